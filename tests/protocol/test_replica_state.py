"""LeaderState rules: follower catch-up and lag (KIP-392), ISR shrink and expand, pending ISR, high watermark."""

from __future__ import annotations

import logging

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from logbus.errors import InvariantViolationError
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.replica_state import LeaderState

LAG_MS = 100


def leader(replicas=(0, 1, 2), isr=None, epoch_start=10, high_watermark=10, now_ms=0, epoch=1) -> LeaderState:
    replicas = list(replicas)
    return LeaderState(0, replicas, list(replicas if isr is None else isr), epoch, epoch_start, high_watermark, now_ms)


# --- follower progress and lag ---------------------------------------------------------------------


def test_a_follower_fetching_at_the_leader_end_stays_in_sync():
    state = leader()
    end = 10
    for now in range(50, 1000, 50):  # well past the lag time in total, each fetch at the leader's end
        end += 7
        state.on_follower_fetch(1, end, end, now)
        state.on_follower_fetch(2, end, end, now)
        assert state.proposed_isr(end, now, LAG_MS) is None
    assert state.isr == {0, 1, 2}


def test_a_follower_that_reached_the_end_as_of_its_previous_fetch_was_caught_up_then():
    """KIP-392: the leader keeps appending, so a busy follower is rarely at the end when it fetches;
    reaching the end the leader had at its previous fetch counts as caught up at that time."""
    state = leader(isr=[0, 1])
    state.on_follower_fetch(1, 5, 10, now_ms=30)  # behind; the leader's end was 10 then
    state.on_follower_fetch(1, 10, 20, now_ms=60)  # reaches 10: caught up as of t=30
    state.on_follower_fetch(1, 15, 30, now_ms=90)  # short of 20: still caught up as of t=30 only
    assert state.proposed_isr(30, 130, LAG_MS) is None  # 100 ms after t=30: within the lag time
    assert state.proposed_isr(30, 131, LAG_MS) == [0]  # 101 ms: out


def test_a_follower_that_never_catches_up_leaves_the_isr_after_the_lag_time():
    state = leader(isr=[0, 1], now_ms=1_000)  # a new leader gives its followers a grace period from t=1000
    end = 10
    for now in range(1_010, 1_100, 10):
        end += 10
        state.on_follower_fetch(1, end - 15, end, now)  # always short of the end the leader had before
        assert state.proposed_isr(end, now, LAG_MS) is None
    assert state.proposed_isr(end, 1_100, LAG_MS) is None  # exactly the lag time: still in
    assert state.proposed_isr(end, 1_101, LAG_MS) == [0]
    assert state.pending_isr == {0} and state.isr == {0, 1}  # only proposed: the controller decides


def test_a_silent_follower_leaves_the_isr_and_a_returning_one_joins_at_the_high_watermark():
    state = leader(isr=[0, 1, 2])
    state.on_follower_fetch(1, 10, 10, now_ms=10)
    assert state.proposed_isr(10, 111, LAG_MS) == [0]  # both silent for longer than the lag time
    state.isr_change_done([0])
    state.on_follower_fetch(1, 10, 12, now_ms=150)  # back, at the high watermark (10)
    assert state.proposed_isr(12, 150, LAG_MS) == [0, 1]  # joins again; 2 is still silent


# --- expanding the ISR -------------------------------------------------------------------------------


def test_a_follower_joins_only_at_the_high_watermark_and_the_epoch_start():
    state = leader(isr=[0, 1], epoch_start=10, high_watermark=5)
    state.on_follower_fetch(2, 7, 10, now_ms=10)
    assert state.proposed_isr(10, 10, LAG_MS) is None  # at the high watermark, below the epoch start
    state.on_follower_fetch(1, 20, 20, now_ms=20)
    assert state.update_high_watermark(20) and state.high_watermark == 20
    state.on_follower_fetch(2, 15, 20, now_ms=20)
    assert state.proposed_isr(20, 20, LAG_MS) is None  # past the epoch start, below the high watermark
    state.on_follower_fetch(2, 20, 20, now_ms=30)
    assert state.proposed_isr(20, 30, LAG_MS) == [0, 1, 2]


def test_a_follower_that_stopped_fetching_does_not_join():
    state = leader(isr=[0, 1])
    state.on_follower_fetch(1, 10, 10, now_ms=200)
    state.on_follower_fetch(2, 10, 10, now_ms=10)  # reached the high watermark, then went silent
    assert state.proposed_isr(10, 111, LAG_MS) is None


def test_only_replicas_join():
    state = leader(isr=[0, 1])
    state.on_follower_fetch(7, 10, 10, now_ms=10)  # not a replica of this partition (e.g. a replaced one)
    assert state.proposed_isr(10, 10, LAG_MS) is None


