"""The Kafka gateway's Ray-free parts: frames, ApiVersions, the consumer protocol's bytes, error codes.

kafka-python's own protocol code (``KafkaProtocol``, its message classes) is
the independent client here: it encodes the requests and decodes the
responses. Everything that needs a cluster is in tests/actors/test_gateway.py.
"""

from __future__ import annotations

import asyncio
import io
import os
import pathlib
import random
import struct
import subprocess
import sys

import cramjam
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer
from kafka.protocol.old.consumer_protocol import ConsumerProtocolMemberAssignment_v0, ConsumerProtocolMemberMetadata_v0
from kafka.protocol.parser import KafkaProtocol

from logbus import errors
from logbus.errors import KafkaProtocolError, LogbusError
from logbus.protocol import kafka_gateway as kg
from logbus.protocol import kafka_records as kr
from logbus.protocol.messages import TopicPartition
from logbus.storage import record_batch as rb
from tests.protocol.log_backend import LogBackend
from tests.protocol.test_kafka_records import BASE_MS, claiming, kafka_batch, with_codec


def kio_frame(api_key: int, version: int, values: dict, correlation_id: int = 1) -> bytes:
    """A request frame (without its size prefix) built with kio's message types, as a client sends it."""
    cls = load_request_schema(api_key, version)
    out = io.BytesIO()
    entity_writer(cls.__header_schema__)(out, cls.__header_schema__(request_api_key=api_key, request_api_version=version,
                                                                   correlation_id=correlation_id, client_id="test"))
    entity_writer(cls)(out, kg.build(cls, values))
    return out.getvalue()


def kio_response(api_key: int, version: int, frame: bytes):
    """The body of a response frame (size prefix included), read with kio."""
    cls = load_response_schema(api_key, version)
    frame = frame[4:]
    _, used = entity_reader(cls.__header_schema__)(frame, 0)
    body, _ = entity_reader(cls)(frame, used)
    return body


def produce_values(topic: str, batches: dict[int, bytes], acks: int = -1) -> dict:
    return {"transactional_id": None, "acks": acks, "timeout": 30_000, "topic_data": [
        {"name": topic, "partition_data": [{"index": p, "records": b} for p, b in batches.items()]}]}


def produce_through(handler: kg.KafkaHandler, values: dict) -> dict[int, tuple]:
    """Run one produce request (v9) through the handler: {partition: (error code, base offset)}."""
    async def run():
        return await handler.start(kio_frame(kg.PRODUCE, 9, values))

    response = kio_response(kg.PRODUCE, 9, asyncio.run(run()))
    return {p.index: (p.error_code, p.base_offset) for t in response.responses for p in t.partition_responses}


@pytest.fixture
def logs(tmp_path):
    backend = LogBackend(str(tmp_path))
    yield backend
    backend.close()


def zeros(size: int) -> bytes:
    """A zstd batch of ``size`` zero bytes of records (a valid CRC; records of length 0, so corrupt once decoded)."""
    return claiming(1, b"\0" * size, kr.CODEC_ZSTD)


def test_a_produce_to_an_unknown_topic_is_refused_before_any_batch_is_decoded(logs, monkeypatch):
    # 100 partitions of a small frame each, every one expanding to 64 MiB: nothing is decompressed.
    bomb = zeros(64 << 20)
    assert len(bomb) < 4096
    decompressed = []
    decompress = kr._decompress
    monkeypatch.setattr(kr, "_decompress", lambda codec, payload, limit: decompressed.append(codec) or decompress(codec, payload, limit))
    replies = produce_through(kg.KafkaHandler(logs), produce_values("no-such-topic", {p: bomb for p in range(100)}))
    assert replies == {p: (kg.ErrorCode.unknown_topic_or_partition, -1) for p in range(100)}
    assert decompressed == []  # not one batch (each would take seconds)
    assert logs.lookups == 100


