"""Retries: one rule for every client, bounded exponential backoff within a deadline.

A retriable error (a leader election, a restarting controller or replica, a
call that timed out) is retried inside the clients, as Kafka's clients do,
and the caller sees only what retrying cannot fix, or a timeout. Everything
that retries does it through here:

- :class:`Backoff` is the state of one retried operation: the wait before
  its next try (``min_s``, doubling up to ``max_s``, back to ``min_s`` after
  a success) and its deadline, past which there is no next try. The
  producer keeps one per batch (its delivery timeout), the consumer one per
  partition (no deadline: ``poll()`` goes on reading the other partitions
  meanwhile), a Ray Data read task one per partition it reads.
- :func:`retry_until` runs a call again after each retriable error until its
  deadline, then raises RequestTimedOutError naming what was being done and
  the last error: the consumer's commits and offset lookups, the command
  line's group resets.

Nothing here runs on a timer: a retry happens when its caller next acts.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from logbus.errors import LogbusError, RequestTimedOutError

logger = logging.getLogger(__name__)

RETRY_BACKOFF_MIN_S = 0.05  # the first retry waits this long
RETRY_BACKOFF_MAX_S = 1.0  # and the wait doubles up to this (Kafka's retry.backoff.max.ms)

T = TypeVar("T")


class Backoff:
    """The retries of one operation: how long to wait before the next try, and whether there is one.

    Not thread-safe: one owner (a partition's state, a batch, a loop).
    """

    __slots__ = ("min_s", "max_s", "deadline_s", "_next_s")

    def __init__(
        self, min_s: float = RETRY_BACKOFF_MIN_S, max_s: float = RETRY_BACKOFF_MAX_S, deadline_s: float | None = None
    ) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"a backoff needs 0 < min_s <= max_s, not {min_s}, {max_s}")
        self.min_s = min_s
        self.max_s = max_s
        self.deadline_s = deadline_s  # time.monotonic(); None: retried for as long as the owner wants
        self._next_s = min_s

    def delay_s(self, now: float) -> float | None:
        """The wait before the next try (doubling the one after it, up to ``max_s``), or None when that
        try would start past the deadline: give up."""
        delay = self._next_s
        if self.deadline_s is not None and now + delay >= self.deadline_s:
            return None
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def succeeded(self) -> None:
        """A try worked: the next failure starts again from ``min_s``."""
        self._next_s = self.min_s


def retry_until(
    deadline_s: float,
    what: str,
    attempt: Callable[[float], T],
    on_retry: Callable[[LogbusError], None] | None = None,
    *,
    retriable: Callable[[LogbusError], bool] = lambda error: error.retriable,
) -> T:
    """``attempt(seconds left)`` until it returns, retrying retriable logbus errors until ``deadline_s``.

    ``on_retry(error)`` runs before each new try (a metadata refresh, say);
    the tries back off from RETRY_BACKOFF_MIN_S to RETRY_BACKOFF_MAX_S. An
    error ``retriable`` refuses (by default: one not marked retriable) goes
    to the caller at once; once ``deadline_s`` (``time.monotonic()``) is
    near, RequestTimedOutError says what was being done and what the last
    error was. One try is always made.
    """
    backoff = Backoff()  # no deadline of its own: the last try starts at deadline_s at the latest
    while True:
        try:
            return attempt(max(0.0, deadline_s - time.monotonic()))
        except LogbusError as error:
            if not retriable(error):
                raise
            now = time.monotonic()
            if now >= deadline_s:
                raise RequestTimedOutError(f"{what} did not complete within its timeout; last error: {error}") from error
            logger.debug("%s: retrying after %s: %s", what, type(error).__name__, error)
            if on_retry is not None:
                on_retry(error)
            time.sleep(min(backoff.delay_s(now), deadline_s - now))
