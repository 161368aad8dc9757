"""Which ACL each Kafka request needs, and what a refusal answers: kafka_authz without Ray or sockets.

Requests are kio's messages built as clients send them; replies are encoded
in the request's version (a refusal that does not fit its version's reply
fails here), and the handler runs on real partition logs (LogBackend).
"""

from __future__ import annotations

import asyncio

import pytest

from logbus.protocol import kafka_authz as az
from logbus.protocol import kafka_gateway as kg
from logbus.protocol.acl import AclBinding, Authorizer
from logbus.protocol.kafka_messages import Request, build, encode_response, request_class
from tests.protocol.log_backend import LogBackend
from tests.protocol.test_kafka_gateway import kio_frame, kio_response, produce_values
from tests.protocol.test_kafka_records import kafka_batch

ALICE = "User:alice"
E = kg.ErrorCode


def acl(resource_type: str, name: str, operation: str, permission: str = "allow", pattern: str = "literal", principal: str = ALICE):
    return AclBinding.of({"principal": principal, "resource_type": resource_type, "name": name, "operation": operation,
                          "permission": permission, "pattern": pattern})


def access(*bindings, principal: str = ALICE, super_users=()) -> az.Access:
    return az.Access(Authorizer(bindings, super_users=super_users), principal, "10.0.0.7")


def request(api_key: int, version: int, values: dict) -> Request:
    return Request(api_key, version, 1, "test", build(request_class(api_key, version), values))


def reply(req: Request, decision: az.Decision, values: dict | None = None):
    """The decision's reply as the client reads it: the whole reply, or the handler's ``values`` patched."""
    out = decision.reply if decision.request is None else decision.finish(values or {})
    return kio_response(req.api_key, req.api_version, encode_response(req.api_key, req.api_version, 1, out))


def test_every_api_served_has_a_rule():
    assert set(kg.API_VERSIONS_SERVED) <= set(az.RULES)


def test_produce_needs_write_per_topic_and_transactional_write_for_a_transaction():
    reader = access(acl("topic", "orders", "read"), acl("topic", "logs-", "write", pattern="prefixed"))
    values = {"transactional_id": None, "acks": -1, "timeout": 1000, "topic_data": [
        {"name": "orders", "partition_data": [{"index": 0, "records": b""}]}, {"name": "logs-app", "partition_data": [{"index": 1, "records": b""}]}]}
    req = request(kg.PRODUCE, 9, values)
    decision = az.authorize(reader, req)
    assert [t.name for t in decision.request.body.topic_data] == ["logs-app"]
    body = reply(req, decision)
    assert [(t.name, [(p.index, p.error_code) for p in t.partition_responses]) for t in body.responses] == [("orders", [(0, E.topic_authorization_failed)])]
    txn = request(kg.PRODUCE, 9, {**values, "transactional_id": "tx-1"})
    decision = az.authorize(reader, txn)
    assert decision.request is None
    assert {p.error_code for t in reply(txn, decision).responses for p in t.partition_responses} == {E.transactional_id_authorization_failed}
    writer = access(acl("topic", "*", "write"), acl("transactional_id", "tx-", "write", pattern="prefixed"))
    assert az.authorize(writer, txn).request is txn


