#!/usr/bin/env python
"""The long fault run: for each seed, a fresh namespace cluster, ``--seconds`` of faults, then heal and judge.

    .venv/bin/python tools/fault_run.py [--seconds 300] [--nodes 3] [--rate 100] [--keep] SEED [SEED ...]

Prints one JSON object per seed on stdout (``seed``, ``ok``, ``violations``,
``full_isr``, ``full_isr_after_s``, the faults applied, the workload's
counts, the history checker's report, the replicas' comparison and the last
description of the topic); progress goes to stderr. Exits 0 if every run
kept every invariant and healed to its full ISR, 1 otherwise. Needs root
(network namespaces), and the machine to itself (nothing else running):
``.venv/bin/python tools/fault_run.py 1 2 3``.
See tests/cluster/fault_run.py for what a run does and checks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.fault_run import FaultRun  # noqa: E402
from tests.cluster.netns import NetnsCluster, unavailable_reason  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seeds", metavar="SEED", type=int, nargs="+", help="a run per seed")
    parser.add_argument("--seconds", type=float, default=300.0, help="how long faults go on (default: 300)")
    parser.add_argument("--nodes", type=int, default=3, help="replica hosts (default: 3)")
    parser.add_argument("--rate", type=float, default=100.0, help="records per second the producer sends (default: 100)")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (history, Ray's logs) and say where")
    args = parser.parse_args()
    if reason := unavailable_reason():
        parser.error(reason)
    all_ok = True
    for seed in args.seeds:
        directory = Path(tempfile.mkdtemp(prefix=f"fault-run-{seed}-"))
        cluster = NetnsCluster(nodes=args.nodes, keep_directory=args.keep)
        try:
            with cluster:
                result = FaultRun(cluster, seed, args.seconds, directory, rate=args.rate).run()
            output = result.as_dict()
        except Exception as error:  # noqa: BLE001 (a run that could not finish is a result too)
            output = {"seed": seed, "ok": False, "error": f"{type(error).__name__}: {error}"}
        if args.keep:
            output["kept"] = {"run": str(directory), "cluster": str(cluster.directory)}
        else:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
        all_ok = all_ok and output["ok"]
        print(json.dumps(output, default=str), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
