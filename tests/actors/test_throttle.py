"""A reassignment's throttled copy: the pace of the new replica's fetch loop (replica_fetcher.py; plain asyncio, no Ray).

The replica's clock is its event loop's; here the loop's clock is the test's, and moves only when
the replica sleeps, so the waits are checked exactly whatever the machine's load.
"""

import asyncio
import types

from logbus.actors.replica_fetcher import ReplicaFetcher


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is ``now``, set by the test."""

    now = 1_000.0

    def time(self) -> float:
        return self.now


def paced(slices: list[int], rate: int | None, work_s: float = 0.0, monkeypatch=None) -> tuple[list[float], float, object]:
    """Copy ``slices`` (bytes each) through ``_pace``, ``work_s`` of fetching after each; returns the
    waits it asked for, the time the copy took on the loop's clock, and the fetch loop's state."""
    loop = ClockLoop()
    fetcher = types.SimpleNamespace(throttle_bytes_per_s=rate, _throttle_until=0.0, throttled_copy_bytes=0)
    waits = []

    async def sleep(seconds):
        waits.append(seconds)
        loop.now += seconds

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def copy():
        for size in slices:
            await ReplicaFetcher._pace(fetcher, size)
            loop.now += work_s

    started = loop.now
    try:
        loop.run_until_complete(copy())
    finally:
        loop.close()
    return waits, loop.now - started, fetcher


def test_a_throttled_copy_takes_at_least_its_bytes_over_the_rate(monkeypatch):
    rate = 1_000_000
    slices = [200_000] * 10 + [64_000, 5_000]
    waits, took_s, fetcher = paced(slices, rate, monkeypatch=monkeypatch)
    assert took_s >= sum(slices) / rate * (1 - 1e-9)
    assert all(w > 0 for w in waits) and len(waits) == len(slices)
    assert fetcher.throttled_copy_bytes == sum(slices)


def test_fetch_time_does_not_let_the_copy_exceed_the_rate(monkeypatch):
    """Slices fetched slowly (0.05 s each) or in bursts: never faster than the throttle over the copy."""
    rate = 1_000_000
    for work_s in (0.05, 0.0):
        slices = [200_000, 64_000, 200_000, 1_000, 200_000]
        _, took_s, _ = paced(slices, rate, work_s=work_s, monkeypatch=monkeypatch)
        assert took_s >= sum(slices) / rate * (1 - 1e-9), work_s


def test_no_throttle_no_wait(monkeypatch):
    waits, took_s, fetcher = paced([16 << 20] * 3, None, monkeypatch=monkeypatch)
    assert waits == [] and took_s == 0 and fetcher.throttled_copy_bytes == 0
