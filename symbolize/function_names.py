"""What a symbol table adds to symbolic's SymCache: the names users expect, start lines, and
lines for code outside every subprogram. Chosen once, when the table is built, and kept in the
table file behind the SymCache's own bytes (symbolic reads only as far as its header says).

The name of a function with code: the DWARF subprogram's, as gdb, addr2line, eu-addr2line and
llvm-symbolizer name its frames: its linkage name, demangled (a C function's asm label as it
is: glibc's `__GI___regfree` for `__regfree`), else its DW_AT_name; the raw linkage name is the
system name. Without DWARF, the best of the symbol table's aliases at its entry: not an
internal one (glibc's `__GI_*` and `*_alias*` hidden names, GCC's `.cold` parts), global or
weak before local, the later listed of equals (symbolic takes the first listed).

Where the function is exported, the code from its entry on (the outermost frame, but in a
GCC `.cold` part) is named as llvm-symbolizer names it given the stripped executable: after
the executable's .dynsym symbol there, the largest, the last listed of equals (`select`, not
`__select`; `getcwd` where libc hides the DWARF name `__getcwd`). .dynsym's order is GNU hash
order, which only the executable carries: a detached debug file keeps the table's header but
not its contents. Without it, the DWARF name where it is exported, or the DW_AT_name where
that is (`__nanosleep`, not its label `__GI___nanosleep`), else, where .symtab has either
there but hidden, the last exported name that .symtab lists there (a DWARF name that is no
symbol is kept: Go's `runtime.mstart`, whose symbol is `runtime.mstart.abi0`). Inlined
frames keep the DWARF name, and so does a `.cold` part where .dynsym named the rest (no
.dynsym symbol covers it: llvm-symbolizer names it by DWARF too), even a .dynsym that exports
nothing (a stripped program's); without the stripped executable, or where no DWARF subprogram
knows the function, a `.cold` part is named after its `.cold` symbol, as llvm-symbolizer names
it by a .symtab (the debug file's, or an executable's that keeps one).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
_CLONE_SUFFIX = re.compile(r"(?:\.(?:isra|constprop|part)\.\d+)+$")


@dataclass(frozen=True, slots=True)
class OrphanRows:
    """Line rows of code outside every subprogram, sorted by address, as columns: libc has
    some 2,500, and an object each took 8 ms of every opening of its table."""

    address: npt.NDArray[np.uint64]  # relative to the load address, as SymCache addresses are
    file: tuple[str, ...]
    line: npt.NDArray[np.uint64]  # 0: the row ends a sequence

    def __len__(self) -> int:
        return len(self.address)

    @classmethod
    def of(cls, rows: Sequence[Sequence[object]]) -> OrphanRows:
        """From (address, file, line) rows; ValueError for rows that are not."""
        try:
            file = tuple(f for r in rows if type(f := r[1]) is str)
            address = np.array([r[0] for r in rows], dtype=np.uint64)
            line = np.array([r[2] for r in rows], dtype=np.uint64)
            if len(file) != len(rows) or any(len(r) != 3 for r in rows) \
                    or address.shape != (len(rows),) or line.shape != (len(rows),):
                raise ValueError("an orphan row is not (address, file, line)")
            return cls(address, file, line)
        except (TypeError, OverflowError, IndexError, KeyError) as e:  # not rows of three,
            raise ValueError(f"orphan rows: {e}") from e  # or a number out of range


def _no_rows() -> OrphanRows:
    return OrphanRows(np.zeros(0, np.uint64), (), np.zeros(0, np.uint64))


@dataclass
class TableExtras:
    # Function index -> (name, system name) for its frames; `dwarf_names` where an inlined
    # frame's and a cold part's differ (the outermost frame elsewhere is named after an
    # exported symbol).
    names: dict[int, tuple[str, str]] = field(default_factory=dict)
    dwarf_names: dict[int, tuple[str, str]] = field(default_factory=dict)
    # Whether the names were chosen with the executable at hand, and whether by its .dynsym
    # (a stripped one): then a `.cold` part is named after its function, else after itself.
    from_executable: bool = False
    from_dynsym: bool = False
    start_lines: list[int] = field(default_factory=list)  # per function index; 0: unknown
    # Where a function's name is declared at several lines (static functions of several
    # files), its start line by the file of its frame, where that file declares it once.
    start_lines_in: dict[int, dict[str, int]] = field(default_factory=dict)
    # Sorted [start, end) ranges of code outside every subprogram, and their rows (sorted;
    # a row with line 0 ends a sequence).
    orphan_ranges: list[tuple[int, int]] = field(default_factory=list)
    orphan_rows: OrphanRows = field(default_factory=_no_rows)
    # The innermost frame's column at each address: that of the last of these (sorted,
    # relative) addresses at or below it; 0 where the line table has none.
    column_starts: npt.NDArray[np.uint32] = field(
        default_factory=lambda: np.zeros(0, np.uint32))
    columns: npt.NDArray[np.uint16] = field(default_factory=lambda: np.zeros(0, np.uint16))

    def start_line(self, function: int, file: str) -> int:
        """The start line of a frame of `function` whose code is in `file`; 0: unknown."""
        line = self.start_lines[function] if 0 <= function < len(self.start_lines) else 0
        if not line and (by_file := self.start_lines_in.get(function)) is not None:
            return by_file.get(file, 0)
        return line

    def name(self, function: int, outermost_hot: bool) -> tuple[str, str] | None:
        """(name, system name) of a frame of `function`: the outermost one outside a `.cold`
        part, or another (inlined, or in a `.cold` part by .dynsym); None: symbolic's."""
        if outermost_hot:
            return self.names.get(function)
        return self.dwarf_names.get(function) or self.names.get(function)


