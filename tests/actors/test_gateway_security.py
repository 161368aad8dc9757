"""The Kafka gateway off loopback: TLS on its listener, with real Kafka clients and CAs made here.

Each test starts a gateway of its own (one per node at a time), with
certificates from a CA the test makes; confluent-kafka and kafka-python
connect over SSL, produce and consume; a client without TLS, one that
does not trust the gateway's CA, and one whose certificate comes from
another CA are refused.
"""

from __future__ import annotations

import random
import socket
import struct
import ssl
import time

import confluent_kafka.admin  # noqa: F401 (ck.admin below)
import pytest
import ray

from logbus import cli
from logbus.actors.gateway import gateway_name
from logbus.errors import InvalidConfigError
from logbus.protocol import kafka_gateway as kg
from tests.actors.test_gateway import Raw, logbus_view
from tests.certificates import Authority
from tests.conftest import kafka_python_consumer, wait_for

# ACLs and users stay on a cluster (no test deletes them): this module shares a cluster of its own.
pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster_of_its_own]

RECORDS = 200


@pytest.fixture
def authority(tmp_path):
    return Authority(str(tmp_path), "test")


@pytest.fixture
def other_authority(tmp_path):
    return Authority(str(tmp_path), "other")


@pytest.fixture
def server_cert(authority):
    return authority.issue("gateway", server=True)


def start(bus, **options):
    return bus.start_gateway(port=0, **options)


class TlsRaw(Raw):
    """Raw's Kafka requests over a TLS connection made with ``context``."""

    def __init__(self, gateway, context: ssl.SSLContext) -> None:
        host, port = gateway.brokers[0][0], gateway.brokers[0][1]
        plain = socket.create_connection((host, port), timeout=30)
        self.sock = context.wrap_socket(plain, server_hostname=host)
        self.correlation = 0


