"""The remote tier (storage/tier.py): closed segments copied as Parquet, read back as the same records."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from logbus.errors import OffsetOutOfRangeError, StorageError, TierFencedError
from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage.record_batch import TIMESTAMP_LOG_APPEND_TIME, slice_visible_batches
from logbus.storage.tier import TIER_SCHEMA, DirectTierReader, RemoteTier, segment_copy


def records_of(data, start=0):
    """(offset, key, value, timestamp, headers) of every visible record in framed batches."""
    kept, _ = slice_visible_batches(data, start)
    out = []
    for header, first, batch in kept:
        rows = batch.to_pylist()
        for i, row in enumerate(rows):
            stamp = header.max_timestamp_ms if header.timestamp_type == TIMESTAMP_LOG_APPEND_TIME else row["timestamp"]
            out.append((first + i, row["key"], row["value"], stamp, sorted(row["headers"] or [])))
    return out


def read_log(log, start=0):
    out, offset = [], start
    while offset < log.log_end_offset:
        read = log.read(offset, 1 << 20)
        if read is None:
            break
        out += records_of(read.data, offset)
        offset = read.next_offset
    return out


def read_tier(tier, start):
    out, offset = [], start
    while offset < tier.manifest.end_offset:
        read = tier.read(offset, 1000)
        out += records_of(read.data, offset)
        assert read.next_offset > offset
        offset = read.next_offset
    return out


def tier_plan(tier, start):
    """What a leader's reply names for a consumer reading the tier itself from ``start``."""
    manifest = tier.manifest
    files = [(f.name, f.base_offset, f.next_offset) for f in manifest.files if f.name and f.next_offset > start]
    return {"uri": tier.uri, "directory": tier.directory, "files": files, "start": start, "until": manifest.end_offset}


def read_direct(tier, start, max_bytes=1000, ahead=None):
    """The records a consumer reads straight from the tier's files, as :func:`records_of` gives them."""
    reader = DirectTierReader(tier_plan(tier, start), ahead=ahead)
    out = []
    while reader.continues(reader.next_offset):
        before = reader.next_offset
        runs, next_offset = reader.read(max_bytes)
        assert next_offset > before and next_offset == reader.next_offset
        for first, batch, append_time in runs:
            for i, row in enumerate(batch.to_pylist()):
                stamp = row["timestamp"] if append_time is None else append_time
                out.append((first + i, row["key"], row["value"], stamp, sorted(row["headers"] or [])))
    reader.close()
    return out


def fill(log, batches=30, per_batch=7):
    for b in range(batches):
        values = [f"v{b}-{i}".encode() for i in range(per_batch)]
        keys = [f"k{i}".encode() if i % 2 else None for i in range(per_batch)]
        headers = [{"h": f"{b}".encode()} if i % 3 == 0 else None for i in range(per_batch)]
        log.append(encode_batch(values, keys, [1_000_000 + b * 10 + i for i in range(per_batch)], headers), leader_epoch=1)


@pytest.fixture
def log(tmp_path):
    log = PartitionLog(str(tmp_path / "log"), LogConfig.from_dict({"segment.bytes": 4096}))
    yield log
    log.close()


def upload_closed(tier, log, epoch=1):
    for i in range(len(log.segments) - 1):
        tier.upload(segment_copy(log, i), epoch)


def test_uploaded_segments_read_back_as_the_same_records(tmp_path, log):
    fill(log)
    assert len(log.segments) > 3
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log)
    manifest = tier.read_manifest()
    assert manifest.end_offset == log.active_segment.base_offset
    assert [f.base_offset for f in manifest.files] == [s.base_offset for s in log.segments[:-1]]
    assert read_tier(tier, 0) == read_log(log)[: manifest.end_offset]
    # Mid-file starts read the same suffix.
    assert read_tier(tier, 45) == read_log(log, 45)[: manifest.end_offset - 45]
    # The files are plain Parquet with the tier's columns, sorted by offset.
    table = pq.read_table(os.path.join(tier.directory, "data", manifest.files[0].name))
    assert table.schema.equals(TIER_SCHEMA)
    assert table.column("offset").to_pylist() == list(range(manifest.files[0].base_offset, manifest.files[0].next_offset))


def test_uploading_again_copies_nothing_and_a_later_epoch_fences_the_older(tmp_path, log):
    fill(log)
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log, epoch=1)
    version = tier.manifest.version
    assert tier.upload(segment_copy(log, 0), 1) is None and tier.read_manifest().version == version
    # A new leader (epoch 2) takes over the tier; the deposed one can no longer write it.
    newer = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    newer.delete_before(1, leader_epoch=2)
    with pytest.raises(TierFencedError):
        tier.upload(segment_copy(log, len(log.segments) - 2), 1)
    with pytest.raises(TierFencedError):
        tier.delete_before(100, leader_epoch=1)


