"""Ray Data: read a topic's offset range as a Dataset, and write a Dataset into a topic.

``read_dataset(topic, start, end)`` returns a :class:`ray.data.Dataset` with the
schema of ``ray.data.read_kafka`` (:data:`SCHEMA`). The offset range of every
partition is resolved once, on the driver, when ``read_dataset`` is called:
the start and end offsets of all partitions are asked for together, so the
range is one consistent cut of the topic, errors in the arguments surface
before any task starts, and re-running the Dataset reads the same records.

There is one read task per partition. It calls the partition leader's
``fetch`` directly (actor handles pickle), keeps the next fetch in flight while
it decodes the current one, decodes whole batches with Arrow without copying
(:func:`~logbus.storage.record_batch.decode_batches`), slices them to
``[start, end)``, and yields blocks of about ``block_size_bytes``, so that
downstream consumers (Spark through RayDP above all) get a few large Arrow
blocks rather than many small ones.

Read tasks ask Ray for what ``num_cpus`` / ``ray_remote_args`` say (Ray Data's
default: one CPU each). They mostly wait on the replicas' fetches, so
``num_cpus=0`` is safe, and needed where something else holds every CPU of
the cluster for long (Spark's executors: :mod:`logbus.spark` reads with it);
at most :func:`task_slots` zero-CPU tasks run at once.

``TopicSink`` is a :class:`ray.data.Datasink`: ``ds.write_datasink(TopicSink(...))``
sends every block with one :class:`~logbus.api.producer.Producer` per write
task (``send_table``, then ``flush``), so no per-row Python runs on the path
unless rows are partitioned by key.

Offset specifications (``start`` / ``end``):

- ``"earliest"`` (the log start offset) / ``"latest"`` (the high watermark);
  ``start`` cannot be ``"latest"`` and ``end`` cannot be ``"earliest"`` (as in
  ``read_kafka`` and Spark's batch Kafka source);
- an ``int``: the same offset in every partition;
- a :class:`datetime.datetime`: per partition, the first offset whose timestamp
  is at or after it (a naive datetime is UTC); the high watermark when there
  is none;
- a ``{partition: offset}`` dict whose offsets are any of the above;
  partitions not listed take ``"earliest"`` (start) or ``"latest"`` (end).

As in ``read_kafka``, an end past the high watermark is cut to it, and a start
below the log start offset (records already deleted by retention) is raised to
it with a warning. A start past the high watermark, a start after the end,
and negative offsets raise :class:`~logbus.errors.OffsetOutOfRangeError`.

Transactions: ``isolation_level="read_committed"`` resolves ``"latest"`` (and
cuts every end) to the last stable offset instead of the high watermark, and
the read tasks fetch with that isolation level and drop the batches of
aborted transactions; transaction markers are never rows, at either level.
So a range's rows may be fewer than its offsets (markers, aborted records and
compaction's gaps take offsets), and read tasks declare no row count.

``timestamp_type`` uses ``ray.data.read_kafka``'s codes (confluent-kafka's):
1 for CreateTime, 2 for LogAppendTime (0, not available, never occurs).
Records of a LogAppendTime batch (a topic with ``message.timestamp.type`` =
LogAppendTime) carry the batch's append time, its max timestamp.
``logbus.spark.read`` maps the codes to Spark's (0 CreateTime, 1 LogAppendTime).
"""

from __future__ import annotations

import functools
import inspect
import logging
import posixpath
import time
from datetime import datetime, timezone
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data import Dataset
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasink, Datasource, ReadTask

from logbus.actors.fetcher import send_fetch, wait_reply
from logbus.actors.remote import get
from logbus.api.client import Bus, connect
from logbus.options import INT32_MAX, INT64_MAX, check_flag, check_int, check_number
from logbus.api.producer import Producer, end_transaction
from logbus.retry import Backoff
from logbus.errors import (
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    LeaderNotAvailableError,
    LogbusError,
    OffsetOutOfRangeError,
    TransactionAbortedError,
)
from logbus.protocol.messages import READ_COMMITTED, READ_UNCOMMITTED, FetchRequest
from logbus.protocol.transaction_coordinator import validate_transactional_id
from logbus.storage import record_batch as rb
from logbus.storage.isolation import isolation_level_code
from logbus.storage.names import validate_topic_name
from logbus.storage.tier import read_tier_files

logger = logging.getLogger(__name__)

EARLIEST = "earliest"
LATEST = "latest"

SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64()),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("timestamp", pa.int64()),  # ms since the epoch
        pa.field("timestamp_type", pa.int32()),  # 1 CreateTime, 2 LogAppendTime (read_kafka's codes)
        pa.field("headers", rb.HEADERS_TYPE),
    ]
)

