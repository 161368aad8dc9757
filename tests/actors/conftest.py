"""The three-node cluster that the replication, compaction and gateway-failover tests share.

One cluster for all of their modules (starting one takes about 10 s): the suite runs those modules
one after another, at the end of tests/actors (see ``run_order`` in tests/conftest.py), and the
cluster ends with the package. Each test gets it with three live replica nodes, whatever an earlier
test removed.
"""

from __future__ import annotations

import pytest

from tests.actors.multinode import REPLICA_RESOURCE, live_replica_nodes, start_cluster, stop_cluster
from tests.conftest import wait_for


@pytest.fixture(scope="package")
def three_node_cluster():
    cluster = start_cluster([{"num_cpus": 1, "resources": REPLICA_RESOURCE}] * 3)
    yield cluster
    stop_cluster(cluster)


@pytest.fixture
def cluster(three_node_cluster):
    """A head node (driver and controller) plus three live replica nodes; replaces the shared Ray session."""
    for _ in range(max(0, 3 - live_replica_nodes())):
        three_node_cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE)
    wait_for(lambda: live_replica_nodes() >= 3, timeout_s=120, message="three replica nodes")
    return three_node_cluster
