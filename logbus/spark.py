"""Spark through RayDP: read a topic into a DataFrame, write a DataFrame into a topic.

    import logbus.spark

    spark = logbus.spark.init_spark("my-app")          # Spark executors as Ray actors
    df = logbus.spark.read(spark, "events")             # the Spark Kafka source's schema
    df.groupBy("key").count().show()
    logbus.spark.write(df.selectExpr("key", "upper(value) AS value"), "events-upper")
    logbus.spark.stop_spark()

In a session started by :func:`init_spark`, Spark reads and writes topics with
logbus's own data source (``logbus/jvm``, Java: ``spark.read.format("logbus")``,
``spark.readStream.format("logbus")`` through :func:`read_stream`, and
``df.write`` / ``writeStream.format("logbus")``): its executors fetch Arrow
batches from the leaders, and send them, with Ray cross-language calls, and
Spark gets columnar batches over the batches' own Arrow vectors. ``read``
plans the read here (offsets, the tiered part, the replicas) and hands the
plan to that source. The rest of this docstring is the path without it (a
session without the jar, or no JDK to build it):

``read`` goes topic -> :func:`logbus.api.dataset.read_dataset` (one Ray task per
partition, large Arrow blocks) -> one Arrow IPC stream per block -> RayDP's
``ray_dataset_to_spark_dataframe`` (the function behind ``Dataset.to_spark``),
whose executors read those streams in the JVM -> a cheap Spark projection to
the exact schema of Spark's Kafka source:

    key binary, value binary, topic string, partition int, offset long,
    timestamp timestamp, timestampType int [, headers array<struct<key string, value binary>>]

(``Dataset.to_spark`` itself hands RayDP Arrow tables, which RayDP converts
through pandas in Spark's Python workers: slower, and with pandas 3 it cannot
carry string or map columns; see :func:`to_spark`.)

The offsets are resolved when ``read`` is called and the records are read
into Ray's object store then (RayDP needs the blocks to build the DataFrame);
Spark reads them from there each time the DataFrame is evaluated, so the
DataFrame always holds the same records. As with ``Dataset.to_spark``, the
blocks stay in the object store until the Spark session stops.

``write`` goes DataFrame -> RayDP's recoverable conversion (what
``ray.data.from_spark`` runs: Arrow batches cached in the executors) -> one
Ray task per Spark partition sending it through a
:class:`~logbus.api.dataset.TopicSink`, with Spark's Kafka sink columns:
``value`` (required, string or binary) and optional ``key``, ``headers`` and
``partition``; other columns are ignored.

Spark's executors hold their CPUs for the session's life, so every Ray task
these functions start (read, Arrow stream, fetch and write tasks) asks for
no CPU: with ``init_spark(executor_cores=...)`` as large as Ray's CPU count,
one-CPU tasks would wait forever.

Environment (RayDP 1.6.5 on Java 17): :func:`init_spark` adds the JVM options
Spark needs on Java 17 to the driver, executor and RayDP app master options
(keeping the caller's), and points ``PYSPARK_PYTHON`` at this interpreter
when it is not set (RayDP's Python workers must import pyarrow and ray).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import uuid
from datetime import datetime

from logbus import jvm
from logbus.actors.remote import get, unwrap
from logbus.api.client import Bus, connect
from logbus.api.dataset import (
    EARLIEST,
    FETCH_MAX_BYTES,
    LATEST,
    TopicDatasource,
    TopicSink,
    check_bus,
    check_producer_options,
    task_slots,
)
from logbus.api.dataset import SCHEMA as DATASET_SCHEMA
from logbus.options import INT64_MAX, check_flag, check_int
from logbus.errors import IllegalStateError, InvalidConfigError, InvalidPartitionError, InvalidRecordError
from logbus.storage.names import validate_topic_name

# Packages of java.base that Spark 3.5 and RayDP open by reflection (Java 17 refuses without these).
_OPENED_PACKAGES = (
    "java.lang", "java.lang.invoke", "java.lang.reflect", "java.io", "java.net", "java.nio", "java.math",
    "java.text", "java.time", "java.util", "java.util.concurrent", "java.util.concurrent.atomic",
    "jdk.internal.misc", "sun.nio.ch", "sun.nio.cs", "sun.security.action", "sun.util.calendar",
)
JAVA_17_OPTIONS = " ".join(["-XX:+IgnoreUnrecognizedVMOptions"] + [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in _OPENED_PACKAGES])
JAVA_OPTION_KEYS = (
    "spark.driver.extraJavaOptions",
    "spark.executor.extraJavaOptions",
    "spark.ray.raydp_app_master.extraJavaOptions",
)

# Spark's Kafka source spells the offset bounds in JSON with these two sentinels.
SPARK_EARLIEST = -2
SMALL_READ_OFFSETS = 20_000  # a range of at most this many offsets is read in this process, not by Ray Data tasks,
SMALL_READ_BYTES = 64 << 20  # unless its records come to more than this: then the tasks read it after all
SPARK_LATEST = -1
JVM_FETCH_TIMEOUT_S = 30.0  # how long Spark's reader of a partition tries its replicas before the task fails

logger = logging.getLogger(__name__)

def spark_configs(configs: dict | None = None, ray_logs_dir: str | None = None) -> dict:
    """``configs`` with the Java 17 options merged in (ours first, so the caller's can override).

    ``ray_logs_dir``: the connected Ray session's log directory, given to the driver's JVM as
    ``ray.logging.dir``. RayDP's Java agent in that JVM writes its log there, and without the
    property uses ``/tmp/ray/session_latest/logs``: another session's (the machine's latest, not
    necessarily this one), and when that link dangles (its session was deleted) the agent fails and
    Spark does not start.
    """
    merged = {str(k): str(v) for k, v in (configs or {}).items()}
    for key in JAVA_OPTION_KEYS:
        theirs = merged.get(key, "").strip()
        ours = JAVA_17_OPTIONS
        if key == "spark.driver.extraJavaOptions" and ray_logs_dir and "-Dray.logging.dir=" not in theirs:
            ours = f"{ours} -Dray.logging.dir={ray_logs_dir}"
        merged[key] = f"{ours} {theirs}".strip()
    return merged


def _ray_logs_dir() -> str | None:
    """This driver's Ray session's log directory (None if Ray does not say)."""
    import ray

    try:
        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 (a Ray without it: RayDP's agent falls back to its default)
        return None


def init_spark(
    app_name: str = "logbus",
    num_executors: int = 1,
    executor_cores: int = 1,
    executor_memory: str | int = "1GB",
    configs: dict | None = None,
    **raydp_options,
):
    """Start Spark on Ray with RayDP (``raydp.init_spark``) and return the SparkSession.

    Starts a local Ray first if none is running (as RayDP does). Spark's
    executors are Ray actors of ``executor_cores`` CPUs each, held for the
    session's life; :func:`read`, :func:`write` and :func:`stream` start only
    zero-CPU Ray tasks, so the executors may take every CPU of the cluster.
    ``raydp_options`` go to ``raydp.init_spark`` (e.g. ``placement_group_strategy``).
    """
    import ray
    import raydp

    if not ray.is_initialized():
        ray.init()  # as raydp.init_spark would: here, so that the driver's options can name its session's logs
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    configs = dict(configs or {})
    try:
        jar = jvm.jar()
    except (IllegalStateError, OSError) as error:
        logger.warning("logbus: Spark will read topics through Ray Data, without logbus's data source: %s", error)
    else:
        theirs = str(configs.get("spark.jars", "")).strip()
        configs["spark.jars"] = f"{theirs},{jar}" if theirs else jar
    return raydp.init_spark(
        app_name, num_executors, executor_cores, executor_memory, configs=spark_configs(configs, _ray_logs_dir()), **raydp_options
    )


def stop_spark() -> None:
    """Stop the Spark session started by :func:`init_spark` (and its executor actors)."""
    import raydp

    raydp.stop_spark()


def check_spark(spark) -> None:
    """Raise IllegalStateError unless ``spark`` is a live SparkSession started through RayDP."""
    from pyspark.sql import SparkSession

    if spark is None:
        raise IllegalStateError("Spark is not started: pass the session from logbus.spark.init_spark(...)")
    if not isinstance(spark, SparkSession):
        raise IllegalStateError(f"expected a SparkSession from logbus.spark.init_spark(...), not {type(spark).__name__}")
    context = spark.sparkContext
    if getattr(context, "_jsc", None) is None:
        raise IllegalStateError("this Spark session was stopped: start one with logbus.spark.init_spark(...)")
    master = context.master or ""
    if not master.startswith("ray://"):
        raise IllegalStateError(
            f"this Spark session runs on {master!r}, not on Ray: logbus hands data to Spark through RayDP, "
            "so start the session with logbus.spark.init_spark(...)"
        )


# --- offsets in Spark's spelling -----------------------------------------------------------------


def _offsets(spec, topic: str, what: str, forbidden: str):
    """Translate Spark's offset spelling into read_dataset's; other specifications pass through.

    Accepts "earliest"/"latest", a JSON string or dict like {"topic": {"0": 23, "1": -2}}
    (-2 earliest, -1 latest), or anything read_dataset takes (int, datetime, {partition: offset}).
    """
    if isinstance(spec, str) and spec not in (EARLIEST, LATEST):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise InvalidConfigError(
                f"{what} must be 'earliest', 'latest' or JSON like {{\"{topic}\": {{\"0\": 23}}}}, not {spec!r}"
            ) from None
        if not isinstance(spec, dict):
            raise InvalidConfigError(f"{what} JSON must be an object of topics, not {spec!r}")
    if not (isinstance(spec, dict) and spec and all(isinstance(k, str) for k in spec)):
        return spec  # read_dataset's own spelling, checked there
    others = sorted(k for k in spec if k != topic)
    if others:
        raise InvalidConfigError(f"{what} names topics {others}; this read is of topic {topic!r} only")
    partitions = spec.get(topic)
    if not isinstance(partitions, dict):
        raise InvalidConfigError(f"{what}[{topic!r}] must map partitions to offsets, not {partitions!r}")
    translated = {}
    for partition, offset in partitions.items():
        try:
            number = int(partition)
        except (TypeError, ValueError):
            raise InvalidPartitionError(f"{what}[{topic!r}] has a partition {partition!r} that is not a number") from None
        if isinstance(offset, bool) or not isinstance(offset, int | datetime | str):
            raise InvalidConfigError(f"{what}[{topic!r}][{partition!r}] must be an offset, not {offset!r}")
        if offset == SPARK_EARLIEST:
            offset = EARLIEST
        elif offset == SPARK_LATEST:
            offset = LATEST
        if offset == forbidden:
            raise InvalidConfigError(
                f"{what}[{topic!r}][{partition!r}] cannot be {forbidden!r} "
                f"({SPARK_LATEST if forbidden == LATEST else SPARK_EARLIEST}) in a batch read"
            )
        translated[number] = offset
    return translated


# --- read -------------------------------------------------------------------------------------------


@functools.cache
def _arrow_stream_task():
    import ray

    # Zero CPUs, as the read and write tasks: Spark's executors may hold every CPU of the cluster.
    @ray.remote(num_cpus=0)
    def arrow_stream(table, columns: list[str]) -> bytes:
        """One block's ``columns`` as an Arrow IPC stream (:func:`_ipc_stream`)."""
        return _ipc_stream(table, columns)

    return arrow_stream


