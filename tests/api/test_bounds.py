"""Every cache and table of the clients has a bound: each test here fills one past it, through the real path.

The bounds are in the thousands; the tests lower them on the object under test
(each is an attribute of its owner, or of the BoundedDict it uses) so that a
handful of topics or partitions fills them. What must hold: the table never
grows past its bound, and everything still works (records delivered once,
metadata asked for again when it is needed again).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import logbus
from logbus import TopicPartition
from logbus.actors.channel_client import Channels
from logbus.bounded_dict import BoundedDict
from tests.conftest import wait_for


@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 20), st.integers()), max_size=200))
def test_a_bounded_dict_keeps_the_keys_stored_last(bound, writes):
    table = BoundedDict(bound)
    for key, value in writes:
        table[key] = value
        assert len(table) <= bound
        assert table[key] == value
    newest_first = list(dict.fromkeys(key for key, _ in reversed(writes)))
    assert list(table) == list(reversed(newest_first[:bound]))
    with pytest.raises(TypeError):
        table.update({1: 2})


def read_values(bus, topics: list[str], partitions: int, expected: int) -> list[bytes]:
    """Every record's value, read until ``expected`` came and then half a second more (to see duplicates)."""
    consumer = logbus.Consumer(bus, consumer_timeout_ms=500)
    consumer.assign([TopicPartition(t, p) for t in topics for p in range(partitions)])
    values = []
    wait_for(lambda: values.extend(r.value for r in consumer) or len(values) >= expected, timeout_s=60, message="records")
    values.extend(r.value for r in consumer)
    consumer.close()
    return values


@pytest.mark.timeout(240)
def test_the_bus_metadata_cache_keeps_its_bound(bus, topic_name):
    topics = [f"{topic_name}-{i}" for i in range(5)]
    for topic in topics:
        bus.admin.create_topic(topic)
    bus._metadata.max_entries = 3
    for topic in topics * 2:
        assert bus.topic_metadata(topic).partition_count == 1
        assert len(bus._metadata) <= 3
    assert set(bus._metadata) == set(topics[2:])
    assert bus.cached_metadata(topics[0]) is None  # dropped: asked for again when used
    assert bus.topic_metadata(topics[0]).name == topics[0]


@pytest.mark.timeout(240)
def test_the_producer_keeps_bounded_tables_of_topics_and_partitions(bus, topic_name):
    topics = [f"{topic_name}-{i}" for i in range(4)]
    for topic in topics:
        bus.admin.create_topic(topic, partitions=3)
    producer = logbus.Producer(bus, linger_ms=0)
    for table in (producer._topics, producer._limits, producer._sticky):
        table.max_entries = 2
    producer.sequence_partitions_max = 4
    for round_ in range(3):
        # One record at a time: the other partitions are idle whenever a new one needs sequence numbers.
        for topic in topics:
            for p in range(3):
                producer.send(topic, b"%d" % round_, partition=p).get(timeout=60)
                assert len(producer._sequences) <= 4
            producer.send(topic, b"keyless").get(timeout=60)
        assert max(len(producer._topics), len(producer._limits), len(producer._sticky)) <= 2
        assert producer._in_flight == {}  # only partitions with requests in flight have an entry
    # Partitions that forgot theirs started again in newer epochs.
    assert producer._producer_epoch > 0
    # Partitions busy at once keep theirs: past the bound, the table holds what is on its way.
    futures = [producer.send(topic, b"burst", partition=p) for topic in topics for p in range(3)]
    for future in futures:
        future.get(timeout=60)
    producer.send(topics[0], b"after", partition=0).get(timeout=60)
    producer.close()
    # Every record once: forgetting sequence numbers restarts them in a newer epoch, which the leaders take.
    values = read_values(bus, topics, 3, 49)
    assert sorted(values) == sorted([b"0", b"1", b"2"] * 12 + [b"keyless"] * 12 + [b"burst"] * 12 + [b"after"])


@pytest.mark.timeout(240)
def test_the_consumer_forgets_the_topics_it_no_longer_reads(bus, topic_name):
    topics = [f"{topic_name}-{i}" for i in range(4)]
    for topic in topics:
        bus.admin.create_topic(topic)
    consumer = logbus.Consumer(bus)
    for topic in topics:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.poll(timeout_ms=200)
        for table in (consumer._metadata_calls, consumer._metadata_fresh_s, consumer._metadata_retry_at_s):
            assert set(table) <= {topic}
    consumer.close()


@pytest.mark.timeout(240)
def test_the_local_channel_registry_keeps_its_bound(bus, topic_name):
    topics = [f"{topic_name}-{i}" for i in range(6)]
    for topic in topics:
        bus.admin.create_topic(topic)
    registry = Channels(entries_max=3)
    leaders = [bus.topic_metadata(topic).leaders[0] for topic in topics]
    for leader in leaders:
        registry.connection(leader)  # a lookup starts; the first requests go as actor calls meanwhile
        assert registry.entry_count() <= 3
    # A replica on this node answers its lookup, and its connection is kept while the registry is full.
    connected = wait_for(lambda: registry.connection(leaders[-1]), timeout_s=60, message="a local connection")
    for leader in leaders[:-1]:
        registry.connection(leader)
        assert registry.entry_count() <= 3
    assert registry.connection(leaders[-1]) is connected
    connected.close()
