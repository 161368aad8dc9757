"""ClusterMetadata rules: placement, elections, ISR changes, replacement, restart placement, reassignment and
preferred leaders; random sequences of them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from logbus.errors import (
    InternalStateError,
    InvalidConfigError,
    InvariantViolationError,
    InvalidPartitionError,
    InvalidReassignmentError,
    InvalidReplicationFactorError,
    NoReassignmentInProgressError,
    ReassignmentInProgressError,
    TopicAlreadyExistsError,
    UnknownTopicError,
)
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.storage.node_identity import new_node_id

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


def test_a_whole_cluster_restart_of_hosts_keeps_every_replica_on_its_node():
    """Hosts keep their node ids over a restart (their data directories): nothing moves, whatever is live yet;
    a partition with a replica on a host waits for it, even next to nodes named by Ray node ids."""
    hosts = [new_node_id() for _ in range(3)]
    metadata = metadata_with(partitions=4, replication_factor=2, nodes=hosts)
    mixed = metadata.create_topic("mixed", 2, 2, None, [hosts[0], "ray-node-a"])
    before = json.loads(metadata.to_json())
    assert metadata.reassign_dead_nodes(["ray-node-b", "ray-node-c"]) == []
    assert json.loads(metadata.to_json()) == before
    assert all(hosts[0] in state.nodes.values() for state in mixed.partitions)


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
    with pytest.raises(InvariantViolationError, match="only in-sync replica"):
        metadata.replace_replica("t", 0, dead=0, node="n3")
    with pytest.raises(InvariantViolationError, match="not one of"):
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


# --- reassignment (KIP-455), drain and preferred leaders -------------------------------------------


def placement(metadata, partition=0):
    """The partition's nodes, in replica order."""
    state = metadata.topics["t"].partitions[partition]
    return [state.nodes[str(r)] for r in state.replicas]


def test_a_reassignment_keeps_replicas_on_target_nodes_and_adds_fresh_ones_elsewhere():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    assert metadata.start_reassignment("t", 0, ["n3", b, a], NODES) == [3]
    # The target's replicas in target order, then the one being removed; the ISR waits for the new one.
    assert (state.replicas, state.adding, state.removing, state.isr) == ([3, 1, 0, 2], [3], [2], [0, 1, 2])
    assert (state.nodes["3"], state.next_replica_id, state.leader, state.leader_epoch) == ("n3", 4, 0, 0)
    assert metadata.reassignments() == {("t", 0): {"target": ["n3", b, a], "adding": [3], "removing": [2], "throttle_bytes_per_s": None}}
    assert metadata.topics["t"].replication_factor == 3
    assert not metadata.reassignment_ready("t", 0)
    with pytest.raises(InternalStateError, match="not ready"):
        metadata.complete_reassignment("t", 0)
    assert metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 1, 2, 3]) == [0, 1, 2, 3]
    assert metadata.reassignment_ready("t", 0)
    assert metadata.complete_reassignment("t", 0) == ([2], False)
    assert (state.replicas, state.isr, state.adding, state.removing) == ([3, 1, 0], [0, 1, 3], [], [])
    assert placement(metadata) == ["n3", b, a] and "2" not in state.nodes
    assert (state.leader, state.leader_epoch) == (0, 0) and metadata.reassignments() == {}
    # The new first replica is the preferred leader: leadership goes back to it with a new epoch.
    assert metadata.elect_preferred_leader("t", 0, alive={0, 1, 3})
    assert (state.leader, state.leader_epoch, state.isr) == (3, 1, [0, 1, 3])
    assert not metadata.elect_preferred_leader("t", 0, alive={0, 1, 3})


