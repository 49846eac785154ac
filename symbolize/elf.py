"""ELF structure: build-ID notes, program headers, function symbols.

Read through elf_headers' quick tables where it can, through pyelftools where it cannot.

Files come from upstreams we do not control, so they are opened with ELFFile(stream) and
never with ELFFile.load_from_path, which follows .gnu_debuglink names from the file's bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.common.utils import parse_cstring_from_stream
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import Section

from .elf_headers import (
    E_TYPES,
    PT_LOAD,
    SHF_ALLOC,
    SHF_COMPRESSED,
    SHF_EXECINSTR,
    SHT_DYNSYM,
    SHT_NOBITS,
    SHT_NOTE,
    SHT_STRTAB,
    SHT_SYMTAB,
    ElfHeaders,
    Read,
    UnusualHeaders,
    headers_of,
    read_headers,
    section_named,
)

NT_GNU_BUILD_ID = "NT_GNU_BUILD_ID"
PF_X = 0x1
STT_FUNC = 2
# An indirect function's value is its resolver's code, which .dynsym names after the function
# (`memcmp` for glibc's `memcmp_ifunc`).
STT_GNU_IFUNC = 10


def _malformed(error: Exception) -> bool:
    """Whether pyelftools failed on a file that is not valid ELF: it raises a spread of types
    on malformed input, and construct's errors have no common public base we can import."""
    return (isinstance(error, (ELFError, ELFParseError, ValueError, KeyError, EOFError,
                               AssertionError, zlib.error))
            or type(error).__module__.startswith(("construct", "elftools")))


def _build_id_from_notes(notes: object) -> str | None:
    for note in notes:  # type: ignore[attr-defined]
        if note["n_type"] == NT_GNU_BUILD_ID and note["n_name"] == "GNU":
            desc = note["n_desc"]
            return desc.lower() if isinstance(desc, str) else bytes(desc).hex()
    return None


def build_id_of_stream(stream: BinaryIO) -> str | None:
    """The GNU build ID of an ELF file, or None if it is not ELF or has no build-ID note.

    Section headers are tried first: detached debug files keep the note section but their
    program headers may point at contents that objcopy dropped. A file's are read with
    build_id_of_notes first; pyelftools reads what that cannot.
    """
    with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor
        if found := build_id_of_notes(stream.fileno()):
            return found
    return _build_id_by_pyelftools(stream)


def _build_id_by_pyelftools(stream: BinaryIO) -> str | None:
    """build_id_of_stream's second reader: the notes of sections, then of segments."""
    try:
        elf = ELFFile(stream)
        for section in elf.iter_sections():
            if section["sh_type"] == "SHT_NOTE":
                found = _build_id_from_notes(section.iter_notes())  # type: ignore[attr-defined]
                if found:
                    return found
        for segment in elf.iter_segments():
            if segment["p_type"] == "PT_NOTE":
                found = _build_id_from_notes(segment.iter_notes())  # type: ignore[attr-defined]
                if found:
                    return found
    except OSError:
        return None
    except Exception as e:
        if _malformed(e):
            return None
        raise
    return None


def build_id_of_file(path: Path) -> str | None:
    with path.open("rb") as f:
        return build_id_of_stream(f)


_NT_GNU_BUILD_ID = 3  # n_type of the note that NT_GNU_BUILD_ID names for pyelftools
# At most this many note bytes are read: a build-ID note is a few dozen bytes in one of the
# first sections, and a file that claims more is left to pyelftools.
_MAX_NOTES_BYTES = 1 << 16


def build_id_of_notes(fd: int) -> str | None:
    """The build ID from the section headers' notes, as build_id_of_stream finds it first, read
    with pread and struct: 6.5 us on libc's debug file where pyelftools takes 0.56 ms (its
    structs are built per file), on the path of every download's last byte
    (proxy.artifacts.service) and of every symbol-table build. None when it is not found so,
    or anything about the file is unusual: pyelftools is asked then."""
    headers = read_headers(fd)
    return build_id_of_headers(headers) if headers is not None else None


def build_id_of_reads(read: Read, size: int) -> str | None:
    """build_id_of_notes of a file of `size` bytes that `read(n, offset)` reads."""
    headers = headers_of(read, size)
    return build_id_of_headers(headers) if headers is not None else None


