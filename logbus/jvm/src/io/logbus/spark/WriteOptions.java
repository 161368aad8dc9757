package io.logbus.spark;

import java.io.Serializable;
import java.util.Locale;

import org.apache.spark.sql.types.ArrayType;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * A write's options and the columns it takes, as Spark's Kafka sink names them: {@code value} (string or
 * binary, required), {@code key} (string or binary), {@code headers} (array&lt;struct&lt;key string, value
 * binary&gt;&gt;), {@code partition} (int); other columns are ignored. Options: {@code topic} (required),
 * {@code logbus.namespace}, {@code acks} ("all", the default, or 1).
 */
final class WriteOptions implements Serializable {
  private static final long serialVersionUID = 1L;

  final String topic;
  final String namespace;
  final int acks;
  final long timeoutMs = SourceOptions.TIMEOUT_MS;
  final int keyIndex;
  final int valueIndex;
  final int headersIndex;
  final int partitionIndex;
  final DataType[] types;

  WriteOptions(CaseInsensitiveStringMap options, StructType schema) {
    topic = options.get("topic");
    if (topic == null || topic.isEmpty()) {
      throw new IllegalArgumentException("writing to format(\"logbus\") needs option(\"topic\", name)");
    }
    namespace = options.getOrDefault("logbus.namespace", SourceOptions.DEFAULT_NAMESPACE);
    String level = options.getOrDefault("acks", "all").trim().toLowerCase(Locale.ROOT);
    if (!level.equals("all") && !level.equals("-1") && !level.equals("1")) {
      throw new IllegalArgumentException("acks must be all (or -1) or 1, not " + level);
    }
    acks = level.equals("1") ? 1 : -1;
    types = new DataType[schema.fields().length];
    for (int i = 0; i < types.length; i++) {
      types[i] = schema.fields()[i].dataType();
    }
    keyIndex = column(schema, "key", false);
    valueIndex = column(schema, "value", true);
    headersIndex = column(schema, "headers", false);
    partitionIndex = column(schema, "partition", false);
  }

  private int column(StructType schema, String name, boolean required) {
    int index = -1;
    for (int i = 0; i < schema.fields().length; i++) {
      if (schema.fields()[i].name().equalsIgnoreCase(name)) {
        index = i;
      }
    }
    if (index < 0) {
      if (required) {
        throw new IllegalArgumentException("writing to logbus needs a column '" + name + "' (string or binary); the DataFrame has "
            + String.join(", ", schema.fieldNames()));
      }
      return -1;
    }
    StructField field = schema.fields()[index];
    DataType type = field.dataType();
    boolean fits;
    switch (name) {
      case "partition":
        fits = type == DataTypes.IntegerType;
        break;
      case "headers":
        fits = type instanceof ArrayType && ((ArrayType) type).elementType() instanceof StructType
            && sameHeaders((StructType) ((ArrayType) type).elementType());
        break;
      default:
        fits = type == DataTypes.StringType || type == DataTypes.BinaryType;
    }
    if (!fits) {
      throw new IllegalArgumentException("column '" + name + "' must be "
          + (name.equals("partition") ? "int" : name.equals("headers") ? "array<struct<key: string, value: binary>>" : "string or binary")
          + ", not " + type.simpleString());
    }
    return index;
  }

  private static boolean sameHeaders(StructType struct) {
    return struct.fields().length == 2 && struct.fields()[0].dataType() == DataTypes.StringType
        && struct.fields()[1].dataType() == DataTypes.BinaryType;
  }
}
