"""The jvm_fetch reply (logbus/protocol/jvm_fetch.py): the batches Spark's JVM reader gets are the ones a
Python reader keeps, whole and as stored, and its header-only form carries each kept batch's frame header."""

import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import CorruptRecordError, InvalidRecordError
from logbus.protocol import jvm_fetch
from logbus.storage import record_batch as rb
from logbus.storage.batch_header import HEADER_SIZE, HEADER_STRUCT, BatchHeader, read_header

PLAIN, TRANSACTIONAL, COMMIT, ABORT = range(4)


def framed(kind: int, producer: int, offset: int, count: int) -> bytes:
    """One batch of ``count`` records at ``offset`` (a marker has one record)."""
    if kind in (COMMIT, ABORT):
        records = rb.decode_records(rb.encode_control_batch(producer, 0, kind == COMMIT, 0, 1))[1]
        return rb.frame_record_batch(records, base_offset=offset, producer_id=producer, control=True)
    records = rb.build_record_batch([b"%d-%d" % (offset, i) for i in range(count)])
    if kind == PLAIN:
        return rb.frame_record_batch(records, base_offset=offset)
    return rb.frame_record_batch(records, base_offset=offset, producer_id=producer, producer_epoch=0, base_sequence=0, transactional=True)


def header_at(reply: bytes, position: int) -> BatchHeader:
    """A frame header's fields, whether or not its batch follows it (a headers-only reply)."""
    return BatchHeader(*HEADER_STRUCT.unpack_from(reply, position))


def log_of(batches) -> bytes:
    parts, offset = [], 0
    for kind, producer, count in batches:
        count = 1 if kind in (COMMIT, ABORT) else count
        parts.append(framed(kind, producer, offset, count))
        offset += count
    return b"".join(parts)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([PLAIN, TRANSACTIONAL, TRANSACTIONAL, COMMIT, ABORT]), st.integers(0, 2), st.integers(1, 3)), max_size=12),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), max_size=4),
    st.booleans(),
    st.booleans(),
    st.integers(1, jvm_fetch.ALL_COLUMNS),
)
def test_the_reply_holds_exactly_the_batches_a_python_reader_keeps(batches, aborted, read_committed, headers_only, columns):
    data = log_of(batches)
    reply = jvm_fetch.pack_reply(
        data, 0, 99, 120, headers_only=headers_only, read_committed=read_committed, aborted=aborted, columns=columns,
    )
    parsed = jvm_fetch.parse_reply(reply)
    assert (parsed.first_offset, parsed.next_offset, parsed.high_watermark) == (0, 99, 120)
    assert bool(parsed.flags & jvm_fetch.HEADERS_ONLY) == headers_only
    assert parsed.columns == (0 if headers_only else columns)
    kept, _ = rb.slice_visible_batches(data, 0, read_committed=read_committed, aborted=aborted)
    assert [header_at(reply, position).base_offset for position, _ in parsed.batches] == [h.base_offset for h, _, _ in kept]
    names = [name for bit, name in enumerate(jvm_fetch.COLUMNS) if columns >> bit & 1]
    schema = pa.schema([rb.SCHEMA.field(name) for name in names])
    for (position, length), (header, _, records) in zip(parsed.batches, kept):
        if headers_only:
            assert length == HEADER_SIZE and header_at(reply, position) == header
        elif columns == jvm_fetch.ALL_COLUMNS:  # whole, as stored: it decodes to the same records
            again, decoded = rb.decode_records(reply, position)
            assert again == header and decoded.equals(records)
        else:  # the same header fields but its length, and the columns asked for
            again = read_header(reply, position)
            assert (again.base_offset, again.record_count, again.attributes) == (header.base_offset, header.record_count, header.attributes)
            decoded = pa.ipc.read_record_batch(pa.py_buffer(reply[position + HEADER_SIZE:position + length]), schema)
            assert decoded.equals(records.select(names))


def test_nothing_to_return_is_a_reply_of_its_header_only():
    reply = jvm_fetch.pack_reply(None, 42, 42, 40)
    assert len(reply) == jvm_fetch.REPLY_HEADER.size
    assert jvm_fetch.parse_reply(reply) == jvm_fetch.Reply(0, jvm_fetch.ALL_COLUMNS, 42, 42, 40, [])


def test_a_damaged_reply_is_refused():
    reply = jvm_fetch.pack_reply(log_of([(PLAIN, 0, 3), (PLAIN, 0, 2)]), 0, 5, 5)
    with pytest.raises(CorruptRecordError, match="magic"):
        jvm_fetch.parse_reply(b"XXXX" + reply[4:])
    with pytest.raises(CorruptRecordError, match="past its"):
        jvm_fetch.parse_reply(reply + b"\0" * 8)
    with pytest.raises(CorruptRecordError, match="shorter"):
        jvm_fetch.parse_reply(reply[:10])
    with pytest.raises(InvalidRecordError, match="mask"):
        jvm_fetch.pack_reply(None, 0, 0, 0, columns=16)
    # The Java reader reads the same fields at the same places (FetchReply.java).
    magic, flags, first, next_offset, high_watermark, count, columns = struct.unpack_from("<4siqqqii", reply)
    assert (magic, struct.unpack("<i", magic)[0], count, columns) == (b"LBJF", 0x464A424C, 2, 15)
