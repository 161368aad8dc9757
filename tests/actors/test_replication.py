"""Replication and failover on a multi-node Ray cluster on one machine (ray.cluster_utils.Cluster).

Faults are injected for real: Ray nodes removed without grace, replica and
controller processes killed with SIGKILL, a follower paused with SIGSTOP,
segment bytes truncated or flipped. After each run the invariants are
checked: no acknowledged record lost, no duplicates (idempotent producer),
every offset holds the same bytes on every replica, offsets never reused.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import threading
import time
import uuid

import psutil
import pyarrow as pa
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.actors.channel_client import channels
from logbus.actors.controller import CONTROLLER_NAME
from logbus.actors.remote import get
from logbus.cli import main
from logbus.errors import NotEnoughReplicasError
from logbus.storage.record_batch import encode_batch
from tests.actors.multinode import REPLICA_RESOURCE
from tests.actors.replica_files import committed_bytes
from tests.actors.test_metrics import scrape, total
from logbus.actors.node_agent import agent_actor_name
from tests.conftest import close_bus, wait_for
from tests.healing import assert_healed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

@pytest.fixture
def rbus(cluster, tmp_path):
    bus = logbus.connect(data_dir=str(tmp_path / "data"), namespace=f"r-{uuid.uuid4().hex[:8]}", replica_replacement_ms=2000)
    yield bus
    close_bus(bus)


def statuses(bus, topic):
    """Every replica's own view; retried while the controller is briefly unreachable (a node just died)."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    deadline = time.monotonic() + 60
    while True:
        try:
            return ray.get(controller.replica_statuses.remote(topic), timeout=60)[0]
        except ray.exceptions.RayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def leader_status(bus, topic):
    """(the partition as described, the leader's own status or None); retried over transient errors."""
    deadline = time.monotonic() + 60
    while True:
        try:
            described = bus.admin.describe_topic(topic).partitions[0]
            break
        except logbus.LogbusError as error:
            if not error.retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    # Asked of the leader alone: a paused or unreachable follower would hold up a question to every replica.
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    while True:
        try:
            handle = ray.get(controller.topic_metadata.remote(topic), timeout=60)["partitions"][0]["leader"]
            break
        except ray.exceptions.RayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        status = ray.get(handle.status.remote(), timeout=5) if handle is not None else None
    except ray.exceptions.RayError:
        status = None
    if status is not None and status.get("replica_id") == described.leader and status.get("role") == "leader":
        return described, status
    return described, None


def serving_leader(bus, topic, timeout_s=60):
    """(the partition as described, the leader's own status) once the leader answers, as leader."""
    return wait_for(lambda: (lambda found: found if found[1] else None)(leader_status(bus, topic)), timeout_s=timeout_s,
                    interval_s=0.2, message="the leader's own status")


def wait_isr(bus, topic, size, timeout_s=90):
    return wait_for(
        lambda: (lambda described, status: len(described.isr) == size and status)(*leader_status(bus, topic)),
        timeout_s=timeout_s,
        interval_s=0.2,
        message=f"ISR of {size}",
    )


def wait_new_leader(bus, topic, old_epoch, timeout_s=60):
    """Seconds until a leader with a higher epoch holds the partition and says so itself."""
    started = time.monotonic()

    seen = []

    def elected():
        described, status = leader_status(bus, topic)
        seen[:] = [described, status]
        return status is not None and described.leader_epoch > old_epoch and status["leader_epoch"] == described.leader_epoch

    try:
        wait_for(elected, timeout_s=timeout_s, interval_s=0.05, message="a new leader")
    except AssertionError as error:
        raise AssertionError(f"{error}; last seen: {seen}; replicas: {statuses(bus, topic)}") from None
    return time.monotonic() - started


