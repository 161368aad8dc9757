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
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from logbus.errors import (
    GroupNotEmptyError,
    InvalidConfigError,
    LeaderNotAvailableError,
    LogbusError,
    OffsetOutOfRangeError,
    UnknownTopicError,
)
from logbus.protocol.group_coordinator import (
    GroupCoordinator,
    GroupState,
    JoinResult,
    OffsetAndMetadata,
    decode_offset_commit_key,
    decode_offset_commit_value,
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
LONG_POLL_MAX_MS = 5_000  # bound on how long a heartbeat or join call may wait for the group to change
JOIN_RECHECK_MS = 100  # a waiting join re-runs the join this often even without a change (delays, timeouts)


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


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
        self._groups_version_saved = self.groups.state_version
        self._groups_text_saved: str | None = None
        self._group_events: dict[str, asyncio.Event] = {}
        self._group_prints: dict[str, tuple] = {}
        self._committed: dict[tuple[str, str, int], OffsetAndMetadata] = {}
        self._offsets_loaded: asyncio.Event | None = None
        self._lag_gauge = None
        self._lag_exported_s = 0.0

    def _partition_counts(self) -> dict[str, int]:
        return {name: len(topic.partitions) for name, topic in self.metadata.topics.items()}

    def _save_groups(self) -> None:
        """Persist the groups if what would be written changed (a join poll that changed nothing
        durable moves ``state_version`` but must not cost a write and an fsync)."""
        if self.groups.state_version == self._groups_version_saved:
            return
        self._groups_version_saved = self.groups.state_version
        text = self.groups.to_json()
        if text == self._groups_text_saved:
            return
        temporary = self._groups_path + ".tmp"
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self._groups_path)
        self._groups_text_saved = text

    # --- long polls: members wait on their group instead of polling it --------------------------------

    def _group_event(self, group_id: str) -> asyncio.Event:
        event = self._group_events.get(group_id)
        if event is None:
            event = self._group_events[group_id] = asyncio.Event()
            self._group_prints[group_id] = self.groups.fingerprint(group_id)
        return event

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

    async def _wait_group_change(self, group_id: str, event: asyncio.Event, timeout_ms: float) -> bool:
        """Wait until ``event`` (taken before the state was read) fires or ``timeout_ms`` passes."""
        if timeout_ms <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout_ms / 1000)
            return True
        except asyncio.TimeoutError:
            return False

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
        not form within ``wait_ms``: the call waits for the group to change
        rather than have the member poll it.
        """
        await self._ready()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(0, int(wait_ms)), LONG_POLL_MAX_MS) / 1000
        options = dict(options)
        while True:
            result = self.groups.join(group_id, now_ms=monotonic_ms(), **options)
            self._groups_changed(group_id)  # wake the others first, then wait on a fresh event
            event = self._group_event(group_id)
            self._save_groups()
            remaining_ms = (deadline - loop.time()) * 1000
            if isinstance(result, JoinResult) or remaining_ms <= 0:
                return result
            options["member_id"] = result.member_id
            if result.retry_backoff_ms > 0:
                await self._wait_group_change(group_id, event, min(remaining_ms, JOIN_RECHECK_MS))

    async def group_sync(self, group_id: str, member_id: str, generation: int):
        await self._ready()
        result = self.groups.sync(group_id, member_id, generation, now_ms=monotonic_ms())
        self._groups_changed(group_id)
        self._save_groups()
        return result

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, poll_idle_ms: int, wait_ms: int = 0):
        """Heartbeat; with ``wait_ms``, a long poll: when there is nothing to do the reply waits
        until the group changes (then says what to do) or ``wait_ms`` passes.

        The member counts as alive at the call's start (and at a change it is woken for).
        """
        await self._ready()
        started = time.monotonic()
        result = self.groups.heartbeat(group_id, member_id, generation, poll_idle_ms=poll_idle_ms, now_ms=monotonic_ms())
        self._groups_changed(group_id)
        event = self._group_event(group_id)
        self._save_groups()
        if result.rejoin or result.revoke:
            return result
        if not await self._wait_group_change(group_id, event, min(max(0, int(wait_ms)), LONG_POLL_MAX_MS)):
            return result
        waited_ms = int((time.monotonic() - started) * 1000)
        result = self.groups.heartbeat(
            group_id, member_id, generation, poll_idle_ms=poll_idle_ms + waited_ms, now_ms=monotonic_ms()
        )
        self._save_groups()
        return result

    async def group_leave(self, group_id: str, member_id: str) -> bool:
        await self._ready()
        left = self.groups.leave(group_id, member_id, now_ms=monotonic_ms())
        self._groups_changed(group_id)
        self._save_groups()
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
        records = self.groups.commit_offsets(group_id, member_id, generation, checked, now_ms=monotonic_ms())
        self._save_groups()
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
        records = self.groups.commit_offsets(group_id, "", -1, {tp: OffsetAndMetadata(o) for tp, o in targets.items()}, now_ms=monotonic_ms())
        self._save_groups()
        await self._append_commits(records)
        for tp, offset in targets.items():
            self._committed[(group_id, tp.topic, tp.partition)] = OffsetAndMetadata(offset)
        return {tp: offset for tp, offset in targets.items()}
