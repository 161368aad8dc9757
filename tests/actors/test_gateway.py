"""The Kafka gateway with real Kafka clients: kafka-python, aiokafka, confluent-kafka and kcat.

Each client produces and consumes through ``bus.start_gateway``; a logbus
Consumer then reads the same topic, and both must see the same records at the
same offsets. Raw requests (built with kio, the gateway's own message types,
sent over a plain socket) check error codes and de-duplication; a bounded
fuzz run checks that bad frames cost a connection and nothing else.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest
import ray
from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer

import logbus
from logbus import TopicPartition
from logbus import cli
from logbus.errors import IllegalStateError, InvalidConfigError
from logbus.protocol import kafka_gateway as kg
from logbus.storage import record_batch as rb
from tests.api.test_compaction import consume
from tests.conftest import kafka_python_consumer, leave_group, wait_for
from tests.protocol.test_kafka_records import kafka_batch

pytestmark = pytest.mark.timeout(600)

N = 40_000  # records per client run: over 1 MiB a partition, so a consumer fetches each more than once
PARTITIONS = 3
KCAT = shutil.which("kcat")


@pytest.fixture
def gateway(bus, module_bus_state):
    """The module's gateway, on the module's shared cluster: started by the first test that asks for it,
    stopped when the module ends. Tests that start gateways of their own (with settings of their own,
    which one gateway per node and cluster allows) are marked ``own_bus``."""
    assert bus is module_bus_state.bus, "the module's gateway serves the module's shared cluster, not a test's own"
    return module_bus_state.kept("gateway", lambda shared: shared.start_gateway(port=0), stop=lambda started: started.stop())


def value_of(i: int) -> bytes:
    return (b"value-%08d-" % i).ljust(100, b"x")


def key_of(i: int) -> bytes:
    return b"key-%d" % i


# Record timestamps the producers set: distinct, and recent (older ones would fall to the topics'
# time retention at once).
TIMESTAMP_BASE_MS = int(time.time() * 1000) - N


def timestamp_of(i: int) -> int:
    return TIMESTAMP_BASE_MS + i


def logbus_view(bus, topic: str, expected: int) -> dict:
    """{(partition, offset): (key, value, timestamp, headers)} as a logbus Consumer reads the topic."""
    consumer = logbus.Consumer(bus, topic, group_id=f"check-{time.monotonic_ns()}", enable_auto_commit=False)
    seen: dict = {}
    deadline = time.monotonic() + 120
    try:
        while len(seen) < expected and time.monotonic() < deadline:
            for r in _records(consumer):
                seen[(r.partition, r.offset)] = (r.key, r.value, r.timestamp, list(r.headers or []))
    finally:
        consumer.close()
    return seen


def _records(consumer):
    batch = consumer.poll(timeout_ms=500, max_records=50_000)
    return [r for records in batch.values() for r in records]


def committed_offsets(bus, group: str) -> dict:
    description = bus.admin.describe_group(group)
    return {(row["topic"], row["partition"]): row["current_offset"] for row in description["offsets"]}


def end_offsets(bus, topic: str) -> dict:
    return {(topic, p.partition): p.high_watermark for p in bus.admin.describe_topic(topic).partitions}


def check_same_records(bus, topic: str, kafka_seen: dict) -> None:
    """The Kafka client's records are logbus's: same offsets, keys, values, timestamps, headers; all N, once."""
    native = logbus_view(bus, topic, N)
    assert len(native) == N
    assert kafka_seen == native
    assert sorted(v[0] for v in native.values()) == sorted(key_of(i) for i in range(N))


# --- each client: produce N keyed records (acks=all, idempotent), consume them in a group with commits ---


def test_confluent_kafka_produces_and_consumes_in_a_group(bus, gateway, topic_name):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    failures = []
    for i in range(N):
        headers = [("i", b"%d" % i)] if i % 1000 == 0 else None
        while True:
            try:
                producer.produce(topic_name, key=key_of(i), value=value_of(i), timestamp=timestamp_of(i), headers=headers,
                                 on_delivery=lambda err, msg: err and failures.append(err))
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0 and not failures

    group = "confluent-group"
    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": group, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False})
    consumer.subscribe([topic_name])
    seen: dict = {}
    deadline = time.monotonic() + 120
    while len(seen) < N and time.monotonic() < deadline:
        for message in consumer.consume(10_000, 1.0):
            assert message.error() is None, message.error()
            timestamp_type, timestamp = message.timestamp()
            assert timestamp_type == ck.TIMESTAMP_CREATE_TIME
            seen[(message.partition(), message.offset())] = (message.key(), message.value(), timestamp, list(message.headers() or []))
    consumer.commit(asynchronous=False)
    committed = {(tp.topic, tp.partition): tp.offset for tp in consumer.committed([ck.TopicPartition(topic_name, p) for p in range(PARTITIONS)])}
    consumer.close()
    assert seen[next(k for k, v in seen.items() if v[0] == key_of(0))][3] == [("i", b"0")]
    check_same_records(bus, topic_name, seen)
    assert committed == end_offsets(bus, topic_name) == committed_offsets(bus, group)


def test_kafka_python_produces_and_consumes_in_a_group(bus, gateway, topic_name):
    from kafka import KafkaProducer

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    producer = KafkaProducer(bootstrap_servers=gateway.bootstrap_servers, acks="all", enable_idempotence=True, linger_ms=5,
                             batch_size=64 << 10)
    futures = [producer.send(topic_name, key=key_of(i), value=value_of(i), timestamp_ms=timestamp_of(i),
                             headers=[("i", b"%d" % i)] if i % 1000 == 0 else None) for i in range(N)]
    producer.flush(120)
    assert all(f.succeeded() for f in futures)
    producer.close()

    group = "kafka-python-group"
    consumer = kafka_python_consumer([topic_name], bootstrap_servers=gateway.bootstrap_servers, group_id=group, auto_offset_reset="earliest",
                                     enable_auto_commit=False)
    seen: dict = {}
    deadline = time.monotonic() + 180
    while len(seen) < N and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=1000, max_records=10_000).values():
            for r in records:
                seen[(r.partition, r.offset)] = (r.key, r.value, r.timestamp, [tuple(h) for h in r.headers])
    consumer.commit()
    consumer.close()
    check_same_records(bus, topic_name, seen)
    assert committed_offsets(bus, group) == end_offsets(bus, topic_name)


def test_aiokafka_produces_and_consumes_in_a_group(bus, gateway, topic_name):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    group = "aiokafka-group"

    async def run() -> dict:
        producer = AIOKafkaProducer(bootstrap_servers=gateway.bootstrap_servers, acks="all", enable_idempotence=True, linger_ms=5)
        await producer.start()
        try:
            pending = [await producer.send(topic_name, key=key_of(i), value=value_of(i), timestamp_ms=timestamp_of(i),
                                           headers=[("i", b"%d" % i)] if i % 1000 == 0 else None) for i in range(N)]
            await asyncio.gather(*pending)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=gateway.bootstrap_servers, group_id=group,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        seen: dict = {}
        try:
            deadline = time.monotonic() + 180
            while len(seen) < N and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=1000, max_records=10_000)).values():
                    for r in records:
                        seen[(r.partition, r.offset)] = (r.key, r.value, r.timestamp, [tuple(h) for h in r.headers])
            await consumer.commit()
        finally:
            await consumer.stop()
        return seen

    seen = asyncio.run(run())
    check_same_records(bus, topic_name, seen)
    assert committed_offsets(bus, group) == end_offsets(bus, topic_name)


@pytest.mark.skipif(KCAT is None, reason="kcat is not installed (./dev installs Debian's kcat)")
def test_kcat_produces_from_a_file_consumes_to_the_end_and_lists_metadata(bus, gateway, topic_name, tmp_path):
    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    source = tmp_path / "records.txt"
    source.write_bytes(b"".join(key_of(i) + b":" + value_of(i) + b"\n" for i in range(N)))
    kcat = [KCAT, "-b", gateway.bootstrap_servers]
    produced = subprocess.run([*kcat, "-P", "-t", topic_name, "-K", ":", "-X", "acks=all", "-X", "enable.idempotence=true",
                               "-l", str(source)], capture_output=True, timeout=300)
    assert produced.returncode == 0, produced.stderr.decode()

    listed = subprocess.run([*kcat, "-L", "-t", topic_name], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    broker_id = gateway.brokers[0][2]
    assert f'topic "{topic_name}" with {PARTITIONS} partitions' in listed.stdout
    for p in range(PARTITIONS):
        assert f"partition {p}, leader {broker_id}, replicas: {broker_id}, isrs: {broker_id}" in listed.stdout

    consumed = subprocess.run([*kcat, "-C", "-t", topic_name, "-o", "beginning", "-e", "-f", "%p %o %T %k %s\\n"],
                              capture_output=True, timeout=300)
    assert consumed.returncode == 0, consumed.stderr.decode()
    seen = {}
    for line in consumed.stdout.splitlines():
        partition, offset, timestamp, key, value = line.split(b" ")
        seen[(int(partition), int(offset))] = (key, value, int(timestamp), [])
    check_same_records(bus, topic_name, seen)

    # And in a consumer group (kcat's balanced consumer), which commits what it read when it exits.
    grouped = subprocess.run([*kcat, "-G", "kcat-group", topic_name, "-e", "-X", "auto.offset.reset=earliest", "-f", "%o\\n"],
                             capture_output=True, timeout=300)
    assert grouped.returncode == 0, grouped.stderr.decode()
    assert len(grouped.stdout.splitlines()) == N
    assert committed_offsets(bus, "kcat-group") == end_offsets(bus, topic_name)


# --- groups shared with logbus consumers; codecs; timestamps; admin ------------------------------------


def test_a_kafka_consumer_and_a_logbus_consumer_share_a_group(bus, gateway, topic_name):
    import confluent_kafka as ck
    from confluent_kafka.admin import AdminClient

    partitions = 4
    bus.admin.create_topic(topic_name, partitions=partitions)
    with logbus.Producer(bus) as producer:
        for i in range(2000):
            producer.send(topic_name, value_of(i), key=key_of(i))
    group = "mixed-group"
    kafka = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": group, "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, "partition.assignment.strategy": "range", "session.timeout.ms": 10_000,
                         "heartbeat.interval.ms": 500})
    kafka.subscribe([topic_name])
    native = logbus.Consumer(bus, topic_name, group_id=group, enable_auto_commit=False)
    kafka_seen, native_seen = {}, {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for message in kafka.consume(1000, 0.2):
                assert message.error() is None, message.error()
                kafka_seen[(message.partition(), message.offset())] = message.key()
            for r in _records_quick(native):
                native_seen[(r.partition, r.offset)] = r.key
            kafka_parts = {tp.partition for tp in kafka.assignment()}
            native_parts = {tp.partition for tp in native.assignment()}
            # Before the rebalance one member may read a partition the other then reads again, so what
            # counts is the union of what both saw, not the sum.
            if len(kafka_parts) == len(native_parts) == 2 and len(kafka_seen.keys() | native_seen.keys()) >= 2000:
                break
        assert kafka_parts.isdisjoint(native_parts) and kafka_parts | native_parts == set(range(partitions))
        assert len(kafka_seen.keys() | native_seen.keys()) == 2000
        # One key per offset, whichever member read it.
        assert all(native_seen[at] == key for at, key in kafka_seen.items() if at in native_seen)
        members = bus.admin.describe_group(group)["members"]
        assert len(members) == 2
        # Kafka's admin tools see the one group, both members and their partitions (ListGroups, DescribeGroups).
        admin = AdminClient({"bootstrap.servers": gateway.bootstrap_servers})
        assert group in {g.group_id for g in admin.list_consumer_groups(request_timeout=30).result().valid}
        [described] = admin.describe_consumer_groups([group], request_timeout=30).values()
        description = described.result()
        assert description.state == ck.ConsumerGroupState.STABLE and len(description.members) == 2
        assigned = [tp.partition for m in description.members for tp in m.assignment.topic_partitions]
        assert sorted(assigned) == list(range(partitions))
    finally:
        kafka.close()
        native.close()


def _records_quick(consumer):
    return [r for records in consumer.poll(timeout_ms=100).values() for r in records]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_from_a_kafka_producer_are_stored_and_read_back(bus, gateway, topic_name, codec):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=1)
    producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers, "compression.type": codec, "linger.ms": 20})
    for i in range(5000):
        producer.produce(topic_name, key=key_of(i), value=value_of(i))
    assert producer.flush(60) == 0
    seen = logbus_view(bus, topic_name, 5000)
    assert [seen[(0, i)][:2] for i in range(5000)] == [(key_of(i), value_of(i)) for i in range(5000)]


def test_log_append_time_topics_report_the_append_time_to_both_kinds_of_client(bus, gateway, topic_name):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=1, config={"message.timestamp.type": "LogAppendTime"})
    before = int(time.time() * 1000)
    producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers})
    delivered = []
    producer.produce(topic_name, value=b"v", timestamp=1_000, on_delivery=lambda err, msg: delivered.append((err, msg.timestamp())))
    assert producer.flush(30) == 0
    [(error, (kind, stamped))] = delivered
    assert error is None and kind == ck.TIMESTAMP_LOG_APPEND_TIME and stamped >= before
    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": "lat", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic_name])
    message = wait_for(lambda: next(iter(consumer.consume(1, 1.0)), None), timeout_s=60, message="the record")
    consumer.close()
    assert message.timestamp() == (ck.TIMESTAMP_LOG_APPEND_TIME, stamped)
    [record] = logbus_view(bus, topic_name, 1).values()
    assert record[2] == stamped


def test_a_kafka_consumer_reads_a_compacted_topic_to_its_end(bus, gateway, topic_name):
    import confluent_kafka as ck

    # One batch per segment (segment.bytes=1024), cleaned as soon as a segment closes.
    bus.admin.create_topic(topic_name, config={"cleanup.policy": "compact", "segment.bytes": 1024, "min.cleanable.dirty.ratio": 0})
    written = {}
    with logbus.Producer(bus, linger_ms=0) as producer:
        for i in range(41):  # the last in the active segment, which is never cleaned: a key of its own
            key = b"key-%d" % (i % 7) if i < 40 else b"last"
            written[producer.send(topic_name, b"value-%d" % i, key=key).get(timeout=30).offset] = key
    latest = {key: offset for offset, key in sorted(written.items())}
    expected = sorted((offset, written[offset], b"value-%d" % offset) for offset in latest.values())
    wait_for(lambda: consume(bus, topic_name) == expected, timeout_s=60, message="the cleaner to compact the log")

    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": f"compacted-{topic_name}",
                            "enable.partition.eof": True, "enable.auto.commit": False})
    consumer.assign([ck.TopicPartition(topic_name, 0, ck.OFFSET_BEGINNING)])
    seen, at_end = [], False
    deadline = time.monotonic() + 60
    try:
        while not at_end:
            assert time.monotonic() < deadline, f"the consumer did not reach the end; it read {seen}"
            for message in consumer.consume(100, 1.0):
                if message.error() is not None and message.error().code() == ck.KafkaError._PARTITION_EOF:
                    at_end = True
                    continue
                assert message.error() is None, message.error()
                seen.append((message.offset(), message.key(), message.value()))
        [position] = consumer.position([ck.TopicPartition(topic_name, 0)])
    finally:
        consumer.close()
    assert seen == expected  # the latest value of each key, at its own offset, with the gaps between
    assert position.offset == max(written) + 1 == bus.admin.describe_topic(topic_name).partitions[0].high_watermark


def test_kafka_admin_creates_describes_lists_and_deletes(bus, gateway, topic_name):
    from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

    admin = AdminClient({"bootstrap.servers": gateway.bootstrap_servers})
    [future] = admin.create_topics([NewTopic(topic_name, num_partitions=2, replication_factor=1, config={"retention.ms": "60000"})]).values()
    future.result(60)
    assert bus.admin.describe_topic(topic_name).config == {"retention.ms": 60000}
    [future] = admin.create_topics([NewTopic(topic_name, num_partitions=2, replication_factor=1)]).values()
    with pytest.raises(Exception, match="TOPIC_ALREADY_EXISTS"):
        future.result(60)
    [described] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic_name)]).values()
    configs = described.result(60)
    assert configs["retention.ms"].value == "60000" and configs["segment.bytes"].is_default
    assert topic_name in admin.list_topics(timeout=30).topics
    [future] = admin.delete_topics([topic_name]).values()
    future.result(60)
    wait_for(lambda: topic_name not in bus.admin.list_topics(), timeout_s=30, message="the topic gone")


@pytest.mark.own_bus  # the command stops its cluster's gateway when it ends: the module's would go with it
def test_the_gateway_command_serves_until_stopped(bus, topic_name, capsys):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=1)
    codes = []
    command = threading.Thread(target=lambda: codes.append(cli.main(["--namespace", bus.namespace, "--data-dir", bus.data_dir,
                                                                     "gateway", "--port", "0"])))
    command.start()
    printed = []

    def bootstrap():
        printed.append(capsys.readouterr().out)
        line = next((l for l in "".join(printed).splitlines() if l.startswith("Kafka gateway serving: bootstrap.servers=")), None)
        return line and line.split("=", 1)[1]

    try:
        servers = wait_for(bootstrap, timeout_s=60, message="the gateway's address")
        assert servers.startswith("127.0.0.1:")  # loopback unless another address is asked for
        producer = ck.Producer({"bootstrap.servers": servers, "acks": "all"})
        producer.produce(topic_name, key=b"k", value=b"through the command")
        assert producer.flush(30) == 0
    finally:
        cli.gateway_stop.set()
        command.join(60)
    assert codes == [0] and "Kafka gateway stopped." in capsys.readouterr().out
    [(position, record)] = logbus_view(bus, topic_name, 1).items()
    assert position == (0, 0) and record[:2] == (b"k", b"through the command")
    with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens there any more
        socket.create_connection(("127.0.0.1", int(servers.rsplit(":", 1)[1])), timeout=5)


def test_starting_the_gateway_again_with_other_settings_is_refused_and_the_running_one_keeps_serving(bus, gateway):
    [before] = gateway.stats()
    assert bus.start_gateway(port=0).brokers == gateway.brokers  # asked the same: the gateway running
    for other in ({"port": gateway.brokers[0][1] + 1}, {"port": 0, "host": "0.0.0.0"}, {"port": 0, "advertised_host": "example.com"},
                  {"port": 0, "max_request_bytes": 1 << 20}, {"port": 0, "max_connections": 10}):
        with pytest.raises(IllegalStateError, match="already runs on node .* started with"):
            bus.start_gateway(**other)
    raw = Raw(gateway)
    assert raw.call(kg.API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"}).error_code == kg.ErrorCode.none
    raw.close()
    [after] = gateway.stats()
    assert after["pid"] == before["pid"]  # the same gateway, never restarted


# --- raw requests: error codes and de-duplication --------------------------------------------------------


class Raw:
    """One connection speaking Kafka's protocol with kio's message types (what a client library does)."""

    def __init__(self, gateway) -> None:
        host, port = gateway.brokers[0][0], gateway.brokers[0][1]
        self.sock = socket.create_connection((host, port), timeout=30)
        self.correlation = 0

    def send_frame(self, frame: bytes) -> None:
        self.sock.sendall(struct.pack(">i", len(frame)) + frame)

    def call(self, api_key: int, version: int, values: dict):
        self.send(api_key, version, values)
        return self.receive(api_key, version, self.correlation)

    def send(self, api_key: int, version: int, values: dict) -> int:
        """Send a request without waiting for its response; its correlation id."""
        request_cls = load_request_schema(api_key, version)
        self.correlation += 1
        out = io.BytesIO()
        entity_writer(request_cls.__header_schema__)(out, request_cls.__header_schema__(
            request_api_key=api_key, request_api_version=version, correlation_id=self.correlation, client_id="raw"))
        entity_writer(request_cls)(out, kg.build(request_cls, values))
        self.send_frame(out.getvalue())
        return self.correlation

    def receive(self, api_key: int, version: int, correlation: int):
        """The next response, which must be the one to request ``correlation``."""
        (size,) = struct.unpack(">i", self._read(4))
        frame = self._read(size)
        response_cls = load_response_schema(api_key, version)
        header, used = entity_reader(response_cls.__header_schema__)(frame, 0)
        assert header.correlation_id == correlation
        body, _ = entity_reader(response_cls)(frame, used)
        return body

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the gateway closed the connection")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def produce_request(topic: str, records: bytes, acks: int = -1, partition: int = 0) -> dict:
    return {"transactional_id": None, "acks": acks, "timeout": 30_000, "topic_data": [
        {"name": topic, "partition_data": [{"index": partition, "records": records}]}]}


def produce(raw: Raw, topic: str, records: bytes, acks: int = -1):
    response = raw.call(kg.PRODUCE, 9, produce_request(topic, records, acks))
    [partition] = response.responses[0].partition_responses
    return partition


def fetch_request(topic: str, offset: int, max_wait_ms: int = 0) -> dict:
    return {"replica_id": -1, "max_wait": max_wait_ms, "min_bytes": 1, "max_bytes": 1 << 20, "isolation_level": 0,
            "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "", "topics": [
        {"topic": topic, "partitions": [{"partition": 0, "current_leader_epoch": -1, "fetch_offset": offset, "last_fetched_epoch": -1,
                                         "log_start_offset": -1, "partition_max_bytes": 1 << 20}]}]}


def fetch(raw: Raw, topic: str, offset: int):
    response = raw.call(kg.FETCH, 12, fetch_request(topic, offset))
    return response.responses[0].partitions[0]


def test_a_long_poll_the_gateway_stops_waiting_for_ends_at_the_replica_too(bus, gateway, topic_name):
    """A fetch of two partitions answers when one gets data; the other partition's long poll is
    cancelled at its leader then, not left parked until the wait's end (30 s)."""
    bus.admin.create_topic(topic_name, partitions=2)
    leaders = bus.topic_metadata(topic_name).leaders

    def status(partition: int) -> dict:
        return ray.get(leaders[partition].status.remote(), timeout=60)

    def waiting(partition: int) -> int:
        return status(partition)["fetches_waiting"]

    request = fetch_request(topic_name, 0, max_wait_ms=30_000)
    request["topics"][0]["partitions"].append({**request["topics"][0]["partitions"][0], "partition": 1})
    raw = Raw(gateway)
    try:
        correlation = raw.send(kg.FETCH, 12, request)
        wait_for(lambda: waiting(0) == 1 and waiting(1) == 1, timeout_s=60, message="both long polls parked at their leaders")
        with logbus.Producer(bus) as producer:
            producer.send(topic_name, b"to partition 0", partition=0).result(timeout=60)
        answered = {p.partition_index: p for p in raw.receive(kg.FETCH, 12, correlation).responses[0].partitions}
        assert answered[0].records and not answered[1].records
        wait_for(lambda: waiting(1) == 0, timeout_s=60, message="partition 1's long poll ended at its leader")
        assert status(1)["fetch_waits_expired"] == 0  # cancelled, not left to run out
    finally:
        raw.close()


