"""Log compaction through the storage layer: what the cleaner keeps, gaps in offsets, readers and
followers at gaps, producer state, delete_records, interrupted swaps, and a Hypothesis property."""

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError, InvalidRecordError, OffsetOutOfRangeError
from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage import record_batch as rb
from logbus.storage.cleaner import CLEANED_SUFFIX, SWAP_SUFFIX, read_summary
from logbus.storage.partition_log import OFFSET_GAPS_FILE
from logbus.storage.segment import LOG_SUFFIX, SUMMARY_SUFFIX, segment_file_name

COMPACT = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": 0}


def put(log, pairs, timestamp_ms=None, **frame):
    """Append one batch of (key, value) pairs (value None: a tombstone); returns its base offset."""
    keys = [k for k, _ in pairs]
    values = [v for _, v in pairs]
    stamps = None if timestamp_ms is None else [timestamp_ms] * len(pairs)
    return log.append(encode_batch(values, keys, stamps, **frame), leader_epoch=1).base_offset


def read_all(log, start=None, max_offset=None, max_bytes=1 << 20):
    """Every record from ``start`` (the log start) on, following each read's next_offset (gaps too):
    [(offset, key, value)]. Checks that each reply covers the offsets it says it does."""
    offset = log.log_start_offset if start is None else start
    out = []
    while True:
        result = log.read(offset, max_bytes, max_offset=max_offset)
        if result is None:
            return out
        assert result.first_offset <= offset < result.next_offset
        for header, first, records in rb.slice_batches(result.data, offset):
            keys = records.column("key").to_pylist()
            values = records.column("value").to_pylist()
            out += [(first + i, k, v) for i, (k, v) in enumerate(zip(keys, values))]
        offset = result.next_offset


def latest_per_key(written, below):
    latest = {}
    for offset, key, value in written:
        if offset < below:
            latest[key] = (offset, key, value)
    return sorted(latest.values())


def test_cleaning_keeps_the_latest_record_per_key_and_every_offset(open_log):
    log = open_log(COMPACT)
    written = []
    for round_ in range(4):
        for key in (b"a", b"b", b"c"):
            base = put(log, [(key, b"%s%d" % (key, round_))])
            written.append((base, key, b"%s%d" % (key, round_)))
        log.roll()
    put(log, [(b"a", b"in-the-active-segment")])
    before = read_all(log)
    cleaned = log.clean()
    assert cleaned and sum(c.records_removed for c in cleaned) == 9
    after = read_all(log)
    assert after == latest_per_key(written, 12) + [(12, b"a", b"in-the-active-segment")]
    assert set(after) <= set(before)  # nothing new, nothing moved: every offset keeps its record
    assert log.log_end_offset == 13 and log.log_start_offset == 0
    assert os.path.exists(os.path.join(log.directory, OFFSET_GAPS_FILE))
    assert log.clean() == []  # nothing dirty since


def test_the_active_segment_and_records_at_or_above_the_bound_stay(open_log):
    log = open_log(COMPACT)
    for i in range(3):
        put(log, [(b"k", b"%d" % i)])
        log.roll()
    put(log, [(b"k", b"3")])  # active
    assert log.clean(upper_bound=2) and read_all(log) == [(1, b"k", b"1"), (2, b"k", b"2"), (3, b"k", b"3")]
    log.clean()
    assert read_all(log) == [(2, b"k", b"2"), (3, b"k", b"3")]


def test_reads_at_a_gap_start_at_the_next_batch_and_say_so(open_log):
    log = open_log(COMPACT)
    put(log, [(b"a", b"1"), (b"b", b"1"), (b"c", b"1"), (b"d", b"1")])  # 0..3
    put(log, [(b"a", b"2"), (b"b", b"2")])  # 4..5
    log.roll()
    put(log, [(b"c", b"2")])  # 6, active: c's value at 2 stays until 6 is cleaned too
    log.clean()
    assert read_all(log) == [(2, b"c", b"1"), (3, b"d", b"1"), (4, b"a", b"2"), (5, b"b", b"2"), (6, b"c", b"2")]
    result = log.read(1)
    assert (result.first_offset, result.next_offset) == (1, 6)  # covers [1, 6): 1 is gone
    assert [(h.base_offset, h.record_count) for h, _ in rb.decode_batches(result.data)] == [(2, 2), (4, 2)]
    skipped = log.read(0, max_offset=2)  # nothing below the bound but a gap
    assert (skipped.size_bytes, skipped.first_offset, skipped.next_offset) == (0, 0, 2)


