"""A partition's remote tier: its closed segments as Parquet files, listed by a versioned manifest.

Kafka's tiered storage (KIP-405) moves closed segments to object storage in
its own format; logbus writes them as Parquet, so the history of a topic is a
table that Spark, Ray Data, DuckDB or pyarrow read with their own readers, and
consumers read it back through logbus as if it had never left the replicas.

Layout, under a pyarrow filesystem URI (``file://`` by default, or ``s3://``,
``gs://``, ``hdfs://``: whatever ``pyarrow.fs.FileSystem.from_uri`` opens)::

    <root>/<topic>-<topic id>/<partition>/data/<first>-e<epoch>-<nonce>.parquet
    <root>/<topic>-<topic id>/<partition>/manifest-<version>.json

A data file holds the committed records of offsets ``[first, next)`` of one
segment (the manifest says where it ends) whose timestamps fall on one UTC day:
a segment becomes one file, or one per run of records of one day in offset
order where it spans midnight, so that the Iceberg table can be partitioned
by day. One row a record, with the columns of :data:`TIER_SCHEMA`
(``partition, offset, timestamp, timestamp_type, key, value, headers``),
sorted by offset, in row groups of at most :data:`ROW_GROUP_ROWS` rows (their
offset and timestamp statistics let a reader skip what it does not need).
Records of aborted transactions and transaction markers are not copied: their
offsets are gaps, which readers pass as they pass a compacted topic's.

The manifest is the only truth about what is in the tier: a data file that it
does not list is not part of the partition (an upload that crashed, or lost a
race), and readers never list data files. Each version is a new file, written
whole before it is visible:

- on a local filesystem, written to a temporary name, synced, then linked to
  its final name, which fails if that version exists already: two uploaders
  (an old leader that has not yet heard it was deposed, and the new one)
  cannot both commit version ``n``; the loser reads the winner's and stops if
  its leader epoch is higher;
- on an object store, a single PUT (visible only once complete). pyarrow
  offers no conditional PUT, so there the epoch check before each commit is
  the fence, and two leaders uploading in the same instant can overwrite each
  other's version: the overwritten upload's data file is then unlisted, and
  its records are still on the replicas (local segments are deleted only
  once a manifest read back lists them).

A manifest records the leader epoch that wrote it; an uploader whose epoch
is lower than the manifest's is refused (:class:`TierFencedError`). The
manifest's ``log_start_offset`` is the first offset the tier still serves
(retention of the whole log raises it, then deletes the files wholly below
it). Older manifest versions are deleted after a commit, keeping the last
:data:`MANIFEST_VERSIONS_KEPT`.

This module imports no Ray. A :class:`RemoteTier` is not thread-safe; its owner
(a replica) runs one upload or retention pass at a time, in a worker thread,
while reads go on (they use only the manifest snapshot they were given).
"""

from __future__ import annotations

import bisect
import json
import os
import posixpath
import secrets
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from logbus.errors import InvalidConfigError, OffsetOutOfRangeError, StorageError, TierFencedError
from logbus.storage import batch_header as bh
from logbus.storage.files import sync_directory, sync_path
from logbus.storage.record_batch import HEADERS_TYPE, SCHEMA, frame_parts, slice_visible_batches
from logbus.storage.txn_index import AbortedTxn

TIER_SCHEMA = pa.schema(
    [
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("timestamp_type", pa.int32(), nullable=False),  # 0 CreateTime, 1 LogAppendTime (Kafka's)
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", HEADERS_TYPE),
    ]
)
ROW_GROUP_ROWS = 128 * 1024
ROW_GROUP_MAX_BYTES = 64 * 1024 * 1024  # a row group is written once it holds this much, whatever its rows
# zstd; dictionaries only where values repeat (a random value column costs the writer a dictionary
# it then drops), offsets and timestamps with statistics for readers that skip row groups.
PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": ["partition", "timestamp_type", "key"]}
READ_CHUNK_BYTES = 8 * 1024 * 1024  # how much of a segment an upload decodes at a time
MANIFEST_VERSIONS_KEPT = 3
SWEEP_GRACE_S = 600.0  # unlisted data files younger than this are not swept
FRAME_MAX_BYTES = 1 << 20  # about this much (and at least one record) per batch a tier read rebuilds
MANIFEST_PREFIX = "manifest-"
DATA_DIR = "data"


@dataclass(frozen=True, slots=True)
class TierFile:
    """One data file the manifest lists: the offsets it covers and what it holds."""

    name: str
    base_offset: int
    next_offset: int  # exclusive: the file covers [base_offset, next_offset), gaps included
    records: int
    size_bytes: int
    min_timestamp_ms: int
    max_timestamp_ms: int