FETCH_MAX_BYTES = 8 << 20  # per fetch; a fetch returns whole batches, at least one
# Blocks of 16 MiB are about 120,000 records of 100 bytes: few enough blocks for
# Spark (through RayDP each block becomes one Spark partition and one task).
BLOCK_SIZE_BYTES = 16 << 20
# How long a read task keeps retrying a partition whose leader is unavailable
# (restarting, or moving after a failover) before it gives up.
RETRY_TIMEOUT_S = 60.0
# A fetch below ``end`` that returns nothing means the high watermark went
# back (a leader change truncated the log): wait this long for it to return.
MISSING_RECORDS_WAIT_MS = 2_000


# --- argument checks (driver side) -------------------------------------------------------------


def check_bus(bus, *, optional: bool = True) -> None:
    """Raise InvalidConfigError unless ``bus`` is a Bus from :func:`logbus.connect` (or None when ``optional``)."""
    if (bus is None and optional) or isinstance(bus, Bus):
        return
    raise InvalidConfigError(f"bus must be a Bus from logbus.connect(){' or None' if optional else ''}, not {type(bus).__name__}")


@functools.cache
def producer_option_names() -> frozenset[str]:
    """The keyword arguments of :class:`~logbus.api.producer.Producer` (what producer options may name)."""
    return frozenset(name for name in inspect.signature(Producer).parameters if name != "bus")


