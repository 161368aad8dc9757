"""Restarts: the controller's process, and the whole Ray cluster over the same data directory."""

import os
import signal

import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.actors.controller import CONTROLLER_NAME
from tests.api.test_broker import drain
from tests.conftest import RAY_INIT_ARGS, close_bus, wait_for
from tests.healing import assert_healed


def produce(bus, topic, count, prefix):
    with logbus.Producer(bus) as producer:
        futures = [producer.send(topic, b"%s-%d" % (prefix, i), key=b"%d" % i) for i in range(count)]
    return [f.result() for f in futures]


@pytest.mark.slow
def kill_controller(bus) -> None:
    """SIGKILL the controller's process; returns once Ray restarted it and it answers."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    pid = ray.get(controller.ping.remote())
    os.kill(pid, signal.SIGKILL)

    def restarted():
        try:
            return ray.get(controller.ping.remote(), timeout=30) != pid
        except ray.exceptions.RayActorError:
            return False

    wait_for(restarted, timeout_s=120, message="controller restart")


def test_controller_process_kill_loses_nothing(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2, config={"retention.ms": 86_400_000})
    produce(bus, topic_name, 1000, b"before")
    kill_controller(bus)
    described = bus.admin.describe_topic(topic_name)
    assert described.config == {"retention.ms": 86_400_000}
    assert sum(p.high_watermark for p in described.partitions) == 1000
    produce(bus, topic_name, 1000, b"after")
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)])
    assert drain(consumer, 2000).num_rows == 2000
    assert sum(assert_healed(bus, topic_name).values()) == 2000


@pytest.mark.slow
def test_a_partition_leaderless_at_a_controller_restart_gets_its_leader_at_once(bus, topic_name):
    """The partition's only replica is paused, so the controller leaves it without a leader (nothing
    in sync is alive); the controller is killed, the replica continued. The restarted controller
    elects it at once (its restore elects every partition without a live leader), rather than
    waiting for the preferred-leader check minutes later."""
    bus.admin.create_topic(topic_name, partitions=1)
    produce(bus, topic_name, 100, b"before")
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    replica = ray.get(controller.replica_statuses.remote(topic_name), timeout=60)[0][0]
    os.kill(replica["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: bus.topic_metadata(topic_name, refresh=True).leaders[0] is None, timeout_s=60,
                 message="the partition without a leader")
        epoch = bus.topic_metadata(topic_name).leader_epochs[0]
        controller_pid = ray.get(controller.ping.remote())
        os.kill(controller_pid, signal.SIGKILL)
    finally:
        os.kill(replica["pid"], signal.SIGCONT)

    def elected():
        try:
            metadata = bus.topic_metadata(topic_name, refresh=True)
        except (logbus.LogbusError, ray.exceptions.RayError):
            return False  # the controller is restarting
        return metadata.leaders[0] is not None and metadata.leader_epochs[0] > epoch

    wait_for(elected, timeout_s=60, interval_s=0.1, message="a leader elected by the restarted controller")
    assert assert_healed(bus, topic_name) == {0: 100}
    produce(bus, topic_name, 10, b"after")
    assert bus.admin.describe_topic(topic_name).partitions[0].high_watermark == 110


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_whole_ray_cluster_restart_finds_every_topic_and_record(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    bus.admin.create_topic(topic_name + "-other", partitions=1)
    sent = produce(bus, topic_name, 5000, b"kept")
    namespace, data_dir = bus.namespace, bus.data_dir

    ray.shutdown()
    ray.init(**RAY_INIT_ARGS)

    again = logbus.connect(data_dir=data_dir, namespace=namespace)
    try:
        assert sorted(again.admin.list_topics()) == sorted([topic_name, topic_name + "-other"])
        described = again.admin.describe_topic(topic_name)
        assert [p.high_watermark for p in described.partitions] == [
            sum(1 for m in sent if m.partition == p) for p in range(3)
        ]
        consumer = logbus.Consumer(again)
        consumer.assign([TopicPartition(topic_name, p) for p in range(3)])
        table = drain(consumer, 5000)
        assert sorted(table["value"].to_pylist()) == sorted(b"kept-%d" % i for i in range(5000))
        produce(again, topic_name, 10, b"new")  # offsets continue after the old ones
        assert sum(p.high_watermark for p in again.admin.describe_topic(topic_name).partitions) == 5010
        assert sum(assert_healed(again, topic_name).values()) == 5010
    finally:
        close_bus(again)
