"""The artifact service: cache hit, join a fetch under way, remembered miss, or a new fetch.

Knows nothing of HTTP requests: proxy.http turns its results and exceptions into responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import hashlib
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.artifacts.board import SETTLED, VERIFIED, Claim, FlightBoard, Lied
from proxy.artifacts.chunk_writer import Backlog, ChunkWriter
from proxy.artifacts.doubts import Doubts
from proxy.artifacts.flight import Flight, FlightReader
from proxy.artifacts.index import READ_ONLY, ArtifactCache, CachedArtifact, key_hash
from proxy.artifacts.misses import RememberedMisses
from proxy.artifacts.resume import ResumedBody
from proxy.artifacts.scope import RequestScope
from proxy.config import FetchPolicy
from proxy.errors import (
    DatabaseUnavailable,
    InsufficientStorage,
    NotCached,
    NotFound,
    OutOfResources,
    RememberedNotFound,
    SymgateError,
    TooLarge,
    UpstreamUnavailable,
    VerificationFailed,
    out_of_descriptors,
)
from proxy.health import DISK
from proxy.keys import ArtifactKey, Kind, shown_detail
from proxy.metrics import ProxyMetrics
from proxy.sources.base import ArtifactMeta, Body, Source
from proxy.sources.policy import ask
from proxy.store.repository import DATABASE_ERRORS, ArtifactRecord, is_disk_full, is_read_only
from symbolize.elf import build_id_of_file, build_id_of_reads, section_extent

if TYPE_CHECKING:
    from proxy.bucket.tier import SharedTier

log = logging.getLogger(__name__)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Times a request tries to claim a key's fetch, following other processes' in between.
CLAIM_ROUNDS = 3
# How long a stopping server waits for downloads that are being committed.
COMMIT_AT_STOP_S = 10.0
# A download of unannounced size holds the budget in steps of this much, not per chunk.
RESERVE_STEP = 4 * 1024 * 1024
# A chunk this small is written on the loop: its pwrite costs less than a thread's hand-over.
INLINE_WRITE = 64 * 1024
# Bytes that downloads may hold in memory for the disk, read ahead of it: all of a process's
# together, and each download however many run (proxy.artifacts.chunk_writer).
UNWRITTEN_LIMIT = 32 * 1024 * 1024
UNWRITTEN_FLOOR = 2 * 1024 * 1024
ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True, slots=True)
class Hit:
    artifact: CachedArtifact
    # A section cut from a file this request had to fetch (or join the fetch of), or a file
    # another process fetched while this request waited for it: the request cost an upstream
    # download, and is counted as the miss it was.
    fetched: bool = False


@dataclass(frozen=True, slots=True)
class _Parent:
    """The file a section is cut from: cached, or served but not kept (then only the open
    descriptor of a reader reaches it, through /proc/self/fd)."""

    path: Path
    scope: str
    upstream: str
    filename: str
    archive: str | None
    mtime: float
    fetched: bool = False  # not in the cache when the cut began: fetched for it


@dataclass(frozen=True, slots=True)
class Streaming:
    """A fetch under way; the caller must close `reader`."""

    flight: Flight
    reader: FlightReader
    meta: ArtifactMeta


@dataclass(frozen=True, slots=True)
class _UnkeptSection:
    """A section cut but not kept (no room for it in the budget): its bytes in a temp file
    already unlinked, which the flight's descriptor holds, each request that wanted the cut
    reading them as a download's whole body."""

    flight: Flight
    meta: ArtifactMeta

    def streaming(self) -> Streaming:
        return Streaming(self.flight, self.flight.reader(), self.meta)