def test_a_manifest_version_is_written_once_and_a_second_uploader_copies_nothing(tmp_path, log):
    fill(log)
    first = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    second = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    assert first.upload(segment_copy(log, 0), 1) is not None
    # Version 1 exists: a writer that read version 0 cannot commit its own version 1 over it.
    listed = first.read_manifest()
    stale = type(listed)(listed.version, listed.leader_epoch, listed.log_start_offset, ())
    assert second._commit(stale) is False
    assert RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0).read_manifest() == listed
    # The second uploader re-reads before copying: segment 0 is listed, so it copies nothing.
    assert second.upload(segment_copy(log, 0), 1) is None
    assert second.upload(segment_copy(log, 1), 1) is not None
    names = [f.name for f in second.read_manifest().files]
    assert len(names) == 2 and sorted(os.listdir(os.path.join(first.directory, "data"))) == sorted(names)


def test_retention_of_the_whole_log_trims_the_tier(tmp_path, log):
    fill(log)
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log)
    files = tier.manifest.files
    cut = tier.retention_offset(now_ms=1_000_000 + 10_000, retention_ms=10_000 - 45, retention_bytes=-1, local_bytes=0)
    assert cut is not None and cut in [f.next_offset for f in files]
    assert len(tier.delete_before(cut, 1)) >= 1
    assert tier.manifest.log_start_offset == cut
    with pytest.raises(OffsetOutOfRangeError):
        tier.read(0, 100)
    assert read_tier(tier, cut) == read_log(log, cut)[: tier.manifest.end_offset - cut]
    names = {f.name for f in tier.manifest.files}
    assert set(os.listdir(os.path.join(tier.directory, "data"))) == names


def test_aborted_records_and_markers_become_gaps(tmp_path, log):
    log.append(encode_batch([b"plain"]), leader_epoch=1)
    log.append(encode_batch([b"doomed"], producer_id=9, producer_epoch=0, base_sequence=0, transactional=True), leader_epoch=1)
    log.append_marker(9, 0, False, 0, leader_epoch=1)
    log.append(encode_batch([b"kept"], producer_id=9, producer_epoch=0, base_sequence=1, transactional=True), leader_epoch=1)
    log.append_marker(9, 0, True, 0, leader_epoch=1)
    log.roll()
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    tier.upload(segment_copy(log, 0), 1)
    assert [(o, v) for o, _, v, _, _ in read_tier(tier, 0)] == [(0, b"plain"), (3, b"kept")]
    assert tier.manifest.end_offset == 5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=25),
    log_append=st.lists(st.booleans(), min_size=25, max_size=25),
    start=st.integers(min_value=0, max_value=400),
    step_ms=st.sampled_from([1, 86_400_000 // 3]),  # batches a ms apart, or crossing midnight every few batches
)
def test_any_uploaded_prefix_reads_back_record_for_record(tmp_path_factory, sizes, log_append, start, step_ms):
    directory = tmp_path_factory.mktemp("prop")
    # Timestamps of 1970: no roll or retention by age (segments then end only by size).
    log = PartitionLog(str(directory / "log"), LogConfig.from_dict({"segment.bytes": 2048, "segment.ms": 2**62, "retention.ms": -1}))
    try:
        for b, n in enumerate(sizes):
            data = encode_batch([os.urandom(b % 5) for _ in range(n)], timestamps_ms=[5_000 + b * step_ms] * n,
                                timestamp_type=TIMESTAMP_LOG_APPEND_TIME if log_append[b] else 0)
            log.append(data, leader_epoch=1)
        log.roll()
        tier = RemoteTier(f"file://{directory}/remote", "t", "x", 3)
        upload_closed(tier, log)
        end = tier.manifest.end_offset
        assert end == log.log_end_offset
        start = min(start, end - 1)
        expected = read_log(log, start)
        assert read_tier(tier, start) == expected
        # A consumer reading the files itself gets the same records, a row group read ahead or not.
        assert read_direct(tier, start, max_bytes=700) == expected
        with ThreadPoolExecutor(1) as ahead:
            assert read_direct(tier, start, max_bytes=1 << 20, ahead=ahead) == expected
    finally:
        log.close()


def test_local_retention_deletes_only_what_the_tier_holds(tmp_path):
    log = PartitionLog(
        str(tmp_path / "log"),
        LogConfig.from_dict({"segment.bytes": 4096, "retention.ms": -1, "remote.storage.enable": True, "local.retention.bytes": 0}),
    )
    try:
        fill(log)
        segments = len(log.segments)
        assert log.enforce_retention() == 0  # nothing uploaded: everything stays
        tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
        for i in range(2):
            tier.upload(segment_copy(log, i), 1)
        log.tiered_offset = tier.manifest.end_offset
        assert log.enforce_retention() == 2
        assert len(log.segments) == segments - 2
        assert log.log_start_offset == tier.manifest.end_offset
        # What left the disk is read from the tier, the rest from the log: together the whole log.
        assert [r[0] for r in read_tier(tier, 0) + read_log(log, log.log_start_offset)] == list(range(log.log_end_offset))
    finally:
        log.close()


def test_an_upload_of_a_segment_deleted_meanwhile_fails_clearly_and_lists_nothing(tmp_path, log):
    fill(log)
    copy = segment_copy(log, 0)
    log.delete_records(log.segments[1].base_offset)  # retention or delete_records took it first
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    with pytest.raises(StorageError, match="cannot write"):
        tier.upload(copy, 1)
    assert tier.read_manifest().files == ()
    assert os.listdir(os.path.join(tier.directory, "data")) == []


def test_a_compacted_topic_cannot_be_tiered():
    from logbus.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="compact"):
        LogConfig.from_dict({"cleanup.policy": "compact", "remote.storage.enable": True})


