"""Option checks shared by every client, the command line and Ray Data: one rule per kind of value.

Each check takes the option's name and the value given, returns the value
(in seconds, for durations given in ms) and otherwise raises
InvalidConfigError naming both, in one form everywhere::

    fetch_max_bytes must be an int from 1 to 2147483647, not 0
    session_timeout_ms must be an int of ms from 1 to 2147483647, not -5
    timeout_ms must be a number of ms from 0 to 2147483647, not nan

Rules common to all of them: a bool is never a number (``True`` is not 1
here, though Python says it is), NaN is never a number, and every bound is
inclusive. Durations have an upper bound, so every wait stays within what
``threading``'s waits take (an infinite or huge wait raises OverflowError
deep inside otherwise): ms at most ``MS_MAX`` (Kafka's int timeouts, about
24.8 days), seconds at most ``threading.TIMEOUT_MAX``. A duration that may
be unlimited says so with ``forever``: then None (and infinity, for ms, as
kafka-python's ``consumer_timeout_ms`` takes it) mean no limit.

The command line parses its flags' text into numbers and runs the same
checks (``logbus/cli/_common.py``), so a flag and the option it sets fail
with the same words.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Callable

from logbus.errors import InvalidConfigError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MS_MAX = INT32_MAX  # durations in ms: Kafka's int timeouts
SECONDS_MAX = threading.TIMEOUT_MAX  # durations in seconds: what threading's waits take


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _or_none(none_ok: bool) -> str:
    return " or None" if none_ok else ""


def check_int(name: str, value, minimum: int = 1, maximum: int = INT64_MAX, *, none_ok: bool = False, unit: str = "") -> int | None:
    """``value`` if it is an int (not a bool) from ``minimum`` to ``maximum`` (or None, with ``none_ok``).

    ``unit`` ("ms", "bytes") goes into the message: "an int of ms from ...".
    """
    if value is None and none_ok:
        return None
    if not _is_int(value) or not minimum <= value <= maximum:
        of = f" of {unit}" if unit else ""
        raise InvalidConfigError(f"{name} must be an int{of} from {minimum} to {maximum}{_or_none(none_ok)}, not {value!r}")
    return value


def check_ms(
    name: str, value, minimum: float = 0, maximum: float = MS_MAX, *, positive: bool = False, forever: bool = False
) -> float | None:
    """A duration in ms (an int or a float), as seconds: from ``minimum`` (above 0, with ``positive``)
    to ``maximum``. With ``forever``, None and infinity mean no limit (returned as None)."""
    if forever and (value is None or (_is_number(value) and value == math.inf)):
        return None
    if not _is_number(value) or not minimum <= value <= maximum or (positive and value <= 0):
        unlimited = ", or None for no limit" if forever else ""
        bounds = f"above 0, at most {maximum}" if positive else f"from {minimum} to {maximum}"
        raise InvalidConfigError(f"{name} must be a number of ms {bounds}{unlimited}, not {value!r}")
    return float(value) / 1000


def check_seconds(
    name: str, value, minimum: float = 0, maximum: float = SECONDS_MAX, *, positive: bool = False, none_ok: bool = False
) -> float | None:
    """A duration in seconds (an int or a float) from ``minimum`` (above 0, with ``positive``) to
    ``maximum`` (or None, with ``none_ok``)."""
    if value is None and none_ok:
        return None
    if not _is_number(value) or not minimum <= value <= maximum or (positive and value <= 0):
        bounds = f"above 0, at most {maximum:g}" if positive else f"from {minimum} to {maximum:g}"
        raise InvalidConfigError(f"{name} must be a number of seconds {bounds}{_or_none(none_ok)}, not {value!r}")
    return float(value)


def check_number(name: str, value, minimum: float = 0, maximum: float = math.inf, *, none_ok: bool = False) -> float | None:
    """A finite number (an int or a float) from ``minimum`` to ``maximum`` (or None, with ``none_ok``)."""
    if value is None and none_ok:
        return None
    if not _is_number(value) or math.isinf(value) or not minimum <= value <= maximum:
        upper = f" to {maximum:g}" if maximum != math.inf else " or more"
        raise InvalidConfigError(f"{name} must be a finite number from {minimum:g}{upper}{_or_none(none_ok)}, not {value!r}")
    return value


def check_flag(name: str, value, *, none_ok: bool = False) -> bool | None:
    """``value`` if it is True or False (not 1, not "false"), or None with ``none_ok``."""
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{name} must be True or False{_or_none(none_ok)}, not {value!r}")
    return value


def check_choice(name: str, value, choices: tuple):
    """``value`` if it is one of ``choices`` (compared with its type: 1.0 is not 1, True is not 1)."""
    if not any(value.__class__ is choice.__class__ and value == choice for choice in choices):
        raise InvalidConfigError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, not {value!r}")
    return value


def check_callable(name: str, value, takes: str, *, none_ok: bool = True) -> Callable | None:
    """``value`` if it is callable (or None, with ``none_ok``); ``takes`` says what it is called with."""
    if value is None and none_ok:
        return None
    if not callable(value):
        raise InvalidConfigError(f"{name} must be a callable taking {takes}{_or_none(none_ok)}, not {value!r}")
    return value
