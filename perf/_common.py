"""What the benchmarks in perf/ share: set-up and clean-up, output, timing, test data, and the baselines.

Every ``perf/bench_*.py`` imports this module as ``_common`` (perf/ is the script's
directory, so it is on ``sys.path``; Ray puts it on its workers' path too). Importing it
puts the repository root first on ``sys.path``, so a benchmark measures the logbus of the
tree it lives in. The pieces:

- Ray: a private local Ray (``start_local_ray``), SIGTERM turned into a clean exit
  (``exit_on_sigterm``), and the best-effort clean-up every benchmark does in its
  ``finally``: ``kill_actors``, ``delete_topics``, ``shutdown_ray`` (also of a
  ``ray.cluster_utils.Cluster``) and ``remove_dir``.
- Output: timestamped progress lines (``log``), aligned tables (``print_table``,
  ``fmt``, ``fmt_rate``), the rounding of figures in the JSON lines (``json_value``,
  ``round_fixed``) and what every line says about the run (``RunInfo``: quick or full,
  date, load average at the start and end; the machine is shared).
- Timing and statistics: ``timed``, ``timed_loop`` / ``measure`` (best-of-N micro
  loops, with page faults), ``best_and_median``, ``best_rate``, ``wait_for`` and
  ``latency_percentiles_ms`` (a record never received counts as infinitely late).
- Data: 100-byte random values (``make_pool``, ``split_values``), tables for
  ``send_table`` (``make_table``), and values that carry their send time
  (``stamped_value``, read back with ``first_int64``).
- logbus load: ``produce_send`` / ``produce_tables`` (a timed produce repetition;
  ``produce_rounds`` times any round of sends), ``paced_send`` and the two ends of a
  latency stream, ``PacedProducer`` and ``LatencyConsumer`` (logbus or Redis).
- Same-run baselines: a private ``RedisServer`` (a child process, always stopped) with
  ``redis_produce`` / ``redis_consume``; ``ray.util.queue`` (``queue_round``); Ray's own
  transport of 1 MiB arrays to an actor (``Sink``, ``transport_ceiling``).

The actors and the task here reserve no CPU (``num_cpus=0``), like logbus's own actors and
the benchmarks' other actors: Ray's CPU slots never decide whether one of them can start.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import ray

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the logbus of this tree, not an installed one

import logbus  # noqa: E402
from logbus import Consumer, Producer, TopicPartition  # noqa: E402

VALUE_SIZE = 100  # bytes per record value, in every benchmark
TABLE_ROWS = 10_000  # rows per send_table() call
LATENCY_POLL_MS = 5  # the latency consumer's poll timeout
REDIS_PIPELINE = 1_000  # XADDs per pipeline in the Redis produce baseline
REDIS_READ_COUNT = 1_000  # COUNT of each XREADGROUP
QUEUE_BATCH = 1_000  # values per put() in the ray.util.queue baseline


# --- command line and run ------------------------------------------------------------------------


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of the benchmark's docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def new_namespace(prefix: str) -> str:
    """A Ray namespace of its own for one run (never shared with another run on this machine)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class RunInfo:
    """Facts about one run for its JSON lines: quick or full, the date, and the 1-minute load average
    at the start and at the end (other work on this shared machine moves every figure)."""

    quick: bool
    wall_start: float = field(default_factory=time.perf_counter)
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    load_end: tuple[float, float, float] | None = None
    date: str = ""

    def finish(self) -> float:
        """Note the load average and the date at the end; returns the run's wall time in seconds."""
        self.load_end = os.getloadavg()
        self.date = datetime.date.today().isoformat()
        return time.perf_counter() - self.wall_start

    @property
    def loadavg_start(self) -> float:
        return round(self.load_start[0], 1)

    @property
    def loadavg_end(self) -> float | None:
        return None if self.load_end is None else round(self.load_end[0], 1)


