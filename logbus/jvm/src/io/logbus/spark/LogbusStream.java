package io.logbus.spark;

import java.io.IOException;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.connector.read.streaming.Offset;
import org.apache.spark.sql.connector.read.streaming.ReadLimit;
import org.apache.spark.sql.connector.read.streaming.ReadMaxRows;
import org.apache.spark.sql.connector.read.streaming.SupportsTriggerAvailableNow;
import org.apache.spark.sql.types.StructType;

/**
 * {@code spark.readStream.format("logbus")}: a topic as a micro-batch stream. Spark's checkpoint holds
 * each batch's offsets ({@link LogbusOffset}); a restarted query reads a batch it planned again from
 * exactly those offsets, so it neither loses nor repeats one. Each trigger asks the controller for
 * the partitions (a partition added later is read from its start) and their leaders for their ends;
 * {@code maxOffsetsPerTrigger} shares a trigger's offsets among the partitions by how far behind each is.
 */
final class LogbusStream implements MicroBatchStream, SupportsTriggerAvailableNow {
  private final SourceOptions options;
  private final StructType schema;
  private final String checkpointLocation;
  private final TopicClient client;
  private List<String[]> partitions;
  private Map<Integer, TopicClient.Offsets> offsets = new HashMap<>();
  private Map<Integer, Long> availableNow; // Trigger.AvailableNow: the ends when the query started
  private LogbusOffset initial; // Spark asks for it more than once before the first batch is in its checkpoint

  LogbusStream(SourceOptions options, StructType schema, String checkpointLocation) {
    this.options = options;
    this.schema = schema;
    this.checkpointLocation = checkpointLocation;
    this.client = options.client();
  }

  private void refresh() {
    partitions = client.partitions();
    List<TopicClient.Offsets> found = client.offsets(partitions);
    Map<Integer, TopicClient.Offsets> byPartition = new HashMap<>();
    for (int p = 0; p < found.size(); p++) {
      byPartition.put(p, found.get(p));
    }
    offsets = byPartition;
  }

  @Override
  public Offset initialOffset() {
    if (initial == null) {
      initial = firstOffset();
    }
    return initial;
  }

