"""Idempotent producer state of one partition: per producer id, its epoch and its last batches.

The leader checks every batch that carries a producer id before writing it:

- a batch whose sequence range equals one of the producer's last
  ``BATCHES_KEPT`` batches is a duplicate (a retry of a batch that was
  written): the original offsets are returned and nothing is written;
- a batch must otherwise continue the producer's sequence exactly
  (``base_sequence == last_sequence + 1``), or start at 0 for a new producer
  or a new epoch; anything else is OutOfOrderSequenceError (a gap would mean
  lost records);
- a batch from an older producer epoch is ProducerFencedError.

Every replica (leader or follower) updates the table from the batch headers
it appends, so a new leader knows every producer's sequence. On open the
table is rebuilt from the headers in the log.

This class is not thread-safe; its owner (a partition log) serialises access.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from logbus.errors import OutOfOrderSequenceError, ProducerFencedError
from logbus.storage.record_batch import NO_PRODUCER_ID, BatchHeader

BATCHES_KEPT = 5  # as Kafka: at most this many batches in flight per partition with idempotence on


@dataclass(slots=True)
class _Producer:
    epoch: int
    batches: deque = field(default_factory=lambda: deque(maxlen=BATCHES_KEPT))  # (first_seq, last_seq, base_offset)

    @property
    def last_sequence(self) -> int:
        return self.batches[-1][1] if self.batches else -1


class ProducerStateTable:
    """Sequence state of the idempotent producers that wrote to one partition."""

    def __init__(self) -> None:
        self.producers: dict[int, _Producer] = {}

    def check(self, header: BatchHeader) -> int | None:
        """Validate a batch about to be appended by the leader.

        Returns the base offset it was written at before if it is a duplicate,
        None if it may be appended; raises OutOfOrderSequenceError or
        ProducerFencedError otherwise.
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
        for first, last, base_offset in state.batches:
            if first == header.base_sequence and last == header.last_sequence:
                return base_offset
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
        state = self.producers.get(header.producer_id)
        if state is None or header.producer_epoch > state.epoch:
            state = self.producers[header.producer_id] = _Producer(header.producer_epoch)
        state.batches.append((header.base_sequence, header.last_sequence, header.base_offset))

    def clear(self) -> None:
        self.producers.clear()