def check_producer_options(options) -> dict:
    """``options`` (None or a dict of Producer keyword arguments) as a new dict; InvalidConfigError otherwise.

    Only the names are checked here; the Producer checks the values when it is built.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidConfigError(f"producer options must be a dict of Producer arguments, not {type(options).__name__}")
    unknown = sorted(repr(name) if not isinstance(name, str) else name for name in options if name not in producer_option_names())
    if unknown:
        raise InvalidConfigError(f"unknown producer options {unknown}; known: {sorted(producer_option_names())}")
    return dict(options)


@functools.cache
def _options_probe():
    """A remote function never called: its ``.options()`` checks task options the way Ray will."""

    def probe() -> None:  # pragma: no cover (never runs)
        return None

    return ray.remote(probe)


def check_task_options(num_cpus=None, ray_remote_args=None) -> None:
    """Raise InvalidConfigError unless ``num_cpus`` and ``ray_remote_args`` are options Ray takes for a task.

    Checked on the driver: Ray would otherwise refuse them only when the
    Dataset executes, with a bare ValueError or TypeError.
    """
    check_number("num_cpus", num_cpus, none_ok=True)
    if ray_remote_args is None:
        options = {}
    elif isinstance(ray_remote_args, dict) and all(isinstance(name, str) for name in ray_remote_args):
        options = dict(ray_remote_args)
    else:
        raise InvalidConfigError(f"ray_remote_args must be a dict of ray.remote options or None, not {ray_remote_args!r}")
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    try:
        _options_probe().options(**options)
    except (ValueError, TypeError, OverflowError) as error:
        raise InvalidConfigError(f"bad Ray task options {options!r}: {error}") from None


def task_slots() -> int:
    """How many zero-CPU tasks to run at once: the cluster's CPUs (what it would run at one CPU each).

    Ray does not count zero-CPU tasks against its CPUs, so nothing else
    bounds how many run at once (each in a worker process of its own).
    """
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


# --- offset resolution (driver side) ----------------------------------------------------------


def _to_ms(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _check_spec(spec, what: str, forbidden: str) -> None:
    """Raise InvalidConfigError unless ``spec`` is one offset specification (not a dict)."""
    if isinstance(spec, str):
        if spec not in (EARLIEST, LATEST):
            raise InvalidConfigError(f"{what} must be 'earliest', 'latest', an int, a datetime or a {{partition: offset}} dict, not {spec!r}")
        if spec == forbidden:
            raise InvalidConfigError(f"{what} cannot be {forbidden!r}")
    elif isinstance(spec, datetime):
        pass
    elif isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise OffsetOutOfRangeError(f"{what} must be a non-negative offset, not {spec}")
    else:
        raise InvalidConfigError(
            f"{what} must be 'earliest', 'latest', an int, a datetime or a {{partition: offset}} dict, not {spec!r}"
        )


def _per_partition(spec, what: str, default: str, forbidden: str, partition_count: int) -> list:
    """One offset specification per partition, checked."""
    if isinstance(spec, dict):
        specs = [default] * partition_count
        for partition, offset in spec.items():
            if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
                raise InvalidPartitionError(f"{what} keys must be partition numbers (int >= 0), not {partition!r}")
            if partition >= partition_count:
                # Not UnknownTopicError: that one is retriable, and a partition number the caller got wrong stays wrong.
                raise InvalidPartitionError(f"{what} names partition {partition}; the topic has partitions 0..{partition_count - 1}")
            _check_spec(offset, f"{what}[{partition}]", forbidden)
            specs[partition] = offset
        return specs
    _check_spec(spec, what, forbidden)
    return [spec] * partition_count


def resolve_offsets(
    bus: Bus, topic: str, start="earliest", end="latest", isolation_level: int = READ_UNCOMMITTED
) -> list[tuple[int, int]]:
    """Resolve ``start`` and ``end`` to ``[(start, end)]`` per partition, with one round of concurrent calls.

    See the module docstring for the accepted specifications and the errors. With
    ``isolation_level`` READ_COMMITTED, the bound is each partition's last stable offset.
    """
    check_bus(bus, optional=False)
    validate_topic_name(topic)
    metadata = bus.topic_metadata(topic, refresh=True)
    count = metadata.partition_count
    starts = _per_partition(start, "start", EARLIEST, LATEST, count)
    ends = _per_partition(end, "end", LATEST, EARLIEST, count)
    leaders = metadata.leaders
    for partition, leader in enumerate(leaders):
        if leader is None:
            raise LeaderNotAvailableError(f"{topic}-{partition} has no leader right now")
    # Every call goes out before any answer is awaited: one cut across the partitions.
    args = () if isolation_level == READ_UNCOMMITTED else (isolation_level,)
    offset_refs = [leader.offsets.remote(*args) for leader in leaders]
    time_refs = {}
    for partition, specs in enumerate(zip(starts, ends)):
        for spec in specs:
            if isinstance(spec, datetime):
                time_refs[(partition, spec)] = leaders[partition].offset_for_timestamp.remote(_to_ms(spec))
    bounds = [get(ref) for ref in offset_refs]
    by_time = {key: get(ref) for key, ref in time_refs.items()}

    ranges = []
    for partition, (log_start, high_watermark, _) in enumerate(bounds):

        def resolve(spec) -> int:
            if spec == EARLIEST:
                return log_start
            if spec == LATEST:
                return high_watermark
            if isinstance(spec, datetime):
                found = by_time[(partition, spec)]
                return high_watermark if found < 0 else found
            return spec

        first, last = resolve(starts[partition]), min(resolve(ends[partition]), high_watermark)
        if first > high_watermark:
            raise OffsetOutOfRangeError(
                f"start offset {first} of {topic}-{partition} is past its high watermark {high_watermark}"
            )
        if first < log_start:
            logger.warning(
                "start offset %d of %s-%d is below its log start offset %d (deleted by retention); reading from %d",
                first, topic, partition, log_start, log_start,
            )
            first = log_start
        if last < first:
            raise OffsetOutOfRangeError(
                f"end offset {last} of {topic}-{partition} is before its start offset {first} "
                f"(start={starts[partition]!r}, end={ends[partition]!r})"
            )
        ranges.append((first, last))
    return ranges


# --- reading (read task side) -----------------------------------------------------------------


def _records_to_rows(topic: str, partition: int, header: rb.BatchHeader, records: pa.RecordBatch, first: int) -> pa.RecordBatch:
    """One decoded (and sliced) batch as a record batch of SCHEMA; every column but four is a view."""
    count = records.num_rows
    timestamps = records.column(2)
    if header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME:
        timestamps = pa.array(np.full(count, header.max_timestamp_ms, np.int64))
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.arange(first, first + count, dtype=np.int64)),
            records.column(0),
            records.column(1),
            pa.repeat(pa.scalar(topic, pa.string()), count),
            pa.repeat(pa.scalar(partition, pa.int32()), count),
            timestamps,
            pa.repeat(pa.scalar(header.reader_timestamp_type, pa.int32()), count),
            records.column(3),
        ],
        schema=SCHEMA,
    )


def _tier_rows_to_rows(topic: str, partition: int, rows: pa.Table) -> pa.Table:
    """Rows read straight from a tier file as a table of SCHEMA."""
    count = rows.num_rows
    return pa.Table.from_arrays(
        [
            rows.column("offset"),
            rows.column("key"),
            rows.column("value"),
            pa.repeat(pa.scalar(topic, pa.string()), count),
            pa.repeat(pa.scalar(partition, pa.int32()), count),
            pc.divide(rows.column("timestamp").cast(pa.int64()), 1000),
            pc.add(rows.column("timestamp_type"), 1),  # the tier keeps Kafka's 0/1; read_kafka's codes are 1/2
            rows.column("headers"),
        ],
        schema=SCHEMA,
    )


def tier_parts(bus: Bus, topic: str, ranges: list[tuple[int, int]]) -> list[dict | None]:
    """For each partition's ``(start, end)``, the part its remote tier holds, readable from the tier's
    files directly (``PartitionReplica.tier_files``), or None; one round of concurrent calls."""
    leaders = bus.topic_metadata(topic).leaders
    refs = [leader.tier_files.remote(start, end) if start < end else None for leader, (start, end) in zip(leaders, ranges)]
    return [None if ref is None else get(ref) for ref in refs]


class _PartitionReader:
    """Reads ``[start, end)`` of one partition with one fetch kept in flight; retries while the leader is away."""

    def __init__(
        self, topic: str, partition: int, leader, namespace: str, data_dir: str, fetch_max_bytes: int,
        isolation_level: int = READ_UNCOMMITTED,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.leader = leader
        self.namespace = namespace
        self.data_dir = data_dir
        self.fetch_max_bytes = fetch_max_bytes
        self.isolation_level = isolation_level

    def _fetch(self, offset: int, max_wait_ms: int = 0):
        return send_fetch(self.leader, FetchRequest(offset, self.fetch_max_bytes, max_wait_ms, isolation_level=self.isolation_level))

    def _refresh_leader(self) -> None:
        metadata = connect(namespace=self.namespace, data_dir=self.data_dir).topic_metadata(self.topic, refresh=True)
        if metadata.leaders[self.partition] is not None:
            self.leader = metadata.leaders[self.partition]

    def batches(self, start: int, end: int, verify_crc: bool) -> Iterator[pa.RecordBatch]:
        offset = start
        pending = self._fetch(offset) if offset < end else None
        retries: Backoff | None = None  # after a retriable error, until RETRY_TIMEOUT_S after the first
        waited = False  # for records that should be there
        while pending is not None:
            try:
                meta, data, _ = wait_reply(pending)
            except LogbusError as error:
                if not error.retriable:
                    raise
                now = time.monotonic()
                if retries is None:
                    retries = Backoff(deadline_s=now + RETRY_TIMEOUT_S)
                delay_s = retries.delay_s(now)
                if delay_s is None:
                    raise
                time.sleep(delay_s)
                try:
                    self._refresh_leader()
                except LogbusError:
                    pass  # the controller may be restarting too; keep the old handle and retry
                pending = self._fetch(offset)
                continue
            retries = None
            if data is None:
                # Records below ``end`` were committed when the range was resolved; if the
                # high watermark went back since (a new leader truncated), wait for it once.
                if waited:
                    raise OffsetOutOfRangeError(
                        f"{self.topic}-{self.partition}: offsets up to {end} were committed when the read started, "
                        f"but the high watermark is now {meta.high_watermark} (the log was truncated)"
                    )
                waited = True
                pending = self._fetch(offset, MISSING_RECORDS_WAIT_MS)
                continue
            waited = False
            next_offset = min(meta.next_offset, end)
            # Ask for the next range before decoding this one, so the fetch overlaps the decode.
            pending = self._fetch(next_offset) if next_offset < end else None
            kept, _ = rb.slice_visible_batches(
                data, offset, end, read_committed=self.isolation_level == READ_COMMITTED,
                aborted=meta.aborted_transactions, verify_crc=verify_crc,
            )
            for header, first, records in kept:
                yield _records_to_rows(self.topic, self.partition, header, records, first)
            offset = next_offset


def _read_partition(
    topic: str,
    partition: int,
    leader,
    namespace: str,
    data_dir: str,
    start: int,
    end: int,
    fetch_max_bytes: int,
    block_size_bytes: int,
    verify_crc: bool,
    isolation_level: int = READ_UNCOMMITTED,
    tier: dict | None = None,
) -> Iterator[pa.Table]:
    """The body of one read task: blocks of about ``block_size_bytes`` covering ``[start, end)``; with
    ``tier`` (:func:`tier_parts`), its first part read from the remote tier's files."""
    if tier is not None:  # the part the remote tier holds, from its Parquet files, a row group at a time
        try:
            for rows in read_tier_files(tier["uri"], tier["directory"], tier["files"], start, tier["until"]):
                yield _tier_rows_to_rows(topic, partition, rows)
                start = rows.column("offset")[-1].as_py() + 1  # a failure after this goes on from here
            start = max(start, tier["until"])
        except LogbusError as error:  # files this host cannot reach (a tier on another host's disk): fetch instead
            logger.warning("%s-%d: reading the remote tier's files failed (%s); reading through the leader", topic, partition, error)
    reader = _PartitionReader(topic, partition, leader, namespace, data_dir, fetch_max_bytes, isolation_level)
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    for batch in reader.batches(start, end, verify_crc):
        pending.append(batch)
        pending_bytes += batch.nbytes
        if pending_bytes >= block_size_bytes:
            yield pa.Table.from_batches(pending, SCHEMA)
            pending, pending_bytes = [], 0
    if pending:
        yield pa.Table.from_batches(pending, SCHEMA)


