"""Kafka v2 record batches <-> logbus batches, checked against kafka-python's own record format code.

kafka-python's ``DefaultRecordBatchBuilder`` builds the Kafka batches a client
would send, and its ``DefaultRecordBatch`` reads (and CRC-checks) what the
gateway returns; logbus's side is read with ``record_batch.decode_batches``.
"""

from __future__ import annotations

import pathlib
import struct
import subprocess
import sys

import crc32c
import cramjam
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from logbus.errors import CorruptRecordError, InvalidRecordError, RecordTooLargeError
from logbus.protocol import kafka_records as kr
from logbus.storage import record_batch as rb

BASE_MS = 1_700_000_000_000


def kafka_batch(records, *, producer_id=-1, producer_epoch=-1, base_sequence=-1, transactional=False) -> bytes:
    """An uncompressed Kafka batch of ``records`` [(key, value, timestamp, headers)], as a client builds it."""
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=0, is_transactional=transactional, producer_id=producer_id,
        producer_epoch=producer_epoch, base_sequence=base_sequence, batch_size=1 << 30,
    )
    for offset, (key, value, timestamp, headers) in enumerate(records):
        builder.append(offset, timestamp=timestamp, key=key, value=value, headers=headers)
    return bytes(builder.build())


def with_codec(batch: bytes, codec: int) -> bytes:
    """The same batch with its records compressed by ``codec``, as a client compresses them."""
    records = batch[kr.HEADER_SIZE:]
    compressed = {
        kr.CODEC_GZIP: lambda b: bytes(cramjam.gzip.compress(b)),
        kr.CODEC_SNAPPY: lambda b: bytes(cramjam.snappy.compress_raw(b)),
        kr.CODEC_LZ4: lambda b: bytes(cramjam.lz4.compress(b)),
        kr.CODEC_ZSTD: lambda b: bytes(cramjam.zstd.compress(b)),
    }[codec](records)
    return recrc(batch[: kr.HEADER_SIZE] + compressed, attributes_or=codec)


def xerial(raw: bytes, block: int = 1000) -> bytes:
    """Snappy in xerial's framing (Kafka's Java client): a header, then length-prefixed raw blocks."""
    out = [b"\x82SNAPPY\x00", struct.pack(">ii", 1, 1)]
    for start in range(0, len(raw), block):
        chunk = bytes(cramjam.snappy.compress_raw(raw[start : start + block]))
        out += [struct.pack(">i", len(chunk)), chunk]
    return b"".join(out)


def recrc(batch: bytes, attributes_or: int = 0) -> bytes:
    """Fix a batch's length and CRC after its bytes changed (and set attribute bits)."""
    out = bytearray(batch)
    struct.pack_into(">i", out, 8, len(out) - kr.LOG_OVERHEAD)
    (attributes,) = struct.unpack_from(">h", out, 21)
    struct.pack_into(">h", out, 21, attributes | attributes_or)
    struct.pack_into(">I", out, 17, crc32c.crc32c(bytes(out[21:])))
    return bytes(out)


def logbus_rows(encoded: bytes) -> tuple[rb.BatchHeader, list[dict]]:
    [(header, records)] = rb.decode_batches(encoded)
    return header, records.to_pylist()


def kafka_rows(data: bytes) -> list[tuple]:
    batch = DefaultRecordBatch(data)
    assert batch.validate_crc()
    return [(r.offset, r.key, r.value, r.timestamp, [tuple(h) for h in r.headers]) for r in batch]


RECORDS = [
    (b"k0", b"v0", BASE_MS, []),
    (None, b"no key", BASE_MS + 5, [("trace", b"abc"), ("empty", b""), ("none", None)]),
    (b"tombstone", None, BASE_MS - 3, []),
    (b"", b"", BASE_MS + 10**6, [("h", b"x" * 300)]),
]


