"""The consumer as Kafka users meet it: kafka-python's idioms, retriable errors kept inside, bad input named.

Pure checks (argument handling, ConsumerRecord's shape) run without Ray; the
rest go through real Ray actors (the ``bus`` fixture), and the fault tests
kill real replica and controller processes.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import time

import pyarrow as pa
import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st

import logbus
from logbus import ConsumerRecord, OffsetAndMetadata, OffsetAndTimestamp, TopicPartition
from logbus.api import consumer as consumer_module
from logbus.api.group_membership import REJOIN_ERRORS, checked_offsets
from logbus.errors import (
    IllegalStateError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidPartitionError,
    InvalidRecordError,
    InvalidTopicError,
    OffsetOutOfRangeError,
    RecordDeserializationError,
    SerializationError,
)
from logbus.storage import record_batch as rb
from tests.healing import assert_healed
from tests.conftest import wait_for

FAST_GROUP = dict(session_timeout_ms=3000, heartbeat_interval_ms=300, enable_auto_commit=False)

topic_names = st.text(alphabet="abcxyz-._", min_size=1, max_size=12).filter(lambda t: t not in (".", ".."))
partitions = st.lists(st.builds(TopicPartition, topic_names, st.integers(0, 1000)), max_size=6)


# --- without Ray ---------------------------------------------------------------------------------------


def test_consumer_record_keeps_its_seven_fields_in_place_and_adds_kafka_python_names():
    old = ConsumerRecord("t", 1, 7, 1234, b"k", b"v", [("h", b"x")])  # built as before timestamp_type existed
    assert old.timestamp_type == rb.TIMESTAMP_TYPE_CREATE_TIME
    assert old[:7] == ("t", 1, 7, 1234, b"k", b"v", [("h", b"x")])  # every index reads what it read
    assert (old.timestamp, old.timestamp_ms) == (1234, 1234)
    assert old._replace(timestamp_ms=99).timestamp == 99
    assert ConsumerRecord._fields[-1] == "timestamp_type"
    appended = ConsumerRecord("t", 1, 7, 55, None, None, None, rb.TIMESTAMP_TYPE_LOG_APPEND_TIME)
    assert (appended.timestamp, appended.timestamp_type) == (55, 2)
    assert logbus.OffsetAndTimestamp(3, 4) == (3, 4) and logbus.OffsetAndMetadata(5, "m").metadata == "m"


@given(partitions)
def test_partitions_are_taken_as_arguments_or_as_one_list(tps):
    as_list = consumer_module._partitions_arg((tps,), "f()")
    assert as_list == tps
    assert consumer_module._partitions_arg(tuple(tps), "f()") == (tps or None)  # varargs; none given -> None
    assert consumer_module._partitions_arg((tuple(tps),), "f()") == tps  # one tuple of them
    if tps:
        assert consumer_module._partitions_arg((tps[0],), "f()") == [tps[0]]  # one partition alone
        assert consumer_module._partitions_arg(((tps[0].topic, tps[0].partition),), "f()") == [tps[0]]


@pytest.mark.parametrize("bad", ["events", b"events", 5, None, [("t", -1)], [("t",)], [5]])
def test_partition_arguments_that_are_not_partitions_are_refused(bad):
    with pytest.raises((InvalidConfigError, InvalidTopicError, InvalidPartitionError)) as caught:
        consumer_module._partitions_arg((bad,), "f()")
    assert not caught.value.retriable


@given(st.one_of(st.integers(0, 10**12), st.floats(0, 1e12)))
def test_poll_timeouts_accept_finite_non_negative_numbers(ms):
    assert consumer_module._poll_timeout_s(ms) == pytest.approx(ms / 1000)


@given(st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-9), st.just(math.nan), st.just(math.inf),
                 st.booleans(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=1)))
def test_poll_timeouts_refuse_everything_else(bad):
    with pytest.raises(InvalidConfigError, match=f"timeout_ms must be a number of ms from 0 to {2**63 - 1}, not "):
        consumer_module._poll_timeout_s(bad)


def test_consumer_timeout_may_be_forever():
    assert logbus.Consumer(None, consumer_timeout_ms=None)._consumer_timeout_s is None
    assert logbus.Consumer(None, consumer_timeout_ms=math.inf)._consumer_timeout_s is None
    with pytest.raises(InvalidConfigError, match="consumer_timeout_ms .* or None for no limit, not -1"):
        logbus.Consumer(None, consumer_timeout_ms=-1)


@given(st.dictionaries(st.builds(TopicPartition, st.just("t"), st.integers(0, 50)),
                       st.one_of(st.integers(0, 2**63 - 1), st.builds(OffsetAndMetadata, st.integers(0, 2**63 - 1), st.text(max_size=5)))))
def test_commits_of_offsets_and_offsets_with_metadata_are_taken_as_they_are(offsets):
    assert checked_offsets(offsets) == offsets


@pytest.mark.parametrize("value", [1.5, True, -1, "5", None, OffsetAndMetadata(-1), OffsetAndMetadata(1.5), 2**63])
def test_commit_values_that_are_not_offsets_are_refused(value):
    with pytest.raises(InvalidRecordError, match="commit for"):
        checked_offsets({TopicPartition("t", 0): value})


@pytest.mark.parametrize("offsets", [[(TopicPartition("t", 0), 1)], 5, "t", {TopicPartition("t", 0)}])
def test_commits_that_are_not_dicts_are_refused(offsets):
    with pytest.raises(InvalidConfigError, match="dict"):
        checked_offsets(offsets)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(fetch_max_bytes=0), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_bytes=-5), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_bytes=1.5), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_bytes=True), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_bytes="1MB"), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_bytes=2**40), InvalidConfigError, "fetch_max_bytes"),
        (dict(fetch_max_wait_ms=-1), InvalidConfigError, "fetch_max_wait_ms"),
        (dict(fetch_max_wait_ms=float("inf")), InvalidConfigError, "fetch_max_wait_ms"),
        (dict(fetch_max_wait_ms=None), InvalidConfigError, "fetch_max_wait_ms"),
        (dict(max_buffered_bytes=0), InvalidConfigError, "max_buffered_bytes"),
        (dict(max_buffered_bytes=False), InvalidConfigError, "max_buffered_bytes"),
        (dict(check_crcs=1), InvalidConfigError, "check_crcs"),
        (dict(check_crcs="no"), InvalidConfigError, "check_crcs"),
        (dict(enable_auto_commit="false"), InvalidConfigError, "enable_auto_commit"),
        (dict(local_channel=0), InvalidConfigError, "local_channel"),
        (dict(partition_assignment_strategy=5), InvalidConfigError, "partition_assignment_strategy"),
        (dict(partition_assignment_strategy=[]), InvalidConfigError, "partition_assignment_strategy"),
        (dict(partition_assignment_strategy=["range", 5]), InvalidConfigError, "partition_assignment_strategy"),
        (dict(partition_assignment_strategy={"range"}), InvalidConfigError, "partition_assignment_strategy"),
        (dict(partition_assignment_strategy="sticky"), InvalidConfigError, "strategy"),
        (dict(key_deserializer="utf-8"), InvalidConfigError, "key_deserializer"),
        (dict(value_deserializer=b"json"), InvalidConfigError, "value_deserializer"),
        (dict(consumer_timeout_ms=-1), InvalidConfigError, "consumer_timeout_ms"),
        (dict(consumer_timeout_ms="1s"), InvalidConfigError, "consumer_timeout_ms"),
        (dict(default_api_timeout_ms=0), InvalidConfigError, "default_api_timeout_ms"),
        (dict(auto_offset_reset="smallest"), InvalidConfigError, "auto_offset_reset"),
        (dict(group_id=""), InvalidGroupIdError, "group_id"),
        (dict(isolation_level="READ_COMMITTED"), InvalidConfigError, "isolation_level"),
        (dict(isolation_level=1), InvalidConfigError, "isolation_level"),
    ],
)
def test_consumer_settings_are_checked_before_anything_happens(options, error, message):
    with pytest.raises(error, match=message) as caught:
        logbus.Consumer(None, **options)  # fails before any use of the bus
    assert not caught.value.retriable


def test_topics_given_to_the_constructor_must_be_names():
    with pytest.raises(InvalidConfigError, match="one by one"):
        logbus.Consumer(None, ["events", "clicks"], group_id="g")


def test_a_deserialization_error_names_its_record_and_survives_pickling():
    error = RecordDeserializationError("the value deserializer failed at offset 7", TopicPartition("t", 2), 7)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.topic_partition, copy.offset, str(copy)) == (TopicPartition("t", 2), 7, str(error))
    assert isinstance(copy, SerializationError) and not copy.retriable


# --- through real actors ------------------------------------------------------------------------------


def produce_values(bus, topic, values, partition=0, **fields):
    """``values`` in one batch (send_table), to one partition."""
    columns = {"value": pa.array(values, pa.binary()), "partition": pa.array([partition] * len(values), pa.int32())}
    columns.update(fields)
    with logbus.Producer(bus) as producer:
        producer.send_table(topic, pa.table(columns)).result(timeout=60)


def test_kafka_python_idioms_subscribe_in_the_constructor_and_iterate(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(40):
            key = None if i % 10 == 0 else f"user-{i % 3}"
            producer.send(topic_name, json.dumps({"n": i}).encode(), key=key, partition=i % 2)
    consumer = logbus.Consumer(
        bus, topic_name, group_id="idioms", key_deserializer=bytes.decode, value_deserializer=json.loads,
        consumer_timeout_ms=60_000, **FAST_GROUP,
    )
    assert consumer._subscribed  # white box: the constructor subscribed; the join happens in poll/iteration
    first = next(consumer)
    assert isinstance(first, ConsumerRecord) and first.value == {"n": first.offset * 2 + first.partition}
    # Positions count records handed out, not records converted: the other partition has handed out none.
    other = TopicPartition(topic_name, 1 - first.partition)
    assert consumer.position(other) == 0  # (looked up if it was not yet: commit() commits known positions only, as Kafka's)
    consumer.commit()
    assert consumer.committed(TopicPartition(topic_name, first.partition)) == first.offset + 1
    assert consumer.committed([other]) == {other: 0}
    got = [first]
    for record in consumer:
        got.append(record)
        if len(got) == 40:
            break
    assert sorted(r.value["n"] for r in got) == list(range(40))
    for record in got:
        n = record.value["n"]
        assert record.key == (None if n % 10 == 0 else f"user-{n % 3}")  # a null key stays None
        assert record.timestamp_type == rb.TIMESTAMP_TYPE_CREATE_TIME and record.timestamp > 0
    for partition in (0, 1):
        assert [r.offset for r in got if r.partition == partition] == list(range(20))
    # Nothing more: iteration stops after consumer_timeout_ms without a record (kafka-python's StopIteration).
    consumer._consumer_timeout_s = 0.5  # white box: shorten the wait for this check
    assert list(consumer) == []
    consumer.close()


def test_iteration_hands_out_records_one_at_a_time_across_seek_pause_and_poll(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    produce_values(bus, topic_name, [b"%d" % i for i in range(10)])
    consumer = logbus.Consumer(bus, consumer_timeout_ms=30_000)
    consumer.assign([tp])
    assert next(consumer).offset == 0
    assert consumer.position(tp) == 1  # ten were fetched and converted; one was handed out
    consumer.seek(tp, 5)
    assert next(consumer).offset == 5  # the converted records after the old position are dropped
    consumer.pause(tp)
    consumer._consumer_timeout_s = 0.3  # white box: a short wait for the paused partition
    with pytest.raises(StopIteration):
        next(consumer)
    consumer._consumer_timeout_s = 30.0
    consumer.resume(tp)
    assert next(consumer).offset == 6
    # poll() after iterating: the records converted for iteration are not lost or repeated.
    got = []
    wait_for(lambda: got.extend(r.offset for r in consumer.poll(timeout_ms=200).get(tp, [])) or len(got) >= 3,
             timeout_s=60, interval_s=0, message="the rest by poll()")
    assert got == [7, 8, 9]
    consumer.close()


def test_a_failing_deserializer_names_the_record_and_the_position_stays_there(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    produce_values(bus, topic_name, [b"1", b"2", b"oops", b"4"])
    consumer = logbus.Consumer(bus, value_deserializer=int)
    consumer.assign([tp])
    values = []

    def until_error():
        try:
            values.extend(r.value for r in consumer.poll(timeout_ms=200).get(tp, []))
        except RecordDeserializationError as error:
            return error
        return None

    error = wait_for(until_error, timeout_s=60, interval_s=0, message="the deserialization error")
    assert values == [1, 2]  # the records before it were handed out first
    assert (error.topic_partition, error.offset) == (tp, 2)
    assert isinstance(error, SerializationError) and isinstance(error.__cause__, ValueError) and not error.retriable
    assert f"offset 2 of {topic_name}-0" in str(error)
    assert consumer.position(tp) == 2
    for _ in range(2):  # it stays there, as in Kafka's clients, by poll() and by iteration alike
        with pytest.raises(RecordDeserializationError):
            consumer.poll(timeout_ms=100)
        with pytest.raises(RecordDeserializationError):
            next(consumer)
        assert consumer.position(tp) == 2
    consumer.seek(error.topic_partition, error.offset + 1)
    rest = wait_for(lambda: consumer.poll(timeout_ms=200).get(tp), timeout_s=60, message="the record after it")
    assert [r.value for r in rest] == [4]
    # A key deserializer failure is named the same way.
    keyed = logbus.Consumer(bus, key_deserializer=lambda key: key.decode("ascii"))
    keyed.assign([tp])
    produce_values(bus, topic_name, [b"a", b"b"], key=pa.array([b"ok", b"\xff"], pa.binary()))
    keyed.seek(tp, 4)
    first = wait_for(lambda: keyed.poll(timeout_ms=200).get(tp), timeout_s=60, message="the first keyed record")
    assert [r.key for r in first] == ["ok"]
    with pytest.raises(RecordDeserializationError, match="key deserializer failed on the record at offset 5"):
        keyed.poll(timeout_ms=100)
    consumer.close()
    keyed.close()


def test_log_append_time_records_carry_their_batch_append_time_in_poll_and_poll_arrow(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config={"message.timestamp.type": "LogAppendTime"})
    tp = TopicPartition(topic_name, 0)
    before_ms = time.time_ns() // 1_000_000
    for batch in range(3):  # three batches, each appended at its own time; create times long past
        produce_values(bus, topic_name, [b"%d-%d" % (batch, i) for i in range(5)],
                       timestamp=pa.array([1_000 + i for i in range(5)], pa.int64()))
    after_ms = time.time_ns() // 1_000_000
    consumer = logbus.Consumer(bus)
    consumer.assign([tp])
    records = []
    wait_for(lambda: records.extend(consumer.poll(timeout_ms=200).get(tp, [])) or len(records) >= 15,
             timeout_s=60, interval_s=0, message="15 records")
    assert {r.timestamp_type for r in records} == {rb.TIMESTAMP_TYPE_LOG_APPEND_TIME}
    for batch in range(3):
        stamps = {r.timestamp for r in records[batch * 5:batch * 5 + 5]}
        assert len(stamps) == 1  # every record of a batch carries the batch's append time
        assert before_ms <= stamps.pop() <= after_ms
    consumer.seek(tp, 3)  # a slice that starts inside the first batch
    tables = []
    wait_for(lambda: tables.append(consumer.poll_arrow(timeout_ms=200)) or sum(t.num_rows for t in tables) >= 12,
             timeout_s=60, interval_s=0, message="12 rows")
    table = pa.concat_tables(tables)
    assert table["offset"].to_pylist() == list(range(3, 15))
    assert table["timestamp"].to_pylist() == [r.timestamp for r in records[3:]]
    assert table["timestamp_type"].to_pylist() == [rb.TIMESTAMP_TYPE_LOG_APPEND_TIME] * 12
    assert table.schema.names == ["topic", "partition", "offset", "timestamp", "key", "value", "headers", "timestamp_type"]
    first_append = records[0].timestamp
    assert consumer.offsets_for_times({tp: first_append}) == {tp: OffsetAndTimestamp(0, first_append)}
    consumer.close()


def test_commits_with_metadata_and_partitions_given_either_way(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    tp0, tp1 = TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)
    for partition, count in ((0, 6), (1, 4)):
        produce_values(bus, topic_name, [b"x"] * count, partition=partition)
    consumer = logbus.Consumer(bus, group_id="meta", **FAST_GROUP)
    consumer.assign([tp0, tp1])
    consumer.commit({tp0: OffsetAndMetadata(3, "checkpoint-a"), tp1: 2})
    assert consumer.committed(tp0) == 3  # one partition: its offset (kafka-python's committed(tp))
    assert consumer.committed([tp0, tp1]) == {tp0: 3, tp1: 2}
    assert consumer.committed([tp0], metadata=True) == {tp0: OffsetAndMetadata(3, "checkpoint-a", -1)}
    done = []
    consumer.commit_async({tp1: OffsetAndMetadata(4, "b")}, callback=lambda offsets, error: done.append(error))
    wait_for(lambda: done, timeout_s=60, message="the asynchronous commit")
    assert done == [None] and consumer.committed(tp1, metadata=True) == OffsetAndMetadata(4, "b", -1)
    consumer.seek_to_end(tp0, tp1)
    assert (consumer.position(tp0), consumer.position(tp1)) == (6, 4)
    consumer.seek_to_beginning(tp1)
    assert (consumer.position(tp0), consumer.position(tp1)) == (6, 0)
    consumer.seek_to_end([tp1])
    consumer.seek_to_beginning()  # no partitions: every assigned one
    assert (consumer.position(tp0), consumer.position(tp1)) == (0, 0)
    consumer.pause(tp0, tp1)
    assert consumer.paused() == {tp0, tp1}
    consumer.resume([tp1])
    consumer.pause()  # none given: none paused (kafka-python's)
    assert consumer.paused() == {tp0}
    got = []
    wait_for(lambda: got.extend(consumer.poll_arrow(timeout_ms=200)["partition"].to_pylist()) or len(got) >= 4,
             timeout_s=60, interval_s=0, message="the unpaused partition's records")
    assert got == [1] * 4
    consumer.close()


def test_bad_arguments_are_named_errors_and_change_nothing(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    tp = TopicPartition(topic_name, 0)
    beyond = TopicPartition(topic_name, 2)
    produce_values(bus, topic_name, [b"a", b"b"])
    consumer = logbus.Consumer(bus, group_id="strict", **FAST_GROUP)
    consumer.assign([tp])
    bad_calls = [
        (lambda: consumer.poll(timeout_ms="100"), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.poll(timeout_ms=-1), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.poll(timeout_ms=math.nan), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.poll(timeout_ms=math.inf), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.poll(max_records=0), InvalidConfigError, "max_records"),
        (lambda: consumer.poll(max_records=2.5), InvalidConfigError, "max_records"),
        (lambda: consumer.poll(max_records=True), InvalidConfigError, "max_records"),
        (lambda: consumer.poll_arrow(timeout_ms=None), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.poll_arrow(max_records=-3), InvalidConfigError, "max_records"),
        (lambda: consumer.seek(tp, "1"), InvalidConfigError, "offset"),
        (lambda: consumer.seek(tp, 1.0), InvalidConfigError, "offset"),
        (lambda: consumer.seek(tp, True), InvalidConfigError, "offset"),
        (lambda: consumer.seek(tp, -1), OffsetOutOfRangeError, "offset"),
        (lambda: consumer.offsets_for_times([tp]), InvalidConfigError, "dict"),
        (lambda: consumer.offsets_for_times({tp: "yesterday"}), InvalidConfigError, "timestamp"),
        (lambda: consumer.offsets_for_times({tp: -5}), InvalidConfigError, "timestamp"),
        (lambda: consumer.offsets_for_times({tp: 1.5}), InvalidConfigError, "timestamp"),
        (lambda: consumer.offsets_for_times({tp: True}), InvalidConfigError, "timestamp"),
        (lambda: consumer.offsets_for_times({beyond: 0}), InvalidPartitionError, r"partitions 0\.\.1"),
        (lambda: consumer.beginning_offsets([beyond]), InvalidPartitionError, r"partitions 0\.\.1"),
        (lambda: consumer.end_offsets([beyond]), InvalidPartitionError, r"partitions 0\.\.1"),
        (lambda: consumer.beginning_offsets(tp), InvalidConfigError, "list of TopicPartitions"),
        (lambda: consumer.assign([beyond]), InvalidPartitionError, r"partitions 0\.\.1"),
        (lambda: consumer.assign(topic_name), InvalidConfigError, "list of TopicPartitions"),
        (lambda: consumer.commit([(tp, 1)]), InvalidConfigError, "dict"),
        (lambda: consumer.commit({tp: 1.5}), InvalidRecordError, "commit for"),
        (lambda: consumer.commit({tp: True}), InvalidRecordError, "commit for"),
        (lambda: consumer.commit({tp: -1}), InvalidRecordError, "commit for"),
        (lambda: consumer.commit({tp: "1"}), InvalidRecordError, "commit for"),
        (lambda: consumer.commit({tp: 1}, timeout_ms=-1), InvalidConfigError, "timeout_ms"),
        (lambda: consumer.commit_async({tp: 1.5}), InvalidRecordError, "commit for"),
        (lambda: consumer.commit_async("offsets"), InvalidConfigError, "dict"),
        (lambda: consumer.committed(5), InvalidConfigError, "list of TopicPartitions"),
        (lambda: consumer.seek_to_end("events"), InvalidConfigError, "list of TopicPartitions"),
        (lambda: consumer.pause(5), InvalidConfigError, "list of TopicPartitions"),
    ]
    for call, error, message in bad_calls:
        with pytest.raises(error, match=message) as caught:
            call()
        assert not caught.value.retriable, caught.value
    assert consumer.assignment() == {tp} and consumer.committed([tp]) == {tp: None}
    consumer.close()
    group_consumer = logbus.Consumer(bus, group_id="strict-subscriber", **FAST_GROUP)
    with pytest.raises(InvalidConfigError, match="not a str"):
        group_consumer.subscribe(topic_name)  # would have subscribed to its letters
    with pytest.raises(InvalidConfigError, match="list of topic names"):
        group_consumer.subscribe(5)
    assert not group_consumer._subscribed
    group_consumer.close()
    # A partition past the cached count is looked up again before it is refused: the topic may have grown.
    grown = logbus.connect(namespace=bus.namespace, data_dir=bus.data_dir)
    grown.admin.create_partitions(topic_name, 3)
    reader = logbus.Consumer(bus)
    reader.assign([beyond])
    assert reader.end_offsets([beyond]) == {beyond: 0}
    reader.close()
    with pytest.raises(IllegalStateError):
        reader.pause(beyond)


# --- faults: retriable errors stay inside the consumer --------------------------------------------------


def leader_pid(bus, topic, partition):
    """The pid of the partition's leader replica as the replica reports it, or None while there is none
    (or the controller is away)."""
    try:
        statuses = ray.get(bus.controller.replica_statuses.remote(topic), timeout=30)[partition]
    except ray.exceptions.RayError:
        return None
    return next((s["pid"] for s in statuses if s.get("role") == "leader" and "pid" in s), None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_poll_and_commit_keep_leader_and_controller_kills_inside(bus, topic_name):
    """A group member polls and commits while leaders and then the controller are killed.

    The first leader dies before the member's first poll (its positions are
    looked up during the outage), the second while it reads, then the
    controller (the group coordinator). Nothing retriable reaches the member:
    poll() only returns records (maybe none) and commit() only returns, or
    raises one of the errors that say "rejoin first" (the controller's restart
    forgets the group's members). It commits after every poll, records or
    not, and auto-commits too, so commits meet the outages. Every record is seen.
    """
    partitions, per_partition = 2, 1500
    bus.admin.create_topic(topic_name, partitions=partitions)
    for partition in range(partitions):
        produce_values(bus, topic_name, [b"%d" % i for i in range(per_partition)], partition=partition)
    everything = {(p, o) for p in range(partitions) for o in range(per_partition)}
    consumer = logbus.Consumer(
        bus, topic_name, group_id="faults", **dict(FAST_GROUP, enable_auto_commit=True, auto_commit_interval_ms=200)
    )
    seen = set()

    def step():
        polled = consumer.poll(timeout_ms=200, max_records=20)  # any error here fails the test
        for tp, records in polled.items():
            seen.update((tp.partition, r.offset) for r in records)
        try:
            consumer.commit()
        except REJOIN_ERRORS:
            pass  # "rejoin first": the next poll() rejoins. Nothing retriable may come here.
        return len(seen)

    def kill_leader_while_polling(partition, enough):
        """Kill the partition's leader, then poll and commit until it is back in a new process and
        ``enough`` records were seen. The first poll starts while the leader is down (a restart takes a
        new process and a log recovery)."""
        killed = wait_for(lambda: leader_pid(bus, topic_name, partition), timeout_s=60, message="the leader's pid")
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: step() >= enough and leader_pid(bus, topic_name, partition) not in (None, killed),
                 timeout_s=120, interval_s=0, message=f"the leader of partition {partition} back, and {enough} records")

    kill_leader_while_polling(0, len(everything) // 4)  # before the first poll: the join finds it dead
    kill_leader_while_polling(1, len(everything) // 2)
    controller_pid = ray.get(bus.controller.ping.remote(), timeout=60)
    os.kill(controller_pid, signal.SIGKILL)
    wait_for(lambda: step() and seen >= everything, timeout_s=240, interval_s=0, message="every record")
    assert seen == everything
    assert ray.get(bus.controller.ping.remote(), timeout=60) != controller_pid  # it really restarted
    # Once the group has settled again, the positions commit cleanly.
    wait_for(lambda: step() and consumer.assignment() and not _commit_refused(consumer),
             timeout_s=60, interval_s=0, message="a clean commit")
    consumer.close()
    assert assert_healed(bus, topic_name) == {p: per_partition for p in range(partitions)}


def _commit_refused(consumer) -> bool:
    try:
        consumer.commit()
    except REJOIN_ERRORS:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_new_consumer_polls_through_a_leader_restart(bus, topic_name):
    """Positions are looked up while the partition's only replica is dead: poll() returns nothing
    meanwhile instead of raising LeaderNotAvailableError, and the lookups wait it out."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    produce_values(bus, topic_name, [b"%d" % i for i in range(500)])
    os.kill(wait_for(lambda: leader_pid(bus, topic_name, 0), timeout_s=60, message="the leader's pid"), signal.SIGKILL)
    consumer = logbus.Consumer(bus)
    consumer.assign([tp])
    offsets = []
    wait_for(lambda: offsets.extend(r.offset for r in consumer.poll(timeout_ms=100).get(tp, [])) or len(offsets) >= 500,
             timeout_s=120, interval_s=0, message="every record")
    assert offsets == list(range(500))
    os.kill(wait_for(lambda: leader_pid(bus, topic_name, 0), timeout_s=60, message="the leader's pid"), signal.SIGKILL)
    assert consumer.end_offsets([tp]) == {tp: 500}  # retried inside until the replica is back
    assert consumer.beginning_offsets([tp]) == {tp: 0}
    consumer.close()
    assert assert_healed(bus, topic_name) == {0: 500}
