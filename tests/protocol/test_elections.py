"""Election decisions and role deliveries, without Ray: who may lead, what must be sent again and when."""

from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.protocol import elections
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.elections import LeaderlessWatch, RoleDeliveries, candidates, electable, needs_election
from logbus.protocol.liveness import LEASE_TIMEOUT_MS


def test_the_leaderless_limit_is_the_lease_timeout_plus_a_second():
    assert elections.LEADERLESS_LIMIT_MS == LEASE_TIMEOUT_MS + 1_000


def test_candidates_come_from_the_live_isr_in_replica_order():
    assert candidates([2, 0, 1], isr=[0, 1, 2], alive={0, 1}, unclean_allowed=False) == ([0, 1], False)
    assert candidates([2, 0, 1], isr=[1], alive={0, 1, 2}, unclean_allowed=True) == ([1], False)


def test_out_of_sync_replicas_lead_only_when_unclean_election_is_enabled():
    assert candidates([0, 1, 2], isr=[0], alive={1, 2}, unclean_allowed=False) == ([], False)
    assert candidates([0, 1, 2], isr=[0], alive={1, 2}, unclean_allowed=True) == ([1, 2], True)
    assert candidates([0, 1], isr=[0], alive=set(), unclean_allowed=True) == ([], True)


def test_needs_election_when_the_leader_is_missing_or_not_alive():
    assert needs_election(None, {0, 1})
    assert needs_election(0, {1})
    assert not needs_election(1, {1})


def test_electable_means_an_election_would_give_a_live_leader():
    assert electable(None, [0, 1, 2], [2], {2}, False)  # the case: leader None, ISR [2], 2 alive
    assert not electable(None, [0, 1, 2], [2], {0, 1}, False)  # only out-of-sync replicas alive
    assert electable(None, [0, 1, 2], [2], {0, 1}, True)
    assert not electable(1, [0, 1, 2], [1, 2], {1, 2}, False)  # it has a live leader


def test_a_controller_restart_elects_from_the_isr_not_the_preferred_replica():
    """Metadata as a restart finds it: no leader, the preferred replica 0 alive but out of the ISR."""
    metadata = ClusterMetadata()
    metadata.create_topic("t", 1, 3, None, ["a", "b", "c"])
    state = metadata.topics["t"].partitions[0]
    state.isr = [2]
    assert metadata.elect_leader("t", 0, alive={0, 1, 2}, unclean_allowed=False)
    assert metadata.topics["t"].partitions[0].leader == 2
    assert metadata.elect_leader("t", 0, alive={0, 1}, unclean_allowed=False)  # 2 lost: leaderless, not 0
    assert state.leader is None and state.isr == [2]
    assert not metadata.elect_leader("t", 0, alive={0, 1}, unclean_allowed=False)  # stays so
    epoch = state.leader_epoch
    assert metadata.elect_leader("t", 0, alive={0, 1}, unclean_allowed=True)
    assert (state.leader, state.isr, state.leader_epoch) == (0, [0], epoch + 1)


def test_a_failed_delivery_is_sent_again_after_a_doubling_bounded_backoff():
    d = RoleDeliveries(retry_min_ms=200, retry_max_ms=1_000)
    key = ("t", 0, 1)
    assert d.expect(key, 5, "n1", now_ms=0)
    assert d.due(0) == [(key, 5)]
    waits = []
    now = 0
    for _ in range(6):
        assert d.sending(key, 5)
        assert d.due(now) == []  # a call is under way: not sent twice
        again = d.failed(key, 5, now)
        waits.append(again - now)
        assert d.due(again - 1) == []
        assert d.due(again) == [(key, 5)]
        now = again
    assert waits == [200, 400, 800, 1_000, 1_000, 1_000]
    assert d.sending(key, 5)
    d.delivered(key, 5)
    assert len(d) == 0 and d.due(10**9) == []


