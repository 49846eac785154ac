"""Symbolizing one profile, as a pipeline: decode -> candidates -> which need program headers
-> ask a SymbolProvider for each build ID's table -> rewrite -> encode.

The server (proxy/symbols) and the offline CLI (offline.py) differ only in their provider:
where tables come from and how long they are kept. Everything a profile's answer depends on
is decided here, once, so the two give the same bytes for the same debug files.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .chains import FunctionIds
from .elf import LoadSegment
from .outcome import Outcome
from .pprof.codec import ProfileError, decode, encode
from .pprof.profile_raw_pb2 import RawProfile
from .rewrite import MappingSymbols, Report, candidates, rewrite
from .symtab import SymbolTable

log = logging.getLogger(__name__)


class TooManyBuildIds(ProfileError):
    """A well-formed profile asks for more build IDs than one request may fetch or build."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """A provider's answer for one build ID: its table, or the outcome that explains why not."""

    table: SymbolTable | None
    # Program headers with real file offsets (from the executable); None when none could be
    # had, and the pipeline guesses GNU ld's layout instead.
    segments: tuple[LoadSegment, ...] | None = None
    outcome: Outcome = Outcome.OK


class SymbolProvider(Protocol):
    @property
    def function_ids(self) -> FunctionIds:
        """Shared by every table the provider opens and every rewrite that uses them."""
        ...

    async def resolve(self, build_id: str, *, needs_layout: bool) -> Resolved:
        """The table of `build_id`, and its program headers when `needs_layout`.

        Never raises for a build ID's own failure: that is an outcome.
        """
        ...


@dataclass(frozen=True, slots=True)
class Limits:
    max_decompressed_bytes: int
    max_build_ids: int
    # Past this, the profile is answered with the tables that are ready; None: no limit.
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class Symbolized:
    body: bytes  # the request's own bytes when nothing was filled in
    report: Report
    layout_guesses: int  # build IDs whose program headers had to be guessed

    @property
    def changed(self) -> bool:
        return self.report.changed


async def symbolize_profile(body: bytes, provider: SymbolProvider, limits: Limits) -> Symbolized:
    """Raises ProfileError (ProfileTooLarge, TooManyBuildIds) for a profile it cannot take."""
    decoded = await asyncio.to_thread(decode, body, limits.max_decompressed_bytes)
    profile = decoded.profile
    report = Report()
    wanted = candidates(profile, report)
    layouts = _needs_layout(profile, wanted)
    if len(layouts) > limits.max_build_ids:
        raise TooManyBuildIds(f"profile has {len(layouts)} build IDs to symbolize; the limit is "
                              f"{limits.max_build_ids} per request")
    resolved = await _resolve_all(provider, layouts, limits.deadline_s)
    symbols: dict[str, MappingSymbols] = {}
    guesses = 0
    for bid, r in resolved.items():
        if r.table is None:
            continue
        segments = r.segments
        if segments is None:
            segments = r.table.guessed_layout() if layouts[bid] else ()
            guesses += layouts[bid]
        symbols[bid] = MappingSymbols(r.table, segments)
    for bid in wanted.values():
        if bid not in symbols:
            report.mappings_skipped[resolved[bid].outcome] += 1
    usable = {mid: bid for mid, bid in wanted.items() if bid in symbols}
    if usable:
        await asyncio.to_thread(rewrite, profile, usable, symbols, provider.function_ids, report)
    if not report.changed:
        return Symbolized(body, report, guesses)
    out = await asyncio.to_thread(encode, profile, decoded.gzipped)
    return Symbolized(out, report, guesses)


def _needs_layout(profile: RawProfile, wanted: Mapping[int, str]) -> dict[str, bool]:
    """Build ID -> whether some mapping of it has runtime addresses (not ELF-relative ones),
    which only the executable's program headers translate exactly."""
    needs = dict.fromkeys(wanted.values(), False)
    for m in profile.mapping:
        if m.id in wanted and (m.memory_start or m.file_offset):
            needs[wanted[m.id]] = True
    return needs


async def _resolve_all(provider: SymbolProvider, layouts: Mapping[str, bool],
                       deadline_s: float | None) -> dict[str, Resolved]:
    tasks = {bid: asyncio.ensure_future(provider.resolve(bid, needs_layout=needs))
             for bid, needs in sorted(layouts.items())}
    if tasks:
        await asyncio.wait(tasks.values(), timeout=deadline_s)
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
