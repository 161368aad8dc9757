"""Consumer group coordination: membership, generations, rebalances and offset-commit checks.

Sans-IO state logic in the spirit of Kafka's GroupCoordinator: no Ray, no
I/O, no clock of its own. Every method takes ``now_ms`` (the controller's
clock; any monotonic millisecond clock works, since no absolute time is
persisted) and returns values. The controller actor owns one
:class:`GroupCoordinator`, forwards each consumer RPC to it, calls
:meth:`GroupCoordinator.tick` from its control loop, calls
:meth:`GroupCoordinator.metadata_changed` whenever topics are created,
deleted or grow, and persists :meth:`GroupCoordinator.to_json` when
:attr:`GroupCoordinator.state_version` moves.

This class is not thread-safe; the controller serialises calls.

Why joins return JoinPending
----------------------------
Kafka's JoinGroup is a long poll held open on a connection. This class has
no connections and no clock, so a join returns either :class:`JoinResult`
(the generation is formed: here is your assignment) or :class:`JoinPending`
(call ``join`` again after ``retry_backoff_ms``). The controller holds a
member's join call open and re-runs ``join`` when :meth:`GroupCoordinator.fingerprint`
changes, and it holds heartbeats open the same way (long polls), so neither
side polls on a timer; calls a held request re-runs pass ``keep_alive=False``
(a waiting request shows the member alive only when it arrived). The
coordinator computes the assignment of logbus's own consumers itself with the
group's strategy (see :mod:`logbus.protocol.assignors`) as soon as every
member has rejoined, so they have no group leader and no separate SyncGroup
round: ``sync`` only re-fetches an assignment whose join response was lost.
Groups of Kafka clients (through the gateway) follow Kafka's classic
protocol instead: see "Kafka's classic protocol" below. Normal flow results
are values; errors are for calls that cannot succeed as sent.

What a consumer does
--------------------
::

    member_id, owned = "", set()
    join loop:
        r = join(group_id, member_id=member_id, group_instance_id=..., topics=... or pattern=...,
                 owned=owned if cooperative else (), protocols=(...), timeouts..., now_ms=...)
        member_id = r.member_id
        JoinPending -> wait r.retry_backoff_ms, join again
        JoinResult  -> commit and stop fetching r.revoke (cooperative only), owned = r.assignment,
                       generation = r.generation; if r.revoke: join again at once (phase two)
    every heartbeat interval (a third of the session timeout, say):
        h = heartbeat(group_id, member_id, generation, poll_idle_ms=<ms since last poll()>, now_ms=...)
        h.revoke -> commit and revoke those partitions; h.rejoin -> join loop
                    (an eager consumer revokes everything before it joins)
    commit_offsets(group_id, member_id, generation, {tp: OffsetAndMetadata(...)}, now_ms=...)
        -> records to append to __consumer_offsets
    leave(group_id, member_id, now_ms=...) on close (static members usually just stop)
    UnknownMemberIdError anywhere -> drop all partitions, member_id = "", join loop

A consumer is cooperative only if every strategy it lists is (Kafka's rule);
an eager consumer revokes all its partitions before each join and reports
``owned=()``. A consumer must also stop fetching on its own when it has not
polled within ``max_poll_interval_ms``: the coordinator may reassign its
partitions as soon as it notices.

Group states (Kafka's)
----------------------
============================  ===============================================================
Empty                         no members (offsets may still be committed with generation -1)
PreparingRebalance            waiting for every member to rejoin (or the rebalance timeout)
CompletingRebalance           generation formed; waiting for every member to collect its
                              assignment (or the rebalance timeout)
Stable                        every member has its assignment
Dead                          deleted; the group is removed from the coordinator
============================  ===============================================================

Transitions (:data:`VALID_PREVIOUS_STATES`)::

    Empty ──first join──▶ PreparingRebalance ──all rejoined──▶ CompletingRebalance ──all collected──▶ Stable
      ▲                      │   ▲  ▲                               │                                  │
      └──no members left─────┘   │  └──join/leave/expiry/metadata───┘                                  │
                                 └───────────────────join/leave/expiry/metadata change─────────────────┘
    Empty ──delete_group──▶ Dead

The generation grows by one each time a rebalance completes, including when
it completes with no members (the group becomes Empty).

Ownership (the invariant)
-------------------------
For each member the coordinator keeps ``owned``: the partitions the member
may still hold. It grows by the member's assignment when a generation forms
and shrinks when the member's join reports it no longer holds a partition
(``owned &= reported``; reports of partitions it was never given are
ignored). So ``owned`` always contains what the member really holds.
Members' ``owned`` sets are disjoint, and a generation never assigns a member
a partition in another member's ``owned`` set (checked at every formation;
a violation is a bug and raises InvariantViolationError, see ``logbus/invariant.py``). Under an eager strategy every
member has revoked everything by the time the generation forms, so ``owned``
is cleared first. Under cooperative-sticky a moving partition is withheld
(assigned to nobody) until its owner's next join no longer reports it; that
join starts the follow-up rebalance that assigns it (KIP-429's two phases).

Kafka's classic protocol
------------------------
Members that join through the Kafka gateway pass ``protocol_metadata``
(one opaque blob per protocol they list) and a ``protocol_type``; they are
*Kafka members*. A generation whose members are all Kafka members is
formed as Kafka's coordinator forms one, whatever the protocols are called
and whatever their metadata holds:

- the group's protocol is one every member lists (the one most members
  prefer); a member whose protocol type differs, or that lists none of
  the members' common protocols, is refused (InconsistentGroupProtocolError);
- a leader is elected: the leader before, if it rejoined, else the member
  that joined first; its join result lists every member's id, group
  instance id and metadata for the chosen protocol; the others get none;
- the leader's ``sync`` brings every member's assignment (bytes the
  coordinator does not interpret; the gateway passes the partitions they
  name, where it can read them, for descriptions and lag); the group is
  then Stable and each member's ``sync`` returns exactly the bytes the
  leader gave it (a follower's sync before the leader's is SyncPending);
- in a Stable group a member whose metadata changed, or the leader, that
  rejoins starts a rebalance (cooperative members revoke, then rejoin with
  metadata that no longer lists what they revoked: Kafka's cooperative
  protocol is the clients'); any other rejoin gets the current generation;
- a static member (KIP-345) that restarts into a Stable group whose
  protocol stays the chosen one takes its place with its assignment, no
  rebalance, and is told the leader as it was (so a restarted leader does
  not assign again); its old member id is fenced (FencedInstanceIdError
  where the call names the instance);
- the rebalance timeout bounds both the rejoin (members that have not
  rejoined are removed when it passes) and the sync (members that have not
  sent SyncGroup, the leader included, are removed when it passes after
  the generation formed); the topics' changes do not rebalance the group
  (its leader watches them, as with Kafka).

The mixed-group rule: logbus's own consumers have no assignor of their own
(they never lead), so a generation with any logbus member is assigned by the
coordinator with the chosen strategy, which is then necessarily one logbus
has (logbus's members list only those), and its Kafka members are told a
leader that is none of them, so they send an empty SyncGroup and get the
coordinator's assignment. A Kafka member can join such a group only if it
lists one of logbus's strategies among its own (as its client's defaults
usually do); once the last logbus member leaves, the next generation is
the classic protocol again. Which rule forms a generation is decided when
it forms.

Static membership (KIP-345)
---------------------------
A member with a ``group_instance_id`` that joins with an empty member id
while its instance is still a member (its session has not expired) takes the
instance's place with no rebalance: same generation, same assignment. As in
Kafka it gets a fresh member id, and the old member id is fenced (its calls
raise UnknownMemberIdError), so a zombie process with the same instance id
cannot keep fetching and committing as if it were the member. If its
subscription changed, the group rebalances.

Timeouts (checked lazily on every call for that group, and for all groups by ``tick``)
----------------------------------------------------------------------------------------
- session: a member with no join/sync/heartbeat/commit for more than
  ``session_timeout_ms`` is removed; the group rebalances.
- poll: heartbeats carry ``poll_idle_ms`` (the consumer's own measure of the
  time since its last poll, so clocks need not agree); a heartbeat reporting
  more than ``max_poll_interval_ms`` removes the member. Only a report can show
  it (between heartbeats the consumer may have polled), so this is checked when
  a heartbeat arrives, not by ``tick``; a consumer that stops heartbeating too
  is caught by its session timeout.
- rebalance: members that have not rejoined ``max(rebalance_timeout_ms)``
  after a rebalance starts are removed and the generation forms without them;
  members that have not collected their assignment within the same time
  after it forms are removed too (Kafka's pending-sync timeout).

Persistence
-----------
:meth:`GroupCoordinator.to_dict` holds groups, members, subscriptions,
generations, assignments and ``owned`` sets, but no timers: on load
(:meth:`GroupCoordinator.from_dict`) every member starts a fresh session at
``now_ms``, as Kafka does when a coordinator takes over a group. Committed
offsets are not kept here; :func:`encode_offset_commit` builds the records
for the internal topic ``__consumer_offsets`` (format below).
"""

from __future__ import annotations

