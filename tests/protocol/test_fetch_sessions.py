"""Fetch sessions: pipelined fetches continue one another; the least recently used session is forgotten first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.protocol.fetch_sessions import FetchSessions


def test_a_session_continues_where_its_last_answered_fetch_ended():
    sessions = FetchSessions()
    assert sessions.start_offset(7, 100) == 100  # a new session reads where it asks
    sessions.answered(7, 150)
    assert sessions.start_offset(7, 100) == 150  # a pipelined fetch sent before that reply arrived
    assert sessions.start_offset(7, 200) == 200  # past it: where it asks
    assert sessions.start_offset(None, 100) == 100  # no session
    sessions.answered(7, 120)  # a slower reply of an earlier fetch: the session never moves back
    assert sessions.start_offset(7, 0) == 150


def test_the_least_recently_used_session_is_forgotten_first():
    sessions = FetchSessions(sessions_max=2)
    sessions.answered(1, 10)
    sessions.answered(2, 20)
    sessions.answered(1, 11)  # 1 is now the most recent
    sessions.answered(3, 30)
    assert 2 not in sessions and 1 in sessions and 3 in sessions and len(sessions) == 2
    assert sessions.start_offset(2, 5) == 5  # forgotten: it reads where it asks (always correct)
    sessions.clear()
    assert len(sessions) == 0
    with pytest.raises(ValueError):
        FetchSessions(sessions_max=0)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1_000)), max_size=60), st.integers(1, 4))
def test_sessions_are_bounded_and_monotone(answers, sessions_max):
    sessions = FetchSessions(sessions_max)
    highest: dict[int, int] = {}
    for session, offset in answers:
        expected = max(offset, highest.get(session, 0))
        sessions.answered(session, offset)
        highest[session] = expected
        highest = {s: position for s, position in highest.items() if s in sessions}  # forgotten ones start over
        assert len(sessions) <= sessions_max
        assert sessions.start_offset(session, 0) == expected
