"""An asyncio event loop on a fake clock: time moves only when the loop would sleep, straight to the next timer.

Code under test uses the loop as it always does (``loop.time()``,
``call_later``, ``asyncio.sleep``, futures); a wait of ten seconds takes no
time at all, and the times a test sees are exact. A loop that would wait
with no timer armed (nothing could ever wake it) raises instead of hanging.
No threads: ``call_soon_threadsafe`` and ``to_thread`` are not for it.
"""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: FakeClockLoop | None = None

    def select(self, timeout=None):
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("the loop would wait forever: nothing is scheduled that could wake it")
        self.loop.now_s += timeout
        return events


class FakeClockLoop(asyncio.SelectorEventLoop):
    """``time()`` starts at 0 and jumps to each timer as the loop reaches it."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now_s = 0.0

    def time(self) -> float:
        return self.now_s


def run_on_fake_clock(main):
    """Run the coroutine function ``main`` on a fresh FakeClockLoop; returns its result."""
    loop = FakeClockLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
