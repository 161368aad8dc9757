"""Record batches: the unit that is produced, stored, replicated and fetched.

A batch is the same bytes on the producer, on every replica's disk and in a
fetch response. It is a fixed little-endian frame header followed by one Arrow
IPC stream message (a record batch, without the schema message) with the
columns ``key: binary``, ``value: binary``, ``timestamp: int64`` (ms since the
epoch) and ``headers: map<string, binary>``. Record ``i`` of a batch has the
offset ``base_offset + i``.

The frame header (its layout, checks and the leader's rewriting of it) is
:mod:`logbus.storage.batch_header`, which needs no Arrow; this module adds the
payload: building, framing and decoding Arrow record batches, and re-exports
the header's names so that the format reads as one module.

The base offset and the leader epoch lie before the CRC field and outside the
CRC, as in Kafka, so the leader assigns them by rewriting 8 + 4 bytes of the
header without touching (or re-checksumming) the payload. The header is 64
bytes and Arrow messages are multiples of 8 bytes, so a batch is a multiple of
8 bytes and the payload of every batch in a segment stays 8-byte aligned: Arrow
reads its buffers in place, with no copy.

Compression uses Arrow IPC's own body compression (LZ4 frame or ZSTD); the
codec is also recorded in the attributes so tools can tell without parsing the
payload.

Reading checks the magic, the lengths, the CRC, and that the payload decodes
to ``record_count`` rows. A batch that fails any check raises
:class:`~logbus.errors.CorruptRecordError`; it is never returned.

This module holds no state and imports no Ray; every function is thread-safe.
"""

from __future__ import annotations

import functools
import struct
from typing import Iterator, Sequence

import crc32c
import numpy as np
import pyarrow as pa

from logbus.clock import wall_ms
from logbus.errors import CorruptRecordError, InvalidRecordError
from logbus.storage.batch_header import (  # noqa: F401  (re-exported: the format is one module to its users)
    MAGIC_V1,
    BASE_OFFSET_OFFSET,
    BASE_OFFSET_LENGTH,
    LENGTH_OFFSET,
    LENGTH_LENGTH,
    LEADER_EPOCH_OFFSET,
    LEADER_EPOCH_LENGTH,
    MAGIC_OFFSET,
    MAGIC_LENGTH,
    CRC_OFFSET,
    CRC_LENGTH,
    ATTRIBUTES_OFFSET,
    ATTRIBUTES_LENGTH,
    RECORD_COUNT_OFFSET,
    RECORD_COUNT_LENGTH,
    FIRST_TIMESTAMP_OFFSET,
    FIRST_TIMESTAMP_LENGTH,
    MAX_TIMESTAMP_OFFSET,
    MAX_TIMESTAMP_LENGTH,
    PRODUCER_ID_OFFSET,
    PRODUCER_ID_LENGTH,
    PRODUCER_EPOCH_OFFSET,
    PRODUCER_EPOCH_LENGTH,
    BASE_SEQUENCE_OFFSET,
    BASE_SEQUENCE_LENGTH,
    RESERVED_OFFSET,
    RESERVED_LENGTH,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MIN_BATCH_LENGTH,
    HEADER_STRUCT,
    CRC_STRUCT,
    COMPRESSION_MASK,
    TIMESTAMP_TYPE_MASK,
    TRANSACTIONAL_MASK,
    CONTROL_MASK,
    COMPRESSION_CODES,
    COMPRESSION_NAMES,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    TIMESTAMP_TYPE_NOT_AVAILABLE,
    TIMESTAMP_TYPE_CREATE_TIME,
    TIMESTAMP_TYPE_LOG_APPEND_TIME,
    NO_PRODUCER_ID,
    NO_PRODUCER_EPOCH,
    NO_SEQUENCE,
    NO_LEADER_EPOCH,
    BatchHeader,
    read_header,
    unpack_header,
    compute_crc,
    validate_batch,
    iter_headers,
    with_offset_and_epoch,
)


