"""Cluster metadata kept by the controller: topics, partitions, replica placement, leaders, epochs.

Pure state with its rules; no Ray and no I/O beyond (de)serialising to JSON.
The controller actor owns one instance, persists it after every change
(:meth:`to_json`), and reloads it on restart (:meth:`from_json`).

Replica ids are per partition: a new partition's replicas have the ids
0 .. replication_factor-1, and every replica added later (a replacement, or
one a reassignment adds) takes the partition's ``next_replica_id``, so an id
is never reused. Replica ``r``'s log lives in
``{data_dir}/replica-{r}/{topic}-{partition}`` on its node; placement maps a
replica id to its node.

A node is named by its logbus node id: a host's identity, kept in its data
directory and advertised as the Ray node label ``logbus.node``
(``storage/node_identity.py``), which outlives the host's Ray nodes; or, for
a node without that label (one machine's Ray nodes, the embedded default),
its Ray node id, which ends with that Ray node. The controller maps each id
to the Ray node carrying it now. The cluster's own id (``cluster_id``) is
made with the metadata and recorded in every host's data directory the
cluster uses, so a directory of another cluster is refused.

A reassignment moves a partition to an ordered list of target nodes (Kafka's
KIP-455): replicas already on a target node stay, the other target nodes get
new replicas (``adding``), and the replicas on no target node (``removing``)
stay until every added replica has joined the ISR; then
:meth:`ClusterMetadata.complete_reassignment` drops them. Meanwhile
``replicas`` lists the target's replicas in target order, then the ones being
removed, so elections prefer the target, and its first replica is the
preferred leader (:meth:`ClusterMetadata.elect_preferred_leader`).

Invariants of every partition, checked after each change (a violation is a
bug and raises InvariantViolationError, ``logbus/invariant.py``; in the controller
it ends the process, which restarts from ``metadata.json``):

- the replica ids are distinct, and the node map has exactly them;
- the ISR is a non-empty subset of the replicas, also while the partition
  has no leader (it keeps the last in-sync members, so a returning one can
  lead without loss);
- a leader is one of the replicas and in the ISR;
- the leader epoch grows by one on every change of leader (to none
  included), and never otherwise;
- a replacement replica gets an id larger than any the partition had, so
  ids are never reused (``next_replica_id`` is larger than every id);
- the replicas being added and removed are replicas, no replica is both, and
  the ones being removed come last.

This class is not thread-safe; the controller serialises access.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field

from logbus.errors import (
    InternalStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidPartitionsError,
    InvalidReassignmentError,
    InvalidReplicationFactorError,
    NodeCapacityError,
    NoReassignmentInProgressError,
    ReassignmentInProgressError,
    TopicAlreadyExistsError,
    UnknownTopicError,
)
from logbus.invariant import check as _check
from logbus.protocol.acl import AclBinding, AclFilter, Authorizer
from logbus.protocol.elections import candidates
from logbus.protocol.placement import NodeLoad, Placer
from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_topic_name
from logbus.storage.node_identity import is_node_id

PARTITIONS_MAX = 10_000  # per topic: each partition replica is a Ray actor (a process)
METADATA_VERSION = 3  # 2: partitions carry adding, removing and next_replica_id; 3: the cluster id
# Version 1 loads with no reassignment in progress and ids derived from the replicas; versions 1 and 2
# get a new cluster id (the controller writes the file again at once: ``upgraded_from``). Their node ids
# are Ray node ids, which stay the identity of nodes without a logbus label.
READABLE_VERSIONS = (1, 2, 3)


@dataclass(slots=True)
class PartitionState:
    replicas: list[int]  # replica ids, the first is the preferred leader; during a reassignment the target's, then the removing
    nodes: dict[str, str]  # replica id (as str, for JSON) -> node id (a logbus node id, or a Ray node id: see above)
    leader: int | None
    leader_epoch: int
    isr: list[int]
    adding: list[int] = field(default_factory=list)  # replicas a reassignment adds (they copy the log, then join the ISR)
    removing: list[int] = field(default_factory=list)  # replicas a reassignment drops when it completes
    next_replica_id: int = -1  # the id the next new replica gets; -1: one past the largest replica id
    throttle_bytes_per_s: int | None = None  # a reassignment's copy limit per new replica (None: unthrottled)

    def __post_init__(self) -> None:
        if self.next_replica_id < 0:
            # Metadata written before ids were counted: a new id was always the largest, so this one is fresh.
            self.next_replica_id = max(self.replicas, default=-1) + 1

    def target(self) -> list[int]:
        """The replicas the partition keeps once its reassignment (if any) completes, preferred leader first."""
        return [r for r in self.replicas if r not in self.removing]

    def reassigning(self) -> bool:
        """Whether a reassignment is in progress."""
        return bool(self.adding or self.removing)

    def _new_replica_id(self) -> int:
        new = self.next_replica_id
        self.next_replica_id += 1
        return new


@dataclass(slots=True)
class TopicState:
    name: str
    topic_id: str
    partitions: list[PartitionState]
    config: dict = field(default_factory=dict)  # overrides, Kafka dotted names

    @property
    def replication_factor(self) -> int:
        """Partition 0's replica count (its target's while it is being reassigned)."""
        return len(self.partitions[0].target()) if self.partitions else 0


class ClusterMetadata:
    """Topics and their partitions' placement and leadership."""

    def __init__(self, cluster_id: str | None = None) -> None:
        self.topics: dict[str, TopicState] = {}
        self.next_producer_id = 0
        self.cluster_id = cluster_id or uuid.uuid4().hex  # recorded in the data directory of every host the cluster uses
        self.upgraded_from: int | None = None  # the version read, when older than METADATA_VERSION
        # user -> SCRAM mechanism -> the stored credential's fields (salt, stored_key, server_key
        # base64; iterations): what the Kafka gateway checks SASL logins against. Never a password.
        self.scram_credentials: dict[str, dict[str, dict]] = {}
        # The Kafka gateway's ACL bindings (AclBinding.to_dict each), and a count of their changes that
        # only grows (gateways reload the bindings when it moves past what they hold).
        self.acls: list[dict] = []
        self.acl_version = 0

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
            # Slots come from the autoscaler through Ray's placement groups, and two hosts claiming one
            # node could both get a bundle: a placement the caller cannot use, not a broken invariant.
            if not (len(placements) == partitions and all(len(set(p)) == len(p) == replication_factor for p in placements)):
                raise NodeCapacityError(
                    f"placements for {name!r} must give {replication_factor} distinct nodes for each of {partitions} partitions, "
                    f"not {placements!r}"
                )
            topic = TopicState(name, uuid.uuid4().hex, [], {key: normalized[key] for key in (config or {})})
            topic.partitions = [self._partition_on(nodes) for nodes in placements]
            self.topics[name] = topic
            return topic
        if replication_factor > len(live_nodes):
            raise InvalidReplicationFactorError(
                f"replication factor {replication_factor} exceeds the {len(live_nodes)} live node(s)"
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
                f"replication factor {topic.replication_factor} exceeds the {len(live_nodes)} live node(s)"
            )
        added = list(range(current, total))
        placements = self._placer(live_nodes, node_limits, loads).place_all(len(added), topic.replication_factor)
        topic.partitions += [self._partition_on(nodes) for nodes in placements]
        return added

    def alter_config(self, name: str, config: dict | None, delete: list[str] | None = None) -> dict:
        """Merge config overrides into a topic's, and remove those named in ``delete`` (back to the
        defaults); return the new overrides.

        Validated first, and an error changes nothing: InvalidConfigError for
        an unknown key in ``delete``, a key both set and deleted, or a
        resulting config LogConfig refuses. Deleting a key the topic does not
        override is no error (it is at its default already).
        """
        topic = self.topic(name)
        removed = list(delete or ())
        for key in removed:
            if key not in LogConfig.KEYS:
                raise InvalidConfigError(f"unknown topic config {key!r}; known: {', '.join(sorted(LogConfig.KEYS))}")
            if key in (config or {}):
                raise InvalidConfigError(f"topic config {key!r} cannot be both set and deleted")
        merged = {**{k: v for k, v in topic.config.items() if k not in removed}, **(config or {})}
        normalized = LogConfig.from_dict(merged).to_dict()
        if LogConfig.from_dict(topic.config).remote_storage_enable:
            before = LogConfig.from_dict(topic.config)
            if not normalized["remote.storage.enable"]:
                # Kafka's rule too (before KIP-950): the tier holds history no local log has any more.
                raise InvalidConfigError(f"topic {name!r} is tiered: remote.storage.enable cannot be turned off")
            for key in ("remote.storage.uri",):
                if normalized[key] != getattr(before, LogConfig.KEYS[key][0]):
                    raise InvalidConfigError(f"topic {name!r} is tiered: {key} cannot change (its history is there)")
        topic.config = {key: normalized[key] for key in merged}
        return topic.config

    def delete_topic(self, name: str) -> TopicState:
        topic = self.topic(name)
        del self.topics[name]
        return topic

    def reassign_dead_nodes(self, live_nodes: list[str]) -> list[tuple[str, int, int]]:
        """Place partitions none of whose replicas is on a live node again; return the (topic, partition, replica) moved.

        Only partitions whose every replica is on a node named by its Ray node
        id (no logbus identity): such a node never comes back, and that
        happens when the whole Ray cluster of one machine was restarted over
        the same data directory (every node id is new), where every node sees
        that directory, so a moved replica finds its log where it left it. A
        partition with a replica on a logbus node id waits for that node: the
        host comes back with its data directory, whatever its Ray node is
        then. A partition with a replica still on a live node is left alone:
        its lost replicas go through election and replacement (a new replica
        id, which copies the log from the leader), never by moving an
        identity onto a node that may already hold another replica of the
        partition.
        """
        moved = []
        if not live_nodes:
            return moved
        live = set(live_nodes)
        for topic in self.topics.values():
            for p, state in enumerate(topic.partitions):
                if any(state.nodes[str(r)] in live or is_node_id(state.nodes[str(r)]) for r in state.replicas):
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
        chosen, unclean = candidates(state.replicas, state.isr, alive, unclean_allowed)
        if not chosen:
            if old is None:
                return False
            state.leader = None
            state.leader_epoch += 1
            _check_partition(state, f"{name}-{partition}")
            return True
        new = chosen[0]
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

        The new id is the partition's ``next_replica_id``, larger than any it
        had, so no id is ever reused. The new replica takes ``dead``'s place
        in ``replicas``, and in a reassignment its role too (one replacing a
        replica being added is being added; one replacing a replica being
        removed is removed when the reassignment completes). ``dead`` leaves
        the ISR; if it led, the partition becomes leaderless and the epoch
        moves on, as for any change of leader. The caller must not replace
        the only in-sync replica (that would lose the committed records), nor
        put the new one on a node that holds another replica of the partition
        (InvariantViolationError, nothing changed: the controller checks both first).
        """
        state = self.topic(name).partitions[partition]
        where = f"{name}-{partition}"
        _check(dead in state.replicas, f"{where}: replica {dead} to replace is not one of {state.replicas}")
        _check(state.isr != [dead], f"{where}: replica {dead} is the only in-sync replica; replacing it loses the partition's data")
        others = {state.nodes[str(r)] for r in state.replicas if r != dead}
        _check(node not in others, f"{where}: node {node} already holds a replica of the partition")
        new = state._new_replica_id()
        state.replicas = [new if r == dead else r for r in state.replicas]
        state.adding = [new if r == dead else r for r in state.adding]
        state.removing = [new if r == dead else r for r in state.removing]
        state.nodes.pop(str(dead), None)
        state.nodes[str(new)] = node
        state.isr = [r for r in state.isr if r != dead]
        if state.leader == dead:
            state.leader = None
            state.leader_epoch += 1
        _check_partition(state, where)
        return new

    # --- reassignment and preferred leaders ----------------------------------------------------

    def partition(self, name: str, partition: int) -> PartitionState:
        """A partition's state; UnknownTopicError, or InvalidPartitionError for a number outside 0..count-1."""
        topic = self.topic(name)
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < len(topic.partitions):
            raise InvalidPartitionError(f"topic {name!r} has partitions 0..{len(topic.partitions) - 1}, not {partition!r}")
        return topic.partitions[partition]

    def start_reassignment(
        self, name: str, partition: int, target_nodes: list[str], live_nodes: list[str], throttle_bytes_per_s: int | None = None
    ) -> list[int]:
        """Start moving a partition to ``target_nodes`` (ordered: the first hosts the preferred leader); return the new replica ids.

        Everything is validated first, and an error changes nothing:
        UnknownTopicError or InvalidPartitionError for a partition that does
        not exist, ReassignmentInProgressError if the partition is already
        being moved, InvalidReassignmentError for an empty target, a node
        named twice or a node not in ``live_nodes``, and
        InvalidReplicationFactorError for a target longer than the live nodes.

        A replica already on a target node keeps its id (and its log); every
        other target node gets a new replica with a fresh id (``adding``), and
        the replicas on no target node are ``removing``. ``replicas`` becomes
        the target's replicas in target order followed by the removing ones;
        the ISR is unchanged: a new replica joins it through the leader's
        :meth:`alter_isr` once it caught up, and then the controller calls
        :meth:`complete_reassignment`. A target with the current nodes only
        reorders ``replicas`` (no data moves) and returns ``[]``.
        """
        state = self.partition(name, partition)
        where = f"{name}-{partition}"
        if state.reassigning():
            raise ReassignmentInProgressError(
                f"{where} is already being reassigned (adding {state.adding}, removing {state.removing}): "
                "cancel it or wait for it to complete"
            )
        _validate_target(where, target_nodes, live_nodes)
        # A target node keeps the replica it holds (the first, should a node hold two); the others get new ones.
        unclaimed = list(state.replicas)
        kept: dict[str, int] = {}
        for node in target_nodes:
            for r in unclaimed:
                if state.nodes[str(r)] == node:
                    kept[node] = r
                    unclaimed.remove(r)
                    break
        if len(kept) == len(target_nodes) and not unclaimed:
            state.replicas = [kept[node] for node in target_nodes]  # the same nodes: at most a new order
            _check_partition(state, where)
            return []
        target: list[int] = []
        added: list[int] = []
        for node in target_nodes:
            if node in kept:
                target.append(kept[node])
            else:
                new = state._new_replica_id()
                state.nodes[str(new)] = node
                target.append(new)
                added.append(new)
        state.replicas = target + unclaimed
        state.adding = added
        state.removing = unclaimed
        state.throttle_bytes_per_s = throttle_bytes_per_s if added else None  # kept with the move: a restarted controller has it
        _check_partition(state, where)
        return list(added)

    def reassignment_ready(self, name: str, partition: int) -> bool:
        """Whether a reassignment in progress may complete: every replica it adds is in the ISR.

        Also the ISR must keep a member once the removing replicas leave it
        (a target of replicas already there, all out of sync, must wait for
        one of them to rejoin; otherwise completing would lose the data).
        False when no reassignment is in progress.
        """
        state = self.partition(name, partition)
        if not state.reassigning():
            return False
        isr = set(state.isr)
        return set(state.adding) <= isr and any(r in isr for r in state.target())

    def complete_reassignment(self, name: str, partition: int) -> tuple[list[int], bool]:
        """Finish a ready reassignment; return (the removed replica ids, whether the leadership changed).

        ``replicas`` becomes the target's replicas in target order; the
        removed ones leave ``replicas``, the ISR and ``nodes`` (the caller
        stops them and deletes their logs). If the leader was removed, the
        first target replica in the ISR leads, at the next epoch. Refused
        (InternalStateError, nothing changed) when no reassignment is in
        progress or it is not :meth:`reassignment_ready`.
        """
        state = self.partition(name, partition)
        where = f"{name}-{partition}"
        if not state.reassigning():
            raise InternalStateError(f"{where}: no reassignment in progress to complete")
        if not self.reassignment_ready(name, partition):
            raise InternalStateError(
                f"{where}: the reassignment is not ready: replicas {state.adding} must all be in the ISR {state.isr}, "
                f"and one of the target {state.target()} must be"
            )
        removed = list(state.removing)
        target = state.target()
        state.replicas = target
        state.isr = [r for r in state.isr if r not in removed]
        for r in removed:
            del state.nodes[str(r)]
        state.adding, state.removing, state.throttle_bytes_per_s = [], [], None
        changed = state.leader in removed
        if changed:
            state.leader = next(r for r in target if r in state.isr)
            state.leader_epoch += 1
        _check_partition(state, where)
        return removed, changed

    def cancel_reassignment(self, name: str, partition: int) -> list[int]:
        """Abandon a reassignment in progress; return the replicas it had added (they leave; the caller deletes them).

        The replicas it was removing stay: ``replicas`` keeps its order
        without the added ones (the target's kept replicas, then the ones
        that were leaving), so the preferred leader may differ from before the
        reassignment (the order before it is not kept). Refused, nothing changed: NoReassignmentInProgressError when none is
        in progress; InvalidReassignmentError when an added replica leads or
        the ISR has no other member (move leadership first).
        """
        state = self.partition(name, partition)
        where = f"{name}-{partition}"
        if not state.reassigning():
            raise NoReassignmentInProgressError(f"{where} is not being reassigned")
        added = list(state.adding)
        if state.leader in added:
            raise InvalidReassignmentError(
                f"{where}: replica {state.leader}, added by the reassignment, leads; move leadership to another replica before cancelling"
            )
        if all(r in added for r in state.isr):
            raise InvalidReassignmentError(
                f"{where}: the ISR {state.isr} has only replicas the reassignment added; cancelling would lose the partition's data"
            )
        state.replicas = [r for r in state.replicas if r not in added]
        state.isr = [r for r in state.isr if r not in added]
        for r in added:
            del state.nodes[str(r)]
        state.adding, state.removing, state.throttle_bytes_per_s = [], [], None
        _check_partition(state, where)
        return added

    def reassignments(self) -> dict[tuple[str, int], dict[str, list]]:
        """Every partition being reassigned: {"target": [node ids, in order], "adding": [ids], "removing": [ids],
        "throttle_bytes_per_s": the copy limit or None}."""
        moving = {}
        for topic in self.topics.values():
            for p, state in enumerate(topic.partitions):
                if state.reassigning():
                    moving[(topic.name, p)] = {
                        "target": [state.nodes[str(r)] for r in state.target()],
                        "adding": list(state.adding),
                        "removing": list(state.removing),
                        "throttle_bytes_per_s": state.throttle_bytes_per_s,
                    }
        return moving

    def elect_preferred_leader(self, name: str, partition: int, alive: set[int]) -> bool:
        """Give the leadership back to the preferred leader (the first replica); True if the leadership changed.

        Only when it is in the ISR and ``alive`` (so it has every committed
        record), and does not lead already. The epoch moves on; the ISR is
        unchanged (the old leader is in sync, not failed).
        """
        state = self.partition(name, partition)
        preferred = state.replicas[0]
        if state.leader == preferred or preferred not in state.isr or preferred not in alive:
            return False
        state.leader = preferred
        state.leader_epoch += 1
        _check_partition(state, f"{name}-{partition}")
        return True

    def allocate_producer_id(self) -> int:
        producer_id = self.next_producer_id
        self.next_producer_id += 1
        return producer_id

    # --- SCRAM credentials --------------------------------------------------------------------

    def scram_credential(self, user: str, mechanism: str) -> dict | None:
        return self.scram_credentials.get(user, {}).get(mechanism)

    def set_scram_credential(self, user: str, mechanism: str, credential: dict) -> None:
        self.scram_credentials.setdefault(user, {})[mechanism] = dict(credential)

    def delete_scram_credential(self, user: str, mechanism: str | None = None) -> bool:
        """Delete one mechanism's credential of ``user`` (every one if None); whether there was one."""
        mechanisms = self.scram_credentials.get(user)
        if not mechanisms or (mechanism is not None and mechanism not in mechanisms):
            return False
        if mechanism is None:
            mechanisms.clear()
        else:
            del mechanisms[mechanism]
        if not mechanisms:
            del self.scram_credentials[user]
        return True

    def scram_users(self) -> dict[str, dict[str, int]]:
        """user -> mechanism -> iterations: what may be shown of the credentials."""
        return {user: {m: c["iterations"] for m, c in mechanisms.items()} for user, mechanisms in self.scram_credentials.items()}

    # --- ACLs ------------------------------------------------------------------------------------

    def acl_bindings(self) -> list[AclBinding]:
        return [AclBinding.of(b) for b in self.acls]

    def create_acls(self, bindings: list[AclBinding]) -> int:
        """Add bindings (one already there stays once); how many were new. InvalidConfigError past the bound."""
        authorizer = Authorizer(self.acl_bindings())
        added = authorizer.add(bindings)
        if added:
            self.acls = [b.to_dict() for b in authorizer.bindings]
            self.acl_version += 1
        return added

    def describe_acls(self, acl_filter: AclFilter) -> list[AclBinding]:
        return Authorizer(self.acl_bindings()).describe(acl_filter)

    def delete_acls(self, filters: list[AclFilter]) -> list[list[AclBinding]]:
        """Delete what each filter matches, in turn; per filter, the bindings it deleted."""
        authorizer = Authorizer(self.acl_bindings())
        deleted = [authorizer.delete(f) for f in filters]
        if any(deleted):
            self.acls = [b.to_dict() for b in authorizer.bindings]
            self.acl_version += 1
        return deleted

    # --- persistence -------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": METADATA_VERSION,
                "cluster_id": self.cluster_id,
                "next_producer_id": self.next_producer_id,
                "topics": {name: asdict(topic) for name, topic in self.topics.items()},
                "scram_credentials": self.scram_credentials,
                "acls": self.acls,
                "acl_version": self.acl_version,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "ClusterMetadata":
        raw = json.loads(text)
        if raw.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"unsupported metadata version {raw.get('version')!r}")
        metadata = cls(raw.get("cluster_id"))
        if raw["version"] < METADATA_VERSION:
            metadata.upgraded_from = raw["version"]
        metadata.next_producer_id = raw["next_producer_id"]
        metadata.scram_credentials = raw.get("scram_credentials", {})  # absent from files written before SASL
        metadata.acls = raw.get("acls", [])  # and these before ACLs
        metadata.acl_version = raw.get("acl_version", 0)
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
    adding, removing = set(state.adding), set(state.removing)
    _check(len(adding) == len(state.adding) and adding <= replicas, f"{where}: adding {state.adding} is not a subset of the replicas {state.replicas}")
    _check(len(removing) == len(state.removing) and removing <= replicas, f"{where}: removing {state.removing} is not a subset of the replicas {state.replicas}")
    _check(state.throttle_bytes_per_s is None or bool(adding), f"{where}: a copy throttle with no replica being added")
    _check(not adding & removing, f"{where}: replicas {sorted(adding & removing)} are both being added and removed")
    _check(
        set(state.replicas[len(state.replicas) - len(removing):]) == removing,
        f"{where}: the replicas being removed {state.removing} do not come last in {state.replicas}",
    )
    _check(state.next_replica_id > max(replicas, default=-1), f"{where}: next replica id {state.next_replica_id} is not above every id in {state.replicas}")


