"""What clients, gateways and tools read of the cluster, and the security records kept in its metadata.

The controller creates one :class:`ClientMetadata` and forwards these Ray
methods to it, each after the controller is ready: ``topic_metadata``
(producers and consumers), ``gateway_metadata`` (the Kafka gateway's view in
one call), ``replica_statuses`` and ``nodes`` (``logbus status`` and tools),
the SCRAM credentials (``scram_credential``, ``alter_scram_credentials``,
``scram_users``), the ACLs (``create_acls``, ``describe_acls``,
``delete_acls``, ``acls``) and ``allocate_producer_id``.

It reaches the controller through the small :class:`ClientHost` interface
(the metadata and its lock, persisting it, a partition's replica handles,
the topics, a look at Ray's nodes), and reads the nodes from
:class:`~logbus.actors.cluster_nodes.ClusterNodes` and the nodes being
drained from :class:`~logbus.actors.replica_moves.ReplicaMoves`. The rules
(ACL matching, SCRAM records, producer ids) are ``ClusterMetadata``'s; a
change to them is made under the lock and persisted before the call
returns. Every method runs on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import collections

from logbus.actors.cluster_nodes import ClusterNodes
from logbus.actors.metadata_host import MetadataHost
from logbus.actors.partition_replica import replica_actor_name
from logbus.actors.placement import replica_directory
from logbus.actors.replica_moves import ReplicaMoves
from logbus.clock import monotonic_ms
from logbus.protocol.acl import AclBinding, AclFilter
from logbus.storage.names import validate_topic_name

REPLICA_STATUS_TIMEOUT_S = 5.0  # a replica that does not answer a status question in this long shows as an error
AGENT_USAGE_TIMEOUT_S = 10.0  # a node agent that does not report its memory use in this long shows none


class ClientHost(MetadataHost):
    """What the client-facing reads need of the controller."""

    data_dir: str

    def persist(self) -> None:
        """Write the metadata to its file now (under the lock): a change no replica or node agent needs to hear of."""

    async def list_topics(self, include_internal: bool = False) -> list[str]:
        """Every topic's name, sorted; ``__consumer_offsets`` only if ``include_internal``."""


