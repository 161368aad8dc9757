package io.logbus.spark;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayDeque;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.ThreadLocalRandom;

import io.ray.api.BaseActorHandle;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.function.PyActorMethod;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.util.ArrayData;
import org.apache.spark.sql.connector.write.DataWriter;
import org.apache.spark.sql.connector.write.WriterCommitMessage;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.util.ArrowUtils;

/**
 * One Spark task's rows into a topic: rows are gathered per partition into Arrow batches and each full
 * batch is sent to the partition's leader replica ({@code jvm_produce}, a Ray cross-language call),
 * several in flight; {@link #commit} returns once every batch is acknowledged. Partitions as Kafka's
 * producer picks them: the row's {@code partition} if the DataFrame has one, else murmur2 of the key,
 * else one partition per batch in turn (sticky). A partition's batches are sent one at a time, so
 * they are written in order. At least once: a batch sent again after a lost reply, or by a task
 * Spark runs again, is written again (the writer has no producer id).
 */
final class TopicWriter implements DataWriter<InternalRow> {
  private static final PyActorMethod<byte[]> JVM_PRODUCE = PyActorMethod.of("jvm_produce", byte[].class);
  static final int BATCH_RECORDS = 65_536;
  // Larger batches mean fewer calls, each of which costs the replica an object-store read and an actor
  // call: 4 MiB wrote 1M records in 0.8-0.9 s where 1 MiB took 1.2-1.5 s. Within max.message.bytes.
  static final long BATCH_BYTES = 4 << 20;
  static final int IN_FLIGHT = 8;

  private final WriteOptions options;
  private final BufferAllocator allocator;
  private final BatchEncoder[] encoders;
  private final String[][] replicas;
  private final ArrayDeque<Pending> pending = new ArrayDeque<>();
  private final Pending[] last; // each partition's batch in flight: one at a time, so a retry keeps their order
  private final long batchBytes;
  private int sticky;
  private long written;

  /** A batch sent and not yet acknowledged. */
  private static final class Pending {
    final int partition;
    final byte[] batch;
    final long deadline;
    int replica;
    ObjectRef<byte[]> reply;

    Pending(int partition, byte[] batch, long deadline) {
      this.partition = partition;
      this.batch = batch;
      this.deadline = deadline;
    }
  }

  TopicWriter(WriteOptions options) {
    this.options = options;
    TopicClient client = new TopicClient(options.topic, options.namespace, 0, options.timeoutMs);
    replicas = client.partitions().toArray(new String[0][]);
    // The records' bytes, leaving room for Arrow's offsets and padding and the frame header.
    batchBytes = Math.max(1, Math.min(BATCH_BYTES, client.maxMessageBytes() / 2));
    allocator = ArrowUtils.rootAllocator().newChildAllocator("logbus writer " + options.topic, 0, Long.MAX_VALUE);
    encoders = new BatchEncoder[replicas.length];
    last = new Pending[replicas.length];
    sticky = ThreadLocalRandom.current().nextInt(replicas.length);
  }

  @Override
  public void write(InternalRow row) {
    byte[] key = bytes(row, options.keyIndex);
    byte[] value = bytes(row, options.valueIndex);
    int partition;
    if (options.partitionIndex >= 0 && !row.isNullAt(options.partitionIndex)) {
      partition = row.getInt(options.partitionIndex);
      if (partition < 0 || partition >= replicas.length) {
        throw new IllegalArgumentException("partition " + partition + " of " + options.topic + ", which has " + replicas.length);
      }
    } else if (key != null) {
      partition = Murmur2.partition(key, replicas.length);
    } else {
      partition = sticky;
    }
    byte[][] headerKeys = null;
    byte[][] headerValues = null;
    if (options.headersIndex >= 0 && !row.isNullAt(options.headersIndex)) {
      ArrayData array = row.getArray(options.headersIndex);
      headerKeys = new byte[array.numElements()][];
      headerValues = new byte[array.numElements()][];
      for (int i = 0; i < headerKeys.length; i++) {
        InternalRow header = array.getStruct(i, 2);
        if (header.isNullAt(0)) {
          throw new IllegalArgumentException("a header needs a key");
        }
        headerKeys[i] = header.getUTF8String(0).getBytes();
        headerValues[i] = header.isNullAt(1) ? null : header.getBinary(1);
      }
    }
    BatchEncoder encoder = encoders[partition];
    if (encoder == null) {
      encoder = encoders[partition] = new BatchEncoder(allocator);
    }
    encoder.add(key, value, System.currentTimeMillis(), headerKeys, headerValues);
    if (encoder.rows() >= BATCH_RECORDS || encoder.bytes() >= batchBytes) {
      send(partition);
      if (options.partitionIndex < 0 && key == null && partition == sticky) {
        sticky = (sticky + 1) % replicas.length;
      }
    }
  }

