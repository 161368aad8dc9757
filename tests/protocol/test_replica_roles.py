"""ReplicaState: roles and epochs, the fence rule, a follower's decisions, the parked-follower ISR rule.

Each test feeds the state events with a real partition log (in a temporary
directory) and checks the actions it returns; the log is changed only by
carrying them out, as the replica actor does.
"""

from __future__ import annotations

import pytest

from logbus.errors import FencedLeaderEpochError, InvalidRecordError, NotLeaderError, OffsetOutOfRangeError
from logbus.protocol.messages import READ_COMMITTED, READ_UNCOMMITTED, FetchRequest, FetchResponse
from logbus.protocol.replica_state import (
    FENCE_ASK_DELAY_MS,
    FOLLOWER,
    FOLLOWER_RETRY_WAIT_MS,
    ISR_RETRY_DELAY_MS,
    ISR_TIMER,
    LEADER,
    ROLE_TIMER,
    UNKNOWN,
    AdvanceLogStart,
    AppendFromLeader,
    ArmTimer,
    AskEpochEnd,
    AskRole,
    HighWatermarkMoved,
    LeadershipChanged,
    ProposeIsr,
    ReplicaState,
    SaveEpoch,
    StartEpoch,
    StartFollowing,
    StartLogAt,
    StopFollowing,
    Truncate,
    apply_to_log,
    truncation_target,
)
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog
from logbus.storage.record_batch import encode_batch

LAG_MS = 4_000


@pytest.fixture
def open_log(tmp_path):
    opened = []

    def _open(name="r"):
        log = PartitionLog(str(tmp_path / name), LogConfig.from_dict({"replica.lag.time.max.ms": LAG_MS}))
        opened.append(log)
        return log

    yield _open
    for log in opened:
        log.close()


def append(log, epoch, count=1):
    for _ in range(count):
        log.append(encode_batch([b"x"]), leader_epoch=epoch)


def run(log, actions):
    """Carry out the log actions (the others are the owner's: timers, calls, tasks)."""
    for action in actions:
        if isinstance(action, (StartEpoch, Truncate, StartLogAt, AdvanceLogStart)):
            apply_to_log(log, action)
    return actions


def kinds(actions):
    return [type(action) for action in actions]


# --- roles -----------------------------------------------------------------------------------------------


def test_becoming_leader_saves_the_epoch_starts_it_in_the_log_and_keeps_the_follower_high_watermark(open_log):
    log = open_log()
    append(log, 0, 5)
    state = ReplicaState(1, 0, partition_name="t-0")
    run(log, state.become_follower(0, 0, "leader-0", log)[1])
    state.fetch_reply_applied(0, FetchResponse(5, 5, 4, 0, 0), log)  # the leader said: committed up to 4
    accepted, actions = state.become_leader(1, [0, 1, 2], [1, 2], log, now_ms=0)
    run(log, actions)
    assert accepted and state.role == LEADER and state.leader_epoch == 1
    assert kinds(actions)[:4] == [StopFollowing, SaveEpoch, LeadershipChanged, StartEpoch]
    assert log.epochs.entries[-1] == (1, 5)
    assert state.high_watermark(log.log_end_offset) == 4  # where it was: ISR members hold that much
    assert state.leader.isr == {1, 2}


def test_role_changes_are_idempotent_and_an_older_epoch_is_refused(open_log):
    log = open_log()
    state = ReplicaState(1, -1, partition_name="t-0")
    assert state.become_follower(3, 0, "leader-0", log) == (True, [SaveEpoch(3), LeadershipChanged(), StopFollowing(), StartFollowing(3, 0)])
    assert state.become_follower(3, 0, "leader-0", log) == (True, [])  # the controller sent it again
    # The same epoch and leader, but another process (Ray re-created the leader's actor): follow it anew.
    assert kinds(state.become_follower(3, 0, "leader-0-again", log)[1]) == [LeadershipChanged, StopFollowing, StartFollowing]
    assert state.become_follower(2, 2, "leader-2", log) == (False, [])
    assert state.become_leader(2, [0, 1, 2], [0, 1, 2], log, 0) == (False, [])
    assert state.role == FOLLOWER and state.leader_epoch == 3


