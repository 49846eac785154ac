"""Symbolizing one profile, as a pipeline: decode -> candidates -> which need program headers
-> ask a SymbolProvider for each build ID's table -> rewrite -> encode.

The server (proxy/symbols) and the offline CLI (offline.py) differ only in their provider
(where tables come from and how long they are kept) and in where the CPU-bound steps run
(`Work`: worker processes for the server, a thread offline). Everything a profile's answer
depends on is decided here and in worker.py, once, so the two give the same bytes for the
same debug files.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar, cast

from .elf import LoadSegment
from .outcome import Outcome, TryAgain
from .pprof.codec import GZIP_MAGIC, as_bytes, inflated
from .rewrite import Report
from .symtab import TableSpec
from .worker import (
    Answer,
    Finished,
    Limits,
    Scanned,
    TooManyBuildIds,
    TooMuchWork,
    Workspace,
    check_samples,
    scan,
)

__all__ = [
    "InThread",
    "Limits",
    "Resolved",
    "SymbolProvider",
    "Symbolized",
    "TablesGone",
    "TooManyBuildIds",
    "TooMuchWork",
    "Work",
    "symbolize_profile",
]
log = logging.getLogger(__name__)
T = TypeVar("T")


class TablesGone(TryAgain):
    """Tables a profile's rewrite was to read left the disk, again after they were built
    anew (evicted under a tight cache budget): the profile is refused, to be sent again."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """A provider's answer for one build ID: its table, or the outcome that explains why not."""

    table: TableSpec | None
    # Program headers with real file offsets (from the executable); None when none could be
    # had, and the pipeline guesses GNU ld's layout instead.
    segments: tuple[LoadSegment, ...] | None = None
    outcome: Outcome = Outcome.OK


class SymbolProvider(Protocol):
    async def resolve(self, build_id: str, *, needs_layout: bool) -> Resolved:
        """The table of `build_id`, and its program headers when `needs_layout`.

        Never raises for a build ID's own failure: that is an outcome. Raises TryAgain for
        the provider's own passing trouble, which refuses the whole profile.
        """
        ...

    async def unreadable(self, build_id: str, table: TableSpec) -> None:
        """The table given for `build_id`, `table`, could not be read (damaged on disk): not
        to be given again as it is."""
        ...


