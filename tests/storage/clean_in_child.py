"""Run one cleaning of a log directory in this process, to be killed part way (tests/storage/test_clean_crash.py).

    python -m tests.storage.clean_in_child DIRECTORY CONFIG_JSON NOW_MS KILL_AT

The process opens the log with its clock fixed at NOW_MS, prints ``ready``,
and runs ``PartitionLog.clean()``. With KILL_AT = N > 0 it sends itself
SIGKILL just before the N-th file system operation of the cleaning (a write,
sync, rename or unlink: the steps whose order makes a swap atomic), so the
operations before it happened and none after. With KILL_AT = 0 it runs to the
end and prints how many such operations there were and how long the cleaning
took.
"""

import json
import os
import signal
import sys
import time

from logbus.storage import LogConfig, PartitionLog

OPERATIONS = ("pwritev", "pwrite", "write", "fsync", "fdatasync", "replace", "rename", "unlink", "ftruncate")


def main() -> None:
    directory, config, now_ms, kill_at = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    log = PartitionLog(directory, LogConfig.from_dict(config), clock_ms=lambda: now_ms)
    count = [0]

    def counted(operation):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return operation(*args, **kwargs)

        return call

    for name in OPERATIONS:
        setattr(os, name, counted(getattr(os, name)))
    print("ready", flush=True)
    started = time.monotonic()
    cleaned = log.clean()
    elapsed = time.monotonic() - started
    print(json.dumps({"operations": count[0], "seconds": elapsed, "groups": len(cleaned)}), flush=True)


if __name__ == "__main__":
    main()
