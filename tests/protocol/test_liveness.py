"""The controller's lease bookkeeping: grace for new replicas, silence, and stalls not counted."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from logbus.protocol import liveness
from logbus.protocol.liveness import Liveness


def test_constants_keep_a_deposed_leader_stopped_before_another_is_elected():
    assert liveness.LEASE_TIMEOUT_MS > liveness.LEASE_MS + liveness.HEARTBEAT_INTERVAL_MS


def test_a_replica_is_alive_until_silent_longer_than_the_timeout():
    lv = Liveness(now_ms=0, lease_timeout_ms=700, restart_grace_ms=0)
    lv.heard("r", 1_000)
    assert lv.alive("r", 1_700)
    assert not lv.alive("r", 1_701)
    assert lv.silent_ms("r", 1_701) == 701


def test_unknown_replicas_get_the_restart_grace():
    lv = Liveness(now_ms=10_000, lease_timeout_ms=700, restart_grace_ms=3_000)
    assert lv.alive("never-heard", 13_700)
    assert not lv.alive("never-heard", 13_701)


def test_a_new_replica_is_alive_through_its_start_up_grace():
    lv = Liveness(now_ms=0, lease_timeout_ms=700, restart_grace_ms=0)
    lv.expect("new", 5_000, grace_ms=30_000)
    assert lv.alive("new", 35_700)
    assert not lv.alive("new", 35_701)
    lv.heard("new", 6_000)  # its first heartbeat ends the grace
    assert not lv.alive("new", 6_701)


def test_a_stalled_tick_does_not_count_against_leases():
    lv = Liveness(now_ms=0, lease_timeout_ms=700, restart_grace_ms=0)
    assert lv.tick(0, 100) == 0
    lv.heard("r", 50)
    # The controller stalled for 2 s: the next tick is 1.9 s late; heartbeats queued behind the stall
    # must not make r look dead.
    assert lv.tick(2_100, 100) == 2_000
    assert lv.alive("r", 2_100)
    # A tick that is merely a little late changes nothing.
    assert lv.tick(2_250, 100) == 50
    assert lv.silent_ms("r", 2_250) == 2_250 - 50 - 2_000


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["heard", "tick"]), st.integers(1, 400)), max_size=40))
def test_a_replica_heard_within_the_timeout_is_never_judged_dead(steps):
    """Whatever the ticks do, a replica heard at most LEASE_TIMEOUT_MS ago counts as alive."""
    lv = Liveness(now_ms=0, restart_grace_ms=0)
    now, last_heard = 0, 0
    lv.heard("r", 0)
    lv.tick(0, 100)
    for kind, advance in steps:
        now += advance
        if kind == "heard":
            lv.heard("r", now)
            last_heard = now
        else:
            lv.tick(now, 100)
        if now - last_heard <= liveness.LEASE_TIMEOUT_MS:
            assert lv.alive("r", now)



def _isolation_case(**options) -> Liveness:
    """Two nodes heard at 0 and 100, ticks every 100 ms from 0."""
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400, rejoin_ms=1_000, **options)
    lv.heard("a", 0)
    lv.heard("b", 100)
    return lv


def _ticks(lv: Liveness, start_ms: int, end_ms: int) -> None:
    for now in range(start_ms, end_ms + 1, 100):
        lv.tick(now, 100)


def test_a_silence_of_every_node_at_once_is_not_counted_against_their_leases():
    lv = _isolation_case()
    _ticks(lv, 0, 5_000)  # nobody heard for 5 s: this controller is cut off (or everyone is down)
    assert lv.isolated and lv.isolations == 1
    assert lv.alive("a", 5_000) and lv.alive("b", 5_000)
    assert lv.isolated_ms > 4_000
    # One node is heard again: the isolation ends, and the other gets the rejoin time plus a lease to be heard.
    lv.heard("b", 5_050)
    _ticks(lv, 5_100, 5_100)
    assert not lv.isolated and lv.isolated_ms == 0
    assert lv.rejoining() == 1
    assert lv.alive("a", 5_100 + 1_000 + 800)
    assert not lv.alive("a", 5_100 + 1_000 + 801)  # still silent after that: its lease runs out as usual
    lv.heard("a", 5_500)
    assert lv.rejoining() == 0
    assert lv.isolated_total_ms > 4_000


def test_a_silence_of_one_node_while_another_is_heard_counts_as_always():
    lv = _isolation_case()
    for now in range(100, 2_001, 100):
        lv.heard("b", now)
        lv.tick(now, 100)
    assert not lv.isolated and lv.isolations == 0
    assert not lv.alive("a", 2_000)


def test_isolation_keeps_a_key_alive_no_longer_than_its_bound_past_its_last_heartbeat():
    lv = _isolation_case(isolation_credit_max_ms=3_000)
    _ticks(lv, 0, 10_000)
    assert lv.isolated
    assert lv.alive("a", 3_800) and not lv.alive("a", 10_000) and not lv.alive("b", 10_000)
    # Heard again after the bound: the nodes that ran out meanwhile stay dead.
    lv.heard("b", 10_050)
    _ticks(lv, 10_100, 10_100)
    assert not lv.isolated and lv.rejoining() == 0
    assert lv.alive("b", 10_100) and not lv.alive("a", 10_100)


def test_silences_that_come_and_go_do_not_keep_a_dead_node_alive_for_good():
    """A live node heard only now and then (or a controller host cut and healed again and again) starts
    one isolation after another; a dead node is kept alive by them only up to the bound past its last
    heartbeat, not by a fresh bound each time."""
    lv = _isolation_case(isolation_credit_max_ms=3_000)
    for now in range(100, 30_001, 100):
        if now % 600 == 0:
            lv.heard("b", now)
        lv.tick(now, 100)
    assert lv.isolations > 10
    assert not lv.alive("a", 30_000)
    assert lv.alive("b", 30_000)


def test_a_node_already_dead_when_every_node_falls_silent_stays_dead():
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    lv.heard("dead", 0)
    for now in range(0, 1_501, 100):
        lv.heard("live", now)
        lv.tick(now, 100)
    assert not lv.alive("dead", 1_500)
    _ticks(lv, 1_600, 4_000)  # now nobody is heard
    assert lv.isolated
    assert lv.alive("live", 4_000) and not lv.alive("dead", 4_000)
    lv.heard("live", 4_050)
    _ticks(lv, 4_100, 4_100)
    assert not lv.alive("dead", 4_100)


def test_a_late_tick_as_isolation_begins_loses_no_node_alive_at_the_tick_before():
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    lv.heard("older", 0)
    lv.heard("newer", 200)  # heartbeats are 200 ms apart: a routine spread
    _ticks(lv, 0, 700)
    lv.tick(890, 100)  # 90 ms late: not a stall; "older" was alive at the tick before, silent 890 ms now
    assert lv.isolated
    assert lv.alive("older", 890) and lv.alive("newer", 890)


def test_a_start_up_grace_neither_hides_an_isolation_nor_ends_one():
    lv = _isolation_case()
    lv.expect("starting", 0, grace_ms=30_000)
    _ticks(lv, 0, 2_000)
    assert lv.isolated and lv.alive("a", 2_000)
    lv.expect("another", 2_050, grace_ms=30_000)
    _ticks(lv, 2_100, 3_000)
    assert lv.isolated and lv.isolations == 1 and lv.rejoining() == 0


def test_nothing_is_counted_as_an_isolation_when_no_node_is_alive_to_keep():
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    lv.heard("only", 0)
    _ticks(lv, 0, 1_000)  # counted alive by the rule, up to its bound
    lv.forget("only")  # its agent stopped: no node left
    _ticks(lv, 1_100, 2_000)
    assert not lv.isolated


def test_a_node_that_leaves_takes_its_heartbeats_out_of_the_isolation_rule():
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    lv.heard("stays", 0)
    lv.heard("leaves", 300)  # the newest heartbeat
    lv.forget("leaves")  # its agent stopped
    _ticks(lv, 100, 600)  # "stays" alone has been silent 600 ms: every node left is silent
    assert lv.isolated and lv.alive("stays", 600)
    lv.heard("back", 650)
    _ticks(lv, 700, 700)
    assert not lv.isolated


def test_a_silence_right_after_a_stall_is_seen_as_one():
    """Heartbeats handled after a stall but before its late tick are moved on by the stall, into the
    future; the next ones move them back. The silence after them is still seen as every node's."""
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    for now in range(0, 1_001, 100):
        if now % 200 == 0:
            lv.heard("a", now)
            lv.heard("b", now)
        lv.tick(now, 100)
    lv.heard("a", 1_900)  # queued behind the stall, handled before the late tick
    lv.heard("b", 1_900)
    lv.tick(1_900, 100)  # 800 ms late: a stall
    for now in range(2_000, 2_201, 100):
        lv.tick(now, 100)
    lv.heard("a", 2_200)
    lv.heard("b", 2_200)
    _ticks(lv, 2_300, 3_600)  # then no node at all: this controller is cut off
    assert lv.isolated and lv.alive("a", 3_600) and lv.alive("b", 3_600)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "expect", "forget", "tick", "tick"]), st.integers(1, 1_500)),
                max_size=60))
