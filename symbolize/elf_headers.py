"""An ELF file's header tables read with pread and struct: the ELF header, the program headers,
the section headers with their names, and a section's stored bytes.

pyelftools builds its construct structs anew for every file it opens (about 1 ms) and then an
object per header; a small program's symbol-table build opened its two files five times that
way, 6 of its 7.5 ms. These tables are fixed-size records of the ELF specification, so they
are read here in a few microseconds, and nothing past them: DWARF, notes' contents and symbols
are their callers' business. Whatever this does not expect (an extended program header
count, more than MAX_SECTIONS sections, a table past the end of the file, a header size that
is not the standard one) gives None, and the callers ask pyelftools, as they did before. One
damage is read through: a name-table index past the sections leaves them nameless but whole,
so that a build-ID note is still found by its type (pyelftools fails on such a file).
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass

PT_LOAD = 1
PT_NOTE = 4
SHT_SYMTAB = 2
SHT_STRTAB = 3
SHT_NOTE = 7
SHT_NOBITS = 8
SHT_DYNSYM = 11
SHF_ALLOC = 0x2
SHF_EXECINSTR = 0x4
SHF_COMPRESSED = 0x800
E_TYPES = {0: "ET_NONE", 1: "ET_REL", 2: "ET_EXEC", 3: "ET_DYN", 4: "ET_CORE"}

# Counts the tables may claim: 0xFFFF is PN_XNUM, whose real value lives in section 0, left
# to pyelftools.
_MAX_ENTRIES = 0xFFFE
# A section count of 0 or a name-table index of SHN_XINDEX in the ELF header: the real values
# are section 0's sh_size and sh_link (extended section numbering). Read here up to this many
# sections (16 MiB of headers): pyelftools walked a file claiming hundreds of thousands, a
# hostile debuginfo's or upload's, at some 17 us a section, again for every section asked of it.
SHN_XINDEX = 0xFFFF
MAX_SECTIONS = 1 << 18
# Section names are read whole: a real .shstrtab is a few hundred bytes.
_MAX_NAMES_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Class:
    """Where ELF32 and ELF64 keep what is read here."""

    header_size: int
    offsets: str  # e_phoff, e_shoff
    offsets_at: int
    counts_at: int  # e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
    program: str
    # Of a program header's fields: p_type, p_flags, p_offset, p_vaddr, p_filesz, p_memsz,
    # p_align (ELF32 puts p_flags after p_memsz, ELF64 after p_type).
    program_fields: tuple[int, ...]
    # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info,
    # sh_addralign, sh_entsize
    section: str


_CLASSES = {
    True: _Class(64, "QQ", 0x20, 0x36, "IIQQQQQQ", (0, 1, 2, 3, 5, 6, 7), "IIQQQQIIQQ"),
    False: _Class(52, "II", 0x1C, 0x2A, "IIIIIIII", (0, 6, 1, 2, 4, 5, 7), "IIIIIIIIII"),
}


@dataclass(frozen=True, slots=True)
class ProgramHeader:
    type: int
    flags: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int
    align: int


@dataclass(frozen=True, slots=True)
class SectionHeader:
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    align: int


# read(size, offset): the file's bytes there, fewer at its end; raises OSError or OverflowError
# where it cannot read.
Read = Callable[[int, int], bytes]


@dataclass(frozen=True, slots=True)
class ElfHeaders:
    """The header tables of a file, and how to read it (the file stays the caller's)."""

    read: Read
    is64: bool
    order: str  # struct's byte order: "<" or ">"
    e_type: int
    programs: tuple[ProgramHeader, ...]
    sections: tuple[SectionHeader, ...]
    file_size: int

    def section(self, name: str, kind: int | None = None) -> SectionHeader | None:
        """The first section called `name` (and of type `kind`, if given)."""
        return next((s for s in self.sections
                     if s.name == name and (kind is None or s.type == kind)), None)

    def data(self, section: SectionHeader, limit: int = 1 << 30) -> bytes | None:
        """The section's bytes as stored; b"" for SHT_NOBITS; None when they are compressed,
        over `limit`, or past the end of the file (checked before any is read: a damaged size
        must not make us allocate what it claims)."""
        if section.type == SHT_NOBITS:
            return b""
        if section.flags & SHF_COMPRESSED or section.size > limit \
                or section.offset + section.size > self.file_size:
            return None
        return _read_exactly(self.read, section.size, section.offset)


def read_headers(fd: int) -> ElfHeaders | None:
    """The header tables of the ELF file open on `fd`, or None when it is not ELF or anything
    about its headers is unusual."""
    try:
        size = os.fstat(fd).st_size
    except OSError:
        return None
    return headers_of(lambda n, offset: os.pread(fd, n, offset), size)


def headers_of(read: Read, file_size: int) -> ElfHeaders | None:
    """read_headers for a file of `file_size` bytes read by `read`: one being downloaded,
    partly on disk and partly in memory (proxy.artifacts.flight)."""
    try:
        head = read(64, 0)
        if (ident := _ident(head)) is None:
            return None
        is64, order, layout = ident
        e_type, = struct.unpack_from(order + "H", head, 0x10)
        phoff, shoff = struct.unpack_from(order + layout.offsets, head, layout.offsets_at)
        phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(
            order + "HHHHH", head, layout.counts_at)
        pfmt, pfields, sfmt = order + layout.program, layout.program_fields, order + layout.section
        programs: list[ProgramHeader] = []
        if phnum:
            if phentsize != struct.calcsize(pfmt) or phnum > _MAX_ENTRIES:
                return None
            table = _read_exactly(read, phnum * phentsize, phoff)
            if table is None:
                return None
            for raw in struct.iter_unpack(pfmt, table):
                p_type, flags, offset, vaddr, filesz, memsz, align = (raw[i] for i in pfields)
                programs.append(ProgramHeader(p_type, flags, offset, vaddr, filesz, memsz,
                                              align))
        sections: list[SectionHeader] = []
        if shoff:
            if shentsize != struct.calcsize(sfmt):
                return None
            if (counts := _counts(read, sfmt, shoff, shnum, shstrndx)) is None:
                return None
            shnum, shstrndx = counts
            # Checked before a byte is read: the count is the file's word, not its size.
            if not 0 < shnum <= MAX_SECTIONS or shnum * shentsize > file_size - shoff:
                return None
            table = _read_exactly(read, shnum * shentsize, shoff)
            if table is None:
                return None
            rows = list(struct.iter_unpack(sfmt, table))
            # Sections without a name table (none, or an index past the sections) keep their
            # other fields: a build-ID note is found by its type, where pyelftools fails.
            names = b""
            if shstrndx < shnum:
                if (found := _names(read, rows[shstrndx])) is None:
                    return None
                names = found
            for name_at, s_type, flags, addr, offset, size, link, _info, align, _entsize \
                    in rows:
                end = names.find(b"\0", name_at)
                # A byte that is not UTF-8 is kept as a lone surrogate, not replaced: a name
                # with U+FFFD for it was the text of another name (`.x\xff` that of `.x\ufffd`),
                # and a section asked for by that name was cut from the wrong one.
                name = names[name_at:end if end >= 0 else len(names)].decode(
                    errors="surrogateescape")
                sections.append(SectionHeader(name, s_type, flags, addr, offset, size, link,
                                              align))
        return ElfHeaders(read, is64, order, e_type, tuple(programs), tuple(sections),
                          file_size)
    except (OSError, OverflowError, struct.error):
        return None


# Section headers section_named looks through: a file claiming more is looked for in this many,
# as pyelftools was walked only so far. A hostile file's count is bounded by its size alone.
MAX_SCANNED_SECTIONS = 1 << 22
_SCAN_ROWS = 1 << 14  # read at a time: 1 MiB of ELF64 headers


def shown_section(name: str) -> str:
    """A section's name for a message or a stored error: its bytes that are not UTF-8 (kept
    as lone surrogates, which no UTF-8 store or log takes) escaped as `\\xff`."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class UnusualHeaders(Exception):
    """A section table that headers_of does not read either (a header size that is not the
    standard one, a table past the end of the file, a name table too large): pyelftools'."""


def section_named(read: Read, file_size: int, name: bytes) -> SectionHeader | None:
    """The first section whose name is the bytes `name`, or None; UnusualHeaders where the
    table is not read here. Only the name column of each header is looked at, no object made
    for it: headers_of's table of a file of 2^18 sections took a second or more for each
    section asked of it (a hostile debuginfo's, and every miss of its sections is asked
    again), and a count past that was pyelftools' walk, four seconds."""
    try:
        head = read(64, 0)
        if (ident := _ident(head)) is None:
            raise UnusualHeaders
        _is64, order, layout = ident
        sfmt = order + layout.section
        _, shoff = struct.unpack_from(order + layout.offsets, head, layout.offsets_at)
        _, _, shentsize, shnum, shstrndx = struct.unpack_from(order + "HHHHH", head,
                                                              layout.counts_at)
        if not shoff:
            return None
        if shentsize != struct.calcsize(sfmt):
            raise UnusualHeaders
        if (counts := _counts(read, sfmt, shoff, shnum, shstrndx)) is None:
            raise UnusualHeaders
        shnum, shstrndx = counts
        if shnum <= 0 or shnum * shentsize > file_size - shoff:
            raise UnusualHeaders
        names = b""
        if shstrndx < shnum:
            names_row = _read_exactly(read, shentsize, shoff + shstrndx * shentsize)
            if names_row is None:
                raise UnusualHeaders
            if (found := _names(read, struct.unpack(sfmt, names_row))) is None:
                raise UnusualHeaders
            names = found
        target, tail = name + b"\0", len(names) - len(name)
        stride = shentsize // 4  # sh_name is the first 4 bytes of a header
        for start in range(0, min(shnum, MAX_SCANNED_SECTIONS), _SCAN_ROWS):
            count = min(_SCAN_ROWS, shnum - start)
            table = _read_exactly(read, count * shentsize, shoff + start * shentsize)
            if table is None:
                raise UnusualHeaders
            column = array("I", table)
            if column.itemsize != 4:  # no platform symgate runs on
                raise UnusualHeaders
            if order != ("<" if sys.byteorder == "little" else ">"):
                column.byteswap()
            for i, at in enumerate(column[::stride]):
                # As headers_of names it: up to its NUL, or the table's end (nothing past it).
                if names.startswith(target, at) or (at == tail and names.endswith(name)) \
                        or (at >= len(names) and not name):
                    row = struct.unpack_from(sfmt, table, i * shentsize)
                    return SectionHeader(name.decode(errors="surrogateescape"), row[1],
                                         row[2], row[3], row[4], row[5], row[6], row[8])
        return None
    except (OSError, OverflowError, struct.error):
        raise UnusualHeaders from None


def _ident(head: bytes) -> tuple[bool, str, _Class] | None:
    """Whether the ELF header `head` (its first 64 bytes) is ELF64, its byte order for struct,
    and its class's layout; None where it is no ELF header whole."""
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) \
            or head[5] not in (1, 2):
        return None
    is64, order = head[4] == 2, "<" if head[5] == 1 else ">"
    layout = _CLASSES[is64]
    return None if len(head) < layout.header_size else (is64, order, layout)


