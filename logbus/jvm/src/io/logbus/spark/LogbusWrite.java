package io.logbus.spark;

import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.write.BatchWrite;
import org.apache.spark.sql.connector.write.DataWriter;
import org.apache.spark.sql.connector.write.DataWriterFactory;
import org.apache.spark.sql.connector.write.LogicalWriteInfo;
import org.apache.spark.sql.connector.write.PhysicalWriteInfo;
import org.apache.spark.sql.connector.write.Write;
import org.apache.spark.sql.connector.write.WriteBuilder;
import org.apache.spark.sql.connector.write.WriterCommitMessage;
import org.apache.spark.sql.connector.write.streaming.StreamingDataWriterFactory;
import org.apache.spark.sql.connector.write.streaming.StreamingWrite;

/**
 * {@code df.write.format("logbus")} and {@code df.writeStream.format("logbus")}: each task writes its rows
 * with a {@link TopicWriter}. Nothing to do at a job's or an epoch's commit: every batch a task sent is
 * acknowledged before its task commits (at least once, as Spark's Kafka sink).
 */
public final class LogbusWrite implements WriteBuilder, Write, BatchWrite, StreamingWrite {
  // Records written by the batch writes that carried option("logbus.writeId", id), for Python's
  // logbus.spark.write to report (at most WRITTEN_KEPT of them).
  private static final int WRITTEN_KEPT = 1000;
  private static final Map<String, Long> WRITTEN = Collections.synchronizedMap(new LinkedHashMap<String, Long>() {
    @Override
    protected boolean removeEldestEntry(Map.Entry<String, Long> eldest) {
      return size() > WRITTEN_KEPT;
    }
  });

  private final WriteOptions options;
  private final String writeId;

  LogbusWrite(LogicalWriteInfo info) {
    options = new WriteOptions(info.options(), info.schema());
    writeId = info.options().get("logbus.writeId");
  }

  /** Records written by the batch write of option("logbus.writeId", id), or -1 if none committed. */
  public static long written(String writeId) {
    Long records = WRITTEN.remove(writeId);
    return records == null ? -1 : records;
  }

  @Override
  public Write build() {
    return this;
  }

  @Override
  public BatchWrite toBatch() {
    return this;
  }

  @Override
  public StreamingWrite toStreaming() {
    return this;
  }

  @Override
  public String description() {
    return "logbus " + options.topic;
  }

  @Override
  public DataWriterFactory createBatchWriterFactory(PhysicalWriteInfo info) {
    return new Factory(options, TopicWriter.Layout.of(options)); // asked once for the job's tasks
  }

  @Override
  public StreamingDataWriterFactory createStreamingWriterFactory(PhysicalWriteInfo info) {
    return new Factory(options, null); // each epoch's tasks ask: leaders move while a query runs
  }

  @Override
  public boolean useCommitCoordinator() {
    return false; // tasks' writes are appends: two attempts of one task may both commit (at least once)
  }

  @Override
  public void commit(WriterCommitMessage[] messages) {
    if (writeId != null) {
      long records = 0;
      for (WriterCommitMessage message : messages) {
        records += message instanceof TopicWriter.Written ? ((TopicWriter.Written) message).records : 0;
      }
      WRITTEN.put(writeId, records);
    }
  }

  @Override
  public void abort(WriterCommitMessage[] messages) {}

  @Override
  public void commit(long epochId, WriterCommitMessage[] messages) {}

  @Override
  public void abort(long epochId, WriterCommitMessage[] messages) {}

  /** Shipped to the executors: a writer per task. */
  static final class Factory implements DataWriterFactory, StreamingDataWriterFactory {
    private static final long serialVersionUID = 1L;
    private final WriteOptions options;
    private final TopicWriter.Layout layout;

    Factory(WriteOptions options, TopicWriter.Layout layout) {
      this.options = options;
      this.layout = layout;
    }

    @Override
    public DataWriter<InternalRow> createWriter(int partitionId, long taskId) {
      return new TopicWriter(options, layout);
    }

    @Override
    public DataWriter<InternalRow> createWriter(int partitionId, long taskId, long epochId) {
      return new TopicWriter(options, layout);
    }
  }
}
