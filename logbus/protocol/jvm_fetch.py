"""The reply of a replica's ``jvm_fetch``: what Spark's JVM reader of a topic receives. No Ray.

Spark's executors run in the JVM (RayDP makes them Ray actors) and read a
partition by calling its leader's ``jvm_fetch`` as a Ray cross-language call:
plain integers in, one ``bytes`` out (Ray stores bytes raw, so the JVM gets
them as a ``byte[]`` with no serializer in between). Everything a Java reader
would otherwise need to know of logbus's transactions is decided here, from
the batches' frame headers: the reply holds only the batches a reader keeps
(see :func:`logbus.storage.isolation.visible`), whole and as stored, so the
JVM decodes each one's Arrow message and slices the first and last to its
range. The Java side is ``logbus/jvm/src/io/logbus/spark/FetchReply.java``.

Layout (all integers little-endian)::

    position  size  field
    0         4     magic            'LBJF'
    4         4     flags            bit 0: headers only (each batch's 64-byte frame header, no payload)
    8         8     first_offset     the read's first offset (FetchResponse.first_offset)
    16        8     next_offset      where the next read starts (past a compacted gap too)
    24        8     high_watermark   the partition's high watermark when the read was served
    32        4     batch_count      batches that follow
    36        4     columns          which of the batch schema's columns the batches hold: bit 0 key,
                                     1 value, 2 timestamp, 3 headers (ALL_COLUMNS: the batches as
                                     stored); 0 with headers only
    40              the batches, one after another (each: frame header, then, unless headers
                    only, its Arrow IPC record batch message)

With nothing to return (no records yet, or the high watermark went back),
``next_offset`` equals ``first_offset`` and no batch follows. A reader that
only counts (Spark's ``count()`` needs no column) asks for headers only: a
batch's record count is in its frame header, so a count moves 64 bytes per
batch instead of the batch. A reader that needs some of the stored columns
(a group-by of the key) asks for those: each batch is then rewritten with only
them (``record_batch.project_batch``: the replica decodes it with Arrow, which
it otherwise never loads), so the values a query does not read never leave
the replica, as a Parquet reader skips the column chunks it does not read.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from logbus.errors import CorruptRecordError, InvalidRecordError
from logbus.storage.batch_header import CONTROL_MASK, HEADER_SIZE, TRANSACTIONAL_MASK, iter_headers

MAGIC = b"LBJF"
HEADERS_ONLY = 0x1
COLUMNS = ("key", "value", "timestamp", "headers")  # record_batch.SCHEMA's, in its order
ALL_COLUMNS = (1 << len(COLUMNS)) - 1
REPLY_HEADER = struct.Struct("<4siqqqii")
assert REPLY_HEADER.size == 40 and REPLY_HEADER.size % 8 == 0, "the batches must stay 8-byte aligned"


class Reply(NamedTuple):
    """A parsed reply (for tests and Python readers): its fields and each batch's (position, length)."""

    flags: int
    columns: int
    first_offset: int
    next_offset: int
    high_watermark: int
    batches: list[tuple[int, int]]


def visible_positions(data, read_committed: bool, aborted) -> list[tuple[int, int]]:
    """(position, length) of each batch of ``data`` (whole batches of one read) a reader keeps.

    Control batches are never kept; with ``read_committed``, neither are the
    batches of ``aborted`` transactions ((producer id, first offset) pairs as a
    read_committed fetch reply carries them). Only an ABORT marker's own record
    is decoded (Arrow), and only when there are aborted transactions to place.
    """
    headers = list(iter_headers(data))
    spans = [(position, header.size_bytes) for position, header in headers]
    if not any(header.attributes & (TRANSACTIONAL_MASK | CONTROL_MASK) for _, header in headers):
        return spans  # the usual case: nothing to drop
    from logbus.storage.isolation import visible_headers  # noqa: PLC0415 (numpy, only with transactions)

    markers = [False] * len(headers)
    if read_committed and len(aborted):
        from logbus.storage.record_batch import read_control_batch  # noqa: PLC0415 (Arrow)

        markers = [header.is_control and not read_control_batch(data, position)[1] for position, header in headers]
    keep = visible_headers([header for _, header in headers], markers, aborted, read_committed)
    return [span for span, kept in zip(spans, keep) if kept]


def pack_reply(
    data, first_offset: int, next_offset: int, high_watermark: int, *,
    headers_only: bool = False, read_committed: bool = False, aborted=(), columns: int = ALL_COLUMNS,
) -> bytes:
    """The reply for one read's ``data`` (whole batches; empty or None when there is nothing).

    ``columns``: the mask of the batch schema's columns to send (see the layout); ignored with
    ``headers_only``. InvalidRecordError for a mask outside ALL_COLUMNS.
    """
    if not 0 <= columns <= ALL_COLUMNS:
        raise InvalidRecordError(f"columns is a mask of {ALL_COLUMNS:#x} ({', '.join(COLUMNS)}), not {columns!r}")
    if headers_only:
        columns = 0
    spans = visible_positions(data, read_committed, aborted) if data is not None and len(data) else []
    view = memoryview(data) if spans else None
    parts = [REPLY_HEADER.pack(MAGIC, HEADERS_ONLY if headers_only else 0, first_offset, next_offset, high_watermark, len(spans), columns)]
    if spans and not headers_only and columns != ALL_COLUMNS:
        from logbus.storage.record_batch import project_batch  # noqa: PLC0415 (Arrow, only for a projection)

        names = [name for bit, name in enumerate(COLUMNS) if columns >> bit & 1]
        for position, _ in spans:
            parts.extend(project_batch(view, position, names))
        return b"".join(parts)
    for position, length in spans:
        parts.append(view[position:position + (HEADER_SIZE if headers_only else length)])
    return b"".join(parts)


def parse_reply(reply: bytes) -> Reply:
    """The fields of a reply and where its batches lie (each batch's length read from its frame header)."""
    if len(reply) < REPLY_HEADER.size:
        raise CorruptRecordError(f"a jvm_fetch reply of {len(reply)} bytes is shorter than its header")
    magic, flags, first, next_offset, high_watermark, count, columns = REPLY_HEADER.unpack_from(reply)
    if magic != MAGIC:
        raise CorruptRecordError(f"not a jvm_fetch reply (magic {magic!r})")
    batches = []
    position = REPLY_HEADER.size
    for _ in range(count):
        if flags & HEADERS_ONLY:
            batches.append((position, HEADER_SIZE))
            position += HEADER_SIZE
        else:
            _, header = next(iter_headers(reply, position))
            batches.append((position, header.size_bytes))
            position += header.size_bytes
    if position != len(reply):
        raise CorruptRecordError(f"a jvm_fetch reply holds {len(reply) - position} bytes past its {count} batches")
    return Reply(flags, columns, first, next_offset, high_watermark, batches)
