"""A namespace cluster leaves nothing behind: its shutdown, and the cleanup of what a crashed run left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster.netns import (
    PREFIX,
    STATE_FILE,
    NetnsCluster,
    cleanup_leftovers,
    logbus_shm_directory,
    netns_names,
    pids_in_netns,
    unavailable_reason,
)

pytestmark = [pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())), pytest.mark.timeout(600)]


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(30)
    return process.pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as file:
        return file.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_leftovers_of_a_dead_owner_are_cleaned_and_a_live_owners_are_not():
    dead = _dead_pid()
    leftover, alive = f"{PREFIX}{dead}c99-n1", f"{PREFIX}{os.getpid()}c99-n1"
    directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{dead}c99-"))
    shm = Path(logbus_shm_directory(f"leftover-{dead}"))
    sleeper = None
    try:
        for name in (leftover, alive):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
        # A process the crashed run left in its namespace, its directory and its logbus files in /dev/shm.
        sleeper = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "600"], start_new_session=True)
        deadline = time.monotonic() + 30
        while sleeper.pid not in pids_in_netns(leftover) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_in_netns(leftover) == [sleeper.pid]
        (directory / STATE_FILE).write_text(json.dumps({"owner_pid": dead, "owner_start": 1, "name": f"{PREFIX}{dead}c99",
                                                        "logbus_namespaces": [f"leftover-{dead}"]}))
        shm.mkdir(parents=True)
        (shm / "lease").write_bytes(b"\0" * 64)

        deleted = cleanup_leftovers()

        assert leftover in deleted and alive not in deleted
        assert leftover not in netns_names() and alive in netns_names()
        sleeper.wait(30)  # killed (this process reaps it)
        assert sleeper.returncode == -signal.SIGKILL
        assert not directory.exists() and not shm.exists()
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(30)
        for name in (leftover, alive):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        subprocess.run(["rm", "-rf", str(directory), str(shm)], timeout=30)


@pytest.mark.slow
def test_shutdown_ends_every_process_and_deletes_every_namespace_and_file():
    shm_before = set(os.listdir("/dev/shm"))
    cluster = NetnsCluster(nodes=1)
    try:
        cluster.start()
        cluster.register_logbus_namespace("teardown-check")
        shm = Path(logbus_shm_directory("teardown-check"))
        shm.mkdir(parents=True, exist_ok=True)
        (shm / "lease").write_bytes(b"\0" * 64)
        pids = [pid for role in cluster.hosts for pid in cluster.pids(role)]
        namespaces = [host.netns for host in cluster.hosts.values()] + [cluster.bridge_netns]
        assert len(pids) >= 3 * 3  # a head and two nodes, each with a raylet and Ray's agents
    finally:
        cluster.shutdown()
    assert all(_gone(pid) for pid in pids)
    assert not set(namespaces) & set(netns_names())
    assert not cluster.directory.exists()
    assert not shm.exists()
    assert set(os.listdir("/dev/shm")) <= shm_before  # nor anything Ray put there
    cluster.shutdown()  # a second time does nothing
