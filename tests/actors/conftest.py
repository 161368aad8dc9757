"""The three-node cluster that the replication, compaction and gateway-failover tests share.

One cluster for all of their modules (starting one takes about 10 s): they run one after another (at
the end of tests/actors in one process, as one unit of work on one pytest-xdist worker: see
``run_order`` and ``SHARED_FIXTURE_MODULES`` in tests/conftest.py). The cluster starts with the first
of their tests and stops after the last, before the next test of any other module (which then gets
the shared Ray session again). Each test gets it with three live replica nodes, whatever an earlier
test removed.
"""

from __future__ import annotations

import os

import pytest

from tests.actors.multinode import REPLICA_RESOURCE, live_replica_nodes, start_cluster, stop_cluster
from tests.conftest import SHARED_FIXTURE_MODULES, TESTS_DIR, wait_for


class ThreeNodes:
    """The cluster (a ``ray.cluster_utils.Cluster``), started on first use, stopped by ``stop``."""

    def __init__(self) -> None:
        self.cluster = None

    def get(self):
        if self.cluster is None:
            self.cluster = start_cluster([{"num_cpus": 1, "resources": REPLICA_RESOURCE}] * 3)
        return self.cluster

    def stop(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            stop_cluster(cluster)


THREE_NODES = ThreeNodes()


@pytest.fixture(scope="package")
def three_node_cluster():
    yield THREE_NODES
    THREE_NODES.stop()


@pytest.fixture
def cluster(three_node_cluster):
    """A head node (driver and controller) plus three live replica nodes; replaces the shared Ray session."""
    nodes = three_node_cluster.get()
    for _ in range(max(0, 3 - live_replica_nodes())):
        nodes.add_node(num_cpus=1, resources=REPLICA_RESOURCE)
    wait_for(lambda: live_replica_nodes() >= 3, timeout_s=120, message="three replica nodes")
    return nodes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown: stop the cluster if the next test (pytest-xdist's next on this worker)
    is of none of its modules, so that the next test never runs on it."""
    result = yield
    following = nextitem and os.path.relpath(str(nextitem.fspath), TESTS_DIR)
    if THREE_NODES.cluster is not None and following not in SHARED_FIXTURE_MODULES["three_node_cluster"]:
        THREE_NODES.stop()
    return result
