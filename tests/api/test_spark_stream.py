"""logbus.spark.stream: micro-batches as DataFrames; offsets committed only after a batch succeeded."""

import pytest

import logbus
import logbus.spark
from logbus import TopicPartition


def test_stream_fails_on_third_batch_then_restarts_and_processes_everything(spark, bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    with logbus.Producer(bus) as producer:
        for i in range(2000):
            producer.send(topic_name, b"v-%d" % i, partition=i % 2)
    processed = set()
    calls = []

    def process_batch(df, batch_id):
        calls.append(batch_id)
        rows = df.select("partition", "offset").collect()
        if len(calls) == 3:
            raise RuntimeError("the sink is down")
        processed.update((r["partition"], r["offset"]) for r in rows)

    first = logbus.spark.stream(
        spark, topic_name, "spark-etl", process_batch, max_offsets_per_trigger=500, trigger_interval_s=0, bus=bus,
        until_caught_up=True, progress=lambda p: None,
    )
    with pytest.raises(RuntimeError, match="sink is down"):
        first.await_termination(timeout_s=300)
    tps = [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    committed = logbus.Consumer(bus, group_id="spark-etl").committed(tps)
    for tp in tps:  # committed offsets never pass an unprocessed record
        assert {(tp.partition, o) for o in range(committed[tp])} <= processed
    second = logbus.spark.stream(
        spark, topic_name, "spark-etl", process_batch, max_offsets_per_trigger=500, trigger_interval_s=0, bus=bus,
        until_caught_up=True, progress=lambda p: None,
    )
    assert second.await_termination(timeout_s=300)
    assert calls[3] == 2  # the failed batch ran again with its batch id
    assert processed == {(i % 2, i // 2) for i in range(2000)}
    assert second.recent_progress[-1].lag_after == 0


def test_stream_needs_a_running_spark(bus, topic_name):
    bus.admin.create_topic(topic_name)
    with pytest.raises(logbus.IllegalStateError):
        logbus.spark.stream(None, topic_name, "g", lambda df, batch_id: None, bus=bus)
