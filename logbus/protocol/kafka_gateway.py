"""The Kafka gateway's request handling: Kafka's wire protocol onto logbus, without Ray and without sockets.

A :class:`KafkaHandler` takes one request frame (the bytes after Kafka's
4-byte size prefix) and returns the response frame, or None for a produce
request with ``acks=0`` (Kafka sends no response then). Message types and
their encodings are the ``kio`` package's (one dataclass per API key and
version, generated from Kafka's own message definitions); this module picks
the class of each request's version, reads it, and builds the response of
the same version from plain values (:func:`build` fills in only the fields
that version has).

What it needs of the cluster is the small :class:`Backend` interface, which
the gateway actor (``logbus/actors/gateway.py``) implements with the
controller, the replicas and their local channels: topics and where their
leaders live, produce, fetch, offsets, producer ids, topic administration
and the group coordinator's RPCs.

The APIs and versions served are :data:`API_VERSIONS`; ApiVersions tells
clients so. Brokers are the gateways, one per node at most: Metadata
advertises, for each partition, the gateway on its leader's node (or this
gateway, where a node has none), so clients send produce requests and
fetches to a gateway that reaches the leader over its local channel.

Groups. logbus's coordinator assigns partitions itself (no group leader, no
SyncGroup round), so a JoinGroup is the coordinator's join, held until the
generation forms; every member is told it is a follower (the leader named is
no member), so each sends an empty SyncGroup, whose reply is the assignment
the coordinator computed, in Kafka's ConsumerProtocol encoding. Kafka
consumers and logbus consumers can therefore share one group.

Transactions. Every gateway answers for the one transaction coordinator (in
the controller), as for the group coordinator: InitProducerId with a
transactional id, AddPartitionsToTxn, AddOffsetsToTxn, EndTxn and
TxnOffsetCommit are its calls. A transactional producer's batches are
produced as any idempotent producer's, with the transactional bit kept; a
read_committed Fetch reads up to the last stable offset and names the
aborted transactions of its range, and markers go to Kafka clients as
Kafka's control batches, so their own read_committed filtering applies.

Errors. logbus's errors map to Kafka's codes (:func:`error_code`). A frame
that cannot be parsed, or names an API key or version not served, raises
:class:`~logbus.errors.KafkaProtocolError`: the gateway closes the
connection, as Kafka does (ApiVersions alone answers an unknown version,
with UNSUPPORTED_VERSION and the versions it has).
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Hashable, Mapping, Protocol

from kio.schema.errors import ErrorCode

from logbus import errors as e
from logbus.protocol.group_coordinator import (
    OFFSET_METADATA_BYTES_MAX,
    OFFSETS_TOPIC,
    REBALANCE_TIMEOUT_MS_MAX,
    SESSION_TIMEOUT_MS_MAX,
    SESSION_TIMEOUT_MS_MIN,
    HeartbeatResult,
    JoinPending,
    JoinResult,
    OffsetAndMetadata,
    SyncPending,
)
from logbus.protocol.acl import Authorizer
from logbus.protocol.kafka_admin import RESOURCE_BROKER, RESOURCE_TOPIC, AdminRequests
from logbus.protocol.kafka_authz import ACL_API_VERSIONS, ANONYMOUS, Access, AclRequests, Decision, authorize
from logbus.protocol.kafka_messages import (
    UNKNOWN_AUTHORIZED_OPERATIONS,
    Request,
    build,
    encode_assignment,
    encode_response,
    encode_subscription,
    error_response,
    get as _get,
    knows,
    ms as _ms,
    parse_assignment,
    parse_subscription,
    peek_header,
    read_request,
    read_subscription,
)
from logbus.protocol.kafka_records import DECOMPRESSED_MAX_BYTES, ProducedBatch, to_kafka, to_logbus
from logbus.protocol.messages import READ_COMMITTED, READ_UNCOMMITTED, FetchResponse, ProduceResponse, TopicPartition
from logbus.storage import record_batch as rb
from logbus.storage.log_config import LogConfig
from logbus.storage.names import INTERNAL_TOPIC_PREFIX, validate_topic_name

logger = logging.getLogger(__name__)

# API keys served, and the versions of each: within what kio has, and what current kcat
# (librdkafka), kafka-python, aiokafka and confluent-kafka ask for. Fetch stays below v13 and
# Metadata below v13 (topic ids instead of names); Produce below v10, JoinGroup below v8 (reasons),
# OffsetCommit below v9 and OffsetFetch below v8 (KIP-848's and batched forms).
PRODUCE, FETCH, LIST_OFFSETS, METADATA = 0, 1, 2, 3
OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR, JOIN_GROUP, HEARTBEAT, LEAVE_GROUP, SYNC_GROUP = 8, 9, 10, 11, 12, 13, 14
DESCRIBE_GROUPS, LIST_GROUPS, API_VERSIONS, CREATE_TOPICS, DELETE_TOPICS, DELETE_RECORDS, INIT_PRODUCER_ID = 15, 16, 18, 19, 20, 21, 22
OFFSET_FOR_LEADER_EPOCH, DESCRIBE_CONFIGS, ALTER_CONFIGS, DESCRIBE_LOG_DIRS, CREATE_PARTITIONS = 23, 32, 33, 35, 37
DELETE_GROUPS, ELECT_LEADERS, INCREMENTAL_ALTER_CONFIGS, OFFSET_DELETE, DESCRIBE_CLUSTER = 42, 43, 44, 47, 60
CONSUMER_GROUP_HEARTBEAT = 68
DESCRIBE_ACLS, CREATE_ACLS, DELETE_ACLS = 29, 30, 31
DESCRIBE_USER_SCRAM_CREDENTIALS, ALTER_USER_SCRAM_CREDENTIALS = 50, 51
ADD_PARTITIONS_TO_TXN, ADD_OFFSETS_TO_TXN, END_TXN, TXN_OFFSET_COMMIT = 24, 25, 26, 28
API_VERSIONS_SERVED: dict[int, tuple[int, int]] = {
    PRODUCE: (3, 9),
    FETCH: (4, 12),
    LIST_OFFSETS: (0, 7),
    METADATA: (0, 12),
    OFFSET_COMMIT: (2, 8),
    OFFSET_FETCH: (1, 7),
    FIND_COORDINATOR: (0, 4),
    JOIN_GROUP: (0, 7),
    HEARTBEAT: (0, 4),
    LEAVE_GROUP: (0, 5),
    SYNC_GROUP: (0, 5),
    DESCRIBE_GROUPS: (0, 5),
    LIST_GROUPS: (0, 4),
    API_VERSIONS: (0, 3),
    CREATE_TOPICS: (2, 7),
    DELETE_TOPICS: (1, 6),
    INIT_PRODUCER_ID: (0, 4),
    # Transactions: the versions before KIP-890's (AddPartitionsToTxn v4 is broker to broker; the
    # later EndTxn, AddOffsetsToTxn and TxnOffsetCommit versions ask for its server-side epoch bumps).
    ADD_PARTITIONS_TO_TXN: (0, 3),
    ADD_OFFSETS_TO_TXN: (0, 3),
    END_TXN: (0, 3),
    TXN_OFFSET_COMMIT: (0, 3),
    DESCRIBE_CONFIGS: (1, 4),
    DELETE_RECORDS: (0, 2),
    OFFSET_FOR_LEADER_EPOCH: (2, 4),
    ALTER_CONFIGS: (0, 2),
    DESCRIBE_LOG_DIRS: (1, 4),
    CREATE_PARTITIONS: (0, 3),
    DELETE_GROUPS: (0, 2),
    ELECT_LEADERS: (0, 2),
    INCREMENTAL_ALTER_CONFIGS: (0, 1),
    OFFSET_DELETE: (0, 0),
    DESCRIBE_CLUSTER: (0, 1),
    CONSUMER_GROUP_HEARTBEAT: (0, 1),
    **ACL_API_VERSIONS,  # DescribeAcls, CreateAcls, DeleteAcls
    DESCRIBE_USER_SCRAM_CREDENTIALS: (0, 0),
    ALTER_USER_SCRAM_CREDENTIALS: (0, 0),
}

MAX_REQUEST_BYTES_DEFAULT = 100 << 20  # Kafka's socket.request.max.bytes
REQUEST_DECOMPRESSED_FACTOR = 4  # a produce request's batches may decompress to this many times max_request_bytes, in all
CONSUMER_PROTOCOL = "consumer"
COORDINATOR_LEADER = "logbus-coordinator"  # the group leader every member is told of: none of them
GROUP_PROTOCOLS = ("range", "roundrobin", "cooperative-sticky")  # the strategies logbus's coordinator has
JOIN_WAIT_MS_MAX = 300_000  # a JoinGroup is held at most this long (or its rebalance timeout)
# How often a KIP-848 member is told to heartbeat (Kafka's group.consumer.heartbeat.interval.ms is 5 s):
# each heartbeat is its rejoin, so a rebalance forms once every member has sent one; while one is under
# way, sooner.
CONSUMER_HEARTBEAT_INTERVAL_MS = 3_000
CONSUMER_HEARTBEAT_INTERVAL_MS_REBALANCING = 500
LIST_OFFSETS_LATEST, LIST_OFFSETS_EARLIEST, LIST_OFFSETS_MAX_TIMESTAMP = -1, -2, -3
CONFIG_SOURCE_TOPIC, CONFIG_SOURCE_STATIC_BROKER, CONFIG_SOURCE_DEFAULT = 1, 4, 5


# --- the gateway's broker settings -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """A gateway's broker settings, named as Kafka names them (``from_dict`` takes those names).

    ``auto.create.topics.enable`` (default true, as Kafka): a Metadata request
    that names a topic that does not exist creates it, when the client allows
    it, with ``num.partitions`` partitions (default 1) and
    ``default.replication.factor`` replicas (default 1), which are also what a
    CreateTopics request asking for -1 gets.
    """

    auto_create_topics_enable: bool = True
    num_partitions: int = 1
    default_replication_factor: int = 1

    NAMES: typing.ClassVar[dict[str, str]] = {
        "auto.create.topics.enable": "auto_create_topics_enable",
        "num.partitions": "num_partitions",
        "default.replication.factor": "default_replication_factor",
    }

    @classmethod
    def from_dict(cls, config: Mapping | None) -> "BrokerConfig":
        """Settings from Kafka's names (values as Kafka's properties take them: "true", "3", or Python's);
        InvalidConfigError for an unknown name or a bad value."""
        values = {}
        for name, value in (config or {}).items():
            field = cls.NAMES.get(name)
            if field is None:
                raise e.InvalidConfigError(f"unknown gateway setting {name!r}; known: {', '.join(sorted(cls.NAMES))}")
            if field == "auto_create_topics_enable":
                if isinstance(value, str) and value.lower() in ("true", "false"):
                    value = value.lower() == "true"
                if not isinstance(value, bool):
                    raise e.InvalidConfigError(f"{name} must be true or false, not {value!r}")
            else:
                if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
                    raise e.InvalidConfigError(f"{name} must be an int in [1, 100000], not {value!r}")
            values[field] = value
        return cls(**values)

    def to_dict(self) -> dict:
        return {name: getattr(self, field) for name, field in self.NAMES.items()}


# The first version of each transactional API whose clients know PRODUCER_FENCED (KIP-588); older
# ones are told INVALID_PRODUCER_EPOCH, as Kafka tells them.
PRODUCER_FENCED_SINCE = {INIT_PRODUCER_ID: 4, ADD_PARTITIONS_TO_TXN: 2, ADD_OFFSETS_TO_TXN: 2, END_TXN: 2}


# --- what the handler needs of the cluster -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broker:
    """A gateway as Kafka clients see it: a broker id, and where it listens."""

    broker_id: int
    host: str
    port: int
    node_id: str


@dataclass(frozen=True, slots=True)
class PartitionView:
    """Where a partition's leader is, and its replicas' and in-sync replicas' nodes."""

    leader_node: str | None
    leader_epoch: int
    replica_nodes: tuple[str, ...]
    isr_nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TopicView:
    """A topic as the handler needs it: its id, its config overrides, its partitions, and its
    effective max.message.bytes (the most a produced batch may take)."""

    name: str
    topic_id: str
    config: dict
    partitions: tuple[PartitionView, ...]
    max_message_bytes: int


