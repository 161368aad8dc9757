#!/usr/bin/env python
"""The performance report: run the benchmarks, write perf/RESULTS.md's summary table, draw the charts.

    .venv/bin/python perf/report.py --quick            # every benchmark in its quick mode
    .venv/bin/python perf/report.py --full             # every benchmark in full (about an hour here)
    .venv/bin/python perf/report.py --only broker scale
    .venv/bin/python perf/report.py --from-results     # no runs: redraw from perf/results/*.jsonl

Each benchmark runs alone, one after the other (they measure a shared 2-core machine: nothing
else should run meanwhile), as a child process; the JSON lines it prints last are kept in
``perf/results/<bench>.jsonl`` (the latest run of each). From those the report writes the
summary table between the ``summary`` markers at the top of ``perf/RESULTS.md`` (case, figure,
same-run baseline ratio, target, met) and draws PNG charts into ``perf/charts/`` with
matplotlib:

- ``throughput.png``: records/s of logbus against its same-run baselines (Redis Streams,
  ``ray.util.queue``, Spark on Parquet, the native path) as ratios;
- ``latency.png``: end-to-end latency percentiles (p50, p99) of the latency cases;
- ``failover.png``: the failover timeline, seconds to a new leader and to the first
  acknowledgement for each leader-node kill;
- ``scale.png``: idle CPU and memory per replica against a plain Ray actor, for 16 and 64
  replicas on a node.

A benchmark that fails is reported as failed and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

PERF = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(PERF, "results")
CHARTS_DIR = os.path.join(PERF, "charts")
RESULTS_MD = os.path.join(PERF, "RESULTS.md")
BENCHES = ["storage", "broker", "replication", "groups", "spark", "scale", "move", "gateway"]
START, END = "<!-- summary:start -->", "<!-- summary:end -->"
FIGURES = ("records_per_s", "p50_ms", "p99_ms", "p50_s", "max_s", "value", "create_s", "move_s", "ratio")


def run_bench(name: str, quick: bool, timeout_s: float) -> tuple[list[dict], str]:
    script = os.path.join(PERF, f"bench_{name}.py")
    if not os.path.exists(script):
        return [], "no such benchmark"
    command = [sys.executable, script] + (["--quick"] if quick else [])
    print(f"[{time.strftime('%H:%M:%S')}] running {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout_s:.0f}s"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{") and '"bench"' in line]
    status = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {len(lines)} results in {time.monotonic() - started:.0f}s ({status})", flush=True)
    return lines, status


def load_results() -> dict[str, list[dict]]:
    found = {}
    for name in BENCHES:
        path = os.path.join(RESULTS_DIR, f"{name}.jsonl")
        if os.path.exists(path):
            with open(path) as file:
                found[name] = [json.loads(line) for line in file if line.strip()]
    return found


UNITS = {"records_per_s": "rec/s", "p50_ms": "ms p50", "p99_ms": "ms p99", "p50_s": "s p50", "max_s": "s max",
         "create_s": "s", "move_s": "s"}


def _number(value: float) -> str:
    return f"{value:,.0f}".replace(",", " ") if abs(value) >= 1000 else f"{value:.3g}"


def _figure(line: dict) -> str:
    """The case's figures, with their units: throughput, and the percentiles a latency or failover case has."""
    parts = []
    for key in FIGURES[:-1]:
        value = line.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            unit = UNITS.get(key) or line.get("unit", "")
            parts.append(f"{_number(value)} {unit}".strip())
    return ", ".join(parts) or "-"


def summary_table(results: dict[str, list[dict]]) -> str:
    rows = ["| bench | case | figure | ratio to same-run baseline | target | met | date |", "|---|---|---|---|---|---|---|"]
    for name in BENCHES:
        for line in results.get(name, []):
            ratio = line.get("ratio")
            ratio_text = "-" if not isinstance(ratio, int | float) else f"{ratio:.2f}x" + (f" vs {line['ratio_vs']}" if line.get("ratio_vs") else "")
            met = {True: "yes", False: "**no**", None: "-"}.get(line.get("meets_target"), "-")
            quick = " (quick)" if line.get("quick") else ""
            rows.append(f"| {name} | {line.get('case', '')} | {_figure(line)} | {ratio_text} | {line.get('target') or '-'} | {met} | {line.get('date', '')}{quick} |")
    return "\n".join(rows)


def write_summary(results: dict[str, list[dict]], statuses: dict[str, str]) -> None:
    with open(RESULTS_MD) as file:
        text = file.read()
    failed = [f"- `{name}`: {status}" for name, status in statuses.items() if status != "ok"]
    block = (
        f"{START}\n## Summary (perf/report.py, {datetime.date.today().isoformat()})\n\n"
        "The latest run of each benchmark, as `perf/report.py` last collected it; the sections below "
        "record every run with its command.\n\n" + summary_table(results) + "\n"
        + ("\nBenchmarks that did not finish in the last report run:\n" + "\n".join(failed) + "\n" if failed else "")
        + "\n![throughput](charts/throughput.png) ![latency](charts/latency.png)\n"
        "![failover](charts/failover.png) ![scale](charts/scale.png)\n" + END
    )
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        head, _, rest = text.partition("\n")
        text = f"{head}\n\n{block}\n{rest}"
    with open(RESULTS_MD, "w") as file:
        file.write(text)


