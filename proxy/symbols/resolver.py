"""Symbol tables per (scope, build ID): found, built, opened, and shared by every request.

A table is built from the best ELF file there is for the build ID: a debug file from the
configured local debug directories or from symgate's cache and the request's sources, else the
executable (its .symtab/.dynsym). It is kept under the scope of the file it was built from, so
a table built from a tenant's private file answers that tenant only. Builds start in the
background as soon as a debuginfo or executable is cached, and a table is dropped when the
artifact it was built from is evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from proxy.artifacts.index import SPACE_BACK_BYTES
from proxy.artifacts.scope import SHARED, RequestScope
from proxy.artifacts.service import ArtifactService, Streaming
from proxy.errors import (
    DatabaseUnavailable,
    InsufficientStorage,
    NotFound,
    SourceEvicted,
    SymgateError,
    WorkerLost,
)
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import SymbolizeMetrics
from proxy.store.repository import SymbolTableRecord, is_disk_full, is_read_only
from proxy.symbols import build_lock
from proxy.symbols.build_pool import BuildPool
from proxy.symbols.open_tables import OpenTable, OpenTables
from proxy.symbols.table_store import (
    WITHOUT_EXECUTABLE,
    WITHOUT_SUPPLEMENT,
    TableStore,
    built_from,
    from_executable,
    layout_from_json,
    local_source_key,
    partial,
    ranges_from_json,
    without_executable,
)
from proxy.symbols.workers import SymbolizeWorkers
from symbolize.debugdirs import LocalFiles, find_debug_file, find_executable, find_local
from symbolize.elf import LoadSegment, executable_segments, exported_functions, layout_of_file
from symbolize.outcome import Outcome, TryAgain
from symbolize.pipeline import Resolved, SymbolProvider
from symbolize.supplementary import SupplementLink, supplement_beside, supplement_link
from symbolize.symtab import FORMAT, MalformedObject, NoSymbols, TableSpec, names_from_executable

log = logging.getLogger(__name__)
T = TypeVar("T")
# Evicted artifacts whose tables are still to be dropped (the database did not answer); past
# this, the oldest are given up (their tables stay until a purge).
MAX_OWED_DROPS = 100_000

# What a shared resolution ends in: the table, opened under its scope, or why there is none.
_Found = tuple[str, OpenTable] | Outcome
Segments = tuple[LoadSegment, ...]
# An executable's program headers and the scope of the file they came from, or None.
_Layout = tuple[str, Segments] | None
# A table unreadable again this soon after it was dropped for it is believed malformed.
UNREADABLE_AGAIN_S = 3600.0


class _Unread:
    """A debug file's supplement link not read yet (None is a file without one)."""


_UNREAD = _Unread()


class _LocalLookup:
    """What the local debug directories hold of one build ID: looked for once, when first
    asked, and shared by the steps of one resolution that ask."""

    def __init__(self, find: Callable[[], Awaitable[LocalFiles | None]]) -> None:
        self._find = find
        self._found: asyncio.Future[LocalFiles | None] | None = None

    async def files(self) -> LocalFiles:
        if self._found is None:
            self._found = asyncio.ensure_future(self._find())
        # Shielded: a caller cancelled must not cancel the lookup for the next step.
        return await asyncio.shield(self._found) or LocalFiles()


# A file beside the one a table is built from, and its cached artifact (to lease), if any.
_Beside = tuple[Path, tuple[str, ArtifactKey] | None]


class _Source:
    """The ELF file a table is built from, and the cached artifact it is (to lease), if any;
    the executable beside a debug file, whose .dynsym names exported functions as
    llvm-symbolizer does (symbolize/function_names.py); and the supplementary file dwz gave a
    debug file (symbolize/supplementary.py)."""

    def __init__(self, path: Path, source_key: str, scope: str,
                 artifact: tuple[str, ArtifactKey] | None,
                 executable: _Beside | None = None, supplement: _Beside | None = None
                 ) -> None:
        self.path = path
        self.source_key = source_key
        self.scope = scope
        self.artifact = artifact
        self.executable = executable
        self.supplement = supplement

    def cached(self) -> list[tuple[str, ArtifactKey]]:
        """The cached artifacts among its files."""
        return [artifact for artifact in (self.artifact, self.executable and self.executable[1],
                                          self.supplement and self.supplement[1])
                if artifact is not None]