class ArtifactService:
    def __init__(
        self,
        *,
        cache: ArtifactCache,
        misses: RememberedMisses,
        policy: FetchPolicy,
        max_concurrent_fetches: int,
        max_artifact_bytes: int,
        metrics: ProxyMetrics,
        board: FlightBoard,
        tier: SharedTier | None = None,
        doubt_s: float = 600.0,
        forwarded_ttl_limit: int = 8,
    ) -> None:
        self.cache = cache
        self._forwarded_ttl_limit = forwarded_ttl_limit
        # The bucket shared by a cluster's replicas ([storage]); None on a single node.
        self.tier = tier
        self._board = board
        # Larger than the whole budget is served but not kept (see _download).
        self._max_artifact = max_artifact_bytes
        self.misses = misses
        misses.sql_failed = cache.sql_failed  # one health record for every query
        self._policy = policy
        self._slots = asyncio.Semaphore(max_concurrent_fetches)
        self._backlog = Backlog(UNWRITTEN_LIMIT)
        self._metrics = metrics
        # Upstreams whose last answer for a key was another file: asked after the others.
        self._doubts = Doubts(doubt_s)
        self._flights: dict[str, Flight] = {}  # keyed by key_hash(request scope, key)
        self._tasks: set[asyncio.Task[None]] = set()
        # Tidying of ended fetches' files (seconds later): not work anybody waits for.
        self._tidying: set[asyncio.Task[None]] = set()
        # Sections being cut, by key_hash.
        self._cuts: dict[str, asyncio.Future[Hit | _UnkeptSection]] = {}
        # Called with each artifact's scope and key once it is committed to the cache, and the
        # request whose fetch brought it (None: an upload, a copy of one from the bucket).
        self.committed: list[Callable[[str, ArtifactKey, RequestScope | None], None]] = []
        # The scopes holding an upload on some replica, as SQL said at the last look (and
        # this process's own uploads since): where a tenant without sources of its own has
        # files the shared scope does not speak for (_own_upload).
        self.uploaders: frozenset[str] = frozenset()

    async def find(self, key: ArtifactKey, req: RequestScope, *, cache_only: bool = False,
                   check_file: bool = True) -> Hit | Streaming:
        """Raises NotFound, UpstreamUnavailable (or UpstreamTimeout), VerificationFailed.

        Only the scopes the request may see answer it, and only its own sources are asked.
        With req.may_fetch false (past the forwarding hop limit) only the cache answers;
        with cache_only, a miss raises NotCached instead of fetching. Without check_file, a
        hit in memory is not stat()ed: the caller opens the file, and calls vanished() if it
        is gone.
        """
        # Whether _find looks for the tenant's uploads first, as `uploaders` says now: a refresh
        # of it during the upstream's answer must not skip the look below.
        looked = self._has_own_uploads(req)
        # The look _find made when the database could not answer it.
        unknown: list[DatabaseUnavailable] = []
        try:
            return await self._find(key, req, cache_only, check_file, unknown)
        except NotFound:
            if unknown:
                # A tenant known to have uploads, whose upload of this key nobody can rule out
                # while the database is down: the shared scope's miss is not its answer.
                raise unknown[0] from None
            # A tenant's first upload on another replica or process is known here only at the
            # next refresh of `uploaders`: a miss of the shared scope, whether its sources just
            # confirmed it or it is remembered (another tenant's, made after the upload), is
            # worth a look there before it is answered: the upload's owner would otherwise get
            # a 404 for it, which elfutils' client keeps for ten minutes.
            if key.kind is Kind.SECTION or not req.may_fetch or not req.tenant \
                    or req.scope == req.tenant or looked:
                raise
            try:
                own = await self._own_upload(key, req)
            except DatabaseUnavailable:
                own = None  # a tenant not known to have uploads: most likely it has none
            if own is None:
                raise
            self.uploaded(req.tenant)
            return own

    async def _find(self, key: ArtifactKey, req: RequestScope, cache_only: bool,
                    check_file: bool, unknown: list[DatabaseUnavailable]) -> Hit | Streaming:
        if key.kind is Kind.SECTION:
            return await self._section(key, req, cache_only)
        visible = req.visible
        for seen in visible if self._flights else ():
            done = self._flights.get(key_hash(seen, key))
            if done is not None and done.succeeded:
                # Its clients have their bytes; the commit (an fsync and a row) makes it a hit.
                await done.wait_settled()
        if (hit := self.cache.peek_any(visible, key)) is not None:
            if hit.scope != visible[0] \
                    and (first := await self.cache.get(visible[0], key)) is not None:
                # The tenant's own file (an upload, what its own server gave), committed by
                # another process on this data dir, comes before the shared scope's that this
                # one holds in memory: a stat tells, SQL is asked only where there is a file.
                return Hit(first)
            if not check_file or hit.path.is_file():
                self.cache.touch(hit)
                return Hit(hit)
            await self.vanished(hit)
        ups = req.sources
        scope = req.scope
        names, local_has = _miss_judges(req, key)
        kh = key_hash(scope, key)
        if not req.may_fetch or cache_only:
            # The cache is also what another process on this data dir committed, which this
            # one's memory does not hold: with serve --workers N, a memory miss alone would
            # answer by which worker the connection reached.
            if (stored := await self.stored(req.visible, key)) is not None:
                return Hit(stored)
            if not req.may_fetch:
                raise NotFound("not found (forwarded-ttl-limit reached; upstreams not asked)")
            raise NotCached("not in symgate's cache (Cache-Control: only-if-cached)")
        if self._has_own_uploads(req):
            try:
                if (own := await self._own_upload(key, req)) is not None:
                    return own
            except DatabaseUnavailable as e:
                unknown.append(e)  # what the shared scope has may still answer
        if (joined := await self._join_or_remembered(kh, req, key, names, local_has)):
            return joined
        # What another process cached, then what it found missing: in turn, not at once. The
        # first asks SQL only where a file is there (a stat), and a hit needs no second;
        # gathered, the two reads (on SQLite, done on this thread: local_reads) cost two tasks
        # and two steps of the loop, 0.1 ms of a cold fetch's first byte, for no overlap.
        if (stored := await self.stored(req.visible, key)) is not None:
            return Hit(stored)
        known_missing = await self.misses.live(scope, key)
        if not local_has and known_missing.issuperset(names) \
                and (names or self.tier is None):
            # No local source has it, and every remote one is remembered as not having it
            # (with none, the bucket may still have another replica's upload: asked below).
            if names:
                raise RememberedNotFound()
            raise NotFound("not found" if ups else "not found (no upstreams configured)")
        # While this request awaited SQL, another may have started the same fetch, or finished
        # it: committed (the index has it) or remembered (the memo has it), and unregistered.
        if (joined := await self._join_or_remembered(kh, req, key, names, local_has)):
            return joined
        if (hit := self.cache.peek_any(req.visible, key)) is not None and hit.path.is_file():
            return Hit(hit)
        claim = await self._claim_or_join(kh, req, key, names, local_has)
        if isinstance(claim, (Hit, Streaming)):
            return claim
        try:
            path, fd = self._new_temp()
        except BaseException as e:  # a full disk: the claim must not outlive this request
            if claim is not None:
                self._end_claim(kh, claim, e if isinstance(e, SymgateError)
                                else SymgateError("cannot make a temp file"))
            raise
        flight = Flight(fd)
        flight.asking = _asking(req)
        self._flights[kh] = flight
        self._start(self._fetch(key, req, flight, path,
                                [u for u in ups if u.name not in known_missing], claim,
                                names, local_has))
        return await self._join(flight)

    def hit_now(self, visible: tuple[str, ...], key: ArtifactKey) -> CachedArtifact | None:
        """What find() answers at once for a hit in memory (not stat()ed), not yet counted
        (cache.touch); None where find() would wait (a fetch of it settling) or go further."""
        if self._flights and any(key_hash(s, key) in self._flights for s in visible):
            return None
        return self.cache.peek_any(visible, key)

    def remembered_now(self, req: RequestScope, key: ArtifactKey) -> bool:
        """Whether find() raises RememberedNotFound at once, from memory: may fetch, no fetch
        of the key under way or settling, no hit in memory, no local source has it, and every
        remote source's miss is in the memo. False where find() would ask SQL or go further."""
        if key.kind is Kind.SECTION or not req.may_fetch:
            return False
        if self._flights and any(key_hash(s, key) in self._flights for s in req.visible):
            return False
        if self.cache.peek_any(req.visible, key) is not None:
            return False
        names, local_has = _miss_judges(req, key)
        if not names or local_has or self._has_own_uploads(req):
            return False
        return self.misses.memo_covers(req.scope, key, names)

    async def _claim_or_join(self, kh: str, req: RequestScope, key: ArtifactKey,
                             names: list[str], local_has: bool
                             ) -> Claim | Hit | Streaming | None:
        """The right to fetch `kh` for every process on this data dir, or what another
        process's fetch of it gives: its download, followed, or the file it committed. None,
        rarely, when the right could not be had in a few rounds: then fetch all the same."""
        for _ in range(CLAIM_ROUNDS):
            claim = self._claim(kh)
            if claim is not None:
                if claim.after_another:
                    return await self._answered_meanwhile(kh, claim, req, key, names,
                                                          local_has) or claim
                return claim
            # Another process is fetching it: follow its download.
            if (followed := await self._follow(kh, req.visible, key)) is not None:
                return followed
            if (stored := await self.stored(req.visible, key)) is not None:
                # Committed while this request waited for it (a small file goes from streaming
                # to settled between two looks): the other process's fetch, joined, and a
                # miss, as it is for a client of the process that fetched it.
                self._metrics.singleflight_joins.inc()
                return Hit(stored, fetched=True)
            if (joined := await self._join_or_remembered(kh, req, key, names, local_has)):
                return joined
            # Ended without a file for us (not kept, or its writer died): claim it again.
        return None

    async def _answered_meanwhile(self, kh: str, claim: Claim, req: RequestScope,
                                  key: ArtifactKey, names: list[str], local_has: bool
                                  ) -> Hit | None:
        """What another process's fetch of the key, ended between this request's look in SQL
        and its claim, left in SQL: the file it committed, or the miss it remembered. Its
        files linger a while after its end, which is how the claim knows to look again."""
        try:
            stored, missing = await asyncio.gather(
                self.stored(req.visible, key),
                self._remembered_missing(req.scope, key, names, local_has))
        except BaseException:
            self._end_claim(kh, claim, None)  # not kept: a follower looks, then claims
            raise
        if stored is not None:
            self._end_claim(kh, claim, None)
            return Hit(stored)
        if missing:
            error = RememberedNotFound()
            self._end_claim(kh, claim, error)
            raise error
        return None

    async def _remembered_missing(self, scope: str, key: ArtifactKey, names: list[str],
                                  local_has: bool) -> bool:
        """Whether SQL (or the memo) remembers a miss of `key` from every remote source
        `names` the request asks, and no local source has it: a remembered 404."""
        if not names or local_has:
            return False
        return (await self.misses.live(scope, key)).issuperset(names)

    def _end_claim(self, kh: str, claim: Claim, error: SymgateError | None,
                   lied: str | None = None) -> None:
        """Say how the claimed fetch ended (`lied`: see Flight.lied), free the key, and tidy
        its files once its followers have read that."""
        if error is not None:
            claim.failed(error, lied)
        else:
            claim.say(SETTLED)
        claim.release()
        tidy = asyncio.create_task(self._board.tidy(kh, claim.ident))
        self._tidying.add(tidy)
        tidy.add_done_callback(self._tidying.discard)

    async def _follow(self, kh: str, visible: tuple[str, ...], key: ArtifactKey
                      ) -> Streaming | Hit | None:
        """Join another process's fetch of `kh` through a local mirror flight, which this
        process's other clients then join too. Raises its failure; None if it ended. One that
        had its verdict before this request came is a hit once committed, as in the process
        that fetched it (README: "a request that comes meanwhile waits for it and is a hit")."""
        try:
            with self._metrics.fetch_waiters.track_inprogress():
                followed = await self._board.follow(kh)
        except Lied as e:
            # Asked again (Flight.lied), as the writer's own clients do: the caller looks in
            # SQL, joins the fetch made again, or makes it, that upstream after the others.
            self._doubts.doubt(kh, e.upstream)
            return None
        except SymgateError:
            # The followed fetch failed before it streamed: this request waited on it and gets
            # its failure, as a client that joined this process's own failed fetch does.
            self._metrics.singleflight_joins.inc()
            raise
        if followed is None:
            return None
        if followed.late:
            with contextlib.ExitStack() as closing:
                if followed.fd >= 0:
                    closing.callback(os.close, followed.fd)
                if (stored := await self.stored(visible, key)) is not None:
                    return Hit(stored)
                if followed.fd < 0:
                    return None
                # Not kept (no room in the budget): its file, held open, is the answer.
                closing.pop_all()
        if (flight := self._flights.get(kh)) is not None:  # another client got here first
            os.close(followed.fd)
            self._metrics.singleflight_joins.inc()
            return await self._join(flight)
        flight = Flight(followed.fd)
        flight.started(followed.meta)
        self._flights[kh] = flight
        self._metrics.singleflight_joins.inc()

        async def mirror() -> None:
            try:
                await self._board.track(kh, followed, flight)
            finally:
                if self._flights.get(kh) is flight:
                    del self._flights[kh]
                if flight.lied:
                    # Its clients ask again (Flight.lied): that upstream after the others.
                    self._doubts.doubt(kh, flight.lied)

        self._start(mirror())
        return await self._join(flight)

    def _start(self, job: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def vanished(self, hit: CachedArtifact) -> None:
        """A cached file found missing: deleted behind our back (an operator, a disk cleaner)
        or evicted by another process. Forgotten; the next find fetches it again."""
        log.warning("cached %s vanished from disk; fetching it again", hit.record.key)
        await self.cache.vanished(hit.record)

    async def stored(self, scopes: tuple[str, ...], key: ArtifactKey) -> CachedArtifact | None:
        """The first of `scopes` whose cached file this process knows, or SQL knows of (one
        another process committed)."""
        for scope in scopes:
            if (stored := await self.cache.get(scope, key)) is not None:
                return stored
        return None

    async def _join_or_remembered(self, kh: str, req: RequestScope, key: ArtifactKey,
                                  names: list[str], local_has: bool) -> Streaming | None:
        """What memory alone answers: the fetch under way, joined, or a remembered miss
        (raised); None when only SQL or a new fetch can tell."""
        if (flight := self._flights.get(kh)) is not None:
            if not flight.succeeded:
                self._metrics.singleflight_joins.inc()
                # Waiting, when its failure is no answer, for its headers or its end.
                with self._metrics.fetch_waiters.track_inprogress():
                    answers = await self._answers(flight, _asking(req))
                if answers:
                    return await self._join(flight)
            else:
                # Verified and being committed (an fsync and a row): a hit in a moment.
                await flight.wait_settled()
        if not local_has and self.misses.memo_covers(req.scope, key, names):
            raise RememberedNotFound()
        return None

    @staticmethod
    async def _answers(flight: Flight, asking: frozenset[str]) -> bool:
        """Whether what `flight` ends in answers a request that asks the sources `asking`.
        A fetch of a tenant that lists some of the global sources only (so shares the shared
        scope's fetches) answers with the file it finds, which any of them may give; but its
        failure, a 404 above all, is no answer for a request that asks others too, which
        elfutils' client would keep for ten minutes. Such a request waits for its headers;
        if it failed, for its end (its misses remembered, its key free), and looks on."""
        if flight.asking is None or flight.asking >= asking:
            return True
        try:
            await flight.wait_meta()
        except SymgateError:
            await flight.wait_settled()
            return False
        return True

    async def _fetch(
        self, key: ArtifactKey, req: RequestScope, flight: Flight, temp: Path,
        ups: list[Source], claim: Claim | None, names: list[str], local_has: bool,
    ) -> None:
        """Runs detached from any client: a disconnect does not stop the download. `claim`
        tells the other server processes how it goes (None: another fetches it too)."""
        scope = req.scope
        self._metrics.inflight_fetches.inc()
        lease = None
        try:
            async with self._slots:
                if self.tier is not None and not local_has:
                    # Only copies that every request sharing this flight may see: a tenant
                    # without sources of its own shares the shared scope's flights, but not
                    # its uploads (_own_upload looked for those).
                    drawn = [key_hash(s, key)
                             for s in (req.visible if scope == req.tenant else (scope,))]
                    if names:
                        obtained = await self.tier.obtain(
                            key_hash(scope, key), drawn, key,
                            lambda: self._remembered_missing(scope, key, names, local_has))
                        copy, lease = obtained.body, obtained.lease
                    else:  # no upstream to fetch it from for the cluster: no lease to wait on
                        copy = await self.tier.copy(drawn, key)
                    if copy is not None:
                        body = ResumedBody(copy, lambda: self._upstream_body(ups, key, req),
                                           self._metrics.bucket_copies_resumed.inc,
                                           copy.rec.sha256)
                        try:
                            await self._download(key, copy.rec.scope, flight, temp, body,
                                                 claim, publish=False, req=req)
                        finally:
                            body.close()
                        return
                kh = key_hash(scope, key)
                result = await ask(ups, key, req.hop, self._policy,
                                   self._doubts.doubted(kh, [u.name for u in ups]))
                remembering = {u.name for u in ups if u.remembers_misses}
                misses = [name for name in result.not_found if name in remembering]
                if misses and req.hop.hops() >= self._forwarded_ttl_limit:
                    # As many hops as the limit: an elfutils debuginfod with the same (its
                    # default) answers 404 without asking its own upstreams. That says
                    # nothing of the file, and remembered it would answer every client, for
                    # a client's X-Forwarded-For.
                    misses = []
                if misses:
                    await self.misses.record(scope, key, misses)
                    for name in misses:
                        self._metrics.negative_entries_written.labels(
                            self._metrics.upstream_label(name)).inc()
                if result.body is None:
                    flight.fail(result.failure() if result.failures else NotFound("not found"))
                    return
                # What a source of the request's tenant gave stays the tenant's.
                owner = next((u.scope for u in ups if u.name == result.body.meta.upstream),
                             scope)
                answered = result.body.meta.upstream
                try:
                    await self._download(key, owner, flight, temp, result.body, claim,
                                         publish=self.tier is not None, req=req)
                except (VerificationFailed, TooLarge):
                    # TooLarge: the size it announced, which the others may not (a lie, or
                    # another file); if it is the truth, they say so too.
                    if len(ups) > 1:
                        log.warning("%s answered %s with what is not its file; asked after the "
                                    "other upstreams for it from now on", answered, key.id)
                    # Asked again, a fetch that only the liar can answer would lie again.
                    others = any(u.name != answered and u.name not in result.not_found
                                 for u in ups)
                    flight.lied = answered if others else None
                    self._doubts.doubt(kh, answered)
                    raise
                finally:
                    result.body.close()
                self._doubts.forget(kh, answered)
        except Exception as e:
            self._failed(flight, e, "fetching", key)
        finally:
            try:
                if lease is not None:  # after the copy is published, or the miss remembered
                    await lease.release()
            finally:  # a stop's cancel raised by the release: the flight still lands
                self._land(key_hash(scope, key), flight, temp, claim)

    def _land(self, kh: str, flight: Flight, temp: Path, claim: Claim | None) -> None:
        """A fetch's end, however it ended: its claim said, its key free, its files tidied."""
        if not flight.finished:  # cancelled: server shutting down
            flight.fail(UpstreamUnavailable("server shutting down"))
        if claim is not None:
            self._end_claim(kh, claim, flight.error or flight.store_error, flight.lied)
        if self._flights.get(kh) is flight:
            del self._flights[kh]
        flight.close_fd()
        self.cache.release(flight)
        temp.unlink(missing_ok=True)  # gone already, unless it was not committed
        flight.settle()
        self._metrics.inflight_fetches.dec()

    # -- a tenant's own uploads --------------------------------------------------------------

    def _has_own_uploads(self, req: RequestScope) -> bool:
        """Whether the request's tenant, without sources of its own (so sharing the shared
        scope's misses and fetches), holds uploads in its own scope."""
        return bool(req.tenant) and req.scope != req.tenant and req.tenant in self.uploaders

    async def _own_upload(self, key: ArtifactKey, req: RequestScope) -> Hit | Streaming | None:
        """The tenant's upload of `key`, looked for before anything the shared scope says: its
        remembered misses (another tenant's 404 must not hide it) and its flights (which draw
        on shared copies alone). One another process of this replica took in is in SQL; one
        another replica took in is in the bucket, copied here under a flight of the tenant's
        own. None when there is none; DatabaseUnavailable when the bucket's catalogue cannot
        be read."""
        tenant = req.tenant
        if (stored := await self.cache.get(tenant, key)) is not None:
            return Hit(stored)
        if self.tier is None:
            return None
        kh = key_hash(tenant, key)
        # A temp file and a flight only for a copy there is: most misses of a tenant's have none.
        if kh not in self._flights:
            held = await self.tier.holds(kh)
            if held is None:
                raise DatabaseUnavailable("the database cannot be reached to look for the "
                                          "tenant's uploads; retry")
            if not held:
                return None
        flight = self._flights.get(kh)
        if flight is None:
            temp, fd = self._new_temp()
            flight = self._flights[kh] = Flight(fd)
            self._metrics.inflight_fetches.inc()
            self._start(self._copy_own(key, tenant, flight, temp))
        try:
            return await self._join(flight)
        except NotFound:
            return None

    async def _copy_own(self, key: ArtifactKey, tenant: str, flight: Flight, temp: Path
                        ) -> None:
        assert self.tier is not None
        try:
            body = await self.tier.copy([key_hash(tenant, key)], key)
            if body is None:
                flight.fail(NotFound("no upload of it in the bucket"))
                return
            try:
                await self._download(key, tenant, flight, temp, body, None, publish=False)
            finally:
                body.close()
        except Exception as e:
            self._failed(flight, e, "copying from the bucket", key)
        finally:
            self._land(key_hash(tenant, key), flight, temp, None)

    def _failed(self, flight: Flight, error: Exception, doing: str, key: ArtifactKey) -> None:
        """A fetch's failure as its clients get it: its own, a full disk's 507, else an
        internal error, logged (called in the `except` block: the traceback is at hand)."""
        if isinstance(error, SymgateError):
            # Its traceback holds this fetch's frames (the upstream's body and its buffers,
            # the last chunk), which hold the flight that keeps the error: a cycle that only
            # a full collection would free. Its clients need its type and reason alone.
            flight.fail(error.with_traceback(None))
        elif is_disk_full(error):
            flight.fail(self.disk_full(error))
        elif is_read_only(error):
            flight.fail(self.read_only(error))
        elif isinstance(error, OSError) and (full := out_of_descriptors(error)) is not None:
            # The server's passing want, not a fault of the fetch: a profile that needed the
            # file was refused with "does not fit cache.max_bytes" (507) for it.
            log.warning("%s %s failed: %s", doing, key.id, error)
            flight.fail(full)
        else:
            log.exception("%s %s failed", doing, key.id)
            flight.fail(SymgateError(f"internal error while {doing}"))

    async def refresh_uploaders(self) -> None:
        """Learn which scopes hold uploads (SQL failing: as known before)."""
        try:
            self.uploaders = frozenset(await self.cache.upload_scopes())
        except DATABASE_ERRORS as e:
            self.cache.sql_failed("reading which tenants have uploads", e)

    def uploaded(self, scope: str) -> None:
        """This process took in an upload into `scope`: its tenant's requests look there now,
        not after the next refresh."""
        self.uploaders |= {scope}

    async def _upstream_body(self, ups: list[Source], key: ArtifactKey,
                             req: RequestScope) -> Body | None:
        """The key's body from the upstreams, asked as a miss would ask them: for a bucket
        copy that broke off."""
        return (await ask(ups, key, req.hop, self._policy)).body

    async def _download(
        self, key: ArtifactKey, scope: str, flight: Flight, temp: Path, body: Body,
        claim: Claim | None, *, publish: bool, req: RequestScope | None = None,
    ) -> None:
        """`publish`: write the file to the shared bucket once it is committed here. `req`:
        the request whose fetch it is, told to the `committed` listeners."""
        meta = body.meta
        # Before any verdict: a failure then reaches the clients as one on the way does
        # (Flight.wait_streamable), which they may ask again for (Flight.lied).
        flight.started(meta)
        if meta.size is not None and meta.size > self._max_artifact:
            self._reject(key, meta, "too_large")
            raise TooLarge(f"{meta.upstream} has {meta.size} bytes; symgate fetches at most "
                           f"{self._max_artifact} (cache.max_artifact_bytes)")
        # The budget holds during the download: room is made as the bytes come, a step ahead
        # of them. Not for the announced size up front, which an upstream could inflate to
        # have the cache emptied for a body it never sends; that size only caps the steps, and
        # one that could not fit even then is not kept from the start, evicting nothing.
        # A body whose end cannot be told from a cut (a source, which has no build ID to
        # verify, cut as its connection closed) is served as it comes, never kept.
        keep = meta.framed and (meta.size is None or self.cache.could_fit(flight, meta.size))
        step = max(1, min(RESERVE_STEP, self.cache.max_bytes // 16))
        held = 0
        fd = flight.writer_fd
        # Written behind the reads, in a thread: the clients get each chunk from memory as it
        # comes (pwrite's page allocation cost 1-7 ms of a 4 MB body here, on the loop,
        # between every client and its bytes).
        writer = ChunkWriter(lambda chunk, offset: self._write(fd, flight, chunk, offset),
                             self._backlog, UNWRITTEN_FLOOR)
        head = b""  # the body's first bytes, up to ELF_MAGIC's length
        try:
            async for chunk in body.chunks():
                if key.kind.is_elf and len(head) < len(ELF_MAGIC):
                    # Told from its first bytes, before any client gets one and before the
                    # budget makes room for it: a body that will never verify (an error page,
                    # an endless stream of anything) would otherwise evict files as it grows.
                    head = (head + chunk[:len(ELF_MAGIC)])[:len(ELF_MAGIC)]
                    if head != ELF_MAGIC[:len(head)]:
                        self._reject(key, meta, "not_elf")
                        raise VerificationFailed(
                            f"{meta.upstream} sent a file with build ID none (not ELF), not "
                            f"{key.build_id}")
                needed = flight.received + len(chunk)
                if keep and needed > held:
                    held = -(-needed // step) * step
                    if meta.size is not None and needed <= meta.size:
                        held = min(held, meta.size)
                    if needed <= self.cache.max_bytes:
                        # Not rounded past the whole budget: of no stated size, a file within
                        # a step of max_bytes was refused that room, though it fits, and was
                        # fetched again at every request, never kept.
                        held = min(held, self.cache.max_bytes)
                    keep = await self.cache.reserve(flight, held)
                if needed > self._max_artifact:
                    self._reject(key, meta, "too_large")
                    raise VerificationFailed(
                        f"{meta.upstream} sent more than {self._max_artifact} bytes "
                        "(cache.max_artifact_bytes)")
                if meta.size is not None and needed > meta.size:
                    # Before any client gets those bytes: a reader trusts the announced size
                    # to hold back the last byte until the file is verified.
                    self._reject(key, meta, "truncated")
                    raise VerificationFailed(
                        f"{meta.upstream} sent more than the {meta.size} bytes it announced")
                offset = flight.received
                flight.arrived(chunk)
                if offset == 0:
                    # No client is sent a byte before the first chunk is on disk (see
                    # Flight.wait_streamable): a cache that cannot write answers a clean 507,
                    # not a response cut after its status line. Written here rather than by
                    # the writer's task, whose turn of the loop (the upstream's next reads
                    # first) every client's first byte would wait for.
                    await self._write(fd, flight, chunk, 0)
                else:
                    await writer.put(chunk, offset)
                # A body already in the socket's buffer is read without a pause: let the
                # clients send this chunk before the next, or the first byte waits for all.
                # Not once the announced size is in: the body has ended, and its clients must
                # see that before they start, so that a small file's verdict (a build ID that
                # does not match) reaches them as a status line, not as a cut-off body.
                if meta.size is None or flight.received < meta.size:
                    await asyncio.sleep(0)
                if offset == 0 and claim is not None:
                    # Told to the other processes once this one's clients had their first
                    # bytes: the board's thread writing it took the GIL and the disk's
                    # journal from the first chunk's write, 0.35 ms of every first byte.
                    claim.streaming(temp, meta)
            if flight.received == 0 and claim is not None:
                claim.streaming(temp, meta)  # an empty body: said all the same
            flight.body_ended()
            if meta.size is not None and flight.received != meta.size:
                self._reject(key, meta, "truncated")
                raise VerificationFailed(
                    f"{meta.upstream} sent {flight.received} of {meta.size} bytes")
            if key.kind.is_elf:
                await self._verify(key, meta, flight, temp, writer)
            if claim is not None:
                claim.say(VERIFIED, size=flight.received)
            if not keep and not meta.framed:
                log.info("%s came with nothing to tell its end from a cut: served, not kept",
                         key.id)
            elif not keep:
                log.info("%s (%d bytes) does not fit cache.max_bytes now: served, not kept",
                         key.id, flight.received)
                self._metrics.not_kept.inc()
            # The bytes are right: every client gets its last byte now, from memory if the
            # disk is behind, and the rest (the writes, fsync, rename, the row) is the cache's
            # business, not theirs.
            flight.succeed()
            await writer.flush()
        except BaseException:
            writer.abandon()
            raise
        if not keep:
            # Its readers hold their own descriptors: the file goes when the last one is done.
            try:
                if publish and self.tier is not None and meta.framed:
                    # Too big for this disk need not be for the bucket: the replicas waiting
                    # on this key's lease read it there rather than each fetch it upstream.
                    digest = await asyncio.to_thread(_sha256_of, fd)
                    await self.tier.publish(self._record(key, scope, meta, flight.written,
                                                         digest, publish), temp)
            except OSError as e:  # its clients have it: only the bucket goes without
                log.warning("%s was served but could not be hashed for the bucket: %s",
                            key.id, e)
            finally:
                temp.unlink(missing_ok=True)
            return
        # The rename and the row under the upload lock: a PUT of the key while it was fetched
        # has put the uploader's file in its place, which this download would replace, though
        # the PUT was told it is kept (and processes keeping its bytes in memory would go on
        # serving them: two files under one key).
        async with contextlib.AsyncExitStack() as locked:
            try:
                # Hashed here, from the page cache, in a thread: ~10 ms of a 4 MB file that the
                # loop would otherwise spend while its clients wait. Synced before the lock,
                # which other downloads' commits wait for: the commit's fsync is then quick.
                digest = await asyncio.to_thread(_synced_sha256_of, fd)
                when = _http_date(meta.last_modified) if meta.last_modified else None
                await locked.enter_async_context(self.cache.uploads_locked())
                if await self.cache.upload_here(scope, key):
                    log.info("%s was uploaded while it was fetched: served, not kept", key.id)
                    return
                final = await asyncio.to_thread(self.cache.store.commit, temp, fd, scope, key,
                                                when.timestamp() if when is not None else None)
            except OSError as e:
                # Said to what waits for the file to be kept (a profile's resolution) as the
                # passing want it is: found not kept, the profile was refused with a 507 that
                # blamed cache.max_bytes, for a full descriptor table too.
                flight.not_kept = self._passing_os_failure(e)
                log.warning("%s was served but could not be cached: %s", key.id, e)
                return
            self.cache.health.ok(DISK)
            self.cache.release(flight)  # its bytes are counted as a file from now on
            record = self._record(key, scope, meta, flight.written, digest, publish)
            await self.cache.add(record)
        if record.shared and self.tier is not None \
                and await self.tier.holds(record.key_hash) is False:
            # Gone from the bucket while it was copied here: an upload deleted on another
            # replica, whose removal of this replica's rows came before this row was written
            # and found none. Kept, the deleted upload would be served here until evicted.
            log.info("%s left the shared bucket while it was copied: not kept", key.id)
            await self.cache.remove(scope, key)
            return
        self.misses.forget(scope, key)
        for listener in self.committed:
            listener(scope, key, req)
        if publish and self.tier is not None:
            # Under the key's lease: the replicas waiting for it read this copy next.
            with self.cache.lease(scope, key):
                await self.tier.publish(record, final)
        if self.cache.shared:
            try:
                await self.cache.enforce_shared_budget()
            except DATABASE_ERRORS as e:
                self.cache.sql_failed("judging the whole cache against its budget", e)

    # -- sections ---------------------------------------------------------------------------------
    # An upstream's /section answer cannot be verified, so a section is cut from the debuginfo
    # (or, when that lacks it or has it NOBITS or empty, the executable) found like any request for
    # them, build ID checked, and kept as an artifact of its own: a hit then reads only the
    # section, never the parent file again. Bytes and headers are elfutils'
    # (handle_buildid_f_match): the raw section, and the FILE and mtime of its parent.

    async def _section(self, key: ArtifactKey, req: RequestScope, cache_only: bool
                       ) -> Hit | Streaming:
        # A tenant with a file of its own to cut from (an upload), which its requests for that
        # file get before the shared scope's, keeps its cuts in its own scope: a cut the
        # shared scope has is of another file.
        own = await self._has_own_parent(key, req)
        cached = self.cache.peek_any(req.visible, key)
        if own and (cached is None or cached.scope != req.tenant):
            # Its own cut, which another process on this data dir may have made and this one
            # has not in memory.
            cached = await self.cache.get(req.tenant, key, touch=False) or cached
        if cached is not None and cached.path.is_file() \
                and (cached.scope == req.tenant or not own):
            return Hit(await self.cache.get(cached.scope, key) or cached)
        # Shared by the requests that see the same files: of one tenant (its own scope and the
        # shared one), not of one scope, which tenants without sources of their own share while
        # each sees its own uploads too. And that may do the same: one that may not fetch
        # (only-if-cached, past the hop limit) must neither wait on a fetch nor hand its 504
        # or 404 to one that may.
        kh = key_hash(req.tenant, key)
        if cache_only or not req.may_fetch:
            kh += "/cache-only"
        if (pending := self._cuts.get(kh)) is not None:
            return _answer(await asyncio.shield(pending))
        cut: asyncio.Future[Hit | _UnkeptSection] = asyncio.get_running_loop().create_future()
        self._cuts[kh] = cut
        try:
            hit = await self._cut_section(key, req, cache_only)
        except asyncio.CancelledError:
            cut.cancel()
            raise
        except Exception as e:
            cut.set_exception(e)
            cut.exception()  # retrieved: nobody may be waiting for it
            raise
        finally:
            del self._cuts[kh]
        cut.set_result(hit)
        return _answer(hit)

    async def _has_own_parent(self, key: ArtifactKey, req: RequestScope) -> bool:
        """Whether the tenant has in its own scope a file the section `key` may be cut from:
        in this process's memory, or committed by another process on this data dir (which
        memory alone missed, and the shared scope's cut answered the tenant there)."""
        if not req.tenant:
            return False
        for kind in (Kind.DEBUGINFO, Kind.EXECUTABLE):
            if await self.cache.get(req.tenant, ArtifactKey(key.build_id, kind),
                                    touch=False) is not None:
                return True
        return False

    async def _cut_section(self, key: ArtifactKey, req: RequestScope, cache_only: bool
                           ) -> Hit | _UnkeptSection:
        # A debuginfo that cannot be had (too large, its upstream failing, or sending another
        # file) still leaves the executable to cut from; its failure is the answer only if that
        # has no section either.
        failure: SymgateError | None = None
        for kind in (Kind.DEBUGINFO, Kind.EXECUTABLE):
            parent_key = ArtifactKey(key.build_id, kind)
            try:
                async with self._parent(parent_key, req, cache_only) as parent:
                    extent = await asyncio.to_thread(section_extent, parent.path, key.detail)
                    if extent is None:
                        continue
                    scope = req.tenant if await self._has_own_parent(key, req) \
                        else parent.scope
                    stored = await self._store_section(key, parent, scope, *extent)
                    if isinstance(stored, _UnkeptSection):
                        return stored
                    return Hit(stored, fetched=parent.fetched)
            except NotFound:
                continue
            except (TooLarge, UpstreamUnavailable, VerificationFailed) as e:
                failure = failure or e
        if failure is not None:
            raise failure
        raise NotFound(f"not found (no section {shown_detail(key.detail)} in the debuginfo or "
                       "executable)")

    @contextlib.asynccontextmanager
    async def _parent(self, key: ArtifactKey, req: RequestScope, cache_only: bool,
                      again: bool = True) -> AsyncIterator[_Parent]:
        """The artifact to cut from, fetched first if need be (joining any fetch under way),
        held (leased, and open) until the cut is done. A cached file found gone as it is
        opened is fetched again, once (`again`)."""
        for attempt in range(2):
            result = await self.find(key, req, cache_only=cache_only)
            if isinstance(result, Hit):
                break
            try:
                await result.flight.wait_settled()
            except BaseException:
                result.reader.close()
                raise
            if attempt or result.flight.error is None or not result.flight.lied:
                break
            # The upstream that answered sent another file, and a cut waits for the whole
            # file, so none of it was sent: the others are asked first now (Flight.lied), as
            # a GET of the file itself is asked again.
            result.reader.close()
        if isinstance(result, Hit):
            cached = result.artifact
        else:
            try:
                await result.flight.wait_settled()
                if (error := result.flight.error or result.flight.store_error) is not None:
                    raise error  # the file, which a section is cut from, is not whole
                found = self.cache.peek_any(req.visible, key)
                if found is None:
                    # Served but not kept (larger than the budget), or evicted at once: gone
                    # from the directory, but this reader's descriptor still reads it whole.
                    meta = result.meta
                    fd = result.reader.fd
                    when = _http_date(meta.last_modified) if meta.last_modified else None
                    # Of a source the request asked: its scope. Else (an upload, copied from
                    # the bucket) the most private one the request sees: a tenant's upload
                    # must not have its sections kept where other tenants see them.
                    yield _Parent(
                        path=Path(f"/proc/self/fd/{fd}"),
                        scope=next((u.scope for u in req.sources if u.name == meta.upstream),
                                   req.visible[0]),
                        upstream=meta.upstream, filename=meta.filename or key.default_filename,
                        archive=meta.archive,
                        mtime=when.timestamp() if when is not None else os.fstat(fd).st_mtime,
                        fetched=True)
                    return
                cached = found
            finally:
                result.reader.close()
        with self.cache.lease(cached.scope, key):
            opened: int | None
            try:
                # Read through its descriptor: a lease keeps this process's eviction off the
                # file, not another process's (its eviction, an operator's purge), which may
                # remove it the moment it was committed, or as the cut reads it.
                opened = os.open(cached.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                await self.vanished(cached)
                opened = None
            except OSError as e:
                self._raise_os_failure(e)
                raise
            if opened is not None and os.fstat(opened).st_size != cached.record.size:
                # Not the file its row describes: cut short on disk, or another process's
                # newer commit that this one's index is not told of yet. A GET of it finds it
                # again (fetched anew); a cut from it was a 404, its section headers (at its
                # end) gone, or the damaged file's bytes. Forgotten, and found again alike.
                os.close(opened)
                log.warning("cached %s is not the size its index entry says; looking it up "
                            "again", cached.record.key)
                await self.cache.vanished(cached.record)
                opened = None
            if opened is not None:
                try:
                    yield _Parent(
                        path=Path(f"/proc/self/fd/{opened}"), scope=cached.scope,
                        upstream=cached.record.upstream, filename=cached.record.filename,
                        archive=cached.record.archive, mtime=os.fstat(opened).st_mtime,
                        fetched=not isinstance(result, Hit) or result.fetched)
                finally:
                    os.close(opened)
                return
        if not again:
            raise OutOfResources(f"the cached {key.id} was removed as it was read, twice; "
                                 "try again")
        async with self._parent(key, req, cache_only, again=False) as parent:
            yield parent

    async def _store_section(self, key: ArtifactKey, parent: _Parent, scope: str,
                             offset: int, size: int) -> CachedArtifact | _UnkeptSection:
        """The section cut from `parent`, kept in `scope`: the parent's, or the tenant's
        whose own file shadows the shared scope's cuts (_section)."""
        # Its room in the budget, held before a byte is written, as a download's is: cut and
        # committed unjudged, a section larger than the budget evicted every other file for
        # itself, and then went too.
        room = object()
        # The rename and the row under the upload lock, as a download's: `cache purge` holds
        # it from its rows to its files, and a cut committed in between (by a process whose
        # memory lacked the section, whose row the purge had just deleted) had its new file
        # removed, its row left naming no file.
        async with contextlib.AsyncExitStack() as locked:
            try:
                keep = self.cache.could_fit(room, size) and await self.cache.reserve(room, size)
                temp, fd = self._new_temp()
                try:
                    try:
                        digest = await asyncio.to_thread(_copy_range, parent.path, offset, size,
                                                         fd)
                        if digest is None:
                            raise VerificationFailed(
                                f"{key.id}: section runs past the end of its file")
                        if not keep:
                            temp.unlink()
                            log.info("%s (%d bytes) does not fit cache.max_bytes now: served, "
                                     "not kept", key.id, size)
                            self._metrics.not_kept.inc()
                            return _unkept(os.dup(fd), parent, size)
                        await locked.enter_async_context(self.cache.uploads_locked())
                        final = await asyncio.to_thread(self.cache.store.commit, temp, fd,
                                                        scope, key, parent.mtime)
                    except OSError as e:
                        self._raise_os_failure(e)
                        raise
                except BaseException:
                    temp.unlink(missing_ok=True)
                    raise
                finally:
                    os.close(fd)
            finally:
                self.cache.release(room)  # its bytes are counted as a file from here on
            now = datetime.now(UTC)
            record = ArtifactRecord(
                key_hash=key_hash(scope, key), scope=scope, key=key.id, build_id=key.build_id,
                kind=str(key.kind), size=size, sha256=digest, upstream=parent.upstream,
                filename=parent.filename, archive=parent.archive, fetched_at=now,
                last_access=now, hits=0,
            )
            await self.cache.add(record)
        return await self.cache.get(scope, key) or CachedArtifact(record, final)

    async def _verify(self, key: ArtifactKey, meta: ArtifactMeta, flight: Flight, temp: Path,
                      writer: ChunkWriter) -> None:
        """The build ID of what came, read where it is (on disk or still in memory), on the
        loop where the section headers allow: pyelftools' ~1.5 ms in a thread, and before it
        the wait for the disk, were the last wait of every download's last byte."""
        found = build_id_of_reads(flight.read, flight.received)
        if found is None:
            await writer.flush()
            found = await asyncio.to_thread(build_id_of_file, temp)
        if found != key.build_id:
            self._reject(key, meta, "not_elf" if found is None else "build_id_mismatch")
            raise VerificationFailed(
                f"{meta.upstream} sent a file with build ID {found or 'none'},"
                f" not {key.build_id}")

    async def _write(self, fd: int, flight: Flight, chunk: bytes, offset: int) -> None:
        """Write at `offset`, then tell `flight`; on a full disk, evict to make room and try
        again, while eviction finds something to remove (bounded: each round frees at least
        a file)."""
        for _ in range(8):
            try:
                # The first chunk on the loop too: every client's first byte waits for it,
                # and a thread's hand-over would add to that wait.
                if len(chunk) <= INLINE_WRITE or offset == 0:
                    _write_all(fd, chunk, offset)
                else:
                    try:
                        own = os.dup(fd)
                    except OSError as e:
                        self._raise_os_failure(e)
                        raise
                    # Shielded: a cancelled download must not cancel the job before it runs,
                    # which alone closes the descriptor made for it.
                    await asyncio.shield(asyncio.get_running_loop().run_in_executor(
                        None, _write_own, own, chunk, offset))
                flight.wrote(len(chunk))
                return
            except OSError as e:
                if e.errno not in _NO_SPACE:
                    raise
                error = e
            # Room for this download so far and as much again, since SQLite and other
            # writers take their share of what is freed: one eviction per download, not
            # one per chunk.
            if await self.cache.make_room(2 * (offset + len(chunk))) == 0:
                break
        raise self.disk_full(error) from error

    def _claim(self, kh: str) -> Claim | None:
        try:
            return self._board.claim(kh)
        except OSError as e:
            self._raise_os_failure(e)
            raise

    def _new_temp(self) -> tuple[Path, int]:
        try:
            return self.cache.store.new_temp()
        except OSError as e:
            self._raise_os_failure(e)
            raise

    def _raise_os_failure(self, error: OSError) -> None:
        """Raise the passing condition `error` is (_passing_os_failure); any other OSError is
        a real fault and is left to the caller to raise."""
        if (failure := self._passing_os_failure(error)) is not None:
            if isinstance(failure, OutOfResources):
                log.warning("cannot open a cache file: %s", error)
            raise failure from error

    def _passing_os_failure(self, error: OSError) -> SymgateError | None:
        """A full disk (of bytes or of inodes), a read-only one or a full descriptor table:
        a passing condition of the server, answered with Retry-After (the disk's said on
        /healthz); None for any other OSError."""
        if error.errno in _NO_SPACE:
            return self.disk_full(error)
        if error.errno == errno.EROFS:
            return self.read_only(error)
        return out_of_descriptors(error)

    def disk_full(self, error: BaseException) -> InsufficientStorage:
        reason = f"no space left for the cache ({error})"
        self.cache.health.fail(DISK, reason)
        log.warning("%s", reason)
        return InsufficientStorage("insufficient storage: the cache's disk is full")

    def read_only(self, error: BaseException) -> InsufficientStorage:
        """The cache's filesystem is read-only (remounted so after an I/O error, as ext4's
        errors=remount-ro does, or mounted so by mistake): nothing can be kept, as on a full
        disk, until an operator makes it writable again. Not a bug of the server's (a 500
        with a traceback per miss), and /healthz must say it: recheck_space keeps it said
        while the disk stays so."""
        self.cache.health.fail(DISK, READ_ONLY)
        log.warning("%s (%s)", READ_ONLY, error)
        return InsufficientStorage(f"insufficient storage: {READ_ONLY}")

    def _record(self, key: ArtifactKey, scope: str, meta: ArtifactMeta, size: int,
                digest: str, publish: bool) -> ArtifactRecord:
        now = datetime.now(UTC)
        return ArtifactRecord(
            key_hash=key_hash(scope, key), scope=scope, key=key.id, build_id=key.build_id,
            kind=str(key.kind), size=size, sha256=digest, upstream=meta.upstream,
            filename=meta.filename or key.default_filename, archive=meta.archive,
            fetched_at=now, last_access=now, hits=0, ima_signature=meta.ima_signature,
            shared=self.tier is not None and not publish,  # read from the bucket
        )

    def _reject(self, key: ArtifactKey, meta: ArtifactMeta, reason: str) -> None:
        # By upstream: which one lies is what an operator has to act on.
        self._metrics.verification_failures.labels(
            str(key.kind), reason, self._metrics.upstream_label(meta.upstream)).inc()

    async def warm_up(self) -> None:
        """Run a miss's SQL lookups once, for a key nobody has: the first client's cold fetch
        would otherwise pay for compiling them and opening the database (~20 ms)."""
        nobody = ArtifactKey("00" * 20, Kind.DEBUGINFO)
        await asyncio.gather(self.stored(("",), nobody), self.misses.live("", nobody),
                             self.refresh_uploaders())

    async def _join(self, flight: Flight) -> Streaming:
        # The descriptor is duplicated now, while the flight certainly holds it open.
        try:
            reader = flight.reader()
        except OSError as e:
            self._raise_os_failure(e)
            raise
        try:
            with self._metrics.fetch_waiters.track_inprogress():
                meta = await flight.wait_meta()
        except BaseException:
            reader.close()
            raise
        return Streaming(flight, reader, meta)

    async def wait_idle(self) -> None:
        """Until no fetch is under way (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Stop every fetch, but let those whose clients have had every byte commit their file
        first: that is an fsync and a row, and a stop must not lose what was just fetched."""
        committing = [f.wait_settled() for f in self._flights.values() if f.succeeded]
        if committing:
            await asyncio.wait([asyncio.ensure_future(c) for c in committing],
                               timeout=COMMIT_AT_STOP_S)
        for task in [*self._tasks, *self._tidying]:
            task.cancel()  # files left untidy are cleared at the next start
        await asyncio.gather(*self._tidying, return_exceptions=True)
        await self.wait_idle()


def _answer(cut: Hit | _UnkeptSection) -> Hit | Streaming:
    """A section's cut as one request's answer: the cached file, or its own reader of one
    not kept."""
    return cut if isinstance(cut, Hit) else cut.streaming()


def _unkept(fd: int, parent: _Parent, size: int) -> _UnkeptSection:
    """A section of `size` bytes, whole on `fd` (which it owns: closed once every request
    reading it has let it go, each reading through a duplicate), with its parent's headers."""
    meta = ArtifactMeta(upstream=parent.upstream, size=size, filename=parent.filename,
                        archive=parent.archive,
                        last_modified=email.utils.formatdate(parent.mtime, usegmt=True))
    flight = Flight(fd)
    weakref.finalize(flight, os.close, fd)
    flight.started(meta)
    flight.wrote(size)
    flight.body_ended()
    flight.succeed()
    return _UnkeptSection(flight, meta)


def _copy_range(path: Path, offset: int, size: int, fd: int) -> str | None:
    """Copy `size` bytes at `offset` of `path` to `fd`; their sha256, or None if the file is
    shorter than that."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left:
            chunk = f.read(min(left, 1024 * 1024))
            if not chunk:
                return None
            _write_all(fd, chunk, size - left)
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _asking(req: RequestScope) -> frozenset[str]:
    """The names of the sources the request asks, remote and local."""
    return frozenset(u.name for u in req.sources)


def _miss_judges(req: RequestScope, key: ArtifactKey) -> tuple[list[str], bool]:
    """The request's sources whose misses are remembered, by name, and whether a source that
    can tell at once (a local directory) has the key. Only the former can make a request a
    negative hit; the latter overrides any remembered miss."""
    names = [u.name for u in req.sources if u.remembers_misses]
    return names, any(u.has(key) for u in req.sources if not u.remembers_misses)


def _synced_sha256_of(fd: int) -> str:
    os.fsync(fd)
    return _sha256_of(fd)


def _sha256_of(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1024 * 1024, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _write_own(fd: int, data: bytes, offset: int) -> None:
    """_write_all on a descriptor of its own, closed after: a thread's write that outlives its
    download (cancelled, failed) lands in the download's file, unlinked or not, never in a
    file that reuses the download's descriptor number."""
    try:
        _write_all(fd, data, offset)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """pwrite, so that writing a chunk again after a failure part-way puts it in its place."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _http_date(value: str) -> datetime | None:
    try:
        return email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
