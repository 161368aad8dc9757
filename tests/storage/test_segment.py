"""Log segment: an append must continue the segment's offsets; a refused one changes nothing on disk."""

import os

import pytest

from logbus.errors import InvariantViolationError
from logbus.storage import decode_batches, encode_batch
from logbus.storage import record_batch as rb
from logbus.storage.segment import LogSegment

BASE = 100


def stamped(values, base_offset, leader_epoch=1):
    """A batch as PartitionLog hands it to a segment: its header with offset and epoch, and the buffers."""
    raw = encode_batch(values)
    new_header, payload = rb.with_offset_and_epoch(raw, base_offset, leader_epoch)
    return rb.read_header(raw).stamped(base_offset, leader_epoch), [new_header, payload]


def records_of(segment):
    found = segment.read(segment.base_offset, 1 << 20)
    if found is None:
        return []
    view, _, _ = found
    return [(h.base_offset + i, v) for h, batch in decode_batches(view) for i, v in enumerate(batch.column("value").to_pylist())]


def snapshot(segment):
    """Everything an append touches: offsets, sizes, timestamps, index entries, and the files' bytes."""
    indexes = [segment.offset_index, segment.time_index]
    files = [segment.log_path] + [index.path for index in indexes]
    return (
        segment.next_offset,
        segment.size_bytes,
        segment.max_timestamp_ms,
        [[index.entry(i) for i in range(len(index))] for index in indexes],
        {path: open(path, "rb").read() for path in files if os.path.exists(path)},
    )


@pytest.mark.parametrize("base_offset", [BASE + 6, BASE + 4, BASE, 0], ids=["gap", "overlap", "repeat", "below-base"])
def test_an_append_that_does_not_continue_the_segment_is_refused_and_changes_nothing(tmp_path, base_offset):
    segment = LogSegment(str(tmp_path), BASE, index_interval_bytes=1)  # an index entry for every batch
    segment.append(*stamped([b"a", b"b", b"c"], BASE))
    segment.append(*stamped([b"d", b"e"], BASE + 3))
    segment.flush()
    before = snapshot(segment)
    with pytest.raises(InvariantViolationError, match=f"offset {base_offset} does not continue segment .* at offset {BASE + 5}"):
        segment.append(*stamped([b"x"], base_offset))
    assert snapshot(segment) == before
    segment.close()

    again = LogSegment.open_existing(str(tmp_path), BASE, index_interval_bytes=1)
    assert again.next_offset == BASE + 5
    expected = [(BASE + i, v) for i, v in enumerate([b"a", b"b", b"c", b"d", b"e"])]
    assert records_of(again) == expected
    report = again.recover()  # a full scan agrees: every batch valid, nothing cut
    assert (report.valid_batches, report.truncated_bytes, report.error) == (2, 0, None)
    again.append(*stamped([b"f"], BASE + 5))  # the segment still takes the batch that does continue it
    assert records_of(again) == expected + [(BASE + 5, b"f")]
    again.close()


def test_an_empty_segment_takes_only_its_base_offset(tmp_path):
    segment = LogSegment(str(tmp_path), BASE, index_interval_bytes=4096)
    with pytest.raises(InvariantViolationError):
        segment.append(*stamped([b"a"], BASE + 1))
    assert (segment.is_empty, segment.next_offset, os.path.getsize(segment.log_path)) == (True, BASE, 0)
    segment.append(*stamped([b"a"], BASE))
    assert records_of(segment) == [(BASE, b"a")]
    segment.close()
