"""Fedora's MiniDebugInfo: a program stripped to .dynsym keeps, xz-compressed in its
.gnu_debugdata section, a small ELF file whose .symtab names the functions .dynsym lacks (its
static ones). elfutils (eu-addr2line, eu-stack, perf) and gdb name code by it when no debug
file can be had; symbolic does not read it. So a copy of such a program is given one .symtab
of the functions of both tables, which symbolic and function_symbols read as any other."""

from __future__ import annotations

import lzma
import os
import shutil
import struct
from pathlib import Path

from .elf_headers import (
    SHF_COMPRESSED,
    SHT_DYNSYM,
    SHT_STRTAB,
    SHT_SYMTAB,
    ElfHeaders,
    SectionHeader,
    headers_of,
    read_headers,
)

# Fedora's are some tens of KiB inflated; a bound keeps a crafted one from filling memory.
_MAX_INFLATED = 256 << 20
_STT_FUNC, _STT_GNU_IFUNC, _STB_LOCAL = 2, 10, 0


def has_minidebuginfo(headers: ElfHeaders) -> bool:
    """Whether the file carries MiniDebugInfo and no .symtab of its own."""
    return headers.section(".gnu_debugdata") is not None \
        and headers.section(".symtab", SHT_SYMTAB) is None


def with_minidebuginfo(path: Path, copy: Path) -> Path:
    """`copy`, a copy of the program at `path` with a .symtab of its MiniDebugInfo's functions
    and its .dynsym's; `path` itself where it has none that can be read."""
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        if headers is None or not has_minidebuginfo(headers) or len(headers.sections) > 0xFF00:
            return path
        symtab = _merged_symbols(headers)
    if symtab is None:
        return path
    try:
        shutil.copyfile(path, copy)  # in the try: a copy cut short (the disk full) goes too
        with copy.open("r+b") as f:
            _add_symtab(f.fileno(), headers, *symtab)
    except BaseException:
        copy.unlink(missing_ok=True)
        raise
    return copy


def _inflated(headers: ElfHeaders) -> ElfHeaders | None:
    """The headers of the ELF file in .gnu_debugdata; None where it is not a whole xz stream
    of one, of the program's class and byte order."""
    section = headers.section(".gnu_debugdata")
    data = headers.data(section) if section is not None else None
    if data is None:
        return None
    try:
        inflater = lzma.LZMADecompressor(lzma.FORMAT_XZ)
        mini = inflater.decompress(data, _MAX_INFLATED)
    except lzma.LZMAError:
        return None
    if not inflater.eof:
        return None
    found = headers_of(lambda n, offset: mini[offset:offset + n], len(mini))
    if found is None or (found.is64, found.order) != (headers.is64, headers.order):
        return None
    return found


def _table(headers: ElfHeaders, kind: int) -> tuple[list[tuple[int, ...]], bytes,
                                                    tuple[SectionHeader, ...]] | None:
    """The symbols of the file's first table of type `kind`, its names, and its sections."""
    table = next((s for s in headers.sections if s.type == kind), None)
    if table is None or table.link >= len(headers.sections):
        return None
    names = headers.sections[table.link]
    if names.type != SHT_STRTAB or (table.flags | names.flags) & SHF_COMPRESSED:
        return None
    data, strings = headers.data(table), headers.data(names)
    if data is None or strings is None:
        return None
    fmt = _symbol_format(headers)
    size = struct.calcsize(fmt)
    return list(struct.iter_unpack(fmt, data[:len(data) - len(data) % size])), strings, \
        headers.sections


def _symbol_format(headers: ElfHeaders) -> str:
    # ELF64: st_name, st_info, st_other, st_shndx, st_value, st_size; ELF32: st_name,
    # st_value, st_size, st_info, st_other, st_shndx.
    return headers.order + ("IBBHQQ" if headers.is64 else "IIIBBH")