def test_a_leader_with_a_new_replica_list_keeps_its_leadership(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1, 2], [0, 1, 2], log, 0)[1])
    leadership = state.leadership
    accepted, actions = state.become_leader(1, [0, 3, 2], [0, 1, 2], log, 0)
    assert accepted and state.leadership == leadership and SaveEpoch not in kinds(actions)
    assert state.leader.isr == {0, 2} and state.leader.replicas == [0, 3, 2]


def test_the_controllers_answer_is_reconciled(open_log):
    log = open_log()
    state = ReplicaState(1, 4, partition_name="t-0")
    assert state.role == UNKNOWN
    assert kinds(state.reconcile(0, 5, [0, 1], [0, 1], "leader-0", log, 0)) == [SaveEpoch, LeadershipChanged, StopFollowing, StartFollowing]
    assert state.reconcile(0, 5, [0, 1], [0, 1], "leader-0", log, 0) == []  # nothing stale
    run(log, state.reconcile(1, 6, [0, 1], [0, 1], None, log, 0))
    assert state.role == LEADER and state.leader_epoch == 6
    # A newer epoch without a leader: a leader steps down (it may no longer take writes).
    assert state.reconcile(None, 7, [0, 1], [1], None, log, 0) == [SaveEpoch(7), LeadershipChanged()]
    assert state.role == UNKNOWN and state.leader is None
    with pytest.raises(NotLeaderError):
        state.check_leader()


def test_requests_at_another_epoch_are_refused_with_the_right_error(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(5, [0, 1], [0, 1], log, 0)[1])
    assert state.check_leader(5) is state.leader
    with pytest.raises(FencedLeaderEpochError, match="request epoch 4, leader epoch 5"):
        state.check_leader(4)
    with pytest.raises(NotLeaderError, match="request epoch 6"):
        state.check_leader(6)
    with pytest.raises(OffsetOutOfRangeError, match="past the leader's log end"):
        state.on_replica_fetch(1, 5, 1, log, 0)


# --- the fence: ask for the role once per fence epoch -------------------------------------------------


def test_a_fence_past_our_epoch_arms_one_timer_then_asks_once_per_fence_epoch():
    state = ReplicaState(0, 3, partition_name="t-0")
    assert state.on_fence(3) == []  # ours
    assert state.on_fence(4) == [ArmTimer(ROLE_TIMER, FENCE_ASK_DELAY_MS)]
    assert state.on_fence(4) == []  # armed already
    assert state.role_timer_fired(4) == [AskRole(4)]
    assert state.on_fence(4) == []  # asked about already
    assert state.on_fence(5) == [ArmTimer(ROLE_TIMER, FENCE_ASK_DELAY_MS)]
    assert state.role_timer_fired(5) == [AskRole(5)]


def test_a_role_change_arriving_before_the_timer_means_no_question(open_log):
    log = open_log()
    state = ReplicaState(0, 3, partition_name="t-0")
    assert state.on_fence(4) == [ArmTimer(ROLE_TIMER, FENCE_ASK_DELAY_MS)]
    state.become_follower(4, 1, "leader-1", log)
    assert state.role_timer_fired(4) == []


# --- following: truncation by epoch, out of range, what a reply brings ---------------------------------


def test_truncation_keeps_what_the_leader_has_of_our_latest_epoch(open_log):
    leader, follower = open_log("leader"), open_log("follower")
    for log in (leader, follower):
        append(log, 0, 3)
    append(leader, 2, 2)  # the leader's epoch 2 starts at 3
    append(follower, 1, 4)  # the follower led epoch 1 (never committed) from 3
    state = ReplicaState(1, 1, partition_name="t-0")
    run(follower, state.become_follower(2, 0, "leader", follower)[1])
    step = state.next_fetch(2, follower)
    assert step == AskEpochEnd(1)
    answer = leader.epochs.end_offset_for(step.epoch, leader.log_end_offset)
    assert answer == (0, 3)  # the leader never had epoch 1; its epoch 0 ends at 3
    assert run(follower, state.on_epoch_end(2, *answer, follower)) == [Truncate(3)]
    assert follower.log_end_offset == 3
    request = state.next_fetch(2, follower)
    assert isinstance(request, FetchRequest) and request.offset == 3 and request.max_wait_ms == LAG_MS // 2


