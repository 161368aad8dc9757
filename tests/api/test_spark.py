"""Spark through RayDP: logbus.spark.read / write against real replicas, real files and a real Spark.

One Spark session serves the whole run (RayDP's Spark takes about 10 s to
start); it runs on the shared Ray session of tests/conftest.py.
"""

from __future__ import annotations

import os
import time
import uuid
import zlib
from collections import Counter

import pyarrow as pa
import pytest
import ray

import logbus
import logbus.spark
from logbus import TopicPartition
from logbus.errors import (
    IllegalStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    OffsetOutOfRangeError,
    UnknownTopicError,
)
from tests.api.murmur2_reference import kafka_partition
from tests.api.test_dataset import KEYS, PARTITIONS, RECORDS, produce_topic
from tests.conftest import wait_for


@pytest.fixture
def topic(bus, module_bus_state):
    """The module's topic of RECORDS keyed records on its shared cluster, produced once: (name, produced
    table, records per partition)."""
    return module_bus_state.kept("topic", lambda shared: produce_topic(shared, "sp"))


def drain(bus, topic: str, partitions: int, expected: int) -> pa.Table:
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    tables, total = [], 0

    def more():
        nonlocal total
        table = consumer.poll_arrow(timeout_ms=500)
        tables.append(table)
        total += table.num_rows
        return total >= expected

    wait_for(more, timeout_s=120, interval_s=0, message=f"{expected} records")
    consumer.close()
    return pa.concat_tables(tables)


def content_hash(key: bytes, value: bytes, timestamp_ms: int) -> int:
    """What Spark computes below as crc32(concat(key, value, timestamp as decimal digits))."""
    return zlib.crc32(key + value + str(timestamp_ms).encode())


def scans_with_the_jvm_reader(df) -> bool:
    """Whether Spark's plan for ``df`` reads through logbus's own data source (logbus/jvm)."""
    return "BatchScan logbus" in df._jdf.queryExecution().executedPlan().toString()


