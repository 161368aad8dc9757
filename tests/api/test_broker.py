"""The broker end to end on one machine: real Ray actors, real files."""

import os
import signal
import time

import pyarrow as pa
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.protocol.messages import FetchRequest
from logbus.storage import record_batch as rb
from logbus.errors import (
    IllegalStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidPartitionsError,
    InvalidRecordError,
    InvalidReplicationFactorError,
    InvalidTopicError,
    OffsetOutOfRangeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    UnknownTopicError,
)
from tests.api.murmur2_reference import kafka_partition
from tests.healing import assert_healed
from tests.conftest import wait_for


def drain(consumer, expected, timeout_s=120):
    """Poll until ``expected`` records arrived; returns them as a pyarrow Table."""
    tables, total = [], 0

    def more():
        nonlocal total
        table = consumer.poll_arrow(timeout_ms=500)
        if table.num_rows:
            tables.append(table)
            total += table.num_rows
        return total >= expected

    wait_for(more, timeout_s=timeout_s, interval_s=0, message=f"{expected} records")
    return pa.concat_tables(tables)


def test_produce_and_consume_200k_keyed_records(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=4)
    producer = logbus.Producer(bus, linger_ms=20)
    count = 200_000
    keys = [b"user-%d" % (i % 5000) for i in range(count)]
    futures = [producer.send(topic_name, b"event-%d" % i, key=keys[i]) for i in range(count)]
    producer.flush(timeout_s=120)
    metadata = [f.result() for f in futures]
    producer.close()

    for i in range(0, count, 997):  # the key decides the partition, exactly like Kafka's Java client
        assert metadata[i].partition == kafka_partition(keys[i], 4)
    per_partition = {}
    for i, m in enumerate(metadata):
        per_partition.setdefault(m.partition, []).append((m.offset, i))
    for partition, entries in per_partition.items():
        assert [o for o, _ in entries] == list(range(len(entries)))  # contiguous, in send order

    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, p) for p in range(4)])
    table = drain(consumer, count)
    assert table.num_rows == count
    assert consumer.poll_arrow(timeout_ms=200).num_rows == 0
    for partition in range(4):
        rows = table.filter(pa.compute.equal(table["partition"], partition))
        offsets = rows["offset"].to_pylist()
        assert offsets == list(range(len(per_partition[partition])))
        assert rows["value"].to_pylist() == [b"event-%d" % i for _, i in per_partition[partition]]
        assert all(kafka_partition(k, 4) == partition for k in rows["key"].to_pylist()[:500])
    described = bus.admin.describe_topic(topic_name)
    assert sum(p.high_watermark for p in described.partitions) == count


def test_poll_returns_records_with_headers_and_timestamps(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    # Recent timestamps: records older than retention.ms (7 days by default) would be deleted.
    base_ms = int(time.time() * 1000) - 60_000
    with logbus.Producer(bus, linger_ms=0) as producer:
        producer.send(topic_name, "first", key="k", headers={"trace": b"abc"}, timestamp_ms=base_ms).result(timeout=60)
        producer.send(topic_name, b"second", timestamp_ms=base_ms + 1000).result(timeout=60)
    consumer = logbus.Consumer(bus)
    tp = TopicPartition(topic_name, 0)
    consumer.assign([tp])
    records = wait_for(lambda: consumer.poll(timeout_ms=500).get(tp), message="records")
    first = records[0]
    assert (first.offset, first.key, first.value, first.timestamp_ms, first.headers) == (0, b"k", b"first", base_ms, [("trace", b"abc")])
    assert (first.timestamp, first.timestamp_type) == (base_ms, rb.TIMESTAMP_TYPE_CREATE_TIME)
    # The first record at or after the time, with its own timestamp (Kafka's OffsetAndTimestamp).
    assert consumer.offsets_for_times({tp: base_ms + 500}) == {tp: logbus.OffsetAndTimestamp(1, base_ms + 1000)}
    assert consumer.offsets_for_times({tp: base_ms + 5000}) == {tp: None}
    consumer.seek(tp, 1)
    again = wait_for(lambda: consumer.poll(timeout_ms=500).get(tp), message="record after seek")
    assert [r.value for r in again] == [b"second"]
    assert consumer.position(tp) == 2
    assert consumer.beginning_offsets([tp]) == {tp: 0} and consumer.end_offsets([tp]) == {tp: 2}


def test_send_table_in_bulk(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    table = pa.table({"key": [b"k%d" % (i % 7) for i in range(30_000)], "value": [b"v%d" % i for i in range(30_000)]})
    with logbus.Producer(bus) as producer:
        batches = producer.send_table(topic_name, table).result(timeout=120)
    assert sum(b.record_count for b in batches) == 30_000
    for b in batches:
        assert b.partition in (0, 1, 2) and b.base_offset >= 0
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, p) for p in range(3)])
    got = drain(consumer, 30_000)
    assert sorted(got["value"].to_pylist()) == sorted(table["value"].to_pylist())
    for key, partition in zip(got["key"].to_pylist()[:300], got["partition"].to_pylist()[:300]):
        assert kafka_partition(key, 3) == partition


