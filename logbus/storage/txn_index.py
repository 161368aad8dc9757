"""Aborted-transaction index of one segment (Kafka's ``.txnindex``): a read_committed fetch learns
which transactions in its range aborted without scanning batches.

File format: a sequence of 32-byte little-endian entries, one per ABORT marker in the segment
holding the marker, in the order the markers were appended (so ``last_offset`` increases)::

    producer_id         int64   the transaction's producer
    first_offset        int64   the transaction's first offset (it may lie in an earlier segment)
    last_offset         int64   the offset of its ABORT marker (in this segment)
    last_stable_offset  int64   the log's LSO just after the marker: the first offset of the oldest
                                transaction still ongoing then, else the marker's offset + 1

A search for the aborted transactions overlapping ``[start, end)`` (entries with
``last_offset >= start`` and ``first_offset < end``) reads the segment holding ``start`` and the
ones after it, and stops after an entry whose ``last_stable_offset`` reaches ``end``: every
transaction begun below ``end`` had ended by then, so no later marker belongs to one (Kafka's
TransactionIndex.collectAbortedTxns).

A marker of a producer with no ongoing transaction (nothing to abort) gets no entry. The file is
created with its first entry: a segment whose file is missing has none. Like the offset and time
indexes it is derived data, not checksummed: recovery rebuilds it for every segment it scans, from
the batch headers (and, for ABORT markers, the marker's record) and the producer state they give;
a file that does not load is rebuilt the same way. Writes follow the indexes' contract
(offset_index.py): an entry is written before memory holds it, a failed write is cut back
(StorageError naming the file), and a cut that fails is made before the next write.

This class is not thread-safe; its owner (a segment) serialises access.
"""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

import numpy as np

from logbus.storage.offset_index import IndexFile


class AbortedTxn(NamedTuple):
    """One entry of the index (see the module docstring)."""

    producer_id: int
    first_offset: int
    last_offset: int
    last_stable_offset: int


class TxnIndex(IndexFile):
    """The aborted transactions whose ABORT marker lies in one segment (see the module docstring)."""

    DTYPE = np.dtype(
        [("producer_id", "<i8"), ("first_offset", "<i8"), ("last_offset", "<i8"), ("last_stable_offset", "<i8")]
    )
    KEY = "last_offset"

    def load(self) -> bool:
        """Load the entries; a missing file is an empty index. False (empty) if the file is inconsistent."""
        if not os.path.exists(self.path):
            self._close_fd()
            self._keys, self._values = [], []
            self._cut_pending = False
            return True
        return super().load()

    def _values_of(self, entries: np.ndarray) -> list | None:
        first = entries["first_offset"].astype(np.int64)
        last = entries["last_offset"].astype(np.int64)
        stable = entries["last_stable_offset"].astype(np.int64)
        if np.any(first > last) or np.any(stable > last + 1) or np.any(first < 0):
            return None
        return list(zip(entries["producer_id"].astype(np.int64).tolist(), first.tolist(), stable.tolist()))

    def _pack(self, key: int, value) -> bytes:
        producer_id, first_offset, last_stable_offset = value
        entry = np.zeros(1, self.DTYPE)
        entry["producer_id"], entry["first_offset"] = producer_id, first_offset
        entry["last_offset"], entry["last_stable_offset"] = key, last_stable_offset
        return entry.tobytes()

    def append(self, entry: AbortedTxn) -> None:
        """Add the entry of an ABORT marker appended to the segment (StorageError: nothing changed)."""
        self._append(entry.last_offset, (entry.producer_id, entry.first_offset, entry.last_stable_offset))

    def entry_at(self, i: int) -> AbortedTxn:
        producer_id, first_offset, last_stable_offset = self._values[i]
        return AbortedTxn(producer_id, first_offset, self._keys[i], last_stable_offset)

    def entries(self) -> list[AbortedTxn]:
        return [self.entry_at(i) for i in range(len(self._keys))]

    def rebuild(self, entries: list[AbortedTxn]) -> None:
        """Replace every entry (recovery); StorageError naming the file if a write fails (then the index
        holds a prefix of them, in memory and on disk)."""
        self.reset()
        for entry in entries:
            self.append(entry)

    def collect(self, start: int, end: int) -> tuple[list[AbortedTxn], bool]:
        """The entries overlapping ``[start, end)``, and whether the search may stop here (an entry's
        last stable offset reached ``end``: see the module docstring)."""
        found = []
        complete = False
        for i in range(bisect.bisect_left(self._keys, start), len(self._keys)):
            entry = self.entry_at(i)
            if entry.last_offset >= start and entry.first_offset < end:
                found.append(entry)
            if entry.last_stable_offset >= end:
                complete = True
                break
        return found, complete

    def consistent_with(self, base_offset: int, next_offset: int) -> bool:
        """Every marker the entries name lies inside the segment's offsets."""
        return not self._keys or (self._keys[0] >= base_offset and self._keys[-1] < next_offset)

    def truncate_from_offset(self, offset: int) -> None:
        """Drop the entries of markers at or after ``offset``."""
        self.truncate_entries(bisect.bisect_left(self._keys, offset))
