"""Record batch format: round trips, header rewriting, and rejection of damaged bytes."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import CorruptRecordError, InvalidRecordError
from logbus.storage import record_batch as rb

binary_or_none = st.one_of(st.none(), st.binary(max_size=64))
header_maps = st.one_of(
    st.none(), st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.binary(max_size=16)), max_size=3)
)


@st.composite
def batches(draw):
    count = draw(st.integers(1, 40))
    values = draw(st.lists(binary_or_none, min_size=count, max_size=count))
    keys = draw(st.one_of(st.none(), st.lists(binary_or_none, min_size=count, max_size=count)))
    timestamps = draw(
        st.one_of(st.none(), st.lists(st.integers(0, 2**62), min_size=count, max_size=count))
    )
    headers = draw(st.one_of(st.none(), st.lists(header_maps, min_size=count, max_size=count)))
    compression = draw(st.sampled_from([None, "lz4", "zstd"]))
    return values, keys, timestamps, headers, compression


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(0, 2**40), st.integers(0, 2**31 - 1))
def test_round_trip(batch, base_offset, epoch):
    values, keys, timestamps, headers, compression = batch
    encoded = rb.encode_batch(values, keys, timestamps, headers, compression=compression, default_timestamp_ms=1234)
    assert len(encoded) % 8 == 0
    header_bytes, payload = rb.with_offset_and_epoch(encoded, base_offset, epoch)
    stamped = bytes(header_bytes) + bytes(payload)
    [(header, records)] = rb.decode_batches(stamped)
    assert header.base_offset == base_offset
    assert header.leader_epoch == epoch
    assert header.record_count == len(values)
    assert header.compression == compression
    assert records.column("value").to_pylist() == values
    assert records.column("key").to_pylist() == (keys if keys is not None else [None] * len(values))
    expected_ts = timestamps if timestamps is not None else [1234] * len(values)
    assert records.column("timestamp").to_pylist() == expected_ts
    assert header.first_timestamp_ms == expected_ts[0]
    assert header.max_timestamp_ms == max(expected_ts)
    decoded_headers = records.column("headers").to_pylist()
    if headers is None:
        assert decoded_headers == [None] * len(values)
    else:
        assert decoded_headers == [None if h is None else list(h.items()) for h in headers]


@settings(max_examples=100, deadline=None)
@given(batches())
def test_uncompressed_message_matches_the_stream_writers_bytes(batch):
    """frame_record_batch takes the uncompressed message from RecordBatch.serialize(): the same bytes
    as the IPC stream writer writes after the schema (the format the log stores)."""
    values, keys, timestamps, headers, _ = batch
    records = rb.build_record_batch(values, keys, timestamps, headers, default_timestamp_ms=1234)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.SCHEMA) as writer:
        writer.write_batch(records)
    streamed = sink.getvalue().to_pybytes()[rb.SCHEMA.serialize().size :]
    framed = rb.frame_record_batch(records)
    assert framed[rb.HEADER_SIZE :] == streamed[: len(streamed) - 8]  # the stream's end-of-stream marker is not stored


def test_table_round_trip_casts_strings():
    table = pa.table({"value": ["a", "bb", None], "key": ["k1", None, "k3"], "timestamp": [5, 6, 7]})
    [(header, records)] = rb.decode_batches(rb.encode_table(table))
    assert records.column("value").to_pylist() == [b"a", b"bb", None]
    assert records.column("key").to_pylist() == [b"k1", None, b"k3"]
    assert header.max_timestamp_ms == 7 and header.first_timestamp_ms == 5


def test_decode_is_zero_copy_over_numpy_buffer():
    encoded = rb.encode_batch([b"x" * 100] * 1000)
    array = np.frombuffer(encoded, dtype=np.uint8)
    [(_, records)] = rb.decode_batches(array)
    values = records.column("value")
    data_buffer = values.buffers()[2]
    start = array.ctypes.data
    assert start <= data_buffer.address < start + array.nbytes  # values point into the array


def test_stamped_header_changes_only_offset_and_epoch():
    import dataclasses

    header = rb.read_header(rb.encode_batch([b"a", b"b"], producer_id=7, producer_epoch=1, base_sequence=3))
    assert header.stamped(42, 5) == dataclasses.replace(header, base_offset=42, leader_epoch=5)


def test_offset_and_epoch_are_outside_the_crc():
    encoded = rb.encode_batch([b"a", b"b"])
    header, payload = rb.with_offset_and_epoch(encoded, 77, 9)
    rewritten = bytes(header) + bytes(payload)
    assert rb.validate_batch(rewritten).crc == rb.validate_batch(encoded).crc


def test_every_single_byte_flip_is_detected():
    encoded = bytearray(rb.encode_batch([b"value-%d" % i for i in range(5)], keys=[b"k"] * 5))
    unprotected = set(range(rb.BASE_OFFSET_OFFSET, rb.LENGTH_OFFSET)) | set(
        range(rb.LEADER_EPOCH_OFFSET, rb.MAGIC_OFFSET)
    )
    for position in range(len(encoded)):
        if position in unprotected:
            continue
        damaged = bytearray(encoded)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptRecordError):
            rb.decode_batches(bytes(damaged))


def test_truncated_batch_is_rejected():
    encoded = rb.encode_batch([b"x" * 50] * 3)
    for cut in range(len(encoded)):
        with pytest.raises(CorruptRecordError):
            rb.decode_batches(encoded[: cut + 1] if cut + 1 < len(encoded) else encoded[:cut])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(values=[]), "at least one record"),
        (dict(values=[1, 2]), "must be bytes"),
        (dict(values=[b"a"], keys=[b"a", b"b"]), "keys"),
        (dict(values=[b"a"], timestamps_ms=[1, 2]), "timestamps"),
        (dict(values=[b"a"], headers=[{"h": 5}]), "header value"),
        (dict(values=[b"a"], compression="gzip"), "compression"),
    ],
)
def test_bad_input_is_rejected_clearly(kwargs, message):
    with pytest.raises(InvalidRecordError, match=message):
        rb.encode_batch(**kwargs)


def test_table_without_value_column_is_rejected():
    with pytest.raises(InvalidRecordError, match="'value' column"):
        rb.encode_table(pa.table({"key": [b"a"]}))


def test_encode_is_a_few_c_level_calls():
    """Per-record Python work stays off the path: encoding and decoding 10,000 records is bounded work.

    This checks the shape of the work (calls into Python per record), not its speed:
    a profile of one encode must not grow with the record count.
    """
    import cProfile
    import pstats

    def python_calls(count):
        values = [b"x" * 100] * count
        profiler = cProfile.Profile()
        profiler.enable()
        rb.decode_batches(rb.encode_batch(values))
        profiler.disable()
        return pstats.Stats(profiler).total_calls

    python_calls(10)  # first use: modules and caches loaded lazily
    small = min(python_calls(10) for _ in range(3))
    large = min(python_calls(10_000) for _ in range(3))
    # Per-record work would add at least 10,000 calls; a few stray ones (a garbage collection's
    # callbacks, in whatever process order the suite runs) are not work that grows with the records.
    assert large <= small + 10, (large, small)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(0, 50), st.data())
def test_slice_batches_returns_exactly_the_offsets_asked_for(counts, base, data):
    """Whole batches go in (as a fetch returns them); exactly the records of [start, end) come out, in order."""
    buffer, offset = b"", base
    for count in counts:
        encoded = rb.encode_batch([b"%d" % (offset + i) for i in range(count)], default_timestamp_ms=1)
        header, payload = rb.with_offset_and_epoch(encoded, offset, 0)
        buffer += bytes(header) + bytes(payload)
        offset += count
    start = data.draw(st.integers(0, offset + 2))
    end = data.draw(st.one_of(st.none(), st.integers(0, offset + 2)))
    got = []
    for header, first, records in rb.slice_batches(buffer, start, end):
        assert header.base_offset <= first < header.next_offset
        got += [(first + i, value) for i, value in enumerate(records.column("value").to_pylist())]
    stop = offset if end is None else min(end, offset)
    expected = [(o, b"%d" % o) for o in range(max(start, base), stop)]
    assert got == expected


@pytest.mark.parametrize("start", [0, 5_000])
@pytest.mark.parametrize("with_headers", [False, True])
def test_a_slice_of_a_large_batch_frames_to_the_size_of_its_own_rows(start, with_headers):
    # Arrow's IPC writer would otherwise write a sliced map column's whole offsets (send_table
    # splitting a large table without headers framed 1,000 rows of 20,000 to 7x their size).
    rows = 20_000
    columns = {"value": [b"v%d" % i for i in range(rows)]}
    if with_headers:
        columns["headers"] = pa.array([[("h", b"%d" % i)] if i % 3 == 0 else None for i in range(rows)], rb.HEADERS_TYPE)
    big = rb.conform_table(pa.table(columns), default_timestamp_ms=1)
    piece = big.slice(start, 1_000)
    fresh = pa.RecordBatch.from_pylist(piece.to_pylist(), schema=rb.SCHEMA)
    framed = rb.frame_record_batch(piece)
    # (the sliced binary columns' buffers keep a few bytes of alignment more than fresh ones)
    assert len(framed) <= len(rb.frame_record_batch(fresh)) + 256
    _, decoded = rb.decode_records(framed)
    assert decoded.equals(fresh)
