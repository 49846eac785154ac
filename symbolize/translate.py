"""From a sampled address to the ELF virtual address that symbols and DWARF are keyed by.

For an address `a` in a pprof mapping `m` of an ELF file:

    file_offset = a - m.memory_start + m.file_offset

then the PT_LOAD program header `p` with p.offset <= file_offset < p.offset + p.filesz gives

    vaddr = file_offset - p.offset + p.vaddr

This is exact for ET_EXEC and ET_DYN (PIE executables, shared libraries) wherever they were
loaded, and for mappings of a later segment (non-zero file_offset, e.g. a libc text mapping at
file offset 0x26000). Profiles from the OpenTelemetry eBPF profiler carry ELF-relative
addresses with memory_start = 0 and file_offset = 0: there the address already is the vaddr.

The program headers must have real p_offset/p_filesz: those of the executable, because a
detached debug file made by `objcopy --only-keep-debug` zeroes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .elf import LoadSegment


def to_vaddr(
    address: int,
    *,
    memory_start: int,
    memory_limit: int,
    file_offset: int,
    segments: Sequence[LoadSegment],
) -> int | None:
    """The ELF virtual address of a sampled address, or None if it maps to no segment."""
    if memory_limit and not memory_start <= address < memory_limit:
        return None
    if memory_start == 0 and file_offset == 0:
        return address  # ELF-relative already
    offset = address - memory_start + file_offset
    for seg in segments:
        if seg.offset <= offset < seg.offset + seg.filesz:
            return offset - seg.offset + seg.vaddr
    return None
