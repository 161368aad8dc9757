"""Transactions in the storage layer: markers, the producer table's ongoing transactions, the
aborted-transaction index, the first unstable offset, recovery, retention and compaction; and a
Hypothesis property that checks them against a model."""

import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidRecordError, ProducerFencedError
from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage import record_batch as rb
from logbus.storage.cleaner import read_summary
from logbus.storage.segment import TXN_INDEX_SUFFIX, segment_file_name
from logbus.storage.txn_index import AbortedTxn
from tests.storage.conftest import FakeClock

COMPACT = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": 0}


class Txn:
    """A transactional producer writing straight to a log (as the leader would take its batches)."""

    def __init__(self, log, producer_id, epoch=0):
        self.log, self.producer_id, self.epoch, self.sequence = log, producer_id, epoch, 0

    def send(self, values, keys=None):
        keys = keys or [b"k-%s" % v for v in values]
        stamps = [self.log.clock_ms()] * len(values)
        batch = encode_batch(values, keys, stamps, producer_id=self.producer_id, producer_epoch=self.epoch, base_sequence=self.sequence, transactional=True)
        result = self.log.append(batch, leader_epoch=1)
        self.sequence += len(values)
        return result.base_offset

    def end(self, commit, epoch=None):
        return self.log.append_marker(self.producer_id, self.epoch if epoch is None else epoch, commit, 5, leader_epoch=1).base_offset


def plain(log, values, keys=None):
    keys = keys or [b"k-%s" % v for v in values]
    return log.append(encode_batch(values, keys, [log.clock_ms()] * len(values)), leader_epoch=1).base_offset


def batches(log, start=None, end=None):
    """Every stored batch (header, records) from ``start`` on, markers included."""
    offset = log.log_start_offset if start is None else start
    out = []
    while (result := log.read(offset, 1 << 20, max_offset=end)) is not None:
        out += rb.decode_batches(result.data)
        offset = result.next_offset
    return out


def read(log, read_committed, max_bytes=1 << 20):
    """What a reader sees from the log start: [(offset, value)], read in replies of ``max_bytes``,
    each with its aborted transactions, as a replica answers a fetch (read_committed: up to the LSO)."""
    offset = log.log_start_offset
    unstable = log.first_unstable_offset()
    bound = log.log_end_offset if unstable is None or not read_committed else unstable
    out = []
    while (result := log.read(offset, max_bytes, max_offset=bound)) is not None:
        aborted = log.aborted_transactions(offset, result.next_offset) if read_committed else ()
        kept, _ = rb.slice_visible_batches(result.data, offset, read_committed=read_committed, aborted=aborted)
        for _, first, records in kept:
            out += [(first + i, v) for i, v in enumerate(records.column("value").to_pylist())]
        offset = result.next_offset
    return out


# --- the format -------------------------------------------------------------------------------------------


def test_a_marker_is_kafkas_control_batch():
    batch = rb.encode_control_batch(42, 3, True, 7, 1_700_000_000_123)
    header, records = rb.decode_records(batch)
    assert header.is_control and header.is_transactional and header.attributes & 0x30 == 0x30
    assert (header.producer_id, header.producer_epoch, header.base_sequence, header.record_count) == (42, 3, -1, 1)
    assert records.column("key")[0].as_py() == struct.pack(">hh", 0, 1)  # ControlRecordKey: version 0, COMMIT
    assert records.column("value")[0].as_py() == struct.pack(">hi", 0, 7)  # EndTransactionMarker: coordinator epoch 7
    assert records.column("timestamp")[0].as_py() == header.max_timestamp_ms == 1_700_000_000_123
    assert rb.control_record(records) == (True, 7)
    abort = rb.decode_records(rb.encode_control_batch(42, 3, False, 7, 0))[1]
    assert rb.control_record(abort) == (False, 7) and abort.column("key")[0].as_py() == struct.pack(">hh", 0, 0)


