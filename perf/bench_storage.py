#!/usr/bin/env python
"""Storage-layer micro-benchmarks: batch encode/decode and PartitionLog append/read.

Run with ``./dev bench storage`` (= ``.venv/bin/python perf/bench_storage.py``).
``--quick`` makes a short run (< 30 s); ``--dir DIR`` puts the data in a fresh
subdirectory of DIR (default: of /tmp); that subdirectory is removed at the end.

Every record value is 100 bytes of random (incompressible) data; keys and
headers are null, timestamps are "now". Cases:

1. encode      ``encode_batch(values_list)`` for 1,000 and 10,000 records, without
               compression and with lz4 / zstd (informational). Reference: a plain
               pyarrow build-and-write of the same 4-column batch.
2. decode      ``decode_batches(buf)`` of an ~8 MiB buffer of such batches (as in a
               fetch response), verify_crc True and False. Reference: a plain pyarrow
               IPC stream read of the same batches.
3. append      ``PartitionLog.append`` of one pre-encoded batch, reused, with
               flush.policy "os" and "batch"; ratio to os.write of same-size chunks
               to a fresh file in the same directory (plus fdatasync per chunk for
               "batch").
4. read        sequential ``PartitionLog.read(offset, 8 MiB)`` over the whole log,
               walking next_offset, each result copied into a preallocated numpy
               buffer; ratio to a numpy memcpy of the same total bytes in the same
               8 MiB chunks from an in-memory source.
5. last, informational: encode of 10,000 records again with glibc's heap trimming
               turned off (mallopt), to show the cost of page faults on that path.

Every figure is the best of N repetitions (N is printed); the medians are in the
JSON lines too. The last lines of output are one JSON object per result.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

# First: it puts this tree's logbus on sys.path.
from _common import VALUE_SIZE, arg_parser, best_and_median, measure, round_fixed, split_values

from logbus.clock import wall_ms
from logbus.storage import record_batch as rb
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog

MIB = 1024 * 1024
READ_MAX_BYTES = 8 * MIB
DECODE_BUFFER_BYTES = 8 * MIB
BATCH_SIZES = (1_000, 10_000)

ENCODE_TARGET = 5_000_000  # records/s, 10,000-record batches, no compression
DECODE_TARGET = 50_000_000  # records/s
APPEND_TARGET_RATIO = 0.5  # of the raw sequential write ceiling, 10,000-record batches, policy "os"


@dataclass
class Result:
    section: str
    case: str
    records_per_s: float | None
    mb_per_s: float | None
    median_records_per_s: float | None = None
    ratio: float | None = None
    ratio_to: str | None = None
    target: float | None = None
    target_metric: str | None = None
    stat: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def meets_target(self) -> bool | None:
        if self.target is None:
            return None
        value = self.ratio if self.target_metric == "ratio" else self.records_per_s
        return value is not None and value >= self.target

    def json(self) -> str:
        return json.dumps(
            {
                "bench": "storage",
                "case": self.case,
                "records_per_s": round_fixed(self.records_per_s),
                "mb_per_s": round_fixed(self.mb_per_s, 1),
                "ratio": round_fixed(self.ratio, 3),
                "ratio_to": self.ratio_to,
                "target": self.target,
                "target_metric": self.target_metric,
                "meets_target": self.meets_target,
                "median_records_per_s": round_fixed(self.median_records_per_s),
                "stat": self.stat,
                **self.extra,
            }
        )


def make_values(count: int) -> list[bytes]:
    return split_values(np.random.default_rng(42).bytes(count * VALUE_SIZE))


# --- 1. encode -------------------------------------------------------------------------------------


def pyarrow_build_and_write(values: list[bytes], now_ms: int) -> pa.Buffer:
    """The same 4-column batch built and IPC-written with plain pyarrow calls."""
    count = len(values)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.nulls(count, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array(np.full(count, now_ms, np.int64)),
            pa.nulls(count, rb.HEADERS_TYPE),
        ],
        schema=rb.SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.SCHEMA) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def bench_encode(values: list[bytes], reps: int, min_seconds: float) -> list[Result]:
    results = []
    now_ms = wall_ms()
    for size in BATCH_SIZES:
        batch_values = values[:size]
        reference_samples, ref_faults = measure(lambda: pyarrow_build_and_write(batch_values, now_ms), reps, min_seconds)
        ref_best, ref_median = best_and_median(reference_samples)
        ref_bytes = pyarrow_build_and_write(batch_values, now_ms).size
        results.append(
            Result(
                "encode", f"ref_pyarrow_build_write_{size}", size / ref_best, ref_bytes / ref_best / 1e6,
                size / ref_median, stat=f"best of {reps}",
                note=f"reference: pa.array + RecordBatch + IPC stream write; {ref_faults:.0f} page faults/call",
                extra={"page_faults_per_call": round(ref_faults, 1)},
            )
        )
        for compression in (None, "lz4", "zstd"):
            samples, faults = measure(lambda: rb.encode_batch(batch_values, compression=compression), reps, min_seconds)
            best, median = best_and_median(samples)
            encoded = rb.encode_batch(batch_values, compression=compression)
            target = ENCODE_TARGET if (compression is None and size == 10_000) else None
            results.append(
                Result(
                    "encode", f"encode_{size}_{compression or 'none'}", size / best, len(encoded) / best / 1e6,
                    size / median, ratio=ref_best / best, ratio_to="ref_pyarrow_build_write",
                    target=target, target_metric="records_per_s" if target else None, stat=f"best of {reps}",
                    note=("" if compression is None else f"informational; {len(encoded)} bytes (random data); ")
                    + f"{faults:.0f} page faults/call",
                    extra={"batch_bytes": len(encoded), "page_faults_per_call": round(faults, 1)},
                )
            )
    return results


def bench_encode_without_heap_trim(values: list[bytes], reps: int, min_seconds: float) -> list[Result]:
    """encode_batch(10,000) again with glibc's heap trimming off (informational; run last).

    With glibc's default dynamic thresholds, the ~3 MB of temporaries of one 10,000-record
    encode can be given back to the kernel (brk shrink) after every call and faulted in
    again on the next, which is slow on this VM. mallopt cannot be undone, so this runs
    after every other case.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        if not (libc.mallopt(m_trim_threshold, 256 * MIB) and libc.mallopt(m_mmap_threshold, 32 * MIB)):
            return []
    except OSError:
        return []
    size = 10_000
    batch_values = values[:size]
    samples, faults = measure(lambda: rb.encode_batch(batch_values), reps, min_seconds)
    best, median = best_and_median(samples)
    encoded = rb.encode_batch(batch_values)
    return [
        Result(
            "encode, glibc heap trim off (informational)", f"encode_{size}_none_no_heap_trim", size / best,
            len(encoded) / best / 1e6, size / median, stat=f"best of {reps}",
            note=f"mallopt(M_TRIM_THRESHOLD=256MiB, M_MMAP_THRESHOLD=32MiB); {faults:.0f} page faults/call",
            extra={"page_faults_per_call": round(faults, 1)},
        )
    ]


