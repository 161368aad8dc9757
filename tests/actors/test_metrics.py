"""The metrics operators expect, scraped from Ray's real Prometheus endpoint after known traffic."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request

import pytest
import ray

import logbus
from logbus import TopicPartition
from tests.conftest import wait_for

# Ray reports metrics every second here (its default is 10 s): the tests below show gauges still on
# the endpoint after two report intervals, which must pass within their deadlines.
pytestmark = pytest.mark.usefixtures("metrics_every_second")


def scrape() -> dict[str, list[tuple[dict, float]]]:
    """Every sample of every node's endpoint: name -> [(labels, value)]. A node Ray still lists as alive
    whose endpoint refuses connections was just removed (Ray notices a few seconds later): skipped."""
    samples: dict[str, list[tuple[dict, float]]] = {}
    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ([0-9.eE+-]+|NaN|\+Inf)$")
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10).read().decode()
        except urllib.error.URLError as error:
            if isinstance(error.reason, ConnectionRefusedError):
                continue
            raise
        for line in text.splitlines():
            found = line_re.match(line)
            if found and found.group(1).startswith("ray_logbus_"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(2) or ""))
                samples.setdefault(found.group(1), []).append((labels, float(found.group(3))))
    return samples


def total(samples, name: str, **labels) -> float:
    return sum(value for found, value in samples.get(name, []) if all(found.get(k) == v for k, v in labels.items()))


def test_produce_fetch_latency_and_log_metrics_after_known_traffic(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus, acks=1) as producer:
        for i in range(100):
            producer.send(topic_name, b"%03d" % i, partition=i % 2)
    # This producer stays open while the endpoint is scraped: its buffer gauge is set again each second
    # while it lives, and Ray drops a gauge not set within two report intervals (2 s here), which a busy
    # machine can take to export the counters below.
    with logbus.Producer(bus, acks="all") as producer:
        for i in range(50):
            producer.send(topic_name, b"all-%03d" % i, partition=0)
        producer.flush(timeout_s=60)
        consumer = logbus.Consumer(bus)
        consumer.assign([TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)])
        got = []
        wait_for(lambda: got.extend(consumer.poll(timeout_ms=300).values()) or sum(map(len, got)) >= 150, timeout_s=60,
                 message="records")
        consumer.close()

        def exported():
            samples = scrape()
            done = (
                total(samples, "ray_logbus_topic_messages_in_total", topic=topic_name) == 150
                and total(samples, "ray_logbus_topic_messages_out_total", topic=topic_name) >= 150
                and total(samples, "ray_logbus_log_size_bytes", topic=topic_name) > 0
                and "ray_logbus_producer_buffer_bytes" in samples
            )
            return samples if done else None

        samples = wait_for(exported, timeout_s=90, interval_s=1, message="metrics exported")
    assert total(samples, "ray_logbus_topic_bytes_in_total", topic=topic_name) > 150 * 3  # every record's value, and framing
    assert total(samples, "ray_logbus_topic_bytes_out_total", topic=topic_name) > 0
    assert total(samples, "ray_logbus_request_latency_ms_count", request="produce") >= 1
    assert total(samples, "ray_logbus_request_latency_ms_count", request="produce_acks_all") >= 1
    assert total(samples, "ray_logbus_request_latency_ms_count", request="fetch") >= 1
    assert {labels["partition"] for labels, _ in samples["ray_logbus_log_segments"] if labels.get("topic") == topic_name} == {"0", "1"}
    assert any(labels.get("client_id") for labels, _ in samples["ray_logbus_producer_buffer_bytes"])


def test_the_partition_health_gauges_stay_on_the_endpoint_while_nothing_changes(bus, topic_name):
    """Ray's metrics agent drops a gauge that was not set within two report intervals (2 s in this
    module). The controller counts under-replicated and offline partitions when an ISR or a
    leader changes, and sets the same counts again while nothing does: they are still on the endpoint
    well after the last change (before, they were gone about 2 s after it)."""
    bus.admin.create_topic(topic_name, partitions=1)  # the last change this test makes
    changed = time.monotonic()

    def there_long_after():
        if time.monotonic() - changed < 5.0:
            return False
        samples = scrape()
        return "ray_logbus_under_replicated_partitions" in samples and "ray_logbus_offline_partitions" in samples

    wait_for(there_long_after, timeout_s=90, interval_s=0.2, message="the health gauges 5 s after the last change")


def test_a_leaders_log_gauges_stay_on_the_endpoint_while_idle_and_leave_with_the_topic(bus, topic_name):
    """A leader's log size and segment count change only with its log; Ray drops a gauge not set within
    two report intervals. Each leader publishes them in its fence file and its node's agent sets them
    every interval: they are still there well after the last append (before, about 2 s after it), and
    go once the topic is deleted (the agent exports no replica that is gone)."""
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus, acks=1) as producer:
        for i in range(40):
            producer.send(topic_name, b"idle-%02d" % i, partition=i % 2)
    appended = time.monotonic()  # the last change to either log

    def both_partitions(samples) -> dict:
        return {labels["partition"]: value for labels, value in samples.get("ray_logbus_log_size_bytes", [])
                if labels.get("topic") == topic_name}

    def there_long_after():
        if time.monotonic() - appended < 5.0:
            return None
        samples = scrape()
        sizes = both_partitions(samples)
        segments = {labels["partition"] for labels, _ in samples.get("ray_logbus_log_segments", []) if labels.get("topic") == topic_name}
        return sizes if set(sizes) == {"0", "1"} and segments == {"0", "1"} else None

    sizes = wait_for(there_long_after, timeout_s=90, interval_s=0.2, message="both leaders' log gauges 5 s after the last append")
    assert all(value > 20 * 7 for value in sizes.values()), sizes  # 20 records of 7 bytes each, and framing

    bus.admin.delete_topic(topic_name)
    wait_for(lambda: not both_partitions(scrape()), timeout_s=90, interval_s=0.5, message="the deleted topic's log gauges gone")


def test_an_idle_producers_buffer_gauge_stays_on_the_endpoint(bus, topic_name):
    """The buffer gauge is set by the producer's sender thread, and set again each second while the
    buffer stands still: an idle producer's series (all its records acknowledged: 0 bytes) is there
    well after its last send, and not only for the two report intervals Ray keeps a gauge."""
    bus.admin.create_topic(topic_name, partitions=1)
    prefix = f"producer-{os.getpid()}-"
    with logbus.Producer(bus, acks=1) as producer:
        producer.send(topic_name, b"one")
        producer.flush()
        sent = time.monotonic()

        def idle_and_there():
            if time.monotonic() - sent < 5.0:
                return False
            return any(labels.get("client_id", "").startswith(prefix) and value == 0
                       for labels, value in scrape().get("ray_logbus_producer_buffer_bytes", []))

        wait_for(idle_and_there, timeout_s=90, interval_s=0.2, message="the idle producer's buffer gauge 5 s after its last send")
