"""The transaction coordinator's state machine (KIP-98): one transaction's metadata per transactional id. No I/O.

The service (``logbus/actors/transaction_service.py``) drives it: each call
returns a *step* that says what the service must do, and the service reports
back what happened. Nothing here appends, writes markers or sleeps.

States, as Kafka's ``TransactionState`` (the numbers are Kafka's, and are what
``__transaction_state`` stores)::

    Empty (0)             no transaction open; the producer's id and epoch are known
    Ongoing (1)           partitions were added; records may be written to them
    PrepareCommit (2)     durable decision to commit; markers are being written
    PrepareAbort (3)      durable decision to abort; markers are being written
    CompleteCommit (4)    every COMMIT marker is written
    CompleteAbort (5)     every ABORT marker is written
    Dead (6)              the transactional id expired (a tombstone in the topic)
    PrepareEpochFence (7) in memory only: the epoch was bumped to fence the producer,
                          and the abort that follows is being persisted

Transitions (``VALID_PREVIOUS_STATES`` below, Kafka's table): a state may be
entered only from the states listed for it. A transition is first *pending*:
the step :class:`Persist` carries the new metadata, which the service appends
to ``__transaction_state`` with acks=all and then reports with
:meth:`TransactionCoordinator.applied`. Until then every other call on that
transactional id answers ConcurrentTransactionsError (retriable), so the log
holds the transitions in the order they were made and memory never runs
ahead of it. A pending transition whose append failed for certain (nothing
was written) is dropped with :meth:`~TransactionCoordinator.abandon`; one
whose outcome is unknown (a timeout) must be appended again until it is
durable, never replaced by another: otherwise a restart could find in the log
a decision nobody acted on.

Why a transaction completes one way only: markers are written only for a
PrepareCommit or PrepareAbort that is durable, and from either the only way
on is its own Complete state. A restarted coordinator reads the log and
writes the markers of every transaction it finds in a Prepare state again
(markers are idempotent in effect: a second COMMIT of the same transaction
commits nothing new), and treats an Ongoing one as it would have: it aborts
it when its timeout passes.

Epochs fence zombies. ``init_producer_id`` bumps the epoch (or allocates a new
producer id once the epoch would pass 32767); a transaction the old epoch left
Ongoing is aborted first with the *new* epoch, so the partitions' leaders, on
seeing its markers, refuse the old epoch's batches (ProducerFencedError). A
transaction open longer than its timeout is aborted the same way.

Timeouts cost one timer, not one per transaction: :meth:`next_deadline_ms`
is the earliest deadline of the Ongoing transactions (a heap with lazy
deletion) and :meth:`expire` aborts those past it.

This class is not thread-safe; the service calls it from one event loop.
"""

from __future__ import annotations

import enum
import heapq
import struct
from dataclasses import dataclass, field, replace
from typing import Iterable

from logbus.errors import (
    ConcurrentTransactionsError,
    CorruptRecordError,
    InternalStateError,
    InvalidConfigError,
    InvalidProducerEpochError,
    InvalidProducerIdMappingError,
    InvalidTransactionTimeoutError,
    InvalidTxnStateError,
    ProducerFencedError,
)
from logbus.invariant import check
from logbus.protocol.field_reader import FieldReader
from logbus.protocol.messages import TopicPartition

TRANSACTION_STATE_TOPIC = "__transaction_state"
TRANSACTION_TIMEOUT_MS_MAX = 900_000  # Kafka's transaction.max.timeout.ms (15 minutes)
TRANSACTION_TIMEOUT_MS_DEFAULT = 60_000  # Kafka's transaction.timeout.ms
TRANSACTIONAL_ID_CHARS_MAX = 255  # as a group id: the id is a key of the compacted topic
PRODUCER_EPOCH_MAX = 2**15 - 1  # int16 in batch headers; past it a new producer id
PARTITIONS_PER_TRANSACTION_MAX = 100_000  # bound on one transaction's partitions (each gets a marker)
NO_PRODUCER_ID = -1

