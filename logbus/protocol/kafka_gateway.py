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
import dataclasses
import datetime
import functools
import io
import logging
import struct
import time
import typing
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Hashable, Mapping, Protocol

from kio.index import load_request_schema, load_response_schema
from kio.schema.consumer_protocol_assignment.v0 import ConsumerProtocolAssignment
from kio.schema.consumer_protocol_subscription.v0 import ConsumerProtocolSubscription as SubscriptionV0
from kio.schema.consumer_protocol_subscription.v1 import ConsumerProtocolSubscription as SubscriptionV1
from kio.schema.consumer_protocol_subscription.v2 import ConsumerProtocolSubscription as SubscriptionV2
from kio.schema.consumer_protocol_subscription.v3 import ConsumerProtocolSubscription as SubscriptionV3
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer
from kio.serial.errors import SerialError

from logbus import errors as e
from logbus.protocol.group_coordinator import HeartbeatResult, JoinPending, JoinResult, OffsetAndMetadata
from logbus.protocol.kafka_records import DECOMPRESSED_MAX_BYTES, ProducedBatch, to_kafka, to_logbus
from logbus.protocol.messages import READ_COMMITTED, READ_UNCOMMITTED, FetchResponse, ProduceResponse, TopicPartition
from logbus.storage import record_batch as rb
from logbus.storage.log_config import LogConfig
from logbus.storage.names import INTERNAL_TOPIC_PREFIX

logger = logging.getLogger(__name__)

# API keys served, and the versions of each: within what kio has, and what current kcat
# (librdkafka), kafka-python, aiokafka and confluent-kafka ask for. Fetch stays below v13 and
# Metadata below v13 (topic ids instead of names); Produce below v10, JoinGroup below v8 (reasons),
# OffsetCommit below v9 and OffsetFetch below v8 (KIP-848's and batched forms).
PRODUCE, FETCH, LIST_OFFSETS, METADATA = 0, 1, 2, 3
OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR, JOIN_GROUP, HEARTBEAT, LEAVE_GROUP, SYNC_GROUP = 8, 9, 10, 11, 12, 13, 14
DESCRIBE_GROUPS, LIST_GROUPS, API_VERSIONS, CREATE_TOPICS, DELETE_TOPICS, INIT_PRODUCER_ID = 15, 16, 18, 19, 20, 22
ADD_PARTITIONS_TO_TXN, ADD_OFFSETS_TO_TXN, END_TXN, TXN_OFFSET_COMMIT = 24, 25, 26, 28
DESCRIBE_CONFIGS = 32
API_VERSIONS_SERVED: dict[int, tuple[int, int]] = {
    PRODUCE: (3, 9),
    FETCH: (4, 12),
    LIST_OFFSETS: (1, 7),
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
}