def test_a_reassignments_throttle_is_saved_with_it_and_goes_when_it_ends():
    metadata = metadata_with(partitions=2)
    a, b, c = placement(metadata)
    assert metadata.start_reassignment("t", 0, ["n3", b, a], NODES, throttle_bytes_per_s=4_000_000) == [3]
    assert metadata.start_reassignment("t", 1, [b, a, "n3"], NODES, throttle_bytes_per_s=1_000) == [3]
    # A restarted controller reads it back with the move.
    restored = ClusterMetadata.from_json(metadata.to_json())
    assert {k: v["throttle_bytes_per_s"] for k, v in restored.reassignments().items()} == {("t", 0): 4_000_000, ("t", 1): 1_000}
    restored.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 1, 2, 3])
    restored.complete_reassignment("t", 0)
    assert restored.topics["t"].partitions[0].throttle_bytes_per_s is None
    restored.cancel_reassignment("t", 1)
    assert restored.topics["t"].partitions[1].throttle_bytes_per_s is None and restored.reassignments() == {}
    # A move that adds no replica copies nothing: no throttle is kept for it.
    assert restored.start_reassignment("t", 0, [b], NODES, throttle_bytes_per_s=5) == []
    assert restored.reassignments()[("t", 0)]["throttle_bytes_per_s"] is None


def test_completing_without_the_leader_hands_leadership_to_the_first_target_replica_in_sync():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    assert metadata.start_reassignment("t", 0, [c, "n3"], NODES) == [3]
    assert (state.replicas, state.removing) == ([2, 3, 0, 1], [0, 1])
    metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 3])  # replica 2 fell out of sync
    assert metadata.complete_reassignment("t", 0) == ([0, 1], True)
    assert (state.replicas, state.isr, state.leader, state.leader_epoch) == ([2, 3], [3], 3, 1)
    assert placement(metadata) == [c, "n3"]


def test_a_target_of_the_current_nodes_only_reorders():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    before = metadata.to_json()
    assert metadata.start_reassignment("t", 0, [a, b, c], NODES) == []
    assert metadata.to_json() == before  # the same nodes in the same order: nothing at all
    assert metadata.start_reassignment("t", 0, [c, a, b], NODES) == []
    assert (state.replicas, state.adding, state.removing, state.next_replica_id) == ([2, 0, 1], [], [], 3)
    assert (state.leader, state.leader_epoch, state.isr) == (0, 0, [0, 1, 2]) and metadata.reassignments() == {}


def test_a_shrinking_reassignment_waits_for_a_target_replica_in_sync():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0])
    assert metadata.start_reassignment("t", 0, [b], NODES) == []
    assert (state.replicas, state.adding, state.removing) == ([1, 0, 2], [], [0, 2])
    assert metadata.topics["t"].replication_factor == 1
    assert not metadata.reassignment_ready("t", 0)  # completing now would leave no in-sync replica
    with pytest.raises(InternalStateError):
        metadata.complete_reassignment("t", 0)
    metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 1])
    assert metadata.complete_reassignment("t", 0) == ([0, 2], True)
    assert (state.replicas, state.isr, state.leader, state.leader_epoch, state.nodes) == ([1], [1], 1, 1, {"1": b})


@pytest.mark.parametrize(
    "target, live, error",
    [
        ([], NODES, InvalidReassignmentError),
        (["n0", "n3", "n0"], NODES, InvalidReassignmentError),
        (["n0", "n9"], NODES, InvalidReassignmentError),
        ("n0", NODES, InvalidReassignmentError),
        (["n0", "n1", "n2", "n3"], NODES[:3], InvalidReplicationFactorError),
    ],
)
def test_a_bad_target_is_a_named_caller_error_and_changes_nothing(target, live, error):
    metadata = metadata_with(partitions=1)
    before = metadata.to_json()
    with pytest.raises(error) as raised:
        metadata.start_reassignment("t", 0, target, live)
    assert not raised.value.retriable
    assert metadata.to_json() == before


