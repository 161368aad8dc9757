"""End-to-end demo. Until the broker lands this exercises the storage engine directly."""

import shutil
import time
from pathlib import Path

from logbus.storage import LogConfig, PartitionLog, decode_batches, encode_batch


def main() -> None:
    directory = Path("logbus-data") / "demo-storage" / "page-views-0"
    shutil.rmtree(directory, ignore_errors=True)
    log = PartitionLog(str(directory), LogConfig.from_dict({"segment.bytes": 64 << 20}))
    values = [b'{"user": "u%06d", "page": "/p/%d"}' % (i, i % 97) for i in range(10_000)]
    started = time.perf_counter()
    for _ in range(100):
        log.append(encode_batch(values, keys=[v[9:16] for v in values]))
    produced_s = time.perf_counter() - started
    started = time.perf_counter()
    offset = count = 0
    while (result := log.read(offset, 8 << 20)) is not None:
        count += sum(records.num_rows for _, records in decode_batches(result.data))
        offset = result.next_offset
    read_s = time.perf_counter() - started
    print(f"appended 1,000,000 records in {produced_s:.2f}s ({1e6 / produced_s:,.0f} records/s)")
    print(f"read back {count:,} records in {read_s:.2f}s ({count / read_s:,.0f} records/s)")
    log.close()


if __name__ == "__main__":
    main()
