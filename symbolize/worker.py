"""The CPU-bound steps of symbolizing a profile, as functions of bytes: decode and scan (which
build IDs to resolve), then decode, rewrite and encode with the tables the caller resolved.

The server runs them in worker processes, so that a big profile never holds its event loop
(and the GIL) away from /buildid; the offline CLI runs them in a thread. Either way they get
the request's bytes and tables by path, and give back bytes: nothing large crosses a process
boundary as Python objects. Each process keeps its own open tables and its own FunctionIds,
which every rewrite in that process shares.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from . import fallback
from .chains import FunctionIds
from .elf import LoadSegment
from .outcome import NAMED, Outcome
from .pprof import codec
from .pprof.codec import (
    Buffer,
    Decoded,
    ProfileError,
    Shape,
    as_bytes,
    check_tables,
    decode,
    encode,
    inflated,
    shape_of,
)
from .pprof.profile_raw_pb2 import RawProfile
from .rewrite import NO_LOCATIONS, MappingSymbols, Report, candidates, rewrite, sampled
from .symcache_columns import UnreadableSymCache
from .symtab import SymbolTable, TableSpec

log = logging.getLogger(__name__)


class TooManyBuildIds(ProfileError):
    """A well-formed profile asks for more build IDs than one request may fetch or build."""


class TooMuchWork(ProfileError):
    """A well-formed profile has more mappings, locations, functions or samples than one
    request may have symbolized: refused before any of the work is done."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_decompressed_bytes: int
    max_build_ids: int
    # Past this, the profile is answered with the tables that are ready; None: no limit.
    deadline_s: float | None = None
    # Per profile; None: no limit. Counted as the profile is decoded, before any rewrite.
    max_profile_mappings: int | None = None
    max_profile_locations: int | None = None
    max_profile_functions: int | None = None
    max_profile_samples: int | None = None
    # Name what stays unsymbolized `module+0xoffset` (symbolize.fallback).
    fallback: bool = False
    # What `scan` measured the profile to decode to (Scanned.size): `finish` inflates a
    # gzipped one once, to no more than that, without measuring it again, nor checking again
    # the string indices the scan checked.
    scanned_size: int | None = None
    # And how many of each table it has (Scanned.shape), for `check_samples`.
    scanned_shape: Shape | None = None
    # The profile came gzipped and is given to the steps inflated (pipeline.py): the answer
    # is gzipped as it came.
    gzip_answer: bool = False


@dataclass(frozen=True, slots=True)
class Scanned:
    """What `scan` found: the build IDs to resolve (widest mapping first), each with whether
    it needs the executable's program headers, and the size the profile decodes to."""

    layouts: dict[str, bool]
    size: int
    shape: Shape


@dataclass(frozen=True, slots=True)
class Answer:
    """What the caller found for one build ID: its table and the program headers to translate
    with ((): none needed), or the outcome that explains why there is no table."""

    table: TableSpec | None
    segments: tuple[LoadSegment, ...] = ()
    outcome: Outcome = Outcome.OK


@dataclass(frozen=True, slots=True)
class Finished:
    # None: nothing was filled in, and the request's own bytes stand. A view where the answer
    # is mapped from where a worker wrote it (proxy.symbols.shared_bodies).
    body: bytes | memoryview | None
    report: Report


def _decode(body: Buffer, limits: Limits) -> Decoded:
    if limits.scanned_size is not None:
        decoded = decode(body, limits.scanned_size, measured=True, checked=False)
    else:
        decoded = decode(body, limits.max_decompressed_bytes, checked=False)
    profile = decoded.profile
    # Samples and locations stay encoded in a RawProfile: counting them costs nothing, and the
    # rewrite, whose cost grows with them, has not started.
    for what, count, limit in (
            ("mappings", len(profile.mapping), limits.max_profile_mappings),
            ("locations", len(profile.location), limits.max_profile_locations),
            ("functions", len(profile.function), limits.max_profile_functions),
            ("samples", len(profile.sample), limits.max_profile_samples)):
        if limit is not None and count > limit:
            raise TooMuchWork(f"profile has {count} {what}; the limit is {limit} per request")
    # Checked after the counts: 3 million functions took 1.7 s of checks to be refused. Not
    # again by `finish` for the same bytes a scan has checked (Python, some 0.5 us a mapping
    # and a function). The samples are `check_samples`'s.
    if limits.scanned_size is None:
        check_tables(profile)
    return decoded


def _needs_layout(profile: RawProfile, wanted: dict[int, str]) -> dict[str, bool]:
    """Build ID -> whether some mapping of it has runtime addresses (not ELF-relative ones),
    which only the executable's program headers translate exactly.

    Ordered by the widest mapping of each, widest first (then by build ID): a cold profile's
    tables are resolved in this order, and its biggest build (libc's, 0.3 s, against a few ms
    for a small program's) must be the first to reach a build worker, not wait for a slot
    behind small ones that happened to sort before it.
    """
    needs = dict.fromkeys(wanted.values(), False)
    extent = dict.fromkeys(wanted.values(), 0)
    for m in profile.mapping:
        if m.id in wanted:
            bid = wanted[m.id]
            if m.memory_start or m.file_offset:
                needs[bid] = True
            if m.memory_limit > m.memory_start:
                extent[bid] = max(extent[bid], m.memory_limit - m.memory_start)
    return {bid: needs[bid] for bid in sorted(needs, key=lambda b: (-extent[b], b))}


