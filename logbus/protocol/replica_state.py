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

This class is not thread-safe; the partition replica actor serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FollowerProgress:
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
        self.replica_id = replica_id
        self.replicas = list(replicas)
        self.isr = set(isr) | {replica_id}
        self.pending_isr: set[int] | None = None
        self.leader_epoch = leader_epoch
        self.epoch_start_offset = epoch_start_offset
        self.high_watermark = high_watermark
        # Followers start with a fresh grace period: a new leader does not know their progress yet.
        self.followers = {
            r: FollowerProgress(last_caught_up_ms=now_ms, last_fetch_ms=now_ms) for r in self.replicas if r != replica_id
        }

    # --- follower fetches -------------------------------------------------------------------------

    def on_follower_fetch(self, follower_id: int, fetch_offset: int, leader_end_offset: int, now_ms: int) -> None:
        """Record a follower's fetch at ``fetch_offset`` (it has everything below)."""
        progress = self.followers.setdefault(follower_id, FollowerProgress())
        if fetch_offset >= leader_end_offset:
            progress.last_caught_up_ms = now_ms
        elif fetch_offset >= progress.leader_end_at_last_fetch:
            progress.last_caught_up_ms = max(progress.last_caught_up_ms, progress.last_fetch_ms)
        progress.log_end_offset = fetch_offset
        progress.last_fetch_ms = now_ms
        progress.leader_end_at_last_fetch = leader_end_offset

    # --- high watermark ------------------------------------------------------------------------------

    def _members(self) -> set[int]:
        return self.isr | (self.pending_isr or set())

    def update_high_watermark(self, leader_end_offset: int) -> bool:
        """Advance the high watermark to the smallest log end among ISR members; True if it moved."""
        ends = [leader_end_offset]
        for r in self._members():
            if r != self.replica_id:
                ends.append(self.followers.get(r, FollowerProgress()).log_end_offset)
        candidate = min(ends)
        if candidate > self.high_watermark:
            self.high_watermark = candidate
            return True
        return False

    # --- ISR changes -------------------------------------------------------------------------------------

    def proposed_isr(self, leader_end_offset: int, now_ms: int, lag_time_max_ms: int) -> list[int] | None:
        """The ISR this leader should ask the controller for now, or None when no change is due."""
        if self.pending_isr is not None:
            return None
        new = set(self.isr)
        for r, progress in self.followers.items():
            if r not in self.replicas:
                continue
            if r in new and now_ms - progress.last_caught_up_ms > lag_time_max_ms:
                new.discard(r)
            elif (
                r not in new
                and progress.log_end_offset >= self.high_watermark
                and progress.log_end_offset >= self.epoch_start_offset
                and now_ms - progress.last_fetch_ms <= lag_time_max_ms
            ):
                new.add(r)
        if new == self.isr:
            return None
        self.pending_isr = new
        return sorted(new)

    def isr_change_done(self, accepted: list[int] | None) -> None:
        """The controller answered a proposal: ``accepted`` is the ISR now in force (None: refused)."""
        if accepted is not None:
            self.isr = set(accepted) | {self.replica_id}
        self.pending_isr = None

    def in_sync_count(self) -> int:
        return len(self.isr)
