"""The file layout of an lld-linked program, derived from its detached debug file alone.

Runtime addresses are translated through the program headers' file offsets, which
`objcopy --only-keep-debug` does not keep whole: a debug file's PT_LOAD offsets are the real
ones modulo the segment alignment. GNU ld puts every segment at a file offset equal to its
address (less the load address), which is the guess symtab.TableSpec makes. lld packs the
segments one after another instead: each starts at the first offset past the previous one's
file bytes that is congruent to its address modulo its alignment. So a site's own lld-built
`.debug` tree, without executables, got none of its addresses symbolized.

The debug file says which linker made it (lld writes "Linker: LLD" into .comment) and keeps
every segment's address, size and alignment, and its sections' addresses and sizes; the
derived offsets are then checked against the residues the debug file kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from .elf import PF_X, LoadSegment
from .elf_headers import PT_LOAD, SHF_ALLOC, ElfHeaders, ProgramHeader, read_headers

_PF_W = 0x2
# Sections that take memory but no file bytes even in the program itself.
_NO_FILE_BYTES = (".bss", ".tbss", ".lbss", ".sbss")
# A .comment is a line per tool that made the file: one this big is not read.
_MAX_COMMENT_BYTES = 1 << 20


def lld_layout(path: Path) -> tuple[LoadSegment, ...] | None:
    """The program headers the lld-linked program of the debug file at `path` has, with real
    file offsets and sizes; None when it is not lld's, or the derivation does not check out."""
    try:
        with path.open("rb") as f:
            headers = read_headers(f.fileno())
            found = _from_headers(headers) if headers is not None else _by_pyelftools(f)
    except OSError:
        return None
    if found is None:
        return None
    loads, sections = found
    derived = []
    offset = 0
    for h in sorted(loads, key=lambda h: h.vaddr):
        align = max(h.align, 1)
        # The first offset at or past the previous segment's bytes congruent to the address.
        offset += (h.vaddr - offset) % align
        if offset % align != h.offset % align:
            return None  # not laid out as lld lays out: leave it to the other guess
        filesz = h.memsz
        if h.flags & _PF_W:  # its .bss has no file bytes
            filesz = max((addr + size - h.vaddr for name, addr, size in sections
                          if h.vaddr <= addr < h.vaddr + h.memsz
                          and not name.startswith(_NO_FILE_BYTES)), default=0)
        derived.append(LoadSegment(offset, h.vaddr, filesz, h.memsz, bool(h.flags & PF_X)))
        offset += filesz
    return tuple(derived) if any(s.executable for s in derived) else None


_Found = tuple[list[ProgramHeader], list[tuple[str, int, int]]]


def _is_lld(comment: bytes | None) -> bool:
    return comment is not None and b"Linker: " in comment and b"LLD" in comment


def _from_headers(headers: ElfHeaders) -> _Found | None:
    """The PT_LOAD headers and the allocated sections (name, address, size) of an lld-linked
    file; None when it is not one."""
    comment = headers.section(".comment")
    if comment is None or not _is_lld(headers.data(comment, _MAX_COMMENT_BYTES)):
        return None
    return ([p for p in headers.programs if p.type == PT_LOAD],
            [(s.name, s.addr, s.size) for s in headers.sections
             if s.flags & SHF_ALLOC and s.size])


def _by_pyelftools(f: BinaryIO) -> _Found | None:
    """_from_headers, for a file whose headers only pyelftools reads."""
    try:
        elf = ELFFile(f)
        comment = elf.get_section_by_name(".comment")
        if comment is None or comment["sh_size"] > _MAX_COMMENT_BYTES \
                or not _is_lld(comment.data()):
            return None
        loads = [ProgramHeader(PT_LOAD, int(h["p_flags"]), int(h["p_offset"]),
                               int(h["p_vaddr"]), int(h["p_filesz"]), int(h["p_memsz"]),
                               int(h["p_align"]))
                 for h in (seg.header for seg in elf.iter_segments())
                 if h["p_type"] == "PT_LOAD"]
        sections = [(s.name, int(s["sh_addr"]), int(s["sh_size"])) for s in elf.iter_sections()
                    if s["sh_flags"] & SHF_ALLOC and s["sh_size"]]
    except (ELFError, ELFParseError, ValueError, KeyError, OSError, EOFError):
        return None
    return loads, sections