class Workload:
    """An idempotent acks='all' producer sending unique values from a thread until stopped, at most
    about ``200 / pause_s`` records a second."""

    def __init__(self, bus, topic, pause_s: float = 0.01):
        self.producer = logbus.Producer(bus, acks="all", linger_ms=2, delivery_timeout_ms=120_000, request_timeout_ms=10_000)
        self.topic = topic
        self.pause_s = pause_s
        self.futures = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        i = 0
        while not self.stop_event.is_set():
            self.futures.append((b"v-%d" % i, self.producer.send(self.topic, b"v-%d" % i)))
            i += 1
            if i % 200 == 0:
                time.sleep(self.pause_s)  # by default about 20,000 records/s: steady, not a flood

    def acknowledged_count(self):
        return sum(1 for _, f in list(self.futures) if f.done() and f.exception() is None)

    def stop(self):
        """Stop sending and close the producer, failing what is still unacknowledged after 5 s."""
        self.stop_event.set()
        self.thread.join(timeout=30)
        self.producer.close(timeout_s=5)

    def finish(self):
        self.stop_event.set()
        self.thread.join(timeout=30)
        self.producer.flush(timeout_s=180)
        self.producer.close()
        acknowledged = {}
        for value, future in self.futures:
            if future.exception() is None:
                acknowledged[value] = future.result().offset
        return acknowledged


def check_invariants(bus, topic, acknowledged, replication_factor):
    """No acknowledged record lost, no duplicates, one value per offset, identical replicas."""
    tp = TopicPartition(topic, 0)
    wait_isr(bus, topic, replication_factor)
    consumer = logbus.Consumer(bus)
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    tables, total = [], 0

    def drained():
        nonlocal total
        table = consumer.poll_arrow(timeout_ms=500)
        tables.append(table)
        total += table.num_rows
        return total >= end

    wait_for(drained, timeout_s=120, interval_s=0, message="drain")
    table = pa.concat_tables(tables)
    offsets = table["offset"].to_pylist()
    values = table["value"].to_pylist()
    assert offsets == list(range(len(offsets))), "offsets must be contiguous and never reused"
    assert len(set(values)) == len(values), "the idempotent producer wrote a record twice"
    stored = dict(zip(values, offsets))
    lost = [v for v in acknowledged if v not in stored]
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {lost[:3]}"
    moved = [v for v, o in acknowledged.items() if stored[v] != o]
    assert not moved, f"acknowledged records at other offsets than acknowledged: {moved[:3]}"

    # Every replica holds the same bytes for every committed offset.
    described = bus.admin.describe_topic(topic).partitions[0]
    wait_for(
        lambda: all(s.get("log_end_offset") == described.log_end_offset for s in statuses(bus, topic)),
        timeout_s=90,
        message="followers caught up",
    )
    copies = [committed_bytes(bus.data_dir, topic, 0, r, described.high_watermark) for r in described.replicas]
    assert len(copies) == replication_factor
    assert all(bytes(c) == bytes(copies[0]) for c in copies[1:]), "replicas differ below the high watermark"
    return len(values)


def test_leader_node_killed_twice(cluster, rbus):
    topic = "orders"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    workload = Workload(rbus, topic)
    failovers = []
    try:
        for _ in range(2):  # the replica placed after the first kill takes part in the second failover
            wait_isr(rbus, topic, 3)
            acked_before = workload.acknowledged_count()
            wait_for(lambda: workload.acknowledged_count() > acked_before + 500, timeout_s=60, message="progress")
            described, status = serving_leader(rbus, topic)
            node = next(n for n in cluster.worker_nodes if n.node_id == status["node_id"])
            kill_node(cluster, node)
            failovers.append(wait_new_leader(rbus, topic, described.leader_epoch))
            cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE)  # room for the replacement replica
            acked = workload.acknowledged_count()
            wait_for(lambda: workload.acknowledged_count() > acked + 200, timeout_s=60, message="writes resume")
        acknowledged = workload.finish()
    finally:
        workload.stop()  # also on failure: no producer thread may outlive its test
    stored = check_invariants(rbus, topic, acknowledged, 3)
    assert_healed(rbus, topic)
    print(
        f"\nnode-kill failover: p50 {statistics.median(failovers):.2f}s, max {max(failovers):.2f}s; "
        f"{len(acknowledged)} acknowledged, {stored} stored"
    )


def kill_node(cluster, node):
    """The node dies: its raylet and every process on it, at once.

    ``remove_node`` kills the raylet and its agents but leaves worker processes to notice
    that on their own; until they do, an actor there keeps answering direct calls (a
    leader would keep its lease and its producers). A machine that dies takes them all.
    """
    raylet = node.all_processes["raylet"][0].process
    processes = psutil.Process(raylet.pid).children(recursive=True)
    for process in processes:
        try:
            process.suspend()
        except psutil.NoSuchProcess:
            pass
    cluster.remove_node(node, allow_graceful=False)
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def kill_process(pid):
    os.kill(pid, signal.SIGKILL)


