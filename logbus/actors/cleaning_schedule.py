"""When a replica cleans its log (compaction), and the cleaning itself: planned on the loop, done in a thread.

Topics with ``cleanup.policy`` "compact" (``storage/cleaner.py``). No
polling: one timer (named "clean") for the moment the log may next need
cleaning (``PartitionLog.next_cleaning_ms``: a segment rolled and the dirty
ratio is met, a segment leaves min.compaction.lag.ms, a kept tombstone is
due), re-armed when a segment rolls, the config changes or a cleaning ends.
A cleaning due but not yet below the high watermark waits for the
watermark's next move, not for a timer.

A cleaning reads and writes files in a thread (the offset map, then each
cleaned segment), only below the high watermark, while the replica goes on
serving; each cleaned segment is swapped in on the event loop, where the log
is otherwise used. One that fails is tried again after CLEAN_FAILED_RETRY_S,
twice as late each time in a row, up to CLEAN_FAILED_RETRY_MAX_S. Leader and
followers clean their own copies.

Not thread-safe; the replica's event loop owns it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from logbus.actors.timers import Timers
from logbus.clock import wall_ms
from logbus.errors import LogbusError
from logbus.storage.cleaner import build_offset_map, clean_group, discard
from logbus.storage.partition_log import PartitionLog

logger = logging.getLogger(__name__)

CLEAN_TIMER = "clean"
CLEAN_FAILED_RETRY_S = 60.0  # a cleaning that failed is tried again this soon, then twice as late each time
CLEAN_FAILED_RETRY_MAX_S = 3600.0


class CleaningSchedule:
    """One replica's cleanings: when, and each one (see the module docstring).

    ``high_watermark()`` bounds what a cleaning may touch; ``swapped()`` is
    called after each cleaned segment is swapped in (reads shared before it
    may hold the old bytes) and ``shrank()`` after a cleaning that finished.
    Nothing starts, and a cleaning under way keeps nothing, once ``active()``
    says False (the replica is being deleted).
    """

    def __init__(
        self,
        log: PartitionLog,
        timers: Timers,
        high_watermark: Callable[[], int],
        swapped: Callable[[], None],
        shrank: Callable[[], None],
        label: str,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.log = log
        self._timers = timers
        self._high_watermark = high_watermark
        self._swapped = swapped
        self._shrank = shrank
        self._label = label
        self._task: asyncio.Task | None = None  # the cleaning under way
        self._stop = None  # set to stop it (the stop event of its plan)
        self._after_hw: int | None = None  # a cleaning due but held back: it starts once the watermark reaches this
        self._failures = 0  # in a row: the retry backs off
        self._active = active

    def _running(self) -> bool:
        return self._task is not None and not self._task.done()

    def arm(self) -> None:
        """One timer for the moment the log may next need cleaning (none for other topics)."""
        if self._running():
            return  # the cleaning under way arms the next one when it ends
        due_ms = self.log.next_cleaning_ms()
        if due_ms is None:
            self._timers.disarm(CLEAN_TIMER)
        else:
            self._timers.arm(CLEAN_TIMER, (due_ms - wall_ms()) / 1000, self._due)

    def high_watermark_moved(self) -> None:
        """A cleaning that waited for the high watermark may start now (no timer while it waits)."""
        if self._after_hw is not None and self._high_watermark() >= self._after_hw:
            self._after_hw = None
            self.arm()

    async def stop(self) -> None:
        """The cleaning under way (the replica is no longer ``active()``) stops at its next batch; returns once it has."""
        self._timers.disarm(CLEAN_TIMER)
        if self._running():
            if self._stop is not None:
                self._stop.set()
            await asyncio.wait({self._task})

    def _due(self) -> None:
        if not self._active() or self._running():
            return
        self._task = asyncio.get_running_loop().create_task(self._clean())

    async def _clean(self) -> None:
        """One cleaning below the high watermark: offset map and cleaned segments in a thread, each
        swap on the event loop. Then the timer for the next one."""
        retry_s = None
        rearm = True
        try:
            plan = self.log.cleaning_plan(upper_bound=self._high_watermark())
            if plan is None:
                due_ms = self.log.next_cleaning_ms()
                if due_ms is not None and due_ms <= wall_ms():
                    # Due, but not below the high watermark yet: the watermark's next move starts it.
                    self._after_hw = self.log.active_segment.base_offset
                    rearm = False
                return
            self._stop = plan.stop
            offset_map = await asyncio.to_thread(build_offset_map, plan)
            done = []
            for group in plan.groups:
                cleaned = await asyncio.to_thread(clean_group, plan, group, offset_map)
                if not self._active() or not self.log.replace_segments(cleaned):
                    discard(cleaned)
                    return  # the log changed meanwhile (truncated, retention): the next cleaning plans again
                self._swapped()
                done.append(cleaned)
            self.log.finish_cleaning(plan, done)
            self._failures = 0
            self._shrank()
            removed = sum(c.records_removed for c in done)
            logger.info(
                "replica %s: cleaned offsets up to %d: %d records removed, %d -> %d bytes",
                self._label, plan.end_offset, removed, sum(c.bytes_before for c in done), sum(c.bytes_after for c in done),
            )
        except Exception as error:  # noqa: BLE001 (keep serving; try again in a while, whatever failed)
            retry_s = min(CLEAN_FAILED_RETRY_S * 2**self._failures, CLEAN_FAILED_RETRY_MAX_S)
            self._failures += 1
            if self._active():
                expected = isinstance(error, LogbusError | OSError)  # a damaged or changed file; else a bug, with its traceback
                logger.warning("replica %s: log cleaning failed (trying again in %.0f s): %s", self._label, retry_s, error,
                               exc_info=not expected)
        finally:
            self._stop = None
            if self._active():
                if retry_s is not None:
                    self._timers.arm(CLEAN_TIMER, retry_s, self._due)
                elif rearm:
                    asyncio.get_running_loop().call_soon(self.arm)  # once this task is done