SMALL_SEGMENTS = {**COMPACT, "segment.bytes": 2048}  # a few small batches each; a large one fills a group


def test_a_gap_at_the_end_of_a_segment_is_passed_to_the_next_one(open_log):
    log = open_log(SMALL_SEGMENTS)
    put(log, [(b"a", b"1")])  # 0
    log.append(encode_batch([b"1"], [b"b"]))  # 1, a batch of its own, in the same segment
    log.roll()
    put(log, [(b"b", b"2" * 1500)])  # 2: with it the two segments would be over segment.bytes: cleaned apart
    log.roll()
    put(log, [(b"z", b"1")])  # 3, active
    log.clean()
    assert [(s.base_offset, s.next_offset) for s in log.segments] == [(0, 1), (2, 3), (3, 4)]
    result = log.read(1)
    assert (result.first_offset, result.next_offset) == (1, 3)
    assert [o for o, _, _ in read_all(log)] == [0, 2, 3]


def test_a_segment_cleaned_empty_stays_and_reads_pass_it(open_log):
    log = open_log(SMALL_SEGMENTS)
    put(log, [(b"a", b"1"), (b"b", b"1")])  # 0..1
    log.roll()
    put(log, [(b"a", b"2" * 1500), (b"b", b"2")])  # 2..3: cleaned apart from 0..1 (see above)
    log.roll()
    log.clean()
    assert [(s.base_offset, s.size_bytes) for s in log.segments][0] == (0, 0)
    result = log.read(0)
    assert (result.first_offset, result.next_offset) == (0, 4)
    log.close()
    again = open_log(SMALL_SEGMENTS)
    assert [s.base_offset for s in again.segments] == [0, 2, 4]  # kept: it holds what the cleaner summarised
    assert [o for o, _, _ in read_all(again)] == [2, 3]


def test_a_gap_up_to_the_log_end_is_an_empty_reply_that_moves_the_reader_on(open_log, clock):
    log = open_log({**COMPACT, "delete.retention.ms": 0})
    put(log, [(b"a", b"1")])  # 0
    log.roll()
    put(log, [(b"a", None)], timestamp_ms=clock.now_ms - 1)  # 1: a tombstone, expired already
    log.roll()  # the active segment is empty: the log ends at 2
    log.clean()
    assert read_all(log) == [] and log.log_end_offset == 2
    skipped = log.read(0)
    assert (skipped.size_bytes, skipped.first_offset, skipped.next_offset) == (0, 0, 2)
    assert (log.read(1, max_offset=1), log.read(2)) == (None, None)  # at a bound: nothing to say yet
    put(log, [(b"b", b"1")])  # 2
    log.roll()
    put(log, [(b"c", b"1")])  # 3, active
    skipped = log.read(0, max_offset=3)
    assert (skipped.first_offset, skipped.next_offset) == (0, 3) and skipped.size_bytes > 0
    between = log.read(1, max_offset=2)  # the batch at 2 ends at the bound: only the gap before it
    assert (between.size_bytes, between.first_offset, between.next_offset) == (0, 1, 2)


def test_reopening_a_compacted_log_keeps_its_gaps(open_log, tmp_path):
    log = open_log(COMPACT)
    for i in range(6):
        put(log, [(b"k%d" % (i % 2), b"%d" % i), (b"x", b"%d" % i)])
        log.roll()
    log.clean()
    before = read_all(log)
    log.close()
    os.unlink(os.path.join(log.directory, "recovery-point"))  # rescan everything on open
    again = open_log(COMPACT)
    assert again.recovery.errors == () and again.recovery.truncated_bytes == 0
    assert read_all(again) == before
    assert again.append(encode_batch([b"v"], [b"k0"])).base_offset == 12