# --- Ray: start and clean-up -----------------------------------------------------------------------


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that the benchmark's ``finally`` clean-up runs."""

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def start_local_ray(namespace: str | None = None, object_store_memory: int = 2 << 30, attempts: int = 2) -> None:
    """A private local Ray with 4 CPUs and no dashboard (``address="local"``: never join another
    cluster running on this machine); workers' output stays out of the benchmark's."""
    for attempt in range(1, attempts + 1):  # on an overloaded machine the local Ray can time out while starting
        try:
            ray.init(
                address="local", num_cpus=4, include_dashboard=False, namespace=namespace,
                object_store_memory=object_store_memory, log_to_driver=False,
            )
            return
        except Exception as error:  # noqa: BLE001 (Ray raises a bare Exception for a startup timeout)
            if attempt == attempts:
                raise
            log(f"ray.init failed ({error}); retrying once in 5 s")
            ray.shutdown()
            time.sleep(5)


def kill_actors(actors) -> None:
    """ray.kill each actor; one already dead (a killed victim) is fine."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 (already dead)
            pass


def delete_topics(bus, topics) -> None:
    """Delete the topics (their replica actors and files), best effort: the whole Ray is stopped next."""
    if bus is None or not ray.is_initialized():
        return
    for name in list(topics):
        try:
            bus.admin.delete_topic(name)
        except Exception as error:  # noqa: BLE001 (best effort)
            log(f"could not delete topic {name}: {error}")


def shutdown_ray(cluster=None) -> None:
    """Disconnect from Ray, then stop its processes: the local Ray, or every node of ``cluster``."""
    if ray.is_initialized():
        ray.shutdown()
    if cluster is None:
        return
    try:
        cluster.shutdown()
    except ValueError:  # a stray thread re-attached to the cluster: detach and retry
        ray.shutdown()
        cluster.shutdown()


def remove_dir(path: str, attempts: int = 1) -> None:
    """rmtree, retried (1 s apart) while something still writes there (a replica outliving its raylet)."""
    for attempt in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        if attempt + 1 < attempts:
            time.sleep(1)


def end_spark_run(root: str) -> None:
    """A Spark benchmark's cleanup, also after an error: stop the Spark session (if any), Ray, and
    remove the run's data directory."""
    try:
        import logbus.spark

        logbus.spark.stop_spark()
    except Exception:  # noqa: BLE001 (best-effort cleanup)
        pass
    shutdown_ray()
    remove_dir(root)


# --- output ----------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_text() -> str:
    return "load avg " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def fmt_rate(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value / 1e6:.2f} M" if value >= 1e6 else f"{value / 1e3:,.0f} k"


def fmt(value: float | None, digits: int = 2, inf: str = "inf") -> str:
    """A number for a table cell: empty for None or NaN, ``inf`` for infinity."""
    if value is None or value != value:
        return ""
    return inf if value == float("inf") else f"{value:,.{digits}f}"


def print_table(headers: tuple[str, ...], rows: list[tuple]) -> None:
    """Left-aligned columns, as wide as their widest cell, between blank lines."""
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print()


def json_value(value, digits: int = 3, non_finite_as_text: bool = False):
    """A figure for a JSON line: a float of 1,000 or more becomes a whole number, a smaller one keeps
    ``digits`` decimals; lists and dicts are rounded inside. NaN and infinity become null, or
    "nan" / "inf" with ``non_finite_as_text`` (a lost record's latency is infinite)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, float | np.floating):
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            return str(value) if non_finite_as_text else None
        return round(value) if abs(value) >= 1000 else round(value, digits)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, list):
        return [json_value(v, digits, non_finite_as_text) for v in value]
    if isinstance(value, dict):
        return {k: json_value(v, digits, non_finite_as_text) for k, v in value.items()}
    return value


def round_fixed(value, digits: int = 0):
    """``value`` with a fixed number of decimals (0: an int); None stays None."""
    if value is None:
        return None
    return round(value, digits) if digits else int(round(value))


# --- timing and statistics -------------------------------------------------------------------------


def timed(fn):
    """(seconds, result) of one call of ``fn``."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def timed_loop(fn, min_seconds: float) -> tuple[float, int]:
    """(seconds per call, calls) of ``fn``, called until ``min_seconds`` have passed (at least once)."""
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls, calls


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(fn, reps: int, min_seconds: float) -> tuple[list[float], float]:
    """Seconds per call of ``fn`` in each of ``reps`` timed loops (after one unmeasured warm-up
    loop), and the minor page faults per call over the measured loops.

    The warm-up matters on this VM: the first touch of freshly allocated memory is slow,
    and the allocator's pools only settle after a few large allocations.
    """
    timed_loop(fn, min_seconds)
    faults_before = minor_faults()
    samples, total_calls = [], 0
    for _ in range(reps):
        per_call, calls = timed_loop(fn, min_seconds)
        samples.append(per_call)
        total_calls += calls
    return samples, (minor_faults() - faults_before) / total_calls