def test_pause_resume_and_seek_to_end(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus) as producer:
        for i in range(100):
            producer.send(topic_name, b"%d" % i, partition=i % 2)
    consumer = logbus.Consumer(bus)
    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    consumer.assign(tps)
    consumer.pause([tps[1]])
    got = drain(consumer, 50)
    assert set(got["partition"].to_pylist()) == {0} and got.num_rows == 50
    consumer.resume([tps[1]])
    assert drain(consumer, 50)["partition"].to_pylist() == [1] * 50
    consumer.seek_to_end()
    assert consumer.position(tps[0]) == 50
    assert consumer.poll_arrow(timeout_ms=100).num_rows == 0


def test_auto_offset_reset_latest_and_none(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    with logbus.Producer(bus) as producer:
        producer.send(topic_name, b"old").result(timeout=60)
    latest = logbus.Consumer(bus, auto_offset_reset="latest")
    latest.assign([tp])
    assert latest.position(tp) == 1
    strict = logbus.Consumer(bus, auto_offset_reset="none")
    strict.assign([tp])
    with pytest.raises(OffsetOutOfRangeError):
        strict.poll(timeout_ms=100)
    strict.seek(tp, 5)  # past the end
    with pytest.raises(OffsetOutOfRangeError):
        strict.poll(timeout_ms=2000)


def test_admin_lifecycle_and_errors(bus, topic_name):
    created = bus.admin.create_topic(topic_name, partitions=2, config={"retention.ms": 3600000})
    assert [p.partition for p in created.partitions] == [0, 1]
    assert topic_name in bus.admin.list_topics()
    with pytest.raises(TopicAlreadyExistsError):
        bus.admin.create_topic(topic_name)
    grown = bus.admin.create_partitions(topic_name, 3)
    assert len(grown.partitions) == 3
    with pytest.raises(InvalidPartitionsError):
        bus.admin.create_partitions(topic_name, 2)
    assert bus.admin.alter_config(topic_name, {"segment.bytes": 1 << 20}) == {"retention.ms": 3600000, "segment.bytes": 1 << 20}
    assert bus.admin.describe_topic(topic_name).config["segment.bytes"] == 1 << 20
    directory = os.path.join(bus.data_dir, "replica-0", f"{topic_name}-0")
    assert os.path.isdir(directory)
    bus.admin.delete_topic(topic_name)
    assert topic_name not in bus.admin.list_topics()
    assert not os.path.exists(directory)
    with pytest.raises(UnknownTopicError):
        bus.admin.describe_topic(topic_name)
    with pytest.raises(UnknownTopicError):
        bus.admin.delete_topic(topic_name)


@pytest.mark.parametrize("name", ["../x", "", "..", "a/b", "x" * 250, "bad name"])
def test_invalid_topic_names_change_nothing(bus, name):
    before = sorted(os.listdir(bus.data_dir))
    with pytest.raises(InvalidTopicError):
        bus.admin.create_topic(name)
    producer = logbus.Producer(bus)
    with pytest.raises(InvalidTopicError):
        producer.send(name, b"x")
    producer.close()
    assert sorted(os.listdir(bus.data_dir)) == before
    assert bus.admin.list_topics() == []


def test_bad_inputs_get_named_errors(bus, topic_name):
    with pytest.raises(InvalidReplicationFactorError):
        bus.admin.create_topic(topic_name, replication_factor=5)  # one Ray node here
    with pytest.raises(InvalidPartitionsError):
        bus.admin.create_topic(topic_name, partitions=0)
    assert bus.admin.list_topics() == []
    bus.admin.create_topic(topic_name, partitions=1, config={"max.message.bytes": 8192})
    producer = logbus.Producer(bus)
    with pytest.raises(UnknownTopicError):
        producer.send("no-such-topic", b"x")
    with pytest.raises(InvalidPartitionError):
        producer.send(topic_name, b"x", partition=3)
    with pytest.raises(RecordTooLargeError):
        producer.send(topic_name, b"x" * 10_000)
    with pytest.raises(logbus.InvalidRecordError):
        producer.send(topic_name, 12345)
    producer.close()
    with pytest.raises(IllegalStateError):
        producer.send(topic_name, b"x")
    consumer = logbus.Consumer(bus)
    with pytest.raises(UnknownTopicError):
        consumer.assign([TopicPartition("no-such-topic", 0)])
    consumer.assign([TopicPartition(topic_name, 0)])
    with pytest.raises(OffsetOutOfRangeError):
        consumer.seek(TopicPartition(topic_name, 0), -1)
    consumer.close()
    with pytest.raises(IllegalStateError):
        consumer.poll()
    # Nothing refused was written. (On a loaded machine the node's lease can lapse and the partition be
    # leaderless for a moment, its end offset unknown: read it from its leader.)

    def led():
        partition = bus.admin.describe_topic(topic_name).partitions[0]
        return partition if partition.leader is not None else None

    assert wait_for(led, timeout_s=60, message="the partition's leader").log_end_offset == 0


def test_producer_refuses_bad_input_with_named_errors_and_sends_nothing(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    producer = logbus.Producer(bus, linger_ms=0)
    refused = [
        # A partition number outside the topic is the caller's mistake: not the retriable UnknownTopicError.
        (InvalidPartitionError, "partitions 0..1", dict(partition=2)),
        (InvalidPartitionError, "partitions 0..1", dict(partition=99)),
        (InvalidPartitionError, "partitions 0..1", dict(partition=-1)),
        (InvalidPartitionError, "partitions 0..1", dict(partition=True)),
        (InvalidPartitionError, "partitions 0..1", dict(partition=1.0)),
        (InvalidPartitionError, "partitions 0..1", dict(partition="0")),
        (InvalidRecordError, "timestamp_ms", dict(timestamp_ms=2**63)),
        (InvalidRecordError, "timestamp_ms", dict(timestamp_ms=-1)),
        (InvalidRecordError, "value is a str that is not valid UTF-8", dict(value="\ud800")),
        (InvalidRecordError, "key is a str that is not valid UTF-8", dict(key="\ud800")),
        (InvalidRecordError, "header name", dict(headers={"\ud800": b"x"})),
        (InvalidRecordError, "header 'h' must be bytes", dict(headers={"h": 5})),
        (InvalidRecordError, "headers must be a dict or a list", dict(headers=[("h",)])),
    ]
    for error, message, arguments in refused:
        arguments = {"value": b"x", **arguments}
        with pytest.raises(error, match=message) as caught:
            producer.send(topic_name, **arguments)
        assert not caught.value.retriable, arguments
    with pytest.raises(InvalidTopicError):
        producer.send([topic_name], b"x")  # unhashable: still a topic-name error
    tables = [
        (InvalidPartitionError, "partition 5", pa.table({"value": [b"x"], "partition": [5]})),
        (InvalidRecordError, "must hold ints", pa.table({"value": [b"x"], "partition": [1.0]})),
        (InvalidRecordError, "must hold ints", pa.table({"value": [b"x"], "partition": ["0"]})),
        (InvalidRecordError, "nulls", pa.table({"value": [b"x", b"y"], "partition": pa.array([0, None], pa.int32())})),
        (InvalidRecordError, "column 'key'", pa.table({"value": [b"x"], "key": [7]})),
        (InvalidRecordError, "non-negative", pa.table({"value": [b"x"], "timestamp": [-5]})),
    ]
    for error, message, table in tables:
        with pytest.raises(error, match=message) as caught:
            producer.send_table(topic_name, table)
        assert not caught.value.retriable
    for timeout_s in (-1, "soon", float("nan"), True):
        with pytest.raises(InvalidConfigError, match="timeout_s"):
            producer.flush(timeout_s)
        with pytest.raises(InvalidConfigError, match="timeout_s"):
            producer.close(timeout_s)
    # Nothing was queued by the refused calls: the next record is the first of its partition.
    assert producer.send(topic_name, b"good", partition=1).result(timeout=60).offset == 0
    producer.close()
    assert [p.log_end_offset for p in bus.admin.describe_topic(topic_name).partitions] == [0, 1]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(acks=True), "acks"),
        (dict(acks=1.0), "acks"),
        (dict(compression=["lz4"]), "compression"),
        (dict(linger_ms=float("nan")), "linger_ms"),
        (dict(request_timeout_ms=float("inf")), "request_timeout_ms"),
        (dict(max_block_ms=10**30), "max_block_ms"),
        (dict(batch_size_bytes=1.5), "batch_size_bytes"),
        (dict(buffer_memory_bytes=float("inf")), "buffer_memory_bytes"),
        (dict(max_in_flight=True), "max_in_flight"),
        (dict(enable_idempotence="false"), "enable_idempotence"),
        (dict(local_channel=None), "local_channel"),
    ],
)
def test_producer_settings_are_checked(bus, options, message):
    with pytest.raises(InvalidConfigError, match=message):
        logbus.Producer(bus, **options)


