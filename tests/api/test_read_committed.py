"""Transactions on the log side, through real replica actors: transactional batches produced to the
leader, markers written with write_txn_markers (as the transaction coordinator writes them), and
consumers at both isolation levels (poll, poll_arrow, end_offsets, a long poll woken by a marker),
Ray Data's read_dataset, and the fencing of an older producer epoch by a marker."""

from __future__ import annotations

import threading
import time

import pytest

import logbus
from logbus import TopicPartition
from logbus.actors.remote import get
from logbus.errors import InvalidConfigError, ProducerFencedError
from logbus.protocol.messages import READ_COMMITTED, FetchRequest
from logbus.retry import retry_until
from logbus.storage import record_batch as rb
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)


def at_leader(bus, topic, call):
    """``get(call(leader))`` on the partition's leader, asked again as a client asks while the error is
    retriable (a new topic's leader takes writes only once its node's lease is held), for up to 60 s."""
    return retry_until(time.monotonic() + 60, f"a call to {topic}'s leader",
                       lambda _left: get(call(bus.topic_metadata(topic).leaders[0])),
                       on_retry=lambda _error: bus.topic_metadata(topic, refresh=True))


class TxnWriter:
    """A transactional producer's batches, sent straight to the partition leader (as the producer
    sends them once its coordinator registered the partition), and its markers, written as the
    coordinator writes them."""

    def __init__(self, bus, topic, producer_id, epoch=0):
        self.bus, self.topic, self.producer_id, self.epoch, self.sequence = bus, topic, producer_id, epoch, 0

    def send(self, values):
        batch = rb.encode_batch(
            values, [b"k"] * len(values), producer_id=self.producer_id, producer_epoch=self.epoch, base_sequence=self.sequence,
            transactional=True,
        )
        reply = at_leader(self.bus, self.topic, lambda leader: leader.produce.remote(batch, "all"))
        self.sequence += len(values)
        return reply.base_offset

    def end(self, commit, epoch=None):
        marker = (self.producer_id, self.epoch if epoch is None else epoch, 3, commit)
        (error,) = at_leader(self.bus, self.topic, lambda leader: leader.write_txn_markers.remote([marker], None))
        return error


def plain(bus, topic, values):
    batch = rb.encode_batch(values, [b"k"] * len(values))
    return at_leader(bus, topic, lambda leader: leader.produce.remote(batch, "all")).base_offset


def consume(bus, topic, isolation_level, until):
    """[(offset, value)] read by a consumer at ``isolation_level`` until its position reaches ``until``."""
    tp = TopicPartition(topic, 0)
    out = []
    with logbus.Consumer(bus, enable_auto_commit=False, isolation_level=isolation_level) as consumer:
        consumer.assign([tp])
        consumer.seek_to_beginning([tp])
        wait_for(
            lambda: out.extend((r.offset, r.value) for r in consumer.poll(200).get(tp, [])) or consumer.position(tp) >= until,
            timeout_s=60, message=f"the consumer's position to reach {until}",
        )
        assert consumer.position(tp) == until  # past the markers, not beyond
    return out


