#!/usr/bin/env python
"""What starting one partition replica costs the machine, beside starting a bare Ray actor.

Run with ``./dev bench actor_start`` (= ``.venv/bin/python perf/bench_actor_start.py``);
``--rounds N`` sets how many rounds each case runs (default 3), ``--partitions P`` the
replicas per round (default 8).

The figure is CPU time, of the whole machine (``/proc/stat``: user, nice, system, irq and
softirq), less the idle machine's rate measured first over 5 s, per actor started:
- baseline: a bare Ray actor (``num_cpus=0``, one method) created, called once and killed,
  ``P`` at a time; a new Ray worker process each;
- replica: a topic of ``P`` partitions at replication factor 1 created, one record produced
  to each partition and acknowledged, then the topic deleted: ``P`` replica actors started
  (each a Ray worker process that imports logbus, opens its log and reports to its node).
Ratio: replica / baseline. It is what the test suite's time follows (docs/design.md, "Tests":
most of a run's CPU goes to worker processes starting). Wall time per round is reported for
information. Nothing else should run on the machine meanwhile.

The last lines are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

# First: it puts this tree's logbus on sys.path.
from _common import arg_parser, new_namespace, print_table, remove_dir, shutdown_ray, start_local_ray


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_of(run, idle_rate: float) -> tuple[float, float]:
    """(CPU seconds beyond the idle rate, wall seconds) that ``run()`` took, with 2 s after it for
    processes to end (a killed actor's worker exits after its call returns)."""
    cpu0, wall0 = machine_cpu_s(), time.monotonic()
    run()
    time.sleep(2.0)
    wall = time.monotonic() - wall0
    return machine_cpu_s() - cpu0 - idle_rate * wall, wall - 2.0


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case (default 3)")
    parser.add_argument("--partitions", type=int, default=8, help="actors started per round (default 8)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.partitions < 1:
        parser.error("--rounds and --partitions must be at least 1")
    root = tempfile.mkdtemp(prefix="bench_actor_start-")
    start_local_ray()
    import ray

    import logbus

    @ray.remote(num_cpus=0)
    class Bare:
        def ping(self) -> int:
            return 1

    results = []
    try:
        bus = logbus.connect(data_dir=root, namespace=new_namespace("bench-actor-start"))
        bus.admin.create_topic("warm-up", partitions=1)  # the controller's and the agent's own start-up, not measured
        bus.admin.delete_topic("warm-up")
        time.sleep(3.0)
        cpu0 = machine_cpu_s()
        time.sleep(5.0)
        idle_rate = (machine_cpu_s() - cpu0) / 5.0

        def bare_round() -> None:
            actors = [Bare.remote() for _ in range(args.partitions)]
            ray.get([a.ping.remote() for a in actors], timeout=120)
            for a in actors:
                ray.kill(a)

        def replica_round(n: int):
            def run() -> None:
                topic = f"start-{n}"
                bus.admin.create_topic(topic, partitions=args.partitions, replication_factor=1)
                with logbus.Producer(bus, linger_ms=0) as producer:
                    for p in range(args.partitions):
                        producer.send(topic, b"x", partition=p).get(timeout=120)
                bus.admin.delete_topic(topic)
            return run

        cases = {"bare Ray actor": [], "partition replica": []}
        for n in range(args.rounds):  # alternated, so that a drift in the machine's load touches both
            cases["bare Ray actor"].append(cpu_of(bare_round, idle_rate))
            cases["partition replica"].append(cpu_of(replica_round(n), idle_rate))
        base = statistics.median(cpu for cpu, _ in cases["bare Ray actor"]) / args.partitions
        for name, runs in cases.items():
            per_actor = statistics.median(cpu for cpu, _ in runs) / args.partitions
            results.append({"case": name, "cpu_s_per_actor": round(per_actor, 3),
                            "wall_s_per_round": round(statistics.median(wall for _, wall in runs), 2),
                            "ratio": round(per_actor / base, 2), "ratio_to": "bare Ray actor",
                            "idle_cpu_s_per_s": round(idle_rate, 3), "rounds": args.rounds, "actors_per_round": args.partitions,
                            "load_avg": [round(x, 1) for x in os.getloadavg()]})
    finally:
        shutdown_ray()
        remove_dir(root)

    print_table(("case", "CPU s per actor", "wall s per round", "ratio"), [
        (r["case"], f"{r['cpu_s_per_actor']:.3f}", f"{r['wall_s_per_round']:.2f}", f"{r['ratio']:.2f}x {r['ratio_to']}")
        for r in results
    ])
    for r in results:
        print(json.dumps({"bench": "actor_start", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
