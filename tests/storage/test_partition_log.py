"""Partition log: offsets, reads, roll, retention, indexes, truncation, reopen, bad input."""

import os

import pytest

from logbus.errors import InvalidConfigError, InvalidRecordError, InvalidTopicError, OffsetOutOfRangeError, RecordTooLargeError
from logbus.storage import LogConfig, decode_batches, encode_batch
from logbus.storage.names import partition_dir_name, validate_topic_name


def values_of(result):
    return [value for _, records in decode_batches(result.data) for value in records.column("value").to_pylist()]


def offsets_of(result):
    return [h.base_offset + i for h, records in decode_batches(result.data) for i in range(records.num_rows)]


def fill(log, batches, per_batch, timestamp_ms=None, prefix=b"v"):
    for b in range(batches):
        values = [b"%s-%d-%d" % (prefix, b, i) for i in range(per_batch)]
        stamps = None if timestamp_ms is None else [timestamp_ms] * per_batch
        log.append(encode_batch(values, timestamps_ms=stamps), leader_epoch=1)


def read_all(log, start=None, max_bytes=1 << 20):
    offset = log.log_start_offset if start is None else start
    values, offsets = [], []
    while True:
        result = log.read(offset, max_bytes)
        if result is None:
            return offsets, values
        offsets += offsets_of(result)
        values += values_of(result)
        offset = result.next_offset


def test_append_assigns_contiguous_offsets_and_reads_back(open_log):
    log = open_log()
    first = log.append(encode_batch([b"a", b"b", b"c"]), leader_epoch=3)
    second = log.append(encode_batch([b"d"]), leader_epoch=3)
    assert (first.base_offset, first.last_offset, second.base_offset) == (0, 2, 3)
    assert log.log_end_offset == 4
    offsets, values = read_all(log)
    assert offsets == [0, 1, 2, 3] and values == [b"a", b"b", b"c", b"d"]
    header, _ = decode_batches(log.read(3).data)[0]
    assert header.leader_epoch == 3


def test_read_mid_batch_returns_whole_batch_and_respects_max_offset(open_log):
    log = open_log()
    fill(log, batches=5, per_batch=10)
    result = log.read(25, max_bytes=1)  # smaller than a batch: the first batch still comes
    assert result.first_offset == 20 and result.next_offset == 30
    assert log.read(25, max_bytes=1 << 20, max_offset=30).next_offset == 30
    assert log.read(25, max_bytes=1 << 20, max_offset=29) is None  # batch 20..29 not below the watermark
    assert log.read(50) is None  # at the end: nothing yet, not an error


def test_read_out_of_range(open_log):
    log = open_log()
    fill(log, batches=2, per_batch=5)
    with pytest.raises(OffsetOutOfRangeError):
        log.read(11)
    with pytest.raises(OffsetOutOfRangeError):
        log.read(-1)


def test_roll_by_size_and_read_across_segments(open_log):
    log = open_log({"segment.bytes": 4096, "index.interval.bytes": 512})
    fill(log, batches=60, per_batch=8)
    assert len(log.segments) > 5
    for earlier, later in zip(log.segments, log.segments[1:]):
        assert earlier.next_offset == later.base_offset
        assert earlier.size_bytes <= 4096
    offsets, values = read_all(log, max_bytes=2048)
    assert offsets == list(range(480))
    assert values == [b"v-%d-%d" % (b, i) for b in range(60) for i in range(8)]
    names = sorted(os.listdir(log.directory))
    assert "00000000000000000000.log" in names and "00000000000000000000.index" in names


def test_index_lookup_finds_every_offset(open_log):
    log = open_log({"index.interval.bytes": 300})
    fill(log, batches=40, per_batch=3)
    assert len(log.active_segment.offset_index) > 5
    for offset in range(120):
        result = log.read(offset, max_bytes=1)
        assert result.first_offset <= offset < result.next_offset


def test_roll_by_age(open_log, clock):
    log = open_log({"segment.ms": 1000})
    fill(log, batches=1, per_batch=2, timestamp_ms=clock.now_ms)
    clock.now_ms += 999
    fill(log, batches=1, per_batch=2, timestamp_ms=clock.now_ms)
    assert len(log.segments) == 1
    clock.now_ms += 1
    fill(log, batches=1, per_batch=2, timestamp_ms=clock.now_ms)
    assert [s.base_offset for s in log.segments] == [0, 4]


def test_retention_by_time_moves_log_start(open_log, clock):
    log = open_log({"segment.bytes": 2048, "retention.ms": 10_000})
    fill(log, batches=20, per_batch=5, timestamp_ms=clock.now_ms - 20_000, prefix=b"old")
    old_end = log.log_end_offset
    fill(log, batches=3, per_batch=5, timestamp_ms=clock.now_ms, prefix=b"new")
    deleted = log.enforce_retention()
    assert deleted > 0
    assert 0 < log.log_start_offset <= old_end
    offsets, values = read_all(log)
    assert offsets[0] == log.log_start_offset and offsets[-1] == log.log_end_offset - 1
    assert all(v.startswith(b"new") for v in values[-15:])
    with pytest.raises(OffsetOutOfRangeError):
        log.read(0)