def _validate_target(where: str, target_nodes: list[str], live_nodes: list[str]) -> None:
    """Refuse a reassignment target that is empty, repeats a node, or names a node that is not live."""
    if not isinstance(target_nodes, (list, tuple)) or not all(isinstance(n, str) for n in target_nodes):
        raise InvalidReassignmentError(f"{where}: the target must be a list of node ids, not {target_nodes!r}")
    if not target_nodes:
        raise InvalidReassignmentError(f"{where}: the target names no node; a partition needs at least one replica")
    repeated = sorted({n for n in target_nodes if target_nodes.count(n) > 1})
    if repeated:
        raise InvalidReassignmentError(f"{where}: the target names node(s) {repeated} more than once; a node holds one replica of a partition")
    if len(target_nodes) > len(set(live_nodes)):
        raise InvalidReplicationFactorError(
            f"{where}: a target of {len(target_nodes)} replicas exceeds the {len(set(live_nodes))} live node(s)"
        )
    dead = [n for n in target_nodes if n not in set(live_nodes)]
    if dead:
        raise InvalidReassignmentError(f"{where}: target node(s) {dead} are not live")


def _check_count(what: str, value: object, error: type[Exception], limit: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{what} must be a positive int, not {value!r}")
    if limit is not None and value > limit:
        raise error(f"{what} must be at most {limit}, not {value}")