def test_unknown_partitions_and_a_reassignment_in_progress_are_refused():
    metadata = metadata_with(partitions=2)
    with pytest.raises(UnknownTopicError):
        metadata.start_reassignment("nope", 0, ["n0"], NODES)
    for partition in (2, -1, "0", True):
        with pytest.raises(InvalidPartitionError):
            metadata.start_reassignment("t", partition, ["n0"], NODES)
    metadata.start_reassignment("t", 0, ["n3"], NODES)
    before = metadata.to_json()
    with pytest.raises(ReassignmentInProgressError) as raised:
        metadata.start_reassignment("t", 0, ["n0"], NODES)
    assert not raised.value.retriable and metadata.to_json() == before
    assert metadata.start_reassignment("t", 1, ["n3"], NODES) == [3]  # another partition is not held up
    assert set(metadata.reassignments()) == {("t", 0), ("t", 1)}


def test_cancelling_drops_the_added_replicas_and_keeps_their_ids_burnt():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    with pytest.raises(NoReassignmentInProgressError):
        metadata.cancel_reassignment("t", 0)
    with pytest.raises(InternalStateError, match="no reassignment"):
        metadata.complete_reassignment("t", 0)
    assert not metadata.reassignment_ready("t", 0)
    assert metadata.start_reassignment("t", 0, ["n3", a], NODES) == [3]
    metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 1, 2, 3])
    assert metadata.cancel_reassignment("t", 0) == [3]
    assert (state.replicas, state.isr, state.adding, state.removing) == ([0, 1, 2], [0, 1, 2], [], [])
    assert set(state.nodes) == {"0", "1", "2"} and state.next_replica_id == 4
    assert metadata.replace_replica("t", 0, dead=2, node="n3") == 4  # id 3 had a directory once: never again


def test_cancelling_is_refused_while_an_added_replica_leads_or_holds_every_in_sync_copy():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    metadata.start_reassignment("t", 0, ["n3"], NODES)
    metadata.alter_isr("t", 0, leader=0, leader_epoch=0, isr=[0, 3])
    assert metadata.elect_leader("t", 0, alive={3}, unclean_allowed=False)  # the new replica leads
    before = metadata.to_json()
    with pytest.raises(InvalidReassignmentError, match="leads"):
        metadata.cancel_reassignment("t", 0)
    assert metadata.elect_leader("t", 0, alive=set(), unclean_allowed=False)  # leaderless, ISR [3]
    assert state.isr == [3]
    with pytest.raises(InvalidReassignmentError, match="lose"):
        metadata.cancel_reassignment("t", 0)
    assert metadata.complete_reassignment("t", 0) == ([0, 1, 2], False)  # completing keeps the data
    assert (state.replicas, state.isr, state.leader) == ([3], [3], None)
    assert before != metadata.to_json()


def test_a_replacement_during_a_reassignment_takes_the_dead_replicas_role():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    a, b, c = placement(metadata)
    metadata.start_reassignment("t", 0, [a, "n3"], NODES + ["n4", "n5"])
    assert (state.replicas, state.adding, state.removing) == ([0, 3, 1, 2], [3], [1, 2])
    assert metadata.replace_replica("t", 0, dead=3, node="n4") == 4  # the added replica's node died
    assert metadata.replace_replica("t", 0, dead=2, node="n5") == 5
    assert (state.replicas, state.adding, state.removing) == ([0, 4, 1, 5], [4], [1, 5])
    assert metadata.reassignments()[("t", 0)]["target"] == [a, "n4"]
    with pytest.raises(InvariantViolationError, match="already holds"):
        metadata.replace_replica("t", 0, dead=1, node="n4")


def test_the_preferred_leader_leads_only_when_in_sync_and_alive():
    metadata = metadata_with(partitions=1)
    state = metadata.topics["t"].partitions[0]
    assert metadata.elect_leader("t", 0, alive={1, 2}, unclean_allowed=False)  # 0 failed: 1 leads, ISR [1, 2]
    assert not metadata.elect_preferred_leader("t", 0, alive={0, 1, 2})  # 0 is back but not in sync yet
    metadata.alter_isr("t", 0, leader=1, leader_epoch=1, isr=[0, 1, 2])
    assert not metadata.elect_preferred_leader("t", 0, alive={1, 2})
    assert metadata.elect_preferred_leader("t", 0, alive={0, 1, 2})
    assert (state.leader, state.leader_epoch, state.isr) == (0, 2, [0, 1, 2])


