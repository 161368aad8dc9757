"""Storage engine: record batch format, segments, indexes and the partition log. Imports no Ray."""

from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_topic_name
from logbus.storage.partition_log import AppendResult, PartitionLog, ReadResult, RecoveryReport
from logbus.storage.record_batch import (
    SCHEMA,
    BatchHeader,
    decode_batches,
    decode_records,
    encode_batch,
    encode_table,
)

__all__ = [
    "SCHEMA",
    "AppendResult",
    "BatchHeader",
    "LogConfig",
    "PartitionLog",
    "ReadResult",
    "RecoveryReport",
    "decode_batches",
    "decode_records",
    "encode_batch",
    "encode_table",
    "validate_topic_name",
]
