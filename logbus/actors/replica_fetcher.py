"""A follower's fetch loop: the calls to its leader, one at a time, and what it does with the answers.

Kafka's fetcher thread, one loop per follower replica and leader epoch. The
decisions are the replication state's (``protocol/replica_state.py``): it
says what to ask next (where our latest epoch ends in the leader's log, or a
fetch from our log end) and what each answer means (truncate, append,
start the log at the leader's log start, adopt its high watermark). This
module makes the calls and carries the answers back:

- fetches go over the fetch link to the leader (``fetch_link.py``: TCP,
  no Ray call) once it is open, and as actor calls until then, while it is
  being opened again after a failure, and for a batch larger than a link's
  reply;
- a fetch has a deadline of its own, its wait plus FOLLOWER_FETCH_SLACK_MS:
  one sent into a cut network (or on a connection that died) would
  otherwise wait until the transport gives up, many seconds; the other calls
  (epoch ends, offsets) have FOLLOWER_CALL_TIMEOUT_S;
- a failed call is logged once per kind of error and retried after
  RETRY_PAUSE_S, with the short wait the state asks for while failing;
- a reply's batches are appended unchanged (fetched from the object store
  when they came as an ObjectRef), then, with a throttle (a reassignment's
  copy rate), the loop waits until the bytes copied are within the rate.

The loop ends when the state says so (the role or epoch changed) or when
``stop()`` cancels it. A broken invariant met on the way (an append's
post-condition, a rule of the replication state) never reaches the loop's
``except`` clauses to be retried: it ends the replica's process where it is
found (``invariant_exit.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray

from logbus.actors.fetch_link import LinkSlot
from logbus.errors import ChannelReplyTooLargeError, FetchLinkClosedError, LogbusError, OffsetOutOfRangeError, RequestTimedOutError
from logbus.protocol.messages import READ_UNCOMMITTED
from logbus.protocol.replica_state import AskEpochEnd, ReplicaState
from logbus.storage.partition_log import PartitionLog

logger = logging.getLogger(__name__)

# A follower's fetch ends by its own deadline: its wait plus this slack. One sent into a cut network
# (or on a connection that died) would otherwise wait until the transport gives up, many seconds.
FOLLOWER_FETCH_SLACK_MS = 1_000
FOLLOWER_CALL_TIMEOUT_S = 5.0  # a follower's other calls to its leader (epoch ends, offsets)
RETRY_PAUSE_S = 0.1  # after a failed call, before the next


class ReplicaFetcher:
    """The fetch loop of one follower replica (see the module docstring).

    ``run(actions)`` carries out the state's actions; ``look_at_fence()``
    reads the fence file (a newer epoch there: a role change we may have
    missed); ``appended()`` is told after each append (a rolled segment may
    make a cleaning due, and so may a transaction marker: it is given the
    log's first unstable offset from before the append); nothing is fetched
    once ``active()`` says False.
    """

    def __init__(
        self,
        state: ReplicaState,
        log: PartitionLog,
        label: str,
        run: Callable[[list], None],
        look_at_fence: Callable[[], None],
        appended: Callable[[int | None], None],
        active: Callable[[], bool],
    ) -> None:
        self.state = state
        self.log = log
        self._label = label
        self._run = run
        self._look_at_fence = look_at_fence
        self._appended = appended
        self._active = active
        self.throttle_bytes_per_s: int | None = None  # a reassignment's copy rate limit
        self.throttled_copy_bytes = 0  # copied from the leader under a throttle, since this process started
        self.fetched_bytes = 0  # appended from leaders' fetch replies, since this process started
        self.linked_fetches = 0  # fetches answered over a fetch link, since this process started
        self._throttle_until = 0.0
        self._task: asyncio.Task | None = None

    def start(self, epoch: int, leader) -> None:
        """Follow ``leader`` (an actor handle) at ``epoch``, in place of any loop running."""
        self.stop()
        self._task = asyncio.get_running_loop().create_task(self._follow(epoch, leader))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _follow(self, epoch: int, leader) -> None:
        link = LinkSlot(lambda: asyncio.wait_for(leader.fetch_link_address.remote(), FOLLOWER_CALL_TIMEOUT_S), self._label)
        try:
            await self._follow_with(epoch, leader, link)
        finally:
            link.close()

    async def _fetch(self, leader, link: LinkSlot, epoch: int, step) -> tuple:
        """One fetch from the leader, within its deadline: over the fetch link when it is open, else (or
        when the link fails) as an actor call in the time left."""
        replica_id = self.state.replica_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (step.max_wait_ms + FOLLOWER_FETCH_SLACK_MS) / 1000
        connection = link.ready()
        try:
            if connection is not None:
                try:
                    reply = await asyncio.wait_for(connection.fetch(replica_id, epoch, step), deadline - loop.time())
                    self.linked_fetches += 1
                    return reply
                except FetchLinkClosedError as error:
                    link.failed(error)  # nothing answered: this fetch goes as an actor call
                except ChannelReplyTooLargeError:
                    pass  # a batch larger than a link's reply: this fetch goes as an actor call
                except LogbusError:
                    raise  # the leader's answer, as the actor call would have raised it
                except asyncio.TimeoutError:
                    link.failed(RequestTimedOutError("a fetch passed its deadline"))  # a reply may still come: out of step
                    raise
            return await asyncio.wait_for(leader.replica_fetch.remote(replica_id, epoch, step), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise RequestTimedOutError(
                f"fetch from the leader not answered within its wait ({step.max_wait_ms} ms) and {FOLLOWER_FETCH_SLACK_MS} ms"
            ) from None

    async def _follow_with(self, epoch: int, leader, link: LinkSlot) -> None:
        last_error = None
        state = self.state
        while self._active():
            self._look_at_fence()
            step = state.next_fetch(epoch, self.log, self.throttle_bytes_per_s)
            if step is None:
                return  # the role or epoch changed
            try:
                if isinstance(step, AskEpochEnd):
                    leader_epoch, end_offset = await asyncio.wait_for(
                        leader.end_offset_for_epoch.remote(step.epoch), FOLLOWER_CALL_TIMEOUT_S
                    )
                    self._run(state.on_epoch_end(epoch, leader_epoch, end_offset, self.log))
                    continue
                meta, data = await self._fetch(leader, link, epoch, step)
                if state.follow is not None and state.follow.failing:
                    logger.info("replica %s: fetching from leader %s again", self._label, state.leader_id)
                last_error = None
                for append in state.on_fetch_reply(epoch, meta, data is not None):
                    if isinstance(data, ray.ObjectRef):
                        data = await data
                    # The reply's offsets say which gaps (offsets the leader compacted) it covers.
                    unstable = self.log.first_unstable_offset()
                    self.log.append_as_follower(data, append.first_offset, append.next_offset)
                    copied = len(data)
                    self.fetched_bytes += copied
                    del data
                    self._appended(unstable)
                    await self._pace(copied)
                self._run(state.fetch_reply_applied(epoch, meta, self.log))
            except asyncio.CancelledError:
                raise
            except OffsetOutOfRangeError:
                try:
                    # The leader's local log start: a follower never copies what only the tier holds.
                    start, _, end = await asyncio.wait_for(leader.offsets.remote(READ_UNCOMMITTED, True), FOLLOWER_CALL_TIMEOUT_S)
                except Exception:  # noqa: BLE001 (the next fetch tries again)
                    state.on_fetch_failed(epoch)
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                self._run(state.on_out_of_range(epoch, start, end, self.log))
            except Exception as error:  # noqa: BLE001 (leader gone, fenced or restarting: wait for a role change)
                state.on_fetch_failed(epoch)
                if repr(error) != last_error:  # say so once per kind of error, not every 100 ms
                    last_error = repr(error)
                    logger.warning("replica %s: fetch from leader failed: %r", self._label, error)
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _pace(self, copied: int) -> None:
        """With a throttle (bytes/s), wait until the bytes copied so far are within the rate."""
        rate = self.throttle_bytes_per_s
        if not rate:
            self._throttle_until = 0.0
            return
        self.throttled_copy_bytes += copied
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._throttle_until = max(self._throttle_until, now) + copied / rate
        if self._throttle_until > now:
            await asyncio.sleep(self._throttle_until - now)
