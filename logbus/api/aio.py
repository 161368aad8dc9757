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

from logbus.api import consumer as sync_consumer
from logbus.api import producer as sync_producer
from logbus.api.client import Bus
from logbus.options import INT64_MAX, check_int, check_ms
from logbus.errors import IllegalStateError, InvalidConfigError
from logbus.protocol.group_coordinator import OffsetAndMetadata
from logbus.protocol.messages import ConsumerGroupMetadata, ConsumerRecord, RecordMetadata, TopicPartition

logger = logging.getLogger(__name__)

# pyarrow's first scalar loads its pandas shim (importing pandas, when installed): half a second of
# work that holds the GIL. The sync consumer makes scalars when it is assigned partitions; from its
# worker thread that would stall the event loop for as long. Here it is paid at import instead.
pa.scalar(0)

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

    * on the loop when the sync producer holds the topic's metadata (it
      keeps it once the topic is sent to, for its last TOPICS_MAX topics),
      the record's size is known
      before it is sent (key and value are bytes, str or None and no
      serializer is configured), and the bytes of every record this producer
      has handed over and not seen completed, plus this one, fit
      ``buffer_memory_bytes``. This producer counts what the sync producer
      counts (with the same function, ``record_charge_bytes``), and frees it
      later (when the completion reaches the loop), so the sync producer's
      buffer then has room and ``send()`` cannot wait;
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
        charge = sync_producer.record_charge_bytes(value, key, headers) if self._sizes_known else None
        if (
            charge is not None
            and not self._backlog
            and not self._unsized
            and topic.__class__ is str
            and producer._holds_metadata(topic)
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

    # --- transactions (a producer made with transactional_id=...) ---------------------------------

    async def init_transactions(self, timeout_s: float | None = None) -> None:
        """As :meth:`logbus.Producer.init_transactions`, off the loop."""
        producer = self._running()
        await self._loop.run_in_executor(self._worker, producer.init_transactions, timeout_s)

    async def begin_transaction(self) -> None:
        """As :meth:`logbus.Producer.begin_transaction` (after every send handed to the worker)."""
        producer = self._running()
        await self._loop.run_in_executor(self._worker, producer.begin_transaction)

    async def send_offsets_to_transaction(self, offsets: dict, group_metadata, timeout_s: float | None = None) -> None:
        """As :meth:`logbus.Producer.send_offsets_to_transaction`, off the loop."""
        producer = self._running()
        await self._loop.run_in_executor(self._worker, producer.send_offsets_to_transaction, offsets, group_metadata, timeout_s)

    async def commit_transaction(self, timeout_s: float | None = None) -> None:
        """As :meth:`logbus.Producer.commit_transaction`: on the worker, after every send handed to it,
        so the transaction holds every record whose ``send()`` was awaited before."""
        producer = self._running()
        pending = list(self._unsettled)
        await self._loop.run_in_executor(self._worker, producer.commit_transaction, timeout_s)
        await self._settle(pending, None)

    async def abort_transaction(self, timeout_s: float | None = None) -> None:
        """As :meth:`logbus.Producer.abort_transaction`, on the worker after every send handed to it."""
        producer = self._running()
        pending = list(self._unsettled)
        await self._loop.run_in_executor(self._worker, producer.abort_transaction, timeout_s)
        await self._settle(pending, None)

    async def partitions_for(self, topic: str) -> list[int]:
        """The partition numbers of ``topic`` (fetched once, off the loop)."""
        producer = self._running()
        partitions = await self._loop.run_in_executor(self._worker, producer.partitions_for, topic)
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


class Queued:
    """What the asyncio consumer's plain methods return: the call is made, queued on its worker.

    ``assign()``, ``seek()``, ``pause()``, ``resume()``, ``subscribe()`` and
    ``unsubscribe()`` are plain methods, as aiokafka's are: they check their
    arguments at once (raising InvalidConfigError and the like there), queue
    the call to run on the consumer's worker thread before anything asked of
    the consumer later, and return this. Code written for aiokafka ignores
    it; code written when logbus.aio's were coroutines awaits it (``await
    consumer.seek(tp, 5)``), which waits until the call ran and raises its
    error. An error of a call nobody awaited (``seek()`` of a partition not
    assigned, say) is raised instead by the consumer's next call, or by a
    getmany()/getone() queued after it, which gives its records back: never
    dropped.
    """

    __slots__ = ("_consumer", "_future", "awaited")

    def __init__(self, consumer: "Consumer", future: asyncio.Future) -> None:
        self._consumer = consumer
        self._future = future
        self.awaited = False
        future.add_done_callback(self._ran)

    def done(self) -> bool:
        """Whether the call has run (or failed)."""
        return self._future.done()

    def _ran(self, future: asyncio.Future) -> None:
        error = None if future.cancelled() else future.exception()  # also marks it retrieved for asyncio
        if error is not None and not self.awaited:
            self._consumer._unawaited_failed(self, error)

    def __await__(self):
        self.awaited = True
        self._consumer._claimed(self)
        return (yield from asyncio.shield(self._future).__await__())


class _Fetch:
    """One getmany()/getone()/getmany_arrow() call's work on the worker, and what became of its records.

    ``abandoned`` is set on the loop when the caller stops waiting (it was
    cancelled); the worker reads it before and after the poll. A poll whose
    caller left before it ended gives its records back to the sync consumer
    there and then; one whose caller left just after has them given back by
    a call queued on the worker at once (see Consumer._abandoned).
    """

    __slots__ = ("arrow", "timeout_ms", "take", "convert_max", "abandoned", "handed")

    def __init__(self, arrow: bool, timeout_ms: float, take: int | None, convert_max: int | None) -> None:
        self.arrow = arrow
        self.timeout_ms = timeout_ms
        self.take = take
        self.convert_max = convert_max
        self.abandoned = False  # written on the loop, read on the worker (one attribute: atomic)
        self.handed: tuple | None = None  # (records or Table, resets of their partitions) handed to the caller

    def run(self, consumer: sync_consumer.Consumer):
        if self.abandoned:
            return None  # its caller left before it started
        if self.arrow:
            got = consumer.poll_arrow(timeout_ms=self.timeout_ms, max_records=self.take)
            resets = consumer._resets_of(consumer.assignment()) if got.num_rows else {}
        else:
            got = consumer._hand_out(self.take, self.timeout_ms / 1000, self.convert_max)
            resets = consumer._resets_of(got)
        if self.abandoned:
            _give_back(consumer, got, resets)
            return None
        self.handed = (got, resets)
        return got


def _give_back(consumer: sync_consumer.Consumer, got, resets) -> None:
    """On the worker: return records nobody read to the sync consumer, the one buffer of undelivered records."""
    if isinstance(got, pa.Table):
        consumer._give_back_table(got, resets)
    elif got:
        consumer._give_back(got, resets)


class Consumer:
    """Reads records from coroutines; nothing it does blocks the event loop.

    ``Consumer(bus, *topics, **options)``: the options are those of
    :class:`logbus.Consumer` (group_id, auto_offset_reset, fetch_max_wait_ms,
    ...); with ``topics``, ``start()`` subscribes to them (without a
    group_id: every partition of them, no coordinator, no commits). The sync
    consumer is built by ``await start()``, so option errors are raised
    there.

    The sync consumer is not thread-safe, so this one confines it to a
    single worker thread of its own and runs every call there, in the order
    the calls were made; the loop only awaits. As in aiokafka, ``assign()``,
    ``seek()``, ``pause()``, ``resume()``, ``subscribe()`` and
    ``unsubscribe()`` are plain methods (they queue the call and return a
    :class:`Queued`, which may be awaited), ``assignment()`` and ``paused()``
    answer at once, and the rest are coroutines.

    Records are kept in one place: the sync consumer, whose positions count
    only the records handed out (see ``logbus/api/consumer.py``, "handing
    records out"). ``getone()`` converts a few hundred records at a time
    there and takes one; the next calls take the others on the loop itself
    while the worker is idle (nothing else touches the sync consumer then),
    without a thread hop. A call whose caller stops waiting (cancellation, a
    timeout) still runs to its end on the worker, and its records go back to
    the sync consumer, which hands them out again next; so ``commit()`` and
    ``position()`` never count them. (The one window: a caller cancelled in
    the instant between its poll's end and its own wake-up has its records
    given back by a call queued at once, and a call another coroutine had
    queued before that runs first; a ``commit()`` there counts them.)

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
        # Plain calls made before start(): (the call, the loop Future its Queued waits on), run by start().
        self._before_start: list[tuple[Callable, asyncio.Future]] = []
        self._jobs = 0  # calls submitted to the worker and not yet finished (as the loop sees them)
        self._poll_error: BaseException | None = None  # raised by a poll nobody was waiting for any more
        self._unawaited: tuple[Queued, BaseException] | None = None  # the first failed plain call nobody awaited
        # The assignment and paused partitions as the loop answers them: set at once by the plain calls,
        # and from the worker's own view whenever it has nothing left to run.
        self._assignment: frozenset[TopicPartition] = frozenset()
        self._paused: frozenset[TopicPartition] = frozenset()
        self._worker_view: tuple[frozenset, frozenset] = (frozenset(), frozenset())
        # While a coroutine listener runs, the worker waits for it and runs the calls it makes.
        self._inline: queue.SimpleQueue | None = None
        self._inline_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the sync consumer on the worker thread; subscribe to the topics given, if any, and run
        the plain calls made before (``assign()`` before ``start()``, as aiokafka allows)."""
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
            self._fail_before_start(IllegalStateError("the consumer failed to start"))
            raise
        self._state = "started"
        if self._topics:
            try:
                await self.subscribe(self._topics)
            except BaseException:
                await self.stop()
                raise
        before, self._before_start = self._before_start, []
        for fn, waiter in before:
            self._submit(fn).add_done_callback(functools.partial(_settle_from, waiter))

    def _fail_before_start(self, error: BaseException) -> None:
        before, self._before_start = self._before_start, []
        for _, waiter in before:
            if not waiter.done():
                waiter.set_exception(error)

    async def stop(self) -> None:
        """Close the sync consumer (committing with auto-commit, leaving the group). Idempotent.

        The calls queued before it run first: a poll in progress finishes
        (getone() polls in slices of GETONE_WAIT_MS; a getmany() waits up to
        its ``timeout_ms``), and records nobody read are back in the sync
        consumer, so the close's auto-commit does not pass them.
        """
        if self._state != "started":
            if self._state == "new":
                self._state = "stopped"
                self._fail_before_start(IllegalStateError("the consumer was stopped before it started"))
            return
        self._state = "stopping"
        try:
            await self._run(lambda consumer: consumer.close())
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
        if self._unawaited is not None:
            _, error = self._unawaited
            self._unawaited = None
            raise error

    def _submit(self, fn: Callable[[sync_consumer.Consumer], Any]) -> asyncio.Future:
        """Run ``fn(sync consumer)`` on the worker thread, after every call submitted before it."""
        consumer = self._consumer

        def job():
            try:
                return fn(consumer)
            finally:
                # Taken by the loop once the worker has nothing left to run: rebinding one attribute is atomic.
                self._worker_view = (frozenset(consumer.assignment()), frozenset(consumer.paused()))

        self._jobs += 1
        with self._inline_lock:
            if self._inline is not None:
                # A coroutine listener is running and the worker waits for it: it runs this call now.
                inline: Future = Future()
                self._inline.put((job, inline))
                future = asyncio.wrap_future(inline, loop=self._loop)
            else:
                future = self._loop.run_in_executor(self._worker, job)
        future.add_done_callback(self._job_done)
        return future

    def _job_done(self, _future: asyncio.Future) -> None:
        """On the loop: a call finished. With none left, the worker's view is the truth."""
        self._jobs -= 1
        if not self._jobs:
            self._assignment, self._paused = self._worker_view

    async def _run(self, fn: Callable[[sync_consumer.Consumer], Any]) -> Any:
        """Run ``fn`` on the worker and wait for it; a caller that stops waiting does not stop it."""
        return await asyncio.shield(self._submit(fn))

    async def _call(self, fn: Callable[[sync_consumer.Consumer], Any]) -> Any:
        self._check_started()
        return await self._run(fn)

    def _queue(self, fn: Callable[[sync_consumer.Consumer], Any]) -> Queued:
        """Queue a plain method's call (see :class:`Queued`); before start(), it runs when start() does."""
        if self._state == "new":
            waiter = asyncio.get_running_loop().create_future()
            self._before_start.append((fn, waiter))
            return Queued(self, waiter)
        self._check_started()
        return Queued(self, self._submit(fn))

    def _unawaited_failed(self, queued: Queued, error: BaseException) -> None:
        """A plain call failed and nobody awaits it (yet): the consumer's next call raises its error."""
        if self._unawaited is None:
            self._unawaited = (queued, error)

    def _claimed(self, queued: Queued) -> None:
        """``queued`` is awaited after all: its error goes to the one awaiting it, not to the next call."""
        if self._unawaited is not None and self._unawaited[0] is queued:
            self._unawaited = None

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

    async def _fetch(self, arrow: bool, timeout_ms: float, take: int | None, convert_max: int | None):
        """Hand out up to ``take`` records: on the loop from those the sync consumer converted before,
        if any and the worker is idle; else by a poll on the worker (converting up to ``convert_max``)."""
        check_ms("timeout_ms", timeout_ms, maximum=sync_consumer.POLL_TIMEOUT_MS_MAX)
        check_int("max_records", take, 1, INT64_MAX, none_ok=True)
        self._check_started()
        if self._poll_error is not None:
            error, self._poll_error = self._poll_error, None
            raise error
        if not arrow and not self._jobs and self._consumer._pending:
            handed = self._consumer._take_pending(take)  # the worker is idle: nothing else touches the consumer
            if handed:
                return handed
        fetch = _Fetch(arrow, timeout_ms, take, convert_max)
        future = self._submit(fetch.run)
        try:
            got = await asyncio.shield(future)
        except asyncio.CancelledError:
            fetch.abandoned = True
            future.add_done_callback(functools.partial(self._abandoned, fetch))
            raise
        if self._unawaited is not None and fetch.handed is not None:
            # A plain call queued before this poll failed on the worker and nobody awaits it (its error
            # reached the loop before this poll's records did: the worker runs calls in order). Its error
            # is this call's, and the records go back, to be handed out after the caller dealt with it.
            handed, resets = fetch.handed
            self._submit(lambda consumer: _give_back(consumer, handed, resets))
            self._check_started()
        return got

    def _abandoned(self, fetch: _Fetch, future: asyncio.Future) -> None:
        """On the loop: the poll of a caller that stopped waiting ended. Its error goes to the next
        fetch; its records, if the worker handed them out before it saw the caller leave, go back."""
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            if self._poll_error is None:
                self._poll_error = error
            return
        if fetch.handed is not None and self._state == "started":
            got, resets = fetch.handed
            self._submit(lambda consumer: _give_back(consumer, got, resets))

    # --- assignment, positions, commits ---------------------------------------------------------

    def subscribe(self, topics: Iterable[str] = (), pattern: str | None = None, listener=None) -> Queued:
        """Join the consumer group for these topics and/or the ``pattern`` (as :meth:`logbus.Consumer.subscribe`;
        without a group_id, read every partition of them). A plain method (see :class:`Queued`)."""
        if topics is not None and not isinstance(topics, str | bytes) and isinstance(topics, Iterable):
            topics = list(topics)
        names, pattern = sync_consumer.check_subscription(topics or None, pattern)
        wrapped = None if listener is None else _Listener(listener, self)
        return self._queue(lambda consumer: consumer.subscribe(names, pattern=pattern, listener=wrapped))

    def unsubscribe(self) -> Queued:
        """Give up every partition and leave the group. A plain method (see :class:`Queued`)."""
        queued = self._queue(lambda consumer: consumer.unsubscribe())
        self._assignment = self._paused = frozenset()
        return queued

    def assign(self, partitions: Iterable[TopicPartition]) -> Queued:
        """Read exactly these partitions (replacing any previous assignment). A plain method (see :class:`Queued`)."""
        tps = sync_consumer._check_tps(partitions, "assign()")
        queued = self._queue(lambda consumer: consumer.assign(tps))
        self._assignment = frozenset(tps)
        self._paused = self._paused & self._assignment
        return queued

    def assignment(self) -> set[TopicPartition]:
        """The assigned partitions: as the last plain call set them, or as the worker last saw them."""
        return set(self._assignment)

    def seek(self, tp: TopicPartition, offset: int) -> Queued:
        """Make ``offset`` the next offset returned for ``tp``. A plain method (see :class:`Queued`)."""
        tp = sync_consumer._check_tp(tp)
        sync_consumer.check_seek_offset(offset)
        return self._queue(lambda consumer: consumer.seek(tp, offset))

    def pause(self, *partitions: TopicPartition) -> Queued:
        """Stop fetching from these partitions (as arguments or one list) until resume(). A plain method."""
        tps = sync_consumer._partitions_arg(partitions, "pause()") or []
        queued = self._queue(lambda consumer: consumer.pause(tps))
        self._paused = self._paused | (frozenset(tps) & self._assignment)
        return queued

    def resume(self, *partitions: TopicPartition) -> Queued:
        """Fetch again from these paused partitions (as arguments or one list). A plain method."""
        tps = sync_consumer._partitions_arg(partitions, "resume()") or []
        queued = self._queue(lambda consumer: consumer.resume(tps))
        self._paused = self._paused - frozenset(tps)
        return queued

    def paused(self) -> set[TopicPartition]:
        """The paused partitions: as the last plain call set them, or as the worker last saw them."""
        return set(self._paused)

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their log start."""
        tps = sync_consumer._partitions_arg(partitions, "seek_to_beginning()") or []
        await self._call(lambda consumer: consumer.seek_to_beginning(*tps))

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        """Seek these partitions (as arguments or one list; none: every assigned one) to their high watermark."""
        tps = sync_consumer._partitions_arg(partitions, "seek_to_end()") or []
        await self._call(lambda consumer: consumer.seek_to_end(*tps))

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record getmany()/getone() returns for ``tp``."""
        return await self._call(lambda consumer: consumer.position(tp))

    async def commit(self, offsets: dict[TopicPartition, Any] | None = None) -> None:
        """Commit ``offsets`` (default: the position of every assigned partition) and wait.

        Offsets are ints, OffsetAndMetadata, or aiokafka's ``(offset, metadata)``
        pairs. Errors as :meth:`logbus.Consumer.commit` (CommitFailedError after
        the group went on without this member; IllegalStateError without a
        group_id, ...).
        """
        if isinstance(offsets, dict):
            offsets = {tp: _offset_and_metadata(value) for tp, value in offsets.items()}
        await self._call(lambda consumer: consumer.commit(offsets))

    async def committed(self, partitions) -> Any:
        """The group's committed offset: of one TopicPartition (aiokafka's form), its offset or None; of a
        list of them, a dict of TopicPartition -> offset or None."""
        if not sync_consumer._is_one_partition(partitions) and isinstance(partitions, Iterable):
            partitions = list(partitions)
        return await self._call(lambda consumer: consumer.committed(partitions))

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        partitions = list(partitions)
        return await self._call(lambda consumer: consumer.beginning_offsets(partitions))

    async def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        partitions = list(partitions)
        return await self._call(lambda consumer: consumer.end_offsets(partitions))

    async def group_metadata(self) -> ConsumerGroupMetadata:
        """As :meth:`logbus.Consumer.group_metadata` (for a transactional producer's
        ``send_offsets_to_transaction``)."""
        return await self._call(lambda consumer: consumer.group_metadata())

    async def offsets_for_times(self, timestamps: dict[TopicPartition, int]) -> dict[TopicPartition, Any]:
        """For each partition, the earliest record at or after the given ms: OffsetAndTimestamp, or None."""
        timestamps = dict(timestamps)
        return await self._call(lambda consumer: consumer.offsets_for_times(timestamps))


def _settle_from(waiter: asyncio.Future, future: asyncio.Future) -> None:
    """Give ``waiter`` the outcome of ``future`` (a call made before start(), now run)."""
    if waiter.done():
        return
    if future.cancelled():
        waiter.cancel()
    elif future.exception() is not None:
        waiter.set_exception(future.exception())
    else:
        waiter.set_result(future.result())


def _offset_and_metadata(value):
    """aiokafka's ``(offset, metadata)`` pair as an OffsetAndMetadata; anything else as it is."""
    if isinstance(value, tuple) and not isinstance(value, OffsetAndMetadata) and len(value) == 2:
        return OffsetAndMetadata(*value)
    return value


def _run_inline(job: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(job())
    except BaseException as error:  # noqa: BLE001 (handed to the awaiting coroutine)
        future.set_exception(error)