def test_a_new_leaders_claim_fences_the_old_one_and_sweeps_unlisted_files(tmp_path, log):
    fill(log)
    old = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    old.upload(segment_copy(log, 0), 1)
    stray = os.path.join(old.directory, "data", "00000000000000000099-00000000000000000100-e1-dead.parquet")
    with open(stray, "wb") as file:
        file.write(b"an upload that never listed its file")
    new = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    new.claim(2)
    assert new.sweep_orphans() == (1, 0)
    assert not os.path.exists(stray)
    assert [f.name for f in new.read_manifest().files] == [f.name for f in old.read_manifest().files]
    assert new.manifest.leader_epoch == 2
    with pytest.raises(TierFencedError):
        old.upload(segment_copy(log, 1), 1)
    assert sorted(os.listdir(os.path.join(old.directory, "data"))) == [new.manifest.files[0].name]


def test_offset_for_timestamp_in_the_tier_matches_the_logs(tmp_path, log):
    fill(log)
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log)
    end = tier.manifest.end_offset
    for target in (0, 1_000_000, 1_000_055, 1_000_101, 1_000_000 + 10 * 29):
        expected = log.offset_for_timestamp(target)
        found = tier.offset_for_timestamp(target)
        assert found == (expected if expected is not None and expected < end else None)
    tier.delete_before(tier.manifest.files[2].base_offset, 1)
    assert tier.offset_for_timestamp(0) == tier.manifest.files[0].base_offset


def test_a_tier_on_an_s3_compatible_store_reads_back_the_same(s3_endpoint, tmp_path, log):
    fill(log)
    uri = s3_endpoint("tier-storage-test")
    tier = RemoteTier(uri, "t", "id1", 0)
    upload_closed(tier, log)
    fresh = RemoteTier(uri, "t", "id1", 0)  # what another host reads
    assert fresh.manifest.end_offset == log.active_segment.base_offset
    assert read_tier(fresh, 0) == read_log(log)[: fresh.manifest.end_offset]
    assert fresh.offset_for_timestamp(1_000_055) == log.offset_for_timestamp(1_000_055)
    removed = fresh.delete_before(fresh.manifest.files[1].base_offset, 2)
    assert len(removed) == 1
    with pytest.raises(TierFencedError):  # the manifest's epoch is 2 now
        tier.upload(segment_copy(log, 0), 1)
    fresh.claim(3)
    assert fresh.sweep_orphans() == (0, 0)
    fresh.delete_all()
    assert RemoteTier(uri, "t", "id1", 0).manifest.files == ()


@pytest.mark.parametrize("chunk_bytes", [100, 1500, 5000])
def test_uploads_read_segments_in_chunks_that_cut_batches_anywhere(tmp_path, log, monkeypatch, chunk_bytes):
    import logbus.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "READ_CHUNK_BYTES", chunk_bytes)
    fill(log, batches=40, per_batch=9)
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log)
    assert read_tier(tier, 0) == read_log(log)[: tier.manifest.end_offset]


def test_an_upload_never_starts_below_the_logs_start(tmp_path, log):
    fill(log)
    log.delete_records(10)  # inside the first segment
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    tier.upload(segment_copy(log, 0), 1)
    assert tier.manifest.log_start_offset == 10 and tier.manifest.files[0].base_offset == 10
    assert [r[0] for r in read_tier(tier, 10)][:3] == [10, 11, 12]


