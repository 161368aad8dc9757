"""Lease bookkeeping of the controller: when each replica was last heard from, and who is still alive.

Pure state with an explicit clock (no Ray, no I/O), owned by the controller.
A replica renews its lease with a heartbeat; the controller counts it alive
while its last heartbeat is at most ``LEASE_TIMEOUT_MS`` old. A leader itself
stops taking writes ``LEASE_MS`` after sending its last acknowledged
heartbeat, so it has stopped before the controller may elect another leader
(``LEASE_TIMEOUT_MS`` > ``LEASE_MS``, checked at import).

Three rules keep a slow or cut-off controller from deposing live replicas:

- a replica just created is alive until its first heartbeat or a start-up
  grace ends;
- a controller tick that runs late (the controller's process stalled, with
  heartbeats queued behind the stall) does not count the stalled time against
  anyone's lease;
- isolation: once no key at all has been heard for ``ISOLATED_AFTER_MS`` (every
  node silent at once: this controller's host is cut off, or every node went
  down together, which this process cannot tell apart), the silence from
  then on is not counted against the leases still running at the previous
  tick; once any key is heard again, each of those has ``REJOIN_MS`` plus a
  whole lease timeout from then to be heard too (an agent reopens its
  link to the controller within about a second of a heal). Electing nobody
  is all a controller that hears nobody could do anyway: what the rule saves
  is the round of elections (new epochs, fences, role changes) after a cut
  of the controller's host, where every leader can go on under its old
  epoch once its node's lease is renewed. Its cost is bounded per key: the
  rule never keeps a key alive past ``ISOLATION_CREDIT_MAX_MS`` plus a lease
  timeout after its last real heartbeat, however often silences come and go.

Each rule only lengthens the time before the controller counts a replica
dead, never shortens it, and none brings back one already counted dead; so
a leader has always stopped (``LEASE_MS``) before another may be elected.
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
ISOLATED_AFTER_MS = 2 * HEARTBEAT_INTERVAL_MS  # no key heard this long: the controller is cut off (or all are down)
ISOLATION_CREDIT_MAX_MS = 10_000  # isolation keeps a key alive at most this much past its last heartbeat's lease
REJOIN_MS = 1_000  # after an isolation, what a key gets beyond a lease timeout to be heard (reconnect, a heartbeat)

check(LEASE_TIMEOUT_MS > LEASE_MS + HEARTBEAT_INTERVAL_MS,
      "the controller's lease timeout must exceed a leader's lease by at least one heartbeat interval")
check(ISOLATED_AFTER_MS < LEASE_TIMEOUT_MS, "isolation must be seen before any lease runs out")


class Liveness:
    """Last-heard times per key (a node or a replica), with start-up grace, stall and isolation compensation.

    ``_last_seen_ms`` is what leases are judged by: a real heartbeat, or a
    start-up grace's end, moved on by the stall and isolation rules.
    ``_heard_ms`` is each key's last real heartbeat (moved on by stalls only),
    which bounds what isolation may add.
    """

    def __init__(self, now_ms: int, lease_timeout_ms: int = LEASE_TIMEOUT_MS, restart_grace_ms: int = RESTART_GRACE_MS,
                 isolated_after_ms: int = ISOLATED_AFTER_MS, isolation_credit_max_ms: int = ISOLATION_CREDIT_MAX_MS,
                 rejoin_ms: int = REJOIN_MS) -> None:
        check(isolated_after_ms < lease_timeout_ms, "isolation must be seen before any lease runs out")
        self.lease_timeout_ms = lease_timeout_ms
        self.isolated_after_ms = isolated_after_ms
        self.isolation_credit_max_ms = isolation_credit_max_ms
        self.rejoin_ms = rejoin_ms
        # Keys never heard from since this controller started count from here: running replicas
        # get restart_grace_ms to check in before they are judged.
        self._default_ms = now_ms + restart_grace_ms
        self._last_seen_ms: dict[Hashable, int] = {}
        self._heard_ms: dict[Hashable, int] = {}
        self._newest_heard_ms: int | None = None  # max(_heard_ms.values()), kept as heartbeats come
        self._last_tick_ms: int | None = None
        self._credited: set[Hashable] = set()  # keys this isolation kept alive so far
        self._rejoining: set[Hashable] = set()  # keys kept alive by the last isolation, not heard since it ended
        self.isolated = False  # as of the last tick: no key heard for isolated_after_ms
        self.isolated_ms = 0  # silence of the current isolation not counted against leases
        self.isolations = 0  # isolations that kept a lease alive, since this controller started
        self.isolated_total_ms = 0  # silence not counted, over every isolation

    def expect(self, key: Hashable, now_ms: int, grace_ms: int = STARTUP_GRACE_MS) -> None:
        """A replica is being created: alive until its first heartbeat or ``grace_ms`` from now."""
        self._last_seen_ms[key] = now_ms + grace_ms
        self._unheard(key)
        self._rejoining.discard(key)

    def heard(self, key: Hashable, now_ms: int) -> None:
        """A heartbeat arrived from ``key``."""
        before = self._heard_ms.get(key)
        self._last_seen_ms[key] = self._heard_ms[key] = now_ms
        if self._newest_heard_ms is None or now_ms >= self._newest_heard_ms:
            self._newest_heard_ms = now_ms
        elif before == self._newest_heard_ms:  # the newest went back (a stall moved it on): rare, work per key then
            self._newest_heard_ms = max(self._heard_ms.values())
        self._rejoining.discard(key)

    def forget(self, key: Hashable) -> None:
        self._last_seen_ms.pop(key, None)
        self._unheard(key)
        self._credited.discard(key)
        self._rejoining.discard(key)

    def _unheard(self, key: Hashable) -> None:
        """Drop ``key``'s last heartbeat; the newest of all is found again only if it was that one."""
        if self._heard_ms.pop(key, None) == self._newest_heard_ms:
            self._newest_heard_ms = max(self._heard_ms.values(), default=None)

    def silent_ms(self, key: Hashable, now_ms: int) -> int:
        """How long ``key`` has been silent (negative while a start-up grace runs)."""
        return now_ms - self._last_seen_ms.get(key, self._default_ms)

    def alive(self, key: Hashable, now_ms: int) -> bool:
        return self.silent_ms(key, now_ms) <= self.lease_timeout_ms

    def rejoining(self) -> int:
        """How many keys the last isolation kept alive have not been heard since it ended (and are still alive)."""
        return len(self._rejoining)

    def tick(self, now_ms: int, interval_ms: int, stall_ms: int = STALL_MS) -> int:
        """Called once per control-loop tick; returns how late this tick ran.

        A tick later than ``stall_ms`` past its interval means this process
        stalled: replicas' heartbeats may still be queued behind the stall, so
        the stalled time is added to every last-heard time. Then the isolation
        rule (module docstring) for the time since the last tick.
        """
        previous_ms, self._last_tick_ms = self._last_tick_ms, now_ms
        late_ms = 0 if previous_ms is None else now_ms - previous_ms - interval_ms
        stalled_ms = late_ms if late_ms > stall_ms else 0
        if stalled_ms:
            for times in (self._last_seen_ms, self._heard_ms):
                for key in times:
                    times[key] += stalled_ms
            self._default_ms += stalled_ms
            if self._newest_heard_ms is not None:
                self._newest_heard_ms += stalled_ms
        if previous_ms is not None:
            self._isolation(previous_ms, now_ms, stalled_ms)
        self._rejoining = {key for key in self._rejoining if self.alive(key, now_ms)}
        return late_ms

    def _isolation(self, previous_ms: int, now_ms: int, stalled_ms: int) -> None:
        """The isolation rule, for the time since the tick at ``previous_ms`` (less a stall already credited).
        Costs the keys heard, only while no key is heard."""
        if self._newest_heard_ms is None or now_ms - self._newest_heard_ms <= self.isolated_after_ms:
            if self.isolated:  # heard again: each key kept alive gets a while from now to be heard too
                for key in self._credited:
                    seen, heard = self._last_seen_ms.get(key), self._heard_ms.get(key)
                    if seen is None or heard is None or now_ms - seen > self.lease_timeout_ms or heard >= now_ms - self.isolated_after_ms:
                        continue  # gone, counted dead, or heard since
                    self._last_seen_ms[key] = max(seen, min(now_ms + self.rejoin_ms, heard + self.isolation_credit_max_ms))
                    self._rejoining.add(key)
                self._credited.clear()
                self.isolated, self.isolated_ms = False, 0
            return
        if not self.isolated:
            self.isolated = True
        span_ms = now_ms - previous_ms - stalled_ms
        credited = False
        for key, seen in self._last_seen_ms.items():
            heard = self._heard_ms.get(key)
            # Only keys heard for real and alive at the last tick (a key counted dead stays dead), and no
            # further than the bound past its last heartbeat.
            if heard is None or previous_ms - seen > self.lease_timeout_ms:
                continue
            moved = min(seen + span_ms, heard + self.isolation_credit_max_ms)
            if moved > seen:
                self._last_seen_ms[key] = moved
                self._credited.add(key)
                credited = True
        if credited:
            if self.isolated_ms == 0:
                self.isolations += 1
            self.isolated_ms += span_ms
            self.isolated_total_ms += span_ms
