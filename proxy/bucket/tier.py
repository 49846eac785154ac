"""The shared tier: a replica's local miss is looked for in the bucket before any upstream;
what a replica fetches from upstream is written to the bucket, then announced in the catalogue
(bucket_objects); one replica at a time fetches a key from upstream (a lease), and the others
wait for its bucket copy.

Why wait for the bucket copy, not stream from the fetching replica: replicas then reach only
the bucket and the database, never each other (pods behind a balancer have no stable address
to name), a fetch outlives the replica that made it, and the balancer's consistent hashing
sends a key's clients to one replica, so one key wanted on two replicas at once is the rare
case. Its price there: the waiting replica's first byte comes after the fetcher's last.

A bucket that is down or hangs is passed by (proxy.bucket.objects): requests go to the
upstreams as on a single node, files are uploaded later by the catch-up (sync), and no
client sees an error for it. A copy whose bytes do not match its row is deleted and refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from proxy.bucket.leases import Lease, Leases
from proxy.bucket.objects import Bucket, BucketDown, ObjectStream, WrongCopy
from proxy.config import StorageConfig
from proxy.errors import RememberedNotFound, UpstreamUnavailable, VerificationFailed
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.sources.base import ArtifactMeta
from proxy.store.repository import DATABASE_ERRORS, ArtifactRecord, BucketRecord, Repository
from symbolize.symtab import FORMAT

log = logging.getLogger(__name__)
# A replica waiting for another's fetch looks for its copy this often, backing off to the
# longest: the delay a waiting replica's first byte may have beyond the copy's arrival.
POLL_FIRST_S = 0.05
POLL_LONGEST_S = 0.5
# Files the catch-up uploads per round, and objects eviction deletes per statement.
SYNC_BATCH = 64
EVICT_BATCH = 100
# How long a stop waits for the tier's background jobs (access times of copies read, a table's
# upload) before it cuts what is left.
CLOSE_WAIT_S = 10.0
EVICTION_LEASE = "bucket-eviction"
ORPHANS_LEASE = "bucket-orphans"
# The only objects a sweep may delete: what object_path makes, of any table format. Anything
# else under the prefix is not symgate's to judge.
_OUR_OBJECT = re.compile(r"(?:[a-z]+|symtab/[^/]+)/([0-9a-f]{64})")
TABLE = "symtab"
# What a write to or read from the shared tier can meet that leaves this replica as it was.
_SHARED_ERRORS: tuple[type[BaseException], ...] = (BucketDown, OSError, *DATABASE_ERRORS)


def object_path(kind: str, kh: str) -> str:
    return f"{TABLE}/{FORMAT}/{kh}" if kind == TABLE else f"{kind}/{kh}"


def fetch_lease(kh: str) -> str:
    """The lease of the replica fetching (or catching up) a key for the cluster."""
    return f"fetch:{kh}"


def table_key(build_id: str) -> str:
    """A symbol table's key: its format is part of it, so a new format is a new object."""
    return f"{TABLE}/{FORMAT}/{build_id}"


def table_hash(scope: str, build_id: str) -> str:
    text = f"{scope}\0{table_key(build_id)}" if scope else table_key(build_id)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Obtained:
    """How this replica gets a key it lacks: the bucket's copy (body), or the right to fetch
    it from upstream for the cluster (lease); neither: fetch it alone (the bucket or the
    database failing, or the wait too long)."""

    body: BucketBody | None = None
    lease: Lease | None = None


