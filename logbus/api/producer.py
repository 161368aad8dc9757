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
retried after a metadata refresh until ``delivery_timeout_ms``, each batch
backing off from RETRY_BACKOFF_S doubling up to a second (``logbus/retry.py``,
as Kafka's retry.backoff.ms and retry.backoff.max.ms). Without idempotence a
retry can write a batch twice, as in Kafka.

Futures: ``send()`` returns a :class:`RecordFuture`, a full
``concurrent.futures.Future`` (``wait``, ``as_completed``,
``asyncio.wrap_future``, callbacks, timeouts) with kafka-python's ``get``,
``add_callback`` and ``add_errback``. It is a view on its batch's outcome:
a record costs one small object, and the Future's own state (a Condition and
its lists: about 0.65 µs to make, where all of ``send()`` takes 0.9 µs) is
created only for the records that ``wait``/``as_completed`` are asked about.

Transactions (KIP-98): a producer made with ``transactional_id`` writes
records to several partitions, and consumer offsets, atomically:
``init_transactions()`` once, then ``begin_transaction()``, sends,
``send_offsets_to_transaction()``, and ``commit_transaction()`` or
``abort_transaction()``. Its state machine is
:class:`~logbus.protocol.transaction_manager.TransactionManager`; the
coordinator is the controller's (``logbus/actors/transaction_service.py``).
Before the first batch of a partition goes, the sender adds the partition
to the transaction (partitions met together go in one call), holding that
partition's batches meanwhile. The batches carry the transactional
attribute; ``read_committed`` consumers see them once the COMMIT marker is
written, and never if the transaction aborts.

Idempotence after a failure (KIP-360): once a batch of an idempotent
producer fails for good, its sequence numbers are a hole the leader will
never see filled, so every later batch of that partition would be refused
as out of order. The producer therefore bumps its epoch and starts the
partition again at sequence 0, as soon as nothing of that partition is in
flight: see ``_restart_sequences``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
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
from logbus.bounded_dict import BoundedDict
from logbus.retry import RETRY_BACKOFF_MAX_S, Backoff
from logbus.options import INT32_MAX, INT64_MAX, check_callable, check_choice, check_flag, check_int, check_ms, check_seconds
from logbus.errors import (
    BufferExhaustedError,
    ChannelClosedError,
    IllegalStateError,
    InvalidTxnStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    LeaderNotAvailableError,
    LogbusError,
    OutOfOrderSequenceError,
    RecordTooLargeError,
    RequestTimedOutError,
    SerializationError,
    TransactionAbortedError,
    copy_error,
)
from logbus.actors import metrics
from logbus.actors.channel_client import channels as local_channels
from logbus.protocol.local_channel import CHANNEL_PRODUCE_MAX_BYTES, PRODUCE
from logbus.protocol.messages import PRODUCE_INLINE_MAX_BYTES, PRODUCE_TIMEOUT_MS_DEFAULT, RecordMetadata, TopicPartition
from logbus.protocol.transaction_coordinator import TRANSACTION_TIMEOUT_MS_DEFAULT, validate_transactional_id
from logbus.protocol.transaction_manager import TransactionManager, TxnClientState
from logbus.storage import record_batch as rb
from logbus.storage.names import validate_topic_name

try:  # the per-record path in C, built by pip at install (setup.py); absent, send() runs in Python alone
    from logbus.api import _fastsend
except ImportError:
    _fastsend = None

logger = logging.getLogger(__name__)

BATCH_OVERHEAD_BYTES = 4096  # headroom under max.message.bytes for the frame and Arrow metadata
RECORD_OVERHEAD_BYTES = 20  # per record in an Arrow batch: offsets, timestamp, validity
HEADER_OVERHEAD_BYTES = 12  # per header: its map entry's offsets and validity
# A batch's retry waits at most this long for the metadata refresh it asked for, then goes to the leader
# known (the sender thread never waits longer on a controller that does not answer; Producer._refreshed).
METADATA_WAIT_S = 0.2
METADATA_ANSWER_FRESH_S = 1.0  # a refresh asked for longer ago than this is asked for again once taken
RETRY_BACKOFF_S = 0.1  # a batch's first retry waits this long (Kafka's retry.backoff.ms), doubling up to RETRY_BACKOFF_MAX_S
STALE_AFTER_S = 0.25  # a request unanswered this long makes the sender check whether its leader moved
STALE_CHECK_INTERVAL_S = 0.1
ACKS = (0, 1, "all", -1)
IDEMPOTENT_IN_FLIGHT_MAX = 5  # the leader remembers this many batches per producer for de-duplication
PRODUCER_EPOCH_MAX = 2**15 - 1  # the epoch is an int16 in the batch header; past it, a new producer id
TIMESTAMP_MS_MAX = 2**63 - 1  # timestamps are int64 in the batch
ZERO_ALLOWED = ("linger_ms", "max_block_ms")  # the times that may be 0 (the others must be above it)
# Topics whose metadata, limits and sticky partition one producer keeps (a topic sent to again past
# that asks for its metadata again), and partitions whose idempotent sequence numbers it keeps: past
# that, partitions with nothing buffered or in flight forget theirs, and start again at sequence 0 in a
# newer producer epoch (see _forget_idle_sequences).
TOPICS_MAX = 4096
SEQUENCE_PARTITIONS_MAX = 65_536
TRANSACTION_CALL_TIMEOUT_S = 60.0  # default bound of init/commit/abort/send_offsets (Kafka's max.block.ms)


_PRODUCER_IDS = itertools.count(1)  # names the producers of a process in their buffer metric
# Whether producers created from now on take send()'s common case in C (logbus.api._fastsend), when it
# was built. The Python send() is the reference and handles every other case; benchmarks and tests set
# this to False to measure or check the Python path alone.
FAST_PATH = _fastsend is not None and _fastsend.RECORD_OVERHEAD_BYTES == RECORD_OVERHEAD_BYTES


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
        "sent_s", "leader_id", "outcome", "waiting", "sequenced", "retries", "callbacks", "columns",
    )

    def __init__(self, topic: str, partition: int, now_s: float, delivery_timeout_s: float, columnar: bool = False) -> None:
        self.topic = topic
        self.partition = partition
        # The records' keys, values and timestamps: as Arrow buffers (logbus.api._fastsend.Columns) in a
        # producer with the C path, else as lists.
        self.columns = _fastsend.Columns() if columnar else None
        self.values: list | None = None if columnar else []
        self.keys: list | None = None if columnar else []
        self.headers: list | None = None
        self.timestamps: list | None = None if columnar else []
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
        # (base offset, log append time or -1, error or None) once the batch is done for good; set
        # (under _OUTCOME_LOCK) before the records' futures and the batch's future are completed.
        self.outcome: tuple[int, int, BaseException | None] | None = None
        self.waiting: list[RecordFuture] | None = None  # record futures with state of their own
        # Its records' callbacks, six values each (RecordFuture._on_outcome), until the batch is done.
        self.callbacks: list | None = None
        self.sequenced: tuple[int, int] | None = None  # (producer id, epoch) its sequence numbers belong to
        self.retries: Backoff | None = None  # from its first retriable failure: backoff until its delivery deadline


