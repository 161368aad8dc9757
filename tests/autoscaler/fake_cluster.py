"""A fake autoscaling multi-node Ray cluster on one machine, for tests of logbus under an autoscaler.

The recipe (Ray 2.60): Ray's autoscaler v1 runs in the head node's monitor process and, with
the ``fake_multinode`` node provider, adds and removes worker nodes on this machine as real
Ray nodes (each with its own raylet) for pending demand (tasks, actors, placement groups).

1. ``RAY_FAKE_CLUSTER=1`` (the fake provider refuses to start without it),
   ``AUTOSCALER_UPDATE_INTERVAL_S=1`` (an integer: the monitor's loop period) and
   ``RAY_AUTOSCALER_FATESHARE_WORKERS=1`` (a monitor that fails stops the worker nodes it
   started, which are its child processes) go into ``os.environ`` before the head starts, so
   that the monitor inherits them.
2. An autoscaler config is written to a file (``cluster_config``): provider
   ``fake_multinode`` pointed at the head's GCS address (a free port chosen here), the head
   node type ``ray.head.default`` and the worker node types, plus the keys that autoscaler v1
   reads without defaults (``auth``, ``file_mounts``, the command lists, ...). The monitor
   reads it again on every update, so it stays on disk until the cluster is shut down.
3. ``ray.cluster_utils.Cluster`` starts the head with ``autoscaling_config`` set to that file
   and ``RAY_OVERRIDE_NODE_ID_FOR_TESTING`` set to the fake provider's head node id (the
   provider names nodes by id, and takes the head to be that one).
4. The driver connects with the explicit GCS address: ``Cluster`` overwrites the machine-wide
   ``/tmp/ray/ray_current_cluster`` when the head starts (so ``ray.init("auto")`` would find
   whichever cluster wrote it last) and deletes it at shutdown; its previous content is put
   back each time, as other Ray users on the machine may rely on it.
5. Shutdown: ``ray.shutdown()``; the head's monitor is stopped, then every worker node it
   started (its descendant processes); then ``Cluster.shutdown()`` stops the head; then a
   check that no process of this cluster is left, found by its GCS address or its session
   directory (in a process's command line or among its open files: Ray's worker processes
   rename themselves ``ray::...`` but keep their log files open). A leftover is killed and
   reported as an error.

Why not ``ray.cluster_utils.AutoscalingCluster``: its constructor reads
``fake_multi_node/example.yaml``, which the Ray wheel does not ship, and its ``start()`` and
``shutdown()`` run ``ray stop --force``, which kills every Ray process on the machine,
including other test runs'. Never call ``ray stop`` here.

These tests start a Ray cluster of their own and must not share the main suite's Ray
session, so ``./dev test`` runs them in a pytest process of their own, beside the main suite
(which does not collect them: ``norecursedirs`` in pyproject.toml). Nothing here depends on
what else runs on the machine: the driver names its cluster's GCS address, the address file is
put back, and the leftover check matches this cluster's own address and session directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import ray
from ray._common.utils import get_ray_address_file
from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from ray.autoscaler._private.util import validate_config
from ray.cluster_utils import Cluster

logger = logging.getLogger(__name__)

HEAD_NODE_TYPE = "ray.head.default"
AUTOSCALER_ENVIRONMENT = {
    "RAY_FAKE_CLUSTER": "1",
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
    "RAY_AUTOSCALER_FATESHARE_WORKERS": "1",
    "RAY_enable_autoscaler_v2": "0",  # the recipe is autoscaler v1's
}
# Keys autoscaler v1 reads from the config without defaults (autoscaler.py, commands.py).
REQUIRED_EMPTY_KEYS: dict[str, Any] = {
    "auth": {},
    "docker": {},
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}
RAY_ADDRESS_FILE = Path(get_ray_address_file(None))  # /tmp/ray/ray_current_cluster


@dataclasses.dataclass(frozen=True)
class ScaleEvent:
    """One observed change of the number of live worker nodes, and how long it took."""

    from_workers: int
    to_workers: int
    seconds: float

    @property
    def up(self) -> bool:
        return self.to_workers > self.from_workers


@dataclasses.dataclass(frozen=True)
class Mark:
    """When demand changed (``time.monotonic()``) and how many worker nodes were alive then."""

    time: float
    workers: int


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def cluster_config(
    gcs_address: str,
    worker_types: dict[str, dict],
    idle_timeout_s: float,
    head_resources: dict[str, float],
    upscaling_speed: float,
    cluster_name: str,
) -> dict[str, Any]:
    """The autoscaler config: ``worker_types`` maps a node type name to its ``resources``,
    ``min_workers``, ``max_workers`` and optional ``labels`` (``node_config`` may be left out)."""
    node_types = {HEAD_NODE_TYPE: {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}}
    for name, spec in worker_types.items():
        node_types[name] = {"node_config": {}, "min_workers": 0, **spec}
    return {
        "cluster_name": cluster_name,
        "max_workers": sum(spec.get("max_workers", 0) for spec in worker_types.values()),
        "upscaling_speed": upscaling_speed,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": node_types,
        "head_node_type": HEAD_NODE_TYPE,
        **json.loads(json.dumps(REQUIRED_EMPTY_KEYS)),  # a fresh copy of every default
    }


@contextlib.contextmanager
def _address_file_kept():
    """Put back what the machine-wide ``ray_current_cluster`` file held before the block:
    ``Cluster`` overwrites it when the head starts and deletes it at shutdown."""
    try:
        before: str | None = RAY_ADDRESS_FILE.read_text()
    except OSError:
        before = None
    try:
        yield
    finally:
        try:
            if before is None:
                RAY_ADDRESS_FILE.unlink(missing_ok=True)
            else:
                RAY_ADDRESS_FILE.write_text(before)
        except OSError:
            logger.warning("could not restore %s", RAY_ADDRESS_FILE)


class FakeAutoscalingCluster:
    """A head node (no CPUs by default) whose autoscaler adds worker nodes of ``worker_types``
    for pending demand and removes them after ``idle_timeout_s`` of idleness.

    ``start()`` also connects this process to it (``ray.init``); ``shutdown()`` disconnects,
    stops every node and checks that none of its processes is left. ``scale_events`` records
    each change of the worker count that ``wait_for_workers`` saw, with its duration.
    """

    def __init__(
        self,
        worker_types: dict[str, dict],
        idle_timeout_s: float,
        config_dir: Path,
        head_resources: dict[str, float] | None = None,
        upscaling_speed: float = 10.0,
        head_args: dict[str, Any] | None = None,
        namespace: str | None = None,
    ):
        self.worker_types = worker_types
        self.idle_timeout_s = idle_timeout_s
        self.config_path = config_dir / "autoscaler.json"
        self.head_resources = {"CPU": 0} if head_resources is None else head_resources
        self.upscaling_speed = upscaling_speed
        self.head_args = head_args or {}
        self.namespace = namespace
        self.scale_events: list[ScaleEvent] = []
        self.address = ""
        self.session_dir = ""
        self._cluster: Cluster | None = None
        self._saved_environment: dict[str, str | None] = {}

    def start(self) -> "FakeAutoscalingCluster":
        if ray.is_initialized():
            ray.shutdown()
        port = free_port()
        gcs_address = f"{ray.util.get_node_ip_address()}:{port}"
        config = cluster_config(
            gcs_address,
            self.worker_types,
            self.idle_timeout_s,
            self.head_resources,
            self.upscaling_speed,
            cluster_name=f"logbus-fake-{port}",
        )
        validate_config(config)  # a bad config fails here, not silently in the monitor's log
        self.config_path.write_text(json.dumps(config, indent=2))
        self._saved_environment = {key: os.environ.get(key) for key in AUTOSCALER_ENVIRONMENT}
        os.environ.update(AUTOSCALER_ENVIRONMENT)
        head_resources = dict(self.head_resources)
        head_args = dict(
            num_cpus=head_resources.pop("CPU", 0),
            num_gpus=head_resources.pop("GPU", 0),
            object_store_memory=head_resources.pop("object_store_memory", 150 << 20),
            resources=head_resources,
            gcs_server_port=port,
            autoscaling_config=str(self.config_path),
            include_dashboard=False,
            dashboard_port=free_port(),  # Ray starts its API server anyway; 8265 may be another cluster's
            env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        )
        head_args.update(self.head_args)
        self.address = gcs_address  # so that shutdown() finds what a failed start left behind
        started = time.monotonic()
        with _address_file_kept():
            self._cluster = Cluster(initialize_head=True, head_node_args=head_args)
        self.address = self._cluster.address
        self.session_dir = self._cluster.head_node.get_session_dir_path()
        ray.init(address=self.address, namespace=self.namespace, log_to_driver=False)
        logger.info("fake autoscaling cluster at %s (session %s) up in %.1f s", self.address, self.session_dir, time.monotonic() - started)
        return self

    @property
    def head_node_id(self) -> str:
        assert self._cluster is not None
        return self._cluster.head_node.node_id

    def worker_nodes(self) -> list[dict]:
        """The ``ray.nodes()`` entries of the live worker nodes (every live node but the head)."""
        return [node for node in ray.nodes() if node.get("Alive") and node["NodeID"] != self.head_node_id]

    def node_ids(self) -> list[str]:
        """The ids of the live worker nodes, sorted."""
        return sorted(node["NodeID"] for node in self.worker_nodes())

    def mark(self) -> Mark:
        """Note the time and the number of live worker nodes; call it just before changing demand
        and pass the result to ``wait_for_workers`` as ``since``."""
        return Mark(time.monotonic(), len(self.node_ids()))

    def wait_for_workers(self, count: int, timeout_s: float = 180.0, since: Mark | None = None) -> float:
        """Wait until ``count`` worker nodes are alive (at least ``count`` when scaling up from
        ``since``, at most when scaling down: the fake provider may briefly start one node more
        than asked for); return the seconds since ``since`` (default: now), so that the duration
        covers the autoscaler's reaction as well as the nodes' start or stop. A change of the
        worker count is recorded in ``scale_events``.
        """
        since = since or self.mark()
        deadline = time.monotonic() + timeout_s
        while not _reached(live := len(self.node_ids()), count, since.workers):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {count} worker nodes ({live} alive)")
            time.sleep(0.2)
        seconds = time.monotonic() - since.time
        if live != since.workers:
            self.scale_events.append(ScaleEvent(since.workers, live, seconds))
            logger.info("worker nodes %d -> %d in %.1f s", since.workers, live, seconds)
        return seconds

    def termination_reasons(self, node_ids: list[str]) -> dict[str, list[str]]:
        """Why the autoscaler ended each of ``node_ids``, as its log (the head's ``monitor.log``) says:
        ``StandardAutoscaler: Terminating the node with id ID and ip IP. (REASON)``. The fake provider
        gives each node the id Ray knows it by."""
        log = Path(self.session_dir) / "logs" / "monitor.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.findall(r"Terminating the node with id (\S+) and ip \S+\. \((.*?)\)", text)
        return {node_id: [reason for found_id, reason in found if found_id == node_id] for node_id in node_ids}

    def processes(self) -> list[psutil.Process]:
        """This machine's processes that belong to this cluster (see the module docstring)."""
        marks = [re.escape(mark) for mark in (self.address, self.session_dir) if mark]
        if not marks:  # an empty mark would match every process on the machine
            return []
        # The GCS address as a whole ("ip:port", not a longer port), the session dir or a path in it.
        pattern = re.compile(r"(?<![\w.])(?:" + "|".join(marks) + r")(?![\w.-])")
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if pattern.search(" ".join(process.info["cmdline"] or ())) or any(
                    pattern.match(f.path) for f in process.open_files()
                ):
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def _stop_autoscaler_and_workers(self, grace_s: float) -> None:
        """Stop the head's monitor (the autoscaler), then every worker node it started.

        Ray's own way is not relied on: when terminated, the monitor stops its worker nodes
        (RAY_AUTOSCALER_FATESHARE_WORKERS), but a monitor busy starting nodes holds the fake
        provider's lock for as long as that takes, ``Cluster.shutdown()`` kills it first, and
        the worker nodes' processes (its children) are orphaned.
        """
        assert self._cluster is not None
        monitors = self._cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
        for info in monitors:
            if info.process.poll() is not None:  # exited already (its pid may be another process's now)
                continue
            try:
                monitor = psutil.Process(info.process.pid)
                monitor.suspend()  # no node starts from here on
                workers = monitor.children(recursive=True)
                monitor.kill()  # Ray reaps it (Cluster.shutdown)
            except psutil.NoSuchProcess:
                continue
            stop_processes(workers, grace_s)

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Disconnect, stop every node of the cluster and make sure none of its processes is left.

        Raises AssertionError (after killing them) if processes of the cluster were still alive
        ``grace_s`` after the nodes were stopped.
        """
        if ray.is_initialized():
            ray.shutdown()
        running = self._cluster is not None
        leftovers: list[psutil.Process] = []
        try:
            if running:
                self._stop_autoscaler_and_workers(grace_s)
                with _address_file_kept():
                    try:
                        self._cluster.shutdown()
                    except ValueError:  # a stray thread re-attached this process to the cluster: detach and retry
                        ray.shutdown()
                        self._cluster.shutdown()
            deadline = time.monotonic() + grace_s
            while (leftovers := self.processes()) and time.monotonic() < deadline:
                time.sleep(0.5)
            _send(leftovers, signal.SIGKILL)
            _wait_gone(leftovers, 30.0)
        finally:
            self._cluster = None
            for key, value in self._saved_environment.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_environment = {}
        if running and self.scale_events:
            logger.info("scale events of %s: %s", self.address, [dataclasses.astuple(e) for e in self.scale_events])
        if leftovers:
            raise AssertionError(
                f"processes of the cluster at {self.address} were alive {grace_s}s after its shutdown and were killed: "
                + ", ".join(f"{p.pid}" for p in leftovers)
            )


def _reached(live: int, count: int, before: int) -> bool:
    if count > before:
        return live >= count
    if count < before:
        return live <= count
    return live == count


def _gone(process: psutil.Process) -> bool:
    # A zombie has exited: its parent (maybe not this process) has yet to reap it.
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``processes`` to exit; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _send(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        try:
            process.send_signal(sig)  # psutil checks that the pid was not reused meanwhile
        except psutil.NoSuchProcess:
            pass


def stop_processes(processes: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM ``processes``, give them ``grace_s`` to exit, then SIGKILL those left."""
    _send(processes, signal.SIGTERM)
    alive = _wait_gone(processes, grace_s)
    if alive:
        _send(alive, signal.SIGKILL)
        alive = _wait_gone(alive, 30.0)
    if alive:
        logger.warning("processes still alive after SIGKILL: %s", [p.pid for p in alive])
