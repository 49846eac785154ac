"""The quick header reader (symbolize.elf_headers) against pyelftools: the same program and
section headers on real files (gcc and lld output, stripped executables, detached debug files,
libc), and on broken files either the same tables or none (then pyelftools is asked), never
an exception. And the readers built on it give what they gave through pyelftools alone."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from elftools.elf.elffile import ELFFile

from symbolize.elf import build_id_of_file, function_symbols, layout_of_file, section_extent
from symbolize.elf_headers import (
    ElfHeaders,
    SectionHeader,
    UnusualHeaders,
    read_headers,
    section_named,
)
from symbolize.lld_layout import lld_layout
from tests.elfs import ElfSet, broken_copies, build_program, on_descriptor, real_elf_files
from tests.libc import LIBC, LIBC_DEBUG

Tables = tuple[list[tuple[int, ...]], list[tuple[object, ...]]]


def quick(path: Path) -> ElfHeaders | None:
    return on_descriptor(path, read_headers)


def tables(h: ElfHeaders) -> Tables:
    # A name's bytes that are not UTF-8 are kept (lone surrogates) where pyelftools puts
    # U+FFFD for each: shown here as pyelftools shows them.
    return ([(p.type, p.flags, p.offset, p.vaddr, p.filesz, p.memsz, p.align)
             for p in h.programs],
            [(s.name.encode(errors="surrogateescape").decode(errors="replace"), s.type,
              s.flags, s.addr, s.offset, s.size, s.link, s.align)
             for s in h.sections])


def by_pyelftools(path: Path) -> Tables:
    with path.open("rb") as f:
        elf = ELFFile(f)
        # pyelftools names the types it knows: its own tables turn them back into numbers.
        p_type = _numbers(elf.structs.Elf_Phdr, "p_type")
        sh_type = _numbers(elf.structs.Elf_Shdr, "sh_type")
        programs = [elf._get_segment_header(i) for i in range(elf.num_segments())]
        sections = [elf.get_section(i) for i in range(elf.num_sections())]
        return ([(p_type(p["p_type"]), p["p_flags"], p["p_offset"], p["p_vaddr"],
                  p["p_filesz"], p["p_memsz"], p["p_align"]) for p in programs],
                [(s.name, sh_type(s["sh_type"]), s["sh_flags"], s["sh_addr"],
                  s["sh_offset"], s["sh_size"], s["sh_link"], s["sh_addralign"])
                 for s in sections])


def _numbers(struct_: Any, field: str) -> Callable[[object], int]:
    mapping = next(c for c in struct_.subcons if c.name == field)
    return lambda value: value if isinstance(value, int) else int(mapping.encoding[value])


def test_the_same_tables_as_pyelftools_on_real_files(elfs: ElfSet) -> None:
    for path in real_elf_files(elfs):
        headers = quick(path)
        assert headers is not None, path
        assert tables(headers) == by_pyelftools(path), path


@pytest.mark.skipif(shutil.which("ld.lld") is None, reason="needs lld (Debian's lld)")
def test_an_lld_linked_program_is_read_as_pyelftools_reads_it(tmp_path: Path) -> None:
    elf = build_program(tmp_path / "src", tmp_path, "lldprog", 3, extra_flags=("-fuse-ld=lld",))
    for path in (elf.executable, elf.debug):
        headers = quick(path)
        assert headers is not None
        assert tables(headers) == by_pyelftools(path)
    layout = lld_layout(elf.debug)
    real = layout_of_file(elf.executable)
    assert layout is not None and real is not None
    assert [s for s in layout if s.executable] == [s for s in real.segments if s.executable]


def test_broken_files_give_pyelftools_tables_or_none(elfs: ElfSet, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    for original in (elfs.prog.debug.read_bytes(), elfs.prog.executable.read_bytes()):
        for data in broken_copies(original, 7):
            broken.write_bytes(data)
            headers = quick(broken)
            if headers is None:
                continue
            try:
                want = by_pyelftools(broken)
                if _names_past_their_table(broken):
                    # pyelftools reads a name on past the end of the name table, to the
                    # next NUL anywhere in the file (`\x7fELF...` for a table of no size
                    # at offset 0); the quick reader keeps to the table: nothing to compare.
                    continue
            except Exception:  # pyelftools raises a spread of types on bad input
                continue  # pyelftools cannot read what we read: nothing to compare
            assert tables(headers) == want, data[:8]


def _names_past_their_table(path: Path) -> bool:
    """Whether a section's name, as pyelftools reads it, runs past the section-name table's
    sh_size (a damaged table, or a damaged sh_name)."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        shstrndx = elf["e_shstrndx"]
        if not isinstance(shstrndx, int) or shstrndx >= elf.num_sections():
            return False
        size = elf._get_section_header(shstrndx)["sh_size"]
        for i in range(elf.num_sections()):
            at = elf._get_section_header(i)["sh_name"]
            f.seek(elf._get_section_header(shstrndx)["sh_offset"] + at)
            if at + len(f.read(size + 1).split(b"\0", 1)[0]) >= size:
                return True
    return False



