package io.logbus.spark;

import java.io.Serializable;
import java.util.Locale;

import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * The options of {@code format("logbus")}, named after Spark's Kafka source where it has one:
 * {@code subscribe} (one topic), {@code startingOffsets} and {@code endingOffsets} ("earliest",
 * "latest" or Kafka's JSON, {@code {"topic": {"0": 23, "1": -2}}}), {@code startingTimestamp},
 * {@code startingOffsetsByTimestamp} (Kafka's JSON of timestamps), {@code startingOffsetsByTimestampStrategy},
 * {@code endingTimestamp}, {@code endingOffsetsByTimestamp} (batch reads), {@code maxOffsetsPerTrigger},
 * {@code failOnDataLoss}, {@code includeHeaders}, {@code kafka.isolation.level}; and logbus's own
 * {@code logbus.namespace} (the Ray namespace logbus runs in, "logbus" by default).
 */
final class SourceOptions implements Serializable {
  private static final long serialVersionUID = 1L;
  static final String DEFAULT_NAMESPACE = "logbus";
  static final long TIMEOUT_MS = 30_000L;
  static final int FETCH_MAX_BYTES = 8 << 20;

  final String topic;
  final String namespace;
  final String startingOffsets;
  final String endingOffsets;
  final Long startingTimestamp; // null when not set; takes precedence over startingOffsetsByTimestamp, as in Spark
  final String startingOffsetsByTimestamp; // Kafka's JSON of timestamps, every partition named
  final boolean startLatestWhenNoTimestampMatch; // startingOffsetsByTimestampStrategy "latest" (else "error")
  final Long endingTimestamp;
  final String endingOffsetsByTimestamp;
  final long maxOffsetsPerTrigger; // 0: no limit
  final boolean failOnDataLoss;
  final boolean includeHeaders;
  final int isolation;

  /**
   * Options of Spark's Kafka source that would change what is read and that logbus does not offer: refused
   * by name rather than ignored (a query would otherwise read other records than its author asked for).
   */
  static final String[] NOT_OFFERED = {"assign", "subscribePattern"};

  SourceOptions(CaseInsensitiveStringMap options, String defaultStart) {
    for (String name : NOT_OFFERED) {
      if (options.containsKey(name)) {
        throw new IllegalArgumentException("format(\"logbus\") does not offer Spark's Kafka option " + name
            + " (it reads the one topic named by subscribe)");
      }
    }
    topic = options.get("subscribe");
    if (topic == null || topic.isEmpty()) {
      throw new IllegalArgumentException(
          "format(\"logbus\") needs option(\"subscribe\", topic) (or use logbus.spark.read / read_stream in Python)");
    }
    if (topic.contains(",")) {
      throw new IllegalArgumentException("subscribe names one logbus topic, not several: " + topic);
    }
    namespace = options.getOrDefault("logbus.namespace", DEFAULT_NAMESPACE);
    startingOffsets = options.getOrDefault("startingOffsets", defaultStart).trim();
    endingOffsets = options.getOrDefault("endingOffsets", "latest").trim();
    startingTimestamp = timestamp(options, "startingTimestamp");
    startingOffsetsByTimestamp = options.get("startingOffsetsByTimestamp");
    endingTimestamp = timestamp(options, "endingTimestamp");
    endingOffsetsByTimestamp = options.get("endingOffsetsByTimestamp");
    String strategy = options.getOrDefault("startingOffsetsByTimestampStrategy", "error").trim().toLowerCase(Locale.ROOT);
    if (!strategy.equals("error") && !strategy.equals("latest")) {
      throw new IllegalArgumentException("startingOffsetsByTimestampStrategy must be error or latest, not " + strategy);
    }
    startLatestWhenNoTimestampMatch = strategy.equals("latest");
    String max = options.get("maxOffsetsPerTrigger");
    try {
      maxOffsetsPerTrigger = max == null ? 0 : Long.parseLong(max.trim());
    } catch (NumberFormatException e) {
      throw new IllegalArgumentException("maxOffsetsPerTrigger must be a positive number, not " + max, e);
    }
    if (max != null && maxOffsetsPerTrigger <= 0) {
      throw new IllegalArgumentException("maxOffsetsPerTrigger must be a positive number, not " + max);
    }
    failOnDataLoss = flag(options, "failOnDataLoss", true);
    includeHeaders = flag(options, "includeHeaders", false);
    String level = options.getOrDefault("kafka.isolation.level", "read_uncommitted").trim().toLowerCase(Locale.ROOT);
    if (!level.equals("read_uncommitted") && !level.equals("read_committed")) {
      throw new IllegalArgumentException("kafka.isolation.level must be read_uncommitted or read_committed, not " + level);
    }
    isolation = level.equals("read_committed") ? 1 : 0;
  }

  /** A timestamp option (milliseconds since the epoch, at least 0), or null when it is not set. */
  static Long timestamp(CaseInsensitiveStringMap options, String name) {
    String value = options.get(name);
    if (value == null) {
      return null;
    }
    try {
      long timestamp = Long.parseLong(value.trim());
      if (timestamp >= 0) {
        return timestamp;
      }
    } catch (NumberFormatException e) {
      // refused below
    }
    throw new IllegalArgumentException(name + " must be a timestamp in milliseconds since the epoch (at least 0), not " + value);
  }

  static boolean flag(CaseInsensitiveStringMap options, String name, boolean fallback) {
    String value = options.get(name);
    if (value == null) {
      return fallback;
    }
    switch (value.trim().toLowerCase(Locale.ROOT)) {
      case "true":
        return true;
      case "false":
        return false;
      default:
        throw new IllegalArgumentException(name + " must be true or false, not " + value);
    }
  }

  TopicClient client() {
    return new TopicClient(topic, namespace, isolation, TIMEOUT_MS);
  }
}
