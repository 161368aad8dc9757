"""Admin: topic management, validated on the caller's side before any remote call."""

from __future__ import annotations

import datetime

from logbus.actors.controller import CREATE_TIMEOUT_S
from logbus.actors.remote import CONTROL_TIMEOUT_S, get
from logbus.options import check_int, check_seconds
from logbus.protocol.group_coordinator import validate_group_id
from logbus.errors import (
    InvalidConfigError,
    LogbusError,
    InvalidPartitionsError,
    InvalidReassignmentError,
    InvalidReplicationFactorError,
    OffsetOutOfRangeError,
)
from logbus.protocol.cluster_metadata import PARTITIONS_MAX
from logbus.protocol.messages import TopicDescription, TopicPartition
from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_partition, validate_topic_name

TIER_STATUS_TIMEOUT_S = 10.0  # describe_tier waits this long for each partition's leader

RESET_TARGETS = ("earliest", "latest")
CONFIG_SOURCES = ("default", "topic")  # where a topic config's value comes from (describe_configs)


def _seconds(what: str, value) -> float:
    return check_seconds(what, value, positive=True)


def _positive(what: str, value, error, limit: int | None = None):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{what} must be a positive int, not {value!r}")
    if limit is not None and value > limit:
        raise error(f"{what} must be at most {limit}, not {value}")
    return value


def _check_reset_target(to) -> None:
    """Raise unless ``to`` is "earliest", "latest", an offset, or {"timestamp": ms} (the controller's spellings)."""
    if isinstance(to, dict) and set(to) == {"timestamp"}:
        to = to["timestamp"]
        if isinstance(to, bool) or not isinstance(to, int):
            raise InvalidConfigError(f"reset to timestamp must be an int of ms, not {to!r}")
    elif isinstance(to, str):
        if to not in RESET_TARGETS:
            raise InvalidConfigError(f"reset to must be 'earliest', 'latest', an offset or a datetime, not {to!r}")
    elif isinstance(to, int) and not isinstance(to, bool):
        if to < 0:
            raise OffsetOutOfRangeError(f"reset to offset must be non-negative, not {to}")
    else:
        raise InvalidConfigError(f"reset to must be 'earliest', 'latest', an offset or a datetime, not {to!r}")