def test_an_extended_section_count_is_read_as_pyelftools_reads_it(
        elfs: ElfSet, tmp_path: Path) -> None:
    """e_shnum 0 and e_shstrndx SHN_XINDEX, the real values in section 0 (extended numbering,
    which a file of 0xFF00 sections or more must use): left to pyelftools, which a hostile file
    claiming hundreds of thousands of sections held for seconds per section asked of it."""
    data = bytearray(elfs.prog.debug.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    count, names_at = struct.unpack_from("<HH", data, 0x3C)
    struct.pack_into("<HH", data, 0x3C, 0, 0xFFFF)
    struct.pack_into("<Q", data, shoff + 32, count)  # section 0's sh_size, then sh_link
    struct.pack_into("<I", data, shoff + 40, names_at)
    extended = tmp_path / "extended.debug"
    extended.write_bytes(data)
    headers = quick(extended)
    assert headers is not None and tables(headers) == by_pyelftools(extended)
    assert section_extent(extended, ".debug_info") == section_extent(elfs.prog.debug,
                                                                      ".debug_info")
    # A count past what the file holds is not believed (nor read: 2**40 headers).
    struct.pack_into("<Q", data, shoff + 32, 1 << 40)
    extended.write_bytes(data)
    assert quick(extended) is None


def _named(path: Path, name: str) -> SectionHeader | str | None:
    try:
        return on_descriptor(path, lambda fd: section_named(
            lambda n, at: os.pread(fd, n, at), os.fstat(fd).st_size,
            name.encode(errors="surrogateescape")))
    except UnusualHeaders:
        return "unusual"


def test_a_section_is_named_as_the_tables_name_it(elfs: ElfSet, tmp_path: Path) -> None:
    """section_named, which looks at the name column alone, finds the section the whole
    tables give first for each name (and none for a name no section has), on real files and
    on every broken one whose tables are read."""
    broken = tmp_path / "broken"
    files: list[Path] = list(real_elf_files(elfs))
    for i, data in enumerate(broken_copies(elfs.prog.debug.read_bytes(), 5)):
        files.append(broken.with_name(f"broken{i}"))
        files[-1].write_bytes(data)
    for path in files:
        headers = quick(path)
        if headers is None:
            continue
        for name in {s.name for s in headers.sections} | {".nonesuch", ".debug"}:
            assert _named(path, name) == headers.section(name), (path, name)


def test_a_section_past_the_first_65535_of_a_file_of_more_than_2_18_is_found(
        elfs: ElfSet, tmp_path: Path) -> None:
    """A file of more sections than elf_headers reads into its tables (2^18, extended
    numbering) was walked by pyelftools, four seconds for each section asked of it, and only
    up to 0xFFFF sections: a section after those was no section (elfutils serves it)."""
    data = bytearray(elfs.prog.debug.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    count, = struct.unpack_from("<H", data, 0x3C)
    rows = bytearray(data[shoff:shoff + 64 * count])
    info = next(i for i in range(count) if _row_name(data, shoff, i) == b".debug_info")
    total = (1 << 18) + 16
    # Nameless empty sections between the file's own and its .debug_info, moved last.
    rows += bytes(64) * (total - count - 1) + rows[info * 64:info * 64 + 64]
    rows[info * 64:info * 64 + 4] = b"\0\0\0\0"
    struct.pack_into("<Q", rows, 32, total)  # section 0's sh_size: the count
    data += bytes(-len(data) % 8)
    struct.pack_into("<QH", data, 0x28, len(data), 0)
    struct.pack_into("<H", data, 0x3C, 0)
    many = tmp_path / "many.debug"
    many.write_bytes(data + rows)
    assert quick(many) is None
    assert section_extent(many, ".debug_info") == section_extent(elfs.prog.debug,
                                                                 ".debug_info")
    assert section_extent(many, ".nonesuch") is None


def _row_name(data: bytearray, shoff: int, index: int) -> bytes:
    names_at, = struct.unpack_from("<H", data, 0x3E)
    names, = struct.unpack_from("<Q", data, shoff + names_at * 64 + 24)
    at = names + struct.unpack_from("<I", data, shoff + index * 64)[0]
    return bytes(data[at:data.index(b"\0", at)])


def test_the_readers_on_broken_files_answer_as_before_or_say_nothing(
        elfs: ElfSet, tmp_path: Path) -> None:
    """Every reader built on the header tables keeps its contract on damaged input: an answer
    or its 'nothing' (None, ()), never an exception."""
    broken = tmp_path / "broken"
    for data in broken_copies(elfs.prog.debug.read_bytes(), 11):
        broken.write_bytes(data)
        layout_of_file(broken)
        function_symbols(broken)
        function_symbols(broken, ".dynsym")
        lld_layout(broken)
        section_extent(broken, ".debug_info")


def test_symbols_and_layout_of_libc_match_its_tools() -> None:
    """libc's function symbols and program headers as binutils reads them."""
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    symbols = function_symbols(LIBC_DEBUG)
    nm = subprocess.run(["nm", "--defined-only", "-S", str(LIBC_DEBUG)], capture_output=True,
                        text=True, check=True).stdout
    want = {(int(v, 16), int(size, 16), name) for v, size, kind, name in
            (line.split() for line in nm.splitlines() if len(line.split()) == 4)
            if kind in "TtWwi" and int(size, 16)}
    got = {(s.value, s.size, s.name) for s in symbols}
    assert got <= want and len(got) >= 0.95 * len(want)
    layout = layout_of_file(LIBC)
    readelf = subprocess.run(["readelf", "-lW", str(LIBC)], capture_output=True, text=True,
                             check=True).stdout
    loads = [line.split() for line in readelf.splitlines() if line.strip().startswith("LOAD")]
    assert layout is not None
    assert [(s.offset, s.vaddr, s.filesz, s.memsz) for s in layout.segments] == [
        (int(f[1], 16), int(f[2], 16), int(f[4], 16), int(f[5], 16)) for f in loads]


def _patched_section(original: bytes, index: int, field_at: int, fmt: str, value: int
                     ) -> bytes:
    """`original` with one field of section header `index` set (ELF64 little-endian)."""
    shoff, = struct.unpack_from("<Q", original, 0x28)
    at = shoff + index * 64 + field_at
    return original[:at] + struct.pack(fmt, value) + original[at + struct.calcsize(fmt):]


def test_a_damaged_name_table_keeps_the_build_id(elfs: ElfSet, tmp_path: Path) -> None:
    """e_shstrndx past the section count: no section has a name any more, but the build-ID
    note is still found by its type (pyelftools gives up on such a file)."""
    original = elfs.prog.debug.read_bytes()
    path = tmp_path / "no-names"
    path.write_bytes(original[:0x3E] + struct.pack("<H", 0xFFF0) + original[0x40:])
    assert build_id_of_file(path) == elfs.prog.build_id
    layout = layout_of_file(path)
    assert layout is not None and layout.build_id == elfs.prog.build_id
    assert function_symbols(path) == ()


def test_a_symbol_table_must_link_a_string_table(elfs: ElfSet, tmp_path: Path) -> None:
    original = elfs.prog.debug.read_bytes()
    headers = quick(elfs.prog.debug)
    assert headers is not None and function_symbols(elfs.prog.debug)
    index = next(i for i, s in enumerate(headers.sections) if s.name == ".symtab")
    path = tmp_path / "bad-link"
    for link in (0, index):  # the null section, and the table itself
        path.write_bytes(_patched_section(original, index, 40, "<I", link))  # sh_link
        assert function_symbols(path) == ()


def test_a_section_named_like_the_symbol_table_is_passed_over(elfs: ElfSet,
                                                              tmp_path: Path) -> None:
    """The symbols are those of the SHT_SYMTAB called .symtab, not of the first section
    called so."""
    original = elfs.prog.debug.read_bytes()
    headers = quick(elfs.prog.debug)
    assert headers is not None
    symtab = next(i for i, s in enumerate(headers.sections) if s.name == ".symtab")
    decoy = next(i for i, s in enumerate(headers.sections) if 0 < i < symtab
                 and s.type not in (2, 3))
    # The decoy takes the name of .symtab (its sh_name offset).
    name_at, = struct.unpack_from("<I", original, struct.unpack_from("<Q", original, 0x28)[0]
                                  + symtab * 64)
    path = tmp_path / "decoy"
    path.write_bytes(_patched_section(original, decoy, 0, "<I", name_at))
    assert quick(path) is not None and quick(path).sections[decoy].name == ".symtab"  # type: ignore[union-attr]
    assert function_symbols(path) == function_symbols(elfs.prog.debug)


def test_a_section_said_to_be_huge_is_not_read(elfs: ElfSet, tmp_path: Path) -> None:
    original = elfs.prog.debug.read_bytes()
    headers = quick(elfs.prog.debug)
    assert headers is not None
    index = next(i for i, s in enumerate(headers.sections) if s.name == ".symtab")
    path = tmp_path / "huge"
    path.write_bytes(_patched_section(original, index, 32, "<Q", 1 << 29))  # sh_size
    assert function_symbols(path) == ()
    fd = os.open(path, os.O_RDONLY)
    try:
        damaged = read_headers(fd)
        assert damaged is not None and damaged.data(damaged.sections[index]) is None
    finally:
        os.close(fd)


def test_a_section_table_without_code_sections_does_not_say_the_layout_is_a_debug_files(
        elfs: ElfSet, tmp_path: Path) -> None:
    """has_file_layout asks the sections whether the code is in the file (a debug file's code
    is SHT_NOBITS); a table with no code section to ask, here only its null entry, leaves the
    program headers to say, as before."""
    for source, real in ((elfs.prog.executable, True), (elfs.prog.debug, False)):
        data = bytearray(source.read_bytes())
        struct.pack_into("<HH", data, 0x3C, 1, 0)  # ELF64 e_shnum = 1, e_shstrndx = 0
        odd = tmp_path / source.name
        odd.write_bytes(data)
        layout, before = layout_of_file(odd), layout_of_file(source)
        assert layout is not None and before is not None
        assert layout.holds_code is None and before.holds_code is real
        assert layout.has_file_layout is before.has_file_layout is real
