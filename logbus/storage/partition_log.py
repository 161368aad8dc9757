"""A partition replica's log: an ordered list of segments plus the roll, flush and retention policy.

Directory layout (one directory per partition replica, ``{topic}-{partition}``)::

    00000000000000000000.log / .index / .timeindex   segments, named by base offset
    00000000000000052341.log / .index / .timeindex   (.txnindex: aborted transactions, once there is one)
    recovery-point                                    offset below which every segment was synced
    log-start-offset                                  the log start offset, once delete_records moved it
    cleaner-offset-checkpoint                         compaction: first dirty offset, next tombstone due
    offset-gaps                                       compaction: offsets in this log may have gaps

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

Retention (``cleanup.policy`` "delete") deletes whole segments, oldest first,
never the active one (which is rolled first if it alone is past
retention.ms). The log start offset is the base offset of the first
remaining segment, or higher once :meth:`PartitionLog.delete_records` moved
it (Kafka's DeleteRecords: it is kept in ``log-start-offset``, and reads
below it raise OffsetOutOfRangeError).

Producer expiry (``producer.id.expiration.ms``, see producer_state.py): the
producer table forgets producers whose last write is that old, with no
transaction open, when a segment rolls and whenever the table is rebuilt from
the headers (open, recovery, truncation). No timer: the timestamps come from
the batch headers, so a rebuild forgets again whatever an earlier expiry
forgot. (One exception to "memory is what an open recovers": a batch's append
time, which the table also counts while the log is open, is not on disk, so
a producer whose records are stamped over the expiration in the past stays
in memory for the expiration after its write, and a rebuild forgets it.)

Transactions (KIP-98). A transactional producer's batches carry the
TRANSACTIONAL attribute; the transaction ends with a marker, a control batch
(COMMIT or ABORT) that the leader appends with :meth:`PartitionLog.append_marker`
and followers copy like any batch. The producer table keeps each producer's
ongoing transaction, so :meth:`PartitionLog.first_unstable_offset` is the
first offset of the oldest one (the leader's last stable offset is the
smaller of it and the high watermark). An ABORT marker adds an entry to its
segment's transaction index (txn_index.py), which
:meth:`PartitionLog.aborted_transactions` reads instead of scanning batches.
A producer's ongoing transaction whose first batches retention or
delete_records removed starts, from then on, at its first batch left (what
an open finds).

Compaction (``cleanup.policy`` "compact", see cleaner.py) removes records
from closed segments but never changes an offset: the removed ones become
gaps. A log may have gaps only once ``offset-gaps`` exists (written before
the first gap): recovery then accepts offsets that increase with gaps,
within and between segments; in other logs it still requires contiguous
offsets. A read at an offset in a gap returns the next batch, and the
reply's ``first_offset`` is the offset asked for (the batches cover every
offset from there); a read that finds only a gap up to its bound returns no
batch but a ``next_offset`` past the gap, so no reader waits at a gap.

Write contract (a full disk, an I/O error: whatever OSError a write step
meets). What memory holds (the segments, each one's size, next offset and
index entries, the log start offset, the epoch cache, the producer table) is
what the next open would recover from the files, after every call, whether
it returned or raised; a step that fails raises StorageError naming its file.

- An append is all or nothing: its steps are a roll if one is due (see
  :meth:`_roll_to`), the log file, the index entries it is due (and a
  marker's transaction index entry), the epoch
  checkpoint if its leader epoch is new, and the sync its flush policy asks
  for. If one fails, the ones done are undone (the files cut back, the epoch
  entries put back) and the producer table, updated only after the last
  step, has not changed: the batch is not in the log, a retry appends it
  once, and its offset was never given to another batch.
- Operations on several files (a roll, a truncation, delete_records, a
  truncation to a new start) are made of steps that each leave a whole log
  on disk (a segment is deleted by removing its log file first; a new one is
  made before an old one it replaces goes), and memory follows each step
  done. The state files written along the way (recovery point, log start,
  cleaner checkpoint, epoch checkpoint, a cleaned segment's summary) are each
  harmless when a failed write leaves them stale: the recovery point only
  says where scanning starts, a log start below the first segment's base
  counts as that base, and open keeps only the epochs inside the log.
- A cleaning's swap is atomic on disk (cleaner.py); when it fails the log is
  read back from disk (:meth:`_resync`). If even that fails, the log closes
  itself and every call raises StorageError until its owner opens it again.

Post-conditions (``logbus/invariant.py``: a failure raises
InvariantViolationError, and ends a replica's process, which reopens the log).
After each batch written, the log end is the batch's next offset and the
batch continued the log (a gap only where gaps are allowed), and a segment
just rolled continues the one before: O(1), from what the append computed
anyway. After a truncation the log ends at the truncation point (at the
start of the batch that held it: batches go whole), and nothing at or past
it is left; after delete_records the log start only moved forward, to the
offset asked for, never past the log end, and the first segment holds it;
after recovery the log end is at or past the log start. After each of
those, and after retention and a cleaning's swap, the segments continue one
another (and the base offsets the reads bisect are theirs): these run over
the segments, on operations that are rare next to appends.

Recovery makes the last one hold: a log start written by delete_records
whose records were then lost with unsynced writes (a machine that crashed;
flush.policy "os" syncs nothing per batch) lies past the recovered log end.
The log is then emptied and starts at its log start, as Kafka's does: the
records below it were deleted anyway, the ones above it are gone, and a
follower copies them again.

This class is not thread-safe: its owner (a partition replica actor)
serialises calls.
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

from logbus.errors import (
    CorruptRecordError,
    InvalidRecordError,
    OffsetOutOfRangeError,
    RecordTooLargeError,
    StorageError,
)
from logbus.clock import wall_ms
from logbus.invariant import check, require_test_hooks, violated
from logbus.storage import batch_header as bh
from logbus.storage.files import replace_file, sync_directory
from logbus.storage.cleaner import (
    CleanedSegment,
    CleaningPlan,
    SourceSegment,
    build_offset_map,
    clean_group,
    commit_swap,
    finish_swap,
    complete_swaps,
    discard,
    SegmentSummary,
    group_segments,
    read_summary,
    replace_summary,
)
from logbus.storage.leader_epoch_cache import LeaderEpochCache
from logbus.storage.log_config import LOG_APPEND_TIME, LogConfig
from logbus.storage.producer_state import ProducerStateTable
from logbus.storage.segment import (
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SUMMARY_SUFFIX,
    TIME_INDEX_SUFFIX,
    TXN_INDEX_SUFFIX,
    LogSegment,
    segment_file_name,
)
from logbus.storage.txn_index import AbortedTxn


logger = logging.getLogger(__name__)

RECOVERY_POINT_FILE = "recovery-point"
LOG_START_OFFSET_FILE = "log-start-offset"
CLEANER_CHECKPOINT_FILE = "cleaner-offset-checkpoint"
OFFSET_GAPS_FILE = "offset-gaps"
_NO_BYTES = memoryview(b"")


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening the log found and repaired."""

    segments_scanned: int
    truncated_bytes: int
    segments_deleted: int
    errors: tuple[str, ...]
    swaps: tuple[str, ...] = ()  # cleanings a crash interrupted: completed or discarded (cleaner.complete_swaps)


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

    ``data`` views the segment's mapped file (no copy). It holds every record
    of the log in ``[first_offset, next_offset)``: ``first_offset`` is the base
    offset of its first batch (which may be below the requested offset:
    batches are returned whole) or, when that batch starts past the requested
    offset (a compacted gap), the requested offset; ``next_offset`` is the
    offset after its last batch. ``data`` is empty when the offsets from the
    requested one to ``next_offset`` are all gone (compacted).
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
        self._failure: str | None = None  # why the log closed itself (see _resync)
        # Set by the test hook test_hook_break_next_append (refused outside tests): the next batch
        # written fails its post-condition.
        self._break_next_append = False
        self.epochs = LeaderEpochCache(directory)
        self.producer_state = ProducerStateTable()
        # With a remote tier (remote.storage.enable): the offset below which the tier holds every
        # record, set by the owner after each upload; local retention deletes only segments below it.
        self.tiered_offset: int | None = None
        self.recovery = self._load()
        self._last_flush_ms = self.clock_ms()

    def _load(self) -> RecoveryReport:
        """Open the segments and state files as they are on disk, and rebuild what memory derives from them."""
        try:
            swaps = complete_swaps(self.directory)
        except OSError as error:
            raise StorageError(f"cannot complete the cleanings interrupted in {self.directory}: {error}") from error
        self._gaps = os.path.exists(self._path(OFFSET_GAPS_FILE))
        recovery = self._open_segments(tuple(swaps))
        self._trim_active_summary()
        self._log_start = self._read_number(LOG_START_OFFSET_FILE, 0)
        checkpoint = self._read_text(CLEANER_CHECKPOINT_FILE).split()
        self._cleaner_checkpoint = int(checkpoint[0]) if checkpoint[:1] and checkpoint[0].isdigit() else 0
        self._tombstones_due_ms = int(checkpoint[1]) if checkpoint[1:2] and checkpoint[1].isdigit() else None
        if self._log_start > self.log_end_offset:
            # The records up to the log start were lost after it was written (see the module docstring).
            message = f"log start {self._log_start} is past the recovered log end {self.log_end_offset}: emptied, starting at it"
            logger.warning("%s: %s", self.directory, message)
            recovery = replace(recovery, errors=recovery.errors + (message,))
            self.truncate_fully_and_start_at(self._log_start)
        self._rebuild_derived_state(trust_epoch_checkpoint=True)
        self._check_segments("recovery")
        check(
            self.log_start_offset <= self.log_end_offset,
            f"{self.directory}: after recovery, the log start {self.log_start_offset} is past the log end {self.log_end_offset}",
        )
        return recovery

    def _rebuild_derived_state(self, trust_epoch_checkpoint: bool = False) -> None:
        """Rebuild the producer table (and, if needed, the epoch cache) from the batch headers.

        Of a checkpoint's epochs, those inside the log are kept (see leader_epoch_cache.py).
        """
        loaded = trust_epoch_checkpoint and self.epochs.load()
        if not loaded:
            self.epochs.entries = []
        self._rebuild_producer_state(rebuild_epochs=not loaded)
        self.epochs.clamp(self.log_start_offset, self.log_end_offset)
        if not loaded:
            try:
                self.epochs.save()
            except StorageError as error:  # rebuilt again on the next open
                logger.warning("%s", error)

    def _rebuild_producer_state(self, rebuild_epochs: bool = False) -> None:
        """The producer table from the batch headers (and the cleaner's summaries); with
        ``rebuild_epochs``, the epoch cache (in memory) too. The transaction index of a segment that
        recovery scanned (or whose index did not load) is rebuilt on the way, from its markers and
        the producer state before each."""
        self.producer_state.clear()
        end = self.log_end_offset
        for segment in self.segments:
            summary = self._summary_of(segment)
            # A cleaned segment: the producer state its original batches gave (cleaner.py), less
            # the batches a truncation removed since; batches appended after that count by header.
            pending = [] if summary is None else [entry for entry in summary.producers if entry[4] < end]
            aborted: list[AbortedTxn] | None = [] if segment.txn_index_stale else None
            view = segment._view()
            for position, header in bh.iter_headers(view, 0, segment.size_bytes):
                if summary is None or header.base_offset >= summary.end_offset:
                    for entry in pending:
                        self.producer_state.apply(entry)
                    pending = []
                    if aborted is not None and header.is_control:
                        # (A cleaned segment's markers below its summary's end name no batch left: no entry.)
                        commit = self._marker_commits(view, position)
                        entry = self._aborted_entry(header, commit)
                        if not commit:  # the entry written with the marker, if the file had it (segment.recover)
                            entry = segment.txn_entries_before.get((header.producer_id, header.base_offset), entry)
                        if entry is not None:
                            aborted.append(entry)
                    self.producer_state.update(header)
                if rebuild_epochs:
                    self.epochs.assign(header.leader_epoch, header.base_offset, persist=False)
            del view
            for entry in pending:
                self.producer_state.apply(entry)
            if aborted is not None:
                segment.txn_index.rebuild(aborted)
                segment.txn_index_stale = False
                segment.txn_entries_before = {}
        # After the whole log: a producer's later batches may revive it (an expired producer that
        # wrote again), and the transaction index above needed every producer's ongoing transaction.
        self._expire_producers()

    def _expire_producers(self) -> int:
        """Forget the producers whose last write is producer.id.expiration.ms old (producer_state.py).
        Run on work the log does anyway (a roll, a rebuild of the producer table), never on a timer:
        an idle partition keeps its producers until its next roll or open, which is harmless."""
        return self.producer_state.remove_expired(self.clock_ms(), self.config.producer_id_expiration_ms)

    @staticmethod
    def _marker_commits(buffer, position: int = 0) -> bool:
        """Whether the control batch at ``position`` is a COMMIT marker (else ABORT): its record is read
        with Arrow, imported only when a marker is met. CorruptRecordError if it is not a marker."""
        from logbus.storage.record_batch import read_control_batch  # noqa: PLC0415

        _, commit, _ = read_control_batch(buffer, position)
        return commit

    def _aborted_entry(self, marker: bh.BatchHeader, commit: bool) -> AbortedTxn | None:
        """The transaction index entry of a marker about to be recorded in the producer table (None for
        a COMMIT, or a marker of a producer with no ongoing transaction: nothing to abort)."""
        ongoing = self.producer_state.ongoing
        first = ongoing.get(marker.producer_id)
        if commit or first is None:
            return None
        others = [offset for producer_id, offset in ongoing.items() if producer_id != marker.producer_id]
        return AbortedTxn(marker.producer_id, first, marker.base_offset, min(others + [marker.base_offset + 1]))

    def _summary_of(self, segment: LogSegment):
        """The cleaner's summary of a cleaned segment, or None (also, with a warning, if it is unreadable:
        the segment's batch headers then stand in for it)."""
        try:
            return read_summary(segment.summary_path)
        except CorruptRecordError as error:
            logger.warning("%s; rebuilding its producer state from its batch headers", error)
            return None

    # --- opening and recovery -------------------------------------------------------------

    def _open_segments(self, swaps: tuple[str, ...] = ()) -> RecoveryReport:
        names = os.listdir(self.directory)
        bases = sorted(
            int(name[: -len(LOG_SUFFIX)])
            for name in names
            if name.endswith(LOG_SUFFIX) and name[: -len(LOG_SUFFIX)].isdigit()
        )
        self._remove_orphans(names, set(bases))
        recovery_point = self._read_recovery_point()
        scanned = truncated = deleted = 0
        errors: list[str] = []
        expected: int | None = None
        stopped = False  # after a cut or a gap, later segments are unreachable and go
        for i, base in enumerate(bases):
            continues = expected is None or base == expected or (self._gaps and base > expected)
            if not stopped and not continues:
                errors.append(f"segment {base} does not continue the log at offset {expected}")
                stopped = True
            if stopped:
                LogSegment(self.directory, base, self.config.index_interval_bytes).delete()
                deleted += 1
                continue
            is_last = i == len(bases) - 1
            if is_last or recovery_point is None or base >= recovery_point:
                segment = LogSegment(self.directory, base, self.config.index_interval_bytes)
                report = segment.recover(expected_base_offset=expected, allow_gaps=self._gaps)
                scanned += 1
                truncated += report.truncated_bytes
                if report.error:
                    errors.append(f"segment {base}: {report.error}")
                stopped = report.truncated_bytes > 0
            else:
                segment = LogSegment.open_existing(self.directory, base, self.config.index_interval_bytes, self._gaps)
            if segment.is_empty and not is_last and not stopped and not os.path.exists(segment.summary_path):
                # An empty segment in the middle carries nothing; its successor continues the log.
                # (One the cleaner emptied carries the producer state of what it replaced.)
                segment.delete()
                continue
            self._add_segment(segment)
            expected = segment.next_offset
        if not self.segments:
            self._add_segment(LogSegment(self.directory, 0, self.config.index_interval_bytes))
        return RecoveryReport(scanned, truncated, deleted, tuple(errors), swaps)

    def _remove_orphans(self, names: list[str], bases: set[int]) -> None:
        """Remove the index and summary files of segments whose log file is gone (a deletion that
        failed after it): harmless, but they would sit there for good. Best effort."""
        for name in names:
            base, _, suffix = name.partition(".")
            if base.isdigit() and "." + suffix in (INDEX_SUFFIX, TIME_INDEX_SUFFIX, TXN_INDEX_SUFFIX, SUMMARY_SUFFIX) and int(base) not in bases:
                try:
                    os.unlink(self._path(name))
                except OSError as error:
                    logger.warning("cannot remove %s, left by a deleted segment: %s", name, error)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _read_text(self, name: str) -> str:
        try:
            with open(self._path(name)) as file:
                return file.read()
        except FileNotFoundError:
            return ""

    def _read_number(self, name: str, default):
        try:
            return int(self._read_text(name).strip())
        except ValueError:
            return default

    def _read_recovery_point(self) -> int | None:
        return self._read_number(RECOVERY_POINT_FILE, None)

    def _write_state(self, name: str, text: str, adopt: Callable[[], None] | None = None) -> None:
        """Replace the state file ``name`` (files.py); StorageError naming it if that fails.

        ``adopt`` takes the new value into memory as soon as the file holds it
        (before the directory's sync, which can still fail), so that memory
        always matches the file: a failure before the rename changes neither.
        """
        path = self._path(name)
        try:
            replace_file(path, text)
        except OSError as error:
            raise StorageError(f"writing {path} failed: {error}") from error
        if adopt is not None:
            adopt()
        try:
            sync_directory(self.directory)
        except OSError as error:
            raise StorageError(f"syncing directory {self.directory} after writing {path} failed: {error}") from error

    def _allow_gaps(self) -> None:
        """Before the first gap is written: from now on (and after a restart) offsets may have gaps."""
        if not self._gaps:
            self._write_state(OFFSET_GAPS_FILE, "offsets in this log may have gaps (compaction)\n", self._gaps_allowed)

    def _gaps_allowed(self) -> None:
        self._gaps = True

    def _write_recovery_point(self, offset: int) -> None:
        """Where the next open starts scanning. Stale, it is harmless: every segment but the active one
        was synced when it rolled, and the active one is always scanned."""
        self._write_state(RECOVERY_POINT_FILE, f"{offset}\n")

    def _add_segment(self, segment: LogSegment) -> None:
        self.segments.append(segment)
        self._bases.append(segment.base_offset)

    # --- post-conditions (see the module docstring) -----------------------------------------------

    def _continues(self, before: LogSegment, after: LogSegment) -> bool:
        """Whether ``after`` starts where ``before`` ends (or past it, in a log that may have gaps)."""
        return before.next_offset == after.base_offset or (self._gaps and before.next_offset < after.base_offset)

    def test_hook_break_next_append(self) -> None:
        """A test hook: the next batch written (as leader or follower) fails its post-condition, as a
        bug in the append would, so tests can watch a replica end and come back. One append only.

        Refused (IllegalStateError, nothing changed) unless the process was started with
        ``LOGBUS_TEST_HOOKS=1`` (``logbus.invariant.require_test_hooks``).
        """
        require_test_hooks("test_hook_break_next_append")
        self._break_next_append = True

    def _check_appended(self, header: bh.BatchHeader, end_before: int, allow_gap: bool) -> None:
        """After one batch written: the log end moved to the batch's next offset, the batch continued
        the log, and a segment rolled for it continues the one before. O(1)."""
        # (On this path the messages are formatted only once a check failed.)
        end = header.next_offset
        if self._break_next_append:
            self._break_next_append = False
            end += 1  # as if the log end had not moved by exactly the batch's offsets
        if not (self.log_end_offset == end and (header.base_offset == end_before or (allow_gap and header.base_offset > end_before))):
            violated(
                f"{self.directory}: the log end is {self.log_end_offset} after a batch at [{header.base_offset}, "
                f"{header.next_offset}) was appended to a log ending at {end_before}"
            )
        active = self.active_segment
        if not (self._bases[-1] == active.base_offset and (len(self.segments) == 1 or self._continues(self.segments[-2], active))):
            violated(
                f"{self.directory}: the active segment at {active.base_offset} does not continue the log "
                f"(the segment before ends at {self.segments[-2].next_offset if len(self.segments) > 1 else None})"
            )

    def _check_segments(self, after: str) -> None:
        """After a rare operation (``after`` names it): the segments continue one another, and their
        base offsets are the index's. O(segments)."""
        check(
            self._bases == [segment.base_offset for segment in self.segments],
            f"{self.directory}: after {after}, the segment index {self._bases[:5]}... does not match the segments",
        )
        for before, following in zip(self.segments, self.segments[1:]):
            check(
                self._continues(before, following),
                f"{self.directory}: after {after}, segment {following.base_offset} does not continue segment "
                f"{before.base_offset}, which ends at {before.next_offset}",
            )

    # --- offsets ---------------------------------------------------------------------------------

    @property
    def log_start_offset(self) -> int:
        """The first offset readable: the first segment's base offset, or higher after delete_records."""
        return max(self._log_start, self.segments[0].base_offset)

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
            if self._failure is not None:
                raise StorageError(f"log {self.directory} closed itself: {self._failure}")
            raise StorageError(f"log {self.directory} is closed")

    def _validate_copied(self, view: memoryview, position: int) -> bh.BatchHeader:
        """Check a batch copied from the leader: its frame and CRC. The leader checked its records
        and size when it took them (a follower needs no Arrow), and a batch the leader holds is
        copied even if max.message.bytes was lowered since, as Kafka's followers do."""
        try:
            return bh.validate_batch(view, position)
        except CorruptRecordError as error:
            raise InvalidRecordError(f"batch failed validation: {error}") from None

    def _validate_incoming(self, buffer, position: int = 0, keyed: bool = False) -> bh.BatchHeader:
        """Check one incoming batch completely before any byte of it is written (``keyed``: every
        record must have a key, as on a compacted topic)."""
        view = memoryview(buffer)
        try:
            header = bh.read_header(view, position)
        except CorruptRecordError as error:
            raise InvalidRecordError(f"not a valid batch: {error}") from None
        if header.size_bytes > self.config.max_message_bytes:
            raise RecordTooLargeError(
                f"batch of {header.size_bytes} bytes exceeds max.message.bytes={self.config.max_message_bytes}"
            )
        # A leader checks the records themselves (Arrow; imported on the first produce, so a replica
        # that only follows or idles never loads it); followers check CRCs (append_as_follower).
        from logbus.storage.record_batch import decode_records  # noqa: PLC0415

        try:
            _, records = decode_records(view, position)  # checks CRC and that the payload holds record_count rows
        except CorruptRecordError as error:
            raise InvalidRecordError(f"batch failed validation: {error}") from None
        if keyed and records.column(0).null_count:
            raise InvalidRecordError(
                f"a compacted topic (cleanup.policy={self.config.cleanup_policy}) takes only records with a key; "
                f"{records.column(0).null_count} of the batch's {header.record_count} have none"
            )
        return header

    def append(self, batch, *, leader_epoch: int = bh.NO_LEADER_EPOCH) -> AppendResult:
        """Append one batch as leader: assign offsets from the log end and stamp ``leader_epoch``.

        ``batch`` is one framed batch (bytes, memoryview or a uint8 numpy array).
        Raises RecordTooLargeError / InvalidRecordError before writing anything.
        """
        self._check_open()
        view = _byte_view(batch)
        header = self._validate_incoming(view, keyed=self.config.compact)
        if header.size_bytes != len(view):
            raise InvalidRecordError(f"expected one batch of {header.size_bytes} bytes, got {len(view)} bytes")
        if header.is_control:
            raise InvalidRecordError("a control batch (a transaction marker) is written by the transaction coordinator only")
        if header.is_transactional and header.producer_id == bh.NO_PRODUCER_ID:
            raise InvalidRecordError("a transactional batch needs the producer id of its transactional producer")
        duplicate_of = self.producer_state.check(header)
        if duplicate_of is not None:
            # The timestamp as stored: on a LogAppendTime topic the append time of the original.
            base, max_timestamp_ms = duplicate_of
            last = base + header.record_count - 1
            return AppendResult(base, last, header.record_count, max_timestamp_ms, self.log_end_offset, duplicate=True)
        base_offset = self.log_end_offset
        append_time = self.clock_ms() if self.config.message_timestamp_type == LOG_APPEND_TIME else None
        new_header_bytes, payload = bh.with_offset_and_epoch(view, base_offset, leader_epoch, append_time)
        stamped = header.stamped(base_offset, leader_epoch) if append_time is None else bh.unpack_header(new_header_bytes)
        self._write(stamped, [new_header_bytes, payload])
        return AppendResult(base_offset, stamped.last_offset, stamped.record_count, stamped.max_timestamp_ms, self.log_end_offset)

    def append_marker(
        self,
        producer_id: int,
        producer_epoch: int,
        commit: bool,
        coordinator_epoch: int,
        *,
        leader_epoch: int = bh.NO_LEADER_EPOCH,
        timestamp_ms: int | None = None,
    ) -> AppendResult:
        """Append a transaction marker as leader: the COMMIT (``commit``) or ABORT control batch of
        ``producer_id``'s transaction, at the log end (see record_batch.encode_control_batch).

        ProducerFencedError if ``producer_epoch`` is older than the producer's
        epoch here. A producer with no ongoing transaction here gets its
        marker all the same (as in Kafka: it moves the producer's epoch here);
        an ABORT marker adds an entry to the transaction index only when it
        ends a transaction. ``timestamp_ms``: the coordinator's time (default:
        this log's clock; a LogAppendTime topic stamps the append time anyway).
        """
        from logbus.storage.record_batch import encode_control_batch  # noqa: PLC0415 (Arrow, only for markers)

        self._check_open()
        if isinstance(producer_id, bool) or not isinstance(producer_id, int) or producer_id < 0:
            raise InvalidRecordError(f"a transaction marker needs a producer id, not {producer_id!r}")
        self.producer_state.check_marker(producer_id, producer_epoch)
        now_ms = self.clock_ms()
        batch = encode_control_batch(producer_id, producer_epoch, bool(commit), coordinator_epoch, now_ms if timestamp_ms is None else timestamp_ms)
        base_offset = self.log_end_offset
        append_time = now_ms if self.config.message_timestamp_type == LOG_APPEND_TIME else None
        new_header_bytes, payload = bh.with_offset_and_epoch(batch, base_offset, leader_epoch, append_time)
        stamped = bh.unpack_header(new_header_bytes)
        self._write(stamped, [new_header_bytes, payload], commit=bool(commit))
        return AppendResult(base_offset, stamped.last_offset, stamped.record_count, stamped.max_timestamp_ms, self.log_end_offset)

    def append_as_follower(self, batches, first_offset: int | None = None, next_offset: int | None = None) -> AppendResult | None:
        """Append whole batches copied from the leader, keeping their offsets and epochs.

        Every batch must continue the log exactly (base offset == log end
        offset), with two exceptions, both about offsets the leader no longer
        has. ``first_offset`` and ``next_offset`` are the leader's fetch reply's
        (the offsets it covers, see :class:`ReadResult`): when the reply covers
        the log end, a batch may start past it (the offsets between were
        compacted on the leader), and an empty reply whose ``next_offset`` is
        past the log end moves the log end there. And an empty log whose end is
        inside the first batch (it was started at the leader's log start, which
        delete_records moved inside a batch) starts again at that batch, its log
        start offset unchanged. Returns None when no batch was appended.
        """
        self._check_open()
        view = _byte_view(batches)
        covered = first_offset is not None and first_offset <= self.log_end_offset
        position = 0
        first = last = None
        while position < len(view):
            header = self._validate_copied(view, position)
            end = self.log_end_offset
            gap = header.base_offset > end and covered
            data = view[position : position + header.size_bytes]
            if header.base_offset < end <= header.last_offset and first is None and self._is_empty():
                self._start_at_batch(header, data)
            elif header.base_offset != end and not gap:
                raise InvalidRecordError(
                    f"batch at offset {header.base_offset} does not continue the log at {self.log_end_offset}"
                )
            else:
                if gap:
                    self._allow_gaps()
                self._write(header, [data], allow_gap=gap)
            first = first or header
            last = header
            position += header.size_bytes
        if last is None:
            if covered and next_offset is not None and next_offset > self.log_end_offset:
                self._allow_gaps()
                self._roll_to(next_offset)
            return None
        return AppendResult(
            first.base_offset, last.last_offset, last.next_offset - first.base_offset, last.max_timestamp_ms, self.log_end_offset
        )

    def _start_at_batch(self, header: bh.BatchHeader, data: memoryview) -> None:
        """An empty log whose end lies inside ``header``'s batch takes the whole batch: its empty
        segment is replaced by one at the batch's base offset. If the batch does not go in, the log
        is rolled back to where it ended (if even that fails, it stays empty at the batch's base
        offset, where the next copy of the batch continues it)."""
        end = self.log_end_offset
        try:
            self._roll_to(header.base_offset)
            self._write(header, [data])
        except StorageError:
            if not self._closed and self.log_end_offset != end:
                try:
                    self._roll_to(end)
                except StorageError as error:
                    logger.warning("%s; the log stays empty at offset %d", error, self.log_end_offset)
            raise

    def _is_empty(self) -> bool:
        return len(self.segments) == 1 and self.active_segment.is_empty

    def _write(self, header: bh.BatchHeader, parts: list, allow_gap: bool = False, commit: bool | None = None) -> None:
        """Write one batch, all or nothing (see the write contract in the module docstring).

        A control batch's marker type is ``commit`` (read from its record when None: a copied one).
        """
        aborted = None
        end_before = self.log_end_offset
        if header.is_control:
            if commit is None:
                try:
                    commit = self._marker_commits(parts[0] if len(parts) == 1 else b"".join(bytes(p) for p in parts))
                except CorruptRecordError as error:
                    raise InvalidRecordError(f"control batch at offset {header.base_offset} is not a marker: {error}") from None
            aborted = self._aborted_entry(header, commit)
        self._maybe_roll(header)
        active = self.active_segment
        tail = active.tail()
        epochs = self.epochs.entries
        active.append(header, parts, allow_gap, aborted)  # all or nothing
        try:
            # A follower's first batch may start below its log start (append_as_follower): its epoch
            # starts, in this log, at the log start, as open would clamp it.
            self.epochs.assign(header.leader_epoch, max(header.base_offset, self.log_start_offset))
            policy = self.config.flush_policy
            if policy == "batch":
                active.flush(indexes=False)
            elif policy == "interval":
                self.maybe_flush()
        except StorageError:
            active.restore(tail)
            self.epochs.entries = epochs  # the file may hold the new entry: it starts at the log end, so open drops it
            raise
        self.producer_state.update(header, self.clock_ms())
        active.release_page_cache(self.config.cache_tail_bytes)
        self._check_appended(header, end_before, allow_gap)

    def _maybe_roll(self, incoming: bh.BatchHeader) -> None:
        active = self.active_segment
        if active.is_empty:
            return
        now = self.clock_ms()
        too_big = active.size_bytes + incoming.size_bytes > self.config.segment_bytes
        too_old = active.first_timestamp_ms is not None and now - self._segment_birth_ms(active) >= self.config.segment_ms
        if not active.can_hold(incoming) and incoming.base_offset > self.log_end_offset:
            self._roll_to(incoming.base_offset)  # past a gap too wide for the segment's relative offsets
        elif too_big or too_old or not active.can_hold(incoming):
            self.roll()

    def _segment_birth_ms(self, segment: LogSegment) -> int:
        return segment.first_timestamp_ms if segment.first_timestamp_ms is not None else self.clock_ms()

    def roll(self) -> LogSegment:
        """Start a new active segment at the log end offset (syncing the old one)."""
        self._check_open()
        active = self.active_segment
        if active.is_empty:
            return active
        return self._roll_to(self.log_end_offset)

    def _new_segment(self, base_offset: int) -> LogSegment:
        """An empty segment at ``base_offset``. Files a deleted segment left at that base offset go
        first (its index files are cut before their first write: offset_index.py). StorageError if
        that or the creation fails: then no segment was made."""
        for suffix in (SUMMARY_SUFFIX, TXN_INDEX_SUFFIX):
            # A summary would make the new segment look like a cleaned one; a transaction index (read on
            # open when its entries look possible) would name another segment's markers.
            leftover = self._path(segment_file_name(base_offset, suffix))
            if os.path.exists(leftover):
                try:
                    os.unlink(leftover)
                except OSError as error:
                    raise StorageError(f"removing {leftover}, left by a deleted segment, failed: {error}") from error
        segment = LogSegment(self.directory, base_offset, self.config.index_interval_bytes)
        if not segment.is_empty:  # a leftover file at this base offset cannot be ours
            segment.delete()
            segment = LogSegment(self.directory, base_offset, self.config.index_interval_bytes)
        return segment

    def _roll_to(self, base_offset: int) -> LogSegment:
        """Make an empty active segment at ``base_offset`` (at or past the log end; past it only in a
        log that may have gaps, or an empty log): an empty active segment is replaced, else the
        active one is synced and a new one added.

        Steps: sync the active segment (if it holds batches), create the new one's log file,
        delete an empty active segment it replaces, write the recovery point. A failure in the
        first three changes nothing (a file made is removed again); after them the roll stands,
        and a recovery point not written only makes the next open scan more. StorageError either way.
        """
        active = self.active_segment
        if active.is_empty and active.base_offset == base_offset:
            return active
        if not active.is_empty:
            active.flush()
        segment = self._new_segment(base_offset)
        if active.is_empty:
            try:
                active.delete()
            except StorageError:
                self._discard_new_segment(segment)
                raise
            self.segments[-1] = segment
            self._bases[-1] = base_offset
        else:
            self._add_segment(segment)
        self._expire_producers()  # the roll stands: work the log does anyway, so expiry rides on it
        self._write_recovery_point(segment.base_offset)
        return segment

    def _discard_new_segment(self, segment: LogSegment) -> None:
        """Remove a segment just made and not yet in the log (a later step of its operation failed).

        If it cannot be removed, it is empty, and open drops it if it lies below the active segment
        (an empty segment before the last) or, in a log without gaps, past the log end (it does not
        continue the log): then nothing changed. Else the log is read back from disk.
        """
        try:
            segment.delete()
        except StorageError as error:
            segment.close()
            base = segment.base_offset
            if base < self.active_segment.base_offset or (not self._gaps and base > self.log_end_offset):
                logger.warning("%s; the next open removes it", error)
            else:
                logger.warning("%s; taking the log as it is on disk", error)
                self._resync()

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
        batches returned. In a compacted log, a read at an offset in a gap
        starts with the next batch; when only a gap lies between ``offset`` and
        the bound, the result holds no batch and its ``next_offset`` is past the
        gap (see :class:`ReadResult`). Returns None when there is nothing at or
        after ``offset`` yet (``offset`` == log end, or everything is above
        ``max_offset``). Raises OffsetOutOfRangeError below the log start or
        past the log end, and CorruptRecordError if a stored batch fails its CRC
        (checked unless ``verify_crc`` is False: for readers that check it themselves).
        """
        self._check_open()
        self._check_offset(offset)
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        end = self.log_end_offset if max_offset is None else min(max_offset, self.log_end_offset)
        if offset >= end:
            return None
        i = max(0, bisect.bisect_right(self._bases, offset) - 1)
        for segment in self.segments[i:]:
            found = segment.read(offset, max_bytes, max_offset, verify_crc)
            if found is not None:
                data, first_offset, next_offset = found
                return ReadResult(data, min(first_offset, offset), next_offset)
            located = segment.find_batch(offset) if offset < segment.next_offset else None
            if located is not None:
                # Held by this segment, but above max_offset. A gap before that batch is passed.
                gap_end = min(located[1].base_offset, end)
                return ReadResult(_NO_BYTES, offset, gap_end) if gap_end > offset else None
        return ReadResult(_NO_BYTES, offset, end)  # only a gap from ``offset`` to the end

    # --- transactions -----------------------------------------------------------------------------

    def first_unstable_offset(self) -> int | None:
        """The first offset of the oldest ongoing transaction, or None when none is ongoing. The
        leader's last stable offset is the smaller of this and its high watermark."""
        return self.producer_state.first_unstable_offset()

    def aborted_transactions(self, start: int, end: int) -> list[tuple[int, int]]:
        """(producer id, first offset) of each aborted transaction overlapping ``[start, end)``: its
        ABORT marker at or after ``start``, its first offset below ``end``; in marker order. From the
        transaction indexes of the segments from the one holding ``start`` on, without reading
        batches (see txn_index.py for where the search stops)."""
        return [(entry.producer_id, entry.first_offset) for entry in self.aborted_txns(start, end)]

    def aborted_txns(self, start: int, end: int) -> list[AbortedTxn]:
        """The entries behind :meth:`aborted_transactions` (their markers' offsets too)."""
        self._check_open()
        found: list[AbortedTxn] = []
        if end <= start:
            return found
        i = max(0, bisect.bisect_right(self._bases, start) - 1)
        for segment in self.segments[i:]:
            entries, complete = segment.txn_index.collect(start, end)
            found += entries
            if complete:
                break
        return found

    def _forget_deleted_transactions(self) -> None:
        """After the oldest segments went: an ongoing transaction that began in them now begins at its
        first batch left, or, with none left, is no longer known here (what an open would find)."""
        base = self.segments[0].base_offset
        lost = {producer_id for producer_id, first in self.producer_state.ongoing.items() if first < base}
        found: dict[int, int] = {}
        for segment in self.segments:
            if len(found) == len(lost):
                break
            view = segment._view()
            for _, header in bh.iter_headers(view, 0, segment.size_bytes):
                if header.producer_id in lost and header.producer_id not in found and header.is_transactional and not header.is_control:
                    found[header.producer_id] = header.base_offset
            del view
        for producer_id in lost:
            self.producer_state.move_transaction_start(producer_id, found.get(producer_id))

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """The earliest offset (from the log start) whose record timestamp is >= ``timestamp_ms``, or None."""
        self._check_open()
        start = self.log_start_offset
        for segment in self.segments:
            if segment.next_offset <= start:
                continue
            offset = segment.offset_for_timestamp(timestamp_ms, start)
            if offset is not None:
                return offset
        return None

    # --- truncation and retention ----------------------------------------------------------------

    def truncate_to(self, offset: int) -> int:
        """Remove every batch that holds an offset >= ``offset`` (batches go whole); return the new log end.

        Used by replication when a follower must drop a divergent tail. Never
        goes below the log start offset: if the batch holding it would go
        (delete_records moved it inside a batch), the log is emptied at its
        start instead (:meth:`truncate_fully_and_start_at`). The segments past ``offset`` are
        deleted newest first, then the active one is cut: each step is all or
        nothing, so a failure (StorageError) leaves a shorter log that is
        still whole, and what memory derives from the log follows it; the
        state files written after that are each harmless when stale.
        """
        self._check_open()
        if offset >= self.log_end_offset:
            return self.log_end_offset
        start = self.log_start_offset
        offset = max(offset, start)
        found = self.segments[max(0, bisect.bisect_right(self._bases, offset) - 1)].find_batch(offset)
        # Where the log must end: at the start of the batch holding ``offset`` (None: in a gap, or
        # past the last batch, it ends somewhere at or below ``offset``).
        cut = found[1].base_offset if found is not None and found[1].base_offset <= offset else None
        if found is not None and found[1].base_offset < start:
            # The batch to cut holds the log start (delete_records moved it inside the batch): the
            # log would end below its start. Empty it at its start instead, as a follower started
            # there is (it takes that batch whole again, see append_as_follower).
            self.truncate_fully_and_start_at(start)
            return self.log_end_offset
        failure = None
        try:
            while len(self.segments) > 1 and self.segments[-1].base_offset >= offset:
                self.segments[-1].delete()  # StorageError: the segment is intact
                self.segments.pop()
                self._bases.pop()
                self.active_segment.reactivate()
            self.active_segment.truncate_to(offset)
        except StorageError as error:
            failure = error
        self._check_segments("a truncation")
        if failure is None:
            end = self.log_end_offset
            check(
                end <= offset and (cut is None or end == cut),
                f"{self.directory}: truncated to {offset}, the log ends at {end}"
                + ("" if cut is None else f", not at {cut} where the batch holding {offset} began"),
            )
        epochs = self.epochs.entries
        self.epochs.truncate_from_end(self.log_end_offset, persist=False)
        self._rebuild_producer_state()
        active_base = self.active_segment.base_offset
        steps = [
            self._trim_active_summary,
            lambda: self._write_recovery_point(min(self._read_recovery_point() or 0, active_base)),
        ]
        if self._cleaner_checkpoint > active_base:
            # What is appended from here on is new: dirty for the next cleaning.
            steps.append(lambda: self._write_cleaner_checkpoint(active_base, self._tombstones_due_ms))
        if self.epochs.entries != epochs:
            steps.append(self.epochs.save)
        _run_steps(steps, failure)
        return self.log_end_offset

    def _trim_active_summary(self) -> None:
        """After a truncation into a cleaned segment (now the active one): its summary covers the
        offsets up to the new log end only, so that what is appended from there counts by its batch
        headers (see cleaner.py). Also run on open, for a crash between the truncation and this."""
        segment = self.active_segment
        summary = self._summary_of(segment)
        if summary is None or summary.end_offset <= segment.next_offset:
            return
        end = segment.next_offset
        kept = tuple(entry for entry in summary.producers if entry[4] < end)
        replace_summary(segment.summary_path, SegmentSummary(end, kept, tuple(m for m in summary.markers if m[0] < end)))

    def truncate_fully_and_start_at(self, offset: int) -> None:
        """Delete every segment and start an empty log at ``offset`` (a follower far behind the leader's start).

        The segments go oldest first, then the new empty one is made and the
        last old one deleted: every step is all or nothing and leaves a log
        that is whole (a shorter one), so after a failure (StorageError)
        memory follows what was done, and a retry finishes the work.
        """
        self._check_open()
        failure = None
        try:
            while len(self.segments) > 1:
                self._delete_oldest(persist_epochs=False, follow_transactions=False)
            last = self.active_segment
            if last.base_offset == offset:
                last.truncate_to(offset)
            else:
                segment = self._new_segment(offset)
                try:
                    last.delete()
                except StorageError:
                    self._discard_new_segment(segment)
                    raise
                self.segments[-1] = segment
                self._bases[-1] = offset
        except StorageError as error:
            failure = error
            if self._closed:  # reading the log back failed too (see _resync)
                raise
        if failure is None:
            self._check_segments("a truncation to a new start")
            check(
                len(self.segments) == 1 and self.active_segment.is_empty and self.log_end_offset == offset,
                f"{self.directory}: started again at {offset}, the log holds {len(self.segments)} segments and ends at {self.log_end_offset}",
            )
            self.epochs.entries = []
            self.producer_state.clear()
            steps = [
                lambda: self._write_recovery_point(offset),
                lambda: self._set_log_start(offset),
                lambda: self._write_cleaner_checkpoint(offset, None),
                self.epochs.save,
            ]
        else:
            self.epochs.clamp(self.log_start_offset, self.log_end_offset)
            self._rebuild_producer_state()
            steps = [self.epochs.save]
        _run_steps(steps, failure)

    def _set_log_start(self, offset: int) -> None:
        def adopt() -> None:
            self._log_start = offset

        self._write_state(LOG_START_OFFSET_FILE, f"{offset}\n", adopt)

    def delete_records(self, offset: int) -> int:
        """Kafka's DeleteRecords: make ``offset`` the log start offset; returns the log start offset.

        Records below it can no longer be read (OffsetOutOfRangeError), and
        segments wholly below it are deleted (never the active one). An
        offset at or below the log start changes nothing; one past the log end
        raises OffsetOutOfRangeError. The caller (the leader) bounds it by the
        high watermark; followers follow their leader's log start.
        """
        self._check_open()
        if isinstance(offset, bool) or not isinstance(offset, int) or offset > self.log_end_offset:
            raise OffsetOutOfRangeError(f"cannot delete records below {offset!r}: the log ends at {self.log_end_offset}")
        failure = None
        start_before = self.log_start_offset
        if offset > start_before:
            try:
                self._set_log_start(offset)
            except StorageError as error:
                if self._log_start != offset:
                    raise  # the file kept the old log start: nothing changed
                failure = error  # only the directory's sync failed: the new log start stands
        # The rest also completes a call that failed part way before.
        try:
            _run_steps([self._clamp_epochs, self._delete_below_log_start], failure)
        finally:
            # Whether or not a segment's deletion failed: the log start went to the offset (forward only).
            start = self.log_start_offset
            check(
                start == max(start_before, offset) and self.segments[0].base_offset <= start
                and (start == start_before or start <= self.log_end_offset),
                f"{self.directory}: delete_records({offset}) moved the log start from {start_before} to {start} "
                f"(first segment at {self.segments[0].base_offset}, log end {self.log_end_offset})",
            )
            self._check_segments("delete_records")
        return start

    def _clamp_epochs(self, persist: bool = True) -> None:
        """Keep the epochs inside the log, as open does (leader_epoch_cache.py): in memory whatever
        the checkpoint's write does, as open would drop the others from the file too."""
        epochs = self.epochs.entries
        self.epochs.clamp(self.log_start_offset, self.log_end_offset)
        if persist and self.epochs.entries != epochs:
            self.epochs.save()

    def _delete_below_log_start(self) -> None:
        while len(self.segments) > 1 and self.segments[1].base_offset <= self.log_start_offset:
            self._delete_oldest()

    def enforce_retention(self) -> int:
        """Delete whole old segments past retention.ms or retention.bytes; return how many went.

        Only for cleanup.policy "delete" (alone or with "compact").
        """
        self._check_open()
        now = self.clock_ms()
        config = self.config
        deleted = len(self.segments)
        self._delete_below_log_start()  # left by a delete_records that failed part way
        deleted -= len(self.segments)
        if not config.delete:
            return deleted
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
        if config.remote_storage_enable:
            deleted += self._enforce_local_retention(now)
        if deleted:
            self._check_segments("retention")
        return deleted

    def _uploaded(self, segment: LogSegment) -> bool:
        return self.tiered_offset is not None and segment.next_offset <= self.tiered_offset

    def _enforce_local_retention(self, now: int) -> int:
        """With a remote tier: delete the oldest segments the tier holds past local.retention.ms / .bytes."""
        local_ms, local_bytes = self.config.local_retention
        deleted = 0
        if local_ms >= 0:
            while len(self.segments) > 1 and self._uploaded(self.segments[0]) and now - self.segments[0].max_timestamp_ms > local_ms:
                self._delete_oldest()
                deleted += 1
        if local_bytes >= 0:
            total = self.size_bytes
            while len(self.segments) > 1 and self._uploaded(self.segments[0]) and total - self.segments[0].size_bytes >= local_bytes:
                total -= self.segments[0].size_bytes
                self._delete_oldest()
                deleted += 1
        return deleted

    def next_retention_ms(self) -> int | None:
        """The clock time (ms) at which :meth:`enforce_retention` will next have something to delete
        by ``retention.ms``, or None (time retention off, or nothing written). Owners arm one timer
        for it instead of checking periodically."""
        if self._closed or not self.config.delete:
            return None
        local_ms = self.config.local_retention[0]
        if self.config.remote_storage_enable and local_ms >= 0 and len(self.segments) > 1 and self._uploaded(self.segments[0]):
            due = self.segments[0].max_timestamp_ms + local_ms + 1
            if self.config.retention_ms >= 0:
                due = min(due, self.segments[0].max_timestamp_ms + self.config.retention_ms + 1)
            return due
        if self.config.retention_ms < 0:
            return None
        if len(self.segments) > 1:
            return self.segments[0].max_timestamp_ms + self.config.retention_ms + 1
        if not self.active_segment.is_empty:
            return self.active_segment.max_timestamp_ms + self.config.retention_ms + 1
        return None

    def _delete_oldest(self, persist_epochs: bool = True, follow_transactions: bool = True) -> None:
        """Delete the first segment (StorageError: it is intact); the epochs before the new log start go,
        in memory whatever the checkpoint's write does (open drops them too), and so do the starts of
        the ongoing transactions it held (``_forget_deleted_transactions``)."""
        self.segments[0].delete()
        self.segments.pop(0)
        self._bases.pop(0)
        if follow_transactions:
            first = self.producer_state.first_unstable_offset()
            if first is not None and first < self.segments[0].base_offset:
                self._forget_deleted_transactions()
        self._clamp_epochs(persist_epochs)

    # --- compaction (see cleaner.py) --------------------------------------------------------------

    def _cleanable(self, upper_bound: int | None, now_ms: int) -> tuple[list[SourceSegment], int | None]:
        """The closed segments a cleaning may rewrite now, and when the next one leaves
        min.compaction.lag.ms behind (None: none is held back by it)."""
        bound = self.active_segment.base_offset if upper_bound is None else min(upper_bound, self.active_segment.base_offset)
        lag_ms = self.config.min_compaction_lag_ms
        sources = []
        for segment, following in zip(self.segments, self.segments[1:]):
            if following.base_offset > bound:
                return sources, None
            if lag_ms > 0 and now_ms - segment.max_timestamp_ms < lag_ms:
                return sources, segment.max_timestamp_ms + lag_ms
            summary = segment.summary_path if os.path.exists(segment.summary_path) else None
            sources.append(SourceSegment(segment, segment.base_offset, following.base_offset, segment.log_path, segment.size_bytes, summary))
        return sources, None

    def cleaning_plan(self, upper_bound: int | None = None) -> CleaningPlan | None:
        """What a cleaning would rewrite now (see cleaner.py), or None if it is not due.

        ``upper_bound``: no record at or above it is cleaned or read for the
        offset map (the high watermark: a follower may still truncate above it).
        Due when the topic is compacted, some closed segments may be cleaned,
        and either the dirty ones (from the cleaner checkpoint on) hold at least
        min.cleanable.dirty.ratio of their bytes or a tombstone kept by the last
        cleaning is due to go.
        """
        if self._closed or not self.config.compact:
            return None
        now = self.clock_ms()
        unstable = self.first_unstable_offset()
        if unstable is not None:  # nothing at or above the LSO: its transactions may still abort
            upper_bound = unstable if upper_bound is None else min(upper_bound, unstable)
        sources, _ = self._cleanable(upper_bound, now)
        if not sources:
            return None
        first_dirty = max(self._cleaner_checkpoint, sources[0].base_offset)
        dirty = [s for s in sources if s.base_offset >= first_dirty]
        dirty_bytes = sum(s.size_bytes for s in dirty)
        total_bytes = sum(s.size_bytes for s in sources)
        ratio_met = dirty_bytes > 0 and dirty_bytes >= self.config.min_cleanable_dirty_ratio * total_bytes
        tombstones_due = self._tombstones_due_ms is not None and self._tombstones_due_ms <= now
        if not (ratio_met or tombstones_due):
            return None
        end = sources[-1].end_offset
        aborted = tuple((t.producer_id, t.first_offset, t.last_offset) for t in self.aborted_txns(sources[0].base_offset, end))
        return CleaningPlan(
            self.directory, group_segments(sources, self.config.segment_bytes), tuple(dirty), self.log_start_offset,
            now, self.config.delete_retention_ms, self.config.index_interval_bytes, aborted,
        )

    def next_cleaning_ms(self) -> int | None:
        """The clock time (ms) from which :meth:`cleaning_plan` may have work (now, if it has some when
        the high watermark allows), or None: owners arm one timer for it instead of checking."""
        if self._closed or not self.config.compact:
            return None
        now = self.clock_ms()
        if self.cleaning_plan() is not None:
            return now
        _, lag_ends = self._cleanable(None, now)
        due = [t for t in (lag_ends, self._tombstones_due_ms) if t is not None and t > now]
        return min(due) if due else None

    def replace_segments(self, cleaned: CleanedSegment) -> bool:
        """Swap a cleaned segment in for the segments it was made from (on disk and here), if they are
        still the log's, unchanged; False (and the cleaned files are removed) if they are not.

        Called by the log's owner, like every other method; the swap is atomic
        on disk (see cleaner.py). StorageError if a step fails: before the swap
        commits, the log is as it was (the cleaned files are removed); after,
        the log is read back from disk, which completes the swap (:meth:`_resync`).
        """
        sources = cleaned.sources
        position = next((i for i, s in enumerate(self.segments) if s is sources[0].segment), None)
        current = (
            not self._closed
            and position is not None
            and len(self.segments) > position + len(sources)
            and all(
                self.segments[position + k] is source.segment and source.segment.size_bytes == source.size_bytes
                for k, source in enumerate(sources)
            )
            and self.segments[position + len(sources)].base_offset == cleaned.end_offset
        )
        if not current or not cleaned.changed:
            discard(cleaned)
            return current
        try:
            self._allow_gaps()
        except StorageError:
            discard(cleaned)
            raise
        try:
            commit_swap(cleaned)
        except StorageError:
            if cleaned.state == "written":  # not committed: the log is as it was
                discard(cleaned)
            else:
                self._resync()  # committed, not yet durable: take what is on disk
            raise
        for source in sources:
            source.segment.close()
        try:
            finish_swap(cleaned)
            segment = LogSegment.open_existing(self.directory, cleaned.base_offset, self.config.index_interval_bytes, allow_gaps=True)
        except (StorageError, CorruptRecordError, OSError):
            self._resync()  # the swap committed: open completes it
            raise
        end = position + len(sources)
        self.segments[position:end] = [segment]
        self._bases[position:end] = [segment.base_offset]
        self._check_segments("a cleaning's swap")
        return True

    def _resync(self) -> None:
        """Take the log as it is on disk, as on open (after an operation on several files failed half
        way, e.g. a cleaning's swap). If even that fails, the log closes itself: every later call
        raises StorageError, and the log's owner opens it again."""
        previous = self.segments
        for segment in previous:
            segment.close()
        self.segments, self._bases = [], []
        try:
            self._load()
        except (StorageError, CorruptRecordError, OSError) as error:
            for segment in self.segments:
                segment.close()
            # Closed, the log still answers its offsets as they last were.
            self.segments, self._bases = previous, [segment.base_offset for segment in previous]
            self._closed = True
            self._failure = f"after a failed write, reading it back from disk failed: {error}"
            raise StorageError(f"log {self.directory} {self._failure}") from error

    def finish_cleaning(self, plan: CleaningPlan, cleaned: list[CleanedSegment]) -> None:
        """After every group of ``plan`` was swapped in: the segments up to its end are clean now."""
        dues = [c.tombstones_due_ms for c in cleaned if c.tombstones_due_ms is not None]
        self._write_cleaner_checkpoint(max(self._cleaner_checkpoint, plan.end_offset), min(dues) if dues else None)

    def _write_cleaner_checkpoint(self, first_dirty: int, tombstones_due_ms: int | None) -> None:
        due = -1 if tombstones_due_ms is None else tombstones_due_ms

        def adopt() -> None:
            self._cleaner_checkpoint, self._tombstones_due_ms = first_dirty, tombstones_due_ms

        self._write_state(CLEANER_CHECKPOINT_FILE, f"{first_dirty} {due}\n", adopt)

    def clean(self, upper_bound: int | None = None) -> list[CleanedSegment]:
        """Run one cleaning now if one is due, in this thread (owners that must keep serving run
        :func:`~logbus.storage.cleaner.build_offset_map` and ``clean_group`` in a thread instead).
        Returns the cleaned segments (empty if none was due)."""
        plan = self.cleaning_plan(upper_bound)
        if plan is None:
            return []
        offset_map = build_offset_map(plan)
        done = []
        for group in plan.groups:
            cleaned = clean_group(plan, group, offset_map)
            if not self.replace_segments(cleaned):
                return done
            done.append(cleaned)
        self.finish_cleaning(plan, done)
        return done

    # --- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Sync and close every file; the log can be reopened from its directory."""
        if self._closed:
            return
        try:
            self.active_segment.flush()
            self._write_recovery_point(self.log_end_offset)
        finally:  # closed whatever failed: the next open recovers from what is on disk
            for segment in self.segments:
                segment.close()
            self._closed = True

    def delete(self) -> None:
        """Remove the log's files and directory."""
        for segment in self.segments:
            segment.delete()
        self._closed = True
        names = (RECOVERY_POINT_FILE, LOG_START_OFFSET_FILE, CLEANER_CHECKPOINT_FILE, OFFSET_GAPS_FILE, self.epochs.path)
        for name in names + tuple(name + ".tmp" for name in names):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def _run_steps(steps: list[Callable[[], None]], failure: StorageError | None = None) -> None:
    """Run every step, even after one failed (each leaves the log whole on its own); then raise the
    first StorageError, ``failure`` if given."""
    for step in steps:
        try:
            step()
        except StorageError as error:
            failure = failure or error
    if failure is not None:
        raise failure


def _byte_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view

