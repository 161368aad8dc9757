"""Moving replicas between nodes: reassignments (start, finish, cancel, describe), drains, rebalancing, preferred leaders.

The controller creates one :class:`ReplicaMoves` and forwards its Ray methods
``reassign_partitions``, ``cancel_reassignments``, ``describe_reassignments``,
``drain_node``, ``rebalance`` and ``elect_preferred_leaders`` to it. It
reaches the controller through the small :class:`MoveHost` interface: the
metadata and its lock, the nodes, and the replica lifecycle (start a
partition's replicas, announce its leader once fenced, retire replicas).

A move, as Kafka's: the partition's target nodes are written to the metadata
(``ClusterMetadata.start_reassignment``); the new replicas start (throttled,
if asked) and copy the log from the leader; once every one of them is in the
ISR (the leader's ``alter_isr``, which calls :meth:`ReplicaMoves.isr_changed`)
the old replicas leave (``complete_reassignment``), and leadership moves,
fenced, if the leader was one of them. A restarted controller finds moves in
progress in its metadata and completes them the same way.

A drained node is left out of placement (:attr:`ReplicaMoves.draining`) from
the drain's start until the node leaves the node table. Every
``PREFERRED_LEADER_CHECK_MS`` leaders go back to their preferred replicas.

The decisions (may these moves start, is a move finished, which partitions
get their preferred leader back, how many slots a drain asks an autoscaler
for) are ``protocol/replica_moves.py``'s; where replicas go is
``protocol/placement.py``'s. Every method runs on the controller's event
loop; metadata changes are made under the host's lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from logbus.actors import metrics
from logbus.actors.metadata_host import MetadataHost
from logbus.actors.placement import SlotReservation, autoscaler_replica_capacity
from logbus.clock import monotonic_ms
from logbus.errors import InvalidReassignmentError, NodeCapacityError
from logbus.protocol.cluster_metadata import TopicState
from logbus.protocol.placement import plan_drain, plan_rebalance
from logbus.protocol.replica_moves import (
    check_assignments_form,
    check_reassignments,
    drain_reservation_size,
    move_progress,
    move_ready,
    preferred_election_candidates,
)

logger = logging.getLogger(__name__)

PREFERRED_LEADER_CHECK_MS = 300_000  # leaders go back to their preferred replicas this often (Kafka: 5 min)
OFFSETS_CALL_TIMEOUT_S = 10.0  # a replica that does not report its offsets in this long shows no progress


class MoveHost(MetadataHost):
    """What moving replicas needs of the controller."""

    def knows_node(self, node_id: str) -> bool:
        """Whether ``node_id`` is a live node or in the node table."""

    def start_agent(self, node_id: str) -> None:
        """Start the node agent of ``node_id`` if it has none; ReplicaNotAvailableError when the node is away."""

    async def announce_fenced(self, topic: TopicState, partition: int) -> None:
        """Tell a partition's replicas its leader once its epoch is fenced (never raises)."""

    async def retire_replicas(self, replicas: list[tuple[TopicState, int, int, str]]) -> None:
        """End replicas (topic, partition, replica id, node id): their files, actors and fence entries."""

    async def reserve_nodes(self, what: str, partitions: int, replication_factor: int, timeout_s: float) -> SlotReservation:
        """Ask the autoscaler for replica slots on distinct nodes; NodeCapacityError if they do not come in ``timeout_s``."""

    def spawn(self, coroutine, what: str) -> asyncio.Task:
        """Run ``coroutine`` in the background, logging a failure as ``what`` failed."""

    def replica_alive(self, topic: TopicState, partition: int, replica_id: int, now: int) -> bool:
        """Whether the replica's node holds a lease and has not reported the replica down."""


