"""PartitionReplica: the actor that owns one partition replica's log on its node.

A thin shell around :class:`~logbus.storage.PartitionLog` and, while it
leads, a :class:`~logbus.protocol.replica_state.LeaderState`. It receives
encoded batches (bytes or uint8 arrays, never Arrow objects), appends them,
and serves fetches as a copy of whole batches: inside the reply when small,
else as an ObjectRef (one copy, mmap -> object store). A consumer's fetch
session lets its pipelined fetches continue one another (see ``_read``).
Clients on the same node may send small produce requests and fetches at the
log end over the replica's local channel, a Unix socket served on the same
event loop (``channel_server.py``): the same methods, without Ray's per-call
cost.

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
whose fence epoch stays past its own for ``FENCE_ASK_DELAY_S`` (the agent
says when it moves the fence; requests and a follower's fetches look too)
asks again, once per fence epoch. A follower's fetch has a deadline
of its own (its wait plus ``FOLLOWER_FETCH_SLACK_MS``). The leader
checks its ISR when something happens (a follower's fetch, a produce) and
arms one timer only while an in-sync follower is behind; retention arms one
timer for when its oldest data expires, and interval flushes one after an
append. A follower long-polls its leader with a long wait (half the lag
time), so an idle follower costs one call per few seconds, and a follower
whose fetch waits at the leader's end counts as in sync for that long.

Compaction (``cleanup.policy`` with "compact", ``storage/cleaner.py``): one
timer for when the log may next need cleaning (a segment rolled, a segment
left min.compaction.lag.ms, a tombstone is due to go); a cleaning due but not
yet below the high watermark starts when the watermark moves. The cleaning
reads and writes files in a thread, below the high watermark, while the
replica goes on serving; each cleaned segment is swapped in on the event loop. Leader and
followers compact their own copies (their bytes then differ; their records
at each offset do not).

It is an async actor: every method runs on one event loop, so calls are
serialised between awaits and the log (not thread-safe) is only touched from
that loop. Ray may start one caller's calls out of order; batches of an
idempotent producer that overtook their predecessors wait for them (see
``_wait_for_earlier_batches``), so they land in the order they were sent.

All durable state is rebuilt from disk in ``__init__`` (Ray reruns only the
constructor on restart); the role is relearned from the controller.

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
import pickle
import shutil
from collections import OrderedDict

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from logbus.actors import metrics
from logbus.actors.channel_server import ChannelServer
from logbus.actors.lease_files import NodeLease, ReplicaFence, may_write, node_directory, replica_file_name
from logbus.actors.node_agent import agent_actor_name
from logbus.clock import monotonic_ms, wall_ms
from logbus.errors import (
    ChannelReplyTooLargeError,
    DataDirectoryInUseError,
    FencedLeaderEpochError,
    InvalidRecordError,
    LogbusError,
    NotEnoughReplicasError,
    NotLeaderError,
    OffsetOutOfRangeError,
    ProducerFencedError,
    RequestTimedOutError,
)
from logbus.protocol import local_channel as wire
from logbus.protocol.messages import (
    FETCH_INLINE_MAX_BYTES,
    FETCH_MAX_BYTES_MAX,
    FETCH_WAIT_MS_MAX,
    PRODUCE_TIMEOUT_MS_DEFAULT,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    FetchRequest,
    FetchResponse,
    ProduceResponse,
)
from logbus.protocol.liveness import LEASE_MS
from logbus.protocol.replica_state import LeaderState
from logbus.storage import batch_header as bh
from logbus.storage.cleaner import build_offset_map, clean_group, discard
from logbus.storage.dir_lock import DirectoryLock
from logbus.storage.files import write_atomically
from logbus.storage.leader_epoch_cache import UNDEFINED_EPOCH
from logbus.storage.log_config import LOG_APPEND_TIME, LogConfig
from logbus.storage.partition_log import PartitionLog, ReadResult

logger = logging.getLogger(__name__)

STATE_FILE = "replica.json"
OWNER_LOCK_FILE = "owner.lock"  # held for the process's lifetime: one process per replica directory
OWNER_LOCK_WAIT_S = 30.0  # a restarted replica waits this long for a predecessor still exiting
REPLICA_FETCH_WAIT_MS = 10_000  # at most (and at most half the lag time): an append answers a waiting fetch at once
ALTER_ISR_TIMEOUT_S = 5.0
LEASE_WAIT_MS = LEASE_MS  # a write finding the node's lease lapsed waits this long for a renewal
LEASE_POLL_S = 0.01  # ... checking the lease file this often (only while it waits)
START_RETRY_S = 0.2  # telling the agent and the controller that this replica started is retried this often
# A follower's fetch ends by its own deadline: its wait plus this slack. One sent into a cut network
# (or on a connection that died) would otherwise wait until the transport gives up, many seconds.
FOLLOWER_FETCH_SLACK_MS = 1_000
# After a fetch that failed or timed out, the follower asks with this short wait (deadline: this plus
# the slack) until one succeeds: once the leader can be reached again, a fetch ends and is sent again
# within 2 s, and the follower is back in the ISR at its next fetch.
FOLLOWER_RETRY_WAIT_MS = 500
FOLLOWER_CALL_TIMEOUT_S = 5.0  # a follower's other calls to its leader (epoch ends, offsets)
FENCE_ASK_DELAY_S = 1.0  # a fence epoch past ours this long (the controller's call did not come): ask for our role
MAX_TIMER_S = 24 * 3600.0  # a far-away retention deadline is re-checked daily (clock changes, config changes)
CLEAN_FAILED_RETRY_S = 60.0  # a cleaning that failed is tried again this soon, then twice as late each time
CLEAN_FAILED_RETRY_MAX_S = 3600.0
REPLICA_FETCH_MAX_BYTES = 16 << 20
THROTTLE_SLICE_S = 0.2  # a throttled follower fetches about this many seconds' worth of bytes at a time
THROTTLED_FETCH_MIN_BYTES = 64 << 10
PRODUCE_TIMEOUT_MS_MAX = 120_000
FETCH_SESSIONS_MAX = 1024  # consumers' fetch sessions remembered (least recently used ones are forgotten)
REORDER_WAIT_S = 0.3  # how long a batch that overtook its predecessors waits for them (short: after a
# failover the missing batch may sit behind the waiting ones in the producer)

LEADER = "leader"
FOLLOWER = "follower"
UNKNOWN = "unknown"


class Wakeup:
    """Coroutines waiting, with a timeout, for the next ``wake_all()``.

    What ``asyncio.wait_for(event.wait(), t)`` on a fresh Event per signal did,
    without a task per wait: a woken waiter resumes in the loop's next turn
    instead of three turns later, which is on the path of every fetch waiting
    at the log end.
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    async def wait(self, timeout_s: float) -> bool:
        """True if woken, False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(max(0.0, timeout_s), _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if not (waiter.done() and not waiter.cancelled() and waiter.result()):
                try:
                    self._waiters.remove(waiter)  # timed out or cancelled: not waiting any more
                except ValueError:
                    pass

    def __len__(self) -> int:
        """How many coroutines wait now."""
        return len(self._waiters)

    def wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _same_actor(a, b) -> bool:
    """Whether two handles name the same actor (a replica re-created under its old id is another actor)."""
    return a is not None and b is not None and a._actor_id == b._actor_id


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
        self.leader_epoch = int(state["leader_epoch"])  # the epoch of the role held, -1 before any
        self.role = UNKNOWN
        self.leader_state: LeaderState | None = None
        self.leader_handle = None
        self.leader_id: int | None = None
        self.follower_high_watermark = 0
        self._lease: NodeLease | None = None  # the node's lease (None standalone: no controller)
        self._fence: ReplicaFence | None = None  # this replica's pid and its partition's current epoch
        self._controller_handle = None
        self._agent_handle = None  # this node's agent (asked for our role on our behalf)
        self._role_asked_epoch = -1  # the fence epoch we last asked our role for
        self._role_question: asyncio.Task | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}  # one-shot: "isr", "retention", "flush", "clean", "role"
        self._cleaning: asyncio.Task | None = None  # the log cleaning under way
        self._cleaning_stop = None  # set to stop it (the stop event of its plan)
        # A cleaning due but held back by the high watermark: it starts once the watermark reaches this.
        self._clean_after_hw: int | None = None
        self._clean_failures = 0  # in a row: the retry backs off
        self._parked: dict[int, tuple[int, int]] = {}  # followers whose fetch waits here at the end: id -> (offset, since ms)
        self._isr_proposal: asyncio.Task | None = None
        self.throttle_bytes_per_s: int | None = None  # a reassignment's copy rate limit, as follower
        self.fetched_bytes = 0  # bytes this process appended from its leaders' fetch replies, as follower
        self._throttle_until = 0.0
        self._throttled_copy_bytes = 0  # copied from the leader under a throttle, since this process started
        self._fetch_waits_expired = 0  # long polls that ended with no data when their wait ran out
        self._segments_seen = 0
        self._log_gauges = metrics.LogGauges(topic, partition)
        self._shared_read = None  # ((first offset, next offset, bytes, CRC checked), ObjectRef) of the last large read
        # Consumers' fetch sessions while leading: session id -> where the last fetch answered in it ended.
        self._fetch_sessions: OrderedDict[int, int] = OrderedDict()
        self._appended: Wakeup | None = None  # woken by every append (long-polling fetches wait on it)
        self._hw_moved: Wakeup | None = None  # woken when the high watermark moves or leadership changes
        self._tasks: list[asyncio.Task] = []
        self._follow_task: asyncio.Task | None = None
        self._deleted = False
        self._removing = False  # delete() began: every call from here on gets NotLeaderError
        self._label = f"{topic}-{partition}/{replica_id}"
        self._channel = ChannelServer(self._channel_request, f"replica {self._label}")
        self._channel_started: asyncio.Task | None = None
        self._save_state()
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

    # --- loop-bound set-up and background work -------------------------------------------------

    def _started(self) -> None:
        """Create loop-bound objects on first use (the constructor runs outside the event loop).

        Every request starts here: one that reaches a replica being removed
        gets NotLeaderError (retriable: the client asks where the partition's
        leader is now), never the closed log's StorageError.
        """
        if self._removing:
            raise NotLeaderError(f"replica {self.replica_id} of {self.topic}-{self.partition} has been removed")
        if self._appended is not None:
            return
        self._appended = Wakeup()
        self._hw_moved = Wakeup()
        loop = asyncio.get_running_loop()
        if self.controller_name is not None:
            directory = node_directory(self.namespace, ray.get_runtime_context().get_node_id())
            self._lease = NodeLease(directory)
            self._fence = ReplicaFence.of(directory, self.topic_id, self.partition, self.replica_id)
            self._fence.pid = os.getpid()
            self._tasks.append(loop.create_task(self._say_started()))
        self._channel_started = loop.create_task(self._channel.start())
        self._arm_retention()
        self._arm_cleaning()

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

    def _fence_ahead(self) -> int | None:
        """Our fence's epoch if it is past ours and not yet asked about (one 8-byte read), else None."""
        fence = self._fence
        if fence is None or self._deleted:
            return None
        current = fence.current_epoch
        return current if current > self.leader_epoch and current > self._role_asked_epoch else None

    def _check_fence(self) -> None:
        """Ask the controller for our role if our fence stays past our epoch for FENCE_ASK_DELAY_S.

        The agent writes a partition's new epoch into the fence before the
        controller tells anyone their role, and tells us (``fence_moved``);
        every request and follower fetch looks too. The controller's own call
        normally follows within milliseconds; a replica that missed it (a
        call lost in a cut network, say) asks once per fence epoch, after a
        one-shot timer, so that an election costs no second call per replica.
        """
        if self._fence_ahead() is not None and "role" not in self._timers:
            self._arm("role", FENCE_ASK_DELAY_S, self._ask_if_behind)

    def _ask_if_behind(self) -> None:
        current = self._fence_ahead()
        if current is None:
            return  # the role change arrived meanwhile
        self._role_asked_epoch = current
        if self._role_question is None or self._role_question.done():
            logger.info("replica %s: fence epoch %d is past ours (%d): asking for our role", self._label, current, self.leader_epoch)
            self._role_question = asyncio.get_running_loop().create_task(self._ask_role())

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

    # --- one-shot timers instead of periodic work ----------------------------------------------

    def _arm(self, name: str, delay_s: float, callback) -> None:
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        delay_s = min(max(0.0, delay_s), MAX_TIMER_S)
        self._timers[name] = asyncio.get_running_loop().call_later(delay_s, self._fire, name, callback)

    def _fire(self, name: str, callback) -> None:
        self._timers.pop(name, None)
        if not self._deleted:
            callback()

    def _disarm(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _arm_retention(self) -> None:
        """One timer for the moment the oldest data expires (nothing in between)."""
        due_ms = self.log.next_retention_ms()
        if due_ms is None:
            self._disarm("retention")
        else:
            self._arm("retention", (due_ms - wall_ms()) / 1000, self._retention_due)

    def _retention_due(self) -> None:
        try:
            if self.log.enforce_retention():
                self._log_shrank()
        except LogbusError as error:  # keep serving; try again in a while
            logger.warning("replica %s: retention failed: %s", self._label, error)
            self._arm("retention", 60.0, self._retention_due)
            return
        self._arm_retention()

    def _log_shrank(self) -> None:
        """Retention, a cleaning or delete_records changed the log's size: a leader's gauges say so now
        (they are otherwise set by appends, which may not come)."""
        if self.role == LEADER:
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments), force=True)

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
                self._arm_cleaning()  # a closed segment more: dirty bytes
        if config.flush_policy == "interval" and "flush" not in self._timers:
            self._arm("flush", config.flush_ms / 1000, self._flush_due)

    def _flush_due(self) -> None:
        try:
            self.log.maybe_flush()
        except LogbusError as error:
            logger.warning("replica %s: interval flush failed: %s", self._label, error)

    # --- compaction: a one-shot timer, the work in a thread -----------------------------------------

    def _arm_cleaning(self) -> None:
        """One timer for the moment the log may next need cleaning (none for other topics)."""
        if self._cleaning is not None and not self._cleaning.done():
            return  # the cleaning under way arms the next one when it ends
        due_ms = self.log.next_cleaning_ms()
        if due_ms is None:
            self._disarm("clean")
        else:
            self._arm("clean", (due_ms - wall_ms()) / 1000, self._cleaning_due)

    def _high_watermark_moved(self) -> None:
        """A cleaning that waited for the high watermark may start now (no timer while it waits)."""
        if self._clean_after_hw is not None and self.high_watermark >= self._clean_after_hw:
            self._clean_after_hw = None
            self._arm_cleaning()

    def _cleaning_due(self) -> None:
        if self._deleted or (self._cleaning is not None and not self._cleaning.done()):
            return
        self._cleaning = asyncio.get_running_loop().create_task(self._clean())

    async def _clean(self) -> None:
        """One cleaning below the high watermark: offset map and cleaned segments in a thread, each
        swap on the event loop (the log is only touched here). Then the timer for the next one."""
        retry_s = None
        rearm = True
        try:
            plan = self.log.cleaning_plan(upper_bound=self.high_watermark)
            if plan is None:
                due_ms = self.log.next_cleaning_ms()
                if due_ms is not None and due_ms <= wall_ms():
                    # Due, but not below the high watermark yet: the watermark's next move starts it.
                    self._clean_after_hw = self.log.active_segment.base_offset
                    rearm = False
                return
            self._cleaning_stop = plan.stop
            offset_map = await asyncio.to_thread(build_offset_map, plan)
            done = []
            for group in plan.groups:
                cleaned = await asyncio.to_thread(clean_group, plan, group, offset_map)
                if self._deleted or not self.log.replace_segments(cleaned):
                    discard(cleaned)
                    return  # the log changed meanwhile (truncated, retention): the next cleaning plans again
                self._shared_read = None  # a read shared before the swap may hold the old bytes
                done.append(cleaned)
            self.log.finish_cleaning(plan, done)
            self._clean_failures = 0
            self._log_shrank()
            removed = sum(c.records_removed for c in done)
            logger.info(
                "replica %s: cleaned offsets up to %d: %d records removed, %d -> %d bytes",
                self._label, plan.end_offset, removed, sum(c.bytes_before for c in done), sum(c.bytes_after for c in done),
            )
        except Exception as error:  # noqa: BLE001 (keep serving; try again in a while, whatever failed)
            retry_s = min(CLEAN_FAILED_RETRY_S * 2**self._clean_failures, CLEAN_FAILED_RETRY_MAX_S)
            self._clean_failures += 1
            if not self._deleted:
                expected = isinstance(error, LogbusError | OSError)  # a damaged or changed file; else a bug, with its traceback
                logger.warning("replica %s: log cleaning failed (trying again in %.0f s): %s", self._label, retry_s, error,
                               exc_info=not expected)
        finally:
            self._cleaning_stop = None
            if not self._deleted:
                if retry_s is not None:
                    self._arm("clean", retry_s, self._cleaning_due)
                elif rearm:
                    asyncio.get_running_loop().call_soon(self._arm_cleaning)  # once this task is done

    # --- the ISR, checked when something happens ---------------------------------------------------

    def _check_isr(self) -> None:
        """As leader: propose an ISR change if one is due now; arm one timer for the next one that may be."""
        state = self.leader_state
        if self.role != LEADER or state is None or self.controller_name is None:
            return
        now = monotonic_ms()
        end = self.log.log_end_offset
        lag_ms = self.log.config.replica_lag_time_max_ms
        # A follower whose fetch waits here at the end is in sync, for as long as such a fetch can
        # wait (a live follower sends the next one at half the lag time; a paused one does not).
        waiting, expiry = set(), None
        for follower, (offset, since) in self._parked.items():
            if offset >= end and now - since <= lag_ms:
                state.on_follower_fetch(follower, offset, end, now)
                waiting.add(follower)
                expiry = since + lag_ms + 1 if expiry is None else min(expiry, since + lag_ms + 1)
        if self._isr_proposal is None or self._isr_proposal.done():
            proposal = state.proposed_isr(end, now, lag_ms)
            if proposal is not None:
                self._isr_proposal = asyncio.get_running_loop().create_task(self._propose_isr(state, proposal))
        due = state.next_isr_check_ms(end, lag_ms, waiting)
        if expiry is not None:
            due = expiry if due is None else min(due, expiry)
        if due is None:
            self._disarm("isr")
        else:
            self._arm("isr", (due - now) / 1000, self._check_isr)

    async def _propose_isr(self, state: LeaderState, proposal: list[int]) -> None:
        try:
            accepted = await asyncio.wait_for(
                (await self._controller()).alter_isr.remote(self.topic, self.partition, self.replica_id, state.leader_epoch, proposal),
                timeout=ALTER_ISR_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 (not answered: asked again below)
            self._controller_handle = None
            accepted = None
        if self.leader_state is not state:
            return
        state.isr_change_done(accepted)
        self._advance_high_watermark()
        if accepted is None:
            self._arm("isr", 0.5, self._check_isr)  # refused or unanswered: look again shortly
        else:
            self._check_isr()

    async def _reconcile(self, reply: dict) -> None:
        """Adopt the controller's view of the partition if ours is stale."""
        epoch, leader = reply["leader_epoch"], reply["leader"]
        if leader == self.replica_id:
            if self.role != LEADER or epoch != self.leader_epoch:
                await self.become_leader(epoch, reply["replicas"], reply["isr"])
            elif self.leader_state is not None:
                self.leader_state.replicas = list(reply["replicas"])
        elif leader is not None:
            if (
                self.role != FOLLOWER
                or epoch != self.leader_epoch
                or self.leader_id != leader
                or not _same_actor(self.leader_handle, reply["leader_handle"])
            ):
                await self.become_follower(epoch, leader, reply["leader_handle"])
        elif self.role == LEADER and epoch > self.leader_epoch:
            self._step_down(epoch)

    # --- roles --------------------------------------------------------------------------------------------

    @property
    def high_watermark(self) -> int:
        if self.role == LEADER and self.leader_state is not None:
            return self.leader_state.high_watermark
        return min(self.follower_high_watermark, self.log.log_end_offset)

    @property
    def last_stable_offset(self) -> int:
        """The smaller of the high watermark and the first offset of the oldest ongoing transaction:
        read_committed readers read below it."""
        high_watermark = self.high_watermark
        unstable = self.log.first_unstable_offset()
        return high_watermark if unstable is None else min(high_watermark, unstable)

    def _read_limit(self, isolation_level: int) -> int:
        """Where a consumer's fetch (or an offsets query) ends for its isolation level."""
        if isolation_level == READ_UNCOMMITTED:
            return self.high_watermark
        if isolation_level == READ_COMMITTED:
            return self.last_stable_offset
        raise InvalidRecordError(f"isolation_level must be {READ_UNCOMMITTED} or {READ_COMMITTED}, not {isolation_level!r}")

    def _signal(self, attribute: str) -> None:
        getattr(self, attribute).wake_all()

    def _advance_high_watermark(self) -> None:
        if self.leader_state is not None and self.leader_state.update_high_watermark(self.log.log_end_offset):
            self._signal("_hw_moved")
            self._signal("_appended")  # consumers long-polling at the old watermark can proceed
            self._high_watermark_moved()

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self.leader_epoch:
            self.leader_epoch = epoch
            self._save_state()

    async def become_leader(self, epoch: int, replicas: list[int], isr: list[int]) -> bool:
        """Lead the partition from ``epoch`` on (called by the controller; idempotent)."""
        self._started()
        if epoch == self.leader_epoch and self.role == LEADER and self.leader_state is not None:
            if list(replicas) != self.leader_state.replicas:
                self.leader_state.replicas = list(replicas)  # a replaced follower: the same leadership
                self._advance_high_watermark()
                self._check_isr()
            return True
        if epoch < self.leader_epoch:
            return False
        self._stop_following()
        self._set_epoch(epoch)
        self._shared_read = None  # a read cached under an earlier leadership may predate a truncation
        self._fetch_sessions.clear()  # so may a session's position
        self.log.epochs.assign(epoch, self.log.log_end_offset)
        previous_hw = self.high_watermark
        self.leader_state = LeaderState(
            self.replica_id, replicas, isr, epoch, self.log.log_end_offset, previous_hw, monotonic_ms()
        )
        self.role = LEADER
        self.leader_id = self.replica_id
        self.leader_handle = None
        self._parked.clear()
        self._advance_high_watermark()
        self._signal("_hw_moved")
        self._check_isr()
        return True

    def _step_down(self, epoch: int) -> None:
        self.leader_state = None
        self.role = UNKNOWN
        self._set_epoch(epoch)
        self._signal("_hw_moved")

    async def become_follower(self, epoch: int, leader_id: int, leader_handle) -> bool:
        """Follow ``leader_id`` from ``epoch`` on (called by the controller; idempotent)."""
        self._started()
        if epoch < self.leader_epoch:
            return False
        if (
            self.role == FOLLOWER
            and epoch == self.leader_epoch
            and self.leader_id == leader_id
            and _same_actor(self.leader_handle, leader_handle)
        ):
            return True
        if self.role == LEADER:
            self.follower_high_watermark = self.high_watermark
        self.leader_state = None
        self._shared_read = None
        self._set_epoch(epoch)
        self.role = FOLLOWER
        self.leader_id = leader_id
        self.leader_handle = leader_handle
        self._signal("_hw_moved")  # acks=all waiters on a deposed leader must give up
        self._stop_following()
        self._follow_task = asyncio.get_running_loop().create_task(self._follow(epoch, leader_handle))
        return True

    def _stop_following(self) -> None:
        if self._follow_task is not None:
            self._follow_task.cancel()
            self._follow_task = None

    async def _truncate_by_epoch(self, leader) -> None:
        """KIP-101/279: cut our log where our latest epoch diverges from the leader's log."""
        latest = self.log.epochs.latest_epoch
        if latest == UNDEFINED_EPOCH:
            return
        leader_epoch, end_offset = await asyncio.wait_for(leader.end_offset_for_epoch.remote(latest), FOLLOWER_CALL_TIMEOUT_S)
        if leader_epoch == UNDEFINED_EPOCH:
            target = self.log.log_start_offset
        else:
            _, our_end = self.log.epochs.end_offset_for(leader_epoch, self.log.log_end_offset)
            target = min(end_offset, our_end)
        if target < self.log.log_end_offset:
            self.log.truncate_to(target)

    async def _follow(self, epoch: int, leader) -> None:
        truncated = False
        last_error = None
        failing = False  # the last call to the leader failed or timed out: fetch with a short wait
        while not self._deleted and self.role == FOLLOWER and self.leader_epoch == epoch:
            self._check_fence()  # a newer epoch in our fence: a role change we may have missed
            try:
                if not truncated:
                    await self._truncate_by_epoch(leader)
                    truncated = True
                # Wait at most half the lag time: a fetch waiting at the leader counts as in sync only
                # that long, so an idle follower renews it before it stops counting.
                wait_ms = min(REPLICA_FETCH_WAIT_MS, self.log.config.replica_lag_time_max_ms // 2)
                if failing:
                    wait_ms = min(wait_ms, FOLLOWER_RETRY_WAIT_MS)
                max_bytes = REPLICA_FETCH_MAX_BYTES
                if self.throttle_bytes_per_s:
                    # A throttled copy (a reassignment) asks for small slices, so its pace stays smooth.
                    max_bytes = max(THROTTLED_FETCH_MIN_BYTES, min(max_bytes, int(self.throttle_bytes_per_s * THROTTLE_SLICE_S)))
                request = FetchRequest(self.log.log_end_offset, max_bytes, wait_ms, False, FETCH_INLINE_MAX_BYTES)
                try:
                    meta, data = await asyncio.wait_for(
                        leader.replica_fetch.remote(self.replica_id, epoch, request), (wait_ms + FOLLOWER_FETCH_SLACK_MS) / 1000
                    )
                except asyncio.TimeoutError:
                    raise RequestTimedOutError(
                        f"fetch from the leader not answered within its wait ({wait_ms} ms) and {FOLLOWER_FETCH_SLACK_MS} ms"
                    ) from None
                if failing:
                    logger.info("replica %s: fetching from leader %s again", self._label, self.leader_id)
                failing = False
                last_error = None
                if self.role != FOLLOWER or self.leader_epoch != epoch:
                    return
                if data is not None:
                    if isinstance(data, ray.ObjectRef):
                        data = await data
                    # The reply's offsets say which gaps (offsets the leader compacted) it covers.
                    unstable = self.log.first_unstable_offset()
                    self.log.append_as_follower(data, meta.first_offset, meta.next_offset)
                    copied = len(data)
                    self.fetched_bytes += copied
                    del data
                    self._after_follower_append(unstable)
                    await self._pace(copied)
                if meta.log_start_offset > self.log.log_start_offset:  # the leader's delete_records
                    self.log.delete_records(min(meta.log_start_offset, self.log.log_end_offset))
                if meta.high_watermark != self.follower_high_watermark:
                    self.follower_high_watermark = meta.high_watermark
                    self._high_watermark_moved()
            except asyncio.CancelledError:
                raise
            except OffsetOutOfRangeError:
                try:
                    start, _, end = await asyncio.wait_for(leader.offsets.remote(), FOLLOWER_CALL_TIMEOUT_S)
                except Exception:  # noqa: BLE001 (the next fetch tries again)
                    failing = True
                    await asyncio.sleep(0.1)
                    continue
                if self.log.log_end_offset < start:
                    self.log.truncate_fully_and_start_at(start)
                else:
                    truncated = False  # our log runs past the leader's: cut it by epoch again
            except Exception as error:  # noqa: BLE001 (leader gone, fenced or restarting: wait for a role change)
                failing = True
                if repr(error) != last_error:  # say so once per kind of error, not every 100 ms
                    last_error = repr(error)
                    logger.warning("replica %s: fetch from leader failed: %r", self._label, error)
                await asyncio.sleep(0.1)

    def _after_follower_append(self, unstable_before: int | None = None) -> None:
        """A follower compacts its own copy: a rolled segment may make a cleaning due, and so may a
        marker that ended the transaction holding cleanings back."""
        if self.log.config.compact and unstable_before is not None and self.log.first_unstable_offset() != unstable_before:
            self._arm_cleaning()
        if self.log.config.compact and len(self.log.segments) != self._segments_seen:
            self._segments_seen = len(self.log.segments)
            self._arm_cleaning()

    async def _pace(self, copied: int) -> None:
        """With a throttle (bytes/s), wait until the bytes copied so far are within the rate."""
        rate = self.throttle_bytes_per_s
        if not rate:
            self._throttle_until = 0.0
            return
        self._throttled_copy_bytes += copied
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._throttle_until = max(self._throttle_until, now) + copied / rate
        if self._throttle_until > now:
            await asyncio.sleep(self._throttle_until - now)

    async def set_throttle(self, bytes_per_s: int | None) -> None:
        """Limit how fast this replica copies from its leader (a reassignment's new replica); None: no limit."""
        self.throttle_bytes_per_s = int(bytes_per_s) if bytes_per_s else None

    # --- data plane --------------------------------------------------------------------------------------

    def _check_leader(self, epoch: int | None = None) -> LeaderState:
        self._check_fence()
        if self.role != LEADER or self.leader_state is None:
            raise NotLeaderError(f"replica {self.replica_id} of {self.topic}-{self.partition} is not the leader")
        if epoch is not None and epoch != self.leader_epoch:
            error = FencedLeaderEpochError if epoch < self.leader_epoch else NotLeaderError
            raise error(f"{self.topic}-{self.partition}: request epoch {epoch}, leader epoch {self.leader_epoch}")
        return self.leader_state

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
        if self._parked:
            self._check_isr()  # followers waiting at the end were in sync up to now
        result = self.log.append(batch, leader_epoch=self.leader_epoch)
        if not result.duplicate:
            self._signal("_appended")
            self._after_append()
            metrics.appended(self.topic, result.record_count, len(batch))
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments))
        self._advance_high_watermark()
        self._check_isr()
        if acks == "all":
            await self._wait_committed(state, result.last_offset + 1, min(int(timeout_ms), PRODUCE_TIMEOUT_MS_MAX))
        metrics.latency("produce_acks_all" if acks == "all" else "produce", monotonic_ms() - started_ms)
        append_time = result.max_timestamp_ms if self.log.config.message_timestamp_type == LOG_APPEND_TIME else -1
        return ProduceResponse(result.base_offset, result.log_end_offset, self.log.log_start_offset, result.max_timestamp_ms, append_time)

    async def _wait_for_earlier_batches(self, batch) -> None:
        """Let an idempotent producer's batch that arrived ahead of its predecessors wait for them.

        Ray runs an async actor's calls concurrently, so batches sent in order
        by one producer may start here out of order. A batch whose sequence is
        ahead of the producer's next expected one waits (briefly) for the gap to
        fill, instead of failing with OutOfOrderSequenceError and a retry.
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
            if not await self._appended.wait(remaining):
                return

    async def _wait_committed(self, state: LeaderState, end_offset: int, timeout_ms: int) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        while state.high_watermark < end_offset:
            if self.leader_state is not state:
                raise NotLeaderError(f"{self.topic}-{self.partition}: leadership moved before the batch was committed")
            if state.in_sync_count() < self.log.config.min_insync_replicas:
                raise NotEnoughReplicasError(
                    f"{self.topic}-{self.partition}: the ISR shrank below min.insync.replicas after the append"
                )
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RequestTimedOutError(f"{self.topic}-{self.partition}: not replicated to the ISR within {timeout_ms} ms")
            await self._hw_moved.wait(min(remaining, 0.1))

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
        written twice ends nothing the second time) or StorageError.
        """
        self._started()
        state = self._check_leader(leader_epoch)
        if not await self._lease_held():
            raise NotLeaderError(
                f"{self.topic}-{self.partition}: this leader may not take writes (its node's lease ran out, or "
                f"epoch {self.leader_epoch} is no longer the partition's current one)"
            )
        state = self._check_leader(leader_epoch)  # again: the role may have changed while the lease was awaited
        parsed = []
        for marker in markers:
            try:
                producer_id, producer_epoch, coordinator_epoch, commit = marker
            except (TypeError, ValueError):
                raise InvalidRecordError(f"a transaction marker is (producer id, producer epoch, coordinator epoch, commit), not {marker!r}") from None
            for name, value in (("producer id", producer_id), ("producer epoch", producer_epoch), ("coordinator epoch", coordinator_epoch)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidRecordError(f"a transaction marker's {name} must be an int >= 0, not {value!r}")
            parsed.append((producer_id, producer_epoch, coordinator_epoch, bool(commit)))
        min_isr = self.log.config.min_insync_replicas
        if state.in_sync_count() < min_isr:
            raise NotEnoughReplicasError(
                f"{self.topic}-{self.partition} has {state.in_sync_count()} in-sync replicas, min.insync.replicas={min_isr}"
            )
        if self._parked:
            self._check_isr()  # followers waiting at the end were in sync up to now
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
            self._signal("_appended")
            self._after_append()
            self._log_gauges.update(self.log.size_bytes, len(self.log.segments))
            self._advance_high_watermark()
            self._check_isr()
            if self.log.config.compact:
                self._arm_cleaning()  # a cleaning the transaction held back (nothing at or above the LSO is cleaned)
            await self._wait_committed(state, end_offset, min(int(timeout_ms), PRODUCE_TIMEOUT_MS_MAX))
        return results

    def _remember_session(self, session: int, next_offset: int) -> None:
        sessions = self._fetch_sessions
        sessions[session] = max(next_offset, sessions.get(session, 0))
        sessions.move_to_end(session)
        if len(sessions) > FETCH_SESSIONS_MAX:
            sessions.popitem(last=False)

    async def _read(self, request: FetchRequest, limit, max_bytes_cap: int) -> ReadResult | None:
        """Whole batches from ``request.offset`` below ``limit()``, waiting up to ``max_wait_ms`` for some.

        None if nothing arrived in time. In a fetch ``session``, the read starts
        where the session's last answered fetch ended, if that is past the
        offset: a consumer's pipelined fetches (sent before the earlier one's
        reply arrived) then continue one another. At most ``max_bytes_cap``
        bytes are read, whatever the request asks (at least one batch).
        """
        max_wait_ms = min(max(0, int(request.max_wait_ms)), FETCH_WAIT_MS_MAX)
        max_bytes = min(max(1, int(request.max_bytes)), max_bytes_cap)
        offset, session = int(request.offset), request.session
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_ms / 1000
        epoch = self.leader_epoch
        while True:
            if self.leader_epoch != epoch or self.role != LEADER:
                raise NotLeaderError(f"{self.topic}-{self.partition}: leadership changed during the fetch")
            start = offset if session is None else max(offset, self._fetch_sessions.get(session, 0))
            result = self.log.read(start, max_bytes, max_offset=limit(), verify_crc=bool(request.verify_crc))
            if result is not None:
                return result
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self._appended.wait(remaining)

    def _for_actor_call(self, result: ReadResult, request: FetchRequest):
        """A read's batches as an actor call's reply carries them: bytes when small, else an ObjectRef."""
        size = len(result.data)
        if size <= min(max(0, int(request.inline_max_bytes)), FETCH_INLINE_MAX_BYTES):
            # Small: a copy travels inside the reply, as bytes (no object-store round trip for the
            # reader, and bytes serialize faster than an array).
            return bytes(result.data)
        # One copy, from the mapped segment into the object store; readers asking for the same
        # batches at the same time (the followers, mostly) share it.
        key = (result.first_offset, result.next_offset, size, bool(request.verify_crc))  # checked or not
        if self._shared_read is not None and self._shared_read[0] == key:
            return self._shared_read[1]
        ref = ray.put(np.frombuffer(result.data, dtype=np.uint8))
        self._shared_read = (key, ref)
        return ref

    def _for_channel(self, result: ReadResult):
        """A read's batches for the local channel: a view of the mapped segment (no copy), however small.

        The view is written to the socket before the reply's task yields (see
        channel_server). A first batch larger than a channel reply carries
        raises ChannelReplyTooLargeError (the reader fetches it with an actor call).
        """
        if len(result.data) > wire.CHANNEL_FETCH_MAX_BYTES:
            raise ChannelReplyTooLargeError(
                f"{self.topic}-{self.partition}: the batch at offset {result.first_offset} is too large "
                f"for the local channel", result.next_offset,
            )
        return pickle.PickleBuffer(result.data)

    async def _serve_fetch(
        self, request: FetchRequest, limit, channel: bool = False, consumer: bool = True
    ) -> tuple[FetchResponse, object]:
        """Read, then package for the transport: (FetchResponse, data or None)."""
        started_ms = monotonic_ms()
        result = await self._read(request, limit, wire.CHANNEL_FETCH_MAX_BYTES if channel else FETCH_MAX_BYTES_MAX)
        if consumer:
            metrics.latency("fetch", monotonic_ms() - started_ms)
        if result is None:
            if consumer and request.max_wait_ms > 0:
                self._fetch_waits_expired += 1
            offset = int(request.offset)
            return FetchResponse(offset, offset, self.high_watermark, self.log.log_start_offset, self.leader_epoch, self._lso_or_hw()), None
        if consumer:
            metrics.fetched(self.topic, result.next_offset - result.first_offset, len(result.data))
        data = self._for_channel(result) if channel else self._for_actor_call(result, request)
        if request.session is not None:  # only once packaged: a refused reply leaves the session where it was
            self._remember_session(request.session, result.next_offset)
        aborted = ()
        if consumer and request.isolation_level == READ_COMMITTED:
            aborted = tuple(self.log.aborted_transactions(result.first_offset, result.next_offset))
        meta = FetchResponse(
            result.first_offset, result.next_offset, self.high_watermark, self.log.log_start_offset, self.leader_epoch,
            self._lso_or_hw(), aborted,
        )
        return meta, data

    def _lso_or_hw(self) -> int:
        """A fetch reply's last stable offset (a follower answering has none of its own: its high watermark)."""
        return self.last_stable_offset if self.role == LEADER else self.high_watermark

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

    async def channel_address(self) -> tuple[str, str] | None:
        """(node id, socket address) of this replica's local channel, or None where there is none."""
        self._started()
        try:
            address = await asyncio.shield(self._channel_started)
        except Exception as error:  # noqa: BLE001 (clients fall back to actor calls)
            logger.warning("replica %s: no local channel: %s", self._label, error)
            return None
        return None if address is None else (ray.get_runtime_context().get_node_id(), address)

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
        """
        self._started()
        state = self._check_leader(epoch)
        if request.offset > self.log.log_end_offset:
            raise OffsetOutOfRangeError(f"follower offset {request.offset} is past the leader's log end {self.log.log_end_offset}")
        state.on_follower_fetch(follower_id, request.offset, self.log.log_end_offset, monotonic_ms())
        self._advance_high_watermark()
        self._check_isr()
        if request.offset < self.log.log_end_offset:
            return await self._serve_fetch(request, lambda: None, consumer=False)
        # At the end: the fetch waits here for the next append; while it waits, this follower is in sync.
        parked = (request.offset, monotonic_ms())
        self._parked[follower_id] = parked
        try:
            return await self._serve_fetch(request, lambda: None, consumer=False)
        finally:
            if self._parked.get(follower_id) is parked:
                del self._parked[follower_id]

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
        start = self.log.delete_records(offset)
        self._shared_read = None
        self._log_shrank()
        self._arm_retention()
        return start

    async def offsets(self, isolation_level: int = READ_UNCOMMITTED) -> tuple[int, int, int]:
        """(log start offset, high watermark, log end offset); with ``isolation_level`` READ_COMMITTED,
        the last stable offset instead of the high watermark (ListOffsets' latest for such readers)."""
        self._started()
        return self.log.log_start_offset, self._read_limit(isolation_level), self.log.log_end_offset

    async def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """First offset with a timestamp >= ``timestamp_ms`` below the high watermark, or -1."""
        self._started()
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
        self._arm_cleaning()

    async def delete(self) -> None:
        """Close and remove this replica's files; the actor is killed by the controller afterwards.

        A replica removed by a reassignment may still think it leads (the
        controller elected the new leader elsewhere and told only the replicas
        that stay). It steps down first, so fetches and acks="all" produces
        waiting here end with NotLeaderError before the log closes under them.
        """
        if self._removing:
            return  # asked again: the first call did the work
        self._deleted = True
        self._removing = True
        self.leader_state = None
        self.role = UNKNOWN
        if self._appended is not None:
            self._signal("_appended")
            self._signal("_hw_moved")
        self._stop_following()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._cleaning is not None and not self._cleaning.done():
            if self._cleaning_stop is not None:
                self._cleaning_stop.set()  # its thread stops at the next batch
            await asyncio.wait({self._cleaning})  # before the files go
        if self._fence is not None:
            self._fence.remove()
        await self._channel.close()
        self.log.delete()
        shutil.rmtree(self.directory, ignore_errors=True)
        self._owner_lock.release()

    async def ping(self) -> int:
        """Ready check: returns the process id (fault-injection tests kill it)."""
        self._started()
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
            "fetched_bytes": self.fetched_bytes,  # copied from leaders since this process started
            "segments": len(self.log.segments),
            # Long polls parked here for data (and, rarely, an idempotent batch waiting for an earlier one).
            "fetches_waiting": len(self._appended),
            # Consumers' long polls that waited here until their max_wait_ms ran out, with no data.
            "fetch_waits_expired": self._fetch_waits_expired,
            # As a reassignment's new replica: the copy's rate limit (None: none), and the bytes copied under one.
            "throttle_bytes_per_s": self.throttle_bytes_per_s,
            "throttled_copy_bytes": self._throttled_copy_bytes,
            # What recovery did when this process opened the log (a restart after a crash cuts a torn tail).
            "recovery": {
                "segments_scanned": self.log.recovery.segments_scanned,
                "truncated_bytes": self.log.recovery.truncated_bytes,
                "errors": list(self.log.recovery.errors),
                "swaps": list(self.log.recovery.swaps),  # cleanings a crash interrupted, completed or discarded
            },
        }


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
