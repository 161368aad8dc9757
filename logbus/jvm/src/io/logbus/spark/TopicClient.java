package io.logbus.spark;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.function.Function;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import io.ray.api.BaseActorHandle;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.function.PyActorMethod;

/**
 * What Spark's driver asks logbus when it plans a read itself (a query started with
 * {@code option("subscribe", topic)}, as every streaming query is): the topic's partitions and their
 * replicas from the controller, and each partition's offsets from its leader. Ray cross-language calls;
 * RayDP's driver is a Ray Java driver.
 */
final class TopicClient {
  static final String CONTROLLER = "logbus-controller";
  private static final PyActorMethod<byte[]> METADATA = PyActorMethod.of("jvm_topic_metadata", byte[].class);
  private static final PyActorMethod<byte[]> OFFSETS = PyActorMethod.of("jvm_offsets", byte[].class);
  private static final PyActorMethod<byte[]> OFFSET_FOR_TIMESTAMP = PyActorMethod.of("jvm_offset_for_timestamp", byte[].class);

  private final String topic;
  private final String namespace;
  private final int isolation;
  private final long timeoutMs;
  static final long ATTEMPT_MS = 10_000L; // one call's wait: a replica or controller that does not answer is asked again
  private int maxMessageBytes = 8 << 20;

  /** One partition's offsets as its leader reported them. */
  static final class Offsets {
    final long logStart;
    final long end; // the high watermark, or the last stable offset for read_committed
    final long logEnd;

    Offsets(long logStart, long end, long logEnd) {
      this.logStart = logStart;
      this.end = end;
      this.logEnd = logEnd;
    }
  }

  TopicClient(String topic, String namespace, int isolation, long timeoutMs) {
    this.topic = topic;
    this.namespace = namespace;
    this.isolation = isolation;
    this.timeoutMs = timeoutMs;
  }

  private PyActorHandle actor(String name) {
    Optional<BaseActorHandle> handle = Ray.getActor(name, namespace);
    if (!handle.isPresent()) {
      throw new IllegalStateException("no logbus actor named " + name + " in Ray namespace " + namespace
          + " (is logbus running there? the option logbus.namespace names it)");
    }
    return (PyActorHandle) handle.get();
  }

  /** Each partition's replicas' actor names, the leader's first. */
  List<String[]> partitions() {
    byte[] reply = null;
    long deadline = System.currentTimeMillis() + timeoutMs;
    while (reply == null) {
      try {
        reply = Ray.get(actor(CONTROLLER).task(METADATA, topic).remote(), Math.max(1, Math.min(ATTEMPT_MS, deadline - System.currentTimeMillis())));
      } catch (RuntimeException e) {
        String text = String.valueOf(e.getMessage());
        if (text.contains("UnknownTopicError")) {
          throw new IllegalArgumentException("logbus has no topic " + topic, e);
        }
        if (System.currentTimeMillis() >= deadline) {
          throw new IllegalStateException("asking logbus's controller for topic " + topic + " failed for " + timeoutMs + " ms: "
              + e.getMessage(), e);
        }
        pause(200); // the controller restarting: ask again
      }
    }
    try {
      JsonNode root = new ObjectMapper().readTree(new String(reply, StandardCharsets.UTF_8));
      maxMessageBytes = root.path("max_message_bytes").asInt(maxMessageBytes);
      List<String[]> partitions = new ArrayList<>();
      for (JsonNode partition : root.path("partitions")) {
        List<String> names = new ArrayList<>();
        for (JsonNode name : partition.path("replicas")) {
          names.add(name.asText());
        }
        partitions.add(names.toArray(new String[0]));
      }
      return partitions;
    } catch (IOException e) {
      throw new IllegalStateException("logbus's controller sent unreadable metadata for " + topic, e);
    }
  }

  /** The topic's max.message.bytes, as the last {@link #partitions} call found it. */
  int maxMessageBytes() {
    return maxMessageBytes;
  }

