"""Topic configuration: Kafka's topic-level keys, validated, with documented defaults.

Configs are given as a dict of Kafka's dotted names (``{"retention.ms": 60000}``)
and held as a frozen dataclass with unit-suffixed attribute names.

Flush policy and what each setting can lose
-------------------------------------------

``flush.policy`` decides when a partition log forces its writes to disk
(``fdatasync``). An append is always written to the OS page cache before it is
acknowledged, so a crash of the logbus process (or its Ray actor) loses
nothing acknowledged under any policy. What a *power failure or kernel crash*
of the machine can lose:

- ``"batch"``: nothing acknowledged; every append is synced before it returns
  (slowest: one fdatasync per batch).
- ``"interval"``: at most the last ``flush.ms`` milliseconds of appends
  (a sync happens on the first append after the interval expires, and on a
  background tick of the owning replica).
- ``"os"`` (the default, as in Kafka): whatever the kernel had not yet written
  back, typically up to 30 s of appends on Linux. As in Kafka, durability
  against machine loss comes from replication (``acks="all"`` with
  ``min.insync.replicas`` >= 2), not from fsync.

Segments are always synced when they are rolled and when the log is closed.
After an unclean stop, recovery rescans every segment written since the last
sync point, so a torn write is cut off, never served.

Timestamps
----------

``message.timestamp.type``: ``CreateTime`` (the default) keeps the timestamp
each producer gave its records; ``LogAppendTime`` makes the leader stamp every
batch with the time it appended it, which readers then report for each of the
batch's records (as Kafka does).

Page cache
----------

``cache.tail.bytes`` (default 32 MiB) is how much of the end of the active
segment a replica leaves in the OS page cache: older pages are written back
and dropped as appends go on (see ``segment.py``), so new appends reuse
recently freed memory instead of taking never-used memory, which is slow on
virtual machines. Readers more than that far behind the end (a consumer
catching up, a replica copying an old segment) read from disk. Rolled segments
keep their last ``cache.tail.bytes`` cached. ``-1`` leaves everything to the
kernel, as Kafka does. No setting changes what is durable.

Cleanup: retention and compaction
---------------------------------

``cleanup.policy`` (Kafka's names) says what happens to old records:

- ``"delete"`` (the default): retention. Whole segments, oldest first, are
  deleted once their newest record is older than ``retention.ms`` or the log
  is larger than ``retention.bytes``.
- ``"compact"``: compaction. The cleaner (``cleaner.py``) keeps the latest
  record of each key in the closed segments (never the active one, never at
  or above the high watermark) and leaves every offset as it was: the ones it
  removed become gaps. ``retention.ms`` and ``retention.bytes`` do not apply.
  A record without a key cannot be produced to such a topic (the cleaner
  drops any that are there from before the policy changed, as Kafka's does).
- ``"compact,delete"`` (or ``"delete,compact"``): both.

What the cleaner honours:

- ``min.cleanable.dirty.ratio`` (default 0.5): it cleans a log only when the
  bytes written since its last cleaning ("dirty") are at least this share of
  the cleanable bytes: each cleaning rewrites every closed segment, so this
  bounds the work per byte written.
- ``min.compaction.lag.ms`` (default 0): a segment is cleaned only once its
  newest record is at least this old, so a consumer that keeps up sees every
  update of a key for at least that long.
- ``delete.retention.ms`` (default 1 day): a tombstone (a record whose value
  is None: "delete this key") is kept this long after its timestamp (the
  timestamp readers see for it), so a consumer reading the log from the start
  sees it and forgets the key; a cleaning after that removes it.

Remote tier
-----------

``remote.storage.enable`` (default false; KIP-405's name) copies each closed
segment, once wholly below the high watermark and the last stable offset, to
the topic's remote tier as a Parquet file (``storage/tier.py``), at
``remote.storage.uri`` (logbus's own key: a pyarrow filesystem URI; empty
means the cluster's default, ``<data dir>/remote``), and registered in an
Iceberg table (``remote.storage.catalog``, logbus's own key too: see
``storage/tier_catalog.py``). Then
``local.retention.ms`` / ``local.retention.bytes`` (-2, the default: the same
as ``retention.ms`` / ``retention.bytes``) bound what stays on the replicas'
disks, and only segments already in the tier leave them by that rule;
``retention.ms`` / ``retention.bytes`` bound the whole log, tier included.
Consumers read offsets below the local log start from the tier. A compacted
topic cannot be tiered (as in Kafka).

Producer ids
------------

``producer.id.expiration.ms`` (default 1 day, at most Kafka's int range, about
24.8 days): a partition forgets an idempotent producer (its epoch and last
sequence numbers) once the producer's last write there is this old, unless it
has a transaction open. In Kafka this is a broker setting; here it is a topic
setting like the others (each log applies its own). There is no timer for it:
the log drops expired producers when it rolls a segment and when it rebuilds
its producer table (open, recovery, truncation); see ``producer_state.py`` for
what a producer the log no longer knows may then write.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from logbus.errors import InvalidConfigError

FLUSH_POLICIES = ("os", "interval", "batch")
CREATE_TIME = "CreateTime"  # a record keeps the timestamp its producer gave it
LOG_APPEND_TIME = "LogAppendTime"  # the leader stamps each batch with the time it appended it
TIMESTAMP_TYPES = (CREATE_TIME, LOG_APPEND_TIME)
DELETE = "delete"  # cleanup.policy: retention deletes old segments
COMPACT = "compact"  # cleanup.policy: the cleaner keeps the latest record per key
CLEANUP_POLICIES = (DELETE, COMPACT, f"{COMPACT},{DELETE}")  # as stored; "delete,compact" is read as the last

MIB = 1024 * 1024
DAY_MS = 24 * 3600 * 1000
INT_MAX = 2**31 - 1  # Kafka's int configs
LONG_MAX = 2**63 - 1  # Kafka's long configs


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Topic-level settings. Build with :meth:`from_dict` to validate Kafka's dotted keys."""

    segment_bytes: int = 256 * MIB
    segment_ms: int = 7 * DAY_MS
    retention_ms: int = 7 * DAY_MS  # -1: keep forever
    retention_bytes: int = -1  # -1: no size limit
    max_message_bytes: int = 8 * MIB
    index_interval_bytes: int = 4096
    flush_policy: str = "os"
    flush_ms: int = 1000
    min_insync_replicas: int = 1
    unclean_leader_election_enable: bool = False
    replica_lag_time_max_ms: int = 10_000
    cache_tail_bytes: int = 32 * MIB  # -1: leave every written page in the page cache
    message_timestamp_type: str = CREATE_TIME
    cleanup_policy: str = DELETE
    delete_retention_ms: int = DAY_MS  # how long a tombstone outlives its timestamp
    min_cleanable_dirty_ratio: float = 0.5
    min_compaction_lag_ms: int = 0
    producer_id_expiration_ms: int = DAY_MS  # a producer's state goes once its last write is this old
    remote_storage_enable: bool = False  # closed segments are copied to the remote tier (storage/tier.py)
    local_retention_ms: int = -2  # with the tier: how long uploaded segments stay on disk too (-2: retention.ms)
    local_retention_bytes: int = -2  # with the tier: how much of the log stays on disk (-2: retention.bytes)
    remote_storage_uri: str = ""  # where the tier is ("": the cluster's default, under its data directory)
    remote_storage_catalog: str = ""  # the Iceberg catalog of the tier ("": SQLite beside a file:// tier; "none")

    # dotted Kafka name -> (attribute, type, lowest legal value, highest legal value). The highest
    # is the range of Kafka's type for the key (int or long): values must fit the int32 / int64
    # fields and system calls they reach.
    KEYS = {
        "segment.bytes": ("segment_bytes", int, 1024, INT_MAX),
        "segment.ms": ("segment_ms", int, 1, LONG_MAX),
        "retention.ms": ("retention_ms", int, -1, LONG_MAX),
        "retention.bytes": ("retention_bytes", int, -1, LONG_MAX),
        "max.message.bytes": ("max_message_bytes", int, 128, INT_MAX),
        "index.interval.bytes": ("index_interval_bytes", int, 0, INT_MAX),
        "flush.policy": ("flush_policy", str, None, None),
        "flush.ms": ("flush_ms", int, 0, LONG_MAX),
        "min.insync.replicas": ("min_insync_replicas", int, 1, INT_MAX),
        "unclean.leader.election.enable": ("unclean_leader_election_enable", bool, None, None),
        "replica.lag.time.max.ms": ("replica_lag_time_max_ms", int, 1, LONG_MAX),
        "cache.tail.bytes": ("cache_tail_bytes", int, -1, LONG_MAX),
        "message.timestamp.type": ("message_timestamp_type", str, None, None),
        "cleanup.policy": ("cleanup_policy", str, None, None),
        "delete.retention.ms": ("delete_retention_ms", int, 0, LONG_MAX),
        "min.cleanable.dirty.ratio": ("min_cleanable_dirty_ratio", float, 0, 1),
        "min.compaction.lag.ms": ("min_compaction_lag_ms", int, 0, LONG_MAX),
        "producer.id.expiration.ms": ("producer_id_expiration_ms", int, 1, INT_MAX),  # an int in Kafka too
        "remote.storage.enable": ("remote_storage_enable", bool, None, None),
        "local.retention.ms": ("local_retention_ms", int, -2, LONG_MAX),
        "local.retention.bytes": ("local_retention_bytes", int, -2, LONG_MAX),
        "remote.storage.uri": ("remote_storage_uri", str, None, None),  # logbus's own key
        "remote.storage.catalog": ("remote_storage_catalog", str, None, None),  # logbus's own key
    }

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None = None, base: "LogConfig | None" = None) -> "LogConfig":
        """Validate ``config`` (Kafka dotted names) and overlay it on ``base`` (or the defaults)."""
        if base is None:
            base = cls()
        elif not isinstance(base, LogConfig):
            raise InvalidConfigError(f"base must be a LogConfig, not {type(base).__name__}")
        if config is None:
            return base
        if not isinstance(config, Mapping):
            raise InvalidConfigError(f"config must be a dict of Kafka-style keys, not {type(config).__name__}")
        changes = {}
        for key, raw in config.items():
            if key not in cls.KEYS:
                raise InvalidConfigError(f"unknown topic config {key!r}; known: {', '.join(sorted(cls.KEYS))}")
            attribute, kind, lowest, highest = cls.KEYS[key]
            changes[attribute] = _coerce(key, raw, kind, lowest, highest)
        policy = changes.get("flush_policy", base.flush_policy)
        if policy not in FLUSH_POLICIES:
            raise InvalidConfigError(f"flush.policy must be one of {FLUSH_POLICIES}, not {policy!r}")
        timestamp_type = changes.get("message_timestamp_type", base.message_timestamp_type)
        if timestamp_type not in TIMESTAMP_TYPES:
            raise InvalidConfigError(f"message.timestamp.type must be one of {TIMESTAMP_TYPES}, not {timestamp_type!r}")
        if "cleanup_policy" in changes:
            changes["cleanup_policy"] = _cleanup_policy(changes["cleanup_policy"])
        merged = dataclasses.replace(base, **changes)
        if merged.remote_storage_enable and merged.compact:
            raise InvalidConfigError("remote.storage.enable is for cleanup.policy delete only (Kafka's rule): a compacted topic is not tiered")
        return merged

    @property
    def local_retention(self) -> tuple[int, int]:
        """(ms, bytes) that bound what stays on local disk once uploaded to the tier (-2 resolved to
        retention.ms / retention.bytes)."""
        ms = self.retention_ms if self.local_retention_ms == -2 else self.local_retention_ms
        size = self.retention_bytes if self.local_retention_bytes == -2 else self.local_retention_bytes
        return ms, size

    @property
    def compact(self) -> bool:
        """Whether the cleaner compacts this log (cleanup.policy includes "compact")."""
        return COMPACT in self.cleanup_policy.split(",")

    @property
    def delete(self) -> bool:
        """Whether retention deletes old segments (cleanup.policy includes "delete")."""
        return DELETE in self.cleanup_policy.split(",")

    def to_dict(self) -> dict[str, Any]:
        """The config under Kafka's dotted names."""
        return {key: getattr(self, attribute) for key, (attribute, *_) in self.KEYS.items()}


