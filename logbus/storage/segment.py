"""A log segment: one log file of whole batches plus its offset and time indexes.

Files, in the partition's directory, named by the segment's base offset::

    {base_offset:020d}.log        the batches, back to back
    {base_offset:020d}.index      sparse offset index (see offset_index.py)
    {base_offset:020d}.timeindex  sparse time index (see time_index.py)
    {base_offset:020d}.txnindex   aborted transactions whose ABORT marker is here (txn_index.py;
                                  only once there is one)
    {base_offset:020d}.summary    only for a segment the cleaner wrote (see cleaner.py)

Writes append to the log file with ``pwritev`` at the logical end (header and payload as two
buffers, so the leader's rewritten header costs no payload copy). Each appended batch must
start at the segment's next offset: offsets within a segment are contiguous, except in a
log that compaction has thinned (``cleaner.py``): there a batch may start past the next
offset (``allow_gap``), and the offsets in between are gone (compacted). Offsets always
increase. Reads map the file with ``mmap`` and return memoryviews of whole batches: no
copy. The map is widened lazily when a read reaches bytes appended since it was made. A
read at an offset in a gap starts with the next batch.

A view returned by :meth:`read` stays valid until the segment is truncated,
deleted or closed; callers copy (e.g. into Ray's object store) before any of
those.

Crash contract: the log file is the truth; indexes are derived and rebuilt by
:meth:`recover`, which checks each batch's lengths, CRC and offsets (contiguous,
or only increasing where gaps are allowed), cuts the file at the first bad
batch, and returns the number of bytes cut. The transaction index needs the
log's producer state to be rebuilt: :meth:`recover` empties it and sets
``txn_index_stale``, and the partition log rebuilds it (so it does for a
segment whose transaction index does not load).

Write contract: what is in memory (size, next offset, timestamps, index
entries) is what :meth:`recover` would find in the files. An append writes
the log file, then the index entries it is due, then its transaction index
entry if it is an ABORT marker (each file written before memory changes); if any write fails (a full disk, an I/O error: whatever
OSError), every file is cut back to where the append found it and
StorageError, naming the file, is raised: the batch is not in the segment.
The owner undoes an append whose later steps failed with :meth:`restore`. A
cut that fails too (the disk refuses even that) is left pending: memory
already holds the old state, the extra bytes lie past the logical end, and
:meth:`repair` cuts them before anything else is written to the segment (the
write fails if it still cannot), so a batch is never appended after bytes
that recovery could mistake for one.

Page cache. Appends land in the OS page cache, and a replica's cache would
grow with everything it ever wrote. :meth:`release_page_cache` hands the pages
more than a given number of bytes behind the end back to the kernel (written
back first, never lost), so new appends reuse recently freed memory: taking
never-used memory is slow on virtual machines (the host maps it on first
touch), much slower than copying into pages that were in use moments ago.

This class is not thread-safe.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

from logbus.errors import CorruptRecordError, StorageError
from logbus.invariant import check
from logbus.storage import batch_header as bh
from logbus.storage.offset_index import OffsetIndex
from logbus.storage.time_index import TimeIndex
from logbus.storage.txn_index import AbortedTxn, TxnIndex

logger = logging.getLogger(__name__)

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIME_INDEX_SUFFIX = ".timeindex"
TXN_INDEX_SUFFIX = ".txnindex"
SUMMARY_SUFFIX = ".summary"
RELATIVE_OFFSET_MAX = 2**32 - 1  # index entries store offsets relative to the base as uint32
POSITION_MAX = 2**32 - 1
PAGE_BYTES = mmap.PAGESIZE
CACHE_RELEASE_STEP_BYTES = 8 << 20  # the page cache is advised at most once per this many appended bytes
CACHE_RELEASE_REPEAT_BYTES = 32 << 20  # each advice covers this much before the previous one's end again


def segment_file_name(base_offset: int, suffix: str) -> str:
    return f"{base_offset:020d}{suffix}"


@dataclass(frozen=True, slots=True)
class SegmentRecovery:
    """What :meth:`LogSegment.recover` found."""

    valid_batches: int
    valid_bytes: int
    truncated_bytes: int
    error: str | None  # why the scan stopped early, if it did


@dataclass(frozen=True, slots=True)
class SegmentTail:
    """Where a segment's end stood (:meth:`LogSegment.tail`): what an append changes, to undo it."""

    size_bytes: int
    next_offset: int
    max_timestamp_ms: int
    first_timestamp_ms: int | None
    bytes_since_index_entry: int
    offset_entries: int
    time_entries: int
    txn_entries: int