# Record format of __transaction_state (Kafka's TransactionLogKey / TransactionLogValue, version 0).
TXN_KEY_VERSION = 0
TXN_VALUE_VERSION = 0
COORDINATOR_KEY_VERSION = 1  # logbus's own key: the coordinator epoch (see TransactionCoordinator.load)
_INT8 = struct.Struct(">b")
_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_INT64 = struct.Struct(">q")
_VALUE_HEAD = struct.Struct(">hqhib")  # version, producer_id, producer_epoch, timeout_ms, state
_VALUE_TAIL = struct.Struct(">qq")  # last update timestamp ms, start timestamp ms


class TxnState(enum.Enum):
    """A transaction's state; the values are Kafka's state ids in ``__transaction_state``."""

    EMPTY = 0
    ONGOING = 1
    PREPARE_COMMIT = 2
    PREPARE_ABORT = 3
    COMPLETE_COMMIT = 4
    COMPLETE_ABORT = 5
    DEAD = 6
    PREPARE_EPOCH_FENCE = 7


S = TxnState
VALID_PREVIOUS_STATES: dict[TxnState, frozenset[TxnState]] = {
    S.EMPTY: frozenset({S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT}),
    S.ONGOING: frozenset({S.ONGOING, S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT}),
    S.PREPARE_COMMIT: frozenset({S.ONGOING}),
    S.PREPARE_ABORT: frozenset({S.ONGOING, S.PREPARE_EPOCH_FENCE}),
    S.COMPLETE_COMMIT: frozenset({S.PREPARE_COMMIT}),
    S.COMPLETE_ABORT: frozenset({S.PREPARE_ABORT}),
    S.DEAD: frozenset({S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT}),
    S.PREPARE_EPOCH_FENCE: frozenset({S.ONGOING}),
}
PREPARED = frozenset({S.PREPARE_COMMIT, S.PREPARE_ABORT})
COMPLETED = frozenset({S.COMPLETE_COMMIT, S.COMPLETE_ABORT})


