"""A transactional producer's own state machine (Kafka's client ``TransactionManager``). No I/O.

The producer (``logbus/api/producer.py``) asks it, under its lock, whether
a call is allowed now, tells it what happened, and asks it which partitions
must join the transaction before their batches go. States, as Kafka's::

    UNINITIALIZED           init_transactions() not called yet
    INITIALIZING            init_transactions() (or the epoch bump after an abort) is running
    READY                   no transaction open: begin_transaction() opens one
    IN_TRANSACTION          send(), send_table(), send_offsets_to_transaction()
    COMMITTING_TRANSACTION  commit_transaction() runs: sends refused; a commit that timed out may be retried
    ABORTING_TRANSACTION    abort_transaction() runs; an abort that timed out may be retried
    ABORTABLE_ERROR         something in the transaction failed: only abort_transaction() is allowed
    FATAL_ERROR             fenced (another instance took over, or the transaction timed out),
                            or the coordinator and producer disagree: every call raises; close it

Transitions are the table ``VALID_PREVIOUS_STATES``. A call made in a state
that does not allow it raises InvalidTxnStateError and changes nothing; in
FATAL_ERROR every call raises the error that made it fatal, and in
ABORTABLE_ERROR every call but abort raises one that wraps the cause.

Partitions join a transaction before their first batch is sent
(AddPartitionsToTxn): the sender marks a partition *pending* when it meets a
batch for it (:meth:`TransactionManager.needs_partition`), holds its batches
back, sends the pending set in one call (:meth:`take_pending`), and releases
them once the coordinator has them (:meth:`partitions_added`). A
transaction that never added a partition or offsets ends without calling the
coordinator at all (as Kafka's).

After a batch of the transaction failed for good, its partition's sequence
numbers have a hole the leader will never see filled; a transactional
producer may not bump its own epoch (the coordinator owns it), so the abort
is followed by an epoch bump from the coordinator (``init_producer_id`` with
the epoch the producer holds, KIP-360) and every partition starts again at
sequence 0: :attr:`TransactionManager.epoch_bump_needed`.

This class is not thread-safe; the producer calls it under its lock.
"""

from __future__ import annotations

import enum

from logbus.errors import (
    InvalidProducerEpochError,
    InvalidProducerIdMappingError,
    InvalidTxnStateError,
    ProducerFencedError,
    TransactionAbortedError,
    copy_error,
)


class TxnClientState(enum.Enum):
    UNINITIALIZED = "UNINITIALIZED"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    IN_TRANSACTION = "IN_TRANSACTION"
    COMMITTING_TRANSACTION = "COMMITTING_TRANSACTION"
    ABORTING_TRANSACTION = "ABORTING_TRANSACTION"
    ABORTABLE_ERROR = "ABORTABLE_ERROR"
    FATAL_ERROR = "FATAL_ERROR"


C = TxnClientState
VALID_PREVIOUS_STATES: dict[TxnClientState, frozenset[TxnClientState]] = {
    C.UNINITIALIZED: frozenset(),
    C.INITIALIZING: frozenset({C.UNINITIALIZED, C.INITIALIZING, C.ABORTING_TRANSACTION}),
    C.READY: frozenset({C.INITIALIZING, C.COMMITTING_TRANSACTION, C.ABORTING_TRANSACTION}),
    C.IN_TRANSACTION: frozenset({C.READY}),
    C.COMMITTING_TRANSACTION: frozenset({C.IN_TRANSACTION, C.COMMITTING_TRANSACTION}),
    C.ABORTING_TRANSACTION: frozenset({C.IN_TRANSACTION, C.ABORTABLE_ERROR, C.ABORTING_TRANSACTION}),
    C.ABORTABLE_ERROR: frozenset({C.IN_TRANSACTION, C.COMMITTING_TRANSACTION, C.ABORTABLE_ERROR}),
    C.FATAL_ERROR: frozenset(C),
}

# Errors that end the producer (Kafka's fatal ones for a transactional producer).
FATAL_ERRORS = (ProducerFencedError, InvalidProducerEpochError, InvalidProducerIdMappingError)


def is_fatal(error: BaseException) -> bool:
    return isinstance(error, FATAL_ERRORS)


