"""Where a machine's CPU time goes, by kind of process, while something runs.

    .venv/bin/python tools/cpu_by_process.py --seconds 45        # sample for 45 s
    .venv/bin/python tools/cpu_by_process.py -- ./dev test tests/api/test_groups.py

Samples every process's CPU time (``/proc/PID/stat``) once a second and sums what each kind of
process used while sampling: Ray's own processes by name (``raylet``, ``gcs_server``, the dashboard
agent), Ray workers by their title (``ray::PartitionReplica``, ``ray::IDLE`` for a worker started
but not yet given an actor or task), ``worker-boot`` for a Ray worker seen before it set its title,
and anything else by its command name. A process is counted under the kind it had when first seen,
so a worker's start-up shows as ``ray::IDLE`` or ``worker-boot`` and the rest of its life as that
too; a process that starts and ends between two samples is missed. Prints one line per kind,
largest first: CPU seconds, share of all sampled CPU time, and how many processes of that kind
were seen. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
RAY_HELPERS = ("gcs_server", "dashboard/agent", "runtime_env/agent", "log_monitor", "monitor.py", "dashboard.py",
               "pyspark.daemon", "java", "pytest")


def kind(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if comm.startswith("ray::") or comm in ("raylet", "gcs_server"):
        return comm
    if "default_worker" in command:
        return "worker-boot"
    return next((name for name in RAY_HELPERS if name in command), comm)


def cpu_ticks(pid: str) -> tuple[str, int] | None:
    """(start time, user + system ticks) of a process; the start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19], int(fields[11]) + int(fields[12])


class Sampler:
    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list] = {}  # (pid, start time) -> [ticks at the last sample, kind]
        self.ticks: collections.Counter = collections.Counter()
        self.processes: dict[str, set] = collections.defaultdict(set)
        self.first = True

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            found = cpu_ticks(pid)
            if found is None:
                continue
            start, ticks = found
            known = self.seen.get((pid, start))
            if known is None:
                name = kind(pid)
                if name is None:
                    continue
                self.seen[(pid, start)] = [ticks, name]
                self.processes[name].add((pid, start))
                if not self.first:  # a process started since the last sample: all its time is new
                    self.ticks[name] += ticks
            else:
                self.ticks[known[1]] += ticks - known[0]
                known[0] = ticks
        self.first = False

    def report(self) -> str:
        total = sum(self.ticks.values()) or 1
        return "\n".join(f"{ticks / HZ:8.1f} s {100 * ticks / total:5.1f} %  {name} (processes: {len(self.processes[name])})"
                         for name, ticks in self.ticks.most_common() if ticks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, help="sample this long (without a command)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="a command to run and sample until it ends (after --)")
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"]
    if not command and not args.seconds:
        parser.error("give --seconds or a command after --")
    sampler = Sampler()
    sampler.sample()
    started = time.monotonic()
    process = subprocess.Popen(command) if command else None
    try:
        while (process.poll() is None) if process else (time.monotonic() - started < args.seconds):
            time.sleep(1.0)
            sampler.sample()
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait()
    print(f"sampled {time.monotonic() - started:.0f} s")
    print(sampler.report())
    return process.returncode if process else 0


if __name__ == "__main__":
    sys.exit(main())
