"""asyncio clients: a Producer and a Consumer with aiokafka's shapes that never block the event loop.

Both wrap the sync clients (``logbus.api.producer`` and ``logbus.api.consumer``)
and decide, call by call, what may run on the loop's thread and what must go
to a worker thread; the loop only ever awaits. They are meant for coroutines
that must stay responsive while records flow: Ray Serve deployments, async
Ray actors, asyncio services.

    async with logbus.aio.Producer(bus, linger_ms=5) as producer:
        metadata = await producer.send_and_wait("events", b"hello", key=b"user-1")

    async with logbus.aio.Consumer(bus, "events", group_id="dashboards") as consumer:
        async for record in consumer:
            ...

The Producer runs the sync producer's ``send()`` on the loop when it cannot
block (the usual case, a few microseconds), and on its worker thread when it
might: see :class:`Producer`. Completions come back to the loop through one
:class:`_LoopBridge`, which wakes the loop once per burst of completions (a
batch's records complete together), not once per record, and needs no
thread per record.

The Consumer confines the sync consumer (not thread-safe) to one worker
thread of its own and runs every call there, in the order made: see
:class:`Consumer`.

Errors are the sync clients' logbus errors, raised in the awaiting coroutine.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from logbus.api import consumer as sync_consumer
from logbus.api import producer as sync_producer
from logbus.api.client import Bus
from logbus.errors import IllegalStateError, InvalidConfigError
from logbus.protocol.messages import ConsumerRecord, RecordMetadata, TopicPartition

logger = logging.getLogger(__name__)

# pyarrow's first scalar loads its pandas shim (importing pandas, when installed): half a second of
# work that holds the GIL. The sync consumer makes scalars when it is assigned partitions; from its
# worker thread that would stall the event loop for as long. Here it is paid at import instead.
pa.scalar(0)

# What the sync producer charges its buffer per record on top of the key, value and headers
# (headers: name, value and this much each). The loop's estimate must never be below the sync
# producer's own count, so it adds a margin to the sync producer's figures.
RECORD_CHARGE_BYTES = sync_producer.RECORD_OVERHEAD_BYTES + 16
HEADER_CHARGE_BYTES = 12 + 4
GETONE_WAIT_MS = 200  # getone() polls in slices this long, so stop() never waits on it for longer
GETONE_POLL_MAX = 500  # records one poll of getone() fetches; the rest wait in the consumer for the next calls
STOP_SETTLE_S = 5.0  # stop() waits this long for the replies of the last records to reach the loop


class _LoopBridge:
    """Hands calls from other threads to the event loop, waking the loop once per burst.

    ``post(fn, *args)`` (and ``done(future)``, which runs ``on_done(future)``)
    may be called from any thread, the loop's included; the loop runs
    ``fn(*args)`` soon after, each kind in the order posted. Only a post that
    finds no drain scheduled writes to the loop's wake-up pipe
    (``call_soon_threadsafe``): a batch of 1,000 records completing at once
    costs one wake-up, not 1,000.

    No lock: ``deque.append`` and ``popleft`` are atomic, and ``drain``
    clears the flag before it empties the queue, so a call posted while it
    runs is either taken by it or finds the flag clear and schedules the
    next drain. (Two posters may both schedule one; the second drain finds
    little or nothing to do.)
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[Future], None] | None = None) -> None:
        self._loop = loop
        self._calls: deque = deque()
        self._done: deque = deque()
        self._on_done = on_done
        self._scheduled = False

    def post(self, fn: Callable, *args) -> None:
        self._calls.append((fn, args))
        self._wake()

    def done(self, future: Future) -> None:
        """``post(on_done, future)`` without allocating: it is the done-callback of every record.

        Each object allocated per record adds to the cyclic garbage
        collector's work, a good part of what a record costs here.
        """
        self._done.append(future)
        self._wake()

    def _wake(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: nobody is left to await these
            logger.debug("event loop closed; dropping a completion")

    def drain(self) -> None:
        """Run every call posted so far. On the loop's thread only."""
        self._scheduled = False
        calls, done = self._calls, self._done
        while calls or done:
            try:
                while calls:
                    fn, args = calls.popleft()
                    fn(*args)
                while done:
                    self._on_done(done.popleft())
            except Exception:  # noqa: BLE001 (one failing call must not strand the others)
                logger.exception("a completion callback failed")


def _charge(data) -> int | None:
    """Bytes ``data`` (a key or value) counts for in the producer's buffer; None if not known before sending."""
    if data is None:
        return 0
    kind = data.__class__
    if kind is bytes or kind is bytearray:
        return len(data)
    if kind is str:
        return len(data) if data.isascii() else len(data.encode("utf-8", "surrogatepass"))
    if kind is memoryview:
        return data.nbytes
    return None  # something the sync producer rejects, or (with a serializer) turns into bytes of its own


def _record_charge(value, key, headers) -> int | None:
    """At least what the sync producer charges its buffer for this record, or None if that cannot be known."""
    value_bytes = _charge(value)
    key_bytes = _charge(key)
    if value_bytes is None or key_bytes is None:
        return None
    size = RECORD_CHARGE_BYTES + value_bytes + key_bytes
    if headers is not None:
        try:
            items = headers.items() if isinstance(headers, dict) else headers
            for name, header in items:
                header_bytes = _charge(header)
                if header_bytes is None or name.__class__ is not str:
                    return None
                size += HEADER_CHARGE_BYTES + len(name.encode("utf-8", "surrogatepass")) + header_bytes
        except (TypeError, ValueError):
            return None  # malformed: the sync producer names the mistake
    return size


class Producer:
    """Sends records from coroutines; ``await send()`` never blocks the event loop.

    ``bus`` and the keyword options are those of :class:`logbus.Producer`
    (acks, linger_ms, batch_size_bytes, buffer_memory_bytes, compression,
    max_block_ms, delivery_timeout_ms, serializers, ...). The sync producer is
    built by ``await start()``, so its option errors (InvalidConfigError)
    are raised there.

    What runs where. The sync producer's ``send()`` does per-record
    bookkeeping under a lock the sender thread holds only for moments; it
    can block in two cases only: the first send to a topic fetches the
    topic's metadata (an actor call), and a full buffer waits up to
    ``max_block_ms`` for space. So ``send()`` calls it on the loop's thread
    when neither can happen, and on this producer's worker thread otherwise:

    * on the loop when the topic has been sent to before (its metadata is
      cached by the sync producer from then on), the record's size is known
      before it is sent (key and value are bytes, str or None and no
      serializer is configured), and the bytes of every record this producer
      has handed over and not seen completed, plus this one, fit
      ``buffer_memory_bytes``. This producer counts at least what the sync
      producer counts, and frees it later (when the completion reaches the
      loop), so the sync producer's buffer then has room and ``send()``
      cannot wait;
    * on the worker otherwise, and also whenever an earlier send is still
      waiting there or a ``send_table`` (whose size the sync producer
      computes itself) is in the buffer, so that records keep the order in
      which ``send()`` was called. A full buffer then makes the awaiting
      coroutine wait (up to ``max_block_ms``, then BufferExhaustedError, as
      in the sync producer) while the loop runs on.

    ``send_table()``, ``flush()``, ``stop()`` and ``partitions_for()``
    always run off the loop.

    Cost, measured on the 2-core development machine (shared, so noisy) with
    one partition whose leader runs on this node, linger_ms=0, acks=1 and
    100-byte records. ``await send_and_wait()``, one record at a time: a
    median of 0.27-0.30 ms against 0.23-0.25 ms for the sync
    ``send().result()``, about +0.045 ms (the completion's hop from the
    reply's thread to the loop, and the coroutine's wake-up;
    perf/bench_broker.py's asyncio cases measure it). ``await send()`` alone, records queued back to back: 4-10 µs per
    record on the loop against 1-2 µs for the sync ``send()`` (the asyncio
    Future, the done-callback, and the garbage collector's share of them),
    plus 2-4 µs when its completion reaches the loop. A send that takes the
    worker path costs a thread round trip: about 40 µs when sends are
    awaited one after another (concurrent sends share the trip).

    Each record's completion reaches the loop through a :class:`_LoopBridge`
    (a done-callback on the sync future, then one ``call_soon_threadsafe``
    per burst): no thread per record.
    """

    def __init__(self, bus: Bus, **options: Any) -> None:
        if not isinstance(bus, Bus):
            raise InvalidConfigError(f"bus must be a Bus from logbus.connect(), not {type(bus).__name__}")
        self._bus = bus
        self._options = options
        # A serializer turns a key or value into bytes the loop cannot size before sending.
        self._sizes_known = not any(name.endswith("serializer") and value is not None for name, value in options.items())
        self._producer: sync_producer.Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._bridge: _LoopBridge | None = None
        self._state = "new"  # -> "started" -> "stopped"
        self._known_topics: set[str] = set()  # topics whose metadata the sync producer holds
        self._backlog = 0  # sends and tables handed to the worker whose queuing the loop has not yet seen
        self._held_bytes = 0  # charges of records handed over and not yet completed (as seen by the loop)
        self._unsized = 0  # records and tables in the sync producer whose charge the loop does not know
        self._buffer_limit = 0
        # Futures handed out and not yet resolved: the sync future -> its asyncio Future, and that -> its charge.
        self._pending: dict[Future, asyncio.Future] = {}
        self._unsettled: dict[asyncio.Future, int | None] = {}
        self._record_done: Callable[[Future], None] | None = None  # bound once: see _LoopBridge.done

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the sync producer (its sender thread starts). Idempotent; a stopped producer cannot restart."""
        if self._state == "started":
            return
        if self._state == "stopped":
            raise IllegalStateError("the producer was stopped; create a new one")
        loop = asyncio.get_running_loop()
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logbus-aio-producer")
        try:
            producer = await loop.run_in_executor(worker, functools.partial(sync_producer.Producer, self._bus, **self._options))
        except BaseException:
            worker.shutdown(wait=False)
            raise
        self._loop, self._worker, self._producer = loop, worker, producer
        self._bridge = _LoopBridge(loop, self._settle_record)
        self._record_done = self._bridge.done
        self._buffer_limit = producer.buffer_memory_bytes
        self._state = "started"

    async def stop(self, timeout_s: float | None = None) -> None:
        """Send what is buffered, wait for the replies, stop the sender. Later sends raise IllegalStateError.

        As with the sync ``close()``, records still unacknowledged after
        ``timeout_s`` fail (RequestTimedOutError) and the producer stops anyway.
        """
        if self._state != "started":
            self._state = "stopped"
            return
        self._state = "stopped"
        try:
            # On the worker: after every send handed to it, so those records are flushed too.
            await asyncio.shield(self._loop.run_in_executor(self._worker, self._producer.close, timeout_s))
        finally:
            self._worker.shutdown(wait=False)
        await self._settle(list(self._unsettled), STOP_SETTLE_S)

    async def __aenter__(self) -> "Producer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _running(self) -> sync_producer.Producer:
        if self._state != "started":
            raise IllegalStateError("the producer is not started" if self._state == "new" else "the producer was stopped")
        return self._producer

    # --- sending --------------------------------------------------------------------------------

    async def send(
        self, topic: str, value=None, key=None, partition: int | None = None, timestamp_ms: int | None = None, headers=None
    ) -> asyncio.Future:
        """Queue one record; returns (once it is queued) an asyncio Future of its RecordMetadata.

        Arguments as in :meth:`logbus.Producer.send`. Mistakes (UnknownTopicError,
        InvalidPartitionError, InvalidRecordError, RecordTooLargeError, ...) and
        BufferExhaustedError are raised here; delivery errors by the Future.
        Records are queued in the order ``send()`` is awaited. Cancelling the
        returned Future does not unsend the record.
        """
        producer = self._running()
        charge = _record_charge(value, key, headers) if self._sizes_known else None
        if (
            charge is not None
            and not self._backlog
            and not self._unsized
            and topic.__class__ is str
            and topic in self._known_topics
            and self._held_bytes + charge <= self._buffer_limit
        ):
            # Cannot block: the metadata is cached and the buffer has room (see the class docstring).
            record = producer.send(topic, value, key=key, headers=headers, partition=partition, timestamp_ms=timestamp_ms)
            return self._track(record, charge)
        send = functools.partial(producer.send, topic, value, key=key, headers=headers, partition=partition, timestamp_ms=timestamp_ms)
        return await self._queue_on_worker(send, topic, charge)

    async def send_and_wait(
        self, topic: str, value=None, key=None, partition: int | None = None, timestamp_ms: int | None = None, headers=None
    ) -> RecordMetadata:
        """Send one record and wait until it is acknowledged; returns its RecordMetadata."""
        future = await self.send(topic, value, key=key, partition=partition, timestamp_ms=timestamp_ms, headers=headers)
        return await future

    async def send_table(self, topic: str, table: pa.Table | pa.RecordBatch) -> asyncio.Future:
        """Queue a pyarrow Table in bulk (as :meth:`logbus.Producer.send_table`), on the worker thread.

        Returns, once the table is queued, an asyncio Future of the list of
        BatchMetadata: ``await (await producer.send_table(topic, table))``.
        """
        producer = self._running()
        return await self._queue_on_worker(functools.partial(producer.send_table, topic, table), topic, None)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Send everything queued and wait until each of those records is acknowledged or failed.

        Raises RequestTimedOutError after ``timeout_s`` (None: no limit).
        """
        producer = self._running()
        await self._loop.run_in_executor(self._worker, _nothing)  # every send handed to the worker is queued
        pending = list(self._unsettled)
        # Not on the worker: a long flush must not hold up sends meanwhile.
        await self._loop.run_in_executor(None, producer.flush, timeout_s)
        # The sync flush returns once the replies are in; their completions may still be on their way here.
        await self._settle(pending, None)

    async def partitions_for(self, topic: str) -> list[int]:
        """The partition numbers of ``topic`` (fetched once, off the loop)."""
        producer = self._running()
        partitions = await self._loop.run_in_executor(self._worker, producer.partitions_for, topic)
        self._known_topics.add(topic)
        return partitions

    # --- completions ----------------------------------------------------------------------------

    async def _queue_on_worker(self, send: Callable[[], Future], topic: str, charge: int | None) -> asyncio.Future:
        """Run ``send`` on the worker (in order with earlier ones); returns the asyncio Future of what it queued."""
        result = self._loop.create_future()
        queued = self._loop.create_future()
        self._backlog += 1
        job = self._worker.submit(send)
        # The bookkeeping happens when the job ends, whether or not this coroutine is still waiting.
        job.add_done_callback(functools.partial(self._bridge.post, self._queued, topic, charge, result, queued))
        try:
            return await queued
        except asyncio.CancelledError:
            job.cancel()  # not started yet: nothing is sent; already running: it is tracked as usual
            raise

    def _queued(self, topic: str, charge: int | None, result: asyncio.Future, queued: asyncio.Future, job: Future) -> None:
        """On the loop: a send or table ran on the worker."""
        self._backlog -= 1
        if job.cancelled():
            return
        error = job.exception()
        if error is not None:
            if not queued.done():
                queued.set_exception(error)
            return
        self._known_topics.add(topic)
        self._track(job.result(), charge, result)
        if not queued.done():
            queued.set_result(result)

    def _track(self, record: Future, charge: int | None, result: asyncio.Future | None = None) -> asyncio.Future:
        if result is None:
            result = self._loop.create_future()
        if charge is None:
            self._unsized += 1
        else:
            self._held_bytes += charge
        self._pending[record] = result
        self._unsettled[result] = charge
        record.add_done_callback(self._record_done)
        return result

    def _settle_record(self, record: Future) -> None:
        """On the loop: a record (or table) completed; free its charge and resolve its asyncio Future."""
        result = self._pending.pop(record)
        charge = self._unsettled.pop(result)
        if charge is None:
            self._unsized -= 1
        else:
            self._held_bytes -= charge
        if result.done():
            return  # cancelled by its holder
        error = record.exception()
        if error is None:
            result.set_result(record.result())
        else:
            result.set_exception(error)

    async def _settle(self, futures: list[asyncio.Future], timeout_s: float | None) -> None:
        """Wait until ``futures`` are resolved (their completions are on their way to the loop)."""
        waiting = [f for f in futures if not f.done()]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=timeout_s)
            if late:
                logger.warning("%d records had no reply %ss after the producer stopped", len(late), timeout_s)


