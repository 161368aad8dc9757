"""Transactions through the Kafka gateway: the coordinator's APIs with raw requests, then Kafka's own
transactional clients (confluent-kafka and kafka-python) against logbus's coordinator, markers and read_committed."""

from __future__ import annotations

import time

import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.protocol import kafka_gateway as kg
from tests.actors.test_gateway import Raw
from tests.conftest import kafka_python_consumer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def gateway(bus):
    gw = bus.start_gateway(port=0)
    yield gw
    gw.stop()


def transactions(bus) -> dict:
    return {t["transactional_id"]: t for t in ray.get(bus.controller.describe_transactions.remote(), timeout=60)}


def init_producer_id(raw: Raw, transactional_id: str, producer_id: int = -1, epoch: int = -1):
    return raw.call(kg.INIT_PRODUCER_ID, 4, {"transactional_id": transactional_id, "transaction_timeout": 60_000,
                                             "producer_id": producer_id, "producer_epoch": epoch})


def add_partitions(raw: Raw, version: int, transactional_id: str, producer_id: int, epoch: int, topic: str, partitions) -> list:
    response = raw.call(kg.ADD_PARTITIONS_TO_TXN, version, {
        "v3_and_below_transactional_id": transactional_id, "v3_and_below_producer_id": producer_id,
        "v3_and_below_producer_epoch": epoch,
        "v3_and_below_topics": [{"name": topic, "partitions": list(partitions)}]})
    return [p.partition_error_code for t in response.results_by_topic_v3_and_below for p in t.results_by_partition]


def end_txn(raw: Raw, version: int, transactional_id: str, producer_id: int, epoch: int, commit: bool):
    return raw.call(kg.END_TXN, version, {"transactional_id": transactional_id, "producer_id": producer_id,
                                          "producer_epoch": epoch, "committed": commit}).error_code


def test_the_coordinators_apis_fence_older_epochs_with_the_code_each_version_knows(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    raw = Raw(gateway)
    tid = f"{topic_name}-txn"
    found = raw.call(kg.FIND_COORDINATOR, 4, {"key_type": 1, "coordinator_keys": [tid]})
    assert [(c.key, c.error_code) for c in found.coordinators] == [(tid, kg.ErrorCode.none)]

    first = init_producer_id(raw, tid)
    assert first.error_code == kg.ErrorCode.none and first.producer_id >= 0
    second = init_producer_id(raw, tid)  # a new instance with the same transactional id
    assert second.error_code == kg.ErrorCode.none
    assert (second.producer_id, second.producer_epoch) == (first.producer_id, first.producer_epoch + 1)
    # KIP-360: the first instance's re-init names the epoch it holds, which is no longer current.
    assert init_producer_id(raw, tid, first.producer_id, first.producer_epoch).error_code == kg.ErrorCode.producer_fenced

    pid, old, new = first.producer_id, first.producer_epoch, second.producer_epoch
    assert add_partitions(raw, 3, tid, pid, old, topic_name, [0, 1]) == [kg.ErrorCode.producer_fenced] * 2
    assert add_partitions(raw, 1, tid, pid, old, topic_name, [0]) == [kg.ErrorCode.invalid_producer_epoch]
    assert end_txn(raw, 3, tid, pid, old, True) == kg.ErrorCode.producer_fenced
    # The current instance: nothing open yet, so there is nothing to commit.
    assert end_txn(raw, 3, tid, pid, new, True) == kg.ErrorCode.invalid_txn_state
    assert add_partitions(raw, 3, tid, pid, new, "no-such-topic", [0]) == [kg.ErrorCode.unknown_topic_or_partition]
    assert add_partitions(raw, 3, tid, pid, new, topic_name, [0, 1]) == [kg.ErrorCode.none] * 2
    state = transactions(bus)[tid]
    assert (state["producer_id"], state["producer_epoch"], state["state"]) == (pid, new, "ONGOING")
    assert state["partitions"] == [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    assert add_partitions(raw, 3, f"{tid}-unknown", pid, new, topic_name, [0]) == [kg.ErrorCode.invalid_producer_id_mapping]
    raw.close()


# --- Kafka's own transactional client ---------------------------------------------------------------

INPUTS = 600
BATCH = 100  # input records per transaction


def read_committed(gateway, topic: str, partitions: int, expected: int) -> list[tuple[int, int, bytes]]:
    """(partition, offset, value) of every record a read_committed confluent-kafka consumer reads,
    once it has read ``expected`` of them and reached the topic's end; control batches are never among them."""
    import confluent_kafka as ck

    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": f"check-{time.monotonic_ns()}",
                            "auto.offset.reset": "earliest", "enable.auto.commit": False, "isolation.level": "read_committed",
                            "enable.partition.eof": True})
    consumer.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(partitions)])
    seen, at_end = [], set()
    deadline = time.monotonic() + 120
    try:
        while (len(seen) < expected or len(at_end) < partitions) and time.monotonic() < deadline:
            for message in consumer.consume(1000, 1.0):
                if message.error() is not None:
                    assert message.error().code() == ck.KafkaError._PARTITION_EOF, message.error()
                    at_end.add(message.partition())
                    continue
                at_end.discard(message.partition())
                seen.append((message.partition(), message.offset(), message.value()))
    finally:
        consumer.close()
    return seen


