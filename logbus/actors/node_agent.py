"""NodeAgent: one actor per node of a logbus cluster, holding the node's lease and watching its replica processes.

Liveness costs what the cluster has nodes, not what it has replicas: the
agent heartbeats the controller (every 200 ms, pipelined, over a socket:
``heartbeat_link.py``; as a ``node_heartbeat`` actor call while the socket
is down) on behalf of every replica on its node, and writes the lease it
gets into the node's lease file, which the node's leaders read before each
write (``lease_files.py``). A node whose agent falls silent is dead to the
controller after ``LEASE_TIMEOUT_MS``, by which time its leaders' leases have
run out (``LEASE_MS``).

The agent also watches the replica processes of its node, at no cost while
they run: a replica announces its pid in its fence file when it starts
(``register``), and the agent waits on a pidfd for its exit. A process that
exits, or that is stopped (SIGSTOP: a scan of the watched processes' states
in ``/proc`` per tick, one timer for the node), is reported down at once in
an extra heartbeat, and reported up again when it runs (Ray restarts a dead
replica; a stopped one may be continued).

Epochs. The controller tells the agent each partition's current leader
epoch for every replica on the node (``set_epochs``, and in heartbeat
replies whenever the agent is behind); the agent writes them into the
replicas' fence files *before* it extends the lease. A deposed leader, even
one paused while it was deposed, finds a newer epoch there and takes no more
writes; the controller announces a new leader only once every live agent
hosting the partition has applied the new epoch. A replica whose epoch
moved is told (``fence_moved``, given its handle when it registered), so
that one whose role change from the controller does not come asks for it.

Gauges. Ray's metrics agent drops a gauge series not set again within two
report intervals, and an idle partition's log changes rarely. Each leader
publishes its log's gauges in its fence file (``lease_files.py``); the agent
sets them, from its one timer, twice a report interval for every replica of
its node whose process runs and whose published epoch is the partition's
current one, while the node holds its lease (``_export_gauges``): the
node's cost, not a timer per partition.

After a restart (Ray restarts the agent like any actor) the agent starts
with no lease, finds its node's replicas from their fence files, and is
brought up to date by the controller's first reply.

Identity. An agent runs on one Ray node (its actor name and its files are
the Ray node's) and speaks for one logbus node: the host's identity, which
outlives its Ray nodes (``placement.py``). Its heartbeats name both; the
controller renews a node's lease only from the agent on the Ray node it maps
the node to now. It answers an agent on a Ray node the node left ``stale``:
that agent revokes its lease (its leaders stop) and stops heartbeating. An
agent on a Ray node the node is not on yet (a host that joined again, its
agent heartbeating before the controller has moved the node there) is
answered ``wait``: no renewal, and it goes on heartbeating. ``identify`` reads the
host's data directory and records the cluster's id there, before the
controller places anything on the node.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from logbus.actors import metrics
from logbus.actors.heartbeat_link import HeartbeatLink, ReopenPolicy
from logbus.actors.lease_files import NodeLease, ReplicaFence, node_directory
from logbus.actors.logs import configure_logging
from logbus.actors.placement import host_identity
from logbus.clock import monotonic_ms
from logbus.errors import HeartbeatLinkClosedError, HeartbeatRefusedError
from logbus.protocol.liveness import HEARTBEAT_INTERVAL_MS, LEASE_MS, LEASE_TIMEOUT_MS

logger = logging.getLogger(__name__)

HEARTBEATS_IN_FLIGHT_MAX = 5
LINK_OPEN_TIMEOUT_S = 5.0  # asking the controller for its address, and a first connection to it
LINK_SILENT_MS = 2 * LEASE_TIMEOUT_MS  # a link with a heartbeat unanswered this long is dropped and reopened
REPLICA_FILE_PREFIX = "r-"


def gauge_export_interval_ms() -> int:
    """How often the agent sets its leaders' gauges: Ray's metrics report interval (Ray floors it at 1 s),
    within which a gauge must be set again to stay on the endpoint."""
    try:
        return max(int(ray._config.metrics_report_interval_ms()), 1_000)
    except Exception:  # noqa: BLE001 (a Ray without this setting: its default)
        return 10_000


def _process_state(pid: int, stat_fd: int | None = None) -> str | None:
    """The state letter of a process (``R``, ``S``, ``T`` for stopped, ...), or None if it is gone.

    With ``stat_fd`` (its ``/proc/PID/stat`` kept open) one ``pread``: the kernel writes the file
    afresh at each read from offset 0.
    """
    try:
        if stat_fd is not None:
            data = os.pread(stat_fd, 512, 0)
        else:
            with open(f"/proc/{pid}/stat", "rb") as file:
                data = file.read()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ')'.
    end = data.rfind(b")")
    return data[end + 2 : end + 3].decode() if end >= 0 else None


def _partition_of(name: str) -> int:
    """The partition in a replica file's name (``lease_files.replica_file_name``: r-TOPICID-PARTITION-REPLICA)."""
    try:
        return int(name.rsplit("-", 2)[1])
    except (IndexError, ValueError):
        return -1


