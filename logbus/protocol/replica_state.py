"""Replication state of one partition replica: its role, a leader's ISR and high watermark, a follower's decisions.

Sans-IO, as h11 is: no Ray, no files, no clock of its own. The replica actor
(``actors/partition_replica.py``) feeds it events (a role change from the
controller, a follower's fetch, an append, a fetch reply from the leader, a
timer, the fence file's epoch) with the time and a read-only view of the log,
and carries out the *actions* it returns, in order: persist the epoch,
truncate the log, append a reply's batches, propose an ISR, arm a timer, ask
for the role, ... A test harness does the same with real logs and no actors
(``tests/protocol/test_replication_model.py``), which is how replication bugs
are found without Ray.

:class:`ReplicaState` holds the role and decides:

- *Roles.* ``become_leader`` / ``become_follower`` carry a leader epoch; an
  older one is refused, the same one again changes nothing (idempotent). A
  leader that learns a newer epoch without a leader steps down. A deposed
  leader keeps its high watermark as a follower's.
- *The fence rule.* The node agent writes each partition's current epoch
  into the replica's fence file before the controller tells anyone their
  role. A replica whose fence stays past its own epoch for
  ``FENCE_ASK_DELAY_MS`` (one one-shot timer) asks the controller for its
  role, once per fence epoch: the controller's own call normally comes first.
- *Follower decisions* (Kafka's fetcher, KIP-101/279): before its first fetch
  from a leader it asks where its own latest epoch ends in the leader's log
  and truncates there (never merely to its high watermark); a fetch past the
  leader's log end or below its log start is answered by starting the log
  at the leader's log start, or by truncating by epoch again; each fetch
  reply's batches are appended unchanged, and the leader's log start and high
  watermark adopted.
- *Leader decisions*, through :class:`LeaderState` below: a follower's fetch
  records its progress and advances the high watermark; a follower whose
  fetch waits (parked) at the log end counts as caught up while it waits, as
  long as such a fetch can wait; ISR changes are proposed one at a time, and
  one timer is armed only while an in-sync follower is behind.
- *Read limits.* A consumer reads below the high watermark, or, reading
  committed records only (KIP-98), below the last stable offset: the
  smaller of the high watermark and the first offset of the log's oldest
  ongoing transaction. Transaction markers are appended as any batch is
  (``before_append`` / ``after_append``); followers copy them unchanged.

:class:`LeaderState`: leader-side replication state of one partition:
follower progress, ISR decisions, high watermark.

Kafka 0.8 semantics with the later fixes, as plain state driven by method
calls with an explicit clock (no Ray, no I/O):

- Followers pull. Each follower fetch at offset ``o`` tells the leader that
  the follower holds everything below ``o`` (its log end offset).
- A follower is *caught up* when its log end offset reaches the leader's log
  end offset as of its previous fetch (KIP-392's "last caught up time"). A
  follower in the ISR that has not been caught up for
  ``replica_lag_time_max_ms`` leaves the ISR; an out-of-sync follower whose
  log end offset reaches the high watermark (and the start of the current
  leader epoch) joins again.
- The high watermark is the smallest log end offset among ISR members; it
  never moves back while one leader holds the partition.
- ISR changes are proposed to the controller, which persists them; the
  leader applies the new ISR only once the controller has accepted it.
  While a change is pending, the high watermark is computed over the union
  of the old and the proposed ISR (the safe choice for either outcome).
- The replica list comes from the controller. A replaced replica (the
  controller gives its replacement a fresh id and drops it from the ISR)
  leaves this leader's ISR, and a pending one, as soon as the new list is set.

Invariants
----------
- The leader is in the ISR (and in a pending ISR), and both are subsets of
  the replicas. Checked after every change of membership: a violation is a
  bug and raises InvariantViolationError (``logbus/invariant.py``; in a replica's
  process it ends the process, which restarts from its files).
- The high watermark never moves back, and is never raised past the leader's
  log end offset nor past the log end offset this leader knows for any ISR
  or pending ISR member (it is their minimum). A leader starts with the high
  watermark it had as a follower and counts its ISR members as holding
  everything below it, which is what being in sync means. The only way a
  member can then be below the high watermark is to fetch below it: a
  follower that lost records it had acknowledged (unsynced writes lost with
  its machine). That is logged; the high watermark stays where it is, and
  the follower leaves the ISR after ``replica_lag_time_max_ms`` unless it
  catches up first.
- A leader is never asked to stand below its high watermark: the leader's
  log end offset given to :meth:`LeaderState.update_high_watermark` is at
  least the high watermark (InvariantViolationError otherwise).

These classes are not thread-safe; the partition replica actor serialises calls.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from logbus.errors import FencedLeaderEpochError, InvalidRecordError, NotLeaderError, OffsetOutOfRangeError
from logbus.invariant import check as _check
from logbus.protocol.messages import FETCH_INLINE_MAX_BYTES, READ_COMMITTED, READ_UNCOMMITTED, FetchRequest, FetchResponse

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FollowerProgress:
    """What the leader knows of one follower, from its fetches."""

    # What the follower holds at least: everything below this offset (its last fetch offset).
    log_end_offset: int = 0
    last_fetch_ms: int = -1
    last_caught_up_ms: int = -1
    # The leader's log end offset when this follower last fetched: reaching it means caught up.
    leader_end_at_last_fetch: int = 0


class LeaderState:
    """ISR and high watermark bookkeeping for a partition this replica leads."""

    def __init__(
        self,
        replica_id: int,
        replicas: list[int],
        isr: list[int],
        leader_epoch: int,
        epoch_start_offset: int,
        high_watermark: int,
        now_ms: int,
    ) -> None:
        """Start leading at ``epoch_start_offset`` (this replica's log end offset) with ``high_watermark``.

        ``replicas`` and ``isr`` are the controller's; the leader must be one
        of the replicas, and the ISR a subset of them (InvariantViolationError otherwise).
        """
        _check(replica_id in replicas, f"leader {replica_id} is not one of the replicas {replicas}")
        _check(set(isr) <= set(replicas), f"ISR {sorted(isr)} is not a subset of the replicas {replicas}")
        _check(
            0 <= high_watermark <= epoch_start_offset,
            f"high watermark {high_watermark} is outside the new leader's log [0, {epoch_start_offset}]",
        )
        self.replica_id = replica_id
        self._replicas = list(replicas)
        self.isr = set(isr) | {replica_id}
        self.pending_isr: set[int] | None = None
        self.leader_epoch = leader_epoch
        self.epoch_start_offset = epoch_start_offset
        self._high_watermark = high_watermark
        # Followers start with a fresh grace period: a new leader does not know their progress yet.
        # An ISR member holds at least everything below the high watermark (that is what in sync means).
        self.followers = {
            r: FollowerProgress(
                log_end_offset=high_watermark if r in self.isr else 0, last_caught_up_ms=now_ms, last_fetch_ms=now_ms
            )
            for r in self._replicas
            if r != replica_id
        }
        self._check_membership()

    @property
    def high_watermark(self) -> int:
        """Offsets below it are committed (on every ISR member): consumers may read them. Only ever grows."""
        return self._high_watermark

    @property
    def replicas(self) -> list[int]:
        """The partition's replica ids, as the controller last said."""
        return self._replicas

    @replicas.setter
    def replicas(self, replicas: list[int]) -> None:
        """Adopt the controller's replica list; a replica no longer in it leaves the ISR here too.

        The controller drops a replaced replica from the ISR when it replaces
        it; keeping it here would hold the high watermark at its last log end
        until the next ISR change.
        """
        members = set(replicas)
        _check(self.replica_id in members, f"leader {self.replica_id} is not one of the new replicas {list(replicas)}")
        self._replicas = list(replicas)
        self.isr &= members
        if self.pending_isr is not None:
            self.pending_isr &= members
        self._check_membership()

    def _check_membership(self) -> None:
        replicas = set(self._replicas)
        _check(self.replica_id in self.isr, f"leader {self.replica_id} is not in its ISR {sorted(self.isr)}")
        _check(self.isr <= replicas, f"ISR {sorted(self.isr)} is not a subset of the replicas {self._replicas}")
        if self.pending_isr is not None:
            _check(self.replica_id in self.pending_isr, f"leader {self.replica_id} is not in the pending ISR {sorted(self.pending_isr)}")
            _check(
                self.pending_isr <= replicas,
                f"pending ISR {sorted(self.pending_isr)} is not a subset of the replicas {self._replicas}",
            )

    # --- follower fetches -------------------------------------------------------------------------

    def on_follower_fetch(self, follower_id: int, fetch_offset: int, leader_end_offset: int, now_ms: int) -> None:
        """Record a follower's fetch at ``fetch_offset`` (it has everything below; at most ``leader_end_offset``)."""
        _check(
            fetch_offset <= leader_end_offset,
            f"follower {follower_id} fetches at {fetch_offset}, past the leader's log end {leader_end_offset} (checked by the caller)",
        )
        progress = self.followers.setdefault(follower_id, FollowerProgress())
        if fetch_offset >= leader_end_offset:
            progress.last_caught_up_ms = now_ms
        elif fetch_offset >= progress.leader_end_at_last_fetch:
            progress.last_caught_up_ms = max(progress.last_caught_up_ms, progress.last_fetch_ms)
        if fetch_offset < self._high_watermark <= progress.log_end_offset and follower_id in self._members():
            # The HW stays (it never moves back); the follower leaves the ISR unless it catches up in time.
            logger.warning(
                "in-sync follower %d of leader %d (epoch %d) fetches at %d, below the high watermark %d: it lost records it had",
                follower_id, self.replica_id, self.leader_epoch, fetch_offset, self._high_watermark,
            )
        progress.log_end_offset = fetch_offset
        progress.last_fetch_ms = now_ms
        progress.leader_end_at_last_fetch = leader_end_offset

    # --- high watermark ------------------------------------------------------------------------------

    def _members(self) -> set[int]:
        return self.isr | (self.pending_isr or set())

    def update_high_watermark(self, leader_end_offset: int) -> bool:
        """Advance the high watermark to the smallest log end among ISR members; True if it moved."""
        _check(
            leader_end_offset >= self._high_watermark,
            f"leader {self.replica_id}'s log end {leader_end_offset} is below its high watermark {self._high_watermark}",
        )
        ends = [leader_end_offset]
        for r in self._members():
            if r != self.replica_id:
                ends.append(self.followers.get(r, FollowerProgress()).log_end_offset)
        candidate = min(ends)
        if candidate > self._high_watermark:  # only ever forward, and to a minimum over the leader and every member
            self._high_watermark = candidate
            return True
        return False

    # --- ISR changes -------------------------------------------------------------------------------------

    def proposed_isr(self, leader_end_offset: int, now_ms: int, lag_time_max_ms: int) -> list[int] | None:
        """The ISR this leader should ask the controller for now, or None when no change is due."""
        if self.pending_isr is not None:
            return None
        new = set(self.isr)
        for r, progress in self.followers.items():
            if r not in self._replicas or r == self.replica_id:
                continue
            if r in new and now_ms - progress.last_caught_up_ms > lag_time_max_ms:
                new.discard(r)
            elif (
                r not in new
                and progress.log_end_offset >= self._high_watermark
                and progress.log_end_offset >= self.epoch_start_offset
                and now_ms - progress.last_fetch_ms <= lag_time_max_ms
            ):
                new.add(r)
        if new == self.isr:
            return None
        self.pending_isr = new
        self._check_membership()
        return sorted(new)

    def next_isr_check_ms(self, leader_end_offset: int, lag_time_max_ms: int, waiting: set[int] = frozenset()) -> int | None:
        """When :meth:`proposed_isr` could next drop a member that does nothing: the earliest time an
        in-sync follower runs out of lag time, or None if none can. Followers in ``waiting`` have a
        fetch waiting at the leader's end (their owner counts them caught up while it waits), so
        only the others count. Its owner arms one timer for it (no periodic checks); fetches,
        which are what brings followers back, are checked as they arrive."""
        deadline = None
        for r, progress in self.followers.items():
            if r in self.isr and r in self.replicas and (r not in waiting or progress.log_end_offset < leader_end_offset):
                due = progress.last_caught_up_ms + lag_time_max_ms + 1
                deadline = due if deadline is None else min(deadline, due)
        return deadline

    def isr_change_done(self, accepted: list[int] | None) -> None:
        """The controller answered a proposal: ``accepted`` is the ISR now in force (None: refused).

        Replicas this leader no longer has (replaced while the proposal was
        out) are left out, as the controller left them out when it replaced them.
        """
        if accepted is not None:
            self.isr = (set(accepted) & set(self._replicas)) | {self.replica_id}
        self.pending_isr = None
        self._check_membership()

    def in_sync_count(self) -> int:
        return len(self.isr)


# --- a replica's role and decisions --------------------------------------------------------------------

LEADER = "leader"
FOLLOWER = "follower"
UNKNOWN = "unknown"

UNDEFINED_EPOCH = -1  # as the leader epoch cache says "no such epoch" (storage/leader_epoch_cache.py)

# A follower waits at most this long at the leader's end (and at most half the lag time): an append
# answers a waiting fetch at once, so the wait only bounds what an idle follower costs.
REPLICA_FETCH_WAIT_MS = 10_000
# After a fetch that failed or timed out, the follower asks with this short wait until one succeeds:
# once the leader can be reached again, a fetch ends and is sent again within 2 s (see the actor's
# FOLLOWER_FETCH_SLACK_MS), and the follower is back in the ISR at its next fetch.
FOLLOWER_RETRY_WAIT_MS = 500
REPLICA_FETCH_MAX_BYTES = 16 << 20
THROTTLE_SLICE_MS = 200  # a throttled follower fetches about this many ms' worth of bytes at a time
THROTTLED_FETCH_MIN_BYTES = 64 << 10
# A fence epoch past ours this long (the controller's call did not come): ask for our role.
FENCE_ASK_DELAY_MS = 1_000
ISR_RETRY_DELAY_MS = 500  # an ISR change refused or not answered: look again this soon

# Timer names: the owner keeps one one-shot timer per name and calls the method named when it fires.
ISR_TIMER = "isr"  # -> ReplicaState.check_isr
ROLE_TIMER = "role"  # -> ReplicaState.role_timer_fired


class EpochsView(Protocol):
    """What the state reads of a log's leader epoch cache (``storage/leader_epoch_cache.py``)."""

    @property
    def latest_epoch(self) -> int: ...

    def end_offset_for(self, epoch: int, log_end_offset: int) -> tuple[int, int]: ...


class LogConfigView(Protocol):
    replica_lag_time_max_ms: int


class LogView(Protocol):
    """What the state reads of the replica's log (a ``storage.PartitionLog``); it never changes it."""

    log_start_offset: int
    log_end_offset: int
    epochs: EpochsView
    config: LogConfigView

    def first_unstable_offset(self) -> int | None:
        """The first offset of the oldest ongoing transaction, or None (read only for the last stable offset)."""


# Actions: what the owner carries out, in the order given. Log actions change the log
# (``apply_to_log`` does them); the others are the owner's (timers, calls, tasks, waiters).


@dataclass(frozen=True, slots=True)
class SaveEpoch:
    """Persist ``epoch``, the epoch of the role now held (it survives a restart; the role does not)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class StartEpoch:
    """Log: a new leader's epoch starts at ``start_offset`` (the leader epoch cache)."""

    epoch: int
    start_offset: int


@dataclass(frozen=True, slots=True)
class Truncate:
    """Log: remove everything at and after ``offset`` (a divergent tail, KIP-101)."""

    offset: int


@dataclass(frozen=True, slots=True)
class StartLogAt:
    """Log: delete everything and start empty at ``offset`` (a follower behind the leader's log start)."""

    offset: int


@dataclass(frozen=True, slots=True)
class AppendFromLeader:
    """Log: append the fetch reply's batches unchanged; the reply covers ``[first_offset, next_offset)``."""

    first_offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class AdvanceLogStart:
    """Log: the leader's log start moved (its delete_records): move ours to ``offset``."""

    offset: int


@dataclass(frozen=True, slots=True)
class HighWatermarkMoved:
    """Wake what waits for the high watermark (acks=all produces, fetches at the old one, a cleaning)."""


@dataclass(frozen=True, slots=True)
class LeadershipChanged:
    """The role or epoch changed: wake acks=all waiters (they give up), forget fetch sessions and shared
    reads (a position or a read made under another leadership may predate a truncation)."""


@dataclass(frozen=True, slots=True)
class StartFollowing:
    """Start the fetch loop for ``epoch`` (from ``leader_id``; the owner holds its handle)."""

    epoch: int
    leader_id: int


@dataclass(frozen=True, slots=True)
class StopFollowing:
    """End the fetch loop, if one runs."""


@dataclass(frozen=True, slots=True)
class ProposeIsr:
    """Ask the controller for ``isr`` as leader at ``leader_epoch``; answer with :meth:`ReplicaState.isr_answered`
    (``leadership`` names the leadership that asked: an answer for an earlier one is ignored)."""

    leadership: int
    leader_epoch: int
    isr: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """(Re)arm the one-shot timer ``name`` to fire in ``delay_ms``."""

    name: str
    delay_ms: int


@dataclass(frozen=True, slots=True)
class DisarmTimer:
    name: str


@dataclass(frozen=True, slots=True)
class AskRole:
    """Ask the controller for this replica's role (the fence is at ``fence_epoch``); answer with ``reconcile``."""

    fence_epoch: int


LOG_ACTIONS = (StartEpoch, Truncate, StartLogAt, AdvanceLogStart)


def apply_to_log(log, action) -> None:
    """Carry out a log action (one of ``LOG_ACTIONS``) on a ``storage.PartitionLog``."""
    match action:
        case StartEpoch(epoch, start_offset):
            log.epochs.assign(epoch, start_offset)
        case Truncate(offset):
            log.truncate_to(offset)
        case StartLogAt(offset):
            log.truncate_fully_and_start_at(offset)
        case AdvanceLogStart(offset):
            log.delete_records(offset)
        case _:
            raise TypeError(f"not a log action: {action!r}")


@dataclass(frozen=True, slots=True)
class AskEpochEnd:
    """A follower's next step: ask the leader where ``epoch`` ends in its log (KIP-279 OffsetsForLeaderEpoch)."""

    epoch: int


@dataclass(slots=True)
class FollowState:
    """A follower's fetch loop, for one leader epoch."""

    epoch: int
    leader_id: int
    needs_truncation: bool = True  # truncate by epoch before the next fetch
    ask_epoch: int | None = None  # the epoch to ask about next while truncating (None: our latest)
    failing: bool = False  # the last call to the leader failed or timed out: fetch with a short wait


def truncation_target(
    epochs: EpochsView, log_start_offset: int, log_end_offset: int, leader_epoch: int, leader_end_offset: int
) -> tuple[int, int | None]:
    """KIP-101/279: where a follower cuts its log, given the leader's answer about one of its epochs, and
    which epoch to ask about next (None: the truncation is done).

    The leader said its largest epoch at or below the one asked about is
    ``leader_epoch``, ending at ``leader_end_offset`` (UNDEFINED_EPOCH: it has
    none, and the follower keeps nothing past its log start). If the follower
    has that epoch too, it keeps what it has of it up to where the leader's
    ends. If it does not (its own largest epoch below is an older one), it
    cuts where that older epoch ends and asks about it next, as Kafka's
    fetcher does: the leader's end of one epoch says nothing of where the
    follower's other epoch stops agreeing with the leader's log.
    """
    if leader_epoch == UNDEFINED_EPOCH:
        return log_start_offset, None
    our_epoch, our_end = epochs.end_offset_for(leader_epoch, log_end_offset)
    if our_epoch == UNDEFINED_EPOCH:
        return log_start_offset, None  # every epoch we hold is one the leader never had
    if our_epoch != leader_epoch:
        return min(our_end, log_end_offset), our_epoch
    return min(leader_end_offset, our_end), None


class ReplicaState:
    """Role, epoch and replication decisions of one partition replica (see the module docstring).

    ``leader_epoch`` is the epoch the replica last held a role in (persisted
    by its owner on :class:`SaveEpoch`; -1 before any). ``controlled``: the
    replica has a controller to propose ISR changes to and a fence to read
    (False for a standalone replica in tests).
    """

    def __init__(self, replica_id: int, leader_epoch: int, *, partition_name: str, controlled: bool = True) -> None:
        self.replica_id = replica_id
        self.partition_name = partition_name  # "topic-partition", for messages
        self.controlled = controlled
        self.leader_epoch = leader_epoch
        self.role = UNKNOWN
        self.leader: LeaderState | None = None  # while leading
        self.leader_id: int | None = None
        self.leader_ref: Hashable | None = None  # which process the leader is (the owner's handle's identity)
        self.follow: FollowState | None = None  # while following
        self._follower_high_watermark = 0
        # Followers whose fetch waits here at the end: id -> (offset, since ms). Each park's value is its token.
        self.parked: dict[int, tuple[int, int]] = {}
        self.leadership = 0  # counts leaderships: an ISR answer names the one that asked
        self._isr_in_flight = False  # a ProposeIsr of this leadership not yet answered
        self.role_asked_epoch = -1  # the fence epoch we last asked our role for
        self._role_timer_armed = False

    # --- offsets -----------------------------------------------------------------------------------------

    def high_watermark(self, log_end_offset: int) -> int:
        """A leader's high watermark; a follower's is the last its leader sent (at most its own log end)."""
        if self.role == LEADER and self.leader is not None:
            return self.leader.high_watermark
        return min(self._follower_high_watermark, log_end_offset)

    def last_stable_offset(self, log: LogView) -> int:
        """The smaller of the high watermark and the first offset of the oldest ongoing transaction in
        ``log`` (KIP-98): read_committed readers read below it."""
        high_watermark = self.high_watermark(log.log_end_offset)
        unstable = log.first_unstable_offset()
        return high_watermark if unstable is None else min(high_watermark, unstable)

    def read_limit(self, isolation_level: int, log: LogView) -> int:
        """Where a consumer's fetch (or an offsets query) ends for its isolation level: the high watermark
        (READ_UNCOMMITTED) or the last stable offset (READ_COMMITTED). InvalidRecordError for another level."""
        if isolation_level == READ_UNCOMMITTED:
            return self.high_watermark(log.log_end_offset)
        if isolation_level == READ_COMMITTED:
            return self.last_stable_offset(log)
        raise InvalidRecordError(f"isolation_level must be {READ_UNCOMMITTED} or {READ_COMMITTED}, not {isolation_level!r}")

    def reply_stable_offset(self, log: LogView) -> int:
        """The last stable offset a fetch reply carries: a leader's; a follower has none of its own (its
        leader's transactions decide it), so its high watermark."""
        if self.role == LEADER:
            return self.last_stable_offset(log)
        return self.high_watermark(log.log_end_offset)

    def _set_epoch(self, epoch: int) -> list:
        if epoch == self.leader_epoch:
            return []
        self.leader_epoch = epoch
        return [SaveEpoch(epoch)]

    # --- roles -------------------------------------------------------------------------------------------

    def become_leader(self, epoch: int, replicas: list[int], isr: list[int], log: LogView, now_ms: int) -> tuple[bool, list]:
        """Lead from ``epoch`` on (idempotent): (accepted, actions). An older epoch is refused."""
        end = log.log_end_offset
        if epoch == self.leader_epoch and self.role == LEADER and self.leader is not None:
            if list(replicas) == self.leader.replicas:
                return True, []
            self.leader.replicas = list(replicas)  # a replaced follower: the same leadership
            return True, self.advance_high_watermark(end) + self.check_isr(log, now_ms)
        if epoch < self.leader_epoch:
            return False, []
        previous_hw = self.high_watermark(end)
        actions = [StopFollowing(), *self._set_epoch(epoch), LeadershipChanged(), StartEpoch(epoch, end)]
        self.leadership += 1
        self._isr_in_flight = False
        self.leader = LeaderState(self.replica_id, replicas, isr, epoch, end, previous_hw, now_ms)
        self.role = LEADER
        self.leader_id = self.replica_id
        self.leader_ref = None
        self.follow = None
        self.parked.clear()
        actions += self.advance_high_watermark(end)
        actions += self.check_isr(log, now_ms)
        return True, actions

    def become_follower(self, epoch: int, leader_id: int, leader_ref: Hashable | None, log: LogView) -> tuple[bool, list]:
        """Follow ``leader_id`` (its process is ``leader_ref``) from ``epoch`` on (idempotent): (accepted, actions)."""
        if epoch < self.leader_epoch:
            return False, []
        if self.role == FOLLOWER and epoch == self.leader_epoch and self.leader_id == leader_id and self._same_leader(leader_ref):
            return True, []
        self._keep_high_watermark()
        self.leader = None
        actions = [*self._set_epoch(epoch), LeadershipChanged(), StopFollowing()]
        self.role = FOLLOWER
        self.leader_id = leader_id
        self.leader_ref = leader_ref
        self.follow = FollowState(epoch, leader_id)
        actions.append(StartFollowing(epoch, leader_id))
        return True, actions

    def _same_leader(self, leader_ref: Hashable | None) -> bool:
        return leader_ref is not None and self.leader_ref is not None and leader_ref == self.leader_ref

    def _keep_high_watermark(self) -> None:
        """Leaving the leadership: the high watermark it reached is kept (it never goes back)."""
        if self.role == LEADER and self.leader is not None:
            self._follower_high_watermark = self.leader.high_watermark

    def step_down(self, epoch: int) -> list:
        """A newer epoch without a role for us (no leader yet): stop leading."""
        self._keep_high_watermark()
        self.leader = None
        self.role = UNKNOWN
        return [*self._set_epoch(epoch), LeadershipChanged()]

    def reconcile(
        self, leader: int | None, epoch: int, replicas: list[int], isr: list[int], leader_ref: Hashable | None, log: LogView, now_ms: int
    ) -> list:
        """Adopt the controller's view of the partition (its answer to :class:`AskRole`) if ours is stale."""
        if leader == self.replica_id:  # a new leadership, or the same one's replica list
            return self.become_leader(epoch, replicas, isr, log, now_ms)[1]
        if leader is not None:
            if self.role != FOLLOWER or epoch != self.leader_epoch or self.leader_id != leader or not self._same_leader(leader_ref):
                return self.become_follower(epoch, leader, leader_ref, log)[1]
            return []
        if self.role == LEADER and epoch > self.leader_epoch:
            return self.step_down(epoch)
        return []

    def remove(self) -> list:
        """The replica is being deleted: no role from here on."""
        self.leader = None
        self.role = UNKNOWN
        self.follow = None
        self.parked.clear()
        return [LeadershipChanged(), StopFollowing(), DisarmTimer(ISR_TIMER), DisarmTimer(ROLE_TIMER)]

    # --- the fence: ask for our role when it stays past our epoch -----------------------------------------

    def _fence_ahead(self, fence_epoch: int) -> bool:
        return fence_epoch > self.leader_epoch and fence_epoch > self.role_asked_epoch

    def on_fence(self, fence_epoch: int) -> list:
        """The fence file says ``fence_epoch`` (read on every request and follower fetch, and when the agent
        says it moved): if it is past ours and not yet asked about, arm the role timer (once)."""
        if not self._fence_ahead(fence_epoch) or self._role_timer_armed:
            return []
        self._role_timer_armed = True
        return [ArmTimer(ROLE_TIMER, FENCE_ASK_DELAY_MS)]

    def role_timer_fired(self, fence_epoch: int) -> list:
        """The role timer fired with the fence at ``fence_epoch``: ask, unless the role change arrived meanwhile."""
        self._role_timer_armed = False
        if not self._fence_ahead(fence_epoch):
            return []
        self.role_asked_epoch = fence_epoch
        return [AskRole(fence_epoch)]

    # --- leading -----------------------------------------------------------------------------------------

    def check_leader(self, epoch: int | None = None) -> LeaderState:
        """The leader state, if this replica leads (at ``epoch``, if given); else NotLeaderError (or
        FencedLeaderEpochError for an older epoch)."""
        if self.role != LEADER or self.leader is None:
            raise NotLeaderError(f"replica {self.replica_id} of {self.partition_name} is not the leader")
        if epoch is not None and epoch != self.leader_epoch:
            error = FencedLeaderEpochError if epoch < self.leader_epoch else NotLeaderError
            raise error(f"{self.partition_name}: request epoch {epoch}, leader epoch {self.leader_epoch}")
        return self.leader

    def advance_high_watermark(self, log_end_offset: int) -> list:
        if self.leader is not None and self.leader.update_high_watermark(log_end_offset):
            return [HighWatermarkMoved()]
        return []

    def on_replica_fetch(self, follower_id: int, epoch: int, offset: int, log: LogView, now_ms: int) -> list:
        """A follower's fetch at ``offset`` (it holds everything below): record its progress.

        NotLeaderError / FencedLeaderEpochError when this replica does not lead
        at ``epoch``; OffsetOutOfRangeError past the log end (the follower's
        log runs past ours: it truncates by epoch again).
        """
        state = self.check_leader(epoch)
        end = log.log_end_offset
        if offset > end:
            raise OffsetOutOfRangeError(f"follower offset {offset} is past the leader's log end {end}")
        state.on_follower_fetch(follower_id, offset, end, now_ms)
        return self.advance_high_watermark(end) + self.check_isr(log, now_ms)

    def park(self, follower_id: int, offset: int, now_ms: int) -> tuple[int, int]:
        """A follower's fetch at the log end waits here; returns its token for :meth:`unpark`."""
        token = (offset, now_ms)
        self.parked[follower_id] = token
        return token

    def unpark(self, follower_id: int, token: tuple[int, int]) -> None:
        if self.parked.get(follower_id) is token:
            del self.parked[follower_id]

    def before_append(self, log: LogView, now_ms: int) -> list:
        """About to append as leader: followers parked at the end were in sync up to now."""
        return self.check_isr(log, now_ms) if self.parked else []

    def after_append(self, log: LogView, now_ms: int) -> list:
        """Appended as leader (or found a duplicate): the high watermark and the ISR, looked at again."""
        return self.advance_high_watermark(log.log_end_offset) + self.check_isr(log, now_ms)

    def check_isr(self, log: LogView, now_ms: int) -> list:
        """As leader: propose an ISR change if one is due now; one timer for the next that may be."""
        state = self.leader
        if self.role != LEADER or state is None or not self.controlled:
            return []
        end = log.log_end_offset
        lag_ms = log.config.replica_lag_time_max_ms
        # A follower whose fetch waits here at the end is in sync, for as long as such a fetch can
        # wait (a live follower sends the next one at half the lag time; a paused one does not).
        waiting, expiry = set(), None
        for follower, (offset, since) in self.parked.items():
            if offset >= end and now_ms - since <= lag_ms:
                state.on_follower_fetch(follower, offset, end, now_ms)
                waiting.add(follower)
                expiry = since + lag_ms + 1 if expiry is None else min(expiry, since + lag_ms + 1)
        actions: list = []
        if not self._isr_in_flight:
            if state.pending_isr is not None:
                # The last proposal went unanswered: the controller may have taken it, so the same is
                # asked again until an answer says which ISR is in force (never another meanwhile).
                proposal = sorted(state.pending_isr)
            else:
                proposal = state.proposed_isr(end, now_ms, lag_ms)
            if proposal is not None:
                self._isr_in_flight = True
                actions.append(ProposeIsr(self.leadership, state.leader_epoch, tuple(proposal)))
        due = state.next_isr_check_ms(end, lag_ms, waiting)
        if expiry is not None:
            due = expiry if due is None else min(due, expiry)
        actions.append(DisarmTimer(ISR_TIMER) if due is None else ArmTimer(ISR_TIMER, due - now_ms))
        return actions

    def followers_gone(self, epoch: int, followers: list[int], log: LogView, now_ms: int) -> list:
        """As leader of ``epoch``: the controller found the node of these followers dead (its lease ran out).

        They count as out of sync from now, as if silent for ``replica_lag_time_max_ms``: the next
        proposal leaves them out of the ISR (Kafka's controller takes a fenced broker out of every
        ISR), so acks=all writes wait for them no longer than the controller takes to notice. A fetch
        waiting here from one of them no longer counts it in sync. One that fetches again catches up
        and comes back into the ISR as any follower does. Another epoch's notice is ignored.
        """
        state = self.leader
        if self.role != LEADER or state is None or epoch != self.leader_epoch:
            return []
        stale_ms = now_ms - log.config.replica_lag_time_max_ms - 1
        for follower in followers:
            if follower == self.replica_id or follower not in state.replicas:
                continue
            progress = state.followers.setdefault(follower, FollowerProgress())
            progress.last_caught_up_ms = min(progress.last_caught_up_ms, stale_ms)
            progress.last_fetch_ms = min(progress.last_fetch_ms, stale_ms)  # not back in before it fetches again
            self.parked.pop(follower, None)
        return self.check_isr(log, now_ms)

    def isr_answered(self, leadership: int, accepted: list[int] | None, log: LogView, now_ms: int) -> list:
        """The controller answered a :class:`ProposeIsr`: ``accepted`` is the ISR now in force, None that it
        refused (this leader's epoch is not the current one)."""
        state = self.leader
        if state is None or leadership != self.leadership:
            return []
        self._isr_in_flight = False
        state.isr_change_done(accepted)
        actions = self.advance_high_watermark(log.log_end_offset)
        if accepted is None:
            return actions + [ArmTimer(ISR_TIMER, ISR_RETRY_DELAY_MS)]  # look again shortly
        return actions + self.check_isr(log, now_ms)

    def isr_unanswered(self, leadership: int) -> list:
        """A :class:`ProposeIsr` got no answer (timed out, or the controller could not be reached).

        The controller may have taken it: the proposal stays pending (the high
        watermark counts the old and the proposed members alike) and is sent
        again, the same, after ISR_RETRY_DELAY_MS. Taking the old ISR back
        instead let the two disagree for good: a shrink the controller
        accepted left it with fewer members than the leader counted (and
        nothing to tell it otherwise), an expansion it accepted made a replica
        electable that the leader's high watermark did not wait for.
        """
        if self.leader is None or leadership != self.leadership:
            return []
        self._isr_in_flight = False
        return [ArmTimer(ISR_TIMER, ISR_RETRY_DELAY_MS)]

    # --- following ---------------------------------------------------------------------------------------

    def _following(self, epoch: int) -> FollowState | None:
        follow = self.follow
        if self.role != FOLLOWER or follow is None or follow.epoch != epoch or self.leader_epoch != epoch:
            return None
        return follow

    def next_fetch(self, epoch: int, log: LogView, throttle_bytes_per_s: int | None = None) -> AskEpochEnd | FetchRequest | None:
        """The fetch loop of ``epoch``'s next step: ask where our latest epoch ends, or fetch; None: stop."""
        follow = self._following(epoch)
        if follow is None:
            return None
        if follow.needs_truncation:
            asked = log.epochs.latest_epoch if follow.ask_epoch is None else follow.ask_epoch
            if asked != UNDEFINED_EPOCH:
                return AskEpochEnd(asked)
            follow.needs_truncation = False  # nothing to cut
        # Wait at most half the lag time: a fetch waiting at the leader counts as in sync only that
        # long, so an idle follower renews it before it stops counting.
        wait_ms = min(REPLICA_FETCH_WAIT_MS, log.config.replica_lag_time_max_ms // 2)
        if follow.failing:
            wait_ms = min(wait_ms, FOLLOWER_RETRY_WAIT_MS)
        max_bytes = REPLICA_FETCH_MAX_BYTES
        if throttle_bytes_per_s:
            # A throttled copy (a reassignment) asks for small slices, so its pace stays smooth.
            max_bytes = max(THROTTLED_FETCH_MIN_BYTES, min(max_bytes, throttle_bytes_per_s * THROTTLE_SLICE_MS // 1000))
        return FetchRequest(log.log_end_offset, max_bytes, wait_ms, False, FETCH_INLINE_MAX_BYTES)

    def on_epoch_end(self, epoch: int, leader_epoch: int, leader_end_offset: int, log: LogView) -> list:
        """The leader answered :class:`AskEpochEnd`: truncate where our logs diverge."""
        follow = self._following(epoch)
        if follow is None:
            return []
        if leader_epoch == UNDEFINED_EPOCH:
            # The leader holds no epoch at or below ours: its log is empty at its start (DeleteRecords
            # took everything; the epoch cache keeps only epochs inside the log), or it never had one
            # of ours. As Kafka's fetcher, keep what is committed (our high watermark) and fetch from
            # there: an out-of-range answer then cuts to the leader's end or starts at its start.
            target = max(log.log_start_offset, min(self._follower_high_watermark, log.log_end_offset))
            follow.ask_epoch = None
        else:
            target, follow.ask_epoch = truncation_target(
                log.epochs, log.log_start_offset, log.log_end_offset, leader_epoch, leader_end_offset
            )
        follow.needs_truncation = follow.ask_epoch is not None  # each round asks about an older epoch: it ends
        if target >= log.log_end_offset:
            return []
        self._cut_high_watermark(target, log.log_end_offset)
        return [Truncate(target)]

    def _cut_high_watermark(self, target: int, log_end_offset: int) -> None:
        """The log is about to be cut at ``target``: what will follow it there is not known to be committed.

        Never below the high watermark after a clean election (the new leader
        holds every committed record); only after an unclean one, whose leader
        may lack some, does a follower cut below it.
        """
        if target < min(self._follower_high_watermark, log_end_offset):
            logger.warning(
                "replica %d of %s cuts its log at %d, below its high watermark %d: committed records are lost (an unclean election?)",
                self.replica_id, self.partition_name, target, min(self._follower_high_watermark, log_end_offset),
            )
        self._follower_high_watermark = min(self._follower_high_watermark, target)

    def on_fetch_reply(self, epoch: int, reply: FetchResponse, has_data: bool) -> list:
        """The leader answered a fetch: append its batches (if any). Then :meth:`fetch_reply_applied`."""
        follow = self._following(epoch)
        if follow is None:
            return []
        follow.failing = False
        return [AppendFromLeader(reply.first_offset, reply.next_offset)] if has_data else []

    def fetch_reply_applied(self, epoch: int, reply: FetchResponse, log: LogView) -> list:
        """After the reply's batches were appended: the leader's log start and high watermark."""
        if self._following(epoch) is None:
            return []
        actions: list = []
        if reply.log_start_offset > log.log_start_offset:  # the leader's delete_records
            actions.append(AdvanceLogStart(min(reply.log_start_offset, log.log_end_offset)))
        # Only forward: a new leader's high watermark may lag the one its predecessor reached, which
        # this follower may have learnt (every record below it is on the new leader too).
        if reply.high_watermark > self._follower_high_watermark:
            self._follower_high_watermark = reply.high_watermark
            actions.append(HighWatermarkMoved())
        return actions

    def on_out_of_range(self, epoch: int, leader_start_offset: int, leader_end_offset: int, log: LogView) -> list:
        """The leader refused our fetch offset; it holds ``[leader_start_offset, leader_end_offset)``."""
        follow = self._following(epoch)
        if follow is None:
            return []
        if log.log_end_offset < leader_start_offset:
            return [StartLogAt(leader_start_offset)]  # everything we hold is below the leader's start: nothing is cut
        actions: list = []
        if log.log_end_offset > leader_end_offset:
            # Our log runs past the leader's end: what is past it is not committed (after a clean
            # election the leader holds every committed record), so it goes first.
            if leader_end_offset < log.log_start_offset:
                self._cut_high_watermark(leader_start_offset, log.log_end_offset)
                return [StartLogAt(leader_start_offset)]
            self._cut_high_watermark(leader_end_offset, log.log_end_offset)
            actions.append(Truncate(leader_end_offset))
        follow.needs_truncation = True  # and what remains is cut by epoch again
        follow.ask_epoch = None
        return actions

    def on_fetch_failed(self, epoch: int) -> None:
        """A call to the leader failed or timed out: the next fetch waits briefly."""
        follow = self._following(epoch)
        if follow is not None:
            follow.failing = True
