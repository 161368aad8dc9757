"""Ray Data: read_dataset and TopicSink against real replica actors and real files."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.api.dataset import SCHEMA, TopicDatasource, TopicSink, read_dataset, resolve_offsets, write_dataset
from logbus.errors import (
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    InvalidTopicError,
    OffsetOutOfRangeError,
    UnknownTopicError,
)
from tests.conftest import wait_for

RECORDS = 20_000
PARTITIONS = 4
KEYS = 1_000


def produced_table(count: int, start_ms: int) -> pa.Table:
    """``count`` records: unique values, 1,000 keys, increasing timestamps, headers on every third record."""
    index = np.arange(count)
    headers = [[("seq", b"%d" % i), ("kind", b"third")] if i % 3 == 0 else None for i in range(count)]
    return pa.table(
        {
            "key": pa.array([b"key-%d" % (i % KEYS) for i in range(count)], pa.binary()),
            "value": pa.array([b"value-%08d" % i for i in range(count)], pa.binary()),
            "timestamp": pa.array(start_ms + index, pa.int64()),
            "headers": pa.array(headers, pa.map_(pa.string(), pa.binary())),
        }
    )


def produce_topic(bus, prefix: str) -> tuple[str, pa.Table, list[int]]:
    """A new 4-partition topic holding RECORDS records: (name, produced table, records per partition)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=PARTITIONS)
    # Recent timestamps (retention must not delete the segments under the test), 1 ms apart.
    table = produced_table(RECORDS, int(time.time() * 1000) - RECORDS)
    producer = logbus.Producer(bus)
    future = producer.send_table(name, table)
    producer.flush(timeout_s=120)
    batches = future.result()
    producer.close()
    counts = [0] * PARTITIONS
    for batch in batches:
        counts[batch.partition] += batch.record_count
    assert sum(counts) == RECORDS and all(counts)
    return name, table, counts


@pytest.fixture
def topic(bus, module_bus_state):
    """The module's topic of RECORDS records on its shared cluster, produced once (``produce_topic``)."""
    return module_bus_state.kept("topic", lambda shared: produce_topic(shared, "ds"))


def rows(table: pa.Table, columns=("key", "value", "timestamp", "headers")) -> list[tuple]:
    """Rows as comparable tuples, sorted by value (values are unique)."""
    table = table.select(list(columns)).sort_by("value")
    return list(zip(*(table.column(c).to_pylist() for c in columns)))


def read_all(dataset) -> pa.Table:
    return pa.concat_tables(ray.get(dataset.to_arrow_refs()))


def check_partitions(table: pa.Table, expected_ranges: dict[int, tuple[int, int]]) -> None:
    """Each partition holds exactly the offsets [start, end), once each, in order of the values sent."""
    for partition, (start, end) in expected_ranges.items():
        part = table.filter(pc.equal(table["partition"], partition)).sort_by("offset")
        assert part["offset"].to_pylist() == list(range(start, end)), partition
        values = part["value"].to_pylist()
        assert values == sorted(values), f"partition {partition} is not in send order"


