"""Consumer groups end to end: real Ray actors as group members, real kills, real commits."""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.actors.controller import CONTROLLER_NAME
from logbus.api.group_membership import GroupMembership
from logbus.errors import (
    GroupNotEmptyError,
    IllegalGenerationError,
    InvalidConfigError,
    InvalidGroupIdError,
    InvalidPartitionError,
    RebalanceInProgressError,
)
from tests.healing import assert_healed
from tests.conftest import leave_group, wait_for

FAST_GROUP = dict(session_timeout_ms=3000, heartbeat_interval_ms=300, enable_auto_commit=False)


def produce(bus, topic, partitions, per_partition):
    with logbus.Producer(bus, linger_ms=5) as producer:
        for p in range(partitions):
            for i in range(per_partition):
                producer.send(topic, b"%d-%d" % (p, i), partition=p)


class Recorder:
    """A rebalance listener that remembers what it was told."""

    def __init__(self):
        self.events = []

    def on_partitions_revoked(self, partitions):
        self.events.append(("revoked", set(partitions)))

    def on_partitions_assigned(self, partitions):
        self.events.append(("assigned", set(partitions)))

    def on_partitions_lost(self, partitions):
        self.events.append(("lost", set(partitions)))

    def revoked(self):
        return set().union(*[p for kind, p in self.events if kind in ("revoked", "lost")])


@ray.remote(num_cpus=0, max_restarts=0)
class GroupWorker:
    """A group member in its own process: polls, 'processes' records, commits after each poll."""

    def __init__(self, bus, topic, group_id, options):
        self.consumer = logbus.Consumer(bus, group_id=group_id, **options)
        self.consumer.subscribe([topic])

    def step(self, polls=5, max_records=200, timeout_ms=200):
        processed = []
        for _ in range(polls):
            for tp, records in self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records).items():
                processed += [(tp.partition, r.offset) for r in records]
            if processed:
                try:
                    self.consumer.commit()
                except (IllegalGenerationError, RebalanceInProgressError, logbus.UnknownMemberIdError):
                    pass  # a rebalance: these records may be processed again by the next owner
        return processed, sorted(tp.partition for tp in self.consumer.assignment())

    def pid(self):
        return os.getpid()

    def close(self):
        self.consumer.close()


def wait_split(a, b):
    """Poll two members until each owns two of the topic's four partitions."""
    def split():
        a.poll(timeout_ms=50)
        b.poll(timeout_ms=50)
        return len(a.assignment()) == 2 and len(b.assignment()) == 2

    wait_for(split, timeout_s=60, interval_s=0, message="the partitions split between the two members")


