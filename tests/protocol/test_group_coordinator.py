"""The group coordinator as a state machine driven by calls and a fake clock: no Ray, no I/O.

Unit tests walk Kafka's flows one call at a time; the property tests drive
random groups of simulated consumers (each following the consumer contract in
the module docstring) through joins, leaves, crashes, stalls, static restarts,
topic changes and coordinator restarts, and check the ownership invariant
after every call.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import (
    CorruptRecordError,
    GroupNotEmptyError,
    IllegalGenerationError,
    IllegalStateError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidPartitionError,
    InvalidRecordError,
    InvalidTopicError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from logbus.protocol.assignors import RebalanceProtocol, get_assignor
from logbus.protocol.group_coordinator import (
    OFFSET_METADATA_BYTES_MAX,
    VALID_PREVIOUS_STATES,
    GroupCoordinator,
    GroupState,
    HeartbeatResult,
    JoinPending,
    JoinResult,
    OffsetAndMetadata,
    decode_offset_commit_key,
    decode_offset_commit_value,
    encode_offset_commit,
    long_poll_wait_ms,
    offset_commit_key,
    offsets_topic_partition_for,
    validate_group_id,
)
from logbus.protocol.messages import TopicPartition

SESSION_MS = 3_000
REBALANCE_MS = 5_000
MAX_POLL_MS = 4_000
TIMEOUTS = dict(session_timeout_ms=SESSION_MS, rebalance_timeout_ms=REBALANCE_MS, max_poll_interval_ms=MAX_POLL_MS)


def make_coordinator(counts=None, **options) -> GroupCoordinator:
    ids = itertools.count()
    return GroupCoordinator(
        topic_partition_counts=counts if counts is not None else {"t": 4},
        new_member_id=lambda prefix: f"{prefix}-{next(ids):04d}",
        **options,
    )


def tp(topic: str, partition: int) -> TopicPartition:
    return TopicPartition(topic, partition)


def join_new(gc: GroupCoordinator, now_ms: int, group="g", topics=("t",), protocols=("range",), **kw):
    """A dynamic member's first join: get an id (KIP-394), then join with it."""
    pending = gc.join(group, topics=topics, protocols=protocols, now_ms=now_ms, **TIMEOUTS, **kw)
    assert isinstance(pending, JoinPending) and pending.retry_backoff_ms == 0
    return gc.join(group, member_id=pending.member_id, topics=topics, protocols=protocols, now_ms=now_ms, **TIMEOUTS, **kw)


def rejoin(gc, member_id, now_ms, group="g", topics=("t",), protocols=("range",), owned=(), **kw):
    return gc.join(group, member_id=member_id, topics=topics, protocols=protocols, owned=owned, now_ms=now_ms, **TIMEOUTS, **kw)


# --- the state table ---------------------------------------------------------------------------


def test_transition_table_is_kafkas():
    S = GroupState
    assert VALID_PREVIOUS_STATES[S.COMPLETING_REBALANCE] == {S.PREPARING_REBALANCE}
    assert VALID_PREVIOUS_STATES[S.STABLE] == {S.COMPLETING_REBALANCE}
    assert VALID_PREVIOUS_STATES[S.EMPTY] == {S.PREPARING_REBALANCE}
    assert VALID_PREVIOUS_STATES[S.PREPARING_REBALANCE] == {S.EMPTY, S.STABLE, S.COMPLETING_REBALANCE}


# --- joining -----------------------------------------------------------------------------------


def test_single_member_joins_and_gets_everything():
    gc = make_coordinator()
    first = gc.join("g", topics=["t"], now_ms=0, **TIMEOUTS)
    assert first == JoinPending("consumer-0000", 0)
    assert gc.describe("g").state is GroupState.EMPTY  # an issued id is not yet a member
    result = rejoin(gc, first.member_id, 0)
    assert result == JoinResult("consumer-0000", 1, "range", (tp("t", 0), tp("t", 1), tp("t", 2), tp("t", 3)), ())
    described = gc.describe("g")
    assert (described.state, described.generation, described.protocol) == (GroupState.STABLE, 1, "range")
    assert gc.list_groups() == [("g", GroupState.STABLE, "range")]


def test_second_member_triggers_an_eager_rebalance():
    gc = make_coordinator()
    a = join_new(gc, 0)
    b = join_new(gc, 100)
    assert isinstance(b, JoinPending) and b.retry_backoff_ms == 100
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE
    assert gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=200) == HeartbeatResult(True, ())
    # Commits with the current generation are still allowed while the group prepares (Kafka does too).
    gc.commit_offsets("g", a.member_id, a.generation, {("t", 0): 7}, now_ms=200)
    a2 = rejoin(gc, a.member_id, 300)  # eager: a revoked everything and reports nothing
    assert a2.generation == 2 and a2.assignment == (tp("t", 0), tp("t", 1))
    assert gc.describe("g").state is GroupState.COMPLETING_REBALANCE
    with pytest.raises(IllegalGenerationError):
        gc.commit_offsets("g", a.member_id, 1, {("t", 0): 8}, now_ms=300)
    b2 = rejoin(gc, b.member_id, 400)
    assert b2.generation == 2 and b2.assignment == (tp("t", 2), tp("t", 3))
    assert gc.describe("g").state is GroupState.STABLE


def test_unknown_member_id_is_rejected():
    gc = make_coordinator()
    with pytest.raises(UnknownMemberIdError):
        rejoin(gc, "nobody", 0)
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", "nobody", 1, poll_idle_ms=0, now_ms=0)
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("no-such-group", "nobody", 1, poll_idle_ms=0, now_ms=0)
    with pytest.raises(UnknownMemberIdError):
        rejoin(gc, "nobody", 0, group="no-such-group")
    assert gc.list_groups() == []  # a failed join creates no group


def test_issued_member_ids_expire():
    gc = make_coordinator()
    pending = gc.join("g", topics=["t"], now_ms=0, **TIMEOUTS)
    with pytest.raises(UnknownMemberIdError):
        rejoin(gc, pending.member_id, SESSION_MS + 1)


def test_rejoin_with_the_same_subscription_returns_the_same_generation():
    gc = make_coordinator()
    a = join_new(gc, 0)
    assert rejoin(gc, a.member_id, 10) == a  # e.g. a retried join whose response was lost
    assert gc.sync("g", a.member_id, a.generation, now_ms=20) == a


