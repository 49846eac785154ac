"""Debug files that dwz gave a supplementary file, read whole with it.

`dwz -m` (Fedora's and RHEL's debug packages, Debian's and Ubuntu's of several programs) moves
the DWARF that a package's files share into one supplementary file, named by the debug file's
`.gnu_debugaltlink` with its build ID: the abstract instances of inline
functions, their names, the types. The debug file's own DIEs point there with
DW_FORM_GNU_ref_alt and DW_FORM_GNU_strp_alt, which symbolic does not follow. libdw does, once
told which file is the supplement (dwarf_setalt); so such a file is read here by libdw, and
what a SymCache holds (functions' address ranges and names, inline chains with their call
sites, the lines of the line tables within functions, and the symbol table's functions where
no DWARF function is) is written as Breakpad text, from which symbolic builds the SymCache.
The rest of the table (names users expect, start lines, columns) is read as for any file,
with the supplement (dwarf.read_functions). The same reading, with no supplement, serves GCC's
link-time-optimized DWARF 4, which symbolic misreads (symtab.build_symbol_table).

Breakpad keeps no language: a Rust function's legacy (`_ZN...17h<hash>E`) name is then
demangled as C++'s. DWARF 5's standard link, `.debug_sup` (`dwz -5`), is not followed: libdw
0.188 reads its DW_FORM_ref_sup4 references as nameless, which cuts inline chains
(eu-addr2line's too); such a file is named by its symbols alone.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from .breakpad import HEADER, one_line, write_symbols
from .dwarf import (
    DW_AT_COMP_DIR,
    DW_AT_LINKAGE_NAME,
    DW_AT_MIPS_LINKAGE_NAME,
    LIBDW,
    Die,
    DieAttributes,
    clean_path,
    opened,
    units,
)
from .elf import FunctionSymbol, build_id_of_file
from .elf_headers import SHF_COMPRESSED, read_headers

_DW_TAG_LEXICAL_BLOCK = 0x0B
_DW_TAG_COMPILE_UNIT = 0x11
_DW_TAG_STRUCTURE_TYPE = 0x13
_DW_TAG_CLASS_TYPE = 0x02
_DW_TAG_UNION_TYPE = 0x17
_DW_TAG_INLINED_SUBROUTINE = 0x1D
_DW_TAG_SUBPROGRAM = 0x2E
_DW_TAG_NAMESPACE = 0x39
_DW_TAG_MODULE = 0x1E
# Where subprograms are found: in a unit, a function, a namespace or a type (C++ members
# defined in the class, a local class's in a function), never in a variable's or a type's
# other children.
_SCOPES = frozenset({_DW_TAG_NAMESPACE, _DW_TAG_STRUCTURE_TYPE, _DW_TAG_CLASS_TYPE,
                     _DW_TAG_UNION_TYPE, _DW_TAG_MODULE})
# DIEs nested deeper are not visited: each level is two Python frames (the recursion limit is
# 1,000), and real code nests tens deep (gcc -O2 inlines 300 deep only when asked to).
_MAX_NESTING = 300
_DW_AT_NAME = 0x03
_DW_AT_CALL_FILE = 0x58
_DW_AT_CALL_LINE = 0x59


@dataclass(frozen=True, slots=True)
class SupplementLink:
    """Where a debug file's supplementary file is: its name as dwz wrote it (absolute, or
    relative to the debug file's directory), and its build ID ("" if the link has none)."""

    name: str
    build_id: str


def supplement_link(path: Path) -> SupplementLink | None:
    """The supplementary file that `path`'s DWARF refers to by .gnu_debugaltlink; None if
    there is none (or the link cannot be read)."""
    try:
        with path.open("rb") as f:
            headers = read_headers(f.fileno())
            section = headers.section(".gnu_debugaltlink") if headers is not None else None
            if headers is None or section is None or section.flags & SHF_COMPRESSED:
                return None
            data = headers.data(section, limit=1 << 16)
    except OSError:
        return None
    return parse_link(data) if data is not None else None


def parse_link(data: bytes) -> SupplementLink | None:
    """A .gnu_debugaltlink: the supplement's file name, NUL, its build ID's bytes."""
    name, nul, build_id = data.partition(b"\0")
    if not nul or not name:
        return None
    return SupplementLink(name.decode(errors="replace"), build_id.hex())


def supplement_matches(path: Path, link: SupplementLink) -> bool:
    """Whether `path` is the supplementary file `link` names: a wrong one would give the debug
    file's code the names and types of another package."""
    return bool(link.build_id) and build_id_of_file(path) == link.build_id