def api_versions_ok(raw: Raw) -> bool:
    return raw.call(kg.API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"}).error_code == kg.ErrorCode.none


@pytest.mark.own_bus  # a gateway with settings of its own
def test_connections_over_the_limit_are_closed_and_the_open_ones_keep_serving(bus):
    gw = bus.start_gateway(port=0, max_connections=2)
    opened = []
    try:
        opened += [Raw(gw), Raw(gw)]
        assert all(api_versions_ok(raw) for raw in opened)
        opened.append(Raw(gw))  # accepted by the kernel, then closed by the gateway unread
        with pytest.raises(ConnectionError):
            api_versions_ok(opened[-1])
        [stats] = gw.stats()
        assert (stats["connections"], stats["connections_limit"], stats["connections_refused"]) == (2, 2, 1)
        assert api_versions_ok(opened[1])
        opened[0].close()
        wait_for(lambda: gw.stats()[0]["connections"] == 1, timeout_s=30, message="the closed connection counted out")
        opened.append(Raw(gw))  # room again
        assert api_versions_ok(opened[-1])
    finally:
        for raw in opened:
            raw.close()
        gw.stop()
    with pytest.raises(InvalidConfigError, match="max_connections"):
        bus.start_gateway(port=0, max_connections=0)


@pytest.mark.parametrize("ending", ["the client closes it", "a frame over the size limit"])
def test_a_long_poll_whose_connection_ends_ends_at_the_replica(bus, gateway, topic_name, ending):
    """A connection that ends during a 30 s long poll, closed by its client or by the gateway over a
    bad frame: the fetch ends at the leader then (and the gateway goes on serving), not at the wait's end."""
    bus.admin.create_topic(topic_name, partitions=1)
    leader = bus.topic_metadata(topic_name).leaders[0]

    def status() -> dict:
        return ray.get(leader.status.remote(), timeout=60)

    def waiting() -> int:
        return status()["fetches_waiting"]

    raw = Raw(gateway)
    try:
        raw.send(kg.FETCH, 12, fetch_request(topic_name, 0, max_wait_ms=30_000))
        wait_for(lambda: waiting() == 1, timeout_s=60, message="the long poll parked at the leader")
        if ending != "the client closes it":
            raw.sock.sendall(struct.pack(">i", kg.MAX_REQUEST_BYTES_DEFAULT + 1))
            try:  # the gateway closes the connection, with no reply to the fetch
                assert raw.sock.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        raw.close()
    wait_for(lambda: waiting() == 0, timeout_s=60, message="the long poll ended at the leader")
    assert status()["fetch_waits_expired"] == 0  # cancelled, not left to run out
    again = Raw(gateway)
    try:
        now_ms = int(time.time() * 1000)  # (a record years old would be past the topic's retention)
        assert produce(again, topic_name, kafka_batch([(None, b"after", now_ms, [])])).error_code == kg.ErrorCode.none
        assert fetch(again, topic_name, 0).records
    finally:
        again.close()


def test_a_replica_that_stops_reading_does_not_hold_up_the_gateways_other_connections(bus, gateway, topic_name):
    """A batch larger than a socket holds, sent to a stopped (SIGSTOP) leader, must not stall the
    gateway's loop: a produce to another partition on another connection is answered meanwhile."""
    stuck, other = topic_name + "-stuck", topic_name + "-other"
    for name in (stuck, other):
        bus.admin.create_topic(name, partitions=1)
    to_stuck, to_other = Raw(gateway), Raw(gateway)
    small = kafka_batch([(None, b"warm", 1_700_000_000_000, [])])

    def backlogged() -> int:
        return gateway.stats()[0]["replica_channels_backlogged"]
    try:
        for raw, name in ((to_stuck, stuck), (to_other, other)):  # leaders looked up, channels open
            assert produce(raw, name, small).error_code == kg.ErrorCode.none
        pid = ray.get(bus.topic_metadata(stuck).leaders[0].status.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            big = kafka_batch([(None, b"x" * (600 << 10), 1_700_000_000_000, [])])  # about 3 times a socket's room
            correlation = to_stuck.send(kg.PRODUCE, 9, produce_request(stuck, big, acks=1))
            # What the stopped replica's socket cannot take goes to the channel's own sender thread.
            wait_for(lambda: backlogged() == 1, timeout_s=60, message="the batch handed to the channel's sender thread")
            assert produce(to_other, other, small).error_code == kg.ErrorCode.none
            # Answered while the batch still waits for the stopped replica: the gateway's loop never
            # waited for its socket (which would have held it for the channel's 5 s send timeout).
            assert backlogged() == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: backlogged() == 0, timeout_s=60, message="the batch sent once the replica reads again")
        response = to_stuck.receive(kg.PRODUCE, 9, correlation).responses[0].partition_responses[0]
        assert response.error_code in (kg.ErrorCode.none, kg.ErrorCode.not_leader_or_follower, kg.ErrorCode.request_timed_out,
                                       kg.ErrorCode.leader_not_available), response  # the stopped leader may have been deposed
    finally:
        to_stuck.close()
        to_other.close()


@pytest.mark.own_bus  # a gateway with settings of its own
def test_open_requests_of_all_connections_together_stay_within_the_gateways_byte_limit(bus, topic_name):
    """Long-polling fetches from three connections ask for more room than the gateway has: the later
    ones wait unread, and every one is answered once a record comes and the earlier ones finish."""
    bus.admin.create_topic(topic_name, partitions=1)
    gateway = bus.start_gateway(port=0, max_request_bytes=1024)  # its open requests: 4 KiB in all
    raws = []
    try:
        [stats] = gateway.stats()
        assert stats["open_request_bytes_limit"] == 4096
        raws = [Raw(gateway) for _ in range(3)]
        sent = [[raw.send(kg.FETCH, 12, fetch_request(topic_name, 0, max_wait_ms=60_000)) for _ in range(30)] for raw in raws]

        def parked():
            [now] = gateway.stats()
            return now["requests_waited_for_room"] > 0 and now["open_request_bytes"] > 4096 - 200 and now

        full = wait_for(parked, timeout_s=60, message="the gateway's room filled by parked fetches")
        assert full["open_request_bytes"] <= 4096
        with logbus.Producer(bus) as producer:
            producer.send(topic_name, b"wakes them all").result(timeout=60)
        for raw, correlations in zip(raws, sent):
            for correlation in correlations:
                partition = raw.receive(kg.FETCH, 12, correlation).responses[0].partitions[0]
                assert partition.error_code == kg.ErrorCode.none and partition.high_watermark == 1
                assert partition.records  # the record, to every fetch
        [after] = gateway.stats()
        assert after["open_request_bytes_peak"] <= 4096
        assert after["open_request_bytes"] == 0
    finally:
        for raw in raws:
            raw.close()
        gateway.stop()


@pytest.mark.own_bus  # a gateway with settings of its own
def test_one_connection_holds_at_most_half_the_gateways_room(bus, topic_name):
    """A connection whose long polls would fill the gateway's room holds half of it: its later requests
    wait unread, and another connection is served meanwhile."""
    bus.admin.create_topic(topic_name, partitions=1)
    gateway = bus.start_gateway(port=0, max_request_bytes=1024)  # 4 KiB for the gateway, 2 KiB a connection
    greedy = other = None
    try:
        greedy = Raw(gateway)
        # ~9 KiB of long polls (the replica holds each at most 30 s: the rest of the test fits in that).
        sent = [greedy.send(kg.FETCH, 12, fetch_request(topic_name, 0, max_wait_ms=30_000)) for _ in range(60)]

        def held():
            [now] = gateway.stats()
            return now["requests_waited_for_connection_room"] > 0 and now["open_request_bytes"] > 1024 and now

        full = wait_for(held, timeout_s=20, message="the connection's share filled by its parked fetches")
        assert full["open_request_bytes_connection_limit"] == 2048 and full["open_request_bytes"] <= 2048
        other = Raw(gateway)  # served at once, while the first connection's fetches still wait
        versions = other.call(kg.API_VERSIONS, 3, {"client_software_name": "raw", "client_software_version": "1"})
        assert versions.error_code == kg.ErrorCode.none
        assert fetch(other, topic_name, 0).error_code == kg.ErrorCode.none
        with logbus.Producer(bus) as producer:
            producer.send(topic_name, b"wakes them all").result(timeout=60)
        for correlation in sent:
            partition = greedy.receive(kg.FETCH, 12, correlation).responses[0].partitions[0]
            assert partition.error_code == kg.ErrorCode.none and partition.records
        [after] = gateway.stats()
        assert after["open_request_bytes_peak"] <= 4096 and after["open_request_bytes"] == 0
    finally:
        for raw in (greedy, other):
            if raw is not None:
                raw.close()
        gateway.stop()


def test_a_client_that_goes_away_frees_its_connection_slot_at_once(bus, gateway, topic_name):
    """A JoinGroup held by the coordinator (the group waits for its other member to rejoin) does not keep
    the connection of a client that closed it counted until the join is answered."""
    bus.admin.create_topic(topic_name, partitions=1)
    join = {"group_id": "held", "session_timeout": 60_000, "rebalance_timeout": 60_000, "member_id": "", "group_instance_id": None,
            "protocol_type": "consumer", "protocols": [{"name": "range", "metadata": kg.encode_subscription([topic_name])}]}
    first = Raw(gateway)
    second = None
    try:
        joined = first.call(kg.JOIN_GROUP, 7, join)
        assert joined.error_code == kg.ErrorCode.none
        synced = first.call(kg.SYNC_GROUP, 5, {"group_id": "held", "generation_id": joined.generation_id, "member_id": joined.member_id,
                                               "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range",
                                               "assignments": []})
        assert synced.error_code == kg.ErrorCode.none
        # The gateway is the module's: connections of earlier tests' clients must be counted out first.
        wait_for(lambda: gateway.stats()[0]["connections"] == 1, timeout_s=60, message="this test's connection alone")
        [before] = gateway.stats()
        second = Raw(gateway)
        second.send(kg.JOIN_GROUP, 7, join)  # held: the first member does not rejoin (it would have 60 s to)
        wait_for(lambda: ray.get(bus.controller.describe_group.remote("held"))["state"] == "PreparingRebalance", timeout_s=60,
                 message="the group rebalancing")
        assert gateway.stats()[0]["connections"] == before["connections"] + 1
        second.close()
        # Long before the join's answer (up to 60 s): the slot is free once the gateway sees the close.
        wait_for(lambda: gateway.stats()[0]["connections"] == before["connections"], timeout_s=20, message="the slot freed")
        left = first.call(kg.LEAVE_GROUP, 5, {"group_id": "held", "members": [{"member_id": joined.member_id, "group_instance_id": None,
                                                                                 "reason": None}]})
        assert left.error_code == kg.ErrorCode.none
    finally:
        for raw in (first, second):
            if raw is not None:
                raw.close()
    # The second client went away while its join was held: its member stays in the group until its 60 s
    # session runs out. It leaves now, as a client's LeaveGroup would, so that no live member is left
    # behind on the module's cluster.
    leave_group(bus, "held")


def test_produce_requests_read_before_the_client_closes_are_all_written(bus, gateway, topic_name):
    """acks=0 batches a client sent just before closing its connection all land (Kafka serves every
    request it has read), though the gateway sends the batches of one partition one after another."""
    bus.admin.create_topic(topic_name, partitions=1)
    raw = Raw(gateway)
    requests, per_request = 50, 20
    now_ms = int(time.time() * 1000)  # (records of 2023 would be past the topic's retention, and gone at once)
    for r in range(requests):
        records = [(b"k", b"%d" % (r * per_request + i), now_ms, []) for i in range(per_request)]
        raw.send(kg.PRODUCE, 9, produce_request(topic_name, kafka_batch(records), acks=0))
    raw.close()  # at once: no reply is awaited with acks=0
    wait_for(lambda: bus.admin.describe_topic(topic_name).partitions[0].high_watermark == requests * per_request, timeout_s=60,
             message="every batch written")
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, 0)])
    values = []
    wait_for(lambda: values.extend(consumer.poll_arrow(timeout_ms=200)["value"].to_pylist()) or len(values) >= requests * per_request,
             timeout_s=60, message="the records read back")
    consumer.close()
    assert values == [b"%d" % i for i in range(requests * per_request)]  # each once, in the order sent


