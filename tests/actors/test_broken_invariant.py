"""A replica that finds a broken invariant ends its process, and comes back from its files with its data.

The violation is injected for real, through the log's test hook
(``PartitionLog.test_hook_break_next_append``, called by the replica's
``test_hook_break_next_append``; accepted because tests/conftest.py sets
LOGBUS_TEST_HOOKS=1 for every Ray process the tests start): the next batch
the replica writes fails the append's post-condition, as a bug in the
append would. A follower meets it copying from its leader, a leader taking
a produce. The replica's process must end (no retry loop may swallow it),
say why in its log, and come back: Ray restarts the actor, it reopens its
log, and the partition has its full ISR again, with every acknowledged
record at the offset it was acknowledged at, on every replica.
"""

from __future__ import annotations

import glob
import os

import psutil
import pytest
import ray

import logbus
from logbus.actors.controller import CONTROLLER_NAME
from logbus.actors.partition_replica import replica_actor_name
from tests.actors.test_replication import check_invariants, rbus, serving_leader, statuses, wait_isr  # noqa: F401 (rbus: a fixture)
from tests.conftest import wait_for
from tests.healing import assert_healed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def replica_handle(bus, topic, status):
    """The actor handle of the replica whose own status is ``status`` (partition 0)."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    topic_id = ray.get(controller.topic_metadata.remote(topic), timeout=60)["topic_id"]
    name = replica_actor_name(topic, topic_id, 0, status["replica_id"], status["node_id"])
    return ray.get_actor(name, namespace=bus.namespace)


def process_ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def worker_log(pid: int) -> str:
    """What the Ray worker process ``pid`` wrote to its stderr (its log file in the session's logs)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    paths = glob.glob(os.path.join(session, "logs", f"worker-*-{pid}.err"))
    return "".join(open(path, errors="replace").read() for path in paths)


def produce(bus, topic, prefix, count):
    """Send ``count`` records with acks=all (idempotent); returns {value: offset} of those acknowledged."""
    with logbus.Producer(bus, acks="all", linger_ms=2, delivery_timeout_ms=120_000, request_timeout_ms=10_000) as producer:
        futures = {b"%s-%d" % (prefix, i): producer.send(topic, b"%s-%d" % (prefix, i)) for i in range(count)}
        producer.flush(timeout_s=180)
    return {value: future.result().offset for value, future in futures.items() if future.exception() is None}


@pytest.mark.parametrize("role", ["follower", "leader"])
def test_a_replica_that_breaks_an_invariant_ends_and_comes_back_with_its_data(cluster, rbus, role):
    topic = f"broken-{role}"
    rbus.admin.create_topic(topic, partitions=1, replication_factor=3, config={"min.insync.replicas": 2})
    wait_isr(rbus, topic, 3)
    acknowledged = produce(rbus, topic, b"before", 300)
    assert len(acknowledged) == 300
    wait_isr(rbus, topic, 3)
    if role == "leader":
        _, target = serving_leader(rbus, topic)
    else:
        target = next(s for s in statuses(rbus, topic) if s.get("role") == "follower")
    pid = ray.get(replica_handle(rbus, topic, target).test_hook_break_next_append.remote(), timeout=60)
    assert pid == target["pid"]

    # The next batch it writes (a produce the leader takes, or its copy on the follower) breaks the rule.
    after = produce(rbus, topic, b"after", 300)
    wait_for(lambda: process_ended(pid), timeout_s=60, message=f"the replica's process {pid} to end")
    assert "invariant broken, ending process" in worker_log(pid)
    assert "was appended to a log ending at" in worker_log(pid)
    assert after, "no record was acknowledged after the replica ended"
    acknowledged.update(after)

    # Ray starts it again (another process), it reopens its log and rejoins the ISR.
    wait_for(
        lambda: any(s.get("replica_id") == target["replica_id"] and s.get("pid") not in (None, pid) for s in statuses(rbus, topic)),
        timeout_s=120,
        message="the replica restarted",
    )
    check_invariants(rbus, topic, acknowledged, 3)  # full ISR; every acknowledged record at its offset, on every replica
    assert assert_healed(rbus, topic)[0] >= len(acknowledged)
