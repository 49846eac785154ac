"""OpenTelemetry profiles (OTLP `profiles/v1development`) to and from what the pprof pipeline
consumes, so that an ExportProfilesServiceRequest is symbolized by the very same steps as a
pprof profile.

An OTLP request keeps its mappings, locations, functions and strings in one shared
ProfilesDictionary (entry 0 of each table is the empty one). Its mappings and locations become
those of a pprof profile with the same ids (the table indices) and its functions and strings
keep theirs, so that what the rewrite adds comes back as lines on the same locations, functions
appended to the function table and strings appended to the string table. Samples, stacks,
links, attributes and everything else never leave the request.

A mapping names its file's GNU build ID in the attribute `process.executable.build_id.gnu`.
The OpenTelemetry eBPF profiler reports native frames by ELF virtual address, while the
mapping's range is where the file was loaded; other producers send runtime addresses within
that range. A mapping whose every unsymbolized address lies in its range is read as runtime
addresses (translated through the program headers, as pprof's are); any other as ELF-relative.
Frames the profiler marks as not native (`profile.frame.type`: kernel, python, ...) are left
as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.profiles.v1development.profiles_pb2 import (
    KeyValueAndUnit,
    Location,
    ProfilesDictionary,
)

from . import fallback
from .pprof.codec import ProfileError, parsed
from .pprof.profile_pb2 import Profile

BUILD_ID_KEY = "process.executable.build_id.gnu"
FRAME_TYPE_KEY = "profile.frame.type"
NATIVE = "native"


class TooManyLocations(ProfileError):
    """A request whose dictionary has more locations than one request may have symbolized."""


@dataclass(frozen=True, slots=True)
class Converted:
    request: ExportProfilesServiceRequest
    pprof: bytes  # a pprof Profile of the dictionary's mappings, locations and functions


def decode(body: bytes, max_locations: int | None = None) -> Converted:
    """The request and its pprof counterpart; ProfileError for what is not an OTLP profiles
    request, TooManyLocations past `max_locations` (before any conversion work)."""
    if not body:
        raise ProfileError("empty body")
    try:
        request = parsed(ExportProfilesServiceRequest, body)
    except DecodeError as e:
        raise ProfileError(f"not an OTLP ExportProfilesServiceRequest: {e}") from e
    d = request.dictionary
    if max_locations is not None and len(d.location_table) > max_locations + 1:
        raise TooManyLocations(f"request has {len(d.location_table) - 1} locations; the limit "
                               f"is {max_locations} per request")
    return Converted(request, to_pprof(d).SerializeToString())


def pprof_of(body: bytes, max_locations: int | None = None) -> bytes:
    """decode's pprof counterpart of the request, alone: for a worker process, which gives
    back bytes, not the parsed request (pickled, it would be parsed again on arrival)."""
    return decode(body, max_locations).pprof


def filled(body: bytes, symbolized: bytes) -> bytes | None:
    """The request `body` with what the rewrite added to its pprof counterpart (from_pprof),
    as bytes; None where nothing was added (a fallback's names taken away and given again,
    still no debug info): the request as it came stands, not one with the pprof's build-ID
    strings appended."""
    request = parsed(ExportProfilesServiceRequest, body)
    if not from_pprof(request, symbolized):
        return None
    return request.SerializeToString()


def _attributes(d: ProfilesDictionary, key: str) -> dict[int, str]:
    """Attribute index -> string value, of the attributes named `key`."""
    strings = d.string_table
    return {i: a.value.string_value for i, a in enumerate(d.attribute_table)
            if _key(a, strings) == key and a.value.HasField("string_value")}


def _key(a: KeyValueAndUnit, strings: Sequence[str]) -> str:
    return strings[a.key_strindex] if 0 <= a.key_strindex < len(strings) else ""


def _string(strings: Sequence[str], index: int, what: str) -> int:
    if not 0 <= index < max(len(strings), 1):
        raise ProfileError(f"{what}: string index {index} out of range")
    return index


def to_pprof(d: ProfilesDictionary) -> Profile:
    strings = d.string_table
    if strings and strings[0] != "":
        raise ProfileError("not an OTLP profile: string_table[0] must be empty")
    build_ids = _attributes(d, BUILD_ID_KEY)
    not_native = {i for i, v in _attributes(d, FRAME_TYPE_KEY).items() if v != NATIVE}
    no_symbol = _no_symbol_functions(d)
    p = Profile()
    p.string_table.extend(strings or [""])
    mappings = len(d.mapping_table)
    functions = len(d.function_table)
    # Unsymbolized native locations, by mapping index: what a mapping's addresses look like.
    native: dict[int, list[int]] = {}
    for j, loc in enumerate(d.location_table):
        if not 0 <= loc.mapping_index < max(mappings, 1):
            raise ProfileError(f"location {j}: mapping index {loc.mapping_index} out of range")
        for ln in loc.lines:
            if not 0 <= ln.function_index < max(functions, 1):
                raise ProfileError(f"location {j}: function index {ln.function_index} "
                                   "out of range")
        # Lines of names a fallback gave (a request symbolized before its debug info
        # existed) are none: the mapping keeps has_functions false, as pprof's does, so
        # that a later pass strips those names and symbolizes the frame.
        if j and loc.mapping_index and _bare(loc, no_symbol) \
                and not not_native.intersection(loc.attribute_indices):
            native.setdefault(loc.mapping_index, []).append(loc.address)
    for i, m in enumerate(d.mapping_table):
        if not i:
            continue
        bid = next((build_ids[a] for a in m.attribute_indices if a in build_ids), "")
        build_id = 0
        if bid:
            build_id = len(p.string_table)
            p.string_table.append(bid)
        addresses = native.get(i, [])
        runtime = bool(m.memory_start) and bool(addresses) and all(
            m.memory_start <= a < m.memory_limit for a in addresses)
        # A mapping with no frame to fill in (only kernel frames, say, or all with lines) is
        # as good as symbolized: nothing is fetched for it.
        p.mapping.add(id=i, filename=_string(strings, m.filename_strindex, f"mapping {i}"),
                      build_id=build_id, has_functions=not addresses,
                      **({"memory_start": m.memory_start, "memory_limit": m.memory_limit,
                          "file_offset": m.file_offset} if runtime else {}))
    for j, loc in enumerate(d.location_table):
        if not j:
            continue
        # A frame the profiler says is not native is nobody's to symbolize: no mapping.
        mapping = 0 if not_native.intersection(loc.attribute_indices) else loc.mapping_index
        out = p.location.add(id=j, mapping_id=mapping, address=loc.address)
        for ln in loc.lines:
            if ln.function_index:  # entry 0, no function: a line of none (proto's zero value)
                out.line.add(function_id=ln.function_index, line=ln.line, column=ln.column)
    for i, f in enumerate(d.function_table):
        if i:
            p.function.add(id=i, name=_string(strings, f.name_strindex, f"function {i}"),
                           system_name=_string(strings, f.system_name_strindex,
                                               f"function {i}"),
                           filename=_string(strings, f.filename_strindex, f"function {i}"),
                           start_line=f.start_line)
    return p


def from_pprof(request: ExportProfilesServiceRequest, symbolized: bytes | memoryview
               ) -> int:
    """Put what the rewrite added to the pprof counterpart back into `request`: lines of the
    locations that had none (or only a fallback's names), the functions and strings they use.
    The locations filled."""
    p = Profile.FromString(bytes(symbolized))
    d = request.dictionary
    no_symbol = _no_symbol_functions(d)  # of the request as sent, before what is added
    known = len(d.string_table)
    if not known:
        d.string_table.append("")
        known = 1
    d.string_table.extend(p.string_table[known:])
    original = len(d.function_table)
    index: dict[int, int] = {}
    for f in p.function:
        if 0 < f.id < original:
            index[f.id] = f.id
            continue
        if not d.function_table:
            d.function_table.add()  # entry 0, the empty one
        index[f.id] = len(d.function_table)
        d.function_table.add(name_strindex=f.name, system_name_strindex=f.system_name,
                             filename_strindex=f.filename, start_line=f.start_line)
    filled = 0
    for loc in p.location:
        target = d.location_table[loc.id]
        if not loc.line or not _bare(target, no_symbol):
            continue
        lines = [(index[ln.function_id], ln.line, ln.column) for ln in loc.line]
        if lines != [(ln.function_index, ln.line, ln.column) for ln in target.lines]:
            del target.lines[:]
            for function_index, line, column in lines:
                target.lines.add(function_index=function_index, line=line, column=column)
            filled += 1
    return filled


def _no_symbol_functions(d: ProfilesDictionary) -> set[int]:
    """The functions whose lines are none: entry 0, the empty one (where a converter from
    pprof dedupes Go's nameless function to), and fallback.names_no_symbol's."""
    strings = d.string_table
    return {0} | {i for i, f in enumerate(d.function_table) if i and fallback.names_no_symbol(
        strings, f.name_strindex, f.system_name_strindex, f.filename_strindex)}


def _bare(loc: Location, no_symbol: set[int]) -> bool:
    """Whether a location is yet to be symbolized: no lines, or only lines that are none."""
    return all(ln.function_index in no_symbol for ln in loc.lines)
