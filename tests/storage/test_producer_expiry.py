"""Producer ids expire (Kafka's producer.id.expiration.ms): when, what survives a reopen, and what a
producer the log no longer knows may write (KIP-360)."""

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from logbus.errors import DuplicateSequenceError, InvalidConfigError, OutOfOrderSequenceError, UnknownSequenceError
from logbus.protocol.kafka_gateway import error_code
from logbus.storage import LogConfig, PartitionLog, encode_batch
from logbus.storage.log_config import DAY_MS, INT_MAX
from logbus.storage.producer_state import ProducerStateTable
from logbus.storage.record_batch import BatchHeader
from tests.storage.conftest import FakeClock

EXPIRY_MS = 60_000


def batch(producer_id, sequence, clock, count=1, epoch=0, transactional=False):
    """``count`` records of ``producer_id`` from ``sequence`` on, stamped now (the timestamp expiry measures)."""
    return encode_batch(
        [b"p%d-s%d" % (producer_id, sequence + i) for i in range(count)],
        timestamps_ms=[clock.now_ms] * count,
        producer_id=producer_id,
        producer_epoch=epoch,
        base_sequence=sequence,
        transactional=transactional,
    )


def header(producer_id, base_sequence, count=1, epoch=0, max_timestamp_ms=1_000):
    return BatchHeader(-1, 0, 0, 2, 0, 0, count, max_timestamp_ms, max_timestamp_ms, producer_id, epoch, base_sequence)


# --- the config -------------------------------------------------------------------------------------------


def test_the_expiration_is_a_validated_topic_setting_of_a_day_by_default():
    assert LogConfig().producer_id_expiration_ms == DAY_MS == 86_400_000
    assert LogConfig.from_dict({"producer.id.expiration.ms": "1000"}).producer_id_expiration_ms == 1000
    for bad in (0, -1, INT_MAX + 1, 1.5, "soon", True):
        with pytest.raises(InvalidConfigError, match="producer.id.expiration.ms"):
            LogConfig.from_dict({"producer.id.expiration.ms": bad})


# --- the unknown-producer rule (KIP-360) -----------------------------------------------------------------------


def test_an_unknown_producer_starts_anywhere_but_a_known_one_keeps_its_rules():
    table = ProducerStateTable()
    assert table.check(header(1, 57)) is None  # unknown here: any first sequence starts its state
    table.update(header(1, 57, count=3))
    assert table.producers[1].last_sequence == 59
    assert table.check(header(1, 60)) is None
    with pytest.raises(OutOfOrderSequenceError):
        table.check(header(1, 62))  # known, with a gap
    with pytest.raises(OutOfOrderSequenceError):
        table.check(header(1, 5, epoch=1))  # a new epoch of a known producer starts at 0
    assert table.check(header(1, 0, epoch=1)) is None
    with pytest.raises(UnknownSequenceError):
        table.check(header(1, 0))  # below the sequence the table first knew it at: written or not, unknown


def test_a_batch_overtaken_by_its_unknown_producers_next_one_fails_and_is_never_reported_written():
    """A new producer's batch 0 fails retriably (or is slow), its batch 1 reaches the leader first and is
    taken (the producer is unknown here): batch 0 must then fail for good, never as a duplicate, which
    Kafka's clients count as written."""
    leader, follower = ProducerStateTable(), ProducerStateTable()
    assert leader.check(header(1, 5, count=5)) is None
    for table in (leader, follower):
        table.update(header(1, 5, count=5))
    for table in (leader, follower):  # a follower that took the same batches answers the same
        with pytest.raises(UnknownSequenceError) as failed:
            table.check(header(1, 0, count=5))
        assert error_code(failed.value) == ErrorCode.out_of_order_sequence_number
        assert table.check(header(1, 5, count=5)) == (-1, 1_000)  # the batch it took is a duplicate, as before
    # A producer known from sequence 0 still gets DuplicateSequenceError for a retry older than its kept batches.
    known = ProducerStateTable()
    for sequence in range(0, 60, 10):
        known.update(header(2, sequence, count=10))
    with pytest.raises(DuplicateSequenceError) as duplicate:
        known.check(header(2, 0, count=10))
    assert error_code(duplicate.value) == ErrorCode.duplicate_sequence_number


def test_a_batch_that_does_not_continue_starts_the_kept_batches_afresh():
    """A leader accepted it from a producer it did not know: a follower that still knew the producer
    keeps what the leader keeps, so either answers the same retry the same way."""
    follower = ProducerStateTable()
    follower.update(header(1, 0, count=5))
    follower.update(header(1, 40, count=2))  # what a leader that had forgotten producer 1 took
    assert list(follower.producers[1].batches) == [(40, 41, -1, 1_000)]
    with pytest.raises(UnknownSequenceError):
        follower.check(header(1, 0, count=5))
    assert follower.check(header(1, 40, count=2)) == (-1, 1_000)


# --- expiry through the log ------------------------------------------------------------------------------------


