#!/usr/bin/env python
"""Spark bridge benchmark: topic -> Spark DataFrame, and Spark DataFrame -> topic, through RayDP.

Run with ``./dev bench spark`` (= ``.venv/bin/python perf/bench_spark.py``).
``--quick`` uses 500,000 records instead of 5,000,000; ``--dir DIR`` puts the
logbus data in a fresh subdirectory of DIR (default: of /tmp), removed at the end.

Records: 100-byte random (incompressible) values, 1,000 distinct 8-byte keys,
recent timestamps, no headers, spread evenly over a 4-partition topic.

Cases (each timed end to end, from the records at rest to the Spark results):

1. read         ``logbus.spark.read(spark, topic)`` (offsets resolved, one Ray task per
                partition fetching and decoding whole batches, one Arrow IPC stream per
                block handed to RayDP's JVM reader), then ``df.count()`` and
                ``df.groupBy("key").count().collect()``.
2. baseline     the same records as an in-memory pyarrow Table, cut into blocks of the
                same size, handed to Spark with ``ray.data.from_arrow(blocks).to_spark(spark)``
                (RayDP's path for Arrow tables: a pandas UDF in Spark's Python workers)
                and the same Spark projection, count and group-by. Target:
                read >= 70% of this baseline's records/s.
3. in-memory, IPC handoff (info): the in-memory blocks through the same handoff as
                ``read`` (``logbus.spark.to_spark``): what the logbus part itself costs.
4. write        ``logbus.spark.write(df, topic)`` of a DataFrame of (key, value) persisted on disk
                (RayDP's ``from_spark`` then ``TopicSink``, keyed partitioning).
5. write reference (info): ``Producer.send_table`` of the same (key, value) records from
                an in-memory Table, without Spark.

Each figure is the best of N repetitions (N is printed), after a warm-up on a
small range that starts Spark's Python workers and Ray's task workers. The
machine's load average is printed with the results: other work on a 2-core
machine changes the figures a lot. The last lines are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

# First: it puts this tree's logbus on sys.path.
from _common import VALUE_SIZE, arg_parser, end_spark_run, new_namespace, start_local_ray, timed

KEYS = 1_000
PARTITIONS = 4
TARGET_RATIO = 0.70
PRODUCE_CHUNK_ROWS = 250_000
WARMUP_RECORDS = 20_000


def make_records(count: int, partitions: int, seed: int = 7) -> pa.Table:
    """key, value, timestamp and partition columns; values are random and incompressible."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, count * VALUE_SIZE, dtype=np.uint8)
    offsets = np.arange(0, (count + 1) * VALUE_SIZE, VALUE_SIZE, dtype=np.int32)
    values = pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    key_bytes = np.frombuffer(b"".join(b"key-%04d" % k for k in range(KEYS)), np.uint8).reshape(KEYS, 8)
    index = np.arange(count)
    keys = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(np.arange(0, (count + 1) * 8, 8, dtype=np.int32)), pa.py_buffer(key_bytes[index % KEYS].tobytes())]
    )
    now_ms = int(time.time() * 1000)
    return pa.table(
        {
            "key": keys,
            "value": values,
            "timestamp": pa.array(now_ms - count + index, pa.int64()),
            "partition": pa.array(index % partitions, pa.int32()),
        }
    )


def produce(bus, topic: str, table: pa.Table) -> None:
    import logbus

    producer = logbus.Producer(bus, linger_ms=5)
    futures = [producer.send_table(topic, table.slice(i, PRODUCE_CHUNK_ROWS)) for i in range(0, table.num_rows, PRODUCE_CHUNK_ROWS)]
    producer.flush(timeout_s=600)
    for future in futures:
        future.result()
    producer.close()