  private byte[] bytes(InternalRow row, int index) {
    if (index < 0 || row.isNullAt(index)) {
      return null;
    }
    return options.types[index] == DataTypes.StringType ? row.getUTF8String(index).getBytes() : row.getBinary(index);
  }

  private void send(int partition) {
    if (last[partition] != null && pending.remove(last[partition])) {
      await(last[partition]); // a partition's batches are acknowledged in order
    }
    byte[] batch = encoders[partition].frame();
    Pending sent = new Pending(partition, batch, System.currentTimeMillis() + options.timeoutMs);
    submit(sent);
    pending.add(sent);
    last[partition] = sent;
    written += ByteBuffer.wrap(batch).order(ByteOrder.LITTLE_ENDIAN).getInt(23);
    while (pending.size() > IN_FLIGHT) {
      await(pending.poll());
    }
  }

  private void submit(Pending batch) {
    String[] names = replicas[batch.partition];
    if (names.length == 0) { // no replica on a live node now: await asks the controller again
      batch.reply = null;
      return;
    }
    String name = names[batch.replica % names.length];
    Optional<BaseActorHandle> handle = Ray.getActor(name, options.namespace);
    batch.reply = handle.isPresent()
        ? ((PyActorHandle) handle.get()).task(JVM_PRODUCE, batch.batch, options.acks, (int) Math.min(Integer.MAX_VALUE, options.timeoutMs)).remote()
        : null;
  }

  /** Wait for a batch's acknowledgement, sending it to the partition's other replicas while its leader is away. */
  private void await(Pending batch) {
    RuntimeException last = null;
    while (true) {
      try {
        if (batch.reply != null) {
          Ray.get(batch.reply, Math.max(1, batch.deadline - System.currentTimeMillis()));
          return;
        }
      } catch (RuntimeException e) {
        if (!retriable(e)) {
          throw new IllegalStateException(options.topic + "-" + batch.partition + ": writing a batch failed: " + e.getMessage(), e);
        }
        last = e;
      }
      if (System.currentTimeMillis() >= batch.deadline) {
        throw new IllegalStateException(options.topic + "-" + batch.partition + ": no leader took a batch within "
            + options.timeoutMs + " ms" + (last == null ? "" : "; last error: " + last.getMessage()), last);
      }
      batch.replica++;
      if (replicas[batch.partition].length == 0 || batch.replica % replicas[batch.partition].length == 0) {
        TopicClient.pause(200);
        try {
          List<String[]> names = new TopicClient(options.topic, options.namespace, 0, options.timeoutMs).partitions();
          replicas[batch.partition] = names.get(batch.partition);
        } catch (RuntimeException e) {
          // the controller may be away too: keep the names known
        }
      }
      submit(batch);
    }
  }

  private static boolean retriable(RuntimeException e) {
    String text = String.valueOf(e.getMessage());
    return e instanceof io.ray.api.exception.RayActorException
        || e instanceof io.ray.api.exception.RayTimeoutException
        || text.contains("NotLeaderError") || text.contains("LeaderNotAvailableError") || text.contains("NotEnoughReplicasError")
        || text.contains("RequestTimedOutError") || text.contains("FencedLeaderEpochError") || text.contains("ReplicaNotAvailableError")
        || text.contains("ActorDiedError") || text.contains("ActorUnavailableError") || text.contains("ObjectLostException");
  }

  @Override
  public WriterCommitMessage commit() {
    for (int p = 0; p < encoders.length; p++) {
      if (encoders[p] != null && encoders[p].rows() > 0) {
        send(p);
      }
    }
    while (!pending.isEmpty()) {
      await(pending.poll());
    }
    return new Written(written);
  }

  @Override
  public void abort() {
    pending.clear(); // batches already sent stay written (at least once, as Spark's Kafka sink)
  }

  @Override
  public void close() {
    for (BatchEncoder encoder : encoders) {
      if (encoder != null) {
        encoder.close();
      }
    }
    allocator.close();
  }

  /** How many records a task wrote. */
  static final class Written implements WriterCommitMessage {
    private static final long serialVersionUID = 1L;
    final long records;

    Written(long records) {
      this.records = records;
    }
  }
}