def best_and_median(samples: list[float]) -> tuple[float, float]:
    """Samples are seconds per unit of work: best = smallest."""
    return min(samples), statistics.median(samples)


def best_rate(runs: list[tuple[int, float]]) -> tuple[float, list[float]]:
    """(highest rate, every rate) of (count, seconds) repetitions."""
    rates = [count / seconds for count, seconds in runs]
    return max(rates), rates


def wait_for(condition, timeout_s: float, interval_s: float = 0.1, message: str = "condition"):
    """Poll ``condition()`` until it returns something true (returned) or ``timeout_s`` passes (TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {message}")
        time.sleep(interval_s)


def latency_percentiles_ms(latencies_ns: np.ndarray, sent: int) -> tuple[float, float, float]:
    """p50, p99 and max in ms over every record sent; a record never received counts as infinitely late."""
    if sent == 0:
        return float("nan"), float("nan"), float("nan")
    ordered = np.sort(latencies_ns.astype(np.float64) / 1e6)

    def at(q: float) -> float:
        rank = max(0, int(np.ceil(q * sent)) - 1)
        return float(ordered[rank]) if rank < len(ordered) else float("inf")

    return at(0.50), at(0.99), (float(ordered[-1]) if len(ordered) >= sent else float("inf"))


# --- data ------------------------------------------------------------------------------------------

PAD = b"\x00" * (VALUE_SIZE - 8)


def split_values(raw: bytes, size: int = VALUE_SIZE) -> list[bytes]:
    """``raw`` cut into values of ``size`` bytes."""
    return [raw[i * size : (i + 1) * size] for i in range(len(raw) // size)]


def make_pool(count: int, seed: int = 7) -> list[bytes]:
    """``count`` random (incompressible) values of VALUE_SIZE bytes."""
    return split_values(np.random.default_rng(seed).integers(0, 256, count * VALUE_SIZE, dtype=np.uint8).tobytes())


def make_table(pool: list[bytes], partition: int | None = None) -> pa.Table:
    """TABLE_ROWS values of the pool as a table for ``send_table`` (all to ``partition`` if given)."""
    columns = {"value": pa.array(pool[:TABLE_ROWS], pa.binary())}
    if partition is not None:
        columns["partition"] = pa.array(np.full(TABLE_ROWS, partition, np.int32))
    return pa.table(columns)


def stamped_value() -> bytes:
    """A value whose first 8 bytes are its send time (``time.time_ns()``, one clock for the whole machine)."""
    return struct.pack("<q", time.time_ns()) + PAD


def first_int64(values) -> np.ndarray:
    """The little-endian int64 in the first 8 bytes of each value of a binary Arrow array (no per-row Python)."""
    if isinstance(values, pa.ChunkedArray):
        parts = [first_int64(chunk) for chunk in values.chunks]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)
    count = len(values)
    if count == 0:
        return np.empty(0, np.int64)
    _, offsets_buffer, data_buffer = values.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32)[values.offset : values.offset + count]
    data = np.frombuffer(data_buffer, np.uint8)
    index = offsets[:, None].astype(np.int64) + np.arange(8)
    return np.ascontiguousarray(data[index]).view("<i8").ravel()


# --- logbus load: produce --------------------------------------------------------------------------


class Sent(NamedTuple):
    """One produce repetition: from the first send to the end of ``flush()``."""

    records: int
    start: float  # time.time() (comparable across processes)
    end: float  # time.time()
    seconds: float  # perf_counter between the two


def produce_rounds(producer, send_round, round_size: int, n: int, time_cap_s: float) -> Sent:
    """``send_round()`` (which sends ``round_size`` records) until ``n`` records or ``time_cap_s``; then
    flush. The caller checks what it sent."""
    sent = 0
    start_wall = time.time()
    start = time.perf_counter()
    deadline = start + time_cap_s
    while sent < n:
        send_round()
        sent += round_size
        if time.perf_counter() > deadline:
            break
    producer.flush()
    seconds = time.perf_counter() - start
    return Sent(sent, start_wall, time.time(), seconds)


def produce_send(producer, topic: str, pool: list[bytes], n: int, time_cap_s: float, partition: int | None = None) -> Sent:
    """send() per record, cycling through ``pool``, until ``n`` records or ``time_cap_s``; then flush.
    Raises if the last record failed."""
    send = producer.send
    last = [None]

    def send_round() -> None:
        if partition is None:
            for value in pool:
                last[0] = send(topic, value)
        else:
            for value in pool:
                last[0] = send(topic, value, partition=partition)

    sent = produce_rounds(producer, send_round, len(pool), n, time_cap_s)
    last[0].result()
    return sent


def produce_tables(producer, topic: str, table: pa.Table, n: int, time_cap_s: float) -> Sent:
    """send_table() of the same pre-built table until ``n`` records or ``time_cap_s``; then flush.
    Raises if any batch failed."""
    futures = []
    sent = 0
    start_wall = time.time()
    start = time.perf_counter()
    deadline = start + time_cap_s
    while sent < n:
        futures.append(producer.send_table(topic, table))
        sent += table.num_rows
        if time.perf_counter() > deadline:
            break
    producer.flush()
    seconds = time.perf_counter() - start
    end_wall = time.time()
    for future in futures:
        future.result()
    return Sent(sent, start_wall, end_wall, seconds)


def high_watermarks(bus, topic: str) -> list[int]:
    return [p.high_watermark for p in bus.admin.describe_topic(topic).partitions]


def consume_all(bus, topic: str, partitions: int, time_cap_s: float) -> tuple[int, float]:
    """Read the whole topic from the start with poll_arrow; returns (records, seconds)."""
    expected = sum(high_watermarks(bus, topic))
    consumer = Consumer(bus)
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        consumer.seek_to_beginning()
        got = 0
        start = time.perf_counter()
        deadline = start + time_cap_s
        while got < expected and time.perf_counter() < deadline:
            got += consumer.poll_arrow(timeout_ms=1000).num_rows
        elapsed = time.perf_counter() - start
    finally:
        consumer.close()
    return got, elapsed


# --- logbus load: a paced latency stream -----------------------------------------------------------


def paced_send(send_one, rate: int, duration_s: float, on_tick=None) -> tuple[int, float]:
    """Call ``send_one()`` at ``rate`` per second for ``duration_s`` (catching up in small bursts every ~0.5 ms;
    ``on_tick()`` after each burst). Returns (records sent, seconds the sending took)."""
    total = int(rate * duration_s)
    sent = 0
    start = time.perf_counter()
    while sent < total:
        due = min(total, int((time.perf_counter() - start) * rate) + 1)
        while sent < due:
            send_one()
            sent += 1
        if on_tick is not None:
            on_tick()
        time.sleep(0.0005)
    return sent, time.perf_counter() - start


def _connect(namespace: str | None, data_dir: str | None):
    return logbus.connect(data_dir=data_dir, namespace=namespace) if namespace else None


def _redis_client(port: int | None):
    if port is None:
        return None
    import redis

    return redis.Redis(host="127.0.0.1", port=port)


@ray.remote(num_cpus=0)
class PacedProducer:
    """Sends stamped records at a fixed rate, to logbus or Redis; in its own process, so that a hopelessly
    backlogged producer can simply be killed, backlog and all."""

    def __init__(self, namespace: str | None = None, data_dir: str | None = None, redis_port: int | None = None) -> None:
        self.bus = _connect(namespace, data_dir)
        self.redis = _redis_client(redis_port)
        self.producer = None

    def warm_up_logbus(self, topic: str, rate: int, options: dict, records: int) -> int:
        """Create the producer that the next ``run_logbus`` uses and send ``records`` at ``rate`` with it
        (its first-use costs, producer id, metadata and first encode, stay out of the timed run)."""
        self.producer = Producer(self.bus, **options)
        paced_send(lambda: self.producer.send(topic, stamped_value()), rate, records / rate)
        self.producer.flush(timeout_s=60)
        return records

    def run_logbus(self, topic: str, rate: int, duration_s: float, flush_timeout_s: float,
                   options: dict | None = None) -> tuple[int, float, bool]:
        """A paced stream, then flush; (records sent, seconds of sending, flushed in time). ``options``:
        the settings of a Producer created in this call; None: the warm producer of ``warm_up_logbus``."""
        producer = self.producer if options is None else Producer(self.bus, **options)
        sent, send_s = paced_send(lambda: producer.send(topic, stamped_value()), rate, duration_s)
        try:
            producer.flush(timeout_s=flush_timeout_s)
        except logbus.errors.RequestTimedOutError:
            return sent, send_s, False  # the caller kills this actor, and the backlog with it
        producer.close()
        return sent, send_s, True

    def run_redis(self, stream: str, rate: int, duration_s: float) -> tuple[int, float, bool]:
        """XADD each record as it falls due; the records due at one tick (~0.5 ms) share one pipeline
        (one round trip per record cannot keep up with 10,000/s from Python on this machine)."""
        pipe = self.redis.pipeline(transaction=False)
        sent, send_s = paced_send(lambda: pipe.xadd(stream, {"v": stamped_value()}), rate, duration_s, on_tick=pipe.execute)
        return sent, send_s, True


@ray.remote(num_cpus=0)
class LatencyConsumer:
    """Polls a partition (logbus) or a stream (Redis) and records send->poll latency per record, in ns."""

    def __init__(self, namespace: str | None = None, data_dir: str | None = None, redis_port: int | None = None) -> None:
        self.bus = _connect(namespace, data_dir)
        self.redis = _redis_client(redis_port)
        self.consumer = None
        self._timeline = (np.empty(0, np.int64),) * 2

    def prepare_logbus(self, topic: str, partition: int, offset: int, options: dict | None = None) -> bool:
        if self.consumer is not None:
            self.consumer.close()
        self.consumer = Consumer(self.bus, **(options or {}))
        self.consumer.assign([TopicPartition(topic, partition)])
        self.consumer.seek(TopicPartition(topic, partition), offset)
        self.consumer.poll_arrow(timeout_ms=0)  # the first fetch is now in flight
        return True

    def warm_up_logbus(self, expected: int, timeout_s: float) -> int:
        """Consume the producer's warm-up records (first-use costs of the fetch and decode path)."""
        got, deadline = 0, time.monotonic() + timeout_s
        while got < expected and time.monotonic() < deadline:
            got += self.consumer.poll_arrow(timeout_ms=LATENCY_POLL_MS).num_rows
        return got

    def run_logbus(self, expected: int, timeout_s: float) -> np.ndarray:
        """Each record's latency in ns, in the order received; ``timeline()`` then has its send and receipt times."""
        stamps, receipts = [], []
        got = 0
        deadline = time.monotonic() + timeout_s
        poll = self.consumer.poll_arrow
        while got < expected and time.monotonic() < deadline:
            table = poll(timeout_ms=LATENCY_POLL_MS)
            now = time.time_ns()
            if table.num_rows:
                stamps.append(first_int64(table.column("value")))
                receipts.append(np.full(table.num_rows, now, np.int64))
                got += table.num_rows
        self._timeline = (np.concatenate(stamps), np.concatenate(receipts)) if stamps else (np.empty(0, np.int64),) * 2
        return self._timeline[1] - self._timeline[0]

    def timeline(self) -> tuple[np.ndarray, np.ndarray]:
        """The last ``run_logbus``'s send times and receipt times (``time.time_ns()``), one per record received."""
        return self._timeline

    def prepare_redis(self, stream: str, group: str) -> bool:
        self.redis.xgroup_create(stream, group, id="$", mkstream=True)
        return True

    def run_redis(self, stream: str, group: str, expected: int, timeout_s: float) -> np.ndarray:
        out = []
        got = 0
        deadline = time.monotonic() + timeout_s
        while got < expected and time.monotonic() < deadline:
            reply = self.redis.xreadgroup(group, "c1", {stream: ">"}, count=REDIS_READ_COUNT, block=LATENCY_POLL_MS)
            now = time.time_ns()
            for _, entries in reply:
                stamps = np.fromiter((struct.unpack_from("<q", fields[b"v"])[0] for _, fields in entries), np.int64, len(entries))
                out.append(now - stamps)
                got += len(entries)
        return np.concatenate(out) if out else np.empty(0, np.int64)


