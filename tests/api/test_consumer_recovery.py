"""The consumer heals by itself: it reads the partitions it can, and a group member rejoins on its own.

Faults are real: a partition's only replica is paused with SIGSTOP (its node
agent reports it down and the controller leaves the partition leaderless
until it runs again), the controller's process is paused past the members'
session timeout, and a member's own process is paused until the coordinator
has expired it. Nothing retriable reaches the caller; every record is read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import threading
import time

import pytest
import ray

import logbus
import logbus.aio
from logbus import TopicPartition
from logbus.api.group_membership import GroupMembership
from logbus.errors import CommitFailedError, IllegalGenerationError, RebalanceInProgressError, RequestTimedOutError
from tests.api.test_consumer import leader_pid, produce_values
from tests.conftest import wait_for

FAST_GROUP = dict(session_timeout_ms=3000, heartbeat_interval_ms=300, enable_auto_commit=False)


@contextlib.contextmanager
def paused(pid):
    """The process stopped (SIGSTOP) for the block's duration; continued whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def leader_of(bus, topic, partition):
    """The partition's leader as the controller announces it now (None: leaderless)."""
    return bus.topic_metadata(topic, refresh=True).leaders[partition]


def read_into(consumer, seen):
    """One poll; records go into ``seen`` ({partition: [(offset, value)]}). Any error fails the test."""
    for tp, records in consumer.poll(timeout_ms=200, max_records=300).items():
        seen[tp.partition].extend((r.offset, r.value) for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_leaderless_partition_does_not_hold_up_the_others(bus, topic_name):
    """One partition of four has no leader (its only replica is paused): the consumer reads the other
    three in full meanwhile, and the fourth once its leader is back.

    Then the same with a partition whose leader goes away while the consumer is fetching from it at
    the log end: new records of the other three keep coming.
    """
    partitions, per_partition = 4, 400
    bus.admin.create_topic(topic_name, partitions=partitions, replication_factor=1)
    values = {p: [b"%d-%d" % (p, i) for i in range(per_partition)] for p in range(partitions)}
    for p in range(partitions):
        produce_values(bus, topic_name, values[p], partition=p)
    pids = {p: wait_for(lambda p=p: leader_pid(bus, topic_name, p), timeout_s=60, message="the leaders' pids")
            for p in range(partitions)}
    consumer = logbus.Consumer(bus)
    seen = collections.defaultdict(list)

    with paused(pids[3]):
        wait_for(lambda: leader_of(bus, topic_name, 3) is None, timeout_s=60, message="partition 3 leaderless")
        # Its position is looked up, and fails, alongside the others': they are read all the same.
        consumer.assign([TopicPartition(topic_name, p) for p in range(partitions)])
        wait_for(lambda: read_into(consumer, seen) or all(len(seen[p]) >= per_partition for p in range(3)),
                 timeout_s=120, interval_s=0, message="the three partitions with a leader read in full")
        assert leader_of(bus, topic_name, 3) is None  # it really was leaderless all along
        assert 3 not in seen
    wait_for(lambda: read_into(consumer, seen) or len(seen[3]) >= per_partition,
             timeout_s=120, interval_s=0, message="partition 3 read once its leader is back")
    for p in range(partitions):
        assert seen[p] == list(enumerate(values[p]))  # every record, in order, once

    # At the log end, fetches wait at every leader; partition 0's leader stops answering.
    read_into(consumer, seen)
    more = {p: [b"more-%d-%d" % (p, i) for i in range(100)] for p in range(partitions)}
    with paused(pids[0]):
        wait_for(lambda: leader_of(bus, topic_name, 0) is None, timeout_s=60, message="partition 0 leaderless")
        for p in (1, 2, 3):
            produce_values(bus, topic_name, more[p], partition=p)
        wait_for(lambda: read_into(consumer, seen) or all(len(seen[p]) >= per_partition + 100 for p in (1, 2, 3)),
                 timeout_s=120, interval_s=0, message="new records of the partitions with a leader")
    wait_for(lambda: leader_of(bus, topic_name, 0) is not None, timeout_s=60, message="partition 0's leader back")
    produce_values(bus, topic_name, more[0], partition=0)
    wait_for(lambda: read_into(consumer, seen) or len(seen[0]) >= per_partition + 100,
             timeout_s=120, interval_s=0, message="partition 0's new records")
    for p in range(partitions):
        assert seen[p] == list(enumerate(values[p] + more[p]))
    consumer.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_asyncio_consumer_reads_and_commits_around_a_leaderless_partition(bus, topic_name):
    """logbus.aio's consumer, over the same partitions: records of the three partitions with a leader
    come while the fourth has none, and a commit while records are kept (getone() hands out one of
    many) commits the partitions that have positions without waiting for the fourth."""
    partitions, per_partition = 4, 200
    bus.admin.create_topic(topic_name, partitions=partitions, replication_factor=1)
    tps = [TopicPartition(topic_name, p) for p in range(partitions)]
    for p in range(partitions):
        produce_values(bus, topic_name, [b"%d-%d" % (p, i) for i in range(per_partition)], partition=p)
    stopped = wait_for(lambda: leader_pid(bus, topic_name, 3), timeout_s=60, message="partition 3's leader pid")
    seen = collections.defaultdict(list)

    async def read_until(consumer, done, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out; read {dict((p, len(r)) for p, r in seen.items())}"
            for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                seen[tp.partition].extend(r.offset for r in records)

    async def run():
        async with logbus.aio.Consumer(bus, group_id="aio-leaderless") as consumer:
            with paused(stopped):
                wait_for(lambda: leader_of(bus, topic_name, 3) is None, timeout_s=60, message="partition 3 leaderless")
                await consumer.assign(tps)
                first = await consumer.getone()  # the rest of its poll is kept for the next calls
                seen[first.partition].append(first.offset)
                await consumer.commit()
                committed = await consumer.committed(tps)
                assert committed[tps[first.partition]] == first.offset + 1
                assert committed[tps[3]] is None  # no position yet: nothing to commit, and not waited for
                await read_until(consumer, lambda: all(len(seen[p]) >= per_partition for p in range(3)))
                assert 3 not in seen
            await read_until(consumer, lambda: len(seen[3]) >= per_partition)
            await consumer.commit()
            assert await consumer.committed(tps) == {tp: per_partition for tp in tps}

    asyncio.run(run())
    assert {p: sorted(offsets) for p, offsets in seen.items()} == {p: list(range(per_partition)) for p in range(partitions)}


class Recorder:
    """A rebalance listener that remembers what it was told, in order."""

    def __init__(self):
        self.events = []

    def on_partitions_revoked(self, partitions):
        self.events.append(("revoked", frozenset(partitions)))

    def on_partitions_assigned(self, partitions):
        self.events.append(("assigned", frozenset(partitions)))

    def on_partitions_lost(self, partitions):
        self.events.append(("lost", frozenset(partitions)))


class Producing:
    """An idempotent acks='all' producer sending numbered values to every partition from a thread."""

    def __init__(self, bus, topic, partitions):
        self.producer = logbus.Producer(bus, acks="all", linger_ms=5, delivery_timeout_ms=120_000)
        self.topic, self.partitions = topic, partitions
        self.futures = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        i = 0
        while not self.stopping.wait(0.002):
            value = b"v-%d" % i
            self.futures.append((value, self.producer.send(self.topic, value, partition=i % self.partitions)))
            i += 1

    def acknowledged(self):
        """Stop; every record that was acknowledged: {value: (partition, offset)}."""
        self.stopping.set()
        self.thread.join(timeout=30)
        self.producer.flush(timeout_s=180)
        self.producer.close()
        return {value: (f.result().partition, f.result().offset) for value, f in self.futures if f.exception() is None}


class Member:
    """A group member's poll-and-commit loop: poll() may raise nothing; commit() only what Kafka's
    commitSync raises after a rebalance or when its timeout runs out."""

    COMMIT_REFUSALS = (CommitFailedError, RebalanceInProgressError, RequestTimedOutError)

    def __init__(self, consumer, topic, partitions):
        self.consumer = consumer
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.seen = set()  # (partition, offset, value)
        self.refused = collections.Counter()
        self.committed = {}  # the highest offset seen committed, per partition

    def step(self):
        for tp, records in self.consumer.poll(timeout_ms=200, max_records=500).items():
            self.seen.update((tp.partition, r.offset, r.value) for r in records)
        if not self.consumer.assignment():
            return  # nothing to commit (and the coordinator may be away: no question to ask it)
        try:
            self.consumer.commit(timeout_ms=2000)
        except self.COMMIT_REFUSALS as error:
            self.refused[type(error).__name__] += 1
            return
        self.check_committed()

    def check_committed(self):
        """Committed offsets never go backwards."""
        for tp, offset in self.consumer.committed(self.tps, timeout_ms=60_000).items():
            if offset is None:
                continue
            assert offset >= self.committed.get(tp, 0), f"{tp}'s committed offset went back to {offset} from {self.committed[tp]}"
            self.committed[tp] = offset

    def values(self):
        return {value for _, _, value in self.seen}


def check_everything_read(member, acknowledged):
    assert member.values() >= set(acknowledged), f"{len(set(acknowledged) - member.values())} acknowledged records never read"
    where = {value: (p, o) for p, o, value in member.seen}
    assert all(where[value] == place for value, place in acknowledged.items())  # one value per offset
    ends = member.consumer.end_offsets(member.tps)
    # A send that failed may have been written all the same: read up to the log end, past it too.
    wait_for(lambda: member.step() or all(member.consumer.position(tp) >= ends[tp] for tp in member.tps),
             timeout_s=120, interval_s=0, message="positions at the log end")
    member.consumer.commit()
    member.check_committed()
    assert member.committed == ends  # everything read is committed, and nothing past it


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_member_rejoins_by_itself_after_the_controller_was_paused_past_its_session(bus, topic_name):
    """The controller (the group coordinator) stops past the member's session timeout, then runs on.

    The member keeps polling throughout: no error from poll(), its partitions
    are reported lost once its session must have ended, and it rejoins on its
    own when the coordinator answers again, with every partition assigned.
    Records produced all along are all read, and committed offsets never go back.
    """
    partitions = 4
    bus.admin.create_topic(topic_name, partitions=partitions, replication_factor=1)
    listener = Recorder()
    consumer = logbus.Consumer(bus, group_id="paused-coordinator", **FAST_GROUP)
    consumer.subscribe([topic_name], listener=listener)
    member = Member(consumer, topic_name, partitions)
    producing = Producing(bus, topic_name, partitions)
    everything = frozenset(member.tps)
    wait_for(lambda: member.step() or (consumer.assignment() == everything and len(member.seen) > 500),
             timeout_s=120, interval_s=0, message="the member reading every partition")
    controller_pid = ray.get(bus.controller.ping.remote(), timeout=60)
    with paused(controller_pid):
        # Polling goes on; once the coordinator has been silent past the session timeout, the
        # member's partitions may belong to another member: they are lost.
        wait_for(lambda: member.step() or ("lost", everything) in listener.events,
                 timeout_s=120, interval_s=0, message="the member's partitions reported lost")
    lost_at = listener.events.index(("lost", everything))
    wait_for(lambda: member.step() or (consumer.assignment() == everything and ("assigned", everything) in listener.events[lost_at:]),
             timeout_s=120, interval_s=0, message="the member rejoined with every partition")
    acknowledged = producing.acknowledged()
    wait_for(lambda: member.step() or member.values() >= set(acknowledged),
             timeout_s=180, interval_s=0, message="every acknowledged record read")
    check_everything_read(member, acknowledged)
    consumer.close()


@ray.remote(num_cpus=0, max_restarts=0)
class RemoteMember:
    """A group member in a process of its own (so the test can pause it), polling and committing."""

    def __init__(self, bus, topic, partitions, group_id):
        self.listener = Recorder()
        consumer = logbus.Consumer(bus, group_id=group_id, **FAST_GROUP)
        consumer.subscribe([topic], listener=self.listener)
        self.member = Member(consumer, topic, partitions)

    def pid(self):
        return os.getpid()

    def steps(self, count):
        """``count`` poll-and-commit rounds; what the member knows afterwards."""
        for _ in range(count):
            self.member.step()
        return {
            "assignment": {tp.partition for tp in self.member.consumer.assignment()},
            "events": list(self.listener.events),
            "seen": len(self.member.seen),
            "refused": dict(self.member.refused),
        }

    def finish(self, acknowledged):
        check_everything_read(self.member, acknowledged)
        self.member.consumer.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_member_expired_by_the_coordinator_rejoins_by_itself(bus, topic_name):
    """A member's own process stops (a long GC pause, say) until the coordinator has removed it.

    When it runs again its polls rejoin: its partitions are reported lost, not revoked (they may
    have been reassigned meanwhile), and it gets every partition back. poll() raises nothing; every
    record is read; committed offsets never go back.
    """
    partitions = 4
    bus.admin.create_topic(topic_name, partitions=partitions, replication_factor=1)
    worker = RemoteMember.remote(bus, topic_name, partitions, "expired-member")
    producing = Producing(bus, topic_name, partitions)
    wait_for(lambda: (lambda s: s["assignment"] == set(range(partitions)) and s["seen"] > 500)(ray.get(worker.steps.remote(5), timeout=120)),
             timeout_s=120, interval_s=0, message="the member reading every partition")
    described = bus.admin.describe_group("expired-member")
    assert len(described["members"]) == 1
    with paused(ray.get(worker.pid.remote(), timeout=60)):
        wait_for(lambda: not bus.admin.describe_group("expired-member")["members"],
                 timeout_s=60, message="the coordinator expiring the paused member")
    state = wait_for(
        lambda: (lambda s: s if s["assignment"] == set(range(partitions)) and any(e[0] == "lost" for e in s["events"]) else None)(
            ray.get(worker.steps.remote(5), timeout=120)),
        timeout_s=120, interval_s=0, message="the member back with every partition")
    everything = set(range(partitions))
    assert ("revoked", frozenset(TopicPartition(topic_name, p) for p in everything)) not in state["events"][1:]
    acknowledged = producing.acknowledged()
    wait_for(lambda: ray.get(worker.steps.remote(5), timeout=120)["seen"] >= len(acknowledged),
             timeout_s=180, interval_s=0, message="every acknowledged record read")
    ray.get(worker.finish.remote(acknowledged), timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_commit_after_the_member_was_removed_fails_and_the_next_poll_rejoins(bus, topic_name):
    """The coordinator removes the member (as an expired session would): its commit raises
    CommitFailedError (Kafka's CommitFailedException; also an UnknownMemberIdError, what commit()
    raised before), and its next polls rejoin with nothing raised."""
    bus.admin.create_topic(topic_name, partitions=2)
    produce_values(bus, topic_name, [b"%d" % i for i in range(50)], partition=0)
    listener = Recorder()
    consumer = logbus.Consumer(bus, group_id="removed", **FAST_GROUP)
    consumer.subscribe([topic_name], listener=listener)
    everything = frozenset(TopicPartition(topic_name, p) for p in range(2))
    got = []
    wait_for(lambda: got.extend(consumer.poll(timeout_ms=200).get(TopicPartition(topic_name, 0), [])) or len(got) == 50,
             timeout_s=60, interval_s=0, message="the member's records")
    consumer.commit()
    removed = consumer._membership.member_id
    assert ray.get(bus.controller.group_leave.remote("removed", removed), timeout=60)
    with pytest.raises(CommitFailedError) as refused:
        consumer.commit({TopicPartition(topic_name, 0): 50})
    assert isinstance(refused.value, logbus.UnknownMemberIdError) and not refused.value.retriable
    wait_for(lambda: consumer.poll(timeout_ms=200) is not None and consumer.assignment() == everything,
             timeout_s=60, interval_s=0, message="the member rejoined")
    assert consumer._membership.member_id != removed
    assert ("lost", everything) in listener.events and listener.events[-1] == ("assigned", everything)
    consumer.commit()  # a member again: its commits succeed
    assert consumer.committed([TopicPartition(topic_name, 0)]) == {TopicPartition(topic_name, 0): 50}
    consumer.close()


# --- the member's side of a generation's end, without Ray -------------------------------------------------


def membership(member_id="m-1", generation=4, managed=True):
    """A GroupMembership as a member of ``generation`` (no bus: its heartbeat thread waits for a member id
    it is given only here, and is stopped before it could use one)."""
    state = GroupMembership(None, "g", group_instance_id=None, client_id="c", protocols=("range",),
                            session_timeout_ms=3000, heartbeat_interval_ms=300, max_poll_interval_ms=4000)
    state.stop()
    state.member_id, state.generation, state.needs_join, state.managed = member_id, generation, False, managed
    return state


@pytest.mark.parametrize("refusal, unknown", [(logbus.UnknownMemberIdError("gone"), True), (IllegalGenerationError("old"), False)])
def test_a_commit_refused_for_a_past_generation_ends_it_and_raises_commit_failed(refusal, unknown):
    state = membership()
    failure = state._commit_refused(refusal, "m-1", 4)
    assert isinstance(failure, CommitFailedError) and failure.__cause__ is refusal and not failure.retriable
    assert isinstance(failure, (logbus.UnknownMemberIdError, IllegalGenerationError))  # what commit() raised before
    assert (state.generation, state.needs_join) == (-1, True)
    assert state.member_id == ("" if unknown else "m-1")  # an unknown member joins as a new one
    assert state.take_lost() and not state.take_lost()  # the partitions are lost once, then rejoined
    with pytest.raises(CommitFailedError, match="not a member"):
        state._commit_identity()  # until it rejoins, a subscribed consumer commits nothing


def test_a_refusal_about_an_older_generation_changes_nothing():
    state = membership(generation=5)  # it rejoined after the commit was sent with generation 4
    failure = state._commit_refused(logbus.UnknownMemberIdError("gone"), "m-1", 4)
    assert isinstance(failure, CommitFailedError)
    assert (state.member_id, state.generation, state.needs_join, state.take_lost()) == ("m-1", 5, False, False)


def test_a_rebalance_in_progress_asks_for_a_rejoin_and_keeps_the_generation():
    state = membership()
    refusal = RebalanceInProgressError("rebalancing")
    assert state._commit_refused(refusal, "m-1", 4) is refusal  # Kafka's RebalanceInProgressException
    assert (state.generation, state.needs_join, state.take_lost()) == (4, True, False)


def test_a_manually_assigned_consumer_commits_as_a_non_member():
    assert membership(member_id="", generation=-1, managed=False)._commit_identity() == ("", -1)
    assert membership()._commit_identity() == ("m-1", 4)