def as_read_blocks(table: pa.Table, topic: str, rows_per_block: int, topic_type) -> list[pa.Table]:
    """The produced records as the blocks logbus.spark.read hands Spark (same columns, same block size)."""
    order = np.argsort(table["partition"].to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    parts = table["partition"].to_numpy()
    offsets = np.empty(table.num_rows, np.int64)
    for p in range(PARTITIONS):
        mask = parts == p
        offsets[mask] = np.arange(mask.sum())
    count = table.num_rows
    shaped = pa.table(
        {
            "offset": pa.array(offsets),
            "key": table["key"],
            "value": table["value"],
            "topic": pa.array([topic] * count, pa.string()).cast(topic_type),
            "partition": table["partition"],
            "timestamp": table["timestamp"],
            "timestamp_type": pa.array(np.zeros(count, np.int32)),
        }
    ).combine_chunks()
    return [shaped.slice(i, rows_per_block) for i in range(0, count, rows_per_block)]


def kafka_columns():
    from pyspark.sql import functions as F

    return [
        F.col("key"), F.col("value"), F.col("topic").cast("string").alias("topic"), F.col("partition"), F.col("offset"),
        F.timestamp_millis(F.col("timestamp")).alias("timestamp"), F.col("timestamp_type").alias("timestampType"),
    ]


def count_and_group(df) -> tuple[int, dict]:
    count = df.count()
    groups = {bytes(row["key"]): row["count"] for row in df.groupBy("key").count().collect()}
    return count, groups


def result(case: str, records: int, seconds: float, reps: int, **extra) -> dict:
    out = {"bench": "spark", "case": case, "records": records, "seconds": round(seconds, 3), "records_per_s": round(records / seconds)}
    out.update(reps=reps, **extra)
    return out


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="500,000 records instead of 5,000,000")
    parser.add_argument("--records", type=int, help="override the record count")
    parser.add_argument("--reps", type=int, help="repetitions per case (default 2, or 3 with --quick)")
    parser.add_argument("--dir", help="put the data in a fresh subdirectory of DIR, removed at the end (default: under /tmp)")
    args = parser.parse_args(argv)
    records = args.records or (500_000 if args.quick else 5_000_000)
    reps = args.reps or (3 if args.quick else 2)
    os.environ["PYSPARK_PYTHON"] = sys.executable

    import ray

    root = tempfile.mkdtemp(prefix="bench_spark-", dir=args.dir or "/tmp")
    started = time.perf_counter()
    start_local_ray(object_store_memory=(6 << 30) if records > 1_000_000 else (2 << 30))
    import logbus
    import logbus.spark
    from logbus.api.dataset import BLOCK_SIZE_BYTES

    print(
        f"bench_spark: {records:,} records of {VALUE_SIZE} bytes, {PARTITIONS} partitions, best of {reps}; "
        f"{os.cpu_count()} CPUs, data in {root}",
        flush=True,
    )
    results: list[dict] = []

    def start_spark(app_name: str):
        return logbus.spark.init_spark(
            app_name, num_executors=1, executor_cores=2, executor_memory="6GB",
            configs={
                "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": "8",
                # RayDP's from_spark starts one fetch task per Spark partition, all at once by
                # default, and each makes the executor copy its partition: bound them to free CPUs.
                "spark.ray.raydp_recoverable_fetch.task.resource.CPU": "1",
            },
        )

    try:
        spark = start_spark("logbus-bench-read")
        bus = logbus.connect(data_dir=root, namespace=new_namespace("bench-spark"))
        topic = "bench-spark"
        bus.admin.create_topic(topic, partitions=PARTITIONS)
        table = make_records(records, PARTITIONS)
        produce_s, _ = timed(lambda: produce(bus, topic, table))
        print(f"  produced {records:,} records in {produce_s:.1f} s ({time.perf_counter() - started:.0f} s)", flush=True)
        row_bytes = 8 + VALUE_SIZE + 8 + 8 + len(topic) + 4 + 8 + 4 + 4 * 4  # columns and offsets of one row
        rows_per_block = max(1, BLOCK_SIZE_BYTES // row_bytes)
        udf_blocks = as_read_blocks(table, topic, rows_per_block, pa.binary())  # pandas 3 breaks on string columns there
        ipc_blocks = as_read_blocks(table, topic, rows_per_block, pa.string())
        expected_groups = {b"key-%04d" % k: records // KEYS + (1 if k < records % KEYS else 0) for k in range(KEYS)}

        def logbus_read(end=None):
            return count_and_group(logbus.spark.read(spark, topic, ending_offsets=end or "latest", bus=bus))

        def baseline(blocks):
            return count_and_group(ray.data.from_arrow(blocks).to_spark(spark).select(*kafka_columns()))

        def in_memory_ipc(blocks):
            return count_and_group(logbus.spark.to_spark(spark, ray.data.from_arrow(blocks), blocks[0].schema).select(*kafka_columns()))

        # Warm-up: Spark's Python workers (they start Ray clients), Ray task workers, JIT.
        small = {p: WARMUP_RECORDS // PARTITIONS for p in range(PARTITIONS)}
        logbus_read(small)
        baseline([b.slice(0, WARMUP_RECORDS // 2) for b in udf_blocks[:2]])
        in_memory_ipc([b.slice(0, WARMUP_RECORDS // 2) for b in ipc_blocks[:2]])
        print(f"  warmed up ({time.perf_counter() - started:.0f} s)", flush=True)

        timings: dict[str, list[float]] = {"read": [], "baseline": [], "in-memory-ipc": []}
        for rep in range(reps):
            for case, run in (("read", logbus_read), ("baseline", lambda: baseline(udf_blocks)), ("in-memory-ipc", lambda: in_memory_ipc(ipc_blocks))):
                seconds, (count, groups) = timed(run)
                if count != records or groups != expected_groups:
                    raise SystemExit(f"{case}: wrong result (count {count:,}, {len(groups)} groups)")
                timings[case].append(seconds)
                print(f"  rep {rep + 1} {case}: {seconds:.2f} s, {records / seconds:,.0f} records/s ({time.perf_counter() - started:.0f} s)", flush=True)

        read_s, baseline_s, ipc_s = min(timings["read"]), min(timings["baseline"]), min(timings["in-memory-ipc"])
        ratio = baseline_s / read_s
        load = [round(x, 1) for x in os.getloadavg()]
        results.append(result("read: topic -> DataFrame, count + group-by", records, read_s, reps, ratio=round(ratio, 2),
                              ratio_to="baseline", target=TARGET_RATIO, met=ratio >= TARGET_RATIO, all_s=[round(s, 2) for s in timings["read"]]))
        results.append(result("baseline: in-memory Table, from_arrow().to_spark()", records, baseline_s, reps, all_s=[round(s, 2) for s in timings["baseline"]]))
        results.append(result("info: in-memory Table, IPC handoff", records, ipc_s, reps, ratio=round(ipc_s / read_s, 2),
                              ratio_to="read is this fraction of it", all_s=[round(s, 2) for s in timings["in-memory-ipc"]]))

        # RayDP holds every block handed to Spark until the session stops: start afresh.
        del udf_blocks, ipc_blocks
        logbus.spark.stop_spark()
        spark = start_spark("logbus-bench-write")

        # Spark DataFrame -> topic: the source is persisted in Spark first (on local disk, to
        # leave the executor's heap to RayDP's from_spark), so only the write is timed.
        from pyspark import StorageLevel

        source = logbus.spark.read(spark, topic, bus=bus).select("key", "value").persist(StorageLevel.DISK_ONLY)
        assert source.count() == records
        bus.admin.create_topic("bench-spark-warmup", partitions=PARTITIONS)
        logbus.spark.write(source.limit(WARMUP_RECORDS), "bench-spark-warmup", bus=bus)  # warm-up of from_spark's path
        bus.admin.delete_topic("bench-spark-warmup")
        write_timings, reference_timings = [], []
        kv = table.select(["key", "value"])
        for rep in range(reps):
            out = f"bench-spark-out-{rep}"
            bus.admin.create_topic(out, partitions=PARTITIONS)
            seconds, written = timed(lambda: logbus.spark.write(source, out, bus=bus))
            if written != records:
                raise SystemExit(f"write: {written:,} records written, expected {records:,}")
            write_timings.append(seconds)
            print(f"  rep {rep + 1} write: {seconds:.2f} s, {records / seconds:,.0f} records/s ({time.perf_counter() - started:.0f} s)", flush=True)
            bus.admin.delete_topic(out)
            reference = f"bench-spark-ref-{rep}"
            bus.admin.create_topic(reference, partitions=PARTITIONS)
            seconds, _ = timed(lambda: produce(bus, reference, kv))
            reference_timings.append(seconds)
            print(f"  rep {rep + 1} write reference: {seconds:.2f} s ({time.perf_counter() - started:.0f} s)", flush=True)
            bus.admin.delete_topic(reference)
        source.unpersist()
        write_s, reference_s = min(write_timings), min(reference_timings)
        results.append(result("write: DataFrame -> topic (key, value)", records, write_s, reps, ratio=round(reference_s / write_s, 2),
                              ratio_to="producer reference", all_s=[round(s, 2) for s in write_timings]))
        results.append(result("info: Producer.send_table of the same records, no Spark", records, reference_s, reps,
                              all_s=[round(s, 2) for s in reference_timings]))
        for r in results:
            r["load_avg"] = load
    finally:
        end_spark_run(root)

    print()
    print(f"{'case':<52} {'records/s':>12} {'seconds':>8} {'ratio':>6}")
    for r in results:
        ratio = "" if "ratio" not in r else f"{r['ratio']:.2f}"
        print(f"{r['case']:<52} {r['records_per_s']:>12,} {r['seconds']:>8.2f} {ratio:>6}")
    met = results[0]["met"]
    print(f"target (read >= {TARGET_RATIO:.0%} of the baseline's records/s): {'met' if met else 'missed'} "
          f"(ratio {results[0]['ratio']:.2f}); load average {results[0]['load_avg']}; total {time.perf_counter() - started:.0f} s")
    print()
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
