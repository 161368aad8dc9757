"""The ``autoscaling_cluster`` fixture: a fake autoscaling Ray cluster of the module's own (see fake_cluster.py)."""

from __future__ import annotations

import pytest

from tests.autoscaler.fake_cluster import FakeAutoscalingCluster


@pytest.fixture(scope="module")
def autoscaling_cluster(tmp_path_factory):
    """A factory: ``autoscaling_cluster(worker_types, idle_timeout_s=6.0, **options)`` starts a
    ``FakeAutoscalingCluster`` (see its parameters) and connects this process to it.

    One cluster at a time (Ray allows one connection per process): starting another shuts the
    previous one down; the last is shut down at the end of the module.
    """
    current: list[FakeAutoscalingCluster] = []

    def shutdown_current():
        while current:
            current.pop().shutdown()

    def start(worker_types: dict[str, dict], idle_timeout_s: float = 6.0, **options) -> FakeAutoscalingCluster:
        shutdown_current()
        cluster = FakeAutoscalingCluster(worker_types, idle_timeout_s, tmp_path_factory.mktemp("autoscaler"), **options)
        current.append(cluster)  # before start(): a half-started cluster is shut down too
        return cluster.start()

    yield start
    shutdown_current()
