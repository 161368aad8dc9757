"""Controller: the detached, named actor that holds cluster metadata and manages replica actors.

It owns a :class:`~logbus.protocol.cluster_metadata.ClusterMetadata`, persists
it to ``{data_dir}/controller/metadata.json`` after every change (write to a
temporary file, fsync, rename), and reloads it when Ray restarts the actor or
when a new Ray cluster starts over the same data directory. On start it
(re)creates every replica actor, pointing replicas whose node is gone at live
nodes.

Retry contract: a call that failed may have taken effect, so clients may send
it again; creating an existing replica actor reuses it (``get_if_exists``),
and deleting twice reports UnknownTopicError the second time.

It is an async actor: methods run on one event loop and are serialised by a
lock around every metadata change.
"""

from __future__ import annotations

import asyncio
import os

import ray

from logbus.protocol.cluster_metadata import ClusterMetadata, TopicState
from logbus.protocol.messages import PartitionInfo, TopicDescription
from logbus.storage.names import partition_dir_name, validate_topic_name

METADATA_FILE = "metadata.json"
REPLICA_CALL_TIMEOUT_S = 60.0


def replica_directory(data_dir: str, topic: str, partition: int, replica_id: int) -> str:
    return os.path.join(data_dir, f"replica-{replica_id}", partition_dir_name(topic, partition))


def live_node_ids() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))


class Controller:
    """Cluster metadata and replica lifecycle (see the module docstring)."""

    def __init__(self, data_dir: str, namespace: str) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.namespace = namespace
        self._metadata_dir = os.path.join(self.data_dir, "controller")
        os.makedirs(self._metadata_dir, exist_ok=True)
        self.metadata = self._load()
        self._replicas: dict[tuple[str, int, int], ray.actor.ActorHandle] = {}
        self._lock: asyncio.Lock | None = None
        self._started: asyncio.Task | None = None

    # --- persistence ---------------------------------------------------------------------------

    def _load(self) -> ClusterMetadata:
        path = os.path.join(self._metadata_dir, METADATA_FILE)
        try:
            with open(path) as file:
                return ClusterMetadata.from_json(file.read())
        except FileNotFoundError:
            return ClusterMetadata()

    def _persist(self) -> None:
        path = os.path.join(self._metadata_dir, METADATA_FILE)
        temporary = path + ".tmp"
        with open(temporary, "w") as file:
            file.write(self.metadata.to_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)

    # --- start-up --------------------------------------------------------------------------------

    async def _ready(self) -> None:
        """Bring every replica actor up once, before the first request is served."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._restore())
        await asyncio.shield(self._started)

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
            from logbus.actors import factory  # factory imports this module

            state = topic.partitions[partition]
            handle = factory.partition_replica(
                namespace=self.namespace,
                topic=topic.name,
                topic_id=topic.topic_id,
                partition=partition,
                replica_id=replica_id,
                node_id=state.nodes[str(replica_id)],
                directory=replica_directory(self.data_dir, topic.name, partition, replica_id),
                config=topic.config,
                leader_epoch=state.leader_epoch,
            )
            self._replicas[key] = handle
        return handle

    async def _start_partition(self, topic: TopicState, partition: int) -> None:
        state = topic.partitions[partition]
        handles = [self._replica_handle(topic, partition, r) for r in state.replicas]
        await asyncio.wait_for(asyncio.gather(*(h.ping.remote() for h in handles)), REPLICA_CALL_TIMEOUT_S)

    # --- admin -------------------------------------------------------------------------------------

    async def create_topic(self, name: str, partitions: int, replication_factor: int, config: dict | None) -> TopicDescription:
        await self._ready()
        async with self._lock:
            topic = self.metadata.create_topic(name, partitions, replication_factor, config, live_node_ids())
            self._persist()
        # Start every replica actor concurrently: each is a process that takes a while to boot.
        await asyncio.gather(*(self._start_partition(topic, p) for p in range(partitions)))
        return await self.describe_topic(name)

    async def delete_topic(self, name: str) -> None:
        await self._ready()
        async with self._lock:
            topic = self.metadata.delete_topic(name)
            self._persist()
        handles = []
        for p, state in enumerate(topic.partitions):
            for r in state.replicas:
                handle = self._replicas.pop((name, p, r), None)
                if handle is not None:
                    handles.append(handle)
        if handles:
            await asyncio.gather(*(h.delete.remote() for h in handles), return_exceptions=True)
        for handle in handles:
            ray.kill(handle, no_restart=True)

    async def list_topics(self) -> list[str]:
        await self._ready()
        return sorted(self.metadata.topics)

    async def describe_topic(self, name: str) -> TopicDescription:
        await self._ready()
        topic = self.metadata.topic(name)
        leaders = [self._replica_handle(topic, p, state.leader) for p, state in enumerate(topic.partitions)]
        offsets = await asyncio.gather(*(h.offsets.remote() for h in leaders), return_exceptions=True)
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
            self._persist()
            topic = self.metadata.topic(name)
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

    async def get_data_dir(self) -> str:
        return self.data_dir

    async def ping(self) -> int:
        await self._ready()
        return os.getpid()
