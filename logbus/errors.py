"""The one error tree of logbus.

Every error a user can see derives from :class:`LogbusError`. Each class says
whether retrying the same request may succeed (``retriable``), the way Kafka's
error codes do, and is named after Kafka's code where it means the same thing.

Errors say whose fault they are: bad input from the caller (``InvalidTopicError``,
``RecordTooLargeError``, ...) is never retriable; a transient state of the
cluster (``NotLeaderError``, ``NotEnoughReplicasError``, timeouts) is.
"""

from __future__ import annotations

import copy


def copy_error(error: BaseException) -> BaseException:
    """A caller's own copy of an error that several callers share (a failed batch's, a transaction's
    fatal one): the same type, arguments and attributes, a list of notes of its own, and the
    original's cause, but no traceback yet.

    Raising a shared error adds each caller's frames to its one traceback, so whatever keeps the
    error (a batch, a transaction) keeps those frames and what they hold: a cycle, when a frame holds
    futures of the batch, that the garbage collector cannot see whole where the producer's C path
    leaves futures untracked (logbus/api/_fastsend.c). An error that cannot be rebuilt from its
    arguments is returned as it is.
    """
    try:
        own = copy.copy(error)
    except Exception:  # noqa: BLE001 (an exception type whose arguments do not rebuild it)
        return error
    if type(own) is not type(error):
        return error
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        own.__notes__ = list(notes)
    own.__cause__ = error.__cause__
    own.__suppress_context__ = error.__suppress_context__
    own.__traceback__ = None
    return own


class LogbusError(Exception):
    """Base of every logbus error."""

    retriable: bool = False


class RetriableError(LogbusError):
    """The request may succeed if it is sent again (after a metadata refresh)."""

    retriable = True


# --- caller errors: bad input, never retriable -----------------------------------


class InvalidTopicError(LogbusError, ValueError):
    """The topic name is empty, '.', '..', too long, or has characters outside [a-zA-Z0-9._-]."""


class InvalidConfigError(LogbusError, ValueError):
    """A topic, producer or consumer setting is unknown or out of range."""


class SerializationError(LogbusError, ValueError):
    """A key or value serializer (producer) or deserializer (consumer) failed; the message names the
    record (topic, partition, offset where known) and the cause."""


class InvalidRecordError(LogbusError, ValueError):
    """A record or batch is malformed (wrong column types, bad timestamps, ...)."""


class RecordTooLargeError(LogbusError, ValueError):
    """A record or batch is larger than the topic's max.message.bytes."""


class InvalidPartitionsError(LogbusError, ValueError):
    """The partition count is invalid (not positive, or lower than the current count)."""


class InvalidPartitionError(LogbusError, ValueError):
    """A partition number is not an int, or outside the topic's partitions 0..count-1.

    Not :class:`UnknownTopicError`: that one is retriable (the topic may be being
    created), while a partition number the caller got wrong stays wrong; Kafka's
    Java client likewise fails such a record at once, without retrying.
    """


class InvalidReplicationFactorError(LogbusError, ValueError):
    """The replication factor is not positive or exceeds the number of live nodes."""


class CliError(LogbusError):
    """The ``logbus`` command failed on its input data (e.g. a line without the key separator)."""


class NodeCapacityError(LogbusError):
    """Placing the replicas asked for would put more on some node than its max.replicas.per.node allows;
    nothing was created (add nodes, raise the limit, or ask for fewer partitions)."""


class TopicAlreadyExistsError(LogbusError):
    """A topic with this name already exists."""


class OffsetOutOfRangeError(LogbusError):
    """The requested offset is below the log start offset or past the log end offset."""


class IllegalStateError(LogbusError, RuntimeError):
    """The object was used in a state that does not allow the call (e.g. after close())."""


class CorruptRecordError(LogbusError):
    """A stored batch failed its CRC or length checks; it is never served."""


class StorageError(LogbusError):
    """The log directory could not be read or written (disk full, I/O error)."""


class TierFencedError(StorageError):
    """A remote tier's manifest was written by a later leader epoch than this uploader's: a newer
    leader owns the tier (storage/tier.py)."""


class InvalidGroupIdError(LogbusError, ValueError):
    """The consumer group id is empty or malformed."""


