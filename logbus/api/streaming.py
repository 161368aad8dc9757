"""Micro-batch streaming in the foreachBatch style, with a consumer group's committed offsets as the checkpoint.

Each trigger:

1. reads the group's committed offsets (where the previous batch ended), the
   id of the last committed batch, and a batch planned but not committed, if
   any (see 3);
2. plans the next batch: the planned one, over exactly its planned offsets,
   if there is one; else from the committed offsets up to the partitions'
   high watermarks (at most ``max_offsets_per_trigger`` records in all, split
   across partitions in proportion to what each has waiting), with the next
   batch id;
3. records a new plan durably before running it (the offset log of Spark's
   micro-batches): one commit that leaves every partition's offset where it
   is and puts the batch id and the partition's planned end in its metadata;
4. hands the offset range ``[start, end)`` and the batch id to
   ``run_batch`` (which reads it: as a Spark DataFrame in
   :func:`logbus.spark.stream`, as a Ray Dataset here);
5. commits ``end`` for every partition, with the batch id in the commit's
   metadata, only after ``run_batch`` returned.

So a batch that fails is not committed, and a restarted stream runs it again
with the same batch id over the same offsets, however many records arrived
meanwhile: at least once, and exactly once for a sink that writes
idempotently by batch id (one that skips a batch id it already wrote).
Committed offsets never pass a record that was not processed.

The stream commits as a group without members (generation -1): a group used
by a stream must not also have subscribed consumers.

Exactly once into a topic (``transactional_id``). The stream then owns a
transactional :class:`~logbus.api.producer.Producer`, and each batch is one
transaction: ``run_batch`` gets the producer as a fourth argument and writes
its output with it; the stream adds the batch's end offsets (with the batch
id in their metadata) to the same transaction and commits it. The output
records and the input offsets become visible together (to read_committed
readers), or not at all. A stream that died mid-batch is restarted with the
same transactional id: ``init_transactions()`` fences the dead instance and
aborts its open transaction (or waits for one it was committing to
complete), and only then is the checkpoint read, so the batch runs again
(over its planned offsets, with its id) only if its transaction did not
commit. Each input record's output is visible once, whatever the restarts.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from logbus.actors.remote import get
from logbus.api.client import Bus, connect
from logbus.options import check_callable, check_choice, check_flag, check_int, check_seconds
from logbus.errors import IllegalStateError, InvalidConfigError, LogbusError
from logbus.protocol.group_coordinator import OffsetAndMetadata, validate_group_id
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import validate_topic_name

logger = logging.getLogger(__name__)

STARTS = ("earliest", "latest")
# The commit metadata of a planned batch: {"planned_batch": <id>, "end": <the partition's planned end>}.
# A committed batch's metadata is its id alone, in decimal digits.
PLANNED_BATCH = "planned_batch"


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


def planned_metadata(batch_id: int, end: int) -> str:
    """The commit metadata that records batch ``batch_id`` as planned to end at ``end`` in one partition."""
    return json.dumps({PLANNED_BATCH: batch_id, "end": end}, separators=(",", ":"))


def _parse_planned(metadata: str) -> tuple[int, int] | None:
    """(batch id, end) from :func:`planned_metadata`'s text; None for any other metadata."""
    if not metadata.startswith("{"):
        return None
    try:
        found = json.loads(metadata)
    except ValueError:
        return None
    if not isinstance(found, dict) or set(found) != {PLANNED_BATCH, "end"}:
        return None
    batch_id, end = found[PLANNED_BATCH], found["end"]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (batch_id, end)):
        return None
    return batch_id, end


def _parse_committed(metadata: str) -> int | None:
    """The batch id of a committed batch's metadata; None for any other metadata."""
    return int(metadata) if metadata.isascii() and metadata.isdigit() else None


@dataclass(frozen=True)
class Checkpoint:
    """What a stream's group has committed: where the next batch starts, and its id.

    ``planned_end`` is the end per partition of batch ``next_batch_id`` when that
    batch was planned (its plan recorded) but not committed: it must run again
    over exactly those offsets. None when the next batch is still to be planned.
    """

    offsets: dict[int, int]  # the committed offset of each partition that has one
    next_batch_id: int
    planned_end: dict[int, int] | None

    @classmethod
    def from_commits(cls, commits: Mapping[int, OffsetAndMetadata | None]) -> "Checkpoint":
        """Read the group's commits (partition -> OffsetAndMetadata, or None where nothing was committed)."""
        offsets: dict[int, int] = {}
        last_committed = -1
        planned_id, planned_end = -1, {}
        for partition, om in commits.items():
            if om is None:
                continue
            offsets[partition] = om.offset
            batch_id = _parse_committed(om.metadata)
            if batch_id is not None:
                last_committed = max(last_committed, batch_id)
                continue
            plan = _parse_planned(om.metadata)
            if plan is not None:
                if plan[0] > planned_id:
                    planned_id, planned_end = plan[0], {}
                if plan[0] == planned_id:
                    planned_end[partition] = plan[1]
                last_committed = max(last_committed, plan[0] - 1)  # a plan is written after its predecessor's commit
        if planned_id > last_committed:
            return cls(offsets, planned_id, planned_end)
        return cls(offsets, last_committed + 1, None)


@dataclass(frozen=True)
class _Plan:
    start: dict[int, int]
    end: dict[int, int]
    batch_id: int
    recorded: bool  # the plan is already in the group's commits (a batch that failed runs again)


def _check_run_options(max_batches: int | None = None, until_caught_up: bool = False) -> None:
    check_int("max_batches", max_batches, none_ok=True)
    check_flag("until_caught_up", until_caught_up)