@dataclass(frozen=True, slots=True)
class TierManifest:
    """One version of a partition's manifest."""

    version: int = 0
    leader_epoch: int = -1
    log_start_offset: int = 0
    files: tuple[TierFile, ...] = field(default_factory=tuple)

    @property
    def end_offset(self) -> int:
        """The offset after the last one uploaded (the log start when nothing is)."""
        return self.files[-1].next_offset if self.files else self.log_start_offset

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def file_for(self, offset: int) -> int | None:
        """Index of the listed file that covers ``offset``, or None."""
        i = bisect.bisect_right(self.files, offset, key=lambda f: f.base_offset) - 1
        if i >= 0 and offset < self.files[i].next_offset:
            return i
        return None

    def to_json(self) -> str:
        files = [{name: getattr(f, name) for name in TierFile.__slots__} for f in self.files]
        return json.dumps(
            {"version": self.version, "leader_epoch": self.leader_epoch, "log_start_offset": self.log_start_offset, "files": files},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "TierManifest":
        raw = json.loads(text)
        return cls(
            version=int(raw["version"]), leader_epoch=int(raw["leader_epoch"]),
            log_start_offset=int(raw["log_start_offset"]), files=tuple(TierFile(**f) for f in raw["files"]),
        )


@dataclass(frozen=True, slots=True)
class TierRead:
    """Records read back from the tier, as framed batches: the same shape as a log read
    (``data`` holds every record of ``[first_offset, next_offset)`` the tier has; offsets in
    between that it has not are gaps)."""

    data: bytes
    first_offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class SegmentCopy:
    """What an upload needs of one closed segment, taken on the log's owner's thread so that the
    upload can run on another: its file (read through a mapping of its own, which a deletion of the
    segment meanwhile does not end), its offsets and the aborted transactions that touch them."""

    path: str
    base_offset: int
    next_offset: int
    size_bytes: int
    aborted: tuple[AbortedTxn, ...]
    log_start_offset: int  # the log's, when the copy was taken: nothing below it is uploaded (delete_records)


def segment_copy(log, index: int) -> SegmentCopy:
    """A :class:`SegmentCopy` of the log's closed segment ``index`` (call on the log's owner's thread)."""
    segment = log.segments[index]
    if segment is log.active_segment:
        raise StorageError("the active segment is never uploaded")
    aborted = tuple(log.aborted_txns(segment.base_offset, segment.next_offset))
    return SegmentCopy(segment.log_path, segment.base_offset, segment.next_offset, segment.size_bytes, aborted, log.log_start_offset)


def redact(uri: str) -> str:
    """A tier URI for logs and status: without the secret of credentials written into it."""
    parsed = urlparse(uri)
    if parsed.password is None:
        return uri
    return parsed._replace(netloc=f"{parsed.username}:***@{parsed.hostname}" + (f":{parsed.port}" if parsed.port else "")).geturl()


def open_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path) for a tier URI; InvalidConfigError naming the URI when pyarrow cannot open it."""
    if not isinstance(uri, str) or not uri:
        raise InvalidConfigError(f"remote.storage.uri must be a filesystem URI (file://, s3://, ...), not {uri!r}")
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as error:
        raise InvalidConfigError(f"remote.storage.uri {redact(uri)!r} cannot be opened: {error}") from None


class RemoteTier:
    """The remote tier of one partition (see the module docstring)."""

    def __init__(self, uri: str, topic: str, topic_id: str, partition: int) -> None:
        self.uri = uri
        self.partition = partition
        self.fs, root = open_filesystem(uri)
        self.directory = posixpath.join(root, f"{topic}-{topic_id}" if topic_id else topic, str(partition))
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        self._cached: tuple[tuple[str, int], pa.Table] | None = None  # ((file, row group), rows): the last read
        self._open_file: tuple[str, pq.ParquetFile] | None = None  # (file, its reader): the last opened
        self._reading = threading.Lock()  # reads run in worker threads and share the two above
        try:
            self.fs.create_dir(posixpath.join(self.directory, DATA_DIR), recursive=True)
        except OSError as error:
            raise StorageError(f"cannot create the remote tier {self.directory} at {redact(uri)}: {error}") from error
        self.manifest = self.read_manifest()

    # --- the manifest ---------------------------------------------------------------------------

    def _manifest_path(self, version: int) -> str:
        return posixpath.join(self.directory, f"{MANIFEST_PREFIX}{version:012d}.json")

    def _versions(self) -> list[int]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.directory))
        except OSError as error:
            raise StorageError(f"cannot list the remote tier {self.directory}: {error}") from error
        versions = []
        for info in infos:
            name = posixpath.basename(info.path)
            if name.startswith(MANIFEST_PREFIX) and name.endswith(".json") and name[len(MANIFEST_PREFIX):-5].isdigit():
                versions.append(int(name[len(MANIFEST_PREFIX):-5]))
        return sorted(versions)

    def read_manifest(self) -> TierManifest:
        """The newest manifest on the filesystem (an empty one before the first upload); also kept as ``manifest``."""
        versions = self._versions()
        if not versions:
            self.manifest = TierManifest()
            return self.manifest
        path = self._manifest_path(versions[-1])
        try:
            with self.fs.open_input_stream(path) as stream:
                manifest = TierManifest.from_json(stream.read().decode())
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise StorageError(f"the remote tier's manifest {path} is unreadable: {error}") from error
        self.manifest = manifest
        return manifest

    def _commit(self, manifest: TierManifest) -> bool:
        """Write ``manifest`` as its version; False when that version exists already (another writer won)."""
        path = self._manifest_path(manifest.version)
        data = manifest.to_json().encode()
        try:
            if self._local:
                temporary = f"{path}.{secrets.token_hex(4)}.tmp"
                with open(temporary, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                try:
                    os.link(temporary, path)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(temporary)
                sync_directory(self.directory)
            else:
                if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                    return False
                with self.fs.open_output_stream(path) as stream:
                    stream.write(data)
                # No conditional PUT: read it back, and count it as ours only if it still is.
                with self.fs.open_input_stream(path) as stream:
                    if stream.read() != data:
                        return False
        except OSError as error:
            raise StorageError(f"cannot write the remote tier's manifest {path}: {error}") from error
        self.manifest = manifest
        for old in self._versions()[:-MANIFEST_VERSIONS_KEPT]:
            self._delete_quietly(self._manifest_path(old))
        return True

    def _update(self, leader_epoch: int, change) -> TierManifest:
        """Commit ``change(latest manifest)`` (a new manifest, or None for no change) as the next version,
        fenced by ``leader_epoch``; re-read and retry when another writer committed first."""
        for _ in range(8):
            latest = self.read_manifest()
            if latest.leader_epoch > leader_epoch:
                raise TierFencedError(
                    f"remote tier {self.directory}: leader epoch {leader_epoch} is older than the manifest's {latest.leader_epoch}"
                )
            new = change(latest)
            if new is None:
                return latest
            new = TierManifest(latest.version + 1, leader_epoch, new.log_start_offset, new.files)
            if self._commit(new):
                return new
        raise StorageError(f"remote tier {self.directory}: the manifest kept changing under this writer")

    # --- upload -----------------------------------------------------------------------------------

    def upload(self, segment: SegmentCopy, leader_epoch: int) -> tuple[TierFile, ...] | None:
        """Copy the committed records of a closed segment that the tier does not hold yet into data
        files, one per run of records of one UTC day (one file, unless the segment spans midnight),
        and list them in one manifest version. None when there was nothing to copy, or another
        uploader listed them first.

        The caller makes sure the segment is wholly below the high watermark and the last stable
        offset. Raises TierFencedError when a later leader wrote the manifest.
        """
        manifest = self.read_manifest()
        start = max(manifest.end_offset, segment.base_offset, segment.log_start_offset)
        end = segment.next_offset
        if manifest.leader_epoch > leader_epoch:
            raise TierFencedError(
                f"remote tier {self.directory}: leader epoch {leader_epoch} is older than the manifest's {manifest.leader_epoch}"
            )
        if end <= start:
            return None
        if manifest.files and start != manifest.end_offset:
            raise StorageError(
                f"remote tier {self.directory}: the tier ends at {manifest.end_offset} but the segment starts at "
                f"{segment.base_offset}: the offsets between are on no replica's disk"
            )
        written = self._write_files(segment, start, end, leader_epoch)
        if written is None:
            # Records crossing midnight back and forth (producers' clocks apart): one file of several
            # days rather than a file per crossing (the Iceberg table then stops partitioning by day).
            written = self._write_files(segment, start, end, leader_epoch, by_day=False)
        # Only aborted records and markers: the range is listed as a gap, with no file.
        entries = tuple(written) or (TierFile("", start, end, 0, 0, 0, 0),)

        def append(latest: TierManifest) -> TierManifest | None:
            if latest.files and latest.end_offset != start or start < latest.log_start_offset:
                return None  # another leader uploaded these offsets first, or retention passed them
            files = latest.files
            return TierManifest(0, 0, latest.log_start_offset if files else start, files + entries)

        try:
            committed = self._update(leader_epoch, append)
        except TierFencedError:
            self.delete_files(entries)  # never listed: a later leader's manifest came first
            raise
        if entries[0] not in committed.files:
            self.delete_files(entries)
            return None
        return entries

    def _write_files(self, segment: SegmentCopy, start: int, end: int, leader_epoch: int, by_day: bool = True) -> list[TierFile] | None:
        """Write the committed records of ``[start, end)``, a file per run of records of one UTC day in
        offset order (each complete before visible), covering ``[start, end)`` between them: the
        first starts at ``start``, each other at its first record, the last ends at ``end``. Empty
        when the range holds no committed record. None when it would take more than MAX_DAY_FILES
        files (what was written is deleted); ``by_day`` False writes one file, whatever its days."""
        done: list[TierFile] = []
        current: _DayFile | None = None
        segment_rows = _segment_rows(segment, start, end, self.partition)
        try:
            for rows in segment_rows:
                for day, run in _day_runs(rows) if by_day else ((None, rows),):
                    if current is not None and current.day != day:
                        if len(done) + 2 > MAX_DAY_FILES:
                            current.abandon()
                            self.delete_files(done)
                            return None
                        next_offset = int(run.column("offset")[0].as_py())
                        done.append(current.finish(next_offset))
                        current = None
                    if current is None:
                        base = done[-1].next_offset if done else start
                        current = _DayFile(self, day, base, leader_epoch)
                    current.add(run)
            if current is not None:
                done.append(current.finish(end))
                current = None
            if done and self._local:
                sync_directory(posixpath.join(self.directory, DATA_DIR))  # the names are durable before any manifest lists them
        except (OSError, pa.ArrowException, StorageError) as error:
            if current is not None:
                current.abandon()
            self.delete_files(done)
            raise StorageError(f"cannot write a data file of [{start}, {end}) to the remote tier {self.directory}: {error}") from error
        finally:
            segment_rows.close()
        return done

    # --- retention --------------------------------------------------------------------------------

    def delete_before(self, offset: int, leader_epoch: int, delete_files: bool = True) -> list[TierFile]:
        """Raise the tier's log start to ``offset`` (retention or delete_records of the whole log): the
        files wholly below it leave the manifest, and (``delete_files``) the filesystem; returns them.
        An owner that registers the files elsewhere too (an Iceberg table) deletes them itself, once
        they are unregistered there (:meth:`delete_files`)."""
        removed: list[TierFile] = []

        def trim(latest: TierManifest) -> TierManifest | None:
            removed.clear()
            if offset <= latest.log_start_offset:
                return None
            removed.extend(f for f in latest.files if f.next_offset <= offset)
            return TierManifest(0, 0, offset, tuple(f for f in latest.files if f.next_offset > offset))

        self._update(leader_epoch, trim)
        if delete_files:
            self.delete_files(removed)
        return list(removed)

    def delete_files(self, files) -> None:
        """Delete data files the manifest no longer lists."""
        for f in files:
            if f.name:
                self._delete_quietly(posixpath.join(self.directory, DATA_DIR, f.name))

    def claim(self, leader_epoch: int) -> None:
        """A new leader's first step: a manifest version of its epoch (the same content), after which no
        older leader can commit (TierFencedError)."""
        self._update(leader_epoch, lambda latest: latest if latest.leader_epoch < leader_epoch else None)

    def sweep_orphans(self, grace_s: float | None = None) -> tuple[int, int]:
        """Delete data files the manifest does not list (an upload that crashed before listing its file,
        or files a crash left between leaving the manifest and being deleted); how many went. Only after
        :meth:`claim`: an older leader's upload still under way can then never list its file on a
        filesystem where versions are written once. On an object store, where a deposed leader's PUT
        can still land, files younger than ``grace_s`` (default SWEEP_GRACE_S there, 0 on a local or
        shared filesystem) are left for a later sweep. Returns (deleted, left for being young)."""
        if grace_s is None:
            grace_s = 0.0 if self._local else SWEEP_GRACE_S
        manifest = self.read_manifest()
        listed = {f.name for f in manifest.files}
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(posixpath.join(self.directory, DATA_DIR)))
        except OSError as error:
            raise StorageError(f"cannot list the remote tier {self.directory}: {error}") from error
        gone = young = 0
        now_s = time.time()
        for info in infos:
            if posixpath.basename(info.path) in listed:
                continue
            # A file this new may be a deposed leader's upload still on its way to a commit that an
            # object store cannot refuse (no conditional PUT): it is left for a later sweep.
            if grace_s > 0 and info.mtime is not None and now_s - info.mtime.timestamp() < grace_s:
                young += 1
                continue
            self._delete_quietly(info.path)
            gone += 1
        return gone, young

    def retention_offset(self, now_ms: int, retention_ms: int, retention_bytes: int, local_bytes: int) -> int | None:
        """The offset below which retention of the whole log deletes remote files, or None. ``local_bytes``:
        the local log's bytes the tier does not hold (counted once, as Kafka's RLM does)."""
        files = self.manifest.files
        keep_from = 0
        if retention_ms >= 0:
            while keep_from < len(files) and now_ms - files[keep_from].max_timestamp_ms > retention_ms:
                keep_from += 1
        if retention_bytes >= 0:
            total = local_bytes + sum(f.size_bytes for f in files[keep_from:])
            while keep_from < len(files) and total > retention_bytes:
                total -= files[keep_from].size_bytes
                keep_from += 1
        if keep_from == 0:
            return None
        return files[keep_from - 1].next_offset

    def delete_all(self) -> None:
        """Delete the partition's whole tier (its topic was deleted)."""
        try:
            self.fs.delete_dir(self.directory)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise StorageError(f"cannot delete the remote tier {self.directory}: {error}") from error

    # --- reading ----------------------------------------------------------------------------------

    def read(self, offset: int, max_bytes: int, manifest: TierManifest | None = None) -> TierRead:
        """Framed batches of the records from ``offset`` on (at least one batch, then up to
        ``max_bytes``, across files). OffsetOutOfRangeError when no listed file covers ``offset``."""
        manifest = manifest or self.manifest
        if offset < manifest.log_start_offset:
            raise OffsetOutOfRangeError(f"offset {offset} is below the remote tier's log start {manifest.log_start_offset}")
        i = manifest.file_for(offset)
        if i is None:
            raise OffsetOutOfRangeError(f"offset {offset} is not in the remote tier [{manifest.log_start_offset}, {manifest.end_offset})")
        with self._reading:
            return self._read_from(manifest, i, offset, max_bytes)

    def _read_from(self, manifest: TierManifest, i: int, offset: int, max_bytes: int) -> TierRead:
        parts: list = []  # every frame's header and message, joined once (one copy of the records)
        size = 0
        next_offset = offset
        for entry in manifest.files[i:]:  # contiguous: each file starts where the one before ends
            if entry.name:
                for (header, message), frame_next in self._file_frames(entry, max(offset, entry.base_offset)):
                    parts += (header, message)
                    size += len(header) + message.size
                    next_offset = frame_next
                    if size >= max_bytes:
                        return TierRead(b"".join(parts), offset, next_offset)
            next_offset = entry.next_offset  # past the file, gaps at its end included
        return TierRead(b"".join(parts), offset, next_offset)

    def _file_frames(self, entry: TierFile, start: int):
        """Framed batches of one file's records from ``start`` on: ((header, message), offset after it)."""
        path = posixpath.join(self.directory, DATA_DIR, entry.name)
        try:
            parquet = self._parquet_file(entry.name, path)
            for group in range(parquet.num_row_groups):
                stats = parquet.metadata.row_group(group).column(1).statistics
                if stats is not None and stats.has_min_max and stats.max < start:
                    continue
                rows = self._row_group(parquet, entry.name, group)
                begin = int(np.searchsorted(rows.column("offset").to_numpy(), start))
                yield from _frames(rows.slice(begin))
                self._cached = None  # read to its end: the next read starts in the next group
        except (OSError, pa.ArrowException) as error:
            raise StorageError(f"cannot read {path} from the remote tier: {error}") from error

    def _parquet_file(self, name: str, path: str) -> pq.ParquetFile:
        if self._open_file is not None and self._open_file[0] == name:
            return self._open_file[1]
        parquet = pq.ParquetFile(self.fs.open_input_file(path))
        self._open_file = (name, parquet)  # one kept open: a reader replaying history asks for it again next
        return parquet

    def offset_for_timestamp(self, timestamp_ms: int, manifest: TierManifest | None = None) -> int | None:
        """The first offset in the tier whose record's timestamp is at least ``timestamp_ms`` (the
        files' max timestamps pick the file, its timestamp column the row), or None."""
        manifest = manifest or self.manifest
        for entry in manifest.files:
            if not entry.name or entry.max_timestamp_ms < timestamp_ms or entry.next_offset <= manifest.log_start_offset:
                continue
            path = posixpath.join(self.directory, DATA_DIR, entry.name)
            try:
                rows = pq.read_table(self.fs.open_input_file(path), columns=["offset", "timestamp"])
            except (OSError, pa.ArrowException) as error:
                raise StorageError(f"cannot read {path} from the remote tier: {error}") from error
            stamps = pc.divide(rows.column("timestamp").cast(pa.int64()), 1000).to_numpy()
            offsets = rows.column("offset").to_numpy()
            hits = np.flatnonzero((stamps >= timestamp_ms) & (offsets >= manifest.log_start_offset))
            if len(hits):
                return int(offsets[hits[0]])
        return None

    def _row_group(self, parquet: pq.ParquetFile, name: str, group: int) -> pa.Table:
        key = (name, group)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        rows = parquet.read_row_group(group)
        self._cached = (key, rows)  # one row group kept: a reader replaying history asks for the next records next
        return rows

    def _delete_quietly(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except OSError:
            pass  # absent already, or the store refuses: an unlisted file is never read


def read_tier_files(uri: str, directory: str, files, start: int, until: int, columns=None) -> Iterator[pa.Table]:
    """The tier rows of offsets ``[start, until)`` straight from a partition's data files ((name, base
    offset, next offset) as :meth:`RemoteTier` lists them), a row group at a time, reading only the
    row groups whose offsets overlap the range and only ``columns`` (None: all). For readers outside
    the replicas (Ray Data's read tasks); StorageError when a file cannot be read."""
    fs, _ = open_filesystem(uri)
    for name, base, next_offset in files:
        if next_offset <= start or base >= until:
            continue
        path = posixpath.join(directory, DATA_DIR, name)
        try:
            parquet = pq.ParquetFile(fs.open_input_file(path))
            offset_column = parquet.schema_arrow.get_field_index("offset")
            for group in range(parquet.num_row_groups):
                stats = parquet.metadata.row_group(group).column(offset_column).statistics
                if stats is not None and stats.has_min_max and (stats.max < start or stats.min >= until):
                    continue
                rows = parquet.read_row_group(group, columns=None if columns is None else sorted(set(columns) | {"offset"}))
                offsets = rows.column("offset")
                if stats is None or not stats.has_min_max or stats.min < start or stats.max >= until:
                    rows = rows.filter(pc.and_(pc.greater_equal(offsets, start), pc.less(offsets, until)))
                if rows.num_rows:
                    yield rows
        except (OSError, pa.ArrowException) as error:
            raise StorageError(f"cannot read {path} from the remote tier: {error}") from error


class DirectTierReader:
    """A consumer's sequential reads of a partition's tiered history straight from the tier's files, by
    the plan a leader's fetch reply offers (``files_for``: uri, directory, files, start, until), so
    that replaying history costs the leader nothing and this process only Parquet's decoding.

    Reads continue one another from ``start``: :meth:`read` returns the records of the next row
    groups as :func:`record_runs` (what a fetch's batches decode to) and the offset after them.
    Not thread-safe: one read at a time (a consumer runs each partition's reads one after another,
    in a worker thread). With ``ahead`` (an executor whose tasks never wait on others), the next row
    group is decoded there while the rows before it are handed over (one row group held ahead).
    StorageError when a file cannot be read (another host's file:// tier, a file retention deleted):
    the reader is then spent and the consumer goes back to the leader.
    """

    def __init__(self, plan: dict, ahead: Executor | None = None) -> None:
        self.uri = plan["uri"]
        self.directory = plan["directory"]
        self.files = [tuple(f) for f in plan["files"]]
        self.start = int(plan["start"])
        self.until = int(plan["until"])
        self.next_offset = self.start  # where the next read continues
        self.reads = 0  # reads that succeeded
        self._rows: Iterator[pa.Table] | None = None
        self._left: pa.Table | None = None  # rows of a row group not yet returned
        self._executor = ahead
        self._ahead: Future | None = None  # the next row group, being read
        self._closed = False

    def continues(self, offset: int) -> bool:
        """Whether a reader at ``offset`` goes on with this plan (its next read starts there)."""
        return offset == self.next_offset < self.until

    def read(self, max_bytes: int) -> tuple[list[tuple[int, pa.RecordBatch, int | None]], int]:
        """The next records, about ``max_bytes`` of them (at least one row group's part): (runs, offset after them).

        A StorageError says with ``tier_unreachable`` whether this process cannot see the tier's
        directory at all (True), or only a file of the plan is gone (retention, DeleteRecords)."""
        try:
            return self._read(max_bytes)
        except StorageError as error:
            error.tier_unreachable = not self._directory_visible()
            raise

    def _directory_visible(self) -> bool:
        try:
            fs, _ = open_filesystem(self.uri)
            return fs.get_file_info(posixpath.join(self.directory, DATA_DIR)).type == pafs.FileType.Directory
        except (InvalidConfigError, OSError, pa.ArrowException):
            return False

    def _read(self, max_bytes: int) -> tuple[list[tuple[int, pa.RecordBatch, int | None]], int]:
        runs: list = []
        size = 0
        while size < max_bytes and self.next_offset < self.until and not self._closed:
            if self._left is None:
                self._left = self._next_rows()
                if self._left is None:
                    self.next_offset = self.until  # past the plan's last file (gaps at its end included)
                    break
            rows = self._left
            take = rows.num_rows
            if size + rows.nbytes > max_bytes:
                take = max(1, int((max_bytes - size) * rows.num_rows // max(1, rows.nbytes)))
            part = rows.slice(0, take)
            self._left = rows.slice(take) if take < rows.num_rows else None
            runs.extend(record_runs(part))
            size += part.nbytes
            self.next_offset = int(part.column("offset")[take - 1].as_py()) + 1
        self.reads += 1
        return runs, self.next_offset

    def _next_rows(self) -> pa.Table | None:
        if self._rows is None:
            self._rows = read_tier_files(self.uri, self.directory, self.files, self.next_offset, self.until)
        if self._ahead is not None:
            rows, self._ahead = self._ahead.result(), None
        else:
            rows = next(self._rows, None)
        if rows is not None and self._executor is not None and not self._closed:
            self._ahead = self._executor.submit(next, self._rows, None)
        return rows

    def close(self) -> None:
        """Stop reading ahead (a row group being read is dropped, one waiting to be is not read). A read
        under way in another thread finishes, and reads nothing ahead."""
        self._closed = True
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None
        self._left = None


def _segment_rows(segment: SegmentCopy, start: int, end: int, partition: int) -> Iterator[pa.Table]:
    """The committed records of ``[start, end)`` of a segment's file, as tier rows, a batch at a time."""
    with open(segment.path, "rb") as file:
        for chunk_start, chunk_end, chunk in _chunks(file, segment.size_bytes, READ_CHUNK_BYTES):
            if chunk_end <= start or chunk_start >= end:
                continue
            aborted = [(a.producer_id, a.first_offset) for a in segment.aborted if a.first_offset < chunk_end and a.last_offset >= chunk_start]
            kept, _ = slice_visible_batches(chunk, start, end, read_committed=True, aborted=aborted)
            for header, first, batch in kept:
                yield _tier_rows(partition, header, first, batch)


DAY_MS = 86_400_000
DAY_US = DAY_MS * 1000
# At most this many files per uploaded segment: a segment of a quiet topic spans days (segment.ms is
# 7 days by default), but records crossing midnight back and forth would start a file at every
# crossing; past this many, the segment is uploaded as one file of several days instead.
MAX_DAY_FILES = 32


def _day_runs(rows: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    """Tier rows in runs of one UTC day, in offset order: (day number since the epoch, rows)."""
    days = np.floor_divide(rows.column("timestamp").cast(pa.int64()).to_numpy(), DAY_US)
    if len(days) == 0:
        return
    if days[0] == days[-1] and (days == days[0]).all():
        yield int(days[0]), rows
        return
    breaks = np.flatnonzero(np.diff(days) != 0) + 1
    for begin, stop in zip(np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(days)])).tolist()):
        yield int(days[begin]), rows.slice(begin, stop - begin)


class _DayFile:
    """One data file being written by an upload: the records of one day, from ``base`` on."""

    def __init__(self, tier: RemoteTier, day: int, base: int, leader_epoch: int) -> None:
        self.tier, self.day, self.base = tier, day, base
        self.name = f"{base:020d}-e{leader_epoch}-{secrets.token_hex(4)}.parquet"
        self.path = posixpath.join(tier.directory, DATA_DIR, self.name)
        self.temporary = f"{self.path}.tmp" if tier._local else self.path
        self.sink = None  # the output stream, closed here: closing it is what completes an object store's upload
        self.writer: pq.ParquetWriter | None = None
        self.pending: list[pa.Table] = []
        self.pending_rows = self.pending_bytes = self.records = 0
        self.low: int | None = None
        self.high: int | None = None

    def add(self, rows: pa.Table) -> None:
        self.pending.append(rows)
        self.pending_rows += rows.num_rows
        self.pending_bytes += rows.nbytes
        self.records += rows.num_rows
        extremes = pc.min_max(rows.column("timestamp"))
        low, high = extremes["min"].value // 1000, extremes["max"].value // 1000
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)
        if self.pending_rows >= ROW_GROUP_ROWS or self.pending_bytes >= ROW_GROUP_MAX_BYTES:
            self._write_pending()

    def _write_pending(self) -> None:
        if not self.pending:
            return
        if self.writer is None:
            self.sink = self.tier.fs.open_output_stream(self.temporary)
            self.writer = pq.ParquetWriter(self.sink, TIER_SCHEMA, **PARQUET_OPTIONS)
        self.writer.write_table(pa.concat_tables(self.pending), row_group_size=ROW_GROUP_ROWS)
        self.pending, self.pending_rows, self.pending_bytes = [], 0, 0

    def finish(self, next_offset: int) -> TierFile:
        """Complete the file (synced, under its name) covering ``[base, next_offset)``."""
        self._write_pending()
        self.writer.close()
        self.writer = None
        sink, self.sink = self.sink, None
        sink.close()  # raises if the store did not take the file
        if self.tier._local:
            sync_path(self.temporary)
            os.replace(self.temporary, self.path)
        info = self.tier.fs.get_file_info(self.path)
        if info.type != pafs.FileType.File:
            raise StorageError(f"{self.path} is not in the remote tier after its upload")
        return TierFile(self.name, self.base, next_offset, self.records, info.size, self.low, self.high)

    def abandon(self) -> None:
        """An upload that failed: close what is open and delete what was written (under either name)."""
        for closing in (self.writer, self.sink):
            if closing is not None:
                try:
                    closing.close()
                except (OSError, pa.ArrowException):
                    pass
        self.tier._delete_quietly(self.temporary)
        if self.temporary != self.path:
            self.tier._delete_quietly(self.path)


