"""Kafka's and logbus's ACL and SCRAM admin APIs through a SASL_SSL gateway (fixtures and helpers: test_gateway_acls.py)."""

from __future__ import annotations

import confluent_kafka as ck
import confluent_kafka.admin as cka
import pytest

import logbus
from logbus.errors import InvalidConfigError
from tests.actors.test_gateway_acls import acl_gateway, config, error_of, produce  # noqa: F401 (fixtures)
from tests.actors.test_gateway_security import authority, server_cert  # noqa: F401 (fixtures)
from tests.api.test_restart import kill_controller

# ACLs and users stay on a cluster (no test deletes them): this module shares a cluster of its own.
pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster_of_its_own]


def kafka_python_describe_error(gateway, authority, user: str) -> str | None:  # noqa: F811
    """The error kafka-python's describe_acls raises for ``user`` (its class name), or None."""
    import kafka
    import kafka.errors
    from kafka.admin import ACLFilter, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePatternFilter, ResourceType

    admin = kafka.KafkaAdminClient(bootstrap_servers=gateway.bootstrap_servers, security_protocol="SASL_SSL", ssl_cafile=authority.cafile,
                                   sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=user, sasl_plain_password=f"{user}-secret")
    try:
        every = ACLFilter(principal=None, host="*", operation=ACLOperation.ANY, permission_type=ACLPermissionType.ANY,
                          resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY))
        try:
            admin.describe_acls(every)
        except kafka.errors.BrokerResponseError as raised:
            return type(raised).__name__
        return None
    finally:
        admin.close()


def kafka_python_scram_describe_error(gateway, authority, user: str, about: str) -> str | None:  # noqa: F811
    """The error kafka-python's describe_user_scram_credentials raises for ``user`` (its class name), or None."""
    import kafka
    import kafka.errors

    admin = kafka.KafkaAdminClient(bootstrap_servers=gateway.bootstrap_servers, security_protocol="SASL_SSL", ssl_cafile=authority.cafile,
                                   sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=user, sasl_plain_password=f"{user}-secret")
    try:
        admin.describe_user_scram_credentials([about])
    except kafka.errors.BrokerResponseError as raised:
        return type(raised).__name__
    finally:
        admin.close()
    return None


def test_confluent_kafkas_admin_client_creates_describes_and_deletes_acls(bus, acl_gateway, authority, topic_name):  # noqa: F811
    binding = cka.AclBinding(cka.ResourceType.TOPIC, topic_name, cka.ResourcePatternType.PREFIXED, "User:alice", "*",
                             cka.AclOperation.READ, cka.AclPermissionType.ALLOW)
    admin = cka.AdminClient(config(acl_gateway, authority, "admin"))
    alice = cka.AdminClient(config(acl_gateway, authority, "alice"))
    try:
        admin.create_acls([binding])[binding].result(timeout=30)
        assert bus.admin.describe_acls({"principal": "User:alice"}) == [
            logbus.AclBinding("User:alice", "topic", topic_name, pattern="prefixed", operation="read")]
        every = cka.AclBindingFilter(cka.ResourceType.ANY, None, cka.ResourcePatternType.ANY, None, None, cka.AclOperation.ANY,
                                     cka.AclPermissionType.ANY)
        assert admin.describe_acls(every).result(timeout=30) == [binding]
        # alice may not touch the ACLs: ALTER and DESCRIBE on the cluster are needed. librdkafka drops
        # DescribeAcls' error code (its reply reads as an empty list); kafka-python reports it.
        assert alice.describe_acls(every).result(timeout=30) == []
        assert kafka_python_describe_error(acl_gateway, authority, "alice") == "ClusterAuthorizationFailedError"
        assert kafka_python_describe_error(acl_gateway, authority, "admin") is None
        assert error_of(alice.create_acls([binding])[binding]) == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED
        deleted = admin.delete_acls([every])[every].result(timeout=30)
        assert deleted == [binding] and bus.admin.describe_acls() == []
    finally:
        del admin, alice


def test_logbus_admin_acls_round_trip_refuse_bad_bindings_and_survive_a_controller_restart(bus, acl_gateway, authority, topic_name):  # noqa: F811
    with pytest.raises(InvalidConfigError, match="operation"):
        bus.admin.create_acls({"principal": "User:alice", "resource_type": "topic", "name": topic_name, "operation": "fly"})
    with pytest.raises(InvalidConfigError, match="principal"):
        bus.admin.create_acls([{"principal": "alice", "resource_type": "topic", "name": topic_name}])
    assert bus.admin.describe_acls() == []  # nothing of a refused call is stored
    bindings = [logbus.AclBinding("User:alice", "topic", topic_name, operation="write"),
                logbus.AclBinding("User:alice", "group", "g-", pattern="prefixed", operation="read")]
    assert bus.admin.create_acls(bindings) == 2 and bus.admin.create_acls(bindings[:1]) == 0
    assert bus.admin.describe_acls({"resource_type": "topic", "name": topic_name, "pattern": "match"}) == bindings[:1]
    bus.admin.create_topic(topic_name, partitions=1)
    kill_controller(bus)
    assert bus.admin.describe_acls() == bindings
    assert produce(acl_gateway, authority, "alice", topic_name, 2) == [None, None]
    assert bus.admin.delete_acls([{"resource_type": "group"}, {"resource_type": "group"}]) == [bindings[1:], []]
    assert bus.admin.describe_acls() == bindings[:1]


def test_scram_credentials_through_confluent_kafkas_admin_client(bus, acl_gateway, authority):  # noqa: F811
    admin = cka.AdminClient(config(acl_gateway, authority, "admin"))
    alice = cka.AdminClient(config(acl_gateway, authority, "alice"))
    try:
        info = cka.ScramCredentialInfo(cka.ScramMechanism.SCRAM_SHA_512, 8192)
        upsert = cka.UserScramCredentialUpsertion("dave", info, b"dave-secret")
        admin.alter_user_scram_credentials([upsert])["dave"].result(timeout=30)
        assert bus.admin.list_scram_users()["dave"] == {"SCRAM-SHA-512": 8192}
        described = admin.describe_user_scram_credentials(["dave"])["dave"].result(timeout=30)
        assert [(c.mechanism, c.iterations) for c in described.scram_credential_infos] == [(cka.ScramMechanism.SCRAM_SHA_512, 8192)]
        # the credential made from the client's salted password lets dave in (he may see no topic: no ACL names him)
        dave = cka.AdminClient(config(acl_gateway, authority, "dave"))
        try:
            assert acl_gateway.brokers[0][2] in dave.list_topics(timeout=30).brokers
        finally:
            del dave
        # alice may not read credentials' descriptions. Checked with kafka-python: confluent-kafka 2.16.1
        # frees memory twice after handling this refusal (the process aborts: munmap_chunk).
        assert kafka_python_scram_describe_error(acl_gateway, authority, "alice", "dave") == "ClusterAuthorizationFailedError"
        deletion = cka.UserScramCredentialDeletion("dave", cka.ScramMechanism.SCRAM_SHA_512)
        admin.alter_user_scram_credentials([deletion])["dave"].result(timeout=30)
        assert "dave" not in bus.admin.list_scram_users()
        assert error_of(admin.alter_user_scram_credentials([deletion])["dave"]) == ck.KafkaError.RESOURCE_NOT_FOUND
    finally:
        del admin, alice