@pytest.mark.timeout(180)
def test_read_dataset_round_trip(bus, topic):
    name, produced, counts = topic
    dataset = read_dataset(name, bus=bus, block_size_bytes=64 << 10)
    assert dataset.schema().base_schema == SCHEMA
    assert dataset.count() == RECORDS
    refs = dataset.to_arrow_refs()
    blocks = ray.get(refs)
    table = pa.concat_tables(blocks)
    assert table.schema == SCHEMA
    assert table.num_rows == RECORDS
    check_partitions(table, {p: (0, counts[p]) for p in range(PARTITIONS)})
    assert rows(table) == rows(produced)
    assert set(table["topic"].to_pylist()) == {name}
    assert set(table["timestamp_type"].to_pylist()) == {1}  # CreateTime, in read_kafka's codes
    # Blocks of about the requested 64 KiB (several a partition): not one per fetched batch,
    # not tiny ones, not merged into Ray Data's default 128 MiB. Only the last block of a
    # partition may be smaller than half of it.
    target = 64 << 10
    assert all(b.nbytes <= 2 * target for b in blocks)
    assert len([b for b in blocks if b.nbytes < target // 2]) <= PARTITIONS
    assert len(blocks) <= table.nbytes // (target // 2) + PARTITIONS


@pytest.mark.timeout(180)
def test_offset_ranges_int_dict_and_datetime(bus, topic):
    name, produced, counts = topic

    table = read_all(read_dataset(name, 100, 250, bus=bus))
    assert table.num_rows == 150 * PARTITIONS
    check_partitions(table, {p: (100, 250) for p in range(PARTITIONS)})

    start = {0: 10, 2: "earliest", 3: counts[3]}
    end = {0: 20, 1: 5, 3: "latest"}
    table = read_all(read_dataset(name, start, end, bus=bus))
    expected = {0: (10, 20), 1: (0, 5), 2: (0, counts[2]), 3: (counts[3], counts[3])}
    check_partitions(table, expected)
    assert table.num_rows == sum(e - s for s, e in expected.values())

    # Timestamps rise by 1 ms per record sent, so a time range is a range of values.
    first_ms = produced["timestamp"][0].as_py()
    low_ms, high_ms = first_ms + 30_000, first_ms + 60_000
    low = datetime.fromtimestamp(low_ms / 1000, tz=timezone.utc)
    high = datetime.fromtimestamp(high_ms / 1000, tz=timezone.utc)
    table = read_all(read_dataset(name, low, high, bus=bus))
    wanted = produced.filter(pc.and_(pc.greater_equal(produced["timestamp"], low_ms), pc.less(produced["timestamp"], high_ms)))
    assert rows(table) == rows(wanted)
    # A naive datetime is UTC, as in ray.data.read_kafka.
    naive = read_dataset(name, low.replace(tzinfo=None), high.replace(tzinfo=None), bus=bus)
    assert naive.count() == wanted.num_rows

    empty = read_all(read_dataset(name, {p: counts[p] for p in range(PARTITIONS)}, bus=bus))
    assert empty.num_rows == 0 and empty.schema == SCHEMA


@pytest.mark.timeout(180)
def test_topic_sink_round_trip(bus):
    source = produced_table(30_000, int(time.time() * 1000))
    source = source.append_column("user", source["key"].cast(pa.string()))
    name = f"sink-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=3)
    dataset = ray.data.from_arrow([source.slice(0, 10_000), source.slice(10_000)])
    sink = TopicSink(name, key_column="user", bus=bus)
    dataset.write_datasink(sink)
    assert sink.records_written == source.num_rows

    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(name, p) for p in range(3)])
    tables, total = [], 0

    def more():
        nonlocal total
        table = consumer.poll_arrow(timeout_ms=500)
        tables.append(table)
        total += table.num_rows
        return total >= source.num_rows

    wait_for(more, timeout_s=120, interval_s=0, message=f"{source.num_rows} records")
    consumer.close()
    back = pa.concat_tables(tables)
    assert back.num_rows == source.num_rows
    assert rows(back) == rows(source)
    # One key, one partition: the sink partitions by key as the producer does.
    pairs = set(zip(back["key"].to_pylist(), back["partition"].to_pylist()))
    assert len(pairs) == KEYS

    # write_dataset, with explicit partitions and Spark-style headers (list of key/value structs).
    other = f"sink-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(other, partitions=2)
    entries = pa.array([[{"key": "h", "value": b"%d" % i}] for i in range(1_000)], pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])))
    spark_like = pa.table({"value": pa.array(["v%d" % i for i in range(1_000)]), "headers": entries, "partition": pa.array([i % 2 for i in range(1_000)], pa.int32())})
    assert write_dataset(ray.data.from_arrow(spark_like), other, bus) == 1_000
    back = read_all(read_dataset(other, bus=bus))
    assert back.num_rows == 1_000
    for row in back.slice(0, 50).to_pylist():
        number = int(row["value"][1:])
        assert row["partition"] == number % 2
        assert row["headers"] == [("h", b"%d" % number)]


