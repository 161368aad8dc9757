"""Log compaction: the cleaner keeps the latest record of each key in a log's closed segments.

For topics whose ``cleanup.policy`` includes ``compact`` (see log_config.py).
What it keeps, and what it never changes:

- Offsets never change. A batch stores no per-record offsets (record ``i``
  has ``base_offset + i``), so the cleaner writes each run of consecutive
  surviving records of a batch as a batch of its own: every batch stays
  dense, and the offsets between two batches that hold no record are the
  compacted ones (gaps). Readers at an offset in a gap get the next batch;
  a fetch reply says which offsets it covers (see ``PartitionLog.read``).
- It cleans the closed segments below the high watermark (the caller's
  ``upper_bound``) and below the first unstable offset (the first offset of
  the oldest ongoing transaction: nothing at or above the LSO is cleaned or
  read for the offset map), outside ``min.compaction.lag.ms``: never the
  active segment, never records a follower may still have to truncate, so
  every replica compacts the same committed prefix, each its own copy.
- A record survives when it is the latest record of its key among the
  offsets cleaned, or newer than them. Records without a key are dropped
  (Kafka's rule; a compacted topic refuses them on produce). A tombstone
  (value None) survives until ``delete.retention.ms`` after its timestamp.
- Transactions. Below the LSO every transaction has ended, so each one is
  committed or aborted. The batches of aborted transactions (the log's
  aborted-transaction index names them: a producer's transactional batches
  from the transaction's first offset to its ABORT marker) are removed
  whole, and their keys never enter the offset map (an aborted record must
  not make a committed one obsolete). A committed transaction's records are
  compacted as any. A marker (control batch) is never compacted by key: it
  stays while any record of its transaction is left, and from the first
  cleaning that leaves none, for ``delete.retention.ms`` more (Kafka's
  rule, which measures from the cleaning that found the data gone); the
  cleaned segment's summary keeps that time per marker, and the marker goes
  at the first cleaning after it (due as a kept tombstone is). A cleaned segment holds no aborted data, so its transaction
  index is empty: its markers' entries would name nothing left to skip.
- ``min.cleanable.dirty.ratio``: a cleaning rewrites every cleanable
  segment, so it runs only once the bytes written since the last one
  ("dirty", from the log's cleaner checkpoint on) are that share of the
  cleanable bytes, or once a tombstone kept by the last one is due to go.

The work, Kafka's way. :meth:`PartitionLog.cleaning_plan` (on the log's
owner) snapshots what to clean. :func:`build_offset_map` reads the dirty
segments and maps each key to its latest offset; :func:`clean_group` writes
one group of consecutive segments (at most ``segment.bytes`` together) as one
new segment with its files named ``*.cleaned``, then syncs them. Both read
the segment files through their own file handles and touch no object of the
log, so they run in a thread while the log goes on serving appends and
reads. :meth:`PartitionLog.replace_segments` (on the owner again) checks
that the group's segments are still the ones planned and swaps the new one
in (:func:`commit_swap`).

Producer state. After compaction a producer's batches may be gone or split,
and the idempotence table is rebuilt from batch headers on open
(producer_state.py). Kafka keeps each producer's last batch as an empty
batch; a logbus batch holds at least one record, so instead each cleaned
segment keeps, in its ``.summary`` file, the producer table entries that its
original segments' headers gave (at most 5 batches per producer, with each
producer's ongoing transaction, :meth:`ProducerStateTable.entries`);
rebuilding reads those instead of the cleaned segment's headers. A surviving
run of an idempotent batch keeps the batch's producer id and epoch, its
transactional attribute, and the sequence number of its first record.

Crash safety: a swap is atomic. A cleaned segment at base offset ``B``
replaces the original segments with base offsets in ``[B, end)`` (``end``,
the base offset of the segment after them, is in the summary):

1. its files are written as ``B.log.cleaned``, ``B.index.cleaned``,
   ``B.timeindex.cleaned``, ``B.txnindex.cleaned`` (empty) and
   ``B.summary.cleaned``, and synced;
2. each is renamed to ``*.swap``, ``B.log.swap`` last, and the directory is
   synced: the rename of ``B.log.cleaned`` commits the swap;
3. the original segments other than ``B`` are deleted, the ``.swap`` files
   are renamed to their final names (the log file last, replacing the old
   ``B.log``), and the directory is synced.

On open, :func:`complete_swaps` runs before the segments are read: it deletes
every ``.cleaned`` file and every ``.swap`` file of an uncommitted swap (no
``B.log.swap``), and completes every committed one (step 3 again: every step
may be repeated). So recovery leaves the old segments or the new one, never a
mix.

Nothing here imports Ray; the functions that run in a thread share nothing
with the log but the files they read.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:  # Arrow is imported where a cleaning decodes batches, in its thread
    import pyarrow as pa

from logbus.errors import CorruptRecordError, StorageError
from logbus.invariant import check
from logbus.storage import batch_header as bh
from logbus.storage.files import write_atomically
from logbus.storage.producer_state import NO_TRANSACTION, BatchEntry, ProducerStateTable
from logbus.storage.segment import (
    INDEX_SUFFIX,
    LOG_SUFFIX,
    RELATIVE_OFFSET_MAX,
    SUMMARY_SUFFIX,
    TIME_INDEX_SUFFIX,
    TXN_INDEX_SUFFIX,
    LogSegment,
    segment_file_name,
)

logger = logging.getLogger(__name__)

CLEANED_SUFFIX = ".cleaned"  # a cleaned segment's files while they are written
SWAP_SUFFIX = ".swap"  # ... once the swap is committed, until they take their final names
SUMMARY_VERSION = 2  # 2: producer entries with their ongoing transaction, and the markers' times
# A swap renames these in this order; the log file last (its rename commits, or finishes, the swap).
SWAP_ORDER = (SUMMARY_SUFFIX, INDEX_SUFFIX, TIME_INDEX_SUFFIX, TXN_INDEX_SUFFIX, LOG_SUFFIX)
SEGMENT_SUFFIXES = (LOG_SUFFIX, INDEX_SUFFIX, TIME_INDEX_SUFFIX, TXN_INDEX_SUFFIX, SUMMARY_SUFFIX)


# --- the summary of a cleaned segment -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentSummary:
    """What a cleaned segment replaced: the offsets up to ``end_offset`` and its producers' state.

    The summary stands for the segment's batches below ``end_offset``; a
    batch at or past it was appended after a truncation into the segment
    (which lowers ``end_offset`` to the new log end), and counts by its header.
    """

    end_offset: int  # the base offset of the segment after the ones it replaced
    producers: tuple[BatchEntry, ...]
    # (offset, ms) of each marker kept whose transaction's batches were all gone at the cleaning that
    # wrote this summary: the time of the first cleaning that found them gone.
    markers: tuple[tuple[int, int], ...] = ()


def _summary_text(summary: SegmentSummary) -> str:
    return json.dumps({
        "version": SUMMARY_VERSION, "end_offset": summary.end_offset, "producers": [list(e) for e in summary.producers],
        "markers": [list(m) for m in summary.markers],
    })


def write_summary(path: str, summary: SegmentSummary) -> None:
    """Write and sync a new summary file (the swap's renames make it visible); StorageError naming it on failure."""
    try:
        with open(path, "w") as file:
            file.write(_summary_text(summary))
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        raise StorageError(f"writing segment summary {path} failed: {error}") from error


def replace_summary(path: str, summary: SegmentSummary) -> None:
    """Replace the summary of a segment in the log, atomically (after a truncation into it);
    StorageError naming it on failure (then the file holds the old summary or the new one)."""
    try:
        write_atomically(path, _summary_text(summary))
    except OSError as error:
        raise StorageError(f"writing segment summary {path} failed: {error}") from error


def read_summary(path: str) -> SegmentSummary | None:
    """The summary at ``path``, or None if there is none; CorruptRecordError if it is unreadable."""
    try:
        with open(path) as file:
            raw = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CorruptRecordError(f"segment summary {path} is unreadable: {error}") from None
    try:
        version = raw["version"]
        if version not in (1, SUMMARY_VERSION):
            raise ValueError(f"unknown version {version}")
        producers = tuple(tuple(int(v) for v in entry) for entry in raw["producers"])
        if version == 1:  # written before transactions: no producer had one ongoing
            producers = tuple(entry + (NO_TRANSACTION,) for entry in producers)
        if any(len(entry) != 7 for entry in producers):
            raise ValueError("a producer entry has the wrong length")
        markers = tuple((int(offset), int(ms)) for offset, ms in raw.get("markers", ()))
        return SegmentSummary(int(raw["end_offset"]), producers, markers)
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptRecordError(f"segment summary {path} is malformed: {error}") from None


# --- what to clean --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceSegment:
    """One closed segment as planned: where its bytes are, and what it covers.

    ``segment`` is the log's own object, compared (by identity) when the
    cleaned result is swapped in; the cleaning thread reads only ``log_path``.
    """

    segment: LogSegment
    base_offset: int
    end_offset: int  # the next segment's base offset
    log_path: str
    size_bytes: int
    summary_path: str | None  # when the segment is itself a cleaned one


@dataclass(frozen=True, slots=True)
class CleaningPlan:
    """One cleaning of one log (built by ``PartitionLog.cleaning_plan``)."""

    directory: str
    groups: tuple[tuple[SourceSegment, ...], ...]  # each becomes one cleaned segment
    dirty: tuple[SourceSegment, ...]  # the segments written since the last cleaning: the offset map's source
    log_start_offset: int  # records below it are gone already (delete_records)
    now_ms: int
    delete_retention_ms: int
    index_interval_bytes: int
    # The aborted transactions overlapping the cleaned offsets: (producer id, first offset, offset of
    # its ABORT marker), by first offset.
    aborted: tuple[tuple[int, int, int], ...] = ()
    # Set by the log's owner to stop a cleaning under way (the log is going away): the thread
    # checks it between batches.
    stop: threading.Event = field(default_factory=threading.Event, compare=False)
    # Producers with a transactional record kept since their last marker, as the groups are cleaned
    # in order (one thread): a marker stays while its transaction has records.
    txn_records_kept: set = field(default_factory=set, compare=False)
    # ``aborted`` by producer: producer id -> ([first offsets], [marker offsets]) (a producer's
    # transactions do not overlap), built on first use.
    _aborted_ranges: dict = field(default_factory=dict, compare=False)

    def is_aborted(self, header: bh.BatchHeader) -> bool:
        """Whether a transactional data batch belongs to an aborted transaction."""
        if not header.is_transactional or header.is_control or not self.aborted:
            return False
        ranges = self._aborted_ranges
        if not ranges:
            for producer_id, first, last in sorted(self.aborted, key=lambda entry: entry[1]):
                firsts, lasts = ranges.setdefault(producer_id, ([], []))
                firsts.append(first)
                lasts.append(last)
        found = ranges.get(header.producer_id)
        if found is None:
            return False
        i = bisect.bisect_right(found[0], header.base_offset) - 1
        return i >= 0 and header.base_offset <= found[1][i]

    @property
    def end_offset(self) -> int:
        """The first offset past the cleaned segments."""
        return self.groups[-1][-1].end_offset


@dataclass(slots=True)
class CleanedSegment:
    """A group's cleaned segment, written and synced as ``.cleaned`` files, ready to swap in."""

    directory: str
    base_offset: int
    end_offset: int
    sources: tuple[SourceSegment, ...]
    records_kept: int = 0
    records_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    tombstones_due_ms: int | None = None  # when the earliest tombstone kept may go
    changed: bool = True  # False: the result holds what its one source held (no swap needed)
    state: str = field(default="written")  # written -> committed | discarded

    def path(self, suffix: str, stage: str = CLEANED_SUFFIX) -> str:
        return os.path.join(self.directory, segment_file_name(self.base_offset, suffix) + stage)


def group_segments(sources: list[SourceSegment], max_bytes: int) -> tuple[tuple[SourceSegment, ...], ...]:
    """Consecutive segments in groups of at most ``max_bytes`` together (before cleaning, so after it
    too) whose offsets fit one segment's relative offsets (Kafka's groupSegmentsBySize)."""
    groups: list[list[SourceSegment]] = []
    for source in sources:
        group = groups[-1] if groups else None
        if (
            group is not None
            and sum(s.size_bytes for s in group) + source.size_bytes <= max_bytes
            and source.end_offset - 1 - group[0].base_offset <= RELATIVE_OFFSET_MAX
        ):
            group.append(source)
        else:
            groups.append([source])
    return tuple(tuple(group) for group in groups)


# --- reading segment files from a thread ---------------------------------------------------------------


def _batches(plan: CleaningPlan, source: SourceSegment) -> Iterator[tuple[bh.BatchHeader, bytes]]:
    """Every batch of a source segment as (header, its bytes), read through a file handle of our own.

    No map: the log's owner may truncate or delete the file meanwhile, and a
    read past a mapped file's end would crash the process. A file that
    changed under us shows as a short read: StorageError (the plan is stale).
    """
    try:
        file = open(source.log_path, "rb", buffering=1 << 20)
    except FileNotFoundError:
        raise StorageError(f"segment {source.log_path} went away during cleaning") from None
    with file:
        position = 0
        while position < source.size_bytes:
            if plan.stop.is_set():
                raise StorageError(f"the cleaning of {plan.directory} was stopped")
            head = file.read(bh.HEADER_SIZE)
            if len(head) < bh.HEADER_SIZE:
                raise StorageError(f"segment {source.log_path} shrank during cleaning")
            size = bh.unpack_header(head).size_bytes
            if size < bh.HEADER_SIZE or position + size > source.size_bytes:
                raise CorruptRecordError(f"segment {source.log_path}: impossible batch length at position {position}")
            rest = file.read(size - bh.HEADER_SIZE)
            if len(rest) != size - bh.HEADER_SIZE:
                raise StorageError(f"segment {source.log_path} shrank during cleaning")
            data = head + rest
            header = bh.read_header(data)  # the checks of a header read from a segment
            yield header, data
            position += size


def build_offset_map(plan: CleaningPlan) -> dict[bytes, int]:
    """Each key written in the plan's dirty segments -> the offset of its latest record there.

    Keys in memory: the map's size is that of the distinct keys of the dirty
    segments (Kafka bounds it with a dedupe buffer and cleans in parts; see
    docs/design.md).
    """
    from logbus.storage.record_batch import decode_records  # noqa: PLC0415 (Arrow, only in a cleaning's thread)

    offsets: dict[bytes, int] = {}
    for source in plan.dirty:
        for header, data in _batches(plan, source):
            if header.is_control or plan.is_aborted(header):
                continue  # markers are never compacted by key; aborted records make nothing obsolete
            _, records = decode_records(data)
            keys = records.column(0)
            base = header.base_offset
            if keys.null_count == 0:
                offsets.update(zip(keys.to_pylist(), range(base, base + header.record_count)))
            else:
                offsets.update((key, base + i) for i, key in enumerate(keys.to_pylist()) if key is not None)
    return offsets


# --- cleaning one group -----------------------------------------------------------------------------


def _keep(plan: CleaningPlan, offset_map: dict[bytes, int], header: bh.BatchHeader, records: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(which records of a batch survive, which of those are tombstones)."""
    count = header.record_count
    base = header.base_offset
    keys = records.column(0).to_pylist()
    keep = np.fromiter(
        (key is not None and offset_map.get(key, -1) <= offset for key, offset in zip(keys, range(base, base + count))),
        dtype=bool,
        count=count,
    )
    if base < plan.log_start_offset:
        keep[: plan.log_start_offset - base] = False
    values = records.column(1)
    tombstones = np.zeros(count, dtype=bool)
    if values.null_count:
        tombstones = values.is_null().to_numpy(zero_copy_only=False) & keep
        if header.timestamp_type == bh.TIMESTAMP_LOG_APPEND_TIME:
            timestamps = np.full(count, header.max_timestamp_ms, dtype=np.int64)
        else:
            timestamps = records.column(2).to_numpy()
        expired = tombstones & (plan.now_ms - timestamps > plan.delete_retention_ms)
        keep &= ~expired
        tombstones &= ~expired
    return keep, tombstones


def _runs(kept: np.ndarray) -> list[tuple[int, int]]:
    """(first row, row count) of each run of consecutive kept rows."""
    rows = np.flatnonzero(kept)
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [rows.size]))
    return [(int(rows[s]), int(e - s)) for s, e in zip(starts, ends)]


def _frame_run(header: bh.BatchHeader, records: pa.RecordBatch, first: int, count: int) -> bytes:
    """Rows ``[first, first + count)`` of a batch as a batch of their own, at their own offsets.

    It keeps the batch's leader epoch, compression, timestamp type and
    producer, and the sequence number of its first record; a LogAppendTime
    batch keeps its append time.
    """
    from logbus.storage.record_batch import frame_record_batch  # noqa: PLC0415 (Arrow, only in a cleaning's thread)

    appended = header.timestamp_type == bh.TIMESTAMP_LOG_APPEND_TIME
    # A slice: frame_record_batch copies a sliced headers column so the run carries only its own rows.
    rows = records.slice(first, count)
    return frame_record_batch(
        rows,
        base_offset=header.base_offset + first,
        leader_epoch=header.leader_epoch,
        compression=header.compression,
        producer_id=header.producer_id,
        producer_epoch=header.producer_epoch,
        base_sequence=bh.NO_SEQUENCE if header.base_sequence == bh.NO_SEQUENCE else header.base_sequence + first,
        timestamp_type=header.timestamp_type,
        timestamp_range=(header.max_timestamp_ms, header.max_timestamp_ms) if appended else None,
        transactional=header.is_transactional,
    )


def _remove(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def clean_group(plan: CleaningPlan, group: tuple[SourceSegment, ...], offset_map: dict[bytes, int]) -> CleanedSegment:
    """Write the cleaned segment of one group as synced ``.cleaned`` files (see the module docstring).

    Runs in a thread: it reads the group's files and writes new ones, and
    touches nothing the log's owner uses. Raises StorageError or
    CorruptRecordError (nothing is left behind) when a file changed or is damaged.
    """
    from logbus.storage.record_batch import decode_records  # noqa: PLC0415 (Arrow, only in a cleaning's thread)

    cleaned = CleanedSegment(plan.directory, group[0].base_offset, group[-1].end_offset, group)
    try:
        _remove(cleaned.path(suffix) for suffix in SEGMENT_SUFFIXES)  # leftovers of an attempt that failed
    except OSError as error:
        raise StorageError(f"removing the files of an earlier cleaning, {cleaned.path(LOG_SUFFIX)} and its indexes, failed: {error}") from error
    out = LogSegment(plan.directory, cleaned.base_offset, plan.index_interval_bytes, file_suffix=CLEANED_SUFFIX)
    producers = ProducerStateTable()
    markers_before: dict[int, int] = {}  # the sources' markers found without their batches, and since when
    markers: list[tuple[int, int]] = []  # the kept ones of those
    try:
        for source in group:
            summary = read_summary(source.summary_path) if source.summary_path else None
            if summary is not None:
                for entry in summary.producers:
                    producers.apply(entry)
                markers_before.update(summary.markers)
            for header, data in _batches(plan, source):
                if summary is None or header.base_offset >= summary.end_offset:
                    producers.update(header)
                _, records = decode_records(data)  # checks the CRC: a damaged batch stops the cleaning
                cleaned.bytes_before += header.size_bytes
                if header.is_transactional:
                    if header.is_control:
                        keep, tombstones = _keep_marker(plan, header, markers_before, markers, cleaned)
                    elif plan.is_aborted(header):
                        keep = tombstones = np.zeros(header.record_count, dtype=bool)
                    else:
                        keep, tombstones = _keep(plan, offset_map, header, records)
                        if keep.any():
                            plan.txn_records_kept.add(header.producer_id)
                else:
                    keep, tombstones = _keep(plan, offset_map, header, records)
                kept = int(keep.sum())
                cleaned.records_kept += kept
                cleaned.records_removed += header.record_count - kept
                if tombstones.any():
                    if header.timestamp_type == bh.TIMESTAMP_LOG_APPEND_TIME:
                        oldest = header.max_timestamp_ms
                    else:
                        oldest = int(records.column(2).to_numpy()[tombstones].min())
                    due = oldest + plan.delete_retention_ms + 1
                    cleaned.tombstones_due_ms = due if cleaned.tombstones_due_ms is None else min(cleaned.tombstones_due_ms, due)
                if kept == header.record_count:
                    parts = [(header, data)]  # the batch as it was
                else:
                    parts = []
                    for first, count in _runs(keep):
                        framed = _frame_run(header, records, first, count)
                        parts.append((bh.read_header(framed), framed))
                for part_header, framed in parts:
                    check(out.can_hold(part_header), f"cleaned segment {out.log_path} cannot hold the batch at offset {part_header.base_offset}")
                    out.append(part_header, [framed], allow_gap=True)
                    cleaned.bytes_after += part_header.size_bytes
        for index in (out.offset_index, out.time_index, out.txn_index):
            try:
                open(index.path, "ab").close()  # an emptied segment has no entries, but has its files
            except OSError as error:
                raise StorageError(f"creating index {index.path} failed: {error}") from error
        out.flush()
        out.close()
        write_summary(cleaned.path(SUMMARY_SUFFIX), SegmentSummary(cleaned.end_offset, tuple(producers.entries()), tuple(markers)))
    except BaseException:
        out.close()
        discard(cleaned)
        raise
    # A marker's time must reach the summary even when nothing else changed.
    cleaned.changed = cleaned.records_removed > 0 or len(group) > 1 or dict(markers) != markers_before
    return cleaned


def _keep_marker(
    plan: CleaningPlan, header: bh.BatchHeader, before: dict[int, int], markers: list, cleaned: CleanedSegment
) -> tuple[np.ndarray, np.ndarray]:
    """Whether a marker stays (see the module docstring): while records of its transaction are left,
    and for delete.retention.ms after the first cleaning that left none."""
    offset = header.base_offset
    has_records = header.producer_id in plan.txn_records_kept
    plan.txn_records_kept.discard(header.producer_id)
    keep = np.ones(1, dtype=bool)
    if offset < plan.log_start_offset:
        keep[0] = False
    elif not has_records:
        since_ms = before.get(offset, plan.now_ms)
        if plan.now_ms - since_ms > plan.delete_retention_ms:
            keep[0] = False
        else:
            markers.append((offset, since_ms))
            due = since_ms + plan.delete_retention_ms + 1
            cleaned.tombstones_due_ms = due if cleaned.tombstones_due_ms is None else min(cleaned.tombstones_due_ms, due)
    return keep, np.zeros(1, dtype=bool)


def discard(cleaned: CleanedSegment) -> None:
    """Remove a cleaned segment's files that were not swapped in (``.cleaned``, and ``.swap`` of a
    swap that did not commit). Best effort: a file that stays is removed by the next cleaning of
    that group, or on open (``complete_swaps``)."""
    if cleaned.state == "written":
        try:
            _remove(cleaned.path(suffix, stage) for suffix in SEGMENT_SUFFIXES for stage in (CLEANED_SUFFIX, SWAP_SUFFIX))
        except OSError as error:
            logger.warning("cannot remove cleaned segment %s: %s", cleaned.path(LOG_SUFFIX), error)
        cleaned.state = "discarded"


# --- the swap -------------------------------------------------------------------------------------------


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _segment_bases(directory: str) -> list[int]:
    return sorted(
        int(name[: -len(LOG_SUFFIX)])
        for name in os.listdir(directory)
        if name.endswith(LOG_SUFFIX) and name[: -len(LOG_SUFFIX)].isdigit()
    )


def _finish_swap(directory: str, base_offset: int, end_offset: int) -> None:
    """Step 3 of a committed swap (idempotent): delete the replaced segments, rename the ``.swap`` files."""
    for base in _segment_bases(directory):
        if base_offset < base < end_offset:
            _remove(os.path.join(directory, segment_file_name(base, suffix)) for suffix in SEGMENT_SUFFIXES)
    for suffix in SWAP_ORDER:
        name = os.path.join(directory, segment_file_name(base_offset, suffix))
        if os.path.exists(name + SWAP_SUFFIX):
            os.replace(name + SWAP_SUFFIX, name)
    _sync_directory(directory)


def commit_swap(cleaned: CleanedSegment) -> None:
    """Commit a written cleaned segment's swap (step 2 of the module docstring): its files are
    renamed to ``.swap``, the log file last, and the directory is synced.

    The source segments' files are not touched: they stay open and in use. StorageError if a step
    fails: ``cleaned.state`` is still "written" if the log file's rename did not happen (then
    nothing changed for the log; :func:`discard` removes the files), or "committed" (the
    directory's sync failed: the swap is visible, and its completion is up to open).
    """
    check(cleaned.state == "written", f"cleaned segment {cleaned.base_offset} is {cleaned.state}, not written")
    try:
        for suffix in SWAP_ORDER:
            os.replace(cleaned.path(suffix), cleaned.path(suffix, SWAP_SUFFIX))
            if suffix == LOG_SUFFIX:
                cleaned.state = "committed"
        _sync_directory(cleaned.directory)
    except OSError as error:
        raise StorageError(f"swapping in cleaned segment {cleaned.path(LOG_SUFFIX)} failed: {error}") from error


def finish_swap(cleaned: CleanedSegment) -> None:
    """Complete a committed swap (step 3 of the module docstring): the replaced segments' files go
    and the new one's take their final names. The caller (the log's owner) has closed the source
    segments' files and opens the new segment afterwards. StorageError if a step fails (open
    completes it: every step may be repeated)."""
    try:
        _finish_swap(cleaned.directory, cleaned.base_offset, cleaned.end_offset)
    except OSError as error:
        raise StorageError(f"finishing the swap of cleaned segment {cleaned.path(LOG_SUFFIX, SWAP_SUFFIX)} failed: {error}") from error


def _base_of(name: str) -> int:
    """The base offset in a segment file's name (-1 if it has none)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def complete_swaps(directory: str) -> list[str]:
    """Before a log opens: discard every cleaning that did not commit, complete every one that did.

    Returns what it did, one line per cleaned segment, for the recovery report.
    """
    done = []
    names = os.listdir(directory)
    uncommitted: set[int] = set()  # base offsets of cleaned segments a crash left unswapped
    for name in names:
        if name.endswith(CLEANED_SUFFIX):
            _remove([os.path.join(directory, name)])
            uncommitted.add(_base_of(name))
    swapping = sorted(
        int(name[: -len(LOG_SUFFIX + SWAP_SUFFIX)])
        for name in names
        if name.endswith(LOG_SUFFIX + SWAP_SUFFIX) and name[: -len(LOG_SUFFIX + SWAP_SUFFIX)].isdigit()
    )
    for base in swapping:
        summary_path = os.path.join(directory, segment_file_name(base, SUMMARY_SUFFIX))
        summary = read_summary(summary_path + SWAP_SUFFIX) or read_summary(summary_path)
        if summary is None:
            raise CorruptRecordError(f"committed swap of segment {base} in {directory} has no summary")
        _finish_swap(directory, base, summary.end_offset)
        done.append(f"completed the swap of cleaned segment {base} (offsets up to {summary.end_offset})")
    for name in os.listdir(directory):
        if name.endswith(SWAP_SUFFIX):  # of a swap that did not commit
            _remove([os.path.join(directory, name)])
            uncommitted.add(_base_of(name))
    uncommitted.discard(-1)
    done += [f"discarded cleaned segment {base}: its cleaning did not commit" for base in sorted(uncommitted)]
    return done