import base64
import enum
import json
import re
import struct
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from logbus.errors import (
    CorruptRecordError,
    FencedInstanceIdError,
    GroupNotEmptyError,
    IllegalGenerationError,
    IllegalStateError,
    InconsistentGroupProtocolError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidRecordError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from logbus.protocol.field_reader import FieldReader
from logbus.protocol.assignors import (
    ASSIGN_PARTITIONS_MAX,
    RebalanceProtocol,
    Subscription,
    get_assignor,
)
from logbus.invariant import check as _check
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import INTERNAL_TOPIC_PREFIX, validate_partition, validate_topic_name

# --- limits ------------------------------------------------------------------------------------

GROUP_ID_LENGTH_MAX = 255  # as a file-name component and a record key it must stay small
NAME_LENGTH_MAX = 255  # client ids, group instance ids, member ids
GROUP_SIZE_MAX = 1_000  # Kafka's group.max.size is unbounded by default; an assignment is O(members^2)
GROUPS_MAX = 10_000  # every group lives in the controller's memory and its persisted metadata
PROTOCOLS_MAX = 8  # strategies one member may list
SUBSCRIPTION_TOPICS_MAX = 10_000
COMMIT_PARTITIONS_MAX = ASSIGN_PARTITIONS_MAX
# Kafka's group.min/max.session.timeout.ms are 6 s and 30 min; logbus fails over within 2 s, and its
# tests drive short sessions, so the floor is lower.
SESSION_TIMEOUT_MS_MIN = 100
SESSION_TIMEOUT_MS_MAX = 1_800_000
REBALANCE_TIMEOUT_MS_MAX = 3_600_000  # also bounds max_poll_interval_ms
OFFSET_METADATA_BYTES_MAX = 4_096  # Kafka's offset.metadata.max.bytes
REMOVALS_KEPT_MAX = 10_000  # removal events kept for tick() between two ticks
# A Kafka member's protocol metadata (all its protocols together) and the assignment its leader gives
# it: opaque bytes the coordinator relays, kept in the controller's memory and persisted with the
# group (groups.json is rewritten whole), so bounded. Kafka bounds them by its request size only.
PROTOCOL_METADATA_BYTES_MAX = 1 << 20
ASSIGNMENT_BYTES_MAX = 1 << 20
CONSUMER_PROTOCOL_TYPE = "consumer"  # Kafka's protocol type of consumer groups; logbus's members are consumers

# Defaults: Kafka's consumer defaults (session.timeout.ms 45 s since 3.0, max.poll.interval.ms 5 min,
# which the Java consumer also sends as its rebalance timeout).
DEFAULT_SESSION_TIMEOUT_MS = 45_000
DEFAULT_REBALANCE_TIMEOUT_MS = 300_000
DEFAULT_MAX_POLL_INTERVAL_MS = 300_000
DEFAULT_JOIN_RETRY_BACKOFF_MS = 100
DEFAULT_CLIENT_ID = "consumer"

STATE_VERSION = 1  # of to_dict()

# --- states ------------------------------------------------------------------------------------


class GroupState(str, enum.Enum):
    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


_S = GroupState
VALID_PREVIOUS_STATES: dict[GroupState, frozenset[GroupState]] = {
    _S.EMPTY: frozenset({_S.PREPARING_REBALANCE}),
    _S.PREPARING_REBALANCE: frozenset({_S.EMPTY, _S.COMPLETING_REBALANCE, _S.STABLE}),
    _S.COMPLETING_REBALANCE: frozenset({_S.PREPARING_REBALANCE}),
    _S.STABLE: frozenset({_S.COMPLETING_REBALANCE}),
    _S.DEAD: frozenset({_S.EMPTY, _S.PREPARING_REBALANCE, _S.COMPLETING_REBALANCE, _S.STABLE, _S.DEAD}),
}

# Why a member was removed (MemberRemoved.reason).
REASON_LEFT = "left the group"
REASON_SESSION_TIMEOUT = "session timeout"
REASON_MAX_POLL_INTERVAL = "max poll interval exceeded"
REASON_REBALANCE_TIMEOUT = "rebalance timeout"
REASON_FENCED = "replaced by a new instance with the same group instance id"

# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JoinPending:
    """The rebalance has not completed: call ``join`` again with ``member_id`` after ``retry_backoff_ms``."""

    member_id: str
    retry_backoff_ms: int


@dataclass(frozen=True, slots=True)
class JoinResult:
    """The member's place in a formed generation.

    ``revoke``: partitions the member holds but must give up (commit, stop
    fetching), then join again at once. Always empty under eager strategies,
    whose members revoke everything before they join.

    In a generation of Kafka's classic protocol (see "Kafka's classic
    protocol" in the module docstring), ``leader`` is the member that
    assigns, ``members`` (given to the leader only) every member's id,
    group instance id and metadata for the chosen protocol, and
    ``assignment_bytes`` (from ``sync``) what the leader gave this member,
    as it gave it. ``leader`` is None when the coordinator assigns.
    """

    member_id: str
    generation: int
    protocol: str  # the group's assignment strategy for this generation
    assignment: tuple[TopicPartition, ...]
    revoke: tuple[TopicPartition, ...] = ()
    leader: str | None = None
    members: tuple[tuple[str, str | None, bytes], ...] = ()
    protocol_type: str = CONSUMER_PROTOCOL_TYPE
    assignment_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class SyncPending:
    """A follower's SyncGroup in a classic generation whose leader has not sent the assignment yet: call
    ``sync`` again (the controller holds the call until the group changes)."""

    member_id: str


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """``rejoin``: call join (a rebalance is under way, or the member must collect a new generation).

    ``revoke``: partitions to give up now (cooperative-sticky's first phase);
    after revoking them, join again.
    """

    rejoin: bool
    revoke: tuple[TopicPartition, ...] = ()
    # Set by the controller on a long-polled heartbeat: how long the call was held, and whether a
    # change of the group ended the wait (rather than its running out, or no wait at all).
    waited_ms: int = 0
    woken: bool = False


def long_poll_wait_ms(requested_ms: int, session_timeout_ms: int, cap_ms: int) -> int:
    """How long the coordinator may hold a member's heartbeat when the group has nothing for it.

    A held heartbeat shows the member alive only when it arrived, so the wait
    stays within half the session timeout: the next heartbeat then has the
    other half to arrive (a consumer whose heartbeat interval is not below
    its session timeout would otherwise expire while it waits). Never
    negative, never above ``cap_ms``.
    """
    return max(0, min(int(requested_ms), int(session_timeout_ms) // 2, int(cap_ms)))


class MemberRemoved(NamedTuple):
    group_id: str
    member_id: str
    group_instance_id: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class MemberDescription:
    member_id: str
    group_instance_id: str | None
    client_id: str
    topics: tuple[str, ...]  # explicit subscription
    pattern: str | None  # pattern subscription (full match), if any
    assignment: tuple[TopicPartition, ...]
    pending_revocation: tuple[TopicPartition, ...]  # held beyond the assignment, not yet confirmed revoked
    kafka: bool = False  # a member of Kafka's classic protocol (through the gateway)
    metadata: bytes | None = None  # a Kafka member's metadata for the group's protocol
    assignment_bytes: bytes | None = None  # what its leader gave it (classic generations)


@dataclass(frozen=True, slots=True)
class GroupDescription:
    group_id: str
    state: GroupState
    protocol: str | None
    generation: int
    members: tuple[MemberDescription, ...]
    protocol_type: str | None = None
    leader: str | None = None  # the assigning member of a classic generation (None: the coordinator assigns)


class GroupListing(NamedTuple):
    group_id: str
    state: GroupState
    protocol: str | None


class OffsetAndMetadata(NamedTuple):
    """A committed position: the next offset to consume, with optional client metadata."""

    offset: int
    metadata: str = ""
    leader_epoch: int = -1  # the leader epoch of the last consumed record, -1 if unknown


# --- validation --------------------------------------------------------------------------------


def validate_group_id(group_id: object) -> str:
    """Return ``group_id`` if legal: a printable str of 1 to 255 characters; else raise InvalidGroupIdError."""
    if not isinstance(group_id, str):
        raise InvalidGroupIdError(f"group id must be a str, not {type(group_id).__name__}")
    if not group_id:
        raise InvalidGroupIdError("group id must not be empty")
    if len(group_id) > GROUP_ID_LENGTH_MAX:
        raise InvalidGroupIdError(f"group id is {len(group_id)} characters; the limit is {GROUP_ID_LENGTH_MAX}")
    if not group_id.isprintable():
        raise InvalidGroupIdError(f"group id {group_id!r} has non-printable characters")
    return group_id


def _check_name(what: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise InvalidConfigError(f"{what} must be a non-empty str, not {value!r}")
    if len(value) > NAME_LENGTH_MAX or not value.isprintable():
        raise InvalidConfigError(f"{what} must be printable and at most {NAME_LENGTH_MAX} characters, not {value!r}")
    return value


def _check_ms(what: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidConfigError(f"{what} must be an int in [{low}, {high}], not {value!r}")
    return value


def _check_now(now_ms: object) -> int:
    if isinstance(now_ms, bool) or not isinstance(now_ms, int):
        raise TypeError(f"now_ms must be an int, not {now_ms!r}")
    return now_ms


def _check_generation(generation: object) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise IllegalGenerationError(f"generation must be an int, not {generation!r}")
    return generation


def _to_partition(tp: object) -> TopicPartition:
    if not isinstance(tp, (tuple, list)) or len(tp) != 2:
        raise InvalidConfigError(f"a partition must be a (topic, partition) pair, not {tp!r}")
    return TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))


# --- state -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Member:
    member_id: str
    group_instance_id: str | None
    client_id: str
    topics: tuple[str, ...]
    pattern: str | None
    protocols: tuple[str, ...]
    session_timeout_ms: int
    rebalance_timeout_ms: int
    max_poll_interval_ms: int
    generation: int = -1  # the generation `assignment` belongs to
    assignment: tuple[TopicPartition, ...] = ()
    owned: set[TopicPartition] = field(default_factory=set)  # may still hold (see module docstring)
    rejoined: bool = False  # has joined the rebalance in progress
    collected: bool = False  # has received its assignment of the current generation
    # Kafka's classic protocol (members that joined through the gateway).
    kafka: bool = False  # may lead; receives its leader's assignment as the leader wrote it
    protocol_type: str = CONSUMER_PROTOCOL_TYPE
    metadata: tuple[bytes, ...] = ()  # per protocol, in `protocols` order (Kafka members only)
    assignment_bytes: bytes | None = None  # what the leader gave it in this generation
    synced: bool = False  # sent its SyncGroup for this generation (Kafka's pending-sync set)
    # A KIP-848 member (ConsumerGroupHeartbeat): its generation is an epoch it learns on its next heartbeat.
    epochs: bool = False
    # Not persisted; a loaded coordinator restarts the session at its load time.
    last_heartbeat_ms: int = 0

    def metadata_for(self, protocol: str | None) -> bytes | None:
        """This Kafka member's metadata for ``protocol`` (None for logbus members, or a protocol it lacks)."""
        if not self.kafka or protocol not in self.protocols:
            return None
        return self.metadata[self.protocols.index(protocol)]

    def to_dict(self) -> dict:
        return {
            "member_id": self.member_id,
            "group_instance_id": self.group_instance_id,
            "client_id": self.client_id,
            "topics": list(self.topics),
            "pattern": self.pattern,
            "protocols": list(self.protocols),
            "session_timeout_ms": self.session_timeout_ms,
            "rebalance_timeout_ms": self.rebalance_timeout_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "generation": self.generation,
            "assignment": [list(tp) for tp in self.assignment],
            "owned": [list(tp) for tp in sorted(self.owned)],
            "rejoined": self.rejoined,
            "collected": self.collected,
            "kafka": self.kafka,
            "protocol_type": self.protocol_type,
            "metadata": [_b64(m) for m in self.metadata],
            "assignment_bytes": None if self.assignment_bytes is None else _b64(self.assignment_bytes),
            "synced": self.synced,
            "epochs": self.epochs,
        }

    @classmethod
    def from_dict(cls, raw: dict, now_ms: int) -> "_Member":
        return cls(
            member_id=raw["member_id"],
            group_instance_id=raw["group_instance_id"],
            client_id=raw["client_id"],
            topics=tuple(raw["topics"]),
            pattern=raw["pattern"],
            protocols=tuple(raw["protocols"]),
            session_timeout_ms=raw["session_timeout_ms"],
            rebalance_timeout_ms=raw["rebalance_timeout_ms"],
            max_poll_interval_ms=raw["max_poll_interval_ms"],
            generation=raw["generation"],
            assignment=tuple(TopicPartition(t, p) for t, p in raw["assignment"]),
            owned={TopicPartition(t, p) for t, p in raw["owned"]},
            rejoined=raw["rejoined"],
            collected=raw["collected"],
            # Absent from state written before Kafka's classic protocol was served: logbus members.
            kafka=raw.get("kafka", False),
            protocol_type=raw.get("protocol_type", CONSUMER_PROTOCOL_TYPE),
            metadata=tuple(base64.b64decode(m) for m in raw.get("metadata", ())),
            assignment_bytes=None if raw.get("assignment_bytes") is None else base64.b64decode(raw["assignment_bytes"]),
            synced=raw.get("synced", False),
            epochs=raw.get("epochs", False),
            last_heartbeat_ms=now_ms,
        )


@dataclass(slots=True)
class _Group:
    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    protocol: str | None = None  # the strategy of the current generation
    protocol_type: str | None = None  # the members' protocol type (Kafka's; "consumer" for consumer groups)
    leader: str | None = None  # the member that assigns (classic generations); None: the coordinator assigns
    members: dict[str, _Member] = field(default_factory=dict)
    static_members: dict[str, str] = field(default_factory=dict)  # group instance id -> member id
    subscribed_counts: dict[str, int] = field(default_factory=dict)  # what the current assignment was built on
    # Transient (not persisted).
    pending_member_ids: dict[str, int] = field(default_factory=dict)  # issued member id -> expiry (ms)
    rebalance_deadline_ms: int | None = None
    join_not_before_ms: int | None = None  # initial rebalance delay of a group leaving Empty

    def to_dict(self) -> dict:
        return {
            "group_id": self.group_id,
            "state": self.state.value,
            "generation": self.generation,
            "protocol": self.protocol,
            "protocol_type": self.protocol_type,
            "leader": self.leader,
            "subscribed_counts": dict(self.subscribed_counts),
            "members": [member.to_dict() for member in self.members.values()],
        }


@dataclass(frozen=True, slots=True)
class _JoinRequest:
    """A join's validated arguments."""

    group_instance_id: str | None
    client_id: str
    topics: tuple[str, ...]
    pattern: str | None
    owned: frozenset[TopicPartition]
    protocols: tuple[str, ...]
    session_timeout_ms: int
    rebalance_timeout_ms: int
    max_poll_interval_ms: int
    kafka: bool = False
    protocol_type: str = CONSUMER_PROTOCOL_TYPE
    metadata: tuple[bytes, ...] = ()
    epochs: bool = False


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _random_member_id(prefix: str) -> str:
    """Kafka's form: the client id (or group instance id), a dash, a random UUID."""
    return f"{prefix}-{uuid.uuid4()}"


class GroupCoordinator:
    """All consumer groups of one cluster: membership, generations and assignments."""

    def __init__(
        self,
        *,
        topic_partition_counts: Mapping[str, int] | None = None,
        initial_rebalance_delay_ms: int = 0,
        session_timeout_ms_min: int = SESSION_TIMEOUT_MS_MIN,
        session_timeout_ms_max: int = SESSION_TIMEOUT_MS_MAX,
        group_size_max: int = GROUP_SIZE_MAX,
        groups_max: int = GROUPS_MAX,
        join_retry_backoff_ms: int = DEFAULT_JOIN_RETRY_BACKOFF_MS,
        new_member_id: Callable[[str], str] = _random_member_id,
        stall_ms: int | None = None,
    ) -> None:
        """
        Args:
            topic_partition_counts: topic -> partition count of every existing topic.
            initial_rebalance_delay_ms: how long a group leaving Empty waits for more members
                before forming its first generation (Kafka's group.initial.rebalance.delay.ms).
            new_member_id: builds a member id from a client id or group instance id; ids must
                be unique for the life of the cluster (the default appends a UUID).
            stall_ms: for a caller that calls :meth:`tick` more often than this while any group
                has members: a longer gap between two calls means the caller's process stalled
                (the members' heartbeats may be queued behind it), and the gap is not counted
                against any session, pending member id or rebalance timeout. None: no such
                compensation (every gap counts).
        """
        self._topic_partition_counts: dict[str, int] = _checked_counts(topic_partition_counts or {})
        self._initial_rebalance_delay_ms = _check_ms("initial_rebalance_delay_ms", initial_rebalance_delay_ms, 0, REBALANCE_TIMEOUT_MS_MAX)
        self._session_timeout_ms_min = session_timeout_ms_min
        self._session_timeout_ms_max = session_timeout_ms_max
        self._group_size_max = group_size_max
        self._groups_max = groups_max
        self._join_retry_backoff_ms = join_retry_backoff_ms
        self._new_member_id = new_member_id
        self._groups: dict[str, _Group] = {}
        self._removals: deque[MemberRemoved] = deque(maxlen=REMOVALS_KEPT_MAX)
        self._state_version = 0
        self._stall_ms = None if stall_ms is None else _check_ms("stall_ms", stall_ms, 1, REBALANCE_TIMEOUT_MS_MAX)
        self._last_now_ms: int | None = None  # the latest ``now_ms`` any call brought

    @property
    def state_version(self) -> int:
        """Grows whenever persisted state changes: persist :meth:`to_json` when it moved."""
        return self._state_version

    # --- membership ------------------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        *,
        member_id: str = "",
        group_instance_id: str | None = None,
        client_id: str = DEFAULT_CLIENT_ID,
        topics: Iterable[str] = (),
        pattern: str | None = None,
        owned: Iterable[tuple[str, int]] = (),
        protocols: Iterable[str] | str = ("range",),
        session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
        rebalance_timeout_ms: int = DEFAULT_REBALANCE_TIMEOUT_MS,
        max_poll_interval_ms: int = DEFAULT_MAX_POLL_INTERVAL_MS,
        protocol_type: str = CONSUMER_PROTOCOL_TYPE,
        protocol_metadata: Iterable[bytes] | None = None,
        new_member_id: str | None = None,
        member_epochs: bool = False,
        now_ms: int,
        keep_alive: bool = True,
    ) -> JoinResult | JoinPending:
        """Join or rejoin ``group_id``; poll it until it returns a :class:`JoinResult`.

        Args:
            member_id: "" on the first join, then the id the coordinator returned. A dynamic
                member's first join only hands out the id (JoinPending with no backoff); a static
                member's first join joins at once.
            group_instance_id: makes the member static (KIP-345).
            topics, pattern: the subscription: explicit topics, and/or a regular expression that
                topic names must match in full (internal ``__`` topics are never matched).
            owned: partitions the member holds now (cooperative consumers); eager ones pass ().
            protocols: assignment strategies the member supports, preferred first. The group
                uses one that every member supports (the one most members prefer).
            keep_alive: False when the controller re-runs a join call it holds open: the
                member's session then still runs from the call's arrival.
            protocol_type, protocol_metadata: a Kafka member's (through the gateway): its
                protocol type, and its metadata for each of ``protocols`` (opaque bytes, relayed
                to its leader). Its protocols may have any names; ``topics`` and ``owned`` are what
                its metadata says, as far as it could be read. None: a logbus member, whose
                protocols are logbus's strategies (see "Kafka's classic protocol").
            new_member_id: the id a first join (``member_id`` "") gives the member, chosen by the
                client (KIP-848's ConsumerGroupHeartbeat v1): it joins at once, with no KIP-394
                round to hand out an id. None: the coordinator makes one.
            member_epochs: a KIP-848 member, which learns the group's generation (its epoch) only
                on its next heartbeat: its commits with an older generation are taken for the
                partitions it still holds (see ``commit_offsets``).

        Raises:
            InvalidGroupIdError, InvalidConfigError, InvalidTopicError, InvalidPartitionError: bad arguments.
            InconsistentGroupProtocolError: no strategy (or protocol type) in common with the members.
            UnknownMemberIdError: ``member_id`` is not (or no longer) a member: join again with "".
            FencedInstanceIdError: ``member_id`` was replaced by a newer instance with the same
                ``group_instance_id``.
            IllegalStateError: the group or the coordinator is full.
        """
        validate_group_id(group_id)
        now_ms = self._clock(now_ms)
        member_id = _check_name("member_id", member_id, allow_empty=True)
        request = self._join_request(
            group_instance_id, client_id, topics, pattern, owned, protocols,
            session_timeout_ms, rebalance_timeout_ms, max_poll_interval_ms, protocol_type, protocol_metadata,
        )  # fmt: skip
        if member_epochs:
            request = replace(request, epochs=True)
        group = self._groups.get(group_id)
        if group is None:
            if member_id:
                raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r} (no such group)")
            group = self._add_group(group_id)
        self._expire(group, now_ms)

        if member_id == "":
            instance_id = request.group_instance_id
            if new_member_id is not None:
                new_member_id = _check_name("new_member_id", new_member_id)
                if new_member_id in group.members or new_member_id in group.pending_member_ids:
                    raise UnknownMemberIdError(f"member id {new_member_id!r} is taken in group {group_id!r}")
                if instance_id is not None and instance_id in group.static_members:
                    return self._replace_static_member(group, group.static_members[instance_id], request, now_ms, new_member_id)
                self._check_room(group, extra=1)
                self._check_protocols(group, request, excluding=None)
                return self._add_member(group, self._new_member(new_member_id, request, now_ms), now_ms)
            if instance_id is None:
                # KIP-394: hand out an id first and count the member only when it joins with it, so a
                # lost response leaves no phantom member for the rebalance to wait for.
                self._check_room(group, extra=1)
                self._check_protocols(group, request, excluding=None)
                new_id = self._new_member_id(request.client_id)
                group.pending_member_ids[new_id] = now_ms + request.session_timeout_ms
                return JoinPending(new_id, retry_backoff_ms=0)
            if instance_id in group.static_members:
                return self._replace_static_member(group, group.static_members[instance_id], request, now_ms)
            self._check_room(group, extra=1)
            self._check_protocols(group, request, excluding=None)
            member = self._new_member(self._new_member_id(instance_id), request, now_ms)
            return self._add_member(group, member, now_ms)

        if member_id in group.pending_member_ids:
            if request.group_instance_id is not None:
                raise UnknownMemberIdError(f"member id {member_id!r} was issued to a dynamic member; static members join with ''")
            self._check_protocols(group, request, excluding=None)
            del group.pending_member_ids[member_id]
            self._check_room(group, extra=1)
            return self._add_member(group, self._new_member(member_id, request, now_ms), now_ms)

        self._check_fenced(group, member_id, request.group_instance_id)
        member = self._member(group, member_id)
        if member.group_instance_id != request.group_instance_id:
            raise UnknownMemberIdError(
                f"member {member_id!r} has group instance id {member.group_instance_id!r}, not {request.group_instance_id!r}"
            )
        self._check_protocols(group, request, excluding=member_id)
        return self._rejoin(group, member, request, now_ms, keep_alive)

    def sync(
        self,
        group_id: str,
        member_id: str,
        generation: int,
        *,
        assignments: Mapping[str, tuple[bytes, Iterable[tuple[str, int]]]] | None = None,
        group_instance_id: str | None = None,
        protocol_type: str | None = None,
        protocol_name: str | None = None,
        now_ms: int,
        keep_alive: bool = True,
    ) -> JoinResult | SyncPending:
        """SyncGroup: the member's assignment of ``generation``.

        When the coordinator assigns, this only fetches the assignment again
        (after a lost join response). In a classic generation the leader's
        sync brings ``assignments`` (member id -> (the bytes to hand over,
        the partitions they name as far as they could be read)); it makes
        the group Stable, and every member's sync then returns what the
        leader gave it. A follower's sync before the leader's returns
        SyncPending (call again; ``keep_alive`` False for a call the controller
        re-runs while it holds it). ``protocol_type`` and ``protocol_name``,
        where the member sends them, must be the group's.

        Raises:
            UnknownMemberIdError: not a member. FencedInstanceIdError: fenced (see ``join``).
            RebalanceInProgressError: a rebalance is under way: join again.
            IllegalGenerationError: ``generation`` is not the current one.
            InconsistentGroupProtocolError: another protocol type or name than the group's.
            InvalidConfigError: an assignment over ASSIGNMENT_BYTES_MAX.
        """
        validate_group_id(group_id)
        now_ms = self._clock(now_ms)
        generation = _check_generation(generation)
        group = self._existing_group(group_id, member_id)
        self._expire(group, now_ms)
        self._check_fenced(group, member_id, group_instance_id)
        member = self._member(group, member_id)
        if keep_alive:
            member.last_heartbeat_ms = now_ms
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgressError(f"group {group_id!r} is rebalancing; join again")
        if generation != group.generation:
            raise IllegalGenerationError(f"generation {generation} is not group {group_id!r}'s current {group.generation}")
        if protocol_type is not None and protocol_type != group.protocol_type:
            raise InconsistentGroupProtocolError(f"group {group_id!r} has protocol type {group.protocol_type!r}, not {protocol_type!r}")
        if protocol_name is not None and protocol_name != group.protocol:
            raise InconsistentGroupProtocolError(f"group {group_id!r} uses protocol {group.protocol!r}, not {protocol_name!r}")
        if not member.synced:
            member.synced = True
            self._state_version += 1
        if group.leader is None:
            return self._collect(group, member)
        if group.state is GroupState.COMPLETING_REBALANCE:
            if member_id != group.leader:
                self._maybe_end_sync_deadline(group)
                return SyncPending(member_id)
            self._apply_assignments(group, assignments or {})
        if not member.collected:
            member.collected = True
            self._state_version += 1
        self._maybe_end_sync_deadline(group)
        return self._classic_result(group, member, group.leader)

    def fingerprint(self, group_id: str) -> tuple:
        """What members waiting on a group (long-polled heartbeats and joins) wait to see change:
        its state, generation and members. Equal fingerprints mean nothing for them to act on."""
        group = self._groups.get(group_id)
        if group is None:
            return ()
        return (group.state, group.generation, tuple(group.members))

    def group_ids(self) -> list[str]:
        return list(self._groups)

    def member_view(self, group_id: str, member_id: str) -> tuple | None:
        """(topics, pattern, owned partitions, generation, group generation) of a member, or None if it is none."""
        group = self._groups.get(group_id)
        member = None if group is None else group.members.get(member_id)
        if member is None:
            return None
        return member.topics, member.pattern, tuple(sorted(member.owned)), member.generation, group.generation

    def session_timeout_ms(self, group_id: str, member_id: str) -> int | None:
        """The member's session timeout, or None if it is not a member."""
        group = self._groups.get(group_id)
        member = None if group is None else group.members.get(member_id)
        return None if member is None else member.session_timeout_ms

    def heartbeat(
        self, group_id: str, member_id: str, generation: int, *, poll_idle_ms: int, now_ms: int, keep_alive: bool = True,
        group_instance_id: str | None = None,
    ) -> HeartbeatResult:
        """Keep the member's session alive; say whether it must rejoin or revoke partitions.

        Args:
            generation: the generation of the member's current assignment (-1 if none yet).
            poll_idle_ms: milliseconds since the consumer's last poll, on its own clock.
            keep_alive: False to ask again, for a heartbeat the controller holds open, what the
                member must do, without counting it as a new heartbeat: a held call shows the
                member alive only when it arrived (the member may have died since).

        Raises:
            UnknownMemberIdError: not a member (removed, fenced, or exceeded ``max_poll_interval_ms``
                just now): drop all partitions and join with member id "".
            IllegalGenerationError: ``generation`` is newer than the group's (a Kafka member's: any
                other than the group's, outside a rebalance, as Kafka answers).
            FencedInstanceIdError: fenced (see ``join``).
        """
        validate_group_id(group_id)
        now_ms = self._clock(now_ms)
        generation = _check_generation(generation)
        poll_idle_ms = _check_ms("poll_idle_ms", poll_idle_ms, 0, 2**62)
        group = self._existing_group(group_id, member_id)
        self._expire(group, now_ms)
        self._check_fenced(group, member_id, group_instance_id)
        member = self._member(group, member_id)
        if keep_alive:
            member.last_heartbeat_ms = now_ms
        if poll_idle_ms > member.max_poll_interval_ms:
            self._remove_members(group, [member_id], REASON_MAX_POLL_INTERVAL, now_ms)
            raise UnknownMemberIdError(
                f"member {member_id!r} did not poll for {poll_idle_ms} ms (max.poll.interval.ms {member.max_poll_interval_ms}); it was removed"
            )
        if generation > group.generation:
            raise IllegalGenerationError(f"generation {generation} is newer than group {group_id!r}'s {group.generation}")
        if group.state is GroupState.PREPARING_REBALANCE:
            return HeartbeatResult(rejoin=True, revoke=self._pending_revocation(member))
        if generation != group.generation:
            if member.kafka:
                raise IllegalGenerationError(f"generation {generation} is not group {group_id!r}'s current {group.generation}")
            return HeartbeatResult(rejoin=True)  # a new generation is formed: join to collect it
        if group.leader is not None:
            return HeartbeatResult(rejoin=False)  # a classic generation: the assignment comes with SyncGroup
        self._collect(group, member)  # knowing the generation means the member has its assignment
        revoke = self._pending_revocation(member)
        return HeartbeatResult(rejoin=bool(revoke), revoke=revoke)

    def leave(self, group_id: str, member_id: str, *, now_ms: int, group_instance_id: str | None = None) -> bool:
        """Remove a member at once (the group rebalances); False if it was not a member (idempotent).

        With ``group_instance_id`` (Kafka's LeaveGroup v3+), the static member of that instance
        leaves; ``member_id`` may then be "" (any member of the instance), else it must be the
        instance's current member (FencedInstanceIdError otherwise).
        """
        validate_group_id(group_id)
        now_ms = self._clock(now_ms)
        group = self._groups.get(group_id)
        if group is None:
            return False
        self._expire(group, now_ms)
        if group_instance_id is not None:
            current = group.static_members.get(group_instance_id)
            if current is None:
                return False
            if member_id and member_id != current:
                raise FencedInstanceIdError(f"member {member_id!r} is not group instance {group_instance_id!r}'s current member")
            member_id = current
        if member_id not in group.members:
            return False
        self._remove_members(group, [member_id], REASON_LEFT, now_ms)
        return True

    def tick(self, now_ms: int) -> list[MemberRemoved]:
        """Expire sessions, poll intervals and rebalance timeouts in every group.

        Returns every member removal since the previous tick (including removals
        that other calls made), for the controller to log.
        """
        now_ms = self._clock(now_ms)
        for group in list(self._groups.values()):
            self._expire(group, now_ms)
        removals = list(self._removals)
        self._removals.clear()
        return removals

    def metadata_changed(self, topic_partition_counts: Mapping[str, int], *, now_ms: int) -> list[str]:
        """Take the cluster's topics (topic -> partition count); rebalance groups whose subscribed topics changed.

        A group rebalances when a topic it subscribes to (explicitly or by
        pattern) appears, disappears or changes its partition count. Returns
        the ids of the groups that started a rebalance.
        """
        now_ms = self._clock(now_ms)
        self._topic_partition_counts = _checked_counts(topic_partition_counts)
        started = []
        for group in list(self._groups.values()):
            self._expire(group, now_ms)
            # A classic group's leader watches its topics itself (Kafka's coordinator does not).
            if group.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE) and group.leader is None:
                if self._subscribed_counts(group) != group.subscribed_counts:
                    self._prepare_rebalance(group, now_ms)
                    started.append(group.group_id)
        return started

    # --- offsets ---------------------------------------------------------------------------------

    def commit_offsets(
        self,
        group_id: str,
        member_id: str,
        generation: int,
        offsets: Mapping[tuple[str, int], OffsetAndMetadata | int],
        *,
        now_ms: int,
        commit_timestamp_ms: int | None = None,
        expire_timestamp_ms: int | None = None,
        group_instance_id: str | None = None,
    ) -> list[tuple[bytes, bytes]]:
        """Check that the commit may happen; return the records to append to ``__consumer_offsets``.

        A member commits with its current generation. A consumer outside group
        management commits with ``member_id=""`` and ``generation=-1``, which is
        allowed only while the group has no members (the group is created Empty
        if it does not exist). Partitions are not checked against the member's
        assignment (as in Kafka: a cooperative member commits what it revokes).
        A KIP-848 member (``join(member_epochs=True)``) may also commit with an
        older generation than the group's, for partitions it still holds: it
        learns the new one only on its next heartbeat. The records carry ``commit_timestamp_ms`` (wall-clock ms; ``now_ms`` if
        not given) and, if given, ``expire_timestamp_ms`` (see "Records of
        __consumer_offsets").

        Raises:
            UnknownMemberIdError: not a member (or a generation -1 commit while the group has members).
            IllegalGenerationError: the generation is not the group's current one.
            RebalanceInProgressError: the member has not collected the current generation.
            InvalidGroupIdError, InvalidTopicError, InvalidPartitionError, InvalidConfigError, InvalidRecordError: bad arguments.
        """
        validate_group_id(group_id)
        now_ms = self._clock(now_ms)
        generation = _check_generation(generation)
        checked = _checked_offsets(offsets)
        group = self._groups.get(group_id)
        if group is not None:
            self._check_fenced(group, member_id, group_instance_id)
        if generation < 0:
            if group is not None:
                self._expire(group, now_ms)
                if member_id in group.members:
                    raise IllegalGenerationError(f"member {member_id!r} committed with generation {generation}; the group's is {group.generation}")
                if group.members:
                    raise UnknownMemberIdError(f"group {group_id!r} has members; only a member can commit, with its generation")
            if member_id:
                raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r}")
            if group is None:
                self._add_group(group_id)  # an offsets-only group, as in Kafka
        else:
            if group is None:
                raise IllegalGenerationError(f"group {group_id!r} does not exist; generation {generation} is stale")
            self._expire(group, now_ms)
            member = self._member(group, member_id)
            if member.epochs and 0 < generation < group.generation and set(checked) <= member.owned | set(member.assignment):
                # A KIP-848 member commits with the epoch it has until a heartbeat gives it the new
                # one (as Kafka's coordinator takes it for partitions the member still holds).
                pass
            elif generation != group.generation:
                raise IllegalGenerationError(f"generation {generation} is not group {group_id!r}'s current {group.generation}")
            elif group.state is GroupState.COMPLETING_REBALANCE and not member.collected:
                raise RebalanceInProgressError(f"group {group_id!r} is completing a rebalance; join to collect it")
            member.last_heartbeat_ms = now_ms
        stamp_ms = now_ms if commit_timestamp_ms is None else commit_timestamp_ms
        return [encode_offset_commit(group_id, tp, om, stamp_ms, expire_timestamp_ms) for tp, om in checked.items()]

    # --- administration --------------------------------------------------------------------------

    def describe(self, group_id: str) -> GroupDescription:
        """The group's state, strategy, generation and members; an unknown group is described as Dead."""
        validate_group_id(group_id)
        group = self._groups.get(group_id)
        if group is None:
            return GroupDescription(group_id, GroupState.DEAD, None, 0, ())
        members = tuple(
            MemberDescription(
                m.member_id,
                m.group_instance_id,
                m.client_id,
                m.topics,
                m.pattern,
                m.assignment,
                self._pending_revocation(m),
                m.kafka,
                m.metadata_for(group.protocol),
                m.assignment_bytes,
            )
            for m in sorted(group.members.values(), key=lambda m: m.member_id)
        )
        return GroupDescription(group_id, group.state, group.protocol, group.generation, members, group.protocol_type, group.leader)

    def list_groups(self) -> list[GroupListing]:
        return [GroupListing(g.group_id, g.state, g.protocol) for g in sorted(self._groups.values(), key=lambda g: g.group_id)]

    def delete_group(self, group_id: str) -> bool:
        """Forget a group with no members (it becomes Dead); False if it does not exist.

        Raises GroupNotEmptyError if it has members. Deleting its committed
        offsets (tombstones for :func:`offset_commit_key`) is the caller's job.
        """
        validate_group_id(group_id)
        group = self._groups.get(group_id)
        if group is None:
            return False
        if group.members:
            raise GroupNotEmptyError(f"group {group_id!r} has {len(group.members)} member(s)")
        self._transition(group, GroupState.DEAD)
        del self._groups[group_id]
        return True

    # --- persistence -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"version": STATE_VERSION, "groups": [g.to_dict() for g in self._groups.values()]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping, *, now_ms: int, **options) -> "GroupCoordinator":
        """Rebuild a coordinator; every member starts a fresh session (and rebalance timeout) at ``now_ms``.

        ``options`` are the constructor's; timers are not persisted, and neither
        is the topic metadata (pass ``topic_partition_counts`` or call
        :meth:`metadata_changed`). Raises ValueError if ``data`` is not a
        consistent state of this version.
        """
        now_ms = _check_now(now_ms)
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported group coordinator state version {data.get('version')!r}")
        coordinator = cls(**options)
        try:
            for raw in data["groups"]:
                group = _Group(
                    group_id=validate_group_id(raw["group_id"]),
                    state=GroupState(raw["state"]),
                    generation=raw["generation"],
                    protocol=raw["protocol"],
                    protocol_type=raw.get("protocol_type", CONSUMER_PROTOCOL_TYPE if raw["members"] else None),
                    leader=raw.get("leader"),
                    subscribed_counts=dict(raw["subscribed_counts"]),
                )
                for raw_member in raw["members"]:
                    member = _Member.from_dict(raw_member, now_ms)
                    group.members[member.member_id] = member
                    if member.group_instance_id is not None:
                        group.static_members[member.group_instance_id] = member.member_id
                if group.state in (GroupState.PREPARING_REBALANCE, GroupState.COMPLETING_REBALANCE) or (
                    group.leader is not None and not all(m.synced for m in group.members.values())
                ):
                    group.rebalance_deadline_ms = now_ms + _max_rebalance_timeout_ms(group)
                coordinator._check_loaded_group(group)
                coordinator._groups[group.group_id] = group
        except (KeyError, TypeError, InvalidGroupIdError, ValueError) as e:
            raise ValueError(f"corrupt group coordinator state: {e!r}") from e
        return coordinator

    @classmethod
    def from_json(cls, text: str, *, now_ms: int, **options) -> "GroupCoordinator":
        return cls.from_dict(json.loads(text), now_ms=now_ms, **options)

    # --- internals: requests ---------------------------------------------------------------------

    def _join_request(
        self, group_instance_id, client_id, topics, pattern, owned, protocols,
        session_timeout_ms, rebalance_timeout_ms, max_poll_interval_ms, protocol_type=CONSUMER_PROTOCOL_TYPE, protocol_metadata=None,
    ) -> _JoinRequest:  # fmt: skip
        if group_instance_id is not None:
            _check_name("group_instance_id", group_instance_id)
        _check_name("client_id", client_id)
        if isinstance(topics, str):
            raise InvalidConfigError(f"topics must be a collection of topic names, not the str {topics!r}")
        topic_list = tuple(sorted({validate_topic_name(t) for t in topics}))
        if len(topic_list) > SUBSCRIPTION_TOPICS_MAX:
            raise InvalidConfigError(f"{len(topic_list)} subscribed topics exceed the limit of {SUBSCRIPTION_TOPICS_MAX}")
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern:
                raise InvalidConfigError(f"pattern must be a non-empty str or None, not {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise InvalidConfigError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
        kafka = protocol_metadata is not None
        if not topic_list and pattern is None and not kafka:
            raise InvalidConfigError("a member must subscribe to topics, a pattern, or both")
        owned_list = list(owned)
        if len(owned_list) > ASSIGN_PARTITIONS_MAX:
            raise InvalidConfigError(f"{len(owned_list)} owned partitions exceed the limit of {ASSIGN_PARTITIONS_MAX}")
        owned_set = frozenset(_to_partition(tp) for tp in owned_list)
        protocol_list = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        if not protocol_list or len(protocol_list) > PROTOCOLS_MAX or len(set(protocol_list)) != len(protocol_list):
            raise InconsistentGroupProtocolError(f"protocols must list 1 to {PROTOCOLS_MAX} distinct strategies, not {protocols!r}")
        _check_name("protocol_type", protocol_type)
        if kafka:
            # A Kafka member's protocols are its own to name; its metadata is relayed as it is.
            for name in protocol_list:
                _check_name("protocol name", name)
            metadata = tuple(bytes(m) for m in protocol_metadata)
            if len(metadata) != len(protocol_list):
                raise InvalidConfigError(f"{len(metadata)} protocol metadata for {len(protocol_list)} protocols")
            if sum(len(m) for m in metadata) > PROTOCOL_METADATA_BYTES_MAX:
                raise InvalidConfigError(f"protocol metadata of {sum(len(m) for m in metadata)} bytes exceeds {PROTOCOL_METADATA_BYTES_MAX}")
        else:
            if protocol_type != CONSUMER_PROTOCOL_TYPE:
                raise InvalidConfigError(f"logbus's consumers have protocol type {CONSUMER_PROTOCOL_TYPE!r}, not {protocol_type!r}")
            for name in protocol_list:
                get_assignor(name)
            metadata = ()
        session = _check_ms("session_timeout_ms", session_timeout_ms, self._session_timeout_ms_min, self._session_timeout_ms_max)
        rebalance = _check_ms("rebalance_timeout_ms", rebalance_timeout_ms, 1, REBALANCE_TIMEOUT_MS_MAX)
        max_poll = _check_ms("max_poll_interval_ms", max_poll_interval_ms, 1, REBALANCE_TIMEOUT_MS_MAX)
        return _JoinRequest(group_instance_id, client_id, topic_list, pattern, owned_set, protocol_list, session, rebalance, max_poll,
                            kafka, protocol_type, metadata)

    def _add_group(self, group_id: str) -> _Group:
        if len(self._groups) >= self._groups_max:
            raise IllegalStateError(f"the coordinator already has {len(self._groups)} groups (the limit)")
        group = self._groups[group_id] = _Group(group_id)
        self._state_version += 1
        return group

    def _existing_group(self, group_id: str, member_id: str) -> _Group:
        group = self._groups.get(group_id)
        if group is None:
            raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r} (no such group)")
        return group

    def _member(self, group: _Group, member_id: str) -> _Member:
        member = group.members.get(member_id)
        if member is None:
            raise UnknownMemberIdError(f"group {group.group_id!r} has no member {member_id!r}")
        return member

    def _check_room(self, group: _Group, extra: int) -> None:
        if len(group.members) + len(group.pending_member_ids) + extra > self._group_size_max:
            raise IllegalStateError(f"group {group.group_id!r} is full ({self._group_size_max} members)")

    def _check_protocols(self, group: _Group, request: _JoinRequest, excluding: str | None) -> None:
        """Kafka's rule: a member joins a group only with its members' protocol type and a protocol they all have."""
        others = [m for m in group.members.values() if m.member_id != excluding]
        if not others:
            return
        types = {m.protocol_type for m in others}
        if types != {request.protocol_type}:
            raise InconsistentGroupProtocolError(
                f"group {group.group_id!r} has protocol type {sorted(types)}, not {request.protocol_type!r}"
            )
        common = set(request.protocols).intersection(*(m.protocols for m in others))
        if not common:
            raise InconsistentGroupProtocolError(
                f"group {group.group_id!r} has no assignment strategy in common with {list(request.protocols)}"
                f" (its members support {sorted(set().union(*(m.protocols for m in others)))})"
            )

    @staticmethod
    def _check_fenced(group: _Group, member_id: str, group_instance_id: str | None) -> None:
        """Kafka's static-member fence: the instance is now another member."""
        if group_instance_id is None:
            return
        current = group.static_members.get(group_instance_id)
        if current is not None and current != member_id:
            raise FencedInstanceIdError(
                f"member {member_id!r} of group {group.group_id!r} was replaced by {current!r} (group instance id {group_instance_id!r})"
            )

    def _new_member(self, member_id: str, request: _JoinRequest, now_ms: int) -> _Member:
        return _Member(
            member_id=member_id,
            group_instance_id=request.group_instance_id,
            client_id=request.client_id,
            topics=request.topics,
            pattern=request.pattern,
            protocols=request.protocols,
            session_timeout_ms=request.session_timeout_ms,
            rebalance_timeout_ms=request.rebalance_timeout_ms,
            max_poll_interval_ms=request.max_poll_interval_ms,
            kafka=request.kafka,
            protocol_type=request.protocol_type,
            metadata=request.metadata,
            epochs=request.epochs,
            last_heartbeat_ms=now_ms,
        )

    # --- internals: the state machine ------------------------------------------------------------

    def _transition(self, group: _Group, state: GroupState) -> None:
        _check(
            group.state in VALID_PREVIOUS_STATES[state],
            f"group {group.group_id!r}: illegal transition {group.state.value} -> {state.value}",
        )
        group.state = state
        self._state_version += 1

    def _add_member(self, group: _Group, member: _Member, now_ms: int) -> JoinResult | JoinPending:
        group.members[member.member_id] = member
        if member.group_instance_id is not None:
            group.static_members[member.group_instance_id] = member.member_id
        self._state_version += 1
        if group.state is not GroupState.PREPARING_REBALANCE:
            self._prepare_rebalance(group, now_ms)
        member.rejoined = True
        self._maybe_complete_join(group, now_ms)
        return self._join_response(group, member)

    def _update_member(self, member: _Member, request: _JoinRequest, now_ms: int, keep_alive: bool = True) -> bool:
        """Take a join's arguments; return whether the subscription or strategies changed."""
        changed = (member.topics, member.pattern, member.protocols, member.metadata, member.protocol_type) != (
            request.topics, request.pattern, request.protocols, request.metadata, request.protocol_type)
        before = (member.client_id, member.session_timeout_ms, member.rebalance_timeout_ms, member.max_poll_interval_ms)
        member.client_id = request.client_id
        member.topics, member.pattern, member.protocols = request.topics, request.pattern, request.protocols
        member.metadata, member.protocol_type, member.kafka = request.metadata, request.protocol_type, request.kafka
        member.epochs = request.epochs
        member.session_timeout_ms = request.session_timeout_ms
        member.rebalance_timeout_ms = request.rebalance_timeout_ms
        member.max_poll_interval_ms = request.max_poll_interval_ms
        if keep_alive:
            member.last_heartbeat_ms = now_ms
        after = (member.client_id, member.session_timeout_ms, member.rebalance_timeout_ms, member.max_poll_interval_ms)
        if changed or after != before:
            self._state_version += 1  # a repeated join with the same arguments persists nothing new
        return changed

    def _rejoin(self, group: _Group, member: _Member, request: _JoinRequest, now_ms: int, keep_alive: bool = True) -> JoinResult | JoinPending:
        changed = self._update_member(member, request, now_ms, keep_alive)
        released = member.owned - request.owned
        if released:
            member.owned -= released
            self._state_version += 1
        if member.kafka:
            # A Kafka member's report is what it holds: it may hold partitions a classic leader gave it
            # that this coordinator could not count as its own (see _apply_assignments).
            held_by_others = set().union(*(m.owned for m in group.members.values() if m is not member))
            gained = set(request.owned) - member.owned - held_by_others
            if gained:
                member.owned |= gained
                self._state_version += 1
        if group.state is GroupState.PREPARING_REBALANCE:
            if not member.rejoined:
                member.rejoined = True
                self._state_version += 1
            self._maybe_complete_join(group, now_ms)
        elif group.leader is not None:
            # Kafka's rules for a classic generation: a member whose metadata changed, or the leader
            # rejoining a Stable group (it asks for a new assignment), starts a rebalance; any other
            # rejoin gets the current generation again (a lost JoinGroup response).
            if changed or (member.member_id == group.leader and group.state is GroupState.STABLE):
                self._prepare_rebalance(group, now_ms)
                member.rejoined = True
                self._maybe_complete_join(group, now_ms)
        elif changed or released & self._unassigned_partitions(group):
            # A new subscription, or (cooperative phase two) a withheld partition is now free.
            self._prepare_rebalance(group, now_ms)
            member.rejoined = True
            self._maybe_complete_join(group, now_ms)
        return self._join_response(group, member)

    def _replace_static_member(self, group: _Group, old_member_id: str, request: _JoinRequest, now_ms: int,
                               new_member_id: str | None = None) -> JoinResult | JoinPending:
        """A restarted static member takes its instance's place under a new member id; the old id is fenced."""
        self._check_protocols(group, request, excluding=old_member_id)
        leader_before = group.leader
        member = group.members.pop(old_member_id)
        member.member_id = new_member_id if new_member_id is not None else self._new_member_id(request.group_instance_id)
        group.members[member.member_id] = member
        group.static_members[request.group_instance_id] = member.member_id
        if group.leader == old_member_id:
            group.leader = member.member_id
        self._state_version += 1
        self._removals.append(MemberRemoved(group.group_id, old_member_id, member.group_instance_id, REASON_FENCED))
        if group.leader is None or group.state is GroupState.PREPARING_REBALANCE:
            return self._rejoin(group, member, request, now_ms)
        # A classic generation, as Kafka's coordinator treats a static member that restarted: in a
        # Stable group whose protocol stays the one chosen, it takes its place with its assignment and
        # no rebalance, and is told the leader as it was (so a restarted leader does not assign again);
        # otherwise, or while the generation completes, the group rebalances.
        self._update_member(member, request, now_ms)
        if group.state is GroupState.STABLE and _select_protocol(group.members.values()) == group.protocol:
            return self._classic_result(group, member, leader_before, members=False)
        self._prepare_rebalance(group, now_ms)
        member.rejoined = True
        self._maybe_complete_join(group, now_ms)
        return self._join_response(group, member)

    def _prepare_rebalance(self, group: _Group, now_ms: int) -> None:
        from_empty = group.state is GroupState.EMPTY
        self._transition(group, GroupState.PREPARING_REBALANCE)
        for member in group.members.values():
            member.rejoined = False
        group.rebalance_deadline_ms = now_ms + _max_rebalance_timeout_ms(group)
        group.join_not_before_ms = now_ms + self._initial_rebalance_delay_ms if from_empty else None
        self._maybe_complete_join(group, now_ms)  # a group whose last member left completes at once

    def _maybe_complete_join(self, group: _Group, now_ms: int) -> None:
        if group.state is not GroupState.PREPARING_REBALANCE:
            return
        if group.members:
            if now_ms > group.rebalance_deadline_ms:
                stragglers = [m.member_id for m in group.members.values() if not m.rejoined]
                self._remove_members(group, stragglers, REASON_REBALANCE_TIMEOUT, now_ms, rebalance=False)
            elif not all(m.rejoined for m in group.members.values()):
                return
            elif group.join_not_before_ms is not None and now_ms < group.join_not_before_ms:
                return
        self._complete_join(group, now_ms)

    def _complete_join(self, group: _Group, now_ms: int) -> None:
        group.generation += 1
        group.join_not_before_ms = None
        if not group.members:
            self._transition(group, GroupState.EMPTY)
            group.protocol = None
            group.leader = None
            group.subscribed_counts = {}
            group.rebalance_deadline_ms = None
            return
        protocol = _select_protocol(group.members.values())
        group.protocol_type = next(iter(group.members.values())).protocol_type
        if all(m.kafka for m in group.members.values()):
            self._complete_classic_join(group, protocol, now_ms)
            return
        group.leader = None
        assignor = get_assignor(protocol)
        if assignor.protocol is RebalanceProtocol.EAGER:
            for member in group.members.values():
                member.owned = set()  # eager members revoke everything before they rejoin
        effective = {m.member_id: self._effective_topics(m) for m in group.members.values()}
        counts = self._subscribed_counts(group)
        subscriptions = {
            m.member_id: Subscription(frozenset(effective[m.member_id]), tuple(sorted(m.owned)), m.group_instance_id)
            for m in group.members.values()
        }
        assignment = assignor.assign(counts, subscriptions)
        self._check_assignment(group, counts, effective, assignment)
        for member in group.members.values():
            member.assignment = tuple(sorted(assignment[member.member_id]))
            member.generation = group.generation
            member.rejoined = False
            member.collected = False
            member.synced = False
            member.assignment_bytes = None
            member.owned |= set(member.assignment)
        group.protocol = protocol
        group.subscribed_counts = counts
        self._transition(group, GroupState.COMPLETING_REBALANCE)
        group.rebalance_deadline_ms = now_ms + _max_rebalance_timeout_ms(group)

    def _check_assignment(self, group: _Group, counts: dict[str, int], effective: dict[str, set[str]], assignment: Mapping) -> None:
        """The ownership invariant, checked before any member sees the assignment."""
        _check(set(assignment) == set(group.members), f"group {group.group_id!r}: assignment members differ from the group's")
        seen: dict[TopicPartition, str] = {}
        for member_id, partitions in assignment.items():
            for tp in partitions:
                _check(tp not in seen, f"group {group.group_id!r}: {tp} assigned to {seen.get(tp)!r} and {member_id!r}")
                seen[tp] = member_id
                _check(tp.topic in effective[member_id], f"group {group.group_id!r}: {tp} given to {member_id!r}, not subscribed")
                _check(0 <= tp.partition < counts.get(tp.topic, 0), f"group {group.group_id!r}: {tp} does not exist")
        for member in group.members.values():
            for tp in member.owned:
                owner = seen.get(tp)
                _check(
                    owner is None or owner == member.member_id,
                    f"group {group.group_id!r}: {tp} assigned to {owner!r} while {member.member_id!r} still holds it",
                )

    def _collect(self, group: _Group, member: _Member) -> JoinResult:
        """Hand the member its assignment of the current generation; the group is Stable once all have theirs."""
        _check(member.generation == group.generation, f"member {member.member_id!r} is not in generation {group.generation}")
        if not member.collected or not member.owned.issuperset(member.assignment):
            self._state_version += 1
        member.collected = True
        member.owned |= set(member.assignment)
        if group.state is GroupState.COMPLETING_REBALANCE and all(m.collected for m in group.members.values()):
            self._transition(group, GroupState.STABLE)
            group.rebalance_deadline_ms = None
        return JoinResult(member.member_id, group.generation, group.protocol, member.assignment, self._pending_revocation(member))

    def _complete_classic_join(self, group: _Group, protocol: str, now_ms: int) -> None:
        """Form a generation of Kafka's classic protocol: elect a leader (the one before, if it rejoined;
        else the member that joined first), which assigns in its SyncGroup."""
        if group.leader not in group.members:
            group.leader = next(iter(group.members))
        for member in group.members.values():
            member.generation = group.generation
            member.rejoined = False
            member.collected = False
            member.synced = False
            member.assignment = ()
            member.assignment_bytes = None
        group.protocol = protocol
        group.subscribed_counts = self._subscribed_counts(group)
        self._transition(group, GroupState.COMPLETING_REBALANCE)
        group.rebalance_deadline_ms = now_ms + _max_rebalance_timeout_ms(group)

    def _classic_result(self, group: _Group, member: _Member, leader: str | None, members: bool = True) -> JoinResult:
        """A member's place in a classic generation: the leader's id, every member's metadata for the leader
        (unless ``members`` is False), and what the leader assigned it once it has."""
        listed = ()
        if members and member.member_id == leader:
            listed = tuple((m.member_id, m.group_instance_id, m.metadata_for(group.protocol) or b"") for m in group.members.values())
        return JoinResult(member.member_id, group.generation, group.protocol, member.assignment, (), leader, listed,
                          group.protocol_type, member.assignment_bytes)

    def _apply_assignments(self, group: _Group, assignments: Mapping) -> None:
        """The leader's SyncGroup: each member's assignment as the leader gave it (none for a member it
        left out; entries for non-members are ignored, as Kafka does); the group is Stable."""
        for data, _ in assignments.values():
            if len(data) > ASSIGNMENT_BYTES_MAX:
                raise InvalidConfigError(f"an assignment of {len(data)} bytes exceeds {ASSIGNMENT_BYTES_MAX}")
        for member in group.members.values():
            data, partitions = assignments.get(member.member_id, (b"", ()))
            member.assignment_bytes = bytes(data)
            member.assignment = tuple(sorted({TopicPartition(t, p) for t, p in partitions}))
            # What the member holds from now on, as far as the assignment could be read, and never a
            # partition another member still holds (a leader may hand one over before its owner gave
            # it up; that member counts it again once its next join reports it).
            held_by_others = set().union(*(m.owned for m in group.members.values() if m is not member))
            member.owned |= set(member.assignment) - held_by_others
        self._transition(group, GroupState.STABLE)

    def _maybe_end_sync_deadline(self, group: _Group) -> None:
        if group.state is GroupState.STABLE and all(m.synced for m in group.members.values()):
            group.rebalance_deadline_ms = None

    def _join_response(self, group: _Group, member: _Member) -> JoinResult | JoinPending:
        if group.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
            if group.leader is not None:
                return self._classic_result(group, member, group.leader)
            return self._collect(group, member)
        return JoinPending(member.member_id, self._join_retry_backoff_ms)

    def _remove_members(self, group: _Group, member_ids: list[str], reason: str, now_ms: int, rebalance: bool = True) -> None:
        if not member_ids:
            return
        for member_id in member_ids:
            member = group.members.pop(member_id)
            if member.group_instance_id is not None and group.static_members.get(member.group_instance_id) == member_id:
                del group.static_members[member.group_instance_id]
            if group.leader == member_id:
                group.leader = None  # the next generation elects another (the group rebalances now)
            self._removals.append(MemberRemoved(group.group_id, member_id, member.group_instance_id, reason))
        self._state_version += 1
        if not rebalance:
            return
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group, now_ms)
        else:
            self._prepare_rebalance(group, now_ms)

    def _clock(self, now_ms: object) -> int:
        """``now_ms`` checked; a gap longer than ``stall_ms`` since the previous call is credited (see ``__init__``)."""
        now_ms = _check_now(now_ms)
        last = self._last_now_ms
        if last is None or now_ms > last:
            self._last_now_ms = now_ms
            if last is not None and self._stall_ms is not None and now_ms - last > self._stall_ms:
                self._credit_stall(now_ms - last)
        return now_ms

    def _credit_stall(self, stalled_ms: int) -> None:
        """Move every running timer ``stalled_ms`` later, as if this process had not stalled."""
        for group in self._groups.values():
            for member in group.members.values():
                member.last_heartbeat_ms += stalled_ms
            for member_id in group.pending_member_ids:
                group.pending_member_ids[member_id] += stalled_ms
            if group.rebalance_deadline_ms is not None:
                group.rebalance_deadline_ms += stalled_ms
            if group.join_not_before_ms is not None:
                group.join_not_before_ms += stalled_ms

    def _expire(self, group: _Group, now_ms: int) -> None:
        """Apply every timeout of one group that has passed by ``now_ms``."""
        for member_id, expiry_ms in list(group.pending_member_ids.items()):
            if now_ms > expiry_ms:
                del group.pending_member_ids[member_id]
        timed_out = [m.member_id for m in group.members.values() if now_ms - m.last_heartbeat_ms > m.session_timeout_ms]
        self._remove_members(group, timed_out, REASON_SESSION_TIMEOUT, now_ms)
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group, now_ms)
        elif group.rebalance_deadline_ms is not None and now_ms > group.rebalance_deadline_ms and group.state in (
            GroupState.COMPLETING_REBALANCE, GroupState.STABLE
        ):
            # Kafka's pending-sync timeout: members that did not come for their assignment in time go
            # (in a classic generation: did not send SyncGroup, the leader included).
            if group.leader is not None:
                laggards = [m.member_id for m in group.members.values() if not m.synced]
            else:
                laggards = [m.member_id for m in group.members.values() if not m.collected]
            group.rebalance_deadline_ms = None if not laggards else group.rebalance_deadline_ms
            self._remove_members(group, laggards, REASON_REBALANCE_TIMEOUT, now_ms)

    # --- internals: subscriptions ----------------------------------------------------------------

    def _effective_topics(self, member: _Member) -> set[str]:
        topics = set(member.topics)
        if member.pattern is not None:
            topics.update(
                t
                for t in self._topic_partition_counts
                if not t.startswith(INTERNAL_TOPIC_PREFIX) and re.fullmatch(member.pattern, t)
            )
        return topics

    def _subscribed_counts(self, group: _Group) -> dict[str, int]:
        """Partition counts of the existing topics the group's members subscribe to."""
        topics = set().union(*(self._effective_topics(m) for m in group.members.values())) if group.members else set()
        return {t: self._topic_partition_counts[t] for t in sorted(topics) if t in self._topic_partition_counts}

    def _unassigned_partitions(self, group: _Group) -> set[TopicPartition]:
        """Subscribed partitions the current generation left unassigned (withheld by cooperative-sticky)."""
        everything = {TopicPartition(t, p) for t, count in group.subscribed_counts.items() for p in range(count)}
        for member in group.members.values():
            everything.difference_update(member.assignment)
        return everything

    @staticmethod
    def _pending_revocation(member: _Member) -> tuple[TopicPartition, ...]:
        return tuple(sorted(member.owned.difference(member.assignment)))

    def _check_loaded_group(self, group: _Group) -> None:
        """A group read back from a file keeps the rules (ValueError otherwise): data read from disk is
        checked as input, not trusted, so a damaged file is refused rather than taken for a bug here."""
        _check_loaded(group.state is not GroupState.DEAD, "a Dead group was persisted")
        _check_loaded((group.state is GroupState.EMPTY) == (not group.members), f"group {group.group_id!r}: state {group.state.value} with {len(group.members)} members")
        _check_loaded(group.leader is None or group.leader in group.members, f"group {group.group_id!r}: its leader is no member")
        holders: dict[TopicPartition, str] = {}
        for member in group.members.values():
            _check_loaded(member.generation <= group.generation, f"member {member.member_id!r} is ahead of its group")
            for tp in member.owned:
                _check_loaded(tp not in holders, f"{tp} held by {holders.get(tp)!r} and {member.member_id!r}")
                holders[tp] = member.member_id


