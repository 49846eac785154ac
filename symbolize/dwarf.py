"""A second reader of a file's DWARF, beside symbolic's: elfutils' libdw, through ctypes.

symbolic's SymCache keeps what a lookup needs, but not three things a profile's user expects:
the subprogram's own names where the symbol table has several aliases for it (its linkage
name and DW_AT_name, `__GI___nanosleep` and `__nanosleep`, where symbolic takes the first
alias .symtab lists), its DW_AT_decl_line (pprof's Function.start_line), and lines for code
that a CU's line table covers but that no subprogram's address range does. GCC emits the last
for a function whose DW_TAG_subprogram carries no DW_AT_low_pc/DW_AT_ranges (glibc's
`mcheck_pedantic`, `mtrace`, ...): symbolic takes a CU's lines only inside its subprograms'
ranges and leaves such code without a line, while llvm-symbolizer reads the CU's line table.

Only subprogram DIEs are visited (dwarf_getfuncs). Every line table is decoded (by libdw,
0.1 s for libc), for the columns symbolic's SymCache drops; but read row by row through ctypes
they would cost 0.9 s for libc, so their addresses and columns are taken from libdw's row
array in bulk (`_RowLayout`), checked against libdw's accessors. Line rows as
objects are made only for the few CUs with code outside every subprogram.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import os
import posixpath
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

DW_AT_COMP_DIR = 0x1B
DW_AT_DECL_FILE = 0x3A
DW_AT_LINKAGE_NAME = 0x6E
DW_AT_MIPS_LINKAGE_NAME = 0x2007


class Die(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("cu", ctypes.c_void_p),
                ("abbrev", ctypes.c_void_p), ("padding", ctypes.c_long)]


class _Attribute(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint), ("form", ctypes.c_uint),
                ("valp", ctypes.c_void_p), ("cu", ctypes.c_void_p)]


# Every pointer crosses ctypes as a plain address (c_void_p): libc's 6,000 subprograms cost
# some 60,000 calls, and a typed pointer argument costs twice a plain integer's conversion.
_P = ctypes.c_void_p
_Callback = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P)


def _load() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("dw") or "libdw.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    sig = {
        "dwarf_begin": (_P, [ctypes.c_int, ctypes.c_int]),
        "dwarf_end": (ctypes.c_int, [_P]),
        # dwarf, offset, next offset, header size, version, abbrev offset, address size,
        # offset size, type signature, type offset
        "dwarf_next_unit": (ctypes.c_int, [_P, ctypes.c_uint64, _P, _P, _P, _P, _P, _P, _P,
                                           _P]),
        "dwarf_offdie": (_P, [_P, ctypes.c_uint64, _P]),
        "dwarf_getfuncs": (ctypes.c_ssize_t, [_P, _Callback, _P, ctypes.c_ssize_t]),
        "dwarf_diename": (ctypes.c_char_p, [_P]),
        "dwarf_decl_line": (ctypes.c_int, [_P, _P]),
        # A pointer into the CU's file table, made a string once per file (_decl_file).
        "dwarf_decl_file": (_P, [_P]),
        "dwarf_attr_integrate": (_P, [_P, ctypes.c_uint, _P]),
        "dwarf_formstring": (ctypes.c_char_p, [_P]),
        "dwarf_ranges": (ctypes.c_ssize_t, [_P, ctypes.c_ssize_t, _P, _P, _P]),
        "dwarf_getsrclines": (ctypes.c_int, [_P, _P, _P]),
        "dwarf_onesrcline": (_P, [_P, ctypes.c_size_t]),
        "dwarf_lineaddr": (ctypes.c_int, [_P, _P]),
        "dwarf_lineno": (ctypes.c_int, [_P, _P]),
        "dwarf_linecol": (ctypes.c_int, [_P, _P]),
        "dwarf_lineendsequence": (ctypes.c_int, [_P, _P]),
        "dwarf_linesrc": (ctypes.c_char_p, [_P, _P, _P]),
        # For a file that dwz gave a supplementary file (supplementary.py).
        "dwarf_setalt": (None, [_P, _P]),
        "dwarf_tag": (ctypes.c_int, [_P]),
        "dwarf_child": (ctypes.c_int, [_P, _P]),
        "dwarf_siblingof": (ctypes.c_int, [_P, _P]),
        "dwarf_formudata": (ctypes.c_int, [_P, _P]),
        "dwarf_getsrcfiles": (ctypes.c_int, [_P, _P, _P]),
        "dwarf_filesrc": (_P, [_P, ctypes.c_size_t, _P, _P]),
        # Unit, result, version, abbrev offset, address size, offset size, unit id, subdie.
        "dwarf_cu_die": (_P, [_P, _P, _P, _P, _P, _P, _P, _P]),
    }
    for fn, (restype, argtypes) in sig.items():
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = argtypes
    # Since elfutils 0.178: a row's file table and index (supplementary.py checks with it).
    if hasattr(lib, "dwarf_line_file"):
        lib.dwarf_line_file.restype = ctypes.c_int
        lib.dwarf_line_file.argtypes = [_P, _P, _P]
    return lib


LIBDW = _load()


@dataclass(frozen=True, slots=True)
class Subprogram:
    name: str  # DW_AT_name
    linkage_name: str  # DW_AT_linkage_name, or "" (C functions without an asm label)
    decl_line: int  # 0: unknown


@dataclass(frozen=True, slots=True)
class LineRow:
    address: int
    file: str
    line: int
    column: int
    end_sequence: bool


@dataclass
class DwarfFunctions:
    """What the second reader found: subprograms with code by the start of each of their
    address ranges (symbolic's entry of a function is one of them), the declared line of
    every name (0 where subprograms of one name disagree), and the line rows of code outside
    every subprogram."""

    by_entry: dict[int, Subprogram] = field(default_factory=dict)
    decl_lines: dict[str, int] = field(default_factory=dict)
    # Where subprograms of one name disagree (static functions of several files: glibc has
    # four `cancel_handler`s), the declared line of the name in each file that declares it
    # once, by (name, file as symbolic writes its paths).
    decl_lines_in: dict[tuple[str, str], int] = field(default_factory=dict)
    # [start, end) ranges that a CU covers and none of its subprograms does, and the rows of
    # those CUs' line tables (sorted by address within each CU, CUs one after another).
    orphan_ranges: list[tuple[int, int]] = field(default_factory=list)
    orphan_rows: list[LineRow] = field(default_factory=list)
    # The column of every address, as llvm-symbolizer gives the innermost frame's: from the
    # last line row at or below it. Sorted row addresses, and each one's column, a row only
    # where the column changes (an end of sequence: column 0).
    column_starts: npt.NDArray[np.uint64] = field(
        default_factory=lambda: np.zeros(0, np.uint64))
    columns: npt.NDArray[np.uint16] = field(default_factory=lambda: np.zeros(0, np.uint16))


def read_functions(path: Path, symbol_starts: Sequence[int],
                   supplement: Path | None = None) -> DwarfFunctions:
    """The DWARF facts of the file at `path`; empty when it has no DWARF or libdw is missing
    (names then come from the symbol table alone). `supplement`: the file that dwz moved part
    of its DWARF to (supplementary.py), whose names and declared lines it refers to.

    `symbol_starts` (sorted): where .symtab's functions start. A CU's code outside its
    subprograms matters where a function starts in it; elsewhere it is the padding between
    functions, and reading those CUs' line tables would cost a second for libc.
    """
    out = DwarfFunctions()
    if LIBDW is None:
        return out
    with opened(path, supplement) as dbg:
        if dbg:
            _Reader(LIBDW, out, symbol_starts).read(dbg)
    return out


@contextmanager
def opened(path: Path, supplement: Path | None = None) -> Iterator[int]:
    """libdw's handle on the DWARF of `path` (0: it has none), with `supplement`'s DWARF as
    the one its DW_FORM_GNU_ref_alt and DW_FORM_GNU_strp_alt forms point into."""
    assert LIBDW is not None
    with contextlib.ExitStack() as held:
        alt = held.enter_context(opened(supplement)) if supplement is not None else 0
        if supplement is not None and not alt:
            # A supplement without DWARF (damaged, stripped, hostile) is none: libdw, not
            # given one, would look for it itself where the link says, any path on this
            # machine (a FIFO there hangs the build), or read the file without it (nameless
            # inline functions whose lines land in their callers).
            yield 0
            return
        fd = os.open(path, os.O_RDONLY)
        dbg = 0
        try:
            dbg = LIBDW.dwarf_begin(fd, 0) or 0  # DWARF_C_READ; NULL: no DWARF
            if dbg and alt:
                # Set before any unit is read; the supplement's handle outlives this one.
                LIBDW.dwarf_setalt(dbg, alt)
            yield dbg
        finally:
            if dbg:
                LIBDW.dwarf_end(dbg)
            os.close(fd)


def units(lib: ctypes.CDLL, dbg: int) -> Iterator[tuple[int, int]]:
    """(offset of its DIE, DWARF version) of each unit of .debug_info, up to the first that is
    of no DWARF version (2 to 5). libdw reads zeros as units of 4 bytes and version 0: a
    section of 64 MiB of zeros (inflated from 64 KiB) was 16 million units, read one ctypes
    call at a time for a minute, and a dwz'd file's longer still; nothing past such a unit
    can be told from garbage."""
    offset, following, header = 0, ctypes.c_uint64(), ctypes.c_size_t()
    version = ctypes.c_uint16()
    at = ctypes.addressof
    while lib.dwarf_next_unit(dbg, offset, at(following), at(header), at(version),
                              None, None, None, None, None) == 0:
        if not 2 <= version.value <= 5:
            return
        yield offset + header.value, version.value
        offset = following.value


class DieAttributes:
    """A DIE's attributes as libdw reads them (through DW_AT_abstract_origin and
    DW_AT_specification, into a supplement where one is set), into out-parameters made once
    and passed by address: a big file's DIEs are read with a handful of calls each."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._attr, self._value = _Attribute(), ctypes.c_uint64()
        self._base, self._start, self._end = ctypes.c_uint64(), ctypes.c_uint64(), \
            ctypes.c_uint64()
        at = ctypes.addressof
        self._attr_at, self._value_at = at(self._attr), at(self._value)
        self._range_at = (at(self._base), at(self._start), at(self._end))

    def string(self, die: int, attribute: int) -> str:
        """The attribute's string, "" where the DIE (or the one it comes from) has none."""
        attr = self._lib.dwarf_attr_integrate(die, attribute, self._attr_at)
        raw = self._lib.dwarf_formstring(attr) if attr else None
        return raw.decode(errors="replace") if raw else ""

    def udata(self, die: int, attribute: int) -> int:
        """The attribute's unsigned constant; -1 where there is none."""
        attr = self._lib.dwarf_attr_integrate(die, attribute, self._attr_at)
        if not attr or self._lib.dwarf_formudata(attr, self._value_at) != 0:
            return -1
        return self._value.value

    def ranges(self, die: int) -> list[tuple[int, int]]:
        """The DIE's [start, end) address ranges, empty ones left out."""
        found: list[tuple[int, int]] = []
        offset = 0
        ranges, base, start, end = self._lib.dwarf_ranges, *self._range_at
        while True:
            offset = ranges(die, offset, base, start, end)
            if offset <= 0:
                return found
            if self._end.value > self._start.value:
                found.append((self._start.value, self._end.value))


