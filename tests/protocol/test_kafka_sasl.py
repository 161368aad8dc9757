"""SASL on a gateway connection without Ray or sockets: SaslHandshake, SaslAuthenticate, turns, throttling.

Frames are built with kio, as a client writes them; credentials come from a
dict (the gateway's come from the controller's metadata).
"""

from __future__ import annotations

import asyncio
import io
import struct

import pytest
from hypothesis import given, settings, strategies as st
from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

from logbus.errors import KafkaProtocolError
from logbus.protocol.kafka_messages import build
from logbus.protocol.kafka_sasl import (
    FAILED_DELAY_S_BASE,
    FAILED_DELAY_S_MAX,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    UNAUTHENTICATED_FRAME_BYTES_MAX,
    Authenticator,
    FailureThrottle,
)
from logbus.protocol.listener_security import ListenerSecurity
from logbus.protocol.scram import ITERATIONS_MIN, ScramClient, make_credential

API_VERSIONS, METADATA = 18, 3
USERS = {"alice": "alice-secret", "bob": "bob-secret"}
CREDENTIALS = {(user, mechanism): make_credential(mechanism, password, iterations=ITERATIONS_MIN)
               for user, password in USERS.items() for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512")}


def request_frame(api_key: int, version: int, values: dict, correlation_id: int = 7) -> bytes:
    cls = load_request_schema(api_key, version)
    out = io.BytesIO()
    entity_writer(cls.__header_schema__)(out, cls.__header_schema__(request_api_key=api_key, request_api_version=version,
                                                                      correlation_id=correlation_id, client_id="t"))
    entity_writer(cls)(out, build(cls, values))
    return out.getvalue()


def read_response(api_key: int, version: int, frame: bytes):
    (size,) = struct.unpack_from(">i", frame)
    assert size == len(frame) - 4
    cls = load_response_schema(api_key, version)
    header, used = entity_reader(cls.__header_schema__)(frame[4:], 0)
    body, _ = entity_reader(cls)(frame[4:], used)
    return body


class Connection:
    """One connection's session, with what reaches the gateway's handler past it recorded."""

    def __init__(self, authenticator: Authenticator, address=("10.0.0.1", 5555)) -> None:
        self.session = authenticator.session(address)
        self.passed: list[bytes] = []

    async def _handler(self, frame: bytes):
        self.passed.append(frame)
        return b"handled"

    def send(self, frame: bytes):
        return asyncio.run(_awaited(self.session.start(frame, self._handler)))

    def handshake(self, mechanism: str):
        return read_response(SASL_HANDSHAKE, 1, self.send(request_frame(SASL_HANDSHAKE, 1, {"mechanism": mechanism})))

    def authenticate(self, token: bytes, version: int = 2):
        return read_response(SASL_AUTHENTICATE, version, self.send(request_frame(SASL_AUTHENTICATE, version, {"auth_bytes": token})))


async def _awaited(awaitable):
    return await awaitable


def authenticator(mechanisms=("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"), delays=None) -> Authenticator:
    async def lookup(user, mechanism):
        return CREDENTIALS.get((user, mechanism))

    async def sleep(seconds):
        if delays is not None:
            delays.append(seconds)

    security = ListenerSecurity("cert.pem", "key.pem", sasl_mechanisms=mechanisms)
    return Authenticator(security, lookup, sleep=sleep)


def scram_login(connection: Connection, mechanism: str, user: str, password: str):
    assert connection.handshake(mechanism).error_code == ErrorCode.none
    client = ScramClient(mechanism, user, password)
    first = connection.authenticate(client.first())
    assert first.error_code == ErrorCode.none
    final = connection.authenticate(client.final(first.auth_bytes))
    return client, final


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_authenticates_and_then_requests_pass_to_the_handler(mechanism):
    auth = authenticator()
    connection = Connection(auth)
    assert connection.send(request_frame(API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"})) == b"handled"
    client, final = scram_login(connection, mechanism, "alice", "alice-secret")
    assert final.error_code == ErrorCode.none and client.check(final.auth_bytes) and final.session_lifetime.total_seconds() == 0
    assert connection.session.principal == "User:alice"
    metadata = request_frame(METADATA, 12, {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    assert connection.send(metadata) == b"handled"
    assert len(connection.passed) == 2 and auth.stats.succeeded == 1 and auth.stats.by_mechanism == {mechanism: 1}


@pytest.mark.parametrize("user, password", [("alice", "wrong"), ("mallory", "alice-secret")])
def test_a_wrong_password_or_unknown_user_is_refused_alike_throttled_and_ends_the_connection(user, password):
    delays: list[float] = []
    auth = authenticator(delays=delays)
    connection = Connection(auth)
    _, final = scram_login(connection, "SCRAM-SHA-512", user, password)
    assert final.error_code == ErrorCode.sasl_authentication_failed
    assert final.error_message == "Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512"
    assert password not in final.error_message and connection.session.principal is None
    assert auth.stats.failed == 1 and delays == [FAILED_DELAY_S_BASE]
    with pytest.raises(KafkaProtocolError, match="after a failed authentication"):
        connection.send(request_frame(API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"}))
    assert connection.passed == []


def test_plain_checks_the_password_against_the_scram_credential():
    auth = authenticator()
    good = Connection(auth)
    assert good.handshake("PLAIN").error_code == ErrorCode.none
    assert good.authenticate(b"\0bob\0bob-secret").error_code == ErrorCode.none and good.session.principal == "User:bob"
    for token in (b"\0bob\0nope", b"\0nobody\0bob-secret", b"alice\0bob\0bob-secret", b"bob-secret", b"\0\0"):
        bad = Connection(auth)
        bad.handshake("PLAIN")
        reply = bad.authenticate(token)
        assert reply.error_code == ErrorCode.sasl_authentication_failed and b"secret" not in (reply.error_message or "").encode()
        assert bad.session.principal is None


def test_requests_out_of_turn_end_the_connection_before_anything_reaches_the_handler():
    auth = authenticator(mechanisms=("SCRAM-SHA-512",))
    metadata = request_frame(METADATA, 12, {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    with pytest.raises(KafkaProtocolError, match="before authentication"):
        Connection(auth).send(metadata)
    with pytest.raises(KafkaProtocolError, match="SaslAuthenticate"):  # no handshake yet
        Connection(auth).send(request_frame(SASL_AUTHENTICATE, 2, {"auth_bytes": b"n,,n=alice,r=x"}))
    with pytest.raises(KafkaProtocolError, match="SaslHandshake v0"):  # tokens outside Kafka's framing: not served
        Connection(auth).send(request_frame(SASL_HANDSHAKE, 0, {"mechanism": "SCRAM-SHA-512"}))
    connection = Connection(auth)
    reply = connection.handshake("PLAIN")  # not offered by this gateway
    assert reply.error_code == ErrorCode.unsupported_sasl_mechanism and list(reply.mechanisms) == ["SCRAM-SHA-512"]
    with pytest.raises(KafkaProtocolError):
        connection.send(request_frame(SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-512"}))
    done = Connection(auth)
    scram_login(done, "SCRAM-SHA-512", "alice", "alice-secret")
    with pytest.raises(KafkaProtocolError, match="after authentication"):
        done.send(request_frame(SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-512"}))
    assert connection.passed == done.passed == [] and auth.stats.refused_frames == 5
    assert Connection(auth).session.frame_bytes_max == UNAUTHENTICATED_FRAME_BYTES_MAX and done.session.frame_bytes_max is None


def test_without_sasl_every_frame_passes_as_before():
    connection = Connection(Authenticator(ListenerSecurity(), lookup=None))
    frame = request_frame(SASL_HANDSHAKE, 1, {"mechanism": "PLAIN"})
    assert connection.send(frame) == b"handled" and connection.passed == [frame]
    assert connection.session.frame_bytes_max is None


def test_the_throttle_doubles_per_recent_failure_up_to_its_maximum_and_forgets_old_ones():
    now = [0.0]
    throttle = FailureThrottle(clock=lambda: now[0])
    delays = [throttle.failed("10.0.0.1") for _ in range(12)]
    assert delays[:3] == [FAILED_DELAY_S_BASE, 2 * FAILED_DELAY_S_BASE, 4 * FAILED_DELAY_S_BASE] and delays[-1] == FAILED_DELAY_S_MAX
    assert throttle.failed("10.0.0.2") == FAILED_DELAY_S_BASE  # another address starts afresh
    now[0] = 3600.0
    assert throttle.failed("10.0.0.1") == FAILED_DELAY_S_BASE  # an hour on, the old failures no longer count


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=3), st.sampled_from(["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"]))
def test_arbitrary_tokens_never_authenticate_and_end_in_a_reply_or_a_closed_connection(tokens, mechanism):
    connection = Connection(authenticator())
    connection.handshake(mechanism)
    for token in tokens:
        try:
            reply = connection.authenticate(token)
        except KafkaProtocolError:
            break
        if reply.error_code != ErrorCode.none:
            assert reply.error_code == ErrorCode.sasl_authentication_failed
    assert connection.session.principal is None and connection.passed == []