class Admin:
    """Create, delete, list, describe and alter topics (``bus.admin``)."""

    def __init__(self, bus) -> None:
        self._bus = bus

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication_factor: int = 1,
        config: dict | None = None,
        timeout_s: float = CREATE_TIMEOUT_S,
    ) -> TopicDescription:
        """Create a topic; its replica actors are started, and serve, before this returns.

        Replicas go to the least loaded nodes, one per rack while racks last.
        When the nodes cannot hold the topic and a Ray autoscaler may add nodes
        with replica slots (``logbus_replica``), the replicas become pending
        demand it answers, and this waits up to ``timeout_s`` for them.

        Raises InvalidTopicError, TopicAlreadyExistsError, InvalidPartitionsError,
        InvalidReplicationFactorError (more replicas than nodes, no autoscaler),
        NodeCapacityError (no replica slots left, no autoscaler; or it did not
        add nodes in time) or InvalidConfigError.
        """
        validate_topic_name(name)
        _positive("partitions", partitions, InvalidPartitionsError, PARTITIONS_MAX)
        _positive("replication_factor", replication_factor, InvalidReplicationFactorError)
        _seconds("timeout_s", timeout_s)
        LogConfig.from_dict(config)
        self._bus.forget(name)
        reply = self._bus.controller.create_topic.remote(name, partitions, replication_factor, config, float(timeout_s))
        return get(reply, timeout_s=timeout_s + CONTROL_TIMEOUT_S)

    def delete_topic(self, name: str) -> None:
        """Delete a topic: its replica actors stop and its files are removed."""
        validate_topic_name(name)
        self._bus.forget(name)
        get(self._bus.controller.delete_topic.remote(name))

    def list_topics(self) -> list[str]:
        return get(self._bus.controller.list_topics.remote())

    def describe_topic(self, name: str) -> TopicDescription:
        """Partitions with leader, replicas, isr, leader_epoch, log_start_offset and high_watermark."""
        validate_topic_name(name)
        return get(self._bus.controller.describe_topic.remote(name))

    def describe_tier(self, name: str) -> dict[int, dict | None]:
        """A tiered topic's remote tier, per partition, as its leader sees it: ``uri``,
        ``log_start_offset`` (the tier's first offset), ``uploaded_up_to`` (the offset after the last
        one uploaded), ``files``, ``remote_bytes``, ``local_bytes``, ``upload_lag_bytes`` (local bytes
        not yet uploaded, the active segment's included), ``uploads`` (files this leader uploaded),
        ``iceberg_table`` and ``iceberg_synced``. None for a partition whose topic is not tiered (or
        whose leader has not opened its tier yet), that has no leader now, or whose leader does not
        answer within TIER_STATUS_TIMEOUT_S (a dead node: the other partitions are still shown)."""
        validate_topic_name(name)
        leaders = self._bus.topic_metadata(name, refresh=True).leaders
        refs = {p: leader.tier_status.remote() for p, leader in enumerate(leaders) if leader is not None}

        def status(p: int) -> dict | None:
            if p not in refs:
                return None
            try:
                return get(refs[p], timeout_s=TIER_STATUS_TIMEOUT_S)
            except LogbusError as error:
                if not error.retriable:
                    raise
                return None

        return {p: status(p) for p in range(len(leaders))}

    def delete_records(self, offsets: dict) -> dict[TopicPartition, int]:
        """Kafka's DeleteRecords: ``{TopicPartition: offset}`` makes each ``offset`` (-1: the
        partition's high watermark) the partition's log start offset; returns the new log start
        offsets.

        Records below it can no longer be read: a consumer whose position is
        below it gets its ``auto_offset_reset`` ("earliest" then means the new
        start). Whole segments below it are deleted; followers follow their
        leader's log start. An offset at or below the current log start changes
        nothing. Raises OffsetOutOfRangeError for an offset past the high
        watermark (or below -1), UnknownTopicError for an unknown topic and
        InvalidPartitionError for a partition the topic does not have.
        """
        if not isinstance(offsets, dict) or not offsets:
            raise InvalidConfigError("offsets must be a non-empty {TopicPartition: offset} dict")
        checked = {}
        for tp, offset in offsets.items():
            if not isinstance(tp, tuple) or len(tp) != 2:
                raise InvalidConfigError(f"expected a TopicPartition(topic, partition), not {tp!r}")
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < -1:
                raise OffsetOutOfRangeError(f"the offset to delete records below for {tp} must be an int >= 0 (or -1), not {offset!r}")
            checked[TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))] = offset
        starts = get(self._bus.controller.delete_records.remote(checked))
        return {TopicPartition(*tp): start for tp, start in starts.items()}

    def describe_configs(self, name: str) -> dict[str, dict]:
        """Every topic config (Kafka's dotted names) of topic ``name``: ``{name: {"value": value,
        "source": "default" | "topic"}}``; "topic" for the overrides set on the topic."""
        validate_topic_name(name)
        overrides = get(self._bus.controller.topic_metadata.remote(name))["config"]
        values = LogConfig.from_dict(overrides).to_dict()
        return {key: {"value": value, "source": CONFIG_SOURCES[key in overrides]} for key, value in values.items()}

    def create_partitions(self, name: str, total: int) -> TopicDescription:
        """Grow a topic to ``total`` partitions (keys may then map to other partitions, as in Kafka)."""
        validate_topic_name(name)
        _positive("total", total, InvalidPartitionsError, PARTITIONS_MAX)
        self._bus.forget(name)
        return get(self._bus.controller.create_partitions.remote(name, total))

    # --- consumer groups ---------------------------------------------------------------------------

    def list_groups(self) -> list[tuple[str, str, str | None]]:
        """(group id, state, assignment strategy) of every group with members or committed offsets."""
        return [tuple(g) for g in get(self._bus.controller.list_groups.remote())]

    def describe_group(self, group_id: str) -> dict:
        """State, members with their assignments, and per partition the committed offset,
        log end offset (the high watermark), lag and owning member (Kafka's columns)."""
        validate_group_id(group_id)
        return get(self._bus.controller.describe_group.remote(group_id))

    def create_scram_user(self, name: str, password: str, mechanism: str = "SCRAM-SHA-512", iterations: int = 4096) -> None:
        """Let ``name`` authenticate to the Kafka gateway's SASL (SCRAM ``mechanism``, and PLAIN) with ``password``.

        The password is salted and hashed here (PBKDF2, ``iterations`` rounds,
        4096..16384); only the salted credential reaches the cluster, kept in
        the controller's metadata. Setting a user's credential again replaces
        it (connections already authenticated stay so). Raises
        InvalidConfigError for an unknown mechanism, an empty password or a
        bad user name.
        """
        from logbus.protocol.scram import check_user_name, make_credential

        check_user_name(name)
        credential = make_credential(mechanism, password, iterations=iterations)
        get(self._bus.controller.alter_scram_credentials.remote([(name, mechanism, credential.to_dict())], []))

    def delete_scram_user(self, name: str, mechanism: str | None = None) -> bool:
        """Remove ``name``'s SCRAM credential for ``mechanism`` (every one if None); whether there was one."""
        from logbus.protocol.scram import MECHANISMS, check_user_name

        check_user_name(name)
        if mechanism is not None and mechanism not in MECHANISMS:
            raise InvalidConfigError(f"SCRAM mechanism must be one of {sorted(MECHANISMS)}, not {mechanism!r}")
        [found] = get(self._bus.controller.alter_scram_credentials.remote([], [(name, mechanism)]))
        return found

    def list_scram_users(self) -> dict[str, dict[str, int]]:
        """``{user: {mechanism: iterations}}`` of every SCRAM credential (never the credentials themselves)."""
        return get(self._bus.controller.scram_users.remote())

    # --- ACLs (the Kafka gateway's authorizer) ------------------------------------------------------

    def create_acls(self, bindings) -> int:
        """Add ACL bindings for the Kafka gateway (Kafka's ``CreateAcls``); how many were new.

        Each binding is a :class:`logbus.AclBinding` or a dict of Kafka's
        fields in lower case: ``principal`` ("User:alice", or "User:*"),
        ``host`` (default "*"), ``resource_type`` ("topic", "group",
        "cluster", "transactional_id"), ``name`` ("kafka-cluster" for the
        cluster; "*" for every resource of the type), ``pattern`` ("literal",
        the default, or "prefixed"), ``operation`` ("read", "write",
        "create", "delete", "alter", "describe", "cluster_action",
        "describe_configs", "alter_configs", "idempotent_write", or "all",
        the default) and ``permission`` ("allow", the default, or "deny").
        All are checked before any is stored (InvalidConfigError names the
        bad one); a binding already there is kept once. Durable (the
        controller's metadata) and in force at every running gateway before
        this returns. Gateways check them when SASL is on (or ``acls=True``);
        see ``Bus.start_gateway``.
        """
        from logbus.actors.gateway import acls_changed
        from logbus.protocol.acl import AclBinding

        if isinstance(bindings, (dict, AclBinding)):
            bindings = [bindings]
        parsed = [AclBinding.of(b) for b in bindings]
        added = get(self._bus.controller.create_acls.remote([b.to_dict() for b in parsed]))
        if added:
            acls_changed(self._bus.namespace)
        return added

    def describe_acls(self, filter=None) -> list:
        """The ACL bindings (:class:`logbus.AclBinding`) a filter matches (Kafka's ``DescribeAcls``): a
        :class:`logbus.AclFilter` or a dict of the binding fields to match, each absent or "any" matching
        every value, and ``pattern="match"`` with a ``name`` giving the bindings that apply to that
        resource (literal, "*" and prefixes). None: every binding."""
        from logbus.protocol.acl import AclBinding, AclFilter

        found = get(self._bus.controller.describe_acls.remote(AclFilter.of(filter).to_dict()))
        return [AclBinding.of(b) for b in found]

    def delete_acls(self, filters) -> list[list]:
        """Delete the ACL bindings each filter matches (Kafka's ``DeleteAcls``; filters as ``describe_acls``
        takes them, one or a list); per filter, the bindings it deleted. In force at every running gateway
        before this returns."""
        from logbus.actors.gateway import acls_changed
        from logbus.protocol.acl import AclBinding, AclFilter

        if filters is None or isinstance(filters, (dict, AclFilter)):
            filters = [filters]
        parsed = [AclFilter.of(f) for f in filters]
        deleted = get(self._bus.controller.delete_acls.remote([f.to_dict() for f in parsed]))
        if any(deleted):
            acls_changed(self._bus.namespace)
        return [[AclBinding.of(b) for b in found] for found in deleted]

    def delete_group(self, group_id: str) -> list[TopicPartition]:
        """Delete an inactive consumer group: its state and its committed offsets (tombstones in
        ``__consumer_offsets``, which compaction then removes). Returns the partitions whose
        committed offsets were deleted.

        Raises GroupNotEmptyError while the group has members (stop its
        consumers first), InvalidGroupIdError if there is no such group.
        """
        validate_group_id(group_id)
        return [TopicPartition(*tp) for tp in get(self._bus.controller.delete_group.remote(group_id))]

    def reset_offsets(self, group_id: str, to="earliest", topics: list[str] | None = None) -> dict:
        """Reset an inactive group's committed offsets to "earliest", "latest", an offset, or a datetime.

        Applies to every partition of ``topics``, or to the partitions the group
        has committed. Raises GroupNotEmptyError while the group has members.
        """
        validate_group_id(group_id)
        if isinstance(to, datetime.datetime):
            to = {"timestamp": int(to.timestamp() * 1000)}
        _check_reset_target(to)
        if topics is not None:
            if isinstance(topics, str) or not isinstance(topics, list | tuple | set | frozenset):
                raise InvalidConfigError(f"topics must be a list of topic names or None, not {topics!r}")
            for topic in topics:
                validate_topic_name(topic)
        return get(self._bus.controller.reset_offsets.remote(group_id, to, list(topics) if topics else None))

    def alter_config(self, name: str, config: dict | None = None, delete: list[str] | None = None) -> dict:
        """Change topic config overrides (Kafka's dotted names), and remove the overrides named in
        ``delete`` (their defaults apply again); returns the topic's overrides."""
        validate_topic_name(name)
        LogConfig.from_dict(config)
        if delete is not None:
            if isinstance(delete, str) or not isinstance(delete, list | tuple | set | frozenset):
                raise InvalidConfigError(f"delete must be a list of topic config names, not {delete!r}")
            for key in delete:
                if key not in LogConfig.KEYS:
                    raise InvalidConfigError(f"unknown topic config {key!r}; known: {', '.join(sorted(LogConfig.KEYS))}")
                if key in (config or {}):
                    raise InvalidConfigError(f"topic config {key!r} cannot be both set and deleted")
        self._bus.forget(name)
        return get(self._bus.controller.alter_config.remote(name, config or {}, list(delete or ())))

    # --- nodes: moving replicas --------------------------------------------------------------------

    def nodes(self) -> list[dict]:
        """Every node that may host replicas: replicas, leaders, max.replicas.per.node, alive, draining."""
        return get(self._bus.controller.nodes.remote())

    def reassign_partitions(self, assignments: dict, throttle_bytes_per_s: int | None = None) -> list[dict]:
        """Move partitions to other nodes: ``{TopicPartition: [node_id, ...]}``, the first node hosting
        the preferred leader (Kafka's kafka-reassign-partitions).

        New replicas copy the log from the leader, at most ``throttle_bytes_per_s``
        each when given, and join the ISR; only then are the old replicas
        removed (their files deleted) and, if the leader was one of them,
        leadership moved. Producers and consumers keep running; nothing
        acknowledged is lost. Returns :meth:`describe_reassignments`. Raises
        InvalidReassignmentError (unknown or duplicate nodes),
        InvalidReplicationFactorError (more replicas than nodes) or
        ReassignmentInProgressError, and then nothing changed.
        """
        if not isinstance(assignments, dict) or not assignments:
            raise InvalidReassignmentError("assignments must be a non-empty {TopicPartition: [node ids]} dict")
        checked = {}
        for tp, nodes in assignments.items():
            if not isinstance(tp, tuple) or len(tp) != 2:
                raise InvalidReassignmentError(f"expected a TopicPartition(topic, partition), not {tp!r}")
            validate_topic_name(tp[0])
            if isinstance(nodes, str) or not isinstance(nodes, list | tuple) or not all(isinstance(n, str) and n for n in nodes):
                raise InvalidReassignmentError(f"the target of {tp} must be a list of node ids, not {nodes!r}")
            checked[(tp[0], validate_partition(tp[1]))] = list(nodes)
        _throttle(throttle_bytes_per_s)
        for topic in {t for t, _ in checked}:
            self._bus.forget(topic)
        return get(self._bus.controller.reassign_partitions.remote(checked, throttle_bytes_per_s))

    def describe_reassignments(self) -> list[dict]:
        """Partitions being moved: target nodes, replicas being added and removed, and how far each new one has copied."""
        return get(self._bus.controller.describe_reassignments.remote())

    def cancel_reassignments(self, partitions) -> list:
        """Abandon the reassignments of ``partitions`` (TopicPartitions): new replicas go, old ones stay."""
        tps = [(validate_topic_name(tp[0]), validate_partition(tp[1])) for tp in partitions]
        return get(self._bus.controller.cancel_reassignments.remote(tps))

    def drain_node(self, node_id: str, throttle_bytes_per_s: int | None = None, timeout_s: float = CREATE_TIMEOUT_S) -> dict:
        """Move every replica and leadership off ``node_id`` (reassignments, as above), so that it becomes
        idle and a Ray autoscaler may remove it. New replicas are no longer placed there.

        If a partition has no other node to go to and an autoscaler may add
        nodes with replica slots, one is asked for and waited for up to
        ``timeout_s``; otherwise NodeCapacityError. The moves then proceed in
        the background (:meth:`describe_reassignments`).
        """
        if not isinstance(node_id, str) or not node_id:
            raise InvalidReassignmentError(f"node_id must be a Ray node id, not {node_id!r}")
        _throttle(throttle_bytes_per_s)
        _seconds("timeout_s", timeout_s)
        reply = self._bus.controller.drain_node.remote(node_id, throttle_bytes_per_s, float(timeout_s))
        return get(reply, timeout_s=timeout_s + CONTROL_TIMEOUT_S)

    def rebalance(self, throttle_bytes_per_s: int | None = None) -> dict:
        """Spread replicas evenly over the live nodes (onto nodes just added, say), with as few moves as possible."""
        _throttle(throttle_bytes_per_s)
        return get(self._bus.controller.rebalance.remote(throttle_bytes_per_s))

    def elect_preferred_leaders(self, topics: list[str] | None = None) -> list:
        """Give leadership back to each partition's preferred leader (its first replica) where it is in sync.

        The controller also does this every 5 minutes; after failovers, leaders spread evenly again.
        """
        if topics is not None:
            topics = [validate_topic_name(t) for t in topics]
        return get(self._bus.controller.elect_preferred_leaders.remote(topics))


def _throttle(value) -> None:
    check_int("throttle_bytes_per_s", value, none_ok=True, unit="bytes per second")
