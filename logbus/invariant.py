"""Invariant checks where state changes: a broken invariant is a bug in logbus, and it crashes loudly.

One mechanism, two words (``errors.py``), for the two things a bug in logbus
can look like from inside:

- ``check(condition, message)`` raises :class:`~logbus.errors.InvariantViolationError`
  when a rule logbus's own state relies on does not hold: a post-condition
  after a change (the partition log after an append, a truncation,
  delete_records, recovery), or a step's inputs that show the state is
  already wrong (a segment handed a batch that does not continue it, a
  group with two owners of a partition). The state that found it cannot be
  trusted any more.
- :class:`~logbus.errors.InternalStateError` raised as itself is a refusal:
  one part of logbus asked another for a change its rules forbid, and the
  call was refused before anything changed. The state that refused is
  sound, so its owner goes on; the caller's view was stale or wrong (a
  retry after a restart, a race between two of the controller's tasks).
  These are the transaction coordinator's transitions
  (``protocol/transaction_coordinator.py``: markers written for a
  transaction it has not prepared, a transition applied twice, a producer
  id it was not given) and ``ClusterMetadata.complete_reassignment`` (a move
  not in progress, or not ready). Everything else is a ``check``.

``InvariantViolationError`` is an ``InternalStateError``: callers and tests that
mean "a bug in logbus" catch the one; those that must tell a refusal from
broken state catch the subclass.

What a violation does depends on the process. By default ``check`` raises,
and the caller sees the error (a client, the gateway, a unit test). A
process that owns durable state (a partition replica, the controller)
installs a handler with :func:`on_violation`; it runs before the error is
raised, wherever the check sits, so no ``except`` on the way (a fetch loop
that retries failed calls, a timer that must survive) can swallow it: the
replica's handler logs the violation and ends the process, and Ray restarts
the actor from its files (``logbus/actors/invariant_exit.py``).

``check`` is a function, not an ``assert`` statement, so ``python -O`` does
not remove it: the rules it guards (a high watermark that never moves back,
one owner per partition, a log end that moves by exactly what was appended)
are what keeps acknowledged records safe. Checks cost what they check: the
ones on hot paths are O(1), the ones over every segment run on rare
operations only.

Tests also break an invariant on purpose, to watch a replica end and come
back (``PartitionLog.test_hook_break_next_append``). Such a hook is refused
(:func:`require_test_hooks`) unless the process was started with
``LOGBUS_TEST_HOOKS=1`` in its environment: a production process cannot be
made to end by a stray call. The test suite sets it before it starts Ray, so
every Ray process it starts inherits it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn

from logbus.errors import IllegalStateError, InvariantViolationError

TEST_HOOKS_ENV = "LOGBUS_TEST_HOOKS"  # "1" in a process's environment: its test hooks may be used

_handler: Callable[[InvariantViolationError], None] | None = None


def check(condition: bool, message: str) -> None:
    """Raise InvariantViolationError(``message``) unless ``condition`` holds (after the process's handler, if any)."""
    if not condition:
        violated(message)


def violated(message: str) -> NoReturn:
    """A rule is broken: run the process's handler (:func:`on_violation`), then raise InvariantViolationError."""
    error = InvariantViolationError(message)
    if _handler is not None:
        _handler(error)
    raise error


def on_violation(handler: Callable[[InvariantViolationError], None] | None) -> None:
    """Call ``handler(error)`` at every broken invariant in this process, before it is raised (None: none).

    One handler per process: the owner of the process's durable state sets
    it (a replica or controller actor, in its own Ray worker process).
    """
    global _handler
    _handler = handler


def test_hooks_enabled() -> bool:
    """Whether this process was started with ``LOGBUS_TEST_HOOKS=1``: the test hooks that break an invariant on purpose may be used."""
    return os.environ.get(TEST_HOOKS_ENV) == "1"


def require_test_hooks(hook: str) -> None:
    """Refuse the test hook ``hook`` (IllegalStateError) unless :func:`test_hooks_enabled`."""
    if not test_hooks_enabled():
        raise IllegalStateError(
            f"{hook} is a test hook and is refused: this process was not started with {TEST_HOOKS_ENV}=1 in its environment"
        )