def test_retention_by_time_rolls_a_lone_expired_active_segment(open_log, clock):
    log = open_log({"retention.ms": 1000})
    fill(log, batches=2, per_batch=5, timestamp_ms=clock.now_ms)
    clock.now_ms += 5000
    assert log.enforce_retention() == 1
    assert log.log_start_offset == log.log_end_offset == 10
    fill(log, batches=1, per_batch=1, timestamp_ms=clock.now_ms)
    assert read_all(log)[0] == [10]


def test_retention_by_size(open_log):
    log = open_log({"segment.bytes": 2048, "retention.bytes": 6000})
    fill(log, batches=40, per_batch=5)
    log.enforce_retention()
    assert log.size_bytes - log.segments[0].size_bytes < 6000
    assert log.size_bytes >= 6000 - 2048
    offsets, _ = read_all(log)
    assert offsets == list(range(log.log_start_offset, 200))


def test_offset_for_timestamp(open_log):
    log = open_log({"segment.bytes": 2048, "index.interval.bytes": 256})
    for b in range(30):
        log.append(encode_batch([b"x"] * 4, timestamps_ms=[1000 + b * 10 + i for i in range(4)]))
    assert log.offset_for_timestamp(0) == 0
    assert log.offset_for_timestamp(1000) == 0
    assert log.offset_for_timestamp(1001) == 1
    assert log.offset_for_timestamp(1004) == 4  # between batches: first record of the next batch
    assert log.offset_for_timestamp(1152) == 15 * 4 + 2
    assert log.offset_for_timestamp(1293) == 119
    assert log.offset_for_timestamp(1294) is None


def test_truncate_to_removes_whole_batches_and_appends_continue(open_log):
    log = open_log({"segment.bytes": 2048})
    fill(log, batches=40, per_batch=5)
    assert log.truncate_to(103) == 100  # offset inside the batch 100..104: the batch goes whole
    assert log.log_end_offset == 100
    log.append(encode_batch([b"after"]))
    offsets, values = read_all(log)
    assert offsets == list(range(101)) and values[-1] == b"after"
    assert log.truncate_to(1000) == 101  # past the end: nothing to do


def test_truncate_fully_and_start_at(open_log):
    log = open_log()
    fill(log, batches=3, per_batch=5)
    log.truncate_fully_and_start_at(500)
    assert log.log_start_offset == log.log_end_offset == 500
    log.append(encode_batch([b"x"]))
    assert read_all(log)[0] == [500]


def test_follower_append_keeps_offsets_and_rejects_gaps(open_log, tmp_path):
    leader = open_log(directory=tmp_path / "leader")
    fill(leader, batches=4, per_batch=3)
    follower = open_log(directory=tmp_path / "follower")
    fetched = leader.read(0, max_bytes=1 << 20)
    result = follower.append_as_follower(fetched.data)
    assert result.base_offset == 0 and follower.log_end_offset == 12
    assert read_all(follower) == read_all(leader)
    with pytest.raises(InvalidRecordError, match="does not continue"):
        follower.append_as_follower(leader.read(3).data)
    assert follower.log_end_offset == 12


def test_reopen_after_clean_close(open_log, tmp_path):
    log = open_log({"segment.bytes": 2048})
    fill(log, batches=30, per_batch=5)
    before = read_all(log)
    segments = len(log.segments)
    log.close()
    again = open_log({"segment.bytes": 2048})
    assert again.recovery.truncated_bytes == 0 and again.recovery.segments_scanned == 1
    assert len(again.segments) == segments
    assert read_all(again) == before
    again.append(encode_batch([b"next"]))
    assert again.log_end_offset == 151


def test_reopen_with_missing_indexes_rebuilds_them(open_log, tmp_path):
    log = open_log({"segment.bytes": 2048, "index.interval.bytes": 256})
    fill(log, batches=30, per_batch=5)
    before = read_all(log)
    log.close()
    for name in os.listdir(log.directory):
        if name.endswith(".index") or name.endswith(".timeindex"):
            os.unlink(os.path.join(log.directory, name))
    again = open_log({"segment.bytes": 2048, "index.interval.bytes": 256})
    assert read_all(again) == before
    assert again.offset_for_timestamp(0) == 0


def test_record_too_large_writes_nothing(open_log):
    log = open_log({"max.message.bytes": 1024})
    with pytest.raises(RecordTooLargeError):
        log.append(encode_batch([b"x" * 2000]))
    assert log.log_end_offset == 0 and log.size_bytes == 0