def api_versions(raw: Raw):
    return raw.call(kg.API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"})


def reported(client, errors: list, codes, text: str = "") -> None:
    """Wait until confluent-kafka's error callback (served by poll) reports one of ``codes``."""
    def seen() -> bool:
        client.poll(0.1)
        return any(error.code() in codes and text in error.str() for error in errors)

    wait_for(seen, timeout_s=60, message=f"the client reporting one of {codes}")


def client_context(cafile: str, cert=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cafile)
    if cert is not None:
        context.load_cert_chain(cert.certfile, cert.keyfile)
    return context


def test_confluent_kafka_and_kafka_python_produce_and_consume_over_tls(bus, authority, server_cert, topic_name):
    import confluent_kafka as ck
    import kafka

    gateway = start(bus, ssl_certfile=server_cert.certfile, ssl_keyfile=server_cert.keyfile)
    try:
        bus.admin.create_topic(topic_name, partitions=1)
        servers = gateway.bootstrap_servers
        tls = {"bootstrap.servers": servers, "security.protocol": "SSL", "ssl.ca.location": authority.cafile}
        producer = ck.Producer({**tls, "acks": "all"})
        for i in range(RECORDS // 2):
            producer.produce(topic_name, key=b"ck-%d" % i, value=b"v%d" % i)
        assert producer.flush(60) == 0
        kp = kafka.KafkaProducer(bootstrap_servers=servers, security_protocol="SSL", ssl_cafile=authority.cafile, acks="all")
        for i in range(RECORDS // 2):
            kp.send(topic_name, key=b"kp-%d" % i, value=b"v%d" % i)
        kp.flush(60)
        kp.close()

        consumer = ck.Consumer({**tls, "group.id": "tls-ck", "auto.offset.reset": "earliest"})
        consumer.subscribe([topic_name])
        seen = {}
        deadline = time.monotonic() + 120
        while len(seen) < RECORDS and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                seen[message.offset()] = message.key()
        consumer.close()
        kc = kafka_python_consumer([topic_name], bootstrap_servers=servers, security_protocol="SSL", ssl_cafile=authority.cafile,
                                   auto_offset_reset="earliest", consumer_timeout_ms=20_000, group_id="tls-kp")
        kafka_python_seen = {}
        for message in kc:
            kafka_python_seen[message.offset] = message.key
            if len(kafka_python_seen) == RECORDS:
                break
        kc.close()
        native = logbus_view(bus, topic_name, RECORDS)
        assert seen == kafka_python_seen == {offset: record[0] for (_, offset), record in native.items()}
        assert sorted(seen.values()) == sorted([b"ck-%d" % i for i in range(RECORDS // 2)] + [b"kp-%d" % i for i in range(RECORDS // 2)])
    finally:
        gateway.stop()


def test_a_client_without_tls_or_not_trusting_the_ca_is_refused_and_the_gateway_serves_on(bus, authority, other_authority, server_cert):
    import confluent_kafka as ck

    gateway = start(bus, ssl_certfile=server_cert.certfile, ssl_keyfile=server_cert.keyfile)
    try:
        plain = Raw(gateway)  # Kafka's protocol without TLS: the handshake fails, the connection closes unanswered
        with pytest.raises(ConnectionError):
            api_versions(plain)
        plain.close()
        with pytest.raises(ssl.SSLCertVerificationError):  # the client does not trust the gateway's certificate
            TlsRaw(gateway, client_context(other_authority.cafile))
        errors = []
        admin = ck.admin.AdminClient({"bootstrap.servers": gateway.bootstrap_servers, "security.protocol": "SSL",
                                      "ssl.ca.location": other_authority.cafile, "error_cb": errors.append})
        reported(admin, errors, (ck.KafkaError._SSL,), "certificate verify failed")
        with pytest.raises(ck.KafkaException):
            admin.list_topics(timeout=2)
        del admin  # (its librdkafka threads end with it)
        good = TlsRaw(gateway, client_context(authority.cafile))  # and the gateway serves on
        assert api_versions(good).error_code == kg.ErrorCode.none
        good.close()
    finally:
        gateway.stop()


def test_client_certificates_from_the_ca_are_required_and_one_from_another_ca_is_refused(bus, authority, other_authority, server_cert):
    import confluent_kafka as ck
    import kafka

    gateway = start(bus, ssl_certfile=server_cert.certfile, ssl_keyfile=server_cert.keyfile, ssl_cafile=authority.cafile)
    try:
        good_client = authority.issue("alice", server=False)
        stranger = other_authority.issue("mallory", server=False)
        raw = TlsRaw(gateway, client_context(authority.cafile, good_client))
        assert api_versions(raw).error_code == kg.ErrorCode.none
        raw.close()
        for cert in (None, stranger):  # no certificate, or one from another CA: the gateway ends the handshake
            with pytest.raises((ssl.SSLError, ConnectionError)):
                refused = TlsRaw(gateway, client_context(authority.cafile, cert))
                api_versions(refused)  # TLS 1.3 reports the client's failure at its first read
        errors = []
        admin = ck.admin.AdminClient({"bootstrap.servers": gateway.bootstrap_servers, "security.protocol": "SSL",
                                      "ssl.ca.location": authority.cafile, "ssl.certificate.location": stranger.certfile,
                                      "ssl.key.location": stranger.keyfile, "error_cb": errors.append})
        # With TLS 1.3 the client learns of the refusal after its handshake: the connection closed by the gateway.
        reported(admin, errors, (ck.KafkaError._SSL, ck.KafkaError._TRANSPORT, ck.KafkaError._ALL_BROKERS_DOWN))
        with pytest.raises(ck.KafkaException):
            admin.list_topics(timeout=2)
        del admin  # (its librdkafka threads end with it)
        mutual = {"bootstrap.servers": gateway.bootstrap_servers, "security.protocol": "SSL", "ssl.ca.location": authority.cafile,
                  "ssl.certificate.location": good_client.certfile, "ssl.key.location": good_client.keyfile}
        assert gateway.brokers[0][2] in ck.admin.AdminClient(mutual).list_topics(timeout=30).brokers
        client = kafka.KafkaAdminClient(bootstrap_servers=gateway.bootstrap_servers, security_protocol="SSL", ssl_cafile=authority.cafile,
                                        ssl_certfile=good_client.certfile, ssl_keyfile=good_client.keyfile)
        assert isinstance(client.list_topics(), list)
        client.close()
    finally:
        gateway.stop()


def test_a_gateway_off_loopback_without_tls_and_authentication_refuses_to_start(bus, server_cert, capsys):
    node_id = ray.get_runtime_context().get_node_id()
    for options in ({}, {"ssl_certfile": server_cert.certfile, "ssl_keyfile": server_cert.keyfile}):  # TLS alone authenticates nobody
        with pytest.raises(InvalidConfigError, match="without .*allow_plaintext"):
            bus.start_gateway("0.0.0.0", 0, **options)
    with pytest.raises(ValueError):  # nothing was started
        ray.get_actor(gateway_name(node_id), namespace=bus.namespace)
    code = cli.main(["--namespace", bus.namespace, "--data-dir", bus.data_dir, "gateway", "--host", "0.0.0.0", "--port", "0"])
    assert code != 0 and "allow-plaintext" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ray.get_actor(gateway_name(node_id), namespace=bus.namespace)


def test_unreadable_tls_files_and_half_settings_are_refused_before_anything_starts(bus, server_cert, tmp_path):
    with pytest.raises(InvalidConfigError, match="go together"):
        bus.start_gateway(port=0, ssl_certfile=server_cert.certfile)
    with pytest.raises(InvalidConfigError, match="cannot be used"):
        bus.start_gateway(port=0, ssl_certfile=str(tmp_path / "missing.pem"), ssl_keyfile=server_cert.keyfile)
    with pytest.raises(InvalidConfigError, match="needs TLS"):
        bus.start_gateway(port=0, sasl_mechanisms=("PLAIN",))


# --- SASL over TLS: SCRAM-SHA-512/256 and PLAIN ------------------------------------------------------------


@pytest.fixture
def sasl_gateway(bus, server_cert):
    # alice is a super user here: these tests are about authentication (tests/actors/test_gateway_acls.py: ACLs).
    gateway = start(bus, ssl_certfile=server_cert.certfile, ssl_keyfile=server_cert.keyfile,
                    sasl_mechanisms=("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"), super_users=("User:alice",))
    bus.admin.create_scram_user("alice", "alice-secret", mechanism="SCRAM-SHA-512")
    bus.admin.create_scram_user("alice", "alice-secret", mechanism="SCRAM-SHA-256")
    yield gateway
    gateway.stop()
    bus.admin.delete_scram_user("alice")


def confluent_sasl(gateway, authority, mechanism: str, user: str, password: str, **extra) -> dict:
    return {"bootstrap.servers": gateway.bootstrap_servers, "security.protocol": "SASL_SSL", "ssl.ca.location": authority.cafile,
            "sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": password, **extra}


def authentications(gateway) -> dict:
    [stats] = gateway.stats()
    return stats["authentications"]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"])
def test_confluent_kafka_and_kafka_python_authenticate_with_sasl_ssl_produce_and_consume(bus, sasl_gateway, authority, topic_name, mechanism):
    import confluent_kafka as ck
    import kafka

    bus.admin.create_topic(topic_name, partitions=1)
    before = authentications(sasl_gateway)
    producer = ck.Producer(confluent_sasl(sasl_gateway, authority, mechanism, "alice", "alice-secret", acks="all"))
    for i in range(RECORDS // 2):
        producer.produce(topic_name, key=b"ck-%d" % i, value=b"v")
    assert producer.flush(60) == 0
    kafka_sasl = {"bootstrap_servers": sasl_gateway.bootstrap_servers, "security_protocol": "SASL_SSL", "ssl_cafile": authority.cafile,
                  "sasl_mechanism": mechanism, "sasl_plain_username": "alice", "sasl_plain_password": "alice-secret"}
    kp = kafka.KafkaProducer(acks="all", **kafka_sasl)
    for i in range(RECORDS // 2):
        kp.send(topic_name, key=b"kp-%d" % i, value=b"v")
    kp.flush(60)
    kp.close()
    consumer = ck.Consumer(confluent_sasl(sasl_gateway, authority, mechanism, "alice", "alice-secret", **{"group.id": f"sasl-{mechanism}",
                                                                                                         "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic_name])
    seen = {}
    deadline = time.monotonic() + 120
    while len(seen) < RECORDS and time.monotonic() < deadline:
        message = consumer.poll(1.0)
        if message is not None and message.error() is None:
            seen[message.offset()] = message.key()
    consumer.close()
    kc = kafka_python_consumer([topic_name], auto_offset_reset="earliest", consumer_timeout_ms=20_000, group_id=f"sasl-kp-{mechanism}", **kafka_sasl)
    kafka_python_seen = {}
    for message in kc:
        kafka_python_seen[message.offset] = message.key
        if len(kafka_python_seen) == RECORDS:
            break
    kc.close()
    assert seen == kafka_python_seen and len(seen) == RECORDS
    after = authentications(sasl_gateway)
    assert after["by_mechanism"].get(mechanism, 0) > before["by_mechanism"].get(mechanism, 0) and after["failed"] == before["failed"]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_aiokafka_authenticates_with_sasl_ssl_produces_and_consumes_and_a_wrong_password_is_refused(bus, sasl_gateway, authority, topic_name, mechanism):
    import asyncio

    import aiokafka
    import aiokafka.errors
    from aiokafka.helpers import create_ssl_context

    bus.admin.create_topic(topic_name, partitions=1)

    def settings(password: str) -> dict:
        return {"bootstrap_servers": sasl_gateway.bootstrap_servers, "security_protocol": "SASL_SSL",
                "ssl_context": create_ssl_context(cafile=authority.cafile), "sasl_mechanism": mechanism,
                "sasl_plain_username": "alice", "sasl_plain_password": password, "request_timeout_ms": 10_000}

    async def main() -> list:
        producer = aiokafka.AIOKafkaProducer(acks="all", **settings("alice-secret"))
        await producer.start()
        try:
            for i in range(RECORDS):
                await producer.send(topic_name, key=b"ak-%d" % i, value=b"v")
            await producer.flush()
        finally:
            await producer.stop()
        consumer = aiokafka.AIOKafkaConsumer(topic_name, group_id=f"aiokafka-{mechanism}", auto_offset_reset="earliest", **settings("alice-secret"))
        await consumer.start()
        seen = {}
        try:
            while len(seen) < RECORDS:
                batches = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 60)
                for records in batches.values():
                    seen.update((r.offset, r.key) for r in records)
        finally:
            await consumer.stop()
        refused = aiokafka.AIOKafkaProducer(**settings("not-her-password"))
        with pytest.raises((aiokafka.errors.KafkaConnectionError, aiokafka.errors.KafkaError)):
            await refused.start()
        await refused.stop()
        return sorted(seen.values())

    before = authentications(sasl_gateway)
    assert asyncio.run(main()) == sorted(b"ak-%d" % i for i in range(RECORDS))
    after = authentications(sasl_gateway)
    assert after["by_mechanism"].get(mechanism, 0) > before["by_mechanism"].get(mechanism, 0)
    assert after["failed"] > before["failed"]


@pytest.mark.parametrize("user, password", [("alice", "not-her-password"), ("nobody", "alice-secret")])
def test_a_wrong_password_or_an_unknown_user_is_refused_as_clients_report_it(bus, sasl_gateway, authority, user, password, caplog):
    import confluent_kafka as ck
    import kafka
    import kafka.errors

    # kafka-python first: its first attempt is answered before the failure throttle slows this address.
    # kafka-python 3.0 logs each refusal (Kafka's SASL_AUTHENTICATION_FAILED, error 58) and gives up at its bootstrap timeout.
    with pytest.raises((kafka.errors.SaslAuthenticationFailedError, kafka.errors.KafkaTimeoutError)):
        kafka.KafkaAdminClient(bootstrap_servers=sasl_gateway.bootstrap_servers, security_protocol="SASL_SSL", ssl_cafile=authority.cafile,
                               sasl_mechanism="SCRAM-SHA-256", sasl_plain_username=user, sasl_plain_password=password,
                               request_timeout_ms=10_000, bootstrap_timeout_ms=5_000)
    assert any("SaslAuthenticationFailedError" in r.getMessage() for r in caplog.records if r.name.startswith("kafka"))
    errors = []
    admin = ck.admin.AdminClient(confluent_sasl(sasl_gateway, authority, "SCRAM-SHA-512", user, password, error_cb=errors.append))
    try:
        reported(admin, errors, (ck.KafkaError._AUTHENTICATION,), "invalid credentials")
        with pytest.raises(ck.KafkaException):
            admin.list_topics(timeout=2)
    finally:
        del admin  # its librdkafka threads end with the object; a kept reference reconnects for the rest of the run
    wait_for(lambda: authentications(sasl_gateway)["failed"] >= 2, timeout_s=30, message="the failures counted")
    assert authentications(sasl_gateway)["addresses_throttled"] == 1
    # and the gateway serves the right password on
    good = ck.admin.AdminClient(confluent_sasl(sasl_gateway, authority, "SCRAM-SHA-512", "alice", "alice-secret"))
    try:
        assert sasl_gateway.brokers[0][2] in good.list_topics(timeout=30).brokers
    finally:
        del good


def test_a_deleted_user_can_no_longer_authenticate_and_credentials_are_never_shown(bus, sasl_gateway, authority):
    import confluent_kafka as ck

    bus.admin.create_scram_user("carol", "carol-secret")
    assert bus.admin.list_scram_users()["carol"] == {"SCRAM-SHA-512": 4096}
    assert "carol-secret" not in repr(bus.admin.list_scram_users())
    ok = ck.admin.AdminClient(confluent_sasl(sasl_gateway, authority, "SCRAM-SHA-512", "carol", "carol-secret"))
    assert sasl_gateway.brokers[0][2] in ok.list_topics(timeout=30).brokers
    assert bus.admin.delete_scram_user("carol") and not bus.admin.delete_scram_user("carol")
    errors = []
    refused = ck.admin.AdminClient(confluent_sasl(sasl_gateway, authority, "SCRAM-SHA-512", "carol", "carol-secret", error_cb=errors.append))
    try:
        reported(refused, errors, (ck.KafkaError._AUTHENTICATION,))
        with pytest.raises(ck.KafkaException):
            refused.list_topics(timeout=2)
    finally:
        del refused, ok  # (their librdkafka threads end with them)


def test_bad_sasl_frames_cost_their_connection_and_the_gateway_serves_others(bus, sasl_gateway, authority):
    context = client_context(authority.cafile)
    rng = random.Random(32)
    for round_ in range(30):
        raw = TlsRaw(sasl_gateway, context)
        try:
            kind = round_ % 5
            if kind == 0:  # a request before authentication
                raw.call(kg.METADATA, 12, {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
            elif kind == 1:  # a mechanism not offered, then more
                reply = raw.call(17, 1, {"mechanism": "GSSAPI"})
                assert reply.error_code == kg.ErrorCode.unsupported_sasl_mechanism
                raw.call(17, 1, {"mechanism": "PLAIN"})
            elif kind == 2:  # over the unauthenticated size bound
                raw.send_frame(b"\0" * (600 * 1024))
                raw.receive(18, 3, 1)
            elif kind == 3:  # truncated
                raw.sock.sendall(struct.pack(">i", 100) + bytes(rng.randrange(256) for _ in range(rng.randrange(60))))
                continue  # and gone: the gateway reads to the end of the connection, and lets it go
            else:  # random SCRAM tokens
                assert raw.call(17, 1, {"mechanism": "SCRAM-SHA-512"}).error_code == kg.ErrorCode.none
                reply = raw.call(36, 2, {"auth_bytes": bytes(rng.randrange(256) for _ in range(rng.randrange(200)))})
                assert reply.error_code == kg.ErrorCode.sasl_authentication_failed
                raw.call(36, 2, {"auth_bytes": b"again"})
            raise AssertionError("the gateway answered a bad SASL exchange to its end")
        except (ConnectionError, ssl.SSLError, OSError):
            pass
        finally:
            raw.close()
    good = TlsRaw(sasl_gateway, context)
    assert api_versions(good).error_code == kg.ErrorCode.none
    keys = {k.api_key: (k.min_version, k.max_version) for k in api_versions(good).api_keys}
    assert keys[17] == (1, 1) and keys[36] == (0, 2)
    good.close()
    import confluent_kafka as ck

    ok = ck.admin.AdminClient(confluent_sasl(sasl_gateway, authority, "SCRAM-SHA-256", "alice", "alice-secret"))
    assert sasl_gateway.brokers[0][2] in ok.list_topics(timeout=30).brokers
