"""Elections and role delivery: what the controller decides, apart from the calls it makes.

Pure state with an explicit clock (no Ray, no I/O), owned by the controller.

Elections are driven by events, never by a per-partition timer: any event
that may make a leader possible (the controller starts, a node is heard
again, a replica starts, a replica is reported up, an ISR or a topic's
config changes) runs :func:`needs_election` over the partitions it touches,
and :meth:`ClusterMetadata.elect_leader` chooses from the live ISR, and from
the other live replicas only where ``unclean.leader.election.enable`` allows
it (off by default, as in Kafka). A partition left without a leader while
one was electable for longer than ``LEADERLESS_LIMIT_MS`` means an event was
missed: a bug, which :class:`LeaderlessWatch` finds on the control loop's
tick (its cost is the leaderless partitions, normally none).

Role delivery follows Redpanda's controller_backend: the metadata is the
desired state, and :class:`RoleDeliveries` keeps, per replica, the role
change (``become_leader`` / ``become_follower`` at an epoch) not yet
acknowledged. The controller calls again on a bounded backoff and at once
when the replica's node is heard again, until the replica acknowledges the
epoch or a newer one replaces it; nothing that failed is forgotten.

These classes are not thread-safe; the controller's event loop owns them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from logbus.protocol.liveness import LEASE_TIMEOUT_MS

LEADERLESS_LIMIT_MS = LEASE_TIMEOUT_MS + 1_000  # a partition electable but leaderless this long: an event was missed
DELIVERY_RETRY_MIN_MS = 200  # a role change not delivered is sent again this soon, then twice as late each time
DELIVERY_RETRY_MAX_MS = 5_000  # ... up to this (a node heard again gets its pending changes at once)


def candidates(replicas: list[int], isr: list[int], alive: set[int], unclean_allowed: bool) -> tuple[list[int], bool]:
    """Who may lead, in replica order, and whether choosing one is unclean.

    The live ISR members; with none, and only if ``unclean_allowed``, every
    live replica (which may lack committed records).
    """
    clean = [r for r in replicas if r in isr and r in alive]
    if clean or not unclean_allowed:
        return clean, False
    return [r for r in replicas if r in alive], True


def needs_election(leader: int | None, alive: set[int]) -> bool:
    """Whether a partition must elect: it has no leader, or its leader is not alive."""
    return leader is None or leader not in alive


def electable(leader: int | None, replicas: list[int], isr: list[int], alive: set[int], unclean_allowed: bool) -> bool:
    """Whether an election would give a partition a live leader it lacks now."""
    return needs_election(leader, alive) and bool(candidates(replicas, isr, alive, unclean_allowed)[0])


@dataclass(slots=True)
class _Delivery:
    epoch: int
    node: str
    attempts: int = 0
    next_ms: int = 0
    in_flight: bool = False


class RoleDeliveries:
    """Role changes not yet acknowledged, one per replica key, with the epoch each must reach.

    ``expect`` records that a replica must learn an epoch (replacing an older
    one; an older epoch never replaces a newer). ``due`` lists those whose
    next try has come and that have no call under way; the caller marks each
    ``sending``, then reports ``delivered`` or ``failed``. A failure is tried
    again after a backoff that doubles from ``retry_min_ms`` to
    ``retry_max_ms``; ``node_heard`` makes a node's pending changes due at once.
    """

    def __init__(self, retry_min_ms: int = DELIVERY_RETRY_MIN_MS, retry_max_ms: int = DELIVERY_RETRY_MAX_MS) -> None:
        self.retry_min_ms = retry_min_ms
        self.retry_max_ms = retry_max_ms
        self._pending: dict[Hashable, _Delivery] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pending

    def expect(self, key: Hashable, epoch: int, node: str, now_ms: int) -> bool:
        """The replica ``key`` on ``node`` must learn ``epoch``; due now. False if a newer epoch is pending."""
        known = self._pending.get(key)
        if known is not None and known.epoch > epoch:
            return False
        if known is not None and known.epoch == epoch:
            known.node = node
            if not known.in_flight:
                known.next_ms = min(known.next_ms, now_ms)
            return True
        self._pending[key] = _Delivery(epoch, node, next_ms=now_ms)
        return True

    def epoch(self, key: Hashable) -> int | None:
        """The epoch pending for ``key``, or None."""
        known = self._pending.get(key)
        return None if known is None else known.epoch

    def attempts(self, key: Hashable) -> int:
        """Calls made for ``key``'s pending change since it was expected (or its node was last heard)."""
        known = self._pending.get(key)
        return 0 if known is None else known.attempts

    def retry_now(self, keys: Iterable[Hashable], now_ms: int) -> None:
        """These replicas are reachable again (reported up): their pending changes are due now."""
        for key in keys:
            known = self._pending.get(key)
            if known is not None:
                known.next_ms = min(known.next_ms, now_ms)
                known.attempts = 0

    def due(self, now_ms: int) -> list[tuple[Hashable, int]]:
        """(key, epoch) of every pending change whose next try has come and that has no call under way."""
        return [(key, d.epoch) for key, d in self._pending.items() if not d.in_flight and d.next_ms <= now_ms]

    def sending(self, key: Hashable, epoch: int) -> bool:
        """Mark a call under way; False if ``key`` no longer waits for ``epoch`` or a call is already under way."""
        known = self._pending.get(key)
        if known is None or known.epoch != epoch or known.in_flight:
            return False
        known.in_flight = True
        known.attempts += 1
        return True

    def delivered(self, key: Hashable, epoch: int) -> None:
        """The replica acknowledged ``epoch`` (or a newer one): nothing more to send it, unless newer is pending."""
        known = self._pending.get(key)
        if known is None:
            return
        if known.epoch <= epoch:
            del self._pending[key]
        elif known.in_flight:
            known.in_flight = False  # a newer change waits: due at its own time

    def failed(self, key: Hashable, epoch: int, now_ms: int) -> int | None:
        """The call for ``epoch`` failed; returns when it is tried again (None if nothing is pending for it)."""
        known = self._pending.get(key)
        if known is None:
            return None
        known.in_flight = False
        if known.epoch != epoch:
            return known.next_ms  # a newer change replaced it meanwhile
        delay = min(self.retry_min_ms * 2 ** max(0, known.attempts - 1), self.retry_max_ms)
        known.next_ms = now_ms + delay
        return known.next_ms

    def node_heard(self, node: str, now_ms: int) -> int:
        """``node`` is reachable again: its pending changes are due now, backoff reset. Returns how many."""
        count = 0
        for d in self._pending.values():
            if d.node == node:
                d.next_ms = min(d.next_ms, now_ms)
                d.attempts = 0
                count += 1
        return count

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Stop delivering to these replicas (deleted, removed, or a leaderless partition's)."""
        for key in keys:
            self._pending.pop(key, None)

    def keys(self) -> list[Hashable]:
        return list(self._pending)

    def describe(self) -> list[dict]:
        """Every pending change: key, epoch, node, attempts so far and whether a call is under way (for status and tests)."""
        return [
            {"key": key, "epoch": d.epoch, "node": d.node, "attempts": d.attempts, "in_flight": d.in_flight}
            for key, d in self._pending.items()
        ]


class LeaderlessWatch:
    """Partitions without a leader while one is electable: since when, and which have been so too long.

    The controller calls :meth:`update` for each leaderless partition it
    looks at (on events, and on its tick for the partitions it knows to be
    leaderless); a partition electable for longer than ``limit_ms`` is
    returned by :meth:`overdue` once per stretch.
    """

    def __init__(self, limit_ms: int = LEADERLESS_LIMIT_MS) -> None:
        self.limit_ms = limit_ms
        self._since: dict[Hashable, int] = {}
        self._reported: set[Hashable] = set()

    def update(self, key: Hashable, electable_now: bool, now_ms: int) -> None:
        """``key`` is leaderless and electable now (or not): starts or ends its stretch."""
        if electable_now:
            self._since.setdefault(key, now_ms)
        else:
            self.clear(key)

    def clear(self, key: Hashable) -> None:
        """``key`` has a leader (or cannot have one): its stretch ends."""
        self._since.pop(key, None)
        self._reported.discard(key)

    def watched(self) -> list[Hashable]:
        return list(self._since)

    def overdue(self, now_ms: int) -> list[tuple[Hashable, int]]:
        """(key, ms electable) of partitions over the limit, each returned once per stretch."""
        out = []
        for key, since in self._since.items():
            if now_ms - since > self.limit_ms and key not in self._reported:
                self._reported.add(key)
                out.append((key, now_ms - since))
        return out
