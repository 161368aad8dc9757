"""The frame header of a record batch: layout, checks and the leader's rewriting. Imports no Arrow.

A batch (see :mod:`logbus.storage.record_batch`) is a fixed little-endian frame
header followed by one Arrow IPC record batch message. Everything a replica does
on its hot path needs only the header: validating a produced batch (lengths,
CRC), assigning its offset and epoch, indexing it, and serving fetches as
whole batches. This module is that part; a replica's process loads Arrow only
when it must read records (timestamps lookups of LogAppendTime-less batches,
compaction), which keeps an idle replica's memory and start-up time close to a
plain actor's.

Frame header (all integers little-endian)::

    position  size  field
    0         8     base_offset        int64   assigned by the leader
    8         4     batch_length       int32   bytes after this field
    12        4     leader_epoch       int32   assigned by the leader
    16        1     magic              int8    format version, MAGIC_V1
    17        4     crc                uint32  CRC32C of bytes [21, 12 + batch_length)
    21        2     attributes         int16   bits 0-2 compression, bit 3 timestamp type,
                                               bit 4 transactional, bit 5 control (Kafka's)
    23        4     record_count       int32
    27        8     first_timestamp_ms int64   timestamp of the first record
    35        8     max_timestamp_ms   int64   largest timestamp in the batch
    43        8     producer_id        int64   -1 when not idempotent
    51        2     producer_epoch     int16
    53        4     base_sequence      int32   sequence number of the first record
    57        7     reserved           zero
    64              payload: one Arrow IPC record batch message

A transactional batch (bit 4) carries the producer id and epoch of its
transactional producer; its records are visible to read_committed readers
once the transaction's COMMIT marker is in the log, and never if it aborts. A
control batch (bits 4 and 5) is a transaction marker: one record whose key
and value are Kafka's ControlRecordKey and EndTransactionMarker (see
``record_batch.encode_control_batch``), base_sequence -1; readers never hand
it out.

The base offset and the leader epoch lie before the CRC field and outside the
CRC, as in Kafka, so the leader assigns them by rewriting 8 + 4 bytes of the
header without touching (or re-checksumming) the payload.

This module holds no state; every function is thread-safe.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

import crc32c

from logbus.errors import CorruptRecordError

MAGIC_V1 = 0x4C  # 'L'

# Field positions, each built from the one before it.
BASE_OFFSET_OFFSET = 0
BASE_OFFSET_LENGTH = 8
LENGTH_OFFSET = BASE_OFFSET_OFFSET + BASE_OFFSET_LENGTH
LENGTH_LENGTH = 4
LEADER_EPOCH_OFFSET = LENGTH_OFFSET + LENGTH_LENGTH
LEADER_EPOCH_LENGTH = 4
MAGIC_OFFSET = LEADER_EPOCH_OFFSET + LEADER_EPOCH_LENGTH
MAGIC_LENGTH = 1
CRC_OFFSET = MAGIC_OFFSET + MAGIC_LENGTH
CRC_LENGTH = 4
ATTRIBUTES_OFFSET = CRC_OFFSET + CRC_LENGTH
ATTRIBUTES_LENGTH = 2
RECORD_COUNT_OFFSET = ATTRIBUTES_OFFSET + ATTRIBUTES_LENGTH
RECORD_COUNT_LENGTH = 4
FIRST_TIMESTAMP_OFFSET = RECORD_COUNT_OFFSET + RECORD_COUNT_LENGTH
FIRST_TIMESTAMP_LENGTH = 8
MAX_TIMESTAMP_OFFSET = FIRST_TIMESTAMP_OFFSET + FIRST_TIMESTAMP_LENGTH
MAX_TIMESTAMP_LENGTH = 8
PRODUCER_ID_OFFSET = MAX_TIMESTAMP_OFFSET + MAX_TIMESTAMP_LENGTH
PRODUCER_ID_LENGTH = 8
PRODUCER_EPOCH_OFFSET = PRODUCER_ID_OFFSET + PRODUCER_ID_LENGTH
PRODUCER_EPOCH_LENGTH = 2
BASE_SEQUENCE_OFFSET = PRODUCER_EPOCH_OFFSET + PRODUCER_EPOCH_LENGTH
BASE_SEQUENCE_LENGTH = 4
RESERVED_OFFSET = BASE_SEQUENCE_OFFSET + BASE_SEQUENCE_LENGTH
RESERVED_LENGTH = 7
HEADER_SIZE = RESERVED_OFFSET + RESERVED_LENGTH
# batch_length counts the bytes after the length field.
LOG_OVERHEAD = LENGTH_OFFSET + LENGTH_LENGTH
MIN_BATCH_LENGTH = HEADER_SIZE - LOG_OVERHEAD

HEADER_STRUCT = struct.Struct("<qiibIhiqqqhi7x")
_OFFSET_AND_EPOCH = struct.Struct("<q")
_EPOCH = struct.Struct("<i")
CRC_STRUCT = struct.Struct("<I")
_ATTRIBUTES = struct.Struct("<h")
_TIMESTAMP = struct.Struct("<q")
assert HEADER_STRUCT.size == HEADER_SIZE == 64, "frame header layout drifted"
assert HEADER_SIZE % 8 == 0, "the payload must stay 8-byte aligned"

# Attributes
COMPRESSION_MASK = 0x07
TIMESTAMP_TYPE_MASK = 0x08
TRANSACTIONAL_MASK = 0x10  # Kafka's bit positions: a gateway writes Kafka's attributes from ours unchanged
CONTROL_MASK = 0x20
COMPRESSION_CODES = {None: 0, "lz4": 3, "zstd": 4}
COMPRESSION_NAMES = {code: name for name, code in COMPRESSION_CODES.items()}
# The timestamp type as the attribute bit stores it (Kafka's record batch bit 3).
TIMESTAMP_CREATE_TIME = 0
TIMESTAMP_LOG_APPEND_TIME = 1
# The timestamp type as readers see it (ConsumerRecord.timestamp_type, Ray Data's timestamp_type
# column): confluent-kafka's and ray.data.read_kafka's codes.
TIMESTAMP_TYPE_NOT_AVAILABLE = 0
TIMESTAMP_TYPE_CREATE_TIME = 1
TIMESTAMP_TYPE_LOG_APPEND_TIME = 2

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1
NO_LEADER_EPOCH = -1


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The decoded frame header of one batch (see the module docstring)."""

    base_offset: int
    batch_length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    record_count: int
    first_timestamp_ms: int
    max_timestamp_ms: int
    producer_id: int
    producer_epoch: int
    base_sequence: int

    def stamped(self, base_offset: int, leader_epoch: int) -> "BatchHeader":
        """This header with the offset and epoch a leader assigns (dataclasses.replace costs ~10x more)."""
        return BatchHeader(
            base_offset, self.batch_length, leader_epoch, self.magic, self.crc, self.attributes, self.record_count,
            self.first_timestamp_ms, self.max_timestamp_ms, self.producer_id, self.producer_epoch, self.base_sequence,
        )

    @property
    def size_bytes(self) -> int:
        """Total size of the batch, header included."""
        return LOG_OVERHEAD + self.batch_length

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.record_count - 1

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count

    @property
    def compression(self) -> str | None:
        return COMPRESSION_NAMES.get(self.attributes & COMPRESSION_MASK)

    @property
    def timestamp_type(self) -> int:
        """The stored bit: TIMESTAMP_CREATE_TIME or TIMESTAMP_LOG_APPEND_TIME."""
        return (self.attributes & TIMESTAMP_TYPE_MASK) >> 3

    @property
    def reader_timestamp_type(self) -> int:
        """The code readers see (confluent-kafka's): TIMESTAMP_TYPE_CREATE_TIME or TIMESTAMP_TYPE_LOG_APPEND_TIME."""
        return TIMESTAMP_TYPE_LOG_APPEND_TIME if self.attributes & TIMESTAMP_TYPE_MASK else TIMESTAMP_TYPE_CREATE_TIME

    @property
    def is_transactional(self) -> bool:
        """Written by a transactional producer (data or marker)."""
        return bool(self.attributes & TRANSACTIONAL_MASK)

    @property
    def is_control(self) -> bool:
        """A transaction marker (see the module docstring)."""
        return bool(self.attributes & CONTROL_MASK)

    @property
    def last_sequence(self) -> int:
        if self.base_sequence == NO_SEQUENCE:
            return NO_SEQUENCE
        return self.base_sequence + self.record_count - 1



