"""Stable node identity on hosts with addresses and disks of their own: a host is its data directory, not its Ray node.

On the namespace cluster (``netns_cluster``, tests/cluster/netns.py), each
replica host joins with ``logbus join --data-dir`` (a directory of its own:
its "disk"), which gives it a logbus node id on first start and advertises
it as a Ray node label. Checked here, on one logbus cluster (a host's data
directory belongs to one cluster), in order:

- a host killed and joined again at once comes back as a new Ray node and
  gets its replicas back with their data: a replication-factor-1 partition
  whose only replica is there leads again, replication-factor-3 followers
  fetch only what they missed, and every partition heals to its full ISR
  with the same replicas (none replaced);
- a whole-cluster restart (every host's processes killed, the head started
  again, every host joined again with its data directory: new Ray node ids
  everywhere) loses nothing at factor 1 and copies nothing at factor 3:
  every follower has fetched 0 bytes once every partition is back to its
  full ISR, and every record is read back;
- a host whose data directory belongs to another cluster is refused, with
  an error naming both cluster ids, and hosts nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from logbus.actors.placement import replica_directory
from logbus.storage.node_identity import META_FILE, NodeMeta, is_node_id, new_node_id
from tests.cluster.history import check, load
from tests.cluster.netns import CLIENT
from tests.cluster.workload import Workload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HEAL_TIMEOUT_S = 240.0
RECORDS = 300


@pytest.fixture(scope="module")
def session(netns_cluster, tmp_path_factory):
    """One logbus cluster on the namespace cluster, its workload driver replaced when the whole cluster restarts."""
    directory = tmp_path_factory.mktemp("identity")
    state = SimpleNamespace(data_dir=str(directory / "data"), namespace=f"ni-{uuid.uuid4().hex[:8]}",
                            history_path=str(directory / "history.jsonl"), acked={})
    state.workload = Workload(netns_cluster, state.data_dir, state.namespace, state.history_path)
    yield state
    state.workload.close()


def _healed(described: dict) -> bool:
    """Every partition has a leader and its full ISR, as the controller says and as its leader sees it; every replica answers."""
    for partition, statuses in zip(described["partitions"], described["statuses"]):
        replicas = sorted(partition["replicas"])
        if partition["leader"] is None or sorted(partition["isr"]) != replicas or any(s.get("error") for s in statuses):
            return False
        leaders = [s for s in statuses if s.get("role") == "leader"]
        if len(leaders) != 1 or sorted(leaders[0].get("isr") or []) != replicas:
            return False
        if len({s["log_end_offset"] for s in statuses}) != 1:  # followers caught up (nothing is being produced)
            return False
    return True


def wait_healed(workload: Workload, topics: list[str], timeout_s: float = HEAL_TIMEOUT_S) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        described, last_error = {}, None
        try:
            described = {topic: workload.call("describe", topic=topic, reply_timeout_s=120) for topic in topics}
        except AssertionError as error:  # the controller or a replica was away: ask again
            last_error = str(error)[:2000]
        if described and all(_healed(d) for d in described.values()):
            return described
        if time.monotonic() > deadline:
            raise AssertionError(f"not healed after {timeout_s:.0f} s: {last_error or json.dumps(described)[:6000]}")
        time.sleep(2.0)


def replicas_by_key(described: dict[str, dict]) -> dict[tuple[str, int, int], dict]:
    return {(topic, p["partition"], s["replica_id"]): s
            for topic, d in described.items() for p, statuses in zip(d["partitions"], d["statuses"]) for s in statuses}


def produce(session, topic: str, count: int, prefix: str) -> None:
    before = session.workload.call("produce", topic=topic, count=0)["acked"]
    counts = session.workload.call("produce", topic=topic, count=count, prefix=prefix)
    assert counts["acked"] - before == count and counts["failed"] == 0, counts
    session.acked[topic] = session.acked.get(topic, 0) + count


def read_back(session, topics: list[str], consumer: str) -> None:
    """A fresh consumer reads every topic (every one acknowledged so far) from its start; the history (every
    ack, every poll) must hold."""
    for topic in topics:
        read = session.workload.call("read_all", topic=topic, consumer=consumer, reply_timeout_s=400)
        assert read["read"] == session.acked[topic], (topic, read)
    report = check(load(session.history_path), complete_consumers=[consumer])
    assert report.ok, report.as_dict()
    assert report.acked == sum(session.acked.values())


QUICK = ["quick-1", "quick-3"]


def test_a_host_killed_and_joined_again_at_once_gets_its_replicas_back_with_their_data(netns_cluster, session):
    cluster = netns_cluster
    for topic, factor in zip(QUICK, (1, 3)):
        session.workload.call("create_topic", topic=topic, partitions=3, replication_factor=factor,
                              config={"min.insync.replicas": str(min(factor, 2))})
        produce(session, topic, RECORDS, f"{topic}-a")
    before = replicas_by_key(wait_healed(session.workload, QUICK))
    node = cluster.node_id("n2")
    assert is_node_id(node)
    on_n2 = {key: status for key, status in before.items() if status["node"] == node}
    assert {key[0] for key in on_n2} == set(QUICK)  # one replica of each quick-3 partition, one quick-1 partition at least
    for key, status in on_n2.items():
        assert status["directory"] == replica_directory(str(cluster.hosts["n2"].data_dir), *key)
    old_ray_node = {status["node_id"] for status in on_n2.values()}.pop()

    cluster.kill("n2")
    cluster.restart("n2")  # at once: the old Ray node is not even declared dead yet
    new_ray_node = cluster.wait_for_node("n2", not_node_id=old_ray_node)["NodeID"]
    produce(session, "quick-3", 100, "quick-3-b")  # while n2's followers come back: what they will fetch
    after = replicas_by_key(wait_healed(session.workload, QUICK))

    assert set(after) == set(before)  # the same replicas: none replaced
    for key, status in after.items():
        assert status["node"] == before[key]["node"], key
    for key, status in on_n2.items():
        back = after[key]
        assert back["node_id"] == new_ray_node and back["directory"] == status["directory"], (key, back)
        assert back["log_start_offset"] == status["log_start_offset"] == 0
        if key[0] == "quick-1":
            # The only replica, the only ISR member: it leads again, with everything it had.
            assert back["role"] == "leader" and back["fetched_bytes"] == 0 and back["log_end_offset"] == status["log_end_offset"]
        else:
            # Only what was produced while it was away was fetched, not the log it kept.
            assert 0 < back["fetched_bytes"] < status["size_bytes"], (key, status, back)
            assert back["size_bytes"] - status["size_bytes"] >= back["fetched_bytes"]
    read_back(session, QUICK, "after-rejoin")


RESTART = ["restart-1", "restart-3"]


def test_a_whole_cluster_restart_with_new_ray_node_ids_loses_nothing_and_copies_nothing(netns_cluster, session):
    cluster = netns_cluster
    for topic, factor in zip(RESTART, (1, 3)):
        session.workload.call("create_topic", topic=topic, partitions=3, replication_factor=factor,
                              config={"min.insync.replicas": str(min(factor, 2))})
        produce(session, topic, RECORDS, f"{topic}-a")
    topics = QUICK + RESTART
    before = replicas_by_key(wait_healed(session.workload, topics))
    ray_nodes_before = {status["node_id"] for status in before.values()}

    session.workload.close()
    cluster.restart_all()
    session.workload = Workload(cluster, session.data_dir, session.namespace, session.history_path)
    after = replicas_by_key(wait_healed(session.workload, topics))

    assert not {status["node_id"] for status in after.values()} & ray_nodes_before  # new Ray nodes everywhere
    assert set(after) == set(before)
    for key, status in after.items():
        assert (status["node"], status["directory"]) == (before[key]["node"], before[key]["directory"]), key
        assert (status["log_start_offset"], status["log_end_offset"], status["size_bytes"]) == (
            before[key]["log_start_offset"], before[key]["log_end_offset"], before[key]["size_bytes"]), key
    fetched = sum(status["fetched_bytes"] for status in after.values())
    held = sum(status["size_bytes"] for status in after.values())
    followers = sum(1 for status in after.values() if status["role"] == "follower")
    print(f"\nwhole-cluster restart: {len(after)} replicas ({followers} followers) holding {held} bytes; "
          f"bytes fetched by followers after the restart: {fetched}", file=sys.stderr)
    assert followers == 2 * 2 * 3 and fetched == 0
    read_back(session, topics, "after-restart")


def test_a_data_directory_of_another_cluster_is_refused_naming_both_cluster_ids(netns_cluster, session):
    cluster = netns_cluster
    ours = json.loads((Path(session.data_dir) / "controller" / "metadata.json").read_text())["cluster_id"]
    theirs = uuid.uuid4().hex
    host = cluster.add_host("x1", replica_slots=4, rack="rack-x")
    host.data_dir.mkdir(parents=True)
    foreign = NodeMeta(new_node_id(), theirs)
    (host.data_dir / META_FILE).write_text(foreign.to_text())
    cluster.join("x1")
    cluster.wait_for_node("x1")
    try:
        nodes = session.workload.call("nodes")["nodes"]
        refused = [n for n in nodes if n.get("refused")]
        assert [n["node_id"] for n in refused] == [foreign.node_id], nodes
        assert theirs in refused[0]["refused"] and ours in refused[0]["refused"], refused
        assert foreign.node_id not in {n["node_id"] for n in nodes if not n.get("refused")}
        # It hosts nothing: three hosts, not four, may take a replica.
        with pytest.raises(AssertionError, match="InvalidReplicationFactorError"):
            session.workload.call("create_topic", topic="everywhere", partitions=1, replication_factor=4)
        # What an operator sees.
        listing = cluster.popen(CLIENT, [str(Path(sys.executable).with_name("logbus")), "nodes", "list", "--address", cluster.address,
                                         "--data-dir", session.data_dir, "--namespace", session.namespace],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = listing.communicate(timeout=300)
        assert listing.returncode == 0, err
        assert f"Refused: node {foreign.node_id}" in out and theirs in out and ours in out, out
        assert (host.data_dir / META_FILE).read_text() == foreign.to_text()  # nothing written into it
    finally:
        cluster.kill("x1")