def test_subscription_change_triggers_a_rebalance():
    gc = make_coordinator({"t": 2, "u": 2})
    a = join_new(gc, 0)
    result = rejoin(gc, a.member_id, 10, topics=("t", "u"))
    assert result.generation == 2
    assert result.assignment == (tp("t", 0), tp("t", 1), tp("u", 0), tp("u", 1))


def test_initial_rebalance_delay_lets_more_members_join():
    gc = make_coordinator(initial_rebalance_delay_ms=1_000)
    a = join_new(gc, 0)
    b = join_new(gc, 500)
    assert isinstance(a, JoinPending) and isinstance(b, JoinPending)
    assert isinstance(rejoin(gc, a.member_id, 999), JoinPending)
    a2 = rejoin(gc, a.member_id, 1_000)
    assert a2.generation == 1 and len(a2.assignment) == 2  # one generation for both


def test_protocol_selection_and_inconsistent_protocols():
    gc = make_coordinator()
    a = join_new(gc, 0, protocols=("roundrobin", "range"))
    assert a.protocol == "roundrobin"
    b = join_new(gc, 10, protocols=("range",))
    a2 = rejoin(gc, a.member_id, 20, protocols=("roundrobin", "range"))
    assert a2.protocol == "range" and a2.generation == 2
    with pytest.raises(InvalidConfigError):
        gc.join("g", topics=["t"], protocols=["cooperative-sticky"], now_ms=30)
    assert b.member_id in {m.member_id for m in gc.describe("g").members}


def test_join_argument_validation():
    gc = make_coordinator()
    bad = [
        dict(topics=()),  # neither topics nor pattern
        dict(topics="t"),  # a str, not a collection
        dict(topics=["t"], protocols=()),
        dict(topics=["t"], protocols=["sticky"]),
        dict(topics=["t"], protocols=["range", "range"]),
        dict(topics=["t"], pattern="("),
        dict(topics=["t"], session_timeout_ms=10),
        dict(topics=["t"], rebalance_timeout_ms=0),
        dict(topics=["t"], group_instance_id=""),
        dict(topics=["t"], client_id="a\nb"),
        dict(topics=["t"], owned=[("t",)]),
    ]
    for kwargs in bad:
        with pytest.raises(InvalidConfigError):
            gc.join("g", now_ms=0, **kwargs)
    with pytest.raises(InvalidTopicError):
        gc.join("g", topics=["bad topic"], now_ms=0)
    with pytest.raises(InvalidPartitionError):
        gc.join("g", topics=["t"], owned=[("t", -1)], now_ms=0)


@pytest.mark.parametrize("group_id", ["", "a" * 256, "tab\there", "nul\x00", None, 7, b"g"])
def test_invalid_group_ids(group_id):
    with pytest.raises(InvalidGroupIdError):
        validate_group_id(group_id)
    gc = make_coordinator()
    with pytest.raises(InvalidGroupIdError):
        gc.join(group_id, topics=["t"], now_ms=0)
    with pytest.raises(InvalidGroupIdError):
        gc.commit_offsets(group_id, "", -1, {("t", 0): 1}, now_ms=0)
    with pytest.raises(InvalidGroupIdError):
        gc.describe(group_id)


def test_valid_group_ids():
    for group_id in ("g", "my group.v2", "a" * 255, "ünïcode-grüppe"):
        assert validate_group_id(group_id) == group_id


def test_group_size_and_group_count_limits():
    gc = make_coordinator(group_size_max=2, groups_max=1)
    join_new(gc, 0)
    join_new(gc, 0)
    with pytest.raises(IllegalStateError):
        gc.join("g", topics=["t"], now_ms=0, **TIMEOUTS)
    with pytest.raises(IllegalStateError):
        gc.join("other", topics=["t"], now_ms=0, **TIMEOUTS)


# --- timeouts ----------------------------------------------------------------------------------


def stable_pair(gc, protocols=("range",)):
    """Two members in a Stable generation 2."""
    a = join_new(gc, 0, protocols=protocols)
    b = join_new(gc, 0, protocols=protocols)
    a = rejoin(gc, a.member_id, 0, protocols=protocols)
    b = rejoin(gc, b.member_id, 0, protocols=protocols)
    assert gc.describe("g").state is GroupState.STABLE and a.generation == b.generation == 2
    return a, b


def test_session_timeout_removes_a_member_and_rebalances():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=SESSION_MS)
    assert gc.tick(SESSION_MS) == []
    removed = gc.tick(SESSION_MS + 1)
    assert [(r.member_id, r.reason) for r in removed] == [(b.member_id, "session timeout")]
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE
    a3 = rejoin(gc, a.member_id, SESSION_MS + 2)
    assert a3.generation == 3 and len(a3.assignment) == 4
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=SESSION_MS + 3)


def test_a_stall_of_the_coordinators_process_is_not_counted_against_sessions():
    # The caller ticks every 100 ms while groups have members; a longer gap is its process stalling, with
    # the members' heartbeats queued behind the stall.
    gc = make_coordinator(stall_ms=1_000)
    a, b = stable_pair(gc)
    for now in range(100, 1_001, 100):
        assert gc.tick(now) == []
    # 10 s without a call: the first heartbeat processed after the stall (a's) finds both members in.
    after = 1_000 + 10_000
    assert gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=after) == HeartbeatResult(False, ())
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=after + 10) == HeartbeatResult(False, ())
    assert gc.tick(after + 100) == []
    # Time after the stall counts again: b heard last at after + 10 goes a session later.
    for now in range(after + 200, after + SESSION_MS + 11, 100):
        gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=now)
        assert gc.tick(now) == []
    removed = gc.tick(after + SESSION_MS + 100)
    assert [(r.member_id, r.reason) for r in removed] == [(b.member_id, "session timeout")]


def test_without_stall_compensation_every_gap_counts():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=SESSION_MS + 1)
    assert {r.member_id for r in gc.tick(SESSION_MS + 2)} == {a.member_id, b.member_id}


