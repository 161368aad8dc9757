"""Topic administration in the controller: create, delete, list and describe topics, add partitions, alter configs, delete records.

The controller creates one :class:`TopicAdmin` and forwards its Ray methods
``create_topic``, ``delete_topic``, ``list_topics``, ``describe_topic``,
``create_partitions``, ``alter_config`` and ``delete_records`` to it (and
creates ``__consumer_offsets`` and ``__transaction_state`` through it). It
reaches the controller through the small :class:`TopicAdminHost` interface:
the metadata and its lock, the nodes, and the replica lifecycle (start a
partition's replicas, retire replicas, elect).

The rules of a topic (names, counts, configs, where its replicas go) are
``ClusterMetadata``'s and placement's; this module orders the steps around
them: the metadata changes under the lock and is persisted before any
replica hears of it, replicas start after, and a deleted topic's replicas
delete their files before the call returns. Every method runs on the
controller's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from logbus.actors.metadata_host import MetadataHost
from logbus.actors.placement import SlotReservation, autoscaler_replica_capacity
from logbus.actors.remote import unwrap
from logbus.errors import (
    InvalidPartitionError,
    InvalidReplicationFactorError,
    NodeCapacityError,
    RequestTimedOutError,
)
from logbus.protocol.cluster_metadata import TopicState
from logbus.protocol.group_coordinator import OFFSETS_TOPIC
from logbus.protocol.messages import PartitionInfo, TopicDescription, TopicPartition

TOPIC_DELETE_TIMEOUT_S = 600.0  # a deleted topic's replica deleting its files (a large log, a cleaning to stop)
LEADER_CALL_TIMEOUT_S = 60.0  # a leader that does not answer delete_records in this long: RequestTimedOutError
OFFSETS_CALL_TIMEOUT_S = 10.0  # a leader that does not report its offsets in this long shows -1 in a description


class TopicAdminHost(MetadataHost):
    """What topic administration needs of the controller."""

    def leader_handle(self, topic: str, partition: int):
        """A partition's leader's handle; UnknownTopicError, or LeaderNotAvailableError while it has none."""

    async def retire_replicas(
        self, replicas: list[tuple[TopicState, int, int, str]], delete_timeout_s: float, topic_deleted: bool = False
    ) -> None:
        """End replicas (topic, partition, replica id, node id): their files (within ``delete_timeout_s``), actors, fence entries."""

    async def reserve_nodes(self, what: str, partitions: int, replication_factor: int, timeout_s: float) -> SlotReservation:
        """Ask the autoscaler for replica slots on distinct nodes; NodeCapacityError if they do not come in ``timeout_s``."""


class TopicAdmin:
    """Topics' lifecycle and settings, over a :class:`TopicAdminHost` (see the module docstring)."""

    def __init__(self, host: TopicAdminHost, topics_changed: Callable[[], None]) -> None:
        self._host = host
        self._topics_changed = topics_changed  # the group service's: a topic made, deleted or grown

    async def create_topic(self, name: str, partitions: int, replication_factor: int, config: dict | None, timeout_s: float,
                           internal: bool = False) -> None:
        """Create a topic and start its replicas; returns once every replica serves.

        When the cluster's nodes cannot hold it and an autoscaler may add
        nodes with replica slots, the replicas become pending demand that the
        autoscaler answers (up to ``timeout_s``); an ``internal`` topic, or a
        cluster without such an autoscaler, fails at once.
        """
        host = self._host
        reserved = None
        await host.refresh_nodes()
        async with host.lock:
            try:
                topic = host.metadata.create_topic(name, partitions, replication_factor, config, host.live_nodes(), loads=host.loads())
            except (NodeCapacityError, InvalidReplicationFactorError):
                if internal or autoscaler_replica_capacity() == 0:
                    raise
                host.metadata.check_new_topic(name, partitions, replication_factor, config)
                topic = None
        if topic is None:
            # More nodes are needed: ask the autoscaler for them (the lock is not held meanwhile).
            reserved = await host.reserve_nodes(f"topic {name!r}", partitions, replication_factor, timeout_s)
            async with host.lock:
                try:
                    topic = host.metadata.create_topic(
                        name, partitions, replication_factor, config, host.live_nodes(), placements=reserved.placements
                    )
                except BaseException:
                    reserved.release()
                    raise
        try:
            async with host.lock:
                host.metadata_changed()
                self._topics_changed()
            # Start every replica actor concurrently: each is a process that takes a while to boot.
            starts = [host.start_partition(topic, p) for p in range(partitions)]
            if reserved is not None:
                for p in range(partitions):  # the actors exist (pending on their slots): free the slots for them
                    for r in topic.partitions[p].replicas:
                        host.replica_handle(topic, p, r)
                reserved.release()
            await asyncio.gather(*starts)
        finally:
            if reserved is not None:
                reserved.release()

    async def delete_topic(self, name: str) -> None:
        """Delete a topic (the internal one too: the caller decides which may be): its metadata, then its replicas and files."""
        host = self._host
        async with host.lock:
            topic = host.metadata.delete_topic(name)
            host.metadata_changed()
            self._topics_changed()
        # A deleted topic's replicas get long to delete their files: a topic made again under the same
        # name reuses the replicas' directories, so files left behind would come back as its records.
        await host.retire_replicas(
            [(topic, p, r, state.nodes[str(r)]) for p, state in enumerate(topic.partitions) for r in state.replicas],
            delete_timeout_s=TOPIC_DELETE_TIMEOUT_S,
            topic_deleted=True,
        )

    def list_topics(self, include_internal: bool = False) -> list[str]:
        """Every topic's name, sorted; ``__consumer_offsets`` only if ``include_internal``."""
        return sorted(name for name in self._host.metadata.topics if include_internal or name != OFFSETS_TOPIC)

    async def describe_topic(self, name: str) -> TopicDescription:
        """A topic's partitions (leader, replicas, ISR, epoch, and the leader's offsets, -1 where it did not answer) and config."""
        host = self._host
        topic = host.metadata.topic(name)

        async def leader_offsets(p, state):
            if state.leader is None:
                return None
            return await asyncio.wait_for(host.replica_handle(topic, p, state.leader).offsets.remote(), OFFSETS_CALL_TIMEOUT_S)

        offsets = await asyncio.gather(*(leader_offsets(p, s) for p, s in enumerate(topic.partitions)), return_exceptions=True)
        infos = []
        for p, (state, found) in enumerate(zip(topic.partitions, offsets)):
            start, high_watermark, end = found if isinstance(found, tuple) else (-1, -1, -1)
            infos.append(
                PartitionInfo(name, p, state.leader, tuple(state.replicas), tuple(state.isr), state.leader_epoch, start, high_watermark, end)
            )
        return TopicDescription(name, tuple(infos), dict(topic.config))

    async def create_partitions(self, name: str, total: int) -> TopicDescription:
        """Grow a topic to ``total`` partitions, placed by load; returns its description once the new ones serve."""
        host = self._host
        await host.refresh_nodes()
        async with host.lock:
            added = host.metadata.create_partitions(name, total, host.live_nodes(), loads=host.loads())
            topic = host.metadata.topic(name)
            host.metadata_changed()
            self._topics_changed()
        await asyncio.gather(*(host.start_partition(topic, p) for p in added))
        return await self.describe_topic(name)

    async def alter_config(self, name: str, config: dict | None, delete: list[str] | None = None) -> dict:
        """Set topic config overrides, and remove those named in ``delete`` (back to the defaults);
        returns the topic's overrides. Every replica applies them before this returns."""
        host = self._host
        async with host.lock:
            overrides = host.metadata.alter_config(name, config, delete)  # an error changes nothing
            host.metadata_changed()  # the replicas and epochs are as they were: this persists
            topic = host.metadata.topic(name)
        # unclean.leader.election.enable may now let a leaderless partition elect an out-of-sync
        # replica: at once, before the replicas (one of them perhaps paused) are told the new config.
        await host.check_partitions({(name, p) for p in range(len(topic.partitions))})
        # A replica whose node is away is told when it starts there again (it is created with the topic's config).
        handles = [host.handle_or_none(topic, p, r) for p, state in enumerate(topic.partitions) for r in state.replicas]
        await asyncio.gather(*(h.update_config.remote(overrides) for h in handles if h is not None))
        return dict(overrides)

    async def delete_records(self, offsets: dict) -> dict:
        """Kafka's DeleteRecords: ``{(topic, partition): offset}`` (-1: the high watermark) -> each
        partition's new log start offset, moved by its leader (its followers follow). Every partition
        is tried; the first error (an offset past the high watermark, no leader) is raised after."""
        host = self._host
        tps = []
        for tp, offset in offsets.items():
            topic, partition = tp
            state_topic = host.metadata.topic(topic)
            if not 0 <= partition < len(state_topic.partitions):
                raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{len(state_topic.partitions) - 1}, not {partition}")
            tps.append((TopicPartition(topic, partition), offset))

        async def one(tp, offset):
            leader = host.leader_handle(tp.topic, tp.partition)
            try:
                return await asyncio.wait_for(leader.delete_records.remote(offset), LEADER_CALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RequestTimedOutError(f"{tp.topic}-{tp.partition}: its leader did not answer delete_records "
                                           f"within {LEADER_CALL_TIMEOUT_S:.0f} s") from None

        found = await asyncio.gather(*(one(tp, offset) for tp, offset in tps), return_exceptions=True)
        for result in found:
            if isinstance(result, BaseException):
                raise unwrap(result)
        return {tp: start for (tp, _), start in zip(tps, found)}
