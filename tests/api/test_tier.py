"""Tiered topics end to end: real replicas upload closed segments as Parquet, delete them locally, and
consumers read them back through the tier as if they had never left."""

import datetime
import glob
import os
import time

import pyarrow.parquet as pq
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.errors import InvalidConfigError
from tests.api.cli_helpers import cli  # noqa: F401 (a fixture)
from tests.conftest import wait_for

DAY_MS = 86_400_000
TIERED = {
    "segment.bytes": 16 * 1024,
    "remote.storage.enable": True,
    "local.retention.bytes": 0,  # a segment the tier holds leaves the disk at once
    "retention.ms": -1,
}


def leader_status(bus, topic, partition=0):
    leader = bus.topic_metadata(topic).leaders[partition]
    return ray.get(leader.status.remote(), timeout=60)


def wait_tiered(bus, topic, partition=0):
    """The leader's tier status once every closed segment is uploaded, local retention deleted it
    (TIERED keeps nothing local that the tier holds: the active segment alone is left on disk) and
    the Iceberg table lists it."""

    def tiered():
        status = leader_status(bus, topic, partition)
        tier = status["tier"]
        done = tier and status["segments"] == 1 and tier["uploaded_up_to"] == status["log_start_offset"] > 0 and tier["iceberg_synced"] is not False
        return tier if done else None

    return wait_for(tiered, timeout_s=120, message=f"{topic}-{partition} tiered")


def produce(bus, topic, count, partitions=1, timestamp=None):
    """``count`` records, spread over the partitions in turn; ``timestamp``: a function of the record's
    number giving its timestamp (None: the producer's clock)."""
    producer = logbus.Producer(bus, acks="all", linger_ms=5, batch_size_bytes=4096)
    futures = [
        producer.send(topic, b"value-%06d" % i + b"." * 80, key=b"key-%d" % (i % 17), headers=[("n", b"%d" % i)], partition=i % partitions,
                      timestamp_ms=None if timestamp is None else timestamp(i))
        for i in range(count)
    ]
    producer.flush(timeout_s=120)
    metadata = [f.result(timeout=60) for f in futures]
    producer.close()
    return metadata


def read_all(bus, topic, partition, end, start=0, direct=True):
    """Records ``[start, end)`` through a Consumer; ``direct``: it reads the tier's files itself
    (the default), else the leader serves them."""
    consumer = logbus.Consumer(bus, auto_offset_reset="earliest", read_tier_directly=direct)
    consumer.assign([TopicPartition(topic, partition)])
    consumer.seek(TopicPartition(topic, partition), start)
    records = []

    def more():
        for polled in consumer.poll(timeout_ms=500, max_records=10_000).values():
            records.extend(polled)
        return len(records) >= end - start

    try:
        wait_for(more, timeout_s=120, interval_s=0, message=f"{end - start} records")
    finally:
        consumer.close()
    return records


def test_a_tiered_topic_is_read_back_whole_after_its_segments_leave_the_disk(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2, config=TIERED)
    count = 4000
    metadata = produce(bus, topic_name, count, partitions=2)
    sent = {(m.partition, m.offset): i for i, m in enumerate(metadata)}

    # The leader uploads every closed segment, and local retention deletes the uploaded ones.
    for partition in range(2):
        tier = wait_tiered(bus, topic_name, partition)
        assert tier["files"] >= 3 and tier["log_start_offset"] == 0
    # Earliest is the tier's start, not the local log's.
    consumer = logbus.Consumer(bus)
    try:
        partitions = [TopicPartition(topic_name, p) for p in range(2)]
        assert consumer.beginning_offsets(partitions) == {tp: 0 for tp in partitions}
    finally:
        consumer.close()

    for partition in range(2):
        end = sum(1 for p, _ in sent if p == partition)
        for direct in (True, False):  # the consumer reading the tier's files itself, and the leader serving them
            served_before = leader_status(bus, topic_name, partition)["tier"]["served_bytes"]
            records = read_all(bus, topic_name, partition, end, direct=direct)
            assert [r.offset for r in records] == list(range(end))
            for record in records:
                i = sent[(partition, record.offset)]
                assert record.value == b"value-%06d" % i + b"." * 80
                assert record.key == b"key-%d" % (i % 17)
                assert list(record.headers) == [("n", b"%d" % i)]
                assert record.timestamp == metadata[i].timestamp
                assert record.timestamp_type == 1  # CreateTime (confluent-kafka's code)
            served = leader_status(bus, topic_name, partition)["tier"]["served_bytes"] - served_before
            assert (served == 0) if direct else (served > 0)
            # A read starting inside the tier, mid-file, goes on into the local log.
            middle = end // 3
            assert [r.offset for r in read_all(bus, topic_name, partition, end, start=middle, direct=direct)] == list(range(middle, end))


