"""Which ACL each Kafka request needs, what a refusal answers, and Kafka's ACL APIs: sans-IO.

The Kafka gateway checks each request against the cluster's ACLs
(:class:`~logbus.protocol.acl.Authorizer`) before any of it reaches a
replica or a coordinator, as Kafka's broker does (its authorizer docs,
"Operations and Resources on Protocols"):

===============================================  ==========================================================
Produce                                          WRITE topic; WRITE transactional id when transactional
Fetch                                            READ topic
ListOffsets, OffsetForLeaderEpoch                DESCRIBE topic
Metadata                                         DESCRIBE topic; CREATE cluster or topic to auto-create
OffsetCommit                                     READ group, READ topic
OffsetFetch                                      DESCRIBE group, DESCRIBE topic
FindCoordinator                                  DESCRIBE group, or DESCRIBE transactional id
JoinGroup, SyncGroup, Heartbeat, LeaveGroup,     READ group
ConsumerGroupHeartbeat
DescribeGroups                                   DESCRIBE group
ListGroups                                       DESCRIBE cluster, else only the groups it may DESCRIBE
DeleteGroups                                     DELETE group
OffsetDelete                                     DELETE group, READ topic
CreateTopics                                     CREATE cluster, or CREATE topic
DeleteTopics, DeleteRecords                      DELETE topic
CreatePartitions                                 ALTER topic
DescribeConfigs                                  DESCRIBE_CONFIGS topic (or cluster, for broker configs)
AlterConfigs, IncrementalAlterConfigs            ALTER_CONFIGS topic (or cluster)
InitProducerId                                   WRITE transactional id; without one, IDEMPOTENT_WRITE
                                                 cluster or WRITE on some topic
AddPartitionsToTxn                               WRITE transactional id, WRITE topic
AddOffsetsToTxn                                  WRITE transactional id, READ group
EndTxn                                           WRITE transactional id
TxnOffsetCommit                                  WRITE transactional id, READ group, READ topic
ElectLeaders, CreateAcls, DeleteAcls,            ALTER cluster
AlterUserScramCredentials
DescribeLogDirs, DescribeAcls,                   DESCRIBE cluster
DescribeUserScramCredentials
ApiVersions, DescribeCluster                     nothing
===============================================  ==========================================================

A refusal carries Kafka's code where the reply has room for it: per topic
(or partition) TOPIC_AUTHORIZATION_FAILED, the others served as usual;
GROUP_AUTHORIZATION_FAILED, TRANSACTIONAL_ID_AUTHORIZATION_FAILED and
CLUSTER_AUTHORIZATION_FAILED for the whole request. A Metadata request for
every topic leaves out the topics the principal may not describe (naming
one gets TOPIC_AUTHORIZATION_FAILED, whether it exists or not).

:func:`authorize` turns a request into a :class:`Decision`: the request
with the refused parts taken out (for the handler), and how to put their
errors into the handler's reply; or the whole reply when nothing is left.
:class:`AclRequests` serves CreateAcls, DescribeAcls and DeleteAcls
(KIP-140) for :class:`~logbus.protocol.kafka_gateway.KafkaHandler`.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Callable

from kio.schema.errors import ErrorCode

from logbus import errors as e
from logbus.protocol.acl import CLUSTER_NAME, AclBinding, AclFilter, Authorizer, Operation, PatternType, Permission, ResourceType
from logbus.protocol.kafka_messages import UNKNOWN_AUTHORIZED_OPERATIONS, Request, error_values, get, response_class

# API keys (the same numbers as kafka_gateway's; not imported from it, which imports this module)
PRODUCE, FETCH, LIST_OFFSETS, METADATA = 0, 1, 2, 3
OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR, JOIN_GROUP, HEARTBEAT, LEAVE_GROUP, SYNC_GROUP = 8, 9, 10, 11, 12, 13, 14
DESCRIBE_GROUPS, LIST_GROUPS, API_VERSIONS, CREATE_TOPICS, DELETE_TOPICS, DELETE_RECORDS, INIT_PRODUCER_ID = 15, 16, 18, 19, 20, 21, 22
OFFSET_FOR_LEADER_EPOCH, ADD_PARTITIONS_TO_TXN, ADD_OFFSETS_TO_TXN, END_TXN, TXN_OFFSET_COMMIT = 23, 24, 25, 26, 28
DESCRIBE_ACLS, CREATE_ACLS, DELETE_ACLS = 29, 30, 31
DESCRIBE_CONFIGS, ALTER_CONFIGS, DESCRIBE_LOG_DIRS, CREATE_PARTITIONS = 32, 33, 35, 37
DELETE_GROUPS, ELECT_LEADERS, INCREMENTAL_ALTER_CONFIGS, OFFSET_DELETE = 42, 43, 44, 47
DESCRIBE_USER_SCRAM_CREDENTIALS, ALTER_USER_SCRAM_CREDENTIALS, DESCRIBE_CLUSTER, CONSUMER_GROUP_HEARTBEAT = 50, 51, 60, 68
ACL_API_VERSIONS = {DESCRIBE_ACLS: (1, 3), CREATE_ACLS: (1, 3), DELETE_ACLS: (1, 3)}  # v1 is what librdkafka and kafka-python send

ANONYMOUS = "User:ANONYMOUS"  # the principal of a connection that did not authenticate
TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID = ResourceType.topic, ResourceType.group, ResourceType.cluster, ResourceType.transactional_id
TOPIC_DENIED = ErrorCode.topic_authorization_failed
GROUP_DENIED = ErrorCode.group_authorization_failed
CLUSTER_DENIED = ErrorCode.cluster_authorization_failed
TXN_DENIED = ErrorCode.transactional_id_authorization_failed
RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4  # DescribeConfigs' resource types
_DENIED_CODES = {TOPIC: TOPIC_DENIED, GROUP: GROUP_DENIED, CLUSTER: CLUSTER_DENIED, TRANSACTIONAL_ID: TXN_DENIED}


def denied_message(resource_type: ResourceType, name: str) -> str:
    return f"not authorized to access {resource_type.name.replace('_', ' ')} {name!r}"


@dataclass(frozen=True)
class Access:
    """Who asks (principal, and the host it connects from) and the ACLs that decide."""

    authorizer: Authorizer
    principal: str = ANONYMOUS
    host: str = "*"

    def may(self, operation: Operation, resource_type: ResourceType, name: str = CLUSTER_NAME) -> bool:
        return self.authorizer.authorize(self.principal, self.host, operation, resource_type, name)

    def may_any(self, operation: Operation, resource_type: ResourceType) -> bool:
        return self.authorizer.authorize_any(self.principal, self.host, operation, resource_type)


@dataclass
class Decision:
    """What a request may do: ``request`` for the handler (its refused parts taken out) and ``patch``, which
    puts their errors into the handler's reply; or ``reply``, the whole answer, when nothing is left to serve.
    ``may_create`` (Metadata only): whether a topic may be auto-created."""

    request: Request | None
    reply: dict | None = None
    patch: Callable[[dict], dict] | None = None
    may_create: Callable[[str], bool] | None = None

    def finish(self, values: dict) -> dict:
        return self.patch(values) if self.patch is not None else values


def _allowed(request: Request) -> Decision:
    return Decision(request)


def _whole(reply: dict) -> Decision:
    return Decision(None, reply=reply)


def _refused(request: Request, code: ErrorCode, message: str) -> Decision:
    """The request's reply with ``code`` wherever it has an error code at its top (see ``error_values``)."""
    return _whole(error_values(response_class(request.api_key, request.api_version), code, message))


