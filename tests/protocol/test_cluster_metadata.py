"""ClusterMetadata rules: placement, elections, ISR changes, replacement, restart placement."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidReplicationFactorError, TopicAlreadyExistsError
from logbus.protocol.cluster_metadata import ClusterMetadata

NODES = ["n0", "n1", "n2", "n3"]


def metadata_with(partitions=3, replication_factor=3, nodes=NODES[:3]):
    metadata = ClusterMetadata()
    metadata.create_topic("t", partitions, replication_factor, None, list(nodes))
    return metadata


def test_replicas_of_a_partition_go_to_distinct_nodes():
    metadata = metadata_with(partitions=5, replication_factor=3, nodes=NODES)
    for state in metadata.topics["t"].partitions:
        assert len(set(state.nodes.values())) == 3
        assert state.leader == 0 and state.leader_epoch == 0 and state.isr == [0, 1, 2]


def test_bad_topics_are_refused_and_change_nothing():
    metadata = metadata_with()
    with pytest.raises(TopicAlreadyExistsError):
        metadata.create_topic("t", 1, 1, None, NODES)
    with pytest.raises(InvalidReplicationFactorError):
        metadata.create_topic("u", 1, 4, None, NODES[:3])
    assert list(metadata.topics) == ["t"]


def test_election_prefers_live_isr_members_and_bumps_the_epoch():
    metadata = metadata_with()
    assert metadata.elect_leader("t", 0, alive={1, 2}, unclean_allowed=False)
    state = metadata.topics["t"].partitions[0]
    assert (state.leader, state.leader_epoch, state.isr) == (1, 1, [1, 2])
    # No live ISR member and no unclean election: leaderless, and the ISR keeps its last members.
    metadata.alter_isr("t", 0, leader=1, leader_epoch=1, isr=[1])
    assert metadata.elect_leader("t", 0, alive={2}, unclean_allowed=False)
    assert (state.leader, state.leader_epoch, state.isr) == (None, 2, [1])
    # Unclean election lets the out-of-sync replica lead, alone in the ISR.
    assert metadata.elect_leader("t", 0, alive={2}, unclean_allowed=True)
    assert (state.leader, state.leader_epoch, state.isr) == (2, 3, [2])


def test_isr_changes_only_from_the_current_leader_and_epoch():
    metadata = metadata_with()
    assert metadata.alter_isr("t", 0, leader=1, leader_epoch=0, isr=[1]) is None
    assert metadata.alter_isr("t", 0, leader=0, leader_epoch=1, isr=[0]) is None
    assert metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[2, 7]) == [0, 2]


def test_replacement_takes_a_fresh_id_on_the_new_node():
    metadata = metadata_with(nodes=NODES[:3])
    new = metadata.replace_replica("t", 0, dead=1, node="n3")
    state = metadata.topics["t"].partitions[0]
    assert new == 3 and state.replicas == [0, 3, 2] and state.nodes["3"] == "n3" and "1" not in state.nodes
    assert 1 not in state.isr


def test_a_partition_with_a_live_replica_is_not_moved_on_restart():
    """A controller restart after one node died must not move that node's replicas next to others."""
    metadata = metadata_with(partitions=3, replication_factor=3, nodes=NODES[:3])
    before = {p: dict(s.nodes) for p, s in enumerate(metadata.topics["t"].partitions)}
    assert metadata.reassign_dead_nodes(["n0", "n2", "n3"]) == []
    assert {p: dict(s.nodes) for p, s in enumerate(metadata.topics["t"].partitions)} == before


@settings(max_examples=200, deadline=None)
@given(
    partitions=st.integers(1, 6),
    replication_factor=st.integers(1, 3),
    new_nodes=st.integers(1, 5),
)
def test_whole_cluster_restart_places_every_replica_on_a_live_node(partitions, replication_factor, new_nodes):
    metadata = metadata_with(partitions=partitions, replication_factor=replication_factor, nodes=NODES[:3])
    live = [f"m{i}" for i in range(new_nodes)]
    moved = metadata.reassign_dead_nodes(live)
    assert len(moved) == partitions * replication_factor
    for state in metadata.topics["t"].partitions:
        assert all(node in live for node in state.nodes.values())
        # Distinct nodes whenever there are enough of them.
        assert len(set(state.nodes.values())) == min(replication_factor, new_nodes)
        assert state.leader == 0 and state.leader_epoch == 0  # the log and leadership carry over


def test_json_round_trip_keeps_everything():
    metadata = metadata_with()
    metadata.elect_leader("t", 1, alive={2}, unclean_allowed=False)
    metadata.allocate_producer_id()
    again = ClusterMetadata.from_json(metadata.to_json())
    assert again.to_json() == metadata.to_json()
    assert again.next_producer_id == 1