@dataclass(frozen=True, slots=True)
class TxnMetadata:
    """One transactional id's state, as stored in ``__transaction_state``."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    state: TxnState
    partitions: frozenset = frozenset()  # of TopicPartition
    update_ms: int = -1  # wall ms of the last change
    start_ms: int = -1  # wall ms the open transaction began (Ongoing and after), else -1

    @property
    def deadline_ms(self) -> int:
        return self.start_ms + self.timeout_ms


@dataclass(frozen=True, slots=True)
class Markers:
    """Transaction markers to write: one control batch per partition, all with the same outcome."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    coordinator_epoch: int
    commit: bool
    partitions: tuple  # of TopicPartition, sorted
    start_ms: int = -1  # when the transaction began: with the id and producer id, names the transaction


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the caller with ``value``; nothing to persist."""

    value: object = None


class Retry(enum.Enum):
    """What a :class:`Persist` answers when the call must be made again once it is done."""

    AFTER_COMPLETION = "after-completion"


@dataclass(frozen=True, slots=True)
class AwaitCompletion:
    """The transactional id is completing a transaction: wait until it is done, then call again."""

    transactional_id: str


@dataclass(frozen=True, slots=True)
class Persist:
    """Append ``metadata`` to ``__transaction_state`` (acks=all), then report
    :meth:`TransactionCoordinator.applied`. The call's answer is ``reply``; if
    ``markers`` is set, write them next and report
    :meth:`TransactionCoordinator.markers_written`."""

    metadata: TxnMetadata
    reply: object = None
    markers: Markers | None = None

    @property
    def key(self) -> bytes:
        return transaction_key(self.metadata.transactional_id)

    @property
    def value(self) -> bytes | None:
        return None if self.metadata.state is TxnState.DEAD else transaction_value(self.metadata)


Step = Reply | Persist | AwaitCompletion


@dataclass(slots=True)
class _Entry:
    current: TxnMetadata
    pending: TxnMetadata | None = None
    pending_since_ms: int = 0


@dataclass(slots=True)
class TransactionCoordinator:
    """Every transactional id's state and the rules of its transitions (see the module docstring)."""

    coordinator_epoch: int = 0
    timeout_ms_max: int = TRANSACTION_TIMEOUT_MS_MAX
    entries: dict[str, _Entry] = field(default_factory=dict)
    _deadlines: list = field(default_factory=list)  # heap of (deadline ms, transactional id, start ms)

    # --- loading ----------------------------------------------------------------------------------

    def load(self, key: bytes, value: bytes | None) -> None:
        """Replay one record of ``__transaction_state`` (in log order; the last per key wins).

        Raises CorruptRecordError on a record that is not one of the
        coordinator's. The coordinator epoch record keeps the largest epoch seen.
        """
        kind, name = decode_key(key)
        if kind == "coordinator":
            if value is not None:
                self.coordinator_epoch = max(self.coordinator_epoch, decode_coordinator_value(value))
            return
        if value is None:
            self.entries.pop(name, None)
            return
        metadata = decode_transaction_value(name, value)
        self.entries[name] = _Entry(metadata)
        self._track(metadata)

    def prepared(self) -> list[Markers]:
        """After loading: the markers of every transaction the log leaves in PrepareCommit or
        PrepareAbort, to write (again) before reporting :meth:`markers_written`."""
        return [self._markers(e.current) for e in self.entries.values() if e.current.state in PREPARED and e.pending is None]

    # --- the calls ------------------------------------------------------------------------------------

    def needs_producer_id(self, transactional_id: str) -> bool:
        """Whether :meth:`init_producer_id` for this id will need a fresh producer id."""
        entry = self.entries.get(transactional_id)
        if entry is None:
            return True
        current = entry.current
        return current.state in (S.EMPTY, *COMPLETED) and entry.pending is None and current.producer_epoch >= PRODUCER_EPOCH_MAX

    def init_producer_id(
        self,
        transactional_id: str,
        timeout_ms: int,
        now_ms: int,
        new_producer_id: int | None = None,
        expected: tuple[int, int] | None = None,
    ) -> Step:
        """InitProducerId: the (producer id, epoch) for a new instance of a transactional producer.

        ``new_producer_id`` must be given when :meth:`needs_producer_id` says
        so. ``expected`` is the (producer id, epoch) the calling instance holds,
        when it re-initialises itself (after an abort that left its sequence
        numbers unusable, KIP-360): if another instance moved the epoch since,
        the caller is a zombie (ProducerFencedError).
        """
        validate_transactional_id(transactional_id)
        self._check_timeout(timeout_ms)
        entry = self.entries.get(transactional_id)
        if entry is None:
            if expected is not None:
                raise ProducerFencedError(f"transactional id {transactional_id!r} has no state; {expected} is not its producer")
            producer_id = self._fresh(new_producer_id)
            metadata = TxnMetadata(transactional_id, producer_id, 0, timeout_ms, S.EMPTY, frozenset(), now_ms, -1)
            return self._prepare(None, metadata, now_ms, reply=(producer_id, 0))
        self._check_pending(entry)
        current = entry.current
        if expected is not None and expected != (current.producer_id, current.producer_epoch):
            raise ProducerFencedError(
                f"transactional id {transactional_id!r} is now producer {current.producer_id} epoch {current.producer_epoch}, not {expected}"
            )
        if current.state in PREPARED:
            return AwaitCompletion(transactional_id)
        if current.state is S.ONGOING or current.state is S.PREPARE_EPOCH_FENCE:
            # (a fence whose abort was not saved is prepared again)
            return self._fence_and_abort(entry, now_ms, reply=Retry.AFTER_COMPLETION)
        # (a tombstone removes the entry: DEAD is never current)
        check(current.state is not S.DEAD, f"transactional id {transactional_id!r} is Dead but still has an entry")
        if current.producer_epoch >= PRODUCER_EPOCH_MAX:
            producer_id, epoch = self._fresh(new_producer_id), 0
        else:
            producer_id, epoch = current.producer_id, current.producer_epoch + 1
        metadata = replace(
            current, producer_id=producer_id, producer_epoch=epoch, timeout_ms=timeout_ms, state=S.EMPTY,
            partitions=frozenset(), update_ms=now_ms, start_ms=-1,
        )
        return self._prepare(entry, metadata, now_ms, reply=(producer_id, epoch))

    def add_partitions(self, transactional_id: str, producer_id: int, epoch: int, partitions: Iterable, now_ms: int) -> Step:
        """AddPartitionsToTxn: the partitions join the open transaction (which this opens if none is)."""
        partitions = frozenset(TopicPartition(*tp) for tp in partitions)
        entry = self._producer_entry(transactional_id, producer_id, epoch)
        current = entry.current
        if current.state in PREPARED or current.state is S.PREPARE_EPOCH_FENCE:
            raise ConcurrentTransactionsError(f"transactional id {transactional_id!r} is still completing its last transaction")
        if current.state is S.ONGOING:
            if partitions <= current.partitions:
                return Reply()
            union = current.partitions | partitions
            self._check_partition_count(transactional_id, len(union))
            return self._prepare(entry, replace(current, partitions=union, update_ms=now_ms), now_ms)
        if current.state not in VALID_PREVIOUS_STATES[S.ONGOING]:
            raise InvalidTxnStateError(f"transactional id {transactional_id!r} cannot add partitions in state {current.state.name}")
        if not partitions:
            return Reply()
        self._check_partition_count(transactional_id, len(partitions))
        metadata = replace(current, state=S.ONGOING, partitions=partitions, update_ms=now_ms, start_ms=now_ms)
        return self._prepare(entry, metadata, now_ms)

    def end_txn(self, transactional_id: str, producer_id: int, epoch: int, commit: bool, now_ms: int) -> Step:
        """EndTxn: decide the open transaction's outcome (durably), then its markers are written.

        A retry after the transaction completed the same way is answered at
        once; the other way is InvalidTxnStateError. While the markers of the
        same outcome are being written the caller waits (AwaitCompletion).
        """
        entry = self._producer_entry(transactional_id, producer_id, epoch)
        current = entry.current
        target = S.PREPARE_COMMIT if commit else S.PREPARE_ABORT
        done = S.COMPLETE_COMMIT if commit else S.COMPLETE_ABORT
        if current.state is S.ONGOING:
            metadata = replace(current, state=target, update_ms=now_ms)
            return self._prepare(entry, metadata, now_ms, markers=self._markers(metadata))
        if current.state is target:
            return AwaitCompletion(transactional_id)
        if current.state is done:
            return Reply()
        outcome = "commit" if commit else "abort"
        raise InvalidTxnStateError(
            f"transactional id {transactional_id!r} cannot {outcome}: its transaction is {current.state.name}"
        )

    def check_in_transaction(self, transactional_id: str, producer_id: int, epoch: int, tp: TopicPartition) -> None:
        """Raise unless the producer instance is current and ``tp`` is in its open transaction (a
        TxnOffsetCommit must follow its AddOffsetsToTxn)."""
        entry = self._producer_entry(transactional_id, producer_id, epoch)
        if entry.current.state is not S.ONGOING or tp not in entry.current.partitions:
            raise InvalidTxnStateError(f"transactional id {transactional_id!r} has no open transaction holding {tp}")

    def markers_written(self, transactional_id: str, now_ms: int) -> Persist:
        """Every marker of the prepared transaction is written: persist its Complete state."""
        entry = self.entries.get(transactional_id)
        if entry is None or entry.current.state not in PREPARED:
            raise InternalStateError(f"markers written for {transactional_id!r}, which has no prepared transaction")
        self._check_pending(entry)
        current = entry.current
        done = S.COMPLETE_COMMIT if current.state is S.PREPARE_COMMIT else S.COMPLETE_ABORT
        return self._prepare(entry, replace(current, state=done, partitions=frozenset(), update_ms=now_ms), now_ms)

    # --- time ---------------------------------------------------------------------------------------

    def next_deadline_ms(self) -> int | None:
        """The earliest timeout among Ongoing transactions (None if none): when to call :meth:`expire`."""
        while self._deadlines:
            deadline, name, start = self._deadlines[0]
            entry = self.entries.get(name)
            if entry is not None and entry.current.state in (S.ONGOING, S.PREPARE_EPOCH_FENCE) and entry.current.start_ms == start:
                return deadline
            heapq.heappop(self._deadlines)  # stale: that transaction ended or changed
        return None

    def expire(self, now_ms: int) -> list[Persist]:
        """Abort every Ongoing transaction past its timeout, bumping its epoch (the producer is fenced).

        A transaction whose entry has a pending transition is left for the next
        call (the deadline stays in the heap).
        """
        steps, later = [], []
        while True:
            deadline = self.next_deadline_ms()
            if deadline is None or deadline > now_ms:
                break
            item = heapq.heappop(self._deadlines)
            entry = self.entries[item[1]]
            if entry.pending is not None:
                later.append(item)
                continue
            steps.append(self._fence_and_abort(entry, now_ms, reply=None))
        for item in later:
            heapq.heappush(self._deadlines, item)
        return steps

    # --- persistence outcomes ----------------------------------------------------------------------------

    def applied(self, transactional_id: str) -> TxnMetadata:
        """The pending transition of ``transactional_id`` is durable: it becomes the current state."""
        entry = self.entries.get(transactional_id)
        if entry is None or entry.pending is None:
            raise InternalStateError(f"no pending transition of {transactional_id!r} to apply")
        new = entry.pending
        if entry.current.state not in VALID_PREVIOUS_STATES[new.state]:
            raise InternalStateError(f"{transactional_id!r}: {entry.current.state.name} -> {new.state.name} is not a transition")
        old, entry.current, entry.pending = entry.current, new, None
        if new.state is S.DEAD:
            del self.entries[transactional_id]
        if old.state is not S.ONGOING:  # a transaction that opened (adding partitions keeps its deadline)
            self._track(new)
        return new

    def abandon(self, transactional_id: str) -> None:
        """The pending transition was certainly not written: forget it (memory keeps the current state).

        An in-memory fence (PrepareEpochFence) stays: its abort is prepared
        again by the next :meth:`expire` or ``init_producer_id``.
        """
        entry = self.entries.get(transactional_id)
        if entry is None or entry.pending is None:
            return
        entry.pending = None
        if entry.current.state is S.EMPTY and entry.current.producer_id == NO_PRODUCER_ID:
            del self.entries[transactional_id]  # a first init that never became durable
        elif entry.current.state is S.PREPARE_EPOCH_FENCE:
            self._track(entry.current)

    def pending(self, transactional_id: str) -> TxnMetadata | None:
        """The transition of ``transactional_id`` waiting to be persisted, if any."""
        entry = self.entries.get(transactional_id)
        return None if entry is None else entry.pending

    def state_of(self, transactional_id: str) -> TxnMetadata | None:
        """The current (durable, or fenced in memory) state of ``transactional_id``."""
        entry = self.entries.get(transactional_id)
        return None if entry is None else entry.current

    def describe(self) -> list[TxnMetadata]:
        return [entry.current for entry in self.entries.values()]

    # --- internals --------------------------------------------------------------------------------

    def _fresh(self, new_producer_id: int | None) -> int:
        if new_producer_id is None or isinstance(new_producer_id, bool) or not isinstance(new_producer_id, int) or new_producer_id < 0:
            raise InternalStateError(f"a new producer id is needed, and {new_producer_id!r} is not one")
        return new_producer_id

    def _check_timeout(self, timeout_ms) -> None:
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or not 0 < timeout_ms <= self.timeout_ms_max:
            raise InvalidTransactionTimeoutError(
                f"transaction_timeout_ms must be an int in 1..{self.timeout_ms_max}, not {timeout_ms!r}"
            )

    def _check_partition_count(self, transactional_id: str, count: int) -> None:
        if count > PARTITIONS_PER_TRANSACTION_MAX:
            raise InvalidConfigError(
                f"transactional id {transactional_id!r}: a transaction may span at most {PARTITIONS_PER_TRANSACTION_MAX} partitions"
            )

    @staticmethod
    def _check_pending(entry: _Entry) -> None:
        if entry.pending is not None:
            raise ConcurrentTransactionsError(
                f"transactional id {entry.current.transactional_id!r} has a change being saved ({entry.pending.state.name}); retry"
            )

    def _producer_entry(self, transactional_id: str, producer_id: int, epoch: int) -> _Entry:
        """The entry of a call from a producer instance; raises if that instance is not the current one."""
        validate_transactional_id(transactional_id)
        entry = self.entries.get(transactional_id)
        if entry is None or entry.current.producer_id != producer_id:
            raise InvalidProducerIdMappingError(
                f"transactional id {transactional_id!r} is not mapped to producer id {producer_id}: call init_transactions()"
            )
        current = entry.current
        if epoch < current.producer_epoch:
            raise ProducerFencedError(
                f"transactional id {transactional_id!r}: epoch {epoch} was fenced by epoch {current.producer_epoch} "
                f"(another instance with the same transactional id started, or the transaction timed out)"
            )
        if epoch > current.producer_epoch:
            raise InvalidProducerEpochError(f"transactional id {transactional_id!r}: epoch {epoch} is newer than {current.producer_epoch}")
        self._check_pending(entry)
        return entry

    def _fence_and_abort(self, entry: _Entry, now_ms: int, reply) -> Persist:
        """Bump the epoch in memory (PrepareEpochFence), then persist the abort with the new epoch."""
        current = entry.current
        if current.state is S.ONGOING:
            epoch = current.producer_epoch + 1 if current.producer_epoch < PRODUCER_EPOCH_MAX else current.producer_epoch
            entry.current = current = replace(current, producer_epoch=epoch, state=S.PREPARE_EPOCH_FENCE)
        if current.state is not S.PREPARE_EPOCH_FENCE:
            raise InternalStateError(f"{current.transactional_id!r}: cannot fence a transaction in state {current.state.name}")
        metadata = replace(current, state=S.PREPARE_ABORT, update_ms=now_ms)
        return self._prepare(entry, metadata, now_ms, reply=reply, markers=self._markers(metadata))

    def _prepare(self, entry: _Entry | None, metadata: TxnMetadata, now_ms: int, reply=None, markers=None) -> Persist:
        if entry is None:
            placeholder = TxnMetadata(metadata.transactional_id, NO_PRODUCER_ID, -1, metadata.timeout_ms, S.EMPTY)
            entry = self.entries[metadata.transactional_id] = _Entry(placeholder)
        elif entry.current.state not in VALID_PREVIOUS_STATES[metadata.state]:
            raise InternalStateError(
                f"{metadata.transactional_id!r}: {entry.current.state.name} -> {metadata.state.name} is not a transition"
            )
        entry.pending = metadata
        entry.pending_since_ms = now_ms
        return Persist(metadata, reply, markers)

    def _markers(self, metadata: TxnMetadata) -> Markers:
        return Markers(
            metadata.transactional_id, metadata.producer_id, metadata.producer_epoch, self.coordinator_epoch,
            metadata.state is S.PREPARE_COMMIT, tuple(sorted(metadata.partitions)), metadata.start_ms,
        )

    def _track(self, metadata: TxnMetadata) -> None:
        if metadata.state is S.ONGOING or metadata.state is S.PREPARE_EPOCH_FENCE:
            heapq.heappush(self._deadlines, (metadata.deadline_ms, metadata.transactional_id, metadata.start_ms))