def _cleanup_policy(raw: str) -> str:
    """A cleanup.policy in its one stored spelling: a comma-separated list of delete and compact."""
    names = [name.strip() for name in raw.split(",")]
    if not names or any(name not in (DELETE, COMPACT) for name in names) or len(set(names)) != len(names):
        raise InvalidConfigError(f"cleanup.policy must be delete, compact or compact,delete, not {raw!r}")
    return ",".join(name for name in (COMPACT, DELETE) if name in names)


def _coerce(key: str, raw: Any, kind: type, lowest: int | None, highest: int | None) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise InvalidConfigError(f"{key} must be true or false, not {raw!r}")
    if kind is str:
        if not isinstance(raw, str):
            raise InvalidConfigError(f"{key} must be a string, not {raw!r}")
        return raw
    if kind is float:
        if isinstance(raw, bool) or not isinstance(raw, str | numbers.Real):
            raise InvalidConfigError(f"{key} must be a number, not {raw!r}")
        try:
            number = float(raw)
        except ValueError:
            raise InvalidConfigError(f"{key} must be a number, not {raw!r}") from None
        if not lowest <= number <= highest:  # also refuses NaN
            raise InvalidConfigError(f"{key} must be between {lowest} and {highest}, not {raw!r}")
        return number
    if isinstance(raw, bool) or not isinstance(raw, str | numbers.Real):  # int() would take b"5" too
        raise InvalidConfigError(f"{key} must be an integer, not {raw!r}")
    try:
        value = int(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        raise InvalidConfigError(f"{key} must be an integer, not {raw!r}") from None
    if isinstance(raw, float) and raw != value:
        raise InvalidConfigError(f"{key} must be an integer, not {raw!r}")
    if lowest is not None and value < lowest:
        raise InvalidConfigError(f"{key} must be at least {lowest}, not {value}")
    if highest is not None and value > highest:
        raise InvalidConfigError(f"{key} must be at most {highest}, not {value}")
    return value
