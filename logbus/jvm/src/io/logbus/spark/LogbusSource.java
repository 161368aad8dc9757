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
 * <p>A batch read is planned in Python by {@code logbus.spark.read} (the option {@code logbus.plan},
 * see {@link ReadPlan}) or here from the options of {@link SourceOptions}; a streaming query
 * ({@code spark.readStream.format("logbus")}) is planned here trigger by trigger ({@link LogbusStream}).
 * Either way the executors fetch each partition's batches from its leader replica with Ray
 * cross-language calls and hand Spark columnar batches made from the batches' own Arrow buffers.
 */
public final class LogbusSource implements TableProvider, DataSourceRegister {
  @Override
  public String shortName() {
    return "logbus";
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    if (!options.containsKey(ReadPlan.OPTION) && !options.containsKey("subscribe") && options.containsKey("topic")) {
      return KafkaSchema.of(false); // a write (option "topic"): the table takes any schema
    }
    return KafkaSchema.of(ReadPlan.includeHeaders(options));
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
