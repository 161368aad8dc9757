"""A fault run: a producer and a consumer through network and process faults mixed by a seed, then heal and judge.

On a namespace cluster (netns.py): a topic with replication factor 3 and
``min.insync.replicas`` 2; a driver on the client host runs an idempotent
``acks="all"`` producer and a consumer (``live``) for the whole run,
recording every send, acknowledgement, failure and poll (workload.py,
history.py). Meanwhile faults follow one another, chosen and timed by the
seed (:func:`plan_faults`; every kind at least once):

- ``cut``: a replica host cut from every other host (its bridge port down);
- ``cut_pair``: two hosts (replica hosts or the head) cut from each other only;
- ``cut_controller``: the head (the controller's host) cut off;
- ``flap``: a host cut and healed every 1-3 s;
- ``kill``: every process of a replica host SIGKILLed, the host joined again
  as a new Ray node a few seconds later;
- ``pause``: every process of a host (a replica host or the head) stopped
  with SIGSTOP, then resumed.

After the last fault everything is healed, hosts whose Ray node died join
again, and the run waits (bounded) for every partition to have its full ISR
(every replica in it, as the controller describes the partition and as its
leader sees it). Then the producer stops (every send gets its outcome), the
consumer reads on to the high watermark, a fresh consumer (``final``) reads
every partition from its start, and every replica's files are read up to the
high watermark. The history checker then counts what must be zero: lost,
duplicated, two values at one offset (acks, polls and replicas' files
together), unseen, non-monotonic, phantom records; and the replicas are
compared record by record.

:func:`run` returns a :class:`FaultRunResult`: ``as_dict()`` is the
machine-readable result ``tools/fault_run.py`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import uuid
from pathlib import Path

from tests.cluster.history import check, compare_replicas, load, replica_events, replica_records
from tests.cluster.netns import HEAD, NetnsCluster
from tests.cluster.workload import Workload

FAULT_KINDS = ("cut", "cut_pair", "cut_controller", "flap", "kill", "pause")
TOPIC = "faults"
PARTITIONS = 3
REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2
REPLICA_REPLACEMENT_MS = 5_000  # a killed host's replicas are re-created on a live host this soon
HOLD_S = (2.0, 6.0)  # how long one fault lasts
FLAP_S = (6.0, 10.0)  # how long a flap goes on
FLAP_TOGGLE_S = (1.0, 3.0)
CALM_S = (2.0, 5.0)  # between two faults
FULL_ISR_TIMEOUT_S = 240.0
NOTE_LEADERS_BEFORE_S = 1.0  # the leaders are asked this long before each fault begins
STOP_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    targets: tuple[str, ...]
    start_s: float  # from the start of the faults
    hold_s: float


def plan_faults(seed: int, duration_s: float, replica_hosts: list[str]) -> list[Fault]:
    """Faults one after another for ``duration_s`` (longer if needed for every kind to come once): the
    first six are the kinds in an order the seed chooses, later ones any kind. Targets and timings come
    from the seed too, so a seed names a run."""
    rng = random.Random(seed)
    kinds = list(FAULT_KINDS)
    rng.shuffle(kinds)
    faults, now = [], rng.uniform(*CALM_S)
    while now < duration_s or kinds:
        kind = kinds.pop(0) if kinds else rng.choice(FAULT_KINDS)
        if kind == "cut_pair":
            targets = tuple(rng.sample([*replica_hosts, HEAD], 2))
        elif kind == "cut_controller":
            targets = (HEAD,)
        elif kind == "pause":
            targets = (rng.choice([*replica_hosts, HEAD]),)
        else:
            targets = (rng.choice(replica_hosts),)
        hold = rng.uniform(*(FLAP_S if kind == "flap" else HOLD_S))
        faults.append(Fault(kind, targets, round(now, 3), round(hold, 3)))
        now += hold + rng.uniform(*CALM_S)
    return faults


@dataclasses.dataclass
class FaultRunResult:
    seed: int
    duration_s: float
    faults: list[dict]
    counts: dict
    report: dict  # the history checker's (Report.as_dict())
    replicas: dict  # per partition: compare_replicas() of its replicas up to the high watermark
    full_isr: bool
    full_isr_after_s: float | None
    last_describe: dict
    offline_partitions: list[int]  # with no leader at the end
    final_read: bool  # whether the final read from every partition's start succeeded
    errors: list[str]
    stalls: dict = dataclasses.field(default_factory=dict)  # see ack_stalls()

    def violations(self) -> dict[str, int]:
        found = dict(self.report["violations"])
        found["replicas_disagree"] = sum(len(r["disagree"]) for r in self.replicas.values())
        found["replicas_missing"] = sum(len(offsets) for r in self.replicas.values() for offsets in r["missing"].values())
        return found

    @property
    def ok(self) -> bool:
        return self.full_isr and self.final_read and not self.offline_partitions and not any(self.violations().values())

    def as_dict(self) -> dict:
        return {"seed": self.seed, "ok": self.ok, "full_isr": self.full_isr, "full_isr_after_s": self.full_isr_after_s,
                "violations": self.violations(), **dataclasses.asdict(self)}


def _full_isr(described: dict) -> bool:
    """Every partition's ISR holds all its replicas, as described by the controller and as its leader sees it."""
    for partition, statuses in zip(described["partitions"], described["statuses"]):
        replicas = sorted(partition["replicas"])
        if len(replicas) != REPLICATION_FACTOR or sorted(partition["isr"]) != replicas:
            return False
        leaders = [s for s in statuses if s.get("role") == "leader"]
        if len(leaders) != 1 or sorted(leaders[0].get("isr") or []) != replicas or any(s.get("error") for s in statuses):
            return False
    return True


