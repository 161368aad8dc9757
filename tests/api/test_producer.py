"""The producer's contract with its callers, end to end: real Ray actors, real files.

Record futures as concurrent.futures and asyncio see them, kafka-python's
spellings, serializers, record timestamps, and idempotence after a batch that
failed for good (KIP-360).
"""

import asyncio
import concurrent.futures
import gc
import json
import os
import signal
import threading
import time
import weakref

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import logbus
from logbus import TopicPartition
from logbus.actors.remote import get
from logbus.api import producer as producer_module
from logbus.errors import (
    DuplicateSequenceError,
    IllegalStateError,
    InvalidConfigError,
    InvalidRecordError,
    NotEnoughReplicasError,
    NotLeaderError,
    RecordTooLargeError,
    SerializationError,
)
from logbus.protocol.messages import FetchRequest
from logbus.storage import encode_batch
from logbus.storage import record_batch as rb
from tests.api.murmur2_reference import kafka_partition
from tests.conftest import wait_for

LONG_LINGER_MS = 5_000  # records stay pending this long unless flushed: time to look at pending futures


def read_all(bus, topic, partition=0, timeout_s=60):
    """Every record of one partition, from offset 0 to its end, as ConsumerRecords."""
    tp = TopicPartition(topic, partition)
    consumer = logbus.Consumer(bus)
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    records = []

    def more():
        records.extend(consumer.poll(timeout_ms=200).get(tp, []))
        return len(records) >= end

    wait_for(more, timeout_s=timeout_s, interval_s=0, message=f"{end} records of {topic}-{partition}")
    consumer.close()
    return records


def test_record_futures_work_with_wait_and_as_completed(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    futures = [producer.send(topic_name, b"v%d" % i, key=b"k%d" % (i % 11)) for i in range(300)]
    assert isinstance(futures[0], concurrent.futures.Future)
    # Pending: wait() and as_completed() look at (and wait on) the futures' own state.
    done, not_done = concurrent.futures.wait(futures, timeout=0)
    assert not done and len(not_done) == 300
    with pytest.raises(concurrent.futures.TimeoutError):
        next(concurrent.futures.as_completed(futures, timeout=0.01))
    # Still pending here: as_completed yields them as their batches complete (sent by a flush from
    # another thread rather than at the linger's end).
    flushing = threading.Thread(target=producer.flush, kwargs={"timeout": 60})
    flushing.start()
    yielded = list(concurrent.futures.as_completed(futures, timeout=60))
    flushing.join(timeout=60)
    assert sorted(map(id, yielded)) == sorted(map(id, futures))  # each future once, itself (not its batch)
    done, not_done = concurrent.futures.wait(futures, timeout=60)
    assert len(done) == 300 and not not_done
    first = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION, timeout=60)
    assert len(first.done) == 300
    producer.close()
    metadata = [f.result() for f in futures]
    by_partition = {}
    for m in metadata:
        by_partition.setdefault(m.partition, []).append(m.offset)
    assert all(offsets == list(range(len(offsets))) for offsets in by_partition.values())
    stored = {(r.partition, r.offset): r.value for p in range(3) for r in read_all(bus, topic_name, p)}
    assert {(m.partition, m.offset): b"v%d" % i for i, m in enumerate(metadata)} == stored


