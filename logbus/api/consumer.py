"""Consumer: fetches whole Arrow batches from partition leaders, with fetches kept in flight.

At the log end, each assigned partition keeps two fetches in flight, so one
is always waiting at the leader while the other's reply travels back: records
appended there go out at once instead of waiting for the next fetch to arrive.
A partition that is behind keeps two fetches in flight too while the buffer
and both replies fit ``max_buffered_bytes`` (else one), sent again before its
records are handed out, so the leader's reads overlap this process's decoding
and the caller's work.
The fetches of a partition share a fetch session (an id the leader keys by):
a fetch that was sent while an earlier one was outstanding continues where the
earlier one ended, and the consumer drops whatever it already has, so a
leader that lost the session (a new leader, say) costs only a re-read. A
partition whose leader runs on this node is fetched over the leader's local
channel (a Unix socket, see ``logbus/protocol/local_channel.py``): same
fetch, same session, a tenth of an actor call's latency, and the batches go
from the mapped segment into the socket and from the socket into one buffer
here. From a leader on another node, large results travel as an ObjectRef to
whole batches in Ray's object store, small ones inside the reply. Either way
they are decoded in place with Arrow (no copy, no per-row work) and sliced to
the consumer's position. Each buffered batch keeps the one thing of its
header readers need: the append time of a LogAppendTime batch, which is every
one of its records' timestamp.

``poll()`` turns records into ConsumerRecord tuples (per-row Python, as any
poll API must), through the key and value deserializers if there are any;
iterating over the consumer (kafka-python's ``for record in consumer``) hands
them out one at a time. ``poll_arrow()`` returns one pyarrow Table and does
no per-row Python work.

Transactions (KIP-98). Transaction markers (control batches) are never handed
out, and positions move past them. With ``isolation_level="read_committed"``
the consumer fetches up to the last stable offset (records of a transaction
still open wait there) and drops the batches of aborted transactions; the
fetch reply names those, so the decision is made per batch header
(``logbus/storage/isolation.py``), never per record. The default,
"read_uncommitted", hands out every record below the high watermark, as
Kafka's consumer does.

Partitions are read independently, as Kafka's consumer reads them: each
partition's position lookup and fetches go on by themselves, so one whose
leader is away (an election, a dead or stopped replica, a call that is not
answered) holds up no other. Retriable errors (a leader election, a replica
or the controller restarting) stay inside the consumer, as in Kafka's
clients: a partition that meets one is retried alone, after a backoff
(RETRY_BACKOFF_MIN_S doubling to RETRY_BACKOFF_MAX_S) and with metadata
asked for afresh, while ``poll()`` goes on reading the others and returns
what it has. The retries are part of ``poll()``'s work: nothing runs on a
timer. Metadata, position lookups and the group's committed offsets are
asked for without waiting, so ``poll()`` never waits for the controller or a
leader longer than its own timeout; their replies are taken by the poll they
arrive in. A non-retriable error of one partition (OffsetOutOfRangeError with
``auto_offset_reset="none"``, say) is raised by ``poll()``, as Kafka's.
``commit()``, ``committed()`` and the offset lookups retry retriable errors
until their timeout (``default_api_timeout_ms`` unless given), then raise
RequestTimedOutError.

Group management: with a ``group_id``, ``subscribe()`` (or topics given to
the constructor) lets the group coordinator (in the controller) assign
partitions across the group's members; positions start from the group's
committed offsets (or ``auto_offset_reset``); ``commit()`` stores positions
durably. Rebalance listeners and auto-commit run inside ``poll()``, on the
caller's thread. A member the group went on without (its session expired,
or the coordinator removed it) rejoins by itself in ``poll()``, as Kafka's
consumer does: its partitions are reported lost (``on_partitions_lost``) and
a new assignment follows; a commit it made meanwhile raises
CommitFailedError (see ``logbus/api/group_membership.py``). Without a
``group_id``, ``subscribe()`` (or topics given to the constructor) assigns
every partition of the topics, with no coordinator and no commits, as
kafka-python's consumer without a group does.

Tiered topics (``remote.storage.enable``): a partition's history in the
remote tier comes through the leader as the rest of the log does, and the
leader's reply names the tier's files that follow. A consumer that can read
them (a ``file://`` tier on its own host, an object store it has access to)
reads the next records straight from those Parquet files, in a worker thread,
until the plan's end, then asks the leader again: replaying history then
costs the leader nothing, and this process only Parquet's decoding. The
records, offsets, timestamps and headers are the same either way. A file it
cannot read sends it back to the leader (``read_tier_directly=False``: always
through the leader).

Records converted but not handed out wait in one buffer (see "handing
records out" below), which iteration, ``poll()`` and ``logbus.aio`` share.

Not thread-safe (like Kafka's consumer): use one consumer per thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import random
import re
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from itertools import repeat
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa
import ray

from logbus.actors.channel_client import channels as local_channels
from logbus.actors.fetcher import send_fetch, wait_reply
from logbus.actors.remote import get
from logbus.api.client import Bus
from logbus.api.group_membership import GroupMembership, checked_offsets, retriable_in_group
from logbus.options import INT32_MAX, INT64_MAX, MS_MAX, check_callable, check_choice, check_flag, check_int, check_ms
from logbus.retry import RETRY_BACKOFF_MAX_S, Backoff, retry_until
from logbus.errors import (
    ChannelReplyTooLargeError,
    IllegalStateError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidPartitionError,
    LeaderNotAvailableError,
    LogbusError,
    OffsetOutOfRangeError,
    RecordDeserializationError,
    UnknownTopicError,
)
from logbus.protocol.assignors import get_assignor
from logbus.protocol.group_coordinator import OffsetAndMetadata
from logbus.protocol.messages import (
    FETCH_INLINE_MAX_BYTES,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    ConsumerGroupMetadata,
    ConsumerRecord,
    FetchRequest,
    OffsetAndTimestamp,
    TopicPartition,
)
from logbus.storage import record_batch as rb
from logbus.storage.isolation import isolation_level_code
from logbus.storage.names import validate_partition, validate_topic_name

if TYPE_CHECKING:
    from logbus.storage.tier import DirectTierReader

logger = logging.getLogger(__name__)

OFFSET_RESETS = ("earliest", "latest", "none")
STALE_FETCH_GRACE_S = 1.5  # past its long poll, a fetch (or lookup) this late makes the consumer check for a new leader
# A metadata request or the group's committed offsets unanswered this long (a stopped controller) is
# given up; they are asked for again when needed (a stopped controller answers in order when it runs).
CALL_PATIENCE_S = 5.0
FETCHES_IN_FLIGHT = 2  # per partition at the log end: one waits at the leader while the other's reply travels
DEFAULT_API_TIMEOUT_MS = 60_000  # Kafka's default.api.timeout.ms: how long commit() and the lookups retry
# A call made inside poll() (a position lookup, the commit before partitions are revoked) waits at least
# this long for its answer, whatever poll()'s timeout: a poll(timeout_ms=0) loop must still get answers
# on a busy machine. Only a call that hangs (a stopped process) makes poll() last longer than asked.
CALL_TIMEOUT_MIN_S = 5.0
ITERATOR_MAX_RECORDS = 500  # iterating over the consumer converts this many records at a time
ITERATOR_POLL_S = 1.0  # and polls in slices this long, so the group sees it polling
# poll() and iteration wait in slices of at most a second, so any finite timeout works there; calls
# that wait on one Ray call (commit(), the lookups) take at most MS_MAX, as Kafka's int timeouts.
POLL_TIMEOUT_MS_MAX = INT64_MAX
METADATA_MAX_AGE_MS = 300_000  # kafka-python's metadata_max_age_ms: a consumer without a group looks for new partitions this often
ARROW_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.int64()),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", rb.HEADERS_TYPE),
        # Last, as in ConsumerRecord: the columns before it keep their places.
        pa.field("timestamp_type", pa.int32()),  # 1 CreateTime, 2 LogAppendTime (confluent-kafka's codes)
    ]
)
CREATE_TIME = -1  # a buffered batch's append time when it has none (a CreateTime batch)
TIER_READ_PATIENCE_S = 30.0  # a read of the tier's files taking longer sends the partition to its leader
# A buffered entry of no records: its offset is where the position moves once it is taken (past
# markers and aborted batches that ended a fetch reply).
NO_RECORDS = pa.RecordBatch.from_pylist([], schema=rb.SCHEMA)


class _Partition:
    """Fetch state of one assigned partition."""

    __slots__ = (
        "tp", "position", "fetch_offset", "paused", "in_flight", "buffer", "buffered_rows", "error", "at_end", "session",
        "arrow_scalars", "actor_fetch_until", "needs_committed", "resets", "lookup", "retry_at_s", "backoff",
        "stale_since_s", "tier", "tier_read", "tier_unreachable",
    )

    def __init__(self, tp: TopicPartition, needs_committed: bool = False) -> None:
        self.tp = tp
        self.position: int | None = None  # next offset to hand to the caller
        self.fetch_offset: int | None = None  # next offset to fetch
        self.paused = False
        # Outstanding fetches, oldest first: (ObjectRef, or a local channel's Future; requested offset,
        # sent at, leader actor id, session).
        self.in_flight: deque[tuple] = deque()
        self.session = _new_session()  # replies to fetches of an older session are dropped
        # (offset of row 0, records, the batch's append time or CREATE_TIME): a LogAppendTime batch's
        # records all carry its append time, which only its header holds.
        self.buffer: deque[tuple[int, pa.RecordBatch, int]] = deque()
        self.buffered_rows = 0
        self.error: LogbusError | None = None
        self.at_end = False  # the last fetch was small (came inline): we are at the log end
        self.actor_fetch_until = 0  # below this offset, fetch with actor calls (a batch too large for the channel)
        self.arrow_scalars = (pa.scalar(tp.topic, pa.string()), pa.scalar(tp.partition, pa.int32()))  # for poll_arrow
        # Assigned by the group: the position comes from the group's committed offset, if there is one.
        self.needs_committed = needs_committed
        self.resets = 0  # counts reset_to(): records handed out one at a time check it (see Consumer.__next__)
        # The position lookup on its way to the leader: (ObjectRef, sent at, resets then, leader actor id).
        self.lookup: tuple | None = None
        # After a retriable error: no request before retry_at_s (the backoff doubles up to
        # RETRY_BACKOFF_MAX_S and starts again after a success), and the next one goes where
        # metadata asked for after stale_since_s says (None: the cached metadata will do).
        self.retry_at_s = 0.0
        self.backoff = Backoff()  # no deadline: poll() reads the other partitions meanwhile
        self.stale_since_s: float | None = None
        # A tiered topic's history read straight from the tier's files: the reader of the plan the
        # leader's last reply named (None: fetch from the leader), the read on its way in a worker
        # thread (Future, the reader, resets then, [when a worker took it up]), and whether this process cannot reach the
        # tier. The reader holds up to two decoded row groups besides what is buffered: its slices
        # keep their row group alive, and it reads the next one ahead.
        self.tier: DirectTierReader | None = None
        self.tier_read: tuple | None = None
        self.tier_unreachable = False

    def reset_to(self, offset: int | None) -> None:
        """Make ``offset`` the position and fetch from there (None: find a position again, by auto_offset_reset)."""
        self.position = self.fetch_offset = offset
        self.buffer.clear()
        self.buffered_rows = 0
        self.error = None
        self.needs_committed = False
        self.resets += 1
        self.lookup = None  # a lookup on its way is answered for nobody
        self.drop_tier()  # the next reply from the leader names the files from there
        self.tier_unreachable = False  # and a seek tries the files again
        self.drop_fetches()

    def buffered_bytes(self) -> int:
        """The bytes of the records buffered and not handed out (what ``max_buffered_bytes`` bounds)."""
        return sum(r.nbytes for _, r, _ in self.buffer) if self.buffered_rows else 0

    def drop_tier(self) -> None:
        """Stop reading the tier's files (a read on its way is dropped); fetch from the leader."""
        if self.tier is not None:
            self.tier.close()
        self.tier = self.tier_read = None

    def retry_later(self, now: float, refresh_metadata: bool = True) -> None:
        """A retriable error: the next request waits out the backoff and goes by fresh metadata."""
        self.retry_at_s = now + self.backoff.delay_s(now)
        if refresh_metadata and self.stale_since_s is None:
            self.stale_since_s = now

    def succeeded(self) -> None:
        self.backoff.succeeded()

    def drop_fetches(self) -> None:
        """Forget the outstanding fetches and start a new fetch session (the next fetch reads from fetch_offset)."""
        self.in_flight.clear()
        self.session = _new_session()
        self.at_end = False


