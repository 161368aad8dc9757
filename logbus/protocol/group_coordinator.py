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
coordinator computes the assignment itself with the group's strategy (see
:mod:`logbus.protocol.assignors`) as soon as every member has rejoined, so
there is no group leader and no separate SyncGroup round: ``sync`` only
re-fetches an assignment whose join response was lost. Normal flow results
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
a violation is a bug and raises AssertionError). Under an eager strategy every
member has revoked everything by the time the generation forms, so ``owned``
is cleared first. Under cooperative-sticky a moving partition is withheld
(assigned to nobody) until its owner's next join no longer reports it; that
join starts the follow-up rebalance that assigns it (KIP-429's two phases).

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

import enum
import json
import re
import struct
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from logbus.errors import (
    CorruptRecordError,
    GroupNotEmptyError,
    IllegalGenerationError,
    IllegalStateError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidRecordError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
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
    """

    member_id: str
    generation: int
    protocol: str  # the group's assignment strategy for this generation
    assignment: tuple[TopicPartition, ...]
    revoke: tuple[TopicPartition, ...] = ()


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


@dataclass(frozen=True, slots=True)
class GroupDescription:
    group_id: str
    state: GroupState
    protocol: str | None
    generation: int
    members: tuple[MemberDescription, ...]


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
    # Not persisted; a loaded coordinator restarts the session at its load time.
    last_heartbeat_ms: int = 0

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
            last_heartbeat_ms=now_ms,
        )


@dataclass(slots=True)
class _Group:
    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    protocol: str | None = None  # the strategy of the current generation
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
    ) -> None:
        """
        Args:
            topic_partition_counts: topic -> partition count of every existing topic.
            initial_rebalance_delay_ms: how long a group leaving Empty waits for more members
                before forming its first generation (Kafka's group.initial.rebalance.delay.ms).
            new_member_id: builds a member id from a client id or group instance id; ids must
                be unique for the life of the cluster (the default appends a UUID).
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

        Raises:
            InvalidGroupIdError, InvalidConfigError, InvalidTopicError, InvalidPartitionError: bad arguments.
            UnknownMemberIdError: ``member_id`` is not (or no longer) a member, or was fenced by
                a newer instance with the same ``group_instance_id``: join again with "".
            IllegalStateError: the group or the coordinator is full.
        """
        validate_group_id(group_id)
        now_ms = _check_now(now_ms)
        member_id = _check_name("member_id", member_id, allow_empty=True)
        request = self._join_request(
            group_instance_id, client_id, topics, pattern, owned, protocols,
            session_timeout_ms, rebalance_timeout_ms, max_poll_interval_ms,
        )  # fmt: skip
        group = self._groups.get(group_id)
        if group is None:
            if member_id:
                raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r} (no such group)")
            group = self._add_group(group_id)
        self._expire(group, now_ms)

        if member_id == "":
            instance_id = request.group_instance_id
            if instance_id is None:
                # KIP-394: hand out an id first and count the member only when it joins with it, so a
                # lost response leaves no phantom member for the rebalance to wait for.
                self._check_room(group, extra=1)
                self._check_protocols(group, request.protocols, excluding=None)
                new_id = self._new_member_id(request.client_id)
                group.pending_member_ids[new_id] = now_ms + request.session_timeout_ms
                return JoinPending(new_id, retry_backoff_ms=0)
            if instance_id in group.static_members:
                return self._replace_static_member(group, group.static_members[instance_id], request, now_ms)
            self._check_room(group, extra=1)
            self._check_protocols(group, request.protocols, excluding=None)
            member = self._new_member(self._new_member_id(instance_id), request, now_ms)
            return self._add_member(group, member, now_ms)

        if member_id in group.pending_member_ids:
            if request.group_instance_id is not None:
                raise UnknownMemberIdError(f"member id {member_id!r} was issued to a dynamic member; static members join with ''")
            del group.pending_member_ids[member_id]
            self._check_room(group, extra=1)
            self._check_protocols(group, request.protocols, excluding=None)
            return self._add_member(group, self._new_member(member_id, request, now_ms), now_ms)

        member = self._member(group, member_id)
        if member.group_instance_id != request.group_instance_id:
            raise UnknownMemberIdError(
                f"member {member_id!r} has group instance id {member.group_instance_id!r}, not {request.group_instance_id!r}"
            )
        self._check_protocols(group, request.protocols, excluding=member_id)
        return self._rejoin(group, member, request, now_ms, keep_alive)

    def sync(self, group_id: str, member_id: str, generation: int, *, now_ms: int) -> JoinResult:
        """Fetch the member's assignment for ``generation`` again (after a lost join response).

        Raises:
            UnknownMemberIdError: not a member.
            RebalanceInProgressError: a rebalance is under way: join again.
            IllegalGenerationError: ``generation`` is not the current one.
        """
        validate_group_id(group_id)
        now_ms = _check_now(now_ms)
        generation = _check_generation(generation)
        group = self._existing_group(group_id, member_id)
        self._expire(group, now_ms)
        member = self._member(group, member_id)
        member.last_heartbeat_ms = now_ms
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgressError(f"group {group_id!r} is rebalancing; join again")
        if generation != group.generation:
            raise IllegalGenerationError(f"generation {generation} is not group {group_id!r}'s current {group.generation}")
        return self._collect(group, member)

    def fingerprint(self, group_id: str) -> tuple:
        """What members waiting on a group (long-polled heartbeats and joins) wait to see change:
        its state, generation and members. Equal fingerprints mean nothing for them to act on."""
        group = self._groups.get(group_id)
        if group is None:
            return ()
        return (group.state, group.generation, tuple(group.members))

    def group_ids(self) -> list[str]:
        return list(self._groups)

    def session_timeout_ms(self, group_id: str, member_id: str) -> int | None:
        """The member's session timeout, or None if it is not a member."""
        group = self._groups.get(group_id)
        member = None if group is None else group.members.get(member_id)
        return None if member is None else member.session_timeout_ms

    def heartbeat(
        self, group_id: str, member_id: str, generation: int, *, poll_idle_ms: int, now_ms: int, keep_alive: bool = True
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
            IllegalGenerationError: ``generation`` is newer than the group's.
        """
        validate_group_id(group_id)
        now_ms = _check_now(now_ms)
        generation = _check_generation(generation)
        poll_idle_ms = _check_ms("poll_idle_ms", poll_idle_ms, 0, 2**62)
        group = self._existing_group(group_id, member_id)
        self._expire(group, now_ms)
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
            return HeartbeatResult(rejoin=True)  # a new generation is formed: join to collect it
        self._collect(group, member)  # knowing the generation means the member has its assignment
        revoke = self._pending_revocation(member)
        return HeartbeatResult(rejoin=bool(revoke), revoke=revoke)

    def leave(self, group_id: str, member_id: str, *, now_ms: int) -> bool:
        """Remove a member at once (the group rebalances); False if it was not a member (idempotent)."""
        validate_group_id(group_id)
        now_ms = _check_now(now_ms)
        group = self._groups.get(group_id)
        if group is None:
            return False
        self._expire(group, now_ms)
        if member_id not in group.members:
            return False
        self._remove_members(group, [member_id], REASON_LEFT, now_ms)
        return True

    def tick(self, now_ms: int) -> list[MemberRemoved]:
        """Expire sessions, poll intervals and rebalance timeouts in every group.

        Returns every member removal since the previous tick (including removals
        that other calls made), for the controller to log.
        """
        now_ms = _check_now(now_ms)
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
        now_ms = _check_now(now_ms)
        self._topic_partition_counts = _checked_counts(topic_partition_counts)
        started = []
        for group in list(self._groups.values()):
            self._expire(group, now_ms)
            if group.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
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
    ) -> list[tuple[bytes, bytes]]:
        """Check that the commit may happen; return the records to append to ``__consumer_offsets``.

        A member commits with its current generation. A consumer outside group
        management commits with ``member_id=""`` and ``generation=-1``, which is
        allowed only while the group has no members (the group is created Empty
        if it does not exist). Partitions are not checked against the member's
        assignment (as in Kafka: a cooperative member commits what it revokes).

        Raises:
            UnknownMemberIdError: not a member (or a generation -1 commit while the group has members).
            IllegalGenerationError: the generation is not the group's current one.
            RebalanceInProgressError: the member has not collected the current generation.
            InvalidGroupIdError, InvalidTopicError, InvalidPartitionError, InvalidConfigError, InvalidRecordError: bad arguments.
        """
        validate_group_id(group_id)
        now_ms = _check_now(now_ms)
        generation = _check_generation(generation)
        checked = _checked_offsets(offsets)
        group = self._groups.get(group_id)
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
            if generation != group.generation:
                raise IllegalGenerationError(f"generation {generation} is not group {group_id!r}'s current {group.generation}")
            if group.state is GroupState.COMPLETING_REBALANCE and not member.collected:
                raise RebalanceInProgressError(f"group {group_id!r} is completing a rebalance; join to collect it")
            member.last_heartbeat_ms = now_ms
        return [encode_offset_commit(group_id, tp, om, now_ms) for tp, om in checked.items()]

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
            )
            for m in sorted(group.members.values(), key=lambda m: m.member_id)
        )
        return GroupDescription(group_id, group.state, group.protocol, group.generation, members)

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
                    subscribed_counts=dict(raw["subscribed_counts"]),
                )
                for raw_member in raw["members"]:
                    member = _Member.from_dict(raw_member, now_ms)
                    group.members[member.member_id] = member
                    if member.group_instance_id is not None:
                        group.static_members[member.group_instance_id] = member.member_id
                if group.state in (GroupState.PREPARING_REBALANCE, GroupState.COMPLETING_REBALANCE):
                    group.rebalance_deadline_ms = now_ms + _max_rebalance_timeout_ms(group)
                coordinator._check_loaded_group(group)
                coordinator._groups[group.group_id] = group
        except (KeyError, TypeError, AssertionError, InvalidGroupIdError) as e:
            raise ValueError(f"corrupt group coordinator state: {e!r}") from e
        return coordinator

    @classmethod
    def from_json(cls, text: str, *, now_ms: int, **options) -> "GroupCoordinator":
        return cls.from_dict(json.loads(text), now_ms=now_ms, **options)

    # --- internals: requests ---------------------------------------------------------------------

    def _join_request(
        self, group_instance_id, client_id, topics, pattern, owned, protocols,
        session_timeout_ms, rebalance_timeout_ms, max_poll_interval_ms,
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
        if not topic_list and pattern is None:
            raise InvalidConfigError("a member must subscribe to topics, a pattern, or both")
        owned_list = list(owned)
        if len(owned_list) > ASSIGN_PARTITIONS_MAX:
            raise InvalidConfigError(f"{len(owned_list)} owned partitions exceed the limit of {ASSIGN_PARTITIONS_MAX}")
        owned_set = frozenset(_to_partition(tp) for tp in owned_list)
        protocol_list = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        if not protocol_list or len(protocol_list) > PROTOCOLS_MAX or len(set(protocol_list)) != len(protocol_list):
            raise InvalidConfigError(f"protocols must list 1 to {PROTOCOLS_MAX} distinct strategies, not {protocols!r}")
        for name in protocol_list:
            get_assignor(name)
        session = _check_ms("session_timeout_ms", session_timeout_ms, self._session_timeout_ms_min, self._session_timeout_ms_max)
        rebalance = _check_ms("rebalance_timeout_ms", rebalance_timeout_ms, 1, REBALANCE_TIMEOUT_MS_MAX)
        max_poll = _check_ms("max_poll_interval_ms", max_poll_interval_ms, 1, REBALANCE_TIMEOUT_MS_MAX)
        return _JoinRequest(group_instance_id, client_id, topic_list, pattern, owned_set, protocol_list, session, rebalance, max_poll)

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

    def _check_protocols(self, group: _Group, protocols: tuple[str, ...], excluding: str | None) -> None:
        others = [m for m in group.members.values() if m.member_id != excluding]
        if not others:
            return
        common = set(protocols).intersection(*(m.protocols for m in others))
        if not common:
            raise InvalidConfigError(
                f"group {group.group_id!r} has no assignment strategy in common with {list(protocols)}"
                f" (its members support {sorted(set().union(*(m.protocols for m in others)))})"
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
        changed = (member.topics, member.pattern, member.protocols) != (request.topics, request.pattern, request.protocols)
        before = (member.client_id, member.session_timeout_ms, member.rebalance_timeout_ms, member.max_poll_interval_ms)
        member.client_id = request.client_id
        member.topics, member.pattern, member.protocols = request.topics, request.pattern, request.protocols
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
        if group.state is GroupState.PREPARING_REBALANCE:
            if not member.rejoined:
                member.rejoined = True
                self._state_version += 1
            self._maybe_complete_join(group, now_ms)
        elif changed or released & self._unassigned_partitions(group):
            # A new subscription, or (cooperative phase two) a withheld partition is now free.
            self._prepare_rebalance(group, now_ms)
            member.rejoined = True
            self._maybe_complete_join(group, now_ms)
        return self._join_response(group, member)

    def _replace_static_member(self, group: _Group, old_member_id: str, request: _JoinRequest, now_ms: int) -> JoinResult | JoinPending:
        """A restarted static member takes its instance's place under a new member id; the old id is fenced."""
        self._check_protocols(group, request.protocols, excluding=old_member_id)
        member = group.members.pop(old_member_id)
        member.member_id = self._new_member_id(request.group_instance_id)
        group.members[member.member_id] = member
        group.static_members[request.group_instance_id] = member.member_id
        self._state_version += 1
        self._removals.append(MemberRemoved(group.group_id, old_member_id, member.group_instance_id, REASON_FENCED))
        return self._rejoin(group, member, request, now_ms)

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
            group.subscribed_counts = {}
            group.rebalance_deadline_ms = None
            return
        protocol = _select_protocol(group.members.values())
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

    def _join_response(self, group: _Group, member: _Member) -> JoinResult | JoinPending:
        if group.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
            return self._collect(group, member)
        return JoinPending(member.member_id, self._join_retry_backoff_ms)

    def _remove_members(self, group: _Group, member_ids: list[str], reason: str, now_ms: int, rebalance: bool = True) -> None:
        if not member_ids:
            return
        for member_id in member_ids:
            member = group.members.pop(member_id)
            if member.group_instance_id is not None and group.static_members.get(member.group_instance_id) == member_id:
                del group.static_members[member.group_instance_id]
            self._removals.append(MemberRemoved(group.group_id, member_id, member.group_instance_id, reason))
        self._state_version += 1
        if not rebalance:
            return
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group, now_ms)
        else:
            self._prepare_rebalance(group, now_ms)

    def _expire(self, group: _Group, now_ms: int) -> None:
        """Apply every timeout of one group that has passed by ``now_ms``."""
        for member_id, expiry_ms in list(group.pending_member_ids.items()):
            if now_ms > expiry_ms:
                del group.pending_member_ids[member_id]
        timed_out = [m.member_id for m in group.members.values() if now_ms - m.last_heartbeat_ms > m.session_timeout_ms]
        self._remove_members(group, timed_out, REASON_SESSION_TIMEOUT, now_ms)
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group, now_ms)
        elif group.state is GroupState.COMPLETING_REBALANCE and now_ms > group.rebalance_deadline_ms:
            laggards = [m.member_id for m in group.members.values() if not m.collected]
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
        _check(group.state is not GroupState.DEAD, "a Dead group was persisted")
        _check((group.state is GroupState.EMPTY) == (not group.members), f"group {group.group_id!r}: state {group.state.value} with {len(group.members)} members")
        holders: dict[TopicPartition, str] = {}
        for member in group.members.values():
            _check(member.generation <= group.generation, f"member {member.member_id!r} is ahead of its group")
            for tp in member.owned:
                _check(tp not in holders, f"{tp} held by {holders.get(tp)!r} and {member.member_id!r}")
                holders[tp] = member.member_id


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
# One record per committed partition; the topic is compacted on the key, so the
# latest commit of each (group, topic, partition) survives. A record with this
# key and no value (a tombstone) deletes the commit. Integers are big-endian, as
# in Kafka; strings are a signed 16-bit byte length followed by UTF-8 bytes.
#
#   key   (version 1)  key_version: int16 = 1 | group_id: string | topic: string | partition: int32
#   value (version 1)  value_version: int16 = 1 | offset: int64 | leader_epoch: int32 (-1: unknown)
#                      | metadata: string | commit_timestamp_ms: int64
#
# The value's fields are those of Kafka's OffsetCommitValue v3. Key versions
# leave room for other record kinds in the same topic (Kafka uses key version 2
# for group metadata); a reader rejects versions it does not know.

OFFSETS_TOPIC = "__consumer_offsets"
OFFSET_COMMIT_KEY_VERSION = 1
OFFSET_COMMIT_VALUE_VERSION = 1
_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_VALUE_HEAD = struct.Struct(">hqi")  # value_version, offset, leader_epoch
_INT64 = struct.Struct(">q")
_STRING_BYTES_MAX = 2**15 - 1


class OffsetCommitValue(NamedTuple):
    offset: int
    metadata: str
    leader_epoch: int
    commit_timestamp_ms: int


def _pack_string(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > _STRING_BYTES_MAX:
        raise InvalidRecordError(f"string of {len(raw)} bytes does not fit a record field")
    return _INT16.pack(len(raw)) + raw


class _Reader:
    """Reads fields in order; every short or malformed read is a CorruptRecordError."""

    def __init__(self, data: bytes, what: str) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptRecordError(f"{what} must be bytes, not {type(data).__name__}")
        self.data, self.position, self.what = bytes(data), 0, what

    def unpack(self, layout: struct.Struct) -> tuple:
        end = self.position + layout.size
        if end > len(self.data):
            raise CorruptRecordError(f"{self.what} is truncated at byte {self.position}")
        values = layout.unpack_from(self.data, self.position)
        self.position = end
        return values

    def string(self) -> str:
        (length,) = self.unpack(_INT16)
        end = self.position + length
        if length < 0 or end > len(self.data):
            raise CorruptRecordError(f"{self.what} has a bad string length {length} at byte {self.position}")
        try:
            text = self.data[self.position : end].decode()
        except UnicodeDecodeError:
            raise CorruptRecordError(f"{self.what} has a string that is not UTF-8") from None
        self.position = end
        return text

    def finish(self) -> None:
        if self.position != len(self.data):
            raise CorruptRecordError(f"{self.what} has {len(self.data) - self.position} trailing bytes")


def offset_commit_key(group_id: str, tp: tuple[str, int]) -> bytes:
    tp = _to_partition(tp)
    return _INT16.pack(OFFSET_COMMIT_KEY_VERSION) + _pack_string(validate_group_id(group_id)) + _pack_string(tp.topic) + _INT32.pack(tp.partition)


def decode_offset_commit_key(key: bytes) -> tuple[str, TopicPartition]:
    """The (group id, partition) of an offset-commit key; CorruptRecordError if it is not one."""
    reader = _Reader(key, "offset commit key")
    (version,) = reader.unpack(_INT16)
    if version != OFFSET_COMMIT_KEY_VERSION:
        raise CorruptRecordError(f"unknown __consumer_offsets key version {version}")
    group_id, topic = reader.string(), reader.string()
    (partition,) = reader.unpack(_INT32)
    reader.finish()
    return group_id, TopicPartition(topic, partition)


def offset_commit_value(om: OffsetAndMetadata | int, commit_timestamp_ms: int) -> bytes:
    om = _checked_offset(TopicPartition("?", -1), om)
    if isinstance(commit_timestamp_ms, bool) or not isinstance(commit_timestamp_ms, int) or not -(2**63) <= commit_timestamp_ms < 2**63:
        raise InvalidRecordError(f"commit timestamp must be an int64, not {commit_timestamp_ms!r}")
    return _VALUE_HEAD.pack(OFFSET_COMMIT_VALUE_VERSION, om.offset, om.leader_epoch) + _pack_string(om.metadata) + _INT64.pack(commit_timestamp_ms)


def decode_offset_commit_value(value: bytes) -> OffsetCommitValue:
    reader = _Reader(value, "offset commit value")
    version, offset, leader_epoch = reader.unpack(_VALUE_HEAD)
    if version != OFFSET_COMMIT_VALUE_VERSION:
        raise CorruptRecordError(f"unknown __consumer_offsets value version {version}")
    metadata = reader.string()
    (commit_timestamp_ms,) = reader.unpack(_INT64)
    reader.finish()
    if offset < 0:
        raise CorruptRecordError(f"offset commit value has a negative offset {offset}")
    return OffsetCommitValue(offset, metadata, leader_epoch, commit_timestamp_ms)


def encode_offset_commit(group_id: str, tp: tuple[str, int], om: OffsetAndMetadata | int, commit_timestamp_ms: int) -> tuple[bytes, bytes]:
    """The (key, value) record of one commit, for ``__consumer_offsets``."""
    return offset_commit_key(group_id, tp), offset_commit_value(om, commit_timestamp_ms)


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
    "OffsetCommitValue",
    "OFFSETS_TOPIC",
    "VALID_PREVIOUS_STATES",
    "decode_offset_commit_key",
    "decode_offset_commit_value",
    "encode_offset_commit",
    "offset_commit_key",
    "offset_commit_value",
    "offsets_topic_partition_for",
    "validate_group_id",
]
