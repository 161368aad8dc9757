"""Producer: buffers records per partition, closes them into Arrow batches, and sends them to leaders.

``send()`` does only per-record bookkeeping (type checks, the partition, list
appends); the work that can be done per batch (building Arrow arrays, framing,
the CRC) happens when a batch closes, in a background sender thread, in a few
C-level calls. A batch closes when it reaches ``batch_size_bytes`` (full
batches use up to ``max_in_flight`` requests per partition), or once it is
``linger_ms`` old and its partition has no request in flight (until then
later records join it, so ``linger_ms=0`` sends at once when the partition
is idle and batches under load, like Nagle's algorithm). The
buffer holds at most ``buffer_memory_bytes``: a full buffer blocks
``send()`` up to ``max_block_ms``, then raises BufferExhaustedError.
Nothing sent is silently dropped: every record's future either resolves to
its RecordMetadata or raises.

Partitioning matches Kafka's Java client: murmur2(key) % partitions for keyed
records (same key, same partition); keyless records stick to one partition
per batch, chosen anew each time a batch closes.

Retries: retriable errors (a leader that died or moved, a timeout) are
retried after a metadata refresh until ``delivery_timeout_ms``. Without
idempotence a retry can write a batch twice, as in Kafka.
"""

from __future__ import annotations

import math
import pickle
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from confluent_kafka import murmur2

from logbus.actors.remote import get, unwrap
from logbus.api.client import Bus, TopicMetadata
from logbus.errors import (
    BufferExhaustedError,
    ChannelClosedError,
    IllegalStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    LeaderNotAvailableError,
    LogbusError,
    RecordTooLargeError,
    RequestTimedOutError,
)
from logbus.actors.channel_client import channels as local_channels
from logbus.protocol.local_channel import CHANNEL_PRODUCE_MAX_BYTES, PRODUCE
from logbus.protocol.messages import PRODUCE_INLINE_MAX_BYTES, PRODUCE_TIMEOUT_MS_DEFAULT, RecordMetadata
from logbus.storage import record_batch as rb
from logbus.storage.names import validate_topic_name

BATCH_OVERHEAD_BYTES = 4096  # headroom under max.message.bytes for the frame and Arrow metadata
RECORD_OVERHEAD_BYTES = 20  # per record in an Arrow batch: offsets, timestamp, validity
RETRY_BACKOFF_S = 0.1
STALE_AFTER_S = 0.25  # a request unanswered this long makes the sender check whether its leader moved
STALE_CHECK_INTERVAL_S = 0.1
ACKS = (0, 1, "all", -1)
IDEMPOTENT_IN_FLIGHT_MAX = 5  # the leader remembers this many batches per producer for de-duplication
TIMESTAMP_MS_MAX = 2**63 - 1  # timestamps are int64 in the batch
# Bounds of the settings: sizes and counts are positive ints; the others are times in ms, at most
# about 24.8 days (Kafka's int timeouts), which keeps every wait within what threading's waits and
# the replica's timers take.
SIZE_SETTINGS = ("batch_size_bytes", "buffer_memory_bytes", "max_in_flight")
MS_SETTING_MAX = 2**31 - 1
ZERO_ALLOWED = ("linger_ms", "max_block_ms")  # the times that may be 0


@dataclass(frozen=True)
class BatchMetadata:
    """Where a bulk-sent batch landed: records ``base_offset`` .. ``base_offset + record_count - 1``."""

    topic: str
    partition: int
    base_offset: int
    record_count: int


class _Batch:
    __slots__ = (
        "topic", "partition", "values", "keys", "headers", "timestamps", "size_bytes", "created_s",
        "future", "encoded", "record_count", "attempts", "deadline_s", "not_before_s", "records", "order",
        "sent_s", "leader_id",
    )

    def __init__(self, topic: str, partition: int, now_s: float, delivery_timeout_s: float) -> None:
        self.topic = topic
        self.partition = partition
        self.values: list = []
        self.keys: list = []
        self.headers: list | None = None
        self.timestamps: list = []
        self.size_bytes = 0
        self.created_s = now_s
        self.future: Future = Future()
        self.encoded: bytes | None = None
        self.record_count = 0
        self.attempts = 0
        self.deadline_s = now_s + delivery_timeout_s
        self.not_before_s = 0.0
        self.records = None  # an Arrow batch to frame at dispatch (send_table)
        self.order = 0  # dispatch order within the producer: retries keep it
        self.sent_s = 0.0  # when the current attempt was sent
        self.leader_id = None  # the actor id the current attempt went to


