#!/usr/bin/env python
"""Transaction benchmarks: transactional send_table against plain send_table, commit latency, read_committed reads.

Run with ``.venv/bin/python perf/bench_transactions.py``. ``--quick`` makes a short
smoke run (< 90 s).

Everything runs on this machine: a private embedded Ray
(``ray.init(address="local", num_cpus=4, include_dashboard=False)``), a fresh temp
``data_dir`` and a unique namespace, all removed at the end (also on errors and on
SIGTERM). Records are 100-byte random values in pre-built tables of 10,000 rows
(``send_table``), into a topic of 3 partitions (one table per partition per round).

1. produce       The same producer settings (acks="all", idempotent), in the same run,
                 alternating rounds: plain ``send_table`` + flush, against a
                 transactional producer that commits every 100 ms (``begin_transaction``,
                 ``send_table`` until 100 ms passed, ``commit_transaction``). records/s per
                 round; best and median of the rounds. Target: transactional >= 0.9x plain.
2. commit        Latency of ``commit_transaction()`` (flush of the transaction's batches,
                 then EndTxn: PrepareCommit saved, a marker on each of the 3 partitions,
                 CompleteCommit saved), from the commits of phase 1: p50 and p99. Also a
                 transaction of one small record per partition (the protocol's own cost).
3. consume       The topic written in phase 1 (plain and transactional rounds, markers
                 included) read from the start with ``poll_arrow``, by a read_committed
                 consumer and by a read_uncommitted one, alternating; records/s, best and
                 median. Target: read_committed >= 0.9x read_uncommitted.

This machine is shared (2 cores, other engineers' runs): every figure is repeated, and the
load average at the start and end is printed. The last lines of output are one JSON object
per result ({"bench": "transactions", ...}).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

# First: it puts this tree's logbus on sys.path.
from _common import (
    TABLE_ROWS,
    RunInfo,
    arg_parser,
    delete_topics,
    exit_on_sigterm,
    fmt,
    fmt_rate,
    json_value,
    log,
    make_pool,
    make_table,
    new_namespace,
    print_table,
    remove_dir,
    shutdown_ray,
    start_local_ray,
)

import logbus  # noqa: E402
from logbus import Consumer, Producer, TopicPartition  # noqa: E402

PARTITIONS = 3
COMMIT_INTERVAL_S = 0.1
PRODUCER_OPTIONS = {"acks": "all", "linger_ms": 5}


@dataclass
class Mode:
    rounds: int
    round_s: float
    small_commits: int
    consume_rounds: int


FULL = Mode(rounds=6, round_s=5.0, small_commits=200, consume_rounds=4)
QUICK = Mode(rounds=2, round_s=1.5, small_commits=20, consume_rounds=2)


@dataclass
class Result:
    case: str
    unit: str
    values: list[float] = field(default_factory=list)
    target: str | None = None
    meets_target: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def best(self) -> float | None:
        if not self.values:
            return None
        return min(self.values) if self.unit == "ms" else max(self.values)

    @property
    def p50(self) -> float | None:
        return statistics.median(self.values) if self.values else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def plain_round(producer: Producer, topic: str, tables: list, seconds: float) -> tuple[int, float]:
    """send_table for ``seconds``, then flush; (records, records/s)."""
    sent, futures = 0, []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for table in tables:
            futures.append(producer.send_table(topic, table))
            sent += table.num_rows
    producer.flush()
    elapsed = time.perf_counter() - start
    for future in futures:
        future.result()
    return sent, sent / elapsed


def transactional_round(producer: Producer, topic: str, tables: list, seconds: float, commits_ms: list[float]) -> tuple[int, float]:
    """Transactions of ``COMMIT_INTERVAL_S`` each for ``seconds``; (records, records/s). Appends each commit's latency."""
    sent = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        producer.begin_transaction()
        opened = time.perf_counter()
        futures = []
        while time.perf_counter() - opened < COMMIT_INTERVAL_S:
            for table in tables:
                futures.append(producer.send_table(topic, table))
                sent += table.num_rows
        committing = time.perf_counter()
        producer.commit_transaction()
        commits_ms.append((time.perf_counter() - committing) * 1000)
        for future in futures:
            future.result()
    return sent, sent / (time.perf_counter() - start)


