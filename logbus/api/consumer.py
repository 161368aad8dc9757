"""Consumer: fetches whole Arrow batches from partition leaders, with fetches kept in flight.

At the log end, each assigned partition keeps two fetches in flight, so one
is always waiting at the leader while the other's reply travels back: records
appended there go out at once instead of waiting for the next fetch to arrive.
A partition that is behind keeps two fetches in flight too while the buffer
and both replies fit ``max_buffered_bytes`` (else one), sent again before its
records are handed out, so the leader's reads overlap this process's decoding
and the caller's work.
The fetches of a partition share a fetch session (an id the leader keys by):
a fetch that was sent while an earlier one was outstanding continues where the
earlier one ended, and the consumer drops whatever it already has, so a
leader that lost the session (a new leader, say) costs only a re-read. A
partition whose leader runs on this node is fetched over the leader's local
channel (a Unix socket, see ``logbus/protocol/local_channel.py``): same
fetch, same session, a tenth of an actor call's latency, and the batches go
from the mapped segment into the socket and from the socket into one buffer
here. From a leader on another node, large results travel as an ObjectRef to
whole batches in Ray's object store, small ones inside the reply. Either way
they are decoded in place with Arrow (no copy, no per-row work) and sliced to
the consumer's position.

``poll()`` turns records into ConsumerRecord tuples (per-row Python, as any
poll API must); ``poll_arrow()`` returns one pyarrow Table and does no per-row
Python work.

Group management: with a ``group_id``, ``subscribe()`` lets the group
coordinator (in the controller) assign partitions across the group's members;
positions start from the group's committed offsets (or ``auto_offset_reset``);
``commit()`` stores positions durably. Rebalance listeners and auto-commit run
inside ``poll()``, on the caller's thread.

Not thread-safe (like Kafka's consumer): use one consumer per thread.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import time
from collections import deque
from concurrent.futures import Future
from typing import Iterable

import numpy as np
import pyarrow as pa
import ray

from logbus.actors.remote import get
from logbus.api.client import Bus
from logbus.actors.channel_client import channels as local_channels
from logbus.actors.fetcher import send_fetch, wait_reply
from logbus.errors import (
    ChannelReplyTooLargeError,
    IllegalStateError,
    InvalidConfigError,
    InvalidGroupIdError,
    LeaderNotAvailableError,
    LogbusError,
    OffsetOutOfRangeError,
    UnknownTopicError,
)
from logbus.protocol.messages import FETCH_INLINE_MAX_BYTES, ConsumerRecord, FetchRequest, TopicPartition
from logbus.storage import record_batch as rb
from logbus.storage.names import validate_partition, validate_topic_name

OFFSET_RESETS = ("earliest", "latest", "none")
STALE_FETCH_GRACE_S = 1.5  # past its long poll, a fetch this late makes the consumer check for a new leader
FETCHES_IN_FLIGHT = 2  # per partition at the log end: one waits at the leader while the other's reply travels
ARROW_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.int64()),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", rb.HEADERS_TYPE),
    ]
)


class _Partition:
    """Fetch state of one assigned partition."""

    __slots__ = (
        "tp", "position", "fetch_offset", "paused", "in_flight", "buffer", "buffered_rows", "error", "at_end", "session",
        "arrow_scalars", "actor_fetch_until",
    )

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.position: int | None = None  # next offset to hand to the caller
        self.fetch_offset: int | None = None  # next offset to fetch
        self.paused = False
        # Outstanding fetches, oldest first: (ObjectRef, or a local channel's Future; requested offset,
        # sent at, leader actor id, session).
        self.in_flight: deque[tuple] = deque()
        self.session = _new_session()  # replies to fetches of an older session are dropped
        self.buffer: deque[tuple[int, pa.RecordBatch]] = deque()  # (offset of row 0, records)
        self.buffered_rows = 0
        self.error: LogbusError | None = None
        self.at_end = False  # the last fetch was small (came inline): we are at the log end
        self.actor_fetch_until = 0  # below this offset, fetch with actor calls (a batch too large for the channel)
        self.arrow_scalars = (pa.scalar(tp.topic, pa.string()), pa.scalar(tp.partition, pa.int32()))  # for poll_arrow

    def reset_to(self, offset: int) -> None:
        self.position = self.fetch_offset = offset
        self.buffer.clear()
        self.buffered_rows = 0
        self.error = None
        self.drop_fetches()

    def drop_fetches(self) -> None:
        """Forget the outstanding fetches and start a new fetch session (the next fetch reads from fetch_offset)."""
        self.in_flight.clear()
        self.session = _new_session()
        self.at_end = False


def _wait_any(pending: list, timeout_s: float) -> list:
    """The outstanding fetches (ObjectRefs and local channel Futures) done within ``timeout_s``, waiting for one."""
    futures = [p for p in pending if isinstance(p, Future)]
    if not futures:
        return ray.wait(pending, num_returns=1, timeout=timeout_s)[0]
    done = [f for f in futures if f.done()]
    refs = [p for p in pending if not isinstance(p, Future)]
    if done:
        return done + (ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else [])
    if not refs:
        return list(concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)[0])
    # Both kinds: wait on the ObjectRefs through Futures of their own.
    as_futures = {ref.future(): ref for ref in refs}
    finished, _ = concurrent.futures.wait(
        futures + list(as_futures), timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
    )
    return [as_futures.get(f, f) for f in finished]


def _done_now(pending: list) -> list:
    """Those of the outstanding fetches that are done already (no waiting)."""
    done = [p for p in pending if isinstance(p, Future) and p.done()]
    refs = [p for p in pending if not isinstance(p, Future)]
    if refs:
        done += ray.wait(refs, num_returns=len(refs), timeout=0)[0]
    return done


def _new_session() -> int:
    return random.getrandbits(62)


def _check_tp(tp) -> TopicPartition:
    if not isinstance(tp, tuple) or len(tp) != 2:
        raise InvalidConfigError(f"expected a TopicPartition(topic, partition), not {tp!r}")
    return TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))


class Consumer:
    """Reads records from assigned partitions.

    Args:
        bus: from :func:`logbus.connect`.
        group_id: the consumer group (used for committed offsets by group consumers).
        auto_offset_reset: where to start without a valid position: "earliest",
            "latest", or "none" (raise OffsetOutOfRangeError).
        fetch_max_bytes: bytes one fetch may return per partition (whole batches; at least one).
        fetch_max_wait_ms: how long a replica holds a fetch open waiting for new data.
        max_buffered_bytes: per partition, stop prefetching while this much is buffered.
        check_crcs: verify each batch's CRC32C when decoding (cheap; hardware CRC).
        session_timeout_ms: a member silent this long is removed from the group.
        heartbeat_interval_ms: how often the background thread heartbeats (a third of the session timeout, say).
        max_poll_interval_ms: a member that does not poll() this often is removed from the group.
        enable_auto_commit: commit positions every ``auto_commit_interval_ms`` from poll(), and before
            partitions are revoked and on close().
        partition_assignment_strategy: strategy names, preferred first: "range", "roundrobin",
            "cooperative-sticky" (cooperative only if every listed strategy is).
        group_instance_id: makes this member static: restarting within the session timeout gets
            its partitions back with no rebalance.
        local_channel: fetch from a leader on this node over its local channel (a Unix socket;
            a tenth of an actor call's latency, and no copy into the object store) rather than
            with actor calls.
    """

    def __init__(
        self,
        bus: Bus,
        group_id: str | None = None,
        auto_offset_reset: str = "earliest",
        fetch_max_bytes: int = 8 << 20,
        fetch_max_wait_ms: int = 500,
        max_buffered_bytes: int = 32 << 20,
        check_crcs: bool = True,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5_000,
        partition_assignment_strategy: tuple[str, ...] | list[str] | str = ("range",),
        group_instance_id: str | None = None,
        client_id: str = "logbus-consumer",
        local_channel: bool = True,
    ) -> None:
        if auto_offset_reset not in OFFSET_RESETS:
            raise InvalidConfigError(f"auto_offset_reset must be one of {OFFSET_RESETS}, not {auto_offset_reset!r}")
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise InvalidGroupIdError(f"group_id must be a non-empty str or None, not {group_id!r}")
        self._bus = bus
        self.group_id = group_id
        self.auto_offset_reset = auto_offset_reset
        self.fetch_max_bytes = int(fetch_max_bytes)
        self.fetch_max_wait_ms = int(fetch_max_wait_ms)
        self.max_buffered_bytes = int(max_buffered_bytes)
        self.check_crcs = check_crcs
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._channels = local_channels() if local_channel else None
        self._closed = False
        if isinstance(partition_assignment_strategy, str):
            partition_assignment_strategy = (partition_assignment_strategy,)
        for name, value in (
            ("session_timeout_ms", session_timeout_ms), ("heartbeat_interval_ms", heartbeat_interval_ms),
            ("max_poll_interval_ms", max_poll_interval_ms), ("auto_commit_interval_ms", auto_commit_interval_ms),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfigError(f"{name} must be a positive int, not {value!r}")
        if heartbeat_interval_ms >= session_timeout_ms:
            raise InvalidConfigError("heartbeat_interval_ms must be lower than session_timeout_ms")
        if group_instance_id is not None and group_id is None:
            raise InvalidConfigError("group_instance_id needs a group_id")
        self._group_options = dict(
            group_instance_id=group_instance_id,
            client_id=client_id,
            protocols=tuple(partition_assignment_strategy),
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            max_poll_interval_ms=max_poll_interval_ms,
        )
        from logbus.protocol.assignors import get_assignor

        for name in partition_assignment_strategy:
            get_assignor(name)
        self.enable_auto_commit = bool(enable_auto_commit) and group_id is not None
        self.auto_commit_interval_s = auto_commit_interval_ms / 1000
        self._last_auto_commit_s = time.monotonic()
        self._membership = None  # GroupMembership once subscribe() is called
        self._listener = None
        self._subscribed = False

    # --- assignment and positions ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise IllegalStateError("the consumer is closed")

    def _leader(self, tp: TopicPartition, refresh: bool = False):
        metadata = self._bus.topic_metadata(tp.topic, refresh=refresh)
        if tp.partition >= metadata.partition_count:
            raise UnknownTopicError(f"topic {tp.topic!r} has partitions 0..{metadata.partition_count - 1}, not {tp.partition}")
        leader = metadata.leaders[tp.partition]
        if leader is None:
            self._bus.forget(tp.topic)
            raise LeaderNotAvailableError(f"{tp} has no leader right now (an election is in progress)")
        return leader

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any previous assignment)."""
        self._check_open()
        if self._subscribed:
            raise IllegalStateError("assign() cannot be mixed with subscribe(); call unsubscribe() first")
        wanted = [_check_tp(tp) for tp in partitions]
        for tp in wanted:
            try:
                self._leader(tp)  # unknown topics and partitions fail here, before anything changes
            except LeaderNotAvailableError:
                pass  # it exists; its leader is being elected
        self._partitions = {tp: self._partitions.get(tp) or _Partition(tp) for tp in wanted}

    def assignment(self) -> set[TopicPartition]:
        return set(self._partitions)

    def _state(self, tp) -> _Partition:
        tp = _check_tp(tp)
        try:
            return self._partitions[tp]
        except KeyError:
            raise IllegalStateError(f"{tp} is not assigned to this consumer") from None

    def _offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int, int]]:
        refs = {tp: self._leader(tp).offsets.remote() for tp in tps}
        return {tp: get(ref) for tp, ref in refs.items()}

    def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The log start offset of each partition."""
        self._check_open()
        return {tp: found[0] for tp, found in self._offsets([_check_tp(tp) for tp in partitions]).items()}

    def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The high watermark (the offset after the last committed record) of each partition."""
        self._check_open()
        return {tp: found[1] for tp, found in self._offsets([_check_tp(tp) for tp in partitions]).items()}

    def offsets_for_times(self, timestamps: dict[TopicPartition, int]) -> dict[TopicPartition, int | None]:
        """For each partition, the earliest offset whose timestamp is >= the given ms, or None."""
        self._check_open()
        refs = {_check_tp(tp): self._leader(_check_tp(tp)).offset_for_timestamp.remote(int(ts)) for tp, ts in timestamps.items()}
        return {tp: (None if (offset := get(ref)) < 0 else offset) for tp, ref in refs.items()}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Make ``offset`` the next offset poll() returns for ``tp``."""
        self._check_open()
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise OffsetOutOfRangeError(f"offset must be a non-negative int, not {offset!r}")
        self._state(tp).reset_to(offset)

    def seek_to_beginning(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        self._check_open()
        tps = list(self._partitions) if partitions is None else [_check_tp(tp) for tp in partitions]
        for tp, offset in self.beginning_offsets(tps).items():
            self._state(tp).reset_to(offset)

    def seek_to_end(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        self._check_open()
        tps = list(self._partitions) if partitions is None else [_check_tp(tp) for tp in partitions]
        for tp, offset in self.end_offsets(tps).items():
            self._state(tp).reset_to(offset)

    def position(self, tp: TopicPartition) -> int:
        """The offset the next record returned for ``tp`` will have."""
        self._check_open()
        state = self._state(tp)
        if state.position is None:
            self._reset_positions([state])
        return state.position

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        """Stop fetching from these partitions until resume()."""
        for tp in partitions:
            self._state(tp).paused = True

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._state(tp).paused = False

    def paused(self) -> set[TopicPartition]:
        return {tp for tp, state in self._partitions.items() if state.paused}

    def _reset_positions(self, states: list[_Partition]) -> None:
        if not states:
            return
        if self.auto_offset_reset == "none":
            raise OffsetOutOfRangeError(
                f"no position for {[s.tp for s in states]} and auto_offset_reset='none'; seek() first"
            )
        found = self._offsets([s.tp for s in states])
        for state in states:
            start, high_watermark, _ = found[state.tp]
            state.reset_to(start if self.auto_offset_reset == "earliest" else high_watermark)

    # --- fetching ------------------------------------------------------------------------------------

    def _send_fetches(self) -> None:
        for state in self._partitions.values():
            if state.paused or state.error is not None:
                continue
            if len(state.in_flight) >= FETCHES_IN_FLIGHT:
                continue
            if state.buffered_rows and state.at_end and state.in_flight:
                # At the log end with a fetch already waiting at the leader: the records in
                # hand go to the caller first (sending a fetch costs a fraction of a ms).
                continue
            buffered = sum(r.nbytes for _, r in state.buffer) if state.buffered_rows else 0
            if state.at_end:
                full = bool(buffered) and buffered >= self.max_buffered_bytes  # replies at the log end are small
            else:
                # Behind the log end, replies are up to fetch_max_bytes each: a second fetch goes
                # out (so the leader reads the next bytes while this process decodes the last
                # ones) only while the buffer and every reply on its way fit max_buffered_bytes.
                on_the_way = (len(state.in_flight) + 1) * self.fetch_max_bytes
                full = bool(state.in_flight or buffered) and buffered + on_the_way > self.max_buffered_bytes
            if full:
                continue
            try:
                leader = self._leader(state.tp)
            except LogbusError as error:
                if not error.retriable:
                    state.error = error
                continue  # retriable (no leader yet): the next round asks again
            # The replica skips its CRC check when we check every batch ourselves, and sends
            # small results inside its reply (one round trip instead of two).
            request = FetchRequest(
                state.fetch_offset, self.fetch_max_bytes, self.fetch_max_wait_ms, not self.check_crcs,
                FETCH_INLINE_MAX_BYTES, state.session,
            )
            channels = self._channels if state.fetch_offset >= state.actor_fetch_until else None
            ref = send_fetch(leader, request, channels)
            state.in_flight.append((ref, state.fetch_offset, time.monotonic(), leader._actor_id, state.session))

    def _drop_stale_fetches(self) -> None:
        """Give up on fetches that outlived their long poll and whose leader has since been replaced.

        A fetch sent to a replica whose node died may never be answered.
        """
        now = time.monotonic()
        patience_s = self.fetch_max_wait_ms / 1000 + STALE_FETCH_GRACE_S
        stale = [s for s in self._partitions.values() if s.in_flight and now - s.in_flight[0][2] > patience_s]
        for topic in {s.tp.topic for s in stale}:
            self._bus.forget(topic)
        for state in stale:
            try:
                leader = self._leader(state.tp)
            except LogbusError:
                leader = None
            if leader is None or leader._actor_id != state.in_flight[0][3]:
                state.drop_fetches()

    def _receive(self, state: _Partition, fetch: tuple) -> None:
        """Take the reply to one of the partition's outstanding fetches.

        Replies may come back in any order (Ray may even start a caller's calls
        out of order); each says which offsets it holds, and the consumer takes
        what continues its position and drops what it already has.
        """
        try:
            state.in_flight.remove(fetch)
        except ValueError:
            return  # dropped meanwhile (a seek, or a reset by another reply of this round)
        ref, requested, _, _, session = fetch
        try:
            meta, data, large = wait_reply(ref)
        except ChannelReplyTooLargeError as error:
            state.actor_fetch_until = max(state.actor_fetch_until, error.end_offset)
            return
        except OffsetOutOfRangeError:
            if session != state.session:
                return  # a seek happened meanwhile
            if self.auto_offset_reset == "none":
                state.error = OffsetOutOfRangeError(f"offset {requested} is out of range for {state.tp}")
                return
            self._reset_positions([state])
            return
        except LogbusError as error:
            if error.retriable:
                self._bus.forget(state.tp.topic)  # the next fetch asks for fresh metadata
                return
            state.error = error
            return
        if session != state.session:
            return  # a seek happened meanwhile
        state.at_end = not large
        if data is None or meta.next_offset <= state.fetch_offset:
            return  # the long poll expired empty, or an earlier fetch already brought these records
        if meta.first_offset > state.fetch_offset:
            # Records between our position and this reply went to a reply we dropped (or one
            # that is still on its way): start a new session, which reads from fetch_offset again.
            state.drop_fetches()
            return
        for _, first, records in rb.slice_batches(data, state.fetch_offset, verify_crc=self.check_crcs):
            state.buffer.append((first, records))
            state.buffered_rows += records.num_rows
        state.fetch_offset = meta.next_offset

    def _pump(self, timeout_s: float) -> None:
        """Send fetches, and wait up to ``timeout_s`` for at least one partition to have records."""
        deadline = time.monotonic() + timeout_s
        if self._subscribed and self._membership is not None:
            self._membership.polled()
            if not self._maintain_group(deadline):
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    time.sleep(min(remaining, 0.05))
                return
        self._maybe_auto_commit()
        while True:
            try:
                self._reset_positions([s for s in self._partitions.values() if s.position is None])
            except LogbusError as error:
                if not error.retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            self._send_fetches()
            self._raise_errors()
            if any(s.buffered_rows and not s.paused for s in self._partitions.values()):
                return
            remaining = deadline - time.monotonic()
            self._drop_stale_fetches()
            in_flight = {f[0]: (s, f) for s in self._partitions.values() for f in s.in_flight}
            if not in_flight:
                if remaining > 0:
                    time.sleep(min(remaining, 0.05))
                    continue
                return
            membership = self._membership if self._subscribed else None
            if membership is not None and (membership.needs_join or membership.revoke_requested or membership.lost):
                # The group is rebalancing: take part now, within this poll().
                if not self._maintain_group(deadline):
                    return
                continue
            # A group member waits in short slices, so a rebalance reaches it within ~0.1 s.
            slice_s = 0.1 if membership is not None else 0.5
            ready = _wait_any(list(in_flight), max(0.0, min(remaining, slice_s)))
            for ref in ready:
                self._receive(*in_flight[ref])
            # Collect the replies of other partitions that are already done, without waiting (a
            # partition with records in hand, e.g. the one just received, need not be asked: each
            # ray.wait costs a fraction of a ms).
            others = [r for r, (state, _) in in_flight.items() if r not in ready and not state.buffered_rows]
            if others:
                for ref in _done_now(others):
                    self._receive(*in_flight[ref])
            self._send_fetches()  # prefetch before handing records out
            if remaining <= 0 and not ready:
                return

    def _raise_errors(self) -> None:
        for state in self._partitions.values():
            if state.error is not None:
                error, state.error = state.error, None
                raise error

    def _take(self, max_records: int | None) -> list[tuple[_Partition, int, pa.RecordBatch]]:
        """Pop up to ``max_records`` buffered records across partitions, advancing positions."""
        taken = []
        budget = max_records if max_records is not None else float("inf")
        for state in self._partitions.values():
            while state.buffer and budget > 0 and not state.paused:
                first, records = state.buffer[0]
                if records.num_rows > budget:
                    count = int(budget)
                    state.buffer[0] = (first + count, records.slice(count))
                    records = records.slice(0, count)
                else:
                    state.buffer.popleft()
                state.buffered_rows -= records.num_rows
                budget -= records.num_rows
                state.position = first + records.num_rows
                taken.append((state, first, records))
        return taken

    def poll(self, timeout_ms: float = 0, max_records: int | None = 500) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Records from assigned partitions, waiting up to ``timeout_ms`` for some to arrive."""
        self._check_open()
        self._pump(timeout_ms / 1000)
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        for state, first, records in self._take(max_records):
            topic, partition = state.tp
            count = records.num_rows
            rows = zip(
                [topic] * count,
                [partition] * count,
                range(first, first + count),
                records.column(2).to_pylist(),
                records.column(0).to_pylist(),
                records.column(1).to_pylist(),
                records.column(3).to_pylist(),
            )
            out.setdefault(state.tp, []).extend(map(ConsumerRecord._make, rows))
        return out

    def poll_arrow(self, timeout_ms: float = 0, max_records: int | None = None) -> pa.Table:
        """Buffered records as one pyarrow Table (topic, partition, offset, timestamp, key, value, headers).

        No per-row Python work: the Table's columns point at the fetched
        batches, plus three computed columns.
        """
        self._check_open()
        self._pump(timeout_ms / 1000)
        batches = []
        for state, first, records in self._take(max_records):
            count = records.num_rows
            topic, partition = state.arrow_scalars
            key, value, timestamp, headers = records.columns
            batches.append(
                pa.RecordBatch.from_arrays(
                    [
                        pa.repeat(topic, count),
                        pa.repeat(partition, count),
                        pa.array(np.arange(first, first + count, dtype=np.int64)),
                        timestamp,
                        key,
                        value,
                        headers,
                    ],
                    schema=ARROW_SCHEMA,
                )
            )
        return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)

    # --- consumer groups -----------------------------------------------------------------------------

    def subscribe(self, topics: Iterable[str] | None = None, pattern: str | None = None, listener=None) -> None:
        """Join the consumer group and let its coordinator assign partitions of these topics.

        ``topics`` (names) and/or ``pattern`` (a regular expression topic names
        must match in full; new matching topics join the subscription).
        ``listener`` may define ``on_partitions_revoked(partitions)``,
        ``on_partitions_assigned(partitions)`` and ``on_partitions_lost(partitions)``;
        they are called from poll().
        """
        self._check_open()
        if self.group_id is None:
            raise InvalidGroupIdError("subscribe() needs a group_id")
        if topics is None and pattern is None:
            raise InvalidConfigError("subscribe() needs topics or a pattern")
        names = tuple(validate_topic_name(t) for t in (topics or ()))
        if pattern is not None:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as error:
                raise InvalidConfigError(f"invalid topic pattern {pattern!r}: {error}") from None
        if not self._subscribed and self._partitions:
            raise IllegalStateError("subscribe() cannot be mixed with assign(); call unsubscribe() first")
        if self._membership is None:
            from logbus.api.group_membership import GroupMembership

            self._membership = GroupMembership(self._bus, self.group_id, **self._group_options)
        self._listener = listener
        self._subscribed = True
        self._membership.subscribe(names, pattern)

    def unsubscribe(self) -> None:
        """Give up every partition and leave the group."""
        self._check_open()
        if self._membership is not None:
            self._revoke(list(self._partitions), commit=True)
            self._membership.leave()
            self._membership = None
        self._subscribed = False
        self._partitions = {}

    def _call_listener(self, name: str, partitions) -> None:
        callback = getattr(self._listener, name, None)
        if callback is not None and partitions:
            callback(sorted(partitions))

    def _revoke(self, partitions, commit: bool) -> None:
        """Give up partitions: commit their positions (auto-commit), tell the listener, forget them."""
        partitions = [tp for tp in partitions if tp in self._partitions]
        if not partitions:
            return
        if commit and self.enable_auto_commit:
            try:
                self._commit_positions(partitions)
            except LogbusError:
                pass  # the next owner starts from the last successful commit: at least once
        self._call_listener("on_partitions_revoked", partitions)
        for tp in partitions:
            self._partitions.pop(tp, None)

    def _maintain_group(self, deadline: float) -> bool:
        """Act on what the coordinator said; join if needed. False while this member may not fetch."""
        membership = self._membership
        if membership.lost:
            membership.lost = False
            lost = list(self._partitions)
            self._partitions = {}
            self._call_listener("on_partitions_lost", lost)
        if not membership.coordinator_ok:
            return False  # stop fetching until the coordinator answers again
        if membership.revoke_requested:
            revoke, membership.revoke_requested = membership.revoke_requested, ()
            self._revoke(revoke, commit=True)
            membership.needs_join = True
        while membership.needs_join:
            if not membership.cooperative:
                self._revoke(list(self._partitions), commit=True)
            result = membership.join(tuple(self._partitions), deadline)
            if result is None:
                return False
            assigned = set(result.assignment)
            self._revoke([tp for tp in self._partitions if tp not in assigned], commit=True)
            added = [tp for tp in result.assignment if tp not in self._partitions]
            for tp in added:
                self._partitions[tp] = _Partition(tp)
            self._start_from_committed(added)
            self._call_listener("on_partitions_assigned", added)
            if result.revoke:
                membership.needs_join = True
        return True

    def _start_from_committed(self, partitions: list[TopicPartition]) -> None:
        if not partitions:
            return
        committed = self._membership.committed(partitions)
        for tp in partitions:
            found = committed.get(tp)
            if found is not None:
                self._partitions[tp].reset_to(found.offset)

    def _positions(self, partitions=None) -> dict[TopicPartition, int]:
        tps = self._partitions if partitions is None else partitions
        return {tp: self._partitions[tp].position for tp in tps if tp in self._partitions and self._partitions[tp].position is not None}

    def _committer(self):
        if self.group_id is None:
            raise InvalidGroupIdError("committing offsets needs a group_id")
        if self._membership is None:
            from logbus.api.group_membership import GroupMembership

            # A consumer with manual assignment commits as a non-member (generation -1).
            self._membership = GroupMembership(self._bus, self.group_id, **self._group_options)
            self._membership.stop()
        return self._membership

    def _commit_positions(self, partitions=None) -> None:
        offsets = self._positions(partitions)
        if offsets:
            self._committer().commit(offsets)

    def _maybe_auto_commit(self) -> None:
        if not self.enable_auto_commit or time.monotonic() - self._last_auto_commit_s < self.auto_commit_interval_s:
            return
        self._last_auto_commit_s = time.monotonic()
        offsets = self._positions()
        if offsets:
            self._committer().commit_async(offsets)

    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (default: the current positions of every assigned partition) and wait.

        Raises IllegalGenerationError / UnknownMemberIdError if this member's
        generation is stale (a rebalance happened): poll() again to rejoin.
        """
        self._check_open()
        if offsets is None:
            offsets = self._positions()
        offsets = {_check_tp(tp): int(o) for tp, o in offsets.items()}
        if offsets:
            self._committer().commit(offsets)

    def commit_async(self, offsets: dict[TopicPartition, int] | None = None, callback=None) -> None:
        """Commit without waiting; ``callback(offsets, error_or_None)`` runs when it is done."""
        self._check_open()
        if offsets is None:
            offsets = self._positions()
        offsets = {_check_tp(tp): int(o) for tp, o in offsets.items()}
        if offsets:
            self._committer().commit_async(offsets, callback)

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None where nothing was committed)."""
        self._check_open()
        found = self._committer().committed([_check_tp(tp) for tp in partitions])
        return {tp: (None if om is None else om.offset) for tp, om in found.items()}

    def close(self) -> None:
        """Commit (with auto-commit), leave the group, stop fetching. Later calls raise IllegalStateError."""
        if self._closed:
            return
        if self._membership is not None:
            if self._subscribed and self.enable_auto_commit:
                try:
                    self._commit_positions()
                except LogbusError:
                    pass
            self._membership.leave()
            self._membership = None
        self._closed = True
        self._partitions = {}

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
