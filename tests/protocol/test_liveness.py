"""The controller's lease bookkeeping: grace for new replicas, silence, and stalls not counted."""

from hypothesis import given, settings
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
