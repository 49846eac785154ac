"""What a symbol table adds to symbolic's SymCache: the names users expect, start lines, and
lines for code outside every subprogram. Chosen once, when the table is built, and kept in the
table file behind the SymCache's own bytes (symbolic reads only as far as its header says).

The name of a function with code: the DWARF subprogram's (demangled linkage name, or
DW_AT_name for C; the raw linkage name is the system name), but the name a shared library
exports it under where it hides the DWARF one (`getcwd` for `__getcwd`, as llvm-symbolizer
given the executable says); else the best of the symbol table's aliases at its entry: not an
internal one (glibc's `__GI_*` and `*_alias*` hidden names, GCC's `.cold` parts), global or
weak before local, the later listed of equals. symbolic takes the first alias listed,
`__GI___nanosleep` for what gdb calls `__nanosleep`.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .demangle import demangle
from .dwarf import DwarfFunctions
from .elf import FunctionSymbol, cold_part
from .symcache_columns import NONE, SymCacheColumns

# Behind the SymCache: the extras as JSON, the column rows (their u32 addresses, then their
# u16 columns), then the sizes of both, the SymCache's own length, and this mark.
_TRAILER = struct.Struct("<QQQ8s")
_MARK = b"SGXTRA02"
_INTERNAL = re.compile(r"^__GI_|_alias(?:_\d+)?$")


@dataclass(frozen=True, slots=True)
class OrphanRow:
    address: int  # relative to the load address, as SymCache addresses are
    file: str
    line: int


@dataclass
class TableExtras:
    # Function index -> (name, system name) for its frames (but an outermost one in a cold
    # part, named after the .cold symbol as llvm-symbolizer does).
    names: dict[int, tuple[str, str]] = field(default_factory=dict)
    start_lines: list[int] = field(default_factory=list)  # per function index; 0: unknown
    # Sorted [start, end) ranges of code outside every subprogram, and their rows (sorted;
    # a row with line 0 ends a sequence).
    orphan_ranges: list[tuple[int, int]] = field(default_factory=list)
    orphan_rows: list[OrphanRow] = field(default_factory=list)
    # The innermost frame's column at each address: that of the last of these (sorted,
    # relative) addresses at or below it; 0 where the line table has none.
    column_starts: npt.NDArray[np.uint32] = field(
        default_factory=lambda: np.zeros(0, np.uint32))
    columns: npt.NDArray[np.uint16] = field(default_factory=lambda: np.zeros(0, np.uint16))

    def start_line(self, function: int) -> int:
        return self.start_lines[function] if 0 <= function < len(self.start_lines) else 0


def choose(columns: SymCacheColumns, load_address: int, dwarf: DwarfFunctions,
           symbols: Sequence[FunctionSymbol]) -> TableExtras:
    """The extras of a SymCache, from the second DWARF reader and the symbol table."""
    aliases: dict[int, list[FunctionSymbol]] = {}
    for s in symbols:
        aliases.setdefault(s.value, []).append(s)
    extras = TableExtras(start_lines=[0] * columns.functions)
    entries = columns.function_entry.tolist()
    name_at = columns.function_name.tolist()
    for f, entry in enumerate(entries):
        own = columns.string(name_at[f]) if name_at[f] != NONE else ""
        if entry == NONE:  # known only inlined: symbolic's name is the DWARF linkage name
            extras.start_lines[f] = dwarf.decl_lines.get(own, 0)
            if (name := dwarf.names_by_linkage.get(own)) is not None and name != own:
                extras.names[f] = (name, own)
            continue
        address = entry + load_address
        sub = dwarf.by_entry.get(address)
        if sub is not None:
            extras.start_lines[f] = sub.decl_line
            system = sub.linkage_name or sub.name
            if system.startswith(("_Z", "_R")):
                if system == own:  # symbolic's name, demangled knowing the language
                    continue
                chosen = (demangle(system), system)
            else:
                chosen = (sub.name or system, system)
            exported = _exported(aliases.get(address, []))
            if exported and not {sub.name, system} & set(exported):
                # The library hides the DWARF name (`__getcwd`, `__pthread_create_2_1`) and
                # exports the function as `getcwd`, `pthread_create`: what its callers wrote,
                # and what llvm-symbolizer says given the executable (from its .dynsym).
                chosen = (demangle(exported[-1]), system)
        else:
            best = _best_alias(aliases.get(address, []))
            if best is None:
                continue
            chosen = (demangle(best.partition("@")[0]), best)
        if chosen != (demangle(own), own):
            extras.names[f] = chosen
    starts = sorted(dwarf.orphan_ranges)
    extras.orphan_ranges = [(a - load_address, b - load_address) for a, b in starts]
    extras.orphan_rows = [OrphanRow(r.address - load_address, r.file,
                                    0 if r.end_sequence else r.line)
                          for r in dwarf.orphan_rows]
    # SymCache addresses are u32 offsets from the load address: so are these.
    relative = dwarf.column_starts - np.uint64(load_address)
    kept = (dwarf.column_starts >= np.uint64(load_address)) & (relative <= np.uint64(NONE))
    extras.column_starts = relative[kept].astype(np.uint32)
    extras.columns = dwarf.columns[kept]
    return extras


def _best_alias(found: list[FunctionSymbol]) -> str | None:
    best, rank = None, (-1, -1)
    for s in found:  # the later listed of equals, as llvm-symbolizer takes
        here = (not (_INTERNAL.search(s.name) or cold_part(s.name)), s.bind != 0)
        if here >= rank:
            best, rank = s.name, here
    return best


def _exported(found: list[FunctionSymbol]) -> list[str]:
    """The names a shared library exports at one address, in .symtab's order, without the
    version that .symtab appends to an old one (`__libc_start_main@GLIBC_2.2.5`): .dynsym, which
    a detached debug file lacks, holds the global and weak symbols that are not internal."""
    return [s.name.partition("@")[0] for s in found
            if s.bind != 0 and not (_INTERNAL.search(s.name) or cold_part(s.name))]


def append_to(path: Path, extras: TableExtras) -> None:
    """Write `extras` behind the SymCache at `path`."""
    blob = json.dumps({
        "names": [[f, n, s] for f, (n, s) in sorted(extras.names.items())],
        "start_lines": extras.start_lines,
        "orphan_ranges": extras.orphan_ranges,
        "orphan_rows": [[r.address, r.file, r.line] for r in extras.orphan_rows],
    }, separators=(",", ":")).encode()
    rows = extras.column_starts.astype("<u4").tobytes() + extras.columns.astype("<u2").tobytes()
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(blob)
        f.write(rows)
        f.write(_TRAILER.pack(len(blob), len(rows), size, _MARK))


def read_from(path: Path) -> TableExtras | None:
    """The extras behind the SymCache at `path`; None for a table written without them."""
    with path.open("rb") as f:
        f.seek(0, 2)
        end = f.tell()
        if end < _TRAILER.size:
            return None
        f.seek(end - _TRAILER.size)
        blob_size, rows_size, _symcache_size, mark = _TRAILER.unpack(f.read(_TRAILER.size))
        if mark != _MARK or blob_size + rows_size > end - _TRAILER.size or rows_size % 6:
            return None
        f.seek(end - _TRAILER.size - rows_size - blob_size)
        raw = json.loads(f.read(blob_size))
        rows = f.read(rows_size)
    count = rows_size // 6
    return TableExtras(
        column_starts=np.frombuffer(rows, dtype="<u4", count=count).astype(np.uint32),
        columns=np.frombuffer(rows, dtype="<u2", offset=4 * count).astype(np.uint16),
        names={int(f): (n, s) for f, n, s in raw["names"]},
        start_lines=[int(x) for x in raw["start_lines"]],
        orphan_ranges=[(int(a), int(b)) for a, b in raw["orphan_ranges"]],
        orphan_rows=[OrphanRow(int(a), str(p), int(n)) for a, p, n in raw["orphan_rows"]],
    )
