"""Where replicas go: placement by load, racks, and leaders spread evenly; drain and rebalance plans. Pure (no Ray, no I/O).

The controller asks :class:`Placer` for the nodes of each new partition. A
partition's replicas go to distinct nodes; among the candidates the least
loaded go first (fewest replicas, then fewest bytes, then the node id, so the
choice is deterministic); when nodes carry rack labels (Ray node label
``logbus.rack``, or ``zone``) the replicas of one partition spread over as
many racks as there are (like Kafka's ``broker.rack``). The first replica is
the partition's preferred leader: among a partition's nodes the one leading
the fewest partitions goes first, so leaders spread evenly too. Each choice
counts towards the next one, so one call places a whole topic evenly.

For replicas that exist, :func:`plan_drain` (empty a node) and
:func:`plan_rebalance` (even out the replicas per node, e.g. onto nodes just
added) plan reassignments: a target list of nodes per partition, to start
with ``ClusterMetadata.start_reassignment``. They follow the same rules: never
two replicas of a partition on one node, never fewer racks for a partition
than it had, the least loaded nodes first, and as few replicas moved as
possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from logbus.errors import InvalidReplicationFactorError, NodeCapacityError

NO_RACK = ""


@dataclass(slots=True)
class NodeLoad:
    """What placement knows of one node: its rack, and how loaded it is."""

    node_id: str
    rack: str = NO_RACK
    replicas: int = 0
    leaders: int = 0
    bytes: int = 0
    limit: int | None = None  # most replicas it may hold (None: no limit)

    def full(self) -> bool:
        return self.limit is not None and self.replicas >= self.limit


@dataclass
class Placer:
    """Places partitions one after the other, counting each placement into the loads."""

    nodes: list[NodeLoad]
    _by_id: dict[str, NodeLoad] = field(init=False)

    def __post_init__(self) -> None:
        self._by_id = {n.node_id: n for n in self.nodes}

    def place(self, replication_factor: int) -> list[str]:
        """The nodes of one new partition, preferred leader first; counts them as loaded."""
        if replication_factor > len(self.nodes):
            raise InvalidReplicationFactorError(
                f"replication factor {replication_factor} exceeds the {len(self.nodes)} node(s) that may host replicas"
            )
        open_nodes = [n for n in self.nodes if not n.full()]
        if len(open_nodes) < replication_factor:
            raise NodeCapacityError(
                f"a partition needs {replication_factor} nodes with room for a replica; {len(open_nodes)} have room "
                "(max.replicas.per.node): add nodes, raise the limit, or use fewer partitions"
            )
        chosen: list[NodeLoad] = []
        racks_used: set[str] = set()
        candidates = sorted(open_nodes, key=lambda n: (n.replicas, n.bytes, n.node_id))
        while len(chosen) < replication_factor:
            # The least loaded node on a rack this partition does not use yet; once every rack is used, any.
            fresh = [n for n in candidates if n not in chosen and n.rack not in racks_used]
            pick = (fresh or [n for n in candidates if n not in chosen])[0]
            chosen.append(pick)
            racks_used.add(pick.rack)
        chosen.sort(key=lambda n: (n.leaders, n.replicas, n.node_id))  # the preferred leader: fewest leaders
        for n in chosen:
            n.replicas += 1
        chosen[0].leaders += 1
        return [n.node_id for n in chosen]

    def place_all(self, partitions: int, replication_factor: int) -> list[list[str]]:
        """The nodes of ``partitions`` new partitions; nothing is counted if any one cannot be placed."""
        saved = [(n.replicas, n.leaders) for n in self.nodes]
        try:
            return [self.place(replication_factor) for _ in range(partitions)]
        except Exception:
            for n, (replicas, leaders) in zip(self.nodes, saved):
                n.replicas, n.leaders = replicas, leaders
            raise


# --- reassignment plans -------------------------------------------------------------------


class _Metadata(Protocol):
    """What the planners read of a ``ClusterMetadata`` (not imported: that module imports this one)."""

    topics: dict


class _Loads:
    """The planners' working copy of the loads: replicas and leaders per node, counted as moves are planned.

    The caller's :class:`NodeLoad` objects are left as they are: a plan is a
    proposal, counted only once its reassignments start.
    """

    def __init__(self, loads: list[NodeLoad]) -> None:
        self.nodes = {n.node_id: n for n in loads}
        self.replicas = {n.node_id: n.replicas for n in loads}
        self.leaders = {n.node_id: n.leaders for n in loads}

    def rack(self, node_id: str) -> str:
        node = self.nodes.get(node_id)
        return node.rack if node is not None else NO_RACK  # a node placement does not know (a dead one): no rack

    def has_room(self, node_id: str) -> bool:
        limit = self.nodes[node_id].limit
        return limit is None or self.replicas[node_id] < limit

    def move(self, src: str, dst: str, leads: bool) -> None:
        """Count one replica (the preferred leader if ``leads``) as moved from ``src`` to ``dst``."""
        for counts, moved in ((self.replicas, True), (self.leaders, leads)):
            if moved:
                if src in counts:
                    counts[src] -= 1
                counts[dst] += 1

    def order(self, node_id: str) -> tuple:
        """Least loaded first: fewest replicas, then fewest bytes, then the id (deterministic)."""
        return self.replicas[node_id], self.nodes[node_id].bytes, node_id


def _targets(metadata: _Metadata) -> tuple[dict[tuple[str, int], list[str]], set[tuple[str, int]]]:
    """Every partition's target nodes (where it will be once a reassignment in progress completes), and the ones moving."""
    targets, moving = {}, set()
    for name in sorted(metadata.topics):
        for p, state in enumerate(metadata.topics[name].partitions):
            targets[(name, p)] = [state.nodes[str(r)] for r in state.target()]
            if state.reassigning():
                moving.add((name, p))
    return targets, moving