def _nothing() -> None:
    """A marker job: once it ran, every job submitted before it has run."""


class _Listener:
    """A rebalance listener called from the worker thread, inside the sync consumer's poll().

    Plain methods run there. Coroutine methods (aiokafka's listeners are
    ``async def``) run on the loop while the worker waits; meanwhile the
    worker runs the calls the listener makes on the consumer (``await
    consumer.commit()`` in ``on_partitions_revoked``, say), which would
    otherwise queue behind the poll that is waiting for the listener. A
    listener must not fetch (getmany(), getone()): it runs inside a poll,
    which would wait for itself.
    """

    def __init__(self, listener, consumer: "Consumer") -> None:
        self._listener = listener
        self._consumer = consumer

    def on_partitions_revoked(self, partitions) -> None:
        self._call("on_partitions_revoked", partitions)

    def on_partitions_assigned(self, partitions) -> None:
        self._call("on_partitions_assigned", partitions)

    def on_partitions_lost(self, partitions) -> None:
        self._call("on_partitions_lost", partitions)

    def _call(self, name: str, partitions) -> None:
        method = getattr(self._listener, name, None)
        if method is None:
            return
        result = method(partitions)
        if inspect.isawaitable(result):
            self._consumer._await_from_worker(result)


async def _await(awaitable):
    return await awaitable


