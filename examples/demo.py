"""End-to-end demo: a page-view stream through logbus on an embedded local Ray.

Creates a topic, produces one million page-view events keyed by user,
consumes them back as Arrow tables, and prints what it did and how fast.
Data lives in ./logbus-data (or --data-dir) and survives the run.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import pyarrow as pa
import pyarrow.compute as pc

import logbus
from logbus import TopicPartition

PAGES = ["/", "/search", "/cart", "/checkout", "/product/1", "/product/2", "/product/3", "/help", "/account", "/deals"]


def make_events(count: int, users: int, seed: int = 7) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    keys, values = [], []
    start_ms = 1_700_000_000_000
    for i in range(count):
        user = f"user-{rng.randrange(users):05d}"
        keys.append(user.encode())
        event = {"user": user, "page": rng.choice(PAGES), "ts": start_ms + i, "ms_on_page": rng.randrange(50, 30_000)}
        values.append(json.dumps(event, separators=(",", ":")).encode())
    return keys, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", default="logbus-data")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    args = parser.parse_args()

    started = time.perf_counter()
    bus = logbus.connect(data_dir=args.data_dir)
    print(f"connected to logbus in {time.perf_counter() - started:.1f}s (data in {bus.data_dir})")
    topic = "page-views"
    if topic in bus.admin.list_topics():
        bus.admin.delete_topic(topic)  # a fresh topic each run keeps the figures comparable
    bus.admin.create_topic(topic, partitions=args.partitions)
    print(f"created topic {topic!r} with {args.partitions} partitions")

    keys, values = make_events(args.events, users=20_000)
    producer = logbus.Producer(bus, linger_ms=10)
    started = time.perf_counter()
    futures = []
    for i in range(args.events):
        futures.append(producer.send(topic, values[i], key=keys[i]))
        if (i + 1) % 250_000 == 0:
            print(f"  sent {i + 1:,} events ({(i + 1) / (time.perf_counter() - started):,.0f}/s)")
    producer.flush()
    produce_s = time.perf_counter() - started
    failed = sum(1 for f in futures if f.exception() is not None)
    producer.close()
    print(f"produced {args.events:,} events in {produce_s:.2f}s: {args.events / produce_s:,.0f} records/s, {failed} failed")

    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic, p) for p in range(args.partitions)])
    started = time.perf_counter()
    tables, total = [], 0
    while total < args.events:
        table = consumer.poll_arrow(timeout_ms=2000)
        if table.num_rows == 0:
            break
        tables.append(table)
        total += table.num_rows
    consume_s = time.perf_counter() - started
    consumer.close()
    print(f"consumed {total:,} events in {consume_s:.2f}s: {total / consume_s:,.0f} records/s")

    table = pa.concat_tables(tables)
    per_partition = table.group_by("partition").aggregate([("offset", "count"), ("offset", "max")]).sort_by("partition")
    for row in per_partition.to_pylist():
        print(f"  partition {row['partition']}: {row['offset_count']:,} events, last offset {row['offset_max']:,}")
    pages = pc.struct_field(pc.extract_regex(table["value"].cast(pa.string()), r'"page":"(?P<page>[^"]*)"'), "page")
    top = pa.table({"page": pages}).group_by("page").aggregate([("page", "count")]).sort_by([("page_count", "descending")])
    print("top pages:", ", ".join(f"{r['page']} ({r['page_count']:,})" for r in top.to_pylist()[:5]))
    ok = total == args.events and failed == 0
    print("demo", "OK: every event came back" if ok else "FAILED: events missing")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
