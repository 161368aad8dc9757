"""The micro-batch loop: commits only after a batch succeeded; a failed batch runs again after a restart."""

import pyarrow as pa
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.api.dataset import read_dataset
from logbus.api.streaming import MicroBatchStream
from logbus.errors import InvalidConfigError, UnknownTopicError


class Boom(RuntimeError):
    pass


def test_failed_batch_is_not_committed_and_runs_again_after_restart(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=3)
    with logbus.Producer(bus) as producer:
        for i in range(3000):
            producer.send(topic_name, b"%d" % i, partition=i % 3)
    processed = []  # (batch_id, partition, offset)
    calls = []

    def run_batch(start, end, batch_id):
        calls.append(batch_id)
        table = pa.concat_tables(ray.get(read_dataset(topic_name, start=start, end=end, bus=bus).to_arrow_refs()))
        if len(calls) == 3:
            raise Boom("the sink is down")
        processed.extend((batch_id, p, o) for p, o in zip(table["partition"].to_pylist(), table["offset"].to_pylist()))

    stream = MicroBatchStream(topic_name, "etl", run_batch, max_offsets_per_trigger=700, trigger_interval_s=0, bus=bus, progress=None)
    with pytest.raises(Boom):
        stream.run(until_caught_up=True)
    tps = [TopicPartition(topic_name, p) for p in range(3)]
    committed = logbus.Consumer(bus, group_id="etl").committed(tps)
    done = {(p, o) for _, p, o in processed}
    # Committed offsets never pass a record that was not processed.
    for tp in tps:
        assert {(tp.partition, o) for o in range(committed[tp])} <= done
    assert sum(committed.values()) == len(processed) > 0 and calls == [0, 1, 2]

    restarted = MicroBatchStream(topic_name, "etl", run_batch, max_offsets_per_trigger=700, trigger_interval_s=0, bus=bus, progress=None)
    restarted.run(until_caught_up=True)
    assert calls[3] == 2  # the failed batch runs again, with its batch id
    assert {(p, o) for _, p, o in processed} == {(i % 3, i // 3) for i in range(3000)}
    assert len(processed) == 3000  # nothing was processed twice: the failed batch had written nothing
    progress = restarted.recent_progress[-1]
    assert progress.lag_after == 0 and sum(progress.end.values()) == 3000


def test_stream_in_background_stops_on_request(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    seen = []
    stream = MicroBatchStream(
        topic_name, "bg", lambda start, end, batch_id: seen.append(end[0] - start[0]), trigger_interval_s=0.1, bus=bus, progress=None
    ).start()
    with logbus.Producer(bus) as producer:
        for i in range(100):
            producer.send(topic_name, b"x")
    from tests.conftest import wait_for

    wait_for(lambda: sum(seen) == 100, timeout_s=60, message="the stream to take every record")
    stream.stop()
    assert stream.await_termination(timeout_s=30)
    assert not stream.is_active


def test_stream_bad_input(bus, topic_name):
    with pytest.raises(UnknownTopicError):
        MicroBatchStream("no-such-topic", "g", lambda *a: None, bus=bus)
    bus.admin.create_topic(topic_name)
    with pytest.raises(InvalidConfigError):
        MicroBatchStream(topic_name, "g", lambda *a: None, max_offsets_per_trigger=0, bus=bus)
    with pytest.raises(logbus.InvalidGroupIdError):
        MicroBatchStream(topic_name, "", lambda *a: None, bus=bus)
    stream = MicroBatchStream(topic_name, "g", lambda *a: None, trigger_interval_s=0, bus=bus, progress=None)
    # Bad run options fail the caller, not the stream's thread.
    for options, message in (
        (dict(max_batches=0), "max_batches"),
        (dict(max_batches=1.5), "max_batches"),
        (dict(until_caught_up="yes"), "until_caught_up"),
        (dict(batches=1), "options of run"),
    ):
        with pytest.raises(InvalidConfigError, match=message):
            stream.start(**options)
        assert not stream.is_active
    with pytest.raises(InvalidConfigError, match="max_batches"):
        stream.run(max_batches=-1)
    stream.start(until_caught_up=True)
    with pytest.raises(InvalidConfigError, match="timeout_s"):
        stream.await_termination(timeout_s=-1)
    assert stream.await_termination(timeout_s=60) and stream.exception is None


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(run_batch=None), "run_batch must be a callable"),
        (dict(progress="stderr"), "progress must be a callable"),
        (dict(trigger_interval_s=float("inf")), "trigger_interval_s"),
        (dict(trigger_interval_s=float("nan")), "trigger_interval_s"),
        (dict(trigger_interval_s=True), "trigger_interval_s"),
        (dict(max_offsets_per_trigger=2.0), "max_offsets_per_trigger"),
        (dict(starting_offsets=["earliest"]), "starting_offsets"),
        (dict(bus="localhost"), "bus must be a Bus"),
    ],
)
def test_stream_arguments_are_checked_before_connecting(arguments, message):
    arguments = {"run_batch": lambda *a: None, **arguments}
    with pytest.raises(InvalidConfigError, match=message):
        MicroBatchStream("events", "g", **arguments)
