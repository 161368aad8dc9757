"""The partition log's post-conditions (see its module docstring): they hold through every operation,
and a state that breaks one (memory corrupted as a bug would, or the log's test hook) makes the
operation raise InvariantViolationError, after which the files reopen into a whole log. The test hook
is refused in a process started without LOGBUS_TEST_HOOKS=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import os

import pytest

from logbus import invariant
from logbus.errors import IllegalStateError, InvariantViolationError
from logbus.storage import batch_header as bh
from logbus.storage import encode_batch
from logbus.storage.partition_log import LOG_START_OFFSET_FILE
from tests.storage.test_partition_log import fill, read_all

SMALL_SEGMENTS = {"segment.bytes": 1024}


def test_the_test_hook_is_off_by_default_and_breaks_one_append(open_log, tmp_path):
    log = open_log()
    assert log._break_next_append is False
    log.append(encode_batch([b"a", b"b"]), leader_epoch=1)
    log.test_hook_break_next_append()
    with pytest.raises(InvariantViolationError, match=r"the log end is 4 after a batch at \[2, 4\) was appended to a log ending at 2"):
        log.append(encode_batch([b"c", b"d"]), leader_epoch=1)
    assert log._break_next_append is False  # one append only
    log.append(encode_batch([b"e"]), leader_epoch=1)
    log.close()
    # What a replica's restart finds: every batch written, at its offsets (the one whose check
    # failed was whole in the file: the check runs after the write).
    again = open_log()
    assert read_all(again) == ([0, 1, 2, 3, 4], [b"a", b"b", b"c", b"d", b"e"])
    assert again.recovery.truncated_bytes == 0


def test_the_hook_breaks_a_followers_append_too(open_log, tmp_path):
    leader = open_log(directory=tmp_path / "leader")
    fill(leader, batches=3, per_batch=2)
    follower = open_log(directory=tmp_path / "follower")
    follower.test_hook_break_next_append()
    with pytest.raises(InvariantViolationError, match="after a batch at"):
        follower.append_as_follower(leader.read(0, 1 << 20).data, 0, leader.log_end_offset)


@pytest.mark.parametrize("switch", [None, "0", "true", ""])
def test_the_test_hook_is_refused_in_a_process_started_without_the_switch(open_log, monkeypatch, switch):
    """Outside the tests (LOGBUS_TEST_HOOKS unset, or anything but "1") the hook refuses with a
    logbus error and changes nothing: the next appends go through."""
    if switch is None:
        monkeypatch.delenv(invariant.TEST_HOOKS_ENV, raising=False)
    else:
        monkeypatch.setenv(invariant.TEST_HOOKS_ENV, switch)
    assert not invariant.test_hooks_enabled()
    log = open_log()
    with pytest.raises(IllegalStateError, match=r"test_hook_break_next_append is a test hook and is refused: .* LOGBUS_TEST_HOOKS=1"):
        log.test_hook_break_next_append()
    log.append(encode_batch([b"a", b"b"]), leader_epoch=1)
    log.append(encode_batch([b"c"]), leader_epoch=1)
    assert read_all(log) == ([0, 1, 2], [b"a", b"b", b"c"])


def test_the_test_hook_is_accepted_with_the_switch(open_log, monkeypatch):
    monkeypatch.setenv(invariant.TEST_HOOKS_ENV, "1")
    assert invariant.test_hooks_enabled()
    log = open_log()
    log.test_hook_break_next_append()
    with pytest.raises(InvariantViolationError, match="after a batch at"):
        log.append(encode_batch([b"a"]), leader_epoch=1)


def test_an_append_after_the_segment_index_went_wrong_raises(open_log):
    log = open_log()
    fill(log, batches=2, per_batch=3)
    log._bases[-1] += 1  # the offsets reads bisect no longer match the segments
    with pytest.raises(InvariantViolationError, match="active segment at 0 does not continue the log"):
        log.append(encode_batch([b"x"]), leader_epoch=1)


def test_an_append_after_a_hole_between_the_last_two_segments_raises(open_log):
    log = open_log({"segment.bytes": 2048})
    fill(log, batches=3, per_batch=5)  # two batches in the first segment, one in the active one (room for more)
    assert [segment.base_offset for segment in log.segments] == [0, 10]
    log.segments[-2].next_offset -= 1  # the closed segment's end went back, as a bug would put it
    with pytest.raises(InvariantViolationError, match=r"active segment at \d+ does not continue the log \(the segment before ends at"):
        log.append(encode_batch([b"y"]), leader_epoch=1)


@pytest.mark.parametrize("offset", [10, 12, 3, 0])
def test_truncation_ends_the_log_at_the_start_of_the_batch_holding_the_point(open_log, offset):
    log = open_log(SMALL_SEGMENTS)
    fill(log, batches=6, per_batch=5)  # batches at 0, 5, 10, 15, 20, 25, several segments
    assert log.truncate_to(offset) == offset - offset % 5
    assert read_all(log)[0] == list(range(offset - offset % 5))


def test_a_truncation_over_segments_that_do_not_continue_one_another_raises(open_log):
    log = open_log(SMALL_SEGMENTS)
    fill(log, batches=6, per_batch=5)
    assert len(log.segments) >= 3
    log.segments[0].next_offset -= 1  # a hole between the first two segments
    with pytest.raises(InvariantViolationError, match=r"after a truncation, segment \d+ does not continue segment 0"):
        log.truncate_to(27)


def test_delete_records_moves_the_log_start_forward_only(open_log):
    log = open_log(SMALL_SEGMENTS)
    fill(log, batches=6, per_batch=5)
    assert log.delete_records(12) == 12
    assert log.delete_records(4) == 12  # below the start: nothing moves back
    assert log.segments[0].base_offset <= 12 < (log.segments[1].base_offset if len(log.segments) > 1 else 30)
    assert log.delete_records(30) == 30 and log.log_start_offset == log.log_end_offset == 30


def test_delete_records_over_a_broken_segment_index_raises(open_log):
    log = open_log(SMALL_SEGMENTS)
    fill(log, batches=6, per_batch=5)
    log._bases[0] = 1
    with pytest.raises(InvariantViolationError, match="after delete_records, the segment index"):
        log.delete_records(2)


def test_recovery_empties_a_log_whose_start_is_past_its_recovered_end(open_log, tmp_path):
    """delete_records wrote the log start, then a machine crash lost the unsynced records up to it:
    the reopened log starts empty at its log start (as Kafka's does), rather than ending before it."""
    log = open_log()
    fill(log, batches=4, per_batch=5)
    log.delete_records(15)
    log.close()
    segment = os.path.join(tmp_path, "topic-0", "00000000000000000000.log")
    with open(segment, "r+b") as file:  # the last two batches never reached the disk
        data = file.read()
        third = bh.read_header(data, 0).size_bytes
        third += bh.read_header(data, third).size_bytes
        file.truncate(third)
    again = open_log()
    assert (again.log_start_offset, again.log_end_offset) == (15, 15)
    assert read_all(again) == ([], [])
    assert any("past the recovered log end 10" in error for error in again.recovery.errors)
    assert open(os.path.join(tmp_path, "topic-0", LOG_START_OFFSET_FILE)).read().strip() == "15"
    again.append(encode_batch([b"next"]), leader_epoch=2)
    assert read_all(again) == ([15], [b"next"])
