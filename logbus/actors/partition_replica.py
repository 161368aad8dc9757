"""PartitionReplica: the actor that owns one partition replica's log on its node.

A thin shell around :class:`~logbus.storage.PartitionLog`: it receives encoded
batches (uint8 arrays, never Arrow objects), appends them, and serves fetches
as an ObjectRef to a copy of whole batches (one copy, mmap -> object store).

It is an async actor: every method runs on one event loop, so calls are
serialised between awaits and the log (not thread-safe) is only touched from
that loop. A produce appends before its first await, so batches from one
caller land in the order they were sent.

All state is rebuilt from disk in ``__init__``: when Ray restarts the actor
(it reruns only the constructor) the log recovers from its files, and the
replica's latest topic config is reloaded from ``replica.json`` beside the log.

Retry contract: a produce that failed may have been appended (the caller cannot
tell a lost reply from a lost request); fetches and offset queries are
idempotent.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import ray

from logbus.errors import InvalidRecordError, NotLeaderError
from logbus.protocol.messages import FetchResponse, ProduceResponse
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog

STATE_FILE = "replica.json"
BACKGROUND_INTERVAL_S = 1.0  # retention and interval flushes are checked this often
FETCH_WAIT_MS_MAX = 30_000


class PartitionReplica:
    """One replica of one partition (see the module docstring)."""

    def __init__(self, topic: str, partition: int, replica_id: int, directory: str, config: dict, leader_epoch: int) -> None:
        self.topic = topic
        self.partition = partition
        self.replica_id = replica_id
        self.directory = directory
        state = self._load_state()
        if state is None:
            state = {"config": dict(config), "leader_epoch": leader_epoch}
        self.config_overrides = state["config"]
        self.leader_epoch = max(int(state["leader_epoch"]), leader_epoch)
        self.log = PartitionLog(directory, LogConfig.from_dict(self.config_overrides))
        self._save_state()
        self._appended: asyncio.Event | None = None
        self._background: asyncio.Task | None = None
        self._deleted = False

    # --- state file --------------------------------------------------------------------------

    def _state_path(self) -> str:
        return os.path.join(self.directory, STATE_FILE)

    def _load_state(self) -> dict | None:
        try:
            with open(self._state_path()) as file:
                return json.load(file)
        except (FileNotFoundError, ValueError):
            return None

    def _save_state(self) -> None:
        path = self._state_path()
        temporary = path + ".tmp"
        with open(temporary, "w") as file:
            json.dump({"config": self.config_overrides, "leader_epoch": self.leader_epoch}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)

    # --- helpers -------------------------------------------------------------------------------

    def _started(self) -> None:
        """Create loop-bound objects on first use (the constructor runs outside the event loop)."""
        if self._appended is None:
            self._appended = asyncio.Event()
        if self._background is None:
            self._background = asyncio.get_running_loop().create_task(self._background_loop())

    async def _background_loop(self) -> None:
        while not self._deleted:
            await asyncio.sleep(BACKGROUND_INTERVAL_S)
            if self._deleted:
                return
            self.log.enforce_retention()
            self.log.maybe_flush()

    @property
    def high_watermark(self) -> int:
        # With one replica every appended record is committed; replication narrows this.
        return self.log.log_end_offset

    def _signal_append(self) -> None:
        event = self._appended
        self._appended = asyncio.Event()
        event.set()

    # --- data plane --------------------------------------------------------------------------------

    async def produce(self, batch: np.ndarray, acks: int | str = 1, leader_epoch: int | None = None) -> ProduceResponse:
        """Append one encoded batch as leader and return where it landed."""
        self._started()
        if leader_epoch is not None and leader_epoch != self.leader_epoch:
            raise NotLeaderError(f"{self.topic}-{self.partition}: request epoch {leader_epoch}, replica epoch {self.leader_epoch}")
        if not isinstance(batch, np.ndarray | bytes | bytearray | memoryview):
            raise InvalidRecordError(f"produce takes an encoded batch (uint8 array or bytes), not {type(batch).__name__}")
        result = self.log.append(batch, leader_epoch=self.leader_epoch)
        self._signal_append()
        return ProduceResponse(result.base_offset, result.log_end_offset, self.log.log_start_offset, result.max_timestamp_ms)

    async def fetch(self, offset: int, max_bytes: int = 8 << 20, max_wait_ms: int = 0):
        """Whole batches from ``offset`` below the high watermark: (FetchResponse, ObjectRef | None).

        Waits up to ``max_wait_ms`` for data when there is none yet. The
        ObjectRef holds a uint8 array of whole batches (the first may start
        below ``offset``); it is None when nothing arrived in time.
        """
        self._started()
        max_wait_ms = min(max(0, int(max_wait_ms)), FETCH_WAIT_MS_MAX)
        deadline = asyncio.get_running_loop().time() + max_wait_ms / 1000
        while True:
            result = self.log.read(offset, max_bytes, max_offset=self.high_watermark)
            if result is not None:
                # One copy, from the mapped segment into the object store.
                ref = ray.put(np.frombuffer(result.data, dtype=np.uint8))
                meta = FetchResponse(
                    result.first_offset, result.next_offset, self.high_watermark, self.log.log_start_offset, self.leader_epoch
                )
                del result
                return meta, ref
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return FetchResponse(offset, offset, self.high_watermark, self.log.log_start_offset, self.leader_epoch), None
            try:
                await asyncio.wait_for(self._appended.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def offsets(self) -> tuple[int, int, int]:
        """(log start offset, high watermark, log end offset)."""
        self._started()
        return self.log.log_start_offset, self.high_watermark, self.log.log_end_offset

    async def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """First offset with a timestamp >= ``timestamp_ms`` below the high watermark, or -1."""
        offset = self.log.offset_for_timestamp(timestamp_ms)
        if offset is None or offset >= self.high_watermark:
            return -1
        return offset

    # --- control plane ------------------------------------------------------------------------------

    async def update_config(self, config: dict) -> None:
        """Apply new topic config overrides (validated by the controller) and keep them for restarts."""
        self.config_overrides = dict(config)
        self.log.config = LogConfig.from_dict(self.config_overrides)
        self._save_state()

    async def enforce_retention(self) -> int:
        return self.log.enforce_retention()

    async def delete(self) -> None:
        """Close and remove this replica's files; the actor is killed by the controller afterwards."""
        self._deleted = True
        self.log.delete()
        shutil.rmtree(self.directory, ignore_errors=True)

    async def ping(self) -> int:
        """Ready check: returns the process id (fault-injection tests kill it)."""
        self._started()
        return os.getpid()

    async def recovery_report(self) -> dict:
        report = self.log.recovery
        return {"segments_scanned": report.segments_scanned, "truncated_bytes": report.truncated_bytes, "errors": list(report.errors)}
