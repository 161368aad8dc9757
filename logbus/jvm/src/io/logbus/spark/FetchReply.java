package io.logbus.spark;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;

/**
 * A replica's {@code jvm_fetch} reply: the layout is in {@code logbus/protocol/jvm_fetch.py}. Each
 * batch is a 64-byte frame header ({@code logbus/storage/batch_header.py}), then (unless the reply
 * holds headers only) one Arrow IPC record batch message.
 */
final class FetchReply {
  static final int MAGIC = 0x464A424C; // "LBJF" read little-endian
  static final int HEADERS_ONLY = 1;
  static final int SIZE = 40;
  static final int FRAME_HEADER = 64;
  // Frame header fields.
  private static final int BASE_OFFSET = 0;
  private static final int BATCH_LENGTH = 8;
  private static final int ATTRIBUTES = 21;
  private static final int RECORD_COUNT = 23;
  private static final int MAX_TIMESTAMP = 35;
  private static final int LOG_OVERHEAD = 12;
  static final int LOG_APPEND_TIME_MASK = 0x8;

  final byte[] bytes;
  final ByteBuffer buffer;
  final boolean headersOnly;
  final long firstOffset;
  final long nextOffset;
  final long highWatermark;
  final int columns;
  final int[] positions;

  FetchReply(byte[] bytes) {
    this.bytes = bytes;
    buffer = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN);
    if (bytes.length < SIZE || buffer.getInt(0) != MAGIC) {
      throw new IllegalStateException("not a logbus jvm_fetch reply (" + bytes.length + " bytes)");
    }
    headersOnly = (buffer.getInt(4) & HEADERS_ONLY) != 0;
    firstOffset = buffer.getLong(8);
    nextOffset = buffer.getLong(16);
    highWatermark = buffer.getLong(24);
    int count = buffer.getInt(32);
    columns = buffer.getInt(36);
    positions = new int[count];
    int position = SIZE;
    for (int i = 0; i < count; i++) {
      positions[i] = position;
      position += headersOnly ? FRAME_HEADER : LOG_OVERHEAD + buffer.getInt(position + BATCH_LENGTH);
    }
    if (position != bytes.length) {
      throw new IllegalStateException("a logbus jvm_fetch reply of " + bytes.length + " bytes ends its batches at " + position);
    }
  }

  int batches() {
    return positions.length;
  }

  long baseOffset(int batch) {
    return buffer.getLong(positions[batch] + BASE_OFFSET);
  }

  int recordCount(int batch) {
    return buffer.getInt(positions[batch] + RECORD_COUNT);
  }

  int attributes(int batch) {
    return buffer.getShort(positions[batch] + ATTRIBUTES);
  }

  long maxTimestampMs(int batch) {
    return buffer.getLong(positions[batch] + MAX_TIMESTAMP);
  }

  /** Where the batch's Arrow message starts, and its length. */
  int payload(int batch) {
    return positions[batch] + FRAME_HEADER;
  }

  int payloadLength(int batch) {
    return LOG_OVERHEAD + buffer.getInt(positions[batch] + BATCH_LENGTH) - FRAME_HEADER;
  }
}
