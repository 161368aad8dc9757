"""logbus.spark.stream: micro-batches as DataFrames; offsets committed only after a batch succeeded."""

import time

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


# --- spark.readStream.format("logbus"): Spark's own Structured Streaming -----------------------------


def produce_values(bus, topic: str, values: range, partitions: int = 2) -> None:
    with logbus.Producer(bus) as producer:
        for i in values:
            producer.send(topic, b"%d" % i, partition=i % partitions)
        producer.flush(timeout_s=60)


def run_query(spark, df, sink, checkpoint, timeout_s: float = 240):
    """One Trigger.AvailableNow run of ``df`` into ``foreachBatch(sink)``: it reads what is there and ends."""
    query = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    try:
        query.awaitTermination(timeout_s)
    finally:
        if query.isActive:
            query.stop()
            raise AssertionError(f"the query did not end within {timeout_s} s")


def test_read_stream_has_the_kafka_sources_schema(spark, bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    df = logbus.spark.read_stream(spark, topic_name, bus=bus)
    assert df.isStreaming and df.schema == logbus.spark.kafka_schema()
    assert logbus.spark.read_stream(spark, topic_name, include_headers=True, bus=bus).schema == logbus.spark.kafka_schema(True)


@pytest.mark.timeout(600)
def test_a_query_restarted_between_a_batchs_write_and_its_commit_neither_loses_nor_repeats(spark, bus, topic_name, tmp_path):
    from pyspark.errors import StreamingQueryException

    bus.admin.create_topic(topic_name, partitions=2)
    produce_values(bus, topic_name, range(0, 600))
    written: dict[int, list[tuple[int, int, int]]] = {}  # batch id -> rows; a batch id written again replaces itself
    crash = {"armed": True}

    def sink(df, batch_id):
        written[batch_id] = [(r["partition"], r["offset"], int(bytes(r["value"]))) for r in df.collect()]
        if batch_id == 1 and crash["armed"]:
            crash["armed"] = False
            raise RuntimeError("the driver died after the sink wrote batch 1, before Spark committed it")

    def stream():
        return logbus.spark.read_stream(spark, topic_name, starting_offsets="earliest", max_offsets_per_trigger=200, bus=bus)

    checkpoint = tmp_path / "checkpoint"
    with pytest.raises(StreamingQueryException, match="before Spark committed it"):
        run_query(spark, stream(), sink, checkpoint)
    first_write = list(written[1])
    produce_values(bus, topic_name, range(600, 900))  # arrives while the query is down
    run_query(spark, stream(), sink, checkpoint)
    assert written[1] == first_write  # batch 1 ran again over the offsets it was planned with
    rows = [row for batch in sorted(written) for row in written[batch]]
    assert sorted(value for _, _, value in rows) == list(range(900))  # each record once
    assert len({(p, o) for p, o, _ in rows}) == 900
    assert all(0 < len(batch) <= 200 for batch in written.values())


@pytest.mark.timeout(600)
def test_fail_on_data_loss_stops_a_query_whose_next_records_were_deleted(spark, bus, topic_name, tmp_path):
    from pyspark.errors import StreamingQueryException

    bus.admin.create_topic(topic_name, partitions=1)
    produce_values(bus, topic_name, range(0, 100), partitions=1)
    seen: list[int] = []

    def sink(df, batch_id):
        seen.extend(int(bytes(r["value"])) for r in df.collect())

    def stream(fail_on_data_loss):
        return logbus.spark.read_stream(spark, topic_name, starting_offsets="earliest", fail_on_data_loss=fail_on_data_loss, bus=bus)

    checkpoint = tmp_path / "checkpoint"
    run_query(spark, stream(True), sink, checkpoint)
    assert seen == list(range(100))
    produce_values(bus, topic_name, range(100, 200), partitions=1)
    bus.admin.delete_records({TopicPartition(topic_name, 0): 150})  # 100..149 go before the query reads them
    with pytest.raises(StreamingQueryException, match="were deleted before this query read them"):
        run_query(spark, stream(True), sink, checkpoint)
    run_query(spark, stream(False), sink, checkpoint)
    assert seen == list(range(100)) + list(range(150, 200))


def test_read_stream_options_are_checked(spark, bus, topic_name):
    from logbus.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="max_offsets_per_trigger"):
        logbus.spark.read_stream(spark, topic_name, max_offsets_per_trigger=0, bus=bus)
    with pytest.raises(InvalidConfigError, match="isolation_level"):
        logbus.spark.read_stream(spark, topic_name, isolation_level="serializable", bus=bus)
    with pytest.raises(Exception, match="subscribe"):  # Spark's own spelling, without the topic
        spark.readStream.format("logbus").load()
    # Kafka source options that would change what is read, which logbus does not offer: refused by name.
    for name, value in (("assign", '{"t": [0]}'), ("subscribePattern", "t-.*")):
        reader = spark.readStream.format("logbus").option("subscribe", topic_name).option(name, value)
        with pytest.raises(Exception, match=f"does not offer Spark's Kafka option {name}"):
            reader.option("logbus.namespace", bus.namespace).load()