def test_json_keeps_a_reassignment_in_progress_and_reads_version_1():
    metadata = metadata_with(partitions=2)
    metadata.start_reassignment("t", 0, ["n3", "n0"], NODES)
    again = ClusterMetadata.from_json(metadata.to_json())
    assert again.to_json() == metadata.to_json()
    assert again.reassignments() == metadata.reassignments()
    # Metadata written before reassignments: no new fields, version 1.
    raw = json.loads(metadata_with(partitions=2).to_json())
    raw["version"] = 1
    for partition in raw["topics"]["t"]["partitions"]:
        for key in ("adding", "removing", "next_replica_id"):
            del partition[key]
    old = ClusterMetadata.from_json(json.dumps(raw))
    state = old.topics["t"].partitions[0]
    assert (state.adding, state.removing, state.next_replica_id) == ([], [], 3) and old.reassignments() == {}
    assert old.replace_replica("t", 0, dead=1, node="n3") == 3
    assert old.upgraded_from == 1
    raw["version"] = 99
    with pytest.raises(ValueError, match="unsupported metadata version"):
        ClusterMetadata.from_json(json.dumps(raw))


def test_version_2_metadata_naming_ray_node_ids_loads_and_is_upgraded_in_place():
    """A file written before node identity: its node ids are Ray node ids, which stay the ids of nodes
    without a logbus label; it gets a cluster id, and is written again in the current version."""
    ray_nodes = ["77b5e1b62b6ed7717948bf9c25f32ba2f482a779d59755323a823833", "1f" * 28]
    raw = json.loads(metadata_with(partitions=2, replication_factor=2, nodes=ray_nodes).to_json())
    raw["version"] = 2
    del raw["cluster_id"]
    old = ClusterMetadata.from_json(json.dumps(raw))
    assert old.upgraded_from == 2 and old.cluster_id
    assert {n for state in old.topics["t"].partitions for n in state.nodes.values()} == set(ray_nodes)
    written = json.loads(old.to_json())
    assert written["version"] == 3 and written["cluster_id"] == old.cluster_id
    again = ClusterMetadata.from_json(old.to_json())
    assert again.upgraded_from is None and again.cluster_id == old.cluster_id and again.to_json() == old.to_json()
    # Those Ray node ids end with their Ray nodes: a whole-cluster restart places the partitions again.
    assert len(again.reassign_dead_nodes(["m0", "m1"])) == 4


def test_a_new_cluster_has_an_id_of_its_own():
    assert ClusterMetadata().cluster_id != ClusterMetadata().cluster_id


