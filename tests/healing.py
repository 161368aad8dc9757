"""After a fault: the check every fault test ends with, that the cluster healed.

Every partition gets a leader that serves as one (the controller elects within
the lease plus a second, LEADERLESS_LIMIT_MS; waited for here with a generous
bound, never timed) with every replica back in sync, and a fresh consumer
reads every partition from its log start to its end.
"""

from __future__ import annotations

import time

import ray

import logbus
from logbus import TopicPartition
from logbus.actors.controller import CONTROLLER_NAME
from tests.conftest import wait_for

HEAL_TIMEOUT_S = 120.0  # generous: a loaded machine restarts processes slowly; the bound is not the target


def leaders_serving(bus, topic: str) -> list | None:
    """Each partition's (leader id, epoch) once every partition has a leader that says it leads at the
    controller's epoch with every replica in sync (the controller's ISR and the leader's own); None
    while some partition has no leader or is short of a replica."""
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
        partitions = ray.get(controller.topic_metadata.remote(topic), timeout=30)["partitions"]
        described = ray.get(controller.describe_topic.remote(topic), timeout=30).partitions
    except (ray.exceptions.RayError, ValueError):
        return None  # the controller is restarting
    found = []
    for partition, info in zip(partitions, described):
        handle, epoch = partition["leader"], partition["leader_epoch"]
        if handle is None or info.leader_epoch != epoch or set(info.isr) != set(info.replicas):
            return None
        try:
            status = ray.get(handle.status.remote(), timeout=5)
        except ray.exceptions.RayError:
            return None
        if status.get("role") != "leader" or status.get("leader_epoch") != epoch:
            return None
        if set(status.get("isr") or ()) != set(info.replicas):
            return None
        found.append((status["replica_id"], epoch))
    return found


def assert_healed(bus, topic: str, timeout_s: float = HEAL_TIMEOUT_S) -> dict[int, int]:
    """Every partition of ``topic`` has a serving leader, and a fresh consumer reads each one from its
    log start to its end; returns the records read per partition."""
    wait_for(lambda: leaders_serving(bus, topic), timeout_s=timeout_s, interval_s=0.1,
             message=f"a serving leader and a full ISR for every partition of {topic}")
    count = bus.topic_metadata(topic, refresh=True).partition_count
    tps = [TopicPartition(topic, p) for p in range(count)]
    consumer = logbus.Consumer(bus)
    try:
        consumer.assign(tps)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(tps)
        read = {tp.partition: 0 for tp in tps}
        deadline = time.monotonic() + timeout_s

        def at_end():
            table = consumer.poll_arrow(timeout_ms=500)
            if table.num_rows:
                for p in table["partition"].to_pylist():
                    read[p] += 1
            return all(consumer.position(tp) >= ends[tp] for tp in tps)

        wait_for(at_end, timeout_s=max(1.0, deadline - time.monotonic()), interval_s=0, message=f"a fresh consumer at the end of {topic}")
    finally:
        consumer.close()
    return read
