"""ACLs at the Kafka gateway, over SASL_SSL, with confluent-kafka as the client: what a principal may do, what it is refused
and how the client reports it, prefixed bindings, a deny over an allow, super users, metadata hiding, Kafka's ACL admin
APIs and logbus's, and ACLs kept across a controller restart.

Each test starts a SASL_SSL gateway (certificates from a CA made here; fixtures of test_gateway_security.py) with
``User:admin`` as its super user, and users alice and admin.
"""

from __future__ import annotations

import time

import confluent_kafka as ck
import confluent_kafka.admin as cka
import pytest

import logbus
from logbus.errors import InvalidConfigError
from tests.actors.test_gateway_security import authority, confluent_sasl, server_cert, start  # noqa: F401 (fixtures)
from tests.api.test_restart import kill_controller
from tests.conftest import wait_for

# ACLs and users stay on a cluster (no test deletes them): this module shares a cluster of its own.
pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster_of_its_own]

SHORT = {"socket.timeout.ms": 10_000, "message.timeout.ms": 10_000, "request.timeout.ms": 10_000}


@pytest.fixture
def acl_gateway(bus, server_cert):  # noqa: F811
    gateway = start(bus, ssl_certfile=server_cert.certfile, ssl_keyfile=server_cert.keyfile, sasl_mechanisms=("SCRAM-SHA-512",),
                    super_users=("User:admin",))
    bus.admin.create_scram_user("alice", "alice-secret")
    bus.admin.create_scram_user("admin", "admin-secret")
    yield gateway
    gateway.stop()
    bus.admin.delete_acls(None)
    bus.admin.delete_scram_user("alice")
    bus.admin.delete_scram_user("admin")


def config(gateway, authority, user: str, **extra) -> dict:  # noqa: F811
    return confluent_sasl(gateway, authority, "SCRAM-SHA-512", user, f"{user}-secret", **SHORT, **extra)


def produce(gateway, authority, user: str, topic: str, count: int = 1) -> list:  # noqa: F811
    """Produce ``count`` records as ``user``; the delivery errors (None for each one delivered)."""
    outcomes = []
    producer = ck.Producer(config(gateway, authority, user, acks="all"))
    try:
        for i in range(count):
            producer.produce(topic, value=b"v%d" % i, on_delivery=lambda error, _message: outcomes.append(error))
        producer.flush(30)
    finally:
        del producer
    return outcomes


def consumer_error(consumer, codes) -> ck.KafkaError:
    """The first error of ``codes`` the consumer reports through poll."""
    found = []

    def seen() -> bool:
        message = consumer.poll(0.2)
        if message is not None and message.error() is not None and message.error().code() in codes:
            found.append(message.error())
        return bool(found)

    wait_for(seen, timeout_s=60, message=f"the consumer reporting one of {codes}")
    return found[0]


def read(consumer, count: int) -> list[bytes]:
    values = []
    deadline = time.monotonic() + 60
    while len(values) < count and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and message.error() is None:
            values.append(message.value())
    return values


def error_of(future) -> int:
    with pytest.raises(ck.KafkaException) as raised:
        future.result(timeout=30)
    return raised.value.args[0].code()


def names(gateway, authority, user: str) -> set[str]:  # noqa: F811
    admin = cka.AdminClient(config(gateway, authority, user))
    try:
        return set(admin.list_topics(timeout=30).topics)
    finally:
        del admin


def test_a_reader_of_one_topic_and_group_reads_it_and_is_refused_everything_else(bus, acl_gateway, authority, topic_name):  # noqa: F811
    other = topic_name + "-other"
    bus.admin.create_topic(topic_name, partitions=1)
    bus.admin.create_topic(other, partitions=1)
    bus.admin.create_acls([{"principal": "User:alice", "resource_type": "topic", "name": topic_name, "operation": "read"},
                           logbus.AclBinding("User:alice", "group", "readers", operation="read")])
    assert produce(acl_gateway, authority, "admin", topic_name, 5) == [None] * 5  # a super user needs no ACL

    reader = ck.Consumer(config(acl_gateway, authority, "alice", **{"group.id": "readers", "auto.offset.reset": "earliest"}))
    try:
        reader.subscribe([topic_name])
        assert read(reader, 5) == [b"v%d" % i for i in range(5)]
        reader.commit(asynchronous=False)
    finally:
        reader.close()
        del reader

    # producing: refused per record, as the client reports it
    assert {e.code() for e in produce(acl_gateway, authority, "alice", topic_name)} == {ck.KafkaError.TOPIC_AUTHORIZATION_FAILED}
    # another topic: refused, and hidden from the list of every topic
    refused = ck.Consumer(config(acl_gateway, authority, "alice", **{"group.id": "readers", "auto.offset.reset": "earliest"}))
    try:
        refused.subscribe([other])
        assert consumer_error(refused, (ck.KafkaError.TOPIC_AUTHORIZATION_FAILED,)).code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        refused.close()
        del refused
    visible = names(acl_gateway, authority, "alice")
    assert topic_name in visible and other not in visible
    assert {topic_name, other} <= names(acl_gateway, authority, "admin")
    # another group: refused
    stranger = ck.Consumer(config(acl_gateway, authority, "alice", **{"group.id": "strangers", "auto.offset.reset": "earliest"}))
    try:
        stranger.subscribe([topic_name])
        consumer_error(stranger, (ck.KafkaError.GROUP_AUTHORIZATION_FAILED,))
    finally:
        stranger.close()
        del stranger
    # creating and deleting topics: refused
    admin = cka.AdminClient(config(acl_gateway, authority, "alice"))
    try:
        [created] = admin.create_topics([cka.NewTopic(topic_name + "-new", 1, 1)], operation_timeout=10).values()
        assert error_of(created) == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED
        [deleted] = admin.delete_topics([topic_name], operation_timeout=10).values()
        assert error_of(deleted) == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        del admin
    assert topic_name in bus.admin.list_topics() and topic_name + "-new" not in bus.admin.list_topics()
    assert bus.admin.describe_group("readers")["offsets"][0]["current_offset"] == 5  # alice's commit went through


def test_a_prefixed_allow_a_deny_over_it_and_the_deny_lifted(bus, acl_gateway, authority, topic_name):  # noqa: F811
    team, secret = topic_name + "-team-a", topic_name + "-team-secret"
    for name in (team, secret):
        bus.admin.create_topic(name, partitions=1)
    bus.admin.create_acls([{"principal": "User:alice", "resource_type": "topic", "name": topic_name + "-team-", "pattern": "prefixed",
                            "operation": "write"},
                           {"principal": "User:alice", "resource_type": "topic", "name": secret, "operation": "write", "permission": "deny"}])
    assert produce(acl_gateway, authority, "alice", team, 3) == [None] * 3
    assert {e.code() for e in produce(acl_gateway, authority, "alice", secret)} == {ck.KafkaError.TOPIC_AUTHORIZATION_FAILED}
    # Lifting the deny takes effect at once (librdkafka keeps a refused topic's error in a producer: a new one sends).
    [deleted] = bus.admin.delete_acls({"principal": "User:alice", "permission": "deny"})
    assert [b.name for b in deleted] == [secret]
    assert produce(acl_gateway, authority, "alice", secret) == [None]
    assert bus.admin.describe_topic(secret).partitions[0].high_watermark == 1
