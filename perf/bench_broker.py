#!/usr/bin/env python
"""Broker benchmarks: logbus produce / consume throughput and end-to-end latency, with baselines.

Run with ``./dev bench broker`` (= ``.venv/bin/python perf/bench_broker.py``).
``--quick`` makes a short smoke run (< 90 s); ``--records N`` sets the records per
repetition of the throughput cases; ``--skip-redis`` leaves out the Redis baseline;
``--only keyed`` runs case 1d alone (with its baselines).

Everything runs in one process tree on this machine: a private local Ray
(``ray.init(address="local", num_cpus=4)``), a fresh temp ``data_dir`` and a
unique namespace; and, for the baseline, a private ``redis-server`` on a free
loopback port with its own temp dir (``--appendonly yes --appendfsync everysec
--save ''``), which is always shut down at the end, also on errors.

Every record value is 100 bytes (random, incompressible); keys and headers are
null; logbus producers use acks=1 and otherwise default settings (so, with the
current Producer, enable_idempotence=True). Cases:

1. produce   (a) one Producer in the driver, ``send()`` per record, 1-partition topic;
             (b) one Producer, ``send_table()`` of the same pre-built 10,000-row pyarrow
                 table, over and over; (info) the same with enable_idempotence=False;
             (c) two Producers in two Ray actors (separate processes), a 2-partition
                 topic, producer i writing partition i, with ``send_table()`` and, as a
                 second row, with ``send()``; aggregate records/s = all records / (last
                 end - first start).
             Each timing runs from the first send to the end of ``flush()`` (every record
             acknowledged); a repetition stops sending after N records or a time cap.
1d. produce  the per-record path as users write it: one Producer in the driver, ``send(topic,
             value, key=key)`` per record (1,000 distinct keys), a 4-partition topic, every
             RecordFuture kept in a list until the end (target >= 1M records/s); (info) the
             same with ``add_callback`` on every future instead of keeping it (the callbacks
             count the acknowledgements); (info) the same with send() in Python alone
             (``logbus.api.producer.FAST_PATH = False``: the same run's baseline of the C
             path, logbus/api/_fastsend.c); (info) the floor any per-record future pays in
             CPython: one object of three slots made and kept per record, nothing sent.
2. consume   one Consumer in the driver reads the whole send_table topic from offset 0
             with ``poll_arrow()``; records/s, and MB/s of value bytes.
3. latency   a Producer in a Ray actor sends at a paced 10,000 records/s (bursts every
             ~0.5 ms); each value starts with its send time (``time.time_ns()``); a
             Consumer in another Ray actor polls (timeout 5 ms) and computes poll-return
             time minus send time per record. p50 / p99 over every record sent: a record
             not received within a grace period after the sending ended counts as
             infinitely late ("lost"), and a producer still backlogged then is killed.
             Target case: linger_ms=0. Informational: linger_ms=5 (the default),
             linger_ms=0 with max_in_flight=1, linger_ms=5 with enable_idempotence=False,
             and linger_ms=0 with local_channel=False for producer and consumer (actor
             calls only, no Unix socket to the leader). The throughput cases' topics are
             deleted first (their actors and files), so the stream does not share the
             CPUs with their heartbeats or with the kernel writing back their data.
3b. latency  in one process: a Producer (linger_ms=0) in the driver's main thread sends at the
             same paced 10,000 records/s while a Consumer in a thread of the driver polls them
             with ``poll()`` (per record, as users write it; timeout 5 ms); the two share the
             process and its GIL (a Ray driver or a Serve replica that produces and consumes).
             Target p99 <= 5 ms; ratio against the two-process linger_ms=0 case's p99. One more
             repetition than the other latency cases, the best (lowest p99) reported.
4. baselines Redis Streams with redis-py + hiredis: XADD pipelined 1,000 at a time
             (produce); XREADGROUP COUNT 1000 from the start of the stream (consume, no
             XACK); the same latency test (XADD of the records due at each ~0.5 ms tick
             in one pipeline, XREADGROUP BLOCK 5 in a Ray actor).
             ray.util.queue.Queue: the driver puts lists of 1,000 values, a Ray task gets
             them; records/s from the first put to the last get.
5. ratios    logbus / Redis for produce, consume and latency p99; logbus / queue.
6. asyncio   (info) ``logbus.aio``: (a) ``await send_and_wait()`` one 100-byte record at a
             time against the sync ``send().result()``, interleaved in rounds of 200; the
             medians and their ratio. (b) An asyncio Consumer in an async Ray actor reads
             a 2-partition topic that an asyncio Producer in the driver fills at a paced
             20,000 records/s, while a coroutine in the actor's loop wakes every 10 ms on
             a fixed schedule: how late its wake-ups run (p50, p99, max), against an idle
             async actor's ticks meanwhile (the machine's own noise): the consumer's worker
             thread shares the GIL with the loop. (The tests check that neither client
             makes a blocking call on the loop; these are the figures.)

Every case runs once unmeasured as a warm-up (latency: the first configuration), then
is repeated (3 times in a full run, 2 in a quick one; latency 2 / 1 times) and the best
repetition is reported (for latency: the repetition with the lowest p99). This
machine is shared, so the load average at the start and end is printed too. The last
lines of the output are one JSON object per result.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray

# First: it puts this tree's logbus on sys.path.
from _common import (
    LATENCY_POLL_MS,
    QUEUE_BATCH,
    REDIS_PIPELINE,
    REDIS_READ_COUNT,
    TABLE_ROWS,
    VALUE_SIZE,
    LatencyConsumer,
    PacedProducer,
    RedisServer,
    RedisUnavailable,
    RunInfo,
    Sent,
    arg_parser,
    best_rate,
    consume_all,
    delete_topics,
    exit_on_sigterm,
    fmt,
    fmt_rate,
    high_watermarks,
    json_value,
    latency_percentiles_ms,
    log,
    make_pool,
    make_table,
    new_namespace,
    paced_send,
    print_table,
    produce_rounds,
    produce_send,
    produce_tables,
    queue_round,
    redis_consume,
    redis_produce,
    remove_dir,
    shutdown_ray,
    stamped_value,
    start_local_ray,
)

import logbus
import logbus.aio
import logbus.api.producer as producer_module
from logbus import Producer

POOL_SIZE = 10_000  # distinct values cycled through by the send() loops
LATENCY_RATE = 10_000  # records/s
LATENCY_WARMUP_RECORDS = 2_000  # sent and received untimed before each timed latency run

PRODUCE_TARGET = 1_500_000  # records/s
PRODUCE_RATIO_TARGET = 8.0  # x Redis XADD
CONSUME_TARGET = 5_000_000
CONSUME_RATIO_TARGET = 15.0  # x Redis XREADGROUP
P50_TARGET_MS = 3.0
P99_TARGET_MS = 15.0
KEYED_TARGET = 1_000_000  # records/s: send() with keys, futures kept, 4 partitions
KEYED_PARTITIONS = 4
KEY_COUNT = 1_000
ONE_PROCESS_P99_TARGET_MS = 5.0  # producer and consumer in one process (a Ray driver, a Serve replica)


@dataclass
class Mode:
    records: int  # per repetition of a throughput case
    reps: int
    latency_reps: int
    latency_s: float
    time_cap_s: float  # a produce repetition stops sending after this long (then flushes)
    warmup_records: int
    latency_grace_s: float  # how long after the paced sending ends records may still arrive


FULL = Mode(records=2_000_000, reps=3, latency_reps=2, latency_s=5.0, time_cap_s=6.0, warmup_records=200_000, latency_grace_s=5.0)
QUICK = Mode(records=200_000, reps=2, latency_reps=1, latency_s=2.0, time_cap_s=3.0, warmup_records=50_000, latency_grace_s=4.0)


@dataclass
class Result:
    case: str
    records_per_s: float | None
    mb_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    ratio_vs: str | None = None
    ratio: float | None = None
    target: str | None = None
    meets_target: bool | None = None
    reps: list = field(default_factory=list)  # records/s (or p99 ms) of every measured repetition
    note: str = ""
    extra: dict = field(default_factory=dict)


@ray.remote(num_cpus=0)
class ProducerWorker:
    """A Producer in its own process (for the two-producer case)."""

    def __init__(self, namespace: str, data_dir: str) -> None:
        self.bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        self.producer = Producer(self.bus, acks=1)
        self.pool = make_pool(POOL_SIZE, seed=os.getpid())

    def run(self, topic: str, partition: int, api: str, n: int, time_cap_s: float) -> Sent:
        if api == "send":
            return produce_send(self.producer, topic, self.pool, n, time_cap_s, partition=partition)
        return produce_tables(self.producer, topic, make_table(self.pool, partition), n, time_cap_s)

    def close(self) -> None:
        self.producer.close()


class _Kept:
    """The least a per-record future holds (its batch, index and timestamp): the floor of case 1d."""

    __slots__ = ("batch", "index", "timestamp_ms")

    def __init__(self, batch, index: int, timestamp_ms: int) -> None:
        self.batch = batch
        self.index = index
        self.timestamp_ms = timestamp_ms


def produce_keyed(producer, topic: str, pool: list[bytes], keys: list[bytes], n: int, time_cap_s: float,
                  callbacks: bool = False) -> Sent:
    """Case 1d: send(topic, value, key=key) per record, every future kept (or given a callback), until
    ``n`` records or ``time_cap_s``; then flush. Raises unless every record was acknowledged."""
    send = producer.send
    futures: list = []
    keep = futures.append
    acked = [0]

    def on_ack(metadata) -> None:
        acked[0] += 1

    def send_round() -> None:
        if callbacks:
            for key, value in zip(keys, pool):
                send(topic, value, key=key).add_callback(on_ack)
        else:
            for key, value in zip(keys, pool):
                keep(send(topic, value, key=key))

    sent = produce_rounds(producer, send_round, len(pool), n, time_cap_s)
    if callbacks:
        if acked[0] != sent.records:
            raise RuntimeError(f"{acked[0]} of {sent.records} records were acknowledged")
    elif len(futures) != sent.records or futures[-1].result(timeout=60).offset < 0 or not all(f.done() for f in futures):
        raise RuntimeError("not every record was acknowledged")
    return sent


def keep_objects(pool: list[bytes], keys: list[bytes], n: int) -> Sent:
    """The floor of case 1d: one small object made and kept per record, the loop of produce_keyed, nothing sent."""
    kept: list = []
    keep = kept.append
    batch = object()
    sent = 0
    start_wall = time.time()
    start = time.perf_counter()
    while sent < n:
        for key, value in zip(keys, pool):
            keep(_Kept(batch, sent, 0))
        sent += len(pool)
    seconds = time.perf_counter() - start
    return Sent(sent, start_wall, time.time(), seconds)


def keyed_cases(bus, create, check_landed, pool: list[bytes], mode) -> list[Result]:
    """Case 1d (see the module's docstring)."""
    keys = [b"user-%d" % (i % KEY_COUNT) for i in range(len(pool))]
    results: list[Result] = []
    fast_path = getattr(producer_module, "FAST_PATH", False)
    # (Named so that the Redis ratio and target of the 'logbus produce' rows are not applied to them.)
    cases = [("kept", "logbus send() with keys, futures kept, 1 producer, 4 partitions", True)]
    cases.append(("callbacks", "(info) keyed send(), add_callback() on every future instead of keeping it", True))
    if fast_path:
        cases.append(("kept", "(info) keyed send(), futures kept, send() in Python alone (FAST_PATH=False)", False))
    for kind, label, use_c in cases:
        topic = create(f"bench-keyed-{kind}{'' if use_c else '-python'}", KEYED_PARTITIONS)
        producer_module.FAST_PATH = use_c and fast_path
        try:
            producer = Producer(bus, acks=1)
        finally:
            producer_module.FAST_PATH = fast_path

        def produce(n: int) -> Sent:
            return produce_keyed(producer, topic, pool, keys, n, mode.time_cap_s, callbacks=kind == "callbacks")

        produce(mode.warmup_records)
        runs, extra = [], {}
        for rep in range(mode.reps):
            before = sum(high_watermarks(bus, topic))
            sent = produce(mode.records)
            check_landed(topic, before, sent.records, extra)
            runs.append((sent.records, sent.seconds))
            log(f"{label:<60} rep {rep + 1}: {sent.records:,} records in {sent.seconds:.2f}s = {sent.records / sent.seconds:,.0f}/s")
        producer.close()
        rate, reps = best_rate(runs)
        extra["c_path"] = use_c and fast_path
        results.append(Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps, extra=extra))
    floor_runs = []
    for _ in range(mode.reps):
        sent = keep_objects(pool, keys, mode.records)
        floor_runs.append((sent.records, sent.seconds))
    floor, floor_reps = best_rate(floor_runs)
    log(f"floor: one object of three slots made and kept per record: {floor:,.0f}/s")
    kept = results[0]
    kept.target, kept.meets_target = f">= {KEYED_TARGET / 1e6:g} M/s", kept.records_per_s >= KEYED_TARGET
    if fast_path:
        python = results[-1]
        kept.ratio_vs, kept.ratio = "send() in Python alone, same case (the C path's gain)", kept.records_per_s / python.records_per_s
    results.append(Result("(info) floor: an object of three slots made and kept per record, nothing sent", floor, reps=floor_reps,
                          ratio_vs="the futures-kept case / this floor",
                          ratio=kept.records_per_s / floor))
    return results


