"""kafka-python's and aiokafka's quickstarts, as their READMEs write them, with logbus in place of Kafka.

Each snippet keeps its documentation's shape; only the class (``logbus.Consumer``,
``logbus.Producer``, ``logbus.aio.Consumer``, ``logbus.aio.Producer``) and the
connection (a bus instead of ``bootstrap_servers``) change, plus a way for
loops the documentation writes as endless to end once they have what they
should. ``docs/clients.md`` lists what still differs. Real Ray actors
throughout (the ``bus`` fixture).
"""

from __future__ import annotations

import asyncio
import json
import msgpack
import pytest

import logbus
import logbus.aio
from logbus import TopicPartition
from logbus.errors import IllegalStateError, InvalidConfigError
from tests.conftest import wait_for


def fill(bus, topic: str, partitions: int, count: int, value=lambda i: b"%d" % i) -> None:
    """``count`` records spread over ``partitions``, acknowledged."""
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(count):
            producer.send(topic, value(i), partition=i % partitions)


def drain(consumer, count: int) -> list:
    """Iterate over ``consumer`` (which has a consumer_timeout_ms) until ``count`` records came; fail after 60 s."""
    got = []
    wait_for(lambda: got.extend(consumer) or len(got) >= count, timeout_s=60, message=f"{count} records")
    return got


# --- kafka-python -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_kafka_python_consumer_quickstart_reads_every_partition_without_a_group(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    fill(bus, topic_name, 3, 30)

    # >>> consumer = KafkaConsumer('my_favorite_topic', auto_offset_reset='earliest')
    # >>> for msg in consumer:
    # ...     print (msg)
    consumer = logbus.Consumer(bus, topic_name, auto_offset_reset="earliest")
    seen = []
    for msg in consumer:
        seen.append(msg)
        if len(seen) == 30:
            break
    assert sorted(int(m.value) for m in seen) == list(range(30))
    assert consumer.assignment() == {TopicPartition(topic_name, p) for p in range(3)}
    # No group, so nothing to commit to, as kafka-python's: IllegalStateError('Requires group_id').
    for call in (consumer.commit, consumer.commit_async, lambda: consumer.committed(TopicPartition(topic_name, 0))):
        with pytest.raises(IllegalStateError, match="requires a group_id"):
            call()
    with pytest.raises(IllegalStateError, match="requires a group_id"):
        consumer.commit({TopicPartition(topic_name, 0): 1})
    # Positions are its own: where it stopped reading.
    assert sum(consumer.position(TopicPartition(topic_name, p)) for p in range(3)) == 30
    consumer.close()


@pytest.mark.timeout(180)
def test_a_consumer_without_a_group_finds_partitions_and_topics_added_later(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    fill(bus, topic_name, 1, 5)
    consumer = logbus.Consumer(bus, topic_name, metadata_max_age_ms=200, consumer_timeout_ms=200)
    assert sorted(int(m.value) for m in drain(consumer, 5)) == list(range(5))
    bus.admin.create_partitions(topic_name, 2)
    with logbus.Producer(bus, linger_ms=0) as producer:
        producer.send(topic_name, b"new", partition=1).get(timeout=60)
    assert [m.value for m in drain(consumer, 1)] == [b"new"]
    assert consumer.assignment() == {TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)}
    consumer.close()

    # kafka-python's "Subscribe to a regex topic pattern": consumer = KafkaConsumer(); consumer.subscribe(pattern='^awesome.*')
    prefix = topic_name[:40] + "-awesome"
    bus.admin.create_topic(prefix + "-a")
    fill(bus, prefix + "-a", 1, 3)
    consumer = logbus.Consumer(bus, metadata_max_age_ms=200, consumer_timeout_ms=200)
    consumer.subscribe(pattern=f"^{prefix}.*")
    assert [m.value for m in drain(consumer, 3)] == [b"0", b"1", b"2"]
    bus.admin.create_topic(prefix + "-b")
    fill(bus, prefix + "-b", 1, 2)
    assert [(m.topic, m.value) for m in drain(consumer, 2)] == [(prefix + "-b", b"0"), (prefix + "-b", b"1")]
    assert {tp.topic for tp in consumer.assignment()} == {prefix + "-a", prefix + "-b"}
    # A topic that goes leaves the assignment, and its bookkeeping goes with it.
    bus.admin.delete_topic(prefix + "-a")
    wait_for(
        lambda: list(consumer) == [] and {tp.topic for tp in consumer.assignment()} == {prefix + "-b"}
        and set(consumer._metadata_fresh_s) <= {prefix + "-b"},
        timeout_s=60, message="the deleted topic to leave the assignment and the consumer's tables",
    )
    consumer.close()