class UnknownMemberIdError(LogbusError):
    """The group coordinator does not know this member (it was removed)."""


class FencedInstanceIdError(UnknownMemberIdError):
    """A static member's old member id: a newer process with the same group instance id took its place
    (Kafka's FENCED_INSTANCE_ID). The old process is a zombie and must stop; as an UnknownMemberIdError
    it is no member any more."""


class FencedMemberEpochError(UnknownMemberIdError):
    """A KIP-848 member's epoch is not one the coordinator gave it (Kafka's FENCED_MEMBER_EPOCH): it must give
    up its partitions and join again with epoch 0."""


class UnsupportedAssignorError(InvalidConfigError):
    """A KIP-848 member asked for a server-side assignor the coordinator does not have (Kafka's
    UNSUPPORTED_ASSIGNOR)."""


class InconsistentGroupProtocolError(InvalidConfigError):
    """A member's protocol type, or every assignment strategy it lists, differs from its group's members'
    (Kafka's INCONSISTENT_GROUP_PROTOCOL)."""


class IllegalGenerationError(LogbusError):
    """The member's group generation is stale (a rebalance happened)."""


class CommitFailedError(UnknownMemberIdError, IllegalGenerationError):
    """A group member's commit that can never succeed (Kafka's CommitFailedException): the group
    went on without this member, whose member id the coordinator no longer knows or whose generation
    is over, so its partitions may belong to another member by now.

    Not retriable: the next ``poll()`` rejoins the group (the partitions are reported lost to the
    rebalance listener, and the new assignment starts from the group's committed offsets), so the
    records processed since the last successful commit may be delivered again. ``__cause__`` is the
    coordinator's answer. It derives from the two errors ``commit()`` raised for this before, so
    handlers written for those still catch it.
    """


class GroupNotEmptyError(LogbusError):
    """The operation needs an inactive group but the group has members."""


class GroupSubscribedToTopicError(LogbusError):
    """Committed offsets of a topic the group's members subscribe to cannot be deleted (Kafka's
    GROUP_SUBSCRIBED_TO_TOPIC)."""


class OutOfOrderSequenceError(RetriableError):
    """An idempotent producer's batch does not continue its sequence (an earlier batch is still being retried)."""


class UnknownSequenceError(LogbusError):
    """An idempotent producer's batch starts below the first sequence number the leader knows its producer from.

    The leader took a later batch of the producer while it did not know the
    producer (new, or forgotten: expired after ``producer.id.expiration.ms``,
    or its batches deleted), so it cannot tell whether this one was written
    (before the producer was forgotten) or never was (it was overtaken). Not
    retriable, and never reported as written: its records may be missing, and a
    retry would write them after the ones that overtook them (Kafka answers
    such a batch with OUT_OF_ORDER_SEQUENCE_NUMBER).
    """


class DuplicateSequenceError(LogbusError):
    """An idempotent producer's batch starts below the sequence numbers the leader remembers for it.

    The leader keeps the last 5 batches of each producer; a batch older than
    those (a retry that arrived after newer batches were written) was written
    before, at offsets the leader no longer knows. Not retriable: writing it
    again would duplicate its records, so no retry can succeed (Kafka's
    DUPLICATE_SEQUENCE_NUMBER).
    """


class ProducerFencedError(LogbusError):
    """A newer producer with the same producer id (or transactional id) has a higher epoch: this one is a
    zombie, and every later call of it fails the same way; close it (Kafka's PRODUCER_FENCED)."""


class DataDirectoryInUseError(LogbusError):
    """Another live process owns this data directory (a logbus controller of another Ray cluster or
    namespace, or another replica process); its files are never opened twice."""


class InconsistentClusterIdError(LogbusError):
    """A host's data directory belongs to another logbus cluster (Kafka's InconsistentClusterIdException).

    Its ``meta.properties`` names a cluster id other than the cluster's it
    joined; the message names both. The cluster places nothing on that node
    and opens none of its files: join the host with the data directory of
    this cluster, or an empty one.
    """


class SaslAuthenticationError(LogbusError):
    """A SASL login to the Kafka gateway failed (Kafka's SaslAuthenticationException): a message that
    cannot be read, a wrong proof or an unknown user. The message names neither the password nor
    whether the user exists."""


