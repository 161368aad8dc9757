"""The replica's named one-shot timers, on an event loop with a fake clock (no Ray, no real waiting)."""

from __future__ import annotations

import asyncio

import pytest

from logbus.actors.timers import MAX_TIMER_S, Timers
from tests.fake_clock_loop import run_on_fake_clock


def test_timers_fire_once_rearming_replaces_and_an_inactive_owner_hears_nothing():
    async def main():
        loop = asyncio.get_running_loop()
        active = {"yes": True}
        timers = Timers(lambda: active["yes"])
        fired = []
        timers.arm("isr", 1.0, lambda: fired.append(("isr", loop.time())))
        timers.arm("isr", 2.0, lambda: fired.append(("isr again", loop.time())))  # replaces the first
        timers.arm("flush", -5, lambda: fired.append(("flush", loop.time())))  # a deadline passed: at once
        timers.arm("retention", 10 * MAX_TIMER_S, lambda: fired.append(("retention", loop.time())))
        timers.arm("clean", 3.0, lambda: fired.append(("clean", loop.time())))
        timers.disarm("clean")
        await asyncio.sleep(2.5)
        armed = ("isr" in timers, "retention" in timers)
        active["yes"] = False
        await asyncio.sleep(MAX_TIMER_S)
        timers.cancel_all()
        return fired, armed

    fired, armed = run_on_fake_clock(main)
    assert fired == [("flush", 0.0), ("isr again", pytest.approx(2.0))]
    assert armed == (False, True)  # a fired timer is gone; a far deadline is capped at a day, not lost
