"""Fetches parked at a replica's log end (Kafka's delayed fetches), and produces waiting for their commit.

A fetch that finds nothing to read waits, up to its ``max_wait_ms``, for the
next append (a long poll): :meth:`FetchParking.read` reads, and while the
read finds nothing, parks on the ``appended`` wakeup, which every append and
every move of the high watermark wakes. Each waiter has its own deadline
(one ``call_later`` while it waits, none otherwise: nothing runs while a
replica is idle). An acks=all produce waits the same way on ``hw_moved``
until the high watermark passes its batch (:meth:`FetchParking.wait_until`).

Who may read (the leadership a fetch started under) is the caller's to
check: ``read`` calls its ``check`` before every read, and a woken fetch
whose leadership changed ends with the error ``check`` raises.

Plain asyncio, no Ray: tests drive it on an event loop with a fake clock.
Not thread-safe; the replica's event loop owns it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

Result = TypeVar("Result")

COMMIT_WAIT_SLICE_S = 0.1  # a produce waiting for its commit looks again at least this often (ISR shrinks wake nothing)


class Wakeup:
    """Coroutines waiting, with a timeout, for the next ``wake_all()``.

    What ``asyncio.wait_for(event.wait(), t)`` on a fresh Event per signal did,
    without a task per wait: a woken waiter resumes in the loop's next turn
    instead of three turns later, which is on the path of every fetch waiting
    at the log end.
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    async def wait(self, timeout_s: float) -> bool:
        """True if woken, False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(max(0.0, timeout_s), _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if not (waiter.done() and not waiter.cancelled() and waiter.result()):
                try:
                    self._waiters.remove(waiter)  # timed out or cancelled: not waiting any more
                except ValueError:
                    pass

    def __len__(self) -> int:
        """How many coroutines wait now."""
        return len(self._waiters)

    def wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


class FetchParking:
    """The two wakeups of a replica and the waits on them."""

    def __init__(self) -> None:
        self.appended = Wakeup()  # every append, and every move of the high watermark
        self.hw_moved = Wakeup()  # every move of the high watermark, and every change of leadership

    def appended_now(self) -> None:
        """An append: parked fetches read again (idempotent batches waiting for a predecessor look again)."""
        self.appended.wake_all()

    def high_watermark_moved(self) -> None:
        """The high watermark moved: produces waiting for it look again, and so do fetches bounded by it."""
        self.hw_moved.wake_all()
        self.appended.wake_all()

    def leadership_changed(self) -> None:
        """Produces waiting for a commit look again (and give up: their leadership is gone)."""
        self.hw_moved.wake_all()

    def __len__(self) -> int:
        """How many fetches (and, rarely, idempotent batches waiting for an earlier one) are parked."""
        return len(self.appended)

    async def read(self, read: Callable[[], Result | None], max_wait_ms: int, check: Callable[[], None]) -> Result | None:
        """``read()``'s first result that is not None, waiting up to ``max_wait_ms`` for appends; None if none came.

        ``check()`` runs before every read and raises to end the fetch (its
        leadership changed while it waited).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_ms / 1000
        while True:
            check()
            result = read()
            if result is not None:
                return result
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self.appended.wait(remaining)

    async def wait_until(self, done: Callable[[], bool], check: Callable[[], None], timeout_ms: int) -> bool:
        """Wait until ``done()`` (looked at when the high watermark moves, and every COMMIT_WAIT_SLICE_S);
        False if ``timeout_ms`` passed first. ``check()`` runs before each look and raises to give up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while not done():
            check()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await self.hw_moved.wait(min(remaining, COMMIT_WAIT_SLICE_S))
        return True