@dataclass(slots=True)
class _Sequences:
    """An idempotent producer's sequence numbers for one partition, and the (id, epoch) they belong to."""

    producer_id: int
    epoch: int
    next: int = 0
    # Whether the leader acknowledged a batch of this sequence: until it has, the partition has one
    # batch in flight (see _collect).
    acknowledged: bool = False
    acknowledged_s: float = 0.0  # when the last acknowledgement came (time.monotonic())
    # The partition's producer.id.expiration.ms as its leader last said, in seconds (None: not said).
    expiration_s: float | None = None

    def known_to_leader(self, now_s: float) -> bool:
        """Whether the leader surely still knows this sequence, so that several of its batches may be in
        flight: it acknowledged one, and not so long ago that it may have forgotten the producer since
        (half its producer.id.expiration.ms, a margin for the two clocks). A leader that forgot the
        producer takes its next batch at any sequence (KIP-360), so the partition goes one batch at a
        time again until the next acknowledgement, as before the first. Not covered: a leader that
        reopens its log counts from the batches' own timestamps, as Kafka's does, so a backfill's
        producer (old timestamps) is forgotten by a reopen at once (docs/design.md)."""
        if not self.acknowledged:
            return False
        return self.expiration_s is None or now_s - self.acknowledged_s < self.expiration_s / 2


_track = _fastsend.track if _fastsend is not None else (lambda obj: None)
_OUTCOME_LOCK = threading.Lock()  # orders a batch's completion against its records taking state of their own
# The producers whose batches the current thread is completing (running their records' callbacks): see flush().
_COMPLETING = threading.local()


def _completing_here() -> list:
    producers = getattr(_COMPLETING, "producers", None)
    if producers is None:
        producers = _COMPLETING.producers = []
    return producers

_FUTURE_STATE = frozenset(("_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"))


class RecordFuture(Future):
    """The future of one record sent with :meth:`Producer.send`; resolves to its RecordMetadata.

    A complete ``concurrent.futures.Future``: ``result`` and ``exception``
    with timeouts, ``done``, ``add_done_callback``, and it works with
    ``concurrent.futures.wait`` and ``as_completed`` and with
    ``asyncio.wrap_future``. As in Kafka's clients, a record handed to the
    producer cannot be called back: ``cancel()`` returns False, the future
    is never cancelled, and ``running()`` is True until it is done.
    kafka-python's spellings work too: ``get(timeout)``,
    ``add_callback(fn, *args, **kwargs)`` and ``add_errback(fn, *args, **kwargs)``.

    Callbacks run in the thread that completes the record's batch (where the
    producer handles the leader's reply), or at once in the caller's thread if
    the record is already done; keep them short. An exception a callback
    raises is logged, not propagated (as concurrent.futures does).

    Why it is cheap: a record's outcome is its batch's, so the methods above
    read the batch. The state a Future keeps for ``wait`` and
    ``as_completed`` (a Condition and two lists: 0.65 µs to create, where all
    of ``send()`` takes 0.9 µs) is created on first access, only for records
    those functions are asked about; the batch completes such records before
    its own future, so ``wait`` never sees a record pending that ``done()``
    reports done.
    """

    __slots__ = ("_batch", "_index", "_timestamp_ms")

    def __init__(self, batch: _Batch, index: int, timestamp_ms: int) -> None:  # noqa: D107 (no super().__init__: see _materialize)
        self._batch = batch
        self._index = index
        self._timestamp_ms = timestamp_ms

    def __getattr__(self, name: str):
        # Reached only for attributes not set: the Future's own state, on its first use.
        if name not in _FUTURE_STATE:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._materialize()
        return self.__dict__[name]

    def _materialize(self) -> None:
        """Give this record a Future's own state, completed with the batch."""
        batch = self._batch
        with _OUTCOME_LOCK:
            if "_condition" in self.__dict__:
                return
            _track(self)  # the Future's state can refer back to it (a callback's closure, a waiter)
            Future.__init__(self)
            outcome = batch.outcome
            if outcome is None:
                if batch.waiting is None:
                    batch.waiting = []
                batch.waiting.append(self)
                return
        # Outside the lock: wait() may hold this future's condition while it asks for another's state.
        self._settle(outcome)

    def _settle(self, outcome: tuple) -> None:
        base_offset, append_time_ms, error = outcome
        if error is None:
            Future.set_result(self, self._metadata(base_offset, append_time_ms))
        else:
            Future.set_exception(self, copy_error(error))

    def _metadata(self, base_offset: int, append_time_ms: int) -> RecordMetadata:
        return _record_metadata(self._batch, base_offset, append_time_ms, self._index, self._timestamp_ms)

    def _outcome(self, timeout: float | None) -> tuple:
        batch = self._batch
        outcome = batch.outcome
        if outcome is None:
            batch.future.exception(timeout)  # waits; TimeoutError if the timeout passes first
            outcome = batch.outcome
        return outcome

    def result(self, timeout: float | None = None) -> RecordMetadata:
        """The record's RecordMetadata once acknowledged; raises its error if it failed, TimeoutError after ``timeout`` s.

        The error raised is the caller's own copy of the batch's (see :meth:`exception`).
        """
        base_offset, append_time_ms, error = self._outcome(timeout)
        if error is not None:
            raise copy_error(error)
        return self._metadata(base_offset, append_time_ms)

    def get(self, timeout: float | None = None) -> RecordMetadata:
        """kafka-python's name for :meth:`result`."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The record's error, None if it was acknowledged; TimeoutError after ``timeout`` s.

        Each call returns a new copy of the error the record's batch failed with (the same type,
        arguments, attributes and cause: ``logbus.errors.copy_error``), so that raising it adds
        tracebacks to that copy alone; compare errors by type, not identity.
        """
        error = self._outcome(timeout)[2]
        return None if error is None else copy_error(error)

    def done(self) -> bool:
        return self._batch.outcome is not None

    def running(self) -> bool:
        return self._batch.outcome is None

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False  # a record handed to the producer is on its way

    def add_done_callback(self, fn) -> None:
        """Call ``fn(future)`` once the record is done (at once if it is)."""
        self._on_outcome(_DONE, fn, self, None)

    def add_callback(self, fn, *args, **kwargs) -> "RecordFuture":
        """Call ``fn(metadata, *args, **kwargs)`` if the record is acknowledged; returns this future."""
        self._on_outcome(_CALLBACK, fn, args, kwargs)
        return self

    def add_errback(self, fn, *args, **kwargs) -> "RecordFuture":
        """Call ``fn(exception, *args, **kwargs)`` if the record fails; returns this future."""
        self._on_outcome(_ERRBACK, fn, args, kwargs)
        return self

    def _on_outcome(self, kind: int, fn, args, kwargs) -> None:
        """Have ``fn`` called with the record's outcome: by the batch's completion, or now if it is done.

        The batch keeps the call in a flat list of plain values (no closure, and no reference to this
        future but for add_done_callback's): a callback per record, for a million records in flight,
        would otherwise be millions of objects for the cyclic garbage collector to walk again and again.
        A cycle through the list (a callback that refers to its future, which refers to its batch) ends
        when the batch is done and drops the list, so a future the C path left untracked stays so.
        """
        batch = self._batch
        with _OUTCOME_LOCK:
            outcome = batch.outcome
            if outcome is None:
                calls = batch.callbacks
                if calls is None:
                    calls = batch.callbacks = []
                calls += (self._index, self._timestamp_ms, kind, fn, args, kwargs)
                return
        _call_back(batch, outcome, self._index, self._timestamp_ms, kind, fn, args, kwargs)

    def set_result(self, *args) -> None:
        raise IllegalStateError("a record future is completed by the producer")

    set_exception = set_running_or_notify_cancel = set_result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<RecordFuture {self._batch.topic}-{self._batch.partition}[{self._index}] {state}>"