def test_a_stall_moves_issued_member_ids_and_rebalance_timeouts_too():
    gc = make_coordinator(stall_ms=1_000)
    pending = gc.join("g", topics=["t"], now_ms=0, **TIMEOUTS)
    # 5 s with no call, past the issued id's expiry (SESSION_MS): the id is still good after the stall.
    assert rejoin(gc, pending.member_id, 5_000).generation == 1

    gc = make_coordinator(stall_ms=1_000)
    a, b = stable_pair(gc)
    c = join_new(gc, 1_000)  # c starts a rebalance at t=1000; b never rejoins
    now = 1_000
    while now < 1_000 + REBALANCE_MS - 500:
        now += 500
        assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=now).rejoin
        assert isinstance(rejoin(gc, a.member_id, now), JoinPending)
        assert isinstance(rejoin(gc, c.member_id, now), JoinPending)
    # A 10 s stall past the rebalance deadline: the members are heard first, and b is still waited for.
    now += 10_000
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=now).rejoin
    assert isinstance(rejoin(gc, a.member_id, now), JoinPending)
    assert b.member_id in {m.member_id for m in gc.describe("g").members}
    # The rest of the rebalance timeout, counted after the stall, evicts it.
    result = rejoin(gc, a.member_id, now + 1_000)
    assert result.generation == 3
    assert b.member_id not in {m.member_id for m in gc.describe("g").members}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=30_000), min_size=1, max_size=20))
def test_gaps_longer_than_the_stall_threshold_never_expire_a_member_heard_just_before(gaps):
    gc = make_coordinator(stall_ms=1_000)
    a, _ = stable_pair(gc)
    now = 0
    for gap in gaps:
        now += gap
        # a is heard on every call: only a gap of at most stall_ms between calls counts, which is below its session.
        result = gc.heartbeat("g", a.member_id, gc.describe("g").generation, poll_idle_ms=0, now_ms=now)
        assert isinstance(result, HeartbeatResult)
        assert a.member_id in [m.member_id for m in gc.describe("g").members]


def test_max_poll_interval_removes_a_member():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    assert gc.heartbeat("g", a.member_id, 2, poll_idle_ms=MAX_POLL_MS, now_ms=100) == HeartbeatResult(False, ())
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", a.member_id, 2, poll_idle_ms=MAX_POLL_MS + 1, now_ms=200)
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE
    assert [m.member_id for m in gc.describe("g").members] == [b.member_id]
    assert [r.reason for r in gc.tick(300)] == ["max poll interval exceeded"]


def test_rebalance_timeout_evicts_members_that_do_not_rejoin():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    c = join_new(gc, 1_000)  # c starts a rebalance at t=1000
    # b keeps heartbeating (its session stays alive) but never rejoins.
    for now in range(1_500, 1_000 + REBALANCE_MS + 1, 1_000):
        assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=now).rejoin
        assert isinstance(rejoin(gc, a.member_id, now), JoinPending)
        assert isinstance(rejoin(gc, c.member_id, now), JoinPending)
    result = rejoin(gc, a.member_id, 1_000 + REBALANCE_MS + 1)
    assert result.generation == 3
    assert b.member_id not in {m.member_id for m in gc.describe("g").members}
    assert [r.reason for r in gc.tick(1_000 + REBALANCE_MS + 2)] == ["rebalance timeout"]


def test_members_that_never_collect_their_assignment_are_evicted():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    rejoin(gc, a.member_id, 100, topics=("t",), protocols=("range",), pattern="x.*")  # rebalance
    rejoin(gc, b.member_id, 100)
    assert gc.describe("g").state is GroupState.COMPLETING_REBALANCE  # a has not collected gen 3
    for now in range(1_000, 100 + REBALANCE_MS + 1, 1_000):
        # b commits fine (it has gen 3); a heartbeats with gen 2 and is told to rejoin.
        gc.commit_offsets("g", b.member_id, 3, {("t", 2): 1}, now_ms=now)
        assert gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=now) == HeartbeatResult(True, ())
    gc.heartbeat("g", b.member_id, 3, poll_idle_ms=0, now_ms=100 + REBALANCE_MS + 1)
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE
    assert [m.member_id for m in gc.describe("g").members] == [b.member_id]


def test_last_member_leaving_empties_the_group_with_a_new_generation():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    assert gc.leave("g", a.member_id, now_ms=10)
    assert not gc.leave("g", a.member_id, now_ms=11)  # idempotent
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE
    assert gc.leave("g", b.member_id, now_ms=12)
    described = gc.describe("g")
    assert (described.state, described.generation, described.members) == (GroupState.EMPTY, 3, ())
    assert not gc.leave("unknown", "x", now_ms=13)


# --- static membership -------------------------------------------------------------------------


def test_static_member_restart_keeps_its_assignment_without_rebalance():
    gc = make_coordinator()
    a = gc.join("g", group_instance_id="host-a", topics=["t"], now_ms=0, **TIMEOUTS)
    assert isinstance(a, JoinResult)  # static members skip the member-id round trip
    b = join_new(gc, 0)
    a = gc.join("g", member_id=a.member_id, group_instance_id="host-a", topics=["t"], now_ms=0, **TIMEOUTS)
    b = rejoin(gc, b.member_id, 0)
    assert (a.generation, b.generation) == (2, 2) and len(a.assignment) == 2
    # host-a's process dies and comes back within its session timeout, with no member id.
    back = gc.join("g", group_instance_id="host-a", topics=["t"], now_ms=SESSION_MS - 1, **TIMEOUTS)
    assert isinstance(back, JoinResult)
    assert (back.generation, back.assignment) == (2, a.assignment) and back.member_id != a.member_id
    assert gc.describe("g").state is GroupState.STABLE
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=SESSION_MS) == HeartbeatResult(False, ())
    # The old process is fenced.
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=SESSION_MS)
    with pytest.raises(UnknownMemberIdError):
        gc.commit_offsets("g", a.member_id, 2, {("t", 0): 1}, now_ms=SESSION_MS)
    with pytest.raises(UnknownMemberIdError):
        gc.join("g", member_id=a.member_id, group_instance_id="host-a", topics=["t"], now_ms=SESSION_MS, **TIMEOUTS)
    gc.commit_offsets("g", back.member_id, 2, {("t", 0): 1}, now_ms=SESSION_MS)


def test_static_member_back_after_its_session_expired_rebalances():
    gc = make_coordinator()
    a = gc.join("g", group_instance_id="host-a", topics=["t"], now_ms=0, **TIMEOUTS)
    back = gc.join("g", group_instance_id="host-a", topics=["t"], now_ms=SESSION_MS + 1, **TIMEOUTS)
    assert back.generation == 3  # removed (gen 2, Empty), then joined as new (gen 3)
    assert back.member_id != a.member_id


