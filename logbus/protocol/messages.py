"""Plain message types shared by clients, replicas and the controller. No Ray, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from logbus.storage.batch_header import TIMESTAMP_TYPE_CREATE_TIME
from logbus.storage.isolation import READ_COMMITTED, READ_UNCOMMITTED  # noqa: F401 (the codes FetchRequest carries)


class TopicPartition(NamedTuple):
    """A partition of a topic, as in Kafka's clients."""

    topic: str
    partition: int


class RecordMetadata(NamedTuple):
    """Where an acknowledged record landed.

    ``timestamp_ms`` is the record's timestamp as stored: the leader's append
    time on a LogAppendTime topic, else the record's create time. ``offset``
    is -1 with acks=0 (no reply). ``timestamp`` and ``topic_partition`` are
    kafka-python's names.
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int

    @property
    def timestamp(self) -> int:
        """The record's timestamp in ms (kafka-python's name for ``timestamp_ms``)."""
        return self.timestamp_ms

    @property
    def topic_partition(self) -> TopicPartition:
        """The record's topic and partition as a TopicPartition."""
        return TopicPartition(self.topic, self.partition)


class ConsumerRecord(NamedTuple):
    """One record as returned by Consumer.poll() and by iterating over a Consumer.

    Read it by name, as kafka-python's: ``topic``, ``partition``, ``offset``,
    ``timestamp`` (ms; also ``timestamp_ms``), ``timestamp_type``, ``key``,
    ``value``, ``headers``. ``timestamp_type`` uses confluent-kafka's and
    ``ray.data.read_kafka``'s codes: 1 CreateTime (the producer's time), 2
    LogAppendTime (the leader's append time, the same for every record of a
    batch): ``logbus.storage.record_batch.TIMESTAMP_TYPE_*``.

    Why the tuple's order is not kafka-python's (topic, partition, offset,
    timestamp, timestamp_type, key, value, headers): records were tuples of
    seven fields before ``timestamp_type`` existed, and code that indexes them
    (``record[4]`` for the key) must keep reading what it read. Putting the
    new field in kafka-python's place would make such code read the wrong
    field without any error; appending it keeps every index, and code that
    unpacks all seven fields fails loudly instead. The field keeps its name
    ``timestamp_ms`` (``_asdict()`` and ``_replace()`` keep working);
    ``timestamp`` is kafka-python's name for it, as a property. A record built
    with seven fields is a CreateTime record.
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: Any  # bytes or None; what the key deserializer returned, when the consumer has one
    value: Any  # likewise with the value deserializer
    headers: list[tuple[str, bytes | None]] | None
    timestamp_type: int = TIMESTAMP_TYPE_CREATE_TIME

    @property
    def timestamp(self) -> int:
        """The record's timestamp in ms (kafka-python's name for ``timestamp_ms``)."""
        return self.timestamp_ms


class ConsumerGroupMetadata(NamedTuple):
    """A group member's identity as ``Consumer.group_metadata()`` gives it (KIP-447): what a
    transactional producer passes to ``send_offsets_to_transaction`` so that the group refuses
    offsets from a member it no longer knows (a zombie of an earlier generation)."""

    group_id: str
    generation_id: int  # -1 outside a generation (a consumer without group management)
    member_id: str  # "" likewise
    group_instance_id: str | None = None


class OffsetAndTimestamp(NamedTuple):
    """What Consumer.offsets_for_times() finds for a partition: the first offset at or after the
    time asked for, and that record's timestamp (ms), as in Kafka's clients."""

    offset: int
    timestamp: int


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition as described by the controller."""

    topic: str
    partition: int
    leader: int | None  # replica id of the leader, None while no leader is available
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    leader_epoch: int
    log_start_offset: int = -1
    high_watermark: int = -1
    log_end_offset: int = -1


@dataclass(frozen=True, slots=True)
class TopicDescription:
    name: str
    partitions: tuple[PartitionInfo, ...]
    config: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProduceResponse:
    base_offset: int
    log_end_offset: int
    log_start_offset: int
    timestamp_ms: int  # max timestamp of the batch as stored (the append time on a LogAppendTime topic)
    log_append_time_ms: int = -1  # the leader's append time on a LogAppendTime topic, else -1 (as Kafka)
    # The partition's producer.id.expiration.ms (-1: not said): how long after its last write the leader
    # may forget an idempotent producer, after which it takes the producer's next batch at any sequence.
    producer_expiration_ms: int = -1