def read_all(bus, topic: str, isolation_level: str, expected: int, time_cap_s: float) -> float:
    """Read the topic from the start with poll_arrow; records/s over ``expected`` records."""
    consumer = Consumer(bus, isolation_level=isolation_level)
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        consumer.seek_to_beginning()
        got = 0
        start = time.perf_counter()
        while got < expected and time.perf_counter() - start < time_cap_s:
            got += consumer.poll_arrow(timeout_ms=1000).num_rows
        elapsed = time.perf_counter() - start
    finally:
        consumer.close()
    if got < expected:
        raise RuntimeError(f"{isolation_level} read {got} of {expected} records in {time_cap_s}s")
    return got / elapsed


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 90 s)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    exit_on_sigterm()

    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-txn-")
    namespace = new_namespace("bench-txn")
    topic = "bench-transactions"
    results: list[Result] = []
    bus = None
    log(f"mode={'quick' if args.quick else 'full'} partitions={PARTITIONS} data_dir={data_dir} namespace={namespace} "
        f"load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        start_local_ray(namespace, object_store_memory=1 << 30)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        bus.admin.create_topic(topic, partitions=PARTITIONS)
        pool = make_pool(TABLE_ROWS)
        tables = [make_table(pool, partition=p) for p in range(PARTITIONS)]

        # ---- 1-2. produce, and the commits' latency ---------------------------------------------------
        plain = Result("produce: send_table, idempotent, acks=all", "records/s")
        transactional = Result(f"produce: send_table in transactions committed every {COMMIT_INTERVAL_S * 1000:.0f} ms", "records/s")
        commits_ms: list[float] = []
        with Producer(bus, **PRODUCER_OPTIONS) as plain_producer, \
                Producer(bus, transactional_id=f"{namespace}-bench", **PRODUCER_OPTIONS) as txn_producer:
            txn_producer.init_transactions()
            # Warm-up: metadata, channels, batches in flight.
            records = plain_round(plain_producer, topic, tables, 0.5)[0] + transactional_round(txn_producer, topic, tables, 0.5, [])[0]
            for r in range(mode.rounds):
                sent, rate = plain_round(plain_producer, topic, tables, mode.round_s)
                records += sent
                plain.values.append(rate)
                sent, rate = transactional_round(txn_producer, topic, tables, mode.round_s, commits_ms)
                records += sent
                transactional.values.append(rate)
                log(f"round {r + 1}/{mode.rounds}: plain {fmt_rate(plain.values[-1])}, transactional {fmt_rate(transactional.values[-1])}")
            small_ms = []
            for _ in range(mode.small_commits):
                txn_producer.begin_transaction()
                for p in range(PARTITIONS):
                    txn_producer.send(topic, b"x" * 100, partition=p)
                    records += 1
                started = time.perf_counter()
                txn_producer.commit_transaction()
                small_ms.append((time.perf_counter() - started) * 1000)
        ratio = Result("  ratio: transactional / plain (median rounds)", "x", target=">= 0.9")
        ratio.values = [transactional.p50 / plain.p50]
        ratio.extra["best_ratio"] = transactional.best / plain.best
        ratio.meets_target = ratio.values[0] >= 0.9
        commit = Result(f"commit_transaction latency ({COMMIT_INTERVAL_S * 1000:.0f} ms transactions of send_table)", "ms", commits_ms)
        commit.extra.update(p99=percentile(commits_ms, 0.99), commits=len(commits_ms))
        small = Result(f"commit_transaction latency (one 100-byte record on each of {PARTITIONS} partitions)", "ms", small_ms)
        small.extra.update(p99=percentile(small_ms, 0.99), commits=len(small_ms))
        results += [plain, transactional, ratio, commit, small]

        # ---- 3. read_committed against read_uncommitted ---------------------------------------------------
        expected = sum(p.high_watermark for p in bus.admin.describe_topic(topic).partitions)
        committed_read = Result("consume: poll_arrow, read_committed", "records/s")
        uncommitted_read = Result("consume: poll_arrow, read_uncommitted", "records/s")
        # Every record sent was committed (markers take offsets but are no records: readers skip them).
        for r in range(mode.consume_rounds):
            uncommitted_read.values.append(read_all(bus, topic, "read_uncommitted", records, 120))
            committed_read.values.append(read_all(bus, topic, "read_committed", records, 120))
            log(f"read {r + 1}/{mode.consume_rounds}: read_uncommitted {fmt_rate(uncommitted_read.values[-1])}, "
                f"read_committed {fmt_rate(committed_read.values[-1])}")
        read_ratio = Result("  ratio: read_committed / read_uncommitted (median)", "x", target=">= 0.9")
        read_ratio.values = [committed_read.p50 / uncommitted_read.p50]
        read_ratio.meets_target = read_ratio.values[0] >= 0.9
        results += [uncommitted_read, committed_read, read_ratio]
        log(f"topic: {expected:,} offsets, {records:,} records (the rest are transaction markers)")
    finally:
        delete_topics(bus, [topic])
        shutdown_ray()
        remove_dir(data_dir)

    wall = run.finish()
    print_table(
        ("case", "unit", "best", "p50", "p99", "target"),
        [(r.case, r.unit, fmt(r.best), fmt(r.p50), fmt(r.extra.get("p99")), r.target or "") for r in results],
    )
    log(f"done in {wall:.0f}s; load average {run.load_start[0]:.1f} at the start, {run.load_end[0]:.1f} at the end "
        f"(other processes share these {os.cpu_count()} CPUs)")
    for r in results:
        line = {
            "bench": "transactions", "case": r.case.strip(), "unit": r.unit, "best": json_value(r.best), "p50": json_value(r.p50),
            "values": json_value(r.values) if len(r.values) <= 20 else None, "target": r.target, "meets_target": r.meets_target,
            "quick": run.quick, "date": run.date, "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        }
        line.update({k: json_value(v) for k, v in r.extra.items()})
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
