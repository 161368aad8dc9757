#!/usr/bin/env python
"""Scale benchmark: what idle partition replicas cost, how fast topics start, and a node holding 128 replicas.

Run with ``./dev bench scale`` (= ``.venv/bin/python perf/bench_scale.py``); ``--quick``
makes a short smoke run. One private local Ray on this machine (one node), a fresh temp
``data_dir`` and a unique namespace; every topic has replication factor 1, so every
replica of every topic lives on the one node.

The same-run baseline is the plain Ray actor: an async actor with ``num_cpus=0`` that
imports nothing and does nothing (``Plain`` below). Cases:

1. idle     for N = 16 and 64: a topic of N partitions, nothing produced; after a settling
            pause, the CPU time used over a window by the N replica processes plus what
            logbus runs beside them (the node agent and the controller), per replica; and
            the mean USS (unique memory) of a replica process. Then N plain actors, the
            same figures. Ratios: replica / plain actor (targets: CPU <= 1.5x, USS <= 1.2x).
2. create   the time ``create_topic`` takes for 16, 64 and 128 partitions (it returns once
            every replica serves) against the time Ray takes to start that many plain
            actors and hear from each (target for 64: <= 1.3x).
3. busy     with 128 replicas on the node: one record sent to every partition of a
            128-partition topic and read back from every partition (seconds), and the
            end-to-end latency (p50 / p99) of a 1-partition topic at 1,000 records/s, against
            the same latency with 8 replicas on the node (target: p50 <= 1.5x). Between the
            two, a control: the latency with 8 replicas and 128 plain idle actors on the
            node, which tells Ray's share of the difference (its idle worker processes)
            from logbus's (info).

CPU time is read from /proc through psutil (user + system of each process); Ray's own
daemons (raylet, GCS) are shared by both sides and not counted. The machine is shared:
the load average at the start and end is printed, and the figures are ratios of
measurements taken in the same run. The last lines are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import psutil
import ray

from _common import (  # noqa: I001  (importing _common first puts this tree's logbus on sys.path)
    LatencyConsumer,
    PacedProducer,
    RunInfo,
    arg_parser,
    delete_topics,
    exit_on_sigterm,
    json_value,
    latency_percentiles_ms,
    log,
    new_namespace,
    print_table,
    remove_dir,
    shutdown_ray,
    start_local_ray,
)

import logbus
from logbus import TopicPartition
from logbus.actors.controller import CONTROLLER_NAME
from logbus.actors.node_agent import agent_actor_name

FULL = dict(idle_sizes=(16, 64), create_sizes=(16, 64, 128), busy_size=128, settle_s=5.0, window_s=20.0, latency_s=20.0)
QUICK = dict(idle_sizes=(16,), create_sizes=(16, 32), busy_size=32, settle_s=3.0, window_s=5.0, latency_s=5.0)
LATENCY_RATE = 1_000
LATENCY_GRACE_S = 10.0


@ray.remote(num_cpus=0)
class Plain:
    """The baseline: an idle async actor that imports nothing."""

    async def pid(self) -> int:
        return os.getpid()


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def mean_uss_mib(pids: list[int]) -> float:
    values = []
    for pid in pids:
        try:
            values.append(psutil.Process(pid).memory_full_info().uss / 2**20)
        except psutil.NoSuchProcess:
            pass
    return float(np.mean(values)) if values else float("nan")


def idle_cpu_per_process(pids: list[int], extra_pids: list[int], count: int, window_s: float) -> float:
    """CPU cores used per process (fraction of one core) over ``window_s``, ``extra_pids`` charged to the whole."""
    everyone = pids + extra_pids
    before = cpu_seconds(everyone)
    time.sleep(window_s)  # a measurement window
    return (cpu_seconds(everyone) - before) / window_s / count


def replica_pids(bus, topic: str) -> list[int]:
    statuses = ray.get(bus.controller.replica_statuses.remote(topic), timeout=300)
    return [s["pid"] for replicas in statuses for s in replicas if "pid" in s]


def logbus_side_pids(bus) -> list[int]:
    """The processes logbus runs beside its replicas: the controller and the node's agent."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    agent = ray.get_actor(agent_actor_name(ray.get_runtime_context().get_node_id()), namespace=bus.namespace)
    return [ray.get(controller.ping.remote(), timeout=60), ray.get(agent.ping.remote(), timeout=60)]


