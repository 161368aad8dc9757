"""ClusterMetadata rules: placement, elections, ISR changes, replacement, restart placement; random sequences of them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

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


def test_replacing_the_leader_leaves_the_partition_leaderless_at_a_new_epoch():
    metadata = metadata_with()
    state = metadata.topics["t"].partitions[0]
    new = metadata.replace_replica("t", 0, dead=0, node="n3")
    assert (new, state.leader, state.leader_epoch, state.isr, state.replicas) == (3, None, 1, [1, 2], [3, 1, 2])
    assert metadata.elect_leader("t", 0, alive={1, 2, 3}, unclean_allowed=False)
    assert (state.leader, state.leader_epoch) == (1, 2)


def test_the_only_in_sync_replica_is_never_replaced():
    metadata = metadata_with()
    state = metadata.topics["t"].partitions[0]
    assert metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0]) == [0]
    assert metadata.elect_leader("t", 0, alive={1, 2}, unclean_allowed=False)  # leaderless, ISR [0]
    before = metadata.to_json()
    with pytest.raises(AssertionError, match="only in-sync replica"):
        metadata.replace_replica("t", 0, dead=0, node="n3")
    with pytest.raises(AssertionError, match="not one of"):
        metadata.replace_replica("t", 0, dead=7, node="n3")
    assert metadata.to_json() == before and state.isr == [0]


def test_a_leaderless_partition_accepts_no_isr_change():
    metadata = metadata_with()
    state = metadata.topics["t"].partitions[0]
    assert metadata.elect_leader("t", 0, alive=set(), unclean_allowed=False)
    assert metadata.alter_isr("t", 0, leader=None, leader_epoch=state.leader_epoch, isr=[1]) is None
    assert (state.leader, state.isr) == (None, [0, 1, 2])


class ElectionMachine(RuleBasedStateMachine):
    """Elections (any live set, clean or unclean), ISR changes from the current or a stale leader and
    epoch, and replacements, on one partition of 1 to 5 replicas; every rule checks its own outcome and
    the invariants hold after every step."""

    @initialize(replication_factor=st.integers(1, 5))
    def start(self, replication_factor):
        self.metadata = ClusterMetadata()
        self.metadata.create_topic("t", 1, replication_factor, None, [f"n{i}" for i in range(replication_factor)])
        self.ever = set(range(replication_factor))  # every replica id the partition ever had
        self.last = self.snapshot()
        self.nodes = replication_factor

    def state(self):
        return self.metadata.topics["t"].partitions[0]

    def snapshot(self):
        s = self.state()
        return s.leader, s.leader_epoch, list(s.isr), list(s.replicas)

    def ids(self):
        """Replica ids to draw from: current ones, replaced ones, and one never used."""
        return sorted(self.ever | {max(self.ever) + 1})

    @rule(data=st.data(), unclean=st.booleans())
    def elect(self, data, unclean):
        alive = data.draw(st.sets(st.sampled_from(self.ids())))
        leader, epoch, isr, replicas = self.snapshot()
        changed = self.metadata.elect_leader("t", 0, alive, unclean)
        s = self.state()
        assert changed == (s.leader != leader) and s.replicas == replicas
        clean = [r for r in replicas if r in isr and r in alive]
        if clean:  # a clean election: the first live ISR member in replica order (the old leader if that is it)
            assert s.leader == clean[0]
            deposed = leader if changed and leader is not None and len(isr) > 1 else None
            assert s.isr == [r for r in isr if r != deposed]  # a deposed leader leaves the ISR
        elif unclean and any(r in alive for r in replicas):  # unclean: a live out-of-sync replica, alone in the ISR
            assert s.leader == next(r for r in replicas if r in alive) and s.isr == [s.leader]
        else:  # nobody may lead: leaderless, keeping the last ISR
            assert s.leader is None and s.isr == isr
        if not unclean:
            assert s.leader is None or s.leader in isr  # an out-of-sync replica never leads

    @rule(data=st.data(), epoch_delta=st.integers(-1, 1))
    def alter_isr(self, data, epoch_delta):
        leader, epoch, isr, replicas = self.snapshot()
        who = data.draw(st.sampled_from(self.ids() + [None]) | st.just(leader))
        proposal = data.draw(st.lists(st.sampled_from(self.ids()), max_size=6))
        accepted = self.metadata.alter_isr("t", 0, who, epoch + epoch_delta, proposal)
        s = self.state()
        if leader is not None and who == leader and epoch_delta == 0:
            assert accepted == s.isr == sorted(set(proposal) & set(replicas) | {leader})
        else:
            assert accepted is None and s.isr == isr
        assert (s.leader, s.leader_epoch, s.replicas) == (leader, epoch, replicas)

    @rule(data=st.data())
    def replace(self, data):
        leader, epoch, isr, replicas = self.snapshot()
        candidates = [r for r in replicas if isr != [r]]  # the controller never replaces the only in-sync copy
        if not candidates:
            return
        dead = data.draw(st.sampled_from(candidates))
        self.nodes += 1
        new = self.metadata.replace_replica("t", 0, dead, f"n{self.nodes}")
        s = self.state()
        assert new not in self.ever  # never reused
        self.ever.add(new)
        assert s.replicas == [new if r == dead else r for r in replicas] and s.nodes[str(new)] == f"n{self.nodes}"
        assert s.isr == [r for r in isr if r != dead]
        if dead == leader:
            assert (s.leader, s.leader_epoch) == (None, epoch + 1)
        else:
            assert (s.leader, s.leader_epoch) == (leader, epoch)

    @invariant()
    def epoch_moves_exactly_with_the_leader(self):
        leader, epoch, _, _ = self.last
        s = self.state()
        assert s.leader_epoch == (epoch + 1 if s.leader != leader else epoch)
        self.last = self.snapshot()

    @invariant()
    def partition_is_consistent(self):
        s = self.state()
        assert len(set(s.replicas)) == len(s.replicas) and set(s.replicas) <= self.ever
        assert set(s.nodes) == {str(r) for r in s.replicas}
        assert s.isr and len(set(s.isr)) == len(s.isr) and set(s.isr) <= set(s.replicas)
        if s.leader is not None:
            assert s.leader in s.replicas and s.leader in s.isr
        again = ClusterMetadata.from_json(self.metadata.to_json()).topics["t"].partitions[0]
        assert again == s


ElectionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_election_machine = ElectionMachine.TestCase


def test_a_placement_over_a_nodes_limit_fails_and_adds_nothing():
    from logbus.errors import NodeCapacityError

    metadata = ClusterMetadata()
    metadata.create_topic("a", 3, 1, None, ["n1", "n2"], node_limits={"n1": 2, "n2": 2})
    assert metadata.replicas_per_node() == {"n1": 2, "n2": 1}
    before = metadata.to_json()
    with pytest.raises(NodeCapacityError, match="max.replicas.per.node"):
        metadata.create_topic("b", 2, 1, None, ["n1", "n2"], node_limits={"n1": 2, "n2": 2})
    with pytest.raises(NodeCapacityError):
        metadata.create_partitions("a", 5, ["n1", "n2"], node_limits={"n1": 2, "n2": 2})
    assert metadata.to_json() == before  # nothing created, nothing grown
    metadata.create_partitions("a", 4, ["n1", "n2"], node_limits={"n1": 2, "n2": 2})
    assert metadata.replicas_per_node() == {"n1": 2, "n2": 2}