def test_process_faults_and_controller_restart(cluster, rbus):
    topic = "payments"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2, "replica.lag.time.max.ms": 1500})
    workload = Workload(rbus, topic)
    try:
        run_process_faults(rbus, topic, workload)
        acknowledged = workload.finish()
    finally:
        workload.stop()
    check_invariants(rbus, topic, acknowledged, 3)
    assert_healed(rbus, topic)


def run_process_faults(rbus, topic, workload):
    def progress(extra=300):
        acked = workload.acknowledged_count()
        wait_for(lambda: workload.acknowledged_count() > acked + extra, timeout_s=90, message="progress")

    wait_isr(rbus, topic, 3)
    progress()
    # 1. The leader's actor process is killed.
    described, status = serving_leader(rbus, topic)
    kill_process(status["pid"])
    progress()
    wait_isr(rbus, topic, 3)
    # 2. A follower is paused past replica.lag.time.max.ms: it leaves the ISR, then rejoins.
    described, status = serving_leader(rbus, topic)
    follower = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
    os.kill(follower["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: follower["replica_id"] not in rbus.admin.describe_topic(topic).partitions[0].isr, timeout_s=60, message="ISR shrink")
        progress()  # two in-sync replicas still meet min.insync.replicas
    finally:
        os.kill(follower["pid"], signal.SIGCONT)
    wait_isr(rbus, topic, 3)
    # 3. A follower dies, then at once the leader (the KIP-101 case).
    described, status = serving_leader(rbus, topic)
    follower = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
    kill_process(follower["pid"])
    kill_process(status["pid"])
    progress()
    wait_isr(rbus, topic, 3)
    # 4. The controller's process is killed mid-stream.
    controller = ray.get_actor(CONTROLLER_NAME, namespace=rbus.namespace)
    kill_process(ray.get(controller.ping.remote()))
    progress()


def test_not_enough_replicas_is_refused_and_never_exposed(cluster, rbus):
    topic = "strict"
    rbus.admin.create_topic(
        topic, partitions=1, replication_factor=2, config={"min.insync.replicas": 2, "replica.lag.time.max.ms": 1000}
    )
    wait_isr(rbus, topic, 2)
    with logbus.Producer(rbus, acks="all") as producer:
        producer.send(topic, b"committed").result(timeout=60)
    follower = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
    os.kill(follower["pid"], signal.SIGSTOP)
    try:
        wait_isr(rbus, topic, 1)
        producer = logbus.Producer(rbus, acks="all", delivery_timeout_ms=3000)
        futures = [producer.send(topic, b"refused-%d" % i) for i in range(20)]
        producer.flush(timeout_s=60)
        for future in futures:
            assert isinstance(future.exception(), NotEnoughReplicasError)
        producer.close()
    finally:
        os.kill(follower["pid"], signal.SIGCONT)
    wait_isr(rbus, topic, 2)
    consumer = logbus.Consumer(rbus)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    values = []
    wait_for(lambda: values.extend(consumer.poll_arrow(timeout_ms=300)["value"].to_pylist()) or values, timeout_s=30, message="records")
    values += consumer.poll_arrow(timeout_ms=1000)["value"].to_pylist()
    assert values == [b"committed"]
    assert assert_healed(rbus, topic) == {0: 1}


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_follower_segment_recovers_and_refetches(cluster, rbus, damage):
    topic = f"damaged-{damage}"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    with logbus.Producer(rbus, acks="all", linger_ms=0) as producer:
        for i in range(300):
            producer.send(topic, b"d-%d" % i)
    wait_isr(rbus, topic, 3)
    follower = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
    directory = os.path.join(rbus.data_dir, f"replica-{follower['replica_id']}", f"{topic}-0")
    segment = os.path.join(directory, "00000000000000000000.log")
    os.kill(follower["pid"], signal.SIGSTOP)  # hold it still while its file is damaged
    size = os.path.getsize(segment)
    with open(segment, "r+b") as file:
        if damage == "truncate":
            file.truncate(size - 37)
        else:
            file.seek(size - 50)
            byte = file.read(1)
            file.seek(size - 50)
            file.write(bytes([byte[0] ^ 0x5A]))
    kill_process(follower["pid"])  # Ray restarts it: recovery cuts the damaged batch, then it refetches
    restarted = wait_for(
        lambda: next(
            (s for s in statuses(rbus, topic) if s.get("replica_id") == follower["replica_id"] and s.get("pid") not in (None, follower["pid"])),
            None,
        ),
        timeout_s=90,
        message="follower restart",
    )
    assert restarted["recovery"]["truncated_bytes"] > 0
    check_invariants(rbus, topic, {b"d-%d" % i: i for i in range(300)}, 3)
    assert assert_healed(rbus, topic) == {0: 300}


def epoch_moved_after(bus, topic, old_epoch, timeout_s=60) -> float:
    """Seconds until the controller's metadata names a leader with a higher epoch (asks no replica:
    a paused one would hold up the measurement)."""
    started = time.monotonic()

    def moved():
        metadata = bus.topic_metadata(topic, refresh=True)
        return metadata.leader_epochs[0] > old_epoch and metadata.leaders[0] is not None

    wait_for(moved, timeout_s=timeout_s, interval_s=0.02, message="a new leader in the metadata")
    return time.monotonic() - started


def test_a_paused_leader_is_replaced_and_refuses_writes_when_it_runs_again(cluster, rbus):
    """SIGSTOP on a live node: the agent reports the leader down, a new leader is elected once the
    paused one's fence holds the new epoch, and the writes queued to the paused one are refused when
    it runs again: nothing from a deposed leader is acknowledged or stored."""
    topic = "paused"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    acknowledged = {}
    with logbus.Producer(rbus, acks="all") as producer:
        for i in range(200):
            value = b"before-%d" % i
            acknowledged[value] = producer.send(topic, value)
    described, status = serving_leader(rbus, topic)
    deposed = rbus.topic_metadata(topic, refresh=True).leaders[0]
    os.kill(status["pid"], signal.SIGSTOP)
    try:
        epoch_moved_after(rbus, topic, described.leader_epoch)
        wait_new_leader(rbus, topic, described.leader_epoch, timeout_s=60)
        # Produce requests straight to the paused leader wait in its mailbox until it runs again.
        queued = [deposed.produce.remote(encode_batch([b"deposed-%d" % i]), "all") for i in range(5)]
        queued += [deposed.produce.remote(encode_batch([b"deposed-one-%d" % i]), 1) for i in range(5)]
        with logbus.Producer(rbus, acks="all") as producer:
            for i in range(200):
                value = b"after-%d" % i
                acknowledged[value] = producer.send(topic, value)
    finally:
        os.kill(status["pid"], signal.SIGCONT)
    for ref in queued:
        with pytest.raises(logbus.NotLeaderError):
            get(ref, timeout_s=60)
    acknowledged = {value: future.result().offset for value, future in acknowledged.items()}
    check_invariants(rbus, topic, acknowledged, 3)
    tp = TopicPartition(topic, 0)
    consumer = logbus.Consumer(rbus)
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    values = []
    wait_for(lambda: values.extend(consumer.poll_arrow(timeout_ms=500)["value"].to_pylist()) or len(values) >= end, timeout_s=60, message="drain")
    assert not [v for v in values if v.startswith(b"deposed")], "a deposed leader's write was stored"
    consumer.close()
    assert assert_healed(rbus, topic) == {0: len(acknowledged)}


def test_a_killed_leader_process_on_a_live_node_fails_over(cluster, rbus):
    topic = "killed"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    described, status = serving_leader(rbus, topic)
    kill_process(status["pid"])
    epoch_moved_after(rbus, topic, described.leader_epoch)
    wait_new_leader(rbus, topic, described.leader_epoch, timeout_s=60)
    with logbus.Producer(rbus, acks="all") as producer:
        assert producer.send(topic, b"after").result(timeout=60).offset >= 0
    assert_healed(rbus, topic)


def test_followers_fetch_over_their_links_and_a_reset_link_loses_nothing(cluster, rbus):
    """Followers fetch from the leader over TCP fetch links once open. Under acks=all load, every link
    to the leader is reset from outside (``ss -K``, as a middlebox or a dying connection would): the
    followers fetch with actor calls meanwhile, open new links, and nothing acknowledged is lost."""
    topic = "linked"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    workload = Workload(rbus, topic)
    try:
        def linked():
            followers = [s for s in statuses(rbus, topic) if s.get("role") == "follower"]
            return len(followers) == 2 and all(s["linked_fetches"] > 20 for s in followers) and followers

        wait_for(linked, timeout_s=90, interval_s=0.2, message="both followers fetching over their links")
        described, status = serving_leader(rbus, topic)
        handle = ray.get(controller_of(rbus).topic_metadata.remote(topic), timeout=60)["partitions"][0]["leader"]
        address = ray.get(handle.fetch_link_address.remote(), timeout=60)
        assert status["linked_fetches_served"] > 0 and status["fetch_links_opened"] >= 2
        opened_before = status["fetch_links_opened"]
        before = {s["replica_id"]: s["linked_fetches"] for s in linked()}
        acknowledged_before = workload.acknowledged_count()
        killed = subprocess.run(["ss", "-K", "dst", address["host"], "dport", "=", str(address["port"])],
                                capture_output=True, text=True, timeout=30)
        assert killed.returncode == 0, killed.stderr
        assert killed.stdout.count("ESTAB") >= 2, killed.stdout  # both followers' connections were reset

        def linked_again():
            now = {s["replica_id"]: s["linked_fetches"] for s in linked() or []}
            return now.keys() == before.keys() and all(now[r] > before[r] + 20 for r in now)

        wait_for(linked_again, timeout_s=90, interval_s=0.2, message="both followers fetching over new links")
        assert serving_leader(rbus, topic)[1]["fetch_links_opened"] >= opened_before + 2
        wait_for(lambda: workload.acknowledged_count() > acknowledged_before + 500, timeout_s=90, message="more writes")
        acknowledged = workload.finish()
    finally:
        workload.stop()
    assert check_invariants(rbus, topic, acknowledged, 3) >= len(acknowledged)
    assert_healed(rbus, topic)


def test_clients_on_another_node_use_the_leaders_channel_over_tcp_and_a_reset_loses_nothing(cluster, rbus):
    """The driver's producer and consumer (on the head node) reach a leader on another node over the
    replica's channel on TCP rather than actor calls. Under acks=all load the connection is reset from
    outside (``ss -K``): the requests on it fail retriably and are sent again, a new connection opens,
    and nothing acknowledged is lost or written twice."""
    topic = "remote-clients"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    leader = rbus.topic_metadata(topic).leaders[0]
    connection = wait_for(lambda: channels().connection(leader), timeout_s=60, message="a channel to the leader")
    assert connection.remote  # the leader is on a replica node, the driver on the head node
    with logbus.Producer(rbus, acks="all", linger_ms=0) as producer:
        offsets = [producer.send(topic, b"one-%d" % i).result(30).offset for i in range(200)]
    assert offsets == list(range(200))
    assert connection.requests_sent >= 200
    address = ray.get(leader.channel_address.remote(), timeout=60)[2]
    workload = Workload(rbus, topic)
    try:
        wait_for(lambda: workload.acknowledged_count() > 1000, timeout_s=90, message="load")
        killed = subprocess.run(["ss", "-K", "dst", address["host"], "dport", "=", str(address["port"])],
                                capture_output=True, text=True, timeout=30)
        assert killed.returncode == 0, killed.stderr
        assert "ESTAB" in killed.stdout, killed.stdout
        wait_for(lambda: connection.closed, timeout_s=30, message="the reset connection closed")
        acknowledged_before = workload.acknowledged_count()
        again = wait_for(lambda: (lambda c: c if c is not None and c is not connection else None)(channels().connection(leader)),
                         timeout_s=60, message="a new channel to the leader")
        wait_for(lambda: workload.acknowledged_count() > acknowledged_before + 1000, timeout_s=90, message="more writes")
        acknowledged = workload.finish()
    finally:
        workload.stop()
    assert again.requests_sent > 0 and again.remote
    assert check_invariants(rbus, topic, acknowledged, 3) >= len(acknowledged) + 200


def test_a_lost_follower_shows_in_the_metrics_and_in_status(cluster, rbus):
    """A follower's node is removed under load: the ISR shrinks, the partition is under-replicated in
    the controller's gauge and in `logbus status --json`, and the shrink is counted."""
    topic = "watched"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2, "replica.lag.time.max.ms": 1500})
    wait_isr(rbus, topic, 3)
    shrinks_before = total(scrape(), "ray_logbus_isr_shrinks_total")
    workload = Workload(rbus, topic)
    try:
        wait_for(lambda: workload.acknowledged_count() > 300, timeout_s=90, message="load")
        follower = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
        node = next(n for n in cluster.list_all_nodes() if n.node_id == follower["node_id"])
        kill_node(cluster, node)
        wait_isr(rbus, topic, 2)

        def gauged():
            # Both from one scrape: the gauge and the counter may arrive in different exports.
            samples = scrape()
            shown = total(samples, "ray_logbus_under_replicated_partitions") >= 1
            return samples if shown and total(samples, "ray_logbus_isr_shrinks_total") > shrinks_before else None

        samples = wait_for(gauged, timeout_s=90, interval_s=1, message="the under-replicated gauge and the shrink counted")
        assert total(samples, "ray_logbus_offline_partitions") == 0
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--address", cluster.address, "--namespace", rbus.namespace, "--data-dir", rbus.data_dir, "status", "--json"])
        assert code == 0
        status = json.loads(out.getvalue()[out.getvalue().index("{"):])
        assert [(p["topic"], p["partition"], len(p["isr"])) for p in status["under_replicated_partitions"]] == [(topic, 0, 2)]
        acknowledged = workload.finish()
    finally:
        workload.stop()
    assert len(acknowledged) > 300
    cluster.add_node(num_cpus=1, resources=REPLICA_RESOURCE)  # room for the lost replica's replacement
    assert_healed(rbus, topic)


