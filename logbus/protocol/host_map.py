"""Which Ray node each node is now: Ray's nodes as last seen, the hosts checked and refused, two hosts with one identity.

Decisions over plain data (no Ray, no I/O), owned by the controller next to
its node table (``node_table.py``), which this map reads and adds records
to. The controller makes the Ray calls: it lists Ray's nodes
(``actors/placement.py``, ``replica_hosts``), asks an agent on a host for its
identity, kills actors and logs; it tells this map what it found, and this
map decides which Ray node each node is, which hosts may be used, and which
duplicates to report. This class is not thread-safe: the controller calls it
from its event loop only.

Nodes and Ray nodes. A Ray node without the ``logbus.node`` label
(unlabelled) is the node named by its Ray node id, for good. A labelled Ray
node carries a host's node id (the identity in its data directory,
``storage/node_identity.py``); the node is on that Ray node once the host
there was checked (``identify``: an agent there read the identity and
recorded the cluster's id) and the node moved there (``NodeTable.move``). A
host whose check failed for good (another cluster's data directory, or one
without this node's identity) is refused (``refuse``): it is never used and
never a candidate again, while its Ray node lives.

A look at Ray's nodes (``look``) decides, for each node id labelled Ray
nodes carry (refused hosts left out, and the Ray nodes the node left,
``Node.past_ray_nodes``, never again):

- the node stays on its Ray node while that one carries it and is the only
  one that does, or while the node is alive (its agent heartbeats): a host
  that joined again before Ray declared its old Ray node dead is moved to
  only once the old one is silent, and two hosts with one identity (a copied
  data directory) leave the node where it is; the second is reported once
  per set of Ray nodes (``Look.duplicates``);
- otherwise the node moves to the newest other Ray node carrying it (the
  one a look listed last; of several first listed by the same look, the
  highest Ray node id), once the host there is checked (``Look.moves``: the
  controller checks each, then moves the node). A host killed while it was
  joining again is still listed on that Ray node until Ray declares it dead,
  beside the one it joined on next.

Usable hosts (``usable``): the Ray nodes, as last seen (``seen``), that are
their node now: unlabelled ones, and labelled ones their node is on. Refused
hosts are not, nor a Ray node a host left, nor a Ray node not in Ray's list
(it left, or is dead).

What is kept, and for how long. Checks and refusals are kept per Ray node
id, which Ray never reuses, while that Ray node is among Ray's nodes as
last seen: ``seen`` drops those of Ray nodes no longer listed (they left,
or are dead), and with them the duplicates reported of a set of Ray nodes
one of which left. So a cluster whose hosts come and go keeps as many as
it has live Ray nodes, not one per Ray node it ever had. A refused host
stays refused while Ray lists it; a Ray node listed again after a list
without it (Ray does not list a dead node again, so only as a glitch) is
checked again, as a new host would be. A node that leaves the node table
(``NodeTable.prune``) leaves this map too (``forget``): its checks,
refusals and reported duplicates. A node's ``past_ray_nodes`` likewise
keeps only the Ray nodes Ray still lists: one the node left that Ray no
longer lists can never be a candidate again.
"""

from __future__ import annotations

import dataclasses

from logbus.protocol.node_table import Node, NodeTable
from logbus.storage.node_identity import is_node_id


@dataclasses.dataclass(frozen=True)
class RayNode:
    """A live Ray node that may host replicas, as placement sees it."""

    ray_node_id: str
    node_id: str  # its logbus node id (label), or its Ray node id when it has no label
    labelled: bool
    limit: int  # replicas it may hold (replica_limit)
    rack: str  # "" when it has none


@dataclasses.dataclass(frozen=True)
class Identity:
    """A host checked on a Ray node: the node it is, where its replicas keep their logs, the agent that checked it."""

    node_id: str
    data_dir: str | None  # None: the cluster's data directory (a Ray node labelled by other means)
    agent: object  # the node agent's handle (opaque here)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A host refused on a Ray node: the node it claimed, and why (the check's error)."""

    node_id: str
    error: str


@dataclasses.dataclass(frozen=True)
class Duplicate:
    """A node carried by more than one Ray node while it stays on one: two hosts with one identity."""

    node_id: str
    ray_node_ids: tuple[str, ...]  # the Ray nodes carrying it (none it left), sorted
    kept: str  # the Ray node it stays on


@dataclasses.dataclass(frozen=True)
class Look:
    """What a look at Ray's nodes decided (``HostMap.look``)."""

    moves: list[tuple[Node, str]]  # (node, the Ray node to check, then move it to), by node id
    duplicates: list[Duplicate]  # reported for the first time