def test_static_member_with_a_new_subscription_rebalances():
    gc = make_coordinator({"t": 2, "u": 2})
    a = gc.join("g", group_instance_id="host-a", topics=["t"], now_ms=0, **TIMEOUTS)
    back = gc.join("g", group_instance_id="host-a", topics=["u"], now_ms=10, **TIMEOUTS)
    assert back.generation == a.generation + 1 and back.assignment == (tp("u", 0), tp("u", 1))


# --- cooperative-sticky ------------------------------------------------------------------------


def test_cooperative_two_phase_rebalance():
    gc = make_coordinator()
    coop = ("cooperative-sticky",)
    a = join_new(gc, 0, protocols=coop)
    assert a.assignment == (tp("t", 0), tp("t", 1), tp("t", 2), tp("t", 3))
    b = join_new(gc, 10, protocols=coop)
    assert gc.heartbeat("g", a.member_id, 1, poll_idle_ms=0, now_ms=20) == HeartbeatResult(True, ())
    # a keeps fetching while it rejoins, reporting what it owns.
    a2 = rejoin(gc, a.member_id, 30, protocols=coop, owned=a.assignment)
    assert a2.generation == 2
    assert a2.assignment == (tp("t", 0), tp("t", 1)) and a2.revoke == (tp("t", 2), tp("t", 3))
    b2 = rejoin(gc, b.member_id, 30, protocols=coop)
    assert b2.generation == 2 and b2.assignment == ()  # t-2 and t-3 are still a's
    assert gc.describe("g").state is GroupState.STABLE
    # Until a confirms the revocation, its heartbeats repeat it, and nobody else gets the partitions.
    assert gc.heartbeat("g", a.member_id, 2, poll_idle_ms=0, now_ms=40) == HeartbeatResult(True, (tp("t", 2), tp("t", 3)))
    pending = {m.member_id: m.pending_revocation for m in gc.describe("g").members}
    assert pending == {a.member_id: (tp("t", 2), tp("t", 3)), b.member_id: ()}
    # a revokes (after committing t-2, t-3 with generation 2) and rejoins: phase two.
    gc.commit_offsets("g", a.member_id, 2, {("t", 2): 5, ("t", 3): 6}, now_ms=50)
    a3 = rejoin(gc, a.member_id, 60, protocols=coop, owned=a2.assignment)
    assert isinstance(a3, JoinPending)
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=60).rejoin
    b3 = rejoin(gc, b.member_id, 70, protocols=coop, owned=b2.assignment)
    assert b3.generation == 3 and b3.assignment == (tp("t", 2), tp("t", 3)) and b3.revoke == ()
    a3 = rejoin(gc, a.member_id, 70, protocols=coop, owned=a2.assignment)
    assert a3.assignment == (tp("t", 0), tp("t", 1)) and a3.revoke == ()


def test_cooperative_member_that_never_revokes_blocks_the_move():
    gc = make_coordinator()
    coop = ("cooperative-sticky",)
    a = join_new(gc, 0, protocols=coop)
    b = join_new(gc, 10, protocols=coop)
    a2 = rejoin(gc, a.member_id, 20, protocols=coop, owned=a.assignment)
    rejoin(gc, b.member_id, 20, protocols=coop)
    # A new rebalance starts while a still holds t-2/t-3 (a's report still claims them).
    rejoin(gc, b.member_id, 30, protocols=coop, topics=("t",), pattern="zzz")
    a3 = rejoin(gc, a.member_id, 40, protocols=coop, owned=a.assignment)
    assert a3.generation == 3 and set(a3.revoke) == {tp("t", 2), tp("t", 3)}
    b3 = rejoin(gc, b.member_id, 40, protocols=coop, topics=("t",), pattern="zzz")
    assert b3.assignment == ()
    del a2


def test_claims_of_partitions_never_given_are_ignored():
    gc = make_coordinator()
    coop = ("cooperative-sticky",)
    a = join_new(gc, 0, protocols=coop, topics=("t",))
    b = join_new(gc, 0, protocols=coop)
    a = rejoin(gc, a.member_id, 0, protocols=coop, owned=a.assignment)
    # b claims partitions it was never given: they do not count as b's.
    b = rejoin(gc, b.member_id, 0, protocols=coop, owned=[("t", 0), ("t", 1), ("t", 2), ("t", 3)])
    assert b.assignment == () and b.revoke == ()


# --- metadata changes --------------------------------------------------------------------------


def test_partition_count_change_triggers_a_rebalance():
    gc = make_coordinator({"t": 2, "other": 1})
    a = join_new(gc, 0)
    assert gc.metadata_changed({"t": 2, "other": 5, "new": 1}, now_ms=10) == []  # not subscribed
    assert gc.metadata_changed({"t": 3, "other": 5}, now_ms=20) == ["g"]
    a2 = rejoin(gc, a.member_id, 30)
    assert a2.generation == 2 and len(a2.assignment) == 3
    assert gc.metadata_changed({"other": 5}, now_ms=40) == ["g"]  # t deleted
    assert rejoin(gc, a.member_id, 50).assignment == ()


def test_pattern_subscription_picks_up_new_topics_but_not_internal_ones():
    gc = make_coordinator({"orders-eu": 1, "payments": 1})
    a = gc.join("g", group_instance_id="i", pattern=r"orders-.*", now_ms=0, **TIMEOUTS)
    assert a.assignment == (tp("orders-eu", 0),)
    assert gc.metadata_changed({"orders-eu": 1, "payments": 1, "__orders-internal": 3}, now_ms=10) == []
    assert gc.metadata_changed({"orders-eu": 1, "orders-us": 2, "payments": 1}, now_ms=20) == ["g"]
    a2 = gc.join("g", member_id=a.member_id, group_instance_id="i", pattern=r"orders-.*", now_ms=30, **TIMEOUTS)
    assert a2.assignment == (tp("orders-eu", 0), tp("orders-us", 0), tp("orders-us", 1))
    assert gc.describe("g").members[0].pattern == r"orders-.*"


# --- offset commits ----------------------------------------------------------------------------