class Consumer:
    """Reads records from coroutines; nothing it does blocks the event loop.

    ``Consumer(bus, *topics, **options)``: the options are those of
    :class:`logbus.Consumer` (group_id, auto_offset_reset, fetch_max_wait_ms,
    ...); with ``topics``, ``start()`` subscribes to them. The sync consumer
    is built by ``await start()``, so option errors are raised there.

    The sync consumer is not thread-safe, so this one confines it to a
    single worker thread of its own and runs every call there, in the order
    the calls were made; the loop only awaits. Hence every method that
    touches it is a coroutine (``await consumer.seek(...)``), except
    ``assignment()``, which returns what the worker last saw. A call whose
    caller stops waiting (cancellation, a timeout) still runs to its end on
    the worker: a poll in progress finishes there, and its records are kept
    here and returned by the next getmany()/getone(). Records kept that way
    are not yet delivered: ``commit()`` and ``position()`` count from the
    first of them, and seeks, ``assign()`` and ``stop()`` put them back.
    The sync consumer is polled only while nothing is kept, so the commits
    it makes itself (auto-commit, before a rebalance) never pass a record
    not yet delivered.

    A rebalance listener's methods (given to ``subscribe()``) may be plain or
    ``async def``; see :class:`_Listener`.

    The worker thread shares the GIL with the loop: poll()'s per-row work
    (building ConsumerRecords for getmany()) holds the loop up for at most
    the interpreter's switch interval (5 ms) at a time; getmany_arrow()
    does little per-row work. Measured in an async Ray actor consuming
    20,000 records/s with getmany() (perf/bench_broker.py's asyncio cases):
    a coroutine ticking every 10 ms in the same loop ran late by 0.7-0.9 ms
    at the median and 6-9 ms at the 99th percentile.
    """

    def __init__(self, bus: Bus, *topics: str, **options: Any) -> None:
        if not isinstance(bus, Bus):
            raise InvalidConfigError(f"bus must be a Bus from logbus.connect(), not {type(bus).__name__}")
        self._bus = bus
        self._topics = topics
        self._options = options
        self._consumer: sync_consumer.Consumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._state = "new"  # -> "started" -> "stopping" -> "stopped"
        self._poll: asyncio.Future | None = None  # the poll running on the worker, if any
        self._poll_arrow = False  # whether it is a poll_arrow()
        self._poll_error: BaseException | None = None  # raised by a poll nobody was waiting for any more
        # Records fetched and not yet delivered (a caller stopped waiting, or getone() took one of
        # many): in the form they were fetched in, only one of the two at a time.
        self._kept: dict[TopicPartition, list[ConsumerRecord]] = {}
        self._kept_table: pa.Table | None = None
        self._assignment: frozenset[TopicPartition] = frozenset()
        # While a coroutine listener runs, the worker waits for it and runs the calls it makes.
        self._inline: queue.SimpleQueue | None = None
        self._inline_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the sync consumer on the worker thread; subscribe to the topics given, if any."""
        if self._state == "started":
            return
        if self._state != "new":
            raise IllegalStateError("the consumer was stopped; create a new one")
        self._loop = asyncio.get_running_loop()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logbus-aio-consumer")
        try:
            self._consumer = await self._loop.run_in_executor(
                self._worker, functools.partial(sync_consumer.Consumer, self._bus, **self._options)
            )
        except BaseException:
            self._worker.shutdown(wait=False)
            raise
        self._state = "started"
        if self._topics:
            try:
                await self.subscribe(self._topics)
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        """Close the sync consumer (committing with auto-commit, leaving the group). Idempotent.

        A poll in progress finishes first (getone() polls in slices of
        GETONE_WAIT_MS; a getmany() waits up to its ``timeout_ms``). Records
        fetched but not delivered are put back first, so the close's
        auto-commit does not pass them.
        """
        if self._state != "started":
            if self._state == "new":
                self._state = "stopped"
            return
        self._state = "stopping"
        try:
            poll = self._poll
            if poll is not None:
                await asyncio.wait([poll])
                self._polled(poll)
            undelivered = self._take_kept_offsets(None)

            def close(consumer: sync_consumer.Consumer) -> None:
                _seek_back(consumer, undelivered)
                consumer.close()

            await self._run(close)
        finally:
            self._state = "stopped"
            self._worker.shutdown(wait=False)

    async def __aenter__(self) -> "Consumer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def __aiter__(self) -> "Consumer":
        return self

    async def __anext__(self) -> ConsumerRecord:
        """The next record; the iteration ends when the consumer is stopped."""
        try:
            return await self.getone()
        except IllegalStateError:
            if self._state != "started":
                raise StopAsyncIteration from None
            raise

    # --- running calls on the worker ------------------------------------------------------------

    def _check_started(self) -> None:
        if self._state != "started":
            raise IllegalStateError("the consumer is not started" if self._state == "new" else "the consumer is stopped")

    def _submit(self, fn: Callable[[sync_consumer.Consumer], Any]) -> asyncio.Future:
        """Run ``fn(sync consumer)`` on the worker thread, after every call submitted before it."""
        consumer = self._consumer

        def job():
            try:
                return fn(consumer)
            finally:
                # Read on the loop by assignment(): rebinding one attribute is atomic.
                self._assignment = frozenset(consumer.assignment())

        with self._inline_lock:
            if self._inline is not None:
                # A coroutine listener is running and the worker waits for it: it runs this call now.
                future: Future = Future()
                self._inline.put((job, future))
                return asyncio.wrap_future(future, loop=self._loop)
        return self._loop.run_in_executor(self._worker, job)

    async def _run(self, fn: Callable[[sync_consumer.Consumer], Any]) -> Any:
        """Run ``fn`` on the worker and wait for it; a caller that stops waiting does not stop it."""
        return await asyncio.shield(self._submit(fn))

    async def _call(self, fn: Callable[[sync_consumer.Consumer], Any]) -> Any:
        self._check_started()
        return await self._run(fn)

    def _await_from_worker(self, awaitable) -> None:
        """On the worker: run ``awaitable`` on the loop and wait, running the consumer calls it makes."""
        inline: queue.SimpleQueue = queue.SimpleQueue()
        with self._inline_lock:
            self._inline = inline
        try:
            done = asyncio.run_coroutine_threadsafe(_await(awaitable), self._loop)
            done.add_done_callback(lambda _: inline.put(None))
            while (item := inline.get()) is not None:
                _run_inline(*item)
        finally:
            with self._inline_lock:
                self._inline = None
            # Calls made after the listener ended but before the switch back: run them now, in order.
            while True:
                try:
                    item = inline.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _run_inline(*item)
        done.result()

    # --- fetching -------------------------------------------------------------------------------

    async def getmany(self, timeout_ms: float = 0, max_records: int | None = None) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Records from the assigned partitions, waiting up to ``timeout_ms`` for some: ``{TopicPartition: [ConsumerRecord]}``."""
        return await self._fetch(False, timeout_ms, max_records, max_records)

    async def getmany_arrow(self, timeout_ms: float = 0, max_records: int | None = None) -> pa.Table:
        """Records as one pyarrow Table, like :meth:`logbus.Consumer.poll_arrow` (no per-row Python work)."""
        return await self._fetch(True, timeout_ms, max_records, max_records)

    async def getone(self) -> ConsumerRecord:
        """The next record, waiting as long as it takes (raises IllegalStateError once the consumer is stopped)."""
        while True:
            for records in (await self._fetch(False, GETONE_WAIT_MS, 1, GETONE_POLL_MAX)).values():
                return records[0]

    async def _fetch(self, arrow: bool, timeout_ms: float, take: int | None, poll_max: int | None):
        """Hand out up to ``take`` kept records, else poll once (up to ``poll_max``) and hand out from that."""
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or not timeout_ms >= 0:
            raise InvalidConfigError(f"timeout_ms must be a non-negative number, not {timeout_ms!r}")
        for name, value in (("max_records", take), ("max_records", poll_max)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise InvalidConfigError(f"{name} must be a positive int or None, not {value!r}")
        own = None
        while True:
            self._check_started()
            if self._poll_error is not None:
                error, self._poll_error = self._poll_error, None
                raise error
            if arrow and self._kept_table is not None:
                return self._take_table(take)
            if not arrow and self._kept:
                return self._take_records(take)
            if self._kept_table is not None or self._kept:
                # Kept in the other form: put them back and fetch them again in this one.
                await self._run(functools.partial(_seek_back, offsets=self._take_kept_offsets(None)))
                continue
            if own is not None:
                return _empty_table() if arrow else {}  # our own poll found nothing
            poll = self._poll
            if poll is None:
                poll = own = self._poll = self._submit(
                    lambda consumer: (consumer.poll_arrow if arrow else consumer.poll)(timeout_ms=timeout_ms, max_records=poll_max)
                )
                self._poll_arrow = arrow
                poll.add_done_callback(self._polled)
            try:
                await asyncio.shield(poll)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (kept by _polled and raised at the top of the loop)
                pass
            # Awaiting a poll that is already done does not yield to the loop, so its done-callback
            # may not have run yet: collect it here (else this loop would spin on it).
            self._polled(poll)

    def _polled(self, poll: asyncio.Future) -> None:
        """On the loop, whether or not anyone still waits: keep the poll's records (or its error). Once per poll."""
        if poll is not self._poll:
            return  # collected already
        self._poll = None
        arrow = self._poll_arrow
        if poll.cancelled():
            return
        error = poll.exception()
        if error is not None:
            self._poll_error = error
            return
        result = poll.result()
        if arrow:
            if result.num_rows:
                self._kept_table = result if self._kept_table is None else pa.concat_tables([self._kept_table, result])
        else:
            for tp, records in result.items():
                if records:
                    self._kept.setdefault(tp, []).extend(records)

    def _take_records(self, count: int | None) -> dict[TopicPartition, list[ConsumerRecord]]:
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        budget = count if count is not None else float("inf")
        for tp in list(self._kept):
            if budget <= 0:
                break
            records = self._kept[tp]
            if len(records) <= budget:
                out[tp] = records
                del self._kept[tp]
            else:
                out[tp], self._kept[tp] = records[: int(budget)], records[int(budget) :]
            budget -= len(out[tp])
        return out

    def _take_table(self, count: int | None) -> pa.Table:
        table = self._kept_table
        if count is None or table.num_rows <= count:
            self._kept_table = None
            return table
        self._kept_table = table.slice(count)
        return table.slice(0, count)

    def _kept_offsets(self) -> dict[TopicPartition, int]:
        """The first offset kept (not yet delivered) of each partition that has some."""
        if self._kept_table is not None:
            firsts = self._kept_table.group_by(["topic", "partition"]).aggregate([("offset", "min")])
            return {
                TopicPartition(topic, partition): offset
                for topic, partition, offset in zip(*(firsts.column(n).to_pylist() for n in ("topic", "partition", "offset_min")))
            }
        return {tp: records[0].offset for tp, records in self._kept.items()}

    def _take_kept_offsets(self, partitions: Iterable[TopicPartition] | None) -> dict[TopicPartition, int]:
        """Forget the kept records of ``partitions`` (None: all); returns where each of them starts."""
        offsets = self._kept_offsets()
        if partitions is None:
            self._kept, self._kept_table = {}, None
            return offsets
        wanted = {TopicPartition(*tp) for tp in partitions}
        offsets = {tp: offset for tp, offset in offsets.items() if tp in wanted}
        if not offsets:
            return {}
        table = self._kept_table
        if table is not None:
            topics, numbers = table.column("topic"), table.column("partition")
            dropped = None
            for tp in offsets:
                rows = pc.and_(pc.equal(topics, tp.topic), pc.equal(numbers, tp.partition))
                dropped = rows if dropped is None else pc.or_(dropped, rows)
            rest = table.filter(pc.invert(dropped))
            self._kept_table = rest if rest.num_rows else None
            return offsets
        for tp in offsets:
            del self._kept[tp]
        return offsets

    # --- assignment, positions, commits ---------------------------------------------------------

    async def subscribe(self, topics: Iterable[str] = (), pattern: str | None = None, listener=None) -> None:
        """Join the consumer group for these topics and/or the ``pattern`` (as :meth:`logbus.Consumer.subscribe`)."""
        topics = list(topics) if topics is not None else []
        wrapped = None if listener is None else _Listener(listener, self)
        await self._call(lambda consumer: consumer.subscribe(topics or None, pattern=pattern, listener=wrapped))

    async def unsubscribe(self) -> None:
        """Give up every partition and leave the group."""
        self._check_started()
        undelivered = self._take_kept_offsets(None)

        def unsubscribe(consumer: sync_consumer.Consumer) -> None:
            _seek_back(consumer, undelivered)  # so the commit on revoke does not pass them
            consumer.unsubscribe()

        await self._run(unsubscribe)

    async def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any previous assignment)."""
        partitions = list(partitions)
        wanted = {TopicPartition(*tp) for tp in partitions if isinstance(tp, tuple) and len(tp) == 2}
        # Records kept for partitions that stay assigned stay kept: their positions carry on.
        await self._run_superseding(lambda consumer: consumer.assign(partitions), lambda: set(self._kept_offsets()) - wanted)

    def assignment(self) -> set[TopicPartition]:
        """The assigned partitions, as of the last call the worker ran."""
        return set(self._assignment)

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Make ``offset`` the next offset returned for ``tp``."""
        await self._run_superseding(lambda consumer: consumer.seek(tp, offset), lambda: [tp])

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their log start."""
        tps = _partitions(partitions)
        await self._run_superseding(lambda consumer: consumer.seek_to_beginning(*tps), lambda: tps or None)

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their high watermark."""
        tps = _partitions(partitions)
        await self._run_superseding(lambda consumer: consumer.seek_to_end(*tps), lambda: tps or None)

    async def _run_superseding(self, fn: Callable[[sync_consumer.Consumer], Any], superseded: Callable[[], Any]) -> None:
        """Run ``fn``; once it succeeded, forget the kept records of the ``superseded()`` partitions (None: all).

        Only on success: a seek that fails leaves the position where it was,
        past the kept records, which must then still be delivered.
        """
        self._check_started()
        future = self._submit(fn)

        def forget(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._take_kept_offsets(superseded())

        future.add_done_callback(forget)
        await asyncio.shield(future)

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record getmany()/getone() returns for ``tp``."""
        self._check_started()
        kept = self._kept_offsets().get(TopicPartition(*tp) if isinstance(tp, tuple) and len(tp) == 2 else tp)
        if kept is not None:
            return kept
        return await self._run(lambda consumer: consumer.position(tp))

    async def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (default: the position of every assigned partition) and wait.

        Errors as :meth:`logbus.Consumer.commit` (CommitFailedError after the group went on without
        this member, ...).
        """
        self._check_started()
        if offsets is not None:
            offsets = dict(offsets)
            await self._run(lambda consumer: consumer.commit(offsets))
            return
        undelivered = self._kept_offsets()

        def commit(consumer: sync_consumer.Consumer) -> None:
            if not undelivered:
                consumer.commit()
                return
            # Partitions with records kept here are committed where those start; the others at their
            # positions, as the sync commit() does (a partition with no position yet, its leader away
            # say, is not waited for).
            positions = consumer._positions()
            positions.update((tp, offset) for tp, offset in undelivered.items() if tp in positions)
            consumer.commit(positions)

        await self._run(commit)

    async def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None where nothing was committed)."""
        partitions = list(partitions)
        return await self._call(lambda consumer: consumer.committed(partitions))

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        partitions = list(partitions)
        return await self._call(lambda consumer: consumer.beginning_offsets(partitions))

    async def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        partitions = list(partitions)
        return await self._call(lambda consumer: consumer.end_offsets(partitions))


def _run_inline(job: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(job())
    except BaseException as error:  # noqa: BLE001 (handed to the awaiting coroutine)
        future.set_exception(error)


def _seek_back(consumer: sync_consumer.Consumer, offsets: dict[TopicPartition, int]) -> None:
    """On the worker: move partitions back to records fetched but not delivered, so they are fetched again."""
    for tp, offset in offsets.items():
        try:
            consumer.seek(tp, offset)
        except IllegalStateError:
            pass  # no longer assigned: its next owner starts from the group's commit


def _empty_table() -> pa.Table:
    return sync_consumer.ARROW_SCHEMA.empty_table()


def _partitions(partitions: tuple) -> list:
    """Partitions given as arguments or as one iterable (the sync consumer's forms), as a list."""
    if len(partitions) == 1 and not (isinstance(partitions[0], tuple) and len(partitions[0]) == 2 and isinstance(partitions[0][0], str)):
        return list(partitions[0]) if partitions[0] is not None else []
    return list(partitions)
