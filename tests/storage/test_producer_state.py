"""The leader's idempotent producer table on its own: duplicates, the window, gaps and epochs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.errors import DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError
from logbus.storage import encode_batch
from logbus.storage.producer_state import BATCHES_KEPT, ProducerStateTable
from logbus.storage.record_batch import BatchHeader

PRODUCER_ID = 7


def header(base_sequence, count=1, epoch=0, base_offset=-1, max_timestamp_ms=1_000):
    return BatchHeader(
        base_offset, 0, 0, 2, 0, 0, count, max_timestamp_ms, max_timestamp_ms, PRODUCER_ID, epoch, base_sequence
    )


def write(table, batches):
    """Check and record ``batches`` [(base_sequence, count)] in order, as a leader appending them."""
    offset = 0
    written = []
    for sequence, count in batches:
        incoming = header(sequence, count)
        assert table.check(incoming) is None
        stored = header(sequence, count, base_offset=offset, max_timestamp_ms=10_000 + offset)
        table.update(stored)
        written.append(stored)
        offset += count
    return written


def test_a_batch_below_the_window_is_a_duplicate_no_retry_can_fix():
    table = ProducerStateTable()
    write(table, [(s, 1) for s in range(BATCHES_KEPT + 1)])  # sequence 0 has left the window
    with pytest.raises(DuplicateSequenceError, match="below") as raised:
        table.check(header(0))
    assert not raised.value.retriable
    assert table.check(header(1)) == (1, 10_001)  # the oldest batch still kept: answered as a duplicate
    with pytest.raises(OutOfOrderSequenceError) as gap:
        table.check(header(BATCHES_KEPT + 3))  # ahead: its predecessor may still be on its way
    assert gap.value.retriable


@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    probe=st.integers(0, 60),
    count=st.integers(1, 4),
)
def test_every_sequence_gets_the_answer_its_place_calls_for(sizes, probe, count):
    """A batch at ``probe`` is a duplicate of a kept batch, below the window, next, or out of order."""
    table = ProducerStateTable()
    batches, sequence = [], 0
    for size in sizes:
        batches.append((sequence, size))
        sequence += size
    written = write(table, batches)
    kept = written[-BATCHES_KEPT:]
    exact = {(h.base_sequence, h.last_sequence): h for h in kept}
    incoming = header(probe, count)
    key = (incoming.base_sequence, incoming.last_sequence)
    if key in exact:
        assert table.check(incoming) == (exact[key].base_offset, exact[key].max_timestamp_ms)
    elif probe < kept[0].base_sequence:
        with pytest.raises(DuplicateSequenceError):
            table.check(incoming)
    elif probe == sequence:
        assert table.check(incoming) is None
    else:
        with pytest.raises(OutOfOrderSequenceError):
            table.check(incoming)


def test_a_new_epoch_restarts_at_zero_and_fences_the_old_one():
    table = ProducerStateTable()
    write(table, [(0, 3), (3, 2)])
    with pytest.raises(OutOfOrderSequenceError):
        table.check(header(5, epoch=1))  # a new epoch starts at 0
    assert table.check(header(0, epoch=1)) is None
    table.update(header(0, epoch=1, base_offset=5))
    with pytest.raises(ProducerFencedError):
        table.check(header(5))  # the old epoch carries on no more
    assert table.check(header(1, epoch=1)) is None


def test_a_duplicate_on_a_log_append_time_topic_reports_the_original_append_time(open_log, clock):
    log = open_log({"message.timestamp.type": "LogAppendTime"})
    batch = encode_batch([b"a", b"b"], timestamps_ms=[5, 6], producer_id=PRODUCER_ID, producer_epoch=0, base_sequence=0)
    first = log.append(batch, leader_epoch=1)
    assert first.max_timestamp_ms == clock.now_ms
    appended_ms = clock.now_ms
    clock.now_ms += 60_000
    retry = log.append(batch, leader_epoch=1)
    assert retry.duplicate and (retry.base_offset, retry.max_timestamp_ms) == (0, appended_ms)
    assert log.log_end_offset == 2