class Backend(Protocol):
    """The cluster, as the handler uses it (implemented by the gateway actor)."""

    broker: Broker  # this gateway
    cluster_id: str

    def brokers(self) -> list[Broker]:
        """Every gateway, this one included."""

    def broker_on(self, node_id: str | None) -> Broker:
        """The gateway on ``node_id``, or this one where that node has none."""

    async def topics(self, names: list[str] | None) -> dict[str, TopicView | None]:
        """The topics named (None for one that does not exist), or every topic but logbus's internal ones."""

    async def topic(self, name: str) -> TopicView | None:
        """One topic (None if it does not exist) for the data path: as last looked up, when that is
        recent and no reply since said its leaders moved; else after one lookup, shared by every
        request that asks for the topic while it is under way."""

    def produce(self, topic: str, partition: int, batch: bytes, acks: int | str, timeout_ms: int) -> Awaitable[ProduceResponse]:
        """Hand ``batch`` to the partition's leader as the last ``topic()`` found it, now (before
        returning); the awaitable gives the leader's reply. Raises UnknownTopicError or
        LeaderNotAvailableError when there is no such leader to hand it to."""

    def fetch(self, topic: str, partition: int, offset: int, max_bytes: int, max_wait_ms: int,
              isolation_level: int = READ_UNCOMMITTED) -> Awaitable[tuple[FetchResponse, Any]]:
        """Fetch whole logbus batches from ``offset``: (FetchResponse, buffer or None); READ_COMMITTED
        reads up to the last stable offset and names the aborted transactions the reply overlaps."""

    async def offsets(self, topic: str, partition: int, isolation_level: int = READ_UNCOMMITTED) -> tuple[int, int, int]:
        """(log start offset, high watermark, log end offset); READ_COMMITTED gives the last stable
        offset in place of the high watermark."""

    async def offset_for_timestamp(self, topic: str, partition: int, timestamp_ms: int) -> int:
        """The first offset whose timestamp is >= ``timestamp_ms``, or -1."""

    async def allocate_producer_id(self) -> int:
        """A producer id no other producer has (InitProducerId)."""

    async def create_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        """Create a topic; ``config`` maps Kafka topic config names to the values a client sent."""

    async def delete_topic(self, name: str) -> None:
        """Delete a topic and its data."""

    async def group_join(self, group_id: str, options: dict, wait_ms: int) -> JoinResult | JoinPending:
        """The coordinator's join (``options``: its join arguments), waiting up to ``wait_ms`` for the
        generation to form: a JoinResult, or JoinPending (join again with its member id)."""

    async def group_sync(self, group_id: str, member_id: str, generation: int, assignments: dict | None, wait_ms: int,
                         group_instance_id: str | None, protocol_type: str | None, protocol_name: str | None) -> JoinResult | SyncPending:
        """SyncGroup (the coordinator's ``sync``), waiting up to ``wait_ms`` for the leader's assignments."""

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, group_instance_id: str | None = None) -> HeartbeatResult:
        """A member's heartbeat; the result says whether it must join again."""

    async def consumer_group_heartbeat(self, group_id: str, member_id: str, member_epoch: int, options: dict) -> dict:
        """KIP-848's heartbeat (GroupService.consumer_heartbeat): {member_id, member_epoch, assignment, rebalancing}."""

    async def topic_names_by_id(self) -> dict[str, str]:
        """{topic id (hex): name} of the topics the backend has looked up."""

    async def group_leave(self, group_id: str, member_id: str, group_instance_id: str | None = None) -> bool:
        """Take a member (or a static instance's member) out of its group; False if it was not a member."""

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict, group_instance_id: str | None = None,
                             retention_ms: int | None = None) -> None:
        """Commit ``offsets`` ({TopicPartition: OffsetAndMetadata}) for a member of the generation."""

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        """{TopicPartition: OffsetAndMetadata or None}: the group's committed offsets of ``partitions``."""

    async def describe_group(self, group_id: str) -> dict:
        """The group's state, protocol type, protocol, leader, members (with their metadata and assignments)
        and committed offsets per partition (GroupService.describe_group with protocol details)."""

    async def list_groups(self) -> list[tuple[str, str, str | None, str]]:
        """(group id, state, protocol, protocol type) of every group."""

    async def delete_group(self, group_id: str) -> None:
        """Delete a group without members, and its committed offsets."""

    async def delete_group_offsets(self, group_id: str, partitions: list) -> dict:
        """Kafka's OffsetDelete: {TopicPartition: None, or the error for it}."""

    async def ensure_offsets_topic(self) -> None:
        """Create ``__consumer_offsets`` if it does not exist."""

    # --- administration ------------------------------------------------------------------------------

    async def create_partitions(self, name: str, total: int) -> None:
        """Grow a topic to ``total`` partitions."""

    async def delete_records(self, topic: str, partition: int, offset: int) -> int:
        """Move a partition's log start to ``offset`` (-1: the high watermark); its new log start."""

    async def alter_config(self, name: str, config: dict, delete: list[str]) -> None:
        """Set a topic's config overrides and remove those named in ``delete``."""

    async def end_offset_for_epoch(self, topic: str, partition: int, epoch: int) -> tuple[int, int]:
        """(largest leader epoch <= ``epoch`` in the leader's log, the offset where it ends)."""

    async def elect_preferred_leaders(self, partitions: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Preferred-leader elections of ``partitions``; the partitions whose leader moved."""

    async def replica_statuses(self, topic: str) -> list[list[dict]]:
        """Every replica's status (node, role, offsets, size), per partition."""

    async def data_dir(self) -> str:
        """The cluster's data directory (DescribeLogDirs's log directory)."""

    async def txn_init_producer_id(self, transactional_id: str, timeout_ms: int, expected: tuple[int, int] | None) -> tuple[int, int]:
        """The transaction coordinator's InitProducerId: (producer id, epoch); fences older instances."""

    async def txn_add_partitions(self, transactional_id: str, producer_id: int, epoch: int, partitions: list[TopicPartition]) -> None:
        """AddPartitionsToTxn: durable before it returns."""

    async def txn_add_offsets(self, transactional_id: str, producer_id: int, epoch: int, group_id: str) -> None:
        """AddOffsetsToTxn: the group's offsets partition joins the transaction."""

    async def txn_offset_commit(self, transactional_id: str, producer_id: int, epoch: int, group_metadata: tuple, offsets: dict) -> None:
        """TxnOffsetCommit: ``group_metadata`` is (group id, generation, member id, group instance id)."""

    async def txn_end(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        """EndTxn: returns once the transaction's markers are written."""

    # --- ACLs (kafka_authz.AclRequests) ---------------------------------------------------------------

    async def create_acls(self, bindings: list[dict]) -> None:
        """Add ACL bindings (``AclBinding.to_dict`` each); every gateway checks by them once this returns."""

    async def describe_acls(self, acl_filter: dict) -> list[dict]:
        """The bindings an ``AclFilter`` (as its ``to_dict``) matches."""

    async def delete_acls(self, filters: list[dict]) -> list[list[dict]]:
        """Delete what each filter matches; per filter, the bindings deleted."""

    async def scram_users(self) -> dict[str, dict[str, int]]:
        """user -> SCRAM mechanism -> iterations of every stored credential."""

    async def alter_scram_credentials(self, upserts: list, deletions: list) -> list[bool]:
        """Set each (user, mechanism, credential dict), delete each (user, mechanism); per deletion, whether it found one."""


# --- errors ----------------------------------------------------------------------------------------

# Most specific first: the first class an error is an instance of gives its code.
_ERROR_CODES: tuple[tuple[type, ErrorCode], ...] = (
    (e.ChannelClosedError, ErrorCode.not_leader_or_follower),
    (e.FencedLeaderEpochError, ErrorCode.not_leader_or_follower),
    (e.NotLeaderError, ErrorCode.not_leader_or_follower),
    (e.LeaderNotAvailableError, ErrorCode.leader_not_available),
    (e.UnknownTopicError, ErrorCode.unknown_topic_or_partition),
    (e.InvalidPartitionError, ErrorCode.unknown_topic_or_partition),
    (e.OffsetOutOfRangeError, ErrorCode.offset_out_of_range),
    (e.RecordTooLargeError, ErrorCode.message_too_large),
    (e.CorruptRecordError, ErrorCode.corrupt_message),
    (e.InvalidRecordError, ErrorCode.invalid_record),
    (e.NotEnoughReplicasError, ErrorCode.not_enough_replicas),
    (e.RequestTimedOutError, ErrorCode.request_timed_out),
    (e.OutOfOrderSequenceError, ErrorCode.out_of_order_sequence_number),
    (e.DuplicateSequenceError, ErrorCode.duplicate_sequence_number),
    (e.UnknownSequenceError, ErrorCode.out_of_order_sequence_number),  # never DUPLICATE: Java clients count that as written
    (e.ProducerFencedError, ErrorCode.invalid_producer_epoch),
    (e.FencedInstanceIdError, ErrorCode.fenced_instance_id),
    (e.FencedMemberEpochError, ErrorCode.fenced_member_epoch),
    (e.InvalidProducerEpochError, ErrorCode.invalid_producer_epoch),
    (e.InvalidProducerIdMappingError, ErrorCode.invalid_producer_id_mapping),
    (e.InvalidTxnStateError, ErrorCode.invalid_txn_state),
    (e.ConcurrentTransactionsError, ErrorCode.concurrent_transactions),
    (e.InvalidTransactionTimeoutError, ErrorCode.invalid_transaction_timeout),
    (e.TransactionalIdNotFoundError, ErrorCode.transactional_id_not_found),
    (e.UnknownMemberIdError, ErrorCode.unknown_member_id),
    (e.IllegalGenerationError, ErrorCode.illegal_generation),
    (e.RebalanceInProgressError, ErrorCode.rebalance_in_progress),
    (e.CoordinatorNotAvailableError, ErrorCode.coordinator_not_available),
    (e.InvalidGroupIdError, ErrorCode.invalid_group_id),
    (e.GroupNotEmptyError, ErrorCode.non_empty_group),
    (e.GroupSubscribedToTopicError, ErrorCode.group_subscribed_to_topic),
    (e.InconsistentGroupProtocolError, ErrorCode.inconsistent_group_protocol),
    (e.UnsupportedAssignorError, ErrorCode.unsupported_assignor),
    (e.TopicAlreadyExistsError, ErrorCode.topic_already_exists),
    (e.InvalidTopicError, ErrorCode.invalid_topic_exception),
    (e.InvalidPartitionsError, ErrorCode.invalid_partitions),
    (e.InvalidReplicationFactorError, ErrorCode.invalid_replication_factor),
    (e.NodeCapacityError, ErrorCode.policy_violation),
    (e.InconsistentClusterIdError, ErrorCode.inconsistent_cluster_id),
    (e.ReplicaNotAvailableError, ErrorCode.replica_not_available),
    (e.TierNotAvailableError, ErrorCode.kafka_storage_error),
    (e.SaslAuthenticationError, ErrorCode.sasl_authentication_failed),
    (e.InvalidConfigError, ErrorCode.invalid_config),
    (e.StorageError, ErrorCode.kafka_storage_error),
    (e.ReassignmentInProgressError, ErrorCode.reassignment_in_progress),
    (e.NoReassignmentInProgressError, ErrorCode.no_reassignment_in_progress),
    (e.InvalidReassignmentError, ErrorCode.invalid_replica_assignment),
    (e.IllegalStateError, ErrorCode.invalid_request),
)


def error_code(error: BaseException) -> ErrorCode:
    """Kafka's error code for a logbus error (UNKNOWN_SERVER_ERROR for anything else)."""
    for cls, code in _ERROR_CODES:
        if isinstance(error, cls):
            return code
    if isinstance(error, TimeoutError | asyncio.TimeoutError):
        return ErrorCode.request_timed_out
    return ErrorCode.unknown_server_error


def txn_error_code(error: BaseException, api_key: int, api_version: int) -> ErrorCode:
    """:func:`error_code` for the transaction coordinator's APIs: a fenced producer is told
    PRODUCER_FENCED by the versions that know it (its produce requests keep INVALID_PRODUCER_EPOCH)."""
    if isinstance(error, e.ProducerFencedError) and api_version >= PRODUCER_FENCED_SINCE.get(api_key, 2**15):
        return ErrorCode.producer_fenced
    return error_code(error)


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:1000]


# --- frames ----------------------------------------------------------------------------------------


def parse_request(frame: bytes) -> Request:
    """Read one request frame (without its size prefix) of an API version served; KafkaProtocolError if it
    cannot be read or is not served."""
    api_key, api_version, _ = peek_header(frame)
    versions = API_VERSIONS_SERVED.get(api_key)
    if versions is None:
        raise e.KafkaProtocolError(f"API key {api_key} is not served")
    if not versions[0] <= api_version <= versions[1]:
        raise e.KafkaProtocolError(f"API key {api_key} version {api_version} is not served (versions {versions[0]}-{versions[1]})")
    return read_request(frame)


def broker_id_for(node_id: str) -> int:
    """A stable int32 broker id for a Ray node id (hex): every gateway computes the same one."""
    return zlib.crc32(node_id.encode()) & 0x7FFFFFFF


# --- produce: what a batch may cost to decode ----------------------------------------------------------


class _DecompressionBudget:
    """What the compressed batches of one produce request may still decompress to, in all."""

    __slots__ = ("remaining",)

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining


def _to_logbus(view: TopicView | None, topic: str, partition: int, records: bytes, budget: _DecompressionBudget) -> ProducedBatch:
    """A partition's Kafka batch as the logbus batch to append, decoded only once the topic exists and
    the batch is within its max.message.bytes.

    Compressed records may expand to at most the least of the topic's
    max.message.bytes (the gateway stores them uncompressed, and a logbus
    batch is no smaller than the Kafka records it holds), what the request's
    other batches left of its budget, and ``DECOMPRESSED_MAX_BYTES``;
    RecordTooLargeError past that.
    """
    if view is None:
        raise e.UnknownTopicError(f"topic {topic!r} does not exist")
    if not 0 <= partition < len(view.partitions):
        raise e.UnknownTopicError(f"topic {topic!r} has partitions 0..{len(view.partitions) - 1}, not {partition}")
    if len(records) > view.max_message_bytes:
        raise e.RecordTooLargeError(f"a batch of {len(records)} bytes exceeds max.message.bytes={view.max_message_bytes} of topic {topic!r}")
    limit = min(view.max_message_bytes, budget.remaining, DECOMPRESSED_MAX_BYTES)
    produced = to_logbus(records, decompressed_max_bytes=limit)
    budget.remaining -= produced.decompressed_bytes
    return produced


# --- the handler ---------------------------------------------------------------------------------------


class KafkaHandler(AdminRequests, AclRequests):
    """Serves Kafka requests against a :class:`Backend` (see the module docstring).

    One per gateway; shared by its connections. It remembers the latest
    JoinGroup result of each member (for its SyncGroup) and nothing else.

    ``authorizer``: the cluster's ACLs, when the gateway checks them (None:
    every request is served, as before ACLs). The gateway replaces it whole
    when the ACLs change; each request is checked against the one it finds
    when it starts (``logbus/protocol/kafka_authz.py``).
    """

    authorizer: Authorizer | None = None

    @property
    def acls_enabled(self) -> bool:
        return self.authorizer is not None

    def __init__(self, backend: Backend, *, max_request_bytes: int = MAX_REQUEST_BYTES_DEFAULT, config: BrokerConfig | None = None) -> None:
        self.backend = backend
        self.max_request_bytes = max_request_bytes
        self.config = config if config is not None else BrokerConfig()
        # (connection, topic, partition) -> the turn of the latest batch sent there (see _produce_partition).
        self._turns: dict[tuple[Hashable, str, int], asyncio.Future] = {}
        self.requests_served: dict[tuple[int, int], int] = {}  # by (API key, version): for tests and `stats()`
        self.requests_unserved: dict[tuple[int, int], int] = {}  # answered UNSUPPORTED_VERSION, by (API key, version)
        # What ApiVersions lists: the APIs served here, and those the listener serves itself (SASL's).
        self.api_versions: dict[int, tuple[int, int]] = dict(API_VERSIONS_SERVED)
        self._handlers = {
            API_VERSIONS: self._api_versions,
            METADATA: self._metadata,
            FETCH: self._fetch,
            LIST_OFFSETS: self._list_offsets,
            FIND_COORDINATOR: self._find_coordinator,
            JOIN_GROUP: self._join_group,
            SYNC_GROUP: self._sync_group,
            HEARTBEAT: self._heartbeat,
            LEAVE_GROUP: self._leave_group,
            OFFSET_COMMIT: self._offset_commit,
            OFFSET_FETCH: self._offset_fetch,
            INIT_PRODUCER_ID: self._init_producer_id,
            ADD_PARTITIONS_TO_TXN: self._add_partitions_to_txn,
            ADD_OFFSETS_TO_TXN: self._add_offsets_to_txn,
            END_TXN: self._end_txn,
            TXN_OFFSET_COMMIT: self._txn_offset_commit,
            CREATE_TOPICS: self._create_topics,
            DELETE_TOPICS: self._delete_topics,
            DESCRIBE_CONFIGS: self._describe_configs,
            DESCRIBE_GROUPS: self._describe_groups,
            LIST_GROUPS: self._list_groups,
            DELETE_RECORDS: self._delete_records,
            OFFSET_FOR_LEADER_EPOCH: self._offset_for_leader_epoch,
            ALTER_CONFIGS: self._alter_configs,
            DESCRIBE_LOG_DIRS: self._describe_log_dirs,
            CREATE_PARTITIONS: self._create_partitions,
            DELETE_GROUPS: self._delete_groups,
            ELECT_LEADERS: self._elect_leaders,
            INCREMENTAL_ALTER_CONFIGS: self._incremental_alter_configs,
            OFFSET_DELETE: self._offset_delete,
            DESCRIBE_CLUSTER: self._describe_cluster,
            CONSUMER_GROUP_HEARTBEAT: self._consumer_group_heartbeat,
            DESCRIBE_ACLS: self._describe_acls,
            CREATE_ACLS: self._create_acls,
            DELETE_ACLS: self._delete_acls,
            DESCRIBE_USER_SCRAM_CREDENTIALS: self._describe_user_scram_credentials,
            ALTER_USER_SCRAM_CREDENTIALS: self._alter_user_scram_credentials,
        }
        assert set(self._handlers) | {PRODUCE} == set(API_VERSIONS_SERVED), "every API served has its handler"

    def start(self, frame: bytes, connection: Hashable = None, principal: str = ANONYMOUS, host: str = "*") -> Awaitable[bytes | None]:
        """Begin serving one request frame; the awaitable gives the response frame (None: send nothing).

        Parsing happens here, before this returns; raises KafkaProtocolError for
        a frame that cannot be served (close the connection). ``connection``
        identifies the connection the frame came on: a produce request's batches
        take their turn behind the same connection's earlier batches for the
        same partition (see ``_produce_partition``), so each connection's
        records reach every partition in the order they were sent. Called on
        the event loop that awaits the result. ``principal`` (``User:NAME``) and
        ``host`` (its address) are who sent it, for the ACLs when
        ``authorizer`` is set: the request is checked here, before anything of
        it is served.
        """
        api_key, api_version, correlation_id = peek_header(frame)
        if api_key == API_VERSIONS and api_version > API_VERSIONS_SERVED[API_VERSIONS][1]:
            # Kafka answers an ApiVersions it does not know in version 0, so the client can retry lower.
            return _done(encode_response(API_VERSIONS, 0, correlation_id, self._versions_values(ErrorCode.unsupported_version)))
        versions = API_VERSIONS_SERVED.get(api_key)
        if (versions is None or not versions[0] <= api_version <= versions[1]) and knows(api_key, api_version):
            # An API (or version) ApiVersions does not list: its own reply, saying UNSUPPORTED_VERSION
            # (not retriable: the client gives up on it) wherever the reply has an error code. A request
            # kio cannot read at all closes the connection below, as Kafka closes it.
            unserved = (api_key, api_version)
            self.requests_unserved[unserved] = self.requests_unserved.get(unserved, 0) + 1
            return _done(error_response(api_key, api_version, correlation_id, ErrorCode.unsupported_version,
                                        f"API key {api_key} version {api_version} is not served by the logbus gateway"))
        request = parse_request(frame)
        served = (api_key, api_version)
        self.requests_served[served] = self.requests_served.get(served, 0) + 1
        access = Access(self.authorizer, principal or ANONYMOUS, host) if self.authorizer is not None else None
        if access is None and api_key == ALTER_USER_SCRAM_CREDENTIALS:
            # Without ACLs nobody may change credentials here: any client could take over another's login.
            # logbus's admin (create_scram_user, delete_scram_user) still can.
            access = Access(Authorizer(()), principal or ANONYMOUS, host)
        if api_key == PRODUCE:
            if request.body.acks not in (0, 1, -1):
                return self._respond(request, _done(_refused_produce(request.body, ErrorCode.invalid_required_acks,
                                                                     f"acks must be 0, 1 or -1, not {request.body.acks}")))
            decision = authorize(access, request) if access is not None else Decision(request)  # now: batches keep their turns
            if decision.request is None:
                return _done(None) if request.body.acks == 0 else self._respond(request, _done(decision.reply))
            replies = self._send_produce(decision.request, connection)  # each batch in its partition's turn
            if request.body.acks == 0:
                return _discard(replies)
            return self._respond(request, _finished(decision, self._produce_replies(replies)))
        if access is not None:
            return self._respond(request, self._authorized(access, request))
        return self._respond(request, self._handlers[api_key](request))

    async def _authorized(self, access: Access, request: Request) -> dict:
        """The request's reply values, as far as the ACLs let it be served (see ``kafka_authz``)."""
        decision = authorize(access, request)
        if decision.request is None:
            return decision.reply
        if request.api_key == METADATA:
            values = await self._metadata(decision.request, may_create=decision.may_create)
        else:
            values = await self._handlers[request.api_key](decision.request)
        return decision.finish(values)

    @staticmethod
    def _code(error: BaseException) -> ErrorCode:
        return error_code(error)

    async def _respond(self, request: Request, values) -> bytes:
        """The response frame; an unexpected error becomes the request's own reply carrying its code, so no
        request read in full costs its connection (the error is logged: it is a bug)."""
        try:
            values = await values
            return encode_response(request.api_key, request.api_version, request.correlation_id, values)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001
            logger.exception("Kafka gateway: API key %d version %d failed; answering with its error code", request.api_key, request.api_version)
            return error_response(request.api_key, request.api_version, request.correlation_id, error_code(error), _message(error))

    # --- ApiVersions, Metadata, FindCoordinator -----------------------------------------------------

    def _versions_values(self, code: ErrorCode = ErrorCode.none) -> dict:
        return {
            "error_code": code,
            "api_keys": [{"api_key": k, "min_version": lo, "max_version": hi} for k, (lo, hi) in sorted(self.api_versions.items())],
            "throttle_time": 0,
        }

    async def _api_versions(self, request: Request) -> dict:
        return self._versions_values()

    def _broker_values(self, broker: Broker) -> dict:
        return {"node_id": broker.broker_id, "host": broker.host, "port": broker.port, "rack": None}

    async def _metadata(self, request: Request, may_create=None) -> dict:
        """Metadata; ``may_create(name)`` says whether the principal may auto-create a topic (None: anyone may)."""
        body = request.body
        by_id: dict[uuid.UUID, str] = {}
        ids: list[uuid.UUID] = []
        if body.topics is None or (request.api_version == 0 and not body.topics):
            names = None  # every topic (in version 0, an empty list means every topic too)
        else:
            names = [t.name for t in body.topics if t.name is not None]
            ids = [t.topic_id for t in body.topics if t.name is None and _get(t, "topic_id") is not None]
        # Versions 0-3 have no flag: Kafka creates topics a Metadata request names, as version 4+ asks.
        allow_creation = bool(_get(body, "allow_auto_topic_creation", default=True))
        topics = []
        try:
            if names is not None and ids:
                everything = await self.backend.topics(None)
                by_id = {_topic_uuid(v.topic_id): n for n, v in everything.items() if v is not None}
            views = await self.backend.topics(names) if names is None or names else {}
            views = dict(views)
            missing = [n for n, v in views.items() if v is None]
            if missing and names is not None:
                views.update(await self._auto_create(missing, allow_creation, may_create))
        except Exception as error:  # noqa: BLE001 (the controller unreachable: every topic asked says so)
            code = error_code(error)
            views = {}
            for name in names or []:
                topics.append({"error_code": code, "name": name, "topic_id": uuid.UUID(int=0), "is_internal": False, "partitions": []})
        for topic_id in ids if names is not None else []:
            name = by_id.get(topic_id)
            if name is None:
                topics.append({"error_code": ErrorCode.unknown_topic_id, "name": None, "topic_id": topic_id, "is_internal": False,
                               "partitions": []})
            elif name not in views:
                views[name] = (await self.backend.topics([name])).get(name)
        for name, view in views.items():
            if not isinstance(view, TopicView):
                code = view if isinstance(view, ErrorCode) else ErrorCode.unknown_topic_or_partition
                topics.append({"error_code": code, "name": name, "topic_id": uuid.UUID(int=0), "is_internal": False, "partitions": []})
                continue
            partitions = []
            for index, p in enumerate(view.partitions):
                replicas = _unique(self.backend.broker_on(n).broker_id for n in p.replica_nodes)
                isr = _unique(self.backend.broker_on(n).broker_id for n in p.isr_nodes)
                partitions.append({
                    "error_code": ErrorCode.none if p.leader_node is not None else ErrorCode.leader_not_available,
                    "partition_index": index,
                    "leader_id": self.backend.broker_on(p.leader_node).broker_id if p.leader_node is not None else -1,
                    "leader_epoch": p.leader_epoch,
                    "replica_nodes": replicas,
                    "isr_nodes": isr,
                    "offline_replicas": (),
                })
            topics.append({"error_code": ErrorCode.none, "name": name, "topic_id": _topic_uuid(view.topic_id),
                           "is_internal": name.startswith(INTERNAL_TOPIC_PREFIX), "partitions": partitions,
                           "topic_authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS})
        return {
            "throttle_time": 0,
            "brokers": [self._broker_values(b) for b in self.backend.brokers()],
            "cluster_id": self.backend.cluster_id,
            "controller_id": self.backend.broker.broker_id,
            "topics": topics,
            "cluster_authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS,
        }

    async def _auto_create(self, names: list[str], allowed: bool, may_create=None) -> dict[str, TopicView | ErrorCode]:
        """Topics a Metadata request named that do not exist: created as Kafka's broker creates them when
        ``auto.create.topics.enable`` is on and the client allows it (``num.partitions``,
        ``default.replication.factor``); ``__consumer_offsets`` is created whenever it is asked for.
        Returns each name's view once created, or the error code to answer for it."""
        out: dict[str, TopicView | ErrorCode] = {}

        async def one(name: str) -> None:
            if name == OFFSETS_TOPIC:
                try:
                    await self.backend.ensure_offsets_topic()
                except Exception as error:  # noqa: BLE001
                    out[name] = error_code(error)
                    return
            elif not (allowed and self.config.auto_create_topics_enable):
                out[name] = ErrorCode.unknown_topic_or_partition
                return
            elif may_create is not None and not may_create(name):
                out[name] = ErrorCode.topic_authorization_failed  # as Kafka: neither CREATE on the cluster nor on the topic
                return
            else:
                try:
                    validate_topic_name(name)
                    if name.startswith(INTERNAL_TOPIC_PREFIX):
                        raise e.InvalidTopicError(f"topic names starting with {INTERNAL_TOPIC_PREFIX!r} are logbus's")
                    await self.backend.create_topic(name, self.config.num_partitions, self.config.default_replication_factor, {})
                except e.TopicAlreadyExistsError:
                    pass  # created meanwhile (another client's Metadata): it is there now
                except e.InvalidTopicError:
                    out[name] = ErrorCode.invalid_topic_exception
                    return
                except Exception as error:  # noqa: BLE001
                    logger.info("auto-creating topic %r failed: %s", name, _message(error))
                    out[name] = error_code(error) if not isinstance(error, e.LogbusError) or error.retriable else ErrorCode.leader_not_available
                    return
            view = (await self.backend.topics([name])).get(name)
            out[name] = view if view is not None else ErrorCode.leader_not_available

        await asyncio.gather(*(one(n) for n in names))
        return out

    async def _find_coordinator(self, request: Request) -> dict:
        # Every gateway reaches the one group coordinator and the one transaction coordinator (both
        # in the controller): each is the coordinator of whatever it is asked about, a group
        # (key_type 0) or a transactional id (key_type 1).
        me = self.backend.broker
        entry = {"node_id": me.broker_id, "host": me.host, "port": me.port, "error_code": ErrorCode.none, "error_message": None}
        keys = _get(request.body, "coordinator_keys", default=None)
        if keys is None:
            return {"throttle_time": 0, **entry}
        return {"throttle_time": 0, "coordinators": [{"key": k, **entry} for k in keys]}

    # --- Produce -------------------------------------------------------------------------------------

    def _send_produce(self, request: Request, connection: Hashable) -> list[tuple[str, int, Awaitable | BaseException]]:
        """Start every partition's batch on its way to its leader, in its turn (see ``_produce_partition``)."""
        body = request.body
        acks = body.acks
        timeout_ms = max(1, _ms(body.timeout))
        logbus_acks: int | str = "all" if acks == -1 else int(acks)
        budget = _DecompressionBudget(REQUEST_DECOMPRESSED_FACTOR * self.max_request_bytes)
        replies: list[tuple[str, int, Awaitable | BaseException]] = []
        for topic in body.topic_data:
            for partition in topic.partition_data:
                # A transactional producer's batches go to the leaders as any idempotent producer's
                # (its AddPartitionsToTxn came first; leaders do not check that, as Kafka's before KIP-890).
                pending = self._produce_partition(connection, topic.name, partition.index, partition.records or b"", logbus_acks, timeout_ms, budget)
                replies.append((topic.name, partition.index, pending))
        return replies

    def _produce_partition(self, connection: Hashable, topic: str, partition: int, records: bytes, acks, timeout_ms: int,
                           budget: _DecompressionBudget) -> asyncio.Task:
        """One partition's batch of a produce request, handed to the leader in its turn.

        The batches a connection sends to one partition are handed to its
        leader in the order they came: each waits for the previous one's turn
        to end. A batch of an idempotent producer ends its turn once handed
        over (the leader puts the producer's batches in sequence order, waiting
        briefly for one that is late); any other batch ends it when its reply
        comes, so one is in flight per partition and connection, as logbus's
        own producer keeps without idempotence: a later batch could otherwise
        overtake it on the way (an actor call and the local channel race, and
        Ray may start one caller's calls out of order).
        """
        key = (connection, topic, partition)
        previous = self._turns.get(key)
        turn = asyncio.get_running_loop().create_future()
        self._turns[key] = turn
        return asyncio.ensure_future(self._produce_in_turn(key, previous, turn, records, acks, timeout_ms, budget))

    async def _produce_in_turn(self, key: tuple, previous: asyncio.Future | None, turn: asyncio.Future, records: bytes, acks,
                               timeout_ms: int, budget: _DecompressionBudget) -> ProduceResponse:
        _, topic, partition = key
        try:
            if previous is not None:
                await asyncio.shield(previous)  # shielded: a cancelled waiter must not end the turn it waits for
            # The topic first (cached, or looked up once for every request waiting on it): an unknown
            # topic or a batch over its max.message.bytes is refused before anything is decoded.
            view = await self.backend.topic(topic)
            produced = _to_logbus(view, topic, partition, records, budget)
            pending = self.backend.produce(topic, partition, produced.encoded, acks, timeout_ms)
            if produced.header.producer_id >= 0:
                self._end_turn(key, turn)
            return await pending
        finally:
            self._end_turn(key, turn)

    def _end_turn(self, key: tuple, turn: asyncio.Future) -> None:
        if not turn.done():
            turn.set_result(None)
        if self._turns.get(key) is turn:
            del self._turns[key]  # the last of its partition and connection: nothing is waiting for it

    async def _produce_replies(self, replies: list) -> dict:
        results = await asyncio.gather(*(_settle(pending) for _, _, pending in replies))
        by_topic: dict[str, list] = {}
        for (topic, partition, _), result in zip(replies, results):
            if isinstance(result, BaseException):
                if not isinstance(result, e.LogbusError) or not result.retriable:
                    logger.info("produce to %s-%d refused: %s", topic, partition, _message(result))
                entry = {"index": partition, "error_code": error_code(result), "base_offset": -1, "log_append_time": -1,
                         "log_start_offset": -1, "record_errors": [], "error_message": _message(result)}
            else:
                entry = {"index": partition, "error_code": ErrorCode.none, "base_offset": result.base_offset,
                         "log_append_time": result.log_append_time_ms, "log_start_offset": result.log_start_offset,
                         "record_errors": [], "error_message": None}
            by_topic.setdefault(topic, []).append(entry)
        return {"responses": [{"name": t, "partition_responses": ps} for t, ps in by_topic.items()], "throttle_time": 0}

    # --- Fetch and ListOffsets -------------------------------------------------------------------------

    async def _fetch(self, request: Request) -> dict:
        body = request.body
        max_wait_ms = max(0, _ms(body.max_wait))
        min_bytes = max(0, int(body.min_bytes))
        total_max = int(_get(body, "max_bytes", default=2**31 - 1))
        isolation = READ_COMMITTED if int(_get(body, "isolation_level", default=READ_UNCOMMITTED)) == READ_COMMITTED else READ_UNCOMMITTED
        wanted = [(t.topic, p.partition, int(p.fetch_offset), max(1, int(p.partition_max_bytes))) for t in body.topics for p in t.partitions]
        results: dict[tuple[str, int], Any] = {}
        # First a look without waiting: partitions with data answer at once.
        immediate = await asyncio.gather(*(_settle(self.backend.fetch(t, p, o, m, 0, isolation)) for t, p, o, m in wanted))
        total = 0
        for (t, p, _, _), result in zip(wanted, immediate):
            results[(t, p)] = result
            if not isinstance(result, BaseException) and result[1] is not None:
                total += len(result[1])
        waiting = []
        for (t, p, offset, m), result in zip(wanted, immediate):
            if isinstance(result, BaseException):
                continue
            meta, data = result
            if data is None:
                waiting.append((t, p, offset, m))
            elif len(data) == 0 and meta.next_offset > offset:
                # Only a compacted gap, up to the high watermark: wait from past it. A Kafka client
                # cannot be told where the gap ends (it would fetch the same offset again at once),
                # but takes batches that start past its position, as from Kafka's compacted logs.
                waiting.append((t, p, meta.next_offset, m))
        if waiting and max_wait_ms > 0 and total < max(min_bytes, 1):
            # Then wait at the leaders for the first data (or the wait's end).
            tasks = {asyncio.ensure_future(_settle(self.backend.fetch(t, p, o, m, max_wait_ms, isolation))): (t, p) for t, p, o, m in waiting}
            deadline = time.monotonic() + max_wait_ms / 1000
            pending = set(tasks)
            try:
                while pending and total < max(min_bytes, 1):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        result = task.result()
                        results[tasks[task]] = result
                        if not isinstance(result, BaseException) and result[1] is not None:
                            total += len(result[1])
            finally:
                # Also when this request is cancelled (its client went away): asyncio.wait leaves them.
                for task in pending:
                    task.cancel()  # its reply, if any, is dropped: the client fetches the partition again
        by_topic: dict[str, list] = {}
        budget = total_max
        for t, p, offset, _ in wanted:
            result = results[(t, p)]
            entry = {"partition_index": p, "error_code": ErrorCode.none, "high_watermark": -1, "last_stable_offset": -1,
                     "log_start_offset": -1, "aborted_transactions": [], "preferred_read_replica": -1, "records": b""}
            if isinstance(result, BaseException):
                entry["error_code"] = error_code(result)
                if not isinstance(result, e.LogbusError) or not result.retriable:
                    logger.debug("fetch of %s-%d at %d failed: %s", t, p, offset, _message(result))
            else:
                meta, data = result
                entry.update(high_watermark=meta.high_watermark, last_stable_offset=meta.last_stable_offset, log_start_offset=meta.log_start_offset)
                if isolation == READ_COMMITTED:
                    # Kafka's consumer drops these transactions' batches (control batches reach it as
                    # Kafka's control batches, which it never hands out).
                    entry["aborted_transactions"] = [{"producer_id": producer_id, "first_offset": first_offset}
                                                     for producer_id, first_offset in meta.aborted_transactions]
                if data is not None and (budget > 0 or budget == total_max):
                    try:
                        records = to_kafka(data)
                    except e.LogbusError as error:
                        entry["error_code"] = error_code(error)
                        logger.warning("fetch of %s-%d at %d: %s", t, p, offset, _message(error))
                    else:
                        entry["records"] = records
                        budget -= len(records)
            by_topic.setdefault(t, []).append(entry)
        return {"throttle_time": 0, "error_code": ErrorCode.none, "session_id": 0,
                "responses": [{"topic": t, "partitions": ps} for t, ps in by_topic.items()]}

    async def _list_offsets(self, request: Request) -> dict:
        # read_committed: the latest offset is the last stable offset (the end of what it may read).
        isolation = READ_COMMITTED if int(_get(request.body, "isolation_level", default=READ_UNCOMMITTED)) == READ_COMMITTED else READ_UNCOMMITTED

        async def one(topic: str, partition: int, timestamp: int) -> dict:
            entry = {"partition_index": partition, "error_code": ErrorCode.none, "timestamp": -1, "offset": -1, "leader_epoch": -1}
            try:
                if request.api_version == 0 and max_offsets.get((topic, partition), 1) < 1:
                    return {**entry, "old_style_offsets": ()}  # asked for no offsets
                start, high_watermark, _ = await self.backend.offsets(topic, partition, isolation)
                if timestamp == LIST_OFFSETS_LATEST:
                    entry["offset"] = high_watermark
                elif timestamp == LIST_OFFSETS_EARLIEST:
                    entry["offset"] = start
                elif timestamp >= 0:
                    offset = await self.backend.offset_for_timestamp(topic, partition, timestamp)
                    if offset >= 0:
                        entry["offset"] = offset
                        entry["timestamp"] = await self._timestamp_at(topic, partition, offset)
                else:
                    entry["error_code"] = ErrorCode.invalid_request  # max timestamp and others: not served
            except Exception as error:  # noqa: BLE001
                entry["error_code"] = error_code(error)
            # Version 0 lists offsets (Kafka's: segment starts before the time, newest first; here the one
            # offset a later version answers, which is the first of Kafka's list).
            entry["old_style_offsets"] = (entry["offset"],) if entry["offset"] >= 0 else ()
            return entry

        by_topic: dict[str, list] = {}
        max_offsets = {(t.name, p.partition_index): int(_get(p, "max_num_offsets", default=1)) for t in request.body.topics for p in t.partitions}
        requests = [(t.name, p.partition_index, int(p.timestamp)) for t in request.body.topics for p in t.partitions]
        entries = await asyncio.gather(*(one(*r) for r in requests))
        for (topic, _, _), entry in zip(requests, entries):
            by_topic.setdefault(topic, []).append(entry)
        return {"throttle_time": 0, "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]}

    async def _timestamp_at(self, topic: str, partition: int, offset: int) -> int:
        """The timestamp of the record at ``offset`` (as Kafka's ListOffsets by time reports it)."""
        _, data = await self.backend.fetch(topic, partition, offset, 1, 0)
        if data is None:
            return -1
        for header, first, records in rb.slice_batches(data, offset, offset + 1):
            if header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME:
                return header.max_timestamp_ms
            return int(records.column(2)[0].as_py())
        return -1

    # --- producer ids and topics ---------------------------------------------------------------------------

    async def _init_producer_id(self, request: Request) -> dict:
        body = request.body
        producer_id, epoch = int(_get(body, "producer_id", default=-1)), int(_get(body, "producer_epoch", default=-1))
        if body.transactional_id is not None:
            # KIP-360: an instance that already holds an id and epoch names them; the coordinator
            # bumps that epoch only if it is still the current one (otherwise the caller is fenced).
            expected = (producer_id, epoch) if producer_id >= 0 else None
            try:
                producer_id, epoch = await self.backend.txn_init_producer_id(body.transactional_id, _ms(body.transaction_timeout), expected)
            except Exception as error:  # noqa: BLE001
                code = txn_error_code(error, request.api_key, request.api_version)
                logger.debug("InitProducerId for %r refused: %s", body.transactional_id, _message(error))
                return {"throttle_time": 0, "error_code": code, "producer_id": -1, "producer_epoch": -1}
            return {"throttle_time": 0, "error_code": ErrorCode.none, "producer_id": producer_id, "producer_epoch": epoch}
        try:
            if producer_id >= 0 and 0 <= epoch < 2**15 - 2:
                # KIP-360: an idempotent producer bumps its epoch after a failed batch; its sequences restart at 0.
                return {"throttle_time": 0, "error_code": ErrorCode.none, "producer_id": producer_id, "producer_epoch": epoch + 1}
            producer_id = await self.backend.allocate_producer_id()
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": error_code(error), "producer_id": -1, "producer_epoch": -1}
        return {"throttle_time": 0, "error_code": ErrorCode.none, "producer_id": producer_id, "producer_epoch": 0}

    # --- transactions (the coordinator's side; partitions' data and markers go through Produce) ------

    async def _txn_call(self, request: Request, call: Awaitable) -> ErrorCode:
        """Await one coordinator call: NONE, or the error's code for this request's version."""
        try:
            await call
        except Exception as error:  # noqa: BLE001 (one answer for the whole request: it is one call)
            logger.debug("%s v%d of %r refused: %s", _TXN_API_NAMES[request.api_key], request.api_version,
                         _get(request.body, "transactional_id", "v3_and_below_transactional_id"), _message(error))
            return txn_error_code(error, request.api_key, request.api_version)
        return ErrorCode.none

    async def _add_partitions_to_txn(self, request: Request) -> dict:
        body = request.body
        topics = body.v3_and_below_topics
        partitions = [TopicPartition(t.name, int(p)) for t in topics for p in t.partitions]
        code = await self._txn_call(request, self.backend.txn_add_partitions(
            body.v3_and_below_transactional_id, int(body.v3_and_below_producer_id), int(body.v3_and_below_producer_epoch), partitions))
        return {"throttle_time": 0, "results_by_topic_v3_and_below": [
            {"name": t.name, "results_by_partition": [{"partition_index": p, "partition_error_code": code} for p in t.partitions]}
            for t in topics
        ]}

    async def _add_offsets_to_txn(self, request: Request) -> dict:
        body = request.body
        code = await self._txn_call(request, self.backend.txn_add_offsets(
            body.transactional_id, int(body.producer_id), int(body.producer_epoch), body.group_id))
        return {"throttle_time": 0, "error_code": code}

    async def _end_txn(self, request: Request) -> dict:
        body = request.body
        code = await self._txn_call(request, self.backend.txn_end(
            body.transactional_id, int(body.producer_id), int(body.producer_epoch), bool(body.committed)))
        return {"throttle_time": 0, "error_code": code}

    async def _txn_offset_commit(self, request: Request) -> dict:
        body = request.body
        offsets = {}
        for topic in body.topics:
            for p in topic.partitions:
                leader_epoch = int(_get(p, "committed_leader_epoch", default=-1))
                offsets[TopicPartition(topic.name, int(p.partition_index))] = OffsetAndMetadata(int(p.committed_offset), p.committed_metadata or "", leader_epoch)
        # Before version 3 (KIP-447) the request names no member: the group's generation is not checked.
        group_metadata = (body.group_id, int(_get(body, "generation_id", default=-1)), _get(body, "member_id", default="") or "",
                          _get(body, "group_instance_id", default=None))
        code = await self._txn_call(request, self.backend.txn_offset_commit(
            body.transactional_id, int(body.producer_id), int(body.producer_epoch), group_metadata, offsets))
        return {"throttle_time": 0, "topics": [
            {"name": t.name, "partitions": [{"partition_index": p.partition_index, "error_code": code} for p in t.partitions]} for t in body.topics
        ]}

    async def _create_topics(self, request: Request) -> dict:
        body = request.body

        async def one(topic) -> dict:
            partitions = self.config.num_partitions if topic.num_partitions == -1 else int(topic.num_partitions)
            replication = self.config.default_replication_factor if topic.replication_factor == -1 else int(topic.replication_factor)
            config = {c.name: c.value for c in topic.configs if c.value is not None}
            result = {"name": topic.name, "topic_id": uuid.UUID(int=0), "error_code": ErrorCode.none, "error_message": None,
                      "topic_config_error_code": 0, "num_partitions": partitions, "replication_factor": replication, "configs": None}
            try:
                if topic.assignments:
                    raise e.InvalidConfigError("replica assignments are logbus's to choose; give a partition count and replication factor")
                LogConfig.from_dict(config)
                if partitions <= 0:
                    raise e.InvalidPartitionsError(f"num_partitions must be positive, not {partitions}")
                if replication <= 0:
                    raise e.InvalidReplicationFactorError(f"replication_factor must be positive, not {replication}")
                existing = await self.backend.topics([topic.name])
                if existing.get(topic.name) is not None:
                    raise e.TopicAlreadyExistsError(f"topic {topic.name!r} already exists")
                if not body.validate_only:
                    await self.backend.create_topic(topic.name, partitions, replication, config)
                    created = (await self.backend.topics([topic.name])).get(topic.name)
                    if created is not None:
                        result["topic_id"] = _topic_uuid(created.topic_id)
            except Exception as error:  # noqa: BLE001
                result.update(error_code=error_code(error), error_message=_message(error))
            return result

        results = await asyncio.gather(*(one(t) for t in body.topics))
        return {"throttle_time": 0, "topics": list(results)}

    async def _delete_topics(self, request: Request) -> dict:
        body = request.body
        # Versions 1-5 name the topics (an empty list: none), version 6 lists topic entries.
        names = list(body.topic_names) if hasattr(body, "topic_names") else [t.name for t in body.topics]

        async def one(name) -> dict:
            result = {"name": name, "topic_id": uuid.UUID(int=0), "error_code": ErrorCode.none, "error_message": None}
            try:
                if name is None:
                    raise e.UnknownTopicError("topics are deleted by name")
                await self.backend.delete_topic(name)
            except Exception as error:  # noqa: BLE001
                result.update(error_code=error_code(error), error_message=_message(error))
            return result

        return {"throttle_time": 0, "responses": list(await asyncio.gather(*(one(n) for n in names)))}

    async def _describe_configs(self, request: Request) -> dict:
        results = []
        for resource in request.body.resources:
            keys = resource.configuration_keys
            entry = {"error_code": ErrorCode.none, "error_message": None, "resource_type": resource.resource_type,
                     "resource_name": resource.resource_name, "configs": []}
            if resource.resource_type == RESOURCE_TOPIC:
                try:
                    view = (await self.backend.topics([resource.resource_name])).get(resource.resource_name)
                except Exception as error:  # noqa: BLE001
                    entry.update(error_code=error_code(error), error_message=_message(error))
                    results.append(entry)
                    continue
                if view is None:
                    entry.update(error_code=ErrorCode.unknown_topic_or_partition, error_message=f"topic {resource.resource_name!r} does not exist")
                else:
                    effective = LogConfig.from_dict(view.config).to_dict()
                    for name, value in effective.items():
                        if keys and name not in keys:
                            continue
                        source = CONFIG_SOURCE_TOPIC if name in view.config else CONFIG_SOURCE_DEFAULT
                        text = str(value).lower() if isinstance(value, bool) else str(value)
                        entry["configs"].append({"name": name, "value": text, "read_only": False, "is_default": source == CONFIG_SOURCE_DEFAULT,
                                                 "config_source": source, "is_sensitive": False, "synonyms": [], "config_type": 0,
                                                 "documentation": None})
            elif resource.resource_type == RESOURCE_BROKER:
                for name, value in self.config.to_dict().items():  # the gateway's broker settings, read-only
                    if keys and name not in keys:
                        continue
                    text = str(value).lower() if isinstance(value, bool) else str(value)
                    entry["configs"].append({"name": name, "value": text, "read_only": True, "is_default": False,
                                             "config_source": CONFIG_SOURCE_STATIC_BROKER, "is_sensitive": False, "synonyms": [],
                                             "config_type": 0, "documentation": None})
            else:
                entry.update(error_code=ErrorCode.invalid_request, error_message=f"resource type {resource.resource_type} is not served")
            results.append(entry)
        return {"throttle_time": 0, "results": results}

    # --- groups ------------------------------------------------------------------------------------------
    #
    # Kafka's classic protocol: the coordinator (GroupCoordinator) elects a leader among the Kafka
    # members, relays their metadata to it and hands out its SyncGroup assignments as they are; a
    # group with a logbus consumer in it is assigned by the coordinator instead, and its Kafka members
    # are told a leader that is none of them (COORDINATOR_LEADER), so they send an empty SyncGroup and
    # get the coordinator's assignment in Kafka's ConsumerProtocol encoding.

    async def _join_group(self, request: Request) -> dict:
        body = request.body
        failure = {"throttle_time": 0, "generation_id": -1, "protocol_type": body.protocol_type, "protocol_name": None,
                   "leader": "", "member_id": body.member_id, "members": []}
        protocols = list(body.protocols)
        if not body.protocol_type or not protocols:
            return {**failure, "error_code": ErrorCode.inconsistent_group_protocol}
        session_ms = _ms(body.session_timeout)
        if not SESSION_TIMEOUT_MS_MIN <= session_ms <= SESSION_TIMEOUT_MS_MAX:
            return {**failure, "error_code": ErrorCode.invalid_session_timeout}
        rebalance_ms = _ms(_get(body, "rebalance_timeout", default=body.session_timeout))
        if rebalance_ms <= 0:
            rebalance_ms = session_ms
        topics, owned = (), ()
        if body.protocol_type == CONSUMER_PROTOCOL:
            # What the members' metadata says, where it can be read: the coordinator needs the topics only
            # when it assigns (a group with logbus consumers), and for descriptions. The bytes go to the
            # leader as they are, readable or not.
            for p in protocols:
                try:
                    subscription = read_subscription(p.metadata)
                except e.LogbusError:
                    continue
                topics, owned = subscription.topics, subscription.owned
                break
        options = {
            "member_id": body.member_id,
            "group_instance_id": _get(body, "group_instance_id"),
            "client_id": _printable(request.client_id) or "kafka",
            "topics": topics,
            "owned": owned,
            "protocols": tuple(p.name for p in protocols),
            "protocol_metadata": tuple(bytes(p.metadata) for p in protocols),
            "protocol_type": body.protocol_type,
            "session_timeout_ms": session_ms,
            "rebalance_timeout_ms": min(rebalance_ms, REBALANCE_TIMEOUT_MS_MAX),
            "max_poll_interval_ms": min(rebalance_ms, REBALANCE_TIMEOUT_MS_MAX),
        }
        try:
            result = await self._join_until_formed(body.group_id, options, min(rebalance_ms, JOIN_WAIT_MS_MAX))
        except Exception as error:  # noqa: BLE001
            return {**failure, "error_code": error_code(error)}
        if not isinstance(result, JoinResult):
            # The generation did not form in time: the member joins again with its id.
            return {**failure, "error_code": ErrorCode.rebalance_in_progress, "member_id": result.member_id}
        members = [{"member_id": m, "group_instance_id": instance, "metadata": metadata} for m, instance, metadata in result.members]
        return {"throttle_time": 0, "error_code": ErrorCode.none, "generation_id": result.generation, "protocol_type": result.protocol_type,
                "protocol_name": result.protocol, "leader": result.leader if result.leader is not None else COORDINATOR_LEADER,
                "member_id": result.member_id, "members": members}

    async def _consumer_group_heartbeat(self, request: Request) -> dict:
        """KIP-848's ConsumerGroupHeartbeat (``group.protocol=consumer``): the coordinator assigns (see
        ``GroupService.consumer_heartbeat``); partitions travel as topic ids."""
        body = request.body
        failure = {"throttle_time": 0, "member_id": body.member_id or None, "member_epoch": -1, "heartbeat_interval": 0, "assignment": None}
        try:
            owned = None
            if body.topic_partitions is not None:
                names = await self._topic_names({tp.topic_id for tp in body.topic_partitions})
                owned = [(names[tp.topic_id], int(p)) for tp in body.topic_partitions if tp.topic_id in names for p in tp.partitions]
            options = {
                "group_instance_id": body.instance_id,
                "rebalance_timeout_ms": _ms(body.rebalance_timeout),
                "topics": None if body.subscribed_topic_names is None else [t for t in body.subscribed_topic_names if _valid_topic_name(t)],
                "pattern": _get(body, "subscribed_topic_regex") or None,  # librdkafka sends "" for none
                "assignor": body.server_assignor,
                "owned": owned,
                "client_id": _printable(request.client_id) or "kafka",
            }
            result = await self.backend.consumer_group_heartbeat(body.group_id, body.member_id, int(body.member_epoch), options)
            assignment = None
            if result["assignment"] is not None:
                partitions = [TopicPartition(*tp) for tp in result["assignment"]]
                topics = sorted({tp.topic for tp in partitions})
                views = await self.backend.topics(topics) if topics else {}
                assignment = {"topic_partitions": [
                    {"topic_id": _topic_uuid(views[t].topic_id), "partitions": tuple(sorted(tp.partition for tp in partitions if tp.topic == t))}
                    for t in topics if views.get(t) is not None]}
        except Exception as error:  # noqa: BLE001
            return {**failure, "error_code": error_code(error), "error_message": _message(error)}
        interval = CONSUMER_HEARTBEAT_INTERVAL_MS_REBALANCING if result["rebalancing"] else CONSUMER_HEARTBEAT_INTERVAL_MS
        return {"throttle_time": 0, "error_code": ErrorCode.none, "error_message": None, "member_id": result["member_id"],
                "member_epoch": result["member_epoch"], "heartbeat_interval": interval, "assignment": assignment}

    async def _topic_names(self, topic_ids: set) -> dict:
        """{topic id: name} for the ids given (those of existing topics), looking every topic up once if one is not cached."""
        known = {_topic_uuid(k): v for k, v in (await self.backend.topic_names_by_id()).items()}
        if not set(topic_ids) <= set(known):
            everything = await self.backend.topics(None)
            known = {_topic_uuid(v.topic_id): n for n, v in everything.items() if v is not None}
        return {i: known[i] for i in topic_ids if i in known}

    async def _join_until_formed(self, group_id: str, options: dict, wait_ms: int):
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            result = await self.backend.group_join(group_id, options, max(0, remaining_ms))
            options["member_id"] = result.member_id
            if isinstance(result, JoinResult) or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(min(result.retry_backoff_ms, 100) / 1000)

    async def _sync_group(self, request: Request) -> dict:
        body = request.body
        reply = {"throttle_time": 0, "protocol_type": _get(body, "protocol_type"), "protocol_name": _get(body, "protocol_name"),
                 "assignment": b""}
        assignments = {}
        for entry in body.assignments:
            data = bytes(entry.assignment)
            try:
                partitions = tuple(parse_assignment(data))  # for descriptions and lag only: the bytes go as they are
            except e.LogbusError:
                partitions = ()
            assignments[entry.member_id] = (data, partitions)
        deadline = time.monotonic() + JOIN_WAIT_MS_MAX / 1000
        try:
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                result = await self.backend.group_sync(body.group_id, body.member_id, body.generation_id, assignments, max(0, remaining_ms),
                                                       _get(body, "group_instance_id"), _get(body, "protocol_type"), _get(body, "protocol_name"))
                assignments = None  # the leader's assignments went with its first call
                if not isinstance(result, SyncPending) or time.monotonic() >= deadline:
                    break
        except Exception as error:  # noqa: BLE001
            return {**reply, "error_code": error_code(error)}
        if isinstance(result, SyncPending):
            return {**reply, "error_code": ErrorCode.rebalance_in_progress}
        if result.leader is not None:
            assignment = result.assignment_bytes or b""  # the leader's bytes, as they are
        else:
            assignment = encode_assignment(result.assignment)  # the coordinator's
        return {**reply, "error_code": ErrorCode.none, "protocol_type": result.protocol_type, "protocol_name": result.protocol,
                "assignment": assignment}

    async def _heartbeat(self, request: Request) -> dict:
        body = request.body
        try:
            result = await self.backend.group_heartbeat(body.group_id, body.member_id, body.generation_id, _get(body, "group_instance_id"))
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": error_code(error)}
        code = ErrorCode.rebalance_in_progress if result.rejoin else ErrorCode.none
        return {"throttle_time": 0, "error_code": code}

    async def _leave_group(self, request: Request) -> dict:
        body = request.body
        members = _get(body, "members", default=None)
        identities = [(m.member_id, m.group_instance_id) for m in members] if members is not None else [(body.member_id, None)]
        responses, top = [], ErrorCode.none
        for member_id, instance_id in identities:
            code = ErrorCode.none
            try:
                if not await self.backend.group_leave(body.group_id, member_id, instance_id):
                    code = ErrorCode.unknown_member_id
            except Exception as error:  # noqa: BLE001
                code = error_code(error)
            responses.append({"member_id": member_id, "group_instance_id": instance_id, "error_code": code})
            if members is None:
                top = code
        return {"throttle_time": 0, "error_code": top, "members": responses}

    async def _offset_commit(self, request: Request) -> dict:
        body = request.body
        generation = int(_get(body, "generation_id_or_member_epoch", "generation_id", default=-1))
        retention_ms = _get(body, "retention_time", default=None)
        retention_ms = None if retention_ms is None or _ms(retention_ms) < 0 else _ms(retention_ms)
        offsets, codes = {}, {}
        for topic in body.topics:
            for p in topic.partitions:
                tp = TopicPartition(topic.name, int(p.partition_index))
                metadata = p.committed_metadata or ""
                if len(metadata.encode()) > OFFSET_METADATA_BYTES_MAX:
                    codes[tp] = ErrorCode.offset_metadata_too_large
                    continue
                leader_epoch = int(_get(p, "committed_leader_epoch", default=-1))
                if int(p.committed_offset) < 0:
                    codes[tp] = ErrorCode.invalid_commit_offset_size
                    continue
                offsets[tp] = OffsetAndMetadata(int(p.committed_offset), metadata, leader_epoch)
        code = ErrorCode.none
        if offsets:
            try:
                await self.backend.commit_offsets(body.group_id, body.member_id, generation, offsets, _get(body, "group_instance_id"),
                                                  retention_ms)
            except Exception as error:  # noqa: BLE001 (one answer for the whole commit: it is one append)
                code = error_code(error)
                logger.debug("group %s: commit refused: %s", body.group_id, _message(error))
        return {"throttle_time": 0, "topics": [
            {"name": t.name, "partitions": [{"partition_index": p.partition_index,
                                             "error_code": codes.get(TopicPartition(t.name, int(p.partition_index)), code)}
                                            for p in t.partitions]} for t in body.topics
        ]}

    async def _offset_fetch(self, request: Request) -> dict:
        body = request.body
        try:
            if body.topics is None:
                description = await self.backend.describe_group(body.group_id)
                partitions = [TopicPartition(r["topic"], r["partition"]) for r in description["offsets"] if r["current_offset"] is not None]
            else:
                partitions = [TopicPartition(t.name, int(p)) for t in body.topics for p in t.partition_indexes]
            committed = await self.backend.fetch_committed(body.group_id, partitions) if partitions else {}
        except e.InvalidGroupIdError:
            committed, partitions = {}, [] if body.topics is None else [TopicPartition(t.name, int(p)) for t in body.topics for p in t.partition_indexes]
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "topics": [], "error_code": error_code(error)}
        by_topic: dict[str, list] = {}
        for tp in partitions:
            om = committed.get(tp)
            by_topic.setdefault(tp.topic, []).append({
                "partition_index": tp.partition,
                "committed_offset": -1 if om is None else om.offset,
                "committed_leader_epoch": -1 if om is None else om.leader_epoch,
                "metadata": "" if om is None else om.metadata,
                "error_code": ErrorCode.none,
            })
        return {"throttle_time": 0, "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()], "error_code": ErrorCode.none}

    async def _describe_groups(self, request: Request) -> dict:
        groups = []
        for group_id in request.body.groups:
            entry = {"error_code": ErrorCode.none, "group_id": group_id, "group_state": "Dead", "protocol_type": "",
                     "protocol_data": "", "members": [], "authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS}
            try:
                d = await self.backend.describe_group(group_id)
            except e.InvalidGroupIdError:
                groups.append(entry)  # as Kafka: an unknown group is Dead, with no error
                continue
            except Exception as error:  # noqa: BLE001
                groups.append({**entry, "error_code": error_code(error)})
                continue
            entry.update(group_state=d["state"], protocol_type=d.get("protocol_type") or ("" if not d["members"] else CONSUMER_PROTOCOL),
                         protocol_data=d["protocol"] or "")
            entry["members"] = [_described_member(m, d.get("leader")) for m in d["members"]]
            groups.append(entry)
        return {"throttle_time": 0, "groups": groups}

    async def _list_groups(self, request: Request) -> dict:
        states = set(_get(request.body, "states_filter", default=()) or ())
        try:
            listed = await self.backend.list_groups()
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": error_code(error), "groups": []}
        groups = [{"group_id": g[0], "protocol_type": g[3] if len(g) > 3 else CONSUMER_PROTOCOL, "group_state": g[1]}
                  for g in listed if not states or g[1] in states]
        return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}


_TXN_API_NAMES = {INIT_PRODUCER_ID: "InitProducerId", ADD_PARTITIONS_TO_TXN: "AddPartitionsToTxn", ADD_OFFSETS_TO_TXN: "AddOffsetsToTxn",
                  END_TXN: "EndTxn", TXN_OFFSET_COMMIT: "TxnOffsetCommit"}


# --- helpers -----------------------------------------------------------------------------------------------


def _described_member(m: dict, leader: str | None) -> dict:
    """A member as DescribeGroups shows it: a Kafka member's metadata and (classic) assignment as they are;
    a logbus consumer's, or a coordinator's assignment, in Kafka's ConsumerProtocol encoding."""
    partitions = [TopicPartition(*tp) for tp in m["assignment"]]
    metadata = m.get("metadata")
    if metadata is None:
        metadata = encode_subscription(m.get("topics") or sorted({tp.topic for tp in partitions}))
    assignment = m.get("assignment_bytes") if leader is not None else None
    if assignment is None:
        assignment = encode_assignment(partitions)
    return {"member_id": m["member_id"], "group_instance_id": m["group_instance_id"], "client_id": m["client_id"], "client_host": "",
            "member_metadata": metadata, "member_assignment": assignment}


def _valid_topic_name(name) -> bool:
    try:
        validate_topic_name(name)
    except e.LogbusError:
        return False
    return True


def _printable(text: str | None) -> str | None:
    """A client id as the coordinator keeps it: printable, at most 255 characters."""
    if text is None:
        return None
    return "".join(c for c in text if c.isprintable())[:255]


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _topic_uuid(topic_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(hex=topic_id)
    except (ValueError, TypeError):
        return uuid.UUID(int=0)


async def _settle(pending):
    """The result of an awaitable, or the exception it raised (as a value)."""
    if isinstance(pending, BaseException):
        return pending
    try:
        return await pending
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001
        return error


async def _done(value):
    return value


async def _finished(decision: Decision, values: Awaitable[dict]) -> dict:
    return decision.finish(await values)


def _refused_produce(body, code: ErrorCode, message: str) -> dict:
    """The response values of a produce request refused whole: every partition answers ``code``."""
    return {"throttle_time": 0, "responses": [{"name": t.name, "partition_responses": [
        {"index": p.index, "error_code": code, "base_offset": -1, "log_append_time": -1, "log_start_offset": -1, "record_errors": [],
         "error_message": message} for p in t.partition_data]} for t in body.topic_data]}


async def _discard(replies: list) -> None:
    """acks=0: wait for the writes (so a connection's requests stay bounded), answer nothing."""
    results = await asyncio.gather(*(_settle(pending) for _, _, pending in replies))
    for (topic, partition, _), result in zip(replies, results):
        if isinstance(result, BaseException):
            logger.debug("acks=0 produce to %s-%d failed: %s", topic, partition, _message(result))
    return None