def test_confluent_kafkas_consume_transform_produce_loop_commits_each_input_once(bus, gateway, topic_name):
    import confluent_kafka as ck

    source, sink, group = f"{topic_name}-in", f"{topic_name}-out", f"{topic_name}-group"
    bus.admin.create_topic(source, partitions=2)
    bus.admin.create_topic(sink, partitions=3)
    with logbus.Producer(bus, acks="all") as producer:
        for i in range(INPUTS):
            producer.send(source, b"%d" % i, partition=i % 2)
        producer.flush()

    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": group, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.subscribe([source])
    producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers, "transactional.id": f"{topic_name}-txn", "linger.ms": 5})
    producer.init_transactions(60)
    done, aborted_once = 0, False
    deadline = time.monotonic() + 240
    while done < INPUTS and time.monotonic() < deadline:
        messages = [m for m in consumer.consume(BATCH, 1.0) if m.error() is None]
        if not messages:
            continue
        producer.begin_transaction()
        for m in messages:
            producer.produce(sink, b"out-" + m.value(), partition=int(m.value()) % 3)
        if not aborted_once:
            # The first transaction is aborted: its output is never read, and its input is read again.
            aborted_once = True
            producer.abort_transaction(60)
            positions = consumer.committed(consumer.assignment(), 30)
            for tp in positions:
                consumer.seek(ck.TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else ck.OFFSET_BEGINNING))
            continue
        producer.send_offsets_to_transaction(consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 60)
        producer.commit_transaction(60)
        done += len(messages)
    consumer.close()

    seen = read_committed(gateway, sink, 3, INPUTS)
    assert sorted(v for _, _, v in seen) == sorted(b"out-%d" % i for i in range(INPUTS))  # each input's output once
    for p in range(3):
        offsets = [o for q, o, _ in seen if q == p]
        assert offsets == sorted(offsets)
    # The aborted transaction's records and every marker hold offsets too, which no reader is given.
    assert sum(p.high_watermark for p in bus.admin.describe_topic(sink).partitions) > INPUTS
    ends = {TopicPartition(source, p.partition): p.high_watermark for p in bus.admin.describe_topic(source).partitions}
    committed = ray.get(bus.controller.fetch_committed.remote(group, list(ends)), timeout=60)
    assert {tp: om.offset for tp, om in committed.items()} == ends
    assert transactions(bus)[f"{topic_name}-txn"]["state"] == "COMPLETE_COMMIT"