class HostMap:
    """Which Ray node each node is, the hosts checked and refused (see the module docstring)."""

    def __init__(self, table: NodeTable) -> None:
        self._table = table
        self._hosts: list[RayNode] = []  # Ray's nodes as last seen
        # By Ray node id, those among Ray's nodes as last seen only (``seen``): bounded by the live Ray nodes.
        self._identified: dict[str, Identity] = {}
        self._refused: dict[str, Refusal] = {}
        self._duplicates_told: set[tuple[str, tuple[str, ...]]] = set()  # (node id, its Ray nodes) reported
        self._first_listed: dict[str, int] = {}  # Ray node id -> when a look first listed it (as the others)

    # --- looking at Ray's nodes ---------------------------------------------------------------------

    def look(self, hosts: list[RayNode], now_ms: int) -> Look:
        """Ray's nodes, just listed: which nodes move where (once checked), which duplicates to report.

        Every node id a labelled host carries gets a record in the table, and
        none that Ray's nodes carry is pruned until a later look misses it.
        Usable hosts stay as at the previous look until ``seen``.
        """
        self._table.set_carried(host.node_id for host in hosts)
        for host in hosts:
            self._first_listed.setdefault(host.ray_node_id, now_ms)
        candidates: dict[str, list[str]] = {}
        for host in hosts:
            if host.labelled and host.ray_node_id not in self._refused:
                candidates.setdefault(host.node_id, []).append(host.ray_node_id)
        moves: list[tuple[Node, str]] = []
        duplicates: list[Duplicate] = []
        for node_id, ray_node_ids in sorted(candidates.items()):
            node = self._table.entry(node_id)
            fresh = [r for r in ray_node_ids if r not in node.past_ray_nodes]
            if node.ray_node_id in fresh and (len(fresh) == 1 or self._table.alive(node_id, now_ms)):
                told = (node_id, tuple(sorted(fresh)))
                if len(fresh) > 1 and told not in self._duplicates_told:
                    self._duplicates_told.add(told)
                    duplicates.append(Duplicate(node_id, told[1], node.ray_node_id))
                continue
            others = [r for r in fresh if r != node.ray_node_id]
            if others:
                # The newest: a host killed while it was joining again is listed on its Ray node before
                # that until Ray declares it dead, and a check there waits until then.
                moves.append((node, max(others, key=lambda r: (self._first_listed[r], r))))
        return Look(moves, duplicates)

    def seen(self, hosts: list[RayNode]) -> None:
        """Ray's nodes as last seen (after the look's checks): what ``usable`` and the lookups below go by.

        The checks, refusals and reported duplicates of Ray nodes not among them go, as do those Ray
        nodes from the nodes' ``past_ray_nodes``: those Ray nodes left (the controller checks only
        Ray nodes of the list it then passes here), and Ray never lists a dead one again.
        """
        self._hosts = list(hosts)
        listed = {host.ray_node_id for host in hosts}
        self._identified = {r: i for r, i in self._identified.items() if r in listed}
        self._refused = {r: i for r, i in self._refused.items() if r in listed}
        self._duplicates_told = {told for told in self._duplicates_told if listed.issuperset(told[1])}
        self._first_listed = {r: at for r, at in self._first_listed.items() if r in listed}
        for node in self._table.nodes():  # a Ray node a node left is kept from it only while Ray lists it
            node.past_ray_nodes &= listed

    # --- checks --------------------------------------------------------------------------------------

    def identified(self, ray_node_id: str) -> Identity | None:
        """The host on ``ray_node_id`` as checked, or None if it was not (or not successfully)."""
        return self._identified.get(ray_node_id)

    def identify(self, ray_node_id: str, node_id: str, data_dir: str | None, agent: object) -> Identity:
        """The host on ``ray_node_id`` was checked: it is ``node_id``, its logs in ``data_dir``. Returns its identity."""
        identity = self._identified[ray_node_id] = Identity(node_id, data_dir, agent)
        return identity

    def refuse(self, ray_node_id: str, node_id: str, error: str) -> None:
        """The host on ``ray_node_id``, claiming ``node_id``, failed its check for good: never used."""
        self._refused[ray_node_id] = Refusal(node_id, error)

    def refused_live(self) -> list[tuple[str, Refusal]]:
        """The refused hosts still among Ray's nodes as last seen, by Ray node id (what an operator is shown)."""
        live = {host.ray_node_id for host in self._hosts}
        return [(ray_node_id, refusal) for ray_node_id, refusal in sorted(self._refused.items()) if ray_node_id in live]

    # --- which Ray node each node is ------------------------------------------------------------------

    def usable(self) -> list[RayNode]:
        """The live Ray nodes, as last seen, that are their node now: a node named by its Ray node id, or a
        host's node mapped there (checked); hosts refused and Ray nodes a host left are not."""
        usable = []
        for host in self._hosts:
            if host.ray_node_id in self._refused:
                continue
            node = self._table.get(host.node_id)
            if not host.labelled or (node is not None and node.ray_node_id == host.ray_node_id):
                usable.append(host)
        return usable

    def live_nodes(self) -> list[str]:
        """The ids of the nodes that may host replicas now (as last seen), sorted."""
        return sorted({host.node_id for host in self.usable()})

    def ray_node_of(self, node_id: str | None) -> str | None:
        """The Ray node ``node_id`` is on now: its record's; without one, a Ray node id names itself and a
        host's node id has none."""
        node = self._table.get(node_id)
        return node.ray_node_id if node is not None else (None if node_id is None or is_node_id(node_id) else node_id)

    def node_of_ray_node(self, ray_node_id: str) -> str:
        """The node a Ray node is (as last seen): its label's node id, else its own id."""
        return next((host.node_id for host in self._hosts if host.ray_node_id == ray_node_id), ray_node_id)

    # --- forgetting ----------------------------------------------------------------------------------

    def forget(self, node_id: str) -> None:
        """A node that left the node table: its checks, refusals and reported duplicates go too."""
        self._identified = {r: i for r, i in self._identified.items() if i.node_id != node_id}
        self._refused = {r: i for r, i in self._refused.items() if i.node_id != node_id}
        self._duplicates_told = {told for told in self._duplicates_told if told[0] != node_id}
