"""Issue 14, items 1-3: the names users expect, start lines, and lines that symbolic's SymCache
lacks, scored against llvm-symbolizer on the real libc (Debian's libc6-dbg)."""

from __future__ import annotations

import posixpath
import random
import re
import subprocess
from pathlib import Path

import pytest
from symbolic.symcache import SymCache

from symbolize.chains import FunctionIds
from symbolize.elf import layout_of_file
from symbolize.pprof.profile_pb2 import Profile
from symbolize.rewrite import MappingSymbols
from symbolize.symtab import BuildResult, build_symbol_table
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_functions
from tests.profiles import Expected, frames_of, llvm_symbolize
from tests.rewriting import open_table, run_rewrite

# GCC's clones: llvm-symbolizer names their code after the clone's symbol.
_CLONE = re.compile(r"\.(?:part|constprop|isra|cold)(?:\.\d+)?")


@pytest.fixture(scope="module")
def libc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildResult]:
    assert LIBC_ID
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    out = tmp_path_factory.mktemp("names") / "libc.symc"
    return out, build_symbol_table(LIBC_DEBUG, out, LIBC_ID)


def _symbolized(built: tuple[Path, BuildResult], vaddrs: list[int]) -> dict[int, list[Expected]]:
    """symgate's frames per ELF-relative address of libc."""
    ids = FunctionIds()
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID])
    p.mapping.add(id=1, filename=1, build_id=2)
    for i, v in enumerate(vaddrs, start=1):
        p.location.add(id=i, mapping_id=1, address=v)
    out = run_rewrite(p.SerializeToString(),
                      {LIBC_ID: MappingSymbols(open_table(built[0], built[1], ids), ())}, ids)[0]
    return {loc.address: frames_of(out, loc) for loc in out.location}


def _sample() -> list[int]:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    rng = random.Random(14)
    return sorted({*libc_functions(1500),
                   *rng.sample(range(text.vaddr, text.vaddr + text.filesz), 1500)})