class TopicDatasource(Datasource):
    """A bounded offset range of a topic as a Ray Data source: one read task per partition.

    The range is resolved in the constructor (on the driver); see the module docstring.
    """

    def __init__(
        self,
        topic: str,
        start="earliest",
        end="latest",
        bus: Bus | None = None,
        *,
        fetch_max_bytes: int = FETCH_MAX_BYTES,
        block_size_bytes: int = BLOCK_SIZE_BYTES,
        verify_crc: bool = True,
        isolation_level: str = "read_uncommitted",
    ) -> None:
        super().__init__()
        self._isolation = isolation_level_code(isolation_level)
        check_int("fetch_max_bytes", fetch_max_bytes, 1, INT32_MAX, unit="bytes")
        check_int("block_size_bytes", block_size_bytes, 1, INT64_MAX, unit="bytes")
        check_flag("verify_crc", verify_crc)
        check_bus(bus)
        bus = connect() if bus is None else bus
        self.topic = validate_topic_name(topic)
        self.ranges = resolve_offsets(bus, topic, start, end, self._isolation)
        self._leaders = bus.topic_metadata(topic).leaders
        # Tiered topics: the part of each range the remote tier holds is read from its files.
        self.tiers = tier_parts(bus, topic, self.ranges)
        tiered = sum(t["until"] - t["start"] for t in self.tiers if t is not None)
        if tiered:
            logger.info("%s: %d of %d offsets read from the remote tier's Parquet files", topic, tiered, self.num_rows)
        self._namespace = bus.namespace
        self._data_dir = bus.data_dir
        self._fetch_max_bytes = fetch_max_bytes
        self._block_size_bytes = block_size_bytes
        self._verify_crc = verify_crc

    @property
    def isolation_level(self) -> int:
        """READ_UNCOMMITTED (0) or READ_COMMITTED (1)."""
        return self._isolation

    @property
    def num_rows(self) -> int:
        """The offsets in the range: at least its rows (markers, aborted records and compacted gaps take
        offsets too)."""
        return sum(end - start for start, end in self.ranges)

    def get_name(self) -> str:
        return "Logbus"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def to_dataset(
        self, num_cpus: float | None = None, ray_remote_args: dict | None = None, concurrency: int | None = None
    ) -> Dataset:
        """The Dataset of this range (an empty one with SCHEMA when the range holds no record).

        ``num_cpus`` per read task (None: Ray Data's default, one CPU);
        ``concurrency``: at most this many read tasks at once (None: as many as
        the CPUs allow, or :func:`task_slots` for zero-CPU tasks).
        """
        check_task_options(num_cpus, ray_remote_args)
        check_int("concurrency", concurrency, none_ok=True)
        tasks = max(1, sum(1 for start, end in self.ranges if start < end))  # an empty range: one empty task
        if concurrency is None and (num_cpus == 0 or (ray_remote_args or {}).get("num_cpus") == 0):
            concurrency = task_slots()
        # One output stream per read task: without this Ray Data splits each task's
        # blocks into many small ones to reach its default minimum block count.
        dataset = ray.data.read_datasource(
            self, num_cpus=num_cpus, ray_remote_args=ray_remote_args, override_num_blocks=tasks,
            concurrency=None if concurrency is None else min(concurrency, tasks),
        )
        # And without this it merges them (copying) up to its own target of 128 MiB.
        # The Dataset has its own copy of the DataContext: nothing else changes.
        dataset.context.target_max_block_size = self._block_size_bytes
        return dataset

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list[ReadTask]:
        tasks = []
        for partition, (start, end) in enumerate(self.ranges):
            if start >= end:
                continue  # nothing to read: no task, no empty block (unless no partition has records)

            def read_fn(
                partition=partition, start=start, end=end, topic=self.topic, leader=self._leaders[partition],
                namespace=self._namespace, data_dir=self._data_dir, fetch_max_bytes=self._fetch_max_bytes,
                block_size_bytes=self._block_size_bytes, verify_crc=self._verify_crc, isolation_level=self._isolation,
                tier=self.tiers[partition],
            ):
                return _read_partition(
                    topic, partition, leader, namespace, data_dir, start, end, fetch_max_bytes, block_size_bytes, verify_crc,
                    isolation_level, tier,
                )

            metadata = BlockMetadata(
                # Unknown: transaction markers, aborted records (read_committed) and compacted gaps
                # take offsets of the range but are no rows (Dataset.count() reads instead).
                num_rows=None,
                size_bytes=None,
                input_files=[f"logbus://{self.topic}/{partition}"] + (
                    [posixpath.join(self.tiers[partition]["directory"], "data", name) for name, _, _ in self.tiers[partition]["files"]]
                    if self.tiers[partition] else []
                ),
                exec_stats=None,
            )
            tasks.append(ReadTask(read_fn, metadata, schema=SCHEMA, per_task_row_limit=per_task_row_limit))
        if not tasks:
            # One task of one empty block, not ray.data.from_arrow: its metadata task takes a
            # CPU whatever num_cpus says, and so would wait while Spark holds every CPU.
            metadata = BlockMetadata(num_rows=0, size_bytes=0, input_files=[f"logbus://{self.topic}"], exec_stats=None)
            tasks.append(ReadTask(lambda: [SCHEMA.empty_table()], metadata, schema=SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks


def read_dataset(
    topic: str,
    start="earliest",
    end="latest",
    bus: Bus | None = None,
    *,
    fetch_max_bytes: int = FETCH_MAX_BYTES,
    block_size_bytes: int = BLOCK_SIZE_BYTES,
    verify_crc: bool = True,
    num_cpus: float | None = None,
    ray_remote_args: dict | None = None,
    isolation_level: str = "read_uncommitted",
) -> Dataset:
    """Read ``[start, end)`` of every partition of ``topic`` as a Ray Dataset.

    Columns (as ``ray.data.read_kafka``): offset int64, key binary, value binary,
    topic string, partition int32, timestamp int64 (ms), timestamp_type int32,
    headers map<string, binary>. ``bus=None`` connects with :func:`logbus.connect`.

    The offsets are resolved now (see the module docstring); the records are
    read when the Dataset executes, in blocks of about ``block_size_bytes``
    (the Dataset's ``context.target_max_block_size`` is set to it). Raises UnknownTopicError, InvalidTopicError,
    InvalidConfigError, InvalidPartitionError or OffsetOutOfRangeError here, before any task starts.

    ``num_cpus`` and ``ray_remote_args`` go to each read task (checked here).
    Read tasks mostly wait on the replicas' fetches: ``num_cpus=0`` lets them
    run while other work (Spark's executors, say) holds every CPU of the
    cluster, where one-CPU tasks would wait for a CPU that never frees up.

    ``isolation_level``: "read_uncommitted" (the default) or "read_committed"
    (only committed transactions' records, up to each partition's last stable
    offset; see the module docstring).
    """
    check_task_options(num_cpus, ray_remote_args)
    datasource = TopicDatasource(
        topic, start, end, bus, fetch_max_bytes=fetch_max_bytes, block_size_bytes=block_size_bytes, verify_crc=verify_crc,
        isolation_level=isolation_level,
    )
    return datasource.to_dataset(num_cpus=num_cpus, ray_remote_args=ray_remote_args)


# --- writing ----------------------------------------------------------------------------------


def _is_binary_like(arrow_type: pa.DataType) -> bool:
    return (
        pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type) or pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type) or pa.types.is_null(arrow_type)
    )