def test_truncation_asks_again_until_leader_and_follower_name_the_same_epoch(open_log):
    """KIP-279, as Kafka's fetcher: the leader never had the follower's latest epoch, and answers with one
    the follower never had either. The follower cuts where its own older epoch ends and asks about that
    one; cutting at the leader's end of its epoch kept records of the follower's that the leader lacks."""
    leader, follower = open_log("leader"), open_log("follower")
    for log in (leader, follower):
        append(log, 0, 5)  # offsets 0-4 of epoch 0: both have them
    append(follower, 0, 3)  # 5-7 of epoch 0: the old leader's, which this leader never got
    append(follower, 2, 4)  # 8-11: the follower led epoch 2 (elected uncleanly)
    append(leader, 1, 5)  # 5-9: this leader's epoch 1
    leader.epochs.assign(3, leader.log_end_offset)
    state = ReplicaState(1, 2, partition_name="t-0")
    run(follower, state.become_follower(3, 0, "leader", follower)[1])
    assert state.next_fetch(3, follower) == AskEpochEnd(2)
    assert leader.epochs.end_offset_for(2, leader.log_end_offset) == (1, 10)
    assert run(follower, state.on_epoch_end(3, 1, 10, follower)) == [Truncate(8)]  # epoch 2 goes
    assert state.next_fetch(3, follower) == AskEpochEnd(0)  # and again, about epoch 0
    assert leader.epochs.end_offset_for(0, leader.log_end_offset) == (0, 5)
    assert run(follower, state.on_epoch_end(3, 0, 5, follower)) == [Truncate(5)]
    assert isinstance(state.next_fetch(3, follower), FetchRequest) and follower.log_end_offset == 5


def test_truncation_target_cases(open_log):
    log = open_log()
    append(log, 0, 2)
    append(log, 3, 2)
    epochs = log.epochs
    assert truncation_target(epochs, 0, 4, -1, -1) == (0, None)  # the leader has no epoch as old: keep nothing
    assert truncation_target(epochs, 0, 4, 3, 10) == (4, None)  # the leader has more of epoch 3: keep all
    assert truncation_target(epochs, 0, 4, 3, 3) == (3, None)
    assert truncation_target(epochs, 0, 4, 0, 2) == (2, None)
    # The leader's epoch 1 is not ours: cut where our epoch 0 ends, then ask about epoch 0.
    assert truncation_target(epochs, 0, 4, 1, 3) == (2, 0)


def test_a_fetch_past_the_leader_or_below_its_start_is_resolved(open_log):
    log = open_log()
    append(log, 0, 3)
    state = ReplicaState(1, 0, partition_name="t-0")
    run(log, state.become_follower(1, 0, "leader", log)[1])
    state.on_epoch_end(1, 0, 3, log)
    # The leader's log starts past ours (its delete_records, or retention): start empty at its start.
    assert run(log, state.on_out_of_range(1, 10, 12, log)) == [StartLogAt(10)]
    assert (log.log_start_offset, log.log_end_offset) == (10, 10)
    # Our log runs past the leader's end: cut to its end, then truncate by epoch again before the next fetch.
    append(log, 0, 5)
    assert run(log, state.on_out_of_range(1, 0, 12, log)) == [Truncate(12)]
    assert log.log_end_offset == 12
    assert isinstance(state.next_fetch(1, log), AskEpochEnd)


def test_a_leader_with_no_epoch_of_ours_leaves_the_follower_its_committed_records(open_log):
    """A leader whose log is empty at its start (DeleteRecords took everything) holds no epoch: the
    follower keeps what is below its high watermark, as Kafka's fetcher does, and its high watermark
    does not go back."""
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(1, 0, partition_name="t-0")
    run(log, state.become_follower(0, 0, "leader-0", log)[1])
    state.fetch_reply_applied(0, FetchResponse(4, 4, 2, 0, 0), log)
    run(log, state.become_follower(1, 2, "leader-2", log)[1])
    assert state.next_fetch(1, log) == AskEpochEnd(0)
    assert run(log, state.on_epoch_end(1, -1, -1, log)) == [Truncate(2)]
    assert log.log_end_offset == 2 and state.high_watermark(log.log_end_offset) == 2


