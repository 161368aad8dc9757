"""Sparse time index of one segment: maps timestamps to offsets.

File format: a sequence of 12-byte little-endian entries
``(timestamp_ms: int64, relative_offset: uint32)``. An entry says: every record
at or after ``relative_offset`` (relative to the segment's base offset) that
has a timestamp >= ``timestamp_ms`` comes at or after that batch; entries are
added only when a batch's max timestamp exceeds the last indexed one, so keys
increase. Like the offset index it is derived data, not checksummed, and is
rebuilt from the log when in doubt.

This class is not thread-safe; its owner (a segment) serialises access.
"""

from __future__ import annotations

import bisect

import numpy as np

from logbus.storage.offset_index import IndexFile


class TimeIndex(IndexFile):
    """Sparse map from max timestamp to the relative offset of the batch that reached it."""

    DTYPE = np.dtype([("timestamp_ms", "<i8"), ("relative_offset", "<u4")])
    KEY = "timestamp_ms"

    def maybe_add(self, max_timestamp_ms: int, relative_offset: int) -> None:
        """Index a batch whose max timestamp is larger than any indexed before."""
        last = self.last_key
        if last is None or max_timestamp_ms > last:
            self._append(max_timestamp_ms, relative_offset)

    def first_offset_reaching(self, timestamp_ms: int) -> int | None:
        """Relative offset of the batch after which scanning can start to find ``timestamp_ms``.

        Returns the relative offset of the last entry whose timestamp is below
        ``timestamp_ms`` (records before it are all older), or None when no
        entry is below it (start at the segment's beginning).
        """
        i = bisect.bisect_left(self._keys, timestamp_ms) - 1
        return self._values[i] if i >= 0 else None

    def truncate_from_offset(self, relative_offset: int) -> None:
        """Drop entries for batches at or after ``relative_offset``."""
        count = bisect.bisect_left(self._values, relative_offset)
        self.truncate_entries(count)
