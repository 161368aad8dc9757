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
from logbus.protocol.messages import ConsumerRecord, PartitionInfo, RecordMetadata, TopicDescription, TopicPartition

__version__ = "0.1.0"