def test_producer_needs_a_bus():
    with pytest.raises(InvalidConfigError, match="bus must be a Bus"):
        logbus.Producer(None)


def test_admin_refuses_bad_arguments_before_the_controller(bus, topic_name):
    with pytest.raises(InvalidPartitionsError, match="at most"):
        bus.admin.create_topic(topic_name, partitions=10**30)
    with pytest.raises(InvalidConfigError, match="segment.bytes must be at most"):
        bus.admin.create_topic(topic_name, config={"segment.bytes": 2**31})
    with pytest.raises(InvalidConfigError, match="retention.ms must be an integer"):
        bus.admin.create_topic(topic_name, config={"retention.ms": float("inf")})
    assert bus.admin.list_topics() == []
    bus.admin.create_topic(topic_name)
    for to in ("soon", 1.5, True, None, {"timestamp": "x"}):
        with pytest.raises(InvalidConfigError, match="reset to"):
            bus.admin.reset_offsets("g", to, topics=[topic_name])
    with pytest.raises(OffsetOutOfRangeError):
        bus.admin.reset_offsets("g", -1, topics=[topic_name])
    with pytest.raises(InvalidConfigError, match="topics must be a list"):
        bus.admin.reset_offsets("g", "earliest", topics=topic_name)  # a str would be read as one-letter topics
    assert bus.admin.list_groups() == []  # nothing was reset