def _replace(request: Request, **fields) -> Request:
    return dataclasses.replace(request, body=dataclasses.replace(request.body, **fields))


def _append(key: str, entries: list) -> Callable[[dict], dict]:
    def patch(values: dict) -> dict:
        return {**values, key: list(values.get(key) or ()) + entries}
    return patch


def _split(items, allowed: Callable) -> tuple[list, list]:
    yes, no = [], []
    for item in items:
        (yes if allowed(item) else no).append(item)
    return yes, no


def _by_topic(request: Request, access: Access, operation: Operation, *, topics_field: str, topic_name: str, partitions_field: str,
              partition_index: Callable, reply_key: str, reply_name: str, reply_partitions: str, entry: Callable[[int], dict]) -> Decision:
    """The common shape: topics of partitions, refused per topic (TOPIC_AUTHORIZATION_FAILED per partition)."""
    topics = getattr(request.body, topics_field) or ()
    allowed, denied = _split(topics, lambda t: access.may(operation, TOPIC, getattr(t, topic_name)))
    if not denied:
        return _allowed(request)
    refused = [{reply_name: getattr(t, topic_name), reply_partitions: [entry(partition_index(p)) for p in getattr(t, partitions_field)]}
               for t in denied]
    return Decision(_replace(request, **{topics_field: tuple(allowed)}), patch=_append(reply_key, refused))