def test_commit_validation():
    gc = make_coordinator()
    # An offsets-only ("simple") consumer: generation -1, no member id, group created Empty.
    records = gc.commit_offsets("solo", "", -1, {("t", 0): 10}, now_ms=0)
    assert [decode_offset_commit_key(k) for k, _ in records] == [("solo", tp("t", 0))]
    assert gc.describe("solo").state is GroupState.EMPTY
    with pytest.raises(UnknownMemberIdError):
        gc.commit_offsets("solo", "someone", -1, {("t", 0): 10}, now_ms=0)
    # A stale generation for a group that does not exist.
    with pytest.raises(IllegalGenerationError):
        gc.commit_offsets("nobody-home", "m", 3, {("t", 0): 1}, now_ms=0)
    a, b = stable_pair(gc)
    with pytest.raises(UnknownMemberIdError):
        gc.commit_offsets("g", "", -1, {("t", 0): 1}, now_ms=0)  # the group has members
    with pytest.raises(IllegalGenerationError):
        gc.commit_offsets("g", a.member_id, -1, {("t", 0): 1}, now_ms=0)
    with pytest.raises(IllegalGenerationError):
        gc.commit_offsets("g", a.member_id, 1, {("t", 0): 1}, now_ms=0)
    with pytest.raises(UnknownMemberIdError):
        gc.commit_offsets("g", "stranger", 2, {("t", 0): 1}, now_ms=0)
    records = gc.commit_offsets("g", a.member_id, 2, {("t", 0): OffsetAndMetadata(5, "meta", 3)}, now_ms=77)
    key, value = records[0]
    assert decode_offset_commit_key(key) == ("g", tp("t", 0))
    assert decode_offset_commit_value(value) == (5, "meta", 3, 77)
    for bad in ({("t", 0): -1}, {("t", 0): "5"}, {("t", 0): OffsetAndMetadata(1, "x" * (OFFSET_METADATA_BYTES_MAX + 1))}):
        with pytest.raises(InvalidRecordError):
            gc.commit_offsets("g", a.member_id, 2, bad, now_ms=0)
    with pytest.raises(InvalidTopicError):
        gc.commit_offsets("g", a.member_id, 2, {("", 0): 1}, now_ms=0)


def test_commit_keeps_the_session_alive():
    gc = make_coordinator()
    a = join_new(gc, 0)
    for now in range(1_000, 3 * SESSION_MS, 1_000):
        gc.commit_offsets("g", a.member_id, 1, {("t", 0): now}, now_ms=now)
    assert gc.tick(3 * SESSION_MS) == []


def test_sync_errors():
    gc = make_coordinator()
    a, b = stable_pair(gc)
    with pytest.raises(IllegalGenerationError):
        gc.sync("g", a.member_id, 1, now_ms=0)
    join_new(gc, 10)
    with pytest.raises(RebalanceInProgressError):
        gc.sync("g", a.member_id, 2, now_ms=20)
    with pytest.raises(UnknownMemberIdError):
        gc.sync("g", "nobody", 2, now_ms=20)


def test_heartbeat_from_the_future_is_illegal():
    gc = make_coordinator()
    a = join_new(gc, 0)
    with pytest.raises(IllegalGenerationError):
        gc.heartbeat("g", a.member_id, 9, poll_idle_ms=0, now_ms=1)


def test_delete_group():
    gc = make_coordinator()
    a = join_new(gc, 0)
    with pytest.raises(GroupNotEmptyError):
        gc.delete_group("g")
    gc.leave("g", a.member_id, now_ms=1)
    assert gc.delete_group("g")
    assert not gc.delete_group("g")
    assert gc.describe("g").state is GroupState.DEAD
    assert gc.list_groups() == []


# --- __consumer_offsets records ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    group_id=st.text(min_size=1, max_size=255).filter(str.isprintable),
    topic=st.from_regex(r"[a-zA-Z0-9._-]{1,249}", fullmatch=True).filter(lambda t: t not in (".", "..")),
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**63 - 1),
    metadata=st.text(max_size=200),
    leader_epoch=st.integers(-1, 2**31 - 1),
    timestamp=st.integers(-(2**63), 2**63 - 1),
)
def test_offset_commit_record_round_trip(group_id, topic, partition, offset, metadata, leader_epoch, timestamp):
    key, value = encode_offset_commit(group_id, (topic, partition), OffsetAndMetadata(offset, metadata, leader_epoch), timestamp)
    assert decode_offset_commit_key(key) == (group_id, tp(topic, partition))
    assert decode_offset_commit_value(value) == (offset, metadata, leader_epoch, timestamp)
    assert key == offset_commit_key(group_id, (topic, partition))  # compaction needs a stable key
    for cut in (0, 1, len(key) - 1):
        with pytest.raises(CorruptRecordError):
            decode_offset_commit_key(key[:cut])
    for cut in (0, 5, len(value) - 1):
        with pytest.raises(CorruptRecordError):
            decode_offset_commit_value(value[:cut])
    with pytest.raises(CorruptRecordError):
        decode_offset_commit_value(value + b"\x00")


def test_offset_record_versions_are_checked():
    key, value = encode_offset_commit("g", ("t", 0), 1, 0)
    with pytest.raises(CorruptRecordError):
        decode_offset_commit_key(b"\x00\x02" + key[2:])
    with pytest.raises(CorruptRecordError):
        decode_offset_commit_value(b"\x00\x09" + value[2:])
    with pytest.raises(CorruptRecordError):
        decode_offset_commit_value("not bytes")


def test_offsets_partition_matches_kafka():
    # Java: "my-group".hashCode() == 1080097219? Check against a direct computation instead.
    def java_hash(s: str) -> int:
        h = 0
        for ch in s:
            h = (31 * h + ord(ch)) & 0xFFFFFFFF
        return h if h < 2**31 else h - 2**32

    for group_id in ("g", "my-group", "consumer-group-with-a-long-name", "ünï"):
        expected = (java_hash(group_id) & 0x7FFFFFFF) % 50
        assert offsets_topic_partition_for(group_id, 50) == expected
    assert java_hash("hello") == 99162322  # Java's "hello".hashCode()
    with pytest.raises(InvalidConfigError):
        offsets_topic_partition_for("g", 0)


# --- persistence -------------------------------------------------------------------------------


