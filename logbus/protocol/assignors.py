"""Partition assignment strategies for consumer groups, with Kafka's semantics.

Pure functions over plain values: no Ray, no I/O, no clock. The group
coordinator (:mod:`logbus.protocol.group_coordinator`) picks one strategy per
generation and calls it once every member has rejoined.

Input and output
----------------
``assign(partitions_per_topic, subscriptions)`` takes

- ``partitions_per_topic``: topic -> partition count, for the topics that exist
  (a subscribed topic missing from it gets no partitions, as in Kafka);
- ``subscriptions``: member id -> :class:`Subscription` (the member's topics,
  the partitions it owned before this rebalance, its static instance id),

and returns member id -> sorted list of :class:`TopicPartition`, with an entry
(possibly empty) for every member. A partition is only ever given to a member
subscribed to its topic, and to at most one member.

Member order
------------
Strategies that deal partitions in member order sort members as Kafka's
``MemberInfo`` does: static members (with a ``group_instance_id``) first, by
instance id, then dynamic members by member id. A static member gets a new
member id when it restarts, so ordering by instance id keeps its place.

The strategies (looked up by name with :func:`get_assignor`)
------------------------------------------------------------
``range``
    Per topic, the subscribed members in member order each get one contiguous
    range; the first ``count % members`` members get one extra partition
    (Kafka's RangeAssignor). Eager.
``roundrobin``
    All subscribed topic-partitions sorted by (topic, partition), dealt over a
    circular iterator of members in member order that skips members not
    subscribed to the partition's topic (Kafka's RoundRobinAssignor). Eager.
``cooperative-sticky``
    A balanced assignment that keeps each member's previously owned
    partitions where it can (see :func:`sticky_assign`), followed by the
    cooperative adjustment of KIP-429 (:func:`cooperative_adjust`): a
    partition that moves to a new owner is left unassigned in this
    generation while any other member still owns it. The previous owner
    revokes it and rejoins, and the following rebalance assigns it.
    Cooperative.

Eager strategies expect every member to revoke all its partitions before it
rejoins; they ignore ``owned_partitions``. A consumer is cooperative only if
every strategy it lists is (Kafka's rule), so a group that picks an eager
strategy is made of members that all revoke before joining.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from logbus.errors import InvalidConfigError
from logbus.invariant import check
from logbus.protocol.messages import TopicPartition

# The controller computes assignments inline, so their size is bounded. At these limits (measured on
# 2 cores) equal subscriptions take under 1 s; mixed subscriptions, whose balancing loop is quadratic
# in members at worst, took 2.5 s when one member owned everything. Realistic groups take milliseconds.
ASSIGN_MEMBERS_MAX = 1_000
ASSIGN_PARTITIONS_MAX = 100_000


class RebalanceProtocol(str, enum.Enum):
    """How members give up partitions during a rebalance (Kafka's RebalanceProtocol)."""

    EAGER = "eager"  # every member revokes everything before rejoining
    COOPERATIVE = "cooperative"  # members keep what they own; moves take two rebalances


@dataclass(frozen=True, slots=True)
class Subscription:
    """What one member brings to an assignment.

    ``owned_partitions`` are the partitions the member holds going into this
    rebalance; only sticky/cooperative strategies use them. Several members
    claiming one partition is a conflict: none of them keeps it on account of
    stickiness (Kafka does the same for claims from the same generation).
    """

    topics: frozenset[str]
    owned_partitions: tuple[TopicPartition, ...] = ()
    group_instance_id: str | None = None

    @classmethod
    def of(
        cls,
        topics: Iterable[str],
        owned_partitions: Iterable[tuple[str, int]] = (),
        group_instance_id: str | None = None,
    ) -> "Subscription":
        owned = tuple(sorted(TopicPartition(t, p) for t, p in owned_partitions))
        return cls(frozenset(topics), owned, group_instance_id)


Assignment = dict[str, list[TopicPartition]]


def member_order(subscriptions: Mapping[str, Subscription]) -> list[str]:
    """Member ids in Kafka's MemberInfo order: static members by instance id, then the rest by member id."""

    def key(member_id: str) -> tuple:
        instance_id = subscriptions[member_id].group_instance_id
        return (0, instance_id, member_id) if instance_id is not None else (1, member_id, member_id)

    return sorted(subscriptions, key=key)


def _check_sizes(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> None:
    if len(subscriptions) > ASSIGN_MEMBERS_MAX:
        raise InvalidConfigError(f"{len(subscriptions)} members exceed the assignor limit of {ASSIGN_MEMBERS_MAX}")
    subscribed = set().union(*(s.topics for s in subscriptions.values())) if subscriptions else set()
    total = 0
    for topic in subscribed:
        count = partitions_per_topic.get(topic, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidConfigError(f"partition count of topic {topic!r} must be a non-negative int, not {count!r}")
        total += count
    if total > ASSIGN_PARTITIONS_MAX:
        raise InvalidConfigError(f"{total} subscribed partitions exceed the assignor limit of {ASSIGN_PARTITIONS_MAX}")


def _all_partitions(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> list[TopicPartition]:
    """Every partition of a topic some member subscribes to, sorted."""
    subscribed = set().union(*(s.topics for s in subscriptions.values())) if subscriptions else set()
    return [
        TopicPartition(topic, p)
        for topic in sorted(subscribed)
        for p in range(partitions_per_topic.get(topic, 0))
    ]


# --- range -------------------------------------------------------------------------------------


def range_assign(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> Assignment:
    """Kafka's RangeAssignor: per topic, contiguous ranges over the subscribed members in member order."""
    _check_sizes(partitions_per_topic, subscriptions)
    assignment: Assignment = {member: [] for member in subscriptions}
    ordered = member_order(subscriptions)
    topics = sorted(set().union(*(s.topics for s in subscriptions.values())) if subscriptions else ())
    for topic in topics:
        count = partitions_per_topic.get(topic, 0)
        members = [m for m in ordered if topic in subscriptions[m].topics]
        per_member, extra = divmod(count, len(members))
        for i, member in enumerate(members):
            start = per_member * i + min(i, extra)
            length = per_member + (1 if i < extra else 0)
            assignment[member].extend(TopicPartition(topic, p) for p in range(start, start + length))
    return {member: sorted(partitions) for member, partitions in assignment.items()}


# --- round robin -------------------------------------------------------------------------------


def roundrobin_assign(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> Assignment:
    """Kafka's RoundRobinAssignor: sorted partitions dealt over a circular iterator of members.

    The iterator skips members not subscribed to the partition's topic and
    keeps its position from one partition to the next.
    """
    _check_sizes(partitions_per_topic, subscriptions)
    assignment: Assignment = {member: [] for member in subscriptions}
    ordered = member_order(subscriptions)
    position = 0
    for tp in _all_partitions(partitions_per_topic, subscriptions):
        # Some member subscribes to tp.topic (that is how it got into the list), so this ends.
        while tp.topic not in subscriptions[ordered[position]].topics:
            position = (position + 1) % len(ordered)
        assignment[ordered[position]].append(tp)
        position = (position + 1) % len(ordered)
    return assignment


# --- sticky ------------------------------------------------------------------------------------


def valid_owned_partitions(
    partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]
) -> dict[str, set[TopicPartition]]:
    """The owned partitions each member may keep on account of stickiness.

    A claim counts if the partition exists, the member subscribes to its
    topic, and no other member claims it too.
    """
    claims: dict[TopicPartition, list[str]] = {}
    for member, subscription in subscriptions.items():
        for tp in set(subscription.owned_partitions):
            claims.setdefault(tp, []).append(member)
    owned: dict[str, set[TopicPartition]] = {member: set() for member in subscriptions}
    for tp, claimants in claims.items():
        if len(claimants) != 1 or not 0 <= tp.partition < partitions_per_topic.get(tp.topic, 0):
            continue
        member = claimants[0]
        if tp.topic in subscriptions[member].topics:
            owned[member].add(tp)
    return owned


def sticky_assign(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> Assignment:
    """A balanced assignment that moves as few previously owned partitions as balance allows.

    Members keep their valid owned partitions (:func:`valid_owned_partitions`)
    except where balance needs them elsewhere. Members with the same
    subscription end with partition counts that differ by at most one. As in
    Kafka, there are two paths:

    - every member subscribes to the same topics (the usual case): quotas. With
      ``n`` partitions over ``m`` members, the ``n % m`` members owning most get
      ``n // m + 1`` and the rest ``n // m``. Each member keeps its owned
      partitions up to its quota (giving away its highest ones), which moves the
      fewest partitions possible. The free partitions, in (topic, partition)
      order, then go one at a time to the least loaded member below its quota
      (ties by member order).
    - otherwise: :func:`_sticky_general`.
    """
    _check_sizes(partitions_per_topic, subscriptions)
    ordered = member_order(subscriptions)
    owned = valid_owned_partitions(partitions_per_topic, subscriptions)
    everything = _all_partitions(partitions_per_topic, subscriptions)
    if len({s.topics for s in subscriptions.values()}) <= 1:
        assigned = _sticky_equal_subscriptions(everything, owned, ordered)
    else:
        assigned = _sticky_general(everything, subscriptions, owned, ordered)
    return {member: sorted(assigned[member]) for member in subscriptions}


def _sticky_equal_subscriptions(
    everything: list[TopicPartition], owned: dict[str, set[TopicPartition]], ordered: list[str]
) -> dict[str, set[TopicPartition]]:
    rank = {member: i for i, member in enumerate(ordered)}
    share, extra = divmod(len(everything), len(ordered)) if ordered else (0, 0)
    by_owned = sorted(ordered, key=lambda m: (-len(owned[m]), rank[m]))
    quota = {member: share + (1 if i < extra else 0) for i, member in enumerate(by_owned)}
    taken = set().union(*owned.values()) if owned else set()
    free = [tp for tp in everything if tp not in taken]
    assigned: dict[str, set[TopicPartition]] = {}
    for member in ordered:
        mine = sorted(owned[member])
        assigned[member] = set(mine[: quota[member]])
        free.extend(mine[quota[member] :])
    free.sort()
    heap = [(len(assigned[m]), rank[m], m) for m in ordered if len(assigned[m]) < quota[m]]
    heapq.heapify(heap)
    for tp in free:
        load, member_rank, member = heapq.heappop(heap)
        assigned[member].add(tp)
        if load + 1 < quota[member]:
            heapq.heappush(heap, (load + 1, member_rank, member))
    check(not heap, "equal-subscription quotas do not add up to the partition count")
    return assigned


def _sticky_general(
    everything: list[TopicPartition],
    subscriptions: Mapping[str, Subscription],
    owned: dict[str, set[TopicPartition]],
    ordered: list[str],
) -> dict[str, set[TopicPartition]]:
    """Sticky assignment for members with different subscriptions.

    1. Every member keeps its valid owned partitions.
    2. Each remaining partition goes to the least loaded member subscribed to
       its topic (ties by member order); partitions with the fewest eligible
       members are placed first, as in Kafka's StickyAssignor.
    3. While some member ``a`` holds at least two partitions more than a member
       ``b`` that could take one of them, move one from the most loaded such
       ``a`` to the least loaded such ``b`` (:class:`_Balancer`), preferring
       partitions ``a`` did not own before (those moves are free).

    At the end no such pair exists, so members with the same subscription hold
    counts that differ by at most one. Each move strictly lowers the sum of
    squared counts, so step 3 terminates.
    """
    rank = {member: i for i, member in enumerate(ordered)}
    assigned: dict[str, set[TopicPartition]] = {member: set(owned[member]) for member in ordered}
    taken = set().union(*assigned.values()) if assigned else set()
    eligible_by_topic = {
        topic: tuple(m for m in ordered if topic in subscriptions[m].topics) for topic in {tp.topic for tp in everything}
    }
    free = [tp for tp in everything if tp not in taken]
    free.sort(key=lambda tp: (len(eligible_by_topic[tp.topic]), tp))
    # One heap of (load, rank, member) per set of eligible members. Loads only grow here, so an entry
    # whose load is out of date is pushed back with the current one until the smallest entry is exact.
    heaps: dict[tuple[str, ...], list] = {}
    for tp in free:
        eligible = eligible_by_topic[tp.topic]
        heap = heaps.get(eligible)
        if heap is None:
            heap = heaps[eligible] = [(len(assigned[m]), rank[m], m) for m in eligible]
            heapq.heapify(heap)
        while True:
            load, member_rank, member = heapq.heappop(heap)
            if load == len(assigned[member]):
                break
            heapq.heappush(heap, (len(assigned[member]), member_rank, member))
        assigned[member].add(tp)
        heapq.heappush(heap, (load + 1, member_rank, member))
    balancer = _Balancer(assigned, subscriptions, owned, ordered)
    while balancer.move_one():
        pass
    return assigned


class _Balancer:
    """Step 3 of :func:`_sticky_general`, with the bookkeeping that keeps one move cheap.

    Members are kept sorted by load both ways (donors heaviest first, receivers
    lightest first; ties by member order) and only the two members of a move are
    re-placed. Each member's partitions are kept in the order they would be
    given away (partitions it did not own before last, then by (topic,
    partition)), with a count per topic, so finding what a donor can hand a
    receiver does not scan all its partitions.
    """

    def __init__(self, assigned, subscriptions, owned, ordered) -> None:
        self.assigned, self.subscriptions, self.owned = assigned, subscriptions, owned
        self.rank = {member: i for i, member in enumerate(ordered)}
        self.load = {member: len(assigned[member]) for member in ordered}
        self.donors = sorted(ordered, key=self._donor_key)
        self.receivers = sorted(ordered, key=self._receiver_key)
        self.queue = {m: sorted(assigned[m], key=lambda tp, m=m: self._give_key(m, tp)) for m in ordered}
        self.topic_counts = {m: Counter(tp.topic for tp in assigned[m]) for m in ordered}

    def _donor_key(self, member: str) -> tuple:
        return (-self.load[member], self.rank[member])

    def _receiver_key(self, member: str) -> tuple:
        return (self.load[member], self.rank[member])

    def _give_key(self, member: str, tp: TopicPartition) -> tuple:
        return (tp not in self.owned[member], tp)

    def move_one(self) -> bool:
        """Move one partition from the most loaded member that can give one to a member two or more below it."""
        for donor in self.donors:
            held_topics = self.topic_counts[donor].keys()
            for receiver in self.receivers:
                if self.load[donor] - self.load[receiver] < 2:
                    break  # receivers are sorted by load: no lighter one follows
                topics = self.subscriptions[receiver].topics
                if not topics.isdisjoint(held_topics):
                    self._move(donor, receiver, topics)
                    return True
        return False

    def _move(self, donor: str, receiver: str, topics: frozenset[str]) -> None:
        queue = self.queue[donor]
        index = next(i for i in range(len(queue) - 1, -1, -1) if queue[i].topic in topics)
        tp = queue.pop(index)
        self.assigned[donor].remove(tp)
        self.assigned[receiver].add(tp)
        self.topic_counts[donor][tp.topic] -= 1
        if not self.topic_counts[donor][tp.topic]:
            del self.topic_counts[donor][tp.topic]
        self.topic_counts[receiver][tp.topic] += 1
        bisect.insort(self.queue[receiver], tp, key=lambda x: self._give_key(receiver, x))
        for members, key in ((self.donors, self._donor_key), (self.receivers, self._receiver_key)):
            for member in (donor, receiver):  # take both out while their keys still match their places
                index = bisect.bisect_left(members, key(member), key=key)
                check(members[index] == member, "balancer order is out of date")
                del members[index]
        self.load[donor] -= 1
        self.load[receiver] += 1
        for members, key in ((self.donors, self._donor_key), (self.receivers, self._receiver_key)):
            for member in (donor, receiver):
                bisect.insort(members, member, key=key)


def cooperative_adjust(target: Mapping[str, list[TopicPartition]], subscriptions: Mapping[str, Subscription]) -> Assignment:
    """KIP-429's adjustment: drop from each member's target the partitions another member still owns.

    A partition whose target owner differs from a member that owns it now is
    assigned to nobody in this generation. Its owner sees it missing from its
    own assignment, revokes it and rejoins; by the next rebalance nobody owns
    it and it is assigned. A partition claimed by several members is held
    back while any member other than its target still claims it.
    """
    claimed_by: dict[TopicPartition, set[str]] = {}
    for member, subscription in subscriptions.items():
        for tp in subscription.owned_partitions:
            claimed_by.setdefault(tp, set()).add(member)
    return {
        member: [tp for tp in partitions if not (claimed_by.get(tp, set()) - {member})]
        for member, partitions in target.items()
    }


def cooperative_sticky_assign(partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> Assignment:
    """Kafka's CooperativeStickyAssignor: the sticky target, then :func:`cooperative_adjust`."""
    return cooperative_adjust(sticky_assign(partitions_per_topic, subscriptions), subscriptions)


# --- lookup ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionAssignor:
    """A named strategy: ``assign(partitions_per_topic, subscriptions) -> member -> partitions``."""

    name: str
    protocol: RebalanceProtocol
    function: Callable[[Mapping[str, int], Mapping[str, Subscription]], Assignment]

    def assign(self, partitions_per_topic: Mapping[str, int], subscriptions: Mapping[str, Subscription]) -> Assignment:
        return self.function(partitions_per_topic, subscriptions)


RANGE = PartitionAssignor("range", RebalanceProtocol.EAGER, range_assign)
ROUNDROBIN = PartitionAssignor("roundrobin", RebalanceProtocol.EAGER, roundrobin_assign)
COOPERATIVE_STICKY = PartitionAssignor("cooperative-sticky", RebalanceProtocol.COOPERATIVE, cooperative_sticky_assign)

ASSIGNORS: dict[str, PartitionAssignor] = {a.name: a for a in (RANGE, ROUNDROBIN, COOPERATIVE_STICKY)}


def get_assignor(name: str) -> PartitionAssignor:
    """The strategy called ``name`` ("range", "roundrobin" or "cooperative-sticky")."""
    try:
        return ASSIGNORS[name]
    except (KeyError, TypeError):
        raise InvalidConfigError(f"unknown partition assignment strategy {name!r}; known: {sorted(ASSIGNORS)}") from None