class ReplicaMoves:
    """Reassignments, drains, rebalancing and preferred leaders, over a :class:`MoveHost` (see the module docstring)."""

    def __init__(self, host: MoveHost, calls: collections.Counter) -> None:
        self._host = host
        self._calls = calls  # the controller's calls served, by kind: moves started count as reassign_partitions
        self.draining: set[str] = set()  # nodes being emptied: placement leaves them out
        self._last_preferred_check_ms = monotonic_ms()

    # --- the controller's events ---------------------------------------------------------------

    def tick(self, now_ms: int) -> None:
        """Each control-loop tick: every PREFERRED_LEADER_CHECK_MS, leaders go back to their preferred replicas."""
        if now_ms - self._last_preferred_check_ms > PREFERRED_LEADER_CHECK_MS:
            self._last_preferred_check_ms = now_ms
            self._host.spawn(self.elect_preferred_leaders(), "electing preferred leaders")

    def isr_changed(self, topic: str, partition: int) -> None:
        """A partition's ISR changed (under the lock): complete its move if that made the move ready."""
        if move_ready(self._host.metadata, topic, partition):
            self._host.spawn(self._finish_move(topic, partition), f"completing the move of {topic}-{partition}")

    def node_gone(self, node_id: str) -> None:
        """A node left the node table: a drain of it ends (a node that comes back is new)."""
        self.draining.discard(node_id)

    # --- reassignments -------------------------------------------------------------------------

    async def reassign_partitions(self, assignments: dict, throttle_bytes_per_s: int | None = None) -> list[dict]:
        """Start moves (validated first: all start, or none); returns :meth:`describe_reassignments`."""
        await self._reassign(assignments, throttle_bytes_per_s)
        return await self.describe_reassignments()

    async def _reassign(self, assignments: dict, throttle_bytes_per_s: int | None, reserved: SlotReservation | None = None) -> None:
        """Start moves; ``reserved`` (slots the autoscaler provided for them) is released once the
        new replicas' actors exist and can take the slots over."""
        host = self._host
        self._calls["reassign_partitions"] += 1
        check_assignments_form(assignments)
        await host.refresh_nodes()
        async with host.lock:
            live = host.live_nodes()
            checked = check_reassignments(host.metadata, assignments, live)
            started = {}
            for (topic, partition), nodes in checked.items():
                started[(topic, partition)] = host.metadata.start_reassignment(topic, partition, nodes, live, throttle_bytes_per_s)
            host.metadata_changed()
        if reserved is not None:
            for (topic, partition), added in started.items():
                topic_state = host.metadata.topics[topic]
                for r in added:
                    host.replica_handle(topic_state, partition, r)  # pending on a slot the reservation frees
            reserved.release()
        await asyncio.gather(*(self._begin_move(t, p) for (t, p) in started))

    async def _begin_move(self, topic_name: str, partition: int) -> None:
        """Start a reassignment's new replicas (throttled) and tell the partition its new replica list."""
        host = self._host
        topic = host.metadata.topics[topic_name]
        state = topic.partitions[partition]
        for r in state.adding:
            host.start_agent(state.nodes[str(r)])
        throttle = state.throttle_bytes_per_s
        if throttle:  # before they are told to follow: the copy starts throttled
            handles = [host.handle_or_none(topic, partition, r) for r in state.adding]
            await asyncio.gather(*(h.set_throttle.remote(throttle) for h in handles if h is not None), return_exceptions=True)
        await host.start_partition(topic, partition)
        if host.metadata.reassignment_ready(topic_name, partition):
            host.spawn(self._finish_move(topic_name, partition), f"completing the move of {topic_name}-{partition}")

    async def _finish_move(self, topic_name: str, partition: int) -> None:
        """Every new replica is in the ISR: drop the old ones, move leadership if needed (fenced)."""
        host = self._host
        async with host.lock:
            if not move_ready(host.metadata, topic_name, partition):
                return  # completed by an earlier call, cancelled, or deleted meanwhile
            topic = host.metadata.topics[topic_name]
            old_nodes = dict(topic.partitions[partition].nodes)
            removed, moved = host.metadata.complete_reassignment(topic_name, partition)
            if moved:
                metrics.leader_elected(unclean=False)
            host.metadata_changed()
        state = topic.partitions[partition]
        handles = [host.handle_or_none(topic, partition, r) for r in state.replicas]
        await asyncio.gather(*(h.set_throttle.remote(None) for h in handles if h is not None), return_exceptions=True)
        await host.announce_fenced(topic, partition)
        await host.retire_replicas([(topic, partition, r, old_nodes[str(r)]) for r in removed])
        await host.check_partitions({(topic_name, partition)})  # the leader the move chose may be gone meanwhile
        logger.info("%s-%d: moved to %s", topic_name, partition, [state.nodes[str(r)][:8] for r in state.replicas])

    async def cancel_reassignments(self, partitions: list) -> list:
        """Abandon reassignments in progress: the new replicas go, the old ones stay. Returns what was cancelled."""
        host = self._host
        cancelled = []
        for topic_name, partition in partitions:
            async with host.lock:
                topic = host.metadata.topic(topic_name)
                old_nodes = dict(topic.partitions[partition].nodes)
                removed = host.metadata.cancel_reassignment(topic_name, partition)
                host.metadata_changed()
            await host.announce_fenced(topic, partition)
            await host.retire_replicas([(topic, partition, r, old_nodes[str(r)]) for r in removed])
            cancelled.append((topic_name, partition))
        return cancelled

    async def describe_reassignments(self) -> list[dict]:
        """Partitions being moved: target nodes, replicas being added and removed, and how far each new one has copied."""
        host = self._host
        out = []
        for (topic_name, partition), moving in sorted(host.metadata.reassignments().items()):
            topic = host.metadata.topics[topic_name]
            leader = topic.partitions[partition].leader
            handles = {r: host.handle_or_none(topic, partition, r) for r in [*moving["adding"], *([leader] if leader is not None else [])]}
            handles = {r: h for r, h in handles.items() if h is not None}
            found = await asyncio.gather(
                *(asyncio.wait_for(h.offsets.remote(), OFFSETS_CALL_TIMEOUT_S) for h in handles.values()), return_exceptions=True
            )
            ends = {r: (f[2] if isinstance(f, tuple) else None) for r, f in zip(handles, found)}
            out.append(move_progress(topic_name, partition, moving, leader, ends))
        return out

    # --- drain and rebalance -------------------------------------------------------------------

    async def drain_node(self, node_id: str, throttle_bytes_per_s: int | None, timeout_s: float) -> dict:
        """Move every replica and leadership off ``node_id`` so it becomes idle (and an autoscaler may remove it).

        When some partition has nowhere else to go and an autoscaler may add
        nodes with replica slots, one is asked for (up to ``timeout_s``).
        """
        await self._host.refresh_nodes()
        if not self._host.knows_node(node_id):
            raise InvalidReassignmentError(f"unknown node {node_id!r}")
        already = node_id in self.draining
        self.draining.add(node_id)  # placement (and the plan) leave it out from now on
        try:
            return await self._drain(node_id, throttle_bytes_per_s, timeout_s)
        except BaseException:
            if not already:  # a drain that could not start leaves the node as it was
                self.draining.discard(node_id)
            raise

    async def _drain(self, node_id: str, throttle_bytes_per_s: int | None, timeout_s: float) -> dict:
        host = self._host
        reserved = None
        try:
            plan = plan_drain(host.metadata, node_id, host.loads())
        except NodeCapacityError:
            # Some partition has no other node to go to: with an autoscaler, ask for one.
            if autoscaler_replica_capacity() == 0:
                raise
            size = drain_reservation_size(host.metadata, node_id)
            reserved = await host.reserve_nodes(f"draining node {node_id[:12]}", 1, size, timeout_s)
            try:
                plan = plan_drain(host.metadata, node_id, host.loads())
            except BaseException:
                reserved.release()
                raise
        if not plan:
            if reserved is not None:
                reserved.release()
            return {"node_id": node_id, "moving": []}
        try:
            await self._reassign(plan, throttle_bytes_per_s, reserved)
        finally:
            if reserved is not None:
                reserved.release()
        return {"node_id": node_id, "moving": sorted(plan)}

    async def rebalance(self, throttle_bytes_per_s: int | None = None) -> dict:
        """Spread replicas evenly over the live nodes (e.g. onto nodes just added): the fewest moves."""
        plan = plan_rebalance(self._host.metadata, self._host.loads())
        if plan:
            await self.reassign_partitions(plan, throttle_bytes_per_s)
        return {"moving": sorted(plan)}

    # --- preferred leaders ---------------------------------------------------------------------

    async def elect_preferred_leaders(self, topics: list[str] | None = None, partitions: list | None = None) -> list:
        """Give leadership back to each partition's preferred leader (its first replica) where it is
        alive and in sync; ``partitions`` ((topic, partition) pairs), if given, narrows ``topics``.
        Returns the partitions moved."""
        host = self._host
        now = monotonic_ms()
        changed: list[tuple[TopicState, int]] = []
        async with host.lock:
            for name, p in preferred_election_candidates(host.metadata, topics, partitions):
                topic = host.metadata.topics[name]
                alive = {r for r in topic.partitions[p].replicas if host.replica_alive(topic, p, r, now)}
                if host.metadata.elect_preferred_leader(name, p, alive):
                    changed.append((topic, p))
                    metrics.leader_elected(unclean=False)
            if changed:
                host.metadata_changed()
        await asyncio.gather(*(host.announce_fenced(t, p) for t, p in changed))
        return [(t.name, p) for t, p in changed]
