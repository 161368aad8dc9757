"""Write faults: each write call the storage layer makes fails in turn, as a full disk (ENOSPC) or
a failing one (EIO) would fail it, once or from then on.

For every write call N of an operation (an append, with and without a roll, a new epoch and each
flush policy; a transaction marker, which also writes the aborted-transaction index; a follower's
first batch; truncate_to; truncate_fully_and_start_at; delete_records; a cleaning; close): the operation raises StorageError naming a file, or succeeds; what the log
holds in memory is what an open of its files would find if the process died right then; once the
fault clears, a retry and further appends work; and after a close and an open every acknowledged
record is there with its value at its offset, no offset has two values, the log end is the one
before the close, and idempotent retries are still recognised; the first unstable offset and the
aborted transactions are those of the markers acknowledged. A Hypothesis property interleaves
appends, transactional appends and markers, faults, retries, rolls, truncations, delete_records
and reopens against a model.

The faults are real failed calls at the boundary with the kernel: the storage modules' ``os`` and
``open`` are replaced by ones that count each call that writes (to a file or a directory) and fail
the chosen one. Nothing of logbus is mocked.
"""

import builtins
import errno
import functools
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from logbus.errors import OffsetOutOfRangeError, StorageError
from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage import cleaner, files, leader_epoch_cache, offset_index, partition_log, segment, txn_index
from logbus.storage import record_batch as rb
from tests.storage.conftest import FakeClock

STORAGE_MODULES = (segment, offset_index, partition_log, files, cleaner, leader_epoch_cache, txn_index)
# The os calls that write to a file or a directory; os.open and open count when they create or
# truncate a file (opening one that exists writes nothing).
WRITE_CALLS = frozenset({"pwritev", "pwrite", "write", "ftruncate", "truncate", "fsync", "fdatasync", "rename", "replace", "unlink", "remove"})
DATA_WRITES = frozenset({"pwritev", "pwrite", "write"})
CALLS_MAX = 200  # no operation here makes more write calls: a bound on each loop over N
PRODUCER_ID = 7
TXN_PRODUCER_ID = 8


# --- the disk ------------------------------------------------------------------------------------------


class DiskFaults:
    """Counts the storage modules' write calls and fails the chosen one.

    ``arm(n)``: the n-th write call from now fails (``once``), or (``persistent``) that one and
    every later one until ``clear()``, as a disk that stays full or broken; then the n-th call,
    if it writes data, first writes half of it and returns the short count, as a disk filling
    up part way through a write does.
    """

    def __init__(self):
        self.count = 0
        self.fail_at = None
        self.persistent = False
        self.errno = errno.ENOSPC
        self.fired = False
        self.paused = False
        self.only_suffix = None  # with it, only the calls writing to files whose name ends so count

    def arm(self, n, error=errno.ENOSPC, persistent=False, only_suffix=None):
        self.count, self.fail_at, self.errno, self.persistent, self.fired = 0, n, error, persistent, False
        self.only_suffix = only_suffix

    def clear(self):
        self.fail_at = None
        self.only_suffix = None

    def hit(self, name):
        """Count a write call; 'fail', 'short' or None (go ahead)."""
        if self.paused:
            return None
        self.count += 1
        if self.fail_at is None or self.count < self.fail_at or (self.count > self.fail_at and not self.persistent):
            return None
        self.fired = True
        return "short" if self.persistent and self.count == self.fail_at and name in DATA_WRITES else "fail"

    def error(self, path=None):
        return OSError(self.errno, os.strerror(self.errno), path)

    def open(self, file, mode="r", *args, **kwargs):
        """builtins.open as the storage modules see it."""
        if not any(c in mode for c in "wax+"):
            return builtins.open(file, mode, *args, **kwargs)
        if ("w" in mode or "x" in mode or not os.path.exists(file)) and self.hit("open"):
            raise self.error(file)
        return _FaultyFile(builtins.open(file, mode, *args, **kwargs), self)


class _FaultyFile:
    def __init__(self, file, faults):
        self._file, self._faults = file, faults

    def write(self, data):
        if self._faults.hit("write"):
            raise self._faults.error(self._file.name)
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