def test_tombstones_stay_for_delete_retention_ms_then_go(open_log, clock):
    log = open_log({**COMPACT, "delete.retention.ms": 60_000})
    put(log, [(b"a", b"1"), (b"b", b"1")], timestamp_ms=clock.now_ms)
    put(log, [(b"a", None)], timestamp_ms=clock.now_ms)
    log.roll()
    put(log, [(b"c", b"1")])
    log.clean()
    assert read_all(log) == [(1, b"b", b"1"), (2, b"a", None), (3, b"c", b"1")]
    due = log.next_cleaning_ms()
    assert due == clock.now_ms + 60_001  # the tombstone's timestamp + delete.retention.ms
    clock.now_ms = due - 1
    assert log.clean() == []
    clock.now_ms = due
    assert log.clean()
    assert read_all(log) == [(1, b"b", b"1"), (3, b"c", b"1")]
    assert log.next_cleaning_ms() is None
    log.close()
    assert [o for o, _, _ in read_all(open_log({**COMPACT, "delete.retention.ms": 60_000}))] == [1, 3]


def test_a_tombstone_removes_older_values_of_its_key_at_once(open_log, clock):
    log = open_log({**COMPACT, "delete.retention.ms": 60_000})
    put(log, [(b"a", b"1"), (b"a", b"2")], timestamp_ms=clock.now_ms)
    log.roll()
    put(log, [(b"a", None)], timestamp_ms=clock.now_ms)
    log.roll()
    log.clean()
    assert read_all(log) == [(2, b"a", None)]


def test_min_cleanable_dirty_ratio_decides_when_a_cleaning_is_due(open_log):
    log = open_log({"cleanup.policy": "compact", "min.cleanable.dirty.ratio": 0.5})
    for i in range(4):
        put(log, [(b"k%d" % i, b"v" * 100)])
        log.roll()
    assert log.clean()  # everything is dirty at first
    assert log.next_cleaning_ms() is None
    put(log, [(b"k0", b"w" * 100)])
    log.roll()  # dirty: 1 segment of 5 of the same size
    assert log.cleaning_plan() is None and log.next_cleaning_ms() is None
    for i in range(1, 4):
        put(log, [(b"k%d" % i, b"w" * 100)])
        log.roll()
    plan = log.cleaning_plan()  # dirty: 4 of 8
    assert plan is not None and [s.base_offset for s in plan.dirty] == [4, 5, 6, 7]
    log.clean()
    assert [v for _, _, v in read_all(log)] == [b"w" * 100] * 4


def test_min_compaction_lag_ms_keeps_recent_segments_as_they_are(open_log, clock):
    log = open_log({**COMPACT, "min.compaction.lag.ms": 10_000})
    put(log, [(b"k", b"old")], timestamp_ms=clock.now_ms - 20_000)
    log.roll()
    put(log, [(b"k", b"recent")], timestamp_ms=clock.now_ms - 5_000)
    log.roll()
    put(log, [(b"k", b"newest")], timestamp_ms=clock.now_ms)
    log.roll()
    assert log.clean()
    assert read_all(log) == [(0, b"k", b"old"), (1, b"k", b"recent"), (2, b"k", b"newest")]  # only 0 was cleanable
    assert log.next_cleaning_ms() == clock.now_ms + 5_000  # when segment 1 leaves the lag
    clock.now_ms += 5_000
    log.clean()
    assert read_all(log) == [(1, b"k", b"recent"), (2, b"k", b"newest")]


def test_a_compacted_topic_refuses_records_without_a_key_and_the_cleaner_drops_old_ones(open_log):
    log = open_log()  # delete policy: keyless records are fine
    log.append(encode_batch([b"no key"]))
    put(log, [(b"k", b"1")])
    log.roll()
    put(log, [(b"k", b"2")])
    log.close()
    log = open_log(COMPACT)
    with pytest.raises(InvalidRecordError, match="key"):
        log.append(encode_batch([b"x", b"y"], [b"k", None]))
    log.roll()
    log.clean()
    assert read_all(log) == [(2, b"k", b"2")]