def _check_loaded(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _max_rebalance_timeout_ms(group: _Group) -> int:
    return max((m.rebalance_timeout_ms for m in group.members.values()), default=0)


def _select_protocol(members: Iterable[_Member]) -> str:
    """Kafka's choice: among strategies every member supports, the one most members list first."""
    members = list(members)
    candidates = set(members[0].protocols).intersection(*(m.protocols for m in members[1:]))
    _check(bool(candidates), "members share no assignment strategy (checked at join)")
    votes = dict.fromkeys(sorted(candidates), 0)
    for member in members:
        votes[next(p for p in member.protocols if p in candidates)] += 1
    return max(votes, key=lambda name: (votes[name], name == "cooperative-sticky", name))


def _checked_counts(counts: Mapping[str, int]) -> dict[str, int]:
    checked = {}
    for topic, count in counts.items():
        validate_topic_name(topic)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidConfigError(f"partition count of {topic!r} must be a non-negative int, not {count!r}")
        checked[topic] = count
    return checked


def _checked_offsets(offsets: Mapping) -> dict[TopicPartition, OffsetAndMetadata]:
    if len(offsets) > COMMIT_PARTITIONS_MAX:
        raise InvalidConfigError(f"{len(offsets)} partitions in one commit exceed the limit of {COMMIT_PARTITIONS_MAX}")
    checked = {}
    for tp, value in offsets.items():
        tp = _to_partition(tp)
        checked[tp] = _checked_offset(tp, value)
    return checked


def _checked_offset(tp: TopicPartition, value: object) -> OffsetAndMetadata:
    om = OffsetAndMetadata(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(om, tuple) or len(om) != 3:
        raise InvalidRecordError(f"the commit for {tp} must be an offset or an OffsetAndMetadata, not {value!r}")
    om = OffsetAndMetadata(*om)
    if isinstance(om.offset, bool) or not isinstance(om.offset, int) or not 0 <= om.offset < 2**63:
        raise InvalidRecordError(f"committed offset for {tp} must be a non-negative int, not {om.offset!r}")
    if isinstance(om.leader_epoch, bool) or not isinstance(om.leader_epoch, int) or not -1 <= om.leader_epoch < 2**31:
        raise InvalidRecordError(f"leader epoch for {tp} must be an int >= -1, not {om.leader_epoch!r}")
    if not isinstance(om.metadata, str) or len(om.metadata.encode()) > OFFSET_METADATA_BYTES_MAX:
        raise InvalidRecordError(f"commit metadata for {tp} must be a str of at most {OFFSET_METADATA_BYTES_MAX} UTF-8 bytes")
    return om


# --- records of __consumer_offsets -------------------------------------------------------------
#
# Kafka's own record formats (its group coordinator's OffsetCommitKey and OffsetCommitValue
# schemas), so a tool that reads __consumer_offsets through the Kafka gateway (a lag monitor, say)
# decodes them as it decodes a Kafka broker's. One record per committed partition; the topic is
# compacted on the key, so the latest commit of each (group, topic, partition) survives, and a
# record with this key and no value (a tombstone) deletes the commit. Integers are big-endian;
# a string is an int16 byte length then UTF-8 bytes (version 4 of the value: a compact string,
# an unsigned varint of length + 1).
#
#   key      version: int16 (0 or 1: an offset commit; 2: group metadata, which logbus does not
#            write: its groups live in groups.json) | group: string | topic: string | partition: int32
#            Written as version 1, as Kafka's coordinator writes it.
#   value v0 version: int16 | offset: int64 | metadata: string | commit_timestamp: int64
#   value v1 ... v0's fields ... | expire_timestamp: int64
#   value v2 as v0
#   value v3 version: int16 | offset: int64 | leader_epoch: int32 (-1: unknown) | metadata: string
#            | commit_timestamp: int64
#   value v4 as v3 with a compact metadata string, then tagged fields (flexible)
#
# Written as version 3, or version 1 when the commit asked for an expiry (OffsetCommit v2-v4 with a
# retention time), as Kafka writes them. Timestamps are wall-clock ms since the Unix epoch.
#
# Before this format, logbus wrote value "version 1" with version 3's layout (and a monotonic
# commit timestamp). Such a value is still read: a version-1 value that is not a well-formed
# Kafka v1 value with wall-clock timestamps (between 2000 and 3000) but is a well-formed value of
# the old layout is read as the old layout. Kafka's v1 is 4 bytes longer for the same metadata, so
# only an old value with exactly 4 more bytes of metadata can have a v1 reading at all, and that
# reading puts the old leader epoch and metadata length in the commit timestamp's high bytes
# (before 2000, or past year 10000) and the old monotonic commit time in the expiry (before 2000).

OFFSETS_TOPIC = "__consumer_offsets"
OFFSET_COMMIT_KEY_VERSION = 1  # written (Kafka's coordinator writes 1; 0 is the same layout)
GROUP_METADATA_KEY_VERSION = 2  # Kafka's group metadata records: skipped by readers here
OFFSET_COMMIT_VALUE_VERSION = 3  # written without an expiry
OFFSET_COMMIT_VALUE_VERSION_WITH_EXPIRY = 1  # written with one
OFFSET_COMMIT_VALUE_VERSIONS = range(0, 5)
WALL_CLOCK_MS_MIN = 946_684_800_000  # 2000-01-01: a v1 value's timestamps are after this ...
WALL_CLOCK_MS_MAX = 32_503_680_000_000  # ... and before 3000-01-01 (see above)
_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_INT64 = struct.Struct(">q")
_STRING_BYTES_MAX = 2**15 - 1


class OffsetCommitValue(NamedTuple):
    offset: int
    metadata: str
    leader_epoch: int
    commit_timestamp_ms: int


@dataclass(frozen=True, slots=True)
class OffsetCommitRecord:
    """A value of ``__consumer_offsets`` as written: its version and every field (-1 where the version has none)."""

    version: int
    offset: int
    metadata: str
    leader_epoch: int
    commit_timestamp_ms: int
    expire_timestamp_ms: int = -1
    legacy: bool = False  # logbus's layout from before Kafka's format (see above)


def _pack_string(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > _STRING_BYTES_MAX:
        raise InvalidRecordError(f"string of {len(raw)} bytes does not fit a record field")
    return _INT16.pack(len(raw)) + raw


def offsets_key_version(key: bytes) -> int:
    """The version of a ``__consumer_offsets`` key: 0 or 1 for an offset commit, 2 for group metadata."""
    return FieldReader(key, "__consumer_offsets key").int16()


def offset_commit_key(group_id: str, tp: tuple[str, int]) -> bytes:
    tp = _to_partition(tp)
    return _INT16.pack(OFFSET_COMMIT_KEY_VERSION) + _pack_string(validate_group_id(group_id)) + _pack_string(tp.topic) + _INT32.pack(tp.partition)


def decode_offset_commit_key(key: bytes) -> tuple[str, TopicPartition]:
    """The (group id, partition) of an offset-commit key (version 0 or 1); CorruptRecordError if it is not one."""
    reader = FieldReader(key, "offset commit key")
    version = reader.int16()
    if version not in (0, 1):
        raise CorruptRecordError(f"__consumer_offsets key version {version} is no offset commit")
    group_id, topic = reader.string(), reader.string()
    partition = reader.int32()
    reader.finish()
    return group_id, TopicPartition(topic, partition)


def offset_commit_value(om: OffsetAndMetadata | int, commit_timestamp_ms: int, expire_timestamp_ms: int | None = None) -> bytes:
    """An OffsetCommitValue: version 3, or version 1 when ``expire_timestamp_ms`` is given (Kafka's choice)."""
    om = _checked_offset(TopicPartition("?", -1), om)
    for what, ms in (("commit timestamp", commit_timestamp_ms), ("expire timestamp", expire_timestamp_ms)):
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int) or not -(2**63) <= ms < 2**63):
            raise InvalidRecordError(f"{what} must be an int64, not {ms!r}")
    if expire_timestamp_ms is None:
        return (_INT16.pack(OFFSET_COMMIT_VALUE_VERSION) + _INT64.pack(om.offset) + _INT32.pack(om.leader_epoch)
                + _pack_string(om.metadata) + _INT64.pack(commit_timestamp_ms))
    return (_INT16.pack(OFFSET_COMMIT_VALUE_VERSION_WITH_EXPIRY) + _INT64.pack(om.offset) + _pack_string(om.metadata)
            + _INT64.pack(commit_timestamp_ms) + _INT64.pack(expire_timestamp_ms))


def _read_value(value: bytes, version: int) -> OffsetCommitRecord:
    reader = FieldReader(value, f"offset commit value v{version}", position=2)
    offset = reader.int64()
    leader_epoch = reader.int32() if version >= 3 else -1
    metadata = reader.compact_string() if version >= 4 else reader.string()
    commit_ms = reader.int64()
    expire_ms = reader.int64() if version == 1 else -1
    if version >= 4:
        reader.tagged_fields()
    reader.finish()
    return OffsetCommitRecord(version, offset, metadata, leader_epoch, commit_ms, expire_ms)


def _read_legacy_value(value: bytes) -> OffsetCommitRecord:
    reader = FieldReader(value, "offset commit value (logbus's former layout)", position=2)
    offset, leader_epoch = reader.int64(), reader.int32()
    metadata = reader.string()
    commit_ms = reader.int64()
    reader.finish()
    return OffsetCommitRecord(1, offset, metadata, leader_epoch, commit_ms, -1, legacy=True)


def read_offset_commit_value(value: bytes) -> OffsetCommitRecord:
    """Any version of an OffsetCommitValue, or logbus's former layout (see above); CorruptRecordError else."""
    version = FieldReader(value, "offset commit value").int16()
    if version not in OFFSET_COMMIT_VALUE_VERSIONS:
        raise CorruptRecordError(f"unknown __consumer_offsets value version {version}")
    if version == 1:
        try:
            record = _read_value(value, 1)
        except CorruptRecordError:
            record = None
        if record is None or not all(WALL_CLOCK_MS_MIN <= ms < WALL_CLOCK_MS_MAX for ms in (record.commit_timestamp_ms, record.expire_timestamp_ms)):
            try:
                record = _read_legacy_value(value)
            except CorruptRecordError:
                if record is None:
                    raise
    else:
        record = _read_value(value, version)
    if record.offset < 0:
        raise CorruptRecordError(f"offset commit value has a negative offset {record.offset}")
    return record


def decode_offset_commit_value(value: bytes) -> OffsetCommitValue:
    """(offset, metadata, leader epoch, commit timestamp) of any OffsetCommitValue (see :func:`read_offset_commit_value`)."""
    record = read_offset_commit_value(value)
    return OffsetCommitValue(record.offset, record.metadata, record.leader_epoch, record.commit_timestamp_ms)


def encode_offset_commit(group_id: str, tp: tuple[str, int], om: OffsetAndMetadata | int, commit_timestamp_ms: int,
                         expire_timestamp_ms: int | None = None) -> tuple[bytes, bytes]:
    """The (key, value) record of one commit, for ``__consumer_offsets``."""
    return offset_commit_key(group_id, tp), offset_commit_value(om, commit_timestamp_ms, expire_timestamp_ms)


def offsets_topic_partition_for(group_id: str, partition_count: int) -> int:
    """The ``__consumer_offsets`` partition of a group, as Kafka computes it: abs(Java hashCode) % count."""
    validate_group_id(group_id)
    if isinstance(partition_count, bool) or not isinstance(partition_count, int) or partition_count < 1:
        raise InvalidConfigError(f"partition_count must be a positive int, not {partition_count!r}")
    h = 0
    encoded = group_id.encode("utf-16-be")  # Java hashes UTF-16 code units
    for i in range(0, len(encoded), 2):
        h = (31 * h + int.from_bytes(encoded[i : i + 2], "big")) & 0xFFFFFFFF
    return (h & 0x7FFFFFFF) % partition_count  # Kafka's Utils.abs: clear the sign bit


__all__ = [
    "GroupCoordinator",
    "GroupState",
    "GroupDescription",
    "GroupListing",
    "HeartbeatResult",
    "JoinPending",
    "JoinResult",
    "MemberDescription",
    "MemberRemoved",
    "OffsetAndMetadata",
    "OffsetCommitRecord",
    "OffsetCommitValue",
    "OFFSETS_TOPIC",
    "SyncPending",
    "VALID_PREVIOUS_STATES",
    "decode_offset_commit_key",
    "decode_offset_commit_value",
    "encode_offset_commit",
    "offset_commit_key",
    "offset_commit_value",
    "offsets_key_version",
    "offsets_topic_partition_for",
    "read_offset_commit_value",
    "validate_group_id",
]
