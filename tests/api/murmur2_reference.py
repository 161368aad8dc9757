"""Kafka's murmur2 partitioner, ported line by line from the Java client (Utils.murmur2, toPositive).

A slow reference for tests: the producer uses a C implementation and must agree with this.
"""


def murmur2(data: bytes) -> int:
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16) + ((data[i4 + 3] & 0xFF) << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length & ~3
    if tail == 3:
        h ^= (data[base + 2] & 0xFF) << 16
    if tail >= 2:
        h ^= (data[base + 1] & 0xFF) << 8
    if tail >= 1:
        h ^= data[base] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def kafka_partition(key: bytes, partitions: int) -> int:
    """Java: Utils.toPositive(Utils.murmur2(keyBytes)) % numPartitions."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
