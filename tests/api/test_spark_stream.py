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


def test_batch_that_crashed_after_its_sink_wrote_reruns_its_planned_offsets(spark, bus, topic_name):
    """Spark's exactly-once recipe: a sink idempotent by batch id, a crash between its write and the commit,
    records arriving while the stream is down; the restarted stream re-runs the batch over its planned offsets."""
    bus.admin.create_topic(topic_name, partitions=2)

    def produce(values: range) -> None:
        with logbus.Producer(bus) as producer:
            for i in values:
                producer.send(topic_name, b"%d" % i, partition=i % 2)

    produce(range(0, 300))
    sink: dict[int, list[int]] = {}  # batch id -> values; a batch id already written is skipped
    crash_after_writing = {1}
    ranges = []

    def process_batch(df, batch_id):
        rows = df.select("partition", "offset", "value").collect()
        ranges.append((batch_id, sorted((r["partition"], r["offset"]) for r in rows)))
        if batch_id not in sink:
            sink[batch_id] = [int(bytes(r["value"])) for r in rows]
        if batch_id in crash_after_writing:
            crash_after_writing.discard(batch_id)
            raise RuntimeError("crashed after the sink wrote, before the commit")

    def start():
        return logbus.spark.stream(
            spark, topic_name, "spark-exactly-once", process_batch, trigger_interval_s=0, bus=bus,
            until_caught_up=True, progress=lambda p: None,
        )

    assert start().await_termination(timeout_s=300)  # batch 0: 300 records
    produce(range(300, 500))
    with pytest.raises(RuntimeError, match="crashed after the sink wrote"):
        start().await_termination(timeout_s=300)  # batch 1: 200 records written, then the crash
    failed = ranges[-1]
    assert failed[0] == 1 and len(failed[1]) == 200

    produce(range(500, 800))  # while the stream is down
    restarted = start()
    assert restarted.await_termination(timeout_s=300)
    assert [p.batch_id for p in restarted.recent_progress] == [1, 2]
    assert ranges[-2] == failed  # batch 1 again, over the same offsets
    assert sorted(v for values in sink.values() for v in values) == list(range(800))  # every record exactly once


def test_stream_needs_a_running_spark(bus, topic_name):
    bus.admin.create_topic(topic_name)
    with pytest.raises(logbus.IllegalStateError):
        logbus.spark.stream(None, topic_name, "g", lambda df, batch_id: None, bus=bus)