def test_producer_and_consumer_inside_ray_tasks(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)

    @ray.remote(num_cpus=0)
    def produce(bus, topic, start):
        with logbus.Producer(bus) as producer:
            futures = [producer.send(topic, b"%d" % i, key=b"%d" % i) for i in range(start, start + 500)]
        return [f.result().offset for f in futures]

    @ray.remote(num_cpus=0)
    def consume(bus, topic, expected):
        consumer = logbus.Consumer(bus)
        consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
        values = []
        while len(values) < expected:
            values += consumer.poll_arrow(timeout_ms=1000)["value"].to_pylist()
        return sorted(int(v) for v in values)

    ray.get([produce.remote(bus, topic_name, 0), produce.remote(bus, topic_name, 500)], timeout=120)
    assert ray.get(consume.remote(bus, topic_name, 1000), timeout=120) == list(range(1000))


@pytest.mark.slow
def test_kill_replica_process_while_producing(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    leader = bus.topic_metadata(topic_name).leaders[0]
    pid = ray.get(leader.ping.remote())
    producer = logbus.Producer(bus, linger_ms=1, delivery_timeout_ms=60_000)
    futures = []
    for i in range(20_000):
        futures.append(producer.send(topic_name, b"r-%d" % i))
        if i == 10_000:
            os.kill(pid, signal.SIGKILL)
    producer.flush(timeout_s=120)
    acknowledged = {f.result().offset: b"r-%d" % i for i, f in enumerate(futures) if f.exception() is None}
    assert len(acknowledged) > 10_000
    assert ray.get(leader.ping.remote()) != pid  # Ray restarted the actor in a new process
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, 0)])
    end = consumer.end_offsets([TopicPartition(topic_name, 0)])[TopicPartition(topic_name, 0)]
    stored = drain(consumer, end)
    by_offset = dict(zip(stored["offset"].to_pylist(), stored["value"].to_pylist()))
    for offset, value in acknowledged.items():
        assert by_offset[offset] == value  # every acknowledged record survived, at its offset
    assert assert_healed(bus, topic_name) == {0: end}


