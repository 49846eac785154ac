"""Issue 14 (3): `Line.column`, where the DWARF line table has columns (gcc emits them by
default, and Debian's libc6-dbg has them), as llvm-symbolizer reports the innermost frame's:
from the line row of the address. symbolic's SymCache drops columns and merges rows that
differ only in theirs; the table keeps the rows' columns beside it."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest

from symbolize.chains import FunctionIds
from symbolize.dwarf import read_functions
from symbolize.elf import build_id_of_file, function_symbols, layout_of_file
from symbolize.pprof.profile_pb2 import Profile
from symbolize.rewrite import MappingSymbols
from symbolize.symtab import build_symbol_table
from tests.elfs import Elf, ElfSet
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.profiles import code_addresses
from tests.rewriting import open_table, run_rewrite


def llvm_columns(executable: Path, vaddrs: list[int]) -> dict[int, list[int]]:
    """llvm-symbolizer's Column per frame (innermost first), run on the executable (it finds
    the debug file by build ID or .gnu_debuglink); unresolved addresses left out."""
    out = subprocess.run(["llvm-symbolizer", f"--obj={executable}", "--inlining",
                          "--output-style=JSON"], input="\n".join(hex(v) for v in vaddrs),
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        if line.strip():
            answer = json.loads(line)
            frames = answer["Symbol"]
            if frames and frames[0]["FunctionName"] not in ("", "??"):
                found[int(answer["Address"], 16)] = [int(f["Column"]) for f in frames]
    return found


def symgate_columns(debug: Path, build_id: str, vaddrs: list[int], work: Path
                    ) -> dict[int, list[int]]:
    """symgate's Line.column per frame of each ELF-relative address, innermost first."""
    built = build_symbol_table(debug, work / f"{build_id}.symc", build_id)
    ids = FunctionIds()
    p = Profile()
    p.string_table.extend(["", "binary", build_id])
    p.mapping.add(id=1, filename=1, build_id=2)
    for i, v in enumerate(vaddrs, start=1):
        p.location.add(id=i, mapping_id=1, address=v)
    table = open_table(work / f"{build_id}.symc", built, ids)
    out = run_rewrite(p.SerializeToString(), {build_id: MappingSymbols(table, ())}, ids)[0]
    return {loc.address: [ln.column for ln in loc.line] for loc in out.location}


def _compare(got: dict[int, list[int]], want: dict[int, list[int]]) -> int:
    """How many innermost columns llvm-symbolizer gives that are not 0, after checking
    symgate's are the same everywhere, and that the frames it is inlined into have none (their
    DW_AT_call_column is not read)."""
    wrong = [(hex(v), got.get(v), w) for v, w in want.items()
             if not got.get(v) or got[v][0] != w[0] or any(got[v][1:])]
    assert not wrong, (len(wrong), wrong[:5])
    return sum(1 for w in want.values() if w[0])


def test_gcc_fixtures_columns_are_llvm_symbolizers(elfs: ElfSet, tmp_path: Path) -> None:
    with_columns = 0
    for elf in (elfs.prog, elfs.nopie, elfs.shlib, elfs.cpp):
        vaddrs = code_addresses(elf)
        want = llvm_columns(elf.executable, vaddrs)
        assert len(want) > 20
        with_columns += _compare(symgate_columns(elf.debug, elf.build_id, vaddrs, tmp_path),
                                 want)
    assert with_columns > 100  # gcc writes columns: the test has work to do


def test_libc_columns_are_llvm_symbolizers(tmp_path: Path) -> None:
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    vaddrs = random.Random(3).sample(range(text.vaddr, text.vaddr + text.filesz), 3000)
    want = llvm_columns(LIBC, vaddrs)
    assert len(want) > 2500
    assert _compare(symgate_columns(LIBC_DEBUG, LIBC_ID, vaddrs, tmp_path), want) > 2000


# main's last line sequence ends in landing pads that jump to main.cold, its last row at its
# end address; crt1's _start, without DWARF, follows.
LANDING_PADS_CPP = r"""
#include <cstdio>
#include <functional>
#include <map>
#include <string>
static int __attribute__((noinline)) call_twice(const std::function<int(int)> &f, int x) {
    return f(x) + f(x + 1);
}
int main(int argc, char **) {
    std::map<std::string, int> m;
    for (int i = 0; i < argc * 10; i++) m[std::to_string(i)] = i;
    int k = argc;
    auto lam = [&k](int x) { return x * k; };
    std::printf("%d %zu\n", call_twice(lam, argc), m.size());
    return 0;
}
"""


def test_code_without_dwarf_after_a_line_sequence_has_no_column(tmp_path: Path) -> None:
    """llvm-symbolizer gives code that no line row covers no column. GCC may end a line
    sequence with a row at its end address, which libdw sorts after the end of the sequence:
    its column ran on into the code after. `_start` (crt1's, no DWARF) had column 19 of
    main's last row."""
    (tmp_path / "main.cpp").write_text(LANDING_PADS_CPP)
    exe = tmp_path / "prog"
    subprocess.run(["g++", "-O2", "-g", "-Wl,--build-id", "main.cpp", "-o", "prog"],
                   cwd=tmp_path, check=True, capture_output=True)
    build_id = build_id_of_file(exe)
    assert build_id
    start = next(s.value for s in function_symbols(exe) if s.name == "_start")
    dwarf = read_functions(exe, [start])
    at = np.searchsorted(dwarf.column_starts, start, side="right") - 1
    assert at >= 0 and dwarf.columns[at], "the compiler ended main's sequence otherwise"
    vaddrs = code_addresses(Elf("prog", build_id, exe, exe, ()))
    want = llvm_columns(exe, vaddrs)
    assert want[start] == [0]
    _compare(symgate_columns(exe, build_id, vaddrs, tmp_path), want)
