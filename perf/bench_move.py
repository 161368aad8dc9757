#!/usr/bin/env python
"""Move benchmark: moving a partition to a new node under load, and a topic that needs a new node.

Run with ``./dev bench move`` (= ``.venv/bin/python perf/bench_move.py``); ``--quick`` makes a
short smoke run (100 MB instead of 1 GB). Two parts, each on a Ray cluster of its own on this
machine:

1. move      ``ray.cluster_utils.Cluster``: a head and four replica nodes (16 ``logbus_replica``
             slots each). A topic of one partition, replication factor 3, min.insync.replicas 2,
             filled with 1 GB of 1,000-byte records (``send_table``, acks="all"). Baseline: the
             produce throughput of an acks="all" ``send_table`` producer for 10 s, paced at a
             quarter of the throttle (``--produce-rate``, bytes/s). Then the same producer keeps
             sending (for the move's first 20 s at most, then it stops and the copy catches up)
             while ``reassign_partitions`` moves the partition from nodes A, B, C to B, C, D with
             a throttle (default 100 MB/s): the time the move takes, the bytes/s the new replica
             copied (its log files' growth), and the produce throughput during the move as a
             ratio to the baseline (target >= 0.7). The producer is paced because a move only
             ends when the copy outruns the writes (as in Kafka, the throttle must exceed the
             partition's write rate): unpaced, this machine writes ~700 MB/s with acks="all",
             and a move throttled to 100 MB/s would copy until the disk is full; paced at half the
             throttle, the copy (~60 MB/s here under that load) barely gained on the writes. The move is
             cancelled, and the run fails, after ``MOVE_TIMEOUT_S``.
2. autoscale the fake autoscaling cluster of ``tests/autoscaler`` (Ray's fake_multinode provider,
             autoscaler v1): from a head alone, ``create_topic`` with replication factor 2 needs
             two nodes; the time until the autoscaler's nodes are up (the autoscaler's part) and
             the rest until ``create_topic`` returned with every replica serving (logbus's part).

The machine is shared: the load average at the start and end is printed. The last lines are
one JSON object per result.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import ray
from ray.cluster_utils import Cluster

from _common import RunInfo, arg_parser, exit_on_sigterm, json_value, log, print_table, remove_dir, shutdown_ray  # noqa: I001

import logbus
from logbus import TopicPartition
from logbus.actors.placement import replica_directory

RECORD_BYTES = 1_000
TABLE_ROWS = 10_000
BASELINE_S = 10.0
MOVE_TIMEOUT_S = 600.0  # a move not done by then is cancelled and the run fails
DURING_MAX_S = 20.0  # the producer sends during the first seconds of the move at most, then stops


def value_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=rows * RECORD_BYTES, dtype=np.uint8).tobytes()
    return pa.table({"value": pa.array([data[i * RECORD_BYTES:(i + 1) * RECORD_BYTES] for i in range(rows)], pa.binary())})


class Sender:
    """A producer in a thread sending the same table over and over at a paced rate, counting acknowledged records per second."""

    def __init__(self, bus, topic: str, table: pa.Table, rate_bytes_per_s: float) -> None:
        self.producer = logbus.Producer(bus, acks="all")
        self.topic, self.table = topic, table
        self.rate_bytes_per_s = rate_bytes_per_s  # pacing: a table is sent no sooner than the rate allows
        self.acked: list[tuple[float, int]] = []  # (time, records) per acknowledged send_table
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending = []
        table_bytes = self.table.num_rows * RECORD_BYTES
        started, sent = time.monotonic(), 0
        while not self.stop_event.is_set():
            wait_s = started + sent * table_bytes / self.rate_bytes_per_s - time.monotonic()
            if wait_s > 0 and self.stop_event.wait(wait_s):
                break
            pending.append(self.producer.send_table(self.topic, self.table))
            sent += 1
            while len(pending) > 4:
                pending.pop(0).result(timeout=300)
                self.acked.append((time.monotonic(), self.table.num_rows))
        for future in pending:
            future.result(timeout=300)
            self.acked.append((time.monotonic(), self.table.num_rows))

    def rate(self, start: float, end: float) -> float:
        return sum(n for t, n in self.acked if start <= t < end) / max(1e-9, end - start)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=600)
        self.producer.close()


def log_bytes(directory: str) -> int:
    if not os.path.isdir(directory):
        return 0
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".log"))


def statuses_nodes(bus, topic: str) -> dict[int, str]:
    reported = ray.get(bus.controller.replica_statuses.remote(topic), timeout=120)[0]
    return {s["replica_id"]: s["node_id"] for s in reported if "node_id" in s}


def bench_move(total_bytes: int, throttle: int, produce_rate: float) -> dict:
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-move-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        for _ in range(4):
            cluster.add_node(num_cpus=1, resources={"logbus_replica": 16})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        bus = logbus.connect(data_dir=data_dir, namespace=f"bench-move-{uuid.uuid4().hex[:8]}")
        topic = "moving"
        bus.admin.create_topic(topic, partitions=1, replication_factor=3,
                               config={"min.insync.replicas": 2, "segment.bytes": 256 << 20})
        table = value_table(TABLE_ROWS)
        log(f"filling {total_bytes / 1e9:.2f} GB")
        with logbus.Producer(bus, acks="all") as producer:
            futures = [producer.send_table(topic, table) for _ in range(total_bytes // (TABLE_ROWS * RECORD_BYTES))]
            for future in futures:
                future.result(timeout=600)
        sender = Sender(bus, topic, table, produce_rate)
        time.sleep(2.0)  # the sender's first requests are out of the measurement
        base_start = time.monotonic()
        time.sleep(BASELINE_S)  # the baseline window
        baseline = sender.rate(base_start, time.monotonic())
        nodes = statuses_nodes(bus, topic)
        described = bus.admin.describe_topic(topic).partitions[0]
        before = [nodes[r] for r in described.replicas]
        spare = next(n["node_id"] for n in bus.admin.nodes() if n["node_id"] not in before)
        moved_start = time.monotonic()
        moving = bus.admin.reassign_partitions({TopicPartition(topic, 0): before[1:] + [spare]}, throttle_bytes_per_s=throttle)
        new_dir = replica_directory(bus.data_dir, topic, 0, moving[0]["adding"][0])
        samples = []
        during = None
        while bus.admin.describe_reassignments():
            if during is None and time.monotonic() - moved_start >= DURING_MAX_S:
                during_end = time.monotonic()
                during = sender.rate(moved_start, during_end)
                sender.stop()  # the copy then catches up with a log that no longer grows
            if time.monotonic() - moved_start > MOVE_TIMEOUT_S:
                bus.admin.cancel_reassignments([TopicPartition(topic, 0)])
                raise RuntimeError(f"the move did not finish in {MOVE_TIMEOUT_S:.0f}s (cancelled)")
            samples.append((time.monotonic(), log_bytes(new_dir)))
            time.sleep(0.25)
        moved_end = time.monotonic()
        if during is None:
            during_end = moved_end
            during = sender.rate(moved_start, moved_end)
            sender.stop()
        copying = [(t, b) for t, b in samples if b > 0]
        copied_rate = (copying[-1][1] - copying[0][1]) / (copying[-1][0] - copying[0][0]) if len(copying) > 1 else float("nan")
        copied_bytes = copying[-1][1] if copying else 0
        log(f"moved {copied_bytes / 1e9:.2f} GB in {moved_end - moved_start:.1f}s at {copied_rate / 1e6:.1f} MB/s "
            f"(throttle {throttle / 1e6:.0f} MB/s); produce {during:,.0f} records/s during, {baseline:,.0f} before")
        bus.admin.delete_topic(topic)
        return {"move_s": moved_end - moved_start, "copied_bytes": copied_bytes, "copy_bytes_per_s": copied_rate,
                "throttle_bytes_per_s": throttle, "produce_rate_bytes_per_s": produce_rate, "produce_window_s": during_end - moved_start, "produce_before": baseline, "produce_during": during,
                "ratio": during / baseline if baseline else float("nan")}
    finally:
        shutdown_ray(cluster)
        remove_dir(data_dir, attempts=5)


def bench_autoscale() -> dict:
    import sys  # noqa: PLC0415

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.autoscaler.fake_cluster import FakeAutoscalingCluster  # noqa: PLC0415

    work = tempfile.mkdtemp(prefix="logbus-bench-autoscale-")
    worker_types = {"replica-node": {"resources": {"CPU": 1, "logbus_replica": 4, "object_store_memory": 100 << 20}, "max_workers": 3}}
    cluster = FakeAutoscalingCluster(worker_types, 6.0, __import__("pathlib").Path(work))
    try:
        cluster.start()
        bus = logbus.connect(data_dir=os.path.join(work, "data"), namespace=f"bench-as-{uuid.uuid4().hex[:8]}")
        cluster.wait_for_workers(0, timeout_s=300)
        mark = cluster.mark()
        started = time.monotonic()
        result = {}

        def create():
            bus.admin.create_topic("grown", partitions=2, replication_factor=2, timeout_s=300)
            result["done"] = time.monotonic()

        thread = threading.Thread(target=create)
        thread.start()
        cluster.wait_for_workers(2, timeout_s=300, since=mark)
        nodes_up = time.monotonic()
        thread.join(timeout=600)
        total = result["done"] - started
        log(f"create needing 2 nodes: {total:.1f}s, of which {nodes_up - started:.1f}s until the autoscaler's nodes were up")
        return {"create_s": total, "autoscaler_s": nodes_up - started, "logbus_s": result["done"] - nodes_up}
    finally:
        cluster.shutdown()
        remove_dir(work, attempts=3)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="100 MB instead of 1 GB")
    parser.add_argument("--throttle", type=int, default=100_000_000, help="bytes/s each moving replica may copy")
    parser.add_argument("--skip-autoscale", action="store_true", help="leave out the autoscaler part")
    parser.add_argument("--produce-rate", type=float, default=None,
                        help="bytes/s the producer is paced at before and during the move (default: a quarter of the throttle)")
    args = parser.parse_args()
    exit_on_sigterm()
    run = RunInfo(quick=bool(args.quick))
    log(f"mode={'quick' if args.quick else 'full'}, load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")
    produce_rate = args.produce_rate or args.throttle / 4
    move = bench_move(100_000_000 if args.quick else 1_000_000_000, args.throttle, produce_rate)
    scale = None if args.skip_autoscale else bench_autoscale()
    run.finish()
    rows = [
        ("move: seconds", f"{move['move_s']:.1f}", ""),
        ("move: copied MB/s", f"{move['copy_bytes_per_s'] / 1e6:.1f}", f"throttle {move['throttle_bytes_per_s'] / 1e6:.0f}"),
        ("move: produce during / before", f"{move['ratio']:.2f}", ">= 0.7"),
    ]
    if scale:
        rows += [("autoscale: create_topic seconds", f"{scale['create_s']:.1f}", ""),
                 ("  of which the autoscaler", f"{scale['autoscaler_s']:.1f}", ""),
                 ("  of which logbus", f"{scale['logbus_s']:.1f}", "")]
    print_table(("case", "value", "note"), rows)
    common = {"quick": run.quick, "date": run.date, "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end}
    print(json.dumps({"bench": "move", "case": "move a partition under load", **{k: json_value(v) for k, v in move.items()},
                      "target": 0.7, "meets_target": move["ratio"] >= 0.7, **common}))
    if scale:
        print(json.dumps({"bench": "move", "case": "create_topic needing 2 new nodes", **{k: json_value(v) for k, v in scale.items()}, **common}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