def test_a_node_heard_again_gets_its_pending_changes_at_once():
    d = RoleDeliveries(retry_min_ms=200, retry_max_ms=5_000)
    d.expect(("t", 0, 0), 3, "n1", 0)
    d.expect(("t", 1, 0), 3, "n2", 0)
    for key in (("t", 0, 0), ("t", 1, 0)):
        for _ in range(4):
            d.sending(key, 3)
            d.failed(key, 3, 0)
    assert d.due(100) == []
    assert d.node_heard("n1", 100) == 1
    assert d.due(100) == [(("t", 0, 0), 3)]
    d.retry_now([("t", 1, 0)], 150)
    assert sorted(d.due(150)) == [(("t", 0, 0), 3), (("t", 1, 0), 3)]
    assert d.attempts(("t", 1, 0)) == 0  # the backoff starts over


def test_a_newer_epoch_replaces_an_older_one_and_never_the_reverse():
    d = RoleDeliveries()
    key = ("t", 0, 2)
    d.expect(key, 4, "n1", 0)
    assert d.sending(key, 4)
    assert d.expect(key, 5, "n1", 10)  # a newer election while the old call is under way
    assert not d.expect(key, 4, "n1", 20)
    assert d.epoch(key) == 5
    d.failed(key, 4, 30)  # the old call's failure does not delay the new change
    assert d.due(30) == [(key, 5)]
    d.delivered(key, 4)  # nor does the old epoch's acknowledgement complete it
    assert d.epoch(key) == 5
    assert d.sending(key, 5)
    d.delivered(key, 6)  # acknowledging a newer epoch covers it
    assert key not in d


def test_forgotten_replicas_are_not_sent_anything():
    d = RoleDeliveries()
    d.expect(("t", 0, 0), 1, "n1", 0)
    d.expect(("t", 0, 1), 1, "n2", 0)
    d.forget([("t", 0, 0)])
    assert d.due(0) == [(("t", 0, 1), 1)]
    assert not d.sending(("t", 0, 0), 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["expect", "send", "fail", "ack", "heard"]), st.integers(0, 3), st.integers(1, 3_000)), max_size=60))
def test_a_pending_change_is_never_dropped_until_acknowledged(steps):
    """Whatever fails and whatever order things come in, the newest expected epoch stays pending
    until acknowledged, and is due again within the maximum backoff of any failure."""
    d = RoleDeliveries(retry_min_ms=100, retry_max_ms=2_000)
    key = "r"
    now = 0
    newest = None
    acked = -1
    for kind, epoch, advance in steps:
        now += advance
        if kind == "expect":
            d.expect(key, epoch, "n", now)
            newest = epoch if newest is None else max(newest, epoch)
        elif kind == "send" and newest is not None:
            d.sending(key, d.epoch(key) if key in d else newest)
        elif kind == "fail" and key in d:
            again = d.failed(key, d.epoch(key), now)
            assert again is not None and again - now <= 2_000
        elif kind == "ack" and key in d:
            acked = max(acked, epoch)
            d.delivered(key, epoch)
        elif kind == "heard":
            d.node_heard("n", now)
        if newest is not None and newest > acked:
            assert d.epoch(key) == newest, "the newest change must stay pending until acknowledged"
        if key in d and not any(e["in_flight"] for e in d.describe()):
            assert d.due(now + 2_000), "a pending change is due again within the backoff's bound"


def test_leaderless_overdue_is_reported_once_per_stretch():
    watch = LeaderlessWatch(limit_ms=1_800)
    watch.update("p", electable_now=True, now_ms=0)
    assert watch.overdue(1_800) == []
    assert watch.overdue(1_801) == [("p", 1_801)]
    assert watch.overdue(5_000) == []  # once
    watch.update("p", electable_now=True, now_ms=6_000)  # still the same stretch
    assert watch.overdue(6_000) == []
    watch.clear("p")  # it got a leader
    watch.update("p", electable_now=True, now_ms=10_000)
    assert watch.overdue(11_900) == [("p", 1_900)]


def test_a_partition_that_cannot_elect_is_not_overdue():
    watch = LeaderlessWatch(limit_ms=1_800)
    watch.update("p", electable_now=False, now_ms=0)  # its only in-sync replica is dead, unclean off
    assert watch.overdue(60_000) == [] and watch.watched() == []
    watch.update("p", electable_now=True, now_ms=60_000)  # the replica came back
    assert watch.overdue(61_000) == []
    assert watch.overdue(61_801) == [("p", 1_801)]