def test_the_tier_is_parquet_that_other_readers_read(bus, topic_name, tmp_path):
    uri = f"file://{tmp_path}/tier"
    bus.admin.create_topic(topic_name, partitions=1, config={**TIERED, "remote.storage.uri": uri})
    metadata = produce(bus, topic_name, 1500)
    uploaded = wait_tiered(bus, topic_name)["uploaded_up_to"]
    files = sorted(glob.glob(f"{tmp_path}/tier/{topic_name}-*/0/data/*.parquet"))
    table = pq.ParquetDataset(files).read()
    rows = table.sort_by("offset")
    assert rows.column("offset").to_pylist() == list(range(uploaded))
    assert set(rows.column("partition").to_pylist()) == {0}
    assert rows.column("value").to_pylist() == [b"value-%06d" % i + b"." * 80 for i in range(uploaded)]
    assert [int(t.timestamp() * 1000) for t in rows.column("timestamp").to_pylist()] == [metadata[i].timestamp for i in range(uploaded)]
    # Deleting the topic deletes its tier.
    bus.admin.delete_topic(topic_name)
    wait_for(lambda: not glob.glob(f"{tmp_path}/tier/{topic_name}-*/0/data/*.parquet"), timeout_s=60, message="tier deleted")


def test_delete_records_moves_the_tiers_log_start(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config=TIERED)
    produce(bus, topic_name, 1500)
    assert wait_tiered(bus, topic_name)["uploaded_up_to"] > 100
    assert bus.admin.delete_records({TopicPartition(topic_name, 0): 100}) == {TopicPartition(topic_name, 0): 100}
    status = leader_status(bus, topic_name)
    assert status["tier"]["log_start_offset"] == 100
    records = read_all(bus, topic_name, 0, 1500, start=100)
    assert records[0].offset == 100 and len(records) == 1400


