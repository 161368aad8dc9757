"""One-shot timers by name on the running event loop: what a replica arms instead of periodic work.

A replica runs nothing on an idle timer: each kind of deadline (the ISR's
next check, the oldest data's retention, an interval flush, the next
cleaning, asking for its role) is one named timer, armed for the moment it
is due and re-armed by whatever moves that moment. Arming a name again
replaces its timer; a fired timer is gone until armed again.

This class is not thread-safe; its owner's event loop uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

MAX_TIMER_S = 24 * 3600.0  # a far-away deadline is re-checked daily (clock changes, config changes)


class Timers:
    """Named one-shot timers; a timer fires its callback only while ``active()`` says so."""

    def __init__(self, active: Callable[[], bool] = lambda: True) -> None:
        self._active = active
        self._handles: dict[str, asyncio.TimerHandle] = {}

    def arm(self, name: str, delay_s: float, callback: Callable[[], None]) -> None:
        """Fire ``callback`` in ``delay_s`` (clamped to [0, MAX_TIMER_S]), replacing the timer ``name``."""
        self.disarm(name)
        delay_s = min(max(0.0, delay_s), MAX_TIMER_S)
        self._handles[name] = asyncio.get_running_loop().call_later(delay_s, self._fire, name, callback)

    def _fire(self, name: str, callback: Callable[[], None]) -> None:
        self._handles.pop(name, None)
        if self._active():
            callback()

    def disarm(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()

    def __contains__(self, name: str) -> bool:
        """Whether the timer ``name`` is armed."""
        return name in self._handles