class ReassignmentMachine(RuleBasedStateMachine):
    """Reassignments started (valid or not), the ISR growing through the leader, completions, cancels,
    elections, preferred-leader elections and replacements, on one partition of 1 to 5 replicas over 1
    to 6 nodes. Each rule checks its outcome against a model (the target in force, the ids ever used);
    the invariants hold after every step."""

    @initialize(data=st.data())
    def start(self, data):
        nodes = data.draw(st.integers(1, 6))
        replication_factor = data.draw(st.integers(1, min(5, nodes)))
        self.live = [f"n{i}" for i in range(nodes)]
        self.metadata = ClusterMetadata()
        self.metadata.create_topic("t", 1, replication_factor, None, list(self.live))
        self.ever = set(range(replication_factor))
        self.target = None  # the target nodes of the reassignment in progress, as the model expects them
        self.last = (0, 0)  # leader, epoch

    def state(self):
        return self.metadata.topics["t"].partitions[0]

    def nodes_of(self, replicas):
        return [self.state().nodes[str(r)] for r in replicas]

    def ids(self):
        return sorted(self.ever | {max(self.ever) + 1})

    def unchanged_after(self, error, call):
        before = self.metadata.to_json()
        with pytest.raises(error):
            call()
        assert self.metadata.to_json() == before

    @rule(data=st.data())
    def start_reassignment(self, data):
        pool = self.live + ["gone"]  # "gone" is not live
        valid = st.permutations(self.live).flatmap(lambda nodes: st.integers(1, len(nodes)).map(lambda k: nodes[:k]))
        target = data.draw(valid | st.lists(st.sampled_from(pool), max_size=len(pool) + 1))
        s = self.state()
        replicas, isr, leader, epoch = list(s.replicas), list(s.isr), s.leader, s.leader_epoch
        current = self.nodes_of(replicas)
        if self.target is not None:
            error = ReassignmentInProgressError
        elif not target or len(set(target)) < len(target):
            error = InvalidReassignmentError
        elif len(target) > len(self.live):
            error = InvalidReplicationFactorError
        elif "gone" in target:
            error = InvalidReassignmentError
        else:
            error = None
        if error is not None:
            self.unchanged_after(error, lambda: self.metadata.start_reassignment("t", 0, target, self.live))
            return
        added = self.metadata.start_reassignment("t", 0, target, self.live)
        assert not set(added) & self.ever and added == sorted(added)  # fresh ids, in target order
        self.ever |= set(added)
        assert added == [r for r in s.replicas if r not in replicas]
        assert self.nodes_of(s.replicas[: len(target)]) == target  # the target in target order, then the removed
        assert s.removing == [r for r in replicas if current[replicas.index(r)] not in target]
        assert s.adding == added and (s.isr, s.leader, s.leader_epoch) == (isr, leader, epoch)
        if set(target) == set(current):
            assert not s.adding and not s.removing and self.nodes_of(s.replicas) == target  # only a new order
        else:
            self.target = list(target)
            assert self.metadata.reassignments() == {("t", 0): {"target": target, "adding": s.adding, "removing": s.removing, "throttle_bytes_per_s": None}}

    @rule(data=st.data())
    def leader_changes_the_isr(self, data):
        s = self.state()
        if s.leader is None:
            return
        proposal = data.draw(st.lists(st.sampled_from(s.replicas), unique=True))
        if data.draw(st.booleans()):
            proposal = sorted(set(proposal) | set(s.isr))  # mostly growth: new replicas catching up
        expected = sorted(set(proposal) | {s.leader})
        assert self.metadata.alter_isr("t", 0, s.leader, s.leader_epoch, proposal) == expected == s.isr

    @precondition(lambda self: self.target is not None)
    @rule(data=st.data())
    def added_replica_catches_up(self, data):
        s = self.state()
        if s.leader is None or not s.adding:
            return
        caught_up = data.draw(st.sampled_from(s.adding))
        assert caught_up in self.metadata.alter_isr("t", 0, s.leader, s.leader_epoch, s.isr + [caught_up]) == s.isr

    @precondition(lambda self: self.target is not None)
    @rule(catch_up=st.booleans())
    def complete(self, catch_up):
        s = self.state()
        if catch_up and s.leader is not None:  # often every added replica has caught up by now
            self.metadata.alter_isr("t", 0, s.leader, s.leader_epoch, s.isr + s.adding)
        isr = set(s.isr)
        if not (set(s.adding) <= isr and isr & set(s.target())):
            assert not self.metadata.reassignment_ready("t", 0)
            self.unchanged_after(InternalStateError, lambda: self.metadata.complete_reassignment("t", 0))
            return
        assert self.metadata.reassignment_ready("t", 0)
        removing, leader, epoch, target_ids = list(s.removing), s.leader, s.leader_epoch, s.target()
        removed, changed = self.metadata.complete_reassignment("t", 0)
        assert removed == removing and self.nodes_of(s.replicas) == self.target  # exactly the target, in order
        assert s.replicas == target_ids and not s.adding and not s.removing and set(s.nodes) == {str(r) for r in s.replicas}
        assert changed == (leader in removing)
        if changed:
            assert (s.leader, s.leader_epoch) == (next(r for r in target_ids if r in isr), epoch + 1)
        else:
            assert (s.leader, s.leader_epoch) == (leader, epoch)
        self.target = None

    @precondition(lambda self: self.target is not None)
    @rule()
    def cancel(self):
        s = self.state()
        if s.leader in s.adding or set(s.isr) <= set(s.adding):
            self.unchanged_after(InvalidReassignmentError, lambda: self.metadata.cancel_reassignment("t", 0))
            return
        replicas, adding, leader, epoch = list(s.replicas), list(s.adding), s.leader, s.leader_epoch
        assert self.metadata.cancel_reassignment("t", 0) == adding
        assert s.replicas == [r for r in replicas if r not in adding] and not s.adding and not s.removing
        assert (s.leader, s.leader_epoch) == (leader, epoch)
        self.target = None

    @rule(data=st.data(), unclean=st.booleans())
    def elect(self, data, unclean):
        alive = data.draw(st.sets(st.sampled_from(self.ids())))
        leader = self.state().leader
        assert self.metadata.elect_leader("t", 0, alive, unclean) == (self.state().leader != leader)

    @rule(data=st.data())
    def elect_preferred(self, data):
        s = self.state()
        alive = data.draw(st.sets(st.sampled_from(self.ids())))
        preferred, leader = s.replicas[0], s.leader
        should = preferred != leader and preferred in s.isr and preferred in alive
        assert self.metadata.elect_preferred_leader("t", 0, alive) == should
        assert s.leader == (preferred if should else leader)

    @rule(data=st.data())
    def replace(self, data):
        s = self.state()
        candidates = [r for r in s.replicas if s.isr != [r]]
        if not candidates:
            return
        dead = data.draw(st.sampled_from(candidates))
        used = set(self.nodes_of(r for r in s.replicas if r != dead))
        free = [n for n in self.live if n not in used]
        if not free:
            self.live.append(f"n{len(self.live)}")  # a node joins
            free = [self.live[-1]]
        node = data.draw(st.sampled_from(free))
        old_node = s.nodes[str(dead)]
        in_target = dead in s.target()
        new = self.metadata.replace_replica("t", 0, dead, node)
        assert new not in self.ever
        self.ever.add(new)
        if self.target is not None and in_target:
            self.target[self.target.index(old_node)] = node  # the target moves with its replica

    @invariant()
    def partition_is_consistent(self):
        s = self.state()
        replicas = set(s.replicas)
        assert len(replicas) == len(s.replicas) and replicas <= self.ever and s.next_replica_id > max(self.ever)
        assert set(s.nodes) == {str(r) for r in s.replicas}
        assert len(set(s.nodes.values())) == len(s.nodes)  # never two replicas of the partition on one node
        assert s.isr and len(set(s.isr)) == len(s.isr) and set(s.isr) <= replicas
        assert s.leader is None or s.leader in s.isr
        assert set(s.adding) <= replicas and set(s.removing) <= replicas and not set(s.adding) & set(s.removing)
        assert s.replicas[len(s.replicas) - len(s.removing):] == s.removing  # the removed come last
        assert (self.target is not None) == s.reassigning()
        if self.target is not None:
            assert self.metadata.reassignments()[("t", 0)]["target"] == self.target
        again = ClusterMetadata.from_json(self.metadata.to_json()).topics["t"].partitions[0]
        assert again == s

    @invariant()
    def leadership_changes_only_with_a_new_epoch(self):
        leader, epoch = self.last
        s = self.state()
        assert s.leader_epoch == (epoch + 1 if s.leader != leader else epoch)
        self.last = (s.leader, s.leader_epoch)


ReassignmentMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_reassignment_machine = ReassignmentMachine.TestCase


def test_acls_are_kept_in_the_metadata_and_a_file_from_before_acls_loads_with_none():
    from logbus.protocol.acl import AclBinding, AclFilter

    metadata = ClusterMetadata()
    read = AclBinding.of({"principal": "User:alice", "resource_type": "topic", "name": "orders", "operation": "read"})
    prefixed = AclBinding.of({"principal": "User:bob", "resource_type": "group", "name": "team-", "pattern": "prefixed"})
    assert metadata.create_acls([read, prefixed, read]) == 2 and metadata.acl_version == 1
    assert metadata.create_acls([read]) == 0 and metadata.acl_version == 1  # nothing new: the version stays
    loaded = ClusterMetadata.from_json(metadata.to_json())
    assert loaded.acl_bindings() == [read, prefixed] and loaded.acl_version == 1
    assert loaded.delete_acls([AclFilter.of({"principal": "User:bob"}), AclFilter.of({"principal": "User:bob"})]) == [[prefixed], []]
    assert loaded.describe_acls(AclFilter()) == [read] and loaded.acl_version == 2
    raw = json.loads(metadata.to_json())
    del raw["acls"], raw["acl_version"]
    older = ClusterMetadata.from_json(json.dumps(raw))
    assert older.acl_bindings() == [] and older.acl_version == 0


