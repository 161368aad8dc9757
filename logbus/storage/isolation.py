"""What a reader sees of a fetch reply: isolation levels and the batches they keep (KIP-98).

Two isolation levels, Kafka's codes (``FetchRequest.isolation_level``):

- ``READ_UNCOMMITTED`` (0, the default): the replica reads up to the high
  watermark, and readers keep every data batch, transactional or not.
- ``READ_COMMITTED`` (1): the replica reads up to the last stable offset (the
  smaller of the high watermark and the first offset of the oldest ongoing
  transaction) and answers with the aborted transactions overlapping the
  reply, ``(producer id, first offset)``, from its transaction index; readers
  drop the batches of those transactions.

Control batches (transaction markers) are dropped at both levels: users never
see markers, and positions move past them.

The decision is Kafka's (``CompletedFetch.nextFetchedRecord``), made per batch
header, never per record: walk the reply's batches in order; at each batch
with a producer id, the aborted transactions whose first offset is at or
below the batch's last offset make their producer "aborted"; a producer's
ABORT marker makes it not aborted again; a transactional data batch of an
aborted producer is dropped. :func:`visible` computes it with numpy over
arrays of the batches' header fields: for a producer's data batch ``b``, it
is aborted exactly when some aborted transaction of that producer has its
first offset above the last offset of the producer's last ABORT marker
before ``b`` and at or below ``b``'s last offset (a marker clears whatever
was consumed by then, and anything consumed later was consumed by ``b``).
The loop is over the aborted producers of the reply (few), each step a numpy
operation over the reply's batches. tests/storage/test_isolation.py checks
it against Kafka's algorithm written out the slow way.

No Ray, no state; every function is thread-safe.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from logbus.errors import InvalidConfigError
from logbus.storage.batch_header import CONTROL_MASK, TRANSACTIONAL_MASK, BatchHeader

READ_UNCOMMITTED = 0
READ_COMMITTED = 1
ISOLATION_LEVELS = {"read_uncommitted": READ_UNCOMMITTED, "read_committed": READ_COMMITTED}
_NONE_BEFORE = np.iinfo(np.int64).min


def isolation_level_code(name: object) -> int:
    """The code of an isolation level given by name ("read_uncommitted" or "read_committed");
    InvalidConfigError for anything else."""
    if not isinstance(name, str) or name not in ISOLATION_LEVELS:
        raise InvalidConfigError(f"isolation_level must be one of {sorted(ISOLATION_LEVELS)}, not {name!r}")
    return ISOLATION_LEVELS[name]


def visible(
    producer_ids: np.ndarray,
    attributes: np.ndarray,
    last_offsets: np.ndarray,
    abort_markers: np.ndarray,
    aborted: Sequence[tuple[int, int]] | np.ndarray,
    read_committed: bool,
) -> np.ndarray:
    """Which batches of a fetch reply a reader keeps: a boolean array, one per batch, in reply order.

    The arrays hold, per batch: its producer id, attributes and last offset
    (increasing), and whether it is an ABORT marker. ``aborted``: the reply's
    aborted transactions, (producer id, first offset) pairs. Control batches
    are never kept; with ``read_committed``, neither are the transactional
    batches of aborted transactions (see the module docstring).
    """
    attributes = np.asarray(attributes)
    keep = (attributes & CONTROL_MASK) == 0
    if not read_committed or len(aborted) == 0:
        return keep
    producer_ids = np.asarray(producer_ids, dtype=np.int64)
    last_offsets = np.asarray(last_offsets, dtype=np.int64)
    abort_markers = np.asarray(abort_markers, dtype=bool)
    transactional_data = keep & ((attributes & TRANSACTIONAL_MASK) != 0)
    table = np.asarray(aborted, dtype=np.int64).reshape(-1, 2)
    for producer_id in np.unique(table[:, 0]):
        mine = np.flatnonzero(producer_ids == producer_id)
        if mine.size == 0:
            continue
        firsts = np.sort(table[table[:, 0] == producer_id, 1])
        lasts = last_offsets[mine]
        # The last offset of the producer's latest ABORT marker before each of its batches.
        cleared = np.maximum.accumulate(np.where(abort_markers[mine], lasts, _NONE_BEFORE))
        before = np.concatenate(([_NONE_BEFORE], cleared[:-1]))
        pending = np.searchsorted(firsts, lasts, side="right") > np.searchsorted(firsts, before, side="right")
        keep[mine[pending & transactional_data[mine]]] = False
    return keep


def visible_headers(headers: Sequence[BatchHeader], abort_markers: Iterable[bool], aborted, read_committed: bool) -> np.ndarray:
    """:func:`visible` for a reply's decoded headers (one pass over the batches to gather their fields)."""
    count = len(headers)
    producer_ids = np.fromiter((h.producer_id for h in headers), dtype=np.int64, count=count)
    attributes = np.fromiter((h.attributes for h in headers), dtype=np.int64, count=count)
    last_offsets = np.fromiter((h.base_offset + h.record_count - 1 for h in headers), dtype=np.int64, count=count)
    markers = np.fromiter(abort_markers, dtype=bool, count=count)
    return visible(producer_ids, attributes, last_offsets, markers, aborted, read_committed)