def test_the_iceberg_table_follows_the_manifest_and_keeps_a_bounded_history(tmp_path, log, monkeypatch):
    import logbus.storage.tier_catalog as tier_catalog
    from logbus.storage.tier_catalog import TierCatalog, catalog_location

    monkeypatch.setattr(tier_catalog, "SNAPSHOTS_KEPT", 2)
    fill(log)
    uri = f"file://{tmp_path}/remote"
    tier = RemoteTier(uri, "t.x", "id1", 0)
    catalog = TierCatalog(catalog_location("", uri), uri, "t.x", "id1")
    for i in range(len(log.segments) - 1):
        tier.upload(segment_copy(log, i), 1)
        assert catalog.sync(0, tier.directory, tier.manifest) == (1, 0)
    table = catalog.catalog.load_table("logbus.t_x")
    listed = lambda t: sorted(os.path.basename(task.file.file_path) for task in t.scan().plan_files())  # noqa: E731
    assert listed(table) == sorted(f.name for f in tier.manifest.files)
    assert len(table.snapshots()) < 4  # expired down to the newest two once four existed
    assert table.scan().to_arrow().num_rows == sum(f.records for f in tier.manifest.files)
    removed = tier.delete_before(tier.manifest.files[2].base_offset, 1, delete_files=False)
    assert catalog.sync(0, tier.directory, tier.manifest) == (0, 2) and len(removed) == 2
    table = catalog.catalog.load_table("logbus.t_x")
    assert listed(table) == sorted(f.name for f in tier.manifest.files)
    assert catalog.sync(0, tier.directory, tier.manifest) == (0, 0)  # in line: nothing to do
    catalog.drop()
    assert catalog.catalog.list_tables("logbus") == []
    assert catalog_location("none", uri) is None and catalog_location("", "s3://b/x") is None


def test_a_file_of_several_days_makes_the_iceberg_table_stop_partitioning_by_day(tmp_path, log):
    """A tier file spanning midnight (as a logbus that did not cut files by day uploaded them) is listed
    under a spec without the day field; the files listed before keep theirs, and every row reads back."""
    import pyarrow as pa

    from logbus.storage.tier import TierFile, TierManifest
    from logbus.storage.tier_catalog import TierCatalog, catalog_location

    fill(log)
    uri = f"file://{tmp_path}/remote"
    tier = RemoteTier(uri, "t", "id1", 0)
    catalog = TierCatalog(catalog_location("", uri), uri, "t", "id1")
    tier.upload(segment_copy(log, 0), 1)
    assert catalog.sync(0, tier.directory, tier.manifest) == (1, 0)
    table = catalog.catalog.load_table("logbus.t")
    assert [f.name for f in table.spec().fields] == ["partition", "timestamp_day"]
    start = tier.manifest.end_offset
    stamps_ms = [DAY_MS - 1, DAY_MS, DAY_MS + 1]
    rows = pa.table(
        [
            pa.array([0] * 3, pa.int32()), pa.array(range(start, start + 3), pa.int64()),
            pa.array([t * 1000 for t in stamps_ms], pa.int64()).cast(pa.timestamp("us", tz="UTC")), pa.array([0] * 3, pa.int32()),
            pa.array([None] * 3, pa.binary()), pa.array([b"a", b"b", b"c"]), pa.nulls(3, TIER_SCHEMA.field("headers").type),
        ],
        schema=TIER_SCHEMA,
    )
    name = f"{start:020d}-e1-old.parquet"
    pq.write_table(rows, os.path.join(tier.directory, "data", name))
    entry = TierFile(name, start, start + 3, 3, os.path.getsize(os.path.join(tier.directory, "data", name)), stamps_ms[0], stamps_ms[-1])
    tier._update(1, lambda latest: TierManifest(0, 0, latest.log_start_offset, latest.files + (entry,)))
    assert catalog.sync(0, tier.directory, tier.manifest) == (1, 0)
    table = catalog.catalog.load_table("logbus.t")
    assert [f.name for f in table.spec().fields] == ["partition"]
    offsets = sorted(table.scan(selected_fields=("offset",)).to_arrow().column("offset").to_pylist())
    assert offsets == list(range(start + 3))
    catalog.drop()