@pytest.mark.timeout(120)
def test_bad_input_raises_on_the_driver(bus, topic):
    name, _, counts = topic
    with pytest.raises(UnknownTopicError):
        read_dataset("no-such-topic", bus=bus)
    with pytest.raises(InvalidTopicError):
        read_dataset("../escape", bus=bus)
    with pytest.raises(OffsetOutOfRangeError, match="before its start"):
        read_dataset(name, 200, 100, bus=bus)
    with pytest.raises(OffsetOutOfRangeError, match="before its start"):
        read_dataset(name, {1: 50}, {1: 10}, bus=bus)
    with pytest.raises(OffsetOutOfRangeError, match="past its high watermark"):
        read_dataset(name, max(counts) + 1, bus=bus)
    with pytest.raises(OffsetOutOfRangeError):
        read_dataset(name, -1, bus=bus)
    with pytest.raises(InvalidConfigError):
        read_dataset(name, "latest", bus=bus)
    with pytest.raises(InvalidConfigError):
        read_dataset(name, end="earliest", bus=bus)
    with pytest.raises(InvalidConfigError):
        read_dataset(name, "start", bus=bus)
    with pytest.raises(InvalidPartitionError, match=r"partitions 0\.\.3") as caught:
        read_dataset(name, {PARTITIONS: 0}, bus=bus)
    assert not caught.value.retriable  # a partition the topic does not have stays missing
    with pytest.raises(InvalidPartitionError):
        read_dataset(name, end={-1: 5}, bus=bus)

    with pytest.raises(UnknownTopicError):
        TopicSink("no-such-topic", bus=bus)
    target = f"bad-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(target, partitions=1)
    no_value = ray.data.from_arrow(pa.table({"payload": pa.array([b"x"] * 10)}))
    with pytest.raises(InvalidRecordError, match="no value column"):
        write_dataset(no_value, target, bus)
    with pytest.raises(InvalidRecordError, match="no key column"):
        write_dataset(ray.data.from_arrow(pa.table({"value": pa.array([b"x"] * 10)})), target, bus, key_column="user")
    with pytest.raises(InvalidRecordError, match="no value column"):
        no_value.write_datasink(TopicSink(target, bus=bus))
    assert read_dataset(target, bus=bus).count() == 0  # nothing was written


def test_log_append_time_topic_reports_the_append_time(bus):
    """message.timestamp.type=LogAppendTime: rows carry the leader's append time, typed 2 (read_kafka's code)."""
    name = f"lat-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(name, partitions=1, config={"message.timestamp.type": "LogAppendTime"})
    before_ms = time.time_ns() // 1_000_000
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(20):
            producer.send(name, b"v%d" % i, timestamp_ms=1_000 + i).result()  # create times long past
    after_ms = time.time_ns() // 1_000_000
    table = read_dataset(name, bus=bus).to_arrow_refs()
    table = pa.concat_tables(ray.get(table))
    assert table.num_rows == 20
    assert set(table["timestamp_type"].to_pylist()) == {2}
    stamps = table["timestamp"].to_pylist()
    assert all(before_ms <= t <= after_ms for t in stamps), (before_ms, stamps[:3], after_ms)
    assert stamps == sorted(stamps)