# --- high watermark ------------------------------------------------------------------------------------


def test_the_high_watermark_is_the_smallest_log_end_among_isr_members():
    state = leader(isr=[0, 1], epoch_start=10, high_watermark=8)
    # A new leader counts its in-sync followers as holding what is below the high watermark, no more.
    assert (state.followers[1].log_end_offset, state.followers[2].log_end_offset) == (8, 0)
    assert not state.update_high_watermark(10)
    state.on_follower_fetch(2, 3, 10, now_ms=10)  # not in the ISR: does not hold the watermark back
    state.on_follower_fetch(1, 9, 10, now_ms=10)
    assert state.update_high_watermark(10) and state.high_watermark == 9
    state.on_follower_fetch(1, 15, 15, now_ms=20)
    assert state.update_high_watermark(12) and state.high_watermark == 12  # the leader's end bounds it too
    assert not state.update_high_watermark(12)


def test_the_high_watermark_never_moves_back_when_a_member_loses_records(caplog):
    state = leader(isr=[0, 1])
    state.on_follower_fetch(1, 20, 20, now_ms=10)
    assert state.update_high_watermark(20) and state.high_watermark == 20
    with caplog.at_level(logging.WARNING, logger="logbus.protocol.replica_state"):
        state.on_follower_fetch(1, 12, 20, now_ms=20)  # its unsynced tail was lost with its machine
    assert "below the high watermark 20" in caplog.text
    assert not state.update_high_watermark(20) and state.high_watermark == 20
    assert state.proposed_isr(20, 111, LAG_MS) == [0]  # not caught up since t=10: out after the lag time
    with pytest.raises(AttributeError):
        state.high_watermark = 0  # read-only: only update_high_watermark moves it


def test_a_pending_isr_change_counts_old_and_new_members():
    state = leader(isr=[0, 1, 2], epoch_start=10, high_watermark=10)
    state.on_follower_fetch(1, 30, 30, now_ms=90)
    state.on_follower_fetch(2, 12, 12, now_ms=5)  # then silent
    assert state.update_high_watermark(30) and state.high_watermark == 12
    assert state.proposed_isr(30, 106, LAG_MS) == [0, 1]  # 2 is proposed out ...
    assert not state.update_high_watermark(30) and state.high_watermark == 12  # ... but holds the HW until accepted
    state.isr_change_done([0, 1])
    assert state.update_high_watermark(30) and state.high_watermark == 30

    state.on_follower_fetch(2, 30, 40, now_ms=110)  # back at the high watermark
    assert state.proposed_isr(40, 110, LAG_MS) == [0, 1, 2]
    state.on_follower_fetch(1, 40, 40, now_ms=111)
    assert not state.update_high_watermark(40) and state.high_watermark == 30  # the joining member counts already


# --- the controller's answer ----------------------------------------------------------------------------


def test_a_refused_change_keeps_the_isr_and_is_proposed_again():
    state = leader(isr=[0, 1])
    assert state.proposed_isr(10, 101, LAG_MS) == [0]
    assert state.proposed_isr(10, 102, LAG_MS) is None  # one change at a time
    state.isr_change_done(None)
    assert state.isr == {0, 1} and state.pending_isr is None
    assert state.proposed_isr(10, 103, LAG_MS) == [0]
    state.isr_change_done([0])
    assert state.isr == {0} and state.pending_isr is None and state.in_sync_count() == 1


def test_the_accepted_isr_keeps_the_leader_and_only_current_replicas():
    state = leader(replicas=(0, 1, 2), isr=[0, 1])
    assert state.proposed_isr(10, 101, LAG_MS) == [0]
    state.isr_change_done([1, 2, 5])  # 5 is not (or no longer) a replica here; the leader is missing
    assert state.isr == {0, 1, 2}


def test_a_replaced_replica_leaves_the_isr_when_the_replica_list_changes():
    state = leader(replicas=(0, 1, 2), isr=[0, 1])
    state.on_follower_fetch(1, 10, 10, now_ms=50)
    state.on_follower_fetch(2, 10, 10, now_ms=50)
    assert state.proposed_isr(10, 50, LAG_MS) == [0, 1, 2]  # 2 joins
    state.replicas = [0, 3, 2]  # meanwhile the controller replaced 1 by 3
    assert state.isr == {0} and state.pending_isr == {0, 2}
    state.isr_change_done([0, 1, 2])  # the answer, given before the replacement
    assert state.isr == {0, 2}


# --- checked invariants -------------------------------------------------------------------------------