def test_kafka_pythons_consume_transform_produce_loop_commits_each_input_once(bus, gateway, topic_name):
    # The same loop with kafka-python's own transaction manager (3.0: KIP-98 and KIP-447), and its
    # read_committed consumer reading the result: another client's view of markers and aborts.
    import kafka
    from kafka.structs import OffsetAndMetadata as KafkaOffset

    source, sink, group = f"{topic_name}-in", f"{topic_name}-out", f"{topic_name}-group"
    bus.admin.create_topic(source, partitions=2)
    bus.admin.create_topic(sink, partitions=3)
    with logbus.Producer(bus, acks="all") as producer:
        for i in range(INPUTS):
            producer.send(source, b"%d" % i, partition=i % 2)
    servers = gateway.bootstrap_servers
    consumer = kafka_python_consumer([source], bootstrap_servers=servers, group_id=group, auto_offset_reset="earliest",
                                     enable_auto_commit=False, isolation_level="read_committed")
    producer = kafka.KafkaProducer(bootstrap_servers=servers, transactional_id=f"{topic_name}-txn", linger_ms=5)
    try:
        producer.init_transactions()
        done, aborted_once = 0, False
        deadline = time.monotonic() + 240
        while done < INPUTS and time.monotonic() < deadline:
            polled = consumer.poll(timeout_ms=1000, max_records=BATCH)
            messages = [m for records in polled.values() for m in records]
            if not messages:
                continue
            producer.begin_transaction()
            for m in messages:
                producer.send(sink, b"out-" + m.value, partition=int(m.value) % 3)
            if not aborted_once:
                # The first transaction is aborted: its output is never read, and its input is read again.
                aborted_once = True
                producer.abort_transaction()
                for tp in consumer.assignment():
                    committed = consumer.committed(tp)
                    consumer.seek(tp, committed if committed is not None else 0)
                continue
            offsets = {tp: KafkaOffset(consumer.position(tp), "", -1) for tp in consumer.assignment()}
            producer.send_offsets_to_transaction(offsets, consumer.group_metadata())
            producer.commit_transaction()
            done += len(messages)
    finally:
        producer.close(timeout=30)
        consumer.close()

    reader = kafka.KafkaConsumer(bootstrap_servers=servers, auto_offset_reset="earliest", enable_auto_commit=False,
                                 isolation_level="read_committed", consumer_timeout_ms=5_000)
    try:
        reader.assign([kafka.TopicPartition(sink, p) for p in range(3)])
        seen = []
        deadline = time.monotonic() + 120
        while len(seen) < INPUTS and time.monotonic() < deadline:
            for records in reader.poll(timeout_ms=1000).values():
                seen.extend((r.partition, r.offset, r.value) for r in records)
    finally:
        reader.close()
    assert sorted(v for _, _, v in seen) == sorted(b"out-%d" % i for i in range(INPUTS))  # each input's output once
    assert sorted(v for _, _, v in read_committed(gateway, sink, 3, INPUTS)) == sorted(v for _, _, v in seen)  # confluent's view agrees
    ends = {TopicPartition(source, p.partition): p.high_watermark for p in bus.admin.describe_topic(source).partitions}
    committed = ray.get(bus.controller.fetch_committed.remote(group, list(ends)), timeout=60)
    assert {tp: om.offset for tp, om in committed.items()} == ends
    assert transactions(bus)[f"{topic_name}-txn"]["state"] == "COMPLETE_COMMIT"


def test_a_fenced_confluent_kafka_producer_fails_fatally_and_nothing_it_wrote_is_read_committed(bus, gateway, topic_name):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=2)
    config = {"bootstrap.servers": gateway.bootstrap_servers, "transactional.id": f"{topic_name}-txn", "linger.ms": 0}
    zombie = ck.Producer(config)
    zombie.init_transactions(60)
    zombie.begin_transaction()
    for i in range(20):
        zombie.produce(topic_name, b"zombie-%d" % i, partition=i % 2)
    assert zombie.flush(60) == 0
    successor = ck.Producer(config)
    successor.init_transactions(60)  # bumps the epoch and aborts the zombie's open transaction
    with pytest.raises(ck.KafkaException) as raised:
        zombie.commit_transaction(60)
    assert raised.value.args[0].fatal() or raised.value.args[0].code() in (ck.KafkaError._FENCED, ck.KafkaError.PRODUCER_FENCED,
                                                                          ck.KafkaError.INVALID_PRODUCER_EPOCH)
    successor.begin_transaction()
    for i in range(10):
        successor.produce(topic_name, b"successor-%d" % i, partition=i % 2)
    successor.commit_transaction(60)
    seen = read_committed(gateway, topic_name, 2, 10)
    assert sorted(v for _, _, v in seen) == sorted(b"successor-%d" % i for i in range(10))
