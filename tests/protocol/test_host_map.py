"""Which Ray node each node is, without Ray: Ray's node lists as plain data, a node table on a fake clock, and
the checks of hosts answered here (checked, or refused) as the controller's agents would answer them."""

from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.protocol.host_map import HostMap, Look, RayNode
from logbus.protocol.node_table import NodeTable
from logbus.storage.node_identity import NODE_ID_HEX_DIGITS, NODE_ID_PREFIX

LEASE_MS = 800


def node_id(i: int) -> str:
    return f"{NODE_ID_PREFIX}{i:0{NODE_ID_HEX_DIGITS}x}"


A, B = node_id(0xA), node_id(0xB)


def host(ray_node_id: str, label: str | None = None, limit: int = 4, rack: str = "") -> RayNode:
    """A Ray node as ``replica_hosts`` lists it: labelled with a host's node id, or its own node."""
    return RayNode(ray_node_id=ray_node_id, node_id=label or ray_node_id, labelled=label is not None, limit=limit, rack=rack)


def tables(now_ms: int = 0) -> tuple[NodeTable, HostMap]:
    table = NodeTable("controller-1", now_ms, lease_timeout_ms=LEASE_MS, restart_grace_ms=0, prune_after_ms=10 * LEASE_MS)
    return table, HostMap(table)


def refresh(table: NodeTable, hosts: HostMap, listed: list[RayNode], now_ms: int, refuse: frozenset[str] = frozenset()):
    """One ``refresh_nodes``: look, check each Ray node a node would move to (refusing those in ``refuse``,
    the others' checks succeed), see, move. Returns the look."""
    look = hosts.look(listed, now_ms)
    found = []
    for node, ray_node_id in look.moves:
        known = hosts.identified(ray_node_id)
        if known is None and ray_node_id in refuse:
            hosts.refuse(ray_node_id, node.node_id, f"Ray node {ray_node_id}: another cluster's data directory")
        elif known is None:
            known = hosts.identify(ray_node_id, node.node_id, f"/data/{ray_node_id}", f"agent-on-{ray_node_id}")
        found.append(known)
    hosts.seen(listed)
    for (node, ray_node_id), identity in zip(look.moves, found):
        if identity is not None:
            table.move(node, ray_node_id, identity.data_dir, identity.agent)
    return look


def heard(table: NodeTable, node: str, now_ms: int) -> None:
    table.renew(table.entry(node), "agent-1", [], None, now_ms)


# --- unlabelled Ray nodes -------------------------------------------------------------------------


def test_an_unlabelled_ray_node_is_its_own_node_and_usable_at_once():
    table, hosts = tables()
    look = refresh(table, hosts, [host("ray-1"), host("ray-2", rack="r2")], 0)
    assert look.moves == [] and look.duplicates == []
    assert [h.ray_node_id for h in hosts.usable()] == ["ray-1", "ray-2"]
    assert hosts.live_nodes() == ["ray-1", "ray-2"]
    assert hosts.ray_node_of("ray-1") == "ray-1" and hosts.node_of_ray_node("ray-2") == "ray-2"
    assert "ray-1" not in table  # nothing to check, no record made


# --- labelled hosts ---------------------------------------------------------------------------------


def test_a_labelled_host_is_its_node_once_checked_and_moved_there():
    table, hosts = tables()
    look = hosts.look([host("ray-1", A)], 0)
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-1")]
    hosts.seen([host("ray-1", A)])
    assert hosts.usable() == [] and hosts.live_nodes() == []  # not checked yet: nothing placed there
    assert hosts.ray_node_of(A) is None
    identity = hosts.identify("ray-1", A, "/data/a", "agent")
    assert hosts.identified("ray-1") == identity and (identity.node_id, identity.data_dir, identity.agent) == (A, "/data/a", "agent")
    table.move(look.moves[0][0], "ray-1", identity.data_dir, identity.agent)
    assert hosts.live_nodes() == [A] and hosts.ray_node_of(A) == "ray-1" and hosts.node_of_ray_node("ray-1") == A
    # The next look leaves it there: nothing to move, nothing to report.
    assert refresh(table, hosts, [host("ray-1", A)], 100) == Look([], [])


def test_labelled_and_unlabelled_hosts_side_by_side():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A), host("ray-2"), host("ray-3", B)], 0, refuse=frozenset({"ray-3"}))
    assert hosts.live_nodes() == sorted([A, "ray-2"])
    assert {h.ray_node_id: h.labelled for h in hosts.usable()} == {"ray-1": True, "ray-2": False}


def test_usable_hosts_stay_as_at_the_previous_look_until_seen():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1")], 0)
    hosts.look([host("ray-2")], 100)  # the checks of a look are under way
    assert hosts.live_nodes() == ["ray-1"]
    hosts.seen([host("ray-2")])
    assert hosts.live_nodes() == ["ray-2"]


