package io.logbus.spark;

import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.BigIntVector;
import org.apache.arrow.vector.VarBinaryVector;
import org.apache.arrow.vector.complex.MapVector;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.execution.vectorized.ConstantColumnVector;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.ArrowUtils;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * Reads one partition's {@code [start, end)}: one Spark columnar batch per logbus batch, over the
 * batch's own Arrow vectors. A query that needs no column (a count) asks the replica for batch headers
 * only and never receives records.
 */
final class RangeReader implements PartitionReader<ColumnarBatch> {
  private final ReadPlan.Range range;
  private final String[] columns;
  private final boolean headersOnly;
  private final ReplicaClient client;
  private final BufferAllocator allocator;
  private final BatchDecoder decoder;
  private final UTF8String topic;
  private long offset;
  private FetchReply reply;
  private long askedFrom;
  private int nextBatch;
  private int emptyReplies;
  private ColumnarBatch current;
  private boolean failed;

  RangeReader(ReadPlan plan, ReadPlan.Range range, StructType schema) {
    this.range = range;
    columns = schema.fieldNames();
    int fetched = 0;
    for (String column : columns) {
      fetched |= BatchDecoder.bit(column);
    }
    // Offsets, topic, partition and timestampType come from the frame header and the plan: a query of
    // only those (a count) fetches headers only. A query of the values takes the batches as stored (the
    // values are most of a batch: a projection would save little and cost the replica a decode).
    if ((fetched & BatchDecoder.bit("value")) != 0) {
      fetched = BatchDecoder.ALL_COLUMNS;
    }
    headersOnly = fetched == 0;
    client = new ReplicaClient(plan, range, fetched);
    allocator = ArrowUtils.rootAllocator().newChildAllocator("logbus " + plan.topic + "-" + range.partition, 0, Long.MAX_VALUE);
    decoder = headersOnly ? null : new BatchDecoder(allocator, fetched);
    topic = UTF8String.fromString(plan.topic);
    offset = range.start;
  }

  @Override
  public boolean next() {
    try {
      return advance();
    } catch (RuntimeException e) {
      failed = true;
      throw e;
    }
  }

  private boolean advance() {
    while (true) {
      if (reply != null && nextBatch < reply.batches()) {
        int batch = nextBatch++;
        long base = reply.baseOffset(batch);
        long first = Math.max(askedFrom, base);
        long stop = Math.min(range.end, base + reply.recordCount(batch));
        if (stop > first) {
          current = build(batch, (int) (first - base), (int) (stop - first), first);
          return true;
        }
        continue;
      }
      if (reply != null) {
        offset = Math.min(reply.nextOffset, range.end);
        reply = null;
      }
      if (offset >= range.end) {
        return false;
      }
      FetchReply fetched;
      try {
        fetched = client.fetch(offset);
      } catch (ReplicaClient.DataLoss lost) {
        // failOnDataLoss=false: retention deleted the records from here on before they were read; go on
        // from the log's start now, as Spark's Kafka source does.
        long start = client.logStart();
        if (start <= offset) {
          throw new IllegalStateException("logbus " + topic + "-" + range.partition + ": offset " + offset
              + " is out of range, but the log starts at " + start, lost);
        }
        offset = start;
        continue;
      }
      if (fetched.nextOffset <= offset) {
        // Nothing at an offset that was below the high watermark when the read was planned: the log
        // went back (a new leader truncated it). Wait for it a few times, as a consumer would.
        if (++emptyReplies > 20) {
          throw new IllegalStateException(
              "logbus " + topic + "-" + range.partition + ": offsets up to " + range.end
                  + " were committed when the read was planned, but the high watermark is now " + fetched.highWatermark
                  + " (the log was truncated)");
        }
        TopicClient.pause(100);
        continue;
      }
      emptyReplies = 0;
      askedFrom = offset;
      reply = fetched;
      nextBatch = 0;
      long following = Math.min(fetched.nextOffset, range.end);
      if (following < range.end) {
        client.prefetch(following); // the next fetch overlaps this reply's decoding
      }
    }
  }

  private ColumnarBatch build(int batch, int from, int rows, long firstOffset) {
    if (!headersOnly) {
      decoder.load(reply, batch);
    }
    boolean logAppendTime = (reply.attributes(batch) & FetchReply.LOG_APPEND_TIME_MASK) != 0;
    ColumnVector[] vectors = new ColumnVector[columns.length];
    for (int i = 0; i < columns.length; i++) {
      vectors[i] = column(columns[i], from, rows, firstOffset, logAppendTime, reply.maxTimestampMs(batch));
    }
    return new ColumnarBatch(vectors, rows);
  }

  private ColumnVector column(String name, int from, int rows, long firstOffset, boolean logAppendTime, long maxTimestampMs) {
    switch (name) {
      case "key":
      case "value":
        return new Columns.Binary((VarBinaryVector) decoder.root.getVector(name), from, rows);
      case "timestamp":
        return new Columns.Timestamps((BigIntVector) decoder.root.getVector(name), from, logAppendTime, maxTimestampMs);
      case "headers":
        return new Columns.Headers((MapVector) decoder.root.getVector(name), from);
      case "offset":
        return new Columns.Offsets(firstOffset);
      case "topic": {
        ConstantColumnVector vector = new ConstantColumnVector(rows, DataTypes.StringType);
        vector.setUtf8String(topic);
        return vector;
      }
      case "partition": {
        ConstantColumnVector vector = new ConstantColumnVector(rows, DataTypes.IntegerType);
        vector.setInt(range.partition);
        return vector;
      }
      case "timestampType": {
        ConstantColumnVector vector = new ConstantColumnVector(rows, DataTypes.IntegerType);
        vector.setInt(logAppendTime ? 1 : 0); // Kafka's codes, as Spark's Kafka source gives them
        return vector;
      }
      default:
        throw new IllegalArgumentException("logbus has no column " + name);
    }
  }

  @Override
  public ColumnarBatch get() {
    return current;
  }

  @Override
  public void close() {
    if (decoder != null) {
      decoder.close();
    }
    try {
      allocator.close();
    } catch (IllegalStateException leaked) {
      if (!failed) {
        throw leaked;
      }
      // A batch that failed to load may hold buffers it decompressed: the task's own error is the one to see.
    }
  }

}