def choose(columns: SymCacheColumns, load_address: int, dwarf: DwarfFunctions,
           symbols: Sequence[FunctionSymbol],
           exports: Sequence[FunctionSymbol] | None = None) -> TableExtras:
    """The extras of a SymCache, from the second DWARF reader and the symbol table, and the
    functions a stripped executable exports (.dynsym, in its order) when it is at hand."""
    aliases: dict[int, list[FunctionSymbol]] = {}
    for s in symbols:
        aliases.setdefault(s.value, []).append(s)
    # Where a C++ or Rust symbol is: the only places _mangled_alias can find one (none in a
    # C library's thousands of functions, each asked otherwise).
    mangled_at = {s.value for s in symbols if s.name.startswith(("_Z", "_R"))}
    picks = _dynsym_picks(exports) if exports is not None else None
    range_starts: dict[int, list[int]] = {}  # a subprogram's, by the object's id
    for start, subprogram in sorted(dwarf.by_entry.items()):
        range_starts.setdefault(id(subprogram), []).append(start)
    extras = TableExtras(start_lines=[0] * columns.functions, from_dynsym=picks is not None)
    ambiguous: dict[str, dict[str, int]] = {}
    for (declared, file), line in dwarf.decl_lines_in.items():
        ambiguous.setdefault(declared, {})[file] = line
    entries = columns.function_entry.tolist()
    name_at = columns.function_name.tolist()
    for f, entry in enumerate(entries):
        own = columns.string(name_at[f]) if name_at[f] != NONE else ""
        if entry == NONE:  # known only inlined: symbolic's name is the DWARF linkage name
            extras.start_lines[f] = dwarf.decl_lines.get(own, 0)
            if own in ambiguous:
                extras.start_lines_in[f] = ambiguous[own]
            continue
        address = entry + load_address
        # A legacy Rust name (`_ZN...17h<hash>E`) is Itanium-shaped: demangled as Rust only
        # when symbolic says the function is Rust's, as symtab.py demangles symbolic's own.
        lang = "rust" if columns.is_rust(f) else ""

        def demangle_as(name: str, lang: str = lang) -> str:
            return demangle(name, lang)

        sub = dwarf.by_entry.get(address)
        pick = None
        if picks is not None:  # a function split by GCC is exported at its hot part's start
            pick = next((picks[a] for a in range_starts.get(id(sub), [address]) if a in picks),
                        None)
        if sub is not None:
            extras.start_lines[f] = sub.decl_line
            # GCC gives a lambda's operator() and the members of a template instantiated
            # with a lambda or a local class no DW_AT_linkage_name: only `operator()`,
            # `_M_invoke` by DWARF, which would name every lambda of a program alike. The
            # symbol at its entry has the qualified name, which llvm-symbolizer gives too.
            system = sub.linkage_name or (
                _mangled_alias(aliases[address], sub.name) if address in mangled_at else None
            ) or sub.name
            mangled = system.startswith(("_Z", "_R"))
            # The linkage name, as gdb, addr2line, eu-addr2line and llvm-symbolizer all name
            # a subprogram: a C function's asm label too (glibc's `__GI___regfree`, for
            # `__regfree`, which the library's own code calls it by).
            by_dwarf = (demangle_as(system) if mangled else system, system)
            chosen = by_dwarf
            exported = _exported(aliases.get(address, []))
            if pick is not None:
                chosen = (demangle_as(pick), system)
            elif picks is None and exported and system not in exported:
                if sub.name in exported:  # `__nanosleep`, exported, not its `__GI_` label
                    chosen = (sub.name, system)
                elif {sub.name, system} & {s.name.partition("@")[0] for s in aliases[address]}:
                    # The library hides the DWARF name (`__getcwd`, `__pthread_create_2_1`:
                    # a local symbol there) and exports the function as `getcwd`,
                    # `pthread_create`: what its callers wrote, and what llvm-symbolizer says
                    # given the executable (from its .dynsym). A DWARF name that is no symbol
                    # at all is hidden by nothing: Go names an assembly function
                    # `runtime.mstart` in DWARF, as its runtime and its profiles do, and its
                    # linker `runtime.mstart.abi0`.
                    chosen = (demangle_as(exported[-1]), system)
            if mangled and system == own and chosen == by_dwarf:
                continue  # symbolic's name, demangled knowing the language
            if chosen != by_dwarf:
                extras.dwarf_names[f] = by_dwarf
        else:
            best = _best_alias(aliases.get(address, []))
            if pick is not None:
                chosen = (demangle_as(pick), best or pick)
            elif best is None:
                continue
            else:
                chosen = (demangle_as(best.partition("@")[0]), best)
                if picks is not None and cold_part(best) is not None:
                    # A `.cold` part only .symtab knows (a split-DWARF program's, without
                    # its .dwo files): llvm-symbolizer names it nothing given the stripped
                    # executable, eu-addr2line by the debug file's symbol, kept here as
                    # that, not renamed after its function as a DWARF function's is.
                    extras.names[f] = chosen
                    continue
        if chosen != (demangle_as(own), own):
            extras.names[f] = chosen
    starts = sorted(dwarf.orphan_ranges)
    extras.orphan_ranges = [(a - load_address, b - load_address) for a, b in starts]
    # Only rows a SymCache address (a u32 offset from the load address) can fall on.
    extras.orphan_rows = OrphanRows.of([(r.address - load_address, r.file,
                                         0 if r.end_sequence else r.line)
                                        for r in dwarf.orphan_rows
                                        if 0 <= r.address - load_address <= NONE])
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