def build_id_of_headers(headers: ElfHeaders) -> str | None:
    """build_id_of_notes, for a file whose headers are read."""
    notes_read = 0
    for section in headers.sections:
        if section.type != SHT_NOTE:
            continue
        align = max(section.align, 4)
        notes_read += section.size
        if notes_read > _MAX_NOTES_BYTES or align not in (4, 8):
            return None
        data = headers.data(section)
        if data is None:
            return None
        found = _gnu_build_id(data, headers.order, align)
        if found is None:
            return None
        if found:
            return found
    return None


def _gnu_build_id(data: bytes, order: str, align: int) -> str | None:
    """The GNU build ID of a note section's notes; "" when it has none; None when its notes
    do not parse."""
    at = 0
    while at + 12 <= len(data):
        namesz, descsz, kind = struct.unpack_from(order + "III", data, at)
        name_at = at + 12
        desc_at = -(-(name_at + namesz) // align) * align  # offsets aligned, from the section
        end = -(-(desc_at + descsz) // align) * align
        if desc_at + descsz > len(data):
            return None
        if kind == _NT_GNU_BUILD_ID and data[name_at: name_at + namesz] == b"GNU\0":
            return data[desc_at: desc_at + descsz].hex() if descsz else None
        at = end
    return "" if at >= len(data) else None


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """A PT_LOAD program header."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    executable: bool


@dataclass(frozen=True, slots=True)
class ElfLayout:
    build_id: str | None
    elf_type: str  # "ET_EXEC", "ET_DYN", ...
    segments: tuple[LoadSegment, ...]
    # Whether the file holds its code's bytes (its allocated executable sections are not
    # SHT_NOBITS); None where no section of any size is one (no section table, no code),
    # which cannot tell.
    holds_code: bool | None = None

    @property
    def load_address(self) -> int:
        """The lowest PT_LOAD address: what symbol-table addresses are relative to."""
        return min((s.vaddr for s in self.segments), default=0)

    @property
    def has_file_layout(self) -> bool:
        """Whether p_offset/p_filesz are real: not a debug file's.

        objcopy --only-keep-debug cuts a segment's file size to the bytes it still holds. That
        is 0 for a code segment of its own (GNU ld since binutils 2.31, lld), but where the
        code shares the first segment with the ELF header, program headers and notes (GNU ld
        -z noseparate-code, the default before 2.31 and on RHEL 8; gold), those are kept and
        the size is theirs: so the sections say, where the file has them, whether the code is
        in the file.
        """
        return (self.holds_code is not False
                and any(s.executable and s.filesz > 0 for s in self.segments))


def _holds_code(sections: Iterable[tuple[int, int, int]]) -> bool | None:
    """Of (sh_type, sh_flags, sh_size) rows: whether the allocated executable sections have
    bytes in the file; None where no section of any size is one (no section table, a stripped
    or odd one, or no code: gold and lld keep a data-only library's empty .text), which cannot
    tell. A debug file's SHT_NOBITS sections keep their sizes."""
    code = SHF_ALLOC | SHF_EXECINSTR
    in_file = [kind != SHT_NOBITS for kind, flags, size in sections
               if flags & code == code and size > 0]
    return any(in_file) if in_file else None


def layout_of_file(path: Path) -> ElfLayout | None:
    """Program headers and build ID of an ELF file, or None if it is not a usable ELF file."""
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        if headers is not None and headers.e_type in E_TYPES:
            segments = tuple(LoadSegment(p.offset, p.vaddr, p.filesz, p.memsz,
                                         bool(p.flags & PF_X))
                             for p in headers.programs if p.type == PT_LOAD)
            build_id = build_id_of_headers(headers) or _build_id_by_pyelftools(f)
            return ElfLayout(build_id, E_TYPES[headers.e_type], segments,
                             _holds_code((s.type, s.flags, s.size) for s in headers.sections))
        try:
            elf = ELFFile(f)
            segments = tuple(
                LoadSegment(
                    offset=seg["p_offset"], vaddr=seg["p_vaddr"], filesz=seg["p_filesz"],
                    memsz=seg["p_memsz"], executable=bool(seg["p_flags"] & PF_X),
                )
                for seg in elf.iter_segments()
                if seg["p_type"] == "PT_LOAD"
            )
            elf_type = str(elf["e_type"])
            # pyelftools names the types it knows: only SHT_NOBITS matters here.
            holds_code = _holds_code(
                (SHT_NOBITS if sec["sh_type"] in ("SHT_NOBITS", SHT_NOBITS) else -1,
                 int(sec["sh_flags"]), int(sec["sh_size"]))
                for sec in elf.iter_sections())
        except (ELFError, ELFParseError, ValueError, KeyError, OSError, EOFError,
                AssertionError):
            return None
        f.seek(0)
        return ElfLayout(build_id_of_stream(f), elf_type, segments, holds_code)


_ADDRESS_END = (1 << 64) - 1  # the last address a 64-bit range may end at
_COLD_SUFFIX = re.compile(r"\.cold(?:\.\d+)?$")


def executable_segments(path: Path | None, build_id: str) -> tuple[LoadSegment, ...] | None:
    """The program headers of the file at `path` when it is an executable (real file offsets)
    with the right build ID, else None; blocking."""
    layout = layout_of_file(path) if path is not None else None
    if layout is None or not layout.has_file_layout or layout.build_id != build_id:
        return None
    return layout.segments


def cold_part(name: str) -> str | None:
    """`main` for `main.cold` or `main.cold.3` (GCC's split-off unlikely code), else None."""
    return _COLD_SUFFIX.sub("", name) if _COLD_SUFFIX.search(name) else None


@dataclass(frozen=True, slots=True)
class FunctionSymbol:
    """An STT_FUNC or STT_GNU_IFUNC symbol of .symtab with a size, in the order the table
    lists them."""

    value: int
    size: int
    bind: int  # STB_LOCAL 0, STB_GLOBAL 1, STB_WEAK 2
    name: str


def function_symbols(path: Path, section: str = ".symtab", *, unsized: bool = False
                     ) -> tuple[FunctionSymbol, ...]:
    """The sized (and `unsized` too), defined STT_FUNC and STT_GNU_IFUNC symbols of `section`
    (.symtab, or an executable's .dynsym), in table order; () without one.

    The symbol array is read with struct, because building a pyelftools object per symbol
    costs 0.2 s for libc's 9,000 symbols; the sections are found by elf_headers, and by
    pyelftools in a file that reader leaves to it.
    """
    kind = SHT_SYMTAB if section == ".symtab" else SHT_DYNSYM
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        if headers is not None:
            symtab = headers.section(section, kind)
            if symtab is None or symtab.link >= len(headers.sections) \
                    or headers.sections[symtab.link].type != SHT_STRTAB:
                return ()
            names = headers.sections[symtab.link]
            if not (symtab.flags | names.flags) & SHF_COMPRESSED:
                data, strtab = headers.data(symtab), headers.data(names)
                if data is None or strtab is None:  # past the end of the file
                    return ()
                return _function_symbols(data, strtab, headers.is64, headers.order, unsized)
        # Compressed tables, and files whose headers only pyelftools reads.
        try:
            elf = ELFFile(f)
            table = elf.get_section_by_name(section)
            if table is None or table["sh_type"] != ("SHT_SYMTAB" if kind == SHT_SYMTAB
                                                     else "SHT_DYNSYM"):
                return ()
            names_section = elf.get_section(table["sh_link"])
            # pyelftools would allocate whatever size a damaged header claims.
            if max(table["sh_size"], names_section["sh_size"]) > os.fstat(f.fileno()).st_size:
                return ()
            strtab = names_section.data()
            data = table.data()
            return _function_symbols(data, strtab, elf.elfclass == 64,
                                     "<" if elf.little_endian else ">", unsized)
        # zlib's error: a compressed table whose stream is not zlib's, which pyelftools
        # inflates as it comes (it escaped the build, an "internal" failure at every profile).
        except (ELFError, ELFParseError, ValueError, KeyError, OSError, EOFError, zlib.error):
            return ()


def _function_symbols(data: bytes, strtab: bytes, is64: bool, order: str,
                      unsized: bool = False) -> tuple[FunctionSymbol, ...]:
    if is64:  # st_name, st_info, st_other, st_shndx, st_value, st_size
        fmt, name_i, info_i, shndx_i, value_i, size_i = order + "IBBHQQ", 0, 1, 3, 4, 5
    else:  # st_name, st_value, st_size, st_info, st_other, st_shndx
        fmt, name_i, info_i, shndx_i, value_i, size_i = order + "IIIBBH", 0, 3, 5, 1, 2
    entry = struct.calcsize(fmt)
    found = []
    for sym in struct.iter_unpack(fmt, data[: len(data) - len(data) % entry]):
        if sym[info_i] & 0xF not in (STT_FUNC, STT_GNU_IFUNC) or not (sym[size_i] or unsized) \
                or not sym[shndx_i]:  # SHN_UNDEF: another file's function
            continue
        start = sym[name_i]
        name = strtab[start: strtab.find(b"\0", start)].decode(errors="replace")
        found.append(FunctionSymbol(sym[value_i], sym[size_i], sym[info_i] >> 4, name))
    return tuple(found)


def exported_functions(path: Path, build_id: str) -> tuple[FunctionSymbol, ...] | None:
    """The functions a stripped executable or shared library exports: its .dynsym's, in that
    table's order (GNU hash order, which a detached debug file does not keep: its .dynsym has
    no contents); () for a stripped program that exports none. None when the file keeps its
    .symtab (which llvm-symbolizer then names code by, as the debug file's own .symtab), or
    when it is not the executable of `build_id`."""
    return exports_of(path) if executable_segments(path, build_id) is not None else None


def exports_of(executable: Path) -> tuple[FunctionSymbol, ...] | None:
    """exported_functions, of a file already known to be the executable."""
    return None if function_symbols(executable) else function_symbols(executable, ".dynsym")


def cold_ranges(symbols: tuple[FunctionSymbol, ...]) -> tuple[tuple[int, int], ...]:
    """[start, end) of every `*.cold` function symbol that ends within the address space
    (a damaged table's may not: its range, recorded with the table, failed every process that
    opened it)."""
    return tuple(sorted((s.value, s.value + s.size) for s in symbols
                        if ".cold" in s.name and cold_part(s.name) is not None
                        and s.value + s.size <= _ADDRESS_END))


def cold_ranges_of_file(path: Path) -> tuple[tuple[int, int], ...]:
    return cold_ranges(function_symbols(path))


# Sections pyelftools walks for section_extent, where section_named could not read the table
# (a header size not the standard one, a name table past its limit): as many as a
# file can have without extended numbering. A hostile file's count is bounded by its size
# alone, and each section costs pyelftools some 17 us, for every section asked of the file.
_MAX_WALK = 0xFFFF


def section_extent(path: Path, name: str) -> tuple[int, int] | None:
    """(file offset, size) of the first section called `name`, as stored (a compressed
    section stays compressed, as elfutils' elf_rawdata gives it); None when the file has no
    such section, or its first is SHT_NOBITS or empty (no bytes in this file: elfutils'
    extract_section finds no data, and looks in the executable, or answers 404), or its header
    puts bytes past the end of the file (elf_rawdata refuses it as an invalid section header,
    and elfutils looks on alike), or the file is not valid ELF."""
    with path.open("rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        fd = f.fileno()
        try:
            found = section_named(lambda n, offset: os.pread(fd, n, offset), file_size,
                                  name.encode("utf-8", "surrogateescape"))
        except UnusualHeaders:
            pass
        else:
            if found is None or found.type == SHT_NOBITS or found.size == 0:
                return None
            return _within(found.offset, found.size, file_size)
        try:
            elf = ELFFile(f)
            for at, section in enumerate(elf.iter_sections()):
                if at == _MAX_WALK:
                    return None
                if section.name == name and _named(elf, section, name):
                    if section["sh_type"] == "SHT_NOBITS" or not section["sh_size"]:
                        return None
                    return _within(int(section["sh_offset"]), int(section["sh_size"]),
                                   file_size)
        except OSError:  # a seek past what the file system takes: an offset made up
            return None
        except Exception as e:
            if _malformed(e):
                return None
            raise
    return None


def _named(elf: ELFFile, section: Section, name: str) -> bool:
    """Whether `section`, whose name pyelftools decodes as `name`, is named by `name`'s bytes:
    pyelftools replaces each byte that is not UTF-8 with U+FFFD, so `.x\xff` decodes as the
    text of `.x\ufffd`, another section's name."""
    if "\ufffd" not in name:
        return True
    names = elf.get_section(elf.get_shstrndx())
    raw = parse_cstring_from_stream(elf.stream, names["sh_offset"] + section["sh_name"])
    return raw == name.encode("utf-8", "surrogateescape")


def _within(offset: int, size: int, file_size: int) -> tuple[int, int] | None:
    """(offset, size) where those bytes are all in the file: a header that claims more (a
    size of terabytes, an offset past what a seek takes) must cost nothing, not the room it
    claims in the cache's budget before the copy finds the file short."""
    return (offset, size) if offset + size <= file_size else None