@pytest.mark.timeout(180)
def test_kafka_python_readme_consumers(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    fill(bus, topic_name, 3, 9, value=lambda i: msgpack.dumps({"n": i}))

    # >>> # manually assign the partition list for the consumer
    # >>> consumer = KafkaConsumer(bootstrap_servers='localhost:1234')
    # >>> consumer.assign([TopicPartition('foobar', 2)])
    # >>> msg = next(consumer)
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, 2)])
    msg = next(consumer)
    assert (msg.partition, msg.offset, msgpack.loads(msg.value)) == (2, 0, {"n": 2})
    consumer.close()

    # >>> # Deserialize msgpack-encoded values
    # >>> consumer = KafkaConsumer(value_deserializer=msgpack.loads)
    # >>> consumer.subscribe(['msgpackfoo'])
    # >>> for msg in consumer:
    # ...     assert isinstance(msg.value, dict)
    consumer = logbus.Consumer(bus, value_deserializer=msgpack.loads)
    consumer.subscribe([topic_name])
    values = []
    for msg in consumer:
        assert isinstance(msg.value, dict)
        values.append(msg.value["n"])
        if len(values) == 9:
            break
    assert sorted(values) == list(range(9))
    consumer.close()

    # The group form of the same quickstart: KafkaConsumer('my_favorite_topic', group_id='my_favorite_group').
    consumer = logbus.Consumer(bus, topic_name, group_id="favorites", session_timeout_ms=3000, heartbeat_interval_ms=300)
    values = []
    for msg in consumer:
        values.append(msg.value)
        if len(values) == 9:
            break
    consumer.commit()
    assert consumer.committed(TopicPartition(topic_name, 0)) == 3
    consumer.close()


@pytest.mark.timeout(180)
def test_kafka_python_readme_producer(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)

    # >>> producer = KafkaProducer(bootstrap_servers='localhost:1234')
    # >>> for _ in range(100):
    # ...     producer.send('foobar', b'some_message_bytes')
    producer = logbus.Producer(bus)
    for _ in range(100):
        producer.send(topic_name, b"some_message_bytes")
    # >>> # Block until all pending messages are sent
    # >>> producer.flush()
    producer.flush()
    # >>> # Block until a single message is sent (or timeout)
    # >>> producer.send('foobar', b'another_message').get(timeout=60)
    metadata = producer.send(topic_name, b"another_message").get(timeout=60)
    assert metadata.topic == topic_name and metadata.offset >= 0
    # >>> # Use a key for hashed-partitioning
    # >>> producer.send('foobar', key=b'foo', value=b'bar')
    keyed = [producer.send(topic_name, key=b"foo", value=b"bar") for _ in range(3)]
    assert len({future.get(timeout=60).partition for future in keyed}) == 1
    producer.close()
    # >>> producer = KafkaProducer(value_serializer=lambda v: json.dumps(v).encode('utf-8'))
    # >>> producer.send('fizzbuzz', {'foo': 'bar'})
    producer = logbus.Producer(bus, value_serializer=lambda v: json.dumps(v).encode("utf-8"))
    producer.send(topic_name, {"foo": "bar"}).get(timeout=60)
    producer.close()
    # >>> producer = KafkaProducer(key_serializer=str.encode)
    # >>> producer.send('flipflap', key='ping', value=b'1234')
    producer = logbus.Producer(bus, key_serializer=str.encode)
    producer.send(topic_name, key="ping", value=b"1234").get(timeout=60)
    producer.close()

    consumer = logbus.Consumer(bus, topic_name, consumer_timeout_ms=1000)
    records = drain(consumer, 106)
    assert len(records) == 106
    assert sum(r.value == b"some_message_bytes" for r in records) == 100
    assert {(r.key, r.value) for r in records if r.key is not None} == {(b"foo", b"bar"), (b"ping", b"1234")}
    assert any(r.value == b'{"foo": "bar"}' for r in records)
    consumer.close()


