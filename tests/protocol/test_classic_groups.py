"""Kafka's classic group protocol in the coordinator: leaders, relayed metadata, the leader's assignments.

Members that joined through the Kafka gateway (``protocol_metadata`` given)
form generations the way Kafka's coordinator forms them: a protocol every
member has (any name), a leader among them that gets every member's
metadata, and the leader's SyncGroup assignments handed to each member as
they are. A group with any logbus member is assigned by the coordinator
(the mixed-group rule). No Ray, a fake clock.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import (
    FencedInstanceIdError,
    IllegalGenerationError,
    InconsistentGroupProtocolError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from logbus.protocol.group_coordinator import GroupCoordinator, GroupState, JoinPending, JoinResult, SyncPending
from logbus.protocol.messages import TopicPartition

TIMEOUTS = dict(session_timeout_ms=10_000, rebalance_timeout_ms=5_000, max_poll_interval_ms=5_000)


def coordinator() -> GroupCoordinator:
    ids = itertools.count()
    return GroupCoordinator(topic_partition_counts={"t": 6}, new_member_id=lambda prefix: f"{prefix}-{next(ids):03d}")


def kafka_join(gc, now_ms, member_id="", protocols=(("mine", b"meta"),), group="g", protocol_type="consumer", **kw):
    """A Kafka member's join as the gateway makes it (KIP-394's first round included)."""
    names = tuple(name for name, _ in protocols)
    metadata = tuple(data for _, data in protocols)
    options = dict(protocols=names, protocol_metadata=metadata, protocol_type=protocol_type, client_id="kafka", **TIMEOUTS, **kw)
    result = gc.join(group, member_id=member_id, now_ms=now_ms, **options)
    if isinstance(result, JoinPending) and not member_id and kw.get("group_instance_id") is None:
        result = gc.join(group, member_id=result.member_id, now_ms=now_ms, **options)
    return result


def form_three(gc):
    """Three Kafka members with a protocol of their own: joins, then the generation forms at the last rejoin."""
    a = kafka_join(gc, 0, protocols=(("mine", b"A"),))
    assert isinstance(a, JoinResult) and a.leader == a.member_id  # alone: leader of generation 1
    gc.sync("g", a.member_id, a.generation, assignments={a.member_id: (b"first", ())}, now_ms=0)
    b = kafka_join(gc, 1, protocols=(("mine", b"B"),))
    c = kafka_join(gc, 2, protocols=(("mine", b"C"),))
    assert isinstance(b, JoinPending) and isinstance(c, JoinPending)
    a = kafka_join(gc, 3, member_id=a.member_id, protocols=(("mine", b"A"),))
    b = kafka_join(gc, 4, member_id=b.member_id, protocols=(("mine", b"B"),))
    c = kafka_join(gc, 5, member_id=c.member_id, protocols=(("mine", b"C"),))
    return a, b, c


def test_the_leader_gets_every_members_metadata_and_hands_out_assignments_as_they_are():
    gc = coordinator()
    a, b, c = form_three(gc)
    assert {r.generation for r in (a, b, c)} == {2} and {r.leader for r in (a, b, c)} == {a.member_id}
    assert {r.protocol for r in (a, b, c)} == {"mine"}
    # Only the leader is told the members, each with its metadata for the chosen protocol.
    assert sorted(a.members) == sorted([(a.member_id, None, b"A"), (b.member_id, None, b"B"), (c.member_id, None, b"C")])
    assert b.members == c.members == ()
    # A follower's SyncGroup waits for the leader's.
    assert gc.sync("g", b.member_id, 2, now_ms=6) == SyncPending(b.member_id)
    assert gc.describe("g").state is GroupState.COMPLETING_REBALANCE
    assignments = {a.member_id: (b"to-a", [("t", 0), ("t", 1)]), b.member_id: (b"to-b\x00user", [("t", 2)]),
                   c.member_id: (b"\x01opaque", [])}
    synced = gc.sync("g", a.member_id, 2, assignments=assignments, now_ms=7)
    assert synced.assignment_bytes == b"to-a" and synced.assignment == (TopicPartition("t", 0), TopicPartition("t", 1))
    assert gc.describe("g").state is GroupState.STABLE
    assert gc.sync("g", b.member_id, 2, now_ms=8).assignment_bytes == b"to-b\x00user"
    assert gc.sync("g", c.member_id, 2, now_ms=9).assignment_bytes == b"\x01opaque"
    described = {m.member_id: m for m in gc.describe("g").members}
    assert described[c.member_id].metadata == b"C" and described[c.member_id].assignment_bytes == b"\x01opaque"
    assert gc.describe("g").leader == a.member_id and gc.describe("g").protocol_type == "consumer"


def test_a_member_the_leader_leaves_out_gets_an_empty_assignment_and_strangers_are_ignored():
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={a.member_id: (b"x", ()), "stranger": (b"y", ())}, now_ms=6)
    assert gc.sync("g", b.member_id, 2, now_ms=7).assignment_bytes == b""


def test_the_protocol_is_one_every_member_has_chosen_by_their_preferences():
    gc = coordinator()
    a = kafka_join(gc, 0, protocols=(("x", b"1"), ("y", b"2")))
    b = kafka_join(gc, 1, protocols=(("y", b"3"), ("z", b"4")))
    a = kafka_join(gc, 2, member_id=a.member_id, protocols=(("x", b"1"), ("y", b"2")))
    assert isinstance(b, JoinPending) and a.protocol == "y" and a.leader == a.member_id
    assert sorted(a.members) == sorted([(a.member_id, None, b"2"), (b.member_id, None, b"3")])
    with pytest.raises(InconsistentGroupProtocolError):
        kafka_join(gc, 3, protocols=(("z", b""),))  # not one every member has
    with pytest.raises(InconsistentGroupProtocolError):
        kafka_join(gc, 3, protocols=(("y", b""),), protocol_type="connect")
    with pytest.raises(InconsistentGroupProtocolError):  # logbus's consumers have no "y"
        gc.join("g", topics=("t",), protocols=("range",), now_ms=3, **TIMEOUTS)


def test_a_group_of_another_protocol_type_forms_too():
    gc = coordinator()
    worker = kafka_join(gc, 0, protocols=(("sessioned", b"\x00\x01config"),), protocol_type="connect")
    assert isinstance(worker, JoinResult) and worker.leader == worker.member_id and worker.protocol_type == "connect"
    assert worker.members == ((worker.member_id, None, b"\x00\x01config"),)


def test_when_the_leader_leaves_the_group_rebalances_and_elects_another():
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={}, now_ms=6)
    assert gc.leave("g", a.member_id, now_ms=7)
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=8).rejoin  # REBALANCE_IN_PROGRESS
    b2 = kafka_join(gc, 9, member_id=b.member_id, protocols=(("mine", b"B"),))
    assert isinstance(b2, JoinPending)
    c2 = kafka_join(gc, 10, member_id=c.member_id, protocols=(("mine", b"C"),))
    assert c2.generation == 3 and c2.leader == b.member_id and c2.members == ()
    b3 = kafka_join(gc, 11, member_id=b.member_id, protocols=(("mine", b"B"),))  # its join response, again
    assert b3.generation == 3 and sorted(b3.members) == sorted([(b.member_id, None, b"B"), (c.member_id, None, b"C")])


def test_members_that_do_not_rejoin_or_sync_within_the_rebalance_timeout_are_removed():
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={}, now_ms=6)
    gc.sync("g", b.member_id, 2, now_ms=6)
    gc.sync("g", c.member_id, 2, now_ms=6)
    kafka_join(gc, 100, member_id=a.member_id, protocols=(("mine", b"A2"),))  # changed metadata: a rebalance
    kafka_join(gc, 200, member_id=b.member_id, protocols=(("mine", b"B"),))
    # c never rejoins: after the rebalance timeout (5 s) the generation forms without it.
    gc.tick(100 + 5_001)
    assert [m.member_id for m in gc.describe("g").members] == sorted([a.member_id, b.member_id])
    description = gc.describe("g")
    assert description.state is GroupState.COMPLETING_REBALANCE and description.generation == 3
    # The leader never sends SyncGroup: it goes after the rebalance timeout, the follower stays.
    assert description.leader == a.member_id  # the leader before, rejoined
    assert gc.sync("g", b.member_id, 3, now_ms=5_200) == SyncPending(b.member_id)
    gc.heartbeat("g", a.member_id, 3, poll_idle_ms=0, now_ms=5_200)  # alive, but it never assigns
    gc.heartbeat("g", b.member_id, 3, poll_idle_ms=0, now_ms=9_000)
    gc.tick(5_101 + 5_001)
    assert [m.member_id for m in gc.describe("g").members] == [b.member_id]
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE


def test_in_a_stable_group_a_follower_rejoining_unchanged_gets_the_same_generation_and_the_leader_starts_a_rebalance():
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={b.member_id: (b"bb", [("t", 3)])}, now_ms=6)
    again = kafka_join(gc, 7, member_id=b.member_id, protocols=(("mine", b"B"),))
    assert isinstance(again, JoinResult) and again.generation == 2 and again.leader == a.member_id
    assert gc.sync("g", b.member_id, 2, now_ms=8).assignment_bytes == b"bb"
    # The leader's rejoin asks for a new assignment (it saw the topics change, say).
    assert isinstance(kafka_join(gc, 9, member_id=a.member_id, protocols=(("mine", b"A"),)), JoinPending)
    assert gc.describe("g").state is GroupState.PREPARING_REBALANCE


def test_cooperative_members_rejoin_after_revoking_and_that_starts_the_next_rebalance():
    # Kafka's cooperative protocol is the clients': a member that revoked partitions rejoins with
    # metadata that no longer lists them, which (its metadata changed) starts the next rebalance.
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={b.member_id: (b"b", [("t", 0), ("t", 1)])}, now_ms=6)
    gc.sync("g", b.member_id, 2, now_ms=6)
    assert gc.describe("g").state is GroupState.STABLE
    revoked = kafka_join(gc, 7, member_id=b.member_id, protocols=(("mine", b"B, owning t-0 only"),), owned=[("t", 0)])
    assert isinstance(revoked, JoinPending) and gc.describe("g").state is GroupState.PREPARING_REBALANCE
    assert gc._groups["g"].members[b.member_id].owned == {TopicPartition("t", 0)}  # what it reported holding


def test_a_static_member_that_restarts_takes_its_place_without_a_rebalance_and_its_old_id_is_fenced():
    gc = coordinator()
    a = kafka_join(gc, 0, group_instance_id="host-a")
    b = kafka_join(gc, 1, group_instance_id="host-b")
    a = kafka_join(gc, 2, member_id=a.member_id, group_instance_id="host-a")
    b = gc.join("g", member_id=b.member_id, group_instance_id="host-b", protocols=("mine",), protocol_metadata=(b"meta",), now_ms=3,
                **TIMEOUTS)
    leader = a if a.leader == a.member_id else b
    follower = b if leader is a else a
    gc.sync("g", leader.member_id, leader.generation, assignments={leader.member_id: (b"L", ()), follower.member_id: (b"F", ())}, now_ms=4)
    instance = "host-a" if leader is a else "host-b"
    # The leader's process restarts: same instance id, no member id.
    restarted = kafka_join(gc, 5, group_instance_id=instance)
    assert isinstance(restarted, JoinResult) and restarted.generation == leader.generation
    assert restarted.member_id != leader.member_id
    assert restarted.leader == leader.member_id  # the leader as it was: the new process does not assign again
    assert gc.describe("g").state is GroupState.STABLE and gc.describe("g").leader == restarted.member_id
    assert gc.sync("g", restarted.member_id, restarted.generation, group_instance_id=instance, now_ms=6).assignment_bytes == b"L"
    with pytest.raises(FencedInstanceIdError):
        gc.heartbeat("g", leader.member_id, leader.generation, poll_idle_ms=0, now_ms=7, group_instance_id=instance)
    with pytest.raises(FencedInstanceIdError):
        gc.commit_offsets("g", leader.member_id, leader.generation, {("t", 0): 1}, now_ms=7, group_instance_id=instance)
    with pytest.raises(FencedInstanceIdError):
        gc.leave("g", leader.member_id, now_ms=7, group_instance_id=instance)
    assert gc.leave("g", "", now_ms=8, group_instance_id=instance)  # LeaveGroup by instance id alone
    assert [m.group_instance_id for m in gc.describe("g").members] == ["host-b" if instance == "host-a" else "host-a"]


def test_heartbeats_answer_as_kafka_answers_them():
    gc = coordinator()
    a, b, c = form_three(gc)
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=6).rejoin is False  # CompletingRebalance: NONE
    with pytest.raises(IllegalGenerationError):
        gc.heartbeat("g", b.member_id, 1, poll_idle_ms=0, now_ms=6)
    gc.sync("g", a.member_id, 2, assignments={}, now_ms=7)
    assert gc.heartbeat("g", b.member_id, 2, poll_idle_ms=0, now_ms=8).rejoin is False
    with pytest.raises(UnknownMemberIdError):
        gc.heartbeat("g", "nobody", 2, poll_idle_ms=0, now_ms=8)
    with pytest.raises(InconsistentGroupProtocolError):
        gc.sync("g", b.member_id, 2, protocol_name="range", now_ms=9)
    kafka_join(gc, 10, member_id=c.member_id, protocols=(("mine", b"C2"),))
    with pytest.raises(RebalanceInProgressError):
        gc.sync("g", b.member_id, 2, now_ms=11)


# --- the mixed-group rule ----------------------------------------------------------------------------


def test_a_group_with_a_logbus_member_is_assigned_by_the_coordinator_and_without_one_by_a_kafka_leader():
    gc = coordinator()
    k1 = kafka_join(gc, 0, protocols=(("range", b"k1"), ("mine", b"k1")), topics=("t",))
    gc.sync("g", k1.member_id, 1, assignments={}, now_ms=0)
    native = gc.join("g", topics=("t",), protocols=("range",), now_ms=1, **TIMEOUTS)
    native = gc.join("g", member_id=native.member_id, topics=("t",), protocols=("range",), now_ms=1, **TIMEOUTS)
    assert isinstance(native, JoinPending)
    k1 = kafka_join(gc, 2, member_id=k1.member_id, protocols=(("range", b"k1"), ("mine", b"k1")), topics=("t",))
    # A logbus member has no assignor of its own: the coordinator assigns, with range (the one both have).
    assert k1.leader is None and k1.protocol == "range" and k1.generation == 2
    native = gc.join("g", member_id=native.member_id, topics=("t",), protocols=("range",), now_ms=3, **TIMEOUTS)
    assert sorted(k1.assignment + native.assignment) == [TopicPartition("t", p) for p in range(6)]
    assert len(k1.assignment) == len(native.assignment) == 3
    assert gc.sync("g", k1.member_id, 2, now_ms=4).assignment == k1.assignment  # the Kafka member's empty SyncGroup
    # Once the logbus member leaves, the next generation is Kafka's classic protocol again.
    gc.leave("g", native.member_id, now_ms=5)
    k1 = kafka_join(gc, 6, member_id=k1.member_id, protocols=(("range", b"k1"), ("mine", b"k1")), topics=("t",))
    assert k1.leader == k1.member_id and k1.generation == 3 and k1.members == ((k1.member_id, None, b"k1"),)


# --- persistence and a random walk -------------------------------------------------------------------


def test_a_classic_group_survives_a_restart_of_the_coordinator():
    gc = coordinator()
    a, b, c = form_three(gc)
    gc.sync("g", a.member_id, 2, assignments={c.member_id: (b"\xffcc", [("t", 5)])}, now_ms=6)
    loaded = GroupCoordinator.from_json(gc.to_json(), now_ms=100, topic_partition_counts={"t": 6})
    description = loaded.describe("g")
    assert description.leader == a.member_id and description.protocol == "mine"
    assert loaded.sync("g", c.member_id, 2, now_ms=101).assignment_bytes == b"\xffcc"
    assert {m.member_id: m.metadata for m in description.members}[b.member_id] == b"B"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "rejoin", "sync", "leave", "tick", "heartbeat"]), st.integers(0, 3)), max_size=60))
def test_random_classic_groups_keep_kafkas_rules(steps):
    """Whatever members do: a formed generation has a leader among its members; a Stable group's
    members get exactly what the leader gave them; no partition is held by two members."""
    gc = coordinator()
    now = 0
    members: dict[int, str] = {}
    given_out: dict[str, bytes] = {}
    for action, who in steps:
        now += 700
        try:
            if action == "join" and who not in members:
                result = kafka_join(gc, now, protocols=(("mine", b"%d" % who),))
                members[who] = result.member_id
            elif action == "rejoin" and who in members:
                kafka_join(gc, now, member_id=members[who], protocols=(("mine", b"%d" % who),))
            elif action == "sync" and who in members:
                description = gc.describe("g")
                assignments = None
                if description.leader == members[who]:
                    assignments = {m.member_id: (m.member_id.encode(), [("t", i)]) for i, m in enumerate(description.members)}
                    given_out = {m: data for m, (data, _) in assignments.items()}
                result = gc.sync("g", members[who], description.generation, assignments=assignments, now_ms=now)
                if isinstance(result, JoinResult):
                    assert result.assignment_bytes == given_out.get(members[who], b"")
            elif action == "leave" and who in members:
                gc.leave("g", members.pop(who), now_ms=now)
            elif action == "heartbeat" and who in members:
                gc.heartbeat("g", members[who], gc.describe("g").generation, poll_idle_ms=0, now_ms=now)
            elif action == "tick":
                gc.tick(now + 6_000 * who)
                now += 6_000 * who
        except (UnknownMemberIdError, RebalanceInProgressError, IllegalGenerationError):
            members = {k: v for k, v in members.items() if v in {m.member_id for m in gc.describe("g").members}}
        description = gc.describe("g")
        if description.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
            assert description.leader in {m.member_id for m in description.members}
        held = [tp for m in gc._groups["g"].members.values() for tp in m.owned] if "g" in gc._groups else []
        assert len(held) == len(set(held))


def test_a_kip_848_member_commits_with_its_older_epoch_only_for_partitions_it_still_holds():
    # A KIP-848 member learns the group's new generation (its epoch) on its next heartbeat; until then it
    # commits with the one it has, which Kafka's coordinator takes for partitions the member holds.
    gc = coordinator()
    options = dict(topics=("t",), protocols=("cooperative-sticky",), member_epochs=True, **TIMEOUTS)
    a = gc.join("g", new_member_id="a", now_ms=0, **options)
    assert isinstance(a, JoinResult) and a.generation == 1 and len(a.assignment) == 6
    everything = [(tp.topic, tp.partition) for tp in a.assignment]
    assert isinstance(gc.join("g", new_member_id="b", now_ms=1, **options), JoinPending)
    a2 = gc.join("g", member_id="a", owned=everything, now_ms=2, **options)
    b = gc.join("g", member_id="b", now_ms=3, **options)
    assert isinstance(a2, JoinResult) and a2.generation == 2 and 0 < len(a2.assignment) < 6
    assert gc.commit_offsets("g", "a", 1, {("t", 0): 10}, now_ms=4)  # still its partition: taken
    kept = [(tp.topic, tp.partition) for tp in a2.assignment]
    gc.join("g", member_id="a", owned=kept, now_ms=5, **options)  # it gives up the rest
    given_up = next(tp for tp in everything if tp not in kept)
    with pytest.raises(IllegalGenerationError):
        gc.commit_offsets("g", "a", 1, {given_up: 10}, now_ms=6)
    with pytest.raises(IllegalGenerationError):  # an epoch the group never had
        gc.commit_offsets("g", "a", 3, {kept[0]: 10}, now_ms=6)
    assert gc.commit_offsets("g", "a", 1, {kept[0]: 10}, now_ms=6)
    # A logbus member with the same history commits only with the current generation.
    gc2 = coordinator()
    logbus_options = {**options, "member_epochs": False}
    first = gc2.join("g", member_id="", now_ms=0, **logbus_options)
    member = first.member_id if isinstance(first, JoinPending) else first.member_id
    joined = gc2.join("g", member_id=member, now_ms=0, **logbus_options) if isinstance(first, JoinPending) else first
    assert isinstance(joined, JoinResult) and joined.generation == 1
    other = gc2.join("g", member_id="", now_ms=1, **logbus_options)
    gc2.join("g", member_id=other.member_id, now_ms=1, **logbus_options)
    gc2.join("g", member_id=member, owned=[(tp.topic, tp.partition) for tp in joined.assignment], now_ms=2, **logbus_options)
    with pytest.raises(IllegalGenerationError):
        gc2.commit_offsets("g", member, 1, {("t", 0): 10}, now_ms=4)
    # Restarted from its state, the coordinator keeps the rule.
    again = GroupCoordinator.from_json(gc.to_json(), now_ms=7, topic_partition_counts={"t": 6})
    assert again.commit_offsets("g", "a", 1, {kept[0]: 11}, now_ms=8)