def supplement_beside(debug_file: Path, link: SupplementLink) -> Path | None:
    """The supplementary file where `link` says it is (`/usr/lib/debug/.dwz/<package>`, or a
    path relative to the debug file's directory, as gdb and libdw look), if it is that one."""
    try:
        # Relative to the file itself, not to a .build-id link to it.
        where = Path(link.name) if os.path.isabs(link.name) \
            else debug_file.resolve().parent / link.name
        return where if where.is_file() and supplement_matches(where, link) else None
    except (OSError, RuntimeError):  # RuntimeError: a loop of links
        return None


@dataclass
class _Inline:
    depth: int
    call_line: int
    call_file: int
    origin: int
    ranges: list[tuple[int, int]]


# A unit's line rows: their addresses, sorted, and each one's line and file number (-1: the
# row ends a sequence). Arrays, not objects: every unit's are held until the text is written,
# millions of rows in a big library.
_Rows = tuple["array[int]", "array[int]", "array[int]"]


@dataclass
class _Subprogram:
    name: str
    ranges: list[tuple[int, int]]
    rows: _Rows  # its unit's
    inlines: list[_Inline] = field(default_factory=list)


def write_breakpad(path: Path, supplement: Path | None, out: TextIO, load_address: int,
                   code: Sequence[tuple[int, int]], symbols: Sequence[FunctionSymbol]) -> bool:
    """Write the Breakpad text of `path`'s DWARF (read with `supplement`'s) and of its symbol
    table's functions `symbols` (sized or not, in table order) to `out`, addresses relative to
    `load_address`; only code within `code` ([start, end) of the executable segments: a
    function that GNU ld discarded keeps its address 0). False if there is no DWARF to read
    (or no libdw), or it does not fit `supplement`."""
    if LIBDW is None:
        return False
    first_at: dict[int, str] = {}
    for s in symbols:
        first_at.setdefault(s.value, s.name)
    with opened(path, supplement) as dbg:
        if not dbg:
            return False
        walker = _Walker(code, first_at)
        walker.read(dbg)
    if walker.unnamed:
        # gcc and clang name every inline function: references that do not resolve are a
        # supplement that is not the one dwz wrote (damaged, cut short, another with its build
        # ID), whose inline functions would be dropped and their lines put in their callers.
        return False
    out.write(HEADER)
    for name, number in walker.files.items():
        out.write(f"FILE {number} {one_line(name)}\n")
    for name, number in walker.origins.items():
        out.write(f"INLINE_ORIGIN {number} {one_line(name)}\n")
    covered: list[tuple[int, int]] = []
    for start, sub in sorted(walker.functions.items()):
        end = max(e for s, e in sub.ranges if s == start)
        if covered and start < covered[-1][1]:
            continue  # nested in or overlapping the one before: symbolic keeps the outer
        covered.append((start, end))
        _write_function(out, sub, start, end, load_address)
    write_symbols(out, symbols, covered, load_address)
    return True


def _write_function(out: TextIO, sub: _Subprogram, start: int, end: int,
                    load_address: int) -> None:
    out.write(f"FUNC {start - load_address:x} {end - start:x} 0 {one_line(sub.name)}\n")
    for inline in sub.inlines:
        inside = [(max(a, start), min(b, end)) for a, b in inline.ranges if a < end and b > start]
        if inside:
            spans = " ".join(f"{a - load_address:x} {b - a:x}" for a, b in inside)
            out.write(f"INLINE {inline.depth} {inline.call_line} {inline.call_file} "
                      f"{inline.origin} {spans}\n")
    addresses, lines, files = sub.rows
    i = bisect.bisect_left(addresses, start)
    while i < len(addresses) and addresses[i] < end:
        line, file = lines[i], files[i]
        a = max(addresses[i], start)
        b = min(addresses[i + 1] if i + 1 < len(addresses) else end, end)
        if file >= 0 and b > a:  # -1: past a sequence's end
            out.write(f"{a - load_address:x} {b - a:x} {line} {file}\n")
        i += 1