def test_a_kafka_batch_becomes_one_logbus_batch_with_the_same_records_and_producer_fields():
    produced = kr.to_logbus(kafka_batch(RECORDS, producer_id=42, producer_epoch=3, base_sequence=17))
    header, rows = logbus_rows(produced.encoded)
    assert (header.producer_id, header.producer_epoch, header.base_sequence, header.record_count) == (42, 3, 17, 4)
    assert header.reader_timestamp_type == rb.TIMESTAMP_TYPE_CREATE_TIME
    assert [(r["key"], r["value"], r["timestamp"], r["headers"]) for r in rows] == [
        (b"k0", b"v0", BASE_MS, None),  # no headers: null, as a logbus producer leaves them
        (None, b"no key", BASE_MS + 5, [("trace", b"abc"), ("empty", b""), ("none", None)]),
        (b"tombstone", None, BASE_MS - 3, None),
        (b"", b"", BASE_MS + 10**6, [("h", b"x" * 300)]),
    ]
    assert produced.max_timestamp_ms == BASE_MS + 10**6
    assert (header.first_timestamp_ms, header.max_timestamp_ms) == (BASE_MS, BASE_MS + 10**6)


def test_a_logbus_batch_becomes_a_kafka_batch_a_kafka_client_reads():
    encoded = rb.encode_batch(
        [b"a", None, b"c" * 1000], keys=[None, b"k1", b"k2"], timestamps_ms=[BASE_MS, BASE_MS - 1, BASE_MS + 7],
        headers=[None, [("x", b"1"), ("y", None)], []], producer_id=9, producer_epoch=1, base_sequence=30,
    )
    stamped, payload = rb.with_offset_and_epoch(encoded, 1000, 5)
    kafka = kr.to_kafka(bytes(stamped) + bytes(payload))
    assert kafka_rows(kafka) == [
        (1000, None, b"a", BASE_MS, []),
        (1001, b"k1", None, BASE_MS - 1, [("x", b"1"), ("y", None)]),
        (1002, b"k2", b"c" * 1000, BASE_MS + 7, []),
    ]
    header = kr.read_header(kafka)
    assert (header.base_offset, header.partition_leader_epoch, header.producer_id, header.producer_epoch, header.base_sequence) == (1000, 5, 9, 1, 30)
    assert header.attributes == 0 and header.max_timestamp == BASE_MS + 7 and header.last_offset_delta == 2


def test_a_log_append_time_batch_carries_the_append_time_as_kafka_does():
    encoded = rb.encode_batch([b"a", b"b"], timestamps_ms=[BASE_MS, BASE_MS + 1])
    stamped, payload = rb.with_offset_and_epoch(encoded, 0, 0, log_append_time_ms=BASE_MS + 5000)
    kafka = kr.to_kafka(bytes(stamped) + bytes(payload))
    header = kr.read_header(kafka)
    assert header.attributes & kr.TIMESTAMP_TYPE_BIT
    assert header.max_timestamp == BASE_MS + 5000
    batch = DefaultRecordBatch(kafka)
    assert batch.timestamp_type == 1  # LogAppendTime: kafka-python then reports the batch's max timestamp
    assert [r.timestamp for r in batch] == [BASE_MS + 5000, BASE_MS + 5000]


def test_several_logbus_batches_become_as_many_kafka_batches():
    first = rb.with_offset_and_epoch(rb.encode_batch([b"a", b"b"]), 0, 0)
    second = rb.with_offset_and_epoch(rb.encode_batch([b"c"]), 2, 1)
    kafka = kr.to_kafka(b"".join(bytes(part) for pair in (first, second) for part in pair))
    headers = [h for _, h in kr.iter_batches(kafka)]
    assert [(h.base_offset, h.record_count, h.partition_leader_epoch) for h in headers] == [(0, 2, 0), (2, 1, 1)]


