"""A streaming pipeline: page views from logbus into Spark in micro-batches, aggregated with Spark SQL.

Produces page-view events into a topic, streams them into Spark through RayDP
(each micro-batch a DataFrame with the Kafka source's schema), counts views per
page per minute with Spark SQL, writes the results to an output topic, and
prints them. The group's offsets are committed only after a batch's results
were written, so a crash re-runs that batch (at least once).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import logbus
import logbus.spark
from logbus import TopicPartition

PAGES = ["/", "/search", "/cart", "/checkout", "/product/1", "/product/2", "/help"]


def produce_events(bus, topic: str, count: int) -> None:
    rng = random.Random(11)
    start_ms = int(time.time() * 1000) - 10 * 60_000  # the last ten minutes
    with logbus.Producer(bus, linger_ms=10) as producer:
        for i in range(count):
            timestamp_ms = start_ms + i * (10 * 60_000) // count
            event = {"user": f"user-{rng.randrange(5000)}", "page": rng.choice(PAGES)}
            producer.send(topic, json.dumps(event).encode(), key=event["user"], timestamp_ms=timestamp_ms)


def configure_logging(verbose: bool) -> None:
    """logbus's own progress lines (one per micro-batch); Ray Data's and Spark's INFO chatter only with --verbose."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("logbus").setLevel(logging.INFO)
    if not verbose:
        import ray.data

        logging.getLogger("ray.data").setLevel(logging.WARNING)  # execution plans and progress, per micro-batch
        ray.data.DataContext.get_current().enable_progress_bars = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", default="logbus-data")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--verbose", action="store_true", help="show Ray Data's and Spark's INFO logs too")
    args = parser.parse_args()
    configure_logging(args.verbose)

    bus = logbus.connect(data_dir=args.data_dir)
    source, sink = "pipeline-page-views", "pipeline-views-per-minute"
    for topic in (source, sink):
        if topic in bus.admin.list_topics():
            bus.admin.delete_topic(topic)
    bus.admin.create_topic(source, partitions=4)
    bus.admin.create_topic(sink, partitions=1)
    produce_events(bus, source, args.events)
    print(f"produced {args.events:,} page views into {source!r}")

    started = time.perf_counter()
    spark = logbus.spark.init_spark(
        "logbus-pipeline", num_executors=1, executor_cores=1, executor_memory="1GB",
        configs={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "4"},
    )
    spark.sparkContext.setLogLevel("INFO" if args.verbose else "ERROR")
    print(f"Spark started through RayDP in {time.perf_counter() - started:.1f}s")

    def process_batch(df, batch_id: int) -> None:
        df.createOrReplaceTempView("views")
        per_minute = spark.sql(
            """
            SELECT get_json_object(CAST(value AS STRING), '$.page') AS page,
                   date_trunc('minute', timestamp) AS minute,
                   count(*) AS views
            FROM views GROUP BY 1, 2
            """
        )
        out = per_minute.selectExpr(
            "CAST(page AS BINARY) AS key",
            "CAST(to_json(named_struct('batch', %d, 'page', page, 'minute', CAST(minute AS STRING), 'views', views)) AS BINARY) AS value"
            % batch_id,
        )
        written = logbus.spark.write(out, sink, bus=bus)
        print(f"  batch {batch_id}: {df.count():,} views -> {written} (page, minute) counts")

    stream = logbus.spark.stream(
        spark, source, "pipeline", process_batch, max_offsets_per_trigger=args.events // 2, trigger_interval_s=0, bus=bus,
        until_caught_up=True,
    )
    stream.await_termination()
    print(f"streamed in {len(stream.recent_progress)} micro-batches: " + "; ".join(str(p) for p in stream.recent_progress))

    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(sink, 0)])
    rows = []
    while (table := consumer.poll_arrow(timeout_ms=2000)).num_rows:
        rows += [json.loads(v) for v in table["value"].to_pylist()]
    totals: dict[str, int] = {}
    for row in rows:
        totals[row["page"]] = totals.get(row["page"], 0) + row["views"]
    print("views per page:", ", ".join(f"{page} {views:,}" for page, views in sorted(totals.items(), key=lambda kv: -kv[1])))
    ok = sum(totals.values()) == args.events
    print("pipeline", "OK: every view counted once" if ok else "FAILED: counts do not add up")
    logbus.spark.stop_spark()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