def test_a_retried_idempotent_batch_is_written_once(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    raw = Raw(gateway)
    producer_id = raw.call(kg.INIT_PRODUCER_ID, 4, {"transactional_id": None, "transaction_timeout": 60_000,
                                                    "producer_id": -1, "producer_epoch": -1}).producer_id
    batch = kafka_batch([(b"k", b"v%d" % i, 1_700_000_000_000, []) for i in range(10)], producer_id=producer_id, producer_epoch=0, base_sequence=0)
    first = produce(raw, topic_name, batch)
    again = produce(raw, topic_name, batch)  # a retry after a lost response
    assert first.error_code == again.error_code == kg.ErrorCode.none
    assert first.base_offset == again.base_offset == 0
    after = produce(raw, topic_name, kafka_batch([(b"k", b"w", 1_700_000_000_000, [])], producer_id=producer_id,
                                                 producer_epoch=0, base_sequence=10))
    assert after.base_offset == 10
    assert bus.admin.describe_topic(topic_name).partitions[0].high_watermark == 11
    raw.close()


def test_a_connections_pipelined_batches_land_in_the_order_sent(bus, gateway, topic_name):
    # Every request is sent before any response is read (as a client with many requests in flight
    # does), to a topic the gateway has not looked up yet: partition 0 gets plain batches, partition 1
    # an idempotent producer's.
    bus.admin.create_topic(topic_name, partitions=2)
    raw = Raw(gateway)
    producer_id = raw.call(kg.INIT_PRODUCER_ID, 4, {"transactional_id": None, "transaction_timeout": 60_000,
                                                    "producer_id": -1, "producer_epoch": -1}).producer_id
    count = 400
    sent = []
    for i in range(count):
        partition = i % 2
        idempotent = {"producer_id": producer_id, "producer_epoch": 0, "base_sequence": i // 2} if partition else {}
        batch = kafka_batch([(None, b"%d" % i, timestamp_of(i), [])], **idempotent)
        sent.append(raw.send(kg.PRODUCE, 9, produce_request(topic_name, batch, acks=1, partition=partition)))
    replies = [raw.receive(kg.PRODUCE, 9, correlation).responses[0].partition_responses[0] for correlation in sent]
    raw.close()
    assert [r.error_code for r in replies] == [kg.ErrorCode.none] * count
    seen = logbus_view(bus, topic_name, count)
    for partition in (0, 1):
        stored = [int(seen[(partition, offset)][1]) for offset in range(count // 2)]
        assert stored == list(range(partition, count, 2))
        assert [r.base_offset for r in replies[partition::2]] == list(range(count // 2))


def test_errors_reach_kafka_clients_as_kafka_codes(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config={"max.message.bytes": 4096})
    raw = Raw(gateway)
    small = kafka_batch([(None, b"x", 1_700_000_000_000, [])])
    assert produce(raw, "no-such-topic", small).error_code == kg.ErrorCode.unknown_topic_or_partition
    assert produce(raw, topic_name, kafka_batch([(None, b"x" * 10_000, 1_700_000_000_000, [])])).error_code == kg.ErrorCode.message_too_large
    corrupt = bytearray(small)
    corrupt[-1] ^= 0xFF
    assert produce(raw, topic_name, bytes(corrupt)).error_code == kg.ErrorCode.corrupt_message
    assert produce(raw, topic_name, small).error_code == kg.ErrorCode.none
    assert fetch(raw, topic_name, 10**9).error_code == kg.ErrorCode.offset_out_of_range
    assert fetch(raw, "no-such-topic", 0).error_code == kg.ErrorCode.unknown_topic_or_partition
    heartbeat = raw.call(kg.HEARTBEAT, 4, {"group_id": "nobody", "generation_id": 1, "member_id": "ghost", "group_instance_id": None})
    assert heartbeat.error_code == kg.ErrorCode.unknown_member_id
    assert bus.admin.describe_topic(topic_name).partitions[0].high_watermark == 1
    raw.close()


def test_generations_are_checked_as_kafka_does(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    raw = Raw(gateway)
    subscription = kg.encode_subscription([topic_name])
    joined = raw.call(kg.JOIN_GROUP, 7, {"group_id": "g", "session_timeout": 10_000, "rebalance_timeout": 10_000, "member_id": "",
                                         "group_instance_id": None, "protocol_type": "consumer",
                                         "protocols": [{"name": "range", "metadata": subscription}]})
    # Kafka's classic protocol: the one member leads, and its SyncGroup brings the assignment it made.
    assert joined.error_code == kg.ErrorCode.none and joined.leader == joined.member_id and joined.protocol_name == "range"
    assert [(m.member_id, m.metadata) for m in joined.members] == [(joined.member_id, subscription)]
    mine = kg.encode_assignment([TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)])
    synced = raw.call(kg.SYNC_GROUP, 5, {"group_id": "g", "generation_id": joined.generation_id, "member_id": joined.member_id,
                                         "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range",
                                         "assignments": [{"member_id": joined.member_id, "assignment": mine}]})
    assert synced.error_code == kg.ErrorCode.none
    assert synced.assignment == mine
    stale = raw.call(kg.HEARTBEAT, 4, {"group_id": "g", "generation_id": joined.generation_id + 5, "member_id": joined.member_id,
                                       "group_instance_id": None})
    assert stale.error_code == kg.ErrorCode.illegal_generation
    ok = raw.call(kg.HEARTBEAT, 4, {"group_id": "g", "generation_id": joined.generation_id, "member_id": joined.member_id,
                                    "group_instance_id": None})
    assert ok.error_code == kg.ErrorCode.none
    left = raw.call(kg.LEAVE_GROUP, 5, {"group_id": "g", "members": [{"member_id": joined.member_id, "group_instance_id": None, "reason": None}]})
    assert left.error_code == kg.ErrorCode.none and left.members[0].error_code == kg.ErrorCode.none
    raw.close()


# --- fuzz: bad frames cost their connection, never the gateway or the log ----------------------------------


def test_random_and_truncated_frames_leave_the_gateway_serving_and_the_log_unchanged(bus, gateway, topic_name):
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=1)
    with logbus.Producer(bus) as producer:
        for i in range(100):
            producer.send(topic_name, value_of(i), key=key_of(i))
    before = bus.admin.describe_topic(topic_name).partitions[0].high_watermark
    [stats_before] = gateway.stats()
    generator = random.Random(2024)
    valid = Raw(gateway)
    metadata = {"topics": [{"name": topic_name, "topic_id": None}], "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False}
    good_batch = kafka_batch([(b"k", b"v", 1_700_000_000_000, [])])
    for round_ in range(300):
        raw = Raw(gateway)
        kind = generator.choice(["random", "header", "truncated", "oversized", "produce"])
        if kind == "random":
            raw.sock.sendall(bytes(generator.randrange(256) for _ in range(generator.randrange(1, 200))))
        elif kind == "header":
            api_key = generator.choice(sorted(kg.API_VERSIONS_SERVED) + [7, 50, 1000])
            body = struct.pack(">hhi", api_key, generator.randrange(-2, 16), round_) + bytes(generator.randrange(256) for _ in range(generator.randrange(80)))
            raw.send_frame(body)
        elif kind == "truncated":
            raw.sock.sendall(struct.pack(">i", 1000) + bytes(generator.randrange(256) for _ in range(generator.randrange(1000))))
        elif kind == "oversized":
            raw.sock.sendall(struct.pack(">i", generator.choice([2**31 - 1, 200 << 20, -5, 3])))
        else:
            # A well-formed produce request whose records are damaged: bytes flipped in the batch's
            # length, magic, CRC or what the CRC covers (not the base offset or partition leader epoch,
            # which are the broker's to set), or cut short.
            damaged = bytearray(good_batch)
            for position in generator.sample([*range(8, 12), *range(16, len(damaged))], generator.randrange(1, 4)):
                damaged[position] ^= generator.randrange(1, 256)
            if generator.random() < 0.3:
                damaged = damaged[: generator.randrange(len(damaged))]
            response = produce(raw, topic_name, bytes(damaged))
            assert response.error_code in (kg.ErrorCode.corrupt_message, kg.ErrorCode.invalid_record), response
        # The end of the stream after the frame: the gateway has dealt with the frame once it closes.
        raw.sock.shutdown(socket.SHUT_WR)
        raw.sock.settimeout(30)
        try:
            while raw.sock.recv(1 << 16):
                pass
        except OSError:
            pass  # reset: closed with replies unread
        raw.close()
        if round_ % 25 == 0:
            assert valid.call(kg.METADATA, 12, metadata).topics[0].name == topic_name  # a correct client is still served
    valid.close()
    assert bus.admin.describe_topic(topic_name).partitions[0].high_watermark == before  # nothing was written
    [stats_after] = gateway.stats()
    assert stats_after["pid"] == stats_before["pid"]  # the same process: nothing crashed it
    assert stats_after["refused_frames"] > stats_before["refused_frames"]
    native = logbus_view(bus, topic_name, before)
    assert [native[(0, i)][:2] for i in range(before)] == [(key_of(i), value_of(i)) for i in range(before)]  # unchanged
    # And real clients still work.
    producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers, "acks": "all"})
    producer.produce(topic_name, key=b"after", value=b"fuzz")
    assert producer.flush(30) == 0
    assert bus.admin.describe_topic(topic_name).partitions[0].high_watermark == before + 1
