"""The arrays inside a SymCache file, read with numpy: lookups for a whole profile at once.

symbolic builds the SymCache (the DWARF work) and answers one address at a time. Through its
Python binding a lookup costs about 15 µs in Python objects: 1.5 s for a profile of 100,000
addresses, more than llvm-symbolizer takes to parse the DWARF and answer them all. Yet the file
is a few flat arrays (symbolic-symcache's format, version 9), in this order, each aligned to 8:

    files, functions, source locations (file, line, function, inlined-into: four u32 each),
    range start addresses (u32, sorted), strings

and the last `len(ranges)` source locations belong to the ranges, one each: the innermost
frame of every address in that range, whose inlined-into links lead out to the function the
code is in. So a profile's lookups are one bulk search of the range starts (range_index.py),
and its frames a walk of links.
Function names are read here as symbolic's lookups give them (`symbol`); file paths are left
to symbolic, whose lookup joins and cleans a file's three parts (symtab.py asks it once per
file it meets). Each of those lookups checks its chain's walk, and the names read here,
against symbolic's own answer: the chains that bring no new file are not checked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

U32 = npt.NDArray[np.uint32]

SUPPORTED_VERSIONS = frozenset({9})
NONE = 0xFFFFFFFF  # symbolic's "no file", "no function", "not inlined", "no location"
_MAGIC = b"SYMC"
_PREAMBLE = struct.Struct("<4sI")  # magic, version
# debug id (32 bytes), arch, files, functions, source locations, ranges, string bytes, reserved
_HEADER = struct.Struct("<32sIIIIII16s")
_FILE_SIZE = 24  # six u32: comp dir, directory, name, and three source-server strings
_FUNCTION_SIZE = 16  # four u32: name, comp dir, entry address, language


class UnreadableSymCache(Exception):
    """The file is not a SymCache in a layout this reader knows, or it is inconsistent."""


@dataclass(frozen=True, slots=True)
class SymCacheColumns:
    range_starts: U32  # sorted; addresses relative to the object's load address
    # Per source location, as symbolic stores them:
    file: U32
    line: U32
    function: U32
    inlined_into: U32
    files: int
    functions: int
    # Per function: where its name is in `strings`, its entry address (NONE for a function
    # known only as inlined), and its language (symbolic_common::Language as a number)
    function_name: U32
    function_entry: U32
    function_language: U32
    # The string table's bytes, as a memoryview: its items are ints at once, where a numpy
    # array's are boxed scalars, 10x slower an item, and libc's table reads some 15,000 names.
    strings: memoryview

    def _bytes_at(self, offset: int) -> bytes:
        """The bytes of the string at `offset`: a LEB128 length, then that many bytes.
        IndexError where either runs past the string table, or the length past 64 bits (as
        the leb128 crate that symbolic reads it with: a tenth byte other than 0 or 1)."""
        strings = self.strings
        size, shift, at = 0, 0, offset
        while True:
            byte = strings[at]
            at += 1
            if shift == 63 and byte > 1:
                raise IndexError(f"string at {offset}: its length overflows 64 bits")
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
        if at + size > len(strings):
            raise IndexError(f"string at {offset} runs past the string table")
        return strings[at: at + size].tobytes()

    def string(self, offset: int) -> str:
        """The string at `offset`, undecodable bytes replaced."""
        return self._bytes_at(offset).decode(errors="replace")

    def symbol(self, function: int) -> str:
        """The function's name as symbolic's lookup gives it (the `symbol` of a frame): "?"
        for no function, or a name its string table cannot give (out of bounds, not UTF-8)."""
        if not 0 <= function < self.functions:
            return "?"
        try:
            return self._bytes_at(int(self.function_name[function])).decode()
        except (IndexError, UnicodeDecodeError):
            return "?"

    def is_rust(self, function: int) -> bool:
        """Whether symbolic says the function is Rust's (Language::Rust, 7): its `_ZN` names
        are then demangled as Rust's legacy scheme."""
        return 0 <= function < self.functions and int(self.function_language[function]) == 7

    @property
    def first_range_location(self) -> int:
        """The index of range 0's source location; range i's is this plus i."""
        return len(self.file) - len(self.range_starts)


def _align(offset: int) -> int:
    return (offset + 7) & ~7


def read_columns(path: Path) -> SymCacheColumns:
    """The arrays of the SymCache at `path`, mapped read-only, after checking they cohere."""
    # A plain array over the mapping: np.memmap's own indexing costs microseconds a call.
    data = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    if len(data) < _PREAMBLE.size + _HEADER.size:
        raise UnreadableSymCache(f"{path.name}: too short for a SymCache")
    head = bytes(data[: _PREAMBLE.size + _HEADER.size])
    magic, version = _PREAMBLE.unpack_from(head, 0)
    if magic != _MAGIC:
        raise UnreadableSymCache(f"{path.name}: not a little-endian SymCache")
    if version not in SUPPORTED_VERSIONS:
        raise UnreadableSymCache(f"{path.name}: SymCache version {version}; this reader knows "
                                 f"{sorted(SUPPORTED_VERSIONS)}")
    _id, _arch, files, functions, locations, ranges, string_bytes, _r = _HEADER.unpack_from(
        head, _PREAMBLE.size)
    offset = _align(_PREAMBLE.size + _HEADER.size)
    offset = _align(offset + files * _FILE_SIZE)
    function_offset = offset
    offset = _align(offset + functions * _FUNCTION_SIZE)
    location_offset = offset
    offset = _align(offset + locations * 16)
    range_offset = offset
    offset = _align(offset + ranges * 4)
    if offset + string_bytes > len(data) or ranges > locations:
        raise UnreadableSymCache(f"{path.name}: header counts do not fit the file")
    table = data[location_offset: location_offset + locations * 16].view("<u4")
    table = table.reshape(locations, 4)
    function_table = data[function_offset: function_offset + functions * _FUNCTION_SIZE]
    function_table = function_table.view("<u4").reshape(functions, 4)
    columns = SymCacheColumns(
        range_starts=data[range_offset: range_offset + ranges * 4].view("<u4"),
        file=table[:, 0], line=table[:, 1], function=table[:, 2], inlined_into=table[:, 3],
        files=files, functions=functions, function_name=function_table[:, 0],
        function_entry=function_table[:, 2], function_language=function_table[:, 3],
        strings=memoryview(data[offset: offset + string_bytes]))  # type: ignore[arg-type]
    _check(path, columns)
    return columns


def _check(path: Path, c: SymCacheColumns) -> None:
    """Indices in bounds and ranges sorted, so that no walk can leave the arrays.

    A location that is inlined into itself, or in a longer loop, is not caught here: walks are
    bounded instead.
    """
    locations = len(c.file)
    problems = []
    if np.any(np.diff(c.range_starts.astype(np.int64)) < 0):
        problems.append("ranges are not sorted")
    for name, column, bound in (("file", c.file, c.files), ("function", c.function, c.functions),
                                ("inlined-into", c.inlined_into, locations)):
        if np.any((column >= bound) & (column != NONE)):
            problems.append(f"a {name} index is out of range")
    if problems:
        raise UnreadableSymCache(f"{path.name}: {'; '.join(problems)}")