class TransactionManager:
    """One transactional producer's transaction state (see the module docstring)."""

    def __init__(self, transactional_id: str, timeout_ms: int) -> None:
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self.state = C.UNINITIALIZED
        self.producer_id = -1
        self.epoch = -1
        self.partitions: set = set()  # in the transaction (the coordinator has them)
        self.pending: set = set()  # met by the sender, not yet sent to the coordinator
        self.adding: set = set()  # sent to the coordinator, reply not yet in
        self.offsets_added = False  # send_offsets_to_transaction added a group
        self.error: BaseException | None = None  # what made the state ABORTABLE_ERROR or FATAL_ERROR
        self.epoch_bump_needed = False

    # --- transitions ---------------------------------------------------------------------------------

    def _to(self, state: TxnClientState) -> None:
        if self.state not in VALID_PREVIOUS_STATES[state]:
            raise InvalidTxnStateError(f"transactional id {self.transactional_id!r}: cannot go from {self.state.value} to {state.value}")
        self.state = state

    def _raise_if_failed(self) -> None:
        if self.state is C.FATAL_ERROR:
            raise self._fatal_error()
        if self.state is C.ABORTABLE_ERROR:
            raise InvalidTxnStateError(
                f"transactional id {self.transactional_id!r}: the transaction failed ({self.error!r}); abort_transaction() is the only call allowed"
            ) from self.error

    def _fatal_error(self) -> BaseException:
        if self.error is not None:
            return copy_error(self.error)  # each raise its own (a raise adds the caller's frames to it)
        return InvalidTxnStateError(f"transactional id {self.transactional_id!r}: the producer failed")

    def begin_init(self) -> None:
        """init_transactions(): UNINITIALIZED (or an init that failed and is retried) -> INITIALIZING."""
        if self.state is C.FATAL_ERROR:
            raise self._fatal_error()
        if self.state not in (C.UNINITIALIZED, C.INITIALIZING):
            raise InvalidTxnStateError(f"init_transactions() was already called (state {self.state.value})")
        self._to(C.INITIALIZING)

    def initialized(self, producer_id: int, epoch: int) -> None:
        """The coordinator gave (producer id, epoch): READY."""
        self.producer_id, self.epoch = producer_id, epoch
        self.epoch_bump_needed = False
        self._to(C.READY)

    def begin(self) -> None:
        """begin_transaction(): READY -> IN_TRANSACTION."""
        self._raise_if_failed()
        if self.state is C.UNINITIALIZED:
            raise InvalidTxnStateError("call init_transactions() before begin_transaction()")
        if self.state is not C.READY:
            raise InvalidTxnStateError(f"a transaction is already open (state {self.state.value}): commit or abort it first")
        self._to(C.IN_TRANSACTION)
        self.partitions.clear()
        self.pending.clear()
        self.adding.clear()
        self.offsets_added = False

    def check_send(self) -> None:
        """send(), send_table(), send_offsets_to_transaction(): only inside an open transaction."""
        if self.state is C.IN_TRANSACTION:
            return
        self._raise_if_failed()
        if self.state is C.READY or self.state is C.UNINITIALIZED:
            raise InvalidTxnStateError("a transactional producer sends only inside begin_transaction() ... commit_transaction()")
        raise InvalidTxnStateError(f"cannot send while the transaction is {self.state.value}")

    def begin_commit(self) -> None:
        """commit_transaction(): IN_TRANSACTION (or a commit being retried) -> COMMITTING_TRANSACTION."""
        self._raise_if_failed()
        if self.state not in (C.IN_TRANSACTION, C.COMMITTING_TRANSACTION):
            raise InvalidTxnStateError(f"no transaction to commit (state {self.state.value})")
        self._to(C.COMMITTING_TRANSACTION)

    def begin_abort(self) -> None:
        """abort_transaction(): IN_TRANSACTION, ABORTABLE_ERROR (or an abort being retried) -> ABORTING_TRANSACTION."""
        if self.state is C.FATAL_ERROR:
            raise self._fatal_error()
        if self.state not in (C.IN_TRANSACTION, C.ABORTABLE_ERROR, C.ABORTING_TRANSACTION):
            raise InvalidTxnStateError(f"no transaction to abort (state {self.state.value})")
        self._to(C.ABORTING_TRANSACTION)

    def completed(self) -> None:
        """The commit or abort is done (markers written, or nothing to end): READY, unless the
        epoch must be bumped first (then INITIALIZING: the producer re-initialises)."""
        if self.state not in (C.COMMITTING_TRANSACTION, C.ABORTING_TRANSACTION):
            raise InvalidTxnStateError(f"no transaction is ending (state {self.state.value})")
        self.partitions.clear()
        self.pending.clear()
        self.adding.clear()
        self.offsets_added = False
        if self.epoch_bump_needed and self.state is C.ABORTING_TRANSACTION:
            self._to(C.INITIALIZING)
        else:
            self._to(C.READY)

    def fail(self, error: BaseException) -> None:
        """Something in the transaction failed: FATAL_ERROR if ``error`` is fatal, else ABORTABLE_ERROR
        (when a transaction is open or committing; an abort or init in progress keeps its state and
        the caller raises the error)."""
        if self.state is C.FATAL_ERROR:
            return
        if is_fatal(error):
            self.error = error
            self._to(C.FATAL_ERROR)
        elif self.state in (C.IN_TRANSACTION, C.COMMITTING_TRANSACTION, C.ABORTABLE_ERROR):
            if self.state is not C.ABORTABLE_ERROR:
                self.error = error
            self._to(C.ABORTABLE_ERROR)

    def batch_failed(self, error: BaseException) -> None:
        """A batch of the transaction failed for good: its partition's sequence has a hole."""
        self.epoch_bump_needed = True
        if not isinstance(error, TransactionAbortedError):
            self.fail(error)

    # --- partitions -----------------------------------------------------------------------------------

    @property
    def needs_end_txn(self) -> bool:
        """Whether ending this transaction involves the coordinator (it has partitions or offsets)."""
        return bool(self.partitions or self.adding or self.offsets_added)

    def needs_partition(self, tp) -> bool:
        """For the sender, per batch: True if ``tp`` is not in the transaction yet (the batch waits;
        ``tp`` becomes pending)."""
        if tp in self.partitions:
            return False
        if tp not in self.adding:
            self.pending.add(tp)
        return True

    def take_pending(self) -> list:
        """The pending partitions to send in one AddPartitionsToTxn (they move to *adding*)."""
        taken = sorted(self.pending)
        self.adding.update(taken)
        self.pending.clear()
        return taken

    def partitions_added(self, partitions) -> None:
        self.adding.difference_update(partitions)
        self.partitions.update(partitions)

    def partitions_not_added(self, partitions) -> None:
        """An AddPartitionsToTxn failed (retriable): they are pending again."""
        self.adding.difference_update(partitions)
        self.pending.update(partitions)

    @property
    def sending_allowed(self) -> bool:
        """Whether the sender may dispatch the transaction's batches (not once it failed)."""
        return self.state is C.IN_TRANSACTION or self.state is C.COMMITTING_TRANSACTION