HEADERS_TYPE = pa.map_(pa.string(), pa.binary())
SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("timestamp", pa.int64()),
        pa.field("headers", HEADERS_TYPE),
    ]
)
# An IPC stream starts with the schema message; a batch stores only the record
# batch message that follows it.
_SCHEMA_MESSAGE_SIZE = SCHEMA.serialize().size

_BINARY = pa.binary()
_INT64 = pa.int64()
_WRITE_OPTIONS = {name: pa.ipc.IpcWriteOptions(compression=name) for name in COMPRESSION_CODES}


# --- encoding -------------------------------------------------------------------------


def _binary_array(items: Sequence, name: str) -> pa.Array:
    """Build a binary array from bytes-like items (str is encoded as UTF-8; None allowed), in one C-level call.

    (pyarrow's converter beats building offsets with numpy at every size measured, 10 to 100,000 items.)
    """
    try:
        array = pa.array(items, _BINARY)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise InvalidRecordError(f"{name} must be bytes, str or None: {error}") from None
    if isinstance(array, pa.ChunkedArray):  # pyarrow splits a column over 2 GiB
        raise InvalidRecordError(f"{name} column exceeds 2 GiB in one batch")
    return array


def _timestamps_array(timestamps_ms, count: int, default_ms: int) -> pa.Array:
    if timestamps_ms is None:
        return pa.array(np.full(count, default_ms, np.int64))
    if isinstance(timestamps_ms, pa.Array | pa.ChunkedArray):
        array = timestamps_ms
    elif isinstance(timestamps_ms, list):
        # A list of ints (None for "now"), as the producer keeps them: one C-level call.
        try:
            array = pa.array(timestamps_ms, _INT64)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            return _timestamps_array(np.asarray(timestamps_ms, dtype=object), count, default_ms)
    else:
        array = np.asarray(timestamps_ms)
        if array.dtype == object:
            array = np.array([default_ms if t is None else t for t in timestamps_ms], np.int64)
        array = pa.array(array.astype(np.int64, copy=False))
    if len(array) != count:
        raise InvalidRecordError(f"got {len(array)} timestamps for {count} records")
    if array.null_count:
        array = array.fill_null(default_ms)
    return array if array.type == _INT64 else array.cast(_INT64)


@functools.lru_cache(maxsize=256)
def _nulls(arrow_type: pa.DataType, count: int) -> pa.Array:
    """An all-null array (immutable, so small ones are shared between batches)."""
    return pa.nulls(count, arrow_type)


def _null_column(arrow_type: pa.DataType, count: int) -> pa.Array:
    return _nulls(arrow_type, count) if count <= 1024 else pa.nulls(count, arrow_type)


def _headers_array(headers, count: int) -> pa.Array:
    if headers is None:
        return _null_column(HEADERS_TYPE, count)
    if len(headers) != count:
        raise InvalidRecordError(f"got {len(headers)} header entries for {count} records")
    rows = []
    for entry in headers:
        if entry is None:
            rows.append(None)
        elif isinstance(entry, dict):
            rows.append([(k, as_bytes(v, "header value")) for k, v in entry.items()])
        else:
            rows.append([(k, as_bytes(v, "header value")) for k, v in entry])
    try:
        return pa.array(rows, HEADERS_TYPE)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise InvalidRecordError(f"headers must map str to bytes: {error}") from None


