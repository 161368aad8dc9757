"""Kafka v2 record batches <-> logbus batches: what the Kafka gateway does to records. No Ray, no I/O.

A Kafka client produces Kafka's record batch format (magic 2, KIP-98); logbus
stores Arrow batches (``storage/record_batch.py``). The gateway turns each
Kafka batch of a produce request into exactly one logbus batch with the same
records, and each logbus batch a fetch returns into one Kafka batch, so both
kinds of client see the same offsets, keys, values, headers and timestamps:

- offsets: a Kafka batch's records take consecutive offsets from the batch's
  base offset, as a logbus batch's do; a fetched logbus batch becomes a Kafka
  batch with the same base offset and record count;
- the idempotent producer's id, epoch and base sequence go from the Kafka
  batch header into the logbus header unchanged, so the leader's
  de-duplication applies to Kafka producers' retries as to logbus's;
- timestamps: a record's timestamp is the batch's base timestamp plus its
  delta; a LogAppendTime logbus batch becomes a Kafka batch with the
  timestamp-type bit set and the append time as its max timestamp (which is
  what Kafka consumers report for every record of such a batch);
- headers: Kafka's (key, value) pairs become logbus's ``map<string, binary>``
  entries in their order (keys must be UTF-8, as Kafka's Java client makes
  them); a record without headers has null headers.

Kafka batch layout (big-endian)::

    position  size  field
    0         8     baseOffset
    8         4     batchLength            bytes after this field
    12        4     partitionLeaderEpoch
    16        1     magic                  2
    17        4     crc                    CRC32C of bytes [21, 12 + batchLength)
    21        2     attributes             bits 0-2 codec, 3 timestamp type, 4 transactional, 5 control
    23        4     lastOffsetDelta
    27        8     baseTimestamp
    35        8     maxTimestamp
    43        8     producerId
    51        2     producerEpoch
    53        4     baseSequence
    57        4     recordCount
    61              records (compressed as a whole when the codec is not 0)

    record: length varint, attributes int8, timestampDelta varlong, offsetDelta varint,
            keyLength varint, key, valueLength varint, value, headerCount varint,
            headers (keyLength varint, key, valueLength varint, value); all varints zigzag

Produce requests may use any of Kafka's codecs (gzip, snappy in its raw or
xerial framing, LZ4 frames, zstd: all through ``cramjam``); decompression
writes into a buffer of the size the caller allows (at most
``DECOMPRESSED_MAX_BYTES``), so a small frame cannot expand without limit:
records that would expand past it raise
:class:`~logbus.errors.RecordTooLargeError` (Kafka's MESSAGE_TOO_LARGE). Fetch replies are uncompressed (the gateway runs beside its clients'
brokers; a codec would cost CPU on both ends to save loopback bytes).

Speed. Records are variable-length, so finding where each begins walks the
records (one varint each), except through runs of records of one size, which
numpy finds at once (see ``_record_bodies``); everything else is done per
field for all records at once with numpy (varints, offsets, timestamps), and
keys and values are gathered by Arrow (``take`` when reading,
``binary_join_element_wise`` when writing), not copied one by one; so are
headers, read in rounds (every record's first header, then every second
one, ...) and written all at once.

Errors: a batch that fails a length, CRC or format check (among them: a
record count larger than its bytes can hold, at ``MIN_RECORD_BYTES`` a record) raises
:class:`~logbus.errors.CorruptRecordError` (Kafka's CORRUPT_MESSAGE); one that
is well-formed but not acceptable (control batches, a transactional batch
with no producer id, offset deltas out of order, a header key that is not UTF-8) raises
:class:`~logbus.errors.InvalidRecordError` (Kafka's INVALID_RECORD). Nothing
is returned for a batch that failed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

import cramjam
import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logbus.errors import CorruptRecordError, InvalidRecordError, RecordTooLargeError
from logbus.invariant import check
from logbus.storage import record_batch as rb

KAFKA_MAGIC = 2
HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
LOG_OVERHEAD = 12  # baseOffset and batchLength: the bytes batchLength does not count
CRC_START = 21  # the CRC covers attributes to the end
MIN_BATCH_LENGTH = HEADER_SIZE - LOG_OVERHEAD
# The smallest record: its length, attributes, timestamp delta, offset delta, key length, value
# length and header count, one byte each (null key and value, no headers). A batch claiming more
# records than its bytes can hold is refused before anything is allocated per record.
MIN_RECORD_BYTES = 7
assert HEADER_SIZE == 61, "Kafka's batch header is 61 bytes"

# Attributes.
CODEC_MASK = 0x07
TIMESTAMP_TYPE_BIT = 0x08
TRANSACTIONAL_BIT = 0x10
CONTROL_BIT = 0x20
CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD = range(5)
CODEC_NAMES = {CODEC_NONE: None, CODEC_GZIP: "gzip", CODEC_SNAPPY: "snappy", CODEC_LZ4: "lz4", CODEC_ZSTD: "zstd"}

DECOMPRESSED_MAX_BYTES = 256 << 20  # a compressed batch may expand to at most this much
RECORDS_MAX = 2**31 - 1
_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = 16  # magic, version int32, compatible version int32
_U64 = np.uint64
_SEVEN = np.uint64(7)
_LOW7 = np.uint64(0x7F)


@dataclass(frozen=True, slots=True)
class KafkaBatchHeader:
    """The header fields of one Kafka batch (see the module docstring)."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def size_bytes(self) -> int:
        return LOG_OVERHEAD + self.batch_length

    @property
    def codec(self) -> int:
        return self.attributes & CODEC_MASK