# --- the run -------------------------------------------------------------------------------------


def print_results(results: list[Result]) -> None:
    headers = ("case", "records/s", "MB/s", "p50 ms", "p99 ms", "ratio", "vs", "target", "met")
    print_table(headers, [
        (
            r.case, fmt_rate(r.records_per_s), fmt(r.mb_per_s, 0, inf="lost"), fmt(r.p50_ms, inf="lost"),
            fmt(r.p99_ms, inf="lost"), "" if r.ratio is None else f"{r.ratio:.2f}x", r.ratio_vs or "", r.target or "",
            "" if r.meets_target is None else ("yes" if r.meets_target else "NO"),
        )
        for r in results
    ])


FUTURE_COST_TARGET = 0.10  # of the per-record send() time


class _RecordView:
    """What send() must return at the least without the Future contract: its batch, index and timestamp."""

    __slots__ = ("_batch", "_index", "_timestamp_ms")

    def __init__(self, batch, index: int, timestamp_ms: int) -> None:
        self._batch = batch
        self._index = index
        self._timestamp_ms = timestamp_ms


def future_cost(send_rate: float, n: int = 1_000_000) -> Result:
    """What the Future contract adds to send(), as a share of send()'s time per record in the same run.

    send() returns a RecordFuture per record: a concurrent.futures.Future
    whose own state is made only when wait()/as_completed() ask for it. Its
    cost over the least send() must return anyway (an object holding the
    record's batch, index and timestamp, as the record views before the
    contract did) is timed over n records, the best of 3. A plain
    concurrent.futures.Future per record is timed beside it, as what the
    contract would cost done naively.
    """
    from concurrent.futures import Future  # noqa: PLC0415

    from logbus.api.producer import RecordFuture  # noqa: PLC0415

    def best_s(make) -> float:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for i in range(n):
                make(i, None, 0)
            best = min(best, time.perf_counter() - started)
        return best / n

    view_s = best_s(lambda i, batch, ts: _RecordView(batch, i, ts))
    record_future_s = best_s(lambda i, batch, ts: RecordFuture(batch, i, ts))
    plain_future_s = best_s(lambda i, batch, ts: Future())
    added_s = max(0.0, record_future_s - view_s)
    share = added_s * send_rate
    log(f"the Future contract: a RecordFuture takes {record_future_s * 1e6:.3f} us, the bare record view "
        f"{view_s * 1e6:.3f} us: {added_s * 1e6:.3f} us added = {share:.1%} of send() ({1e6 / send_rate:.3f} us); "
        f"a plain Future per record would add {max(0.0, plain_future_s - view_s) * 1e6:.3f} us")
    return Result(
        "the Future contract: what a RecordFuture adds to send()", None, ratio_vs="send() per record",
        ratio=share, target=f"<= {FUTURE_COST_TARGET:.0%} of send()", meets_target=share <= FUTURE_COST_TARGET,
        extra={"record_future_us": round(record_future_s * 1e6, 4), "record_view_us": round(view_s * 1e6, 4),
               "plain_future_us": round(plain_future_s * 1e6, 4), "send_us": round(1e6 / send_rate, 4)},
    )

