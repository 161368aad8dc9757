"""The ``netns_cluster`` fixture: a Ray cluster whose hosts each have a network namespace and an address (netns.py)."""

from __future__ import annotations

import sys

import pytest

from tests.cluster.netns import NetnsCluster, unavailable_reason

FAILED_MODULES: set[str] = set()  # modules of which a test failed in this run (their cluster's logs are kept)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        FAILED_MODULES.add(item.module.__name__)
    return report


@pytest.fixture(scope="module")
def netns_cluster(request):
    """A Ray head, three replica nodes (8 replica slots each, racks rack-1..3) and a client host, each in a
    network namespace of its own, with token authentication on. One per test module; the finalizer ends
    every process of its namespaces and deletes them, whatever the tests did. If a test of the module
    failed, the cluster's directory (every host's Ray logs) is kept, and its path printed."""
    if reason := unavailable_reason():
        pytest.skip(reason)
    cluster = NetnsCluster(nodes=3)
    try:
        cluster.start()
        yield cluster
    finally:
        if request.module.__name__ in FAILED_MODULES:
            cluster.keep_directory = True
            print(f"\n{request.module.__name__}: a test failed; its cluster's logs are kept in {cluster.directory}",
                  file=sys.__stderr__, flush=True)
        cluster.shutdown()
