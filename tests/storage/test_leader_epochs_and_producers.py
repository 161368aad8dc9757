"""Leader epoch cache (KIP-101/279 lookups) and idempotent producer state, through the partition log."""

import pytest

from logbus.errors import OutOfOrderSequenceError, ProducerFencedError
from logbus.storage import encode_batch
from logbus.storage.leader_epoch_cache import UNDEFINED_EPOCH, LeaderEpochCache


def test_epoch_cache_lookups(tmp_path):
    cache = LeaderEpochCache(str(tmp_path))
    cache.assign(1, 0)
    cache.assign(3, 10)
    cache.assign(4, 25)
    assert cache.end_offset_for(1, 40) == (1, 10)
    assert cache.end_offset_for(2, 40) == (1, 10)  # unknown epoch 2: the largest below it, ending where 3 began
    assert cache.end_offset_for(3, 40) == (3, 25)
    assert cache.end_offset_for(4, 40) == (4, 40)  # the latest epoch ends at the log end
    assert cache.end_offset_for(0, 40) == (UNDEFINED_EPOCH, -1)
    assert not cache.assign(2, 30)  # older epochs are ignored
    cache.truncate_from_end(25)
    assert cache.entries == [(1, 0), (3, 10)]
    cache.truncate_from_start(12)
    assert cache.entries == [(3, 12)]
    again = LeaderEpochCache(str(tmp_path))
    assert again.load() and again.entries == [(3, 12)]


def test_log_tracks_epochs_and_rebuilds_them(open_log, tmp_path):
    log = open_log()
    for epoch, count in ((0, 3), (0, 2), (2, 4), (5, 1)):
        log.append(encode_batch([b"x"] * count), leader_epoch=epoch)
    assert log.epochs.entries == [(0, 0), (2, 5), (5, 9)]
    log.truncate_to(7)  # cuts the epoch-2 batch (5..8) whole
    assert log.log_end_offset == 5 and log.epochs.entries == [(0, 0)]
    log.append(encode_batch([b"y"]), leader_epoch=6)
    log.close()
    import os

    os.unlink(os.path.join(log.directory, "leader-epoch-checkpoint"))
    reopened = open_log()
    assert reopened.epochs.entries == [(0, 0), (6, 5)]


def idempotent(values, sequence, producer_id=7, epoch=0):
    return encode_batch(values, producer_id=producer_id, producer_epoch=epoch, base_sequence=sequence)


def test_duplicates_are_not_written_twice(open_log):
    log = open_log()
    first = log.append(idempotent([b"a", b"b"], 0), leader_epoch=1)
    second = log.append(idempotent([b"c"], 2), leader_epoch=1)
    retry = log.append(idempotent([b"a", b"b"], 0), leader_epoch=1)
    assert retry.duplicate and retry.base_offset == first.base_offset == 0
    assert log.append(idempotent([b"c"], 2), leader_epoch=1).base_offset == second.base_offset
    assert log.log_end_offset == 3


def test_sequence_gaps_and_fenced_epochs_are_rejected(open_log):
    log = open_log()
    log.append(idempotent([b"a"], 0), leader_epoch=1)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idempotent([b"c"], 5), leader_epoch=1)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idempotent([b"b"], 5, epoch=1), leader_epoch=1)  # a new epoch of a known producer starts at 0
    log.append(idempotent([b"b"], 0, epoch=1), leader_epoch=1)  # a new producer epoch restarts at 0
    with pytest.raises(ProducerFencedError):
        log.append(idempotent([b"old"], 1, epoch=0), leader_epoch=1)
    # A producer unknown here starts wherever its sequence is (KIP-360): the log may have forgotten it.
    assert log.append(idempotent([b"z"], 3, producer_id=99), leader_epoch=1).base_offset == 2
    with pytest.raises(OutOfOrderSequenceError):
        log.append(idempotent([b"z"], 5, producer_id=99), leader_epoch=1)  # known now: a gap is refused
    assert log.log_end_offset == 3


def test_producer_state_survives_reopen_and_follower_appends(open_log, tmp_path):
    leader = open_log(directory=tmp_path / "leader")
    leader.append(idempotent([b"a", b"b"], 0), leader_epoch=1)
    follower = open_log(directory=tmp_path / "follower")
    follower.append_as_follower(leader.read(0).data)
    # The follower, become leader, recognises the retry of a batch it only replicated.
    assert follower.append(idempotent([b"a", b"b"], 0), leader_epoch=2).duplicate
    leader.close()
    reopened = open_log(directory=tmp_path / "leader")
    assert reopened.append(idempotent([b"a", b"b"], 0), leader_epoch=1).duplicate
    assert reopened.append(idempotent([b"c"], 2), leader_epoch=1).base_offset == 2