class ClientMetadata:
    """The cluster as clients see it, and its security records, over a :class:`ClientHost` (see the module docstring)."""

    def __init__(self, host: ClientHost, nodes: ClusterNodes, moves: ReplicaMoves) -> None:
        self._host = host
        self._nodes = nodes
        self._moves = moves

    # --- metadata for clients --------------------------------------------------------------------------

    def topic_metadata(self, name: str) -> dict:
        """What producers and consumers need: config and, per partition, the leader's handle and epoch."""
        host = self._host
        validate_topic_name(name)
        topic = host.metadata.topic(name)
        partitions = []
        host_map = self._nodes.host_map
        for p, state in enumerate(topic.partitions):
            # A leader on a node away now (for the moments before its lease runs out) is no leader to clients.
            handle = host.handle_or_none(topic, p, state.leader)
            # The replicas' actor names, the leader's first: what a reader outside Python (Spark's JVM) calls.
            ordered = ([state.leader] if state.leader is not None else []) + [r for r in state.replicas if r != state.leader]
            names = [
                replica_actor_name(topic.name, topic.topic_id, p, r, ray_node)
                for r in ordered if (ray_node := host_map.ray_node_of(state.nodes.get(str(r)))) is not None
            ]
            partitions.append({"leader": handle, "leader_epoch": state.leader_epoch, "replica_names": names})
        return {"name": name, "topic_id": topic.topic_id, "config": dict(topic.config), "partitions": partitions}

    async def gateway_metadata(self, names: list[str] | None = None) -> dict:
        """For the Kafka gateway, in one call (see ``Controller.gateway_metadata``)."""
        host = self._host
        host_map = self._nodes.host_map
        topics = {}
        for name in (await host.list_topics(include_internal=True)) if names is None else names:
            topic = host.metadata.topics.get(name)
            if topic is None:
                topics[name] = None
                continue
            partitions = []
            for p, state in enumerate(topic.partitions):
                leader = state.leader
                handle = host.handle_or_none(topic, p, leader)
                partitions.append({
                    "leader": handle,
                    "leader_epoch": state.leader_epoch,
                    "leader_node": host_map.ray_node_of(state.nodes.get(str(leader))) if handle is not None else None,
                    "replica_nodes": [n for r in state.replicas if (n := host_map.ray_node_of(state.nodes.get(str(r)))) is not None],
                    "isr_nodes": [n for r in state.isr if (n := host_map.ray_node_of(state.nodes.get(str(r)))) is not None],
                })
            topics[name] = {"topic_id": topic.topic_id, "config": dict(topic.config), "partitions": partitions}
        now = monotonic_ms()
        return {"topics": topics, "dead_nodes": self._nodes.table.dead_ray_nodes(now), "acl_version": host.metadata.acl_version}

    # --- SCRAM credentials (the Kafka gateway's SASL) ------------------------------------------------

    def scram_credential(self, user: str, mechanism: str) -> dict | None:
        """The stored SCRAM credential of ``user`` for ``mechanism`` (None if it has none)."""
        return self._host.metadata.scram_credential(user, mechanism)

    async def alter_scram_credentials(self, upserts: list, deletions: list) -> list[bool]:
        """Set each (user, mechanism, credential) of ``upserts``, then delete each (user, mechanism or
        None for all) of ``deletions``; durable before this returns. Per deletion, whether it found one."""
        host = self._host
        async with host.lock:
            for user, mechanism, credential in upserts:
                host.metadata.set_scram_credential(user, mechanism, credential)
            found = [host.metadata.delete_scram_credential(user, mechanism) for user, mechanism in deletions]
            host.persist()
        return found

    def scram_users(self) -> dict[str, dict[str, int]]:
        """user -> mechanism -> iterations of every SCRAM credential (never the credential itself)."""
        return self._host.metadata.scram_users()

    # --- ACLs (the Kafka gateway's authorizer) ------------------------------------------------------

    async def create_acls(self, bindings: list[dict]) -> int:
        """Add ACL bindings (AclBinding.to_dict each); durable before this returns. How many were new."""
        host = self._host
        parsed = [AclBinding.of(b) for b in bindings]
        async with host.lock:
            added = host.metadata.create_acls(parsed)
            if added:
                host.persist()
        return added

    def describe_acls(self, acl_filter: dict | None = None) -> list[dict]:
        """The ACL bindings an AclFilter (as its to_dict; None: every binding) matches."""
        return [b.to_dict() for b in self._host.metadata.describe_acls(AclFilter.of(acl_filter))]

    async def delete_acls(self, filters: list[dict]) -> list[list[dict]]:
        """Delete the bindings each filter matches; per filter, the bindings it deleted. Durable before this returns."""
        host = self._host
        parsed = [AclFilter.of(f) for f in filters]
        async with host.lock:
            deleted = host.metadata.delete_acls(parsed)
            if any(deleted):
                host.persist()
        return [[b.to_dict() for b in found] for found in deleted]

    def acls(self, known_version: int = -1) -> tuple[int, list[dict] | None]:
        """(the ACLs' version, every binding), or (version, None) when ``known_version`` is current."""
        metadata = self._host.metadata
        version = metadata.acl_version
        return version, (None if version == known_version else list(metadata.acls))

    # --- producer ids --------------------------------------------------------------------------------

    async def allocate_producer_id(self) -> int:
        """A producer id for an idempotent producer, unique for the life of the cluster's data."""
        host = self._host
        async with host.lock:
            producer_id = host.metadata.allocate_producer_id()
            host.persist()
        return producer_id

    # --- status for tools ------------------------------------------------------------------------------

    async def replica_statuses(self, name: str) -> list[list[dict]]:
        """Every replica's own view, with its ``node`` and ``directory`` (see ``Controller.replica_statuses``)."""
        host = self._host
        topic = host.metadata.topic(name)

        async def status(p: int, r: int):
            return await asyncio.wait_for(host.replica_handle(topic, p, r).status.remote(), REPLICA_STATUS_TIMEOUT_S)

        # Every replica is asked at once: one that does not answer costs its 5 s once, not once per partition.
        asked = [(p, r) for p, state in enumerate(topic.partitions) for r in state.replicas]
        found = await asyncio.gather(*(status(p, r) for p, r in asked), return_exceptions=True)
        out: list[list[dict]] = [[] for _ in topic.partitions]
        for (p, r), f in zip(asked, found):
            node = self._nodes.table.entry(topic.partitions[p].nodes[str(r)])
            directory = replica_directory(node.data_dir or host.data_dir, name, p, r) if node.ready else None
            where = {"node": node.node_id, "directory": directory}
            out[p].append({**f, **where} if isinstance(f, dict) else {"replica_id": r, "error": repr(f), **where})
        return out

    async def nodes(self) -> list[dict]:
        """Every node that may host replicas: its replicas, leaders, replica limit, lease state (see ``Controller.nodes``)."""
        host = self._host
        table, host_map = self._nodes.table, self._nodes.host_map
        counts: dict[str, int] = collections.Counter()
        leaders: dict[str, int] = collections.Counter()
        for topic in host.metadata.topics.values():
            for state in topic.partitions:
                for r in state.replicas:
                    counts[state.nodes[str(r)]] += 1
                if state.leader is not None:
                    leaders[state.nodes[str(state.leader)]] += 1
        await host.refresh_nodes()
        usable = host_map.usable()
        limits = {usable_host.node_id: usable_host.limit for usable_host in usable}
        now = monotonic_ms()
        # Bytes from the leaders' own view, memory from each node's agent: asked now, concurrently.
        sizes: dict[str, int] = collections.Counter()
        statuses = await asyncio.gather(*(self.replica_statuses(name) for name in list(host.metadata.topics)), return_exceptions=True)
        for found in statuses:
            for replicas in found if isinstance(found, list) else []:
                for status in replicas:
                    if "size_bytes" in status:
                        sizes[status["node"]] += status["size_bytes"]
        agents = [(n, n.agent) for n in table.nodes() if n.agent is not None]
        usage = await asyncio.gather(*(asyncio.wait_for(a.usage.remote(), AGENT_USAGE_TIMEOUT_S) for _, a in agents), return_exceptions=True)
        memory = {n.node_id: u.get("uss_mean_bytes") for (n, _), u in zip(agents, usage) if isinstance(u, dict)}
        out = []
        for node_id in sorted(set(limits) | set(counts)):
            node = table.get(node_id)
            out.append({
                "bytes": sizes.get(node_id, 0),
                "memory_per_replica_bytes": memory.get(node_id),
                "node_id": node_id,
                "replicas": counts.get(node_id, 0),
                "leaders": leaders.get(node_id, 0),
                "max_replicas": limits.get(node_id),
                "alive": node_id in limits and (node is None or node.agent is None or table.alive(node_id, now)),
                "replicas_down": len(node.down) if node is not None else 0,
                "draining": node_id in self._moves.draining,
                "ray_node_id": node.ray_node_id if node is not None else host_map.ray_node_of(node_id),
                "data_dir": (node.data_dir if node is not None else None) or host.data_dir,
            })
        # Hosts refused (another cluster's data directory): listed with the reason, never used.
        for ray_node_id, refused in host_map.refused_live():
            out.append({"bytes": 0, "memory_per_replica_bytes": None, "node_id": refused.node_id, "replicas": 0, "leaders": 0,
                        "max_replicas": None, "alive": False, "replicas_down": 0, "draining": False,
                        "ray_node_id": ray_node_id, "data_dir": None, "refused": refused.error})
        return out