@pytest.mark.parametrize("codec", [kr.CODEC_GZIP, kr.CODEC_SNAPPY, kr.CODEC_LZ4, kr.CODEC_ZSTD])
def test_every_kafka_codec_is_read(codec):
    batch = kafka_batch([(b"k%d" % i, b"value %d " % i * 20, BASE_MS + i, []) for i in range(500)])
    _, rows = logbus_rows(kr.to_logbus(with_codec(batch, codec)).encoded)
    assert [(r["key"], r["value"], r["timestamp"]) for r in rows] == [(b"k%d" % i, b"value %d " % i * 20, BASE_MS + i) for i in range(500)]


def test_snappy_in_xerial_framing_is_read():
    batch = kafka_batch([(b"k%d" % i, b"x" * 50, BASE_MS, []) for i in range(300)])
    framed = recrc(batch[: kr.HEADER_SIZE] + xerial(batch[kr.HEADER_SIZE :]), attributes_or=kr.CODEC_SNAPPY)
    _, rows = logbus_rows(kr.to_logbus(framed).encoded)
    assert [r["key"] for r in rows] == [b"k%d" % i for i in range(300)]


@pytest.mark.parametrize("codec", [kr.CODEC_GZIP, kr.CODEC_SNAPPY, kr.CODEC_LZ4, kr.CODEC_ZSTD, "xerial"])
def test_a_batch_that_expands_past_the_limit_is_too_large_and_one_that_does_not_decompress_is_corrupt(codec):
    batch = kafka_batch([(None, b"\0" * 100_000, BASE_MS, [])])
    if codec == "xerial":
        compressed = recrc(batch[: kr.HEADER_SIZE] + xerial(batch[kr.HEADER_SIZE :]), attributes_or=kr.CODEC_SNAPPY)
    else:
        compressed = with_codec(batch, codec)
    with pytest.raises(RecordTooLargeError, match="expand past 10000 bytes"):
        kr.to_logbus(compressed, decompressed_max_bytes=10_000)
    assert kr.to_logbus(compressed, decompressed_max_bytes=200_000).decompressed_bytes == len(batch) - kr.HEADER_SIZE
    assert kr.to_logbus(batch, decompressed_max_bytes=10).decompressed_bytes == 0  # uncompressed: the limit is not for it
    # Compressed bytes cut short (with a valid CRC), within the limit, are corrupt, not too large.
    with pytest.raises(CorruptRecordError):
        kr.to_logbus(recrc(compressed[: (kr.HEADER_SIZE + len(compressed)) // 2]), decompressed_max_bytes=200_000)


def claiming(record_count: int, payload: bytes, codec: int = kr.CODEC_NONE) -> bytes:
    """A batch whose header claims ``record_count`` records over ``payload`` (compressed by ``codec``), with a
    valid CRC: what a client can send, since it computes the CRC itself."""
    if codec != kr.CODEC_NONE:
        payload = bytes({kr.CODEC_ZSTD: cramjam.zstd.compress, kr.CODEC_GZIP: cramjam.gzip.compress}[codec](payload))
    header = kr.HEADER.pack(0, 0, -1, kr.KAFKA_MAGIC, 0, codec, max(record_count - 1, 0), BASE_MS, BASE_MS, -1, -1, -1, record_count)
    return recrc(header + payload)


def test_a_record_count_the_bytes_cannot_hold_is_refused_before_anything_is_allocated_for_it():
    import tracemalloc

    # 2**31 - 1 records in 10 bytes: refused by the header check, whatever is decoded after it.
    with pytest.raises(CorruptRecordError, match="claims 2147483647 records in 10 bytes"):
        kr.read_header(claiming(kr.RECORDS_MAX, b"\x00" * 10))
    # Two million records in 10 bytes, plain or compressed, must cost no per-record memory before the refusal.
    for codec in (kr.CODEC_NONE, kr.CODEC_ZSTD, kr.CODEC_GZIP):
        batch = claiming(2_000_000, b"\x00" * 10, codec)
        tracemalloc.start()
        try:
            with pytest.raises(CorruptRecordError, match="claims 2000000 records in 10 bytes"):
                kr.to_logbus(batch, decompressed_max_bytes=4096)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10, f"{peak} bytes allocated to refuse a batch of {len(batch)} bytes"


def test_a_batch_of_the_smallest_records_is_read():
    # Null key, null value, no headers: 7 bytes a record, the least MIN_RECORD_BYTES allows.
    batch = kafka_batch([(None, None, BASE_MS, [])] * 60)  # offset deltas below 64: one byte each
    assert len(batch) - kr.HEADER_SIZE == 60 * kr.MIN_RECORD_BYTES
    _, rows = logbus_rows(kr.to_logbus(batch).encoded)
    assert [(r["key"], r["value"]) for r in rows] == [(None, None)] * 60
    assert kr.to_logbus(with_codec(batch, kr.CODEC_ZSTD)).record_count == 60


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 100_000), st.binary(max_size=120), st.sampled_from([kr.CODEC_NONE, kr.CODEC_ZSTD]))
def test_batches_with_a_valid_crc_and_any_record_count_decode_or_raise_record_errors(record_count, payload, codec):
    try:
        produced = kr.to_logbus(claiming(record_count, payload, codec), decompressed_max_bytes=4096)
    except (CorruptRecordError, InvalidRecordError):
        return
    assert produced.record_count == record_count <= len(payload) // kr.MIN_RECORD_BYTES


def test_a_transactional_batch_stays_transactional_and_extra_batches_are_refused():
    produced = kr.to_logbus(kafka_batch(RECORDS, producer_id=7, producer_epoch=3, base_sequence=5, transactional=True))
    [(header, _)] = list(rb.decode_batches(produced.encoded))
    assert header.is_transactional and not header.is_control
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (7, 3, 5)
    assert not rb.decode_batches(kr.to_logbus(kafka_batch(RECORDS)).encoded)[0][0].is_transactional
    with pytest.raises(InvalidRecordError, match="producer id"):
        kr.to_logbus(kafka_batch(RECORDS, transactional=True))
    with pytest.raises(InvalidRecordError, match="exactly one"):
        kr.to_logbus(kafka_batch(RECORDS) * 2)


def test_offset_deltas_out_of_order_are_refused():
    batch = bytearray(kafka_batch([(b"a", b"b", BASE_MS, []), (b"c", b"d", BASE_MS, [])]))
    # The second record's offset delta (zigzag 1: the byte 2) after its length, attributes and timestamp delta.
    second = kr.HEADER_SIZE + 1 + batch[kr.HEADER_SIZE] // 2
    assert batch[second + 3] == 2
    batch[second + 3] = 4  # offset delta 2
    with pytest.raises(InvalidRecordError, match="offset deltas"):
        kr.to_logbus(recrc(bytes(batch)))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_batches_raise_only_record_errors(data):
    batch = kafka_batch(RECORDS, producer_id=5, producer_epoch=0, base_sequence=0)
    kind = data.draw(st.sampled_from(["truncate", "flip", "flip-recrc", "codec"]))
    if kind == "truncate":
        damaged = batch[: data.draw(st.integers(0, len(batch) - 1))]
    elif kind == "codec":
        damaged = recrc(batch, attributes_or=data.draw(st.integers(1, 7)))
    else:
        position = data.draw(st.integers(0, len(batch) - 1))
        damaged = bytearray(batch)
        damaged[position] ^= data.draw(st.integers(1, 255))
        damaged = recrc(bytes(damaged)) if kind == "flip-recrc" and position >= kr.CRC_START else bytes(damaged)
    try:
        produced = kr.to_logbus(damaged)
    except (CorruptRecordError, InvalidRecordError):
        return
    # A change the format cannot see (a key's or value's bytes, a timestamp) still makes a whole batch.
    assert rb.decode_batches(produced.encoded)[0][0].record_count == produced.record_count


def test_random_bytes_raise_only_record_errors():
    import random

    generator = random.Random(7)
    for _ in range(2000):
        size = generator.randrange(0, 200)
        blob = bytes(generator.randrange(256) for _ in range(size))
        if generator.random() < 0.5 and size >= kr.HEADER_SIZE:
            blob = recrc(struct.pack(">q", 0) + blob[8:16] + b"\x02" + blob[17:])  # a plausible header
        with pytest.raises((CorruptRecordError, InvalidRecordError)):
            kr.to_logbus(blob)


records_strategy = st.lists(
    st.tuples(
        st.none() | st.binary(max_size=40),
        st.none() | st.binary(max_size=300),
        st.integers(BASE_MS - 10**9, BASE_MS + 10**9),
        st.lists(st.tuples(st.text(max_size=8), st.none() | st.binary(max_size=20)), max_size=3),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(records_strategy)
def test_kafka_to_logbus_to_kafka_keeps_every_record(records):
    produced = kr.to_logbus(kafka_batch(records))
    stamped, payload = rb.with_offset_and_epoch(produced.encoded, 77, 2)
    assert kafka_rows(kr.to_kafka(bytes(stamped) + bytes(payload))) == [
        (77 + i, key, value, timestamp, [tuple(h) for h in headers]) for i, (key, value, timestamp, headers) in enumerate(records)
    ]


def test_a_batch_of_ten_thousand_records_keeps_every_record_both_ways():
    # Offset deltas take 1, 2 and 3 bytes; values of one size (one varint size for all) in one
    # half, of many sizes in the other; one timestamp for most records, a spread for the rest.
    records = [(None if i % 3 else b"key%d" % i, b"v" * 100 if i < 5_000 else b"w" * (i % 300),
                BASE_MS if i < 8_000 else BASE_MS + i * 1_000, []) for i in range(10_000)]
    produced = kr.to_logbus(kafka_batch(records))
    assert produced.record_count == 10_000
    stamped, payload = rb.with_offset_and_epoch(produced.encoded, 5, 1)
    assert kafka_rows(kr.to_kafka(bytes(stamped) + bytes(payload))) == [
        (5 + i, key, value, timestamp, []) for i, (key, value, timestamp, _) in enumerate(records)
    ]


def zigzag_varint(value: int) -> bytes:
    raw, out = (value << 1) ^ (value >> 63), bytearray()
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    return bytes(out + bytes([raw]))


def record_bodies_one_by_one(data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """kr._record_bodies without the runs: the reference it is tested against."""
    starts, lengths = [], []
    position = 0
    try:
        for i in range(count):
            n, size = kr._varint_at(data, position)
            length = (n >> 1) ^ -(n & 1)
            if length <= 0:
                raise CorruptRecordError(f"record {i} has length {length}")
            starts.append(position + size)
            lengths.append(length)
            position += size + length
    except IndexError:
        raise CorruptRecordError("the records are cut short") from None
    if position != len(data):
        raise CorruptRecordError(f"the records take {position} bytes; the batch holds {len(data)}")
    return np.array(starts, np.int64), np.array(lengths, np.int64)


def record_bodies_both_ways(data: bytes, count: int):
    """What the run-taking walk and the one-by-one reference make of the same bytes: results or error types."""
    outcomes = []
    for walk in (kr._record_bodies, record_bodies_one_by_one):
        try:
            starts, lengths = walk(data, count)
            outcomes.append((starts.tolist(), lengths.tolist()))
        except CorruptRecordError:
            outcomes.append(CorruptRecordError)
    return outcomes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.integers(1, 300)) | st.tuples(st.integers(8180, 8200), st.integers(1, 20)),
                min_size=1, max_size=8), st.data())
def test_records_in_runs_of_one_size_are_found_as_one_by_one(runs, data):
    # Runs of same-length records (lengths whose varints take 1 to 3 bytes), then a count that may be
    # off, and bytes that may be cut: the walk that takes runs at once agrees with the reference.
    body = b"".join(zigzag_varint(length) + bytes([i % 251]) * length for length, repeat in runs for i in range(repeat))
    count = sum(repeat for _, repeat in runs) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    cut = data.draw(st.sampled_from([0, 0, 0, 1, 7]))
    body = body[: len(body) - cut]
    by_runs, one_by_one = record_bodies_both_ways(body, max(count, 1))
    assert by_runs == one_by_one
    if count > 0 and not cut and count == sum(repeat for _, repeat in runs):
        assert by_runs != CorruptRecordError and by_runs[1] == [length for length, repeat in runs for _ in range(repeat)]


def test_padded_length_varints_walk_the_same_way_with_or_without_runs():
    # 0x82 0x00 is 2 (a length of 1) padded to two bytes, which a varint reader accepts. A run is
    # the records that begin with the very bytes of the one before, not merely its length's.
    assert record_bodies_both_ways(bytes([0x82, 0, 0x41, 0, 0x41]), 2) == [CorruptRecordError] * 2
    padded = bytes([0x82, 0x00, 0x41]) * 40
    assert record_bodies_both_ways(padded, 40) == [([3 * i + 2 for i in range(40)], [1] * 40)] * 2
    mixed = bytes([0x82, 0x00, 0x41]) * 20 + bytes([0x02, 0x41]) * 20
    assert record_bodies_both_ways(mixed, 40)[0] == record_bodies_both_ways(mixed, 40)[1]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 80))
