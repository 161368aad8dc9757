#!/usr/bin/env python
"""Where acks=all writes wait: a fixed fault plan on a namespace cluster, then each partition's wait, second by second.

    .venv/bin/python tools/stall_probe.py SCENARIO [--keep] [--tail SECONDS]

SCENARIO is one of the plans below (a kill then a controller cut, a
controller cut, host cuts, a controller cut then a host cut, a flap, kills of one host then
a pause and a flap of it, as seed 3 ends), or
``seed:N:SECONDS``: the faults tests/cluster/fault_run.py plans for seed N
that begin within SECONDS. The run is a fault run (fault_run.py: the same
cluster, workload and checks) that ends ``--tail`` seconds after the last
fault. It prints one JSON line (whether the run kept every invariant, the
faults with their times, the stalls by fault kind and, within a kind, by
what the cut hosts were to the partition: leader, follower or neither) and
then, per partition, ``second:wait`` for each second of sending
(counted from the first fault's plan time) whose worst acknowledgement
wait was over 0.5 s. ``--keep`` keeps the cluster's directory (every Ray
node's logs) and says where. Needs root and the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.cluster.fault_run as fr  # noqa: E402
from tests.cluster.history import load  # noqa: E402
from tests.cluster.netns import HEAD, NetnsCluster  # noqa: E402

SCENARIOS = {
    "kill_then_controller": [("kill", ("n2",), 5.0, 4.0), ("cut_controller", (HEAD,), 14.0, 4.0)],
    "controller": [("cut_controller", (HEAD,), 5.0, 4.0)],
    "host": [("cut", ("n1",), 5.0, 5.0), ("cut", ("n2",), 25.0, 5.0)],
    "controller_then_host": [("cut_controller", (HEAD,), 5.0, 4.0), ("cut", ("n2",), 12.0, 4.0)],
    "flap": [("flap", ("n2",), 5.0, 8.7)],
    "kills_then_flap": [("kill", ("n2",), 5.0, 2.0), ("kill", ("n2",), 11.5, 2.1), ("pause", ("n2",), 19.0, 2.2),
                        ("flap", ("n2",), 22.3, 8.7)],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", help=f"one of {sorted(SCENARIOS)}, or seed:N:SECONDS for fault_run's plan of seed N")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--tail", type=float, default=40.0)
    args = parser.parse_args()
    if args.scenario.startswith("seed:"):
        _, seed, seconds = args.scenario.split(":")
        plan = [f for f in fr.plan_faults(int(seed), 300.0, ["n1", "n2", "n3"]) if f.start_s < float(seconds)]
    else:
        plan = [fr.Fault(kind, targets, start, hold) for kind, targets, start, hold in SCENARIOS[args.scenario]]
    duration = plan[-1].start_s + plan[-1].hold_s + args.tail
    directory = Path(tempfile.mkdtemp(prefix="stall-"))
    cluster = NetnsCluster(nodes=3, keep_directory=args.keep)
    with cluster:
        result = fr.FaultRun(cluster, 1, duration, directory, plan=plan).run()
    events = load(str(directory / "history.jsonl"))
    sent = {e["value"]: e["t"] for e in events if e["kind"] == "send"}
    start = min(f["began_t"] - f["began_s"] for f in result.faults)
    per = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e["kind"] == "ack" and e.get("value") in sent:
            second = int(sent[e["value"]] - start)
            per[e["partition"]][second] = max(per[e["partition"]][second], e["t"] - sent[e["value"]])
    print(json.dumps({"ok": result.ok, "violations": result.violations(), "full_isr_after_s": result.full_isr_after_s,
                      "faults": [(f["kind"], f["targets"], f["began_s"], f["ended_s"]) for f in result.faults],
                      "stalls": result.stalls, "errors": result.errors[:10],
                      "kept": str(cluster.directory) if args.keep else None, "run": str(directory)}, default=str))
    for partition in sorted(per):
        row = " ".join(f"{s}:{w:.1f}" for s, w in sorted(per[partition].items()) if w > 0.5)
        print(f"partition {partition} (send second: worst wait s, waits > 0.5 s): {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
