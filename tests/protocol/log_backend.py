"""The Kafka handler's Backend over partition logs in this process, for Ray-free tests of the handler.

What the gateway actor's backend does with the controller and the replicas,
done here with a dict of topics and one :class:`PartitionLog` per partition
(real logs, in a temporary directory): produce appends to the log, fetch
reads it, waiting for an append as a leader's long poll does. It serves
what the handler's produce and fetch paths need (``topic``, ``produce``,
``fetch``); the tests check the handler's own decisions against it (what it
refuses before decoding, where it waits for data) and what reached the logs.
"""

from __future__ import annotations

import asyncio
import os

from logbus.protocol import kafka_gateway as kg
from logbus.protocol.messages import FetchResponse, ProduceResponse
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog


class LogBackend:
    """Topics of partition logs under ``directory``; ``lookups`` counts the handler's ``topic`` calls,
    ``waits`` holds each fetch that found nothing and waits for an append (topic, partition, offset),
    and ``on_wait``, if a test sets an Event there, is set when one starts waiting."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.views: dict[str, kg.TopicView] = {}
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self.lookups = 0
        self.waits: list[tuple[str, int, int]] = []
        self.on_wait: asyncio.Event | None = None
        self._appended: asyncio.Event | None = None  # made on the loop of the first fetch that waits

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
        self.appended()
        return _done(ProduceResponse(result.base_offset, result.log_end_offset, 0, result.max_timestamp_ms))

    def appended(self) -> None:
        """Wake the fetches waiting for data (after an append to one of the logs)."""
        if self._appended is not None:
            self._appended.set()
            self._appended = None

    async def fetch(self, topic: str, partition: int, offset: int, max_bytes: int, max_wait_ms: int, isolation_level: int = 0):
        assert isolation_level == 0, "these logs serve read_uncommitted fetches only"
        log = self.logs[(topic, partition)]
        deadline = asyncio.get_running_loop().time() + max_wait_ms / 1000
        while True:
            result = log.read(offset, max_bytes)
            if result is not None:
                meta = FetchResponse(result.first_offset, result.next_offset, log.log_end_offset, log.log_start_offset, 0)
                return meta, bytes(result.data)
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return FetchResponse(offset, offset, log.log_end_offset, log.log_start_offset, 0), None
            if self._appended is None:
                self._appended = asyncio.Event()
            appended = self._appended
            self.waits.append((topic, partition, offset))
            if self.on_wait is not None:
                self.on_wait.set()
            try:
                await asyncio.wait_for(appended.wait(), remaining)
            except asyncio.TimeoutError:
                pass


async def _done(value):
    return value