def test_a_consumer_reading_the_tier_itself_goes_back_to_the_leader_when_files_go(bus, topic_name, tmp_path):
    uri = f"file://{tmp_path}/tier"
    bus.admin.create_topic(topic_name, partitions=1, config={**TIERED, "remote.storage.uri": uri})
    produce(bus, topic_name, 3000)
    end = wait_tiered(bus, topic_name)["uploaded_up_to"]

    def tier_files():
        """The first offsets of the tier's data files (each file's name starts with it)."""
        names = (os.path.basename(p) for p in glob.glob(f"{tmp_path}/tier/{topic_name}-*/0/data/*.parquet"))
        return sorted(int(name.split("-")[0]) for name in names)

    files = tier_files()
    assert len(files) >= 8
    # A consumer with a small fetch size and buffer reads the files a little at a time.
    consumer = logbus.Consumer(bus, fetch_max_bytes=2000, max_buffered_bytes=4000)
    tp = TopicPartition(topic_name, 0)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    served_before = leader_status(bus, topic_name)["tier"]["served_bytes"]
    records = []
    try:
        wait_for(lambda: records.extend(consumer.poll(timeout_ms=500).get(tp, [])) or records, timeout_s=60, message="first records")
        assert leader_status(bus, topic_name)["tier"]["served_bytes"] == served_before  # read from the files
        # DeleteRecords moves the log start past the files the consumer has not opened yet; the tier deletes them.
        cut = files[6]
        assert bus.admin.delete_records({tp: cut}) == {tp: cut}
        wait_for(lambda: tier_files()[0] >= cut, timeout_s=60, message="the files below the new start deleted")

        def more():
            records.extend(consumer.poll(timeout_ms=500, max_records=10_000).get(tp, []))
            return len(records) and records[-1].offset >= end - 1

        wait_for(more, timeout_s=120, interval_s=0, message="the records up to the tier's end")
    finally:
        consumer.close()
    offsets = [r.offset for r in records]
    # What it read before the files went, then (out of range at the leader, reset to earliest) the new start on.
    jump = next(i for i in range(1, len(offsets)) if offsets[i] != offsets[i - 1] + 1)
    assert offsets[:jump] == list(range(jump)) and 0 < jump <= cut
    assert offsets[jump:] == list(range(cut, offsets[-1] + 1))
    assert all(r.value == b"value-%06d" % r.offset + b"." * 80 for r in records)


def test_tier_configs_are_checked(bus, topic_name):
    bus.admin.create_topic(topic_name + "-t", partitions=1, config={"remote.storage.enable": True})
    with pytest.raises(InvalidConfigError, match="cannot be turned off"):
        bus.admin.alter_config(topic_name + "-t", {"remote.storage.enable": False})
    with pytest.raises(InvalidConfigError, match="cannot be turned off"):
        bus.admin.alter_config(topic_name + "-t", delete=["remote.storage.enable"])
    with pytest.raises(InvalidConfigError, match="cannot change"):
        bus.admin.alter_config(topic_name + "-t", {"remote.storage.uri": "file:///elsewhere"})
    assert bus.admin.alter_config(topic_name + "-t", {"local.retention.ms": 1000})["local.retention.ms"] == 1000
    with pytest.raises(InvalidConfigError, match="compact"):
        bus.admin.create_topic(topic_name, partitions=1, config={"cleanup.policy": "compact", "remote.storage.enable": True})
    with pytest.raises(InvalidConfigError, match="local.retention.ms"):
        bus.admin.create_topic(topic_name, partitions=1, config={"local.retention.ms": -3})


