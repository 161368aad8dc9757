"""The nodes' epoch tables as the controller derives them from its metadata, and the replies to heartbeats.
No Ray is started.

Every replica the metadata names is in exactly one epoch table, its node's,
with its partition's current leader epoch; a node hosting nothing has no
table (so ``NodeTable.set_epochs`` empties it and its agent is retired); and
the replica index names each replica's (topic, partition, replica id). A
heartbeat is answered as ``NodeTable.heartbeat_answer`` decides, and only one
answered ``renew`` renews the node's lease.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.actors.cluster_nodes import ClusterNodes, epoch_tables, followers_to_drop
from logbus.actors.lease_files import replica_file_name
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.node_table import NodeTable

NODES = ["node-a", "node-b", "node-c", "node-d"]


def metadata_with(topics: list[tuple[int, int]]) -> ClusterMetadata:
    """Topics t0, t1, ... of (partitions, replication factor) placed on NODES."""
    metadata = ClusterMetadata()
    for i, (partitions, replication_factor) in enumerate(topics):
        metadata.create_topic(f"t{i}", partitions, replication_factor, None, NODES)
    return metadata


def test_each_replica_is_in_its_nodes_table_with_its_partitions_leader_epoch():
    metadata = metadata_with([(2, 2)])
    topic = metadata.topic("t0")
    state = topic.partitions[1]
    dead = state.nodes[str(state.leader)]
    assert metadata.elect_leader("t0", 1, alive=set(state.replicas) - {state.leader}, unclean_allowed=False)
    by_name, tables = epoch_tables(metadata.topics.values())
    for p, partition in enumerate(topic.partitions):
        for r in partition.replicas:
            name = replica_file_name(topic.topic_id, p, r)
            assert by_name[name] == ("t0", p, r)
            assert tables[partition.nodes[str(r)]][name] == partition.leader_epoch
    assert topic.partitions[1].leader_epoch == 1 and topic.partitions[0].leader_epoch == 0
    assert dead in tables  # still hosting its (follower) replica


def test_no_topics_no_tables_and_a_node_left_empty_loses_its_table():
    assert epoch_tables([]) == ({}, {})
    metadata = metadata_with([(1, 1)])
    _, tables = epoch_tables(metadata.topics.values())
    table = NodeTable("controller-1", 0)
    assert [n.node_id for n in table.set_epochs(tables)] == list(tables)
    metadata.delete_topic("t0")
    _, tables = epoch_tables(metadata.topics.values())
    assert tables == {}
    emptied = table.set_epochs(tables)
    assert len(emptied) == 1 and emptied[0].epochs == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, len(NODES))), max_size=5))
def test_every_replica_is_in_exactly_one_table_and_the_index_names_it(topics):
    metadata = metadata_with(topics)
    by_name, tables = epoch_tables(metadata.topics.values())
    expected = {
        replica_file_name(t.topic_id, p, r): (t.name, p, r, state.nodes[str(r)], state.leader_epoch)
        for t in metadata.topics.values() for p, state in enumerate(t.partitions) for r in state.replicas
    }
    assert len(expected) == sum(p * f for p, f in topics)
    assert by_name == {name: e[:3] for name, e in expected.items()}
    placed = [(name, node, epoch) for node, table in tables.items() for name, epoch in table.items()]
    assert sorted(placed) == sorted((name, e[3], e[4]) for name, e in expected.items())
    assert all(tables.values())  # no empty table: a node hosting nothing has none



class Host:
    """The controller's side of a heartbeat that renews (``NodeHost``): what it was asked to do."""

    def __init__(self) -> None:
        self.resent: list[str] = []

    def resend_roles(self, node_id: str, now: int) -> None:
        self.resent.append(node_id)

    def spawn(self, coroutine, what: str) -> None:
        coroutine.close()  # checking the replicas of a node hosting none: nothing to run


def test_only_a_heartbeat_from_the_nodes_ray_node_renews_its_lease_and_the_others_are_told_why_not():
    host = Host()
    nodes = ClusterNodes(host, "controller-1", "controller")
    node_id = "node-0123456789abcdef"
    node = nodes.table.entry(node_id)
    assert nodes.renew(node_id, "agent-1", [], None, "ray-old") == {"wait": True}  # on no Ray node yet
    nodes.table.move(node, "ray-old", None, agent=None)
    nodes.table.move(node, "ray-new", None, agent=None)  # the host joined again
    assert nodes.renew(node_id, "agent-1", [], None, "ray-old") == {"stale": True}
    assert nodes.renew(node_id, "agent-2", [], None, "ray-other") == {"wait": True}
    assert node.incarnation is None and host.resent == []  # nothing renewed yet
    reply = nodes.renew(node_id, "agent-3", [], None, "ray-new")
    assert reply == {"version": node.version, "epochs": {}}
    assert node.incarnation == "agent-3" and host.resent == [node_id]  # a new agent: its roles are sent again


def test_the_followers_of_a_dead_node_in_live_leaders_isrs_are_named_by_partition_with_its_leader_epoch():
    metadata = metadata_with([(4, 3)])
    topic = metadata.topic("t0")
    dead = topic.partitions[0].nodes[str(topic.partitions[0].leader)]  # leads partition 0, follows others
    by_name, tables = epoch_tables(metadata.topics.values())
    on_dead = set(tables[dead])

    def leader_alive(t, p, leader):
        return t.partitions[p].nodes[str(leader)] != dead

    found = followers_to_drop(on_dead, by_name, metadata, leader_alive)
    expected = {}
    for p, state in enumerate(topic.partitions):
        mine = [r for r in state.replicas if state.nodes[str(r)] == dead]
        if mine and state.nodes[str(state.leader)] != dead:
            expected[("t0", p)] = (state.leader_epoch, mine)
    assert found == expected and ("t0", 0) not in found  # its own leaderships are an election's business
    # A follower already out of the ISR is not named; nor are replicas the index does not know.
    some = next(iter(found))
    state = topic.partitions[some[1]]
    state.isr = [r for r in state.isr if r not in found[some][1]]
    assert some not in followers_to_drop(on_dead | {"unknown-replica"}, by_name, metadata, leader_alive)