def _merged_symbols(headers: ElfHeaders) -> tuple[bytes, bytes, int] | None:
    """(.symtab's entries, .strtab, index of its first global symbol): the defined functions
    of the MiniDebugInfo's .symtab, locals first, then .dynsym's; their section indexes made
    the program's (the MiniDebugInfo file has fewer sections)."""
    mini = _inflated(headers)
    own = _table(mini, SHT_SYMTAB) if mini is not None else None
    exported = _table(headers, SHT_DYNSYM)
    if own is None:
        return None
    by_name = {s.name: i for i, s in enumerate(headers.sections) if s.name}
    info_at, shndx_at, name_at = (1, 3, 0) if headers.is64 else (3, 5, 0)
    fmt = _symbol_format(headers)
    strings = bytearray(b"\0")
    rows: list[tuple[int, tuple[int, ...]]] = []  # (binding, entry)
    for symbols, names, sections, remap in ((*own, True), *(
            [(*exported, False)] if exported is not None else [])):
        for sym in symbols:
            shndx = sym[shndx_at]
            if sym[info_at] & 0xF not in (_STT_FUNC, _STT_GNU_IFUNC) or not shndx:
                continue
            if remap:
                if shndx >= len(sections) or sections[shndx].name not in by_name:
                    continue
                shndx = by_name[sections[shndx].name]
            start = sym[name_at]
            name = names[start:names.find(b"\0", start)] if start < len(names) else b""
            entry = list(sym)
            entry[name_at], entry[shndx_at] = len(strings), shndx
            strings += name + b"\0"
            rows.append((sym[info_at] >> 4, tuple(entry)))
    if not rows:
        return None
    rows.sort(key=lambda row: row[0] != _STB_LOCAL)  # stable: each table's order kept
    first_global = 1 + sum(1 for binding, _ in rows if binding == _STB_LOCAL)
    null = bytes(struct.calcsize(fmt))
    return null + b"".join(struct.pack(fmt, *entry) for _, entry in rows), bytes(strings), \
        first_global


def _add_symtab(fd: int, headers: ElfHeaders, symbols: bytes, strings: bytes,
                first_global: int) -> None:
    """Append .symtab and .strtab to the file open on `fd`, whose section headers are
    `headers`': their data, a name table with their names, and the section header table
    with two more rows, all at the end; the ELF header pointed at the new table."""
    word = "Q" if headers.is64 else "I"
    layout = (headers.order + "IIQQQQIIQQ") if headers.is64 else (headers.order + "IIIIIIIIII")
    row_size = struct.calcsize(layout)
    shoff_at, shnum_at = (0x28, 0x3C) if headers.is64 else (0x20, 0x30)
    shoff, = struct.unpack(headers.order + word, os.pread(fd, 8 if headers.is64 else 4, shoff_at))
    count, names_index = struct.unpack(headers.order + "HH", os.pread(fd, 4, shnum_at))
    old_rows = os.pread(fd, count * row_size, shoff)
    names_row = list(struct.unpack_from(layout, old_rows, names_index * row_size))
    old_names = os.pread(fd, names_row[5], names_row[4])

    def append(data: bytes) -> int:
        at = -(-os.fstat(fd).st_size // 8) * 8
        os.pwrite(fd, data, at)
        return at

    names = old_names + b".symtab\0.strtab\0"
    names_row[4], names_row[5] = append(names), len(names)
    entry_size = struct.calcsize(_symbol_format(headers))
    symtab_at, strtab_at = append(symbols), append(strings)
    symtab_row = (len(old_names), SHT_SYMTAB, 0, 0, symtab_at, len(symbols), count + 1,
                  first_global, 8 if headers.is64 else 4, entry_size)
    strtab_row = (len(old_names) + len(".symtab\0"), SHT_STRTAB, 0, 0, strtab_at,
                  len(strings), 0, 0, 1, 0)
    rows = bytearray(old_rows)
    struct.pack_into(layout, rows, names_index * row_size, *names_row)
    rows += struct.pack(layout, *symtab_row) + struct.pack(layout, *strtab_row)
    table_at = append(bytes(rows))
    os.pwrite(fd, struct.pack(headers.order + word, table_at), shoff_at)
    os.pwrite(fd, struct.pack(headers.order + "H", count + 2), shnum_at)
