"""Rewriting a pprof profile: functions, files, lines and inline frames for native mappings.

Only mappings with has_functions == false and a build ID are touched. Everything else (other
mappings, samples, labels, comments, the existing string table entries and their order) is
left as it is; new strings and functions are appended.

The work is done in bulk, because a profile can have 100,000 locations and protobuf's message
objects cost about a microsecond each to touch from Python: the locations are read as columns
(columns.py), translated to ELF addresses with numpy (translate.py), looked up as encoded chains
(chains.py), and a symbolized location is its own bytes followed by its chain's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping as MappingT
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .buildid import InvalidBuildId, normalize_build_id
from .chains import Chains, FunctionIds
from .elf import LoadSegment
from .pprof.columns import location_columns
from .pprof.profile_pb2 import Function
from .pprof.profile_raw_pb2 import RawProfile
from .symtab import SymbolTable
from .translate import to_vaddrs


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


def candidates(profile: RawProfile, report: Report) -> dict[int, str]:
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


class _Functions:
    """The profile's Function entries for the chain function ids a rewrite used.

    An id becomes the profile's own Function where the profile has one with the same name,
    system name and file already, and is renumbered where the profile uses the id itself.
    """

    def __init__(self, profile: RawProfile, ids: FunctionIds) -> None:
        self._profile = profile
        self._ids = ids
        if not profile.string_table:
            profile.string_table.append("")
        self._strings: dict[str, int] = {}
        for i, s in enumerate(profile.string_table):
            self._strings.setdefault(s, i)
        self._own: dict[tuple[int, int, int, int], int] = {}
        table = profile.string_table
        for f in profile.function:  # by the strings, in case the table has one twice
            key = (self._strings[table[f.name]], self._strings[table[f.system_name]],
                   self._strings[table[f.filename]], f.start_line)
            self._own.setdefault(key, f.id)
        self._own_ids = {f.id for f in profile.function}

    def add(self, used: set[int]) -> dict[int, int]:
        """Add a Function for each id; return the ids that must be written as others."""
        remap: dict[int, int] = {}
        table = self._profile.string_table
        new_strings: list[str] = []
        strings = self._strings

        def string(s: str) -> int:
            index = strings.get(s)
            if index is None:
                index = strings[s] = len(table) + len(new_strings)
                new_strings.append(s)
            return index

        new_functions: list[Function] = []
        next_free = max(self._own_ids | used, default=0) + 1
        for fid in sorted(used):
            name, system_name, filename = self._ids.key_of(fid)
            key = (string(name), string(system_name), string(filename), 0)
            own = self._own.get(key)
            if own is None:
                own = fid
                if fid in self._own_ids:
                    own, next_free = next_free, next_free + 1
                new_functions.append(Function(id=own, name=key[0], system_name=key[1],
                                              filename=key[2]))
                self._own[key] = own
            if own != fid:
                remap[fid] = own
        table.extend(new_strings)
        self._profile.function.extend(new_functions)
        return remap


def rewrite(
    profile: RawProfile,
    mapping_ids: MappingT[int, str],
    symbols: MappingT[str, MappingSymbols],
    ids: FunctionIds,
    report: Report,
) -> None:
    """Fill in lines for the locations of `mapping_ids` whose build ID has `symbols`.

    Mutates `profile` and `report`. A mapping's has_* flags are set to what was filled in.
    Raises MalformedLocation for a location that is not a Location message.
    """
    with ids.session():
        _rewrite(profile, mapping_ids, symbols, ids, report)


def _rewrite(profile: RawProfile, mapping_ids: MappingT[int, str],
             symbols: MappingT[str, MappingSymbols], ids: FunctionIds, report: Report) -> None:
    by_id = {m.id: m for m in profile.mapping}
    usable = {mid: symbols[bid] for mid, bid in mapping_ids.items() if bid in symbols}
    if not usable:
        return
    columns = location_columns(profile.location)
    wanted = ~columns.has_lines
    found: dict[int, tuple[npt.NDArray[np.intp], Chains]] = {}  # mapping id -> where, chains
    for mid, sym in usable.items():
        m = by_id[mid]
        where = np.flatnonzero((columns.mapping_id == mid) & wanted)
        if not len(where):
            report.mappings_skipped["no_locations"] += 1
            continue
        vaddrs, ok = to_vaddrs(columns.address[where], memory_start=m.memory_start,
                               memory_limit=m.memory_limit, file_offset=m.file_offset,
                               segments=sym.segments)
        if outside := int(len(ok) - ok.sum()):
            report.locations_unresolved["outside_mapping"] += outside
        found[mid] = (where[ok], sym.table.chains(vaddrs[ok].tolist()))

    used: set[int] = set()
    for _where, chains in found.values():
        used |= chains.function_ids()
    remap = _Functions(profile, ids).add(used)

    # An object array: the new bytes of the symbolized locations are made in numpy's loop.
    locations = np.empty(len(profile.location), dtype=object)
    locations[:] = list(profile.location)
    for mid, (where, chains) in found.items():
        locations[where] += chains.encoded(remap)
        report.locations_symbolized += chains.symbolized
        if chains.unresolved:
            report.locations_unresolved["no_symbol"] += chains.unresolved
        m = by_id[mid]
        if chains.symbolized:
            report.mappings_symbolized += 1
            m.has_functions = True
            m.has_filenames = chains.has_filenames
            m.has_line_numbers = chains.has_line_numbers
            m.has_inline_frames = chains.has_inline_frames
        else:
            report.mappings_skipped["no_symbols"] += 1
    del profile.location[:]
    profile.location.extend(locations.tolist())
