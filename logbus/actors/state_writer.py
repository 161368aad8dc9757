"""One writer task per state file: keeps a file at the latest queued text, in order, off the event loop.

The group service saves ``groups.json`` whenever a group's durable state
changes, and must answer a call only once the state that call saw is on disk.
Writing on the event loop would stall every other call for an fsync; one
thread per write could reorder them. So writes are queued here: a single task
writes the latest queued text (``asyncio.to_thread``), states queued while a
write runs fold into the next one, and ``durable()`` waits until everything
queued before it is on disk, or raises if the write failed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from logbus.errors import CoordinatorNotAvailableError
from logbus.storage.files import write_atomically

logger = logging.getLogger(__name__)

WRITE_RETRY_S = 1.0  # after a failed write, retry_failed() tries again this often


class StateWriter:
    """The latest state of one file, written by one task (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._text: str | None = None  # the latest text queued
        self._seq = 0  # sequence number of the latest text queued
        self._written_seq = 0  # of the latest text on disk
        self._writer: asyncio.Task | None = None
        self._error: OSError | None = None
        self._failed_s = 0.0
        self._flushed: asyncio.Event | None = None  # set (and replaced) after every write attempt

    def queue(self, text: str) -> None:
        """Make ``text`` the file's next content; returns at once (``durable()`` waits for it)."""
        if text == self._text:
            return
        self._text = text
        self._seq += 1
        self._start()

    def _start(self) -> None:
        if self._written_seq >= self._seq:
            return
        if self._writer is not None and not self._writer.done():
            return  # the running writer picks the latest text up when its write ends
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop (no writer can be running): write here
            write_atomically(self.path, self._text)
            self._written_seq = self._seq
            return
        self._writer = loop.create_task(self._write())

    async def _write(self) -> None:
        while self._written_seq < self._seq:
            seq, text = self._seq, self._text
            try:
                await asyncio.to_thread(write_atomically, self.path, text)
            except OSError as error:
                if self._error is None:
                    logger.error("cannot write %s: %r (retrying)", self.path, error)
                self._error = error
                self._failed_s = time.monotonic()
                self._wake()
                return
            self._error = None
            self._written_seq = seq
            self._wake()

    def _wake(self) -> None:
        flushed, self._flushed = self._flushed, None
        if flushed is not None:
            flushed.set()

    async def durable(self) -> None:
        """Wait until every text queued so far is on disk; CoordinatorNotAvailableError (retriable) if it cannot be written."""
        target = self._seq
        while self._written_seq < target:
            writing = self._writer is not None and not self._writer.done()
            if not writing and self._error is not None:
                error, self._error = self._error, None
                self._start()  # let the next caller (or the timer) try again
                raise CoordinatorNotAvailableError(f"the group coordinator cannot save its state: {error}")
            self._start()
            if self._flushed is None:
                self._flushed = asyncio.Event()
            await self._flushed.wait()

    def has_failed(self) -> bool:
        """Whether the last write failed (and is to be retried)."""
        return self._error is not None

    def retry_failed(self) -> None:
        """Called by a timer: after a failed write, try again once WRITE_RETRY_S has passed."""
        if self._error is not None and time.monotonic() - self._failed_s > WRITE_RETRY_S:
            self._failed_s = time.monotonic()
            self._start()