def test_retention_does_not_apply_to_a_compact_only_topic(open_log, clock):
    log = open_log({**COMPACT, "retention.ms": 1000, "retention.bytes": 0})
    put(log, [(b"k", b"1")], timestamp_ms=clock.now_ms - 10_000)
    log.roll()
    put(log, [(b"j", b"1")])
    assert log.enforce_retention() == 0 and log.next_retention_ms() is None
    assert len(read_all(log)) == 2
    log.config = LogConfig.from_dict({**COMPACT, "cleanup.policy": "delete,compact", "retention.ms": 1000})
    assert log.config.cleanup_policy == "compact,delete"
    assert log.enforce_retention() == 1 and read_all(log) == [(1, b"j", b"1")]


def test_compressed_and_log_append_time_batches_keep_their_kind_when_split(open_log, clock):
    log = open_log({**COMPACT, "message.timestamp.type": "LogAppendTime"})
    put(log, [(b"a", b"1"), (b"b", b"1"), (b"c", b"1")], compression="zstd")
    append_time = clock.now_ms
    clock.now_ms += 1000
    put(log, [(b"b", b"2")])
    log.roll()
    log.clean()
    result = log.read(0)
    batches = rb.decode_batches(result.data)
    assert [(h.base_offset, h.record_count) for h, _ in batches] == [(0, 1), (2, 1), (3, 1)]
    for header, _ in batches[:2]:
        assert header.compression == "zstd" and header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME
        assert header.max_timestamp_ms == append_time and header.leader_epoch == 1
    assert log.offset_for_timestamp(append_time) == 0
    assert log.offset_for_timestamp(append_time + 1) == 3


def test_a_run_split_from_a_big_batch_holds_only_its_own_rows(open_log):
    log = open_log(COMPACT)
    keys = [b"gone-%d" % (i % 10) if i % 500 else b"kept-%d" % i for i in range(2000)]
    put(log, [(key, b"v" * 20) for key in keys])
    put(log, [(b"gone-%d" % i, b"latest") for i in range(10)])
    log.roll()
    put(log, [(b"z", b"active")])
    [cleaned] = log.clean()
    runs = rb.decode_batches(log.read(0, 1 << 20).data)
    assert [(h.base_offset, h.record_count) for h, _ in runs][:4] == [(0, 1), (500, 1), (1000, 1), (1500, 1)]
    # Four one-record batches, not four copies of the big batch's columns.
    assert all(h.size_bytes < 1024 for h, _ in runs) and cleaned.bytes_after < cleaned.bytes_before // 4


def test_many_small_segments_are_cleaned_into_few(open_log):
    log = open_log({**COMPACT, "segment.bytes": 64 << 10})
    for i in range(40):
        put(log, [(b"k%d" % (i % 4), b"v%d" % i)])
        log.roll()
    log.clean()
    assert len(log.segments) == 2  # one cleaned segment and the active one
    assert [(o, v) for o, _, v in read_all(log)] == [(36, b"v36"), (37, b"v37"), (38, b"v38"), (39, b"v39")]
    summary = read_summary(log.segments[0].summary_path)
    assert summary.end_offset == 40 and summary.producers == ()


def test_idempotent_producer_state_survives_compaction_and_a_restart(open_log):
    log = open_log(COMPACT)
    pid, epoch = 7, 0

    def produce(sequence, pairs):
        batch = encode_batch([v for _, v in pairs], [k for k, _ in pairs], producer_id=pid, producer_epoch=epoch, base_sequence=sequence)
        return log.append(batch, leader_epoch=1), batch

    produce(0, [(b"a", b"1"), (b"b", b"1"), (b"c", b"1")])
    produce(3, [(b"a", b"2"), (b"b", b"2")])
    log.roll()
    _, last = produce(5, [(b"a", b"3"), (b"b", b"3")])  # supersedes every record above but c's
    log.roll()
    log.append(encode_batch([b"other"], [b"z"]), leader_epoch=1)  # the active segment
    table = sorted(log.producer_state.entries())
    log.clean()
    assert [o for o, _, _ in read_all(log)] == [2, 5, 6, 7]
    cleaned_batch = rb.decode_batches(log.read(2).data)[0][0]
    assert (cleaned_batch.producer_id, cleaned_batch.base_sequence) == (pid, 2)  # c's own sequence number
    log.close()
    again = open_log(COMPACT)
    assert sorted(again.producer_state.entries()) == table
    retry = again.append(last, leader_epoch=1)  # the last batch, sent again: known, not written twice
    assert retry.duplicate and retry.base_offset == 5
    assert again.append(encode_batch([b"4"], [b"a"], producer_id=pid, producer_epoch=epoch, base_sequence=7)).base_offset == 8