def test_a_transactional_batch_needs_a_producer_and_a_control_batch_is_never_produced(open_log):
    with pytest.raises(InvalidRecordError, match="producer id"):
        encode_batch([b"x"], transactional=True)
    data = encode_batch([b"x"], producer_id=3, producer_epoch=0, base_sequence=0, transactional=True)
    assert rb.decode_records(data)[0].is_transactional and not rb.decode_records(data)[0].is_control
    log = open_log()
    with pytest.raises(InvalidRecordError, match="coordinator"):
        log.append(rb.encode_control_batch(3, 0, True, 0, 1))
    assert log.log_end_offset == 0


# --- the first unstable offset and the index --------------------------------------------------------------


def test_ongoing_transactions_hold_the_first_unstable_offset_and_aborts_are_indexed(open_log):
    log = open_log()
    a, b = Txn(log, 10), Txn(log, 11)
    plain(log, [b"p0"])
    assert log.first_unstable_offset() is None
    assert a.send([b"a1", b"a2"]) == 1
    assert b.send([b"b1"]) == 3
    a.send([b"a3"])
    assert log.first_unstable_offset() == 1
    assert a.end(commit=False) == 5  # a's transaction [1, 5) aborted; b's still open
    assert log.first_unstable_offset() == 3
    assert log.aborted_transactions(0, 6) == [(10, 1)]
    assert log.active_segment.txn_index.entries() == [AbortedTxn(10, 1, 5, 3)]  # the LSO just after: b's start
    b.end(commit=True)
    assert log.first_unstable_offset() is None
    assert log.aborted_transactions(0, 100) == [(10, 1)] and log.aborted_transactions(6, 100) == []
    assert log.aborted_transactions(0, 1) == []  # began at 1: not below the end
    assert read(log, True) == [(0, b"p0"), (3, b"b1")]
    assert read(log, False) == [(0, b"p0"), (1, b"a1"), (2, b"a2"), (3, b"b1"), (4, b"a3")]


def test_a_marker_ending_no_transaction_is_written_and_indexes_nothing(open_log):
    log = open_log()
    t = Txn(log, 10)
    assert t.end(commit=False) == 0
    assert log.log_end_offset == 1 and log.aborted_transactions(0, 1) == []
    assert not os.path.exists(log.active_segment.txn_index.path)  # no aborted transaction: no file
    t.send([b"x"])
    assert log.first_unstable_offset() == 1


def test_markers_fence_older_epochs_and_a_newer_one_restarts_the_sequence(open_log):
    log = open_log()
    t = Txn(log, 10)
    t.send([b"x", b"y"])
    t.end(commit=False, epoch=1)  # the coordinator fenced the producer: its marker carries epoch 1
    assert log.first_unstable_offset() is None
    with pytest.raises(ProducerFencedError):
        t.send([b"zombie"])  # epoch 0
    with pytest.raises(ProducerFencedError):
        t.end(commit=True, epoch=0)
    fresh = Txn(log, 10, epoch=1)
    assert fresh.send([b"z"]) == 3  # epoch 1 starts at sequence 0
    assert log.first_unstable_offset() == 3
    with pytest.raises(ProducerFencedError):
        log.append_marker(10, 0, True, 5)


def test_a_transactional_batch_without_sequence_numbers_is_checked_for_its_epoch_only(open_log, tmp_path):
    """The group coordinator writes a transaction's offsets so (as Kafka's does)."""
    log = open_log()

    def offsets(epoch):
        return encode_batch([b"o"], [b"k"], producer_id=10, producer_epoch=epoch, base_sequence=-1, transactional=True)

    assert log.append(offsets(0)).base_offset == 0
    assert log.append(offsets(0)).base_offset == 1  # never a duplicate
    assert log.first_unstable_offset() == 0
    log.append_marker(10, 1, True, 0)
    assert log.first_unstable_offset() is None
    with pytest.raises(ProducerFencedError):
        log.append(offsets(0))
    assert log.append(offsets(1)).base_offset == 3 and log.first_unstable_offset() == 3
    entries = log.producer_state.entries()
    log.close()
    assert open_log().producer_state.entries() == entries