def validate_transactional_id(transactional_id: object) -> str:
    """Return ``transactional_id`` if legal: a str of 1 to 255 printable characters; else InvalidConfigError."""
    if not isinstance(transactional_id, str):
        raise InvalidConfigError(f"transactional_id must be a str, not {type(transactional_id).__name__}")
    if not 0 < len(transactional_id) <= TRANSACTIONAL_ID_CHARS_MAX or not transactional_id.isprintable():
        raise InvalidConfigError(f"transactional_id must be 1 to {TRANSACTIONAL_ID_CHARS_MAX} printable characters, not {transactional_id!r}")
    try:
        transactional_id.encode()
    except UnicodeEncodeError:
        raise InvalidConfigError(f"transactional_id {transactional_id!r} is not valid UTF-8") from None
    return transactional_id


# --- the records of __transaction_state ---------------------------------------------------------------


def _pack_string(text: str) -> bytes:
    raw = text.encode()
    return _INT16.pack(len(raw)) + raw


def transaction_key(transactional_id: str) -> bytes:
    """TransactionLogKey v0: int16 version, string transactional id."""
    return _INT16.pack(TXN_KEY_VERSION) + _pack_string(validate_transactional_id(transactional_id))


COORDINATOR_KEY = _INT16.pack(COORDINATOR_KEY_VERSION)


