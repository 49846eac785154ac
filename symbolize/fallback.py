"""Names for frames that cannot be symbolized, on request: `libfoo.so+0x1a2b`.

A location left without lines (no build ID, no debug info anywhere, a stripped file) is given
one line whose function is its mapping's file name and the address's offset in that file (an
ELF-relative address, in a mapping without a range, is taken as it is): the same across runs
and address-space layouts, so profiles aggregate by it. The mapping keeps
has_functions false, so a later pass (once debug info exists) still symbolizes it: such names
are recognised and taken away again before a rewrite (`strip`), and never stand in its way.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence

import numpy as np

from .pprof import varint
from .pprof.columns import location_columns
from .pprof.new_ids import NewIds
from .pprof.profile_pb2 import Location
from .pprof.profile_raw_pb2 import RawProfile
from .pprof.string_index import first_indices

_NAME = re.compile(r"(.+)\+0x[0-9a-f]+")
# Pages the kernel maps into every process: the same code at the same offsets each run.
_KERNEL_FILES = ("[vdso]", "[vsyscall]")
_LINE = 0x22  # Location.line: field 4, length-delimited


def _module(profile: RawProfile, filename_index: int) -> str:
    """What a mapping's frames are named after: its file's base name, "" for memory that is
    no file (heap, stack, anonymous or JIT memory), whose offsets mean nothing across runs."""
    strings = profile.string_table
    name = strings[filename_index] if 0 < filename_index < len(strings) else ""
    if name in _KERNEL_FILES:
        return name
    if not name or name.startswith(("[", "//anon", "memfd:", "/memfd:")):
        return ""
    return posixpath.basename(name)


def _named_functions(profile: RawProfile) -> dict[int, str]:
    """Function id -> the module it names, for functions this module wrote."""
    strings = profile.string_table
    out: dict[int, str] = {}
    for f in profile.function:
        if not (0 < f.name < len(strings)) or f.system_name != f.name or f.filename:
            continue
        if m := _NAME.fullmatch(strings[f.name]):
            out[f.id] = m.group(1)
    return out


def _nameless_functions(profile: RawProfile) -> set[int]:
    """The ids of functions with neither a name nor a system name: what Go's runtime/pprof
    writes for a PC it could not symbolize (C code of a cgo program, libc), one line of a
    function named "" at line 0, where other profilers write no line at all."""
    strings = profile.string_table
    return {f.id for f in profile.function
            if not (0 < f.name < len(strings) and strings[f.name])
            and not (0 < f.system_name < len(strings) and strings[f.system_name])}


def names_no_symbol(strings: Sequence[str], name: int, system_name: int, filename: int
                    ) -> bool:
    """Whether a function, by its string indices, is one this module wrote or one that names
    nothing (Go's): a line of it is none that `strip` keeps, where it is of its mapping's
    module. For tables other than a pprof profile's (OTLP's), which must tell such lines too."""
    def text(i: int) -> str:
        return strings[i] if 0 < i < len(strings) else ""

    if not text(name) and not text(system_name):
        return True
    return system_name == name and not filename and _NAME.fullmatch(text(name)) is not None


def strip(profile: RawProfile, mapping_ids: Iterable[int]) -> int:
    """Take the names this module gave back, and lines that name no function (Go's), off the
    locations of these mappings (which are about to be symbolized), so that the rewrite sees
    them as the locations without lines they are. The locations stripped."""
    ids = set(mapping_ids)
    unsymbolized = {m.id: _module(profile, m.filename) for m in profile.mapping
                    if m.id in ids and not m.has_functions}
    if not unsymbolized or not profile.function:
        return 0
    named = _named_functions(profile)
    nameless = _nameless_functions(profile)
    if not named and not nameless:
        return 0
    encoded = list(profile.location)
    columns = location_columns(encoded)
    candidates = np.flatnonzero(columns.has_lines & np.isin(
        columns.mapping_id, np.array(list(unsymbolized), dtype=np.uint64)))
    stripped = 0
    for i in candidates.tolist():
        loc = Location.FromString(encoded[i])
        module = unsymbolized[loc.mapping_id]
        if loc.line and all(ln.function_id in nameless
                            or (module and named.get(ln.function_id) == module)
                            for ln in loc.line):
            loc.ClearField("line")
            encoded[i] = loc.SerializeToString()
            stripped += 1
    if stripped:
        _replace(profile, encoded)
    return stripped


def fill(profile: RawProfile) -> int:
    """Give every location without lines, of a mapping without functions that names a file,
    its `module+0xoffset` function. The locations named."""
    modules = {m.id: (_module(profile, m.filename), m) for m in profile.mapping
               if not m.has_functions}
    modules = {mid: v for mid, v in modules.items() if v[0]}
    if not modules:
        return 0
    encoded = list(profile.location)
    columns = location_columns(encoded)
    ours = np.isin(columns.mapping_id, np.array(list(modules), dtype=np.uint64))
    blank = ~columns.has_lines
    # Go's lines that name no function are no lines: such a location is named as well, in
    # their stead.
    bare: dict[int, bytes] = {}
    if nameless := _nameless_functions(profile):
        for i in np.flatnonzero(columns.has_lines & ours).tolist():
            loc = Location.FromString(encoded[i])
            if all(ln.function_id in nameless for ln in loc.line):
                loc.ClearField("line")
                bare[i] = loc.SerializeToString()
                blank[i] = True
    wanted = np.flatnonzero(blank & ours)
    if not len(wanted):
        return 0
    names: list[tuple[int, str]] = []
    for i, mid, address in zip(wanted.tolist(), columns.mapping_id[wanted].tolist(),
                               columns.address[wanted].tolist(), strict=True):
        module, m = modules[mid]
        # As translate.py reads a mapping: no limit, no range (ELF-relative addresses).
        if m.memory_limit and not m.memory_start <= address < m.memory_limit:
            continue  # not in its mapping (or the range is inverted): no offset to name it by
        offset = address - m.memory_start + m.file_offset
        if not 0 <= offset < 1 << 64:
            continue  # below the file's start (no limit to say so) or past any file's end
        names.append((i, f"{module}+0x{offset:x}"))
    ids = _function_ids(profile, (name for _i, name in names))
    for i, name in names:
        line = varint.encode_one(1 << 3) + varint.encode_one(ids[name])  # Line.function_id
        encoded[i] = bare.get(i, encoded[i]) + bytes([_LINE]) + varint.encode_one(len(line)) \
            + line
    if names:
        _replace(profile, encoded)
    return len(names)


def _function_ids(profile: RawProfile, names: Iterable[str]) -> dict[str, int]:
    """A Function for each name (name and system_name alike, no file), the profile's own where
    it has one already (a profile named before), else new ones (NewIds), numbered and their
    strings appended in the order of the names, as the rewrite numbers its functions: never
    in the order of the locations, which another profiler may write otherwise."""
    strings = profile.string_table
    if not strings:
        strings.append("")
    distinct = dict.fromkeys(sorted(set(names)))
    index = first_indices(strings, distinct.keys())
    own = {(f.name, f.system_name, f.filename): f.id for f in profile.function}
    ids: dict[str, int] = {}
    new: list[tuple[str, int]] = []
    for name in distinct:
        if name not in index:
            index[name] = len(strings)
            strings.append(name)
        key = (index[name], index[name], 0)
        if key in own:
            ids[name] = own[key]
        else:
            new.append((name, index[name]))
    # In one take: ids past the top are searched for once, not once a name.
    taken = NewIds(f.id for f in profile.function).take(len(new)).tolist()
    for (name, at), function_id in zip(new, taken, strict=True):
        profile.function.add(id=function_id, name=at, system_name=at)
        ids[name] = function_id
    return ids


def _replace(profile: RawProfile, encoded: list[bytes]) -> None:
    del profile.location[:]
    profile.location.extend(encoded)