def _names(read: Read, row: tuple[int, ...]) -> bytes | None:
    """The section-name table whose section header is `row`; None where it is not read: past
    _MAX_NAMES_BYTES, without bytes in the file (SHT_NOBITS), or not all there."""
    _, s_type, _, _, offset, size, *_ = row
    if size > _MAX_NAMES_BYTES or s_type == SHT_NOBITS:
        return None
    return _read_exactly(read, size, offset)


def _counts(read: Read, sfmt: str, shoff: int, shnum: int, shstrndx: int
            ) -> tuple[int, int] | None:
    """The section count and the name table's index: the ELF header's, or where it defers to
    the first section header (extended numbering, past 0xff00 sections: 0 and SHN_XINDEX),
    that header's; None where it cannot be read."""
    if shnum != 0 and shstrndx != SHN_XINDEX:
        return shnum, shstrndx
    first = _read_exactly(read, struct.calcsize(sfmt), shoff)
    if first is None:
        return None
    row = struct.unpack(sfmt, first)
    return row[5] if shnum == 0 else shnum, row[6] if shstrndx == SHN_XINDEX else shstrndx


def _read_exactly(read: Read, size: int, offset: int) -> bytes | None:
    try:
        data = read(size, offset)
    except (OSError, OverflowError):  # an offset past what pread takes: not a file to trust
        return None
    return data if len(data) == size else None