def test_a_truncation_inside_a_cleaned_segment_drops_the_producer_entries_above_it(open_log):
    log = open_log(COMPACT)
    for sequence in range(4):
        log.append(encode_batch([b"v"], [b"k%d" % (sequence % 2)], producer_id=3, producer_epoch=0, base_sequence=sequence))
    log.roll()
    log.append(encode_batch([b"w"], [b"k9"]))
    log.clean()
    assert [o for o, _, _ in read_all(log)] == [2, 3, 4]
    log.truncate_to(3)
    assert [entry[4] for entry in log.producer_state.entries()] == [0, 1, 2]
    assert log.producer_state.producers[3].last_sequence == 2


def test_batches_appended_after_a_truncation_into_a_cleaned_segment_keep_their_producer_state(open_log):
    log = open_log(COMPACT)
    for sequence in range(4):
        log.append(encode_batch([b"v"], [b"k%d" % (sequence % 2)], producer_id=3, producer_epoch=0, base_sequence=sequence))
    log.roll()
    log.append(encode_batch([b"w"], [b"k9"]))
    log.clean()  # segment 0 is a cleaned one now: offsets 2 and 3
    log.truncate_to(3)  # it becomes the active segment
    assert read_summary(os.path.join(log.directory, segment_file_name(0, SUMMARY_SUFFIX))).end_offset == 3
    appended = log.append(encode_batch([b"x"], [b"k7"], producer_id=8, producer_epoch=0, base_sequence=0))
    assert appended.base_offset == 3
    table = sorted(log.producer_state.entries())
    log.close()
    again = open_log(COMPACT)
    assert sorted(again.producer_state.entries()) == table  # producer 8's batch counted by its header
    retry = again.append(encode_batch([b"x"], [b"k7"], producer_id=8, producer_epoch=0, base_sequence=0))
    assert retry.duplicate and retry.base_offset == 3
    again.roll()
    put(again, [(b"k9", b"2")])
    assert again.clean()  # segment 0 cleaned again, with what was appended to it
    assert sorted(again.producer_state.entries()) == table
    again.close()
    assert sorted(open_log(COMPACT).producer_state.entries()) == table


def test_records_appended_after_a_truncation_are_cleaned_like_any_new_ones(open_log):
    log = open_log(COMPACT)
    for i in range(4):
        put(log, [(b"k%d" % i, b"1")])
        log.roll()
    put(log, [(b"z", b"1")])
    log.clean()  # everything below 4 is clean now
    log.truncate_to(2)  # a follower cutting a divergent tail
    put(log, [(b"k0", b"2")])  # 2: supersedes offset 0
    log.roll()
    put(log, [(b"z", b"2")])
    log.clean()
    assert read_all(log) == [(1, b"k1", b"1"), (2, b"k0", b"2"), (3, b"z", b"2")]