def test_a_look_keeps_the_nodes_ray_carries_from_being_pruned():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    late = 100 * LEASE_MS  # never heard, long past any bound
    assert not table.prunable(table.get(A), late)
    hosts.look([], late)
    assert table.prunable(table.get(A), late)


# --- a host that joined again -----------------------------------------------------------------------


def test_a_host_keeps_its_node_across_a_new_ray_node_id():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    heard(table, A, 0)
    # The host restarted: Ray lists only its new Ray node, with the same label.
    look = refresh(table, hosts, [host("ray-9", A)], 100)
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-9")]
    node = table.get(A)
    assert node.ray_node_id == "ray-9" and node.data_dir == "/data/ray-9" and node.past_ray_nodes == {"ray-1"}
    assert hosts.live_nodes() == [A] and hosts.ray_node_of(A) == "ray-9"


def test_a_host_joined_again_before_ray_declared_its_old_ray_node_dead_is_moved_to_once_the_old_one_is_silent():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    heard(table, A, 0)
    both = [host("ray-1", A), host("ray-9", A)]
    look = refresh(table, hosts, both, 100)  # the old Ray node's agent still heartbeats: it stays
    assert look.moves == [] and table.get(A).ray_node_id == "ray-1"
    assert [(d.node_id, d.ray_node_ids, d.kept) for d in look.duplicates] == [(A, ("ray-1", "ray-9"), "ray-1")]
    assert [h.ray_node_id for h in hosts.usable()] == ["ray-1"]  # the other is no Ray node of its node
    look = refresh(table, hosts, both, LEASE_MS + 1)  # its lease ran out: the new Ray node is the node
    assert look.duplicates == [] and table.get(A).ray_node_id == "ray-9"
    assert [h.ray_node_id for h in hosts.usable()] == ["ray-9"]


def test_a_host_on_two_new_ray_nodes_moves_to_the_one_listed_last():
    """A host killed while it was joining again: Ray lists the Ray node it was joining on until it declares
    it dead (a check there would wait until then), and the host's next one beside it."""
    table, hosts = tables()
    refresh(table, hosts, [host("ray-5", A)], 0)
    look = hosts.look([host("ray-1", A)], 1_000)  # ray-5 is gone; the host joined again on ray-1 (killed since)
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-1")]
    hosts.seen([host("ray-1", A)])  # its check did not answer
    look = refresh(table, hosts, [host("ray-1", A), host("ray-3", A)], 2_000)  # and joined again on ray-3
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-3")]
    assert table.get(A).ray_node_id == "ray-3"


def test_the_ray_node_listed_last_wins_whatever_its_id():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-5", A)], 0)
    hosts.look([host("ray-3", A)], 1_000)  # the host joined again on ray-3 (killed since); its check did not answer
    hosts.seen([host("ray-3", A)])
    look = refresh(table, hosts, [host("ray-1", A), host("ray-3", A)], 2_000)  # and again on ray-1: a lower id
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-1")]
    # Two new Ray nodes first listed by one look: the highest id (there is no order to go by; if that is
    # the dead one, its check waits until Ray declares it dead, as every check did before).
    table, hosts = tables()
    refresh(table, hosts, [host("ray-5", A)], 0)
    look = hosts.look([host("ray-1", A), host("ray-3", A)], 1_000)
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-3")]


def test_a_node_never_goes_back_to_a_ray_node_it_left():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    refresh(table, hosts, [host("ray-9", A)], 100)
    look = refresh(table, hosts, [host("ray-1", A)], 200)  # the old Ray node listed again (and the new one not)
    assert look.moves == [] and table.get(A).ray_node_id == "ray-9"
    assert hosts.usable() == [] and hosts.live_nodes() == []


def test_a_ray_node_that_left_is_not_usable():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A), host("ray-2")], 0)
    assert hosts.live_nodes() == sorted([A, "ray-2"])
    refresh(table, hosts, [], 100)
    assert hosts.usable() == [] and hosts.live_nodes() == []
    assert hosts.node_of_ray_node("ray-2") == "ray-2"  # not listed: named by itself
    assert hosts.node_of_ray_node("ray-1") == "ray-1"
    assert hosts.ray_node_of(A) == "ray-1"  # the table still maps the node (its lease decides if it is dead)


def test_a_check_that_does_not_answer_is_tried_again_at_the_next_look():
    table, hosts = tables()
    hosts.look([host("ray-1", A)], 0)
    hosts.seen([host("ray-1", A)])  # no identity recorded, no refusal: the agent did not answer
    assert hosts.usable() == []
    look = hosts.look([host("ray-1", A)], 1_000)
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-1")]


# --- two hosts with one identity, refused hosts ----------------------------------------------------------------