def test_any_bytes_walk_the_same_way_with_or_without_runs(data, count):
    by_runs, one_by_one = record_bodies_both_ways(data, count)
    assert by_runs == one_by_one


def test_headers_of_a_slice_and_of_null_maps_that_span_entries_are_written_as_kafka_reads_them():
    headers = pa.MapArray.from_arrays(
        pa.array([0, 1, 3, 3, 5], pa.int32()), pa.array(["a", "b", "c", "hidden", "gone"]),
        pa.array([b"1", None, b"3", b"x", b"y"]), type=rb.HEADERS_TYPE,
        mask=pa.array([False, False, True, True]),  # the last two are null, the last one over two entries
    )
    count = len(headers)
    batch = pa.RecordBatch.from_arrays([pa.array([None] * count, pa.binary()), pa.array([b"v%d" % i for i in range(count)]),
                                        pa.array([BASE_MS] * count, pa.int64()), headers], schema=rb.SCHEMA)
    [(header, _)] = rb.decode_batches(rb.frame_record_batch(batch, base_offset=10))
    # The whole batch and a slice over the null that spans entries (written map by map); slices
    # without it (written all at once, from an offset into the maps).
    for records, first in ((batch, 0), (batch.slice(1, 3), 1), (batch.slice(1, 2), 1), (batch.slice(0, 2), 0)):
        expected = [[("a", b"1")], [("b", None), ("c", b"3")], [], []][first : first + len(records)]
        assert [headers for *_, headers in kafka_rows(kr.encode_kafka_batch(header, records))] == expected


