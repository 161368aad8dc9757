"""The shared option checks (logbus/options.py): one rule per kind of value, one error naming option and value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError
from logbus.options import MS_MAX, check_callable, check_choice, check_flag, check_int, check_ms, check_number, check_seconds

not_numbers = st.one_of(st.booleans(), st.none(), st.text(max_size=3), st.just(math.nan), st.lists(st.integers(), max_size=1))


def refused(check, name: str, value, *args, **kwargs) -> str:
    with pytest.raises(InvalidConfigError) as caught:
        check(name, value, *args, **kwargs)
    message = str(caught.value)
    assert message.startswith(f"{name} must be ") and message.endswith(f", not {value!r}"), message
    assert not caught.value.retriable
    return message


@given(st.integers(-(2**70), 2**70), st.integers(-5, 5), st.integers(-5, 10))
def test_ints_are_taken_within_their_bounds_and_named_outside(value, low, span):
    high = low + span
    if low <= value <= high:
        assert check_int("count", value, low, high) == value
    else:
        assert f"from {low} to {high}" in refused(check_int, "count", value, low, high)


@given(st.one_of(not_numbers, st.floats(-10, 10)))
def test_ints_refuse_bools_floats_and_the_rest(value):
    if isinstance(value, float) or not isinstance(value, int) or isinstance(value, bool):
        refused(check_int, "fetch_max_bytes", value, unit="bytes")


@given(st.one_of(st.integers(0, MS_MAX), st.floats(0, MS_MAX)))
def test_durations_in_ms_come_back_in_seconds(ms):
    assert check_ms("timeout_ms", ms) == pytest.approx(ms / 1000)


@given(st.one_of(not_numbers, st.integers(max_value=-1), st.just(math.inf), st.just(MS_MAX + 1)))
def test_durations_in_ms_refuse_the_rest(value):
    refused(check_ms, "timeout_ms", value)


def test_unlimited_and_positive_durations():
    assert check_ms("consumer_timeout_ms", None, forever=True) is None
    assert check_ms("consumer_timeout_ms", math.inf, forever=True) is None
    assert "or None for no limit" in refused(check_ms, "consumer_timeout_ms", -1, forever=True)
    assert "above 0" in refused(check_ms, "delivery_timeout_ms", 0, positive=True)
    assert check_ms("delivery_timeout_ms", 0.5, positive=True) == 0.0005
    assert check_seconds("timeout_s", None, none_ok=True) is None
    assert "above 0" in refused(check_seconds, "timeout_s", 0, positive=True)
    refused(check_seconds, "timeout_s", math.inf)
    assert check_number("num_cpus", 0.5) == 0.5
    refused(check_number, "num_cpus", math.inf, none_ok=True)


def test_flags_choices_and_callables():
    assert check_flag("check_crcs", False) is False
    for value in (1, 0, "false", None):
        refused(check_flag, "check_crcs", value)
    assert check_flag("enable_idempotence", None, none_ok=True) is None
    assert check_choice("acks", "all", (0, 1, "all", -1)) == "all"
    for value in (True, 1.0, "1", 2):  # equal to a choice is not enough: True == 1, 1.0 == 1
        refused(check_choice, "acks", value, (0, 1, "all", -1))
    assert check_callable("value_deserializer", None, "bytes") is None
    assert "a callable taking bytes" in refused(check_callable, "value_deserializer", b"json", "bytes")
    refused(check_callable, "run_batch", None, "(start, end, batch_id)", none_ok=False)
