"""Crash recovery: torn writes and flipped bytes are cut off, never served; appends continue correctly."""

import os
import shutil

import pytest

from logbus.errors import CorruptRecordError
from logbus.storage import LogConfig, PartitionLog, decode_batches, encode_batch
from logbus.storage import record_batch as rb

CONFIG = LogConfig.from_dict({"segment.bytes": 4096, "index.interval.bytes": 256})


def read_all(log):
    offset, out = log.log_start_offset, []
    while (result := log.read(offset, 1 << 20)) is not None:
        for header, records in decode_batches(result.data):
            out += [(header.base_offset + i, v) for i, v in enumerate(records.column("value").to_pylist())]
        offset = result.next_offset
    return out


def build_log(directory, batches=12, per_batch=4):
    log = PartitionLog(str(directory), CONFIG)
    for b in range(batches):
        log.append(encode_batch([b"r-%d-%d" % (b, i) for i in range(per_batch)]), leader_epoch=1)
    records = read_all(log)
    active = log.active_segment
    last_start = log.read(log.log_end_offset - 1).first_offset
    positions = [p for p, _ in rb.iter_headers(active._view(), 0, active.size_bytes)]
    # simulate a crash: no close(), so no recovery point is written for the active segment
    log.segments[-1]._map = None
    return records, active.log_path, positions, last_start


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pristine") / "t-0"
    records, log_path, positions, last_start = build_log(directory)
    return directory, records, os.path.basename(log_path), positions, last_start


def damaged_copy(pristine, tmp_path, mutate):
    source, records, log_name, positions, last_start = pristine
    target = tmp_path / "t-0"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    path = target / log_name
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(mutate(data)))
    return target


def check_recovers_to(directory, records, keep_until_offset, expected_truncated=None):
    log = PartitionLog(str(directory), CONFIG)
    try:
        survived = read_all(log)
        assert survived == [r for r in records if r[0] < keep_until_offset]
        assert log.log_end_offset == keep_until_offset
        if expected_truncated is not None:
            assert log.recovery.truncated_bytes == expected_truncated
        log.append(encode_batch([b"after-crash"]))
        assert read_all(log)[-1] == (keep_until_offset, b"after-crash")
    finally:
        log.close()


def test_cut_at_every_byte_of_the_last_batch(pristine, tmp_path):
    _, records, _, positions, last_start = pristine
    start = positions[-1]
    size = os.path.getsize(pristine[0] / pristine[2])
    for cut in range(start, size):
        directory = damaged_copy(pristine, tmp_path, lambda d: d[:cut])
        check_recovers_to(directory, records, keep_until_offset=last_start, expected_truncated=cut - start)
    # and the untouched file keeps everything
    directory = damaged_copy(pristine, tmp_path, lambda d: d)
    check_recovers_to(directory, records, keep_until_offset=records[-1][0] + 1, expected_truncated=0)


def test_flip_every_protected_byte_of_the_last_batch(pristine, tmp_path):
    _, records, _, positions, last_start = pristine
    start = positions[-1]
    size = os.path.getsize(pristine[0] / pristine[2])
    # The leader epoch lies outside the CRC by design (the leader rewrites it), as in Kafka.
    epoch_bytes = range(start + rb.LEADER_EPOCH_OFFSET, start + rb.LEADER_EPOCH_OFFSET + rb.LEADER_EPOCH_LENGTH)
    for position in range(start, size):
        if position in epoch_bytes:
            continue

        def flip(d, position=position):
            d[position] ^= 0x40
            return d

        directory = damaged_copy(pristine, tmp_path, flip)
        check_recovers_to(directory, records, keep_until_offset=last_start, expected_truncated=size - start)


def test_flip_in_a_middle_batch_cuts_from_there(pristine, tmp_path):
    _, records, _, positions, _ = pristine
    middle = positions[len(positions) // 2]
    size = os.path.getsize(pristine[0] / pristine[2])
    directory = damaged_copy(pristine, tmp_path, lambda d: d[: middle + 100] + bytes([d[middle + 100] ^ 1]) + d[middle + 101 :])
    log = PartitionLog(str(directory), CONFIG)
    header_offset = log.log_end_offset
    log.close()
    assert [r for r in records if r[0] < header_offset] == read_all(PartitionLog(str(directory), CONFIG))
    assert header_offset < records[-1][0]
    assert size > middle


def test_zero_filled_tail_is_cut(pristine, tmp_path):
    _, records, _, _, _ = pristine
    directory = damaged_copy(pristine, tmp_path, lambda d: d + bytes(4096))
    check_recovers_to(directory, records, keep_until_offset=records[-1][0] + 1, expected_truncated=4096)


def test_damage_in_an_old_segment_is_never_served(tmp_path):
    directory = tmp_path / "t-0"
    log = PartitionLog(str(directory), CONFIG)
    for b in range(40):
        log.append(encode_batch([b"x-%d" % b] * 4))
    assert len(log.segments) > 3
    old = log.segments[1]
    log.close()
    with open(old.log_path, "r+b") as file:
        file.seek(200)
        byte = file.read(1)
        file.seek(200)
        file.write(bytes([byte[0] ^ 0xFF]))
    # A clean close means old segments are not rescanned on open, but every read checks CRCs.
    log = PartitionLog(str(directory), CONFIG)
    with pytest.raises(CorruptRecordError):
        offset = old.base_offset
        while (result := log.read(offset, 1 << 20)) is not None:
            offset = result.next_offset
    log.close()
    # After an unclean stop from before that segment (no recovery point), recovery cuts it off.
    os.unlink(directory / "recovery-point")
    log = PartitionLog(str(directory), CONFIG)
    assert log.recovery.truncated_bytes > 0 and log.recovery.segments_deleted > 0
    assert log.log_end_offset < 160
    assert [o for o, _ in read_all(log)] == list(range(log.log_end_offset))
    log.close()


def test_gap_between_segments_drops_the_unreachable_tail(tmp_path):
    directory = tmp_path / "t-0"
    log = PartitionLog(str(directory), CONFIG)
    for b in range(40):
        log.append(encode_batch([b"x-%d" % b] * 4))
    bases = [s.base_offset for s in log.segments]
    log.close()
    victim = [s for s in log.segments][2]
    for suffix in (".log", ".index", ".timeindex"):
        os.unlink(victim.log_path[: -len(".log")] + suffix)
    os.unlink(directory / "recovery-point")
    log = PartitionLog(str(directory), CONFIG)
    assert log.log_end_offset == bases[2]
    assert log.recovery.segments_deleted == len(bases) - 3
    log.close()