def test_a_reply_is_appended_then_the_leaders_log_start_and_high_watermark_are_adopted(open_log):
    log = open_log()
    state = ReplicaState(1, 0, partition_name="t-0")
    run(log, state.become_follower(1, 0, "leader", log)[1])
    state.on_fetch_failed(1)
    assert state.next_fetch(1, log).max_wait_ms == FOLLOWER_RETRY_WAIT_MS
    reply = FetchResponse(0, 3, 2, 1, 1)
    assert state.on_fetch_reply(1, reply, has_data=True) == [AppendFromLeader(0, 3)]
    append(log, 1, 3)  # what carrying out AppendFromLeader does, as far as the state can tell
    assert run(log, state.fetch_reply_applied(1, reply, log)) == [AdvanceLogStart(1), HighWatermarkMoved()]
    assert log.log_start_offset == 1 and state.high_watermark(log.log_end_offset) == 2
    assert state.next_fetch(1, log).max_wait_ms == LAG_MS // 2  # the reply ended the failing spell
    # A reply for an epoch the follower left is ignored.
    assert state.on_fetch_reply(0, reply, has_data=True) == []
    assert state.next_fetch(0, log) is None


def test_a_throttled_follower_asks_for_small_slices(open_log):
    log = open_log()
    state = ReplicaState(1, 0, partition_name="t-0")
    state.become_follower(1, 0, "leader", log)
    assert state.next_fetch(1, log, throttle_bytes_per_s=10 << 20).max_bytes == (10 << 20) // 5
    assert state.next_fetch(1, log, throttle_bytes_per_s=1).max_bytes == 64 << 10


# --- leading: parked followers, ISR proposals and answers ------------------------------------------------


def test_a_follower_parked_at_the_end_counts_as_caught_up_while_it_waits(open_log):
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    run(log, state.on_replica_fetch(1, 1, 4, log, now_ms=100))
    token = state.park(1, 4, now_ms=100)
    # While its fetch waits at the end, no timer is needed for follower 1 until the fetch would expire.
    actions = state.check_isr(log, now_ms=500)
    assert actions == [ArmTimer(ISR_TIMER, 100 + LAG_MS + 1 - 500)]
    # Past the lag time, a fetch parked that long no longer counts (a paused follower sends no other):
    # the follower leaves the ISR once the lag time has passed since it last counted (at 500).
    assert ProposeIsr not in kinds(state.check_isr(log, now_ms=100 + LAG_MS + 2))
    assert ProposeIsr(state.leadership, 1, (0,)) in state.check_isr(log, now_ms=500 + LAG_MS + 1)
    state.unpark(1, token)
    assert state.parked == {}


def test_an_append_with_a_parked_follower_renews_it_first(open_log):
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    run(log, state.on_replica_fetch(1, 1, 4, log, now_ms=10))
    state.park(1, 4, now_ms=10)
    state.before_append(log, now_ms=900)  # the follower was at the end up to now
    append(log, 1)
    actions = state.after_append(log, now_ms=900)
    assert ProposeIsr not in kinds(actions)
    assert state.leader.followers[1].last_caught_up_ms == 900


def test_followers_whose_node_died_leave_the_isr_at_once_and_come_back_only_by_fetching(open_log):
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1, 2], [0, 1, 2], log, 0)[1])
    for follower in (1, 2):
        run(log, state.on_replica_fetch(follower, 1, 4, log, now_ms=100))
    state.park(2, 4, now_ms=100)  # a fetch of follower 2 waits at the end when its node dies
    assert ProposeIsr not in kinds(state.check_isr(log, now_ms=200))
    # Another epoch's notice changes nothing; this one's drops 2 well within the lag time.
    assert state.followers_gone(0, [2], log, now_ms=300) == []
    actions = state.followers_gone(1, [2, 0, 7], log, now_ms=300)  # the leader itself and non-replicas are passed over
    assert ProposeIsr(state.leadership, 1, (0, 1)) in actions and 2 not in state.parked
    run(log, state.isr_answered(state.leadership, [0, 1], log, now_ms=310))
    assert state.leader.isr == {0, 1}
    # Not back by itself (it fetched recently, and is at the high watermark)...
    assert ProposeIsr not in kinds(state.check_isr(log, now_ms=400))
    # ...but by fetching again at the end, as any follower that returns.
    assert ProposeIsr(state.leadership, 1, (0, 1, 2)) in run(log, state.on_replica_fetch(2, 1, 4, log, now_ms=500))


