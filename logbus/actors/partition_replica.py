"""PartitionReplica: the actor that owns one partition replica's log on its node.

The actor is the transport, the timers and the lease files over parts that
each have one job (Kafka's Partition, fetcher and purgatory):

- ``protocol/replica_state.py`` (no Ray, no I/O): the role and epoch, a
  leader's ISR and high watermark, a follower's decisions (truncation by
  leader epoch, a fetch out of range, the leader's log start and high
  watermark), the fence rule. It returns actions (truncate, propose an ISR,
  arm a timer, ask for the role, ...) that ``_run`` carries out;
- ``replica_fetcher.py``: a follower's fetch loop, the calls to its leader
  (over ``fetch_link.py``'s TCP link once it is open);
- ``fetch_parking.py``: fetches parked at the log end (long polls) and
  acks=all produces waiting for their commit;
- ``protocol/fetch_sessions.py``: consumers' fetch sessions;
- ``fetch_packaging.py``: a read packaged for its transport, an actor call
  (bytes, or one copy into the object store) or the local channel (a view);
- ``cleaning_schedule.py``: when the log is compacted, and the cleaning;
- ``timers.py``: the named one-shot timers the replica arms.

It receives encoded batches (bytes or uint8 arrays, never Arrow objects),
appends them, and serves fetches as a copy of whole batches. Clients send
produce requests and fetches over the replica's channel, served on the same
event loop (``channel_server.py``): a Unix socket for clients on the same
node, TCP for clients on other nodes; the same methods, without Ray's
per-call cost.

Roles. The controller decides who leads: ``become_leader`` /
``become_follower`` carry the new leader epoch. A follower pulls from the
leader through ``replica_fetch`` (the same read path consumers use, but up to
the log end rather than the high watermark) and appends the bytes unchanged.
Before it follows a new leader it truncates by leader epoch (KIP-101/279):
it asks the leader where its own latest epoch ended and cuts its log there,
never merely to its own high watermark.

Leases and fences, with no call. A replica holds no lease of its own: its
node's agent holds one for the whole node (``node_agent.py``) and writes it,
with the partition's current leader epoch, into small shared-memory files the
replica maps (``lease_files.py``). A leader takes a write only while the
node's lease holds and its own epoch is the current one: two 8-byte reads. So
a leader that was cut off stops before the controller may elect another
(``LEASE_TIMEOUT_MS`` > ``LEASE_MS``, ``protocol/liveness.py``), and one that
was deposed while paused refuses once it runs again: at most one replica
accepts writes for a partition at any time.

Nothing runs on a timer while a replica is idle. A replica that starts (or
that Ray restarted) tells its node agent its pid and asks the controller for
its role (``replica_started``, through the agent, so that the replica's
process need not load the controller's class); role changes come as calls,
which the controller sends again until they are acknowledged, and a replica
whose fence epoch stays past its own for a second (the agent says when it
moves the fence; requests and a follower's fetches look too) asks again,
once per fence epoch. The leader checks its ISR when something happens (a
follower's fetch, a produce) and arms one timer only while an in-sync
follower is behind; retention arms one timer for when its oldest data
expires, interval flushes one after an append, and compaction one for when
the log may next need cleaning. A follower long-polls its leader with a long
wait (half the lag time), so an idle follower costs one call per few
seconds, and a follower whose fetch waits at the leader's end counts as in
sync for that long.

It is an async actor: every method runs on one event loop, so calls are
serialised between awaits and the log (not thread-safe) is only touched from
that loop. Ray may start one caller's calls out of order; batches of an
idempotent producer that overtook their predecessors wait for them (see
``_wait_for_earlier_batches``), so they land in the order they were sent.

All durable state is rebuilt from disk in ``__init__`` (Ray reruns only the
constructor on restart); the role is relearned from the controller. That is
also what a broken invariant leads to (``logbus/invariant.py``, a post-condition
of the log, a rule of the replication state): the process logs it and ends
where it was found (``invariant_exit.py``), and Ray starts it again.

Transactions (KIP-98). ``produce`` takes a transactional producer's batches
as any idempotent producer's (the producer registered the partition with its
coordinator first; the leader does not check that, as Kafka before KIP-890).
The coordinator ends a transaction with ``write_txn_markers``: the leader
appends one marker (control batch) per transaction, with acks=all. A
read_committed fetch (``FetchRequest.isolation_level``) reads up to the last
stable offset, the smaller of the high watermark and the first offset of the
oldest ongoing transaction, and its reply names the aborted transactions it
overlaps (from the log's transaction indexes). A long-polling fetch waits on
the same wakeup as any (appends and high-watermark moves), and those are what
move the last stable offset. Followers copy markers like any batch.

Retry contract: a produce that failed may have been appended (the caller
cannot tell a lost reply from a lost request); the idempotent producer's
sequence numbers make its retries safe. Fetches and offset queries are
idempotent.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import struct

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from logbus.actors import metrics
from logbus.actors.channel_server import ChannelServer, tcp_allowed
from logbus.actors.cleaning_schedule import CleaningSchedule
from logbus.actors.fetch_link import FetchLinkServer
from logbus.actors.fetch_packaging import FetchPackaging
from logbus.actors.fetch_parking import FetchParking
from logbus.actors.invariant_exit import exit_on_violation
from logbus.actors.lease_files import NodeLease, ReplicaFence, may_write, node_directory, replica_file_name
from logbus.actors.node_agent import agent_actor_name
from logbus.actors.replica_fetcher import ReplicaFetcher
from logbus.actors.tiering import TierSchedule
from logbus.actors.timers import Timers
from logbus.clock import monotonic_ms, wall_ms
from logbus.errors import (
    DataDirectoryInUseError,
    InvalidRecordError,
    LogbusError,
    NotEnoughReplicasError,
    NotLeaderError,
    OffsetOutOfRangeError,
    ProducerFencedError,
    RequestTimedOutError,
)
from logbus.invariant import check as _check
from logbus.protocol import jvm_fetch
from logbus.protocol import local_channel as wire
from logbus.protocol.fetch_sessions import FetchSessions
from logbus.protocol.liveness import LEASE_MS
from logbus.protocol.messages import (
    FETCH_MAX_BYTES_MAX,
    FETCH_WAIT_MS_MAX,
    PRODUCE_TIMEOUT_MS_DEFAULT,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    FetchRequest,
    FetchResponse,
    ProduceResponse,
)
from logbus.protocol.replica_state import (
    ISR_TIMER,
    LEADER,
    ROLE_TIMER,
    ArmTimer,
    AskRole,
    DisarmTimer,
    HighWatermarkMoved,
    LeaderState,
    LeadershipChanged,
    ProposeIsr,
    ReplicaState,
    SaveEpoch,
    StartFollowing,
    StopFollowing,
    apply_to_log,
)
from logbus.storage import batch_header as bh
from logbus.storage.dir_lock import DirectoryLock
from logbus.storage.files import write_atomically
from logbus.storage.log_config import LOG_APPEND_TIME, LogConfig
from logbus.storage.partition_log import PartitionLog, ReadResult

logger = logging.getLogger(__name__)

STATE_FILE = "replica.json"
OWNER_LOCK_FILE = "owner.lock"  # held for the process's lifetime: one process per replica directory
OWNER_LOCK_WAIT_S = 30.0  # a restarted replica waits this long for a predecessor still exiting
ALTER_ISR_TIMEOUT_S = 5.0
LEASE_WAIT_MS = LEASE_MS  # a write finding the node's lease lapsed waits this long for a renewal
LEASE_POLL_S = 0.01  # ... checking the lease file this often (only while it waits)
START_RETRY_S = 0.2  # telling the agent and the controller that this replica started is retried this often
RETENTION_FAILED_RETRY_S = 60.0  # retention that failed is tried again this soon
# A consumer that reads the remote tier itself gets at most this many of the tier's next files (and,
# past the first, this many of their bytes) at a time; it asks the leader again past them, so what it
# reads is never far behind what retention and DeleteRecords have done since.
TIER_PLAN_FILES = 16
TIER_PLAN_BYTES = 64 << 20
PRODUCE_TIMEOUT_MS_MAX = 120_000
REORDER_WAIT_S = 0.3  # how long a batch that overtook its predecessors waits for them (short: after a
# failover the missing batch may sit behind the waiting ones in the producer)


def _actor_ref(handle):
    """Which actor a handle names (a replica re-created under its old id is another actor), or None."""
    return None if handle is None else handle._actor_id


class PartitionReplica:
    """One replica of one partition (see the module docstring)."""

    def __init__(
        self,
        topic: str,
        partition: int,
        replica_id: int,
        directory: str,
        config: dict,
        leader_epoch: int,
        namespace: str | None = None,
        controller_name: str | None = None,
        topic_id: str = "",
    ) -> None:
        self.topic = topic
        self.topic_id = topic_id
        self.partition = partition
        self.replica_id = replica_id
        self.directory = directory
        self.namespace = namespace
        self.controller_name = controller_name
        os.makedirs(directory, exist_ok=True)
        self._owner_lock = DirectoryLock(os.path.join(directory, OWNER_LOCK_FILE))
        if not self._owner_lock.acquire(OWNER_LOCK_WAIT_S):
            note = self._owner_lock.read_note() or {}
            raise DataDirectoryInUseError(
                f"replica directory {directory} is in use by another process (pid {note.get('pid', '?')}); "
                "a replica's files are never opened twice"
            )
        self._owner_lock.write_note({"replica": f"{topic}-{partition}/{replica_id}"})
        state = self._load_state() or {"config": dict(config), "leader_epoch": -1}
        self.config_overrides = state["config"]
        self.log = PartitionLog(directory, LogConfig.from_dict(self.config_overrides))
        self._label = f"{topic}-{partition}/{replica_id}"
        # Role, epoch (of the role held, -1 before any) and the replication decisions: sans-IO.
        self.state = ReplicaState(
            replica_id, int(state["leader_epoch"]), partition_name=f"{topic}-{partition}", controlled=controller_name is not None
        )
        self._deleted = False  # no more background work (being deleted, or the controller no longer has us)
        self._removing = False  # delete() began: every call from here on gets NotLeaderError
        self._timers = Timers(lambda: not self._deleted)  # "isr", "role", "retention", "flush", "clean"
        self._timer_callbacks = {ISR_TIMER: self._check_isr, ROLE_TIMER: self._role_timer_fired}
        self._parking = FetchParking()
        self._sessions = FetchSessions()  # consumers' fetch sessions while leading
        self._packaging = FetchPackaging(f"{topic}-{partition}")
        self._cleaning = CleaningSchedule(
            self.log, self._timers, lambda: self.high_watermark, self._packaging.forget, self._log_shrank, self._label,
            active=lambda: not self._deleted,
        )
        self._tiering = TierSchedule(
            self.log, self._timers, topic, topic_id, partition, directory,
            leading=lambda: self.role == LEADER, epoch=lambda: self.leader_epoch,
            upload_bound=lambda: self.last_stable_offset, uploaded=self._retention_due, label=self._label,
            active=lambda: not self._deleted, publish_sizes=self._publish_tier_sizes,
        )
        self._fetcher = ReplicaFetcher(
            self.state, self.log, self._label, self._run, self._check_fence, self._after_follower_append,
            active=lambda: not self._deleted,
        )
        self.leader_handle = None  # the leader followed
        self._offered_leader = None  # the leader handle of the role change being applied
        self._lease: NodeLease | None = None  # the node's lease (None standalone: no controller)
        self._fence: ReplicaFence | None = None  # this replica's pid and its partition's current epoch
        self._controller_handle = None
        self._agent_handle = None  # this node's agent (asked for our role on our behalf)
        self._role_question: asyncio.Task | None = None
        self._isr_proposal: asyncio.Task | None = None  # the ISR change asked of the controller
        self._fetch_waits_expired = 0  # consumers' long polls that ended with no data when their wait ran out
        self._segments_seen = 0
        self._log_gauges = metrics.LogGauges(topic, partition)
        self._loop_ready = False
        self._tasks: list[asyncio.Task] = []
        self._channel = ChannelServer(self._channel_request, f"replica {self._label}")
        self._fetch_links = FetchLinkServer(self._linked_replica_fetch, self._label)  # listens once a follower asks
        self._channel_started: asyncio.Task | None = None
        self._save_state()
        # From here on a broken invariant ends this process, and Ray starts it again from its files
        # (invariant_exit.py). Not before: one found while the log opens is raised from here, and Ray
        # reports the failed start rather than restarting into the same files again and again.
        exit_on_violation(f"replica {self._label}")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the first call starts the background work
        # Ray runs an async actor's constructor on its event loop: say so at once, so a replica
        # that Ray restarted is watched again and relearns its role without waiting for a call.
        self._started()

    # --- state file --------------------------------------------------------------------------

    def _state_path(self) -> str:
        return os.path.join(self.directory, STATE_FILE)

    def _load_state(self) -> dict | None:
        try:
            with open(self._state_path()) as file:
                return json.load(file)
        except (FileNotFoundError, ValueError):
            return None

    def _save_state(self) -> None:
        write_atomically(self._state_path(), json.dumps({"config": self.config_overrides, "leader_epoch": self.leader_epoch}))

    @property
    def leader_epoch(self) -> int:
        """The epoch of the role held (-1 before any)."""
        return self.state.leader_epoch

    @property
    def role(self) -> str:
        return self.state.role

    @property
    def leader_state(self) -> LeaderState | None:
        """The ISR and high watermark bookkeeping, while leading."""
        return self.state.leader

    @property
    def high_watermark(self) -> int:
        return self.state.high_watermark(self.log.log_end_offset)

    @property
    def last_stable_offset(self) -> int:
        """The smaller of the high watermark and the first offset of the oldest ongoing transaction:
        read_committed readers read below it."""
        return self.state.last_stable_offset(self.log)

    def _read_limit(self, isolation_level: int) -> int:
        """Where a consumer's fetch (or an offsets query) ends for its isolation level."""
        return self.state.read_limit(isolation_level, self.log)

    # --- carrying out the replication state's actions ---------------------------------------------------

    def _run(self, actions: list) -> None:
        """Carry out what the replication state decided, in order."""
        for action in actions:
            match action:
                case SaveEpoch():
                    self._save_state()
                case LeadershipChanged():
                    self._packaging.forget()  # a read shared under another leadership may predate a truncation
                    self._sessions.clear()  # so may a session's position
                    self._parking.leadership_changed()  # acks=all waiters on a deposed leader give up
                    self._tiering.leadership_changed()  # a new leader uploads what the tier lacks
                    self._gauges_follow_role()
                case HighWatermarkMoved():
                    if self.role == LEADER:
                        self._parking.high_watermark_moved()  # and consumers long-polling at the old one proceed
                    self._cleaning.high_watermark_moved()
                    self._tiering.bound_moved()
                case StopFollowing():
                    self._fetcher.stop()
                case StartFollowing(epoch=epoch):
                    self.leader_handle = self._offered_leader
                    self._fetcher.start(epoch, self.leader_handle)
                case ProposeIsr():
                    self._isr_proposal = asyncio.get_running_loop().create_task(self._propose_isr(action))
                case ArmTimer(name=name, delay_ms=delay_ms):
                    self._timers.arm(name, delay_ms / 1000, self._timer_callbacks[name])
                case DisarmTimer(name=name):
                    self._timers.disarm(name)
                case AskRole():
                    if not self._deleted and (self._role_question is None or self._role_question.done()):
                        logger.info("replica %s: fence epoch %d is past ours (%d): asking for our role",
                                    self._label, action.fence_epoch, self.leader_epoch)
                        self._role_question = asyncio.get_running_loop().create_task(self._ask_role())
                case _:
                    apply_to_log(self.log, action)

    def _check_isr(self) -> None:
        self._run(self.state.check_isr(self.log, monotonic_ms()))

    def _gauges_follow_role(self) -> None:
        """A new leader publishes its log's gauges now (an idle partition may see no append for long); a
        replica that no longer leads publishes none (``metrics.LogGauges``). Nothing once it is deleted:
        ``delete`` withdraws them itself, and then closes the fence."""
        if self._deleted:
            return
        if self.role == LEADER:
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments), self.leader_epoch, force=True)
        elif self._fence is not None:
            self._fence.withdraw()

    def _publish_tier_sizes(self, remote_bytes: int, lag_bytes: int) -> None:
        if self._deleted:
            return
        if self._fence is not None:
            self._fence.publish_tier(remote_bytes, lag_bytes)
        else:
            metrics.tier_sizes(self.topic, self.partition, remote_bytes, lag_bytes)

    def _role_timer_fired(self) -> None:
        if self._fence is not None:
            self._run(self.state.role_timer_fired(self._fence.current_epoch))

    # --- loop-bound set-up, the controller and the node agent ------------------------------------------

    def _started(self) -> None:
        """Start loop-bound work on first use (the constructor may run outside the event loop).

        Every request starts here: one that reaches a replica being removed
        gets NotLeaderError (retriable: the client asks where the partition's
        leader is now), never the closed log's StorageError.
        """
        if self._removing:
            raise NotLeaderError(f"replica {self.replica_id} of {self.topic}-{self.partition} has been removed")
        if self._loop_ready:
            return
        self._loop_ready = True
        loop = asyncio.get_running_loop()
        if self.controller_name is not None:
            directory = node_directory(self.namespace, ray.get_runtime_context().get_node_id())
            self._lease = NodeLease(directory)
            self._fence = ReplicaFence.of(directory, self.topic_id, self.partition, self.replica_id)
            self._fence.pid = os.getpid()
            self._fence.withdraw()  # what an earlier process of this replica published is not ours
            self._fence.label = self.topic  # the agent exports our gauges under the topic's name
            self._log_gauges.fence = self._fence
            self._gauges_follow_role()
            self._tasks.append(loop.create_task(self._say_started()))
        self._channel_started = loop.create_task(self._channel.start())
        self._arm_retention()
        self._cleaning.arm()
        self._tiering.start()

    async def _controller(self):
        """The controller's handle, looked up off the event loop (the lookup is a blocking GCS call)."""
        if self._controller_handle is None:
            self._controller_handle = await asyncio.to_thread(ray.get_actor, self.controller_name, namespace=self.namespace)
        return self._controller_handle

    async def _agent(self):
        if self._agent_handle is None:
            name = agent_actor_name(ray.get_runtime_context().get_node_id())
            self._agent_handle = await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace)
        return self._agent_handle

    async def _say_started(self) -> None:
        """Once per process: the node agent watches this pid; then the controller says what our role is
        (``_ask_role``)."""
        name = replica_file_name(self.topic_id, self.partition, self.replica_id)
        while not self._deleted:
            try:
                await (await self._agent()).register.remote(name, os.getpid(), ray.get_runtime_context().current_actor)
                break
            except Exception:  # noqa: BLE001 (agent not up yet, or restarting: try again)
                self._agent_handle = None
                await asyncio.sleep(START_RETRY_S)
        await self._ask_role()

    def _check_fence(self) -> None:
        """Look at the fence file (one 8-byte read): the state asks for our role if it stays past our epoch.

        The agent writes a partition's new epoch into the fence before the
        controller tells anyone their role, and tells us (``fence_moved``);
        every request and follower fetch looks too. The controller's own call
        normally follows within milliseconds; a replica that missed it (a
        call lost in a cut network, say) asks once per fence epoch, after a
        one-shot timer, so that an election costs no second call per replica.
        """
        if self._fence is not None and not self._deleted:
            self._run(self.state.on_fence(self._fence.current_epoch))

    async def fence_moved(self) -> None:
        """The node agent wrote a newer epoch into our fence: ask for our role if it is past ours."""
        if self._removing:
            return
        self._started()
        self._check_fence()

    async def _ask_role(self) -> None:
        """Ask the controller (through the node agent, ``NodeAgent.replica_started``) for our role and
        take it; retried until answered."""
        while not self._deleted:
            try:
                reply = await (await self._agent()).replica_started.remote(self.topic, self.partition, self.replica_id)
            except Exception:  # noqa: BLE001 (agent or controller not up yet, or restarting: try again)
                self._agent_handle = None
                await asyncio.sleep(START_RETRY_S)
                continue
            if reply.get("deleted"):
                self._deleted = True
                return
            await self._reconcile(reply)
            return

    async def _reconcile(self, reply: dict) -> None:
        """Adopt the controller's view of the partition if ours is stale."""
        handle = reply["leader_handle"]
        self._offered_leader = handle
        self._run(self.state.reconcile(
            reply["leader"], reply["leader_epoch"], reply["replicas"], reply["isr"], _actor_ref(handle), self.log, monotonic_ms()
        ))

    async def _propose_isr(self, proposal: ProposeIsr) -> None:
        """Ask the controller for the ISR the state proposes; the state takes its answer."""
        try:
            accepted = await asyncio.wait_for(
                (await self._controller()).alter_isr.remote(
                    self.topic, self.partition, self.replica_id, proposal.leader_epoch, list(proposal.isr)
                ),
                timeout=ALTER_ISR_TIMEOUT_S,
            )
        except Exception as error:  # noqa: BLE001 (not answered: it may have been taken; the same is asked again)
            logger.info("replica %s: ISR change %s not answered (%r); asking again", self._label, list(proposal.isr), error)
            self._controller_handle = None
            self._run(self.state.isr_unanswered(proposal.leadership))
            return
        self._run(self.state.isr_answered(proposal.leadership, accepted, self.log, monotonic_ms()))

    # --- leases -------------------------------------------------------------------------------------------

    def _may_write(self) -> bool:
        """The node's lease holds and this leader's epoch is the partition's current one (no call)."""
        if self.controller_name is None:
            return True  # standalone (tests): no controller to hold a lease with
        return may_write(self._lease, self._fence, self.leader_epoch, monotonic_ms())

    async def _lease_held(self) -> bool:
        """``_may_write()``, waiting up to ``LEASE_WAIT_MS`` while only the node's lease has lapsed.

        A lease lapses without a failure when a heartbeat's reply comes late
        (both cores busy, say); the agent's next heartbeat renews it. A write
        arriving meanwhile waits for that rather than failing. Nothing is
        written while the lease is out: the caller checks again before its
        append. A newer epoch in the fence file ends the wait at once.
        """
        if self._may_write():
            return True
        if self._fence is None or self._fence.current_epoch != self.leader_epoch:
            self._check_fence()
            return False
        deadline = monotonic_ms() + LEASE_WAIT_MS
        while monotonic_ms() < deadline:
            await asyncio.sleep(LEASE_POLL_S)
            if self._may_write():
                return True
            if self._fence.current_epoch != self.leader_epoch:
                return False
        return False

    # --- retention, flushes, gauges: one-shot timers instead of periodic work -----------------------------

    def _arm_retention(self) -> None:
        """One timer for the moment the oldest data expires (nothing in between)."""
        due_ms = self.log.next_retention_ms()
        if due_ms is None:
            self._timers.disarm("retention")
        else:
            self._timers.arm("retention", (due_ms - wall_ms()) / 1000, self._retention_due)

    def _retention_due(self) -> None:
        try:
            if self.log.enforce_retention():
                self._log_shrank()
        except LogbusError as error:  # keep serving; try again in a while
            logger.warning("replica %s: retention failed: %s", self._label, error)
            self._timers.arm("retention", RETENTION_FAILED_RETRY_S, self._retention_due)
            return
        self._arm_retention()

    def _log_shrank(self) -> None:
        """Retention, a cleaning or delete_records changed the log's size: a leader's gauges say so now
        (they are otherwise set by appends, which may not come)."""
        if self.role == LEADER:
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments), self.leader_epoch, force=True)

    def _after_append(self) -> None:
        """Timers an append may need: the retention deadline of new data, an interval flush, a cleaning."""
        if "retention" not in self._timers:
            self._arm_retention()
        config = self.log.config
        if len(self.log.segments) != self._segments_seen:
            self._segments_seen = len(self.log.segments)
            if config.retention_bytes >= 0:
                self._retention_due()  # size-bounded topics: check when a segment rolls
            if config.compact:
                self._cleaning.arm()  # a closed segment more: dirty bytes
            self._tiering.segment_rolled()  # a closed segment more to upload
        self._tiering.bound_moved()  # a transaction marker may have moved the last stable offset
        if config.flush_policy == "interval" and "flush" not in self._timers:
            self._timers.arm("flush", config.flush_ms / 1000, self._flush_due)

    def _after_follower_append(self, unstable_before: int | None) -> None:
        """A follower compacts its own copy: a rolled segment may make a cleaning due, and so may a
        marker that ended the transaction holding cleanings back (``unstable_before``: the log's first
        unstable offset before the append). In a tiered topic a rolled segment makes the follower look
        at how far the tier reaches (its local retention deletes what the tier holds)."""
        if self.log.config.remote_storage_enable and len(self.log.segments) != self._segments_seen:
            self._segments_seen = len(self.log.segments)
            self._tiering.segment_rolled()
            return
        if not self.log.config.compact:
            return
        if unstable_before is not None and self.log.first_unstable_offset() != unstable_before:
            self._cleaning.arm()
        if len(self.log.segments) != self._segments_seen:
            self._segments_seen = len(self.log.segments)
            self._cleaning.arm()

    def _flush_due(self) -> None:
        try:
            self.log.maybe_flush()
        except LogbusError as error:
            logger.warning("replica %s: interval flush failed: %s", self._label, error)

    # --- roles --------------------------------------------------------------------------------------------

    async def become_leader(self, epoch: int, replicas: list[int], isr: list[int]) -> bool:
        """Lead the partition from ``epoch`` on (called by the controller; idempotent)."""
        self._started()
        accepted, actions = self.state.become_leader(epoch, replicas, isr, self.log, monotonic_ms())
        self._run(actions)
        return accepted

    async def become_follower(self, epoch: int, leader_id: int, leader_handle) -> bool:
        """Follow ``leader_id`` from ``epoch`` on (called by the controller; idempotent)."""
        self._started()
        self._offered_leader = leader_handle
        accepted, actions = self.state.become_follower(epoch, leader_id, _actor_ref(leader_handle), self.log)
        self._run(actions)
        return accepted

    async def followers_gone(self, epoch: int, followers: list[int]) -> None:
        """The controller found these followers' node dead: as leader of ``epoch``, stop waiting for them
        (they leave the ISR at once; ``ReplicaState.followers_gone``)."""
        self._run(self.state.followers_gone(epoch, list(followers), self.log, monotonic_ms()))

    async def set_throttle(self, bytes_per_s: int | None) -> None:
        """Limit how fast this replica copies from its leader (a reassignment's new replica); None: no limit."""
        self._fetcher.throttle_bytes_per_s = int(bytes_per_s) if bytes_per_s else None

    # --- data plane --------------------------------------------------------------------------------------

    def _check_leader(self, epoch: int | None = None) -> LeaderState:
        self._check_fence()
        return self.state.check_leader(epoch)

    async def produce(
        self, batch, acks: int | str = 1, leader_epoch: int | None = None, timeout_ms: int = PRODUCE_TIMEOUT_MS_DEFAULT
    ) -> ProduceResponse:
        """Append one encoded batch as leader; with acks='all' wait until every ISR member has it."""
        self._started()
        started_ms = monotonic_ms()
        state = self._check_leader(leader_epoch)
        if not await self._lease_held():
            raise NotLeaderError(
                f"{self.topic}-{self.partition}: this leader may not take writes (its node's lease ran out, or "
                f"epoch {self.leader_epoch} is no longer the partition's current one)"
            )
        if not isinstance(batch, np.ndarray | bytes | bytearray | memoryview):
            raise InvalidRecordError(f"produce takes an encoded batch (uint8 array or bytes), not {type(batch).__name__}")
        min_isr = self.log.config.min_insync_replicas
        if acks == "all" and state.in_sync_count() < min_isr:
            raise NotEnoughReplicasError(
                f"{self.topic}-{self.partition} has {state.in_sync_count()} in-sync replicas, min.insync.replicas={min_isr}"
            )
        await self._wait_for_earlier_batches(batch)
        if self.leader_state is not state or not self._may_write():
            raise NotLeaderError(f"{self.topic}-{self.partition}: leadership moved while the batch waited")
        self._run(self.state.before_append(self.log, monotonic_ms()))  # followers parked at the end were in sync up to now
        result = self.log.append(batch, leader_epoch=self.leader_epoch)
        if not result.duplicate:
            self._parking.appended_now()
            self._after_append()
            metrics.appended(self.topic, result.record_count, len(batch))
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments), self.leader_epoch)
        self._run(self.state.after_append(self.log, monotonic_ms()))
        if acks == "all":
            await self._wait_committed(state, result.last_offset + 1, min(int(timeout_ms), PRODUCE_TIMEOUT_MS_MAX))
        metrics.latency("produce_acks_all" if acks == "all" else "produce", monotonic_ms() - started_ms)
        append_time = result.max_timestamp_ms if self.log.config.message_timestamp_type == LOG_APPEND_TIME else -1
        return ProduceResponse(result.base_offset, result.log_end_offset, self.log.log_start_offset, result.max_timestamp_ms, append_time,
                               self.log.config.producer_id_expiration_ms)

    async def _wait_for_earlier_batches(self, batch) -> None:
        """Let an idempotent producer's batch that arrived ahead of its predecessors wait for them.

        Ray runs an async actor's calls concurrently, so batches sent in order
        by one producer may start here out of order. A batch whose sequence is
        ahead of the producer's next expected one waits (briefly) for the gap to
        fill, instead of failing with OutOfOrderSequenceError and a retry. A
        producer the log does not know waits for its sequence 0 the same way:
        the log takes an unknown producer's batch whatever its sequence
        (producer_state.py), so one that overtook its predecessors would be
        written ahead of them.
        """
        try:
            header = bh.read_header(memoryview(batch).cast("B") if isinstance(batch, np.ndarray) else batch)
        except Exception:  # noqa: BLE001 (a malformed batch is rejected by the append itself)
            return
        if header.producer_id == bh.NO_PRODUCER_ID:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REORDER_WAIT_S
        while True:
            known = self.log.producer_state.producers.get(header.producer_id)
            same_epoch = known is not None and known.epoch == header.producer_epoch
            expected = known.last_sequence + 1 if same_epoch else 0
            if header.base_sequence <= expected or (known is not None and header.producer_epoch > known.epoch):
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return  # the append reports the gap
            if not await self._parking.appended.wait(remaining):
                return

    async def _wait_committed(self, state: LeaderState, end_offset: int, timeout_ms: int) -> None:
        """acks=all: wait until the high watermark passes ``end_offset`` while ``state``'s leadership lasts."""

        def check() -> None:
            if self.leader_state is not state:
                raise NotLeaderError(f"{self.topic}-{self.partition}: leadership moved before the batch was committed")
            if state.in_sync_count() < self.log.config.min_insync_replicas:
                raise NotEnoughReplicasError(
                    f"{self.topic}-{self.partition}: the ISR shrank below min.insync.replicas after the append"
                )

        if not await self._parking.wait_until(lambda: state.high_watermark >= end_offset, check, timeout_ms):
            raise RequestTimedOutError(f"{self.topic}-{self.partition}: not replicated to the ISR within {timeout_ms} ms")

    async def write_txn_markers(self, markers: list, leader_epoch: int | None = None, timeout_ms: int = PRODUCE_TIMEOUT_MS_DEFAULT) -> list:
        """As leader, for the transaction coordinator: end transactions on this partition (KIP-98's
        WriteTxnMarkers). ``markers``: (producer id, producer epoch, coordinator epoch, commit) each;
        one marker (a control batch, COMMIT or ABORT) is appended per item, in order.

        Returns one entry per marker, once every marker written is under the high
        watermark (acks=all): None (written) or the error that refused it,
        ProducerFencedError when its producer epoch is older than the
        producer's here (a newer epoch has written since: the transaction was
        completed before). A marker for a producer with no ongoing transaction
        here is written all the same, as Kafka's leader does (it is harmless:
        it ends nothing, and it moves the producer's epoch here). Raises, for
        the whole call, NotLeaderError, FencedLeaderEpochError,
        NotEnoughReplicasError, RequestTimedOutError (all retriable: a marker
        written twice ends nothing the second time), InvalidRecordError (a
        malformed marker; nothing is written) or StorageError.
        """
        self._started()
        state = self._check_leader(leader_epoch)
        if not await self._lease_held():
            raise NotLeaderError(
                f"{self.topic}-{self.partition}: this leader may not take writes (its node's lease ran out, or "
                f"epoch {self.leader_epoch} is no longer the partition's current one)"
            )
        state = self._check_leader(leader_epoch)  # again: the role may have changed while the lease was awaited
        parsed = [_txn_marker(marker) for marker in markers]
        min_isr = self.log.config.min_insync_replicas
        if state.in_sync_count() < min_isr:
            raise NotEnoughReplicasError(
                f"{self.topic}-{self.partition} has {state.in_sync_count()} in-sync replicas, min.insync.replicas={min_isr}"
            )
        self._run(self.state.before_append(self.log, monotonic_ms()))  # followers parked at the end were in sync up to now
        results: list = []
        end_offset = None
        for producer_id, producer_epoch, coordinator_epoch, commit in parsed:
            try:
                result = self.log.append_marker(
                    producer_id, producer_epoch, commit, coordinator_epoch, leader_epoch=self.leader_epoch, timestamp_ms=wall_ms()
                )
            except ProducerFencedError as error:
                results.append(error)
                continue
            results.append(None)
            end_offset = result.last_offset + 1
        if end_offset is not None:
            self._parking.appended_now()
            self._after_append()
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments), self.leader_epoch)
            self._run(self.state.after_append(self.log, monotonic_ms()))
            if self.log.config.compact:
                self._cleaning.arm()  # a cleaning the transaction held back (nothing at or above the LSO is cleaned)
            await self._wait_committed(state, end_offset, min(int(timeout_ms), PRODUCE_TIMEOUT_MS_MAX))
        return results

    async def _read(self, request: FetchRequest, limit, max_bytes_cap: int, consumer: bool = True) -> ReadResult | None:
        """Whole batches from ``request.offset`` below ``limit()``, waiting up to ``max_wait_ms`` for some.

        None if nothing arrived in time. In a fetch ``session``, the read starts
        where the session's last answered fetch ended, if that is past the
        offset (``protocol/fetch_sessions.py``). At most ``max_bytes_cap``
        bytes are read, whatever the request asks (at least one batch).
        """
        max_wait_ms = min(max(0, int(request.max_wait_ms)), FETCH_WAIT_MS_MAX)
        max_bytes = min(max(1, int(request.max_bytes)), max_bytes_cap)
        offset, session = int(request.offset), request.session
        epoch = self.leader_epoch
        if consumer and self._tiering.enabled and offset < self.log.log_start_offset:
            # Below the local log start: the remote tier has it, read from where this session's last
            # answer ended (as on disk). The lock lasts until this fetch is answered (``_serve_fetch``
            # records the session's position with no wait after this returns), so a pipelined fetch
            # of the session starts after it instead of reading the same records again.
            await self._tiering.ensure_open()
            async with self._tiering.read_lock():
                start = max(offset, self._sessions.start_offset(session, offset))
                if self._tiering.in_tier(start):
                    result = await self._tiering.read(start, max_bytes, limit())
                    if self.leader_epoch != epoch or self.role != LEADER:
                        raise NotLeaderError(f"{self.topic}-{self.partition}: leadership changed during the fetch")
                    return result

        def check() -> None:
            if self.leader_epoch != epoch or self.role != LEADER:
                raise NotLeaderError(f"{self.topic}-{self.partition}: leadership changed during the fetch")

        def read() -> ReadResult | None:
            start = self._sessions.start_offset(session, offset)
            return self.log.read(start, max_bytes, max_offset=limit(), verify_crc=bool(request.verify_crc))

        return await self._parking.read(read, max_wait_ms, check)

    async def _serve_fetch(
        self, request: FetchRequest, limit, channel: bool = False, consumer: bool = True
    ) -> tuple[FetchResponse, object]:
        """Read, then package for the transport: (FetchResponse, data or None)."""
        started_ms = monotonic_ms()
        if consumer and request.tier_plan and self._tiering.enabled and int(request.offset) < self.log.log_start_offset:
            plan = await self._tier_plan(int(request.offset))
            if plan is not None:
                offset = int(request.offset)
                return FetchResponse(
                    offset, offset, self.high_watermark, self._tiering.log_start_offset(), self.leader_epoch,
                    self.state.reply_stable_offset(self.log), (), plan,
                ), None
        result = await self._read(request, limit, wire.CHANNEL_FETCH_MAX_BYTES if channel else FETCH_MAX_BYTES_MAX, consumer)
        log_start = self._tiering.log_start_offset() if consumer else self.log.log_start_offset
        if consumer:
            metrics.latency("fetch", monotonic_ms() - started_ms)
        if result is None:
            if consumer and request.max_wait_ms > 0:
                self._fetch_waits_expired += 1
            offset = int(request.offset)
            return FetchResponse(
                offset, offset, self.high_watermark, log_start, self.leader_epoch, self.state.reply_stable_offset(self.log)
            ), None
        if consumer:
            metrics.fetched(self.topic, result.next_offset - result.first_offset, len(result.data))
        data = self._packaging.for_channel(result) if channel else self._packaging.for_actor_call(result, request)
        if request.session is not None:  # only once packaged: a refused reply leaves the session where it was
            self._sessions.answered(request.session, result.next_offset)
        aborted = ()
        if consumer and request.isolation_level == READ_COMMITTED:
            aborted = tuple(self.log.aborted_transactions(result.first_offset, result.next_offset))
        meta = FetchResponse(
            result.first_offset, result.next_offset, self.high_watermark, log_start, self.leader_epoch,
            self.state.reply_stable_offset(self.log), aborted,
        )
        return meta, data

    async def _tier_plan(self, offset: int) -> dict | None:
        """The tier's files from ``offset`` on (at most TIER_PLAN_FILES), for a consumer that reads them
        itself; None when ``offset`` is not where the tier's records are (the fetch is then served
        as any other: out of range below the tier's start)."""
        await self._tiering.ensure_open()
        if self.role != LEADER:
            raise NotLeaderError(f"{self.topic}-{self.partition}: not the leader")
        if not self._tiering.in_tier(offset):
            return None
        plan = self._tiering.files_for(offset, self.log.log_start_offset, max_files=TIER_PLAN_FILES, max_bytes=TIER_PLAN_BYTES)
        return plan if plan is not None and plan["start"] == offset else None

    async def fetch(self, request: FetchRequest) -> tuple[FetchResponse, object]:
        """For consumers: whole batches from ``request.offset`` below the high watermark (the last stable
        offset for ``isolation_level`` READ_COMMITTED): (FetchResponse, data).

        Waits up to ``request.max_wait_ms`` for data when there is none yet.
        ``data`` is None when nothing arrived in time; otherwise whole batches
        (the first may start below the offset): bytes inside the reply when
        they are at most ``request.inline_max_bytes`` (capped at
        FETCH_INLINE_MAX_BYTES), else an ObjectRef to a uint8 array. See
        :class:`~logbus.protocol.messages.FetchRequest` for the fields; the
        reply's ``first_offset`` and ``next_offset`` say which offsets the
        batches cover (in a compacted topic, past a gap: see FetchResponse).
        """
        self._started()
        self._check_leader()
        self._read_limit(request.isolation_level)  # InvalidRecordError for an unknown level, before any wait
        return await self._serve_fetch(request, lambda: self._read_limit(request.isolation_level))

    async def jvm_produce(self, batch: bytes, acks: int, timeout_ms: int) -> bytes:
        """For Spark's JVM writer (a Ray cross-language call): :meth:`produce` of one framed batch
        (``acks`` -1 for "all"), answered as 16 bytes, little-endian int64s: the batch's base offset
        and its log append time (-1 unless the topic stamps LogAppendTime)."""
        reply = await self.produce(batch, "all" if int(acks) == -1 else int(acks), None, int(timeout_ms))
        return struct.pack("<qq", reply.base_offset, reply.log_append_time_ms)

    async def jvm_fetch(self, offset: int, max_bytes: int, isolation_level: int, headers_only: bool, columns: int = jvm_fetch.ALL_COLUMNS) -> bytes:
        """For Spark's JVM reader (a Ray cross-language call): a fetch's kept batches as one ``bytes``.

        As :meth:`fetch` with no wait, no session and no tier plan, but the reply
        holds only what a reader keeps (no transaction markers, and with
        READ_COMMITTED no aborted batches), framed as
        :mod:`logbus.protocol.jvm_fetch` describes; ``headers_only`` returns each
        kept batch's frame header without its records (enough to count them), and
        ``columns`` (a mask) the batches with only those of their columns.
        """
        self._started()
        self._check_leader()
        request = FetchRequest(int(offset), int(max_bytes), 0, isolation_level=int(isolation_level))
        self._read_limit(request.isolation_level)  # InvalidRecordError for an unknown level
        result = await self._read(request, lambda: self._read_limit(request.isolation_level), FETCH_MAX_BYTES_MAX)
        if result is None:
            return jvm_fetch.pack_reply(None, request.offset, request.offset, self.high_watermark)
        metrics.fetched(self.topic, result.next_offset - result.first_offset, len(result.data))
        read_committed = request.isolation_level == READ_COMMITTED
        aborted = tuple(self.log.aborted_transactions(result.first_offset, result.next_offset)) if read_committed else ()
        projected = not headers_only and int(columns) != jvm_fetch.ALL_COLUMNS
        pack = functools.partial(
            jvm_fetch.pack_reply,
            # A projection runs off the event loop, which may truncate the segment meanwhile: on a copy.
            bytes(result.data) if projected else result.data,
            result.first_offset, result.next_offset, self.high_watermark,
            headers_only=bool(headers_only), read_committed=read_committed, aborted=aborted, columns=int(columns),
        )
        if not projected:
            return pack()  # the batches as stored, or their frame headers: no Arrow
        return await asyncio.to_thread(pack)  # each batch decoded and written again: off the event loop

    async def channel_address(self) -> tuple[str, str, dict | None] | None:
        """(node id, socket address, TCP address) of this replica's channel, or None where there is none.

        Clients on this node use the Unix socket; clients on other nodes the TCP
        address (host, port and the token their HELLO carries), None where Ray
        encrypts its own traffic (a channel is plain TCP) or the replica cannot
        listen: they then use actor calls. The first call starts the TCP listener.
        """
        self._started()
        try:
            address = await asyncio.shield(self._channel_started)
        except Exception as error:  # noqa: BLE001 (clients fall back to actor calls)
            logger.warning("replica %s: no local channel: %s", self._label, error)
            return None
        if address is None:
            return None
        tcp = None
        if tcp_allowed():
            try:
                tcp = await self._channel.tcp_address(ray.util.get_node_ip_address())
            except OSError as error:
                logger.warning("replica %s: no channel for other nodes: %s", self._label, error)
        return ray.get_runtime_context().get_node_id(), address, tcp

    async def _channel_request(self, kind: int, args: tuple):
        """A request that came over the local channel: the same work as the actor method."""
        if kind == wire.PRODUCE:
            return await self.produce(*args)
        (request,) = args
        if not isinstance(request, FetchRequest):
            raise InvalidRecordError(f"a local channel fetch carries a FetchRequest, not {type(request).__name__}")
        self._started()
        self._check_leader()
        # Every result travels inside the reply, however large (no object store on this path),
        # up to what one frame can carry.
        self._read_limit(request.isolation_level)
        return await self._serve_fetch(request, lambda: self._read_limit(request.isolation_level), channel=True)

    async def replica_fetch(self, follower_id: int, epoch: int, request: FetchRequest) -> tuple[FetchResponse, object]:
        """For followers: like fetch, but up to the log end; the fetch offset reports the follower's progress.

        No CRC check here: the follower's append checks every batch it receives.
        Followers send this over their fetch link when they have one (``fetch_link_address``).
        """
        return await self._replica_fetch(follower_id, epoch, request, channel=False)

    async def _linked_replica_fetch(self, follower_id: int, epoch: int, request: FetchRequest) -> tuple[FetchResponse, object]:
        """A follower's fetch over its fetch link: the batches as a view of the log, sent before the next yield."""
        return await self._replica_fetch(follower_id, epoch, request, channel=True)

    async def _replica_fetch(self, follower_id: int, epoch: int, request: FetchRequest, channel: bool) -> tuple[FetchResponse, object]:
        self._started()
        self._check_fence()
        self._run(self.state.on_replica_fetch(follower_id, epoch, request.offset, self.log, monotonic_ms()))
        if request.offset < self.log.log_end_offset:
            return await self._serve_fetch(request, lambda: None, channel=channel, consumer=False)
        # At the end: the fetch waits here for the next append; while it waits, this follower is in sync.
        token = self.state.park(follower_id, request.offset, monotonic_ms())
        try:
            return await self._serve_fetch(request, lambda: None, channel=channel, consumer=False)
        finally:
            self.state.unpark(follower_id, token)

    async def fetch_link_address(self) -> dict | None:
        """For followers: where to open a fetch link to this replica (host, port, token), or None where
        it cannot listen or Ray encrypts its traffic (``actors/fetch_link.py``). The first call starts listening."""
        self._started()
        if not tcp_allowed():
            return None
        try:
            return await self._fetch_links.address(ray.util.get_node_ip_address())
        except OSError as error:
            logger.warning("replica %s: no fetch link: %s", self._label, error)
            return None

    async def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """KIP-279 OffsetsForLeaderEpoch: (largest epoch <= ``epoch`` in this log, where it ends)."""
        self._started()
        return self.log.epochs.end_offset_for(epoch, self.log.log_end_offset)

    async def delete_records(self, offset: int, leader_epoch: int | None = None) -> int:
        """As leader: Kafka's DeleteRecords. Make ``offset`` (-1: the high watermark) the log start
        offset; returns the new log start offset. Followers follow it on their next fetch.

        OffsetOutOfRangeError for an offset past the high watermark; an offset
        at or below the log start changes nothing.
        """
        self._started()
        self._check_leader(leader_epoch)
        if not await self._lease_held():
            raise NotLeaderError(f"{self.topic}-{self.partition}: this leader may not take writes now")
        self._check_leader(leader_epoch)  # again: the role may have changed while the lease was awaited
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < -1:
            raise OffsetOutOfRangeError(f"delete_records takes an offset >= 0 (or -1: the high watermark), not {offset!r}")
        high_watermark = self.high_watermark
        if offset == -1:
            offset = high_watermark
        if offset > high_watermark:
            raise OffsetOutOfRangeError(
                f"{self.topic}-{self.partition}: cannot delete records up to {offset}, past the high watermark {high_watermark}"
            )
        before = self.log.log_start_offset
        start = self.log.delete_records(offset)
        # (The log start may already be past this high watermark: retention is not bounded by it, and a
        # restarted leader's high watermark starts low. A call below the log start changes nothing.)
        _check(start == max(before, offset), f"{self._label}: delete_records({offset}) left the log start at {start}, not {max(before, offset)}")
        await self._tiering.delete_records(offset)  # a tiered topic: the tier's log start moves too
        self._packaging.forget()
        self._log_shrank()
        self._arm_retention()
        return self._tiering.log_start_offset()  # the local log's, or (tiered) the tier's where it reaches further back

    async def offsets(self, isolation_level: int = READ_UNCOMMITTED, local: bool = False) -> tuple[int, int, int]:
        """(log start offset, high watermark, log end offset); with ``isolation_level`` READ_COMMITTED,
        the last stable offset instead of the high watermark (ListOffsets' latest for such readers).
        A tiered topic's log start is the tier's, except with ``local`` (a follower's question: it
        copies from the local log start, never from the tier, as in Kafka)."""
        self._started()
        if local:
            return self.log.log_start_offset, self._read_limit(isolation_level), self.log.log_end_offset
        await self._tiering.ensure_open()  # a tiered topic's earliest offset is the tier's
        return self._tiering.log_start_offset(), self._read_limit(isolation_level), self.log.log_end_offset

    async def jvm_offsets(self, isolation_level: int) -> bytes:
        """For Spark's JVM reader (a Ray cross-language call): the leader's ``offsets(isolation_level)``
        as 24 bytes, little-endian int64s: log start offset, high watermark (or last stable offset),
        log end offset. NotLeaderError on a follower."""
        self._started()
        self._check_leader()
        return struct.pack("<qqq", *(await self.offsets(int(isolation_level))))

    async def jvm_offset_for_timestamp(self, timestamp_ms: int) -> bytes:
        """For Spark's JVM source (a Ray cross-language call): the leader's ``offset_for_timestamp`` as 8
        bytes, a little-endian int64 (-1: no record at or after ``timestamp_ms`` below the high watermark).
        NotLeaderError on a follower."""
        self._started()
        self._check_leader()
        offset = await self.offset_for_timestamp(int(timestamp_ms))
        self._check_leader()  # still the leader after the waits (the tier's reads): its high watermark bounded the answer
        return struct.pack("<q", offset)

    async def tier_status(self) -> dict | None:
        """A tiered topic's remote tier as this replica sees it (``TierSchedule.status``), else None."""
        self._started()
        return self._tiering.status()

    async def tier_files(self, start: int, end: int) -> dict | None:
        """The tiered part of ``[start, end)`` as files a reader may read itself (``TierSchedule.files_for``),
        or None: for Ray Data and Spark reads of history."""
        self._started()
        return self._tiering.files_for(start, end)

    async def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """First offset with a timestamp >= ``timestamp_ms`` below the high watermark, or -1."""
        self._started()
        offset = None
        await self._tiering.ensure_open()
        if self._tiering.log_start_offset() < self.log.log_start_offset:  # a tiered topic: its history first
            offset = await self._tiering.offset_for_timestamp(timestamp_ms)
            if offset is not None and offset >= self.log.log_start_offset:
                offset = None  # the tier's copy of what is on disk too: the log answers that part
        if offset is None:
            offset = self.log.offset_for_timestamp(timestamp_ms)
        if offset is None or offset >= self.high_watermark:
            return -1
        return offset

    # --- control plane ------------------------------------------------------------------------------

    async def update_config(self, config: dict) -> None:
        """Apply new topic config overrides (validated by the controller) and keep them for restarts."""
        self.config_overrides = dict(config)
        self.log.config = LogConfig.from_dict(self.config_overrides)
        self._save_state()
        self._started()
        self._arm_retention()
        self._cleaning.arm()
        self._tiering.start()  # a topic just tiered uploads its closed segments

    async def delete(self, topic_deleted: bool = False) -> None:
        """Close and remove this replica's files; the actor is killed by the controller afterwards.

        A replica removed by a reassignment may still think it leads (the
        controller elected the new leader elsewhere and told only the replicas
        that stay). It steps down first, so fetches and acks="all" produces
        waiting here end with NotLeaderError before the log closes under them.

        ``topic_deleted``: the whole topic goes, so this partition's remote tier goes too (every
        replica deletes it; the first does the work). A replica removed by a move leaves it.
        """
        if self._removing:
            return  # asked again: the first call did the work
        self._deleted = True
        self._removing = True
        self._run(self.state.remove())
        self._parking.high_watermark_moved()  # every parked fetch and commit wait looks again, and ends
        self._timers.cancel_all()
        await self._cleaning.stop()  # before the files go
        await self._tiering.stop()
        if topic_deleted and self._tiering.enabled:
            try:
                await asyncio.to_thread(self._tiering.delete_all)
            except LogbusError as error:
                logger.warning("replica %s: the deleted topic's remote tier stays: %s", self._label, error)
        if self._fence is not None:
            self._fence.withdraw()  # the agent may still hold the file open until the controller has it forget us
            self._fence.remove()
        await self._channel.close()
        self._fetch_links.close()
        self.log.delete()
        shutil.rmtree(self.directory, ignore_errors=True)
        self._owner_lock.release()

    async def ping(self) -> int:
        """Ready check: returns the process id (fault-injection tests kill it)."""
        self._started()
        return os.getpid()

    async def test_hook_break_next_append(self) -> int:
        """A test hook: the next batch this replica's log writes fails its post-condition
        (``PartitionLog.test_hook_break_next_append``), as a bug in the append would, and this
        process ends (invariant_exit.py). Returns the process id.

        Refused with IllegalStateError unless this process was started with ``LOGBUS_TEST_HOOKS=1``
        in its environment (the test suite sets it before it starts Ray)."""
        self._started()
        self.log.test_hook_break_next_append()
        return os.getpid()

    async def status(self) -> dict:
        """Role, epoch, offsets, (as leader) ISR, process and what recovery did on open: for `logbus status` and tools."""
        self._started()
        return {
            "replica_id": self.replica_id,
            "role": self.role,
            "leader_epoch": self.leader_epoch,
            "log_start_offset": self.log.log_start_offset,
            "log_end_offset": self.log.log_end_offset,
            "high_watermark": self.high_watermark,
            "isr": sorted(self.leader_state.isr) if self.leader_state else None,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "size_bytes": self.log.size_bytes,
            "fetched_bytes": self._fetcher.fetched_bytes,  # copied from leaders since this process started
            # A follower's fetches answered over its fetch link (the rest went as actor calls), and as a
            # leader, the fetches it answered over links; both since this process started.
            "linked_fetches": self._fetcher.linked_fetches,
            "linked_fetches_served": self._fetch_links.fetches,
            "fetch_links_opened": self._fetch_links.links_opened,
            "segments": len(self.log.segments),
            "tier": self._tiering.status(),  # a tiered topic's remote tier as this replica last saw it, else None
            # Long polls parked here for data (and, rarely, an idempotent batch waiting for an earlier one).
            "fetches_waiting": len(self._parking),
            # Consumers' long polls that waited here until their max_wait_ms ran out, with no data.
            "fetch_waits_expired": self._fetch_waits_expired,
            # As a reassignment's new replica: the copy's rate limit (None: none), and the bytes copied under one.
            "throttle_bytes_per_s": self._fetcher.throttle_bytes_per_s,
            "throttled_copy_bytes": self._fetcher.throttled_copy_bytes,
            # What recovery did when this process opened the log (a restart after a crash cuts a torn tail).
            "recovery": {
                "segments_scanned": self.log.recovery.segments_scanned,
                "truncated_bytes": self.log.recovery.truncated_bytes,
                "errors": list(self.log.recovery.errors),
                "swaps": list(self.log.recovery.swaps),  # cleanings a crash interrupted, completed or discarded
            },
        }