def test_json_round_trip_restarts_timers():
    gc = make_coordinator()
    coop = ("cooperative-sticky",)
    a = join_new(gc, 0, protocols=coop)
    b = join_new(gc, 10, protocols=coop)  # PreparingRebalance: a has not rejoined
    text = gc.to_json()
    assert json.loads(text)["version"] == 1
    # Restored long after (a different clock, say): nobody has expired; the rebalance goes on.
    restored = GroupCoordinator.from_json(text, now_ms=1_000_000, topic_partition_counts={"t": 4})
    assert restored.to_json() == text
    assert restored.tick(1_000_000 + SESSION_MS) == []
    a2 = rejoin(restored, a.member_id, 1_000_000 + 100, protocols=coop, owned=a.assignment)
    b2 = rejoin(restored, b.member_id, 1_000_000 + 100, protocols=coop)
    assert (a2.generation, b2.generation) == (2, 2) and set(a2.revoke) == {tp("t", 2), tp("t", 3)}
    with pytest.raises(ValueError):
        GroupCoordinator.from_json(text.replace('"version": 1', '"version": 99'), now_ms=0)
    broken = json.loads(text)
    broken["groups"][0]["state"] = "Empty"  # an Empty group with members
    with pytest.raises(ValueError):
        GroupCoordinator.from_dict(broken, now_ms=0)


def test_state_version_moves_on_membership_changes_only():
    gc = make_coordinator()
    a = join_new(gc, 0)
    version = gc.state_version
    gc.heartbeat("g", a.member_id, 1, poll_idle_ms=0, now_ms=10)
    gc.commit_offsets("g", a.member_id, 1, {("t", 0): 1}, now_ms=10)
    gc.tick(20)
    assert gc.state_version == version
    gc.leave("g", a.member_id, now_ms=30)
    assert gc.state_version > version


# --- property tests: simulated consumers -------------------------------------------------------

SUBSCRIPTIONS = [(("a",), None), (("a", "b"), None), ((), r"p.*"), (("b",), r"p.*")]
PROTOCOL_SETS = [("range",), ("roundrobin",), ("cooperative-sticky",), ("cooperative-sticky", "range")]


class FakeConsumer:
    """A consumer that follows the coordinator's contract; ``held`` is what it really fetches."""

    def __init__(self, name: str, subscription: int, protocols: tuple[str, ...], instance_id: str | None):
        self.name, self.subscription, self.protocols, self.instance_id = name, subscription, protocols, instance_id
        self.cooperative = all(get_assignor(p).protocol is RebalanceProtocol.COOPERATIVE for p in protocols)
        self.member_id, self.generation, self.held = "", -1, set()
        self.joining, self.alive, self.stalled_since = True, True, None

    def topics(self):
        return SUBSCRIPTIONS[self.subscription]

    def step(self, sim: "Simulation") -> None:
        gc, now = sim.gc, sim.now
        try:
            if self.joining and self.stalled_since is None:
                self._join(sim)
            else:
                idle = 0 if self.stalled_since is None else now - self.stalled_since
                h = gc.heartbeat("g", self.member_id, self.generation, poll_idle_ms=idle, now_ms=now)
                if self.stalled_since is None:  # revocation happens in poll()
                    self.held -= set(h.revoke)
                    self.joining = self.joining or h.rejoin
        except UnknownMemberIdError:
            self.member_id, self.generation, self.held, self.joining = "", -1, set(), True
        sim.check()

    def _join(self, sim: "Simulation") -> None:
        if not self.cooperative:
            self.held = set()  # eager: revoke everything before joining
        topics, pattern = self.topics()
        for _ in range(2):  # a first dynamic join gets an id and joins again at once
            result = sim.gc.join(
                "g", member_id=self.member_id, group_instance_id=self.instance_id, topics=topics, pattern=pattern,
                owned=sorted(self.held) if self.cooperative else (), protocols=self.protocols, now_ms=sim.now, **TIMEOUTS,
            )  # fmt: skip
            self.member_id = result.member_id
            if not (isinstance(result, JoinPending) and result.retry_backoff_ms == 0):
                break
        if isinstance(result, JoinPending):
            return
        assert result.generation >= self.generation
        assert set(result.revoke) == self.held - set(result.assignment), "revoke must name exactly what we lost"
        if not self.cooperative:
            assert result.revoke == ()
        self.held = set(result.assignment)
        self.generation = result.generation
        self.joining = bool(result.revoke)  # phase two: rejoin once revoked


