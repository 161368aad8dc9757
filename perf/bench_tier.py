#!/usr/bin/env python
"""Tiered topics benchmark: uploading segments to the remote tier, Spark over tiered history, and
consumers replaying it, each against its same-run baseline.

Run with ``./dev bench tier`` (= ``.venv/bin/python perf/bench_tier.py``). ``--quick`` uses
500,000 records instead of 2,000,000 (``--records N`` sets any count); ``--dir DIR`` puts the data
in a fresh subdirectory of DIR (default: of /tmp), removed at the end.

Records: 100-byte random (incompressible) values, 1,000 distinct 8-byte keys, recent timestamps,
no headers.

Cases:

1. upload       ``RemoteTier.upload`` of every closed segment of a log holding the records
                (segments of 64 MiB; the Parquet file's rows built from the framed batches),
                against pyarrow alone writing the same rows (the tier's columns and Parquet
                options, the same row groups) to a Parquet file from an in-memory Table, and
                fsyncing it (the tier syncs each file before listing it). Target: >= 0.8x.
2. spark        ``logbus.spark.read(spark, topic, ending_offsets=...)`` of the part of a
                4-partition topic that is in the tier (all but each partition's active segment),
                then ``count()`` and ``groupBy("key").count()``, against Spark reading the tier's
                Parquet files itself (``spark.read.parquet``) and doing the same. Target: >= 0.9x.
3. replay       a Consumer reading a 1-partition topic from offset 0 to its end when all but its
                active segment is in the tier (the consumer reads the tier's Parquet files
                itself, by the plans the leader's replies name), against the same consumer over
                a topic of the same records kept on local segments. Target: >= 0.5x. Beside it
                (info): pyarrow alone reading the tier's files (``read_row_group`` of each), the
                decoding any tier read pays, and the same replay with ``read_tier_directly=False``
                (the leader reads the files and sends framed batches, as for gateway clients).

Each figure is the best of N repetitions. The machine's load average is printed; other work on a
2-core machine changes the figures a lot. The last lines are one JSON object per result.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _common import VALUE_SIZE, arg_parser, end_spark_run, load_text, new_namespace, start_local_ray, timed

KEYS = 1_000
PARTITIONS = 4
SEGMENT_BYTES = 64 << 20
TARGETS = {"upload": 0.8, "spark": 0.9, "replay": 0.5}
TIERED = {"segment.bytes": 4 << 20, "remote.storage.enable": True, "local.retention.bytes": 0, "retention.ms": -1}


def make_values(count: int, seed: int = 7) -> tuple[pa.Array, pa.Array]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, count * VALUE_SIZE, dtype=np.uint8)
    offsets = np.arange(0, (count + 1) * VALUE_SIZE, VALUE_SIZE, dtype=np.int32)
    values = pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    key_bytes = np.frombuffer(b"".join(b"key-%04d" % k for k in range(KEYS)), np.uint8).reshape(KEYS, 8)
    keys = pa.Array.from_buffers(
        pa.binary(), count,
        [None, pa.py_buffer(np.arange(0, (count + 1) * 8, 8, dtype=np.int32)), pa.py_buffer(key_bytes[np.arange(count) % KEYS].tobytes())],
    )
    return keys, values


def result(case: str, records: int, seconds: float, baseline_s: float, reps: int) -> dict:
    ratio = baseline_s / seconds
    return {
        "bench": "tier", "case": case, "records": records, "seconds": round(seconds, 3), "records_per_s": round(records / seconds),
        "baseline_seconds": round(baseline_s, 3), "baseline_records_per_s": round(records / baseline_s),
        "ratio": round(ratio, 3), "target": TARGETS[case], "met": ratio >= TARGETS[case], "reps": reps, "load": load_text(),
    }


def bench_upload(root: str, records: int, reps: int) -> dict:
    """Case 1, without Ray: a log on disk, its segments uploaded; pyarrow alone as the baseline."""
    from logbus.storage import LogConfig, PartitionLog, encode_table
    from logbus.storage.tier import PARQUET_OPTIONS, ROW_GROUP_ROWS, TIER_SCHEMA, RemoteTier, segment_copy

    keys, values = make_values(records)
    now_ms = int(time.time() * 1000)
    stamps = pa.array(now_ms - records + np.arange(records), pa.int64())
    log = PartitionLog(os.path.join(root, "upload-log"), LogConfig.from_dict({"segment.bytes": SEGMENT_BYTES, "retention.ms": -1}))
    chunk = 10_000
    for i in range(0, records, chunk):
        table = pa.table({"key": keys.slice(i, chunk), "value": values.slice(i, chunk), "timestamp": stamps.slice(i, chunk)})
        log.append(encode_table(table), leader_epoch=0)
    log.roll()
    rows = pa.table(
        [
            pa.array(np.zeros(records, np.int32)), pa.array(np.arange(records, dtype=np.int64)),
            pa.compute.multiply(stamps, 1000).cast(pa.timestamp("us", tz="UTC")), pa.array(np.zeros(records, np.int32)),
            keys, values, pa.nulls(records, TIER_SCHEMA.field("headers").type),
        ],
        schema=TIER_SCHEMA,
    )
    best_upload = best_baseline = float("inf")
    for rep in range(reps):
        tier = RemoteTier(f"file://{root}/upload-tier-{rep}", "bench", "x", 0)
        copies = [segment_copy(log, i) for i in range(len(log.segments) - 1)]
        seconds, _ = timed(lambda: [tier.upload(copy, 0) for copy in copies])
        best_upload = min(best_upload, seconds)
        assert tier.read_manifest().end_offset == records
        path = os.path.join(root, f"baseline-{rep}.parquet")

        def durable_write():
            pq.write_table(rows, path, row_group_size=ROW_GROUP_ROWS, **PARQUET_OPTIONS)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # as the tier does before it lists a file
            os.close(fd)

        seconds, _ = timed(durable_write)
        best_baseline = min(best_baseline, seconds)
    log.close()
    return result("upload", records, best_upload, best_baseline, reps)


def produce(bus, topic: str, records: int, partitions: int) -> None:
    import logbus

    keys, values = make_values(records)
    now_ms = int(time.time() * 1000)
    producer = logbus.Producer(bus, linger_ms=5)
    futures = []
    per = records // partitions
    for p in range(partitions):
        for i in range(p * per, (p + 1) * per, 20_000):
            n = min(20_000, (p + 1) * per - i)
            table = pa.table({
                "key": keys.slice(i, n), "value": values.slice(i, n), "timestamp": pa.array(now_ms - records + np.arange(i, i + n), pa.int64()),
                "partition": pa.array(np.full(n, p, np.int32)),
            })
            futures.append(producer.send_table(topic, table))
    producer.flush(timeout_s=600)
    for future in futures:
        future.result()
    producer.close()


def wait_all_tiered(bus, topic: str, partitions: int) -> list[str]:
    """The tier's data files once every partition's closed segments are uploaded and off the disk."""
    import ray

    deadline = time.monotonic() + 300
    while True:
        statuses = [ray.get(leader.status.remote()) for leader in bus.topic_metadata(topic).leaders]
        if all(s["segments"] == 1 and s["tier"] and s["tier"]["uploaded_up_to"] == s["log_start_offset"] > 0 for s in statuses):
            return sorted(glob.glob(f"{bus.data_dir}/remote/{topic}-*/*/data/*.parquet"))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic} not tiered after 300 s: {statuses}")
        time.sleep(0.5)


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="500,000 records instead of 2,000,000")
    parser.add_argument("--records", type=int, help="override the record count")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per case (default 3)")
    parser.add_argument("--dir", help="put the data in a fresh subdirectory of DIR, removed at the end (default: under /tmp)")
    parser.add_argument("--only", choices=sorted(TARGETS), action="append", help="run only these cases")
    args = parser.parse_args(argv)
    records = args.records or (500_000 if args.quick else 2_000_000)
    cases = args.only or ["upload", "spark", "replay"]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    root = tempfile.mkdtemp(prefix="bench_tier-", dir=args.dir or "/tmp")
    print(f"bench_tier: {records:,} records of {VALUE_SIZE} bytes, best of {args.reps}; {os.cpu_count()} CPUs, {load_text()}", flush=True)
    results = []
    try:
        if "upload" in cases:
            results.append(bench_upload(root, records, args.reps))
            print(f"  upload: {results[-1]['records_per_s']:,} records/s, pyarrow alone {results[-1]['baseline_records_per_s']:,}", flush=True)
        if "spark" in cases or "replay" in cases:
            start_local_ray(object_store_memory=2 << 30)
            import logbus
            import logbus.spark
            from logbus import TopicPartition

            bus = logbus.connect(data_dir=root, namespace=new_namespace("bench-tier"))
        if "spark" in cases:
            spark = logbus.spark.init_spark(
                "logbus-bench-tier", num_executors=1, executor_cores=2, executor_memory="4GB",
                configs={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "8"},
            )
            bus.admin.create_topic("spark-tiered", partitions=PARTITIONS, config=TIERED)
            produce(bus, "spark-tiered", records, PARTITIONS)
            files = wait_all_tiered(bus, "spark-tiered", PARTITIONS)
            tiered_records = sum(pq.ParquetFile(f).metadata.num_rows for f in files)

            tiers = bus.admin.describe_tier("spark-tiered")
            ends = {"spark-tiered": {str(p): tiers[p]["uploaded_up_to"] for p in range(PARTITIONS)}}  # the tiered part alone

            def through_logbus():
                df = logbus.spark.read(spark, "spark-tiered", ending_offsets=ends, bus=bus)
                return df.count(), len(df.groupBy("key").count().collect())

            def parquet_alone():
                df = spark.read.parquet(*files)
                return df.count(), len(df.groupBy("key").count().collect())

            through_logbus(), parquet_alone()  # warm-up
            best = best_base = float("inf")
            for _ in range(args.reps):
                seconds, (count, groups) = timed(through_logbus)
                best = min(best, seconds)
                base_s, (base_count, base_groups) = timed(parquet_alone)
                best_base = min(best_base, base_s)
            assert groups == base_groups == KEYS and count == base_count == tiered_records, (count, base_count, tiered_records)
            results.append(result("spark", count, best, best_base, args.reps))
            print(f"  spark: {results[-1]['records_per_s']:,} records/s, Parquet alone {results[-1]['baseline_records_per_s']:,}", flush=True)
            logbus.spark.stop_spark()
        if "replay" in cases:
            replay_records = min(records, 1_000_000)
            bus.admin.create_topic("replay-tiered", partitions=1, config=TIERED)
            bus.admin.create_topic("replay-local", partitions=1, config={"segment.bytes": 16 << 20, "retention.ms": -1})
            produce(bus, "replay-tiered", replay_records, 1)
            produce(bus, "replay-local", replay_records, 1)
            wait_all_tiered(bus, "replay-tiered", 1)

            def replay(topic: str, direct: bool = True) -> int:
                consumer = logbus.Consumer(bus, fetch_max_bytes=8 << 20, read_tier_directly=direct)
                consumer.assign([TopicPartition(topic, 0)])
                consumer.seek(TopicPartition(topic, 0), 0)
                got = 0
                while got < replay_records:
                    table = consumer.poll_arrow(timeout_ms=1000)
                    got += table.num_rows
                consumer.close()
                return got

            replay("replay-tiered"), replay("replay-local")  # warm-up
            best = best_base = float("inf")
            for _ in range(args.reps):
                best = min(best, timed(lambda: replay("replay-tiered"))[0])
                best_base = min(best_base, timed(lambda: replay("replay-local"))[0])
            files = sorted(glob.glob(f"{bus.data_dir}/remote/replay-tiered-*/0/data/*.parquet"))

            def pyarrow_alone() -> int:
                rows = 0
                for path in files:
                    parquet = pq.ParquetFile(path)
                    rows += sum(parquet.read_row_group(g).num_rows for g in range(parquet.num_row_groups))
                return rows

            decode_s = min(timed(pyarrow_alone)[0] for _ in range(args.reps))
            decoded = pyarrow_alone()
            leader_s = min(timed(lambda: replay("replay-tiered", direct=False))[0] for _ in range(args.reps))
            results.append(result("replay", replay_records, best, best_base, args.reps))
            results[-1]["pyarrow_decode_records_per_s"] = round(decoded / decode_s)
            results[-1]["through_leader_records_per_s"] = round(replay_records / leader_s)
            print(f"  replay: {results[-1]['records_per_s']:,} records/s, local segments {results[-1]['baseline_records_per_s']:,}", flush=True)
    finally:
        end_spark_run(root)
    print(f"end: {load_text()}")
    for line in results:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
