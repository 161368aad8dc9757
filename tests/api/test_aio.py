"""The asyncio clients end to end: real Ray actors, in a plain asyncio loop and inside an async Ray actor."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import ray
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import logbus
import logbus.aio
from logbus import ConsumerRecord, RecordMetadata, TopicPartition
from logbus.api import producer as sync_producer
from logbus.api.aio import _LoopBridge
from logbus.api.producer import _as_bytes, _normalize_headers, record_charge_bytes
from logbus.errors import (
    BufferExhaustedError,
    IllegalStateError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    TransactionAbortedError,
    UnknownTopicError,
)
from tests.api.loop_probe import BlockingCalls

TICK_S = 0.01


async def wait_until(condition, timeout_s: float = 60.0, message: str = "condition"):
    """Await ``condition()`` (a coroutine function) until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")


def read_all(bus, topic: str, partitions: int, expected: int) -> pa.Table:
    """Every record of ``topic`` through the sync consumer (the reference path)."""
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    tables, total = [], 0
    deadline = time.monotonic() + 120
    while total < expected:
        assert time.monotonic() < deadline, f"read {total} of {expected} records"
        table = consumer.poll_arrow(timeout_ms=500)
        tables.append(table)
        total += table.num_rows
    consumer.close()
    return pa.concat_tables(tables)


# --- pure parts (no Ray) ------------------------------------------------------------------------------


def test_loop_bridge_runs_every_call_once_in_order_waking_the_loop_once_per_burst():
    threads, per_thread = 4, 20_000
    ran: list[tuple[int, int]] = []
    wakeups = [0]

    class Counting(_LoopBridge):
        def drain(self) -> None:
            wakeups[0] += 1
            super().drain()

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def record(item):
            ran.append(item)
            if len(ran) == threads * per_thread + 1:
                done.set_result(None)

        bridge = Counting(loop, on_done=record)

        def post_many(thread: int) -> None:
            for i in range(per_thread):
                if i % 2:
                    bridge.post(record, (thread, i))
                else:
                    bridge.done((thread, i))  # the allocation-free path

        workers = [threading.Thread(target=post_many, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        bridge.post(record, ("loop", 0))  # from the loop's own thread too
        await asyncio.wait_for(done, timeout=60)
        for worker in workers:
            worker.join()

    asyncio.run(main())
    assert ran.count(("loop", 0)) == 1
    for thread in range(threads):
        mine = [i for t, i in ran if t == thread]
        # Once each; each path keeps a thread's order (a drain runs the posted calls first).
        assert sorted(mine) == list(range(per_thread))
        assert [i for i in mine if i % 2 == 0] == list(range(0, per_thread, 2))
        assert [i for i in mine if i % 2] == list(range(1, per_thread, 2))
    assert wakeups[0] < threads * per_thread / 10, wakeups[0]


payloads = st.one_of(
    st.none(), st.binary(max_size=300), st.text(max_size=100),
    st.binary(max_size=100).map(bytearray), st.binary(max_size=100).map(memoryview),
)


@settings(max_examples=300, deadline=None)
@given(value=payloads, key=payloads, headers=st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=20), payloads, max_size=4),
    st.lists(st.tuples(st.text(max_size=20), payloads), max_size=4),
))
def test_a_record_is_charged_the_same_before_and_after_send_converts_it(value, key, headers):
    # The loop charges what the caller passed; send() charges what it converted: the fast path relies
    # on the two agreeing (while the loop's count fits the buffer, the sync one does too).
    try:
        converted = (_as_bytes(value, "value"), _as_bytes(key, "key"), None if headers is None else _normalize_headers(headers))
    except InvalidRecordError:
        assume(False)  # lone surrogates: send() refuses the record
    before = record_charge_bytes(value, key, headers)
    assert before is not None and before == record_charge_bytes(*converted)
    sizes = [len(b) for b in converted[:2] if b is not None]
    header_sizes = [len(name.encode("utf-8", "surrogatepass")) + len(v or b"") for name, v in converted[2] or ()]
    expected = sync_producer.RECORD_OVERHEAD_BYTES + sum(sizes) + sum(header_sizes) + sync_producer.HEADER_OVERHEAD_BYTES * len(header_sizes)
    assert before == expected


