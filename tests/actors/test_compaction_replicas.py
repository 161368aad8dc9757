"""Compaction on replicated partitions (a multi-node Ray cluster on one machine): leader and
follower each compact their own copy, a new replica copies a compacted log across its gaps and
joins the ISR, followers follow the leader's log start after delete_records, and after a failover
the new leader serves its own compacted copy."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

import logbus
from logbus import TopicPartition
from tests.actors.replica_files import committed_records
from tests.actors.test_replication import leader_status, serving_leader, statuses, wait_isr
from tests.conftest import close_bus, wait_for
from tests.healing import assert_healed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COMPACTED = {"cleanup.policy": "compact", "segment.bytes": 1024, "min.cleanable.dirty.ratio": 0, "min.insync.replicas": 2}


@pytest.fixture
def rbus(cluster, tmp_path):
    bus = logbus.connect(data_dir=str(tmp_path / "data"), namespace=f"c-{uuid.uuid4().hex[:8]}", replica_replacement_ms=2000)
    yield bus
    close_bus(bus)


def consume(bus, topic):
    """Every record of partition 0 from its log start to the high watermark: [(offset, key, value)]."""
    described = bus.admin.describe_topic(topic).partitions[0]
    tp = TopicPartition(topic, 0)
    out = []
    deadline = time.monotonic() + 60
    with logbus.Consumer(bus, enable_auto_commit=False) as consumer:
        consumer.assign([tp])
        consumer.seek(tp, described.log_start_offset)
        while consumer.position(tp) < described.high_watermark:
            assert time.monotonic() < deadline, f"consuming {topic} did not reach {described.high_watermark}"
            out += [(r.offset, r.key, r.value) for r in consumer.poll(200).get(tp, [])]
    return out


def replica_nodes(bus, topic):
    """{replica id: node id} as the replicas report it."""
    return wait_for(
        lambda: (lambda found: found if all("node_id" in s for s in found) else None)(statuses(bus, topic)),
        timeout_s=60, message="replica statuses",
    )


def test_replicas_compact_their_own_copies_and_a_new_replica_copies_the_compacted_log(cluster, rbus):
    topic = "compacted"
    tp = TopicPartition(topic, 0)
    rbus.admin.create_topic(topic, partitions=1, replication_factor=2, config=COMPACTED)
    wait_isr(rbus, topic, 2)
    written = {}
    with logbus.Producer(rbus, acks="all", linger_ms=0) as producer:
        for i in range(60):  # one batch each: one segment each
            key = b"key-%d" % (i % 9)
            written[producer.send(topic, b"value-%d" % i, key=key).get(timeout=60).offset] = (key, b"value-%d" % i)
        written[producer.send(topic, b"last", key=b"last").get(timeout=60).offset] = (b"last", b"last")
    latest = {key: offset for offset, (key, _) in sorted(written.items())}
    expected = sorted((offset, *written[offset]) for offset in latest.values())
    end = max(written) + 1

    # Each replica compacts its own copy (its own timer and thread), to the same records.
    replicas = [s["replica_id"] for s in statuses(rbus, topic)]
    for replica in replicas:
        wait_for(lambda: committed_records(rbus.data_dir, topic, 0, replica, end) == expected, timeout_s=120,
                 message=f"replica {replica} to compact its log")
    assert consume(rbus, topic) == expected

    # A new replica on the third node copies the compacted log, passing its gaps, and joins the ISR.
    nodes = {s["replica_id"]: s["node_id"] for s in replica_nodes(rbus, topic)}
    described = rbus.admin.describe_topic(topic).partitions[0]
    spare = next(n["node_id"] for n in rbus.admin.nodes() if n["alive"] and n["node_id"] not in nodes.values())
    follower = next(r for r in described.replicas if r != described.leader)
    rbus.admin.reassign_partitions({tp: [nodes[described.leader], spare]})
    wait_for(lambda: not rbus.admin.describe_reassignments(), timeout_s=180, message="the move to finish")
    wait_isr(rbus, topic, 2)
    described = rbus.admin.describe_topic(topic).partitions[0]
    new_replica = next(r for r in described.replicas if r not in replicas)
    assert follower not in described.replicas
    wait_for(lambda: committed_records(rbus.data_dir, topic, 0, new_replica, end) == expected, timeout_s=60,
             message="the new replica's copy")

    # delete_records: the followers follow the leader's log start.
    start = expected[1][0]
    assert rbus.admin.delete_records({tp: start}) == {tp: start}
    wait_for(lambda: all(s.get("log_start_offset") == start for s in statuses(rbus, topic)), timeout_s=60,
             message="every replica to follow the log start")

    # The leader dies; the new replica leads, and serves its own copy from the log start.
    described, status = serving_leader(rbus, topic)
    os.kill(status["pid"], signal.SIGKILL)

    def new_replica_leads():
        now, _ = leader_status(rbus, topic)
        return now.leader == new_replica and now.leader_epoch > described.leader_epoch

    wait_for(new_replica_leads, timeout_s=60, message="the new replica to lead")
    assert consume(rbus, topic) == [r for r in expected if r[0] >= start]
    assert_healed(rbus, topic)
