"""A tiered topic across a failover: the leader's node dies while it uploads, a follower takes over the
tier (its own segments cut at other offsets) and goes on where the manifest ends: one copy of each
offset range, no gap, every acknowledged record readable from offset 0."""

from __future__ import annotations

import glob
import json
import os
import uuid

import pytest
import ray

import logbus
from logbus import TopicPartition
from tests.actors.multinode import REPLICA_RESOURCE
from tests.actors.test_replication import kill_node, serving_leader, wait_isr, wait_new_leader
from tests.conftest import close_bus, wait_for

TIERED = {
    "segment.bytes": 16 * 1024,
    "remote.storage.enable": True,
    "local.retention.bytes": 0,
    "retention.ms": -1,
    "min.insync.replicas": 2,
}


@pytest.fixture
def rbus(cluster, tmp_path):
    bus = logbus.connect(data_dir=str(tmp_path / "data"), namespace=f"t-{uuid.uuid4().hex[:8]}", replica_replacement_ms=2000)
    yield bus
    close_bus(bus)


def produce(bus, topic, prefix, count):
    with logbus.Producer(bus, acks="all", linger_ms=2, batch_size_bytes=4096, delivery_timeout_ms=120_000) as producer:
        futures = {b"%s-%d" % (prefix, i) + b"." * 100: producer.send(topic, b"%s-%d" % (prefix, i) + b"." * 100) for i in range(count)}
        producer.flush(timeout_s=180)
    return {future.result().offset: value for value, future in futures.items() if future.exception() is None}


def manifest_files(bus, topic):
    directory = glob.glob(f"{bus.data_dir}/remote/{topic}-*/0")[0]
    with open(sorted(glob.glob(f"{directory}/manifest-*.json"))[-1]) as file:
        manifest = json.load(file)
    return directory, manifest


def test_a_new_leader_takes_over_the_tier_where_the_manifest_ends(cluster, rbus):
    topic = "tiered"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config=TIERED)
    wait_isr(rbus, topic, 3)
    acknowledged = produce(rbus, topic, b"before", 1500)
    assert len(acknowledged) == 1500
    wait_for(lambda: (rbus.admin.describe_tier(topic)[0] or {}).get("files", 0) >= 3, timeout_s=120, message="uploads")
    described, status = serving_leader(rbus, topic)
    old_epoch = described.leader_epoch
    _, before = manifest_files(rbus, topic)
    assert before["leader_epoch"] == old_epoch

    node = next(n for n in cluster.worker_nodes if n.node_id == status["node_id"])
    kill_node(cluster, node)
    wait_new_leader(rbus, topic, old_epoch)
    cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE)  # room for the replacement replica
    acknowledged.update(produce(rbus, topic, b"after", 1500))

    def taken_over():
        # The new leader has claimed the tier and uploaded every closed segment (its local retention
        # left only the active one): no upload is under way, so the files on disk can be compared.
        _, status = serving_leader(rbus, topic)
        tier = status["tier"]
        _, manifest = manifest_files(rbus, topic)
        done = (
            tier and manifest["leader_epoch"] > old_epoch and status["segments"] == 1
            and tier["uploaded_up_to"] == status["log_start_offset"] > before["files"][-1]["next_offset"]
        )
        return (tier, manifest) if done else None

    tier, manifest = wait_for(taken_over, timeout_s=120, message="the new leader's uploads")
    _, manifest = manifest_files(rbus, topic)
    files = manifest["files"]
    assert files[: len(before["files"])] == before["files"]  # what the old leader listed stays as it was
    assert [f["base_offset"] for f in files[1:]] == [f["next_offset"] for f in files[:-1]]  # no gap, no overlap
    directory, _ = manifest_files(rbus, topic)
    listed = {f["name"] for f in files}
    present = set(os.listdir(f"{directory}/data"))
    assert listed <= present  # every listed file is there; any other is an unlisted upload of the dead leader
    assert all(name.endswith(".tmp") or name in listed or f"-e{old_epoch}-" in name for name in present)

    consumer = logbus.Consumer(rbus)
    consumer.assign([TopicPartition(topic, 0)])
    consumer.seek(TopicPartition(topic, 0), 0)
    got = {}

    def read_all():
        for records in consumer.poll(timeout_ms=500).values():
            for record in records:
                assert got.setdefault(record.offset, record.value) == record.value
        return len(got) >= len(acknowledged)

    try:
        wait_for(read_all, timeout_s=120, message="every acknowledged record")
    finally:
        consumer.close()
    for offset, value in acknowledged.items():
        assert got[offset] == value
    assert ray.get(rbus.topic_metadata(topic).leaders[0].tier_status.remote())["log_start_offset"] == 0