@pytest.mark.timeout(180)
def test_bad_arguments_are_named_errors_before_any_task(bus, topic):
    """Bad input fails on the driver with a named, non-retriable error, never a bare Python or Ray one."""
    name, _, _ = topic
    for not_a_bus in ("localhost", object()):
        with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
            read_dataset(name, bus=not_a_bus)
        with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
            TopicSink(name, bus=not_a_bus)
        with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
            write_dataset(ray.data.from_items([{"value": b"x"}]), name, not_a_bus)
    with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
        resolve_offsets(None, name)

    # Read tasks' Ray options: checked here, not refused by Ray once the Dataset executes.
    for num_cpus in (-1, float("inf"), float("nan"), "1", True):
        with pytest.raises(InvalidConfigError, match="num_cpus"):
            read_dataset(name, bus=bus, num_cpus=num_cpus)
    for options in ([("num_cpus", 1)], {"no_such_option": 1}, {"num_cpus": -1}, {"num_cpus": "1"}, {1: 2}, {"resources": {"CPU": 1}}):
        with pytest.raises(InvalidConfigError):
            read_dataset(name, bus=bus, ray_remote_args=options)
    with pytest.raises(InvalidConfigError, match="concurrency"):
        TopicDatasource(name, bus=bus).to_dataset(concurrency=0)
    # Zero-CPU read tasks (what logbus.spark.read runs) read the same records.
    assert read_dataset(name, 0, 10, bus=bus, num_cpus=0).count() == 10 * PARTITIONS
    assert read_dataset(name, 0, 10, bus=bus, ray_remote_args={"num_cpus": 0, "max_retries": 1}).count() == 10 * PARTITIONS

    # Producer options: names against Producer's own arguments, values by the Producer.
    with pytest.raises(InvalidConfigError, match="producer options must be a dict"):
        TopicSink(name, bus=bus, producer_options=[("acks", "all")])
    with pytest.raises(InvalidConfigError, match=r"unknown producer options \['lingerms'\]"):
        TopicSink(name, bus=bus, producer_options={"lingerms": 5})
    with pytest.raises(InvalidConfigError, match=r"unknown producer options \['bus'\]"):
        TopicSink(name, bus=bus, producer_options={"bus": bus})
    with pytest.raises(InvalidConfigError, match="acks"):
        TopicSink(name, bus=bus, producer_options={"acks": 7})


@pytest.mark.timeout(180)
def test_timestamp_column_of_the_wrong_type_is_an_invalid_record(bus):
    target = f"ts-{uuid.uuid4().hex[:8]}"
    bus.admin.create_topic(target, partitions=1)
    values = pa.array([b"a", b"b"])
    strings = ray.data.from_arrow(pa.table({"value": values, "timestamp": pa.array(["yesterday", "today"])}))
    with pytest.raises(InvalidRecordError, match="timestamp column 'timestamp' must hold int ms or Arrow timestamps, not string"):
        write_dataset(strings, target, bus)  # on the driver, before any task
    floats = ray.data.from_arrow(pa.table({"value": values, "sent": pa.array([1.5, 2.5])}))
    with pytest.raises(InvalidRecordError, match="'sent' must hold int ms"):
        floats.write_datasink(TopicSink(target, bus=bus, timestamp_column="sent"))
    # An int type whose values int64 cannot hold fails in the write task, named.
    huge = ray.data.from_arrow(pa.table({"value": values, "timestamp": pa.array([2**63, 1], pa.uint64())}))
    with pytest.raises(InvalidRecordError, match="cannot be int64 ms"):
        write_dataset(huge, target, bus)
    assert read_dataset(target, bus=bus).count() == 0  # nothing was written

    # The types it takes: int ms, Arrow timestamps (truncated to ms), nulls (the send time).
    sent = pa.table({
        "value": pa.array([b"i", b"t", b"n"]),
        "timestamp": pa.array([1_000, None, None], pa.int64()),
    })
    stamped = pa.table({"value": pa.array([b"t"]), "timestamp": pa.array([2_000_999_999], pa.timestamp("ns"))})
    assert write_dataset(ray.data.from_arrow(sent), target, bus) == 3
    assert write_dataset(ray.data.from_arrow(stamped), target, bus) == 1
    back = read_all(read_dataset(target, bus=bus))
    assert back["timestamp"].to_pylist()[0] == 1_000 and back["timestamp"].to_pylist()[3] == 2_000