def test_the_newest_heartbeat_kept_is_the_newest_of_the_nodes_heard(steps):
    """The isolation rule reads the newest heartbeat of all, kept as heartbeats come (not a max over every
    node each tick): it is that max after any heartbeats, expectations, departures, stalls and ticks."""
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400)
    now = 0
    for kind, advance in steps:
        now += advance  # an advance past the tick interval is a stall at the next tick
        if kind in ("a", "b", "c"):
            lv.heard(kind, now)
        elif kind == "expect":
            lv.expect("a", now)
        elif kind == "forget":
            lv.forget("b")
        else:
            lv.tick(now, 100)
        assert lv._newest_heard_ms == max(lv._heard_ms.values(), default=None)


def test_a_stall_and_an_isolation_are_not_counted_twice():
    lv = _isolation_case()
    _ticks(lv, 0, 1_000)
    assert lv.isolated
    credited = lv.isolated_ms
    lv.tick(3_100, 100)  # the process stalled 2 s as well: the stall rule takes those, this rule the rest
    assert lv.isolated_ms - credited == 100
    assert lv.alive("a", 3_100)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "tick", "tick", "tick"]), st.integers(1, 600)), max_size=80),
       st.integers(0, 5_000))
@example(([("tick", 100)] * 5 + [("b", 100)]) * 10, 5_000)
def test_a_node_heard_within_the_timeout_is_alive_and_isolation_keeps_none_past_its_bound(steps, credit_max):
    """Isolation never shortens a lease (a node heard at most the timeout ago is alive), and keeps no node
    alive past the bound after its last heartbeat, however silences come and go."""
    lv = Liveness(now_ms=0, lease_timeout_ms=800, restart_grace_ms=0, isolated_after_ms=400,
                  isolation_credit_max_ms=credit_max, rejoin_ms=1_000)
    now, heard = 0, {"a": 0, "b": 0}
    lv.heard("a", 0)
    lv.heard("b", 0)
    lv.tick(0, 100)
    for kind, advance in steps:
        now += min(advance, 150)  # a tick at every step, on time: no stall compensation in this property
        if kind != "tick":
            lv.heard(kind, now)
            heard[kind] = now
        lv.tick(now, 100)
        for key, at in heard.items():
            if now - at <= 800:
                assert lv.alive(key, now)
            if now - at > credit_max + 800:
                assert not lv.alive(key, now)