def test_read_committed_sees_committed_transactions_only_and_nobody_sees_markers(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    committed, aborted, open_txn = TxnWriter(bus, topic_name, 1001), TxnWriter(bus, topic_name, 1002), TxnWriter(bus, topic_name, 1003)
    committed.send([b"c0", b"c1"])  # 0-1
    aborted.send([b"a0"])  # 2
    plain(bus, topic_name, [b"p0"])  # 3
    committed.send([b"c2"])  # 4
    aborted.send([b"a1", b"a2"])  # 5-6
    assert committed.end(True) is None  # 7
    assert aborted.end(False) is None  # 8
    plain(bus, topic_name, [b"p1"])  # 9
    open_txn.send([b"o0"])  # 10: still open
    plain(bus, topic_name, [b"p2"])  # 11

    leader = bus.topic_metadata(topic_name).leaders[0]
    start, high_watermark, end = get(leader.offsets.remote())
    assert (start, high_watermark, end) == (0, 12, 12)
    assert get(leader.offsets.remote(READ_COMMITTED)) == (0, 10, 12)  # the LSO: the open transaction's first offset

    # read_committed: the committed transaction and plain records below the LSO; never aborted records.
    assert consume(bus, topic_name, "read_committed", 10) == [(0, b"c0"), (1, b"c1"), (3, b"p0"), (4, b"c2"), (9, b"p1")]
    # read_uncommitted: every data record below the high watermark, aborted ones too; never a marker.
    assert consume(bus, topic_name, "read_uncommitted", 12) == [
        (0, b"c0"), (1, b"c1"), (2, b"a0"), (3, b"p0"), (4, b"c2"), (5, b"a1"), (6, b"a2"), (9, b"p1"), (10, b"o0"), (11, b"p2"),
    ]

    # The fetch reply names the aborted transaction it overlaps; the reply ends at the LSO.
    meta, data = get(leader.fetch.remote(FetchRequest(0, 1 << 20, 0, isolation_level=READ_COMMITTED)))
    assert meta.next_offset == 10 and meta.last_stable_offset == 10 and meta.high_watermark == 12
    assert meta.aborted_transactions == ((1002, 2),)
    meta, _ = get(leader.fetch.remote(FetchRequest(0, 1 << 20, 0)))
    assert meta.next_offset == 12 and meta.aborted_transactions == ()

    with logbus.Consumer(bus, enable_auto_commit=False, isolation_level="read_committed") as consumer:
        consumer.assign([tp])
        assert consumer.end_offsets([tp]) == {tp: 10}
        consumer.seek_to_end([tp])
        assert consumer.position(tp) == 10
        # poll_arrow: the same filter, one Table.
        consumer.seek(tp, 0)
        tables = []
        wait_for(lambda: tables.append(consumer.poll_arrow(200)) or consumer.position(tp) >= 10, timeout_s=60, message="poll_arrow to the LSO")
        rows = [t for t in tables if t.num_rows]
        offsets = [o for t in rows for o in t.column("offset").to_pylist()]
        values = [v for t in rows for v in t.column("value").to_pylist()]
        assert offsets == [0, 1, 3, 4, 9] and values == [b"c0", b"c1", b"p0", b"c2", b"p1"]

        # A read_committed consumer waiting at the LSO gets nothing past it, and its fetch waiting
        # there is answered once the open transaction commits.
        assert consumer.poll(300) == {} and consumer.position(tp) == 10
        got, ended = [], []
        committer = threading.Thread(target=lambda: ended.append(open_txn.end(True)), daemon=True)  # its marker: offset 12
        committer.start()
        wait_for(
            lambda: got.extend((r.offset, r.value) for r in consumer.poll(200).get(tp, [])) or len(got) >= 2,
            timeout_s=60, message="the committed transaction's records",
        )
        committer.join(60)
        assert ended == [None] and got == [(10, b"o0"), (11, b"p2")]
        assert consumer.end_offsets([tp]) == {tp: 13}
    assert get(leader.offsets.remote(READ_COMMITTED)) == (0, 13, 13)


def test_markers_fence_an_older_epoch_and_a_marker_with_nothing_to_end_is_harmless(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    zombie = TxnWriter(bus, topic_name, 2001, epoch=0)
    zombie.send([b"z0"])  # 0
    # The coordinator fenced the producer (epoch 1) and aborts its transaction with the new epoch.
    assert zombie.end(False, epoch=1) is None  # 1
    with pytest.raises(ProducerFencedError):
        zombie.send([b"z1"])  # the old epoch is refused from now on
    # A marker of the older epoch is refused, and says so without failing the call.
    assert isinstance(zombie.end(True, epoch=0), ProducerFencedError)
    # A marker for a producer with no transaction here is written and ends nothing.
    assert TxnWriter(bus, topic_name, 2002).end(True) is None  # 2
    successor = TxnWriter(bus, topic_name, 2001, epoch=1)
    successor.send([b"s0"])  # 3: the new epoch starts at sequence 0
    assert successor.end(True) is None  # 4
    assert consume(bus, topic_name, "read_committed", 5) == [(3, b"s0")]
    leader = bus.topic_metadata(topic_name).leaders[0]
    meta, _ = get(leader.fetch.remote(FetchRequest(0, 1 << 20, 0, isolation_level=READ_COMMITTED)))
    assert meta.aborted_transactions == ((2001, 0),)


def test_read_dataset_at_read_committed_drops_aborted_records_and_stops_at_the_lso(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    good, bad = TxnWriter(bus, topic_name, 3001), TxnWriter(bus, topic_name, 3002)
    good.send([b"g0", b"g1"])  # 0-1
    bad.send([b"b0"])  # 2
    plain(bus, topic_name, [b"p0"])  # 3
    good.end(True)  # 4
    bad.end(False)  # 5
    TxnWriter(bus, topic_name, 3003).send([b"o0"])  # 6: open
    plain(bus, topic_name, [b"p1"])  # 7
    committed = logbus.read_dataset(topic_name, bus=bus, isolation_level="read_committed").take_all()
    assert sorted((r["offset"], r["value"]) for r in committed) == [(0, b"g0"), (1, b"g1"), (3, b"p0")]
    everything = logbus.read_dataset(topic_name, bus=bus).take_all()
    assert sorted((r["offset"], r["value"]) for r in everything) == [(0, b"g0"), (1, b"g1"), (2, b"b0"), (3, b"p0"), (6, b"o0"), (7, b"p1")]
    with pytest.raises(InvalidConfigError, match="isolation_level"):
        logbus.read_dataset(topic_name, bus=bus, isolation_level="committed")
