"""The transaction coordinator's state machine, driven without Ray or I/O.

Unit tests walk Kafka's flows one call at a time. The property test drives
any interleaving of init/add/end calls from current and zombie producer
instances, timeouts, appends that succeed, fail or lose their reply, marker
writes and coordinator restarts (a new coordinator loaded from the records
appended so far), and checks after every step that each transition is one of
Kafka's, that the log replays as a chain of valid transitions, that no
transaction is ever completed both ways, and that zombies stay fenced.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from logbus.errors import (
    ConcurrentTransactionsError,
    CorruptRecordError,
    InternalStateError,
    InvalidConfigError,
    InvalidProducerEpochError,
    InvalidProducerIdMappingError,
    InvalidTransactionTimeoutError,
    InvalidTxnStateError,
    ProducerFencedError,
)
from logbus.protocol.messages import TopicPartition
from logbus.protocol.transaction_coordinator import (
    PRODUCER_EPOCH_MAX,
    TRANSACTION_TIMEOUT_MS_MAX,
    VALID_PREVIOUS_STATES,
    AwaitCompletion,
    Persist,
    Reply,
    Retry,
    TransactionCoordinator,
    TxnMetadata,
    TxnState,
    decode_key,
    decode_transaction_value,
    transaction_key,
    transaction_value,
)

A, B = TopicPartition("a", 0), TopicPartition("b", 1)


def persist(coordinator: TransactionCoordinator, step, log: list | None = None):
    """Play the service: append the step's record (to ``log``), apply it, write its markers, complete."""
    assert isinstance(step, Persist), step
    if log is not None:
        log.append((step.key, step.value))
    coordinator.applied(step.metadata.transactional_id)
    if step.markers is not None:
        done = coordinator.markers_written(step.metadata.transactional_id, step.metadata.update_ms + 1)
        if log is not None:
            log.append((done.key, done.value))
        coordinator.applied(done.metadata.transactional_id)
    return step.reply


def init(coordinator, tid, now_ms=1000, timeout_ms=60_000, producer_id=7, expected=None, log=None):
    while True:
        needed = producer_id if coordinator.needs_producer_id(tid) else None
        step = coordinator.init_producer_id(tid, timeout_ms, now_ms, needed, expected)
        reply = persist(coordinator, step, log)
        if reply is not Retry.AFTER_COMPLETION:
            return reply


def test_a_first_init_allocates_an_id_and_a_second_bumps_the_epoch():
    c = TransactionCoordinator()
    assert c.needs_producer_id("t")
    assert init(c, "t", producer_id=7) == (7, 0)
    assert not c.needs_producer_id("t")
    assert init(c, "t") == (7, 1)
    assert c.state_of("t").state is TxnState.EMPTY


def test_commit_flow_persists_ongoing_then_prepare_then_complete_with_markers():
    c = TransactionCoordinator(coordinator_epoch=3)
    pid, epoch = init(c, "t")
    step = c.add_partitions("t", pid, epoch, [A], now_ms=2000)
    assert step.metadata.state is TxnState.ONGOING and step.metadata.start_ms == 2000
    c.applied("t")
    assert c.add_partitions("t", pid, epoch, [A], now_ms=2001) == Reply()  # already in: nothing to save
    step = c.add_partitions("t", pid, epoch, [B], now_ms=2002)
    assert step.metadata.partitions == {A, B}
    c.applied("t")
    step = c.end_txn("t", pid, epoch, True, now_ms=2003)
    assert step.metadata.state is TxnState.PREPARE_COMMIT
    assert step.markers.commit and step.markers.partitions == (A, B)
    assert (step.markers.producer_id, step.markers.producer_epoch, step.markers.coordinator_epoch) == (pid, epoch, 3)
    c.applied("t")
    # A retry while the markers are being written waits for them; the other outcome is refused.
    assert c.end_txn("t", pid, epoch, True, now_ms=2004) == AwaitCompletion("t")
    with pytest.raises(InvalidTxnStateError):
        c.end_txn("t", pid, epoch, False, now_ms=2004)
    with pytest.raises(ConcurrentTransactionsError):
        c.add_partitions("t", pid, epoch, [A], now_ms=2004)
    done = c.markers_written("t", now_ms=2005)
    assert done.metadata.state is TxnState.COMPLETE_COMMIT and not done.metadata.partitions
    c.applied("t")
    assert c.end_txn("t", pid, epoch, True, now_ms=2006) == Reply()  # a retry after completion succeeds
    with pytest.raises(InvalidTxnStateError):
        c.end_txn("t", pid, epoch, False, now_ms=2006)
    # The next transaction starts afresh.
    step = c.add_partitions("t", pid, epoch, [B], now_ms=3000)
    assert step.metadata.partitions == {B} and step.metadata.start_ms == 3000