# --- topic config changes -------------------------------------------------------------------------

CONFIG_VALUES = {  # a few legal values per key, and one each LogConfig refuses
    "retention.ms": ([-1, 1000, 86_400_000], 10**30),
    "segment.bytes": ([1024, 1_048_576], 10),
    "min.insync.replicas": ([1, 2], 0),
    "cleanup.policy": (["delete", "compact", "compact,delete"], "shred"),
}


def test_a_config_change_sets_and_deletes_overrides_and_deleting_an_absent_one_is_no_error():
    metadata = metadata_with()
    assert metadata.alter_config("t", {"retention.ms": "1000", "segment.bytes": 2048}) == {"retention.ms": 1000, "segment.bytes": 2048}
    assert metadata.alter_config("t", {"min.insync.replicas": 2}, delete=["retention.ms", "flush.ms"]) == {
        "segment.bytes": 2048, "min.insync.replicas": 2}
    assert metadata.topics["t"].config == {"segment.bytes": 2048, "min.insync.replicas": 2}
    assert ClusterMetadata.from_json(metadata.to_json()).topics["t"].config == {"segment.bytes": 2048, "min.insync.replicas": 2}


@pytest.mark.parametrize("config, delete, message", [
    ({}, ["nope"], "unknown topic config 'nope'"),
    ({"retention.ms": 5}, ["retention.ms"], "both set and deleted"),
    ({"nope": 1}, [], "unknown topic config 'nope'"),
    ({"segment.bytes": 10}, ["retention.ms"], "segment.bytes"),
])
def test_a_bad_config_change_is_a_named_error_and_changes_nothing(config, delete, message):
    metadata = metadata_with()
    metadata.alter_config("t", {"retention.ms": 1000})
    before = metadata.to_json()
    with pytest.raises(InvalidConfigError, match=message):
        metadata.alter_config("t", config, delete)
    assert metadata.to_json() == before


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_config_changes_leave_the_old_overrides_less_the_deleted_plus_the_set_or_change_nothing(data):
    keys = sorted(CONFIG_VALUES)
    legal = {key: st.sampled_from(values) for key, (values, _) in CONFIG_VALUES.items()}
    any_value = {key: st.sampled_from([*values, bad]) for key, (values, bad) in CONFIG_VALUES.items()}
    metadata = metadata_with()
    old = data.draw(st.fixed_dictionaries({}, optional=legal), label="overrides before")
    metadata.alter_config("t", old)
    config = data.draw(st.fixed_dictionaries({}, optional=any_value), label="set")
    delete = data.draw(st.lists(st.sampled_from([*keys, "nope"]), unique=True), label="delete")
    before = metadata.to_json()
    refused = (
        "nope" in delete
        or set(config) & set(delete)
        or any(value == CONFIG_VALUES[key][1] for key, value in config.items())
    )
    if refused:
        with pytest.raises(InvalidConfigError):
            metadata.alter_config("t", config, delete)
        assert metadata.to_json() == before
        return
    overrides = metadata.alter_config("t", config, delete)
    assert set(overrides) == (set(old) - set(delete)) | set(config)
    for key, value in overrides.items():
        assert value == config.get(key, old.get(key))