def test_a_second_host_claiming_the_same_node_is_reported_once_and_the_node_stays():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    copied = [host("ray-1", A), host("ray-2", A)]
    for now in range(100, 600, 100):  # the first host heartbeats throughout
        heard(table, A, now)
        look = refresh(table, hosts, copied, now)
        assert look.moves == [] and table.get(A).ray_node_id == "ray-1"
        assert len(look.duplicates) == (1 if now == 100 else 0)
        assert [h.ray_node_id for h in hosts.usable()] == ["ray-1"]
    # A third Ray node with the same identity is a new set: reported again.
    heard(table, A, 600)
    look = refresh(table, hosts, [*copied, host("ray-3", A)], 600)
    assert [d.ray_node_ids for d in look.duplicates] == [("ray-1", "ray-2", "ray-3")]


def test_a_refused_host_is_never_used_nor_checked_again_and_is_listed_while_ray_lists_it():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0, refuse=frozenset({"ray-1"}))
    assert table.get(A).ray_node_id is None
    assert [(r, f.node_id) for r, f in hosts.refused_live()] == [("ray-1", A)]
    assert "another cluster" in hosts.refused_live()[0][1].error
    look = refresh(table, hosts, [host("ray-1", A)], 100)
    assert look.moves == [] and hosts.usable() == [] and hosts.live_nodes() == []
    refresh(table, hosts, [], 200)
    assert hosts.refused_live() == []  # its Ray node left


def test_a_refused_duplicate_leaves_the_node_where_it_is():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0)
    # Its lease ran out, and a host with its identity but another cluster's directory joined.
    refresh(table, hosts, [host("ray-2", A)], LEASE_MS + 1, refuse=frozenset({"ray-2"}))
    assert table.get(A).ray_node_id == "ray-1" and hosts.usable() == []
    assert [r for r, _ in hosts.refused_live()] == ["ray-2"]


def test_a_node_that_leaves_the_table_is_forgotten_here_too():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A), host("ray-2", B)], 0, refuse=frozenset({"ray-2"}))
    heard(table, A, 0)
    refresh(table, hosts, [host("ray-1", A), host("ray-3", A)], 100)
    hosts.forget(A)
    hosts.forget(B)
    assert hosts.identified("ray-1") is None and hosts.refused_live() == []
    heard(table, A, 200)
    look = refresh(table, hosts, [host("ray-1", A), host("ray-3", A)], 200)
    assert len(look.duplicates) == 1  # reported again: nothing of its past is kept


def test_checks_and_refusals_of_ray_nodes_that_left_go_so_hosts_coming_and_going_keep_the_map_bounded():
    """Hosts restart again and again (each time a new Ray node id carrying the same node, listed beside
    the old one for a while), a host with another cluster's directory keeps joining and leaving, and
    unlabelled Ray nodes come and go: what the map keeps stays within the Ray nodes listed now."""
    table, hosts = tables()
    nodes = [node_id(0x100 + i) for i in range(5)]
    intruder_node = node_id(0x200)  # claimed by hosts of another cluster only
    for round_ in range(200):
        now = round_ * 100
        for node in nodes:
            heard(table, node, now)
        # Each node's host on a fresh Ray node every other round; in the rounds between, the next one
        # is listed beside it (the old one heartbeats, so the node stays and the pair is reported).
        listed = [host(f"ray-{node[-4:]}-{round_ // 2}", node) for node in nodes]
        if round_ % 2:
            listed += [host(f"ray-{node[-4:]}-{round_ // 2 + 1}", node) for node in nodes]
        intruder = host(f"ray-intruder-{round_}", intruder_node)
        listed += [intruder, host(f"ray-plain-{round_}"), host(f"ray-plain-{round_ + 1}")]
        look = refresh(table, hosts, listed, now, refuse=frozenset({intruder.ray_node_id}))
        assert (intruder_node, intruder.ray_node_id) in [(node.node_id, ray) for node, ray in look.moves]
        # Looked at again: the refusal holds and nothing is checked again.
        assert refresh(table, hosts, listed, now + 1).moves == []
        assert [r for r, _ in hosts.refused_live()] == [intruder.ray_node_id]
        assert sorted(hosts.live_nodes()) == sorted([*nodes, f"ray-plain-{round_}", f"ray-plain-{round_ + 1}"])
        live = {h.ray_node_id for h in listed}
        assert set(hosts._identified) <= live and set(hosts._refused) <= live
        assert all(table.get(node).past_ray_nodes <= live for node in nodes)  # not one per restart
        assert len(hosts._identified) == len(nodes) and len(hosts._refused) == 1
        assert len(hosts._duplicates_told) == (len(nodes) if round_ % 2 else 0)
    refresh(table, hosts, [], 200 * 100)  # every Ray node left
    assert hosts._identified == {} and hosts._refused == {} and hosts._duplicates_told == set()
    assert all(table.get(node).past_ray_nodes == set() for node in nodes)


