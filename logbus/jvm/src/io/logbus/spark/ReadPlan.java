package io.logbus.spark;

import java.io.IOException;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.List;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * What Python's {@code logbus.spark.read} resolved: the option {@code logbus.plan}, JSON of the form
 *
 * <pre>
 * {"topic": "events", "namespace": "logbus", "isolation": 0, "includeHeaders": false,
 *  "fetchMaxBytes": 8388608, "timeoutMs": 30000,
 *  "partitions": [{"partition": 0, "start": 0, "end": 1000, "replicas": ["actor name", ...]}, ...]}
 * </pre>
 *
 * where {@code replicas} names the partition's replica actors, its leader first.
 */
final class ReadPlan implements Serializable {
  private static final long serialVersionUID = 1L;
  static final String OPTION = "logbus.plan";

  final String topic;
  final String namespace;
  final int isolation;
  final boolean includeHeaders;
  final int fetchMaxBytes;
  final long timeoutMs;
  final List<Range> partitions;

  /** One partition's offsets {@code [start, end)} and where to fetch them. */
  static final class Range implements Serializable {
    private static final long serialVersionUID = 1L;
    final int partition;
    final long start;
    final long end;
    final String[] replicas;

    Range(int partition, long start, long end, String[] replicas) {
      this.partition = partition;
      this.start = start;
      this.end = end;
      this.replicas = replicas;
    }
  }

  private ReadPlan(JsonNode root) {
    topic = text(root, "topic");
    namespace = text(root, "namespace");
    isolation = root.path("isolation").asInt(0);
    includeHeaders = root.path("includeHeaders").asBoolean(false);
    fetchMaxBytes = root.path("fetchMaxBytes").asInt(8 << 20);
    timeoutMs = root.path("timeoutMs").asLong(30_000L);
    partitions = new ArrayList<>();
    for (JsonNode node : root.path("partitions")) {
      List<String> names = new ArrayList<>();
      for (JsonNode name : node.path("replicas")) {
        names.add(name.asText());
      }
      if (names.isEmpty()) {
        throw new IllegalArgumentException("logbus.plan: partition " + node.path("partition") + " names no replica");
      }
      partitions.add(
          new Range(node.path("partition").asInt(), node.path("start").asLong(), node.path("end").asLong(),
              names.toArray(new String[0])));
    }
  }

  private static String text(JsonNode root, String field) {
    JsonNode node = root.get(field);
    if (node == null || !node.isTextual()) {
      throw new IllegalArgumentException("logbus.plan: '" + field + "' is missing");
    }
    return node.asText();
  }

  static ReadPlan parse(CaseInsensitiveStringMap options) {
    String json = options.get(OPTION);
    if (json == null) {
      throw new IllegalArgumentException(
          "format(\"logbus\") reads what logbus.spark.read planned: call logbus.spark.read(spark, topic, ...) in Python");
    }
    try {
      return new ReadPlan(new ObjectMapper().readTree(json));
    } catch (IOException e) {
      throw new IllegalArgumentException("logbus.plan is not valid JSON: " + e.getMessage(), e);
    }
  }
}