@dataclass(frozen=True, slots=True)
class ProducedBatch:
    """A Kafka batch from a produce request, as the logbus batch to append."""

    header: KafkaBatchHeader
    encoded: bytes  # the framed logbus batch
    record_count: int
    max_timestamp_ms: int
    decompressed_bytes: int = 0  # what the records decompressed to (0: they were not compressed)


# --- reading Kafka batches ---------------------------------------------------------------------------


def read_header(data, position: int = 0) -> KafkaBatchHeader:
    """The header of the Kafka batch at ``position``, with its lengths checked (not its CRC)."""
    available = len(data) - position
    if available < HEADER_SIZE:
        raise CorruptRecordError(f"Kafka batch header at position {position} is cut short ({available} of {HEADER_SIZE} bytes)")
    header = KafkaBatchHeader(*HEADER.unpack_from(data, position))
    if header.magic != KAFKA_MAGIC:
        raise CorruptRecordError(f"Kafka batch at position {position} has magic {header.magic}; only record batches (magic 2) are accepted")
    if header.batch_length < MIN_BATCH_LENGTH or header.size_bytes > available:
        raise CorruptRecordError(
            f"Kafka batch at position {position} claims {header.batch_length} bytes; {available - LOG_OVERHEAD} are there"
        )
    if header.record_count < 0 or (header.record_count and header.last_offset_delta != header.record_count - 1):
        raise CorruptRecordError(
            f"Kafka batch at position {position}: {header.record_count} records with last offset delta {header.last_offset_delta}"
        )
    records_bytes = header.batch_length - MIN_BATCH_LENGTH
    if header.codec == CODEC_NONE and header.record_count > records_bytes // MIN_RECORD_BYTES:
        raise CorruptRecordError(
            f"Kafka batch at position {position} claims {header.record_count} records in {records_bytes} bytes"
        )
    return header


def iter_batches(data) -> Iterator[tuple[int, KafkaBatchHeader]]:
    """(position, header) of each batch in a buffer of whole Kafka batches (a produce request's records)."""
    view = memoryview(data).cast("B")
    position = 0
    while position < len(view):
        header = read_header(view, position)
        yield position, header
        position += header.size_bytes


# What cramjam's errors say when the output buffer is full: Rust's io::ErrorKind::WriteZero (gzip,
# LZ4 frames, zstd) and snappy's own check of the raw length. Any other error means damaged data.
_OUTPUT_FULL = ("failed to write whole buffer", "is smaller than required")


def _decompress(codec: int, payload: memoryview, limit: int) -> bytes:
    """The records of a compressed batch; RecordTooLargeError if they expand to ``limit`` bytes or more."""
    out = np.empty(limit, np.uint8)  # untouched pages cost nothing: only what is written is backed
    name = CODEC_NAMES.get(codec)
    try:
        if codec == CODEC_GZIP:
            size = cramjam.gzip.decompress_into(payload, out)
        elif codec == CODEC_SNAPPY:
            size = _snappy_into(payload, out)
        elif codec == CODEC_LZ4:
            size = cramjam.lz4.decompress_into(payload, out)
        elif codec == CODEC_ZSTD:
            size = cramjam.zstd.decompress_into(payload, out)
        else:
            raise CorruptRecordError(f"unknown compression codec {codec}")
    except cramjam.DecompressionError as error:
        if any(text in str(error) for text in _OUTPUT_FULL):
            raise RecordTooLargeError(f"{name} records expand past {limit} bytes") from None
        raise CorruptRecordError(f"{name} records do not decompress: {error}") from None
    if size >= limit:
        raise RecordTooLargeError(f"{name} records expand past {limit} bytes")
    return out[:size].tobytes()


def _snappy_into(payload: memoryview, out: np.ndarray) -> int:
    """Raw snappy (librdkafka) or xerial's framing of raw blocks (Kafka's Java client)."""
    if bytes(payload[:8]) != _XERIAL_MAGIC:
        return cramjam.snappy.decompress_raw_into(payload, out)
    position, written = _XERIAL_HEADER, 0
    while position < len(payload):
        if position + 4 > len(payload):
            raise CorruptRecordError("xerial snappy block length is cut short")
        (length,) = struct.unpack_from(">i", payload, position)
        position += 4
        if length < 0 or position + length > len(payload):
            raise CorruptRecordError("xerial snappy block runs past the records")
        written += cramjam.snappy.decompress_raw_into(payload[position : position + length], out[written:])
        position += length
    return written