def log_progress(progress: BatchProgress) -> None:
    """The default progress callback: one INFO line per batch on the ``logbus.api.streaming`` logger."""
    logger.info("stream: %s", progress)


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
        progress: Callable[[BatchProgress], None] | None = log_progress,
        transactional_id: str | None = None,
        producer_options: dict | None = None,
    ) -> None:
        validate_topic_name(topic)
        validate_group_id(group_id)
        check_int("max_offsets_per_trigger", max_offsets_per_trigger, none_ok=True)
        check_seconds("trigger_interval_s", trigger_interval_s)
        check_choice("starting_offsets", starting_offsets, STARTS)
        check_callable("run_batch", run_batch, "(start, end, batch_id)", none_ok=False)
        check_callable("progress", progress, "a BatchProgress")
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
        self.transactional_id = transactional_id
        self.producer = None
        if transactional_id is not None:
            from logbus.api.producer import Producer  # noqa: PLC0415 (only a transactional stream needs one)

            options = dict(producer_options or {})
            if "transactional_id" in options:
                raise InvalidConfigError("give the stream's transactional_id as its own argument, not in producer_options")
            self.producer = Producer(self.bus, transactional_id=transactional_id, **options)
            self._initialized = False
        elif producer_options:
            raise InvalidConfigError("producer_options need a transactional_id (the stream's producer is transactional)")
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

    def _checkpoint(self) -> Checkpoint:
        tps = [TopicPartition(self.topic, p) for p in range(self._partition_count)]
        found = get(self.bus.controller.fetch_committed.remote(self.group_id, tps))
        return Checkpoint.from_commits({tp.partition: om for tp, om in found.items()})

    def _plan(self) -> _Plan | None:
        """The next batch, or None when nothing is waiting."""
        positions = self._partition_offsets()
        if not positions:
            return None
        checkpoint = self._checkpoint()
        start = {}
        for p, (log_start, high_watermark, _) in positions.items():
            if p in checkpoint.offsets:
                start[p] = min(max(checkpoint.offsets[p], log_start), high_watermark)
            else:
                start[p] = log_start if self.starting_offsets == "earliest" else high_watermark
        if checkpoint.planned_end is not None:
            # A batch that was planned but not committed runs again over its planned offsets,
            # with its id, whatever arrived since (partitions it did not name take nothing).
            end = {p: max(start[p], checkpoint.planned_end.get(p, start[p])) for p in positions}
            short = {p: positions[p][1] for p in positions if end[p] > positions[p][1]}
            if short:
                logger.warning(
                    "stream %s/%s: batch %d was planned up to %s, past the high watermarks %s now; waiting for them",
                    self.topic, self.group_id, checkpoint.next_batch_id, end, short,
                )
                return None
            logger.info("stream %s/%s: batch %d runs again over its planned offsets %s..%s",
                        self.topic, self.group_id, checkpoint.next_batch_id, start, end)
            return _Plan(start, end, checkpoint.next_batch_id, recorded=True)
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
        return _Plan(start, end, checkpoint.next_batch_id, recorded=False)

    def _commit(self, offsets: dict[int, int], metadata: Callable[[int], str]) -> None:
        """One commit of every partition's offset, atomic (one batch in ``__consumer_offsets``)."""
        commits = {TopicPartition(self.topic, p): OffsetAndMetadata(o, metadata(p)) for p, o in offsets.items()}
        get(self.bus.controller.commit_offsets.remote(self.group_id, "", -1, commits))

    # --- running -------------------------------------------------------------------------------------

    def _init_transactions(self) -> None:
        """Once, before the first checkpoint is read: fence an earlier instance of this stream and end
        the transaction it left (abort, or the completion of a commit it had begun)."""
        if self.producer is not None and not self._initialized:
            self.producer.init_transactions()
            self._initialized = True

    def _run_transaction(self, start: dict, end: dict, batch_id: int) -> None:
        """One batch as one transaction: its output and its input offsets commit together."""
        producer = self.producer
        producer.begin_transaction()
        try:
            self.run_batch(dict(start), dict(end), batch_id, producer)
            offsets = {TopicPartition(self.topic, p): OffsetAndMetadata(o, str(batch_id)) for p, o in end.items()}
            producer.send_offsets_to_transaction(offsets, self.group_id)
            producer.commit_transaction()
        except BaseException:
            try:
                producer.abort_transaction()
            except LogbusError as error:  # (fenced, or the coordinator away: it aborts at the timeout)
                logger.warning("stream %s/%s: batch %d's transaction was not aborted: %r", self.topic, self.group_id, batch_id, error)
            raise

    def close(self) -> None:
        """Close the stream's transactional producer (if any); call after the stream ended."""
        if self.producer is not None:
            self.producer.close()

    def run_once(self) -> BatchProgress | None:
        """Run one micro-batch if records are waiting; return its progress (None if there was nothing)."""
        self._init_transactions()
        plan = self._plan()
        if plan is None:
            return None
        start, end, batch_id = plan.start, plan.end, plan.batch_id
        started = time.monotonic()
        if not plan.recorded:
            # The offset log: the plan is durable before the batch runs, so a restart after a
            # failure runs this batch id over these offsets again, not up to a later high watermark.
            self._commit(start, lambda p: planned_metadata(batch_id, end[p]))
        if self.producer is not None:
            self._run_transaction(start, end, batch_id)
        else:
            self.run_batch(dict(start), dict(end), batch_id)  # an exception leaves the batch uncommitted
            self._commit(end, lambda p: str(batch_id))
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
            finally:
                self.close()

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
        check_seconds("timeout_s", timeout_s, none_ok=True)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self.exception is not None:
            raise self.exception
        return True

    @property
    def is_active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