def test_record_futures_work_with_asyncio(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    producer = logbus.Producer(bus, linger_ms=5)

    async def main():
        futures = [asyncio.wrap_future(producer.send(topic_name, b"a%d" % i, partition=i % 2)) for i in range(50)]
        return await asyncio.wait_for(asyncio.gather(*futures), 60)

    metadata = asyncio.run(main())
    producer.close()
    assert sorted((m.partition, m.offset) for m in metadata) == sorted((p, o) for p in range(2) for o in range(25))


def test_result_exception_and_cancel_behave_as_a_kafka_future(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    future = producer.send(topic_name, b"pending")
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.01)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.get(timeout=0)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.exception(timeout=0)
    assert not future.done() and future.running() and not future.cancelled()
    assert future.cancel() is False and not future.cancelled()  # a record handed over is on its way
    seen = []
    future.add_done_callback(seen.append)
    with pytest.raises(IllegalStateError):
        future.set_result(None)
    producer.flush(timeout=60)
    assert future.done() and not future.running() and not future.cancelled()
    assert future.exception(timeout=0) is None
    assert future.get() == future.result(timeout=0) and future.result().offset == 0
    assert seen == [future]
    late = []
    future.add_done_callback(late.append)  # already done: called at once
    assert late == [future]
    producer.close()


def test_kafka_python_callbacks_errbacks_and_timestamps(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    old_ms = int(time.time() * 1000) - 60_000  # recent enough for retention
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    calls = []
    future = producer.send(topic_name, b"one", partition=1, timestamp_ms=old_ms)
    chained = future.add_callback(lambda m, tag, n=0: calls.append(("ok", m, tag, n)), "first", n=7).add_errback(
        lambda e, tag: calls.append(("err", e, tag)), "first"
    )
    assert chained is future and calls == []
    producer.flush(timeout=60)
    metadata = future.result()
    assert calls == [("ok", metadata, "first", 7)]
    assert metadata.topic_partition == TopicPartition(topic_name, 1)
    assert metadata.timestamp == metadata.timestamp_ms == old_ms  # CreateTime: the record's own
    future.add_callback(lambda m: calls.append(("late", m)))  # already done: called at once
    assert calls[-1] == ("late", metadata)
    producer.close()


def test_log_append_time_topic_reports_the_leaders_append_time(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config={"message.timestamp.type": "LogAppendTime"})
    old_ms = int(time.time() * 1000) - 60_000
    with logbus.Producer(bus, linger_ms=0) as producer:
        before_ms = time.time_ns() // 1_000_000
        metadata = producer.send(topic_name, b"stamped", timestamp_ms=old_ms).result(timeout=60)
        after_ms = time.time_ns() // 1_000_000
    assert metadata.timestamp == metadata.timestamp_ms and before_ms <= metadata.timestamp <= after_ms
    # The batch as the leader stored it carries that same time.
    leader = bus.topic_metadata(topic_name).leaders[0]
    _, data = get(leader.fetch.remote(FetchRequest(0, inline_max_bytes=1 << 16)))
    stored = rb.read_header(data)
    assert stored.reader_timestamp_type == rb.TIMESTAMP_TYPE_LOG_APPEND_TIME
    assert stored.max_timestamp_ms == metadata.timestamp


def test_serializers_apply_to_keys_and_values_but_not_to_none(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    seen = []

    def value_serializer(value):
        seen.append(value)
        return json.dumps(value)  # a str: sent as UTF-8

    producer = logbus.Producer(
        bus, linger_ms=0, value_serializer=value_serializer, key_serializer=lambda k: b"key-%d" % k
    )
    producer.send(topic_name, {"n": 1}, key=7)
    producer.send(topic_name, None, key=8)  # a tombstone: None is not serialized
    producer.send(topic_name, [2], key=None)
    producer.flush(timeout=60)
    producer.close()
    assert seen == [{"n": 1}, [2]]
    stored = read_all(bus, topic_name)
    assert [(r.key, r.value) for r in stored] == [(b"key-7", b'{"n": 1}'), (b"key-8", None), (None, b"[2]")]


def test_failing_serializers_raise_serialization_error_and_queue_nothing(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)

    def value_serializer(value):
        if value == "boom":
            raise ValueError("cannot serialize boom")
        if value == "number":
            return 42
        return value.encode()

    producer = logbus.Producer(bus, linger_ms=0, value_serializer=value_serializer)
    with pytest.raises(SerializationError) as raised:
        producer.send(topic_name, "boom")
    assert topic_name in str(raised.value) and "cannot serialize boom" in str(raised.value)
    assert isinstance(raised.value.__cause__, ValueError) and not raised.value.retriable
    with pytest.raises(SerializationError, match="returned int"):
        producer.send(topic_name, "number")
    with pytest.raises(InvalidRecordError):  # the serializer's output still meets send()'s own checks
        producer.send(topic_name, "ok", headers=[("h", 5)])
    producer.send(topic_name, "ok").result(timeout=60)
    producer.close()
    assert [r.value for r in read_all(bus, topic_name)] == [b"ok"]
    with pytest.raises(InvalidConfigError, match="value_serializer"):
        logbus.Producer(bus, value_serializer="json")


def test_flush_takes_kafka_pythons_timeout(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    future = producer.send(topic_name, b"x")
    producer.flush(timeout=60)
    assert future.done()
    with pytest.raises(InvalidConfigError):
        producer.flush(timeout=-1)
    with pytest.raises(InvalidConfigError, match="not both"):
        producer.flush(5, timeout=5)
    producer.close()


def test_idempotent_producer_recovers_after_a_batch_failed_for_good(bus, topic_name):
    """KIP-360: a batch that exhausted its delivery timeout must not poison its partition's sequence."""
    bus.admin.create_topic(topic_name, partitions=1, config={"min.insync.replicas": 2})  # one replica: never enough
    producer = logbus.Producer(bus, acks="all", linger_ms=0, delivery_timeout_ms=5000)
    assert producer.enable_idempotence
    failed = []
    lost = producer.send(topic_name, b"lost").add_errback(failed.append)
    # Refused until its delivery timeout: for too few in-sync replicas, or (on a machine so busy that the
    # new leader's node lease is not yet held) as not the leader; never written either way.
    with pytest.raises((NotEnoughReplicasError, NotLeaderError)):
        lost.result(timeout=60)
    assert len(failed) == 1 and isinstance(failed[0], (NotEnoughReplicasError, NotLeaderError))
    bus.admin.alter_config(topic_name, {"min.insync.replicas": 1})
    futures = [producer.send(topic_name, b"after-%d" % i) for i in range(5)]
    producer.flush(timeout=60)
    assert [f.exception() for f in futures] == [None] * 5
    assert [f.result().offset for f in futures] == [0, 1, 2, 3, 4]
    more = [producer.send(topic_name, b"more-%d" % i) for i in range(3)]  # the new sequence carries on
    assert [f.result(timeout=60).offset for f in more] == [5, 6, 7]
    producer.close()
    stored = read_all(bus, topic_name)
    assert [r.value for r in stored] == [b"after-%d" % i for i in range(5)] + [b"more-%d" % i for i in range(3)]


def test_a_sequence_the_leader_may_have_forgotten_goes_one_batch_at_a_time_again(bus, topic_name):
    """The leader says how long it keeps an idempotent producer (producer.id.expiration.ms); once half of
    that has passed since the last acknowledgement, the partition's batches go one at a time until the
    next one, as before its first: a leader that forgot the producer takes any sequence (KIP-360), and a
    second batch must not be written ahead of a first that meets a retriable error."""
    slot = (topic_name, 0)
    bus.admin.create_topic(topic_name, partitions=1, config={"producer.id.expiration.ms": 60_000})
    producer = logbus.Producer(bus, linger_ms=0)
    try:
        assert producer.send(topic_name, b"first").result(timeout=60).offset == 0
        sequences = producer._sequences[slot]
        assert sequences.acknowledged and sequences.expiration_s == 60.0
        now = time.monotonic()
        assert sequences.known_to_leader(now)
        assert not sequences.known_to_leader(sequences.acknowledged_s + 30.0)  # half the window: maybe forgotten
        # A leader that forgets at once (the shortest window there is): every burst still goes through
        # whole and in order, one batch at a time, while the log rolls and forgets the producer.
        bus.admin.alter_config(topic_name, {"producer.id.expiration.ms": 1, "segment.bytes": 4096})
        for burst in range(3):
            futures = [producer.send(topic_name, b"b%d-%03d" % (burst, i) + b"x" * 200) for i in range(40)]
            assert [f.exception(timeout=60) for f in futures] == [None] * 40
        sequences = producer._sequences[slot]
        assert sequences.expiration_s == 0.001
        assert not sequences.known_to_leader(sequences.acknowledged_s + 0.001)
    finally:
        producer.close()
    values = [r.value for r in read_all(bus, topic_name)]
    assert values == [b"first"] + [b"b%d-%03d" % (burst, i) + b"x" * 200 for burst in range(3) for i in range(40)]


@pytest.mark.own_bus
def test_the_sender_asks_for_metadata_again_without_waiting_on_a_controller_that_does_not_answer(bus, topic_name):
    """A batch that needs fresh metadata (after a retriable error) must not hold the sender thread, and
    with it every partition's batches, while the controller does not answer (its host cut off or
    paused): the leaders known serve until the answer comes, and the answer is taken when it does."""
    bus.admin.create_topic(topic_name, partitions=2)
    producer = logbus.Producer(bus, linger_ms=0)
    try:
        assert producer.send(topic_name, b"first", partition=0).result(timeout=60).offset == 0

        # A first send that met a leader not ready yet, or that was long in flight on a busy machine, had
        # the sender ask for the metadata again; an answer asked for is always taken. Take it now, so that
        # the one asked for below is the only one, and the paused controller cannot give it.
        def no_refresh_under_way():
            if topic_name in producer._metadata_requests:
                producer._refreshed(topic_name, 1.0)
            return topic_name not in producer._metadata_requests

        wait_for(no_refresh_under_way, timeout_s=60, message="no refresh of the topic's metadata under way")
        known = producer._topics[topic_name]
        controller_pid = get(bus.controller.ping.remote())
        os.kill(controller_pid, signal.SIGSTOP)
        try:
            answers = []
            asking = threading.Thread(target=lambda: answers.append(producer._refreshed(topic_name, 0.2)))
            asking.start()
            asking.join(timeout=60)
            assert not asking.is_alive(), "the refresh waited on the paused controller"
            assert answers == [known] and answers[0] is known  # the metadata known serves meanwhile
        finally:
            os.kill(controller_pid, signal.SIGCONT)

        def answered():
            metadata = producer._refreshed(topic_name, 1.0)
            return metadata is not known and metadata

        fresh = wait_for(answered, timeout_s=120, message="the controller's answer taken")
        assert [leader._actor_id for leader in fresh.leaders] == [leader._actor_id for leader in known.leaders]
        assert fresh.partition_count == 2
        assert producer.send(topic_name, b"second", partition=1).result(timeout=60).offset == 0
    finally:
        producer.close()


def test_a_batch_numbered_after_a_refused_one_fails_at_once_and_the_partition_recovers(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config={"max.message.bytes": 65536})
    producer = logbus.Producer(bus, linger_ms=0)  # idempotent; the default delivery timeout, 120 s
    assert producer.send(topic_name, b"first").result(timeout=60).offset == 0  # the producer caches the limit
    bus.admin.alter_config(topic_name, {"max.message.bytes": 16384})
    # One table, split at the limit the producer knew: a large batch the leader now refuses for good,
    # then a small one whose sequence follows it, so it can never be in order: it must fail at once,
    # not be retried until its delivery timeout (which result(timeout=60) would not wait for).
    table = pa.table({"value": [b"x" * 1000] * 61})
    with pytest.raises(RecordTooLargeError):
        producer.send_table(topic_name, table).result(timeout=60)
    after = [producer.send(topic_name, b"after-%d" % i) for i in range(3)]
    assert [f.result(timeout=60).offset for f in after] == [1, 2, 3]
    producer.close()
    assert [r.value for r in read_all(bus, topic_name)] == [b"first", b"after-0", b"after-1", b"after-2"]


def test_a_retry_older_than_the_leaders_window_is_refused_for_good(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    # A new topic's partition may have no leader for a moment (as Kafka's LEADER_NOT_AVAILABLE).
    leader = wait_for(lambda: bus.topic_metadata(topic_name, refresh=True).leaders[0], timeout_s=60, message="a leader")
    producer_id = 1 << 40  # outside what the controller hands out

    def batch(sequence):
        return encode_batch([b"s%d" % sequence], producer_id=producer_id, producer_epoch=0, base_sequence=sequence)

    offsets = [get(leader.produce.remote(batch(s))).base_offset for s in range(6)]
    assert offsets == list(range(6))
    assert get(leader.produce.remote(batch(1))).base_offset == 1  # in the window of 5: a duplicate, answered
    with pytest.raises(DuplicateSequenceError) as raised:
        get(leader.produce.remote(batch(0)))  # older than the window: never retriable
    assert not raised.value.retriable
    assert [r.value for r in read_all(bus, topic_name)] == [b"s%d" % s for s in range(6)]


# --- send()'s C path (logbus.api._fastsend) against the Python send() ---------------------------------


def test_the_c_path_is_built_and_taken():
    """./dev builds it (with gcc, which it installs): a run without it would test only the Python path."""
    assert producer_module._fastsend is not None and producer_module.FAST_PATH


def python_producer(bus, monkeypatch, **options) -> logbus.Producer:
    """A producer whose send() is the Python one alone."""
    with monkeypatch.context() as patch:
        patch.setattr(producer_module, "FAST_PATH", False)
        producer = logbus.Producer(bus, **options)
    assert not isinstance(producer.send, producer_module._fastsend.FastSend)
    return producer


def test_the_c_path_and_the_python_path_write_the_same_records(bus, topic_name, monkeypatch):
    """The same sends, one producer on each path, to two topics: the same records land at the same
    partitions and offsets, with the same metadata. The mix makes the C path hand records to the Python
    send() inside a batch (headers, str, a serializer-free bytearray) and take them back."""
    topics = {"c": f"{topic_name}-c", "python": f"{topic_name}-py"}
    for topic in topics.values():
        bus.admin.create_topic(topic, partitions=3)
    producers = {"c": logbus.Producer(bus, linger_ms=LONG_LINGER_MS), "python": python_producer(bus, monkeypatch, linger_ms=LONG_LINGER_MS)}
    assert isinstance(producers["c"].send, producer_module._fastsend.FastSend)
    sends = []
    for i in range(600):
        kind = i % 7
        if kind == 0:
            sends.append(((b"v%d" % i,), {"key": b"k%d" % (i % 13)}))
        elif kind == 1:
            sends.append(((None,), {"key": b"tombstone-%d" % (i % 5)}))
        elif kind == 2:
            sends.append(((b"p%d" % i,), {"partition": i % 3, "timestamp_ms": 1_700_000_000_000 + i}))
        elif kind == 3:
            sends.append(((b"h%d" % i,), {"key": b"k", "headers": {"n": b"%d" % i}}))  # the Python path
        elif kind == 4:
            sends.append((("text-%d" % i,), {"key": bytearray(b"k%d" % i)}))  # converted by the Python path
        elif kind == 5:
            sends.append(((), {"value": b"kw%d" % i, "key": b"k%d" % i, "timestamp_ms": 1_700_000_000_000}))
        else:
            sends.append(((b"", b""), {"partition": 2}))  # empty value and key, positional
    results = {}
    for path, producer in producers.items():
        futures = [producer.send(topics[path], *args, **kwargs) for args, kwargs in sends]
        producer.flush()
        results[path] = [future.result(timeout=60) for future in futures]
        producer.close()
    assert [(m.partition, m.offset) for m in results["c"]] == [(m.partition, m.offset) for m in results["python"]]
    explicit = [i for i, (_, kwargs) in enumerate(sends) if "timestamp_ms" in kwargs]
    assert [results["c"][i].timestamp_ms for i in explicit] == [results["python"][i].timestamp_ms for i in explicit]
    for partition in range(3):
        landed = {
            path: [(r.offset, r.key, r.value, r.headers)
                   for r in read_all(bus, topics[path], partition)]
            for path in topics
        }
        assert landed["c"] == landed["python"] and landed["c"], partition


def test_the_c_path_refuses_what_the_python_path_refuses_with_the_same_errors(bus, topic_name, monkeypatch):
    bus.admin.create_topic(topic_name, partitions=2, config={"max.message.bytes": 64 << 10})
    c_path = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    python = python_producer(bus, monkeypatch, linger_ms=LONG_LINGER_MS)
    for producer in (c_path, python):
        producer.send(topic_name, b"opens", partition=0)
        producer.send(topic_name, b"opens", partition=1)
    bad = [
        ((topic_name, 5), {}),  # an int value
        ((topic_name, b"v"), {"key": 7}),
        ((topic_name, b"v"), {"partition": 2}),
        ((topic_name, b"v"), {"partition": -1}),
        ((topic_name, b"v"), {"partition": True}),
        ((topic_name, b"v"), {"partition": 2**70}),
        ((topic_name, b"v"), {"timestamp_ms": -1}),
        ((topic_name, b"v"), {"timestamp_ms": 2**63}),
        ((topic_name, b"v"), {"timestamp_ms": 1.5}),
        ((topic_name, b"x" * (64 << 10)), {}),
        ((topic_name, b"v"), {"color": "red"}),
        ((topic_name, b"v"), {"topic": topic_name}),
        ((), {}),
        ((topic_name, b"v", None, None, 0, None, "extra"), {}),
        ((["not", "a", "name"], b"v"), {}),
    ]
    for args, kwargs in bad:
        raised = {}
        for path, producer in (("c", c_path), ("python", python)):
            with pytest.raises(Exception) as caught:
                producer.send(*args, **kwargs)
            raised[path] = (type(caught.value), str(caught.value))
        assert raised["c"] == raised["python"], (args, kwargs)
    for producer in (c_path, python):
        producer.flush()
        producer.close()
    assert len(read_all(bus, topic_name, 0)) + len(read_all(bus, topic_name, 1)) == 4  # the good records alone


def test_a_record_future_from_the_c_path_is_freed_by_reference_counting_and_tracked_once_it_can_be_in_a_cycle(bus, topic_name):
    """The C path's futures are not tracked by the cyclic garbage collector (a million kept ones cost
    0.7 us a record in collections otherwise); one given an attribute (or a Future's state) is tracked
    again, so a cycle through it is still collected."""
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    producer.send(topic_name, b"opens the batch")  # opened by the Python send()
    futures = [producer.send(topic_name, b"v%d" % i) for i in range(6)]
    assert not any(gc.is_tracked(f) for f in futures)
    # Callbacks, kept by the batch until it is done (then dropped): the futures stay untracked, even
    # with a callback that refers to its own future (a cycle until the batch is done).
    futures[1].add_done_callback(lambda future: None)
    futures[2].add_callback(lambda metadata: None)
    futures[3].add_errback(lambda error: None)
    futures[4].add_callback(lambda metadata, me=futures[4]: None)
    futures[5].me = futures[5]  # a cycle for good: tracked from the assignment on
    assert [gc.is_tracked(f) for f in futures] == [False] * 5 + [True]
    producer.flush()
    assert [f.result(timeout=60).offset for f in futures] == [1, 2, 3, 4, 5, 6]
    refs = [weakref.ref(f) for f in futures]
    del futures
    producer.close()
    gc.collect()
    assert [ref() for ref in refs] == [None] * 6


def test_a_subclass_that_overrides_send_keeps_its_send(bus):
    class Counting(logbus.Producer):
        def send(self, *args, **kwargs):
            self.sent = getattr(self, "sent", 0) + 1
            return super().send(*args, **kwargs)

    producer = Counting(bus)
    assert not isinstance(producer.send, producer_module._fastsend.FastSend)
    producer.close()


def test_flush_returns_once_every_callback_has_run_and_refuses_to_wait_in_one(bus, topic_name):
    """As in Kafka's producer: when flush() returns, every future sent before is done and its callbacks
    have run (a callback counting acknowledgements has counted them all)."""
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    started, release = threading.Event(), threading.Event()
    ran = []

    def slow_callback(metadata):
        started.set()
        release.wait(60)
        ran.append(metadata.offset)

    futures = [producer.send(topic_name, b"v%d" % i) for i in range(3)]
    futures[0].add_callback(slow_callback)
    flusher = threading.Thread(target=producer.flush, daemon=True)
    flusher.start()
    assert started.wait(60)
    flusher.join(0.5)
    assert flusher.is_alive()  # the batch is acknowledged, but its callback still runs
    release.set()
    flusher.join(60)
    assert not flusher.is_alive() and ran == [0] and all(f.done() for f in futures)
    # In a callback, flush() returns at once with nothing pending, and refuses to wait while records are
    # (it would wait for replies that the thread running the callback delivers).
    inner, refused = [], []

    def flushing_callback(metadata):
        producer.flush(timeout_s=30)
        inner.append(metadata.offset)
        producer.send(topic_name, b"sent by a callback")
        try:
            producer.flush(timeout_s=30)
        except IllegalStateError as error:
            refused.append(error)

    producer.send(topic_name, b"again").add_callback(flushing_callback)
    producer.flush(timeout_s=60)
    assert inner == [3] and len(refused) == 1 and "callback" in str(refused[0])
    producer.flush(timeout_s=60)  # the callback's record
    producer.close()
    assert [r.value for r in read_all(bus, topic_name)][-2:] == [b"again", b"sent by a callback"]


def test_a_failed_batch_is_freed_after_its_error_was_raised_in_a_frame_that_holds_its_futures(bus, topic_name):
    """A batch's records share its error; each caller gets a copy of it (caused by it). Raising the shared
    error into a frame that holds the batch's futures would make a cycle through the batch that the C
    path's untracked futures hide from the garbage collector: the batch, and every value in it, kept forever."""
    bus.admin.create_topic(topic_name, partitions=1, config={"max.message.bytes": 65536})
    producer = logbus.Producer(bus, linger_ms=LONG_LINGER_MS)
    producer.send(topic_name, b"first")
    producer.flush(timeout=60)
    bus.admin.alter_config(topic_name, {"max.message.bytes": 16384})  # the producer still knows 65536

    def send_and_look_at_the_errors():
        futures = [producer.send(topic_name, b"x" * 1000) for _ in range(40)]  # one batch, refused for good
        producer.flush(timeout=60)
        caught = []
        for future in futures:
            try:
                future.get()
            except RecordTooLargeError as error:
                caught.append(error)
        errors = [future.exception() for future in futures]
        try:
            raise errors[0]
        except RecordTooLargeError:
            pass
        assert len(caught) == 40 and all(isinstance(e, RecordTooLargeError) for e in errors)
        assert caught[0] is not caught[1] and str(caught[0]) == str(caught[1]) == str(errors[0])
        return weakref.ref(futures[-1]._batch.future)

    batch_future = send_and_look_at_the_errors()
    bus.admin.alter_config(topic_name, {"max.message.bytes": 65536})
    # (The sender thread keeps its last round's batches in its frame until its next round: one more.)
    producer.send(topic_name, b"next").result(timeout=60)
    gc.collect()
    assert batch_future() is None
    producer.close()


@settings(max_examples=300, deadline=None)
@given(key=st.binary(max_size=64), partitions=st.integers(1, 10_000))
def test_the_c_path_picks_the_partition_of_kafkas_java_client(key, partitions):
    """The C path calls librdkafka's murmur2 partitioner directly (the function confluent_kafka.murmur2
    calls): it agrees with the Java client's partitioner, ported line by line."""
    address = producer_module._murmur2_partitioner()
    assert address
    assert producer_module._fastsend.murmur2_partition(address, key, partitions) == kafka_partition(key, partitions)