class LogSegment:
    """One log file plus its indexes. Not thread-safe."""

    def __init__(self, directory: str, base_offset: int, index_interval_bytes: int, *, file_suffix: str = "") -> None:
        """Open (creating if missing) the segment's files; ``file_suffix`` is appended to each file's
        name (the cleaner writes a new segment as ``.cleaned`` files before swapping it in)."""
        self.directory = directory
        self.base_offset = base_offset
        self.index_interval_bytes = index_interval_bytes
        self.log_path = os.path.join(directory, segment_file_name(base_offset, LOG_SUFFIX) + file_suffix)
        self.offset_index = OffsetIndex(os.path.join(directory, segment_file_name(base_offset, INDEX_SUFFIX) + file_suffix))
        self.time_index = TimeIndex(os.path.join(directory, segment_file_name(base_offset, TIME_INDEX_SUFFIX) + file_suffix))
        self.txn_index = TxnIndex(os.path.join(directory, segment_file_name(base_offset, TXN_INDEX_SUFFIX) + file_suffix))
        self.txn_index_stale = False  # emptied by recovery, or did not load: the partition log rebuilds it
        # What the transaction index file held when recovery emptied it, by (producer id, marker offset):
        # the rebuild keeps the entry of each ABORT marker it finds again (see recover()).
        self.txn_entries_before: dict = {}
        self.summary_path = os.path.join(directory, segment_file_name(base_offset, SUMMARY_SUFFIX) + file_suffix)
        try:
            self._fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT, 0o644)
            self.size_bytes = os.fstat(self._fd).st_size
        except OSError as error:
            raise StorageError(f"cannot open segment {self.log_path}: {error}") from error
        self.next_offset = base_offset
        self.max_timestamp_ms = -1
        self.first_timestamp_ms: int | None = None  # of the first batch: drives roll by segment.ms
        self._bytes_since_index_entry = 0
        self._map: mmap.mmap | None = None
        self._mapped_bytes = 0
        # (offset, position) where the last read ended: a reader at the log end asks for exactly
        # that next, and finds its batch without an index lookup and header scan.
        self._read_end: tuple[int, int] | None = None
        self._cache_released_to = 0  # file position below which the page cache has been advised away
        self._cut_pending = False  # the log file may hold bytes past size_bytes (a failed write's, not yet cut)

    # --- opening ---------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, directory: str, base_offset: int, index_interval_bytes: int, allow_gaps: bool = False) -> "LogSegment":
        """Open a segment trusting its indexes if they look consistent (no full scan)."""
        segment = cls(directory, base_offset, index_interval_bytes)
        if not segment._load_indexes():
            segment.recover(allow_gaps=allow_gaps)
        elif not (segment.txn_index.load() and segment.txn_index.consistent_with(base_offset, segment.next_offset)):
            segment.txn_index.truncate_entries(0)
            segment.txn_index_stale = True
        return segment

    def _load_indexes(self) -> bool:
        if self.size_bytes == 0:
            self.offset_index.reset()
            self.time_index.reset()
            return True
        if not (self.offset_index.load() and self.time_index.load()):
            return False
        if not self.offset_index.consistent_with(self.size_bytes) or self.size_bytes % 8:
            return False
        # The last batch gives next_offset; the first batch gives first_timestamp_ms. Scan
        # forward from the last index entry to reach the end.
        try:
            view = self._view()
            first = bh.read_header(view, 0)
            self.first_timestamp_ms = first.first_timestamp_ms
            start = self.offset_index.lookup(RELATIVE_OFFSET_MAX)
            last = None
            for _, last in bh.iter_headers(view, start, self.size_bytes):
                pass
        except CorruptRecordError:
            return False
        if last is None:
            return False
        # The bytes since the last offset-index entry, as appends and recovery count them: the next
        # entry then goes where either would put it (this segment may be, or become, the active one).
        self._bytes_since_index_entry = self.size_bytes - start
        if len(self.time_index) and self.time_index.entry(len(self.time_index) - 1)[1] >= last.next_offset - self.base_offset:
            return False  # entries past the log's end: left by a cut that failed (see offset_index.py)
        self.next_offset = last.next_offset
        self.max_timestamp_ms = max(self.time_index.last_key or -1, last.max_timestamp_ms)
        return True

    def recover(self, expected_base_offset: int | None = None, allow_gaps: bool = False) -> SegmentRecovery:
        """Scan every batch, rebuild both indexes, and cut the file at the first bad batch.

        A batch is bad if its header or lengths are impossible, its CRC does not
        match, or its base offset does not continue the previous batch (the
        first batch must start at ``expected_base_offset`` when given, else at
        the segment's base offset). With ``allow_gaps`` (a compacted log), a
        batch may start anywhere past the previous one's end (and the first
        anywhere at or past the segment's base and ``expected_base_offset``).
        """
        self.offset_index.reset()
        self.time_index.reset()
        # An entry was written as its ABORT marker was appended, with the transaction's first offset
        # and the last stable offset then. Either may lie in a segment deleted since (retention,
        # delete_records), which the producer state rebuilt from the segments left cannot know: the
        # rebuild keeps the entries of the markers it finds again, so it gives what memory held.
        loaded = self.txn_index.load()
        self.txn_entries_before = {(e.producer_id, e.last_offset): e for e in self.txn_index.entries()} if loaded else {}
        self.txn_index.reset()
        self.txn_index_stale = True
        self.next_offset = self.base_offset
        self.max_timestamp_ms = -1
        self.first_timestamp_ms = None
        self._bytes_since_index_entry = 0
        view = self._view()
        position = 0
        valid_batches = 0
        error = None
        expected = self.base_offset if expected_base_offset is None else expected_base_offset
        if allow_gaps:
            expected = max(expected, self.base_offset)
        while position < self.size_bytes:
            try:
                header = bh.validate_batch(view, position)
            except CorruptRecordError as corrupt:
                error = str(corrupt)
                break
            if header.base_offset != expected and not (allow_gaps and header.base_offset > expected):
                error = f"batch at position {position} has offset {header.base_offset}, expected {expected}"
                break
            if header.last_offset - self.base_offset > RELATIVE_OFFSET_MAX:
                error = f"batch at position {position} overflows the segment's relative offsets"
                break
            self._index_batch(header, position)
            expected = header.next_offset
            position += header.size_bytes
            valid_batches += 1
        del view
        truncated = self.size_bytes - position
        if truncated:
            self._truncate_file(position)
        return SegmentRecovery(valid_batches, position, truncated, error)

    # --- writing ------------------------------------------------------------------------------

    def _index_batch(self, header: bh.BatchHeader, position: int) -> None:
        """Account for a batch now at ``position``: indexes, next offset, timestamps."""
        relative = header.base_offset - self.base_offset
        if self.first_timestamp_ms is None:
            self.first_timestamp_ms = header.first_timestamp_ms
        self.max_timestamp_ms = max(self.max_timestamp_ms, header.max_timestamp_ms)
        if position == 0 or self._bytes_since_index_entry >= self.index_interval_bytes:
            self.offset_index.add(relative, position)
            self.time_index.maybe_add(self.max_timestamp_ms, relative)
            self._bytes_since_index_entry = 0
        self._bytes_since_index_entry += header.size_bytes
        self.next_offset = header.next_offset

    def can_hold(self, header: bh.BatchHeader) -> bool:
        """Whether the batch fits this segment's relative offsets and uint32 positions."""
        return (
            header.last_offset - self.base_offset <= RELATIVE_OFFSET_MAX
            and self.size_bytes + header.size_bytes <= POSITION_MAX
        )

    def append(self, header: bh.BatchHeader, parts: list, allow_gap: bool = False, aborted: AbortedTxn | None = None) -> int:
        """Append one batch given as buffers (e.g. rewritten header and payload); return its position.

        ``aborted``: the batch is an ABORT marker, and this is its transaction index entry.

        The batch must continue the segment: its base offset is the segment's
        next offset, or with ``allow_gap`` (a compacted log) any offset past it
        (InvariantViolationError otherwise, before anything is written: the
        partition log assigns or checks offsets first, so its state is wrong).
        All or nothing: on an I/O error (log file or index) every file is cut
        back to where it was and StorageError is raised (see the module docstring).
        """
        # Written anyway, a gap or an overlap would be served to readers, and the next recovery
        # (which requires contiguous offsets) would cut the log there.
        check(
            header.base_offset == self.next_offset or (allow_gap and header.base_offset > self.next_offset),
            f"batch at offset {header.base_offset} does not continue segment {self.log_path} at offset {self.next_offset}",
        )
        self.repair()
        tail = self.tail()
        position = self.size_bytes
        size = header.size_bytes
        try:
            try:
                written = os.pwritev(self._fd, parts, position)
                if written != size:  # a short write (the disk filling up): finish it, or fail
                    data = b"".join(bytes(p) for p in parts)
                    while written < size:
                        written += os.pwrite(self._fd, data[written:], position + written)
            except OSError as error:
                raise StorageError(f"append to {self.log_path} failed: {error}") from error
            self.size_bytes = position + size
            self._index_batch(header, position)  # StorageError naming the index that failed
            if aborted is not None:
                self.txn_index.append(aborted)
        except StorageError:
            self.restore(tail)
            raise
        return position

    def tail(self) -> SegmentTail:
        """Where the segment ends now, for :meth:`restore`."""
        return SegmentTail(
            self.size_bytes, self.next_offset, self.max_timestamp_ms, self.first_timestamp_ms,
            self._bytes_since_index_entry, len(self.offset_index), len(self.time_index), len(self.txn_index),
        )

    def restore(self, tail: SegmentTail) -> None:
        """Undo the appends made since ``tail``: memory at once, the files now or (if a cut fails)
        before the next write (see the module docstring). Never raises."""
        self.size_bytes = tail.size_bytes
        self.next_offset = tail.next_offset
        self.max_timestamp_ms = tail.max_timestamp_ms
        self.first_timestamp_ms = tail.first_timestamp_ms
        self._bytes_since_index_entry = tail.bytes_since_index_entry
        self._read_end = None
        self.offset_index.truncate_entries(tail.offset_entries)
        self.time_index.truncate_entries(tail.time_entries)
        self.txn_index.truncate_entries(tail.txn_entries)
        self._cut_pending = True
        try:
            self.repair()
        except StorageError as error:
            logger.warning("%s; cut before the next write", error)

    def repair(self) -> None:
        """Make the cuts a failed write left pending (log file and indexes); StorageError if one fails again."""
        if self._cut_pending:
            try:
                os.ftruncate(self._fd, self.size_bytes)
            except OSError as error:
                raise StorageError(f"cutting {self.log_path} back to {self.size_bytes} bytes failed: {error}") from error
            self._cut_pending = False
        self.offset_index.repair()
        self.time_index.repair()
        self.txn_index.repair()

    def release_page_cache(self, keep_bytes: int) -> None:
        """Advise the kernel to drop the log file's cached pages more than ``keep_bytes`` before its end.

        ``POSIX_FADV_DONTNEED`` starts the writeback of dirty pages and drops
        clean ones; it never loses data, and pages a reader has mapped stay.
        Pages still being written back when advised are dropped by a later
        advice: each one covers again the last CACHE_RELEASE_REPEAT_BYTES
        before the previous one's end. Advice is given at most once per
        CACHE_RELEASE_STEP_BYTES of appends. A negative ``keep_bytes`` keeps
        every page. Only the page cache changes: reads of dropped pages come
        from disk.
        """
        if keep_bytes < 0:
            return
        end = (self.size_bytes - keep_bytes) // PAGE_BYTES * PAGE_BYTES
        if end - self._cache_released_to < CACHE_RELEASE_STEP_BYTES:
            return
        start = max(0, self._cache_released_to - CACHE_RELEASE_REPEAT_BYTES)
        try:
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: the pages stay cached
        self._cache_released_to = end

    def flush(self, indexes: bool = True) -> None:
        """Force the log (and its indexes, unless ``indexes`` is False) to disk; StorageError naming
        the file that failed (nothing else changes: the bytes stay written)."""
        self.repair()
        try:
            os.fdatasync(self._fd)
        except OSError as error:
            raise StorageError(f"fsync of {self.log_path} failed: {error}") from error
        if indexes:
            self.offset_index.flush()
            self.time_index.flush()
            self.txn_index.flush()

    # --- reading -------------------------------------------------------------------------------

    def _view(self) -> memoryview:
        """A view of the whole file as mapped now (widened if the file grew)."""
        if self.size_bytes == 0:
            return memoryview(b"")
        if self._mapped_bytes != self.size_bytes:
            # A map that views still point into cannot be closed; dropping our reference
            # lets it go once the last view is released.
            self._map = mmap.mmap(self._fd, self.size_bytes, access=mmap.ACCESS_READ)
            self._mapped_bytes = self.size_bytes
        return memoryview(self._map)

    def find_batch(self, offset: int) -> tuple[int, bh.BatchHeader] | None:
        """(position, header) of the batch holding ``offset`` (or, for an offset in a gap, of the next
        batch), or None if it lies past this segment."""
        if offset >= self.next_offset:
            return None
        view = self._view()
        hint = self._read_end
        if hint is not None and hint[0] == offset and hint[1] < self.size_bytes:
            return hint[1], bh.read_header(view, hint[1])
        start = self.offset_index.lookup(max(0, offset - self.base_offset))
        for position, header in bh.iter_headers(view, start, self.size_bytes):
            if header.last_offset >= offset:
                return position, header
        return None

    def read(
        self, offset: int, max_bytes: int, max_offset: int | None = None, verify_crc: bool = True
    ) -> tuple[memoryview, int, int] | None:
        """Whole batches from the one holding ``offset`` (or the next one, for an offset in a gap):
        (view, first batch's base offset, next offset).

        Takes batches while their total stays within ``max_bytes`` (the first is
        always taken, so a large batch still makes progress) and while each
        batch ends below ``max_offset`` (the high watermark). With
        ``verify_crc`` every returned batch has passed its CRC check (readers
        that check it themselves pass False). Returns None if nothing qualifies.
        """
        found = self.find_batch(offset)
        if found is None:
            return None
        start, first = found
        if max_offset is not None and first.next_offset > max_offset:
            return None
        view = self._view()
        end = start
        next_offset = first.base_offset
        for position, header in bh.iter_headers(view, start, self.size_bytes):
            if position > start and (position + header.size_bytes - start > max_bytes):
                break
            if max_offset is not None and header.next_offset > max_offset:
                break
            if verify_crc:
                bh.validate_batch(view, position)
            end = position + header.size_bytes
            next_offset = header.next_offset
        self._read_end = (next_offset, end)
        return view[start:end], first.base_offset, next_offset

    def offset_for_timestamp(self, timestamp_ms: int, min_offset: int = 0) -> int | None:
        """The first offset at or after ``min_offset`` in this segment whose record timestamp is
        >= ``timestamp_ms``, or None."""
        if self.max_timestamp_ms < timestamp_ms:
            return None
        relative = self.time_index.first_offset_reaching(timestamp_ms)
        start = 0 if relative is None else self.offset_index.lookup(relative)
        view = self._view()
        for position, header in bh.iter_headers(view, start, self.size_bytes):
            if header.max_timestamp_ms >= timestamp_ms and header.last_offset >= min_offset:
                skip = max(0, min_offset - header.base_offset)  # records below the log start
                if header.timestamp_type == bh.TIMESTAMP_LOG_APPEND_TIME:
                    return header.base_offset + skip  # every record of the batch carries its append time
                from logbus.storage.record_batch import decode_records  # noqa: PLC0415 (Arrow only when asked)

                _, records = decode_records(view, position)
                reaching = records.column(2).to_numpy()[skip:] >= timestamp_ms
                if reaching.any():
                    return header.base_offset + skip + int(np.argmax(reaching))
        return None

    # --- truncation and lifetime ---------------------------------------------------------------

    def truncate_to(self, offset: int) -> int:
        """Remove every batch whose last offset is >= ``offset``; return the bytes removed.

        A batch is removed whole, so the new end can lie below ``offset`` when
        ``offset`` falls inside a batch.
        """
        found = self.find_batch(offset)
        if found is None:
            return 0
        position, header = found
        removed = self.size_bytes - position
        self._truncate_file(position)  # StorageError: nothing changed
        self._cut_pending = False
        self.offset_index.truncate_from_position(position)  # memory now; a file that cannot be cut, before the next write
        self.time_index.truncate_from_offset(header.base_offset - self.base_offset)
        self.txn_index.truncate_from_offset(header.base_offset)
        self._reload_tail_state()
        return removed

    def reactivate(self) -> None:
        """Make a closed segment the active one again (a truncation deleted the segments after it).

        A closed segment is opened without counting the bytes written since its last offset-index
        entry; appends to it need that count to place the next entry where recovery would.
        """
        self._reload_tail_state()

    def _reload_tail_state(self) -> None:
        """Recompute next offset and timestamps after a truncation, scanning from the last index entry."""
        self.next_offset = self.base_offset
        self.max_timestamp_ms = self.time_index.last_key if self.time_index.last_key is not None else -1
        self.first_timestamp_ms = None
        self._bytes_since_index_entry = 0
        if self.size_bytes == 0:
            return
        view = self._view()
        self.first_timestamp_ms = bh.read_header(view, 0).first_timestamp_ms
        start = self.offset_index.lookup(RELATIVE_OFFSET_MAX)
        for position, header in bh.iter_headers(view, start, self.size_bytes):
            self.next_offset = header.next_offset
            self.max_timestamp_ms = max(self.max_timestamp_ms, header.max_timestamp_ms)
            self._bytes_since_index_entry = position + header.size_bytes - start

    def _truncate_file(self, size_bytes: int) -> None:
        self._map = None
        self._mapped_bytes = 0
        self._read_end = None
        self._cache_released_to = min(self._cache_released_to, size_bytes // PAGE_BYTES * PAGE_BYTES)
        try:
            os.ftruncate(self._fd, size_bytes)
        except OSError as error:
            raise StorageError(f"truncate of {self.log_path} failed: {error}") from error
        self.size_bytes = size_bytes

    @property
    def is_empty(self) -> bool:
        return self.size_bytes == 0

    def close(self) -> None:
        """Close the files (making pending cuts first, where the disk allows)."""
        if self._fd >= 0:
            try:
                self.repair()
            except StorageError as error:
                # Closing anyway: the next open scans the bytes past the end, and keeps them only
                # if they are whole batches (written, but never acknowledged).
                logger.warning("%s; closing anyway", error)
        self._close_files()

    def _close_files(self) -> None:
        self._map = None
        self._mapped_bytes = 0
        self._read_end = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass  # every write was made (or undone) before
        self.offset_index.close()
        self.time_index.close()
        self.txn_index.close()

    def delete(self) -> None:
        """Remove the segment's files; the log file first, as its removal is what removes the segment
        (open lists segments by their log files). StorageError if that fails: the segment is then
        intact and stays open. Files that outlive it (an index, a summary) are ignored on open and
        replaced before a new segment at the same base offset uses them."""
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise StorageError(f"deleting {self.log_path} failed: {error}") from error
        self._close_files()
        for remove in (lambda: os.unlink(self.summary_path), self.offset_index.delete, self.time_index.delete, self.txn_index.delete):
            try:
                remove()
            except FileNotFoundError:
                pass
            except OSError as error:
                logger.warning("segment %s is gone, but a file of it stays: %s", self.log_path, error)