class _UntrackedRecordFuture(RecordFuture):
    """A RecordFuture made by the C path (logbus/api/_fastsend.c), which leaves it untracked by the
    cyclic garbage collector: it refers only to its batch. An attribute of the caller's could close a
    cycle through it, so setting one tracks it first (as asking for a Future's state does)."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        _track(self)
        object.__setattr__(self, name, value)


def _finish(batch: _Batch, base_offset: int, append_time_ms: int, error: BaseException | None) -> None:
    """Complete a batch for good: its outcome, then its records' own futures, then the batch's future,
    then its records' callbacks (in the order they were added)."""
    with _OUTCOME_LOCK:
        if batch.outcome is not None:
            return  # already completed (a reply racing close()'s abandon)
        outcome = batch.outcome = (base_offset, append_time_ms, error)
        waiting, batch.waiting = batch.waiting, None
        calls, batch.callbacks = batch.callbacks, None
    for record in waiting or ():
        record._settle(outcome)
    if error is None:
        batch.future.set_result(base_offset)
    else:
        batch.future.set_exception(error)
    if calls:
        interrupt = None
        for at in range(0, len(calls), 6):
            try:
                _call_back(batch, outcome, *calls[at:at + 6])
            except BaseException as error:  # noqa: BLE001 (SystemExit, KeyboardInterrupt: raised once all have run)
                interrupt = interrupt or error
        if interrupt is not None:
            raise interrupt


def _record_metadata(batch: _Batch, base_offset: int, append_time_ms: int, index: int, timestamp_ms: int) -> RecordMetadata:
    """The RecordMetadata of the record at ``index`` of ``batch``, written at ``base_offset``."""
    offset = -1 if base_offset < 0 else base_offset + index
    return RecordMetadata(batch.topic, batch.partition, offset, append_time_ms if append_time_ms >= 0 else timestamp_ms)


_CALLBACK, _ERRBACK, _DONE = 0, 1, 2  # what a record's callback is called with (RecordFuture._on_outcome)


def _call_back(batch: _Batch, outcome: tuple, index: int, timestamp_ms: int, kind: int, fn, args, kwargs) -> None:
    """Call one callback of a record of ``batch`` with its outcome; an Exception it raises is logged (as
    concurrent.futures does), not propagated (``_finish`` raises a SystemExit or KeyboardInterrupt once
    the batch's other callbacks have run)."""
    base_offset, append_time_ms, error = outcome
    try:
        if kind == _DONE:
            fn(args)  # the record's future
        elif kind == _CALLBACK:
            if error is None:
                fn(_record_metadata(batch, base_offset, append_time_ms, index, timestamp_ms), *args, **kwargs)
        elif error is not None:
            fn(copy_error(error), *args, **kwargs)
    except Exception:  # noqa: BLE001 (a callback's failure is its own; the producer goes on)
        logger.exception("a callback of a record sent to %s-%d raised", batch.topic, batch.partition)


