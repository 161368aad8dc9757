"""The shared retry helper (logbus/retry.py): bounded exponential backoff within a deadline."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError, LeaderNotAvailableError, RequestTimedOutError
from logbus.retry import Backoff, retry_until


@given(st.floats(0.001, 1), st.integers(1, 8), st.integers(1, 30))
def test_waits_double_up_to_the_bound_and_start_over_after_a_success(min_s, factor, tries):
    backoff = Backoff(min_s, min_s * factor)
    delays = [backoff.delay_s(0.0) for _ in range(tries)]
    assert delays == [min(min_s * 2**i, min_s * factor) for i in range(tries)]
    backoff.succeeded()
    assert backoff.delay_s(0.0) == min_s


@given(st.floats(0, 100), st.floats(0.01, 10))
def test_no_retry_starts_at_or_past_the_deadline(now, left_s):
    backoff = Backoff(deadline_s=now + left_s)
    t = now
    while (delay := backoff.delay_s(t)) is not None:
        assert t + delay < now + left_s
        t += delay


def test_retry_until_retries_retriable_errors_until_the_deadline():
    calls = []

    def flaky(left_s):
        calls.append(left_s)
        if len(calls) < 3:
            raise LeaderNotAvailableError("electing")
        return "done"

    forgot = []
    assert retry_until(time.monotonic() + 30, "reading", flaky, forgot.append) == "done"
    assert len(calls) == 3 and len(forgot) == 2

    def never(_left_s):
        raise LeaderNotAvailableError("still electing")

    with pytest.raises(RequestTimedOutError, match="reading did not complete within its timeout; last error: still electing"):
        retry_until(time.monotonic() + 0.2, "reading", never)

    def wrong(_left_s):
        raise InvalidConfigError("bad")

    with pytest.raises(InvalidConfigError):
        retry_until(time.monotonic() + 30, "reading", wrong)
    with pytest.raises(LeaderNotAvailableError):  # a caller may refuse to retry what is retriable elsewhere
        retry_until(time.monotonic() + 30, "reading", never, retriable=lambda error: False)