def _is_entry_list(arrow_type: pa.DataType) -> bool:
    """list<struct<key: string, value: binary>>: headers as Spark's Kafka source spells them."""
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    item = arrow_type.value_type
    return pa.types.is_struct(item) and item.num_fields == 2 and [item.field(i).name for i in range(2)] == ["key", "value"]


def headers_to_map(array) -> pa.Array:
    """Headers as map<string, binary>, from a map or from a list of {key, value} structs (zero-copy where it can)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_map(array.type):
        return array.cast(rb.HEADERS_TYPE)
    if _is_entry_list(array.type):
        if pa.types.is_large_list(array.type):
            array = array.cast(pa.list_(array.type.value_type))
        offsets = array.offsets
        first = offsets[0].as_py()
        if first or array.offset:  # a slice: rebase the offsets (Arrow refuses sliced offsets with a null mask)
            offsets = pc.subtract(offsets, pa.scalar(first, offsets.type))
        entries = array.values.slice(first, offsets[-1].as_py())
        mask = array.is_null() if array.null_count else None
        return pa.MapArray.from_arrays(
            offsets, entries.field(0).cast(pa.string()), entries.field(1).cast(pa.binary()), mask=mask
        )
    if pa.types.is_null(array.type):
        return pa.nulls(len(array), rb.HEADERS_TYPE)
    raise InvalidRecordError(f"headers must be map<string, binary> or list<struct<key, value>>, not {array.type}")


def _is_timestamp_like(arrow_type: pa.DataType) -> bool:
    """What a timestamp column may hold: int ms since the epoch, an Arrow timestamp, or nulls only."""
    return pa.types.is_integer(arrow_type) or pa.types.is_timestamp(arrow_type) or pa.types.is_null(arrow_type)


def _timestamps_ms(array, column: str = "timestamp") -> pa.Array:
    """Timestamps as int64 ms; InvalidRecordError for other types and for values int64 cannot hold."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not _is_timestamp_like(array.type):
        raise InvalidRecordError(f"timestamp column {column!r} must hold int ms or Arrow timestamps, not {array.type}")
    try:
        if pa.types.is_timestamp(array.type):
            return array.cast(pa.timestamp("ms", array.type.tz), safe=False).cast(pa.int64())  # truncates to ms
        return array.cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:  # e.g. a uint64 beyond int64
        raise InvalidRecordError(f"timestamp column {column!r} of type {array.type} cannot be int64 ms: {error}") from None