def _chunks(file, size_bytes: int, chunk_bytes: int):
    """The segment file's batches in runs of about ``chunk_bytes`` (a larger batch alone): (first offset,
    offset after, a view of whole batches). Only the first ``size_bytes`` are read: what the log holds.
    Each run is read into a buffer of its own (the rows built from it keep it alive), with the
    partial batch at its end carried into the next (copied once, from the run before's buffer)."""
    carried = memoryview(b"")
    remaining = size_bytes
    while remaining > 0 or len(carried):
        want = min(max(chunk_bytes, len(carried) + bh.HEADER_SIZE), len(carried) + remaining)
        buffer = np.empty(want, dtype=np.uint8)  # not zeroed: every byte is read into before it is used
        view = memoryview(buffer).cast("B")
        view[: len(carried)] = carried
        filled = len(carried)
        while filled < want:
            got = file.readinto(view[filled:want])
            if not got:
                raise StorageError(f"segment {file.name} ended {want - filled} bytes early")
            filled += got
        remaining -= want - len(carried)
        first = next_offset = None
        end = 0
        while len(buffer) - end >= bh.HEADER_SIZE:
            header = bh.BatchHeader(*bh.HEADER_STRUCT.unpack_from(buffer, end))  # its length; checked when decoded
            if header.batch_length < bh.MIN_BATCH_LENGTH:
                raise StorageError(f"segment {file.name} has an impossible batch length at position {end}")
            if end + header.size_bytes > len(buffer):
                if end == 0 and remaining > 0:  # one batch larger than a chunk: read the rest of it
                    chunk_bytes = header.size_bytes
                break
            first = header.base_offset if first is None else first
            next_offset = header.next_offset
            end += header.size_bytes
        if end == 0:
            if remaining <= 0:
                raise StorageError(f"segment {file.name} ends inside a batch")
            carried = view
            continue
        carried = view[end:]
        yield first, next_offset, view[:end]