# Batches up to this size travel as bytes inside a produce request or a fetch reply (Ray inlines
# values under 100 KiB, and bytes serialize faster than arrays); larger ones go as uint8 arrays
# through the object store.
FETCH_INLINE_MAX_BYTES = 64 << 10
PRODUCE_INLINE_MAX_BYTES = 64 << 10
PRODUCE_TIMEOUT_MS_DEFAULT = 30_000


FETCH_MAX_BYTES_DEFAULT = 8 << 20
FETCH_MAX_BYTES_MAX = 64 << 20  # a replica answers at most this much per fetch, whatever the request asks
FETCH_WAIT_MS_MAX = 30_000  # and holds a fetch open at most this long


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """One fetch of a partition, as consumers, Ray Data read tasks, the offsets loader and followers send it.

    ``offset``: the first offset wanted (the reply's batches may begin below it).
    ``max_bytes``: bytes of whole batches to return, at least one batch (capped
    at FETCH_MAX_BYTES_MAX by the replica). ``max_wait_ms``: how long the
    replica holds the fetch open when there is nothing yet. ``verify_crc``:
    whether the replica checks CRCs (readers that check every batch
    themselves ask it not to). ``inline_max_bytes``: results up to this size
    come back inside the reply (capped at FETCH_INLINE_MAX_BYTES); larger ones
    as an ObjectRef. ``session``: a consumer's fetch session (see the replica's
    read path): pipelined fetches of one session continue one another.
    ``isolation_level``: READ_UNCOMMITTED (0) reads up to the high watermark;
    READ_COMMITTED (1) up to the last stable offset, and the reply names the
    aborted transactions it overlaps (see ``logbus/storage/isolation.py``).
    ``tier_plan``: a consumer that reads a tiered topic's remote tier itself
    asks for its files instead of its records: where ``offset`` is in the
    tier, the reply carries no records, only ``FetchResponse.tier``.
    """

    offset: int
    max_bytes: int = FETCH_MAX_BYTES_DEFAULT
    max_wait_ms: int = 0
    verify_crc: bool = True
    inline_max_bytes: int = 0
    session: int | None = None
    isolation_level: int = READ_UNCOMMITTED
    tier_plan: bool = False


@dataclass(frozen=True, slots=True)
class FetchResponse:
    """Metadata of one fetch; the batches themselves travel beside it (bytes, or a uint8 array's ObjectRef).

    ``first_offset``/``next_offset`` bound the whole batches returned (the
    first may start below the requested offset): the reply holds every record
    of the log in ``[first_offset, next_offset)``. In a compacted log the first
    batch may start past the offset the read started at, and ``first_offset``
    is then that offset (the ones in between are gone); a reply with no batch
    but ``next_offset`` past that offset says they are all gone up to there.
    ``high_watermark`` and ``log_start_offset`` are the partition's at the
    time of the fetch, and so is ``last_stable_offset`` (the smaller of the
    high watermark and the first offset of the oldest ongoing transaction).
    ``aborted_transactions``: in a READ_COMMITTED reply, (producer id, first
    offset) of each aborted transaction overlapping the batches returned
    (empty otherwise): a reader drops those transactions' batches.
    ``tier``: the answer to a fetch with ``tier_plan`` whose offset is in a
    tiered topic's remote tier (first and next offset are then the fetch's
    offset, and there are no records): where the records from there are in
    the tier's files (``uri``, ``directory``, ``files`` as (name, base offset,
    next offset), ``start``, ``until``), for the consumer to read itself
    (``storage/tier.DirectTierReader``); None otherwise.
    """

    first_offset: int
    next_offset: int
    high_watermark: int
    log_start_offset: int
    leader_epoch: int
    last_stable_offset: int = -1
    aborted_transactions: tuple[tuple[int, int], ...] = ()
    tier: dict | None = None
