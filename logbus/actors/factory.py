"""The one place where ``ray.remote`` is applied: every actor option of logbus is listed here.

The actor classes are plain Python classes (testable without Ray); these
factories turn them into named actors.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from logbus.actors.controller import Controller
from logbus.actors.partition_replica import PartitionReplica

CONTROLLER_NAME = "logbus-controller"


def replica_actor_name(topic: str, topic_id: str, partition: int, replica_id: int) -> str:
    # The topic id keeps a re-created topic's actors apart from a deleted one's.
    return f"logbus-replica:{topic}:{partition}:{replica_id}:{topic_id[:12]}"


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives this resource to the head node only


def controller(namespace: str, data_dir: str, replica_replacement_ms: int | None = None):
    """Get or create the cluster's controller: detached, named, restarted forever by Ray.

    It runs on the head node, where its metadata directory lives, and where
    Ray restarts it after a crash. It must not share a fate with a replica
    node: the head's death ends the Ray cluster anyway (GCS lives there).
    """
    options = {} if replica_replacement_ms is None else {"replica_replacement_ms": replica_replacement_ms}
    return (
        ray.remote(Controller)
        .options(
            name=CONTROLLER_NAME,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,  # callers retry; every controller method is idempotent
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
            max_concurrency=1000,
        )
        .remote(data_dir, namespace, **options)
    )


def partition_replica(
    *,
    namespace: str,
    topic: str,
    topic_id: str,
    partition: int,
    replica_id: int,
    node_id: str,
    directory: str,
    config: dict,
    leader_epoch: int,
):
    """Get or create one partition replica actor, pinned to its node (it owns a directory there)."""
    return (
        ray.remote(PartitionReplica)
        .options(
            name=replica_actor_name(topic, topic_id, partition, replica_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,  # rebuilt from its files by the constructor
            max_task_retries=0,  # a produce must not be replayed behind the producer's back
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        )
        .remote(topic, partition, replica_id, directory, config, leader_epoch, namespace, CONTROLLER_NAME)
    )
