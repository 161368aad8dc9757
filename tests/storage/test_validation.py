"""Validation of topic configs, topic names and partition numbers: bad input gets a named, non-retriable error."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.errors import InvalidConfigError, InvalidPartitionError, InvalidTopicError
from logbus.storage.log_config import INT_MAX, LONG_MAX, LogConfig
from logbus.storage.names import PARTITION_MAX, partition_dir_name, validate_partition, validate_topic_name

INT_KEYS = [key for key, (_, kind, _, _) in LogConfig.KEYS.items() if kind is int]

# Anything a caller might pass by mistake: wrong types, odd numbers, odd strings.
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


# --- LogConfig.from_dict ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", INT_KEYS)
def test_integer_configs_accept_their_whole_range_and_nothing_beyond(key):
    _, _, lowest, highest = LogConfig.KEYS[key]
    assert LogConfig.from_dict({key: lowest}).to_dict()[key] == lowest
    assert LogConfig.from_dict({key: highest}).to_dict()[key] == highest
    assert LogConfig.from_dict({key: str(highest)}).to_dict()[key] == highest  # the CLI passes strings
    for bad in (lowest - 1, highest + 1, 10**30):
        with pytest.raises(InvalidConfigError, match=key):
            LogConfig.from_dict({key: bad})


def test_limits_follow_kafkas_int_and_long_types():
    assert LogConfig.KEYS["segment.bytes"][3] == INT_MAX == 2**31 - 1
    assert LogConfig.KEYS["max.message.bytes"][3] == INT_MAX
    assert LogConfig.KEYS["retention.ms"][3] == LONG_MAX == 2**63 - 1


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("raw", [math.inf, -math.inf, math.nan, 1.5, True, False, None, b"5", "5.0", "soon", "", [], {}])
def test_integer_configs_reject_values_that_are_not_integers(key, raw):
    with pytest.raises(InvalidConfigError, match=key) as caught:
        LogConfig.from_dict({key: raw})
    assert not caught.value.retriable


@pytest.mark.parametrize(
    "config, message",
    [
        ({"flush.policy": 1}, "flush.policy must be a string"),
        ({"flush.policy": "sometimes"}, "flush.policy must be one of"),
        ({"unclean.leader.election.enable": 1}, "must be true or false"),
        ({"unclean.leader.election.enable": "yes"}, "must be true or false"),
        ({"no.such.key": 1}, "unknown topic config 'no.such.key'"),
        ({None: 1}, "unknown topic config None"),
        ([("retention.ms", 1)], "config must be a dict"),
        ("retention.ms=1", "config must be a dict"),
    ],
)
def test_bad_configs_say_what_was_wrong(config, message):
    with pytest.raises(InvalidConfigError, match=message):
        LogConfig.from_dict(config)


def test_the_base_config_must_be_a_log_config():
    with pytest.raises(InvalidConfigError, match="base must be a LogConfig"):
        LogConfig.from_dict({"retention.ms": 1}, base={"retention.ms": 2})
    assert LogConfig.from_dict({"retention.ms": 1}, base=LogConfig(segment_ms=5)).segment_ms == 5


@given(key=st.sampled_from(list(LogConfig.KEYS)), raw=ANYTHING)
def test_from_dict_either_accepts_a_value_or_names_the_mistake(key, raw):
    """No raw TypeError/ValueError/OverflowError: whatever the value, a LogConfig or InvalidConfigError."""
    try:
        config = LogConfig.from_dict({key: raw})
    except InvalidConfigError as error:
        assert key in str(error) and not error.retriable
        return
    value = config.to_dict()[key]
    attribute, kind, lowest, highest = LogConfig.KEYS[key]
    assert type(value) is kind
    if kind is int:
        assert lowest <= value <= highest


# --- names -------------------------------------------------------------------------------------------


@given(number=st.integers())
def test_partition_numbers_are_int32s_from_zero(number):
    if 0 <= number <= PARTITION_MAX:
        assert validate_partition(number) == number
    else:
        with pytest.raises(InvalidPartitionError) as caught:
            validate_partition(number)
        assert not caught.value.retriable


@pytest.mark.parametrize("partition", [None, True, False, 1.0, "0", b"0", [], math.nan])
def test_partition_numbers_must_be_ints(partition):
    with pytest.raises(InvalidPartitionError, match="partition must be an int"):
        validate_partition(partition)
    with pytest.raises(InvalidPartitionError):
        partition_dir_name("topic", partition)


@given(name=ANYTHING)
def test_topic_name_validation_names_every_mistake(name):
    try:
        assert validate_topic_name(name) == name
    except InvalidTopicError as error:
        assert not error.retriable
