"""The Kafka gateway's administration requests: Kafka's admin APIs onto what logbus's controller does.

A mixin of :class:`~logbus.protocol.kafka_gateway.KafkaHandler` (``self.backend``
is its :class:`~logbus.protocol.kafka_gateway.Backend`, ``self.config`` its
broker settings); each method takes a parsed request and returns the values
of its response, every error a code in it. What maps and how:

==========================  ===================================================================
CreatePartitions (37)        ``create_partitions``: a count only (replica assignments are
                             logbus's to choose: INVALID_REPLICA_ASSIGNMENT)
DeleteRecords (21)           the leader moves its log start (``delete_records``); -1 is the
                             high watermark
AlterConfigs (33)            a topic's overrides become exactly those given (Kafka's
                             non-incremental semantics); broker resources are read-only
IncrementalAlterConfigs (44) SET / DELETE per config; APPEND / SUBTRACT on list configs
                             (``cleanup.policy``)
DescribeCluster (60)         the gateways as brokers, as Metadata lists them
DeleteGroups (42)            ``delete_group`` (NON_EMPTY_GROUP while it has members,
                             GROUP_ID_NOT_FOUND for none)
OffsetDelete (47)            a group's committed offsets of partitions of topics it does not
                             subscribe to (GROUP_SUBSCRIBED_TO_TOPIC otherwise)
OffsetForLeaderEpoch (23)    the leader's epoch cache (KIP-101/279), with Kafka's epoch fences
ElectLeaders (43)            preferred elections (``elect_preferred_leaders``); logbus elects
                             unclean leaders on its own, so an unclean election is never needed
                             where a leader exists
DescribeLogDirs (35)         one log directory per broker (the data directory), with the size
                             of each replica on the nodes the gateway answers for
==========================  ===================================================================
"""

from __future__ import annotations

import asyncio
import shutil

from kio.schema.errors import ErrorCode

from logbus import errors as e
from logbus.protocol.group_coordinator import validate_group_id
from logbus.protocol.kafka_messages import UNKNOWN_AUTHORIZED_OPERATIONS, Request, get
from logbus.protocol.messages import TopicPartition
from logbus.storage.log_config import LogConfig

RESOURCE_TOPIC, RESOURCE_BROKER = 2, 4
CONFIG_SET, CONFIG_DELETE, CONFIG_APPEND, CONFIG_SUBTRACT = 0, 1, 2, 3
LIST_CONFIGS = frozenset({"cleanup.policy"})  # configs that are lists (APPEND and SUBTRACT apply)
ELECTION_PREFERRED, ELECTION_UNCLEAN = 0, 1


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:1000]


