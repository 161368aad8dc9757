"""The Kafka handler's Backend over partition logs in this process, for Ray-free tests of the handler.

What the gateway actor's backend does with the controller and the replicas,
done here with a dict of topics and one :class:`PartitionLog` per partition
(real logs, in a temporary directory): produce appends to the log, fetch
reads it. It serves what the handler's produce path needs (``topic``,
``produce``); the tests check the handler's own decisions against it (what
it refuses before decoding, what it decodes at all) and what reached the
logs.
"""

from __future__ import annotations

import os

from logbus.protocol import kafka_gateway as kg
from logbus.protocol.messages import ProduceResponse
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog


class LogBackend:
    """Topics of partition logs under ``directory``; ``lookups`` counts the handler's ``topic`` calls."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.views: dict[str, kg.TopicView] = {}
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self.lookups = 0

    def create_topic(self, name: str, partitions: int = 1, config: dict | None = None) -> None:
        config = dict(config or {})
        log_config = LogConfig.from_dict(config)
        self.views[name] = kg.TopicView(name, "0" * 32, config, tuple(kg.PartitionView("node", 0, ("node",), ("node",)) for _ in range(partitions)),
                                        log_config.max_message_bytes)
        for p in range(partitions):
            self.logs[(name, p)] = PartitionLog(os.path.join(self.directory, f"{name}-{p}"), log_config)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()

    async def topic(self, name: str) -> kg.TopicView | None:
        self.lookups += 1
        return self.views.get(name)

    def produce(self, topic: str, partition: int, batch: bytes, acks, timeout_ms: int):
        result = self.logs[(topic, partition)].append(batch)
        return _done(ProduceResponse(result.base_offset, result.log_end_offset, 0, result.max_timestamp_ms))


async def _done(value):
    return value