def _tier_read_late(read: tuple, now: float) -> bool:
    """Whether a read of the tier's files has been running (not waiting for a worker, not done) too long."""
    future, _, _, started = read
    return not future.done() and bool(started) and now - started[0] > TIER_READ_PATIENCE_S


def _wait_any(pending: list, timeout_s: float) -> list:
    """The outstanding fetches (ObjectRefs and local channel Futures) done within ``timeout_s``, waiting for one."""
    futures = [p for p in pending if isinstance(p, Future)]
    if not futures:
        return ray.wait(pending, num_returns=1, timeout=timeout_s)[0]
    done = [f for f in futures if f.done()]
    refs = [p for p in pending if not isinstance(p, Future)]
    if done:
        return done + (ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else [])
    if not refs:
        return list(concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)[0])
    # Both kinds: wait on the ObjectRefs through Futures of their own.
    as_futures = {ref.future(): ref for ref in refs}
    finished, _ = concurrent.futures.wait(
        futures + list(as_futures), timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
    )
    return [as_futures.get(f, f) for f in finished]


def _done_now(pending: list) -> list:
    """Those of the outstanding fetches that are done already (no waiting)."""
    done = [p for p in pending if isinstance(p, Future) and p.done()]
    refs = [p for p in pending if not isinstance(p, Future)]
    if refs:
        done += ray.wait(refs, num_returns=len(refs), timeout=0)[0]
    return done


def _new_session() -> int:
    return random.getrandbits(62)


def _check_tp(tp) -> TopicPartition:
    if not isinstance(tp, tuple) or len(tp) != 2:
        raise InvalidConfigError(f"expected a TopicPartition(topic, partition), not {tp!r}")
    return TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))


def _is_one_partition(value) -> bool:
    """Whether ``value`` is one TopicPartition (or a (topic, partition) pair), not a collection of them."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)


def _check_tps(partitions, what: str) -> list[TopicPartition]:
    """``partitions``, an iterable of TopicPartitions (not a str, not one TopicPartition), checked."""
    if isinstance(partitions, str | bytes) or _is_one_partition(partitions) or not isinstance(partitions, Iterable):
        raise InvalidConfigError(f"{what} takes a list of TopicPartitions, not {partitions!r}")
    return [_check_tp(tp) for tp in partitions]


def _partitions_arg(partitions: tuple, what: str) -> list[TopicPartition] | None:
    """The partitions of a call that takes them as arguments or as one iterable, as kafka-python's
    ``seek_to_beginning(*partitions)`` and Kafka's ``seekToBeginning(collection)`` do; None if none were given."""
    if not partitions:
        return None
    if len(partitions) == 1 and not _is_one_partition(partitions[0]):
        return _check_tps(partitions[0], what)
    return [_check_tp(tp) for tp in partitions]


def _max_records(value) -> int | None:
    return check_int("max_records", value, 1, INT64_MAX, none_ok=True)


def _poll_timeout_s(value) -> float:
    """poll()'s and iteration's ``timeout_ms``, as seconds (any finite number of ms >= 0)."""
    return check_ms("timeout_ms", value, maximum=POLL_TIMEOUT_MS_MAX)


def _strategies(value) -> tuple[str, ...]:
    """partition_assignment_strategy: one strategy name, or a non-empty list or tuple of them."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not names or not all(isinstance(name, str) for name in names):
        raise InvalidConfigError(
            f"partition_assignment_strategy must be a strategy name or a list of them, preferred first, not {value!r}"
        )
    for name in names:
        get_assignor(name)  # unknown names are InvalidConfigError
    return tuple(names)


def _deserialized(function: Callable, items: list, what: str, tp: TopicPartition, first: int):
    """``function`` applied to each item but None: (results, None), or (results before the failure,
    RecordDeserializationError naming the record it failed on)."""
    out: list = []
    append = out.append
    try:
        for item in items:
            append(None if item is None else function(item))
    except Exception as error:  # noqa: BLE001 (whatever the caller's function raises, named with the record)
        offset = first + len(out)
        failure = RecordDeserializationError(
            f"the {what} deserializer failed on the record at offset {offset} of {tp.topic}-{tp.partition}: "
            f"{type(error).__name__}: {error}; seek past it to go on",
            tp,
            offset,
        )
        failure.__cause__ = error
        return out, failure
    return out, None


def check_seek_offset(offset) -> int:
    """A ``seek()`` offset: an int (InvalidConfigError otherwise) >= 0 (OffsetOutOfRangeError otherwise)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise InvalidConfigError(f"offset must be an int, not {offset!r}")
    if offset < 0:
        raise OffsetOutOfRangeError(f"offset must be a non-negative int, not {offset!r}")
    return offset


def check_subscription(topics, pattern) -> tuple[tuple[str, ...], str | None]:
    """``subscribe()``'s topics (an iterable of names, not a str) and pattern (a regular expression), checked."""
    if topics is None and pattern is None:
        raise InvalidConfigError("subscribe() needs topics or a pattern")
    if isinstance(topics, str | bytes):
        # A str is an iterable of one-letter "topics": never what was meant.
        raise InvalidConfigError(f"subscribe() takes a list of topic names, not a str: subscribe([{topics!r}])")
    if topics is not None and not isinstance(topics, Iterable):
        raise InvalidConfigError(f"subscribe() takes a list of topic names, not {topics!r}")
    names = tuple(validate_topic_name(t) for t in (topics or ()))
    if pattern is not None:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as error:
            raise InvalidConfigError(f"invalid topic pattern {pattern!r}: {error}") from None
    return names, pattern


