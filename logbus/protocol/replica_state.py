"""Leader-side replication state of one partition: follower progress, ISR decisions, high watermark.

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
  bug and raises AssertionError (not an ``assert``, which -O removes).
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
  least the high watermark (AssertionError otherwise).

This class is not thread-safe; the partition replica actor serialises calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from logbus.invariant import check as _check

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
        of the replicas, and the ISR a subset of them (AssertionError otherwise).
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
