"""A cleaning killed part way (a real process, SIGKILL): on open the log holds, for each group of
segments the cleaning rewrites, either the old segments or the new one, never a mix, and loses no
record that the cleaning keeps."""

import os
import random
import shutil
import signal
import time

import pytest

from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage import record_batch as rb
from logbus.storage.cleaner import CLEANED_SUFFIX, SWAP_SUFFIX
from tests.storage import clean_in_child

NOW_MS = 1_700_000_000_000
CONFIG = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": 0, "segment.bytes": 6000, "delete.retention.ms": 1000}
CHILD_TIMEOUT_S = 60


def build_log(directory):
    """Closed segments in several cleaning groups: keys updated over and over, some deleted."""
    rng = random.Random(7)
    log = PartitionLog(str(directory), LogConfig.from_dict(CONFIG), clock_ms=lambda: NOW_MS)
    for b in range(24):
        keys = [b"key-%d" % rng.randrange(8) for _ in range(rng.randrange(1, 5))]
        values = [None if rng.random() < 0.15 else b"value-%d-%d" % (b, i) for i in range(len(keys))]
        timestamp = NOW_MS - (5000 if b < 16 else 0)  # the older tombstones have expired, the newer not
        log.append(encode_batch(values, keys, [timestamp] * len(keys)), leader_epoch=1)
        if b % 4 == 3:
            log.roll()
    log.append(encode_batch([b"active"], [b"key-0"]), leader_epoch=1)
    log.close()


def read_all(directory):
    log = PartitionLog(str(directory), LogConfig.from_dict(CONFIG), clock_ms=lambda: NOW_MS)
    try:
        offset, out = log.log_start_offset, []
        while (result := log.read(offset)) is not None:
            for _, first, records in rb.slice_batches(result.data, offset):
                keys, values = records.column("key").to_pylist(), records.column("value").to_pylist()
                out += [(first + i, k, v) for i, (k, v) in enumerate(zip(keys, values))]
            offset = result.next_offset
        return out, log.recovery
    finally:
        log.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The log before cleaning, the groups a cleaning rewrites, and the log after it (cleaned in this process)."""
    base = tmp_path_factory.mktemp("reference")
    build_log(base / "original")
    before, _ = read_all(base / "original")
    shutil.copytree(base / "original", base / "cleaned")
    log = PartitionLog(str(base / "cleaned"), LogConfig.from_dict(CONFIG), clock_ms=lambda: NOW_MS)
    plan = log.cleaning_plan()
    groups = [(group[0].base_offset, group[-1].end_offset) for group in plan.groups]
    assert len(groups) >= 3
    log.clean()
    log.close()
    after, _ = read_all(base / "cleaned")
    assert len(after) < len(before)
    return base / "original", groups, before, after


def run_child(directory, kill_at):
    """Clean ``directory`` in a child that kills itself before its ``kill_at``-th file operation
    (0: never); returns its exit code and what it said."""
    process, pipe = clean_in_child.start(directory, CONFIG, NOW_MS, kill_at)
    process.join(CHILD_TIMEOUT_S)
    said = []
    try:
        while pipe.poll():
            said.append(pipe.recv())
    except EOFError:  # all said
        pass
    return process.exitcode, said


def check_old_or_new(directory, reference):
    """Each group holds its old records or its cleaned ones; nothing else changed; a cleaning then finishes the job."""
    _, groups, before, after = reference
    got, recovery = read_all(directory)
    assert recovery.errors == () and recovery.truncated_bytes == 0
    assert not [n for n in os.listdir(directory) if n.endswith((CLEANED_SUFFIX, SWAP_SUFFIX))]
    outcomes = []
    for start, end in groups:
        part = [r for r in got if start <= r[0] < end]
        old = [r for r in before if start <= r[0] < end]
        new = [r for r in after if start <= r[0] < end]
        assert part in (old, new), f"offsets {start}..{end} hold a mix of the old and the cleaned records"
        outcomes.append("new" if part == new else "old")
    last_end = groups[-1][1]
    assert [r for r in got if r[0] >= last_end] == [r for r in before if r[0] >= last_end]
    log = PartitionLog(str(directory), LogConfig.from_dict(CONFIG), clock_ms=lambda: NOW_MS)
    log.clean()
    log.close()
    assert read_all(directory)[0] == after
    return outcomes


def test_a_cleaning_killed_before_any_of_its_file_operations_leaves_old_or_new(reference, tmp_path):
    original = reference[0]
    counting = tmp_path / "count"
    shutil.copytree(original, counting)
    exitcode, said = run_child(counting, 0)
    operations = said[-1]["operations"]
    assert exitcode == 0 and operations > 20
    seen = set()
    for kill_at in range(1, operations + 1):
        directory = tmp_path / f"kill-{kill_at}"
        shutil.copytree(original, directory)
        exitcode, _ = run_child(directory, kill_at)
        assert exitcode == -signal.SIGKILL
        seen.add(tuple(check_old_or_new(directory, reference)))
        shutil.rmtree(directory)
    # The kills fell before, inside and after the groups' swaps: every group was seen old and new.
    assert all({outcome[g] for outcome in seen} == {"old", "new"} for g in range(len(reference[1])))


def test_a_cleaning_killed_at_random_times_leaves_old_or_new(reference, tmp_path):
    original = reference[0]
    timing = tmp_path / "timing"
    shutil.copytree(original, timing)
    exitcode, said = run_child(timing, 0)
    assert exitcode == 0
    duration_s = said[-1]["seconds"]
    rng = random.Random(11)
    for attempt in range(8):
        directory = tmp_path / f"random-{attempt}"
        shutil.copytree(original, directory)
        process, pipe = clean_in_child.start(directory, CONFIG, NOW_MS, 0)
        assert pipe.poll(CHILD_TIMEOUT_S) and pipe.recv() == "ready"
        time.sleep(rng.uniform(0, duration_s * 1.2))  # the fault: a kill at a random point of the cleaning
        process.kill()
        process.join(CHILD_TIMEOUT_S)
        assert process.exitcode is not None
        check_old_or_new(directory, reference)
        shutil.rmtree(directory)