def test_a_follower_copies_a_compacted_leader_and_passes_every_gap(open_log, tmp_path, clock):
    config = {**COMPACT, "delete.retention.ms": 0}
    leader = open_log(config, directory=tmp_path / "leader")
    put(leader, [(b"a", b"1"), (b"b", b"1")])  # 0..1
    put(leader, [(b"a", b"2")])  # 2
    leader.roll()
    put(leader, [(b"c", None)], timestamp_ms=clock.now_ms - 1)  # 3: an expired tombstone
    leader.roll()  # empty active at 4: after cleaning the leader's log has no batch from 3 on
    leader.clean()
    assert [o for o, _, _ in read_all(leader)] == [1, 2] and leader.log_end_offset == 4
    follower = open_log(config, directory=tmp_path / "follower")
    replies = []
    while follower.log_end_offset < leader.log_end_offset:
        reply = leader.read(follower.log_end_offset, max_bytes=64)
        replies.append((reply.first_offset, reply.next_offset, reply.size_bytes > 0))
        follower.append_as_follower(reply.data, reply.first_offset, reply.next_offset)
    assert replies == [(0, 2, True), (2, 3, True), (3, 4, False)]
    assert read_all(follower) == read_all(leader) and follower.log_end_offset == 4
    follower.close()
    again = open_log(config, directory=tmp_path / "follower")
    assert again.recovery.errors == () and read_all(again) == read_all(leader) and again.log_end_offset == 4
    # A follower that had the records before the leader compacted them passes the gap at its end.
    behind = open_log(COMPACT, directory=tmp_path / "behind")
    leader2 = open_log(COMPACT, directory=tmp_path / "leader2")
    put(leader2, [(b"a", b"1")])
    put(leader2, [(b"b", b"1")])
    reply = leader2.read(0, max_bytes=1)
    behind.append_as_follower(reply.data, reply.first_offset, reply.next_offset)
    put(leader2, [(b"b", b"2")])
    leader2.roll()
    leader2.clean()  # offset 1 is gone; nothing at all between 1 and the leader's end but offset 2
    leader2.roll()
    reply = leader2.read(behind.log_end_offset)
    assert (reply.first_offset, reply.next_offset) == (1, 3)
    behind.append_as_follower(reply.data, reply.first_offset, reply.next_offset)
    assert read_all(behind) == read_all(leader2)
    behind.close()
    assert read_all(open_log(COMPACT, directory=tmp_path / "behind")) == read_all(leader2)


def test_an_empty_reply_that_covers_the_log_end_moves_it(open_log, tmp_path):
    follower = open_log(COMPACT)
    put(follower, [(b"a", b"1")])
    follower.append_as_follower(b"", first_offset=1, next_offset=7)
    assert follower.log_end_offset == 7
    follower.append_as_follower(b"", first_offset=9, next_offset=12)  # does not cover 7: no move
    assert follower.log_end_offset == 7
    follower.append_as_follower(encode_batch([b"v"], [b"b"], base_offset=7))
    follower.close()
    again = open_log(COMPACT)
    assert again.recovery.errors == ()
    assert read_all(again) == [(0, b"a", b"1"), (7, b"b", b"v")]


def test_without_a_covering_reply_a_follower_still_refuses_gaps(open_log, tmp_path):
    leader = open_log(COMPACT, directory=tmp_path / "leader")
    put(leader, [(b"a", b"1"), (b"b", b"1")])
    put(leader, [(b"c", b"1")])
    follower = open_log(COMPACT, directory=tmp_path / "follower")
    reply = leader.read(2)
    with pytest.raises(InvalidRecordError, match="does not continue"):
        follower.append_as_follower(reply.data)
    with pytest.raises(InvalidRecordError, match="does not continue"):
        follower.append_as_follower(reply.data, first_offset=2)  # covers from 2, the follower ends at 0
    assert follower.log_end_offset == 0
    assert not os.path.exists(os.path.join(follower.directory, OFFSET_GAPS_FILE))


# --- delete_records -----------------------------------------------------------------------------------


def test_delete_records_moves_the_log_start_and_drops_whole_segments_below_it(open_log, clock):
    log = open_log()
    for i in range(3):
        log.append(encode_batch([b"a%d" % i, b"b%d" % i], timestamps_ms=[clock.now_ms + i] * 2))
        log.roll()
    log.append(encode_batch([b"active"]))
    assert log.delete_records(3) == 3
    assert [s.base_offset for s in log.segments] == [2, 4, 6]
    with pytest.raises(OffsetOutOfRangeError):
        log.read(2)
    assert [o for o, _, _ in read_all(log)] == [3, 4, 5, 6]
    assert log.offset_for_timestamp(clock.now_ms) == 3  # not 2: below the start
    assert log.delete_records(1) == 3  # below the start: nothing changes
    with pytest.raises(OffsetOutOfRangeError):
        log.delete_records(8)
    log.close()
    again = open_log()
    assert again.log_start_offset == 3 and [o for o, _, _ in read_all(again)] == [3, 4, 5, 6]
    assert again.delete_records(7) == 7 and len(again.segments) == 1 and read_all(again) == []


