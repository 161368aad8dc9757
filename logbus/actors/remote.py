"""Ray calls as logbus sees them: ``get`` and ``unwrap`` turn Ray's errors into logbus errors.

The one bridge between Ray's exceptions and logbus's error tree, used by the
clients (``logbus/api``) and by actors that call other actors (the
controller's offsets client): a caller sees the logbus error a replica or the
controller raised, with its own message, never Ray's wrapper around it.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from logbus.errors import LeaderNotAvailableError, LogbusError, RequestTimedOutError

CONTROL_TIMEOUT_S = 120.0  # admin calls may start many actors on a busy machine


def unwrap(error: BaseException) -> BaseException:
    """The logbus error behind a Ray error, so users see ours (with its own message), not Ray's wrapper."""
    if isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, LogbusError):
            return cause
    if isinstance(error, GetTimeoutError):
        return RequestTimedOutError(str(error))
    if isinstance(error, RayError) and not isinstance(error, RayTaskError):
        # The actor died, is restarting, cannot be scheduled (its node is gone), or an
        # object was lost: the request may succeed against the partition's next leader.
        return LeaderNotAvailableError(f"the replica serving this request is unavailable: {type(error).__name__}: {error}")
    return error


def get(ref, timeout_s: float | None = CONTROL_TIMEOUT_S):
    """ray.get that raises logbus errors."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except RayError as error:
        raise unwrap(error) from None
