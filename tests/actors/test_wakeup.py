"""The replica's Wakeup (fetch_parking.py): waiters with timeouts, woken together (plain asyncio, no Ray)."""

import asyncio

import pytest

from logbus.actors.fetch_parking import Wakeup


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_waiters_are_woken_together_and_timeouts_leave_nothing_behind():
    async def scenario():
        wakeup = Wakeup()
        waiting = [asyncio.ensure_future(wakeup.wait(30)) for _ in range(3)]
        await asyncio.sleep(0)  # let them start waiting
        wakeup.wake_all()
        woken = await asyncio.gather(*waiting)
        assert await wakeup.wait(0.01) is False  # nobody wakes it now: the timeout answers
        return woken, len(wakeup._waiters)

    woken, left = run(scenario())
    assert woken == [True, True, True] and left == 0


def test_a_cancelled_waiter_is_forgotten_and_later_ones_still_wake():
    async def scenario():
        wakeup = Wakeup()
        cancelled = asyncio.ensure_future(wakeup.wait(30))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        left_after_cancel = len(wakeup._waiters)
        later = asyncio.ensure_future(wakeup.wait(30))
        await asyncio.sleep(0)
        wakeup.wake_all()
        return left_after_cancel, await later

    assert run(scenario()) == (0, True)