def test_a_direct_read_of_files_it_cannot_reach_raises_a_storage_error(tmp_path, log):
    fill(log)
    log.roll()
    tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
    upload_closed(tier, log)
    plan = tier_plan(tier, 0)
    elsewhere = DirectTierReader({**plan, "directory": str(tmp_path / "another-host")})
    with pytest.raises(StorageError, match="cannot read") as unreachable:
        elsewhere.read(1 << 20)
    assert unreachable.value.tier_unreachable  # the tier's directory is not there at all
    # A file retention deleted after the plan was made: the records before it are read, then the error.
    reader = DirectTierReader(plan)
    offsets = []
    while reader.next_offset < plan["files"][0][2]:  # the first file, a record at a time
        runs, _ = reader.read(1)
        offsets += [first + i for first, batch, _ in runs for i in range(batch.num_rows)]
    assert offsets == list(range(plan["files"][0][2]))
    os.unlink(os.path.join(tier.directory, "data", plan["files"][1][0]))
    with pytest.raises(StorageError, match="cannot read") as gone:
        reader.read(1 << 20)
    assert not gone.value.tier_unreachable  # a file is gone, the tier is there


DAY_MS = 86_400_000


def test_a_segment_across_midnight_becomes_a_file_per_run_of_one_day(tmp_path):
    """Each data file holds one UTC day (an Iceberg partition value), runs cut in offset order, the files
    contiguous; CreateTime records crossing midnight back and forth start a file at each crossing."""
    log = PartitionLog(str(tmp_path / "log"), LogConfig.from_dict({"segment.bytes": 1 << 20, "retention.ms": -1}))
    midnight = int(time.time() * 1000) // DAY_MS * DAY_MS  # today's: recent records (older ones would roll segments by age)
    # Batches: two of day 0, one crossing into day 1 inside it, one back on day 0, one of day 1.
    stamps = [
        [midnight - 50 + i for i in range(5)],
        [midnight - 40 + i for i in range(5)],
        [midnight - 2, midnight - 1, midnight, midnight + 1],
        [midnight - 5, midnight - 4],
        [midnight + 10, midnight + 11, midnight + 12],
    ]
    try:
        for b, batch in enumerate(stamps):
            log.append(encode_batch([b"%d-%d" % (b, i) for i in range(len(batch))], timestamps_ms=batch), leader_epoch=1)
        log.roll()
        tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
        entries = tier.upload(segment_copy(log, 0), 1)
        flat = [t for batch in stamps for t in batch]
        assert [(e.base_offset, e.next_offset) for e in entries] == [(0, 12), (12, 14), (14, 16), (16, 19)]
        assert [(e.min_timestamp_ms, e.max_timestamp_ms) for e in entries] == [
            (min(flat[0:12]), max(flat[0:12])), (midnight, midnight + 1), (midnight - 5, midnight - 4), (midnight + 10, midnight + 12),
        ]
        for entry in entries:
            rows = pq.read_table(os.path.join(tier.directory, "data", entry.name))
            days = {int(t.timestamp() * 1000) // DAY_MS for t in rows.column("timestamp").to_pylist()}
            assert len(days) == 1 and rows.column("offset").to_pylist() == list(range(entry.base_offset, entry.next_offset))
        assert tier.read_manifest().files == entries
        expected = read_log(log, 0)
        assert read_tier(tier, 0) == expected == read_direct(tier, 0)
        assert read_tier(tier, 13) == read_log(log, 13) == read_direct(tier, 13)
    finally:
        log.close()


def test_records_crossing_midnight_too_often_are_uploaded_as_one_file(tmp_path):
    """Past MAX_DAY_FILES crossings in one segment (producers' clocks apart), one file of both days."""
    from logbus.storage.tier import MAX_DAY_FILES

    log = PartitionLog(str(tmp_path / "log"), LogConfig.from_dict({"segment.bytes": 1 << 20, "retention.ms": -1}))
    midnight = int(time.time() * 1000) // DAY_MS * DAY_MS
    try:
        for b in range(MAX_DAY_FILES + 8):
            log.append(encode_batch([b"%d" % b], timestamps_ms=[midnight + (1 if b % 2 else -1)]), leader_epoch=1)
        log.roll()
        tier = RemoteTier(f"file://{tmp_path}/remote", "t", "id1", 0)
        [entry] = tier.upload(segment_copy(log, 0), 1)
        assert (entry.base_offset, entry.next_offset, entry.records) == (0, MAX_DAY_FILES + 8, MAX_DAY_FILES + 8)
        assert (entry.min_timestamp_ms, entry.max_timestamp_ms) == (midnight - 1, midnight + 1)
        assert os.listdir(os.path.join(tier.directory, "data")) == [entry.name]  # the day files it began are gone
        assert read_tier(tier, 0) == read_log(log, 0) == read_direct(tier, 0)
    finally:
        log.close()