def as_bytes(value, what: str) -> bytes | None:
    """``value`` as bytes (str is UTF-8 encoded; None stays None); InvalidRecordError for other types."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidRecordError(f"{what} must be bytes, str or None, not {type(value).__name__}")


def build_record_batch(
    values: Sequence,
    keys: Sequence | None = None,
    timestamps_ms=None,
    headers: Sequence | None = None,
    *,
    default_timestamp_ms: int | None = None,
) -> pa.RecordBatch:
    """Build the Arrow record batch of a frame from Python sequences.

    ``values`` and ``keys`` hold bytes (or str, encoded as UTF-8, or None);
    ``timestamps_ms`` is a sequence of int ms (None entries mean "now");
    ``headers`` a sequence of dicts or (str, bytes) pair lists, or None.
    """
    count = len(values)
    if keys is not None and len(keys) != count:
        raise InvalidRecordError(f"got {len(keys)} keys for {count} values")
    default_ms = wall_ms() if default_timestamp_ms is None else default_timestamp_ms
    value_array = _binary_array(values, "value")
    key_array = _null_column(_BINARY, count) if keys is None else _binary_array(keys, "key")
    return pa.RecordBatch.from_arrays(
        [key_array, value_array, _timestamps_array(timestamps_ms, count, default_ms), _headers_array(headers, count)],
        schema=SCHEMA,
    )


def conform_table(table: pa.Table | pa.RecordBatch, *, default_timestamp_ms: int | None = None) -> pa.RecordBatch:
    """Turn a user table (``value`` and optional ``key``, ``timestamp``, ``headers``) into one batch of SCHEMA."""
    names = table.schema.names
    if "value" not in names:
        raise InvalidRecordError(f"a table to send needs a 'value' column; it has {names}")
    count = table.num_rows
    if isinstance(table, pa.Table):
        table = table.combine_chunks()

    def column(name, arrow_type, default):
        if name not in names:
            return default
        array = table.column(name)
        if isinstance(array, pa.ChunkedArray):
            array = array.chunk(0) if array.num_chunks == 1 else pa.concat_arrays(array.chunks) if array.num_chunks else pa.array([], arrow_type)
        try:
            return array.cast(arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise InvalidRecordError(f"column {name!r} of type {array.type} cannot be {arrow_type}: {error}") from None

    default_ms = wall_ms() if default_timestamp_ms is None else default_timestamp_ms
    timestamps = column("timestamp", pa.int64(), None)
    if timestamps is None:
        timestamps = pa.array(np.full(count, default_ms, np.int64))
    elif timestamps.null_count:
        timestamps = timestamps.fill_null(default_ms)
    return pa.RecordBatch.from_arrays(
        [
            column("key", pa.binary(), pa.nulls(count, pa.binary())),
            column("value", pa.binary(), None),
            timestamps,
            column("headers", HEADERS_TYPE, pa.nulls(count, HEADERS_TYPE)),
        ],
        schema=SCHEMA,
    )


_HEADERS_COLUMN = SCHEMA.get_field_index("headers")


def _compact_headers(records: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with its headers column holding only its own rows' offsets and entries.

    Arrow's IPC writer cuts a slice's binary buffers down to the slice, but
    writes a sliced map column's offsets and children whole: a 1,000-row
    slice of a 200,000-row table (Producer.send_table splitting a large
    table, the cleaner keeping runs of a batch) would otherwise carry 1.6 MB
    of the table's header offsets. Copying the slice's headers (tens of µs)
    keeps every frame the size of its own rows.
    """
    headers = records.column(_HEADERS_COLUMN)
    offsets = headers.buffers()[1]
    if offsets is None or offsets.size <= 4 * (len(headers) + 1) + 64:  # (buffers are padded to 64 bytes)
        return records
    columns = list(records.columns)
    columns[_HEADERS_COLUMN] = pa.concat_arrays([headers])
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def frame_record_batch(records: pa.RecordBatch, **options) -> bytes:
    """Serialize an Arrow record batch of SCHEMA into one framed batch (bytes).

    Options as :func:`frame_parts` takes them.
    """
    return b"".join(frame_parts(records, **options))