def test_the_table_stays_bounded_by_the_producers_active_within_the_window(tmp_path):
    """Producers come and go over many windows: the log rolls on time, and after each roll it knows only
    the producers that wrote within the expiration (plus the roll interval it waits for)."""
    clock = FakeClock()
    segment_ms = EXPIRY_MS // 4
    step_ms = 1_000
    log = PartitionLog(
        str(tmp_path / "t-0"),
        LogConfig.from_dict({"producer.id.expiration.ms": EXPIRY_MS, "segment.ms": segment_ms}),
        clock_ms=clock,
    )
    last_write: dict[int, int] = {}
    sequences: dict[int, int] = {}
    largest = 0
    for step in range(2_000):  # 2,000 s: 33 expiration windows
        clock.now_ms += step_ms
        # 3 producers write each second: two new ones, and one that wrote 30 s ago (alive within a window).
        for producer_id in (2 * step, 2 * step + 1, 2 * (step - 30)):
            if producer_id < 0:
                continue
            sequence = sequences.get(producer_id, 0)
            log.append(batch(producer_id, sequence, clock), leader_epoch=1)
            sequences[producer_id] = sequence + 1
            last_write[producer_id] = clock.now_ms
        known = log.producer_state.producers
        largest = max(largest, len(known))
        # Every producer known wrote within the expiration and the roll interval; every one that wrote
        # since the last roll is known.
        oldest_ms = clock.now_ms - EXPIRY_MS - segment_ms - step_ms
        assert all(last_write[p] > oldest_ms for p in known), "an expired producer is still known"
        assert all(p in known for p, t in last_write.items() if t >= clock.now_ms - step_ms)
    assert len(last_write) == 4_000
    # Each second an even and an odd producer start, and the even one writes again 30 s later; each is
    # known for at most the window after its last write (the expiration, a roll interval, a step): at
    # most that many seconds' odd producers, and 30 s more of even ones, of the 4,000.
    window_s = (EXPIRY_MS + segment_ms + step_ms) // step_ms
    assert largest <= 2 * window_s + 30 + 2
    log.close()


def test_a_transaction_keeps_its_producer_alive_until_its_marker(open_log, clock):
    log = open_log({"producer.id.expiration.ms": EXPIRY_MS})
    log.append(batch(1, 0, clock, transactional=True), leader_epoch=1)  # a transaction opens
    log.append(batch(2, 0, clock), leader_epoch=1)  # an idempotent producer, no transaction
    clock.now_ms += 10 * EXPIRY_MS
    log.roll()
    assert set(log.producer_state.producers) == {1}
    assert log.first_unstable_offset() == 0
    log.close()
    log = open_log({"producer.id.expiration.ms": EXPIRY_MS})  # the open expires too: not producer 1
    assert set(log.producer_state.producers) == {1} and log.first_unstable_offset() == 0
    log.append(batch(1, 1, clock, transactional=True), leader_epoch=1)
    log.append_marker(1, 0, True, 0, leader_epoch=1)  # the transaction ends now: its last write
    clock.now_ms += EXPIRY_MS - 1
    log.roll()
    assert set(log.producer_state.producers) == {1}
    clock.now_ms += 1
    log.append(encode_batch([b"no producer"]), leader_epoch=1)  # a roll needs a segment with a batch
    log.roll()
    assert log.producer_state.producers == {} and log.first_unstable_offset() is None


def test_expiry_survives_a_reopen_and_the_live_producer_keeps_its_sequence(open_log, clock):
    config = {"producer.id.expiration.ms": EXPIRY_MS}
    log = open_log(config)
    log.append(batch(1, 0, clock, count=2), leader_epoch=1)  # producer 1 goes quiet after this
    clock.now_ms += EXPIRY_MS // 2
    log.append(batch(2, 0, clock, count=2), leader_epoch=1)
    last_of_2 = batch(2, 2, clock, count=3)
    assert log.append(last_of_2, leader_epoch=1).base_offset == 4
    clock.now_ms += EXPIRY_MS // 2
    log.roll()  # producer 1's last write is EXPIRY_MS old now
    assert set(log.producer_state.producers) == {2}
    log.close()

    log = open_log(config)  # rebuilt from the headers, whose timestamps expire producer 1 again
    assert set(log.producer_state.producers) == {2}
    assert log.producer_state.producers[2].last_timestamp_ms == clock.now_ms - EXPIRY_MS // 2
    retry = log.append(last_of_2, leader_epoch=2)  # a retry of producer 2's last batch
    assert retry.duplicate and retry.base_offset == 4 and log.log_end_offset == 7
    with pytest.raises(OutOfOrderSequenceError):
        log.append(batch(2, 9, clock), leader_epoch=2)  # still known: a gap is refused
    # Producer 1 is unknown: its next batch continues a sequence the log forgot, and is taken.
    assert log.append(batch(1, 2, clock), leader_epoch=2).base_offset == 7
    log.close()

    # An open long after, with no roll in between, expires what the live log still knew.
    clock.now_ms += EXPIRY_MS
    assert open_log(config).producer_state.producers == {}


