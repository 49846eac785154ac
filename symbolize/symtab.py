"""Compact symbol tables: Sentry's symbolic SymCache, built once per build ID, then mmapped.

A SymCache holds functions, inline chains, files and lines from DWARF, or, when there is no
DWARF, function names from .symtab/.dynsym (symbolic reads both), so lookups never parse ELF
or DWARF again. Building is blocking, CPU-heavy work: callers run `build_symbol_table` in a
worker process.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from symbolic.debuginfo import Archive
from symbolic.exceptions import SymbolicError
from symbolic.symcache import SYMCACHE_LATEST_VERSION, SymCache

from .chains import Chains, ChainStore, FunctionIds
from .demangle import demangle
from .elf import LoadSegment, cold_part, cold_ranges_of_file, layout_of_file

FORMAT = f"symcache-{SYMCACHE_LATEST_VERSION}"


class NoSymbols(Exception):
    """The file is ELF but has neither DWARF nor a symbol table."""


class MalformedObject(Exception):
    """The file could not be read as an object file."""


@dataclass(frozen=True, slots=True)
class BuildResult:
    load_address: int
    code_ranges: tuple[tuple[int, int], ...]  # [start, end) virtual addresses of code
    cold_ranges: tuple[tuple[int, int], ...]  # [start, end) of GCC's *.cold function parts
    has_lines: bool
    seconds: float
    size: int
    # The source's program headers when their file offsets are real (an executable, or an
    # unstripped binary); None for a detached debug file, whose offsets objcopy zeroed.
    file_layout: tuple[LoadSegment, ...] | None


class Frame(NamedTuple):
    """A NamedTuple rather than a dataclass: it is hashed and compared per location."""

    system_name: str  # as in the symbol table or DWARF linkage name (mangled)
    name: str  # demangled
    filename: str
    line: int


def warm_up() -> None:
    """Run once in each fresh worker: importing this module loaded symbolic already."""


def build_symbol_table(elf_path: Path, out_path: Path, build_id: str) -> BuildResult:
    """Write the SymCache of `elf_path` to `out_path` (atomically); blocking.

    The file must carry `build_id`: a stale local debug tree must not give wrong symbols.
    """
    started = time.perf_counter()
    layout = layout_of_file(elf_path)
    if layout is None:
        raise MalformedObject(f"{elf_path.name}: not an ELF file")
    if layout.build_id != build_id:
        raise MalformedObject(f"{elf_path.name}: build ID {layout.build_id}, not {build_id}")
    try:
        archive = Archive.open(str(elf_path))
        obj = next(iter(archive.iter_objects()))
        features = set(obj.features)
        if not features & {"debug", "symtab"}:
            raise NoSymbols(f"{elf_path.name}: no DWARF and no symbol table")
        cache = obj.make_symcache()
    except (SymbolicError, StopIteration) as e:
        raise MalformedObject(f"{elf_path.name}: {e}") from e
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        cache.dump_into(f)  # type: ignore[no-untyped-call]
    os.replace(tmp, out_path)
    return BuildResult(
        load_address=layout.load_address,
        code_ranges=tuple((s.vaddr, s.vaddr + s.memsz) for s in layout.segments if s.executable),
        cold_ranges=cold_ranges_of_file(elf_path),
        has_lines="debug" in features,
        seconds=time.perf_counter() - started,
        size=out_path.stat().st_size,
        file_layout=layout.segments if layout.has_file_layout else None,
    )


class SymbolTable:
    """Lookups in a built SymCache, by ELF virtual address."""

    def __init__(
        self, path: Path, load_address: int, code_ranges: tuple[tuple[int, int], ...],
        cold_ranges: tuple[tuple[int, int], ...], has_lines: bool, ids: FunctionIds,
    ) -> None:
        self._cache = SymCache.open(str(path))  # type: ignore[no-untyped-call]
        self.load_address = load_address
        self.code_ranges = code_ranges
        self._cold_starts = [start for start, _end in cold_ranges]
        self._cold_ranges = cold_ranges
        self.has_lines = has_lines
        self._chains = ChainStore(ids)

    def guessed_layout(self) -> tuple[LoadSegment, ...]:
        """Program headers when no executable can be had: code at file offset vaddr - base.

        This is how GNU ld lays out the text segment of executables and shared libraries alike.
        """
        return tuple(LoadSegment(start - self.load_address, start, end - start, end - start, True)
                     for start, end in self.code_ranges)

    def _in_cold_part(self, vaddr: int) -> bool:
        i = bisect.bisect_right(self._cold_starts, vaddr) - 1
        return i >= 0 and vaddr < self._cold_ranges[i][1]

    def chains(self, vaddrs: list[int]) -> Chains:
        """The chains of the addresses, remembered; inside a FunctionIds session."""
        return self._chains.chains(vaddrs, self.lookup)

    def lookup(self, vaddr: int) -> tuple[Frame, ...]:
        """Frames innermost (inlined callee) first, the function the code is in last.

        Addresses outside the code segments get no frames: symbolic would otherwise answer
        with the nearest preceding symbol.
        """
        for start, end in self.code_ranges:
            if start <= vaddr < end:
                break
        else:
            return ()
        found = self._cache.lookup(vaddr - self.load_address)
        frames = [
            Frame(system_name=loc.symbol, name=demangle(loc.symbol, loc.lang or ""),
                  filename=loc.full_path or "", line=int(loc.line or 0))
            for loc in found
            if loc.symbol
        ]
        if frames and ".cold" in frames[-1].system_name \
                and (hot := cold_part(frames[-1].system_name)) is not None \
                and not self._in_cold_part(vaddr):
            # symbolic names a function split by GCC after the symbol at its lowest address,
            # the .cold part; the hot body is the function itself (as llvm-symbolizer says).
            last = frames[-1]
            frames[-1] = Frame(hot, demangle(hot), last.filename, last.line)
        return tuple(frames)
