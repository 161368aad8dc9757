"""Lease and fence files: what a leader reads before each write, written by another process. No Ray."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from logbus.actors import lease_files
from logbus.actors.lease_files import NodeLease, ReplicaFence, may_write


def test_a_leader_may_write_only_while_the_lease_holds_and_its_epoch_is_current(tmp_path):
    lease, fence = NodeLease(str(tmp_path)), ReplicaFence.of(str(tmp_path), "topic-id", 0, 1)
    assert fence.current_epoch == lease_files.NO_EPOCH and lease.expires_ms == 0
    assert not may_write(lease, fence, 3, now_ms=1_000)  # no lease yet
    lease.extend(2_000)
    assert not may_write(lease, fence, 3, now_ms=1_000)  # the epoch is not known to be current
    fence.current_epoch = 3
    assert may_write(lease, fence, 3, now_ms=1_999)
    assert not may_write(lease, fence, 3, now_ms=2_000)  # the lease ran out
    lease.extend(1_500)  # a late reply never shortens the lease
    assert lease.expires_ms == 2_000
    fence.current_epoch = 4  # deposed: a newer epoch
    assert not may_write(lease, fence, 3, now_ms=1_000)
    assert not may_write(None, fence, 4, now_ms=1_000) and not may_write(lease, None, 4, now_ms=1_000)


def _write_from_another_process(directory: str, epoch: int, until_ms: int) -> None:
    ReplicaFence.of(directory, "topic-id", 2, 0).current_epoch = epoch
    NodeLease(directory).extend(until_ms)


def test_writes_of_another_process_are_seen_through_the_mapping(tmp_path):
    directory = str(tmp_path)
    lease, fence = NodeLease(directory), ReplicaFence.of(directory, "topic-id", 2, 0)
    fence.pid = os.getpid()
    process = multiprocessing.get_context("spawn").Process(target=_write_from_another_process, args=(directory, 7, 9_000))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert (fence.current_epoch, lease.expires_ms, fence.pid) == (7, 9_000, os.getpid())


def test_a_reopened_fence_keeps_its_epoch_and_a_removed_one_is_gone(tmp_path):
    fence = ReplicaFence.of(str(tmp_path), "topic-id", 0, 0)
    fence.current_epoch = 12
    again = ReplicaFence.of(str(tmp_path), "topic-id", 0, 0)  # a restarted replica or agent
    assert again.current_epoch == 12
    again.remove()
    assert not os.path.exists(fence.path)


def test_namespaces_and_nodes_never_share_files():
    a = lease_files.node_directory("ns-a", "node1" * 8)
    assert a != lease_files.node_directory("ns-b", "node1" * 8)
    assert a != lease_files.node_directory("ns-a", "node2" * 8)


def test_a_leaders_gauges_are_exported_only_under_the_current_epoch(tmp_path):
    fence = ReplicaFence.of(str(tmp_path), "topic-id", 3, 1)
    fence.label = "orders.v2"
    assert fence.published() is None  # nothing published yet
    fence.current_epoch = 5
    fence.publish_log(5, 4096, 2)
    assert fence.published() == (4096, 2, -1, 0)  # no tier: remote bytes -1
    fence.publish_tier(1 << 20, 512)
    fence.publish_log(5, 8192, 3)
    assert fence.published() == (8192, 3, 1 << 20, 512)
    fence.current_epoch = 6  # deposed: another replica leads epoch 6
    assert fence.published() is None
    fence.publish_log(7, 100, 1)  # this replica leads again, in a later epoch: the tier's old figures are not kept
    fence.current_epoch = 7
    assert fence.published() == (100, 1, -1, 512)
    fence.withdraw()  # it stopped leading, or its process started again
    assert fence.published() is None
    assert ReplicaFence.of(str(tmp_path), "topic-id", 3, 1).label == "orders.v2"  # as the agent reads it


def _publish_from_another_process(directory: str) -> None:
    fence = ReplicaFence.of(directory, "topic-id", 0, 0)
    fence.label = "t" * 249  # the longest topic name Kafka allows
    fence.publish_log(2, 123, 4)


def test_gauges_and_label_written_by_the_replica_are_read_by_the_agent(tmp_path):
    directory = str(tmp_path)
    agent_view = ReplicaFence.of(directory, "topic-id", 0, 0)  # the agent maps it first
    agent_view.current_epoch = 2
    process = multiprocessing.get_context("spawn").Process(target=_publish_from_another_process, args=(directory,))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert agent_view.published() == (123, 4, -1, 0) and agent_view.label == "t" * 249


def test_a_fence_file_of_the_earlier_size_keeps_its_epoch_and_gains_the_gauge_slots(tmp_path):
    path = tmp_path / "r-topic-id-0-0"
    old = bytearray(lease_files.FILE_BYTES)  # an earlier logbus: 64 bytes, pid and epoch only
    lease_files.SLOT.pack_into(old, lease_files.REPLICA_PID_AT, 4321)
    lease_files.SLOT.pack_into(old, lease_files.REPLICA_EPOCH_AT, 9)
    path.write_bytes(bytes(old))
    fence = ReplicaFence.at(str(path))
    assert (fence.pid, fence.current_epoch, fence.label) == (4321, 9, "")
    assert os.path.getsize(path) == lease_files.REPLICA_FILE_BYTES
    fence.withdraw()  # what a replica does when it starts
    assert fence.published() is None


def test_a_topic_name_too_long_for_the_file_is_refused(tmp_path):
    fence = ReplicaFence.of(str(tmp_path), "topic-id", 0, 0)
    with pytest.raises(ValueError, match="does not fit"):
        fence.label = "x" * 1000
    assert fence.label == ""
