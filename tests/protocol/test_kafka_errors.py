"""Every error the gateway can answer encodes: each served API at each served version, and every API it does not serve.

Hypothesis draws requests of every served API and version from kio's own
message types (any field values kio can encode), sends them to a handler
whose cluster fails every call with a drawn error, and decodes each reply
with kio: nullable fields, defaults and per-version fields all have to
work out, and no request may raise anything but KafkaProtocolError (which
closes the connection) from the handler. Requests of APIs not served are
answered in their own version with UNSUPPORTED_VERSION. No Ray.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import struct

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kio.schema.index import api_key_map, schema_name_map
from kio.serial import entity_reader, entity_writer
from kio.static import primitive

from logbus import errors
from logbus.protocol import kafka_gateway as kg
from logbus.protocol import kafka_messages as km


def _register_kio_strategies() -> None:
    """kio's primitive types carry Hypothesis hooks; register them so ``st.from_type`` draws kio entities."""
    for obj in vars(primitive).values():
        if inspect.isclass(obj) and hasattr(obj, "__hypothesis_hook__"):
            for cls in [obj, *obj.__subclasses__()]:
                try:
                    cls.__hypothesis_hook__()
                except Exception:  # noqa: BLE001 (abstract bases have no strategy of their own)
                    pass
    st.register_type_strategy(primitive.Records, st.binary(max_size=300))  # records: any bytes (mostly corrupt batches)


_register_kio_strategies()

# What a failing cluster raises: retriable and fatal logbus errors, timeouts, and a bug.
FAILURES = [
    errors.UnknownTopicError("x"), errors.LeaderNotAvailableError("x"), errors.NotLeaderError("x"), errors.InvalidConfigError("x"),
    errors.UnknownMemberIdError("x"), errors.FencedInstanceIdError("x"), errors.IllegalGenerationError("x"),
    errors.RebalanceInProgressError("x"), errors.InconsistentGroupProtocolError("x"), errors.InvalidGroupIdError("x"),
    errors.GroupNotEmptyError("x"), errors.OffsetOutOfRangeError("x"), errors.RequestTimedOutError("x"), errors.TopicAlreadyExistsError("x"),
    errors.InvalidPartitionsError("x"), errors.CoordinatorNotAvailableError("x"), asyncio.TimeoutError(), RuntimeError("a bug"),
]


class FailingBackend:
    """A cluster whose every call fails with one error (the brokers and ids still answer)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.broker = kg.Broker(7, "127.0.0.1", 9092, "node")
        self.cluster_id = "logbus-test"

    def brokers(self):
        return [self.broker]

    def broker_on(self, node_id):
        return self.broker

    def produce(self, *args, **kwargs):
        raise self.error

    def fetch(self, *args, **kwargs):
        return self._fail()

    async def _fail(self, *args, **kwargs):
        raise self.error

    def __getattr__(self, name):
        return self._fail


def frame_of(api_key: int, version: int, body) -> bytes:
    cls = km.request_class(api_key, version)
    out = io.BytesIO()
    entity_writer(cls.__header_schema__)(out, cls.__header_schema__(request_api_key=api_key, request_api_version=version,
                                                                   correlation_id=4242, client_id="property"))
    entity_writer(cls)(out, body)
    return out.getvalue()


def decoded(api_key: int, version: int, frame: bytes):
    cls = km.response_class(api_key, version)
    (size,) = struct.unpack_from(">i", frame)
    assert size == len(frame) - 4
    header, used = entity_reader(cls.__header_schema__)(frame[4:], 0)
    assert header.correlation_id == 4242
    body, end = entity_reader(cls)(frame[4:], used)
    assert used + end == size
    return body


SERVED = [(key, version) for key, (low, high) in sorted(kg.API_VERSIONS_SERVED.items()) for version in range(low, high + 1)]


@pytest.mark.parametrize(("api_key", "version"), SERVED, ids=lambda v: str(v))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                                  HealthCheck.data_too_large])
@given(data=st.data())
def test_every_served_api_answers_a_failing_cluster_with_a_reply_kio_decodes(api_key, version, data):
    request_cls = km.request_class(api_key, version)
    body = data.draw(st.from_type(request_cls), label="request")
    try:
        frame = frame_of(api_key, version, body)
    except Exception:  # noqa: BLE001 (values kio's writer refuses: no client could send them)
        assume(False)
    error = data.draw(st.sampled_from(FAILURES), label="the cluster's error")
    handler = kg.KafkaHandler(FailingBackend(error))

    async def serve():
        return await asyncio.wait_for(handler.start(frame, connection=1), 30)

    try:
        response = asyncio.run(serve())
    except errors.KafkaProtocolError:
        return  # a request the gateway cannot read closes its connection, as Kafka does
    if response is None:
        assert api_key == kg.PRODUCE and body.acks == 0  # acks=0: no response, as Kafka
        return
    decoded(api_key, version, response)


# Every API kio knows, at every version it knows, whether served or not.
KNOWN = [(key, version) for key, name in sorted(api_key_map.items()) for version in sorted(schema_name_map[name])
         if km.knows(key, version)]


@pytest.mark.parametrize(("api_key", "version"), KNOWN, ids=lambda v: str(v))
def test_every_known_apis_error_reply_encodes_with_each_error_code(api_key, version):
    for code in (km.ErrorCode.unsupported_version, km.ErrorCode.unknown_server_error, km.ErrorCode.coordinator_not_available):
        frame = km.error_response(api_key, version, 4242, code, "the message")
        body = decoded(api_key, version, frame)
        codes = [getattr(body, f) for f in ("error_code",) if hasattr(body, f)]
        assert all(c == code for c in codes)


def test_an_api_not_served_is_answered_unsupported_version_in_its_own_version():
    handler = kg.KafkaHandler(backend=None)
    unserved = [(key, version) for key, version in KNOWN if key not in kg.API_VERSIONS_SERVED or
                not kg.API_VERSIONS_SERVED[key][0] <= version <= kg.API_VERSIONS_SERVED[key][1]]
    assert (38, 2) in unserved  # CreateDelegationToken
    for api_key, version in unserved:
        if api_key == kg.API_VERSIONS:
            continue  # answered in version 0 (see test_kafka_gateway)
        frame = struct.pack(">hhi", api_key, version, 4242) + b"\xff" * 3  # the body is never read
        body = decoded(api_key, version, asyncio.run(handler.start(frame)))
        if hasattr(body, "error_code"):
            assert body.error_code == km.ErrorCode.unsupported_version and not body.error_code.retriable
    assert handler.requests_unserved[(38, 2)] == 1


def test_join_group_failures_encode_below_version_7_where_protocol_name_is_not_nullable():
    # The reported failure: INCONSISTENT_GROUP_PROTOCOL with protocol_name None could not be written
    # below v7, and the gateway closed the connection instead of answering.
    handler = kg.KafkaHandler(FailingBackend(errors.InconsistentGroupProtocolError("no common protocol")))
    for version in range(0, 8):
        values = {"group_id": "g", "session_timeout": 10_000, "rebalance_timeout": 10_000, "member_id": "", "group_instance_id": None,
                  "protocol_type": "consumer", "protocols": [{"name": "mine", "metadata": b"\x00\x04garbage"}]}
        frame = frame_of(kg.JOIN_GROUP, version, km.build(km.request_class(kg.JOIN_GROUP, version), values))
        body = decoded(kg.JOIN_GROUP, version, asyncio.run(handler.start(frame)))
        assert body.error_code == km.ErrorCode.inconsistent_group_protocol
        assert body.protocol_name == ("" if version < 7 else None)