class NodeIdentityError(LogbusError):
    """A host's logbus identity cannot be used: its ``meta.properties`` is unreadable or malformed, or
    names a node id other than the one the host advertises (its Ray node label ``logbus.node``)."""


# --- cluster state: retriable ---------------------------------------------------


class UnknownTopicError(RetriableError):
    """The topic or partition does not exist (Kafka's UNKNOWN_TOPIC_OR_PARTITION)."""


class NotLeaderError(RetriableError):
    """This replica is not the leader of the partition; refresh metadata and retry."""


class NotEnoughReplicasError(RetriableError):
    """Fewer in-sync replicas than min.insync.replicas: an acks='all' write is refused."""


class FencedLeaderEpochError(RetriableError):
    """The request carried a leader epoch older than the replica's current one; refresh metadata."""


class LeaderNotAvailableError(RetriableError):
    """The partition has no live leader right now (an election is in progress)."""


class TierNotAvailableError(RetriableError):
    """A tiered partition's remote tier cannot be read right now (its leader is opening it, or the store
    does not answer): try again (Kafka's KAFKA_STORAGE_ERROR, which its clients retry)."""


class ReplicaNotAvailableError(RetriableError):
    """The replica's node is not in the cluster right now (its host has not joined again yet, or is
    being brought back): calls to that replica wait until it is (Kafka's REPLICA_NOT_AVAILABLE)."""


class RequestTimedOutError(RetriableError, TimeoutError):
    """The request did not complete within its timeout; it may or may not have happened."""


class BufferExhaustedError(RetriableError):
    """The producer's buffer stayed full for longer than its max block time."""


class CoordinatorNotAvailableError(RetriableError):
    """The group coordinator cannot be reached."""


class RebalanceInProgressError(RetriableError):
    """The group is rebalancing; rejoin and retry."""


# --- the local channel (a Unix socket to a replica on the same node) ---------------


class FrameError(LogbusError):
    """A local channel frame that cannot be valid: the stream is out of step or the peer misbehaves.

    Raised on a header whose body length is out of bounds, a body whose parts
    run past its end, or a payload too large to frame; the connection that
    read such a frame is closed.
    """


class ChannelReplyTooLargeError(LogbusError):
    """A batch a fetch reached is larger than a channel reply carries: fetch up to ``end_offset`` with actor calls."""

    def __init__(self, message: str, end_offset: int) -> None:
        # Both in args: the error travels pickled in an ERROR reply and is rebuilt from them.
        super().__init__(message, end_offset)
        self.end_offset = end_offset

    def __str__(self) -> str:
        return self.args[0]


class ChannelClosedError(LeaderNotAvailableError):
    """The local channel to a replica closed (the replica died or restarted, or the socket failed).

    Requests outstanding on it fail with this error; a request refused with it
    before it was sent may go as an actor call instead. Retriable: the next
    request looks the replica's address up again.
    """


# --- the Kafka gateway --------------------------------------------------------------


class HeartbeatLinkClosedError(LogbusError, ConnectionError):
    """A node agent's heartbeat link to the controller is gone (closed, garbage, or silent).

    Internal: the agent heartbeats through an actor call meanwhile and opens a
    new link (``actors/heartbeat_link.py``).
    """


class FetchLinkClosedError(LogbusError, ConnectionError):
    """A follower's fetch link to its leader is gone (closed, refused, garbage, or silent past a fetch's deadline).

    Internal: the follower fetches with actor calls meanwhile and opens a new
    link later (``actors/fetch_link.py``).
    """


class HeartbeatRefusedError(LogbusError):
    """The controller answered a heartbeat on the link with an error: it renews nothing."""


class ChannelBusyError(ChannelClosedError):
    """A request that was not to wait found the local channel busy (a send under way, or no room in
    the socket): nothing was sent, and the caller sends it as an actor call instead."""


class KafkaProtocolError(LogbusError):
    """A Kafka client's request that the gateway cannot serve at all: a malformed frame, one over the
    gateway's maximum request size, or an API key or version it does not implement. The gateway
    closes that connection (as a Kafka broker does); nothing the request carried reached a log."""


# --- internal errors: a bug in logbus, never retriable ----------------------------


