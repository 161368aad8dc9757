"""Lease bookkeeping of the controller: when each replica was last heard from, and who is still alive.

Pure state with an explicit clock (no Ray, no I/O), owned by the controller.
A replica renews its lease with a heartbeat; the controller counts it alive
while its last heartbeat is at most ``LEASE_TIMEOUT_MS`` old. A leader itself
stops taking writes ``LEASE_MS`` after sending its last acknowledged
heartbeat, so it has stopped before the controller may elect another leader
(``LEASE_TIMEOUT_MS`` > ``LEASE_MS``, checked at import).

Two rules keep a slow controller from deposing live replicas: a replica just
created is alive until its first heartbeat or a start-up grace ends, and a
controller tick that runs late (the controller's process stalled, with
heartbeats queued behind the stall) does not count the stalled time against
anyone's lease.
"""

from __future__ import annotations

from collections.abc import Hashable

from logbus.invariant import check

# As a Ray actor call a heartbeat cost each of its two processes about 1.7 ms of CPU on a 2-core
# VM (idle, the agent and the controller each used 2.0-2.7 % of a core with a heartbeat every
# 100 ms, 1.35 % every 200 ms); over the agents' sockets (actors/heartbeat_link.py) they use about
# 0.6 % each every 200 ms, near a plain idle actor's 0.35 %. Failover of a whole frozen node is
# 0.8 s of silence, a tick and an election (p50 <= 1 s, max <= 2 s); a reply may come 350 ms late
# before the lease lapses, and a write that finds it lapsed waits for the next renewal.
LEASE_MS = 550  # a leader stops taking writes this long after sending its last acknowledged heartbeat
LEASE_TIMEOUT_MS = 800  # the controller deposes a leader silent this long
HEARTBEAT_INTERVAL_MS = 200  # node agents renew their node's lease this often
STALL_MS = 200  # a controller tick this much later than its interval means the controller stalled
STARTUP_GRACE_MS = 30_000  # a replica actor being created is not judged before its first heartbeat (or this)
RESTART_GRACE_MS = 3_000  # after a controller restart, running replicas get this long to check in

check(LEASE_TIMEOUT_MS > LEASE_MS + HEARTBEAT_INTERVAL_MS,
      "the controller's lease timeout must exceed a leader's lease by at least one heartbeat interval")


class Liveness:
    """Last-heard times per key (a replica), with start-up grace and stall compensation."""

    def __init__(self, now_ms: int, lease_timeout_ms: int = LEASE_TIMEOUT_MS, restart_grace_ms: int = RESTART_GRACE_MS) -> None:
        self.lease_timeout_ms = lease_timeout_ms
        # Keys never heard from since this controller started count from here: running replicas
        # get restart_grace_ms to check in before they are judged.
        self._default_ms = now_ms + restart_grace_ms
        self._last_seen_ms: dict[Hashable, int] = {}
        self._last_tick_ms: int | None = None

    def expect(self, key: Hashable, now_ms: int, grace_ms: int = STARTUP_GRACE_MS) -> None:
        """A replica is being created: alive until its first heartbeat or ``grace_ms`` from now."""
        self._last_seen_ms[key] = now_ms + grace_ms

    def heard(self, key: Hashable, now_ms: int) -> None:
        """A heartbeat arrived from ``key``."""
        self._last_seen_ms[key] = now_ms

    def forget(self, key: Hashable) -> None:
        self._last_seen_ms.pop(key, None)

    def silent_ms(self, key: Hashable, now_ms: int) -> int:
        """How long ``key`` has been silent (negative while a start-up grace runs)."""
        return now_ms - self._last_seen_ms.get(key, self._default_ms)

    def alive(self, key: Hashable, now_ms: int) -> bool:
        return self.silent_ms(key, now_ms) <= self.lease_timeout_ms

    def tick(self, now_ms: int, interval_ms: int, stall_ms: int = STALL_MS) -> int:
        """Called once per control-loop tick; returns how late this tick ran.

        A tick later than ``stall_ms`` past its interval means this process
        stalled: replicas' heartbeats may still be queued behind the stall, so
        the stalled time is added to every last-heard time.
        """
        late_ms = 0 if self._last_tick_ms is None else now_ms - self._last_tick_ms - interval_ms
        self._last_tick_ms = now_ms
        if late_ms > stall_ms:
            for key in self._last_seen_ms:
                self._last_seen_ms[key] += late_ms
            self._default_ms += late_ms
        return late_ms
