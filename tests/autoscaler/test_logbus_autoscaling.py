"""logbus grows and shrinks with the Ray autoscaler (a fake autoscaling cluster on this machine).

Starting from a head alone: a topic whose replication factor needs nodes
that do not exist becomes pending demand and the autoscaler adds them; a
second topic that needs one more node gets it; a partition moves onto the
new node and a drain moves it off again, after which the node is idle, the
autoscaler removes it, and the controller forgets it. An idempotent
acks="all" producer and a consumer group run throughout: every record sent
is acknowledged (the partitions always had a leader to take it within the
producer's delivery timeout), none is lost or written twice, and the group
reads them all.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.errors import InvalidReassignmentError
from tests.conftest import close_bus, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SCALE_TIMEOUT_S = 240.0
WORKER_TYPES = {
    "replica-node": {
        "resources": {"CPU": 1, "logbus_replica": 4, "object_store_memory": 100 << 20},
        "max_workers": 4,
    },
}


@pytest.fixture(scope="module")
def cluster(autoscaling_cluster):
    return autoscaling_cluster(WORKER_TYPES, idle_timeout_s=6.0)


class Load:
    """An idempotent acks="all" producer and a one-member consumer group on ``topic``, in threads."""

    def __init__(self, bus, topic: str, partitions: int) -> None:
        self.bus, self.topic, self.partitions = bus, topic, partitions
        self.stop_event = threading.Event()
        self.produced = threading.Event()  # the producer flushed and closed: no acknowledgement is still to come
        self.sent: list = []
        self.seen: list[bytes] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._produce, self._consume)]
        for thread in self.threads:
            thread.start()

    def _produce(self) -> None:
        producer = logbus.Producer(self.bus, acks="all", linger_ms=5)
        i = 0
        while not self.stop_event.is_set():
            value = b"v-%d" % i
            self.sent.append((value, producer.send(self.topic, value, key=b"k%d" % (i % 17))))
            i += 1
            if i % 100 == 0:
                time.sleep(0.05)  # about 2,000 records/s
        try:
            producer.flush(timeout_s=120)
            producer.close()
        finally:
            self.produced.set()

    def _consume(self) -> None:
        consumer = logbus.Consumer(self.bus, self.topic, group_id="autoscaled", enable_auto_commit=False)
        try:
            # On until the producer is done and every record it had acknowledged was seen (a count
            # would not do: a rebalance may hand the group a record twice).
            while not self.produced.is_set() or not self._saw_everything_acknowledged():
                for records in consumer.poll(timeout_ms=200).values():
                    self.seen.extend(r.value for r in records)
                consumer.commit()
                if self.stop_event.is_set() and time.monotonic() > self.drain_deadline:
                    break
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            self.errors.append(error)
        finally:
            consumer.close()

    def _saw_everything_acknowledged(self) -> bool:
        seen = set(self.seen)
        return all(value in seen for value, future in list(self.sent) if future.done() and future.exception() is None)

    def acknowledged_count(self) -> int:
        return sum(1 for _, f in list(self.sent) if f.done() and f.exception() is None)

    def finish(self) -> tuple[set[bytes], list[BaseException]]:
        """Stop; the values acknowledged, and the errors of the records that were not."""
        self.drain_deadline = time.monotonic() + 120
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=240)
        acknowledged = {value for value, future in self.sent if future.exception() is None}
        return acknowledged, [future.exception() for _, future in self.sent if future.exception() is not None]


def replica_nodes(bus, topic: str) -> list[set[str]]:
    statuses = ray.get(bus.controller.replica_statuses.remote(topic), timeout=120)
    return [{s["node_id"] for s in replicas if "node_id" in s} for replicas in statuses]


def test_topics_grow_the_cluster_and_a_drained_node_is_removed(cluster, tmp_path):
    cluster.wait_for_workers(0, timeout_s=SCALE_TIMEOUT_S)
    bus = logbus.connect(data_dir=str(tmp_path / "data"), namespace=f"as-{uuid.uuid4().hex[:8]}")
    try:
        # 1. Replication factor 2 on a cluster with no replica node: the autoscaler adds two.
        started = time.monotonic()
        bus.admin.create_topic("grow", partitions=2, replication_factor=2, timeout_s=SCALE_TIMEOUT_S)
        created_s = time.monotonic() - started
        workers = set(cluster.node_ids())
        assert len(workers) >= 2, workers
        for nodes in replica_nodes(bus, "grow"):
            assert len(nodes) == 2 and nodes <= workers
        load = Load(bus, "grow", 2)
        wait_for(lambda: load.acknowledged_count() > 500 and len(load.seen) > 200, timeout_s=120, message="load running")

        # 2. Replication factor 3: a third node (the autoscaler may have started it already, as it
        # sometimes starts one node more than the demand while others start).
        bus.admin.create_topic("more", partitions=1, replication_factor=3, timeout_s=SCALE_TIMEOUT_S)
        (more_nodes,) = replica_nodes(bus, "more")
        assert len(more_nodes) == 3 and more_nodes <= set(cluster.node_ids())

        # 3. A partition under load moves onto a node it did not use, then a drain moves it off again.
        (grow0, _) = replica_nodes(bus, "grow")
        new_node = sorted(more_nodes - grow0)[0]
        keep = sorted(grow0)[0]
        bus.admin.reassign_partitions({TopicPartition("grow", 0): [new_node, keep]})
        wait_for(lambda: not bus.admin.describe_reassignments(), timeout_s=SCALE_TIMEOUT_S, message="the move")
        assert replica_nodes(bus, "grow")[0] == {new_node, keep}
        bus.admin.delete_topic("more")
        # (If __consumer_offsets spans all three nodes, the drain asks the autoscaler for a fourth.)
        bus.admin.drain_node(new_node, timeout_s=SCALE_TIMEOUT_S)
        wait_for(lambda: not bus.admin.describe_reassignments(), timeout_s=SCALE_TIMEOUT_S, message="the drain")
        assert new_node not in set().union(*replica_nodes(bus, "grow"))
        assert next(n for n in bus.admin.nodes() if n["node_id"] == new_node)["replicas"] == 0

        # 4. The drained node is idle: the autoscaler removes it.
        wait_for(lambda: new_node not in cluster.node_ids(), timeout_s=SCALE_TIMEOUT_S, message="the drained node removed")
        acked = load.acknowledged_count()
        wait_for(lambda: load.acknowledged_count() > acked + 500, timeout_s=60, message="more load after the removal")

        # 5. The controller forgets the removed node (protocol/node_table.py): it is unknown from then on.
        def forgotten() -> bool:
            try:
                bus.admin.drain_node(new_node, timeout_s=10)
            except InvalidReassignmentError as error:
                assert "unknown node" in str(error)
                return True
            return False

        wait_for(forgotten, timeout_s=120, interval_s=0.5, message="the removed node gone from the controller's node table")
        acknowledged, failed = load.finish()
        assert not load.errors, load.errors
        assert not failed, f"{len(failed)} records not acknowledged, e.g. {failed[:3]}"
        # Every acknowledged record is in the log once, and reached the group.
        tps = [TopicPartition("grow", p) for p in range(2)]
        reader = logbus.Consumer(bus)
        reader.assign(tps)
        ends = reader.end_offsets(tps)
        stored = []
        wait_for(lambda: stored.extend(reader.poll_arrow(timeout_ms=500)["value"].to_pylist()) or len(stored) >= sum(ends.values()),
                 timeout_s=120, message="read back")
        reader.close()
        assert len(stored) == len(set(stored)), "a record was written twice"
        missing = acknowledged - set(stored)
        assert not missing, f"{len(missing)} acknowledged records lost"
        assert acknowledged <= set(load.seen), "the group missed acknowledged records"
        print(f"create needing 2 new nodes took {created_s:.1f}s; scale events: {cluster.scale_events}")
    finally:
        close_bus(bus)