def start_plain(count: int) -> tuple[list, list[int], float]:
    started = time.perf_counter()
    actors = [Plain.remote() for _ in range(count)]
    pids = ray.get([a.pid.remote() for a in actors], timeout=900)
    return actors, pids, time.perf_counter() - started


def stop_plain(actors) -> None:
    for actor in actors:
        ray.kill(actor)


def one_record_each(bus, topic: str, partitions: int) -> float:
    """Seconds to send one record to every partition (acks=all) and read every one back."""
    started = time.perf_counter()
    with logbus.Producer(bus, acks="all", linger_ms=0) as producer:
        futures = [producer.send(topic, b"p%d" % p, partition=p) for p in range(partitions)]
        for future in futures:
            future.result(timeout=120)
    consumer = logbus.Consumer(bus, fetch_max_wait_ms=100)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    seen, deadline = set(), time.monotonic() + 120
    while len(seen) < partitions and time.monotonic() < deadline:
        table = consumer.poll_arrow(timeout_ms=200)
        seen.update(table["partition"].to_pylist())
    consumer.close()
    if len(seen) < partitions:
        raise RuntimeError(f"only {len(seen)} of {partitions} partitions answered")
    return time.perf_counter() - started


def latency(bus, data_dir: str, topic: str, duration_s: float) -> tuple[float, float]:
    producer = PacedProducer.remote(bus.namespace, data_dir)
    consumer = LatencyConsumer.remote(bus.namespace, data_dir)
    try:
        ray.get(consumer.prepare_logbus.remote(topic, 0, 0), timeout=120)
        warm = 500
        ray.get(producer.warm_up_logbus.remote(topic, LATENCY_RATE, {"linger_ms": 0}, warm), timeout=120)
        ray.get(consumer.warm_up_logbus.remote(warm, 60), timeout=120)
        expected = int(LATENCY_RATE * duration_s)
        received = consumer.run_logbus.remote(expected, duration_s + LATENCY_GRACE_S)
        ray.get(producer.run_logbus.remote(topic, LATENCY_RATE, duration_s, 60), timeout=duration_s + 120)
        latencies = ray.get(received, timeout=duration_s + 120)
        p50, p99, _ = latency_percentiles_ms(latencies, expected)
        return p50, p99
    finally:
        ray.kill(producer)
        ray.kill(consumer)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    exit_on_sigterm()
    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-scale-")
    namespace = new_namespace("bench-scale")
    bus, topics, rows, lines = None, [], [], []
    log(f"mode={'quick' if args.quick else 'full'} data_dir={data_dir} namespace={namespace} "
        f"load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")

    def emit(case: str, value, baseline, unit: str, target: float | None = None, **extra) -> None:
        ratio = None if baseline in (None, 0) else value / baseline
        meets = None if target is None or ratio is None else ratio <= target
        rows.append((case, f"{value:.4g} {unit}", "-" if baseline is None else f"{baseline:.4g} {unit}",
                     "-" if ratio is None else f"{ratio:.2f}x", "-" if target is None else f"<= {target}x", meets))
        lines.append({"bench": "scale", "case": case, "value": json_value(value, 4), "baseline": json_value(baseline, 4),
                      "unit": unit, "ratio": json_value(ratio), "target": target, "meets_target": meets, **extra})

    try:
        start_local_ray(namespace, object_store_memory=1 << 30)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        bus.admin.create_topic("warm-up", partitions=1)  # the agent and the first worker start outside the timings
        topics.append("warm-up")
        side = logbus_side_pids(bus)

        # 1. idle cost per replica against plain actors
        for n in mode["idle_sizes"]:
            name = f"idle-{n}"
            bus.admin.create_topic(name, partitions=n)
            topics.append(name)
            pids = replica_pids(bus, name)
            time.sleep(mode["settle_s"])  # let start-up work end before the window
            cpu = idle_cpu_per_process(pids, side, n, mode["window_s"])
            uss = mean_uss_mib(pids)
            bus.admin.delete_topic(name)
            topics.remove(name)
            actors, plain_pids, _ = start_plain(n)
            time.sleep(mode["settle_s"])
            plain_cpu = idle_cpu_per_process(plain_pids, [], n, mode["window_s"])
            plain_uss = mean_uss_mib(plain_pids)
            stop_plain(actors)
            log(f"idle {n}: replica {cpu * 100:.3f}% of a core, {uss:.1f} MiB USS; plain {plain_cpu * 100:.3f}%, {plain_uss:.1f} MiB")
            emit(f"idle cpu per replica, {n} replicas", cpu * 100, plain_cpu * 100, "% of a core", 1.5, replicas=n)
            emit(f"uss per replica, {n} replicas", uss, plain_uss, "MiB", 1.2, replicas=n)

        # 2. creation time against Ray's floor (busy: the largest topic stays for case 3)
        busy_topic = None
        for n in mode["create_sizes"]:
            actors, _, plain_s = start_plain(n)
            stop_plain(actors)
            name = f"create-{n}"
            started = time.perf_counter()
            bus.admin.create_topic(name, partitions=n)
            created_s = time.perf_counter() - started
            topics.append(name)
            log(f"create {n}: {created_s:.1f}s; {n} plain actors: {plain_s:.1f}s")
            emit(f"create topic of {n} partitions", created_s, plain_s, "s", 1.3 if n == 64 else None, partitions=n)
            if n == mode["busy_size"]:
                busy_topic = name
            else:
                bus.admin.delete_topic(name)
                topics.remove(name)

        # 3. a busy node: latency with 8 replicas, then with the big topic present
        bus.admin.delete_topic(busy_topic)
        topics.remove(busy_topic)
        bus.admin.create_topic("few", partitions=6)  # + warm-up + latency topic = 8 replicas
        topics.append("few")
        bus.admin.create_topic("latency-8", partitions=1)
        topics.append("latency-8")
        p50_8, p99_8 = latency(bus, data_dir, "latency-8", mode["latency_s"])
        # Each measurement on a fresh latency topic (the consumer reads from offset 0: an earlier
        # run's records would count as sent a minute before).
        bus.admin.delete_topic("latency-8")
        topics.remove("latency-8")
        # The control: as many plain actors as the big topic has replicas, beside the 8 replicas.
        actors, _, _ = start_plain(mode["busy_size"])
        try:
            bus.admin.create_topic("latency-plain", partitions=1)
            topics.append("latency-plain")
            p50_plain, p99_plain = latency(bus, data_dir, "latency-plain", mode["latency_s"])
        finally:
            stop_plain(actors)
        for name in ("few", "latency-plain"):
            bus.admin.delete_topic(name)
            topics.remove(name)
        bus.admin.create_topic(busy_topic, partitions=mode["busy_size"])
        topics.append(busy_topic)
        bus.admin.create_topic("latency-n", partitions=1)
        topics.append("latency-n")
        replicas = 2 + mode["busy_size"]
        each_s = one_record_each(bus, busy_topic, mode["busy_size"])
        p50_n, p99_n = latency(bus, data_dir, "latency-n", mode["latency_s"])
        log(f"{replicas} replicas: one record each to and from {mode['busy_size']} partitions in {each_s:.2f}s; "
            f"latency p50/p99 {p50_n:.2f}/{p99_n:.2f} ms against {p50_8:.2f}/{p99_8:.2f} ms with 8 replicas "
            f"and {p50_plain:.2f}/{p99_plain:.2f} ms with 8 replicas and {mode['busy_size']} plain actors")
        emit(f"one record to and from each of {mode['busy_size']} partitions", each_s, None, "s", replicas=replicas)
        emit(f"latency p50 at {LATENCY_RATE}/s with {replicas} replicas", p50_n, p50_8, "ms", 1.5, replicas=replicas)
        emit(f"latency p99 at {LATENCY_RATE}/s with {replicas} replicas", p99_n, p99_8, "ms", None, replicas=replicas)
        control = f"8 replicas and {mode['busy_size']} plain actors"
        emit(f"latency p50 at {LATENCY_RATE}/s, {replicas} replicas vs {control} (info)", p50_n, p50_plain, "ms", None,
             replicas=replicas)
        emit(f"latency p99 at {LATENCY_RATE}/s, {replicas} replicas vs {control} (info)", p99_n, p99_plain, "ms", None,
             replicas=replicas)
    finally:
        delete_topics(bus, topics)
        shutdown_ray()
        remove_dir(data_dir)
    wall = run.finish()
    print_table(("case", "logbus", "plain Ray / baseline", "ratio", "target", "meets"), rows)
    log(f"done in {wall:.0f}s; load average {run.load_start[0]:.1f} at the start, {run.load_end[0]:.1f} at the end")
    for line in lines:
        line.update(quick=run.quick, date=run.date, loadavg_start=run.loadavg_start, loadavg_end=run.loadavg_end)
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