def test_a_pending_change_makes_other_calls_retry():
    c = TransactionCoordinator()
    pid, epoch = init(c, "t")
    c.add_partitions("t", pid, epoch, [A], now_ms=2000)
    with pytest.raises(ConcurrentTransactionsError) as raised:
        c.end_txn("t", pid, epoch, True, now_ms=2001)
    assert raised.value.retriable
    c.abandon("t")  # the append failed: nothing was written
    assert c.state_of("t").state is TxnState.EMPTY
    assert c.end_txn is not None
    with pytest.raises(InvalidTxnStateError):
        c.end_txn("t", pid, epoch, True, now_ms=2002)  # nothing is open


def test_a_new_instance_fences_the_old_and_aborts_its_open_transaction_with_the_new_epoch():
    c = TransactionCoordinator()
    pid, epoch = init(c, "t")
    persist(c, c.add_partitions("t", pid, epoch, [A, B], now_ms=2000))
    step = c.init_producer_id("t", 60_000, 2100, None)
    assert step.metadata.state is TxnState.PREPARE_ABORT and step.reply is Retry.AFTER_COMPLETION
    assert step.markers.producer_epoch == epoch + 1 and not step.markers.commit and step.markers.partitions == (A, B)
    assert c.state_of("t").state is TxnState.PREPARE_EPOCH_FENCE
    with pytest.raises(ProducerFencedError):
        c.end_txn("t", pid, epoch, True, now_ms=2101)  # the zombie cannot commit, even before the abort is saved
    persist(c, step)
    assert c.state_of("t").state is TxnState.COMPLETE_ABORT
    new = init(c, "t", now_ms=2200)
    assert new == (pid, epoch + 2)
    for call in (lambda: c.add_partitions("t", pid, epoch, [A], 2300), lambda: c.end_txn("t", pid, epoch, False, 2300)):
        with pytest.raises(ProducerFencedError):
            call()
    with pytest.raises(InvalidProducerEpochError):
        c.add_partitions("t", pid, epoch + 5, [A], 2300)
    with pytest.raises(InvalidProducerIdMappingError):
        c.add_partitions("t", pid + 1, epoch + 2, [A], 2300)
    with pytest.raises(InvalidProducerIdMappingError):
        c.add_partitions("unknown", pid, epoch, [A], 2300)


def test_reinit_with_an_expected_epoch_detects_a_fence():
    c = TransactionCoordinator()
    pid, epoch = init(c, "t")
    assert init(c, "t", expected=(pid, epoch)) == (pid, epoch + 1)
    with pytest.raises(ProducerFencedError):
        c.init_producer_id("t", 60_000, 3000, None, expected=(pid, epoch))


def test_timeout_aborts_with_an_epoch_bump_and_one_timer_deadline():
    c = TransactionCoordinator()
    pid, epoch = init(c, "t", timeout_ms=1000)
    init(c, "u", timeout_ms=5000, producer_id=8)
    assert c.next_deadline_ms() is None
    persist(c, c.add_partitions("t", pid, epoch, [A], now_ms=10_000))
    persist(c, c.add_partitions("u", 8, 0, [B], now_ms=10_500))
    assert c.next_deadline_ms() == 11_000
    assert c.expire(10_999) == []
    steps = c.expire(11_000)
    assert [s.metadata.transactional_id for s in steps] == ["t"]
    assert steps[0].markers.producer_epoch == epoch + 1 and not steps[0].markers.commit
    persist(c, steps[0])
    assert c.next_deadline_ms() == 15_500
    with pytest.raises(ProducerFencedError):
        c.end_txn("t", pid, epoch, True, now_ms=11_001)


def test_epoch_exhaustion_allocates_a_new_producer_id():
    c = TransactionCoordinator()
    c.load(transaction_key("t"), transaction_value(TxnMetadata("t", 7, PRODUCER_EPOCH_MAX - 1, 60_000, TxnState.EMPTY)))
    assert init(c, "t") == (7, PRODUCER_EPOCH_MAX)
    assert c.needs_producer_id("t")
    with pytest.raises(InternalStateError):
        c.init_producer_id("t", 60_000, 1, None)
    assert init(c, "t", producer_id=9) == (9, 0)


