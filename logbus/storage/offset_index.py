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
memory for lookups and appended to the file as they are made.

This class is not thread-safe; its owner (a segment) serialises access.
"""

from __future__ import annotations

import bisect
import os

import numpy as np


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

    # --- loading and rebuilding ---------------------------------------------------------

    def load(self) -> bool:
        """Load entries from the file; return False (leaving the index empty) if it is missing or inconsistent."""
        self._close_fd()
        self._keys, self._values = [], []
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
        self._keys = keys.tolist()
        self._values = entries[self.value_field].astype(np.int64).tolist()
        return True

    @property
    def value_field(self) -> str:
        return [name for name in self.DTYPE.names if name != self.KEY][0]

    def reset(self) -> None:
        """Drop every entry, in memory and on disk (before a rebuild)."""
        self._keys, self._values = [], []
        self._close_fd()
        with open(self.path, "wb"):
            pass

    def _open_for_append(self) -> int:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self._fd

    def _append(self, key: int, value: int) -> None:
        entry = np.zeros(1, self.DTYPE)
        entry[self.KEY] = key
        entry[self.value_field] = value
        os.write(self._open_for_append(), entry.tobytes())
        self._keys.append(key)
        self._values.append(value)

    def truncate_entries(self, count: int) -> None:
        """Keep only the first ``count`` entries."""
        if count >= len(self._keys):
            return
        del self._keys[count:]
        del self._values[count:]
        self._close_fd()
        os.truncate(self.path, count * self.DTYPE.itemsize)

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
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._close_fd()

    def delete(self) -> None:
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