class _Watched:
    __slots__ = ("fence", "pid", "pidfd", "stat_fd", "replica", "topic", "partition")

    def __init__(self, fence: ReplicaFence, partition: int) -> None:
        self.fence = fence
        self.topic = ""  # the topic's name, read from the fence once the replica wrote it
        self.partition = partition
        self.pid = 0
        self.pidfd: int | None = None
        self.stat_fd: int | None = None
        self.replica = None  # the replica actor's handle, told when its fence epoch moves


class NodeAgent:
    """The node's lease holder and replica watcher (see the module docstring)."""

    def __init__(self, namespace: str, node_id: str, controller_name: str, logbus_node_id: str | None = None) -> None:
        configure_logging()
        self.namespace = namespace
        self.node_id = node_id  # the Ray node's id: the agent's name and its files are the Ray node's
        self.logbus_node_id = logbus_node_id or node_id  # the node it speaks for (placement.py)
        self.stale = False  # the controller maps the node to another Ray node now: no more heartbeats
        self.controller_name = controller_name
        self.directory = node_directory(namespace, node_id)
        os.makedirs(self.directory, exist_ok=True)
        self.lease = NodeLease(self.directory)
        self.lease.revoke()  # a new agent holds no lease until the controller answers it
        self.incarnation = uuid.uuid4().hex
        self.epochs_version: list | None = None  # the controller's epoch table version applied here
        self._replicas: dict[str, _Watched] = {}  # replica file name -> what is watched
        self._down: set[str] = set()  # replicas whose process exited or is stopped
        self._controller_handle = None
        self._link: HeartbeatLink | None = None  # the heartbeat's socket to the controller (heartbeat_link.py)
        self._link_task: asyncio.Task | None = None
        self._reopen = ReopenPolicy()  # when the link is tried again, and to which address
        self._links_dropped = 0  # closed, or silent for LINK_SILENT_MS
        self._heartbeat_applied = 0
        self._urgent: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # Twice a report interval: Ray drops a gauge whose last setting reached it two intervals ago, and
        # this loop's ticks drift against the worker's export timer.
        self._gauges_every_ms = gauge_export_interval_ms() // 2
        self._gauges_at_ms = 0  # when the leaders' gauges were last set
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(REPLICA_FILE_PREFIX):
                self._track(name)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start()

    # --- replicas ----------------------------------------------------------------------------------

    def _track(self, name: str) -> _Watched:
        watched = self._replicas.get(name)
        if watched is None:
            watched = self._replicas[name] = _Watched(ReplicaFence.at(os.path.join(self.directory, name)), _partition_of(name))
        pid = watched.fence.pid
        if pid and pid != watched.pid:
            self._watch(name, watched, pid)
        return watched

    def _watch(self, name: str, watched: _Watched, pid: int) -> None:
        self._unwatch(watched)
        watched.pid = pid
        try:
            watched.pidfd = os.pidfd_open(pid)
            watched.stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except (ProcessLookupError, OSError):
            self._set_down(name, True)
            return
        self._set_down(name, _process_state(pid) in (None, "T", "t", "Z", "X"))
        try:
            asyncio.get_running_loop().add_reader(watched.pidfd, self._exited, name, pid)
        except RuntimeError:
            pass  # no loop yet (constructor): _start() adds the readers

    def _unwatch(self, watched: _Watched) -> None:
        if watched.pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(watched.pidfd)
            except RuntimeError:
                pass
            os.close(watched.pidfd)
            watched.pidfd = None
        if watched.stat_fd is not None:
            os.close(watched.stat_fd)
            watched.stat_fd = None

    def _exited(self, name: str, pid: int) -> None:
        watched = self._replicas.get(name)
        if watched is None or watched.pid != pid:
            return
        self._unwatch(watched)
        self._set_down(name, True)

    def _set_down(self, name: str, down: bool) -> None:
        if down == (name in self._down):
            return
        if down:
            self._down.add(name)
        else:
            self._down.discard(name)
        logger.info("node %s: replica %s %s", self.node_id[:8], name, "down" if down else "up")
        if self._urgent is not None:
            self._urgent.set()  # tell the controller now, not at the next tick

    async def register(self, name: str, pid: int, replica=None) -> None:
        """A replica process started (or restarted) on this node: watch it (and, given its handle,
        tell it when its fence epoch moves)."""
        self._start()
        watched = self._track(name)
        if replica is not None:
            watched.replica = replica
        self._watch(name, watched, pid)

    async def replica_started(self, topic: str, partition: int, replica_id: int) -> dict:
        """A starting replica's question for the controller (its role), asked on its behalf.

        Ray imports an actor's module into every process that holds a handle
        to it; asking through the agent keeps the controller's module (about
        35 ms of start-up, and its memory) out of replicas that never call the
        controller themselves (a leader without followers never does).
        """
        controller = await self._controller()
        try:
            return await controller.replica_started.remote(topic, partition, replica_id)
        except Exception:
            self._controller_handle = None  # restarting: look it up again on the replica's retry
            raise

    async def forget(self, names: list[str]) -> None:
        """Replicas deleted with their topic: stop watching them and remove their fence files."""
        for name in names:
            watched = self._replicas.pop(name, None)
            self._down.discard(name)
            if watched is not None:
                self._unwatch(watched)
                watched.fence.remove()

    async def set_epochs(self, version: list, epochs: dict[str, int]) -> list:
        """The controller's current leader epochs for replicas on this node; returns the version applied."""
        self._start()
        self._apply_epochs(version, epochs)
        return self.epochs_version

    def _apply_epochs(self, version: list, epochs: dict[str, int]) -> None:
        """Write each replica's new epoch into its fence; then tell the replicas whose epoch moved on
        (one call each, per election), so that one that misses its role change asks for it."""
        moved = []
        for name, epoch in epochs.items():
            watched = self._track(name)
            if watched.fence.current_epoch != epoch:
                if epoch > watched.fence.current_epoch and watched.replica is not None:
                    moved.append(watched.replica)
                watched.fence.current_epoch = epoch
        self.epochs_version = list(version)
        for replica in moved:
            try:
                replica.fence_moved.remote()  # not awaited: the replica compares the fence with its own epoch
            except Exception:  # noqa: BLE001 (a replica gone: Ray restarts it, and it asks when it starts)
                pass

    async def shut_down(self) -> None:
        """The cluster is being torn down: stop heartbeating and remove this node's files."""
        if self._task is not None:
            self._task.cancel()
        if self._link is not None:
            self._link.close()
        for watched in self._replicas.values():
            self._unwatch(watched)
            watched.fence.remove()
        self._replicas.clear()
        self.lease.revoke()
        self.lease.close()
        try:
            os.unlink(self.lease.path)
            os.rmdir(self.directory)
            os.rmdir(os.path.dirname(self.directory))  # the cluster's directory, once no node of it is left here
        except OSError:
            pass  # something else still there

    async def usage(self) -> dict:
        """Memory of this node's replica processes (for `logbus status`): how many, and their mean USS."""
        import psutil  # noqa: PLC0415 (only when asked)

        uss = []
        for watched in self._replicas.values():
            if watched.pid and watched.pidfd is not None:
                try:
                    uss.append(psutil.Process(watched.pid).memory_full_info().uss)
                except (psutil.Error, OSError):
                    pass
        return {"replica_processes": len(uss), "uss_mean_bytes": int(sum(uss) / len(uss)) if uss else None}

    async def ping(self) -> int:
        self._start()
        return os.getpid()

    async def status(self) -> dict:
        """This agent's process, whether its heartbeat link is open, and how many links it dropped
        (closed, or unanswered for LINK_SILENT_MS) since it started."""
        self._start()
        link = self._link
        return {"pid": os.getpid(), "heartbeat_link_open": link is not None and not link.closed,
                "heartbeat_links_dropped": self._links_dropped}

    async def identify(self, cluster_id: str) -> dict:
        """The host's identity, checked, with ``cluster_id`` recorded on first use (``placement.host_identity``):
        ``{"node_id", "data_dir"}``. InconsistentClusterIdError for a data directory of another cluster."""
        return await asyncio.to_thread(host_identity, self.logbus_node_id, cluster_id)

    # --- the one timer of the node -----------------------------------------------------------------

    def _start(self) -> None:
        if self._task is not None or self.stale:
            return
        self._urgent = asyncio.Event()
        loop = asyncio.get_running_loop()
        for name, watched in self._replicas.items():
            if watched.pidfd is not None:
                loop.add_reader(watched.pidfd, self._exited, name, watched.pid)
        self._task = loop.create_task(self._run())

    async def _controller(self):
        if self._controller_handle is None:
            self._controller_handle = await asyncio.to_thread(ray.get_actor, self.controller_name, namespace=self.namespace)
        return self._controller_handle

    async def _run(self) -> None:
        sequence = 0
        outstanding: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        while True:
            self._scan_states()
            now_ms = monotonic_ms()
            if now_ms - self._gauges_at_ms >= self._gauges_every_ms and now_ms < self.lease.expires_ms:
                self._gauges_at_ms = now_ms
                self._export_gauges()
            if len(outstanding) < HEARTBEATS_IN_FLIGHT_MAX:
                sequence += 1
                task = loop.create_task(self._heartbeat(sequence))
                outstanding.add(task)
                task.add_done_callback(outstanding.discard)
            self._urgent.clear()
            try:
                await asyncio.wait_for(self._urgent.wait(), HEARTBEAT_INTERVAL_MS / 1000)
            except asyncio.TimeoutError:
                pass

    def _scan_states(self) -> None:
        """Stopped (or continued) replica processes: SIGSTOP leaves no other trace."""
        for name, watched in self._replicas.items():
            if watched.pidfd is None:
                continue
            state = _process_state(watched.pid, watched.stat_fd)
            if state is not None:
                self._set_down(name, state in ("T", "t"))

    def _export_gauges(self) -> None:
        """Set the gauges of each leader of this node from its fence file (see the module docstring):
        a few 8-byte reads and four gauge settings per leader, twice a report interval, while the node
        holds its lease (a node cut off from the controller may have been replaced as leader of each of
        its partitions: its fences keep the old epochs until the controller is heard again)."""
        failed = None
        for name, watched in self._replicas.items():
            if watched.pidfd is None or name in self._down or watched.partition < 0:
                continue  # a process that is gone or stopped serves nothing: its gauges leave with it
            published = watched.fence.published()
            if published is None:
                continue
            if not watched.topic:
                watched.topic = watched.fence.label
                if not watched.topic:
                    continue
            try:
                metrics.export_published(watched.topic, watched.partition, published)
            except Exception as error:  # noqa: BLE001 (metrics are not worth the heartbeat's loop)
                failed = failed or (name, error)
        if failed is not None:
            logger.warning("node %s: could not set the gauges of %s (and maybe others): %s", self.node_id[:8], *failed)

    async def _heartbeat(self, sequence: int) -> None:
        sent_ms = monotonic_ms()
        down = sorted(self._down)
        link = self._usable_link(sent_ms)
        try:
            if link is not None:
                message = {"node": self.logbus_node_id, "ray_node": self.node_id, "incarnation": self.incarnation, "down": down,
                           "version": self.epochs_version}
                reply = await asyncio.wait_for(link.call(message, sent_ms), timeout=LEASE_MS / 1000)
            else:
                controller = await self._controller()
                reply = await asyncio.wait_for(
                    controller.node_heartbeat.remote(self.logbus_node_id, self.incarnation, down, self.epochs_version, self.node_id),
                    timeout=LEASE_MS / 1000,
                )
        except asyncio.TimeoutError:
            return  # a slow controller: no renewal from this one; the next ones are on their way
        except (HeartbeatLinkClosedError, HeartbeatRefusedError):
            return  # the link closed (reopened in the background) or the controller refused this one
        except Exception:  # noqa: BLE001 (the controller is restarting: look it up again)
            self._controller_handle = None
            return
        if reply.get("stale"):
            self._go_stale()
            return
        if reply.get("wait"):
            return  # the controller is starting and has not found this node yet: no renewal
        if reply.get("epochs") is not None:
            self._apply_epochs(reply["version"], reply["epochs"])  # before the lease: fences first
        if sequence <= self._heartbeat_applied:
            return  # overtaken by a later heartbeat's reply, which renewed the lease further
        self._heartbeat_applied = sequence
        if reply.get("version") == self.epochs_version:
            self.lease.extend(sent_ms + LEASE_MS)

    def _go_stale(self) -> None:
        """The controller maps this node to another Ray node now (the host joined again): revoke the lease,
        so this Ray node's leaders take no more writes, and stop heartbeating."""
        if self.stale:
            return
        self.stale = True
        self.lease.revoke()
        logger.warning("node %s: the controller maps node %s to another Ray node now; this agent stops heartbeating",
                       self.node_id[:8], self.logbus_node_id)
        if self._link is not None:
            self._link.close()
        if self._task is not None:
            self._task.cancel()

    def _usable_link(self, now_ms: int) -> HeartbeatLink | None:
        """The open heartbeat link, or None (heartbeat through Ray) while one is being opened."""
        link = self._link
        if link is not None:
            since = link.unanswered_since_ms()
            if not link.closed and (since is None or now_ms - since <= LINK_SILENT_MS):
                return link
            logger.info("node %s: heartbeat link %s; reopening it", self.node_id[:8], "closed" if link.closed else "silent")
            link.close()
            self._link = None
            self._links_dropped += 1
        if self._link_task is None and self._reopen.due(now_ms):
            self._link_task = asyncio.get_running_loop().create_task(self._open_link())
        return None

    async def _open_link(self) -> None:
        """Open the heartbeat link: to the address it had if that worked before (a cut network healing),
        else to the one the controller gives now (``ReopenPolicy``)."""
        reopen = self._reopen
        try:
            if reopen.address is None:
                controller = await self._controller()
                reopen.asked(await asyncio.wait_for(controller.heartbeat_address.remote(), LINK_OPEN_TIMEOUT_S))
            self._link = await HeartbeatLink.open(reopen.address, reopen.connect_timeout_s(LINK_OPEN_TIMEOUT_S))
            reopen.opened()
        except Exception as error:  # noqa: BLE001 (heartbeats go through Ray until a later try succeeds)
            quiet = reopen.proven
            delay_ms = reopen.failed(monotonic_ms(), refused=isinstance(error, ConnectionRefusedError))
            # Said loudly once: tries keep failing (a firewall between nodes?), and heartbeats cost more.
            log = logger.warning if reopen.slowest else logger.debug if quiet and reopen.failures > 1 else logger.info
            log("node %s: no heartbeat link to the controller (%s: %s); heartbeats are actor calls meanwhile, next try in %.2f s",
                self.node_id[:8], type(error).__name__, error, delay_ms / 1000)
        finally:
            self._link_task = None


def agent_actor_name(node_id: str) -> str:
    return f"logbus-node-agent:{node_id}"


@functools.cache
def _agent_actor_class():
    """The agent's Ray actor class, made once per process (see partition_replica's ``_replica_actor_class``)."""
    return ray.remote(NodeAgent)


def start_agent(namespace: str, node_id: str, controller_name: str, logbus_node_id: str | None = None):
    """Get or create the agent of the Ray node ``node_id``, pinned there, speaking for ``logbus_node_id``
    (by default the Ray node's own id: a node without a logbus label)."""
    return (
        _agent_actor_class()
        .options(
            name=agent_actor_name(node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        )
        .remote(namespace, node_id, controller_name, logbus_node_id)
    )