@pytest.mark.parametrize("version", [4, 12])
def test_fetch_needs_read_and_a_write_alone_does_not_grant_it(version):
    req = request(kg.FETCH, version, {"replica_id": -1, "max_wait": 500, "min_bytes": 1, "topics": [
        {"topic": "orders", "partitions": [{"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1024}]},
        {"topic": "audit", "partitions": [{"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1024}]}]})
    decision = az.authorize(access(acl("topic", "orders", "read"), acl("topic", "audit", "write")), req)
    assert [t.topic for t in decision.request.body.topics] == ["orders"]
    assert [(t.topic, t.partitions[0].error_code) for t in reply(req, decision).responses] == [("audit", E.topic_authorization_failed)]


def test_metadata_hides_what_may_not_be_described_and_refuses_it_by_name():
    who = access(acl("topic", "orders", "read"), acl("topic", "new-", "create", pattern="prefixed"), acl("topic", "new-", "describe", pattern="prefixed"))
    everything = request(kg.METADATA, 12, {"topics": None, "allow_auto_topic_creation": True})
    decision = az.authorize(who, everything)
    listed = {"topics": [{"name": n, "error_code": 0, "partitions": []} for n in ("orders", "payments", "new-x")]}
    assert [t.name for t in reply(everything, decision, listed).topics] == ["orders", "new-x"]
    named = request(kg.METADATA, 12, {"topics": [{"name": "payments"}, {"name": "orders"}], "allow_auto_topic_creation": True})
    decision = az.authorize(who, named)
    assert [t.name for t in decision.request.body.topics] == ["orders"]
    body = reply(named, decision, {"topics": [{"name": "orders", "error_code": 0, "partitions": []}]})
    assert [(t.name, t.error_code) for t in body.topics] == [("orders", E.none), ("payments", E.topic_authorization_failed)]
    assert decision.may_create("new-y") and not decision.may_create("orders2")
    # v0 reads an empty topic list as every topic: a v0 request whose topics are all refused lists none it may see.
    refused_v0 = request(kg.METADATA, 0, {"topics": [{"name": "payments"}]})
    decision = az.authorize(who, refused_v0)
    body = reply(refused_v0, decision, {"topics": [{"name": n, "error_code": 0, "partitions": []} for n in ("orders", "new-x")]})
    assert [(t.name, t.error_code) for t in body.topics] == [("payments", E.topic_authorization_failed)]
    assert access(acl("cluster", "kafka-cluster", "create")).authorizer.authorize(ALICE, "h", az.Operation.create, az.CLUSTER, "kafka-cluster")


def test_group_apis_need_the_group_and_commits_the_topics_too():
    who = access(acl("group", "billing", "read"), acl("topic", "orders", "read"))
    join = request(kg.JOIN_GROUP, 7, {"group_id": "other", "session_timeout": 10_000, "rebalance_timeout": 10_000, "member_id": "",
                                      "protocol_type": "consumer", "protocols": [{"name": "range", "metadata": b""}]})
    assert reply(join, az.authorize(who, join)).error_code == E.group_authorization_failed
    assert az.authorize(who, request(kg.JOIN_GROUP, 7, {**{"group_id": "billing"}, "protocol_type": "consumer"})).request is not None
    commit_values = {"group_id": "billing", "generation_id_or_member_epoch": 1, "member_id": "m", "topics": [
        {"name": "orders", "partitions": [{"partition_index": 0, "committed_offset": 5}]},
        {"name": "payments", "partitions": [{"partition_index": 0, "committed_offset": 5}, {"partition_index": 1, "committed_offset": 5}]}]}
    commit = request(kg.OFFSET_COMMIT, 8, commit_values)
    decision = az.authorize(who, commit)
    assert [t.name for t in decision.request.body.topics] == ["orders"]
    assert [(t.name, [p.error_code for p in t.partitions]) for t in reply(commit, decision).topics] == [
        ("payments", [E.topic_authorization_failed] * 2)]
    other = request(kg.OFFSET_COMMIT, 8, {**commit_values, "group_id": "other"})
    assert {p.error_code for t in reply(other, az.authorize(who, other)).topics for p in t.partitions} == {E.group_authorization_failed}
    for version in (1, 7):  # version 1 has no error at its top: each partition says it
        fetch = request(kg.OFFSET_FETCH, version, {"group_id": "other", "topics": [{"name": "orders", "partition_indexes": [0]}]})
        body = reply(fetch, az.authorize(who, fetch))
        assert (body.topics[0].partitions[0].error_code if version == 1 else body.error_code) == E.group_authorization_failed


@pytest.mark.parametrize("version", [3, 4])
def test_find_coordinator_needs_describe_on_the_group_or_the_transactional_id(version):
    who = access(acl("group", "billing", "read"), acl("transactional_id", "tx", "write"))
    for key_type, allowed, refused, code in ((0, "billing", "other", E.group_authorization_failed),
                                             (1, "tx", "tx2", E.transactional_id_authorization_failed)):
        values = {"key_type": key_type, **({"coordinator_keys": [allowed, refused]} if version >= 4 else {"key": refused})}
        req = request(kg.FIND_COORDINATOR, version, values)
        decision = az.authorize(who, req)
        body = reply(req, decision)
        if version >= 4:
            assert list(decision.request.body.coordinator_keys) == [allowed]
            assert [(c.key, c.error_code) for c in body.coordinators] == [(refused, code)]
        else:
            assert body.error_code == code


def test_topic_administration_needs_create_delete_alter_and_configs():
    who = access(acl("topic", "team-", "create", pattern="prefixed"), acl("topic", "team-a", "delete"), acl("topic", "team-a", "alter_configs"))
    create = request(kg.CREATE_TOPICS, 7, {"topics": [{"name": "team-a", "num_partitions": 1, "replication_factor": 1},
                                                      {"name": "other", "num_partitions": 1, "replication_factor": 1}], "timeout": 1000})
    decision = az.authorize(who, create)
    assert [t.name for t in decision.request.body.topics] == ["team-a"]
    assert [(t.name, t.error_code) for t in reply(create, decision).topics] == [("other", E.topic_authorization_failed)]
    assert az.authorize(access(acl("cluster", "kafka-cluster", "create")), create).request is create
    for version in (1, 6):
        values = {"topic_names": ["team-a", "team-b"]} if version < 6 else {"topics": [{"name": "team-a"}, {"name": "team-b"}]}
        delete = request(kg.DELETE_TOPICS, version, {**values, "timeout": 1000})
        assert [(r.name, r.error_code) for r in reply(delete, az.authorize(who, delete)).responses] == [("team-b", E.topic_authorization_failed)]
    describe = request(kg.DESCRIBE_CONFIGS, 4, {"resources": [{"resource_type": 2, "resource_name": "team-a", "configuration_keys": None},
                                                              {"resource_type": 4, "resource_name": "0", "configuration_keys": None}]})
    decision = az.authorize(who, describe)  # describe_configs is implied by alter_configs
    assert [r.resource_name for r in decision.request.body.resources] == ["team-a"]
    assert [(r.resource_name, r.error_code) for r in reply(describe, decision).results] == [("0", E.cluster_authorization_failed)]
    partitions = request(kg.CREATE_PARTITIONS, 3, {"topics": [{"name": "team-a", "count": 2, "assignments": None}], "timeout": 1000})
    assert [(r.name, r.error_code) for r in reply(partitions, az.authorize(who, partitions)).results] == [("team-a", E.topic_authorization_failed)]


def test_producer_ids_and_transactions():
    writer = access(acl("topic", "orders", "write"))
    idempotent = request(kg.INIT_PRODUCER_ID, 4, {"transactional_id": None, "transaction_timeout": 60_000})
    assert az.authorize(writer, idempotent).request is idempotent  # WRITE on some topic is enough (KIP-679)
    assert reply(idempotent, az.authorize(access(acl("topic", "orders", "read")), idempotent)).error_code == E.cluster_authorization_failed
    denied_everywhere = access(acl("topic", "orders", "write"), acl("topic", "*", "write", permission="deny"))
    assert az.authorize(denied_everywhere, idempotent).request is None
    txn = request(kg.INIT_PRODUCER_ID, 4, {"transactional_id": "tx", "transaction_timeout": 60_000})
    assert reply(txn, az.authorize(writer, txn)).error_code == E.transactional_id_authorization_failed
    who = access(acl("topic", "orders", "write"), acl("transactional_id", "tx", "write"))
    add = request(kg.ADD_PARTITIONS_TO_TXN, 3, {"v3_and_below_transactional_id": "tx", "v3_and_below_producer_id": 1, "v3_and_below_producer_epoch": 0,
                                                "v3_and_below_topics": [{"name": "orders", "partitions": [0]}, {"name": "audit", "partitions": [0]}]})
    body = reply(add, az.authorize(who, add))
    assert {t.name: t.results_by_partition[0].partition_error_code for t in body.results_by_topic_v3_and_below} == {
        "orders": E.operation_not_attempted, "audit": E.topic_authorization_failed}
    offsets = request(kg.ADD_OFFSETS_TO_TXN, 3, {"transactional_id": "tx", "producer_id": 1, "producer_epoch": 0, "group_id": "g"})
    assert reply(offsets, az.authorize(who, offsets)).error_code == E.group_authorization_failed
    end = request(kg.END_TXN, 3, {"transactional_id": "tx2", "producer_id": 1, "producer_epoch": 0, "committed": True})
    assert reply(end, az.authorize(who, end)).error_code == E.transactional_id_authorization_failed


def test_cluster_apis_and_super_users():
    create = request(kg.CREATE_ACLS, 1, {"creations": [{"resource_type": 2, "resource_name": "t", "resource_pattern_type": 3, "principal": ALICE,
                                                         "host": "*", "operation": 3, "permission_type": 3}]})
    nobody = access(acl("topic", "*", "all"))
    assert [r.error_code for r in reply(create, az.authorize(nobody, create)).results] == [E.cluster_authorization_failed]
    describe = request(kg.DESCRIBE_ACLS, 1, {"resource_type_filter": 1, "pattern_type_filter": 1, "operation": 1, "permission_type": 1})
    assert reply(describe, az.authorize(nobody, describe)).error_code == E.cluster_authorization_failed
    assert az.authorize(access(acl("cluster", "kafka-cluster", "describe")), describe).request is describe
    assert az.authorize(access(super_users=[ALICE]), create).request is create
    groups = request(kg.LIST_GROUPS, 4, {"states_filter": []})
    decision = az.authorize(access(acl("group", "billing", "describe")), groups)
    listed = {"groups": [{"group_id": g, "protocol_type": "consumer", "group_state": "Stable"} for g in ("billing", "other")]}
    assert [g.group_id for g in reply(groups, decision, listed).groups] == ["billing"]


def test_the_handler_refuses_before_anything_reaches_a_log(tmp_path):
    logs = LogBackend(str(tmp_path))
    try:
        logs.create_topic("orders")
        logs.create_topic("payments")
        handler = kg.KafkaHandler(logs)
        handler.authorizer = Authorizer([acl("topic", "orders", "write")])
        batch = kafka_batch([(b"k", b"v", 1_700_000_000_000, [])])

        async def produce(topic: str, principal: str) -> int:
            frame = await handler.start(kio_frame(kg.PRODUCE, 9, produce_values(topic, {0: batch})), principal=principal)
            return kio_response(kg.PRODUCE, 9, frame).responses[0].partition_responses[0].error_code

        assert asyncio.run(produce("orders", ALICE)) == E.none
        assert asyncio.run(produce("payments", ALICE)) == E.topic_authorization_failed
        assert asyncio.run(produce("orders", "User:bob")) == E.topic_authorization_failed
        assert logs.logs[("orders", 0)].log_end_offset == 1 and logs.logs[("payments", 0)].log_end_offset == 0
        # Without an authorizer (ACLs off) the ACL APIs say so, as a Kafka broker without one.
        plain = kg.KafkaHandler(logs)
        frame = asyncio.run(plain.start(kio_frame(kg.DESCRIBE_ACLS, 1, {"resource_type_filter": 1, "pattern_type_filter": 1, "operation": 1,
                                                                          "permission_type": 1})))
        assert kio_response(kg.DESCRIBE_ACLS, 1, frame).error_code == E.security_disabled
        # ... and nobody may change SCRAM credentials through it (any client could take over another's login).
        alter = {"deletions": [], "upsertions": [{"name": "admin", "mechanism": 2, "iterations": 8192, "salt": b"s", "salted_password": b"p"}]}
        frame = asyncio.run(plain.start(kio_frame(kg.ALTER_USER_SCRAM_CREDENTIALS, 0, alter), principal="User:bob"))
        assert [(r.user, r.error_code) for r in kio_response(kg.ALTER_USER_SCRAM_CREDENTIALS, 0, frame).results] == [
            ("admin", E.cluster_authorization_failed)]
    finally:
        logs.close()


def test_scram_credential_apis_refuse_each_user_named_as_kafka_does():
    # A reply with a result per user named (librdkafka matches its per-user futures to them).
    alice, admin = access(acl("topic", "t", "read")), access(acl("cluster", "kafka-cluster", "all"))
    describe = request(kg.DESCRIBE_USER_SCRAM_CREDENTIALS, 0, {"users": [{"name": "dave"}, {"name": "erin"}]})
    assert az.authorize(admin, describe).request is describe
    body = reply(describe, az.authorize(alice, describe))
    assert body.error_code == E.cluster_authorization_failed
    assert [(r.user, r.error_code) for r in body.results] == [("dave", E.cluster_authorization_failed), ("erin", E.cluster_authorization_failed)]
    alter = request(kg.ALTER_USER_SCRAM_CREDENTIALS, 0, {"deletions": [{"name": "dave", "mechanism": 2}], "upsertions": [
        {"name": "erin", "mechanism": 2, "iterations": 8192, "salt": b"s", "salted_password": b"p"}]})
    assert az.authorize(admin, alter).request is alter
    body = reply(alter, az.authorize(alice, alter))
    assert [(r.user, r.error_code) for r in body.results] == [("dave", E.cluster_authorization_failed), ("erin", E.cluster_authorization_failed)]
