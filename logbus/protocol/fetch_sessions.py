"""Consumers' fetch sessions on a leader: where each session's last answered fetch ended.

A consumer keeps several fetches in flight, each sent before the previous
reply arrived, so each names the offset the consumer knew when it sent it.
In a session, a fetch starts where the session's last *answered* fetch
ended, if that is past its offset: pipelined fetches then continue one
another instead of reading the same batches again. A fetch is remembered
only once its reply is packaged (a reply refused on the way, say too large
for its transport, leaves the session where it was).

At most ``FETCH_SESSIONS_MAX`` sessions are remembered; the least recently
used is forgotten first (its consumer's next fetch then reads from the
offset it names, which is always correct, only perhaps a repeat). A leader
forgets them all when its leadership changes: a position learnt under
another leadership may be past a truncation.

Plain state, no I/O; not thread-safe (the replica's event loop owns it).
"""

from __future__ import annotations

from collections import OrderedDict

FETCH_SESSIONS_MAX = 1024


class FetchSessions:
    """Session id -> the offset its last answered fetch ended at, least recently used first."""

    def __init__(self, sessions_max: int = FETCH_SESSIONS_MAX) -> None:
        if sessions_max < 1:
            raise ValueError(f"sessions_max must be at least 1, not {sessions_max}")
        self.sessions_max = sessions_max
        self._positions: OrderedDict[int, int] = OrderedDict()

    def start_offset(self, session: int | None, offset: int) -> int:
        """Where a fetch at ``offset`` in ``session`` (None: no session) reads from."""
        if session is None:
            return offset
        return max(offset, self._positions.get(session, 0))

    def answered(self, session: int, next_offset: int) -> None:
        """A fetch of ``session`` was answered up to ``next_offset``: the session never moves back."""
        positions = self._positions
        positions[session] = max(next_offset, positions.get(session, 0))
        positions.move_to_end(session)
        if len(positions) > self.sessions_max:
            positions.popitem(last=False)

    def clear(self) -> None:
        self._positions.clear()

    def __len__(self) -> int:
        return len(self._positions)

    def __contains__(self, session: int) -> bool:
        return session in self._positions
