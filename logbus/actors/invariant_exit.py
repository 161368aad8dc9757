"""What a replica's or the controller's process does when an invariant breaks: log it, and end.

A broken invariant (``logbus/invariant.py``) means the state in this
process's memory is wrong in a way logbus did not foresee. Carrying on
would serve it, replicate it or write it to disk; retrying would meet it
again (a follower's fetch loop once logged the same broken rule every 100
ms, for good). Its files are the truth instead: the process ends, and Ray,
which starts these actors with ``max_restarts=-1``, starts it again; the
constructor rebuilds the state from disk (a replica its log, recovered as
after any crash; the controller its metadata) and asks for its role again.
Meanwhile the node agent, which watches each replica's pid, reports it down
at once, so the controller moves leadership as for any dead replica.

The process ends with ``os._exit(INVARIANT_EXIT_CODE)`` (70, ``EX_SOFTWARE``:
an internal software error), after the violation is logged at error level
with where it broke and the log handlers are flushed. Not Ray's
``exit_actor()``: that is an intentional exit, which Ray does not restart;
nor an exception: every ``except Exception`` between the check and the
actor's edge would be a place to swallow it. Nothing else runs after the
check (no ``finally``, no write that was to follow).

Only a Ray actor's own worker process installs the handler (a driver or a
test that builds an actor's class without Ray keeps the default: raise).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback

import ray

from logbus import invariant
from logbus.errors import InvariantViolationError

logger = logging.getLogger(__name__)

INVARIANT_EXIT_CODE = 70  # EX_SOFTWARE (sysexits.h): an internal software error


def exit_on_violation(label: str) -> bool:
    """In a Ray actor's worker process: from now on a broken invariant ends this process (see the module
    docstring), its log line naming ``label`` (the replica or the controller). Returns whether it was
    installed (False outside an actor's process)."""
    if ray.get_runtime_context().get_actor_id() is None:
        return False
    invariant.on_violation(functools.partial(end_process, label))
    return True


def end_process(label: str, error: InvariantViolationError) -> None:
    """Log ``error`` at error level with the stack that found it, flush the logs, and end the process."""
    try:
        stack = "".join(traceback.format_stack()[:-2])  # up to the check (not this function, nor invariant.violated)
        logger.error(
            "%s: invariant broken, ending process %d (exit code %d) to restart from its files: %s\n%s",
            label, os.getpid(), INVARIANT_EXIT_CODE, error, stack,
        )
        for handler in logging.getLogger("logbus").handlers + logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(INVARIANT_EXIT_CODE)