def _all_partitions(topics, topic_name: str, partitions_field: str, partition_index: Callable, entry: Callable[[int], dict],
                    reply_name: str = "name", reply_partitions: str = "partitions") -> list:
    return [{reply_name: getattr(t, topic_name), reply_partitions: [entry(partition_index(p)) for p in getattr(t, partitions_field)]}
            for t in topics or ()]


# --- the rules, per API -------------------------------------------------------------------------------------


def _produce_entry(code: ErrorCode, message: str) -> Callable[[int], dict]:
    return lambda index: {"index": index, "error_code": code, "base_offset": -1, "log_append_time": -1, "log_start_offset": -1,
                          "record_errors": [], "error_message": message}


def _produce(access: Access, request: Request) -> Decision:
    body = request.body
    transactional_id = get(body, "transactional_id")
    if transactional_id is not None and not access.may(Operation.write, TRANSACTIONAL_ID, transactional_id):
        entry = _produce_entry(TXN_DENIED, denied_message(TRANSACTIONAL_ID, transactional_id))
        return _whole({"throttle_time": 0, "responses": _all_partitions(body.topic_data, "name", "partition_data", lambda p: p.index, entry,
                                                                         reply_partitions="partition_responses")})
    return _by_topic(request, access, Operation.write, topics_field="topic_data", topic_name="name", partitions_field="partition_data",
                     partition_index=lambda p: p.index, reply_key="responses", reply_name="name", reply_partitions="partition_responses",
                     entry=_produce_entry(TOPIC_DENIED, "not authorized to write to the topic"))


def _fetch(access: Access, request: Request) -> Decision:
    return _by_topic(request, access, Operation.read, topics_field="topics", topic_name="topic", partitions_field="partitions",
                     partition_index=lambda p: p.partition, reply_key="responses", reply_name="topic", reply_partitions="partitions",
                     entry=lambda i: {"partition_index": i, "error_code": TOPIC_DENIED, "high_watermark": -1, "last_stable_offset": -1,
                                      "log_start_offset": -1, "aborted_transactions": [], "preferred_read_replica": -1, "records": b""})


def _list_offsets(access: Access, request: Request) -> Decision:
    return _by_topic(request, access, Operation.describe, topics_field="topics", topic_name="name", partitions_field="partitions",
                     partition_index=lambda p: p.partition_index, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=lambda i: {"partition_index": i, "error_code": TOPIC_DENIED, "timestamp": -1, "offset": -1, "leader_epoch": -1,
                                      "old_style_offsets": ()})