# --- reading --------------------------------------------------------------------------


def read_header(buffer, position: int = 0) -> BatchHeader:
    """Decode and sanity-check the header at ``position``; does not check the CRC.

    Raises CorruptRecordError when the header is incomplete or impossible.
    """
    available = len(buffer) - position
    if available < HEADER_SIZE:
        raise CorruptRecordError(f"batch header at position {position} is cut short ({available} of {HEADER_SIZE} bytes)")
    header = BatchHeader(*HEADER_STRUCT.unpack_from(buffer, position))
    if header.magic != MAGIC_V1:
        raise CorruptRecordError(f"bad magic {header.magic:#x} at position {position}")
    if header.batch_length < MIN_BATCH_LENGTH or header.size_bytes % 8:
        raise CorruptRecordError(f"impossible batch length {header.batch_length} at position {position}")
    if header.size_bytes > available:
        raise CorruptRecordError(
            f"batch at position {position} is cut short ({available} of {header.size_bytes} bytes)"
        )
    if header.record_count <= 0 or header.base_offset < 0:
        raise CorruptRecordError(f"impossible record count or offset at position {position}")
    return header


def unpack_header(header_bytes) -> BatchHeader:
    """The fields of a header this process built (``with_offset_and_epoch``); no checks."""
    return BatchHeader(*HEADER_STRUCT.unpack_from(header_bytes, 0))


