"""Partition assignment strategies: Kafka's documented examples, then properties over random groups."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError
from logbus.protocol.assignors import (
    ASSIGN_MEMBERS_MAX,
    ASSIGNORS,
    RebalanceProtocol,
    Subscription,
    cooperative_adjust,
    cooperative_sticky_assign,
    get_assignor,
    member_order,
    range_assign,
    roundrobin_assign,
    sticky_assign,
    valid_owned_partitions,
)
from logbus.protocol.messages import TopicPartition


def tps(spec: str) -> list[TopicPartition]:
    """'t0p0 t1p2' -> [TopicPartition('t0', 0), TopicPartition('t1', 2)]."""
    out = []
    for item in spec.split():
        topic, partition = item.rsplit("p", 1)
        out.append(TopicPartition(topic, int(partition)))
    return sorted(out)


def subs(**members: str) -> dict[str, Subscription]:
    """subs(C0='t0 t1') -> {'C0': Subscription({'t0', 't1'})}."""
    return {m: Subscription.of(topics.split()) for m, topics in members.items()}


def with_owned(subscriptions: dict[str, Subscription], owned: dict[str, str]) -> dict[str, Subscription]:
    return {m: Subscription.of(s.topics, tps(owned.get(m, "")), s.group_instance_id) for m, s in subscriptions.items()}


# --- lookup ----------------------------------------------------------------------------------------


def test_lookup_by_name():
    assert get_assignor("range").assign is not None
    assert {name: a.protocol for name, a in ASSIGNORS.items()} == {
        "range": RebalanceProtocol.EAGER,
        "roundrobin": RebalanceProtocol.EAGER,
        "cooperative-sticky": RebalanceProtocol.COOPERATIVE,
    }
    for bad in ("sticky", "", None, "Range"):
        with pytest.raises(InvalidConfigError):
            get_assignor(bad)


def test_limits_and_bad_counts():
    with pytest.raises(InvalidConfigError):
        range_assign({"t": 1}, {f"m{i}": Subscription.of(["t"]) for i in range(ASSIGN_MEMBERS_MAX + 1)})
    with pytest.raises(InvalidConfigError):
        sticky_assign({"t": -1}, subs(a="t"))
    with pytest.raises(InvalidConfigError):
        roundrobin_assign({"t": True}, subs(a="t"))


def test_no_members_and_unknown_topics():
    for name, assignor in ASSIGNORS.items():
        assert assignor.assign({"t": 3}, {}) == {}, name
        # A subscribed topic that does not exist contributes nothing; an unsubscribed one is ignored.
        assert assignor.assign({"other": 3}, subs(a="missing")) == {"a": []}, name


def test_member_order_puts_static_members_first_by_instance_id():
    subscriptions = {
        "z-dynamic": Subscription.of(["t"]),
        "a-dynamic": Subscription.of(["t"]),
        "m1": Subscription.of(["t"], group_instance_id="instance-b"),
        "m2": Subscription.of(["t"], group_instance_id="instance-a"),
    }
    assert member_order(subscriptions) == ["m2", "m1", "a-dynamic", "z-dynamic"]


# --- range: Kafka's RangeAssignor javadoc -----------------------------------------------------


def test_range_kafka_example():
    # "C0 and C1, t0 and t1 with 3 partitions each: C0: [t0p0, t0p1, t1p0, t1p1], C1: [t0p2, t1p2]."
    result = range_assign({"t0": 3, "t1": 3}, subs(C0="t0 t1", C1="t0 t1"))
    assert result == {"C0": tps("t0p0 t0p1 t1p0 t1p1"), "C1": tps("t0p2 t1p2")}


def test_range_uneven_and_partial_subscriptions():
    result = range_assign({"t": 7, "u": 2}, subs(a="t", b="t u", c="t"))
    assert result == {"a": tps("tp0 tp1 tp2"), "b": tps("tp3 tp4 up0 up1"), "c": tps("tp5 tp6")}
    # More members than partitions: the last members get nothing.
    assert range_assign({"t": 2}, subs(a="t", b="t", c="t")) == {"a": tps("tp0"), "b": tps("tp1"), "c": []}


def test_range_uses_instance_ids_for_order():
    subscriptions = {
        "zz": Subscription.of(["t"], group_instance_id="i1"),
        "aa": Subscription.of(["t"], group_instance_id="i2"),
    }
    assert range_assign({"t": 4}, subscriptions) == {"zz": tps("tp0 tp1"), "aa": tps("tp2 tp3")}


# --- roundrobin: Kafka's RoundRobinAssignor javadoc -------------------------------------------


def test_roundrobin_kafka_example_identical_subscriptions():
    # "C0: [t0p0, t0p2, t1p1], C1: [t0p1, t1p0, t1p2]"
    result = roundrobin_assign({"t0": 3, "t1": 3}, subs(C0="t0 t1", C1="t0 t1"))
    assert result == {"C0": tps("t0p0 t0p2 t1p1"), "C1": tps("t0p1 t1p0 t1p2")}


def test_roundrobin_kafka_example_different_subscriptions():
    # "C0: [t0p0], C1: [t1p0], C2: [t1p1, t2p0, t2p1, t2p2]"
    result = roundrobin_assign({"t0": 1, "t1": 2, "t2": 3}, subs(C0="t0", C1="t0 t1", C2="t0 t1 t2"))
    assert result == {"C0": tps("t0p0"), "C1": tps("t1p0"), "C2": tps("t1p1 t2p0 t2p1 t2p2")}


# --- sticky: Kafka's StickyAssignor javadoc ---------------------------------------------------


def test_sticky_kafka_example_member_leaves():
    # Three members, t0..t3 with 2 partitions each, then C1 goes: the sticky result keeps all of
    # C0's and C2's partitions: "C0 [t0p0, t1p1, t3p0, t2p0], C2 [t1p0, t2p1, t0p1, t3p1]".
    counts = {"t0": 2, "t1": 2, "t2": 2, "t3": 2}
    before = {"C0": "t0p0 t1p1 t3p0", "C1": "t0p1 t2p0 t3p1", "C2": "t1p0 t2p1"}
    everyone = subs(C0="t0 t1 t2 t3", C2="t0 t1 t2 t3")
    result = sticky_assign(counts, with_owned(everyone, before))
    assert result == {"C0": tps("t0p0 t1p1 t3p0 t2p0"), "C2": tps("t1p0 t2p1 t0p1 t3p1")}


def test_sticky_kafka_example_different_subscriptions():
    # "C0 [t0p0], C1 [t1p0, t1p1], C2 [t2p0, t2p1, t2p2]"; after C0 leaves: "C1 [t1p0, t1p1, t0p0]".
    counts = {"t0": 1, "t1": 2, "t2": 3}
    first = sticky_assign(counts, subs(C0="t0", C1="t0 t1", C2="t0 t1 t2"))
    assert first == {"C0": tps("t0p0"), "C1": tps("t1p0 t1p1"), "C2": tps("t2p0 t2p1 t2p2")}
    remaining = {m: " ".join(f"{tp.topic}p{tp.partition}" for tp in first[m]) for m in ("C1", "C2")}
    second = sticky_assign(counts, with_owned(subs(C1="t0 t1", C2="t0 t1 t2"), remaining))
    assert second == {"C1": tps("t1p0 t1p1 t0p0"), "C2": tps("t2p0 t2p1 t2p2")}


def test_sticky_new_member_takes_only_the_excess():
    owned = {"a": "tp0 tp1 tp2 tp3 tp4 tp5"}
    result = sticky_assign({"t": 6}, with_owned(subs(a="t", b="t", c="t"), owned))
    assert [len(result[m]) for m in "abc"] == [2, 2, 2]
    assert set(result["a"]) <= set(tps(owned["a"]))  # a only gave partitions away


def test_owned_claims_that_do_not_count():
    subscriptions = with_owned(subs(a="t", b="t", c="u"), {"a": "tp0 tp9", "b": "tp0 tp1", "c": "tp2"})
    # tp0 is claimed twice, tp9 does not exist, c does not subscribe to t.
    assert valid_owned_partitions({"t": 3, "u": 1}, subscriptions) == {"a": set(), "b": {TopicPartition("t", 1)}, "c": set()}


def test_cooperative_adjust_withholds_partitions_owned_by_someone_else():
    subscriptions = with_owned(subs(a="t", b="t"), {"a": "tp0 tp1 tp2 tp3"})
    target = sticky_assign({"t": 4}, subscriptions)
    assert target == {"a": tps("tp0 tp1"), "b": tps("tp2 tp3")}
    assert cooperative_adjust(target, subscriptions) == {"a": tps("tp0 tp1"), "b": []}
    assert cooperative_sticky_assign({"t": 4}, subscriptions) == {"a": tps("tp0 tp1"), "b": []}
    # Phase two: a revoked tp2 and tp3, so nobody owns them and b gets them.
    after_revoke = with_owned(subs(a="t", b="t"), {"a": "tp0 tp1"})
    assert cooperative_sticky_assign({"t": 4}, after_revoke) == {"a": tps("tp0 tp1"), "b": tps("tp2 tp3")}


# --- properties ------------------------------------------------------------------------------------

TOPICS = ["t0", "t1", "t2", "t3"]


@st.composite
def groups(draw, identical: bool = False, with_owned_partitions: bool = True):
    """(partition counts, subscriptions) for 1..8 members over up to 4 topics, with a random prior ownership."""
    counts = {t: draw(st.integers(0, 12)) for t in TOPICS[: draw(st.integers(1, len(TOPICS)))]}
    topic_sets = st.sets(st.sampled_from(sorted(counts) + ["missing"]), min_size=1)
    members = [f"m{i:02d}" for i in range(draw(st.integers(1, 8)))]
    shared = draw(topic_sets)
    topics = {m: shared if identical else draw(topic_sets) for m in members}
    owned: dict[str, list[TopicPartition]] = {m: [] for m in members}
    if with_owned_partitions:
        everything = [TopicPartition(t, p) for t, n in counts.items() for p in range(n)]
        for tp in everything:
            holder = draw(st.sampled_from(members + [None]))
            if holder is not None and tp.topic in topics[holder]:
                owned[holder].append(tp)
    static = draw(st.booleans())
    subscriptions = {
        m: Subscription.of(topics[m], owned[m], group_instance_id=f"i-{m[::-1]}" if static else None) for m in members
    }
    return counts, subscriptions


def subscribed_partitions(counts, subscriptions) -> set[TopicPartition]:
    topics = set().union(*(s.topics for s in subscriptions.values()))
    return {TopicPartition(t, p) for t in topics for p in range(counts.get(t, 0))}


def check_valid(counts, subscriptions, result, complete: bool = True) -> None:
    assert set(result) == set(subscriptions)
    every = [tp for partitions in result.values() for tp in partitions]
    assert len(every) == len(set(every)), "a partition has two owners"
    for member, partitions in result.items():
        assert partitions == sorted(partitions)
        for tp in partitions:
            assert tp.topic in subscriptions[member].topics
            assert 0 <= tp.partition < counts[tp.topic]
    if complete:
        assert set(every) == subscribed_partitions(counts, subscriptions), "a subscribed partition is unassigned"


def spread_by_subscription(subscriptions, result) -> int:
    """The largest count difference among members with the same subscription."""
    by_topics: dict[frozenset, list[int]] = {}
    for member, subscription in subscriptions.items():
        by_topics.setdefault(subscription.topics, []).append(len(result[member]))
    return max(max(c) - min(c) for c in by_topics.values())


@settings(max_examples=150, deadline=None)
@given(groups())
def test_every_partition_assigned_exactly_once(group):
    counts, subscriptions = group
    for assign in (range_assign, roundrobin_assign, sticky_assign):
        check_valid(counts, subscriptions, assign(counts, subscriptions))
    check_valid(counts, subscriptions, cooperative_sticky_assign(counts, subscriptions), complete=False)


@settings(max_examples=100, deadline=None)
@given(groups(identical=True))
def test_balance_with_identical_subscriptions(group):
    counts, subscriptions = group
    for assign in (roundrobin_assign, sticky_assign):
        result = assign(counts, subscriptions)
        assert spread_by_subscription(subscriptions, result) <= 1, assign.__name__
    # Range balances each topic on its own.
    result = range_assign(counts, subscriptions)
    for topic in counts:
        per_member = Counter({m: 0 for m in subscriptions})
        per_member.update(m for m, partitions in result.items() for tp in partitions if tp.topic == topic)
        assert max(per_member.values()) - min(per_member.values()) <= 1


@settings(max_examples=150, deadline=None)
@given(groups())
def test_sticky_balances_members_with_the_same_subscription(group):
    counts, subscriptions = group
    assert spread_by_subscription(subscriptions, sticky_assign(counts, subscriptions)) <= 1


def moved_partitions(counts, subscriptions, result) -> int:
    """Owned partitions (that stickiness could have kept) that the result gives to someone else."""
    valid = valid_owned_partitions(counts, subscriptions)
    return sum(len(valid[m] - set(result[m])) for m in subscriptions)


@settings(max_examples=150, deadline=None)
@given(groups(identical=True))
def test_sticky_moves_only_what_balance_requires(group):
    counts, subscriptions = group
    total = len(subscribed_partitions(counts, subscriptions))
    members = len(subscriptions)
    floor, extra = divmod(total, members)
    # The fewest moves: the `extra` members owning most keep floor + 1, everyone else keeps floor.
    owned = sorted((len(v) for v in valid_owned_partitions(counts, subscriptions).values()), reverse=True)
    minimum = sum(max(0, o - (floor + 1 if i < extra else floor)) for i, o in enumerate(owned))
    assert moved_partitions(counts, subscriptions, sticky_assign(counts, subscriptions)) == minimum
    assert moved_partitions(counts, subscriptions, cooperative_sticky_assign(counts, subscriptions)) == minimum


@settings(max_examples=150, deadline=None)
@given(groups(with_owned_partitions=False))
def test_sticky_result_is_a_fixed_point(group):
    """A member set that did not change keeps exactly its assignment, whatever the subscriptions."""
    counts, subscriptions = group
    first = sticky_assign(counts, subscriptions)
    again = {m: Subscription.of(s.topics, first[m], s.group_instance_id) for m, s in subscriptions.items()}
    assert sticky_assign(counts, again) == first
    assert cooperative_sticky_assign(counts, again) == first


@settings(max_examples=150, deadline=None)
@given(groups())
def test_cooperative_phases_never_double_own(group):
    """Each phase's members revoke what they lost; no phase gives a partition that someone else still owns."""
    counts, subscriptions = group
    phases = 0
    while True:
        phases += 1
        result = cooperative_sticky_assign(counts, subscriptions)
        check_valid(counts, subscriptions, result, complete=False)
        for member, partitions in result.items():
            for other, subscription in subscriptions.items():
                if other != member:
                    assert not set(partitions) & set(subscription.owned_partitions), "assigned while another member owns it"
        # Members keep what they were given and revoke the rest (the consumer side of the protocol).
        subscriptions = {m: Subscription.of(s.topics, result[m], s.group_instance_id) for m, s in subscriptions.items()}
        if set().union(*map(set, result.values())) == subscribed_partitions(counts, subscriptions):
            break
        assert phases < 6, "cooperative rebalancing did not converge"
    # Two phases at most when everyone subscribes to the same topics (revoke, then assign).
    if len({s.topics for s in subscriptions.values()}) == 1:
        assert phases <= 2
    assert cooperative_sticky_assign(counts, subscriptions) == result
