"""The transaction coordinator in the controller: its RPCs, ``__transaction_state``, markers and the timeout timer.

The controller owns one :class:`TransactionService` and forwards the
transactional producer's calls to it (InitProducerId, AddPartitionsToTxn,
AddOffsetsToTxn, EndTxn), as it forwards group calls to the group service.
The rules live in the sans-IO
:class:`~logbus.protocol.transaction_coordinator.TransactionCoordinator`; this
module does its I/O:

- Durability. Every transition is appended to the compacted, replicated
  internal topic ``__transaction_state`` (key: the transactional id; value:
  Kafka's TransactionLogValue) with acks=all before it takes effect or is
  answered. A transition whose append failed for certain (no leader to send
  it to, or a leader that refused it) is dropped; one whose outcome is unknown
  (a timeout, a leader that died during the call) is appended again, in the
  background, until it is durable: the transactional id answers
  ConcurrentTransactionsError (retriable) meanwhile, so memory never runs
  ahead of the log nor the log ahead of memory. On start the service reads the
  topic from its start (the last record per key wins), takes a coordinator
  epoch one above the last one recorded, writes again the markers of every
  transaction found prepared, and the timer aborts the Ongoing ones when their
  timeouts pass (the timestamps are wall time, as Kafka's).

- Markers. Once PrepareCommit or PrepareAbort is durable, one marker per
  partition of the transaction is written through the partition's current
  leader (``write_txn_markers``), all partitions at once, each retried until
  written (a leader that moved is looked up again; a partition whose topic
  was deleted is skipped); then CompleteCommit/CompleteAbort is appended. A
  transaction's offsets are a partition of ``__consumer_offsets``: once its
  marker is written the group service makes the offsets committed (or drops
  them). ``end_txn`` returns when that is done, or after its bound (the
  completion goes on; a retry of the same outcome waits for it).

- Timeouts. One timer task sleeps until the earliest deadline of the Ongoing
  transactions (``next_deadline_ms``) or until a change makes an earlier
  one; none runs while no transaction is open.

What it needs of the controller is :class:`TransactionHost`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from logbus.actors.fetcher import reply_async
from logbus.actors.remote import unwrap
from logbus.clock import wall_ms
from logbus.errors import (
    ConcurrentTransactionsError,
    CoordinatorNotAvailableError,
    LeaderNotAvailableError,
    LogbusError,
    NotLeaderError,
    ProducerFencedError,
    RequestTimedOutError,
    UnknownTopicError,
)
from logbus.protocol.group_coordinator import OFFSETS_TOPIC, validate_group_id
from logbus.protocol.messages import FetchRequest, TopicPartition
from logbus.protocol.transaction_coordinator import (
    COORDINATOR_KEY,
    TRANSACTION_STATE_TOPIC,
    AwaitCompletion,
    Markers,
    Persist,
    Reply,
    Retry,
    TransactionCoordinator,
    coordinator_value,
    validate_transactional_id,
)

logger = logging.getLogger(__name__)

STATE_TOPIC_PARTITIONS = 1
STATE_TOPIC_REPLICATION_MAX = 3
STATE_TOPIC_CONFIG = {"segment.bytes": 64 << 20, "min.insync.replicas": 1, "cleanup.policy": "compact"}
LOAD_TIMEOUT_S = 60.0
LOAD_FETCH_BYTES = 16 << 20
APPEND_CALL_TIMEOUT_S = 30.0
MARKER_CALL_TIMEOUT_S = 30.0
RETRY_BACKOFF_S = 0.1
RETRY_BACKOFF_MAX_S = 2.0
CALL_WAIT_S_MAX = 60.0  # bound on how long one RPC waits for appends and markers before answering retriable
TIMER_SLEEP_S_MAX = 60.0  # the timer re-checks at least this often while transactions are open (wall clock jumps)


class TransactionHost(Protocol):
    """What the transaction service needs of the controller."""

    def partition_counts(self) -> dict[str, int]:
        """Every topic (internal ones included) and its partition count."""

    def leader_handle(self, topic: str, partition: int):
        """The actor handle of a partition's leader; UnknownTopicError, or LeaderNotAvailableError while it has none."""

    async def create_internal_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        """Create a logbus-internal topic and wait until it serves."""

    def live_node_count(self) -> int:
        """How many nodes may host replicas."""

    async def allocate_producer_id(self) -> int:
        """A producer id never handed out before."""