def _ipc_stream(table, columns: list[str]) -> bytes:
    """``columns`` of ``table`` as an Arrow IPC stream in a bytes object, the form RayDP's JVM reads directly."""
    import pyarrow as pa

    table = table.select(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _hand_to_spark(spark, refs: list, schema):
    """A DataFrame of ``schema`` over Arrow IPC streams in Ray's object store (``refs``)."""
    import ray
    from raydp.spark.dataset import ray_dataset_to_spark_dataframe
    from raydp.spark.ray_cluster_master import RAYDP_SPARK_MASTER_SUFFIX

    # The JVM gets only the objects' ids, so something must hold the references
    # for as long as Spark may read them: RayDP's master actor, which holds
    # Dataset.to_spark's blocks the same way, until the Spark session stops.
    master = ray.get_actor(spark.sparkContext.appName + RAYDP_SPARK_MASTER_SUFFIX)
    ray.get(master.add_objects.remote(uuid.uuid4().hex, refs))
    return ray_dataset_to_spark_dataframe(spark, schema, refs)


def _small_to_spark(spark, source: TopicDatasource, schema):
    """A small range, read here rather than by Ray Data: its planning and tasks cost more than the read
    (a micro-batch trigger over a few records). The same reads the tasks make, in this process, then
    one IPC stream through the object store, as :func:`to_spark` hands Spark its blocks. None if its
    records come to more than SMALL_READ_BYTES (the caller has the tasks read it)."""
    import pyarrow as pa
    import ray

    tables, size = [], 0
    for task in source.get_read_tasks(1):
        for block in task():
            tables.append(block)
            size += block.nbytes
            if size > SMALL_READ_BYTES:
                return None  # large records: not small after all
    # (A range of only transaction markers, aborted or compacted records yields no block.)
    table = pa.concat_tables(tables) if tables else DATASET_SCHEMA.empty_table()
    return _hand_to_spark(spark, [ray.put(_ipc_stream(table, list(schema.names)))], schema)


def to_spark(spark, dataset, schema):
    """Hand a Dataset of Arrow blocks to Spark as Arrow IPC streams (RayDP's JVM-side reader).

    ``Dataset.to_spark`` gives RayDP the Arrow tables themselves, which RayDP
    turns into rows with a pandas UDF in Spark's Python workers (every value a
    Python object, and with pandas 3 neither string nor map columns survive).
    RayDP's same entry point, given blocks that are IPC stream bytes, reads
    them in the executors' JVM with Arrow's Java reader instead: no Python
    worker, no per-row Python, every Arrow type Spark knows. One zero-CPU Ray
    task per block writes the stream of ``schema``'s columns (one copy); at
    most :func:`~logbus.api.dataset.task_slots` of them run at once.
    """
    import ray

    arrow_stream = _arrow_stream_task()
    columns = list(schema.names)
    slots = task_slots()
    refs, running = [], []
    for block in dataset.to_arrow_refs():
        if len(running) >= slots:
            _, running = ray.wait(running, num_returns=len(running) - slots + 1)
        refs.append(arrow_stream.remote(block, columns))
        running.append(refs[-1])
    if not refs:
        raise IllegalStateError("to_spark needs a Dataset with at least one block")
    return _hand_to_spark(spark, refs, schema)


def read(
    spark,
    topic: str,
    starting_offsets="earliest",
    ending_offsets="latest",
    include_headers: bool = False,
    bus: Bus | None = None,
    isolation_level: str = "read_uncommitted",
):
    """Read ``[starting_offsets, ending_offsets)`` of ``topic`` as a Spark DataFrame.

    Offsets: "earliest", "latest", Spark's JSON spelling (a string or dict,
    ``{"topic": {"0": 23, "1": -2}}``, -2 earliest, -1 latest; partitions not
    named take earliest / latest), or what :func:`logbus.api.dataset.read_dataset`
    takes. Bad arguments raise before any task starts: IllegalStateError
    (Spark not started), UnknownTopicError, InvalidConfigError,
    InvalidPartitionError (a partition the topic does not have), OffsetOutOfRangeError.

    The read tasks take no CPU (they mostly wait on the replicas' fetches), so
    a read runs even while Spark's executors hold every CPU of the cluster
    (``init_spark(executor_cores=...)`` as large as Ray's CPU count).

    ``isolation_level`` (Spark's ``kafka.isolation.level``): "read_uncommitted"
    (the default) or "read_committed": only records of committed transactions
    (and of none), up to each partition's last stable offset ("latest" means
    that offset). Transaction markers are never rows.
    """
    validate_topic_name(topic)
    check_flag("include_headers", include_headers)
    check_bus(bus)
    start = _offsets(starting_offsets, topic, "starting_offsets", LATEST)
    end = _offsets(ending_offsets, topic, "ending_offsets", EARLIEST)
    check_spark(spark)
    source = TopicDatasource(topic, start, end, bus, isolation_level=isolation_level)
    if source.num_rows == 0:
        return spark.createDataFrame([], kafka_schema(include_headers))
    tiered, source = _tiered_part(spark, source, topic, bus, isolation_level, include_headers)
    # Zero-CPU read tasks: Spark's executors (Ray actors of executor_cores CPUs each) keep
    # their CPUs for the session's life, and one-CPU read tasks waited forever for them
    # when they held all of Ray's CPUs. The executors sit idle while the read runs.
    schema = DATASET_SCHEMA
    if not include_headers:
        # Dropped in the stream-writing tasks, not by a Ray Data projection (another stage of tasks).
        schema = schema.remove(schema.get_field_index("headers"))
    native = None if source is None else _jvm_read(spark, source, bus, include_headers)
    if native is not None and tiered is None:
        return native
    if source is None or native is not None:
        df = tiered
    else:
        df = _small_to_spark(spark, source, schema) if source.num_rows <= SMALL_READ_OFFSETS else None
        if df is None:
            df = to_spark(spark, source.to_dataset(num_cpus=0), schema)
        if tiered is not None:
            df = tiered.unionByName(df)
    df = _as_kafka_rows(df, include_headers)
    return df if native is None else df.unionByName(native)


def _as_kafka_rows(df, include_headers: bool):
    """A DataFrame of the Dataset's columns (``logbus.api.dataset.SCHEMA``) in the Kafka source's schema."""
    from pyspark.sql import functions as F

    columns = [
        F.col("key"),
        F.col("value"),
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.timestamp_millis(F.col("timestamp")).alias("timestamp"),
        # Spark's Kafka source uses Kafka's Java codes (0 CreateTime, 1 LogAppendTime, -1 none);
        # the Dataset has read_kafka's (1, 2, 0).
        (F.col("timestamp_type") - 1).cast("int").alias("timestampType"),
    ]
    if include_headers:
        # map_entries gives non-null keys and entries; the Kafka source's type allows nulls.
        headers_type = kafka_schema(True)["headers"].dataType
        columns.append(F.map_entries(F.col("headers")).cast(headers_type).alias("headers"))
    return df.select(*columns)


def _jvm_read(spark, source: TopicDatasource, bus, include_headers: bool):
    """The range of ``source`` through logbus's Java data source (``logbus/jvm``): Spark's executors fetch
    each partition from its leader with Ray cross-language calls and read its Arrow batches in place.
    None when this session was started without the data source's jar, or a partition has no replica
    on a live node (then Ray Data reads it)."""
    if not jvm.in_session(spark):
        return None
    bus = connect() if bus is None else bus
    partitions = get(bus.request_metadata(source.topic))["partitions"]
    planned = []
    for p, (start, end) in enumerate(source.ranges):
        if start < end:
            names = partitions[p].get("replica_names") or []
            if not names:
                return None  # no replica on a live node now: the Ray Data reader waits for one
            planned.append({"partition": p, "start": start, "end": end, "replicas": names})
    plan = {
        "topic": source.topic,
        "namespace": bus.namespace,
        "isolation": source.isolation_level,
        "includeHeaders": include_headers,
        "fetchMaxBytes": FETCH_MAX_BYTES,
        "timeoutMs": int(JVM_FETCH_TIMEOUT_S * 1000),
        "partitions": planned,
    }
    return spark.read.format("logbus").option("logbus.plan", json.dumps(plan)).load()


def _tiered_part(spark, source: TopicDatasource, topic: str, bus, isolation_level: str, include_headers: bool):
    """(DataFrame of the range's part the remote tier holds, read by Spark's own Parquet reader, or None;
    the source of the rest, or None when nothing is left). Only for a tier on a filesystem this driver
    reads (``file://``, every file present): Spark's executors then read the same paths."""
    from pyspark.sql import functions as F

    parts = {p: t for p, t in enumerate(source.tiers) if t is not None and t["uri"].startswith("file://") and t["files"]}
    paths = {p: [os.path.join(t["directory"], "data", name) for name, _, _ in t["files"]] for p, t in parts.items()}
    if not parts or not all(os.path.exists(path) for files in paths.values() for path in files):
        return None, source
    # Files wholly inside their partition's range are read as they are (Spark counts them from their
    # footers); the others through a filter on the range.
    whole = [p for p, t in parts.items() if t["files"][0][1] == t["start"] and t["files"][-1][2] == t["until"]]
    ranges = None
    for p, t in parts.items():
        if p not in whole:
            condition = (F.col("partition") == p) & (F.col("offset") >= t["start"]) & (F.col("offset") < t["until"])
            ranges = condition if ranges is None else ranges | condition
    columns = [
        F.col("offset"), F.col("key"), F.col("value"), F.lit(topic).alias("topic"), F.col("partition"),
        F.unix_millis(F.col("timestamp")).alias("timestamp"),
        (F.col("timestamp_type") + 1).cast("int").alias("timestamp_type"),  # as the Dataset's codes
    ]
    if include_headers:
        columns.append(F.col("headers"))
    tiered = None
    if whole:
        tiered = spark.read.parquet(*(path for p in whole for path in paths[p])).select(*columns)
    if ranges is not None:
        cut = spark.read.parquet(*(path for p in parts if p not in whole for path in paths[p])).where(ranges).select(*columns)
        tiered = cut if tiered is None else tiered.unionByName(cut)
    rest = {p: (parts[p]["until"] if p in parts else start, end) for p, (start, end) in enumerate(source.ranges)}
    if all(start >= end for start, end in rest.values()):
        return tiered, None
    starts = {p: start for p, (start, _) in rest.items()}
    ends = {p: max(start, end) for p, (start, end) in rest.items()}
    return tiered, TopicDatasource(topic, starts, ends, bus, isolation_level=isolation_level)


def kafka_schema(include_headers: bool = False):
    """The schema of Spark's Kafka source (and of :func:`read`)."""
    from pyspark.sql.types import (
        ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType, TimestampType,
    )

    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
    if include_headers:
        header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
        fields.append(StructField("headers", ArrayType(header)))
    return StructType(fields)


# --- write ------------------------------------------------------------------------------------------


def _check_columns(df) -> list[str]:
    """The columns of ``df`` to send, after checking their types the way Spark's Kafka sink does."""
    from pyspark.sql.types import ArrayType, BinaryType, IntegerType, LongType, ShortType, ByteType, StringType, StructType

    types = {field.name: field.dataType for field in df.schema.fields}
    if "value" not in types:
        raise InvalidRecordError(f"a DataFrame to write needs a 'value' column (string or binary); it has {list(types)}")
    for name in ("value", "key"):
        if name in types and not isinstance(types[name], StringType | BinaryType):
            raise InvalidRecordError(f"column {name!r} must be string or binary, not {types[name].simpleString()}")
    if "headers" in types:
        kind = types["headers"]
        element = kind.elementType if isinstance(kind, ArrayType) else None
        if not (isinstance(element, StructType) and [f.name for f in element.fields] == ["key", "value"]):
            raise InvalidRecordError(
                f"column 'headers' must be array<struct<key: string, value: binary>>, not {kind.simpleString()}"
            )
    if "partition" in types and not isinstance(types["partition"], IntegerType | LongType | ShortType | ByteType):
        raise InvalidRecordError(f"column 'partition' must be an int, not {types['partition'].simpleString()}")
    return [name for name in ("value", "key", "headers", "partition") if name in types]


@functools.cache
def _write_block_task():
    import ray

    @ray.remote(num_cpus=0)
    def write_block(sink: TopicSink, table) -> int:
        """Send one Spark partition's Arrow table through ``sink`` (flushed: every record acknowledged)."""
        return sink.write([table], None)

    return write_block


def _write_partitions(df, sink: TopicSink) -> int:
    """Send every partition of ``df`` through ``sink``, one zero-CPU Ray task each; returns the records written.

    RayDP's recoverable conversion, as ``ray.data.from_spark`` runs it: Spark
    caches each partition's rows as Arrow in its executor, and a Ray task
    fetches them from the executor actor. ``ray.data.from_spark`` ends with
    ``ray.data.from_arrow_refs``, whose metadata tasks take one CPU each and
    so wait forever while Spark's executors hold every CPU of the cluster;
    here the fetch (RayDP's own task function) and the write tasks take none,
    and at most :func:`~logbus.api.dataset.task_slots` partitions are in
    flight. The cached partitions are released at the end, as
    ``release_spark_recoverable`` does.
    """
    import ray
    from pyspark.storagelevel import StorageLevel
    from ray.exceptions import RayTaskError
    from raydp.spark.dataset import _fetch_arrow_table_from_executor

    context = df.sparkSession.sparkContext
    writer = context._jvm.org.apache.spark.sql.raydp.ObjectStoreWriter
    info = writer.prepareRecoverableRDD(df._jdf, context._getJavaStorageLevel(StorageLevel.MEMORY_AND_DISK))
    rdd_id = info.rddId()
    try:
        locations, schema_json, agent_url = info.locations(), info.schemaJson(), info.driverAgentUrl()
        fetch = _fetch_arrow_table_from_executor.options(num_cpus=0)
        write_block = _write_block_task()
        sink_ref = ray.put(sink)
        slots = task_slots()
        running, written = [], 0
        try:
            for partition in range(info.numPartitions()):
                if len(running) >= slots:
                    done, running = ray.wait(running, num_returns=1)
                    written += ray.get(done[0])
                table = fetch.remote(f"raydp-executor-{locations[partition]}", rdd_id, partition, schema_json, agent_url)
                running.append(write_block.remote(sink_ref, table))
            written += sum(ray.get(running))
        except RayTaskError as error:
            raise unwrap(error) from None  # the sink's own error (InvalidPartitionError, ...), not Ray's wrapper
    finally:
        writer.releaseRecoverableRDD(rdd_id)
    return written


def _send_partitions(df, topic: str, producer, sinks: dict, bus: Bus) -> int:
    """Send every partition of ``df`` through ``producer`` (a transactional one, in this process), in
    the transaction it has open; returns the records sent. The partitions' Arrow tables come from
    Spark's executors as in :func:`_write_partitions`, and go out with send_table."""
    import ray
    from pyspark.storagelevel import StorageLevel
    from raydp.spark.dataset import _fetch_arrow_table_from_executor

    columns = _check_columns(df)
    keyed = "key" in columns
    sink = sinks.get(keyed)
    if sink is None:  # (one per stream and key presence: a sink checks the topic and options when made)
        sink = sinks[keyed] = TopicSink(
            topic, key_column="key" if keyed else None, value_column="value", bus=bus,
            headers_column="headers", timestamp_column=None, partition_column="partition",
        )
    df = df.select(*columns)
    context = df.sparkSession.sparkContext
    writer = context._jvm.org.apache.spark.sql.raydp.ObjectStoreWriter
    info = writer.prepareRecoverableRDD(df._jdf, context._getJavaStorageLevel(StorageLevel.MEMORY_AND_DISK))
    rdd_id = info.rddId()
    futures, sent = [], 0
    try:
        locations, schema_json, agent_url = info.locations(), info.schemaJson(), info.driverAgentUrl()
        fetch = _fetch_arrow_table_from_executor.options(num_cpus=0)
        refs = [fetch.remote(f"raydp-executor-{locations[p]}", rdd_id, p, schema_json, agent_url) for p in range(info.numPartitions())]
        for ref in refs:
            table = sink.table_of(ray.get(ref))
            if table.num_rows:
                futures.append(producer.send_table(topic, table))
                sent += table.num_rows
    finally:
        writer.releaseRecoverableRDD(rdd_id)
    for future in futures:
        future.result()  # the first failed batch's error (the transaction then aborts)
    return sent


def write(df, topic: str, bus: Bus | None = None, **producer_options) -> int:
    """Write the rows of ``df`` into ``topic``; returns the number of records written.

    Columns as Spark's Kafka sink: ``value`` (string or binary, required),
    optional ``key`` (string or binary), ``headers`` (array<struct<key string,
    value binary>>) and ``partition`` (int); others (``topic`` included) are
    ignored. Rows without a partition go by key hash (Kafka's murmur2), or to a
    sticky partition when keyless. ``producer_options`` go to each write task's
    :class:`~logbus.api.producer.Producer`. Bad arguments raise before any Spark
    job: IllegalStateError (Spark not started), UnknownTopicError, InvalidRecordError,
    InvalidConfigError.

    In a session with logbus's jar (:func:`init_spark`) and no
    ``producer_options``, Spark's executors write it themselves
    (``df.write.format("logbus")``: Arrow batches to the leaders, acks=all, in
    order per partition, at least once: a batch sent again after a lost reply,
    or by a task Spark runs again, is written twice; the writer has no producer
    id). Give ``producer_options`` (``enable_idempotence=True``, say) for the
    Producer's guarantees instead. Otherwise one Ray task per Spark
    partition sends it (see :func:`_write_partitions`) with a Producer; like
    :func:`read`'s tasks they take no CPU, so a write runs even while Spark's
    executors hold every CPU of the cluster.
    """
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        raise InvalidRecordError(f"write takes a Spark DataFrame, not {type(df).__name__}")
    validate_topic_name(topic)
    check_bus(bus)
    producer_options = check_producer_options(producer_options)
    check_spark(df.sparkSession)
    columns = _check_columns(df)
    if not producer_options and jvm.in_session(df.sparkSession):
        return _jvm_write(df.select(*columns), topic, bus)
    sink = TopicSink(
        topic,
        key_column="key" if "key" in columns else None,
        value_column="value",
        bus=bus,
        headers_column="headers",
        timestamp_column=None,  # Spark's Kafka sink has no timestamp column either
        partition_column="partition",
        producer_options=producer_options,
    )
    return _write_partitions(df.select(*columns), sink)


def _jvm_write(df, topic: str, bus) -> int:
    """``df`` into ``topic`` through logbus's Java data source: each Spark task frames its rows as Arrow
    batches and sends them to the leaders by Ray cross-language calls (acks=all). The count comes
    from the write's commit in the driver's JVM."""
    from pyspark.sql import functions as F

    bus = connect() if bus is None else bus
    bus.topic_metadata(topic)  # UnknownTopicError before any Spark job
    # The types the writer takes (the checks above let an integral partition and any header names in).
    if "partition" in df.columns:
        df = df.withColumn("partition", F.col("partition").cast("int"))
    if "headers" in df.columns:
        df = df.withColumn("headers", F.col("headers").cast(kafka_schema(True)["headers"].dataType))
    write_id = uuid.uuid4().hex
    (
        df.write.format("logbus").mode("append")
        .option("topic", topic).option("logbus.namespace", bus.namespace).option("logbus.writeId", write_id)
        .save()
    )
    written = int(df.sparkSession.sparkContext._jvm.io.logbus.spark.LogbusWrite.written(write_id))
    if written < 0:
        raise IllegalStateError(f"Spark's write into {topic} ended without its commit (no count of records written)")
    return written


# --- stream -----------------------------------------------------------------------------------------


def read_stream(
    spark,
    topic: str,
    starting_offsets="latest",
    max_offsets_per_trigger: int | None = None,
    fail_on_data_loss: bool = True,
    include_headers: bool = False,
    isolation_level: str = "read_uncommitted",
    bus: Bus | None = None,
):
    """``topic`` as a streaming DataFrame: ``spark.readStream.format("logbus")`` with these options.

    Spark plans each micro-batch itself (logbus's Java source, ``logbus/jvm``):
    its checkpoint (``writeStream.option("checkpointLocation", ...)``) holds
    each batch's offsets, so a restarted query reads a batch it planned again
    from the same offsets; with a sink that writes a batch id once (a file
    sink, ``foreachBatch`` keyed by batch id) each record comes out once. The
    options are the Kafka source's (``startingOffsets``: "earliest", "latest"
    or its JSON; ``maxOffsetsPerTrigger``; ``failOnDataLoss``; ``includeHeaders``;
    ``kafka.isolation.level``) and so is the schema (:func:`kafka_schema`).
    IllegalStateError when the session was started without logbus's jar
    (start it with :func:`init_spark`).
    """
    validate_topic_name(topic)
    check_flag("include_headers", include_headers)
    check_flag("fail_on_data_loss", fail_on_data_loss)
    check_bus(bus)
    check_spark(spark)
    if isolation_level not in ("read_uncommitted", "read_committed"):
        raise InvalidConfigError(f"isolation_level must be read_uncommitted or read_committed, not {isolation_level!r}")
    if max_offsets_per_trigger is not None:
        check_int("max_offsets_per_trigger", max_offsets_per_trigger, 1, INT64_MAX)
    if not jvm.in_session(spark):
        raise IllegalStateError("this Spark session has no logbus data source: start it with logbus.spark.init_spark(...)")
    if isinstance(starting_offsets, dict):
        starting_offsets = json.dumps(starting_offsets)
    namespace = (connect() if bus is None else bus).namespace
    reader = (
        spark.readStream.format("logbus")
        .option("subscribe", topic)
        .option("logbus.namespace", namespace)
        .option("startingOffsets", str(starting_offsets))
        .option("failOnDataLoss", str(fail_on_data_loss).lower())
        .option("includeHeaders", str(include_headers).lower())
        .option("kafka.isolation.level", isolation_level)
    )
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return reader.load()


def stream(
    spark,
    topic: str,
    group_id: str,
    process_batch,
    max_offsets_per_trigger: int | None = None,
    trigger_interval_s: float = 5.0,
    starting_offsets: str = "earliest",
    include_headers: bool = False,
    bus: Bus | None = None,
    until_caught_up: bool = False,
    max_batches: int | None = None,
    progress=None,
    output_topic: str | None = None,
    transactional_id: str | None = None,
    producer_options: dict | None = None,
):
    """Micro-batches of ``topic`` as DataFrames, in the ``foreachBatch`` style; returns the running stream.

    Each trigger plans the group's next offset range and records the plan in
    the group's commits, reads the range as a DataFrame (the Kafka source's
    schema), calls ``process_batch(df, batch_id)``, and commits the group's
    offsets only after it returned: a failure leaves them uncommitted, so a
    restarted stream runs that batch again with the same batch id over the
    same offsets, whatever arrived meanwhile (at least once; exactly once for
    a sink that skips a batch id it already wrote).
    Progress (records, rate, lag) is reported per batch to ``progress``
    (default: a line on stderr). Stop it with ``.stop()``; wait with
    ``.await_termination()``, which re-raises the error that ended it.
    ``until_caught_up`` ends the stream at the first trigger with nothing to do.
    See :mod:`logbus.api.streaming`.

    Exactly once into a topic: with ``output_topic`` and ``transactional_id``,
    ``process_batch(df, batch_id)`` returns the DataFrame to write (columns as
    :func:`write`), and each batch writes it into ``output_topic`` and commits
    its input offsets in one transaction: a batch restarted after its write
    and before its commit aborts the first write (read_committed readers never
    see it) and writes again, so each output record is visible once. The rows
    travel from Spark's executors to this process's transactional producer
    (one producer, so one transaction per batch).
    """
    from logbus.api.streaming import MicroBatchStream, log_progress

    if not callable(process_batch):
        raise InvalidConfigError("process_batch must be a callable taking (DataFrame, batch_id)")
    check_flag("include_headers", include_headers)
    check_spark(spark)

    if (output_topic is None) != (transactional_id is None):
        raise InvalidConfigError("output_topic and transactional_id go together (a transactional write of the batch's output)")
    if output_topic is not None:
        validate_topic_name(output_topic)
    sinks: dict = {}

    def run_batch(start: dict, end: dict, batch_id: int, producer=None) -> None:
        df = read(spark, topic, starting_offsets=start, ending_offsets=end, include_headers=include_headers, bus=micro.bus)
        output = process_batch(df, batch_id)
        if producer is not None:
            from pyspark.sql import DataFrame

            if not isinstance(output, DataFrame):
                raise InvalidRecordError(f"process_batch must return the DataFrame to write into {output_topic!r}, not {type(output).__name__}")
            _send_partitions(output, output_topic, producer, sinks, micro.bus)

    micro = MicroBatchStream(
        topic,
        group_id,
        run_batch,
        max_offsets_per_trigger=max_offsets_per_trigger,
        trigger_interval_s=trigger_interval_s,
        starting_offsets=starting_offsets,
        bus=bus,
        progress=progress or log_progress,
        transactional_id=transactional_id,
        producer_options=check_producer_options(producer_options) if transactional_id is not None else None,
    )
    return micro.start(until_caught_up=until_caught_up, max_batches=max_batches)
