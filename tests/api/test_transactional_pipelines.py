"""Pipelines that write transactionally: a micro-batch stream (plain and Spark) and Ray Data's TopicSink.

Each run is interrupted between its output write and its commit (a process killed, or a commit
refused), restarted, and the output read with read_committed: every output record once.
"""

from __future__ import annotations

import os
import signal
import threading

import pyarrow as pa
import pytest
import ray

import logbus
from logbus.api.streaming import MicroBatchStream
from logbus.protocol.messages import TopicPartition
from tests.api.test_transactions_e2e import committed_values, read_committed
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(
    not hasattr(logbus.Consumer, "group_metadata"), reason="needs the log side of transactions (read_committed consumers)"
)


def read_uncommitted_values(bus, topic, partitions):
    consumer = logbus.Consumer(bus, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(tps)
        out = []
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            for records in consumer.poll(timeout_ms=200).values():
                out.extend(r.value for r in records)
        return sorted(out)
    finally:
        consumer.close()


def produce(bus, topic, count, partitions=2):
    with logbus.Producer(bus, acks="all") as producer:
        for i in range(count):
            producer.send(topic, b"%d" % i, partition=i % partitions)


def copy_batch(bus, source, sink):
    """run_batch of a transactional stream: the batch's records, prefixed, into ``sink``."""

    def run_batch(start, end, batch_id, producer):
        consumer = logbus.Consumer(bus, enable_auto_commit=False)
        try:
            consumer.assign([TopicPartition(source, p) for p in start])
            for p in start:
                consumer.seek(TopicPartition(source, p), start[p])
            remaining = {p: end[p] - start[p] for p in start}
            while any(remaining.values()):
                for tp, records in consumer.poll(timeout_ms=200).items():
                    for r in records:
                        if r.offset < end[tp.partition]:
                            producer.send(sink, b"out-" + r.value, partition=tp.partition)
                            remaining[tp.partition] -= 1
        finally:
            consumer.close()
        producer.flush()

    return run_batch


@ray.remote(num_cpus=0, max_restarts=0)
class StreamProcess:
    """A transactional stream in a process of its own; its batch waits after writing until released."""

    def __init__(self, bus, source, sink, group, transactional_id):
        self.written = threading.Event()
        write = copy_batch(bus, source, sink)

        def run_batch(start, end, batch_id, producer):
            write(start, end, batch_id, producer)
            self.written.set()
            threading.Event().wait()  # the process is killed here: written, not committed

        self.stream = MicroBatchStream(
            source, group, run_batch, trigger_interval_s=0, bus=bus, transactional_id=transactional_id, progress=None
        )

    def pid(self):
        return os.getpid()

    def start(self):
        self.stream.start(max_batches=1)

    def written_yet(self):
        return self.written.is_set()


@pytest.mark.timeout(400)
def test_a_stream_killed_between_its_write_and_its_commit_yields_each_output_once(bus, topic_name):
    source, sink, group, tid = f"{topic_name}-in", f"{topic_name}-out", f"{topic_name}-g", f"{topic_name}-tx"
    bus.admin.create_topic(source, partitions=2)
    bus.admin.create_topic(sink, partitions=2)
    produce(bus, source, 200)
    doomed = StreamProcess.remote(bus, source, sink, group, tid)
    ray.get(doomed.start.remote(), timeout=120)
    wait_for(lambda: ray.get(doomed.written_yet.remote(), timeout=60), timeout_s=120, message="the batch's output written")
    os.kill(ray.get(doomed.pid.remote(), timeout=60), signal.SIGKILL)
    restarted = MicroBatchStream(source, group, copy_batch(bus, source, sink), trigger_interval_s=0, bus=bus, transactional_id=tid, progress=None)
    restarted.run(until_caught_up=True)
    restarted.close()
    expected = sorted(b"out-%d" % i for i in range(200))
    assert committed_values(bus, sink, 2) == expected
    assert read_uncommitted_values(bus, sink, 2) == sorted(expected * 2)  # the first write is in the log, aborted


@pytest.mark.timeout(600)
def test_spark_stream_restarted_after_its_output_write_yields_each_output_record_once(spark, bus, topic_name):
    from pyspark.sql import functions as F

    source, sink, group, tid = f"{topic_name}-in", f"{topic_name}-out", f"{topic_name}-g", f"{topic_name}-tx"
    bus.admin.create_topic(source, partitions=2)
    bus.admin.create_topic(sink, partitions=2)
    produce(bus, source, 300)
    intruders = []

    def process_batch(df, batch_id):
        if not intruders:
            # A consumer joins the stream's group while the batch runs: the batch writes its output,
            # and then the group refuses the stream's offsets (only members commit): the transaction aborts.
            intruder = logbus.Consumer(bus, source, group_id=group, enable_auto_commit=False)
            wait_for(lambda: intruder.poll(timeout_ms=100) is not None and intruder.assignment(), timeout_s=60, message="the intruder joined")
            intruders.append(intruder)
        return df.select(F.concat(F.lit(b"out-"), F.col("value")).alias("value"), F.col("partition"))

    first = logbus.spark.stream(
        spark, source, group, process_batch, trigger_interval_s=0, bus=bus, until_caught_up=True, progress=lambda p: None,
        output_topic=sink, transactional_id=tid,
    )
    with pytest.raises(logbus.LogbusError):
        first.await_termination(timeout_s=300)
    intruders[0].close()
    assert committed_values(bus, sink, 2) == []
    second = logbus.spark.stream(
        spark, source, group, process_batch, trigger_interval_s=0, bus=bus, until_caught_up=True, progress=lambda p: None,
        output_topic=sink, transactional_id=tid,
    )
    assert second.await_termination(timeout_s=300)
    expected = sorted(b"out-%d" % i for i in range(300))
    assert committed_values(bus, sink, 2) == expected
    assert len(read_uncommitted_values(bus, sink, 2)) == 600  # the first batch's write happened, and was aborted


def test_a_transactional_topic_sink_commits_every_task_or_shows_nothing(bus, topic_name):
    import ray.data

    bus.admin.create_topic(topic_name, partitions=2)
    values = [b"r%d" % i for i in range(300)]
    dataset = ray.data.from_arrow(pa.table({"value": values})).repartition(3)
    written = logbus.write_dataset(dataset, topic_name, bus=bus, transactional_id=f"{topic_name}-tx")
    assert written == 300
    assert committed_values(bus, topic_name, 2) == sorted(values)

    def explode(batch):
        if b"r299" in batch["value"].tolist():
            raise ValueError("a block fails")
        return batch

    failing = ray.data.from_arrow(pa.table({"value": values})).repartition(3).map_batches(explode, batch_format="pyarrow")
    with pytest.raises(Exception):  # noqa: B017 (Ray Data wraps the task's error)
        logbus.write_dataset(failing, topic_name, bus=bus, transactional_id=f"{topic_name}-tx2",
                             producer_options={"transaction_timeout_ms": 3_000})
    # The tasks that wrote left their transactions open; the coordinator aborts them at their timeout,
    # and read_committed readers never see them.
    wait_for(lambda: len(read_committed(bus, topic_name, 2)) == 300 and _stable(bus, topic_name, 2), timeout_s=120,
             message="the failed write's transactions aborted")
    assert committed_values(bus, topic_name, 2) == sorted(values)


def _stable(bus, topic, partitions) -> bool:
    consumer = logbus.Consumer(bus, isolation_level="read_committed", enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return consumer.end_offsets(tps) == {tp: p.high_watermark for tp, p in zip(tps, bus.admin.describe_topic(topic).partitions)}
    finally:
        consumer.close()