# --- baseline: Redis Streams -----------------------------------------------------------------------


class RedisUnavailable(Exception):
    pass


def ensure_redis_server() -> str:
    """The path of redis-server; installs Debian's package when running as root with apt-get."""
    path = shutil.which("redis-server")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        log("redis-server not found; installing Debian's redis-server with apt-get (running as root)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        done = subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], env=env, capture_output=True)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], env=env, capture_output=True)
        path = shutil.which("redis-server")
        if path:
            return path
    raise RedisUnavailable("redis-server is not installed: run `sudo apt-get install -y redis-server`, or pass --skip-redis")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a free loopback port, with its own temp dir (``--appendonly yes
    --appendfsync everysec --save ''``); stop() is idempotent and also runs at exit."""

    def __init__(self) -> None:
        import redis

        binary = ensure_redis_server()
        self.dir = tempfile.mkdtemp(prefix="logbus-bench-redis-")
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log"),
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        atexit.register(self.stop)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RedisUnavailable("redis-server did not start") from None
                time.sleep(0.05)
        self.version = self.client.info("server")["redis_version"]

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            try:
                self.client.shutdown(nosave=True)
            except Exception:  # noqa: BLE001 (shutdown closes the connection; it may also fail)
                pass
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_produce(client, stream: str, pool: list[bytes], n: int, time_cap_s: float) -> tuple[int, float]:
    """XADD pipelined REDIS_PIPELINE at a time; returns (records, seconds)."""
    sent = 0
    chunks = [pool[i : i + REDIS_PIPELINE] for i in range(0, len(pool), REDIS_PIPELINE)]
    start = time.perf_counter()
    deadline = start + time_cap_s
    while sent < n:
        for chunk in chunks:
            pipe = client.pipeline(transaction=False)
            for value in chunk:
                pipe.xadd(stream, {"v": value})
            pipe.execute()
            sent += len(chunk)
        if time.perf_counter() > deadline:
            break
    return sent, time.perf_counter() - start


def redis_consume(client, stream: str, group: str, time_cap_s: float) -> tuple[int, float]:
    """XREADGROUP COUNT REDIS_READ_COUNT from the start of the stream to its end; returns (records, seconds)."""
    expected = client.xlen(stream)
    client.xgroup_create(stream, group, id="0")
    got = 0
    start = time.perf_counter()
    deadline = start + time_cap_s
    while got < expected and time.perf_counter() < deadline:
        reply = client.xreadgroup(group, "c1", {stream: ">"}, count=REDIS_READ_COUNT)
        if not reply:
            break
        for _, entries in reply:
            got += len(entries)
    return got, time.perf_counter() - start


# --- baseline: plain Ray ---------------------------------------------------------------------------


@ray.remote(num_cpus=0)
def drain_queue(queue, batches: int) -> tuple[int, float]:
    """Get ``batches`` lists from ``queue``; (values got, time.time() at the end)."""
    got = 0
    for _ in range(batches):
        got += len(queue.get())
    return got, time.time()


def queue_round(queue, batch: list, batches: int) -> tuple[int, float]:
    """The driver puts ``batch`` ``batches`` times into a ``ray.util.queue.Queue`` while a Ray task gets
    them; (values, seconds from the first put to the last get)."""
    start = time.time()
    ref = drain_queue.remote(queue, batches)
    for _ in range(batches):
        queue.put(batch)
    got, end = ray.get(ref)
    return got, end - start


@ray.remote(num_cpus=0)
class Sink:
    """Takes arrays and does nothing with them: the far end of Ray's own transport."""

    def take(self, array) -> int:
        return len(array)


def transport_ceiling(sink, reps: int, seconds: float) -> tuple[float, list[float]]:
    """MB/s of 1 MiB arrays sent to the ``sink`` actor with 5 calls in flight (best of ``reps`` runs of
    ``seconds``, after a warm-up)."""
    array = np.frombuffer(np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes(), np.uint8)

    def once(duration_s: float) -> float:
        refs: deque = deque()
        sent = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s:
            if len(refs) >= 5:
                ray.get(refs.popleft())
            refs.append(sink.take.remote(array))
            sent += 1
        ray.get(list(refs))
        return sent * len(array) / 1e6 / (time.perf_counter() - start)

    once(0.5)
    rates = [once(seconds) for _ in range(reps)]
    return max(rates), rates
