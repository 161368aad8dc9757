package io.logbus.spark;

import java.util.List;
import java.util.Optional;

import io.ray.api.BaseActorHandle;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.exception.RayException;
import io.ray.api.function.PyActorMethod;

/**
 * Fetches one partition from its leader replica with Ray cross-language calls to the replica actor's
 * {@code jvm_fetch}, one fetch kept in flight ahead of the reader. When the replica it calls is not the
 * leader (or is away), it tries the partition's other replicas in turn, backing off after each full
 * round, until the plan's timeout.
 */
final class ReplicaClient {
  private static final PyActorMethod<byte[]> JVM_FETCH = PyActorMethod.of("jvm_fetch", byte[].class);
  // Headers only: a fetch of this many stored bytes returns 64 bytes a batch.
  private static final int HEADERS_FETCH_MAX_BYTES = 64 << 20;
  // Python errors worth trying another replica (or the same one later) for.
  private static final String[] RETRIABLE = {
    "NotLeaderError", "LeaderNotAvailableError", "NotEnoughReplicasError", "ReplicaNotAvailableError",
    "FencedLeaderEpochError", "TierNotAvailableError", "RequestTimedOutError", "ObjectLostException",
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError",
  };

  private final ReadPlan plan;
  private final ReadPlan.Range range;
  private final boolean headersOnly;
  private final int columns;
  private int current;
  private String[] replicas;
  private PyActorHandle actor;
  private long pendingOffset = -1;
  private ObjectRef<byte[]> pending;

  /** {@code columns}: the mask of the batch schema's columns to fetch (see BatchDecoder); 0 fetches headers only. */
  ReplicaClient(ReadPlan plan, ReadPlan.Range range, int columns) {
    this.plan = plan;
    this.range = range;
    this.columns = columns;
    this.headersOnly = columns == 0;
    this.replicas = range.replicas;
  }

  private String label() {
    return plan.topic + "-" + range.partition;
  }

  private PyActorHandle actor() {
    if (actor == null) {
      String name = replicas[current];
      Optional<BaseActorHandle> handle = Ray.getActor(name, plan.namespace);
      if (!handle.isPresent()) {
        throw new IllegalStateException(label() + ": no replica actor named " + name + " (ActorDiedError)");
      }
      actor = (PyActorHandle) handle.get();
    }
    return actor;
  }

  private ObjectRef<byte[]> send(long offset) {
    int maxBytes = headersOnly ? Math.max(plan.fetchMaxBytes, HEADERS_FETCH_MAX_BYTES) : plan.fetchMaxBytes;
    return actor().task(JVM_FETCH, offset, maxBytes, plan.isolation, headersOnly, columns).remote();
  }

  /** Ask for {@code offset} now; the next {@link #fetch} of that offset takes the answer. */
  void prefetch(long offset) {
    try {
      pending = send(offset);
      pendingOffset = offset;
    } catch (RuntimeException e) {
      pending = null; // fetch() asks again, and handles the error
    }
  }

  /** The reply for {@code offset}. */
  FetchReply fetch(long offset) {
    long deadline = System.currentTimeMillis() + plan.timeoutMs;
    int failed = 0;
    RuntimeException last = null;
    while (true) {
      ObjectRef<byte[]> ref = null;
      if (pending != null && pendingOffset == offset) {
        ref = pending;
      }
      pending = null;
      try {
        if (ref == null) {
          ref = send(offset);
        }
        long left = Math.max(1, Math.min(TopicClient.ATTEMPT_MS, deadline - System.currentTimeMillis()));
        FetchReply reply = new FetchReply(Ray.get(ref, left));
        if (reply.columns != columns) {
          throw new IllegalStateException(label() + ": asked for columns " + columns + ", the replica sent " + reply.columns);
        }
        return reply;
      } catch (RuntimeException e) {
        if (!plan.failOnDataLoss && String.valueOf(e.getMessage()).contains("OffsetOutOfRangeError")) {
          throw new DataLoss(e);
        }
        if (!retriable(e)) {
          throw new IllegalStateException(label() + ": fetching offset " + offset + " failed: " + e.getMessage(), e);
        }
        last = e;
      }
      actor = null;
      current = (current + 1) % replicas.length;
      failed += 1;
      long now = System.currentTimeMillis();
      if (now >= deadline) {
        throw new IllegalStateException(
            label() + ": no replica served offset " + offset + " within " + plan.timeoutMs + " ms; last error: "
                + (last == null ? "none" : last.getMessage()), last);
      }
      if (failed % replicas.length == 0) {
        TopicClient.pause(Math.min(deadline - now, Math.min(1000L, 50L << Math.min(5, failed / replicas.length))));
        refreshReplicas();
      }
    }
  }

  /**
   * After every replica named failed once: ask the controller for the partition's replicas again (a
   * replica moved, or its host joined again as a new Ray node: its actor has a new name).
   */
  private void refreshReplicas() {
    try {
      List<String[]> partitions = new TopicClient(plan.topic, plan.namespace, plan.isolation, plan.timeoutMs).partitions();
      if (range.partition < partitions.size() && partitions.get(range.partition).length > 0) {
        replicas = partitions.get(range.partition);
        current = 0;
      }
    } catch (RuntimeException e) {
      // the controller may be restarting too: keep the names known
    }
  }

  /** Records the read needs were deleted (retention) meanwhile, and the query goes on without them. */
  static final class DataLoss extends RuntimeException {
    private static final long serialVersionUID = 1L;

    DataLoss(Throwable cause) {
      super(cause.getMessage(), cause);
    }
  }

  /** The partition's log start now, from its leader. */
  long logStart() {
    return new TopicClient(plan.topic, plan.namespace, plan.isolation, plan.timeoutMs)
        .offsets(java.util.Collections.singletonList(replicas)).get(0).logStart;
  }

  private static boolean retriable(RuntimeException e) {
    if (e instanceof IllegalStateException && String.valueOf(e.getMessage()).contains("ActorDiedError")) {
      return true;
    }
    if (!(e instanceof RayException)) {
      return false;
    }
    if (e instanceof io.ray.api.exception.RayActorException
        || e instanceof io.ray.api.exception.RayTimeoutException) {
      return true;
    }
    String text = String.valueOf(e.getMessage());
    for (String name : RETRIABLE) {
      if (text.contains(name)) {
        return true;
      }
    }
    return false;
  }

}