def test_an_epoch_bump_keeps_the_ongoing_transaction(open_log):
    log = open_log()
    Txn(log, 10, epoch=0).send([b"a"])
    Txn(log, 10, epoch=1).send([b"b"])  # (a producer's new epoch does not end its transaction)
    assert log.first_unstable_offset() == 0
    log.append_marker(10, 1, False, 0)
    assert log.aborted_transactions(0, 3) == [(10, 0)]


def test_the_search_stops_at_an_entry_whose_lso_covers_the_range(open_log):
    log = open_log()
    a = Txn(log, 10)
    for i in range(3):  # a segment per batch
        a.send([b"%d" % i])
        log.roll()
        a.end(commit=False)
        log.roll()
    assert log.aborted_transactions(0, 1) == [(10, 0)]
    assert log.aborted_transactions(1, 3) == [(10, 0), (10, 2)]
    assert log.aborted_transactions(0, 100) == [(10, 0), (10, 2), (10, 4)]
    # Reading the first entry's segment, its LSO (2) covers [0, 1): the later segments are not read.
    log.segments[3].txn_index._keys.append(99)  # a poisoned entry the search must not reach
    log.segments[3].txn_index._values.append((77, 0, 100))
    assert log.aborted_transactions(0, 1) == [(10, 0)]


# --- recovery, followers, truncation ----------------------------------------------------------------------


def written(log):
    return log.first_unstable_offset(), log.aborted_transactions(0, log.log_end_offset + 1), log.producer_state.entries()


def test_recovery_rebuilds_the_index_and_the_ongoing_transactions(open_log, tmp_path):
    log = open_log()
    a, b = Txn(log, 10), Txn(log, 11)
    for i in range(6):
        a.send([b"a%d" % i])
        b.send([b"b%d" % i])
        if i % 2:
            a.end(commit=False)
        log.roll()
    before = written(log)
    assert len(before[1]) == 3 and before[0] is not None and len(log.segments) > 3
    index_files = [s.txn_index.path for s in log.segments if os.path.exists(s.txn_index.path)]
    log.close()
    os.unlink(os.path.join(str(tmp_path / "topic-0"), "recovery-point"))  # every segment is scanned (as after a crash)
    os.unlink(index_files[0])  # lost with the crash
    with open(index_files[-1], "ab") as file:
        file.write(b"torn")  # a torn entry
    again = open_log()
    assert written(again) == before
    assert os.path.getsize(index_files[-1]) % 32 == 0


def test_a_follower_builds_the_same_index_and_state(open_log, tmp_path):
    leader = open_log()
    a, b = Txn(leader, 10), Txn(leader, 11)
    a.send([b"a1"])
    b.send([b"b1"])
    a.end(commit=False)
    plain(leader, [b"p"])
    b.send([b"b2"])
    follower = open_log(directory=tmp_path / "follower")
    result = leader.read(0, 1 << 20)
    follower.append_as_follower(result.data, result.first_offset, result.next_offset)
    assert written(follower) == written(leader)
    assert [s.txn_index.entries() for s in follower.segments] == [s.txn_index.entries() for s in leader.segments]


def test_truncation_drops_markers_entries_and_reopens_their_transactions(open_log):
    log = open_log()
    a = Txn(log, 10)
    a.send([b"a1"])
    a.send([b"a2"])
    marker = a.end(commit=False)
    assert log.first_unstable_offset() is None and log.aborted_transactions(0, 10) == [(10, 0)]
    log.truncate_to(marker)  # the marker was never committed
    assert log.first_unstable_offset() == 0 and log.aborted_transactions(0, 10) == []
    assert log.active_segment.txn_index.entries() == []
    a.end(commit=True)
    assert log.first_unstable_offset() is None and read(log, True) == [(0, b"a1"), (1, b"a2")]


# --- retention and delete_records -----------------------------------------------------------------------------


