"""Breakpad symbol text, written for symbolic to build a SymCache from where it cannot read an
ELF file's DWARF right: a dwz'd debug file, or GCC's link-time-optimized DWARF 4, which libdw
reads instead (supplementary.py)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TextIO

from .elf import FunctionSymbol

# Breakpad's own module line, which symbolic needs first; the IDs symgate keeps elsewhere.
HEADER = "MODULE Linux unknown 000000000000000000000000000000000 debug\n"


def one_line(name: str) -> str:
    """A name as a Breakpad record's last field, which ends at the line's end: a file's own
    line breaks (a damaged or hostile one's) would start records of their own."""
    return name.replace("\n", " ").replace("\r", " ")


def write_symbols(out: TextIO, symbols: Sequence[FunctionSymbol],
                  covered: Sequence[tuple[int, int]], load_address: int) -> None:
    """The function symbols `symbols` (sized or not, in table order) that start where no
    function of `covered` ([start, end), sorted, apart) is, as symbolic adds a symbol table's
    to a SymCache: the first listed at an address, over its size up to the next function
    (a FUNC without lines), or up to the next symbol where it has none; addresses relative
    to `load_address`."""
    starts = [a for a, _b in covered]
    seen: set[int] = set()
    for s in sorted(symbols, key=lambda s: s.value):  # stable: table order at one address
        i = bisect.bisect_right(starts, s.value) - 1
        if (i >= 0 and s.value < covered[i][1]) or s.value in seen or not s.name.strip() \
                or s.value < load_address:
            continue
        seen.add(s.value)
        if not s.size:
            out.write(f"PUBLIC {s.value - load_address:x} 0 {one_line(s.name)}\n")
            continue
        end = s.value + s.size
        if i + 1 < len(starts):
            end = min(end, starts[i + 1])
        out.write(f"FUNC {s.value - load_address:x} {end - s.value:x} 0 {one_line(s.name)}\n")
