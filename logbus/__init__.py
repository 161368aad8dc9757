"""logbus: a distributed, persistent, partitioned, replicated commit log on Ray.

    bus = logbus.connect()
    bus.admin.create_topic("events", partitions=4)
    producer = logbus.Producer(bus)
    producer.send("events", b"hello", key=b"user-1")
    producer.flush()
"""

import importlib

from logbus import errors
from logbus.errors import *  # noqa: F401,F403  (the error tree is part of the public API)
from logbus.protocol.messages import (
    ConsumerGroupMetadata,
    ConsumerRecord,
    OffsetAndTimestamp,
    PartitionInfo,
    RecordMetadata,
    TopicDescription,
    TopicPartition,
)

__version__ = "0.1.0"

# The clients are imported on first use: a replica actor's process imports the ``logbus``
# package too, and must not pay (in memory and start-up time) for clients it never uses.
# Ray Data costs seconds more, and is needed only by these four names.
_LAZY = {
    "Admin": "logbus.api.admin",
    "BatchMetadata": "logbus.api.producer",
    "Bus": "logbus.api.client",
    "connect": "logbus.api.client",
    "Consumer": "logbus.api.consumer",
    "OffsetAndMetadata": "logbus.protocol.group_coordinator",
    "Producer": "logbus.api.producer",
    "read_dataset": "logbus.api.dataset",
    "write_dataset": "logbus.api.dataset",
    "TopicSink": "logbus.api.dataset",
    "TopicDatasource": "logbus.api.dataset",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'logbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
