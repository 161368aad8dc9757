"""One mechanism for a broken invariant: ``invariant.check`` raises one error type, ``-O`` keeps it,
and a process that installs the actors' handler ends there (exit code 70), whatever ``except``
clauses lie between the check and the process's edge. The handler is tried in real processes."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import logbus
from logbus import invariant
from logbus.errors import InternalStateError, InvariantViolationError, LogbusError

PACKAGE = pathlib.Path(logbus.__file__).parent
REPO = PACKAGE.parent


def run_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_a_broken_invariant_raises_the_one_internal_error_type():
    invariant.check(True, "holds")
    with pytest.raises(InvariantViolationError, match="^the log end moved back$") as raised:
        invariant.check(False, "the log end moved back")
    error = raised.value
    assert isinstance(error, InternalStateError) and isinstance(error, LogbusError)
    assert not isinstance(error, AssertionError)  # not an assert: callers catch logbus's own tree
    assert error.retriable is False
    with pytest.raises(InvariantViolationError, match="directly"):
        invariant.violated("directly")


def test_the_handler_runs_before_the_error_is_raised():
    seen = []
    invariant.on_violation(lambda error: seen.append(str(error)))
    try:
        with pytest.raises(InvariantViolationError):
            invariant.check(False, "two owners of t-0")
        invariant.check(True, "not called for a rule that holds")
    finally:
        invariant.on_violation(None)
    assert seen == ["two owners of t-0"]


def test_python_dash_O_keeps_the_checks():
    done = run_python("from logbus.invariant import check\nassert False, 'asserts are gone under -O'\ncheck(False, 'still checked')", "-O")
    assert done.returncode == 1
    assert "InvariantViolationError: still checked" in done.stderr
    assert "asserts are gone" not in done.stderr


def test_no_module_has_a_check_of_its_own():
    """Every broken rule goes through invariant.check: no ``raise AssertionError`` left in logbus."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if getattr(raised, "id", None) == "AssertionError":
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


ACTOR_PROCESS = """
import functools, logging
from logbus import invariant
from logbus.actors import invariant_exit
logging.basicConfig(level=logging.INFO)
invariant.on_violation(functools.partial(invariant_exit.end_process, "replica t-0/1"))

def follower_loop():
    # The shape of a retry loop: a broad except and a finally, neither of which may see the violation.
    for attempt in range(3):
        try:
            invariant.check(attempt != 1, "the log end is 5 after a batch at [3, 4)")
            print("attempt", attempt, "passed", flush=True)
        except Exception as error:
            print("swallowed", repr(error), flush=True)
        finally:
            print("finally ran", attempt, flush=True)

follower_loop()
print("carried on", flush=True)
"""


def test_the_actors_handler_ends_the_process_where_the_check_failed():
    done = run_python(ACTOR_PROCESS)
    assert done.returncode == 70  # invariant_exit.INVARIANT_EXIT_CODE
    assert done.stdout.splitlines() == ["attempt 0 passed", "finally ran 0"]  # nothing ran after the check
    assert "replica t-0/1: invariant broken, ending process" in done.stderr
    assert "the log end is 5 after a batch at [3, 4)" in done.stderr
    assert "in follower_loop" in done.stderr  # where it broke


def test_outside_an_actor_process_the_handler_is_not_installed():
    """The driver (and a test building an actor's class without Ray) keeps the default: raise."""
    done = run_python(
        "from logbus import invariant\nfrom logbus.actors.invariant_exit import exit_on_violation\n"
        "print(exit_on_violation('controller'), invariant._handler)\ninvariant.check(False, 'raised')"
    )
    assert done.stdout.split() == ["False", "None"]
    assert done.returncode == 1 and "InvariantViolationError: raised" in done.stderr