def controller_of(bus):
    return ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)


def metadata_now(bus, topic):
    """The controller's view of partition 0 (leader id, epoch, ISR), retried over a controller restart."""
    def ask():
        try:
            return bus.admin.describe_topic(topic).partitions[0]
        except (logbus.LogbusError, ray.exceptions.RayError):
            return None
    return wait_for(ask, timeout_s=120, interval_s=0.1, message="the controller's answer")


def agent_pid(bus, node_id):
    return ray.get(ray.get_actor(agent_actor_name(node_id), namespace=bus.namespace).ping.remote(), timeout=60)


def replica_status(bus, topic, replica_id):
    return next(s for s in statuses(bus, topic) if s.get("replica_id") == replica_id)


def test_a_deposed_leader_that_missed_its_role_change_rejoins_as_a_follower(cluster, rbus):
    """The leader's process and its node's agent are paused: the node's lease runs out, another replica
    is elected, and the become_follower sent to the old leader fails (not answered in time). The
    controller keeps it pending and delivers it once the node is heard again: the old leader follows,
    and the ISR is whole again."""
    topic = "deposed"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2, "replica.lag.time.max.ms": 1500})
    wait_isr(rbus, topic, 3)
    with logbus.Producer(rbus, acks="all") as producer:
        for i in range(100):
            producer.send(topic, b"before-%d" % i)
    described, status = serving_leader(rbus, topic)
    old = status["replica_id"]
    paused = [status["pid"], agent_pid(rbus, status["node_id"])]
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        epoch_moved_after(rbus, topic, described.leader_epoch)

        def missed():
            pending = ray.get(controller_of(rbus).role_deliveries.remote(), timeout=30)
            return [p for p in pending if tuple(p["key"]) == (topic, 0, old) and p["attempts"] >= 1 and not p["in_flight"]]

        wait_for(missed, timeout_s=90, interval_s=0.2, message="a failed become_follower to the paused old leader")
        with logbus.Producer(rbus, acks="all") as producer:
            for i in range(100):
                producer.send(topic, b"after-%d" % i)
    finally:
        for pid in reversed(paused):
            os.kill(pid, signal.SIGCONT)
    current = metadata_now(rbus, topic)
    wait_for(
        lambda: (lambda s: s.get("role") == "follower" and s.get("leader_epoch") >= current.leader_epoch)(replica_status(rbus, topic, old)),
        timeout_s=90, interval_s=0.2, message="the old leader following the new one",
    )
    wait_isr(rbus, topic, 3)
    wait_for(lambda: not ray.get(controller_of(rbus).role_deliveries.remote(), timeout=30), timeout_s=60, message="no role change pending")
    assert assert_healed(rbus, topic) == {0: 200}