# --- aiokafka -----------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_aiokafka_readme_producer_and_consumer(bus, topic_name):
    my_topic, my_other_topic = topic_name, topic_name + "-other"
    bus.admin.create_topic(my_topic, partitions=2)
    bus.admin.create_topic(my_other_topic)
    consumed = []

    async def send_one():
        producer = logbus.aio.Producer(bus)
        # Get cluster layout and initial topic/partition leadership information
        await producer.start()
        try:
            # Produce message
            await producer.send_and_wait(my_topic, b"Super message")
            await producer.send_and_wait(my_other_topic, b"Other message")
        finally:
            # Wait for all pending messages to be delivered or expire.
            await producer.stop()

    async def consume(**group):
        consumer = logbus.aio.Consumer(bus, my_topic, my_other_topic, **group)
        # Get cluster layout and join group `my-group`
        await consumer.start()
        try:
            # Consume messages
            async for msg in consumer:
                consumed.append((msg.topic, msg.partition, msg.offset, msg.key, msg.value, msg.timestamp))
                if len(consumed) % 2 == 0:
                    break
        finally:
            # Will leave consumer group; perform autocommit if enabled.
            await consumer.stop()

    asyncio.run(send_one())
    asyncio.run(consume(group_id="my-group"))
    asyncio.run(consume())  # aiokafka's consumer without a group_id: every partition, no commits
    assert sorted(value for *_, value, _ in consumed) == [b"Other message", b"Other message", b"Super message", b"Super message"]
    checker = logbus.Consumer(bus, group_id="my-group")
    assert checker.committed(TopicPartition(my_other_topic, 0)) == 1  # autocommit on stop
    checker.close()


@pytest.mark.timeout(180)
def test_aiokafka_plain_methods_take_effect_without_await(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    fill(bus, topic_name, 2, 40)
    tp0, tp1 = TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)

    async def main():
        consumer = logbus.aio.Consumer(bus)
        consumer.assign([tp0])  # aiokafka allows it before start(); it runs when start() does
        await consumer.start()
        assert consumer.assignment() == {tp0}
        assert (await consumer.getone()).partition == 0

        consumer.assign([tp0, tp1])  # as aiokafka's: no await, and it has taken effect for what follows
        assert consumer.assignment() == {tp0, tp1}
        consumer.seek(tp1, 15)
        consumer.pause(tp0)
        assert consumer.paused() == {tp0}
        batch = await consumer.getmany(timeout_ms=2000)
        assert set(batch) == {tp1} and batch[tp1][0].offset == 15
        consumer.resume(tp0)
        assert consumer.paused() == set()
        seen = {tp0: [], tp1: [r.offset for r in batch[tp1]]}

        async def rest():
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                seen[tp].extend(r.offset for r in records)
            return len(seen[tp0]) >= 19 and len(seen[tp1]) >= 5

        await asyncio.wait_for(_until(rest), 60)
        assert seen == {tp0: list(range(1, 20)), tp1: list(range(15, 20))}

        # Code written when these were coroutines still works: awaiting waits for the call and raises its error.
        await consumer.seek(tp0, 3)
        assert await consumer.position(tp0) == 3
        with pytest.raises(IllegalStateError, match="not assigned"):
            await consumer.seek(TopicPartition(topic_name + "-other", 0), 0)
        # A call nobody awaited that failed on the worker: the next fetch raises its error, never a silent no-op,
        # and the records that fetch polled are handed out by the one after.
        consumer.seek(tp0, 7)
        consumer.seek(TopicPartition(topic_name + "-other", 0), 0)
        with pytest.raises(IllegalStateError, match="not assigned"):
            await consumer.getmany(timeout_ms=2000)
        again = []

        async def tp0_again():
            again.extend(r.offset for r in (await consumer.getmany(timeout_ms=500)).get(tp0, []))
            return again

        await asyncio.wait_for(_until(tp0_again), 60)
        assert again[0] == 7
        # Mistakes in the arguments are raised by the call itself.
        with pytest.raises(InvalidConfigError, match="list of TopicPartitions"):
            consumer.assign(topic_name)
        with pytest.raises(InvalidConfigError, match="offset must be an int"):
            consumer.seek(tp0, "3")
        # Without a group_id, commit() raises as kafka-python's (aiokafka's raises IllegalOperation).
        with pytest.raises(IllegalStateError, match="requires a group_id"):
            await consumer.commit()
        await consumer.stop()

    asyncio.run(main())


async def _until(condition, interval_s: float = 0.0):
    while not await condition():
        await asyncio.sleep(interval_s)