class BucketBody:
    """A bucket object read as an upstream's answer (proxy.sources.base.Body), checked
    against its catalogue row as it streams: size and sha256, before the last byte goes."""

    def __init__(self, rec: BucketRecord, chunks: ObjectStream,
                 refuse: Callable[[BucketRecord], Awaitable[None]]) -> None:
        self.rec = rec
        self.meta = ArtifactMeta(upstream=rec.upstream, size=rec.size, filename=rec.filename,
                                 archive=rec.archive, last_modified=rec.last_modified,
                                 ima_signature=rec.ima_signature)
        self._chunks = chunks
        self._refuse = refuse

    async def chunks(self) -> AsyncIterator[bytes]:
        digest = hashlib.sha256()
        size = 0
        ended = True
        try:
            async for chunk in self._chunks:
                if size + len(chunk) > self.rec.size:  # more than was written there
                    ended = False
                    break
                size += len(chunk)
                digest.update(chunk)
                yield chunk
        except BucketDown as e:
            raise UpstreamUnavailable(f"the shared bucket stopped sending {self.rec.key}: {e}"
                                      ) from e
        finally:
            self.close()
        if size != self.rec.size or not ended:
            # Cut short or run on, each a whole answer by its Content-Length: what was sent
            # may be the file's start all the same, so it is finished from an upstream as a
            # copy that breaks off is (proxy.artifacts.resume), whose first bytes are checked
            # against these. Cut, its client had to come again for the file.
            await self._refuse(self.rec)
            sent = f"{size} bytes" if ended else f"more than {self.rec.size} bytes"
            raise UpstreamUnavailable(f"the shared bucket sent {sent} of {self.rec.key}, "
                                      f"where {self.rec.size} were written; its row deleted")
        if digest.hexdigest() != self.rec.sha256:
            await self._refuse(self.rec)
            raise VerificationFailed(f"the shared bucket's copy of {self.rec.key} does not "
                                     "match what was written there; deleted")

    def close(self) -> None:
        self._chunks.close()