def test_a_log_that_never_rolls_expires_on_open(open_log, clock):
    log = open_log({"producer.id.expiration.ms": EXPIRY_MS})
    log.append(batch(1, 0, clock), leader_epoch=1)
    clock.now_ms += 2 * EXPIRY_MS
    assert set(log.producer_state.producers) == {1}  # no roll, no timer: still known
    log.close()
    assert open_log({"producer.id.expiration.ms": EXPIRY_MS}).producer_state.producers == {}


# --- the property ---------------------------------------------------------------------------------------------

step = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 3), st.integers(1, 3)),  # producer, records
    st.tuples(st.just("retry"), st.integers(0, 3), st.none()),  # its last acknowledged batch again
    st.tuples(st.just("txn"), st.just(9), st.integers(1, 2)),  # producer 9's transactional batch
    st.tuples(st.just("marker"), st.just(9), st.booleans()),  # producer 9's commit or abort
    st.tuples(st.just("wait"), st.integers(0, 2 * EXPIRY_MS), st.none()),
    st.tuples(st.just("roll"), st.none(), st.none()),
    st.tuples(st.just("reopen"), st.none(), st.none()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(step, min_size=5, max_size=40))
def test_property_the_log_knows_exactly_the_producers_expiry_has_not_taken(tmp_path_factory, steps):
    """A model of expiry: a producer is known from its write until a roll or an open finds its last write
    (batch or marker) EXPIRY_MS old with no transaction open. The log knows exactly the model's producers;
    a retry of a known producer's last batch is a duplicate; a forgotten one's next batch is taken
    wherever its sequence is (its producer carries on as it was)."""
    directory = str(tmp_path_factory.mktemp("expiry"))
    clock = FakeClock()
    config = LogConfig.from_dict({"producer.id.expiration.ms": EXPIRY_MS})
    log = PartitionLog(directory, config, clock_ms=clock)
    known: set[int] = set()
    last_write_ms: dict[int, int] = {}
    sequence: dict[int, int] = {}
    last_batch: dict[int, tuple[bytes, int]] = {}  # producer -> (its last acknowledged batch, offset)
    txn_open = False

    def expire():
        for p in list(known):
            if not (p == 9 and txn_open) and clock.now_ms - last_write_ms[p] >= EXPIRY_MS:
                known.discard(p)

    try:
        for kind, argument, option in steps:
            if kind in ("write", "txn"):
                p = argument
                data = batch(p, sequence.get(p, 0), clock, count=option, transactional=kind == "txn")
                result = log.append(data, leader_epoch=1)
                assert not result.duplicate
                sequence[p] = sequence.get(p, 0) + option
                last_batch[p] = (data, result.base_offset)
                known.add(p)
                last_write_ms[p] = clock.now_ms
                txn_open = txn_open or kind == "txn"
            elif kind == "retry":
                if argument not in last_batch:
                    continue
                data, offset = last_batch[argument]
                end = log.log_end_offset
                if argument in known:
                    again = log.append(data, leader_epoch=1)
                    assert again.duplicate and again.base_offset == offset and log.log_end_offset == end
            elif kind == "marker":
                log.append_marker(9, 0, option, 0, leader_epoch=1)
                known.add(9)
                last_write_ms[9] = clock.now_ms
                txn_open = False
            elif kind == "wait":
                clock.now_ms += argument
            elif kind == "roll":
                rolled = not log.active_segment.is_empty
                log.roll()
                if rolled:
                    expire()
            else:
                log.close()
                log = PartitionLog(directory, config, clock_ms=clock)
                expire()
            assert set(log.producer_state.producers) == known
            assert (log.first_unstable_offset() is not None) == txn_open
    finally:
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_records_stamped_in_the_past_keep_their_producer_while_the_log_is_open(open_log, clock):
    """A backfill on a CreateTime topic: the append time counts while the log is open, so a retry right
    after a roll is still a duplicate; an open has only the timestamps, and forgets the producer."""
    config = {"producer.id.expiration.ms": EXPIRY_MS}
    log = open_log(config)
    old = encode_batch([b"a", b"b"], timestamps_ms=[5, 6], producer_id=1, producer_epoch=0, base_sequence=0)
    assert log.append(old, leader_epoch=1).base_offset == 0
    log.roll()
    assert log.append(old, leader_epoch=1).duplicate
    clock.now_ms += EXPIRY_MS
    log.append(encode_batch([b"no producer"]), leader_epoch=1)
    log.roll()
    assert log.producer_state.producers == {}  # the expiration after its last append
    log.append(encode_batch([b"c"], timestamps_ms=[7], producer_id=1, producer_epoch=0, base_sequence=2), leader_epoch=1)
    log.close()
    assert open_log(config).producer_state.producers == {}  # stamped 7 ms after the epoch: long expired