class TopicSink(Datasink):
    """Writes a Dataset into a topic: ``ds.write_datasink(TopicSink("events", key_column="user"))``.

    Args:
        topic: an existing topic (checked now, on the driver).
        key_column: the column of record keys (binary or string), or None for keyless records.
        value_column: the column of record values (binary or string); required.
        bus: from :func:`logbus.connect`; None connects to the default.
        headers_column, timestamp_column, partition_column: used when the Dataset has a
            column of that name (None: never). Headers are map<string, binary> or
            list<struct<key, value>> (Spark's spelling); timestamps are int64 ms or an
            Arrow timestamp; partitions are ints in range. Rows without a partition go
            by key hash, or to one sticky partition per block.
        producer_options: keyword arguments for each write task's :class:`Producer`
            (names and values checked now: InvalidConfigError).

    Delivery: every write task flushes its producer and fails if any record
    failed, so a successful write means every record was acknowledged. A
    retried task sends its block again (at-least-once, as Kafka without
    idempotence). After the write, ``records_written`` holds the total.

    Transactional (``transactional_id``): each write task writes its blocks in
    a transaction of its own (transactional id ``{transactional_id}-{task
    index}``), flushes it, and leaves it open; once every task succeeded, the
    driver commits them all (``on_write_complete``). read_committed readers
    see nothing of the write until then, and nothing of a failed attempt: a
    retried task fences its earlier attempt (same transactional id), which
    aborts that attempt's transaction; a write that fails leaves its tasks'
    transactions to the coordinator, which aborts them after
    ``transaction_timeout_ms`` (default 60 s; it must exceed the write's
    duration) or when the next write with the same transactional id starts.
    The commits are one per task: if the coordinator aborted one before the
    driver commits it (its timeout passed), that one fails and the error
    names it, while the others commit.
    """

    def __init__(
        self,
        topic: str,
        key_column: str | None = None,
        value_column: str = "value",
        bus: Bus | None = None,
        *,
        headers_column: str | None = "headers",
        timestamp_column: str | None = "timestamp",
        partition_column: str | None = "partition",
        producer_options: dict | None = None,
        transactional_id: str | None = None,
    ) -> None:
        if not isinstance(value_column, str) or not value_column:
            raise InvalidConfigError(f"value_column must be a column name, not {value_column!r}")
        for name, column in (("key_column", key_column), ("headers_column", headers_column),
                             ("timestamp_column", timestamp_column), ("partition_column", partition_column)):
            if column is not None and (not isinstance(column, str) or not column):
                raise InvalidConfigError(f"{name} must be a column name or None, not {column!r}")
        check_bus(bus)
        self.producer_options = check_producer_options(producer_options)
        self.bus = connect() if bus is None else bus
        self.topic = validate_topic_name(topic)
        self.bus.topic_metadata(topic, refresh=True)  # UnknownTopicError now, not in a task
        self.key_column = key_column
        self.value_column = value_column
        self.headers_column = headers_column
        self.timestamp_column = timestamp_column
        self.partition_column = partition_column
        if transactional_id is not None:
            validate_transactional_id(transactional_id)
            if "transactional_id" in self.producer_options:
                raise InvalidConfigError("give the sink's transactional_id as its own argument, not in producer_options")
        self.transactional_id = transactional_id
        options = dict(self.producer_options)
        if transactional_id is not None:
            options["transactional_id"] = transactional_id
        Producer(self.bus, **options).close()  # bad producer option values fail now
        self.records_written = 0

    def get_name(self) -> str:
        return "Logbus"

    @property
    def min_bytes_per_write(self) -> int:
        return 4 << 20  # a few MiB per write task call: whole batches, few actor calls

    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        """Check the columns on the driver before any write task starts."""
        if schema is None:
            return
        if hasattr(schema, "base_schema"):
            schema = schema.base_schema
        names = list(schema.names)
        if self.value_column not in names:
            raise InvalidRecordError(f"the Dataset has no value column {self.value_column!r}; its columns are {names}")
        if not _is_binary_like(schema.field(self.value_column).type):
            raise InvalidRecordError(f"value column {self.value_column!r} must be binary or string, not {schema.field(self.value_column).type}")
        if self.key_column is not None:
            if self.key_column not in names:
                raise InvalidRecordError(f"the Dataset has no key column {self.key_column!r}; its columns are {names}")
            if not _is_binary_like(schema.field(self.key_column).type):
                raise InvalidRecordError(f"key column {self.key_column!r} must be binary or string, not {schema.field(self.key_column).type}")
        if self.headers_column in names:
            kind = schema.field(self.headers_column).type
            if not (pa.types.is_map(kind) or _is_entry_list(kind) or pa.types.is_null(kind)):
                raise InvalidRecordError(f"headers column {self.headers_column!r} must be map<string, binary> or list<struct<key, value>>, not {kind}")
        if self.timestamp_column in names and not _is_timestamp_like(schema.field(self.timestamp_column).type):
            raise InvalidRecordError(
                f"timestamp column {self.timestamp_column!r} must hold int ms or Arrow timestamps, not {schema.field(self.timestamp_column).type}"
            )
        if self.partition_column in names and not pa.types.is_integer(schema.field(self.partition_column).type):
            raise InvalidRecordError(f"partition column {self.partition_column!r} must hold ints, not {schema.field(self.partition_column).type}")

    def table_of(self, block) -> pa.Table:
        """The columns send_table takes, from one block."""
        table = BlockAccessor.for_block(block).to_arrow()
        names = table.schema.names
        if self.value_column not in names:
            raise InvalidRecordError(f"a block has no value column {self.value_column!r}; its columns are {names}")
        columns = {"value": table.column(self.value_column)}
        if self.key_column is not None:
            columns["key"] = table.column(self.key_column)
        if self.headers_column in names:
            columns["headers"] = headers_to_map(table.column(self.headers_column))
        if self.timestamp_column in names:
            columns["timestamp"] = _timestamps_ms(table.column(self.timestamp_column), self.timestamp_column)
        if self.partition_column in names:
            column = table.column(self.partition_column)
            if column.null_count:
                raise InvalidRecordError(f"partition column {self.partition_column!r} has nulls")
            columns["partition"] = column
        return pa.table(columns)

    def write(self, blocks, ctx):
        if self.transactional_id is not None:
            return self._write_transaction(blocks, ctx)
        producer = Producer(self.bus, **self.producer_options)
        futures, count = [], 0
        try:
            for block in blocks:
                table = self.table_of(block)
                if table.num_rows:
                    futures.append(producer.send_table(self.topic, table))
                    count += table.num_rows
            producer.flush()
        finally:
            producer.close()
        for future in futures:
            future.result()  # raises the first failed batch's error
        return count

    def _write_transaction(self, blocks, ctx) -> tuple[int, tuple | None]:
        """One task's blocks in a transaction left open for the driver to commit: (records, handle)."""
        transactional_id = f"{self.transactional_id}-{ctx.task_idx}"
        producer = Producer(self.bus, transactional_id=transactional_id, **self.producer_options)
        futures, count = [], 0
        try:
            producer.init_transactions()  # fences (and aborts) an earlier attempt of this task
            producer.begin_transaction()
            for block in blocks:
                table = self.table_of(block)
                if table.num_rows:
                    futures.append(producer.send_table(self.topic, table))
                    count += table.num_rows
            handle = producer.hand_over_transaction()
        finally:
            producer.close()  # aborts the transaction unless it was handed over
        for future in futures:
            future.result()
        return count, handle

    def on_write_complete(self, write_result) -> None:
        if self.transactional_id is None:
            self.records_written = sum(write_result.write_returns)
            return
        failures = []
        for _, handle in write_result.write_returns:
            if handle is None:
                continue
            try:
                end_transaction(self.bus, handle, commit=True)
            except LogbusError as error:
                failures.append(f"{handle[0]}: {error!r}")
        if failures:
            raise TransactionAbortedError(f"write tasks' transactions not committed: {failures}")
        self.records_written = sum(count for count, _ in write_result.write_returns)


def write_dataset(dataset: Dataset, topic: str, bus: Bus | None = None, *, key_column: str | None = None, value_column: str = "value", **sink_options) -> int:
    """Write ``dataset`` into ``topic`` through a :class:`TopicSink`; returns the number of records written.

    Unlike a bare ``write_datasink``, this checks the columns against the
    Dataset's schema before any task (read or write) starts.
    """
    sink = TopicSink(topic, key_column=key_column, value_column=value_column, bus=bus, **sink_options)
    schema = dataset.schema(fetch_if_missing=False)
    if schema is not None:
        sink.on_write_start(schema)
    dataset.write_datasink(sink)
    return sink.records_written