# --- 2. decode -------------------------------------------------------------------------------------


def bench_decode(values: list[bytes], reps: int, min_seconds: float) -> list[Result]:
    results = []
    for size in BATCH_SIZES:
        one = rb.encode_batch(values[:size])
        count = max(1, DECODE_BUFFER_BYTES // len(one))
        # A fetch-sized buffer of whole batches, in a numpy (aligned) buffer like the object store's.
        buffer = np.frombuffer(b"".join([one] * count), np.uint8).copy()
        records = count * size

        # Reference: plain pyarrow reads an IPC stream of the same record batches.
        _, arrow_batch = rb.decode_records(one, verify_crc=False)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rb.SCHEMA) as writer:
            for _ in range(count):
                writer.write_batch(arrow_batch)
        stream = sink.getvalue()

        def reference():
            return pa.ipc.open_stream(stream).read_all()

        ref_samples, _ = measure(reference, reps, min_seconds)
        ref_best, ref_median = best_and_median(ref_samples)
        results.append(
            Result(
                "decode", f"ref_pyarrow_ipc_read_{size}", records / ref_best, stream.size / ref_best / 1e6,
                records / ref_median, stat=f"best of {reps}", note="reference: pa.ipc.open_stream(...).read_all()",
            )
        )
        for verify in (True, False):
            decoded = rb.decode_batches(buffer, verify_crc=verify)
            assert len(decoded) == count and sum(r.num_rows for _, r in decoded) == records
            samples, _ = measure(lambda: rb.decode_batches(buffer, verify_crc=verify), reps, min_seconds)
            best, median = best_and_median(samples)
            results.append(
                Result(
                    "decode", f"decode_{size}_crc_{'on' if verify else 'off'}", records / best, buffer.nbytes / best / 1e6,
                    records / median, ratio=ref_best / best, ratio_to="ref_pyarrow_ipc_read",
                    target=DECODE_TARGET, target_metric="records_per_s", stat=f"best of {reps}",
                    note=f"{count} batches, {buffer.nbytes / MIB:.1f} MiB per call",
                    extra={"batches_per_call": count},
                )
            )
    return results


# --- 3. append -------------------------------------------------------------------------------------