def _is_throughput_ratio(line: dict) -> bool:
    """A records/s figure against a same-run baseline (not a latency or cost ratio, where lower is better)."""
    vs = line.get("ratio_vs") or ""
    return (isinstance(line.get("ratio"), int | float) and vs not in ("", "none") and "lower is better" not in vs
            and isinstance(line.get("records_per_s"), int | float) and "latency" not in line.get("case", ""))


def draw_charts(results: dict[str, list[dict]]) -> list[str]:
    import matplotlib  # noqa: PLC0415 (only the report needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    os.makedirs(CHARTS_DIR, exist_ok=True)
    drawn = []

    ratios = [(f"{n}: {l['case'][:38]}", l["ratio"]) for n in ("broker", "spark", "gateway", "move")
              for l in results.get(n, []) if _is_throughput_ratio(l)]
    if ratios:
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(ratios) + 1.2))
        ax.barh([r[0] for r in ratios], [r[1] for r in ratios], color="#4c72b0")
        ax.axvline(1.0, color="grey", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("logbus / same-run baseline (log scale; 1 = as fast)")
        ax.set_title("Throughput against same-run baselines")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(os.path.join(CHARTS_DIR, "throughput.png"), dpi=110)
        plt.close(fig)
        drawn.append("throughput.png")

    latencies = [(f"{n}: {l['case'][:40]}", l["p50_ms"], l["p99_ms"]) for n in ("broker", "replication", "scale")
                 for l in results.get(n, []) if isinstance(l.get("p50_ms"), int | float) and isinstance(l.get("p99_ms"), int | float)]
    if latencies:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(latencies) + 1.2))
        y = range(len(latencies))
        ax.barh([i + 0.2 for i in y], [l[2] for l in latencies], height=0.4, label="p99", color="#dd8452")
        ax.barh([i - 0.2 for i in y], [l[1] for l in latencies], height=0.4, label="p50", color="#4c72b0")
        ax.set_yticks(list(y), [l[0] for l in latencies])
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency, ms (log scale)")
        ax.legend()
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(os.path.join(CHARTS_DIR, "latency.png"), dpi=110)
        plt.close(fig)
        drawn.append("latency.png")

    kills = {l["case"]: l.get("reps") for l in results.get("replication", []) if str(l.get("case", "")).startswith("failover (")}
    if kills:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for case, reps in kills.items():
            if reps:
                ax.plot(range(1, len(reps) + 1), [r if r is not None else float("nan") for r in reps], marker="o",
                        label=", ".join(part for part in case.split(", ") if "kills" not in part))
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xlabel("leader-node kill")
        ax.set_ylabel("seconds after the kill")
        ax.set_title("Failover timeline")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(CHARTS_DIR, "failover.png"), dpi=110)
        plt.close(fig)
        drawn.append("failover.png")

    scale = results.get("scale", [])
    cpu = [(l["replicas"], l["value"], l["baseline"]) for l in scale if str(l.get("case", "")).startswith("idle cpu") and "replicas" in l]
    uss = [(l["replicas"], l["value"], l["baseline"]) for l in scale if str(l.get("case", "")).startswith("uss") and "replicas" in l]
    if cpu or uss:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, rows, label in ((axes[0], cpu, "idle CPU per process, % of a core"), (axes[1], uss, "USS per process, MiB")):
            xs = [str(r[0]) for r in rows]
            ax.bar([i - 0.2 for i in range(len(rows))], [r[1] for r in rows], width=0.4, label="logbus replica")
            ax.bar([i + 0.2 for i in range(len(rows))], [r[2] for r in rows], width=0.4, label="plain Ray actor")
            ax.set_xticks(range(len(rows)), xs)
            ax.set_xlabel("replicas on the node")
            ax.set_title(label, fontsize=10)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(CHARTS_DIR, "scale.png"), dpi=110)
        plt.close(fig)
        drawn.append("scale.png")
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every benchmark in its quick mode (the default)")
    mode.add_argument("--full", action="store_true", help="every benchmark in full")
    mode.add_argument("--from-results", action="store_true", help="run nothing: redraw from perf/results/*.jsonl")
    parser.add_argument("--only", nargs="+", choices=BENCHES, help="run only these benchmarks")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one benchmark may take")
    args = parser.parse_args()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    statuses: dict[str, str] = {}
    if not args.from_results:
        for name in args.only or BENCHES:
            lines, status = run_bench(name, quick=not args.full, timeout_s=args.timeout)
            statuses[name] = status
            if lines:
                with open(os.path.join(RESULTS_DIR, f"{name}.jsonl"), "w") as file:
                    file.write("".join(json.dumps(line) + "\n" for line in lines))
    results = load_results()
    write_summary(results, statuses)
    drawn = draw_charts(results)
    print(f"summary of {sum(map(len, results.values()))} results written to {RESULTS_MD}; charts: {', '.join(drawn) or 'none'}")
    return 0 if all(s == "ok" for s in statuses.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
