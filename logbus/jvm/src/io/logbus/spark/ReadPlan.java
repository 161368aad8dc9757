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
 * where {@code replicas} names the partition's replica actors, its leader first. A query that names its
 * topic instead ({@code option("subscribe", topic)}, see {@link SourceOptions}) is planned here in the
 * driver: {@link #plan}.
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
  final boolean failOnDataLoss;
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
    failOnDataLoss = true;
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

  ReadPlan(SourceOptions options, List<Range> partitions) {
    topic = options.topic;
    namespace = options.namespace;
    isolation = options.isolation;
    includeHeaders = options.includeHeaders;
    fetchMaxBytes = SourceOptions.FETCH_MAX_BYTES;
    timeoutMs = SourceOptions.TIMEOUT_MS;
    failOnDataLoss = options.failOnDataLoss;
    this.partitions = partitions;
  }

  /**
   * Each partition's offset for a spec of {@code startingOffsets} or {@code endingOffsets}: "earliest"
   * (-2), "latest" (-1) or Kafka's JSON, where partitions not named take {@code fallback}.
   */
  static long[] specs(String spec, String topic, String what, int partitions, long fallback) {
    long[] offsets = new long[partitions];
    String lower = spec.toLowerCase(java.util.Locale.ROOT);
    java.util.Arrays.fill(offsets, lower.equals("earliest") ? -2 : lower.equals("latest") ? -1 : fallback);
    if (lower.equals("earliest") || lower.equals("latest")) {
      return offsets;
    }
    for (java.util.Map.Entry<Integer, Long> entry : LogbusOffset.parse(spec, topic, what).entrySet()) {
      if (entry.getKey() < 0 || entry.getKey() >= partitions) {
        throw new IllegalArgumentException(what + " names partition " + entry.getKey() + " of " + topic + ", which has " + partitions);
      }
      offsets[entry.getKey()] = entry.getValue();
    }
    return offsets;
  }

  /** A spec (-2 earliest, -1 latest, or an offset) as an offset of a partition with these offsets. */
  static long resolve(long spec, TopicClient.Offsets offsets) {
    return spec == -2 ? offsets.logStart : spec == -1 ? offsets.end : spec;
  }

  /**
   * Each partition's timestamp from {@code global} (one for every partition) or else {@code byPartition}
   * (Kafka's JSON, {@code {"topic": {"0": 1700000000000}}}, every partition named, as Spark's Kafka source
   * asks), or null when neither is set.
   */
  static long[] timestamps(Long global, String byPartition, String topic, String what, int partitions) {
    long[] timestamps = new long[partitions];
    if (global != null) {
      java.util.Arrays.fill(timestamps, global);
      return timestamps;
    }
    if (byPartition == null) {
      return null;
    }
    java.util.Map<Integer, Long> given = LogbusOffset.parse(byPartition, topic, what, 0);
    for (java.util.Map.Entry<Integer, Long> entry : given.entrySet()) {
      if (entry.getKey() < 0 || entry.getKey() >= partitions) {
        throw new IllegalArgumentException(what + " names partition " + entry.getKey() + " of " + topic + ", which has " + partitions);
      }
      timestamps[entry.getKey()] = entry.getValue();
    }
    if (given.size() != partitions) {
      throw new IllegalArgumentException(what + " must name every partition of " + topic + " (it has " + partitions + "), as in Spark's Kafka source");
    }
    return timestamps;
  }

  /**
   * Each partition's first offset to read: by {@code startingTimestamp} or {@code startingOffsetsByTimestamp}
   * when one is set (the first record at or after it; a partition with none fails, or starts at its end with
   * {@code startingOffsetsByTimestampStrategy} latest), else by {@code startingOffsets}, whose partitions not
   * named start at the earliest offset in a batch read and at the latest in a stream.
   */
  static long[] startOffsets(SourceOptions options, TopicClient client, List<String[]> names, List<TopicClient.Offsets> offsets, boolean batch) {
    int count = names.size();
    String what = options.startingTimestamp != null ? "startingTimestamp" : "startingOffsetsByTimestamp";
    long[] times = timestamps(options.startingTimestamp, options.startingOffsetsByTimestamp, options.topic, what, count);
    long[] starts = new long[count];
    if (times == null) {
      long[] specs = specs(options.startingOffsets, options.topic, "startingOffsets", count, batch ? -2 : -1);
      for (int p = 0; p < count; p++) {
        if (batch && specs[p] == -1) {
          throw new IllegalArgumentException("a batch read's startingOffsets cannot be latest (as in Spark's Kafka source)");
        }
        starts[p] = resolve(specs[p], offsets.get(p));
      }
      return starts;
    }
    long[] found = client.offsetsForTimestamps(names, times);
    for (int p = 0; p < count; p++) {
      if (found[p] >= 0) {
        // At least the log start: a tiered topic's tier may answer below it just after delete_records. A
        // batch read ends at the end it planned with (asked first: a match past it leaves nothing to read);
        // a stream starts at the match, past the end it knows if records came meanwhile, which the next
        // trigger sees.
        long start = Math.max(found[p], offsets.get(p).logStart);
        starts[p] = batch ? Math.min(start, offsets.get(p).end) : start;
      } else if (options.startLatestWhenNoTimestampMatch) {
        starts[p] = offsets.get(p).end;
      } else {
        throw new IllegalStateException(options.topic + "-" + p + " has no record at or after timestamp " + times[p] + " (" + what
            + "); set startingOffsetsByTimestampStrategy to latest to start at the partition's end");
      }
    }
    return starts;
  }

  /**
   * Each partition's end for a batch read: by {@code endingTimestamp} or {@code endingOffsetsByTimestamp}
   * (the first record at or after it, not read; the partition's end when it has none, as in Spark's Kafka
   * source), else by {@code endingOffsets}.
   */
  static long[] endOffsets(SourceOptions options, TopicClient client, List<String[]> names, List<TopicClient.Offsets> offsets) {
    int count = names.size();
    String what = options.endingTimestamp != null ? "endingTimestamp" : "endingOffsetsByTimestamp";
    long[] times = timestamps(options.endingTimestamp, options.endingOffsetsByTimestamp, options.topic, what, count);
    long[] ends = new long[count];
    if (times == null) {
      long[] specs = specs(options.endingOffsets, options.topic, "endingOffsets", count, -1);
      for (int p = 0; p < count; p++) {
        if (specs[p] == -2) {
          throw new IllegalArgumentException("a batch read's endingOffsets cannot be earliest (as in Spark's Kafka source)");
        }
        ends[p] = resolve(specs[p], offsets.get(p));
      }
      return ends;
    }
    long[] found = client.offsetsForTimestamps(names, times);
    for (int p = 0; p < count; p++) {
      ends[p] = found[p] >= 0 ? Math.max(Math.min(found[p], offsets.get(p).end), offsets.get(p).logStart) : offsets.get(p).end;
    }
    return ends;
  }

  /** A batch read of {@code [startingOffsets, endingOffsets)} (or of their timestamp forms), planned in the driver. */
  static ReadPlan plan(SourceOptions options) {
    TopicClient client = options.client();
    List<String[]> names = client.partitions();
    List<TopicClient.Offsets> offsets = client.offsets(names);
    long[] starts = startOffsets(options, client, names, offsets, true);
    long[] ends = endOffsets(options, client, names, offsets);
    List<Range> ranges = new ArrayList<>();
    for (int p = 0; p < names.size(); p++) {
      TopicClient.Offsets at = offsets.get(p);
      long start = starts[p];
      long end = ends[p];
      if (start < at.logStart) {
        if (options.failOnDataLoss) {
          throw new IllegalStateException(options.topic + "-" + p + ": offsets from " + start + " are gone (the log starts at "
              + at.logStart + "); set failOnDataLoss to false to read from there");
        }
        start = at.logStart;
      }
      if (end > at.end || end < start) {
        throw new IllegalArgumentException(options.topic + "-" + p + ": cannot read [" + start + ", " + end + ") of offsets ["
            + at.logStart + ", " + at.end + ")");
      }
      ranges.add(new Range(p, start, end, names.get(p)));
    }
    return new ReadPlan(options, ranges);
  }

  static boolean includeHeaders(CaseInsensitiveStringMap options) {
    return options.containsKey(OPTION) ? parse(options).includeHeaders : new SourceOptions(options, "earliest").includeHeaders;
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
      return plan(new SourceOptions(options, "earliest"));
    }
    try {
      return new ReadPlan(new ObjectMapper().readTree(json));
    } catch (IOException e) {
      throw new IllegalArgumentException("logbus.plan is not valid JSON: " + e.getMessage(), e);
    }
  }
}
