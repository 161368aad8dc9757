"""Lease and fence files: what a leader reads before each write, written by another process. No Ray."""

from __future__ import annotations

import multiprocessing
import os

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
