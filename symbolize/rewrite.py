"""Rewriting a pprof profile: functions, files, lines and inline frames for native mappings.

Only mappings with has_functions == false and a build ID are touched. Everything else (other
mappings, samples, labels, comments, the existing string table entries and their order) is
left as it is; new strings and functions are appended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping as MappingT
from collections.abc import Sequence
from dataclasses import dataclass, field

from .buildid import InvalidBuildId, normalize_build_id
from .elf import LoadSegment
from .pprof.profile_pb2 import Function, Profile
from .symtab import Frame, SymbolTable
from .translate import to_vaddr


@dataclass(frozen=True, slots=True)
class MappingSymbols:
    """What the rewriter needs for one build ID."""

    table: SymbolTable
    # Program headers with real file offsets, for runtime-address translation.
    segments: Sequence[LoadSegment]


@dataclass
class Report:
    mappings_symbolized: int = 0
    mappings_skipped: Counter[str] = field(default_factory=Counter)  # reason -> count
    locations_symbolized: int = 0
    locations_unresolved: Counter[str] = field(default_factory=Counter)  # reason -> count

    @property
    def changed(self) -> bool:
        return self.locations_symbolized > 0


def candidates(profile: Profile, report: Report) -> dict[int, str]:
    """Mapping id -> normalised build ID of every mapping this rewrite would symbolize.

    Mappings passed over are counted in `report` with their reason.
    """
    strings = profile.string_table
    out: dict[int, str] = {}
    for m in profile.mapping:
        raw = strings[m.build_id] if m.build_id < len(strings) else ""
        if m.has_functions:
            report.mappings_skipped["has_functions"] += 1
        elif not raw:
            report.mappings_skipped["no_build_id"] += 1
        else:
            try:
                out[m.id] = normalize_build_id(raw)
            except InvalidBuildId:
                report.mappings_skipped["invalid_build_id"] += 1
    return out


class _Tables:
    """Interning of strings and functions, reusing what the profile already has."""

    def __init__(self, profile: Profile) -> None:
        self._profile = profile
        if not profile.string_table:
            profile.string_table.append("")
        self._strings: dict[str, int] = {}
        for i, s in enumerate(profile.string_table):
            self._strings.setdefault(s, i)
        self._functions: dict[tuple[int, int, int, int], int] = {}
        self._by_frame: dict[Frame, int] = {}
        self._next_id = 1
        for f in profile.function:
            self._functions.setdefault((f.name, f.system_name, f.filename, f.start_line), f.id)
            self._next_id = max(self._next_id, f.id + 1)

    def string(self, s: str) -> int:
        index = self._strings.get(s)
        if index is None:
            index = len(self._profile.string_table)
            self._profile.string_table.append(s)
            self._strings[s] = index
        return index

    def function_of(self, frame: Frame) -> int:
        """The Function id for a frame, interned (one dict lookup for a known frame)."""
        fid = self._by_frame.get(frame)
        if fid is None:
            fid = self._by_frame[frame] = self.function(frame.name, frame.system_name,
                                                        frame.filename)
        return fid

    def function(self, name: str, system_name: str, filename: str) -> int:
        key = (self.string(name), self.string(system_name), self.string(filename), 0)
        fid = self._functions.get(key)
        if fid is None:
            fid = self._next_id
            self._next_id += 1
            self._profile.function.append(
                Function(id=fid, name=key[0], system_name=key[1], filename=key[2])
            )
            self._functions[key] = fid
        return fid


def rewrite(
    profile: Profile,
    mapping_ids: MappingT[int, str],
    symbols: MappingT[str, MappingSymbols],
    report: Report,
) -> None:
    """Fill in lines for the locations of `mapping_ids` whose build ID has `symbols`.

    Mutates `profile` and `report`. A mapping's has_* flags are set to what was filled in.
    """
    by_id = {m.id: m for m in profile.mapping}
    usable = {mid: symbols[bid] for mid, bid in mapping_ids.items() if bid in symbols}
    tables = _Tables(profile)
    filled: dict[int, list[bool]] = {mid: [False, False, False, False] for mid in usable}
    tried: set[int] = set()
    for loc in profile.location:
        sym = usable.get(loc.mapping_id)
        if sym is None or loc.line:
            continue
        tried.add(loc.mapping_id)
        m = by_id[loc.mapping_id]
        vaddr = to_vaddr(loc.address, memory_start=m.memory_start, memory_limit=m.memory_limit,
                         file_offset=m.file_offset, segments=sym.segments)
        if vaddr is None:
            report.locations_unresolved["outside_mapping"] += 1
            continue
        frames = sym.table.lookup(vaddr)
        if not frames:
            report.locations_unresolved["no_symbol"] += 1
            continue
        out = loc.line
        for frame in frames:
            out.add(function_id=tables.function_of(frame), line=frame.line)
        flags = filled[loc.mapping_id]
        flags[0] = True
        flags[1] = flags[1] or any(f.filename for f in frames)
        flags[2] = flags[2] or any(f.line for f in frames)
        flags[3] = flags[3] or len(frames) > 1
        report.locations_symbolized += 1
    for mid, (functions, filenames, lines, inline) in filled.items():
        m = by_id[mid]
        if functions:
            report.mappings_symbolized += 1
            m.has_functions, m.has_filenames = True, filenames
            m.has_line_numbers, m.has_inline_frames = lines, inline
        else:  # symbols were there; either no location asked for them or none resolved
            report.mappings_skipped["no_symbols" if mid in tried else "no_locations"] += 1
