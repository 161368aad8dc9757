#!/usr/bin/env python
"""Spark bridge benchmark: topic -> Spark DataFrame against Spark reading Parquet, and DataFrame -> topic.

Run with ``./dev bench spark`` (= ``.venv/bin/python perf/bench_spark.py``).
``--records N`` (default 1,000,000; ``--quick``: 200,000), ``--executor-cores C``
(default 1), ``--no-write`` to time the reads only; ``--dir DIR`` puts the data
(the topic and the Parquet files) in a fresh subdirectory of DIR (default: of
/tmp), removed at the end.

Records: 100-byte random (incompressible) values, 1,000 distinct 8-byte keys,
recent timestamps, no headers, spread evenly over a 4-partition topic.

Cases (each timed from the records at rest to the Spark results, the
DataFrame not cached, so each action reads again):

1. baseline     Spark reading the same records from local Parquet files (one per
                partition, written by pyarrow with Spark's default snappy compression,
                in the Kafka source's columns): ``spark.read.parquet(dir)``, then
                ``df.count()`` and ``df.groupBy("key").count().collect()``.
2. read         ``logbus.spark.read(spark, topic)`` then the same two actions. Target:
                at least the baseline's records/s (ratio >= 1.0).
3. write        ``logbus.spark.write(df, topic)`` of a DataFrame of (key, value) persisted on
                disk. Target: at least 0.5 of the reference's records/s.
4. write reference (info): ``Producer.send_table`` of the same (key, value) records from
                an in-memory Table, without Spark.

Each figure is the best of N repetitions (N is printed), the two read cases
alternating, after a warm-up of each. The machine's load average is printed
with the results. The last lines are one JSON object per result.
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
TARGET_RATIO = 1.0  # read's records/s over Spark reading Parquet
WRITE_TARGET_RATIO = 0.5  # write's records/s over Producer.send_table
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


def write_parquet(table: pa.Table, topic: str, directory: str) -> None:
    """The produced records in the Kafka source's columns, one Parquet file per partition (offsets as
    the topic numbers them: in produce order within each partition)."""
    import pyarrow.parquet as pq

    os.makedirs(directory)
    parts = table["partition"].to_numpy()
    for p in range(PARTITIONS):
        rows = table.filter(pa.array(parts == p))
        count = rows.num_rows
        pq.write_table(
            pa.table(
                {
                    "key": rows["key"],
                    "value": rows["value"],
                    "topic": pa.array([topic] * count, pa.string()),
                    "partition": rows["partition"],
                    "offset": pa.array(np.arange(count, dtype=np.int64)),
                    "timestamp": rows["timestamp"].cast(pa.timestamp("ms")).cast(pa.timestamp("us")),
                    "timestampType": pa.array(np.zeros(count, np.int32)),
                }
            ),
            os.path.join(directory, f"part-{p}.parquet"),
            compression="snappy",
        )


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
    parser.add_argument("--quick", action="store_true", help="200,000 records instead of 1,000,000")
    parser.add_argument("--records", type=int, help="override the record count")
    parser.add_argument("--executor-cores", type=int, default=1, help="cores of Spark's one executor (default 1)")
    parser.add_argument("--reps", type=int, help="repetitions per case (default 3)")
    parser.add_argument("--no-write", action="store_true", help="time the reads only")
    parser.add_argument("--dir", help="put the data in a fresh subdirectory of DIR, removed at the end (default: under /tmp)")
    args = parser.parse_args(argv)
    records = args.records or (200_000 if args.quick else 1_000_000)
    reps = args.reps or 3
    cores = args.executor_cores
    os.environ["PYSPARK_PYTHON"] = sys.executable

    root = tempfile.mkdtemp(prefix="bench_spark-", dir=args.dir or "/tmp")
    started = time.perf_counter()
    start_local_ray(object_store_memory=(6 << 30) if records > 1_000_000 else (2 << 30))
    import logbus
    import logbus.spark

    print(
        f"bench_spark: {records:,} records of {VALUE_SIZE} bytes, {PARTITIONS} partitions, best of {reps}; "
        f"Spark: 1 executor of {cores} cores; {os.cpu_count()} CPUs, data in {root}",
        flush=True,
    )
    results: list[dict] = []

    def start_spark(app_name: str):
        return logbus.spark.init_spark(
            app_name, num_executors=1, executor_cores=cores, executor_memory="6GB",
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
        bus = logbus.connect(data_dir=os.path.join(root, "logbus"), namespace=new_namespace("bench-spark"))
        topic = "bench-spark"
        bus.admin.create_topic(topic, partitions=PARTITIONS)
        table = make_records(records, PARTITIONS)
        produce_s, _ = timed(lambda: produce(bus, topic, table))
        parquet_dir = os.path.join(root, "parquet")
        write_parquet(table, topic, parquet_dir)
        print(f"  produced {records:,} records in {produce_s:.1f} s, and wrote them as Parquet ({time.perf_counter() - started:.0f} s)", flush=True)
        expected_groups = {b"key-%04d" % k: records // KEYS + (1 if k < records % KEYS else 0) for k in range(KEYS)}

        def logbus_read():
            return count_and_group(logbus.spark.read(spark, topic, bus=bus))

        def parquet_read():
            return count_and_group(spark.read.parquet(parquet_dir))

        # Warm-up: the JVM's JIT and class loading, the executor's first tasks.
        for run in (parquet_read, logbus_read):
            run()
        print(f"  warmed up ({time.perf_counter() - started:.0f} s)", flush=True)

        timings: dict[str, list[float]] = {"read": [], "baseline": []}
        for rep in range(reps):
            for case, run in (("baseline", parquet_read), ("read", logbus_read)):
                seconds, (count, groups) = timed(run)
                if count != records or groups != expected_groups:
                    raise SystemExit(f"{case}: wrong result (count {count:,}, {len(groups)} groups)")
                timings[case].append(seconds)
                print(f"  rep {rep + 1} {case}: {seconds:.2f} s, {records / seconds:,.0f} records/s ({time.perf_counter() - started:.0f} s)", flush=True)

        read_s, baseline_s = min(timings["read"]), min(timings["baseline"])
        ratio = baseline_s / read_s
        load = [round(x, 1) for x in os.getloadavg()]
        results.append(result("read: topic -> DataFrame, count + group-by", records, read_s, reps, ratio=round(ratio, 2),
                              ratio_to="baseline", target=TARGET_RATIO, met=ratio >= TARGET_RATIO, executor_cores=cores,
                              all_s=[round(s, 2) for s in timings["read"]]))
        results.append(result("baseline: Spark reading local Parquet, same actions", records, baseline_s, reps, executor_cores=cores,
                              all_s=[round(s, 2) for s in timings["baseline"]]))
        if args.no_write:
            for r in results:
                r["load_avg"] = load
            return report(results, started)

        # RayDP holds every block handed to Spark until the session stops: start afresh.
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
        write_ratio = reference_s / write_s
        results.append(result("write: DataFrame -> topic (key, value)", records, write_s, reps, ratio=round(write_ratio, 2),
                              ratio_to="producer reference", target=WRITE_TARGET_RATIO, met=write_ratio >= WRITE_TARGET_RATIO,
                              all_s=[round(s, 2) for s in write_timings]))
        results.append(result("info: Producer.send_table of the same records, no Spark", records, reference_s, reps,
                              all_s=[round(s, 2) for s in reference_timings]))
        for r in results:
            r["load_avg"] = load
    finally:
        end_spark_run(root)
    return report(results, started)


def report(results: list[dict], started: float) -> int:
    print()
    print(f"{'case':<52} {'records/s':>12} {'seconds':>8} {'ratio':>6}")
    for r in results:
        ratio = "" if "ratio" not in r else f"{r['ratio']:.2f}"
        print(f"{r['case']:<52} {r['records_per_s']:>12,} {r['seconds']:>8.2f} {ratio:>6}")
    for r in results:
        if "target" in r:
            print(f"target ({r['case'].split(':')[0]} >= {r['target']:.2f}x {r['ratio_to']}): {'met' if r['met'] else 'missed'} (ratio {r['ratio']:.2f})")
    print(f"load average {results[0]['load_avg']}; total {time.perf_counter() - started:.0f} s")
    print()
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