@pytest.mark.parametrize("value, key, headers", [
    ({"a": 1}, None, None),  # what a serializer would turn into bytes of its own
    (b"v", 17, None),
    (b"v", None, {"h": 1.5}),
    (b"v", None, [("h",)]),
    (b"v", None, {3: b"x"}),
])
def test_records_whose_size_is_unknown_before_sending_are_not_counted_on_the_loop(value, key, headers):
    assert record_charge_bytes(value, key, headers) is None


def test_the_blocking_call_probe_records_waits_on_its_own_thread_only():
    """The probe the tests below rely on: it records what would wait, on its thread, and nothing else."""
    import concurrent.futures

    done = concurrent.futures.Future()
    done.set_result(1)
    pending = concurrent.futures.Future()
    gate = threading.Event()
    with BlockingCalls() as probe:
        other = threading.Thread(target=gate.wait, args=(30,))  # a wait, but on another thread
        other.start()
        threading.Event().wait(0)  # told not to wait
        assert done.result() == 1  # done already: no wait
        time.sleep(0.001)
        threading.Timer(0.01, pending.set_result, (2,)).start()
        assert pending.result(timeout=30) == 2
        threading.Timer(0.01, gate.set).start()
        other.join()
    assert [call.split(",")[0] for call in probe.calls] == ["time.sleep", "Future.result", "Thread.join"]
    assert time.sleep.__module__ == "time"  # put back


# --- the producer in a plain asyncio loop ---------------------------------------------------------