def test_isr_answers_for_an_earlier_leadership_are_ignored(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    actions = state.check_isr(log, now_ms=LAG_MS + 5)
    (proposal,) = [a for a in actions if isinstance(a, ProposeIsr)]
    run(log, state.become_leader(2, [0, 1], [0, 1], log, LAG_MS + 6)[1])
    assert state.isr_answered(proposal.leadership, [0], log, LAG_MS + 7) == []
    assert state.leader.isr == {0, 1}


def test_a_standalone_replica_proposes_nothing(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0", controlled=False)
    accepted, actions = state.become_leader(1, [0, 1], [0, 1], log, 0)
    assert accepted and not any(isinstance(a, (ProposeIsr, ArmTimer)) for a in actions)
    assert state.check_isr(log, now_ms=10 * LAG_MS) == []


# --- read limits: the high watermark, and the last stable offset for read_committed ----------------------


def test_read_committed_stops_at_the_oldest_ongoing_transaction_below_the_high_watermark(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    append(log, 1, 2)  # offsets 0-1, not yet on the follower
    # Nothing is committed yet: both levels stop at the high watermark.
    assert state.read_limit(READ_UNCOMMITTED, log) == state.read_limit(READ_COMMITTED, log) == 0
    transaction = encode_batch([b"t", b"t"], producer_id=7, producer_epoch=0, base_sequence=0, transactional=True)
    log.append(transaction, leader_epoch=1)  # offsets 2-3: a transaction starts at 2
    append(log, 1)  # offset 4
    run(log, state.on_replica_fetch(1, 1, 5, log, now_ms=10))  # the follower holds everything: HW 5
    assert state.read_limit(READ_UNCOMMITTED, log) == 5
    assert state.read_limit(READ_COMMITTED, log) == state.last_stable_offset(log) == 2
    assert state.reply_stable_offset(log) == 2
    log.append_marker(7, 0, True, 0, leader_epoch=1)  # offset 5 commits it; the marker is not committed yet
    assert state.last_stable_offset(log) == 5  # no transaction is ongoing: the high watermark
    run(log, state.on_replica_fetch(1, 1, 6, log, now_ms=20))
    assert state.read_limit(READ_COMMITTED, log) == state.read_limit(READ_UNCOMMITTED, log) == 6
    with pytest.raises(InvalidRecordError):
        state.read_limit(2, log)


def test_a_follower_replies_with_its_high_watermark_as_the_stable_offset(open_log):
    leader_log, log = open_log("leader"), open_log("follower")
    leader_log.append(encode_batch([b"t"], producer_id=7, producer_epoch=0, base_sequence=0, transactional=True), leader_epoch=1)
    append(leader_log, 1)
    state = ReplicaState(1, -1, partition_name="t-0")
    run(log, state.become_follower(1, 0, "leader", log)[1])
    copy = leader_log.read(0, 1 << 20, verify_crc=False)
    log.append_as_follower(bytes(copy.data), copy.first_offset, copy.next_offset)  # offset 0 opens a transaction
    state.fetch_reply_applied(1, FetchResponse(2, 2, 2, 0, 1), log)
    assert state.high_watermark(log.log_end_offset) == 2
    assert state.last_stable_offset(log) == 0  # its own log's open transaction
    assert state.reply_stable_offset(log) == 2  # a follower has no last stable offset of its own


# --- the high watermark never goes back ------------------------------------------------------------------


def test_a_follower_keeps_the_higher_high_watermark_it_learnt_from_an_earlier_leader(open_log):
    """A new leader's high watermark lags the one its predecessor reached (it learns it from the
    fetches of its own followers); a follower that knew the higher one keeps it."""
    log = open_log()
    append(log, 0, 8)
    state = ReplicaState(2, 0, partition_name="t-0")
    run(log, state.become_follower(0, 0, "leader-0", log)[1])
    state.fetch_reply_applied(0, FetchResponse(8, 8, 8, 0, 0), log)
    run(log, state.become_follower(1, 1, "leader-1", log)[1])
    assert state.fetch_reply_applied(1, FetchResponse(8, 8, 5, 0, 1), log) == []
    assert state.high_watermark(log.log_end_offset) == 8
    assert state.fetch_reply_applied(1, FetchResponse(8, 8, 9, 0, 1), log) == [HighWatermarkMoved()]


def test_a_leader_that_steps_down_keeps_its_high_watermark(open_log):
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    run(log, state.on_replica_fetch(1, 1, 4, log, now_ms=10))
    assert state.high_watermark(log.log_end_offset) == 4
    state.step_down(2)
    assert state.role == UNKNOWN and state.high_watermark(log.log_end_offset) == 4


def test_a_follower_cut_below_its_high_watermark_after_an_unclean_election_takes_the_lower_one(open_log, caplog):
    log = open_log()
    append(log, 0, 6)
    state = ReplicaState(1, 0, partition_name="t-0")
    run(log, state.become_follower(0, 0, "leader-0", log)[1])
    state.fetch_reply_applied(0, FetchResponse(6, 6, 6, 0, 0), log)
    run(log, state.become_follower(1, 2, "leader-2", log)[1])  # 2 was out of the ISR: it has only 3 records
    assert state.next_fetch(1, log) == AskEpochEnd(0)
    assert run(log, state.on_epoch_end(1, 0, 3, log)) == [Truncate(3)]
    assert "below its high watermark 6" in caplog.text
    append(log, 1, 3)  # what the new leader sends: not committed until it says so
    assert state.high_watermark(log.log_end_offset) == 3


# --- an ISR change the controller did not answer ---------------------------------------------------------


def test_an_unanswered_isr_change_stays_pending_and_the_same_is_asked_again(open_log):
    """The controller may have taken a change whose answer was lost: until an answer says which ISR is in
    force, the high watermark waits for the old and the proposed members alike, and nothing else is asked."""
    log = open_log()
    append(log, 0, 4)
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1, 2], [0, 1], log, 0)[1])
    run(log, state.on_replica_fetch(1, 1, 4, log, now_ms=10))
    expand = ProposeIsr(state.leadership, 1, (0, 1, 2))
    assert expand in state.on_replica_fetch(2, 1, 4, log, now_ms=20)  # 2 caught up: it joins
    assert ProposeIsr not in kinds(state.check_isr(log, now_ms=21))  # one at a time
    assert state.isr_unanswered(state.leadership) == [ArmTimer(ISR_TIMER, ISR_RETRY_DELAY_MS)]
    assert state.leader.pending_isr == {0, 1, 2} and state.leader.isr == {0, 1}
    append(log, 1, 2)
    actions = run(log, state.on_replica_fetch(1, 1, 6, log, now_ms=30))
    assert state.high_watermark(log.log_end_offset) == 4  # 2, still at 4, holds it: the controller may count it
    assert expand in actions  # the same change, asked again
    state.isr_answered(state.leadership, [0, 1, 2], log, now_ms=40)
    assert state.leader.isr == {0, 1, 2} and state.leader.pending_isr is None


def test_a_refused_isr_change_is_dropped(open_log):
    log = open_log()
    state = ReplicaState(0, -1, partition_name="t-0")
    run(log, state.become_leader(1, [0, 1], [0, 1], log, 0)[1])
    (proposal,) = [a for a in state.check_isr(log, now_ms=LAG_MS + 5) if isinstance(a, ProposeIsr)]
    assert state.isr_answered(proposal.leadership, None, log, LAG_MS + 6)[-1] == ArmTimer(ISR_TIMER, ISR_RETRY_DELAY_MS)
    assert state.leader.isr == {0, 1} and state.leader.pending_isr is None