def _symbols() -> dict[int, list[str]]:
    """Address -> the names .symtab defines there, in table order."""
    out = subprocess.run(["readelf", "-sW", str(LIBC_DEBUG)], capture_output=True, text=True,
                         check=True).stdout
    found: dict[int, list[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[3] in ("FUNC", "IFUNC"):
            found.setdefault(int(parts[1], 16), []).append(parts[7])
    return found


def _in_cold_part(built: BuildResult, v: int) -> bool:
    return any(a <= v < b for a, b in built.cold_ranges)


def test_outermost_frames_are_named_after_their_dwarf_subprogram(
        libc: tuple[Path, BuildResult]) -> None:
    """`__nanosleep` (its DW_AT_name, which gdb shows), not the first .symtab alias symbolic
    takes (`__GI___nanosleep`, kept as the system name: it is the DWARF linkage name)."""
    vaddrs = _sample()
    got = _symbolized(libc, vaddrs)
    dwarf = llvm_symbolize(LIBC_DEBUG, vaddrs, functions="short")
    compared, wrong = 0, []
    for v, want in dwarf.items():
        # A cold part is named after its .cold symbol, as llvm-symbolizer does; code without
        # a subprogram (assembly: no start line) after a symbol, as below.
        if _in_cold_part(libc[1], v) or not want[-1].start_line:
            continue
        compared += 1
        ours = got[v]
        if [f.function for f in ours] != [f.function for f in want]:
            wrong.append((hex(v), ours[-1], want[-1]))
    assert compared > 2000
    assert not wrong, (len(wrong), wrong[:5])
    at = next(a for a, names in _symbols().items() if "__GI___nanosleep" in names)
    assert [(f.function, f.system_name) for f in _symbolized(libc, [at + 4])[at + 4]] \
        == [("__nanosleep", "__GI___nanosleep")]


def test_names_differ_from_llvm_symbolizer_only_by_its_symtab_pick(
        libc: tuple[Path, BuildResult]) -> None:
    """llvm-symbolizer 14 names the outermost frame from .symtab: of the symbols at the
    function's address, the last listed (`nanosleep` over `__nanosleep`, `__GI_____strtof_l_
    internal` over `____strtof_l_internal`, `glob@@GLIBC_2.27`), or a GCC clone's own symbol
    (`str_to_mpn.part.0.constprop.0`). Every location where symgate's name is not llvm's is
    one of these: the same function under another of its symbols."""
    vaddrs = _sample()
    got = _symbolized(libc, vaddrs)
    llvm = llvm_symbolize(LIBC_DEBUG, vaddrs)
    symbols = _symbols()
    aliases = {name: set(names) for names in symbols.values() for name in names}
    exact, unexplained = 0, []
    for v, want in llvm.items():
        ours = got[v]
        if [f.function for f in ours] == [f.function for f in want]:
            exact += 1
            continue
        theirs = want[-1].system_name
        same_symbol = ours[-1].system_name in aliases.get(theirs, set()) \
            or ours[-1].function == want[-1].function
        clone = _CLONE.sub("", theirs) in (ours[-1].system_name, ours[-1].function)
        # Inlined frames: llvm-symbolizer prints their linkage name, symgate's system name.
        if [f.system_name for f in ours[:-1]] != [f.system_name for f in want[:-1]] \
                or not (same_symbol or clone):
            unexplained.append((hex(v), ours[-1], want[-1]))
    assert not unexplained, (len(unexplained), unexplained[:5])
    assert exact < len(llvm)  # glibc's aliases do make them differ: this test has work to do


def test_lines_of_code_outside_every_subprogram(libc: tuple[Path, BuildResult]) -> None:
    """Issue 14 (2): GCC gave these functions a DW_TAG_subprogram without DW_AT_low_pc, so
    no subprogram covers their code, while the CU's line table does. symbolic's SymCache
    has no line for them; llvm-symbolizer, reading the line table, has one."""
    starts = {name: address for address, names in _symbols().items() for name in names}
    names = ["mcheck_pedantic", "mtrace", "xdr_uint32_t@GLIBC_2.2.5", "x_putint32"]
    vaddrs = [starts[n] + k for n in names for k in (0, 4)]
    cache = SymCache.open(str(libc[0]))  # type: ignore[no-untyped-call]
    # The SymCache alone: no line.
    assert all(not any(loc.line for loc in cache.lookup(v)) for v in vaddrs)
    llvm = llvm_symbolize(LIBC_DEBUG, vaddrs)
    got = _symbolized(libc, vaddrs)
    assert len(llvm) >= len(names)  # mtrace is one byte long: its +4 is not in it
    for v, want in llvm.items():
        assert want[0].line
        # Paths as symbolic writes them (`.` and `..` resolved), as every other frame's are.
        assert (got[v][0].file, got[v][0].line) == (posixpath.normpath(want[0].file),
                                                    want[0].line), hex(v)


def test_every_line_llvm_symbolizer_has(libc: tuple[Path, BuildResult]) -> None:
    vaddrs = _sample()
    got = _symbolized(libc, vaddrs)
    llvm = llvm_symbolize(LIBC_DEBUG, vaddrs)
    missing = [hex(v) for v, want in llvm.items() if want[0].line and not got[v][0].line]
    assert not missing, (len(missing), missing[:5])


def test_start_lines_are_llvm_symbolizers(libc: tuple[Path, BuildResult]) -> None:
    """Issue 14 (3): Function.start_line is each frame's DW_AT_decl_line, inlined frames'
    included; 0 only where subprograms of one name declare different lines (static inline
    functions of several files) and symbolic's table does not say which."""
    vaddrs = _sample()
    got = _symbolized(libc, vaddrs)
    llvm = llvm_symbolize(LIBC_DEBUG, vaddrs)
    frames = wrong = unknown = 0
    for v, want in llvm.items():
        for ours, theirs in zip(got[v], want, strict=True):
            if not theirs.start_line:
                continue
            frames += 1
            if not ours.start_line:
                unknown += 1
            elif ours.start_line != theirs.start_line:
                wrong += 1
    assert frames > 3000
    assert wrong == 0
    assert unknown < frames // 50, (unknown, frames)