class _Reader:
    def __init__(self, lib: ctypes.CDLL, out: DwarfFunctions, starts: Sequence[int]) -> None:
        self._lib = lib
        self._out = out
        self._starts = starts
        # Out-parameters, made once and passed by address: libc has some 6,000 subprograms
        # and 8,000 range lists, each read with a handful of calls through ctypes.
        self._die = DieAttributes(lib)
        self._int = ctypes.c_int()
        self._lines_p, self._count = ctypes.c_void_p(), ctypes.c_size_t()
        at = ctypes.addressof
        self._decl_attr, self._decl_value = _Attribute(), ctypes.c_uint64()
        self._decl_attr_at, self._decl_value_at = at(self._decl_attr), at(self._decl_value)
        self._int_at = at(self._int)
        self._lines_at, self._count_at = at(self._lines_p), at(self._count)
        self._version = 0
        self._cu_ranges: list[tuple[int, int]] = []
        # (DW_AT_decl_line, DW_AT_decl_file as libdw's pointer) of each name's subprograms,
        # and the directory of the CU of each pointer.
        self._declared: dict[str, set[tuple[int, int]]] = {}
        self._file_dirs: dict[int, str] = {}
        self._comp_dir = ""
        self._row_arrays: list[bytes] = []
        self._layout: _RowLayout | None = None

    def read(self, dbg: int) -> None:
        lib = self._lib
        callback = _Callback(self._subprogram)
        die = Die()
        for offset, version in units(lib, dbg):
            cu = lib.dwarf_offdie(dbg, offset, ctypes.addressof(die))
            if cu:
                self._version = version
                self._cu_ranges = []
                self._comp_dir = self._die.string(cu, DW_AT_COMP_DIR)
                lib.dwarf_getfuncs(cu, callback, None, 0)
                outside = [(a, b) for a, b in _subtract(self._die.ranges(cu), self._cu_ranges)
                           if bisect.bisect_left(self._starts, a) < len(self._starts)
                           and self._starts[bisect.bisect_left(self._starts, a)] < b]
                if outside:
                    self._out.orphan_ranges += outside
                    self._out.orphan_rows += self._rows(cu)
                self._row_array(cu)
        self._decl_lines()
        self._out.orphan_rows.sort(key=lambda r: (r.address, not r.end_sequence))
        if self._layout is not None:
            self._out.column_starts, self._out.columns = self._layout.columns(self._row_arrays)

    def _line_table(self, cu: int) -> tuple[int, int]:
        """The CU's rows (libdw's Dwarf_Lines) and their count; (0, 0) without a table."""
        if self._lib.dwarf_getsrclines(cu, self._lines_at, self._count_at) != 0:
            return 0, 0
        return self._lines_p.value or 0, self._count.value

    def _row_array(self, cu: int) -> None:
        """Keep the bytes of the CU's line rows, once their layout is known and checked."""
        lib = self._lib
        lines, n = self._line_table(cu)
        if not n:
            return
        checked: range | tuple[()] = ()
        if self._layout is None:
            if n < 2:
                return
            self._layout = _RowLayout(lib.dwarf_onesrcline(lines, 1)
                                      - lib.dwarf_onesrcline(lines, 0))
            if self._layout.stride not in _PROVEN_STRIDES:
                checked = range(n)
        layout = self._layout
        first = lib.dwarf_onesrcline(lines, 0)
        raw = ctypes.string_at(first, n * layout.stride)
        if all(layout.agrees(lib, lib.dwarf_onesrcline(lines, i), raw, i) for i in checked):
            self._row_arrays.append(raw)
            # The layout is the loaded libdw's, the same for every CU of every file: once a
            # CU's rows all agree, the 2,000 CUs of libc need not each be checked again (a
            # row each cost 34 ms), nor a small program's first CU in every build.
            if checked:
                _PROVEN_STRIDES.add(layout.stride)
        else:  # another libdw's layout: the columns are not known
            self._layout = None
            self._row_arrays = []

    def _decl_lines(self) -> None:
        """Each name's declared line, 0 where its subprograms disagree; and for those, the
        line in each file that declares the name at one line."""
        paths: dict[int, str] = {0: ""}
        out = self._out
        for name, declared in self._declared.items():
            lines = {line for line, _at in declared}
            if len(lines) == 1:
                out.decl_lines[name] = next(iter(lines))
                continue
            out.decl_lines[name] = 0
            in_file: dict[str, set[int]] = {}
            for line, at in declared:
                path = paths.get(at)
                if path is None:  # the table lives as long as the Dwarf handle: still read
                    path = paths[at] = clean_path(self._file_dirs[at],
                                              ctypes.string_at(at).decode(errors="replace"))
                in_file.setdefault(path, set()).add(line)
            for path, lines in in_file.items():
                if len(lines) == 1:
                    out.decl_lines_in[(name, path)] = next(iter(lines))

    def _subprogram(self, die: int, _arg: object) -> int:
        lib = self._lib
        raw = lib.dwarf_diename(die)
        name = raw.decode(errors="replace") if raw else ""
        linkage = self._die.string(die, DW_AT_LINKAGE_NAME)
        # DWARF 5 has no use for the MIPS name, and producers emit it only for older
        # versions: a call saved per subprogram.
        if not linkage and self._version < 5:
            linkage = self._die.string(die, DW_AT_MIPS_LINKAGE_NAME)
        self._int.value = 0
        lib.dwarf_decl_line(die, self._int_at)
        line = max(self._int.value, 0)
        if line:  # a declaration without one says nothing, an abstract instance says it
            # With its file as libdw's pointer into the CU's file table: made a path at the
            # end, for the few names declared at several lines (_decl_lines).
            declared = self._declared
            at = lib.dwarf_decl_file(die) or 0
            if not at:
                at = self._decl_file_zero(die)
            elif at not in self._file_dirs:
                self._file_dirs[at] = self._comp_dir
            if name:
                declared.setdefault(name, set()).add((line, at))
            if linkage and linkage != name:
                declared.setdefault(linkage, set()).add((line, at))
        elif name:
            # A definition without a line (GCC gives a lambda's `operator()` none) leaves its
            # name's line unknown: not another function's, std::function's `operator()`
            # declared at line 587 of <bits/std_function.h>.
            self._declared.setdefault(name, set()).add((0, 0))
        ranges = self._die.ranges(die)
        if ranges:
            self._cu_ranges += ranges
            found = Subprogram(name, linkage, line)
            # symbolic's entry is one of the starts: a hot or cold part's. Of subprograms
            # sharing a start (gas's, one per alias: `__memmove_ssse3`, `__memcpy_ssse3`), the
            # later one, which llvm-symbolizer names the code after.
            for start, _end in ranges:
                self._out.by_entry[start] = found
        return 0  # DWARF_CB_OK

    def _decl_file_zero(self, die: int) -> int:
        """The DIE's DW_AT_decl_file where it is file 0 of a DWARF 5 unit, as libdw's pointer
        into that unit's file table (0: it is not). Clang declares every function of the
        unit's own source file so, and libdw's dwarf_decl_file (0.188) takes index 0 for no
        file, as it is before DWARF 5: `helper` static in two files was declared nowhere,
        and its frames had no start line."""
        lib = self._lib
        attr = lib.dwarf_attr_integrate(die, DW_AT_DECL_FILE, self._decl_attr_at)
        if not attr or lib.dwarf_formudata(attr, self._decl_value_at) != 0 \
                or self._decl_value.value != 0 or not self._decl_attr.cu:
            return 0
        # The unit of the attribute, which DW_AT_abstract_origin or DW_AT_specification may
        # have taken from another one (a link-time optimized program's).
        at = ctypes.addressof
        unit, version = Die(), ctypes.c_uint16()
        if not lib.dwarf_cu_die(self._decl_attr.cu, at(unit), at(version), None, None, None,
                                None, None) or version.value < 5:
            return 0
        files, count = ctypes.c_void_p(), ctypes.c_size_t()
        if lib.dwarf_getsrcfiles(at(unit), at(files), at(count)) != 0 or not count.value:
            return 0
        name: int = lib.dwarf_filesrc(files, 0, None, None) or 0
        if name and name not in self._file_dirs:
            self._file_dirs[name] = self._die.string(at(unit), DW_AT_COMP_DIR)
        return name

    def _rows(self, cu: int) -> list[LineRow]:
        lib = self._lib
        lines, n = self._line_table(cu)
        address, number, column = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_int()
        end = ctypes.c_bool()
        at = ctypes.addressof
        address_at, number_at, column_at, end_at = at(address), at(number), at(column), at(end)
        rows = []
        comp_dir = self._comp_dir
        paths: dict[bytes, str] = {}
        for i in range(n):
            row = lib.dwarf_onesrcline(lines, i)
            lib.dwarf_lineaddr(row, address_at)
            lib.dwarf_lineno(row, number_at)
            lib.dwarf_linecol(row, column_at)
            lib.dwarf_lineendsequence(row, end_at)
            source = lib.dwarf_linesrc(row, None, None)
            path = paths.get(source)
            if path is None:
                path = paths[source] = clean_path(comp_dir, source.decode(errors="replace")) \
                    if source else ""
            rows.append(LineRow(address.value, path, max(number.value, 0),
                                max(column.value, 0), bool(end.value)))
        return rows


