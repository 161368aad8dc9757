package io.logbus.spark;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.channels.WritableByteChannel;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.zip.CRC32C;

import org.apache.arrow.memory.ArrowBuf;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.BigIntVector;
import org.apache.arrow.vector.BitVectorHelper;
import org.apache.arrow.vector.FieldVector;
import org.apache.arrow.vector.VarBinaryVector;
import org.apache.arrow.vector.VarCharVector;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.VectorUnloader;
import org.apache.arrow.vector.complex.MapVector;
import org.apache.arrow.vector.complex.StructVector;
import org.apache.arrow.vector.ipc.WriteChannel;
import org.apache.arrow.vector.ipc.message.ArrowRecordBatch;
import org.apache.arrow.vector.ipc.message.IpcOption;
import org.apache.arrow.vector.ipc.message.MessageSerializer;

/**
 * Records for one partition, gathered into Arrow vectors of the batch schema and framed as a logbus
 * batch ({@code logbus/storage/batch_header.py}: the 64-byte frame header, CRC32C and all, then the Arrow
 * IPC record batch message), as a producer of no producer id (not idempotent) frames it. Not thread-safe.
 */
final class BatchEncoder implements AutoCloseable {
  private static final byte MAGIC = 0x4C;
  private static final int LOG_OVERHEAD = 12;
  // The offsets buffers among a batch's 17 (key 3, value 3, timestamp 2, headers 2, entries 1, their key 3
  // and value 3: validity, offsets, data in field order).
  private static final int[] OFFSET_BUFFERS = {1, 4, 9, 12, 15};

  private final BufferAllocator allocator;
  private final VectorSchemaRoot root;
  private final VarBinaryVector keys;
  private final VarBinaryVector values;
  private final BigIntVector timestamps;
  private final MapVector headers;
  private final StructVector entries;
  private final VarCharVector headerKeys;
  private final VarBinaryVector headerValues;
  private int rows;
  private int entryCount;
  private long bytes;
  private long firstTimestamp;
  private long maxTimestamp;

  BatchEncoder(BufferAllocator allocator) {
    this.allocator = allocator;
    root = VectorSchemaRoot.create(new org.apache.arrow.vector.types.pojo.Schema(BatchDecoder.FIELDS), allocator);
    keys = (VarBinaryVector) root.getVector("key");
    values = (VarBinaryVector) root.getVector("value");
    timestamps = (BigIntVector) root.getVector("timestamp");
    headers = (MapVector) root.getVector("headers");
    entries = (StructVector) headers.getDataVector();
    headerKeys = (VarCharVector) entries.getChildByOrdinal(0);
    headerValues = (VarBinaryVector) entries.getChildByOrdinal(1);
    root.allocateNew();
  }

  /**
   * Empty again for the next batch, which reuses the buffers this one grew (validity and offsets zeroed): a
   * batch of 4 MiB would otherwise grow its buffers from Arrow's default size again, copying them each time.
   */
  private void reset() {
    for (FieldVector vector : root.getFieldVectors()) {
      vector.reset();
    }
    root.setRowCount(0);
    rows = 0;
    entryCount = 0;
    bytes = 0;
  }

  int rows() {
    return rows;
  }

  long bytes() {
    return bytes;
  }

  /**
   * One record whose key and value are ranges of arrays ({@code key[keyStart, keyStart + keyLength)}; a null
   * array for a null key or value), copied once, into the batch's vectors; {@code hKeys}/{@code hValues} null
   * for no headers.
   */
  void add(byte[] key, int keyStart, int keyLength, byte[] value, int valueStart, int valueLength, long timestampMs,
      byte[][] hKeys, byte[][] hValues) {
    if (key == null) {
      keys.setNull(rows);
    } else {
      keys.setSafe(rows, key, keyStart, keyLength);
      bytes += keyLength;
    }
    if (value == null) {
      values.setNull(rows);
    } else {
      values.setSafe(rows, value, valueStart, valueLength);
      bytes += valueLength;
    }
    timestamps.setSafe(rows, timestampMs);
    if (hKeys == null) {
      // An empty entry list made null: ListVector.setNull refills every offset since the last value it
      // set, which made a batch of header-less records quadratic.
      headers.startNewValue(rows);
      headers.endValue(rows, 0);
      BitVectorHelper.unsetBit(headers.getValidityBuffer(), rows);
    } else {
      headers.startNewValue(rows);
      for (int i = 0; i < hKeys.length; i++) {
        entries.setIndexDefined(entryCount);
        headerKeys.setSafe(entryCount, hKeys[i]);
        if (hValues[i] == null) {
          headerValues.setNull(entryCount);
        } else {
          headerValues.setSafe(entryCount, hValues[i]);
          bytes += hValues[i].length;
        }
        bytes += hKeys[i].length + 12; // and their offsets and validity
        entryCount++;
      }
      headers.endValue(rows, hKeys.length);
    }
    firstTimestamp = rows == 0 ? timestampMs : firstTimestamp;
    maxTimestamp = rows == 0 ? timestampMs : Math.max(maxTimestamp, timestampMs);
    rows++;
    bytes += 24; // the timestamp, the offsets of key, value and headers, validity
  }