def test_retention_deletes_segments_with_their_index_and_moves_an_ongoing_transactions_start(open_log, clock):
    log = open_log({"retention.ms": 1000})
    a, b = Txn(log, 10), Txn(log, 11)
    a.send([b"a1"])
    b.send([b"b1"])
    a.end(commit=False)
    log.roll()
    index = log.segments[0].txn_index.path
    assert os.path.exists(index)
    clock.now_ms += 10_000
    b.send([b"b2"])  # b's transaction goes on in the new segment
    clock.now_ms += 10
    log.roll()
    assert log.enforce_retention() >= 1
    assert not os.path.exists(index)
    assert log.segments[0].base_offset == 3 and log.first_unstable_offset() == 3  # what an open finds
    log.close()
    again = PartitionLog(log.directory, log.config, clock_ms=clock)
    assert again.first_unstable_offset() == 3
    again.close()


def test_delete_records_past_every_batch_of_a_transaction_forgets_it(open_log):
    log = open_log()
    a = Txn(log, 10)
    a.send([b"a1"])
    log.roll()
    plain(log, [b"p"])
    log.roll()
    assert log.first_unstable_offset() == 0
    log.delete_records(2)
    assert log.first_unstable_offset() is None  # none of its batches is left (as an open finds)


# --- compaction -------------------------------------------------------------------------------------------------


def test_compaction_stops_at_the_lso_and_removes_aborted_records(open_log):
    log = open_log(COMPACT)
    a, b = Txn(log, 10), Txn(log, 11)
    plain(log, [b"v0"], [b"k"])
    a.send([b"aborted"], [b"k"])  # the newest record of k, but aborted: v0 must stay
    a.end(commit=False)
    log.roll()
    b.send([b"open"], [b"j"])  # an open transaction from offset 3
    log.roll()
    plain(log, [b"later"], [b"k"])
    log.roll()
    plain(log, [b"active"], [b"z"])
    log.clean()
    assert log.segments[0].base_offset == 0 and log._cleaner_checkpoint == 3  # not at or past the LSO (3)
    assert [(h.base_offset, h.is_control) for h, _ in batches(log, 0, 3)] == [(0, False), (2, True)]
    assert read(log, False)[:1] == [(0, b"v0")]
    b.end(commit=True)
    log.clean()
    assert read(log, True) == [(3, b"open"), (4, b"later"), (5, b"active")]  # v0 superseded now


def test_a_marker_stays_until_its_data_is_gone_and_delete_retention_ms_after(open_log, clock):
    log = open_log({**COMPACT, "delete.retention.ms": 1000})
    a = Txn(log, 10)
    a.send([b"c1"], [b"k"])
    commit = a.end(commit=True)
    a.send([b"x"], [b"x"])
    abort = a.end(commit=False)
    log.roll()
    plain(log, [b"c2"], [b"k"])  # makes c1 obsolete
    log.roll()
    plain(log, [b"active"], [b"z"])
    started = clock.now_ms
    log.clean()
    kept = [(h.base_offset, h.is_control) for h, _ in batches(log, 0, 5)]
    assert kept == [(1, True), (3, True), (4, False)]  # c1 and the aborted x went; both markers stay
    assert log.aborted_transactions(0, 5) == []  # a cleaned segment holds no aborted data: no entries
    summary = read_summary(log.segments[0].summary_path)
    assert dict(summary.markers) == {1: started, 3: started}  # both transactions' data gone now
    clock.now_ms += 500
    assert log.clean() == []  # not due yet
    clock.now_ms += 600
    assert log.clean()  # due: delete.retention.ms passed since the data went
    assert [(h.base_offset, h.is_control) for h, _ in batches(log, 0, 5)] == [(4, False)]
    assert read(log, True) == [(4, b"c2"), (5, b"active")]
    log.close()
    again = PartitionLog(log.directory, log.config, clock_ms=clock)
    assert again.producer_state.producers[10].txn_first_offset is None and again.first_unstable_offset() is None
    again.close()


