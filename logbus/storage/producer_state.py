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
  (``base_sequence == last_sequence + 1``), or start at 0 for a new producer
  or a new epoch; anything else is OutOfOrderSequenceError, retriable (a
  gap would mean lost records, and the batch that fills it may still be on
  its way);
- a batch from an older producer epoch is ProducerFencedError.

A producer starts a new epoch, at sequence 0, after one of its batches to a
partition failed for good (KIP-360; see logbus/api/producer.py).

Every replica (leader or follower) updates the table from the batch headers
it appends, so a new leader knows every producer's sequence. On open the
table is rebuilt from the headers in the log, and, for segments the cleaner
rewrote, from the entries it kept for them (:meth:`ProducerStateTable.entries`).

This class is not thread-safe; its owner (a partition log) serialises access.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from logbus.errors import DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError
from logbus.storage.batch_header import NO_PRODUCER_ID, BatchHeader

BATCHES_KEPT = 5  # as Kafka: at most this many batches in flight per partition with idempotence on
# (producer id, epoch, first sequence, last sequence, base offset, max timestamp ms) of one batch
BatchEntry = tuple[int, int, int, int, int, int]


@dataclass(slots=True)
class _Producer:
    epoch: int
    # (first_seq, last_seq, base_offset, max_timestamp_ms) of the last batches, oldest first
    batches: deque = field(default_factory=lambda: deque(maxlen=BATCHES_KEPT))

    @property
    def last_sequence(self) -> int:
        return self.batches[-1][1] if self.batches else -1


class ProducerStateTable:
    """Sequence state of the idempotent producers that wrote to one partition."""

    def __init__(self) -> None:
        self.producers: dict[int, _Producer] = {}

    def check(self, header: BatchHeader) -> tuple[int, int] | None:
        """Validate a batch about to be appended by the leader.

        Returns (base offset, max timestamp) of the batch as written before if
        it is a duplicate, None if it may be appended; raises
        DuplicateSequenceError, OutOfOrderSequenceError or ProducerFencedError
        otherwise.
        """
        if header.producer_id == NO_PRODUCER_ID:
            return None
        state = self.producers.get(header.producer_id)
        if state is None:
            if header.base_sequence != 0:
                raise OutOfOrderSequenceError(
                    f"producer {header.producer_id} is unknown here and its batch starts at sequence {header.base_sequence}, not 0"
                )
            return None
        if header.producer_epoch < state.epoch:
            raise ProducerFencedError(f"producer {header.producer_id} epoch {header.producer_epoch} is older than {state.epoch}")
        if header.producer_epoch > state.epoch:
            if header.base_sequence != 0:
                raise OutOfOrderSequenceError(f"a new producer epoch must start at sequence 0, not {header.base_sequence}")
            return None
        for first, last, base_offset, max_timestamp_ms in state.batches:
            if first == header.base_sequence and last == header.last_sequence:
                return base_offset, max_timestamp_ms
        oldest = state.batches[0][0]
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

    def update(self, header: BatchHeader) -> None:
        """Record a batch that was appended (as leader or follower)."""
        if header.producer_id == NO_PRODUCER_ID:
            return
        self.apply(
            (header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence, header.base_offset, header.max_timestamp_ms)
        )

    def apply(self, entry: "BatchEntry") -> None:
        """Record a batch given as an entry of :meth:`entries` (what :meth:`update` does with a header)."""
        producer_id, epoch, first_sequence, last_sequence, base_offset, max_timestamp_ms = entry
        state = self.producers.get(producer_id)
        if state is None or epoch > state.epoch:
            state = self.producers[producer_id] = _Producer(epoch)
        state.batches.append((first_sequence, last_sequence, base_offset, max_timestamp_ms))

    def entries(self) -> list["BatchEntry"]:
        """The table as batch entries, in offset order: applying them to an empty table rebuilds it,
        and applying them after the entries of earlier batches gives what updating with every one of
        the batches they summarise would have (a producer's older batches only set its epoch).

        The cleaner keeps these for the batches it rewrites (see cleaner.py): after compaction a
        producer's batches may be gone, but its sequence state must survive a restart.
        """
        out = [
            (producer_id, state.epoch, first, last, base_offset, max_timestamp_ms)
            for producer_id, state in self.producers.items()
            for first, last, base_offset, max_timestamp_ms in state.batches
        ]
        out.sort(key=lambda entry: entry[4])
        return out

    def clear(self) -> None:
        self.producers.clear()
