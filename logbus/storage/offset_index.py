"""Sparse offset index of one segment: maps offsets to byte positions in the log file.

File format: a sequence of 8-byte little-endian entries
``(relative_offset: uint32, position: uint32)``, where ``relative_offset`` is
the base offset of a batch minus the segment's base offset and ``position`` is
that batch's byte position in the segment's log file. An entry is added at
most every ``index_interval_bytes`` of log, so a lookup finds the greatest
indexed batch at or below an offset and the log is scanned forward from there.

The index is not checksummed: it is derived data. When its file is missing,
inconsistent (entries out of order, positions past the log's end), or the
segment is being recovered, it is rebuilt from the log. Entries are kept in
memory for lookups and written to the file as they are made.

Writes and failures. The file holds exactly the entries in memory: an entry
is written (``pwrite`` at the end of the entries, so a short or failed write
is simply overwritten later) before it is added in memory, and a write that
fails cuts the file back and raises StorageError naming the file. Dropping
entries (a truncation, or undoing a failed append) always drops them in
memory; if the file cannot be cut back then, the cut is left pending and
made before the next write (:meth:`IndexFile.repair`, which the segment calls
before it writes anything). Until then the extra entries on disk all point
at or past the log's end, which :meth:`LogSegment._load_indexes` detects, so
they are never trusted. A new index object makes that cut before its first
write too: a file left behind by a deleted segment at the same base offset
is never appended to.

This class is not thread-safe; its owner (a segment) serialises access.
"""

from __future__ import annotations

import bisect
import os

import numpy as np

from logbus.errors import StorageError


class IndexFile:
    """Shared machinery of the sparse indexes: an append-only file of fixed-size entries.

    Subclasses set ``DTYPE`` (a numpy structured dtype) and name the key field
    in ``KEY``; keys must be non-decreasing.
    """

    DTYPE: np.dtype
    KEY: str

    def __init__(self, path: str) -> None:
        self.path = path
        self._keys: list[int] = []
        self._values: list[int] = []
        self._fd = -1
        # The file may hold more than the entries in memory (a file left behind, a cut that failed):
        # cut it to their length before the next write.
        self._cut_pending = True

    # --- loading and rebuilding ---------------------------------------------------------

    def load(self) -> bool:
        """Load entries from the file; return False (leaving the index empty) if it is missing or inconsistent."""
        self._close_fd()
        self._keys, self._values = [], []
        self._cut_pending = True
        try:
            raw = np.fromfile(self.path, dtype=np.uint8)
        except (FileNotFoundError, ValueError):
            return False
        if raw.size % self.DTYPE.itemsize:
            return False
        entries = raw.view(self.DTYPE)
        keys = entries[self.KEY].astype(np.int64)
        if keys.size and np.any(np.diff(keys) < 0):
            return False
        values = self._values_of(entries)
        if values is None:
            return False
        self._keys = keys.tolist()
        self._values = values
        self._cut_pending = False
        return True

    @property
    def value_field(self) -> str:
        return [name for name in self.DTYPE.names if name != self.KEY][0]

    def _values_of(self, entries: np.ndarray) -> list | None:
        """The values of entries read from the file (None: they are inconsistent)."""
        return entries[self.value_field].astype(np.int64).tolist()

    def _pack(self, key: int, value) -> bytes:
        """One entry as the file holds it."""
        entry = np.zeros(1, self.DTYPE)
        entry[self.KEY] = key
        entry[self.value_field] = value
        return entry.tobytes()

    def reset(self) -> None:
        """Drop every entry, in memory and on disk (before a rebuild); StorageError if the file cannot be cut."""
        self._keys, self._values = [], []
        self._cut_pending = True
        self.repair()

    @property
    def size_bytes(self) -> int:
        """The length of the file when it holds exactly the entries in memory."""
        return len(self._keys) * self.DTYPE.itemsize

    def _open(self) -> int:
        if self._fd < 0:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError as error:
                raise StorageError(f"cannot open index {self.path}: {error}") from error
        return self._fd

    def repair(self) -> None:
        """Make a pending cut (see the module docstring); StorageError if it fails again."""
        if not self._cut_pending:
            return
        try:
            if self._fd < 0:
                try:
                    self._fd = os.open(self.path, os.O_WRONLY)
                except FileNotFoundError:
                    self._cut_pending = False  # nothing to cut; the first write creates the file
                    return
            os.ftruncate(self._fd, self.size_bytes)
        except OSError as error:
            raise StorageError(f"cutting index {self.path} back to {len(self._keys)} entries failed: {error}") from error
        self._cut_pending = False

    def _append(self, key: int, value) -> None:
        """Write one entry, then add it in memory; on failure the file is cut back (or the cut left
        pending) and StorageError is raised, with the entries in memory unchanged."""
        data = self._pack(key, value)
        self.repair()
        fd = self._open()
        position = self.size_bytes
        try:
            written = 0
            while written < len(data):  # a short write (the disk filling up) is finished or fails
                written += os.pwrite(fd, data[written:], position + written)
        except OSError as error:
            self._cut_pending = True
            try:
                self.repair()
            except StorageError:
                pass  # cut before the next write
            raise StorageError(f"append to index {self.path} failed: {error}") from error
        self._keys.append(key)
        self._values.append(value)

    def truncate_entries(self, count: int) -> None:
        """Keep only the first ``count`` entries (in memory at once; the file now, or before the next write)."""
        if count >= len(self._keys):
            return
        del self._keys[count:]
        del self._values[count:]
        self._cut_pending = True
        try:
            self.repair()
        except StorageError:
            pass  # the entries past the cut point past the log's end: never trusted, cut before the next write

    # --- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._keys)

    def floor(self, key: int) -> int | None:
        """Index of the last entry whose key is <= ``key``, or None."""
        i = bisect.bisect_right(self._keys, key) - 1
        return i if i >= 0 else None

    def entry(self, i: int) -> tuple[int, int]:
        return self._keys[i], self._values[i]

    @property
    def last_key(self) -> int | None:
        return self._keys[-1] if self._keys else None

    # --- lifetime ---------------------------------------------------------------------------

    def flush(self) -> None:
        """fdatasync the file (if it was written through this object); StorageError naming it on failure."""
        if self._fd >= 0:
            try:
                os.fdatasync(self._fd)
            except OSError as error:
                raise StorageError(f"fsync of index {self.path} failed: {error}") from error

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass  # nothing of ours is lost: every write was made (or undone) before

    def close(self) -> None:
        """Close the file (its owner makes a pending cut first, where it can: see the module docstring)."""
        self._close_fd()

    def delete(self) -> None:
        """Remove the file (raises OSError, other than for a file already gone)."""
        self._close_fd()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class OffsetIndex(IndexFile):
    """Sparse map from relative offset to byte position (see the module docstring)."""

    DTYPE = np.dtype([("relative_offset", "<u4"), ("position", "<u4")])
    KEY = "relative_offset"

    def add(self, relative_offset: int, position: int) -> None:
        self._append(relative_offset, position)

    def lookup(self, relative_offset: int) -> int:
        """Byte position of the greatest indexed batch at or below ``relative_offset`` (0 if none)."""
        i = self.floor(relative_offset)
        return 0 if i is None else self._values[i]

    def consistent_with(self, log_size_bytes: int) -> bool:
        return all(position < log_size_bytes for position in self._values[-1:])

    def truncate_from_position(self, position: int) -> None:
        """Drop entries that point at or past ``position``."""
        count = bisect.bisect_left(self._values, position)
        self.truncate_entries(count)
