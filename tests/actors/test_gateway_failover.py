"""The Kafka gateway across a leader's death: a confluent-kafka producer (acks=all, idempotent)
follows the new leader when the leader's node is killed, and loses no acknowledged record.

Multi-node on one machine with ``ray.cluster_utils.Cluster`` (the three-node cluster of
tests/actors/conftest.py), with the fault injection and invariant checks of ``test_replication.py``:
one gateway per replica node, so Metadata names the leader's node's gateway
as each partition's leader and the producer sends there; killing that node
kills its gateway too, and the producer must find the new leader through the
gateways that remain.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from logbus.actors.gateway import KafkaGateway
from logbus.protocol import kafka_gateway as kg
from tests.actors.test_gateway import Raw

from tests.actors.test_replication import (  # noqa: F401 (rbus: the fixture of a bus on the three-node cluster)
    REPLICA_RESOURCE,
    check_invariants,
    kill_node,
    serving_leader,
    rbus,
    wait_isr,
    wait_new_leader,
)
from tests.conftest import wait_for
from tests.healing import assert_healed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]


class KafkaWorkload:
    """A confluent-kafka producer (acks=all, idempotent) sending unique values from a thread until stopped."""

    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        import confluent_kafka as ck

        self.producer = ck.Producer({
            "bootstrap.servers": bootstrap_servers,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 2,
            "message.timeout.ms": 120_000,
            "topic.metadata.refresh.interval.ms": 1000,
        })
        self.topic = topic
        self.acknowledged: dict[bytes, int] = {}
        self.errors: list = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _delivered(self, error, message) -> None:
        if error is None:
            self.acknowledged[message.value()] = message.offset()
        else:
            self.errors.append(error)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = b"v-%d" % self.sent
            try:
                self.producer.produce(self.topic, value=value, on_delivery=self._delivered)
                self.sent += 1
            except BufferError:
                self.producer.poll(0.05)
                continue
            if self.sent % 100 == 0:
                self.producer.poll(0.01)  # delivery reports; about 10,000 records/s: steady, not a flood

    def acknowledged_count(self) -> int:
        return len(self.acknowledged)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def finish(self) -> dict[bytes, int]:
        """Stop sending, wait for every record's outcome, and return {value: offset} of the acknowledged."""
        self.stop()
        remaining = self.producer.flush(180)
        assert remaining == 0, f"{remaining} records without an outcome after 180 s"
        return dict(self.acknowledged)


def test_a_kafka_producer_follows_the_new_leader_when_the_leaders_node_dies(cluster, rbus):
    from confluent_kafka.admin import AdminClient

    topic = "kafka-orders"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    gateway = rbus.start_gateway(port=0, all_nodes=True)
    workload = None
    try:
        assert len(gateway.brokers) == 3  # one per replica node
        workload = KafkaWorkload(gateway.bootstrap_servers, topic)
        wait_for(lambda: workload.acknowledged_count() > 2000, timeout_s=60, message="progress through the gateway")
        described, status = serving_leader(rbus, topic)
        node = next(n for n in cluster.worker_nodes if n.node_id == status["node_id"])
        kill_node(cluster, node)  # the leader and that node's gateway, at once
        failover_s = wait_new_leader(rbus, topic, described.leader_epoch)
        cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE)  # room for the replacement replica
        acked = workload.acknowledged_count()
        started = time.monotonic()
        wait_for(lambda: workload.acknowledged_count() > acked + 2000, timeout_s=90, message="writes resume at the new leader")
        resumed_s = time.monotonic() - started
        acknowledged = workload.finish()

        # Every acknowledged record is stored once, at the offset acknowledged; the replicas agree.
        stored = check_invariants(rbus, topic, acknowledged, 3)
        print(f"\ngateway failover: new leader after {failover_s:.2f}s, writes resumed {resumed_s:.2f}s later; "
              f"{len(acknowledged)} acknowledged, {stored} stored, {len(workload.errors)} delivery errors")
        assert not workload.errors, workload.errors[:3]
        assert len(acknowledged) == workload.sent

        # The killed node's gateway is no longer advertised; the leader named is a live node's gateway.
        killed = kg.broker_id_for(node.node_id)
        alive = ",".join(f"{h}:{p}" for h, p, broker_id, _ in gateway.brokers if broker_id != killed)
        metadata = AdminClient({"bootstrap.servers": alive}).list_topics(topic, timeout=30)
        assert killed not in metadata.brokers
        assert metadata.topics[topic].partitions[0].leader in metadata.brokers
        assert assert_healed(rbus, topic) == {0: stored}
    finally:
        if workload is not None:
            workload.stop()  # no producer thread may outlive its test
        gateway.stop()


def test_a_gateway_that_ray_restarts_rejoins_the_others(cluster, rbus):
    """Its process killed, a gateway comes back on a new port (``port=0``): the other gateways advertise
    the new address, and it advertises them, with no call from the driver."""
    topic = "kafka-rejoin"
    rbus.admin.create_topic(topic, partitions=3, replication_factor=1)
    gateway = rbus.start_gateway(port=0, all_nodes=True)
    try:
        assert len(gateway.brokers) >= 2
        victim, *others = gateway.brokers
        actor = gateway.actors()[0]
        old_pid = ray.get(actor.stats.remote(), timeout=60)["pid"]
        os.kill(old_pid, signal.SIGKILL)

        def restarted():
            try:
                return ray.get(actor.stats.remote(), timeout=5)["pid"] != old_pid and tuple(ray.get(actor.address.remote(), timeout=5))
            except ray.exceptions.RayError:
                return None

        new_address = wait_for(restarted, timeout_s=120, message="the gateway restarted by Ray")
        assert new_address[2:] == victim[2:]  # the same broker id and node

        def advertised(via) -> set:
            raw = Raw(KafkaGateway(rbus.namespace, (via,)))
            try:
                response = raw.call(kg.METADATA, 12, {"topics": [], "allow_auto_topic_creation": False,
                                                     "include_topic_authorized_operations": False})
            finally:
                raw.close()
            return {(b.node_id, b.host, b.port) for b in response.brokers}

        everyone = {(new_address[2], new_address[0], new_address[1])} | {(b[2], b[0], b[1]) for b in others}
        for via in others:
            wait_for(lambda via=via: advertised(via) == everyone, timeout_s=60, message=f"gateway {via[:2]} advertises the restarted one")
        # And the restarted one advertises every gateway (it learns them as it tells them its own).
        wait_for(lambda: advertised(new_address) == everyone, timeout_s=60, message="the restarted gateway advertises every gateway")
    finally:
        gateway.stop()
