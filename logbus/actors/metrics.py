"""The metrics logbus exports: Ray metrics (``ray.util.metrics``), served on every node's Prometheus endpoint.

Ray serves them with its own metrics at each node's ``MetricsExportPort``
(``ray.nodes()[i]["MetricsExportPort"]``), with the prefix ``ray_``. The
names follow what kafka_exporter and Kafka's JMX dashboards show, so a Kafka
dashboard maps onto them line by line:

=====================================================  ==============================================  =======================
Prometheus name                                        what                                            Kafka
=====================================================  ==============================================  =======================
``ray_logbus_topic_messages_in_total{topic}``          records appended by leaders                     BrokerTopicMetrics MessagesInPerSec
``ray_logbus_topic_bytes_in_total{topic}``             bytes appended by leaders                       BytesInPerSec
``ray_logbus_topic_messages_out_total{topic}``         records fetched by consumers                    (records consumed)
``ray_logbus_topic_bytes_out_total{topic}``            bytes fetched by consumers                      BytesOutPerSec
``ray_logbus_request_latency_ms{request}``             histogram: produce, produce_acks_all, fetch     RequestMetrics TotalTimeMs
``ray_logbus_under_replicated_partitions``             partitions whose ISR is smaller than replicas   UnderReplicatedPartitions
``ray_logbus_offline_partitions``                      partitions without a leader                     OfflinePartitionsCount
``ray_logbus_isr_shrinks_total``                       ISR shrinks the controller accepted             IsrShrinksPerSec
``ray_logbus_isr_expands_total``                       ISR expansions the controller accepted          IsrExpandsPerSec
``ray_logbus_leader_elections_total{unclean}``         leadership changes (unclean="true"/"false")     LeaderElectionRate
``ray_logbus_leaderless_overdue_total``                partitions found leaderless past lease + 1 s    (none: a missed
                                                       while a replica could lead (a bug)              election)
``ray_logbus_log_size_bytes{topic,partition}``         a leader's log size                             Log Size
``ray_logbus_log_segments{topic,partition}``           a leader's segment count                        Log NumLogSegments
``ray_logbus_consumer_group_lag{group,topic,partition}`` committed offset to high watermark             kafka_consumergroup_lag
``ray_logbus_producer_buffer_bytes{client_id}``        bytes a producer holds (buffered and in flight)  buffer-total-bytes - available
``ray_logbus_remote_copy_bytes_total{topic}``          bytes of segments leaders uploaded to the tier  RemoteCopyBytesPerSec
``ray_logbus_remote_fetch_bytes_total{topic}``         bytes consumers read back from the tier         RemoteFetchBytesPerSec
``ray_logbus_remote_log_size_bytes{topic,partition}``  a leader's view of its partition's tier size    RemoteLogSizeBytes
``ray_logbus_remote_copy_lag_bytes{topic,partition}``  local bytes not yet uploaded (active included)  RemoteCopyLagBytes
=====================================================  ==============================================  =======================

Each process creates the metrics it uses on first use (a replica never
creates the controller's). Counters and histograms are updated where the
event happens (an append, a fetch, an ISR change, an election). Gauges are
different: Ray 2.60's metrics agent drops a gauge series that was not set
again within two report intervals, so a gauge set only on events leaves the
endpoint seconds after the last one. Each gauge is therefore set again
while its value stands still, by one timer per process that already has
one: the controller's control loop sets the two partition counts once a
second; a producer's sender thread its buffer gauge once a second; a
leader publishes its log's size and segments (at each append,
retention, cleaning or delete_records) and its tier's two sizes (at each
upload or retention pass) in its fence file (``lease_files.py``), and the
node agent sets them for every current leader of its node once a report
interval. Nothing runs per partition on a timer.
"""

from __future__ import annotations

from logbus.clock import monotonic_ms

LATENCY_BOUNDARIES_MS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000]
GAUGE_EVERY_MS = 1_000

_made: dict[str, object] = {}


def _metric(name: str):
    metric = _made.get(name)
    if metric is None:
        from ray.util import metrics  # noqa: PLC0415 (each process pays for what it uses)

        kind, description, tags = _DEFINITIONS[name]
        if kind == "counter":
            metric = metrics.Counter(name, description=description, tag_keys=tags)
        elif kind == "gauge":
            metric = metrics.Gauge(name, description=description, tag_keys=tags)
        else:
            metric = metrics.Histogram(name, description=description, boundaries=LATENCY_BOUNDARIES_MS, tag_keys=tags)
        _made[name] = metric
    return metric


