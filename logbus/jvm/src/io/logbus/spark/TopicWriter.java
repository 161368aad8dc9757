package io.logbus.spark;

import java.util.ArrayDeque;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Queue;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;

import io.ray.api.BaseActorHandle;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.function.PyActorMethod;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.UnsafeRow;
import org.apache.spark.sql.catalyst.util.ArrayData;
import org.apache.spark.sql.connector.write.DataWriter;
import org.apache.spark.sql.connector.write.WriterCommitMessage;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.util.ArrowUtils;
import org.apache.spark.unsafe.Platform;

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
  // Replicas' actors by namespace and name, as found in Ray's GCS, for the executor's tasks to come (a lookup
  // is a call to the GCS); a name whose call failed is looked up again. At most HANDLES_KEPT, the eldest dropped.
  private static final int HANDLES_KEPT = 4096;
  private static final Map<String, PyActorHandle> HANDLES = Collections.synchronizedMap(
      new LinkedHashMap<String, PyActorHandle>(16, 0.75f, true) {
        private static final long serialVersionUID = 1L;

        @Override
        protected boolean removeEldestEntry(Map.Entry<String, PyActorHandle> eldest) {
          return size() > HANDLES_KEPT;
        }
      });

  private final WriteOptions options;
  private final BufferAllocator allocator;
  private final BatchEncoder[] encoders;
  private final String[][] replicas;
  private final ArrayDeque<Pending> pending = new ArrayDeque<>();
  private final Pending[] last; // each partition's batch in flight: one at a time, so a retry keeps their order
  private final long batchBytes;
  // Frames full batches and makes their first call while the task's thread goes on with the next rows (the
  // Arrow IPC copy, the CRC and Ray's copies into its object store: over a third of a task's time alone),
  // in the order sent. Its encoders come back to `spare`, emptied, for the task's thread to fill again (at
  // most partitions + IN_FLIGHT + 1 encoders, each holding up to twice a batch's bytes: they keep their buffers).
  private final ExecutorService sender;
  private final Queue<BatchEncoder> spare = new ConcurrentLinkedQueue<>();
  private final Queue<BatchEncoder> broken = new ConcurrentLinkedQueue<>();
  private int sticky;
  private long written;

  /** A batch sent and not yet acknowledged. */
  private static final class Pending {
    final int partition;
    final long deadline;
    Future<?> sent; // framing and the first call, on the sender thread
    byte[] batch;
    int replica;
    String name; // the namespace and name of the replica the batch was last sent to
    ObjectRef<byte[]> reply;

    Pending(int partition, long deadline) {
      this.partition = partition;
      this.deadline = deadline;
    }
  }

  /** The topic's partitions (each one's replicas' actor names, the leader's first) and max.message.bytes. */
  static final class Layout implements java.io.Serializable {
    private static final long serialVersionUID = 1L;
    final String[][] replicas;
    final int maxMessageBytes;

    Layout(String[][] replicas, int maxMessageBytes) {
      this.replicas = replicas;
      this.maxMessageBytes = maxMessageBytes;
    }

    /** As logbus's controller has it now. */
    static Layout of(WriteOptions options) {
      TopicClient client = new TopicClient(options.topic, options.namespace, 0, options.timeoutMs);
      String[][] replicas = client.partitions().toArray(new String[0][]);
      return new Layout(replicas, client.maxMessageBytes());
    }
  }

  /**
   * {@code layout}: the topic as the job's plan found it (a batch write asks once, in the driver), or null to
   * ask logbus's controller now (a streaming write's epochs, which may come long after its start).
   */
  TopicWriter(WriteOptions options, Layout layout) {
    this.options = options;
    layout = layout == null ? Layout.of(options) : layout;
    replicas = new String[layout.replicas.length][];
    for (int p = 0; p < replicas.length; p++) {
      replicas[p] = layout.replicas[p].clone(); // await() replaces a partition's names after a failed round
    }
    // The records' bytes, leaving room for Arrow's offsets and padding and the frame header.
    batchBytes = Math.max(1, Math.min(BATCH_BYTES, layout.maxMessageBytes / 2));
    allocator = ArrowUtils.rootAllocator().newChildAllocator("logbus writer " + options.topic, 0, Long.MAX_VALUE);
    encoders = new BatchEncoder[replicas.length];
    last = new Pending[replicas.length];
    sticky = ThreadLocalRandom.current().nextInt(replicas.length);
    sender = Executors.newSingleThreadExecutor(task -> {
      Thread thread = new Thread(task, "logbus writer " + options.topic);
      thread.setDaemon(true);
      return thread;
    });
  }

  @Override
  public void write(InternalRow row) {
    // The key and value as ranges of an array: of the row's own array where the row is an UnsafeRow on the
    // heap (Spark's usual row), so they are copied once, into the batch; else copies Spark makes.
    byte[] keyArray = null;
    byte[] valueArray = null;
    int keyStart = 0;
    int keyLength = 0;
    int valueStart = 0;
    int valueLength = 0;
    if (row instanceof UnsafeRow && ((UnsafeRow) row).getBaseObject() instanceof byte[]) {
      UnsafeRow unsafe = (UnsafeRow) row;
      byte[] base = (byte[]) unsafe.getBaseObject();
      long start = unsafe.getBaseOffset() - Platform.BYTE_ARRAY_OFFSET;
      if (options.keyIndex >= 0 && !row.isNullAt(options.keyIndex)) {
        long offsetAndSize = unsafe.getLong(options.keyIndex); // a variable-length field's offset and size
        keyArray = base;
        keyStart = Math.toIntExact(start + (offsetAndSize >> 32));
        keyLength = (int) offsetAndSize;
      }
      if (options.valueIndex >= 0 && !row.isNullAt(options.valueIndex)) {
        long offsetAndSize = unsafe.getLong(options.valueIndex);
        valueArray = base;
        valueStart = Math.toIntExact(start + (offsetAndSize >> 32));
        valueLength = (int) offsetAndSize;
      }
    } else {
      keyArray = bytes(row, options.keyIndex);
      keyLength = keyArray == null ? 0 : keyArray.length;
      valueArray = bytes(row, options.valueIndex);
      valueLength = valueArray == null ? 0 : valueArray.length;
    }
    int partition;
    if (options.partitionIndex >= 0 && !row.isNullAt(options.partitionIndex)) {
      partition = row.getInt(options.partitionIndex);
      if (partition < 0 || partition >= replicas.length) {
        throw new IllegalArgumentException("partition " + partition + " of " + options.topic + ", which has " + replicas.length);
      }
    } else if (keyArray != null) {
      partition = Murmur2.partition(keyArray, keyStart, keyLength, replicas.length);
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
    encoder.add(keyArray, keyStart, keyLength, valueArray, valueStart, valueLength, System.currentTimeMillis(), headerKeys, headerValues);
    if (encoder.rows() >= BATCH_RECORDS || encoder.bytes() >= batchBytes) {
      send(partition);
      if (options.partitionIndex < 0 && keyArray == null && partition == sticky) {
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
    BatchEncoder full = encoders[partition];
    BatchEncoder next = spare.poll();
    encoders[partition] = next != null ? next : new BatchEncoder(allocator);
    written += full.rows();
    Pending sent = new Pending(partition, System.currentTimeMillis() + options.timeoutMs);
    sent.sent = sender.submit(() -> {
      try {
        sent.batch = full.frame();
      } catch (RuntimeException | Error e) {
        broken.add(full); // not filled again: closed with the writer
        throw e;
      }
      spare.add(full);
      submit(sent);
    });
    pending.add(sent);
    last[partition] = sent;
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
    String key = options.namespace + "/" + name;
    PyActorHandle handle = HANDLES.get(key);
    if (handle == null) {
      Optional<BaseActorHandle> found = Ray.getActor(name, options.namespace);
      if (!found.isPresent()) {
        batch.reply = null;
        return;
      }
      handle = (PyActorHandle) found.get();
      HANDLES.put(key, handle);
    }
    batch.name = key;
    batch.reply = handle.task(JVM_PRODUCE, batch.batch, options.acks, (int) Math.min(Integer.MAX_VALUE, options.timeoutMs)).remote();
  }

  /** Wait for a batch's acknowledgement, sending it to the partition's other replicas while its leader is away. */
  private void await(Pending batch) {
    try {
      batch.sent.get();
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(options.topic + "-" + batch.partition + ": interrupted while sending a batch", e);
    } catch (ExecutionException e) {
      Throwable cause = e.getCause();
      if (cause instanceof RuntimeException && retriable((RuntimeException) cause) && batch.batch != null) {
        batch.reply = null; // the call failed: sent again below, to the replica's actor looked up again
        if (batch.name != null) {
          HANDLES.remove(batch.name);
        }
      } else {
        throw new IllegalStateException(options.topic + "-" + batch.partition + ": framing or sending a batch failed: " + cause, cause);
      }
    }
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
        if (batch.name != null) {
          HANDLES.remove(batch.name); // looked up again when next used: the actor may have been replaced
        }
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
    // What the sender has queued is framed and sent (or fails) first: its encoders are in use. Its work is
    // short (a copy, a call that does not wait for its reply), so it is waited for even when Spark interrupts
    // the task, within the write's timeout: Arrow's buffers are freed only by closing them.
    sender.shutdown();
    boolean interrupted = false;
    long deadline = System.currentTimeMillis() + options.timeoutMs;
    while (!sender.isTerminated() && System.currentTimeMillis() < deadline) {
      try {
        sender.awaitTermination(Math.max(1, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
      } catch (InterruptedException e) {
        interrupted = true;
      }
    }
    if (interrupted) {
      Thread.currentThread().interrupt();
    }
    if (!sender.isTerminated()) {
      sender.shutdownNow();
      return; // its buffers are left unfreed rather than freed under it
    }
    for (BatchEncoder encoder : encoders) {
      if (encoder != null) {
        encoder.close();
      }
    }
    for (BatchEncoder encoder : spare) {
      encoder.close();
    }
    for (BatchEncoder encoder : broken) {
      encoder.close();
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