def test_a_follower_started_at_a_log_start_inside_a_batch_takes_that_batch(open_log, tmp_path):
    leader = open_log(directory=tmp_path / "leader")
    leader.append(encode_batch([b"a", b"b", b"c", b"d"]))
    leader.delete_records(2)
    follower = open_log(directory=tmp_path / "follower")
    follower.truncate_fully_and_start_at(leader.log_start_offset)
    reply = leader.read(follower.log_end_offset)
    follower.append_as_follower(reply.data, reply.first_offset, reply.next_offset)
    assert follower.log_start_offset == 2 and follower.log_end_offset == 4
    assert [v for _, _, v in read_all(follower)] == [b"c", b"d"]


# --- interrupted swaps ------------------------------------------------------------------------------------


def compacted_fixture(open_log):
    """A log with three closed segments (offsets 0..5) to clean, and the records a cleaning keeps."""
    log = open_log(COMPACT)
    for i in range(3):
        put(log, [(b"a", b"%d" % i), (b"k%d" % i, b"x")])
        log.roll()
    put(log, [(b"z", b"active")])
    return log


def test_a_cleaning_that_did_not_commit_leaves_the_old_segments(open_log, tmp_path):
    log = compacted_fixture(open_log)
    before = read_all(log)
    plan = log.cleaning_plan()
    from logbus.storage.cleaner import build_offset_map, clean_group

    clean_group(plan, plan.groups[0], build_offset_map(plan))  # written, synced, not swapped in
    directory = log.directory
    base = plan.groups[0][0].base_offset
    os.rename(
        os.path.join(directory, segment_file_name(base, SUMMARY_SUFFIX) + CLEANED_SUFFIX),
        os.path.join(directory, segment_file_name(base, SUMMARY_SUFFIX) + SWAP_SUFFIX),
    )  # half way through the renames to .swap: the log's own rename had not happened
    log.close()
    again = open_log(COMPACT)
    assert read_all(again) == before
    assert not [n for n in os.listdir(directory) if n.endswith((CLEANED_SUFFIX, SWAP_SUFFIX))]
    assert len(again.recovery.swaps) == 1 and "discarded" in again.recovery.swaps[0]


@pytest.mark.parametrize("renamed", [0, 1, 2, 3])
def test_a_committed_swap_is_completed_on_open(open_log, tmp_path, renamed):
    """The swap committed (``.log.swap`` exists), then the process died with ``renamed`` of the
    summary, index and time index files renamed to their final names and the old segments still there."""
    log = compacted_fixture(open_log)
    plan = log.cleaning_plan()
    from logbus.storage.cleaner import SWAP_ORDER, build_offset_map, clean_group

    cleaned = clean_group(plan, plan.groups[0], build_offset_map(plan))
    for suffix in SWAP_ORDER:
        os.replace(cleaned.path(suffix), cleaned.path(suffix, SWAP_SUFFIX))
    for suffix in SWAP_ORDER[:renamed]:
        os.replace(cleaned.path(suffix, SWAP_SUFFIX), cleaned.path(suffix, ""))
    log.close()
    again = open_log(COMPACT)
    assert [o for o, _, _ in read_all(again)] == [1, 3, 4, 5, 6]
    assert [s.base_offset for s in again.segments] == [0, 6]
    assert not [n for n in os.listdir(again.directory) if n.endswith((CLEANED_SUFFIX, SWAP_SUFFIX))]
    assert "completed" in again.recovery.swaps[0]


def test_a_swap_is_refused_when_the_log_changed_meanwhile(open_log):
    log = compacted_fixture(open_log)
    plan = log.cleaning_plan()
    from logbus.storage.cleaner import build_offset_map, clean_group

    cleaned = clean_group(plan, plan.groups[0], build_offset_map(plan))
    log.truncate_to(3)  # a follower's truncation by epoch, say
    assert log.replace_segments(cleaned) is False
    assert not [n for n in os.listdir(log.directory) if n.endswith(CLEANED_SUFFIX)]
    assert [o for o, _, _ in read_all(log)] == [0, 1]