def test_the_summary_keeps_an_ongoing_transaction_whose_marker_is_past_the_cleaned_offsets(open_log):
    log = open_log(COMPACT)
    a = Txn(log, 10)
    plain(log, [b"p"], [b"k"])
    plain(log, [b"p2"], [b"k"])
    a.send([b"t"], [b"t"])
    log.roll()
    log.append_marker(10, 0, True, 0)  # in the active segment: not cleaned
    assert log.clean()
    summary = read_summary(log.segments[0].summary_path)
    assert summary.end_offset == 3 and [e[6] for e in summary.producers if e[0] == 10] == [2]  # ongoing from 2 at 3
    log.close()
    # (On the log's own clock: on the wall clock, records stamped by the test's clock are older than
    # producer.id.expiration.ms, and the open would rightly forget producer 10.)
    again = PartitionLog(log.directory, log.config, clock_ms=log.clock_ms)
    assert again.first_unstable_offset() is None and again.producer_state.producers[10].last_sequence == 0
    again.close()


def test_a_version_1_summary_still_reads(tmp_path):
    path = str(tmp_path / "x.summary")
    with open(path, "w") as file:
        file.write('{"version": 1, "end_offset": 9, "producers": [[7, 0, 0, 1, 3, 100]]}')
    summary = read_summary(path)
    assert summary.producers == ((7, 0, 0, 1, 3, 100, -1),) and summary.markers == ()


# --- the property --------------------------------------------------------------------------------------------------

PRODUCERS = (10, 11, 12)
KEYS = [b"a", b"b", b"c", b"d"]

_send = st.tuples(st.just("send"), st.sampled_from(PRODUCERS), st.integers(1, 3))
_end = st.tuples(st.just("end"), st.sampled_from(PRODUCERS), st.booleans())
_roll = st.tuples(st.just("roll"), st.none(), st.none())
_clean = st.tuples(st.just("clean"), st.none(), st.none())
operation = st.one_of(
    _send, _send, _send,
    st.tuples(st.just("plain"), st.none(), st.integers(1, 3)),
    _end, _end, _end,
    _roll, _roll,
    st.tuples(st.just("reopen"), st.none(), st.none()),
    _clean, _clean,
    st.tuples(st.just("truncate"), st.none(), st.floats(0, 1)),
)


class Model:
    """What the log should hold: every record with its transaction's fate, markers, and open transactions."""

    def __init__(self):
        self.records = []  # [offset, producer or None, txn id or None, key, value, removed]
        self.fate = {}  # txn id -> "open" | "commit" | "abort"
        self.open = {}  # producer -> (txn id, first offset)
        self.markers = []  # (offset, producer, txn id or None, commit)
        self.batches = {p: [] for p in PRODUCERS}  # (base offset, first sequence, count) per producer
        self.next_txn = 0
        self.end = 0

    def sequence(self, producer):
        batches = self.batches[producer]
        return batches[-1][1] + batches[-1][2] if batches else 0

    def first_unstable(self):
        return min((first for _, first in self.open.values()), default=None)

    def aborted(self):
        """(producer, first offset) of each aborted transaction, by marker, as the index has them."""
        out = []
        for offset, producer, txn, commit in self.markers:
            if txn is not None and not commit:
                out.append((producer, min(r[0] for r in self.all_of(txn))))
        return out

    def all_of(self, txn):
        return [r for r in self.records if r[2] == txn]

    def visible(self, read_committed, log_start):
        bound = self.first_unstable() if read_committed and self.open else self.end
        return [
            (r[0], r[4]) for r in self.records
            if not r[5] and r[0] >= log_start and r[0] < bound and not (read_committed and r[2] is not None and self.fate[r[2]] == "abort")
        ]

    def truncate(self, end):
        """The log was cut at ``end``: what it dropped, and the transactions open again."""
        self.records = [r for r in self.records if r[0] < end]
        self.markers = [m for m in self.markers if m[0] < end]
        for producer in PRODUCERS:
            self.batches[producer] = [b for b in self.batches[producer] if b[0] < end]
        self.end = end
        self.open = {}
        for txn in {r[2] for r in self.records if r[2] is not None}:
            if not any(m[2] == txn for m in self.markers):
                records = self.all_of(txn)
                self.open[records[0][1]] = (txn, records[0][0])
                self.fate[txn] = "open"

    def clean(self, end):
        """A cleaning of the offsets below ``end``: aborted records go, and the latest of each key stays."""
        below = [r for r in self.records if r[0] < end and not r[5]]
        latest = {}
        for r in below:
            if r[2] is not None and self.fate[r[2]] == "abort":
                r[5] = True
            else:
                latest[r[3]] = r[0]
        for r in below:
            if not r[5] and latest[r[3]] != r[0]:
                r[5] = True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(operation, min_size=5, max_size=50), st.booleans(), st.sampled_from([300, 1 << 20]))
