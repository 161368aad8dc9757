package io.logbus.spark;

import java.util.Map;

import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * {@code spark.read.format("logbus")}: a topic's records with the schema of Spark's Kafka source.
 *
 * <p>Python's {@code logbus.spark.read} resolves the offsets and the partitions' replicas and passes
 * them as the option {@code logbus.plan} (JSON, see {@link ReadPlan}); the executors then fetch each
 * partition's batches from its leader replica with Ray cross-language calls and hand Spark columnar
 * batches made from the batches' own Arrow buffers.
 */
public final class LogbusSource implements TableProvider, DataSourceRegister {
  @Override
  public String shortName() {
    return "logbus";
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return KafkaSchema.of(ReadPlan.parse(options).includeHeaders);
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning, Map<String, String> properties) {
    return new LogbusTable(schema);
  }

  @Override
  public boolean supportsExternalMetadata() {
    return false;
  }
}
