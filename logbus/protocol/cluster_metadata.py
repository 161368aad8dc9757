"""Cluster metadata kept by the controller: topics, partitions, replica placement, leaders, epochs.

Pure state with its rules; no Ray and no I/O beyond (de)serialising to JSON.
The controller actor owns one instance, persists it after every change
(:meth:`to_json`), and reloads it on restart (:meth:`from_json`).

Replica ids are per partition: replica ``r`` of a partition has the id ``r``
(0 .. replication_factor-1) and its log lives in
``{data_dir}/replica-{r}/{topic}-{partition}``; placement maps a replica id to
the Ray node that runs it.

Invariants of every partition, checked after each change (a violation is a
bug and raises AssertionError, not an ``assert``, which -O removes):

- the replica ids are distinct, and the node map has exactly them;
- the ISR is a non-empty subset of the replicas, also while the partition
  has no leader (it keeps the last in-sync members, so a returning one can
  lead without loss);
- a leader is one of the replicas and in the ISR;
- the leader epoch grows by one on every change of leader (to none
  included), and never otherwise;
- a replacement replica gets an id larger than any the partition had, so
  ids are never reused.

This class is not thread-safe; the controller serialises access.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field

from logbus.invariant import check as _check
from logbus.protocol.placement import NodeLoad, Placer
from logbus.errors import (
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    TopicAlreadyExistsError,
    UnknownTopicError,
)
from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_topic_name

PARTITIONS_MAX = 10_000  # per topic: each partition replica is a Ray actor (a process)
METADATA_VERSION = 1


@dataclass(slots=True)
class PartitionState:
    replicas: list[int]  # replica ids, the first is the preferred leader
    nodes: dict[str, str]  # replica id (as str, for JSON) -> Ray node id
    leader: int | None
    leader_epoch: int
    isr: list[int]


@dataclass(slots=True)
class TopicState:
    name: str
    topic_id: str
    partitions: list[PartitionState]
    config: dict = field(default_factory=dict)  # overrides, Kafka dotted names

    @property
    def replication_factor(self) -> int:
        return len(self.partitions[0].replicas) if self.partitions else 0


class ClusterMetadata:
    """Topics and their partitions' placement and leadership."""

    def __init__(self) -> None:
        self.topics: dict[str, TopicState] = {}
        self.next_producer_id = 0

    # --- topics ------------------------------------------------------------------------------

    def topic(self, name: str) -> TopicState:
        validate_topic_name(name)
        try:
            return self.topics[name]
        except KeyError:
            raise UnknownTopicError(f"topic {name!r} does not exist") from None

    def create_topic(
        self,
        name: str,
        partitions: int,
        replication_factor: int,
        config: dict | None,
        live_nodes: list[str],
        node_limits: dict[str, int] | None = None,
        loads: list[NodeLoad] | None = None,
        placements: list[list[str]] | None = None,
    ) -> TopicState:
        """Add a topic, placing its replicas on distinct live nodes by load; validates everything first.

        ``node_limits`` (node id -> replicas it may hold): NodeCapacityError,
        and nothing added, if the placement would put more on a node.
        ``loads`` (instead of the two): what placement knows of each node
        (racks, bytes, limits; see ``protocol/placement.py``). ``placements``
        (instead of placing): the nodes of each partition, decided elsewhere
        (slots the autoscaler provided).
        """
        normalized = self.check_new_topic(name, partitions, replication_factor, config)
        if placements is not None:
            _check(len(placements) == partitions and all(len(set(p)) == len(p) == replication_factor for p in placements),
                   f"placements for {name!r} must give {replication_factor} distinct nodes for each of {partitions} partitions")
            topic = TopicState(name, uuid.uuid4().hex, [], {key: normalized[key] for key in (config or {})})
            topic.partitions = [self._partition_on(nodes) for nodes in placements]
            self.topics[name] = topic
            return topic
        if replication_factor > len(live_nodes):
            raise InvalidReplicationFactorError(
                f"replication factor {replication_factor} exceeds the {len(live_nodes)} live Ray node(s)"
            )
        overrides = {key: normalized[key] for key in (config or {})}
        topic = TopicState(name, uuid.uuid4().hex, [], overrides)
        placements = self._placer(live_nodes, node_limits, loads).place_all(partitions, replication_factor)
        topic.partitions = [self._partition_on(nodes) for nodes in placements]
        self.topics[name] = topic
        return topic

    def check_new_topic(self, name: str, partitions: int, replication_factor: int, config: dict | None) -> dict:
        """Validate a new topic's name, counts and config, before any placement; returns the config normalized."""
        validate_topic_name(name)
        _check_count("partitions", partitions, InvalidPartitionsError, PARTITIONS_MAX)
        _check_count("replication_factor", replication_factor, InvalidReplicationFactorError, None)
        normalized = LogConfig.from_dict(config).to_dict() if config else {}
        if name in self.topics:
            raise TopicAlreadyExistsError(f"topic {name!r} already exists")
        return normalized

    def replicas_per_node(self) -> dict[str, int]:
        """How many replicas each node holds now."""
        counts: dict[str, int] = {}
        for topic in self.topics.values():
            for state in topic.partitions:
                for node in state.nodes.values():
                    counts[node] = counts.get(node, 0) + 1
        return counts

    def leaders_per_node(self) -> dict[str, int]:
        """How many partitions each node leads now."""
        counts: dict[str, int] = {}
        for topic in self.topics.values():
            for state in topic.partitions:
                if state.leader is not None:
                    node = state.nodes[str(state.leader)]
                    counts[node] = counts.get(node, 0) + 1
        return counts

    def node_loads(self, live_nodes: list[str], node_limits: dict[str, int] | None = None) -> list[NodeLoad]:
        """What placement knows of ``live_nodes`` from the metadata alone: replicas and leaders each holds."""
        replicas, leaders = self.replicas_per_node(), self.leaders_per_node()
        limits = node_limits or {}
        return [NodeLoad(n, replicas=replicas.get(n, 0), leaders=leaders.get(n, 0), limit=limits.get(n)) for n in live_nodes]

    def _placer(self, live_nodes: list[str], node_limits: dict[str, int] | None, loads: list[NodeLoad] | None) -> Placer:
        return Placer(loads if loads is not None else self.node_loads(live_nodes, node_limits))

    @staticmethod
    def _partition_on(nodes: list[str]) -> PartitionState:
        """A new partition with replica ``r`` on ``nodes[r]`` (replica 0, the preferred leader, leads)."""
        replicas = list(range(len(nodes)))
        state = PartitionState(replicas, {str(r): node for r, node in zip(replicas, nodes)}, leader=0, leader_epoch=0, isr=list(replicas))
        _check_partition(state)
        return state

    def create_partitions(
        self,
        name: str,
        total: int,
        live_nodes: list[str],
        node_limits: dict[str, int] | None = None,
        loads: list[NodeLoad] | None = None,
    ) -> list[int]:
        """Grow a topic to ``total`` partitions; return the new partition numbers."""
        topic = self.topic(name)
        _check_count("total", total, InvalidPartitionsError, PARTITIONS_MAX)
        current = len(topic.partitions)
        if total <= current:
            raise InvalidPartitionsError(f"topic {name!r} has {current} partitions; the new total must be larger, not {total}")
        if topic.replication_factor > len(live_nodes):
            raise InvalidReplicationFactorError(
                f"replication factor {topic.replication_factor} exceeds the {len(live_nodes)} live Ray node(s)"
            )
        added = list(range(current, total))
        placements = self._placer(live_nodes, node_limits, loads).place_all(len(added), topic.replication_factor)
        topic.partitions += [self._partition_on(nodes) for nodes in placements]
        return added

    def alter_config(self, name: str, config: dict) -> dict:
        """Merge config overrides into a topic's (validated); return the new overrides."""
        topic = self.topic(name)
        merged = {**topic.config, **(config or {})}
        normalized = LogConfig.from_dict(merged).to_dict()
        topic.config = {key: normalized[key] for key in merged}
        return topic.config

    def delete_topic(self, name: str) -> TopicState:
        topic = self.topic(name)
        del self.topics[name]
        return topic

    def reassign_dead_nodes(self, live_nodes: list[str]) -> list[tuple[str, int, int]]:
        """Place partitions none of whose replicas is on a live node again; return the (topic, partition, replica) moved.

        That happens when the whole Ray cluster was restarted over the same
        data directory (every node id is new): on one machine every node sees
        that directory, so a moved replica finds its log where it left it. A
        partition with a replica still on a live node is left alone: its lost
        replicas go through election and replacement (a new replica id, which
        copies the log from the leader), never by moving an identity onto a
        node that may already hold another replica of the partition.
        """
        moved = []
        if not live_nodes:
            return moved
        live = set(live_nodes)
        for topic in self.topics.values():
            for p, state in enumerate(topic.partitions):
                if any(state.nodes[str(r)] in live for r in state.replicas):
                    continue
                for i, r in enumerate(state.replicas):
                    state.nodes[str(r)] = live_nodes[(p + i) % len(live_nodes)]
                    moved.append((topic.name, p, r))
        return moved

    # --- leadership ---------------------------------------------------------------------------

    def elect_leader(self, name: str, partition: int, alive: set[int], unclean_allowed: bool) -> bool:
        """Choose a new leader for a partition whose leader is gone; True if the leadership changed.

        Candidates are the live ISR members other than the failed leader, in
        replica order. With none, and only if ``unclean_allowed``, any live
        replica may lead (it may lack committed records). Otherwise the
        partition stays leaderless (and the ISR keeps its last members, so a
        returning one can lead without loss). Every change bumps the epoch.
        """
        state = self.topic(name).partitions[partition]
        old = state.leader
        candidates = [r for r in state.replicas if r in state.isr and r in alive]
        unclean = False
        if not candidates and unclean_allowed:
            candidates = [r for r in state.replicas if r in alive]
            unclean = True
        if not candidates:
            if old is None:
                return False
            state.leader = None
            state.leader_epoch += 1
            _check_partition(state, f"{name}-{partition}")
            return True
        new = candidates[0]
        if new == old:
            return False
        state.leader = new
        state.leader_epoch += 1
        if unclean:
            state.isr = [new]
        elif old is not None and old in state.isr and len(state.isr) > 1:
            state.isr = [r for r in state.isr if r != old]
        _check_partition(state, f"{name}-{partition}")
        return True

    def alter_isr(self, name: str, partition: int, leader: int, leader_epoch: int, isr: list[int]) -> list[int] | None:
        """Accept a leader's ISR change if it comes from the current leader and epoch; return the ISR in force.

        The ISR in force keeps only ids that are replicas, and always the leader.
        A leaderless partition accepts no change: it keeps its last ISR.
        """
        state = self.topic(name).partitions[partition]
        if state.leader is None or state.leader != leader or state.leader_epoch != leader_epoch:
            return None
        members = sorted(set(isr) & set(state.replicas) | {leader})
        state.isr = members
        _check_partition(state, f"{name}-{partition}")
        return list(members)

    def replace_replica(self, name: str, partition: int, dead: int, node: str) -> int:
        """Put a new replica (a fresh id, so a fresh directory) on ``node`` in place of ``dead``; return its id.

        The new id is larger than any the partition had (the largest only
        grows), so no id is ever reused. ``dead`` leaves the ISR; if it led,
        the partition becomes leaderless and the epoch moves on, as for any
        change of leader. The caller must not replace the only in-sync
        replica (that would lose the committed records; AssertionError).
        """
        state = self.topic(name).partitions[partition]
        where = f"{name}-{partition}"
        _check(dead in state.replicas, f"{where}: replica {dead} to replace is not one of {state.replicas}")
        _check(state.isr != [dead], f"{where}: replica {dead} is the only in-sync replica; replacing it loses the partition's data")
        new = max(state.replicas) + 1
        state.replicas = [new if r == dead else r for r in state.replicas]
        state.nodes.pop(str(dead), None)
        state.nodes[str(new)] = node
        state.isr = [r for r in state.isr if r != dead]
        if state.leader == dead:
            state.leader = None
            state.leader_epoch += 1
        _check_partition(state, where)
        return new

    def allocate_producer_id(self) -> int:
        producer_id = self.next_producer_id
        self.next_producer_id += 1
        return producer_id

    # --- persistence -------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": METADATA_VERSION,
                "next_producer_id": self.next_producer_id,
                "topics": {name: asdict(topic) for name, topic in self.topics.items()},
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "ClusterMetadata":
        raw = json.loads(text)
        if raw.get("version") != METADATA_VERSION:
            raise ValueError(f"unsupported metadata version {raw.get('version')!r}")
        metadata = cls()
        metadata.next_producer_id = raw["next_producer_id"]
        for name, topic in raw["topics"].items():
            partitions = [PartitionState(**p) for p in topic["partitions"]]
            metadata.topics[name] = TopicState(topic["name"], topic["topic_id"], partitions, topic["config"])
        return metadata


def _check_partition(state: PartitionState, where: str = "new partition") -> None:
    """The invariants of one partition's state (see the module docstring)."""
    replicas = set(state.replicas)
    _check(len(replicas) == len(state.replicas), f"{where}: duplicate replica ids in {state.replicas}")
    _check(set(state.nodes) == {str(r) for r in replicas}, f"{where}: nodes {sorted(state.nodes)} do not match replicas {state.replicas}")
    isr = set(state.isr)
    _check(bool(isr) and len(isr) == len(state.isr), f"{where}: ISR {state.isr} is empty or has duplicates")
    _check(isr <= replicas, f"{where}: ISR {state.isr} is not a subset of the replicas {state.replicas}")
    _check(state.leader is None or state.leader in isr, f"{where}: leader {state.leader} is not in the ISR {state.isr}")


def _check_count(what: str, value: object, error: type[Exception], limit: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{what} must be a positive int, not {value!r}")
    if limit is not None and value > limit:
        raise error(f"{what} must be at most {limit}, not {value}")
