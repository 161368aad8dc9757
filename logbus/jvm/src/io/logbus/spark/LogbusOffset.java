package io.logbus.spark;

import java.io.IOException;
import java.util.Iterator;
import java.util.Map;
import java.util.TreeMap;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import org.apache.spark.sql.connector.read.streaming.Offset;

/**
 * A streaming query's position: the next offset of each partition, written to Spark's checkpoint as
 * the Kafka source writes its own ({@code {"topic": {"0": 23, "1": 7}}}).
 */
final class LogbusOffset extends Offset {
  final String topic;
  final TreeMap<Integer, Long> offsets;

  LogbusOffset(String topic, Map<Integer, Long> offsets) {
    this.topic = topic;
    this.offsets = new TreeMap<>(offsets);
  }

  @Override
  public String json() {
    ObjectMapper mapper = new ObjectMapper();
    ObjectNode root = mapper.createObjectNode();
    ObjectNode partitions = root.putObject(topic);
    for (Map.Entry<Integer, Long> entry : offsets.entrySet()) {
      partitions.put(String.valueOf(entry.getKey()), entry.getValue());
    }
    return root.toString();
  }

  /** Parse Kafka's JSON spelling of offsets for {@code topic}; -2 and -1 (earliest, latest) stay as they are. */
  static Map<Integer, Long> parse(String json, String topic, String what) {
    return parse(json, topic, what, -2);
  }

  /** Parse Kafka's JSON of a number per partition of {@code topic} (offsets, or timestamps), each at least {@code min}. */
  static Map<Integer, Long> parse(String json, String topic, String what, long min) {
    JsonNode root;
    try {
      root = new ObjectMapper().readTree(json);
    } catch (IOException e) {
      throw new IllegalArgumentException(what + " is not JSON: " + json, e);
    }
    JsonNode partitions = root == null ? null : root.get(topic);
    if (partitions == null || !partitions.isObject()) {
      throw new IllegalArgumentException(what + " names no partitions of topic " + topic + ": " + json);
    }
    Map<Integer, Long> offsets = new TreeMap<>();
    Iterator<Map.Entry<String, JsonNode>> fields = partitions.fields();
    while (fields.hasNext()) {
      Map.Entry<String, JsonNode> field = fields.next();
      int partition;
      try {
        partition = Integer.parseInt(field.getKey());
      } catch (NumberFormatException e) {
        throw new IllegalArgumentException(what + ": '" + field.getKey() + "' is no partition number", e);
      }
      if (!field.getValue().canConvertToLong() || field.getValue().asLong() < min) {
        throw new IllegalArgumentException(what + ": partition " + partition + " must have a number of at least " + min
            + (min == -2 ? " (an offset, -2 for earliest or -1 for latest)" : " (a timestamp in milliseconds)") + ", not "
            + field.getValue());
      }
      offsets.put(partition, field.getValue().asLong());
    }
    return offsets;
  }

  static LogbusOffset fromJson(String json) {
    JsonNode root;
    try {
      root = new ObjectMapper().readTree(json);
    } catch (IOException e) {
      throw new IllegalStateException("a checkpointed logbus offset is not JSON: " + json, e);
    }
    if (root == null || !root.fieldNames().hasNext()) {
      throw new IllegalStateException("a checkpointed logbus offset names no topic: " + json);
    }
    String topic = root.fieldNames().next();
    return new LogbusOffset(topic, parse(json, topic, "the checkpointed offset"));
  }
}
