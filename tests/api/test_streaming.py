"""The micro-batch loop: commits only after a batch succeeded; a failed batch runs again after a restart."""

import pyarrow as pa
import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st

import logbus
from logbus import TopicPartition
from logbus.api.dataset import read_dataset
from logbus.api.streaming import Checkpoint, MicroBatchStream, planned_metadata
from logbus.errors import InvalidConfigError, UnknownTopicError
from logbus.protocol.group_coordinator import OffsetAndMetadata


class Boom(RuntimeError):
    pass


# --- the checkpoint in the group's commits (pure) ---------------------------------------------------------

offset_values = st.integers(min_value=0, max_value=2**62)


@given(
    batch_id=st.integers(min_value=0, max_value=2**31),
    ranges=st.dictionaries(st.integers(0, 50), st.tuples(offset_values, offset_values), min_size=1, max_size=8),
    never_committed=st.sets(st.integers(51, 60), max_size=3),
)
def test_checkpoint_after_a_plan_and_after_its_commit(batch_id, ranges, never_committed):
    """A recorded plan (offsets at the start, ends in the metadata) is read back whole; its commit ends it."""
    ranges = {p: (min(a, b), max(a, b)) for p, (a, b) in ranges.items()}
    absent = {p: None for p in never_committed}
    planned = {p: OffsetAndMetadata(start, planned_metadata(batch_id, end)) for p, (start, end) in ranges.items()}
    checkpoint = Checkpoint.from_commits({**planned, **absent})
    assert checkpoint == Checkpoint({p: start for p, (start, _) in ranges.items()}, batch_id, {p: end for p, (_, end) in ranges.items()})

    committed = {p: OffsetAndMetadata(end, str(batch_id)) for p, (_, end) in ranges.items()}
    checkpoint = Checkpoint.from_commits({**committed, **absent})
    assert checkpoint == Checkpoint({p: end for p, (_, end) in ranges.items()}, batch_id + 1, None)


def test_checkpoint_edge_cases():
    assert Checkpoint.from_commits({}) == Checkpoint({}, 0, None)
    assert Checkpoint.from_commits({0: None, 1: None}) == Checkpoint({}, 0, None)
    # Metadata the stream did not write (offsets committed by hand, a consumer's) names no batch.
    foreign = ["", "hello", "{not json", '{"planned_batch": -1, "end": 3}', '{"planned_batch": 1}', "\u00b2", "[1]"]
    for metadata in foreign:
        assert Checkpoint.from_commits({0: OffsetAndMetadata(7, metadata)}) == Checkpoint({0: 7}, 0, None), metadata
    # Streams committed before plans were recorded: the batch id alone.
    assert Checkpoint.from_commits({0: OffsetAndMetadata(10, "4"), 1: OffsetAndMetadata(3, "4")}) == Checkpoint({0: 10, 1: 3}, 5, None)
    # A partition reset by hand after the plan was recorded takes no part in the planned batch.
    mixed = {0: OffsetAndMetadata(10, planned_metadata(5, 20)), 1: OffsetAndMetadata(0, "")}
    assert Checkpoint.from_commits(mixed) == Checkpoint({0: 10, 1: 0}, 5, {0: 20})
    # A plan older than a committed batch is over.
    stale = {0: OffsetAndMetadata(10, planned_metadata(5, 20)), 1: OffsetAndMetadata(30, "5")}
    assert Checkpoint.from_commits(stale) == Checkpoint({0: 10, 1: 30}, 6, None)


# --- the loop against real replicas -----------------------------------------------------------------------


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


def produce(bus, topic: str, values: range, partitions: int) -> None:
    with logbus.Producer(bus) as producer:
        for i in values:
            producer.send(topic, b"%d" % i, partition=i % partitions)


def test_batch_that_crashed_after_its_sink_wrote_reruns_its_planned_offsets(bus, topic_name):
    """A crash after the sink wrote and before the commit, with records arriving meanwhile.

    The restarted stream must run the failed batch over the offsets it was
    first planned with (as Spark's offset log does): a sink that skips a batch
    id it already wrote then ends with every record exactly once. Re-planned up
    to the new high watermark, the batch would cover records the sink never
    saw, and skip them.
    """
    bus.admin.create_topic(topic_name, partitions=2)
    produce(bus, topic_name, range(0, 600), 2)
    sink: dict[int, list[int]] = {}  # batch id -> values written; idempotent by batch id
    crash_after_writing = {1}
    calls = []

    def run_batch(start, end, batch_id):
        calls.append((batch_id, dict(start), dict(end)))
        if batch_id not in sink:
            table = pa.concat_tables(ray.get(read_dataset(topic_name, start=start, end=end, bus=bus).to_arrow_refs()))
            sink[batch_id] = [int(v) for v in table["value"].to_pylist()]
        if batch_id in crash_after_writing:
            crash_after_writing.discard(batch_id)
            raise Boom("crashed after the sink wrote, before the commit")

    first = MicroBatchStream(topic_name, "exactly-once", run_batch, trigger_interval_s=0, bus=bus, progress=None)
    first.run(until_caught_up=True)  # batch 0: the 600 records
    produce(bus, topic_name, range(600, 1000), 2)
    with pytest.raises(Boom):
        first.run(until_caught_up=True)  # batch 1: 400 records written, then the crash
    failed = calls[-1]
    assert failed[0] == 1 and sum(failed[2].values()) - sum(failed[1].values()) == 400

    produce(bus, topic_name, range(1000, 1500), 2)  # while the stream is down
    restarted = MicroBatchStream(topic_name, "exactly-once", run_batch, trigger_interval_s=0, bus=bus, progress=None)
    restarted.run(until_caught_up=True)
    assert calls[len(calls) - len(restarted.recent_progress)] == failed  # batch 1 again, over the same offsets
    assert [p.batch_id for p in restarted.recent_progress] == [1, 2]
    written = [v for batch in sink.values() for v in batch]
    assert sorted(written) == list(range(1500))  # every record exactly once
    committed = logbus.Consumer(bus, group_id="exactly-once").committed([TopicPartition(topic_name, p) for p in range(2)])
    assert sum(committed.values()) == 1500


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
