"""Storage engine: record batch format, segments, indexes and the partition log. Imports no Ray.

The names below load on first use (PEP 562): importing a submodule such as
``logbus.storage.batch_header`` does not load the partition log or Arrow.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LogConfig": "logbus.storage.log_config",
    "validate_topic_name": "logbus.storage.names",
    "AppendResult": "logbus.storage.partition_log",
    "PartitionLog": "logbus.storage.partition_log",
    "ReadResult": "logbus.storage.partition_log",
    "RecoveryReport": "logbus.storage.partition_log",
    "SCHEMA": "logbus.storage.record_batch",
    "BatchHeader": "logbus.storage.batch_header",
    "decode_batches": "logbus.storage.record_batch",
    "decode_records": "logbus.storage.record_batch",
    "encode_batch": "logbus.storage.record_batch",
    "encode_table": "logbus.storage.record_batch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