def test_broken_invariants_raise():
    with pytest.raises(InvariantViolationError, match="not one of the replicas"):
        LeaderState(3, [0, 1, 2], [0, 1, 2], 1, 10, 10, 0)
    with pytest.raises(InvariantViolationError, match="not a subset"):
        LeaderState(0, [0, 1], [0, 1, 2], 1, 10, 10, 0)
    with pytest.raises(InvariantViolationError, match="outside the new leader's log"):
        LeaderState(0, [0, 1], [0, 1], 1, 10, 11, 0)
    state = leader()
    with pytest.raises(InvariantViolationError, match="below its high watermark"):
        state.update_high_watermark(9)
    with pytest.raises(InvariantViolationError, match="past the leader's log end"):
        state.on_follower_fetch(1, 11, 10, 0)
    with pytest.raises(InvariantViolationError, match="not one of the new replicas"):
        state.replicas = [1, 2]
    assert state.isr == {0, 1, 2} and state.replicas == [0, 1, 2]


# --- random interleavings -----------------------------------------------------------------------------


class LeaderStateMachine(RuleBasedStateMachine):
    """A leader (replica 0) under random appends, follower fetches, clock advances, ISR changes that the
    real ClusterMetadata accepts (or that time out), and replica replacements learnt by heartbeat.

    The machine's own view of each follower: ``ends`` (what it holds at least: its last fetch offset;
    at the start, the high watermark for ISR members), ``fetched_ms`` and ``at_end_ms`` (its last fetch,
    and its last fetch at the leader's end; a new leader's grace period counts as both). ``lost``:
    members that fetched below the high watermark (they lost records they had): the watermark bound
    does not hold for them until they fetch at or above it again.
    """

    @initialize(
        replication_factor=st.integers(1, 5),
        data=st.data(),
        lag_ms=st.integers(1, 200),
        epoch_start=st.integers(0, 50),
    )
    def start(self, replication_factor, data, lag_ms, epoch_start):
        self.metadata = ClusterMetadata()
        self.metadata.create_topic("t", 1, replication_factor, None, [f"n{i}" for i in range(replication_factor)])
        replicas = list(range(replication_factor))
        isr = sorted(data.draw(st.sets(st.sampled_from(replicas))) | {0})
        assert self.metadata.alter_isr("t", 0, 0, 0, isr) == isr
        high_watermark = data.draw(st.integers(0, epoch_start))
        self.lag_ms = lag_ms
        self.now = 1_000
        self.leader_end = epoch_start
        self.epoch_start = epoch_start
        self.state = LeaderState(0, replicas, isr, 0, epoch_start, high_watermark, self.now)
        self.last_hw = high_watermark
        self.ends = {r: high_watermark if r in isr else 0 for r in replicas if r != 0}
        self.fetched_ms = {r: self.now for r in replicas if r != 0}
        self.at_end_ms = dict(self.fetched_ms)
        self.lost: set[int] = set()
        self.proposal: list[int] | None = None  # an ISR change in flight to the controller
        self.answer: tuple[list[int] | None] | None = None  # the controller's answer, on its way back
        self.dropped: set[int] = set()  # members the proposal in flight leaves out
        self.replaced: set[int] = set()

    def partition(self):
        return self.metadata.topics["t"].partitions[0]

    def members(self) -> set[int]:
        return self.state.isr | (self.state.pending_isr or set())

    def live_followers(self) -> list[int]:
        return [r for r in self.partition().replicas if r != 0]

    @rule(records=st.integers(1, 30))
    def append(self, records):
        self.leader_end += records
        self.state.update_high_watermark(self.leader_end)

    @rule(data=st.data())
    def follower_fetches(self, data):
        """A follower fetches at its log end: at most the leader's; an in-sync one holds everything below
        the high watermark, except now and then one that lost records it had."""
        live = self.live_followers()
        if not live:
            return
        follower = data.draw(st.sampled_from(live))
        hw = self.state.high_watermark
        in_sync = follower in self.members() and follower not in self.lost
        loses_records = in_sync and hw > 0 and data.draw(st.sampled_from([False] * 7 + [True]))
        if loses_records:
            offset = data.draw(st.integers(0, hw - 1))
        else:
            offset = data.draw(st.just(self.leader_end) | st.integers(hw if in_sync else 0, self.leader_end))
        self.state.on_follower_fetch(follower, offset, self.leader_end, self.now)
        if offset < hw and follower in self.members():
            self.lost.add(follower)
        elif offset >= hw:
            self.lost.discard(follower)
        self.ends[follower] = offset
        self.fetched_ms[follower] = self.now
        if offset >= self.leader_end:
            self.at_end_ms[follower] = self.now
        self.state.update_high_watermark(self.leader_end)

    @rule(data=st.data())
    def clock_advances(self, data):
        lag = self.lag_ms
        self.now += data.draw(st.sampled_from([lag - 1, lag, lag + 1]) | st.integers(0, 3 * lag))

    @rule(accept=st.booleans())
    def isr_change_moves_on(self, accept):
        """One step of the leader's ISR loop: propose; the controller decides (accepts and persists, or
        the call times out: ``accept``); its answer arrives. Anything may happen between the steps."""
        if self.proposal is None:
            self.propose()
        elif self.answer is None:
            self.answer = (self.metadata.alter_isr("t", 0, 0, 0, self.proposal) if accept else None,)
        else:
            self.answer_arrives()

    def propose(self):
        isr = set(self.state.isr)
        proposal = self.state.proposed_isr(self.leader_end, self.now, self.lag_ms)
        if proposal is None:
            return
        assert 0 in proposal and set(proposal) <= set(self.state.replicas)
        for r in isr - set(proposal):  # only a follower not caught up within the lag time leaves
            assert self.now - self.at_end_ms[r] > self.lag_ms, f"follower {r} fetched at the leader's end at {self.at_end_ms[r]}"
        for r in set(proposal) - isr:  # only a recent fetcher at the high watermark and the epoch start joins
            assert self.ends[r] >= max(self.state.high_watermark, self.epoch_start)
            assert self.now - self.fetched_ms[r] <= self.lag_ms
        assert self.state.proposed_isr(self.leader_end, self.now, self.lag_ms) is None  # one change at a time
        self.proposal, self.dropped = proposal, isr - set(proposal)

    def answer_arrives(self):
        (accepted,) = self.answer
        before = set(self.state.isr)
        self.state.isr_change_done(accepted)
        if accepted is None:
            assert self.state.isr == before
        else:
            assert self.state.isr == (set(accepted) & set(self.state.replicas)) | {0}
            assert self.state.isr >= before - self.dropped - self.replaced  # nobody else leaves
        assert self.state.pending_isr is None
        self.proposal, self.answer, self.dropped = None, None, set()
        self.state.update_high_watermark(self.leader_end)

    @rule(data=st.data())
    def controller_replaces_a_follower(self, data):
        live = self.live_followers()
        if not live:
            return
        in_flight = [r for r in live if self.proposal is not None and r in self.proposal]
        # Often one named in an ISR change in flight: its answer then names a replica the leader may no longer have.
        dead = data.draw(st.sampled_from(in_flight) | st.sampled_from(live) if in_flight else st.sampled_from(live))
        new = self.metadata.replace_replica("t", 0, dead, f"m{dead}")
        self.replaced.add(dead)
        self.ends[new], self.fetched_ms[new], self.at_end_ms[new] = 0, -(10**9), -(10**9)
        if data.draw(st.booleans()):  # the leader's next heartbeat reply may come before anything else
            self.heartbeat_reply()

    @rule()
    def heartbeat_reply(self):
        self.state.replicas = list(self.partition().replicas)
        assert not (self.state.isr & self.replaced)

    @invariant()
    def high_watermark_is_monotone_and_bounded(self):
        hw = self.state.high_watermark
        assert self.last_hw <= hw <= self.leader_end
        self.last_hw = hw
        for r in self.members() - {0} - self.lost:
            assert hw <= self.ends[r], f"high watermark {hw} passes member {r}'s log end {self.ends[r]}"

    @invariant()
    def membership(self):
        assert 0 in self.state.isr and self.state.isr <= set(self.state.replicas)
        if self.state.pending_isr is not None:
            assert 0 in self.state.pending_isr and self.state.pending_isr <= set(self.state.replicas)


LeaderStateMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_leader_state_machine = LeaderStateMachine.TestCase


def test_the_next_isr_check_is_when_a_lagging_member_runs_out_of_time():
    from logbus.protocol.replica_state import LeaderState

    state = LeaderState(0, [0, 1, 2], [0, 1, 2], 1, 0, 0, now_ms=1_000)
    # Both followers have a fetch waiting at the end: no timer at all.
    assert state.next_isr_check_ms(0, 10_000, waiting={1, 2}) is None
    # One is between fetches: it must fetch again within the lag time.
    assert state.next_isr_check_ms(0, 10_000, waiting={2}) == 11_001
    state.on_follower_fetch(1, 0, 0, 2_000)
    state.on_follower_fetch(2, 0, 0, 3_000)
    # The leader appends up to 5: both followers are behind; follower 1 caught up last at 2 s.
    assert state.next_isr_check_ms(5, 10_000, waiting={1, 2}) == 12_001
    state.on_follower_fetch(1, 5, 5, 4_000)  # follower 1 catches up, its next fetch waits at the end
    assert state.next_isr_check_ms(5, 10_000, waiting={1}) == 13_001
    assert state.proposed_isr(5, 13_000, 10_000) is None
    assert state.proposed_isr(5, 13_001, 10_000) == [0, 1]
