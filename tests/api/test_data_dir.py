"""One owner per data directory: processes over the same directory share one cluster and lose nothing.

Real processes, each with its own embedded Ray (``logbus.connect()`` with no
address): two applications started at the same moment over one data
directory, each sending records one at a time and waiting for every
acknowledgement. Before, each started a controller and replicas of its own
over the same files and acknowledged records were lost; now the second joins
the first's cluster. The ``logbus`` command run beside them joins too; a
controller of another Ray cluster over the directory refuses with the
holder's name; and after every process has exited, a new one takes the
directory over (the kernel released the dead owners' locks) and reads every
acknowledged record back, each once, at the offset it was acknowledged at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import logbus
from logbus.errors import DataDirectoryInUseError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
RECORDS = 3_000
TOPIC = "shared"

APP = r"""
import json, sys, time
import ray
import logbus
from logbus import TopicPartition

data_dir, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
bus = logbus.connect(data_dir=data_dir, ray_init_options={"log_to_driver": False})
try:
    bus.admin.create_topic("shared", partitions=2)
except logbus.TopicAlreadyExistsError:
    pass
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address}), flush=True)
acked = {}
with logbus.Producer(bus, acks="all", linger_ms=0) as producer:
    for i in range(count):
        value = f"{prefix}-{i}"
        metadata = producer.send("shared", value.encode()).result(timeout=120)
        acked[value] = [metadata.partition, metadata.offset]
print(json.dumps({"acked": acked}), flush=True)
if prefix == "reader":
    tps = [TopicPartition("shared", p) for p in range(2)]
    consumer = logbus.Consumer(bus)
    consumer.assign(tps)
    consumer.seek_to_beginning(tps)
    ends = consumer.end_offsets(tps)
    rows, deadline = [], time.monotonic() + 120
    while len(rows) < sum(ends.values()) and time.monotonic() < deadline:
        table = consumer.poll_arrow(timeout_ms=1000)
        rows += zip(table["partition"].to_pylist(), table["offset"].to_pylist(), [v.decode() for v in table["value"].to_pylist()])
    print(json.dumps({"read": rows}), flush=True)
sys.stdin.readline()  # stay up (serving, or joined) until told to go
"""


def start(data_dir: str, prefix: str, count: int, env: dict | None = None) -> subprocess.Popen:
    """Run APP; ``env``: its whole environment (default: this process's, which may carry Ray's auth settings)."""
    env = dict(os.environ if env is None else env, RAY_ENABLE_AUTO_CONNECT="0", PYTHONPATH=str(REPO_ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-c", APP, data_dir, prefix, str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO_ROOT), env=env,
    )


def message(process: subprocess.Popen, key: str) -> object:
    """The next JSON line the process prints that holds ``key`` (other output is Ray's)."""
    for line in process.stdout:
        line = line.strip()
        if line.startswith("{"):
            found = json.loads(line)
            if key in found:
                return found[key]
    raise AssertionError(f"process {process.pid} exited ({process.wait(30)}) before saying {key!r}")


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                process.stdin.close()
            except OSError:
                pass
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def test_two_processes_over_one_data_directory_lose_nothing(tmp_path, ray_session):
    data_dir = str(tmp_path / "data")
    first, second = start(data_dir, "a", RECORDS), start(data_dir, "b", RECORDS)
    processes = [first, second]
    try:
        # Started at the same moment: one owns the directory, the other joined its cluster.
        assert message(first, "gcs") == message(second, "gcs")
        acked = {**message(first, "acked"), **message(second, "acked")}
        assert len(acked) == 2 * RECORDS

        # The command line beside them joins their cluster too (it would have opened the files a second time).
        listed = subprocess.run(
            [sys.executable, "-m", "logbus.cli", "--data-dir", data_dir, "topics", "list"],
            capture_output=True, text=True, timeout=180, cwd=str(REPO_ROOT),
            env=dict(os.environ, RAY_ENABLE_AUTO_CONNECT="0", PYTHONPATH=str(REPO_ROOT)),
        )
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == [TOPIC]

        # A controller of another Ray cluster (this test's) over the same files refuses, naming the holder.
        with pytest.raises(DataDirectoryInUseError, match=r"in use by another logbus controller \(pid \d+"):
            logbus.connect(data_dir=data_dir, namespace=f"other-{uuid.uuid4().hex[:8]}")
    finally:
        stop(*processes)

    # Every owner is gone: a new process takes the directory over and finds every acknowledged record once.
    reader = start(data_dir, "reader", 0)
    try:
        rows = message(reader, "read")
    finally:
        stop(reader)
    stored = {value: [partition, offset] for partition, offset, value in rows}
    assert len(stored) == len(rows), "a value was stored twice"
    assert len({(p, o) for p, o, _ in rows}) == len(rows), "an offset was used twice"
    lost = [value for value in acked if value not in stored]
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {lost[:3]}"
    moved = [value for value, where in acked.items() if stored[value] != where]
    assert not moved, f"records stored at other offsets than acknowledged: {moved[:3]}"


def user_environment(home: Path, **settings: str) -> dict:
    """The environment a user's shell has: no RAY_AUTH_* (pytest's carries the RAY_AUTH_MODE its own
    ray.init set), HOME a directory of its own (so no token is found in ~/.ray unless Ray writes one)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH_")}
    return {**env, "HOME": str(home), **settings}


@pytest.mark.parametrize("first_settings, second_settings", [
    # A user's environment: the first process's embedded Ray turns token mode on by itself and writes
    # a token to its ~/.ray; the second, with another HOME and no token, joins by address.
    ({}, {}),
    # Token mode asked for: the first has a token file of its own, the second only the mode.
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/token"}, {"RAY_AUTH_MODE": "token"}),
    # Auth turned off by the first process's user; the second's environment says token (as pytest's does).
    ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token"}),
], ids=["user-environment", "token-mode", "first-disabled"])
def test_a_second_process_joins_with_the_first_ones_ray_auth(tmp_path, first_settings, second_settings):
    """The second connect() over a data directory joins the first's cluster with that cluster's auth mode and
    token, whatever its own environment says (before, it got InvalidAuthToken, then DataDirectoryInUseError)."""
    (tmp_path / "token").write_text("a-token-of-this-test-" + uuid.uuid4().hex)
    first_env = user_environment(tmp_path / "home-a", **{k: v.format(tmp=tmp_path) for k, v in first_settings.items()})
    second_env = user_environment(tmp_path / "home-b", **second_settings)
    data_dir = str(tmp_path / "data")
    first = start(data_dir, "a", 20, env=first_env)
    processes = [first]
    try:
        gcs = message(first, "gcs")
        second = start(data_dir, "b", 20, env=second_env)
        processes.append(second)
        assert message(second, "gcs") == gcs
        acked = {**message(first, "acked"), **message(second, "acked")}
        assert len(acked) == 40
        if not first_settings:
            # The token the second process used is the one Ray wrote for the first.
            assert (tmp_path / "home-a" / ".ray" / "auth_token").is_file()
            assert not (tmp_path / "home-b" / ".ray").exists()
    finally:
        stop(*processes)