@pytest.mark.parametrize("idempotent", [True, False])
def test_many_small_batches_land_in_send_order(bus, topic_name, idempotent):
    """Ray may start concurrent calls to an actor out of order; the log must still follow send order."""
    bus.admin.create_topic(topic_name, partitions=1)
    with logbus.Producer(bus, linger_ms=0, enable_idempotence=idempotent) as producer:
        futures = [producer.send(topic_name, b"%d" % i) for i in range(3000)]
    offsets = [f.result().offset for f in futures]
    assert offsets == sorted(offsets) and len(set(offsets)) == 3000
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, 0)])
    values = drain(consumer, 3000)["value"].to_pylist()
    assert values == [b"%d" % i for i in range(3000)]


def test_fetch_sessions_continue_pipelined_fetches(bus, topic_name):
    """Two fetches of one session sent together read consecutive batches; another session starts over."""
    bus.admin.create_topic(topic_name, partitions=1)
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(3):
            producer.send(topic_name, b"batch-%d" % i).result()  # one batch each
    leader = bus.topic_metadata(topic_name).leaders[0]
    one_batch = 1  # max_bytes: whole batches, at least one, so exactly one per fetch here
    pipelined = ray.get([leader.fetch.remote(FetchRequest(0, one_batch, 0, True, 1 << 16, 7)) for _ in range(2)])
    ranges = sorted((meta.first_offset, meta.next_offset) for meta, _ in pipelined)
    assert ranges == [(0, 1), (1, 2)]  # whichever ran first, the second continued it
    assert all(isinstance(data, bytes) for _, data in pipelined)  # small results travel inside the reply
    meta, _ = ray.get(leader.fetch.remote(FetchRequest(0, one_batch, 0, True, 1 << 16, 8)))
    assert (meta.first_offset, meta.next_offset) == (0, 1)  # a new session reads from the offset asked for
    meta, _ = ray.get(leader.fetch.remote(FetchRequest(0, one_batch, 0, True, 1 << 16, 7)))
    assert (meta.first_offset, meta.next_offset) == (2, 3)
    meta, data = ray.get(leader.fetch.remote(FetchRequest(0, one_batch, 0, True, 1 << 16, 7)))
    assert data is None and meta.first_offset == meta.next_offset  # the session is at the end


