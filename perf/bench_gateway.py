#!/usr/bin/env python
"""Kafka gateway benchmark: confluent-kafka through the gateway against logbus's native clients, in one run.

Run with ``./dev bench gateway`` (= ``.venv/bin/python perf/bench_gateway.py``).
``--quick`` makes a short smoke run; ``--records N`` sets the records per
repetition.

One private local Ray, a fresh temp ``data_dir``, a unique namespace, and one
gateway (``bus.start_gateway(port=0)``: loopback, a free port) on this node.
Every value is 100 bytes (random, incompressible); keys and headers are null;
every topic has one partition; acks=1 everywhere. Cases:

1. produce  (native) one ``logbus.Producer`` sends the same pre-built 10,000-row
            table with ``send_table()`` until N records, then ``flush()``;
            (kafka)  one ``confluent_kafka.Producer`` through the gateway,
            ``produce_batch()`` of 10,000 records, the client's fastest call, with
            a delivery callback per record (``linger.ms`` 5, ``batch.size`` 1 MiB,
            no compression, not idempotent), then ``flush()``.
2. consume  both read the native case's topic from offset 0 to its end:
            (native) ``Consumer.poll_arrow()`` on the assigned partition;
            (kafka)  a ``confluent_kafka.Consumer`` with the partition assigned at
            offset 0 (no group), ``consume(10000, 1.0)`` until N messages, with
            ``fetch.queue.backoff.ms`` 10 and ``queued.min.messages`` 1,000,000
            (librdkafka's defaults, 1000 ms and 100,000, make its fetcher pause a
            second each time 100,000 records wait in its queue, which caps a fast
            consumer near 270 k records/s whatever the broker); and, as information,
            the same with librdkafka's defaults.
3. wire     (info) the gateway's own capacity, with a bare protocol client
            (``perf/_kafka_wire.py``) whose cost per record is near zero:
            Produce v9 requests each holding one pre-built 10,000-record Kafka
            batch, five in flight, until N records; and Fetch v12 requests of up
            to 4 MiB from offset 0 of the native topic until N records, counted
            from the batches' headers (nothing decoded per record). What a Kafka
            client library reaches is below this; the gap is the library's.
4. client   (info) confluent-kafka's own cost per record: the produce case's
            ``produce_batch()`` calls, same records and callback, into a
            producer whose bootstrap address is a loopback port nobody listens
            on, so nothing is sent and no delivery is reported; records/s until
            N records are queued (then purged). No gateway can make the kafka
            produce case faster than this.

For the kafka cases the table also gives the client's CPU: the CPU time of
this process (its Python thread and the client library's own threads) over
the case's wall time, in cores. The gateway and the replica run in other
processes; a client near a whole core sets the pace itself.

Each case runs once unmeasured as a warm-up, then ``reps`` times (3; quick 1);
the best repetition is reported. Target: each Kafka figure >= 50% of its native
counterpart. The machine is shared: the load average at the start and end is
printed too. The last lines of the output are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

# First: it puts this tree's logbus on sys.path.
from _common import (
    TABLE_ROWS,
    VALUE_SIZE,
    RunInfo,
    arg_parser,
    consume_all,
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
    produce_tables,
    remove_dir,
    shutdown_ray,
    start_local_ray,
)

import _kafka_wire as wire  # noqa: I001  (after _common: it imports logbus)
import logbus
from logbus import Producer

RATIO_TARGET = 0.5  # Kafka client through the gateway / native logbus client
TIME_CAP_S = 90.0  # per repetition


@dataclass
class Mode:
    records: int
    reps: int


FULL = Mode(records=1_000_000, reps=3)
QUICK = Mode(records=200_000, reps=1)


@dataclass
class Result:
    case: str
    records_per_s: float
    reps: list[float]
    ratio: float | None = None
    target: str | None = None
    meets_target: bool | None = None
    client_cores: float | None = None  # the kafka cases: CPU this process (the client) used in the best repetition


@dataclass
class Rate:
    records_per_s: float
    client_cores: float  # CPU time of this process (all its threads, the client library's included) over the wall time


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def native_produce(bus, topic: str, table, n: int) -> float:
    with Producer(bus, acks=1) as producer:
        sent = produce_tables(producer, topic, table, n, TIME_CAP_S)
    return sent.records / sent.seconds


def kafka_produce(bootstrap: str, topic: str, pool: list[bytes], n: int, client: dict | None = None) -> Rate:
    """``client``: more librdkafka settings (security, for perf/bench_gateway_security.py)."""
    import confluent_kafka as ck

    producer = ck.Producer({
        **(client or {}), "bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5, "batch.size": 1 << 20, "enable.idempotence": False,
        "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 1 << 20,
    })
    failures = []

    def delivered(error, _message) -> None:
        if error is not None:
            failures.append(error)

    # Ready before the clock starts: metadata and the connection to the leader's gateway.
    producer.list_topics(topic, timeout=30)
    sent = 0
    cpu = _process_cpu_s()
    start = time.perf_counter()
    deadline = start + TIME_CAP_S
    while sent < n and time.perf_counter() < deadline:
        pending = [{"value": value} for value in pool]
        while pending:
            queued = producer.produce_batch(topic, pending, on_delivery=delivered)
            # A message the client could not queue (its queue full) comes back marked with "_error"; send it again.
            refused = [{"value": m["value"]} for m in pending if "_error" in m]
            if queued + len(refused) != len(pending):
                raise RuntimeError(f"kafka produce: {len(pending)} messages, {queued} queued, {len(refused)} refused")
            pending = refused
            if pending:
                producer.poll(0.01)
        sent += len(pool)
        producer.poll(0)
    remaining = producer.flush(120)
    seconds = time.perf_counter() - start
    cpu = _process_cpu_s() - cpu
    if remaining or failures:
        raise RuntimeError(f"kafka produce: {remaining} records without an outcome, {len(failures)} failed, e.g. {failures[:1]}")
    return Rate(sent / seconds, cpu / seconds)


def kafka_produce_client_only(pool: list[bytes], n: int) -> float:
    """Records/s confluent-kafka's ``produce_batch()`` queues with no broker to send to: the client's own cost per record."""
    import confluent_kafka as ck

    with socket.socket() as probe:  # a loopback port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    producer = ck.Producer({
        "bootstrap.servers": f"127.0.0.1:{port}", "acks": 1, "linger.ms": 5, "batch.size": 1 << 20, "enable.idempotence": False,
        "queue.buffering.max.messages": n + len(pool), "queue.buffering.max.kbytes": 2_000_000, "message.timeout.ms": 600_000,
        "log_level": 0,  # its connection attempts fail, as meant; not worth a log line each
    })

    def delivered(_error, _message) -> None:  # one as the produce case passes; never called here (nothing polls)
        pass

    queued = 0
    start = time.perf_counter()
    deadline = start + TIME_CAP_S
    while queued < n and time.perf_counter() < deadline:
        batch = [{"value": value} for value in pool]
        taken = producer.produce_batch("client-only", batch, on_delivery=delivered)
        if taken != len(batch):
            raise RuntimeError(f"client-only produce: {taken} of {len(batch)} queued; its queue should hold all {n}")
        queued += taken
    seconds = time.perf_counter() - start
    producer.purge(in_queue=True, in_flight=True)  # nothing was sent: the queued records go, unreported
    return queued / seconds


def native_consume(bus, topic: str, n: int) -> float:
    total, seconds = consume_all(bus, topic, 1, TIME_CAP_S)
    if total < n:
        raise RuntimeError(f"native consume read {total} of {n} records")
    return total / seconds


KAFKA_CONSUMER_TUNING = {"fetch.queue.backoff.ms": 10, "queued.min.messages": 1_000_000}


def kafka_consume(bootstrap: str, topic: str, n: int, tuning: dict | None = None, client: dict | None = None) -> Rate:
    import confluent_kafka as ck

    consumer = ck.Consumer({**(client or {}), "bootstrap.servers": bootstrap, "group.id": f"bench-{time.monotonic_ns()}", "enable.auto.commit": False,
                            "auto.offset.reset": "earliest", **(tuning or {})})
    try:
        consumer.list_topics(topic, timeout=30)
        consumer.assign([ck.TopicPartition(topic, 0, 0)])
        total = 0
        cpu = _process_cpu_s()
        start = time.perf_counter()
        deadline = start + TIME_CAP_S
        while total < n and time.perf_counter() < deadline:
            messages = consumer.consume(10_000, 1.0)
            for message in messages:
                if message.error() is not None:
                    raise RuntimeError(f"kafka consume: {message.error()}")
            total += len(messages)
        seconds = time.perf_counter() - start
        cpu = _process_cpu_s() - cpu
    finally:
        consumer.close()
    if total < n:
        raise RuntimeError(f"kafka consume read {total} of {n} records")
    return Rate(total / seconds, cpu / seconds)


DEFAULTS_CASE = "kafka consume, librdkafka's default queue settings (info)"
WIRE_PRODUCE = "wire produce, bare protocol client (info)"
WIRE_CONSUME = "wire consume, bare protocol client (info)"
CLIENT_ONLY = "kafka produce, the client alone: queued, no broker (info)"


def wire_batch(pool: list[bytes]) -> bytes:
    """One uncompressed Kafka batch of the pool's values (null keys), built as a client builds it."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1, producer_epoch=-1,
                                        base_sequence=-1, batch_size=1 << 30)
    now_ms = int(time.time() * 1000)
    for offset, value in enumerate(pool):
        builder.append(offset, timestamp=now_ms, key=None, value=value, headers=[])
    return bytes(builder.build())


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--records", type=int, default=None, help=f"records per repetition (default: {FULL.records:,}; --quick {QUICK.records:,})")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.records is not None:
        if args.records < TABLE_ROWS:
            parser.error(f"--records must be at least {TABLE_ROWS}")
        mode.records = args.records
    n = mode.records

    exit_on_sigterm()
    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-gateway-")
    namespace = new_namespace("bench-gateway")
    log(f"mode={'quick' if args.quick else 'full'} records={n:,} reps={mode.reps} data_dir={data_dir} "
        f"load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")
    pool = make_pool(TABLE_ROWS)
    table = make_table(pool)
    bus = None
    gateway = None
    topics: list[str] = []
    samples: dict[str, list[float]] = {
        "native produce": [], "kafka produce": [], "native consume": [], "kafka consume": [], DEFAULTS_CASE: [],
        WIRE_PRODUCE: [], WIRE_CONSUME: [], CLIENT_ONLY: [],
    }
    cores: dict[str, list[float]] = {case: [] for case in ("kafka produce", "kafka consume", DEFAULTS_CASE)}
    batch = wire_batch(pool)
    try:
        start_local_ray(namespace)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        gateway = bus.start_gateway(port=0)
        log(f"gateway at {gateway.bootstrap_servers}")
        for rep in range(mode.reps + 1):  # the first is the warm-up
            native_topic, kafka_topic, wire_topic = f"native-{rep}", f"kafka-{rep}", f"wire-{rep}"
            for topic in (native_topic, kafka_topic, wire_topic):
                bus.admin.create_topic(topic, partitions=1)
                topics.append(topic)
            figures = {
                "native produce": native_produce(bus, native_topic, table, n),
                "kafka produce": kafka_produce(gateway.bootstrap_servers, kafka_topic, pool, n),
                "native consume": native_consume(bus, native_topic, n),
                "kafka consume": kafka_consume(gateway.bootstrap_servers, native_topic, n, KAFKA_CONSUMER_TUNING),
                DEFAULTS_CASE: kafka_consume(gateway.bootstrap_servers, native_topic, n),
                WIRE_PRODUCE: wire.produce(gateway.bootstrap_servers, wire_topic, batch, len(pool), n, TIME_CAP_S),
                WIRE_CONSUME: wire.consume(gateway.bootstrap_servers, native_topic, n, TIME_CAP_S),
                CLIENT_ONLY: kafka_produce_client_only(pool, n),
            }
            rates = {case: value for case, value in figures.items() if isinstance(value, Rate)}
            figures.update((case, rate.records_per_s) for case, rate in rates.items())
            log(("warm-up: " if rep == 0 else f"rep {rep}: ") + ", ".join(f"{k} {fmt_rate(v)}/s" for k, v in figures.items())
                + "; client CPU " + ", ".join(f"{k} {rate.client_cores:.2f} cores" for k, rate in rates.items()))
            if rep > 0:
                for case, value in figures.items():
                    samples[case].append(value)
                for case, rate in rates.items():
                    cores[case].append(rate.client_cores)
            delete_topics(bus, topics)  # their replicas and files: the next repetition starts as this one did
            topics.clear()
    finally:
        if gateway is not None:
            gateway.stop()
        if bus is not None:
            delete_topics(bus, topics)
        shutdown_ray()
        remove_dir(data_dir)

    results = [Result(case, max(values), values) for case, values in samples.items()]
    for r in results:
        if r.case in cores:
            r.client_cores = cores[r.case][r.reps.index(r.records_per_s)]
    by_case = {r.case: r for r in results}
    for kind in ("produce", "consume"):
        kafka, native = by_case[f"kafka {kind}"], by_case[f"native {kind}"]
        kafka.ratio = kafka.records_per_s / native.records_per_s
        kafka.target = f">= {RATIO_TARGET:.0%} of native {kind}"
        kafka.meets_target = kafka.ratio >= RATIO_TARGET
    for case, native in ((DEFAULTS_CASE, "native consume"), (WIRE_PRODUCE, "native produce"), (WIRE_CONSUME, "native consume"),
                         (CLIENT_ONLY, "native produce")):
        by_case[case].ratio = by_case[case].records_per_s / by_case[native].records_per_s
    wall = run.finish()
    print_table(
        ("case", "records/s", "MB/s", "vs native", "target", "meets", "client CPU"),
        [(r.case, fmt_rate(r.records_per_s), fmt(r.records_per_s * VALUE_SIZE / 1e6, 1), fmt(r.ratio), r.target or "",
          "" if r.meets_target is None else ("yes" if r.meets_target else "NO"),
          "" if r.client_cores is None else f"{r.client_cores:.2f} cores") for r in results],
    )
    log(f"done in {wall:.0f}s; best of {mode.reps}; load average {run.load_start[0]:.1f} at the start, "
        f"{run.load_end[0]:.1f} at the end (other processes share these {os.cpu_count()} CPUs)")
    for r in results:
        print(json.dumps({
            "bench": "gateway", "case": r.case, "records_per_s": json_value(r.records_per_s),
            "mb_per_s": json_value(r.records_per_s * VALUE_SIZE / 1e6, 1), "ratio_vs": "native" if r.ratio is not None else None,
            "ratio": json_value(r.ratio), "target": r.target, "meets_target": r.meets_target, "reps": [json_value(x) for x in r.reps],
            "client_cpu_cores": json_value(r.client_cores), "records": n, "quick": run.quick, "date": run.date, "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
