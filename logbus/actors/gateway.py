"""The Kafka gateway: a Kafka wire-protocol listener per node, so unmodified Kafka clients use logbus.

``start_gateways`` starts one :class:`Gateway` actor on each node asked for
(the caller's node, or every node hosting replicas), pinned there; each
listens on a TCP port (``127.0.0.1`` unless another address is asked for)
and serves Kafka's protocol with
:class:`~logbus.protocol.kafka_gateway.KafkaHandler`. Metadata names each
gateway a broker and, for each partition, the gateway on its leader's node,
so a client sends its produce requests and fetches to the node of the
leader, whose gateway hands them to the replica over the replica's local
channel (a Unix socket: ``channel_client.py``), the way logbus's own clients
on that node do; a partition whose leader's node has no gateway is served
with actor calls.

The listener runs on an event loop of its own, in a thread of the actor's
process: Ray's calls to the actor (addresses, peers, statistics, shutdown)
and the clients' traffic do not wait for one another, and the listener
needs no call to start after Ray restarts the actor. A restarted gateway
finds the others by their actor names and exchanges addresses with them
(``_rejoin``).

Each connection reads frames (4-byte size, then the request), refuses one
over ``max_request_bytes`` or one that cannot be parsed by closing the
connection, starts each request at once, and writes the responses in request
order, as Kafka clients require; at most ``IN_FLIGHT_MAX`` requests of a
connection are open at once (then it stops reading). Memory is bounded by
bytes too: a request's frame is read only once the frames of the gateway's
open requests, all connections together, leave room for it under
``OPEN_BYTES_FACTOR`` x ``max_request_bytes`` (:class:`_Budget`; a request
alone is always let in); connections wait for room in the order they asked.
A connection's batches for one partition reach its leader in the order they
were sent: the handler hands them over in that order, and keeps one in
flight at a time unless they are an idempotent producer's (see
``KafkaHandler._produce_partition``).

Leaders are cached per topic and looked up again (one lookup at a time per
topic, shared by the requests that need it) after a reply says a leader
moved (not leader, unavailable, closed channel) or ``METADATA_MAX_AGE_S``
after the last lookup; a Metadata request always asks the controller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import pickle
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from logbus.actors.channel_client import cancel_request
from logbus.actors.channel_client import channels as local_channels
from logbus.actors.controller import CONTROLLER_NAME, CREATE_TIMEOUT_S
from logbus.actors.fetcher import send_fetch
from logbus.actors.remote import CONTROL_TIMEOUT_S, unwrap
from logbus.errors import (
    ChannelClosedError,
    ChannelReplyTooLargeError,
    IllegalStateError,
    InvalidConfigError,
    KafkaProtocolError,
    LeaderNotAvailableError,
    NotLeaderError,
    RequestTimedOutError,
    UnknownTopicError,
)
from logbus.protocol import kafka_gateway as kg
from logbus.protocol.kafka_sasl import SASL_API_VERSIONS, Authenticator
from logbus.protocol.listener_security import ListenerSecurity
from logbus.protocol.local_channel import CHANNEL_PRODUCE_MAX_BYTES, PRODUCE
from logbus.protocol.scram import ScramCredential
from logbus.protocol.messages import FETCH_INLINE_MAX_BYTES, PRODUCE_INLINE_MAX_BYTES, READ_UNCOMMITTED, FetchRequest, TopicPartition
from logbus.storage.log_config import LogConfig

logger = logging.getLogger(__name__)

GATEWAY_NAME_PREFIX = "logbus-gateway:"
IN_FLIGHT_MAX = 64  # requests of one connection open at once
OPEN_BYTES_FACTOR = 4  # a gateway's open requests hold at most this many times max_request_bytes in all
CONNECTION_BYTES_FACTOR = 2  # and one connection's at most this many times (half the gateway's room)
MAX_CONNECTIONS_DEFAULT = 4096  # per gateway; one more is closed as soon as it is accepted
# Requests that only wait for something to answer, ended when their connection ends (nobody reads the
# reply); every other request runs to its end, as a Kafka broker serves every request it has read.
ABANDONED_AT_CLOSE = frozenset({kg.FETCH, kg.JOIN_GROUP, kg.SYNC_GROUP, kg.HEARTBEAT})
REFUSED_WARNING_INTERVAL_S = 60.0
METADATA_MAX_AGE_S = 30.0
CALL_MARGIN_S = 10.0  # beyond a request's own timeout, how long a call to a replica or the controller may take
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ANY_HOSTS = ("0.0.0.0", "::", "")


def gateway_name(node_id: str) -> str:
    """The Ray actor name of the gateway on ``node_id`` (one per node, in the cluster's namespace)."""
    return GATEWAY_NAME_PREFIX + node_id


def _wrapped(future: Future) -> asyncio.Future:
    """A concurrent Future on this loop, shielded: a waiter that gives up (a fetch's reply no longer
    wanted, a timeout) must not cancel the Future itself, which the local channel's reader or Ray's
    thread completes later."""
    return asyncio.shield(asyncio.wrap_future(future))


async def _await_ref(ref, timeout_s: float):
    """An actor call's result, on any event loop, as logbus errors."""
    try:
        return await asyncio.wait_for(_wrapped(ref.future()), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimedOutError(f"no reply within {timeout_s:.0f} s") from None
    except RayError as error:
        raise unwrap(error) from None


class _Budget:
    """Bytes of the gateway's open requests, bounded; requests wait for room first come, first served.

    Lives on the listener's loop. A request bigger than the whole budget gets
    in when nothing else is open, so any request within ``max_request_bytes``
    is served eventually.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waited = 0  # requests that had to wait for room
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def _take(self, size: int) -> None:
        self.used += size
        self.peak = max(self.peak, self.used)

    def must_wait(self, size: int) -> bool:
        return bool(self._waiting) or not self._fits(size)

    async def acquire(self, size: int) -> None:
        if not self.must_wait(size):
            self._take(size)
            return
        self.waited += 1
        room = asyncio.get_running_loop().create_future()
        self._waiting.append((size, room))
        try:
            await room
        except asyncio.CancelledError:
            if room.done() and not room.cancelled():
                self.release(size)  # handed over just as its waiter went away
            else:
                with contextlib.suppress(ValueError):  # release() may have dropped it already
                    self._waiting.remove((size, room))
            raise

    def release(self, size: int) -> None:
        self.used -= size
        while self._waiting and self._fits(self._waiting[0][0]):
            size, room = self._waiting.popleft()
            if not room.done():
                self._take(size)
                room.set_result(None)


class _Release:
    """Gives a request's bytes back to its budgets (its connection's, the gateway's), once: when the
    request ends, before anyone awaiting it can see it done (its response is written after), or when
    it is cancelled before it ran."""

    __slots__ = ("budgets", "size")

    def __init__(self, budgets: tuple[_Budget, ...], size: int) -> None:
        self.budgets, self.size = budgets, size

    def __call__(self, _done=None) -> None:
        if self.size:
            size, self.size = self.size, 0
            for budget in self.budgets:
                budget.release(size)


async def _released_after(awaitable, release: _Release):
    try:
        return await awaitable
    finally:
        release()


def _abandon(pending) -> None:
    """Cancel, at the replica, a fetch sent with ``send_fetch`` whose reply is no longer wanted."""
    if isinstance(pending, Future):
        if not pending.done():
            cancel_request(pending)
        return
    try:
        ray.cancel(pending)  # an async actor's call: its coroutine is cancelled
    except Exception:  # noqa: BLE001 (already finished, or the replica is gone)
        pass


@dataclass
class _Topic:
    view: kg.TopicView
    leaders: list  # actor handle per partition (None while leaderless)
    fetched_s: float


class ClusterBackend:
    """The handler's :class:`~logbus.protocol.kafka_gateway.Backend`: the controller, the replicas, their channels."""

    def __init__(self, namespace: str, broker: kg.Broker) -> None:
        self.broker = broker
        self.cluster_id = f"logbus-{namespace}"
        self._namespace = namespace
        self._controller = None
        self._peers: dict[str, kg.Broker] = {broker.node_id: broker}
        self._dead_nodes: set[str] = set()
        self._topics: dict[str, _Topic] = {}
        self._stale: set[str] = set()
        self._lookups: dict[str, asyncio.Future] = {}  # topic -> its lookup under way (see topic())
        self._channels = local_channels()

    # --- brokers --------------------------------------------------------------------------------------

    def set_peers(self, brokers: list[kg.Broker]) -> None:
        self._peers = {b.node_id: b for b in brokers}
        self._peers[self.broker.node_id] = self.broker

    def add_peer(self, broker: kg.Broker) -> None:
        if broker.node_id != self.broker.node_id:
            self._peers[broker.node_id] = broker

    def brokers(self) -> list[kg.Broker]:
        return [b for n, b in self._peers.items() if n == self.broker.node_id or n not in self._dead_nodes]

    def broker_on(self, node_id: str | None) -> kg.Broker:
        peer = self._peers.get(node_id) if node_id is not None else None
        if peer is None or node_id in self._dead_nodes:
            return self.broker
        return peer

    # --- metadata -------------------------------------------------------------------------------------

    @property
    def controller(self):
        if self._controller is None:
            self._controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
        return self._controller

    async def _call(self, method: str, *args, timeout_s: float = CONTROL_TIMEOUT_S):
        return await _await_ref(getattr(self.controller, method).remote(*args), timeout_s)

    async def topics(self, names: list[str] | None) -> dict[str, kg.TopicView | None]:
        found = await self._call("gateway_metadata", names)
        self._dead_nodes = set(found["dead_nodes"])
        now = time.monotonic()
        out = {}
        for name, raw in found["topics"].items():
            if raw is None:
                self._topics.pop(name, None)
                out[name] = None
                continue
            view = kg.TopicView(name, raw["topic_id"], raw["config"], tuple(
                kg.PartitionView(p["leader_node"], p["leader_epoch"], tuple(p["replica_nodes"]), tuple(p["isr_nodes"])) for p in raw["partitions"]
            ), LogConfig.from_dict(raw["config"]).max_message_bytes)
            self._topics[name] = _Topic(view, [p["leader"] for p in raw["partitions"]], now)
            self._stale.discard(name)
            out[name] = view
        return out

    async def topic(self, name: str) -> kg.TopicView | None:
        cached = self._topics.get(name)
        if cached is not None and name not in self._stale and time.monotonic() - cached.fetched_s <= METADATA_MAX_AGE_S:
            return cached.view
        lookup = self._lookups.get(name)
        if lookup is None:
            # One lookup for every request that needs the topic meanwhile: each resumes from the same
            # answer, in the order it started waiting, instead of from answers of its own in any order.
            lookup = self._lookups[name] = asyncio.ensure_future(self.topics([name]))
            lookup.add_done_callback(functools.partial(self._looked_up, name))
        return (await asyncio.shield(lookup)).get(name)

    def _looked_up(self, name: str, lookup: asyncio.Future) -> None:
        if self._lookups.get(name) is lookup:
            del self._lookups[name]
        if not lookup.cancelled():
            lookup.exception()  # its waiters have it (if any are left): not an unretrieved error

    def _cached_leader(self, topic: str, partition: int):
        """The leader's handle as the last lookup of ``topic`` found it."""
        cached = self._topics.get(topic)
        if cached is None:
            raise UnknownTopicError(f"topic {topic!r} does not exist")
        if not 0 <= partition < len(cached.leaders):
            raise UnknownTopicError(f"topic {topic!r} has partitions 0..{len(cached.leaders) - 1}, not {partition}")
        leader = cached.leaders[partition]
        if leader is None:
            raise LeaderNotAvailableError(f"{topic}-{partition} has no leader right now")
        return leader

    async def _leader(self, topic: str, partition: int):
        await self.topic(topic)
        return self._cached_leader(topic, partition)

    def _check_moved(self, topic: str, error: BaseException) -> BaseException:
        """Mark a topic's leaders for a fresh look when a reply says a leader moved; return the error."""
        if isinstance(error, NotLeaderError | LeaderNotAvailableError | UnknownTopicError):
            self._stale.add(topic)
        return error

    @contextlib.contextmanager
    def _leader_errors(self, topic: str, partition: int, what: str, timeout_s: float):
        """Errors of a call to a partition's leader as logbus's: no answer in time is
        RequestTimedOutError, a Ray error the error it carries, and one saying the leader moved
        marks the topic for a fresh lookup (``_check_moved``)."""
        try:
            yield
        except asyncio.TimeoutError:
            raise RequestTimedOutError(f"the leader of {topic}-{partition} did not answer {what} within {timeout_s:.0f} s") from None
        except RayError as error:
            raise self._check_moved(topic, unwrap(error)) from None
        except Exception as error:
            raise self._check_moved(topic, error) from None

    # --- produce and fetch ---------------------------------------------------------------------------

    def produce(self, topic: str, partition: int, batch: bytes, acks, timeout_ms: int):
        try:
            leader = self._cached_leader(topic, partition)
        except Exception as error:
            raise self._check_moved(topic, error) from None
        timeout_s = timeout_ms / 1000 + CALL_MARGIN_S
        return self._await_produce(topic, partition, self._send_produce(leader, batch, acks, timeout_ms), timeout_s)

    def _send_produce(self, leader, batch: bytes, acks, timeout_ms: int):
        """Send now: over the leader's local channel when it is on this node, else as an actor call."""
        if len(batch) <= CHANNEL_PRODUCE_MAX_BYTES:
            connection = self._channels.connection(leader)
            if connection is not None:
                try:
                    # Never waiting here: this is the loop of every connection. What the socket
                    # cannot take now is sent by the connection's sender thread, in order; once
                    # 64 MiB wait there (a replica not reading), batches go as actor calls, which
                    # is safe for order: a partition's next batch of a connection goes only after
                    # this one's reply, except an idempotent producer's, which the leader orders.
                    return connection.call(PRODUCE, (pickle.PickleBuffer(batch), acks, None, timeout_ms), block=False)
                except ChannelClosedError:
                    pass  # nothing was sent (closed, or busy): an actor call carries it
        payload = batch if len(batch) <= PRODUCE_INLINE_MAX_BYTES else np.frombuffer(batch, np.uint8)
        return leader.produce.remote(payload, acks, None, timeout_ms)

    async def _await_produce(self, topic: str, partition: int, sent, timeout_s: float):
        with self._leader_errors(topic, partition, "a produce", timeout_s):
            if isinstance(sent, Future):
                return await asyncio.wait_for(_wrapped(sent), timeout_s)
            return await _await_ref(sent, timeout_s)

    def channels_backlogged(self) -> int:
        """Local channels to replicas with frames waiting for a replica that is not reading (see Channels.backlogged)."""
        return self._channels.backlogged()

    def fetch(self, topic: str, partition: int, offset: int, max_bytes: int, max_wait_ms: int, isolation_level: int = READ_UNCOMMITTED):
        return self._fetch(topic, partition, offset, max_bytes, max_wait_ms, isolation_level)

    async def _fetch(self, topic: str, partition: int, offset: int, max_bytes: int, max_wait_ms: int, isolation_level: int):
        timeout_s = max_wait_ms / 1000 + CALL_MARGIN_S
        request = FetchRequest(offset, max_bytes, max_wait_ms, verify_crc=False, inline_max_bytes=FETCH_INLINE_MAX_BYTES,
                               isolation_level=isolation_level)
        with self._leader_errors(topic, partition, "a fetch", timeout_s):
            leader = await self._leader(topic, partition)
            try:
                return await self._fetch_reply(send_fetch(leader, request, self._channels, block=False), timeout_s)
            except ChannelReplyTooLargeError:
                return await self._fetch_reply(send_fetch(leader, request, None), timeout_s)

    async def _fetch_reply(self, pending, timeout_s: float):
        try:
            if isinstance(pending, Future):
                return await asyncio.wait_for(_wrapped(pending), timeout_s)
            meta, data = await asyncio.wait_for(_wrapped(pending.future()), timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            # Not wanted any more (another partition of the request answered first, or no reply
            # in time): the replica stops waiting for data too, rather than at the wait's end.
            _abandon(pending)
            raise
        if isinstance(data, ray.ObjectRef):
            data = await asyncio.wait_for(_wrapped(data.future()), timeout_s)
        return meta, data

    async def offsets(self, topic: str, partition: int, isolation_level: int = READ_UNCOMMITTED) -> tuple[int, int, int]:
        leader = await self._leader(topic, partition)
        with self._leader_errors(topic, partition, "an offsets query", CALL_MARGIN_S):
            return await _await_ref(leader.offsets.remote(isolation_level), CALL_MARGIN_S)

    async def offset_for_timestamp(self, topic: str, partition: int, timestamp_ms: int) -> int:
        leader = await self._leader(topic, partition)
        with self._leader_errors(topic, partition, "an offset query by time", CALL_MARGIN_S):
            return await _await_ref(leader.offset_for_timestamp.remote(timestamp_ms), CALL_MARGIN_S)

    # --- the controller's other services ----------------------------------------------------------------

    async def allocate_producer_id(self) -> int:
        return await self._call("allocate_producer_id")

    async def create_topic(self, name: str, partitions: int, replication_factor: int, config: dict) -> None:
        await self._call("create_topic", name, partitions, replication_factor, config, timeout_s=CREATE_TIMEOUT_S + CALL_MARGIN_S)

    async def delete_topic(self, name: str) -> None:
        await self._call("delete_topic", name)
        self._topics.pop(name, None)

    async def group_join(self, group_id: str, options: dict, wait_ms: int):
        session_s = options.get("session_timeout_ms", 0) / 1000
        return await self._call("group_join", group_id, options, wait_ms, timeout_s=wait_ms / 1000 + session_s + CALL_MARGIN_S)

    async def group_sync(self, group_id: str, member_id: str, generation: int, assignments: dict | None, wait_ms: int,
                         group_instance_id: str | None, protocol_type: str | None, protocol_name: str | None):
        return await self._call("group_sync", group_id, member_id, generation, assignments, wait_ms, group_instance_id, protocol_type,
                                protocol_name, timeout_s=wait_ms / 1000 + CALL_MARGIN_S)

    async def consumer_group_heartbeat(self, group_id: str, member_id: str, member_epoch: int, options: dict) -> dict:
        return await self._call("consumer_group_heartbeat", group_id, member_id, member_epoch, options)

    async def topic_names_by_id(self) -> dict[str, str]:
        """{topic id (hex): name} of the topics looked up so far."""
        return {cached.view.topic_id: name for name, cached in self._topics.items()}

    async def group_heartbeat(self, group_id: str, member_id: str, generation: int, group_instance_id: str | None = None):
        return await self._call("group_heartbeat", group_id, member_id, generation, 0, 0, group_instance_id)

    async def group_leave(self, group_id: str, member_id: str, group_instance_id: str | None = None) -> bool:
        return await self._call("group_leave", group_id, member_id, group_instance_id)

    async def commit_offsets(self, group_id: str, member_id: str, generation: int, offsets: dict, group_instance_id: str | None = None,
                             retention_ms: int | None = None) -> None:
        await self._call("commit_offsets", group_id, member_id, generation, offsets, group_instance_id, retention_ms)

    async def fetch_committed(self, group_id: str, partitions: list) -> dict:
        return await self._call("fetch_committed", group_id, partitions)

    async def describe_group(self, group_id: str) -> dict:
        return await self._call("describe_group", group_id, True)

    async def list_groups(self) -> list:
        return await self._call("list_groups", True)

    async def delete_group(self, group_id: str) -> None:
        await self._call("delete_group", group_id)

    async def delete_group_offsets(self, group_id: str, partitions: list) -> dict:
        return await self._call("delete_group_offsets", group_id, partitions)

    async def ensure_offsets_topic(self) -> None:
        await self._call("ensure_offsets_topic", timeout_s=CREATE_TIMEOUT_S)

    # --- administration ----------------------------------------------------------------------------------

    async def create_partitions(self, name: str, total: int) -> None:
        await self._call("create_partitions", name, total, timeout_s=CREATE_TIMEOUT_S)
        self._stale.add(name)

    async def delete_records(self, topic: str, partition: int, offset: int) -> int:
        found = await self._call("delete_records", {(topic, partition): offset})
        return found[TopicPartition(topic, partition)]

    async def alter_config(self, name: str, config: dict, delete: list[str]) -> None:
        await self._call("alter_config", name, config, delete)
        self._stale.add(name)

    async def end_offset_for_epoch(self, topic: str, partition: int, epoch: int) -> tuple[int, int]:
        leader = await self._leader(topic, partition)
        with self._leader_errors(topic, partition, "an epoch query", CALL_MARGIN_S):
            return tuple(await _await_ref(leader.end_offset_for_epoch.remote(epoch), CALL_MARGIN_S))

    async def elect_preferred_leaders(self, partitions: list[tuple[str, int]]) -> list[tuple[str, int]]:
        moved = await self._call("elect_preferred_leaders", sorted({t for t, _ in partitions}), [tuple(tp) for tp in partitions])
        for topic, _ in moved:
            self._stale.add(topic)
        return [tuple(tp) for tp in moved]

    async def replica_statuses(self, topic: str) -> list[list[dict]]:
        return await self._call("replica_statuses", topic)

    async def data_dir(self) -> str:
        return await self._call("get_data_dir")

    # The transaction coordinator's calls wait for appends and markers (at most its own bound,
    # transaction_service.CALL_WAIT_S_MAX, before it answers retriable): CONTROL_TIMEOUT_S covers that.

    async def txn_init_producer_id(self, transactional_id: str, timeout_ms: int, expected) -> tuple[int, int]:
        return tuple(await self._call("txn_init_producer_id", transactional_id, timeout_ms, expected))

    async def txn_add_partitions(self, transactional_id: str, producer_id: int, epoch: int, partitions: list) -> None:
        await self._call("txn_add_partitions", transactional_id, producer_id, epoch, partitions)

    async def txn_add_offsets(self, transactional_id: str, producer_id: int, epoch: int, group_id: str) -> None:
        await self._call("txn_add_offsets", transactional_id, producer_id, epoch, group_id)

    async def txn_offset_commit(self, transactional_id: str, producer_id: int, epoch: int, group_metadata: tuple, offsets: dict) -> None:
        await self._call("txn_offset_commit", transactional_id, producer_id, epoch, group_metadata, offsets)

    async def txn_end(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        await self._call("txn_end", transactional_id, producer_id, epoch, commit)


class Gateway:
    """One node's Kafka listener (see the module docstring). Its listener runs in a thread of its own."""

    def __init__(self, namespace: str, host: str, port: int, advertised_host: str | None, max_request_bytes: int,
                 max_connections: int = MAX_CONNECTIONS_DEFAULT, config: dict | None = None, security: dict | None = None) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        broker_config = kg.BrokerConfig.from_dict(config)
        self.security = ListenerSecurity.from_dict(security)
        # As asked (see start_gateways).
        self._settings = (host, port, advertised_host, max_request_bytes, max_connections, broker_config.to_dict(), self.security.to_dict())
        self._ssl = self.security.ssl_context()
        self.max_connections = max_connections
        self.connections_refused = 0
        self._refused_warned_s = -REFUSED_WARNING_INTERVAL_S
        if advertised_host is None:
            advertised_host = ray.util.get_node_ip_address() if host in ANY_HOSTS else host
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False, backlog=128)
        self._sock.setblocking(False)
        bound_port = self._sock.getsockname()[1]
        self.broker = kg.Broker(kg.broker_id_for(node_id), advertised_host, bound_port, node_id)
        self.backend = ClusterBackend(namespace, self.broker)
        self.handler = kg.KafkaHandler(self.backend, max_request_bytes=max_request_bytes, config=broker_config)
        self.auth = Authenticator(self.security, self._scram_credential)
        if self.auth.enabled:
            self.handler.api_versions.update(SASL_API_VERSIONS)
        self.connections = 0
        self.connections_total = 0
        self.refused_frames = 0
        self._budget = _Budget(OPEN_BYTES_FACTOR * max_request_bytes)
        self.requests_waited_for_connection_room = 0  # behind their own connection's share, not the gateway's room
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="logbus-kafka-gateway", daemon=True)
        self._thread.start()
        started.result(timeout=30)
        logger.info("Kafka gateway on node %s listening on %s:%d (advertised %s:%d, %s)", node_id, host, bound_port, advertised_host, bound_port,
                    self.security.security_protocol)
        self._namespace = namespace
        if ray.get_runtime_context().was_current_actor_reconstructed:
            threading.Thread(target=self._rejoin, name="logbus-kafka-gateway-rejoin", daemon=True).start()

    async def _scram_credential(self, user: str, mechanism: str) -> ScramCredential | None:
        found = await self.backend._call("scram_credential", user, mechanism)
        return None if found is None else ScramCredential.from_dict(found)

    def _rejoin(self) -> None:
        """Ray restarted this gateway: learn the other gateways' addresses and tell them this one's.

        Without it the restarted gateway would advertise only itself, and the
        others its old port (with ``port=0`` it listens on a new one).
        """
        mine = self.address()
        peers = [mine]
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception as error:  # noqa: BLE001 (start_gateway again tells every gateway the others)
            logger.warning("Kafka gateway: restarted, but could not list the other gateways: %s", error)
            return
        for entry in named:
            name = entry["name"]
            if entry["namespace"] != self._namespace or not name.startswith(GATEWAY_NAME_PREFIX) or name == gateway_name(self.broker.node_id):
                continue
            try:
                other = ray.get_actor(name, namespace=self._namespace)
                peers.append(tuple(ray.get(other.address.remote(), timeout=CONTROL_TIMEOUT_S)))
                ray.get(other.add_peer.remote(mine), timeout=CONTROL_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 (gone or restarting itself: it rejoins on its own)
                logger.info("Kafka gateway: peer %s not reached after a restart: %s", name, error)
        self.set_peers(peers)
        logger.info("Kafka gateway restarted at %s:%d; %d peer(s) told", mine[0], mine[1], len(peers) - 1)

    def _run(self, started: Future) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._serve_connection, sock=self._sock, ssl=self._ssl)
            started.set_result(None)

        try:
            self._loop.run_until_complete(serve())
        except BaseException as error:  # noqa: BLE001 (reported to the constructor)
            started.set_exception(error)
            return
        self._loop.run_forever()

    def _on_loop(self, fn, *args):
        """Run ``fn`` on the listener's loop and return its result (from Ray's threads)."""
        future: Future = Future()

        def call() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001
                future.set_exception(error)

        self._loop.call_soon_threadsafe(call)
        return future.result(timeout=30)

    # --- actor methods ----------------------------------------------------------------------------------

    def address(self) -> tuple[str, int, int, str]:
        """(advertised host, port, broker id, node id)."""
        return self.broker.host, self.broker.port, self.broker.broker_id, self.broker.node_id

    def settings(self) -> tuple[str, int, str | None, int, int, dict, dict]:
        """(host, port, advertised host, max request bytes, max connections, broker settings, listener security) as asked for
        when it was started."""
        return self._settings

    def set_peers(self, peers: list[tuple[str, int, int, str]]) -> None:
        """Every gateway of the cluster, as ``address()`` gives them (Metadata advertises them as brokers)."""
        brokers = [kg.Broker(broker_id, host, port, node_id) for host, port, broker_id, node_id in peers]
        self._on_loop(self.backend.set_peers, brokers)

    def add_peer(self, peer: tuple[str, int, int, str]) -> None:
        """One gateway's (new) address, as ``address()`` gives it: a gateway that Ray restarted."""
        host, port, broker_id, node_id = peer
        self._on_loop(self.backend.add_peer, kg.Broker(broker_id, host, port, node_id))

    def stats(self) -> dict:
        """Connections now, since start, their limit and how many were refused over it; requests served by
        (API key, version); frames refused; and the bytes of open requests: now, at most so far, the
        limit, and how many requests waited for room; one connection's limit, and how many requests waited
        for their connection's share; and how many local channels to replicas have frames waiting for a
        replica that is not reading (sent by the channel's own thread, never the gateway's loop)."""
        budget = self._budget
        return {
            "pid": os.getpid(),
            "connections": self.connections,
            "connections_total": self.connections_total,
            "connections_limit": self.max_connections,
            "connections_refused": self.connections_refused,
            "requests": dict(self.handler.requests_served),
            "requests_unserved": dict(self.handler.requests_unserved),
            "refused_frames": self.refused_frames,
            "open_request_bytes": budget.used,
            "open_request_bytes_peak": budget.peak,
            "open_request_bytes_limit": budget.limit,
            "requests_waited_for_room": budget.waited,
            "open_request_bytes_connection_limit": CONNECTION_BYTES_FACTOR * self.handler.max_request_bytes,
            "requests_waited_for_connection_room": self.requests_waited_for_connection_room,
            "replica_channels_backlogged": self.backend.channels_backlogged(),
            "authentications": {"succeeded": self.auth.stats.succeeded, "failed": self.auth.stats.failed,
                                "refused_frames": self.auth.stats.refused_frames, "by_mechanism": dict(self.auth.stats.by_mechanism),
                                "addresses_throttled": len(self.auth.throttle)},
        }

    def shutdown(self) -> None:
        """Stop listening and close every connection."""
        def stop() -> None:
            if self._server is not None:
                self._server.close()
                for transport in list(self._transports):
                    transport.close()

        self._on_loop(stop)

    @property
    def _transports(self) -> set:
        if not hasattr(self, "_open"):
            self._open: set = set()
        return self._open

    # --- connections ---------------------------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            # Over the limit: closed at once, unread (the client reconnects after its backoff, as from a
            # Kafka broker at max.connections). Each connection holds a socket and buffers.
            self.connections_refused += 1
            now = time.monotonic()
            if now - self._refused_warned_s >= REFUSED_WARNING_INTERVAL_S:
                self._refused_warned_s = now
                logger.warning("Kafka gateway: %d connections open, the limit (max_connections); closing new ones "
                               "(%d so far)", self.connections, self.connections_refused)
            writer.transport.abort()
            return
        self.connections += 1
        self.connections_total += 1
        connection = self.connections_total  # the handler keeps each connection's batches in order
        self._transports.add(writer.transport)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        responses: asyncio.Queue = asyncio.Queue(maxsize=IN_FLIGHT_MAX)
        sender = asyncio.ensure_future(self._send_responses(responses, writer))
        peer = writer.get_extra_info("peername")
        session = self.auth.session(peer)  # SASL's turn first, when the listener has it
        start_request = functools.partial(self.handler.start, connection=connection)
        # This connection's share of the gateway's room: however slow its requests (long polls, produce
        # requests waiting for acks), it leaves the other half to the other connections.
        own = _Budget(CONNECTION_BYTES_FACTOR * self.handler.max_request_bytes)
        requests: dict[asyncio.Future, int] = {}  # this connection's open requests: their API keys
        gone = False
        try:
            while not sender.done():
                prefix = await reader.readexactly(4)
                size = int.from_bytes(prefix, "big", signed=True)
                size_max = session.frame_bytes_max or self.handler.max_request_bytes
                if size < 8 or size > size_max:
                    raise KafkaProtocolError(f"a request of {size} bytes (the maximum is {size_max})")
                if own.must_wait(size):
                    self.requests_waited_for_connection_room += 1
                await own.acquire(size)
                release = _Release((own,), size)
                try:
                    await self._budget.acquire(size)
                    release = _Release((own, self._budget), size)
                    frame = await reader.readexactly(size)
                    pending = asyncio.ensure_future(_released_after(session.start(frame, start_request), release))
                except BaseException:
                    release()
                    raise
                pending.add_done_callback(release)  # also when cancelled before it ran
                requests[pending] = kg.peek_header(frame)[0]
                pending.add_done_callback(requests.pop)
                await responses.put(pending)
        except (asyncio.IncompleteReadError, ConnectionError):
            gone = True  # the client went away (Kafka clients never half-close a connection)
        except KafkaProtocolError as error:
            self.refused_frames += 1
            logger.warning("Kafka gateway: closing the connection from %s: %s", peer, error)
        except Exception:  # noqa: BLE001 (a bug must cost the connection, never the gateway)
            self.refused_frames += 1
            logger.exception("Kafka gateway: closing the connection from %s after an unexpected error", peer)
        finally:
            # However the connection ends, requests that only wait for something to answer (long
            # polls, group joins and heartbeats the coordinator holds) end now rather than at their
            # wait's end, at the replicas too (ClusterBackend._fetch_reply): nobody reads their replies.
            # Requests that change something (produce, commit, ...) run to their end, as Kafka serves
            # every request it has read; their replies are dropped if the client is gone.
            loop = asyncio.get_running_loop()
            for pending, api_key in list(requests.items()):
                if api_key in ABANDONED_AT_CLOSE:
                    loop.call_soon(pending.cancel)  # after its first step: a request never started is never awaited
            # Nothing more is read: the connection no longer counts against max_connections, whatever
            # its last requests still take (their bytes stay in the budgets until they end).
            self.connections -= 1
            if gone:
                writer.transport.abort()  # the socket goes now; the sender writes nothing more
            try:
                await responses.put(None)
                with contextlib.suppress(Exception):
                    await sender
            finally:
                if not sender.done():
                    sender.cancel()  # this connection's task was cancelled (the gateway stops)
                self._transports.discard(writer.transport)
                writer.close()

    async def _send_responses(self, responses: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        """Write each request's response in the order the requests came. Once one cannot be written (its
        request abandoned, the connection lost), nothing more is: every request still runs to its end."""
        mute = False
        while True:
            pending = await responses.get()
            if pending is None:
                return
            try:
                frame = await pending
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this sender itself is cancelled (which cancels the request it awaited too)
                mute = True  # abandoned as its connection ended: a reply after it would be out of order
                continue
            except Exception:  # noqa: BLE001 (a request that failed unexpectedly closes its connection)
                logger.exception("Kafka gateway: a request failed; closing its connection")
                mute = True
                writer.transport.abort()
                continue
            if frame is None or mute or writer.transport.is_closing():
                continue
            try:
                writer.write(frame)
                await writer.drain()
            except ConnectionError:
                mute = True
                writer.transport.abort()


# --- starting and stopping from a driver ------------------------------------------------------------------


@dataclass(frozen=True)
class KafkaGateway:
    """The gateways started by ``Bus.start_gateway``: their addresses, and how to stop them."""

    namespace: str
    brokers: tuple[tuple[str, int, int, str], ...]  # (host, port, broker id, node id) per gateway

    @property
    def bootstrap_servers(self) -> str:
        """``host:port,...``: what Kafka clients take as ``bootstrap.servers``."""
        return ",".join(f"{'[' + h + ']' if ':' in h else h}:{p}" for h, p, _, _ in self.brokers)

    def actors(self) -> list:
        """The gateway actors' handles, in the order of ``brokers`` (ValueError if one is gone)."""
        return [ray.get_actor(gateway_name(node_id), namespace=self.namespace) for _, _, _, node_id in self.brokers]

    def stats(self) -> list[dict]:
        """Each gateway's statistics (``Gateway.stats``), with its address."""
        out = []
        for (host, port, broker_id, node_id), actor in zip(self.brokers, self.actors()):
            out.append({"host": host, "port": port, "broker_id": broker_id, "node_id": node_id, **ray.get(actor.stats.remote(), timeout=CONTROL_TIMEOUT_S)})
        return out

    def stop(self) -> None:
        """Close the listeners and end the gateway actors."""
        for _, _, _, node_id in self.brokers:
            try:
                actor = ray.get_actor(gateway_name(node_id), namespace=self.namespace)
            except ValueError:
                continue
            try:
                ray.get(actor.shutdown.remote(), timeout=CONTROL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 (already gone)
                pass
            ray.kill(actor, no_restart=True)


def _check_port(port) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidConfigError(f"port must be an int in 0..65535 (0: any free port), not {port!r}")
    return port


@functools.cache
def _gateway_actor_class():
    """The gateway's Ray actor class, made once per process (see partition_replica's ``_replica_actor_class``)."""
    return ray.remote(Gateway)


def start_gateways(
    namespace: str,
    controller,
    host: str = "127.0.0.1",
    port: int = 9092,
    *,
    all_nodes: bool = False,
    advertised_host: str | None = None,
    max_request_bytes: int | None = None,
    max_connections: int | None = None,
    config: dict | None = None,
    security: ListenerSecurity | None = None,
) -> KafkaGateway:
    """Start (or find) the gateway actors and tell each of the others; see ``Bus.start_gateway``.

    ``config``: broker settings by Kafka's names (``auto.create.topics.enable``,
    ``num.partitions``, ``default.replication.factor``; see
    :class:`~logbus.protocol.kafka_gateway.BrokerConfig`). ``__consumer_offsets``
    is created before this returns, as a Kafka cluster has it from the start.
    ``security``: the listener's TLS and SASL; a gateway that would listen
    off loopback without them is refused here, before anything starts
    (:meth:`~logbus.protocol.listener_security.ListenerSecurity.exposure_warning`).

    A gateway already running on a node is used as it is if it was started
    with the same settings, and IllegalStateError is raised (nothing is
    started or stopped) if it was started with others. If a gateway this call
    started fails to start, the ones this call started are ended; gateways
    that were running before are left running.
    """
    if not isinstance(host, str):
        raise InvalidConfigError(f"host must be a str, not {host!r}")
    _check_port(port)
    if max_request_bytes is None:
        max_request_bytes = kg.MAX_REQUEST_BYTES_DEFAULT
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1024:
        raise InvalidConfigError(f"max_request_bytes must be an int of at least 1024, not {max_request_bytes!r}")
    if max_connections is None:
        max_connections = MAX_CONNECTIONS_DEFAULT
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise InvalidConfigError(f"max_connections must be a positive int, not {max_connections!r}")
    broker_config = kg.BrokerConfig.from_dict(config).to_dict()
    security = security if security is not None else ListenerSecurity()
    security.ssl_context()  # files that cannot be read fail here, with the driver's error
    if all_nodes:
        nodes = [n["ray_node_id"] for n in ray.get(controller.nodes.remote(), timeout=CONTROL_TIMEOUT_S) if n["alive"] and n["replicas"]]
        here = ray.get_runtime_context().get_node_id()
        if not nodes:
            nodes = [here]
    else:
        nodes = [ray.get_runtime_context().get_node_id()]
    asked = (host, port, advertised_host, max_request_bytes, max_connections, broker_config, security.to_dict())
    actors, created = [], []
    for node_id in nodes:
        try:
            actors.append(ray.get_actor(gateway_name(node_id), namespace=namespace))
            continue
        except ValueError:
            pass  # none there yet
        exposed = security.exposure_warning(host)  # before one starts: raises unless allowed
        actor = (
            _gateway_actor_class()
            .options(
                name=gateway_name(node_id),
                namespace=namespace,
                lifetime="detached",  # until stop(): a handle dropped by the caller must not end it
                get_if_exists=True,  # one started meanwhile by another caller is used (and checked) as well
                max_restarts=-1,
                max_task_retries=0,
                num_cpus=0,
                max_concurrency=8,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            )
            .remote(namespace, host, port, advertised_host, max_request_bytes, max_connections, broker_config, security.to_dict())
        )
        actors.append(actor)
        created.append(actor)
        if exposed:
            logger.warning("%s", exposed)
    try:
        addresses = ray.get([a.address.remote() for a in actors], timeout=CONTROL_TIMEOUT_S)
        settings = ray.get([a.settings.remote() for a in actors], timeout=CONTROL_TIMEOUT_S)
    except RayError as error:
        cause = unwrap(error)
        _end(created)
        if isinstance(cause, OSError) or "Address already in use" in str(error):
            raise IllegalStateError(f"the Kafka gateway cannot listen on {host}:{port}: {error}") from None
        raise cause from None
    for (_, _, _, node_id), found in zip(addresses, settings):
        if tuple(found) != asked:
            # Ours are the ones started with what was asked (another caller may have started one meanwhile).
            _end([a for a, theirs in zip(actors, settings) if tuple(theirs) == asked and any(a is c for c in created)])
            was = dict(zip(("host", "port", "advertised_host", "max_request_bytes", "max_connections", "config", "security"), found))
            raise IllegalStateError(
                f"a Kafka gateway already runs on node {node_id}, started with {was}; stop it (KafkaGateway.stop()) "
                f"to start one with other settings"
            )
    ray.get([a.set_peers.remote(addresses) for a in actors], timeout=CONTROL_TIMEOUT_S)
    # Kafka's tools (lag monitors reading __consumer_offsets) expect it before the first commit.
    ray.get(controller.ensure_offsets_topic.remote(), timeout=CREATE_TIMEOUT_S + CONTROL_TIMEOUT_S)
    return KafkaGateway(namespace, tuple(tuple(a) for a in addresses))


def _end(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