# --- 6. the asyncio clients -----------------------------------------------------------------------

AIO_RATE = 20_000  # records/s the asyncio producer sends in the loop-lateness case
AIO_PARTITIONS = 2
TICK_S = 0.01
SEND_AND_WAIT_ROUND = 200


class Ticker:
    """A coroutine that wakes every TICK_S on a fixed schedule and records how late each wake-up ran.

    A fixed schedule counts a stall once per tick it covers (a 100 ms stall makes ten late ticks), so
    a loop that is held up shows in the high percentiles.
    """

    def __init__(self) -> None:
        self.lateness_s: list[float] = []
        self._task = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + TICK_S
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            self.lateness_s.append(loop.time() - due)
            due += TICK_S

    async def stop(self) -> list[float]:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.lateness_s


@ray.remote(num_cpus=0)
class AioTickingActor:
    """An async actor whose loop runs a Ticker; optionally an asyncio Consumer in the same loop."""

    def __init__(self) -> None:
        self.ticker = Ticker()
        self.consumer = None

    async def start_ticker(self) -> bool:
        self.ticker.start()
        return True

    async def open(self, bus, topic: str, partitions: int) -> int:
        """Start the consumer and make its first (empty) fetch; returns the ticks so far (one-time
        costs of a process's first consumer are paid here, apart from the steady state)."""
        self.consumer = logbus.aio.Consumer(bus)
        await self.consumer.start()
        await self.consumer.assign([logbus.TopicPartition(topic, p) for p in range(partitions)])
        await self.consumer.getmany(timeout_ms=200)
        return len(self.ticker.lateness_s)

    async def consume(self, expected: int, timeout_s: float) -> tuple[int, list[float]]:
        count = 0
        deadline = time.monotonic() + timeout_s
        while count < expected and time.monotonic() < deadline:
            batch = await self.consumer.getmany(timeout_ms=100, max_records=2000)
            count += sum(len(records) for records in batch.values())
        await self.consumer.stop()
        return count, await self.ticker.stop()

    async def stop_ticker(self) -> list[float]:
        return await self.ticker.stop()


