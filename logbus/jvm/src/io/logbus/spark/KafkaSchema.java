package io.logbus.spark;

import org.apache.spark.sql.types.ArrayType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;

/** The schema of Spark's Kafka source, which a logbus read keeps. */
final class KafkaSchema {
  static final StructType HEADER =
      new StructType().add("key", DataTypes.StringType).add("value", DataTypes.BinaryType);

  private KafkaSchema() {}

  static StructType of(boolean includeHeaders) {
    StructType schema =
        new StructType()
            .add("key", DataTypes.BinaryType)
            .add("value", DataTypes.BinaryType)
            .add("topic", DataTypes.StringType)
            .add("partition", DataTypes.IntegerType)
            .add("offset", DataTypes.LongType)
            .add("timestamp", DataTypes.TimestampType)
            .add("timestampType", DataTypes.IntegerType);
    return includeHeaders ? schema.add("headers", new ArrayType(HEADER, true)) : schema;
  }
}
