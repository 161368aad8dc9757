"""Consumer group coordination inside the controller: the RPCs consumers call, and durable offsets.

The controller mixes :class:`GroupService` in. It forwards every group RPC to
its :class:`~logbus.protocol.group_coordinator.GroupCoordinator` (pure state)
with the controller's clock, persists the coordinator's state to
``{data_dir}/controller/groups.json`` whenever it changes, and keeps
committed offsets in the internal, replicated topic ``__consumer_offsets``:
a commit is acknowledged only after its records were appended there with
acks="all". On start the controller reads that topic back to rebuild its
in-memory table of committed offsets, so commits survive the controller's
restart and the loss of any single node (with three or more nodes the topic
has three replicas).

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
most 1000 calls at a time, and replicas' lease heartbeats must never queue
behind consumers' long polls. Beyond it, heartbeats answer at once and the
member paces itself by its heartbeat interval.

Durability. ``groups.json`` is written only when what it holds changes (a
repeated join or a heartbeat does not move the coordinator's
``state_version``), by one writer task off the event loop
(``asyncio.to_thread``), so the writes stay in order and each writes the
latest state; states queued while a write runs are folded into the next
one. A group RPC answers only once the state it saw is on disk, so no
member acts on a state that a controller restart would roll back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import numpy as np

from logbus.errors import (
    CoordinatorNotAvailableError,
    GroupNotEmptyError,
    InvalidConfigError,
    LeaderNotAvailableError,
    LogbusError,
    OffsetOutOfRangeError,
    UnknownTopicError,
)
from logbus.protocol.group_coordinator import (
    DEFAULT_SESSION_TIMEOUT_MS,
    GroupCoordinator,
    GroupState,
    JoinResult,
    OffsetAndMetadata,
    decode_offset_commit_key,
    decode_offset_commit_value,
    long_poll_wait_ms,
    validate_group_id,
)
from logbus.protocol.messages import TopicPartition
from logbus.storage import record_batch as rb

OFFSETS_TOPIC = "__consumer_offsets"
OFFSETS_TOPIC_PARTITIONS = 1
OFFSETS_TOPIC_REPLICATION_MAX = 3
OFFSETS_TOPIC_CONFIG = {"segment.bytes": 64 << 20, "min.insync.replicas": 1}
GROUPS_FILE = "groups.json"
OFFSETS_LOAD_TIMEOUT_S = 60.0
LAG_EXPORT_INTERVAL_S = 5.0
COMMIT_RETRY_S = 10.0  # a commit retries a moving or not-yet-leased offsets leader this long
LONG_POLL_MAX_MS = 30_000  # bound on how long a heartbeat or join call may wait for the group to change
LONG_POLLS_MAX = 500  # calls waiting at once; the controller's max_concurrency is 1000
JOIN_RECHECK_MS = 1_000  # a held join re-runs the join this often even without a change (a safety net)
GROUP_TICK_S = 0.1  # sessions and rebalance timeouts are checked this often
GROUPS_WRITE_RETRY_S = 1.0  # after a failed write of groups.json, the timer tries again this often


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text``, durably: write a temporary file, fsync it, rename, fsync the directory."""
    temporary = path + ".tmp"
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class GroupService:
    """Group RPCs for the controller (a mixin: it uses the controller's metadata, lock and replicas)."""

    def _init_groups(self) -> None:
        self._groups_path = os.path.join(self._metadata_dir, GROUPS_FILE)
        counts = self._partition_counts()
        try:
            with open(self._groups_path) as file:
                self.groups = GroupCoordinator.from_json(file.read(), now_ms=monotonic_ms(), topic_partition_counts=counts)
        except (FileNotFoundError, ValueError):
            self.groups = GroupCoordinator(topic_partition_counts=counts)
        # groups.json: the latest state queued (sequence number, text) and the last one on disk.
        self._groups_version_queued = self.groups.state_version
        self._groups_text_queued: str | None = None
        self._groups_seq = 0
        self._groups_written_seq = 0
        self._groups_writer: asyncio.Task | None = None
        self._groups_write_error: OSError | None = None
        self._groups_write_failed_s = 0.0
        self._groups_flushed = asyncio.Event()  # set (and replaced) after every write attempt
        # Long polls.
        self._group_events: dict[str, asyncio.Event] = {}
        self._group_prints: dict[str, tuple] = {}
        self._long_polls: dict[int, tuple[str, str, str, float, float]] = {}  # id -> (kind, group, member, start, wait)
        self._long_poll_ids = 0
        self._group_timer: asyncio.Task | None = None
        self._committed: dict[tuple[str, str, int], OffsetAndMetadata] = {}
        self._offsets_loaded: asyncio.Event | None = None
        self._lag_gauge = None
        self._lag_exported_s = 0.0

    def _partition_counts(self) -> dict[str, int]:
        return {name: len(topic.partitions) for name, topic in self.metadata.topics.items()}

    # --- groups.json ---------------------------------------------------------------------------------

    def _save_groups(self) -> None:
        """Queue a write of the groups if their durable state changed; returns at once.

        ``await self._groups_durable()`` waits until it is on disk.
        """
        if self.groups.state_version == self._groups_version_queued:
            return
        self._groups_version_queued = self.groups.state_version
        text = self.groups.to_json()
        if text == self._groups_text_queued:
            return
        self._groups_text_queued = text
        self._groups_seq += 1
        self._start_groups_writer()

    def _start_groups_writer(self) -> None:
        if self._groups_written_seq >= self._groups_seq:
            return
        if self._groups_writer is not None and not self._groups_writer.done():
            return  # the running writer picks the latest state up when its write ends
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (no writer can be running): write here
            _write_atomically(self._groups_path, self._groups_text_queued)
            self._groups_written_seq = self._groups_seq
            return
        self._groups_writer = loop.create_task(self._write_groups())

    async def _write_groups(self) -> None:
        """The one writer: writes the latest queued state until none is left (or a write fails)."""
        while self._groups_written_seq < self._groups_seq:
            seq, text = self._groups_seq, self._groups_text_queued
            try:
                await asyncio.to_thread(_write_atomically, self._groups_path, text)
            except OSError as error:
                if self._groups_write_error is None:
                    print(f"logbus controller: cannot write {self._groups_path}: {error!r} (retrying)")
                self._groups_write_error = error
                self._groups_write_failed_s = time.monotonic()
                self._wake_groups_flushed()
                return
            self._groups_write_error = None
            self._groups_written_seq = seq
            self._wake_groups_flushed()

    def _wake_groups_flushed(self) -> None:
        flushed, self._groups_flushed = self._groups_flushed, asyncio.Event()
        flushed.set()

    async def _groups_durable(self) -> None:
        """Wait until every state queued so far is on disk; raise (retriable) if it cannot be written."""
        target = self._groups_seq
        while self._groups_written_seq < target:
            writing = self._groups_writer is not None and not self._groups_writer.done()
            if not writing and self._groups_write_error is not None:
                error, self._groups_write_error = self._groups_write_error, None
                self._start_groups_writer()  # let the next caller (or the timer) try again
                raise CoordinatorNotAvailableError(f"the group coordinator cannot save its state: {error}")
            self._start_groups_writer()
            await self._groups_flushed.wait()

    async def _settle_group(self, group_id: str) -> asyncio.Event:
        """After a call changed (or may have changed) ``group_id``: wake its waiters, save, and wait
        until the state is durable. Returns the event of the next change, taken before any wait."""
        self._groups_changed(group_id)
        event = self._group_event(group_id)
        self._save_groups()
        await self._groups_durable()
        return event

    # --- long polls: members wait on their group instead of polling it --------------------------------

    def _group_event(self, group_id: str) -> asyncio.Event:
        event = self._group_events.get(group_id)
        if event is None:
            event = self._group_events[group_id] = asyncio.Event()
            self._group_prints[group_id] = self.groups.fingerprint(group_id)
        return event

    def _groups_ready(self) -> None:
        """Start the group timer (a restarted controller starts it with the first group call; the
        control loop ticks the groups too)."""
        if self._group_timer is None or self._group_timer.done():
            self._group_timer = asyncio.get_running_loop().create_task(self._run_group_timer())

    async def _run_group_timer(self) -> None:
        while True:
            await asyncio.sleep(GROUP_TICK_S)
            try:
                self._tick_groups()
            except Exception as error:  # noqa: BLE001 (the timer must survive; the next tick retries)
                print(f"logbus controller: group timer error: {error!r}")

    def _groups_changed(self, group_id: str | None = None) -> None:
        """Wake the members waiting on a group whose state, generation or members changed."""
        for gid in [group_id] if group_id is not None else list(self._group_events):
            fingerprint = self.groups.fingerprint(gid)
            if self._group_prints.get(gid) == fingerprint:
                continue
            self._group_prints[gid] = fingerprint
            event = self._group_events.pop(gid, None)
            if event is not None:
                event.set()

    def _may_long_poll(self) -> bool:
        return len(self._long_polls) < LONG_POLLS_MAX

    async def _wait_group_change(self, kind: str, group_id: str, member_id: str, event: asyncio.Event, timeout_ms: float) -> bool:
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

    async def group_long_polls(self, group_id: str) -> list[dict]:
        """The calls of ``group_id`` the coordinator holds open now (for tests and debugging):
        kind ("heartbeat" or "join"), member_id, waited_ms and wait_ms."""
        now = time.monotonic()
        return [
            {"kind": kind, "member_id": member, "waited_ms": int((now - start) * 1000), "wait_ms": int(wait * 1000)}
            for kind, group, member, start, wait in list(self._long_polls.values())
            if group == group_id
        ]

    def _topics_changed(self) -> None:
        """Called after topics are created, deleted or grow: groups subscribed to them rebalance."""
        self.groups.metadata_changed(self._partition_counts(), now_ms=monotonic_ms())
        self._groups_changed()
        self._save_groups()

    def _tick_groups(self) -> None:
        for removed in self.groups.tick(monotonic_ms()):
            print(f"logbus controller: group {removed.group_id}: member {removed.member_id} removed ({removed.reason})")
        self._groups_changed()  # expired sessions start rebalances: wake the survivors at once
        self._save_groups()
        if self._groups_write_error is not None and time.monotonic() - self._groups_write_failed_s > GROUPS_WRITE_RETRY_S:
            self._groups_write_failed_s = time.monotonic()
            self._start_groups_writer()

    async def _export_lag(self) -> None:
        """Publish each group's lag per partition as the Ray metric ``logbus_consumer_group_lag``.

        Ray serves it with its other metrics on each node's Prometheus endpoint
        (the node's ``MetricsExportPort``).
        """
        if time.monotonic() - self._lag_exported_s < LAG_EXPORT_INTERVAL_S or not self._committed:
            return
        self._lag_exported_s = time.monotonic()
        if self._lag_gauge is None:
            from ray.util.metrics import Gauge

            self._lag_gauge = Gauge(
                "logbus_consumer_group_lag",
                description="Records between a consumer group's committed offset and the partition's high watermark.",
                tag_keys=("group", "topic", "partition"),
            )
        committed = dict(self._committed)
        ends = await self._log_ends(sorted({TopicPartition(t, p) for (_, t, p) in committed}))
        for (group_id, topic, partition), om in committed.items():
            end = ends.get(TopicPartition(topic, partition))
            if end is not None:
                self._lag_gauge.set(max(0, end - om.offset), tags={"group": group_id, "topic": topic, "partition": str(partition)})

    # --- the offsets topic -------------------------------------------------------------------------

    async def _ensure_offsets_topic(self) -> None:
        if OFFSETS_TOPIC in self.metadata.topics:
            return
        from logbus.actors.controller import live_node_ids

        replication = min(OFFSETS_TOPIC_REPLICATION_MAX, max(1, len(live_node_ids())))
        try:
            await self._create_topic(OFFSETS_TOPIC, OFFSETS_TOPIC_PARTITIONS, replication, OFFSETS_TOPIC_CONFIG, internal=True)
        except LogbusError as error:
            if OFFSETS_TOPIC not in self.metadata.topics:
                raise
            del error  # created concurrently: fine

    async def _offsets_ready(self) -> None:
        """Make sure the committed-offset table was rebuilt from ``__consumer_offsets`` once."""
        if self._offsets_loaded is None:
            self._offsets_loaded = asyncio.Event()
            try:
                await self._load_offsets()
            finally:
                self._offsets_loaded.set()
        await self._offsets_loaded.wait()

    async def _offsets_leader(self):
        topic = self.metadata.topic(OFFSETS_TOPIC)
        state = topic.partitions[0]
        if state.leader is None:
            raise LeaderNotAvailableError(f"{OFFSETS_TOPIC} has no leader right now")
        return self._replica_handle(topic, 0, state.leader)

    async def _load_offsets(self) -> None:
        if OFFSETS_TOPIC not in self.metadata.topics:
            return
        deadline = time.monotonic() + OFFSETS_LOAD_TIMEOUT_S
        while True:
            try:
                leader = await self._offsets_leader()
                _, high_watermark, _ = await asyncio.wait_for(leader.offsets.remote(), 10)
                offset, table = 0, {}
                while offset < high_watermark:
                    meta, ref = await asyncio.wait_for(leader.fetch.remote(offset, 16 << 20, 0), 30)
                    if ref is None:
                        break
                    data = await ref
                    for header, records in rb.decode_batches(data):
                        keys = records.column("key").to_pylist()
                        values = records.column("value").to_pylist()
                        for key, value in zip(keys, values):
                            group_id, tp = decode_offset_commit_key(key)
                            if value is None:
                                table.pop((group_id, tp.topic, tp.partition), None)
                            else:
                                decoded = decode_offset_commit_value(value)
                                table[(group_id, tp.topic, tp.partition)] = OffsetAndMetadata(
                                    decoded.offset, decoded.metadata, decoded.leader_epoch
                                )
                    offset = meta.next_offset
                self._committed = table
                return
            except (LogbusError, asyncio.TimeoutError, OffsetOutOfRangeError) as error:
                if time.monotonic() > deadline:
                    print(f"logbus controller: could not read {OFFSETS_TOPIC}: {error!r}")
                    raise LeaderNotAvailableError(f"committed offsets are not readable yet: {error}") from None
                await asyncio.sleep(0.2)
            except Exception as error:  # noqa: BLE001 (Ray errors while the leader restarts)
                if time.monotonic() > deadline:
                    raise LeaderNotAvailableError(f"committed offsets are not readable yet: {error!r}") from None
                await asyncio.sleep(0.2)

    async def _append_commits(self, records: list[tuple[bytes, bytes]]) -> None:
        """Append offset-commit records with acks='all'; raise (retriable) if that fails."""
        await self._ensure_offsets_topic()
        keys = [k for k, _ in records]
        values = [v for _, v in records]
        batch = np.frombuffer(rb.encode_batch(values, keys), np.uint8)
        deadline = time.monotonic() + COMMIT_RETRY_S
        while True:
            # A fresh or moving offsets leader refuses writes until its lease is confirmed: retry briefly.
            try:
                leader = await self._offsets_leader()
                await asyncio.wait_for(leader.produce.remote(batch, "all"), 30)
                return
            except Exception as error:  # noqa: BLE001 (Ray errors mean the offsets leader is moving)
                from logbus.api.client import unwrap

                cause = unwrap(error)
                retriable = isinstance(cause, LogbusError) and cause.retriable
                if not retriable or time.monotonic() > deadline:
                    raise cause from None
                await asyncio.sleep(0.1)

    # --- membership RPCs ------------------------------------------------------------------------------

    async def group_join(self, group_id: str, options: dict, wait_ms: int = 0):
        """JoinGroup; ``options`` are the coordinator's join arguments.

        Returns a JoinResult, or JoinPending (call again) if the generation did
        not form within ``wait_ms``: the call is held open until the group
        changes (the last member's join forms the generation and wakes the
        others) rather than have the member poll it. It waits at most half the
        member's session timeout: a held join shows the member alive only when
        it arrives.
        """
        await self._ready()
        self._groups_ready()
        loop = asyncio.get_running_loop()
        session_ms = options.get("session_timeout_ms", DEFAULT_SESSION_TIMEOUT_MS)
        deadline = loop.time() + long_poll_wait_ms(wait_ms, session_ms, LONG_POLL_MAX_MS) / 1000
        options = dict(options)
        keep_alive = True
        while True:
            result = self.groups.join(group_id, now_ms=monotonic_ms(), keep_alive=keep_alive, **options)
            event = await self._settle_group(group_id)
            remaining_ms = (deadline - loop.time()) * 1000
            if isinstance(result, JoinResult) or remaining_ms <= 0:
                return result
            if options.get("member_id") != result.member_id:
                options["member_id"] = result.member_id  # a first join got its member id: join with it now
                continue
            keep_alive = False  # re-runs of this held call are not new signs of life
            if not self._may_long_poll():
                return result
            await self._wait_group_change("join", group_id, result.member_id, event, min(remaining_ms, JOIN_RECHECK_MS))

    async def group_sync(self, group_id: str, member_id: str, generation: int):
        await self._ready()
        self._groups_ready()
        try:
            return self.groups.sync(group_id, member_id, generation, now_ms=monotonic_ms())
        finally:
            await self._settle_group(group_id)

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, poll_idle_ms: int, wait_ms: int = 0):
        """Heartbeat; with ``wait_ms``, a long poll: when there is nothing to do, the reply waits
        until the group changes (then says what to do) or the wait ends.

        The wait is at most ``wait_ms``, half the member's session timeout and
        :data:`LONG_POLL_MAX_MS`, and none while :data:`LONG_POLLS_MAX` calls
        wait already. The member counts as alive at the call's arrival only.
        The reply's ``waited_ms`` and ``woken`` tell the member whether it
        may send the next heartbeat at once (it waited) or should pace itself
        (it did not).
        """
        await self._ready()
        self._groups_ready()
        started = time.monotonic()
        try:
            result = self.groups.heartbeat(group_id, member_id, generation, poll_idle_ms=poll_idle_ms, now_ms=monotonic_ms())
        finally:
            event = await self._settle_group(group_id)
        if result.rejoin or result.revoke or not self._may_long_poll():
            return result
        session_ms = self.groups.session_timeout_ms(group_id, member_id) or 0
        wait_s = long_poll_wait_ms(wait_ms, session_ms, LONG_POLL_MAX_MS) / 1000 - (time.monotonic() - started)
        woken = await self._wait_group_change("heartbeat", group_id, member_id, event, wait_s * 1000)
        waited_ms = int((time.monotonic() - started) * 1000)
        if woken:
            try:
                result = self.groups.heartbeat(
                    group_id, member_id, generation, poll_idle_ms=poll_idle_ms + waited_ms, now_ms=monotonic_ms(), keep_alive=False
                )
            finally:
                await self._settle_group(group_id)
        return dataclasses.replace(result, waited_ms=waited_ms, woken=woken)

    async def group_leave(self, group_id: str, member_id: str) -> bool:
        await self._ready()
        self._groups_ready()
        left = self.groups.leave(group_id, member_id, now_ms=monotonic_ms())
        await self._settle_group(group_id)
        return left

    # --- offsets RPCs ---------------------------------------------------------------------------------

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict) -> None:
        """OffsetCommit: validated by the coordinator, durable in ``__consumer_offsets`` before it returns."""
        await self._ready()
        await self._offsets_ready()
        checked = {}
        for tp, om in offsets.items():
            tp = TopicPartition(*tp)
            if tp.topic not in self.metadata.topics or tp.partition >= len(self.metadata.topics[tp.topic].partitions):
                raise UnknownTopicError(f"cannot commit an offset for {tp}: no such partition")
            checked[tp] = om if isinstance(om, OffsetAndMetadata) else OffsetAndMetadata(int(om))
        if not checked:
            return
        try:
            records = self.groups.commit_offsets(group_id, member_id, generation, checked, now_ms=monotonic_ms())
        finally:
            await self._settle_group(group_id)  # the call may have expired members (or created the group)
        await self._append_commits(records)
        for tp, om in checked.items():
            self._committed[(group_id, tp.topic, tp.partition)] = om

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        """OffsetFetch: {TopicPartition: OffsetAndMetadata or None}."""
        await self._ready()
        validate_group_id(group_id)
        await self._offsets_ready()
        return {TopicPartition(*tp): self._committed.get((group_id, tp[0], tp[1])) for tp in partitions}

    # --- administration --------------------------------------------------------------------------------

    async def list_groups(self) -> list[tuple[str, str, str | None]]:
        await self._ready()
        await self._offsets_ready()
        known = {g.group_id: (g.group_id, g.state.value, g.protocol) for g in self.groups.list_groups()}
        for group_id, _, _ in self._committed:
            known.setdefault(group_id, (group_id, GroupState.EMPTY.value, None))
        return sorted(known.values())

    async def describe_group(self, group_id: str) -> dict:
        """Members and assignment, and per partition the committed offset, log end offset and lag."""
        await self._ready()
        validate_group_id(group_id)
        await self._offsets_ready()
        description = self.groups.describe(group_id)
        owners = {tp: m.member_id for m in description.members for tp in m.assignment}
        partitions = set(owners) | {TopicPartition(t, p) for (g, t, p) in self._committed if g == group_id}
        if description.state is GroupState.DEAD and not partitions:
            from logbus.errors import InvalidGroupIdError

            raise InvalidGroupIdError(f"group {group_id!r} does not exist (no members and no committed offsets)")
        ends = await self._log_ends(sorted(partitions))
        rows = []
        for tp in sorted(partitions):
            committed = self._committed.get((group_id, tp.topic, tp.partition))
            end = ends.get(tp)
            current = committed.offset if committed is not None else None
            lag = None if current is None or end is None else max(0, end - current)
            rows.append({"topic": tp.topic, "partition": tp.partition, "current_offset": current, "log_end_offset": end, "lag": lag, "consumer_id": owners.get(tp)})
        return {
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

    async def _log_ends(self, partitions: list[TopicPartition]) -> dict:
        async def one(tp):
            topic = self.metadata.topics.get(tp.topic)
            if topic is None or tp.partition >= len(topic.partitions) or topic.partitions[tp.partition].leader is None:
                return tp, None
            handle = self._replica_handle(topic, tp.partition, topic.partitions[tp.partition].leader)
            try:
                _, high_watermark, _ = await asyncio.wait_for(handle.offsets.remote(), 10)
                return tp, high_watermark
            except Exception:  # noqa: BLE001 (a leader moving: no figure this time)
                return tp, None

        return dict(await asyncio.gather(*(one(tp) for tp in partitions)))

    async def reset_offsets(self, group_id: str, to, topics: list[str] | None = None) -> dict:
        """Set an inactive group's committed offsets: to "earliest", "latest", an offset, or {"timestamp": ms}.

        Applies to ``topics`` (every partition) or, by default, to every
        partition the group has committed. Raises GroupNotEmptyError while the
        group has members.
        """
        await self._ready()
        validate_group_id(group_id)
        await self._offsets_ready()
        if self.groups.describe(group_id).members:
            raise GroupNotEmptyError(f"group {group_id!r} has active members; stop them before resetting its offsets")
        if topics:
            partitions = [TopicPartition(t, p) for t in topics for p in range(len(self.metadata.topic(t).partitions))]
        else:
            partitions = sorted({TopicPartition(t, p) for (g, t, p) in self._committed if g == group_id})
        if not partitions:
            raise UnknownTopicError(f"group {group_id!r} has no committed offsets; name the topics to reset")
        targets = {}
        for tp in partitions:
            topic = self.metadata.topic(tp.topic)
            leader = topic.partitions[tp.partition].leader
            if leader is None:
                raise LeaderNotAvailableError(f"{tp} has no leader right now")
            handle = self._replica_handle(topic, tp.partition, leader)
            start, high_watermark, _ = await asyncio.wait_for(handle.offsets.remote(), 10)
            if to == "earliest":
                targets[tp] = start
            elif to == "latest":
                targets[tp] = high_watermark
            elif isinstance(to, dict) and "timestamp" in to:
                found = await asyncio.wait_for(handle.offset_for_timestamp.remote(int(to["timestamp"])), 10)
                targets[tp] = high_watermark if found < 0 else found
            elif isinstance(to, int) and not isinstance(to, bool):
                targets[tp] = min(max(to, start), high_watermark)
            else:
                raise InvalidConfigError(f"reset to must be 'earliest', 'latest', an offset or {{'timestamp': ms}}, not {to!r}")
        try:
            records = self.groups.commit_offsets(group_id, "", -1, {tp: OffsetAndMetadata(o) for tp, o in targets.items()}, now_ms=monotonic_ms())
        finally:
            await self._settle_group(group_id)
        await self._append_commits(records)
        for tp, offset in targets.items():
            self._committed[(group_id, tp.topic, tp.partition)] = OffsetAndMetadata(offset)
        return {tp: offset for tp, offset in targets.items()}