# --- configs --------------------------------------------------------------------------------------------


def test_the_compaction_configs_are_validated():
    config = LogConfig.from_dict({"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.25", "delete.retention.ms": 5})
    assert (config.compact, config.delete, config.min_cleanable_dirty_ratio, config.delete_retention_ms) == (True, False, 0.25, 5)
    assert LogConfig().delete and not LogConfig().compact
    for bad in ({"cleanup.policy": "shred"}, {"cleanup.policy": "compact,compact"}, {"cleanup.policy": 1},
                {"min.cleanable.dirty.ratio": 1.5}, {"min.cleanable.dirty.ratio": "nan"}, {"min.cleanable.dirty.ratio": True},
                {"min.compaction.lag.ms": -1}, {"delete.retention.ms": -1}):
        with pytest.raises(InvalidConfigError):
            LogConfig.from_dict(bad)
    assert LogConfig.from_dict(LogConfig.from_dict({"cleanup.policy": "delete, compact"}).to_dict()).cleanup_policy == "compact,delete"


# --- the property -------------------------------------------------------------------------------------------

KEYS = [b"k%d" % i for i in range(6)]
append = st.tuples(
    st.just("append"),
    st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), st.binary(min_size=1, max_size=24))), min_size=1, max_size=6),
)
operation = st.one_of(
    append,
    append,
    st.tuples(st.just("roll"), st.none()),
    st.tuples(st.just("clean"), st.one_of(st.just(1.0), st.floats(0, 1))),  # the upper bound, as a share of the log
    st.tuples(st.just("tick"), st.integers(0, 40_000)),
    st.tuples(st.just("reopen"), st.none()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(operation, min_size=15, max_size=60))
def test_property_compaction_keeps_the_latest_record_per_key_and_never_moves_an_offset(tmp_path_factory, operations):
    directory = tmp_path_factory.mktemp("log") / "t-0"
    now = [1_700_000_000_000]
    config = LogConfig.from_dict({**COMPACT, "segment.bytes": 2048, "delete.retention.ms": 30_000})
    log = PartitionLog(str(directory), config, clock_ms=lambda: now[0])
    written = {}  # offset -> (key, value, timestamp)
    bound_seen = 0  # upper bounds only grow, as a high watermark does
    cleaned_to, cleaned_at = 0, None  # the end of the last cleaning, and when it ran
    try:
        for kind, argument in operations:
            if kind == "append":
                base = put(log, argument, timestamp_ms=now[0])
                for i, (key, value) in enumerate(argument):
                    written[base + i] = (key, value, now[0])
            elif kind == "roll":
                log.roll()
            elif kind == "tick":
                now[0] += argument
            elif kind == "reopen":
                log.close()
                log = PartitionLog(str(directory), config, clock_ms=lambda: now[0])
            else:
                bound_seen = max(bound_seen, int(argument * log.log_end_offset))
                done = log.clean(upper_bound=bound_seen)
                if done:
                    event(f"cleaned, removing {'some' if sum(c.records_removed for c in done) else 'no'} records")
                    assert done[-1].end_offset >= cleaned_to
                    cleaned_to, cleaned_at = done[-1].end_offset, now[0]
            got = read_all(log)
            offsets = [o for o, _, _ in got]
            assert offsets == sorted(set(offsets))  # offsets only increase
            for offset, key, value in got:
                assert written[offset][:2] == (key, value)  # each record is the one written at its offset
            assert log.log_end_offset == (max(written) + 1 if written else 0)
            # Below the last cleaning's end: exactly the latest record of each key there, less the
            # tombstones that had expired when it ran. At and above it: everything written.
            expected = []
            if cleaned_to:
                latest = {}
                for offset in sorted(o for o in written if o < cleaned_to):
                    latest[written[offset][0]] = offset
                for offset in sorted(latest.values()):
                    key, value, timestamp = written[offset]
                    if value is not None or cleaned_at - timestamp <= 30_000:
                        expected.append((offset, key, value))
            expected += [(o, *written[o][:2]) for o in sorted(written) if o >= cleaned_to]
            assert got == expected
    finally:
        log.close()