def test_a_controller_restart_elects_from_the_isr_when_the_preferred_replica_is_out_of_it(cluster, rbus):
    """The preferred replica leaves the ISR (paused while the other led on), then the only in-sync one
    is paused too: no leader. The preferred one runs again, the controller is killed, the in-sync one
    continued: the restarted controller elects the in-sync replica, never the preferred one."""
    topic = "isr-restart"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=2, config={"min.insync.replicas": 1, "replica.lag.time.max.ms": 1000})
    wait_isr(rbus, topic, 2)
    described, status = serving_leader(rbus, topic)
    assert status["replica_id"] == described.replicas[0]  # a new partition's preferred replica leads
    first = replica_status(rbus, topic, status["replica_id"])
    other = next(r for r in described.replicas if r != first["replica_id"])
    second = replica_status(rbus, topic, other)
    acknowledged = {}
    with logbus.Producer(rbus, acks="all") as producer:
        for i in range(50):
            acknowledged[b"a-%d" % i] = producer.send(topic, b"a-%d" % i)
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        epoch_moved_after(rbus, topic, described.leader_epoch)
        wait_for(lambda: metadata_now(rbus, topic).isr == (other,), timeout_s=60, message="the ISR without the paused replica")
        with logbus.Producer(rbus, acks="all") as producer:
            for i in range(50):
                acknowledged[b"b-%d" % i] = producer.send(topic, b"b-%d" % i)  # only the in-sync replica has these
        os.kill(second["pid"], signal.SIGSTOP)
        try:
            wait_for(lambda: metadata_now(rbus, topic).leader is None, timeout_s=60, message="no leader")
            os.kill(first["pid"], signal.SIGCONT)  # out of the ISR: may not lead (unclean election is off)
            first = None
            kill_process(ray.get(controller_of(rbus).ping.remote()))
        finally:
            os.kill(second["pid"], signal.SIGCONT)
    finally:
        if first is not None:
            os.kill(first["pid"], signal.SIGCONT)
    wait_for(lambda: metadata_now(rbus, topic).leader == other, timeout_s=60, interval_s=0.1, message="the in-sync replica elected")
    acknowledged = {value: future.result(timeout=60).offset for value, future in acknowledged.items()}
    check_invariants(rbus, topic, acknowledged, 2)
    assert assert_healed(rbus, topic) == {0: 100}