def _metadata_entry(name, topic_id=None) -> dict:
    return {"error_code": TOPIC_DENIED, "name": name, "topic_id": topic_id or uuid.UUID(int=0), "is_internal": False, "partitions": [],
            "topic_authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS}


def _metadata(access: Access, request: Request) -> Decision:
    body = request.body

    def may_create(name: str) -> bool:
        return access.may(Operation.create, CLUSTER) or access.may(Operation.create, TOPIC, name)

    def describable(entry: dict) -> bool:
        return entry.get("name") is not None and access.may(Operation.describe, TOPIC, entry["name"])

    if body.topics is None or (request.api_version == 0 and not body.topics):
        # Every topic: those it may not describe are left out, as if they did not exist.
        def hide(values: dict) -> dict:
            return {**values, "topics": [t for t in values.get("topics", ()) if describable(t)]}
        return Decision(request, patch=hide, may_create=may_create)
    allowed, denied = _split(body.topics, lambda t: t.name is None or access.may(Operation.describe, TOPIC, t.name))
    every_topic_served = request.api_version == 0 and not allowed  # v0 reads an empty list as "every topic"

    def refuse(values: dict) -> dict:
        # Topics named by id are looked up first: one it may not describe is refused as well, without its name.
        listed = () if every_topic_served else values.get("topics", ())
        topics = [t if t.get("name") is None or t.get("error_code") not in (None, ErrorCode.none, 0) or describable(t)
                  else _metadata_entry(None, t.get("topic_id")) for t in listed]
        return {**values, "topics": topics + [_metadata_entry(t.name) for t in denied]}

    return Decision(_replace(request, topics=tuple(allowed)), patch=refuse, may_create=may_create)


def _partition_codes(code: ErrorCode) -> Callable[[int], dict]:
    return lambda index: {"partition_index": index, "error_code": code}


def _offset_commit(access: Access, request: Request) -> Decision:
    body = request.body
    if not access.may(Operation.read, GROUP, body.group_id):
        return _whole({"throttle_time": 0, "topics": _all_partitions(body.topics, "name", "partitions", lambda p: p.partition_index,
                                                                      _partition_codes(GROUP_DENIED))})
    return _by_topic(request, access, Operation.read, topics_field="topics", topic_name="name", partitions_field="partitions",
                     partition_index=lambda p: p.partition_index, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=_partition_codes(TOPIC_DENIED))


def _offset_fetch_entry(code: ErrorCode) -> Callable[[int], dict]:
    return lambda index: {"partition_index": index, "committed_offset": -1, "committed_leader_epoch": -1, "metadata": "", "error_code": code}


def _offset_fetch(access: Access, request: Request) -> Decision:
    body = request.body
    if not access.may(Operation.describe, GROUP, body.group_id):
        # Version 1 has no error at its top: each partition asked says it.
        topics = _all_partitions(body.topics, "name", "partition_indexes", int, _offset_fetch_entry(GROUP_DENIED))
        return _whole({"throttle_time": 0, "error_code": GROUP_DENIED, "topics": topics if request.api_version < 2 else []})
    if body.topics is None:
        def hide(values: dict) -> dict:
            return {**values, "topics": [t for t in values.get("topics", ()) if access.may(Operation.describe, TOPIC, t["name"])]}
        return Decision(request, patch=hide)
    return _by_topic(request, access, Operation.describe, topics_field="topics", topic_name="name", partitions_field="partition_indexes",
                     partition_index=int, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=_offset_fetch_entry(TOPIC_DENIED))


def _find_coordinator(access: Access, request: Request) -> Decision:
    body = request.body
    resource = TRANSACTIONAL_ID if int(get(body, "key_type", default=0)) == 1 else GROUP
    code = _DENIED_CODES[resource]
    keys = get(body, "coordinator_keys")
    if keys is None:
        if access.may(Operation.describe, resource, body.key):
            return _allowed(request)
        return _whole({"throttle_time": 0, "error_code": code, "error_message": denied_message(resource, body.key), "node_id": -1, "host": "",
                       "port": -1})
    allowed, denied = _split(keys, lambda k: access.may(Operation.describe, resource, k))
    if not denied:
        return _allowed(request)
    refused = [{"key": k, "node_id": -1, "host": "", "port": -1, "error_code": code, "error_message": denied_message(resource, k)} for k in denied]
    return Decision(_replace(request, coordinator_keys=tuple(allowed)), patch=_append("coordinators", refused))


def _group_read(access: Access, request: Request) -> Decision:
    group_id = request.body.group_id
    if access.may(Operation.read, GROUP, group_id):
        return _allowed(request)
    return _refused(request, GROUP_DENIED, denied_message(GROUP, group_id))


def _describe_groups(access: Access, request: Request) -> Decision:
    allowed, denied = _split(request.body.groups, lambda g: access.may(Operation.describe, GROUP, g))
    if not denied:
        return _allowed(request)
    refused = [{"error_code": GROUP_DENIED, "group_id": g, "group_state": "", "protocol_type": "", "protocol_data": "", "members": [],
                "authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS} for g in denied]
    return Decision(_replace(request, groups=tuple(allowed)), patch=_append("groups", refused))


def _list_groups(access: Access, request: Request) -> Decision:
    if access.may(Operation.describe, CLUSTER):
        return _allowed(request)

    def visible(values: dict) -> dict:
        return {**values, "groups": [g for g in values.get("groups", ()) if access.may(Operation.describe, GROUP, g["group_id"])]}
    return Decision(request, patch=visible)


def _create_topics(access: Access, request: Request) -> Decision:
    if access.may(Operation.create, CLUSTER):
        return _allowed(request)
    allowed, denied = _split(request.body.topics, lambda t: access.may(Operation.create, TOPIC, t.name))
    if not denied:
        return _allowed(request)
    refused = [{"name": t.name, "topic_id": uuid.UUID(int=0), "error_code": TOPIC_DENIED, "error_message": denied_message(TOPIC, t.name),
                "topic_config_error_code": 0, "num_partitions": -1, "replication_factor": -1, "configs": None} for t in denied]
    return Decision(_replace(request, topics=tuple(allowed)), patch=_append("topics", refused))


def _delete_topics(access: Access, request: Request) -> Decision:
    body = request.body
    field = "topic_names" if hasattr(body, "topic_names") else "topics"
    items = getattr(body, field)
    name_of = (lambda t: t) if field == "topic_names" else (lambda t: t.name)
    allowed, denied = _split(items, lambda t: name_of(t) is None or access.may(Operation.delete, TOPIC, name_of(t)))
    if not denied:
        return _allowed(request)
    refused = [{"name": name_of(t), "topic_id": uuid.UUID(int=0), "error_code": TOPIC_DENIED, "error_message": denied_message(TOPIC, name_of(t))}
               for t in denied]
    return Decision(_replace(request, **{field: tuple(allowed)}), patch=_append("responses", refused))


def _delete_records(access: Access, request: Request) -> Decision:
    return _by_topic(request, access, Operation.delete, topics_field="topics", topic_name="name", partitions_field="partitions",
                     partition_index=lambda p: p.partition_index, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=lambda i: {"partition_index": i, "low_watermark": -1, "error_code": TOPIC_DENIED})


def _init_producer_id(access: Access, request: Request) -> Decision:
    transactional_id = request.body.transactional_id
    if transactional_id is not None:
        if access.may(Operation.write, TRANSACTIONAL_ID, transactional_id):
            return _allowed(request)
        code = TXN_DENIED
    elif access.may(Operation.idempotent_write, CLUSTER) or access.may_any(Operation.write, TOPIC):
        return _allowed(request)
    else:
        code = CLUSTER_DENIED
    return _whole({"throttle_time": 0, "error_code": code, "producer_id": -1, "producer_epoch": -1})


def _offset_for_leader_epoch(access: Access, request: Request) -> Decision:
    return _by_topic(request, access, Operation.describe, topics_field="topics", topic_name="topic", partitions_field="partitions",
                     partition_index=lambda p: p.partition, reply_key="topics", reply_name="topic", reply_partitions="partitions",
                     entry=lambda i: {"error_code": TOPIC_DENIED, "partition": i, "leader_epoch": -1, "end_offset": -1})


def _add_partitions_to_txn(access: Access, request: Request) -> Decision:
    body = request.body
    topics = body.v3_and_below_topics

    def reply(code_of: Callable[[str], ErrorCode]) -> Decision:
        return _whole({"throttle_time": 0, "results_by_topic_v3_and_below": [
            {"name": t.name, "results_by_partition": [{"partition_index": p, "partition_error_code": code_of(t.name)} for p in t.partitions]}
            for t in topics]})

    if not access.may(Operation.write, TRANSACTIONAL_ID, body.v3_and_below_transactional_id):
        return reply(lambda _: TXN_DENIED)
    denied = {t.name for t in topics if not access.may(Operation.write, TOPIC, t.name)}
    if not denied:
        return _allowed(request)
    # As Kafka: nothing is added when a topic is refused; the others were not attempted.
    return reply(lambda name: TOPIC_DENIED if name in denied else ErrorCode.operation_not_attempted)


def _add_offsets_to_txn(access: Access, request: Request) -> Decision:
    body = request.body
    if not access.may(Operation.write, TRANSACTIONAL_ID, body.transactional_id):
        return _whole({"throttle_time": 0, "error_code": TXN_DENIED})
    if not access.may(Operation.read, GROUP, body.group_id):
        return _whole({"throttle_time": 0, "error_code": GROUP_DENIED})
    return _allowed(request)


def _end_txn(access: Access, request: Request) -> Decision:
    if access.may(Operation.write, TRANSACTIONAL_ID, request.body.transactional_id):
        return _allowed(request)
    return _whole({"throttle_time": 0, "error_code": TXN_DENIED})


def _txn_offset_commit(access: Access, request: Request) -> Decision:
    body = request.body
    for allowed, code in ((access.may(Operation.write, TRANSACTIONAL_ID, body.transactional_id), TXN_DENIED),
                          (access.may(Operation.read, GROUP, body.group_id), GROUP_DENIED)):
        if not allowed:
            return _whole({"throttle_time": 0, "topics": _all_partitions(body.topics, "name", "partitions", lambda p: p.partition_index,
                                                                          _partition_codes(code))})
    return _by_topic(request, access, Operation.read, topics_field="topics", topic_name="name", partitions_field="partitions",
                     partition_index=lambda p: p.partition_index, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=_partition_codes(TOPIC_DENIED))


def _configs(operation: Operation, reply_key: str, extra: dict) -> Callable[[Access, Request], Decision]:
    def rule(access: Access, request: Request) -> Decision:
        def may(resource) -> bool:
            if resource.resource_type == RESOURCE_TOPIC:
                return access.may(operation, TOPIC, resource.resource_name)
            if resource.resource_type == RESOURCE_BROKER:
                return access.may(operation, CLUSTER)
            return True  # refused by the handler: logbus has no such configs
        allowed, denied = _split(request.body.resources, may)
        if not denied:
            return _allowed(request)
        refused = []
        for r in denied:
            kind = TOPIC if r.resource_type == RESOURCE_TOPIC else CLUSTER
            refused.append({"error_code": _DENIED_CODES[kind], "error_message": denied_message(kind, r.resource_name),
                            "resource_type": r.resource_type, "resource_name": r.resource_name, **extra})
        return Decision(_replace(request, resources=tuple(allowed)), patch=_append(reply_key, refused))
    return rule


def _cluster(operation: Operation) -> Callable[[Access, Request], Decision]:
    def rule(access: Access, request: Request) -> Decision:
        if access.may(operation, CLUSTER):
            return _allowed(request)
        return _refused(request, CLUSTER_DENIED, denied_message(CLUSTER, CLUSTER_NAME))
    return rule


def _create_partitions(access: Access, request: Request) -> Decision:
    allowed, denied = _split(request.body.topics, lambda t: access.may(Operation.alter, TOPIC, t.name))
    if not denied:
        return _allowed(request)
    refused = [{"name": t.name, "error_code": TOPIC_DENIED, "error_message": denied_message(TOPIC, t.name)} for t in denied]
    return Decision(_replace(request, topics=tuple(allowed)), patch=_append("results", refused))


def _delete_groups(access: Access, request: Request) -> Decision:
    allowed, denied = _split(request.body.groups_names, lambda g: access.may(Operation.delete, GROUP, g))
    if not denied:
        return _allowed(request)
    return Decision(_replace(request, groups_names=tuple(allowed)),
                    patch=_append("results", [{"group_id": g, "error_code": GROUP_DENIED} for g in denied]))


def _elect_leaders(access: Access, request: Request) -> Decision:
    if access.may(Operation.alter, CLUSTER):
        return _allowed(request)
    asked = request.body.topic_partitions or ()
    return _whole({"throttle_time": 0, "error_code": CLUSTER_DENIED, "replica_election_results": [
        {"topic": t.topic, "partition_result": [{"partition_id": p, "error_code": CLUSTER_DENIED, "error_message": None} for p in t.partitions]}
        for t in asked]})


def _offset_delete(access: Access, request: Request) -> Decision:
    if not access.may(Operation.delete, GROUP, request.body.group_id):
        return _whole({"throttle_time": 0, "error_code": GROUP_DENIED, "topics": []})
    return _by_topic(request, access, Operation.read, topics_field="topics", topic_name="name", partitions_field="partitions",
                     partition_index=lambda p: p.partition_index, reply_key="topics", reply_name="name", reply_partitions="partitions",
                     entry=_partition_codes(TOPIC_DENIED))


def _create_acls(access: Access, request: Request) -> Decision:
    if access.may(Operation.alter, CLUSTER):
        return _allowed(request)
    message = denied_message(CLUSTER, CLUSTER_NAME)
    return _whole({"throttle_time": 0, "results": [{"error_code": CLUSTER_DENIED, "error_message": message} for _ in request.body.creations]})


def _delete_acls(access: Access, request: Request) -> Decision:
    if access.may(Operation.alter, CLUSTER):
        return _allowed(request)
    message = denied_message(CLUSTER, CLUSTER_NAME)
    return _whole({"throttle_time": 0, "filter_results": [{"error_code": CLUSTER_DENIED, "error_message": message, "matching_acls": []}
                                                          for _ in request.body.filters]})


def _nothing(access: Access, request: Request) -> Decision:
    return _allowed(request)



def _describe_user_scram_credentials(access: Access, request: Request) -> Decision:
    """DESCRIBE on the cluster. Refused as Kafka refuses it: the error at the top and for each user
    asked about (librdkafka expects a result per user it named)."""
    if access.may(Operation.describe, CLUSTER):
        return _allowed(request)
    message = denied_message(CLUSTER, CLUSTER_NAME)
    users = [u.name for u in request.body.users or ()]
    return _whole({"throttle_time": 0, "error_code": CLUSTER_DENIED, "error_message": message,
                   "results": [{"user": name, "error_code": CLUSTER_DENIED, "error_message": message, "credential_infos": []}
                               for name in dict.fromkeys(users)]})


def _alter_user_scram_credentials(access: Access, request: Request) -> Decision:
    """ALTER on the cluster. Refused with the error for each user named (the reply has no error at its top)."""
    if access.may(Operation.alter, CLUSTER):
        return _allowed(request)
    message = denied_message(CLUSTER, CLUSTER_NAME)
    users = [d.name for d in request.body.deletions or ()] + [u.name for u in request.body.upsertions or ()]
    return _whole({"throttle_time": 0, "results": [{"user": name, "error_code": CLUSTER_DENIED, "error_message": message}
                                                   for name in dict.fromkeys(users)]})

RULES: dict[int, Callable[[Access, Request], Decision]] = {
    PRODUCE: _produce,
    FETCH: _fetch,
    LIST_OFFSETS: _list_offsets,
    METADATA: _metadata,
    OFFSET_COMMIT: _offset_commit,
    OFFSET_FETCH: _offset_fetch,
    FIND_COORDINATOR: _find_coordinator,
    JOIN_GROUP: _group_read,
    HEARTBEAT: _group_read,
    LEAVE_GROUP: _group_read,
    SYNC_GROUP: _group_read,
    CONSUMER_GROUP_HEARTBEAT: _group_read,
    DESCRIBE_GROUPS: _describe_groups,
    LIST_GROUPS: _list_groups,
    API_VERSIONS: _nothing,
    DESCRIBE_CLUSTER: _nothing,
    CREATE_TOPICS: _create_topics,
    DELETE_TOPICS: _delete_topics,
    DELETE_RECORDS: _delete_records,
    INIT_PRODUCER_ID: _init_producer_id,
    OFFSET_FOR_LEADER_EPOCH: _offset_for_leader_epoch,
    ADD_PARTITIONS_TO_TXN: _add_partitions_to_txn,
    ADD_OFFSETS_TO_TXN: _add_offsets_to_txn,
    END_TXN: _end_txn,
    TXN_OFFSET_COMMIT: _txn_offset_commit,
    DESCRIBE_CONFIGS: _configs(Operation.describe_configs, "results", {"configs": []}),
    ALTER_CONFIGS: _configs(Operation.alter_configs, "responses", {}),
    INCREMENTAL_ALTER_CONFIGS: _configs(Operation.alter_configs, "responses", {}),
    DESCRIBE_LOG_DIRS: _cluster(Operation.describe),
    CREATE_PARTITIONS: _create_partitions,
    DELETE_GROUPS: _delete_groups,
    ELECT_LEADERS: _elect_leaders,
    OFFSET_DELETE: _offset_delete,
    DESCRIBE_ACLS: _cluster(Operation.describe),
    CREATE_ACLS: _create_acls,
    DELETE_ACLS: _delete_acls,
    DESCRIBE_USER_SCRAM_CREDENTIALS: _describe_user_scram_credentials,
    ALTER_USER_SCRAM_CREDENTIALS: _alter_user_scram_credentials,
}


def authorize(access: Access, request: Request) -> Decision:
    """What ``request`` may do, for ``access`` (see the module docstring). An API without a rule is refused whole
    (CLUSTER_AUTHORIZATION_FAILED): a request is never served unchecked."""
    rule = RULES.get(request.api_key)
    if rule is None:
        return _refused(request, CLUSTER_DENIED, f"API key {request.api_key} has no authorization rule")
    return rule(access, request)


# --- CreateAcls, DescribeAcls, DeleteAcls (KIP-140) ----------------------------------------------------------


def _binding(creation) -> AclBinding:
    return AclBinding(principal=creation.principal, resource_type=int(creation.resource_type), name=creation.resource_name,
                      pattern=int(creation.resource_pattern_type), operation=int(creation.operation),
                      permission=int(creation.permission_type), host=creation.host)


def _filter(body) -> AclFilter:
    return AclFilter(principal=body.principal_filter, resource_type=int(body.resource_type_filter), name=body.resource_name_filter,
                     pattern=int(get(body, "pattern_type_filter", default=PatternType.literal)), operation=int(body.operation),
                     permission=int(body.permission_type), host=body.host_filter)


def _described(bindings: list[AclBinding]) -> list[dict]:
    """Bindings as DescribeAcls lists them: per resource pattern, its ACLs."""
    by_resource: dict[tuple, list] = {}
    for b in bindings:
        by_resource.setdefault((int(b.resource_type), b.name, int(b.pattern)), []).append(
            {"principal": b.principal, "host": b.host, "operation": int(b.operation), "permission_type": int(b.permission)})
    return [{"resource_type": t, "resource_name": n, "pattern_type": p, "acls": acls} for (t, n, p), acls in by_resource.items()]


def _matching(b: AclBinding) -> dict:
    return {"error_code": ErrorCode.none, "error_message": None, "resource_type": int(b.resource_type), "resource_name": b.name,
            "pattern_type": int(b.pattern), "principal": b.principal, "host": b.host, "operation": int(b.operation),
            "permission_type": int(b.permission)}


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:1000]


class AclRequests:
    """CreateAcls, DescribeAcls and DeleteAcls, mixed into KafkaHandler (``self.backend`` has ``create_acls``,
    ``describe_acls`` and ``delete_acls``, ``self.acls_enabled`` says whether the gateway checks ACLs: without,
    they answer SECURITY_DISABLED, as a Kafka broker without an authorizer)."""

    acls_enabled: bool = False

    async def _create_acls(self, request: Request) -> dict:
        creations = request.body.creations
        if not self.acls_enabled:
            return {"throttle_time": 0, "results": [{"error_code": ErrorCode.security_disabled, "error_message": "no authorizer"} for _ in creations]}
        results: list[dict | None] = []
        valid = []
        for creation in creations:
            try:
                valid.append(_binding(creation))
                results.append(None)
            except e.InvalidConfigError as error:
                results.append({"error_code": ErrorCode.invalid_request, "error_message": str(error)})
        outcome = {"error_code": ErrorCode.none, "error_message": None}
        if valid:
            try:
                await self.backend.create_acls([b.to_dict() for b in valid])
            except Exception as error:  # noqa: BLE001
                outcome = {"error_code": self._code(error), "error_message": _message(error)}
        return {"throttle_time": 0, "results": [r if r is not None else outcome for r in results]}

    async def _describe_acls(self, request: Request) -> dict:
        reply = {"throttle_time": 0, "error_code": ErrorCode.none, "error_message": None, "resources": []}
        if not self.acls_enabled:
            return {**reply, "error_code": ErrorCode.security_disabled, "error_message": "no authorizer"}
        try:
            acl_filter = _filter(request.body)
        except e.InvalidConfigError as error:
            return {**reply, "error_code": ErrorCode.invalid_request, "error_message": str(error)}
        try:
            found = await self.backend.describe_acls(acl_filter.to_dict())
        except Exception as error:  # noqa: BLE001
            return {**reply, "error_code": self._code(error), "error_message": _message(error)}
        return {**reply, "resources": _described([AclBinding.of(b) for b in found])}

    async def _delete_acls(self, request: Request) -> dict:
        filters = request.body.filters
        if not self.acls_enabled:
            return {"throttle_time": 0, "filter_results": [{"error_code": ErrorCode.security_disabled, "error_message": "no authorizer",
                                                            "matching_acls": []} for _ in filters]}
        results: list[dict | None] = []
        valid = []
        for f in filters:
            try:
                valid.append(_filter(f))
                results.append(None)
            except e.InvalidConfigError as error:
                results.append({"error_code": ErrorCode.invalid_request, "error_message": str(error), "matching_acls": []})
        deleted: list = []
        failure = None
        if valid:
            try:
                deleted = await self.backend.delete_acls([f.to_dict() for f in valid])
            except Exception as error:  # noqa: BLE001
                failure = {"error_code": self._code(error), "error_message": _message(error), "matching_acls": []}
        found = iter(deleted)
        out = []
        for result in results:
            if result is not None:
                out.append(result)
            elif failure is not None:
                out.append(failure)
            else:
                out.append({"error_code": ErrorCode.none, "error_message": None,
                            "matching_acls": [_matching(AclBinding.of(b)) for b in next(found)]})
        return {"throttle_time": 0, "filter_results": out}


__all__ = ["ACL_API_VERSIONS", "ANONYMOUS", "Access", "AclRequests", "Decision", "RULES", "authorize", "Permission"]