def test_a_batch_over_the_topics_max_message_bytes_is_refused_compressed_or_once_it_expands_past_it(logs):
    logs.create_topic("small", partitions=3, config={"max.message.bytes": 4096})
    big = with_codec(kafka_batch([(b"k%d" % i, bytes(random.Random(i).randbytes(100)), BASE_MS, []) for i in range(60)]), kr.CODEC_ZSTD)
    assert len(big) > 4096  # random values do not compress
    fits = with_codec(kafka_batch([(b"k", b"v" * 100, BASE_MS, [])] * 10), kr.CODEC_ZSTD)
    replies = produce_through(kg.KafkaHandler(logs), produce_values("small", {0: big, 1: zeros(1 << 20), 2: fits}))
    assert replies == {0: (kg.ErrorCode.message_too_large, -1), 1: (kg.ErrorCode.message_too_large, -1), 2: (kg.ErrorCode.none, 0)}
    assert [logs.logs[("small", p)].log_end_offset for p in range(3)] == [0, 0, 10]


def test_the_batches_of_one_request_may_decompress_to_four_times_the_request_limit_in_all(logs):
    logs.create_topic("t", partitions=3)
    batch = kafka_batch([(None, b"x" * 100, BASE_MS, [])] * 18)
    records_bytes = len(batch) - kr.HEADER_SIZE
    assert 1024 < records_bytes < 2048  # two fit in 4 x 1024 bytes, three do not
    compressed = with_codec(batch, kr.CODEC_GZIP)
    handler = kg.KafkaHandler(logs, max_request_bytes=1024)
    replies = produce_through(handler, produce_values("t", {0: compressed, 1: compressed, 2: compressed}))
    assert replies == {0: (kg.ErrorCode.none, 0), 1: (kg.ErrorCode.none, 0), 2: (kg.ErrorCode.message_too_large, -1)}
    # The budget is per request: the next one has its own.
    assert produce_through(handler, produce_values("t", {2: compressed})) == {2: (kg.ErrorCode.none, 0)}
    assert [logs.logs[("t", p)].log_end_offset for p in range(3)] == [18, 18, 18]


def fetch_values(topic: str, offset: int, max_wait_ms: int) -> dict:
    return {"replica_id": -1, "max_wait": max_wait_ms, "min_bytes": 1, "max_bytes": 1 << 20, "isolation_level": 0, "session_id": 0,
            "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "", "topics": [
                {"topic": topic, "partitions": [{"partition": 0, "current_leader_epoch": -1, "fetch_offset": offset, "last_fetched_epoch": -1,
                                                 "log_start_offset": -1, "partition_max_bytes": 1 << 20}]}]}


