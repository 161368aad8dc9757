"""A tiered topic as an Iceberg table: the data files its partitions' tier manifests list, registered in a catalog.

The tier's own manifests (``storage/tier.py``) stay the truth for logbus's
readers; the Iceberg table is how every other reader sees the same files:
Spark, Ray Data's ``read_iceberg``, DuckDB's ``iceberg_scan``, pyiceberg.
After each upload pass or retention pass, the partition's leader brings the
table in line with its manifest (:meth:`TierCatalog.sync`): files the manifest
lists and the table lacks are added (one snapshot, no data rewritten: the
Parquet files are registered where they are), and files the manifest dropped
are deleted from the table (one snapshot; each is wholly below the new log
start, so nothing is rewritten). A sync that a crash or a failed commit left
undone is done by the next one, so the table catches up with the manifest and
never lists a file the manifest has not listed first: readers of the table see
only complete files.

The table: ``logbus.<topic>`` (a ``.`` in the topic name becomes ``_``, as
Iceberg reads dots as namespaces), with the tier's columns, partitioned by
``partition`` (identity) and ``day(timestamp)`` (``timestamp_day``): an upload
writes a file per run of records of one UTC day (``storage/tier.py``), so each
file has one value of each. Per-file bounds on ``timestamp`` and ``offset``
(kept in Iceberg's manifests) let readers skip files within a day too. A table
made by a logbus that partitioned by ``partition`` alone keeps that spec, and a
table given a file of several days (uploaded by such a logbus) stops
partitioning by day: Iceberg keeps each file's spec.

Catalogs (``remote.storage.catalog``): empty (the default) is a SQL catalog on
SQLite beside a ``file://`` tier (``<tier root>/catalog.db``), and no catalog
for a tier on an object store; ``none`` turns it off; a SQLAlchemy URI
(``sqlite:///...``, ``postgresql://...``) names a SQL catalog, and an
``http(s)://`` URI an Iceberg REST catalog.

This module imports no Ray. Calls block (run them in a worker thread).
"""

from __future__ import annotations

import logging
import posixpath
import time
from urllib.parse import urlparse

from logbus.errors import InvalidConfigError, StorageError
from logbus.storage.tier import DATA_DIR, DAY_MS, TIER_SCHEMA, TierManifest

logger = logging.getLogger(__name__)

NAMESPACE = "logbus"
COMMIT_ATTEMPTS = 10  # partitions' leaders commit to one table: a commit that lost a race is tried again
SNAPSHOTS_KEPT = 100  # a table keeps this many snapshots (time travel); older ones expire once twice as many exist
TABLE_PROPERTIES = {"commit.manifest-merge.enabled": "true"}  # each sync's manifest is merged, not kept apart
TOPIC_ID_PROPERTY = "logbus.topic-id"
DAY_FIELD = "timestamp_day"  # the table's partition field day(timestamp)


def catalog_location(setting: str, tier_uri: str) -> str | None:
    """The catalog URI a topic's settings name (see the module docstring), or None for no catalog."""
    if setting == "none":
        return None
    if setting:
        if urlparse(setting).scheme in ("", "file"):
            raise InvalidConfigError(f"remote.storage.catalog must be a SQLAlchemy or http(s) URI, or none, not {setting!r}")
        return setting
    parsed = urlparse(tier_uri)
    if parsed.scheme != "file":
        return None
    return f"sqlite:///{posixpath.join(parsed.path, 'catalog.db')}"


def table_name(topic: str) -> str:
    return f"{NAMESPACE}.{topic.replace('.', '_')}"


