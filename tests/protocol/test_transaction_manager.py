"""The transactional producer's own state machine (Kafka's client TransactionManager), without Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import (
    InvalidTxnStateError,
    NotEnoughReplicasError,
    ProducerFencedError,
    RecordTooLargeError,
    TransactionAbortedError,
)
from logbus.protocol.messages import TopicPartition
from logbus.protocol.transaction_manager import VALID_PREVIOUS_STATES, TransactionManager, TxnClientState

C = TxnClientState
A, B = TopicPartition("a", 0), TopicPartition("b", 0)


def ready() -> TransactionManager:
    txn = TransactionManager("t", 60_000)
    txn.begin_init()
    txn.initialized(7, 0)
    return txn


def test_calls_before_init_are_refused():
    txn = TransactionManager("t", 60_000)
    for call in (txn.begin, txn.check_send, txn.begin_commit, txn.begin_abort):
        with pytest.raises(InvalidTxnStateError):
            call()
    assert txn.state is C.UNINITIALIZED


def test_a_transaction_adds_each_partition_once_before_its_batches_go():
    txn = ready()
    txn.begin()
    txn.check_send()
    assert txn.needs_partition(A) and txn.needs_partition(A) and txn.needs_partition(B)
    assert txn.take_pending() == [A, B]
    assert txn.needs_partition(A) and not txn.pending  # being added: not asked for twice
    txn.partitions_not_added([B])  # a retriable failure: pending again
    assert txn.pending == {B}
    txn.partitions_added([A])
    assert not txn.needs_partition(A)
    assert txn.needs_end_txn
    txn.begin_commit()
    with pytest.raises(InvalidTxnStateError):
        txn.check_send()  # no sends while committing
    txn.begin_commit()  # a commit that timed out may be retried
    txn.completed()
    assert txn.state is C.READY and not txn.partitions and not txn.pending


def test_an_empty_transaction_ends_without_the_coordinator():
    txn = ready()
    txn.begin()
    assert not txn.needs_end_txn
    txn.begin_abort()
    txn.completed()
    assert txn.state is C.READY


def test_a_failed_send_leaves_only_abort_and_then_an_epoch_bump():
    txn = ready()
    txn.begin()
    txn.batch_failed(RecordTooLargeError("too big"))
    assert txn.state is C.ABORTABLE_ERROR and txn.epoch_bump_needed
    for call in (txn.check_send, txn.begin_commit, txn.begin):
        with pytest.raises(InvalidTxnStateError) as raised:
            call()
        assert isinstance(raised.value.__cause__, RecordTooLargeError)
    assert not txn.sending_allowed
    txn.begin_abort()
    txn.completed()
    assert txn.state is C.INITIALIZING  # the producer asks the coordinator for a new epoch
    txn.initialized(7, 1)
    assert txn.state is C.READY and not txn.epoch_bump_needed


def test_a_failure_during_commit_is_abortable():
    txn = ready()
    txn.begin()
    txn.begin_commit()
    txn.fail(NotEnoughReplicasError("no"))
    assert txn.state is C.ABORTABLE_ERROR
    txn.begin_abort()
    txn.completed()
    assert txn.state is C.READY


def test_fencing_is_fatal_for_every_later_call():
    txn = ready()
    txn.begin()
    fenced = ProducerFencedError("fenced")
    txn.batch_failed(fenced)
    assert txn.state is C.FATAL_ERROR
    for call in (txn.check_send, txn.begin_commit, txn.begin_abort, txn.begin, txn.begin_init):
        with pytest.raises(ProducerFencedError):
            call()
    txn.fail(RecordTooLargeError("later"))
    assert txn.state is C.FATAL_ERROR and txn.error is fenced


def test_records_failed_by_an_abort_do_not_make_the_transaction_fail_again():
    txn = ready()
    txn.begin()
    txn.begin_abort()
    txn.batch_failed(TransactionAbortedError("aborted"))
    assert txn.state is C.ABORTING_TRANSACTION
    txn.completed()
    assert txn.state is C.INITIALIZING  # its unsent batch may have had sequence numbers


OPERATIONS = st.sampled_from(
    ["init", "initialized", "begin", "send", "add", "added", "commit", "abort", "completed", "fail", "fatal", "batch_failed"]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(OPERATIONS, max_size=40))
def test_any_sequence_of_calls_moves_only_along_kafkas_transitions(operations):
    txn = TransactionManager("t", 60_000)
    for operation in operations:
        before = txn.state
        try:
            if operation == "init":
                txn.begin_init()
            elif operation == "initialized":
                if txn.state is C.INITIALIZING:
                    txn.initialized(7, txn.epoch + 1)
            elif operation == "begin":
                txn.begin()
            elif operation == "send":
                txn.check_send()
                txn.needs_partition(A)
            elif operation == "add":
                txn.take_pending()
            elif operation == "added":
                txn.partitions_added(list(txn.adding))
            elif operation == "commit":
                txn.begin_commit()
            elif operation == "abort":
                txn.begin_abort()
            elif operation == "completed":
                txn.completed()
            elif operation == "fail":
                txn.fail(NotEnoughReplicasError("x"))
            elif operation == "fatal":
                txn.fail(ProducerFencedError("x"))
            elif operation == "batch_failed":
                txn.batch_failed(RecordTooLargeError("x"))
        except (InvalidTxnStateError, ProducerFencedError):
            assert txn.state is before  # a refused call changes nothing
            continue
        assert txn.state is before or before in VALID_PREVIOUS_STATES[txn.state], (before, operation, txn.state)
        if before is C.FATAL_ERROR:
            assert txn.state is C.FATAL_ERROR
        if txn.state is C.READY:
            assert not txn.partitions and not txn.pending and not txn.adding
        if operation == "commit":
            assert before in (C.IN_TRANSACTION, C.COMMITTING_TRANSACTION)  # never from a failed transaction