def test_a_fetch_at_a_compacted_gap_that_ends_at_the_high_watermark_waits_past_it_for_data(logs):
    # Offsets 0-2 hold records; 3-9 were compacted away on the leader this log copied them from, so
    # the log ends (and every reader's high watermark is) at 10, with no batch after 2.
    logs.create_topic("compacted", config={"cleanup.policy": "compact"})
    log = logs.logs[("compacted", 0)]
    log.append(rb.encode_batch([b"a", b"b", b"c"], keys=[b"1", b"2", b"3"]))
    log.append_as_follower(b"", first_offset=3, next_offset=10)
    assert (log.log_end_offset, log.read(3, 1 << 20).next_offset, len(log.read(3, 1 << 20).data)) == (10, 10, 0)
    handler = kg.KafkaHandler(logs)

    async def fetch_while_appending() -> bytes:
        logs.on_wait = asyncio.Event()
        waited = asyncio.ensure_future(logs.on_wait.wait())
        reply = asyncio.ensure_future(handler.start(kio_frame(kg.FETCH, 12, fetch_values("compacted", 3, 30_000))))
        # The fetch waits at offset 10 (past the gap) instead of answering "nothing" at once: a Kafka
        # client, which cannot learn where the gap ends, would fetch offset 3 again straight away.
        await asyncio.wait({waited, reply}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waited.cancel()
        assert not reply.done() and logs.waits == [("compacted", 0, 10)], "answered without waiting for data"
        await logs.produce("compacted", 0, rb.encode_batch([b"d"], keys=[b"4"]), 1, 1000)
        return await asyncio.wait_for(reply, 10)

    [partition] = kio_response(kg.FETCH, 12, asyncio.run(fetch_while_appending())).responses[0].partitions
    assert partition.error_code == kg.ErrorCode.none and partition.high_watermark == 11
    [(_, header)] = kr.iter_batches(partition.records)
    assert (header.base_offset, header.record_count) == (10, 1)  # a batch past the client's position, as Kafka's compacted logs give


def test_a_produce_with_acks_other_than_0_1_or_minus_1_is_refused_with_invalid_required_acks(logs):
    logs.create_topic("t")
    batch = kafka_batch([(None, b"v", BASE_MS, [])])
    for acks in (2, -2, 5):
        replies = produce_through(kg.KafkaHandler(logs), produce_values("t", {0: batch}, acks=acks))
        assert replies == {0: (kg.ErrorCode.invalid_required_acks, -1)}
    assert logs.logs[("t", 0)].log_end_offset == 0


@pytest.mark.parametrize("version", range(1, 7))
def test_a_delete_topics_request_naming_no_topic_deletes_nothing_in_every_version(version):
    values = {"timeout": 30_000, **({"topics": []} if version >= 6 else {"topic_names": []})}

    async def run():
        return await kg.KafkaHandler(backend=None).start(kio_frame(kg.DELETE_TOPICS, version, values))

    assert kio_response(kg.DELETE_TOPICS, version, asyncio.run(run())).responses == ()


def encoded(request) -> bytes:
    """A request frame as kafka-python sends it, without the size prefix; and the protocol to read the reply."""
    protocol = KafkaProtocol(client_id="test-client")
    protocol.send_request(request)
    return bytes(protocol.send_bytes())[4:], protocol


@pytest.mark.parametrize("version", range(4))
def test_api_versions_lists_what_is_served_in_every_version(version):
    frame, protocol = encoded(ApiVersionsRequest[version](**({"client_software_name": "t", "client_software_version": "1"} if version >= 3 else {})))
    handler = kg.KafkaHandler(backend=None)
    [(correlation_id, response)] = protocol.receive_bytes(asyncio.run(handler.start(frame)))
    assert response.error_code == 0
    assert {k.api_key: (k.min_version, k.max_version) for k in response.api_keys} == kg.API_VERSIONS_SERVED
    assert handler.requests_served == {(kg.API_VERSIONS, version): 1}


def test_an_api_versions_request_newer_than_served_gets_version_0_with_unsupported_version():
    frame = struct.pack(">hhi", kg.API_VERSIONS, 9, 1234) + struct.pack(">h", 1) + b"x" + b"garbage of a future version"
    response = asyncio.run(kg.KafkaHandler(backend=None).start(frame))
    (size, correlation_id, error, count) = struct.unpack_from(">iihi", response)
    assert (size, correlation_id, error) == (len(response) - 4, 1234, 35)  # UNSUPPORTED_VERSION
    assert count == len(kg.API_VERSIONS_SERVED)


def test_bytes_after_a_request_are_ignored_as_kafka_does():
    frame, _ = encoded(MetadataRequest[9](topics=[MetadataRequest.MetadataRequestTopic(name="events")], allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False))
    assert [t.name for t in kg.parse_request(frame + b"\0\0\0").body.topics] == ["events"]


def test_parse_request_reads_what_a_client_sends():
    frame, _ = encoded(MetadataRequest[9](topics=[MetadataRequest.MetadataRequestTopic(name="events")], allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False))
    request = kg.parse_request(frame)
    assert (request.api_key, request.api_version, request.client_id) == (kg.METADATA, 9, "test-client")
    assert [t.name for t in request.body.topics] == ["events"]
    assert request.body.allow_auto_topic_creation is False


def test_frames_that_cannot_be_served_raise_kafka_protocol_error():
    frame, _ = encoded(MetadataRequest[9](topics=[MetadataRequest.MetadataRequestTopic(name="events")], allow_auto_topic_creation=False,
                                          include_topic_authorized_operations=False))
    for bad in (
        frame[:5],  # no header
        frame[:-1],  # cut short
        struct.pack(">hhi", 67, 0, 1) + frame[8:],  # an API key not served
        struct.pack(">hhi", kg.METADATA, 13, 1) + frame[8:],  # a version not served
        struct.pack(">hhi", kg.PRODUCE, 2, 1) + frame[8:],  # below the versions served
    ):
        with pytest.raises(KafkaProtocolError):
            kg.parse_request(bad)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_frames_parse_or_raise_kafka_protocol_error(data):
    api_key = data.draw(st.sampled_from(sorted(kg.API_VERSIONS_SERVED)))
    low, high = kg.API_VERSIONS_SERVED[api_key]
    version = data.draw(st.integers(low - 1, high + 1))
    frame = struct.pack(">hhi", api_key, version, 1) + data.draw(st.binary(max_size=300))
    try:
        request = kg.parse_request(frame)
    except KafkaProtocolError:
        return
    assert (request.api_key, request.api_version) == (api_key, version)


def test_random_frames_of_every_api_key_raise_only_kafka_protocol_error():
    generator = random.Random(11)
    for _ in range(3000):
        api_key = generator.choice(sorted(kg.API_VERSIONS_SERVED) + [7, 99, -1])
        frame = struct.pack(">hhi", api_key, generator.randrange(-1, 15), 1) + bytes(generator.randrange(256) for _ in range(generator.randrange(40)))
        try:
            kg.parse_request(frame)
        except KafkaProtocolError:
            continue


def test_subscriptions_and_assignments_match_kafka_pythons_encoding():
    theirs = ConsumerProtocolMemberMetadata_v0(0, ["a", "b"], b"user").encode()
    assert kg.parse_subscription(theirs) == (("a", "b"), ())
    ours = kg.encode_assignment([TopicPartition("b", 1), TopicPartition("a", 2), TopicPartition("a", 0)])
    decoded = ConsumerProtocolMemberAssignment_v0.decode(ours)
    assert sorted((t, sorted(ps)) for t, ps in decoded.assigned_partitions) == [("a", [0, 2]), ("b", [1])]
    assert kg.parse_assignment(ours) == (TopicPartition("a", 0), TopicPartition("a", 2), TopicPartition("b", 1))
    assert ConsumerProtocolMemberMetadata_v0.decode(kg.encode_subscription(["x"])).topics == ["x"]


def test_a_newer_subscription_version_is_read_for_its_topics_and_owned_partitions():
    # Version 1 adds owned partitions (cooperative rebalancing): [topic, [partitions]].
    body = struct.pack(">h", 1) + struct.pack(">i", 1) + struct.pack(">h", 1) + b"t" + struct.pack(">i", -1)
    body += struct.pack(">i", 1) + struct.pack(">h", 1) + b"t" + struct.pack(">ii", 1, 3)
    assert kg.parse_subscription(body) == (("t",), (TopicPartition("t", 3),))
    with pytest.raises(errors.InvalidConfigError):
        kg.parse_subscription(b"\0")


# Errors a Kafka client never sees from the gateway (client-side, local channel, node heartbeats,
# administration the gateway does not serve) or that mean a bug; they are reported as UNKNOWN_SERVER_ERROR.
UNMAPPED = {
    "LogbusError", "RetriableError", "SerializationError", "RecordDeserializationError", "CliError", "BufferExhaustedError",
    "FrameError", "ChannelReplyTooLargeError", "InternalStateError", "InvariantViolationError", "DataDirectoryInUseError", "KafkaProtocolError",
    "HeartbeatLinkClosedError", "HeartbeatRefusedError", "FetchLinkClosedError", "TransactionAbortedError",
    "NodeIdentityError",  # a host's identity files: the host's operator meets it, never a client
}


@pytest.mark.parametrize("cls", [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, LogbusError)], ids=lambda c: c.__name__)
def test_every_logbus_error_a_client_can_meet_has_a_kafka_code(cls):
    error = cls("x", 0) if cls is errors.ChannelReplyTooLargeError else cls("x")
    code = kg.error_code(error)
    if cls.__name__ in UNMAPPED and cls is not errors.ChannelClosedError:
        assert code == kg.ErrorCode.unknown_server_error or cls.__name__ in ("RetriableError",)
    else:
        assert code != kg.ErrorCode.unknown_server_error
    if cls.retriable and code != kg.ErrorCode.unknown_server_error:
        # What logbus retries, Kafka's clients retry too (after a metadata refresh where it says so).
        assert code.retriable or code in (kg.ErrorCode.out_of_order_sequence_number, kg.ErrorCode.rebalance_in_progress,
                                          kg.ErrorCode.unknown_topic_or_partition)