class TierCatalog:
    """One tiered topic's Iceberg table (see the module docstring)."""

    def __init__(self, catalog_uri: str, tier_uri: str, topic: str, topic_id: str) -> None:
        self.catalog_uri = catalog_uri
        self.topic, self.topic_id = topic, topic_id
        self.identifier = table_name(topic)
        parsed = urlparse(tier_uri)
        self._file_prefix = "" if parsed.scheme == "file" else f"{parsed.scheme}://"
        warehouse = tier_uri.rstrip("/") + "/warehouse"
        try:
            if urlparse(catalog_uri).scheme in ("http", "https"):
                from pyiceberg.catalog.rest import RestCatalog  # noqa: PLC0415 (only where configured)

                self.catalog = RestCatalog(NAMESPACE, uri=catalog_uri, warehouse=warehouse)
            else:
                from pyiceberg.catalog.sql import SqlCatalog  # noqa: PLC0415

                self.catalog = SqlCatalog(NAMESPACE, uri=catalog_uri, warehouse=warehouse)
        except Exception as error:  # noqa: BLE001 (pyiceberg and SQLAlchemy raise many kinds)
            raise StorageError(f"cannot open the Iceberg catalog {catalog_uri}: {error}") from error
        self._table = None

    def file_path(self, directory: str, name: str) -> str:
        """A data file's location as Iceberg records it."""
        return self._file_prefix + posixpath.join(directory, DATA_DIR, name)

    def table(self):
        """The topic's table, made on first use; one of another topic of the same name is replaced."""
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError, TableAlreadyExistsError  # noqa: PLC0415
        from pyiceberg.transforms import DayTransform  # noqa: PLC0415

        if self._table is not None:
            return self._table
        try:
            self.catalog.create_namespace(NAMESPACE)
        except NamespaceAlreadyExistsError:
            pass
        try:
            table = self.catalog.load_table(self.identifier)
            if table.properties.get(TOPIC_ID_PROPERTY) != self.topic_id:
                self.catalog.drop_table(self.identifier)  # a deleted topic's, left by a crash
                raise NoSuchTableError(self.identifier)
            if any(table.properties.get(key) != value for key, value in TABLE_PROPERTIES.items()):
                with table.transaction() as transaction:  # a table made before these properties were set
                    transaction.set_properties(**TABLE_PROPERTIES)
                table = self.catalog.load_table(self.identifier)
        except NoSuchTableError:
            try:
                # The table and its partitioning in one commit: a crash cannot leave it unpartitioned.
                with self.catalog.create_table_transaction(
                    self.identifier, schema=TIER_SCHEMA, properties={TOPIC_ID_PROPERTY: self.topic_id, **TABLE_PROPERTIES},
                ) as transaction:
                    with transaction.update_spec() as spec:
                        spec.add_identity("partition")
                        spec.add_field("timestamp", DayTransform(), DAY_FIELD)
                table = self.catalog.load_table(self.identifier)
            except TableAlreadyExistsError:  # another partition's leader made it first
                table = self.catalog.load_table(self.identifier)
        self._table = table
        return table

    def sync(self, partition: int, directory: str, manifest: TierManifest) -> tuple[int, int]:
        """Bring the table's files of ``partition`` in line with ``manifest``: (files added, files removed)."""
        from pyiceberg.exceptions import CommitFailedException  # noqa: PLC0415
        from pyiceberg.expressions import And, EqualTo, LessThan  # noqa: PLC0415

        by_path = {self.file_path(directory, f.name): f for f in manifest.files if f.name}
        wanted = set(by_path)
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                table = self.table()
                table = self._table = self.catalog.load_table(self.identifier)  # the newest snapshot
                listed = {
                    task.file.file_path
                    for task in table.scan(row_filter=EqualTo("partition", partition), selected_fields=("offset",)).plan_files()
                }
                added = sorted(wanted - listed)
                removed = listed - wanted
                if removed:
                    # Every removed file lies wholly below the first file kept: dropped whole, none rewritten.
                    kept_from = manifest.files[0].base_offset if manifest.files else None
                    condition = EqualTo("partition", partition)
                    table.delete(condition if kept_from is None else And(condition, LessThan("offset", kept_from)))
                if added and any(f.name == DAY_FIELD for f in table.spec().fields) and any(
                    by_path[path].min_timestamp_ms // DAY_MS != by_path[path].max_timestamp_ms // DAY_MS for path in added
                ):
                    # A file of more than one day (uploaded by a logbus that did not cut files at
                    # midnight) has no day to be listed under: the table stops partitioning by day
                    # (files listed so far keep their spec).
                    logger.warning("Iceberg table %s: a tier file spans days; the table is no longer partitioned by day", self.identifier)
                    with table.update_spec() as spec:
                        spec.remove_field(DAY_FIELD)
                    table = self._table = self.catalog.load_table(self.identifier)
                if added:
                    table.add_files(added, check_duplicate_files=False)
                self._expire_snapshots()
                return len(added), len(removed)
            except CommitFailedException:
                self._table = None
                time.sleep(0.05 * (attempt + 1))
            except Exception as error:  # noqa: BLE001 (pyiceberg and SQLAlchemy raise many kinds)
                if "database is locked" in str(error) and attempt + 1 < COMMIT_ATTEMPTS:
                    self._table = None
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise StorageError(f"Iceberg table {self.identifier}: sync of partition {partition} failed: {error}") from error
        raise StorageError(f"Iceberg table {self.identifier}: commits kept failing against other writers")

    def _expire_snapshots(self) -> None:
        """Bound the table's history: once it holds twice SNAPSHOTS_KEPT snapshots, all but the newest
        SNAPSHOTS_KEPT expire (their metadata only: the data files are the tier's, deleted by it).
        Best effort: a commit that loses a race with another partition's leader is left for the next
        sync (the files are already in line)."""
        try:
            table = self._table = self.catalog.load_table(self.identifier)
            snapshots = sorted(table.snapshots(), key=lambda snapshot: snapshot.timestamp_ms)
            if len(snapshots) < 2 * SNAPSHOTS_KEPT:
                return
            current = table.current_snapshot()
            old = [s.snapshot_id for s in snapshots[:-SNAPSHOTS_KEPT] if current is None or s.snapshot_id != current.snapshot_id]
            table.maintenance.expire_snapshots().by_ids(old).commit()
        except Exception as error:  # noqa: BLE001 (pyiceberg and SQLAlchemy raise many kinds)
            self._table = None
            logger.info("Iceberg table %s: expiring old snapshots failed (%s); the next sync tries again", self.identifier, error)

    def drop(self) -> None:
        """The topic was deleted: its table goes (missing already is fine)."""
        from pyiceberg.exceptions import NoSuchTableError  # noqa: PLC0415

        try:
            table = self.catalog.load_table(self.identifier)
            if table.properties.get(TOPIC_ID_PROPERTY) == self.topic_id:
                self.catalog.drop_table(self.identifier)
        except NoSuchTableError:
            pass
        except Exception as error:  # noqa: BLE001
            raise StorageError(f"cannot drop the Iceberg table {self.identifier}: {error}") from error