class _RecordFuture(Future):
    """The future of one record: a view on its batch's future (creating a full Future per record is costly)."""

    def __init__(self, batch: _Batch, index: int, timestamp_ms: int) -> None:  # noqa: D107 (no super().__init__: state is the batch's)
        self._batch = batch
        self._index = index
        self._timestamp_ms = timestamp_ms

    def _metadata(self, base_offset: int) -> RecordMetadata:
        offset = -1 if base_offset < 0 else base_offset + self._index
        return RecordMetadata(self._batch.topic, self._batch.partition, offset, self._timestamp_ms)

    def result(self, timeout=None) -> RecordMetadata:
        return self._metadata(self._batch.future.result(timeout))

    def exception(self, timeout=None):
        return self._batch.future.exception(timeout)

    def done(self) -> bool:
        return self._batch.future.done()

    def running(self) -> bool:
        return not self._batch.future.done()

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False  # a record handed to the producer is on its way

    def add_done_callback(self, fn) -> None:
        self._batch.future.add_done_callback(lambda _: fn(self))

    def set_result(self, result) -> None:
        raise IllegalStateError("a record future is completed by the producer")

    set_exception = set_result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<RecordFuture {self._batch.topic}-{self._batch.partition}[{self._index}] {state}>"


def _check_setting(name: str, value) -> None:
    """Raise InvalidConfigError unless ``value`` is legal for the numeric producer setting ``name``."""
    if name in SIZE_SETTINGS:
        legal = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not legal:
            raise InvalidConfigError(f"{name} must be a positive int, not {value!r}")
        return
    legal = (
        isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        and 0 <= value <= MS_SETTING_MAX and (value > 0 or name in ZERO_ALLOWED)
    )
    if not legal:
        low = "a non-negative" if name in ZERO_ALLOWED else "a positive"
        raise InvalidConfigError(f"{name} must be {low} number of ms, at most {MS_SETTING_MAX}, not {value!r}")


def _as_bytes(value, what: str):
    if value is None or type(value) is bytes:
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as error:  # lone surrogates
            raise InvalidRecordError(f"{what} is a str that is not valid UTF-8: {error}") from None
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidRecordError(f"{what} must be bytes, str or None, not {type(value).__name__}")


