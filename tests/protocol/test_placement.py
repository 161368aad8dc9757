"""Placement by load and racks, leaders spread evenly, drain and rebalance plans: unit tests and Hypothesis properties."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidReplicationFactorError, NodeCapacityError
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.placement import NodeLoad, Placer, plan_drain, plan_rebalance


def test_new_replicas_go_to_the_least_loaded_nodes():
    placer = Placer([NodeLoad("a", replicas=5), NodeLoad("b", replicas=1), NodeLoad("c", replicas=1, bytes=10), NodeLoad("d", replicas=3)])
    assert sorted(placer.place(2)) == ["b", "c"]
    assert placer.place(1) == ["b"]  # b (2) still before c (2, more bytes)


def test_one_replica_per_rack_while_racks_last():
    nodes = [NodeLoad(f"{rack}{i}", rack=rack) for rack in "xyz" for i in range(3)]
    placer = Placer(nodes)
    for _ in range(9):
        chosen = placer.place(3)
        assert len({n[0] for n in chosen}) == 3  # one per rack
    assert Counter(n.replicas for n in nodes) == {3: 9}


def test_full_nodes_and_too_few_nodes_are_named_errors():
    placer = Placer([NodeLoad("a", limit=1), NodeLoad("b", limit=1)])
    with pytest.raises(InvalidReplicationFactorError):
        placer.place(3)
    assert placer.place_all(1, 2)
    with pytest.raises(NodeCapacityError):
        placer.place(1)


def test_a_topic_that_does_not_fit_counts_nothing():
    nodes = [NodeLoad("a", limit=2), NodeLoad("b", limit=2)]
    placer = Placer(nodes)
    with pytest.raises(NodeCapacityError):
        placer.place_all(3, 2)
    assert [(n.replicas, n.leaders) for n in nodes] == [(0, 0), (0, 0)]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),  # nodes
    st.integers(1, 3),  # racks
    st.integers(1, 40),  # partitions
    st.data(),
)
def test_placement_is_even_distinct_and_rack_aware(node_count, rack_count, partitions, data):
    replication_factor = data.draw(st.integers(1, node_count))
    nodes = [NodeLoad(f"n{i}", rack=f"r{i % rack_count}") for i in range(node_count)]
    placed = Placer(nodes).place_all(partitions, replication_factor)
    for chosen in placed:
        assert len(set(chosen)) == replication_factor  # never two replicas of a partition on one node
        racks = {f"r{int(n[1:]) % rack_count}" for n in chosen}
        assert len(racks) == min(replication_factor, rack_count)  # as many racks as can be used
    counts = Counter(n for chosen in placed for n in chosen)
    replicas = [counts.get(n.node_id, 0) for n in nodes]
    if rack_count == 1 or node_count % rack_count == 0:
        assert max(replicas) - min(replicas) <= 1  # even when the racks are even
    leaders = Counter(chosen[0] for chosen in placed)
    lead = [leaders.get(n.node_id, 0) for n in nodes]
    if replication_factor == node_count:
        assert max(lead) - min(lead) <= 1  # every node can lead every partition: leaders spread evenly


# --- drain and rebalance plans ----------------------------------------------------------------------


def cluster(topics, racks):
    """Metadata with ``topics`` ({name: (partitions, replication factor)}) placed by load over the nodes of ``racks``."""
    metadata = ClusterMetadata()
    for name, (partitions, replication_factor) in topics.items():
        metadata.create_topic(name, partitions, replication_factor, None, list(racks), loads=loads_of(metadata, racks))
    return metadata


def loads_of(metadata, racks, limits=None):
    """What the controller tells the planners: each node's rack, replicas and leaders now."""
    loads = metadata.node_loads(list(racks), limits)
    for load in loads:
        load.rack = racks[load.node_id]
    return loads


def placements(metadata):
    return {(name, p): [s.nodes[str(r)] for r in s.replicas] for name, t in metadata.topics.items() for p, s in enumerate(t.partitions)}


def apply(metadata, plan, live):
    """Carry a plan out the way the controller does: start, let the new replicas catch up, complete."""
    for (name, p), target in plan.items():
        metadata.start_reassignment(name, p, target, live)
        state = metadata.topics[name].partitions[p]
        if state.reassigning():
            metadata.alter_isr(name, p, state.leader, state.leader_epoch, state.replicas)
            metadata.complete_reassignment(name, p)
        assert placements(metadata)[(name, p)] == target


