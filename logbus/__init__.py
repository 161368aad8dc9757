"""logbus: a distributed, persistent, partitioned, replicated commit log on Ray.

    bus = logbus.connect()
    bus.admin.create_topic("events", partitions=4)
    producer = logbus.Producer(bus)
    producer.send("events", b"hello", key=b"user-1")
    producer.flush()
"""

from logbus import errors
from logbus.api import Admin, BatchMetadata, Bus, Consumer, Producer, connect
from logbus.errors import *  # noqa: F401,F403  (the error tree is part of the public API)
from logbus.protocol.group_coordinator import OffsetAndMetadata
from logbus.protocol.messages import (
    ConsumerRecord,
    OffsetAndTimestamp,
    PartitionInfo,
    RecordMetadata,
    TopicDescription,
    TopicPartition,
)

__version__ = "0.1.0"

_DATASET_NAMES = ("read_dataset", "write_dataset", "TopicSink", "TopicDatasource")


def __getattr__(name):
    # Ray Data is imported only when these are used: it costs seconds, and replica actors never need it.
    if name in _DATASET_NAMES:
        from logbus.api import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'logbus' has no attribute {name!r}")
