"""Shutting the fake autoscaling cluster down leaves no process of it behind, even while its
autoscaler is still starting worker nodes (when Ray's own shutdown orphans them)."""

from __future__ import annotations

import psutil
import pytest
from ray.util.placement_group import placement_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

WORKER_TYPES = {
    "replica-node": {
        "resources": {"CPU": 1, "logbus_replica": 1, "object_store_memory": 100 << 20},
        "max_workers": 3,
    },
}


def test_shutdown_while_scaling_up_leaves_no_process(autoscaling_cluster):
    cluster = autoscaling_cluster(WORKER_TYPES, idle_timeout_s=60.0)
    asked = cluster.mark()
    placement_group([{"logbus_replica": 1}] * 3, strategy="STRICT_SPREAD")  # three nodes, started one by one
    cluster.wait_for_workers(1, timeout_s=180, since=asked)
    processes = cluster.processes()
    raylets = [p for p in processes if p.name() == "raylet"]
    assert len(raylets) >= 2  # the head's and at least one worker node's

    cluster.shutdown()  # raises if it had to kill leftovers

    assert cluster.processes() == []
    assert not [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
