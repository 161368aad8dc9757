"""Placement by load and racks, and leaders spread evenly: unit tests and Hypothesis properties."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidReplicationFactorError, NodeCapacityError
from logbus.protocol.placement import NodeLoad, Placer


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
