"""The controller's node table without Ray: leases on a fake clock, whose heartbeat renews one, replicas down
and up, epoch tables and fences, and the rule by which dead nodes leave the table (also under churn: the table
stays bounded)."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.protocol import node_table
from logbus.protocol.node_table import NODE_STEADY_MS, FollowUp, HeartbeatAnswer, NodeTable, follow_up

LEASE_MS = 800
PRUNE_MS = 10 * LEASE_MS
REPLACEMENT_MS = 60_000
RETRY_MS = 5_000


def table(now_ms: int = 0) -> NodeTable:
    return NodeTable("controller-1", now_ms, lease_timeout_ms=LEASE_MS, restart_grace_ms=0, prune_after_ms=PRUNE_MS)


def heard(nodes: NodeTable, node_id: str, now_ms: int, down=(), incarnation: str = "agent-1", version=None):
    return nodes.renew(nodes.entry(node_id), incarnation, list(down), version, now_ms)


# --- leases -----------------------------------------------------------------------------------------


def test_a_node_is_alive_until_its_lease_runs_out():
    nodes = table()
    heard(nodes, "ray-a", 1_000)
    assert nodes.alive("ray-a", 1_000 + LEASE_MS)
    assert not nodes.alive("ray-a", 1_000 + LEASE_MS + 1)
    heard(nodes, "ray-a", 1_500)  # a renewal extends it
    assert nodes.alive("ray-a", 1_500 + LEASE_MS)


def test_a_node_named_by_its_ray_node_is_ready_and_a_hosts_node_only_once_moved():
    nodes = table()
    assert nodes.entry("ray-a").ready and nodes.entry("ray-a").ray_node_id == "ray-a"
    host = nodes.entry("node-0123456789abcdef")
    assert not host.ready
    assert nodes.move(host, "ray-b", "/data/b", agent="agent-handle") is None
    assert host.ready and (host.ray_node_id, host.data_dir, host.agent) == ("ray-b", "/data/b", "agent-handle")
    assert nodes.move(host, "ray-c", None, agent=None) == "ray-b"
    assert host.past_ray_nodes == {"ray-b"}


def test_an_expired_lease_is_reported_once_and_replacement_comes_due_later():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1}})
    heard(nodes, "ray-a", 0)
    assert nodes.check_leases(LEASE_MS, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    names, expired = nodes.check_leases(LEASE_MS + 1, REPLACEMENT_MS, RETRY_MS)
    assert names == {"r1", "r2"} and [(n.node_id, again) for n, again in expired] == [("ray-a", False)]
    assert nodes.get("ray-a").dead_since_ms == LEASE_MS + 1
    assert nodes.check_leases(LEASE_MS + 100, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    # Replacement is due replacement_ms after the lease ran out, then every retry_ms.
    due = LEASE_MS + 1 + REPLACEMENT_MS
    assert nodes.check_leases(due - 1, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    assert nodes.check_leases(due, REPLACEMENT_MS, RETRY_MS) == ({"r1", "r2"}, [])
    assert nodes.check_leases(due + RETRY_MS - 1, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    assert nodes.check_leases(due + RETRY_MS, REPLACEMENT_MS, RETRY_MS) == ({"r1", "r2"}, [])


def test_a_node_without_replicas_has_no_expiry_to_report():
    nodes = table()
    heard(nodes, "ray-a", 0)
    assert nodes.check_leases(10 * LEASE_MS, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    assert not nodes.alive("ray-a", 10 * LEASE_MS)


def test_a_node_heard_again_is_revived_and_a_quick_second_expiry_is_the_same_outage():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1}})
    heard(nodes, "ray-a", 0)
    nodes.check_leases(1_000, REPLACEMENT_MS, RETRY_MS)
    renewal = heard(nodes, "ray-a", 1_400)
    assert renewal.revived_after_ms == 400 and not renewal.returned
    assert nodes.get("ray-a").dead_since_ms is None and nodes.alive("ray-a", 1_400)
    _, expired = nodes.check_leases(1_400 + LEASE_MS + 1, REPLACEMENT_MS, RETRY_MS)
    assert [again for _, again in expired] == [True]
    heard(nodes, "ray-a", 3_000)
    _, expired = nodes.check_leases(3_000 + NODE_STEADY_MS + 1, REPLACEMENT_MS, RETRY_MS)
    assert [again for _, again in expired] == [False]


def test_a_new_agent_or_the_first_heartbeat_is_a_return():
    nodes = table()
    assert heard(nodes, "ray-a", 0, incarnation="agent-1").returned
    assert not heard(nodes, "ray-a", 200, incarnation="agent-1").returned
    assert heard(nodes, "ray-a", 400, incarnation="agent-2").returned


def test_a_new_agent_is_expected_through_a_start_up_grace():
    nodes = table()
    nodes.expect("ray-a", 1_000)
    assert nodes.alive("ray-a", 20_000)
    heard(nodes, "ray-a", 2_000)  # its first heartbeat ends the grace
    assert not nodes.alive("ray-a", 2_000 + LEASE_MS + 1)


def test_a_stalled_tick_is_not_counted_against_a_lease():
    nodes = table()
    nodes.tick(0, 100)
    heard(nodes, "ray-a", 50)
    nodes.tick(2_000, 100)  # 1.9 s late: the controller stalled
    assert nodes.alive("ray-a", 2_000)


def test_a_silence_of_every_node_deposes_no_one_and_a_silence_of_one_does():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1}, "ray-b": {"r2": 1}})
    heard(nodes, "ray-a", 0)
    heard(nodes, "ray-b", 0)
    for now in range(0, 5_001, 100):  # the controller hears nobody for 5 s: it is cut off
        nodes.tick(now, 100)
        assert nodes.check_leases(now, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    view = nodes.isolation()
    assert view["isolated"] and view["isolations"] == 1 and view["isolated_ms"] > 4_000
    heard(nodes, "ray-a", 5_050)  # the heal: one node is heard, then the other
    nodes.tick(5_100, 100)
    assert nodes.isolation()["rejoining"] == 1 and not nodes.isolation()["isolated"]
    heard(nodes, "ray-b", 5_600)
    for now in range(5_100, 6_001, 100):
        heard(nodes, "ray-a", now)
        nodes.tick(now, 100)
        assert nodes.check_leases(now, REPLACEMENT_MS, RETRY_MS) == (set(), [])
    assert nodes.isolation()["rejoining"] == 0 and nodes.expiries == 0
    # Now only ray-b falls silent while ray-a is heard: its lease runs out as always.
    expired = []
    for now in range(6_100, 8_001, 100):
        heard(nodes, "ray-a", now)
        nodes.tick(now, 100)
        expired += [n.node_id for n, _ in nodes.check_leases(now, REPLACEMENT_MS, RETRY_MS)[1]]
    assert expired == ["ray-b"] and nodes.expiries == 1


# --- whose heartbeat renews ---------------------------------------------------------------------------

HOST = "node-0123456789abcdef"  # a host's node: it is on whichever Ray node carries its label


def test_a_host_that_joined_again_waits_until_it_is_moved_then_its_old_agent_is_stale():
    nodes = table()
    host = nodes.entry(HOST)
    nodes.move(host, "ray-old", None, agent="old-agent")
    assert nodes.heartbeat_answer(host, "ray-old") is HeartbeatAnswer.RENEW
    # The host joined again as Ray node "ray-new": the agent started there for its check heartbeats
    # before the node is moved, and must go on (told "stale", it would stop for good).
    assert nodes.heartbeat_answer(host, "ray-new") is HeartbeatAnswer.WAIT
    nodes.move(host, "ray-new", None, agent="new-agent")
    assert nodes.heartbeat_answer(host, "ray-new") is HeartbeatAnswer.RENEW
    assert nodes.heartbeat_answer(host, "ray-old") is HeartbeatAnswer.STALE  # the Ray node it left
    assert nodes.heartbeat_answer(host, "ray-other") is HeartbeatAnswer.WAIT  # never its Ray node


def test_a_node_on_no_ray_node_yet_waits_and_an_agent_that_names_no_ray_node_renews():
    nodes = table()
    host = nodes.entry(HOST)
    assert not host.ready
    assert {nodes.heartbeat_answer(host, ray_node) for ray_node in ("ray-a", None)} == {HeartbeatAnswer.WAIT}
    named = nodes.entry("ray-a")  # a node named by its Ray node: on it for good
    assert nodes.heartbeat_answer(named, "ray-a") is HeartbeatAnswer.RENEW
    assert nodes.heartbeat_answer(named, None) is HeartbeatAnswer.RENEW
    assert nodes.heartbeat_answer(named, "ray-b") is HeartbeatAnswer.WAIT


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["ray-a", "ray-b", "ray-c", "ray-d"]), unique=True, max_size=4),  # the Ray nodes it moved to, in turn
    st.sampled_from(["ray-a", "ray-b", "ray-c", "ray-d", "ray-e"]),  # the heartbeat's
)
def test_only_the_current_ray_node_renews_and_only_a_ray_node_left_is_stale(moves, heard_from):
    nodes = table()
    host = nodes.entry(HOST)
    for ray_node in moves:
        nodes.move(host, ray_node, None, agent=None)
    answer = nodes.heartbeat_answer(host, heard_from)
    if moves and heard_from == moves[-1]:
        assert answer is HeartbeatAnswer.RENEW
    elif heard_from in moves:
        assert answer is HeartbeatAnswer.STALE
    else:
        assert answer is HeartbeatAnswer.WAIT  # on no Ray node yet, or not yet on this one


# --- replicas down and up -------------------------------------------------------------------------


def test_replicas_reported_down_and_up():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1}})
    heard(nodes, "ray-a", 0)
    assert nodes.replica_alive("ray-a", "r1", 100) and nodes.replica_alive("ray-a", "r2", 100)
    renewal = heard(nodes, "ray-a", 200, down=["r1"])
    assert renewal.changed == {"r1"} and renewal.up == set()
    assert not nodes.replica_alive("ray-a", "r1", 300) and nodes.replica_alive("ray-a", "r2", 300)
    assert heard(nodes, "ray-a", 400, down=["r1"]).changed == set()  # nothing new
    renewal = heard(nodes, "ray-a", 600, down=[])
    assert renewal.changed == {"r1"} and renewal.up == {"r1"}
    assert nodes.replica_alive("ray-a", "r1", 700)


def test_a_replica_on_a_dead_or_unknown_node_is_not_alive():
    nodes = table()
    heard(nodes, "ray-a", 0)
    assert not nodes.replica_alive("ray-a", "r1", LEASE_MS + 1)
    assert not nodes.replica_alive("ray-unknown", "r1", 0)
    assert not nodes.replica_alive(None, "r1", 0)


def test_a_stopped_agent_forgets_the_lease_and_what_it_reported():
    nodes = table()
    node = nodes.entry("ray-a")
    nodes.renew(node, "agent-1", ["r1"], None, 1_000)
    assert nodes.alive("ray-a", 1_500)
    nodes.agent_stopped(node)
    assert (node.incarnation, node.acked, node.down) == (None, None, set())
    assert not nodes.alive("ray-a", 1_500)  # no lease: silent since the controller started (no grace here)


# --- what a heartbeat starts -------------------------------------------------------------------------


def test_a_nodes_first_heartbeat_checks_every_replica_it_hosts_and_sends_its_roles_again():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1}})
    then = follow_up(heard(nodes, "ray-a", 0), nodes.get("ray-a").epochs)
    assert then == FollowUp(resend_all=True, retry=frozenset(), check=frozenset({"r1", "r2"}))


def test_a_steady_heartbeat_starts_nothing_and_replicas_down_or_up_are_checked():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1}})
    hosted = nodes.get("ray-a").epochs
    heard(nodes, "ray-a", 0)
    assert follow_up(heard(nodes, "ray-a", 100), hosted) == FollowUp(False, frozenset(), None)
    assert follow_up(heard(nodes, "ray-a", 200, down=["r1"]), hosted) == FollowUp(False, frozenset(), frozenset({"r1"}))
    assert follow_up(heard(nodes, "ray-a", 300, down=["r1"]), hosted) == FollowUp(False, frozenset(), None)
    # Up again: checked, and its pending role change is sent at once.
    assert follow_up(heard(nodes, "ray-a", 400), hosted) == FollowUp(False, frozenset({"r1"}), frozenset({"r1"}))


def test_a_node_heard_after_its_lease_ran_out_or_with_a_new_agent_is_back():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1}})
    hosted = nodes.get("ray-a").epochs
    heard(nodes, "ray-a", 0)
    nodes.check_leases(LEASE_MS + 1, REPLACEMENT_MS, RETRY_MS)  # its lease ran out
    revived = heard(nodes, "ray-a", LEASE_MS + 500, down=["r1"])
    assert revived.revived_after_ms == 499 and not revived.returned
    assert follow_up(revived, hosted) == FollowUp(True, frozenset(), frozenset({"r1"}))
    # Within its lease, a new agent (its process restarted) is back too.
    restarted = heard(nodes, "ray-a", LEASE_MS + 600, incarnation="agent-2")
    assert restarted.returned and restarted.up == {"r1"}
    assert follow_up(restarted, hosted) == FollowUp(True, frozenset(), frozenset({"r1"}))


HEARTBEATS = st.lists(
    st.tuples(
        st.integers(1, 3 * LEASE_MS),  # ms since the last heartbeat (more than a lease: its lease ran out)
        st.sets(st.sampled_from(["r1", "r2", "r3", "elsewhere"])),  # replicas reported down
        st.booleans(),  # a new agent
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(HEARTBEATS)
def test_every_replica_whose_state_changed_is_checked_and_a_steady_heartbeat_starts_nothing(heartbeats):
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1, "r3": 1}})
    hosted = set(nodes.get("ray-a").epochs)
    now, agent = 0, 0
    for gap_ms, down, new_agent in heartbeats:
        now += gap_ms
        agent += new_agent
        nodes.check_leases(now - 1, REPLACEMENT_MS, RETRY_MS)
        renewal = heard(nodes, "ray-a", now, down=down, incarnation=f"agent-{agent}")
        then = follow_up(renewal, hosted)
        back = renewal.returned or renewal.revived_after_ms is not None
        assert then.resend_all == back
        assert then.retry <= renewal.up and not (back and then.retry)
        assert (renewal.changed & hosted) <= (then.check or set())
        if back:
            assert then.check == hosted
        elif not renewal.changed:
            assert then == FollowUp(False, frozenset(), None)


# --- epoch tables and fences ------------------------------------------------------------------------


def test_epoch_tables_get_a_new_version_only_when_they_change():
    nodes = table()
    changed = nodes.set_epochs({"ray-a": {"r1": 1}, "ray-b": {"r2": 1}})
    assert sorted(n.node_id for n in changed) == ["ray-a", "ray-b"]
    a_version = list(nodes.get("ray-a").version)
    assert a_version[0] == "controller-1"
    changed = nodes.set_epochs({"ray-a": {"r1": 1}, "ray-b": {"r2": 2}})
    assert [n.node_id for n in changed] == ["ray-b"] and nodes.get("ray-a").version == a_version
    assert nodes.get("ray-b").version[1] > a_version[1]
    changed = nodes.set_epochs({"ray-b": {"r2": 2}})  # ray-a hosts nothing now
    assert [n.node_id for n in changed] == ["ray-a"] and nodes.get("ray-a").epochs == {}


def test_an_applied_version_counts_only_if_newer_and_of_this_controller():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1}})
    node = nodes.get("ray-a")
    nodes.applied(node, ["other-controller", 99])
    assert node.acked is None
    nodes.applied(node, list(node.version))
    assert node.acked == node.version
    nodes.applied(node, [node.version[0], node.version[1] - 1])
    assert node.acked == node.version
    nodes.applied(node, None)
    assert node.acked == node.version


def test_a_fence_waits_for_the_live_nodes_that_have_not_applied_the_new_table():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 2}, "ray-b": {"r2": 2}, "ray-c": {"r3": 2}})
    heard(nodes, "ray-a", 1_000)
    heard(nodes, "ray-b", 1_000)  # ray-c is never heard: dead since the controller started
    needed = nodes.fence_versions(["ray-a", "ray-b", "ray-c", "ray-unknown"])
    assert set(needed) == {"ray-a", "ray-b", "ray-c"}
    assert sorted(nodes.fence_waiting(needed, 1_100)) == ["ray-a", "ray-b"]
    heard(nodes, "ray-a", 1_200, version=list(nodes.get("ray-a").version))
    assert nodes.fence_waiting(needed, 1_300) == ["ray-b"]
    heard(nodes, "ray-b", 1_400, version=list(nodes.get("ray-b").version))
    assert nodes.fence_waiting(needed, 1_500) == []
    # A newer table must be applied again; a node dead meanwhile is not waited for.
    nodes.set_epochs({"ray-a": {"r1": 3}, "ray-b": {"r2": 3}, "ray-c": {"r3": 3}})
    needed = nodes.fence_versions(["ray-a", "ray-b", "ray-c"])
    assert nodes.fence_waiting(needed, 1_600) == ["ray-a", "ray-b"]
    assert nodes.fence_waiting(needed, 1_400 + LEASE_MS + 1) == []


# --- pruning -----------------------------------------------------------------------------------------


def test_a_dead_node_hosting_nothing_leaves_ten_lease_timeouts_after_its_lease_ran_out():
    nodes = table()
    heard(nodes, "ray-a", 1_000)
    ran_out = 1_000 + LEASE_MS
    assert nodes.prune(ran_out + PRUNE_MS - 1) == []
    assert "ray-a" in nodes
    assert [n.node_id for n in nodes.prune(ran_out + PRUNE_MS)] == ["ray-a"]
    assert "ray-a" not in nodes and len(nodes) == 0
    assert nodes.dead_ray_nodes(ran_out + PRUNE_MS) == ["ray-a"]  # still dead to the gateways


def test_a_dead_node_hosting_replicas_stays():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1}})
    heard(nodes, "ray-a", 0)
    assert nodes.prune(100 * PRUNE_MS) == []
    nodes.set_epochs({})  # its replicas were replaced elsewhere: it hosts nothing now
    assert [n.node_id for n in nodes.prune(100 * PRUNE_MS)] == ["ray-a"]


def test_a_draining_node_with_replicas_left_stays_until_they_are_gone():
    nodes = table()
    nodes.set_epochs({"ray-a": {"r1": 1, "r2": 1}})
    heard(nodes, "ray-a", 0)
    nodes.set_epochs({"ray-a": {"r2": 1}, "ray-b": {"r1": 1}})  # one replica moved off, one still moving
    assert "ray-a" not in {n.node_id for n in nodes.prune(100 * PRUNE_MS)}
    nodes.set_epochs({"ray-b": {"r1": 1, "r2": 1}})
    assert "ray-a" in {n.node_id for n in nodes.prune(100 * PRUNE_MS)}


def test_a_node_a_ray_node_carries_stays_without_a_lease():
    nodes = table()
    node = nodes.entry("ray-a")  # an idle host: no agent, so no lease
    nodes.set_carried(["ray-a"])
    assert nodes.prune(100 * PRUNE_MS) == [] and nodes.get("ray-a") is node
    nodes.set_carried([])  # Ray's nodes, looked at again, lack it
    assert nodes.prune(100 * PRUNE_MS) == [node]


def test_a_node_never_heard_leaves_once_the_restart_grace_and_the_bound_are_over():
    nodes = NodeTable("controller-1", 0, lease_timeout_ms=LEASE_MS, restart_grace_ms=3_000, prune_after_ms=PRUNE_MS)
    nodes.entry("ray-a")
    assert nodes.prune(3_000 + LEASE_MS + PRUNE_MS - 1) == []
    assert len(nodes.prune(3_000 + LEASE_MS + PRUNE_MS)) == 1


def test_a_pruned_node_that_comes_back_is_new():
    nodes = table()
    node = nodes.entry("node-0123456789abcdef")
    nodes.move(node, "ray-b", "/data", agent="agent-b")
    heard(nodes, "node-0123456789abcdef", 0, incarnation="agent-1")
    nodes.set_epochs({"node-0123456789abcdef": {"r1": 1}})
    nodes.check_leases(LEASE_MS + 1, REPLACEMENT_MS, RETRY_MS)
    nodes.set_epochs({})
    assert nodes.prune(LEASE_MS + PRUNE_MS) == [node]
    assert nodes.dead_ray_nodes(LEASE_MS + PRUNE_MS) == ["ray-b"]
    back = nodes.entry("node-0123456789abcdef")
    assert back is not node
    assert (back.ray_node_id, back.past_ray_nodes, back.dead_since_ms, back.incarnation, back.epochs) == (None, set(), None, None, {})
    nodes.move(back, "ray-c", "/data", agent="agent-c")
    renewal = heard(nodes, "node-0123456789abcdef", 20_000, incarnation="agent-1")
    assert renewal.returned and renewal.revived_after_ms is None
    assert nodes.alive("node-0123456789abcdef", 20_000)
    assert nodes.dead_ray_nodes(20_000) == ["ray-b"]  # the Ray node it left stays dead


def test_a_ray_node_back_in_the_table_is_no_longer_departed():
    nodes = table()
    nodes.entry("ray-a")
    nodes.prune(LEASE_MS + PRUNE_MS)
    assert nodes.dead_ray_nodes(LEASE_MS + PRUNE_MS) == ["ray-a"]
    heard(nodes, "ray-a", 20_000)
    assert nodes.dead_ray_nodes(20_000) == []


def test_the_departed_are_bounded(monkeypatch):
    monkeypatch.setattr(node_table, "DEPARTED_MAX", 3)
    nodes = table()
    for i in range(5):
        nodes.entry(f"ray-{i}")
    nodes.prune(LEASE_MS + PRUNE_MS)
    assert nodes.dead_ray_nodes(LEASE_MS + PRUNE_MS) == ["ray-2", "ray-3", "ray-4"]  # the oldest forgotten first


def test_a_stopped_agent_of_a_pruned_node_leaves_the_new_records_lease_alone():
    nodes = table()
    old = nodes.entry("ray-a")
    nodes.prune(LEASE_MS + PRUNE_MS)
    heard(nodes, "ray-a", 20_000)
    nodes.agent_stopped(old)  # finishes after the node was pruned and heard again
    assert nodes.alive("ray-a", 20_000)


# --- churn: the table stays bounded -----------------------------------------------------------------


class Churn:
    """Nodes join and die, each hosting replicas for a while; the controller's part as the table sees it:
    heartbeats from live nodes, a look at Ray's nodes now and then, replicas of dead nodes moved off."""

    TICK_MS = 100
    HEARTBEAT_MS = 200
    LOOK_MS = 1_000  # Ray's nodes are looked at this often (as last seen in between)
    REPLACE_MS = 3_000

    def __init__(self, rng: random.Random, partitions: int = 20, replication: int = 2) -> None:
        self.rng = rng
        self.now = 0
        self.nodes = NodeTable("controller-1", 0, lease_timeout_ms=LEASE_MS, restart_grace_ms=0, prune_after_ms=PRUNE_MS)
        self.live: set[str] = set()
        self.died_ms: dict[str, int] = {}
        self.joined = 0
        for _ in range(max(3, replication + 1)):
            self.join()
        self.placement = {f"p{p}r{r}": sorted(self.live)[(p + r) % len(self.live)] for p in range(partitions) for r in range(replication)}
        self.look()
        self.reindex()

    def join(self) -> None:
        self.joined += 1
        node_id = f"ray-{self.joined}"
        self.live.add(node_id)
        self.nodes.entry(node_id)
        self.nodes.renew(self.nodes.entry(node_id), "agent", [], None, self.now)

    def die(self) -> None:
        if len(self.live) > 3:
            node_id = self.rng.choice(sorted(self.live))
            self.live.discard(node_id)
            self.died_ms[node_id] = self.now

    def look(self) -> None:
        self.nodes.set_carried(self.live)

    def reindex(self) -> None:
        tables: dict[str, dict[str, int]] = {}
        for name, node_id in self.placement.items():
            tables.setdefault(node_id, {})[name] = 1
        self.nodes.set_epochs(tables)

    def hosting(self) -> set[str]:
        return set(self.placement.values())

    def step(self) -> None:
        self.now += self.TICK_MS
        if self.rng.random() < 0.15:
            self.join()
        if self.rng.random() < 0.15:
            self.die()
        if self.now % self.HEARTBEAT_MS == 0:
            for node_id in self.live:
                self.nodes.renew(self.nodes.entry(node_id), "agent", [], None, self.now)
        if self.now % self.LOOK_MS == 0:
            self.look()
        self.nodes.tick(self.now, self.TICK_MS)
        names, _ = self.nodes.check_leases(self.now, self.REPLACE_MS, 1_000)
        moved = False
        for name in names:
            node = self.nodes.get(self.placement[name])
            if node.dead_since_ms is not None and self.now - node.dead_since_ms >= self.REPLACE_MS:
                self.placement[name] = self.rng.choice(sorted(self.live))
                moved = True
        if moved:
            self.reindex()
        for node in self.nodes.prune(self.now):
            assert node.node_id not in self.live and node.node_id not in self.hosting()

    def check_bounded(self) -> None:
        """The table holds the live nodes, those hosting replicas, and the recently dead: nothing else."""
        recent = {n for n, died in self.died_ms.items() if self.now - died <= self.LOOK_MS + LEASE_MS + PRUNE_MS + self.TICK_MS}
        kept = {n.node_id for n in self.nodes.nodes()}
        assert kept <= self.live | self.hosting() | recent
        assert self.live <= kept


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_under_churn_the_table_holds_the_live_the_hosting_and_the_recently_dead(seed):
    churn = Churn(random.Random(seed))
    for _ in range(3_000):  # five minutes of churn
        churn.step()
        churn.check_bounded()
    # Churn stops: once the bound has passed, only the live nodes and those hosting replicas are left.
    for _ in range((Churn.LOOK_MS + Churn.REPLACE_MS + LEASE_MS + PRUNE_MS) // Churn.TICK_MS + 20):
        churn.now += Churn.TICK_MS
        for node_id in churn.live:
            churn.nodes.renew(churn.nodes.entry(node_id), "agent", [], None, churn.now)
        churn.look()
        churn.nodes.tick(churn.now, Churn.TICK_MS)
        names, _ = churn.nodes.check_leases(churn.now, Churn.REPLACE_MS, 1_000)
        for name in names:
            if churn.nodes.get(churn.placement[name]).dead_since_ms is not None:
                churn.placement[name] = churn.rng.choice(sorted(churn.live))
        churn.reindex()
        churn.nodes.prune(churn.now)
    assert {n.node_id for n in churn.nodes.nodes()} == churn.live | churn.hosting()
    assert churn.hosting() <= churn.live
    assert churn.joined - len(churn.live) >= 100  # many came and went


def test_a_thousand_nodes_that_came_and_went_leave_only_the_live():
    nodes = table()
    for i in range(1_000):
        node_id = f"ray-{i}"
        heard(nodes, node_id, i)
        nodes.set_epochs({node_id: {f"r{i}": 1}})  # each hosted the replica for a while, then it moved on
    nodes.set_epochs({"ray-live": {"r": 1}})
    heard(nodes, "ray-live", 30_000)
    nodes.set_carried(["ray-live"])
    nodes.prune(30_000)
    assert [n.node_id for n in nodes.nodes()] == ["ray-live"]
