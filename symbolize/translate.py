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

import numpy as np
import numpy.typing as npt

from .elf import LoadSegment

_U64_MAX = (1 << 64) - 1


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


def to_vaddrs(
    addresses: npt.NDArray[np.uint64],
    *,
    memory_start: int,
    memory_limit: int,
    file_offset: int,
    segments: Sequence[LoadSegment],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
    """`to_vaddr` of many addresses at once: the vaddrs, and which addresses have one.

    In uint64 arithmetic, with the wrap-arounds that Python's integers do not have ruled out.
    """
    a = addresses
    ok = np.ones(len(a), dtype=np.bool_)
    if memory_limit:
        ok &= (a >= np.uint64(memory_start)) & (a < np.uint64(memory_limit))
    if memory_start == 0 and file_offset == 0:
        return a, ok
    if memory_start >= file_offset:
        shift = np.uint64(memory_start - file_offset)
        ok &= a >= shift
        offset = a - shift
    else:
        shift = np.uint64(file_offset - memory_start)
        ok &= a <= np.uint64(_U64_MAX) - shift
        offset = a + shift
    vaddrs = np.zeros(len(a), dtype=np.uint64)
    found = np.zeros(len(a), dtype=np.bool_)
    for seg in segments:  # the first segment that holds the offset, as to_vaddr takes
        inside = (~found & (offset >= np.uint64(seg.offset))
                  & (offset < np.uint64(min(seg.offset + seg.filesz, _U64_MAX))))
        if seg.vaddr >= seg.offset:
            vaddrs[inside] = offset[inside] + np.uint64(seg.vaddr - seg.offset)
        else:
            vaddrs[inside] = offset[inside] - np.uint64(seg.offset - seg.vaddr)
        found |= inside
    return vaddrs, ok & found
