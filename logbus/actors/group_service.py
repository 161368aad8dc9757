"""Consumer group coordination in the controller: the group RPCs, their long polls, and groups.json.

The controller owns one :class:`GroupService` and forwards every group RPC to
it. The service owns its state: a
:class:`~logbus.protocol.group_coordinator.GroupCoordinator` (pure state,
driven with the controller's clock), the writer of
``{data_dir}/controller/groups.json``, the calls held open, and the
committed offsets (:class:`~logbus.actors.committed_offsets.CommittedOffsets`,
durable in ``__consumer_offsets``). What it needs of the controller is the
small :class:`GroupHost` interface: partition counts, a partition's leader,
creating the internal topic, and how many nodes there are.

Every method is idempotent in effect (a repeated commit writes the same
offsets again), as the controller's retry contract requires.

Long polls. A member's heartbeat is held open while the group has nothing
for it, and a join is held open until its generation forms; both are
answered as soon as the group's :meth:`~GroupCoordinator.fingerprint`
(state, generation, members) changes. A change wakes every call waiting on
that group through one ``asyncio.Event`` per group. A group timer expires
sessions every 100 ms, so a dead member's session ends, and the survivors
hear of it, within about 100 ms of its timeout. A held call counts as a sign
of life only when it arrives (re-checks after a wake-up pass
``keep_alive=False``), and it waits at most half the member's session
timeout, so a member that dies during a long poll still expires on time.
At most :data:`LONG_POLLS_MAX` calls wait at once: the controller runs at
most :data:`~logbus.actors.controller.CONTROLLER_MAX_CONCURRENCY` calls at a
time, and replicas' lease heartbeats must never queue behind consumers' long
polls. Beyond it, heartbeats answer at once and the member paces itself by
its heartbeat interval.

Durability. ``groups.json`` is written only when what it holds changes (a
repeated join or a heartbeat does not move the coordinator's
``state_version``), by one writer task off the event loop
(:class:`~logbus.actors.state_writer.StateWriter`). A group RPC answers only
once the state it saw is on disk, so no member acts on a state that a
controller restart would roll back.

Lag. Every :data:`LAG_EXPORT_INTERVAL_S` the timer publishes each group's
lag per partition as the Ray metric ``logbus_consumer_group_lag``, which Ray
serves with its other metrics on each node's Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Protocol

from logbus.actors.committed_offsets import CommittedOffsets
from logbus.actors.state_writer import StateWriter
from logbus.clock import monotonic_ms, wall_ms
from logbus.errors import (
    FencedMemberEpochError,
    GroupNotEmptyError,
    GroupSubscribedToTopicError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidPartitionError,
    UnknownMemberIdError,
    UnknownTopicError,
    UnsupportedAssignorError,
)
from logbus.protocol.group_coordinator import (
    DEFAULT_REBALANCE_TIMEOUT_MS,
    DEFAULT_SESSION_TIMEOUT_MS,
    REBALANCE_TIMEOUT_MS_MAX,
    GroupCoordinator,
    GroupState,
    JoinPending,
    JoinResult,
    OffsetAndMetadata,
    SyncPending,
    long_poll_wait_ms,
    validate_group_id,
)
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import validate_partition, validate_topic_name

logger = logging.getLogger(__name__)

GROUPS_FILE = "groups.json"
LAG_EXPORT_INTERVAL_S = 5.0
LONG_POLL_MAX_MS = 30_000  # bound on how long a heartbeat or join call may wait for the group to change
LONG_POLLS_MAX = 500  # calls waiting at once (the controller's max_concurrency is larger, see controller.py)
JOIN_RECHECK_MS = 1_000  # a held join re-runs the join this often even without a change (a safety net)
GROUP_TICK_S = 0.1  # sessions and rebalance timeouts are checked this often
# The timer ticks while any group has members: a gap of this long between two coordinator calls means the
# controller's process stalled, and the stall is not counted against sessions (as for node leases).
GROUP_STALL_MS = 1_000
OFFSETS_CALL_TIMEOUT_S = 10.0
CONSUMER_SESSION_TIMEOUT_MS = 45_000  # Kafka's group.consumer.session.timeout.ms (KIP-848 members)


class GroupHost(Protocol):
    """What the group service needs of the controller."""

    def partition_counts(self) -> dict[str, int]:
        """Every topic (the internal one included) and its partition count."""

    def leader_handle(self, topic: str, partition: int):
        """The actor handle of a partition's leader; UnknownTopicError, or LeaderNotAvailableError while it has none."""

    async def create_internal_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        """Create a logbus-internal topic (``__consumer_offsets``) and wait until it serves."""

    def live_node_count(self) -> int:
        """How many nodes may host replicas."""