class SymbolResolver:
    def __init__(
        self, *, artifacts: ArtifactService, tables: TableStore, open_tables: OpenTables,
        pool: BuildPool, workers: SymbolizeWorkers, debug_dirs: Sequence[Path],
        metrics: SymbolizeMetrics, enabled: bool = True,
    ) -> None:
        self._artifacts = artifacts
        # symbolize.enabled: off, /symbolize passes profiles through untouched, so a table
        # built ahead (a second of CPU for libc's) would never be read, and no worker is due.
        self._enabled = enabled
        self._tables = tables
        self._open = open_tables
        self._pool = pool
        self.workers = workers  # where profiles are rewritten with these tables
        self._debug_dirs = tuple(debug_dirs)
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="symgate-debug-dirs")
        self._metrics = metrics
        # Keyed by (the request's tenant, build ID): one resolution and one layout search each.
        # Not by its scope: tenants without sources of their own share the shared scope, but
        # each also sees its own uploads, so what one's resolution finds is not the other's.
        self._resolving: dict[tuple[str, str], asyncio.Future[_Found]] = {}
        self._layouts: dict[tuple[str, str], asyncio.Future[_Layout]] = {}
        # Keyed by (the source's scope, build ID): one build of each table file at a time.
        self._building: dict[tuple[str, str], asyncio.Future[_Found]] = {}
        # Builds waiting for another process's build of the same table (for tests and status).
        self.builds_waiting = 0
        # When each table was last found unreadable, by (scope, build ID).
        self._unreadable: dict[tuple[str, str], float] = {}
        # Artifacts that left the cache while the database did not answer, whose tables are
        # dropped once it does (drop_owed): oldest first.
        self._owed: dict[tuple[str, ArtifactKey], None] = {}
        for gone in artifacts.cache.gone_at_load:  # the same, through a stop and a start
            self._owe(*gone)
        artifacts.committed.append(self._on_committed)
        artifacts.cache.evicted.append(self._on_evicted)

    @property
    def busy(self) -> bool:
        """A resolution or a build is under way (for tests and status)."""
        return bool(self._resolving or self._building)

    async def start(self, *, worker: bool = True) -> None:
        """Have SQLAlchemy compile the symbol-table query now rather than on the first cold
        profile (about 10 ms), and, with `worker`, start a worker (it exits after
        symbolize.worker_idle_s unless a job comes)."""
        if removed := await asyncio.to_thread(self._tables.clear_leftovers):
            log.info("removed %d half-written symbol tables of dead build workers", removed)
        await self._tables.get(SHARED, "")
        if self._enabled and worker:
            self.workers.pool.start_soon()

    async def close(self) -> None:
        pending: list[asyncio.Future[Any]] = [*self._resolving.values(),
                                              *self._layouts.values(),
                                              *self._building.values()]
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        await self.workers.close()  # builds' and profiles' alike

    def provider(self, req: RequestScope) -> SymbolProvider:
        """What the symbolization pipeline asks, for one request."""
        return _ScopedProvider(self, req)

    # -- lookups -------------------------------------------------------------------------------
    async def resolve(self, req: RequestScope, build_id: str, needs_layout: bool) -> Resolved:
        """The symbols of `build_id` for this request; fetching and building them if need be.

        Shielded as a whole: a request that gives up at its deadline leaves the table and the
        program headers to be found anyway, for the next profile.
        """
        return await asyncio.shield(self._resolve(req, build_id, needs_layout))

    async def _local(self, find: Callable[[Sequence[Path], str], T], build_id: str
                     ) -> T | None:
        """What `find` finds of `build_id` in the local debug directories, looked for in a
        thread: it stats each candidate and reads its build ID, which a slow or remote disk
        (an NFS-mounted /usr/lib/debug) made a wait of the whole loop, once or more per cold
        mapping. None at once where there are none (a plain proxy).

        In a pool of two threads of its own, not the loop's default one: reading ELF headers
        holds the GIL, and a cold profile's 30 lookups on that pool's six threads starved the
        loop (30 ms before the last of its resolutions had even begun) and each other (its
        biggest build ID's lookup, asked first, done 45 ms later)."""
        if not self._debug_dirs:
            return None
        return await asyncio.get_running_loop().run_in_executor(
            self._lookups, find, self._debug_dirs, build_id)

    def _open_for(self, req: RequestScope, build_id: str) -> tuple[str, OpenTable] | None:
        for scope in req.visible:
            if (opened := self._open.get(scope, build_id)) is not None:
                if scope != req.visible[0] \
                        and self._tables.path(req.visible[0], build_id).exists():
                    # The tenant's own table (of its upload, its own server's file), which
                    # another process on this data dir built, comes before the shared one
                    # open here: _load_or_build reads it (a stat tells; SQL only then).
                    return None
                if opened.recheck_at is not None and opened.recheck_at <= time.time():
                    return None  # its debug file is asked for again: _load_or_build
                if not opened.table.path.exists():
                    # Its file left the data dir (removed by hand, a cleanup): found or built
                    # again, as a restart would, rather than failed by every profile.
                    self._open.drop(scope, build_id)
                    return None
                if _unjudged(req, scope, opened.recheck_at is not None) \
                        and req.tenant not in opened.judged_by:
                    return None  # the tenant's own sources first: _load_or_build
                return scope, opened
        return None

    async def _resolve(self, req: RequestScope, build_id: str, needs_layout: bool) -> Resolved:
        found = self._open_for(req, build_id)
        layout: asyncio.Future[_Layout] | None = None
        if found is None:
            # Looked for while the table is built, not after, where the executable is fetched;
            # a local one goes into the build, which records its program headers itself.
            # The local debug directories are looked in once for all this resolution needs
            # of them: a cold profile's 30 build IDs each went through the thread pool three
            # times (the executable, both files, the debug file's dwz link), and its biggest
            # one, first to ask, queued behind the other 29 at each step (0.1 s before
            # libc's build could start). Only when asked: a table the database has needs
            # none of it.
            local = _LocalLookup(lambda: self._local(find_local, build_id))
            if needs_layout and (await local.files()).executable is None:
                layout = self._executable_layout(req, build_id)
            key = (req.tenant, build_id)
            resolved = await (self._resolving.get(key)
                              or self._track(key, self._load_or_build(req, build_id, local)))
            if isinstance(resolved, Outcome):
                return Resolved(None, outcome=resolved)
            found = resolved
        else:
            self._metrics.symtab_cache.labels("hit").inc()
        scope, opened = found
        if needs_layout and (own := opened.scoped_segments.get(req.tenant)) is not None:
            return Resolved(opened.table, own)
        if needs_layout and not opened.layout_searched:
            searched = await (layout or self._executable_layout(req, build_id))
            if searched is not None and searched[0] not in (SHARED, scope):
                # A tenant's own executable translates for that tenant's requests alone: the
                # table it would otherwise mark is seen by others. Kept beside the table.
                opened.scoped_segments[searched[0]] = searched[1]
                return Resolved(opened.table, searched[1])
            if not opened.layout_searched and (searched is not None or req.scope == scope):
                opened.layout_searched = True
                if searched is not None:
                    opened.segments = searched[1]
                    await self._tables.set_layout(scope, build_id, searched[1])
        return Resolved(opened.table, opened.segments)

    def _track(self, key: tuple[str, str], work: Coroutine[object, object, _Found]
               ) -> asyncio.Future[_Found]:
        """Run `work` as the one resolution of `key` that every caller shares."""

        async def guarded() -> _Found:
            try:
                return await work
            except TryAgain:
                raise  # every profile waiting on it is refused, and the next one builds it
            except Exception as e:  # one build ID's failure must not fail a whole profile
                if is_read_only(e):
                    # The data dir cannot be written (its table, its build's lock): refused
                    # with 507 as on a full disk. A 200 with the mapping `internal` would be
                    # kept unsymbolized for good, for a condition an operator ends.
                    raise self._artifacts.read_only(e) from e
                log.exception("symbol table for %s failed", key[1])
                return Outcome.INTERNAL

        future = asyncio.ensure_future(guarded())
        self._resolving[key] = future

        def done(f: asyncio.Future[_Found]) -> None:
            if self._resolving.get(key) is f:
                del self._resolving[key]

        future.add_done_callback(done)
        return future

    async def _load_or_build(self, req: RequestScope, build_id: str, local: _LocalLookup
                             ) -> _Found:
        """`local`: what the local debug directories hold of `build_id`."""
        recheck: SymbolTableRecord | None = None
        failed: SymbolTableRecord | None = None
        for scope in req.visible:
            rec, from_bucket = await self._tables.find(scope, build_id)
            if rec is not None and rec.outcome == Outcome.OK:
                if self._tables.stale(rec) or _unjudged(req, scope, rec.expires_at is not None):
                    recheck = recheck or rec
                    continue
                self._metrics.symtab_cache.labels("bucket" if from_bucket else "hit").inc()
                return scope, self._remember(rec)
            if rec is not None and _unjudged(req, scope, True):
                failed = rec
                continue
            # A failure still believed is believed in any scope the request sees whose files
            # the request's sources judged: looking again would find the same file and build
            # the same nothing.
            if rec is not None:
                return Outcome(rec.outcome)
        self._metrics.symtab_cache.labels("miss").inc()
        try:
            return await self._find_and_build(req, build_id, local, recheck, failed)
        except TryAgain as e:
            if recheck is None or partial(recheck.source_key) \
                    or not self._tables.path(recheck.scope, build_id).exists():
                raise
            # A debug file's table asked about again for its executable, which cannot be
            # built with it now (a tight cache budget evicts one of the two, a full disk): it
            # has every line and still serves, asked about again at the next profile.
            log.info("symbol table for %s not built again with its executable (%s): the one "
                     "without it serves", build_id, e)
            return recheck.scope, self._remember(recheck)

    async def _find_and_build(self, req: RequestScope, build_id: str, local: _LocalLookup,
                              recheck: SymbolTableRecord | None,
                              failed: SymbolTableRecord | None = None) -> _Found:
        """A source for the table and its build; or, where the source is the one `recheck`
        was built from, that table believed again; or the one `failed` was (a shared table's
        failed build, which a tenant's own sources may have had a better file for), that
        failure."""
        try:
            source = await self._find_source(req, build_id, local)
        except TryAgain:
            raise  # the server's passing trouble (a full disk), not the build ID's
        except SymgateError as e:
            log.info("no symbols for %s: %s", build_id, e.reason)
            return e.outcome
        if source is None:
            return Outcome.NOT_FOUND
        if failed is not None and _built_from(failed, source):
            return Outcome(failed.outcome)
        if recheck is not None and _built_from(recheck, source):
            # Still no debug file (or executable): the table it has is as good as a new build.
            if not self._tables.stale(recheck):
                # A shared table not due to be asked about again, which a tenant's own sources
                # had nothing better for: theirs is not the shared scope's answer to renew.
                opened = self._open.get(recheck.scope, build_id) or self._remember(recheck)
            else:
                opened = self._remember(await self._tables.renew(recheck))
            if recheck.scope != req.scope:
                opened.judged_by.add(req.tenant)
            return recheck.scope, opened
        return await self._build(build_id, source)

    def _remember(self, rec: SymbolTableRecord) -> OpenTable:
        table = TableSpec(self._tables.path(rec.scope, rec.build_id), rec.load_address,
                          ranges_from_json(rec.code_ranges), ranges_from_json(rec.cold_ranges),
                          rec.has_lines)
        segments = layout_from_json(rec.file_layout) if rec.file_layout else None
        recheck_at = rec.expires_at.timestamp() \
            if rec.outcome == Outcome.OK and rec.expires_at is not None else None
        opened = OpenTable(table, segments, layout_searched=segments is not None,
                           recheck_at=recheck_at)
        self._open.put(rec.scope, rec.build_id, opened)
        return opened

    async def _find_source(self, req: RequestScope, build_id: str, lookup: _LocalLookup
                           ) -> _Source | None:
        found = await lookup.files()
        local, local_exe = found.debug, found.executable
        if local is not None:
            return await self._with_supplement(req, _debug_source(
                local, local_source_key(local, executable=False), SHARED, None,
                (local_exe, None) if local_exe else None), tenant_table=True,
                link=found.link)
        # The executable is fetched beside the debug file (the layout search of a profile with
        # runtime addresses fetches it too: one upstream fetch for both).
        exe_key = ArtifactKey(build_id, Kind.EXECUTABLE)
        exe: asyncio.Future[tuple[str, Path]] | None = None
        if local_exe is None:
            exe = asyncio.ensure_future(self._artifact_path(exe_key, req))
        try:
            key = ArtifactKey(build_id, Kind.DEBUGINFO)
            with contextlib.suppress(NotFound):
                try:
                    scope, path = await self._artifact_path(key, req)
                except SymgateError as e:
                    # A full disk is the server's passing trouble, not an upstream's: the
                    # profile is refused (TryAgain), never answered with the executable's bare
                    # names, which a backend would keep for good.
                    if local_exe is None or isinstance(e, TryAgain):
                        raise
                    # A site cut off from its upstreams still has its own executables: their
                    # table serves until the debug file is asked for again (stale()).
                    log.info("debug file of %s not had (%s): its table is built from the "
                             "local executable", build_id, e.reason)
                    raise NotFound(e.reason) from e
                beside = await self._beside(scope, local_exe, exe, exe_key)
                return await self._with_supplement(
                    req, _debug_source(path, key.id, scope, (scope, key), beside),
                    tenant_table=True)
            if exe is not None:
                with contextlib.suppress(NotFound):
                    scope, path = await exe
                    return _Source(path, exe_key.id, scope, (scope, exe_key),
                                   (path, (scope, exe_key)))
        finally:
            # Its failure read, whenever it comes (before the debug file's too, which left it
            # to asyncio's "never retrieved" ERROR); a fetch still under way fills the cache.
            if exe is not None:
                exe.add_done_callback(_failure_read)
        if local_exe is None:
            return None
        return _Source(local_exe, local_source_key(local_exe, executable=True), SHARED, None,
                       (local_exe, None))

    async def _with_supplement(self, req: RequestScope | None, source: _Source, *,
                               tenant_table: bool = False,
                               link: SupplementLink | _Unread | None = _UNREAD
                               ) -> _Source | None:
        """`source` with the supplementary file that dwz gave it, when it has one: from the
        local debug directories, the cache, or (with a request) the request's sources. A
        table built without it, named by its symbols alone, is recorded as such
        (WITHOUT_SUPPLEMENT), to be built again once it can be had. None when there is no
        request to fetch it with (a prebuild): the first profile fetches it.

        `tenant_table`: a shared debug file whose supplement only the request's tenant has
        (its own upstream's, its upload) is built with it into the tenant's table, seen by
        that tenant alone. Not for a prebuild, whose table others wait on.

        `link`: the source's own .gnu_debugaltlink, where it was read already."""
        if isinstance(link, _Unread):
            link = await asyncio.to_thread(supplement_link, source.path)
        if link is None:
            return source
        tenant = req.tenant if req is not None and tenant_table else source.scope
        found = await self._supplement(req, source.scope, tenant, link.build_id)
        if found is None and source.artifact is None:
            # A debug file of the local debug directories (the operator's own tree, as
            # /usr/lib/debug): its supplement also where its link says, `.dwz/<package>`
            # beside, as gdb and the offline CLI find it; never for a file an upstream sent.
            beside = await asyncio.to_thread(supplement_beside, source.path, link)
            found = (beside, None) if beside is not None else None
        if found is None and req is None:
            return None
        if found is None:
            log.info("supplementary file %s of %s not had: its table has no lines",
                     link.build_id or link.name, source.source_key)
            source.source_key += WITHOUT_SUPPLEMENT
        elif found[1] is not None and found[1][0] not in (SHARED, source.scope):
            source.scope = found[1][0]
        source.supplement = found
        return source

    async def _supplement(self, req: RequestScope | None, scope: str, tenant: str,
                          build_id: str) -> _Beside | None:
        try:
            key = ArtifactKey.parse(build_id, Kind.DEBUGINFO.value)
        except SymgateError:
            return None  # a link without a build ID, or a damaged one: not to be found
        if (local := await self._local(find_debug_file, key.build_id)) is not None:
            return local, None
        for held in dict.fromkeys((scope, SHARED)):
            if (cached := self._artifacts.cache.peek(held, key)) is not None:
                return cached.path, (held, key)
        if req is None:
            return None
        try:
            found_scope, path = await self._artifact_path(key, req)
        except TryAgain:
            raise  # a full disk: the profile is refused, not answered without lines
        except SymgateError as e:
            log.info("supplementary file %s: %s", build_id, e.reason)
            return None
        # Not a tenant's own file for a table that others see.
        return (path, (found_scope, key)) if found_scope in (SHARED, scope, tenant) else None

    @staticmethod
    async def _beside(scope: str, local_exe: Path | None,
                      fetching: asyncio.Future[tuple[str, Path]] | None, key: ArtifactKey
                      ) -> tuple[Path, tuple[str, ArtifactKey] | None] | None:
        """The executable to build a debug file's table of `scope` with, if there is one: not
        a tenant's own for a table that others see."""
        if local_exe is not None:
            return local_exe, None
        assert fetching is not None
        try:
            exe_scope, path = await fetching
        except SymgateError:
            # A full disk too: the table goes without the executable's names until it is
            # cached (_prebuild builds it again then), and a profile that needs its program
            # headers asks for it again (_find_executable_layout), refused if it still cannot.
            return None
        return (path, (exe_scope, key)) if exe_scope in (SHARED, scope) else None

    async def _artifact_path(self, key: ArtifactKey, req: RequestScope) -> tuple[str, Path]:
        """(scope, path) of the cached artifact, fetched through the request's sources."""
        for attempt in range(2):
            result = await self._artifacts.find(key, req)
            if isinstance(result, Streaming):
                try:
                    await result.flight.wait_settled()
                finally:
                    result.reader.close()
                if result.flight.error is not None:
                    if result.flight.lied and not attempt:
                        continue  # the other upstreams are asked first now (Flight.lied)
                    raise result.flight.error
                # A file served whole but not stored for want of room is not in the cache to
                # read: that passing trouble refuses the profile, rather than a NotFound that
                # builds from the executable or leaves the mapping bare in a 200 kept for good.
                if isinstance(unkept := result.flight.store_error or result.flight.not_kept,
                              TryAgain):
                    raise unkept
            break
        # Committed here, or by the process whose download this one followed.
        cached = self._artifacts.cache.peek_any(req.visible, key) \
            or await self._artifacts.stored(req.visible, key)
        if cached is None:
            if key.kind is not Kind.DEBUGINFO or (
                    isinstance(result, Streaming)
                    and result.flight.received > self._artifacts.cache.max_bytes):
                # An executable beside a debug file only adds to its table (names, program
                # headers a guess stands in for); one larger than the budget is never kept.
                raise NotFound(f"{key.id} left the cache before it could be read")
            # A debug file served but not kept, for the room the files being sent and
            # downloaded hold (or evicted at once for theirs): the passing trouble a full disk
            # is, which refuses the profile. Read as missing, its mapping went bare (or named
            # by the executable alone) in a 200 that a profiling backend keeps for good.
            raise InsufficientStorage(f"{key.id} does not fit cache.max_bytes now; retry")
        return cached.scope, cached.path

    @contextlib.contextmanager
    def _leased(self, source: _Source) -> Iterator[None]:
        with contextlib.ExitStack() as leases:
            for artifact in source.cached():
                leases.enter_context(self._artifacts.cache.lease(*artifact))
            yield

    async def _build(self, build_id: str, source: _Source) -> _Found:
        """Build one table file at a time: a request of a tenant and the prebuild that a
        shared commit starts must not both write the same file."""
        key = (source.scope, build_id)
        running = self._building.get(key)
        if running is None:
            running = asyncio.ensure_future(self._build_now(build_id, source))
            self._building[key] = running

            def done(f: asyncio.Future[_Found]) -> None:
                if self._building.get(key) is f:
                    del self._building[key]

            running.add_done_callback(done)
        return await asyncio.shield(running)

    async def _build_now(self, build_id: str, source: _Source) -> _Found:
        """Build the table, unless another process on this data dir is building it: then wait
        for that build and take what it recorded."""
        scope = source.scope
        lock_path = self._tables.lock_path(scope, build_id)
        with self._leased(source):
            # The row is read first only where another process holds the lock, to tell its
            # build from what was there before: read on every build, a cold profile's 30
            # build IDs queued 60 queries on the one SQLite connection, and its biggest
            # build, first to ask, waited behind the other 29's first query.
            lock, before = build_lock.try_acquire(lock_path), None
            if lock is None:
                before = await self._tables.get(scope, build_id)
                self.builds_waiting += 1
                try:
                    lock = await build_lock.wait_for(lock_path)
                finally:
                    self.builds_waiting -= 1
            try:
                if lock.waited and (found := await self._built_elsewhere(
                        build_id, source, before)) is not None:
                    return found
                return await self._build_locked(build_id, source)
            finally:
                lock.release()  # once the row is written: a waiter reads it next

    async def _built_elsewhere(self, build_id: str, source: _Source,
                               before: SymbolTableRecord | None) -> _Found | None:
        """What the build another process made while this one waited recorded, if it serves
        this build too; None: build after all."""
        scope = source.scope
        rec = await self._tables.usable(scope, build_id)
        if rec is None or (before is not None and rec.built_at == before.built_at):
            return None  # no build recorded meanwhile (its builder died, or had nothing)
        if rec.outcome != Outcome.OK:
            # A failure speaks for the file that failed, not for another one.
            return Outcome(rec.outcome) if rec.source_key == source.source_key else None
        if partial(rec.source_key) and not partial(source.source_key):
            return None  # this build has the lines that the one recorded lacks
        log.info("symbol table for %s: built by another process", build_id)
        return scope, self._remember(rec)

    async def _build_locked(self, build_id: str, source: _Source) -> _Found:
        scope = source.scope
        outcome, error, result = Outcome.OK, None, None
        try:
            # A table is smaller than the file it is built from: that much room is enough.
            result = await self._with_room(lambda: self._pool.build(
                source.path, self._tables.path(scope, build_id), build_id,
                source.executable and source.executable[0],
                source.supplement and source.supplement[0]), _size_of(source.path))
        except NoSymbols as e:
            outcome, error = Outcome.NO_SYMBOLS, str(e)
        except MalformedObject as e:
            outcome, error = Outcome.MALFORMED, str(e)
        except WorkerLost:
            # Its worker died (the OOM killer, say) with the table half-written: removed now,
            # not at the next start, or a file that kills its builder at each try fills the
            # disk with them while the server runs on.
            self._tables.clear_leftovers_of(scope, build_id)
            raise
        except FileNotFoundError as e:
            # The source went away before the worker opened it (a local file removed, a cached
            # one evicted): nothing about it to believe; asked again, it is found or fetched
            # again.
            log.info("symbol table for %s: its source is gone (%s)", build_id, e)
            if source.cached():
                # Evicted by another serving process on this data dir most likely, which knows
                # nothing of this one's leases: the server's passing trouble, so the profile is
                # refused, not answered with the mapping bare in a 200 kept for good.
                raise SourceEvicted(f"{build_id}: a file its symbol table is built from left "
                                    "the cache before it was read; try again") from e
            return Outcome.NOT_FOUND
        try:
            # SQLite sits on the data dir's disk by default, beside the tables: the table
            # just built may take the room its row needed.
            rec = await self._with_room(lambda: self._tables.record(
                scope, build_id, outcome, source.source_key, result, error), SPACE_BACK_BYTES)
        except InsufficientStorage:
            if result is not None:  # no row describes it, and an older one another table
                self._tables.remove_file(scope, build_id)
            raise
        if gone := [a for a in source.cached() if self._artifacts.cache.peek(*a) is None]:
            # Removed while it was read (a purge, an upload deleted; a lease keeps eviction
            # off): the removal found no row to drop (_on_evicted), and this one would have
            # named profiles after a file that is gone, for good (nothing is left by which a
            # purge finds it). Refused as a source evicted before its build read it is.
            self._open.drop(scope, build_id)
            await self._tables.drop(scope, build_id)
            raise SourceEvicted(f"{build_id}: {gone[0][1].id} left the cache while its "
                                "symbol table was built; try again")
        # Counted once recorded and open, so the metric never runs ahead of the table.
        self._metrics.symtab_builds.labels(outcome).inc()
        if result is None:
            log.info("symbol table for %s: %s (%s)", build_id, outcome, error)
            return outcome
        self._metrics.symtab_build_seconds.observe(result.seconds)
        log.info("symbol table for %s built from %s in %.3fs (%d bytes)", build_id,
                 source.source_key, result.seconds, result.size)
        return scope, self._remember(rec)

    async def _with_room(self, attempt: Callable[[], Awaitable[T]], room: int) -> T:
        """`attempt`; on a full disk, evict `room` bytes as a fetch does and try once more.
        Still no room: InsufficientStorage, so the profile is refused with Retry-After (as a
        fetch that cannot be stored is) and nothing about the file is remembered."""
        failure: Exception | None = None
        for tried in range(2):
            if tried and await self._artifacts.cache.make_room(room) == 0:
                break
            try:
                return await attempt()
            except Exception as e:  # OSError from a worker, SQLAlchemy's from SQLite
                if not is_disk_full(e):
                    raise
                failure = e
        assert failure is not None
        raise self._artifacts.disk_full(failure) from failure

    def _executable_layout(self, req: RequestScope, build_id: str
                           ) -> asyncio.Future[_Layout]:
        """The one search for the executable's program headers of `build_id` under way."""
        key = (req.tenant, build_id)
        layout = self._layouts.get(key)
        if layout is None:
            layout = asyncio.ensure_future(self._find_executable_layout(req, build_id))
            self._layouts[key] = layout
            layout.add_done_callback(lambda _f: self._layouts.pop(key, None))
            # Its TryAgain read even when the resolution failed first and nobody awaits it.
            layout.add_done_callback(_failure_read)
        return layout

    async def _find_executable_layout(self, req: RequestScope, build_id: str) -> _Layout:
        """Program headers with real file offsets, from the executable, and the scope of the
        file; None if there are none to be had (the pipeline then guesses)."""
        try:
            scope, exe = SHARED, await self._local(find_executable, build_id)
            if exe is None:
                try:
                    scope, exe = await self._artifact_path(
                        ArtifactKey(build_id, Kind.EXECUTABLE), req)
                except TryAgain:
                    raise  # below
                except SymgateError:
                    pass  # no executable to be had: guessed
            segments = await asyncio.to_thread(executable_segments, exe, build_id)
            return (scope, segments) if segments is not None else None
        except TryAgain:
            # The executable not stored for want of room: the server's passing trouble. A
            # guessed layout is exact for GNU ld only, and a 200 with names from it is kept
            # for good; the profile is refused with Retry-After instead.
            raise
        except Exception:  # a failure here must not fail the profile: guess, as without one
            log.exception("program headers for %s", build_id)
            return None

    # -- cache events --------------------------------------------------------------------------
    def _on_committed(self, scope: str, key: ArtifactKey, req: RequestScope | None) -> None:
        """Pre-extract as soon as an ELF artifact is cached, off the request path. A file
        committed while a table is under way is judged again once that is done: a debug file
        after a table from the executable (committed a moment before: an upload of both, a
        prefetch), so that its lines are not lost to the executable's bare symbols; an
        executable after a debug file's table built without it, which would otherwise wait
        for the miss TTL to be built with it. `req`: the request whose fetch brought it, whose
        sources fetch the supplementary file of a dwz'd debug file (a debugger's, a
        prefetch's: a site about to be cut off needs it too)."""
        if not key.kind.is_elf or not self._enabled:
            return
        pending = self._resolving.get((scope, key.build_id))
        if pending is None:
            started = self._track((scope, key.build_id), self._prebuild(scope, key, req))
        else:
            started = self._track((scope, key.build_id),
                                  self._prebuild_after(pending, scope, key, req))
        started.add_done_callback(_passing_trouble_told)

    async def _prebuild_after(self, pending: asyncio.Future[_Found], scope: str,
                              key: ArtifactKey, req: RequestScope | None) -> _Found:
        await asyncio.wait([pending])
        return await self._prebuild(scope, key, req)

    async def _prebuild(self, scope: str, key: ArtifactKey, req: RequestScope | None = None
                        ) -> _Found:
        bid = key.build_id
        if (running := self._building.get((scope, bid))) is not None:
            await asyncio.wait([running])  # then judge what it built, below
        if scope != SHARED:
            # A tenant's file adds nothing where a shared table with lines exists already.
            shared = await self._tables.usable(SHARED, bid)
            if (shared is not None and shared.outcome == Outcome.OK
                    and not partial(shared.source_key)):
                return SHARED, self._open.get(SHARED, bid) or self._remember(shared)
        rec = await self._tables.here(scope, bid)  # another replica's build: from the bucket
        cached = self._artifacts.cache.peek(scope, key)
        if cached is None:
            return Outcome.NOT_FOUND
        exe_table = rec is not None and from_executable(rec.source_key)
        if (rec is None or rec.format != FORMAT or rec.outcome != Outcome.OK
                or (key.kind is Kind.DEBUGINFO and exe_table)):
            self._open.drop(scope, bid)
            if key.kind is Kind.DEBUGINFO:
                source = _debug_source(cached.path, key.id, scope, (scope, key),
                                       await self._cached_executable(scope, bid))
            else:
                source = _Source(cached.path, key.id, scope, (scope, key),
                                 (cached.path, (scope, key)))
            found = await self._with_supplement(req, source) \
                if key.kind is Kind.DEBUGINFO else source
            if found is None:
                return Outcome.NOT_FOUND  # its supplement not at hand: the first profile's
            return await self._build(bid, found)
        debug_id = ArtifactKey(bid, Kind.DEBUGINFO).id
        if key.kind is Kind.EXECUTABLE and not exe_table \
                and (debug := self._artifacts.cache.peek(scope, ArtifactKey(
                    bid, Kind.DEBUGINFO))) is not None \
                and built_from(rec.source_key) == debug_id \
                and (without_executable(rec.source_key)
                     or (rec.source_key == debug_id
                         and not await asyncio.to_thread(names_from_executable,
                                                         self._tables.path(scope, bid))
                         and bool(await asyncio.to_thread(exported_functions, cached.path,
                                                          bid)))):
            # The debug file's table was built before its executable came (a debugger fetched
            # the debug file alone, or the upstream published it later): built again, to name
            # exported functions by the stripped executable's .dynsym and translate by its
            # program headers, as a table built with it from the start does (a row of an
            # older version, unmarked, only where the executable changes names). Judged after
            # any resolution under way (_on_committed): one that fetched the executable itself
            # built with it, and is left be.
            self._open.drop(scope, bid)
            again = await self._with_supplement(req, _Source(
                debug.path, ArtifactKey(bid, Kind.DEBUGINFO).id, scope,
                (scope, ArtifactKey(bid, Kind.DEBUGINFO)), (cached.path, (scope, key))))
            if again is None:
                return scope, self._open.get(scope, bid) or self._remember(rec)
            return await self._build(bid, again)
        opened = self._open.get(scope, bid) or self._remember(rec)
        if key.kind is Kind.EXECUTABLE and rec.file_layout is None:
            layout = await asyncio.to_thread(layout_of_file, cached.path)
            if layout is not None and layout.has_file_layout:
                await self._tables.set_layout(scope, bid, layout.segments)
                opened.segments = layout.segments
                opened.layout_searched = True
        return scope, opened

    async def _cached_executable(self, scope: str, build_id: str
                                 ) -> tuple[Path, tuple[str, ArtifactKey] | None] | None:
        """The executable of `build_id` on local disk or in the cache, for a table of `scope`."""
        if (local := await self._local(find_executable, build_id)) is not None:
            return local, None
        key = ArtifactKey(build_id, Kind.EXECUTABLE)
        for exe_scope in dict.fromkeys((scope, SHARED)):
            if (cached := self._artifacts.cache.peek(exe_scope, key)) is not None:
                return cached.path, (exe_scope, key)
        return None

    async def unreadable(self, req: RequestScope, build_id: str, table: TableSpec) -> None:
        """The table the request was given for `build_id` (`table`) could not be read by a
        worker (damaged on disk): dropped, so that the next profile has it built (or brought
        from the bucket) again. Damaged again within UNREADABLE_AGAIN_S, it is recorded
        malformed instead, believed as long as a failed build is: a table that every build
        leaves unreadable must not cost a build per profile.

        Only while that very table is the one open: the report of a profile that read the
        damaged file beside another one, and came once that other one's report had dropped
        it and the next profile had built it again (or came second), took the new, sound
        table for unreadable again, and recorded it malformed for malformed_retry_s. A table
        no longer open here is passed over too: the next profile given it reads it again."""
        for scope in req.visible:
            rec = await self._tables.get(scope, build_id)
            opened = self._open.get(scope, build_id)  # after the query: what is open now
            if rec is None or rec.outcome != Outcome.OK or opened is None \
                    or opened.table is not table:
                continue
            self._open.drop(scope, build_id)
            now = time.monotonic()
            last = self._unreadable.get((scope, build_id))
            self._unreadable[(scope, build_id)] = now
            if last is not None and now - last < UNREADABLE_AGAIN_S:
                log.warning("symbol table for %s is unreadable again: recorded malformed",
                            build_id)
                await self._tables.record(scope, build_id, Outcome.MALFORMED, rec.source_key,
                                          None, "unreadable again after a new build")
            else:
                log.warning("symbol table for %s is unreadable: built again when next asked",
                            build_id)
                await self._tables.drop(scope, build_id)
            return

    async def _on_evicted(self, scope: str, key: ArtifactKey) -> None:
        try:
            await self._drop_built_from(scope, key)
        except DatabaseUnavailable:
            # Its table's row cannot be read: the table, file and row, stayed for good, a
            # table of no cached file (not under cache.max_bytes, never evicted again). Owed,
            # and dropped once the database answers.
            self._owe(scope, key)
            raise

    def _owe(self, scope: str, key: ArtifactKey) -> None:
        self._owed.pop((scope, key), None)
        self._owed[scope, key] = None
        while len(self._owed) > MAX_OWED_DROPS:
            del self._owed[next(iter(self._owed))]

    async def drop_owed(self) -> None:
        """Drop the tables of artifacts that left the cache while the database did not answer
        (_on_evicted), unless their files are cached again (by this process or another on the
        data dir), whose tables they are then. A job of every access_flush_s: while the
        database is still away it stops at the first that fails, quietly (each eviction said
        so), the rest owed still."""
        while self._owed:
            scope, key = next(iter(self._owed))
            try:
                if await self._artifacts.cache.get(scope, key, touch=False) is None:
                    await self._drop_built_from(scope, key)
            except DatabaseUnavailable:
                return
            self._owed.pop((scope, key), None)

    async def _drop_built_from(self, scope: str, key: ArtifactKey) -> None:
        """Drop the table of `key`'s build ID that was built from `key`'s file, if any.
        DatabaseUnavailable."""
        rec = await self._tables.get(scope, key.build_id)
        if rec is None and key.kind in (Kind.DEBUGINFO, Kind.EXECUTABLE):
            self._forget_rowless(scope, key.build_id)
            return
        # By the file it was built from, whatever it lacked: a table without its
        # supplementary file or executable is its debug file's too.
        if rec is not None and built_from(rec.source_key) == key.id:
            self._open.drop(scope, key.build_id)
            await self._tables.drop(scope, key.build_id)


    def _forget_rowless(self, scope: str, build_id: str) -> None:
        """A table whose row went with its file's: a `cache purge` made on another replica
        deleted every replica's rows, and this replica learns of it by the notice alone. Its
        copy here goes too, from memory and disk: profiles were otherwise named by the purged
        table for as long as it stayed open, and its file stayed for good. Not while a build
        of it is under way, here or in another process on the data dir (its row is still to
        be written)."""
        if (scope, build_id) in self._building:
            return
        lock = build_lock.try_acquire(self._tables.lock_path(scope, build_id))
        if lock is None:
            return
        try:
            self._open.drop(scope, build_id)
            self._tables.remove_file(scope, build_id)
        finally:
            lock.release()


