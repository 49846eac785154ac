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

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from .elf import PF_X, LoadSegment

_PF_W = 0x2
_SHF_ALLOC = 0x2
# Sections that take memory but no file bytes even in the program itself.
_NO_FILE_BYTES = (".bss", ".tbss", ".lbss", ".sbss")


def lld_layout(path: Path) -> tuple[LoadSegment, ...] | None:
    """The program headers the lld-linked program of the debug file at `path` has, with real
    file offsets and sizes; None when it is not lld's, or the derivation does not check out."""
    try:
        with path.open("rb") as f:
            elf = ELFFile(f)
            comment = elf.get_section_by_name(".comment")
            if comment is None or b"Linker: " not in comment.data() \
                    or b"LLD" not in comment.data():
                return None
            loads = sorted((seg.header for seg in elf.iter_segments()
                            if seg["p_type"] == "PT_LOAD"), key=lambda h: h["p_vaddr"])
            sections = [(s.name, s["sh_addr"], s["sh_size"]) for s in elf.iter_sections()
                        if s["sh_flags"] & _SHF_ALLOC and s["sh_size"]]
    except (ELFError, ELFParseError, ValueError, KeyError, OSError, EOFError):
        return None
    derived = []
    offset = 0
    for h in loads:
        align = max(int(h["p_align"]), 1)
        vaddr, memsz = int(h["p_vaddr"]), int(h["p_memsz"])
        # The first offset at or past the previous segment's bytes congruent to the address.
        offset += (vaddr - offset) % align
        if offset % align != int(h["p_offset"]) % align:
            return None  # not laid out as lld lays out: leave it to the other guess
        filesz = memsz
        if h["p_flags"] & _PF_W:  # its .bss has no file bytes
            filesz = max((addr + size - vaddr for name, addr, size in sections
                          if vaddr <= addr < vaddr + memsz
                          and not name.startswith(_NO_FILE_BYTES)), default=0)
        derived.append(LoadSegment(offset, vaddr, filesz, memsz, bool(h["p_flags"] & PF_X)))
        offset += filesz
    return tuple(derived) if any(s.executable for s in derived) else None
