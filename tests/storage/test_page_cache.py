"""Page-cache release: old pages of the active segment leave the OS page cache, the data stays.

Residency is measured with mincore(2) on a private mapping of the real log file
(mapping a file does not read it in), so these tests run on Linux only.
"""

import ctypes
import ctypes.util
import mmap
import os
import sys

import numpy as np
import pytest

from logbus.storage import decode_batches, encode_batch
from logbus.storage.segment import CACHE_RELEASE_STEP_BYTES, PAGE_BYTES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) residency check needs Linux")

VALUE_BYTES = 1000
PER_BATCH = 256  # about 256 KiB per batch
KEEP_BYTES = 1 << 20


def resident_pages(path: str, length: int) -> int:
    """How many of the first ``length`` bytes' pages of ``path`` are in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    with open(path, "rb") as file, mmap.mmap(file.fileno(), length, access=mmap.ACCESS_COPY) as mapped:
        pages = (length + PAGE_BYTES - 1) // PAGE_BYTES
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        if libc.mincore(ctypes.c_void_p(address), length, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int(np.count_nonzero(np.frombuffer(vector, np.uint8) & 1))


def append_bytes(log, total: int, start_batch: int = 0) -> int:
    """Append batches of distinct values until ``total`` more bytes are written; return the batch count."""
    written = batches = 0
    while written < total:
        batch = encode_batch([b"%08d-%06d" % (start_batch + batches, i) + bytes(VALUE_BYTES - 15) for i in range(PER_BATCH)])
        log.append(batch, leader_epoch=1)
        written += len(batch)
        batches += 1
    return batches


def all_values(log) -> list:
    values, offset = [], log.log_start_offset
    while (result := log.read(offset, 4 << 20)) is not None:
        values += [v for _, records in decode_batches(result.data) for v in records.column("value").to_pylist()]
        offset = result.next_offset
    return values


def expected_values(batches: int) -> list:
    return [b"%08d-%06d" % (b, i) + bytes(VALUE_BYTES - 15) for b in range(batches) for i in range(PER_BATCH)]


def test_pages_behind_the_tail_leave_the_cache_and_the_data_stays(open_log):
    log = open_log({"cache.tail.bytes": KEEP_BYTES})
    batches = append_bytes(log, 3 * CACHE_RELEASE_STEP_BYTES)
    log.flush()  # every page clean: the next advice drops them at once
    batches += append_bytes(log, CACHE_RELEASE_STEP_BYTES + (64 << 10), start_batch=batches)
    path = log.active_segment.log_path
    early = 2 * CACHE_RELEASE_STEP_BYTES
    assert resident_pages(path, early) == 0
    tail_start = log.active_segment.size_bytes - KEEP_BYTES
    with open(path, "rb") as file:
        assert len(file.read()) == log.active_segment.size_bytes  # the file itself is whole
    assert tail_start > early
    assert all_values(log) == expected_values(batches)  # read back (CRC-checked) from disk


def test_a_negative_tail_keeps_every_page(open_log):
    log = open_log({"cache.tail.bytes": -1})
    append_bytes(log, 3 * CACHE_RELEASE_STEP_BYTES)
    log.flush()
    append_bytes(log, CACHE_RELEASE_STEP_BYTES + (64 << 10), start_batch=1000)
    early = 2 * CACHE_RELEASE_STEP_BYTES
    assert resident_pages(log.active_segment.log_path, early) == early // PAGE_BYTES


def test_truncation_into_released_pages_then_appends_and_reopen(open_log):
    log = open_log({"cache.tail.bytes": KEEP_BYTES})
    batches = append_bytes(log, 3 * CACHE_RELEASE_STEP_BYTES)
    log.flush()
    batches += append_bytes(log, CACHE_RELEASE_STEP_BYTES + (64 << 10), start_batch=batches)
    kept = 10  # cut back into the released region, then grow past it again
    log.truncate_to(kept * PER_BATCH)
    assert log.log_end_offset == kept * PER_BATCH
    batches = kept + append_bytes(log, 2 * CACHE_RELEASE_STEP_BYTES, start_batch=kept)
    assert all_values(log) == expected_values(batches)
    log.close()
    reopened = open_log({"cache.tail.bytes": KEEP_BYTES})
    assert reopened.recovery.truncated_bytes == 0
    assert all_values(reopened) == expected_values(batches)