class Simulation:
    wrap = staticmethod(lambda gc: gc)  # subclasses watch every coordinator call through a proxy

    def __init__(self, protocols, rng):
        self.counts = {"a": 3, "b": 2, "p1": 2}
        ids = itertools.count()
        self.new_member_id = lambda prefix: f"{prefix}-{next(ids):04d}"
        self.gc = self.wrap(GroupCoordinator(topic_partition_counts=dict(self.counts), new_member_id=self.new_member_id))
        self.protocols, self.rng = protocols, rng
        self.now = 0
        self.consumers: list[FakeConsumer] = []
        self.names = itertools.count()
        self.last_generation, self.last_assignments = 0, None

    def members(self) -> dict[str, set[TopicPartition]]:
        """The coordinator's view: member -> partitions it may hold (assignment + pending revocation)."""
        return {m.member_id: set(m.assignment) | set(m.pending_revocation) for m in self.gc.describe("g").members}

    def check(self) -> None:
        described = self.gc.describe("g")
        believed = self.members()
        # The coordinator's ownership beliefs are disjoint...
        all_believed = [tp for held in believed.values() for tp in held]
        assert len(all_believed) == len(set(all_believed))
        # ...and cover what each member really fetches, so no two members ever fetch one partition.
        for consumer in self.consumers:
            if consumer.alive and consumer.member_id in believed:
                assert consumer.held <= believed[consumer.member_id], (consumer.name, consumer.held, believed)
        # A generation's assignment never changes; a new assignment comes with a higher generation.
        assignments = {m.member_id: m.assignment for m in described.members}
        assert described.generation >= self.last_generation
        if described.generation == self.last_generation and described.state is not GroupState.EMPTY:
            for member_id, assignment in assignments.items():
                if self.last_assignments and member_id in self.last_assignments:
                    assert assignment == self.last_assignments[member_id]
        self.last_generation, self.last_assignments = described.generation, assignments
        # Commits: the current generation is accepted, a stale one is not.
        for consumer in self.consumers:
            if consumer.alive and consumer.member_id in believed and consumer.generation >= 1:
                offsets = {("a", 0): 1}
                if consumer.generation == described.generation:
                    self.gc.commit_offsets("g", consumer.member_id, consumer.generation, offsets, now_ms=self.now)
                else:
                    with pytest.raises(IllegalGenerationError):
                        self.gc.commit_offsets("g", consumer.member_id, consumer.generation, offsets, now_ms=self.now)

    def round(self, advance_ms: int) -> None:
        self.now += advance_ms
        live = [c for c in self.consumers if c.alive]
        self.rng.shuffle(live)
        for consumer in live:
            consumer.step(self)
        self.gc.tick(self.now)
        self.check()

    def apply(self, action) -> None:
        kind, index, value = action
        live = [c for c in self.consumers if c.alive]
        target = live[index % len(live)] if live else None
        if kind == "add" and len(live) < 6:
            name = f"c{next(self.names)}"
            instance_id = f"host-{name}" if value % 2 else None
            self.consumers.append(FakeConsumer(name, value % len(SUBSCRIPTIONS), self.protocols, instance_id))
        elif target is None:
            return
        elif kind == "leave":
            target.alive = False
            if target.member_id:
                self.gc.leave("g", target.member_id, now_ms=self.now)
        elif kind == "crash":
            target.alive = False  # its session will expire
        elif kind == "restart" and target.instance_id is not None:
            target.alive = False
            self.consumers.append(FakeConsumer(target.name + "'", target.subscription, target.protocols, target.instance_id))
        elif kind == "stall":
            target.stalled_since = self.now if target.stalled_since is None else None
        elif kind == "resubscribe":
            target.subscription = value % len(SUBSCRIPTIONS)
            target.joining = True
        elif kind == "grow":
            topic = sorted(self.counts)[value % len(self.counts)]
            self.counts[topic] += 1
            self.gc.metadata_changed(dict(self.counts), now_ms=self.now)
        elif kind == "new_topic":
            self.counts[f"p{len(self.counts)}"] = 1 + value % 3
            self.gc.metadata_changed(dict(self.counts), now_ms=self.now)
        elif kind == "restart_coordinator":
            counts = dict(self.counts)
            self.gc = self.wrap(GroupCoordinator.from_json(
                self.gc.to_json(), now_ms=self.now, topic_partition_counts=counts, new_member_id=self.new_member_id
            ))

    def converge(self) -> None:
        """No more faults: every live consumer polls again; the group must settle."""
        for consumer in self.consumers:
            consumer.stalled_since = None
        for _ in range(80):
            self.round(200)
            described = self.gc.describe("g")
            live = [c for c in self.consumers if c.alive]
            if (
                described.state in (GroupState.STABLE, GroupState.EMPTY, GroupState.DEAD)
                and not any(c.joining for c in live)
                and {c.member_id for c in live} == {m.member_id for m in described.members}
                and all(not m.pending_revocation for m in described.members)
            ):
                return
        raise AssertionError(f"the group did not settle: {self.gc.describe('g')}")

    def effective_topics(self, consumer) -> set[str]:
        topics, pattern = consumer.topics()
        matched = {t for t in self.counts if pattern and re.fullmatch(pattern, t)}
        return set(topics) | matched

    def check_settled(self) -> None:
        described = self.gc.describe("g")
        live = {c.member_id: c for c in self.consumers if c.alive}
        assignments = {m.member_id: set(m.assignment) for m in described.members}
        for member_id, consumer in live.items():
            assert consumer.held == assignments[member_id]
            assert consumer.generation == described.generation
        # Every partition of a subscribed topic has exactly one owner.
        wanted = {
            TopicPartition(t, p)
            for c in live.values()
            for t in self.effective_topics(c)
            for p in range(self.counts.get(t, 0))
        }
        every = [tp for held in assignments.values() for tp in held]
        assert len(every) == len(set(every)) and set(every) == wanted
        # Balance among members with the same subscription (roundrobin: only if all subscriptions match).
        protocol = described.protocol
        classes: dict[frozenset, list[int]] = {}
        for member_id, consumer in live.items():
            classes.setdefault(frozenset(self.effective_topics(consumer)), []).append(len(assignments[member_id]))
        if protocol == "cooperative-sticky" or (protocol == "roundrobin" and len(classes) == 1):
            assert all(max(c) - min(c) <= 1 for c in classes.values()), classes


ACTIONS = st.tuples(
    st.sampled_from(["add", "add", "leave", "crash", "restart", "stall", "resubscribe", "grow", "new_topic", "restart_coordinator"]),
    st.integers(0, 10),
    st.integers(0, 11),
)
SCRIPTS = st.lists(st.tuples(ACTIONS, st.integers(0, 2_500)), min_size=1, max_size=25)  # (action, ms to advance)


@settings(max_examples=70, deadline=None)
@given(
    protocols=st.sampled_from(PROTOCOL_SETS),
    script=SCRIPTS,
    rng=st.randoms(use_true_random=False),
)
def test_random_groups_keep_single_ownership_and_settle(protocols, script, rng):
    sim = Simulation(protocols, rng)
    for action, advance_ms in script:
        sim.apply(action)
        sim.round(advance_ms)
    sim.converge()
    sim.check_settled()


@settings(max_examples=40, deadline=None)
@given(
    members=st.integers(1, 5),
    partitions=st.integers(1, 12),
    protocols=st.sampled_from(PROTOCOL_SETS),
    who=st.integers(0, 4),
)
def test_static_restart_never_rebalances(members, partitions, protocols, who):
    gc = make_coordinator({"t": partitions})
    ids = {}
    for i in range(members):
        result = gc.join("g", group_instance_id=f"host-{i}", topics=["t"], protocols=protocols, now_ms=0, **TIMEOUTS)
        ids[i] = result.member_id
    results = {i: gc.join("g", member_id=ids[i], group_instance_id=f"host-{i}", topics=["t"], protocols=protocols, now_ms=0, **TIMEOUTS) for i in ids}
    before = gc.describe("g")
    assert before.state is GroupState.STABLE
    i = who % members
    back = gc.join("g", group_instance_id=f"host-{i}", topics=["t"], protocols=protocols, now_ms=SESSION_MS, **TIMEOUTS)
    after = gc.describe("g")
    assert (after.state, after.generation) == (GroupState.STABLE, before.generation)
    assert back.assignment == results[i].assignment and back.generation == results[i].generation
    assert sorted(m.assignment for m in after.members) == sorted(m.assignment for m in before.members)