  /** Every partition's offsets, asked of all leaders at once; a partition whose replicas all fail fails. */
  List<Offsets> offsets(List<String[]> partitions) {
    Function<String, ObjectRef<byte[]>> send = name -> actor(name).task(OFFSETS, isolation).remote();
    List<ObjectRef<byte[]>> pending = new ArrayList<>();
    for (String[] names : partitions) {
      pending.add(names.length == 0 ? null : sent(send, names[0]));
    }
    List<Offsets> result = new ArrayList<>();
    for (int p = 0; p < partitions.size(); p++) {
      ByteBuffer reply = ask(p, partitions.get(p), pending.get(p), send, "offsets");
      result.add(new Offsets(reply.getLong(0), reply.getLong(8), reply.getLong(16)));
    }
    return result;
  }

  /**
   * Each partition's first offset whose record has a timestamp at or after {@code timestamps[p]}, below
   * its high watermark, or -1 when it has none (Kafka's ListOffsets by timestamp); asked of all leaders at once.
   */
  long[] offsetsForTimestamps(List<String[]> partitions, long[] timestamps) {
    List<ObjectRef<byte[]>> pending = new ArrayList<>();
    List<Function<String, ObjectRef<byte[]>>> sends = new ArrayList<>();
    for (int p = 0; p < partitions.size(); p++) {
      long timestamp = timestamps[p];
      Function<String, ObjectRef<byte[]>> send = name -> actor(name).task(OFFSET_FOR_TIMESTAMP, timestamp).remote();
      sends.add(send);
      pending.add(partitions.get(p).length == 0 ? null : sent(send, partitions.get(p)[0]));
    }
    long[] result = new long[partitions.size()];
    for (int p = 0; p < partitions.size(); p++) {
      result[p] = ask(p, partitions.get(p), pending.get(p), sends.get(p), "offset for timestamp " + timestamps[p]).getLong(0);
    }
    return result;
  }

  /** A call sent to the replica {@code name}, or null when it cannot be (no such actor now). */
  private static ObjectRef<byte[]> sent(Function<String, ObjectRef<byte[]>> send, String name) {
    try {
      return send.apply(name);
    } catch (RuntimeException e) {
      return null;
    }
  }

  /** Sleep {@code ms} (at least 0); an interrupt (Spark killing the task) ends the read. */
  static void pause(long ms) {
    try {
      Thread.sleep(Math.max(0, ms));
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException("interrupted", e);
    }
  }

  /**
   * A partition's leader's little-endian reply to {@code send}: {@code first} (already sent to the first
   * replica), then each replica in turn, asking the controller for the replicas again after each round,
   * for {@code timeoutMs} in all.
   */
  private ByteBuffer ask(int partition, String[] names, ObjectRef<byte[]> first, Function<String, ObjectRef<byte[]>> send, String what) {
    long deadline = System.currentTimeMillis() + timeoutMs;
    RuntimeException last = null;
    for (int attempt = 0; ; attempt++) {
      ObjectRef<byte[]> ref = attempt == 0 ? first : (names.length == 0 ? null : sent(send, names[attempt % names.length]));
      if (ref != null) {
        try {
          return ByteBuffer.wrap(Ray.get(ref, Math.max(1, Math.min(ATTEMPT_MS, deadline - System.currentTimeMillis()))))
              .order(ByteOrder.LITTLE_ENDIAN);
        } catch (RuntimeException e) {
          last = e;
        }
      }
      long now = System.currentTimeMillis();
      if (now >= deadline) {
        throw new IllegalStateException(topic + "-" + partition + ": no leader answered for its " + what + " within " + timeoutMs
            + " ms" + (last == null ? " (no replica on a live node)" : "; last error: " + last.getMessage()), last);
      }
      if (names.length == 0 || (attempt + 1) % names.length == 0) {
        pause(Math.min(deadline - now, 200L));
        try {
          List<String[]> fresh = partitions(); // a replica moved, or its host joined again under a new Ray node id
          if (partition < fresh.size()) {
            names = fresh.get(partition);
          }
        } catch (RuntimeException e) {
          // keep the names known
        }
      }
    }
  }
}
