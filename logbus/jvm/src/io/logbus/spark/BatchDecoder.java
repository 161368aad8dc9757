package io.logbus.spark;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;

import org.apache.arrow.flatbuf.Message;
import org.apache.arrow.flatbuf.MessageHeader;
import org.apache.arrow.flatbuf.RecordBatch;
import org.apache.arrow.memory.ArrowBuf;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.VectorLoader;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.ipc.message.ArrowRecordBatch;
import org.apache.arrow.vector.ipc.message.MessageSerializer;
import org.apache.arrow.vector.types.pojo.ArrowType;
import org.apache.arrow.vector.types.pojo.Field;
import org.apache.arrow.vector.types.pojo.FieldType;
import org.apache.arrow.vector.types.pojo.Schema;

/**
 * Loads one logbus batch's Arrow IPC record batch message into vectors of the batch schema
 * ({@code record_batch.SCHEMA}: key, value, timestamp, headers), or of the fields a projected batch
 * holds ({@code record_batch.project_batch}). A reply is copied once into Arrow's
 * memory; each batch's vectors are slices of that copy (decompressed when the batch is compressed).
 * The vectors are reused: a batch's columns are valid until the next {@link #load}.
 */
final class BatchDecoder implements AutoCloseable {
  /** The batch schema's fields, in its order; a projected batch holds some of them (bit i: field i). */
  static final List<Field> FIELDS =
          List.of(
              Field.nullable("key", ArrowType.Binary.INSTANCE),
              Field.nullable("value", ArrowType.Binary.INSTANCE),
              Field.nullable("timestamp", new ArrowType.Int(64, true)),
              new Field(
                  "headers",
                  FieldType.nullable(new ArrowType.Map(false)),
                  List.of(
                      new Field(
                          "entries",
                          FieldType.notNullable(ArrowType.Struct.INSTANCE),
                          List.of(
                              new Field("key", FieldType.notNullable(ArrowType.Utf8.INSTANCE), null),
                              Field.nullable("value", ArrowType.Binary.INSTANCE))))));
  static final int ALL_COLUMNS = (1 << FIELDS.size()) - 1;

  /** The mask bit of a batch column, or 0 for the columns made from the frame header and the plan. */
  static int bit(String column) {
    for (int i = 0; i < FIELDS.size(); i++) {
      if (FIELDS.get(i).getName().equals(column)) {
        return 1 << i;
      }
    }
    return 0;
  }

  private final BufferAllocator allocator;
  final VectorSchemaRoot root;
  private final VectorLoader loader;
  private FetchReply copied;
  private ArrowBuf copy;

  /** {@code columns}: the mask of the fields the batches hold. */
  BatchDecoder(BufferAllocator allocator, int columns) {
    this.allocator = allocator;
    List<Field> fields = new ArrayList<>();
    for (int i = 0; i < FIELDS.size(); i++) {
      if ((columns >> i & 1) != 0) {
        fields.add(FIELDS.get(i));
      }
    }
    root = VectorSchemaRoot.create(new Schema(fields), allocator);
    loader = new VectorLoader(root, Codecs.INSTANCE);
  }

  /** Load batch {@code batch} of {@code reply} into {@link #root}. */
  void load(FetchReply reply, int batch) {
    if (copied != reply) {
      release();
      copy = allocator.buffer(reply.bytes.length);
      copy.setBytes(0, reply.bytes);
      copied = reply;
    }
    int position = reply.payload(batch);
    int end = position + reply.payloadLength(batch);
    int metadataLength = reply.buffer.getInt(position);
    int metadataStart = position + 4;
    if (metadataLength == -1) { // the continuation marker of Arrow's current IPC format
      metadataLength = reply.buffer.getInt(position + 4);
      metadataStart = position + 8;
    }
    ByteBuffer metadata = ByteBuffer.wrap(reply.bytes, metadataStart, metadataLength).slice().order(ByteOrder.LITTLE_ENDIAN);
    Message message = Message.getRootAsMessage(metadata);
    if (message.headerType() != MessageHeader.RecordBatch) {
      throw new IllegalStateException("a logbus batch holds an Arrow message of type " + message.headerType());
    }
    long bodyStart = (long) metadataStart + metadataLength;
    if (bodyStart + message.bodyLength() > end) {
      throw new IllegalStateException("a logbus batch's Arrow body runs past the batch");
    }
    RecordBatch header = (RecordBatch) message.header(new RecordBatch());
    ArrowBuf body = copy.slice(bodyStart, message.bodyLength());
    body.getReferenceManager().retain(); // deserializeRecordBatch releases the body it is given
    try (ArrowRecordBatch loaded = MessageSerializer.deserializeRecordBatch(header, body)) {
      loader.load(loaded);
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  private void release() {
    if (copy != null) {
      copy.close();
      copy = null;
      copied = null;
    }
  }

  @Override
  public void close() {
    root.close();
    release();
  }
}
