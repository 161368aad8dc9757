"""Where new replicas go: placement by load, racks, and leaders spread evenly. Pure (no Ray, no I/O).

The controller asks :class:`Placer` for the nodes of each new partition. A
partition's replicas go to distinct nodes; among the candidates the least
loaded go first (fewest replicas, then fewest bytes, then the node id, so the
choice is deterministic); when nodes carry rack labels (Ray node label
``logbus.rack``, or ``zone``) the replicas of one partition spread over as
many racks as there are (like Kafka's ``broker.rack``). The first replica is
the partition's preferred leader: among a partition's nodes the one leading
the fewest partitions goes first, so leaders spread evenly too. Each choice
counts towards the next one, so one call places a whole topic evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