def _racks(loads: _Loads, nodes: list[str]) -> int:
    return len({loads.rack(n) for n in nodes})


def plan_drain(metadata: _Metadata, node_id: str, loads: list[NodeLoad]) -> dict[tuple[str, int], list[str]]:
    """Targets that move every replica off ``node_id``: {(topic, partition): target nodes, preferred leader first}.

    Each partition whose target holds ``node_id`` gets it replaced, in the
    same position, by the least loaded node of ``loads`` that has room and
    holds no replica of the partition: one on the drained node's rack if
    there is one, else one on a rack the partition does not use, else any.
    Each choice counts towards the next. The partition's other replicas
    stay where they are, unless the drained node's partitions cannot spread
    evenly by themselves (the least loaded nodes already hold replicas of
    them): then, as in :func:`plan_rebalance`, replicas move from the most
    to the least loaded nodes (planned ones first: moving those costs
    nothing more) until the counts differ by at most 1, or by no more than
    they did before the drain, so the plan may also name partitions the
    drained node does not hold. A partition already being reassigned is
    planned from its target (start its move once the current one
    completes). NodeCapacityError, and no plan, if some partition has
    nowhere to go. ``loads`` is not changed.
    """
    work = _Loads(loads)
    drained_rack = work.rack(node_id) if node_id in work.nodes else None
    targets, moving = _targets(metadata)
    others = [n for n in work.nodes if n != node_id]
    spread_before = max(work.replicas[n] for n in others) - min(work.replicas[n] for n in others) if others else 0
    current = {key: list(nodes) for key, nodes in targets.items()}
    for key, nodes in targets.items():
        # Every position on the node (two only after a whole-cluster restart onto fewer nodes).
        for i in [i for i, n in enumerate(nodes) if n == node_id]:
            kept = [n for n in current[key] if n != node_id]
            used_racks = {work.rack(n) for n in kept}
            candidates = [n for n in others if n not in kept and work.has_room(n)]
            if not candidates:
                raise NodeCapacityError(
                    f"{key[0]}-{key[1]} cannot leave node {node_id}: every other node holds one of its replicas or is full "
                    "(max.replicas.per.node): add nodes or raise the limit"
                )

            def tier(n: str) -> int:
                rack = work.rack(n)
                return 0 if rack == drained_rack else 1 if rack not in used_racks else 2

            current[key][i] = min(candidates, key=lambda n: (tier(n), *work.order(n)))
            work.move(node_id, current[key][i], leads=i == 0)
    # Balancing moves replicas of partitions at rest, and the planned ones (the lists are shared with ``current``).
    movable = {key: nodes for key, nodes in current.items() if key not in moving or nodes != targets[key]}
    _balance(work, movable, targets, others, max(1, spread_before))
    return _changed(current, targets)


