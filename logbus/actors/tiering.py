"""A replica's part in its partition's remote tier (``storage/tier.py``): uploads, the tier's retention, reads.

Topics with ``remote.storage.enable``. The leader copies each closed segment
to the tier once the segment lies wholly below the high watermark and the last
stable offset; then the log's local retention (``local.retention.*``) may
delete it (``PartitionLog.tiered_offset``). No polling: an upload pass starts
when a segment rolls, when this replica becomes leader, and when the high
watermark or last stable offset moves while a closed segment waits for it; a
pass uploads every segment that is ready, one at a time, in a worker thread
(the segment is read through its own file handle, so retention meanwhile does
not disturb it), then applies retention of the whole log (``retention.ms`` /
``retention.bytes``, counting local and remote bytes) to the tier. A pass that
fails is tried again after UPLOAD_FAILED_RETRY_S, twice as late each time in a
row, up to UPLOAD_FAILED_RETRY_MAX_S.

Followers learn what the tier holds by reading its manifest when one of their
segments rolls, so their local retention deletes what the tier has too.

Consumers' fetches below the local log start read the tier (in a thread), and
the log start consumers see (ListOffsets' earliest, a fetch reply's) is the
tier's. Followers' fetches never do: a follower starts at the leader's local
log start, as in Kafka.

Not thread-safe; the replica's event loop owns it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from logbus.actors import metrics
from logbus.actors.timers import Timers
from logbus.clock import wall_ms
from logbus.errors import LogbusError, NotLeaderError, TierFencedError, TierNotAvailableError
from logbus.storage.partition_log import PartitionLog, ReadResult

if TYPE_CHECKING:
    from logbus.storage.tier import RemoteTier
    from logbus.storage.tier_catalog import TierCatalog

# logbus.storage.tier (and tier_catalog, which imports it) are imported where a tier is opened
# or used, not here: they load pyarrow's compute, filesystem and Parquet modules, about 75 ms of
# CPU that every replica's process paid at start whether its topic is tiered or not (most are not).

logger = logging.getLogger(__name__)

UPLOAD_TIMER = "tier"  # a failed pass tried again
RETENTION_TIMER = "tier-retention"  # the tier's oldest file passes retention.ms
UPLOAD_FAILED_RETRY_S = 5.0
UPLOAD_FAILED_RETRY_MAX_S = 300.0
OPEN_RETRY_S = 2.0  # after a failed open, readers are told "not available" this long without trying again
REMOTE_DIR = "remote"  # the default tier's folder under the cluster's data directory


def default_tier_uri(replica_directory: str) -> str:
    """The tier a topic gets without remote.storage.uri: ``<data dir>/remote`` of the node holding the
    replica (a replica's directory is ``<data dir>/replica-<id>/<topic>-<partition>``)."""
    data_dir = os.path.dirname(os.path.dirname(os.path.abspath(replica_directory)))
    return "file://" + os.path.join(data_dir, REMOTE_DIR)


class TierSchedule:
    """One replica's uploads, tier retention and tier reads (see the module docstring).

    ``leading()`` says whether this replica leads, ``epoch()`` its leader epoch,
    ``upload_bound()`` the offset below which a segment may be uploaded (the
    smaller of the high watermark and the last stable offset), and
    ``uploaded()`` is called after the tier grew (local retention may delete
    more now). Nothing starts once ``active()`` says False.
    """

    def __init__(
        self,
        log: PartitionLog,
        timers: Timers,
        topic: str,
        topic_id: str,
        partition: int,
        replica_directory: str,
        leading: Callable[[], bool],
        epoch: Callable[[], int],
        upload_bound: Callable[[], int],
        uploaded: Callable[[], None],
        label: str,
        publish_sizes: Callable[[int, int], None],
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.log = log
        self._timers = timers
        self._topic, self._topic_id, self._partition = topic, topic_id, partition
        self._replica_directory = replica_directory
        self._leading, self._epoch, self._bound = leading, epoch, upload_bound
        self._uploaded = uploaded
        self._label = label
        self._active = active
        self._publish_sizes = publish_sizes  # the tier's size and upload lag go here (the replica: _publish_tier_sizes)
        self.tier: RemoteTier | None = None
        self._uri: str | None = None
        self.catalog: TierCatalog | None = None
        self._catalog_key: tuple | None = None
        self._catalog_behind = True  # the Iceberg table may lack what the manifest lists (synced after each pass)
        self._unlisted: list = []  # files out of the manifest, deleted once out of the Iceberg table too
        self._claimed_epoch: int | None = None  # the leader epoch whose claim on the tier is committed
        self._sweep = False
        self._pass: asyncio.Task | None = None
        self._again = False  # something asked for a pass while one ran
        self._waiting_for = None  # the offset a ready segment waits for the bound to reach
        self._failures = 0
        self.fenced = False  # a later leader wrote the tier: this replica uploads nothing more while leading
        self.uploads = 0  # files this replica uploaded (status)
        self.served_bytes = 0  # tier records served in fetch replies (status)
        self._writing: asyncio.Lock | None = None  # one writer of the tier at a time: a pass, or delete_records
        self._reads: asyncio.Lock | None = None  # consumers' tier reads, one at a time (see read_lock)
        self._opening: asyncio.Future | None = None  # the one open under way (a pass, a fetch, ListOffsets)
        self._open_failed: tuple[float, LogbusError] | None = None  # (when, why) the last open failed
        self._start_floor = 0  # the log start DeleteRecords set, in force before the tier's manifest says so

    @property
    def enabled(self) -> bool:
        return self.log.config.remote_storage_enable

    def _open(self) -> RemoteTier | None:
        """The tier, opened (or reopened after a change of remote.storage.uri); None when not tiered.
        Blocking: called in a worker thread, through :meth:`_opened`."""
        if not self.enabled:
            return None
        from logbus.storage.tier import RemoteTier  # noqa: PLC0415 (see the imports above)
        from logbus.storage.tier_catalog import TierCatalog, catalog_location  # noqa: PLC0415

        uri = self.log.config.remote_storage_uri or default_tier_uri(self._replica_directory)
        if self.tier is None or uri != self._uri:
            self.tier = RemoteTier(uri, self._topic, self._topic_id, self._partition)
            self._uri = uri
        location = catalog_location(self.log.config.remote_storage_catalog, uri)
        if (location, uri) != self._catalog_key:
            self.catalog = None if location is None else TierCatalog(location, uri, self._topic, self._topic_id)
            self._catalog_key = (location, uri)
            self._catalog_behind = True
        return self.tier

    async def _opened(self) -> RemoteTier | None:
        """:meth:`_open` in a worker thread, one at a time whoever asks (a pass, a fetch, ListOffsets:
        two opens at once would leave two tier objects); then, on the loop, the log learns how far
        the tier reaches."""
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(asyncio.to_thread(self._open))
        tier = await asyncio.shield(self._opening)
        if tier is not None and tier.manifest.files and (self.log.tiered_offset or 0) < tier.manifest.end_offset:
            self.log.tiered_offset = tier.manifest.end_offset
        return tier

    async def ensure_open(self) -> None:
        """For readers: the tier opened before a read or ListOffsets needs it (a replica opens it in its
        first pass, which may not have run yet); TierNotAvailableError (retriable) when it cannot be,
        at once for OPEN_RETRY_S after a failed open rather than once more per request."""
        if not self.enabled or self.tier is not None:
            return
        failed = self._open_failed
        if failed is not None and time.monotonic() - failed[0] < OPEN_RETRY_S:
            raise TierNotAvailableError(f"{self._label}: the remote tier cannot be opened now: {failed[1]}")
        try:
            await self._opened()
            self._open_failed = None
        except LogbusError as error:
            self._open_failed = (time.monotonic(), error)
            raise TierNotAvailableError(f"{self._label}: the remote tier cannot be opened now: {error}") from None

    def _writer_lock(self) -> asyncio.Lock:
        if self._writing is None:
            self._writing = asyncio.Lock()
        return self._writing

    # --- what starts a pass -------------------------------------------------------------------------

    def segment_rolled(self) -> None:
        if self.enabled:
            self.start()

    def leadership_changed(self) -> None:
        self.fenced = False
        self._waiting_for = None
        if self.enabled and self._leading():
            self.start()
        else:
            self._timers.disarm(RETENTION_TIMER)  # the tier's retention is its leader's

    def bound_moved(self) -> None:
        if self._waiting_for is not None and self._bound() >= self._waiting_for:
            self._waiting_for = None
            self.start()

    def start(self) -> None:
        """Run a pass now, or right after the one under way."""
        if not self._active() or not self.enabled:
            return
        if self._pass is not None and not self._pass.done():
            self._again = True
            return
        self._pass = asyncio.get_running_loop().create_task(self._run_pass())

    async def stop(self) -> None:
        """Wait for a pass under way to end (before the replica's files go)."""
        self._timers.disarm(UPLOAD_TIMER)
        self._timers.disarm(RETENTION_TIMER)
        if self._pass is not None and not self._pass.done():
            try:
                await self._pass
            except Exception:  # noqa: BLE001 (logged by the pass)
                pass

    # --- a pass -------------------------------------------------------------------------------------

    async def _run_pass(self) -> None:
        while True:
            self._again = False
            try:
                if self._leading() and not self.fenced:
                    async with self._writer_lock():
                        await self._upload_ready()
                        await self._apply_retention()
                        await self._sync_catalog()
                    self._export_sizes()
                    self._arm_tier_retention()
                else:
                    await self._follow_manifest()
                self._failures = 0
            except TierFencedError as error:
                logger.info("replica %s: %s; uploads stop until this replica leads again", self._label, error)
                self.fenced = True
            except Exception as error:  # noqa: BLE001 (LogbusError expected; anything else is a bug, logged whole)
                self._failures += 1
                if self._claimed_epoch == self._epoch():
                    self._sweep = True  # files of an upload that failed before a manifest listed them
                delay = min(UPLOAD_FAILED_RETRY_S * 2 ** (self._failures - 1), UPLOAD_FAILED_RETRY_MAX_S)
                if isinstance(error, LogbusError):
                    logger.warning("replica %s: remote tier: %s; trying again in %.0f s", self._label, error, delay)
                else:
                    logger.exception("replica %s: remote tier pass failed; trying again in %.0f s", self._label, delay)
                self._timers.arm(UPLOAD_TIMER, delay, self.start)
                return
            if not self._again or not self._active():
                return

    async def _upload_ready(self) -> None:
        """Upload every closed segment wholly below the bound that the tier does not hold yet."""
        tier = await self._opened()
        if tier is None:
            return
        if self._claimed_epoch != self._epoch():
            epoch = self._epoch()
            await asyncio.to_thread(tier.claim, epoch)
            self._claimed_epoch = epoch
            self._sweep = True  # once the Iceberg table matches the manifest: files a crash left unlisted
            self._catalog_behind = True
        while self._active() and self._leading():
            end = tier.manifest.end_offset
            if tier.manifest.files and self.log.log_start_offset > end:
                # Retention of the whole log deleted local segments before they were uploaded: the
                # offsets between are gone on every replica; the tier starts again past them.
                await self._trim(self.log.log_start_offset)
                continue
            index = next((i for i, s in enumerate(self.log.segments[:-1]) if s.next_offset > end), None)
            if index is None:
                return
            segment = self.log.segments[index]
            if segment.next_offset > self._bound():
                self._waiting_for = segment.next_offset  # bound_moved() starts the next pass
                return
            from logbus.storage.tier import segment_copy  # noqa: PLC0415 (see the imports above)

            copy = segment_copy(self.log, index)
            entries = await asyncio.to_thread(tier.upload, copy, self._epoch())
            if entries is not None:
                self.uploads += len(entries)
                metrics.tier_uploaded(self._topic, copy.size_bytes)
            if tier.manifest.end_offset <= end:
                return  # nothing moved (another uploader's race): the next roll tries again
            self.log.tiered_offset = tier.manifest.end_offset
            self._catalog_behind = True
            self._uploaded()

    async def _apply_retention(self) -> None:
        tier = self.tier
        if tier is None or not tier.manifest.files:
            return
        config = self.log.config
        if not config.delete:
            return
        not_uploaded = sum(s.size_bytes for s in self.log.segments if s.next_offset > tier.manifest.end_offset)
        cut = tier.retention_offset(wall_ms(), config.retention_ms, config.retention_bytes, not_uploaded)
        if cut is not None:
            await self._trim(cut)

    async def _trim(self, offset: int) -> None:
        """Move the tier's log start to ``offset``; its files below go once the Iceberg table no longer
        lists them (at once without a table)."""
        tier = self.tier
        removed = await asyncio.to_thread(tier.delete_before, offset, self._epoch(), self.catalog is None)
        if self.catalog is not None:
            self._unlisted += removed
            self._catalog_behind = True

    async def _sync_catalog(self) -> None:
        """Bring the topic's Iceberg table in line with this partition's manifest (after each pass that
        changed the manifest, and once after this replica claims the tier: a crash may have left it
        behind); then delete the files neither lists any more."""
        if self.tier is None:
            return
        if self.catalog is not None and self._catalog_behind:
            await asyncio.to_thread(self.catalog.sync, self._partition, self.tier.directory, self.tier.manifest)
        if self._unlisted:
            unlisted, self._unlisted = self._unlisted, []
            await asyncio.to_thread(self.tier.delete_files, unlisted)
        # Only now (a pass holds the writer lock throughout): status says "synced" once the files the
        # table dropped are gone from the filesystem too.
        self._catalog_behind = False
        if self._sweep:
            _, young = await asyncio.to_thread(self.tier.sweep_orphans)
            self._sweep = young > 0  # files left for being young are looked at again by the next pass

    def _arm_tier_retention(self) -> None:
        """One timer for the moment the tier's oldest file passes retention.ms (an idle partition's
        tier expires too); none while nothing in the tier can expire."""
        tier, config = self.tier, self.log.config
        if tier is None or not tier.manifest.files or config.retention_ms < 0 or not config.delete:
            self._timers.disarm(RETENTION_TIMER)
            return
        due_ms = tier.manifest.files[0].max_timestamp_ms + config.retention_ms + 1
        self._timers.arm(RETENTION_TIMER, (due_ms - wall_ms()) / 1000, self.start)

    async def _follow_manifest(self) -> None:
        """A follower: learn how far the tier reaches, so local retention may delete what it holds."""
        tier = await self._opened()
        if tier is None:
            return
        await asyncio.to_thread(tier.read_manifest)
        if tier.manifest.files and tier.manifest.end_offset != self.log.tiered_offset:
            self.log.tiered_offset = tier.manifest.end_offset
            self._catalog_behind = True
            self._uploaded()

    def _export_sizes(self) -> None:
        tier = self.tier
        if tier is not None:
            lag = sum(s.size_bytes for s in self.log.segments if s.next_offset > tier.manifest.end_offset)
            self._publish_sizes(tier.manifest.size_bytes, lag)

    # --- what consumers see -------------------------------------------------------------------------

    def log_start_offset(self) -> int:
        """The first offset consumers can read: the tier's log start when the tier reaches the local log."""
        tier = self.tier
        if tier is not None and self.enabled and tier.manifest.files and tier.manifest.end_offset >= self.log.log_start_offset:
            return min(max(tier.manifest.log_start_offset, self._start_floor), self.log.log_start_offset)
        return self.log.log_start_offset

    def in_tier(self, offset: int) -> bool:
        """Whether a consumer's read at ``offset`` is served by the tier (it is below the local log start)."""
        return offset < self.log.log_start_offset and self.log_start_offset() <= offset

    async def read(self, offset: int, max_bytes: int, max_offset: int | None) -> ReadResult | None:
        """Records from ``offset`` read back from the tier, as a log read returns them (what the tier
        holds was below the high watermark and the last stable offset when it was uploaded)."""
        if max_offset is not None and offset >= max_offset:
            return None
        tier = self.tier
        found = await asyncio.to_thread(tier.read, offset, max_bytes, tier.manifest)
        metrics.tier_fetched(self._topic, len(found.data))
        self.served_bytes += len(found.data)
        return ReadResult(memoryview(found.data), found.first_offset, found.next_offset)

    def read_lock(self) -> asyncio.Lock:
        """Held by a consumer's fetch from working out where its tier read starts (its session's
        position) until the read is answered: a pipelined fetch of the same session then starts where
        the one before it ended, instead of reading the same records again."""
        if self._reads is None:
            self._reads = asyncio.Lock()
        return self._reads

    async def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """ListOffsets by time over the tier's part of the log (None: no record there that late)."""
        tier = self.tier
        if tier is None or not self.enabled or not tier.manifest.files:
            return None
        return await asyncio.to_thread(tier.offset_for_timestamp, timestamp_ms, tier.manifest)

    async def delete_records(self, offset: int) -> None:
        """Kafka's DeleteRecords: the tier's log start moves to ``offset`` too (also with no file in it
        yet: an upload never starts below it), under the one-writer lock a pass holds. Readers see
        the new start at once, before the manifest does."""
        if not self.enabled:
            return
        self._start_floor = max(self._start_floor, offset)
        epoch = self._epoch()
        await self.ensure_open()
        async with self._writer_lock():
            if self._epoch() != epoch or not self._leading():
                raise NotLeaderError(f"{self._label}: leadership changed during delete_records")
            if offset > self.tier.manifest.log_start_offset:
                await self._trim(offset)
        self.start()  # the Iceberg table follows

    def files_for(self, start: int, end: int, max_files: int | None = None, max_bytes: int | None = None) -> dict | None:
        """What a reader needs to read ``[start, end)``'s tiered part straight from the tier's files: the
        tier's URI and directory, and each listed file overlapping the range as (name, base offset, next
        offset); the part is ``[start, until)``, ``until`` ending with the last of at most ``max_files``
        files and (past the first) ``max_bytes`` of them. None when the tier holds none of the range."""
        tier = self.tier
        if tier is None or not self.enabled or not tier.manifest.files:
            return None
        manifest = tier.manifest
        start = max(start, manifest.log_start_offset, self._start_floor)
        until = min(end, manifest.end_offset)
        if start >= until:
            return None
        listed = [f for f in manifest.files if f.next_offset > start and f.base_offset < until and f.name]
        if max_files is not None or max_bytes is not None:
            size = 0
            for count, f in enumerate(listed):
                size += f.size_bytes
                if count and ((max_files is not None and count >= max_files) or (max_bytes is not None and size > max_bytes)):
                    listed = listed[:count]
                    until = listed[-1].next_offset
                    break
        files = [(f.name, f.base_offset, f.next_offset) for f in listed]
        return {"uri": self._uri, "directory": tier.directory, "files": files, "start": start, "until": until}

    def delete_all(self) -> None:
        """The topic is being deleted: its tier goes too (the leader's call; a missing tier is fine)."""
        tier = self._open() if self.tier is None else self.tier
        if tier is not None:
            tier.delete_all()
        if self.catalog is not None:
            self.catalog.drop()

    def status(self) -> dict | None:
        tier = self.tier
        if tier is None:
            return None
        from logbus.storage.tier import redact  # noqa: PLC0415 (loaded with the tier: see the imports above)

        manifest = tier.manifest
        return {
            "uri": redact(self._uri),
            "log_start_offset": manifest.log_start_offset,
            "uploaded_up_to": manifest.end_offset,
            "files": len(manifest.files),
            "remote_bytes": manifest.size_bytes,
            "local_bytes": self.log.size_bytes,
            "upload_lag_bytes": sum(s.size_bytes for s in self.log.segments if s.next_offset > manifest.end_offset),
            "uploads": self.uploads,
            # Bytes of tier records this replica served in fetch replies (consumers that read the
            # files themselves cost it nothing), since it started.
            "served_bytes": self.served_bytes,
            "iceberg_table": None if self.catalog is None else self.catalog.identifier,
            "iceberg_synced": None if self.catalog is None else not self._catalog_behind,  # None: no table
        }