MAX_REQUEST_BYTES_DEFAULT = 100 << 20  # Kafka's socket.request.max.bytes
REQUEST_DECOMPRESSED_FACTOR = 4  # a produce request's batches may decompress to this many times max_request_bytes, in all
CONSUMER_PROTOCOL = "consumer"
COORDINATOR_LEADER = "logbus-coordinator"  # the group leader every member is told of: none of them
GROUP_PROTOCOLS = ("range", "roundrobin", "cooperative-sticky")  # the strategies logbus's coordinator has
JOIN_WAIT_MS_MAX = 300_000  # a JoinGroup is held at most this long (or its rebalance timeout)
DEFAULT_PARTITIONS = 1  # CreateTopics with num_partitions -1
DEFAULT_REPLICATION_FACTOR = 1  # and replication_factor -1
LIST_OFFSETS_LATEST, LIST_OFFSETS_EARLIEST, LIST_OFFSETS_MAX_TIMESTAMP = -1, -2, -3
RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4
CONFIG_SOURCE_TOPIC, CONFIG_SOURCE_DEFAULT = 1, 5
# The first version of each transactional API whose clients know PRODUCER_FENCED (KIP-588); older
# ones are told INVALID_PRODUCER_EPOCH, as Kafka tells them.
PRODUCER_FENCED_SINCE = {INIT_PRODUCER_ID: 4, ADD_PARTITIONS_TO_TXN: 2, ADD_OFFSETS_TO_TXN: 2, END_TXN: 2}
JOINS_REMEMBERED_MAX = 10_000  # join results kept for SyncGroup (one per member, the latest)
_SIZE = struct.Struct(">i")
_KEY_AND_VERSION = struct.Struct(">hhi")
_VERSION = struct.Struct(">h")


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

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int) -> HeartbeatResult:
        """A member's heartbeat; the result says whether it must join again."""

    async def group_leave(self, group_id: str, member_id: str) -> bool:
        """Take a member out of its group; False if it was not a member."""

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict) -> None:
        """Commit ``offsets`` ({TopicPartition: OffsetAndMetadata}) for a member of the generation."""

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        """{TopicPartition: OffsetAndMetadata or None}: the group's committed offsets of ``partitions``."""

    async def describe_group(self, group_id: str) -> dict:
        """The group's state, protocol, members (with their assignments) and committed offsets per partition."""

    async def list_groups(self) -> list[tuple[str, str, str | None]]:
        """(group id, state, protocol) of every group."""

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
    (e.ProducerFencedError, ErrorCode.invalid_producer_epoch),
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
    (e.TopicAlreadyExistsError, ErrorCode.topic_already_exists),
    (e.InvalidTopicError, ErrorCode.invalid_topic_exception),
    (e.InvalidPartitionsError, ErrorCode.invalid_partitions),
    (e.InvalidReplicationFactorError, ErrorCode.invalid_replication_factor),
    (e.NodeCapacityError, ErrorCode.policy_violation),
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


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any  # the kio request entity


@functools.cache
def _request_codec(api_key: int, api_version: int):
    cls = load_request_schema(api_key, api_version)
    return cls, entity_reader(cls.__header_schema__), entity_reader(cls)


@functools.cache
def _response_codec(api_key: int, api_version: int):
    cls = load_response_schema(api_key, api_version)
    return cls, entity_writer(cls.__header_schema__), cls.__header_schema__, entity_writer(cls)


def peek_header(frame: bytes) -> tuple[int, int, int]:
    """(api key, api version, correlation id) of a request frame; KafkaProtocolError if it is too short."""
    if len(frame) < _KEY_AND_VERSION.size:
        raise e.KafkaProtocolError(f"a request of {len(frame)} bytes has no header")
    return _KEY_AND_VERSION.unpack_from(frame, 0)


def parse_request(frame: bytes) -> Request:
    """Read one request frame (without its size prefix); KafkaProtocolError if it cannot be served."""
    frame = bytes(frame)  # kio reads read-only buffers only
    api_key, api_version, correlation_id = peek_header(frame)
    versions = API_VERSIONS_SERVED.get(api_key)
    if versions is None:
        raise e.KafkaProtocolError(f"API key {api_key} is not served")
    if not versions[0] <= api_version <= versions[1]:
        raise e.KafkaProtocolError(f"API key {api_key} version {api_version} is not served (versions {versions[0]}-{versions[1]})")
    cls, read_header, read_body = _request_codec(api_key, api_version)
    try:
        header, header_size = read_header(frame, 0)
        body, body_size = read_body(frame, header_size)
    except (SerialError, ValueError, TypeError, OverflowError, IndexError, UnicodeDecodeError) as error:
        raise e.KafkaProtocolError(f"malformed {cls.__name__} v{api_version}: {type(error).__name__}: {error}") from None
    if header_size + body_size > len(frame):
        raise e.KafkaProtocolError(f"{cls.__name__} v{api_version} runs past its frame")
    # Bytes after the request are ignored, as Kafka's brokers ignore them (librdkafka's admin client
    # sends some after a Metadata v12).
    return Request(api_key, api_version, correlation_id, header.client_id, body)


def encode_response(api_key: int, api_version: int, correlation_id: int, values: Mapping) -> bytes:
    """The response frame, size prefix included, of the given API version built from ``values``."""
    cls, write_header, header_cls, write_body = _response_codec(api_key, api_version)
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    write_header(out, header_cls(correlation_id=correlation_id))
    write_body(out, build(cls, values))
    frame = out.getbuffer()
    _SIZE.pack_into(frame, 0, len(frame) - 4)
    del frame
    return out.getvalue()