def coordinator_value(coordinator_epoch: int) -> bytes:
    return _INT16.pack(0) + _INT32.pack(coordinator_epoch)


def decode_coordinator_value(value: bytes) -> int:
    reader = FieldReader(value, "coordinator epoch record")
    version, = reader.unpack(_INT16)
    if version != 0:
        raise CorruptRecordError(f"unknown coordinator record version {version}")
    epoch, = reader.unpack(_INT32)
    reader.finish()
    return epoch


def decode_key(key: bytes) -> tuple[str, str | None]:
    """("transaction", transactional id) or ("coordinator", None); CorruptRecordError otherwise."""
    reader = FieldReader(key, "__transaction_state key")
    (version,) = reader.unpack(_INT16)
    if version == COORDINATOR_KEY_VERSION:
        reader.finish()
        return "coordinator", None
    if version != TXN_KEY_VERSION:
        raise CorruptRecordError(f"unknown __transaction_state key version {version}")
    name = reader.string()
    reader.finish()
    return "transaction", name


def transaction_value(metadata: TxnMetadata) -> bytes:
    """TransactionLogValue v0: int16 version, int64 producer id, int16 epoch, int32 timeout ms, int8
    state, [string topic, [int32 partition]], int64 last update ms, int64 start ms."""
    if metadata.state is TxnState.PREPARE_EPOCH_FENCE:
        raise InternalStateError("PrepareEpochFence is never persisted")
    by_topic: dict[str, list[int]] = {}
    for tp in sorted(metadata.partitions):
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    parts = [
        _VALUE_HEAD.pack(TXN_VALUE_VERSION, metadata.producer_id, metadata.producer_epoch, metadata.timeout_ms, metadata.state.value),
        _INT32.pack(len(by_topic)),
    ]
    for topic, numbers in by_topic.items():
        parts.append(_pack_string(topic))
        parts.append(_INT32.pack(len(numbers)))
        parts.append(struct.pack(f">{len(numbers)}i", *numbers))
    parts.append(_VALUE_TAIL.pack(metadata.update_ms, metadata.start_ms))
    return b"".join(parts)


def decode_transaction_value(transactional_id: str, value: bytes) -> TxnMetadata:
    reader = FieldReader(value, "__transaction_state value")
    version, producer_id, epoch, timeout_ms, state = reader.unpack(_VALUE_HEAD)
    if version != TXN_VALUE_VERSION:
        raise CorruptRecordError(f"unknown __transaction_state value version {version}")
    try:
        state = TxnState(state)
    except ValueError:
        raise CorruptRecordError(f"unknown transaction state {state}") from None
    (topics,) = reader.unpack(_INT32)
    if topics < 0:
        raise CorruptRecordError(f"bad topic count {topics}")
    partitions = []
    for _ in range(topics):
        topic = reader.string()
        (count,) = reader.unpack(_INT32)
        if count < 0 or count > PARTITIONS_PER_TRANSACTION_MAX:
            raise CorruptRecordError(f"bad partition count {count}")
        numbers = reader.unpack(struct.Struct(f">{count}i"))
        partitions.extend(TopicPartition(topic, n) for n in numbers)
    update_ms, start_ms = reader.unpack(_VALUE_TAIL)
    reader.finish()
    return TxnMetadata(transactional_id, producer_id, epoch, timeout_ms, state, frozenset(partitions), update_ms, start_ms)