def frame_parts(
    records: pa.RecordBatch,
    *,
    base_offset: int = 0,
    leader_epoch: int = NO_LEADER_EPOCH,
    compression: str | None = None,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = NO_PRODUCER_EPOCH,
    base_sequence: int = NO_SEQUENCE,
    timestamp_type: int = TIMESTAMP_CREATE_TIME,
    timestamp_range: tuple[int, int] | None = None,
    transactional: bool = False,
    control: bool = False,
) -> tuple[bytearray, pa.Buffer]:
    """An Arrow record batch of SCHEMA as one framed batch in two parts: (header, IPC message).

    A caller framing many batches joins all their parts once (:func:`frame_record_batch`
    joins one batch's two).

    ``timestamp_range`` (first, max) may be passed by a caller that knows the
    timestamp column's first and largest values; otherwise they are computed.
    ``transactional`` sets the attribute of a transactional producer's batch
    (it needs a producer id); ``control`` that of a transaction marker (built
    by :func:`encode_control_batch`).
    """
    if compression not in _WRITE_OPTIONS:
        raise InvalidRecordError(f"compression must be one of {sorted(map(str, COMPRESSION_CODES))}, not {compression!r}")
    count = records.num_rows
    if count == 0:
        raise InvalidRecordError("a batch needs at least one record")
    if not records.schema.equals(SCHEMA):
        raise InvalidRecordError(f"batch schema must be {SCHEMA}, got {records.schema}")
    records = _compact_headers(records)
    if compression is None:
        # The record batch message alone, as a stream writer would write it after the schema
        # (the same bytes: tests check), without a writer's set-up cost (~70 µs a batch).
        message = records.serialize()
    else:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, SCHEMA, options=_WRITE_OPTIONS[compression]) as writer:
            writer.write_batch(records)
            end = sink.tell()
        message = sink.getvalue().slice(_SCHEMA_MESSAGE_SIZE, end - _SCHEMA_MESSAGE_SIZE)
    if timestamp_range is None:
        timestamps = records.column(2).to_numpy()
        timestamp_range = (int(timestamps[0]), int(timestamps.max()))
    if (transactional or control) and producer_id == NO_PRODUCER_ID:
        raise InvalidRecordError("a transactional batch needs the producer id of its transactional producer")
    attributes = COMPRESSION_CODES[compression] | (timestamp_type << 3)
    if transactional or control:
        attributes |= TRANSACTIONAL_MASK
    if control:
        attributes |= CONTROL_MASK
    batch_length = HEADER_SIZE - LOG_OVERHEAD + message.size
    header = bytearray(HEADER_SIZE)
    HEADER_STRUCT.pack_into(
        header, 0, base_offset, batch_length, leader_epoch, MAGIC_V1, 0, attributes, count,
        timestamp_range[0], timestamp_range[1], producer_id, producer_epoch, base_sequence,
    )
    crc = crc32c.crc32c(message, crc32c.crc32c(header[ATTRIBUTES_OFFSET:]))
    CRC_STRUCT.pack_into(header, CRC_OFFSET, crc)
    return header, message


def encode_batch(
    values: Sequence,
    keys: Sequence | None = None,
    timestamps_ms=None,
    headers: Sequence | None = None,
    **frame_options,
) -> bytes:
    """Encode Python values (and optional keys, timestamps, headers) into one framed batch."""
    default_ms = frame_options.pop("default_timestamp_ms", None)
    records = build_record_batch(values, keys, timestamps_ms, headers, default_timestamp_ms=default_ms)
    if isinstance(timestamps_ms, list) and 0 < len(timestamps_ms) <= 1024 and None not in timestamps_ms:
        # Small batches from the producer: the timestamp range from the list (no Arrow round trip).
        frame_options["timestamp_range"] = (int(timestamps_ms[0]), int(max(timestamps_ms)))
    return frame_record_batch(records, **frame_options)


def encode_table(table: pa.Table | pa.RecordBatch, **frame_options) -> bytes:
    """Encode a pyarrow Table/RecordBatch (value, optional key/timestamp/headers) into one framed batch."""
    default_ms = frame_options.pop("default_timestamp_ms", None)
    return frame_record_batch(conform_table(table, default_timestamp_ms=default_ms), **frame_options)


# --- transaction markers ---------------------------------------------------------------

