"""The decisions of moving replicas (protocol/replica_moves.py): unit tests and Hypothesis properties, without Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import (
    InvalidPartitionError,
    InvalidReassignmentError,
    NodeCapacityError,
    ReassignmentInProgressError,
    UnknownTopicError,
)
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.placement import plan_drain
from logbus.protocol.replica_moves import (
    check_assignments_form,
    check_reassignments,
    drain_reservation_size,
    move_progress,
    move_ready,
    preferred_election_candidates,
)


def cluster(topics: dict[str, tuple[int, int]], nodes: list[str]) -> ClusterMetadata:
    """Metadata with ``topics`` ({name: (partitions, replication factor)}) placed by load over ``nodes``."""
    metadata = ClusterMetadata()
    for name, (partitions, replication_factor) in topics.items():
        metadata.create_topic(name, partitions, replication_factor, None, nodes, loads=metadata.node_loads(nodes))
    return metadata


def placements(metadata: ClusterMetadata) -> dict[tuple[str, int], list[str]]:
    return {(name, p): [s.nodes[str(r)] for r in s.replicas] for name, t in metadata.topics.items() for p, s in enumerate(t.partitions)}


def catch_up(metadata: ClusterMetadata, name: str, partition: int) -> None:
    """The leader reports every replica in sync (the new ones copied the log)."""
    state = metadata.topics[name].partitions[partition]
    metadata.alter_isr(name, partition, state.leader, state.leader_epoch, list(state.replicas))


# --- which moves may start ------------------------------------------------------------------------


@pytest.mark.parametrize("assignments", [None, {}, [(("t", 0), ["a"])], "t-0"])
def test_assignments_that_are_no_non_empty_dict_are_refused(assignments):
    with pytest.raises(InvalidReassignmentError, match="non-empty"):
        check_assignments_form(assignments)
    with pytest.raises(InvalidReassignmentError, match="non-empty"):
        check_reassignments(ClusterMetadata(), assignments, ["a"])


def test_valid_moves_come_back_as_lists_and_the_metadata_is_untouched():
    metadata = cluster({"t": (2, 2)}, ["a", "b", "c"])
    before = metadata.to_json()
    checked = check_reassignments(metadata, {("t", 0): ("c", "a"), ("t", 1): ["b", "c"]}, ["a", "b", "c"])
    assert checked == {("t", 0): ["c", "a"], ("t", 1): ["b", "c"]}
    assert metadata.to_json() == before


BAD_ENTRIES = {
    "unknown topic": ((("nope", 0), ["a"]), UnknownTopicError),
    "no such partition": ((("t", 9), ["a"]), InvalidPartitionError),
    "a node twice": ((("t", 0), ["a", "a"]), InvalidReassignmentError),
    "a node not live": ((("t", 0), ["a", "zz"]), InvalidReassignmentError),
    "an empty target": ((("t", 0), []), InvalidReassignmentError),
}


@settings(max_examples=100, deadline=None)
@given(
    partitions=st.integers(2, 6),
    bad=st.sampled_from(sorted(BAD_ENTRIES)),
    data=st.data(),
)
def test_one_bad_move_refuses_them_all_and_changes_nothing(partitions, bad, data):
    nodes = ["a", "b", "c", "d"]
    metadata = cluster({"t": (partitions, 2)}, nodes)
    (key, target), error = BAD_ENTRIES[bad]
    good = {
        ("t", p): data.draw(st.permutations(nodes).map(lambda ns: ns[:2]), label=f"target of t-{p}")
        for p in data.draw(st.sets(st.integers(1, partitions - 1), max_size=partitions - 1), label="partitions moved")
    }
    entries = list(good.items())
    entries.insert(data.draw(st.integers(0, len(entries)), label="where the bad entry goes"), (key, target))
    before = metadata.to_json()
    with pytest.raises(error):
        check_reassignments(metadata, dict(entries), nodes)
    assert metadata.to_json() == before  # nothing started, not even the valid entries before the bad one


def test_a_partition_already_moving_cannot_be_moved_again():
    metadata = cluster({"t": (1, 2)}, ["a", "b", "c"])
    metadata.start_reassignment("t", 0, ["c", "a"], ["a", "b", "c"])
    with pytest.raises(ReassignmentInProgressError):
        check_reassignments(metadata, {("t", 0): ["b", "c"]}, ["a", "b", "c"])


# --- whether a move is finished -------------------------------------------------------------------


def test_a_move_is_ready_once_its_new_replicas_are_in_sync_and_only_until_it_completes():
    metadata = cluster({"t": (2, 2)}, ["a", "b", "c"])
    assert not move_ready(metadata, "t", 0)  # nothing moving
    target = [n for n in ["a", "b", "c"] if n not in placements(metadata)[("t", 0)]] + placements(metadata)[("t", 0)][:1]
    added = metadata.start_reassignment("t", 0, target, ["a", "b", "c"])
    assert added and not move_ready(metadata, "t", 0)  # the new replica has not copied the log yet
    catch_up(metadata, "t", 0)
    assert move_ready(metadata, "t", 0)
    assert not move_ready(metadata, "t", 1)  # another partition of the topic is not moving
    metadata.complete_reassignment("t", 0)
    assert not move_ready(metadata, "t", 0)  # a second completion (an ISR change after it) finds nothing to do
    assert placements(metadata)[("t", 0)] == target


def test_a_move_of_a_deleted_topic_or_a_missing_partition_is_never_ready():
    metadata = cluster({"t": (1, 2)}, ["a", "b", "c"])
    metadata.start_reassignment("t", 0, ["c", "b"] if "a" in placements(metadata)[("t", 0)] else ["a", "b"], ["a", "b", "c"])
    catch_up(metadata, "t", 0)
    assert move_ready(metadata, "t", 0)
    assert not move_ready(metadata, "t", 1)
    assert not move_ready(metadata, "t", -1)
    assert not move_ready(metadata, "other", 0)
    metadata.delete_topic("t")
    assert not move_ready(metadata, "t", 0)


def test_a_cancelled_move_is_not_ready():
    metadata = cluster({"t": (1, 2)}, ["a", "b", "c"])
    [free] = [n for n in ["a", "b", "c"] if n not in placements(metadata)[("t", 0)]]
    metadata.start_reassignment("t", 0, [placements(metadata)[("t", 0)][0], free], ["a", "b", "c"])
    metadata.cancel_reassignment("t", 0)
    catch_up(metadata, "t", 0)
    assert not move_ready(metadata, "t", 0)


# --- what a drain asks an autoscaler for ----------------------------------------------------------


def test_a_drain_reserves_one_slot_more_than_its_widest_partition():
    metadata = cluster({"narrow": (3, 1), "wide": (2, 3)}, ["a", "b", "c"])
    assert drain_reservation_size(metadata, "a") == 4  # every node holds a replica of "wide"
    assert drain_reservation_size(metadata, "nowhere") == 2  # hosts nothing


@settings(max_examples=200, deadline=None)
@given(
    node_count=st.integers(1, 6),
    topics=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=3),
    data=st.data(),
)
def test_with_the_reserved_slots_a_drain_always_has_a_plan_that_leaves_the_node(node_count, topics, data):
    nodes = [f"n{i}" for i in range(node_count)]
    metadata = cluster({f"t{i}": (p, min(rf, node_count)) for i, (p, rf) in enumerate(topics)}, nodes)
    drained = data.draw(st.sampled_from(nodes), label="drained")
    size = drain_reservation_size(metadata, drained)
    hosted = any(drained in targets for targets in placements(metadata).values())
    try:
        plan = plan_drain(metadata, drained, metadata.node_loads(nodes))
    except NodeCapacityError:
        assert hosted and node_count < size  # only a cluster smaller than the reservation has nowhere to go
        # The autoscaler's nodes: the reservation's slots on distinct nodes, new ones where the cluster has too few.
        nodes = nodes + [f"new{i}" for i in range(size - node_count)]
        plan = plan_drain(metadata, drained, metadata.node_loads(nodes))
    before = placements(metadata)
    for key, target in plan.items():
        assert drained not in target  # never onto the drained node
        assert len(set(target)) == len(target) == len(before[key])  # never two replicas of a partition on one node
        assert set(target) <= set(nodes)
    for key, was in before.items():
        assert drained not in plan.get(key, was)  # every partition it held moves


# --- preferred leaders ----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    node_count=st.integers(2, 5),
    topics=st.lists(st.tuples(st.integers(1, 5), st.integers(2, 3)), min_size=1, max_size=3),
    data=st.data(),
)
def test_preferred_leader_candidates_are_exactly_the_partitions_led_by_another_replica(node_count, topics, data):
    nodes = [f"n{i}" for i in range(node_count)]
    metadata = cluster({f"t{i}": (p, min(rf, node_count)) for i, (p, rf) in enumerate(topics)}, nodes)
    keys = sorted(placements(metadata))
    assert preferred_election_candidates(metadata) == []  # placement makes every first replica the leader
    # Some leaders fail over (and their replica later catches up again); some partitions start moving.
    for name, p in data.draw(st.sets(st.sampled_from(keys)), label="failovers"):
        state = metadata.topics[name].partitions[p]
        metadata.elect_leader(name, p, set(state.replicas) - {state.leader}, unclean_allowed=False)
        catch_up(metadata, name, p)
    moving = data.draw(st.sets(st.sampled_from(keys)), label="moving")
    for name, p in moving:
        state = metadata.topics[name].partitions[p]
        held = [state.nodes[str(r)] for r in state.replicas]
        free = [n for n in nodes if n not in held]
        # Onto a node it does not use (a copy), or, with none free, the same nodes in another order (no copy).
        metadata.start_reassignment(name, p, held[:-1] + free[:1] if free else held[::-1], nodes)
    topic_filter = data.draw(st.none() | st.sets(st.sampled_from(sorted(metadata.topics))).map(sorted), label="topics")
    partition_filter = data.draw(st.none() | st.sets(st.sampled_from(keys)).map(sorted), label="partitions")

    found = preferred_election_candidates(metadata, topic_filter, partition_filter)
    assert found == sorted(found, key=lambda key: (list(metadata.topics).index(key[0]), key[1]))
    for name, p in keys:
        state = metadata.topics[name].partitions[p]
        wanted = (
            (topic_filter is None or name in topic_filter)
            and (partition_filter is None or (name, p) in partition_filter)
            and not state.adding
            and state.leader != state.replicas[0]
        )
        assert ((name, p) in found) == wanted

    # Electing them (every replica alive and in sync) leaves none to elect, and the rest as they were.
    everything = preferred_election_candidates(metadata)
    for name, p in everything:
        state = metadata.topics[name].partitions[p]
        assert metadata.elect_preferred_leader(name, p, set(state.replicas))
    assert preferred_election_candidates(metadata) == []
    for name, p in keys:
        state = metadata.topics[name].partitions[p]
        assert state.leader == state.replicas[0] or state.adding


def test_a_preferred_replica_out_of_sync_stays_a_candidate_until_it_may_lead():
    metadata = cluster({"t": (1, 3)}, ["a", "b", "c"])
    state = metadata.topics["t"].partitions[0]
    preferred = state.replicas[0]
    metadata.elect_leader("t", 0, set(state.replicas) - {preferred}, unclean_allowed=False)  # it fails: out of the ISR
    assert preferred_election_candidates(metadata) == [("t", 0)]
    assert not metadata.elect_preferred_leader("t", 0, set(state.replicas))  # not in sync: it may not lead yet
    catch_up(metadata, "t", 0)
    assert metadata.elect_preferred_leader("t", 0, set(state.replicas))
    assert preferred_election_candidates(metadata) == []


# --- how a move is reported -----------------------------------------------------------------------


def test_a_moves_progress_names_the_leaders_end_and_each_new_replicas_copy():
    moving = {"target": ["c", "a"], "adding": [2], "removing": [1], "throttle_bytes_per_s": None}
    row = move_progress("t", 0, moving, 0, {0: 120, 2: 80})
    assert row == {"topic": "t", "partition": 0, **moving, "leader_log_end_offset": 120, "copied": {"2": 80}}
    silent = move_progress("t", 0, moving, None, {2: None})  # no leader; the new replica did not answer
    assert silent["leader_log_end_offset"] is None and silent["copied"] == {"2": None}
