"""A multi-host Ray cluster on one machine: every Ray node in a Linux network namespace of its own.

Ray nodes started on one machine (``ray.cluster_utils.Cluster``) share one
network address, so no test on them ever sees a network partition, or Ray's
token authentication between hosts. Here each host is a network namespace
(``ip netns``) with its own address on one Linux bridge; the bridge lives in
a namespace of its own, and no namespace has a route out, so every address
the cluster uses exists only inside namespaces this module made::

    namespace lbn{pid}c{k}-br:      bridge br0, one port per host (p-head, p-n1, ...), no address
    namespace lbn{pid}c{k}-head:    eth0 10.77.0.1/24  Ray head (GCS, the logbus controller), no replica slots
    namespace lbn{pid}c{k}-n1..nN:  eth0 10.77.0.11.. `logbus join` nodes with replica slots (logbus_replica), racks
    namespace lbn{pid}c{k}-client:  eth0 10.77.0.100   a Ray node without replica slots, for drivers

(``pid`` is the creating process's, ``k`` counts the clusters it made.) A
driver runs in the client namespace (:meth:`NetnsCluster.popen_python`):
Ray attaches a driver to a raylet of its own host, so the client host runs
a Ray node that offers no replica slots (logbus places no replica there).

Ray runs with token authentication on: the head is started with
``RAY_AUTH_MODE=token`` and a token file of the cluster's own, and every
other host joins with ``logbus join --token-file``, under a HOME of its own
(so no token is found in ``~/.ray`` by accident). A replica host joins with
a data directory of its own (``--data-dir``: its "disk", where its logbus
identity and its replicas' logs live); every host joining again uses the
same one, so it is the same logbus node on a new Ray node. Every Ray process gets an
environment without the caller's ``RAY_*`` variables. Each host has its own
Ray ``--temp-dir`` (Ray's Unix sockets and session files live there) and
CPUs 0 (logbus's actors take none, and no idle workers are pre-started).

Faults, each undone by its pair or by :meth:`NetnsCluster.heal_all`:

- :meth:`cut` a host from every other: its bridge port's link goes down,
  so the bridge drops every frame to and from it (TCP connections stall,
  as when a cable is pulled; nothing is refused).
- :meth:`cut_pair` two hosts from each other only: a blackhole route to
  the other's address in each of the two namespaces. No packet filter is
  available here (no iptables, nft or ebtables), and a bridge port carries
  a host's traffic to everyone; a route acts on what a namespace sends, so
  both directions need one. Packets of existing connections are dropped
  (their TCP stalls, as in a partition); a new connection fails at once
  with EINVAL on the sender's side rather than timing out, which is the
  one way this differs from a real partition. Every other path stays up.
- cutting the controller's host is :meth:`cut` of ``"head"``; a flap is
  cut and heal in turn (the fault run drives its timing).
- :meth:`kill` SIGKILLs every process of a host (Ray's and logbus's);
  :meth:`restart` joins it again as a new Ray node. :meth:`pause` and
  :meth:`resume` SIGSTOP / SIGCONT every process of a host.
  :meth:`restart_all` is a whole-cluster restart: every host killed, the
  head started again and every other host joined again (new Ray node ids
  everywhere, the same data directories).

A host's processes are found by their network namespace (``/proc/PID/ns/net``
against the namespace's inode): everything in one of these namespaces was
started by this module or descends from what it started. Shutdown SIGKILLs
exactly those, deletes the namespaces, the cluster's directory and logbus's
``/dev/shm`` files of the logbus namespaces registered with
:meth:`NetnsCluster.register_logbus_namespace`; ``ray stop`` is never run
(it ends every Ray process on the machine). A cluster whose creator died
without shutting it down is cleaned up by :func:`cleanup_leftovers` when the
next one starts. Every command and wait is bounded in time.

Needs root and iproute2 (``ip``); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "lbn"  # every namespace and directory this module makes starts with it
SUBNET = "10.77.0"  # /24; no namespace has a route anywhere else
HEAD_IP = f"{SUBNET}.1"
NODE_IP_BASE = 10  # node i (from 1) gets SUBNET.(NODE_IP_BASE + i)
CLIENT_IP = f"{SUBNET}.100"
HEAD_PORT = 6379
BRIDGE = "br0"
HEAD = "head"
CLIENT = "client"
REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "cluster.json"  # in the cluster's directory: who made it, and what to clean up after it

IP_TIMEOUT_S = 30.0
RAY_START_TIMEOUT_S = 180.0
SIGNAL_WAIT_S = 30.0
QUERY_TIMEOUT_S = 180.0
RESULT_MARKER = "LOGBUS-RESULT "  # starts the line that carries a query's answer (see NetnsCluster.python_json)


def unavailable_reason() -> str | None:
    """Why a namespace cluster cannot run here (None if it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def ray_executable() -> str:
    """The ``ray`` command of the running Python's environment."""
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _run(argv: list[str], timeout_s: float = IP_TIMEOUT_S, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def netns_names() -> list[str]:
    """Every network namespace ``ip netns`` knows."""
    output = _ip("netns", "list").stdout
    return [line.split()[0] for line in output.splitlines() if line.strip()]


def _netns_inode(name: str) -> tuple[int, int] | None:
    try:
        found = os.stat(f"/run/netns/{name}")
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def pids_in_netns(name: str) -> list[int]:
    """The processes whose network namespace is ``name`` (zombies excluded: they have exited)."""
    wanted = _netns_inode(name)
    if wanted is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            found = os.stat(f"/proc/{entry}/ns/net")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile, or a zombie
        if (found.st_dev, found.st_ino) == wanted:
            pids.append(int(entry))
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_netns_processes(name: str, timeout_s: float = SIGNAL_WAIT_S) -> None:
    """SIGKILL every process in namespace ``name`` until none is left (children forked meanwhile too)."""
    deadline = time.monotonic() + timeout_s
    while pids := pids_in_netns(name):
        _signal_all(pids, signal.SIGKILL)  # stopped (paused) ones too
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {name} outlived SIGKILL for {timeout_s} s")
        time.sleep(0.05)


def logbus_shm_directory(logbus_namespace: str) -> str:
    """Where logbus keeps one logbus namespace's lease and fence files (see logbus/actors/lease_files.py)."""
    from logbus.actors.lease_files import node_directory  # noqa: PLC0415 (imports Ray; only for the cleanup)

    return os.path.dirname(node_directory(logbus_namespace, "any-node"))


def _process_state(pid: int) -> str | None:
    """A process's state letter (R, S, D, T, Z, ...; field 3 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def cleanup_leftovers() -> list[str]:
    """Delete what clusters of processes that died without shutting them down left: their processes,
    namespaces, directories and logbus's /dev/shm files. Clusters of live processes are left alone.
    Returns the namespaces deleted."""
    owners: dict[int, list[str]] = {}
    for name in netns_names():
        if name.startswith(PREFIX):
            digits = "".join(itertools.takewhile(str.isdigit, name[len(PREFIX):]))
            if digits:
                owners.setdefault(int(digits), []).append(name)
    states = {}
    for directory in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((directory / STATE_FILE).read_text())
            states[directory] = state
            owners.setdefault(int(state["owner_pid"]), [])
    deleted = []
    for pid, names in owners.items():
        own_states = {d: s for d, s in states.items() if int(s["owner_pid"]) == pid}
        started = {s.get("owner_start") for s in own_states.values()}
        if _process_start(pid) is not None and (not own_states or _process_start(pid) in started):
            continue  # its creator lives
        for name in sorted(names, key=lambda n: n.endswith("-br")):  # hosts first, the bridge last
            kill_netns_processes(name)
            _ip("netns", "delete", name, check=False)
            deleted.append(name)
        for directory, state in own_states.items():
            for namespace in state.get("logbus_namespaces", []):
                shutil.rmtree(logbus_shm_directory(namespace), ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)
    if deleted:
        logger.warning("deleted namespaces left by dead processes: %s", deleted)
    return deleted


@dataclasses.dataclass
class Host:
    """One host: its namespace, address, bridge port and Ray temp dir."""

    role: str
    netns: str
    ip: str
    port: str  # its port on the bridge, in the bridge's namespace
    directory: Path  # HOME and Ray's --temp-dir live here
    replica_slots: int = 0
    rack: str = ""

    @property
    def temp_dir(self) -> Path:
        return self.directory / "ray"

    @property
    def data_dir(self) -> Path:
        """The host's logbus data directory (``logbus join --data-dir``): its identity and its replicas' logs."""
        return self.directory / "data"


_cluster_numbers = itertools.count()


class NetnsCluster:
    """A Ray head, ``nodes`` replica nodes and a client host, each in a network namespace of its own.

    ``replica_slots`` per node (the ``logbus_replica`` resource), ``racks`` (a
    rack label per node, e.g. ``["r1", "r2", "r3"]``; default one rack per
    node). Use as a context manager, or call :meth:`start` and
    :meth:`shutdown`. Not thread-safe: one thread drives faults.
    """

    def __init__(self, nodes: int = 3, replica_slots: int = 8, racks: list[str] | None = None, keep_directory: bool = False) -> None:
        if reason := unavailable_reason():
            raise RuntimeError(reason)
        if not 1 <= nodes <= 80:
            raise ValueError("nodes must be between 1 and 80")
        self.name = f"{PREFIX}{os.getpid()}c{next(_cluster_numbers)}"
        self.directory = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.keep_directory = keep_directory
        self.token_file = self.directory / "auth_token"
        self.logbus_namespaces: list[str] = []
        racks = racks or [f"rack-{i}" for i in range(1, nodes + 1)]
        self.hosts: dict[str, Host] = {HEAD: self._host(HEAD, HEAD_IP)}
        for i in range(1, nodes + 1):
            self.hosts[f"n{i}"] = self._host(f"n{i}", f"{SUBNET}.{NODE_IP_BASE + i}", replica_slots, racks[(i - 1) % len(racks)])
        self.hosts[CLIENT] = self._host(CLIENT, CLIENT_IP)
        self.bridge_netns = f"{self.name}-br"
        self.cut_hosts: set[str] = set()
        self.cut_pairs: set[frozenset[str]] = set()
        self.paused: set[str] = set()
        self.started = False

    def _host(self, role: str, ip: str, replica_slots: int = 0, rack: str = "") -> Host:
        return Host(role, f"{self.name}-{role}", ip, f"p-{role}", self.directory / role, replica_slots, rack)

    @property
    def address(self) -> str:
        """The Ray head's GCS address (inside the namespaces only)."""
        return f"{HEAD_IP}:{HEAD_PORT}"

    @property
    def nodes(self) -> list[str]:
        """The roles of the replica nodes: n1, n2, ..."""
        return [role for role in self.hosts if role not in (HEAD, CLIENT)]

    def __enter__(self) -> NetnsCluster:
        try:
            return self.start()
        except BaseException:
            self.shutdown()
            raise

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- building -------------------------------------------------------------------------------------

    def _write_state(self) -> None:
        state = {"owner_pid": os.getpid(), "owner_start": _process_start(os.getpid()), "name": self.name,
                 "logbus_namespaces": self.logbus_namespaces}
        (self.directory / STATE_FILE).write_text(json.dumps(state))

    def register_logbus_namespace(self, namespace: str) -> None:
        """Note a logbus namespace used on this cluster, so that shutdown deletes its /dev/shm files."""
        if namespace not in self.logbus_namespaces:
            self.logbus_namespaces.append(namespace)
            self._write_state()

    def start(self) -> NetnsCluster:
        """Build the network, start the head, join every node and the client host; wait until all are up."""
        cleanup_leftovers()
        self._write_state()
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.started = True
        _ip("netns", "add", self.bridge_netns)
        _ip("-n", self.bridge_netns, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.bridge_netns, "link", "set", BRIDGE, "up")
        for host in self.hosts.values():
            self._plumb(host)
        self._start_head()
        for role in [*self.nodes, CLIENT]:
            self.join(role)
        self.wait_for_nodes(len(self.hosts))
        return self

    def _plumb(self, host: Host) -> None:
        """The host's namespace, its end of a veth pair (eth0, its address) and the other end on the bridge."""
        host.temp_dir.mkdir(parents=True)
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("-n", host.netns, "link", "add", "eth0", "type", "veth", "peer", "name", host.port, "netns", self.bridge_netns)
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", self.bridge_netns, "link", "set", host.port, "master", BRIDGE)
        _ip("-n", self.bridge_netns, "link", "set", host.port, "up")

    def add_host(self, role: str, replica_slots: int = 0, rack: str = "") -> Host:
        """A further host on the bridge (the next free address), not joined to Ray: :meth:`join` does that."""
        if role in self.hosts or not role.isalnum() or len(role) > 8:
            raise ValueError(f"a new host needs a new alphanumeric role of at most 8 characters, not {role!r}")
        taken = {host.ip for host in self.hosts.values()}
        ip = next(f"{SUBNET}.{i}" for i in range(NODE_IP_BASE + 1, 99) if f"{SUBNET}.{i}" not in taken)
        host = self._host(role, ip, replica_slots, rack)
        self.hosts[role] = host
        self._plumb(host)
        return host

    def reachable(self, source: str, target: str, timeout_s: float = 2.0) -> bool:
        """Whether a TCP connection from ``source`` to a listener on ``target``'s address opens within ``timeout_s``."""
        listener = (
            "import socket, sys\n"
            "server = socket.create_server((sys.argv[1], 0))\n"
            "server.settimeout(float(sys.argv[2]))\n"
            "print(server.getsockname()[1], flush=True)\n"
            "try:\n"
            "    server.accept()\n"
            "except TimeoutError:\n"
            "    pass\n"
        )
        connector = (
            "import socket, sys\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
            "except OSError:\n"
            "    sys.exit(1)\n"
        )
        server = self.popen(target, [sys.executable, "-c", listener, self.hosts[target].ip, str(timeout_s + 5)],
                            stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            client = self.popen(source, [sys.executable, "-c", connector, self.hosts[target].ip, port, str(timeout_s)])
            return client.wait(timeout_s + 30) == 0
        finally:
            server.kill()
            server.wait(SIGNAL_WAIT_S)

    def ray_environment(self, host: Host, token: bool = False) -> dict[str, str]:
        """An environment for a process on ``host``: the caller's without any RAY_* variable, HOME the
        host's own directory; with ``token`` also Ray's token mode and the cluster's token file."""
        env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "LOGBUS_"))}
        env.update(HOME=str(host.directory), PYTHONPATH=str(REPO_ROOT), RAY_USAGE_STATS_ENABLED="0")
        if token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file))
        return env

    def _start_head(self) -> None:
        head = self.hosts[HEAD]
        argv = [ray_executable(), "start", "--head", "--node-ip-address", head.ip, "--port", str(HEAD_PORT),
                "--num-cpus", "0", "--temp-dir", str(head.temp_dir), "--include-dashboard", "false",
                "--disable-usage-stats"]
        self._exec(head, argv, self.ray_environment(head, token=True), RAY_START_TIMEOUT_S)

    def join_argv(self, role: str) -> list[str]:
        """The ``logbus join`` command that makes ``role`` a node of the cluster."""
        host = self.hosts[role]
        argv = [os.path.join(os.path.dirname(sys.executable), "logbus"), "join", "--address", self.address,
                "--token-file", str(self.token_file), "--replica-slots", str(host.replica_slots),
                "--node-ip-address", host.ip, "--temp-dir", str(host.temp_dir), "--num-cpus", "0"]
        if host.replica_slots:
            argv += ["--data-dir", str(host.data_dir)]
        return argv + (["--rack", host.rack] if host.rack else [])

    def node_id(self, role: str) -> str | None:
        """The logbus node id ``role`` joined as (from its data directory), None before its first join."""
        from logbus.storage import node_identity  # noqa: PLC0415 (logbus only where asked)

        meta = node_identity.read(str(self.hosts[role].data_dir))
        return None if meta is None else meta.node_id

    def data_dir_of(self, node_id: str) -> Path | None:
        """The data directory of the host that is logbus node ``node_id`` (None: no host of this cluster is)."""
        return next((host.data_dir for role, host in self.hosts.items() if self.node_id(role) == node_id), None)

    def join(self, role: str) -> None:
        """Start ``role``'s Ray node with ``logbus join`` (not waiting for it to register)."""
        host = self.hosts[role]
        self._exec(host, self.join_argv(role), self.ray_environment(host), RAY_START_TIMEOUT_S)

    def _exec(self, host: Host, argv: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        result = _run(["ip", "netns", "exec", host.netns, *argv], timeout_s=timeout_s, check=False, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} {argv[1]} on {host.role} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    # --- running drivers ----------------------------------------------------------------------------------

    def popen(self, role: str, argv: list[str], env: dict | None = None, token: bool = True, **options) -> subprocess.Popen:
        """Start ``argv`` in ``role``'s namespace with the cluster's Ray environment (token auth on unless
        ``token`` is False), plus ``env``."""
        host = self.hosts[role]
        environment = self.ray_environment(host, token=token) | (env or {})
        return subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], env=environment, cwd=str(REPO_ROOT), **options)

    def popen_python(self, argv: list[str], role: str = CLIENT, **options) -> subprocess.Popen:
        """Start this Python with ``argv`` (a script or ``-m module`` and its arguments) on ``role``."""
        return self.popen(role, [sys.executable, *argv], **options)

    def python(self, code: str, *args: str, role: str = CLIENT, timeout_s: float = QUERY_TIMEOUT_S, **popen_options) -> str:
        """Run ``code`` in a fresh Python on ``role`` (argv: the cluster's address, then ``args``); its stdout.

        The code connects to Ray itself (``ray.init(address=sys.argv[1])``).
        ``popen_options`` go to :meth:`popen` (``env``, ``token``).
        """
        process = self.popen_python(["-c", code, self.address, *args], role=role, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, **popen_options)
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=SIGNAL_WAIT_S)
            raise RuntimeError(f"python on {role} ran past {timeout_s} s:\n{err[-3000:]}") from None
        if process.returncode != 0:
            raise RuntimeError(f"python on {role} exited {process.returncode}:\n{err[-3000:]}")
        return out

    def python_json(self, code: str, *args: str, **options):
        """Run ``code`` as :meth:`python` does; the value it printed with ``print(RESULT, json.dumps(...))``.

        Ray writes warnings of its own to stdout (lagging heartbeats on a busy machine), before or after
        the result, so the result is the line that starts with the marker.
        """
        out = self.python(code, *args, **options)
        for line in reversed(out.splitlines()):
            if line.startswith(RESULT_MARKER):
                return json.loads(line[len(RESULT_MARKER):])
        raise RuntimeError(f"python printed no result line:\n{out[-3000:]}")

    def ray_nodes(self) -> list[dict]:
        """``ray.nodes()`` as the client host sees it (alive, address, resources, labels)."""
        code = (
            "import json, sys, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')\n"
            "print('" + RESULT_MARKER + "' + json.dumps([{k: n.get(k) for k in ('NodeID', 'Alive', 'NodeManagerAddress', 'Resources', 'Labels')}"
            " for n in ray.nodes()]))\n"
        )
        return self.python_json(code)

    def wait_for_nodes(self, count: int, timeout_s: float = QUERY_TIMEOUT_S) -> list[dict]:
        """Wait until ``count`` distinct hosts have a live Ray node; returns the live nodes."""
        code = (
            "import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')\n"
            "count, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])\n"
            "while True:\n"
            "    live = [n for n in ray.nodes() if n['Alive']]\n"
            "    if len({n['NodeManagerAddress'] for n in live}) >= count or time.monotonic() > deadline:\n"
            "        break\n"
            "    time.sleep(0.5)\n"
            "print('" + RESULT_MARKER + "' + json.dumps([{k: n.get(k) for k in ('NodeID', 'NodeManagerAddress', 'Resources', 'Labels')} for n in live]))\n"
        )
        live = self.python_json(code, str(count), str(timeout_s), timeout_s=timeout_s + 120)
        if len({n["NodeManagerAddress"] for n in live}) < count:
            raise AssertionError(f"{count} hosts should have live Ray nodes; live: {sorted(n['NodeManagerAddress'] for n in live)}")
        return live

    def wait_for_node(self, role: str, not_node_id: str | None = None, timeout_s: float = QUERY_TIMEOUT_S) -> dict:
        """Wait until ``role`` has a live Ray node (other than ``not_node_id``: a node restarted); returns it."""
        code = (
            "import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')\n"
            "ip, old, deadline = sys.argv[2], sys.argv[3], time.monotonic() + float(sys.argv[4])\n"
            "found = []\n"
            "while not found and time.monotonic() < deadline:\n"
            "    found = [n for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == ip and n['NodeID'] != old]\n"
            "    time.sleep(0.5)\n"
            "print('" + RESULT_MARKER + "' + json.dumps([{k: n.get(k) for k in ('NodeID', 'NodeManagerAddress', 'Resources', 'Labels')} for n in found]))\n"
        )
        found = self.python_json(code, self.hosts[role].ip, not_node_id or "-", str(timeout_s), timeout_s=timeout_s + 120)
        if not found:
            raise AssertionError(f"{role} ({self.hosts[role].ip}) has no live Ray node after {timeout_s} s")
        return found[0]

    # --- faults -------------------------------------------------------------------------------------------

    def cut(self, role: str) -> None:
        """Cut ``role`` from every other host: its bridge port goes down (every frame to or from it is dropped)."""
        _ip("-n", self.bridge_netns, "link", "set", self.hosts[role].port, "down")
        self.cut_hosts.add(role)

    def heal(self, role: str) -> None:
        """Undo :meth:`cut`."""
        _ip("-n", self.bridge_netns, "link", "set", self.hosts[role].port, "up")
        self.cut_hosts.discard(role)

    def cut_pair(self, a: str, b: str) -> None:
        """Cut ``a`` and ``b`` from each other only (blackhole routes; see the module docstring for why)."""
        if a == b:
            raise ValueError("a pair is two hosts")
        for one, other in ((a, b), (b, a)):
            _ip("-n", self.hosts[one].netns, "route", "replace", "blackhole", f"{self.hosts[other].ip}/32")
        self.cut_pairs.add(frozenset((a, b)))

    def heal_pair(self, a: str, b: str) -> None:
        """Undo :meth:`cut_pair`."""
        for one, other in ((a, b), (b, a)):
            _ip("-n", self.hosts[one].netns, "route", "delete", "blackhole", f"{self.hosts[other].ip}/32", check=False)
        self.cut_pairs.discard(frozenset((a, b)))

    def pids(self, role: str) -> list[int]:
        """Every process of ``role`` (found by its network namespace)."""
        return pids_in_netns(self.hosts[role].netns)

    def kill(self, role: str) -> None:
        """SIGKILL every process of ``role``; the host stays, without a Ray node until :meth:`restart`."""
        kill_netns_processes(self.hosts[role].netns)
        self.paused.discard(role)

    def restart(self, role: str) -> None:
        """Join ``role`` to the cluster again (a new Ray node) after :meth:`kill`, or after Ray declared it dead."""
        if role == HEAD:
            raise ValueError("the head cannot rejoin: its GCS held the cluster's state")
        kill_netns_processes(self.hosts[role].netns)  # a node Ray declared dead may have left processes
        self.paused.discard(role)
        self.join(role)

    def restart_all(self) -> None:
        """A whole-cluster restart: SIGKILL every process of every host, start the head again and join every
        other host again (each with its data directory); returns once every host has a live Ray node."""
        for host in self.hosts.values():
            kill_netns_processes(host.netns)
        self.paused.clear()
        self._start_head()
        for role in [*self.nodes, CLIENT]:
            self.join(role)
        self.wait_for_nodes(len(self.hosts))

    def pause(self, role: str) -> None:
        """SIGSTOP every process of ``role``; returns once each one is stopped (a signal takes effect when its
        process next runs, and a fork may race the first pass, so it signals again until none runs)."""
        deadline = time.monotonic() + SIGNAL_WAIT_S
        while running := [pid for pid in self.pids(role) if _process_state(pid) not in (None, "T", "t")]:
            _signal_all(running, signal.SIGSTOP)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {running} of {role} still ran {SIGNAL_WAIT_S} s after SIGSTOP")
            time.sleep(0.01)
        self.paused.add(role)

    def resume(self, role: str) -> None:
        """SIGCONT every process of ``role``; returns once none is stopped."""
        deadline = time.monotonic() + SIGNAL_WAIT_S
        while stopped := [pid for pid in self.pids(role) if _process_state(pid) in ("T", "t")]:
            _signal_all(stopped, signal.SIGCONT)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {stopped} of {role} still stopped {SIGNAL_WAIT_S} s after SIGCONT")
            time.sleep(0.01)
        self.paused.discard(role)

    def heal_all(self) -> None:
        """Undo every cut, pairwise cut and pause."""
        for role in list(self.paused):
            self.resume(role)
        for pair in list(self.cut_pairs):
            self.heal_pair(*sorted(pair))
        for role in list(self.cut_hosts):
            self.heal(role)

    # --- teardown -------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """SIGKILL every process of the cluster's namespaces, delete the namespaces, the cluster's directory
        and the registered logbus namespaces' /dev/shm files. Safe to call twice, and after a failed start."""
        errors = []
        if self.started:
            for netns in [host.netns for host in self.hosts.values()] + [self.bridge_netns]:
                try:
                    kill_netns_processes(netns)
                except RuntimeError as error:
                    errors.append(str(error))
                _ip("netns", "delete", netns, check=False)
            self.started = False
        for namespace in self.logbus_namespaces:
            shutil.rmtree(logbus_shm_directory(namespace), ignore_errors=True)
        if self.keep_directory:  # kept for its logs: no longer a leftover to clean up
            (self.directory / STATE_FILE).unlink(missing_ok=True)
        else:
            shutil.rmtree(self.directory, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))
