"""The fake autoscaling cluster (conftest.py) scales for real: pending actors and placement
groups get new worker nodes of the configured type (with its labels), idle nodes go away."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

IDLE_TIMEOUT_S = 6.0
SCALE_TIMEOUT_S = 180.0  # the machine may be shared and loaded: starting a Ray node can take long
WORKER_TYPES = {
    "replica-node": {
        "resources": {"CPU": 1, "logbus_replica": 4, "object_store_memory": 100 << 20},
        "max_workers": 3,
        "labels": {"logbus.rack": "a"},
    },
}


@ray.remote(num_cpus=0, resources={"logbus_replica": 1})
class Replica:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster(autoscaling_cluster):
    return autoscaling_cluster(WORKER_TYPES, idle_timeout_s=IDLE_TIMEOUT_S)


@pytest.fixture(autouse=True)
def no_workers_at_start(cluster):
    """Each test starts from the head alone (an earlier test's nodes are idle, so they go away)."""
    cluster.wait_for_workers(0, timeout_s=SCALE_TIMEOUT_S)


def test_a_pending_actor_gets_a_new_node_with_its_type_labels(cluster):
    asked = cluster.mark()
    replica = Replica.remote()
    try:
        cluster.wait_for_workers(1, timeout_s=SCALE_TIMEOUT_S, since=asked)
        node_id = ray.get(replica.node_id.remote(), timeout=SCALE_TIMEOUT_S)
        assert node_id in cluster.node_ids()
        assert node_id != cluster.head_node_id
        (node,) = [node for node in cluster.worker_nodes() if node["NodeID"] == node_id]
        assert node["Labels"]["logbus.rack"] == "a"
        assert node["Resources"]["logbus_replica"] == 4
    finally:
        ray.kill(replica)


def test_a_strict_spread_placement_group_gets_distinct_new_nodes(cluster):
    asked = cluster.mark()
    group = placement_group([{"logbus_replica": 1}] * 2, strategy="STRICT_SPREAD")
    try:
        cluster.wait_for_workers(2, timeout_s=SCALE_TIMEOUT_S, since=asked)
        ray.get(group.ready(), timeout=SCALE_TIMEOUT_S)
        nodes = placement_group_table(group)["bundles_to_node_id"]
        assert len(nodes) == 2
        assert len(set(nodes.values())) == 2
        assert set(nodes.values()) <= set(cluster.node_ids())
    finally:
        remove_placement_group(group)


def test_idle_nodes_go_away_once_actors_and_groups_are_removed(cluster):
    asked = cluster.mark()
    replica = Replica.remote()
    group = placement_group([{"logbus_replica": 1}] * 2, strategy="STRICT_SPREAD")
    cluster.wait_for_workers(2, timeout_s=SCALE_TIMEOUT_S, since=asked)
    ray.get(group.ready(), timeout=SCALE_TIMEOUT_S)
    ray.get(replica.node_id.remote(), timeout=SCALE_TIMEOUT_S)

    used = cluster.node_ids()
    released = cluster.mark()
    ray.kill(replica)
    remove_placement_group(group)
    cluster.wait_for_workers(0, timeout_s=SCALE_TIMEOUT_S, since=released)
    # Each went for being idle (past idle_timeout_s), as the autoscaler's log says of each node it ends.
    assert cluster.termination_reasons(used) == {node_id: ["idle"] for node_id in used}
    # The autoscaler may start one node more than needed while others are still starting.
    up, down = cluster.scale_events[-2:]
    assert up.from_workers == 0 and up.to_workers >= 2
    assert down.from_workers >= 2 and down.to_workers == 0
