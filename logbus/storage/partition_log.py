"""A partition replica's log: an ordered list of segments plus the roll, flush and retention policy.

Directory layout (one directory per partition replica, ``{topic}-{partition}``)::

    00000000000000000000.log / .index / .timeindex   segments, named by base offset
    00000000000000052341.log / .index / .timeindex
    recovery-point                                    offset below which every segment was synced

The last segment is the *active* one; appends go there. A new segment is
rolled when the active one would pass ``segment.bytes``, when its first batch
is older than ``segment.ms``, or when relative offsets or positions would
overflow the index entry format. Rolling syncs the old segment and advances
the recovery point.

Recovery on open: every segment at or after the recovery point, and always the
active segment, is scanned batch by batch (lengths, CRC, contiguous offsets);
the first bad batch and everything after it is cut off, later segments are
deleted, and the indexes are rebuilt. :attr:`recovery` says how many bytes
were cut. Older segments keep their indexes unless they look inconsistent,
and every read checks the CRC of each batch it returns, so a batch damaged
at rest is reported (CorruptRecordError), never served.

Retention deletes whole segments, oldest first, never the active one (which
is rolled first if it alone is past retention.ms); the log start offset is
the base offset of the first remaining segment.

This class is not thread-safe: its owner (a partition replica actor)
serialises calls.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Callable

from logbus.errors import (
    CorruptRecordError,
    InvalidRecordError,
    OffsetOutOfRangeError,
    RecordTooLargeError,
    StorageError,
)
from logbus.clock import wall_ms
from logbus.storage import record_batch as rb
from logbus.storage.files import write_atomically
from logbus.storage.leader_epoch_cache import LeaderEpochCache
from logbus.storage.log_config import LOG_APPEND_TIME, LogConfig
from logbus.storage.producer_state import ProducerStateTable
from logbus.storage.segment import LOG_SUFFIX, LogSegment

RECOVERY_POINT_FILE = "recovery-point"


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening the log found and repaired."""

    segments_scanned: int
    truncated_bytes: int
    segments_deleted: int
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AppendResult:
    base_offset: int
    last_offset: int
    record_count: int
    max_timestamp_ms: int
    log_end_offset: int
    duplicate: bool = False  # an idempotent retry of a batch already in the log: nothing was written


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Whole batches read from one segment.

    ``data`` views the segment's mapped file (no copy); ``first_offset`` is the
    base offset of its first batch (which may be below the requested offset:
    batches are returned whole), and ``next_offset`` the offset after its last.
    """

    data: memoryview
    first_offset: int
    next_offset: int

    @property
    def size_bytes(self) -> int:
        return len(self.data)


class PartitionLog:
    """A partition replica's log (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        directory: str,
        config: LogConfig | None = None,
        *,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.directory = directory
        self.config = config or LogConfig()
        self.clock_ms = clock_ms
        self._closed = False
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            raise StorageError(f"cannot create log directory {directory}: {error}") from error
        self.segments: list[LogSegment] = []
        self._bases: list[int] = []
        self.recovery = self._open_segments()
        self.epochs = LeaderEpochCache(directory)
        self.producer_state = ProducerStateTable()
        self._rebuild_derived_state(trust_epoch_checkpoint=True)
        self._last_flush_ms = self.clock_ms()

    def _rebuild_derived_state(self, trust_epoch_checkpoint: bool = False) -> None:
        """Rebuild the producer table (and, if needed, the epoch cache) from the batch headers."""
        loaded = trust_epoch_checkpoint and self.epochs.load()
        if loaded:
            self.epochs.truncate_from_end(self.log_end_offset)
        else:
            self.epochs.entries = []
        self.producer_state.clear()
        for segment in self.segments:
            view = segment._view()
            for _, header in rb.iter_headers(view, 0, segment.size_bytes):
                self.producer_state.update(header)
                if not loaded:
                    self.epochs.assign(header.leader_epoch, header.base_offset, persist=False)
            del view
        if not loaded:
            self.epochs.save()

    # --- opening and recovery -------------------------------------------------------------

    def _open_segments(self) -> RecoveryReport:
        bases = sorted(
            int(name[: -len(LOG_SUFFIX)])
            for name in os.listdir(self.directory)
            if name.endswith(LOG_SUFFIX) and name[: -len(LOG_SUFFIX)].isdigit()
        )
        recovery_point = self._read_recovery_point()
        scanned = truncated = deleted = 0
        errors: list[str] = []
        expected: int | None = None
        stopped = False  # after a cut or a gap, later segments are unreachable and go
        for i, base in enumerate(bases):
            if not stopped and expected is not None and base != expected:
                errors.append(f"segment {base} does not continue the log at offset {expected}")
                stopped = True
            if stopped:
                LogSegment(self.directory, base, self.config.index_interval_bytes).delete()
                deleted += 1
                continue
            is_last = i == len(bases) - 1
            if is_last or recovery_point is None or base >= recovery_point:
                segment = LogSegment(self.directory, base, self.config.index_interval_bytes)
                report = segment.recover(expected_base_offset=expected)
                scanned += 1
                truncated += report.truncated_bytes
                if report.error:
                    errors.append(f"segment {base}: {report.error}")
                stopped = report.truncated_bytes > 0
            else:
                segment = LogSegment.open_existing(self.directory, base, self.config.index_interval_bytes)
            if segment.is_empty and not is_last and not stopped:
                # An empty segment in the middle carries nothing; its successor continues the log.
                segment.delete()
                continue
            self._add_segment(segment)
            expected = segment.next_offset
        if not self.segments:
            self._add_segment(LogSegment(self.directory, 0, self.config.index_interval_bytes))
        return RecoveryReport(scanned, truncated, deleted, tuple(errors))

    def _read_recovery_point(self) -> int | None:
        try:
            with open(os.path.join(self.directory, RECOVERY_POINT_FILE)) as file:
                return int(file.read().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _write_recovery_point(self, offset: int) -> None:
        write_atomically(os.path.join(self.directory, RECOVERY_POINT_FILE), f"{offset}\n")

    def _add_segment(self, segment: LogSegment) -> None:
        self.segments.append(segment)
        self._bases.append(segment.base_offset)

    # --- offsets ---------------------------------------------------------------------------------

    @property
    def log_start_offset(self) -> int:
        return self.segments[0].base_offset

    @property
    def log_end_offset(self) -> int:
        """The offset the next appended record gets."""
        return self.segments[-1].next_offset

    @property
    def active_segment(self) -> LogSegment:
        return self.segments[-1]

    @property
    def size_bytes(self) -> int:
        return sum(segment.size_bytes for segment in self.segments)

    # --- appending -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"log {self.directory} is closed")

    def _validate_incoming(self, buffer, position: int = 0) -> rb.BatchHeader:
        """Check one incoming batch completely before any byte of it is written."""
        view = memoryview(buffer)
        try:
            header = rb.read_header(view, position)
        except CorruptRecordError as error:
            raise InvalidRecordError(f"not a valid batch: {error}") from None
        if header.size_bytes > self.config.max_message_bytes:
            raise RecordTooLargeError(
                f"batch of {header.size_bytes} bytes exceeds max.message.bytes={self.config.max_message_bytes}"
            )
        try:
            rb.decode_records(view, position)  # checks CRC and that the payload holds record_count rows
        except CorruptRecordError as error:
            raise InvalidRecordError(f"batch failed validation: {error}") from None
        return header

    def append(self, batch, *, leader_epoch: int = rb.NO_LEADER_EPOCH) -> AppendResult:
        """Append one batch as leader: assign offsets from the log end and stamp ``leader_epoch``.

        ``batch`` is one framed batch (bytes, memoryview or a uint8 numpy array).
        Raises RecordTooLargeError / InvalidRecordError before writing anything.
        """
        self._check_open()
        view = _byte_view(batch)
        header = self._validate_incoming(view)
        if header.size_bytes != len(view):
            raise InvalidRecordError(f"expected one batch of {header.size_bytes} bytes, got {len(view)} bytes")
        duplicate_of = self.producer_state.check(header)
        if duplicate_of is not None:
            # The timestamp as stored: on a LogAppendTime topic the append time of the original.
            base, max_timestamp_ms = duplicate_of
            last = base + header.record_count - 1
            return AppendResult(base, last, header.record_count, max_timestamp_ms, self.log_end_offset, duplicate=True)
        base_offset = self.log_end_offset
        append_time = self.clock_ms() if self.config.message_timestamp_type == LOG_APPEND_TIME else None
        new_header_bytes, payload = rb.with_offset_and_epoch(view, base_offset, leader_epoch, append_time)
        stamped = header.stamped(base_offset, leader_epoch) if append_time is None else rb.unpack_header(new_header_bytes)
        self._write(stamped, [new_header_bytes, payload])
        return AppendResult(base_offset, stamped.last_offset, stamped.record_count, stamped.max_timestamp_ms, self.log_end_offset)

    def append_as_follower(self, batches) -> AppendResult | None:
        """Append whole batches copied from the leader, keeping their offsets and epochs.

        Every batch must continue the log exactly (base offset == log end offset).
        Returns None for an empty buffer.
        """
        self._check_open()
        view = _byte_view(batches)
        position = 0
        first = last = None
        while position < len(view):
            header = self._validate_incoming(view, position)
            if header.base_offset != self.log_end_offset:
                raise InvalidRecordError(
                    f"batch at offset {header.base_offset} does not continue the log at {self.log_end_offset}"
                )
            self._write(header, [view[position : position + header.size_bytes]])
            first = first or header
            last = header
            position += header.size_bytes
        if last is None:
            return None
        return AppendResult(
            first.base_offset, last.last_offset, last.next_offset - first.base_offset, last.max_timestamp_ms, self.log_end_offset
        )

    def _write(self, header: rb.BatchHeader, parts: list) -> None:
        self._maybe_roll(header)
        active = self.active_segment
        active.append(header, parts)
        self.epochs.assign(header.leader_epoch, header.base_offset)
        self.producer_state.update(header)
        policy = self.config.flush_policy
        if policy == "batch":
            self.flush(indexes=False)
        elif policy == "interval":
            self.maybe_flush()
        active.release_page_cache(self.config.cache_tail_bytes)

    def _maybe_roll(self, incoming: rb.BatchHeader) -> None:
        active = self.active_segment
        if active.is_empty:
            return
        now = self.clock_ms()
        too_big = active.size_bytes + incoming.size_bytes > self.config.segment_bytes
        too_old = active.first_timestamp_ms is not None and now - self._segment_birth_ms(active) >= self.config.segment_ms
        if too_big or too_old or not active.can_hold(incoming):
            self.roll()

    def _segment_birth_ms(self, segment: LogSegment) -> int:
        return segment.first_timestamp_ms if segment.first_timestamp_ms is not None else self.clock_ms()

    def roll(self) -> LogSegment:
        """Start a new active segment at the log end offset (syncing the old one)."""
        self._check_open()
        active = self.active_segment
        if active.is_empty:
            return active
        active.flush()
        segment = LogSegment(self.directory, self.log_end_offset, self.config.index_interval_bytes)
        if not segment.is_empty:  # a leftover file at this base offset cannot be ours
            segment.delete()
            segment = LogSegment(self.directory, self.log_end_offset, self.config.index_interval_bytes)
        self._add_segment(segment)
        self._write_recovery_point(segment.base_offset)
        return segment

    # --- flushing --------------------------------------------------------------------------------

    def flush(self, indexes: bool = True) -> None:
        """Sync the active segment (older ones were synced when they rolled).

        ``indexes=False`` syncs only the log file: indexes are derived data that
        recovery rebuilds for the active segment, so per-batch syncs skip them.
        """
        self._check_open()
        self.active_segment.flush(indexes=indexes)
        self._last_flush_ms = self.clock_ms()

    def maybe_flush(self) -> bool:
        """For flush.policy='interval': sync if flush.ms has passed since the last sync."""
        if self.config.flush_policy != "interval" or self._closed:
            return False
        if self.clock_ms() - self._last_flush_ms >= self.config.flush_ms:
            self.flush()
            return True
        return False

    # --- reading ---------------------------------------------------------------------------------

    def _check_offset(self, offset: int) -> None:
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise OffsetOutOfRangeError(f"offset must be an int, not {offset!r}")
        if offset < self.log_start_offset or offset > self.log_end_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} is outside the log [{self.log_start_offset}, {self.log_end_offset}]"
            )

    def read(
        self, offset: int, max_bytes: int = 1024 * 1024, max_offset: int | None = None, verify_crc: bool = True
    ) -> ReadResult | None:
        """Whole batches starting with the one that holds ``offset``, from one segment, without copying.

        ``max_offset`` (exclusive; the high watermark for consumers) bounds the
        batches returned. Returns None when there is nothing at or after
        ``offset`` yet (``offset`` == log end, or everything is above
        ``max_offset``). Raises OffsetOutOfRangeError below the log start or
        past the log end, and CorruptRecordError if a stored batch fails its CRC
        (checked unless ``verify_crc`` is False: for readers that check it themselves).
        """
        self._check_open()
        self._check_offset(offset)
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        i = max(0, bisect.bisect_right(self._bases, offset) - 1)
        for segment in self.segments[i:]:
            found = segment.read(offset, max_bytes, max_offset, verify_crc)
            if found is not None:
                return ReadResult(*found)
            if offset < segment.next_offset:
                return None  # held by this segment, but above max_offset
        return None

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """The earliest offset whose record timestamp is >= ``timestamp_ms``, or None if there is none."""
        self._check_open()
        for segment in self.segments:
            offset = segment.offset_for_timestamp(timestamp_ms)
            if offset is not None:
                return offset
        return None

    # --- truncation and retention ----------------------------------------------------------------

    def truncate_to(self, offset: int) -> int:
        """Remove every batch that holds an offset >= ``offset`` (batches go whole); return the new log end.

        Used by replication when a follower must drop a divergent tail. Never
        goes below the log start offset.
        """
        self._check_open()
        if offset >= self.log_end_offset:
            return self.log_end_offset
        offset = max(offset, self.log_start_offset)
        while len(self.segments) > 1 and self.segments[-1].base_offset >= offset:
            segment = self.segments.pop()
            self._bases.pop()
            segment.delete()
        self.active_segment.truncate_to(offset)
        self._write_recovery_point(min(self._read_recovery_point() or 0, self.active_segment.base_offset))
        self.epochs.truncate_from_end(self.log_end_offset)
        self._rebuild_derived_state(trust_epoch_checkpoint=True)
        return self.log_end_offset

    def truncate_fully_and_start_at(self, offset: int) -> None:
        """Delete every segment and start an empty log at ``offset`` (a follower far behind the leader's start)."""
        self._check_open()
        for segment in self.segments:
            segment.delete()
        self.segments, self._bases = [], []
        self._add_segment(LogSegment(self.directory, offset, self.config.index_interval_bytes))
        self._write_recovery_point(offset)
        self.epochs.clear()
        self.producer_state.clear()

    def enforce_retention(self) -> int:
        """Delete whole old segments past retention.ms or retention.bytes; return how many went."""
        self._check_open()
        now = self.clock_ms()
        config = self.config
        deleted = 0
        if config.retention_ms >= 0:
            active = self.active_segment
            if not active.is_empty and now - active.max_timestamp_ms > config.retention_ms and len(self.segments) == 1:
                self.roll()
            while len(self.segments) > 1 and now - self.segments[0].max_timestamp_ms > config.retention_ms:
                self._delete_oldest()
                deleted += 1
        if config.retention_bytes >= 0:
            total = self.size_bytes
            while len(self.segments) > 1 and total - self.segments[0].size_bytes >= config.retention_bytes:
                total -= self.segments[0].size_bytes
                self._delete_oldest()
                deleted += 1
        return deleted

    def next_retention_ms(self) -> int | None:
        """The clock time (ms) at which :meth:`enforce_retention` will next have something to delete
        by ``retention.ms``, or None (time retention off, or nothing written). Owners arm one timer
        for it instead of checking periodically."""
        if self._closed or self.config.retention_ms < 0:
            return None
        if len(self.segments) > 1:
            return self.segments[0].max_timestamp_ms + self.config.retention_ms + 1
        if not self.active_segment.is_empty:
            return self.active_segment.max_timestamp_ms + self.config.retention_ms + 1
        return None

    def _delete_oldest(self) -> None:
        segment = self.segments.pop(0)
        self._bases.pop(0)
        segment.delete()
        self.epochs.truncate_from_start(self.log_start_offset)

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Sync and close every file; the log can be reopened from its directory."""
        if self._closed:
            return
        self.active_segment.flush()
        self._write_recovery_point(self.log_end_offset)
        for segment in self.segments:
            segment.close()
        self._closed = True

    def delete(self) -> None:
        """Remove the log's files and directory."""
        for segment in self.segments:
            segment.delete()
        self._closed = True
        for name in (RECOVERY_POINT_FILE, RECOVERY_POINT_FILE + ".tmp", self.epochs.path, self.epochs.path + ".tmp"):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def _byte_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view

