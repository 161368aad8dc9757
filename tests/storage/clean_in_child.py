"""Run one cleaning of a log directory in a child process, to be killed part way (tests/storage/test_clean_crash.py).

Children are forked from a forkserver that imported logbus once, so a child
starts in milliseconds and a test can kill one at each of a cleaning's file
operations. :func:`start` starts one: it opens the log with its clock fixed
at ``now_ms``, says "ready" through its pipe, and runs
``PartitionLog.clean()``. With ``kill_at`` = N > 0 it sends itself SIGKILL
just before the N-th file system operation of the cleaning (a write, sync,
rename or unlink: the steps whose order makes a swap atomic), so the
operations before it happened and none after. With ``kill_at`` = 0 it runs to
the end and sends how many such operations there were and how long the
cleaning took.
"""

import multiprocessing
import os
import signal
import time

from logbus.storage import LogConfig, PartitionLog

OPERATIONS = ("pwritev", "pwrite", "write", "fsync", "fdatasync", "replace", "rename", "unlink", "ftruncate")

_CONTEXT = multiprocessing.get_context("forkserver")
# What a cleaning imports on first use, too (pyarrow loads pandas lazily): a child imports nothing.
_CONTEXT.set_forkserver_preload(["logbus.storage", "pyarrow.compute", "pandas", __name__])


def _clean(directory: str, config: dict, now_ms: int, kill_at: int, pipe) -> None:
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
    pipe.send("ready")
    started = time.monotonic()
    cleaned = log.clean()
    elapsed = time.monotonic() - started
    pipe.send({"operations": count[0], "seconds": elapsed, "groups": len(cleaned)})


def start(directory, config: dict, now_ms: int, kill_at: int):
    """Start a child cleaning ``directory``; returns (the process, the parent's end of its pipe)."""
    parent, child = _CONTEXT.Pipe()
    process = _CONTEXT.Process(target=_clean, args=(str(directory), config, now_ms, kill_at, child), daemon=True)
    process.start()
    child.close()
    return process, parent