def test_unclean_election_off_keeps_a_partition_leaderless_and_on_elects_an_out_of_sync_replica(cluster, rbus):
    topic = "unclean"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=2, config={"min.insync.replicas": 1, "replica.lag.time.max.ms": 1000})
    wait_isr(rbus, topic, 2)
    described, status = serving_leader(rbus, topic)
    leader = status
    follower = next(s for s in statuses(rbus, topic) if s.get("replica_id") != leader["replica_id"])
    with logbus.Producer(rbus, acks="all") as producer:
        for i in range(20):
            producer.send(topic, b"both-%d" % i)
    os.kill(follower["pid"], signal.SIGSTOP)
    paused = [follower["pid"]]
    altering = None
    try:
        wait_for(lambda: metadata_now(rbus, topic).isr == (leader["replica_id"],), timeout_s=60, message="the ISR shrunk to the leader")
        with logbus.Producer(rbus, acks="all") as producer:
            for i in range(20):
                producer.send(topic, b"leader-only-%d" % i)
        os.kill(leader["pid"], signal.SIGSTOP)
        paused.append(leader["pid"])
        wait_for(lambda: metadata_now(rbus, topic).leader is None, timeout_s=60, message="no leader")
        os.kill(follower["pid"], signal.SIGCONT)  # alive again, but out of sync
        paused.remove(follower["pid"])
        wait_for(lambda: replica_status(rbus, topic, follower["replica_id"]).get("pid") == follower["pid"], timeout_s=60,
                 message="the out-of-sync replica answering")

        def seen_up():
            nodes = ray.get(controller_of(rbus).nodes.remote(), timeout=60)
            return any(n["node_id"] == follower["node_id"] and n["replicas_down"] == 0 for n in nodes)

        wait_for(seen_up, timeout_s=60, interval_s=0.2, message="the controller counting the replica up")
        current = metadata_now(rbus, topic)
        assert current.leader is None, "an out-of-sync replica was elected with unclean.leader.election.enable off"
        # alter_config returns once every replica applied the change, the paused one too: it runs aside.
        altering = threading.Thread(target=rbus.admin.alter_config, args=(topic, {"unclean.leader.election.enable": True}), daemon=True)
        altering.start()
        wait_for(lambda: metadata_now(rbus, topic).leader == follower["replica_id"], timeout_s=60, interval_s=0.1,
                 message="the out-of-sync replica elected, unclean")
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    altering.join(timeout=120)
    assert altering is not None and not altering.is_alive()
    read = assert_healed(rbus, topic)
    assert read[0] >= 20  # what both had; the old leader's own records are lost, as unclean election allows
    wait_isr(rbus, topic, 2)  # the old leader truncates to the new leader's log and follows
