"""Symbol tables per build ID: found, built in worker processes, tracked in SQL, kept open.

A table is built from the best ELF file there is for the build ID: a debug file from the
configured local debug directories or from symgate's cache and upstreams, else the executable
(its .symtab/.dynsym). Builds start in the background as soon as a debuginfo or executable is
cached, and a table is dropped when the artifact it was built from is evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from proxy.artifacts.service import ArtifactService, Streaming
from proxy.errors import NotFound, SymgateError
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import SymbolizeMetrics
from proxy.sources.base import Source
from proxy.store.repository import Repository, SymbolTableRecord
from symbolize.chains import FunctionIds
from symbolize.debugdirs import find_debug_file, find_executable
from symbolize.elf import ElfLayout, LoadSegment, layout_of_file
from symbolize.rewrite import MappingSymbols
from symbolize.symtab import (
    FORMAT,
    BuildResult,
    MalformedObject,
    NoSymbols,
    SymbolTable,
    build_symbol_table,
    warm_up,
)

log = logging.getLogger(__name__)
_OPEN_TABLES = 512
# How long a failed build is believed: a file without symbols may be replaced upstream by one
# with them (like a 404, retried); a malformed file is retried after a day, as symbolicator does.
_RETRY = {"no_symbols": timedelta(minutes=10), "malformed": timedelta(days=1)}


@dataclass(frozen=True, slots=True)
class Outcome:
    """Symbols for a build ID, or the reason there are none (a Report reason)."""

    symbols: MappingSymbols | None
    reason: str = "ok"


@dataclass(slots=True)
class _Open:
    table: SymbolTable
    segments: tuple[LoadSegment, ...] | None  # None until an executable's layout is known


def _layout_json(segments: Sequence[LoadSegment]) -> str:
    return json.dumps([[s.offset, s.vaddr, s.filesz, s.memsz, s.executable] for s in segments])


def _layout_from_json(text: str) -> tuple[LoadSegment, ...]:
    return tuple(LoadSegment(int(o), int(v), int(f), int(m), bool(x))
                 for o, v, f, m, x in json.loads(text))


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in json.loads(text))


class SymbolService:
    def __init__(
        self, *, artifacts: ArtifactService, repo: Repository, root: Path,
        debug_dirs: Sequence[Path], workers: int, metrics: SymbolizeMetrics,
    ) -> None:
        self._artifacts = artifacts
        self._repo = repo
        self.root = root
        self._debug_dirs = tuple(debug_dirs)
        self._metrics = metrics
        # forkserver: never fork a process that runs an event loop and threads.
        self._workers = workers
        self._executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self.function_ids = FunctionIds()  # shared by every open table and every rewrite
        self._resolving: dict[str, asyncio.Future[Outcome]] = {}
        self._layouts: dict[str, asyncio.Future[tuple[LoadSegment, ...] | None]] = {}
        artifacts.committed.append(self._on_committed)
        artifacts.cache.evicted.append(self._on_evicted)

    async def start(self) -> None:
        """Start the worker processes, and have SQLAlchemy compile the symbol-table query,
        now rather than on the first cold profile (about 10 ms)."""
        for _ in range(self._workers):
            self._executor.submit(warm_up)
        await self._repo.get_symbol_table("")

    def path_for(self, build_id: str) -> Path:
        return self.root / build_id[:2] / f"{build_id}.symc"

    async def close(self) -> None:
        pending: list[asyncio.Future[Any]] = [*self._resolving.values(),
                                              *self._layouts.values()]
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- lookups -------------------------------------------------------------------------------
    async def symbols_for(
        self, build_id: str, *, needs_layout: bool, forwarded_for: str = "",
        upstreams: Sequence[Source] | None = None,
    ) -> Outcome:
        """The symbols of `build_id`; fetching and building them if need be (shared).

        Shielded as a whole: a request that gives up at its deadline leaves the table and the
        program headers to be found anyway, for the next profile.
        """
        return await asyncio.shield(
            self._symbols_for(build_id, needs_layout, forwarded_for, upstreams))

    async def _symbols_for(
        self, build_id: str, needs_layout: bool, forwarded_for: str,
        upstreams: Sequence[Source] | None,
    ) -> Outcome:
        opened = self._open.get(build_id)
        layout: asyncio.Future[tuple[LoadSegment, ...] | None] | None = None
        if opened is None:
            if needs_layout:  # looked for while the table is built, not after
                layout = self._executable_layout(build_id, forwarded_for, upstreams)
            future = self._resolving.get(build_id) or self._track(
                build_id, self._resolve(build_id, forwarded_for, upstreams))
            outcome = await future
            # Absent when the LRU of open tables let it go while others were being opened.
            if outcome.symbols is None or (opened := self._open.get(build_id)) is None:
                return outcome
        else:
            self._open.move_to_end(build_id)
            self._metrics.symtab_cache.labels("hit").inc()
        if needs_layout and opened.segments is None:
            found = await (layout or self._executable_layout(build_id, forwarded_for, upstreams))
            if opened.segments is None:
                if found is None:
                    self._metrics.layout_guesses.inc()
                opened.segments = found or opened.table.guessed_layout()
        return Outcome(MappingSymbols(opened.table, opened.segments or ()))

    def _track(
        self, build_id: str, work: Coroutine[object, object, Outcome]
    ) -> asyncio.Future[Outcome]:
        """Run `work` as the one resolution of `build_id` that every caller shares."""

        async def guarded() -> Outcome:
            try:
                return await work
            except Exception:  # one build ID's failure must not fail a whole profile
                log.exception("symbol table for %s failed", build_id)
                return Outcome(None, "error")

        future = asyncio.ensure_future(guarded())
        self._resolving[build_id] = future

        def done(f: asyncio.Future[Outcome]) -> None:
            if self._resolving.get(build_id) is f:
                del self._resolving[build_id]

        future.add_done_callback(done)
        return future

    async def _resolve(
        self, build_id: str, forwarded_for: str, upstreams: Sequence[Source] | None
    ) -> Outcome:
        try:
            rec = await self._repo.get_symbol_table(build_id)
            now = datetime.now(UTC)
            if rec is not None and rec.format == FORMAT:
                if rec.status == "ok" and self.path_for(build_id).exists():
                    self._metrics.symtab_cache.labels("hit").inc()
                    return self._remember(build_id, rec)
                if rec.status != "ok" and rec.retry_after and rec.retry_after > now:
                    return Outcome(None, rec.status)
            self._metrics.symtab_cache.labels("miss").inc()
            source = await self._find_source(build_id, forwarded_for, upstreams)
            if source is None:
                return Outcome(None, "not_found")
            return await self._build(build_id, *source)
        except NotFound:
            return Outcome(None, "not_found")
        except SymgateError as e:
            log.info("no symbols for %s: %s", build_id, e.reason)
            return Outcome(None, "upstream_error")

    def _remember(self, build_id: str, rec: SymbolTableRecord) -> Outcome:
        table = SymbolTable(self.path_for(build_id), rec.load_address,
                            _ranges(rec.code_ranges), _ranges(rec.cold_ranges), rec.has_lines,
                            self.function_ids)
        segments = _layout_from_json(rec.file_layout) if rec.file_layout else None
        self._open[build_id] = _Open(table, segments)
        self._open.move_to_end(build_id)
        while len(self._open) > _OPEN_TABLES:
            self._open.popitem(last=False)
        return Outcome(MappingSymbols(table, segments or ()))

    async def _find_source(
        self, build_id: str, forwarded_for: str, upstreams: Sequence[Source] | None
    ) -> tuple[Path, str, bool] | None:
        """(ELF file, key it came from, whether it is a cached artifact) of the best source."""
        local = find_debug_file(self._debug_dirs, build_id)
        if local is not None:
            return local, f"local:{local}", False
        for kind in (Kind.DEBUGINFO, Kind.EXECUTABLE):
            key = ArtifactKey(build_id, kind)
            try:
                path = await self._artifact_path(key, forwarded_for, upstreams)
            except NotFound:
                continue
            return path, key.id, True
        local_exe = find_executable(self._debug_dirs, build_id)
        return (local_exe, f"local:{local_exe}", False) if local_exe else None

    async def _artifact_path(
        self, key: ArtifactKey, forwarded_for: str, upstreams: Sequence[Source] | None
    ) -> Path:
        result = await self._artifacts.find(key, forwarded_for, upstreams=upstreams)
        if isinstance(result, Streaming):
            try:
                await result.flight.wait_finished()
            finally:
                result.reader.close()
            if result.flight.error is not None:
                raise result.flight.error
        cached = self._artifacts.cache.peek(key)
        if cached is None:
            raise NotFound(f"{key.id} left the cache before it could be read")
        return cached.path

    async def _build(self, build_id: str, source: Path, source_key: str, cached: bool
                     ) -> Outcome:
        loop = asyncio.get_running_loop()
        lease = (self._artifacts.cache.lease(ArtifactKey.from_id(source_key))
                 if cached else contextlib.nullcontext())
        status, error, result = "ok", None, None
        with lease:
            try:
                result = await loop.run_in_executor(
                    self._executor, build_symbol_table, source, self.path_for(build_id),
                    build_id)
            except NoSymbols as e:
                status, error = "no_symbols", str(e)
            except MalformedObject as e:
                status, error = "malformed", str(e)
        rec = self._record(build_id, status, source_key, result, error)
        await self._repo.put_symbol_table(rec)
        # Counted once recorded and open, so the metric never runs ahead of the table.
        self._metrics.symtab_builds.labels(status).inc()
        if result is None:
            log.info("symbol table for %s: %s (%s)", build_id, status, error)
            return Outcome(None, status)
        self._metrics.symtab_build_seconds.observe(result.seconds)
        log.info("symbol table for %s built from %s in %.3fs (%d bytes)", build_id,
                 source_key, result.seconds, result.size)
        return self._remember(build_id, rec)

    def _record(
        self, build_id: str, status: str, source_key: str, result: BuildResult | None,
        error: str | None,
    ) -> SymbolTableRecord:
        now = datetime.now(UTC)
        file_layout = (_layout_json(result.file_layout)
                       if result is not None and result.file_layout is not None else None)
        return SymbolTableRecord(
            build_id=build_id, status=status, format=FORMAT, source_key=source_key,
            size=result.size if result else 0,
            load_address=result.load_address if result else 0,
            code_ranges=json.dumps(result.code_ranges if result else []),
            cold_ranges=json.dumps(result.cold_ranges if result else []),
            has_lines=result.has_lines if result else False, file_layout=file_layout,
            error=error, built_at=now, build_seconds=result.seconds if result else 0.0,
            retry_after=now + _RETRY[status] if status in _RETRY else None,
        )

    def _executable_layout(
        self, build_id: str, forwarded_for: str, upstreams: Sequence[Source] | None,
    ) -> asyncio.Future[tuple[LoadSegment, ...] | None]:
        """The one search for the executable's program headers of `build_id` under way."""
        layout = self._layouts.get(build_id)
        if layout is None:
            layout = asyncio.ensure_future(
                self._find_executable_layout(build_id, forwarded_for, upstreams))
            self._layouts[build_id] = layout
            layout.add_done_callback(lambda _f: self._layouts.pop(build_id, None))
        return layout

    async def _find_executable_layout(
        self, build_id: str, forwarded_for: str, upstreams: Sequence[Source] | None,
    ) -> tuple[LoadSegment, ...] | None:
        """Program headers with real file offsets, from the executable; None if there are
        none to be had (the caller then guesses)."""
        try:
            layout: ElfLayout | None = None
            exe = find_executable(self._debug_dirs, build_id)
            if exe is None:
                with contextlib.suppress(SymgateError):
                    exe = await self._artifact_path(ArtifactKey(build_id, Kind.EXECUTABLE),
                                                    forwarded_for, upstreams)
            if exe is not None:
                layout = await asyncio.to_thread(layout_of_file, exe)
            if layout is None or not layout.has_file_layout or layout.build_id != build_id:
                return None
            await self._repo.set_file_layout(build_id, _layout_json(layout.segments))
            return layout.segments
        except Exception:  # a failure here must not fail the profile: guess, as without one
            log.exception("program headers for %s", build_id)
            return None

    # -- cache events --------------------------------------------------------------------------
    def _on_committed(self, key: ArtifactKey) -> None:
        """Pre-extract as soon as an ELF artifact is cached, off the request path."""
        if key.kind.is_elf and key.build_id not in self._resolving:
            self._track(key.build_id, self._prebuild(key))

    async def _prebuild(self, key: ArtifactKey) -> Outcome:
        rec = await self._repo.get_symbol_table(key.build_id)
        cached = self._artifacts.cache.peek(key)
        if cached is None:
            return Outcome(None, "not_found")
        from_executable = rec is not None and rec.source_key.endswith("/executable")
        if (rec is None or rec.format != FORMAT or rec.status != "ok"
                or (key.kind is Kind.DEBUGINFO and from_executable)):
            self._open.pop(key.build_id, None)
            return await self._build(key.build_id, cached.path, key.id, True)
        if key.kind is Kind.EXECUTABLE and rec.file_layout is None:
            layout = await asyncio.to_thread(layout_of_file, cached.path)
            if layout is not None and layout.has_file_layout:
                await self._repo.set_file_layout(key.build_id, _layout_json(layout.segments))
                if (opened := self._open.get(key.build_id)) is not None:
                    opened.segments = layout.segments
        if key.build_id in self._open:
            opened = self._open[key.build_id]
            return Outcome(MappingSymbols(opened.table, opened.segments or ()))
        return self._remember(key.build_id, rec)

    async def _on_evicted(self, key: ArtifactKey) -> None:
        rec = await self._repo.get_symbol_table(key.build_id)
        if rec is not None and rec.source_key == key.id:
            self._open.pop(key.build_id, None)
            self.path_for(key.build_id).unlink(missing_ok=True)
            await self._repo.delete_symbol_tables([key.build_id])