class _ScopedProvider:
    """The resolver seen by one request: symbolize.pipeline.SymbolProvider."""

    def __init__(self, resolver: SymbolResolver, req: RequestScope) -> None:
        self._resolver = resolver
        self._req = req

    async def resolve(self, build_id: str, *, needs_layout: bool) -> Resolved:
        return await self._resolver.resolve(self._req, build_id, needs_layout)

    async def unreadable(self, build_id: str, table: TableSpec) -> None:
        await self._resolver.unreadable(self._req, build_id, table)


def _debug_source(path: Path, source_key: str, scope: str,
                  artifact: tuple[str, ArtifactKey] | None, executable: _Beside | None
                  ) -> _Source:
    """A debug file as a table's source. Without its executable (not had, or not asked for:
    a debugger fetched the debug file alone), the table may name exported functions otherwise
    than one built with it, as a fresh server builds it, and lacks its program headers: marked
    (WITHOUT_EXECUTABLE), it is asked about again after the miss TTL, and built again once the
    executable is had."""
    source = _Source(path, source_key, scope, artifact, executable)
    if executable is None:
        source.source_key += WITHOUT_EXECUTABLE
    return source


def _built_from(rec: SymbolTableRecord, source: _Source) -> bool:
    """Whether the table (or failed build) `rec` was made from `source`: a new build of it
    would make the same."""
    return rec.source_key == source.source_key and rec.scope == source.scope


def _unjudged(req: RequestScope, scope: str, lacking: bool) -> bool:
    """Whether a table of `scope` that lacks something (a table from the executable, or
    without its supplementary file or executable; a failed build), seen by `req`, was made
    without asking the request's sources for it: a shared one, seen by a tenant with sources
    of its own. Those are asked first, as the shared scope's remembered 404 does not answer
    that tenant either."""
    return lacking and scope == SHARED and req.scope != SHARED


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _failure_read(done: asyncio.Future[Any]) -> None:
    """Marks the failure of a future that nobody may await as read: else asyncio logs it as
    an ERROR with its traceback ("Task exception was never retrieved")."""
    if not done.cancelled():
        done.exception()


def _passing_trouble_told(done: asyncio.Future[_Found]) -> None:
    """A prebuild that met the server's passing trouble (a full disk, a lost worker) has
    nobody to refuse: it is told here, and the next profile that needs the table builds it."""
    if not done.cancelled() and (error := done.exception()) is not None:
        log.warning("symbol table prebuild not done: %s", error)
