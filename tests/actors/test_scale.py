"""Costs that must not grow with replicas: the controller's steady-state calls, and a node's replica limit.

Real Ray actors on the test session's single node.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import ray

import logbus
from logbus.actors.lease_files import NodeLease, node_directory
from logbus.actors.node_agent import agent_actor_name
from logbus.actors.remote import get
from logbus.clock import monotonic_ms
from logbus.errors import NodeCapacityError
from logbus.storage import encode_batch
from tests.conftest import close_bus, wait_for
from tests.healing import assert_healed

# Each test counts the controller's calls and heartbeat links from its start, and stops the controller:
# a cluster of its own each (counters a shared one carried over passed a wait before its heartbeats came).
pytestmark = pytest.mark.own_bus

WINDOW_HEARTBEATS = 15  # a window of this many node heartbeats (5 a second: 3 s on an idle machine)


def call_counts(bus) -> dict[str, int]:
    return ray.get(bus.controller.call_counts.remote(), timeout=60)


def calls_in_window(bus) -> dict[str, int]:
    """The controller's calls while the node's agent sends WINDOW_HEARTBEATS heartbeats over its link:
    a window counted in heartbeats, which a loaded machine stretches along with everything else."""
    before = call_counts(bus)
    wait_for(lambda: call_counts(bus).get("node_heartbeat_link", 0) >= before.get("node_heartbeat_link", 0) + WINDOW_HEARTBEATS,
             timeout_s=120, interval_s=0.1, message=f"{WINDOW_HEARTBEATS} heartbeats over the link")
    after = call_counts(bus)
    return {name: after.get(name, 0) - before.get(name, 0) for name in after}


def test_an_idle_topic_of_8_partitions_adds_no_calls_to_the_controller(bus, topic_name):
    """Steady state: the node agent's heartbeats (per node, over the agent's socket, heartbeat_link.py)
    and nothing per replica, with one partition as with eight."""
    bus.admin.create_topic(topic_name + "-one", partitions=1)
    wait_for(lambda: call_counts(bus).get("replica_started", 0) >= 1, timeout_s=60, message="the replica said it started")
    one = calls_in_window(bus)
    bus.admin.create_topic(topic_name + "-many", partitions=8)
    wait_for(lambda: call_counts(bus).get("replica_started", 0) >= 9, timeout_s=120, message="every replica said it started")
    many = calls_in_window(bus)
    for window in (one, many):
        assert {name: count for name, count in window.items() if count and name != "node_heartbeat_link"} == {}, (one, many)


def test_a_controller_that_stops_answering_gets_a_new_heartbeat_link_once_it_runs_again(bus, topic_name):
    """The agent drops a link whose heartbeats go unanswered (1.6 s), heartbeats through Ray meanwhile,
    and opens a new link; the node's lease is renewed again and writes go on."""
    bus.admin.create_topic(topic_name, partitions=1)
    node_id = ray.get_runtime_context().get_node_id()
    lease = NodeLease(node_directory(bus.namespace, node_id))
    agent = ray.get_actor(agent_actor_name(node_id), namespace=bus.namespace)
    wait_for(lambda: call_counts(bus).get("node_heartbeat_link", 0) > 0, timeout_s=60, message="heartbeats over the link")
    opened = call_counts(bus)["heartbeat_links_opened"]
    dropped = get(agent.status.remote())["heartbeat_links_dropped"]
    controller_pid = get(bus.controller.ping.remote())
    os.kill(controller_pid, signal.SIGSTOP)
    try:  # the fault lasts until the agent gives the silent link up
        wait_for(lambda: get(agent.status.remote())["heartbeat_links_dropped"] > dropped, timeout_s=60,
                 message="the agent dropping the silent link")
    finally:
        os.kill(controller_pid, signal.SIGCONT)
    wait_for(lambda: call_counts(bus)["heartbeat_links_opened"] > opened, timeout_s=60, message="a new heartbeat link")
    wait_for(lambda: lease.expires_ms > monotonic_ms(), timeout_s=60, message="the node's lease renewed")
    assert get(agent.status.remote())["heartbeat_link_open"]
    with logbus.Producer(bus) as producer:
        assert producer.send(topic_name, b"after the pause").result(timeout=60).offset == 0
    assert assert_healed(bus, topic_name) == {0: 1}


def test_a_write_that_finds_the_nodes_lease_lapsed_waits_for_the_next_renewal(bus, topic_name):
    """A late heartbeat reply lets the lease lapse with nothing wrong: writes wait for the renewal."""
    bus.admin.create_topic(topic_name, partitions=1)
    leader = bus.topic_metadata(topic_name).leaders[0]
    node_id = ray.get_runtime_context().get_node_id()
    lease = NodeLease(node_directory(bus.namespace, node_id))
    agent_pid = get(ray.get_actor(agent_actor_name(node_id), namespace=bus.namespace).ping.remote())
    assert get(leader.produce.remote(encode_batch([b"before"]))).base_offset == 0
    os.kill(agent_pid, signal.SIGSTOP)  # no renewal until it continues (well inside the controller's 0.8 s)
    try:
        lease.revoke()  # the lapse a late reply makes
        assert lease.expires_ms <= monotonic_ms()
        pending = leader.produce.remote(encode_batch([b"after"]))
        ready, _ = ray.wait([pending], timeout=0.1)
        assert not ready  # waiting for the lease, neither written nor refused
    finally:
        os.kill(agent_pid, signal.SIGCONT)
    assert get(pending).base_offset == 1
    wait_for(lambda: lease.expires_ms > monotonic_ms(), timeout_s=60, message="the node's lease renewed")
    assert assert_healed(bus, topic_name) == {0: 2}


def test_a_topic_over_a_nodes_replica_limit_fails_and_leaves_nothing_behind(ray_session, tmp_path):
    namespace = f"cap-{uuid.uuid4().hex[:8]}"
    data_dir = str(tmp_path / "data")
    bus = logbus.connect(data_dir=data_dir, namespace=namespace, max_replicas_per_node=4)
    try:
        bus.admin.create_topic("fits", partitions=3)
        with pytest.raises(NodeCapacityError, match="max.replicas.per.node"):
            bus.admin.create_topic("too-big", partitions=2)
        with pytest.raises(NodeCapacityError):
            bus.admin.create_partitions("fits", 5)
        assert bus.admin.list_topics() == ["fits"]
        assert len(bus.admin.describe_topic("fits").partitions) == 3
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        assert not [name for name in actors if "too-big" in name]
        assert sorted(name for name in actors if name.startswith("logbus-replica:")) == sorted(
            f for f in actors if ":fits:" in f
        )
        replica_dirs = [d for root in os.listdir(data_dir) if root.startswith("replica-") for d in os.listdir(os.path.join(data_dir, root))]
        assert sorted(replica_dirs) == ["fits-0", "fits-1", "fits-2"]
        nodes = ray.get(bus.controller.nodes.remote(), timeout=60)
        assert [(n["replicas"], n["max_replicas"]) for n in nodes] == [(3, 4)]
        bus.admin.create_partitions("fits", 4)  # exactly the limit
    finally:
        close_bus(bus)
    # The cluster's lease and fence files on the node went with it (tmpfs is memory), directories too.
    assert not os.path.exists(os.path.dirname(node_directory(namespace, nodes[0]["node_id"])))