class _FaultyOS:
    """The os module, with its write calls counted and failed on demand."""

    def __init__(self, faults):
        self._faults = faults

    def __getattr__(self, name):
        real = getattr(os, name)
        if name in WRITE_CALLS or name == "open":
            return functools.partial(self._call, name, real)
        return real

    def _call(self, name, real, *args, **kwargs):
        if name == "open" and not (args[1] & os.O_TRUNC or (args[1] & os.O_CREAT and not os.path.exists(args[0]))):
            return real(*args, **kwargs)
        suffix = self._faults.only_suffix
        if suffix is not None:
            path = args[0] if isinstance(args[0], str) else os.readlink(f"/proc/self/fd/{args[0]}")
            if not path.endswith(suffix):
                return real(*args, **kwargs)
        outcome = self._faults.hit(name)
        if outcome == "short":
            if name == "pwritev":
                fd, buffers, position = args
                data = b"".join(bytes(b) for b in buffers)
                return os.pwrite(fd, data[: len(data) // 2], position)
            if name == "pwrite":
                fd, data, position = args
                return os.pwrite(fd, bytes(data)[: len(data) // 2], position)
            fd, data = args
            return os.write(fd, bytes(data)[: len(data) // 2])
        if outcome == "fail":
            raise self._faults.error(args[0] if isinstance(args[0], str) else None)
        return real(*args, **kwargs)


@pytest.fixture
def disk(monkeypatch):
    faults = DiskFaults()
    faulty_os = _FaultyOS(faults)
    for module in STORAGE_MODULES:
        monkeypatch.setattr(module, "os", faulty_os)
        monkeypatch.setattr(module, "open", faults.open, raising=False)
    return faults


# --- the model: what was acknowledged ---------------------------------------------------------------------


class Producer:
    """An idempotent producer that retries a failed batch as it was, and remembers what was acknowledged."""

    def __init__(self, keys=None, producer_id=PRODUCER_ID, transactional=False):
        self.keys = keys
        self.producer_id = producer_id
        self.transactional = transactional
        self.sequence = 0
        self.written = 0
        self.acked = {}  # offset -> value
        self.batches = []  # (base offset, first sequence, values) of each acknowledged batch
        self.pending = None  # the batch a failed append left to retry

    def send(self, log, size=2, leader_epoch=1):
        if self.pending is None:
            values = [b"r%d" % (self.written + i) for i in range(size)]
            keys = None if self.keys is None else [self.keys[(self.written + i) % len(self.keys)] for i in range(size)]
            stamps = [log.clock_ms() + self.written + i for i in range(size)]
            self.written += size
            batch = encode_batch(
                values, keys, stamps, producer_id=self.producer_id, producer_epoch=0, base_sequence=self.sequence,
                transactional=self.transactional,
            )
            self.pending = (values, batch)
        values, batch = self.pending
        result = log.append(batch, leader_epoch=leader_epoch)  # StorageError: the batch stays pending
        assert not result.duplicate, "an append that failed had written its batch"
        self.pending = None
        self.batches.append((result.base_offset, self.sequence, values))
        self.sequence += len(values)
        for i, value in enumerate(values):
            assert result.base_offset + i not in self.acked, "an offset was given twice"
            self.acked[result.base_offset + i] = value
        return result

    def retry_until_sent(self, log, leader_epoch=1):
        """After the disk healed: a pending batch goes in once, at the log end."""
        if self.pending is not None:
            end = log.log_end_offset
            assert self.send(log, leader_epoch=leader_epoch).base_offset == end

    def forget_from(self, end_offset):
        """The log was cut at ``end_offset``: what it dropped, and the sequence it now expects. (A
        truncation emptying the log at a start inside a batch removed that batch whole.)"""
        self.acked = {o: v for o, v in self.acked.items() if o < end_offset}
        self.batches = [b for b in self.batches if b[0] + len(b[2]) <= end_offset]
        self.sequence = self.batches[-1][1] + len(self.batches[-1][2]) if self.batches else 0

    def follow_sequence(self, log):
        """After a truncation or an open: the log may have forgotten the producer, when none of its
        batches is left (delete_records took them, or a truncation emptied the log at its start);
        then the producer starts its sequence again, as a real one would after its error."""
        known = log.producer_state.producers.get(self.producer_id)
        if known is None or not known.batches:
            self.sequence = 0
            # A batch that failed before is sent again with the new sequence (a real producer does,
            # after the log's OutOfOrderSequenceError): it was never acknowledged, so it is given up.
            self.pending = None
        else:
            assert known.last_sequence + 1 == self.sequence

    def check_duplicate_detection(self, log):
        """The last acknowledged batch, sent again, is recognised and not written."""
        if not self.batches:
            return
        base, sequence, values = self.batches[-1]
        if base < log.segments[0].base_offset:
            return
        keys = None if self.keys is None else [b"any"] * len(values)
        end = log.log_end_offset
        again = log.append(
            encode_batch(values, keys, producer_id=self.producer_id, producer_epoch=0, base_sequence=sequence, transactional=self.transactional),
            leader_epoch=99,
        )
        assert again.duplicate and again.base_offset == base and log.log_end_offset == end


class Markers:
    """The transaction markers of the transactional producer that were acknowledged: offset -> commit."""

    def __init__(self):
        self.acked = {}
        self.base_at = {}  # offset -> the base offset of the log's first segment when it was written

    def write(self, log, commit, leader_epoch=1):
        base = log.segments[0].base_offset
        result = log.append_marker(TXN_PRODUCER_ID, 0, commit, 0, leader_epoch=leader_epoch)  # StorageError: not written
        assert result.base_offset not in self.acked
        self.acked[result.base_offset] = commit
        self.base_at[result.base_offset] = base
        return result

    def forget_from(self, end_offset):
        self.acked = {o: c for o, c in self.acked.items() if o < end_offset}


def read_all(log, markers=None):
    """{offset: value} of every data record from the log start, following each read's next offset
    (with ``markers``, {offset: commit} of each marker goes there)."""
    offset, out = log.log_start_offset, {}
    while (result := log.read(offset, 1 << 20)) is not None:
        for header, first, records in rb.slice_batches(result.data, offset):
            if header.is_control:
                assert markers is not None, "a marker no one wrote"
                markers[first] = rb.control_record(records)[0]
                continue
            for i, value in enumerate(records.column("value").to_pylist()):
                assert first + i not in out
                out[first + i] = value
        offset = result.next_offset
    return out


def check_content(log, producer, txn=None, markers=None):
    """Every acknowledged record from the log start on, with its value at its offset, and nothing else
    (the transactional producer's records and markers too, when given; then the first unstable offset
    and the aborted transactions are those the acknowledged ones make)."""
    start = log.log_start_offset
    acked = dict(producer.acked)
    if txn is not None:
        acked.update(txn.acked)
    found_markers = {}
    assert read_all(log, found_markers) == {o: v for o, v in acked.items() if o >= start}
    expected_markers = {} if markers is None else markers.acked
    assert found_markers == {o: c for o, c in expected_markers.items() if o >= start}
    if acked or expected_markers:
        assert log.log_end_offset == max(list(acked) + list(expected_markers)) + 1
    if txn is not None:
        check_transactions(log, txn, markers)


def check_transactions(log, txn, markers):
    """The log's first unstable offset and aborted transactions, from what was acknowledged: a
    transaction starts with the first transactional batch after a marker and ends with the next marker.
    Segments deleted (retention, delete_records) take the start of a transaction with them: from
    then on it starts at its first batch left, and a transaction with none left is not known (its
    marker ends nothing)."""
    segment_base = log.segments[0].base_offset
    bases = sorted(base for base, _, _ in txn.batches)
    previous, aborted = -1, []
    for offset in sorted(markers.acked):
        floor = markers.base_at[offset]  # the segments deleted before the marker
        first = min((b for b in bases if previous < b < offset and b >= floor), default=None)
        if first is not None and not markers.acked[offset] and offset >= segment_base:  # (an entry goes with its marker's segment)
            aborted.append((TXN_PRODUCER_ID, first))
        previous = offset
    ongoing = min((b for b in bases if b > previous and b >= segment_base), default=None)
    assert log.first_unstable_offset() == ongoing
    assert log.aborted_transactions(0, log.log_end_offset + 1) == aborted


def state(log):
    """What the log holds in memory, as recovery would rebuild it from the files."""
    segments = [
        (
            s.base_offset, s.size_bytes, s.next_offset, s.max_timestamp_ms, s.first_timestamp_ms,
            [s.offset_index.entry(i) for i in range(len(s.offset_index))],
            [s.time_index.entry(i) for i in range(len(s.time_index))],
            s.txn_index.entries(),
        )
        for s in log.segments
    ]
    # Retention and delete_records remove segments but (as before) not the producers they held from
    # memory; an open knows only the producers of the segments left. Compare those.
    first = log.segments[0].base_offset
    producers = sorted(e for e in log.producer_state.entries() if e[4] >= first)
    return {
        "log": (log.log_start_offset, log.log_end_offset, log._gaps),
        "segments": segments,
        "next index entry": log.active_segment._bytes_since_index_entry,
        "epochs": list(log.epochs.entries),
        "producers": producers,
        "ongoing transactions": sorted(log.producer_state.ongoing.items()),
        "cleaner": (log._cleaner_checkpoint, log._tombstones_due_ms),
    }


def cut_pending(log):
    """A failed write's bytes still wait to be cut (the disk refused the cut too)."""
    return any(
        s._cut_pending or s.offset_index._cut_pending or s.time_index._cut_pending or s.txn_index._cut_pending for s in log.segments
    )


def check_recovers_to_memory(log, disk, directory):
    """Copy the log's files as they are now (a crash) and open the copy: it holds what memory holds."""
    was, disk.paused = disk.paused, True
    try:
        shutil.copytree(log.directory, directory)
        copy = PartitionLog(str(directory), log.config, clock_ms=log.clock_ms)
        try:
            assert state(copy) == state(log)
        finally:
            copy.close()
            shutil.rmtree(directory)
    finally:
        disk.paused = was


def reopen(log):
    log.close()
    return PartitionLog(log.directory, log.config, clock_ms=log.clock_ms)


def reopened_if_closed(log):
    """A log that closed itself (the disk refused even reading it back) is opened again by its owner."""
    return PartitionLog(log.directory, log.config, clock_ms=log.clock_ms) if log._closed else log


def each_write_call(disk, tmp_path, build, operation, error=errno.ENOSPC, persistent=False):
    """For n = 1, 2, ...: build a log, run ``operation`` with the n-th write call failing; yield
    (n, context, the StorageError or None), until the operation makes fewer than n write calls."""
    for n in range(1, CALLS_MAX):
        context = build(tmp_path / f"n{n}")
        disk.arm(n, error, persistent)
        failure = None
        try:
            operation(context)
        except StorageError as caught:
            failure = caught
        fired = disk.fired
        if not persistent or not fired:
            disk.clear()
        if failure is not None:
            assert fired, f"StorageError without a failed write call: {failure}"
            assert os.sep in str(failure), f"the error names no file: {failure}"
        yield n, context, failure
        disk.clear()
        if not fired:
            assert n > 1, "the operation makes no write call"
            return
    raise AssertionError(f"more than {CALLS_MAX} write calls")


def log_of(directory, clock, **config):
    return PartitionLog(str(directory / "t-0"), LogConfig.from_dict({"index.interval.bytes": 1, **config}), clock_ms=clock)


def segments_with_epochs(directory, clock, count=4, per_segment=3, keys=None, **config):
    """A log of ``count`` segments of ``per_segment`` batches of 2 records, the i-th segment in leader epoch i + 1."""
    log = log_of(directory, clock, **config)
    producer = Producer(keys)
    for i in range(count):
        for _ in range(per_segment):
            producer.send(log, leader_epoch=i + 1)
        if i < count - 1:
            log.roll()
    return log, producer


MODES = [(errno.ENOSPC, False), (errno.ENOSPC, True), (errno.EIO, False), (errno.EIO, True)]
MODE_IDS = ["ENOSPC-once", "ENOSPC-stays", "EIO-once", "EIO-stays"]


def heal_and_check(log, producer, disk, tmp_path, n, still_broken=False, epoch=1):
    """After a fault: reads go on, memory is what recovery finds (once the disk cut what it had to);
    then, healed, appends resume, and a close and an open find the same log."""
    check_content(log, producer)  # reads go on, broken disk or not
    if still_broken:
        with pytest.raises(StorageError):  # a write fails again, cleanly
            producer.send(log, leader_epoch=epoch)
        check_content(log, producer)
        disk.clear()
    if not cut_pending(log):
        check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
    producer.retry_until_sent(log, leader_epoch=epoch)
    producer.send(log, leader_epoch=epoch)
    check_recovers_to_memory(log, disk, tmp_path / f"crash-after-{n}")
    end = log.log_end_offset
    log = reopen(log)
    try:
        assert log.log_end_offset == end
        check_content(log, producer)
        producer.check_duplicate_detection(log)
        producer.send(log, leader_epoch=epoch)
        check_content(log, producer)
    finally:
        log.close()


# --- appends -------------------------------------------------------------------------------------------------

APPENDS = {
    # flush policy, roll before the batch (segment.ms passed), the batch in a new leader epoch
    "os-roll-new-epoch": ("os", True, True),
    "os-plain": ("os", False, False),
    "batch-roll-new-epoch": ("batch", True, True),
    "batch-plain": ("batch", False, False),
    "interval-new-epoch": ("interval", False, True),
}


@pytest.mark.parametrize("error,persistent", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", list(APPENDS))
def test_an_append_fails_whole_at_every_write_call_and_the_log_heals(disk, tmp_path, kind, error, persistent):
    policy, roll, new_epoch = APPENDS[kind]
    clock = FakeClock()

    def build(directory):
        log = log_of(directory, clock, **{"flush.policy": policy, "flush.ms": 0, "segment.ms": 60_000})
        producer = Producer()
        for _ in range(4):
            producer.send(log)
        if roll:
            clock.now_ms += 60_000
        return log, producer

    def append(context):
        log, producer = context
        producer.send(log, size=3, leader_epoch=2 if new_epoch else 1)

    for n, (log, producer), failure in each_write_call(disk, tmp_path, build, append, error, persistent):
        if failure is None:
            assert len(log.segments) == 1 + roll  # the append that met no fault rolled as asked
        heal_and_check(log, producer, disk, tmp_path, n, persistent and failure is not None, epoch=2 if new_epoch else 1)


MARKERS = {
    # the marker commits, a roll before it (segment.ms passed), flush policy, a new leader epoch
    "abort-roll-new-epoch": (False, True, "os", True),
    "abort-plain": (False, False, "os", False),
    "abort-batch": (False, False, "batch", False),
    "commit-roll": (True, True, "os", False),
}


@pytest.mark.parametrize("error,persistent", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", list(MARKERS))
def test_a_marker_append_fails_whole_at_every_write_call_and_the_log_heals(disk, tmp_path, kind, error, persistent):
    """A marker's append (log file, indexes, the aborted-transaction index, epoch, sync): all or
    nothing. Failed, the transaction is still open and nothing names it aborted; retried, it lands
    once, at the offset the failed attempt had."""
    commit, roll, policy, new_epoch = MARKERS[kind]
    epoch = 2 if new_epoch else 1
    clock = FakeClock()

    def build(directory):
        log = log_of(directory, clock, **{"flush.policy": policy, "segment.ms": 60_000})
        producer, txn = Producer(), Producer(producer_id=TXN_PRODUCER_ID, transactional=True)
        producer.send(log)
        txn.send(log)
        producer.send(log)
        txn.send(log)
        if roll:
            clock.now_ms += 60_000
        return log, producer, txn, Markers()

    def marker(context):
        log, _, _, markers = context
        markers.write(log, commit, leader_epoch=epoch)

    for n, (log, producer, txn, markers), failure in each_write_call(disk, tmp_path, build, marker, error, persistent):
        assert log.log_end_offset == (9 if failure is None else 8)  # 4 batches of 2, then the marker
        check_content(log, producer, txn, markers)
        if failure is not None:
            assert log.first_unstable_offset() == 2 and log.aborted_transactions(0, 9) == []
            if persistent:
                with pytest.raises(StorageError):
                    markers.write(log, commit, leader_epoch=epoch)
                disk.clear()
            if not cut_pending(log):
                check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
            assert markers.write(log, commit, leader_epoch=epoch).base_offset == 8  # the retry
        assert log.first_unstable_offset() is None
        assert log.aborted_transactions(0, 9) == ([] if commit else [(TXN_PRODUCER_ID, 2)])
        check_content(log, producer, txn, markers)
        check_recovers_to_memory(log, disk, tmp_path / f"crash-after-{n}")
        txn.send(log, leader_epoch=epoch)  # the next transaction
        log = reopen(log)
        try:
            check_content(log, producer, txn, markers)
            assert log.first_unstable_offset() == 9
            txn.check_duplicate_detection(log)
        finally:
            log.close()


@pytest.mark.parametrize("error,persistent", MODES[:2], ids=MODE_IDS[:2])
def test_a_followers_first_batch_inside_its_start_rolls_back_or_lands(disk, tmp_path, error, persistent):
    """A follower started at a log start inside a batch takes that whole batch: its empty segment is
    replaced by one at the batch's base offset (a roll with an empty active segment)."""
    clock = FakeClock()
    leader_batch = rb.frame_record_batch(rb.build_record_batch([b"a", b"b", b"c", b"d"]), base_offset=3, leader_epoch=4)

    def build(directory):
        log = log_of(directory, clock)
        log.truncate_fully_and_start_at(5)
        return log

    for n, log, failure in each_write_call(disk, tmp_path, build, lambda log: log.append_as_follower(leader_batch), error, persistent):
        disk.clear()
        log = reopened_if_closed(log)
        if not cut_pending(log):
            check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
        if failure is not None:
            # Rolled back to the empty log at 5; or, when the disk refused that too, empty at the
            # batch's base offset, where the next copy of the batch continues it.
            assert log.log_end_offset in ((3, 5) if persistent else (5,)) and log.active_segment.is_empty
            log.append_as_follower(leader_batch)
        assert log.log_end_offset == 7 and log.log_start_offset == 5
        assert read_all(log) == {5: b"c", 6: b"d"}
        log = reopen(log)
        assert log.log_end_offset == 7 and read_all(log) == {5: b"c", 6: b"d"} and log.epochs.entries == [(4, 5)]
        log.close()


def test_an_index_entry_that_does_not_fit_fails_its_append_whole_however_often_it_is_retried(disk, tmp_path):
    """The log file has room, its offset index none: each append fails with nothing written, however
    often the producer retries it, and once there is room again it goes in once, at its offset."""
    clock = FakeClock()
    log = log_of(tmp_path, clock)  # an index entry for every batch
    producer = Producer()
    for _ in range(5):
        producer.send(log)
    end, size = log.log_end_offset, log.active_segment.size_bytes
    disk.arm(1, persistent=True, only_suffix=".index")
    for _ in range(20):
        with pytest.raises(StorageError, match=r"\.index"):
            producer.send(log)
        assert (log.log_end_offset, log.active_segment.size_bytes, os.path.getsize(log.active_segment.log_path)) == (end, size, size)
        check_content(log, producer)
    disk.clear()
    producer.retry_until_sent(log)
    for _ in range(5):
        producer.send(log)
    end = log.log_end_offset
    log = reopen(log)
    try:
        assert log.log_end_offset == end == 22 and log.recovery.truncated_bytes == 0  # 11 batches of 2
        check_content(log, producer)
        producer.check_duplicate_detection(log)
    finally:
        log.close()


# --- truncations and delete_records ---------------------------------------------------------------------------


@pytest.mark.parametrize("error,persistent", MODES, ids=MODE_IDS)
def test_truncate_to_at_every_write_call_leaves_a_whole_log(disk, tmp_path, error, persistent):
    clock = FakeClock()
    target = 9  # inside the second segment's second batch (offsets 8..9): the log ends at 8

    def build(directory):
        return segments_with_epochs(directory, clock)

    for n, (log, producer), failure in each_write_call(disk, tmp_path, build, lambda c: c[0].truncate_to(target), error, persistent):
        end = log.log_end_offset
        assert end in (8, 12, 18, 24) and (failure is not None or end == 8)  # a shorter log, but a whole one
        producer.forget_from(end)
        check_content(log, producer)
        disk.clear()
        if not cut_pending(log):
            check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
        assert log.truncate_to(target) == 8  # the retry finishes it
        producer.forget_from(8)
        assert log.epochs.entries == [(1, 0), (2, 6)]
        heal_and_check(log, producer, disk, tmp_path, n, epoch=2)


@pytest.mark.parametrize("error,persistent", MODES, ids=MODE_IDS)
def test_delete_records_at_every_write_call_keeps_the_rest(disk, tmp_path, error, persistent):
    clock = FakeClock()
    start = 15  # inside the third segment (offsets 12..17)

    def build(directory):
        return segments_with_epochs(directory, clock)

    for n, (log, producer), failure in each_write_call(disk, tmp_path, build, lambda c: c[0].delete_records(start), error, persistent):
        assert log.log_start_offset in (0, start)
        check_content(log, producer)
        disk.clear()
        if not cut_pending(log):
            check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
        assert log.delete_records(start) == start  # the retry finishes it
        assert [s.base_offset for s in log.segments] == [12, 18]
        assert log.epochs.entries == [(3, 15), (4, 18)]
        with pytest.raises(OffsetOutOfRangeError):
            log.read(start - 1)
        heal_and_check(log, producer, disk, tmp_path, n, epoch=4)


@pytest.mark.parametrize("error,persistent", MODES, ids=MODE_IDS)
def test_truncate_fully_and_start_at_every_write_call(disk, tmp_path, error, persistent):
    clock = FakeClock()
    start = 40

    def build(directory):
        return segments_with_epochs(directory, clock)

    for n, (log, producer), failure in each_write_call(
        disk, tmp_path, build, lambda c: c[0].truncate_fully_and_start_at(start), error, persistent
    ):
        if failure is not None:
            assert log.log_end_offset in (24, start)
        check_content(log, Producer() if log.log_end_offset == start else producer)
        disk.clear()
        if not cut_pending(log):
            check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
        if log.log_end_offset < start:
            log.truncate_fully_and_start_at(start)  # the retry, as a follower makes it
        assert (log.log_start_offset, log.log_end_offset, len(log.segments)) == (start, start, 1)
        assert log.epochs.entries == [] and log.producer_state.entries() == []
        follower_copy = rb.frame_record_batch(rb.build_record_batch([b"x", b"y"]), base_offset=start, leader_epoch=9)
        log.append_as_follower(follower_copy)
        check_recovers_to_memory(log, disk, tmp_path / f"crash-after-{n}")
        log = reopen(log)
        assert (log.log_start_offset, log.log_end_offset) == (start, start + 2)
        assert read_all(log) == {start: b"x", start + 1: b"y"} and log.epochs.entries == [(9, start)]
        log.close()


# --- a cleaning ------------------------------------------------------------------------------------------------

KEYS = [b"k0", b"k1", b"k2"]


@pytest.mark.parametrize("error,persistent", MODES[:2], ids=MODE_IDS[:2])
def test_a_cleaning_at_every_write_call_keeps_the_old_segments_or_the_new_ones(disk, tmp_path, error, persistent):
    clock = FakeClock()

    def build(directory):
        return segments_with_epochs(
            directory, clock, count=3, per_segment=2, keys=KEYS, **{"cleanup.policy": "compact", "min.cleanable.dirty.ratio": 0}
        )

    for n, (log, producer), failure in each_write_call(disk, tmp_path, build, lambda c: c[0].clean(), error, persistent):
        disk.clear()
        log = reopened_if_closed(log)
        if not cut_pending(log):
            check_recovers_to_memory(log, disk, tmp_path / f"crash-{n}")
        got = read_all(log)
        assert all(producer.acked[o] == v for o, v in got.items())  # every record the one written at its offset
        if failure is not None:
            log.clean()  # the retry
        cleaned_end = log.segments[-1].base_offset  # the active segment is never cleaned
        latest = {}  # the latest record of each key below the active segment
        for offset in sorted(o for o in producer.acked if o < cleaned_end):
            latest[KEYS[int(producer.acked[offset][1:]) % len(KEYS)]] = offset
        expected = {o: producer.acked[o] for o in producer.acked if o >= cleaned_end or o in latest.values()}
        assert read_all(log) == expected
        check_recovers_to_memory(log, disk, tmp_path / f"crash-after-{n}")
        end = log.log_end_offset
        log = reopen(log)
        assert log.log_end_offset == end and read_all(log) == expected
        producer.check_duplicate_detection(log)
        log.close()


# --- close ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error,persistent", MODES[:2], ids=MODE_IDS[:2])
def test_a_close_that_fails_still_closes_and_loses_nothing(disk, tmp_path, error, persistent):
    clock = FakeClock()

    def build(directory):
        log = log_of(directory, clock)
        producer = Producer()
        for _ in range(3):
            producer.send(log)
        return log, producer

    for n, (log, producer), failure in each_write_call(disk, tmp_path, build, lambda c: c[0].close(), error, persistent):
        disk.clear()
        assert log._closed
        with pytest.raises(StorageError):
            log.read(0)
        again = PartitionLog(log.directory, log.config, clock_ms=clock)
        check_content(again, producer)
        producer.check_duplicate_detection(again)
        again.close()


# --- the property ----------------------------------------------------------------------------------------------

operation = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4), st.booleans()),  # records, a new leader epoch
    st.tuples(st.just("append"), st.integers(1, 4), st.just(False)),
    st.tuples(st.just("txn"), st.integers(1, 4), st.none()),  # a transactional batch
    st.tuples(st.just("marker"), st.booleans(), st.none()),  # commit or abort
    st.tuples(st.just("fault"), st.integers(1, 12), st.sampled_from(MODES)),  # the k-th write call from now fails
    st.tuples(st.just("heal"), st.none(), st.none()),
    st.tuples(st.just("roll"), st.none(), st.none()),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.none()),  # where, as a share of the log
    st.tuples(st.just("delete_records"), st.floats(0, 1), st.none()),
    st.tuples(st.just("reopen"), st.none(), st.none()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(operation, min_size=8, max_size=30), st.sampled_from(["os", "batch"]))
# A truncation that deletes the active segment makes the one before it active again: its appends
# must place offset-index entries where recovery does.
@example(operations=[("append", 1, False)] * 4 + [("roll", None, None), ("append", 1, False), ("reopen", None, None), ("truncate", 0.875, None)],
         policy="os")
def test_property_no_acknowledged_record_is_lost_whatever_write_fails(disk, tmp_path_factory, operations, policy):
    directory = tmp_path_factory.mktemp("faults")
    disk.clear()
    disk.paused = False
    clock = FakeClock()
    log = log_of(directory, clock, **{"flush.policy": policy, "segment.bytes": 4096, "index.interval.bytes": 700})
    producer = Producer()
    txn, markers = Producer(producer_id=TXN_PRODUCER_ID, transactional=True), Markers()
    epoch = 1
    crashes = 0
    try:
        for kind, argument, option in operations:
            failed = False
            try:
                if kind == "append":
                    epoch += option
                    producer.send(log, size=argument, leader_epoch=epoch)
                elif kind == "txn":
                    txn.send(log, size=argument, leader_epoch=epoch)
                elif kind == "marker":
                    markers.write(log, argument, leader_epoch=epoch)
                elif kind == "fault":
                    disk.arm(argument, *option)
                elif kind == "heal":
                    disk.clear()
                elif kind == "roll":
                    log.roll()
                elif kind == "truncate":
                    target = log.log_start_offset + int(argument * (log.log_end_offset - log.log_start_offset))
                    before = log.log_end_offset
                    producer.pending = txn.pending = None  # the producers give a batch that failed up
                    try:
                        log.truncate_to(target)
                    finally:
                        assert log.log_end_offset <= before
                        for each in (producer, txn, markers):
                            each.forget_from(log.log_end_offset)
                        producer.follow_sequence(log)
                        txn.follow_sequence(log)
                elif kind == "delete_records":
                    log.delete_records(log.log_start_offset + int(argument * (log.log_end_offset - log.log_start_offset)))
                else:
                    disk.clear()
                    log = reopen(log)
                    producer.follow_sequence(log)
                    txn.follow_sequence(log)
            except StorageError:
                assert disk.fired
                failed = True
                event(f"{kind} failed")
            if log._closed:  # closed itself, or a close failed: its owner opens it again
                disk.clear()
                log = reopened_if_closed(log)
            check_content(log, producer, txn, markers)
            if failed and not cut_pending(log):  # a crash right after a failed write
                crashes += 1
                check_recovers_to_memory(log, disk, directory / f"crash-{crashes}")
        disk.clear()
        producer.retry_until_sent(log, leader_epoch=epoch)
        txn.retry_until_sent(log, leader_epoch=epoch)
        producer.send(log, leader_epoch=epoch)  # healed: appends go on (and make the cuts left pending)
        markers.write(log, False, leader_epoch=epoch)
        check_recovers_to_memory(log, disk, directory / "crash-at-the-end")
        end = log.log_end_offset
        log = reopen(log)
        assert log.log_end_offset == end
        check_content(log, producer, txn, markers)
        producer.check_duplicate_detection(log)
    finally:
        disk.clear()
        log.close()
