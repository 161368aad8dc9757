"""A consumer's membership in a consumer group: joins, heartbeats, and what the coordinator asks of it.

The coordinator lives in the controller actor (see logbus/actors/group_service.py
and logbus/protocol/group_coordinator.py for the protocol). This class is the
member's side: it joins through ``group_join``, which the coordinator holds
open until the generation forms, and a background thread keeps one heartbeat
in place at all times: a long poll of up to ``heartbeat_interval_ms`` that
the coordinator answers as soon as the group starts to rebalance, followed
at once by the next (a reply that was not held, when the coordinator has too
many long polls open, is followed by the next heartbeat an interval later,
as with plain periodic heartbeats). The thread only records
what it learns (rejoin, revoke these partitions, the member was removed, the
coordinator is unreachable); the consumer acts on it
in ``poll()``, on the caller's thread, where rebalance listeners run (as in
Kafka's clients).

When the coordinator cannot be reached the consumer stops fetching; if that
lasts longer than the session timeout, its partitions are treated as lost
(another member may own them by now) and it joins again once the
coordinator is back.

The member rejoins by itself, as Kafka's consumer does: when the coordinator
says it does not know the member (its session expired, or it was removed) or
that its generation is over, from a heartbeat or a commit, the generation
ends here too. The next ``poll()`` reports the partitions lost (not revoked:
they may be another member's already, so nothing is committed for them) and
joins again. A commit refused that way raises CommitFailedError, as Kafka's
commitSync raises CommitFailedException; retrying it cannot succeed.

A join call is never waited for longer than the ``poll()`` that makes it: a
call still unanswered when the poll's time is up stays outstanding, and the
next poll takes its reply (a stopped controller answers when it runs again).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import ray
from ray.exceptions import RayError

from logbus.actors.remote import CONTROL_TIMEOUT_S, get, unwrap
from logbus.options import MS_MAX, check_int
from logbus.retry import retry_until
from logbus.errors import (
    CommitFailedError,
    IllegalGenerationError,
    InvalidConfigError,
    InvalidPartitionError,
    InvalidRecordError,
    LogbusError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from logbus.protocol.assignors import get_assignor
from logbus.protocol.group_coordinator import JoinResult, OffsetAndMetadata, validate_group_id
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import validate_partition, validate_topic_name

HEARTBEAT_TIMEOUT_FRACTION = 0.5  # beyond its long poll, a heartbeat call may take this share of the session timeout
JOIN_WAIT_MAX_S = 1.0  # one join call waits at most this long for the generation to form
MIN_HEARTBEAT_SPACING_S = 0.01
NOT_MEMBER_RECHECK_S = 0.05
ERROR_RETRY_S = 0.5  # after a failed heartbeat or join, the next one is this long (at most an interval) later
PARTITION_COUNT_TIMEOUT_S = 5.0  # an asynchronous commit waits this long at most for a topic's partition count
# A commit refused with these needs the member to rejoin (in poll()) first: retrying it with the same
# generation cannot succeed, so it goes to the caller, as Kafka's commitSync raises CommitFailedException
# (CommitFailedError, for the first two) or RebalanceInProgressException (RebalanceInProgressError is
# retriable, but only after the rejoin).
REJOIN_ERRORS = (UnknownMemberIdError, IllegalGenerationError, RebalanceInProgressError)

logger = logging.getLogger(__name__)

def retriable_in_group(error: LogbusError) -> bool:
    """Whether a group call (a commit, a read of committed offsets) is retried after ``error``: retriable
    errors are, except REJOIN_ERRORS, which need the member to rejoin first."""
    return error.retriable and not isinstance(error, REJOIN_ERRORS)


def _checked_partition(tp) -> TopicPartition:
    if not isinstance(tp, tuple) or len(tp) != 2:
        raise InvalidConfigError(f"expected a TopicPartition(topic, partition), not {tp!r}")
    return TopicPartition(validate_topic_name(tp[0]), validate_partition(tp[1]))


def checked_offsets(offsets) -> dict[TopicPartition, int | OffsetAndMetadata]:
    """``offsets`` as a commit carries them, checked on the caller's side (no bus needed).

    A dict whose keys are TopicPartitions and whose values are offsets (ints
    >= 0, not bools) or OffsetAndMetadata with such an offset; anything else is
    the caller's mistake: InvalidConfigError for something other than a dict,
    InvalidRecordError for a bad value (the coordinator's own check raises the
    same), InvalidTopicError / InvalidPartitionError / InvalidConfigError for a
    bad key.
    """
    if not isinstance(offsets, dict):
        raise InvalidConfigError(f"offsets must be a dict of TopicPartition -> offset, not {offsets!r}")
    checked = {}
    for tp, value in offsets.items():
        tp = _checked_partition(tp)
        offset = value.offset if isinstance(value, OffsetAndMetadata) else value
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
            raise InvalidRecordError(
                f"the commit for {tp} must be an offset (an int >= 0) or an OffsetAndMetadata with one, not {value!r}"
            )
        checked[tp] = value
    return checked


class GroupMembership:
    """The member side of the group protocol (thread-safe: a heartbeat thread and the consumer's thread)."""

    def __init__(
        self,
        bus,
        group_id: str,
        *,
        group_instance_id: str | None,
        client_id: str,
        protocols: tuple[str, ...],
        session_timeout_ms: int,
        heartbeat_interval_ms: int,
        max_poll_interval_ms: int,
    ) -> None:
        # Types are checked here, on the caller's side; the coordinator checks the rest (lengths,
        # ranges) when the member joins, and answers with the same named errors.
        validate_group_id(group_id)
        for what, value in (("group_instance_id", group_instance_id), ("client_id", client_id)):
            if not (isinstance(value, str) or (value is None and what == "group_instance_id")):
                raise InvalidConfigError(f"{what} must be a str, not {value!r}")
        if isinstance(protocols, str) or not isinstance(protocols, tuple | list) or not protocols:
            raise InvalidConfigError(f"protocols must be a non-empty tuple of strategy names, not {protocols!r}")
        for name in protocols:
            get_assignor(name)  # unknown strategies fail here, on the caller's side
        for what, value in (
            ("session_timeout_ms", session_timeout_ms), ("heartbeat_interval_ms", heartbeat_interval_ms),
            ("max_poll_interval_ms", max_poll_interval_ms),
        ):
            check_int(what, value, 1, MS_MAX, unit="ms")
        self._bus = bus
        self.group_id = group_id
        self.group_instance_id = group_instance_id
        self.client_id = client_id
        self.protocols = tuple(protocols)
        # Kafka's rule: a member is cooperative only if every strategy it lists is.
        self.cooperative = all(get_assignor(name).protocol == "cooperative" for name in self.protocols)
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.max_poll_interval_ms = max_poll_interval_ms
        self.member_id = ""
        self.generation = -1
        self.topics: tuple[str, ...] = ()
        self.pattern: str | None = None
        # Subscribed (group management): only a member of a generation may commit. A consumer with
        # manually assigned partitions commits as a non-member (generation -1) instead.
        self.managed = False
        # The join call on its way or held by the coordinator: (ObjectRef, time.monotonic() when sent,
        # wait asked for in ms); and when the next may be sent (after an error, or a reply not held).
        self._join_call: tuple | None = None
        self._join_not_before_s = 0.0
        self.needs_join = True
        self.revoke_requested: tuple[TopicPartition, ...] = ()
        self.lost = False
        self.coordinator_ok = True
        self._unreachable_since: float | None = None
        self._last_poll_s = time.monotonic()
        # How the heartbeat thread learned that it must rejoin or revoke: "woken" (a held heartbeat
        # the coordinator answered when the group changed) or "at once" (a heartbeat that found the
        # group rebalancing when it arrived). For tests and debugging.
        self.notices: collections.Counter[str] = collections.Counter()
        # The heartbeat on its way or held by the coordinator: (time.monotonic() when sent, wait asked
        # for in ms), None between heartbeats. For tests and debugging.
        self.heartbeat_outstanding: tuple[float, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"logbus-heartbeat-{group_id}", daemon=True)
        self._thread.start()

    # --- called by the consumer ---------------------------------------------------------------------

    def polled(self) -> None:
        self._last_poll_s = time.monotonic()

    def subscribe(self, topics: tuple[str, ...], pattern: str | None) -> None:
        if isinstance(topics, str) or not isinstance(topics, tuple | list):
            raise InvalidConfigError(f"topics must be a tuple of topic names, not {topics!r}")
        topics = tuple(validate_topic_name(t) for t in topics)
        if pattern is not None and not isinstance(pattern, str):
            raise InvalidConfigError(f"pattern must be a str or None, not {pattern!r}")
        with self._lock:
            self.topics, self.pattern = topics, pattern
            self.managed = True
            self.needs_join = True
            self._join_call = None  # one on its way carries the old subscription: its reply is not waited for

    def join(self, owned: tuple[TopicPartition, ...], deadline_s: float) -> JoinResult | None:
        """Join (or rejoin) until a generation forms or ``deadline_s`` passes (then None: call again later).

        A join call still unanswered at ``deadline_s`` stays outstanding (the
        coordinator holds it up to JOIN_WAIT_MAX_S, or it is queued at a
        stopped controller) and the next call takes its reply; one unanswered
        past its own timeout is given up and the coordinator marked
        unreachable. ``owned`` is what a cooperative member holds when the
        call is sent.
        """
        while True:
            now = time.monotonic()
            if self._join_call is None:
                if now < self._join_not_before_s:
                    if deadline_s <= now:
                        return None
                    time.sleep(min(self._join_not_before_s, deadline_s) - now)
                    continue
                self._join_call = self._send_join(owned)
            ref, sent_s, wait_ms = self._join_call
            give_up_s = sent_s + wait_ms / 1000 + self.session_timeout_ms / 1000
            ready, _ = ray.wait([ref], timeout=max(0.0, min(deadline_s, give_up_s) - time.monotonic()))
            if not ready:
                if time.monotonic() >= give_up_s:
                    self._join_call = None
                    self._join_not_before_s = time.monotonic() + ERROR_RETRY_S
                    self._mark_unreachable()
                return None
            self._join_call = None
            try:
                result = get(ref)
            except UnknownMemberIdError:
                self.member_id = ""
                continue
            except LogbusError as error:
                if not error.retriable:
                    raise
                self._join_not_before_s = time.monotonic() + ERROR_RETRY_S
                self._mark_unreachable()
                return None
            self._mark_reachable()
            self.member_id = result.member_id
            if isinstance(result, JoinResult):
                with self._lock:
                    self.generation = result.generation
                    self.needs_join = False
                    self.revoke_requested = ()
                return result
            if time.monotonic() - sent_s < wait_ms / 2000:
                # Not held (the coordinator has too many calls waiting): back off.
                self._join_not_before_s = time.monotonic() + result.retry_backoff_ms / 1000
            if time.monotonic() >= deadline_s:
                return None

    def _send_join(self, owned: tuple[TopicPartition, ...]) -> tuple:
        options = {
            "member_id": self.member_id,
            "group_instance_id": self.group_instance_id,
            "client_id": self.client_id,
            "topics": self.topics,
            "pattern": self.pattern,
            "owned": owned if self.cooperative else (),
            "protocols": self.protocols,
            "session_timeout_ms": self.session_timeout_ms,
            "rebalance_timeout_ms": self.max_poll_interval_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
        }
        # The coordinator holds the call until the generation forms (or the wait ends).
        wait_ms = int(JOIN_WAIT_MAX_S * 1000)
        return self._bus.controller.group_join.remote(self.group_id, options, wait_ms), time.monotonic(), wait_ms

    def take_lost(self) -> bool:
        """Whether the partitions held were lost (the generation ended without a rebalance this member
        took part in) since the last call: the consumer drops them without committing."""
        with self._lock:
            lost, self.lost = self.lost, False
            return lost

    def _generation_over(self, member: str, generation: int, unknown_member: bool) -> bool:
        """The coordinator said that ``member`` in ``generation`` is no longer a member (``unknown_member``)
        or that the generation is over: end it here too, so the next poll() rejoins. Nothing changes if
        the member has rejoined since (the answer is about an older generation). True if it ended."""
        with self._lock:
            if (self.member_id, self.generation) != (member, generation):
                return False
            self.coordinator_ok = True  # it answered
            self._unreachable_since = None
            if unknown_member:
                self.member_id = ""
            if self.generation >= 0:
                self.lost = True  # another member may own the partitions by now
            self.generation = -1
            self.needs_join = True
            self.revoke_requested = ()
            return True

    def _commit_identity(self) -> tuple[str, int]:
        """(member id, generation) a commit is sent with; CommitFailedError for a subscribed consumer
        that is not a member of a generation now (it was removed, or is rejoining): poll() first."""
        with self._lock:
            if self.generation >= 0:
                return self.member_id, self.generation
            if self.managed:
                raise CommitFailedError(
                    f"group {self.group_id!r}: this consumer is not a member of the group's current generation "
                    "(it was removed, or is rejoining); poll() to rejoin, then commit the new assignment's positions"
                )
            return "", -1

    def _commit_refused(self, error: LogbusError, member: str, generation: int) -> LogbusError:
        """What a commit refused with ``error`` raises: CommitFailedError (the generation ended: the
        next poll() rejoins) for an unknown member or a stale generation, else ``error`` itself."""
        if isinstance(error, CommitFailedError):
            return error
        if isinstance(error, (UnknownMemberIdError, IllegalGenerationError)):
            self._generation_over(member, generation, unknown_member=isinstance(error, UnknownMemberIdError))
            failure = CommitFailedError(
                f"group {self.group_id!r}: the commit was refused because the group rebalanced without this member "
                f"({error}); poll() rejoins, and the new assignment starts from the group's committed offsets"
            )
            failure.__cause__ = error
            return failure
        if isinstance(error, RebalanceInProgressError):
            with self._lock:
                self.needs_join = True
        return error

    def commit(self, offsets: dict, deadline_s: float | None = None) -> None:
        """Commit with this member's generation (or as a non-member, for manually assigned partitions) and wait.

        Retriable errors are retried until ``deadline_s`` (``time.monotonic()``;
        None: one try), then RequestTimedOutError. Every try commits as the
        member it started as: a generation that went stale meanwhile is refused,
        never replaced by a commit as a non-member. Raises CommitFailedError if
        the member's generation is over (the next poll() rejoins) and
        RebalanceInProgressError if the group is rebalancing.
        """
        offsets = checked_offsets(offsets)
        member, generation = self._commit_identity()

        def attempt(remaining_s: float) -> None:
            self._check_partition_counts(offsets, remaining_s)
            get(self._bus.controller.commit_offsets.remote(self.group_id, member, generation, offsets), timeout_s=remaining_s)

        try:
            if deadline_s is None:
                attempt(CONTROL_TIMEOUT_S)
            else:
                retry_until(
                    deadline_s, f"committing offsets of group {self.group_id!r}", attempt, self._forget_topics(offsets),
                    retriable=retriable_in_group,
                )
        except REJOIN_ERRORS as error:
            refused = self._commit_refused(error, member, generation)
            if refused is error:
                raise
            raise refused from error

    def commit_async(self, offsets: dict, callback=None) -> None:
        """Commit without waiting; ``callback(offsets, error_or_None)`` runs when it is done (the error as
        :meth:`commit` would raise it)."""
        offsets = checked_offsets(offsets)
        if callback is not None and not callable(callback):
            raise InvalidConfigError(f"callback must be a callable taking (offsets, error), not {callback!r}")
        member, generation = self.member_id, self.generation

        def finished(error: BaseException | None) -> None:
            if isinstance(error, REJOIN_ERRORS):
                error = self._commit_refused(error, member, generation)
            if callback is not None:
                callback(offsets, error)
            elif error is not None:
                logger.debug("group %r: an asynchronous commit failed: %s", self.group_id, error)

        try:
            member, generation = self._commit_identity()
            self._check_partition_counts(offsets, PARTITION_COUNT_TIMEOUT_S, cached_only=True)
        except LogbusError as error:
            if not error.retriable and not isinstance(error, CommitFailedError):
                raise
            finished(error)  # as Kafka's commitAsync: a failure of the commit goes to the callback, not the caller
            return
        ref = self._bus.controller.commit_offsets.remote(self.group_id, member, generation, offsets)
        ref.future().add_done_callback(lambda future: finished(None if future.exception() is None else unwrap(future.exception())))

    def committed(self, partitions: list[TopicPartition], timeout_s: float = CONTROL_TIMEOUT_S) -> dict:
        """The group's committed OffsetAndMetadata (or None) of each partition (one try; see retry_until)."""
        return get(self.committed_call(partitions), timeout_s=timeout_s)

    def committed_call(self, partitions: list[TopicPartition]):
        """Ask for the group's committed offsets without waiting: an ObjectRef to what :meth:`committed` returns."""
        partitions = [_checked_partition(tp) for tp in partitions]
        return self._bus.controller.fetch_committed.remote(self.group_id, list(partitions))

    def _forget_topics(self, offsets: dict) -> Callable[[LogbusError], None]:
        """A retry hook: forget the cached metadata of the committed topics (they may have changed)."""

        def forget(_error: LogbusError) -> None:
            for topic in {tp.topic for tp in offsets}:
                self._bus.forget(topic)

        return forget

    def _check_partition_counts(
        self, offsets: dict[TopicPartition, int | OffsetAndMetadata], timeout_s: float, cached_only: bool = False
    ) -> None:
        """Refuse partitions past their topic's count.

        A partition past the topic's count is the caller's mistake (InvalidPartitionError), not the
        retriable "unknown partition" the coordinator would answer; the cached partition count is
        refreshed once before saying so, since the topic may have grown. The metadata is waited for
        ``timeout_s`` at most (a stopped controller must not hold up a commit past its timeout);
        with ``cached_only``, a topic whose metadata is not cached is left to the coordinator's own
        check (an asynchronous commit, the auto-commit inside poll(), never waits to ask).
        """
        for topic in {tp.topic for tp in offsets}:
            highest = max(tp.partition for tp in offsets if tp.topic == topic)
            metadata = self._bus.cached_metadata(topic)
            if metadata is None and cached_only:
                continue
            if metadata is None or highest >= metadata.partition_count:
                metadata = self._bus.metadata_arrived(self._bus.request_metadata(topic), timeout_s=timeout_s)
            count = metadata.partition_count
            if highest >= count:
                raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{count - 1}; cannot commit partition {highest}")

    def leave(self) -> None:
        """Leave at once (dynamic members): the group rebalances without waiting for the session timeout."""
        self._stop.set()
        if self.member_id and self.group_instance_id is None:
            try:
                get(self._bus.controller.group_leave.remote(self.group_id, self.member_id), timeout_s=10)
            except LogbusError:
                pass  # the session timeout removes it anyway
        # A dynamic member's leave wakes its own long poll at once; a static member's poll just
        # runs out (within one heartbeat interval) and the thread, a daemon, ends then.
        self._thread.join(timeout=1)

    def stop(self) -> None:
        self._stop.set()

    # --- the heartbeat thread --------------------------------------------------------------------------

    def _mark_unreachable(self) -> None:
        with self._lock:
            self.coordinator_ok = False
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            elif (time.monotonic() - self._unreachable_since) * 1000 > self.session_timeout_ms and self.generation >= 0:
                # Our session has surely expired: another member may own our partitions now.
                self.lost = True
                self.needs_join = True
                self.generation = -1

    def _mark_reachable(self) -> None:
        with self._lock:
            self.coordinator_ok = True
            self._unreachable_since = None

    def _heartbeat_loop(self) -> None:
        """Heartbeats as long polls: the coordinator answers at once when the group starts to
        rebalance, so the consumer learns of it within a round trip rather than at its next
        heartbeat."""
        pause_s = NOT_MEMBER_RECHECK_S
        last_sent_s = 0.0
        while not self._stop.wait(pause_s):
            # A quiet reply that was held (the wait ended, or the group changed in a way that needs
            # nothing from us) is followed by the next long poll at once; one that was not held,
            # an interval after the previous heartbeat. While the consumer acts on a reply that
            # asked for something, heartbeats keep their interval; as soon as it has rejoined,
            # the long poll resumes. After an error, the next try is ERROR_RETRY_S later.
            pause_s = NOT_MEMBER_RECHECK_S
            with self._lock:
                if not self.member_id or self.generation < 0:
                    continue
                if (self.needs_join or self.revoke_requested) and time.monotonic() - last_sent_s < self.heartbeat_interval_s:
                    continue
                member, generation = self.member_id, self.generation
            last_sent_s = time.monotonic()
            idle_ms = int((time.monotonic() - self._last_poll_s) * 1000)
            wait_ms = int(self.heartbeat_interval_s * 1000)
            try:
                self.heartbeat_outstanding = (last_sent_s, wait_ms)
                ref = self._bus.controller.group_heartbeat.remote(self.group_id, member, generation, idle_ms, wait_ms)
                result = ray.get(ref, timeout=wait_ms / 1000 + self.session_timeout_ms / 1000 * HEARTBEAT_TIMEOUT_FRACTION)
            except RayError as error:
                cause = unwrap(error)
                if isinstance(cause, (UnknownMemberIdError, IllegalGenerationError)):
                    # Removed (session expired, fenced, too long between polls), or the generation is
                    # over: as Kafka's heartbeat thread, end the generation; poll() rejoins.
                    self._generation_over(member, generation, unknown_member=isinstance(cause, UnknownMemberIdError))
                elif isinstance(cause, RebalanceInProgressError):
                    with self._lock:
                        self.needs_join = True
                else:
                    self._mark_unreachable()
                    pause_s = min(ERROR_RETRY_S, self.heartbeat_interval_s)
                continue
            except Exception:  # noqa: BLE001 (the controller handle is being re-resolved)
                self._mark_unreachable()
                pause_s = min(ERROR_RETRY_S, self.heartbeat_interval_s)
                continue
            finally:
                self.heartbeat_outstanding = None
            self._mark_reachable()
            with self._lock:
                if (self.member_id, self.generation) != (member, generation):
                    continue  # the consumer rejoined while this heartbeat was held: its reply is stale
                if result.revoke:
                    self.revoke_requested = tuple(result.revoke)
                if result.rejoin:
                    self.needs_join = True
            if result.rejoin or result.revoke:
                self.notices["woken" if result.woken else "at once"] += 1
            elif result.woken or result.waited_ms > 0:
                pause_s = MIN_HEARTBEAT_SPACING_S
            else:
                pause_s = max(MIN_HEARTBEAT_SPACING_S, last_sent_s + self.heartbeat_interval_s - time.monotonic())