class Consumer:
    """Reads records from assigned partitions.

    kafka-python's habits work: ``Consumer(bus, "events", group_id="g")``
    subscribes to the topics given after the bus, ``for record in consumer:``
    hands out records one at a time, and the methods taking partitions accept
    them as arguments or as one list. Without a ``group_id``,
    ``Consumer(bus, "events")`` reads every partition of its topics (and
    those added to them later) with no coordinator and no commits, as
    kafka-python's ``KafkaConsumer("events")`` does. ``docs/clients.md``
    lists every remaining difference from kafka-python.

    Args:
        bus: from :func:`logbus.connect`.
        *topics: topic names to subscribe to (as ``subscribe(topics)``).
        group_id: the consumer group: its coordinator assigns partitions and keeps committed
            offsets. None: the consumer reads what it subscribes to or is assigned on its own,
            and ``commit()``/``committed()`` raise IllegalStateError.
        auto_offset_reset: where to start without a valid position: "earliest" (logbus's default;
            Kafka's is "latest"), "latest", or "none" (raise OffsetOutOfRangeError).
        fetch_max_bytes: bytes one fetch may return per partition (whole batches; at least one).
        fetch_max_wait_ms: how long a replica holds a fetch open waiting for new data.
        max_buffered_bytes: per partition, stop prefetching while this much is buffered.
        check_crcs: verify each batch's CRC32C when decoding (cheap; hardware CRC).
        session_timeout_ms: a member silent this long is removed from the group.
        heartbeat_interval_ms: how often the background thread heartbeats (a third of the session timeout, say).
        max_poll_interval_ms: a member that does not poll() this often is removed from the group.
        enable_auto_commit: commit positions every ``auto_commit_interval_ms`` from poll(), and before
            partitions are revoked and on close().
        partition_assignment_strategy: strategy names, preferred first: "range", "roundrobin",
            "cooperative-sticky" (cooperative only if every listed strategy is).
        group_instance_id: makes this member static: restarting within the session timeout gets
            its partitions back with no rebalance.
        local_channel: fetch from the leader over its channel (a Unix socket on this node, TCP to
            another; a fraction of an actor call's latency, and no copy into the object store)
            rather than with actor calls.
        read_tier_directly: in a tiered topic, read the history the leader says is in the remote
            tier straight from the tier's Parquet files when this process can reach them (see
            "Tiered topics" above) rather than through the leader.
        key_deserializer, value_deserializer: callables turning a record's key / value bytes into
            what poll() and iteration hand out (a null key or value stays None, the function is
            not called). poll_arrow() returns the bytes. A failure raises
            RecordDeserializationError (a SerializationError) naming the record, whose offset
            stays the position: seek past it to go on.
        consumer_timeout_ms: iterating over the consumer stops after this long without a record
            (None, the default, or infinity: iterate forever, as kafka-python).
        default_api_timeout_ms: how long commit(), committed() and the offset lookups retry
            retriable errors when no timeout is given (Kafka's default.api.timeout.ms).
        isolation_level: "read_uncommitted" (the default: every record below the high watermark)
            or "read_committed" (only records of committed transactions, and of no transaction, up
            to the last stable offset; end_offsets() and seek_to_end() then mean that offset).
            Transaction markers are never returned, whichever level.
        metadata_max_age_ms: without a group, how often a subscription looks for new partitions
            of its topics (and new topics matching its pattern), as kafka-python's option.
    """

    def __init__(
        self,
        bus: Bus,
        *topics: str,
        group_id: str | None = None,
        auto_offset_reset: str = "earliest",
        fetch_max_bytes: int = 8 << 20,
        fetch_max_wait_ms: int = 500,
        max_buffered_bytes: int = 32 << 20,
        check_crcs: bool = True,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5_000,
        partition_assignment_strategy: tuple[str, ...] | list[str] | str = ("range",),
        group_instance_id: str | None = None,
        client_id: str = "logbus-consumer",
        local_channel: bool = True,
        key_deserializer: Callable | None = None,
        value_deserializer: Callable | None = None,
        consumer_timeout_ms: float | None = None,
        default_api_timeout_ms: int = DEFAULT_API_TIMEOUT_MS,
        isolation_level: str = "read_uncommitted",
        metadata_max_age_ms: int = METADATA_MAX_AGE_MS,
        read_tier_directly: bool = True,
    ) -> None:
        check_choice("auto_offset_reset", auto_offset_reset, OFFSET_RESETS)
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise InvalidGroupIdError(f"group_id must be a non-empty str or None, not {group_id!r}")
        for topic in topics:
            if not isinstance(topic, str):
                raise InvalidConfigError(
                    f"topics go after the bus one by one (Consumer(bus, 'a', 'b', group_id=...)), not {topic!r}"
                )
        self._isolation = isolation_level_code(isolation_level)
        self.isolation_level = isolation_level
        self._bus = bus
        self.group_id = group_id
        self.auto_offset_reset = auto_offset_reset
        self.fetch_max_bytes = check_int("fetch_max_bytes", fetch_max_bytes, 1, INT32_MAX, unit="bytes")
        self.fetch_max_wait_ms = check_int("fetch_max_wait_ms", fetch_max_wait_ms, 0, MS_MAX, unit="ms")
        self.max_buffered_bytes = check_int("max_buffered_bytes", max_buffered_bytes, 1, INT64_MAX, unit="bytes")
        self.check_crcs = check_flag("check_crcs", check_crcs)
        enable_auto_commit = check_flag("enable_auto_commit", enable_auto_commit)
        local_channel = check_flag("local_channel", local_channel)
        strategies = _strategies(partition_assignment_strategy)
        for name, value in (
            ("session_timeout_ms", session_timeout_ms), ("heartbeat_interval_ms", heartbeat_interval_ms),
            ("max_poll_interval_ms", max_poll_interval_ms), ("auto_commit_interval_ms", auto_commit_interval_ms),
            ("default_api_timeout_ms", default_api_timeout_ms), ("metadata_max_age_ms", metadata_max_age_ms),
        ):
            check_int(name, value, 1, MS_MAX, unit="ms")
        if heartbeat_interval_ms >= session_timeout_ms:
            raise InvalidConfigError(
                f"heartbeat_interval_ms must be lower than session_timeout_ms ({session_timeout_ms}), not {heartbeat_interval_ms!r}"
            )
        if group_instance_id is not None and group_id is None:
            raise InvalidConfigError("group_instance_id needs a group_id")
        self._key_deserializer = check_callable("key_deserializer", key_deserializer, "bytes")
        self._value_deserializer = check_callable("value_deserializer", value_deserializer, "bytes")
        self._consumer_timeout_s = check_ms("consumer_timeout_ms", consumer_timeout_ms, maximum=POLL_TIMEOUT_MS_MAX, forever=True)
        self._api_timeout_s = default_api_timeout_ms / 1000
        self._metadata_max_age_s = metadata_max_age_ms / 1000
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._channels = local_channels() if local_channel else None
        self._read_tier_directly = check_flag("read_tier_directly", read_tier_directly)
        # Threads for reading tier files, started by the first tier plan.
        self._tier_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._tier_ahead: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._group_options = dict(
            group_instance_id=group_instance_id,
            client_id=client_id,
            protocols=strategies,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            max_poll_interval_ms=max_poll_interval_ms,
        )
        self.enable_auto_commit = enable_auto_commit and group_id is not None
        self.auto_commit_interval_s = auto_commit_interval_ms / 1000
        self._last_auto_commit_s = time.monotonic()
        self._membership: GroupMembership | None = None  # once subscribe() is called, or the first commit
        self._listener = None
        self._subscribed = False
        # Records converted for iteration and not handed out yet: (partition state, its resets then, record).
        # Positions count only records handed out (see __next__).
        self._pending: deque[tuple[_Partition, int, ConsumerRecord]] = deque()
        self._timestamp_type_columns: dict[int, pa.Array] = {}  # for poll_arrow
        # Asked for without waiting (see _pump): metadata per topic, (ObjectRef, sent at); the send time
        # of each topic's last metadata that arrived; no request for a topic before its retry time.
        self._metadata_calls: dict[str, tuple] = {}
        self._metadata_fresh_s: dict[str, float] = {}
        self._metadata_retry_at_s: dict[str, float] = {}
        # The group's committed offsets for partitions it just assigned: (ObjectRef, sent at, [(state, resets)]).
        self._committed_call: tuple | None = None
        # Subscribed without a group: (topic names, compiled pattern or None); every partition of them is
        # assigned here (see _assign_subscribed). A pattern is matched against the cluster's topic list:
        # (names, when they were asked for), and the call asking for it, (ObjectRef, sent at).
        self._own_subscription: tuple[tuple[str, ...], re.Pattern | None] | None = None
        self._topic_list: tuple[frozenset[str], float] = (frozenset(), -math.inf)
        self._topic_list_call: tuple | None = None
        # The partition count of each topic of that subscription, as its last metadata said (0: no such
        # topic); and whether they changed since the assignment last followed them.
        self._own_counts: dict[str, int] = {}
        self._own_changed = False
        if topics:
            self.subscribe(list(topics))

    # --- assignment and positions ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise IllegalStateError("the consumer is closed")

    def _deadline(self, timeout_ms) -> float:
        """The ``time.monotonic()`` deadline of a call given ``timeout_ms`` (None: default_api_timeout_ms)."""
        timeout_s = self._api_timeout_s if timeout_ms is None else check_ms("timeout_ms", timeout_ms)
        return time.monotonic() + timeout_s

    def _forget_topics_of(self, partitions) -> Callable[[LogbusError], None]:
        """A retry hook: drop the cached metadata of these partitions' topics (the leaders may have moved)."""
        topics = {tp.topic for tp in partitions}

        def forget(_error: LogbusError) -> None:
            for topic in topics:
                self._bus.forget(topic)

        return forget

    def _leader(self, tp: TopicPartition, refresh: bool = False):
        metadata = self._bus.topic_metadata(tp.topic, refresh=refresh)
        if tp.partition >= metadata.partition_count and not refresh:
            metadata = self._bus.topic_metadata(tp.topic, refresh=True)  # the topic may have grown meanwhile
        if tp.partition >= metadata.partition_count:
            # The caller's mistake, not the retriable "unknown partition": retrying cannot help.
            raise InvalidPartitionError(
                f"topic {tp.topic!r} has partitions 0..{metadata.partition_count - 1}, not {tp.partition}"
            )
        leader = metadata.leaders[tp.partition]
        if leader is None:
            raise LeaderNotAvailableError(f"{tp} has no leader right now (an election is in progress)")
        return leader

    def _leader_for(self, state: _Partition, now: float):
        """The leader to send the partition's next request to, by metadata at least as fresh as the
        partition needs; None while that metadata is on its way (asked for here, never waited for).
        Raises LeaderNotAvailableError while the partition has no leader, InvalidPartitionError for
        a partition the topic does not have."""
        topic = state.tp.topic
        fresh = False
        if state.stale_since_s is not None:
            if self._metadata_fresh_s.get(topic, -math.inf) < state.stale_since_s:
                self._refresh_metadata(topic, now)
                return None
            state.stale_since_s = None
            fresh = True
        metadata = self._bus.cached_metadata(topic)
        if metadata is None or (state.tp.partition >= metadata.partition_count and not fresh):
            # Not cached yet, or the topic may have grown since it was: ask again.
            state.stale_since_s = now
            self._refresh_metadata(topic, now)
            return None
        if state.tp.partition >= metadata.partition_count:
            raise InvalidPartitionError(
                f"topic {topic!r} has partitions 0..{metadata.partition_count - 1}, not {state.tp.partition}"
            )
        leader = metadata.leaders[state.tp.partition]
        if leader is None:
            raise LeaderNotAvailableError(f"{state.tp} has no leader right now (an election is in progress)")
        return leader

    def _refresh_metadata(self, topic: str, now: float) -> None:
        """Ask the controller for ``topic``'s metadata, unless that is under way or failed just now."""
        if topic not in self._metadata_calls and now >= self._metadata_retry_at_s.get(topic, 0.0):
            self._metadata_calls[topic] = (self._bus.request_metadata(topic), now)

    def _take_metadata(self, topic: str, ref) -> None:
        """Metadata arrived (cached by the bus), or the controller's error: asked again after a backoff."""
        call = self._metadata_calls.get(topic)
        if call is None or call[0] != ref:
            return  # given up meanwhile (late, or the topic is no longer read)
        del self._metadata_calls[topic]
        sent_s = call[1]
        try:
            metadata = self._bus.metadata_arrived(ref, timeout_s=CALL_PATIENCE_S)
        except LogbusError as error:
            logger.debug("metadata of %r: %s; asking again later", topic, error)
            self._metadata_retry_at_s[topic] = time.monotonic() + RETRY_BACKOFF_MAX_S
            if isinstance(error, UnknownTopicError) and self._own_subscription is not None:
                self._own_counts[topic] = 0  # deleted (or not created yet): none of its partitions to read
                self._own_changed = True
            return
        self._metadata_fresh_s[topic] = max(self._metadata_fresh_s.get(topic, -math.inf), sent_s)
        if self._own_subscription is not None and self._own_counts.get(topic) != metadata.partition_count:
            self._own_counts[topic] = metadata.partition_count
            self._own_changed = True

    def _forget_unused_topics(self) -> None:
        """Drop the per-topic bookkeeping (metadata calls, freshness, backoffs) of topics this consumer no
        longer reads or subscribes to: these tables hold no more topics than the consumer uses."""
        used = {tp.topic for tp in self._partitions}
        if self._own_subscription is not None:
            used.update(self._own_subscription[0])
            used.update(self._own_counts)
        for table in (self._metadata_calls, self._metadata_fresh_s, self._metadata_retry_at_s):
            for topic in [t for t in table if t not in used]:
                del table[topic]

    def _assign_subscribed(self, now: float) -> None:
        """Without a group: read every partition of the subscribed topics (and of the topics matching the
        pattern). Their metadata (and the cluster's topic list, for a pattern) is asked for without
        waiting once it is older than metadata_max_age_ms; partitions of topics that left the
        subscription (deleted, or no longer matched) are dropped. Listeners hear of both."""
        names, pattern = self._own_subscription
        topics = set(names)
        if pattern is not None:
            listed, listed_s = self._topic_list
            if now - listed_s > self._metadata_max_age_s and self._topic_list_call is None:
                self._topic_list_call = (self._bus.controller.list_topics.remote(), now)
            topics.update(t for t in listed if pattern.fullmatch(t))
        for topic in topics:
            if now - self._metadata_fresh_s.get(topic, -math.inf) > self._metadata_max_age_s:
                self._refresh_metadata(topic, now)
        if not self._own_changed:
            return
        self._own_changed = False
        left = [t for t in self._own_counts if t not in topics]
        for topic in left:
            del self._own_counts[topic]
        gone = [tp for tp in self._partitions if tp.partition >= self._own_counts.get(tp.topic, math.inf) or tp.topic not in topics]
        for tp in gone:
            del self._partitions[tp]
        added = []
        for topic, count in self._own_counts.items():
            for partition in range(count):
                tp = TopicPartition(topic, partition)
                if tp not in self._partitions:
                    self._partitions[tp] = _Partition(tp)
                    added.append(tp)
        if gone or left:
            self._forget_unused_topics()
        if gone:
            self._call_listener("on_partitions_revoked", gone)
        self._call_listener("on_partitions_assigned", added)

    def _take_topic_list(self, ref) -> None:
        """The cluster's topic names arrived (a pattern subscription without a group); or asked again later."""
        if self._topic_list_call is None or self._topic_list_call[0] != ref:
            return
        _, sent_s = self._topic_list_call
        self._topic_list_call = None
        try:
            names = get(ref, timeout_s=CALL_PATIENCE_S)
        except LogbusError as error:
            logger.debug("listing topics: %s; asking again later", error)
            # Asked again once the backoff is over (as if the last list were that old).
            self._topic_list = (self._topic_list[0], time.monotonic() + RETRY_BACKOFF_MAX_S - self._metadata_max_age_s)
            return
        self._topic_list = (frozenset(names), sent_s)
        self._own_changed = True

    def _failed(self, state: _Partition, error: LogbusError, now: float) -> None:
        """One of the partition's requests failed: retried alone later if retrying may help, else
        raised by poll() (Kafka's consumer raises a partition's non-retriable error too)."""
        if error.retriable:
            logger.debug("%s: %s: %s; retrying", state.tp, type(error).__name__, error)
            state.retry_later(now)
        else:
            state.error = error

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any previous assignment).

        With a ``group_id``, a newly assigned partition starts at the group's committed offset
        (``auto_offset_reset`` where none is committed), as Kafka's consumer does; ``seek()``
        before the first ``poll()`` overrides it. Without one, ``auto_offset_reset`` decides."""
        self._check_open()
        if self._subscribed:
            raise IllegalStateError("assign() cannot be mixed with subscribe(); call unsubscribe() first")
        wanted = _check_tps(partitions, "assign()")
        for tp in wanted:
            try:
                self._leader(tp)  # unknown topics and partitions fail here, before anything changes
            except LeaderNotAvailableError:
                pass  # it exists; its leader is being elected
        from_group = self.group_id is not None
        self._partitions = {tp: self._partitions.get(tp) or _Partition(tp, needs_committed=from_group) for tp in wanted}
        self._forget_unused_topics()

    def assignment(self) -> set[TopicPartition]:
        return set(self._partitions)

    def _state(self, tp) -> _Partition:
        tp = _check_tp(tp)
        try:
            return self._partitions[tp]
        except KeyError:
            raise IllegalStateError(f"{tp} is not assigned to this consumer") from None

    def _offsets(self, tps: list[TopicPartition], timeout_s: float) -> dict[TopicPartition, tuple[int, int, int]]:
        """(log start offset, high watermark, log end offset) of each partition, from its leader (one try)."""
        deadline = time.monotonic() + timeout_s
        refs = {tp: self._leader(tp).offsets.remote(*self._offsets_args) for tp in tps}
        return {tp: get(ref, timeout_s=max(0.0, deadline - time.monotonic())) for tp, ref in refs.items()}

    def _lookup_offsets(self, tps: list[TopicPartition], timeout_ms) -> dict[TopicPartition, tuple[int, int, int]]:
        """_offsets(), retrying retriable errors until ``timeout_ms`` (None: default_api_timeout_ms)."""
        if not tps:
            return {}
        return retry_until(
            self._deadline(timeout_ms), f"looking up the offsets of {tps}", lambda left_s: self._offsets(tps, left_s),
            self._forget_topics_of(tps),
        )

    def beginning_offsets(self, partitions: Iterable[TopicPartition], timeout_ms: float | None = None) -> dict[TopicPartition, int]:
        """The log start offset of each partition."""
        self._check_open()
        found = self._lookup_offsets(_check_tps(partitions, "beginning_offsets()"), timeout_ms)
        return {tp: offsets[0] for tp, offsets in found.items()}

    def end_offsets(self, partitions: Iterable[TopicPartition], timeout_ms: float | None = None) -> dict[TopicPartition, int]:
        """The high watermark (the offset after the last committed record) of each partition; with
        isolation_level="read_committed", the last stable offset."""
        self._check_open()
        found = self._lookup_offsets(_check_tps(partitions, "end_offsets()"), timeout_ms)
        return {tp: offsets[1] for tp, offsets in found.items()}

    def offsets_for_times(
        self, timestamps: dict[TopicPartition, int], timeout_ms: float | None = None
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        """For each partition, the earliest record whose timestamp is >= the given ms: OffsetAndTimestamp
        (its offset and timestamp), or None if there is none (as in Kafka's clients)."""
        self._check_open()
        if not isinstance(timestamps, dict):
            raise InvalidConfigError(f"offsets_for_times() takes a dict of TopicPartition -> timestamp (ms), not {timestamps!r}")
        wanted = {}
        for tp, timestamp in timestamps.items():
            tp = _check_tp(tp)
            if isinstance(timestamp, bool) or not isinstance(timestamp, int) or not 0 <= timestamp <= INT64_MAX:
                raise InvalidConfigError(f"the timestamp for {tp} must be an int of ms >= 0, not {timestamp!r}")
            wanted[tp] = timestamp
        if not wanted:
            return {}
        return retry_until(
            self._deadline(timeout_ms), "looking up offsets for times",
            lambda left_s: self._offsets_for_times(wanted, left_s), self._forget_topics_of(wanted),
        )

    def _offsets_for_times(self, wanted: dict[TopicPartition, int], timeout_s: float) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        """One try of offsets_for_times(): the offsets from the leaders, then each found record's timestamp."""
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        leaders = {tp: self._leader(tp) for tp in wanted}
        refs = {tp: leaders[tp].offset_for_timestamp.remote(timestamp) for tp, timestamp in wanted.items()}
        offsets = {tp: get(ref, timeout_s=left()) for tp, ref in refs.items()}
        # Kafka answers with the found record's timestamp too: read the batch that holds it.
        fetches = {
            tp: leaders[tp].fetch.remote(FetchRequest(offset, 1, 0, True, FETCH_INLINE_MAX_BYTES))
            for tp, offset in offsets.items()
            if offset >= 0
        }
        found: dict[TopicPartition, OffsetAndTimestamp | None] = {tp: None for tp in wanted}
        for tp, ref in fetches.items():
            offset = offsets[tp]
            try:
                _, data, _ = wait_reply(ref, timeout_s=left())
            except OffsetOutOfRangeError:
                data = None  # deleted (retention) since the lookup
            for header, _, records in rb.slice_batches(data, offset, offset + 1) if data is not None else ():
                if header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME:
                    found[tp] = OffsetAndTimestamp(offset, header.max_timestamp_ms)
                else:
                    found[tp] = OffsetAndTimestamp(offset, records.column(2)[0].as_py())
            if found[tp] is None:
                # The record went between the two calls: retriable, the next try finds the next one.
                raise LeaderNotAvailableError(f"the record at offset {offset} of {tp} was deleted while it was looked up")
        return found

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Make ``offset`` the next offset poll() returns for ``tp``."""
        self._check_open()
        check_seek_offset(offset)
        self._state(tp).reset_to(offset)

    def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their log start."""
        self._seek_to(partitions, "seek_to_beginning()", 0)

    def seek_to_end(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their high watermark."""
        self._seek_to(partitions, "seek_to_end()", 1)

    def _seek_to(self, partitions: tuple, what: str, which: int) -> None:
        self._check_open()
        tps = _partitions_arg(partitions, what)
        if tps is None:
            tps = list(self._partitions)
        for tp in tps:
            self._state(tp)  # every one assigned, before anything changes
        for tp, offsets in self._lookup_offsets(tps, None).items():
            self._state(tp).reset_to(offsets[which])

    def position(self, tp: TopicPartition, timeout_ms: float | None = None) -> int:
        """The offset the next record returned for ``tp`` will have."""
        self._check_open()
        state = self._state(tp)
        if state.position is None:
            retry_until(
                self._deadline(timeout_ms), f"finding the position of {state.tp}",
                lambda left_s: self._init_positions([state], left_s), self._forget_topics_of([state.tp]),
                retriable=retriable_in_group,  # it may read the group's committed offsets
            )
        return state.position

    def pause(self, *partitions: TopicPartition) -> None:
        """Stop fetching from these partitions (as arguments or one list) until resume().

        With no partitions, pauses none (as kafka-python's).
        """
        self._check_open()
        for tp in _partitions_arg(partitions, "pause()") or ():
            self._state(tp).paused = True

    def resume(self, *partitions: TopicPartition) -> None:
        """Fetch again from these paused partitions (as arguments or one list; none: none)."""
        self._check_open()
        for tp in _partitions_arg(partitions, "resume()") or ():
            self._state(tp).paused = False

    def paused(self) -> set[TopicPartition]:
        return {tp for tp, state in self._partitions.items() if state.paused}

    def _init_positions(self, states: list[_Partition], timeout_s: float) -> None:
        """Give positions to partitions that have none: the group's committed offset for a partition
        the group just assigned, else by auto_offset_reset. One try; raises what it meets."""
        states = [s for s in states if s.position is None]
        committed_wanted = [s for s in states if s.needs_committed]
        if committed_wanted:
            found = self._committer().committed([s.tp for s in committed_wanted], timeout_s=timeout_s)
            for state in committed_wanted:
                committed = found.get(state.tp)
                if committed is not None:
                    state.reset_to(committed.offset)
                else:
                    state.needs_committed = False  # nothing committed: auto_offset_reset decides
        states = [s for s in states if s.position is None]
        if not states:
            return
        if self.auto_offset_reset == "none":
            raise OffsetOutOfRangeError(
                f"no position for {[s.tp for s in states]} and auto_offset_reset='none'; seek() first"
            )
        found = self._offsets([s.tp for s in states], timeout_s)
        for state in states:
            start, high_watermark, _ = found[state.tp]
            state.reset_to(start if self.auto_offset_reset == "earliest" else high_watermark)

    def _find_positions(self, now: float) -> None:
        """Ask for the positions of partitions that have none, each on its own (replies are taken by
        _take_committed and _take_lookup as they arrive): the group's committed offset for a
        partition the group just assigned, else by auto_offset_reset from its leader's offsets."""
        states = [
            s for s in self._partitions.values()
            if s.position is None and s.lookup is None and s.error is None and now >= s.retry_at_s
        ]
        if not states:
            return
        wanted = [s for s in states if s.needs_committed]
        if wanted and self._committed_call is None:
            ref = self._committer().committed_call([s.tp for s in wanted])
            self._committed_call = (ref, now, [(s, s.resets) for s in wanted])
        resets = [s for s in states if not s.needs_committed]
        if resets and self.auto_offset_reset == "none":
            raise OffsetOutOfRangeError(
                f"no position for {[s.tp for s in resets]} and auto_offset_reset='none'; seek() first"
            )
        for state in resets:
            try:
                leader = self._leader_for(state, now)
            except LogbusError as error:
                self._failed(state, error, now)
                continue
            if leader is not None:
                state.lookup = (leader.offsets.remote(*self._offsets_args), now, state.resets, leader._actor_id)

    def _take_lookup(self, state: _Partition, ref) -> None:
        """A position lookup's reply: the position by auto_offset_reset, or a retry later."""
        if state.lookup is None or state.lookup[0] != ref:
            return  # sought, reset or revoked meanwhile
        state.lookup = None
        if self._partitions.get(state.tp) is not state or state.position is not None:
            return
        try:
            start, high_watermark, _ = get(ref, timeout_s=CALL_PATIENCE_S)
        except LogbusError as error:
            self._failed(state, error, time.monotonic())
            return
        state.succeeded()
        state.reset_to(start if self.auto_offset_reset == "earliest" else high_watermark)

    def _take_committed(self, ref) -> None:
        """The group's committed offsets arrived: positions for the partitions that have one; the others
        go by auto_offset_reset (or everything asked about is retried later, after an error)."""
        if self._committed_call is None or self._committed_call[0] != ref:
            return
        _, _, asked = self._committed_call
        self._committed_call = None
        waiting = [s for s, resets in asked if self._partitions.get(s.tp) is s and s.resets == resets and s.position is None]
        try:
            found = get(ref, timeout_s=CALL_PATIENCE_S)
        except LogbusError as error:
            if not error.retriable:
                raise
            logger.debug("group %r: reading committed offsets: %s; asking again", self.group_id, error)
            for state in waiting:
                state.retry_later(time.monotonic(), refresh_metadata=False)  # the coordinator's error, not the leader's
            return
        for state in waiting:
            committed = found.get(state.tp)
            if committed is not None:
                state.reset_to(committed.offset)
            else:
                state.needs_committed = False  # nothing committed: auto_offset_reset decides

    # --- fetching ------------------------------------------------------------------------------------

    def _send_fetches(self, now: float) -> None:
        for state in self._partitions.values():
            if state.paused or state.error is not None or state.fetch_offset is None or now < state.retry_at_s:
                continue
            if state.tier is not None:
                if state.tier_read is not None:
                    continue  # its read is on its way
                if state.tier.continues(state.fetch_offset):
                    self._read_tier(state)
                    continue
                state.drop_tier()  # past the plan's end: the leader again
            if len(state.in_flight) >= FETCHES_IN_FLIGHT:
                continue
            if state.buffered_rows and state.at_end and state.in_flight:
                # At the log end with a fetch already waiting at the leader: the records in
                # hand go to the caller first (sending a fetch costs a fraction of a ms).
                continue
            buffered = state.buffered_bytes()
            if state.at_end:
                full = bool(buffered) and buffered >= self.max_buffered_bytes  # replies at the log end are small
            else:
                # Behind the log end, replies are up to fetch_max_bytes each: a second fetch goes
                # out (so the leader reads the next bytes while this process decodes the last
                # ones) only while the buffer and every reply on its way fit max_buffered_bytes.
                on_the_way = (len(state.in_flight) + 1) * self.fetch_max_bytes
                full = bool(state.in_flight or buffered) and buffered + on_the_way > self.max_buffered_bytes
            if full:
                continue
            try:
                leader = self._leader_for(state, now)
            except LogbusError as error:
                self._failed(state, error, now)  # no leader yet: asked again after the backoff
                continue
            if leader is None:
                continue  # its metadata is on its way
            # The replica skips its CRC check when we check every batch ourselves, and sends
            # small results inside its reply (one round trip instead of two).
            request = FetchRequest(
                state.fetch_offset, self.fetch_max_bytes, self.fetch_max_wait_ms, not self.check_crcs,
                FETCH_INLINE_MAX_BYTES, state.session, self._isolation,
                tier_plan=self._read_tier_directly and not state.tier_unreachable,
            )
            channels = self._channels if state.fetch_offset >= state.actor_fetch_until else None
            ref = send_fetch(leader, request, channels)
            state.in_flight.append((ref, state.fetch_offset, time.monotonic(), leader._actor_id, state.session))

    def _check_late_calls(self, now: float) -> None:
        """Give up on fetches and position lookups that outlived their long poll and whose leader has
        since been replaced (or is gone), and on metadata and committed-offset calls unanswered for
        CALL_PATIENCE_S.

        A call to a replica whose node died, or whose process is stopped, may never be answered. A
        late one makes the consumer ask for its topic's metadata (without waiting, and again every
        STALE_FETCH_GRACE_S while it stays late); once metadata sent for after it was late arrives,
        a call whose leader is no longer the partition's is dropped, and the partition asks the
        new leader, or retries until there is one.
        """
        fetch_patience_s = self.fetch_max_wait_ms / 1000 + STALE_FETCH_GRACE_S
        for state in self._partitions.values():
            if state.tier_read is not None and _tier_read_late(state.tier_read, now):
                logger.warning("%s: a read of the remote tier's files took over %.0f s; fetching from the leader",
                               state.tp, TIER_READ_PATIENCE_S)
                state.tier_unreachable = True
                state.drop_tier()
            if state.in_flight:
                _, _, sent_s, actor_id, _ = state.in_flight[0]
                if self._leader_replaced(state, sent_s + fetch_patience_s, actor_id, now):
                    state.drop_fetches()
            if state.lookup is not None:
                _, sent_s, _, actor_id = state.lookup
                if self._leader_replaced(state, sent_s + STALE_FETCH_GRACE_S, actor_id, now):
                    state.lookup = None  # asked again of the new leader (or after the backoff, without one)
        for topic, (_, sent_s) in list(self._metadata_calls.items()):
            if now - sent_s > CALL_PATIENCE_S:
                del self._metadata_calls[topic]  # asked again when needed
        if self._topic_list_call is not None and now - self._topic_list_call[1] > CALL_PATIENCE_S:
            self._topic_list_call = None  # asked again by the next round
        if self._committed_call is not None and now - self._committed_call[1] > CALL_PATIENCE_S:
            for state, resets in self._committed_call[2]:
                state.retry_later(now, refresh_metadata=False)
            self._committed_call = None

    def _leader_replaced(self, state: _Partition, late_at_s: float, actor_id, now: float) -> bool:
        """Whether a call to ``actor_id`` that is late from ``late_at_s`` went to a replica that is no
        longer the partition's leader, by metadata asked for since then (asked for here if needed)."""
        if now <= late_at_s:
            return False
        topic = state.tp.topic
        fresh_s = self._metadata_fresh_s.get(topic, -math.inf)
        if fresh_s <= late_at_s or now - fresh_s > STALE_FETCH_GRACE_S:
            self._refresh_metadata(topic, now)
        if fresh_s <= late_at_s:
            return False
        metadata = self._bus.cached_metadata(topic)
        if metadata is None or state.tp.partition >= metadata.partition_count:
            return False
        leader = metadata.leaders[state.tp.partition]
        return leader is None or leader._actor_id != actor_id

    def _receive(self, state: _Partition, fetch: tuple) -> None:
        """Take the reply to one of the partition's outstanding fetches.

        Replies may come back in any order (Ray may even start a caller's calls
        out of order); each says which offsets it holds, and the consumer takes
        what continues its position and drops what it already has.
        """
        try:
            state.in_flight.remove(fetch)
        except ValueError:
            return  # dropped meanwhile (a seek, or a reset by another reply of this round)
        ref, requested, _, _, session = fetch
        try:
            meta, data, large = wait_reply(ref)
        except ChannelReplyTooLargeError as error:
            state.actor_fetch_until = max(state.actor_fetch_until, error.end_offset)
            return
        except OffsetOutOfRangeError:
            if session != state.session:
                return  # a seek happened meanwhile
            if self.auto_offset_reset == "none":
                state.error = OffsetOutOfRangeError(f"offset {requested} is out of range for {state.tp}")
                return
            state.reset_to(None)  # the next round finds a position by auto_offset_reset
            return
        except LogbusError as error:
            if session == state.session:
                self._failed(state, error, time.monotonic())  # retriable: the next fetch goes by fresh metadata
            return
        if session != state.session:
            return  # a seek happened meanwhile
        state.succeeded()
        state.at_end = not large
        if meta.tier is not None:
            self._adopt_tier_plan(state, meta.tier)
            return
        if data is None or meta.next_offset <= state.fetch_offset:
            return  # the long poll expired empty, or an earlier fetch already brought these records
        if meta.first_offset > state.fetch_offset:
            # Records between our position and this reply went to a reply we dropped (or one
            # that is still on its way): start a new session, which reads from fetch_offset again.
            state.drop_fetches()
            return
        kept, skipped_to = rb.slice_visible_batches(
            data, state.fetch_offset, read_committed=self._isolation == READ_COMMITTED,
            aborted=meta.aborted_transactions, verify_crc=self.check_crcs,
        )
        for header, first, records in kept:
            append_time = header.max_timestamp_ms if header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME else CREATE_TIME
            state.buffer.append((first, records, append_time))
            state.buffered_rows += records.num_rows
        if skipped_to is not None:  # markers or aborted batches last: the position moves past them
            state.buffer.append((skipped_to, NO_RECORDS, CREATE_TIME))
        state.fetch_offset = meta.next_offset

    def _adopt_tier_plan(self, state: _Partition, plan: dict) -> None:
        """The leader says the records from the fetch's offset are in these tier files: read them here."""
        state.at_end = False
        if state.tier is not None:
            return  # the pipelined fetch's copy of the same answer
        from logbus.storage.tier import DirectTierReader  # noqa: PLC0415 (Parquet, only for tiered topics)

        if self._tier_threads is None:
            # Reads of the plans, and their readers' row groups read ahead (apart: a read waits for those).
            self._tier_threads = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logbus-tier-read")
            self._tier_ahead = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logbus-tier-ahead")
        reader = DirectTierReader(plan, ahead=self._tier_ahead)
        if reader.continues(state.fetch_offset):
            state.tier = reader
            state.drop_fetches()  # a fetch still on its way would only bring the same answer

    def _read_tier(self, state: _Partition) -> None:
        """Send the partition's next read of its tier plan to a worker thread, unless one is on its
        way or the buffer is full (the same bound as fetches behind the log end)."""
        if state.tier_read is not None:
            return
        buffered = state.buffered_bytes()
        if buffered and buffered + self.fetch_max_bytes > self.max_buffered_bytes:
            return
        reader = state.tier
        started: list[float] = []  # when a worker took it up (reads of several partitions may queue)

        def read():
            started.append(time.monotonic())
            return reader.read(self.fetch_max_bytes)

        state.tier_read = (self._tier_threads.submit(read), reader, state.resets, started)

    def _receive_tier(self, state: _Partition, read: tuple) -> None:
        """Take a read of the partition's tier plan: its records continue the position, or, if the
        files could not be read, the partition goes back to fetching from its leader."""
        if state.tier_read is not read:
            return  # a seek dropped it meanwhile
        state.tier_read = None
        future, reader, resets, _ = read
        if resets != state.resets or reader is not state.tier:
            return
        try:
            runs, next_offset = future.result()
        except (LogbusError, OSError, pa.ArrowException) as error:
            # Another host's file:// tier or credentials this process lacks (the tier's directory
            # cannot be seen: fetch from the leader until a seek), or a file retention deleted
            # meanwhile (the leader serves what is left, or says it is gone).
            # A plan's first read that fails counts as unreachable too: a tier directory this process
            # sees may still not be the leader's (a follower's of the same path on this host).
            unreachable = reader.reads == 0 or getattr(error, "tier_unreachable", True)
            logger.debug("%s: reading the remote tier's files failed (%s), fetching from the leader: %s",
                         state.tp, "unreachable" if unreachable else "a file is gone", error)
            state.tier_unreachable = unreachable
            state.drop_tier()
            return
        end = None
        for first, records, append_time in runs:
            state.buffer.append((first, records, CREATE_TIME if append_time is None else append_time))
            state.buffered_rows += records.num_rows
            end = first + records.num_rows
        if end is None or end < next_offset:  # offsets the tier does not hold (aborted records) last
            state.buffer.append((next_offset, NO_RECORDS, CREATE_TIME))
        state.fetch_offset = next_offset
        state.at_end = False

    def _pump(self, timeout_s: float) -> None:
        """Send fetches, and wait up to ``timeout_s`` for at least one partition to have records.

        Each partition goes on by itself: one without a position has it
        looked up, one with a position is fetched, and one that met a
        retriable error (its leader away, a lookup or fetch unanswered) is
        retried once its backoff is over, by fresh metadata, all without
        holding up the others. Every request is sent without waiting; each
        round waits for whichever reply comes first, until the time is up.
        """
        deadline = time.monotonic() + timeout_s
        if self._subscribed and self._membership is not None:
            self._membership.polled()
            if not self._maintain_group(deadline):
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    time.sleep(min(remaining, 0.05))
                return
        self._maybe_auto_commit()
        while True:
            now = time.monotonic()
            if self._own_subscription is not None:
                self._assign_subscribed(now)
            self._find_positions(now)
            self._send_fetches(now)
            self._raise_errors()
            if any(s.buffered_rows and not s.paused for s in self._partitions.values()):
                return
            self._check_late_calls(now)
            calls = self._outstanding_calls()
            remaining = deadline - time.monotonic()
            if not calls:
                if remaining > 0:
                    time.sleep(min(remaining, 0.05))
                    continue
                return
            membership = self._membership if self._subscribed else None
            if membership is not None and (membership.needs_join or membership.revoke_requested or membership.lost):
                # The group is rebalancing: take part now, within this poll().
                if not self._maintain_group(deadline):
                    return
                continue
            # A group member waits in short slices, so a rebalance reaches it within ~0.1 s; so does a
            # consumer with partitions waiting to be retried (their backoffs end while it waits).
            waiting_retry = any(s.retry_at_s > now for s in self._partitions.values())
            slice_s = 0.1 if membership is not None or waiting_retry else 0.5
            ready = _wait_any(list(calls), max(0.0, min(remaining, slice_s)))
            for ref in ready:
                handler, args = calls[ref]
                handler(*args)
            # Collect the replies of other partitions that are already done, without waiting (a
            # partition with records in hand, e.g. the one just received, need not be asked: each
            # ray.wait costs a fraction of a ms).
            others = [r for r, (handler, args) in calls.items() if r not in ready and not (handler == self._receive and args[0].buffered_rows)]
            if others:
                for ref in _done_now(others):
                    handler, args = calls[ref]
                    handler(*args)
            self._send_fetches(time.monotonic())  # prefetch before handing records out
            if remaining <= 0 and not ready:
                return

    def _outstanding_calls(self) -> dict:
        """Every request on its way, as {ObjectRef or Future: (handler, its arguments)}."""
        calls = {}
        for state in self._partitions.values():
            for fetch in state.in_flight:
                calls[fetch[0]] = (self._receive, (state, fetch))
            if state.tier_read is not None:
                calls[state.tier_read[0]] = (self._receive_tier, (state, state.tier_read))
            if state.lookup is not None:
                calls[state.lookup[0]] = (self._take_lookup, (state, state.lookup[0]))
        if self._committed_call is not None:
            calls[self._committed_call[0]] = (self._take_committed, (self._committed_call[0],))
        if self._topic_list_call is not None:
            calls[self._topic_list_call[0]] = (self._take_topic_list, (self._topic_list_call[0],))
        for topic, (ref, _) in self._metadata_calls.items():
            calls[ref] = (self._take_metadata, (topic, ref))
        return calls

    def _raise_errors(self) -> None:
        for state in self._partitions.values():
            if state.error is not None:
                error, state.error = state.error, None
                raise error

    @property
    def _offsets_args(self) -> tuple:
        """The arguments of a replica's offsets() for this consumer's isolation level."""
        return () if self._isolation == READ_UNCOMMITTED else (self._isolation,)

    def _take(self, max_records: int | None) -> list[tuple[_Partition, int, pa.RecordBatch, int]]:
        """Pop up to ``max_records`` buffered records across partitions, advancing positions.

        Returns (partition state, offset of the first record, records, append time or CREATE_TIME).
        """
        taken = []
        budget = max_records if max_records is not None else float("inf")
        for state in self._partitions.values():
            while state.buffer and budget > 0 and not state.paused:
                first, records, append_time = state.buffer[0]
                if records.num_rows > budget:
                    count = int(budget)
                    state.buffer[0] = (first + count, records.slice(count), append_time)
                    records = records.slice(0, count)
                else:
                    state.buffer.popleft()
                state.buffered_rows -= records.num_rows
                budget -= records.num_rows
                state.position = first + records.num_rows
                taken.append((state, first, records, append_time))
        return taken

    def _put_back(self, taken: list[tuple[_Partition, int, pa.RecordBatch, int]], skip: int) -> None:
        """Return taken records to the front of their buffers (all but the first ``skip`` of the first
        entry), and their partitions' positions to the first record returned."""
        for index in range(len(taken) - 1, -1, -1):
            state, first, records, append_time = taken[index]
            if index == 0 and skip:
                first, records = first + skip, records.slice(skip)
            state.buffer.appendleft((first, records, append_time))
            state.buffered_rows += records.num_rows
            state.position = first

    def _records(self, taken: list[tuple[_Partition, int, pa.RecordBatch, int]]) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Taken records as ConsumerRecords, through the deserializers.

        A deserializer that fails stops there, as in Kafka's clients: the
        records before the one it failed on are returned, that record and
        everything taken after it go back to the buffers, its offset becomes
        its partition's position, and the RecordDeserializationError is raised
        now if no record came before it, else by the next poll().
        """
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        key_deserializer, value_deserializer = self._key_deserializer, self._value_deserializer
        for index, (state, first, records, append_time) in enumerate(taken):
            tp = state.tp
            count = records.num_rows
            keys = records.column(0).to_pylist()
            values = records.column(1).to_pylist()
            failure = None
            if key_deserializer is not None:
                keys, failure = _deserialized(key_deserializer, keys, "key", tp, first)
                if failure is not None:
                    count = failure.offset - first
                    values = values[:count]
            if value_deserializer is not None:
                values, value_failure = _deserialized(value_deserializer, values, "value", tp, first)
                if value_failure is not None:
                    failure, count = value_failure, value_failure.offset - first
            if append_time == CREATE_TIME:
                timestamps, timestamp_type = records.column(2).to_pylist(), rb.TIMESTAMP_TYPE_CREATE_TIME
            else:
                timestamps, timestamp_type = repeat(append_time), rb.TIMESTAMP_TYPE_LOG_APPEND_TIME
            if count:
                rows = zip(
                    repeat(tp.topic),
                    repeat(tp.partition),
                    range(first, first + count),
                    timestamps,
                    keys,
                    values,
                    records.column(3).to_pylist(),
                    repeat(timestamp_type),
                )
                out.setdefault(tp, []).extend(map(ConsumerRecord._make, rows))
            if failure is not None:
                self._put_back(taken[index:], count)
                if not out:
                    raise failure
                state.error = failure  # the next poll() raises it (before handing anything out)
                break
        return out

    def poll(self, timeout_ms: float = 0, max_records: int | None = 500) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Records from assigned partitions, waiting up to ``timeout_ms`` for some to arrive.

        Retriable errors do not reach the caller: poll() retries them until
        ``timeout_ms`` and returns what it has (maybe nothing). Records
        converted earlier and not handed out yet (by iteration, or given back
        by logbus.aio) come first.
        """
        self._check_open()
        return self._hand_out(max_records, _poll_timeout_s(timeout_ms))

    def poll_arrow(self, timeout_ms: float = 0, max_records: int | None = None) -> pa.Table:
        """Buffered records as one pyarrow Table (topic, partition, offset, timestamp, key, value, headers,
        timestamp_type); keys and values are the bytes stored (the deserializers are not applied).

        No per-row Python work: the Table's columns point at the fetched
        batches, plus computed columns (the timestamps of a LogAppendTime
        batch are its append time).
        """
        self._check_open()
        timeout_s = _poll_timeout_s(timeout_ms)
        max_records = _max_records(max_records)
        self._drop_pending()
        self._pump(timeout_s)
        batches = []
        for state, first, records, append_time in self._take(max_records):
            count = records.num_rows
            topic, partition = state.arrow_scalars
            key, value, timestamp, headers = records.columns
            if append_time == CREATE_TIME:
                timestamp_type = self._timestamp_type_column(rb.TIMESTAMP_TYPE_CREATE_TIME, count)
            else:
                timestamp = pa.repeat(pa.scalar(append_time, pa.int64()), count)
                timestamp_type = self._timestamp_type_column(rb.TIMESTAMP_TYPE_LOG_APPEND_TIME, count)
            batches.append(
                pa.RecordBatch.from_arrays(
                    [
                        pa.repeat(topic, count),
                        pa.repeat(partition, count),
                        pa.array(np.arange(first, first + count, dtype=np.int64)),
                        timestamp,
                        key,
                        value,
                        headers,
                        timestamp_type,
                    ],
                    schema=ARROW_SCHEMA,
                )
            )
        return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)

    def _timestamp_type_column(self, code: int, count: int) -> pa.Array:
        """``count`` times ``code``, as an int32 column: a slice of one array kept per code (no per-batch fill)."""
        column = self._timestamp_type_columns.get(code)
        if column is None or len(column) < count:
            column = self._timestamp_type_columns[code] = pa.array(np.full(max(count, 1 << 16), code, np.int32))
        return column.slice(0, count)

    # --- handing records out: poll(), iteration, logbus.aio ---------------------------------------------
    #
    # Records are converted (ConsumerRecords, through the deserializers) from the fetched batches when
    # they are handed out. Those converted but not handed out yet wait in ``_pending``, the one buffer of
    # converted records: iteration converts a few hundred at a time and hands them out one by one, and
    # logbus.aio does the same for getone() and gives back what a cancelled caller never read. A
    # partition's position counts only the records handed out; a pending record whose partition was
    # sought, reset or revoked since it was converted is dropped, and one whose partition is paused is
    # fetched again after resume(). The underscored methods below are that buffer's interface for
    # logbus.aio (logbus/api/aio.py), which keeps no records of its own.

    def _hand_out(
        self, max_records: int | None, timeout_s: float, convert_max: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Up to ``max_records`` records (None: no limit), moving positions past them.

        Records converted before and not handed out come first, without
        waiting. Else this waits up to ``timeout_s`` for records (as poll()
        does) and converts up to ``convert_max`` of them (default:
        ``max_records``); those past ``max_records`` stay for the next call.
        """
        max_records = _max_records(max_records)
        convert_max = max_records if convert_max is None else _max_records(convert_max)
        if self._pending:
            if self._membership is not None:
                self._membership.polled()
            handed = self._take_pending(max_records)
            if handed:
                return handed
        self._pump(timeout_s)
        if convert_max == max_records:
            return self._records(self._take(max_records))  # all of them go out: no need to keep them
        self._convert_pending(convert_max)
        return self._take_pending(max_records)

    def _take_pending(self, max_records: int | None) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Up to ``max_records`` of the records converted before and not handed out (None: all), moving
        positions past them; no fetching, no waiting, no call to anyone."""
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        budget = math.inf if max_records is None else max_records
        while budget > 0:
            record = self._next_pending()
            if record is None:
                break
            out.setdefault(TopicPartition(record.topic, record.partition), []).append(record)
            budget -= 1
        return out

    def _resets_of(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """How many times each assigned partition of ``partitions`` was sought or reset (for give_back)."""
        return {tp: self._partitions[tp].resets for tp in partitions if tp in self._partitions}

    def _give_back(self, records: dict[TopicPartition, list[ConsumerRecord]], resets: dict[TopicPartition, int]) -> None:
        """Take back records handed out that their reader never read (logbus.aio: a caller that stopped
        waiting); ``resets`` is :meth:`_resets_of` their partitions when they were handed out.

        Each partition's position goes back to its first record given back.
        If nothing of the partition was handed out since, they are handed out
        again next, as they are; if later records were, the partition fetches
        again from there (those are handed out twice: never a record lost).
        Records of a partition sought, reset or revoked since are dropped:
        what happened since wins.
        """
        entries = []
        for tp, given in records.items():
            state = self._partitions.get(tp)
            if not given or state is None or state.resets != resets.get(tp):
                continue
            if state.position == given[-1].offset + 1:
                state.position = given[0].offset
                entries.extend((state, state.resets, record) for record in given)
            elif state.position is not None and state.position > given[-1].offset:
                state.reset_to(given[0].offset)
        self._pending.extendleft(reversed(entries))

    def _give_back_table(self, table: pa.Table, resets: dict[TopicPartition, int]) -> None:
        """:meth:`_give_back` for a poll_arrow() Table: its partitions fetch again from its first record of each."""
        if not table.num_rows:
            return
        firsts = table.group_by(["topic", "partition"]).aggregate([("offset", "min")])
        for topic, partition, first in zip(*(firsts.column(name).to_pylist() for name in ("topic", "partition", "offset_min"))):
            tp = TopicPartition(topic, partition)
            state = self._partitions.get(tp)
            if state is not None and state.resets == resets.get(tp) and state.position is not None and state.position > first:
                state.reset_to(first)

    def _convert_pending(self, max_records: int | None) -> None:
        """Convert up to ``max_records`` buffered records into ``_pending``; positions go back to the first of them."""
        for tp, records in self._records(self._take(max_records)).items():
            state = self._partitions[tp]
            state.position = records[0].offset
            self._pending.extend((state, state.resets, record) for record in records)

    def _next_pending(self) -> ConsumerRecord | None:
        while self._pending:
            state, resets, record = self._pending.popleft()
            if self._partitions.get(state.tp) is not state or state.resets != resets:
                continue  # sought, reset or revoked since it was converted
            if state.paused:
                state.reset_to(state.position)  # its records are fetched again after resume()
                continue
            state.position = record.offset + 1
            return record
        return None

    def _drop_pending(self) -> None:
        """Forget the records converted but not handed out (poll_arrow() was called, which hands out
        Arrow): their partitions fetch again from their positions."""
        if not self._pending:
            return
        valid = {state.tp: state for state, resets, _ in self._pending if self._partitions.get(state.tp) is state and state.resets == resets}
        self._pending.clear()
        for state in valid.values():
            state.reset_to(state.position)

    # --- iteration (kafka-python's `for record in consumer`) -------------------------------------------

    def __iter__(self) -> "Consumer":
        return self

    def __next__(self) -> ConsumerRecord:
        """The next record; StopIteration after ``consumer_timeout_ms`` without one (never, by default).

        Records are converted a few hundred at a time, but handed out one at a
        time: a partition's position (what commit() stores) counts only the
        records handed out.
        """
        self._check_open()
        deadline = None if self._consumer_timeout_s is None else time.monotonic() + self._consumer_timeout_s
        polled = False
        while True:
            record = self._next_pending()
            if record is not None:
                return record
            wait_s = ITERATOR_POLL_S
            if deadline is not None:
                wait_s = min(deadline - time.monotonic(), ITERATOR_POLL_S)
                if wait_s <= 0 and polled:
                    raise StopIteration
            self._pump(max(0.0, wait_s))
            self._convert_pending(ITERATOR_MAX_RECORDS)
            polled = True

    # --- consumer groups -----------------------------------------------------------------------------

    def group_metadata(self) -> ConsumerGroupMetadata:
        """This member's identity in its group (KIP-447), for a transactional producer's
        ``send_offsets_to_transaction``: the group refuses offsets sent with a generation it has
        moved past. Generation -1 and member "" before the consumer joined (or without group
        management). InvalidGroupIdError without a ``group_id``."""
        self._check_open()
        if self.group_id is None:
            raise InvalidGroupIdError("group_metadata() needs a consumer with a group_id")
        membership = self._membership
        generation, member_id = (-1, "") if membership is None else (membership.generation, membership.member_id)
        return ConsumerGroupMetadata(self.group_id, generation, member_id, self._group_options["group_instance_id"])

    def subscribe(self, topics: Iterable[str] | None = None, pattern: str | None = None, listener=None) -> None:
        """Read the partitions of these topics: assigned by the group's coordinator, or without a
        group, every one of them.

        ``topics`` (names) and/or ``pattern`` (a regular expression topic names
        must match in full; new matching topics join the subscription).
        ``listener`` may define ``on_partitions_revoked(partitions)``,
        ``on_partitions_assigned(partitions)`` and ``on_partitions_lost(partitions)``;
        they are called from poll().

        With a ``group_id``, the consumer joins the group. Without one (as
        kafka-python's consumer without a group), it assigns itself every
        partition of the topics, with no coordinator and no commits; partitions
        and matching topics created later are found within
        ``metadata_max_age_ms``, and the listener hears of them too.
        """
        self._check_open()
        names, pattern = check_subscription(topics, pattern)
        if not self._subscribed and self._partitions:
            raise IllegalStateError("subscribe() cannot be mixed with assign(); call unsubscribe() first")
        self._listener = listener
        self._subscribed = True
        if self.group_id is None:
            self._own_subscription = (names, None if pattern is None else re.compile(pattern))
            self._topic_list = (frozenset(), -math.inf)  # a new pattern: ask for the topic list now
            self._own_counts = {}
            self._own_changed = True
            return
        if self._membership is None:
            self._membership = GroupMembership(self._bus, self.group_id, **self._group_options)
        self._membership.subscribe(names, pattern)

    def unsubscribe(self) -> None:
        """Give up every partition and leave the group."""
        self._check_open()
        self._pending.clear()
        if self._membership is not None:
            self._revoke(list(self._partitions), commit=True, deadline=self._deadline(None))
            self._membership.leave()
            self._membership = None
        self._subscribed = False
        self._own_subscription = None
        self._own_counts = {}
        self._topic_list_call = None
        self._partitions = {}
        self._forget_unused_topics()

    def _call_listener(self, name: str, partitions) -> None:
        callback = getattr(self._listener, name, None)
        if callback is not None and partitions:
            callback(sorted(partitions))

    def _revoke(self, partitions, commit: bool, deadline: float) -> None:
        """Give up partitions: commit their positions (auto-commit; retried until ``deadline``), tell
        the listener, forget them."""
        partitions = [tp for tp in partitions if tp in self._partitions]
        if not partitions:
            return
        if commit and self.enable_auto_commit:
            try:
                self._commit_positions(partitions, deadline)
            except LogbusError as error:
                # The next owner starts from the last successful commit: at least once.
                logger.info("group %r: committing revoked partitions failed: %s", self.group_id, error)
        self._call_listener("on_partitions_revoked", partitions)
        for tp in partitions:
            self._partitions.pop(tp, None)
        self._forget_unused_topics()

    def _drop_lost(self) -> None:
        """If the member's generation ended without it (see GroupMembership.take_lost), give up every
        partition held without committing (another member may own them now) and tell the listener."""
        if self._membership.take_lost():
            lost = list(self._partitions)
            self._partitions = {}
            self._forget_unused_topics()
            self._call_listener("on_partitions_lost", lost)

    def _maintain_group(self, deadline: float) -> bool:
        """Act on what the coordinator said; join if needed. False while this member may not fetch.

        A member the coordinator no longer knows, or whose generation is over,
        rejoins here by itself (Kafka's consumer does the same in poll()): its
        partitions are dropped as lost, and the join brings a new assignment.
        The join is never waited for past ``deadline``: a later poll() takes
        its reply.
        """
        membership = self._membership
        # A commit before partitions are revoked gets some time even within a short poll().
        commit_deadline = max(deadline, time.monotonic() + CALL_TIMEOUT_MIN_S)
        self._drop_lost()
        if not membership.coordinator_ok and membership.generation >= 0:
            # Stop fetching until the coordinator answers again (or, past the session timeout, the
            # partitions are lost and the member joins again).
            return False
        if membership.revoke_requested:
            revoke, membership.revoke_requested = membership.revoke_requested, ()
            self._revoke(revoke, commit=True, deadline=commit_deadline)
            membership.needs_join = True
        while membership.needs_join:
            if not membership.cooperative:
                self._revoke(list(self._partitions), commit=True, deadline=commit_deadline)
            result = membership.join(tuple(self._partitions), deadline)
            if result is None:
                return False
            self._drop_lost()  # the generation before this one ended while the join was on its way
            assigned = set(result.assignment)
            self._revoke([tp for tp in self._partitions if tp not in assigned], commit=True, deadline=commit_deadline)
            added = [tp for tp in result.assignment if tp not in self._partitions]
            for tp in added:
                # Its position comes from the group's committed offset, looked up by the next round
                # of poll() (retried there while the coordinator is away) unless the listener seeks.
                self._partitions[tp] = _Partition(tp, needs_committed=True)
            self._call_listener("on_partitions_assigned", added)
            if result.revoke:
                membership.needs_join = True
        return True

    def _positions(self, partitions=None) -> dict[TopicPartition, int]:
        tps = self._partitions if partitions is None else partitions
        return {tp: self._partitions[tp].position for tp in tps if tp in self._partitions and self._partitions[tp].position is not None}

    def _check_group(self, what: str) -> None:
        """IllegalStateError for ``what`` (a call that needs the group) on a consumer without a group_id,
        as kafka-python's (its IllegalStateError('Requires group_id')): nothing is committed or read back."""
        if self.group_id is None:
            raise IllegalStateError(
                f"{what} requires a group_id: this consumer has none, so it reads without a coordinator and commits nothing"
            )

    def _committer(self):
        self._check_group("committing offsets")
        if self._membership is None:
            # A consumer with manual assignment commits as a non-member (generation -1).
            self._membership = GroupMembership(self._bus, self.group_id, **self._group_options)
            self._membership.stop()
        return self._membership

    def _commit_positions(self, partitions, deadline: float) -> None:
        offsets = self._positions(partitions)
        if offsets:
            self._committer().commit(offsets, deadline)

    def _maybe_auto_commit(self) -> None:
        if not self.enable_auto_commit or time.monotonic() - self._last_auto_commit_s < self.auto_commit_interval_s:
            return
        self._last_auto_commit_s = time.monotonic()
        offsets = self._positions()
        if offsets:
            try:
                self._committer().commit_async(offsets)
            except LogbusError as error:
                # As in Kafka's clients, a failed auto-commit is logged, and the next one commits later positions.
                logger.info("group %r: auto-commit failed: %s", self.group_id, error)

    def commit(self, offsets: dict[TopicPartition, int | OffsetAndMetadata] | None = None, timeout_ms: float | None = None) -> None:
        """Commit ``offsets`` (default: the current positions of every assigned partition) and wait.

        ``offsets`` maps TopicPartitions to the next offset to read (an int >= 0)
        or to an OffsetAndMetadata(offset, metadata). Retriable errors are
        retried until ``timeout_ms`` (None: ``default_api_timeout_ms``), then
        RequestTimedOutError, as Kafka's commitSync(timeout). As Kafka's, raises
        CommitFailedError if the group went on without this member (its session
        expired, or it was removed: the next poll() rejoins, and its partitions
        are reported lost), and RebalanceInProgressError while the group
        rebalances (poll() to take part, then commit again).
        """
        self._check_open()
        self._check_group("commit()")
        deadline = self._deadline(timeout_ms)
        offsets = self._positions() if offsets is None else checked_offsets(offsets)
        if offsets:
            self._committer().commit(offsets, deadline)

    def commit_async(self, offsets: dict[TopicPartition, int | OffsetAndMetadata] | None = None, callback=None) -> None:
        """Commit without waiting; ``callback(offsets, error_or_None)`` runs when it is done."""
        self._check_open()
        self._check_group("commit_async()")
        offsets = self._positions() if offsets is None else checked_offsets(offsets)
        if offsets:
            self._committer().commit_async(offsets, callback)

    def committed(self, partitions, metadata: bool = False, timeout_ms: float | None = None):
        """The group's committed offset of each partition: a dict of TopicPartition -> offset, or None
        where nothing was committed.

        Given one TopicPartition (kafka-python's ``committed(tp)``), its offset
        alone. With ``metadata``, OffsetAndMetadata instead of offsets.
        Retriable errors are retried until ``timeout_ms`` (None:
        ``default_api_timeout_ms``), then RequestTimedOutError.
        """
        self._check_open()
        self._check_group("committed()")
        one = _is_one_partition(partitions)
        tps = [_check_tp(partitions)] if one else _check_tps(partitions, "committed()")
        deadline = self._deadline(timeout_ms)
        committer = self._committer()
        found = retry_until(
            deadline, f"reading the committed offsets of group {self.group_id!r}",
            lambda left_s: committer.committed(tps, timeout_s=left_s), retriable=retriable_in_group,
        )
        result = {tp: (om if metadata or om is None else om.offset) for tp, om in found.items()}
        return result.get(tps[0]) if one else result

    def close(self) -> None:
        """Commit (with auto-commit), leave the group, stop fetching. Later calls raise IllegalStateError."""
        if self._closed:
            return
        self._pending.clear()  # positions count only the records handed out
        if self._membership is not None:
            if self._subscribed and self.enable_auto_commit:
                try:
                    self._commit_positions(None, self._deadline(None))
                except LogbusError as error:
                    logger.info("group %r: committing on close failed: %s", self.group_id, error)
            self._membership.leave()
            self._membership = None
        self._closed = True
        self._partitions = {}
        if self._tier_threads is not None:
            self._tier_threads.shutdown(wait=False, cancel_futures=True)
            self._tier_ahead.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