  /** The records added since the last call, framed as one batch; the encoder is empty again. */
  byte[] frame() {
    headerKeys.setValueCount(entryCount);
    headerValues.setValueCount(entryCount);
    entries.setValueCount(entryCount);
    root.setRowCount(rows);
    ArrayChannel out;
    try (ArrowRecordBatch batch = new VectorUnloader(root).getRecordBatch();
        ArrowBuf oneOffset = allocator.buffer(8)) {
      // Arrow Java writes an empty variable-width vector's offsets as no bytes; the format (and Arrow
      // C++, which readers use) wants its one offset: the headers' keys and values of a batch without
      // headers.
      oneOffset.setZero(0, 8);
      oneOffset.writerIndex(4);
      List<ArrowBuf> buffers = new ArrayList<>(batch.getBuffers());
      boolean empty = false;
      for (int i : OFFSET_BUFFERS) {
        if (buffers.get(i).readableBytes() == 0) {
          buffers.set(i, oneOffset);
          empty = true;
        }
      }
      if (empty) {
        try (ArrowRecordBatch whole = new ArrowRecordBatch(batch.getLength(), batch.getNodes(), buffers)) {
          out = serialize(whole);
        }
      } else {
        out = serialize(batch);
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    byte[] framed = out.array();
    ByteBuffer header = ByteBuffer.wrap(framed).order(ByteOrder.LITTLE_ENDIAN);
    header.putLong(0, 0L); // base offset: the leader assigns it
    header.putInt(8, framed.length - LOG_OVERHEAD);
    header.putInt(12, -1); // leader epoch: the leader assigns it
    header.put(16, MAGIC);
    header.putShort(21, (short) 0); // no compression, CreateTime
    header.putInt(23, rows);
    header.putLong(27, firstTimestamp);
    header.putLong(35, maxTimestamp);
    header.putLong(43, -1L); // no producer id
    header.putShort(51, (short) -1);
    header.putInt(53, -1);
    CRC32C crc = new CRC32C();
    crc.update(framed, 21, framed.length - 21);
    header.putInt(17, (int) crc.getValue());
    reset();
    return framed;
  }

  /**
   * The batch as an IPC message after the 64 bytes of the frame header, in an array of its exact size: the
   * message's length (the continuation marker and metadata length, the metadata padded to 8 bytes, then the
   * body) is known before it is written, so its buffers are copied once, into the array.
   */
  private static ArrayChannel serialize(ArrowRecordBatch batch) throws IOException {
    int metadata = MessageSerializer.serializeMetadata(batch, IpcOption.DEFAULT).remaining();
    long size = 64L + 8 + ((metadata + 7) & ~7L) + batch.computeBodyLength();
    ArrayChannel out = new ArrayChannel((int) Math.min(Integer.MAX_VALUE - 8, size));
    out.position = 64;
    MessageSerializer.serialize(new WriteChannel(out), batch, IpcOption.DEFAULT);
    return out;
  }

  /** A channel writing into one array, grown only if the message is longer than foreseen. */
  private static final class ArrayChannel implements WritableByteChannel {
    private byte[] array;
    private int position;

    ArrayChannel(int capacity) {
      array = new byte[capacity];
    }

    @Override
    public int write(ByteBuffer source) {
      int length = source.remaining();
      if (array.length - position < length) {
        array = Arrays.copyOf(array, Math.max(position + length, array.length * 2));
      }
      source.get(array, position, length);
      position += length;
      return length;
    }

    /** What was written, the frame header's 64 bytes first (zeros until the caller fills them). */
    byte[] array() {
      return position == array.length ? array : Arrays.copyOf(array, position);
    }

    @Override
    public boolean isOpen() {
      return true;
    }

    @Override
    public void close() {}
  }

  @Override
  public void close() {
    root.close();
  }
}