def compute_crc(buffer, position: int, header: BatchHeader) -> int:
    view = memoryview(buffer)[position + ATTRIBUTES_OFFSET : position + header.size_bytes]
    return crc32c.crc32c(view)


def validate_batch(buffer, position: int = 0) -> BatchHeader:
    """Read the header at ``position`` and check lengths and CRC; raise CorruptRecordError if bad."""
    header = read_header(buffer, position)
    actual = compute_crc(buffer, position, header)
    if actual != header.crc:
        raise CorruptRecordError(
            f"CRC mismatch for batch at position {position} (offset {header.base_offset}): "
            f"stored {header.crc:#010x}, computed {actual:#010x}"
        )
    return header


def iter_headers(buffer, position: int = 0, end: int | None = None) -> Iterator[tuple[int, BatchHeader]]:
    """Yield (position, header) for each batch in ``buffer[position:end]`` without CRC checks."""
    end = len(buffer) if end is None else end
    view = memoryview(buffer)[:end]
    while position < end:
        header = read_header(view, position)
        yield position, header
        position += header.size_bytes


# --- leader-side rewriting --------------------------------------------------------------


def with_offset_and_epoch(
    batch, base_offset: int, leader_epoch: int, log_append_time_ms: int | None = None
) -> tuple[bytearray, memoryview]:
    """Return (new header, payload view) for ``batch`` with base offset and epoch assigned.

    The CRC stays valid because neither field is covered by it; the payload is
    not copied. Write both parts with one ``os.writev``. With
    ``log_append_time_ms`` (a topic whose ``message.timestamp.type`` is
    LogAppendTime), the batch also becomes a LogAppendTime batch: the
    attribute says so, its first and max timestamps are the append time (every
    record's timestamp, for readers), and the CRC, which covers those fields,
    is computed again over the header and the payload in place.
    """
    view = memoryview(batch)
    header = bytearray(view[:HEADER_SIZE])
    _OFFSET_AND_EPOCH.pack_into(header, BASE_OFFSET_OFFSET, base_offset)
    _EPOCH.pack_into(header, LEADER_EPOCH_OFFSET, leader_epoch)
    payload = view[HEADER_SIZE:]
    if log_append_time_ms is not None:
        (attributes,) = _ATTRIBUTES.unpack_from(header, ATTRIBUTES_OFFSET)
        _ATTRIBUTES.pack_into(header, ATTRIBUTES_OFFSET, attributes | TIMESTAMP_TYPE_MASK)
        _TIMESTAMP.pack_into(header, FIRST_TIMESTAMP_OFFSET, log_append_time_ms)
        _TIMESTAMP.pack_into(header, MAX_TIMESTAMP_OFFSET, log_append_time_ms)
        crc = crc32c.crc32c(payload, crc32c.crc32c(memoryview(header)[ATTRIBUTES_OFFSET:]))
        CRC_STRUCT.pack_into(header, CRC_OFFSET, crc)
    return header, payload
