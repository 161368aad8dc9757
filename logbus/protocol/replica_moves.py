"""What moving replicas decides, apart from how the moves are carried out. Pure (no Ray, no I/O).

The controller's :class:`~logbus.actors.replica_moves.ReplicaMoves` starts,
finishes and cancels reassignments, drains nodes, rebalances and elects
preferred leaders; the choices it makes on the way are here, as functions of
the metadata (and of what the replicas reported), so they are tested without
actors:

- :func:`check_reassignments`: whether a set of moves may start, all of them
  or none (each entry is tried on a copy of the metadata first);
- :func:`move_ready`: whether a partition's move may be completed now (every
  replica it adds is in the ISR);
- :func:`drain_reservation_size`: how many replica slots on distinct nodes a
  drain asks an autoscaler for when some partition has nowhere to go;
- :func:`preferred_election_candidates`: which partitions are led by another
  replica than their preferred one and may get it back;
- :func:`move_progress`: one partition's move as ``describe_reassignments``
  reports it.

Where the replicas go (a drain's and a rebalance's targets) is placement's
decision: :func:`~logbus.protocol.placement.plan_drain` and
:func:`~logbus.protocol.placement.plan_rebalance`.
"""

from __future__ import annotations

from collections.abc import Iterable

from logbus.errors import InvalidReassignmentError
from logbus.protocol.cluster_metadata import ClusterMetadata


def check_assignments_form(assignments: object) -> None:
    """InvalidReassignmentError unless ``assignments`` is a non-empty dict (of ``(topic, partition): [node ids]``)."""
    if not isinstance(assignments, dict) or not assignments:
        raise InvalidReassignmentError("assignments must be a non-empty {(topic, partition): [node ids]} dict")


def check_reassignments(metadata: ClusterMetadata, assignments: object, live_nodes: list[str]) -> dict[tuple[str, int], list[str]]:
    """Refuse a set of moves unless every one of them may start; returns them as ``{(topic, partition): [node ids]}``.

    ``assignments`` must be a non-empty ``{(topic, partition): [node id, ...]}``
    dict (InvalidReassignmentError otherwise). Each entry is started on a copy
    of ``metadata``, so the first entry that ``ClusterMetadata.start_reassignment``
    refuses (an unknown partition, one already moving, a bad target) raises
    its error here and ``metadata`` is left as it was: all the moves start,
    or none.
    """
    check_assignments_form(assignments)
    trial = ClusterMetadata.from_json(metadata.to_json())
    checked = {}
    for (topic, partition), nodes in assignments.items():
        trial.start_reassignment(topic, partition, list(nodes), live_nodes)  # raises before anything changes
        checked[(topic, partition)] = list(nodes)
    return checked


def move_ready(metadata: ClusterMetadata, topic: str, partition: int) -> bool:
    """Whether ``topic``-``partition`` is being moved and its move may complete now.

    False for a topic deleted or a partition number out of range meanwhile,
    and for a partition not being moved (a move already completed or
    cancelled): finishing a move is asked for again on every ISR change, and
    only the first call that finds it ready completes it.
    """
    found = metadata.topics.get(topic)
    if found is None or not 0 <= partition < len(found.partitions) or not found.partitions[partition].adding:
        return False
    return metadata.reassignment_ready(topic, partition)


def drain_reservation_size(metadata: ClusterMetadata, node_id: str) -> int:
    """Replica slots on distinct nodes that let every partition on ``node_id`` leave it.

    One more than the widest partition hosted there: the slots may include the
    drained node itself, so RF + 1 distinct nodes leave at least RF others,
    enough for the RF - 1 replicas that stay plus the one that moves. 2 when
    the node hosts nothing.
    """
    widest = max(
        (len(state.replicas) for topic in metadata.topics.values() for state in topic.partitions if node_id in state.nodes.values()),
        default=1,
    )
    return widest + 1


def preferred_election_candidates(
    metadata: ClusterMetadata, topics: Iterable[str] | None = None, partitions: Iterable[tuple[str, int]] | None = None
) -> list[tuple[str, int]]:
    """The partitions whose leader is not their preferred replica (the first), in topic order then by number.

    ``topics`` (names), if given, limits the search to those topics, and
    ``partitions`` ((topic, partition) pairs) to those partitions (Kafka's
    ElectLeaders names them). A partition being moved is left out (its move
    chooses its leader when it completes), and so is one without replicas.
    Whether the preferred replica may lead (alive, in the ISR) is
    ``ClusterMetadata.elect_preferred_leader``'s decision.
    """
    names = None if topics is None else set(topics)
    only = None if partitions is None else {(t, int(p)) for t, p in partitions}
    found = []
    for topic in metadata.topics.values():
        if names is not None and topic.name not in names:
            continue
        for p, state in enumerate(topic.partitions):
            if only is not None and (topic.name, p) not in only:
                continue
            if state.adding or not state.replicas or state.leader == state.replicas[0]:
                continue
            found.append((topic.name, p))
    return found


def move_progress(topic: str, partition: int, moving: dict, leader: int | None, log_end_offsets: dict[int, int | None]) -> dict:
    """One move as ``describe_reassignments`` reports it.

    ``moving`` is the partition's entry of ``ClusterMetadata.reassignments()``;
    ``log_end_offsets`` maps replica ids to the log end offset each reported
    (None, or missing, for one that did not answer). The row adds the
    leader's log end and, per replica being added, how far it has copied.
    """
    return {
        "topic": topic,
        "partition": partition,
        **moving,
        "leader_log_end_offset": log_end_offsets.get(leader) if leader is not None else None,
        "copied": {str(r): log_end_offsets.get(r) for r in moving["adding"]},
    }