def _nested_class(field_type) -> tuple[type | None, bool]:
    """(the entity class of a field, whether the field is a tuple of them)."""
    if dataclasses.is_dataclass(field_type):
        return field_type, False
    origin = typing.get_origin(field_type)
    for arg in typing.get_args(field_type):
        if dataclasses.is_dataclass(arg):
            return arg, origin is tuple
        inner, is_tuple = _nested_class(arg)
        if inner is not None:
            return inner, is_tuple or origin is tuple
    return None, False


@functools.cache
def _fields(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, f.metadata.get("kafka_type"), *_nested_class(hints[f.name])) for f in dataclasses.fields(cls))


def build(cls, values: Mapping):
    """A kio entity of ``cls`` from plain values: fields the class lacks are left out, nested dicts
    become its nested entities, ms become timedeltas, codes ErrorCodes, hex ids UUIDs."""
    kwargs = {}
    for name, kafka_type, nested, is_tuple in _fields(cls):
        if name not in values:
            continue
        value = values[name]
        if nested is not None:
            if is_tuple:
                value = tuple(build(nested, v) for v in value) if value is not None else None
            elif value is not None:
                value = build(nested, value)
        elif kafka_type in ("timedelta_i32", "timedelta_i64"):
            value = datetime.timedelta(milliseconds=value)
        elif kafka_type == "datetime_i64":
            value = None if value is None or value < 0 else datetime.datetime.fromtimestamp(value / 1000, datetime.UTC)
        elif kafka_type == "error_code":
            value = ErrorCode(int(value))
        elif kafka_type == "uuid" and isinstance(value, str):
            value = uuid.UUID(value)
        kwargs[name] = value
    return cls(**kwargs)


def _ms(value) -> int:
    """A kio timedelta (or int) in ms."""
    return int(value.total_seconds() * 1000) if isinstance(value, datetime.timedelta) else int(value)


def _get(entity, *names, default=None):
    """The first of ``names`` that this version of the entity has."""
    for name in names:
        if hasattr(entity, name):
            return getattr(entity, name)
    return default


# --- the consumer protocol (a member's subscription and assignment bytes) --------------------------

_SUBSCRIPTIONS = {0: SubscriptionV0, 1: SubscriptionV1, 2: SubscriptionV2, 3: SubscriptionV3}


def parse_subscription(metadata: bytes) -> tuple[tuple[str, ...], tuple[TopicPartition, ...]]:
    """(topics, owned partitions) of a ConsumerProtocolSubscription; newer versions read as the newest known."""
    if len(metadata) < 2:
        raise e.InvalidConfigError("a consumer subscription of fewer than 2 bytes")
    (version,) = _VERSION.unpack_from(metadata, 0)
    cls = _SUBSCRIPTIONS[min(max(version, 0), 3)]
    try:
        subscription, _ = entity_reader(cls)(metadata, 2)
    except (SerialError, ValueError, TypeError, IndexError, UnicodeDecodeError) as error:
        raise e.InvalidConfigError(f"unreadable consumer subscription: {error}") from None
    owned = tuple(TopicPartition(tp.topic, int(p)) for tp in getattr(subscription, "owned_partitions", ()) for p in tp.partitions)
    return tuple(subscription.topics), owned


def encode_subscription(topics) -> bytes:
    """A ConsumerProtocolSubscription (version 0) of ``topics``, without user data: how DescribeGroups shows a member's subscription."""
    out = io.BytesIO()
    out.write(_VERSION.pack(0))
    entity_writer(SubscriptionV0)(out, SubscriptionV0(topics=tuple(topics), user_data=None))
    return out.getvalue()


def encode_assignment(partitions) -> bytes:
    """A ConsumerProtocolAssignment (version 0) of ``partitions`` (TopicPartitions)."""
    by_topic: dict[str, list[int]] = {}
    for topic, partition in sorted(partitions):
        by_topic.setdefault(topic, []).append(partition)
    assignment = build(ConsumerProtocolAssignment, {"assigned_partitions": [{"topic": t, "partitions": tuple(ps)} for t, ps in by_topic.items()], "user_data": None})
    out = io.BytesIO()
    out.write(_VERSION.pack(0))
    entity_writer(ConsumerProtocolAssignment)(out, assignment)
    return out.getvalue()