@functools.cache
def _murmur2_partitioner() -> int:
    """The address of librdkafka's murmur2 partitioner (``rd_kafka_msg_partitioner_murmur2``, which
    ``confluent_kafka.murmur2`` calls), for the C path to call without Python's argument parsing (0.12 us
    of the 0.6 us a keyed send() takes there); 0 where the library cannot be found, and the C path calls
    ``murmur2`` itself. The library is the one confluent_kafka loaded (its wheel's own copy, or the system's)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "librdkafka" in line and "/" in line), None)
        if path is None:
            return 0
        function = ctypes.CDLL(path).rd_kafka_msg_partitioner_murmur2
        return ctypes.cast(function, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def _binary_column(count: int, buffers: tuple) -> pa.Array:
    """An Arrow binary array over a Columns column's buffers, (null count, validity or None, offsets, data)."""
    nulls, validity, offsets, data = buffers
    return pa.Array.from_buffers(
        pa.binary(), count, [None if validity is None else pa.py_buffer(validity), pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=nulls,
    )


def _serialize(serializer, data, what: str, topic) -> bytes | None:
    """``serializer(data)`` as bytes or None; SerializationError naming the topic and the cause otherwise."""
    try:
        out = serializer(data)
    except Exception as error:  # noqa: BLE001 (whatever the user's serializer raises is its failure)
        raise SerializationError(f"the {what} serializer failed on a record for topic {topic!r}: {error!r}") from error
    if out is None or out.__class__ is bytes:
        return out
    if isinstance(out, bytes):
        return bytes(out)
    if isinstance(out, str):
        try:
            return out.encode()
        except UnicodeEncodeError as error:  # lone surrogates
            raise SerializationError(
                f"the {what} serializer returned a str that is not valid UTF-8 for a record for topic {topic!r}: {error}"
            ) from None
    raise SerializationError(
        f"the {what} serializer returned {type(out).__name__} for a record for topic {topic!r}; it must return bytes, str or None"
    )


def _data_bytes(data) -> int | None:
    """The bytes ``data`` (a key, value or header value) is sent as, as the producer converts it; None for a
    type it refuses (or that a serializer turns into bytes of its own)."""
    kind = data.__class__
    if kind is bytes or kind is bytearray:
        return len(data)
    if data is None:
        return 0
    if kind is str:
        return len(data) if data.isascii() else len(data.encode("utf-8", "surrogatepass"))
    if kind is memoryview:
        return data.nbytes
    return None


def record_charge_bytes(value, key, headers) -> int | None:
    """What one record counts for in the producer's buffer (``buffer_memory_bytes``), and against a batch.

    Its value, key and headers as the bytes sent (str as UTF-8), plus
    RECORD_OVERHEAD_BYTES, plus HEADER_OVERHEAD_BYTES and the name's UTF-8
    bytes per header. ``send()`` charges this for the record it converted;
    ``logbus.aio``'s producer computes it before sending, from what the
    caller passed, to know on its event loop whether ``send()`` may block
    (the two agree: conversion does not change the count). None when it
    cannot be known before the record is converted: a type ``send()``
    refuses, or malformed headers (``send()`` names the mistake).
    """
    size = RECORD_OVERHEAD_BYTES
    if value.__class__ is bytes:
        size += len(value)
    elif value is not None:
        count = _data_bytes(value)
        if count is None:
            return None
        size += count
    if key.__class__ is bytes:
        size += len(key)
    elif key is not None:
        count = _data_bytes(key)
        if count is None:
            return None
        size += count
    if headers is not None:
        try:
            for name, header in headers.items() if isinstance(headers, dict) else headers:
                count = _data_bytes(header)
                if count is None or name.__class__ is not str:
                    return None
                size += HEADER_OVERHEAD_BYTES + count + (len(name) if name.isascii() else len(name.encode("utf-8", "surrogatepass")))
        except (TypeError, ValueError):
            return None
    return size


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
        local_channel: send batches to the leader over its channel (a Unix socket on this node,
            TCP to another; a fraction of an actor call's latency, and no copy into the object
            store) rather than as actor calls. Batches over 32 MiB use actor calls.
        key_serializer, value_serializer: callables (kafka-python's options) that send() applies
            to each key / value before anything else; each must return bytes, str or None. A
            serializer that raises or returns anything else fails the send() with
            SerializationError, and nothing is queued. None is not passed to them (kafka-python
            passes it): a None value stays a tombstone. send_table() does not use them.
        transactional_id: makes the producer transactional (Kafka's transactional.id): one id per
            logical producer, the same across its restarts, so that a new instance fences the
            old one. Implies idempotence and acks="all" (the default then; other acks are
            refused). See :meth:`init_transactions`.
        transaction_timeout_ms: the coordinator aborts a transaction open longer than this
            (at most 900000, Kafka's transaction.max.timeout.ms), and fences this producer.
    """

    def __init__(
        self,
        bus: Bus,
        acks: int | str | None = None,
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
        key_serializer=None,
        value_serializer=None,
        transactional_id: str | None = None,
        transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS_DEFAULT,
    ) -> None:
        if not isinstance(bus, Bus):
            raise InvalidConfigError(f"bus must be a Bus from logbus.connect(), not {type(bus).__name__}")
        txn = None
        if transactional_id is not None:
            validate_transactional_id(transactional_id)
            if isinstance(transaction_timeout_ms, bool) or not isinstance(transaction_timeout_ms, int) or transaction_timeout_ms <= 0:
                raise InvalidConfigError(f"transaction_timeout_ms must be a positive int, not {transaction_timeout_ms!r}")
            if acks is None:
                acks = "all"
            if acks not in ("all", -1) or acks.__class__ not in (int, str):
                raise InvalidConfigError(f"a transactional producer needs acks='all', not {acks!r}")
            if enable_idempotence is False:
                raise InvalidConfigError("a transactional producer is idempotent: enable_idempotence cannot be False")
            enable_idempotence = True
            txn = TransactionManager(transactional_id, transaction_timeout_ms)
        elif acks is None:
            acks = 1
        check_choice("acks", acks, ACKS)  # not True or 1.0, which equal 1
        check_choice("compression", compression, tuple(rb.COMPRESSION_CODES))
        for name, value in (("batch_size_bytes", batch_size_bytes), ("buffer_memory_bytes", buffer_memory_bytes)):
            check_int(name, value, 1, INT64_MAX, unit="bytes")
        check_int("max_in_flight", max_in_flight, 1, INT32_MAX)
        for name, value in (
            ("linger_ms", linger_ms), ("max_block_ms", max_block_ms), ("delivery_timeout_ms", delivery_timeout_ms),
            ("request_timeout_ms", request_timeout_ms),
        ):
            check_ms(name, value, positive=name not in ZERO_ALLOWED)
        check_flag("enable_idempotence", enable_idempotence, none_ok=True)
        check_flag("local_channel", local_channel)
        check_callable("key_serializer", key_serializer, "a key")
        check_callable("value_serializer", value_serializer, "a value")
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
        # Only the sender thread assigns sequence numbers (in _collect and _encode).
        self._sequences: dict[tuple[str, int], _Sequences] = {}
        self._unresolved: set[tuple[str, int]] = set()  # partitions whose sequence must restart (KIP-360)
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
        # Per topic (each at most TOPICS_MAX, written under the lock): metadata, and the sticky partition
        # of keyless records.
        self._topics: BoundedDict = BoundedDict(TOPICS_MAX)
        self._sticky: BoundedDict = BoundedDict(TOPICS_MAX)
        self.sequence_partitions_max = SEQUENCE_PARTITIONS_MAX
        self._open: dict[tuple[str, int], _Batch] = {}
        self._ready: deque[_Batch] = deque()
        self._in_flight: dict[tuple[str, int], int] = {}
        self._in_flight_total = 0
        # Batches whose outcome is decided and whose futures and callbacks are being completed (_complete):
        # flush() waits for them too, so every record's future is done and its callbacks have run when it
        # returns, as in Kafka's producer.
        self._completing = 0
        self._buffered_bytes = 0
        self._buffer_gauge = metrics.BufferGauge(f"producer-{os.getpid()}-{next(_PRODUCER_IDS)}")
        self._flushing = 0
        self._closed = False
        self._stopping = False
        self._refresh: set[str] = set()
        # topic -> (ObjectRef, when asked) of a metadata refresh not yet taken (the sender thread's; _refreshed)
        self._metadata_requests: BoundedDict = BoundedDict(TOPICS_MAX)
        self._metadata_deadline_s = 0.0  # until when the sender's current round may wait for refreshes
        self._in_flight_batches: dict[int, _Batch] = {}
        self._last_stale_check_s = 0.0
        # topic -> (partitions, record limit, max.message.bytes, batch limit for send())
        self._limits: BoundedDict = BoundedDict(TOPICS_MAX)
        self._channels = local_channels() if local_channel else None
        self._lock = threading.Lock()
        # send() takes self._lock directly: the same lock, without Condition.__enter__'s Python frame.
        self._condition = threading.Condition(self._lock)
        self._key_serializer = key_serializer
        self._value_serializer = value_serializer
        self._send_records = self.send  # send() without serializers or a transaction's check
        self._columnar = False  # whether send()'s batches keep their records as Arrow buffers (the C path's)
        if FAST_PATH and type(self).send is Producer.send:
            self._columnar = True
            # The common case in C; every other case, and every error, through the Python send().
            self.send = self._send_records = _fastsend.FastSend(
                self, self._send_records, murmur2, _UntrackedRecordFuture, _Batch, _murmur2_partitioner()
            )
        if key_serializer is not None or value_serializer is not None:
            # Serializing goes in front of send() for this producer alone, so that a producer
            # without serializers runs send() exactly as before, without even a test for them.
            self.send = self._send_serialized
        self._txn = txn
        self._txn_add_not_before_s = 0.0  # retry backoff of AddPartitionsToTxn
        self._txn_add_failing_since_s: float | None = None
        if txn is not None:
            # Sends are checked against the transaction's state in front of send() and send_table(),
            # for this producer alone (as serializers are): other producers run them as before.
            self._send_untransacted = self.send
            self.send = self._send_transactional
        self._sender = threading.Thread(target=self._run_sender, name="logbus-producer-sender", daemon=True)
        self._sender.start()

    # --- metadata -------------------------------------------------------------------------------

    def _topic(self, topic: str, refresh: bool = False) -> TopicMetadata:
        """The topic's metadata: cached (at most TOPICS_MAX topics), else (or with ``refresh``) asked for."""
        metadata = None if refresh else self._topics.get(topic)
        if metadata is None:
            metadata = self._bus.topic_metadata(topic, refresh=refresh)
            with self._lock:
                self._topics[topic] = metadata
                if refresh:
                    self._limits.pop(topic, None)  # from the new metadata, at the next send()
        return metadata

    def _refreshed(self, topic: str, wait_s: float) -> TopicMetadata:
        """The topic's metadata asked for again, for the sender thread, which must not wait on a controller
        that does not answer (its host cut off or paused: Ray's call then waits for the connection to come
        back, whatever the timeout): every partition's batches would stop behind one refresh.

        A refresh is asked for once at a time per topic, and waited for ``wait_s`` at most (the sender
        gives all of one round's refreshes ``METADATA_WAIT_S`` together). An answer is always taken, however
        late it came (answers to one topic come in the order asked, so it is never older than what is
        known); one asked for more than ``METADATA_ANSWER_FRESH_S`` ago is asked for again as well, for the
        next refresh. Until an answer comes the metadata known serves: a batch goes to the leader it went
        to, which takes it once it may again (a leader whose lease lapsed while the controller was away
        goes on under its epoch when the lease is renewed) or refuses it again. With no metadata known at
        all, it waits for the controller as ``_topic`` does.
        """
        asked = self._metadata_requests.get(topic)
        if asked is None:
            asked = self._metadata_requests[topic] = (self._bus.request_metadata(topic), time.monotonic())
        known = self._topics.get(topic)
        if known is not None:
            try:
                ready = bool(ray.wait([asked[0]], timeout=max(0.0, wait_s))[0])
            except Exception:  # noqa: BLE001 (Ray going away, a client link down: no answer now)
                ready = False
            if not ready:
                return known
        del self._metadata_requests[topic]
        metadata = self._bus.metadata_arrived(asked[0])  # with nothing known: waits as _topic does
        if time.monotonic() - asked[1] > METADATA_ANSWER_FRESH_S:
            self._metadata_requests[topic] = (self._bus.request_metadata(topic), time.monotonic())
        with self._lock:
            self._topics[topic] = metadata
            self._limits.pop(topic, None)  # from the new metadata, at the next send()
        return metadata

    def _holds_metadata(self, topic) -> bool:
        """Whether send() to ``topic`` needs no metadata from the controller (never waits for it)."""
        return topic in self._limits and topic in self._topics

    def partitions_for(self, topic: str) -> list[int]:
        """The partition numbers of ``topic``."""
        return list(range(self._topic(topic).partition_count))

    # --- sending ----------------------------------------------------------------------------------

    def send(
        self, topic: str, value=None, key=None, headers=None, partition: int | None = None, timestamp_ms: int | None = None
    ) -> RecordFuture:
        """Queue one record; returns a :class:`RecordFuture` of its RecordMetadata.

        ``value`` and ``key`` are bytes, str (UTF-8) or None, or whatever the
        producer's serializers take; ``headers`` a dict or a list of (str, bytes)
        pairs. Raises at once (nothing queued): UnknownTopicError (retriable: the
        topic may be being created), InvalidTopicError, InvalidPartitionError (a
        partition the topic does not have), InvalidRecordError (bad types or
        timestamp), SerializationError (a serializer failed), RecordTooLargeError
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
            limits = self._topic_limits(topic)
        count, limit, max_message_bytes, batch_limit = limits
        if value.__class__ is not bytes and value is not None:
            value = _as_bytes(value, "value")
        if key.__class__ is not bytes and key is not None:
            key = _as_bytes(key, "key")
        if headers is not None:
            headers = _normalize_headers(headers)
        size = record_charge_bytes(value, key, headers)
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
                batch = self._open[slot] = _Batch(topic, partition, time.monotonic(), self.delivery_timeout_s, self._columnar)
            if batch.columns is not None:
                index = batch.columns.append(value, key, timestamp_ms)
            else:
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
        return RecordFuture(batch, index, timestamp_ms)

    def _topic_limits(self, topic: str) -> tuple[int, int, int, int]:
        """(partitions, record limit, max.message.bytes, batch limit for send()) of ``topic``, kept for send()."""
        metadata = self._topic(topic)
        record_limit = metadata.config.max_message_bytes - BATCH_OVERHEAD_BYTES
        limits = (metadata.partition_count, record_limit, metadata.config.max_message_bytes, min(self.batch_size_bytes, record_limit))
        with self._lock:
            self._limits[topic] = limits
        return limits

    def _send_serialized(
        self, topic: str, value=None, key=None, headers=None, partition: int | None = None, timestamp_ms: int | None = None
    ) -> RecordFuture:
        """send() for a producer with serializers: serialize the key and value, then send them."""
        if self._closed:
            raise IllegalStateError("send() after close()")
        if value is not None and self._value_serializer is not None:
            value = _serialize(self._value_serializer, value, "value", topic)
        if key is not None and self._key_serializer is not None:
            key = _serialize(self._key_serializer, key, "key", topic)
        return self._send_records(topic, value, key, headers, partition, timestamp_ms)

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
        if self._txn is not None:
            with self._lock:
                self._txn.check_send()
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
            partition = random.randrange(count)
            with self._lock:
                self._sticky[topic] = partition
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
        if self._sticky.get(slot[0]) == slot[1] and (batch.columns.null_keys if batch.columns is not None else batch.keys.count(None)):
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
            self._buffer_gauge.update(self._buffered_bytes)
            with self._condition:
                batches, wait_s = self._collect()
                to_add = self._partitions_to_add()
                if not batches and not to_add:
                    if self._stopping and not self._open and not self._ready and not self._in_flight_total:
                        return
                    self._condition.wait(min(wait_s, STALE_CHECK_INTERVAL_S) if self._in_flight_total else wait_s)
                    continue
            if to_add:
                self._add_partitions(to_add)
            self._metadata_deadline_s = time.monotonic() + METADATA_WAIT_S  # for this round's refreshes together
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
                leaders[topic] = self._refreshed(topic, 0.0).leaders  # not answered yet: no news this time
            except Exception:  # noqa: BLE001 (the controller did not answer: no news about the leader)
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
        txn = self._txn
        while self._ready:
            batch = self._ready.popleft()
            slot = (batch.topic, batch.partition)
            if txn is not None and (not txn.sending_allowed or txn.needs_partition(TopicPartition(*slot))):
                # A transaction's batch goes once its partition is in the transaction, and not
                # at all once the transaction failed (abort_transaction() fails it).
                held.add(slot)
                kept.append(batch)
                continue
            sequences = self._sequences.get(slot)  # None until the partition's first batch is framed
            if self.enable_idempotence and self._in_flight.get(slot, 0) and not (sequences is not None and sequences.known_to_leader(now)):
                # A sequence the leader has not acknowledged yet, or may have forgotten since (its
                # producer.id.expiration.ms), goes one batch at a time: a leader that does not know
                # this producer takes its batch at any sequence (KIP-360), so a second batch could be
                # written ahead of a first that met a retriable error, which could then never be
                # written (Kafka's client holds such batches back too).
                held.add(slot)
                kept.append(batch)
                continue
            if slot in held or self._in_flight.get(slot, 0) >= self.max_in_flight or batch.not_before_s > now:
                # A partition's batches leave in order: one held back (retry backoff, or no
                # slot free) holds back the later ones, so they cannot overtake it at the leader.
                held.add(slot)
                kept.append(batch)
                if batch.not_before_s > now:
                    wait_s = min(wait_s, batch.not_before_s - now)
                continue
            if slot in self._unresolved and batch.encoded is None:
                # The first batch to get sequence numbers since one of this partition failed for
                # good: it starts the partition's new sequence once the old one has nothing in
                # flight (batches waiting to be retried sit before it, so they hold it above).
                if self._in_flight.get(slot, 0):
                    held.add(slot)
                    kept.append(batch)
                    continue
                self._restart_sequences(slot)
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

    def _restart_sequences(self, slot: tuple[str, int], why: str = "after a batch failed") -> None:
        """Under the lock, with nothing of ``slot`` in flight: start its sequence numbers afresh (KIP-360).

        A batch that failed for good leaves a hole in its partition's sequence
        that the leader would never see filled (its batch may also have been
        written after all: a lost reply looks like a lost request), so every
        later batch of the old sequence is refused as out of order. The
        partition restarts at sequence 0 in a producer epoch above the one its
        old sequence used, which the leader accepts from any sequence state.

        No record can be written twice: only batches never sent get numbers in
        the new epoch, and every batch of the old epoch is done for good
        (nothing of the partition is in flight, and batches waiting for a retry
        are dispatched before this one). A late copy of an old batch (a request
        that outlived its timeout) is refused by the leader once the new epoch
        has written there (ProducerFencedError), and if it lands before, it
        is an old record written once, not a new one written twice.

        The epoch is the producer's: it is bumped unless another partition
        already moved past this one's epoch. Partitions that did not fail keep
        their sequences in the epoch they started in (the leader tracks each
        partition separately). Past the largest int16 epoch, the next batch
        asks the controller for a new producer id.
        """
        self._unresolved.discard(slot)
        old = self._sequences.pop(slot, None)
        if old is None or (old.producer_id, old.epoch) != (self._producer_id, self._producer_epoch):
            return
        if self._txn is not None:
            return  # the coordinator owns a transactional producer's epoch: bumped after the abort
        if self._producer_epoch >= PRODUCER_EPOCH_MAX:
            self._producer_id = rb.NO_PRODUCER_ID
            self._producer_epoch = rb.NO_PRODUCER_EPOCH
        else:
            self._producer_epoch += 1
        logger.log(
            logging.INFO if why == "after a batch failed" else logging.DEBUG,
            "producer %s: %s-%d restarts its sequence in epoch %s %s",
            old.producer_id, slot[0], slot[1], self._producer_epoch, why,
        )

    def _forget_idle_sequences(self) -> None:
        """Under the lock, with ``sequence_partitions_max`` partitions holding sequence numbers: forget
        those of the oldest quarter of the idle partitions (nothing buffered, waiting or in flight).

        Each starts again at sequence 0 when next sent to, in a producer
        epoch above the one its old sequence used, exactly as after a failed
        batch (``_restart_sequences``, which the leader accepts from any
        sequence state). Nothing of the partition is outstanding, so no record
        can be written twice. Busy partitions keep theirs: the table then
        holds at most the partitions with records on their way, beyond the bound.
        """
        busy = set(self._open) | set(self._in_flight) | {(b.topic, b.partition) for b in self._ready}
        idle = [slot for slot in self._sequences if slot not in busy]
        for slot in idle[: max(1, len(self._sequences) // 4)]:
            self._restart_sequences(slot, "(idle, past sequence_partitions_max)")

    def _dispatch(self, batch: _Batch) -> None:
        try:
            refresh = batch.topic in self._refresh
            self._refresh.discard(batch.topic)
            metadata = (self._refreshed(batch.topic, self._metadata_deadline_s - time.monotonic()) if refresh
                        else self._topic(batch.topic))
            if batch.encoded is None:
                self._encode(batch)
            leader = metadata.leaders[batch.partition]
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
        sequences = None
        if self.enable_idempotence:
            slot = (batch.topic, batch.partition)
            sequences = self._sequences.get(slot)
            if sequences is None:
                if self._producer_id == rb.NO_PRODUCER_ID and self._txn is not None:
                    raise IllegalStateError("a transactional producer has no producer id before init_transactions()")
                if len(self._sequences) >= self.sequence_partitions_max and self._txn is None:
                    # (a transactional producer keeps its sequences: its epoch is the coordinator's)
                    with self._lock:
                        self._forget_idle_sequences()
                if self._producer_id == rb.NO_PRODUCER_ID:
                    self._producer_id = get(self._bus.controller.allocate_producer_id.remote())
                    self._producer_epoch = 0
                sequences = self._sequences[slot] = _Sequences(self._producer_id, self._producer_epoch)
            frame.update(producer_id=sequences.producer_id, producer_epoch=sequences.epoch, base_sequence=sequences.next)
            if self._txn is not None:
                frame["transactional"] = True
        if batch.records is not None:
            encoded = rb.frame_record_batch(batch.records, **frame)
            batch.records = None
        elif batch.columns is not None:
            count, first_ms, max_ms, values, keys, timestamps = batch.columns.buffers()
            records = rb.build_record_batch(
                _binary_column(count, values), None if keys[0] == count else _binary_column(count, keys),
                pa.Array.from_buffers(pa.int64(), count, [None, pa.py_buffer(timestamps)]), batch.headers,
            )
            encoded = rb.frame_record_batch(records, timestamp_range=(first_ms, max_ms), **frame)
            batch.record_count = count
            batch.columns = batch.headers = None
        else:
            keys = batch.keys if any(k is not None for k in batch.keys) else None
            encoded = rb.encode_batch(batch.values, keys, batch.timestamps, batch.headers, **frame)
            batch.record_count = len(batch.values)
            batch.values = batch.keys = batch.headers = batch.timestamps = None
        if sequences is not None:
            # Taken only once the batch is framed: a batch that failed to frame used no numbers.
            sequences.next += batch.record_count
            batch.sequenced = (sequences.producer_id, sequences.epoch)
        batch.encoded = encoded

    def _on_reply(self, batch: _Batch, future, attempt: int) -> None:
        error = future.exception()
        if error is None:
            reply = future.result()
            self._complete(batch, reply.base_offset, None, attempt, append_time_ms=reply.log_append_time_ms,
                           expiration_ms=getattr(reply, "producer_expiration_ms", -1))
        else:
            self._complete(batch, None, unwrap(error), attempt)

    def _complete(
        self,
        batch: _Batch,
        base_offset: int | None,
        error: BaseException | None,
        attempt: int,
        backoff: bool = True,
        append_time_ms: int = -1,
        expiration_ms: int = -1,
    ) -> None:
        with self._condition:
            # Each attempt completes once: a late reply to an attempt that expired is dropped.
            if batch.attempts != attempt or self._in_flight_batches.pop(id(batch), None) is None:
                return
        delay_s = None  # before the retry; None: no retry
        if error is not None and isinstance(error, LogbusError) and error.retriable:
            if batch.retries is None:
                batch.retries = Backoff(RETRY_BACKOFF_S, RETRY_BACKOFF_MAX_S, deadline_s=batch.deadline_s)
            delay_s = batch.retries.delay_s(time.monotonic())
        retry = delay_s is not None
        with self._condition:
            slot = (batch.topic, batch.partition)
            self._in_flight[slot] -= 1
            if not self._in_flight[slot]:
                del self._in_flight[slot]  # the table holds only partitions with requests in flight
            self._in_flight_total -= 1
            if retry and isinstance(error, OutOfOrderSequenceError) and self._behind_a_lost_batch(batch):
                retry = False  # the hole before it will never be filled: fail it now, not at its deadline
            if retry:
                if backoff:
                    batch.not_before_s = time.monotonic() + delay_s
                    self._refresh.add(batch.topic)
                # Retried batches go out again in their first order, ahead of newer ones, so a
                # partition's sequence numbers reach the leader in order.
                retried = sorted([b for b in self._ready if b.order] + [batch], key=lambda b: b.order)
                self._ready = deque(retried + [b for b in self._ready if not b.order])
            else:
                self._completing += 1
                self._buffered_bytes -= batch.size_bytes
                if error is None and batch.sequenced is not None:
                    sequences = self._sequences.get(slot)
                    if sequences is not None and (sequences.producer_id, sequences.epoch) == batch.sequenced:
                        sequences.acknowledged, sequences.acknowledged_s = True, time.monotonic()
                        if expiration_ms > 0:
                            sequences.expiration_s = expiration_ms / 1000
                if error is not None and self._txn is not None:
                    self._txn.batch_failed(copy_error(error))
                if error is not None and batch.sequenced is not None:
                    sequences = self._sequences.get(slot)
                    if sequences is not None and (sequences.producer_id, sequences.epoch) == batch.sequenced:
                        self._unresolved.add(slot)  # its next new batch restarts the sequence
            self._condition.notify_all()
        if retry:
            return
        self._finish_counted([(batch, base_offset if error is None else -1, append_time_ms, error)])

    def _behind_a_lost_batch(self, batch: _Batch) -> bool:
        """Under the lock: whether ``batch`` is its partition's oldest batch of a sequence with a hole.

        An earlier batch of that sequence failed for good (its partition is
        unresolved), and nothing sent before ``batch`` is still on its way to
        fill the gap; so an out-of-order reply to ``batch`` is final.
        """
        slot = (batch.topic, batch.partition)
        if slot not in self._unresolved:
            return False
        sequences = self._sequences.get(slot)
        if sequences is None or (sequences.producer_id, sequences.epoch) != batch.sequenced:
            return False
        pending = list(self._in_flight_batches.values()) + list(self._ready)
        return not any(
            b.order and b.order < batch.order and (b.topic, b.partition) == slot and b.sequenced == batch.sequenced
            for b in pending
        )

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
            self._completing += len(batches)
            self._condition.notify_all()
        self._finish_counted([(batch, -1, -1, error) for batch in batches])

    def _finish_counted(self, outcomes: list[tuple]) -> None:
        """``_finish`` each (batch, base offset, append time, error), then take them out of ``_completing``
        (the caller counted them in, under the lock, when it took them out of what flush() waits for).
        A callback's SystemExit or KeyboardInterrupt is raised once every batch is complete."""
        here = _completing_here()
        here.append(self)
        interrupt = None
        try:
            for outcome in outcomes:
                try:
                    _finish(*outcome)
                except BaseException as error:  # noqa: BLE001 (raised below, once the others are complete)
                    interrupt = interrupt or error
        finally:
            here.remove(self)
            with self._condition:
                self._completing -= len(outcomes)
                self._condition.notify_all()
        if interrupt is not None:
            raise interrupt

    def _refuse_wait_in_callback(self, call: str) -> bool:
        """Whether this thread is running callbacks of this producer's records; IllegalStateError if it is
        running any producer's callbacks while this producer has records buffered or in flight. (Call with
        the lock held.) Callbacks run on the thread that delivers replies (the local channel's reader,
        Ray's), which a wait for replies there would hold up for good; with nothing pending there is
        nothing to wait for, and the callbacks being run are not waited for."""
        here = _completing_here()
        if (here or threading.current_thread() is self._sender) and (self._open or self._ready or self._in_flight_total):
            raise IllegalStateError(
                f"{call} in a record's callback would wait for replies that the thread running the callback "
                "delivers: call it outside callbacks"
            )
        return self in here

    # --- transactions ----------------------------------------------------------------------------------

    def _send_transactional(
        self, topic: str, value, key=None, headers=None, partition: int | None = None, timestamp_ms: int | None = None
    ) -> RecordFuture:
        """send() for a transactional producer: only inside an open transaction."""
        if self._txn.state is not TxnClientState.IN_TRANSACTION:
            with self._lock:
                self._txn.check_send()
        return self._send_untransacted(topic, value, key, headers, partition, timestamp_ms)

    def _require_txn(self) -> TransactionManager:
        if self._txn is None:
            raise IllegalStateError("this producer has no transactional_id: transactions need Producer(bus, transactional_id=...)")
        if self._closed:
            raise IllegalStateError("the producer is closed")
        return self._txn

    def _coordinator_call(self, method: str, *args, deadline_s: float):
        """Call the transaction coordinator (the controller), retrying retriable errors until ``deadline_s``."""
        while True:
            remaining = deadline_s - time.monotonic()
            try:
                ref = getattr(self._bus.controller, method).remote(*args)
                return get(ref, timeout_s=max(0.001, min(remaining, self.request_timeout_s)))
            except LogbusError as error:
                if not error.retriable:
                    raise
                if time.monotonic() + RETRY_BACKOFF_S >= deadline_s:
                    raise RequestTimedOutError(
                        f"transactional id {self._txn.transactional_id!r}: {method} did not succeed in time: {error}"
                    ) from error
                time.sleep(RETRY_BACKOFF_S)

    def _deadline(self, timeout_s: float | None) -> float:
        _check_timeout(timeout_s)
        return time.monotonic() + (TRANSACTION_CALL_TIMEOUT_S if timeout_s is None else timeout_s)

    def _fail_txn(self, error: BaseException) -> None:
        with self._condition:
            self._txn.fail(error)
            self._condition.notify_all()

    def init_transactions(self, timeout_s: float | None = None) -> None:
        """Register the transactional id with the coordinator; call once, before the first transaction.

        Gets this instance's producer id and epoch. A previous instance with the
        same transactional id is fenced: its transaction, if one was open, is
        aborted, and its later sends and commit fail with ProducerFencedError.
        Raises RequestTimedOutError (retriable: call again) if the coordinator
        does not answer within ``timeout_s`` (default 60).
        """
        txn = self._require_txn()
        deadline = self._deadline(timeout_s)
        with self._condition:
            txn.begin_init()
        self._initialize(None, deadline)

    def _initialize(self, expected: tuple[int, int] | None, deadline_s: float) -> None:
        txn = self._txn
        try:
            producer_id, epoch = self._coordinator_call(
                "txn_init_producer_id", txn.transactional_id, txn.timeout_ms, expected, deadline_s=deadline_s
            )
        except LogbusError as error:
            if not error.retriable:
                self._fail_txn(error)
            raise
        with self._condition:
            # Every partition's sequence starts at 0 in the new epoch.
            self._producer_id, self._producer_epoch = producer_id, epoch
            self._sequences.clear()
            self._unresolved.clear()
            txn.initialized(producer_id, epoch)

    def begin_transaction(self) -> None:
        """Open a transaction: sends and offsets from now on commit or abort together. Local (no call)."""
        txn = self._require_txn()
        with self._condition:
            txn.begin()

    def send_offsets_to_transaction(self, offsets: dict, group_metadata, timeout_s: float | None = None) -> None:
        """Commit a consumer group's offsets as part of the transaction (the consume-transform-produce loop).

        ``offsets``: {TopicPartition: next offset to consume (int or
        OffsetAndMetadata)}. ``group_metadata``: ``consumer.group_metadata()``
        (the group's generation and member are checked, so a consumer that lost
        its partitions in a rebalance cannot commit through a transaction), or
        a group id for a consumer outside group management. The offsets become
        the group's committed offsets when the transaction commits, and never if
        it aborts. A failure other than a timeout leaves only abort_transaction().
        """
        txn = self._require_txn()
        deadline = self._deadline(timeout_s)
        with self._condition:
            txn.check_send()
        group = _group_metadata(group_metadata)
        if not isinstance(offsets, dict):
            raise InvalidConfigError(f"offsets must be a dict of {{TopicPartition: offset}}, not {type(offsets).__name__}")
        if not offsets:
            return
        try:
            self._coordinator_call(
                "txn_add_offsets", txn.transactional_id, txn.producer_id, txn.epoch, group[0], deadline_s=deadline
            )
            with self._condition:
                txn.offsets_added = True
            self._coordinator_call(
                "txn_offset_commit", txn.transactional_id, txn.producer_id, txn.epoch, group, dict(offsets), deadline_s=deadline
            )
        except LogbusError as error:
            if not isinstance(error, RequestTimedOutError) and not isinstance(error, ValueError):
                self._fail_txn(error)
            raise

    def commit_transaction(self, timeout_s: float | None = None) -> None:
        """Flush the transaction's records, then commit it: every record and offset becomes visible to
        read_committed readers together.

        If a send of the transaction failed, raises InvalidTxnStateError (its
        cause chained) and only abort_transaction() is allowed. A
        RequestTimedOutError may be retried by calling commit_transaction()
        again. ProducerFencedError: another instance took over (or the
        transaction timed out); close this producer.
        """
        txn = self._require_txn()
        deadline = self._deadline(timeout_s)
        self._flush_for_commit(txn, deadline)
        with self._condition:
            needs_end = txn.needs_end_txn
        if needs_end:
            self._end_txn(True, deadline)
        with self._condition:
            txn.completed()

    def abort_transaction(self, timeout_s: float | None = None) -> None:
        """Abort the transaction: its records are never visible to read_committed readers, its offsets
        never committed. Records not yet sent fail with TransactionAbortedError.

        Allowed after a failed send or commit (ABORTABLE_ERROR); not after a
        fence (ProducerFencedError). A RequestTimedOutError may be retried.
        """
        txn = self._require_txn()
        deadline = self._deadline(timeout_s)
        with self._condition:
            txn.begin_abort()
        self._fail_unsent()
        self._drain_transaction(deadline)
        self._fail_unsent()  # batches that a failed attempt put back meanwhile
        with self._condition:
            needs_end = txn.needs_end_txn
        if needs_end:
            self._end_txn(False, deadline)
        with self._condition:
            txn.completed()
            bump = txn.state is TxnClientState.INITIALIZING
        if bump:
            self._initialize((txn.producer_id, txn.epoch), deadline)

    def hand_over_transaction(self, timeout_s: float | None = None) -> tuple[str, int, int] | None:
        """Flush the open transaction and leave it open, for another process to end with
        :func:`end_transaction` (a two-phase write across processes: Ray Data's transactional
        TopicSink). Returns its handle (transactional id, producer id, epoch), or None if it holds
        nothing. The producer is then READY, and its close() does not abort the handed-over
        transaction; a later begin_transaction() would end it (use a new producer instead).

        Raises as commit_transaction() does when a send of the transaction failed.
        """
        txn = self._require_txn()
        deadline = self._deadline(timeout_s)
        self._flush_for_commit(txn, deadline)
        with self._condition:
            handle = (txn.transactional_id, txn.producer_id, txn.epoch) if txn.needs_end_txn else None
            txn.completed()
        return handle

    def _flush_for_commit(self, txn, deadline_s: float) -> None:
        """Move the transaction to COMMITTING, send and wait for every record, then raise the failure
        that ended the transaction meanwhile, if one did (a failed send)."""
        with self._condition:
            txn.begin_commit()
        self._drain_transaction(deadline_s)
        with self._condition:
            if txn.state is not TxnClientState.COMMITTING_TRANSACTION:
                txn.begin_commit()  # raises the failure that ended the transaction

    def _fail_unsent(self) -> None:
        """Fail every batch buffered and not in flight with TransactionAbortedError (the transaction aborts)."""
        txn = self._txn
        with self._condition:
            unsent = list(self._open.values()) + list(self._ready)
            self._open.clear()
            self._ready.clear()
            for batch in unsent:
                self._buffered_bytes -= batch.size_bytes
                if batch.sequenced is not None:
                    txn.epoch_bump_needed = True  # it may have been written: its sequence has a hole
            self._completing += len(unsent)
            self._condition.notify_all()
        aborted = TransactionAbortedError(f"transactional id {txn.transactional_id!r}: the transaction was aborted before this record was sent")
        self._finish_counted([(batch, -1, -1, aborted) for batch in unsent])

    def _drain_transaction(self, deadline_s: float) -> None:
        """Send everything buffered and wait for every reply; stop early (nothing in flight) once the
        transaction failed (its held batches never go)."""
        txn = self._txn
        with self._condition:
            self._flushing += 1
            self._condition.notify_all()
            try:
                callbacks = self._refuse_wait_in_callback("commit_transaction()")
                while self._open or self._ready or self._in_flight_total or (self._completing and not callbacks):
                    if not txn.sending_allowed and not self._in_flight_total and (not self._completing or callbacks):
                        return  # what is left is held for good (failed or aborting transaction)
                    remaining = deadline_s - time.monotonic()
                    if remaining <= 0:
                        raise RequestTimedOutError(f"transactional id {txn.transactional_id!r}: records not acknowledged in time")
                    self._condition.wait(min(remaining, 0.05))
            finally:
                self._flushing -= 1

    def _end_txn(self, commit: bool, deadline_s: float) -> None:
        txn = self._txn
        try:
            self._coordinator_call("txn_end", txn.transactional_id, txn.producer_id, txn.epoch, commit, deadline_s=deadline_s)
        except LogbusError as error:
            if not error.retriable:
                self._fail_txn(error)
            raise

    def _partitions_to_add(self) -> list | None:
        """Under the lock: the partitions the sender should add to the transaction now, if any."""
        txn = self._txn
        if txn is None or not txn.pending or not txn.sending_allowed or time.monotonic() < self._txn_add_not_before_s:
            return None
        return txn.take_pending()

    def _add_partitions(self, partitions: list) -> None:
        """AddPartitionsToTxn from the sender thread; their held batches go once it succeeds."""
        txn = self._txn
        try:
            get(
                self._bus.controller.txn_add_partitions.remote(txn.transactional_id, txn.producer_id, txn.epoch, partitions),
                timeout_s=self.request_timeout_s,
            )
        except Exception as error:  # noqa: BLE001 (routed to the transaction's state)
            error = unwrap(error)
            now = time.monotonic()
            with self._condition:
                txn.partitions_not_added(partitions)
                retriable = isinstance(error, LogbusError) and error.retriable
                if self._txn_add_failing_since_s is None:
                    self._txn_add_failing_since_s = now
                if not retriable or now - self._txn_add_failing_since_s > self.delivery_timeout_s:
                    txn.fail(error)
                self._txn_add_not_before_s = now + RETRY_BACKOFF_S
                self._condition.notify_all()
            return
        with self._condition:
            self._txn_add_failing_since_s = None
            txn.partitions_added(partitions)
            self._condition.notify_all()

    # --- flushing and closing ------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None, *, timeout: float | None = None) -> None:
        """Send everything buffered and wait until every record is acknowledged or failed: every future
        sent before is done, and its callbacks have run, when this returns (as in Kafka's producer).

        Raises RequestTimedOutError if that takes longer than ``timeout_s``
        seconds (None: no limit). ``timeout`` is kafka-python's name for it.
        """
        if timeout is not None:
            if timeout_s is not None:
                raise InvalidConfigError("flush() takes timeout_s or timeout (the same, in seconds), not both")
            timeout_s = timeout
        _check_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            self._flushing += 1
            self._condition.notify_all()
            try:
                callbacks = self._refuse_wait_in_callback("flush()")
                while self._open or self._ready or self._in_flight_total or (self._completing and not callbacks):
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
        if self._txn is not None and self._txn.state in (
            TxnClientState.IN_TRANSACTION, TxnClientState.ABORTABLE_ERROR, TxnClientState.ABORTING_TRANSACTION,
            TxnClientState.COMMITTING_TRANSACTION,
        ):
            try:  # as Kafka's: an open transaction is aborted (else the coordinator aborts it at its timeout)
                self.abort_transaction(timeout_s)
            except LogbusError as error:
                logger.warning("producer %s: its open transaction was not aborted on close: %r", self._txn.transactional_id, error)
        if self._txn is not None and self._txn.state is TxnClientState.FATAL_ERROR:
            self._abandon(copy_error(self._txn.error) if self._txn.error is not None else IllegalStateError("the producer was fenced"))
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


def end_transaction(bus: Bus, handle: tuple[str, int, int], commit: bool, timeout_s: float = TRANSACTION_CALL_TIMEOUT_S) -> None:
    """Commit (or abort) a transaction another process handed over (:meth:`Producer.hand_over_transaction`).

    Retries retriable errors until ``timeout_s``. ProducerFencedError: a newer
    instance of the transactional id took over, or the transaction timed out
    (the coordinator aborted it).
    """
    transactional_id, producer_id, epoch = handle
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            get(bus.controller.txn_end.remote(transactional_id, producer_id, epoch, bool(commit)), timeout_s=max(0.001, deadline - time.monotonic()))
            return
        except LogbusError as error:
            if not error.retriable or time.monotonic() + RETRY_BACKOFF_S >= deadline:
                raise
            time.sleep(RETRY_BACKOFF_S)


def _group_metadata(group_metadata) -> tuple[str, int, str, str | None]:
    """(group id, generation, member id, group instance id) from ``consumer.group_metadata()`` or a group id."""
    if isinstance(group_metadata, str):
        return group_metadata, -1, "", None
    try:
        return (
            group_metadata.group_id, int(group_metadata.generation_id), group_metadata.member_id or "",
            getattr(group_metadata, "group_instance_id", None),
        )
    except (AttributeError, TypeError, ValueError):
        raise InvalidConfigError(
            f"group_metadata must be consumer.group_metadata() or a group id, not {group_metadata!r}"
        ) from None


def _check_timeout(timeout_s) -> None:
    check_seconds("timeout_s", timeout_s, none_ok=True)


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
