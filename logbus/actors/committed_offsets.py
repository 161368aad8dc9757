"""Committed offsets of consumer groups: a table in the controller, made durable in ``__consumer_offsets``.

The group service owns one :class:`CommittedOffsets`. A commit is
acknowledged only once its records were appended to the internal, replicated
topic ``__consumer_offsets`` with acks="all"; the table in memory is updated
after that. When the controller starts, the table is rebuilt by reading the
topic from the start (the last record per key wins; a record without a value
deletes the key), so commits survive the controller's restart and the loss of
any single node (with three or more nodes the topic has three replicas).

The topic is compacted (``cleanup.policy=compact``): its replicas keep the
latest record per key and drop tombstones a day after they were written, so
the log, and the read on start, stay proportional to the live commits rather
than to every commit ever made. Deleting a group writes a tombstone for each
of its committed partitions.

The topic is created through the host's ``create_internal_topic``: in the
background when a group is first joined (as Kafka creates it on the first
FindCoordinator), so the first commit finds it serving, or else on first use.

Offsets in transactions (KIP-98). A transactional producer's offsets
(``send_offsets_to_transaction``) are appended as a *transactional* batch of
that producer (its id and epoch, no sequence number, as Kafka's coordinator
writes them), and held as pending per producer id, invisible to readers of
committed offsets, until the transaction's marker on this topic: the
transaction coordinator, once it has written that marker, calls
:meth:`CommittedOffsets.transaction_completed`, which makes them committed
(COMMIT) or drops them (ABORT). On start the table is rebuilt the same way
from the log: a transactional batch's offsets wait for its producer's next
marker, and those with no marker yet are pending again (the restarted
transaction coordinator writes that marker).
"""

from __future__ import annotations

import asyncio
import logging
import time

from logbus.actors.fetcher import reply_async
from logbus.actors.remote import unwrap
from logbus.errors import LeaderNotAvailableError, LogbusError
from logbus.protocol.group_coordinator import (
    GROUP_METADATA_KEY_VERSION,
    OFFSETS_TOPIC,
    OffsetAndMetadata,
    decode_offset_commit_key,
    decode_offset_commit_value,
    offset_commit_key,
    offsets_key_version,
)
from logbus.protocol.messages import FetchRequest, TopicPartition

logger = logging.getLogger(__name__)

OFFSETS_TOPIC_PARTITIONS = 1
OFFSETS_TOPIC_REPLICATION_MAX = 3
OFFSETS_TOPIC_CONFIG = {"segment.bytes": 64 << 20, "min.insync.replicas": 1, "cleanup.policy": "compact"}
LOAD_TIMEOUT_S = 60.0
LOAD_FETCH_BYTES = 16 << 20
COMMIT_RETRY_S = 10.0  # a commit retries a moving or not-yet-leased offsets leader this long
RETRY_BACKOFF_S = 0.1
# Batch attributes (storage/batch_header.py, Kafka's bit positions): a transactional producer's batch, a marker.
TRANSACTIONAL_BIT = 0x10
CONTROL_BIT = 0x20

Key = tuple[str, str, int]  # (group id, topic, partition)