def scan(body: Buffer, limits: Limits) -> Scanned:
    """The build IDs to resolve, each with whether it needs the executable's program headers.

    Raises ProfileError (ProfileTooLarge, TooMuchWork, TooManyBuildIds) for a profile it
    cannot take; its samples are left to `check_samples`.
    """
    decoded = _decode(body, limits)
    profile = decoded.profile
    layouts = _needs_layout(profile, sampled(profile, candidates(profile, Report())))
    if len(layouts) > limits.max_build_ids:
        raise TooManyBuildIds(f"profile has {len(layouts)} build IDs to symbolize; the limit is "
                              f"{limits.max_build_ids} per request")
    return Scanned(layouts, len(decoded.raw), shape_of(profile))


def check_samples(body: Buffer, limits: Limits) -> None:
    """Raise ProfileError where a sample, location or label set of the profile is not a valid
    message, or names what the profile does not have (codec.check_samples).

    The one check the scan leaves out, a step of its own: nothing the resolution does reads a
    sample, and a million of them and their locations take 80 to 200 ms to check, a tenth of
    a warm profile's time, which the pipeline spends beside them on another core.
    `limits.scanned_size` and `limits.scanned_shape` are the scan's."""
    _gzipped, raw = inflated(body, limits.scanned_size if limits.scanned_size is not None
                             else limits.max_decompressed_bytes,
                             measured=limits.scanned_size is not None)
    shape = limits.scanned_shape
    if shape is None:
        shape = shape_of(codec.parsed(RawProfile, as_bytes(raw)))  # as the scan's
    codec.check_samples(raw, shape)


class Workspace:
    """One process's open tables (least recently used closed first) and FunctionIds."""

    def __init__(self, open_tables: int) -> None:
        self._capacity = open_tables
        self.ids = FunctionIds()
        self._tables: OrderedDict[tuple[TableSpec, int, int, int], SymbolTable] = OrderedDict()

    def table(self, spec: TableSpec) -> SymbolTable:
        # A table rebuilt under the same path is another file: the inode and time tell.
        st = os.stat(spec.path)
        key = (spec, st.st_ino, st.st_mtime_ns, st.st_size)
        table = self._tables.get(key)
        if table is None:
            # The file it replaced is closed now, so that its disk space is freed.
            for stale in [k for k in self._tables if k[0].path == spec.path]:
                del self._tables[stale]
            table = self._tables[key] = SymbolTable.open(spec, self.ids)
            while len(self._tables) > self._capacity:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return table

    def finish(self, body: Buffer, limits: Limits, answers: dict[str, Answer]) -> Finished:
        """Rewrite the profile with the tables in `answers` (every build ID `scan` gave)."""
        decoded = _decode(body, limits)
        profile, gzipped = decoded.profile, decoded.gzipped
        report = Report()
        wanted = candidates(profile, report)
        symbols: dict[str, MappingSymbols] = {}
        outcomes = {bid: a.outcome for bid, a in answers.items()}
        for bid, a in answers.items():
            if a.table is None:
                continue
            try:
                symbols[bid] = MappingSymbols(self.table(a.table), a.segments)
            except FileNotFoundError:
                report.gone.add(bid)  # evicted since it was found: not damage
            except (OSError, UnreadableSymCache):  # damaged
                log.exception("symbol table of %s", bid)
                outcomes[bid] = Outcome.MALFORMED
                report.unreadable.add(bid)
        for bid in wanted.values():
            if bid not in symbols:
                # Not asked for, by the scan, where no location to fill in lies in it.
                report.mappings_skipped[outcomes.get(bid, NO_LOCATIONS)] += 1
        usable = {mid: bid for mid, bid in wanted.items() if bid in symbols}
        written: list[npt.NDArray[np.uint8]] = []
        if usable:
            # Names an earlier pass gave in their stead, and Go's lines of no function; the
            # encoding's locations are still the profile's where it took none.
            stripped = fallback.strip(profile, usable)
            # The fallback pass reads the locations back from the profile: only without it
            # are they kept apart, to be appended to its encoding.
            written = rewrite(profile, usable, symbols, self.ids, report,
                              None if stripped else decoded.raw,
                              locations_apart=not limits.fallback)
        if limits.fallback and (named := fallback.fill(profile)):
            report.locations_unresolved[NAMED] += named
        if not report.changed and not report.locations_unresolved[NAMED]:
            return Finished(None, report)
        return Finished(encode(profile, gzipped or limits.gzip_answer,
                               [fields.data for fields in written]), report)


# A worker process's own: set by `init_worker`.
_workspace: Workspace | None = None


def init_worker(open_tables: int) -> None:
    global _workspace
    _workspace = Workspace(open_tables)


def finish(body: Buffer, limits: Limits, answers: dict[str, Answer]) -> Finished:
    """`Workspace.finish` in a worker process started with `init_worker`."""
    if _workspace is None:
        raise RuntimeError("init_worker was not called in this process")
    return _workspace.finish(body, limits, answers)