class Work(Protocol):
    """Where the CPU-bound steps (worker.scan, worker.check_samples, Workspace.finish) run."""

    async def scan(self, body: bytes, limits: Limits) -> Scanned: ...

    async def check_samples(self, body: bytes, limits: Limits) -> None: ...

    async def finish(self, body: bytes, limits: Limits,
                     answers: dict[str, Answer]) -> Finished: ...

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` where the steps run: a format's conversion to and from pprof."""
        ...


class InThread:
    """The steps in a thread of this process, with tables it opens itself: for the CLI."""

    def __init__(self, open_tables: int = 512) -> None:
        self._workspace = Workspace(open_tables)

    async def scan(self, body: bytes, limits: Limits) -> Scanned:
        return await asyncio.to_thread(scan, body, limits)

    async def check_samples(self, body: bytes, limits: Limits) -> None:
        await asyncio.to_thread(check_samples, body, limits)

    async def finish(self, body: bytes, limits: Limits,
                     answers: dict[str, Answer]) -> Finished:
        return await asyncio.to_thread(self._workspace.finish, body, limits, answers)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True, slots=True)
class Symbolized:
    body: bytes | memoryview  # the request's own bytes when nothing was filled in
    report: Report
    layout_guesses: int  # build IDs whose program headers had to be guessed

    @property
    def changed(self) -> bool:
        return self.report.changed


async def symbolize_profile(body: bytes, provider: SymbolProvider, limits: Limits,
                            work: Work | None = None) -> Symbolized:
    """Raises ProfileError (ProfileTooLarge, TooMuchWork, TooManyBuildIds) for a profile it
    cannot take."""
    work = work if work is not None else InThread()
    raw = body
    if body[:2] == GZIP_MAGIC:
        # Inflated once, here, rather than by each step (the scan measured and inflated it,
        # the check and the finish inflated it again): the steps share the raw bytes, and the
        # answer is gzipped as the profile came. In a thread: isal lets go of the GIL.
        _gzipped, inflated_body = await asyncio.to_thread(
            inflated, body, limits.max_decompressed_bytes)
        raw, limits = as_bytes(inflated_body), replace(limits, gzip_answer=True)
    scanned = await work.scan(raw, limits)
    measured = replace(limits, scanned_size=scanned.size, scanned_shape=scanned.shape)
    # Checked beside the resolution and the rewrite, which read no sample: on another core
    # where `work` has one. The first of the two to fail ends the other.
    checking = asyncio.ensure_future(work.check_samples(raw, measured))
    rest = asyncio.ensure_future(
        _resolve_and_finish(body, raw, provider, measured, scanned, work))
    try:
        # Until one fails, or both are done.
        await asyncio.wait((checking, rest), return_when=asyncio.FIRST_EXCEPTION)
        if checking.done():
            checking.result()  # raises for a corrupt sample: the profile is refused
        return rest.result()
    finally:
        for step in (checking, rest):
            step.cancel()  # a no-op for a step that has ended
        await asyncio.gather(checking, rest, return_exceptions=True)


async def _resolve_and_finish(body: bytes, raw: bytes, provider: SymbolProvider,
                              limits: Limits, scanned: Scanned, work: Work) -> Symbolized:
    """`body` the request's own bytes, answered where nothing is filled in; `raw` them
    inflated, which the steps read."""
    layouts = scanned.layouts
    wanted = dict(layouts)
    answers: dict[str, Answer] = {}
    guessed: set[str] = set()  # build IDs whose program headers had to be guessed
    # One deadline for the profile, a resolution made again (below) included.
    ends = None if limits.deadline_s is None else time.monotonic() + limits.deadline_s
    for _attempt in range(2):
        left = None if ends is None else max(0.0, ends - time.monotonic())
        resolved = await _resolve_all(provider, wanted, left)
        for bid, r in resolved.items():
            guessed.discard(bid)
            if r.table is None:
                answers[bid] = Answer(None, outcome=r.outcome)
                continue
            segments = r.segments
            if segments is None:
                segments = r.table.guessed_layout() if layouts[bid] else ()
                if layouts[bid]:
                    guessed.add(bid)
            answers[bid] = Answer(r.table, segments)
        done = await work.finish(raw, limits, answers)
        for bid in sorted(done.report.unreadable):
            given = answers[bid].table
            assert given is not None  # only a table given can be found unreadable
            await provider.unreadable(bid, given)
        if not done.report.gone:
            return Symbolized(done.body if done.body is not None else body, done.report,
                              len(guessed))
        # Tables evicted (with the files they were built from) since they were resolved: the
        # provider finds them gone and builds them again. Left bare, their mappings would
        # be in a 200 that a profiling backend keeps for good.
        wanted = {bid: layouts[bid] for bid in done.report.gone}
    raise TablesGone(f"symbol tables of {', '.join(sorted(done.report.gone))} left the disk "
                     "while the profile was rewritten; try again")


async def _resolve_all(provider: SymbolProvider, layouts: Mapping[str, bool],
                       deadline_s: float | None) -> dict[str, Resolved]:
    # In the scan's order (widest mapping first): the first to start is the first to build.
    tasks = {bid: asyncio.ensure_future(provider.resolve(bid, needs_layout=needs))
             for bid, needs in layouts.items()}
    if tasks:
        try:
            await asyncio.wait(tasks.values(), timeout=deadline_s)
        except asyncio.CancelledError:
            for task in tasks.values():
                task.cancel()  # a provider that shares its work lets it go on
            raise
    for task in tasks.values():
        if task.done() and isinstance(task.exception(), TryAgain):
            for other in tasks.values():
                other.cancel()  # a provider that shares its work lets it go on
            raise cast(TryAgain, task.exception())
    out: dict[str, Resolved] = {}
    for bid, task in tasks.items():
        if not task.done():
            task.cancel()  # a provider that shares its work lets it go on for the next profile
            out[bid] = Resolved(None, outcome=Outcome.DEADLINE)
        elif (error := task.exception()) is not None:  # one build ID, never the whole profile
            log.error("symbols for %s failed", bid, exc_info=error)
            out[bid] = Resolved(None, outcome=Outcome.INTERNAL)
        else:
            out[bid] = task.result()
    return out
