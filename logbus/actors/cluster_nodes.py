"""The controller's nodes: their agents, leases, the fence epochs pushed to them, pruning, and which Ray node each is.

The controller creates one :class:`ClusterNodes` and forwards to it the node
agents' heartbeats (``node_heartbeat`` and the heartbeat link), its look
through Ray's nodes (``refresh_nodes``) and each control-loop tick's node
checks. It reaches the controller through the small :class:`NodeHost`
interface: the metadata, the replica handles it keeps, background tasks, and
the events a node's state starts (elections for its replicas' partitions,
role changes sent again, a drain forgotten).

The decisions are pure and tested without Ray: leases, whose heartbeat
renews one, epoch table versions, fences, pruning and what a heartbeat
starts are ``protocol/node_table.py``'s (:class:`NodeTable`,
``follow_up``), which Ray node each node is ``protocol/host_map.py``'s
(:class:`HostMap`), and each node's epoch table comes from the metadata by
:func:`epoch_tables` here.
:class:`ClusterNodes` makes the Ray calls around them: it starts node
agents, pushes epoch tables to them and stops them, checks a host's identity
through an agent there, and kills the actors a node leaves behind when it
moves to another Ray node.

A node whose lease runs out hosts followers too: their leaders elsewhere
would wait for them in every acks=all write until replica.lag.time.max.ms
took them out of the ISR. The leaders are told at once instead
(``followers_gone``; which ones, :func:`followers_to_drop`), as Kafka's
controller takes a fenced broker out of every ISR.

Every method runs on the controller's event loop (nothing here is
thread-safe). The controller reads the table and the host map too: fences,
elections, placement, and what clients are told of the nodes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

import ray

from logbus.actors.lease_files import replica_file_name
from logbus.actors.node_agent import start_agent
from logbus.actors.placement import replica_hosts
from logbus.actors.remote import unwrap
from logbus.clock import monotonic_ms
from logbus.errors import InconsistentClusterIdError, NodeIdentityError, ReplicaNotAvailableError
from logbus.protocol.cluster_metadata import ClusterMetadata, TopicState
from logbus.protocol.host_map import HostMap, Identity
from logbus.protocol.liveness import ISOLATED_AFTER_MS, ISOLATION_CREDIT_MAX_MS
from logbus.protocol.node_table import HeartbeatAnswer, Node, NodeTable, follow_up

logger = logging.getLogger(__name__)

AGENT_CALL_TIMEOUT_S = 60.0  # an agent that does not answer set_epochs or shut_down in this long is away (or gone)
REPLACE_RETRY_MS = 5_000  # a dead node's replicas that could not be placed elsewhere are tried again this often
NODE_DISCOVERY_MS = 1_000  # while a node hosting replicas is away, Ray's nodes are looked through this often for it
FOLLOWERS_GONE_TIMEOUT_S = 5.0  # a leader told that followers are gone answers within this, or drops them by lag time
IDENTIFY_TIMEOUT_S = 60.0  # bound on a host's identity check (its agent's process may still be starting)
IDENTIFY_RECHECK_S = 1.0  # while a check waits, Ray's nodes are looked at this often for the host's next Ray node


def epoch_tables(topics: Iterable[TopicState]) -> tuple[dict[str, tuple[str, int, int]], dict[str, dict[str, int]]]:
    """The replica index and every node's epoch table, from the metadata's topics: replica file name ->
    (topic, partition, replica id), and node id -> {replica file name: its partition's leader epoch}.
    A node hosting nothing has no table."""
    by_name: dict[str, tuple[str, int, int]] = {}
    tables: dict[str, dict[str, int]] = {}
    for topic in topics:
        for p, state in enumerate(topic.partitions):
            for r in state.replicas:
                name = replica_file_name(topic.topic_id, p, r)
                by_name[name] = (topic.name, p, r)
                tables.setdefault(state.nodes[str(r)], {})[name] = state.leader_epoch
    return by_name, tables


def followers_to_drop(names: Iterable[str], by_name: dict[str, tuple[str, int, int]], metadata: ClusterMetadata,
                      leader_alive) -> dict[tuple[str, int], tuple[int, list[int]]]:
    """The ISR members among ``names`` (replica file names of nodes whose lease just ran out) that follow a
    leader still alive (``leader_alive(topic, partition, leader)``), by partition: (topic, partition) ->
    (its leader epoch, those followers). Their leaders are told to stop waiting for them."""
    found: dict[tuple[str, int], tuple[int, list[int]]] = {}
    for name in names:
        if name not in by_name:
            continue
        topic_name, partition, replica_id = by_name[name]
        topic = metadata.topics.get(topic_name)
        if topic is None or partition >= len(topic.partitions):
            continue
        state = topic.partitions[partition]
        if state.leader is None or state.leader == replica_id or replica_id not in state.isr:
            continue
        if not leader_alive(topic, partition, state.leader):
            continue
        found.setdefault((topic_name, partition), (state.leader_epoch, []))[1].append(replica_id)
    return found


class NodeHost(Protocol):
    """What the node table's Ray side needs of the controller."""

    metadata: ClusterMetadata
    namespace: str
    data_dir: str
    replica_replacement_ms: int
    max_replicas_per_node: int | None

    def spawn(self, coroutine, what: str) -> asyncio.Task:
        """Run ``coroutine`` in the background, logging a failure as ``what`` failed."""

    def replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        """A replica's actor handle, created if needed; ReplicaNotAvailableError when its node is away."""

    def known_replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        """The replica's actor handle if one is kept, else None (never starts an actor)."""

    def drop_replica_handle(self, key: tuple[str, int, int]):
        """Forget the handle kept for replica (topic, partition, replica id) and return it (None if none is kept)."""

    async def check_partitions(self, partitions: set[tuple[str, int]]) -> object:
        """Elect where a leader is missing or gone, replace replicas long gone."""

    def resend_roles(self, node_id: str, now: int) -> None:
        """The node was heard again, or its agent is new: the role changes its replicas missed are sent again now."""

    def retry_roles(self, keys: Iterable[tuple[str, int, int]], now: int) -> None:
        """These replicas were reported up again: their pending role changes are sent again now."""

    def node_gone(self, node_id: str) -> None:
        """The node left the node table: forget what else is kept of it (a drain)."""


class ClusterNodes:
    """The nodes' agents, leases, epoch tables and identities, over a :class:`NodeHost` (see the module docstring)."""

    def __init__(self, host: NodeHost, incarnation: str, controller_name: str) -> None:
        self._host = host
        self._controller_name = controller_name  # the agents' heartbeats go to the actor of this name
        self.table = NodeTable(incarnation, monotonic_ms())  # the nodes: leases, epoch tables, pruning
        # Ray nodes as last seen (``refresh``), hosts checked or refused: which Ray node each node is.
        self.host_map = HostMap(self.table)
        self.by_name: dict[str, tuple[str, int, int]] = {}  # replica file name -> (topic, partition, replica id)
        self._refresh_lock_: asyncio.Lock | None = None
        self._discovery: asyncio.Task | None = None
        self._last_discovery_ms = 0

    # --- agents, leases, epochs ----------------------------------------------------------------------

    def reindex(self) -> list[Node]:
        """Rebuild the replica index and every node's epoch table from the metadata (after any change);
        returns the nodes whose table changed (push them)."""
        self.by_name, tables = epoch_tables(self._host.metadata.topics.values())
        return self.table.set_epochs(tables)

    def agent(self, node: Node):
        """The node's agent, started now if it has none; ReplicaNotAvailableError while the node is away."""
        if node.agent is None:
            if not node.ready:
                raise ReplicaNotAvailableError(f"node {node.node_id} is not in the cluster now")
            node.agent = start_agent(self._host.namespace, node.ray_node_id, self._controller_name, node.node_id)
            if node.incarnation is None:
                self.table.expect(node.node_id, monotonic_ms())  # a new agent takes a while to start
        return node.agent

    def push_epochs(self, node: Node) -> None:
        """Send a node's epoch table to its agent now (heartbeat replies would carry it too, later)."""
        if not node.epochs and node.agent is None:
            return  # a node without replicas needs no agent
        if not node.ready:
            return  # away: its agent gets the table in its first heartbeat's reply
        version, epochs = list(node.version), dict(node.epochs)

        async def push() -> None:
            try:
                applied = await asyncio.wait_for(self.agent(node).set_epochs.remote(version, epochs), AGENT_CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 (the agent is away: its heartbeats, or its lease, settle it)
                return
            self.table.applied(node, applied)

        self._host.spawn(push(), f"pushing fence epochs to node {node.node_id[:8]}")

    async def retire_idle_agents(self) -> None:
        """Stop the agent of every node that hosts no replica any more: an actor keeps a node busy,
        and an idle node is what an autoscaler removes (a drained node, say)."""
        for node in self.table.nodes():
            if node.epochs or node.agent is None:
                continue
            await self._stop_agent(node)
            self.table.agent_stopped(node)
            logger.info("node %s hosts no replicas: its agent stopped", node.node_id[:8])

    async def stop_agents(self) -> None:
        """Stop every node's agent (the cluster is being destroyed)."""
        for node in self.table.nodes():
            if node.agent is not None:
                await self._stop_agent(node)

    @staticmethod
    async def _stop_agent(node: Node) -> None:
        """Ask the node's agent to shut down (it stops heartbeating and removes the node's files), then end its actor."""
        agent, node.agent = node.agent, None
        try:
            await asyncio.wait_for(agent.shut_down.remote(), AGENT_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 (already gone)
            pass
        try:
            ray.kill(agent, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass

    def check_leases(self, now: int, tick_interval_ms: int) -> set[str]:
        """Each tick: which nodes' leases ran out, which dead nodes leave the table (work per node, not per
        replica); returns the replicas (file names) whose partitions need an election or a replacement."""
        # A late tick (this process stalled) does not count the stall against any lease, nor does a
        # silence of every node at once (this controller's host cut off) while it lasts, up to a bound.
        before = self.table.isolation()
        self.table.tick(now, tick_interval_ms)
        after = self.table.isolation()
        if after["isolations"] > before["isolations"]:
            logger.warning("no node heard for %d ms: this controller is cut off, or every node is down; the silence is not "
                           "counted against their leases (up to %d ms past each one's last heartbeat)", ISOLATED_AFTER_MS, ISOLATION_CREDIT_MAX_MS)
        elif before["isolated_ms"] and not after["isolated"]:
            logger.warning("a node is heard again after a silence of every node (%d ms of it not counted against leases)",
                           before["isolated_ms"])
        names, expired = self.table.check_leases(now, self._host.replica_replacement_ms, REPLACE_RETRY_MS)
        for node, again in expired:  # once per outage: a node heard briefly in between is the same outage
            (logger.debug if again else logger.warning)(
                "node %s: lease expired%s; its leaders are deposed", node.node_id[:8], " again" if again else "")
        if expired:
            self._drop_followers([name for node, _ in expired for name in node.epochs], now)
        self._prune(now)
        return names

    def _drop_followers(self, names: list[str], now: int) -> None:
        """The replicas ``names`` of nodes whose lease just ran out: leaders elsewhere stop waiting for those
        in their ISR at once (``ReplicaState.followers_gone``), rather than after replica.lag.time.max.ms.
        Work per replica of the nodes that died, once per outage; a leader that does not answer is dropping
        them by lag time anyway."""
        host = self._host

        def leader_alive(topic: TopicState, partition: int, leader: int) -> bool:
            node_id = topic.partitions[partition].nodes.get(str(leader))
            return self.table.replica_alive(node_id, replica_file_name(topic.topic_id, partition, leader), now)

        drops = followers_to_drop(names, self.by_name, host.metadata, leader_alive)
        calls = []
        for (topic_name, partition), (epoch, followers) in drops.items():
            topic = host.metadata.topics[topic_name]
            # Only a leader whose handle is kept: telling one is worth no actor start (a controller
            # that restarted and has not yet reached it leaves it to drop them by lag time).
            handle = host.known_replica_handle(topic, partition, topic.partitions[partition].leader)
            if handle is None:
                continue
            calls.append(asyncio.wait_for(handle.followers_gone.remote(epoch, followers), FOLLOWERS_GONE_TIMEOUT_S))
        if calls:
            host.spawn(self._tell_leaders(calls), "telling leaders that followers are gone")

    @staticmethod
    async def _tell_leaders(calls: list) -> None:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.info("%d of %d leaders were not told that followers are gone (%r); they drop them by lag time",
                        len(failed), len(results), failed[0])

    def _prune(self, now: int) -> None:
        """Each tick: the nodes that left for good leave the table (``NodeTable.prune``: dead for ten
        lease timeouts, hosting nothing, on no Ray node as last seen), and with it everything else kept
        of them: a drain, host checks, duplicate reports. A node that comes back is new."""
        for node in self.table.prune(now):
            if node.agent is not None:
                try:
                    ray.kill(node.agent, no_restart=True)
                except Exception:  # noqa: BLE001 (already gone, with its Ray node)
                    pass
            self._host.node_gone(node.node_id)
            self.host_map.forget(node.node_id)
            logger.info("node %s: gone and hosting no replicas; it leaves the node table", node.node_id[:8])

    async def check_replicas(self, names: set[str]) -> None:
        """Elect where a leader is gone, replace replicas long gone: for the partitions of ``names``."""
        await self._host.check_partitions({self.by_name[n][:2] for n in names if n in self.by_name})

    def renew(self, node_id: str, incarnation: str, down: list[str], version: list | None, ray_node_id: str | None = None) -> dict:
        """A node agent's heartbeat (see ``Controller.node_heartbeat``): its lease, the replicas it reports
        down, the epoch table version it applied; the reply, with the node's epoch table if it is behind.
        An agent on another Ray node than the node's renews nothing: it is told to stop (``stale``) or to
        go on (``wait``), as ``NodeTable.heartbeat_answer`` decides."""
        host = self._host
        now = monotonic_ms()
        node = self.table.entry(node_id)
        answer = self.table.heartbeat_answer(node, ray_node_id)
        if answer is not HeartbeatAnswer.RENEW:
            return {answer.value: True}  # "stale": the agent stops; "wait": it goes on, unrenewed
        renewal = self.table.renew(node, incarnation, down, version, now)
        if renewal.revived_after_ms is not None:
            logger.info("node %s: heard again after %d ms without a lease", node_id[:8], renewal.revived_after_ms)
        # A node's first heartbeat to this controller, or a new agent's, is a return like a revival:
        # its replicas may lead partitions that have no leader (a controller restart, say).
        then = follow_up(renewal, node.epochs)
        if then.resend_all:
            host.resend_roles(node_id, now)  # role changes it missed are sent again now
        elif then.retry:
            host.retry_roles((self.by_name[n] for n in then.retry if n in self.by_name), now)
        if then.check is not None:
            host.spawn(self.check_replicas(set(then.check)), "checking replicas")
        current = version is not None and list(version) == node.version
        return {"version": node.version, "epochs": None if current else dict(node.epochs)}

    # --- node identity: which Ray node each node is now ------------------------------------------------

    @property
    def _refresh_lock(self) -> asyncio.Lock:
        if self._refresh_lock_ is None:
            self._refresh_lock_ = asyncio.Lock()
        return self._refresh_lock_

    async def refresh(self) -> None:
        """Look through Ray's nodes: map each host's node to the Ray node carrying its label now.

        A host new to this controller is checked first (``_identify``); a
        node whose Ray node is gone, or silent while another Ray node carries
        its label (the host joined again before Ray declared its old Ray node
        dead), moves to that Ray node (``_move_node``). A node keeps its Ray
        node while that one heartbeats, whatever else carries its label (two
        hosts with one identity: a copied data directory), and never goes
        back to a Ray node it left (``HostMap.look`` decides). One GCS query,
        plus a check per new host (which looks at Ray's nodes once a second
        while it waits: ``_identity_answer``).
        """
        async with self._refresh_lock:
            self._last_discovery_ms = monotonic_ms()
            hosts = await asyncio.to_thread(replica_hosts, self._host.max_replicas_per_node)
            look = self.host_map.look(hosts, monotonic_ms())  # before any await: none of them is pruned
            for duplicate in look.duplicates:
                logger.error("node %s is carried by Ray nodes %s: two hosts with one identity (a copied data "
                             "directory?); it stays on %s", duplicate.node_id, list(duplicate.ray_node_ids), duplicate.kept[:12])
            moves = look.moves
            carrying = {listed.ray_node_id: listed.node_id for listed in hosts}
            found = await asyncio.gather(*(
                self._identify(ray_node_id, node.node_id, {r for r, n in carrying.items() if n == node.node_id})
                for node, ray_node_id in moves))
            self.host_map.seen(hosts)
            for (node, ray_node_id), identity in zip(moves, found):
                if identity is not None:
                    self._move_node(node, ray_node_id, identity)

    async def _identify(self, ray_node_id: str, node_id: str, carriers: set[str]) -> Identity | None:
        """Check the host on ``ray_node_id`` through an agent there (its data directory holds ``node_id``'s
        identity and this cluster's id, recorded now if it had none); its identity, or None if it cannot
        be used now (refused for good: another cluster's directory; or not answering: tried again later)."""
        known = self.host_map.identified(ray_node_id)
        if known is not None:
            return known
        agent = start_agent(self._host.namespace, ray_node_id, self._controller_name, node_id)
        try:
            found = await self._identity_answer(agent, ray_node_id, node_id, carriers | {ray_node_id})
            if found is None:
                logger.warning("Ray node %s (node %s) not checked: the host is on another Ray node now", ray_node_id[:12], node_id)
                return None
        except Exception as raised:  # noqa: BLE001 (refused below, or tried again at the next look)
            error = unwrap(raised)
            if isinstance(error, (InconsistentClusterIdError, NodeIdentityError)):
                self.host_map.refuse(ray_node_id, node_id, str(error))
                logger.error("Ray node %s refused as node %s: %s", ray_node_id[:12], node_id, error)
                try:
                    ray.kill(agent, no_restart=True)
                except Exception:  # noqa: BLE001 (already gone)
                    pass
            else:
                logger.warning("Ray node %s (node %s) not checked yet: %s: %s", ray_node_id[:12], node_id, type(error).__name__, error)
            return None
        return self.host_map.identify(ray_node_id, node_id, found.get("data_dir"), agent)

    async def _identity_answer(self, agent, ray_node_id: str, node_id: str, carriers: set[str]) -> dict | None:
        """The agent's answer to the identity check (``IDENTIFY_TIMEOUT_S`` at most), or None once a Ray node
        not among ``carriers`` (those carrying ``node_id`` at the look that started the check) carries it:
        the host was killed and joined again while this Ray node was being checked. A check of a Ray node
        whose processes are gone waits until Ray declares it dead (tens of seconds), and the look waiting
        for it would not find the host's new Ray node meanwhile. (A Ray node the host left, still listed
        until Ray declares it dead, is no reason to stop: it was there when the check began.) Ray's nodes
        are looked at once a second while the check waits; a look that fails is no news."""
        answer = asyncio.ensure_future(agent.identify.remote(self._host.metadata.cluster_id))
        deadline = monotonic_ms() + int(IDENTIFY_TIMEOUT_S * 1000)
        try:
            while True:
                left_s = (deadline - monotonic_ms()) / 1000
                if left_s <= 0:
                    raise TimeoutError(f"no answer in {IDENTIFY_TIMEOUT_S:.0f} s")
                done, _ = await asyncio.wait([answer], timeout=min(IDENTIFY_RECHECK_S, left_s))
                if done:
                    return answer.result()
                try:
                    newer = await asyncio.wait_for(self._carriers(node_id), min(IDENTIFY_RECHECK_S, left_s)) - carriers
                except Exception:  # noqa: BLE001 (Ray's nodes not listed this time: no news)
                    newer = set()
                if answer.done():
                    return answer.result()  # it answered meanwhile: that settles it
                if newer:
                    return None
        finally:
            if not answer.done():
                answer.cancel()
            elif not answer.cancelled():
                answer.exception()  # retrieved: an answer left unread is no unhandled error

    async def _carriers(self, node_id: str) -> set[str]:
        """The live Ray nodes carrying ``node_id`` now (one GCS query)."""
        hosts = await asyncio.to_thread(replica_hosts, self._host.max_replicas_per_node)
        return {listed.ray_node_id for listed in hosts if listed.node_id == node_id}

    def _move_node(self, node: Node, ray_node_id: str, identity: Identity) -> None:
        """Map ``node`` to ``ray_node_id`` (checked): its agent and replicas run there from now on.

        The actors on the Ray node it leaves are killed (that Ray node is dead,
        or about to be declared so: its host joined again). Its replicas start
        on the new Ray node at once and open their logs in the host's data
        directory; they ask for their roles, and the agent's first heartbeat
        brings elections for their partitions (a replica that was the only
        in-sync one leads again).
        """
        host = self._host
        names = [n for n in node.epochs if n in self.by_name]  # its replicas (reindex)
        old_handles = [handle for n in names if (handle := host.drop_replica_handle(self.by_name[n])) is not None]
        old_agent = node.agent
        old = self.table.move(node, ray_node_id, identity.data_dir, identity.agent)
        for handle in [*old_handles, *([old_agent] if old_agent is not None else [])]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        (logger.info if old is None else logger.warning)(
            "node %s is on Ray node %s%s: %d replicas, data directory %s", node.node_id, ray_node_id[:12],
            "" if old is None else f" now (was {old[:12]}): its replicas open their logs there", len(names), node.data_dir or host.data_dir)
        if not names:
            return
        self.table.expect(node.node_id, monotonic_ms())  # its agent has its first heartbeat to send
        self.push_epochs(node)
        for name in names:
            topic_name, partition, replica_id = self.by_name[name]
            try:
                host.replica_handle(host.metadata.topics[topic_name], partition, replica_id)
            except Exception as error:  # noqa: BLE001 (its role delivery or the next look tries again)
                logger.warning("%s-%d: replica %d did not start on node %s: %r", topic_name, partition, replica_id, node.node_id, error)

    def look_for_nodes(self, now: int) -> None:
        """Each tick: while a node hosting replicas is away, look through Ray's nodes for it (once a second)."""
        if now - self._last_discovery_ms < NODE_DISCOVERY_MS or (self._discovery is not None and not self._discovery.done()):
            return
        if not self.table.away_with_replicas():
            return
        self._discovery = asyncio.get_running_loop().create_task(self._refresh_safely())

    async def _refresh_safely(self) -> None:
        try:
            await self.refresh()
        except Exception:  # noqa: BLE001 (the next look tries again)
            logger.exception("looking through Ray's nodes failed")
