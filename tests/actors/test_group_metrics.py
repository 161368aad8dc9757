"""Group lag is exported through Ray's metrics and visible on the node's Prometheus endpoint."""

import re
import urllib.request

import ray

import logbus
from logbus import TopicPartition
from tests.conftest import wait_for


def test_lag_per_partition_on_the_prometheus_endpoint(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus) as producer:
        for i in range(30):
            producer.send(topic_name, b"x", partition=i % 2)
    consumer = logbus.Consumer(bus, group_id="lagging")
    consumer.assign([TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)])
    consumer.commit({TopicPartition(topic_name, 0): 5, TopicPartition(topic_name, 1): 15})
    consumer.close()
    port = ray.nodes()[0]["MetricsExportPort"]
    pattern = re.compile(
        r'^ray_logbus_consumer_group_lag\{[^}]*group="lagging"[^}]*partition="(\d)"[^}]*topic="' + re.escape(topic_name) + r'"[^}]*\} ([0-9.]+)$'
    )

    def lags():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {int(m.group(1)): float(m.group(2)) for m in map(pattern.match, text.splitlines()) if m}
        return found if len(found) == 2 else None

    assert wait_for(lags, timeout_s=90, interval_s=1, message="lag metrics") == {0: 10.0, 1: 0.0}