def test_tailing_consumer_gets_each_record_once_across_seeks(bus, topic_name):
    """A consumer at the log end (two fetches in flight) takes every record once, in order, also after seeks."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    consumer = logbus.Consumer(bus, fetch_max_wait_ms=200)
    consumer.assign([tp])
    assert consumer.poll_arrow(timeout_ms=100).num_rows == 0  # tailing: fetches wait at the leader
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(1000):
            producer.send(topic_name, b"%d" % i)
            if i % 100 == 0:
                producer.flush()
    assert drain(consumer, 1000)["offset"].to_pylist() == list(range(1000))
    consumer.seek(tp, 400)
    assert drain(consumer, 600)["offset"].to_pylist() == list(range(400, 1000))
    consumer.seek(tp, 990)
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(1000, 1050):
            producer.send(topic_name, b"%d" % i).result()
    got = drain(consumer, 60)
    assert got["offset"].to_pylist() == list(range(990, 1050))
    assert got["value"].to_pylist() == [b"%d" % i for i in range(990, 1050)]
    assert consumer.poll_arrow(timeout_ms=300).num_rows == 0  # nothing twice
    consumer.close()


def test_consumer_recovers_when_its_fetch_session_runs_ahead(bus, topic_name):
    """Fault: replies of the consumer's fetch session go elsewhere; it must notice the gap and read again."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    consumer = logbus.Consumer(bus, fetch_max_wait_ms=200)
    consumer.assign([tp])
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(100):
            producer.send(topic_name, b"%d" % i)
    assert drain(consumer, 100)["offset"].to_pylist() == list(range(100))
    session = consumer._partitions[tp].session  # white box: the id its next fetches carry
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(100, 200):
            producer.send(topic_name, b"%d" % i).result()  # one batch each
    leader = bus.topic_metadata(topic_name).leaders[0]
    stolen = ray.get([leader.fetch.remote(FetchRequest(100, 1, 0, True, 1 << 16, session)) for _ in range(3)])
    firsts = sorted(meta.first_offset for meta, _ in stolen)
    # They continued the session (its fetches waiting at the leader may have taken a batch first).
    assert firsts[0] >= 100 and firsts == list(range(firsts[0], firsts[0] + 3))
    got = drain(consumer, 100)
    assert got["offset"].to_pylist() == list(range(100, 200))
    assert got["value"].to_pylist() == [b"%d" % i for i in range(100, 200)]
    assert consumer._partitions[tp].session != session  # it started a new session
    consumer.close()


def test_consumer_behind_pipelines_fetches_within_its_memory_bound(bus, topic_name):
    """Behind the log end, two large fetches go out while two replies fit max_buffered_bytes, else one;
    either way every record arrives once, in order."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    rows, tables = 1000, 30
    with logbus.Producer(bus) as producer:
        for t in range(tables):  # one ~110 KB batch per table: larger than a reply carries inline
            values = [b"%06d" % (t * rows + i) + b"x" * 100 for i in range(rows)]
            producer.send_table(topic_name, pa.table({"value": pa.array(values, pa.binary())}))
    fetch_max_bytes = 150_000  # one batch per fetch
    for max_buffered_bytes, in_flight_max in ((10 << 20, 2), (200_000, 1)):
        consumer = logbus.Consumer(bus, fetch_max_bytes=fetch_max_bytes, max_buffered_bytes=max_buffered_bytes)
        consumer.assign([tp])
        consumer.seek_to_beginning()
        state = consumer._partitions[tp]  # white box: the fetches outstanding after each poll
        got, most_in_flight = [], 0
        while sum(t.num_rows for t in got) < rows * tables:
            table = consumer.poll_arrow(timeout_ms=5000)
            assert table.num_rows, "no records within 5 s"
            got.append(table)
            most_in_flight = max(most_in_flight, len(state.in_flight))
        both = pa.concat_tables(got)
        assert both["offset"].to_pylist() == list(range(rows * tables))
        assert [v[:6] for v in both["value"].to_pylist()] == [b"%06d" % i for i in range(rows * tables)]
        if in_flight_max == 2:
            assert most_in_flight == 2  # the second fetch went out while the first reply was handled
        else:
            assert most_in_flight <= 1  # the buffer and a second reply would not fit
        consumer.close()