def test_fingerprint_moves_exactly_when_waiting_members_have_something_to_do():
    """Long polls wake on a fingerprint change: a join, a leave or an expiry changes it; heartbeats
    and a pending member's repeated join polls do not."""
    gc = make_coordinator()
    assert gc.fingerprint("g") == ()
    a = join_new(gc, 0)
    stable = gc.fingerprint("g")
    assert stable[:2] == (GroupState.STABLE, 1)
    gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=100)
    assert gc.fingerprint("g") == stable
    b = join_new(gc, 200)  # a second member: the group prepares a rebalance
    preparing = gc.fingerprint("g")
    assert preparing != stable and preparing[0] is GroupState.PREPARING_REBALANCE
    assert rejoin(gc, b.member_id, 250) == JoinPending(b.member_id, 100)  # polling again changes nothing
    assert gc.fingerprint("g") == preparing
    rejoin(gc, a.member_id, 300)
    rejoin(gc, b.member_id, 300)
    formed = gc.fingerprint("g")
    assert formed != preparing and formed[1] == 2
    gc.leave("g", b.member_id, now_ms=400)
    assert gc.fingerprint("g") != formed


# --- long polls: what a held call may and may not do ------------------------------------------


def test_a_held_heartbeat_rechecked_without_keep_alive_does_not_extend_the_session():
    """The controller re-runs a held heartbeat with keep_alive=False when the group changes: the
    answer is fresh, but the session still runs from the call's arrival, so a member that died
    while its heartbeat was held expires on time."""
    gc = make_coordinator()
    a = join_new(gc, 0)
    gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=1_000)  # arrives, is held
    b = join_new(gc, 2_000)  # wakes the held call: it must rejoin
    woken = gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=2_000, keep_alive=False)
    assert woken.rejoin
    assert gc.tick(1_000 + SESSION_MS) == []  # not yet: the session runs from 1000
    removed = gc.tick(1_000 + SESSION_MS + 1)
    assert [r.member_id for r in removed] == [a.member_id]
    # b, alone now, forms the next generation at its next join.
    assert isinstance(rejoin(gc, b.member_id, 1_000 + SESSION_MS + 2), JoinResult)


def test_a_held_join_rerun_without_keep_alive_does_not_extend_the_session():
    gc = make_coordinator()
    a = join_new(gc, 0)
    b = join_new(gc, 100)  # a must rejoin; b waits in its held join
    assert isinstance(b, JoinPending)
    for now in range(200, SESSION_MS + 100, 500):  # the controller re-runs b's held join now and then
        assert isinstance(rejoin(gc, b.member_id, now, keep_alive=False), JoinPending)
        # a keeps heartbeating (and is told to rejoin) but does not rejoin yet
        assert gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=now).rejoin
    assert gc.tick(SESSION_MS + 100) == []
    # b's session ends SESSION_MS after its arrival at 100, however often its held join was re-run.
    removed = gc.tick(SESSION_MS + 101)
    assert [r.member_id for r in removed] == [b.member_id]


def test_a_keep_alive_false_call_still_reports_removal():
    gc = make_coordinator()
    a = join_new(gc, 0)
    gc.leave("g", a.member_id, now_ms=10)
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", a.member_id, a.generation, poll_idle_ms=0, now_ms=20, keep_alive=False)


def test_repeated_joins_persist_nothing_new():
    """A held join is re-run on every wake-up: if its arguments are the same, nothing durable
    changes, so groups.json is not rewritten."""
    gc = make_coordinator()
    a = join_new(gc, 0)
    b = join_new(gc, 100)
    assert isinstance(b, JoinPending)
    version = gc.state_version
    for now in (150, 200, 250):
        rejoin(gc, b.member_id, now)
        rejoin(gc, b.member_id, now, keep_alive=False)
    assert gc.state_version == version
    rejoin(gc, a.member_id, 300)  # a rejoins: the generation forms
    assert gc.state_version > version
    version = gc.state_version
    rejoin(gc, b.member_id, 310)  # b collects its assignment: that is durable
    assert gc.state_version > version


def test_session_timeout_of_members():
    gc = make_coordinator()
    a = join_new(gc, 0)
    assert gc.session_timeout_ms("g", a.member_id) == SESSION_MS
    assert gc.session_timeout_ms("g", "nobody") is None
    assert gc.session_timeout_ms("other", a.member_id) is None


@given(requested=st.integers(-10, 10**7), session=st.integers(100, 1_800_000), cap=st.integers(0, 10**6))
def test_long_poll_wait_stays_within_half_the_session_and_the_cap(requested, session, cap):
    wait = long_poll_wait_ms(requested, session, cap)
    assert 0 <= wait <= max(0, requested)
    assert wait <= session // 2 and wait <= cap
    # It only shortens a wait, never more than it must.
    assert wait == max(0, min(requested, session // 2, cap))


class _WatchedCoordinator:
    """Forwards every call to a coordinator and checks, around each one, that a change of what
    to_json() would write comes with a change of state_version (the controller writes
    groups.json only when the version moved)."""

    def __init__(self, gc: GroupCoordinator):
        self._gc = gc

    def __getattr__(self, name):
        attr = getattr(self._gc, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            before = (self._gc.to_json(), self._gc.state_version)
            try:
                return attr(*args, **kwargs)
            finally:
                text, version = self._gc.to_json(), self._gc.state_version
                assert text == before[0] or version != before[1], f"{name} changed the persisted state, not state_version"

        return call


class WatchedSimulation(Simulation):
    wrap = staticmethod(_WatchedCoordinator)


@settings(max_examples=60, deadline=None)
@given(
    protocols=st.sampled_from(PROTOCOL_SETS),
    script=SCRIPTS,
    rng=st.randoms(use_true_random=False),
)
def test_every_persisted_change_moves_the_state_version(protocols, script, rng):
    sim = WatchedSimulation(protocols, rng)
    for action, advance_ms in script:
        sim.apply(action)
        sim.round(advance_ms)
    sim.converge()


def test_sync_after_a_lost_join_response_is_persisted():
    gc = make_coordinator()
    a = join_new(gc, 0)
    b = join_new(gc, 100)
    rejoin(gc, a.member_id, 200)  # forms generation 2; a collected it, b's response is "lost"
    version = gc.state_version
    gc.sync("g", b.member_id, 2, now_ms=300)
    assert gc.state_version > version
