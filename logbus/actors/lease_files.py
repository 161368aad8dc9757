"""Leases and epoch fences in shared memory: how a leader decides, with no call, whether it may take a write.

Replicas no longer hold leases of their own with the controller: one node
agent per node does (``node_agent.py``), and tells the replicas on its node
through two kinds of small memory-mapped files under ``/dev/shm`` (tmpfs):

- the node's **lease file**: the monotonic time (ms) until which the node's
  lease with the controller holds. The agent moves it forward after each
  acknowledged heartbeat; when the controller is unreachable it stops moving
  and runs out, so every leader on the node stops taking writes before the
  controller may elect others (the lease constants in ``protocol/liveness.py``).
- one **fence file per replica**: the replica's process id (written by the
  replica when it starts, read by the agent to watch the process) and the
  partition's current leader epoch (written by the agent when the controller
  says so). A leader takes a write only while its own epoch is the current
  one: a leader that was deposed while paused (SIGSTOP) and comes back finds
  a newer epoch in its fence file and refuses, before any call reaches it.

So a leader's check is two 8-byte reads from mapped memory. Linux's
``CLOCK_MONOTONIC`` is shared by every process of a machine, so the lease
time the agent writes means the same to the replicas reading it. 8-byte
aligned writes and reads of a mapped page are atomic on the machines logbus
runs on. The files live in tmpfs: they survive the restart of an agent or a
replica process (the fences must), and vanish with the machine.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import tempfile

SLOT = struct.Struct("<q")
FILE_BYTES = 64  # a few 8-byte slots; one page of tmpfs each
NODE_LEASE_AT = 0  # node file: lease expiry, monotonic ms
REPLICA_PID_AT = 0  # replica file: the replica's process id (0: not started yet)
REPLICA_EPOCH_AT = 8  # replica file: the partition's current leader epoch (-1: none known yet)
NO_EPOCH = -1


def base_directory() -> str:
    """Where the files live: tmpfs (``/dev/shm``) where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def node_directory(namespace: str, node_id: str) -> str:
    """The directory of one logbus cluster's files on one node (namespaces never share files)."""
    digest = hashlib.sha1(namespace.encode()).hexdigest()[:12]
    return os.path.join(base_directory(), f"logbus-{digest}", node_id[:16])


def replica_file_name(topic_id: str, partition: int, replica_id: int) -> str:
    return f"r-{topic_id[:16]}-{partition}-{replica_id}"


class MappedSlots:
    """A small file of 8-byte slots, mapped shared (created zeroed if missing; existing values kept)."""

    def __init__(self, path: str, initial: dict[int, int] | None = None) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fresh = os.fstat(fd).st_size < FILE_BYTES
            if fresh:
                os.ftruncate(fd, FILE_BYTES)
            self._map = mmap.mmap(fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
        if fresh:
            for at, value in (initial or {}).items():
                self.write(at, value)

    def read(self, at: int) -> int:
        return SLOT.unpack_from(self._map, at)[0]

    def write(self, at: int, value: int) -> None:
        SLOT.pack_into(self._map, at, value)

    def close(self) -> None:
        self._map.close()


class NodeLease(MappedSlots):
    """The node's lease with the controller (written by the node agent, read by the replicas)."""

    def __init__(self, directory: str) -> None:
        super().__init__(os.path.join(directory, "node"))

    @property
    def expires_ms(self) -> int:
        return self.read(NODE_LEASE_AT)

    def extend(self, until_ms: int) -> None:
        """Move the expiry forward to ``until_ms`` (never back: a late reply must not shorten it)."""
        if until_ms > self.expires_ms:
            self.write(NODE_LEASE_AT, until_ms)

    def revoke(self) -> None:
        """No lease (a new agent process starts with none until the controller answers it)."""
        self.write(NODE_LEASE_AT, 0)


class ReplicaFence(MappedSlots):
    """One replica's fence file: its pid and its partition's current leader epoch."""

    def __init__(self, path: str) -> None:
        super().__init__(path, {REPLICA_EPOCH_AT: NO_EPOCH})

    @classmethod
    def at(cls, path: str) -> "ReplicaFence":
        return cls(path)

    @classmethod
    def of(cls, directory: str, topic_id: str, partition: int, replica_id: int) -> "ReplicaFence":
        return cls(os.path.join(directory, replica_file_name(topic_id, partition, replica_id)))

    @property
    def pid(self) -> int:
        return self.read(REPLICA_PID_AT)

    @pid.setter
    def pid(self, value: int) -> None:
        self.write(REPLICA_PID_AT, value)

    @property
    def current_epoch(self) -> int:
        return self.read(REPLICA_EPOCH_AT)

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self.write(REPLICA_EPOCH_AT, value)

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def may_write(lease: NodeLease | None, fence: ReplicaFence | None, leader_epoch: int, now_ms: int) -> bool:
    """A leader's check before it takes a write: the node's lease holds and its epoch is the current one."""
    return lease is not None and fence is not None and now_ms < lease.expires_ms and fence.current_epoch == leader_epoch
