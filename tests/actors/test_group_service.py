"""The controller's group service without Ray: long polls, the group timer and groups.json.

A small host stands in for the controller (the GroupHost interface: one topic
``t``, no leaders); each test runs its coroutines on a fresh event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
import pytest

from logbus.actors import group_service, state_writer
from logbus.actors.group_service import GroupService
from logbus.errors import CoordinatorNotAvailableError, LeaderNotAvailableError, UnknownMemberIdError
from logbus.protocol.group_coordinator import JoinPending, JoinResult

OPTIONS = dict(topics=("t",), protocols=("range",), session_timeout_ms=6_000, rebalance_timeout_ms=10_000, max_poll_interval_ms=10_000)


class Host:
    """The GroupHost side of a controller with one topic of four partitions and no offsets topic."""

    def partition_counts(self):
        return {"t": 4}

    def leader_handle(self, topic, partition):
        raise LeaderNotAvailableError(f"{topic}-{partition} has no leader in these tests")

    async def create_internal_topic(self, name, partitions, replication_factor, config):
        raise LeaderNotAvailableError("no internal topics in these tests")

    def live_node_count(self):
        return 1


def Service(directory) -> GroupService:
    """A group service over ``directory``, its timer running (call on the test's event loop)."""
    service = GroupService(Host(), str(directory))
    service.start()
    return service


def on_disk(service) -> dict:
    with open(service._writer.path) as file:
        return json.load(file)


async def join(service, member_id="", wait_ms=2_000, **options):
    return await service.join("g", dict(OPTIONS, member_id=member_id, **options), wait_ms)


async def until(condition) -> None:
    """Let the loop run until ``condition()`` holds (bound it with asyncio.wait_for)."""
    while not condition():
        await asyncio.sleep(0.001)


async def run_ready(steps: int) -> None:
    """Let every task that can run go ``steps`` turns of the loop (no time passes for them)."""
    for _ in range(steps):
        await asyncio.sleep(0)


def test_a_held_join_returns_when_the_last_member_arrives(tmp_path):
    async def main():
        service = Service(tmp_path)
        a = await join(service)
        assert isinstance(a, JoinResult) and a.generation == 1
        # b's join is held until a rejoins, which a's held heartbeat tells it to do.
        b_join = asyncio.ensure_future(join(service, wait_ms=5_000))
        beat = await service.heartbeat("g", a.member_id, a.generation, 0, 5_000)
        assert beat.rejoin and not b_join.done()
        a2 = await join(service, member_id=a.member_id)
        b = await b_join
        assert isinstance(a2, JoinResult) and isinstance(b, JoinResult) and a2.generation == b.generation == 2
        assert sorted(a2.assignment + b.assignment) == sorted(a.assignment)
        return service

    service = asyncio.run(main())
    assert on_disk(service)["groups"][0]["generation"] == 2  # answered only once durable


def test_a_held_heartbeat_is_woken_by_a_join_and_says_so(tmp_path):
    async def main():
        service = Service(tmp_path)
        a = await join(service)
        held = asyncio.ensure_future(service.heartbeat("g", a.member_id, a.generation, 0, 5_000))
        await asyncio.wait_for(until(lambda: service.long_polls("g")), 10)
        polls = service.long_polls("g")
        assert [(p["kind"], p["member_id"]) for p in polls] == [("heartbeat", a.member_id)]
        assert 2_900 <= polls[0]["wait_ms"] <= 3_000  # half the session timeout
        assert not held.done()
        pending = await join(service, wait_ms=0)  # a second member arrives (its first join gets an id)
        assert isinstance(pending, JoinPending)
        await join(service, member_id=pending.member_id, wait_ms=0)
        beat = await asyncio.wait_for(held, 5)
        assert beat.rejoin and beat.woken  # by the join, not at the end of its wait
        assert service.long_polls("g") == []

    asyncio.run(main())


def test_a_quiet_heartbeat_waits_and_reports_it(tmp_path):
    async def main():
        service = Service(tmp_path)
        a = await join(service, session_timeout_ms=400)
        held = asyncio.ensure_future(service.heartbeat("g", a.member_id, a.generation, 0, 10_000))  # held half the session
        await asyncio.wait_for(until(lambda: service.long_polls("g")), 10)
        beat = await asyncio.wait_for(held, 10)
        assert not beat.rejoin and not beat.woken and beat.waited_ms > 0
        group_service_cap = group_service.LONG_POLLS_MAX
        try:
            group_service.LONG_POLLS_MAX = 0  # too many calls held: answer at once
            beat = await service.heartbeat("g", a.member_id, a.generation, 0, 10_000)
            assert (beat.waited_ms, beat.woken) == (0, False)
        finally:
            group_service.LONG_POLLS_MAX = group_service_cap

    asyncio.run(main())


def test_a_member_dead_during_its_held_heartbeat_expires_and_the_timer_wakes_the_survivor(tmp_path):
    """A held heartbeat shows the member alive only when it arrived; the group timer (no other
    call) removes it when its session ends and wakes the survivor's held heartbeat."""

    async def main():
        service = Service(tmp_path)
        survivor = await join(service)
        dead_id = (await join(service, wait_ms=0, session_timeout_ms=300)).member_id
        dead_join = asyncio.ensure_future(join(service, member_id=dead_id, session_timeout_ms=300))
        await asyncio.wait_for(until(lambda: service.long_polls("g")), 10)  # the dead member's join is held
        survivor = await join(service, member_id=survivor.member_id)
        dead = await dead_join
        assert survivor.generation == dead.generation == 2
        # The dead member's last heartbeat is held (its process is gone; nobody reads the reply).
        dead_beat = asyncio.ensure_future(service.heartbeat("g", dead_id, dead.generation, 0, 10_000))
        beat = await asyncio.wait_for(service.heartbeat("g", survivor.member_id, survivor.generation, 0, 2_900), 10)
        assert beat.rejoin and beat.woken  # woken before its own wait ran out: the 300 ms session ended first
        await dead_beat
        assert [m.member_id for m in service.coordinator.describe("g").members] == [survivor.member_id]

    asyncio.run(main())


def test_groups_json_writes_stay_ordered_and_end_with_the_latest_state(tmp_path, monkeypatch):
    """Writes run one at a time off the event loop; states queued during a write fold into the
    next one, and the file ends with the latest state."""
    writes = []
    write = state_writer.write_atomically
    gate = threading.Event()

    writing = threading.Event()

    def slow_write(path, text):
        writing.set()
        gate.wait(5)
        writes.append(json.loads(text))
        write(path, text)

    monkeypatch.setattr(state_writer, "write_atomically", slow_write)

    async def main():
        service = Service(tmp_path)
        first = asyncio.ensure_future(join(service))  # its write blocks on the gate
        await asyncio.wait_for(until(writing.is_set), 10)
        assert not first.done()  # not answered before its state is on disk
        others = [asyncio.ensure_future(join(service, wait_ms=0)) for _ in range(5)]  # issue member ids
        await run_ready(100)
        assert not any(o.done() for o in others)  # they saw a state that is not on disk yet
        gate.set()
        await first
        ids = [(await o).member_id for o in others]
        results = await asyncio.gather(*(join(service, member_id=i, wait_ms=0) for i in ids))
        assert all(isinstance(r, JoinPending) for r in results)
        await service._writer.durable()
        return service

    service = asyncio.run(main())
    members = [len(w["groups"][0]["members"]) if w["groups"] else 0 for w in writes]
    assert members == sorted(members)  # in order: never an older state after a newer one
    assert on_disk(service) == json.loads(service.coordinator.to_json())
    assert len(on_disk(service)["groups"][0]["members"]) == 6


def test_a_failed_write_is_an_error_for_the_caller_and_is_retried(tmp_path, monkeypatch):
    write = state_writer.write_atomically
    failing = {"on": True}

    def flaky_write(path, text):
        if failing["on"]:
            raise OSError(28, "No space left on device")
        write(path, text)

    monkeypatch.setattr(state_writer, "write_atomically", flaky_write)

    async def main():
        service = Service(tmp_path)
        with pytest.raises(CoordinatorNotAvailableError):
            await join(service)
        failing["on"] = False
        result = await join(service)
        assert isinstance(result, JoinResult)
        await service._writer.durable()
        return service

    service = asyncio.run(main())
    assert on_disk(service) == json.loads(service.coordinator.to_json())


def test_repeated_joins_do_not_rewrite_groups_json(tmp_path, monkeypatch):
    writes = []
    write = state_writer.write_atomically

    def counting_write(path, text):
        writes.append(text)
        write(path, text)

    monkeypatch.setattr(state_writer, "write_atomically", counting_write)

    async def main():
        service = Service(tmp_path)
        a = await join(service)
        b = await join(service, wait_ms=0)
        b = await join(service, member_id=b.member_id, wait_ms=0)
        count = len(writes)
        for _ in range(20):
            assert isinstance(await join(service, member_id=b.member_id, wait_ms=0), JoinPending)
            await service.heartbeat("g", a.member_id, a.generation, 0, 0)
        assert len(writes) == count

    asyncio.run(main())


def test_a_restarted_coordinator_reads_back_its_groups(tmp_path):
    async def first_life():
        service = Service(tmp_path)
        return await join(service)

    a = asyncio.run(first_life())

    async def second_life():
        service = Service(tmp_path)
        beat = await service.heartbeat("g", a.member_id, a.generation, 0, 0)
        assert not beat.rejoin
        with pytest.raises(UnknownMemberIdError):
            await service.heartbeat("g", "someone-else", a.generation, 0, 0)

    asyncio.run(second_life())


def test_the_group_timer_stops_when_no_group_has_members_and_a_group_call_starts_it(tmp_path):
    """Nothing runs on a timer while no group has members: the timer ends after its next tick."""

    async def wait_for(condition, deadline_s=10.0):
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while not condition():
            assert loop.time() < end, "condition not reached in time"
            await asyncio.sleep(0.02)

    async def main():
        service = Service(tmp_path)
        await wait_for(lambda: service._timer.done())  # no groups: the first tick ends it
        a = await join(service)
        assert not service._timer.done()
        assert service._busy()  # a member's session is being watched: the timer's ticks go on
        assert await service.leave("g", a.member_id)
        await wait_for(lambda: service._timer.done())
        assert service._timer.exception() is None

    asyncio.run(main())


def test_long_poll_state_is_kept_only_for_groups_someone_waits_on(tmp_path):
    """Joining, heartbeating and leaving 300 groups leaves no wake-up event or fingerprint behind;
    a held heartbeat keeps one for its group until the group changes."""

    async def main():
        service = Service(tmp_path)
        for i in range(300):
            a = await service.join(f"g{i}", dict(OPTIONS), 2_000)
            await service.heartbeat(f"g{i}", a.member_id, a.generation, 0, 0)
            assert await service.leave(f"g{i}", a.member_id)
        assert (len(service._events), len(service._prints)) == (0, 0)
        a = await join(service)
        held = asyncio.ensure_future(service.heartbeat("g", a.member_id, a.generation, 0, 5_000))
        await asyncio.wait_for(until(lambda: "g" in service._events), 10)
        assert set(service._prints) == {"g"}
        b_join = asyncio.ensure_future(join(service, wait_ms=5_000))  # the group changes: the held heartbeat is woken
        assert (await asyncio.wait_for(held, 10)).rejoin
        await join(service, member_id=a.member_id)
        await asyncio.wait_for(b_join, 10)
        assert set(service._events) == set(service._prints) <= {"g"}

    asyncio.run(main())


def test_a_timer_that_ends_while_a_first_join_waits_is_started_again_once_the_member_is_in(tmp_path):
    """A first join only hands out a member id (KIP-394); the member is in after the second, within the
    same call. A timer that ticks while the call waits between the two (for groups.json to be durable,
    slow on a busy machine) finds no member and ends: the call starts it again once the member is in."""

    async def main():
        service = Service(tmp_path)
        ticks = []
        tick = service.tick
        service.tick = lambda: (ticks.append(1), tick())[1]
        durable = service._writer.durable

        async def slow_durable():
            # A write as slow as the timer: it completes once the timer has ended or ticked twice.
            await asyncio.wait_for(until(lambda: service._timer.done() or len(ticks) >= 2), 10)
            await durable()

        service._writer.durable = slow_durable
        a = await join(service)
        assert isinstance(a, JoinResult)
        assert not service._timer.done() and service._busy()

    asyncio.run(main())


class SlowFirstOffsets:
    """``CommittedOffsets`` whose first write waits until released: commits' writes in the order they end."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0
        self.written: list[int] = []

    async def ready(self) -> None:
        return None

    async def commit(self, group_id, records, checked) -> None:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
        self.written.extend(om.offset for om in checked.values())

    async def commit_transactional(self, producer_id, producer_epoch, group_id, records, checked) -> None:
        await self.commit(group_id, records, checked)


def test_one_groups_commits_are_applied_in_the_order_they_came(tmp_path):
    """A commit whose write is slow (its client may have given up on it) holds back the group's next one, so
    the committed offset never goes back; another group's commits do not wait for it."""
    from logbus import TopicPartition

    async def main():
        service = Service(tmp_path)
        service.offsets = offsets = SlowFirstOffsets()
        first = asyncio.ensure_future(service.commit_offsets("g", "", -1, {TopicPartition("t", 0): 127}))
        second = asyncio.ensure_future(service.commit_offsets("g", "", -1, {TopicPartition("t", 0): 140}))
        other = asyncio.ensure_future(service.commit_offsets("h", "", -1, {TopicPartition("t", 0): 5}))
        await asyncio.wait_for(other, 10)  # another group's commit is not held
        await run_ready(20)
        assert not first.done() and not second.done() and offsets.written == [5]
        offsets.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert offsets.written == [5, 127, 140]
        assert service._commit_order == {}  # nothing kept per group once its commits are done

    asyncio.run(main())


def test_a_transactional_commit_waits_for_the_groups_earlier_commit(tmp_path):
    """TxnOffsetCommit takes its turn with the group's plain commits: one that came second ends second, both ways."""
    from logbus import TopicPartition

    async def main():
        service = Service(tmp_path)
        service.offsets = offsets = SlowFirstOffsets()
        tp = TopicPartition("t", 0)
        first = asyncio.ensure_future(service.commit_offsets("g", "", -1, {tp: 127}))
        txn = asyncio.ensure_future(service.txn_offset_commit("g", "", -1, {tp: 140}, producer_id=7, producer_epoch=0))
        await run_ready(20)
        assert not first.done() and not txn.done() and offsets.written == []
        offsets.release.set()
        await asyncio.wait_for(asyncio.gather(first, txn), 10)
        assert offsets.written == [127, 140]

        offsets.calls, offsets.release = 0, asyncio.Event()  # now the transactional one is slow
        txn = asyncio.ensure_future(service.txn_offset_commit("g", "", -1, {tp: 150}, producer_id=7, producer_epoch=0))
        later = asyncio.ensure_future(service.commit_offsets("g", "", -1, {tp: 160}))
        await run_ready(20)
        assert not txn.done() and not later.done() and offsets.written == [127, 140]
        offsets.release.set()
        await asyncio.wait_for(asyncio.gather(txn, later), 10)
        assert offsets.written == [127, 140, 150, 160]
        assert service._commit_order == {}

    asyncio.run(main())