def moved_replicas(before, after):
    return sum(len(set(after[key]) - set(before[key])) for key in before)


def test_a_drain_replaces_the_node_by_the_least_loaded_and_keeps_the_rest():
    racks = {n: "" for n in ["a", "b", "c", "d"]}
    metadata = cluster({"t": (3, 2)}, {n: "" for n in "abc"})
    before = placements(metadata)
    loads = loads_of(metadata, racks)
    snapshot = [(n.replicas, n.leaders) for n in loads]
    plan = plan_drain(metadata, "a", loads)
    assert [(n.replicas, n.leaders) for n in loads] == snapshot  # the caller's loads are left alone
    assert set(plan) == {key for key, nodes in before.items() if "a" in nodes}
    for key, target in plan.items():
        i = before[key].index("a")
        assert target[:i] + target[i + 1:] == before[key][:i] + before[key][i + 1:]  # the others stay, in place
        assert target[i] != "a" and target[i] not in before[key]
    assert Counter(target[before[key].index("a")] for key, target in plan.items())["d"] >= 1  # the empty node first
    apply(metadata, plan, list(racks))
    assert "a" not in metadata.replicas_per_node()


def test_a_drain_stays_on_the_drained_nodes_rack_then_on_a_rack_the_partition_lacks():
    racks = {"a": "x", "b": "y", "c": "z", "d": "x", "e": "w"}
    metadata = ClusterMetadata()
    metadata.create_topic("t", 1, 3, None, ["a", "b", "c"])
    # d shares a's rack: it wins over e though e has a rack of its own, and over b and c's racks.
    assert plan_drain(metadata, "a", loads_of(metadata, racks)) == {("t", 0): [x if x != "a" else "d" for x in placements(metadata)[("t", 0)]]}
    # Without d, e (a rack the partition does not use) keeps the partition on three racks.
    del racks["d"]
    assert plan_drain(metadata, "a", loads_of(metadata, racks))[("t", 0)].count("e") == 1


def test_a_partition_with_nowhere_to_go_is_a_capacity_error():
    racks = {n: "" for n in "abc"}
    metadata = cluster({"t": (2, 3)}, racks)
    with pytest.raises(NodeCapacityError, match="cannot leave node a"):
        plan_drain(metadata, "a", loads_of(metadata, racks))
    racks["d"] = ""
    with pytest.raises(NodeCapacityError):
        plan_drain(metadata, "a", loads_of(metadata, racks, limits={"d": 1}))  # d has room for one of the two
    assert len(plan_drain(metadata, "a", loads_of(metadata, racks, limits={"d": 2}))) == 2


def test_nothing_to_move_is_an_empty_plan():
    assert plan_drain(ClusterMetadata(), "a", []) == {} and plan_rebalance(ClusterMetadata(), []) == {}
    metadata = cluster({"t": (2, 1)}, {"a": ""})
    assert plan_drain(metadata, "b", loads_of(metadata, {"a": "", "b": ""})) == {}  # b holds nothing
    assert plan_rebalance(metadata, loads_of(metadata, {"a": ""})) == {}


def test_a_partition_being_moved_is_planned_from_its_target():
    racks = {n: "" for n in "abcd"}
    metadata = cluster({"t": (1, 2)}, {n: "" for n in "ab"})
    metadata.start_reassignment("t", 0, ["a", "c"], list(racks))  # b is leaving already
    assert plan_drain(metadata, "b", loads_of(metadata, racks)) == {}
    assert plan_drain(metadata, "a", loads_of(metadata, racks)) == {("t", 0): ["d", "c"]}
    assert plan_rebalance(metadata, loads_of(metadata, racks)) == {}  # nothing else to move, and it is moving


def test_a_rebalance_moves_just_enough_replicas_onto_new_nodes():
    metadata = cluster({"t": (6, 2)}, {n: "" for n in "abc"})  # 4 replicas on each of a, b, c
    racks = {n: "" for n in "abcde"}
    before = placements(metadata)
    plan = plan_rebalance(metadata, loads_of(metadata, racks))
    assert moved_replicas(before, before | plan) == 4  # 12 replicas over 5 nodes: 3, 3, 2, 2, 2
    apply(metadata, plan, list(racks))
    assert sorted(metadata.replicas_per_node().values()) == [2, 2, 2, 3, 3]
    assert plan_rebalance(metadata, loads_of(metadata, racks)) == {}  # balanced: nothing more