def parse_assignment(data: bytes) -> tuple[TopicPartition, ...]:
    """The partitions of a ConsumerProtocolAssignment (any version: later ones add fields after these)."""
    if len(data) < 2:
        return ()
    assignment, _ = entity_reader(ConsumerProtocolAssignment)(data, 2)
    return tuple(TopicPartition(tp.topic, int(p)) for tp in assignment.assigned_partitions for p in tp.partitions)


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


class KafkaHandler:
    """Serves Kafka requests against a :class:`Backend` (see the module docstring).

    One per gateway; shared by its connections. It remembers the latest
    JoinGroup result of each member (for its SyncGroup) and nothing else.
    """

    def __init__(self, backend: Backend, *, max_request_bytes: int = MAX_REQUEST_BYTES_DEFAULT) -> None:
        self.backend = backend
        self.max_request_bytes = max_request_bytes
        self._joins: dict[tuple[str, str], tuple[JoinResult, dict]] = {}  # (group, member) -> (result, options)
        # (connection, topic, partition) -> the turn of the latest batch sent there (see _produce_partition).
        self._turns: dict[tuple[Hashable, str, int], asyncio.Future] = {}
        self.requests_served: dict[tuple[int, int], int] = {}  # by (API key, version): for tests and `stats()`
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
        }

    def start(self, frame: bytes, connection: Hashable = None) -> Awaitable[bytes | None]:
        """Begin serving one request frame; the awaitable gives the response frame (None: send nothing).

        Parsing happens here, before this returns; raises KafkaProtocolError for
        a frame that cannot be served (close the connection). ``connection``
        identifies the connection the frame came on: a produce request's batches
        take their turn behind the same connection's earlier batches for the
        same partition (see ``_produce_partition``), so each connection's
        records reach every partition in the order they were sent. Called on
        the event loop that awaits the result.
        """
        api_key, api_version, correlation_id = peek_header(frame)
        if api_key == API_VERSIONS and api_version > API_VERSIONS_SERVED[API_VERSIONS][1]:
            # Kafka answers an ApiVersions it does not know in version 0, so the client can retry lower.
            return _done(encode_response(API_VERSIONS, 0, correlation_id, self._versions_values(ErrorCode.unsupported_version)))
        request = parse_request(frame)
        served = (api_key, api_version)
        self.requests_served[served] = self.requests_served.get(served, 0) + 1
        if api_key == PRODUCE:
            if request.body.acks not in (0, 1, -1):
                return self._respond(request, _done(_refused_produce(request.body, ErrorCode.invalid_required_acks,
                                                                     f"acks must be 0, 1 or -1, not {request.body.acks}")))
            replies = self._send_produce(request, connection)  # each batch in its partition's turn
            if request.body.acks == 0:
                return _discard(replies)
            return self._respond(request, self._produce_replies(replies))
        return self._respond(request, self._handlers[api_key](request))

    async def _respond(self, request: Request, values) -> bytes:
        values = await values
        return encode_response(request.api_key, request.api_version, request.correlation_id, values)

    # --- ApiVersions, Metadata, FindCoordinator -----------------------------------------------------

    def _versions_values(self, code: ErrorCode = ErrorCode.none) -> dict:
        return {
            "error_code": code,
            "api_keys": [{"api_key": k, "min_version": lo, "max_version": hi} for k, (lo, hi) in sorted(API_VERSIONS_SERVED.items())],
            "throttle_time": 0,
        }

    async def _api_versions(self, request: Request) -> dict:
        return self._versions_values()

    def _broker_values(self, broker: Broker) -> dict:
        return {"node_id": broker.broker_id, "host": broker.host, "port": broker.port, "rack": None}

    async def _metadata(self, request: Request) -> dict:
        body = request.body
        if body.topics is None or (request.api_version == 0 and not body.topics):
            names = None  # every topic (in version 0, an empty list means every topic too)
        else:
            names = [t.name for t in body.topics if t.name is not None]
        views = await self.backend.topics(names)
        topics = []
        for name, view in views.items():
            if view is None:
                topics.append({"error_code": ErrorCode.unknown_topic_or_partition, "name": name, "topic_id": uuid.UUID(int=0),
                               "is_internal": False, "partitions": []})
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
                           "topic_authorized_operations": -(2**31)})
        return {
            "throttle_time": 0,
            "brokers": [self._broker_values(b) for b in self.backend.brokers()],
            "cluster_id": self.backend.cluster_id,
            "controller_id": self.backend.broker.broker_id,
            "topics": topics,
            "cluster_authorized_operations": -(2**31),
        }

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
            return entry

        by_topic: dict[str, list] = {}
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
            partitions = DEFAULT_PARTITIONS if topic.num_partitions == -1 else int(topic.num_partitions)
            replication = DEFAULT_REPLICATION_FACTOR if topic.replication_factor == -1 else int(topic.replication_factor)
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
                view = (await self.backend.topics([resource.resource_name])).get(resource.resource_name)
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
            elif resource.resource_type != RESOURCE_BROKER:
                entry.update(error_code=ErrorCode.invalid_request, error_message=f"resource type {resource.resource_type} is not served")
            results.append(entry)
        return {"throttle_time": 0, "results": results}

    # --- groups ------------------------------------------------------------------------------------------

    async def _join_group(self, request: Request) -> dict:
        body = request.body
        failure = {"throttle_time": 0, "generation_id": -1, "protocol_type": CONSUMER_PROTOCOL, "protocol_name": None,
                   "leader": "", "member_id": body.member_id, "members": []}
        if body.protocol_type != CONSUMER_PROTOCOL:
            return {**failure, "error_code": ErrorCode.inconsistent_group_protocol}
        protocols = [p for p in body.protocols if p.name in GROUP_PROTOCOLS]
        if not protocols:
            return {**failure, "error_code": ErrorCode.inconsistent_group_protocol}
        try:
            topics, owned = parse_subscription(protocols[0].metadata)
        except e.LogbusError:
            return {**failure, "error_code": ErrorCode.inconsistent_group_protocol}
        session_ms = _ms(body.session_timeout)
        rebalance_ms = _ms(_get(body, "rebalance_timeout", default=body.session_timeout))
        if rebalance_ms < 0:
            rebalance_ms = session_ms
        options = {
            "member_id": body.member_id,
            "group_instance_id": _get(body, "group_instance_id"),
            "client_id": request.client_id or "kafka",
            "topics": topics,
            "owned": owned,
            "protocols": tuple(p.name for p in protocols),
            "session_timeout_ms": session_ms,
            "rebalance_timeout_ms": rebalance_ms,
            "max_poll_interval_ms": rebalance_ms,
        }
        try:
            result = await self._join_until_formed(body.group_id, options, min(rebalance_ms, JOIN_WAIT_MS_MAX))
        except Exception as error:  # noqa: BLE001
            return {**failure, "error_code": error_code(error)}
        if not isinstance(result, JoinResult):
            # The generation did not form in time: the member joins again with its id.
            return {**failure, "error_code": ErrorCode.rebalance_in_progress, "member_id": result.member_id}
        self._remember_join(body.group_id, result, options)
        return {"throttle_time": 0, "error_code": ErrorCode.none, "generation_id": result.generation, "protocol_type": CONSUMER_PROTOCOL,
                "protocol_name": result.protocol, "leader": COORDINATOR_LEADER, "member_id": result.member_id, "members": []}

    async def _join_until_formed(self, group_id: str, options: dict, wait_ms: int):
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            result = await self.backend.group_join(group_id, options, max(0, remaining_ms))
            options["member_id"] = result.member_id
            if isinstance(result, JoinResult) or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(min(result.retry_backoff_ms, 100) / 1000)

    def _remember_join(self, group_id: str, result: JoinResult, options: dict) -> None:
        key = (group_id, result.member_id)
        self._joins.pop(key, None)
        self._joins[key] = (result, dict(options))
        while len(self._joins) > JOINS_REMEMBERED_MAX:
            self._joins.pop(next(iter(self._joins)))

    async def _sync_group(self, request: Request) -> dict:
        body = request.body
        reply = {"throttle_time": 0, "protocol_type": CONSUMER_PROTOCOL, "protocol_name": None, "assignment": b""}
        remembered = self._joins.get((body.group_id, body.member_id))
        if remembered is None or remembered[0].generation != body.generation_id:
            # Joined through another gateway, or this one restarted: the coordinator says it again.
            options = dict(remembered[1]) if remembered is not None else None
            if options is None:
                return {**reply, "error_code": ErrorCode.rebalance_in_progress}
            try:
                result = await self.backend.group_join(body.group_id, options, 0)
            except Exception as error:  # noqa: BLE001
                return {**reply, "error_code": error_code(error)}
            if not isinstance(result, JoinResult) or result.generation != body.generation_id:
                return {**reply, "error_code": ErrorCode.rebalance_in_progress}
            self._remember_join(body.group_id, result, options)
        else:
            result = remembered[0]
        return {**reply, "error_code": ErrorCode.none, "protocol_name": result.protocol, "assignment": encode_assignment(result.assignment)}

    async def _heartbeat(self, request: Request) -> dict:
        body = request.body
        try:
            result = await self.backend.group_heartbeat(body.group_id, body.member_id, body.generation_id)
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
                if not await self.backend.group_leave(body.group_id, member_id):
                    code = ErrorCode.unknown_member_id
            except Exception as error:  # noqa: BLE001
                code = error_code(error)
            self._joins.pop((body.group_id, member_id), None)
            responses.append({"member_id": member_id, "group_instance_id": instance_id, "error_code": code})
            if members is None:
                top = code
        return {"throttle_time": 0, "error_code": top, "members": responses}

    async def _offset_commit(self, request: Request) -> dict:
        body = request.body
        generation = int(_get(body, "generation_id_or_member_epoch", "generation_id", default=-1))
        offsets = {}
        for topic in body.topics:
            for p in topic.partitions:
                leader_epoch = int(_get(p, "committed_leader_epoch", default=-1))
                offsets[TopicPartition(topic.name, int(p.partition_index))] = OffsetAndMetadata(int(p.committed_offset), p.committed_metadata or "", leader_epoch)
        code = ErrorCode.none
        try:
            await self.backend.commit_offsets(body.group_id, body.member_id, generation, offsets)
        except Exception as error:  # noqa: BLE001 (one answer for the whole commit: it is one append)
            code = error_code(error)
            logger.debug("group %s: commit refused: %s", body.group_id, _message(error))
        return {"throttle_time": 0, "topics": [
            {"name": t.name, "partitions": [{"partition_index": p.partition_index, "error_code": code} for p in t.partitions]} for t in body.topics
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
                     "protocol_data": "", "members": [], "authorized_operations": -(2**31)}
            try:
                d = await self.backend.describe_group(group_id)
            except e.InvalidGroupIdError:
                groups.append(entry)  # as Kafka: an unknown group is Dead, with no error
                continue
            except Exception as error:  # noqa: BLE001
                groups.append({**entry, "error_code": error_code(error)})
                continue
            entry.update(group_state=d["state"], protocol_type=CONSUMER_PROTOCOL, protocol_data=d["protocol"] or "")
            entry["members"] = [{
                "member_id": m["member_id"], "group_instance_id": m["group_instance_id"], "client_id": m["client_id"], "client_host": "",
                "member_metadata": encode_subscription(sorted({tp[0] for tp in m["assignment"]})),
                "member_assignment": encode_assignment(TopicPartition(*tp) for tp in m["assignment"]),
            } for m in d["members"]]
            groups.append(entry)
        return {"throttle_time": 0, "groups": groups}

    async def _list_groups(self, request: Request) -> dict:
        states = set(_get(request.body, "states_filter", default=()) or ())
        try:
            listed = await self.backend.list_groups()
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": error_code(error), "groups": []}
        groups = [{"group_id": g, "protocol_type": CONSUMER_PROTOCOL, "group_state": state} for g, state, _ in listed if not states or state in states]
        return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}


_TXN_API_NAMES = {INIT_PRODUCER_ID: "InitProducerId", ADD_PARTITIONS_TO_TXN: "AddPartitionsToTxn", ADD_OFFSETS_TO_TXN: "AddOffsetsToTxn",
                  END_TXN: "EndTxn", TXN_OFFSET_COMMIT: "TxnOffsetCommit"}


# --- helpers -----------------------------------------------------------------------------------------------


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
