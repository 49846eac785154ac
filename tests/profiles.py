"""pprof profiles over real ELF files placed at realistic load addresses, and what
llvm-symbolizer says those addresses are."""

from __future__ import annotations

import json
import re
import subprocess
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from symbolize.elf import LoadSegment, layout_of_file
from symbolize.pprof.profile_pb2 import Function, Location, Mapping, Profile, Sample, ValueType
from tests.elfs import Elf

PAGE = 0x1000


@dataclass(frozen=True)
class Placed:
    """The executable mapping of an ELF file in a process, as /proc/PID/maps would show it."""

    build_id: str
    filename: str
    memory_start: int
    memory_limit: int
    file_offset: int
    text: LoadSegment
    base: int  # what the loader added to every vaddr

    def runtime(self, vaddr: int) -> int:
        return self.base + vaddr


def place(elf: Elf, base: int) -> Placed:
    layout = layout_of_file(elf.executable)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    start = base + (text.vaddr & ~(PAGE - 1))
    limit = base + ((text.vaddr + text.memsz + PAGE - 1) & ~(PAGE - 1))
    return Placed(elf.build_id, str(elf.executable), start, limit, text.offset & ~(PAGE - 1),
                  text, base)


def code_addresses(elf: Elf) -> list[int]:
    """The address of every instruction in .text, from objdump."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text",
                          str(elf.executable)], capture_output=True, text=True, check=True).stdout
    return [int(m.group(1), 16) for m in re.finditer(r"^\s+([0-9a-f]+):", out, re.M)]


def make_profile(placed: list[tuple[Placed, list[int]]], *, has_functions: bool = False,
                 runtime: bool = True) -> Profile:
    """One mapping per Placed, one location and sample per address (vaddrs).

    With runtime=False, addresses are ELF-relative and the mapping range is left at zero, as the
    OpenTelemetry eBPF profiler sends them.
    """
    p = Profile()
    p.string_table.extend(["", "cpu", "nanoseconds", "thread", "main", "a comment"])
    p.sample_type.append(ValueType(type=1, unit=2))
    p.comment.append(5)
    loc_id = 0
    for mid, (pl, vaddrs) in enumerate(placed, start=1):
        p.string_table.extend([pl.filename, pl.build_id])
        n = len(p.string_table)
        if runtime:
            p.mapping.append(Mapping(id=mid, memory_start=pl.memory_start,
                                     memory_limit=pl.memory_limit, file_offset=pl.file_offset,
                                     filename=n - 2, build_id=n - 1,
                                     has_functions=has_functions))
        else:
            p.mapping.append(Mapping(id=mid, filename=n - 2, build_id=n - 1,
                                     has_functions=has_functions))
        for v in vaddrs:
            loc_id += 1
            p.location.append(Location(id=loc_id, mapping_id=mid,
                                       address=pl.runtime(v) if runtime else v))
            sample = Sample(location_id=[loc_id], value=[loc_id * 10])
            sample.label.add(key=3, str=4)
            p.sample.append(sample)
    return p


@dataclass(frozen=True)
class Expected:
    function: str
    system_name: str
    file: str
    line: int
    start_line: int = 0  # DW_AT_decl_line of the frame's function; 0: unknown


def llvm_symbolize(obj: Path, vaddrs: list[int], functions: str = "linkage"
                   ) -> dict[int, list[Expected]]:
    """llvm-symbolizer's frames per address (innermost first); unresolved addresses left out.

    `obj` is best the executable, as a profiler runs llvm-symbolizer on the mapped file: it
    finds the debug file by build ID (under /usr/lib/debug) or .gnu_debuglink, and names the
    outermost frame from the executable's own symbols (.dynsym for a stripped library). Run on
    a debug file, it names it from that file's full .symtab instead (`nanosleep`,
    `__libc_start_main@GLIBC_2.2.5`, `str_to_mpn.part.0.constprop.0`).
    functions="short" names every frame by its DWARF subprogram's DW_AT_name, never by the
    symbol table (which "linkage", the default, takes for the outermost frame).
    """
    def run(demangle: bool) -> list[dict[str, object]]:
        cmd = ["llvm-symbolizer", f"--obj={obj}", "--inlining", "--output-style=JSON",
               "--demangle" if demangle else "--no-demangle", f"--functions={functions}"]
        out = subprocess.run(cmd, input="\n".join(hex(v) for v in vaddrs), capture_output=True,
                             text=True, check=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    result: dict[int, list[Expected]] = {}
    for named, raw in zip(run(True), run(False), strict=True):
        frames = [
            Expected(str(a["FunctionName"]), str(b["FunctionName"]), str(a["FileName"]),
                     int(a["Line"]), int(a["StartLine"]))  # type: ignore[call-overload]
            for a, b in zip(named["Symbol"], raw["Symbol"], strict=True)  # type: ignore[call-overload]
        ]
        if frames and frames[0].function not in ("??", ""):
            result[int(str(named["Address"]), 16)] = frames
    return result


def frames_of(profile: Profile, location: Location) -> list[Expected]:
    s = profile.string_table
    functions = _functions_of(profile)
    return [Expected(s[functions[ln.function_id].name], s[functions[ln.function_id].system_name],
                     s[functions[ln.function_id].filename], ln.line,
                     functions[ln.function_id].start_line) for ln in location.line]


# The functions of the profiles frames_of read lately, by id: a test reads one profile's frames
# at thousands of addresses, and made this map of all its functions again at each (a static
# program's test spent 46% of its 13 s there). Each kept with the profile itself (its id is
# not reused while it is held) and its count of functions (a profile added to since is mapped
# again).
_FUNCTIONS: OrderedDict[int, tuple[Profile, int, dict[int, Function]]] = OrderedDict()


def _functions_of(profile: Profile) -> dict[int, Function]:
    known = _FUNCTIONS.get(id(profile))
    if known is not None and known[0] is profile and known[1] == len(profile.function):
        return known[2]
    functions = {f.id: f for f in profile.function}
    _FUNCTIONS[id(profile)] = (profile, len(profile.function), functions)
    while len(_FUNCTIONS) > 4:
        _FUNCTIONS.popitem(last=False)
    return functions


def symbol_aliases(elf_file: Path) -> dict[str, set[str]]:
    """Every .symtab name -> all names defined at the same address (weak aliases and the like),
    each also without the version .symtab appends to an old one (`glob@GLIBC_2.2.5`), as
    .dynsym names it."""
    out = subprocess.run(["nm", "--defined-only", str(elf_file)], capture_output=True,
                         text=True, check=True).stdout
    by_address: dict[int, set[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            by_address.setdefault(int(parts[0], 16), set()).update(
                {parts[2], parts[2].partition("@")[0]})
    aliases: dict[str, set[str]] = {}
    for names in by_address.values():
        for name in names:
            aliases.setdefault(name, set()).update(names)
    return aliases