class SharedTier:
    def __init__(self, bucket: Bucket, repo: Repository, config: StorageConfig,
                 metrics: ProxyMetrics, replica: str) -> None:
        self.bucket = bucket
        self._repo = repo
        self._config = config
        self._metrics = metrics
        self._replica = replica
        self.leases = Leases(repo, replica, config.lease_s)
        self._tasks: set[asyncio.Task[None]] = set()
        self._publishing: set[str] = set()  # key hashes this process is writing now
        # The eviction's holds of a key's lease, under holders of their own (not `replica:`):
        # an upload waits for one (a DELETE) whichever process of whichever replica has it,
        # where it does not wait for this replica's fetch of the key (publish_upload).
        self._eviction_leases = Leases(repo, f"eviction-{replica}", config.lease_s)
        self._next_sweep = 0.0  # time.monotonic() of this process's next orphan sweep

    # -- a local miss ------------------------------------------------------------------------
    async def obtain(self, kh: str, hashes: Sequence[str], key: ArtifactKey,
                     missing: Callable[[], Awaitable[bool]]) -> Obtained:
        """The bucket's copy of `key` under the first of `hashes` (its names in the scopes the
        request sees) that has one, else the lease to fetch it (`kh`: its name in the
        request's scope) from upstream, else, while another replica holds that lease, its copy
        once it lands. Raises RememberedNotFound when the other replica's fetch found nothing
        (`missing`)."""
        deadline = asyncio.get_running_loop().time() + self._config.wait_s
        delay = POLL_FIRST_S
        waited = False
        while self.bucket.available:
            try:
                if (body := await self._copy(hashes, key)) is not None:
                    self._metrics.cluster_fetches.labels("waited" if waited else "bucket").inc()
                    return Obtained(body=body)
                if not self.bucket.available:
                    break
                lease = await self.leases.take(fetch_lease(kh))
                if lease is not None:
                    # The holder before may have published, or found nothing, just now: both
                    # asked at once, a round trip before the upstream is.
                    try:
                        body, gone = await self._copy_or_missing(hashes, key, missing)
                    except BaseException:
                        await lease.release()  # or it is renewed, and held, for ever
                        raise
                    if body is not None or gone:
                        try:
                            await lease.release()
                        except BaseException:  # a cancel (a stop) once the row is dropped
                            if body is not None:
                                body.close()
                            raise
                        if body is None:
                            raise RememberedNotFound()
                        self._metrics.cluster_fetches.labels("waited").inc()
                        return Obtained(body=body)
                    self._metrics.cluster_fetches.labels("upstream").inc()
                    return Obtained(lease=lease)
                if await missing():
                    raise RememberedNotFound()
            except DATABASE_ERRORS as e:
                log.warning("cannot ask the cluster for %s (%s): fetching it alone", key.id,
                            type(e).__name__)
                break
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("waited %.0f s for another replica's fetch of %s: fetching it too",
                            self._config.wait_s, key.id)
                break
            waited = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_LONGEST_S)
        self._metrics.cluster_fetches.labels("alone").inc()
        return Obtained()

    async def _copy_or_missing(self, hashes: Sequence[str], key: ArtifactKey,
                               missing: Callable[[], Awaitable[bool]]
                               ) -> tuple[BucketBody | None, bool]:
        """Both at once. A copy opened while the other failed is closed, not left holding its
        connection until the garbage collector comes."""
        copied, gone = await asyncio.gather(self._copy(hashes, key), missing(),
                                            return_exceptions=True)
        if isinstance(gone, BaseException):
            if isinstance(copied, BucketBody):
                copied.close()
            raise gone
        if isinstance(copied, BaseException):
            raise copied
        return copied, gone

    async def holds(self, kh: str) -> bool | None:
        """Whether the catalogue has a whole copy under `kh` (None with the database failing:
        nobody can tell): asked before anything is made to copy it."""
        try:
            return bool(await self._repo.bucket_objects([kh]))
        except DATABASE_ERRORS:
            return None

    async def copy(self, hashes: Sequence[str], key: ArtifactKey) -> BucketBody | None:
        """The first of `hashes`' copies in the bucket, opened, without waiting for any other
        replica's fetch: for what no upstream could give (an upload, or a key that no source
        of this replica remembers missing). None without one, or with the bucket down or the
        database failing."""
        try:
            return await self._copy(hashes, key) if self.bucket.available else None
        except DATABASE_ERRORS as e:
            log.warning("cannot look in the bucket for %s (%s)", key.id, type(e).__name__)
            return None

    async def _copy(self, hashes: Sequence[str], key: ArtifactKey) -> BucketBody | None:
        """The first of `hashes`' copies in the bucket, opened; None without one, or with the
        bucket down. A row whose object is gone (a lifecycle rule, an operator) is dropped."""
        rows = await self._repo.bucket_objects(hashes)
        for kh in hashes:
            if (rec := rows.get(kh)) is None:
                continue
            try:
                chunks = await self.bucket.open(object_path(rec.kind, kh))
            except BucketDown:
                return None
            if chunks is None:
                log.warning("%s is in the bucket's catalogue but not in the bucket", rec.key)
                if await self._repo.delete_bucket_versions([(kh, rec.sha256)]):
                    # Its row still stood: not an eviction's, a purge's or a DELETE's (each
                    # drops the row first), but an object deleted behind symgate's back. The
                    # replicas that have the file write it again: an upload had no other way
                    # back, and every replica without it answered 404 (or the upstream's
                    # download the upload replaced) for good.
                    await self._repo.unshare(kh, rec.sha256)
                continue
            self._start(self._touch(kh))
            return BucketBody(rec, chunks, self._refuse)
        return None

    async def _refuse(self, rec: BucketRecord) -> None:
        """A copy that does not match its row: its row is gone before the client's response
        is cut, so the retry the client makes next cannot be sent the same copy again.

        That row only, not the key's: the copy most often fails its row because another
        version took the key meanwhile (an upload over a download: its object first, then
        its row), whose row and object are not this reader's to drop. Nor the object,
        which may be that version's already: without a row it is never read, and the next
        copy published writes over it."""
        log.warning("the bucket's copy of %s does not match its row: its row deleted",
                    rec.key)
        try:
            await self._repo.delete_bucket_versions([(rec.key_hash, rec.sha256)])
        except DATABASE_ERRORS:
            self._start(self._drop_row(rec))

    async def _drop_row(self, rec: BucketRecord) -> None:
        with contextlib.suppress(*DATABASE_ERRORS):  # the next reader refuses it again
            await self._repo.delete_bucket_versions([(rec.key_hash, rec.sha256)])

    async def _touch(self, kh: str) -> None:
        with contextlib.suppress(*DATABASE_ERRORS):  # an access time: eviction's order
            await self._repo.touch_bucket_object(kh, datetime.now(UTC))

    # -- what this replica has ---------------------------------------------------------------
    async def publish(self, rec: ArtifactRecord, path: Path) -> bool:
        """Write a file this replica has to the bucket, then its row; False if it could not
        be (caught up later by sync)."""
        if not self.bucket.available or rec.key_hash in self._publishing:
            return False
        self._publishing.add(rec.key_hash)
        try:
            await self.bucket.put_file(object_path(rec.kind, rec.key_hash), path)
            mtime = path.stat().st_mtime
            if await self._repo.purged_since(rec.key_hash, rec.sha256, rec.fetched_at):
                # Purged (or this version removed) since it was committed here: the purge
                # found no row of the bucket's to delete, and one written now would serve
                # the file to every replica. The object, rowless, is never read.
                log.info("%s was purged while it was written to the shared bucket: not "
                         "published", rec.key)
                return False
            now = datetime.now(UTC)
            await self._repo.put_bucket_object(BucketRecord(
                key_hash=rec.key_hash, scope=rec.scope, key=rec.key, build_id=rec.build_id,
                kind=rec.kind, size=rec.size, sha256=rec.sha256, upstream=rec.upstream,
                filename=rec.filename, archive=rec.archive,
                last_modified=email.utils.formatdate(mtime, usegmt=True),
                ima_signature=rec.ima_signature, pinned=rec.pinned, stored_at=now,
                last_access=now))
            await self._repo.mark_shared(rec.key_hash)
        except _SHARED_ERRORS as e:
            log.info("%s not in the shared bucket yet (%s); the catch-up will retry", rec.key,
                     type(e).__name__)
            return False
        finally:
            self._publishing.discard(rec.key_hash)
        self._metrics.bucket_uploads.labels(rec.kind).inc()
        return True

    async def publish_upload(self, rec: ArtifactRecord, path: Path) -> bool:
        """publish() an upload under its key's lease, waited for up to read_timeout_s: the
        eviction holds it for one DELETE of the key's object (which must not take this one),
        bounded so. A holder that keeps it longer (another replica fetching the key) is
        published over, as without the lease. So is one of this replica's that is no
        eviction (of any of its processes): its fetch of the key, which waits to commit for
        the upload lock this upload holds, would hold the PUT for that whole time."""
        if not self.bucket.available:
            return False  # not waited for: publish() would not write it
        name = fetch_lease(rec.key_hash)
        deadline = asyncio.get_running_loop().time() + self._config.read_timeout_s
        delay = POLL_FIRST_S
        lease = None
        try:
            while (lease := await self.leases.take(name)) is None \
                    and asyncio.get_running_loop().time() < deadline:
                if (holder := await self._repo.lease_of(name)) is not None \
                        and holder[0].startswith(f"{self._replica}:"):
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, POLL_LONGEST_S)
        except DATABASE_ERRORS as e:  # the row cannot be written either: the catch-up's
            log.info("%s not in the shared bucket yet (%s); the catch-up will retry",
                     rec.key, type(e).__name__)
            return False
        try:
            return await self.publish(rec, path)
        finally:
            if lease is not None:
                await lease.release()

    async def forget(self, recs: Sequence[BucketRecord | ArtifactRecord]) -> None:
        """Remove these artifacts from the bucket (a purge, a bad copy): rows first, so that
        nobody starts reading an object being deleted. Raises DATABASE_ERRORS."""
        await self._repo.delete_bucket_objects([r.key_hash for r in recs])
        # Rowless objects are never read, and written over when published again: a bucket
        # known to be down is not waited on (read_timeout_s) for them.
        if self.bucket.available:
            with contextlib.suppress(BucketDown):
                await self.bucket.delete([object_path(r.kind, r.key_hash) for r in recs])

    # -- symbol tables -----------------------------------------------------------------------
    async def table(self, scope: str, build_id: str, dest: Path) -> bool:
        """Download the table another replica built to `dest`; False if the bucket has none
        (or is down)."""
        if not self.bucket.available:
            return False
        kh = table_hash(scope, build_id)
        try:
            if (rec := (await self._repo.bucket_objects([kh])).get(kh)) is None:
                return False
            try:
                # Checked as an artifact's copy is: a table has no build ID to verify, and
                # one that reads well with other bytes names functions wrongly in every
                # profile.
                if not await self.bucket.get_file(object_path(TABLE, kh), dest, rec.size,
                                                  rec.sha256):
                    await self._repo.delete_bucket_versions([(kh, rec.sha256)])
                    return False
            except WrongCopy:
                await self._refuse(rec)  # built here instead, and published over it
                return False
        except _SHARED_ERRORS as e:
            log.info("symbol table of %s not read from the bucket (%s)", build_id,
                     type(e).__name__)
            return False
        self._start(self._touch(kh))
        return True

    def publish_table(self, scope: str, build_id: str, path: Path) -> None:
        """Upload a table just built, in the background: a profile never waits for it."""
        self._start(self._publish_table(scope, build_id, path))

    async def _publish_table(self, scope: str, build_id: str, path: Path) -> None:
        kh = table_hash(scope, build_id)
        try:
            digest, size = await asyncio.to_thread(_sha256_and_size, path)
        except OSError:
            return  # dropped meanwhile
        rec = ArtifactRecord(
            key_hash=kh, scope=scope, key=table_key(build_id), build_id=build_id, kind=TABLE,
            size=size, sha256=digest, upstream="", filename=path.name, archive=None,
            fetched_at=datetime.now(UTC), last_access=datetime.now(UTC), hits=0)
        await self.publish(rec, path)

    # -- background --------------------------------------------------------------------------
    async def sync(self, path_of: Callable[[ArtifactRecord], Path]) -> None:
        """Upload what this replica has and the bucket lacks (one process of the replica at a
        time), then evict from the bucket past its budget or age (one replica at a time)."""
        if not self.bucket.available:
            return
        if self.bucket.failing:
            try:
                await self.bucket.probe()
            except BucketDown:
                return
        lease = await self.leases.take(f"bucket-sync:{self._replica}")
        if lease is not None:
            try:
                # Not what was fetched just now: its fetcher is publishing it.
                settled = datetime.now(UTC) - timedelta(seconds=self._config.sync_s)
                for rec in await self._repo.unpublished_artifacts(SYNC_BATCH, settled):
                    path = path_of(rec)
                    if path.is_file() and not await self._catch_up(rec, path):
                        break
            finally:
                await lease.release()
        if self._config.max_bytes or self._config.max_age_s:
            await self._evict()
        if self._config.orphan_grace_s and time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self._config.orphan_grace_s
            try:
                await self.sweep_orphans()
            except _SHARED_ERRORS as e:
                log.info("the sweep of the shared bucket's orphan objects put off: %s",
                         type(e).__name__)

    async def sweep_orphans(self, now: datetime | None = None) -> int | None:
        """Delete the objects no catalogue row names that were written orphan_grace_s before
        `now` or earlier (one replica at a time); how many, None while another sweeps. Rows
        name every object readers may read, so the rest is never read again, and would cost
        storage for good: an object whose row a killed replica never wrote, one a purge found
        rowless as it was published, one whose deletion the bucket failed after its row went,
        the tables of an older format. The grace covers the moment between a publish's object
        and its row. Raises BucketDown and DATABASE_ERRORS."""
        lease = await self.leases.take(ORPHANS_LEASE)
        if lease is None:
            return None
        deleted = 0
        try:
            cutoff = (now or datetime.now(UTC)) - timedelta(seconds=self._config.orphan_grace_s)
            old: dict[str, str] = {}  # key hash -> path
            async for path, written in self.bucket.listing():
                if written < cutoff and (ours := _OUR_OBJECT.fullmatch(path)) is not None:
                    old[ours.group(1)] = path
                    if len(old) >= EVICT_BATCH:
                        deleted += await self._delete_orphans(old)
                        old = {}
            deleted += await self._delete_orphans(old)
        finally:
            await lease.release()
        if deleted:
            log.info("deleted %d objects of the shared bucket that no row names", deleted)
        return deleted

    async def _delete_orphans(self, objects: dict[str, str]) -> int:
        """Those of `objects` (key hash -> path) that no row names at their path, each under
        its key's lease (a replica fetching or catching up the key may be writing it anew)."""
        rows = await self._repo.bucket_objects(list(objects))
        deleted = 0
        for kh, path in objects.items():
            if (rec := rows.get(kh)) is not None and object_path(rec.kind, kh) == path:
                continue
            lease = await self.leases.take(fetch_lease(kh))
            if lease is None:
                continue  # being written: looked at again next sweep
            try:
                rec = (await self._repo.bucket_objects([kh])).get(kh)
                if rec is None or object_path(rec.kind, kh) != path:
                    await self.bucket.delete([path])
                    deleted += 1
            finally:
                await lease.release()
        return deleted

    async def _catch_up(self, rec: ArtifactRecord, path: Path) -> bool:
        """Upload a file this replica has, unless another replica has uploaded it meanwhile
        or is fetching or uploading it now (it holds the key's lease): after an outage every
        replica that fetched a file alone has it, and one upload is enough. False if the
        bucket or the database failed: the round ends, the next one tries again."""
        try:
            lease = await self.leases.take(fetch_lease(rec.key_hash))
            if lease is None:
                return True  # looked at again next round, when its row is likely there
            try:
                row = (await self._repo.bucket_objects([rec.key_hash])).get(rec.key_hash)
                # Not over another version, but for an upload over a download (one there
                # before the upload, whose PUT met the bucket failing): that PUT would have
                # written over it, and taken for the upload's, it kept the replicas without
                # a copy of their own on the download for good.
                if row is not None and (row.sha256 == rec.sha256 or row.pinned
                                        or not rec.pinned):
                    await self._repo.mark_shared(rec.key_hash)
                    return True
                return await self.publish(rec, path)
            finally:
                await lease.release()
        except DATABASE_ERRORS as e:
            log.info("catch-up of %s put off: %s", rec.key, type(e).__name__)
            return False

    async def _evict(self) -> None:
        lease = await self.leases.take(EVICTION_LEASE)
        if lease is None:
            return
        try:
            _, size = await self._repo.bucket_totals()
            cutoff = (datetime.now(UTC) - timedelta(seconds=self._config.max_age_s)
                      if self._config.max_age_s else None)
            while True:
                doomed = []
                for rec in await self._repo.oldest_bucket_objects(EVICT_BATCH):
                    over = self._config.max_bytes and size > self._config.max_bytes
                    if not over and not (cutoff is not None and rec.last_access < cutoff):
                        break
                    doomed.append(rec)
                    size -= rec.size
                if not doomed:
                    return
                log.info("evicting %d objects from the shared bucket", len(doomed))
                await self._evict_batch(doomed)
        finally:
            await lease.release()

    async def _evict_batch(self, doomed: Sequence[BucketRecord]) -> None:
        """The rows of the versions read (one replaced since, an upload over the download, is
        not the eviction's), then each of their objects under its key's lease once no row
        names it: every writer of a key's object holds that lease (a fetch, a catch-up, an
        upload). Deleted without it, an object written anew between the row's deletion and
        the DELETE went too: an upload answered 201 was then in no other replica's reach,
        which served the download it replaced, fetched from upstream again."""
        gone = set(await self._repo.delete_bucket_versions(
            [(rec.key_hash, rec.sha256) for rec in doomed]))
        if not self.bucket.available:
            return  # a rowless object is never read: the orphan sweep takes it
        held: list[tuple[BucketRecord, Lease]] = []
        try:
            for rec in doomed:
                # Not a key written anew (its lease taken): the sweep takes what it leaves.
                if rec.key_hash in gone and (lease := await self._eviction_leases.take(
                        fetch_lease(rec.key_hash))) is not None:
                    held.append((rec, lease))
            # One look and one DELETE for the batch, under all of its leases: the eviction of
            # a full bucket is thousands of objects, a query and a request each otherwise.
            named = await self._repo.bucket_objects([rec.key_hash for rec, _ in held]) \
                if held else {}
            if doomed_paths := [object_path(rec.kind, rec.key_hash) for rec, _ in held
                                if rec.key_hash not in named]:
                with contextlib.suppress(BucketDown):
                    await self.bucket.delete(doomed_paths)
        finally:
            for _, lease in held:
                await lease.release()

    def _start(self, job: Awaitable[None]) -> None:
        task = asyncio.ensure_future(job)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # A job rides out the bucket's and the database's failures itself: what reaches here
        # is a bug's, said when it happens, rather than as "exception never retrieved" when
        # the task is collected, or never.
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a background job of the shared bucket failed", exc_info=error)

    async def close(self) -> None:
        """Let background uploads and deletions finish (a stopping replica's last table), for
        CLOSE_WAIT_S at most; then cut what is left and wait for its end. Left running, they
        outlived the stop: a connection held as the process exited, their failures never
        retrieved."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_S)
        left = [task for task in self._tasks if not task.done()]
        if not left:
            return
        log.warning("stopping: %d background jobs of the shared bucket (uploads, access times) "
                    "cut after %g s", len(left), CLOSE_WAIT_S)
        for task in left:
            task.cancel()
        # A failure as it was cut is a bug's, said by _ended.
        await asyncio.gather(*left, return_exceptions=True)


def _sha256_and_size(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