@pytest.mark.timeout(180)
def test_producer_round_trip(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    base_ms = int(time.time() * 1000) - 60_000

    async def main():
        async with logbus.aio.Producer(bus, linger_ms=1) as producer:
            first = await producer.send_and_wait(
                topic_name, b"first", key=b"k", partition=1, timestamp_ms=base_ms, headers={"trace": b"abc"}
            )
            assert first == RecordMetadata(topic_name, 1, 0, base_ms)
            futures = [await producer.send(topic_name, f"v{i}", partition=0) for i in range(2000)]
            assert all(isinstance(f, asyncio.Future) for f in futures)
            metadata = await asyncio.gather(*futures)
            assert [(m.partition, m.offset) for m in metadata] == [(0, i) for i in range(2000)]
            table = pa.table({"value": [b"t%d" % i for i in range(100)], "partition": [1] * 100})
            batches = await (await producer.send_table(topic_name, table))
            assert sum(b.record_count for b in batches) == 100 and min(b.base_offset for b in batches) == 1
            # Mistakes are the sync producer's errors, raised in the awaiting coroutine.
            with pytest.raises(InvalidPartitionError):
                await producer.send(topic_name, b"x", partition=2)
            with pytest.raises(UnknownTopicError):
                await producer.send(topic_name + "-missing", b"x")
            assert await producer.partitions_for(topic_name) == [0, 1]
            last = await producer.send(topic_name, b"last", partition=0)
            await producer.flush(timeout_s=60)
            assert last.done() and last.result().offset == 2000
        with pytest.raises(IllegalStateError, match="stopped"):
            await producer.send(topic_name, b"late")
        with pytest.raises(IllegalStateError, match="not started"):
            await logbus.aio.Producer(bus).send(topic_name, b"early")

    asyncio.run(main())
    got = read_all(bus, topic_name, 2, 2102)
    assert got.num_rows == 2102
    rows = got.filter(pa.compute.equal(got["partition"], 1)).to_pylist()
    assert (rows[0]["key"], rows[0]["value"], rows[0]["timestamp"], rows[0]["headers"]) == (b"k", b"first", base_ms, [("trace", b"abc")])
    assert [r["value"] for r in rows[1:]] == [b"t%d" % i for i in range(100)]
    zero = got.filter(pa.compute.equal(got["partition"], 0))["value"].to_pylist()
    assert zero == [b"v%d" % i for i in range(2000)] + [b"last"]


@pytest.mark.timeout(180)
def test_records_keep_send_order_when_a_full_buffer_moves_sends_to_the_worker(bus, topic_name):
    """A 16 KiB buffer and 1 KB records: sends alternate between the loop and the worker, in order."""
    bus.admin.create_topic(topic_name, partitions=1)
    count = 3000

    async def main():
        async with logbus.aio.Producer(bus, linger_ms=1, buffer_memory_bytes=16 * 1024, batch_size_bytes=4096) as producer:
            futures = [await producer.send(topic_name, b"%06d" % i + b"x" * 1000) for i in range(count)]
            return [m.offset for m in await asyncio.gather(*futures)]

    assert asyncio.run(main()) == list(range(count))
    values = read_all(bus, topic_name, 1, count)["value"].to_pylist()
    assert [int(v[:6]) for v in values] == list(range(count))


@pytest.mark.timeout(120)
def test_bad_producer_options_are_raised_by_start(bus):
    async def main():
        producer = logbus.aio.Producer(bus, acks=2)
        with pytest.raises(InvalidConfigError, match="acks"):
            await producer.start()

    asyncio.run(main())
    with pytest.raises(InvalidConfigError, match="bus"):
        logbus.aio.Producer("not a bus")


@pytest.mark.timeout(180)
def test_a_full_buffer_makes_the_sender_wait_not_the_loop(bus, topic_name):
    # One replica but two required in sync: acks="all" never succeeds, so the records stay buffered
    # (retried) and the buffer stays full.
    bus.admin.create_topic(topic_name, partitions=1, config={"min.insync.replicas": 2})

    async def main():
        producer = logbus.aio.Producer(
            bus, acks="all", linger_ms=0, buffer_memory_bytes=64 * 1024, max_block_ms=1500, delivery_timeout_ms=60_000
        )
        await producer.start()
        await producer.partitions_for(topic_name)
        held = [await producer.send(topic_name, b"x" * 20_000) for _ in range(3)]  # 60 KB of 64 KiB
        with BlockingCalls() as probe:
            send = asyncio.ensure_future(producer.send(topic_name, b"x" * 20_000))
            await asyncio.sleep(0)  # the send runs up to its first await
            # A send waiting on the loop would have run to its end (BufferExhaustedError) in that one step.
            waiting_off_the_loop = not send.done()
            with pytest.raises(BufferExhaustedError):  # raised once max_block_ms passed with no room
                await send
        await producer.stop(timeout_s=0)  # as the sync close(): what is unacknowledged fails
        for future in held:
            with pytest.raises(RequestTimedOutError):
                await future
        return waiting_off_the_loop, probe.calls

    waiting_off_the_loop, blocking_calls = asyncio.run(main())
    assert waiting_off_the_loop
    assert blocking_calls == []


@pytest.mark.timeout(180)
def test_send_and_wait_needs_no_thread_and_no_blocking_call_per_record(bus, topic_name):
    """One record at a time, acknowledged before the next: each completion reaches the loop through the
    producer's loop bridge (no thread per record) and nothing on the loop waits. What a record costs
    against the sync ``send().result()`` is perf/bench_broker.py's ``aio_send_and_wait`` case."""
    bus.admin.create_topic(topic_name, partitions=1)
    records = 300
    started = []
    start = threading.Thread.start

    def counted_start(thread):
        started.append(thread.name)
        return start(thread)

    async def main():
        async with logbus.aio.Producer(bus, linger_ms=0) as producer:
            await producer.send_and_wait(topic_name, b"warm-up")  # the topic's metadata, fetched off the loop
            threading.Thread.start = counted_start
            try:
                with BlockingCalls() as probe:
                    offsets = [(await producer.send_and_wait(topic_name, b"x" * 100)).offset for _ in range(records)]
            finally:
                threading.Thread.start = start
        return offsets, probe.calls

    offsets, blocking_calls = asyncio.run(main())
    assert offsets == list(range(1, records + 1))
    # No thread per record: at most the local channel's reader, once the leader's channel is open.
    assert started in ([], ["logbus-local-channel"]), started
    assert blocking_calls == []


# --- the consumer in a plain asyncio loop ---------------------------------------------------------


def produce(bus, topic: str, count: int, partitions: int, **options) -> None:
    with logbus.Producer(bus, linger_ms=5, **options) as producer:
        for i in range(count):
            producer.send(topic, b"%d" % i, partition=i % partitions)


@pytest.mark.timeout(180)
def test_consumer_round_trip(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    produce(bus, topic_name, 400, 2)
    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]

    async def main():
        async with logbus.aio.Consumer(bus, group_id="aio-round-trip", enable_auto_commit=False) as consumer:
            await consumer.assign(tps)
            assert consumer.assignment() == set(tps)
            delivered: list[ConsumerRecord] = []
            first = await consumer.getone()
            assert isinstance(first, ConsumerRecord) and first.offset == 0
            delivered.append(first)
            async for record in consumer:
                delivered.append(record)
                if len(delivered) == 10:
                    break
            # getone() fetched more than it handed out: a commit now covers only what was delivered. (A
            # commit covers the partitions that have a position: ask for them first, so that one whose
            # position lookup is still on its way is committed too.)
            for tp in tps:
                await consumer.position(tp)
            await consumer.commit()
            last = {}
            for record in delivered:
                last[TopicPartition(record.topic, record.partition)] = record.offset + 1
            # Nothing delivered from a partition: its commit is where it starts (0), whatever was fetched.
            assert await consumer.committed(tps) == {tp: last.get(tp, 0) for tp in tps}
            for tp in tps:
                assert await consumer.position(tp) == last.get(tp, 0)

            async def more():
                batch = await consumer.getmany(timeout_ms=500, max_records=50)
                assert sum(map(len, batch.values())) <= 50
                for records in batch.values():
                    delivered.extend(records)
                return len(delivered) >= 200

            await wait_until(more, message="200 records")
            tables = []

            async def rest():
                table = await consumer.getmany_arrow(timeout_ms=500)
                tables.append(table)
                return len(delivered) + sum(t.num_rows for t in tables) >= 400

            await wait_until(rest, message="400 records")
            assert (await consumer.getmany_arrow(timeout_ms=100)).num_rows == 0
            values = [int(r.value) for r in delivered] + [int(v) for t in tables for v in t["value"].to_pylist()]
            assert sorted(values) == list(range(400))
            offsets = {tp: [] for tp in tps}
            for record in delivered:
                offsets[TopicPartition(record.topic, record.partition)].append(record.offset)
            for table in tables:
                for partition, offset in zip(table["partition"].to_pylist(), table["offset"].to_pylist()):
                    offsets[tps[partition]].append(offset)
            assert offsets == {tp: list(range(200)) for tp in tps}

            await consumer.seek(tps[1], 190)
            again = []

            async def after_seek():
                batch = await consumer.getmany(timeout_ms=500)
                again.extend((r.partition, r.offset) for records in batch.values() for r in records)
                return len(again) >= 10

            await wait_until(after_seek, message="records after seek")
            assert again == [(1, offset) for offset in range(190, 200)]
            await consumer.seek_to_beginning([tps[0]])
            assert await consumer.position(tps[0]) == 0
            await consumer.seek_to_end()
            assert await consumer.position(tps[0]) == 200
            assert await consumer.end_offsets(tps) == {tp: 200 for tp in tps}
            # Errors are the sync consumer's, raised in the awaiting coroutine.
            with pytest.raises(IllegalStateError):
                await consumer.seek(TopicPartition(topic_name + "-other", 0), 0)
            with pytest.raises(InvalidConfigError):
                await consumer.getmany(timeout_ms=-1)
        with pytest.raises(IllegalStateError, match="stopped"):
            await consumer.getmany()

        strict = logbus.aio.Consumer(bus, auto_offset_reset="none")
        await strict.start()
        await strict.assign(tps)
        with pytest.raises(OffsetOutOfRangeError):
            await strict.getmany(timeout_ms=500)
        await strict.stop()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_iteration_ends_when_the_consumer_stops(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)

    async def main():
        consumer = logbus.aio.Consumer(bus)
        await consumer.start()
        await consumer.assign([TopicPartition(topic_name, 0)])
        seen = []

        async def iterate():
            async for record in consumer:
                seen.append(record.value)

        task = asyncio.get_running_loop().create_task(iterate())
        async with logbus.aio.Producer(bus, linger_ms=0) as producer:
            await producer.send_and_wait(topic_name, b"only")

        async def arrived():
            await asyncio.sleep(TICK_S)
            return seen

        await wait_until(arrived, message="the record through the iteration")
        await consumer.stop()  # the iteration is waiting for more: it ends
        await asyncio.wait_for(task, timeout=30)
        return seen

    assert asyncio.run(main()) == [b"only"]


@pytest.mark.timeout(240)
def test_cancelled_calls_lose_no_records(bus, topic_name):
    """Calls cancelled while their poll runs: every record still arrives once, in order, in whatever form asked next."""
    bus.admin.create_topic(topic_name, partitions=2)
    count = 3000
    produce(bus, topic_name, count, 2, batch_size_bytes=1024)  # many small batches: many polls to cut short
    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    rng = random.Random(7)

    async def main():
        offsets = {tp: [] for tp in tps}
        cut_short = 0
        async with logbus.aio.Consumer(bus, group_id="aio-cancel", fetch_max_bytes=4096) as consumer:
            await consumer.assign(tps)

            async def step():
                nonlocal cut_short
                kind = rng.choice(("getmany", "getmany_arrow", "getone"))
                if kind == "getmany":
                    call = consumer.getmany(timeout_ms=200, max_records=rng.choice((None, 7, 100)))
                elif kind == "getmany_arrow":
                    call = consumer.getmany_arrow(timeout_ms=200, max_records=rng.choice((None, 5, 60)))
                else:
                    call = consumer.getone()
                task = asyncio.get_running_loop().create_task(call)
                if rng.random() < 0.5:
                    # Let the call run to its first wait (the poll it started on the worker), then cut it short.
                    await asyncio.sleep(0)
                    task.cancel()
                try:
                    got = await task
                except asyncio.CancelledError:
                    cut_short += 1
                    return False
                if isinstance(got, ConsumerRecord):
                    offsets[TopicPartition(got.topic, got.partition)].append(got.offset)
                elif isinstance(got, pa.Table):
                    for partition, offset in zip(got["partition"].to_pylist(), got["offset"].to_pylist()):
                        offsets[tps[partition]].append(offset)
                else:
                    for tp, records in got.items():
                        offsets[tp].extend(r.offset for r in records)
                return sum(map(len, offsets.values())) >= count

            await wait_until(step, timeout_s=150, message=f"{count} records")
            # Nothing more: no record was delivered twice.
            assert (await consumer.getmany_arrow(timeout_ms=200)).num_rows == 0
            await consumer.commit()
            committed = await consumer.committed(tps)
        return offsets, cut_short, committed

    offsets, cut_short, committed = asyncio.run(main())
    assert offsets == {tp: list(range(count // 2)) for tp in tps}
    assert committed == {tp: count // 2 for tp in tps}
    assert cut_short >= 20, cut_short


@pytest.mark.timeout(180)
def test_a_seek_after_a_cancelled_poll_keeps_the_other_partitions_records(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    per_partition = 300
    produce(bus, topic_name, 2 * per_partition, 2, batch_size_bytes=1024)
    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]

    async def main():
        offsets = {tp: [] for tp in tps}

        def note(table: pa.Table) -> None:
            for partition, offset in zip(table["partition"].to_pylist(), table["offset"].to_pylist()):
                offsets[tps[partition]].append(offset)

        async with logbus.aio.Consumer(bus, fetch_max_bytes=2048) as consumer:
            await consumer.assign(tps)
            for _ in range(10):
                task = asyncio.get_running_loop().create_task(consumer.getmany_arrow(timeout_ms=1000))
                await asyncio.sleep(0)  # the call starts its poll on the worker ...
                task.cancel()  # ... and stops waiting for it: what the poll brings is kept
                try:
                    note(await task)
                except asyncio.CancelledError:
                    pass
                await consumer.seek(tps[0], 0)  # partition 0 starts over; partition 1's kept records stay
                offsets[tps[0]].clear()

            async def rest():
                note(await consumer.getmany_arrow(timeout_ms=500))
                return all(len(found) >= per_partition for found in offsets.values())

            await wait_until(rest, message="every record of both partitions")
            assert (await consumer.getmany_arrow(timeout_ms=200)).num_rows == 0
        return offsets

    assert asyncio.run(main()) == {tp: list(range(per_partition)) for tp in tps}


class AsyncRecorder:
    """An aiokafka-style listener (coroutine methods) that commits through the consumer on revocation."""

    def __init__(self) -> None:
        self.consumer = None
        self.events = []

    async def on_partitions_assigned(self, partitions):
        self.events.append(("assigned", set(partitions)))
        await self.consumer.seek_to_beginning(partitions)

    async def on_partitions_revoked(self, partitions):
        self.events.append(("revoked", set(partitions)))
        await self.consumer.commit()


@pytest.mark.timeout(180)
def test_group_subscription_with_a_coroutine_listener(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    produce(bus, topic_name, 100, 2)
    tps = {TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)}

    async def main():
        listener = AsyncRecorder()
        consumer = logbus.aio.Consumer(bus, group_id="aio-group", enable_auto_commit=False)
        listener.consumer = consumer
        await consumer.start()
        await consumer.subscribe([topic_name], listener=listener)
        got = []

        async def more():
            batch = await consumer.getmany(timeout_ms=500, max_records=30)
            got.extend(r for records in batch.values() for r in records)
            return len(got) >= 100

        await wait_until(more, message="100 records through the group")
        assert consumer.assignment() == tps
        await consumer.unsubscribe()  # revokes: the listener commits through the consumer
        assert listener.events == [("assigned", tps), ("revoked", tps)]
        await consumer.stop()
        return sorted(int(r.value) for r in got)

    assert asyncio.run(main()) == list(range(100))
    checker = logbus.Consumer(bus, group_id="aio-group")
    assert checker.committed(sorted(tps)) == {tp: 50 for tp in tps}
    checker.close()


# --- inside an async Ray actor, under load ----------------------------------------------------------


@ray.remote(num_cpus=0)
class AsyncConsumerActor:
    """Consumes with the asyncio consumer, recording every blocking call made on its event loop's thread."""

    def __init__(self) -> None:
        self.probe = None
        self.consumer = None

    async def open(self, bus, topic: str, partitions: int) -> bool:
        self.probe = BlockingCalls(threading.get_ident())  # this method runs on the actor's event loop
        self.probe.install()
        self.consumer = logbus.aio.Consumer(bus)
        await self.consumer.start()
        await self.consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        assert not await self.consumer.getmany(timeout_ms=200)  # nothing produced yet
        return True

    async def consume(self, expected: int, timeout_s: float):
        consumer = self.consumer
        values, offsets = [], {}
        deadline = time.monotonic() + timeout_s
        while len(values) < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=100, max_records=2000)
            for tp, records in batch.items():
                offsets.setdefault(tp.partition, []).extend(r.offset for r in records)
                values.extend(int(r.value) for r in records)
        # Anything beyond the expected count would be a duplicate.
        extra = await consumer.getmany(timeout_ms=300)
        values.extend(int(r.value) for records in extra.values() for r in records)
        await consumer.stop()
        self.probe.uninstall()
        return np.asarray(values, np.int64), {p: np.asarray(o, np.int64) for p, o in offsets.items()}, self.probe.calls


@pytest.mark.timeout(300)
def test_the_clients_make_no_blocking_call_on_the_loop_under_load(bus, topic_name):
    """The asyncio producer (here, 20,000 records/s) and the asyncio consumer (in an async Ray actor)
    never wait on their event loop's thread: every call that could (a fetch, a full buffer, metadata)
    goes to a worker thread. How late the loop's other coroutines run meanwhile (the GIL is shared with
    the worker) is perf/bench_broker.py's ``aio_loop_lateness`` case."""
    partitions, rate, seconds = 2, 20_000, 4
    count = rate * seconds
    bus.admin.create_topic(topic_name, partitions=partitions)
    actor = AsyncConsumerActor.remote()
    assert ray.get(actor.open.remote(bus, topic_name, partitions), timeout=120)
    consumed = actor.consume.remote(count, 120)

    async def produce_steadily():
        """``rate`` records/s in steps of 10 ms, with the asyncio producer."""
        loop = asyncio.get_running_loop()
        per_step = rate // 100
        with BlockingCalls() as probe:
            async with logbus.aio.Producer(bus, linger_ms=2) as producer:
                await producer.partitions_for(topic_name)
                start = loop.time()
                futures = []
                for step in range(count // per_step):
                    await asyncio.sleep(max(0.0, start + step * 0.01 - loop.time()))  # pacing, not synchronisation
                    for i in range(step * per_step, (step + 1) * per_step):
                        futures.append(await producer.send(topic_name, b"%d" % i, partition=i % partitions))
                await producer.flush(timeout_s=60)
                assert all(f.done() and f.exception() is None for f in futures)
        return probe.calls

    producer_calls = asyncio.run(produce_steadily())
    values, offsets, consumer_calls = ray.get(consumed, timeout=180)
    ray.kill(actor)
    assert len(values) == count and np.array_equal(np.sort(values), np.arange(count))  # each record once
    for partition in range(partitions):
        assert np.array_equal(offsets[partition], np.arange(count // partitions))
    assert producer_calls == []
    assert consumer_calls == []


@pytest.mark.timeout(180)
def test_a_transactional_producer_commits_and_aborts_off_the_loop(bus, topic_name):
    # logbus.aio's transactional calls, with a consumer's offsets in the committed transaction:
    # a read_committed consumer sees the committed records only, and the group has the offsets.
    from tests.api.test_transactions_e2e import committed_values

    bus.admin.create_topic(topic_name, partitions=2)
    source = TopicPartition(topic_name, 1)
    group = f"{topic_name}-g"

    async def main():
        async with logbus.aio.Consumer(bus, group_id=group, enable_auto_commit=False) as consumer, \
                logbus.aio.Producer(bus, transactional_id=f"{topic_name}-tx") as producer:
            await producer.init_transactions()
            await producer.begin_transaction()
            sent = [await producer.send(topic_name, b"c%d" % i, partition=0) for i in range(10)]
            await producer.send_offsets_to_transaction({source: 7}, await consumer.group_metadata())
            await producer.commit_transaction()
            assert [m.offset for m in await asyncio.gather(*sent)] == list(range(10))
            await producer.begin_transaction()
            aborted = [await producer.send(topic_name, b"a%d" % i, partition=0) for i in range(5)]
            await producer.abort_transaction()
            # Records not yet sent when the abort came fail with TransactionAbortedError; none is ever read committed.
            outcomes = await asyncio.gather(*aborted, return_exceptions=True)
            assert all(isinstance(o, TransactionAbortedError) or o.offset >= 10 for o in outcomes)

    asyncio.run(main())
    assert committed_values(bus, topic_name, 2) == sorted(b"c%d" % i for i in range(10))
    checker = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
    try:
        assert checker.committed([source]) == {source: 7}
    finally:
        checker.close()