def all_records(partitions, per_partition):
    return {(p, o) for p in range(partitions) for o in range(per_partition)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_members_one_dies_partitions_move_and_nothing_is_skipped(bus, topic_name):
    partitions, per_partition = 6, 1500
    bus.admin.create_topic(topic_name, partitions=partitions)
    produce(bus, topic_name, partitions, per_partition)
    workers = [GroupWorker.remote(bus, topic_name, "g3", FAST_GROUP) for _ in range(3)]
    processed_by = {i: [] for i in range(3)}
    assignments = {}

    def step(indices, polls=2, timeout_ms=200):
        results = ray.get([workers[i].step.remote(polls, 50, timeout_ms) for i in indices], timeout=120)
        for i, (processed, assigned) in zip(indices, results):
            processed_by[i] += processed
            assignments[i] = assigned

    def balanced(indices):
        step(indices)
        owned = [p for i in indices for p in assignments[i]]
        return sorted(owned) == list(range(partitions)) and all(assignments[i] for i in indices)

    wait_for(lambda: balanced([0, 1, 2]), timeout_s=90, interval_s=0, message="three members own all partitions")
    victim_partitions = set(assignments[2])
    os.kill(ray.get(workers[2].pid.remote()), signal.SIGKILL)
    wait_for(lambda: balanced([0, 1]), timeout_s=90, interval_s=0, message="the survivors own all partitions")

    def drained():
        # Short polls: a member with nothing left must not hold up the one still reading.
        step([0, 1], polls=4, timeout_ms=20)
        seen = {r for i in processed_by for r in processed_by[i]}
        return seen >= all_records(partitions, per_partition)

    wait_for(drained, timeout_s=180, interval_s=0, message="every record processed")
    seen = [r for i in processed_by for r in processed_by[i]]
    assert set(seen) == all_records(partitions, per_partition)  # nothing skipped, nothing invented
    duplicates = {r for r, times in collections.Counter(seen).items() if times > 1}
    # Only the dead member's uncommitted tail may be processed twice.
    assert {p for p, _ in duplicates} <= victim_partitions
    for worker in workers[:2]:
        ray.get(worker.close.remote())


HELD_AFTER_MS = 1_000  # a heartbeat unanswered this long is held by the coordinator (it arrives in milliseconds)


def held_heartbeat(membership, spare_ms):
    """A condition: the member's heartbeat is held by the coordinator with at least ``spare_ms`` to go."""

    def check():
        outstanding = membership.heartbeat_outstanding
        if outstanding is None:
            return False
        sent_s, wait_ms = outstanding
        age_ms = (time.monotonic() - sent_s) * 1000
        return age_ms >= HELD_AFTER_MS and wait_ms - age_ms >= spare_ms

    return check


@pytest.mark.timeout(180)
def test_a_clean_join_rebalances_through_the_held_heartbeat(bus, topic_name):
    """The first member hears of the second one from its held heartbeat, woken by the join,
    not from a heartbeat sent later.

    Its heartbeat interval is 20 s, so the coordinator holds each heartbeat up to 20 s. The
    second member joins while one is held with 10 s or more to go; the first member's
    partitions are revoked and split, and the only heartbeat reply that told it to rejoin is
    the held one, woken by the change (its "at once" count, replies that found the group
    already rebalancing when they arrived, stays zero).
    """
    bus.admin.create_topic(topic_name, partitions=4)
    options = dict(session_timeout_ms=60_000, heartbeat_interval_ms=20_000, enable_auto_commit=False)
    listener = Recorder()
    first = logbus.Consumer(bus, group_id="prompt", **options)
    first.subscribe([topic_name], listener=listener)
    wait_for(lambda: first.poll(timeout_ms=50) is not None and len(first.assignment()) == 4,
             timeout_s=60, interval_s=0, message="the first member owning every partition")
    membership = first._membership
    wait_for(held_heartbeat(membership, spare_ms=10_000),
             timeout_s=60, message="the first member's heartbeat held by the coordinator")
    second = logbus.Consumer(bus, group_id="prompt", **options)
    second.subscribe([topic_name])
    wait_split(first, second)
    everything = {TopicPartition(topic_name, p) for p in range(4)}
    assert set(first.assignment()) | set(second.assignment()) == everything
    assert listener.events[:2] == [("assigned", everything), ("revoked", everything)]
    assert membership.notices == {"woken": 1}, membership.notices
    first.close()
    second.close()


@pytest.mark.timeout(180)
def test_an_expired_session_wakes_the_survivor_held_heartbeat(bus, topic_name):
    """The coordinator's timer finds the dead member's expired session and wakes the survivor.

    The survivor's heartbeats are held up to 20 s and nothing else calls the coordinator, so
    only the timer can notice the expiry. The dead member's own heartbeat was held when it
    stopped: a held heartbeat shows a member alive only when it arrived, so the session still
    ends on time.
    """
    bus.admin.create_topic(topic_name, partitions=4)
    survivor_listener = Recorder()
    survivor = logbus.Consumer(bus, group_id="expiry", session_timeout_ms=60_000, heartbeat_interval_ms=20_000,
                               enable_auto_commit=False)
    survivor.subscribe([topic_name], listener=survivor_listener)
    wait_for(lambda: survivor.poll(timeout_ms=50) is not None and len(survivor.assignment()) == 4,
             timeout_s=60, interval_s=0, message="the survivor owning every partition")
    doomed = logbus.Consumer(bus, group_id="expiry", session_timeout_ms=3_000, heartbeat_interval_ms=1_000,
                             enable_auto_commit=False)
    doomed.subscribe([topic_name])
    wait_split(survivor, doomed)
    membership = survivor._membership
    wait_for(held_heartbeat(membership, spare_ms=15_000),
             timeout_s=60, message="the survivor's heartbeat held by the coordinator")
    before = collections.Counter(membership.notices)
    survivor_listener.events.clear()
    doomed._membership.stop()  # "dies": no more heartbeats, no leave

    wait_for(lambda: survivor.poll(timeout_ms=50) is not None and len(survivor.assignment()) == 4,
             timeout_s=60, interval_s=0, message="the survivor owning every partition again")
    assert membership.notices - before == collections.Counter({"woken": 1}), (membership.notices, before)
    everything = {TopicPartition(topic_name, p) for p in range(4)}
    assert survivor_listener.events[-1] == ("assigned", everything)
    survivor.close()
    doomed.close()


@pytest.mark.timeout(180)
def test_cooperative_rolling_restart_never_revokes_partitions_that_stay(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=6)
    options = dict(FAST_GROUP, partition_assignment_strategy=("cooperative-sticky",))
    listeners = [Recorder() for _ in range(3)]
    consumers = [logbus.Consumer(bus, group_id="coop", **options) for _ in range(3)]
    for consumer, listener in zip(consumers, listeners):
        consumer.subscribe([topic_name], listener=listener)

    def settle():
        def done():
            for consumer in consumers:
                consumer.poll(timeout_ms=50)
            owned = sorted(tp.partition for c in consumers for tp in c.assignment())
            described = bus.admin.describe_group("coop")
            return owned == list(range(6)) and described["state"] == "Stable" and all(c.assignment() for c in consumers)

        wait_for(done, timeout_s=90, interval_s=0, message="a settled group")

    settle()
    for index in range(3):
        before = [set(c.assignment()) for c in consumers]
        for listener in listeners:
            listener.events.clear()
        consumers[index].close()
        consumers[index] = logbus.Consumer(bus, group_id="coop", **options)
        listeners[index] = Recorder()
        consumers[index].subscribe([topic_name], listener=listeners[index])
        settle()
        for other in range(3):
            if other == index:
                continue
            kept = before[other] & set(consumers[other].assignment())
            assert not (listeners[other].revoked() & kept), "a partition that stayed was revoked"
    for consumer in consumers:
        consumer.close()


@pytest.mark.timeout(180)
def test_static_member_restart_causes_no_rebalance(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=4)
    options = dict(FAST_GROUP, session_timeout_ms=10_000, heartbeat_interval_ms=500)
    other_listener = Recorder()
    static = logbus.Consumer(bus, group_id="static", group_instance_id="worker-a", **options)
    other = logbus.Consumer(bus, group_id="static", **options)
    static.subscribe([topic_name])
    other.subscribe([topic_name], listener=other_listener)

    def settled():
        static.poll(timeout_ms=50)
        other.poll(timeout_ms=50)
        return len(static.assignment()) == 2 and len(other.assignment()) == 2

    wait_for(settled, timeout_s=90, interval_s=0, message="two members with two partitions each")
    generation = bus.admin.describe_group("static")["generation"]
    mine = static.assignment()
    other_listener.events.clear()
    static.close()  # a static member does not leave the group on close
    restarted = logbus.Consumer(bus, group_id="static", group_instance_id="worker-a", **options)
    restarted.subscribe([topic_name])
    wait_for(lambda: restarted.poll(timeout_ms=100) is not None and restarted.assignment(), timeout_s=60, message="reassignment")
    for _ in range(5):
        other.poll(timeout_ms=100)
    assert restarted.assignment() == mine
    assert bus.admin.describe_group("static")["generation"] == generation
    assert other_listener.events == []
    restarted.close()
    other.close()
    leave_group(bus, "static")  # a static member stays after its consumer closes


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_controller_kill_pauses_consumers_and_keeps_committed_offsets(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    produce(bus, topic_name, 2, 3000)
    consumer = logbus.Consumer(bus, group_id="survive", **FAST_GROUP)
    consumer.subscribe([topic_name])
    seen = set()

    def consume(rounds):
        for _ in range(rounds):
            for tp, records in consumer.poll(timeout_ms=100, max_records=500).items():
                seen.update((tp.partition, r.offset) for r in records)
            try:
                consumer.commit()
            except logbus.LogbusError:
                pass

    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    # A commit can fail while the group settles (the error is the caller's to retry): go on until
    # both partitions have a committed offset, so there is something for the restart to keep.
    wait_for(lambda: consume(1) or (len(seen) > 1000 and None not in consumer.committed(tps).values()),
             timeout_s=120, interval_s=0, message="progress, committed")
    before = consumer.committed(tps)
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    os.kill(ray.get(controller.ping.remote()), signal.SIGKILL)
    consume(5)  # the coordinator is gone or restarting: no error reaches the caller
    after = consumer.committed(tps, timeout_ms=120_000)  # retried while the controller restarts
    assert all(after[tp] >= before[tp] for tp in tps)  # every commit survived the restart
    wait_for(lambda: consume(2) or len(seen) >= 6000, timeout_s=240, interval_s=0, message="consumption resumes")
    assert seen == {(p, o) for p in range(2) for o in range(3000)}
    consumer.close()
    assert assert_healed(bus, topic_name) == {0: 3000, 1: 3000}


@pytest.mark.own_bus  # it checks that the internal topic is not there yet
def test_a_groups_first_join_creates_the_offsets_topic_before_any_commit(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    with logbus.Producer(bus) as producer:
        producer.send(topic_name, b"one").get(timeout=60)
    assert "__consumer_offsets" not in ray.get(bus.controller.list_topics.remote(True))
    consumer = logbus.Consumer(bus, group_id="first-join", auto_offset_reset="earliest", **FAST_GROUP)
    consumer.subscribe([topic_name])
    wait_for(lambda: consumer.poll(timeout_ms=100) and consumer.assignment(), timeout_s=60, message="join and the record")
    # Nothing was committed (auto-commit is off), and the topic is there, serving, for the first commit.
    wait_for(lambda: "__consumer_offsets" in ray.get(bus.controller.list_topics.remote(True)), timeout_s=60,
             message="__consumer_offsets created by the join")
    assert consumer.committed(TopicPartition(topic_name, 0)) is None
    consumer.commit()
    assert consumer.committed(TopicPartition(topic_name, 0)) == 1
    consumer.close()


def test_group_errors_are_clear(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    # `first` stops polling after it joined: past max_poll_interval_ms it is removed from the group.
    first = logbus.Consumer(bus, group_id="errs", **dict(FAST_GROUP, max_poll_interval_ms=4000))
    first.subscribe([topic_name])
    wait_for(lambda: first.poll(timeout_ms=100) is not None and first.assignment(), timeout_s=60, message="join")
    second = logbus.Consumer(bus, group_id="errs", **FAST_GROUP)
    second.subscribe([topic_name])
    wait_for(lambda: second.poll(timeout_ms=100) is not None and len(second.assignment()) == 2, timeout_s=90, message="second takes over")
    # `first` has not polled since: its generation is stale, so its commit is refused.
    with pytest.raises((IllegalGenerationError, RebalanceInProgressError, logbus.UnknownMemberIdError)):
        first.commit({TopicPartition(topic_name, 0): 1})
    with pytest.raises(GroupNotEmptyError):
        bus.admin.reset_offsets("errs", "earliest")
    with pytest.raises(InvalidGroupIdError):
        bus.admin.describe_group("no-such-group")
    for bad in ("", None, 5, "x" * 300):
        with pytest.raises(InvalidGroupIdError):
            bus.admin.describe_group(bad)
    with pytest.raises(InvalidGroupIdError):
        logbus.Consumer(bus, group_id="")
    first.close()
    second.close()


def test_commits_of_partitions_the_topic_lacks_are_caller_errors(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    consumer = logbus.Consumer(bus, group_id="bad-commits", **FAST_GROUP)
    consumer.assign([TopicPartition(topic_name, 0)])
    beyond = TopicPartition(topic_name, 2)
    with pytest.raises(InvalidPartitionError, match=r"partitions 0\.\.1") as caught:
        consumer.commit({beyond: 5})  # not the retriable "unknown partition": retrying cannot help
    assert not caught.value.retriable
    assert consumer.committed([TopicPartition(topic_name, 0)]) == {TopicPartition(topic_name, 0): None}
    # Grown through another connection: this bus's cached count is stale, and is refreshed before refusing.
    other = logbus.connect(namespace=bus.namespace, data_dir=bus.data_dir)
    other.admin.create_partitions(topic_name, 3)
    consumer.commit({beyond: 5})
    assert consumer.committed([beyond]) == {beyond: 5}
    consumer.close()
    with pytest.raises(InvalidConfigError, match="client_id"):
        logbus.Consumer(bus, group_id="bad-client", client_id=5).subscribe([topic_name])


MEMBERSHIP = dict(
    group_instance_id=None, client_id="c", protocols=("range",), session_timeout_ms=3000, heartbeat_interval_ms=300,
    max_poll_interval_ms=4000,
)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(group_id=""), InvalidGroupIdError, "group id"),
        (dict(client_id=None), InvalidConfigError, "client_id"),
        (dict(group_instance_id=7), InvalidConfigError, "group_instance_id"),
        (dict(protocols="range"), InvalidConfigError, "protocols"),
        (dict(protocols=()), InvalidConfigError, "protocols"),
        (dict(protocols=("sticky",)), InvalidConfigError, "strategy"),
        (dict(session_timeout_ms="3000"), InvalidConfigError, "session_timeout_ms"),
        (dict(heartbeat_interval_ms=0.5), InvalidConfigError, "heartbeat_interval_ms"),
        (dict(max_poll_interval_ms=True), InvalidConfigError, "max_poll_interval_ms"),
    ],
)
def test_membership_arguments_are_checked_on_the_callers_side(options, error, message):
    arguments = {"group_id": "g", **MEMBERSHIP, **options}
    with pytest.raises(error, match=message):
        GroupMembership(None, arguments.pop("group_id"), **arguments)  # fails before any use of the bus


def test_reset_offsets_of_an_inactive_group_and_describe_lag(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    produce(bus, topic_name, 2, 50)
    consumer = logbus.Consumer(bus, group_id="resettable", **FAST_GROUP)
    consumer.assign([TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)])
    consumer.commit({TopicPartition(topic_name, 0): 10, TopicPartition(topic_name, 1): 20})
    consumer.close()
    described = bus.admin.describe_group("resettable")
    rows = {r["partition"]: r for r in described["offsets"]}
    assert (rows[0]["current_offset"], rows[0]["log_end_offset"], rows[0]["lag"]) == (10, 50, 40)
    assert (rows[1]["current_offset"], rows[1]["lag"]) == (20, 30)
    assert ("resettable", "Empty", None) in bus.admin.list_groups()
    bus.admin.reset_offsets("resettable", "latest")
    assert {r["partition"]: r["lag"] for r in bus.admin.describe_group("resettable")["offsets"]} == {0: 0, 1: 0}
    bus.admin.reset_offsets("resettable", 5, topics=[topic_name])
    fresh = logbus.Consumer(bus, group_id="resettable", **FAST_GROUP)
    fresh.subscribe([topic_name])
    got = []
    wait_for(lambda: got.extend(fresh.poll_arrow(timeout_ms=200)["offset"].to_pylist()) or len(got) >= 90, timeout_s=60, message="records")
    assert sorted(got)[:2] == [5, 5] and len(got) == 90  # both partitions from offset 5
    fresh.close()


def test_manual_assignment_with_a_group_keeps_its_partitions_after_commits(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    with logbus.Producer(bus) as producer:
        for i in range(10):
            producer.send(topic_name, b"%d" % i)
    consumer = logbus.Consumer(bus, group_id="manual", enable_auto_commit=True, auto_commit_interval_ms=100)
    consumer.assign([tp])
    got = []
    wait_for(lambda: got.extend(consumer.poll_arrow(timeout_ms=200)["offset"].to_pylist()) or len(got) == 10, timeout_s=60, message="records")
    consumer.commit()
    assert consumer.poll_arrow(timeout_ms=300).num_rows == 0  # no group join happens for an assigned consumer
    assert consumer.assignment() == {tp} and consumer.committed([tp]) == {tp: 10}
    consumer.close()


def test_manual_assignment_with_a_group_starts_at_the_committed_offset(bus, topic_name):
    # Kafka's consumer: an assigned partition with no position starts at the group's committed
    # offset, by auto_offset_reset only where nothing is committed; seek() overrides both.
    bus.admin.create_topic(topic_name, partitions=2)
    tps = [TopicPartition(topic_name, p) for p in range(2)]
    with logbus.Producer(bus) as producer:
        for i in range(20):
            producer.send(topic_name, b"%d" % i, partition=i % 2)
    first = logbus.Consumer(bus, group_id=f"{topic_name}-g", enable_auto_commit=False)
    first.commit({tps[0]: 7})
    first.close()
    resumed = logbus.Consumer(bus, group_id=f"{topic_name}-g", enable_auto_commit=False, auto_offset_reset="earliest")
    resumed.assign(tps)
    assert resumed.position(tps[0]) == 7 and resumed.position(tps[1]) == 0  # committed; nothing committed: earliest
    got = []
    wait_for(lambda: got.extend((r.partition, r.offset) for rs in resumed.poll(timeout_ms=200).values() for r in rs) or len(got) >= 13,
             timeout_s=60, message="records")
    assert sorted(got) == [(0, o) for o in range(7, 10)] + [(1, o) for o in range(10)]
    resumed.close()
    sought = logbus.Consumer(bus, group_id=f"{topic_name}-g", enable_auto_commit=False)
    sought.assign(tps[:1])
    sought.seek(tps[0], 2)
    assert sought.position(tps[0]) == 2
    sought.close()