class CommittedOffsets:
    """The committed offset of every (group, topic, partition), loaded once and kept durable."""

    def __init__(self, host) -> None:
        self._host = host  # the controller's GroupHost side (see group_service.GroupHost)
        self.table: dict[Key, OffsetAndMetadata] = {}
        self.pending: dict[int, dict[Key, OffsetAndMetadata]] = {}  # producer id -> offsets of its open transaction
        self._loaded: asyncio.Event | None = None
        self._creating: asyncio.Task | None = None  # the topic's creation started by prepare(), while it runs

    def get(self, group_id: str, tp: TopicPartition) -> OffsetAndMetadata | None:
        return self.table.get((group_id, tp.topic, tp.partition))

    def partitions_of(self, group_id: str) -> set[TopicPartition]:
        return {TopicPartition(t, p) for (g, t, p) in self.table if g == group_id}

    def group_ids(self) -> set[str]:
        return {g for g, _, _ in self.table}

    async def ready(self) -> None:
        """Make sure the table was rebuilt from ``__consumer_offsets`` once."""
        if self._loaded is None:
            self._loaded = asyncio.Event()
            try:
                await self._load()
            finally:
                self._loaded.set()
        await self._loaded.wait()

    async def _load(self) -> None:
        if OFFSETS_TOPIC not in self._host.partition_counts():
            return
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            try:
                self.table, self.pending = await self._read_all()
                return
            except Exception as error:  # noqa: BLE001 (a leader moving or restarting: retry until the deadline)
                cause = unwrap(error)
                if time.monotonic() > deadline:
                    logger.error("could not read %s: %r", OFFSETS_TOPIC, cause)
                    raise LeaderNotAvailableError(f"committed offsets are not readable yet: {cause!r}") from None
                await asyncio.sleep(0.2)

    async def _read_all(self) -> tuple[dict[Key, OffsetAndMetadata], dict[int, dict[Key, OffsetAndMetadata]]]:
        from logbus.storage import record_batch as rb  # noqa: PLC0415 (see _append)

        leader = self._host.leader_handle(OFFSETS_TOPIC, 0)
        offset, high_watermark, _ = await asyncio.wait_for(leader.offsets.remote(), 10)
        table: dict[Key, OffsetAndMetadata] = {}
        pending: dict[int, dict[Key, OffsetAndMetadata]] = {}
        while offset < high_watermark:  # (a compacted log: a reply may start past the offset asked for)
            meta, data = await asyncio.wait_for(reply_async(leader.fetch.remote(FetchRequest(offset, LOAD_FETCH_BYTES))), 30)
            if data is None:
                break
            for header, _, records in rb.slice_batches(data, offset, high_watermark):
                if header.attributes & CONTROL_BIT:  # a transaction's marker: its offsets take effect, or not
                    commit, _ = rb.control_record(records)
                    done = pending.pop(header.producer_id, {})
                    if commit:
                        _apply(table, done)
                    continue
                target = pending.setdefault(header.producer_id, {}) if header.attributes & TRANSACTIONAL_BIT else table
                for key, value in zip(records.column("key").to_pylist(), records.column("value").to_pylist()):
                    if offsets_key_version(key) >= GROUP_METADATA_KEY_VERSION:
                        continue  # Kafka's group metadata records (logbus keeps its groups in groups.json)
                    group_id, tp = decode_offset_commit_key(key)
                    if value is None:
                        if target is table:
                            table.pop((group_id, tp.topic, tp.partition), None)
                        else:
                            target[(group_id, tp.topic, tp.partition)] = None
                    else:
                        decoded = decode_offset_commit_value(value)
                        target[(group_id, tp.topic, tp.partition)] = OffsetAndMetadata(decoded.offset, decoded.metadata, decoded.leader_epoch)
            offset = meta.next_offset
        return table, pending

    async def ensure_topic(self) -> None:
        """Create ``__consumer_offsets`` now if it does not exist (Kafka tools expect to find it)."""
        await self._ensure_topic()

    def prepare(self) -> None:
        """Start creating the topic in the background if it does not exist yet (a group's first join),
        so that the group's first commit does not wait for a new topic's replicas to start."""
        if self._creating is None and OFFSETS_TOPIC not in self._host.partition_counts():
            self._creating = asyncio.ensure_future(self._ensure_topic())
            self._creating.add_done_callback(self._prepared)

    def _prepared(self, task: asyncio.Task) -> None:
        self._creating = None
        if not task.cancelled() and task.exception() is not None:
            logger.warning("creating %s failed (the first commit tries again): %s", OFFSETS_TOPIC, task.exception())

    async def _ensure_topic(self) -> None:
        creating = self._creating
        if creating is not None and creating is not asyncio.current_task():
            await asyncio.wait([creating])  # its failure is logged; the checks below then try again
        if OFFSETS_TOPIC in self._host.partition_counts():
            return
        replication = min(OFFSETS_TOPIC_REPLICATION_MAX, max(1, self._host.live_node_count()))
        try:
            await self._host.create_internal_topic(OFFSETS_TOPIC, OFFSETS_TOPIC_PARTITIONS, replication, OFFSETS_TOPIC_CONFIG)
        except LogbusError:
            if OFFSETS_TOPIC not in self._host.partition_counts():
                raise
            # created concurrently: fine

    async def commit(self, group_id: str, records: list[tuple[bytes, bytes]], offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """Append offset-commit ``records`` with acks='all', then record ``offsets``; raise (retriable) if that fails."""
        await self._append(records)
        for tp, om in offsets.items():
            self.table[(group_id, tp.topic, tp.partition)] = om

    async def commit_transactional(
        self, producer_id: int, producer_epoch: int, group_id: str, records: list[tuple[bytes, bytes]], offsets: dict
    ) -> None:
        """Append offset-commit ``records`` as a transactional batch of the producer (acks='all'); the
        ``offsets`` stay pending until :meth:`transaction_completed` for that producer.

        They are recorded as pending before the append: if the transaction is
        completed while the append is on its way, the completion sees them (an
        abort drops them; the leader refuses a late batch from a fenced epoch).
        """
        from logbus.storage import record_batch as rb  # noqa: PLC0415 (see _append)

        entries = {(group_id, tp.topic, tp.partition): om for tp, om in offsets.items()}
        pending = self.pending.setdefault(producer_id, {})
        before = {key: pending[key] for key in entries if key in pending}
        pending.update(entries)
        batch = rb.encode_batch(
            [v for _, v in records], [k for k, _ in records],
            producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=rb.NO_SEQUENCE, transactional=True,
        )
        try:
            await self._append_batch(batch)
        except BaseException:
            current = self.pending.get(producer_id)
            if current is pending:  # still the same transaction's: undo this call's offsets
                for key, om in entries.items():
                    if key in before:
                        current[key] = before[key]
                    elif current.get(key) is om:
                        del current[key]
            raise

    def transaction_completed(self, producer_id: int, commit: bool) -> None:
        """The marker of ``producer_id``'s transaction is on ``__consumer_offsets``: its pending offsets
        become committed (commit) or are dropped (abort)."""
        done = self.pending.pop(producer_id, None)
        if commit and done:
            _apply(self.table, done)

    async def delete_group(self, group_id: str) -> list[TopicPartition]:
        """Delete every committed offset of ``group_id``: a tombstone per partition, appended with
        acks='all', then the entries here. Returns the partitions whose offsets went."""
        return await self.delete_partitions(group_id, sorted(self.partitions_of(group_id)))

    async def delete_partitions(self, group_id: str, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Delete the committed offsets of ``partitions`` of ``group_id`` (those it has): tombstones, then
        the entries here. Returns the partitions whose offsets went."""
        partitions = [tp for tp in partitions if (group_id, tp.topic, tp.partition) in self.table]
        if not partitions:
            return []
        await self._append([(offset_commit_key(group_id, tp), None) for tp in partitions])
        for tp in partitions:
            self.table.pop((group_id, tp.topic, tp.partition), None)
        return partitions

    async def _append(self, records: list[tuple[bytes, bytes | None]]) -> None:
        """Append records to ``__consumer_offsets`` with acks='all'; raise (retriable) if that fails."""
        # Arrow is imported here, not with the module: a leader with followers imports this module
        # (it calls the controller to change its ISR, and Ray loads the controller's class for a
        # handle to it), and has no use for Arrow.
        from logbus.storage import record_batch as rb  # noqa: PLC0415

        await self._append_batch(rb.encode_batch([v for _, v in records], [k for k, _ in records]))

    async def _append_batch(self, batch: bytes) -> None:
        await self.ensure_topic()
        deadline = time.monotonic() + COMMIT_RETRY_S
        while True:
            # A fresh or moving offsets leader refuses writes until its lease is confirmed: retry briefly.
            try:
                leader = self._host.leader_handle(OFFSETS_TOPIC, 0)
                await asyncio.wait_for(leader.produce.remote(batch, "all"), 30)
                break
            except Exception as error:  # noqa: BLE001 (Ray errors mean the offsets leader is moving)
                cause = unwrap(error)
                retriable = isinstance(cause, LogbusError) and cause.retriable
                if not retriable or time.monotonic() > deadline:
                    raise cause from None
                await asyncio.sleep(RETRY_BACKOFF_S)


def _apply(table: dict, offsets: dict) -> None:
    """Apply offsets to ``table`` (a None deletes the key)."""
    for key, om in offsets.items():
        if om is None:
            table.pop(key, None)
        else:
            table[key] = om
