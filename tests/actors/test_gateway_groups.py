"""Kafka's group protocol, __consumer_offsets and administration through the gateway, with real Kafka clients.

Consumer groups of Kafka clients follow Kafka's classic protocol: the
clients' own assignors (made-up protocol names carrying user data, here)
lead, and every member gets what its leader gave it. A group with a logbus
Consumer in it is assigned by the coordinator. ``__consumer_offsets`` is
read through the gateway and decoded with Kafka's record schemas; the
admin APIs are driven by confluent-kafka's AdminClient and kafka-python's
KafkaAdminClient.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import struct
import threading
import time

import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.actors.controller import CONTROLLER_NAME
from logbus.actors.gateway import start_gateways
from logbus.protocol import kafka_gateway as kg
from logbus.protocol.group_coordinator import OFFSETS_TOPIC, offset_commit_key
from tests.actors.test_gateway import Raw
from tests.conftest import kafka_python_consumer, leave_group, wait_for

pytestmark = pytest.mark.timeout(600)

PROTOCOL = "logbus-test-tagged"  # an assignor logbus does not have
RECORDS = 3000
PARTITIONS = 6


@pytest.fixture(autouse=True)
def kafka_client_steps(caplog):
    """kafka-python's group and metadata steps at DEBUG, shown in a failing test's report (only there)."""
    caplog.set_level(logging.DEBUG, logger="kafka.coordinator")
    caplog.set_level(logging.DEBUG, logger="kafka.cluster")


@pytest.fixture
def gateway(bus):
    gw = bus.start_gateway(port=0)
    yield gw
    gw.stop()


def produce_keys(bus, topic: str, start: int, count: int) -> None:
    with logbus.Producer(bus, acks="all") as producer:
        for i in range(start, start + count):
            producer.send(topic, b"v%d" % i, key=b"k%d" % i)


# --- kafka-python and aiokafka members with an assignor of their own ---------------------------------------


def kafka_python_assignor(tag: bytes):
    """A kafka-python assignor named PROTOCOL: its metadata carries ``tag`` as user data; as leader it deals
    partitions round robin and gives each member the user data "for:<member's tag> by:<leader's tag>"."""
    from kafka.coordinator.assignors.abstract import AbstractPartitionAssignor, ConsumerProtocolAssignment, ConsumerProtocolSubscription

    received: list = []

    class TaggedAssignor(AbstractPartitionAssignor):
        name = PROTOCOL
        version = 0

        @classmethod
        def metadata(cls, topics):
            return ConsumerProtocolSubscription(0, sorted(topics), tag)

        @classmethod
        def assign(cls, cluster, members):
            topics = sorted({t for m in members for t in m.metadata.topics})
            partitions = [(t, p) for t in topics for p in sorted(cluster.partitions_for_topic(t) or ())]
            order = sorted(members, key=lambda m: m.member_id)
            dealt = {m.member_id: collections.defaultdict(list) for m in order}
            for i, (t, p) in enumerate(partitions):
                dealt[order[i % len(order)].member_id][t].append(p)
            return {m.member_id: ConsumerProtocolAssignment(0, sorted(dealt[m.member_id].items()), b"for:" + m.metadata.user_data + b" by:" + tag)
                    for m in order}

        @classmethod
        def on_assignment(cls, assignment, generation):
            received.append((generation, assignment.user_data, sorted((tp.topic, tp.partition) for tp in assignment.partitions())))

    return TaggedAssignor, received


class KafkaPythonMember(threading.Thread):
    """A kafka-python consumer in its own thread: polls, records what it reads, commits after each batch."""

    def __init__(self, servers: str, topic: str, group: str, tag: bytes, also=(), **options) -> None:
        super().__init__(daemon=True)
        self.tag = tag
        self.assignor, self.received = kafka_python_assignor(tag)
        # Its own assignor first, then ``also`` (as clients' defaults list range, say).
        self.consumer = kafka_python_consumer([topic], bootstrap_servers=servers, group_id=group, client_id=tag.decode(), enable_auto_commit=False,
                                              auto_offset_reset="earliest", session_timeout_ms=10_000, heartbeat_interval_ms=300,
                                              partition_assignment_strategy=[self.assignor, *also], **options)
        self.seen: list = []
        self.errors: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.consumer.poll(timeout_ms=200)
                for records in batch.values():
                    self.seen.extend((r.partition, r.offset, r.key) for r in records)
                if batch:
                    self.consumer.commit()  # before the next poll, where a rebalance may take these partitions
        except Exception as error:  # noqa: BLE001 (reported by the test)
            self.errors.append(error)
        finally:
            self.consumer.close()  # LeaveGroup: the group rebalances at once

    def last(self):
        return self.received[-1] if self.received else None


def keys_read(members) -> collections.Counter:
    return collections.Counter(key for m in members for _, _, key in m.seen)


def check_generation(members, protocol_leader_tags=None):
    """Every member's latest assignment is of one generation, disjoint, covering every partition, with the
    user data its leader wrote for it. A member whose client failed fails the test at once, with its error."""
    for m in members:
        if getattr(m, "errors", None):
            raise AssertionError(f"member {m.tag!r} stopped on {m.errors[0]!r} after the assignments {m.received}") from m.errors[0]
    lasts = [m.last() for m in members]
    if any(last is None for last in lasts) or len({g for g, _, _ in lasts}) != 1:
        return False
    partitions = [tp for _, _, tps in lasts for tp in tps]
    if len(partitions) != len(set(partitions)) or len(partitions) != PARTITIONS:
        return False
    leaders = {data.split(b" by:")[1] for _, data, _ in lasts}
    return len(leaders) == 1 and all(data.startswith(b"for:" + m.tag + b" by:") for m, (_, data, _) in zip(members, lasts))


def test_kafka_python_members_with_an_assignor_of_their_own_form_a_group_of_three_through_the_gateway(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    produce_keys(bus, topic_name, 0, RECORDS // 2)
    group = "kafka-python-tagged"
    a = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, b"a")
    members = [a]
    a.start()
    try:
        wait_for(lambda: check_generation([a]), timeout_s=120, message="a alone, leading")
        wait_for(lambda: len(a.seen) > 0, timeout_s=60, message="a reading")
        # Two more join: the group rebalances each time, and a's assignor (or the new leader's) deals.
        for tag in (b"b", b"c"):
            member = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, tag)
            members.append(member)
            member.start()
            wait_for(lambda: check_generation(members), timeout_s=120, message=f"a generation of {len(members)}")
        described = bus.admin.describe_group(group)
        assert described["protocol"] == PROTOCOL and len(described["members"]) == 3
        assert sorted(tp[1] for m in described["members"] for tp in m["assignment"]) == list(range(PARTITIONS))
        # One leaves: the other two take its partitions.
        leaving = members.pop()
        leaving.stop.set()
        leaving.join(60)
        produce_keys(bus, topic_name, RECORDS // 2, RECORDS // 2)
        wait_for(lambda: check_generation(members), timeout_s=120, message="a generation of two")
        everyone = members + [leaving]
        wait_for(lambda: len(keys_read(everyone)) == RECORDS, timeout_s=180, message="every record read")
        counts = keys_read(everyone)
        assert sorted(counts) == sorted(b"k%d" % i for i in range(RECORDS))
        assert set(counts.values()) == {1}, "a record was read twice"
        assert not any(m.errors for m in everyone), [m.errors for m in everyone]
    finally:
        for m in members:
            m.stop.set()
        for m in members:
            m.join(60)


def aiokafka_assignor(tag: bytes):
    """An aiokafka assignor named PROTOCOL whose subscription's version field says 4 while its body is laid
    out as version 0 (aiokafka writes version 0's fields whatever the version says)."""
    from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

    received: list = []

    class TaggedAssignor(AbstractPartitionAssignor):
        name = PROTOCOL
        version = 4

        @classmethod
        def metadata(cls, topics):
            return ConsumerProtocolMemberMetadata(4, sorted(topics), tag)

        @classmethod
        def assign(cls, cluster, members):
            topics = sorted({t for m in members.values() for t in m.subscription})
            partitions = [(t, p) for t in topics for p in sorted(cluster.partitions_for_topic(t) or ())]
            order = sorted(members)
            dealt = {m: collections.defaultdict(list) for m in order}
            for i, (t, p) in enumerate(partitions):
                dealt[order[i % len(order)]][t].append(p)
            return {m: ConsumerProtocolMemberAssignment(0, sorted(dealt[m].items()), b"for:" + members[m].user_data + b" by:" + tag)
                    for m in order}

        @classmethod
        def on_assignment(cls, assignment):
            received.append((0, assignment.user_data, sorted((tp.topic, tp.partition) for tp in assignment.partitions())))

    return TaggedAssignor, received


def test_aiokafka_members_whose_subscriptions_say_a_version_newer_than_their_layout_form_a_group_of_three(bus, gateway, topic_name):
    from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    produce_keys(bus, topic_name, 0, RECORDS // 2)
    group = "aiokafka-tagged"

    class Member:
        def __init__(self, tag: bytes) -> None:
            self.tag = tag
            self.assignor, self.received = aiokafka_assignor(tag)
            self.seen: list = []
            self.consumer = None
            self.task = None

        def last(self):
            return self.received[-1] if self.received else None

    class CommitOnRevoke(ConsumerRebalanceListener):
        """Commits what was handed out before the partitions go (records are recorded as soon as getmany
        returns them), so the next owner starts after them."""

        def __init__(self, member: Member) -> None:
            self.member = member

        async def on_partitions_revoked(self, revoked):
            if revoked:
                await self.member.consumer.commit()

        async def on_partitions_assigned(self, assigned):
            pass

    async def run(member: Member) -> None:
        member.consumer = AIOKafkaConsumer(bootstrap_servers=gateway.bootstrap_servers, group_id=group, client_id=member.tag.decode(),
                                           enable_auto_commit=False, auto_offset_reset="earliest", session_timeout_ms=10_000,
                                           heartbeat_interval_ms=300, partition_assignment_strategy=(member.assignor,))
        await member.consumer.start()
        member.consumer.subscribe([topic_name], listener=CommitOnRevoke(member))
        try:
            while True:
                batch = await member.consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    member.seen.extend((r.partition, r.offset, r.key) for r in records)
                if batch:
                    try:
                        await member.consumer.commit()
                    except Exception:  # noqa: BLE001 (a rebalance began: the listener committed these)
                        pass
        finally:
            await member.consumer.stop()

    async def until(condition, what: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def scenario() -> list:
        members = [Member(b"a")]
        members[0].task = asyncio.ensure_future(run(members[0]))
        everyone = list(members)
        try:
            await until(lambda: check_generation(members), "a alone, leading")
            for tag in (b"b", b"c"):
                member = Member(tag)
                member.task = asyncio.ensure_future(run(member))
                members.append(member)
                everyone.append(member)
                await until(lambda: check_generation(members), f"a generation of {len(members)}")
            described = bus.admin.describe_group(group)
            assert described["protocol"] == PROTOCOL and len(described["members"]) == 3
            leaving = members.pop()
            leaving.task.cancel()
            await asyncio.gather(leaving.task, return_exceptions=True)
            await asyncio.to_thread(produce_keys, bus, topic_name, RECORDS // 2, RECORDS // 2)
            await until(lambda: check_generation(members), "a generation of two")
            await until(lambda: len(keys_read(everyone)) == RECORDS, "every record read", 180)
        finally:
            for m in members:
                m.task.cancel()
            await asyncio.gather(*(m.task for m in members), return_exceptions=True)
        return everyone

    everyone = asyncio.run(scenario())
    counts = keys_read(everyone)
    assert sorted(counts) == sorted(b"k%d" % i for i in range(RECORDS))
    assert set(counts.values()) == {1}, "a record was read twice"


def test_librdkafka_members_rebalance_cooperatively_with_their_own_leader(bus, gateway, topic_name):
    """confluent-kafka's cooperative-sticky assignor leads (Kafka's cooperative protocol is the clients'):
    a member that joins takes partitions from the others without their giving up the rest, in two rounds,
    and every record is read once."""
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    produce_keys(bus, topic_name, 0, RECORDS // 2)
    group = "cooperative"

    class Member(threading.Thread):
        def __init__(self, name: str) -> None:
            super().__init__(daemon=True)
            self.name_ = name
            self.events: list = []  # ("assign" | "revoke", partitions)
            self.owned: set = set()
            self.seen: list = []
            self.stop = threading.Event()

        def run(self) -> None:
            consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": group, "client.id": self.name_,
                                    "partition.assignment.strategy": "cooperative-sticky", "auto.offset.reset": "earliest",
                                    "enable.auto.commit": False, "session.timeout.ms": 10_000, "heartbeat.interval.ms": 300})

            def on_assign(c, partitions):
                self.events.append(("assign", sorted(p.partition for p in partitions)))
                self.owned |= {p.partition for p in partitions}

            def on_revoke(c, partitions):
                self.events.append(("revoke", sorted(p.partition for p in partitions)))
                if partitions:
                    try:
                        c.commit(asynchronous=False)
                    except ck.KafkaException:
                        pass  # nothing consumed yet
                self.owned -= {p.partition for p in partitions}

            consumer.subscribe([topic_name], on_assign=on_assign, on_revoke=on_revoke)
            try:
                while not self.stop.is_set():
                    messages = consumer.consume(500, 0.2)
                    for m in messages:
                        if m.error() is None:
                            self.seen.append((m.partition(), m.offset(), m.key()))
                    if any(m.error() is None for m in messages):
                        try:
                            consumer.commit(asynchronous=False)
                        except ck.KafkaException:
                            # A generation formed meanwhile (ILLEGAL_GENERATION, as a Kafka broker answers
                            # it): the next commit, or on_revoke's for a partition that moves, covers these.
                            pass
            finally:
                consumer.close()

    members = [Member("a")]
    members[0].start()
    everyone = list(members)
    try:
        wait_for(lambda: members[0].owned == set(range(PARTITIONS)), timeout_s=120, message="a owning everything")
        for name in ("b", "c"):
            member = Member(name)
            members.append(member)
            everyone.append(member)
            member.start()
            wait_for(lambda: all(m.owned for m in members) and sum(len(m.owned) for m in members) == PARTITIONS
                     and set().union(*(m.owned for m in members)) == set(range(PARTITIONS)), timeout_s=120,
                     message=f"{len(members)} members sharing the partitions")
        # Cooperative: a never revoked everything at once (only what moved to b, then to c), and every
        # assignment after its first added partitions to what it kept.
        revoked = [ps for kind, ps in members[0].events if kind == "revoke"]
        assert revoked and all(len(ps) < PARTITIONS for ps in revoked)
        assert bus.admin.describe_group(group)["protocol"] == "cooperative-sticky"
        produce_keys(bus, topic_name, RECORDS // 2, RECORDS // 2)
        wait_for(lambda: len(keys_read(everyone)) == RECORDS, timeout_s=180, message="every record read")
        counts = keys_read(everyone)
        assert set(counts.values()) == {1}, "a record was read twice"
    finally:
        for m in members:
            m.stop.set()
        for m in members:
            m.join(60)


def test_a_static_member_that_restarts_takes_its_place_without_a_rebalance(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    group = "static"
    a = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, b"a", group_instance_id="host-a")
    b = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, b"b", group_instance_id="host-b")
    a.start()
    wait_for(lambda: check_generation([a]), timeout_s=120, message="a alone")
    b.start()
    restarted = None
    try:
        wait_for(lambda: check_generation([a, b]), timeout_s=120, message="a and b")
        before = bus.admin.describe_group(group)
        b_assignments = len(b.received)
        # a's process ends without leaving (a static member does not), and a new one takes its place.
        a.stop.set()
        a.join(60)
        restarted = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, b"a", group_instance_id="host-a")
        restarted.start()
        wait_for(lambda: restarted.last() is not None, timeout_s=60, message="the restarted member's assignment")
        after = bus.admin.describe_group(group)
        assert after["generation"] == before["generation"] and after["state"] == "Stable"  # no rebalance
        assert restarted.last()[2] == a.last()[2] and restarted.last()[1] == a.last()[1]  # its place, as its leader gave it
        assert len(b.received) == b_assignments  # b never rebalanced
        old_ids = {m["member_id"] for m in before["members"] if m["group_instance_id"] == "host-a"}
        new_ids = {m["member_id"] for m in after["members"] if m["group_instance_id"] == "host-a"}
        assert old_ids and new_ids and old_ids.isdisjoint(new_ids)  # the old member id is fenced
    finally:
        for m in (a, b, restarted):
            if m is not None:
                m.stop.set()
        for m in (a, b, restarted):
            if m is not None and m.is_alive():
                m.join(60)
        leave_group(bus, group)  # static members stay after their consumers close


def test_kip_848_consumers_are_assigned_by_the_coordinator(bus, gateway, topic_name):
    """confluent-kafka's consumers with group.protocol=consumer (ConsumerGroupHeartbeat): the coordinator
    assigns; a member that joins takes partitions from the other without its giving up the rest, one that
    leaves gives its partitions back, and every record is read once."""
    import confluent_kafka as ck

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    produce_keys(bus, topic_name, 0, RECORDS // 2)
    group = "kip-848"

    class Member(threading.Thread):
        def __init__(self, name: str) -> None:
            super().__init__(daemon=True)
            self.events: list = []
            self.owned: set = set()
            self.seen: list = []
            self.errors: list = []
            self.stop = threading.Event()
            self.consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": group, "client.id": name,
                                         "group.protocol": "consumer", "auto.offset.reset": "earliest", "enable.auto.commit": False})

        def run(self) -> None:
            def on_assign(c, partitions):
                self.events.append(("assign", sorted(p.partition for p in partitions)))
                self.owned |= {p.partition for p in partitions}

            def on_revoke(c, partitions):
                self.events.append(("revoke", sorted(p.partition for p in partitions)))
                if partitions:
                    try:
                        c.commit(asynchronous=False)
                    except ck.KafkaException as error:
                        if error.args[0].code() != ck.KafkaError._NO_OFFSET:  # nothing read since the last commit
                            self.errors.append(("on_revoke", error))
                self.owned -= {p.partition for p in partitions}

            self.consumer.subscribe([topic_name], on_assign=on_assign, on_revoke=on_revoke)
            try:
                while not self.stop.is_set():
                    messages = self.consumer.consume(500, 0.2)
                    for m in messages:
                        if m.error() is None:
                            self.seen.append((m.partition(), m.offset(), m.key()))
                        elif not m.error().retriable():
                            self.errors.append(m.error())
                    if any(m.error() is None for m in messages):
                        try:
                            self.consumer.commit(asynchronous=False)
                        except ck.KafkaException as error:
                            self.errors.append(error)
            finally:
                self.consumer.close()

    a, b = Member("a"), Member("b")
    a.start()
    try:
        wait_for(lambda: a.owned == set(range(PARTITIONS)), timeout_s=120, message="a owning everything")
        b.start()
        wait_for(lambda: a.owned and b.owned and a.owned | b.owned == set(range(PARTITIONS)) and not a.owned & b.owned,
                 timeout_s=120, message="a and b sharing the partitions")
        assert all(len(ps) < PARTITIONS for kind, ps in a.events if kind == "revoke")  # incremental
        described = bus.admin.describe_group(group)
        assert described["protocol"] == "cooperative-sticky" and len(described["members"]) == 2
        b.stop.set()
        b.join(60)
        produce_keys(bus, topic_name, RECORDS // 2, RECORDS // 2)
        wait_for(lambda: a.owned == set(range(PARTITIONS)), timeout_s=120, message="a owning everything again")
        wait_for(lambda: len(keys_read([a, b])) == RECORDS, timeout_s=180, message="every record read")
        counts = keys_read([a, b])
        assert not [k for k, n in counts.items() if n > 1], "a record was read twice"
        assert not a.errors and not b.errors, (a.errors, b.errors)
    finally:
        for m in (a, b):
            m.stop.set()
        for m in (a, b):
            if m.is_alive():
                m.join(60)


# --- consumers with no group -------------------------------------------------------------------------------


def test_the_quickstarts_of_kafka_python_and_aiokafka_read_every_partition_with_no_group(bus, gateway, topic_name):
    """kafka-python's and aiokafka's quickstarts as their documentation writes them (a topic, the servers,
    auto_offset_reset, and no group_id): each reads every record of every partition once, with no group."""
    from aiokafka import AIOKafkaConsumer
    from kafka import KafkaConsumer

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    produce_keys(bus, topic_name, 0, RECORDS)
    groups_before = {g for g, *_ in bus.admin.list_groups()}

    consumer = KafkaConsumer(topic_name, bootstrap_servers=gateway.bootstrap_servers, auto_offset_reset="earliest",
                             consumer_timeout_ms=30_000)
    python_read = []
    for message in consumer:  # ends after consumer_timeout_ms with nothing new
        python_read.append(message.key)
        if len(python_read) == RECORDS:
            break
    assert consumer.assignment() == {_kafka_python_partition(topic_name, p) for p in range(PARTITIONS)}
    consumer.close()

    async def aiokafka_reads() -> list:
        consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=gateway.bootstrap_servers, auto_offset_reset="earliest")
        await consumer.start()
        read = []
        try:
            async with asyncio.timeout(120):
                async for message in consumer:
                    read.append(message.key)
                    if len(read) == RECORDS:
                        break
        finally:
            await consumer.stop()
        return read

    aio_read = asyncio.run(aiokafka_reads())
    everything = collections.Counter(b"k%d" % i for i in range(RECORDS))
    assert collections.Counter(python_read) == everything
    assert collections.Counter(aio_read) == everything
    assert not {g for g, *_ in bus.admin.list_groups()} - groups_before  # no group was made


def _kafka_python_partition(topic: str, partition: int):
    from kafka import TopicPartition as KpPartition

    return KpPartition(topic, partition)


# --- protocols in common, and the subscription's bytes ------------------------------------------------------


def join_values(group: str, protocols: list, member_id: str = "") -> dict:
    return {"group_id": group, "session_timeout": 10_000, "rebalance_timeout": 10_000, "member_id": member_id, "group_instance_id": None,
            "protocol_type": "consumer", "protocols": protocols, "reason": None}


def test_join_group_with_no_protocol_in_common_is_answered_inconsistent_group_protocol_in_every_version(bus, gateway, topic_name):
    from kafka import KafkaConsumer
    from kafka.errors import InconsistentGroupProtocolError

    bus.admin.create_topic(topic_name, partitions=1)
    group = "no-common-protocol"
    first = Raw(gateway)
    joined = first.call(kg.JOIN_GROUP, 7, join_values(group, [{"name": "ours", "metadata": kg.encode_subscription([topic_name])}]))
    assert joined.error_code == kg.ErrorCode.none and joined.leader == joined.member_id
    other = Raw(gateway)
    try:
        for version in range(0, 8):
            refused = other.call(kg.JOIN_GROUP, version, join_values(group, [{"name": "theirs", "metadata": b"\x00\x00anything"}]))
            assert refused.error_code == kg.ErrorCode.inconsistent_group_protocol
            assert refused.protocol_name == ("" if version < 7 else None)
        # The connection is still served after every refusal (it was closed before, and the client reconnected in a loop).
        assert other.call(kg.API_VERSIONS, 3, {"client_software_name": "t", "client_software_version": "1"}).error_code == kg.ErrorCode.none
        # A real client gets the error, and gives up (a fatal error for it), rather than reconnecting forever.
        consumer = KafkaConsumer(topic_name, bootstrap_servers=gateway.bootstrap_servers, group_id=group,
                                 partition_assignment_strategy=[kafka_python_assignor(b"x")[0]], session_timeout_ms=10_000,
                                 heartbeat_interval_ms=1_000)
        try:
            with pytest.raises(InconsistentGroupProtocolError):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    consumer.poll(timeout_ms=500)
        finally:
            consumer.close()
        [stats] = gateway.stats()
        assert stats["refused_frames"] == 0  # no connection was closed over it
    finally:
        first.close()
        other.close()
        leave_group(bus, group)  # the first raw client's member stays until its session times out


def test_a_subscription_whose_version_is_newer_than_its_layout_is_read_when_the_coordinator_assigns(bus, gateway, topic_name):
    # A Kafka member and a logbus Consumer in one group: the coordinator assigns, so it reads the Kafka
    # member's topics from its subscription, which says version 4 but is laid out as version 0.
    bus.admin.create_topic(topic_name, partitions=4)
    group = "newer-subscription"
    metadata = struct.pack(">h", 4) + struct.pack(">i", 1) + struct.pack(">h", len(topic_name)) + topic_name.encode() + struct.pack(">i", 3) + b"abc"
    raw = Raw(gateway)
    native = logbus.Consumer(bus, topic_name, group_id=group, enable_auto_commit=False, session_timeout_ms=10_000)

    def answer(api_key: int, version: int, values: dict):
        """Send a request that the coordinator holds until the logbus member rejoins (which it does in poll())."""
        correlation = raw.send(api_key, version, values)
        reply: list = []
        receiver = threading.Thread(target=lambda: reply.append(raw.receive(api_key, version, correlation)), daemon=True)
        receiver.start()
        wait_for(lambda: native.poll(timeout_ms=50) is not None and not receiver.is_alive(), timeout_s=60, message="the reply")
        return reply[0]

    try:
        wait_for(lambda: native.poll(timeout_ms=100) is not None and len(native.assignment()) == 4, timeout_s=60, message="native alone")
        joined = answer(kg.JOIN_GROUP, 5, join_values(group, [{"name": "range", "metadata": metadata}]))
        assert joined.error_code == kg.ErrorCode.none, joined
        assert joined.leader == kg.COORDINATOR_LEADER and joined.members == ()  # a logbus member is in the group: no Kafka member leads
        synced = answer(kg.SYNC_GROUP, 5, {"group_id": group, "generation_id": joined.generation_id, "member_id": joined.member_id,
                                           "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range",
                                           "assignments": []})
        assert synced.error_code == kg.ErrorCode.none, synced
        mine = kg.parse_assignment(synced.assignment)
        assert len(mine) == 2 and {tp.topic for tp in mine} == {topic_name}
        wait_for(lambda: native.poll(timeout_ms=50) is not None and len(native.assignment()) == 2, timeout_s=60, message="native's half")
        assert set(native.assignment()).isdisjoint(mine)
    finally:
        native.close()
        raw.close()
        leave_group(bus, group)  # the raw client's member stays until its session times out


def test_a_group_with_a_logbus_consumer_is_assigned_by_the_coordinator_and_without_one_by_a_kafka_leader(bus, gateway, topic_name):
    from kafka.coordinator.assignors.range import RangePartitionAssignor

    bus.admin.create_topic(topic_name, partitions=PARTITIONS)
    group = "mixed-rule"
    # The Kafka consumer lists its own assignor first and range second.
    kafka_member = KafkaPythonMember(gateway.bootstrap_servers, topic_name, group, b"k", also=[RangePartitionAssignor])
    kafka_member.start()
    native = None
    try:
        wait_for(lambda: check_generation([kafka_member]) and bus.admin.describe_group(group)["protocol"] == PROTOCOL, timeout_s=60,
                 message="the Kafka member alone, leading with its own assignor")
        native = logbus.Consumer(bus, topic_name, group_id=group, enable_auto_commit=False, session_timeout_ms=10_000)

        def both_assigned():
            native.poll(timeout_ms=100)
            d = bus.admin.describe_group(group)
            return d["state"] == "Stable" and len(d["members"]) == 2 and all(m["assignment"] for m in d["members"]) and d

        described = wait_for(both_assigned, timeout_s=120, message="the mixed group assigned")
        assert described["protocol"] == "range"  # the one both have: the coordinator assigns with it
        assert sorted(tp[1] for m in described["members"] for tp in m["assignment"]) == list(range(PARTITIONS))
        native.close()
        native = None
        generation = bus.admin.describe_group(group)["generation"]
        wait_for(lambda: bus.admin.describe_group(group)["protocol"] == PROTOCOL and check_generation([kafka_member])
                 and kafka_member.last()[0] > generation, timeout_s=120, message="the classic protocol again")
        assert kafka_member.last()[1] == b"for:k by:k"
    finally:
        if native is not None:
            native.close()
        kafka_member.stop.set()
        kafka_member.join(60)


# --- auto topic creation ---------------------------------------------------------------------------------


def test_topics_a_kafka_client_asks_for_are_created_with_the_gateways_settings(bus, topic_name):
    import confluent_kafka as ck

    gateway = start_gateways(bus.namespace, bus.controller, port=0, config={"num.partitions": 3})
    try:
        # A Metadata request naming a topic that does not exist creates it (Kafka clients allow auto-creation by
        # default). kafka-python's group subscribes once it is there: a group joined before the topic's partitions
        # are known is assigned nothing, and kafka-python looks again only at its next metadata refresh (5 minutes).
        asking = Raw(gateway)
        asking.call(kg.METADATA, 12, {"topics": [{"name": topic_name, "topic_id": None}], "allow_auto_topic_creation": True,
                                      "include_topic_authorized_operations": False})
        asking.close()
        consumer = kafka_python_consumer([topic_name], bootstrap_servers=gateway.bootstrap_servers, group_id=f"{topic_name}-auto",
                                         auto_offset_reset="earliest")
        try:
            wait_for(lambda: consumer.poll(timeout_ms=200) is not None and len(consumer.assignment()) == 3, timeout_s=120,
                     message="assigned")
        finally:
            consumer.close()
        assert len(bus.admin.describe_topic(topic_name).partitions) == 3  # num.partitions
        producer = ck.Producer({"bootstrap.servers": gateway.bootstrap_servers})
        producer.produce(topic_name + "-produced", b"value")
        assert producer.flush(60) == 0  # a producer's topic is created on its first Metadata
        assert len(bus.admin.describe_topic(topic_name + "-produced").partitions) == 3
        raw = Raw(gateway)
        metadata = raw.call(kg.METADATA, 12, {"topics": [{"name": "bad/name", "topic_id": None}], "allow_auto_topic_creation": True,
                                             "include_topic_authorized_operations": False})
        assert metadata.topics[0].error_code == kg.ErrorCode.invalid_topic_exception
        raw.close()
    finally:
        gateway.stop()


def test_with_auto_creation_off_or_not_allowed_a_missing_topic_stays_missing(bus, topic_name):
    gateway = start_gateways(bus.namespace, bus.controller, port=0, config={"auto.create.topics.enable": "false"})
    raw = Raw(gateway)
    try:
        for allowed in (True, False):
            reply = raw.call(kg.METADATA, 12, {"topics": [{"name": topic_name, "topic_id": None}], "allow_auto_topic_creation": allowed,
                                              "include_topic_authorized_operations": False})
            assert reply.topics[0].error_code == kg.ErrorCode.unknown_topic_or_partition
        assert topic_name not in bus.admin.list_topics()
    finally:
        raw.close()
        gateway.stop()
    gateway = bus.start_gateway(port=0)  # on (the default), but the client does not allow it
    raw = Raw(gateway)
    try:
        reply = raw.call(kg.METADATA, 12, {"topics": [{"name": topic_name, "topic_id": None}], "allow_auto_topic_creation": False,
                                          "include_topic_authorized_operations": False})
        assert reply.topics[0].error_code == kg.ErrorCode.unknown_topic_or_partition
        assert topic_name not in bus.admin.list_topics()
        reply = raw.call(kg.METADATA, 12, {"topics": [{"name": topic_name, "topic_id": None}], "allow_auto_topic_creation": True,
                                          "include_topic_authorized_operations": False})
        assert reply.topics[0].error_code == kg.ErrorCode.none and len(reply.topics[0].partitions) == 1
    finally:
        raw.close()
        gateway.stop()


# --- __consumer_offsets in Kafka's formats ----------------------------------------------------------------
#
# Kafka's OffsetCommitKey / OffsetCommitValue schemas (group-coordinator/src/main/resources/common/message),
# as data: (field, type, versions). A reader written from them alone, as a lag monitor's is.

KEY_FIELDS = [("group", "string", range(0, 2)), ("topic", "string", range(0, 2)), ("partition", "int32", range(0, 2))]
VALUE_FIELDS = [("offset", "int64", range(0, 5)), ("leaderEpoch", "int32", range(3, 5)), ("metadata", "string", range(0, 5)),
                ("commitTimestamp", "int64", range(0, 5)), ("expireTimestamp", "int64", range(1, 2))]
VALUE_FLEXIBLE_FROM = 4


def kafka_decode(data: bytes, fields, flexible_from: int | None = None) -> dict:
    (version,) = struct.unpack_from(">h", data)
    position, out = 2, {"version": version}
    flexible = flexible_from is not None and version >= flexible_from
    for name, kind, versions in fields:
        if version not in versions:
            continue
        if kind == "string":
            if flexible:
                length, position = data[position] - 1, position + 1  # a compact string (short ones: one varint byte)
            else:
                (length,) = struct.unpack_from(">h", data, position)
                position += 2
            out[name] = data[position : position + length].decode()
            position += length
        else:
            layout = ">q" if kind == "int64" else ">i"
            (out[name],) = struct.unpack_from(layout, data, position)
            position += struct.calcsize(layout)
    assert position == len(data) - (1 if flexible else 0), f"{len(data) - position} bytes left over"
    return out


@pytest.mark.own_bus  # it reads __consumer_offsets from its start: other tests' deleted groups left tombstones
def test_consumer_offsets_is_there_from_the_start_and_reads_with_kafkas_schemas(bus, gateway, topic_name):
    import confluent_kafka as ck
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KpPartition
    from kafka.protocol.old.list_offsets import ListOffsetsRequest_v0
    from kafka.protocol.parser import KafkaProtocol

    # Before any commit, the topic is there for a lag monitor: listed (internal), with offsets (ListOffsets v0).
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": gateway.bootstrap_servers})
    listed = admin.list_topics(timeout=30).topics
    assert OFFSETS_TOPIC in listed
    host, port = gateway.brokers[0][0], gateway.brokers[0][1]
    protocol = KafkaProtocol(client_id="lag-monitor")
    protocol.send_request(ListOffsetsRequest_v0(replica_id=-1, topics=[(OFFSETS_TOPIC, [(0, -1, 1)])]))
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(protocol.send_bytes())
        responses = []
        while not responses:
            chunk = sock.recv(65536)
            assert chunk, "the gateway closed the connection"
            responses = protocol.receive_bytes(chunk)
    [(_, response)] = responses
    [(name, [(partition, error_code, offsets)])] = response.topics
    assert (name, partition, error_code) == (OFFSETS_TOPIC, 0, 0) and len(offsets) == 1

    bus.admin.create_topic(topic_name, partitions=2)
    produce_keys(bus, topic_name, 0, 100)
    started_ms = int(time.time() * 1000)
    consumer = ck.Consumer({"bootstrap.servers": gateway.bootstrap_servers, "group.id": "lagged", "auto.offset.reset": "earliest",
                            "enable.auto.commit": False})
    consumer.subscribe([topic_name])
    read = 0
    deadline = time.monotonic() + 60
    while read < 100 and time.monotonic() < deadline:
        read += len([m for m in consumer.consume(100, 0.5) if m.error() is None])
    consumer.commit(asynchronous=False)
    consumer.close()
    ended_ms = int(time.time() * 1000)

    # A lag monitor reads the topic through the gateway and decodes it with Kafka's schemas.
    reader = KafkaConsumer(bootstrap_servers=gateway.bootstrap_servers, group_id=None, enable_auto_commit=False)
    tp = KpPartition(OFFSETS_TOPIC, 0)
    reader.assign([tp])
    reader.seek_to_beginning(tp)
    end = reader.end_offsets([tp])[tp]
    commits = {}
    deadline = time.monotonic() + 60
    while reader.position(tp) < end and time.monotonic() < deadline:
        for record in reader.poll(timeout_ms=500).get(tp, []):
            key = kafka_decode(record.key, KEY_FIELDS)
            assert key["version"] in (0, 1)
            value = kafka_decode(record.value, VALUE_FIELDS, VALUE_FLEXIBLE_FROM)
            commits[(key["group"], key["topic"], key["partition"])] = value
    reader.close()
    mine = {k: v for k, v in commits.items() if k[0] == "lagged"}
    assert set(mine) == {("lagged", topic_name, 0), ("lagged", topic_name, 1)}
    assert sum(v["offset"] for v in mine.values()) == 100
    for value in mine.values():
        assert value["version"] == 3
        assert started_ms - 1000 <= value["commitTimestamp"] <= ended_ms + 1000  # wall-clock time, not a monotonic clock


def test_offsets_committed_in_the_former_layout_still_load_after_an_upgrade(bus, topic_name):
    # Before Kafka's formats, logbus wrote value "version 1" with version 3's layout and a monotonic
    # commit time. A cluster upgraded in place finds such records in __consumer_offsets.
    bus.admin.create_topic(topic_name, partitions=2)
    consumer = logbus.Consumer(bus, group_id="new-layout", enable_auto_commit=False)
    consumer.commit({TopicPartition(topic_name, 0): 5})  # creates the topic, in the new layout
    consumer.close()
    former = [("old-group", 0, 42, "kept", 7), ("old-group", 1, 17, "", -1), ("other", 0, 3, "abcd", 0)]
    with logbus.Producer(bus, acks="all") as producer:
        for group, partition, offset, metadata, epoch in former:
            raw = metadata.encode()
            value = struct.pack(">hqi", 1, offset, epoch) + struct.pack(">h", len(raw)) + raw + struct.pack(">q", 123_456_789)
            producer.send(OFFSETS_TOPIC, value, key=offset_commit_key(group, (topic_name, partition)))
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    os.kill(ray.get(controller.ping.remote()), signal.SIGKILL)  # the controller reads the topic again when it restarts

    def loaded():
        try:
            return ray.get(bus.controller.fetch_committed.remote("old-group", [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]),
                           timeout=30)
        except Exception:  # noqa: BLE001 (restarting)
            return None

    committed = wait_for(loaded, timeout_s=120, message="the controller back")
    assert committed[TopicPartition(topic_name, 0)] == (42, "kept", 7)
    assert committed[TopicPartition(topic_name, 1)] == (17, "", -1)
    other = ray.get(bus.controller.fetch_committed.remote("other", [TopicPartition(topic_name, 0)]), timeout=30)
    assert other[TopicPartition(topic_name, 0)] == (3, "abcd", 0)  # 4 bytes of metadata: the case with two readings
    assert ray.get(bus.controller.fetch_committed.remote("new-layout", [TopicPartition(topic_name, 0)]), timeout=30)[
        TopicPartition(topic_name, 0)].offset == 5


# --- administration ----------------------------------------------------------------------------------------


def test_admin_requests_of_confluent_kafka_and_kafka_python(bus, gateway, topic_name):
    from confluent_kafka import ElectionType
    from confluent_kafka import TopicPartition as CkPartition
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions
    from kafka import TopicPartition as KpPartition
    from kafka.admin import ConfigResource as KpConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient

    bus.admin.create_topic(topic_name, partitions=2)
    produce_keys(bus, topic_name, 0, 200)
    admin = AdminClient({"bootstrap.servers": gateway.bootstrap_servers})
    kp = KafkaAdminClient(bootstrap_servers=gateway.bootstrap_servers, request_timeout_ms=30_000)
    try:
        # CreatePartitions
        [future] = admin.create_partitions([NewPartitions(topic_name, 3)]).values()
        future.result(60)
        assert len(bus.admin.describe_topic(topic_name).partitions) == 3
        kp.create_partitions({topic_name: 4})
        assert len(bus.admin.describe_topic(topic_name).partitions) == 4
        [future] = admin.create_partitions([NewPartitions(topic_name, 2)]).values()
        with pytest.raises(Exception, match="INVALID_PARTITIONS"):
            future.result(60)
        # DeleteRecords
        before = {p.partition: p.high_watermark for p in bus.admin.describe_topic(topic_name).partitions}
        [future] = admin.delete_records([CkPartition(topic_name, 0, 10)]).values()
        assert future.result(60).low_watermark == 10
        kp.delete_records({KpPartition(topic_name, 1): -1})
        starts = {p.partition: p.log_start_offset for p in bus.admin.describe_topic(topic_name).partitions}
        assert starts[0] == 10 and starts[1] == before[1]
        # AlterConfigs (the overrides become exactly those given) and IncrementalAlterConfigs
        bus.admin.alter_config(topic_name, {"retention.bytes": 1 << 30})
        [future] = admin.alter_configs([ConfigResource("topic", topic_name, set_config={"retention.ms": "86400000"})]).values()
        future.result(60)
        assert bus.admin.describe_topic(topic_name).config == {"retention.ms": 86400000}
        [future] = admin.incremental_alter_configs([ConfigResource("topic", topic_name, incremental_configs=[
            ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.APPEND),
            ConfigEntry("retention.ms", None, incremental_operation=AlterConfigOpType.DELETE),
            ConfigEntry("segment.bytes", "1048576", incremental_operation=AlterConfigOpType.SET)])]).values()
        future.result(60)
        assert bus.admin.describe_topic(topic_name).config == {"cleanup.policy": "compact,delete", "segment.bytes": 1048576}
        kp.reset_configs([KpConfigResource(ConfigResourceType.TOPIC, topic_name, configs=["segment.bytes"])])
        assert bus.admin.describe_topic(topic_name).config == {"cleanup.policy": "compact,delete"}
        [future] = admin.incremental_alter_configs([ConfigResource("topic", topic_name, incremental_configs=[
            ConfigEntry("no.such.config", "1", incremental_operation=AlterConfigOpType.SET)])]).values()
        with pytest.raises(Exception, match="INVALID_CONFIG"):
            future.result(60)
        # DescribeCluster
        cluster = admin.describe_cluster(request_timeout=30).result(60)
        assert cluster.cluster_id == f"logbus-{bus.namespace}" and [n.port for n in cluster.nodes] == [gateway.brokers[0][1]]
        assert kp.describe_cluster()["cluster_id"] == cluster.cluster_id
        # DeleteGroups and OffsetDelete
        for group in ("to-delete", "to-trim"):
            c = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
            c.commit({TopicPartition(topic_name, 0): 20, TopicPartition(topic_name, 1): 5})
            c.close()
        [future] = admin.delete_consumer_groups(["to-delete"], request_timeout=30).values()
        future.result(60)
        assert "to-delete" not in {g[0] for g in bus.admin.list_groups()}
        [future] = admin.delete_consumer_groups(["never-was"], request_timeout=30).values()
        with pytest.raises(Exception, match="GROUP_ID_NOT_FOUND"):
            future.result(60)
        kp.delete_group_offsets("to-trim", [KpPartition(topic_name, 1)])
        left = {(r["topic"], r["partition"]) for r in bus.admin.describe_group("to-trim")["offsets"] if r["current_offset"] is not None}
        assert left == {(topic_name, 0)}
        # ElectLeaders: every partition's preferred replica leads already (ELECTION_NOT_NEEDED, as Kafka says).
        elected = admin.elect_leaders(ElectionType.PREFERRED, [CkPartition(topic_name, 0)]).result(60)
        [(partition, error)] = elected.items()
        assert (partition.topic, partition.partition) == (topic_name, 0) and error is not None and error.code() == 84
        results = kp.elect_leaders(0, {topic_name: [0, 1]}, raise_errors=False)
        assert results is not None
        # DescribeLogDirs: this broker's replicas and their sizes.
        described = kp.describe_log_dirs()
        assert topic_name in repr(described) and bus.data_dir in repr(described)
        # ListOffsets (every version up to the one kafka-python negotiates)
        from kafka.admin import OffsetSpec

        offsets = kp.list_partition_offsets({KpPartition(topic_name, 0): OffsetSpec.EARLIEST})
        assert offsets[KpPartition(topic_name, 0)].offset == 10
    finally:
        kp.close()
