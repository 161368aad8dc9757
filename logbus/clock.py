"""The two clocks logbus reads: monotonic milliseconds for timeouts and leases, wall milliseconds for record timestamps.

Every module that needs the time asks here, so a test or a reader finds one
definition of each clock.
"""

from __future__ import annotations

import time


def monotonic_ms() -> int:
    """Milliseconds of a clock that never goes back (for durations, deadlines and leases)."""
    return time.monotonic_ns() // 1_000_000


def wall_ms() -> int:
    """Milliseconds since the Unix epoch (for record timestamps and retention)."""
    return time.time_ns() // 1_000_000
