"""Controller: the detached, named actor that holds cluster metadata and runs the replica actors' lifecycle.

It owns a :class:`~logbus.protocol.cluster_metadata.ClusterMetadata`, persists
it to ``{data_dir}/controller/metadata.json`` after every change
(:func:`~logbus.storage.files.write_atomically`), and reloads it when Ray
restarts the actor or when a new Ray cluster starts over the same data
directory. On start it (re)creates every replica actor, pointing replicas
whose node is gone at live nodes (see ``placement.py``).

Failure detection does not wait for Ray's node-death detection: every replica
heartbeats (``replica_heartbeat``); the control loop deposes a leader whose
lease ran out (``protocol/liveness.py``) and elects a live ISR member with a
higher epoch (the deposed leader's own lease ran out first, so it has stopped
taking writes). A replica whose node is gone for ``replica_replacement_ms`` is
replaced by a new replica on another live node, which copies the log from
the leader.

Consumer groups are the :class:`~logbus.actors.group_service.GroupService`'s:
the controller forwards the group RPCs to it and serves it the small
:class:`~logbus.actors.group_service.GroupHost` interface (partition counts,
leaders, the internal topic).

Retry contract: a call that failed may have taken effect, so clients may send
it again; creating an existing replica actor reuses it (``get_if_exists``),
and deleting twice reports UnknownTopicError the second time.

It is an async actor: methods run on one event loop and are serialised by a
lock around every metadata change.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray

from logbus.actors import group_service as groups_module
from logbus.actors.group_service import GroupService
from logbus.actors.partition_replica import start_replica
from logbus.actors.placement import HEAD_NODE_RESOURCE, live_node_ids, replica_directory
from logbus.clock import monotonic_ms
from logbus.errors import DataDirectoryInUseError, InvalidTopicError, LeaderNotAvailableError, UnknownTopicError
from logbus.protocol.cluster_metadata import ClusterMetadata, TopicState
from logbus.protocol.group_coordinator import OFFSETS_TOPIC
from logbus.protocol.liveness import Liveness
from logbus.protocol.messages import PartitionInfo, TopicDescription
from logbus.storage.dir_lock import DirectoryLock
from logbus.storage.files import write_atomically
from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_topic_name

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "logbus-controller"
CONTROLLER_MAX_CONCURRENCY = 1000
METADATA_FILE = "metadata.json"
OWNER_LOCK_FILE = "owner.lock"  # in {data_dir}/controller/, with its note owner.lock.json
OWNER_LOCK_WAIT_S = 10.0  # a restarted controller waits this long for a predecessor still exiting
REPLICA_CALL_TIMEOUT_S = 60.0
CONTROL_LOOP_INTERVAL_S = 0.1
REPLICA_REPLACEMENT_MS = 60_000  # default; settable per controller

if not groups_module.LONG_POLLS_MAX <= CONTROLLER_MAX_CONCURRENCY // 2:
    raise AssertionError("held group calls must leave at least half of the controller's concurrency to other calls")


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
    lock.write_note({"namespace": namespace, "gcs_address": context.gcs_address, "node_id": context.get_node_id(), "data_dir": data_dir})
    return lock


class Controller:
    """Cluster metadata and replica lifecycle; consumer groups through its GroupService (see the module docstring)."""

    def __init__(self, data_dir: str, namespace: str, replica_replacement_ms: int = REPLICA_REPLACEMENT_MS) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.namespace = namespace
        self.replica_replacement_ms = replica_replacement_ms
        self._liveness = Liveness(monotonic_ms())
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
        self._replicas: dict[tuple[str, int, int], ray.actor.ActorHandle] = {}
        self._lock: asyncio.Lock | None = None
        self._started: asyncio.Task | None = None
        self.groups = GroupService(self, self._metadata_dir)

    # --- persistence ---------------------------------------------------------------------------

    def _load(self) -> ClusterMetadata:
        path = os.path.join(self._metadata_dir, METADATA_FILE)
        try:
            with open(path) as file:
                return ClusterMetadata.from_json(file.read())
        except FileNotFoundError:
            return ClusterMetadata()

    def _persist(self) -> None:
        write_atomically(os.path.join(self._metadata_dir, METADATA_FILE), self.metadata.to_json())

    # --- start-up --------------------------------------------------------------------------------

    async def _ready(self) -> None:
        """Bring every replica actor up once, before the first request is served."""
        if self._refused is not None:
            raise self._refused
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._restore())
        await asyncio.shield(self._started)
        if self._control_loop is None:
            self._control_loop = asyncio.get_running_loop().create_task(self._run_control_loop())
            self.groups.start()

    async def _restore(self) -> None:
        if self.metadata.reassign_dead_nodes(live_node_ids()):
            self._persist()
        starts = []
        for topic in self.metadata.topics.values():
            for p in range(len(topic.partitions)):
                starts.append(self._start_partition(topic, p))
        await asyncio.gather(*starts)

    def _replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        key = (topic.name, partition, replica_id)
        handle = self._replicas.get(key)
        if handle is None:
            state = topic.partitions[partition]
            handle = start_replica(
                namespace=self.namespace,
                topic=topic.name,
                topic_id=topic.topic_id,
                partition=partition,
                replica_id=replica_id,
                node_id=state.nodes[str(replica_id)],
                directory=replica_directory(self.data_dir, topic.name, partition, replica_id),
                config=topic.config,
                leader_epoch=state.leader_epoch,
                controller_name=CONTROLLER_NAME,
            )
            self._replicas[key] = handle
        return handle

    async def _start_partition(self, topic: TopicState, partition: int) -> None:
        """Start a partition's replica actors (concurrently) and tell each its role."""
        state = topic.partitions[partition]
        handles = {r: self._replica_handle(topic, partition, r) for r in state.replicas}
        pings = await asyncio.gather(*(h.ping.remote() for h in handles.values()), return_exceptions=True)
        if all(isinstance(p, Exception) for p in pings):
            raise pings[0]
        await self._announce(topic, partition)

    async def _announce(self, topic: TopicState, partition: int) -> None:
        """Tell every replica of a partition the current leader and epoch (best effort; heartbeats repair misses)."""
        state = topic.partitions[partition]
        if state.leader is None:
            return
        leader = self._replica_handle(topic, partition, state.leader)
        calls = [leader.become_leader.remote(state.leader_epoch, list(state.replicas), list(state.isr))]
        for r in state.replicas:
            if r != state.leader:
                calls.append(self._replica_handle(topic, partition, r).become_follower.remote(state.leader_epoch, state.leader, leader))
        await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), REPLICA_CALL_TIMEOUT_S)

    # --- GroupHost: what the group service needs -------------------------------------------------

    def partition_counts(self) -> dict[str, int]:
        return {name: len(topic.partitions) for name, topic in self.metadata.topics.items()}

    def leader_handle(self, topic: str, partition: int):
        state_topic = self.metadata.topic(topic)
        if not 0 <= partition < len(state_topic.partitions):
            raise UnknownTopicError(f"topic {topic!r} has partitions 0..{len(state_topic.partitions) - 1}, not {partition}")
        leader = state_topic.partitions[partition].leader
        if leader is None:
            raise LeaderNotAvailableError(f"{topic}-{partition} has no leader right now")
        return self._replica_handle(state_topic, partition, leader)

    async def create_internal_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        await self._create_topic(name, partitions, replication_factor, config, internal=True)

    def live_node_count(self) -> int:
        return len(live_node_ids())

    # --- failure detection and elections --------------------------------------------------------------

    def _expect_heartbeats(self, topic: TopicState, partitions) -> None:
        """New replicas are alive until proven silent: their actors take a while to start."""
        now = monotonic_ms()
        for p in partitions:
            for r in topic.partitions[p].replicas:
                self._liveness.expect((topic.name, p, r), now)

    async def replica_heartbeat(self, topic: str, partition: int, replica_id: int, leader_epoch: int, log_end_offset: int) -> dict:
        """A replica's lease renewal; the reply carries the partition's current leadership."""
        await self._ready()
        state_topic = self.metadata.topics.get(topic)
        if state_topic is None or partition >= len(state_topic.partitions) or replica_id not in state_topic.partitions[partition].replicas:
            return {"deleted": True}
        self._liveness.heard((topic, partition, replica_id), monotonic_ms())
        state = state_topic.partitions[partition]
        handle = self._replica_handle(state_topic, partition, state.leader) if state.leader is not None else None
        return {
            "leader": state.leader,
            "leader_epoch": state.leader_epoch,
            "replicas": list(state.replicas),
            "isr": list(state.isr),
            "leader_handle": handle,
        }

    async def alter_isr(self, topic: str, partition: int, leader: int, leader_epoch: int, isr: list[int]) -> list[int] | None:
        """A leader's ISR change; accepted only from the current leader and epoch, and persisted first."""
        await self._ready()
        async with self._lock:
            if topic not in self.metadata.topics:
                return None
            accepted = self.metadata.alter_isr(topic, partition, leader, leader_epoch, isr)
            if accepted is not None:
                self._persist()
        return accepted

    async def _run_control_loop(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_LOOP_INTERVAL_S)
            try:
                await self._check_partitions()
            except Exception:  # noqa: BLE001 (the loop must survive; the next tick retries)
                logger.exception("control loop error")

    async def _check_partitions(self) -> None:
        now = monotonic_ms()
        # A late tick (this process stalled) does not count the stall against any lease.
        self._liveness.tick(now, int(CONTROL_LOOP_INTERVAL_S * 1000))
        changed: list[tuple[TopicState, int]] = []
        async with self._lock:
            for topic in list(self.metadata.topics.values()):
                unclean = LogConfig.from_dict(topic.config).unclean_leader_election_enable
                for p, state in enumerate(topic.partitions):
                    alive = {r for r in state.replicas if self._liveness.alive((topic.name, p, r), now)}
                    if state.leader is None or state.leader not in alive:
                        if self.metadata.elect_leader(topic.name, p, alive, unclean):
                            changed.append((topic, p))
                    replaced = self._replace_lost(topic, p, now)
                    if replaced and (topic, p) not in changed:
                        changed.append((topic, p))
            if changed:
                self._persist()
        for topic, p in changed:
            asyncio.get_running_loop().create_task(self._announce_safely(topic, p))

    async def _announce_safely(self, topic: TopicState, partition: int) -> None:
        try:
            await self._announce(topic, partition)
        except Exception as error:  # noqa: BLE001 (heartbeats will carry the news instead)
            logger.warning("announcing %s-%d failed: %r", topic.name, partition, error)

    def _replace_lost(self, topic: TopicState, partition: int, now: int) -> bool:
        """Replace replicas whose node is gone and that were silent for replica_replacement_ms."""
        state = topic.partitions[partition]
        live_nodes = None
        replaced = False
        for r in list(state.replicas):
            if self._liveness.silent_ms((topic.name, partition, r), now) <= self.replica_replacement_ms:
                continue
            if state.isr == [r]:
                continue  # the only in-sync copy: replacing it would lose the partition's data
            if live_nodes is None:
                live_nodes = live_node_ids()
            if state.nodes.get(str(r)) in live_nodes:
                continue  # its node is alive: Ray restarts the actor there
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
            self._liveness.forget((topic.name, partition, r))
            new = self.metadata.replace_replica(topic.name, partition, r, free[partition % len(free)])
            self._liveness.expect((topic.name, partition, new), now)
            self._replica_handle(topic, partition, new)
            replaced = True
        return replaced

    # --- admin -------------------------------------------------------------------------------------

    async def create_topic(self, name: str, partitions: int, replication_factor: int, config: dict | None) -> TopicDescription:
        await self._ready()
        if name == OFFSETS_TOPIC:
            raise InvalidTopicError(f"{OFFSETS_TOPIC} is logbus's internal topic; it is created on first use")
        await self._create_topic(name, partitions, replication_factor, config)
        return await self.describe_topic(name)

    async def _create_topic(self, name, partitions, replication_factor, config, internal: bool = False) -> None:
        async with self._lock:
            topic = self.metadata.create_topic(name, partitions, replication_factor, config, live_node_ids())
            self._expect_heartbeats(topic, range(partitions))
            self._persist()
            self.groups.topics_changed()
        # Start every replica actor concurrently: each is a process that takes a while to boot.
        await asyncio.gather(*(self._start_partition(topic, p) for p in range(partitions)))

    async def delete_topic(self, name: str) -> None:
        await self._ready()
        if name == OFFSETS_TOPIC:
            raise InvalidTopicError(f"{OFFSETS_TOPIC} is logbus's internal topic and cannot be deleted")
        await self._delete_topic(name)

    async def destroy(self) -> None:
        """Delete every topic, the internal one too, with its actors and files (tests and teardown)."""
        await self._ready()
        for name in list(self.metadata.topics):
            await self._delete_topic(name)

    async def _delete_topic(self, name: str) -> None:
        async with self._lock:
            topic = self.metadata.delete_topic(name)
            self._persist()
            self.groups.topics_changed()
        handles = []
        for p, state in enumerate(topic.partitions):
            for r in state.replicas:
                self._liveness.forget((name, p, r))
                handle = self._replicas.pop((name, p, r), None)
                if handle is not None:
                    handles.append(handle)
        if handles:
            await asyncio.gather(*(h.delete.remote() for h in handles), return_exceptions=True)
        for handle in handles:
            ray.kill(handle, no_restart=True)

    async def list_topics(self, include_internal: bool = False) -> list[str]:
        await self._ready()
        return sorted(name for name in self.metadata.topics if include_internal or name != OFFSETS_TOPIC)

    async def describe_topic(self, name: str) -> TopicDescription:
        await self._ready()
        topic = self.metadata.topic(name)

        async def leader_offsets(p, state):
            if state.leader is None:
                return None
            return await asyncio.wait_for(self._replica_handle(topic, p, state.leader).offsets.remote(), 10)

        offsets = await asyncio.gather(*(leader_offsets(p, s) for p, s in enumerate(topic.partitions)), return_exceptions=True)
        infos = []
        for p, (state, found) in enumerate(zip(topic.partitions, offsets)):
            start, high_watermark, end = found if isinstance(found, tuple) else (-1, -1, -1)
            infos.append(
                PartitionInfo(name, p, state.leader, tuple(state.replicas), tuple(state.isr), state.leader_epoch, start, high_watermark, end)
            )
        return TopicDescription(name, tuple(infos), dict(topic.config))

    async def create_partitions(self, name: str, total: int) -> TopicDescription:
        await self._ready()
        async with self._lock:
            added = self.metadata.create_partitions(name, total, live_node_ids())
            topic = self.metadata.topic(name)
            self._expect_heartbeats(topic, added)
            self._persist()
            self.groups.topics_changed()
        await asyncio.gather(*(self._start_partition(topic, p) for p in added))
        return await self.describe_topic(name)

    async def alter_config(self, name: str, config: dict) -> dict:
        await self._ready()
        async with self._lock:
            overrides = self.metadata.alter_config(name, config)
            self._persist()
            topic = self.metadata.topic(name)
        handles = [self._replica_handle(topic, p, r) for p, state in enumerate(topic.partitions) for r in state.replicas]
        await asyncio.gather(*(h.update_config.remote(overrides) for h in handles))
        return dict(overrides)

    # --- metadata for clients --------------------------------------------------------------------------

    async def topic_metadata(self, name: str) -> dict:
        """What producers and consumers need: config and, per partition, the leader's handle and epoch."""
        await self._ready()
        validate_topic_name(name)
        topic = self.metadata.topic(name)
        partitions = []
        for p, state in enumerate(topic.partitions):
            handle = self._replica_handle(topic, p, state.leader) if state.leader is not None else None
            partitions.append({"leader": handle, "leader_epoch": state.leader_epoch})
        return {"name": name, "topic_id": topic.topic_id, "config": dict(topic.config), "partitions": partitions}

    async def allocate_producer_id(self) -> int:
        """A producer id for an idempotent producer, unique for the life of the cluster's data."""
        await self._ready()
        async with self._lock:
            producer_id = self.metadata.allocate_producer_id()
            self._persist()
        return producer_id

    async def replica_statuses(self, name: str) -> list[list[dict]]:
        """Every replica's own view (role, epoch, offsets, last recovery): for `logbus status` and tools."""
        await self._ready()
        topic = self.metadata.topic(name)
        out = []
        for p, state in enumerate(topic.partitions):
            handles = [self._replica_handle(topic, p, r) for r in state.replicas]
            found = await asyncio.gather(*(asyncio.wait_for(h.status.remote(), 5) for h in handles), return_exceptions=True)
            out.append([f if isinstance(f, dict) else {"replica_id": r, "error": repr(f)} for r, f in zip(state.replicas, found)])
        return out

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

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, poll_idle_ms: int, wait_ms: int = 0):
        await self._ready()
        return await self.groups.heartbeat(group_id, member_id, generation, poll_idle_ms, wait_ms)

    async def group_leave(self, group_id: str, member_id: str) -> bool:
        await self._ready()
        return await self.groups.leave(group_id, member_id)

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict) -> None:
        await self._ready()
        await self.groups.commit_offsets(group_id, member_id, generation, offsets)

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        await self._ready()
        return await self.groups.fetch_committed(group_id, partitions)

    async def list_groups(self) -> list[tuple[str, str, str | None]]:
        await self._ready()
        return await self.groups.list_groups()

    async def describe_group(self, group_id: str) -> dict:
        await self._ready()
        return await self.groups.describe_group(group_id)

    async def reset_offsets(self, group_id: str, to, topics: list[str] | None = None) -> dict:
        await self._ready()
        return await self.groups.reset_offsets(group_id, to, topics)


def get_or_create(namespace: str, data_dir: str, replica_replacement_ms: int | None = None):
    """Get or create the cluster's controller: detached, named, restarted forever by Ray.

    It runs on the head node, where its metadata directory lives, and where
    Ray restarts it after a crash. It must not share a fate with a replica
    node: the head's death ends the Ray cluster anyway (GCS lives there).
    """
    options = {} if replica_replacement_ms is None else {"replica_replacement_ms": replica_replacement_ms}
    return (
        ray.remote(Controller)
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