def test_error_codes_of_the_data_path():
    assert kg.error_code(errors.NotLeaderError("x")) == kg.ErrorCode.not_leader_or_follower
    assert kg.error_code(errors.ChannelClosedError("x")) == kg.ErrorCode.not_leader_or_follower
    assert kg.error_code(errors.OffsetOutOfRangeError("x")) == kg.ErrorCode.offset_out_of_range
    assert kg.error_code(errors.RecordTooLargeError("x")) == kg.ErrorCode.message_too_large
    assert kg.error_code(errors.CorruptRecordError("x")) == kg.ErrorCode.corrupt_message
    assert kg.error_code(errors.IllegalGenerationError("x")) == kg.ErrorCode.illegal_generation
    assert kg.error_code(errors.DuplicateSequenceError("x")) == kg.ErrorCode.duplicate_sequence_number
    assert kg.error_code(asyncio.TimeoutError()) == kg.ErrorCode.request_timed_out
    assert kg.error_code(ValueError("a bug")) == kg.ErrorCode.unknown_server_error


def test_the_clients_do_not_load_the_gateway_or_its_dependencies():
    # kio and cramjam are for processes that start a gateway, not for every logbus.connect() user.
    code = ("import sys, logbus; logbus.connect, logbus.Bus, logbus.Producer, logbus.Consumer, logbus.Admin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kio', 'cramjam') or m in "
            "('logbus.actors.gateway', 'logbus.protocol.kafka_gateway', 'logbus.protocol.kafka_records')))")
    root = pathlib.Path(__file__).resolve().parents[2]
    loaded = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().splitlines()[-1] == "[]"


