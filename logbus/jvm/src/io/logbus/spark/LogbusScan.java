package io.logbus.spark;

import java.util.ArrayList;
import java.util.List;

import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** The scan of a planned read: one input partition per topic partition, only the columns the query uses. */
final class LogbusScan implements ScanBuilder, SupportsPushDownRequiredColumns, Scan, Batch {
  private final CaseInsensitiveStringMap options;
  private StructType schema;
  private ReadPlan plan;

  LogbusScan(CaseInsensitiveStringMap options, StructType schema) {
    this.options = options;
    this.schema = schema;
  }

  private ReadPlan plan() {
    if (plan == null) {
      plan = ReadPlan.parse(options);
    }
    return plan;
  }

  @Override
  public void pruneColumns(StructType required) {
    // Spark may prune inside a struct too (headers' key or value alone); the reader hands headers
    // whole, so they keep their full type.
    StructType pruned = new StructType();
    for (StructField field : required.fields()) {
      pruned = pruned.add(field.name().equals("headers") ? KafkaSchema.of(true).apply("headers") : field);
    }
    schema = pruned;
  }

  @Override
  public Scan build() {
    return this;
  }

  @Override
  public StructType readSchema() {
    return schema;
  }

  @Override
  public String description() {
    String topic = options.containsKey(ReadPlan.OPTION) ? plan().topic : options.get("subscribe");
    return "logbus " + topic;
  }

  @Override
  public Batch toBatch() {
    return this;
  }

  @Override
  public MicroBatchStream toMicroBatchStream(String checkpointLocation) {
    for (String ending : new String[] {"endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp"}) {
      if (options.containsKey(ending)) {
        // As Spark's Kafka source: a stream has no end.
        throw new IllegalArgumentException(ending + " is not valid in streaming queries (a stream reads on as records come)");
      }
    }
    for (String name : new String[] {"minOffsetsPerTrigger", "maxTriggerDelay"}) {
      if (options.containsKey(name)) {
        // A trigger that waits for more records: Spark's Kafka source has it, logbus's stream does not.
        throw new IllegalArgumentException("logbus's stream does not offer Spark's Kafka option " + name
            + " (each trigger reads what there is, up to maxOffsetsPerTrigger)");
      }
    }
    return new LogbusStream(new SourceOptions(options, "latest"), schema, checkpointLocation);
  }

  @Override
  public InputPartition[] planInputPartitions() {
    List<InputPartition> parts = new ArrayList<>();
    for (ReadPlan.Range range : plan().partitions) {
      if (range.start < range.end) {
        parts.add(new TopicPartitionRange(range));
      }
    }
    return parts.toArray(new InputPartition[0]);
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new ReaderFactory(plan(), schema);
  }

  /** One partition's range as Spark ships it to an executor. */
  static final class TopicPartitionRange implements InputPartition {
    private static final long serialVersionUID = 1L;
    final ReadPlan.Range range;

    TopicPartitionRange(ReadPlan.Range range) {
      this.range = range;
    }
  }

  /** Columnar readers only: every batch is Arrow already. */
  static final class ReaderFactory implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;
    private final ReadPlan plan;
    private final StructType schema;

    ReaderFactory(ReadPlan plan, StructType schema) {
      this.plan = plan;
      this.schema = schema;
    }

    @Override
    public boolean supportColumnarReads(InputPartition partition) {
      return true;
    }

    @Override
    public PartitionReader<InternalRow> createReader(InputPartition partition) {
      throw new UnsupportedOperationException("logbus reads columnar batches only");
    }

    @Override
    public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
      return new RangeReader(plan, ((TopicPartitionRange) partition).range, schema);
    }
  }
}
