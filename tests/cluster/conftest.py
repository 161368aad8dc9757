"""The ``netns_cluster`` fixture: a Ray cluster whose hosts each have a network namespace and an address (netns.py)."""

from __future__ import annotations

import pytest

from tests.cluster.netns import NetnsCluster, unavailable_reason


@pytest.fixture(scope="module")
def netns_cluster():
    """A Ray head, three replica nodes (8 replica slots each, racks rack-1..3) and a client host, each in a
    network namespace of its own, with token authentication on. One per test module; the finalizer ends
    every process of its namespaces and deletes them, whatever the tests did."""
    if reason := unavailable_reason():
        pytest.skip(reason)
    cluster = NetnsCluster(nodes=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()
