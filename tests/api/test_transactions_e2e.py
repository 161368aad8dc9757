"""Transactions end to end: records and offsets committed or aborted together, zombies fenced, timeouts,
and a consume-transform-produce loop that stays exactly-once while its processes are killed and paused.

Every check reads the output with a read_committed consumer: each input record's output appears
exactly once, nothing from an aborted transaction is ever returned, and offsets only grow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import ray

import logbus
from logbus.actors.controller import CONTROLLER_NAME
from logbus.errors import InvalidTxnStateError, LogbusError, ProducerFencedError, TransactionAbortedError
from logbus.protocol.group_coordinator import OffsetAndMetadata
from logbus.protocol.messages import TopicPartition
from tests.conftest import wait_for

# These need the log side of transactions (markers on the replicas, read_committed consumers).
pytestmark = pytest.mark.skipif(
    not hasattr(logbus.Consumer, "group_metadata"), reason="needs the log side of transactions (read_committed consumers)"
)


def read_committed(bus, topic: str, partitions: int, timeout_s: float = 120.0) -> list[tuple[int, int, bytes]]:
    """Every record of ``topic`` a read_committed consumer returns, from the start to the last stable
    offsets: (partition, offset, value). Checks that offsets only grow within each partition."""
    consumer = logbus.Consumer(bus, isolation_level="read_committed", enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, "read_committed did not reach the last stable offsets"
            for tp, records in consumer.poll(timeout_ms=200).items():
                out.extend((tp.partition, r.offset, r.value) for r in records)
    finally:
        consumer.close()
    for p in range(partitions):
        offsets = [o for q, o, _ in out if q == p]
        assert offsets == sorted(set(offsets)), f"partition {p}: offsets not increasing"
    return out


def committed_values(bus, topic, partitions):
    return sorted(v for _, _, v in read_committed(bus, topic, partitions))


def test_committed_records_are_visible_and_aborted_ones_never(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    producer = logbus.Producer(bus, transactional_id=f"{topic_name}-tx")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(30):
            producer.send(topic_name, f"c{i}".encode(), partition=i % 3)
        producer.commit_transaction()
        producer.begin_transaction()
        aborted = [producer.send(topic_name, f"a{i}".encode(), partition=i % 3) for i in range(30)]
        producer.flush()  # written to the logs, then aborted
        assert all(f.result(timeout=60).offset >= 0 for f in aborted)
        producer.abort_transaction()
        producer.begin_transaction()
        producer.send_table(topic_name, __import__("pyarrow").table({"value": [f"t{i}".encode() for i in range(30)]}))
        producer.commit_transaction()
    finally:
        producer.close()
    values = committed_values(bus, topic_name, 3)
    assert values == sorted([f"c{i}".encode() for i in range(30)] + [f"t{i}".encode() for i in range(30)])


def test_records_not_yet_sent_fail_when_the_transaction_aborts(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, transactional_id=f"{topic_name}-tx", linger_ms=60_000, batch_size_bytes=1 << 20)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        future = producer.send(topic_name, b"lingering")
        producer.abort_transaction()
        with pytest.raises(TransactionAbortedError):
            future.result(timeout=60)
        producer.begin_transaction()
        producer.send(topic_name, b"kept")
        producer.commit_transaction()
    finally:
        producer.close()
    assert committed_values(bus, topic_name, 1) == [b"kept"]


def test_offsets_commit_with_the_transaction_and_not_when_it_aborts(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    group = f"{topic_name}-g"
    tp = TopicPartition(topic_name, 0)
    consumer = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
    producer = logbus.Producer(bus, transactional_id=f"{topic_name}-tx")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(topic_name, b"x", partition=1)
        producer.send_offsets_to_transaction({tp: OffsetAndMetadata(5, "five")}, group)
        assert consumer.committed([tp]).get(tp) is None  # pending until the marker
        producer.commit_transaction()
        assert consumer.committed([tp])[tp] == 5
        producer.begin_transaction()
        producer.send_offsets_to_transaction({tp: 9}, group)
        producer.abort_transaction()
        assert consumer.committed([tp])[tp] == 5
    finally:
        producer.close()
        consumer.close()
    # A restarted controller rebuilds the same table from __consumer_offsets (markers included).
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    pid = ray.get(controller.ping.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _pings_other_than(controller, pid), timeout_s=120, message="controller restart")
    consumer = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
    try:
        assert consumer.committed([tp])[tp] == 5
    finally:
        consumer.close()


def _pings_other_than(controller, pid) -> bool:
    try:
        return ray.get(controller.ping.remote(), timeout=30) != pid
    except Exception:  # noqa: BLE001 (restarting)
        return False


@contextlib.contextmanager
def paused(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@ray.remote(num_cpus=0, max_restarts=0)
class TransactionalWriter:
    """A transactional producer in a process of its own, so the test can pause or kill it."""

    def __init__(self, bus, transactional_id, timeout_ms=60_000):
        self.producer = logbus.Producer(bus, transactional_id=transactional_id, transaction_timeout_ms=timeout_ms)
        self.producer.init_transactions()

    def pid(self):
        return os.getpid()

    def begin_and_send(self, topic, values, partitions):
        self.producer.begin_transaction()
        futures = [self.producer.send(topic, v, partition=i % partitions) for i, v in enumerate(values)]
        self.producer.flush()
        return [f.result(timeout=60).offset for f in futures]

    def send_and_commit(self, topic, values, partitions):
        """Send more in the open transaction, then commit: the errors, by name, of each step."""
        errors = {}
        try:
            for i, v in enumerate(values):
                self.producer.send(topic, v, partition=i % partitions)
            self.producer.flush()
        except LogbusError as error:
            errors["send"] = type(error).__name__
        try:
            self.producer.commit_transaction(timeout_s=60)
        except LogbusError as error:
            errors["commit"] = type(error).__name__
            errors["commit_cause"] = type(error.__cause__).__name__ if error.__cause__ is not None else None
        return errors


def test_a_zombie_paused_mid_transaction_is_fenced_and_nothing_it_wrote_is_visible(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    tid = f"{topic_name}-tx"
    zombie = TransactionalWriter.remote(bus, tid)
    offsets = ray.get(zombie.begin_and_send.remote(topic_name, [b"zombie-1", b"zombie-2"], 2), timeout=120)
    assert all(o >= 0 for o in offsets)
    with paused(ray.get(zombie.pid.remote(), timeout=60)):
        successor = logbus.Producer(bus, transactional_id=tid)
        successor.init_transactions()  # fences the zombie: its open transaction is aborted
        successor.begin_transaction()
        successor.send(topic_name, b"successor", partition=0)
        successor.commit_transaction()
    errors = ray.get(zombie.send_and_commit.remote(topic_name, [b"zombie-3", b"zombie-4"], 2), timeout=180)
    assert "ProducerFencedError" in (errors.get("send"), errors.get("commit"), errors.get("commit_cause")), errors
    errors = ray.get(zombie.send_and_commit.remote(topic_name, [b"zombie-5"], 2), timeout=120)
    assert errors.get("send") == errors.get("commit") == "ProducerFencedError", errors  # fenced is final
    successor.close()
    assert committed_values(bus, topic_name, 2) == [b"successor"]
    ray.kill(zombie)


def test_a_transaction_open_past_its_timeout_is_aborted_and_its_producer_fenced(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    tid = f"{topic_name}-tx"
    producer = logbus.Producer(bus, transactional_id=tid, transaction_timeout_ms=2_000)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(topic_name, b"late", partition=0)
        producer.flush()

        def aborted():
            found = {t["transactional_id"]: t for t in ray.get(bus.controller.describe_transactions.remote(), timeout=60)}
            return found[tid]["state"] == "COMPLETE_ABORT"

        wait_for(aborted, timeout_s=60, message="the coordinator aborting the expired transaction")
        with pytest.raises((ProducerFencedError, InvalidTxnStateError)) as raised:
            producer.send(topic_name, b"later", partition=1)
            producer.commit_transaction()
        assert isinstance(raised.value, ProducerFencedError) or isinstance(raised.value.__cause__, ProducerFencedError)
    finally:
        producer.close()
    assert committed_values(bus, topic_name, 2) == []
    # The stable offset moved past the aborted transaction: a new producer's records are readable.
    follower = logbus.Producer(bus, transactional_id=tid)
    try:
        follower.init_transactions()
        follower.begin_transaction()
        follower.send(topic_name, b"next", partition=0)
        follower.commit_transaction()
    finally:
        follower.close()
    assert committed_values(bus, topic_name, 2) == [b"next"]


# --- consume-transform-produce under faults --------------------------------------------------------------

INPUT_RECORDS = 600
PAUSE_S = 3.0  # how long a paused process stays stopped (past a lease, well inside the transaction timeout)


@ray.remote(num_cpus=0, max_restarts=0)
class Transformer:
    """Reads the input topic as group ``group``, writes each value prefixed to the output topic, and
    sends the input offsets to the same transaction: one transaction per poll."""

    def __init__(self, bus, source, sink, partitions, transactional_id, group):
        self.consumer = logbus.Consumer(bus, group_id=group, isolation_level="read_committed", enable_auto_commit=False)
        self.tps = [TopicPartition(source, p) for p in range(partitions)]
        self.consumer.assign(self.tps)
        self.producer = logbus.Producer(bus, transactional_id=transactional_id, transaction_timeout_ms=10_000)
        self.producer.init_transactions()
        self.sink = sink
        self.partitions = partitions
        self.commits = 0

    def pid(self):
        return os.getpid()

    def steps(self, count):
        """Up to ``count`` transactions; the number committed so far."""
        for _ in range(count):
            records = self.consumer.poll(timeout_ms=100, max_records=50)
            if not records:
                continue
            self.producer.begin_transaction()
            try:
                for tp, batch in records.items():
                    for r in batch:
                        self.producer.send(self.sink, b"out-" + r.value, partition=tp.partition % self.partitions)
                positions = {tp: self.consumer.position(tp) for tp in self.tps}
                self.producer.send_offsets_to_transaction(positions, self.consumer.group_metadata())
                self.producer.commit_transaction()
                self.commits += 1
            except ProducerFencedError:
                raise
            except LogbusError:
                # A leader or the coordinator moving: abort, and read again from what was committed.
                with contextlib.suppress(LogbusError):
                    self.producer.abort_transaction()
                committed = self.consumer.committed(self.tps)
                for tp in self.tps:
                    self.consumer.seek(tp, committed.get(tp) or 0)
        return self.commits

    def close(self):
        self.producer.close()
        self.consumer.close()


def _fault_target(bus, fault, source_topic, sink_topic, transformer):
    if fault.endswith("producer"):
        return ray.get(transformer.pid.remote(), timeout=60)
    if fault.endswith("leader"):
        statuses = ray.get(bus.controller.replica_statuses.remote(sink_topic), timeout=60)
        return next(r["pid"] for r in statuses[0] if r.get("role") == "leader")
    return ray.get(bus.controller.ping.remote(), timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "fault",
    ["kill-producer", "pause-producer", "kill-leader", "pause-leader", "kill-controller", "pause-controller"],
)
def test_consume_transform_produce_is_exactly_once_through_a_fault(bus, topic_name, fault):
    source, sink, partitions = f"{topic_name}-in", f"{topic_name}-out", 2
    bus.admin.create_topic(source, partitions=partitions)
    bus.admin.create_topic(sink, partitions=partitions)
    inputs = [f"v{i}".encode() for i in range(INPUT_RECORDS)]
    with logbus.Producer(bus, acks="all") as loader:
        for i, value in enumerate(inputs):
            loader.send(source, value, partition=i % partitions)
    tid, group = f"{topic_name}-tx", f"{topic_name}-g"
    transformer = Transformer.remote(bus, source, sink, partitions, tid, group)
    wait_for(lambda: ray.get(transformer.steps.remote(3), timeout=180) >= 2, timeout_s=180, message="first transactions")
    target = _fault_target(bus, fault, source, sink, transformer)
    if fault.startswith("kill"):
        os.kill(target, signal.SIGKILL)
        if fault == "kill-producer":
            transformer = Transformer.remote(bus, source, sink, partitions, tid, group)  # fences what the dead one left
        else:
            # The transformer retries through the leader's or the controller's restart.
            steps = transformer.steps.remote(5)
            with contextlib.suppress(Exception):
                ray.get(steps, timeout=180)
    else:
        stepping = transformer.steps.remote(5) if fault != "pause-producer" else None
        with paused(target):
            if fault == "pause-producer":
                # A second instance takes over while the first is stopped; the first is a zombie.
                successor = Transformer.remote(bus, source, sink, partitions, tid, group)
            time.sleep(PAUSE_S)  # the fault's length (the step above runs into the paused process)
        if stepping is not None:
            with contextlib.suppress(Exception):
                ray.get(stepping, timeout=180)
        if fault == "pause-producer":
            with pytest.raises(ProducerFencedError):
                for _ in range(20):
                    ray.get(transformer.steps.remote(5), timeout=180)
            ray.kill(transformer)
            transformer = successor

    def caught_up():
        ray.get(transformer.steps.remote(10), timeout=180)
        consumer = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
        try:
            committed = consumer.committed([TopicPartition(source, p) for p in range(partitions)])
        finally:
            consumer.close()
        return sum(v or 0 for v in committed.values()) == INPUT_RECORDS

    wait_for(caught_up, timeout_s=300, interval_s=0, message="every input committed through a transaction")
    ray.get(transformer.close.remote(), timeout=120)
    outputs = committed_values(bus, sink, partitions)
    assert outputs == sorted(b"out-" + v for v in inputs)  # each input once: none lost, none twice, none aborted
