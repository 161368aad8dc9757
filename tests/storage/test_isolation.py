"""The reader's filter (logbus/storage/isolation.py) against Kafka's algorithm written out the slow
way, batch by batch, as Kafka's consumer runs it (CompletedFetch.nextFetchedRecord)."""

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError
from logbus.storage import encode_batch
from logbus.storage import record_batch as rb
from logbus.storage.batch_header import CONTROL_MASK, TRANSACTIONAL_MASK
from logbus.storage.isolation import READ_COMMITTED, isolation_level_code, visible

PLAIN, IDEMPOTENT, TRANSACTIONAL, COMMIT, ABORT = range(5)
ATTRIBUTES = {PLAIN: 0, IDEMPOTENT: 0, TRANSACTIONAL: TRANSACTIONAL_MASK, COMMIT: TRANSACTIONAL_MASK | CONTROL_MASK, ABORT: TRANSACTIONAL_MASK | CONTROL_MASK}


def kafka(batches, aborted, read_committed):
    """Kafka's consumer, one batch at a time: which batches it hands records of.

    ``batches``: (producer id, kind, last offset) in order; ``aborted``: (producer id, first offset).
    """
    queue = [(first, producer) for producer, first in aborted]
    heapq.heapify(queue)
    aborted_producers = set()
    kept = []
    for producer, kind, last_offset in batches:
        control = kind in (COMMIT, ABORT)
        if read_committed and producer != -1:
            while queue and queue[0][0] <= last_offset:  # consumeAbortedTransactionsUpTo
                aborted_producers.add(heapq.heappop(queue)[1])
            if kind == ABORT:  # containsAbortMarker
                aborted_producers.discard(producer)
            elif kind == TRANSACTIONAL and producer in aborted_producers:  # isBatchAborted
                kept.append(False)
                continue
        kept.append(not control)
    return kept


batch_kinds = st.sampled_from([PLAIN, IDEMPOTENT, TRANSACTIONAL, TRANSACTIONAL, COMMIT, ABORT, ABORT])


@settings(max_examples=600)
@given(
    st.lists(st.tuples(st.integers(0, 3), batch_kinds, st.integers(1, 4)), max_size=30),
    st.lists(st.tuples(st.integers(0, 4), st.integers(-5, 80)), max_size=8),
    st.booleans(),
)
def test_the_filter_is_kafkas_for_any_reply(batches, aborted, read_committed):
    """Any sequence of batches and any aborted list, consistent or not: the same batches kept."""
    rows, offset = [], 0
    for producer, kind, count in batches:
        producer = -1 if kind == PLAIN else producer
        count = 1 if kind in (COMMIT, ABORT) else count
        offset += count
        rows.append((producer, kind, offset - 1))
    producer_ids = np.array([r[0] for r in rows], dtype=np.int64)
    attributes = np.array([ATTRIBUTES[r[1]] for r in rows], dtype=np.int64)
    last_offsets = np.array([r[2] for r in rows], dtype=np.int64)
    abort_markers = np.array([r[1] == ABORT for r in rows], dtype=bool)
    got = visible(producer_ids, attributes, last_offsets, abort_markers, aborted, read_committed)
    assert got.tolist() == kafka(rows, aborted, read_committed)


def test_a_reply_sliced_for_a_reader_drops_markers_and_aborted_batches():
    t = dict(producer_epoch=0, transactional=True)
    parts = [
        rb.frame_record_batch(rb.build_record_batch([b"p0"]), base_offset=0),
        rb.frame_record_batch(rb.build_record_batch([b"a1", b"a2"]), base_offset=1, producer_id=5, base_sequence=0, **t),
        rb.frame_record_batch(rb.build_record_batch([b"b3"]), base_offset=3, producer_id=6, base_sequence=0, **t),
        rb.frame_record_batch(rb.decode_records(rb.encode_control_batch(5, 0, False, 0, 1))[1], base_offset=4, producer_id=5, control=True),
        rb.frame_record_batch(rb.decode_records(rb.encode_control_batch(6, 0, True, 0, 1))[1], base_offset=5, producer_id=6, control=True),
    ]
    reply = b"".join(parts)
    kept, skipped_to = rb.slice_visible_batches(reply, 2, read_committed=True, aborted=[(5, 1)])
    assert [(first, r.column("value").to_pylist()) for _, first, r in kept] == [(3, [b"b3"])]
    assert skipped_to == 6  # the markers after the last batch kept: the position moves past them
    kept, skipped_to = rb.slice_visible_batches(reply, 2)
    assert [(first, r.column("value").to_pylist()) for _, first, r in kept] == [(2, [b"a2"]), (3, [b"b3"])]
    assert skipped_to == 6
    plain = encode_batch([b"x"])
    kept, skipped_to = rb.slice_visible_batches(plain, 0, read_committed=True, aborted=[(5, 0)])
    assert len(kept) == 1 and skipped_to is None


def test_isolation_levels_are_named():
    assert isolation_level_code("read_committed") == READ_COMMITTED and isolation_level_code("read_uncommitted") == 0
    for bad in ("READ_COMMITTED", 1, None):
        with pytest.raises(InvalidConfigError):
            isolation_level_code(bad)
