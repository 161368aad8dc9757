"""Validation of names that become paths: a topic name never escapes the data directory."""

from __future__ import annotations

import re

from logbus.errors import InvalidPartitionError, InvalidTopicError

TOPIC_NAME_LENGTH_MAX = 249  # Kafka's limit: leaves room for "-{partition}" in a 255-byte file name
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]+")
INTERNAL_TOPIC_PREFIX = "__"
PARTITION_MAX = 2**31 - 1  # partition numbers are int32, as in Kafka and the consumer's Arrow columns


def validate_topic_name(name: object) -> str:
    """Return ``name`` if it is a legal topic name, else raise InvalidTopicError.

    Legal: a str of 1 to 249 characters from ``[a-zA-Z0-9._-]``, not '.' or '..'.
    Checked before any path is built from the name.
    """
    if not isinstance(name, str):
        raise InvalidTopicError(f"topic name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidTopicError("topic name must not be empty")
    if name in (".", ".."):
        raise InvalidTopicError(f"topic name cannot be {name!r}")
    if len(name) > TOPIC_NAME_LENGTH_MAX:
        raise InvalidTopicError(f"topic name is {len(name)} characters; the limit is {TOPIC_NAME_LENGTH_MAX}")
    if not _TOPIC_NAME.fullmatch(name):
        raise InvalidTopicError(f"topic name {name!r} has characters outside [a-zA-Z0-9._-]")
    return name


def validate_partition(partition: object) -> int:
    """Return ``partition`` if it can be a partition number (an int in 0..2**31-1), else raise InvalidPartitionError.

    Whether the topic has that partition is checked where its partition count is known.
    """
    if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition <= PARTITION_MAX:
        raise InvalidPartitionError(f"partition must be an int in 0..{PARTITION_MAX}, not {partition!r}")
    return partition


def partition_dir_name(topic: str, partition: int) -> str:
    """The directory of one partition replica's log: ``{topic}-{partition}``."""
    return f"{validate_topic_name(topic)}-{validate_partition(partition)}"