def plan_rebalance(metadata: _Metadata, loads: list[NodeLoad]) -> dict[tuple[str, int], list[str]]:
    """Targets that even out the replicas per node: {(topic, partition): target nodes, preferred leader first}.

    Moves one replica at a time from the most loaded node of ``loads`` to the
    least loaded one (nodes just added, say) until their replica counts
    differ by at most 1, or no legal move is left: the destination must have
    room, hold no replica of the partition, and not leave the partition on
    fewer racks. Each move takes a replica from a node above the balance to
    one below it, so no more replicas move than needed. A moved replica keeps
    its position; the preferred leader moves only while the source leads at
    least 2 more partitions than the destination, so leaders even out too.
    Partitions being reassigned stay as they are; nodes not in ``loads``
    (dead ones) neither give nor take replicas. ``loads`` is not changed.
    """
    work = _Loads(loads)
    targets, moving = _targets(metadata)
    current = {key: list(nodes) for key, nodes in targets.items() if key not in moving}
    _balance(work, current, targets, list(work.nodes), 1)
    return _changed(current, targets)


def _changed(current: dict[tuple[str, int], list[str]], targets: dict[tuple[str, int], list[str]]) -> dict[tuple[str, int], list[str]]:
    return {key: nodes for key, nodes in current.items() if nodes != targets[key]}


def _balance(
    work: _Loads,
    current: dict[tuple[str, int], list[str]],
    original: dict[tuple[str, int], list[str]],
    nodes: list[str],
    spread: int,
) -> None:
    """Move replicas of ``current`` (in place) among ``nodes`` until their replica counts differ by at most ``spread``.

    Each move goes from the most loaded node with a legal move to the least
    loaded node at least 2 below it, so it lowers the sum of squared counts
    and the loop ends; it stops early when no legal move is left.
    """
    while nodes and max(work.replicas[n] for n in nodes) - min(work.replicas[n] for n in nodes) > spread:
        move = _best_move(work, current, original, nodes)
        if move is None:
            return
        key, i, dst = move
        work.move(current[key][i], dst, leads=i == 0)
        current[key][i] = dst


def _best_move(
    work: _Loads,
    current: dict[tuple[str, int], list[str]],
    original: dict[tuple[str, int], list[str]],
    nodes: list[str],
) -> tuple[tuple[str, int], int, str] | None:
    """The next replica to move, as (partition, position, destination), or None if no move helps."""
    order = sorted(nodes, key=work.order)
    for src in reversed(order):
        for dst in order:
            if work.replicas[src] - work.replicas[dst] < 2:
                break
            if not work.has_room(dst):
                continue
            lead_first = work.leaders[src] - work.leaders[dst] >= 2
            choices = []
            for key, placed in current.items():
                if src not in placed or dst in placed:
                    continue
                i = placed.index(src)
                after = placed[:i] + [dst] + placed[i + 1:]
                if _racks(work, after) < _racks(work, placed):
                    continue
                # A replica the plan moves already moves again at no cost; then the preferred leader if leaders are uneven.
                free = src != original[key][i]
                choices.append((not free, (i == 0) != lead_first, key, i))
            if choices:
                *_, key, i = min(choices)
                return key, i, dst
    return None
