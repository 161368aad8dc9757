"""The controller's node table: what it knows of each node, its lease, its epoch table, and when it leaves.

Pure state with an explicit clock (no Ray, no I/O; every method that needs
the time takes ``now_ms``), owned by the controller. The controller makes
the Ray calls (starting agents, pushing epoch tables, killing actors) and
tells the table what happened; the table decides who is alive, what each
agent must be sent, and which nodes a fence still waits for. This class is
not thread-safe: the controller calls it from its event loop only.

A node's record (:class:`Node`): the Ray node it is on now and those it
left, its agent's handle (opaque here) and incarnation, the replicas its
agent reports down, its epoch table with the table's version and the
version its agent last applied, and its outage (when its lease ran out,
when it was heard again).

Whose heartbeat renews (``heartbeat_answer``). A host's node moves between
Ray nodes (a host that joined again is a new Ray node), and an agent may run
on each. Only the agent on the Ray node the node is on now renews its lease.
One on a Ray node the node left is answered ``stale``: it revokes its lease
(its leaders stop) and heartbeats no more. Any other is answered ``wait``,
and goes on heartbeating: the node is on no Ray node yet (its host is not
checked yet, as while this controller starts), or not yet on that one (the
agent started for a host's check heartbeats before the node is moved there;
answered ``stale``, it stopped for good, and the node lost its lease right
after the move).

Leases. A node is alive while its agent's last heartbeat is at most
``LEASE_TIMEOUT_MS`` old (``protocol/liveness.py``, keyed by node id, with
its rules for a stalled controller and for one that hears no node at all); a
replica is alive while its node is and its agent does not report it down.
``check_leases``, once per control-loop tick, notes the nodes hosting
replicas whose lease just ran out, and those whose replicas are due another
try at replacement. A node heard again within ``NODE_STEADY_MS`` of its last
revival is the same outage (reported quietly).

What a heartbeat starts (``follow_up``): a node back (heard again after
its lease ran out, a new agent, or its first heartbeat to this controller)
has every replica it hosts checked for an election and every role change
its replicas missed sent again; otherwise the replicas reported down or up
since its last heartbeat are checked, and those up again get their pending
role changes at once. A steady heartbeat starts nothing.

Epoch tables. ``set_epochs`` takes every node's table from the metadata (each
replica there: its partition's current leader epoch) after each change, and
gives each changed table a new version ``[controller incarnation, counter]``.
An agent's heartbeat, or a push's reply, says which version it applied
(``applied``). A fence (``fence_versions``, then ``fence_waiting``) waits for
the live nodes hosting the partition that have not applied the version
current when it began.

Pruning: dead nodes leave the table. A node leaves when all of these hold:

- it hosts no replica: no partition names it in the metadata (its epoch
  table is empty), so no election, fence or replacement waits for it; a
  draining node still hosting replicas (moves under way) stays;
- no Ray node carries it, as Ray's nodes were last seen (``set_carried``):
  an idle host whose agent was stopped has no lease but is not dead;
- its lease ran out ``PRUNE_AFTER_MS`` (ten lease timeouts) ago or more, or
  it never had one from this controller and the restart grace is that long
  over.

``prune`` runs in the same per-tick pass over the nodes as ``check_leases``
(no timer of its own, and its cost is per node). So the table holds the
nodes Ray's nodes carried when last seen, plus those hosting replicas, plus
the dead for at most ``PRUNE_AFTER_MS``. A pruned node that comes back (a
heartbeat, or a Ray node carrying its label) is new to the table, as any
node is: nothing of its past is kept (a node drained before it left is not
draining when it returns). The Ray node it was last on is remembered among
the departed (at most ``DEPARTED_MAX``, oldest forgotten first) and still
reported dead (``dead_ray_nodes``): a Kafka gateway keeps hiding the broker
of a Ray node that left, as it did while the node stayed in the table.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from logbus.protocol.liveness import LEASE_TIMEOUT_MS, RESTART_GRACE_MS, Liveness
from logbus.storage.node_identity import is_node_id

NODE_STEADY_MS = 10_000  # a node heard again must stay alive this long before another expiry is reported as new
PRUNE_AFTER_LEASES = 10  # a dead node hosting nothing leaves the table this many lease timeouts after its lease ran out
PRUNE_AFTER_MS = PRUNE_AFTER_LEASES * LEASE_TIMEOUT_MS
DEPARTED_MAX = 1_024  # Ray nodes of pruned nodes still reported dead (a few tens of KiB at most)


class Node:
    """What the controller knows of one node that hosts replicas (see the module docstring)."""

    __slots__ = (
        "node_id", "agent", "incarnation", "down", "epochs", "version", "acked", "dead_since_ms", "next_replace_ms", "revived_ms",
        "ray_node_id", "data_dir", "past_ray_nodes",
    )

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        # The Ray node it is on now. A node named by its Ray node id is that Ray node for good; a host's
        # node (a logbus node id) is found by its label, and checked (``identify``), before it is used.
        self.ray_node_id: str | None = None if is_node_id(node_id) else node_id
        self.data_dir: str | None = None  # where its replicas keep their logs; None: the cluster's data directory
        self.past_ray_nodes: set[str] = set()  # Ray nodes it was on before (a host that joined again): never again
        self.agent = None  # the node agent's handle, once started
        self.incarnation: str | None = None  # of the agent process last heard
        self.down: set[str] = set()  # replica file names the agent reports down (exited or stopped)
        self.epochs: dict[str, int] = {}  # replica file name -> its partition's current leader epoch
        self.version: list = ["", 0]  # [controller incarnation, counter] of ``epochs``
        self.acked: list | None = None  # the version the agent last said it applied
        self.dead_since_ms: int | None = None  # when its lease ran out (None while alive)
        self.next_replace_ms = 0  # replacing its replicas elsewhere is tried again no sooner
        self.revived_ms: int | None = None  # when it was last heard again after its lease ran out

    @property
    def ready(self) -> bool:
        """Whether its replicas can run now: it is on a Ray node, checked."""
        return self.ray_node_id is not None


class HeartbeatAnswer(enum.Enum):
    """How a node agent's heartbeat is answered (``NodeTable.heartbeat_answer``); the value is the reply's key."""

    RENEW = "renew"  # the agent on the node's Ray node: its lease is renewed
    WAIT = "wait"  # the node is on no Ray node, or not on the agent's yet: nothing renewed, the agent goes on
    STALE = "stale"  # the agent on a Ray node the node left: it revokes its lease and stops


@dataclass(frozen=True)
class Renewal:
    """What a heartbeat changed (``NodeTable.renew``)."""

    returned: bool  # a new agent, or this controller's first heartbeat from it
    revived_after_ms: int | None  # heard again after its lease ran out this long ago; None if it had not
    changed: frozenset[str]  # replicas reported down, or up, since its last heartbeat
    up: frozenset[str]  # among them, those reported up


@dataclass(frozen=True)
class FollowUp:
    """What a heartbeat starts (``follow_up``): role changes sent again, and which replicas' partitions to check."""

    resend_all: bool  # the node is back (revived or a new agent): every role change its replicas missed is sent again
    retry: frozenset[str]  # otherwise: replicas reported up again, whose pending role changes are sent again
    check: frozenset[str] | None  # replicas whose partitions to check for an election (None: no check)


