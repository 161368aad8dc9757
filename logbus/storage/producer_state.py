"""Idempotent producer state of one partition: per producer id, its epoch and its last batches.

The leader checks every batch that carries a producer id before writing it:

- a batch whose sequence range equals one of the producer's last
  ``BATCHES_KEPT`` batches is a duplicate (a retry of a batch that was
  written): the original offsets and timestamp are returned and nothing is
  written;
- a batch that starts below the oldest of those batches is
  DuplicateSequenceError, at once and not retriable: its sequence numbers
  were written before the window's (the leader only accepts a producer's
  sequence numbers in order), so writing it would duplicate its records, and
  no retry can make it the next batch (Kafka's DUPLICATE_SEQUENCE_NUMBER);
- a batch must otherwise continue the producer's sequence exactly
  (``base_sequence == last_sequence + 1``), or start at 0 for a new epoch of
  a producer known here; anything else is OutOfOrderSequenceError, retriable
  (a gap would mean lost records, and the batch that fills it may still be on
  its way);
- a batch from a producer id this table does not know is accepted whatever
  its first sequence, and starts the producer's state (Kafka's rule since
  KIP-360, ``ProducerAppendInfo.checkSequence``): the table may have
  forgotten the producer (expiry, below; or retention or delete_records took
  every batch it had, and the open after that), and the producer's next batch
  then continues a sequence the table never saw. The price, as in Kafka: a
  batch of a producer unknown here that overtook its predecessors (they met a
  retriable error, or arrived late) is written ahead of them, and they are
  then UnknownSequenceError (below the sequence the table first knew it at), so their records
  fail instead of being written out of order; and a retry of a batch written
  before the producer was forgotten is written again. A leader replica lets a
  batch ahead of its producer's next sequence wait briefly for its
  predecessors first (partition_replica.py, ``_wait_for_earlier_batches``),
  an unknown producer's too, so only a predecessor that failed or is slower
  than that wait is overtaken;
- a batch from an older producer epoch is ProducerFencedError, and so is a
  transaction marker (:meth:`ProducerStateTable.check_marker`).

A producer starts a new epoch, at sequence 0, after one of its batches to a
partition failed for good (KIP-360; see logbus/api/producer.py). A
transaction marker may carry a newer epoch than the producer's batches here
(the coordinator fenced the producer and ended its transaction): the epoch
moves to it, the producer's batches are forgotten, and its next batch starts
at sequence 0.

Expiry (Kafka's ``producer.id.expiration.ms``): :meth:`ProducerStateTable.remove_expired`
forgets every producer whose last write (the max timestamp of its last batch
or marker, as Kafka takes it: on a CreateTime topic the producer's own
timestamp) is at least the expiration old, except one with a transaction
open. The table runs no timer: its owner calls it when it does work anyway
(partition_log.py: a segment roll, a rebuild). The timestamps are those of
the batch headers (and of the cleaner's summaries), so an open, which rebuilds
the table from them and then expires, forgets the same producers again.
While the log stays open, a batch's append time counts too when it is later
than the batch's timestamp (:meth:`ProducerStateTable.update`): a producer
that writes records stamped in the past (a backfill on a CreateTime topic)
keeps its state for the expiration after each write, where Kafka, which
measures the timestamps alone, would forget it at its next check and write
its next retry twice. That append time is nowhere on disk, so a rebuild (an
open, a truncation) forgets such a producer once its timestamps are the expiration old (Kafka's rule).

A transactional batch without sequence numbers (base sequence -1: the group
coordinator's offsets in a transaction, as Kafka's coordinator writes them)
is checked for its epoch only: it is never a duplicate and continues no
sequence.

Transactions (KIP-98). Per producer, the table also keeps the first offset of
its ongoing transaction: the first transactional data batch sets it, a
control batch (the transaction's marker, COMMIT or ABORT) clears it; an epoch
change does not (only a marker ends a transaction). The smallest of them is
the log's first unstable offset (:meth:`ProducerStateTable.first_unstable_offset`):
read_committed readers stop there.

Every replica (leader or follower) updates the table from the batch headers
it appends, so a new leader knows every producer's sequence. On open the
table is rebuilt from the headers in the log, and, for segments the cleaner
rewrote, from the entries it kept for them (:meth:`ProducerStateTable.entries`).

This class is not thread-safe; its owner (a partition log) serialises access.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from logbus.errors import DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError, UnknownSequenceError
from logbus.storage.batch_header import NO_PRODUCER_ID, NO_SEQUENCE, BatchHeader

BATCHES_KEPT = 5  # as Kafka: at most this many batches in flight per partition with idempotence on
# (producer id, epoch, first sequence, last sequence, base offset, max timestamp ms, first offset of
# the producer's ongoing transaction or NO_TRANSACTION) of one batch; an entry with first sequence
# NO_SEQUENCE stands for a producer whose table holds no batch (a marker moved its epoch), at the
# offset of that marker.
BatchEntry = tuple[int, int, int, int, int, int, int]
NO_TRANSACTION = -1


@dataclass(slots=True)
class _Producer:
    epoch: int
    # (first_seq, last_seq, base_offset, max_timestamp_ms) of the last batches, oldest first
    batches: deque = field(default_factory=lambda: deque(maxlen=BATCHES_KEPT))
    txn_first_offset: int | None = None  # the first offset of its ongoing transaction
    # Offset and timestamp of its last marker (or batch without sequence numbers): the entry of a
    # producer whose table holds no batch.
    marker_offset: int = -1
    marker_timestamp_ms: int = -1
    last_timestamp_ms: int = -1  # the max timestamp of its latest batch or marker: what expiry measures
    # The first sequence number of the run the table knows: a batch below it is UnknownSequenceError,
    # not a duplicate (the table took a batch at this sequence while it did not know the producer).
    known_from: int = 0

    def add_batch(self, first: int, last: int, base_offset: int, max_timestamp_ms: int, unknown_before: bool = False) -> None:
        """Keep a batch written (as leader or follower). One that does not continue the producer's
        sequence starts it afresh: the leader took it from a producer it did not know (expired, or
        all its batches deleted), and the batches before it are no sequence the next one continues.
        ``unknown_before``: the table did not know the producer (its sequences below ``first`` are unknown)."""
        if self.batches and first != self.batches[-1][1] + 1:
            self.batches.clear()
            self.known_from = first
        elif not self.batches and unknown_before:
            self.known_from = first
        self.batches.append((first, last, base_offset, max_timestamp_ms))
        self.last_timestamp_ms = max_timestamp_ms

    def add_marker(self, offset: int, timestamp_ms: int) -> None:
        """Keep a marker (or a batch without sequence numbers) written."""
        self.marker_offset, self.marker_timestamp_ms = offset, timestamp_ms
        self.last_timestamp_ms = timestamp_ms

    @property
    def last_sequence(self) -> int:
        return self.batches[-1][1] if self.batches else -1


class ProducerStateTable:
    """Sequence state of the idempotent producers that wrote to one partition."""

    def __init__(self) -> None:
        self.producers: dict[int, _Producer] = {}
        self.ongoing: dict[int, int] = {}  # producer id -> first offset of its ongoing transaction

    def check(self, header: BatchHeader) -> tuple[int, int] | None:
        """Validate a batch about to be appended by the leader.

        Returns (base offset, max timestamp) of the batch as written before if
        it is a duplicate, None if it may be appended; raises
        DuplicateSequenceError, UnknownSequenceError, OutOfOrderSequenceError or ProducerFencedError
        otherwise.
        """
        if header.producer_id == NO_PRODUCER_ID:
            return None
        state = self.producers.get(header.producer_id)
        if header.base_sequence == NO_SEQUENCE and header.is_transactional:
            if state is not None and header.producer_epoch < state.epoch:
                raise ProducerFencedError(f"producer {header.producer_id} epoch {header.producer_epoch} is older than {state.epoch}")
            return None
        if state is None:
            return None  # unknown here (new, or forgotten): any first sequence starts its state (KIP-360)
        if header.producer_epoch < state.epoch:
            raise ProducerFencedError(f"producer {header.producer_id} epoch {header.producer_epoch} is older than {state.epoch}")
        if header.producer_epoch > state.epoch or not state.batches:
            if header.base_sequence != 0:
                raise OutOfOrderSequenceError(f"a new producer epoch must start at sequence 0, not {header.base_sequence}")
            return None
        for first, last, base_offset, max_timestamp_ms in state.batches:
            if first == header.base_sequence and last == header.last_sequence:
                return base_offset, max_timestamp_ms
        oldest = state.batches[0][0]
        if header.base_sequence < state.known_from:
            raise UnknownSequenceError(
                f"producer {header.producer_id}: batch starts at sequence {header.base_sequence}, below sequence "
                f"{state.known_from}, which this leader took while it did not know the producer: whether it "
                f"was written cannot be known here"
            )
        if header.base_sequence < oldest:
            raise DuplicateSequenceError(
                f"producer {header.producer_id}: batch starts at sequence {header.base_sequence}, below the last "
                f"{len(state.batches)} batches this leader remembers (from sequence {oldest}): it was written "
                f"before, at offsets no longer known"
            )
        expected = state.last_sequence + 1
        if header.base_sequence != expected:
            raise OutOfOrderSequenceError(
                f"producer {header.producer_id}: batch starts at sequence {header.base_sequence}, expected {expected}"
            )
        return None

    def check_marker(self, producer_id: int, producer_epoch: int) -> None:
        """Validate a transaction marker about to be appended by the leader: ProducerFencedError if its
        epoch is older than the producer's. A producer unknown here, or without an ongoing transaction,
        is no error (Kafka writes such a marker too: it moves the producer's epoch here, which fences
        a zombie that never wrote to this partition)."""
        state = self.producers.get(producer_id)
        if state is not None and producer_epoch < state.epoch:
            raise ProducerFencedError(
                f"transaction marker of producer {producer_id} with epoch {producer_epoch}, older than {state.epoch}"
            )

    def update(self, header: BatchHeader, append_ms: int | None = None) -> None:
        """Record a batch that was appended (as leader or follower); ``append_ms``: when (the log's
        clock), which expiry takes when it is later than the batch's timestamp (see the module docstring)."""
        producer_id = header.producer_id
        if producer_id == NO_PRODUCER_ID:
            return
        state = self.producers.get(producer_id)
        if header.is_control:
            if state is None or header.producer_epoch > state.epoch:
                state = self._new_epoch(producer_id, header.producer_epoch, state)
            state.txn_first_offset = None
            self.ongoing.pop(producer_id, None)
            state.add_marker(header.base_offset, header.max_timestamp_ms)
            if append_ms is not None and append_ms > state.last_timestamp_ms:
                state.last_timestamp_ms = append_ms
            return
        unknown = state is None
        if state is None or header.producer_epoch > state.epoch:
            state = self._new_epoch(producer_id, header.producer_epoch, state)
        if header.base_sequence == NO_SEQUENCE:  # continues no sequence: recorded as a marker's epoch is
            state.add_marker(header.base_offset, header.max_timestamp_ms)
        else:
            state.add_batch(header.base_sequence, header.last_sequence, header.base_offset, header.max_timestamp_ms, unknown_before=unknown)
        if header.is_transactional and state.txn_first_offset is None:
            state.txn_first_offset = self.ongoing[producer_id] = header.base_offset
        if append_ms is not None and append_ms > state.last_timestamp_ms:
            state.last_timestamp_ms = append_ms

    def _new_epoch(self, producer_id: int, epoch: int, previous: _Producer | None) -> _Producer:
        """The producer in a new epoch: its batches forgotten, its ongoing transaction kept (only a
        marker ends one)."""
        state = self.producers[producer_id] = _Producer(epoch)
        if previous is not None:
            state.txn_first_offset = previous.txn_first_offset
            state.marker_offset, state.marker_timestamp_ms = previous.marker_offset, previous.marker_timestamp_ms
        return state

    def apply(self, entry: "BatchEntry") -> None:
        """Record a batch given as an entry of :meth:`entries` (what :meth:`update` does with a header)."""
        producer_id, epoch, first_sequence, last_sequence, base_offset, max_timestamp_ms, txn_first_offset = entry
        state = self.producers.get(producer_id)
        if state is None or epoch > state.epoch:
            state = self._new_epoch(producer_id, epoch, state)
        if first_sequence == NO_SEQUENCE:
            state.add_marker(base_offset, max_timestamp_ms)
        else:
            state.add_batch(first_sequence, last_sequence, base_offset, max_timestamp_ms)
        if txn_first_offset == NO_TRANSACTION:
            state.txn_first_offset = None
            self.ongoing.pop(producer_id, None)
        else:
            state.txn_first_offset = self.ongoing[producer_id] = txn_first_offset

    def remove_expired(self, now_ms: int, expiration_ms: int) -> int:
        """Forget every producer whose last write is at least ``expiration_ms`` old at ``now_ms``
        (Kafka's ``producer.id.expiration.ms``), except those with a transaction open. Returns how
        many went. O(producers): called on work the log does anyway, never on a timer."""
        expired = [
            producer_id
            for producer_id, state in self.producers.items()
            if state.txn_first_offset is None and now_ms - state.last_timestamp_ms >= expiration_ms
        ]
        for producer_id in expired:
            del self.producers[producer_id]
        return len(expired)

    def first_unstable_offset(self) -> int | None:
        """The first offset of the oldest ongoing transaction, or None when none is ongoing."""
        return min(self.ongoing.values()) if self.ongoing else None

    def ongoing_transactions(self) -> dict[int, int]:
        """producer id -> first offset of its ongoing transaction (a copy)."""
        return dict(self.ongoing)

    def move_transaction_start(self, producer_id: int, first_offset: int | None) -> None:
        """Where a producer's ongoing transaction now starts in the log (None: none of its batches is
        left); for a log whose oldest segments went (see PartitionLog._forget_deleted_transactions)."""
        state = self.producers.get(producer_id)
        if state is None:
            return
        state.txn_first_offset = first_offset
        if first_offset is None:
            self.ongoing.pop(producer_id, None)
        else:
            self.ongoing[producer_id] = first_offset

    def entries(self) -> list["BatchEntry"]:
        """The table as batch entries, in offset order: applying them to an empty table rebuilds it,
        and applying them after the entries of earlier batches gives what updating with every one of
        the batches they summarise would have (a producer's older batches only set its epoch).

        The cleaner keeps these for the batches it rewrites (see cleaner.py): after compaction a
        producer's batches may be gone, but its sequence state must survive a restart.
        """
        out = []
        for producer_id, state in self.producers.items():
            txn = NO_TRANSACTION if state.txn_first_offset is None else state.txn_first_offset
            out += [
                (producer_id, state.epoch, first, last, base_offset, max_timestamp_ms, txn)
                for first, last, base_offset, max_timestamp_ms in state.batches
            ]
            if not state.batches or state.marker_offset > state.batches[-1][2]:
                # Its last marker (or batch without sequence numbers) came after its last batch: an
                # entry of its own, so that the state survives the batches going (retention,
                # delete_records) as an open after that would find it.
                out.append((producer_id, state.epoch, NO_SEQUENCE, NO_SEQUENCE, state.marker_offset, state.marker_timestamp_ms, txn))
        out.sort(key=lambda entry: entry[4])
        return out

    def clear(self) -> None:
        self.producers.clear()
        self.ongoing.clear()
