package io.logbus.spark;

/** Kafka's default partitioner for keyed records: {@code toPositive(murmur2(key)) % partitions}. */
final class Murmur2 {
  private Murmur2() {}

  /** The partition of the key held in {@code data[start, start + length)}. */
  static int partition(byte[] data, int start, int length, int partitions) {
    return (hash(data, start, length) & 0x7fffffff) % partitions;
  }

  /** Kafka's {@code Utils.murmur2} (seed 0x9747b28c) of {@code data[start, start + length)}. */
  static int hash(byte[] data, int start, int length) {
    int seed = 0x9747b28c;
    final int m = 0x5bd1e995;
    final int r = 24;
    int h = seed ^ length;
    int length4 = length / 4;
    for (int i = 0; i < length4; i++) {
      final int i4 = start + i * 4;
      int k = (data[i4] & 0xff) + ((data[i4 + 1] & 0xff) << 8) + ((data[i4 + 2] & 0xff) << 16) + ((data[i4 + 3] & 0xff) << 24);
      k *= m;
      k ^= k >>> r;
      k *= m;
      h *= m;
      h ^= k;
    }
    switch (length % 4) {
      case 3:
        h ^= (data[start + (length & ~3) + 2] & 0xff) << 16;
        // fall through
      case 2:
        h ^= (data[start + (length & ~3) + 1] & 0xff) << 8;
        // fall through
      case 1:
        h ^= data[start + (length & ~3)] & 0xff;
        h *= m;
        // fall through
      default:
        break;
    }
    h ^= h >>> 13;
    h *= m;
    h ^= h >>> 15;
    return h;
  }
}
