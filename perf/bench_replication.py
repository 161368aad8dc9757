#!/usr/bin/env python
"""Replication benchmarks: replicated produce throughput, acks=all end-to-end latency and leader failover.

Run with ``./dev bench replication`` (= ``.venv/bin/python perf/bench_replication.py``).
``--quick`` makes a short smoke run (about 1 min on a quiet machine; 2 kills); ``--kills N`` sets
the number of leader-node kills (default 10; 2 with ``--quick``); ``--wait-load L`` first waits
(up to 20 min) for the 1-minute load average to fall below L; ``--verbose`` shows the actors' output;
``--only PHASE ...`` runs only those of the cases below (``produce``, ``latency``, ``failover``),
e.g. ``--only latency`` for the latency case alone (about a minute); ``--timeline DIR`` saves each
latency repetition's per-record send and receipt times there, to set beside ``perf sched`` (see
perf/RESULTS.md, the acks=all tail).

The cluster is built on this one machine with ``ray.cluster_utils.Cluster``, as in
tests/actors/test_replication.py: a head node (the driver, the controller and the
benchmark's helper actors; num_cpus=2) plus three worker nodes (num_cpus=1) that carry the
custom resource ``{"logbus_replica": 16}`` (replica slots), so every replica is placed off the head node and
each replica of a partition is on its own node. Ray's health checks are lowered as in the
test (300 ms period, 1.5 s timeout, 5 failures). The controller is created by
``logbus.connect(..., replica_replacement_ms=2000)``; the controller places itself on the head
node (checked). Every topic has one partition, replication_factor 3
and min.insync.replicas 2. Records are 100-byte values (random, incompressible), null keys
and headers. Cases:

1. produce   one Producer in the driver, on the head node: every batch crosses to the
             leader's node through Ray's object store, and on to the followers' nodes.
             (a) ``send_table()`` of a pre-built 10,000-row pyarrow table, acks=1;
             (b) the same with acks="all" (the headline; target >= 500,000 records/s,
                 reported as a ratio to LinkedIn's 421,823 records/s for Kafka with 3x
                 synchronous replication; acks=1 is compared with its 786,980 for 3x async);
             (c) ``send()`` per record with acks="all";
             (d) info: (b) with enable_idempotence=False (no sequence numbers; the Producer
                 then keeps one request in flight per partition, to keep records in order).
             Producer settings are otherwise the defaults (linger_ms=5, 1 MiB batches, 5 in
             flight), except delivery_timeout_ms=60 s, which bounds a failing case. A
             10,000-row table becomes two batches (8,738 + 1,262 rows). Each repetition runs
             from the first send to the end of ``flush()`` and is checked against the
             leader's offsets (high watermark for acks=all, log end for acks=1). Batches the
             leader refused and the producer retried are counted per case.
             ref: Ray's own transport: 1 MiB uint8 arrays (a batch) from the driver to an
             actor on a replica node, 5 calls in flight; no logbus code. records/s there is
             MB/s divided by the encoded size of a record (header and Arrow framing included).
2. latency   acks="all", ``send()`` paced at 10,000 records/s by a Producer in a Ray actor on
             the head node; each value starts with its send time (``time.time_ns()``); a
             Consumer in another actor on the head node polls (timeout 5 ms) and computes
             poll-return time minus send time per record. p50 / p99 / max over every record
             sent: a record not received within the grace period after the sending ended
             counts as infinitely late (and a producer still backlogged then is killed).
             The target case is linger_ms=0; linger_ms=2 is reported for comparison (info),
             and so are the percentiles over the received records only. Also (info): the
             round trip of one record at a time (``send(...).result()``, linger_ms=0) with
             acks=1 and with acks="all", 200 each (50 with --quick): the floor of the latency;
             and ref: the same hops as bare Ray actor calls, no logbus code (``ChainLeader`` on
             one replica node, a ``ChainFollower`` long-polling it from each other one, the
             driver as producer and consumer), one value at a time: the floor of the transport.
3. failover  a steady workload: an idempotent acks="all" Producer (linger_ms=2, as in the
             test's Workload) in a thread of the driver, sending ``send()`` per record at
             10,000 records/s in bursts of 200 every 20 ms (one batch per burst), each value
             carrying a sequence number. N times: wait until the ISR is back to 3 and the
             workload is progressing with at most 300 ms of records unacknowledged, then kill
             the node of the partition's leader: SIGSTOP the leader's replica process (it
             freezes at once, as on a machine that died), ``cluster.remove_node(node,
             allow_graceful=False)`` (SIGKILL of the node's raylet and agents), then SIGKILL
             of the frozen process (remove_node leaves worker processes to notice the dead
             raylet by themselves, which can take a second, during which a live old leader
             could still acknowledge). The clock starts just before the SIGSTOP. Every second
             kill freezes the whole node instead: the node's agent is stopped first, then the
             leader, so no one on the node reports the stop and the node's lease running out
             (0.9 s) is what the controller goes by; the two kinds are reported apart. Per kill:
               (a) new leader: until the controller's metadata names a leader with a higher
                   epoch and that replica itself reports role "leader" in that epoch (polled
                   every 20 ms; the time the controller's metadata first changed is also
                   reported, "elected");
               (b) first ack: until the first acknowledgement of a record sent after the
                   kill (done-callbacks on every record sent after the kill).
             The producer's steps after each kill are traced (first error, dispatches to the
             dead leader, metadata refreshes, first dispatch to the new leader) by wrapping
             methods of that producer instance. After (a) and (b), a fresh replica node is
             added (so three remain; the controller replaces the lost replica on it after
             replica_replacement_ms). At the end the workload is flushed and the partition
             drained with a Consumer: every acknowledged record must be there, once, at its
             acknowledged offset. Targets: max <= 2 s and median <= 1 s, for (a) and (b).

Every throughput case runs once unmeasured as a warm-up, then is repeated (3 times in a full
run, 2 in a quick one; per-record send() 2 / 1 times) and the best repetition is reported;
latency: 2 / 1 repetitions, the one with the lowest p99 is reported. Other engineers run
tests on this 2-core machine at the same time, so the figures are noisy: the load average is
logged with every repetition and printed with the results. The last lines of the output are
one JSON object per result ({"bench": "replication", "case": ..., ...}).

Ray and the Cluster are always shut down at the end (also on errors and on SIGTERM).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

# A producer's sender thread that outlives ray.shutdown() (after an error) must not attach itself to
# some other Ray cluster running on this machine.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

# First: it puts this tree's logbus on sys.path.
from _common import (  # noqa: E402
    TABLE_ROWS,
    VALUE_SIZE,
    LatencyConsumer,
    PacedProducer,
    RunInfo,
    Sink,
    arg_parser,
    exit_on_sigterm,
    first_int64,
    fmt,
    fmt_rate,
    high_watermarks,
    json_value,
    latency_percentiles_ms,
    load_text,
    log,
    make_pool,
    make_table,
    new_namespace,
    print_table,
    produce_send,
    produce_tables,
    remove_dir,
    shutdown_ray,
    stamped_value,
    transport_ceiling,
    wait_for,
)

import logbus  # noqa: E402
from logbus import Consumer, Producer, TopicPartition  # noqa: E402
from logbus.actors.placement import REPLICA_NODE_RESOURCE  # noqa: E402
from logbus.actors.controller import CONTROLLER_NAME  # noqa: E402
from logbus.actors.node_agent import agent_actor_name  # noqa: E402
from logbus.storage import record_batch as rb  # noqa: E402

POOL_SIZE = 10_000
LATENCY_RATE = 10_000  # records/s
WORKLOAD_RATE = 10_000  # records/s during the kills
REPLICA_REPLACEMENT_MS = 2_000
FAILOVER_TIMEOUT_S = 30.0  # a kill whose failover takes longer than this is recorded as failed
RECOVERY_TIMEOUT_S = 120.0  # for the ISR to be back to 3 after a kill
STRAGGLER_S = 5.0  # a workload record unacknowledged this long no longer holds up the progress count
STEADY_BACKLOG = 3 * WORKLOAD_RATE // 10  # records unacknowledged: at most 300 ms of the workload

LINKEDIN_SYNC = 421_823  # records/s, Kafka, 1 producer, 3x synchronous replication (LinkedIn, 2014, 2013 hardware)
LINKEDIN_ASYNC = 786_980  # records/s, the same with 3x asynchronous replication (for acks=1)
PRODUCE_ALL_TARGET = 500_000
FAILOVER_MAX_TARGET_S = 2.0
FAILOVER_P50_TARGET_S = 1.0

REPLICA_RESOURCE = {"logbus_replica": 16}  # replica slots per node
SYSTEM_CONFIG = {  # as in tests/actors/test_replication.py
    "health_check_initial_delay_ms": 0,
    # A removed node's raylet refuses connections at once, so it is declared dead after 5 quick
    # failures (~1.5 s); a raylet that is merely slow (a loaded CI machine) must stay silent for
    # 5 x (0.3 s + 1.5 s) before Ray gives up on it, and with it on every actor it hosts.
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 1500,
    "health_check_failure_threshold": 5,
    # Not in the test: Ray's memory monitor kills workers when the *machine's* memory use passes 95%,
    # which other engineers' jobs on this shared machine cause (it killed replicas mid-run once).
    "memory_monitor_refresh_ms": 0,
}
HEAD_OBJECT_STORE = 512 << 20
WORKER_OBJECT_STORE = 384 << 20
TOPIC_CONFIG = {"min.insync.replicas": 2}
PHASES = ("produce", "latency", "failover")  # the cases of the docstring, in the order they run


@dataclass
class Mode:
    records: int  # per repetition of a send_table case
    warmup_records: int
    reps: int
    send_records: int  # per repetition of the per-record send() case
    send_reps: int
    time_cap_s: float  # a produce repetition stops sending after this long (then flushes)
    latency_s: float
    latency_reps: int
    latency_grace_s: float  # how long after the paced sending ends records may still arrive
    kills: int
    transport_s: float = 2.0
    round_trips: int = 200
    steady_timeout_s: float = 30.0  # how long to wait for the workload to keep up before a kill


FULL = Mode(records=1_500_000, warmup_records=200_000, reps=3, send_records=400_000, send_reps=2, time_cap_s=6.0,
            latency_s=5.0, latency_reps=2, latency_grace_s=8.0, kills=10, transport_s=2.0)
QUICK = Mode(records=200_000, warmup_records=30_000, reps=2, send_records=100_000, send_reps=1, time_cap_s=3.0,
             latency_s=1.5, latency_reps=1, latency_grace_s=3.0, kills=2, transport_s=1.0,
             round_trips=50, steady_timeout_s=10.0)


@dataclass
class Result:
    case: str
    records_per_s: float | None = None
    p50: float | None = None  # ms for latency, s for failover
    p99: float | None = None
    max: float | None = None
    unit: str = ""
    ratio_vs: str | None = None
    ratio: float | None = None
    target: str | None = None
    meets_target: bool | None = None
    reps: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


SEQ_PAD = b"\x00" * (VALUE_SIZE - 16)


# --- topics and leaders ------------------------------------------------------------------------------


def controller_of(bus):
    return ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)


def leader_now(bus, topic: str, timeout_s: float = 5.0):
    """(leader epoch, leader handle or None) as the controller has it (cheap: no call to any replica)."""
    raw = ray.get(controller_of(bus).topic_metadata.remote(topic), timeout=timeout_s)
    partition = raw["partitions"][0]
    return partition["leader_epoch"], partition["leader"]


def leader_status(bus, topic: str) -> dict | None:
    """The leader's own status if it reports role leader in the controller's current epoch."""
    epoch, handle = leader_now(bus, topic)
    if handle is None:
        return None
    try:
        status = ray.get(handle.status.remote(), timeout=5)
    except Exception:  # noqa: BLE001 (dead or restarting)
        return None
    if status.get("role") == "leader" and status.get("leader_epoch") == epoch:
        return status
    return None


def isr_full(bus, topic: str, size: int = 3) -> dict | None:
    status = leader_status(bus, topic)
    if status is None:
        return None
    described = bus.admin.describe_topic(topic).partitions[0]
    if len(described.isr) == size and len(described.replicas) == size and described.leader_epoch == status["leader_epoch"]:
        return status
    return None


def high_watermark(bus, topic: str) -> int:
    return high_watermarks(bus, topic)[0]


def log_end_offset(bus, topic: str) -> int:
    return bus.admin.describe_topic(topic).partitions[0].log_end_offset


def create_topic(bus, name: str) -> str:
    t0 = time.perf_counter()
    bus.admin.create_topic(name, partitions=1, replication_factor=3, config=dict(TOPIC_CONFIG))
    wait_for(lambda: isr_full(bus, name), 120, message=f"ISR of 3 for {name}")
    nodes = {s.get("node_id") for s in ray.get(controller_of(bus).replica_statuses.remote(name), timeout=60)[0]}
    log(f"created topic {name} (RF 3, min.insync.replicas 2, replicas on {len(nodes)} nodes) in {time.perf_counter() - t0:.1f}s")
    return name


# --- produce -----------------------------------------------------------------------------------------


def throughput_case(bus, acks, topic, run_once, reps: int, label: str) -> tuple[float, list[float], list[int]]:
    """Warm-up, then ``reps`` measured runs, each checked against the leader's offsets (acks=all: the
    high watermark; acks=1: the log end, as followers may still be fetching)."""
    offset_of = high_watermark if acks == "all" else log_end_offset
    run_once(warmup=True)
    rates, counts = [], []
    for rep in range(reps):
        before = offset_of(bus, topic)
        sent = run_once(warmup=False)
        count, seconds = sent.records, sent.seconds
        stored = offset_of(bus, topic) - before
        if stored != count:
            raise AssertionError(f"{label}: {count} records acknowledged but the leader's offset moved by {stored}")
        rates.append(count / seconds)
        counts.append(count)
        log(f"{label:<34} rep {rep + 1}: {count:,} records in {seconds:.2f}s = {count / seconds:,.0f}/s  ({load_text()})")
    return max(rates), rates, counts


# --- failover workload -------------------------------------------------------------------------------


class ProducerTrace:
    """Timestamps of one producer's internal steps, for the breakdown of a failover.

    Wraps three methods of *instances* (the producer's ``_dispatch`` and ``_complete``, and its Bus's
    ``topic_metadata``); logbus itself is not changed. Events: (monotonic time, kind, detail).
    """

    def __init__(self, producer: Producer, bus=None) -> None:
        self.events: deque = deque(maxlen=500_000)
        self.error_samples: dict[str, tuple[float, str]] = {}  # error type -> (when, first message)
        self.error_counts: dict[str, int] = {}
        dispatch, complete = producer._dispatch, producer._complete

        def traced_dispatch(batch):
            dispatch(batch)
            self.events.append((time.monotonic(), "dispatch", batch.leader_id))

        def traced_complete(batch, base_offset, error, attempt, **options):
            now = time.monotonic()
            self.events.append((now, "complete", None if error is None else type(error).__name__))
            if error is not None:
                name = type(error).__name__
                self.error_counts[name] = self.error_counts.get(name, 0) + 1
                self.error_samples.setdefault(name, (now, str(error)[:300]))
            return complete(batch, base_offset, error, attempt, **options)

        producer._dispatch = traced_dispatch
        producer._complete = traced_complete
        if bus is None:
            return
        metadata = bus.topic_metadata

        def traced_metadata(topic, refresh=False):
            started = time.monotonic()
            result = metadata(topic, refresh=refresh)
            if refresh:
                leader = result.leaders[0]
                self.events.append((time.monotonic(), "metadata",
                                    (result.leader_epochs[0], None if leader is None else leader._actor_id, time.monotonic() - started)))
            return result

        bus.topic_metadata = traced_metadata

    def errors(self) -> str:
        return "; ".join(f"{n} x{self.error_counts[n]} (first: {m})" for n, (_, m) in self.error_samples.items()) or "none"

    def summary(self, start: float, end: float, old_leader_id, old_epoch: int) -> dict:
        """What the producer did between ``start`` (the kill) and ``end``, in seconds after the kill."""
        out = {"errors": {}, "dispatches_to_old_leader": 0, "metadata_refreshes": 0}
        for t, kind, detail in list(self.events):
            if t < start or t > end:
                continue
            at = round(t - start, 3)
            if kind == "complete":
                if detail is None:
                    out.setdefault("first_ok_complete_s", at)
                else:
                    out.setdefault("first_error_s", at)
                    out.setdefault("first_error", detail)
                    out["errors"][detail] = out["errors"].get(detail, 0) + 1
            elif kind == "dispatch":
                if detail == old_leader_id:
                    out["dispatches_to_old_leader"] += 1
                    out["last_dispatch_to_old_leader_s"] = at
                else:
                    out.setdefault("first_dispatch_to_new_leader_s", at)
            elif kind == "metadata":
                epoch, leader_id, seconds = detail
                out["metadata_refreshes"] += 1
                out["metadata_refresh_max_s"] = max(out.get("metadata_refresh_max_s", 0), round(seconds, 3))
                if epoch > old_epoch and leader_id is not None:
                    out.setdefault("first_metadata_with_new_leader_s", at)
        return out


class Workload:
    """An idempotent acks='all' producer sending sequence-numbered records at a steady rate from a thread.

    Futures are reaped in order as they complete (acknowledged sequence number and offset kept
    in compact arrays), so a long run holds only the futures still in flight. After ``mark(t)``
    every record sent gets a done-callback until the first acknowledgement of such a record.
    """

    def __init__(self, bus, topic: str, rate: int) -> None:
        self.producer = Producer(bus, acks="all", linger_ms=2, delivery_timeout_ms=120_000, request_timeout_ms=10_000)
        self.trace = ProducerTrace(self.producer, bus)
        self.topic = topic
        self.rate = rate
        self.pending: deque = deque()
        self.acked_seq: list[np.ndarray] = []
        self.acked_off: list[np.ndarray] = []
        self._seq_buf: list[int] = []
        self._off_buf: list[int] = []
        self.acked = 0
        self.failed = 0
        self.failures: list[str] = []
        self.failed_seqs: list[int] = []
        self.stragglers: list = []
        self._stragglers_checked_s = 0.0
        self.sent = 0
        self._lock = threading.Lock()
        self._mark_s: float | None = None
        self._generation = 0
        self.first_ack_s: float | None = None
        self.probes = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self.thread.start()

    def mark(self, t: float) -> None:
        with self._lock:
            self._generation += 1
            self.first_ack_s = None
            self.probes = 0
            self._mark_s = t

    def _probe_done(self, future, generation: int) -> None:
        now = time.monotonic()
        if future.exception() is not None:
            return
        with self._lock:
            if generation != self._generation:
                return  # a probe of an earlier kill
            if self.first_ack_s is None or now < self.first_ack_s:
                self.first_ack_s = now

    def _record(self, seq: int, future) -> None:
        error = future.exception()
        if error is None:
            self._seq_buf.append(seq)
            self._off_buf.append(future.result().offset)
            self.acked += 1
        else:
            self.failed += 1
            self.failed_seqs.append(seq)
            if len(self.failures) < 5:
                self.failures.append(f"{type(error).__name__}: {error}")

    def _reap(self, final: bool = False) -> None:
        """Take completed futures off the head of ``pending``; a head stuck for STRAGGLER_S moves aside
        (to ``stragglers``, checked every 0.5 s) so that the records behind it are still counted."""
        pending = self.pending
        now = time.monotonic()
        while pending:
            seq, future, sent_s = pending[0]
            if future.done():
                pending.popleft()
                self._record(seq, future)
            elif now - sent_s > STRAGGLER_S and not final:
                self.stragglers.append(pending.popleft())
            else:
                break
        if self.stragglers and (final or now - self._stragglers_checked_s > 0.5):
            self._stragglers_checked_s = now
            still = []
            for item in self.stragglers:
                if item[1].done():
                    self._record(item[0], item[1])
                else:
                    still.append(item)
            self.stragglers = still
        if len(self._seq_buf) >= 50_000:
            self._flush_bufs()

    def _flush_bufs(self) -> None:
        if self._seq_buf:
            self.acked_seq.append(np.array(self._seq_buf, np.int64))
            self.acked_off.append(np.array(self._off_buf, np.int64))
            self._seq_buf, self._off_buf = [], []

    def _run(self) -> None:
        """Bursts of rate/50 records every 20 ms (like the test's Workload: with linger_ms=2 a burst is one batch)."""
        try:
            send = self.producer.send
            topic = self.topic
            burst = max(1, self.rate // 50)
            start = time.perf_counter()
            seq = 0
            tick = 0
            while not self.stop_event.is_set():
                for _ in range(burst):
                    future = send(topic, struct.pack("<qq", seq, time.time_ns()) + SEQ_PAD)
                    mark = self._mark_s
                    if mark is not None and self.first_ack_s is None and time.monotonic() >= mark:
                        self.probes += 1
                        generation = self._generation
                        future.add_done_callback(lambda f, g=generation: self._probe_done(f, g))
                    self.pending.append((seq, future, time.monotonic()))
                    seq += 1
                self.sent = seq
                self._reap()
                tick += 1
                delay = start + tick * 0.02 - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        except BaseException as error:  # noqa: BLE001 (reported by finish())
            self.error = error

    @property
    def backlog(self) -> int:
        """Records sent but not yet acknowledged or failed (stragglers included)."""
        return len(self.pending) + len(self.stragglers)

    def finish(self, timeout_s: float = 180.0) -> tuple[np.ndarray, np.ndarray]:
        """Stop sending, flush, close; (acknowledged sequence numbers, their offsets)."""
        self.stop_event.set()
        self.thread.join(timeout=30)
        self.producer.flush(timeout_s=timeout_s)
        self.producer.close()
        while self.pending or self.stragglers:
            self._reap(final=True)
            if self.pending or self.stragglers:
                time.sleep(0.01)
        self._flush_bufs()
        if self.error is not None:
            raise self.error
        seqs = np.concatenate(self.acked_seq) if self.acked_seq else np.empty(0, np.int64)
        offs = np.concatenate(self.acked_off) if self.acked_off else np.empty(0, np.int64)
        return seqs, offs

    def stop(self) -> None:
        """Stop without waiting for anything (cleanup after an error)."""
        self.stop_event.set()
        self.thread.join(timeout=10)
        try:
            self.producer.close(timeout_s=5)
        except Exception:  # noqa: BLE001 (best effort)
            pass


def drain_and_check(bus, topic: str, acked_seqs: np.ndarray, acked_offsets: np.ndarray, failed_seqs: np.ndarray) -> dict:
    """Read the whole partition; every acknowledged record must be there, once, at its acknowledged offset."""
    tp = TopicPartition(topic, 0)
    consumer = Consumer(bus)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    end = consumer.end_offsets([tp])[tp]
    seq_parts, off_parts, total = [], [], 0
    deadline = time.monotonic() + 180
    while total < end:
        if time.monotonic() > deadline:
            raise TimeoutError(f"drain: {total:,} of {end:,} records after 180 s")
        table = consumer.poll_arrow(timeout_ms=500)
        if table.num_rows:
            seq_parts.append(first_int64(table.column("value")))
            off_parts.append(table.column("offset").to_numpy())
            total += table.num_rows
    consumer.close()
    seqs = np.concatenate(seq_parts) if seq_parts else np.empty(0, np.int64)
    offsets = np.concatenate(off_parts) if off_parts else np.empty(0, np.int64)
    contiguous = bool(np.array_equal(offsets, np.arange(len(offsets))))
    duplicates = int(len(seqs) - len(np.unique(seqs)))
    size = int(max(seqs.max(initial=-1), acked_seqs.max(initial=-1), failed_seqs.max(initial=-1))) + 1
    where = np.full(size, -1, np.int64)
    where[seqs] = offsets
    found = where[acked_seqs]
    lost = int(np.count_nonzero(found < 0))
    moved = int(np.count_nonzero((found >= 0) & (found != acked_offsets)))
    failed_but_stored = int(np.count_nonzero(where[failed_seqs] >= 0))
    return {"failed_but_stored": failed_but_stored, "stored": int(len(seqs)), "high_watermark": int(end), "acknowledged": int(len(acked_seqs)),
            "lost": lost, "moved": moved, "duplicates": duplicates, "offsets_contiguous": contiguous}


# --- output ------------------------------------------------------------------------------------------


def print_results(results: list[Result]) -> None:
    headers = ("case", "records/s", "p50", "p99", "max", "unit", "ratio", "vs", "target", "met")
    print_table(headers, [
        (
            r.case, fmt_rate(r.records_per_s), fmt(r.p50), fmt(r.p99), fmt(r.max), r.unit,
            "" if r.ratio is None else f"{r.ratio:.2f}x", r.ratio_vs or "", r.target or "",
            "" if r.meets_target is None else ("yes" if r.meets_target else "NO"),
        )
        for r in results
    ])


def rounded(value):
    """A figure for the JSON lines ("inf" for a lost record's latency)."""
    return json_value(value, non_finite_as_text=True)


# --- main --------------------------------------------------------------------------------------------


def raylet_pids(cluster: Cluster) -> dict[int, str]:
    """raylet pid -> node id, for every node of the cluster."""
    out = {}
    for node in [cluster.head_node, *cluster.worker_nodes]:
        for info in node.all_processes.get("raylet", []):
            out[info.process.pid] = node.node_id
    return out


def node_of_pid(cluster: Cluster, pid: int) -> str | None:
    """The node whose raylet started process ``pid`` (every worker process is a child of its node's raylet)."""
    import psutil

    try:
        parent = psutil.Process(pid).ppid()
    except psutil.Error:
        return None
    return raylet_pids(cluster).get(parent)


def connect_with_controller_on_head(cluster: Cluster, data_dir: str, namespace: str):
    """logbus.connect, checking that the controller is on the head node (the factory pins it there)."""
    bus = logbus.connect(data_dir=data_dir, namespace=namespace, replica_replacement_ms=REPLICA_REPLACEMENT_MS)
    pid = ray.get(controller_of(bus).ping.remote(), timeout=60)
    where = node_of_pid(cluster, pid)
    if where != cluster.head_node.node_id:
        raise RuntimeError(f"the controller (pid {pid}) is on node {where}, not on the head node {cluster.head_node.node_id}")
    return bus


# --- the floor of Ray's transport for one acks=all round -----------------------------------------------


@ray.remote(num_cpus=0)
class ChainLeader:
    """A bare imitation of one acks=all round on Ray actor calls (no logbus code): a produce call
    appends a value and wakes the followers' parked fetches; each follower's next fetch reports its
    position; once every follower holds the value, the produce call returns and a consumer's parked
    call is answered. The same one-way hops as logbus's path: producer -> leader, leader -> followers
    (fetch replies), followers -> leader (next fetches), leader -> consumer (and -> producer)."""

    def __init__(self, followers: int) -> None:
        self.followers = followers
        self.values: list[bytes] = []
        self.high_watermark = 0
        self.positions: dict[int, int] = {}
        self.events: dict[str, asyncio.Event] = {}

    def _wake(self, name: str) -> None:
        event = self.events.pop(name, None)
        if event is not None:
            event.set()

    async def _wait(self, name: str) -> None:
        await self.events.setdefault(name, asyncio.Event()).wait()

    async def produce(self, value: bytes) -> int:
        self.values.append(value)
        end = len(self.values)
        self._wake("appended")
        while self.high_watermark < end:
            await self._wait("hw")
        return end

    async def fetch(self, follower: int, offset: int) -> list:
        self.positions[follower] = offset
        if len(self.positions) == self.followers and min(self.positions.values()) > self.high_watermark:
            self.high_watermark = min(self.positions.values())
            self._wake("hw")
        while len(self.values) <= offset:
            await self._wait("appended")
        return self.values[offset:]

    async def consume(self, offset: int) -> list:
        while self.high_watermark <= offset:
            await self._wait("hw")
        return self.values[offset:self.high_watermark]


@ray.remote(num_cpus=0)
class ChainFollower:
    async def follow(self, leader, follower: int) -> None:
        log: list[bytes] = []
        while True:
            log.extend(await leader.fetch.remote(follower, len(log)))


def ray_chain_floor(cluster: Cluster, trips: int) -> tuple[np.ndarray, np.ndarray]:
    """One value at a time through a ChainLeader (on one replica node) and two ChainFollowers (one on
    each other replica node), from the driver on the head node: (send -> the consumer's parked call
    answered, send -> the produce call answered), in ms."""
    node_ids = sorted(n.node_id for n in cluster.worker_nodes)[:3]
    nodes = [NodeAffinitySchedulingStrategy(node_id=node_id, soft=False) for node_id in node_ids]
    leader = ChainLeader.options(scheduling_strategy=nodes[0]).remote(2)
    followers = [ChainFollower.options(scheduling_strategy=node).remote() for node in nodes[1:]]
    loops = [f.follow.remote(leader, i) for i, f in enumerate(followers)]
    consumed, acked = [], []
    try:
        for i in range(trips + 10):
            waiting = leader.consume.remote(i)
            time.sleep(0.001)  # the consumer's call is parked before the value is sent, as a long poll is
            start = time.perf_counter()
            produced = leader.produce.remote(stamped_value())
            ray.get(waiting, timeout=30)
            got_s = time.perf_counter()
            ray.get(produced, timeout=30)
            if i >= 10:  # the first ones warm the calls up
                consumed.append(got_s - start)
                acked.append(time.perf_counter() - start)
    finally:
        for actor in [leader, *followers]:
            ray.kill(actor)
        del loops
    return np.array(consumed) * 1e3, np.array(acked) * 1e3



def add_replica_node(cluster: Cluster):
    return cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE, object_store_memory=WORKER_OBJECT_STORE)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run (about 1 min on a quiet machine; 2 kills unless --kills)")
    parser.add_argument("--kills", type=int, default=None, help="leader-node kills (default 10; 2 with --quick)")
    parser.add_argument("--verbose", action="store_true", help="show the replicas' and controller's output")
    parser.add_argument("--only", nargs="+", choices=PHASES, default=None, metavar="PHASE",
                        help=f"run only these phases ({', '.join(PHASES)}; default: all)")
    parser.add_argument("--timeline", default=None, metavar="DIR",
                        help="save each latency repetition's send and receipt times per record (time.time_ns()) "
                             "to DIR/latency-lingerL-repN.npz, with the offset to CLOCK_MONOTONIC (for `perf sched`)")
    parser.add_argument("--wait-load", type=float, default=None, metavar="L",
                        help="first wait (up to 20 min) until the 1-minute load average is below L")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    kills = mode.kills if args.kills is None else args.kills
    if kills < 0:
        parser.error("--kills must be >= 0")

    phases = set(args.only or PHASES)
    if "failover" not in phases:
        kills = 0

    exit_on_sigterm()

    if args.wait_load is not None:
        waited = time.monotonic()
        while os.getloadavg()[0] >= args.wait_load and time.monotonic() - waited < 1200:
            time.sleep(5)
        log(f"waited {time.monotonic() - waited:.0f}s for the load to fall below {args.wait_load:g} ({load_text()})")

    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-replication-")
    namespace = new_namespace("bench-repl")
    results: list[Result] = []
    loads: dict[str, str] = {}
    cluster: Cluster | None = None
    workload: Workload | None = None
    log(f"mode={'quick' if args.quick else 'full'} phases={','.join(p for p in PHASES if p in phases)} kills={kills} data_dir={data_dir} namespace={namespace} ({load_text()})")
    try:
        t0 = time.perf_counter()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "object_store_memory": HEAD_OBJECT_STORE, "include_dashboard": False,
                            "_system_config": SYSTEM_CONFIG},
        )
        for _ in range(3):
            add_replica_node(cluster)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=args.verbose)
        head_id = cluster.head_node.node_id
        if ray.get_runtime_context().get_node_id() != head_id:
            raise RuntimeError("the driver is not attached to the head node")
        bus = connect_with_controller_on_head(cluster, data_dir, namespace)
        log(f"cluster up (head + 3 replica nodes) and controller ready in {time.perf_counter() - t0:.1f}s")

        pool = make_pool(POOL_SIZE)
        table = make_table(pool)
        encoded_bytes = len(rb.encode_batch(pool[:TABLE_ROWS])) / TABLE_ROWS  # framed, as stored and sent

        # ---- 1. produce throughput ---------------------------------------------------------------
        topic = create_topic(bus, "bench") if phases & {"produce", "latency"} else None  # deleted before the kills
        if "produce" in phases:
            loads["produce"] = load_text()
            log(f"phase produce ({loads['produce']})")
            async_ref = ("LinkedIn Kafka 3x async 786,980/s", LINKEDIN_ASYNC)
            sync_ref = ("LinkedIn Kafka 3x sync 421,823/s", LINKEDIN_SYNC)
            cases = (
                # (case, acks, idempotence, api, reps, ratio reference, target)
                (f"produce send_table({TABLE_ROWS:,} rows), acks=1", 1, True, "table", mode.reps, async_ref, None),
                (f"produce send_table({TABLE_ROWS:,} rows), acks=all", "all", True, "table", mode.reps, sync_ref, PRODUCE_ALL_TARGET),
                ("produce send() per record, acks=all", "all", True, "send", mode.send_reps, sync_ref, None),
                # Without idempotence there are no sequence numbers, and the Producer keeps one request in
                # flight per partition (Ray may start concurrent calls out of order): info, see RESULTS.md.
                (f"produce send_table({TABLE_ROWS:,} rows), acks=all, idempotence off (info)", "all", False, "table", mode.reps,
                 sync_ref, None),
            )
            for case, acks, idempotence, api, reps_wanted, (ratio_vs, reference), target in cases:
                producer = Producer(bus, acks=acks, enable_idempotence=idempotence, delivery_timeout_ms=60_000)  # bounds a failing case
                trace = ProducerTrace(producer)
                if api == "table":
                    run_once = lambda warmup, p=producer: produce_tables(  # noqa: E731
                        p, topic, table, mode.warmup_records if warmup else mode.records, mode.time_cap_s)
                else:
                    run_once = lambda warmup, p=producer: produce_send(  # noqa: E731
                        p, topic, pool, mode.warmup_records // 2 if warmup else mode.send_records, mode.time_cap_s)
                result = Result(case, ratio_vs=ratio_vs, target=None if target is None else f">= {target:,} rec/s")
                try:
                    rate, reps, counts = throughput_case(bus, acks, topic, run_once, reps_wanted, case)
                    result.records_per_s, result.ratio, result.reps = rate, rate / reference, reps
                    result.meets_target = None if target is None else rate >= target
                    result.extra = {"records_per_rep": counts, "payload_mb_per_s": rate * VALUE_SIZE / 1e6,
                                    "encoded_mb_per_s": rate * encoded_bytes / 1e6}
                except Exception as error:  # noqa: BLE001 (recorded; the other cases still run)
                    log(f"{case}: FAILED: {type(error).__name__}: {error}")
                    result.meets_target = False if target is not None else None
                    result.extra = {"error": f"{type(error).__name__}: {error}"}
                if trace.error_counts:
                    log(f"{case}: retried or failed batches: {trace.errors()}")
                    result.extra["batch_errors"] = dict(trace.error_counts)
                    result.extra["batch_error_samples"] = {n: m for n, (_, m) in trace.error_samples.items()}
                results.append(result)
                try:
                    producer.close(timeout_s=30)
                except Exception as error:  # noqa: BLE001
                    log(f"{case}: the producer did not close cleanly: {error!r}")

            # The ceiling of Ray's transport here: 1 MiB uint8 arrays (the size of the producer's batches) from the
            # driver to an actor on a replica node, 5 in flight, as the producer sends them; no logbus code at all.
            sink = Sink.options(resources={REPLICA_NODE_RESOURCE: 0.01}).remote()
            ray.get(sink.take.remote(np.zeros(8, np.uint8)), timeout=60)
            transport_mb_s, transport_reps = transport_ceiling(sink, mode.reps, mode.transport_s)
            ray.kill(sink)
            results.append(Result(
                "ref: Ray transport, 1 MiB arrays driver -> actor on a replica node, 5 in flight",
                transport_mb_s * 1e6 / encoded_bytes, reps=transport_reps,
                extra={"mb_per_s": transport_mb_s, "note": "records/s = MB/s / encoded bytes per record"}))
            for r in results:
                if r.case.startswith("produce send_table") and r.records_per_s:
                    r.extra["share_of_transport_ceiling"] = r.records_per_s / (transport_mb_s * 1e6 / encoded_bytes)
            log(f"Ray transport ceiling: {transport_mb_s:,.0f} MB/s = {transport_mb_s * 1e6 / encoded_bytes:,.0f} records/s "
                f"at {encoded_bytes:.1f} encoded bytes per record")

        # ---- 2. end-to-end latency, acks=all ---------------------------------------------------------
        if "latency" in phases:
            loads["latency"] = load_text()
            log(f"phase latency ({loads['latency']})")
            on_head = NodeAffinitySchedulingStrategy(node_id=head_id, soft=False)
            consumer_actor = LatencyConsumer.options(scheduling_strategy=on_head).remote(namespace, data_dir)
            producer_actor = None

            def latency_run(linger_ms: float, duration_s: float) -> tuple[np.ndarray, int, float, bool]:
                nonlocal producer_actor
                if producer_actor is None:
                    producer_actor = PacedProducer.options(scheduling_strategy=on_head).remote(namespace, data_dir)
                offset = log_end_offset(bus, topic)
                ray.get(consumer_actor.prepare_logbus.remote(topic, 0, offset), timeout=60)
                ref = consumer_actor.run_logbus.remote(int(LATENCY_RATE * duration_s), duration_s + mode.latency_grace_s + 0.2)
                time.sleep(0.2)
                options = {"acks": "all", "linger_ms": linger_ms}  # a new Producer for each run
                sent, send_s, flushed = ray.get(
                    producer_actor.run_logbus.remote(topic, LATENCY_RATE, duration_s, mode.latency_grace_s, options),
                    timeout=duration_s + 120)
                latencies = ray.get(ref, timeout=120)
                if not flushed:  # hopelessly backlogged: kill it (and its backlog) rather than wait
                    ray.kill(producer_actor)
                    producer_actor = None
                return latencies, sent, send_s, flushed

            for linger_ms in (0, 2):
                latency_run(2, 1.0)  # warm-up (linger_ms=2: a backlog-free warm-up of every path)
                lat_runs = []
                for rep in range(mode.latency_reps):
                    latencies, sent, send_s, flushed = latency_run(linger_ms, mode.latency_s)
                    p50, p99, mx = latency_percentiles_ms(latencies, sent)
                    if args.timeline:
                        sent_ns, received_ns = ray.get(consumer_actor.timeline.remote(), timeout=60)
                        os.makedirs(args.timeline, exist_ok=True)
                        np.savez(os.path.join(args.timeline, f"latency-linger{linger_ms:g}-rep{rep + 1}.npz"), sent_ns=sent_ns,
                                 received_ns=received_ns, monotonic_minus_wall_ns=time.monotonic_ns() - time.time_ns())
                    got50, got99, _ = latency_percentiles_ms(latencies, len(latencies))  # over the received records only
                    lat_runs.append((p99, p50, mx, len(latencies), sent, send_s, flushed, got50, got99))
                    log(f"latency acks=all linger_ms={linger_ms} @{LATENCY_RATE:,}/s rep {rep + 1}: {len(latencies):,}/{sent:,} received "
                        f"within {mode.latency_grace_s:g}s of the end of sending (sent in {send_s:.2f}s), "
                        f"p50 {fmt(p50)} ms, p99 {fmt(p99)} ms, max {fmt(mx, 1)} ms; over the received ones only: "
                        f"p50 {fmt(got50)} ms, p99 {fmt(got99)} ms  ({load_text()})")
                # The repetition with the lowest p99 (ties, e.g. both infinite: the one that delivered the most).
                p99, p50, mx, received, sent, send_s, flushed, got50, got99 = min(lat_runs, key=lambda r: (r[0], r[1], -r[3]))
                results.append(Result(
                    f"latency acks=all, linger_ms={linger_ms}, @ {LATENCY_RATE:,}/s" + ("" if linger_ms == 0 else " (info)"),
                    sent / send_s, p50=p50, p99=p99, max=mx, unit="ms", reps=[r[0] for r in lat_runs],
                    extra={"received": received, "sent": sent, "all_acknowledged_in_grace": flushed, "grace_s": mode.latency_grace_s,
                           "p50_per_rep": [r[1] for r in lat_runs], "received_only_p50_ms": got50, "received_only_p99_ms": got99}))

            # One record at a time, each awaited: the round trip of a single produce (info; the floor of the latency).
            for acks in (1, "all"):
                producer = Producer(bus, acks=acks, linger_ms=0)
                for _ in range(10):
                    producer.send(topic, stamped_value()).result(timeout=60)
                trips = []
                for _ in range(mode.round_trips):
                    t0 = time.perf_counter()
                    producer.send(topic, stamped_value()).result(timeout=60)
                    trips.append(time.perf_counter() - t0)
                producer.close()
                trips_ms = np.array(trips) * 1e3
                p50, p99 = float(np.percentile(trips_ms, 50)), float(np.percentile(trips_ms, 99))
                log(f"round trip of one record, acks={acks}: p50 {p50:.1f} ms, p99 {p99:.1f} ms over {len(trips)}  ({load_text()})")
                results.append(Result(f"round trip of one record (send + result()), acks={acks} (info)", p50=p50, p99=p99,
                                      max=float(trips_ms.max()), unit="ms", extra={"records": len(trips)}))
            if producer_actor is not None:
                ray.kill(producer_actor)
            ray.kill(consumer_actor)
            # The floor: the same hops as bare Ray actor calls, one value at a time (info).
            consumed_ms, acked_ms = ray_chain_floor(cluster, mode.round_trips)
            for label, values in (("send -> consumer", consumed_ms), ("send -> producer's reply", acked_ms)):
                p50, p99 = float(np.percentile(values, 50)), float(np.percentile(values, 99))
                log(f"ref: bare Ray actor chain, {label}: p50 {p50:.2f} ms, p99 {p99:.2f} ms over {len(values)}  ({load_text()})")
                results.append(Result(f"ref: bare Ray actor chain of the acks=all hops, one value at a time, {label} (info)",
                                      p50=p50, p99=p99, max=float(values.max()), unit="ms", extra={"values": len(values)}))
        if topic is not None:
            bus.admin.delete_topic(topic)

        # ---- 3. leader failover under a steady acks=all workload ---------------------------------------
        if "failover" in phases:
            loads["failover"] = load_text()
            log(f"phase failover: {kills} kills of the leader's node under {WORKLOAD_RATE:,} records/s acks=all ({loads['failover']})")
            topic = create_topic(bus, "failover")
            controller = controller_of(bus)
            controller_pid = ray.get(controller.ping.remote(), timeout=60)
            workload_bus = logbus.connect(data_dir=data_dir, namespace=namespace)  # its own Bus, traced
            workload = Workload(workload_bus, topic, WORKLOAD_RATE)
            kill_rows = []
            for k in range(kills):
                recover_t0 = time.monotonic()
                status = wait_for(lambda: isr_full(bus, topic), RECOVERY_TIMEOUT_S, 0.2, "ISR of 3")
                # Steady state: the workload is progressing and its producer is keeping up (at most
                # 300 ms of records unacknowledged), so that (b) measures the failover, not a backlog.
                # On an overloaded machine that may not come: then kill anyway and record the backlog.
                base = workload.acked
                wait_for(lambda: workload.acked > base + WORKLOAD_RATE // 5, RECOVERY_TIMEOUT_S, 0.05, "workload progress")
                try:
                    wait_for(lambda: workload.backlog <= STEADY_BACKLOG, mode.steady_timeout_s, 0.02, "no backlog")
                    steady = True
                except TimeoutError:
                    steady = False
                    log(f"kill {k + 1}: the workload's producer is not keeping up ({workload.backlog:,} records unacknowledged "
                        f"after {mode.steady_timeout_s:.0f}s); killing anyway")
                recovered_s = time.monotonic() - recover_t0
                status = leader_status(bus, topic) or status
                old_epoch = status["leader_epoch"]
                node = next((n for n in cluster.worker_nodes if n.node_id == status["node_id"]), None)
                if node is None:
                    raise RuntimeError(f"the leader's node {status['node_id']} is not a worker node of the cluster")
                pid = status["pid"]
                backlog_at_kill = workload.backlog
                _, old_handle = leader_now(bus, topic)
                old_leader_id = None if old_handle is None else old_handle._actor_id
                # The kill: freeze the leader process (every second kill, the node's agent first: the
                # whole node freezes), kill the node's raylet and agents, kill the frozen processes.
                whole_node = k % 2 == 1
                frozen = [pid]
                if whole_node:
                    agent = ray.get_actor(agent_actor_name(status["node_id"]), namespace=namespace)
                    frozen.insert(0, ray.get(agent.ping.remote(), timeout=30))
                start = time.monotonic()
                workload.mark(start)
                for frozen_pid in frozen:
                    os.kill(frozen_pid, signal.SIGSTOP)
                cluster.remove_node(node, allow_graceful=False)
                for frozen_pid in frozen:
                    try:
                        os.kill(frozen_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                removed_s = time.monotonic() - start
                elected_s = leader_s = None
                new_epoch = None
                deadline = start + FAILOVER_TIMEOUT_S
                while (leader_s is None or workload.first_ack_s is None) and time.monotonic() < deadline:
                    if leader_s is None:
                        try:
                            raw = ray.get(controller.topic_metadata.remote(topic), timeout=2)
                            epoch, handle = raw["partitions"][0]["leader_epoch"], raw["partitions"][0]["leader"]
                            if epoch > old_epoch and handle is not None:
                                if elected_s is None:
                                    elected_s = time.monotonic() - start
                                reply = ray.get(handle.status.remote(), timeout=2)
                                if reply.get("role") == "leader" and reply.get("leader_epoch") == epoch:
                                    leader_s = time.monotonic() - start
                                    new_epoch = epoch
                        except Exception:  # noqa: BLE001 (busy controller or a replica restarting: poll again)
                            pass
                    time.sleep(0.02)
                first_ack = workload.first_ack_s
                ack_s = None if first_ack is None else first_ack - start
                producer_steps = workload.trace.summary(start, start + FAILOVER_TIMEOUT_S, old_leader_id, old_epoch)
                try:
                    pid_now = ray.get(controller.ping.remote(), timeout=30)
                except Exception as error:  # noqa: BLE001
                    pid_now = repr(error)
                if pid_now != controller_pid:
                    log(f"kill {k + 1}: the controller restarted (pid {controller_pid} -> {pid_now})")
                    controller_pid = pid_now
                row = {"kill": k + 1, "whole_node": whole_node, "steady": steady, "backlog_at_kill": backlog_at_kill, "removed_s": removed_s, "elected_s": elected_s, "leader_s": leader_s, "first_ack_s": ack_s,
                       "old_epoch": old_epoch, "new_epoch": new_epoch, "probes": workload.probes, "waited_before_kill_s": recovered_s,
                       "producer": producer_steps}
                kill_rows.append(row)
                log(f"kill {k + 1}/{kills}: remove_node took {removed_s:.2f}s; controller elected at "
                    f"{fmt(elected_s) or 'n/a '}s, new leader (epoch {old_epoch}->{new_epoch}) at {fmt(leader_s) or 'n/a '}s, "
                    f"first ack at {fmt(ack_s) or 'n/a '}s; {workload.probes:,} records sent after the kill were watched; "
                    f"waited {recovered_s:.1f}s for ISR 3 and a steady workload before the kill  ({load_text()})")
                log(f"  producer after the kill: {producer_steps}")
                add_replica_node(cluster)
                if leader_s is None or ack_s is None:
                    log(f"kill {k + 1}: failover did not complete within {FAILOVER_TIMEOUT_S:.0f}s; stopping the kills")
                    try:
                        log(f"  controller: epoch/leader {leader_now(bus, topic)}; replicas: "
                            f"{ray.get(controller.replica_statuses.remote(topic), timeout=30)[0]}")
                    except Exception as error:  # noqa: BLE001
                        log(f"  no diagnostics: {error!r}")
                    break
            if kills:
                wait_for(lambda: isr_full(bus, topic), RECOVERY_TIMEOUT_S, 0.2, "ISR of 3 after the last kill")
            acked_seqs, acked_offsets = workload.finish()
            sent_total, failed, failures = workload.sent, workload.failed, workload.failures
            failed_seqs = np.array(workload.failed_seqs, np.int64)
            workload = None
            check = drain_and_check(bus, topic, acked_seqs, acked_offsets, failed_seqs)
            check.update(sent=sent_total, failed=failed)
            log(f"workload: {sent_total:,} sent, {check['acknowledged']:,} acknowledged, {failed:,} failed; drained {check['stored']:,} "
                f"(high watermark {check['high_watermark']:,}): lost {check['lost']}, at another offset {check['moved']}, "
                f"duplicates {check['duplicates']}, offsets contiguous {check['offsets_contiguous']}; "
                f"reported failed to the sender but stored anyway {check['failed_but_stored']}"
                + (f"; failures e.g. {failures[:2]}" if failures else ""))
            no_loss = check["lost"] == 0 and check["moved"] == 0 and check["duplicates"] == 0 and check["offsets_contiguous"]

            kinds = (("leader frozen first", False), ("whole node frozen", True))
            for (key, label), (kind, whole_node) in itertools.product(
                (("leader_s", "(a) new leader"), ("first_ack_s", "(b) first ack after kill")), kinds
            ):
                values = [r[key] for r in kill_rows if r["whole_node"] == whole_node]
                done = [v for v in values if v is not None]
                if not values:
                    continue
                p50 = statistics.median([v if v is not None else float("inf") for v in values])
                mx = max(done) if len(done) == len(values) else float("inf")
                results.append(Result(
                    f"failover {label}, {len(values)} leader-node kills, {kind}", p50=p50, max=mx, unit="s",
                    target=f"p50 <= {FAILOVER_P50_TARGET_S:g} s, max <= {FAILOVER_MAX_TARGET_S:g} s",
                    meets_target=bool(p50 <= FAILOVER_P50_TARGET_S and mx <= FAILOVER_MAX_TARGET_S),
                    reps=values, extra={"min": min(done) if done else None,
                                        "kills_without_steady_workload": sum(1 for r in kill_rows if not r["steady"])}))
            elected = [r["elected_s"] for r in kill_rows if r["elected_s"] is not None]
            if elected:
                results.append(Result("failover: controller metadata changed (info)", p50=statistics.median(elected), max=max(elected),
                                      unit="s", reps=elected))
            results.append(Result(
                "failover workload: acknowledged records lost", None, target="0 lost, 0 duplicates", meets_target=no_loss,
                extra={**check, "kills": kill_rows, "workload_rate": WORKLOAD_RATE}))
        loads["end"] = load_text()
    except BaseException:
        if workload is not None:
            workload.stop()
        raise
    finally:
        log("shutting down Ray and the cluster")
        try:
            shutdown_ray(cluster)
        finally:
            # A replica process can outlive its killed raylet for a moment and write again: retry.
            remove_dir(data_dir, attempts=5)

    wall = run.finish()
    print_results(results)
    log(f"done in {wall:.0f}s; throughput: best of {mode.reps} repetitions (send(): {mode.send_reps}); latency: lowest p99 of "
        f"{mode.latency_reps}. Machine shared with other test runs; loads: " + "; ".join(f"{k}: {v}" for k, v in loads.items()))
    for r in results:
        line = {"bench": "replication", "case": r.case, "records_per_s": None if r.records_per_s is None else round(r.records_per_s)}
        if r.unit:
            line.update({f"p50_{r.unit}": rounded(r.p50), f"p99_{r.unit}": rounded(r.p99), f"max_{r.unit}": rounded(r.max)})
        line.update({"ratio_vs": r.ratio_vs, "ratio": None if r.ratio is None else round(r.ratio, 3), "target": r.target,
                     "meets_target": r.meets_target, "reps": rounded(r.reps), "quick": run.quick, "date": run.date})
        line.update(rounded(r.extra))
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
