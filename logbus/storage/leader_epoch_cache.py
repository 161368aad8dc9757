"""Leader epoch cache: for each leader epoch, the first offset written in it (KIP-101).

A replica that restarts, or a leader that was deposed, must not truncate to
its own high watermark (that loses or diverges data, as KIP-101 shows).
Instead it asks the leader for the end offset of its latest epoch and
truncates to that. This cache answers that question on the leader and gives
the follower its latest epoch.

File ``leader-epoch-checkpoint`` in the partition's directory, text::

    0                 format version
    N                 number of entries
    epoch start       one line per entry, epochs and start offsets increasing

It is rewritten (write, fsync, rename) whenever an entry is added or
entries are removed; if it is missing or unreadable the log rebuilds it from
the leader epochs stamped on its batches.

On open the log keeps, of the entries the file holds, those inside the log
(:meth:`LeaderEpochCache.clamp`: from the log start offset, below the log end
offset), and it keeps memory so whenever its start or end moves. So a file
that missed a removal (a truncation from either end, or a clear, whose write
failed) holds nothing the log would use: removals change memory first, then
write the file, and raise StorageError if that fails, with memory already
what the next open will find. :meth:`assign` changes memory only once the
file is written; an append that fails after it puts the old entries back
(the new one starts at the log end, which the next open drops too).

This class is not thread-safe; its owner (a partition log) serialises access.
"""

from __future__ import annotations

import bisect
import os

from logbus.errors import StorageError
from logbus.storage.files import write_atomically

CHECKPOINT_FILE = "leader-epoch-checkpoint"
UNDEFINED_EPOCH = -1
UNDEFINED_OFFSET = -1


class LeaderEpochCache:
    """(epoch, start offset) entries, epochs and offsets strictly increasing."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, CHECKPOINT_FILE)
        self.entries: list[tuple[int, int]] = []

    def load(self) -> bool:
        """Read the checkpoint; False if missing or malformed (then the caller rebuilds)."""
        try:
            with open(self.path) as file:
                lines = file.read().split("\n")
            if lines[0] != "0":
                return False
            count = int(lines[1])
            entries = [tuple(map(int, line.split())) for line in lines[2 : 2 + count]]
        except (FileNotFoundError, ValueError, IndexError):
            return False
        if len(entries) != count or any(len(e) != 2 for e in entries):
            return False
        if any(a[0] >= b[0] or a[1] > b[1] for a, b in zip(entries, entries[1:])):
            return False
        self.entries = entries
        return True

    def save(self, entries: list[tuple[int, int]] | None = None) -> None:
        """Write ``entries`` (default: the entries in memory) to the checkpoint; StorageError naming it on failure."""
        entries = self.entries if entries is None else entries
        lines = [f"0\n{len(entries)}\n"] + [f"{epoch} {start}\n" for epoch, start in entries]
        try:
            write_atomically(self.path, "".join(lines))
        except OSError as error:
            raise StorageError(f"writing the leader epoch checkpoint {self.path} failed: {error}") from error

    @property
    def latest_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else UNDEFINED_EPOCH

    def assign(self, epoch: int, start_offset: int, persist: bool = True) -> bool:
        """Record that ``epoch`` starts at ``start_offset`` if it is newer than the latest; True if added."""
        if epoch < 0 or epoch <= self.latest_epoch:
            return False
        # A later epoch can never start before an earlier one's start.
        entries = list(self.entries)
        while entries and entries[-1][1] > start_offset:
            entries.pop()
        entries.append((epoch, start_offset))
        if persist:
            self.save(entries)  # StorageError: nothing changed in memory
        self.entries = entries
        return True

    def end_offset_for(self, epoch: int, log_end_offset: int) -> tuple[int, int]:
        """KIP-279: (largest known epoch <= ``epoch``, the offset where it ended).

        The end of an epoch is the start offset of the next larger epoch, or
        the log end offset for the latest epoch. Returns (UNDEFINED_EPOCH,
        UNDEFINED_OFFSET) if every known epoch is larger than ``epoch``.
        """
        epochs = [e for e, _ in self.entries]
        i = bisect.bisect_right(epochs, epoch) - 1
        if i < 0:
            return UNDEFINED_EPOCH, UNDEFINED_OFFSET
        if i == len(self.entries) - 1:
            return self.entries[i][0], log_end_offset
        return self.entries[i][0], self.entries[i + 1][1]

    def truncate_from_end(self, end_offset: int, persist: bool = True) -> None:
        """Drop entries that start at or after ``end_offset`` (the log was cut there)."""
        kept = [entry for entry in self.entries if entry[1] < end_offset]
        if kept != self.entries:
            self.entries = kept
            if persist:
                self.save()

    def truncate_from_start(self, start_offset: int, persist: bool = True) -> None:
        """The log now starts at ``start_offset``: clamp the entry that spans it, drop older ones."""
        i = 0
        while i + 1 < len(self.entries) and self.entries[i + 1][1] <= start_offset:
            i += 1
        kept = self.entries[i:]
        if kept and kept[0][1] < start_offset:
            kept[0] = (kept[0][0], start_offset)
        if kept != self.entries:
            self.entries = kept
            if persist:
                self.save()

    def clamp(self, start_offset: int, end_offset: int) -> None:
        """Keep, in memory only, what lies inside a log from ``start_offset`` to ``end_offset`` (on open)."""
        self.truncate_from_start(start_offset, persist=False)
        self.truncate_from_end(end_offset, persist=False)

    def clear(self) -> None:
        self.entries = []
        self.save()