_DEFINITIONS = {
    "logbus_topic_messages_in": ("counter", "Records appended by partition leaders.", ("topic",)),
    "logbus_topic_bytes_in": ("counter", "Bytes appended by partition leaders.", ("topic",)),
    "logbus_topic_messages_out": ("counter", "Records fetched by consumers.", ("topic",)),
    "logbus_topic_bytes_out": ("counter", "Bytes fetched by consumers.", ("topic",)),
    "logbus_request_latency_ms": ("histogram", "Time a replica took to answer a request, ms.", ("request",)),
    "logbus_under_replicated_partitions": ("gauge", "Partitions whose ISR is smaller than their replica set.", ()),
    "logbus_offline_partitions": ("gauge", "Partitions without a leader.", ()),
    "logbus_isr_shrinks": ("counter", "ISR shrinks accepted by the controller.", ()),
    "logbus_isr_expands": ("counter", "ISR expansions accepted by the controller.", ()),
    "logbus_leader_elections": ("counter", "Leadership changes made by the controller.", ("unclean",)),
    "logbus_leaderless_overdue": (
        "counter", "Partitions found without a leader for longer than the lease plus a second while a replica could lead.", ()),
    "logbus_log_size_bytes": ("gauge", "Size of a partition leader's log in bytes.", ("topic", "partition")),
    "logbus_log_segments": ("gauge", "Segments in a partition leader's log.", ("topic", "partition")),
    "logbus_producer_buffer_bytes": ("gauge", "Bytes a producer holds, buffered and in flight.", ("client_id",)),
    "logbus_remote_copy_bytes": ("counter", "Bytes of segments partition leaders uploaded to the remote tier.", ("topic",)),
    "logbus_remote_fetch_bytes": ("counter", "Bytes consumers read back from the remote tier.", ("topic",)),
    "logbus_remote_log_size_bytes": ("gauge", "Size of a partition's remote tier in bytes, as its leader sees it.", ("topic", "partition")),
    "logbus_remote_copy_lag_bytes": ("gauge", "Bytes of a partition leader's log not yet in the remote tier.", ("topic", "partition")),
}


def tier_uploaded(topic: str, size: int) -> None:
    _metric("logbus_remote_copy_bytes").inc(size, tags={"topic": topic})


def tier_fetched(topic: str, size: int) -> None:
    if size > 0:
        _metric("logbus_remote_fetch_bytes").inc(size, tags={"topic": topic})


def tier_sizes(topic: str, partition: int, remote_bytes: int, lag_bytes: int) -> None:
    tags = {"topic": topic, "partition": str(partition)}
    _metric("logbus_remote_log_size_bytes").set(remote_bytes, tags=tags)
    _metric("logbus_remote_copy_lag_bytes").set(lag_bytes, tags=tags)


def appended(topic: str, records: int, size: int) -> None:
    _metric("logbus_topic_messages_in").inc(records, tags={"topic": topic})
    _metric("logbus_topic_bytes_in").inc(size, tags={"topic": topic})


def fetched(topic: str, records: int, size: int) -> None:
    if records > 0:
        _metric("logbus_topic_messages_out").inc(records, tags={"topic": topic})
        _metric("logbus_topic_bytes_out").inc(size, tags={"topic": topic})


def latency(request: str, ms: float) -> None:
    _metric("logbus_request_latency_ms").observe(ms, tags={"request": request})


def isr_changed(old: int, new: int) -> None:
    if new < old:
        _metric("logbus_isr_shrinks").inc(1)
    elif new > old:
        _metric("logbus_isr_expands").inc(1)


def leader_elected(unclean: bool) -> None:
    _metric("logbus_leader_elections").inc(1, tags={"unclean": "true" if unclean else "false"})


def leaderless_overdue() -> None:
    _metric("logbus_leaderless_overdue").inc(1)


def partition_health(under_replicated: int, offline: int) -> None:
    _metric("logbus_under_replicated_partitions").set(under_replicated)
    _metric("logbus_offline_partitions").set(offline)


class LogGauges:
    """A leader's log size and segment count.

    A replica under a controller publishes them in its fence file at each change (two 8-byte writes),
    and its node's agent sets the gauges from there, every report interval, for each current leader
    of the node (``export_published``). A standalone replica (no controller, no agent) sets them
    here, at most once a second, by the event that finds them stale.
    """

    __slots__ = ("_tags", "_set_ms", "fence")

    def __init__(self, topic: str, partition: int) -> None:
        self._tags = {"topic": topic, "partition": str(partition)}
        self._set_ms = 0
        self.fence = None  # the replica's ReplicaFence, once it has one

    def update(self, size_bytes: int, segments: int, epoch: int, force: bool = False) -> None:
        if self.fence is not None:
            self.fence.publish_log(epoch, size_bytes, segments)
            return
        now = monotonic_ms()
        if not force and now - self._set_ms < GAUGE_EVERY_MS:
            return
        self._set_ms = now
        _metric("logbus_log_size_bytes").set(size_bytes, tags=self._tags)
        _metric("logbus_log_segments").set(segments, tags=self._tags)


def export_published(topic: str, partition: int, published: tuple[int, int, int, int]) -> None:
    """Set a leader's gauges from what it published in its fence file (``ReplicaFence.published``):
    the node agent's pass over its node's leaders."""
    size_bytes, segments, remote_bytes, lag_bytes = published
    tags = {"topic": topic, "partition": str(partition)}
    _metric("logbus_log_size_bytes").set(size_bytes, tags=tags)
    _metric("logbus_log_segments").set(segments, tags=tags)
    if remote_bytes >= 0:
        tier_sizes(topic, partition, remote_bytes, lag_bytes)


class BufferGauge:
    """A producer's buffer use, set at most once a second, and again each second while it stands still
    (the producer's sender thread calls ``update`` at least every 50 ms; Ray drops a gauge not set
    within two report intervals)."""

    __slots__ = ("_tags", "_set_ms")

    def __init__(self, client_id: str) -> None:
        self._tags = {"client_id": client_id}
        self._set_ms = 0

    def update(self, buffered: int) -> None:
        now = monotonic_ms()
        if now - self._set_ms < GAUGE_EVERY_MS:
            return
        self._set_ms = now
        try:
            _metric("logbus_producer_buffer_bytes").set(buffered, tags=self._tags)
        except Exception:  # noqa: BLE001 (Ray not connected any more: a metric is not worth an error)
            pass