def test_the_tier_is_an_iceberg_table_that_pyiceberg_duckdb_and_ray_data_read(bus, topic_name, tmp_path):
    from pyiceberg.catalog.sql import SqlCatalog

    uri = f"file://{tmp_path}/tier"
    bus.admin.create_topic(topic_name, partitions=2, config={**TIERED, "remote.storage.uri": uri})
    # Records of three days (a thousand each), so that segments span midnight.
    midnight_ms = (int(time.time() * 1000) // DAY_MS - 3) * DAY_MS
    metadata = produce(bus, topic_name, 3000, partitions=2, timestamp=lambda i: midnight_ms + (i // 1000) * DAY_MS + i)
    ends = {p: wait_tiered(bus, topic_name, p)["uploaded_up_to"] for p in range(2)}
    expected = sorted(
        (m.partition, m.offset, b"value-%06d" % i + b"." * 80) for i, m in enumerate(metadata) if m.offset < ends[m.partition]
    )
    catalog_uri = f"sqlite:///{tmp_path}/tier/catalog.db"
    identifier = "logbus." + topic_name.replace(".", "_")
    table = SqlCatalog("logbus", uri=catalog_uri).load_table(identifier)
    rows = table.scan(selected_fields=("partition", "offset", "value")).to_arrow()
    assert sorted(zip(*(rows.column(c).to_pylist() for c in ("partition", "offset", "value")))) == expected
    # Partitioned by partition and day: each file holds one day, and scans are pruned by both.
    assert [(f.name, str(f.transform)) for f in table.spec().fields] == [("partition", "identity"), ("timestamp_day", "day")]
    days = {m.offset: m.timestamp // DAY_MS for m in metadata if m.partition == 0 and m.offset < ends[0]}
    for task in table.scan(row_filter="partition == 0").plan_files():
        rows = pq.read_table(task.file.file_path.removeprefix("file://"), columns=["offset", "timestamp"])
        assert {days[o] for o in rows.column("offset").to_pylist()} == {task.file.partition[1]}  # days since the epoch
    assert {task.file.partition[0] for task in table.scan(row_filter="partition == 1").plan_files()} == {1}
    last_day = midnight_ms // DAY_MS + 2
    late = table.scan(row_filter=f"timestamp >= '{datetime.datetime.fromtimestamp(last_day * 86400, datetime.UTC).isoformat()}'").plan_files()
    assert late and {task.file.partition[1] for task in late} == {last_day}
    # DuckDB, with its own Iceberg reader (the extension from its wheel, installed in a directory of the test's own).
    import duckdb
    from duckdb_extensions import import_extension

    connection = duckdb.connect(config={"extension_directory": str(tmp_path / "duckdb")})
    for extension in ("avro", "iceberg"):
        import_extension(extension, con=connection)
    connection.execute("load iceberg")
    counts = connection.execute(
        'select "partition", count(*), min("offset"), max("offset") from iceberg_scan(?) group by 1 order by 1',
        [table.metadata_location],
    ).fetchall()
    assert counts == [(p, ends[p], 0, ends[p] - 1) for p in range(2)]
    connection.close()
    # Ray Data's own Iceberg reader.
    import ray.data

    dataset = ray.data.read_iceberg(
        table_identifier=identifier, catalog_kwargs={"name": "logbus", "type": "sql", "uri": catalog_uri},
        selected_fields=("partition", "offset", "value"),
    )
    assert sorted((r["partition"], r["offset"], r["value"]) for r in dataset.iter_rows()) == expected
    # Retention of the whole log drops the table's files below the new start, and deleting the topic its table.
    assert bus.admin.delete_records({TopicPartition(topic_name, 0): ends[0] - 1}) == {TopicPartition(topic_name, 0): ends[0] - 1}

    def trimmed():
        fresh = SqlCatalog("logbus", uri=catalog_uri).load_table(identifier)
        try:
            offsets = fresh.scan(row_filter="partition == 0", selected_fields=("offset",)).to_arrow().column("offset").to_pylist()
        except FileNotFoundError:  # the snapshot loaded was replaced, and its trimmed files deleted, meanwhile: look again
            return None
        return offsets if offsets and 0 < min(offsets) and max(offsets) == ends[0] - 1 else None

    wait_for(trimmed, timeout_s=120, message="the table trimmed")
    bus.admin.delete_topic(topic_name)
    wait_for(lambda: identifier not in {".".join(t) for t in SqlCatalog("logbus", uri=catalog_uri).list_tables("logbus")},
             timeout_s=60, message="the table dropped")


def test_ray_data_reads_the_tiered_part_from_the_files_and_the_rest_from_the_log(bus, topic_name, tmp_path):
    from logbus.api.dataset import TopicDatasource, read_dataset

    bus.admin.create_topic(topic_name, partitions=2, config=TIERED)
    metadata = produce(bus, topic_name, 3000, partitions=2)
    ends = {p: wait_tiered(bus, topic_name, p)["uploaded_up_to"] for p in range(2)}
    source = TopicDatasource(topic_name, bus=bus)
    assert [t["until"] for t in source.tiers] == [ends[0], ends[1]]
    rows = read_dataset(topic_name, bus=bus).take_all()
    assert sorted((r["partition"], r["offset"]) for r in rows) == sorted((m.partition, m.offset) for m in metadata)
    by_offset = {(r["partition"], r["offset"]): r for r in rows}
    for i, m in enumerate(metadata):
        row = by_offset[(m.partition, m.offset)]
        assert row["value"] == b"value-%06d" % i + b"." * 80 and row["key"] == b"key-%d" % (i % 17)
        assert row["timestamp"] == m.timestamp and row["timestamp_type"] == 1
        assert dict(row["headers"]) == {"n": b"%d" % i}
    # A range that starts and ends inside the tier.
    middle = read_dataset(topic_name, start={0: 10, 1: 10}, end={0: ends[0] - 5, 1: 12}, bus=bus).take_all()
    assert sorted((r["partition"], r["offset"]) for r in middle) == [(0, o) for o in range(10, ends[0] - 5)] + [(1, 10), (1, 11)]


def test_spark_reads_the_tiered_part_with_its_own_parquet_reader(spark, bus, topic_name):
    import logbus.spark

    bus.admin.create_topic(topic_name, partitions=2, config=TIERED)
    metadata = produce(bus, topic_name, 3000, partitions=2)
    for p in range(2):
        wait_tiered(bus, topic_name, p)
    df = logbus.spark.read(spark, topic_name, include_headers=True, bus=bus)
    assert "parquet" in df._jdf.queryExecution().analyzed().toString().lower()  # the tiered part: Spark's own reader
    rows = df.collect()
    assert sorted((r.partition, r.offset) for r in rows) == sorted((m.partition, m.offset) for m in metadata)
    by_offset = {(r.partition, r.offset): r for r in rows}
    for i, m in enumerate(metadata):
        row = by_offset[(m.partition, m.offset)]
        assert bytes(row.value) == b"value-%06d" % i + b"." * 80 and bytes(row.key) == b"key-%d" % (i % 17)
        assert int(row.timestamp.timestamp() * 1000) == m.timestamp and row.timestampType == 0 and row.topic == topic_name
        assert [(h.key, bytes(h.value)) for h in row.headers] == [("n", b"%d" % i)]
    # Same rows, same schema as a read of a topic that is not tiered.
    assert df.schema == logbus.spark.kafka_schema(True)
    counted = logbus.spark.read(spark, topic_name, starting_offsets={topic_name: {"0": 5, "1": 7}}, bus=bus).groupBy("partition").count().collect()
    assert sorted((r.partition, r["count"]) for r in counted) == [
        (p, sum(1 for m in metadata if m.partition == p) - start) for p, start in ((0, 5), (1, 7))
    ]


def test_offsets_for_times_reach_into_the_tier(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1, config=TIERED)
    metadata = produce(bus, topic_name, 1500)
    local_start = leader_status(bus, topic_name)["log_start_offset"] if wait_tiered(bus, topic_name) else None
    consumer = logbus.Consumer(bus)
    try:
        tp = TopicPartition(topic_name, 0)
        for i in (0, 17, local_start // 2, local_start + 3, 1499):
            found = consumer.offsets_for_times({tp: metadata[i].timestamp})[tp]
            expected = min(m.offset for m in metadata if m.timestamp >= metadata[i].timestamp)
            assert found.offset == expected
    finally:
        consumer.close()


def test_describe_shows_each_partitions_tier(bus, topic_name, cli):  # noqa: F811
    bus.admin.create_topic(topic_name, partitions=2, config=TIERED)
    produce(bus, topic_name, 2000, partitions=2)
    tiers = {p: wait_tiered(bus, topic_name, p) for p in range(2)}
    assert bus.admin.describe_tier(topic_name) == tiers
    lines = cli("topics", "describe", "--topic", topic_name).lines
    start = lines.index("Remote tier:")
    header = lines[start + 1].split()
    assert header[:4] == ["Topic", "Partition", "TierStart", "UploadedUpTo"]
    rows = [line.split() for line in lines[start + 2 : start + 4]]
    assert [(int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows] == [
        (p, 0, tiers[p]["uploaded_up_to"], tiers[p]["files"]) for p in range(2)
    ]
    assert rows[0][-1] == "logbus." + topic_name.replace(".", "_")
    # A topic that is not tiered has no such block.
    bus.admin.create_topic(topic_name + "-plain", partitions=1)
    assert "Remote tier:" not in cli("topics", "describe", "--topic", topic_name + "-plain").out


def test_killing_the_leader_during_uploads_leaves_one_copy_and_no_gap(bus, topic_name):
    """The leader's process is killed three times once its uploads have begun; Ray restarts it, it claims the tier
    again, sweeps what a killed upload left and goes on from the manifest's end."""
    import json

    bus.admin.create_topic(topic_name, partitions=1, config=TIERED)
    leader = bus.topic_metadata(topic_name).leaders[0]
    producer = logbus.Producer(bus, acks="all", linger_ms=2, batch_size_bytes=4096, delivery_timeout_ms=120_000)
    futures = []
    kills = 0
    for i in range(9000):
        futures.append(producer.send(topic_name, b"r-%d" % i + b"." * 100))
        if i in (2000, 4500, 7000):
            producer.flush(timeout_s=120)
            wait_for(lambda: (ray.get(leader.tier_status.remote(), timeout=60) or {}).get("uploads", 0) > 0, timeout_s=60,
                     message="uploads under way")
            os.kill(ray.get(leader.ping.remote(), timeout=60), 9)
            kills += 1
    producer.flush(timeout_s=180)
    acknowledged = {f.result().offset: b"r-%d" % i + b"." * 100 for i, f in enumerate(futures) if f.exception() is None}
    producer.close()
    assert kills == 3 and len(acknowledged) > 8000
    tier = wait_tiered(bus, topic_name)
    directory = glob.glob(f"{bus.data_dir}/remote/{topic_name}-*/0")[0]
    manifests = sorted(glob.glob(f"{directory}/manifest-*.json"))
    with open(manifests[-1]) as file:
        listed = json.load(file)["files"]
    assert [f["base_offset"] for f in listed[1:]] == [f["next_offset"] for f in listed[:-1]]  # no gap, no overlap
    assert listed[0]["base_offset"] == 0 and listed[-1]["next_offset"] == tier["uploaded_up_to"]
    # One copy of each: the last leader deletes what a killed upload left once its pass has uploaded
    # (after the manifest, which the status above reads, has reached the end).
    wait_for(lambda: sorted(os.listdir(f"{directory}/data")) == sorted(f["name"] for f in listed), timeout_s=60,
             message="the tier's files to be those its manifest lists")
    records = read_all(bus, topic_name, 0, max(acknowledged) + 1)
    by_offset = {r.offset: r.value for r in records}
    assert len(by_offset) == len(records)
    for offset, value in acknowledged.items():
        assert by_offset[offset] == value


def test_a_topic_tiered_to_an_s3_compatible_store(bus, topic_name, s3_endpoint):
    from logbus.api.dataset import read_dataset

    uri = s3_endpoint("tier-topics")
    bus.admin.create_topic(topic_name, partitions=1, config={**TIERED, "remote.storage.uri": uri})
    metadata = produce(bus, topic_name, 1500)
    tier = wait_tiered(bus, topic_name)
    assert tier["uri"] == uri.replace("test:test@", "test:***@")  # the secret is not shown
    assert tier["iceberg_table"] is None and tier["iceberg_synced"] is None  # no catalog by default on an object store
    records = read_all(bus, topic_name, 0, 1500)
    assert [r.value for r in records] == [b"value-%06d" % i + b"." * 80 for i in range(1500)]
    rows = read_dataset(topic_name, bus=bus).take_all()  # the tiered part straight from the store
    assert sorted((r["offset"], r["timestamp"]) for r in rows) == sorted((m.offset, m.timestamp) for m in metadata)


def test_tier_metrics_after_known_traffic(bus, topic_name):
    from tests.actors.test_metrics import scrape, total

    bus.admin.create_topic(topic_name, partitions=1, config=TIERED)
    produce(bus, topic_name, 1500)
    tier = wait_tiered(bus, topic_name)
    read_all(bus, topic_name, 0, 1500, direct=False)  # remote fetch bytes count what the leader serves

    def exported():
        samples = scrape()
        done = (
            total(samples, "ray_logbus_remote_log_size_bytes", topic=topic_name) == tier["remote_bytes"]
            and total(samples, "ray_logbus_remote_fetch_bytes_total", topic=topic_name) > 0
        )
        return samples if done else None

    samples = wait_for(exported, timeout_s=90, interval_s=1, message="tier metrics exported")
    assert total(samples, "ray_logbus_remote_copy_bytes_total", topic=topic_name) >= tier["remote_bytes"] // 10
    assert total(samples, "ray_logbus_remote_copy_lag_bytes", topic=topic_name) == tier["upload_lag_bytes"]


def test_retention_of_the_whole_log_deletes_tier_files_and_their_table_entries(bus, topic_name, tmp_path):
    from pyiceberg.catalog.sql import SqlCatalog

    uri = f"file://{tmp_path}/tier"
    # The whole log may hold 40 KB (the tier's files are about 3 KB each, the active segment at most
    # 16 KB): the tier's oldest files go as newer ones arrive.
    config = {**TIERED, "remote.storage.uri": uri, "retention.bytes": 40_000}
    bus.admin.create_topic(topic_name, partitions=1, config=config)
    produce(bus, topic_name, 3000)
    tier = wait_for(lambda: (lambda t: t if t and t["log_start_offset"] > 0 else None)(bus.admin.describe_tier(topic_name)[0]),
                    timeout_s=120, message="the tier trimmed by retention")
    tier = wait_tiered(bus, topic_name)
    assert tier["log_start_offset"] > 0 and tier["remote_bytes"] <= 40_000
    listed = sorted(os.listdir(glob.glob(f"{tmp_path}/tier/{topic_name}-*/0/data")[0]))
    assert len(listed) == tier["files"]
    table = SqlCatalog("logbus", uri=f"sqlite:///{tmp_path}/tier/catalog.db").load_table("logbus." + topic_name.replace(".", "_"))
    assert sorted(os.path.basename(t.file.file_path) for t in table.scan().plan_files()) == listed
    # Consumers start at the tier's start now.
    consumer = logbus.Consumer(bus)
    try:
        tp = TopicPartition(topic_name, 0)
        assert consumer.beginning_offsets([tp]) == {tp: tier["log_start_offset"]}
    finally:
        consumer.close()


def test_a_controller_restart_during_uploads_leaves_one_copy_and_no_gap(bus, topic_name):
    import json

    from tests.api.test_restart import kill_controller

    bus.admin.create_topic(topic_name, partitions=1, config=TIERED)
    metadata = produce(bus, topic_name, 1500)
    kill_controller(bus)
    metadata += produce(bus, topic_name, 1500)
    tier = wait_tiered(bus, topic_name)
    directory = glob.glob(f"{bus.data_dir}/remote/{topic_name}-*/0")[0]
    with open(sorted(glob.glob(f"{directory}/manifest-*.json"))[-1]) as file:
        listed = json.load(file)["files"]
    assert [f["base_offset"] for f in listed[1:]] == [f["next_offset"] for f in listed[:-1]]
    assert listed[-1]["next_offset"] == tier["uploaded_up_to"]
    assert sorted(os.listdir(f"{directory}/data")) == sorted(f["name"] for f in listed)
    records = read_all(bus, topic_name, 0, 3000)
    assert [r.offset for r in records] == sorted(m.offset for m in metadata) == list(range(3000))