def test_empty_and_null_header_maps_write_no_headers_and_a_long_run_of_headers_reads_back():
    headers = pa.array([[], None, []], rb.HEADERS_TYPE)
    batch = pa.RecordBatch.from_arrays([pa.array([None] * 3, pa.binary()), pa.array([b"a", b"b", b"c"]),
                                        pa.array([BASE_MS] * 3, pa.int64()), headers], schema=rb.SCHEMA)
    [(header, _)] = rb.decode_batches(rb.frame_record_batch(batch))
    assert [h for *_, h in kafka_rows(kr.encode_kafka_batch(header, batch))] == [[], [], []]
    # One record with many headers among records with few: rounds, then one header at a time.
    many = [("h%d" % j, None if j % 7 == 0 else b"%d" % j) for j in range(3_000)]
    records = [(None, b"v%d" % i, BASE_MS, many if i == 5 else [("t", b"%d" % i)] * (i % 3)) for i in range(40)]
    produced = kr.to_logbus(kafka_batch(records))
    _, rows = logbus_rows(produced.encoded)
    assert [r["headers"] for r in rows] == [h or None for *_, h in records]


def test_translating_batches_does_not_import_pandas():
    # pyarrow imports pandas, when installed, the first time pa.array or to_numpy runs: a stall of
    # about a second and tens of MiB in a gateway process that never needs it.
    script = """
import sys
from kafka.record.default_records import DefaultRecordBatchBuilder
from logbus.protocol import kafka_records as kr
builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                    producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
for i in range(50):
    builder.append(i, timestamp=1_700_000_000_000 + i, key=None if i % 2 else b"k%d" % i, value=b"v" * i,
                   headers=[("trace", b"t%d" % i), ("none", None)] if i % 3 == 0 else [])
produced = kr.to_logbus(bytes(builder.build()))
assert kr.to_kafka(produced.encoded)
print("pandas" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=pathlib.Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def unsigned_varint(raw: int) -> bytes:
    out = bytearray()
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    return bytes(out + bytes([raw]))


uint64s = st.integers(0, 2**64 - 1) | st.integers(0, 300) | st.sampled_from([127, 128, 16383, 16384, 2**63, 2**64 - 1])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12).flatmap(lambda rows: st.lists(
    st.lists(st.tuples(uint64s, st.booleans()), min_size=rows, max_size=rows) | st.tuples(uint64s).map(lambda v: [(v[0], True)] * rows),
    min_size=1, max_size=5)))
def test_varint_rows_write_each_rows_varints_field_after_field(fields):
    # Each field: a value per row (some fields one value in every row) and whether the row writes it.
    rows = len(fields[0])
    arrays = []
    for field in fields:
        raw = np.array([value for value, _ in field], np.uint64)
        sizes = np.array([len(unsigned_varint(value)) if written else 0 for value, written in field], np.int64)
        assert kr._varint_sizes(raw).tolist() == [len(unsigned_varint(value)) for value, _ in field]
        arrays.append((raw, sizes))
    data, row_sizes = kr._varint_rows(arrays, rows)
    expected = [b"".join(unsigned_varint(field[row][0]) for field in fields if field[row][1]) for row in range(rows)]
    assert data.tobytes() == b"".join(expected)
    assert row_sizes.tolist() == [len(row) for row in expected]


def test_a_keyed_and_a_keyless_batch_of_ten_thousand_records_read_back_through_kafka_python():
    # The two layouts the writer takes: no key anywhere (one piece before each value) and keys.
    values = [bytes([i % 251]) * (i % 300) for i in range(10_000)]
    for keys in ([None] * 10_000, [b"key-%d" % i if i % 3 else None for i in range(10_000)]):
        table = pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary())})
        kafka = kr.to_kafka(rb.encode_table(table))
        batch = DefaultRecordBatch(kafka)
        assert batch.validate_crc()
        read = list(batch)
        assert [r.key for r in read] == keys
        assert [r.value for r in read] == values
        assert [r.offset for r in read] == list(range(10_000))


def test_markers_and_transactional_batches_reach_kafka_clients_with_kafkas_bits():
    data = kr.to_logbus(kafka_batch(RECORDS, producer_id=7, producer_epoch=3, base_sequence=0, transactional=True)).encoded
    marker = rb.encode_control_batch(7, 3, True, 5, BASE_MS)
    out = kr.to_kafka(data + marker)
    first = DefaultRecordBatch(out[: kr.read_header(out, 0).size_bytes])
    assert first.is_transactional and not first.is_control_batch and first.producer_id == 7
    second = DefaultRecordBatch(out[kr.read_header(out, 0).size_bytes :])
    assert second.is_transactional and second.is_control_batch and (second.producer_id, second.producer_epoch) == (7, 3)
    [record] = list(second)
    assert (record.key, record.value) == (struct.pack(">hh", 0, 1), struct.pack(">hi", 0, 5))  # COMMIT, coordinator epoch 5