def aio_send_and_wait(bus, topic: str, rounds: int) -> Result:
    """(a) await send_and_wait() against send().result(), one record at a time, interleaved rounds."""
    async def run() -> tuple[list[float], list[float]]:
        aio_s, sync_s = [], []
        sync = Producer(bus, linger_ms=0)
        sync.send(topic, b"warm-up").result(timeout=60)
        try:
            async with logbus.aio.Producer(bus, linger_ms=0) as producer:
                await producer.send_and_wait(topic, b"warm-up")
                value = b"x" * VALUE_SIZE
                for _ in range(rounds):
                    for _ in range(SEND_AND_WAIT_ROUND):
                        started = time.perf_counter()
                        await producer.send_and_wait(topic, value)
                        aio_s.append(time.perf_counter() - started)
                    for _ in range(SEND_AND_WAIT_ROUND):
                        started = time.perf_counter()
                        sync.send(topic, value).result(timeout=60)
                        sync_s.append(time.perf_counter() - started)
        finally:
            sync.close()
        return aio_s, sync_s

    aio_s, sync_s = asyncio.run(run())
    aio_ms, sync_ms = float(np.median(aio_s)) * 1e3, float(np.median(sync_s)) * 1e3
    log(f"asyncio send_and_wait(): median {aio_ms:.3f} ms against {sync_ms:.3f} ms for send().result(), "
        f"{aio_ms - sync_ms:+.3f} ms ({len(aio_s):,} records each)")
    return Result(
        "(info) asyncio send_and_wait(), one record at a time", 1e3 / aio_ms, p50_ms=aio_ms,
        p99_ms=float(np.percentile(aio_s, 99)) * 1e3, ratio_vs="sync send().result() median (lower is better)", ratio=aio_ms / sync_ms,
        extra={"key": "aio_send_and_wait", "sync_p50_ms": round(sync_ms, 4), "records": len(aio_s)},
    )