def _tier_rows(partition: int, header: bh.BatchHeader, first: int, batch: pa.RecordBatch) -> pa.Table:
    """One batch's records as tier rows (the timestamp readers see: a LogAppendTime batch's own)."""
    count = batch.num_rows
    log_append = header.timestamp_type == bh.TIMESTAMP_LOG_APPEND_TIME
    if log_append:
        stamps = pa.array(np.full(count, header.max_timestamp_ms, dtype=np.int64))
    else:
        stamps = batch.column(2)
    return pa.Table.from_arrays(
        [
            pa.array(np.full(count, partition, dtype=np.int32)),
            pa.array(np.arange(first, first + count, dtype=np.int64)),
            pc.multiply(stamps.cast(pa.int64()), 1000).cast(pa.timestamp("us", tz="UTC")),
            pa.array(np.full(count, 1 if log_append else 0, dtype=np.int32)),
            batch.column(0),
            batch.column(1),
            batch.column(3),
        ],
        schema=TIER_SCHEMA,
    )


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def record_runs(rows: pa.Table, max_bytes: int = FRAME_MAX_BYTES) -> Iterator[tuple[int, pa.RecordBatch, int | None]]:
    """Tier rows as record batches of SCHEMA, as a log read's batches decode: (first offset, records,
    append time). One per run of consecutive offsets with one timestamp type (and, for LogAppendTime,
    one append time: its batch's), of about ``max_bytes`` each; the append time is None for CreateTime.
    No copy of keys, values or headers: the batches are slices of the rows' columns."""
    if rows.num_rows == 0:
        return
    offsets = rows.column("offset").to_numpy()
    types = rows.column("timestamp_type").to_numpy()
    stamps_ms = pc.divide(rows.column("timestamp").cast(pa.int64()), 1000)
    stamps = stamps_ms.to_numpy()
    per_run = max(1, int(max_bytes * rows.num_rows // max(1, rows.nbytes)))
    # A LogAppendTime batch's records all carry its append time: a change of it starts another run.
    breaks = np.flatnonzero((np.diff(offsets) != 1) | (np.diff(types) != 0) | ((types[1:] != 0) & (np.diff(stamps) != 0))) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(offsets)]))
    # One array per column (a row group's columns come as one chunk each: no copy), sliced per run.
    columns = [_one_array(c) for c in (rows.column("key"), rows.column("value"), stamps_ms, rows.column("headers"))]
    for run_start, run_stop in zip(starts.tolist(), stops.tolist()):
        for begin in range(run_start, run_stop, per_run):
            length = min(begin + per_run, run_stop) - begin
            records = pa.RecordBatch.from_arrays([c.slice(begin, length) for c in columns], schema=SCHEMA)
            yield int(offsets[begin]), records, int(stamps[begin]) if types[begin] else None


def _frames(rows: pa.Table):
    """Framed batches of tier rows (:func:`record_runs`, about FRAME_MAX_BYTES each); yields
    ((header, message), offset after it) (``frame_parts``)."""
    for first, records, append_time in record_runs(rows):
        frame = frame_parts(
            records,
            base_offset=first,
            timestamp_type=bh.TIMESTAMP_CREATE_TIME if append_time is None else bh.TIMESTAMP_LOG_APPEND_TIME,
        )
        yield frame, first + records.num_rows