def test_bad_arguments_are_caller_errors():
    c = TransactionCoordinator()
    for timeout in (0, -1, TRANSACTION_TIMEOUT_MS_MAX + 1, 1.5, True):
        with pytest.raises(InvalidTransactionTimeoutError):
            c.init_producer_id("t", timeout, 1, 7)
    for tid in ("", "x" * 256, "a\nb", 5):
        with pytest.raises(InvalidConfigError):
            c.init_producer_id(tid, 1000, 1, 7)


def test_records_round_trip_and_reload_completes_prepared_transactions():
    c = TransactionCoordinator(coordinator_epoch=4)
    log = []
    pid, epoch = init(c, "t", log=log)
    step = c.add_partitions("t", pid, epoch, [A, B, TopicPartition("a", 3)], now_ms=2000)
    persist(c, step, log)
    kind, name = decode_key(step.key)
    assert (kind, name) == ("transaction", "t")
    assert decode_transaction_value("t", step.value) == step.metadata
    prepare = c.end_txn("t", pid, epoch, True, now_ms=2001)
    log.append((prepare.key, prepare.value))  # durable; the coordinator dies before writing markers
    reloaded = TransactionCoordinator()
    for key, value in log:
        reloaded.load(key, value)
    assert reloaded.state_of("t").state is TxnState.PREPARE_COMMIT
    (markers,) = reloaded.prepared()
    assert markers.commit and set(markers.partitions) == {A, B, TopicPartition("a", 3)}
    for bad in (b"", b"\x00\x09", transaction_key("t") + b"x"):
        with pytest.raises(CorruptRecordError):
            reloaded.load(bad, b"")


def test_the_transition_table_is_kafkas():
    S = TxnState
    assert VALID_PREVIOUS_STATES[S.PREPARE_COMMIT] == {S.ONGOING}
    assert VALID_PREVIOUS_STATES[S.PREPARE_ABORT] == {S.ONGOING, S.PREPARE_EPOCH_FENCE}
    assert VALID_PREVIOUS_STATES[S.COMPLETE_COMMIT] == {S.PREPARE_COMMIT}
    assert VALID_PREVIOUS_STATES[S.COMPLETE_ABORT] == {S.PREPARE_ABORT}
    assert VALID_PREVIOUS_STATES[S.ONGOING] == {S.ONGOING, S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT}


# --- any interleaving ------------------------------------------------------------------------------------

TIDS = ("t1", "t2")
PARTITIONS = (A, B, TopicPartition("c", 0))
ALLOWED_CALL_ERRORS = (
    ConcurrentTransactionsError, InvalidTxnStateError, ProducerFencedError, InvalidProducerEpochError, InvalidProducerIdMappingError,
)