def aio_loop_lateness(bus, topic: str, seconds: float) -> Result:
    """(b) How late an async actor's loop runs its 10 ms ticks while its asyncio Consumer reads AIO_RATE records/s."""
    count = int(AIO_RATE * seconds)
    actor, idle = AioTickingActor.remote(), AioTickingActor.remote()
    try:
        ray.get([actor.start_ticker.remote(), idle.start_ticker.remote()], timeout=60)
        opened_at = ray.get(actor.open.remote(bus, topic, AIO_PARTITIONS), timeout=120)
        consumed = actor.consume.remote(count, seconds + 120)

        async def produce_steadily() -> float:
            loop = asyncio.get_running_loop()
            per_step = int(AIO_RATE * TICK_S)
            async with logbus.aio.Producer(bus, linger_ms=2) as producer:
                await producer.partitions_for(topic)
                start = loop.time()
                for step in range(count // per_step):
                    await asyncio.sleep(max(0.0, start + step * TICK_S - loop.time()))  # pacing
                    for i in range(step * per_step, (step + 1) * per_step):
                        await producer.send(topic, b"%d" % i, partition=i % AIO_PARTITIONS)
                sent_s = loop.time() - start
                await producer.flush(timeout_s=60)
            return sent_s

        sent_s = asyncio.run(produce_steadily())
        received, lateness = ray.get(consumed, timeout=seconds + 180)
        idle_lateness = ray.get(idle.stop_ticker.remote(), timeout=60)
    finally:
        ray.kill(actor)
        ray.kill(idle)
    steady_ms = np.asarray(lateness[opened_at:]) * 1e3
    idle_ms = np.asarray(idle_lateness) * 1e3
    p50, p99, worst = (float(np.percentile(steady_ms, 50)), float(np.percentile(steady_ms, 99)), float(steady_ms.max()))
    idle_p99 = float(np.percentile(idle_ms, 99))
    log(f"asyncio consumer in an async actor, {received:,}/{count:,} records at {count / sent_s:,.0f}/s: its loop's "
        f"{len(steady_ms):,} ticks late by p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.1f} ms; "
        f"an idle async actor's meanwhile: p99 {idle_p99:.2f} ms")
    return Result(
        f"(info) asyncio consumer's event loop, {TICK_S * 1e3:.0f} ms ticks late by, @ {AIO_RATE:,}/s", count / sent_s,
        p50_ms=p50, p99_ms=p99, ratio_vs="an idle async actor's p99 (lower is better)", ratio=p99 / idle_p99 if idle_p99 > 0 else None,
        extra={"key": "aio_loop_lateness", "max_ms": round(worst, 2), "idle_p99_ms": round(idle_p99, 3),
               "ticks": int(len(steady_ms)), "received": received, "sent": count},
    )


def one_process_latency(bus, topic: str, duration_s: float, grace_s: float) -> tuple[np.ndarray, int, float]:
    """A Producer (linger_ms=0) in this process's main thread sends stamped records at a paced
    LATENCY_RATE while a Consumer in a thread of the same process polls them record by record
    (``poll()``, as users write it) and takes poll-return time minus send time; the two clients share
    the process and its GIL. Returns (latencies in ns, records sent, seconds of sending)."""
    from logbus import Consumer, TopicPartition

    tp = TopicPartition(topic, 0)
    producer = Producer(bus, acks=1, linger_ms=0)
    consumer = Consumer(bus)
    try:
        consumer.assign([tp])
        consumer.seek(tp, high_watermarks(bus, topic)[0])
        # First-use costs out of the timing: producer id, metadata, first encode and decode.
        paced_send(lambda: producer.send(topic, stamped_value()), LATENCY_RATE, LATENCY_WARMUP_RECORDS / LATENCY_RATE)
        producer.flush(timeout_s=60)
        warm, deadline = 0, time.monotonic() + 60
        while warm < LATENCY_WARMUP_RECORDS and time.monotonic() < deadline:
            warm += sum(len(records) for records in consumer.poll(timeout_ms=100).values())
        expected = int(LATENCY_RATE * duration_s)
        out: list[np.ndarray] = []
        stop = threading.Event()

        def consume() -> None:
            got = 0
            while got < expected and not stop.is_set():
                polled = consumer.poll(timeout_ms=LATENCY_POLL_MS, max_records=500)
                now = time.time_ns()
                for records in polled.values():
                    out.append(now - np.fromiter((int.from_bytes(r.value[:8], "little", signed=True) for r in records), np.int64, len(records)))
                    got += len(records)

        reader = threading.Thread(target=consume, name="one-process-consumer", daemon=True)
        reader.start()
        sent, send_s = paced_send(lambda: producer.send(topic, stamped_value()), LATENCY_RATE, duration_s)
        producer.flush(timeout_s=grace_s)
        reader.join(grace_s)
        stop.set()
        reader.join(10)
        return (np.concatenate(out) if out else np.empty(0, np.int64)), sent, send_s
    finally:
        producer.close()
        consumer.close()


def producer_accepts(option: str) -> bool:
    return option in inspect.signature(Producer.__init__).parameters


def report(results: list[Result], run: RunInfo, mode: Mode) -> int:
    """Print the table and the JSON lines of ``results``."""
    wall = run.finish()
    print_results(results)
    log(f"done in {wall:.0f}s; every throughput figure is the best of {mode.reps} repetitions, every latency "
        f"figure the repetition with the lowest p99 of {mode.latency_reps}; 'lost' = not received within "
        f"{mode.latency_grace_s:g}s after the sending ended; load average {run.load_start[0]:.1f} at the start, "
        f"{run.load_end[0]:.1f} at the end (other processes share these {os.cpu_count()} CPUs)")
    for r in results:
        line = {
            "bench": "broker", "case": r.case, "records_per_s": json_value(r.records_per_s),
            "mb_per_s": json_value(r.mb_per_s, 1), "p50_ms": json_value(r.p50_ms), "p99_ms": json_value(r.p99_ms),
            "ratio_vs": r.ratio_vs, "ratio": json_value(r.ratio), "target": r.target, "meets_target": r.meets_target,
            "reps": [json_value(x) for x in r.reps], "quick": run.quick, "date": run.date,
            "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        }
        if r.note:
            line["note"] = r.note
        # Only the top-level figures of ``extra`` are rounded (per-repetition lists are printed as measured).
        line.update({k: (json_value(v) if isinstance(v, float) else v) for k, v in r.extra.items() if k != "topic"})
        print(json.dumps(line))
    return 0


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 90 s)")
    parser.add_argument("--records", type=int, default=None, help="records per repetition of a throughput case")
    parser.add_argument("--skip-redis", action="store_true", help="leave out the Redis Streams baseline")
    parser.add_argument("--only", choices=["keyed"], help="run one case alone: keyed = case 1d (with its baselines)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.records is not None:
        if args.records < POOL_SIZE:
            parser.error(f"--records must be at least {POOL_SIZE}")
        mode.records = args.records
        mode.warmup_records = max(POOL_SIZE, min(mode.warmup_records, args.records // 4))

    exit_on_sigterm()

    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-broker-")
    namespace = new_namespace("bench-broker")
    redis_server: RedisServer | None = None
    results: list[Result] = []
    topics: list[str] = []
    bus = None
    log(f"mode={'quick' if args.quick else 'full'} records/rep={mode.records:,} reps={mode.reps} "
        f"data_dir={data_dir} namespace={namespace} load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        start_local_ray(namespace, object_store_memory=2 << 30)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        pool = make_pool(POOL_SIZE)
        table = make_table(pool)

        def create(name: str, partitions: int) -> str:
            t0 = time.perf_counter()
            bus.admin.create_topic(name, partitions=partitions)
            topics.append(name)
            log(f"created topic {name} ({partitions} partitions) in {time.perf_counter() - t0:.1f}s")
            return name

        def check_landed(topic: str, before: int, count: int, result_extra: dict) -> None:
            landed = sum(high_watermarks(bus, topic)) - before
            if landed != count:
                log(f"WARNING: {count:,} records sent to {topic} but {landed:,} landed")
                result_extra.setdefault("landed_mismatch", []).append([count, landed])

        if args.only == "keyed":
            results.extend(keyed_cases(bus, create, check_landed, pool, mode))
            return report(results, run, mode)  # (then the clean-up in finally)

        # ---- 1a/1b. one producer in the driver, send() and send_table() ----------------------------
        single_cases = [
            ("send", "logbus produce, 1 producer, send()", {}),
            ("send_table", f"logbus produce, 1 producer, send_table({TABLE_ROWS:,} rows)", {}),
        ]
        if producer_accepts("enable_idempotence"):
            single_cases.append(
                ("send_table", f"(info) same, send_table, enable_idempotence=False", {"enable_idempotence": False})
            )
        for api, label, options in single_cases:
            topic = create(f"bench-{api.replace('_', '-')}{'-noidem' if options else ''}", 1)
            producer = Producer(bus, acks=1, **options)

            def produce(n: int) -> Sent:
                if api == "send":
                    return produce_send(producer, topic, pool, n, mode.time_cap_s)
                return produce_tables(producer, topic, table, n, mode.time_cap_s)

            produce(mode.warmup_records)
            runs, extra = [], {}
            for rep in range(mode.reps):
                before = sum(high_watermarks(bus, topic))
                sent = produce(mode.records)
                count, seconds = sent.records, sent.end - sent.start
                check_landed(topic, before, count, extra)
                runs.append((count, seconds))
                log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
            producer.close()
            rate, reps = best_rate(runs)
            extra["records_per_rep"] = [c for c, _ in runs]
            extra["topic"] = topic
            results.append(Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps, extra=extra))
        topic_table = next(r.extra["topic"] for r in results if "send_table" in r.case and not r.case.startswith("(info)"))
        send_row = next((r for r in results if r.case == "logbus produce, 1 producer, send()"), None)
        if send_row is not None:
            results.append(future_cost(send_row.records_per_s))

        # ---- 1d. send() with keys, futures kept, 4 partitions --------------------------------------
        results.extend(keyed_cases(bus, create, check_landed, pool, mode))

        # ---- 1c. two producers in two processes, 2 partitions --------------------------------------
        workers = [ProducerWorker.remote(namespace, data_dir) for _ in range(2)]
        for api, label in (("send_table", f"send_table({TABLE_ROWS:,} rows)"), ("send", "send()")):
            label = f"logbus produce, 2 producers, 2 partitions, {label}"
            topic = create(f"bench-two-{api.replace('_', '-')}", 2)
            ray.get([w.run.remote(topic, i, api, mode.warmup_records // 2, mode.time_cap_s) for i, w in enumerate(workers)])
            runs, extra = [], {}
            for rep in range(mode.reps):
                before = sum(high_watermarks(bus, topic))
                done = ray.get([w.run.remote(topic, i, api, mode.records // 2, mode.time_cap_s) for i, w in enumerate(workers)])
                count = sum(d.records for d in done)
                seconds = max(d.end for d in done) - min(d.start for d in done)
                check_landed(topic, before, count, extra)
                runs.append((count, seconds))
                log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
            rate, reps = best_rate(runs)
            extra["records_per_rep"] = [c for c, _ in runs]
            results.append(Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps, extra=extra))
        ray.get([w.close.remote() for w in workers])
        for w in workers:
            ray.kill(w)

        # ---- 2. consume ----------------------------------------------------------------------------
        label = "logbus consume, 1 consumer, poll_arrow()"
        consume_all(bus, topic_table, 1, 2.0)  # warm-up (partial read)
        runs = []
        for rep in range(mode.reps):
            count, seconds = consume_all(bus, topic_table, 1, 4 * mode.time_cap_s)
            runs.append((count, seconds))
            log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
        rate, reps = best_rate(runs)
        results.append(Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps, extra={"records_per_rep": [c for c, _ in runs]}))

        # ---- 3. latency ------------------------------------------------------------------------------
        # The throughput topics go first: their replicas' heartbeats, and the kernel writing back
        # the hundreds of MB they left dirty in the page cache, would otherwise compete with the
        # paced stream for the 2 cores (deleting a topic removes its actors and files).
        t0 = time.perf_counter()
        for name in list(topics):
            bus.admin.delete_topic(name)
            topics.remove(name)
        log(f"deleted the throughput topics in {time.perf_counter() - t0:.1f}s")
        latency_consumer = LatencyConsumer.remote(namespace=namespace, data_dir=data_dir)

        def logbus_latency(topic: str, duration_s: float, options: dict) -> tuple[np.ndarray, int, float, bool]:
            offset = high_watermarks(bus, topic)[0]
            consumer_options = {k: v for k, v in options.items() if k == "local_channel"}
            ray.get(latency_consumer.prepare_logbus.remote(topic, 0, offset, consumer_options))
            paced = PacedProducer.remote(namespace=namespace, data_dir=data_dir)
            try:
                # Both ends first move LATENCY_WARMUP_RECORDS untimed: a fresh producer process pays
                # once for its producer id, metadata and first Arrow encode, a consumer for its
                # first decode; those costs are not part of a steady stream's latency.
                warm = paced.warm_up_logbus.remote(topic, LATENCY_RATE, {"acks": 1, **options}, LATENCY_WARMUP_RECORDS)
                got = ray.get(latency_consumer.warm_up_logbus.remote(LATENCY_WARMUP_RECORDS, 60))
                ray.get(warm)
                if got != LATENCY_WARMUP_RECORDS:
                    raise RuntimeError(f"the latency consumer received {got} of {LATENCY_WARMUP_RECORDS} warm-up records")
                ref = latency_consumer.run_logbus.remote(int(LATENCY_RATE * duration_s), duration_s + mode.latency_grace_s)
                time.sleep(0.2)
                # The producer warmed up above sends the timed stream.
                sent, send_s, flushed = ray.get(paced.run_logbus.remote(topic, LATENCY_RATE, duration_s, mode.latency_grace_s))
                return ray.get(ref), sent, send_s, flushed
            finally:
                ray.kill(paced)  # with a backlog it would keep sending; killing it drops the backlog
        # (options, label, is the target case); the first case also serves as the warm-up
        latency_cases = [
            ({"linger_ms": 5}, f"(info) logbus latency @ {LATENCY_RATE:,}/s, linger_ms=5 (default)", False),
            ({"linger_ms": 0}, f"logbus latency @ {LATENCY_RATE:,}/s, linger_ms=0", True),
            ({"linger_ms": 0, "max_in_flight": 1},
             f"(info) logbus latency @ {LATENCY_RATE:,}/s, linger_ms=0, max_in_flight=1", False),
        ]
        if producer_accepts("local_channel"):
            latency_cases.append(
                ({"linger_ms": 0, "local_channel": False},
                 f"(info) logbus latency @ {LATENCY_RATE:,}/s, linger_ms=0, local_channel=False (actor calls)", False)
            )
        if producer_accepts("enable_idempotence"):
            latency_cases.append(
                ({"linger_ms": 5, "enable_idempotence": False},
                 f"(info) logbus latency @ {LATENCY_RATE:,}/s, linger_ms=5, enable_idempotence=False", False)
            )
        for index, (options, label, is_target) in enumerate(latency_cases):
            topic = create(f"bench-latency-{index}", 1)
            if index == 0:
                logbus_latency(topic, 1.0, options)  # warm-up
            lat_runs = []
            for rep in range(mode.latency_reps):
                latencies, sent, send_s, flushed = logbus_latency(topic, mode.latency_s, options)
                p50, p99, worst = latency_percentiles_ms(latencies, sent)
                lat_runs.append((p99, p50, worst, len(latencies), sent, send_s, flushed))
                log(f"{label:<60} rep {rep + 1}: {len(latencies):,}/{sent:,} records received "
                    f"(within {mode.latency_s + mode.latency_grace_s:.0f}s), sent in {send_s:.2f}s, flush {'ok' if flushed else 'TIMED OUT'}, "
                    f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.1f} ms")
            p99, p50, worst, received, sent, send_s, flushed = min(lat_runs)
            results.append(Result(
                label, sent / send_s, p50_ms=p50, p99_ms=p99,
                target=f"p50 <= {P50_TARGET_MS:g} ms, p99 <= {P99_TARGET_MS:g} ms" if is_target else None,
                meets_target=bool(p50 <= P50_TARGET_MS and p99 <= P99_TARGET_MS) if is_target else None,
                reps=[r[0] for r in lat_runs],
                extra={"received": received, "sent": sent, "max_ms": worst, "p50_per_rep": [r[1] for r in lat_runs],
                       "received_per_rep": [r[3] for r in lat_runs]},
            ))
        ray.kill(latency_consumer)
        two_process_p99 = next(r.p99_ms for r in results if r.case == f"logbus latency @ {LATENCY_RATE:,}/s, linger_ms=0")

        # ---- 3b. latency with producer and consumer in one process ---------------------------------------
        label = f"logbus latency @ {LATENCY_RATE:,}/s, producer and consumer in one process, poll()"
        topic = create("bench-latency-one-process", 1)
        lat_runs = []
        for rep in range(mode.latency_reps + 1):
            latencies, sent, send_s = one_process_latency(bus, topic, mode.latency_s, mode.latency_grace_s)
            p50, p99, worst = latency_percentiles_ms(latencies, sent)
            lat_runs.append((p99, p50, worst, len(latencies), sent, send_s))
            log(f"{label:<60} rep {rep + 1}: {len(latencies):,}/{sent:,} records received, sent in {send_s:.2f}s, "
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.1f} ms")
        p99, p50, worst, received, sent, send_s = min(lat_runs)
        results.append(Result(
            label, sent / send_s, p50_ms=p50, p99_ms=p99, ratio_vs="two processes' p99 (linger_ms=0)",
            ratio=p99 / two_process_p99 if two_process_p99 else None,
            target=f"p99 <= {ONE_PROCESS_P99_TARGET_MS:g} ms", meets_target=bool(p99 <= ONE_PROCESS_P99_TARGET_MS),
            reps=[r[0] for r in lat_runs],
            extra={"received": received, "sent": sent, "max_ms": worst, "p50_per_rep": [r[1] for r in lat_runs],
                   "max_per_rep": [r[2] for r in lat_runs]},
        ))

        # ---- 6. the asyncio clients (before the baselines: the same bus) ----------------------------------
        results.append(aio_send_and_wait(bus, create("bench-aio-send-and-wait", 1), rounds=2 * mode.reps))
        results.append(aio_loop_lateness(bus, create("bench-aio-lateness", AIO_PARTITIONS), 2 * mode.latency_s))

        # ---- 4a. Redis Streams -------------------------------------------------------------------------
        redis_results: dict[str, Result] = {}
        if args.skip_redis:
            log("Redis baseline skipped (--skip-redis)")
        else:
            try:
                redis_server = RedisServer()
            except RedisUnavailable as error:
                log(f"Redis baseline skipped: {error}")
        if redis_server is not None:
            client = redis_server.client
            log(f"redis-server {redis_server.version} on 127.0.0.1:{redis_server.port} (appendonly yes, appendfsync everysec, save '')")
            label = f"Redis XADD, pipelined {REDIS_PIPELINE:,}"
            redis_produce(client, "warmup", pool, mode.warmup_records, mode.time_cap_s)
            client.delete("warmup")
            runs = []
            for rep in range(mode.reps):
                client.delete(f"bench-{rep - 1}")  # keep only the latest stream, for the consume case
                count, seconds = redis_produce(client, f"bench-{rep}", pool, mode.records, mode.time_cap_s)
                if client.xlen(f"bench-{rep}") != count:
                    raise RuntimeError("Redis lost records")
                runs.append((count, seconds))
                log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
            rate, reps = best_rate(runs)
            redis_results["produce"] = Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps)

            label = f"Redis XREADGROUP COUNT {REDIS_READ_COUNT:,}"
            stream = f"bench-{mode.reps - 1}"
            redis_consume(client, stream, "warmup", 2.0)
            runs = []
            for rep in range(mode.reps):
                count, seconds = redis_consume(client, stream, f"group-{rep}", 2 * mode.time_cap_s)
                runs.append((count, seconds))
                log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
            rate, reps = best_rate(runs)
            redis_results["consume"] = Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps)
            client.delete(stream)

            label = f"Redis latency @ {LATENCY_RATE:,}/s, XADD per record"
            redis_consumer = LatencyConsumer.remote(redis_port=redis_server.port)
            redis_producer = PacedProducer.remote(redis_port=redis_server.port)

            def redis_latency(duration_s: float, run: int) -> tuple[np.ndarray, int, float]:
                stream_name = f"latency-{run}"
                ray.get(redis_consumer.prepare_redis.remote(stream_name, "g"))
                ref = redis_consumer.run_redis.remote(stream_name, "g", int(LATENCY_RATE * duration_s), duration_s + mode.latency_grace_s)
                time.sleep(0.2)
                sent, send_s, _ = ray.get(redis_producer.run_redis.remote(stream_name, LATENCY_RATE, duration_s))
                latencies = ray.get(ref)
                client.delete(stream_name)
                return latencies, sent, send_s

            redis_latency(1.0, -1)  # warm-up
            lat_runs = []
            for rep in range(mode.latency_reps):
                latencies, sent, send_s = redis_latency(mode.latency_s, rep)
                p50, p99, worst = latency_percentiles_ms(latencies, sent)
                lat_runs.append((p99, p50, worst, len(latencies), sent, send_s))
                log(f"{label:<60} rep {rep + 1}: {len(latencies):,}/{sent:,} records received, sent in {send_s:.2f}s, "
                    f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.1f} ms")
            p99, p50, worst, received, sent, send_s = min(lat_runs)
            redis_results["latency"] = Result(label, sent / send_s, p50_ms=p50, p99_ms=p99, reps=[r[0] for r in lat_runs],
                                              extra={"received": received, "sent": sent, "max_ms": worst})
            ray.kill(redis_consumer)
            ray.kill(redis_producer)
            redis_server.stop()
            redis_server = None

        # ---- 4b. ray.util.queue -------------------------------------------------------------------------
        from ray.util.queue import Queue

        label = f"ray.util.queue.Queue, put/get lists of {QUEUE_BATCH:,}"
        queue = Queue(maxsize=64, actor_options={"num_cpus": 0})
        batch = pool[:QUEUE_BATCH]
        count, seconds = queue_round(queue, batch, max(1, mode.warmup_records // QUEUE_BATCH))  # warm-up
        # As many batches as the warm-up rate allows within the time cap (a get cannot be interrupted).
        batches = max(10, min(mode.records, int(count / seconds * mode.time_cap_s)) // QUEUE_BATCH)
        runs = []
        for rep in range(mode.reps):
            count, seconds = queue_round(queue, batch, batches)
            runs.append((count, seconds))
            log(f"{label:<60} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s")
        rate, reps = best_rate(runs)
        queue_result = Result(label, rate, rate * VALUE_SIZE / 1e6, reps=reps)
        queue.shutdown()

        # ---- 5. ratios and targets ------------------------------------------------------------------------
        produce_target = f">= {PRODUCE_TARGET / 1e6:g} M/s and >= {PRODUCE_RATIO_TARGET:g}x Redis"
        consume_target = f">= {CONSUME_TARGET / 1e6:g} M/s and >= {CONSUME_RATIO_TARGET:g}x Redis"
        for r in results:
            if r.case.startswith("logbus produce") or r.case.startswith("(info) same"):
                if "produce" in redis_results:
                    r.ratio_vs, r.ratio = "Redis XADD", r.records_per_s / redis_results["produce"].records_per_s
                if r.case.startswith("(info)"):
                    continue
                r.target = produce_target
                r.meets_target = r.records_per_s >= PRODUCE_TARGET and (r.ratio is None or r.ratio >= PRODUCE_RATIO_TARGET)
                if r.ratio is None:
                    r.note = "ratio part of the target not checked (no Redis)"
            elif r.case.startswith("logbus consume"):
                r.target = consume_target
                if "consume" in redis_results:
                    r.ratio_vs, r.ratio = "Redis XREADGROUP", r.records_per_s / redis_results["consume"].records_per_s
                r.meets_target = r.records_per_s >= CONSUME_TARGET and (r.ratio is None or r.ratio >= CONSUME_RATIO_TARGET)
                if r.ratio is None:
                    r.note = "ratio part of the target not checked (no Redis)"
            elif "latency" in r.case and "latency" in redis_results and r.p99_ms != float("inf"):
                r.ratio_vs = "Redis p99 (lower is better)"
                r.ratio = r.p99_ms / redis_results["latency"].p99_ms
        extra_rows = []
        main_rows = [r for r in results if r.case.startswith("logbus produce") or r.case.startswith("logbus consume")]
        for r in main_rows:
            extra_rows.append(Result(f"{r.case}: vs queue", r.records_per_s, ratio_vs="ray.util.queue",
                                     ratio=r.records_per_s / queue_result.records_per_s))
        results = results + list(redis_results.values()) + [queue_result] + extra_rows
    finally:
        if redis_server is not None:
            redis_server.stop()
        delete_topics(bus, topics)
        shutdown_ray()
        remove_dir(data_dir)

    return report(results, run, mode)

if __name__ == "__main__":
    sys.exit(main())