def _certainly_not_written(error: BaseException) -> bool:
    """Whether an append that failed with ``error`` left nothing in the log (else its outcome is unknown)."""
    return isinstance(error, NotLeaderError | LeaderNotAvailableError | UnknownTopicError)


class TransactionService:
    """Transactional producers' RPCs over a TransactionCoordinator (see the module docstring)."""

    def __init__(self, host: TransactionHost, groups) -> None:
        self._host = host
        self._groups = groups  # the GroupService: transactional offsets, and which partition holds a group's
        self.coordinator = TransactionCoordinator()
        self._loaded: asyncio.Task | None = None
        self._epoch_written = False
        self._appends: dict[str, asyncio.Task] = {}  # transactional id -> its pending transition's append
        self._completions: dict[str, asyncio.Task] = {}  # transactional id -> the writing of its markers
        self._timer: asyncio.Task | None = None
        self._timer_wake: asyncio.Event | None = None

    # --- start-up: load __transaction_state ---------------------------------------------------------

    def start(self) -> None:
        """Load the state (on the controller's event loop) and complete what the last coordinator left."""
        if self._loaded is None:
            self._loaded = asyncio.get_running_loop().create_task(self._load())

    async def ready(self) -> None:
        self.start()
        await asyncio.shield(self._loaded)

    async def _load(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            try:
                coordinator = TransactionCoordinator()
                if TRANSACTION_STATE_TOPIC in self._host.partition_counts():
                    await self._read_all(coordinator)
                break
            except Exception as error:  # noqa: BLE001 (a leader moving or restarting: retry until the deadline)
                cause = unwrap(error)
                if time.monotonic() > deadline:
                    self._loaded = None  # the next call tries again
                    logger.error("could not read %s: %r", TRANSACTION_STATE_TOPIC, cause)
                    raise CoordinatorNotAvailableError(f"the transaction state is not readable yet: {cause!r}") from None
                await asyncio.sleep(0.2)
        coordinator.coordinator_epoch += 1  # this coordinator's markers outrank any earlier one's
        self.coordinator = coordinator
        for markers in coordinator.prepared():
            logger.info("transaction %s: completing its %s after a restart", markers.transactional_id, "commit" if markers.commit else "abort")
            self._start_completion(markers)
        self._wake_timer()

    async def _read_all(self, coordinator: TransactionCoordinator) -> None:
        from logbus.storage import record_batch as rb  # noqa: PLC0415 (Arrow only where records are read)

        leader = self._host.leader_handle(TRANSACTION_STATE_TOPIC, 0)
        offset, high_watermark, _ = await asyncio.wait_for(leader.offsets.remote(), 10)
        while offset < high_watermark:  # (a compacted log: a reply may start past the offset asked for)
            meta, data = await asyncio.wait_for(reply_async(leader.fetch.remote(FetchRequest(offset, LOAD_FETCH_BYTES))), 30)
            if data is None:
                break
            for _, _, records in rb.slice_batches(data, offset, high_watermark):
                for key, value in zip(records.column("key").to_pylist(), records.column("value").to_pylist()):
                    coordinator.load(key, value)
            offset = meta.next_offset

    async def _ensure_topic(self) -> None:
        if TRANSACTION_STATE_TOPIC in self._host.partition_counts():
            return
        replication = min(STATE_TOPIC_REPLICATION_MAX, max(1, self._host.live_node_count()))
        try:
            await self._host.create_internal_topic(TRANSACTION_STATE_TOPIC, STATE_TOPIC_PARTITIONS, replication, STATE_TOPIC_CONFIG)
        except LogbusError:
            if TRANSACTION_STATE_TOPIC not in self._host.partition_counts():
                raise

    async def _append(self, records: list[tuple[bytes, bytes | None]]) -> None:
        """One acks=all append to ``__transaction_state``; raises the cause if it fails."""
        from logbus.storage import record_batch as rb  # noqa: PLC0415

        await self._ensure_topic()
        if not self._epoch_written:
            records = [(COORDINATOR_KEY, coordinator_value(self.coordinator.coordinator_epoch)), *records]
        batch = rb.encode_batch([v for _, v in records], [k for k, _ in records])
        leader = self._host.leader_handle(TRANSACTION_STATE_TOPIC, 0)
        try:
            await asyncio.wait_for(leader.produce.remote(batch, "all"), APPEND_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestTimedOutError(f"no reply from the leader of {TRANSACTION_STATE_TOPIC} in {APPEND_CALL_TIMEOUT_S}s") from None
        except Exception as error:  # noqa: BLE001
            raise unwrap(error) from None
        self._epoch_written = True

    # --- transitions: appended until durable -----------------------------------------------------------

    def _start_persist(self, step: Persist) -> asyncio.Task:
        """Append the step's record until it is durable (or certainly refused), then apply it."""
        tid = step.metadata.transactional_id
        task = asyncio.get_running_loop().create_task(self._persist(step))
        self._appends[tid] = task
        task.add_done_callback(lambda _: self._appends.pop(tid, None) if self._appends.get(tid) is task else None)
        return task

    async def _persist(self, step: Persist) -> None:
        tid = step.metadata.transactional_id
        backoff = RETRY_BACKOFF_S
        maybe_written = False
        while True:
            try:
                await self._append([(step.key, step.value)])
                break
            except Exception as error:  # noqa: BLE001 (every failure is either certain or retried)
                cause = unwrap(error)
                if not maybe_written and _certainly_not_written(cause):
                    self.coordinator.abandon(tid)
                    raise CoordinatorNotAvailableError(f"the transaction state could not be saved: {cause!r}") from None
                maybe_written = True
                logger.warning("transaction %s: saving %s failed (%r); retrying", tid, step.metadata.state.name, cause)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
        self.coordinator.applied(tid)
        self._wake_timer()
        if step.markers is not None:
            self._start_completion(step.markers)

    async def _run(self, step, wait_s: float):
        """Carry out a step for a caller: its reply, or Retry.AFTER_COMPLETION when the call must be made again."""
        if isinstance(step, Reply):
            return step.value
        if isinstance(step, AwaitCompletion):
            await self._await_completion(step.transactional_id, wait_s)
            return Retry.AFTER_COMPLETION
        task = self._start_persist(step)
        await self._bounded(task, wait_s, f"saving the state of transactional id {step.metadata.transactional_id!r}")
        if step.markers is not None:
            await self._await_completion(step.metadata.transactional_id, wait_s)
        return step.reply

    @staticmethod
    async def _bounded(task: asyncio.Task, wait_s: float, what: str) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.001, wait_s))
        except asyncio.TimeoutError:
            raise ConcurrentTransactionsError(f"{what} is taking longer than {wait_s:.1f}s; it goes on, retry") from None

    async def _await_completion(self, tid: str, wait_s: float) -> None:
        task = self._completions.get(tid)
        if task is None:
            task = self._appends.get(tid)
        if task is not None:
            await self._bounded(task, wait_s, f"completing the transaction of {tid!r}")
            task = self._completions.get(tid)  # an append may have started the markers
            if task is not None:
                await self._bounded(task, wait_s, f"completing the transaction of {tid!r}")
        else:
            await asyncio.sleep(RETRY_BACKOFF_S)  # (nothing to wait on: the state moved meanwhile)

    # --- markers ------------------------------------------------------------------------------------------

    def _start_completion(self, markers: Markers) -> None:
        tid = markers.transactional_id
        task = asyncio.get_running_loop().create_task(self._complete(markers))
        self._completions[tid] = task
        task.add_done_callback(lambda _: self._completions.pop(tid, None) if self._completions.get(tid) is task else None)

    async def _complete(self, markers: Markers) -> None:
        """Write every marker of a prepared transaction, then persist its Complete state (retried until done)."""
        tid = markers.transactional_id
        await asyncio.gather(*(self._write_marker(markers, tp) for tp in markers.partitions))
        backoff = RETRY_BACKOFF_S
        while True:
            try:
                await self._persist(self.coordinator.markers_written(tid, wall_ms()))
                return
            except LogbusError as error:  # certainly not written (no leader): try again
                logger.warning("transaction %s: saving its completion failed (%r); retrying", tid, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)

    async def _write_marker(self, markers: Markers, tp: TopicPartition) -> None:
        """Write one partition's marker through its current leader, retried until written."""
        marker = (markers.producer_id, markers.producer_epoch, markers.coordinator_epoch, markers.commit)
        backoff = RETRY_BACKOFF_S
        while True:
            try:
                if tp.topic == OFFSETS_TOPIC:
                    # The group service's table is loaded before this marker is in the log: loaded
                    # after, it reads the marker itself; loaded across it, it could miss the update below.
                    await self._groups.offsets.ready()
                if tp.topic not in self._host.partition_counts():
                    logger.info("transaction %s: %s was deleted; no marker for it", markers.transactional_id, tp)
                    return
                leader = self._host.leader_handle(*tp)
                (error,) = await asyncio.wait_for(leader.write_txn_markers.remote([marker], None), MARKER_CALL_TIMEOUT_S)
                if error is not None:
                    raise error
                break
            except Exception as error:  # noqa: BLE001 (a leader moving, dying or not yet leased: retry)
                cause = unwrap(error)
                if isinstance(cause, ProducerFencedError):
                    # A newer epoch of the producer has written there: this transaction was completed
                    # before (only a completed transaction lets a newer epoch start). Nothing to add.
                    logger.info("transaction %s: %s has a newer epoch; marker not needed (%s)", markers.transactional_id, tp, cause)
                    break
                logger.debug("transaction %s: marker for %s failed (%r); retrying", markers.transactional_id, tp, cause)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
        if tp.topic == OFFSETS_TOPIC:
            self._groups.transaction_completed(markers.producer_id, markers.commit)

    # --- the timer ------------------------------------------------------------------------------------

    def _wake_timer(self) -> None:
        if self._timer_wake is not None:
            self._timer_wake.set()
        if self.coordinator.next_deadline_ms() is not None and (self._timer is None or self._timer.done()):
            self._timer = asyncio.get_running_loop().create_task(self._run_timer())

    async def _run_timer(self) -> None:
        """Sleep until the earliest deadline, abort what expired; stop when no transaction is open."""
        while True:
            deadline = self.coordinator.next_deadline_ms()
            if deadline is None:
                return
            self._timer_wake = wake = asyncio.Event()
            delay_s = (deadline - wall_ms()) / 1000
            if delay_s > 0:
                try:
                    await asyncio.wait_for(wake.wait(), min(delay_s, TIMER_SLEEP_S_MAX))
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                for step in self.coordinator.expire(wall_ms()):
                    logger.info("transaction %s: timed out after %d ms; aborting it", step.metadata.transactional_id, step.metadata.timeout_ms)
                    task = self._start_persist(step)
                    task.add_done_callback(_log_failure)
            except Exception:  # noqa: BLE001 (the timer must survive; the next round retries)
                logger.exception("transaction timer error")
            if self.coordinator.next_deadline_ms() == deadline:
                await asyncio.sleep(RETRY_BACKOFF_S)  # (an expired transaction with a change being saved)

    # --- the RPCs -------------------------------------------------------------------------------------

    async def init_producer_id(self, transactional_id: str, timeout_ms: int, expected: tuple[int, int] | None = None) -> tuple[int, int]:
        """InitProducerId for a transactional producer: its (producer id, epoch); fences older instances."""
        validate_transactional_id(transactional_id)
        await self.ready()
        deadline = time.monotonic() + CALL_WAIT_S_MAX
        while True:
            new_id = await self._host.allocate_producer_id() if self.coordinator.needs_producer_id(transactional_id) else None
            if new_id is None and self.coordinator.needs_producer_id(transactional_id):
                continue  # (the state changed while the id was allocated)
            step = self.coordinator.init_producer_id(transactional_id, timeout_ms, wall_ms(), new_id, expected)
            result = await self._run(step, deadline - time.monotonic())
            if result is not Retry.AFTER_COMPLETION:
                return result
            if time.monotonic() > deadline:
                raise ConcurrentTransactionsError(f"transactional id {transactional_id!r} is still completing its last transaction")

    async def add_partitions(self, transactional_id: str, producer_id: int, epoch: int, partitions: list) -> None:
        """AddPartitionsToTxn: durable before it returns."""
        await self.ready()
        counts = self._host.partition_counts()
        checked = []
        for tp in partitions:
            tp = TopicPartition(*tp)
            if tp.topic not in counts or not 0 <= tp.partition < counts[tp.topic]:
                raise UnknownTopicError(f"cannot add {tp} to a transaction: no such partition")
            checked.append(tp)
        step = self.coordinator.add_partitions(transactional_id, producer_id, epoch, checked, wall_ms())
        await self._run(step, CALL_WAIT_S_MAX)

    def offsets_partition(self, group_id: str) -> TopicPartition:
        """The ``__consumer_offsets`` partition that holds ``group_id``'s offsets."""
        validate_group_id(group_id)
        return TopicPartition(OFFSETS_TOPIC, 0)  # the topic has one partition (committed_offsets.py)

    async def add_offsets(self, transactional_id: str, producer_id: int, epoch: int, group_id: str) -> None:
        """AddOffsetsToTxn: the group's ``__consumer_offsets`` partition joins the transaction."""
        await self.ready()
        await self._groups.offsets.ensure_topic()
        step = self.coordinator.add_partitions(transactional_id, producer_id, epoch, [self.offsets_partition(group_id)], wall_ms())
        await self._run(step, CALL_WAIT_S_MAX)

    async def txn_offset_commit(self, transactional_id: str, producer_id: int, epoch: int, group_metadata: tuple, offsets: dict) -> None:
        """TxnOffsetCommit: the consumer group's offsets, committed or dropped with the transaction.

        ``group_metadata`` is (group id, generation, member id, group instance
        id) from ``Consumer.group_metadata()``: the group checks the generation
        and member as for a commit (KIP-447: a zombie consumer's offsets are
        refused). The producer must be the transactional id's current instance,
        in a transaction to which ``add_offsets`` added the group.
        """
        await self.ready()
        group_id, generation, member_id = group_metadata[0], group_metadata[1], group_metadata[2]
        self.coordinator.check_in_transaction(transactional_id, producer_id, epoch, self.offsets_partition(group_id))
        await self._groups.txn_offset_commit(group_id, member_id or "", generation, offsets, producer_id, epoch)

    async def end_txn(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        """EndTxn: commit or abort; returns once every marker is written and the outcome saved."""
        await self.ready()
        deadline = time.monotonic() + CALL_WAIT_S_MAX
        while True:
            step = self.coordinator.end_txn(transactional_id, producer_id, epoch, bool(commit), wall_ms())
            result = await self._run(step, deadline - time.monotonic())
            if result is not Retry.AFTER_COMPLETION:
                return None

    async def describe(self) -> list[dict]:
        """Every transactional id's state (for administration and tests)."""
        await self.ready()
        return [
            {
                "transactional_id": m.transactional_id, "producer_id": m.producer_id, "producer_epoch": m.producer_epoch,
                "state": m.state.name, "timeout_ms": m.timeout_ms, "partitions": sorted(m.partitions), "start_ms": m.start_ms,
            }
            for m in self.coordinator.describe()
        ]


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("transaction timeout abort not saved yet: %r (the timer tries again)", task.exception())
