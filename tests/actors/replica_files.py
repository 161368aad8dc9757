"""Test helper: a replica's committed batches read straight from its segment files, to compare replicas byte for byte
(or, for compacted topics, whose replicas each compact their own copy, record for record).

Replicas of one partition must hold the same bytes for every offset below
the high watermark, unless the topic is compacted: each replica compacts its
own copy, so only the records at the offsets both still hold must agree. Rather than ask the replicas (an RPC that would exist for
tests only), the tests read the files: every node of the test cluster runs on
this machine, so every replica's directory is visible here. Only whole
batches below ``max_offset`` are read (the replica may be appending after
them).
"""

from __future__ import annotations

import os

from logbus.actors.placement import replica_directory
from logbus.errors import CorruptRecordError
from logbus.storage import record_batch as rb
from logbus.storage.segment import LOG_SUFFIX


def committed_bytes(data_dir: str, topic: str, partition: int, replica_id: int, max_offset: int) -> bytes:
    """Every batch of one replica's log that ends at or below ``max_offset``, concatenated in offset order."""
    directory = replica_directory(data_dir, topic, partition, replica_id)
    chunks = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith(LOG_SUFFIX)):
        with open(os.path.join(directory, name), "rb") as file:
            data = file.read()
        position = 0
        while position + rb.HEADER_SIZE <= len(data):
            header = rb.read_header(data, position)
            if header.next_offset > max_offset:
                return b"".join(chunks)
            chunks.append(data[position : position + header.size_bytes])
            position += header.size_bytes
    return b"".join(chunks)


def committed_records(data_dir: str, topic: str, partition: int, replica_id: int, max_offset: int) -> list[tuple] | None:
    """Every record of one replica's log below ``max_offset``: [(offset, key, value)], read from its
    segment files; offsets may have gaps (a compacted log). None if a file changed while it was read
    (the replica swapped in a cleaned segment): ask again."""
    directory = replica_directory(data_dir, topic, partition, replica_id)
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(LOG_SUFFIX))
        for name in names:
            with open(os.path.join(directory, name), "rb") as file:
                data = file.read()
            position = 0
            while position + rb.HEADER_SIZE <= len(data):
                header, records = rb.decode_records(data, position)
                if header.next_offset > max_offset:
                    return out
                keys, values = records.column("key").to_pylist(), records.column("value").to_pylist()
                out += [(header.base_offset + i, k, v) for i, (k, v) in enumerate(zip(keys, values))]
                position += header.size_bytes
    except (FileNotFoundError, CorruptRecordError):
        return None
    offsets = [o for o, _, _ in out]
    return out if offsets == sorted(set(offsets)) else None  # a segment read before and after a swap