def test_a_rebalance_never_puts_a_partition_on_fewer_racks():
    metadata = ClusterMetadata()
    metadata.create_topic("t", 2, 2, None, ["a", "b"])
    racks = {"a": "x", "b": "y", "c": "y", "d": "y"}
    plan = plan_rebalance(metadata, loads_of(metadata, racks))
    for target in plan.values():
        assert {racks[n] for n in target} == {"x", "y"}
    assert "a" in plan.get(("t", 0), ["a"]) and "a" in plan.get(("t", 1), ["a"])  # a is x's only node: it stays


@settings(max_examples=150, deadline=None)
@given(
    node_count=st.integers(2, 6),
    rack_count=st.integers(1, 3),
    topics=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 5)), min_size=1, max_size=3),
    data=st.data(),
)
def test_a_drain_empties_the_node_evenly_and_keeps_racks(node_count, rack_count, topics, data):
    racks = {f"n{i}": f"r{i % rack_count}" for i in range(node_count)}
    metadata = cluster({f"t{i}": (p, min(rf, node_count - 1)) for i, (p, rf) in enumerate(topics)}, racks)
    drained = data.draw(st.sampled_from(sorted(racks)))
    rest = [n for n in racks if n != drained]
    before, counts_before = placements(metadata), metadata.replicas_per_node()
    plan = plan_drain(metadata, drained, loads_of(metadata, racks))
    assert {key for key, nodes in before.items() if drained in nodes} <= set(plan)
    apply(metadata, plan, list(racks))
    counts = metadata.replicas_per_node()
    assert drained not in counts  # the drained node hosts nothing
    for key, nodes in placements(metadata).items():
        assert len(set(nodes)) == len(nodes) == len(before[key])  # never two replicas of a partition on one node
        rack_set, was = {racks[n] for n in nodes}, {racks[n] for n in before[key]}
        assert len(rack_set) >= min(len(was), len({racks[n] for n in rest}))  # no fewer racks than the nodes left allow
    spread_before = max(counts_before.get(n, 0) for n in rest) - min(counts_before.get(n, 0) for n in rest)
    spread = max(counts.get(n, 0) for n in rest) - min(counts.get(n, 0) for n in rest)
    if rack_count == 1:
        assert spread <= max(1, spread_before)  # within 1 of each other (or as even as before)


@settings(max_examples=150, deadline=None)
@given(
    node_count=st.integers(1, 5),
    added=st.integers(1, 3),
    rack_count=st.integers(1, 3),
    topics=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 5)), min_size=1, max_size=3),
)
def test_a_rebalance_evens_out_replicas_moving_as_few_as_possible(node_count, added, rack_count, topics):
    old = {f"n{i}": f"r{i % rack_count}" for i in range(node_count)}
    metadata = cluster({f"t{i}": (p, min(rf, node_count)) for i, (p, rf) in enumerate(topics)}, old)
    racks = old | {f"m{i}": f"r{(node_count + i) % rack_count}" for i in range(added)}  # nodes join, empty
    before, counts_before = placements(metadata), metadata.replicas_per_node()
    plan = plan_rebalance(metadata, loads_of(metadata, racks))
    apply(metadata, plan, list(racks))
    after, counts = placements(metadata), metadata.replicas_per_node()
    for key, nodes in after.items():
        assert len(set(nodes)) == len(nodes) == len(before[key])
        assert len({racks[n] for n in nodes}) >= len({racks[n] for n in before[key]})  # never fewer racks
    if rack_count == 1:
        loads = [counts.get(n, 0) for n in racks]
        assert max(loads) - min(loads) <= 1
        # As few as possible: each node gives only what it holds above its share (the fullest get the larger shares).
        share, extra = divmod(sum(loads), len(racks))
        fullest_first = sorted((counts_before.get(n, 0) for n in racks), reverse=True)
        least = sum(max(0, held - share - (i < extra)) for i, held in enumerate(fullest_first))
        assert moved_replicas(before, after) == least