class AdminRequests:
    """Kafka's admin APIs (see the module docstring); mixed into KafkaHandler."""

    # --- topics -------------------------------------------------------------------------------------

    async def _create_partitions(self, request: Request) -> dict:
        body = request.body

        async def one(topic) -> dict:
            result = {"name": topic.name, "error_code": ErrorCode.none, "error_message": None}
            try:
                if topic.assignments:
                    result.update(error_code=ErrorCode.invalid_replica_assignment,
                                  error_message="replica assignments are logbus's to choose; give a partition count")
                    return result
                view = (await self.backend.topics([topic.name])).get(topic.name)
                if view is None:
                    raise e.UnknownTopicError(f"topic {topic.name!r} does not exist")
                if int(topic.count) <= len(view.partitions):
                    raise e.InvalidPartitionsError(f"topic {topic.name!r} has {len(view.partitions)} partitions; {topic.count} is not more")
                if not body.validate_only:
                    await self.backend.create_partitions(topic.name, int(topic.count))
            except Exception as error:  # noqa: BLE001
                result.update(error_code=self._code(error), error_message=_message(error))
            return result

        names = [t.name for t in body.topics]
        if len(names) != len(set(names)):
            return {"throttle_time": 0, "results": [{"name": n, "error_code": ErrorCode.invalid_request,
                                                     "error_message": "a topic named twice"} for n in names]}
        return {"throttle_time": 0, "results": list(await asyncio.gather(*(one(t) for t in body.topics)))}

    async def _delete_records(self, request: Request) -> dict:
        async def one(topic: str, partition: int, offset: int) -> dict:
            entry = {"partition_index": partition, "low_watermark": -1, "error_code": ErrorCode.none}
            try:
                entry["low_watermark"] = await self.backend.delete_records(topic, partition, offset)
            except Exception as error:  # noqa: BLE001
                entry["error_code"] = self._code(error)
            return entry

        asked = [(t.name, int(p.partition_index), int(p.offset)) for t in request.body.topics for p in t.partitions]
        entries = await asyncio.gather(*(one(*a) for a in asked))
        by_topic: dict[str, list] = {}
        for (topic, _, _), entry in zip(asked, entries):
            by_topic.setdefault(topic, []).append(entry)
        return {"throttle_time": 0, "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]}

    # --- configs --------------------------------------------------------------------------------------

    async def _alter_configs(self, request: Request) -> dict:
        """AlterConfigs: a resource's overrides become exactly the ones given (the others return to their defaults)."""
        body = request.body

        async def one(resource) -> dict:
            entry = {"error_code": ErrorCode.none, "error_message": None, "resource_type": resource.resource_type,
                     "resource_name": resource.resource_name}
            try:
                config = {c.name: c.value for c in resource.configs if c.value is not None}
                nulls = [c.name for c in resource.configs if c.value is None]
                if nulls:
                    raise e.InvalidConfigError(f"no value for {nulls}")
                await self._change_topic_config(resource, config, None, body.validate_only)
            except Exception as error:  # noqa: BLE001
                entry.update(error_code=self._code(error), error_message=_message(error))
            return entry

        return {"throttle_time": 0, "responses": list(await asyncio.gather(*(one(r) for r in body.resources)))}

    async def _incremental_alter_configs(self, request: Request) -> dict:
        body = request.body

        async def one(resource) -> dict:
            entry = {"error_code": ErrorCode.none, "error_message": None, "resource_type": resource.resource_type,
                     "resource_name": resource.resource_name}
            try:
                await self._change_topic_config(resource, None, list(resource.configs), body.validate_only)
            except Exception as error:  # noqa: BLE001
                entry.update(error_code=self._code(error), error_message=_message(error))
            return entry

        return {"throttle_time": 0, "responses": list(await asyncio.gather(*(one(r) for r in body.resources)))}

    async def _change_topic_config(self, resource, replace: dict | None, operations: list | None, validate_only: bool) -> None:
        """A topic's new overrides: ``replace`` (AlterConfigs) or ``operations`` (IncrementalAlterConfigs) applied to the current ones."""
        if resource.resource_type == RESOURCE_BROKER:
            raise e.InvalidConfigError(f"the gateway's broker settings ({', '.join(sorted(self.config.to_dict()))}) are read-only")
        if resource.resource_type != RESOURCE_TOPIC:
            raise e.IllegalStateError(f"resource type {resource.resource_type} has no configs in logbus")
        name = resource.resource_name
        view = (await self.backend.topics([name])).get(name)
        if view is None:
            raise e.UnknownTopicError(f"topic {name!r} does not exist")
        current = {k: str(v) for k, v in view.config.items()}
        if replace is not None:
            target = dict(replace)
        else:
            target = dict(current)
            effective = LogConfig.from_dict(view.config).to_dict()
            seen = set()
            for op in operations:
                if op.name in seen:
                    raise e.InvalidConfigError(f"config {op.name!r} named twice")
                seen.add(op.name)
                if op.name not in LogConfig.KEYS:
                    raise e.InvalidConfigError(f"unknown topic config {op.name!r}")
                if op.config_operation == CONFIG_SET:
                    if op.value is None:
                        raise e.InvalidConfigError(f"SET of {op.name!r} needs a value")
                    target[op.name] = op.value
                elif op.config_operation == CONFIG_DELETE:
                    target.pop(op.name, None)
                elif op.config_operation in (CONFIG_APPEND, CONFIG_SUBTRACT):
                    if op.name not in LIST_CONFIGS:
                        raise e.InvalidConfigError(f"{op.name!r} is not a list config; APPEND and SUBTRACT apply to {sorted(LIST_CONFIGS)}")
                    items = [x for x in str(target.get(op.name, effective[op.name])).split(",") if x]
                    given = [x.strip() for x in (op.value or "").split(",") if x.strip()]
                    if op.config_operation == CONFIG_APPEND:
                        items += [x for x in given if x not in items]
                    else:
                        items = [x for x in items if x not in given]
                    if not items:
                        raise e.InvalidConfigError(f"{op.name!r} cannot become empty")
                    target[op.name] = ",".join(items)
                else:
                    raise e.InvalidConfigError(f"unknown config operation {op.config_operation}")
        LogConfig.from_dict(target)  # every value checked before anything changes
        if validate_only:
            return
        delete = [k for k in current if k not in target]
        changed = {k: v for k, v in target.items() if current.get(k) != str(v)}
        if changed or delete:
            await self.backend.alter_config(name, changed, delete)

    # --- the cluster ----------------------------------------------------------------------------------

    async def _describe_cluster(self, request: Request) -> dict:
        return {
            "throttle_time": 0, "error_code": ErrorCode.none, "error_message": None, "endpoint_type": get(request.body, "endpoint_type", default=1),
            "cluster_id": self.backend.cluster_id, "controller_id": self.backend.broker.broker_id,
            "brokers": [{"broker_id": b.broker_id, "host": b.host, "port": b.port, "rack": None, "is_fenced": False} for b in self.backend.brokers()],
            "cluster_authorized_operations": UNKNOWN_AUTHORIZED_OPERATIONS,
        }

    async def _elect_leaders(self, request: Request) -> dict:
        body = request.body
        election = int(get(body, "election_type", default=ELECTION_PREFERRED))
        asked = None if body.topic_partitions is None else [(t.topic, int(p)) for t in body.topic_partitions for p in t.partitions]
        try:
            views = await self.backend.topics(None if asked is None else sorted({t for t, _ in asked}))
            if asked is None:
                asked = [(name, p) for name, view in views.items() if view is not None for p in range(len(view.partitions))]
            exists = [(t, p) for t, p in asked if views.get(t) is not None and 0 <= p < len(views[t].partitions)]
            moved = set()
            if election == ELECTION_PREFERRED and exists:
                moved = {tuple(tp) for tp in await self.backend.elect_preferred_leaders(exists)}
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": self._code(error), "replica_election_results": []}
        by_topic: dict[str, list] = {}
        for topic, partition in asked:
            view = views.get(topic)
            code, message = ErrorCode.none, None
            if view is None or not 0 <= partition < len(view.partitions):
                code, message = ErrorCode.unknown_topic_or_partition, f"{topic}-{partition} does not exist"
            elif election == ELECTION_UNCLEAN:
                p = view.partitions[partition]
                if p.leader_node is not None:
                    code, message = ErrorCode.election_not_needed, "the partition has a leader"
                else:
                    code, message = ErrorCode.eligible_leaders_not_available, "logbus elects a leader as soon as a replica can lead"
            elif election != ELECTION_PREFERRED:
                code, message = ErrorCode.invalid_request, f"election type {election}"
            elif (topic, partition) not in moved:
                p = view.partitions[partition]
                if p.replica_nodes and p.leader_node == p.replica_nodes[0]:
                    code, message = ErrorCode.election_not_needed, "the preferred replica leads already"
                else:
                    code, message = ErrorCode.preferred_leader_not_available, "the preferred replica is not alive and in sync"
            by_topic.setdefault(topic, []).append({"partition_id": partition, "error_code": code, "error_message": message})
        return {"throttle_time": 0, "error_code": ErrorCode.none,
                "replica_election_results": [{"topic": t, "partition_result": ps} for t, ps in by_topic.items()]}

    async def _describe_log_dirs(self, request: Request) -> dict:
        body = request.body
        try:
            if body.topics is None:
                names = [n for n, v in (await self.backend.topics(None)).items() if v is not None]
                wanted = None
            else:
                names = [t.topic for t in body.topics]
                wanted = {(t.topic, int(p)) for t in body.topics for p in t.partitions}
            data_dir = await self.backend.data_dir()
            statuses = await asyncio.gather(*(self.backend.replica_statuses(n) for n in names), return_exceptions=True)
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": self._code(error), "results": []}
        me = self.backend.broker.broker_id
        topics = []
        for name, found in zip(names, statuses):
            if isinstance(found, BaseException):
                continue
            partitions = []
            for index, replicas in enumerate(found):
                if wanted is not None and (name, index) not in wanted:
                    continue
                for status in replicas:
                    if "error" in status or self.backend.broker_on(status.get("node_id")).broker_id != me:
                        continue
                    lag = max(0, status["high_watermark"] - status["log_end_offset"]) if status["role"] == "leader" else 0
                    partitions.append({"partition_index": index, "partition_size": status["size_bytes"], "offset_lag": lag,
                                       "is_future_key": False})
            if partitions:
                topics.append({"name": name, "partitions": partitions})
        usage = shutil.disk_usage(data_dir) if data_dir else None
        return {"throttle_time": 0, "error_code": ErrorCode.none, "results": [{
            "error_code": ErrorCode.none, "log_dir": data_dir, "topics": topics,
            "total_bytes": usage.total if usage else -1, "usable_bytes": usage.free if usage else -1,
        }]}

    async def _offset_for_leader_epoch(self, request: Request) -> dict:
        async def one(topic: str, p) -> dict:
            entry = {"error_code": ErrorCode.none, "partition": p.partition, "leader_epoch": -1, "end_offset": -1}
            try:
                view = (await self.backend.topics([topic])).get(topic)
                if view is None or not 0 <= p.partition < len(view.partitions):
                    raise e.UnknownTopicError(f"{topic}-{p.partition} does not exist")
                current = int(get(p, "current_leader_epoch", default=-1))
                leader_epoch = view.partitions[p.partition].leader_epoch
                if current >= 0 and current < leader_epoch:
                    entry["error_code"] = ErrorCode.fenced_leader_epoch
                elif current > leader_epoch:
                    entry["error_code"] = ErrorCode.unknown_leader_epoch
                else:
                    entry["leader_epoch"], entry["end_offset"] = await self.backend.end_offset_for_epoch(topic, p.partition, int(p.leader_epoch))
            except Exception as error:  # noqa: BLE001
                entry["error_code"] = self._code(error)
            return entry

        topics = []
        for t in request.body.topics:
            topics.append({"topic": t.topic, "partitions": list(await asyncio.gather(*(one(t.topic, p) for p in t.partitions)))})
        return {"throttle_time": 0, "topics": topics}

    # --- groups ---------------------------------------------------------------------------------------

    async def _delete_groups(self, request: Request) -> dict:
        async def one(group_id: str) -> dict:
            try:
                validate_group_id(group_id)
            except e.InvalidGroupIdError:
                return {"group_id": group_id, "error_code": ErrorCode.invalid_group_id}
            try:
                await self.backend.delete_group(group_id)
            except e.InvalidGroupIdError:
                return {"group_id": group_id, "error_code": ErrorCode.group_id_not_found}
            except Exception as error:  # noqa: BLE001
                return {"group_id": group_id, "error_code": self._code(error)}
            return {"group_id": group_id, "error_code": ErrorCode.none}

        return {"throttle_time": 0, "results": list(await asyncio.gather(*(one(g) for g in request.body.groups_names)))}

    async def _offset_delete(self, request: Request) -> dict:
        body = request.body
        asked = [TopicPartition(t.name, int(p.partition_index)) for t in body.topics for p in t.partitions]
        try:
            validate_group_id(body.group_id)
        except e.InvalidGroupIdError:
            return {"throttle_time": 0, "error_code": ErrorCode.invalid_group_id, "topics": []}
        try:
            results = await self.backend.delete_group_offsets(body.group_id, asked)
        except e.InvalidGroupIdError:
            return {"throttle_time": 0, "error_code": ErrorCode.group_id_not_found, "topics": []}
        except Exception as error:  # noqa: BLE001
            return {"throttle_time": 0, "error_code": self._code(error), "topics": []}
        by_topic: dict[str, list] = {}
        for tp in asked:
            error = results.get(tp)
            by_topic.setdefault(tp.topic, []).append({"partition_index": tp.partition,
                                                      "error_code": ErrorCode.none if error is None else self._code(error)})
        return {"throttle_time": 0, "error_code": ErrorCode.none, "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]}


__all__ = ["AdminRequests", "RESOURCE_BROKER", "RESOURCE_TOPIC"]