class InternalStateError(LogbusError, RuntimeError):
    """A bug in logbus, not bad input: a rule logbus's own state relies on (see ``logbus/invariant.py``).

    Raised as itself, it is a refusal: one part of logbus asked another for
    a change that would break a rule (the transaction coordinator told of
    markers for a transaction it has not prepared, a reassignment completed
    before it is ready), and the call was refused before anything changed.
    The state that refused is sound; the caller's view was wrong.
    """


class InvariantViolationError(InternalStateError):
    """A rule logbus's own state relies on does not hold (raised by ``logbus.invariant.check``).

    Unlike a refusal, the state that found it cannot be trusted: a check
    after a change failed, or a step's own inputs show the state is already
    wrong. In a replica or the controller the process ends at once and
    restarts from its files (``logbus/actors/invariant_exit.py``); elsewhere
    (clients, the gateway) the error reaches the caller.
    """


# --- the consumer's deserializers ----------------------------------------------------


class RecordDeserializationError(SerializationError):
    """A consumer's key or value deserializer failed on one record (Kafka's RecordDeserializationException).

    ``topic_partition`` and ``offset`` name the record. The consumer's position
    stays at it, so every later poll() raises again until the caller moves
    past it: ``consumer.seek(error.topic_partition, error.offset + 1)``.
    """

    def __init__(self, message: str, topic_partition: tuple | None = None, offset: int = -1) -> None:
        # All in args, so the error pickles and unpickles whole.
        super().__init__(message, topic_partition, offset)
        self.topic_partition = topic_partition
        self.offset = offset

    def __str__(self) -> str:
        return self.args[0]

# --- partition reassignment ------------------------------------------------------


class InvalidReassignmentError(LogbusError, ValueError):
    """A partition reassignment cannot be done as asked: its target is empty, names a node twice or a node
    that is not live, or a cancel would drop the partition's leader or its only in-sync replicas (a
    replica the reassignment added leads, or holds every in-sync copy: move leadership first).
    Nothing changed."""


class ReassignmentInProgressError(LogbusError):
    """The partition is already being reassigned: cancel that reassignment, or wait for it to complete,
    before starting another (Kafka's REASSIGNMENT_IN_PROGRESS). Nothing changed."""


class NoReassignmentInProgressError(LogbusError):
    """A reassignment was to be cancelled, but the partition is not being reassigned (Kafka's
    NO_REASSIGNMENT_IN_PROGRESS). Nothing changed."""


# --- transactions (KIP-98) ---------------------------------------------------------


class InvalidProducerEpochError(LogbusError):
    """A transactional call carries a producer epoch the coordinator does not hold for it, and no newer
    instance fenced it: a request from before the producer's own epoch bump (Kafka's
    INVALID_PRODUCER_EPOCH). Not retriable: the producer's transaction state is out of step."""


class InvalidProducerIdMappingError(LogbusError):
    """The transactional id is not (or no longer) mapped to the producer id the call carries: the
    producer must call ``init_transactions()`` (Kafka's INVALID_PRODUCER_ID_MAPPING)."""


class InvalidTxnStateError(LogbusError):
    """The call is not allowed in the transaction's current state: committing an aborted transaction,
    sending outside ``begin_transaction()``, beginning one while another is open (Kafka's
    INVALID_TXN_STATE). Nothing changed."""


class TransactionAbortedError(LogbusError):
    """The transaction was aborted before this record or call could complete (by
    ``abort_transaction()``, or because an earlier send of it failed); send again in a new
    transaction (Kafka's TransactionAbortedException)."""


class ConcurrentTransactionsError(RetriableError):
    """The transaction coordinator is still completing this transactional id's previous transaction
    (writing its markers) or another change of it; retry shortly (Kafka's CONCURRENT_TRANSACTIONS)."""


class InvalidTransactionTimeoutError(LogbusError, ValueError):
    """``transaction_timeout_ms`` is not a positive int at most the coordinator's maximum (15 minutes,
    Kafka's transaction.max.timeout.ms) (Kafka's INVALID_TRANSACTION_TIMEOUT)."""


class TransactionalIdNotFoundError(LogbusError):
    """The transaction coordinator has no state for this transactional id: it was never initialised, or
    it expired after a long idle time; call ``init_transactions()`` (Kafka's TRANSACTIONAL_ID_NOT_FOUND)."""


__all__ = [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, LogbusError)]
