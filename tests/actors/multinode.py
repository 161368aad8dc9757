"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for the tests of
replication, failover and moves: the driver connects to it in place of the suite's shared Ray session."""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

REPLICA_RESOURCE = {"logbus_replica": 16}  # replica slots per node
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    # A removed node's raylet refuses connections at once, so it is declared dead after 5 quick
    # failures (~1.5 s); a raylet that is merely slow (a loaded CI machine) must stay silent for
    # 5 x (0.3 s + 1.5 s) before Ray gives up on it, and with it on every actor it hosts.
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 1500,
    "health_check_failure_threshold": 5,
}

# The head: the driver and the controller. No dashboard: no test reads it, and it is a dozen Python
# processes (its server and a process per module) that cost about 1 CPU-second to start and 0.02 of
# a core while idle, for as long as the cluster lives.
HEAD_NODE_ARGS = {"num_cpus": 2, "include_dashboard": False, "_system_config": SYSTEM_CONFIG}


def start_cluster(replica_nodes: list[dict]) -> Cluster:
    """A head node (the driver and the controller, 2 CPUs) plus one node per entry of ``replica_nodes``
    (``Cluster.add_node`` arguments); this process leaves the Ray it was connected to and joins it."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS)
    for node in replica_nodes:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    try:
        cluster.shutdown()
    except ValueError:  # a stray thread re-attached to the cluster: detach and retry
        ray.shutdown()
        cluster.shutdown()


def live_replica_nodes() -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("logbus_replica"))