def test_property_lso_aborted_list_and_read_committed_match_the_model(tmp_path_factory, operations, compact, read_bytes):
    directory = str(tmp_path_factory.mktemp("txn") / "t-0")
    clock = FakeClock()
    config = LogConfig.from_dict({**(COMPACT if compact else {}), "segment.bytes": 1 << 20})
    log = PartitionLog(directory, config, clock_ms=clock)
    model = Model()
    cleaned = False
    written = 0
    try:
        for kind, producer, argument in operations:
            if kind == "send":
                values = [b"v%d" % (written + i) for i in range(argument)]
                keys = [KEYS[(written + i) % len(KEYS)] for i in range(argument)]
                written += argument
                batch = encode_batch(values, keys, producer_id=producer, producer_epoch=0, base_sequence=model.sequence(producer), transactional=True)
                base = log.append(batch, leader_epoch=1).base_offset
                assert base == model.end
                if producer not in model.open:
                    model.open[producer] = (model.next_txn, base)
                    model.fate[model.next_txn] = "open"
                    model.next_txn += 1
                txn = model.open[producer][0]
                model.records += [[base + i, producer, txn, k, v, False] for i, (k, v) in enumerate(zip(keys, values))]
                model.batches[producer].append((base, model.sequence(producer), argument))
                model.end += argument
            elif kind == "plain":
                values = [b"v%d" % (written + i) for i in range(argument)]
                keys = [KEYS[(written + i) % len(KEYS)] for i in range(argument)]
                written += argument
                base = plain(log, values, keys)
                model.records += [[base + i, None, None, k, v, False] for i, (k, v) in enumerate(zip(keys, values))]
                model.end += argument
            elif kind == "end":
                offset = log.append_marker(producer, 0, argument, 0, leader_epoch=1).base_offset
                txn = model.open.pop(producer, (None,))[0]
                if txn is not None:
                    model.fate[txn] = "commit" if argument else "abort"
                model.markers.append((offset, producer, txn, argument))
                model.end += 1
            elif kind == "roll":
                log.roll()
            elif kind == "reopen":
                before = written_state(log)
                log.close()
                log = PartitionLog(directory, config, clock_ms=clock)
                assert written_state(log) == before
            elif kind == "clean":
                done = log.clean()
                if done:
                    cleaned = True
                    model.clean(max(c.end_offset for c in done))
                    event("cleaned")
            elif kind == "truncate" and not cleaned:  # (followers truncate above the high watermark: never cleaned)
                target = int(argument * model.end)
                end = log.truncate_to(target)
                model.truncate(end)
            assert log.log_end_offset == model.end
            assert log.first_unstable_offset() == model.first_unstable()
            if not cleaned:
                assert log.aborted_transactions(0, model.end + 1) == model.aborted()
            assert read(log, True, read_bytes) == model.visible(True, log.log_start_offset)
            assert read(log, False, read_bytes) == model.visible(False, log.log_start_offset)
        markers = [(h.base_offset, h.producer_id) for h, _ in batches(log) if h.is_control]
        assert markers == [(m[0], m[1]) for m in model.markers]  # every marker stays (delete.retention.ms not passed)
        if model.aborted():
            event("aborted transactions")
    finally:
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def written_state(log):
    return (
        log.log_end_offset, log.first_unstable_offset(), log.aborted_transactions(0, log.log_end_offset + 1),
        sorted(log.producer_state.ongoing.items()),
    )


def test_index_file_name():
    assert segment_file_name(5, TXN_INDEX_SUFFIX) == "00000000000000000005.txnindex"
