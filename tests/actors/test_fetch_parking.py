"""Long polls parked at the log end and produces waiting for their commit, on an event loop with a fake
clock (no Ray, no real waiting; the times seen are exact)."""

from __future__ import annotations

import asyncio

import pytest

from logbus.actors.fetch_parking import COMMIT_WAIT_SLICE_S, FetchParking
from logbus.errors import NotLeaderError
from tests.fake_clock_loop import run_on_fake_clock


class Log:
    """What a parked fetch reads: records appended at given times."""

    def __init__(self) -> None:
        self.end = 0
        self.reads = 0

    def read_from(self, offset: int):
        self.reads += 1
        return (offset, self.end) if self.end > offset else None


def test_a_parked_fetch_is_answered_by_the_first_append_and_not_before():
    async def main():
        loop = asyncio.get_running_loop()
        parking, log = FetchParking(), Log()

        def append():
            log.end += 1
            parking.appended_now()

        loop.call_later(0.3, append)
        result = await parking.read(lambda: log.read_from(0), 5_000, check=lambda: None)
        return result, loop.time(), log.reads, len(parking)

    result, answered_s, reads, parked_after = run_on_fake_clock(main)
    assert result == (0, 1) and answered_s == pytest.approx(0.3)
    assert reads == 2 and parked_after == 0  # one read on arrival, one when woken; nothing left parked


def test_a_parked_fetch_with_nothing_to_read_ends_at_its_deadline_with_none():
    async def main():
        loop = asyncio.get_running_loop()
        parking, log = FetchParking(), Log()
        loop.call_later(0.2, parking.high_watermark_moved)  # woken early, still nothing: it parks again
        result = await parking.read(lambda: log.read_from(0), 1_500, check=lambda: None)
        return result, loop.time(), log.reads

    result, ended_s, reads = run_on_fake_clock(main)
    assert result is None and ended_s == pytest.approx(1.5) and reads == 3


def test_a_parked_fetch_ends_with_the_error_its_check_raises_once_woken():
    async def main():
        loop = asyncio.get_running_loop()
        parking, log = FetchParking(), Log()
        leading = {"yes": True}

        def check():
            if not leading["yes"]:
                raise NotLeaderError("leadership changed during the fetch")

        def deposed():
            leading["yes"] = False
            parking.appended_now()

        loop.call_later(0.4, deposed)
        with pytest.raises(NotLeaderError):
            await parking.read(lambda: log.read_from(0), 10_000, check=check)
        return loop.time()

    assert run_on_fake_clock(main) == pytest.approx(0.4)


def test_a_fetch_without_a_wait_reads_once():
    async def main():
        parking, log = FetchParking(), Log()
        return await parking.read(lambda: log.read_from(0), 0, check=lambda: None), log.reads

    assert run_on_fake_clock(main) == (None, 1)


def test_many_parked_fetches_are_woken_together():
    async def main():
        loop = asyncio.get_running_loop()
        parking, log = FetchParking(), Log()
        fetches = [asyncio.ensure_future(parking.read(lambda o=o: log.read_from(o), 10_000, check=lambda: None)) for o in range(3)]
        await asyncio.sleep(0.1)
        parked = len(parking)
        log.end = 5
        parking.appended_now()
        results = await asyncio.gather(*fetches)
        return parked, results, loop.time()

    parked, results, done_s = run_on_fake_clock(main)
    assert parked == 3 and results == [(0, 5), (1, 5), (2, 5)] and done_s == pytest.approx(0.1)


def test_a_produce_waits_until_its_commit_and_looks_again_each_slice():
    async def main():
        loop = asyncio.get_running_loop()
        parking = FetchParking()
        hw = {"value": 0}
        looks = []

        def moved():
            hw["value"] = 10
            parking.high_watermark_moved()

        loop.call_later(0.35, moved)
        done = await parking.wait_until(lambda: hw["value"] >= 10, check=lambda: looks.append(loop.time()), timeout_ms=5_000)
        return done, loop.time(), looks

    done, done_s, looks = run_on_fake_clock(main)
    assert done and done_s == pytest.approx(0.35)
    # Looked at once on arrival and after each slice without a wakeup (an ISR shrink wakes nobody).
    assert looks == pytest.approx([0.0, COMMIT_WAIT_SLICE_S, 2 * COMMIT_WAIT_SLICE_S, 3 * COMMIT_WAIT_SLICE_S])


def test_a_produce_whose_commit_does_not_come_gives_up_at_its_timeout():
    async def main():
        loop = asyncio.get_running_loop()
        done = await FetchParking().wait_until(lambda: False, check=lambda: None, timeout_ms=1_250)
        return done, loop.time()

    done, ended_s = run_on_fake_clock(main)
    assert not done and ended_s == pytest.approx(1.25)