class CoordinatorMachine(RuleBasedStateMachine):
    """A coordinator, the service around it (appends, markers) and producer instances, all simulated."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000
        self.next_pid = 100
        self.log: list[tuple[bytes, bytes | None]] = []
        self.coordinator = TransactionCoordinator()
        self.pending: dict[str, Persist] = {}  # steps waiting for their append
        self.maybe_written: set[str] = set()  # pending steps an attempt may have appended
        self.marker_jobs: dict[str, object] = {}  # transactional id -> Markers to write
        self.instances: dict[str, list[tuple[int, int]]] = {t: [] for t in TIDS}  # every (pid, epoch) handed out
        self.outcomes: dict[tuple, bool] = {}  # (tid, pid, start_ms) -> committed?
        self.timeouts = {t: 3_000 for t in TIDS}

    def tick(self, ms: int = 1) -> int:
        self.now += ms
        return self.now

    def take(self, tid: str, step) -> None:
        if isinstance(step, Persist):
            assert tid not in self.pending
            self.pending[tid] = step

    def call(self, tid: str, make):
        try:
            step = make()
        except ALLOWED_CALL_ERRORS:
            return None
        self.take(tid, step)
        return step

    # --- producer calls ---

    @rule(tid=st.sampled_from(TIDS), reinit=st.booleans())
    def init(self, tid, reinit):
        now = self.tick()
        new_id = None
        if self.coordinator.needs_producer_id(tid):
            new_id = self.next_pid = self.next_pid + 1
        expected = self.instances[tid][-1] if reinit and self.instances[tid] else None
        step = self.call(tid, lambda: self.coordinator.init_producer_id(tid, self.timeouts[tid], now, new_id, expected))
        if isinstance(step, Persist) and step.reply is not Retry.AFTER_COMPLETION:
            assert step.metadata.state is TxnState.EMPTY

    @rule(tid=st.sampled_from(TIDS), which=st.integers(0, 3), parts=st.sets(st.sampled_from(PARTITIONS), max_size=2))
    def add(self, tid, which, parts):
        if not self.instances[tid]:
            return
        instances = self.instances[tid]
        pid, epoch = instances[max(0, len(instances) - 1 - which)]
        now = self.tick()
        try:
            step = self.coordinator.add_partitions(tid, pid, epoch, parts, now)
        except ALLOWED_CALL_ERRORS as error:
            if (pid, epoch) != instances[-1]:
                assert isinstance(error, ProducerFencedError | InvalidProducerIdMappingError | ConcurrentTransactionsError)
            return
        assert (pid, epoch) == instances[-1]  # a zombie never gets this far
        self.take(tid, step)

    @rule(tid=st.sampled_from(TIDS), which=st.integers(0, 3), commit=st.booleans())
    def end(self, tid, which, commit):
        if not self.instances[tid]:
            return
        instances = self.instances[tid]
        pid, epoch = instances[max(0, len(instances) - 1 - which)]
        now = self.tick()
        try:
            step = self.coordinator.end_txn(tid, pid, epoch, commit, now)
        except ALLOWED_CALL_ERRORS:
            return
        current = self.coordinator.state_of(tid)
        assert (current.producer_id, current.producer_epoch) == (pid, epoch) == instances[-1]  # a zombie never gets this far
        if isinstance(step, Reply):
            assert current.state is (TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT)
        self.take(tid, step)

    # --- time ---

    @rule(ms=st.integers(1, 4_000))
    def timer(self, ms):
        now = self.tick(ms)
        deadline = self.coordinator.next_deadline_ms()
        steps = self.coordinator.expire(now)
        for step in steps:
            assert step.metadata.state is TxnState.PREPARE_ABORT and step.metadata.deadline_ms <= now
            self.take(step.metadata.transactional_id, step)
        if deadline is not None and deadline <= now:
            assert steps or any(e.pending is not None for e in self.coordinator.entries.values())

    # --- the service: appends and markers ---

    @rule(data=st.data(), outcome=st.sampled_from(["ok", "failed", "reply-lost"]))
    def append(self, data, outcome):
        if not self.pending:
            return
        tid = data.draw(st.sampled_from(sorted(self.pending)))
        step = self.pending[tid]
        if outcome == "failed":
            if tid in self.maybe_written:
                return  # an earlier attempt may have been written: the service must keep appending it
            del self.pending[tid]
            self.coordinator.abandon(tid)
            return
        self.log.append((step.key, step.value))
        if outcome == "reply-lost":
            self.maybe_written.add(tid)
            return  # still pending: the service appends it again until it hears back
        del self.pending[tid]
        self.maybe_written.discard(tid)
        previous = self.coordinator.state_of(tid)
        metadata = self.coordinator.applied(tid)
        if previous is not None and previous.producer_id >= 0:
            assert previous.state in VALID_PREVIOUS_STATES[metadata.state]
        if isinstance(step.reply, tuple):
            self.instances[tid].append(step.reply)
        if step.markers is not None:
            self.marker_jobs[tid] = step.markers

    @rule(data=st.data())
    def write_markers(self, data):
        if not self.marker_jobs:
            return
        tid = data.draw(st.sampled_from(sorted(self.marker_jobs)))
        if tid in self.pending:
            return
        markers = self.marker_jobs.pop(tid)
        key = (tid, markers.producer_id, markers.start_ms)
        assert self.outcomes.setdefault(key, markers.commit) == markers.commit, f"{key} completed both ways"
        self.take(tid, self.coordinator.markers_written(tid, self.tick()))

    @rule()
    def restart(self):
        self.coordinator = TransactionCoordinator()
        for key, value in self.log:
            self.coordinator.load(key, value)
        self.pending.clear()
        self.maybe_written.clear()
        self.marker_jobs = {m.transactional_id: m for m in self.coordinator.prepared()}

    # --- invariants ---

    @invariant()
    def log_is_a_chain_of_valid_transitions(self):
        last: dict[str, tuple] = {}
        for key, value in self.log:
            kind, tid = decode_key(key)
            if kind != "transaction" or value is None:
                continue
            metadata = decode_transaction_value(tid, value)
            before = last.get(tid)
            if before is not None and before != metadata:
                assert before.state in VALID_PREVIOUS_STATES[metadata.state], (before, metadata)
                assert (metadata.producer_id, metadata.producer_epoch) >= (before.producer_id, before.producer_epoch) or metadata.producer_id != before.producer_id
            last[tid] = metadata

    @invariant()
    def prepared_transactions_have_marker_work(self):
        for tid, entry in self.coordinator.entries.items():
            if entry.current.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                assert tid in self.marker_jobs or tid in self.pending


TestCoordinatorInterleavings = CoordinatorMachine.TestCase
TestCoordinatorInterleavings.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