def test_garbage_append_writes_nothing(open_log):
    log = open_log()
    good = encode_batch([b"a"])
    for bad in (b"", b"nonsense" * 10, good[:-8], good + good, good[:30] + bytes([good[30] ^ 1]) + good[31:]):
        with pytest.raises(InvalidRecordError):
            log.append(bad)
    assert log.size_bytes == 0


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "x" * 250, "spaces here", "é", None, 5])
def test_invalid_topic_names_are_rejected(name):
    with pytest.raises(InvalidTopicError):
        validate_topic_name(name)
    with pytest.raises(InvalidTopicError):
        partition_dir_name(name, 0)


@pytest.mark.parametrize("name", ["a", "A.b_c-9", "x" * 249, "__consumer_offsets"])
def test_valid_topic_names(name):
    assert validate_topic_name(name) == name


@pytest.mark.parametrize(
    "config",
    [{"segment.bytes": 0}, {"retention.ms": "soon"}, {"flush.policy": "sometimes"}, {"no.such.key": 1}, {"segment.ms": True},
     {"cache.tail.bytes": -2}],
)
def test_invalid_config_is_rejected(config):
    with pytest.raises(InvalidConfigError):
        LogConfig.from_dict(config)


@pytest.mark.parametrize("policy", ["os", "interval", "batch"])
def test_every_flush_policy_appends_and_reopens(open_log, policy, clock):
    log = open_log({"flush.policy": policy, "flush.ms": 10})
    fill(log, batches=3, per_batch=4)
    clock.now_ms += 20
    assert log.maybe_flush() is (policy == "interval")
    log.close()
    assert read_all(open_log({"flush.policy": policy}))[0] == list(range(12))


def test_log_append_time_stamps_each_batch_and_keeps_it_valid(open_log, clock):
    """message.timestamp.type=LogAppendTime: the leader stamps the append time; the CRC still checks."""
    from logbus.storage import record_batch as rb

    log = open_log({"message.timestamp.type": "LogAppendTime"})
    log.append(encode_batch([b"a", b"b"], timestamps_ms=[5, 6]), leader_epoch=1)
    clock.now_ms += 1_000
    appended = log.append(encode_batch([b"c"], timestamps_ms=[7]), leader_epoch=1)
    assert appended.max_timestamp_ms == clock.now_ms
    batches = decode_batches(log.read(0, 1 << 20).data, verify_crc=True)  # raises if a CRC were stale
    assert [(h.reader_timestamp_type, h.first_timestamp_ms, h.max_timestamp_ms) for h, _ in batches] == [
        (rb.TIMESTAMP_TYPE_LOG_APPEND_TIME, clock.now_ms - 1_000, clock.now_ms - 1_000),
        (rb.TIMESTAMP_TYPE_LOG_APPEND_TIME, clock.now_ms, clock.now_ms),
    ]
    assert log.offset_for_timestamp(clock.now_ms - 1) == 2  # the time index follows the append times
    reopened_values = values_of(log.read(0, 1 << 20))
    assert reopened_values == [b"a", b"b", b"c"]


def test_create_time_keeps_the_producers_timestamps(open_log):
    from logbus.storage import record_batch as rb

    log = open_log()
    log.append(encode_batch([b"a"], timestamps_ms=[5]), leader_epoch=1)
    [(header, _)] = decode_batches(log.read(0).data)
    assert (header.reader_timestamp_type, header.max_timestamp_ms) == (rb.TIMESTAMP_TYPE_CREATE_TIME, 5)


def test_unknown_timestamp_type_is_refused():
    with pytest.raises(InvalidConfigError, match="message.timestamp.type"):
        LogConfig.from_dict({"message.timestamp.type": "BrokerTime"})


def test_next_retention_time_says_when_the_oldest_data_expires(open_log, clock):
    log = open_log({"retention.ms": 10_000, "segment.bytes": 1024})
    assert log.next_retention_ms() is None  # nothing written
    fill(log, batches=1, per_batch=2, timestamp_ms=clock.now_ms)
    assert log.next_retention_ms() == clock.now_ms + 10_001
    fill(log, batches=20, per_batch=5, timestamp_ms=clock.now_ms + 5_000)  # rolls segments
    first_deadline = log.next_retention_ms()
    assert first_deadline == clock.now_ms + 10_001
    clock.now_ms = first_deadline
    assert log.enforce_retention() >= 1
    assert log.next_retention_ms() > first_deadline
    assert open_log({"retention.ms": -1}, directory=log.directory + "-forever").next_retention_ms() is None


def test_offset_for_timestamp_of_a_log_append_time_batch_is_its_first_offset(open_log, clock):
    log = open_log({"message.timestamp.type": "LogAppendTime"})
    log.append(encode_batch([b"a", b"b", b"c"], timestamps_ms=[1, 2, clock.now_ms + 99]), leader_epoch=1)
    # The producers' create times would pick offset 2; every record's time is the batch's append time.
    assert log.offset_for_timestamp(clock.now_ms) == 0
    assert log.offset_for_timestamp(clock.now_ms + 1) is None
