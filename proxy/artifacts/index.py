"""The index of cached artifacts: an in-memory LRU backed by SQL, under a size budget.

Hits are answered from memory so that serving never waits on SQL; hit counts and access
times are written back in batches. SQL stays the record across restarts and replicas.

Several replicas (each with a disk of its own) may share the database: each row names the
replica whose disk holds its file (proxy.store.replica), and this index reads, writes, evicts
and reconciles only its own replica's rows. Processes on one cache directory are one replica.

While SQL cannot be reached or written (a PostgreSQL that is down, a SQLite file on a full
disk) the index goes on in memory: rows to write or delete, and hit counts, wait for the next
flush that works. Files on disk are never left for a row to catch up with: a row written
late only describes a file that is already whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from proxy.errors import DatabaseUnavailable, InvalidRequest
from proxy.health import DATABASE, DISK, Health
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.store.budget import spending
from proxy.store.disk import Store, renamed_after
from proxy.store.repository import (
    DATABASE_ERRORS,
    ArtifactRecord,
    PurgeNotice,
    Repository,
    is_disk_full,
    sql_failure,
)
from proxy.to_the_end import to_the_end

log = logging.getLogger(__name__)
# Free space past which a full disk counts as over, without waiting for a download to succeed.
SPACE_BACK_BYTES = 1024 * 1024
# and free inodes past which one that ran out of inodes (many small files) counts as over.
SPACE_BACK_INODES = 64
# The disk condition while the cache's filesystem cannot be written at all.
READ_ONLY = "the cache's disk is read-only"
# Rows read at once when evicting for the whole cache (enforce_shared_budget).
SHARED_EVICTION_BATCH = 1000
# Row deletions kept for when SQL is back; past this, the oldest are forgotten (a row whose
# file is gone is dropped at the next start, and ignored by replicas that check the file).
MAX_UNSYNCED_DELETES = 100_000


@functools.lru_cache(maxsize=16384)  # asked three times per request: keep hot keys' hashes
def key_hash(scope: str, key: ArtifactKey) -> str:
    """The key's name in SQL and in memory; a shared key's is what it was before scopes."""
    text = f"{scope}\0{key.id}" if scope else key.id
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Gone:
    """A row to delete once SQL takes it: only while it is still the commit fetched at
    `fetched_at`, or whichever it is with None (a removal, not an eviction)."""

    fetched_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CachedArtifact:
    record: ArtifactRecord
    path: Path

    @property
    def scope(self) -> str:
        return self.record.scope


class ArtifactCache:
    def __init__(
        self, store: Store, repo: Repository, metrics: ProxyMetrics, max_bytes: int,
        *, shared: bool = False,
    ) -> None:
        """`shared`: one of several serving processes on this cache (its metrics then tell
        the whole cache's size, from SQL)."""
        self.shared = shared
        self._shared_totals = (0, 0)
        self.store = store
        self._repo = repo
        self._metrics = metrics
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ArtifactRecord] = OrderedDict()
        self._paths: dict[str, Path] = {}  # of the entries, as hits ask for them
        self._bytes = 0  # of the files under the budget: uploads (pinned) are not
        self.pinned_bytes = 0
        self._pinned_entries = 0  # the uploads among the entries
        self._counts_unwritten = False  # the last write of hit counts failed
        self._leases: dict[str, int] = {}
        # Budget held by downloads under way (by their flight), so that the files being
        # written and the files kept together stay within max_bytes.
        self._reserved: dict[object, int] = {}
        # The announced sizes of downloads to be kept (could_fit): the room each will hold by
        # its end. Not evicted for before the bytes come (an upstream could inflate it), but
        # what the downloads after them are judged against.
        self._promised: dict[object, int] = {}
        # Only keys of the index: bounded by it, and kept across failed flushes.
        self._pending_access: dict[str, tuple[int, datetime]] = {}
        # Rows SQL has not taken yet: a record to write, or one to delete.
        self._unsynced: OrderedDict[str, ArtifactRecord | _Gone] = OrderedDict()
        # Removals (retire) whose COMMIT went unanswered while SQL could not be asked whether
        # it took them: the commit removed and when, by key hash; asked at the next flush.
        self._unsure_retires: dict[str, tuple[ArtifactRecord, datetime]] = {}
        self.health = Health()
        self._evict_lock = asyncio.Lock()
        self._upload_turn = asyncio.Lock()  # see uploads_locked
        self._deferred: asyncio.Task[None] | None = None
        # Awaited with each artifact's scope and key after it left the cache.
        self.evicted: list[Callable[[str, ArtifactKey], Awaitable[None]]] = []
        # Awaited likewise when only this process's memory of a version goes: another process
        # of this replica removed its file and row (and what was made from it) already.
        self.forgotten: list[Callable[[str, ArtifactKey], Awaitable[None]]] = []
        # The artifacts whose rows load() found without their files, and dropped (see there).
        self.gone_at_load: list[tuple[str, ArtifactKey]] = []
        metrics.cache_max.set(max_bytes)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    async def reserve(self, download: object, total: int) -> bool:
        """Hold `total` bytes of the budget for a download, evicting least recently used
        files to make room. False, with nothing evicted and the download's hold released,
        when even evicting every file not being sent would not make room: the download is
        then served but not kept."""
        async with self._evict_lock:
            held = self._reserved.get(download, 0)
            if total <= held:
                return True
            over = self._bytes + self.reserved_bytes - held + total - self.max_bytes
            victims, over = self._victims(self._entries.values(), over)
            final = max(total, self._promised.get(download, 0))
            if over > 0 or (victims and not self._fits_beside_others(download, final)):
                # Files evicted for a download that then finds no room beside the others
                # (which announced more than they hold yet) would have gone for nothing.
                self.release(download)
                return False
            self._reserved[download] = total
            await self._remove_victims(victims)
            return True

    def could_fit(self, download: object, total: int) -> bool:
        """Whether `total` bytes (a download's announced size) could be held for a download by
        evicting every file not being sent, beside what the other downloads under way will
        hold; evicts nothing. If so, `total` is what this one will hold from now on, for the
        downloads after it: judged by the room it held so far, a second download of two that
        do not fit together was kept, evicted files for the room as both grew, and then found
        none (or left none for the first): those files went for nothing."""
        if not self._fits_beside_others(download, total):
            return False
        self._promised[download] = total
        return True

    def _fits_beside_others(self, download: object, total: int) -> bool:
        """Whether `total` bytes fit the budget beside the files being sent and the room every
        other download under way holds or announced, whichever is more."""
        sent = sum(self._entries[kh].size for kh in self._leases
                   if kh in self._entries and not self._entries[kh].pinned)
        others = sum(max(self._reserved.get(d, 0), self._promised.get(d, 0))
                     for d in self._reserved.keys() | self._promised.keys() if d is not download)
        return sent + others + total <= self.max_bytes

    def release(self, download: object) -> None:
        self._reserved.pop(download, None)
        self._promised.pop(download, None)

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def uploads_locked(self, *, budgeted: bool = False) -> AsyncIterator[None]:
        """Hold the data dir's upload lock (Store.upload_lock). Its blocking wait takes a thread
        of the loop's pool, which has only cores + 4: with a waiter per upload, as many uploads
        at once took every thread, and the holder's own work in a thread (its commit's fsync)
        never ran; every upload, and everything else the server does in threads, hung for
        good. So one task of this process at a time waits for it.

        `budgeted` (a PUT's or DELETE's): the wait for this process's turn is spent from the
        request's database time (proxy.store.budget), DatabaseUnavailable past it. Each
        holder queries the database: against one that does not answer, the N-th upload
        queued waited N timeouts."""
        if budgeted and self._upload_turn.locked():
            try:
                async with spending():
                    await self._upload_turn.acquire()
            except TimeoutError:
                raise _queued_too_long() from None
        else:
            await self._upload_turn.acquire()
        released = False
        try:
            # At once where no other process holds it, as mostly: every download's commit
            # takes it, and a thread's hand-over is a wait of its own on a busy pool.
            fd = self.store.upload_lock(wait=False)
            if fd is None:
                waiting = asyncio.ensure_future(asyncio.to_thread(self.store.upload_lock))
                try:
                    async with spending() if budgeted else contextlib.nullcontext():
                        fd = await asyncio.shield(waiting)
                except (TimeoutError, asyncio.CancelledError) as e:
                    # The thread cannot be stopped: what it takes is let go as it comes, and
                    # the turn with it, so that no second thread waits beside it.
                    waiting.add_done_callback(self._unawaited_lock)
                    released = True
                    if isinstance(e, TimeoutError):
                        raise _queued_too_long() from None
                    raise
            assert fd is not None
            try:
                yield
            finally:
                os.close(fd)
        finally:
            if not released:
                self._upload_turn.release()

    def _unawaited_lock(self, waiting: asyncio.Future[int | None]) -> None:
        """The end of an upload lock's wait that nobody awaits any more (uploads_locked)."""
        if not waiting.cancelled() and waiting.exception() is None \
                and (fd := waiting.result()) is not None:
            os.close(fd)
        self._upload_turn.release()

    async def upload_here(self, scope: str, key: ArtifactKey) -> bool:
        """Whether `key` has an upload in `scope` on this replica: in this process's memory,
        or in SQL (another process's); memory alone while SQL fails (not asked then: every
        download's commit waits under the lock, and would wait out its timeout each). Asked
        under uploads_locked, it stays true or false until the lock is let go."""
        kh = key_hash(scope, key)
        held = self._entries.get(kh)
        if held is not None and held.pinned:
            return True
        # An upload's file is in place before its row (both under the lock): with no file,
        # no upload, and SQL is not asked on the way of every cold fetch's commit.
        if not self.store.artifact_path(scope, key).exists() \
                or self.health.get(DATABASE) is not None:
            return False
        try:
            row = await self._repo.get_artifact(kh)
        except DATABASE_ERRORS as e:
            self.sql_failed("looking for an upload of a fetched file", e)
            return False
        return row is not None and row.pinned

    async def load(self) -> None:
        """Rebuild the index from this replica's rows, keeping only those whose file is here
        and whole; other replicas' rows describe other disks and are left alone. Rows from
        before replicas were told apart (migration 0005) whose file is here and whole become
        this replica's: an upgraded node keeps its files as hits."""
        self.store.clear_temp()
        on_disk = set(self.store.stored_names())
        stale: list[ArtifactRecord] = []
        for rec in await self._repo.all_artifacts():
            if self._found_whole(rec, on_disk):
                self._add(rec)
            else:
                stale.append(rec)
        # Those commits only: another live process may have fetched one again since.
        dropped = await self._repo.delete_commits((r.key_hash, r.fetched_at) for r in stale)
        # Their files went with no listener told (evicted while the database was down, the
        # process stopped before it came back): what was made from them is dropped now.
        self.gone_at_load = [(r.scope, key) for r in stale if r.key_hash in dropped
                             and (key := _key_of(r)) is not None]
        claimed = [rec for rec in await self._repo.unclaimed_artifacts()
                   if self._found_whole(rec, on_disk)]
        await self._repo.claim_artifacts(r.key_hash for r in claimed)
        for rec in claimed:
            self._add(rec)
        # A file without its row: a crash between rename and insert, or another live process
        # that has just renamed it into place, or keeps its row in memory while SQL is down.
        # Only when no other process is alive can it be the first.
        orphans = "kept: another process is alive"
        if not self.store.others_alive():
            for orphan in on_disk:
                self.store.remove_name(orphan)
            orphans = "removed"
        log.info("cache index loaded for replica %s: %d artifacts, %d bytes (%d stale rows, "
                 "%d taken from before replicas, %d orphan files %s)", self._repo.replica,
                 len(self._entries), self._bytes, len(stale), len(claimed), len(on_disk),
                 orphans)
        if self.shared:
            # The gauges tell the whole cache, which every process of this replica has written
            # to SQL: read now, not at the first judge of the budget (access_flush_s away), or
            # a restarted server says its cache is empty meanwhile.
            self._shared_totals = await self._repo.totals()
            self._publish_shared()
        await self.evict()

    def _found_whole(self, rec: ArtifactRecord, on_disk: set[str]) -> bool:
        """Whether the row's file is here with the row's size; if so it is taken out of
        `on_disk` (what is left there has no row). A row whose key does not read as
        one (edited by hand, or damaged) names no file: it goes as a stale one does, and the
        server starts all the same."""
        try:
            key = ArtifactKey.from_id(rec.key)
        except InvalidRequest as e:
            log.warning("artifact row %s has a key that is no key (%r: %s): dropped",
                        rec.key_hash, rec.key[:200], e)
            return False
        # The file as it is now, not as the listing (made before the rows were read) saw it:
        # another live process may have committed it in between, file first, then its row,
        # which is no crash's leftover to drop.
        if not self.whole_here(rec, key):
            return False
        on_disk.discard(self.store.artifact_name(rec.scope, key))
        return True

    def whole_here(self, rec: ArtifactRecord, key: ArtifactKey | None = None) -> bool:
        """Whether the row's file is on this disk with the row's size."""
        key = key or ArtifactKey.from_id(rec.key)
        return _size(self.store.artifact_path(rec.scope, key)) == rec.size

    def _add(self, rec: ArtifactRecord) -> None:
        old = self._entries.pop(rec.key_hash, None)
        if old is not None:
            self._count(old, -1)
            if old.pinned and not rec.pinned:
                # A download committed over an upload of the same ID (its file has the same
                # build ID): it stays an upload, out of eviction's way.
                rec = replace(rec, pinned=True)
        self._entries[rec.key_hash] = rec
        self._count(rec, 1)
        self._publish()

    def _count(self, rec: ArtifactRecord, sign: int) -> None:
        if rec.pinned:
            self.pinned_bytes += sign * rec.size
            self._pinned_entries += sign
        else:
            self._bytes += sign * rec.size

    def _drop(self, kh: str) -> ArtifactRecord | None:
        self._paths.pop(kh, None)
        rec = self._entries.pop(kh, None)
        if rec is not None:
            self._count(rec, -1)
            self._pending_access.pop(kh, None)
            self._publish()
        return rec

    def _publish(self) -> None:
        if self.shared:
            # One of several processes: the whole cache's figures, set only where they are
            # read from SQL (_publish_shared). The gauges show the most recent process's
            # value: set again here, as a file another process fetched is learnt or one of
            # this process's goes, an old reading would hide the newer one of another.
            return
        # The files under the budget, as SQL's totals are for several processes: an upload
        # counted in the entries but not the bytes told another count by the number of
        # workers.
        self._metrics.cache_size.set(self._bytes)
        self._metrics.cache_entries.set(len(self._entries) - self._pinned_entries)

    def _publish_shared(self) -> None:
        self._metrics.cache_entries.set(self._shared_totals[0])
        self._metrics.cache_size.set(self._shared_totals[1])

    def peek(self, scope: str, key: ArtifactKey) -> CachedArtifact | None:
        kh = key_hash(scope, key)
        rec = self._entries.get(kh)
        if rec is None:
            return None
        if (path := self._paths.get(kh)) is None:  # made once: a hit's path costs a lookup
            path = self._paths[kh] = self.store.artifact_path(scope, key)
        return CachedArtifact(rec, path)

    def peek_any(self, scopes: Iterable[str], key: ArtifactKey) -> CachedArtifact | None:
        """The first of `scopes` that has the key in memory."""
        return next((hit for s in scopes if (hit := self.peek(s, key)) is not None), None)

    async def get(self, scope: str, key: ArtifactKey, *, touch: bool = True
                  ) -> CachedArtifact | None:
        """A hit from memory; on a memory miss, a row another process of this replica wrote
        (one sharing this cache directory), if its file is here. Without `touch`, a look that
        is no hit of it (not counted, its place in the LRU kept)."""
        kh = key_hash(scope, key)
        path = self.store.artifact_path(scope, key)
        rec = self._entries.get(kh)
        if rec is None:
            # No file, no hit, whatever SQL says: a stat spares a cold fetch the query.
            if (size := _size(path)) is None:
                return None
            try:
                rec = await self._repo.get_artifact(kh)
            except DATABASE_ERRORS as e:  # a miss then: fetching it beats failing the request
                self.sql_failed("looking up an artifact", e)
                return None
            if rec is None or size != rec.size:
                return None
            self._add(rec)
        hit = CachedArtifact(rec, path)
        if touch:
            self.touch(hit)
        return hit

    def touch(self, hit: CachedArtifact) -> None:
        """Count a hit: most recently used now, its hit written to SQL at the next flush."""
        kh = hit.record.key_hash
        if kh not in self._entries:
            return  # evicted meanwhile
        self._entries.move_to_end(kh)
        hits, _ = self._pending_access.get(kh, (0, hit.record.last_access))
        self._pending_access[kh] = (hits + 1, datetime.now(UTC))

    @contextlib.contextmanager
    def lease(self, scope: str, key: ArtifactKey) -> Iterator[None]:
        """Hold while a file is being sent or read, so eviction passes it over."""
        kh = key_hash(scope, key)
        self._leases[kh] = self._leases.get(kh, 0) + 1
        try:
            yield
        finally:
            if self._leases[kh] == 1:
                del self._leases[kh]
                if self._bytes + self.reserved_bytes > self.max_bytes:
                    # Eviction passed this file over while it was being sent: try again now.
                    self._deferred = asyncio.get_running_loop().create_task(self.evict())
            else:
                self._leases[kh] -= 1

    async def add(self, rec: ArtifactRecord, *, row_now: bool = False) -> None:
        """Index a committed file; its row is written now, or at a later flush if SQL fails.
        With `row_now`, a failure is raised instead, with nothing indexed and the row taken
        back (the caller removes the file)."""
        self._unsynced.pop(rec.key_hash, None)
        try:
            await self._repo.put_artifact(rec)
            self.health.ok(DATABASE)
        except DATABASE_ERRORS as e:
            self.sql_failed("writing an artifact's row", e)
            if row_now:
                await self._take_back(rec)
                raise
            self._unsynced[rec.key_hash] = rec
        self._add(rec)
        await self.evict(keep=rec.key_hash)

    async def _take_back(self, rec: ArtifactRecord) -> None:
        """Delete the row of this commit, which the database may have taken though its
        answer was lost (the connection cut after the COMMIT went): now where SQL answers,
        else at the first flush that reaches it. Taken back only now, it stayed for good when
        the database was still away: a pinned upload on no file, in the upload budget, and
        another file's PUT of its key a 409."""
        try:
            await self._repo.delete_commits([(rec.key_hash, rec.fetched_at)])
        except DATABASE_ERRORS as e:
            self.sql_failed("taking back a row it may have written", e)
            self._delete_later([(rec.key_hash, rec.fetched_at)])

    async def _delete_rows(self, key_hashes: list[str]) -> None:
        for kh in key_hashes:
            self._unsynced.pop(kh, None)
        try:
            await self._repo.delete_artifacts(key_hashes)
        except DATABASE_ERRORS as e:
            self.sql_failed("deleting artifacts' rows", e)
            self._delete_later((kh, None) for kh in key_hashes)

    def _delete_later(self, rows: Iterable[tuple[str, datetime | None]]) -> None:
        for kh, fetched_at in rows:
            self._unsynced[kh] = _Gone(fetched_at)
        while len(self._unsynced) > MAX_UNSYNCED_DELETES:
            self._unsynced.popitem(last=False)

    async def _take(self, records: list[ArtifactRecord], *, rows_later: bool = False
                    ) -> list[ArtifactRecord]:
        """Those of `records` whose rows still describe the commits they do, their rows
        deleted (with `rows_later`: only read now, deleted at the next flush): whose files are
        theirs to remove. Another process may have evicted a key and fetched it again since
        this one read its record (kept in memory since, or read from SQL a moment ago): the
        file at its path is then that fetch's. When SQL cannot tell, the records are believed,
        as before there were commits to tell apart."""
        taken: list[ArtifactRecord] = []
        asked: list[ArtifactRecord] = []
        for rec in records:
            pending = self._unsynced.get(rec.key_hash)
            if isinstance(pending, ArtifactRecord):  # a commit of this process SQL lacks
                if pending.fetched_at == rec.fetched_at:
                    del self._unsynced[rec.key_hash]
                    taken.append(rec)
                continue  # else SQL's row is older than the file this process put there
            asked.append(rec)
        commits = [(rec.key_hash, rec.fetched_at) for rec in asked]
        try:
            if rows_later:
                now = await self._repo.commits_of(kh for kh, _ in commits)
                theirs = {kh for kh, fetched_at in commits if now.get(kh) == fetched_at}
            else:
                for kh, _ in commits:
                    self._unsynced.pop(kh, None)
                theirs = await self._repo.delete_commits(commits)
        except DATABASE_ERRORS as e:
            self.sql_failed("deleting evicted artifacts' rows", e)
            theirs = {kh for kh, _ in commits}
            rows_later = True
        if rows_later:
            self._delete_later((kh, when) for kh, when in commits if kh in theirs)
        return taken + [rec for rec in asked if rec.key_hash in theirs]

    def _forget(self, rec: ArtifactRecord) -> None:
        """Drop the index's entry of this commit of its key, if it holds that one."""
        held = self._entries.get(rec.key_hash)
        if held is not None and held.fetched_at == rec.fetched_at:
            self._drop(rec.key_hash)

    def sql_failed(self, doing: str, error: BaseException) -> None:
        """Note a failed query: the disk if SQLite found it full, else the database."""
        reason = f"{doing}: {sql_failure(error)}"
        if is_disk_full(error):
            self.health.fail(DISK, reason)
        else:
            self.health.fail(DATABASE, reason)
        log.warning("SQL failed %s; going on without it", reason)

    async def upload_scopes(self) -> set[str]:
        """The scopes that hold an upload on some replica (from SQL)."""
        return await self._repo.upload_scopes()

    async def retire(self, rec: ArtifactRecord) -> None:
        """Remove this commit of its key for good (an upload deleted, a download an upload
        replaces), on every serving process and replica: its rows and a notice of it first,
        in one transaction (Repository.retire_artifact), then this process's memory and the
        file. Raises DATABASE_ERRORS with nothing removed: the other processes would go on
        serving it, unknowing. The caller holds the upload lock: the file is this commit's."""
        key = ArtifactKey.from_id(rec.key)
        # What was made from it (its symbol table) goes before its rows, and again with its
        # file below (a profile may build it anew meanwhile): a process killed between the
        # rows and the listeners kept a table of a file no row describes, and profiles were
        # symbolized for good by an upload deleted with a 204 (nor could `cache purge`, which
        # finds tables by their artifacts' rows, take it). Killed here, the file stays, and
        # its table is made from it again.
        await self._notify_evicted([(rec.scope, key)])
        when = datetime.now(UTC)
        try:
            await self._repo.retire_artifact(rec, when)
        except DATABASE_ERRORS:
            # Its COMMIT may have landed with the answer lost (a cut connection): the rows
            # are gone and the notice is there, which this replica's processes take for a
            # removal done (_forget_version), so a 503 here left the file on disk, on no row,
            # until a restart. Asked, where the database answers again; else raised, and
            # asked at the first flush that reaches it (_settle_retires).
            try:
                taken: bool | None = await self._repo.purged_since(rec.key_hash, rec.sha256,
                                                                   when)
            except DATABASE_ERRORS:
                taken = None
            if taken:
                return await self._retired(rec, key)
            if taken is None:
                self._unsure_retires[rec.key_hash] = (rec, when)
            raise
        self._unsure_retires.pop(rec.key_hash, None)
        await self._retired(rec, key)

    async def _settle_retires(self) -> None:
        """Finish the removals SQL took though their 503 said otherwise (see retire): their
        file, on no row, stayed on disk until a restart, and every DELETE sent again was a
        404. Raises DATABASE_ERRORS, the rest kept for the next flush."""
        while self._unsure_retires:
            kh, (rec, when) = unsure = next(iter(self._unsure_retires.items()))
            if await self._repo.purged_since(kh, rec.sha256, when):
                async with self.uploads_locked():
                    # Under the lock, as retire's caller holds it: a commit of the key made
                    # since (a PUT sent again) is another file, and stays.
                    held = self._entries.get(kh)
                    pending = self._unsynced.get(kh)
                    newer = (held is not None and held.fetched_at != rec.fetched_at) or (
                        isinstance(pending, ArtifactRecord)
                        and pending.fetched_at != rec.fetched_at)
                    if not newer and kh not in await self._repo.commits_of([kh]):
                        key = ArtifactKey.from_id(rec.key)
                        if self._renamed_over(rec, key):
                            # Another process's commit of the key (a download while the
                            # database was away, its row still to be written) put its file
                            # there since: theirs stays, only this one's memory of it goes.
                            if isinstance(pending, ArtifactRecord):
                                del self._unsynced[kh]  # the removed commit's row, unwritten
                            if held is not None:
                                self._drop(kh)
                        else:
                            await self._retired(rec, key)
            if self._unsure_retires.get(kh) == unsure[1]:
                del self._unsure_retires[kh]

    def _renamed_over(self, rec: ArtifactRecord, key: ArtifactKey) -> bool:
        """Whether the file at the commit `rec`'s path was put there after it."""
        try:
            st = os.stat(self.store.artifact_path(rec.scope, key))
        except FileNotFoundError:
            return False
        return renamed_after(st, rec.fetched_at)

    async def _retired(self, rec: ArtifactRecord, key: ArtifactKey) -> None:
        """The rest of retire, once SQL has taken the removal."""
        if isinstance(self._unsynced.get(rec.key_hash), ArtifactRecord):
            del self._unsynced[rec.key_hash]  # kept while SQL was failing: its file goes now
        # Whichever commit memory holds: none is on disk once the file goes (a stale one is
        # another process's earlier removal, whose notice this one has not polled yet).
        await self._let_go(rec.key_hash, rec.scope, key)

    async def purged(self, notice: PurgeNotice) -> None:
        """Apply a purge notice: an operator's purge of every version of a key, or the one
        version another process removed (see retire)."""
        key = ArtifactKey.from_id(notice.key)
        if notice.replica == self._repo.replica:
            await self._forget_version(notice, key)
        else:
            await self._purged_here(notice, key)

    async def _forget_version(self, notice: PurgeNotice, key: ArtifactKey) -> None:
        """A version another process of this replica removed: it took the file and row (and
        may have put a newer commit of the key there since), so only memory is this
        process's to clear, and only while it holds that very commit."""
        held = self._entries.get(notice.key_hash)
        if held is None or held.fetched_at != notice.fetched_at:
            return
        self._drop(notice.key_hash)
        await self._notify(self.forgotten, [(notice.scope, key)])

    async def _purged_here(self, notice: PurgeNotice, key: ArtifactKey) -> None:
        """An operator's purge (every version, on every replica), or a version another
        replica removed: the notice's transaction deleted this replica's rows of what it
        purged, so a copy whose row is gone is purged, and goes from memory and disk, whether
        or not this process had it in memory (another process of this replica may have
        fetched it). A row there now is a commit made since (a fetch after the purge, on a
        request that found the file gone before the notice came; a re-upload taken from the
        bucket), and stays; so does a file of other bytes than the version removed, or a
        commit SQL has not taken yet.

        Under the data dir's upload lock, which an upload holds from its file's rename to its
        row: between the two, another process's upload of the key looked purged (no row), and
        its file was removed after its PUT had been told 201."""
        kh = notice.key_hash
        held = self._entries.get(kh)
        if held is not None and notice.sha256 is not None and held.sha256 != notice.sha256:
            return
        async with self.uploads_locked():
            # Asked under the lock: a download of this process committed while the notice
            # waited for it, its row held back (SQL failing), is judged by its own time.
            pending = self._unsynced.get(kh)
            if isinstance(pending, ArtifactRecord):
                await self._unless_purged(pending)
                return
            now = (await self._repo.commits_of([kh])).get(kh)
            if now is None:
                self._drop(kh)
                self.store.remove_artifact(notice.scope, key)
        if now is None:
            await self._notify_evicted([(notice.scope, key)])  # as _let_go, past the lock
            return
        held = self._entries.get(kh)  # this process's own upload may have come meanwhile
        if held is not None and held.fetched_at != now:
            # Another process's newer commit is there: read again when asked.
            self._drop(kh)
            await self._notify(self.forgotten, [(notice.scope, key)])

    async def _unless_purged(self, pending: ArtifactRecord) -> bool:
        """A commit of this process whose row SQL has not taken yet (fetched while SQL was
        failing): let go of, file and all, if a purge of its key (or a removal of its version)
        was made since it was committed, which found no row of it to delete; else kept, True.
        Written as it was, its row was taken for a fetch made after the purge, and the file
        the operator purged was served on. Raises DATABASE_ERRORS."""
        kh = pending.key_hash
        if not await self._repo.purged_since(kh, pending.sha256, pending.fetched_at):
            return True
        if self._unsynced.get(kh) is pending:
            del self._unsynced[kh]
        held = self._entries.get(kh)
        if held is not None and held.fetched_at == pending.fetched_at:
            log.info("%s was purged while its row could not be written: removed", pending.key)
            await self._let_go(kh, pending.scope, ArtifactKey.from_id(pending.key))
        return False

    async def still_current(self, rec: ArtifactRecord) -> bool | None:
        """Whether SQL's row of the key is still this commit; None: SQL cannot tell. A file
        opened before this asks is then the commit's: every removal of a commit (an eviction,
        a purge, a retired upload) deletes its row before another file comes to its path."""
        if self._unsynced.get(rec.key_hash) is rec:
            return True  # this process's own commit, whose row SQL has not taken yet
        if self.health.get(DATABASE) is not None:
            # Not asked while known down, as upload_here: every hit of such a file waited out
            # database.timeout_s, all the outage long, for the None it then got.
            return None
        try:
            now = (await self._repo.commits_of([rec.key_hash])).get(rec.key_hash)
        except DATABASE_ERRORS as e:
            self.sql_failed("looking up an artifact's commit", e)
            return None
        return now == rec.fetched_at

    async def vanished(self, rec: ArtifactRecord) -> None:
        """This commit's file was found missing (an operator, a disk cleaner, another process's
        eviction): forget it, and its row while that still describes it. Its path is left
        alone: a file there now is another process's newer fetch of the key."""
        self._forget(rec)
        if await self._take([rec]):
            await self._notify_evicted([(rec.scope, ArtifactKey.from_id(rec.key))])

    async def remove(self, scope: str, key: ArtifactKey) -> bool:
        kh = key_hash(scope, key)
        if self._drop(kh) is None:
            return False
        await self._delete_rows([kh])
        self.store.remove_artifact(scope, key)
        await self._notify_evicted([(scope, key)])
        return True

    async def _let_go(self, kh: str, scope: str, key: ArtifactKey) -> None:
        """Out of this process's memory and off the disk, and the listeners told (symbol
        tables built from it, hot files); its rows are the caller's."""
        self._drop(kh)
        self.store.remove_artifact(scope, key)
        await self._notify_evicted([(scope, key)])

    async def _notify_evicted(self, keys: list[tuple[str, ArtifactKey]]) -> None:
        await self._notify(self.evicted, keys)

    @staticmethod
    async def _notify(listeners: list[Callable[[str, ArtifactKey], Awaitable[None]]],
                      keys: list[tuple[str, ArtifactKey]]) -> None:
        for scope, key in keys:
            for listener in listeners:
                try:
                    await listener(scope, key)
                except DatabaseUnavailable as e:
                    # An outage (a version retired tells them before its rows go, which
                    # then fail too): one line, no traceback.
                    log.warning("eviction listener for %s: %s", key.id, e.reason)
                except Exception:  # a listener's failure must not stop eviction
                    log.exception("eviction listener failed for %s", key.id)

    async def evict(self, keep: str | None = None) -> None:
        """Drop least recently used artifacts until the cache fits its budget.

        Files being sent, and `keep` (what was just fetched), are passed over: the cache may
        stay over budget until their leases end.
        """
        async with self._evict_lock:
            # Downloads under way keep the room they hold.
            over = self._bytes + self.reserved_bytes - self.max_bytes
            if over <= 0:
                return
            victims, _ = self._victims(self._entries.values(), over, keep)
            await self._remove_victims(victims)

    def _victims(self, records: Iterable[ArtifactRecord], over: int, keep: str | None = None
                 ) -> tuple[list[ArtifactRecord], int]:
        """The first of `records` (least recently used first) to evict for `over` bytes,
        passing over files being sent and `keep`; and the bytes still over after them."""
        victims: list[ArtifactRecord] = []
        for rec in records:
            if over <= 0:
                break
            if rec.key_hash in self._leases or rec.key_hash == keep or rec.pinned:
                continue
            victims.append(rec)
            over -= rec.size
        return victims, over

    async def _remove_victims(self, victims: list[ArtifactRecord], *, rows_later: bool = False
                              ) -> list[ArtifactRecord]:
        """Evict these, each only while its row describes its commit (see _take): rows
        first, or at the next flush with `rows_later` (on a full disk, a SQLite write now
        would take the very space just freed), then files (a reader's open descriptor keeps
        its file). A victim whose key was fetched again meanwhile is only forgotten. What
        was evicted."""
        if not victims:
            return []
        for rec in victims:
            self._forget(rec)
        evicted = []
        for rec in await self._take(victims, rows_later=rows_later):
            held = self._entries.get(rec.key_hash)
            if held is not None and held.fetched_at > rec.fetched_at:
                continue  # this process committed the key again as its row went: that file
            evicted.append(rec)
        keys: list[tuple[str, ArtifactKey]] = []
        for rec in evicted:
            self._drop(rec.key_hash)  # an older record of the key, if any: its file is going
            keys.append((rec.scope, ArtifactKey.from_id(rec.key)))
            self.store.remove_artifact(*keys[-1])
            self._metrics.evictions.inc()
            self._metrics.evicted_bytes.inc(rec.size)
        await self._notify_evicted(keys)
        if evicted:
            log.info("evicted %d artifacts (%d bytes)", len(evicted),
                     sum(r.size for r in evicted))
        if len(evicted) < len(victims):
            log.info("%d artifacts to evict had been fetched again by another process; "
                     "left to it", len(victims) - len(evicted))
        return evicted

    async def flush_access(self) -> None:
        """Write what SQL has not taken yet: rows, then hit counts. A failed batch stays for
        the next flush (merged with what came since) and the failure is raised to be logged."""
        await self._sync_rows()
        batch, self._pending_access = self._pending_access, {}
        if not batch:
            # The counts of a failed write whose files left since (evicted, purged) are not
            # written ever: none pending, /healthz may say the database well again.
            self._counts_unwritten = False
            return
        # Not cut by a cancel (a stop), which is raised once the write is over: a write cut
        # after the database took its COMMIT would be put back as failed, and its hits
        # counted twice by the stop's last flush.
        writing = asyncio.ensure_future(self._repo.record_access(batch))
        try:
            await to_the_end(writing)
        finally:
            if writing.cancelled() or writing.exception() is not None:
                if isinstance(error := None if writing.cancelled() else writing.exception(),
                              DATABASE_ERRORS):
                    self.sql_failed("writing hit counts", error)
                    self._counts_unwritten = True
                for kh, (hits, when) in batch.items():
                    if kh not in self._entries:
                        continue  # evicted meanwhile: its row is gone
                    newer_hits, newer = self._pending_access.get(kh, (0, when))
                    self._pending_access[kh] = (hits + newer_hits, max(when, newer))
            else:
                self._counts_unwritten = False
                self.health.ok(DATABASE)
                for kh, (hits, when) in batch.items():
                    if (rec := self._entries.get(kh)) is not None:
                        self._entries[kh] = replace(rec, hits=rec.hits + hits,
                                                    last_access=when)


    async def _sync_rows(self) -> None:
        """Write the rows kept while SQL was failing; the database is said well again only
        where this asked it something: a flush with none to write, during an outage, said so
        with no query made, and every hit that asks SQL when it is not known down (the
        commit of a file whose inode changed) then waited out database.timeout_s again."""
        if not (self._unsure_retires or self._unsynced):
            return
        try:
            await self._settle_retires()
        except DATABASE_ERRORS as e:
            self.sql_failed("asking whether removals were taken", e)
            raise
        while self._unsynced:
            kh, rec = next(iter(self._unsynced.items()))
            try:
                if isinstance(rec, ArtifactRecord):
                    if await self._unless_purged(rec):
                        await self._repo.put_artifact(rec)
                elif rec.fetched_at is None:
                    await self._repo.delete_artifacts([kh])
                else:
                    await self._repo.delete_commits([(kh, rec.fetched_at)])
            except DATABASE_ERRORS as e:
                self.sql_failed("writing rows kept while SQL was failing", e)
                raise
            if self._unsynced.get(kh) is rec:
                del self._unsynced[kh]
        self.health.ok(DATABASE)

    async def enforce_shared_budget(self) -> None:
        """Judge the whole cache, every process's files on this replica's disk, against
        the budget, and evict its least recently used (by SQL's record) until it fits. Each
        process's own eviction only knows the files it has seen; this is what keeps several
        serving processes together within max_bytes. One process at a time does it."""
        fd = self.store.try_budget_lock()
        if fd is None:
            return
        try:
            # Read before the lock too: every miss's reserve() takes it, and a database that
            # does not answer held them all for this read's timeout. Only a cache over its
            # budget is read again under the lock, where an eviction cannot be under way.
            count, total = await self._repo.totals()
            async with self._evict_lock:
                if total + self.reserved_bytes > self.max_bytes:
                    count, total = await self._repo.totals()
                self._shared_totals = (count, total)
                over = total + self.reserved_bytes - self.max_bytes
                if over > 0:
                    victims, _ = self._victims(
                        await self._repo.least_recently_used(SHARED_EVICTION_BATCH), over)
                    evicted = await self._remove_victims(victims)
                    self._shared_totals = (count - len(evicted),
                                           total - sum(r.size for r in evicted))
                self._publish_shared()
        finally:
            os.close(fd)

    @property
    def rows_pending(self) -> int:
        """Rows this process could not write to SQL and keeps for a later flush, and
        removals SQL has not told it the fate of; and its hit counts, as one, while their
        last write failed (a read-only SQLite file, which answers /healthz's ping: the
        database was said well there and down again at every flush round)."""
        return len(self._unsynced) + len(self._unsure_retires) + int(self._counts_unwritten)

    def recheck_space(self) -> None:
        """Judge the disk again: a full-disk (or read-only) condition cleared once space is
        back (an operator freed some) and it can be written, and set while the disk is that
        full, or read-only, though this process met no write that failed: another serving
        process on this data dir may have, and /healthz must not say "ok" or "degraded" by
        which of them a probe reaches."""
        try:
            inodes = self.store.free_inodes()
            full = (self.store.free_bytes() < SPACE_BACK_BYTES
                    or (inodes is not None and inodes < SPACE_BACK_INODES))
            database = self._repo.sqlite_file
            # A SQLite file elsewhere (database.url on another filesystem): the condition
            # its failed writes set is the same "disk", and its space is judged too, or
            # the cache's room would clear it while every write fails, its log unable to
            # grow or be checkpointed into the file.
            database_full = database is not None and _free_bytes(database.parent) \
                < SPACE_BACK_BYTES
            read_only = self.store.read_only()
        except OSError:
            return
        if read_only:
            # Room to spare, and nothing can be written: not "ok" because space is free.
            self.health.fail(DISK, READ_ONLY)
        elif not full and not database_full:
            self.health.ok(DISK)
        elif self.health.get(DISK) is None:
            self.health.fail(DISK, f"the {'cache' if full else 'database'}'s disk is full "
                             f"(less than {SPACE_BACK_BYTES >> 20} MiB"
                             f"{f' or {SPACE_BACK_INODES} files' if full else ''} free)")

    async def make_room(self, wanted: int) -> int:
        """Evict least recently used artifacts not being sent until `wanted` bytes are freed,
        whatever the budget: the disk is full. The bytes freed."""
        async with self._evict_lock:
            victims, _ = self._victims(self._entries.values(), wanted)
            return sum(r.size for r in await self._remove_victims(victims, rows_later=True))


def _key_of(rec: ArtifactRecord) -> ArtifactKey | None:
    """The row's key; None where it does not read as one (see _found_whole)."""
    try:
        return ArtifactKey.from_id(rec.key)
    except InvalidRequest:
        return None


def _queued_too_long() -> DatabaseUnavailable:
    return DatabaseUnavailable("the uploads and deletes before this one wait for the database; "
                               "retry later")


def _free_bytes(folder: Path) -> int:
    """Space left on the filesystem of `folder` (for an unprivileged writer)."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