def follow_up(renewal: Renewal, hosted: Iterable[str]) -> FollowUp:
    """What a heartbeat that renewed as ``renewal`` starts, for a node hosting the replicas ``hosted``.

    A node back (heard again after its lease ran out, or a new agent, or its
    first heartbeat to this controller) may lead partitions that have no
    leader: every replica it hosts is checked, and every role change its
    replicas missed is sent again. Otherwise the replicas reported down or up
    since its last heartbeat are checked, and those up again get their
    pending role changes at once. A steady heartbeat starts nothing.
    """
    back = renewal.returned or renewal.revived_after_ms is not None
    if back:
        return FollowUp(True, frozenset(), frozenset(hosted))
    return FollowUp(False, renewal.up, renewal.changed or None)


class NodeTable:
    """The nodes, their leases and epoch tables, and the rule by which dead ones leave (see the module docstring)."""

    def __init__(
        self,
        incarnation: str,
        now_ms: int,
        lease_timeout_ms: int = LEASE_TIMEOUT_MS,
        restart_grace_ms: int = RESTART_GRACE_MS,
        prune_after_ms: int = PRUNE_AFTER_MS,
    ) -> None:
        self.incarnation = incarnation  # of the controller: the first half of every epoch table version
        self.prune_after_ms = prune_after_ms
        self._liveness = Liveness(now_ms, lease_timeout_ms, restart_grace_ms)
        self._nodes: dict[str, Node] = {}
        self._versions = 0  # counter of epoch table versions
        self._carried: frozenset[str] = frozenset()  # node ids Ray's nodes carried when last seen
        self._departed: dict[str, None] = {}  # Ray node ids of pruned nodes, oldest first (an ordered set)
        self.expiries = 0  # leases of nodes hosting replicas that ran out, since this table was made

    # --- records -----------------------------------------------------------------------------------

    def get(self, node_id: str | None) -> Node | None:
        return self._nodes.get(node_id) if node_id is not None else None

    def entry(self, node_id: str) -> Node:
        """The node's record, made now if the table has none (a node new to it, or pruned and back)."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = Node(node_id)
            if node.ray_node_id is not None:
                self._departed.pop(node.ray_node_id, None)
        return node

    def nodes(self) -> list[Node]:
        """Every record, as a list (callers may await while going through it)."""
        return list(self._nodes.values())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def move(self, node: Node, ray_node_id: str, data_dir: str | None, agent) -> str | None:
        """``node`` is on ``ray_node_id`` now, checked, with ``agent`` there: its old agent's state is
        forgotten, and the Ray node it left is never its again. Returns that Ray node (None if it had none)."""
        old = node.ray_node_id
        if old is not None:
            node.past_ray_nodes.add(old)
        node.ray_node_id, node.data_dir = ray_node_id, data_dir
        node.agent, node.incarnation, node.acked, node.down = agent, None, None, set()
        self._departed.pop(ray_node_id, None)
        return old

    def agent_stopped(self, node: Node) -> None:
        """The node's agent was stopped (it hosts nothing): no lease, nothing reported down, nothing applied."""
        node.incarnation, node.acked, node.down = None, None, set()
        if self._nodes.get(node.node_id) is node:  # not a record pruned, and made again, meanwhile
            self._liveness.forget(node.node_id)

    # --- leases ------------------------------------------------------------------------------------

    def alive(self, node_id: str, now_ms: int) -> bool:
        return self._liveness.alive(node_id, now_ms)

    def replica_alive(self, node_id: str | None, replica_name: str, now_ms: int) -> bool:
        """Whether the replica (by file name) on ``node_id`` is alive: its node is, and it is not reported down."""
        node = self.get(node_id)
        if node is None or not self.alive(node.node_id, now_ms):
            return False
        return replica_name not in node.down

    def expect(self, node_id: str, now_ms: int) -> None:
        """A new agent for the node is starting: the node is alive until its first heartbeat, or a start-up grace."""
        self._liveness.expect(node_id, now_ms)

    def tick(self, now_ms: int, interval_ms: int) -> int:
        """Once per control-loop tick (``Liveness.tick``: neither a stall of this process nor a silence of
        every node at once is counted against leases); returns how late it ran."""
        return self._liveness.tick(now_ms, interval_ms)

    def isolation(self) -> dict:
        """Whether every node is silent now (this controller cut off, or all down: ``Liveness``); the silence
        of this isolation not counted against leases; the isolations that kept a lease alive and the silence
        not counted since this controller started; how many nodes the last isolation kept alive are not yet
        heard again; and how many times a node's lease ran out since this controller started."""
        lv = self._liveness
        return {"isolated": lv.isolated, "isolated_ms": lv.isolated_ms, "isolations": lv.isolations,
                "isolated_total_ms": lv.isolated_total_ms, "rejoining": lv.rejoining(), "lease_expiries": self.expiries}

    @staticmethod
    def heartbeat_answer(node: Node, ray_node_id: str | None) -> HeartbeatAnswer:
        """How to answer a heartbeat for ``node`` from an agent on ``ray_node_id`` (None: an agent that
        does not name its Ray node, taken to be on the node's): the rule in the module docstring, "Whose heartbeat renews"."""
        if not node.ready:
            return HeartbeatAnswer.WAIT
        if ray_node_id is None or ray_node_id == node.ray_node_id:
            return HeartbeatAnswer.RENEW
        return HeartbeatAnswer.STALE if ray_node_id in node.past_ray_nodes else HeartbeatAnswer.WAIT

    def renew(self, node: Node, incarnation: str, down: Iterable[str], version: list | None, now_ms: int) -> Renewal:
        """A heartbeat from ``node``'s agent, answered ``RENEW`` (``heartbeat_answer``): its lease, the
        replicas it reports down, the epoch table version it applied."""
        self._liveness.heard(node.node_id, now_ms)
        returned = node.incarnation != incarnation
        node.incarnation = incarnation
        revived_after_ms = None if node.dead_since_ms is None else now_ms - node.dead_since_ms
        if revived_after_ms is not None:
            node.revived_ms = now_ms
        node.dead_since_ms = None
        down_now = set(down)
        changed = down_now ^ node.down
        node.down = down_now
        self.applied(node, version)
        return Renewal(returned, revived_after_ms, frozenset(changed), frozenset(changed - down_now))

    def check_leases(self, now_ms: int, replacement_ms: int, replace_retry_ms: int) -> tuple[set[str], list[tuple[Node, bool]]]:
        """Each tick: the nodes hosting replicas whose lease ran out now (each with whether it is the same
        outage as one before, ``NODE_STEADY_MS``), and the replicas (file names) to check: those of the nodes
        just expired, and of dead nodes whose replacement is due again (``replacement_ms`` after the lease ran
        out, then every ``replace_retry_ms``). Costs the nodes, not the replicas."""
        names: set[str] = set()
        expired: list[tuple[Node, bool]] = []
        for node in self._nodes.values():
            if not node.epochs:
                continue
            if node.dead_since_ms is None:
                if not self.alive(node.node_id, now_ms):
                    node.dead_since_ms = now_ms
                    self.expiries += 1
                    node.next_replace_ms = now_ms + replacement_ms
                    # Once per outage: a node heard briefly in between (a late heartbeat) is the same outage.
                    expired.append((node, node.revived_ms is not None and now_ms - node.revived_ms < NODE_STEADY_MS))
                    names |= set(node.epochs)
            elif now_ms >= node.next_replace_ms:
                node.next_replace_ms = now_ms + replace_retry_ms
                names |= set(node.epochs)
        return names, expired

    def away_with_replicas(self) -> bool:
        """Whether a node hosting replicas is away: on no Ray node now, or its lease ran out."""
        return any(n.epochs and (not n.ready or n.dead_since_ms is not None) for n in self._nodes.values())

    def dead_ray_nodes(self, now_ms: int) -> list[str]:
        """The Ray nodes of the nodes whose lease ran out, and of the nodes that left the table (the departed)."""
        dead = [n.ray_node_id for n in self._nodes.values() if n.ray_node_id is not None and not self.alive(n.node_id, now_ms)]
        return dead + list(self._departed)

    # --- epoch tables and fences -------------------------------------------------------------------

    def set_epochs(self, tables: dict[str, dict[str, int]]) -> list[Node]:
        """Every node's epoch table, from the metadata (nodes absent host nothing); returns the nodes whose
        table changed, each with a new version (push them)."""
        changed = []
        for node_id, epochs in tables.items():
            node = self.entry(node_id)
            if node.epochs != epochs:
                node.epochs = epochs
                self._new_version(node)
                changed.append(node)
        for node_id, node in self._nodes.items():
            if node_id not in tables and node.epochs:
                node.epochs = {}
                self._new_version(node)
                changed.append(node)
        return changed

    def _new_version(self, node: Node) -> None:
        self._versions += 1
        node.version = [self.incarnation, self._versions]

    @staticmethod
    def applied(node: Node, version: list | None) -> None:
        """The node's agent applied epoch table ``version`` (a heartbeat's, or a push's reply); an older one is ignored."""
        if version is not None and version[0] == node.version[0] and (
            node.acked is None or node.acked[0] != version[0] or version[1] > node.acked[1]
        ):
            node.acked = list(version)

    def fence_versions(self, node_ids: Iterable[str]) -> dict[str, int]:
        """The epoch table counter current now of each known node among ``node_ids``: what a fence waits for."""
        needed = {}
        for node_id in node_ids:
            node = self._nodes.get(node_id)
            if node is not None:
                needed[node.node_id] = node.version[1]
        return needed

    def fence_waiting(self, needed: dict[str, int], now_ms: int) -> list[str]:
        """The nodes of ``needed`` a fence still waits for: alive, and not yet at their counter there.
        A node dead (or pruned) is not waited for: its leaders stopped when its lease ran out."""
        waiting = []
        for node_id, counter in needed.items():
            if not self.alive(node_id, now_ms):
                continue
            node = self._nodes.get(node_id)
            if node is not None and not (node.acked and node.acked[0] == self.incarnation and node.acked[1] >= counter):
                waiting.append(node_id)
        return waiting

    # --- pruning -----------------------------------------------------------------------------------

    def set_carried(self, node_ids: Iterable[str]) -> None:
        """The node ids Ray's nodes carry, as just seen: none of them is pruned until a later look misses it."""
        self._carried = frozenset(node_ids)

    def prunable(self, node: Node, now_ms: int) -> bool:
        """Whether ``node`` leaves the table now (the rule in the module docstring)."""
        if node.epochs or node.node_id in self._carried:
            return False
        return self._liveness.silent_ms(node.node_id, now_ms) - self._liveness.lease_timeout_ms >= self.prune_after_ms

    def prune(self, now_ms: int) -> list[Node]:
        """Each tick, after ``check_leases``: remove the nodes that left for good, and return them (the
        controller stops their agents, if any, and forgets what else it kept of them)."""
        gone = [node for node in self._nodes.values() if self.prunable(node, now_ms)]
        for node in gone:
            del self._nodes[node.node_id]
            self._liveness.forget(node.node_id)
            if node.ray_node_id is not None:
                self._departed.pop(node.ray_node_id, None)
                self._departed[node.ray_node_id] = None
                while len(self._departed) > DEPARTED_MAX:
                    del self._departed[next(iter(self._departed))]
        return gone