class FaultRun:
    """One run on ``cluster`` (see the module docstring); ``log`` gets a line per step."""

    def __init__(self, cluster: NetnsCluster, seed: int, duration_s: float, directory: Path, rate: float = 100.0, log=None,
                 plan: list[Fault] | None = None) -> None:
        self.cluster = cluster
        self.plan = plan  # the faults to apply; None: plan_faults' for the seed
        self.seed = seed
        self.duration_s = duration_s
        self.directory = Path(directory)
        self.rate = rate
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.errors: list[str] = []
        self.applied: list[dict] = []
        self.last_describe: dict = {}
        self.workload: Workload | None = None
        self._started = time.monotonic()

    def _say(self, text: str) -> None:
        self.log(f"[fault-run seed {self.seed} +{time.monotonic() - self._started:6.1f}s] {text}")

    def run(self) -> FaultRunResult:
        self.directory.mkdir(parents=True, exist_ok=True)
        data_dir = str(self.directory / "data")
        history_path = str(self.directory / "history.jsonl")
        workload = Workload(self.cluster, data_dir, f"fr-{self.seed}-{uuid.uuid4().hex[:6]}", history_path,
                            replica_replacement_ms=REPLICA_REPLACEMENT_MS)
        self.workload = workload
        try:
            workload.call("create_topic", topic=TOPIC, partitions=PARTITIONS, replication_factor=REPLICATION_FACTOR,
                          config={"min.insync.replicas": str(MIN_INSYNC_REPLICAS)})
            self._wait_full_isr(workload, 120.0)
            workload.call("start", topic=TOPIC, rate=self.rate)
            self._say(f"producing at {self.rate:.0f} records/s; faults for {self.duration_s:.0f} s")
            self._inject(self.plan if self.plan is not None else plan_faults(self.seed, self.duration_s, self.cluster.nodes))
            self._heal_everything()
            healed_at = time.monotonic()
            full_isr = self._wait_full_isr(workload, FULL_ISR_TIMEOUT_S)
            full_isr_after_s = round(time.monotonic() - healed_at, 1) if full_isr else None
            self._say(f"full ISR: {full_isr} ({full_isr_after_s} s after the last heal)")
            # What follows may fail on a cluster that did not heal (a partition with no leader): each step
            # that fails is reported, and the history is judged on what was recorded.
            counts = self._step(workload, "stop", {}, timeout_s=STOP_TIMEOUT_S, reply_timeout_s=STOP_TIMEOUT_S + 60)
            final = self._step(workload, "read_all", None, topic=TOPIC, consumer="final", timeout_s=240.0, reply_timeout_s=400)
            described = self._step(workload, "describe", self.last_describe, topic=TOPIC, reply_timeout_s=120)
        finally:
            workload.close()
        events = load(history_path)
        replicas, offline = {}, []
        for index, partition in enumerate(described.get("partitions", [])):
            # Up to the high watermark; a partition with no leader has none: each replica's whole log, compared
            # over their common prefix.
            high_watermark = partition["high_watermark"] if partition["leader"] is not None else None
            if high_watermark is None:
                offline.append(partition["partition"])
            logs = {}
            statuses = {s.get("replica_id"): s for s in described.get("statuses", [[]] * (index + 1))[index]}
            for replica in partition["replicas"]:
                try:
                    directory = self._replica_directory(data_dir, partition["partition"], replica, statuses.get(replica, {}))
                    logs[replica] = replica_records(directory, high_watermark)
                except Exception as error:  # noqa: BLE001 (reported: a replica whose files cannot be read)
                    self.errors.append(f"replica {replica} of partition {partition['partition']}: {error!r}")
                    continue
                events += replica_events(TOPIC, partition["partition"], replica, logs[replica])
            replicas[str(partition["partition"])] = compare_replicas(logs, bound=high_watermark)
        report = check(events, complete_consumers=["live", "final"] if final is not None else ["live"])
        stalls = ack_stalls(events, self.applied, self._replica_hosts(described))
        for partition in replicas.values():  # byte values are not JSON: show them as text
            partition["disagree"] = {o: {_text(v): r for v, r in values.items()} for o, values in partition["disagree"].items()}
        return FaultRunResult(self.seed, self.duration_s, self.applied, counts, report.as_dict(), replicas, full_isr,
                              full_isr_after_s, described, offline, final is not None, self.errors + counts.get("errors", []), stalls)

    def _replica_hosts(self, described: dict) -> dict[int, str]:
        """Replica id -> the host (role) it is on, from the last description (a host keeps its replicas)."""
        roles = {str(self.cluster.node_id(role)): role for role in self.cluster.nodes}
        hosts = {}
        for statuses in described.get("statuses", []):
            for status in statuses:
                if status.get("node") in roles:
                    hosts[status["replica_id"]] = roles[status["node"]]
        return hosts

    def _replica_directory(self, data_dir: str, partition: int, replica: int, status: dict) -> str:
        """Where a replica keeps its log: as the controller says, else in the data directory of its node's host
        (a host's node id), else in the cluster's data directory (a node named by its Ray node id)."""
        from logbus.actors.placement import replica_directory  # noqa: PLC0415 (imports Ray)

        if status.get("directory"):
            return status["directory"]
        host_dir = self.cluster.data_dir_of(status["node"]) if status.get("node") else None
        return replica_directory(str(host_dir or data_dir), TOPIC, partition, replica)

    def _step(self, workload: Workload, op: str, otherwise, **arguments):
        try:
            reply = workload.call(op, **arguments)
        except AssertionError as error:
            self.errors.append(f"{op}: {str(error)[:3000]}")
            self._say(f"{op} failed: {str(error)[:500]}")
            return otherwise
        self._say(f"{op}: {json.dumps(reply)[:500]}")
        return reply

    # --- faults -----------------------------------------------------------------------------------------------

    def _inject(self, faults: list[Fault]) -> None:
        start = time.monotonic()
        for fault in faults:
            if self.workload is not None:  # who leads what as the fault begins (ack_stalls' split by role)
                time.sleep(max(0.0, start + fault.start_s - NOTE_LEADERS_BEFORE_S - time.monotonic()))
                self._step(self.workload, "note_leaders", None, topic=TOPIC, reply_timeout_s=30)
            time.sleep(max(0.0, start + fault.start_s - time.monotonic()))
            began = time.monotonic() - start
            self._say(f"{fault.kind} {','.join(fault.targets)} for {fault.hold_s:.1f} s")
            try:
                self._apply(fault)
            except Exception as error:  # noqa: BLE001 (a fault that could not be applied or undone is reported)
                self.errors.append(f"{fault.kind} {fault.targets}: {error!r}")
                self._say(f"  failed: {error!r}")
            self.applied.append({**dataclasses.asdict(fault), "began_s": round(began, 2), "ended_s": round(time.monotonic() - start, 2),
                                 "began_t": round(start + began, 3), "ended_t": round(time.monotonic(), 3)})

    def _apply(self, fault: Fault) -> None:
        cluster, (target, *rest) = self.cluster, fault.targets
        if fault.kind in ("cut", "cut_controller"):
            cluster.cut(target)
            time.sleep(fault.hold_s)
            cluster.heal(target)
        elif fault.kind == "cut_pair":
            cluster.cut_pair(target, rest[0])
            time.sleep(fault.hold_s)
            cluster.heal_pair(target, rest[0])
        elif fault.kind == "flap":
            rng = random.Random(f"{self.seed}-{fault.start_s}")
            until = time.monotonic() + fault.hold_s
            while time.monotonic() < until:
                cluster.cut(target)
                time.sleep(rng.uniform(*FLAP_TOGGLE_S))
                cluster.heal(target)
                time.sleep(rng.uniform(*FLAP_TOGGLE_S))
        elif fault.kind == "pause":
            cluster.pause(target)
            time.sleep(fault.hold_s)
            cluster.resume(target)
        elif fault.kind == "kill":
            cluster.kill(target)
            time.sleep(fault.hold_s)
            cluster.restart(target)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")

    def _heal_everything(self) -> None:
        """Undo every cut and pause; join again every replica host whose Ray node is not alive."""
        self.cluster.heal_all()
        alive = {node["NodeManagerAddress"] for node in self.cluster.ray_nodes() if node["Alive"]}
        for role in self.cluster.nodes:
            if self.cluster.hosts[role].ip not in alive:
                self._say(f"{role} has no live Ray node: joining it again")
                self.cluster.restart(role)
                self.cluster.wait_for_node(role)
        self._say("healed")

    def _wait_full_isr(self, workload: Workload, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                described = workload.call("describe", topic=TOPIC, reply_timeout_s=120)
                self.last_describe = described
                if _full_isr(described):
                    return True
            except AssertionError as error:  # the controller was away: ask again
                self.last_describe = {"error": str(error)[:2000]}
            if time.monotonic() > deadline:
                self._say(f"no full ISR after {timeout_s:.0f} s: {self.last_describe}")
                return False
            time.sleep(2.0)


def ack_stalls(events: list[dict], faults: list[dict], replica_hosts: dict[int, str] | None = None) -> dict:
    """How long acks=all writes waited through each fault: per fault kind, the longest time from a send
    to its acknowledgement among the records sent while a fault of that kind was on (the history's and
    the faults' times are both this machine's monotonic clock), with the fault it happened in. A cut
    host leads some partitions and follows others: a send to a partition it led waits for a new
    leader; one to a partition it followed waits until the leader drops it from the ISR.

    With the run's ``leaders`` notes (one asked just before each fault began) and ``replica_hosts`` (replica id
    -> host), each kind's figure is also split by the partition's role on the fault's targets when the
    fault began (``by_role``): ``leader`` (a target led it), ``follower`` (a target followed it),
    ``none`` (no target hosts a replica: the controller's host) or ``unknown`` (no note asked within
    ``2 * NOTE_LEADERS_BEFORE_S`` before the fault began was answered before it began)."""
    sent = {e["value"]: e["t"] for e in events if e["kind"] == "send"}
    acks = sorted((sent[e["value"]], e["t"] - sent[e["value"]], e.get("partition")) for e in events
                  if e["kind"] == "ack" and e.get("value") in sent)
    notes = sorted(((e["t"], e["asked"], e["leaders"]) for e in events if e["kind"] == "leaders"), key=lambda n: n[0])
    worst: dict[str, dict] = {}
    for fault in faults:
        waits = [(wait, partition) for t, wait, partition in acks if fault["began_t"] <= t <= fault["ended_t"]]
        if not waits:
            continue
        wait, partition = max(waits)
        kind = worst.setdefault(fault["kind"], {"worst_ack_s": -1.0})
        if wait > kind["worst_ack_s"]:
            kind.update({"worst_ack_s": round(wait, 2), "partition": partition, "targets": fault["targets"],
                         "began_s": fault["began_s"], "records_sent": len(waits)})
        if replica_hosts is None:
            continue
        leaders = next((ls for t, asked, ls in reversed(notes)
                        if t <= fault["began_t"] and asked >= fault["began_t"] - 2 * NOTE_LEADERS_BEFORE_S), None)
        for wait, partition in waits:
            role = _role(fault["targets"], partition, leaders, replica_hosts)
            by_role = kind.setdefault("by_role", {})
            if wait > by_role.get(role, {}).get("worst_ack_s", -1.0):
                by_role[role] = {"worst_ack_s": round(wait, 2), "partition": partition, "targets": fault["targets"],
                                 "began_s": fault["began_s"]}
    return worst


def _role(targets, partition, leaders: dict | None, replica_hosts: dict[int, str]) -> str:
    """The role of a fault's targets in ``partition`` as the fault began (see ``ack_stalls``)."""
    if not set(targets) & set(replica_hosts.values()):
        return "none"
    if leaders is None or partition is None:
        return "unknown"
    leader = leaders.get(str(partition))
    if leader is not None and replica_hosts.get(leader) in targets:
        return "leader"
    return "follower"


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
