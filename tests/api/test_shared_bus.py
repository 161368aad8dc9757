"""The cluster that tests share (``SharedBus`` in tests/conftest.py), tidied after a test and after a module.

A group the test's consumer left (its offsets committed) is deleted quietly and the cluster kept; a
group still holding a live member cannot be deleted, so the cluster is replaced for the next test and
a LeftoverGroupWarning names the test and the group. What a module kept goes when it ends; the
cluster, and its node's agent, stay for the next module.
"""

from __future__ import annotations

import warnings

import pytest
import ray

import logbus
from logbus.actors.node_agent import agent_actor_name
from tests.conftest import LeftoverGroupWarning, SharedBus, wait_for


def joined(bus, topic: str, group: str) -> logbus.Consumer:
    """A consumer of ``topic`` in ``group``, once it has read the topic's record (so it is a member with an assignment)."""
    consumer = logbus.Consumer(bus, topic, group_id=group, enable_auto_commit=False)
    wait_for(lambda: any(consumer.poll(timeout_ms=200).values()), timeout_s=60, message=f"a record read in group {group}")
    return consumer


def test_a_closed_consumers_group_is_deleted_and_a_live_ones_replaces_the_cluster_with_a_warning(ray_session, tmp_path_factory):
    state = SharedBus(tmp_path_factory)
    try:
        bus = state.current()
        topics_before, groups_before = state.topics(), state.groups()
        bus.admin.create_topic("tidied", partitions=1)
        with logbus.Producer(bus) as producer:
            producer.send("tidied", b"record").result(timeout=60)
        closed = joined(bus, "tidied", "closed-group")
        closed.commit()
        closed.close()
        assert "closed-group" in state.groups()  # its committed offsets keep it listed
        with warnings.catch_warnings():
            warnings.simplefilter("error", LeftoverGroupWarning)
            state.tidy("first-test", topics_before, groups_before)
        assert state.bus is bus and state.topics() == topics_before and state.groups() == groups_before

        bus.admin.create_topic("left", partitions=1)
        with logbus.Producer(bus) as producer:
            producer.send("left", b"record").result(timeout=60)
        live = joined(bus, "left", "live-group")
        try:
            with pytest.warns(LeftoverGroupWarning, match=r"second-test left consumer group\(s\) live-group with live members"):
                state.tidy("second-test", topics_before, groups_before)
            assert state.bus is None  # closed: the next test gets a new cluster
        finally:
            live.close()
        fresh = state.current()
        assert fresh.namespace != bus.namespace
        assert state.topics() == set() and state.groups() == set()
    finally:
        state.close()


def test_a_modules_kept_topic_goes_when_it_ends_and_the_cluster_and_its_agent_stay(ray_session, tmp_path_factory):
    state = SharedBus(tmp_path_factory)
    try:
        bus = state.current()
        agent = ray.get_actor(agent_actor_name(ray.get_runtime_context().get_node_id()), namespace=bus.namespace)
        agent_pid = ray.get(agent.ping.remote(), timeout=60)
        stopped = []

        def make(shared):
            shared.admin.create_topic("kept", partitions=1)
            return "made"

        assert state.kept("topic", make, stop=stopped.append) == "made"
        topics_before, groups_before = state.topics(), state.groups()
        bus.admin.create_topic("one-tests", partitions=1)
        state.tidy("a-test", topics_before, groups_before)
        assert state.topics() == {"kept"}
        state.end_module()
        assert stopped == ["made"] and state.topics() == set()
        assert state.current() is bus
        # The node hosts a replica no test deletes (the offsets topic): its agent was never stopped.
        again = ray.get_actor(agent_actor_name(ray.get_runtime_context().get_node_id()), namespace=bus.namespace)
        assert ray.get(again.ping.remote(), timeout=60) == agent_pid
    finally:
        state.close()
