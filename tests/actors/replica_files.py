"""Test helper: a replica's committed batches read straight from its segment files, to compare replicas byte for byte.

Replicas of one partition must hold the same bytes for every offset below
the high watermark. Rather than ask the replicas (an RPC that would exist for
tests only), the tests read the files: every node of the test cluster runs on
this machine, so every replica's directory is visible here. Only whole
batches below ``max_offset`` are read (the replica may be appending after
them).
"""

from __future__ import annotations

import os

from logbus.actors.placement import replica_directory
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