def _mangled_alias(found: list[FunctionSymbol], name: str) -> str | None:
    """The C++ or Rust symbol among `found` whose demangled name holds the unqualified name
    `name` (a DW_AT_name: `operator()`, or `sort<...>` with GCC's spelling of the template's
    arguments, which the demangler's need not match), the best of several as _best_alias
    ranks them; None if none."""
    base = name.split("<", 1)[0]
    if not base:
        return None
    mangled = [s for s in found if s.name.startswith(("_Z", "_R")) and not cold_part(s.name)
               and base in demangle(s.name)]
    best = _best_alias(mangled)
    # A clone's suffix (`.isra.0`, `.constprop.0`) off: the name DWARF would have given it.
    return _CLONE_SUFFIX.sub("", best) if best is not None else None


def _dynsym_picks(exports: Sequence[FunctionSymbol]) -> dict[int, str]:
    """Address -> the exported symbol llvm-symbolizer names the code there after: of those
    starting there, the largest, the last in .dynsym of equals (it sorts by address and size,
    stably, and keeps the last of each address)."""
    picks: dict[int, tuple[int, str]] = {}
    for s in exports:
        held = picks.get(s.value)
        if held is None or s.size >= held[0]:
            picks[s.value] = (s.size, s.name)
    return {address: name for address, (_size, name) in picks.items()}


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
        "dwarf_names": [[f, n, s] for f, (n, s) in sorted(extras.dwarf_names.items())],
        "from_executable": extras.from_executable,
        "from_dynsym": extras.from_dynsym,
        "start_lines": extras.start_lines,
        "start_lines_in": [[f, by_file] for f, by_file in sorted(extras.start_lines_in.items())],
        "orphan_ranges": extras.orphan_ranges,
        "orphan_rows": [[a, f, n] for a, f, n in zip(
            extras.orphan_rows.address.tolist(), extras.orphan_rows.file,
            extras.orphan_rows.line.tolist(), strict=True)],
    }, separators=(",", ":")).encode()
    rows = extras.column_starts.astype("<u4").tobytes() + extras.columns.astype("<u2").tobytes()
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(blob)
        f.write(rows)
        f.write(_TRAILER.pack(len(blob), len(rows), size, _MARK))


def names_from_executable(path: Path) -> bool:
    """Whether the table at `path` was built with its executable's .dynsym at hand."""
    try:
        extras = read_from(path)
    except (OSError, ValueError):
        return False
    return extras is not None and extras.from_executable


def read_from(path: Path) -> TableExtras | None:
    """The extras behind the SymCache at `path`; None for a table written without them.
    ValueError where they are damaged."""
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
        blob = f.read(blob_size)
        rows = f.read(rows_size)
    count = rows_size // 6
    try:
        return _extras(json.loads(blob), rows, count)
    # JSON of another shape, a number past what int() or numpy take, or nested past the
    # parser's depth: damaged, whichever way.
    except (KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        raise ValueError(f"extras of another shape: {type(e).__name__}: {e}") from e


def _extras(raw: Any, rows: bytes, count: int) -> TableExtras:
    return TableExtras(
        column_starts=np.frombuffer(rows, dtype="<u4", count=count).astype(np.uint32),
        columns=np.frombuffer(rows, dtype="<u2", offset=4 * count).astype(np.uint16),
        names={int(f): (n, s) for f, n, s in raw["names"]},
        dwarf_names={int(f): (n, s) for f, n, s in raw.get("dwarf_names", [])},
        from_executable=bool(raw.get("from_executable", False)),
        from_dynsym=bool(raw.get("from_dynsym", False)),
        start_lines=[int(x) for x in raw["start_lines"]],
        start_lines_in={int(f): {str(file): int(n) for file, n in by_file.items()}
                        for f, by_file in raw.get("start_lines_in", [])},
        orphan_ranges=[(int(a), int(b)) for a, b in raw["orphan_ranges"]],
        orphan_rows=OrphanRows.of(raw["orphan_rows"]),
    )
