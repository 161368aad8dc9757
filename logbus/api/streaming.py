"""Micro-batch streaming in the foreachBatch style, with a consumer group's committed offsets as the checkpoint.

Each trigger:

1. reads the group's committed offsets (where the previous batch ended) and
   the batch id stored with them;
2. takes the partitions' high watermarks as the batch's end (at most
   ``max_offsets_per_trigger`` records in all, split across partitions in
   proportion to what each has waiting);
3. hands the offset range ``[start, end)`` and the batch id to
   ``run_batch`` (which reads it: as a Spark DataFrame in
   :func:`logbus.spark.stream`, as a Ray Dataset here);
4. commits ``end`` for every partition, with the batch id in the commit's
   metadata, only after ``run_batch`` returned.

So a batch that fails is not committed and a restarted stream runs it again
with the same batch id and the same offsets: at least once, and exactly once
for a sink that writes idempotently by batch id. Committed offsets never pass
a record that was not processed.

The stream commits as a group without members (generation -1): a group used
by a stream must not also have subscribed consumers.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from logbus.actors.remote import get
from logbus.api.client import Bus, connect
from logbus.errors import IllegalStateError, InvalidConfigError, LogbusError
from logbus.protocol.group_coordinator import OffsetAndMetadata, validate_group_id
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import validate_topic_name

STARTS = ("earliest", "latest")


@dataclass(frozen=True)
class BatchProgress:
    """What one micro-batch did."""

    batch_id: int
    records: int
    duration_s: float
    records_per_s: float
    lag_after: int  # records waiting (high watermark minus committed) once the batch committed
    start: dict
    end: dict

    def __str__(self) -> str:
        return (
            f"batch {self.batch_id}: {self.records:,} records in {self.duration_s:.2f}s "
            f"({self.records_per_s:,.0f}/s), lag {self.lag_after:,}"
        )


def _check_count(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidConfigError(f"{name} must be a positive int or None, not {value!r}")


def _check_seconds(name: str, value) -> None:
    # Finite and within what threading's waits take (an infinite wait raises OverflowError there).
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= threading.TIMEOUT_MAX:
        raise InvalidConfigError(f"{name} must be a non-negative number of seconds, not {value!r}")


def _check_run_options(max_batches: int | None = None, until_caught_up: bool = False) -> None:
    _check_count("max_batches", max_batches)
    if not isinstance(until_caught_up, bool):
        raise InvalidConfigError(f"until_caught_up must be True or False, not {until_caught_up!r}")


def _stderr_progress(progress: BatchProgress) -> None:
    print(f"logbus stream: {progress}", file=sys.stderr, flush=True)


class MicroBatchStream:
    """A running micro-batch loop (see the module docstring). Start it with :meth:`start` or :meth:`run`."""

    def __init__(
        self,
        topic: str,
        group_id: str,
        run_batch: Callable[[dict, dict, int], None],
        *,
        max_offsets_per_trigger: int | None = None,
        trigger_interval_s: float = 5.0,
        starting_offsets: str = "earliest",
        bus: Bus | None = None,
        progress: Callable[[BatchProgress], None] | None = _stderr_progress,
    ) -> None:
        validate_topic_name(topic)
        validate_group_id(group_id)
        _check_count("max_offsets_per_trigger", max_offsets_per_trigger)
        _check_seconds("trigger_interval_s", trigger_interval_s)
        if not isinstance(starting_offsets, str) or starting_offsets not in STARTS:
            raise InvalidConfigError(f"starting_offsets must be one of {STARTS}, not {starting_offsets!r}")
        if not callable(run_batch):
            raise InvalidConfigError(f"run_batch must be a callable taking (start, end, batch_id), not {run_batch!r}")
        if progress is not None and not callable(progress):
            raise InvalidConfigError(f"progress must be a callable taking a BatchProgress, or None, not {progress!r}")
        if bus is not None and not isinstance(bus, Bus):
            raise InvalidConfigError(f"bus must be a Bus from logbus.connect() or None, not {type(bus).__name__}")
        self.bus = bus or connect()
        self.topic = topic
        self.group_id = group_id
        self.run_batch = run_batch
        self.max_offsets_per_trigger = max_offsets_per_trigger
        self.trigger_interval_s = float(trigger_interval_s)
        self.starting_offsets = starting_offsets
        self.progress = progress
        self.recent_progress: list[BatchProgress] = []
        self.exception: BaseException | None = None
        self._partition_count = self.bus.topic_metadata(topic, refresh=True).partition_count  # unknown topics fail here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- offsets -----------------------------------------------------------------------------------

    def _partition_offsets(self) -> dict[int, tuple[int, int, int]]:
        metadata = self.bus.topic_metadata(self.topic)
        refs = {p: leader.offsets.remote() for p, leader in enumerate(metadata.leaders) if leader is not None}
        if len(refs) != metadata.partition_count:
            self.bus.forget(self.topic)
            return {}
        try:
            return {p: get(ref, timeout_s=30) for p, ref in refs.items()}
        except LogbusError as error:
            if error.retriable:
                self.bus.forget(self.topic)
                return {}
            raise

    def _committed(self) -> tuple[dict[int, int], int]:
        """(partition -> committed offset, the next batch id)."""
        tps = [TopicPartition(self.topic, p) for p in range(self._partition_count)]
        found = get(self.bus.controller.fetch_committed.remote(self.group_id, tps))
        offsets, last_batch = {}, -1
        for tp, om in found.items():
            if om is not None:
                offsets[tp.partition] = om.offset
                if om.metadata.isdigit():
                    last_batch = max(last_batch, int(om.metadata))
        return offsets, last_batch + 1

    def _plan(self) -> tuple[dict[int, int], dict[int, int], int] | None:
        """The next batch's (start, end, batch id), or None when nothing is waiting."""
        positions = self._partition_offsets()
        if not positions:
            return None
        committed, batch_id = self._committed()
        start = {}
        for p, (log_start, high_watermark, _) in positions.items():
            if p in committed:
                start[p] = min(max(committed[p], log_start), high_watermark)
            else:
                start[p] = log_start if self.starting_offsets == "earliest" else high_watermark
        waiting = {p: positions[p][1] - start[p] for p in positions}
        total = sum(waiting.values())
        if total <= 0:
            return None
        if self.max_offsets_per_trigger is not None and total > self.max_offsets_per_trigger:
            share = self.max_offsets_per_trigger / total
            end = {p: start[p] + math.floor(waiting[p] * share) for p in positions}
            if sum(end[p] - start[p] for p in positions) == 0:  # tiny budgets still make progress
                busiest = max(waiting, key=waiting.get)
                end[busiest] = start[busiest] + 1
        else:
            end = {p: positions[p][1] for p in positions}
        return start, end, batch_id

    def _commit(self, end: dict[int, int], batch_id: int) -> None:
        offsets = {TopicPartition(self.topic, p): OffsetAndMetadata(o, str(batch_id)) for p, o in end.items()}
        get(self.bus.controller.commit_offsets.remote(self.group_id, "", -1, offsets))

    # --- running -------------------------------------------------------------------------------------

    def run_once(self) -> BatchProgress | None:
        """Run one micro-batch if records are waiting; return its progress (None if there was nothing)."""
        plan = self._plan()
        if plan is None:
            return None
        start, end, batch_id = plan
        started = time.monotonic()
        self.run_batch(dict(start), dict(end), batch_id)  # an exception leaves the batch uncommitted
        self._commit(end, batch_id)
        duration = time.monotonic() - started
        records = sum(end[p] - start[p] for p in end)
        positions = self._partition_offsets()
        lag = sum(max(0, positions[p][1] - end[p]) for p in end if p in positions)
        progress = BatchProgress(batch_id, records, duration, records / duration if duration > 0 else 0.0, lag, start, end)
        self.recent_progress = (self.recent_progress + [progress])[-100:]
        if self.progress is not None:
            self.progress(progress)
        return progress

    def run(self, max_batches: int | None = None, until_caught_up: bool = False) -> None:
        """Run in this thread until stop(), ``max_batches`` batches, or (``until_caught_up``) an idle trigger."""
        _check_run_options(max_batches, until_caught_up)
        done = 0
        while not self._stop.is_set():
            triggered = time.monotonic()
            progress = self.run_once()
            if progress is not None:
                done += 1
                if max_batches is not None and done >= max_batches:
                    return
            elif until_caught_up:
                return
            self._stop.wait(max(0.0, self.trigger_interval_s - (time.monotonic() - triggered)))

    def start(self, **run_options) -> "MicroBatchStream":
        """Run in a background thread; see :meth:`await_termination` and :meth:`stop`."""
        if self._thread is not None:
            raise IllegalStateError("this stream was already started")
        unknown = sorted(set(run_options) - {"max_batches", "until_caught_up"})
        if unknown:
            raise InvalidConfigError(f"start() takes the options of run() (max_batches, until_caught_up), not {unknown}")
        _check_run_options(**run_options)  # here, not in the thread: bad options fail the caller

        def target():
            try:
                self.run(**run_options)
            except BaseException as error:  # noqa: BLE001 (kept for await_termination)
                self.exception = error

        self._thread = threading.Thread(target=target, name=f"logbus-stream-{self.topic}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the batch in progress (which commits if it succeeds)."""
        self._stop.set()

    def await_termination(self, timeout_s: float | None = None) -> bool:
        """Wait for the stream to end; re-raise the error that ended it. False on timeout."""
        if self._thread is None:
            raise IllegalStateError("the stream was not started")
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self.exception is not None:
            raise self.exception
        return True

    @property
    def is_active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