# A control batch's one record, as Kafka writes it (big-endian, as every Kafka field):
# key ControlRecordKey (int16 version 0, int16 type), value EndTransactionMarker (int16 version 0,
# int32 coordinator epoch). The same bytes let the Kafka gateway write Kafka's control batch.
CONTROL_KEY = struct.Struct(">hh")
END_TXN_MARKER = struct.Struct(">hi")
CONTROL_VERSION = 0
CONTROL_TYPE_ABORT = 0
CONTROL_TYPE_COMMIT = 1


def encode_control_batch(
    producer_id: int, producer_epoch: int, commit: bool, coordinator_epoch: int, timestamp_ms: int
) -> bytes:
    """The transaction marker of ``producer_id``'s transaction: one framed control batch.

    The CONTROL and TRANSACTIONAL attributes, the producer's id and epoch, base
    sequence -1, and one record (see CONTROL_KEY, END_TXN_MARKER) stamped
    ``timestamp_ms`` (the coordinator's wall time).
    """
    if producer_id < 0:
        raise InvalidRecordError(f"a transaction marker needs a producer id, not {producer_id}")
    key = CONTROL_KEY.pack(CONTROL_VERSION, CONTROL_TYPE_COMMIT if commit else CONTROL_TYPE_ABORT)
    value = END_TXN_MARKER.pack(CONTROL_VERSION, coordinator_epoch)
    records = build_record_batch([value], [key], [timestamp_ms])
    return frame_record_batch(
        records, producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=NO_SEQUENCE,
        timestamp_range=(timestamp_ms, timestamp_ms), control=True,
    )


def control_record(records: pa.RecordBatch) -> tuple[bool, int]:
    """(commit, coordinator epoch) of a control batch's records; CorruptRecordError if they are not a marker."""
    key = records.column(0)[0].as_py() if records.num_rows == 1 else None
    value = records.column(1)[0].as_py() if records.num_rows == 1 else None
    if key is None or len(key) < CONTROL_KEY.size or value is None or len(value) < END_TXN_MARKER.size:
        raise CorruptRecordError(f"a control batch holds {records.num_rows} records, not one transaction marker")
    version, kind = CONTROL_KEY.unpack_from(key)
    if version != CONTROL_VERSION or kind not in (CONTROL_TYPE_ABORT, CONTROL_TYPE_COMMIT):
        raise CorruptRecordError(f"unknown control record (version {version}, type {kind})")
    _, coordinator_epoch = END_TXN_MARKER.unpack_from(value)
    return kind == CONTROL_TYPE_COMMIT, coordinator_epoch


def read_control_batch(buffer, position: int = 0) -> tuple[BatchHeader, bool, int]:
    """(header, commit, coordinator epoch) of the control batch at ``position``, its CRC checked."""
    header, records = decode_records(buffer, position)
    if not header.is_control:
        raise CorruptRecordError(f"the batch at offset {header.base_offset} is not a control batch")
    commit, coordinator_epoch = control_record(records)
    return header, commit, coordinator_epoch


# --- reading --------------------------------------------------------------------------



def decode_records(buffer, position: int = 0, *, verify_crc: bool = True) -> tuple[BatchHeader, pa.RecordBatch]:
    """Decode the batch at ``position`` of any buffer into (header, Arrow RecordBatch) without copying.

    ``buffer`` may be bytes, a memoryview of an mmap, or a numpy array from the
    object store; the returned record batch points into it.
    """
    header = validate_batch(buffer, position) if verify_crc else read_header(buffer, position)
    payload = pa.py_buffer(memoryview(buffer)[position + HEADER_SIZE : position + header.size_bytes])
    try:
        records = pa.ipc.read_record_batch(payload, SCHEMA)
    except (pa.ArrowInvalid, OSError) as error:
        raise CorruptRecordError(f"batch at position {position} has an unreadable payload: {error}") from None
    if records.num_rows != header.record_count:
        raise CorruptRecordError(
            f"batch at position {position} holds {records.num_rows} records, header says {header.record_count}"
        )
    return header, records