def log_config(policy: str) -> LogConfig:
    return LogConfig.from_dict(
        {"flush.policy": policy, "segment.bytes": 1024 * MIB, "max.message.bytes": 64 * MIB}
    )


def append_pass(directory: str, batch: bytes, count: int, policy: str, keep: bool = False):
    """Append ``batch`` ``count`` times to a fresh log; return (seconds, log or None)."""
    shutil.rmtree(directory, ignore_errors=True)
    log = PartitionLog(directory, log_config(policy))
    append = log.append
    start = time.perf_counter()
    for _ in range(count):
        append(batch, leader_epoch=0)
    elapsed = time.perf_counter() - start
    assert log.log_end_offset == count * rb.read_header(batch).record_count
    if keep:
        return elapsed, log
    log.close()
    log.delete()
    return elapsed, None


def raw_write_pass(directory: str, chunk: bytes, count: int, sync: bool) -> float:
    """os.write ``chunk`` ``count`` times to a fresh file in ``directory`` (fdatasync each if ``sync``)."""
    path = os.path.join(directory, "raw-ceiling.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write, fdatasync = os.write, os.fdatasync
        start = time.perf_counter()
        if sync:
            for _ in range(count):
                write(fd, chunk)
                fdatasync(fd)
        else:
            for _ in range(count):
                write(fd, chunk)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return elapsed


def bench_append(root: str, values: list[bytes], reps: int, total_os: int, total_batch: int):
    """Returns (results, {batch size: open log written with policy os}) for the read benchmark."""
    results = []
    kept_logs = {}
    # Warm-up: first-touch of page-cache memory on this VM is slow; write and delete a log
    # as big as the largest measured one before measuring anything.
    warm = rb.encode_batch(values[:10_000])
    append_pass(os.path.join(root, "warmup"), warm, max(1, total_os // len(warm)), "os")
    raw_write_pass(root, warm, max(1, total_os // len(warm)), sync=False)

    for policy, total in (("os", total_os), ("batch", total_batch)):
        for size in BATCH_SIZES:
            batch = rb.encode_batch(values[:size])
            count = max(1, total // len(batch))
            nbytes = count * len(batch)
            records = count * size
            directory = os.path.join(root, f"log-{policy}-{size}")
            append_samples, ceiling_samples = [], []
            for rep in range(reps):
                keep = policy == "os" and rep == reps - 1
                elapsed, log = append_pass(directory, batch, count, policy, keep=keep)
                append_samples.append(elapsed)
                if log is not None:
                    kept_logs[size] = log
                ceiling_samples.append(raw_write_pass(root, batch, count, sync=policy == "batch"))
            best, median = best_and_median(append_samples)
            ceiling_best, _ = best_and_median(ceiling_samples)
            target = APPEND_TARGET_RATIO if (policy == "os" and size == 10_000) else None
            results.append(
                Result(
                    "append", f"append_{size}_flush_{policy}", records / best, nbytes / best / 1e6,
                    records / median, ratio=ceiling_best / best,
                    ratio_to="raw_write" + ("_fdatasync" if policy == "batch" else ""),
                    target=target, target_metric="ratio" if target else None, stat=f"best of {reps}",
                    note=f"{nbytes / MIB:.0f} MiB in {count} appends; ceiling {nbytes / ceiling_best / 1e6:.0f} MB/s",
                    extra={"ceiling_mb_per_s": round(nbytes / ceiling_best / 1e6, 1), "total_bytes": nbytes},
                )
            )
    return results, kept_logs


# --- 4. read ---------------------------------------------------------------------------------------


def read_pass(log: PartitionLog, destination: np.ndarray) -> tuple[float, int, int]:
    """Read the whole log sequentially in 8 MiB reads, copying each into ``destination``."""
    offset = log.log_start_offset
    end = log.log_end_offset
    nbytes = 0
    read = log.read
    start = time.perf_counter()
    while offset < end:
        result = read(offset, READ_MAX_BYTES)
        data = result.data
        size = len(data)
        np.copyto(destination[:size], np.frombuffer(data, np.uint8))
        nbytes += size
        offset = result.next_offset
        del data, result
    elapsed = time.perf_counter() - start
    return elapsed, nbytes, offset - log.log_start_offset


def memcpy_pass(source: np.ndarray, destination: np.ndarray, chunk: int) -> float:
    start = time.perf_counter()
    for position in range(0, source.nbytes, chunk):
        piece = source[position : position + chunk]
        np.copyto(destination[: piece.nbytes], piece)
    return time.perf_counter() - start


def bench_read(logs: dict[int, PartitionLog], reps: int) -> list[Result]:
    results = []
    destination = np.empty(READ_MAX_BYTES + 2 * MIB, np.uint8)  # room for one batch past max_bytes
    destination.fill(0)
    for size, log in sorted(logs.items()):
        samples = []
        first_pass = None
        nbytes = records = 0
        for _ in range(reps + 1):
            elapsed, nbytes, records = read_pass(log, destination)
            if first_pass is None:
                first_pass = elapsed  # maps the segment fresh: page faults on the mmap
                continue
            samples.append(elapsed)
        assert records == log.log_end_offset - log.log_start_offset
        # A typical read size, so the memcpy ceiling copies the same chunks.
        batch_bytes = rb.read_header(log.read(0, 1).data).size_bytes
        chunk = (READ_MAX_BYTES // batch_bytes) * batch_bytes
        source = np.empty(nbytes, np.uint8)
        source.fill(1)
        memcpy_pass(source, destination, chunk)  # warm-up
        ceiling_samples = [memcpy_pass(source, destination, chunk) for _ in range(reps)]
        del source
        best, median = best_and_median(samples)
        ceiling_best, _ = best_and_median(ceiling_samples)
        results.append(
            Result(
                "read", f"read_{size}", records / best, nbytes / best / 1e6, records / median,
                ratio=ceiling_best / best, ratio_to="memcpy", stat=f"best of {reps} (after 1 unmeasured first pass)",
                note=(
                    f"{nbytes / MIB:.0f} MiB; memcpy ceiling {nbytes / ceiling_best / 1e6:.0f} MB/s; "
                    f"first pass (fresh mmap) {nbytes / first_pass / 1e6:.0f} MB/s"
                ),
                extra={
                    "ceiling_mb_per_s": round(nbytes / ceiling_best / 1e6, 1),
                    "first_pass_mb_per_s": round(nbytes / first_pass / 1e6, 1),
                },
            )
        )
    return results


# --- main ------------------------------------------------------------------------------------------


def print_table(results: list[Result]) -> None:
    header = f"{'case':<34} {'records/s':>14} {'MB/s':>9} {'ratio':>7}  {'vs':<24} {'target':<16} {'met':<4} note"
    print(header)
    print("-" * len(header))
    section = None
    for r in results:
        if r.section != section:
            section = r.section
            print(f"[{section}]")
        target = ""
        if r.target is not None:
            target = f">= {r.target:.0%} ceiling" if r.target_metric == "ratio" else f">= {r.target / 1e6:.0f}M rec/s"
        met = {None: "", True: "yes", False: "NO"}[r.meets_target]
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        records = "" if r.records_per_s is None else f"{r.records_per_s:,.0f}"
        mb = "" if r.mb_per_s is None else f"{r.mb_per_s:,.0f}"
        print(f"{r.case:<34} {records:>14} {mb:>9} {ratio:>7}  {r.ratio_to or '':<24} {target:<16} {met:<4} {r.note}")


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    parser.add_argument("--dir", help="put the data in a fresh subdirectory of DIR, removed at the end (default: under /tmp)")
    args = parser.parse_args(argv)

    if args.quick:
        reps, min_seconds, total_os, total_batch = 3, 0.05, 64 * MIB, 16 * MIB
    else:
        reps, min_seconds, total_os, total_batch = 5, 0.25, 512 * MIB, 128 * MIB

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="bench_storage-", dir=args.dir)
    else:
        root = tempfile.mkdtemp(prefix="bench_storage-", dir="/tmp")

    started = time.perf_counter()
    print(
        f"bench_storage: {'quick' if args.quick else 'full'} run, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
        f"pyarrow {pa.__version__}, numpy {np.__version__}, data in {root}",
        flush=True,
    )
    print(f"values: {VALUE_SIZE} random bytes; each figure is the best of {reps} repetitions", flush=True)
    values = make_values(max(BATCH_SIZES))
    results: list[Result] = []
    logs: dict[int, PartitionLog] = {}
    try:
        results += bench_encode(values, reps, min_seconds)
        print(f"  encode done ({time.perf_counter() - started:.0f} s)", flush=True)
        results += bench_decode(values, reps, min_seconds)
        print(f"  decode done ({time.perf_counter() - started:.0f} s)", flush=True)
        append_results, logs = bench_append(root, values, reps, total_os, total_batch)
        results += append_results
        print(f"  append done ({time.perf_counter() - started:.0f} s)", flush=True)
        results += bench_read(logs, reps)
        print(f"  read done ({time.perf_counter() - started:.0f} s)", flush=True)
        results += bench_encode_without_heap_trim(values, reps, min_seconds)
    finally:
        for log in logs.values():
            log.close()
        shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(results)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    missed = [r.case for r in results if r.meets_target is False]
    print("targets: all met" if not missed else f"targets missed: {', '.join(missed)}")
    print()
    for r in results:
        print(r.json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