def test_a_ray_node_listed_again_after_a_list_without_it_is_checked_again():
    table, hosts = tables()
    refresh(table, hosts, [host("ray-1", A)], 0, refuse=frozenset({"ray-1"}))
    refresh(table, hosts, [], 100)
    look = refresh(table, hosts, [host("ray-1", A)], 200)  # a new host as far as the map knows: checked, and passes
    assert [(node.node_id, ray) for node, ray in look.moves] == [(A, "ray-1")]
    assert hosts.refused_live() == [] and hosts.live_nodes() == [A]


def test_the_ray_node_of_a_node_without_a_record():
    _, hosts = tables()
    assert hosts.ray_node_of(None) is None
    assert hosts.ray_node_of("ray-1") == "ray-1"  # a Ray node id names itself
    assert hosts.ray_node_of(A) is None  # a host's node is on no Ray node until it is moved there


# --- properties -------------------------------------------------------------------------------------


RAY_NODES = [f"ray-{i:02d}" for i in range(8)]
LABELS = [None, A, B, node_id(0xC)]


@settings(max_examples=200, deadline=None)
@given(
    labels=st.lists(st.sampled_from(LABELS), min_size=len(RAY_NODES), max_size=len(RAY_NODES)),
    refused=st.frozensets(st.sampled_from(RAY_NODES), max_size=2),
    steps=st.lists(st.tuples(st.frozensets(st.sampled_from(RAY_NODES)), st.frozensets(st.sampled_from(LABELS[1:]))), max_size=12),
)
def test_each_node_is_on_at_most_one_usable_ray_node_and_a_lone_new_one_takes_it(labels, refused, steps):
    """Through Ray nodes coming and going (a Ray node's label fixed for its life), nodes heard or silent,
    and some hosts refused: every usable host is its node now, no node has two, nothing refused or left is
    used, a refusal holds while its Ray node is listed, a node never returns to a Ray node it left, each
    duplicate set is reported once while its Ray nodes stay listed, a node carried by exactly one Ray node
    it never left and not refused is on it after the look, and the map keeps checks and refusals of listed
    Ray nodes only."""
    label_of = dict(zip(RAY_NODES, labels))
    table, hosts = tables()
    reported: set[tuple[str, tuple[str, ...]]] = set()
    refused_seen: set[str] = set()
    for step, (listed_ids, alive) in enumerate(steps):
        now = (step + 1) * LEASE_MS  # each step a lease timeout later: only the nodes heard now are alive
        for node in alive:
            heard(table, node, now)
        listed = [host(r, label_of[r]) for r in sorted(listed_ids)]
        lone = {}  # node id -> the one Ray node carrying it that it never left and that was not refused before
        for label in LABELS[1:]:
            past = table.get(label).past_ray_nodes if label in table else set()
            fresh = [r for r in listed_ids if label_of[r] == label and r not in refused_seen and r not in past]
            if len(fresh) == 1:
                lone[label] = fresh[0]
        look = refresh(table, hosts, listed, now, refuse=refused)
        # A refusal lasts while Ray lists its Ray node; one listed again after a list without it is a new host.
        assert {r for r, _ in hosts.refused_live()} >= refused_seen & set(listed_ids)
        refused_seen = {r for r, _ in hosts.refused_live()}
        for duplicate in look.duplicates:
            told = (duplicate.node_id, duplicate.ray_node_ids)
            assert told not in reported
            reported.add(told)
            assert duplicate.kept in duplicate.ray_node_ids and len(duplicate.ray_node_ids) > 1
        reported = {told for told in reported if set(told[1]) <= listed_ids}  # reported again once all are back
        assert len(hosts._identified) + len(hosts._refused) <= len(listed_ids)  # kept for live Ray nodes only
        usable = hosts.usable()
        assert {h.ray_node_id for h in usable} <= set(listed_ids) - refused_seen
        by_node: dict[str, list[str]] = {}
        for h in usable:
            by_node.setdefault(h.node_id, []).append(h.ray_node_id)
            if h.labelled:
                assert table.get(h.node_id).ray_node_id == h.ray_node_id
        assert all(len(ray_node_ids) == 1 for ray_node_ids in by_node.values())
        for label in LABELS[1:]:
            node = table.get(label)
            if node is not None:
                assert node.ray_node_id not in node.past_ray_nodes
        for label, ray_node_id in lone.items():
            if ray_node_id not in refused:  # its check succeeds: the node is there now
                assert table.get(label).ray_node_id == ray_node_id and hosts.ray_node_of(label) == ray_node_id
                assert label in hosts.live_nodes()
            else:  # refused now, and the node stays where it was
                assert ray_node_id in {r for r, _ in hosts.refused_live()} and table.get(label).ray_node_id != ray_node_id