def _txn_marker(marker) -> tuple[int, int, int, bool]:
    """A transaction marker as write_txn_markers takes it: (producer id, producer epoch, coordinator epoch,
    commit); InvalidRecordError for anything else."""
    try:
        producer_id, producer_epoch, coordinator_epoch, commit = marker
    except (TypeError, ValueError):
        raise InvalidRecordError(f"a transaction marker is (producer id, producer epoch, coordinator epoch, commit), not {marker!r}") from None
    for name, value in (("producer id", producer_id), ("producer epoch", producer_epoch), ("coordinator epoch", coordinator_epoch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRecordError(f"a transaction marker's {name} must be an int >= 0, not {value!r}")
    return producer_id, producer_epoch, coordinator_epoch, bool(commit)


def replica_actor_name(topic: str, topic_id: str, partition: int, replica_id: int, node_id: str) -> str:
    # The topic id keeps a re-created topic's actors apart from a deleted one's; the Ray node's id keeps the
    # actor of a host that joined again apart from its predecessor on the old Ray node, whose name Ray frees late.
    return f"logbus-replica:{topic}:{partition}:{replica_id}:{topic_id[:12]}:{node_id[:12]}"


@functools.cache
def _replica_actor_class():
    """The Ray actor class of replicas, made once per process: each ``ray.remote(cls)`` is a new
    actor class that Ray inspects and exports to the GCS (a blocking call) on its first use, which
    made every replica the controller started pay for it."""
    return ray.remote(PartitionReplica)


def start_replica(
    *,
    namespace: str,
    topic: str,
    topic_id: str,
    partition: int,
    replica_id: int,
    node_id: str,
    directory: str,
    config: dict,
    leader_epoch: int,
    controller_name: str,
    resources: dict | None = None,
):
    """Get or create one partition replica actor, pinned to its node (it owns a directory there).

    ``resources``: what it declares it needs of the node (one ``logbus_replica`` slot where nodes
    advertise them; see ``placement.uses_replica_slots``).
    """
    return (
        _replica_actor_class()
        .options(
            name=replica_actor_name(topic, topic_id, partition, replica_id, node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,  # rebuilt from its files by the constructor
            max_task_retries=0,  # a produce must not be replayed behind the producer's back
            num_cpus=0,
            resources=resources or {},
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        )
        .remote(topic, partition, replica_id, directory, config, leader_epoch, namespace, controller_name, topic_id)
    )
