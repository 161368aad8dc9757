#!/usr/bin/env python
"""Consumer-group benchmarks: rebalance times (clean join, clean leave, member death) and group consume throughput.

Run with ``./dev bench groups`` (= ``.venv/bin/python perf/bench_groups.py``).
``--quick`` makes a short smoke run (< 90 s); ``--records N`` sets the topic's size.

Everything runs on this machine: a private embedded Ray
(``ray.init(address="local", num_cpus=4, include_dashboard=False)``), a fresh temp
``data_dir`` and a unique namespace, all removed at the end (also on errors and on
SIGTERM). One topic with 6 partitions holds N 100-byte random records (1.2 M; 200 k
with --quick), produced with ``send_table`` before anything is measured.

Every group member is a ``Consumer`` in a Ray actor (its own process) whose thread
polls in a loop (``poll_arrow(timeout_ms=100)``) and records, with
``time.monotonic()`` (one system-wide clock on Linux, so comparable across
processes), each change of its (generation, assignment). Members use the range
strategy (eager), session_timeout_ms=3000, heartbeat_interval_ms=1000 (Kafka's
ratio: a third of the session) unless said otherwise, and no auto-commit.

1. join / leave  Two members own the 6 partitions; a third subscribes (t0: just before
                 its ``subscribe()``), and later leaves with ``close()`` (t0: just before
                 ``close()``). Rebalance time = from t0 until the last member of the new
                 generation has returned from the ``poll()`` that gave it its assignment
                 (the generation in which the members' assignments cover all 6 partitions).
                 During these rounds members sit at the log end (auto_offset_reset
                 "latest"), so the figure is the protocol's, not a consume backlog's.
                 Repeated; p50 and max. The same with heartbeat_interval_ms=300 as (info).
2. death         Three members; one member actor's process gets SIGKILL (t0: just before
                 ``os.kill``). Time until the two survivors own all 6 partitions in a new
                 generation; also given as (time - session timeout). The session runs from
                 the dead member's last heartbeat, up to one heartbeat interval before the
                 kill, so the time can be below the session timeout (by up to 1 s here).
                 The same with heartbeat_interval_ms=300 as (info).

Each rebalance time is also split (printed under the table) into "until the last member
started rejoining" (its first ``GroupMembership.join()`` call, noted by a wrapper in the
member's process: when its heartbeat told it to rejoin, plus up to one poll) and "the join
round after that". The JSON lines also give, per long-lived member and phase, how its
heartbeat thread learned of the rebalances (``heartbeat_notices``: "woken" = a held
heartbeat answered when the group changed; "at once" = a heartbeat that found the group
already rebalancing when it arrived). During phases 1-2 a driver thread also measures the controller's round
trip (``ping``) and a 1 KiB write + fsync in the data dir every 50 ms (info rows).
3. throughput    3 members (actors) subscribe to the topic with a fresh group id and wait
                 until the group is stable; then, on a signal, each seeks its partitions
                 to the beginning and loops ``poll_arrow(timeout_ms=200)`` + ``commit()``
                 (synchronous, after every non-empty poll) until its partitions are read
                 to the end. records/s = N / (last member done - first member started).
                 Compared with one consumer doing the same: a group of one member (an
                 actor too), which owns all 6 partitions. (info) rows: 3 members without
                 commits; one consumer without a group (``assign()``), no commits.

Targets: clean join/leave rebalance <= 1 s; after a death <= session timeout + 1 s.
This machine is shared (2 cores, other engineers' runs): every figure is repeated, and the
load average at the start and end is printed. The last lines of output are one JSON object
per result ({"bench": "groups", ...}).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

import ray

# First: it puts this tree's logbus on sys.path.
from _common import (
    TABLE_ROWS,
    VALUE_SIZE,
    RunInfo,
    arg_parser,
    delete_topics,
    exit_on_sigterm,
    fmt_rate,
    json_value,
    kill_actors,
    log,
    make_pool,
    make_table,
    new_namespace,
    print_table,
    remove_dir,
    shutdown_ray,
    start_local_ray,
)

import logbus
from logbus import Consumer, Producer, TopicPartition

PARTITIONS = 6
SESSION_TIMEOUT_MS = 3000
HEARTBEAT_MS = 1000
FAST_HEARTBEAT_MS = 300
MEMBER_POLL_MS = 100
CLEAN_TARGET_S = 1.0
DEATH_MARGIN_S = 1.0
SETTLE_TIMEOUT_S = 30.0


@dataclass
class Mode:
    records: int
    join_leave_reps: int
    fast_reps: int
    death_reps: int
    fast_death_reps: int
    tput_reps: int
    phase_budget_s: float  # a phase starts no new repetition after this long (it always runs one)


FULL = Mode(records=1_200_000, join_leave_reps=7, fast_reps=5, death_reps=5, fast_death_reps=3, tput_reps=7, phase_budget_s=45)
QUICK = Mode(records=200_000, join_leave_reps=3, fast_reps=2, death_reps=2, fast_death_reps=1, tput_reps=2, phase_budget_s=12)


@dataclass
class Result:
    case: str
    unit: str  # "s" or "records/s"
    values: list = field(default_factory=list)  # one per repetition
    target: str | None = None
    meets_target: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def p50(self):
        return statistics.median(self.values) if self.values else None

    @property
    def max(self):
        return max(self.values) if self.values else None

    @property
    def best(self):
        if not self.values:
            return None
        return min(self.values) if self.unit in ("s", "ms") else max(self.values)


# --- a group member in its own process ---------------------------------------------------------------

JOIN_CALLS: list[float] = []  # in a member's process: when each GroupMembership.join() call started


def _record_join_calls() -> None:
    """Wrap GroupMembership.join (in this process) to note when a member starts (re)joining."""
    from logbus.api import group_membership

    original = group_membership.GroupMembership.join
    if getattr(original, "_bench_wrapped", False):
        return

    def join(self, owned, deadline_s):
        JOIN_CALLS.append(time.monotonic())
        return original(self, owned, deadline_s)

    join._bench_wrapped = True
    group_membership.GroupMembership.join = join


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)
class Member:
    """A Consumer driven by a thread of this actor; other calls read what it recorded or steer it."""

    def __init__(self, namespace: str, data_dir: str) -> None:
        self.bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._go = threading.Event()
        self._events: list = []
        self._info: dict = {}
        self._lock = threading.Lock()
        self._consumer = None
        _record_join_calls()

    def pid(self) -> int:
        return os.getpid()

    def events(self) -> list:
        with self._lock:
            return list(self._events)

    def info(self) -> dict:
        with self._lock:
            return dict(self._info)

    def first_join_call(self, since: float) -> float | None:
        """When this member's consumer first called join() at or after ``since`` (it had learned of a rebalance)."""
        return next((t for t in list(JOIN_CALLS) if t >= since), None)

    def go(self) -> None:
        self._go.set()

    def notices(self) -> dict:
        """How this member's heartbeat thread learned of rebalances: {"woken": n, "at once": m}."""
        membership = getattr(self._consumer, "_membership", None)
        return dict(membership.notices) if membership is not None else {}

    def debug(self) -> dict:
        """The member side's view of the group (for a report when a group does not settle)."""
        consumer = self._consumer
        membership = getattr(consumer, "_membership", None)
        if membership is None:
            return {"membership": None}
        fields = ("member_id", "generation", "needs_join", "coordinator_ok", "lost", "revoke_requested", "_unreachable_since")
        view = {name: getattr(membership, name, None) for name in fields}
        view["now"] = time.monotonic()
        view["assignment"] = sorted(tp.partition for tp in consumer.assignment())
        return view

    def start(self, topic: str, group_id: str | None, options: dict, consume: dict | None = None) -> None:
        """Run a consumer in a thread. ``consume``: None (only follow the group) or
        {"ends": {partition: end}, "commit": bool, "assign": bool} to read to the end after go()."""
        self.stop()
        self._stop.clear()
        self._go.clear()
        with self._lock:
            self._events, self._info = [], {}
        JOIN_CALLS.clear()
        self._thread = threading.Thread(target=self._run, args=(topic, group_id, options, consume), daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """Stop the thread; its consumer closes (a member leaves the group). Returns the recorded info."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(60)
            self._thread = None
        return self.info()

    def _record(self, consumer, last):
        membership = consumer._membership  # the generation is not public; a benchmark may peek
        generation = membership.generation if membership is not None else -1
        state = (generation, tuple(sorted(tp.partition for tp in consumer.assignment())))
        if state != last:
            with self._lock:
                self._events.append((time.monotonic(), *state))
        return state

    def _run(self, topic, group_id, options, consume) -> None:
        info = self._info
        try:
            consumer = self._consumer = Consumer(self.bus, group_id=group_id, auto_offset_reset="latest", enable_auto_commit=False, **options)
            try:
                if consume is not None and consume.get("assign"):
                    consumer.assign([TopicPartition(topic, p) for p in consume["ends"]])
                else:
                    info["subscribe_t"] = time.monotonic()
                    consumer.subscribe([topic])
                last = None
                while not self._stop.is_set() and not (consume is not None and self._go.is_set()):
                    consumer.poll_arrow(timeout_ms=MEMBER_POLL_MS)
                    last = self._record(consumer, last)
                if consume is not None and not self._stop.is_set():
                    self._consume(consumer, topic, consume, last)
                while not self._stop.is_set():  # stay a member (idle) until told to stop
                    consumer.poll_arrow(timeout_ms=MEMBER_POLL_MS)
                    last = self._record(consumer, last)
            finally:
                info["close_t"] = time.monotonic()
                consumer.close()
                info["closed_t"] = time.monotonic()
        except Exception:  # noqa: BLE001 (reported to the driver)
            info["error"] = traceback.format_exc()

    def _consume(self, consumer, topic, consume, last) -> None:
        info = self._info
        ends = {TopicPartition(topic, int(p)): int(e) for p, e in consume["ends"].items()}
        generation = last[0] if last else -1
        info["start_t"] = time.monotonic()
        consumer.seek_to_beginning()
        count = commits = commit_errors = 0
        commit_s = []
        while not self._stop.is_set():
            table = consumer.poll_arrow(timeout_ms=200)
            count += table.num_rows
            if table.num_rows and consume["commit"]:
                t0 = time.monotonic()
                try:
                    consumer.commit()
                    commits += 1
                    commit_s.append(time.monotonic() - t0)
                except logbus.LogbusError:
                    commit_errors += 1
            assigned = consumer.assignment()
            if assigned and all(consumer.position(tp) >= ends[tp] for tp in assigned):
                break
        info["end_t"] = time.monotonic()
        last = self._record(consumer, last)
        info.update(records=count, commits=commits, commit_errors=commit_errors, commit_s=commit_s, rebalanced=last[0] != generation)


# --- the driver's view of a group -------------------------------------------------------------------------


def settled(members, generation_after: int, timeout_s: float = SETTLE_TIMEOUT_S, describe=None):
    """Wait until every member's latest state is one generation > generation_after whose assignments
    are disjoint, non-empty and cover every partition. Returns (generation, [first time each member
    had it], [every member's events])."""
    deadline = time.monotonic() + timeout_s
    while True:
        histories = ray.get([m.events.remote() for m in members], timeout=60)
        latest = [h[-1] if h else None for h in histories]
        if all(latest):
            generations = {g for _, g, _ in latest}
            owned = [p for _, _, assignment in latest for p in assignment]
            if (
                len(generations) == 1
                and (generation := generations.pop()) > generation_after
                and sorted(owned) == list(range(PARTITIONS))
                and all(assignment for _, _, assignment in latest)
            ):
                firsts = [next(t for t, g, _ in h if g == generation) for h in histories]
                return generation, firsts, histories
        if time.monotonic() > deadline:
            views = ray.get([m.debug.remote() for m in members], timeout=60)
            coordinator = describe() if describe is not None else None
            raise TimeoutError(
                f"group not settled after {timeout_s:.0f}s: latest states {latest}; members' views {views}; "
                f"coordinator's view {coordinator}"
            )
        time.sleep(0.05)


def learned_after(members, t0: float) -> float | None:
    """Seconds from t0 until the last of ``members`` started rejoining (learned of the rebalance)."""
    calls = ray.get([m.first_join_call.remote(t0) for m in members], timeout=60)
    return None if any(c is None for c in calls) else max(calls) - t0


def add_breakdown(result: "Result") -> None:
    """Split each rebalance time into 'until the last member started rejoining' and 'the join round after it'."""
    learned = result.extra.get("learned_s") or []
    pairs = [(value, seen) for value, seen in zip(result.values, learned) if seen is not None]
    if not pairs:
        return
    result.extra["round_s"] = [value - seen for value, seen in pairs]
    result.note = (
        f"members started rejoining after p50 {statistics.median(s for _, s in pairs):.2f} s (max {max(s for _, s in pairs):.2f}); "
        f"the join round after that took p50 {statistics.median(result.extra['round_s']):.2f} s (max {max(result.extra['round_s']):.2f})"
    )


def check_errors(members) -> None:
    for info in ray.get([m.info.remote() for m in members], timeout=60):
        if "error" in info:
            raise RuntimeError(f"a member failed:\n{info['error']}")


class Probe:
    """While the rebalance phases run: the controller's round trip (``ping``) and the latency of a small
    write + fsync in the data dir (the controller writes groups.json there), every 50 ms."""

    def __init__(self, bus, data_dir: str) -> None:
        self.bus, self.path = bus, os.path.join(data_dir, "probe.tmp")
        self.ping_s: list[float] = []
        self.fsync_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        payload = b"x" * 1024
        while not self._stop.wait(0.05):
            t0 = time.perf_counter()
            try:
                ray.get(self.bus.controller.ping.remote(), timeout=30)
            except Exception:  # noqa: BLE001 (counted as a 30 s round trip)
                pass
            self.ping_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(self.path, "wb") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            self.fsync_s.append(time.perf_counter() - t0)

    @staticmethod
    def summary(values: list[float]) -> dict:
        if not values:
            return {}
        ordered = sorted(values)
        return {
            "n": len(ordered), "p50_ms": 1000 * ordered[len(ordered) // 2], "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "max_ms": 1000 * ordered[-1], "over_1500ms": sum(v > 1.5 for v in ordered),
        }


# --- output -----------------------------------------------------------------------------------------------


def fmt_value(value, unit: str) -> str:
    if value is None:
        return ""
    if unit == "records/s":
        return fmt_rate(value)
    if unit == "ms":
        return f"{value:.1f}"
    return f"{value:.2f}"


def print_results(results: list[Result]) -> None:
    headers = ("case", "unit", "best", "p50", "max", "n", "target", "met")
    print_table(headers, [
        (
            r.case, r.unit, fmt_value(r.best, r.unit), fmt_value(r.p50, r.unit),
            fmt_value(r.max, r.unit) if r.unit in ("s", "ms") else "", str(len(r.values)), r.target or "",
            "" if r.meets_target is None else ("yes" if r.meets_target else "NO"),
        )
        for r in results
    ])


# --- main -------------------------------------------------------------------------------------------------


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 90 s)")
    parser.add_argument("--records", type=int, default=None, help=f"records in the topic (default: {FULL.records:,}; --quick {QUICK.records:,})")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.records is not None:
        if args.records < PARTITIONS * TABLE_ROWS:
            parser.error(f"--records must be at least {PARTITIONS * TABLE_ROWS}")
        mode.records = args.records

    exit_on_sigterm()

    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-groups-")
    namespace = new_namespace("bench-groups")
    results: list[Result] = []
    actors: list = []
    bus = None
    probe = None
    topic = "bench-groups"
    log(f"mode={'quick' if args.quick else 'full'} records={mode.records:,} partitions={PARTITIONS} data_dir={data_dir} "
        f"namespace={namespace} load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")

    phase_start = [time.monotonic()]

    def new_phase() -> None:
        phase_start[0] = time.monotonic()

    def over_budget(scale: float = 1.0) -> bool:
        return time.monotonic() - phase_start[0] > mode.phase_budget_s * scale

    def describe(group_id):
        def call():
            try:
                return bus.admin.describe_group(group_id)
            except Exception as error:  # noqa: BLE001 (a diagnostic)
                return repr(error)

        return call

    def new_member():
        member = Member.remote(namespace, data_dir)
        actors.append(member)
        return member

    try:
        start_local_ray(namespace, object_store_memory=1 << 30)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        t0 = time.monotonic()
        bus.admin.create_topic(topic, partitions=PARTITIONS)
        log(f"created topic {topic} ({PARTITIONS} partitions) in {time.monotonic() - t0:.1f}s")

        # ---- data ---------------------------------------------------------------------------------------
        t0 = time.monotonic()
        pool = make_pool(TABLE_ROWS)
        tables = [make_table(pool, partition=p) for p in range(PARTITIONS)]
        per_partition = mode.records // PARTITIONS
        chunks = [TABLE_ROWS] * (per_partition // TABLE_ROWS) + ([per_partition % TABLE_ROWS] if per_partition % TABLE_ROWS else [])
        with Producer(bus, acks=1) as producer:
            futures = [producer.send_table(topic, tables[p].slice(0, rows)) for rows in chunks for p in range(PARTITIONS)]
            producer.flush()
        for future in futures:
            future.result()
        ends = {p.partition: p.high_watermark for p in bus.admin.describe_topic(topic).partitions}
        total = sum(ends.values())
        log(f"produced {total:,} records ({VALUE_SIZE} B values) in {time.monotonic() - t0:.1f}s; per partition {sorted(set(ends.values()))}")

        # The first commit of a cluster creates __consumer_offsets (and its new leader refuses writes until its
        # first lease renewal): do it before anything is measured.
        t0 = time.monotonic()
        warm = Consumer(bus, group_id="warm-up", enable_auto_commit=False)
        warm.assign([TopicPartition(topic, 0)])
        for attempt in range(300):
            try:
                warm.commit({TopicPartition(topic, 0): 0})
                break
            except logbus.LogbusError as error:
                if not error.retriable:
                    raise
                time.sleep(0.1)
        warm.close()
        log(f"__consumer_offsets ready in {time.monotonic() - t0:.1f}s ({attempt} failed commits first)")

        # Member actors, started up front (actor start-up is slow on a busy machine and is not measured).
        members = [new_member() for _ in range(3)]
        victims = [new_member() for _ in range(mode.death_reps + mode.fast_death_reps)]
        single_reader = new_member()
        ray.get([m.pid.remote() for m in actors], timeout=180)
        log(f"{len(actors)} member actors up")

        # ---- 1. clean join / leave ----------------------------------------------------------------------
        def join_leave(heartbeat_ms: int, reps: int, tag: str) -> tuple[Result, Result]:
            new_phase()
            options = dict(session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=heartbeat_ms)
            group = f"join-leave-{tag}"
            label = f"session {SESSION_TIMEOUT_MS} ms, heartbeat {heartbeat_ms} ms"
            info = "" if heartbeat_ms == HEARTBEAT_MS else "(info) "
            join = Result(f"{info}rebalance after a clean join, 2 -> 3 members ({label})", "s", target=None if info else f"<= {CLEAN_TARGET_S:g} s")
            leave = Result(f"{info}rebalance after a clean leave, 3 -> 2 members ({label})", "s", target=None if info else f"<= {CLEAN_TARGET_S:g} s")
            # start() returns once the old thread is gone and the new one runs: only then may events() be read
            # (the actor is threaded, so an events() call sent earlier could run first and see the old history).
            ray.get([m.start.remote(topic, group, options) for m in members[:2]], timeout=90)
            generation, _, _ = settled(members[:2], 0, describe=describe(group))
            for rep in range(reps):
                if rep and over_budget():
                    log(f"time budget used up: {tag} stops after {rep} repetitions")
                    break
                ray.get(members[2].start.remote(topic, group, options), timeout=90)
                generation, firsts, histories = settled(members, generation, describe=describe(group))
                t_join = ray.get(members[2].info.remote())["subscribe_t"]
                join.values.append(max(firsts) - t_join)
                join.extra.setdefault("learned_s", []).append(learned_after(members[:2], t_join))
                join.extra.setdefault("generations", []).append(generation)
                time.sleep(0.3)  # settled: let a heartbeat round pass
                stopped = ray.get(members[2].stop.remote(), timeout=90)
                generation, firsts, histories = settled(members[:2], generation, describe=describe(group))
                leave.values.append(max(firsts) - stopped["close_t"])
                leave.extra.setdefault("learned_s", []).append(learned_after(members[:2], stopped["close_t"]))
                leave.extra.setdefault("close_call_s", []).append(stopped["closed_t"] - stopped["close_t"])
                log(f"{tag} rep {rep + 1}: join {join.values[-1]:.3f}s (old members rejoining after {join.extra['learned_s'][-1] or 0:.3f}s), "
                    f"leave {leave.values[-1]:.3f}s (survivors rejoining after {leave.extra['learned_s'][-1] or 0:.3f}s)")
                time.sleep(0.3)
            notices = ray.get([m.notices.remote() for m in members[:2]], timeout=60)
            ray.get([m.stop.remote() for m in members[:2]], timeout=90)
            check_errors(members)
            for r in (join, leave):
                r.extra["heartbeat_notices"] = notices
                add_breakdown(r)
                if r.target and r.values:
                    r.meets_target = r.max <= CLEAN_TARGET_S
                    r.extra["p50_meets_target"] = r.p50 <= CLEAN_TARGET_S
            return join, leave

        probe = Probe(bus, data_dir).__enter__()
        results += join_leave(HEARTBEAT_MS, mode.join_leave_reps, "hb1000")
        results += join_leave(FAST_HEARTBEAT_MS, mode.fast_reps, "hb300")

        # ---- 2. a member dies ---------------------------------------------------------------------------
        def death_phase(heartbeat_ms: int, victims: list, tag: str) -> list[Result]:
            options = dict(session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=heartbeat_ms)
            info = "" if heartbeat_ms == HEARTBEAT_MS else "(info) "
            limit_s = SESSION_TIMEOUT_MS / 1000 + DEATH_MARGIN_S
            death = Result(
                f"{info}rebalance after a member's death (SIGKILL), 3 -> 2 (session {SESSION_TIMEOUT_MS} ms, heartbeat {heartbeat_ms} ms)",
                "s", target=None if info else f"<= session + {DEATH_MARGIN_S:g} s = {limit_s:g} s",
            )
            beyond = Result(f"  {info}the same, minus the session timeout", "s", target=None if info else f"<= {DEATH_MARGIN_S:g} s")
            group = f"death-{tag}"
            new_phase()
            survivors = members[:2]
            ray.get([m.start.remote(topic, group, options) for m in survivors], timeout=90)
            generation, _, _ = settled(survivors, 0, describe=describe(group))
            for rep, victim in enumerate(victims):
                if rep and over_budget():
                    log(f"time budget used up: death ({tag}) stops after {rep} repetitions")
                    break
                ray.get(victim.start.remote(topic, group, options), timeout=90)
                generation, _, _ = settled([*survivors, victim], generation, describe=describe(group))
                time.sleep(0.5)
                pid = ray.get(victim.pid.remote())
                killed_t = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                generation, firsts, histories = settled(
                    survivors, generation, timeout_s=SESSION_TIMEOUT_MS / 1000 + SETTLE_TIMEOUT_S, describe=describe(group)
                )
                seconds = max(firsts) - killed_t
                death.values.append(seconds)
                beyond.values.append(seconds - SESSION_TIMEOUT_MS / 1000)
                death.extra.setdefault("learned_s", []).append(learned_after(survivors, killed_t))
                log(f"death ({tag}) rep {rep + 1}: survivors own every partition {seconds:.3f}s after the kill "
                    f"({seconds - SESSION_TIMEOUT_MS / 1000:+.3f}s beyond the session timeout; survivors rejoining after "
                    f"{death.extra['learned_s'][-1] or 0:.3f}s)")
                time.sleep(0.3)
            death.extra["heartbeat_notices"] = ray.get([m.notices.remote() for m in survivors], timeout=60)
            ray.get([m.stop.remote() for m in survivors], timeout=90)
            check_errors(survivors)
            add_breakdown(death)
            if death.values and not info:
                death.meets_target = death.max <= limit_s
                beyond.meets_target = beyond.max <= DEATH_MARGIN_S
                death.extra["p50_meets_target"] = death.p50 <= limit_s
            return [death, beyond]

        results += death_phase(HEARTBEAT_MS, victims[: mode.death_reps], "hb1000")
        results += death_phase(FAST_HEARTBEAT_MS, victims[mode.death_reps :], "hb300")
        probe.__exit__()
        for name, values in (("controller round trip (ping)", probe.ping_s), ("write + fsync of 1 KiB in the data dir", probe.fsync_s)):
            summary = Probe.summary(values)
            if summary:
                row = Result(f"(info) {name} during phases 1-2, every 50 ms", "ms", values=[1000 * v for v in values])
                row.extra.update(summary)
                row.note = f"p99 {summary['p99_ms']:.0f} ms, max {summary['max_ms']:.0f} ms, {summary['over_1500ms']} over 1.5 s"
                results.append(row)
                log(f"{name}: p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms, max {summary['max_ms']:.1f} ms "
                    f"({summary['over_1500ms']} of {summary['n']} over 1.5 s, the heartbeat's timeout)")

        # ---- 3. group consume throughput ----------------------------------------------------------------
        def consume_run(readers, group_id, commit: bool, assign: bool) -> tuple[float, dict]:
            consume = {"ends": ends, "commit": commit, "assign": assign}
            options = dict(session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=HEARTBEAT_MS)
            ray.get([r.start.remote(topic, group_id, options, consume) for r in readers], timeout=60)
            if not assign:
                settled(readers, 0, describe=describe(group_id))
            else:
                time.sleep(0.3)
            ray.get([r.go.remote() for r in readers], timeout=60)
            deadline = time.monotonic() + 120
            while True:
                infos = ray.get([r.info.remote() for r in readers], timeout=60)
                if any("error" in i for i in infos):
                    raise RuntimeError(next(i["error"] for i in infos if "error" in i))
                if all("end_t" in i for i in infos) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            ray.get([r.stop.remote() for r in readers], timeout=90)
            if not all("end_t" in i for i in infos):
                raise TimeoutError("a reader did not finish within 120 s")
            records = sum(i["records"] for i in infos)
            seconds = max(i["end_t"] for i in infos) - min(i["start_t"] for i in infos)
            commit_ms = sorted(1000 * s for i in infos for s in i["commit_s"])
            details = {
                "records": records, "seconds": seconds, "commits": sum(i["commits"] for i in infos),
                "commit_ms_p50": commit_ms[len(commit_ms) // 2] if commit_ms else None, "commit_ms_max": commit_ms[-1] if commit_ms else None,
                "commit_errors": sum(i["commit_errors"] for i in infos), "rebalanced": any(i["rebalanced"] for i in infos),
                "per_reader": [i["records"] for i in infos],
            }
            if records != total:
                log(f"WARNING: read {records:,} records, the topic has {total:,}")
            return records / seconds, details

        cases = [
            ("group", members, True, f"consume, 3 group members (actors), {PARTITIONS} partitions, poll_arrow + commit"),
            ("group", [single_reader], True, f"consume, 1 group member (actor) owning all {PARTITIONS} partitions, poll_arrow + commit"),
            ("group", members, False, "(info) consume, 3 group members, poll_arrow, no commit"),
            ("assign", [single_reader], False, f"(info) consume, 1 consumer without a group (assign {PARTITIONS} partitions), poll_arrow"),
        ]
        tput = {}
        for index, (kind, readers, commit, label) in enumerate(cases[:2]):
            rate, _ = consume_run(readers, f"tput-warm-up-{index}", commit, assign=False)
            log(f"warm-up (not counted): {label}: {rate:,.0f}/s")
        new_phase()
        for rep in range(mode.tput_reps):
            if rep and over_budget(2):
                log(f"time budget used up: throughput stops after {rep} repetitions")
                break
            for index, (kind, readers, commit, label) in enumerate(cases):
                group_id = f"tput-{index}-{rep}" if kind == "group" else None
                rate, details = consume_run(readers, group_id, commit, assign=kind == "assign")
                result = tput.setdefault(label, Result(label, "records/s"))
                result.values.append(rate)
                for key, value in details.items():
                    result.extra.setdefault(key, []).append(value)
                log(f"{label} rep {rep + 1}: {details['records']:,} records in {details['seconds']:.2f}s = {rate:,.0f}/s "
                    f"({details['commits']} commits, p50 {details['commit_ms_p50'] or 0:.0f} ms, max {details['commit_ms_max'] or 0:.0f} ms, "
                    f"{details['commit_errors']} failed; rebalanced: {details['rebalanced']})")
        results += list(tput.values())
        group_result, single_result = tput.get(cases[0][3]), tput.get(cases[1][3])
        if group_result and single_result and group_result.values and single_result.values:
            ratio = Result("  ratio: 3 members / 1 member (best vs best; with commits)", "x")
            ratio.values = [group_result.best / single_result.best]
            ratio.extra["median_ratio"] = group_result.p50 / single_result.p50
            results.append(ratio)
    finally:
        if probe is not None:
            probe.__exit__()
        kill_actors(actors)  # the killed victims are already dead
        delete_topics(bus, [topic])
        shutdown_ray()
        remove_dir(data_dir)

    wall = run.finish()
    print_results(results)
    for r in results:
        if r.note:
            print(f"{r.case.strip()}: {r.note}")
    log(f"done in {wall:.0f}s; rebalance times: best = lowest, p50 = median, max = highest of n repetitions; throughput: "
        f"best = highest, p50 = median; load average {run.load_start[0]:.1f} at the start, {run.load_end[0]:.1f} at the end "
        f"(other processes share these {os.cpu_count()} CPUs)")
    for r in results:
        line = {
            "bench": "groups", "case": r.case.strip(), "unit": r.unit, "best": json_value(r.best), "p50": json_value(r.p50),
            "max": json_value(r.max) if r.unit in ("s", "ms") else None, "values": json_value(r.values) if len(r.values) <= 20 else None, "target": r.target,
            "meets_target": r.meets_target, "quick": run.quick, "records": mode.records, "date": run.date,
            "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        }
        if r.note:
            line["note"] = r.note
        line.update({k: json_value(v) for k, v in r.extra.items()})
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