  private LogbusOffset firstOffset() {
    // Kept in the checkpoint: a query restarted before its first batch starts where it first would have.
    Path kept = initialOffsetsFile();
    if (kept != null && Files.exists(kept)) {
      try {
        return LogbusOffset.fromJson(new String(Files.readAllBytes(kept), StandardCharsets.UTF_8));
      } catch (IOException e) {
        throw new IllegalStateException("cannot read " + kept, e);
      }
    }
    refresh();
    List<TopicClient.Offsets> known = new ArrayList<>();
    for (int p = 0; p < partitions.size(); p++) {
      known.add(offsets.get(p));
    }
    long[] starts = ReadPlan.startOffsets(options, client, partitions, known, false);
    Map<Integer, Long> start = new TreeMap<>();
    for (int p = 0; p < partitions.size(); p++) {
      long offset = starts[p];
      if (offset < offsets.get(p).logStart && options.failOnDataLoss) {
        throw new IllegalStateException(options.topic + "-" + p + ": startingOffsets names offset " + offset
            + ", below the log's start " + offsets.get(p).logStart + "; set failOnDataLoss to false to start there");
      }
      start.put(p, Math.max(offset, offsets.get(p).logStart));
    }
    LogbusOffset initial = new LogbusOffset(options.topic, start);
    if (kept != null) {
      try {
        Files.createDirectories(kept.getParent());
        Path partial = kept.resolveSibling(kept.getFileName() + ".partial");
        Files.write(partial, initial.json().getBytes(StandardCharsets.UTF_8));
        Files.move(partial, kept, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
      } catch (IOException e) {
        throw new IllegalStateException("cannot write " + kept, e);
      }
    }
    return initial;
  }

  /** Where the initial offsets are kept: a file of the checkpoint, when the checkpoint is a local path. */
  private Path initialOffsetsFile() {
    if (checkpointLocation == null || checkpointLocation.isEmpty()) {
      return null;
    }
    URI uri = URI.create(checkpointLocation.replace(" ", "%20"));
    if (uri.getScheme() != null && !uri.getScheme().equals("file")) {
      return null;
    }
    Path root = uri.getScheme() == null ? Paths.get(checkpointLocation) : Paths.get(uri);
    return root.resolve("logbus-initial-offsets.json");
  }

  @Override
  public ReadLimit getDefaultReadLimit() {
    return options.maxOffsetsPerTrigger > 0 ? ReadLimit.maxRows(options.maxOffsetsPerTrigger) : ReadLimit.allAvailable();
  }

  @Override
  public void prepareForTriggerAvailableNow() {
    refresh();
    availableNow = new HashMap<>();
    for (Map.Entry<Integer, TopicClient.Offsets> entry : offsets.entrySet()) {
      availableNow.put(entry.getKey(), entry.getValue().end);
    }
  }

  @Override
  public Offset latestOffset() {
    throw new UnsupportedOperationException("latestOffset(Offset, ReadLimit) is used");
  }

  /** The partitions' ends as the last trigger found them, for the query's progress ("latestOffset"). */
  @Override
  public Offset reportLatestOffset() {
    if (partitions == null) {
      return null;
    }
    Map<Integer, Long> ends = new TreeMap<>();
    for (Map.Entry<Integer, TopicClient.Offsets> entry : offsets.entrySet()) {
      ends.put(entry.getKey(), entry.getValue().end);
    }
    return new LogbusOffset(options.topic, ends);
  }

  @Override
  public Offset latestOffset(Offset startOffset, ReadLimit limit) {
    sameTopic(startOffset);
    refresh();
    Map<Integer, Long> start = ((LogbusOffset) startOffset).offsets;
    Map<Integer, Long> end = new TreeMap<>();
    long[] from = new long[partitions.size()];
    long[] to = new long[partitions.size()];
    long lag = 0;
    for (int p = 0; p < partitions.size(); p++) {
      TopicClient.Offsets at = offsets.get(p);
      from[p] = Math.max(start.getOrDefault(p, at.logStart), at.logStart);
      long until = availableNow == null ? at.end : Math.min(at.end, availableNow.getOrDefault(p, at.logStart));
      to[p] = Math.max(from[p], until);
      lag += to[p] - from[p];
    }
    long budget = limit instanceof ReadMaxRows ? ((ReadMaxRows) limit).maxRows() : Long.MAX_VALUE;
    if (lag > budget) {
      // Each partition's share of the budget by its lag (as Spark's Kafka source shares it); what the
      // rounding down leaves goes to the partitions in order.
      long given = 0;
      for (int p = 0; p < partitions.size(); p++) {
        long share = (long) Math.floor((double) budget * (to[p] - from[p]) / lag);
        to[p] = from[p] + share;
        given += share;
      }
      for (int p = 0; p < partitions.size() && given < budget; p++) {
        long until = availableNow == null ? offsets.get(p).end : Math.min(offsets.get(p).end, availableNow.getOrDefault(p, 0L));
        long more = Math.min(budget - given, Math.max(0, until - to[p]));
        to[p] += more;
        given += more;
      }
    }
    for (int p = 0; p < partitions.size(); p++) {
      // A partition whose start lies past its end now (its log was truncated) keeps its start.
      end.put(p, Math.max(to[p], start.getOrDefault(p, from[p])));
    }
    return new LogbusOffset(options.topic, end);
  }

  @Override
  public InputPartition[] planInputPartitions(Offset startOffset, Offset endOffset) {
    sameTopic(startOffset);
    Map<Integer, Long> start = ((LogbusOffset) startOffset).offsets;
    Map<Integer, Long> end = ((LogbusOffset) endOffset).offsets;
    if (partitions == null || partitions.size() < end.size()) {
      refresh(); // a batch planned before a restart: its offsets are in the checkpoint, the replicas are not
    }
    // A new leader's high watermark may lag its predecessor's a moment: wait for it to reach what the
    // batch was planned with before calling the log truncated.
    long deadline = System.currentTimeMillis() + SourceOptions.TIMEOUT_MS;
    while (behind(start, end) && System.currentTimeMillis() < deadline) {
      TopicClient.pause(200);
      refresh();
    }
    List<InputPartition> parts = new ArrayList<>();
    for (Map.Entry<Integer, Long> entry : end.entrySet()) {
      int p = entry.getKey();
      TopicClient.Offsets at = offsets.get(p);
      if (at == null) {
        throw new IllegalStateException(options.topic + " has no partition " + p + " now (was the topic deleted and made again?)");
      }
      long from = start.getOrDefault(p, at.logStart);
      long to = entry.getValue();
      if (from >= to) {
        continue;
      }
      if (from < at.logStart) {
        if (options.failOnDataLoss) {
          throw new IllegalStateException(options.topic + "-" + p + ": offsets [" + from + ", " + Math.min(to, at.logStart)
              + ") were deleted before this query read them (the log now starts at " + at.logStart
              + "); set failOnDataLoss to false to go on from there");
        }
        from = at.logStart;
      }
      if (to > at.end) {
        if (options.failOnDataLoss) {
          throw new IllegalStateException(options.topic + "-" + p + ": this batch was planned up to offset " + to
              + ", but the partition now ends at " + at.end + " (its log was truncated); set failOnDataLoss to false to go on");
        }
        to = at.end;
      }
      if (from < to) {
        parts.add(new LogbusScan.TopicPartitionRange(new ReadPlan.Range(p, from, to, partitions.get(p))));
      }
    }
    return parts.toArray(new InputPartition[0]);
  }

  private void sameTopic(Offset offset) {
    String checkpointed = ((LogbusOffset) offset).topic;
    if (!checkpointed.equals(options.topic)) {
      throw new IllegalStateException("this query's checkpoint holds offsets of topic " + checkpointed + ", not of "
          + options.topic + ": a query that subscribes to another topic needs a checkpoint of its own");
    }
  }

  /** Whether a partition with records to read in this batch ends, for now, below the batch's end. */
  private boolean behind(Map<Integer, Long> start, Map<Integer, Long> end) {
    for (Map.Entry<Integer, Long> entry : end.entrySet()) {
      TopicClient.Offsets at = offsets.get(entry.getKey());
      if (at != null && start.getOrDefault(entry.getKey(), at.logStart) < entry.getValue() && entry.getValue() > at.end) {
        return true;
      }
    }
    return false;
  }


  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new LogbusScan.ReaderFactory(new ReadPlan(options, new ArrayList<>()), schema);
  }

  @Override
  public Offset deserializeOffset(String json) {
    return LogbusOffset.fromJson(json);
  }

  @Override
  public void commit(Offset end) {}

  @Override
  public void stop() {}
}