class Producer:
    """Sends records to topics. Thread-safe: many threads may call send() on one producer.

    Args:
        bus: from :func:`logbus.connect`.
        acks: 0 (no reply awaited), 1 (the leader wrote it) or "all" (every in-sync replica has it).
        linger_ms: how long a batch may wait for more records before it is sent.
        batch_size_bytes: a batch is sent once it holds this many bytes.
        buffer_memory_bytes: bound on bytes buffered and in flight; send() blocks beyond it.
        compression: None, "lz4" or "zstd" (Arrow IPC body compression).
        max_in_flight: batches in flight per partition (at most 5 with idempotence, as in Kafka;
            1 without it, which alone keeps a partition's records in send order).
        enable_idempotence: give every batch a producer id and per-partition sequence numbers, so
            retries (after a timeout or a leader failover) never write a record twice. On by
            default unless acks=0 (which gets no replies to retry on).
        max_block_ms: how long send() may block on a full buffer before raising BufferExhaustedError.
        delivery_timeout_ms: bound on the time from send() to success or failure, retries included.
        request_timeout_ms: how long one produce request may take before it is retried.
        local_channel: send batches to a leader on this node over its local channel (a Unix
            socket; a tenth of an actor call's latency, and no copy into the object store) rather
            than as actor calls. Batches over 32 MiB, and leaders on other nodes, use actor calls.
    """

    def __init__(
        self,
        bus: Bus,
        acks: int | str = 1,
        linger_ms: float = 5,
        batch_size_bytes: int = 1 << 20,
        buffer_memory_bytes: int = 64 << 20,
        compression: str | None = None,
        max_in_flight: int = 5,
        max_block_ms: float = 60_000,
        delivery_timeout_ms: float = 120_000,
        request_timeout_ms: float = 30_000,
        enable_idempotence: bool | None = None,
        local_channel: bool = True,
    ) -> None:
        if not isinstance(bus, Bus):
            raise InvalidConfigError(f"bus must be a Bus from logbus.connect(), not {type(bus).__name__}")
        if acks.__class__ not in (int, str) or acks not in ACKS:  # not True or 1.0, which equal 1
            raise InvalidConfigError(f"acks must be 0, 1, 'all' or -1, not {acks!r}")
        if not (compression is None or isinstance(compression, str)) or compression not in rb.COMPRESSION_CODES:
            raise InvalidConfigError(f"compression must be None, 'lz4' or 'zstd', not {compression!r}")
        settings = {
            "linger_ms": linger_ms, "batch_size_bytes": batch_size_bytes, "buffer_memory_bytes": buffer_memory_bytes,
            "max_in_flight": max_in_flight, "max_block_ms": max_block_ms, "delivery_timeout_ms": delivery_timeout_ms,
            "request_timeout_ms": request_timeout_ms,
        }
        for name, value in settings.items():
            _check_setting(name, value)
        for name, value in (("enable_idempotence", enable_idempotence), ("local_channel", local_channel)):
            if not (isinstance(value, bool) or (value is None and name == "enable_idempotence")):
                raise InvalidConfigError(f"{name} must be True or False, not {value!r}")
        if enable_idempotence and acks == 0:
            raise InvalidConfigError("enable_idempotence needs acks=1 or 'all': acks=0 gets no replies to retry on")
        if enable_idempotence is None:
            enable_idempotence = acks != 0
        if enable_idempotence and max_in_flight > IDEMPOTENT_IN_FLIGHT_MAX:
            raise InvalidConfigError(f"max_in_flight must be at most {IDEMPOTENT_IN_FLIGHT_MAX} with idempotence")
        self.enable_idempotence = bool(enable_idempotence)
        if not self.enable_idempotence:
            # Without sequence numbers the leader cannot restore the order of concurrent
            # requests (Ray may start them out of order): keep one in flight per partition.
            max_in_flight = 1
        self._producer_id = rb.NO_PRODUCER_ID
        self._producer_epoch = rb.NO_PRODUCER_EPOCH
        self._next_sequence: dict[tuple[str, int], int] = {}
        self._order = 0
        self._bus = bus
        self.acks = "all" if acks == -1 else acks
        self.linger_s = linger_ms / 1000
        self.batch_size_bytes = int(batch_size_bytes)
        self.buffer_memory_bytes = int(buffer_memory_bytes)
        self.compression = compression
        self.max_in_flight = int(max_in_flight)
        self.max_block_s = max_block_ms / 1000
        self.delivery_timeout_s = delivery_timeout_ms / 1000
        self.request_timeout_s = request_timeout_ms / 1000
        self._topics: dict[str, TopicMetadata] = {}
        self._sticky: dict[str, int] = {}
        self._open: dict[tuple[str, int], _Batch] = {}
        self._ready: deque[_Batch] = deque()
        self._in_flight: dict[tuple[str, int], int] = {}
        self._in_flight_total = 0
        self._buffered_bytes = 0
        self._flushing = 0
        self._closed = False
        self._stopping = False
        self._refresh: set[str] = set()
        self._in_flight_batches: dict[int, _Batch] = {}
        self._last_stale_check_s = 0.0
        # topic -> (partitions, record limit, max.message.bytes, batch limit for send())
        self._limits: dict[str, tuple[int, int, int, int]] = {}
        self._channels = local_channels() if local_channel else None
        self._lock = threading.Lock()
        # send() takes self._lock directly: the same lock, without Condition.__enter__'s Python frame.
        self._condition = threading.Condition(self._lock)
        self._sender = threading.Thread(target=self._run_sender, name="logbus-producer-sender", daemon=True)
        self._sender.start()

    # --- metadata -------------------------------------------------------------------------------

    def _topic(self, topic: str) -> TopicMetadata:
        metadata = self._topics.get(topic)
        if metadata is None:
            metadata = self._bus.topic_metadata(topic)
            self._topics[topic] = metadata
        return metadata

    def partitions_for(self, topic: str) -> list[int]:
        """The partition numbers of ``topic``."""
        return list(range(self._topic(topic).partition_count))

    # --- sending ----------------------------------------------------------------------------------

    def send(self, topic: str, value, key=None, headers=None, partition: int | None = None, timestamp_ms: int | None = None) -> Future:
        """Queue one record; returns a Future of its RecordMetadata.

        ``value`` and ``key`` are bytes, str (UTF-8) or None; ``headers`` a dict
        or a list of (str, bytes) pairs. Raises at once (nothing queued):
        UnknownTopicError (retriable: the topic may be being created),
        InvalidTopicError, InvalidPartitionError (a partition the topic does not
        have), InvalidRecordError (bad types or timestamp), RecordTooLargeError
        (over the topic's max.message.bytes); BufferExhaustedError if the buffer
        stays full.
        """
        if self._closed:
            raise IllegalStateError("send() after close()")
        # The per-record path: type checks, the partition, list appends. Everything else is per batch.
        try:
            limits = self._limits.get(topic)
        except TypeError:  # an unhashable topic: not a name
            validate_topic_name(topic)
            raise
        if limits is None:
            metadata = self._topic(topic)
            record_limit = metadata.config.max_message_bytes - BATCH_OVERHEAD_BYTES
            limits = self._limits[topic] = (
                metadata.partition_count,
                record_limit,
                metadata.config.max_message_bytes,
                min(self.batch_size_bytes, record_limit),
            )
        count, limit, max_message_bytes, batch_limit = limits
        if value.__class__ is not bytes and value is not None:
            value = _as_bytes(value, "value")
        if key.__class__ is not bytes and key is not None:
            key = _as_bytes(key, "key")
        size = RECORD_OVERHEAD_BYTES + (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
        if headers is not None:
            headers = _normalize_headers(headers)
            size += sum(len(k) + (len(v) if v is not None else 0) + 12 for k, v in headers)
        if size > limit:
            raise RecordTooLargeError(
                f"record of about {size} bytes exceeds what a batch of topic {topic!r} can hold "
                f"(max.message.bytes={max_message_bytes})"
            )
        if partition is None:
            if key is not None:
                partition = murmur2(key, count)
            else:
                partition = self._sticky.get(topic)
                if partition is None or partition >= count:
                    partition = self._sticky_partition(topic, count)
        elif partition.__class__ is not int or not 0 <= partition < count:
            raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{count - 1}; partition must be one of them, not {partition!r}")
        if timestamp_ms is None:
            timestamp_ms = time.time_ns() // 1_000_000
        elif timestamp_ms.__class__ is not int or not 0 <= timestamp_ms <= TIMESTAMP_MS_MAX:
            raise InvalidRecordError(f"timestamp_ms must be an int in 0..{TIMESTAMP_MS_MAX}, not {timestamp_ms!r}")
        with self._lock:
            if self._buffered_bytes + size > self.buffer_memory_bytes:
                self._reserve(size)
            else:
                self._buffered_bytes += size
            slot = (topic, partition)
            batch = self._open.get(slot)
            if batch is not None and batch.size_bytes + size > batch_limit:
                self._close_batch(slot)
                batch = None
            new = batch is None
            if new:
                batch = self._open[slot] = _Batch(topic, partition, time.monotonic(), self.delivery_timeout_s)
            index = len(batch.values)
            batch.values.append(value)
            batch.keys.append(key)
            batch.timestamps.append(timestamp_ms)
            if headers is not None:
                if batch.headers is None:
                    batch.headers = [None] * index
                batch.headers.append(headers)
            elif batch.headers is not None:
                batch.headers.append(None)
            batch.size_bytes += size
            if batch.size_bytes >= self.batch_size_bytes:
                self._close_batch(slot)
            elif new:
                self._condition.notify_all()  # the sender times the new batch's linger
        return _RecordFuture(batch, index, timestamp_ms)

    def send_table(self, topic: str, table: pa.Table | pa.RecordBatch) -> Future:
        """Send a pyarrow Table in bulk; returns a Future of a list of BatchMetadata.

        Columns: ``value`` (binary or string), optional ``key``, ``timestamp``
        (int64 ms), ``headers`` (map<string, binary>) and ``partition`` (int).
        Rows without a partition go by key hash, or to one sticky partition.
        Each partition's rows go as one batch, split only where they exceed the
        topic's max.message.bytes. Bad input raises at once, before anything is
        queued: InvalidRecordError (column types, null partitions, negative
        timestamps), InvalidPartitionError (a partition the topic does not have),
        RecordTooLargeError.
        """
        if self._closed:
            raise IllegalStateError("send_table() after close()")
        if not isinstance(table, pa.Table | pa.RecordBatch):
            raise InvalidRecordError(f"send_table takes a pyarrow Table, not {type(table).__name__}")
        metadata = self._topic(topic)
        count = metadata.partition_count
        rows = table.num_rows
        if rows == 0:
            done: Future = Future()
            done.set_result([])
            return done
        records = rb.conform_table(table)  # checks the columns' types first
        timestamps = pc.min_max(records.column(2))
        if timestamps["min"].as_py() < 0:
            raise InvalidRecordError(f"timestamps must be non-negative ms, not {timestamps['min'].as_py()}")
        partitions = self._table_partitions(topic, table, records, count)
        # A table is already a batch: it is split only where it exceeds what one batch of the
        # topic may hold (max.message.bytes), not at batch_size_bytes, which governs send().
        limit = metadata.config.max_message_bytes - BATCH_OVERHEAD_BYTES
        order = np.argsort(partitions, kind="stable")
        sorted_partitions = partitions[order]
        bounds = np.flatnonzero(np.diff(sorted_partitions)) + 1
        batches: list[_Batch] = []
        for chunk in np.split(order, bounds):
            partition = int(partitions[chunk[0]])
            part = records.take(pa.array(chunk)) if len(chunk) != rows else records
            bytes_per_row = max(1, part.nbytes // max(1, part.num_rows))
            step = max(1, limit // bytes_per_row)
            for start in range(0, part.num_rows, step):
                piece = part.slice(start, step)
                if piece.nbytes > limit and piece.num_rows == 1:
                    raise RecordTooLargeError(f"a row of the table exceeds max.message.bytes of topic {topic!r}")
                batch = _Batch(topic, partition, time.monotonic(), self.delivery_timeout_s)
                batch.records = piece
                batch.record_count = piece.num_rows
                batch.size_bytes = piece.nbytes
                batches.append(batch)
        with self._condition:
            for batch in batches:
                self._reserve(batch.size_bytes)
                self._ready.append(batch)
                self._condition.notify_all()
        result: Future = Future()
        _gather(batches, result)
        return result

    def _table_partitions(self, topic: str, table, records: pa.RecordBatch, count: int) -> np.ndarray:
        """The partition of each row: the ``partition`` column, else by key, else one sticky partition."""
        names = table.schema.names
        rows = table.num_rows
        if "partition" in names:
            column = table.column("partition")
            if not pa.types.is_integer(column.type):
                raise InvalidRecordError(f"the 'partition' column must hold ints, not {column.type}")
            if column.null_count:
                raise InvalidRecordError(f"the 'partition' column has {column.null_count} nulls")
            partitions = column.to_numpy(zero_copy_only=False)
            if np.any(partitions < 0) or np.any(partitions >= count):
                bad = int(partitions[(partitions < 0) | (partitions >= count)][0])
                raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{count - 1}; the table names partition {bad}")
            return partitions.astype(np.int64)
        if "key" in names:
            keys = records.column(0).to_pylist()  # binary, as conform_table cast it
            sticky = self._sticky_partition(topic, count)
            return np.fromiter((sticky if k is None else murmur2(k, count) for k in keys), np.int64, rows)
        partition = self._sticky_partition(topic, count)
        self._sticky.pop(topic, None)  # the next keyless table goes to another partition
        return np.full(rows, partition, np.int64)

    def _sticky_partition(self, topic: str, count: int) -> int:
        partition = self._sticky.get(topic)
        if partition is None or partition >= count:
            partition = self._sticky[topic] = random.randrange(count)
        return partition

    def _reserve(self, size: int) -> None:
        """Wait (holding the condition) until ``size`` more bytes fit in the buffer."""
        if self._buffered_bytes + size <= self.buffer_memory_bytes or self._buffered_bytes == 0:
            self._buffered_bytes += size
            return
        deadline = time.monotonic() + self.max_block_s
        self._flushing += 1  # send what is buffered now rather than let it linger
        self._condition.notify_all()
        try:
            while self._buffered_bytes + size > self.buffer_memory_bytes and self._buffered_bytes > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise BufferExhaustedError(
                        f"the producer's buffer ({self.buffer_memory_bytes} bytes) stayed full for {self.max_block_s:.1f}s"
                    )
                self._condition.wait(remaining)
        finally:
            self._flushing -= 1
        self._buffered_bytes += size

    def _close_batch(self, slot: tuple[str, int]) -> None:
        batch = self._open.pop(slot)
        self._ready.append(batch)
        if self._sticky.get(slot[0]) == slot[1] and batch.keys.count(None):
            self._sticky.pop(slot[0], None)  # keyless records move on to another partition
        self._condition.notify_all()

    # --- the sender thread ---------------------------------------------------------------------------

    def _run_sender(self) -> None:
        while True:
            if not ray.is_initialized():
                # Ray was shut down under us: nothing can be delivered any more. Fail what is
                # left (rather than let a Ray call re-attach this process to some cluster).
                self._abandon(IllegalStateError("Ray was shut down before these records were acknowledged"))
                return
            self._expire_stale_requests()
            with self._condition:
                batches, wait_s = self._collect()
                if not batches:
                    if self._stopping and not self._open and not self._ready and not self._in_flight_total:
                        return
                    self._condition.wait(min(wait_s, STALE_CHECK_INTERVAL_S) if self._in_flight_total else wait_s)
                    continue
            for batch in batches:
                self._dispatch(batch)

    def _expire_stale_requests(self) -> None:
        """Fail (as retriable) requests that outlived request_timeout_ms or whose leader was replaced.

        A request to a replica whose node died may never be answered; waiting for
        the timeout alone would stall the partition. So requests older than
        STALE_AFTER_S trigger a metadata refresh, and every in-flight request of
        a partition whose leader changed, young or old, is retried at once
        (oldest first, so sequence numbers reach the new leader in order; safe
        with idempotence).
        """
        now = time.monotonic()
        if now - self._last_stale_check_s < STALE_CHECK_INTERVAL_S:
            return
        self._last_stale_check_s = now
        with self._condition:
            old = [b for b in self._in_flight_batches.values() if now - b.sent_s > STALE_AFTER_S]
        if not old:
            return
        leaders = {}
        for topic in {b.topic for b in old}:
            try:
                self._topics[topic] = metadata = self._bus.topic_metadata(topic, refresh=True)
                leaders[topic] = metadata.leaders
            except LogbusError:
                leaders[topic] = None
        with self._condition:
            candidates = sorted(
                (b for b in self._in_flight_batches.values() if b.topic in leaders), key=lambda b: b.order
            )
        expired = []
        for batch in candidates:
            if now - batch.sent_s > self.request_timeout_s:
                error = RequestTimedOutError(f"no reply from the leader of {batch.topic}-{batch.partition} in {self.request_timeout_s}s")
            else:
                current = leaders.get(batch.topic)
                if current is None:
                    continue  # the controller did not answer: no news about the leader
                leader = current[batch.partition]
                if leader is not None and leader._actor_id == batch.leader_id:
                    continue
                error = LeaderNotAvailableError(f"the leader of {batch.topic}-{batch.partition} changed")
            expired.append((batch, error))
        for batch, error in expired:
            # A batch whose partition has a new leader goes there at once: the metadata is fresh.
            moved = isinstance(error, LeaderNotAvailableError) and leaders[batch.topic][batch.partition] is not None
            self._complete(batch, None, error, attempt=batch.attempts, backoff=not moved)

    def _collect(self) -> tuple[list[_Batch], float]:
        """Under the lock: close lingering batches, then take the ready ones that may go now."""
        now = time.monotonic()
        wait_s = 0.05
        for slot, batch in list(self._open.items()):
            if self._flushing or self._stopping:
                self._close_batch(slot)
                continue
            due = batch.created_s + self.linger_s
            if due > now:
                wait_s = min(wait_s, due - now)
            elif not self._in_flight.get(slot, 0):
                self._close_batch(slot)
            # else: lingered enough, but the partition has a request in flight. A batch that is
            # not full waits for its reply (Nagle's rule), so records arriving meanwhile join it:
            # fewer, larger requests, which is what keeps latency low on busy CPUs. Full batches
            # (closed by send()) still use all max_in_flight slots.
        taken = []
        kept: deque[_Batch] = deque()
        held: set[tuple[str, int]] = set()  # partitions with an earlier batch still waiting
        while self._ready:
            batch = self._ready.popleft()
            slot = (batch.topic, batch.partition)
            if slot in held or self._in_flight.get(slot, 0) >= self.max_in_flight or batch.not_before_s > now:
                # A partition's batches leave in order: one held back (retry backoff, or no
                # slot free) holds back the later ones, so they cannot overtake it at the leader.
                held.add(slot)
                kept.append(batch)
                if batch.not_before_s > now:
                    wait_s = min(wait_s, batch.not_before_s - now)
                continue
            self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
            self._in_flight_total += 1
            if not batch.order:
                self._order += 1
                batch.order = self._order
            batch.attempts += 1
            batch.sent_s = now
            self._in_flight_batches[id(batch)] = batch
            taken.append(batch)
        self._ready = kept
        return taken, max(wait_s, 0.001)

    def _dispatch(self, batch: _Batch) -> None:
        try:
            if batch.topic in self._refresh:
                self._refresh.discard(batch.topic)
                self._topics[batch.topic] = self._bus.topic_metadata(batch.topic, refresh=True)
                self._limits.pop(batch.topic, None)
            if batch.encoded is None:
                self._encode(batch)
            leader = self._topics[batch.topic].leaders[batch.partition]
            if leader is None:
                raise LeaderNotAvailableError(f"{batch.topic}-{batch.partition} has no leader right now")
            batch.leader_id = leader._actor_id
            future = self._send_over_channel(leader, batch.encoded)
            if future is None:
                future = leader.produce.remote(*self._produce_args(batch.encoded)).future()
        except Exception as error:  # noqa: BLE001 (every failure is routed to the batch's future)
            self._complete(batch, None, error, attempt=batch.attempts)
            return
        if self.acks == 0:
            self._complete(batch, -1, None, attempt=batch.attempts)
            return
        attempt = batch.attempts
        future.add_done_callback(lambda future: self._on_reply(batch, future, attempt))

    def _send_over_channel(self, leader, encoded: bytes):
        """The reply's Future if the batch went over the leader's local channel, else None."""
        if self._channels is None or len(encoded) > CHANNEL_PRODUCE_MAX_BYTES:
            return None
        connection = self._channels.connection(leader)
        if connection is None:
            return None
        try:
            # The batch travels out of band: written to the socket as it is, not pickled.
            return connection.call(PRODUCE, (pickle.PickleBuffer(encoded), self.acks, None, int(self.request_timeout_s * 1000)))
        except ChannelClosedError:
            return None  # nothing was sent: the actor call carries it

    def _produce_args(self, encoded: bytes) -> tuple:
        """The arguments of a produce call, kept small: every argument costs time to serialize.

        A batch small enough to travel inside the request goes as bytes (cheaper
        for Ray than an array); a larger one as a uint8 array, which Ray hands to
        the object store without pickling. Trailing arguments equal to the
        replica's defaults are left out.
        """
        payload = encoded if len(encoded) <= PRODUCE_INLINE_MAX_BYTES else np.frombuffer(encoded, np.uint8)
        timeout_ms = int(self.request_timeout_s * 1000)
        if timeout_ms != PRODUCE_TIMEOUT_MS_DEFAULT:
            return payload, self.acks, None, timeout_ms
        return (payload,) if self.acks == 1 else (payload, self.acks)

    def _encode(self, batch: _Batch) -> None:
        """Frame a batch once, at its first dispatch: retries resend the same bytes and sequence numbers."""
        frame = {"compression": self.compression}
        if self.enable_idempotence:
            if self._producer_id == rb.NO_PRODUCER_ID:
                self._producer_id = get(self._bus.controller.allocate_producer_id.remote())
                self._producer_epoch = 0
            slot = (batch.topic, batch.partition)
            count = batch.record_count if batch.records is not None else len(batch.values)
            sequence = self._next_sequence.get(slot, 0)
            self._next_sequence[slot] = sequence + count
            frame.update(producer_id=self._producer_id, producer_epoch=self._producer_epoch, base_sequence=sequence)
        if batch.records is not None:
            batch.encoded = rb.frame_record_batch(batch.records, **frame)
            batch.records = None
        else:
            keys = batch.keys if any(k is not None for k in batch.keys) else None
            batch.encoded = rb.encode_batch(batch.values, keys, batch.timestamps, batch.headers, **frame)
            batch.record_count = len(batch.values)
            batch.values = batch.keys = batch.headers = batch.timestamps = None

    def _on_reply(self, batch: _Batch, future, attempt: int) -> None:
        error = future.exception()
        if error is None:
            self._complete(batch, future.result().base_offset, None, attempt)
        else:
            self._complete(batch, None, unwrap(error), attempt)

    def _complete(
        self, batch: _Batch, base_offset: int | None, error: BaseException | None, attempt: int, backoff: bool = True
    ) -> None:
        with self._condition:
            # Each attempt completes once: a late reply to an attempt that expired is dropped.
            if batch.attempts != attempt or self._in_flight_batches.pop(id(batch), None) is None:
                return
        retry = (
            error is not None
            and isinstance(error, LogbusError)
            and error.retriable
            and time.monotonic() + RETRY_BACKOFF_S < batch.deadline_s
        )
        with self._condition:
            slot = (batch.topic, batch.partition)
            self._in_flight[slot] -= 1
            self._in_flight_total -= 1
            if retry:
                if backoff:
                    batch.not_before_s = time.monotonic() + RETRY_BACKOFF_S
                    self._refresh.add(batch.topic)
                # Retried batches go out again in their first order, ahead of newer ones, so a
                # partition's sequence numbers reach the leader in order.
                retried = sorted([b for b in self._ready if b.order] + [batch], key=lambda b: b.order)
                self._ready = deque(retried + [b for b in self._ready if not b.order])
            else:
                self._buffered_bytes -= batch.size_bytes
            self._condition.notify_all()
        if retry:
            return
        if error is None:
            batch.future.set_result(base_offset)
        else:
            batch.future.set_exception(error)

    def _abandon(self, error: BaseException) -> None:
        """Fail every record not yet acknowledged, and refuse new ones."""
        with self._condition:
            self._closed = True
            batches = list(self._open.values()) + list(self._ready) + list(self._in_flight_batches.values())
            self._open.clear()
            self._ready.clear()
            self._in_flight_batches.clear()
            self._in_flight.clear()
            self._in_flight_total = 0
            self._buffered_bytes = 0
            self._condition.notify_all()
        for batch in batches:
            if not batch.future.done():
                batch.future.set_exception(error)

    # --- flushing and closing ------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything buffered and wait until every record is acknowledged or failed.

        Raises RequestTimedOutError if that takes longer than ``timeout_s`` (None: no limit).
        """
        _check_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            self._flushing += 1
            self._condition.notify_all()
            try:
                while self._open or self._ready or self._in_flight_total:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise RequestTimedOutError(f"flush did not finish within {timeout_s}s")
                    self._condition.wait(0.05 if remaining is None else min(remaining, 0.05))
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then stop the sender thread. Later calls to send() raise IllegalStateError.

        As in Kafka, if ``timeout_s`` passes before everything is acknowledged,
        the records still pending fail (their futures raise RequestTimedOutError)
        and the producer closes anyway.
        """
        _check_timeout(timeout_s)
        if self._closed:
            return
        try:
            self.flush(timeout_s)
        except RequestTimedOutError as error:
            self._abandon(RequestTimedOutError(f"the producer closed before these records were acknowledged: {error}"))
        with self._condition:
            self._closed = True
            self._stopping = True
            self._condition.notify_all()
        self._sender.join(timeout=5)

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_timeout(timeout_s) -> None:
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 <= timeout_s <= threading.TIMEOUT_MAX
    ):
        raise InvalidConfigError(f"timeout_s must be None or a non-negative number of seconds, not {timeout_s!r}")


def _normalize_headers(headers) -> list[tuple[str, bytes | None]]:
    items = headers.items() if isinstance(headers, dict) else headers
    try:
        out = [(k, v if v.__class__ is bytes or v is None else _as_bytes(v, f"header {k!r}")) for k, v in items]
    except InvalidRecordError:
        raise
    except (TypeError, ValueError):
        raise InvalidRecordError(f"headers must be a dict or a list of (str, bytes) pairs, not {headers!r}") from None
    for name, _ in out:
        if not isinstance(name, str):
            raise InvalidRecordError(f"header names must be str, not {type(name).__name__}")
        if not name.isascii():
            try:
                name.encode()
            except UnicodeEncodeError as error:  # lone surrogates: the whole batch could not be encoded
                raise InvalidRecordError(f"header name {name!r} is not valid UTF-8: {error}") from None
    return out


def _gather(batches: list[_Batch], result: Future) -> None:
    """Resolve ``result`` with every batch's metadata once all are done (or with the first error)."""
    remaining = [len(batches)]
    lock = threading.Lock()

    def done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [b.future.exception() for b in batches if b.future.exception() is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result([BatchMetadata(b.topic, b.partition, b.future.result(), b.record_count) for b in batches])

    for batch in batches:
        batch.future.add_done_callback(done)
