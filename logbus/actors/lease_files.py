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
  A leader also publishes its log's gauges there (size, segments, and its
  remote tier's size and upload lag), under the epoch it leads in, with its
  topic's name: the agent exports them to Ray's metrics for every current
  leader of its node, one pass a report interval (Ray drops a gauge not set
  again within two; ``NodeAgent._export_gauges``). A deposed leader's figures
  stop being exported as soon as its fence holds the newer epoch.

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
LABEL_LENGTH = struct.Struct("<H")
FILE_BYTES = 64  # the 8-byte slots; a file shorter than this was never initialised (one page of tmpfs each)
NODE_LEASE_AT = 0  # node file: lease expiry, monotonic ms
REPLICA_PID_AT = 0  # replica file: the replica's process id (0: not started yet)
REPLICA_EPOCH_AT = 8  # replica file: the partition's current leader epoch (-1: none known yet)
GAUGES_EPOCH_AT = 16  # replica file: the leader epoch the gauges below were published in (-1: none)
LOG_BYTES_AT = 24  # replica file: the leader's log size, bytes
LOG_SEGMENTS_AT = 32  # replica file: the leader's segment count
REMOTE_BYTES_AT = 40  # replica file: the remote tier's size as the leader sees it (-1: no tier)
REMOTE_LAG_AT = 48  # replica file: local bytes not yet in the tier
NO_EPOCH = -1
REPLICA_FILE_BYTES = 512  # the slots, then the topic's name: 2 bytes of length and at most 249 of ASCII
LABEL_AT = FILE_BYTES


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

    def __init__(self, path: str, initial: dict[int, int] | None = None, size: int = FILE_BYTES) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            found = os.fstat(fd).st_size
            fresh = found < FILE_BYTES
            if found < size:  # new, or made by an older logbus with fewer bytes: the new ones read zero
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
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
    """One replica's fence file: its pid, its partition's current leader epoch, and, while it leads, its log's gauges."""

    def __init__(self, path: str) -> None:
        super().__init__(path, {REPLICA_EPOCH_AT: NO_EPOCH, GAUGES_EPOCH_AT: NO_EPOCH, REMOTE_BYTES_AT: -1},
                         size=REPLICA_FILE_BYTES)

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

    @property
    def label(self) -> str:
        """The topic's name, as the replica wrote it ("" before it did)."""
        (length,) = LABEL_LENGTH.unpack_from(self._map, LABEL_AT)
        start = LABEL_AT + LABEL_LENGTH.size
        if length > REPLICA_FILE_BYTES - start:
            return ""  # not a length this module wrote
        return self._map[start : start + length].decode("ascii", errors="replace")

    @label.setter
    def label(self, topic: str) -> None:
        data = topic.encode("ascii", errors="replace")  # topic names are ASCII (storage/names.py)
        start = LABEL_AT + LABEL_LENGTH.size
        if len(data) > REPLICA_FILE_BYTES - start:
            raise ValueError(f"a topic name of {len(data)} bytes does not fit a fence file")
        self._map[start : start + len(data)] = data
        LABEL_LENGTH.pack_into(self._map, LABEL_AT, len(data))  # the length last: a reader sees all of it or none

    def publish_log(self, epoch: int, size_bytes: int, segments: int) -> None:
        """A leader of ``epoch``: its log's size and segment count (two 8-byte writes; the epoch's only when it moved)."""
        self.write(LOG_BYTES_AT, size_bytes)
        self.write(LOG_SEGMENTS_AT, segments)
        if self.read(GAUGES_EPOCH_AT) != epoch:
            self.write(REMOTE_BYTES_AT, -1)  # the tier's figures of an earlier leadership are not this one's
            self.write(GAUGES_EPOCH_AT, epoch)

    def publish_tier(self, remote_bytes: int, lag_bytes: int) -> None:
        """The leader's view of its remote tier: its size and the local bytes not yet in it."""
        self.write(REMOTE_LAG_AT, lag_bytes)
        self.write(REMOTE_BYTES_AT, remote_bytes)

    def withdraw(self) -> None:
        """No gauges to export from this replica (it does not lead, or its process started again)."""
        self.write(GAUGES_EPOCH_AT, NO_EPOCH)

    def published(self) -> tuple[int, int, int, int] | None:
        """What the agent exports for this replica: ``(log bytes, segments, remote bytes, remote lag)``
        (remote bytes -1 without a tier), or None unless it published them as the current leader."""
        epoch = self.read(GAUGES_EPOCH_AT)
        if epoch == NO_EPOCH or epoch != self.current_epoch:
            return None
        values = (self.read(LOG_BYTES_AT), self.read(LOG_SEGMENTS_AT), self.read(REMOTE_BYTES_AT), self.read(REMOTE_LAG_AT))
        return values if self.read(GAUGES_EPOCH_AT) == epoch else None  # moved while read: next pass

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def may_write(lease: NodeLease | None, fence: ReplicaFence | None, leader_epoch: int, now_ms: int) -> bool:
    """A leader's check before it takes a write: the node's lease holds and its epoch is the current one."""
    return lease is not None and fence is not None and now_ms < lease.expires_ms and fence.current_epoch == leader_epoch