class _Walker:
    """Every compile unit's functions with code, their inline chains and their line rows."""

    def __init__(self, code: Sequence[tuple[int, int]], first_symbol_at: dict[int, str]
                 ) -> None:
        assert LIBDW is not None
        self._lib = LIBDW
        self._code = sorted(code)
        self._first_symbol_at = first_symbol_at
        self.files: dict[str, int] = {}
        self.origins: dict[str, int] = {}
        self.functions: dict[int, _Subprogram] = {}
        self._die = DieAttributes(LIBDW)
        self._unit_files: list[int] = []  # this unit's file table, as numbers of self.files
        self._unit_table = 0  # libdw's Dwarf_Files of it
        self._rows: _Rows = (array("Q"), array("q"), array("q"))
        self._comp_dir = ""
        self._nesting = 0
        self.unnamed = 0  # inline functions with code whose name could not be read

    def read(self, dbg: int) -> None:
        lib = self._lib
        at = ctypes.addressof
        die = Die()
        for offset, _version in units(lib, dbg):
            if lib.dwarf_offdie(dbg, offset, at(die)) \
                    and lib.dwarf_tag(at(die)) == _DW_TAG_COMPILE_UNIT:
                self._unit(at(die))

    def _unit(self, cu: int) -> None:
        self._comp_dir = self._die.string(cu, DW_AT_COMP_DIR)
        self._unit_files = self._file_table(cu)
        self._rows = self._line_rows(cu)
        self._children(cu, None, 0)

    def _children(self, parent: int, sub: _Subprogram | None, depth: int) -> None:
        if self._nesting >= _MAX_NESTING:
            return  # a damaged or hostile file's: deeper is its caller's code
        lib = self._lib
        child = Die()
        at = ctypes.addressof(child)
        if lib.dwarf_child(parent, at) != 0:
            return
        self._nesting += 1
        try:
            self._each_child(at, sub, depth)
        finally:
            self._nesting -= 1

    def _each_child(self, at: int, sub: _Subprogram | None, depth: int) -> None:
        lib = self._lib
        while True:
            tag = lib.dwarf_tag(at)
            if tag == _DW_TAG_SUBPROGRAM:
                self._subprogram(at)
            elif tag == _DW_TAG_INLINED_SUBROUTINE and sub is not None:
                self._inline(at, sub, depth)
            elif tag == _DW_TAG_LEXICAL_BLOCK and sub is not None:
                self._children(at, sub, depth)
            elif tag in _SCOPES:
                # In a function too: a lambda's operator() (not inlined: at -O0, or called
                # through std::function) and a local class's methods are defined in their
                # class, in the function. Their own functions, not part of this one.
                self._children(at, None, 0)
            if lib.dwarf_siblingof(at, at) != 0:
                return

    def _subprogram(self, die: int) -> None:
        ranges = self._ranges(die)
        if not ranges:
            return  # a declaration, an abstract instance, or code GNU ld discarded
        # symbolic names a function without a linkage name after the symbol at its lowest
        # address where there is one (a split function's `.cold` part's, often).
        name = self._die.string(die, DW_AT_LINKAGE_NAME) \
            or self._die.string(die, DW_AT_MIPS_LINKAGE_NAME) \
            or self._first_symbol_at.get(min(ranges)[0]) or self._die.string(die, _DW_AT_NAME)
        if not name:
            return  # damaged: the symbol table names its code
        sub = _Subprogram(name, ranges, self._rows)
        self._children(die, sub, 0)
        # Of subprograms sharing a start (gas's, one per alias), the later one.
        for start, _end in ranges:
            self.functions[start] = sub

    def _inline(self, die: int, sub: _Subprogram, depth: int) -> None:
        ranges = self._ranges(die)
        name = self._name(die) if ranges else ""
        if ranges and not name:
            self.unnamed += 1
            ranges = []
        if ranges:
            file = self._die.udata(die, _DW_AT_CALL_FILE)
            call_file = self._unit_files[file] if 0 <= file < len(self._unit_files) else 0
            origin = self.origins.setdefault(name, len(self.origins))
            sub.inlines.append(_Inline(depth, max(self._die.udata(die, _DW_AT_CALL_LINE), 0),
                                       call_file, origin, ranges))
        self._children(die, sub, depth + 1 if ranges else depth)

    def _name(self, die: int) -> str:
        """The linkage name, else the name, as symbolic names a function by DWARF; followed
        through DW_AT_abstract_origin and DW_AT_specification, into the supplement."""
        for attribute in (DW_AT_LINKAGE_NAME, DW_AT_MIPS_LINKAGE_NAME, _DW_AT_NAME):
            if name := self._die.string(die, attribute):
                return name
        return ""

    def _in_code(self, start: int) -> bool:
        i = bisect.bisect_right(self._code, (start, 1 << 64)) - 1
        return i >= 0 and start < self._code[i][1]

    def _ranges(self, die: int) -> list[tuple[int, int]]:
        return [(start, end) for start, end in self._die.ranges(die) if self._in_code(start)]

    def _file_number(self, name: str) -> int:
        return self.files.setdefault(clean_path(self._comp_dir, name), len(self.files))

    def _file_table(self, cu: int) -> list[int]:
        lib = self._lib
        files, count = ctypes.c_void_p(), ctypes.c_size_t()
        self._unit_table = 0
        if lib.dwarf_getsrcfiles(cu, ctypes.addressof(files), ctypes.addressof(count)) != 0:
            return []
        self._unit_table = files.value or 0
        table = []
        for i in range(count.value):
            raw = lib.dwarf_filesrc(files, i, None, None)
            table.append(self._file_number(ctypes.string_at(raw).decode(errors="replace"))
                         if raw else 0)
        return table

    def _line_rows(self, cu: int) -> _Rows:
        """The unit's rows by address; of rows at one address, the last."""
        lib = self._lib
        table, count = ctypes.c_void_p(), ctypes.c_size_t()
        at = ctypes.addressof
        if lib.dwarf_getsrclines(cu, at(table), at(count)) != 0 or not count.value:
            return array("Q"), array("q"), array("q")
        return self._rows_in_bulk(table.value or 0, count.value) \
            or self._rows_one_by_one(table.value or 0, count.value)

    def _rows_in_bulk(self, table: int, count: int) -> _Rows | None:
        """The rows read from libdw's row array at once (libc's 290,000 took 2 s one by one):
        `struct Dwarf_Line_s` (libdwP.h, unchanged from 0.173 to 0.191) holds the `files`
        pointer, `addr`, `file`, `line`, then the bit fields with `end_sequence` the third
        past the 16-bit column. Taken as a fact to check: rows spread over the unit are
        compared with libdw's accessors; None (read them one by one) where one disagrees."""
        lib = self._lib
        first = lib.dwarf_onesrcline(table, 0)
        stride = lib.dwarf_onesrcline(table, 1) - first if count > 1 else 32
        if stride < 28 or sys.byteorder != "little" or not first:
            return None
        raw = np.frombuffer(ctypes.string_at(first, count * stride), np.uint8)
        rows = raw.reshape(count, stride)
        files = rows[:, 0:8].copy().view("<u8")[:, 0]
        address = rows[:, 8:16].copy().view("<u8")[:, 0]
        file = rows[:, 16:20].copy().view("<u4")[:, 0].astype(np.int64)
        line = rows[:, 20:24].copy().view("<i4")[:, 0].astype(np.int64)
        end = (rows[:, 24:28].copy().view("<u4")[:, 0] >> 18 & 1).astype(bool)
        line_file = getattr(lib, "dwarf_line_file", None)  # elfutils 0.178 on
        if line_file is None or not self._unit_table:
            return None
        in_table, index = ctypes.c_void_p(), ctypes.c_size_t()
        got, number, ended = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_bool()
        at = ctypes.addressof
        for i in sorted({0, count - 1, *range(0, count, max(count // 16, 1))}):
            row = lib.dwarf_onesrcline(table, i)
            if row != first + i * stride:
                return None
            lib.dwarf_lineaddr(row, at(got))
            lib.dwarf_lineno(row, at(number))
            lib.dwarf_lineendsequence(row, at(ended))
            if line_file(row, at(in_table), at(index)) != 0 \
                    or (got.value, number.value, bool(ended.value), in_table.value, index.value) \
                    != (int(address[i]), int(line[i]), bool(end[i]), int(files[i]), int(file[i])):
                return None
        if (files != self._unit_table).any() or int(file.max()) >= len(self._unit_files):
            return None  # rows of another file table than the unit's, or past its end
        numbers = np.array(self._unit_files, dtype=np.int64)[file]
        numbers[end] = -1
        line = np.where(end, 0, np.maximum(line, 0))
        last = np.append(address[1:] != address[:-1], True)  # of rows at one address
        return (array("Q", address[last].tobytes()), array("q", line[last].tobytes()),
                array("q", numbers[last].tobytes()))

    def _rows_one_by_one(self, table: int, count: int) -> _Rows:
        lib = self._lib
        addresses, lines, files = array("Q"), array("q"), array("q")
        at = ctypes.addressof
        address, number, end = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_bool()
        paths: dict[bytes | None, int] = {}
        linesrc = lib.dwarf_linesrc
        for i in range(count):
            row = lib.dwarf_onesrcline(table, i)
            lib.dwarf_lineaddr(row, at(address))
            lib.dwarf_lineno(row, at(number))
            lib.dwarf_lineendsequence(row, at(end))
            line, file = 0, -1
            if not end.value:
                source = linesrc(row, None, None)
                file = paths.get(source, -1)
                if file < 0:
                    file = paths[source] = self._file_number(
                        source.decode(errors="replace")) if source else 0
                line = max(number.value, 0)
            if addresses and addresses[-1] == address.value:
                lines[-1], files[-1] = line, file
            else:
                addresses.append(address.value)
                lines.append(line)
                files.append(file)
        return addresses, lines, files