def without_the_jvm_reader(monkeypatch) -> None:
    """Read as a session without logbus's jar does: through Ray Data."""
    monkeypatch.setattr(logbus.spark, "_jvm_read", lambda *args, **kwargs: None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reader", ["jvm", "ray-data-tasks", "driver"])
def test_read_topic_into_spark(spark, bus, topic, reader, monkeypatch):
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    name, produced, counts = topic
    if reader != "jvm":
        without_the_jvm_reader(monkeypatch)
    # A range up to SMALL_READ_OFFSETS is read in the driver, a larger one by Ray Data tasks: both here.
    monkeypatch.setattr(logbus.spark, "SMALL_READ_OFFSETS", RECORDS if reader == "driver" else 0)
    df = logbus.spark.read(spark, name, bus=bus)
    assert df.schema == logbus.spark.kafka_schema()
    assert scans_with_the_jvm_reader(df) == (reader == "jvm")

    # One Spark job checks every record: per partition the offsets are 0..n-1 once each,
    # in the order the values were sent, and the records hash to what was produced.
    previous = F.lag("value").over(Window.partitionBy("partition").orderBy("offset"))
    digest = F.crc32(F.concat("key", "value", F.unix_millis("timestamp").cast("string").cast("binary")))
    found = {
        row["partition"]: row.asDict()
        for row in df.withColumn("out_of_order", (previous > F.col("value")).cast("int"))
        .groupBy("partition")
        .agg(
            F.count("*").alias("n"),
            F.countDistinct("offset").alias("distinct"),
            F.min("offset").alias("low"),
            F.max("offset").alias("high"),
            F.sum("out_of_order").alias("out_of_order"),
            F.sum(digest).alias("digest"),
            F.collect_set("topic").alias("topics"),
            F.collect_set("timestampType").alias("types"),
        )
        .collect()
    }
    expected_digest = [0] * PARTITIONS
    for key, value, ts in zip(produced["key"].to_pylist(), produced["value"].to_pylist(), produced["timestamp"].to_pylist()):
        expected_digest[kafka_partition(key, PARTITIONS)] += content_hash(key, value, ts)
    assert sorted(found) == list(range(PARTITIONS))
    for partition, row in found.items():
        n = counts[partition]
        assert (row["n"], row["distinct"], row["low"], row["high"]) == (n, n, 0, n - 1), partition
        assert row["out_of_order"] == 0
        assert row["digest"] == expected_digest[partition]
        assert row["topics"] == [name] and row["types"] == [0]

    # And a slice, row by row, with timestamps as Spark timestamps.
    sample = df.where("offset < 25").orderBy("partition", "offset").collect()
    by_value = {v: (k, ts) for k, v, ts in zip(produced["key"].to_pylist(), produced["value"].to_pylist(), produced["timestamp"].to_pylist())}
    assert len(sample) == 25 * PARTITIONS
    for row in sample:
        key, ts = by_value[bytes(row["value"])]
        assert bytes(row["key"]) == key
        assert round(row["timestamp"].timestamp() * 1000) == ts  # PySpark hands out naive local times


@pytest.mark.timeout(300)
def test_spark_sql_aggregation_matches_python(spark, bus, topic):
    name, produced, _ = topic
    logbus.spark.read(spark, name, bus=bus).createOrReplaceTempView("events")
    result = spark.sql(
        "SELECT CAST(key AS STRING) AS user, COUNT(*) AS n, SUM(LENGTH(value)) AS bytes, MAX(offset) AS last "
        "FROM events GROUP BY key"
    ).collect()
    counted = Counter(produced["key"].to_pylist())
    sizes = Counter()
    for key, value in zip(produced["key"].to_pylist(), produced["value"].to_pylist()):
        sizes[key] += len(value)
    assert len(result) == KEYS
    assert {row["user"].encode(): row["n"] for row in result} == dict(counted)
    assert {row["user"].encode(): row["bytes"] for row in result} == dict(sizes)


@pytest.mark.timeout(300)
def test_json_offsets_and_headers(spark, bus, topic):
    from pyspark.sql import functions as F

    name, produced, counts = topic
    starting = '{"%s": {"0": 23, "1": -2, "3": %d}}' % (name, counts[3] - 7)
    ending = {name: {"0": 100, "2": 50, "3": -1}}
    df = logbus.spark.read(spark, name, starting, ending, include_headers=True, bus=bus)
    assert df.schema == logbus.spark.kafka_schema(include_headers=True)
    found = {
        row["partition"]: (row["n"], row["low"], row["high"])
        for row in df.groupBy("partition").agg(F.count("*").alias("n"), F.min("offset").alias("low"), F.max("offset").alias("high")).collect()
    }
    assert found == {0: (77, 23, 99), 1: (counts[1], 0, counts[1] - 1), 2: (50, 0, 49), 3: (7, counts[3] - 7, counts[3] - 1)}

    empty = logbus.spark.read(spark, name, {name: {str(p): counts[p] for p in range(PARTITIONS)}}, bus=bus)
    assert empty.schema == logbus.spark.kafka_schema() and empty.count() == 0

    sample = df.where("partition = 0").orderBy("offset").select("value", "headers").collect()
    by_value = {v: h for v, h in zip(produced["value"].to_pylist(), produced["headers"].to_pylist())}
    for row in sample:
        expected = by_value[bytes(row["value"])]
        got = None if row["headers"] is None else [(h["key"], bytes(h["value"])) for h in row["headers"]]
        assert got == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", ["jvm", "ray-tasks"])
def test_write_dataframe_to_topic(spark, bus, writer, monkeypatch):
    if writer == "jvm":  # Spark's executors write (logbus's data source): the Ray tasks must not run
        monkeypatch.setattr(logbus.spark, "_write_partitions", lambda *args: pytest.fail("the Ray tasks wrote"))
        options = {}
    else:
        options = {"linger_ms": 5}  # producer options: each Ray task writes with a Producer
    target = f"sp-out-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(target, partitions=3)
    count = 20_000
    df = spark.range(count).selectExpr(
        "CAST(id % 500 AS STRING) AS key",
        "CONCAT('payload-', CAST(id AS STRING)) AS value",
        "ARRAY(NAMED_STRUCT('key', 'id', 'value', CAST(CAST(id AS STRING) AS BINARY))) AS headers",
        "'ignored' AS topic",
    )
    assert logbus.spark.write(df, target, bus=bus, **options) == count
    back = drain(bus, target, 3, count)
    assert back.num_rows == count
    assert sorted(back["value"].to_pylist()) == sorted(b"payload-%d" % i for i in range(count))
    for row in back.slice(0, 200).to_pylist():
        number = int(row["value"][len(b"payload-"):])
        assert row["key"] == b"%d" % (number % 500)
        assert row["headers"] == [("id", b"%d" % number)]
        assert row["partition"] == kafka_partition(row["key"], 3)  # Kafka's key partitioning

    # An explicit partition column wins over the key.
    pinned = f"sp-pin-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(pinned, partitions=2)
    df = spark.range(1_000).selectExpr("CAST(id AS BINARY) AS value", "CAST(id % 2 AS INT) AS partition")
    assert logbus.spark.write(df, pinned, bus=bus, **options) == 1_000
    back = drain(bus, pinned, 2, 1_000)
    assert Counter(back["partition"].to_pylist()) == {0: 500, 1: 500}


@pytest.mark.timeout(300)
def test_jvm_writer_keeps_every_key_and_value_over_many_batches_per_task(spark, bus):
    """Spark's executors frame several batches per partition in one task (more rows than a batch holds,
    framed and sent while the task reads on, the batch's buffers used again): every record comes back
    once, in order per partition, with its key (binary, null), value (empty, multi-byte UTF-8, large)
    and headers (some, none) as written."""
    target = f"sp-many-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(target, partitions=2)
    count = 150_000  # one Spark partition: 2-3 batches of at most 65,536 records for each topic partition
    df = spark.range(0, count, 1, 1).selectExpr(
        "CASE WHEN id % 7 = 0 THEN NULL ELSE CAST(CAST(id % 301 AS STRING) AS BINARY) END AS key",
        "CASE WHEN id % 11 = 0 THEN '' WHEN id % 1001 = 0 THEN REPEAT('v', 20000) "
        "ELSE CONCAT('é-', CAST(id AS STRING)) END AS value",
        "CASE WHEN id % 5 = 0 THEN ARRAY(NAMED_STRUCT('key', 'n', 'value', CAST(CAST(id AS STRING) AS BINARY))) "
        "ELSE NULL END AS headers",
    )
    assert logbus.spark.write(df, target, bus=bus) == count
    back = drain(bus, target, 2, count)
    assert back.num_rows == count

    def expected(i: int) -> tuple:
        key = None if i % 7 == 0 else b"%d" % (i % 301)
        value = b"" if i % 11 == 0 else b"v" * 20000 if i % 1001 == 0 else "é-{}".format(i).encode()
        return key, value

    rows = back.select(["key", "value", "headers", "partition", "offset"]).to_pylist()
    got = sorted((row["key"] is None, row["key"] or b"", row["value"]) for row in rows)
    assert got == sorted((key is None, key or b"", value) for key, value in map(expected, range(count)))
    for row in rows:
        if row["value"].startswith("é-".encode()):
            number = int(row["value"][len("é-".encode()):])
            assert (row["headers"] or None) == ([("n", b"%d" % number)] if number % 5 == 0 else None), row
    for row in rows:
        if row["key"] is not None:
            assert row["partition"] == kafka_partition(row["key"], 2)
    # Within a partition, the records of one key keep the order they were written in (ids ascending).
    numbered = [(r["partition"], r["offset"], r["key"], r["value"]) for r in rows if r["value"].startswith("é-".encode())]
    by_key: dict = {}
    for partition, offset, key, value in sorted(numbered):
        if key is not None:
            by_key.setdefault(key, []).append(int(value[len("é-".encode()):]))
    assert all(ids == sorted(ids) for ids in by_key.values())


class _StoppedContext:
    _jsc = None
    master = "ray://stopped"


@pytest.mark.timeout(300)
def test_small_reads_of_only_a_marker_and_of_large_records(spark, bus, monkeypatch):
    name = f"sp-small-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=1)
    with logbus.Producer(bus, transactional_id=f"tx-{name}") as producer:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(name, b"committed", key=b"k")
        producer.commit_transaction()
    # Offset 0 is the record, offset 1 its transaction's COMMIT marker: a range of only the marker is no row.
    wait_for(lambda: bus.admin.describe_topic(name).partitions[0].high_watermark == 2, timeout_s=60, message="the marker")
    only_marker = logbus.spark.read(spark, name, starting_offsets={name: {"0": 1}}, ending_offsets={name: {"0": 2}}, bus=bus)
    assert only_marker.count() == 0
    # Records past the byte bound of a driver-side read are read by the tasks instead: the same rows.
    monkeypatch.setattr(logbus.spark, "SMALL_READ_BYTES", 1)
    rows = logbus.spark.read(spark, name, bus=bus).collect()
    assert [(bytes(r["key"]), bytes(r["value"]), r["offset"]) for r in rows] == [(b"k", b"committed", 0)]


@pytest.mark.timeout(120)
def test_bad_input_raises_clear_errors(spark, bus, topic):
    from pyspark.sql import DataFrame, SparkSession

    name, _, _ = topic
    with pytest.raises(IllegalStateError, match="not started"):
        logbus.spark.read(None, name, bus=bus)
    stopped = object.__new__(SparkSession)  # what a session looks like after stop(): no JVM context
    stopped._sc = _StoppedContext()
    with pytest.raises(IllegalStateError, match="stopped"):
        logbus.spark.read(stopped, name, bus=bus)
    with pytest.raises(UnknownTopicError):
        logbus.spark.read(spark, "no-such-topic", bus=bus)
    with pytest.raises(OffsetOutOfRangeError, match="before its start"):
        logbus.spark.read(spark, name, {name: {"0": 50}}, {name: {"0": 10}}, bus=bus)
    with pytest.raises(InvalidConfigError, match="latest"):
        logbus.spark.read(spark, name, '{"%s": {"0": -1}}' % name, bus=bus)
    with pytest.raises(InvalidConfigError, match="only"):
        logbus.spark.read(spark, name, '{"other-topic": {"0": 1}}', bus=bus)
    with pytest.raises(InvalidConfigError):
        logbus.spark.read(spark, name, "{not json", bus=bus)
    # A partition the topic does not have is the caller's mistake, not a retriable UnknownTopicError.
    with pytest.raises(InvalidPartitionError, match="partitions 0..3"):
        logbus.spark.read(spark, name, '{"%s": {"%d": 0}}' % (name, PARTITIONS), bus=bus)
    with pytest.raises(InvalidPartitionError, match="not a number"):
        logbus.spark.read(spark, name, '{"%s": {"first": 0}}' % name, bus=bus)

    target = f"sp-bad-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(target, partitions=1)
    with pytest.raises(InvalidRecordError, match="'value' column"):
        logbus.spark.write(spark.range(10).selectExpr("CAST(id AS STRING) AS payload"), target, bus=bus)
    with pytest.raises(InvalidRecordError, match="string or binary"):
        logbus.spark.write(spark.range(10).selectExpr("id AS value"), target, bus=bus)
    with pytest.raises(UnknownTopicError):
        logbus.spark.write(spark.range(10).selectExpr("CAST(id AS STRING) AS value"), "no-such-topic", bus=bus)
    with pytest.raises(InvalidRecordError, match="Spark DataFrame"):
        logbus.spark.write(pa.table({"value": [b"x"]}), target, bus=bus)
    stopped_df = object.__new__(DataFrame)  # a DataFrame of the stopped session
    stopped_df._session = stopped
    with pytest.raises(IllegalStateError, match="stopped"):
        logbus.spark.write(stopped_df, target, bus=bus)
    assert logbus.api.dataset.read_dataset(target, bus=bus).count() == 0  # nothing was written


def test_bad_arguments_are_named_before_spark_or_ray_is_touched():
    """Argument mistakes raise InvalidConfigError before the session is checked or anything connects."""
    from pyspark.sql import DataFrame

    df = object.__new__(DataFrame)  # never evaluated: the arguments fail first
    with pytest.raises(InvalidConfigError, match=r"unknown producer options \['lingerms'\]"):
        logbus.spark.write(df, "events", lingerms=5)  # Producer(**options) would raise a bare TypeError in every task
    with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
        logbus.spark.write(df, "events", bus="localhost")
    with pytest.raises(InvalidConfigError, match="include_headers"):
        logbus.spark.read(None, "events", include_headers="yes")
    with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
        logbus.spark.read(None, "events", bus=object())
    with pytest.raises(InvalidConfigError, match="process_batch"):
        logbus.spark.stream(None, "events", "g", process_batch=None)
    with pytest.raises(InvalidConfigError, match="include_headers"):
        logbus.spark.stream(None, "events", "g", lambda df, batch_id: None, include_headers=1)


@pytest.mark.timeout(300)
def test_log_append_time_topic_reads_as_timestamp_type_1_with_the_append_times(spark, bus):
    """Spark's Kafka source codes: LogAppendTime is 1; the timestamps are the leader's append times."""
    from pyspark.sql import functions as F

    name = f"sp-lat-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=2, config={"message.timestamp.type": "LogAppendTime"})
    before_ms = time.time_ns() // 1_000_000
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(40):
            producer.send(name, b"v%d" % i, partition=i % 2, timestamp_ms=1_000 + i).result()  # create times long past
    after_ms = time.time_ns() // 1_000_000
    rows = (
        logbus.spark.read(spark, name, bus=bus)
        .select("partition", "offset", "timestampType", F.unix_millis("timestamp").alias("ms"))
        .collect()
    )
    assert len(rows) == 40
    assert {row["timestampType"] for row in rows} == {1}
    assert all(before_ms <= row["ms"] <= after_ms for row in rows), (before_ms, [row["ms"] for row in rows[:3]], after_ms)
    # The very append times the replicas stamped, as read_dataset gives them.
    table = pa.concat_tables(ray.get(logbus.api.dataset.read_dataset(name, bus=bus).to_arrow_refs()))
    appended = dict(zip(zip(table["partition"].to_pylist(), table["offset"].to_pylist()), table["timestamp"].to_pylist()))
    assert {(row["partition"], row["offset"]): row["ms"] for row in rows} == appended


# --- no CPU free for Ray tasks ------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class CpuHolder:
    """Holds the CPUs it was created with (``.options(num_cpus=...)``) until it is killed."""

    def ready(self) -> bool:
        return True


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


@pytest.mark.timeout(300)
def test_read_write_and_stream_while_every_cpu_is_held(spark, bus):
    """With no CPU of Ray free (Spark's executor holds one, as init_spark(executor_cores=...) as large
    as Ray's CPU count holds them all; an actor holds the rest), read, write and stream still finish.

    Read tasks of one CPU each used to wait for a free CPU forever (Ray Data: "backpressured:
    tasks(ResourceBudget)"), and so did ray.data.from_spark's metadata tasks in write. The suite's
    Ray session and Spark serve it: what matters to Ray's scheduler is that no CPU is free, not
    which actors hold them.
    """
    records = 3_000
    events, copy = f"sp-cpu-{uuid.uuid4().hex[:8]}", f"sp-cpu-copy-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(events, partitions=3)
    bus.admin.create_topic(copy, partitions=2)
    with logbus.Producer(bus) as producer:
        for i in range(records):
            producer.send(events, b"%d" % i, key=b"k%d" % (i % 50))
    spare = wait_for(free_cpus, timeout_s=60, interval_s=0.2, message="CPUs that Spark's executor leaves free")
    holders = []

    def every_cpu_held() -> bool:
        free = free_cpus()  # Ray's view of free resources follows an actor's start or end shortly after
        if free > 0:
            holders.append(CpuHolder.options(num_cpus=free).remote())
            ray.get(holders[-1].ready.remote(), timeout=60)
        return free == 0

    try:
        wait_for(every_cpu_held, timeout_s=60, interval_s=0.2, message="every CPU held")

        df = logbus.spark.read(spark, events, bus=bus)
        rows = df.select("partition", "offset", "value").collect()
        assert sorted(int(bytes(row["value"])) for row in rows) == list(range(records))
        assert len({(row["partition"], row["offset"]) for row in rows}) == records

        assert logbus.spark.write(df.select("key", "value"), copy, bus=bus) == records
        copied = pa.concat_tables(ray.get(logbus.api.dataset.read_dataset(copy, bus=bus, num_cpus=0).to_arrow_refs()))
        assert sorted(int(v) for v in copied["value"].to_pylist()) == list(range(records))

        batches = []
        stream = logbus.spark.stream(
            spark, events, f"sp-cpu-{uuid.uuid4().hex[:8]}", lambda batch, batch_id: batches.append(batch.count()),
            max_offsets_per_trigger=records // 2, trigger_interval_s=0, bus=bus, until_caught_up=True,
            progress=lambda progress: None,
        )
        assert stream.await_termination(timeout_s=240)
        assert sum(batches) == records and len(batches) >= 2
        assert free_cpus() == 0  # held throughout
    finally:
        for holder in holders:
            ray.kill(holder)
    wait_for(lambda: free_cpus() >= spare, timeout_s=60, interval_s=0.2, message="the held CPUs free again")


# --- logbus's own data source (logbus/jvm): Spark's executors fetch from the replicas ----------------


@pytest.mark.timeout(300)
def test_the_jvm_reader_counts_from_batch_headers_and_slices_batches_at_the_range_ends(spark, bus, topic):
    name, produced, counts = topic
    # Ranges that start and end inside batches: the first and last batch of each are cut.
    start = {str(p): 7 for p in range(PARTITIONS)}
    end = {str(p): counts[p] - 5 for p in range(PARTITIONS)}
    df = logbus.spark.read(spark, name, starting_offsets={name: start}, ending_offsets={name: end}, bus=bus)
    assert scans_with_the_jvm_reader(df)
    counted = df.groupBy().count()
    # A count needs no column: the scan reads none (the reader then fetches batch headers only).
    assert "BatchScan logbus[]" in counted._jdf.queryExecution().executedPlan().toString()
    assert counted.collect()[0][0] == sum(counts) - 12 * PARTITIONS
    bounds = {r["partition"]: (r["low"], r["high"], r["n"]) for r in df.groupBy("partition").agg(
        {"offset": "min", "*": "count"}).withColumnRenamed("min(offset)", "low").withColumnRenamed("count(1)", "n")
        .join(df.groupBy("partition").agg({"offset": "max"}).withColumnRenamed("max(offset)", "high"), "partition").collect()}
    assert bounds == {p: (7, counts[p] - 6, counts[p] - 12) for p in range(PARTITIONS)}


@pytest.mark.timeout(300)
def test_the_jvm_reader_matches_the_ray_data_reader_row_for_row_with_headers(spark, bus, topic, monkeypatch):
    name, _, _ = topic

    def rows(df):
        return sorted(
            (r["partition"], r["offset"], bytes(r["key"]), bytes(r["value"]), r["timestamp"], r["timestampType"], r["topic"],
             None if r["headers"] is None else [(h["key"], bytes(h["value"])) for h in r["headers"]])
            for r in df.where("offset < 300").collect()
        )

    native = logbus.spark.read(spark, name, include_headers=True, bus=bus)
    assert scans_with_the_jvm_reader(native)
    assert native.schema == logbus.spark.kafka_schema(True)
    found = rows(native)
    without_the_jvm_reader(monkeypatch)
    assert found == rows(logbus.spark.read(spark, name, include_headers=True, bus=bus))
    assert any(r[-1] for r in found) and any(r[-1] is None for r in found)  # both kinds of records were compared
    # One field of the headers' structs (Spark prunes inside the struct: the reader still hands both).
    values = {bytes(v) for r in native.where("offset < 300").select("headers.value").collect() if r[0] for v in r[0]}
    assert values == {v for r in found if r[-1] for _, v in r[-1]}


@pytest.mark.timeout(300)
def test_format_logbus_with_subscribe_plans_a_batch_read_in_the_jvm(spark, bus, topic):
    name, _, counts = topic
    reader = spark.read.format("logbus").option("subscribe", name).option("logbus.namespace", bus.namespace)
    assert reader.load().count() == sum(counts)
    some = reader.option("startingOffsets", f'{{"{name}": {{"0": 5}}}}').option("endingOffsets", f'{{"{name}": {{"0": 9, "1": 0}}}}')
    rows = some.load().select("partition", "offset").collect()
    assert sorted((r["partition"], r["offset"]) for r in rows) == [(0, o) for o in range(5, 9)] + [
        (p, o) for p in range(2, PARTITIONS) for o in range(counts[p])]
    with pytest.raises(Exception, match="endingOffsets cannot be earliest"):
        reader.option("endingOffsets", "earliest").load().count()


@pytest.mark.timeout(300)
def test_format_logbus_reads_from_and_to_timestamps_as_kafkas_source_does(spark, bus):
    name = f"sp-ts-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=2)
    base = int(time.time() * 1000) - 600_000  # ten minutes ago: within retention
    with logbus.Producer(bus) as producer:  # partition p: records stamped base + 10 * i, i in 0..19
        for p in range(2):
            for i in range(20):
                producer.send(name, b"%d-%d" % (p, i), partition=p, timestamp_ms=base + 10 * i)
        producer.flush(timeout_s=60)

    def reader():  # a new one each time: a DataFrameReader keeps the options it is given
        return spark.read.format("logbus").option("subscribe", name).option("logbus.namespace", bus.namespace)

    def offsets(df):
        return sorted((r["partition"], r["offset"]) for r in df.select("partition", "offset").collect())

    # startingTimestamp: the first record at or after it (55 -> i = 6); it takes precedence over startingOffsets.
    found = reader().option("startingTimestamp", str(base + 55)).option("startingOffsets", "earliest").load()
    assert offsets(found) == [(p, i) for p in range(2) for i in range(6, 20)]
    # Per partition, with an end by timestamp (the record at or after it is not read).
    by_partition = (reader().option("startingOffsetsByTimestamp", f'{{"{name}": {{"0": {base}, "1": {base + 100}}}}}')
                    .option("endingTimestamp", str(base + 150)).load())
    assert offsets(by_partition) == [(0, i) for i in range(0, 15)] + [(1, i) for i in range(10, 15)]
    # Ends per partition, one with no record at or after it (the partition's end); endingTimestamp would win.
    ends = f'{{"{name}": {{"0": {base + 100}, "1": {base + 10_000}}}}}'
    by_end = reader().option("startingTimestamp", str(base + 55)).option("endingOffsetsByTimestamp", ends).load()
    assert offsets(by_end) == [(0, i) for i in range(6, 10)] + [(1, i) for i in range(6, 20)]
    both = reader().option("endingOffsetsByTimestamp", ends).option("endingTimestamp", str(base + 30)).load()
    assert offsets(both) == [(p, i) for p in range(2) for i in range(3)]
    # No record at or after the timestamp: an error by default, the partition's end with the "latest" strategy.
    with pytest.raises(Exception, match="has no record at or after timestamp"):
        reader().option("startingTimestamp", str(base + 10_000)).load().count()
    late = reader().option("startingTimestamp", str(base + 10_000)).option("startingOffsetsByTimestampStrategy", "latest")
    assert late.load().count() == 0
    with pytest.raises(Exception, match="must name every partition"):
        reader().option("startingOffsetsByTimestamp", f'{{"{name}": {{"0": {base}}}}}').load().count()
    with pytest.raises(Exception, match="startingTimestamp must be a timestamp"):
        reader().option("startingTimestamp", "yesterday").load()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_the_jvm_reader_decompresses_batches(spark, bus, compression):
    name = f"sp-{compression}-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=2)
    values = [b"%s-%06d" % (compression.encode(), i) * 20 for i in range(3000)]  # compressible
    with logbus.Producer(bus, compression=compression, linger_ms=5) as producer:
        for i, value in enumerate(values):
            producer.send(name, value, key=b"k%d" % (i % 7))
        producer.flush(timeout_s=60)
    df = logbus.spark.read(spark, name, bus=bus)
    assert scans_with_the_jvm_reader(df)
    assert sorted(bytes(r["value"]) for r in df.select("value").collect()) == sorted(values)


@pytest.mark.timeout(300)
def test_the_jvm_reader_drops_markers_and_with_read_committed_aborted_records(spark, bus):
    name = f"sp-txn-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=1)
    with logbus.Producer(bus, transactional_id=f"tx-{name}") as producer:
        producer.init_transactions()
        for outcome in ("commit", "abort", "commit"):
            producer.begin_transaction()
            for i in range(50):
                producer.send(name, b"%s-%d" % (outcome.encode(), i), partition=0)
            producer.flush(timeout_s=60)
            producer.commit_transaction() if outcome == "commit" else producer.abort_transaction()
    with logbus.Producer(bus) as plain:
        plain.send(name, b"plain", partition=0)
        plain.flush(timeout_s=60)
    # 150 records, three markers, one plain record.
    wait_for(lambda: bus.admin.describe_topic(name).partitions[0].high_watermark == 154, timeout_s=60, message="the markers")

    def values(isolation_level):
        df = logbus.spark.read(spark, name, bus=bus, isolation_level=isolation_level)
        assert scans_with_the_jvm_reader(df)
        return Counter(bytes(r["value"]).split(b"-")[0] for r in df.collect())

    assert values("read_committed") == {b"commit": 100, b"plain": 1}
    assert values("read_uncommitted") == {b"commit": 100, b"abort": 50, b"plain": 1}


@pytest.mark.timeout(300)
def test_the_jvm_reader_waits_out_a_leader_restart(spark, bus):
    name = f"sp-restart-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=1)
    with logbus.Producer(bus) as producer:
        for i in range(2000):
            producer.send(name, b"%06d" % i)
        producer.flush(timeout_s=60)
    df = logbus.spark.read(spark, name, bus=bus)  # planned: the leader is named now
    leader = bus.topic_metadata(name, refresh=True).leaders[0]
    ray.kill(leader, no_restart=False)  # Ray starts it again; it rebuilds from its files
    rows = df.select("offset", "value").collect()
    assert sorted((r["offset"], bytes(r["value"])) for r in rows) == [(i, b"%06d" % i) for i in range(2000)]


@pytest.mark.timeout(120)
def test_format_logbus_without_a_plan_says_how_to_read(spark):
    with pytest.raises(Exception, match="logbus.spark.read"):
        spark.read.format("logbus").load().count()


def test_the_spark_drivers_jvm_logs_into_this_ray_sessions_log_directory(spark):
    """RayDP's Java agent in the driver's JVM writes its log to ``ray.logging.dir``, and without it to
    /tmp/ray/session_latest/logs: the machine's latest Ray session, not necessarily this one, and
    when that link dangled (its session deleted) the agent failed and Spark did not start.
    init_spark gives the driver's JVM this session's directory."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    jvm = spark.sparkContext._jvm
    assert jvm.java.lang.System.getProperty("ray.logging.dir") == logs
    pid = int(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getName().split("@")[0])
    assert os.path.exists(os.path.join(logs, f"slf4j-{pid}.log"))


def test_the_driver_options_name_the_ray_logs_directory_unless_the_caller_did():
    ours = logbus.spark.spark_configs({"spark.driver.extraJavaOptions": "-Dx=1"}, "/tmp/ray/session_x/logs")
    driver = ours["spark.driver.extraJavaOptions"]
    assert "-Dray.logging.dir=/tmp/ray/session_x/logs" in driver and driver.endswith("-Dx=1")
    assert "ray.logging.dir" not in ours["spark.executor.extraJavaOptions"]  # RayDP names it for its actors
    theirs = logbus.spark.spark_configs({"spark.driver.extraJavaOptions": "-Dray.logging.dir=/elsewhere"}, "/tmp/ray/s/logs")
    assert theirs["spark.driver.extraJavaOptions"].count("ray.logging.dir") == 1
    assert "ray.logging.dir" not in logbus.spark.spark_configs({}, None)["spark.driver.extraJavaOptions"]