class GroupService:
    """Group RPCs, long polls, groups.json and committed offsets (see the module docstring)."""

    def __init__(self, host: GroupHost, metadata_dir: str) -> None:
        self._host = host
        self._writer = StateWriter(os.path.join(metadata_dir, GROUPS_FILE))
        counts = host.partition_counts()
        try:
            with open(self._writer.path) as file:
                self.coordinator = GroupCoordinator.from_json(file.read(), now_ms=monotonic_ms(), topic_partition_counts=counts,
                                                              stall_ms=GROUP_STALL_MS)
        except (FileNotFoundError, ValueError):
            self.coordinator = GroupCoordinator(topic_partition_counts=counts, stall_ms=GROUP_STALL_MS)
        self._version_queued = self.coordinator.state_version  # of the coordinator state last queued for writing
        self.offsets = CommittedOffsets(host)
        # Long polls.
        self._events: dict[str, asyncio.Event] = {}
        self._prints: dict[str, tuple] = {}  # group -> its fingerprint when its event was made (one per event)
        # group -> [its commits' lock, commits holding or waiting for it]: one group's commits are applied
        # one at a time, in the order they came (an entry lives while a commit of the group does).
        self._commit_order: dict[str, list] = {}
        self._long_polls: dict[int, tuple[str, str, str, float, float]] = {}  # id -> (kind, group, member, start, wait)
        self._long_poll_ids = 0
        self._timer: asyncio.Task | None = None
        self._lag_gauge = None
        self._lag_exported_s = 0.0

    def start(self) -> None:
        """Start the group timer (on the controller's event loop): sessions expire even with no group calls."""
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._run_timer())

    # --- groups.json ---------------------------------------------------------------------------------

    def _save(self) -> None:
        """Queue a write of the groups if their durable state changed; returns at once."""
        if self.coordinator.state_version == self._version_queued:
            return
        self._version_queued = self.coordinator.state_version
        self._writer.queue(self.coordinator.to_json())

    async def _settle(self, group_id: str, *, waiting: bool = False) -> asyncio.Event | None:
        """After a call changed (or may have changed) ``group_id``: wake its waiters, save, and wait
        until the state is durable. For a caller that will wait (``waiting``), returns the event of
        the next change, taken before any wait; None otherwise (no event is kept for nobody)."""
        self._wake_changed(group_id)
        event = self._event(group_id) if waiting else None
        self._save()
        await self._writer.durable()
        return event

    # --- long polls: members wait on their group instead of polling it --------------------------------

    def _event(self, group_id: str) -> asyncio.Event:
        event = self._events.get(group_id)
        if event is None:
            event = self._events[group_id] = asyncio.Event()
            self._prints[group_id] = self.coordinator.fingerprint(group_id)
        return event

    def _wake_changed(self, group_id: str | None = None) -> None:
        """Wake the members waiting on a group whose state, generation or members changed."""
        for gid in [group_id] if group_id is not None else list(self._events):
            event = self._events.get(gid)
            if event is None:
                continue  # nobody waits: the next waiter's event takes the fingerprint then
            if self._prints.get(gid) == self.coordinator.fingerprint(gid):
                continue
            del self._events[gid]
            self._prints.pop(gid, None)  # kept only beside an event: as many as the groups waited on
            event.set()

    def _may_long_poll(self) -> bool:
        return len(self._long_polls) < LONG_POLLS_MAX

    async def _wait_change(self, kind: str, group_id: str, member_id: str, event: asyncio.Event, timeout_ms: float) -> bool:
        """Wait until ``event`` (taken before the state was read) fires or ``timeout_ms`` passes."""
        if timeout_ms <= 0:
            return False
        self._long_poll_ids += 1
        key = self._long_poll_ids
        self._long_polls[key] = (kind, group_id, member_id, time.monotonic(), timeout_ms / 1000)
        try:
            await asyncio.wait_for(event.wait(), timeout_ms / 1000)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            del self._long_polls[key]

    def long_polls(self, group_id: str) -> list[dict]:
        """The calls of ``group_id`` held open now: kind ("heartbeat" or "join"), member_id, waited_ms, wait_ms."""
        now = time.monotonic()
        return [
            {"kind": kind, "member_id": member, "waited_ms": int((now - start) * 1000), "wait_ms": int(wait * 1000)}
            for kind, group, member, start, wait in list(self._long_polls.values())
            if group == group_id
        ]

    # --- timers and topic changes ----------------------------------------------------------------------

    def topics_changed(self) -> None:
        """Called after topics are created, deleted or grow: groups subscribed to them rebalance."""
        self.coordinator.metadata_changed(self._host.partition_counts(), now_ms=monotonic_ms())
        self._wake_changed()
        self._save()

    def tick(self) -> None:
        """Expire sessions and rebalance timeouts; wake the survivors at once."""
        for removed in self.coordinator.tick(monotonic_ms()):
            logger.info("group %s: member %s removed (%s)", removed.group_id, removed.member_id, removed.reason)
        self._wake_changed()
        self._save()
        self._writer.retry_failed()

    def _busy(self) -> bool:
        """Whether the timer has anything to do: a group with members (sessions to expire, rebalances
        to time out), committed offsets (lag to export) or a failed write of groups.json to retry."""
        return (
            bool(self.offsets.table)
            or self._writer.has_failed()
            or any(g.state is not GroupState.EMPTY and g.state is not GroupState.DEAD for g in self.coordinator.list_groups())
        )

    async def _run_timer(self) -> None:
        """Ticks while there is something to tick; a cluster without groups has no group timer at all
        (every group call starts it again, see ``start``)."""
        while True:
            await asyncio.sleep(GROUP_TICK_S)
            try:
                self.tick()
                if time.monotonic() - self._lag_exported_s >= LAG_EXPORT_INTERVAL_S:
                    self._lag_exported_s = time.monotonic()
                    await self._export_lag()
                if not self._busy():
                    return
            except Exception:  # noqa: BLE001 (the timer must survive; the next tick retries)
                logger.exception("group timer error")

    async def _export_lag(self) -> None:
        """Publish each group's lag per partition as the Ray metric ``logbus_consumer_group_lag``."""
        committed = dict(self.offsets.table)
        if not committed:
            return
        if self._lag_gauge is None:
            from ray.util.metrics import Gauge  # only the controller that has groups pays for it

            self._lag_gauge = Gauge(
                "logbus_consumer_group_lag",
                description="Records between a consumer group's committed offset and the partition's high watermark.",
                tag_keys=("group", "topic", "partition"),
            )
        ends = await self._log_ends(sorted({TopicPartition(t, p) for (_, t, p) in committed}))
        for (group_id, topic, partition), om in committed.items():
            end = ends.get(TopicPartition(topic, partition))
            if end is not None:
                self._lag_gauge.set(max(0, end - om.offset), tags={"group": group_id, "topic": topic, "partition": str(partition)})

    async def _log_ends(self, partitions: list[TopicPartition]) -> dict:
        async def one(tp):
            try:
                _, high_watermark, _ = await asyncio.wait_for(self._host.leader_handle(*tp).offsets.remote(), OFFSETS_CALL_TIMEOUT_S)
                return tp, high_watermark
            except Exception:  # noqa: BLE001 (no such partition, or a leader moving: no figure this time)
                return tp, None

        return dict(await asyncio.gather(*(one(tp) for tp in partitions)))

    # --- membership RPCs ------------------------------------------------------------------------------

    async def join(self, group_id: str, options: dict, wait_ms: int = 0):
        """JoinGroup; ``options`` are the coordinator's join arguments.

        Returns a JoinResult, or JoinPending (call again) if the generation did
        not form within ``wait_ms``: the call is held open until the group
        changes (the last member's join forms the generation and wakes the
        others) rather than have the member poll it. It waits at most half the
        member's session timeout: a held join shows the member alive only when
        it arrives.
        """
        self.start()
        self.offsets.prepare()  # the group will commit: have __consumer_offsets ready by then
        loop = asyncio.get_running_loop()
        session_ms = options.get("session_timeout_ms", DEFAULT_SESSION_TIMEOUT_MS)
        deadline = loop.time() + long_poll_wait_ms(wait_ms, session_ms, LONG_POLL_MAX_MS) / 1000
        options = dict(options)
        keep_alive = True
        while True:
            result = self.coordinator.join(group_id, now_ms=monotonic_ms(), keep_alive=keep_alive, **options)
            # Again now that the member is in: a first join (KIP-394) only hands out a member id, and a
            # timer that ticked while this call waited for the second found the group without members
            # and ended.
            self.start()
            event = await self._settle(group_id, waiting=not isinstance(result, JoinResult))
            remaining_ms = (deadline - loop.time()) * 1000
            if isinstance(result, JoinResult) or remaining_ms <= 0:
                return result
            if options.get("member_id") != result.member_id:
                options["member_id"] = result.member_id  # a first join got its member id: join with it now
                continue
            keep_alive = False  # re-runs of this held call are not new signs of life
            if not self._may_long_poll():
                return result
            await self._wait_change("join", group_id, result.member_id, event, min(remaining_ms, JOIN_RECHECK_MS))

    async def sync(self, group_id: str, member_id: str, generation: int, assignments: dict | None = None, wait_ms: int = 0,
                   group_instance_id: str | None = None, protocol_type: str | None = None, protocol_name: str | None = None):
        """SyncGroup (Kafka's classic protocol): the member's assignment of ``generation``; the leader's
        call brings every member's (see ``GroupCoordinator.sync``).

        A follower's call is held until the leader's has come (or the group
        changes otherwise), at most ``wait_ms`` and half the member's session
        timeout; then it returns SyncPending (call again).
        """
        self.start()
        loop = asyncio.get_running_loop()
        session_ms = self.coordinator.session_timeout_ms(group_id, member_id) or DEFAULT_SESSION_TIMEOUT_MS
        deadline = loop.time() + long_poll_wait_ms(wait_ms, session_ms, LONG_POLL_MAX_MS) / 1000
        keep_alive = True
        while True:
            try:
                result = self.coordinator.sync(
                    group_id, member_id, generation, assignments=assignments if keep_alive else None, group_instance_id=group_instance_id,
                    protocol_type=protocol_type, protocol_name=protocol_name, now_ms=monotonic_ms(), keep_alive=keep_alive,
                )
            finally:
                event = await self._settle(group_id, waiting=True)
            remaining_ms = (deadline - loop.time()) * 1000
            if not isinstance(result, SyncPending) or remaining_ms <= 0 or not self._may_long_poll():
                return result
            keep_alive = False  # re-runs of this held call are not new signs of life
            await self._wait_change("sync", group_id, member_id, event, min(remaining_ms, JOIN_RECHECK_MS))

    async def consumer_heartbeat(self, group_id: str, member_id: str, member_epoch: int, *, group_instance_id: str | None = None,
                                 rebalance_timeout_ms: int = -1, topics: list | None = None, pattern: str | None = None,
                                 assignor: str | None = None, owned: list | None = None, client_id: str = "kafka") -> dict:
        """KIP-848's ConsumerGroupHeartbeat, for members that ask for ``group.protocol=consumer``.

        Such a member is assigned by the coordinator (as logbus's own
        consumers are), always with cooperative-sticky: a KIP-848 member keeps
        its partitions while the group rebalances, and one that moves is
        withheld until its owner's heartbeat no longer lists it (the
        assignors of KIP-848 are incremental). Every heartbeat is a join (its
        subscription and owned partitions; None: unchanged since the last),
        so the group forms a generation once each member has heartbeated
        since the rebalance began, and the member's epoch is the generation
        it holds. Epoch 0 joins (with the client's own ``member_id``, as
        version 1 has it; "" gets one made), -1 leaves, -2 (a static member
        going away for a while) changes nothing. Returns {member_id,
        member_epoch, assignment (partitions, or None while a rebalance is
        under way), rebalancing}.

        Raises UnknownMemberIdError (join again with epoch 0),
        FencedMemberEpochError (an epoch ahead of the group's),
        UnsupportedAssignorError, InconsistentGroupProtocolError (the group's
        members have no cooperative-sticky: a classic group).
        """
        self.start()
        validate_group_id(group_id)
        if member_epoch == 0:
            self.offsets.prepare()  # a member joining will commit: have __consumer_offsets ready by then
        if assignor not in (None, "", "uniform", "cooperative-sticky"):
            raise UnsupportedAssignorError(f"server assignor {assignor!r}; the coordinator has 'uniform' (cooperative-sticky)")
        if member_epoch == -1:
            try:
                left = self.coordinator.leave(group_id, member_id, now_ms=monotonic_ms())
            finally:
                await self._settle(group_id)
            if not left:
                raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r}")
            return {"member_id": member_id, "member_epoch": -1, "assignment": None, "rebalancing": False}
        view = self.coordinator.member_view(group_id, member_id) if member_id else None
        if member_epoch == -2:
            if view is None:
                raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r}")
            return {"member_id": member_id, "member_epoch": -2, "assignment": None, "rebalancing": False}
        if member_epoch != 0 and view is None:
            raise UnknownMemberIdError(f"group {group_id!r} has no member {member_id!r}")
        if view is not None and member_epoch > view[4]:
            raise FencedMemberEpochError(f"member {member_id!r} has epoch {member_epoch}; the group's is {view[4]}")
        if member_epoch == 0 and view is not None:
            owned = []  # joining again (after an error): it holds nothing
        previous_topics, previous_pattern, previous_owned = (view[0], view[1], view[2]) if view is not None else ((), None, ())
        timeout_ms = rebalance_timeout_ms if rebalance_timeout_ms > 0 else DEFAULT_REBALANCE_TIMEOUT_MS
        options = {
            "group_instance_id": group_instance_id,
            "client_id": client_id,
            "topics": tuple(topics) if topics is not None else previous_topics,
            "pattern": pattern if pattern is not None or topics is not None else previous_pattern,
            "owned": tuple(owned) if owned is not None else previous_owned,
            "protocols": ("cooperative-sticky",),
            "session_timeout_ms": CONSUMER_SESSION_TIMEOUT_MS,
            "rebalance_timeout_ms": min(timeout_ms, REBALANCE_TIMEOUT_MS_MAX),
            "max_poll_interval_ms": min(timeout_ms, REBALANCE_TIMEOUT_MS_MAX),
            "member_epochs": True,
        }
        if not options["topics"] and options["pattern"] is None:
            options["pattern"] = "(?!)"  # subscribed to nothing (yet): a pattern no topic matches
        try:
            if view is None:
                result = self.coordinator.join(group_id, member_id="", new_member_id=member_id or None, now_ms=monotonic_ms(), **options)
                if isinstance(result, JoinPending) and not member_id:
                    result = self.coordinator.join(group_id, member_id=result.member_id, now_ms=monotonic_ms(), **options)
            else:
                result = self.coordinator.join(group_id, member_id=member_id, now_ms=monotonic_ms(), **options)
        finally:
            await self._settle(group_id)
        if isinstance(result, JoinResult):
            return {"member_id": result.member_id, "member_epoch": result.generation, "assignment": list(result.assignment), "rebalancing": False}
        now = self.coordinator.member_view(group_id, result.member_id)
        epoch = max(1, now[3] if now is not None and now[3] > 0 else (now[4] if now is not None else 1))
        return {"member_id": result.member_id, "member_epoch": epoch, "assignment": None, "rebalancing": True}

    async def heartbeat(self, group_id: str, member_id: str, generation: int, poll_idle_ms: int, wait_ms: int = 0,
                        group_instance_id: str | None = None):
        """Heartbeat; with ``wait_ms``, a long poll: when there is nothing to do, the reply waits
        until the group changes (then says what to do) or the wait ends.

        The wait is at most ``wait_ms``, half the member's session timeout and
        :data:`LONG_POLL_MAX_MS`, and none while :data:`LONG_POLLS_MAX` calls
        wait already. The member counts as alive at the call's arrival only.
        The reply's ``waited_ms`` and ``woken`` tell the member whether it
        may send the next heartbeat at once (it waited) or should pace itself
        (it did not).
        """
        self.start()
        started = time.monotonic()
        try:
            result = self.coordinator.heartbeat(group_id, member_id, generation, poll_idle_ms=poll_idle_ms, now_ms=monotonic_ms(),
                                                group_instance_id=group_instance_id)
        finally:
            event = await self._settle(group_id, waiting=True)
        if result.rejoin or result.revoke or not self._may_long_poll():
            return result
        session_ms = self.coordinator.session_timeout_ms(group_id, member_id) or 0
        wait_s = long_poll_wait_ms(wait_ms, session_ms, LONG_POLL_MAX_MS) / 1000 - (time.monotonic() - started)
        woken = await self._wait_change("heartbeat", group_id, member_id, event, wait_s * 1000)
        waited_ms = int((time.monotonic() - started) * 1000)
        if woken:
            try:
                result = self.coordinator.heartbeat(
                    group_id, member_id, generation, poll_idle_ms=poll_idle_ms + waited_ms, now_ms=monotonic_ms(), keep_alive=False
                )
            finally:
                await self._settle(group_id)
        return dataclasses.replace(result, waited_ms=waited_ms, woken=woken)

    async def leave(self, group_id: str, member_id: str, group_instance_id: str | None = None) -> bool:
        self.start()
        left = self.coordinator.leave(group_id, member_id, now_ms=monotonic_ms(), group_instance_id=group_instance_id)
        await self._settle(group_id)
        return left

    # --- offsets RPCs ---------------------------------------------------------------------------------

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict,
                             group_instance_id: str | None = None, retention_ms: int | None = None) -> None:
        """OffsetCommit: validated by the coordinator, durable in ``__consumer_offsets`` before it returns.

        The records carry the commit's wall-clock time and, with ``retention_ms``
        (Kafka's OffsetCommit v2-v4 retention time), the time they expire.
        """
        async with self._in_commit_order(group_id):
            await self._commit_offsets(group_id, member_id, generation, offsets, group_instance_id, retention_ms)

    @contextlib.asynccontextmanager
    async def _in_commit_order(self, group_id: str):
        """One commit (plain or transactional) of ``group_id`` at a time, in arrival order.

        asyncio's lock is first come, first served. Between its check and its write a commit
        awaits, and a commit whose client gave up on it still runs, so two commits of one member
        could otherwise end in the other order and the committed offset go back. Kafka applies a
        connection's requests in order. A group's entry goes with its last commit: nothing is kept
        per idle group.
        """
        entry = self._commit_order.setdefault(group_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._commit_order[group_id]

    async def _commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict,
                              group_instance_id: str | None, retention_ms: int | None) -> None:
        await self.offsets.ready()
        checked = self._checked_offsets(offsets)
        if not checked:
            return
        commit_ms = wall_ms()
        expire_ms = None if retention_ms is None or retention_ms < 0 else commit_ms + retention_ms
        try:
            records = self.coordinator.commit_offsets(group_id, member_id, generation, checked, now_ms=monotonic_ms(),
                                                      commit_timestamp_ms=commit_ms, expire_timestamp_ms=expire_ms,
                                                      group_instance_id=group_instance_id)
        finally:
            await self._settle(group_id)  # the call may have expired members (or created the group)
        await self.offsets.commit(group_id, records, checked)
        self.start()  # lag to export (after the commit: a timer started before it may have found nothing)

    async def txn_offset_commit(
        self, group_id: str, member_id: str, generation: int, offsets: dict, producer_id: int, producer_epoch: int
    ) -> None:
        """TxnOffsetCommit (KIP-447): checked against the group's generation and member like a commit,
        written to ``__consumer_offsets`` as a transactional batch of the producer, and pending until
        the transaction's marker there (see committed_offsets.py). The transaction service checks the
        producer before it calls this. Ordered with the group's other commits (``_in_commit_order``)."""
        async with self._in_commit_order(group_id):
            await self._txn_offset_commit(group_id, member_id, generation, offsets, producer_id, producer_epoch)

    async def _txn_offset_commit(
        self, group_id: str, member_id: str, generation: int, offsets: dict, producer_id: int, producer_epoch: int
    ) -> None:
        await self.offsets.ready()
        checked = self._checked_offsets(offsets)
        if not checked:
            return
        try:
            records = self.coordinator.commit_offsets(group_id, member_id, generation, checked, now_ms=monotonic_ms(),
                                                      commit_timestamp_ms=wall_ms())
        finally:
            await self._settle(group_id)
        await self.offsets.commit_transactional(producer_id, producer_epoch, group_id, records, checked)

    def transaction_completed(self, producer_id: int, commit: bool) -> None:
        """The transaction coordinator wrote ``producer_id``'s marker on ``__consumer_offsets``."""
        self.offsets.transaction_completed(producer_id, commit)
        if commit:
            self.start()

    def _checked_offsets(self, offsets: dict) -> dict:
        """{TopicPartition: OffsetAndMetadata} from a commit's argument; caller errors raised."""
        counts = self._host.partition_counts()
        checked = {}
        if not isinstance(offsets, dict):
            raise InvalidConfigError(f"offsets must be a dict of {{TopicPartition: offset}}, not {type(offsets).__name__}")
        for tp, om in offsets.items():
            if not isinstance(tp, tuple) or len(tp) != 2:
                raise InvalidConfigError(f"expected a TopicPartition(topic, partition), not {tp!r}")
            tp = TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))
            if tp.topic not in counts:
                raise UnknownTopicError(f"cannot commit an offset for {tp}: topic {tp.topic!r} does not exist")
            if tp.partition >= counts[tp.topic]:
                raise InvalidPartitionError(f"cannot commit an offset for {tp}: the topic has partitions 0..{counts[tp.topic] - 1}")
            if not isinstance(om, OffsetAndMetadata):
                if isinstance(om, bool) or not isinstance(om, int) or om < 0:
                    raise InvalidConfigError(f"the offset to commit for {tp} must be an int >= 0 or an OffsetAndMetadata, not {om!r}")
                om = OffsetAndMetadata(om)
            checked[tp] = om
        return checked

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        """OffsetFetch: {TopicPartition: OffsetAndMetadata or None}."""
        validate_group_id(group_id)
        await self.offsets.ready()
        return {TopicPartition(*tp): self.offsets.get(group_id, TopicPartition(*tp)) for tp in partitions}

    # --- administration --------------------------------------------------------------------------------

    async def list_groups(self, with_protocol_type: bool = False) -> list[tuple]:
        """(group id, state, protocol) of every group with members or committed offsets; with
        ``with_protocol_type``, its protocol type fourth ("" for a group of committed offsets only)."""
        await self.offsets.ready()
        known = {}
        for g in self.coordinator.list_groups():
            entry = (g.group_id, g.state.value, g.protocol)
            if with_protocol_type:
                entry += (self.coordinator.describe(g.group_id).protocol_type or "",)
            known[g.group_id] = entry
        for group_id in self.offsets.group_ids():
            known.setdefault(group_id, (group_id, GroupState.EMPTY.value, None) + (("",) if with_protocol_type else ()))
        return sorted(known.values())

    async def describe_group(self, group_id: str, protocol_details: bool = False) -> dict:
        """Members and assignment, and per partition the committed offset, log end offset and lag.

        With ``protocol_details`` (for the Kafka gateway's DescribeGroups), also the group's
        protocol type and leader, and each member's kind (``kafka``), its metadata for the
        group's protocol and the assignment bytes its leader gave it.
        """
        validate_group_id(group_id)
        await self.offsets.ready()
        description = self.coordinator.describe(group_id)
        owners = {tp: m.member_id for m in description.members for tp in m.assignment}
        partitions = set(owners) | self.offsets.partitions_of(group_id)
        if description.state is GroupState.DEAD and not partitions:
            raise InvalidGroupIdError(f"group {group_id!r} does not exist (no members and no committed offsets)")
        ends = await self._log_ends(sorted(partitions))
        rows = []
        for tp in sorted(partitions):
            committed = self.offsets.get(group_id, tp)
            end = ends.get(tp)
            current = committed.offset if committed is not None else None
            lag = None if current is None or end is None else max(0, end - current)
            rows.append({"topic": tp.topic, "partition": tp.partition, "current_offset": current, "log_end_offset": end, "lag": lag, "consumer_id": owners.get(tp)})
        described = {
            "group_id": group_id,
            "state": description.state.value if description.state is not GroupState.DEAD else GroupState.EMPTY.value,
            "protocol": description.protocol,
            "generation": description.generation,
            "members": [
                {"member_id": m.member_id, "group_instance_id": m.group_instance_id, "client_id": m.client_id, "assignment": list(m.assignment)}
                for m in description.members
            ],
            "offsets": rows,
        }
        if protocol_details:
            described["protocol_type"] = description.protocol_type
            described["leader"] = description.leader
            for row, m in zip(described["members"], description.members):
                row.update(kafka=m.kafka, topics=list(m.topics), metadata=m.metadata, assignment_bytes=m.assignment_bytes)
        return described

    async def delete_offsets(self, group_id: str, partitions: list) -> dict:
        """Kafka's OffsetDelete: delete the group's committed offsets of ``partitions`` (tombstones in
        ``__consumer_offsets``). Returns {TopicPartition: None, or the error for that partition}: a
        partition of a topic the group's members subscribe to keeps its offset
        (GroupSubscribedToTopicError). Raises InvalidGroupIdError for a group that does not exist,
        GroupNotEmptyError never (Kafka deletes offsets of topics no member subscribes to)."""
        validate_group_id(group_id)
        await self.offsets.ready()
        description = self.coordinator.describe(group_id)
        if description.state is GroupState.DEAD and not self.offsets.partitions_of(group_id):
            raise InvalidGroupIdError(f"group {group_id!r} does not exist (no members and no committed offsets)")
        subscribed = {t for m in description.members for t in m.topics} | {tp.topic for m in description.members for tp in m.assignment}
        results: dict = {}
        deleted = []
        for tp in partitions:
            tp = TopicPartition(*tp)
            if tp.topic in subscribed:
                results[tp] = GroupSubscribedToTopicError(f"group {group_id!r} subscribes to topic {tp.topic!r}")
            else:
                results[tp] = None
                deleted.append(tp)
        await self.offsets.delete_partitions(group_id, deleted)
        return results

    async def delete_group(self, group_id: str) -> list[TopicPartition]:
        """Delete an inactive group: its state here and its committed offsets (tombstones in
        ``__consumer_offsets``). Returns the partitions whose offsets went.

        Raises GroupNotEmptyError while the group has members, InvalidGroupIdError
        if there is no such group (no state and no committed offsets).
        """
        validate_group_id(group_id)
        await self.offsets.ready()
        description = self.coordinator.describe(group_id)
        if description.members:
            raise GroupNotEmptyError(
                f"group {group_id!r} has {len(description.members)} active member(s); stop them before deleting the group"
            )
        if description.state is GroupState.DEAD and not self.offsets.partitions_of(group_id):
            raise InvalidGroupIdError(f"group {group_id!r} does not exist (no members and no committed offsets)")
        try:
            self.coordinator.delete_group(group_id)  # raises GroupNotEmptyError if a member joined meanwhile
        finally:
            await self._settle(group_id)
        return await self.offsets.delete_group(group_id)

    async def reset_offsets(self, group_id: str, to, topics: list[str] | None = None) -> dict:
        """Set an inactive group's committed offsets: to "earliest", "latest", an offset, or {"timestamp": ms}.

        Applies to ``topics`` (every partition) or, by default, to every
        partition the group has committed. Raises GroupNotEmptyError while the
        group has members.
        """
        validate_group_id(group_id)
        if not (to in ("earliest", "latest") or (isinstance(to, int) and not isinstance(to, bool) and to >= 0)
                or (isinstance(to, dict) and isinstance(to.get("timestamp"), int) and not isinstance(to.get("timestamp"), bool))):
            raise InvalidConfigError(f"reset to must be 'earliest', 'latest', an offset >= 0 or {{'timestamp': ms}}, not {to!r}")
        await self.offsets.ready()
        if self.coordinator.describe(group_id).members:
            raise GroupNotEmptyError(f"group {group_id!r} has active members; stop them before resetting its offsets")
        if topics:
            counts = self._host.partition_counts()
            for t in topics:
                if t not in counts:
                    raise UnknownTopicError(f"topic {t!r} does not exist")
            partitions = [TopicPartition(t, p) for t in topics for p in range(counts[t])]
        else:
            partitions = sorted(self.offsets.partitions_of(group_id))
        if not partitions:
            raise UnknownTopicError(f"group {group_id!r} has no committed offsets; name the topics to reset")
        targets = {}
        for tp in partitions:
            handle = self._host.leader_handle(*tp)
            start, high_watermark, _ = await asyncio.wait_for(handle.offsets.remote(), OFFSETS_CALL_TIMEOUT_S)
            if to == "earliest":
                targets[tp] = start
            elif to == "latest":
                targets[tp] = high_watermark
            elif isinstance(to, dict) and "timestamp" in to:
                found = await asyncio.wait_for(handle.offset_for_timestamp.remote(int(to["timestamp"])), OFFSETS_CALL_TIMEOUT_S)
                targets[tp] = high_watermark if found < 0 else found
            elif isinstance(to, int) and not isinstance(to, bool):
                targets[tp] = min(max(to, start), high_watermark)
            else:
                raise InvalidConfigError(f"reset to must be 'earliest', 'latest', an offset or {{'timestamp': ms}}, not {to!r}")
        offsets = {tp: OffsetAndMetadata(o) for tp, o in targets.items()}
        try:
            records = self.coordinator.commit_offsets(group_id, "", -1, offsets, now_ms=monotonic_ms())
        finally:
            await self._settle(group_id)
        await self.offsets.commit(group_id, records, offsets)
        self.start()
        return dict(targets)