def _int64_array(values: np.ndarray) -> pa.Array:
    """``values`` as an Arrow int64 array, built from its buffer.

    ``pa.array`` and ``Array.to_numpy`` import pandas on first use when it is
    installed (to look for a Series): a second's stall and tens of MiB in a
    gateway that never needs it. Building from buffers does not.
    """
    values = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(pa.int64(), values.size, [None, pa.py_buffer(values)])


def _int64_values(array: pa.Array) -> np.ndarray:
    """The values of an int64 array without nulls, as a numpy view of its buffer (see :func:`_int64_array`)."""
    if array.null_count:
        raise InvalidRecordError("a batch has records without a timestamp")
    return np.frombuffer(array.buffers()[1], np.int64)[array.offset : array.offset + len(array)]


def _zigzag_decode(raw: np.ndarray) -> np.ndarray:
    return (raw >> np.uint64(1)).astype(np.int64) ^ -(raw & np.uint64(1)).astype(np.int64)


def _read_varints(buf: np.ndarray, positions: np.ndarray, ends: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Zigzag varints at ``positions`` (one per record), each within its record's ``ends``: (values, sizes)."""
    if positions.size and not (positions < ends).all():
        raise CorruptRecordError("a record ends in the middle of its fields")
    first = buf[positions]
    raw = (first & 0x7F).astype(_U64)
    sizes = np.ones(positions.size, np.int64)
    active = np.flatnonzero(first & 0x80)
    shift = 7
    while active.size:
        if shift >= 7 * max_bytes:
            raise CorruptRecordError("a varint in a record is too long")
        at = positions[active] + sizes[active]
        if not (at < ends[active]).all():
            raise CorruptRecordError("a record ends in the middle of a varint")
        more = buf[at]
        raw[active] |= (more & 0x7F).astype(_U64) << np.uint64(shift)
        sizes[active] += 1
        active = active[(more & 0x80) != 0]
        shift += 7
    return _zigzag_decode(raw), sizes


_RUN_PROBE_FIRST = 64  # records a first look for a run of one size checks; each look after a full one doubles it
_RUN_PROBE_MAX = 8192
_RUN_MIN = 16  # a look that finds a shorter run backs off: more records one by one before the next


def _record_bodies(data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each record's body starts and how long it is.

    Each record begins with its length (a zigzag varint): nothing else tells
    where the next one starts, so this walks the records one by one, except
    where they come in runs of one size, as records of same-sized keys and
    values do (their size still steps where the varint of the offset delta, or
    of the timestamp delta, grows: at 64 and 8,192 records or milliseconds). After a record, the bytes where the next ones would start
    if they were its size are compared, with numpy, to its length prefix; each
    that matches is a record of the same length, so a run of them is taken at
    once. Where runs are short (records of many sizes) the looks back off.
    """
    starts = np.empty(count, np.int64)
    lengths = np.empty(count, np.int64)
    buf = np.frombuffer(data, np.uint8)
    end = len(data)
    position = i = 0
    stretch = 1  # records to walk one by one before the next look for a run
    backoff = 8
    try:
        while i < count:
            walked_starts, walked_lengths = [], []
            first = i
            for i in range(i, min(count, i + stretch)):
                head = position
                b = data[position]
                if b < 0x80:
                    n = b
                    position += 1
                else:
                    b1 = data[position + 1]
                    if b1 < 0x80:
                        n = (b & 0x7F) | (b1 << 7)
                        position += 2
                    else:
                        n, size = _varint_at(data, position)
                        position += size
                length = (n >> 1) ^ -(n & 1)
                if length <= 0:
                    raise CorruptRecordError(f"record {i} has length {length}")
                walked_starts.append(position)
                walked_lengths.append(length)
                position += length
            i += 1
            starts[first:i] = walked_starts
            lengths[first:i] = walked_lengths
            if i == count:
                break
            # The last record walked: its length prefix, as written (a varint may be padded), from
            # ``head`` to where its body starts. Records that begin with these very bytes decode alike.
            size = walked_starts[-1] - head
            run = _same_size_run(buf, data, head, size, length, count - i, end)
            if run:
                stride = size + length
                starts[i : i + run] = np.arange(position + size, position + size + run * stride, stride, dtype=np.int64)
                lengths[i : i + run] = length
                position += run * stride
                i += run
            if run < _RUN_MIN:
                stretch, backoff = backoff, min(2 * backoff, 1024)
            else:
                stretch, backoff = 1, 8
    except IndexError:
        raise CorruptRecordError("the records are cut short") from None
    if position != end:
        raise CorruptRecordError(f"the records take {position} bytes; the batch holds {end}")
    return starts, lengths


def _same_size_run(buf: np.ndarray, data: bytes, head: int, size: int, length: int, left: int, end: int) -> int:
    """How many records right after the one at ``head`` start with its length prefix (so have its size)."""
    stride = size + length
    prefix = data[head : head + size]
    next_head = head + stride
    run = 0
    probe = _RUN_PROBE_FIRST
    while left > run:
        m = min(left - run, (end - next_head) // stride, probe)
        if m <= 0:
            break
        heads = next_head + np.arange(m, dtype=np.int64) * stride
        same = buf[heads] == prefix[0]
        for k in range(1, size):
            same &= buf[heads + k] == prefix[k]
        if not same.all():
            return run + int(np.argmin(same))
        run += m
        next_head += m * stride
        probe = min(2 * probe, _RUN_PROBE_MAX)
    return run


def _varint_at(data, position: int, max_bytes: int = 5) -> tuple[int, int]:
    """(raw unsigned value, size) of the varint at ``position``."""
    value = shift = 0
    for size in range(1, max_bytes + 1):
        b = data[position + size - 1]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, size
        shift += 7
    raise CorruptRecordError("a varint is too long")


def _binary_column(data: bytes, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A binary array of ``data[start:start + length]`` per record; length -1 is null.

    The pieces are gathered by Arrow, not by a Python loop: over ``data`` as it
    is, the offsets start0, end0, start1, end1, ... make a binary array whose
    even elements are the pieces (the odd ones are what lies between them), and
    ``take`` of the even ones copies them out, back to back.
    """
    count = starts.size
    nulls = lengths < 0
    sizes = np.where(nulls, 0, lengths)
    if int(sizes.sum()) >= 2**31 or len(data) >= 2**31:
        raise InvalidRecordError("a batch holds over 2 GiB of keys or values")
    if count == 0:
        return pa.Array.from_buffers(pa.binary(), 0, [None, pa.py_buffer(np.zeros(1, np.int32)), pa.py_buffer(b"")])
    bounds = np.empty(2 * count, np.int64)
    bounds[0::2] = starts
    bounds[1::2] = starts + sizes
    if bounds[0] < 0 or bounds[-1] > len(data) or np.any(bounds[1:] < bounds[:-1]):
        raise CorruptRecordError("a record's key or value lies outside the records, or out of order")
    spans = pa.Array.from_buffers(pa.binary(), 2 * count - 1, [None, pa.py_buffer(bounds.astype(np.int32)), pa.py_buffer(data)])
    pieces = spans.take(_int64_array(np.arange(0, 2 * count, 2, dtype=np.int64)))
    validity = None
    null_count = int(nulls.sum())
    if null_count:
        validity = pa.py_buffer(np.packbits(~nulls, bitorder="little"))
    _, offsets, joined = pieces.buffers()
    return pa.Array.from_buffers(pa.binary(), count, [validity, offsets, joined], null_count=null_count)


_HEADER_ROUND_MIN = 16  # records still reading headers for a round with numpy to pay; fewer go one header at a time


def _headers_column(data: bytes, starts: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> pa.Array:
    """The headers of every record (null where a record has none), read for all records at once.

    A record's headers follow one another, so they are read in rounds: the
    first header of every record that has one, then the second, and so on,
    each round with numpy. Once few records are left with more headers (one
    record with thousands, say), those are read one header at a time, so the
    work stays linear in the headers.
    """
    count = starts.size
    room = ends - starts
    if (counts * 2 > room).any():  # a header takes two bytes at least: refused before anything is allocated
        raise CorruptRecordError("a record claims more headers than its bytes hold")
    if not (room[counts == 0] == 0).all():
        raise CorruptRecordError("a record has bytes left after its fields")
    buf = np.frombuffer(data, np.uint8)
    bounds = np.zeros(count + 1, np.int64)
    np.cumsum(counts, out=bounds[1:])
    total = int(bounds[-1])
    key_starts, key_lengths = np.empty(total, np.int64), np.empty(total, np.int64)
    value_starts, value_lengths = np.empty(total, np.int64), np.empty(total, np.int64)
    holders = np.flatnonzero(counts)
    position = starts[holders].copy()
    round_ = 0
    while holders.size >= _HEADER_ROUND_MIN:
        end = ends[holders]
        key_length, size = _read_varints(buf, position, end, 5)
        position = position + size
        if (key_length < 0).any() or (position + key_length > end).any():
            raise CorruptRecordError("a header key runs past its record")
        at = bounds[holders] + round_
        key_starts[at], key_lengths[at] = position, key_length
        position = position + key_length
        value_length, size = _read_varints(buf, position, end, 5)
        position = position + size
        if (value_length < -1).any() or (position + np.maximum(value_length, 0) > end).any():
            raise CorruptRecordError("a header value runs past its record")
        value_starts[at], value_lengths[at] = position, value_length
        position = position + np.maximum(value_length, 0)
        round_ += 1
        more = counts[holders] > round_
        if not (position[~more] == end[~more]).all():
            raise CorruptRecordError("a record has bytes left after its headers")
        holders, position = holders[more], position[more]
    for record, at in zip(holders.tolist(), position.tolist()):
        end = int(ends[record])
        try:
            for entry in range(int(bounds[record]) + round_, int(bounds[record + 1])):
                raw, size = _varint_at(data, at)
                key_length = (raw >> 1) ^ -(raw & 1)
                at += size
                if key_length < 0 or at + key_length > end:
                    raise CorruptRecordError("a header key runs past its record")
                key_starts[entry], key_lengths[entry] = at, key_length
                at += key_length
                raw, size = _varint_at(data, at)
                value_length = (raw >> 1) ^ -(raw & 1)
                at += size
                if value_length < -1 or at + max(value_length, 0) > end:
                    raise CorruptRecordError("a header value runs past its record")
                value_starts[entry], value_lengths[entry] = at, value_length
                at += max(value_length, 0)
        except IndexError:
            raise CorruptRecordError("a record's headers are cut short") from None
        if at != end:
            raise CorruptRecordError("a record has bytes left after its headers")
    try:
        keys = _binary_column(data, key_starts, key_lengths).cast(pa.string())
    except pa.ArrowInvalid:
        raise InvalidRecordError("a header key is not UTF-8") from None
    values = _binary_column(data, value_starts, value_lengths)
    without = pa.Array.from_buffers(pa.bool_(), count, [None, pa.py_buffer(np.packbits(counts == 0, bitorder="little"))])
    offsets = pa.Array.from_buffers(pa.int32(), count + 1, [None, pa.py_buffer(bounds.astype(np.int32))])
    return pa.MapArray.from_arrays(offsets, keys, values, type=rb.HEADERS_TYPE, mask=without)  # null: no headers


def decode_records(header: KafkaBatchHeader, records: bytes) -> pa.RecordBatch:
    """The records of one (decompressed) Kafka batch as an Arrow batch of logbus's schema."""
    count = header.record_count
    if count == 0:
        raise InvalidRecordError("a Kafka batch without records")
    if count > len(records) // MIN_RECORD_BYTES:
        # Checked again after decompression: the header's count is the client's word, and the
        # per-record work below allocates for that many records.
        raise CorruptRecordError(f"a Kafka batch claims {count} records in {len(records)} bytes of records")
    starts, body_lengths = _record_bodies(records, count)
    buf = np.frombuffer(records, np.uint8)
    ends = starts + body_lengths
    position = starts + 1  # past the record's attributes (unused, as in Kafka)
    if not (position <= ends).all():
        raise CorruptRecordError("a record ends before its fields")
    timestamp_deltas, sizes = _read_varints(buf, position, ends, 10)
    position += sizes
    offset_deltas, sizes = _read_varints(buf, position, ends, 5)
    position += sizes
    if not np.array_equal(offset_deltas, np.arange(count)):
        raise InvalidRecordError("the records' offset deltas are not 0, 1, 2, ...")
    key_lengths, sizes = _read_varints(buf, position, ends, 5)
    position += sizes
    key_starts = position
    position = position + np.maximum(key_lengths, 0)
    value_lengths, sizes = _read_varints(buf, position, ends, 5)
    position += sizes
    value_starts = position
    position = position + np.maximum(value_lengths, 0)
    header_counts, sizes = _read_varints(buf, position, ends, 5)
    position += sizes
    if (key_lengths < -1).any() or (value_lengths < -1).any() or (header_counts < 0).any():
        raise CorruptRecordError("a record has a negative length")
    if not (position <= ends).all():
        raise CorruptRecordError("a record's key or value runs past the record")
    if header_counts.any():
        headers = _headers_column(records, position, header_counts, ends)
    else:
        if not np.array_equal(position, ends):
            raise CorruptRecordError("a record has bytes left after its fields")
        headers = pa.nulls(count, rb.HEADERS_TYPE)
    timestamps = _int64_array(timestamp_deltas + header.base_timestamp)
    return pa.RecordBatch.from_arrays(
        [_binary_column(records, key_starts, key_lengths), _binary_column(records, value_starts, value_lengths), timestamps, headers],
        schema=rb.SCHEMA,
    )


def decode_batch(data, position: int = 0, *, decompressed_max_bytes: int = DECOMPRESSED_MAX_BYTES) -> tuple[KafkaBatchHeader, pa.RecordBatch]:
    """Check (lengths, CRC, attributes) and decode the Kafka batch at ``position``: (header, records)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    header, records = _checked_records(view, position, decompressed_max_bytes)
    return header, decode_records(header, records)


def _checked_records(view: memoryview, position: int, decompressed_max_bytes: int) -> tuple[KafkaBatchHeader, bytes]:
    """The header and the (decompressed) record bytes of the batch at ``position``, its lengths, CRC and attributes checked."""
    header = read_header(view, position)
    end = position + header.size_bytes
    if crc32c.crc32c(view[position + CRC_START : end]) != header.crc:
        raise CorruptRecordError(f"Kafka batch at position {position} fails its CRC")
    if header.attributes & CONTROL_BIT:
        raise InvalidRecordError("control batches (transaction markers) cannot be produced")
    if header.attributes & TRANSACTIONAL_BIT and header.producer_id < 0:
        raise InvalidRecordError("a transactional batch needs the producer id of its transactional producer")
    payload = view[position + HEADER_SIZE : end]
    codec = header.codec
    return header, bytes(payload) if codec == CODEC_NONE else _decompress(codec, payload, decompressed_max_bytes)


def to_logbus(data, *, decompressed_max_bytes: int = DECOMPRESSED_MAX_BYTES) -> ProducedBatch:
    """The one Kafka batch of a produce request's partition data as the logbus batch to append.

    Kafka requires exactly one batch per partition in a produce request of
    magic 2 (InvalidRecordError otherwise), which keeps an idempotent
    producer's batch and its sequence numbers one unit here too. Compressed
    records that expand to ``decompressed_max_bytes`` or more raise
    RecordTooLargeError.
    """
    view = memoryview(data).cast("B")
    header = read_header(view, 0)
    if header.size_bytes != len(view):
        raise InvalidRecordError("a produce request carries exactly one record batch per partition")
    header, raw = _checked_records(view, 0, decompressed_max_bytes)
    records = decode_records(header, raw)
    timestamps = _int64_values(records.column(2))
    timestamp_range = (int(timestamps[0]), int(timestamps.max()))
    encoded = rb.frame_record_batch(
        records,
        producer_id=header.producer_id,
        producer_epoch=header.producer_epoch,
        base_sequence=header.base_sequence,
        timestamp_range=timestamp_range,
        transactional=bool(header.attributes & TRANSACTIONAL_BIT),  # visible to read_committed once its marker commits
    )
    return ProducedBatch(header, encoded, header.record_count, timestamp_range[1], 0 if header.codec == CODEC_NONE else len(raw))


# --- writing Kafka batches -------------------------------------------------------------------------


def _zigzag(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.int64, copy=False)
    return ((values << 1) ^ (values >> 63)).view(_U64)


def _varint_sizes(raw: np.ndarray) -> np.ndarray:
    """The byte count of each zigzagged value's varint."""
    sizes = np.ones(raw.size, np.int64)
    if not raw.size:
        return sizes
    top = int(raw.max())
    bound = 1 << 7
    while top >= bound:
        sizes += raw >= np.uint64(bound)
        bound <<= 7
    return sizes


def _varint_rows(fields: list[tuple[np.ndarray, np.ndarray]], count: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's varints, field after field: the bytes of every row back to back, and each row's byte count.

    ``fields`` are pairs of zigzagged values and their varint sizes, one per
    row; a size of 0 writes nothing for that row. The varints are written a
    byte column at a time into a matrix as wide as the fields' longest
    varints; the bytes each row uses are then taken out of it in row order.
    A field with one value in every row is written as constant columns.
    """
    widths = [int(sizes.max()) if count else 0 for _, sizes in fields]
    matrix = np.empty((count, sum(widths)), np.uint8)
    used = np.ones(matrix.shape, np.bool_)
    ragged = False
    column = 0
    row_sizes = np.zeros(count, np.int64)
    for (raw, sizes), width in zip(fields, widths):
        row_sizes += sizes
        if not width:
            continue
        uniform = int(sizes.min()) == width
        if uniform and int(raw.min()) == int(raw.max()):
            value = int(raw[0])
            for k in range(width):
                matrix[:, column + k] = (value >> (7 * k)) & 0x7F | (0x80 if k + 1 < width else 0)
            column += width
            continue
        rest = raw
        for k in range(width):
            piece = (rest & _LOW7).astype(np.uint8)
            if uniform:
                if k + 1 < width:
                    piece |= 0x80
            else:
                piece |= (sizes > k + 1).view(np.uint8) << 7
                np.greater(sizes, k, out=used[:, column + k])
                ragged = True
            matrix[:, column + k] = piece
            rest = rest >> _SEVEN
        column += width
    return (matrix[used] if ragged else matrix.reshape(-1)), row_sizes


def _varint_bytes(value: int) -> bytes:
    raw = (value << 1) ^ (value >> 63)
    out = bytearray()
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)
    return bytes(out)


def _offsets(array: pa.Array) -> np.ndarray:
    """The offsets of a binary, string or map array (``len + 1`` of them, absolute into its data), as int64."""
    return np.frombuffer(array.buffers()[1], np.int32)[array.offset : array.offset + len(array) + 1].astype(np.int64)


def _null_mask(array: pa.Array) -> np.ndarray:
    """True where ``array`` is null, from its validity bitmap (``is_null()`` would import pandas)."""
    bits = np.unpackbits(np.frombuffer(array.buffers()[0], np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)] == 0


def _join(*pieces: pa.Array) -> pa.Array:
    """Each row's pieces laid end to end (``binary_join_element_wise``), nulls as nothing.

    The separator is an array of empty values: a Python ``b""`` would go
    through ``pa.scalar``, which imports pandas.
    """
    empty = _binary_array(np.zeros(0, np.uint8), np.zeros(len(pieces[0]), np.int64))
    return pc.binary_join_element_wise(*pieces, empty, null_handling="replace", null_replacement="")


def _binary_lengths(array: pa.Array) -> np.ndarray:
    """The length of each value of a binary array, -1 for null."""
    count = len(array)
    lengths = np.diff(_offsets(array))
    if array.null_count:
        lengths[_null_mask(array)] = -1
    return lengths


def _header_blobs(headers: pa.Array) -> tuple[np.ndarray, pa.Array | None]:
    """Per record: its header count, and a binary array of its encoded header entries (None: no headers).

    Every entry of every record is encoded at once, as the records' fields
    are (varints with numpy, ``binary_join_element_wise`` for key length, key,
    value length, value); the entries of a record lie back to back, so a
    record's part is a span of the joined bytes, cut by the map's offsets.
    """
    count = len(headers)
    if headers.null_count == count:
        return np.zeros(count, np.int64), None
    offsets = _offsets(headers)
    counts = np.diff(offsets)
    if headers.null_count:
        nulls = _null_mask(headers)
        if counts[nulls].any():
            return _header_blobs_one_by_one(headers)  # a null that spans entries (not how logbus writes them)
    first, last = int(offsets[0]), int(offsets[-1])
    if first == last:
        return np.zeros(count, np.int64), None  # only empty or null maps: no headers to write
    pairs = headers.values  # the maps' (key, value) structs; field() applies the struct's own offset
    keys = pairs.field(0).slice(first, last - first)
    values = pairs.field(1).slice(first, last - first)
    if keys.null_count:
        raise InvalidRecordError("a header has a null key")
    key_lengths, value_lengths = _binary_lengths(keys), _binary_lengths(values)
    key_raw, value_raw = _zigzag(key_lengths), _zigzag(value_lengths)
    entry_count = len(keys)
    before = _binary_array(*_varint_rows([(key_raw, _varint_sizes(key_raw))], entry_count))
    between = _binary_array(*_varint_rows([(value_raw, _varint_sizes(value_raw))], entry_count))
    entries = _join(before, keys.view(pa.binary()), between, values)
    record_offsets = _offsets(entries)[offsets - first].astype(np.int32)
    if headers.null_count:
        counts[nulls] = 0
    return counts, pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(record_offsets), entries.buffers()[2]])


def _header_blobs_one_by_one(headers: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """:func:`_header_blobs` record by record, for maps whose null slots span entries."""
    count = len(headers)
    counts = np.zeros(count, np.int64)
    blobs: list[bytes] = [b""] * count
    for i, entries in enumerate(headers.to_pylist()):
        if not entries:
            continue
        parts = []
        for key, value in entries:
            key_bytes = key.encode()
            parts += [_varint_bytes(len(key_bytes)), key_bytes]
            parts += [_varint_bytes(-1)] if value is None else [_varint_bytes(len(value)), value]
        counts[i] = len(entries)
        blobs[i] = b"".join(parts)
    sizes = np.array([len(b) for b in blobs], np.int64)
    return counts, _binary_array(np.frombuffer(b"".join(blobs), np.uint8), sizes)


def _binary_array(buffer: np.ndarray, sizes: np.ndarray) -> pa.Array:
    """A binary array whose values are ``buffer`` cut into pieces of ``sizes`` bytes."""
    offsets = np.zeros(sizes.size + 1, np.int32)
    np.cumsum(sizes, out=offsets[1:])
    return pa.Array.from_buffers(pa.binary(), sizes.size, [None, pa.py_buffer(offsets), pa.py_buffer(buffer)])


def encode_kafka_batch(header: rb.BatchHeader, records: pa.RecordBatch) -> bytes:
    """One logbus batch (its header and its whole Arrow batch) as one uncompressed Kafka batch."""
    return b"".join(_kafka_batch_parts(header, records))


def _kafka_batch_parts(header: rb.BatchHeader, records: pa.RecordBatch) -> tuple:
    """:func:`encode_kafka_batch`'s batch in the parts it is built in (header, records, last byte), not yet joined.

    A Kafka record is its varint fields, then its key, a varint, its value, then
    its headers. The varints of every record are written at once with numpy
    (:func:`_varint_rows`) into pieces: the record's fields up to its key's
    length (and the value's length too when no record has a key), preceded by
    the previous record's header count when there are no headers to write;
    then, with keys, the value's length between key and value; with headers,
    the header count and the headers (encoded for all records at once by
    :func:`_header_blobs`) after the value. Arrow's
    ``binary_join_element_wise`` then lays the pieces out record after
    record, with no Python loop per record.
    """
    count = records.num_rows
    keys, values, timestamp_column, headers = (records.column(i) for i in range(4))
    timestamps = _int64_values(timestamp_column)
    base_timestamp = int(timestamps[0])
    timestamp_raw = _zigzag(timestamps - base_timestamp)
    offset_raw = _zigzag(np.arange(count, dtype=np.int64))
    key_lengths, value_lengths = _binary_lengths(keys), _binary_lengths(values)
    key_raw, value_raw = _zigzag(key_lengths), _zigzag(value_lengths)
    header_counts, header_blobs = _header_blobs(headers)
    header_raw = _zigzag(header_counts)
    header_bytes = np.zeros(count, np.int64) if header_blobs is None else _binary_lengths(header_blobs)

    sizes = [_varint_sizes(x) for x in (timestamp_raw, offset_raw, key_raw, value_raw, header_raw)]
    ts_size, off_size, key_size, value_size, hdr_size = sizes
    key_bytes, value_bytes = np.maximum(key_lengths, 0), np.maximum(value_lengths, 0)
    body = 1 + ts_size + off_size + key_size + key_bytes + value_size + value_bytes + hdr_size + header_bytes
    body_raw = _zigzag(body)
    length_size = _varint_sizes(body_raw)
    total = int((length_size + body).sum())

    # The first piece of each record: its length, attributes (0), timestamp delta, offset delta and
    # key length, and its value's length too when no record has a key. Without headers to write, a
    # record's last byte is its header count (0), written at the start of the next record's first
    # piece, and after the last record on its own.
    fields = []
    if header_blobs is None:
        previous_raw, previous_size = np.zeros(count, _U64), np.zeros(count, np.int64)
        previous_raw[1:], previous_size[1:] = header_raw[:-1], hdr_size[:-1]
        fields.append((previous_raw, previous_size))
    fields += [(body_raw, length_size), (np.zeros(count, _U64), np.ones(count, np.int64)), (timestamp_raw, ts_size),
               (offset_raw, off_size), (key_raw, key_size)]
    no_keys = keys.null_count == count
    if no_keys:
        fields.append((value_raw, value_size))
    pieces = [_binary_array(*_varint_rows(fields, count))]
    if not no_keys:
        pieces += [keys, _binary_array(*_varint_rows([(value_raw, value_size)], count))]
    pieces.append(values)
    if header_blobs is None:
        tail = _varint_bytes(int(header_counts[-1]))
    else:
        pieces += [_binary_array(*_varint_rows([(header_raw, hdr_size)], count)), header_blobs]
        tail = b""
    joined = _join(*pieces)
    records_bytes = memoryview(joined.buffers()[2]).cast("B")[: total - len(tail)]
    check(len(records_bytes) + len(tail) == total, f"a Kafka batch's records came to {len(records_bytes) + len(tail)} bytes, not {total}")

    log_append_time = header.timestamp_type == rb.TIMESTAMP_LOG_APPEND_TIME
    # The transactional and control bits are Kafka's own, at Kafka's positions: a transaction marker
    # (whose record already holds Kafka's ControlRecordKey and EndTransactionMarker) becomes Kafka's
    # control batch, which Kafka clients never hand to users.
    attributes = (TIMESTAMP_TYPE_BIT if log_append_time else 0) | (header.attributes & (TRANSACTIONAL_BIT | CONTROL_BIT))
    max_timestamp = header.max_timestamp_ms if log_append_time else int(timestamps.max())
    out = bytearray(HEADER_SIZE)
    HEADER.pack_into(
        out, 0, header.base_offset, HEADER_SIZE - LOG_OVERHEAD + total, header.leader_epoch, KAFKA_MAGIC, 0, attributes,
        count - 1, base_timestamp, max_timestamp, header.producer_id, header.producer_epoch, header.base_sequence, count,
    )
    crc = crc32c.crc32c(tail, crc32c.crc32c(records_bytes, crc32c.crc32c(memoryview(out)[CRC_START:])))
    struct.pack_into(">I", out, 17, crc)
    return out, records_bytes, tail


def to_kafka(buffer, *, verify_crc: bool = True) -> bytes:
    """A buffer of whole logbus batches (a fetch reply) as Kafka batches, one per logbus batch, uncompressed."""
    # One copy of every batch's bytes, into the reply, not one per batch and another for the reply.
    return b"".join(part for header, records in rb.decode_batches(buffer, verify_crc=verify_crc)
                    for part in _kafka_batch_parts(header, records))
