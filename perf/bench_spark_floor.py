#!/usr/bin/env python
"""The micro-batch floor: how long a trigger over one record takes (Spark's own readStream and `logbus.spark.stream`), beside Spark's floor.

Run with ``./dev bench spark_floor`` (= ``.venv/bin/python perf/bench_spark_floor.py``);
``--triggers N`` sets how many one-record triggers are timed (default 30).

One Spark session through RayDP (1 executor of 1 core, as the tests use) and a
1-partition topic. A stream (``logbus.spark.stream``, ``process_batch`` =
``df.count()``) runs with a 10 ms trigger interval; the benchmark sends one record,
waits for the batch that holds it, and takes the batch's own duration
(``BatchProgress.duration_s``: recording the plan, reading the range as a
DataFrame, the count, committing the offsets). Then the same through Spark's
own Structured Streaming: ``logbus.spark.read_stream`` into ``foreachBatch``
(``df.count()``), default trigger, a checkpoint on local disk; the batch's
duration is Spark's ``durationMs.triggerExecution`` (the offsets asked of
logbus, the plan written, the job, the commit). Then, in the same session, Spark's
own floor: the same ``foreachBatch`` query over a source of Spark's own
(``rate-micro-batch``, one row a batch, nothing read: Spark's part of a trigger
alone), ``spark.range(1).count()`` and the count of a one-row DataFrame made by
``spark.createDataFrame``, the least a trigger that runs a Spark job can take.
Every case gets 3 untimed runs first; medians are reported. Target: trigger median
<= 0.1 s; ratio: trigger median / Spark's ``range(1).count()`` median.

The last lines are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time

# First: it puts this tree's logbus on sys.path.
from _common import arg_parser, end_spark_run, new_namespace, print_table, start_local_ray, timed

TARGET_S = 0.1
WARMUP = 3


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--triggers", type=int, default=30, help="one-record triggers timed (default 30)")
    args = parser.parse_args(argv)
    if args.triggers < 1:
        parser.error("--triggers must be at least 1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    root = tempfile.mkdtemp(prefix="bench_spark_floor-")
    start_local_ray()
    import logbus
    import logbus.spark

    results = []
    try:
        spark = logbus.spark.init_spark("logbus-bench-floor", num_executors=1, executor_cores=1, executor_memory="1GB",
                                        configs={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "4"})
        bus = logbus.connect(data_dir=root, namespace=new_namespace("bench-floor"))
        topic = "floor"
        bus.admin.create_topic(topic, partitions=1)
        batches: list = []
        arrived = threading.Condition()

        def progress(batch) -> None:
            with arrived:
                batches.append(batch)
                arrived.notify_all()

        counted: list[int] = []
        stream = logbus.spark.stream(spark, topic, "floor-group", lambda df, batch_id: counted.append(df.count()),
                                     trigger_interval_s=0.01, bus=bus, progress=progress)
        producer = logbus.Producer(bus, linger_ms=0)
        try:
            for i in range(WARMUP + args.triggers):
                producer.send(topic, b"record-%d" % i).get(timeout=60)
                with arrived:
                    if not arrived.wait_for(lambda: len(batches) > i, timeout=120):
                        raise SystemExit(f"no batch for record {i} within 120 s")
        finally:
            stream.stop()
            stream.await_termination()
            producer.close()
        if sum(b.records for b in batches) != WARMUP + args.triggers or sum(counted) != WARMUP + args.triggers:
            raise SystemExit(f"{sum(counted)} records counted in {len(batches)} batches, expected {WARMUP + args.triggers}")
        trigger = [b.duration_s for b in batches[WARMUP:]]

        # Spark's own Structured Streaming over the same topic.
        native_counted: list[int] = []
        # From the topic's end now ("latest" would be the end when the query's first trigger runs).
        end = bus.admin.describe_topic(topic).partitions[0].high_watermark
        query = (
            logbus.spark.read_stream(spark, topic, starting_offsets={topic: {"0": end}}, bus=bus).writeStream
            .foreachBatch(lambda df, batch_id: native_counted.append(df.count()))
            .option("checkpointLocation", os.path.join(root, "checkpoint")).start()
        )
        try:
            producer = logbus.Producer(bus, linger_ms=0)
            for i in range(WARMUP + args.triggers):
                producer.send(topic, b"native-%d" % i).get(timeout=60)
                deadline = time.monotonic() + 120
                while sum(native_counted) <= i:
                    if time.monotonic() > deadline or query.exception() is not None:
                        raise SystemExit(f"no readStream batch for record {i} within 120 s: {query.exception()}")
                    time.sleep(0.005)
            producer.close()
            progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
        finally:
            query.stop()
        if sum(native_counted) != WARMUP + args.triggers:
            raise SystemExit(f"readStream counted {sum(native_counted)} records, expected {WARMUP + args.triggers}")
        native = [p["durationMs"]["triggerExecution"] / 1000 for p in progress][WARMUP:]

        # The same query over a source of Spark's own: "rate-micro-batch" makes one row per batch and reads
        # nothing, so its trigger is Spark's part of a trigger alone (the plan and commit logs, the job).
        rate_counted: list[int] = []
        rate_query = (
            spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 1).load().writeStream
            .foreachBatch(lambda df, batch_id: rate_counted.append(df.count()))
            .option("checkpointLocation", os.path.join(root, "checkpoint-rate")).start()
        )
        try:
            deadline = time.monotonic() + 300
            while len(rate_counted) < WARMUP + args.triggers:
                if time.monotonic() > deadline or rate_query.exception() is not None:
                    raise SystemExit(f"the rate-micro-batch query made {len(rate_counted)} batches in 300 s: {rate_query.exception()}")
                time.sleep(0.05)
            rate_progress = [p for p in rate_query.recentProgress if p["numInputRows"] > 0]
        finally:
            rate_query.stop()
        if any(count != 1 for count in rate_counted):
            raise SystemExit(f"rate-micro-batch batches of other sizes than 1 row: {sorted(set(rate_counted))}")
        own_source = [p["durationMs"]["triggerExecution"] / 1000 for p in rate_progress][WARMUP:WARMUP + args.triggers]

        def floor(run) -> list[float]:
            for _ in range(WARMUP):
                run()
            return [timed(run)[0] for _ in range(args.triggers)]

        spark_range = floor(lambda: spark.range(1).count())
        one_row = floor(lambda: spark.createDataFrame([(b"k", b"v")], "key binary, value binary").count())
        median = statistics.median(trigger)
        range_median = statistics.median(spark_range)
        native_median = statistics.median(native)
        results.append({"case": "readStream.format(logbus) trigger over 1 record (foreachBatch count)", "median_s": round(native_median, 3),
                        "p90_s": round(sorted(native)[int(0.9 * (len(native) - 1))], 3), "ratio": round(native_median / range_median, 2),
                        "ratio_to": "spark.range(1).count()", "target_s": TARGET_S, "met": native_median <= TARGET_S,
                        "batches": len(native)})
        results.append({"case": "logbus.spark.stream trigger over 1 record (df.count())", "median_s": round(median, 3),
                        "p90_s": round(sorted(trigger)[int(0.9 * (len(trigger) - 1))], 3), "ratio": round(median / range_median, 2),
                        "ratio_to": "spark.range(1).count()", "target_s": TARGET_S, "met": median <= TARGET_S})
        own_median = statistics.median(own_source)

        def parts(progress_list) -> dict:
            """Median ms of each part of a trigger that Spark times (durationMs: latestOffset, addBatch, walCommit, ...)."""
            keys = {k for p in progress_list for k in p["durationMs"]} - {"triggerExecution"}
            return {k: statistics.median(p["durationMs"].get(k, 0) for p in progress_list) for k in sorted(keys)}

        results[0]["parts_ms"] = parts(progress[WARMUP:])
        results.append({"case": "Spark's own source (rate-micro-batch, 1 row a batch), same foreachBatch count",
                        "median_s": round(own_median, 3), "p90_s": round(sorted(own_source)[int(0.9 * (len(own_source) - 1))], 3),
                        "ratio": round(own_median / range_median, 2), "ratio_to": "spark.range(1).count()", "batches": len(own_source),
                        "parts_ms": parts(rate_progress[WARMUP:WARMUP + args.triggers])})
        results[0]["ratio_to_spark_source"] = round(native_median / own_median, 2)
        results.append({"case": "Spark floor: spark.range(1).count()", "median_s": round(range_median, 3),
                        "p90_s": round(sorted(spark_range)[int(0.9 * (len(spark_range) - 1))], 3)})
        results.append({"case": "Spark floor: createDataFrame(1 row).count()", "median_s": round(statistics.median(one_row), 3),
                        "p90_s": round(sorted(one_row)[int(0.9 * (len(one_row) - 1))], 3)})
        load = [round(x, 1) for x in os.getloadavg()]
        for r in results:
            r["load_avg"] = load
            r["triggers"] = args.triggers
    finally:
        end_spark_run(root)

    def ratio_text(r: dict) -> str:
        if "ratio" not in r:
            return ""
        text = f"{r['ratio']:.2f}x {r['ratio_to']}"
        if "ratio_to_spark_source" in r:
            text += f", {r['ratio_to_spark_source']:.2f}x Spark's own source"
        return text

    print_table(("case", "median s", "p90 s", "ratio", "target"), [
        (r["case"], f"{r['median_s']:.3f}", f"{r['p90_s']:.3f}", ratio_text(r),
         f"<= {r['target_s']} s: {'met' if r['met'] else 'MISSED'}" if "target_s" in r else "")
        for r in results
    ])
    for r in results:
        if "parts_ms" in r:
            print(f"{r['case']}: median ms by part of the trigger: " + ", ".join(f"{k} {v:g}" for k, v in r["parts_ms"].items()))
    for r in results:
        print(json.dumps({"bench": "spark_floor", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