def test_broker_ids_are_stable_int32s():
    ids = {kg.broker_id_for(f"{n:056x}") for n in range(1000)}
    assert len(ids) == 1000 and all(0 <= i < 2**31 for i in ids)
    assert kg.broker_id_for("abc") == kg.broker_id_for("abc")


def test_a_fenced_transactional_producer_is_told_producer_fenced_only_by_the_versions_that_know_it():
    fenced = errors.ProducerFencedError("x")
    assert kg.txn_error_code(fenced, kg.END_TXN, 1) == kg.ErrorCode.invalid_producer_epoch
    assert kg.txn_error_code(fenced, kg.END_TXN, 2) == kg.ErrorCode.producer_fenced
    assert kg.txn_error_code(fenced, kg.INIT_PRODUCER_ID, 3) == kg.ErrorCode.invalid_producer_epoch
    assert kg.txn_error_code(fenced, kg.INIT_PRODUCER_ID, 4) == kg.ErrorCode.producer_fenced
    assert kg.txn_error_code(fenced, kg.TXN_OFFSET_COMMIT, 3) == kg.ErrorCode.invalid_producer_epoch
    assert kg.txn_error_code(errors.ConcurrentTransactionsError("x"), kg.END_TXN, 3) == kg.ErrorCode.concurrent_transactions
    assert kg.txn_error_code(errors.InvalidTxnStateError("x"), kg.ADD_PARTITIONS_TO_TXN, 3) == kg.ErrorCode.invalid_txn_state
