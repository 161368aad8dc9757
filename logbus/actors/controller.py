"""Controller: the detached, named actor that holds cluster metadata and runs the replica actors' lifecycle.

It owns a :class:`~logbus.protocol.cluster_metadata.ClusterMetadata`, persists
it to ``{data_dir}/controller/metadata.json`` after every change
(:func:`~logbus.storage.files.write_atomically`), and reloads it when Ray
restarts the actor or when a new Ray cluster starts over the same data
directory. On start it (re)creates every replica actor, pointing replicas
whose node is gone at live nodes (see ``placement.py``).

Failure detection does not wait for Ray's node-death detection, and costs
what the cluster has nodes, not replicas: one agent per node
(``node_agent.py``) heartbeats for every replica on its node (over a
socket, ``heartbeat_link.py``, or ``node_heartbeat`` while that is down),
reports replica processes that exit or are stopped, and is told each
partition's current leader epoch. The control loop checks only the nodes'
leases (``protocol/node_table.py``), pending role deliveries and the partitions
without a leader (normally none). Elections happen on every event that may
make a leader possible or lose one (``protocol/elections.py``): a node's
lease runs out, an agent reports a replica down or up, a node is heard again
(or for the first time), a replica starts, this controller starts, a topic's
config changes. A new leader is announced only once every live node hosting
the partition has applied the new epoch (``_fenced``), so a deposed leader
has stopped taking writes (a dead node's leaders stopped when its lease ran
out); each replica's role change then stays pending until the replica
acknowledges it, sent again on a bounded backoff and at once when its node
is heard again (``RoleDeliveries``). A replica whose node is gone for
``replica_replacement_ms`` is replaced by a new replica on another live node,
which copies the log from the leader, unless its node has come back.

Nodes are named by their logbus node ids (``placement.py``): a host's
identity, kept in its data directory, outlives its Ray nodes. The controller
maps each node to the Ray node carrying its label now (``refresh_nodes``
lists Ray's nodes and checks hosts; ``protocol/host_map.py`` decides), and
runs the node's agent and replicas there; a host that joins again as a new
Ray node gets its replicas back, which reopen their logs where the host
keeps them (no copy), and a replica that was the only in-sync one leads
again. It looks for such hosts among Ray's nodes once a second, only while a
node hosting replicas is away. Before placing anything on a host new to it,
it checks the host's data directory and records the cluster's id there
(``NodeAgent.identify``); a directory of another cluster is refused.

Consumer groups are the :class:`~logbus.actors.group_service.GroupService`'s:
the controller forwards the group RPCs to it and serves it the small
:class:`~logbus.actors.group_service.GroupHost` interface (partition counts,
leaders, the internal topic).

The nodes' agents, leases, the epoch tables pushed to them, pruning and
which Ray node each node is are the
:class:`~logbus.actors.cluster_nodes.ClusterNodes`'s: the controller
forwards the agents' heartbeats and its looks at Ray's nodes to it, reads its
node table for fences, elections and placement, and serves it the small
:class:`~logbus.actors.cluster_nodes.NodeHost` interface.

What clients, gateways and tools read (topic metadata, the gateway's view,
replica statuses, the nodes) and the security records kept in the metadata
(SCRAM credentials, ACLs, producer ids) are the
:class:`~logbus.actors.client_metadata.ClientMetadata`'s, over the small
:class:`~logbus.actors.client_metadata.ClientHost` interface.

Topic administration (create, delete, describe, partitions, configs,
delete_records) is the :class:`~logbus.actors.topic_admin.TopicAdmin`'s, and
moving replicas (reassignments, drains, rebalancing, preferred leaders) the
:class:`~logbus.actors.replica_moves.ReplicaMoves`'s: the controller forwards
those RPCs and serves each a small interface
(:class:`~logbus.actors.topic_admin.TopicAdminHost`,
:class:`~logbus.actors.replica_moves.MoveHost`: the metadata and its lock,
the nodes, starting, announcing and retiring replicas).

Retry contract: a call that failed may have taken effect, so clients may send
it again; creating an existing replica actor reuses it (``get_if_exists``),
and deleting twice reports UnknownTopicError the second time.

It is an async actor: methods run on one event loop and are serialised by a
lock around every metadata change.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import uuid

import ray

from logbus.actors import group_service as groups_module
from logbus.actors import metrics, ray_auth
from logbus.actors.client_metadata import ClientMetadata
from logbus.actors.cluster_nodes import ClusterNodes
from logbus.actors.group_service import GroupService
from logbus.actors.transaction_service import TransactionService
from logbus.actors.heartbeat_link import HeartbeatServer
from logbus.actors.invariant_exit import exit_on_violation
from logbus.actors.lease_files import replica_file_name
from logbus.actors.logs import configure_logging
from logbus.actors.partition_replica import start_replica
from logbus.actors.placement import (
    HEAD_NODE_RESOURCE,
    REPLICA_NODE_RESOURCE,
    SlotReservation,
    replica_directory,
    reserve_replica_slots,
    uses_replica_slots,
)
from logbus.actors.replica_moves import ReplicaMoves
from logbus.actors.topic_admin import TopicAdmin
from logbus.clock import monotonic_ms
from logbus.errors import (
    DataDirectoryInUseError,
    InvalidTopicError,
    LeaderNotAvailableError,
    NodeCapacityError,
    ReplicaNotAvailableError,
    UnknownTopicError,
)
from logbus.invariant import check
from logbus.protocol.cluster_metadata import ClusterMetadata, TopicState
from logbus.protocol.elections import LeaderlessWatch, RoleDeliveries, electable, needs_election
from logbus.protocol.group_coordinator import OFFSETS_TOPIC
from logbus.protocol.messages import TopicDescription
from logbus.protocol.node_table import Node
from logbus.protocol.placement import NodeLoad
from logbus.storage.dir_lock import DirectoryLock
from logbus.storage.files import write_atomically
from logbus.storage.log_config import LogConfig

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "logbus-controller"
CONTROLLER_MAX_CONCURRENCY = 1000
METADATA_FILE = "metadata.json"
OWNER_LOCK_FILE = "owner.lock"  # in {data_dir}/controller/, with its note owner.lock.json
OWNER_LOCK_WAIT_S = 10.0  # a restarted controller waits this long for a predecessor still exiting
REPLICA_CALL_TIMEOUT_S = 60.0
CONTROL_LOOP_INTERVAL_S = 0.1
# The partition-health gauges are set again this often while nothing changes them: Ray's metrics agent
# drops a gauge that was not set within two report intervals (each at least 1 s), so a count set only
# when an ISR or a leader changed left Prometheus seconds later (docs/design.md, Known limits).
HEALTH_GAUGES_EVERY_MS = 1000
REPLICA_REPLACEMENT_MS = 60_000  # default; settable per controller
CREATE_TIMEOUT_S = 300.0  # default bound on waiting for the autoscaler to add nodes for a new topic
FENCE_TIMEOUT_MS = 10_000  # bound on waiting for nodes to apply a new epoch (a silent node is dead sooner)
FENCE_POLL_S = 0.01
ROLE_CALL_TIMEOUT_S = 5.0  # a become_leader / become_follower not answered in this long is sent again (RoleDeliveries)

check(groups_module.LONG_POLLS_MAX <= CONTROLLER_MAX_CONCURRENCY // 2,
      "held group calls must leave at least half of the controller's concurrency to other calls")


def take_ownership(metadata_dir: str, data_dir: str, namespace: str) -> DirectoryLock:
    """Hold the data directory's owner lock for this process's lifetime, and say how to reach this cluster.

    A controller that Ray restarts takes the lock over from its dead
    predecessor; one that finds it held by a live process (a controller of
    another Ray cluster, or of another namespace, over the same files) waits
    briefly, then raises DataDirectoryInUseError naming the holder: two
    controllers, and their replicas, over one data directory would lose
    acknowledged records.
    """
    lock = DirectoryLock(os.path.join(metadata_dir, OWNER_LOCK_FILE))
    if not lock.acquire(OWNER_LOCK_WAIT_S):
        note = lock.read_note() or {}
        raise DataDirectoryInUseError(
            f"data directory {data_dir} is in use by another logbus controller (pid {note.get('pid', '?')}, "
            f"namespace {note.get('namespace', '?')!r}, Ray cluster at {note.get('gcs_address', '?')}); "
            "connect to that cluster, or use another data_dir"
        )
    context = ray.get_runtime_context()
    lock.write_note({"namespace": namespace, "gcs_address": context.gcs_address, "node_id": context.get_node_id(), "data_dir": data_dir,
                     "ray_auth": ray_auth.cluster_auth()})  # how a process over the same directory joins (client.py)
    return lock


class Controller:
    """Cluster metadata and replica lifecycle; consumer groups through its GroupService (see the module docstring)."""

    def __init__(
        self,
        data_dir: str,
        namespace: str,
        replica_replacement_ms: int = REPLICA_REPLACEMENT_MS,
        max_replicas_per_node: int | None = None,
    ) -> None:
        configure_logging()
        self.data_dir = os.path.abspath(data_dir)
        self.namespace = namespace
        self.replica_replacement_ms = replica_replacement_ms
        self.max_replicas_per_node = max_replicas_per_node
        self._incarnation = uuid.uuid4().hex
        self._control_loop: asyncio.Task | None = None
        self._metadata_dir = os.path.join(self.data_dir, "controller")
        os.makedirs(self._metadata_dir, exist_ok=True)
        # A controller that does not own its data directory touches none of its files and
        # answers every call with the reason (raising here would leave callers only Ray's
        # "actor died" without it).
        self._refused: DataDirectoryInUseError | None = None
        try:
            self._owner_lock = take_ownership(self._metadata_dir, self.data_dir, namespace)
        except DataDirectoryInUseError as error:
            self._refused = error
            return
        self.metadata = self._load()
        if self.metadata.upgraded_from is not None:
            # Written again at once in the current format: its node ids (Ray node ids then) stay what they
            # name, nodes without a logbus label; the cluster id is new (placement.py, cluster_metadata.py).
            self.persist()
            logger.info("metadata.json upgraded from version %d: cluster id %s", self.metadata.upgraded_from, self.metadata.cluster_id)
        self._replicas: dict[tuple[str, int, int], ray.actor.ActorHandle] = {}
        # The nodes: agents, leases, epoch tables, pruning, which Ray node each is (cluster_nodes.py).
        self.cluster_nodes = ClusterNodes(self, self._incarnation, CONTROLLER_NAME)
        self._table = self.cluster_nodes.table  # read here by fences, elections and placement
        self._lock_: asyncio.Lock | None = None
        self._started: asyncio.Task | None = None
        self._calls = collections.Counter()  # calls served, by method (for `logbus status` and tests)
        self._use_slots = uses_replica_slots()  # replicas ask for a logbus_replica slot (see placement.py)
        # Role changes not yet acknowledged by their replicas, sent again until they are (elections.py).
        self._deliveries = RoleDeliveries()
        self._delivery_tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()  # tasks started and not awaited: held until done (asyncio keeps them weakly)
        self._leaderless: set[tuple[str, int]] = set()  # partitions the metadata gives no leader (see _export_health)
        self._health: tuple[int, int] | None = None  # (under-replicated, offline) as last counted (_export_health)
        self._health_set_ms = 0  # when those gauges were last set
        self._leaderless_watch = LeaderlessWatch()
        self._heartbeats = HeartbeatServer(self._linked_heartbeat)
        self._host_map = self.cluster_nodes.host_map  # which Ray node each node is: read here by placement and clients
        self.cluster_nodes.reindex()
        self.groups = GroupService(self, self._metadata_dir)
        self.moves = ReplicaMoves(self, self._calls)  # reassignments, drains, rebalancing, preferred leaders
        self.admin = TopicAdmin(self, self.groups.topics_changed)  # topics: create, delete, describe, partitions, configs
        self.transactions = TransactionService(self, self.groups)
        self.client = ClientMetadata(self, self.cluster_nodes, self.moves)  # what clients and tools read; SCRAM, ACLs, producer ids
        # From here on a broken invariant ends this process, and Ray starts it again from its files
        # (invariant_exit.py); one found while they load is raised from here (a failed start).
        exit_on_violation("controller")

    # --- persistence ---------------------------------------------------------------------------

    def _load(self) -> ClusterMetadata:
        path = os.path.join(self._metadata_dir, METADATA_FILE)
        try:
            with open(path) as file:
                return ClusterMetadata.from_json(file.read())
        except FileNotFoundError:
            return ClusterMetadata()

    def persist(self) -> None:
        """Write the metadata to its file now (atomically)."""
        write_atomically(os.path.join(self._metadata_dir, METADATA_FILE), self.metadata.to_json())

    def metadata_changed(self) -> None:
        """After a change to the replicas or epochs (under the lock): persist the metadata, then send every
        node whose fence epochs changed its new table."""
        self.persist()
        for node in self.cluster_nodes.reindex():
            self.cluster_nodes.push_epochs(node)

    # --- start-up --------------------------------------------------------------------------------

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock_ is None:
            self._lock_ = asyncio.Lock()
        return self._lock_

    def _check_owner(self) -> None:
        if self._refused is not None:
            raise self._refused

    async def _ready(self) -> None:
        """Bring every replica actor up once, before the first request is served."""
        self._check_owner()
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._restore())
        await asyncio.shield(self._started)
        if self._control_loop is None:
            self._control_loop = asyncio.get_running_loop().create_task(self._run_control_loop())
            self.groups.start()
            self.transactions.start()

    async def _restore(self) -> None:
        await self.refresh_nodes()
        if self.metadata.reassign_dead_nodes(self._host_map.live_nodes()):
            self.persist()
            self.cluster_nodes.reindex()
        for node in self._table.nodes():
            if node.ready:
                self.cluster_nodes.agent(node)
                self.cluster_nodes.push_epochs(node)
        # A partition left without a leader (its leader was lost before the restart) elects one
        # now, from its ISR: every node counts alive through the restart grace, and one whose
        # agent then reports the new leader down, or stays silent, starts the next election.
        everything = {(t.name, p) for t in self.metadata.topics.values() for p in range(len(t.partitions))}
        await self.check_partitions(everything, announce=False)
        self._export_health()
        starts = []
        for topic in self.metadata.topics.values():
            for p in range(len(topic.partitions)):
                starts.append(self.start_partition(topic, p))
        await asyncio.gather(*starts)

    def known_replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        return self._replicas.get((topic.name, partition, replica_id))

    def replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        key = (topic.name, partition, replica_id)
        handle = self._replicas.get(key)
        if handle is None:
            state = topic.partitions[partition]
            node = self._node_entry(state.nodes[str(replica_id)])
            if not node.ready:
                raise ReplicaNotAvailableError(
                    f"{topic.name}-{partition}: replica {replica_id} is on node {node.node_id}, which is not in the cluster now")
            handle = start_replica(
                namespace=self.namespace,
                topic=topic.name,
                topic_id=topic.topic_id,
                partition=partition,
                replica_id=replica_id,
                node_id=node.ray_node_id,
                directory=self._replica_directory(node, topic.name, partition, replica_id),
                config=topic.config,
                leader_epoch=state.leader_epoch,
                controller_name=CONTROLLER_NAME,
                resources={REPLICA_NODE_RESOURCE: 1} if self._use_slots else None,
            )
            self._replicas[key] = handle
        return handle

    def _replica_directory(self, node: Node, topic: str, partition: int, replica_id: int) -> str:
        return replica_directory(node.data_dir or self.data_dir, topic, partition, replica_id)

    def handle_or_none(self, topic: TopicState, partition: int, replica_id: int | None):
        """A replica's handle, or None when it has none or its node is away (ReplicaNotAvailableError)."""
        if replica_id is None:
            return None
        try:
            return self.replica_handle(topic, partition, replica_id)
        except ReplicaNotAvailableError:
            return None

    async def start_partition(self, topic: TopicState, partition: int) -> None:
        """Start a partition's replica actors (concurrently), fence its epoch, and tell each its role.

        Replicas on nodes away now start when their node comes back (``ClusterNodes._move_node``)."""
        state = topic.partitions[partition]
        handles = {r: h for r in state.replicas if (h := self.handle_or_none(topic, partition, r)) is not None}
        pings = await asyncio.gather(*(h.ping.remote() for h in handles.values()), return_exceptions=True)
        if pings and all(isinstance(p, Exception) for p in pings):
            raise pings[0]
        await self._fenced(topic, partition)
        await self._announce(topic, partition)

    async def _announce(self, topic: TopicState, partition: int) -> None:
        """Tell every replica of a partition the current leader and epoch; returns after the first tries.

        Called only once every live node hosting the partition applied its
        epoch (``_fenced``). Each replica's role change stays pending until
        the replica acknowledges it (``RoleDeliveries``): one that failed is
        sent again on a bounded backoff, and at once when the replica's node
        is heard again or the replica is reported up. A replica also asks for
        its role itself when it starts and whenever its fence epoch moves past
        its own (``replica_started``). A leaderless partition has nothing to
        deliver: its deposed leader's fence already refuses its writes.
        """
        state = topic.partitions[partition]
        keys = [(topic.name, partition, r) for r in state.replicas]
        if state.leader is None:
            self._deliveries.forget(keys)
            return
        now = monotonic_ms()
        for key in keys:
            self._deliveries.expect(key, state.leader_epoch, state.nodes[str(key[2])], now)
        sends = [task for task in (self._deliver(key, state.leader_epoch) for key in keys) if task is not None]
        if sends:
            await asyncio.wait(sends)

    def spawn(self, coroutine, what: str) -> asyncio.Task:
        """Run ``coroutine`` in the background: the task is held until it ends, and a failure is logged."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)

        def done(finished: asyncio.Task) -> None:
            self._background.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                logger.warning("%s failed: %r", what, finished.exception())

        task.add_done_callback(done)
        return task

    def _deliver(self, key: tuple[str, int, int], epoch: int) -> asyncio.Task | None:
        """Send a pending role change now (or join the call already under way); None if none is pending."""
        task = self._delivery_tasks.get(key)
        if task is not None and not task.done():
            return task
        if not self._deliveries.sending(key, epoch):
            return None
        task = asyncio.get_running_loop().create_task(self._send_role(key, epoch))
        self._delivery_tasks[key] = task
        task.add_done_callback(lambda done, key=key: self._delivery_tasks.pop(key, None) if self._delivery_tasks.get(key) is done else None)
        return task

    async def _send_role(self, key: tuple[str, int, int], epoch: int) -> None:
        topic_name, partition, replica_id = key
        topic = self.metadata.topics.get(topic_name)
        if topic is None or partition >= len(topic.partitions) or replica_id not in topic.partitions[partition].replicas:
            self._deliveries.forget([key])  # deleted or removed: nothing to tell it
            return
        state = topic.partitions[partition]
        if state.leader is None or state.leader_epoch != epoch:
            # Superseded: the newer epoch's announce (after its own fence) expects what is due now.
            self._deliveries.delivered(key, epoch)
            return
        try:
            handle = self.replica_handle(topic, partition, replica_id)  # ReplicaNotAvailableError: its node is away
            if replica_id == state.leader:
                call = handle.become_leader.remote(epoch, list(state.replicas), list(state.isr))
            else:
                call = handle.become_follower.remote(epoch, state.leader, self.replica_handle(topic, partition, state.leader))
            accepted = await asyncio.wait_for(call, ROLE_CALL_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 (unreachable, paused or restarting: sent again)
            again_ms = self._deliveries.failed(key, epoch, monotonic_ms())
            log = logger.warning if self._deliveries.attempts(key) == 1 else logger.debug
            log("%s-%d: replica %d did not take its role at epoch %d (%s); sending it again%s", topic_name, partition, replica_id,
                epoch, type(error).__name__, "" if again_ms is None else f" in {max(0, again_ms - monotonic_ms())} ms")
            return
        if not accepted:
            logger.warning("%s-%d: replica %d refused its role at epoch %d (it knows a newer one)", topic_name, partition, replica_id, epoch)
        elif self._deliveries.attempts(key) > 1:
            logger.info("%s-%d: replica %d took its role at epoch %d", topic_name, partition, replica_id, epoch)
        self._deliveries.delivered(key, epoch)

    def _redeliver(self, now: int) -> None:
        """Each tick: send again the role changes whose backoff ended (work per pending change, normally none)."""
        for key, epoch in self._deliveries.due(now):
            self._deliver(key, epoch)

    async def role_deliveries(self) -> list[dict]:
        """Role changes sent but not yet acknowledged: (topic, partition, replica), epoch, node, attempts (tools and tests)."""
        self._check_owner()
        return self._deliveries.describe()

    # --- nodes: heartbeats forwarded to ClusterNodes, and the NodeHost it is served ----------------------

    def drop_replica_handle(self, key: tuple[str, int, int]):
        return self._replicas.pop(key, None)

    def resend_roles(self, node_id: str, now: int) -> None:
        self._deliveries.node_heard(node_id, now)

    def retry_roles(self, keys, now: int) -> None:
        self._deliveries.retry_now(keys, now)

    def node_gone(self, node_id: str) -> None:
        self.moves.node_gone(node_id)

    async def node_heartbeat(
        self, node_id: str, incarnation: str, down: list[str], version: list | None, ray_node_id: str | None = None
    ) -> dict:
        """A node agent's lease renewal: the replicas it reports down, and the epoch table version it applied.

        The reply carries the node's epoch table whenever the agent is behind
        (a new agent, a restarted controller, a change not yet pushed); the
        agent applies it before it extends the node's lease. An agent on a
        Ray node its node left is answered ``stale`` (the host joined again
        elsewhere); one whose node is not mapped yet (this controller is
        starting), or not yet to the agent's Ray node (a host that joined
        again, before its node is moved there), is answered ``wait``
        (``NodeTable.heartbeat_answer``).
        """
        self._check_owner()
        self._calls["node_heartbeat"] += 1
        return self.cluster_nodes.renew(node_id, incarnation, down, version, ray_node_id)

    async def heartbeat_address(self) -> dict:
        """Where node agents send heartbeats (``heartbeat_link.py``): host, port and token."""
        self._check_owner()
        return await self._heartbeats.start(ray.util.get_node_ip_address())

    async def _linked_heartbeat(self, message: dict) -> dict:
        down, version = message["down"], message["version"]
        if not isinstance(down, list) or not (version is None or isinstance(version, list)):
            raise TypeError("a heartbeat's down must be a list and its version a list or null")
        self._check_owner()
        self._calls["node_heartbeat_link"] += 1
        ray_node = message.get("ray_node")
        return self.cluster_nodes.renew(str(message["node"]), str(message["incarnation"]), down, version,
                                        None if ray_node is None else str(ray_node))

    # --- partition health, liveness, fences --------------------------------------------------------------

    def _export_health(self) -> None:
        """Under-replicated and offline partitions, as gauges; recounted when an ISR or a leader changes.

        Also notes which partitions have no leader, for the tick's check that
        none stays so while one is electable (``_watch_leaderless``).
        """
        under = 0
        leaderless = set()
        for topic in self.metadata.topics.values():
            for p, state in enumerate(topic.partitions):
                if state.leader is None:
                    leaderless.add((topic.name, p))
                under += len(state.isr) < len(state.replicas) - len(state.adding)
        for key in self._leaderless - leaderless:
            self._leaderless_watch.clear(key)
        self._leaderless = leaderless
        self._health = (under, len(leaderless))
        self._health_set_ms = monotonic_ms()
        metrics.partition_health(*self._health)

    def _electable(self, topic: TopicState, partition: int, now: int) -> bool:
        """Whether an election would give the partition a live leader it lacks now."""
        state = topic.partitions[partition]
        alive = {r for r in state.replicas if self.replica_alive(topic, partition, r, now)}
        unclean = LogConfig.from_dict(topic.config).unclean_leader_election_enable
        return electable(state.leader, state.replicas, state.isr, alive, unclean)

    def _watch_leaderless(self, now: int) -> None:
        """Each tick: a partition without a leader while one is electable means an event was missed (a
        bug): after LEADERLESS_LIMIT_MS it is logged, counted, and elected. Costs the leaderless partitions."""
        for key in list(self._leaderless):
            topic = self.metadata.topics.get(key[0])
            if topic is None or key[1] >= len(topic.partitions) or topic.partitions[key[1]].leader is not None:
                self._leaderless.discard(key)
                self._leaderless_watch.clear(key)
                continue
            self._leaderless_watch.update(key, self._electable(topic, key[1], now), now)
        overdue = self._leaderless_watch.overdue(now)
        for (topic_name, partition), electable_ms in overdue:
            logger.error("%s-%d: no leader for %d ms although a replica could lead (a missed election); electing now",
                         topic_name, partition, electable_ms)
            metrics.leaderless_overdue()
        if overdue:
            self.spawn(self.check_partitions({key for key, _ in overdue}), "checking leaderless partitions")

    def replica_alive(self, topic: TopicState, partition: int, replica_id: int, now: int) -> bool:
        node_id = topic.partitions[partition].nodes.get(str(replica_id))
        return self._table.replica_alive(node_id, replica_file_name(topic.topic_id, partition, replica_id), now)

    async def _fenced(self, topic: TopicState, partition: int) -> None:
        """Wait until every live node hosting the partition has applied its current epoch.

        Only then may a new leader take writes: a deposed leader (alive,
        perhaps paused) finds the newer epoch in its fence file first. A node
        that does not answer is dead within LEASE_TIMEOUT_MS, and its leaders
        stopped when their lease ran out.
        """
        state = topic.partitions[partition]
        needed = self._table.fence_versions(state.nodes[str(r)] for r in state.replicas)
        deadline = monotonic_ms() + FENCE_TIMEOUT_MS
        while True:
            now = monotonic_ms()
            waiting = self._table.fence_waiting(needed, now)
            if not waiting:
                return
            if now > deadline:
                logger.warning("%s-%d: nodes %s have not applied the new epoch; announcing anyway", topic.name, partition, waiting)
                return
            await asyncio.sleep(FENCE_POLL_S)

    async def replica_started(self, topic: str, partition: int, replica_id: int) -> dict:
        """A replica process started (or Ray restarted it): its partition's current leadership."""
        self._check_owner()
        self._calls["replica_started"] += 1
        state_topic = self.metadata.topics.get(topic)
        if state_topic is None or partition >= len(state_topic.partitions) or replica_id not in state_topic.partitions[partition].replicas:
            return {"deleted": True}
        state = state_topic.partitions[partition]
        if self._started is not None and self._started.done() and self._electable(state_topic, partition, monotonic_ms()):
            # A replica that starts may make a leader possible: elect now, and answer with the result.
            await self.check_partitions({(topic, partition)})
            state_topic = self.metadata.topics.get(topic)
            if state_topic is None or partition >= len(state_topic.partitions):
                return {"deleted": True}
            state = state_topic.partitions[partition]
        if state.leader is not None:
            # Only a fenced epoch is told: a deposed leader elsewhere must have stopped first.
            await self._fenced(state_topic, partition)
            state = state_topic.partitions[partition]
        handle = self.replica_handle(state_topic, partition, state.leader) if state.leader is not None else None
        return {
            "leader": state.leader,
            "leader_epoch": state.leader_epoch,
            "replicas": list(state.replicas),
            "isr": list(state.isr),
            "leader_handle": handle,
        }

    def loads(self) -> list[NodeLoad]:
        """What placement knows of the live nodes (as last seen: ``refresh_nodes``): replicas and leaders
        from the metadata, racks from Ray's node labels, and each node's replica limit."""
        hosts = [host for host in self._host_map.usable() if host.node_id not in self.moves.draining]
        limits = {host.node_id: host.limit for host in hosts}
        self._use_slots = uses_replica_slots()
        loads = self.metadata.node_loads(sorted(limits), limits)
        racks = {host.node_id: host.rack for host in hosts}
        for load in loads:
            load.rack = racks.get(load.node_id, "")
        return loads

    # --- GroupHost: what the group service needs -------------------------------------------------

    def partition_counts(self) -> dict[str, int]:
        return {name: len(topic.partitions) for name, topic in self.metadata.topics.items()}

    def leader_handle(self, topic: str, partition: int):
        state_topic = self.metadata.topic(topic)
        if not 0 <= partition < len(state_topic.partitions):
            raise UnknownTopicError(f"topic {topic!r} has partitions 0..{len(state_topic.partitions) - 1}, not {partition}")
        handle = self.handle_or_none(state_topic, partition, state_topic.partitions[partition].leader)
        if handle is None:
            raise LeaderNotAvailableError(f"{topic}-{partition} has no leader right now")
        return handle

    async def create_internal_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        await self.admin.create_topic(name, partitions, replication_factor, config, CREATE_TIMEOUT_S, internal=True)

    def live_node_count(self) -> int:
        return len(self._host_map.live_nodes())

    # --- failure detection and elections: driven by nodes and events, not by replicas --------------

    async def alter_isr(self, topic: str, partition: int, leader: int, leader_epoch: int, isr: list[int]) -> list[int] | None:
        """A leader's ISR change; accepted only from the current leader and epoch, and persisted first."""
        await self._ready()
        self._calls["alter_isr"] += 1
        async with self.lock:
            if topic not in self.metadata.topics:
                return None
            before = len(self.metadata.topics[topic].partitions[partition].isr)
            accepted = self.metadata.alter_isr(topic, partition, leader, leader_epoch, isr)
            if accepted is not None:
                self.persist()
                metrics.isr_changed(before, len(accepted))
                self._export_health()
                self.moves.isr_changed(topic, partition)
        return accepted

    async def _run_control_loop(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_LOOP_INTERVAL_S)
            try:
                await self._check_nodes()
            except Exception:  # noqa: BLE001 (the loop must survive; the next tick retries)
                logger.exception("control loop error")

    async def _check_nodes(self) -> None:
        """Each tick: which nodes' leases ran out, which dead nodes leave the table (work per node, not per replica)."""
        now = monotonic_ms()
        names = self.cluster_nodes.check_leases(now, int(CONTROL_LOOP_INTERVAL_S * 1000))  # and prunes the nodes gone
        if names:
            await self.cluster_nodes.check_replicas(names)
        self.cluster_nodes.look_for_nodes(now)
        self._redeliver(now)
        self._watch_leaderless(now)
        self.moves.tick(now)
        if self._health is not None and now - self._health_set_ms >= HEALTH_GAUGES_EVERY_MS:
            self._health_set_ms = now  # the same counts again (two gauges, whatever the cluster's size)
            metrics.partition_health(*self._health)

    async def check_partitions(self, partitions: set[tuple[str, int]], announce: bool = True) -> list[tuple[TopicState, int]]:
        """Elect where a leader is missing or gone, replace replicas long gone; returns the partitions changed.

        Run on every event that may make a leader possible (see ``protocol/elections.py``).
        """
        changed: list[tuple[TopicState, int]] = []
        now = monotonic_ms()
        async with self.lock:
            for topic_name, p in sorted(partitions):
                topic = self.metadata.topics.get(topic_name)
                if topic is None or p >= len(topic.partitions):
                    continue
                state = topic.partitions[p]
                alive = {r for r in state.replicas if self.replica_alive(topic, p, r, now)}
                elected = False
                if needs_election(state.leader, alive):
                    unclean = LogConfig.from_dict(topic.config).unclean_leader_election_enable
                    in_sync = set(state.isr)
                    elected = self.metadata.elect_leader(topic.name, p, alive, unclean)
                    if elected and state.leader is not None:
                        metrics.leader_elected(unclean=state.leader not in in_sync)
                if self._replace_lost(topic, p, now) or elected:
                    changed.append((topic, p))
                if state.leader is not None:
                    self._leaderless_watch.clear((topic.name, p))
            if changed:
                self.metadata_changed()
                self._export_health()
        if announce:
            for topic, p in changed:
                self.spawn(self.announce_fenced(topic, p), f"announcing {topic.name}-{p}")
        return changed

    async def announce_fenced(self, topic: TopicState, partition: int) -> None:
        try:
            await self._fenced(topic, partition)
            await self._announce(topic, partition)
        except Exception as error:  # noqa: BLE001 (a bug: deliveries themselves never raise)
            logger.exception("announcing %s-%d failed: %r", topic.name, partition, error)

    async def retire_replicas(
        self, replicas: list[tuple[TopicState, int, int, str]], delete_timeout_s: float = REPLICA_CALL_TIMEOUT_S,
        topic_deleted: bool = False,
    ) -> None:
        """The one path by which replicas end, for a deleted topic or a finished move: each
        (topic, partition, replica id, node id) loses its pending role deliveries, its actor deletes
        its files (bounded wait; with ``topic_deleted``, its partition's remote tier too) and is
        killed, and its node's agent forgets it; then agents left with nothing to run stop."""
        handles, gone = [], {}
        self._deliveries.forget((topic.name, partition, r) for topic, partition, r, _ in replicas)
        for topic, partition, r, node_id in replicas:
            handle = self._replicas.pop((topic.name, partition, r), None)
            if handle is not None:
                handles.append(handle)
            gone.setdefault(node_id, []).append(replica_file_name(topic.topic_id, partition, r))
        results = await asyncio.gather(*(asyncio.wait_for(h.delete.remote(topic_deleted), delete_timeout_s) for h in handles), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a replica did not delete its files (%r); they stay on its node's disk", result)
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        for node_id, names in gone.items():
            node = self._table.get(node_id)
            if node is not None and node.agent is not None:
                try:
                    await asyncio.wait_for(node.agent.forget.remote(names), REPLICA_CALL_TIMEOUT_S)
                except Exception:  # noqa: BLE001 (an agent away: its fence files stay until it returns)
                    pass
        await self.cluster_nodes.retire_idle_agents()

    def _replace_lost(self, topic: TopicState, partition: int, now: int) -> bool:
        """Replace replicas whose node has been dead for replica_replacement_ms and has not come back.

        A node that came back (Ray counts it alive, or its host joined again as
        a new Ray node: ``refresh_nodes`` looks once a second while it is
        away) keeps its replicas: they reopen their logs there."""
        state = topic.partitions[partition]
        live_nodes = None
        replaced = False
        for r in list(state.replicas):
            if r in state.removing:
                continue  # leaving anyway: its reassignment finishes without it
            node = self._table.get(state.nodes.get(str(r)))
            if node is None or node.dead_since_ms is None or now - node.dead_since_ms <= self.replica_replacement_ms:
                continue
            if state.isr == [r]:
                continue  # the only in-sync copy: replacing it would lose the partition's data
            if live_nodes is None:
                live_nodes = self._host_map.live_nodes()
            if node.node_id in live_nodes:
                continue  # Ray still counts the node alive (Ray restarts the actor there), or its host joined again
            used = {state.nodes[str(x)] for x in state.replicas if x != r}
            free = [n for n in live_nodes if n not in used]
            if not free:
                continue
            old = self._replicas.pop((topic.name, partition, r), None)
            if old is not None:
                try:
                    ray.kill(old, no_restart=True)
                except Exception:  # noqa: BLE001 (already gone)
                    pass
            new = self.metadata.replace_replica(topic.name, partition, r, free[partition % len(free)])
            self.cluster_nodes.agent(self._node_entry(state.nodes[str(new)]))
            self.replica_handle(topic, partition, new)
            replaced = True
        return replaced

    def _node_entry(self, node_id: str) -> Node:
        return self._table.entry(node_id)

    # --- MoveHost, TopicAdminHost: what the parts need besides the above ----------------------------------

    def live_nodes(self) -> list[str]:
        return self._host_map.live_nodes()

    def knows_node(self, node_id: str) -> bool:
        return node_id in self._host_map.live_nodes() or node_id in self._table

    def start_agent(self, node_id: str) -> None:
        self.cluster_nodes.agent(self._node_entry(node_id))

    async def refresh_nodes(self) -> None:
        """Look through Ray's nodes now: map each host's node to the Ray node carrying its label (``ClusterNodes.refresh``)."""
        await self.cluster_nodes.refresh()

    # --- topic administration: forwarded to TopicAdmin -------------------------------------------------

    async def create_topic(
        self, name: str, partitions: int, replication_factor: int, config: dict | None, timeout_s: float = CREATE_TIMEOUT_S
    ) -> TopicDescription:
        """Create a topic and start its replicas; returns once every replica serves.

        When the cluster's nodes cannot hold it (too few nodes for the
        replication factor, or no replica slots left) and an autoscaler may
        add nodes with slots, the replicas become pending demand (placement
        groups) that the autoscaler answers; ``timeout_s`` bounds the wait.
        Without such an autoscaler it fails at once.
        """
        await self._ready()
        if name == OFFSETS_TOPIC:
            raise InvalidTopicError(f"{OFFSETS_TOPIC} is logbus's internal topic; it is created on first use")
        await self.admin.create_topic(name, partitions, replication_factor, config, timeout_s)
        return await self.describe_topic(name)

    async def delete_topic(self, name: str) -> None:
        await self._ready()
        if name == OFFSETS_TOPIC:
            raise InvalidTopicError(f"{OFFSETS_TOPIC} is logbus's internal topic and cannot be deleted")
        await self.admin.delete_topic(name)

    async def list_topics(self, include_internal: bool = False) -> list[str]:
        await self._ready()
        return self.admin.list_topics(include_internal)

    async def describe_topic(self, name: str) -> TopicDescription:
        await self._ready()
        return await self.admin.describe_topic(name)

    async def create_partitions(self, name: str, total: int) -> TopicDescription:
        await self._ready()
        return await self.admin.create_partitions(name, total)

    async def alter_config(self, name: str, config: dict, delete: list[str] | None = None) -> dict:
        """Set topic config overrides, and remove those named in ``delete`` (back to the defaults);
        returns the topic's overrides. Every replica applies them before this returns."""
        await self._ready()
        return await self.admin.alter_config(name, config, delete)

    async def delete_records(self, offsets: dict) -> dict:
        """Kafka's DeleteRecords: ``{(topic, partition): offset}`` (-1: the high watermark) -> each
        partition's new log start offset, moved by its leader (its followers follow). Every partition
        is tried; the first error (an offset past the high watermark, no leader) is raised after."""
        await self._ready()
        return await self.admin.delete_records(offsets)

    async def destroy(self) -> None:
        """Delete every topic, the internal one too, with its actors and files, and stop the node agents
        (tests and teardown: what is left is the controller, which the caller kills)."""
        await self._ready()
        for name in list(self.metadata.topics):
            await self.admin.delete_topic(name)
        await self.cluster_nodes.stop_agents()

    # --- autoscaler reservations ------------------------------------------------------------------------

    async def reserve_nodes(self, what: str, partitions: int, replication_factor: int, timeout_s: float) -> SlotReservation:
        """Pending demand the autoscaler answers (``reserve_replica_slots``): ``partitions`` groups of
        ``replication_factor`` replica slots on distinct nodes. Returns them once all are held, with the
        nodes they are on (checked first, if new); NodeCapacityError naming what is missing if the
        autoscaler does not provide them within ``timeout_s``."""
        reservation = await reserve_replica_slots(what, partitions, replication_factor, timeout_s)
        self._use_slots = True
        try:
            await self.refresh_nodes()  # the nodes just added (hosts among them are checked first)
        except BaseException:
            reservation.release()
            raise
        reservation.placements = [[self._host_map.node_of_ray_node(n) for n in ray_nodes] for ray_nodes in reservation.ray_nodes()]
        return reservation

    # --- moving replicas: forwarded to ReplicaMoves ---------------------------------------------------

    async def reassign_partitions(self, assignments: dict, throttle_bytes_per_s: int | None = None) -> list[dict]:
        """Move partitions to new nodes: ``{(topic, partition): [node id, ...]}`` (the first hosts the
        preferred leader). New replicas copy the log from the leader (at most ``throttle_bytes_per_s``
        each), join the ISR, and only then are the old ones removed (and leadership moved, fenced,
        if the leader was one of them). Validates every entry first: all start, or none."""
        await self._ready()
        return await self.moves.reassign_partitions(assignments, throttle_bytes_per_s)

    async def cancel_reassignments(self, partitions: list) -> list:
        """Abandon reassignments in progress: the new replicas go, the old ones stay. Returns what was cancelled."""
        await self._ready()
        return await self.moves.cancel_reassignments(partitions)

    async def describe_reassignments(self) -> list[dict]:
        """Partitions being moved: target nodes, replicas being added and removed, and how far each new one has copied."""
        await self._ready()
        return await self.moves.describe_reassignments()

    async def drain_node(self, node_id: str, throttle_bytes_per_s: int | None = None, timeout_s: float = CREATE_TIMEOUT_S) -> dict:
        """Move every replica and leadership off ``node_id`` so it becomes idle (and an autoscaler may remove it).

        When some partition has nowhere else to go and an autoscaler may add
        nodes with replica slots, one is asked for (up to ``timeout_s``).
        """
        await self._ready()
        return await self.moves.drain_node(node_id, throttle_bytes_per_s, timeout_s)

    async def rebalance(self, throttle_bytes_per_s: int | None = None) -> dict:
        """Spread replicas evenly over the live nodes (e.g. onto nodes just added): the fewest moves."""
        await self._ready()
        return await self.moves.rebalance(throttle_bytes_per_s)

    async def elect_preferred_leaders(self, topics: list[str] | None = None, partitions: list | None = None) -> list:
        """Give leadership back to each partition's preferred leader (its first replica) where it is
        alive and in sync: after failovers, leaders spread evenly again. ``partitions`` ((topic,
        partition) pairs), if given, narrows ``topics`` to those (Kafka's ElectLeaders). Returns the
        partitions moved."""
        await self._ready()
        return await self.moves.elect_preferred_leaders(topics, partitions)

    # --- metadata for clients, security records, status: forwarded to ClientMetadata ------------------

    async def topic_metadata(self, name: str) -> dict:
        """What producers and consumers need: config and, per partition, the leader's handle and epoch."""
        await self._ready()
        return self.client.topic_metadata(name)

    async def jvm_topic_metadata(self, name: str) -> bytes:
        """For Spark's JVM (a Ray cross-language call, which carries no actor handles): the topic's
        partitions as JSON, each with its replicas' actor names (the leader's first) and leader epoch."""
        await self._ready()
        metadata = self.client.topic_metadata(name)
        partitions = [{"replicas": p["replica_names"], "leader_epoch": p["leader_epoch"]} for p in metadata["partitions"]]
        max_message_bytes = LogConfig.from_dict(metadata["config"]).max_message_bytes
        return json.dumps({
            "name": name, "topic_id": metadata["topic_id"], "max_message_bytes": max_message_bytes, "partitions": partitions,
        }).encode()

    async def gateway_metadata(self, names: list[str] | None = None) -> dict:
        """For the Kafka gateway, in one call: per topic named (every topic, ``__consumer_offsets``
        included as Kafka lists it, when ``names`` is None; None for a name that is no topic) its id,
        config and, per partition, the leader's handle, epoch and node and its replicas' and in-sync
        replicas' nodes; and the nodes hosting replicas whose leases ran out (``dead_nodes``). Nodes
        here are the Ray nodes they are on now (a gateway is a Ray node's), a node away none."""
        await self._ready()
        return await self.client.gateway_metadata(names)

    async def scram_credential(self, user: str, mechanism: str) -> dict | None:
        """The stored SCRAM credential of ``user`` for ``mechanism`` (None if it has none): the gateway's SASL check."""
        await self._ready()
        return self.client.scram_credential(user, mechanism)

    async def alter_scram_credentials(self, upserts: list, deletions: list) -> list[bool]:
        """Set each (user, mechanism, credential) of ``upserts``, then delete each (user, mechanism or
        None for all) of ``deletions``; durable before this returns. Per deletion, whether it found one."""
        await self._ready()
        return await self.client.alter_scram_credentials(upserts, deletions)

    async def scram_users(self) -> dict[str, dict[str, int]]:
        """user -> mechanism -> iterations of every SCRAM credential (never the credential itself)."""
        await self._ready()
        return self.client.scram_users()

    async def create_acls(self, bindings: list[dict]) -> int:
        """Add ACL bindings (AclBinding.to_dict each); durable before this returns. How many were new."""
        await self._ready()
        return await self.client.create_acls(bindings)

    async def describe_acls(self, acl_filter: dict | None = None) -> list[dict]:
        """The ACL bindings an AclFilter (as its to_dict; None: every binding) matches."""
        await self._ready()
        return self.client.describe_acls(acl_filter)

    async def delete_acls(self, filters: list[dict]) -> list[list[dict]]:
        """Delete the bindings each filter matches; per filter, the bindings it deleted. Durable before this returns."""
        await self._ready()
        return await self.client.delete_acls(filters)

    async def acls(self, known_version: int = -1) -> tuple[int, list[dict] | None]:
        """(the ACLs' version, every binding), or (version, None) when ``known_version`` is current: what a gateway loads."""
        await self._ready()
        return self.client.acls(known_version)

    async def allocate_producer_id(self) -> int:
        """A producer id for an idempotent producer, unique for the life of the cluster's data."""
        await self._ready()
        return await self.client.allocate_producer_id()

    async def replica_statuses(self, name: str) -> list[list[dict]]:
        """Every replica's own view (role, epoch, offsets, bytes fetched as follower, last recovery): for
        `logbus status` and tools. The controller adds its ``node`` (``node_id`` is the replica's Ray
        node) and ``directory`` (None while its node was not seen), also to a replica that did not answer."""
        await self._ready()
        return await self.client.replica_statuses(name)

    async def nodes(self) -> list[dict]:
        """Every node that may host replicas: its replicas, leaders, replica limit, lease state (`logbus status`)."""
        await self._ready()
        return await self.client.nodes()

    async def call_counts(self) -> dict[str, int]:
        """How many calls of each kind this controller served since it started (for `logbus status`),
        heartbeats over the agents' links (``node_heartbeat_link``) among them, and how many such
        links agents opened (``heartbeat_links_opened``)."""
        self._check_owner()
        return {**self._calls, "heartbeat_links_opened": self._heartbeats.links_opened}

    async def lease_isolation(self) -> dict:
        """What this controller says of silences of every node at once (``protocol/liveness.py``, the
        isolation rule; ``NodeTable.isolation``): whether it hears no node now, the silence not counted
        against leases, the nodes kept alive not yet heard again, and the leases that ran out."""
        self._check_owner()
        return self.cluster_nodes.table.isolation()

    async def get_data_dir(self) -> str:
        if self._refused is not None:
            raise self._refused
        return self.data_dir

    async def ping(self) -> int:
        await self._ready()
        return os.getpid()

    # --- consumer groups: forwarded to the group service ---------------------------------------------

    async def group_join(self, group_id: str, options: dict, wait_ms: int = 0):
        await self._ready()
        return await self.groups.join(group_id, options, wait_ms)

    async def group_sync(self, group_id: str, member_id: str, generation: int, assignments: dict | None = None, wait_ms: int = 0,
                         group_instance_id: str | None = None, protocol_type: str | None = None, protocol_name: str | None = None):
        await self._ready()
        return await self.groups.sync(group_id, member_id, generation, assignments, wait_ms, group_instance_id, protocol_type, protocol_name)

    async def consumer_group_heartbeat(self, group_id: str, member_id: str, member_epoch: int, options: dict) -> dict:
        """KIP-848's ConsumerGroupHeartbeat (see ``GroupService.consumer_heartbeat``; ``options`` are its keyword arguments)."""
        await self._ready()
        return await self.groups.consumer_heartbeat(group_id, member_id, member_epoch, **options)

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, poll_idle_ms: int, wait_ms: int = 0,
                              group_instance_id: str | None = None):
        await self._ready()
        return await self.groups.heartbeat(group_id, member_id, generation, poll_idle_ms, wait_ms, group_instance_id)

    async def group_leave(self, group_id: str, member_id: str, group_instance_id: str | None = None) -> bool:
        await self._ready()
        return await self.groups.leave(group_id, member_id, group_instance_id)

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict,
                             group_instance_id: str | None = None, retention_ms: int | None = None) -> None:
        await self._ready()
        await self.groups.commit_offsets(group_id, member_id, generation, offsets, group_instance_id, retention_ms)

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        await self._ready()
        return await self.groups.fetch_committed(group_id, partitions)

    async def list_groups(self, with_protocol_type: bool = False) -> list[tuple]:
        await self._ready()
        return await self.groups.list_groups(with_protocol_type)

    async def describe_group(self, group_id: str, protocol_details: bool = False) -> dict:
        await self._ready()
        return await self.groups.describe_group(group_id, protocol_details)

    async def reset_offsets(self, group_id: str, to, topics: list[str] | None = None) -> dict:
        await self._ready()
        return await self.groups.reset_offsets(group_id, to, topics)

    async def delete_group(self, group_id: str) -> list:
        await self._ready()
        return await self.groups.delete_group(group_id)

    async def delete_group_offsets(self, group_id: str, partitions: list) -> dict:
        """Kafka's OffsetDelete (see ``GroupService.delete_offsets``)."""
        await self._ready()
        return await self.groups.delete_offsets(group_id, partitions)

    async def ensure_offsets_topic(self) -> None:
        """Create ``__consumer_offsets`` if it does not exist yet (a Kafka gateway starting: Kafka's tools
        expect to find it before the first commit)."""
        await self._ready()
        await self.groups.offsets.ensure_topic()

    # --- transactions: forwarded to the transaction service ---------------------------------------------

    async def txn_init_producer_id(self, transactional_id: str, timeout_ms: int, expected: tuple | None = None) -> tuple[int, int]:
        await self._ready()
        return await self.transactions.init_producer_id(transactional_id, timeout_ms, expected)

    async def txn_add_partitions(self, transactional_id: str, producer_id: int, epoch: int, partitions: list) -> None:
        await self._ready()
        await self.transactions.add_partitions(transactional_id, producer_id, epoch, partitions)

    async def txn_add_offsets(self, transactional_id: str, producer_id: int, epoch: int, group_id: str) -> None:
        await self._ready()
        await self.transactions.add_offsets(transactional_id, producer_id, epoch, group_id)

    async def txn_offset_commit(self, transactional_id: str, producer_id: int, epoch: int, group_metadata: tuple, offsets: dict) -> None:
        await self._ready()
        await self.transactions.txn_offset_commit(transactional_id, producer_id, epoch, group_metadata, offsets)

    async def txn_end(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        await self._ready()
        await self.transactions.end_txn(transactional_id, producer_id, epoch, commit)

    async def describe_transactions(self) -> list[dict]:
        await self._ready()
        return await self.transactions.describe()


@functools.cache
def _controller_actor_class():
    """The controller's Ray actor class, made once per process (see partition_replica's
    ``_replica_actor_class``): Ray inspects and exports each new ``ray.remote(cls)`` on its first
    use, about 0.2 s for this class, which every ``connect()`` paid."""
    return ray.remote(Controller)


def get_or_create(namespace: str, data_dir: str, replica_replacement_ms: int | None = None, max_replicas_per_node: int | None = None):
    """Get or create the cluster's controller: detached, named, restarted forever by Ray.

    It runs on the head node, where its metadata directory lives, and where
    Ray restarts it after a crash. It must not share a fate with a replica
    node: the head's death ends the Ray cluster anyway (GCS lives there).
    """
    options = {} if replica_replacement_ms is None else {"replica_replacement_ms": replica_replacement_ms}
    if max_replicas_per_node is not None:
        options["max_replicas_per_node"] = max_replicas_per_node
    return (
        _controller_actor_class()
        .options(
            name=CONTROLLER_NAME,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,  # callers retry; every controller method is idempotent
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
            max_concurrency=CONTROLLER_MAX_CONCURRENCY,
        )
        .remote(data_dir, namespace, **options)
    )