def project_batch(buffer, position: int, names: Sequence[str]) -> tuple[bytearray, pa.Buffer]:
    """The batch at ``position`` with only the columns ``names`` (in SCHEMA's order): (frame header, IPC
    message), as :func:`frame_parts` returns a batch.

    For readers that asked for some columns only (Spark's JVM reader, through
    ``logbus.protocol.jvm_fetch``): the header is the stored one with its
    length set to the new message's; its CRC is the stored batch's, so the
    projection is no batch to store or to check, only to read. The message is
    uncompressed; its schema is SCHEMA's fields ``names``.
    """
    header, records = decode_records(buffer, position, verify_crc=False)
    message = records.select(list(names)).serialize()
    frame = bytearray(memoryview(buffer)[position:position + HEADER_SIZE])
    struct.pack_into("<i", frame, LENGTH_OFFSET, HEADER_SIZE - LOG_OVERHEAD + message.size)
    return frame, message


def decode_batches(buffer, *, verify_crc: bool = True) -> list[tuple[BatchHeader, pa.RecordBatch]]:
    """Decode every batch of a buffer of whole batches (a fetch response)."""
    view = memoryview(buffer)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    out = []
    position = 0
    while position < len(view):
        header, records = decode_records(view, position, verify_crc=verify_crc)
        out.append((header, records))
        position += header.size_bytes
    return out



def slice_batches(buffer, start: int, end: int | None = None, *, verify_crc: bool = True) -> Iterator[tuple[BatchHeader, int, pa.RecordBatch]]:
    """The records of offsets ``[start, end)`` in a buffer of whole batches: ``(header, first offset, records)``.

    What every reader of a fetch reply does with it: a fetch returns whole
    batches, the first of which may begin below the offset asked for and the
    last of which may run past the end wanted; each batch is decoded in place
    (no copy) and sliced to the range. Batches wholly outside the range are
    skipped; ``end=None`` means no upper bound.
    """
    for header, records in decode_batches(buffer, verify_crc=verify_crc):
        first = max(start, header.base_offset)
        stop = header.next_offset if end is None else min(end, header.next_offset)
        if stop <= first:
            continue
        if first != header.base_offset or stop != header.next_offset:
            records = records.slice(first - header.base_offset, stop - first)
        yield header, first, records


def slice_visible_batches(
    buffer,
    start: int,
    end: int | None = None,
    *,
    read_committed: bool = False,
    aborted=(),
    verify_crc: bool = True,
) -> tuple[list[tuple[BatchHeader, int, pa.RecordBatch]], int | None]:
    """:func:`slice_batches` without what readers never see: control batches (transaction markers)
    always, and with ``read_committed`` the batches of the reply's ``aborted`` transactions
    ((producer id, first offset) pairs, as a read_committed fetch reply carries them); decided per
    batch header (:func:`logbus.storage.isolation.visible`), never per record.

    Returns the kept ``(header, first offset, records)`` and, when batches were dropped after the
    last one kept, the offset just past them (a reader's position moves there), else None.
    """
    from logbus.storage.isolation import visible_headers  # noqa: PLC0415

    decoded = decode_batches(buffer, verify_crc=verify_crc)
    if not any(header.attributes & (TRANSACTIONAL_MASK | CONTROL_MASK) for header, _ in decoded):
        keep = None  # the usual case: nothing to drop
    else:
        headers = [header for header, _ in decoded]
        if read_committed and len(aborted):
            markers = [header.is_control and not control_record(records)[0] for header, records in decoded]
        else:
            markers = [False] * len(decoded)
        keep = visible_headers(headers, markers, aborted, read_committed)
    out = []
    skipped_to = None
    for i, (header, records) in enumerate(decoded):
        first = max(start, header.base_offset)
        stop = header.next_offset if end is None else min(end, header.next_offset)
        if stop <= first:
            continue
        if keep is not None and not keep[i]:
            skipped_to = stop
            continue
        skipped_to = None
        if first != header.base_offset or stop != header.next_offset:
            records = records.slice(first - header.base_offset, stop - first)
        out.append((header, first, records))
    return out, skipped_to