# Row strides whose layout every row of a CU confirmed, in this process (_RowLayout).
_PROVEN_STRIDES: set[int] = set()


class _RowLayout:
    """Where elfutils' `struct Dwarf_Line_s` keeps a row's address, column and end-of-sequence
    flag (libdwP.h, unchanged from 0.173 to 0.191): `files` pointer, `addr`, `file`, `line`,
    then the unsigned short `column` and the bit fields that follow it in the same word,
    `end_sequence` the third. Taken as a fact to check: every row of the first CU a process
    reads is compared with libdw's own accessors, and the columns dropped where one
    disagrees."""

    _ADDRESS, _COLUMN, _END_BIT = 8, 24, 18

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self._address, self._column = ctypes.c_uint64(), ctypes.c_int()
        self._end = ctypes.c_bool()
        at = ctypes.addressof
        self._out_at = (at(self._address), at(self._column), at(self._end))

    def _fields(self, raw: bytes, i: int) -> tuple[int, int, bool]:
        at = i * self.stride
        word = int.from_bytes(raw[at + self._COLUMN: at + self._COLUMN + 4], "little")
        return (int.from_bytes(raw[at + self._ADDRESS: at + self._ADDRESS + 8], "little"),
                word & 0xFFFF, bool(word >> self._END_BIT & 1))

    def agrees(self, lib: ctypes.CDLL, row: int, raw: bytes, i: int) -> bool:
        if self.stride < self._COLUMN + 4 or len(raw) < (i + 1) * self.stride \
                or sys.byteorder != "little":
            return False
        address_at, column_at, end_at = self._out_at
        lib.dwarf_lineaddr(row, address_at)
        lib.dwarf_linecol(row, column_at)
        lib.dwarf_lineendsequence(row, end_at)
        return self._fields(raw, i) == (self._address.value, self._column.value,
                                        bool(self._end.value))

    def columns(self, arrays: list[bytes]
                ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint16]]:
        if not arrays:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint16)
        rows = np.frombuffer(b"".join(arrays), dtype=np.uint8).reshape(-1, self.stride)
        address = rows[:, self._ADDRESS: self._ADDRESS + 8].copy().view("<u8")[:, 0]
        word = rows[:, self._COLUMN: self._COLUMN + 4].copy().view("<u4")[:, 0]
        column = np.where(word >> self._END_BIT & 1, 0, word & 0xFFFF).astype(np.uint16)
        # Of rows at one address the last one holds (an end of sequence sorts before the
        # first row of the next): llvm-symbolizer looks up the last row at or below.
        end = (word >> self._END_BIT & 1).astype(np.uint64)
        if len(address) and int(address.max()) < 1 << 63:
            # One key, address then end of sequence first, in a stable sort of the CUs' own
            # sorted runs: half lexsort's time over libc's 290,000 rows.
            order = np.argsort(address << np.uint64(1) | end ^ np.uint64(1), kind="stable")
        else:
            order = np.lexsort((np.arange(len(address)), end ^ np.uint64(1), address))
        address, column = address[order], column[order]
        last = np.append(address[1:] != address[:-1], True)
        address, column = address[last], column[last]
        changes = np.append(True, column[1:] != column[:-1])
        return address[changes], column[changes]


def clean_path(comp_dir: str, path: str) -> str:
    """A line row's file as symbolic writes its paths: joined to the CU's directory, `.` and
    `..` resolved (`./malloc/./malloc/mcheck.c` is `malloc/malloc/mcheck.c`)."""
    return posixpath.normpath(posixpath.join(comp_dir, path))


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """The parts of `ranges` that no range of `holes` covers."""
    out = []
    cut = sorted(holes)
    for start, end in sorted(ranges):
        at = start
        for h_start, h_end in cut:
            if h_end <= at or h_start >= end:
                continue
            if h_start > at:
                out.append((at, h_start))
            at = max(at, h_end)
        if at < end:
            out.append((at, end))
    return out