@pytest.mark.timeout(600)
def test_a_stream_refuses_ending_offsets_and_reports_the_latest_offsets(spark, bus, topic_name, tmp_path):
    from pyspark.errors import StreamingQueryException

    bus.admin.create_topic(topic_name, partitions=2)
    produce_values(bus, topic_name, range(0, 10))
    ending = (spark.readStream.format("logbus").option("subscribe", topic_name).option("logbus.namespace", bus.namespace)
              .option("endingOffsets", "latest").load())
    with pytest.raises(StreamingQueryException, match="endingOffsets is not valid in streaming queries"):
        run_query(spark, ending, lambda df, batch_id: None, tmp_path / "ending")
    waiting = (spark.readStream.format("logbus").option("subscribe", topic_name).option("logbus.namespace", bus.namespace)
               .option("minOffsetsPerTrigger", "100").load())
    with pytest.raises(StreamingQueryException, match="does not offer Spark's Kafka option minOffsetsPerTrigger"):
        run_query(spark, waiting, lambda df, batch_id: None, tmp_path / "waiting")

    df = logbus.spark.read_stream(spark, topic_name, starting_offsets="earliest", max_offsets_per_trigger=4, bus=bus)
    query = df.writeStream.foreachBatch(lambda df, batch_id: None).option("checkpointLocation", str(tmp_path / "checkpoint"))
    query = query.trigger(availableNow=True).start()
    try:
        assert query.awaitTermination(240), "the query did not end"
    finally:
        query.stop()
    sources = [progress["sources"][0] for progress in query.recentProgress if progress["sources"]]
    # Offsets as the progress shows them: the Kafka source's JSON, as a dict.
    assert sources and all(source["latestOffset"] == {topic_name: {"0": 5, "1": 5}} for source in sources)
    assert sources[-1]["endOffset"] == {topic_name: {"0": 5, "1": 5}}


@pytest.mark.timeout(600)
def test_write_stream_format_logbus_copies_a_topic_into_another(spark, bus, topic_name, tmp_path):
    out = f"{topic_name}-out"
    bus.admin.create_topic(topic_name, partitions=2)
    bus.admin.create_topic(out, partitions=3)
    produce_values(bus, topic_name, range(0, 500))
    query = (
        logbus.spark.read_stream(spark, topic_name, starting_offsets="earliest", max_offsets_per_trigger=150, bus=bus)
        .selectExpr("CAST(NULL AS BINARY) AS key", "value")
        .writeStream.format("logbus").option("topic", out).option("logbus.namespace", bus.namespace)
        .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start()
    )
    query.awaitTermination(300)
    assert not query.isActive and query.exception() is None
    consumer = logbus.Consumer(bus)
    consumer.assign([TopicPartition(out, p) for p in range(3)])
    values = []
    deadline = time.monotonic() + 60
    while len(values) < 500 and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            values.extend(int(r.value) for r in records)
    consumer.close()
    assert sorted(values) == list(range(500))  # keyless: spread over the partitions, each record once


@pytest.mark.timeout(600)
def test_a_stream_starts_at_a_timestamp(spark, bus, topic_name, tmp_path):
    bus.admin.create_topic(topic_name, partitions=2)
    base = int(time.time() * 1000) - 600_000  # ten minutes ago: within retention
    with logbus.Producer(bus) as producer:
        for i in range(40):
            producer.send(topic_name, b"%d" % i, partition=i % 2, timestamp_ms=base + i)
        producer.flush(timeout_s=60)
    seen: list[int] = []
    df = (spark.readStream.format("logbus").option("subscribe", topic_name).option("logbus.namespace", bus.namespace)
          .option("startingTimestamp", str(base + 25)).load())
    run_query(spark, df, lambda batch, batch_id: seen.extend(int(bytes(r["value"])) for r in batch.collect()), tmp_path / "checkpoint")
    assert sorted(seen) == list(range(25, 40))
