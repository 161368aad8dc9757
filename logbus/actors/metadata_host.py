"""What the controller's parts share of it: the metadata, its lock, the nodes and a partition's replicas.

:class:`MetadataHost` is the common base of the interfaces the parts are
written against (``replica_moves.MoveHost``, ``topic_admin.TopicAdminHost``,
``client_metadata.ClientHost``); the controller serves it
(``tests/actors/test_controller_parts.py`` checks). The node table's part
has its own, smaller interface (``cluster_nodes.NodeHost``): the other
parts reach the nodes through the controller.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from logbus.protocol.cluster_metadata import ClusterMetadata, TopicState
from logbus.protocol.placement import NodeLoad


class MetadataHost(Protocol):
    """The metadata, its lock, the nodes, and a partition's replicas: what every controller part needs."""

    metadata: ClusterMetadata

    @property
    def lock(self) -> asyncio.Lock:
        """Held around every metadata change."""

    async def refresh_nodes(self) -> None:
        """Look through Ray's nodes now (nodes just added, hosts to check)."""

    def live_nodes(self) -> list[str]:
        """The nodes that may host replicas now."""

    def loads(self) -> list[NodeLoad]:
        """What placement knows of the live nodes, draining ones left out."""

    def metadata_changed(self) -> None:
        """Persist the metadata, and send every node whose fence epochs changed its new table. Under the lock."""

    def replica_handle(self, topic: TopicState, partition: int, replica_id: int):
        """A replica's actor handle, created if needed; ReplicaNotAvailableError when its node is away."""

    def handle_or_none(self, topic: TopicState, partition: int, replica_id: int | None):
        """A replica's actor handle, or None when it has none or its node is away."""

    async def start_partition(self, topic: TopicState, partition: int) -> None:
        """Start a partition's replica actors, fence its epoch, and tell each its role."""

    async def check_partitions(self, partitions: set[tuple[str, int]]) -> object:
        """Elect where a leader is missing or gone, replace replicas long gone."""
