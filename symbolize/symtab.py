"""Compact symbol tables: Sentry's symbolic SymCache, built once per build ID, then mmapped.

A SymCache holds functions, inline chains, files and lines from DWARF, or, when there is no
DWARF, function names from .symtab/.dynsym (symbolic reads both), so lookups never parse ELF
or DWARF again. Building is blocking, CPU-heavy work: callers run `build_symbol_table` in a
worker process.

Lookups read the SymCache's arrays with numpy (symcache_columns.py), a profile at a time; the
names of functions and files are symbolic's answers, asked once per function and file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
from isal import isal_zlib
from symbolic.debuginfo import Archive
from symbolic.exceptions import SymbolicError
from symbolic.symcache import SYMCACHE_LATEST_VERSION, SymCache

from . import elf, minidebuginfo, zstd
from .chains import Chains, ChainStore, FrameColumns, FunctionIds, FunctionKey
from .demangle import demangle
from .distinct import sorted_distinct
from .dwarf import DwarfFunctions, read_functions
from .elf import (
    FunctionSymbol,
    LoadSegment,
    cold_part,
    executable_segments,
    exports_of,
    function_symbols,
    layout_of_file,
)
from .elf_headers import (
    SHF_ALLOC,
    SHF_COMPRESSED,
    SHF_EXECINSTR,
    SHT_NOBITS,
    SHT_STRTAB,
    SHT_SYMTAB,
    ElfHeaders,
    SectionHeader,
    read_headers,
    shown_section,
)
from .function_names import TableExtras, append_to, choose, read_from
from .function_names import names_from_executable as names_from_executable
from .line_sequences import AWAY, discarded_sequences
from .lld_layout import lld_layout
from .range_index import RangeIndex, sorted_union
from .supplementary import supplement_link, supplement_matches, write_breakpad
from .symcache_columns import NONE, UnreadableSymCache, read_columns

# The SymCache's version, and that of what symgate writes behind it (function_names.py) and
# records beside it (BuildResult; since 5, no debug file's program headers taken for the
# program's: elf.ElfLayout.has_file_layout; since 6, a dwz'd file's DWARF not read, a
# function without a linkage name named after its symbol, and Rust names chosen here demangled
# as Rust; since 7, start lines by file where a name is declared at several lines, line
# sequences of code GNU ld discarded moved off live code, and an eu-stripped debug file's empty
# .symtab replaced by the executable's; since 8, a dwz'd file read whole with its supplementary
# file; since 9, start lines by the file a DWARF 5 unit declares as its file 0, as clang
# declares its functions; since 10, a DWARF name that is no symbol not taken for one a library
# hides; since 11, a C function's asm label, its DWARF linkage name, named where no exported
# name does; since 12, a `.cold` part of a stripped program that exports nothing named after
# its function, as by its .dynsym: such a table's extras read as those of a program that keeps
# .symtab): a table of another format is built again.
FORMAT = f"symcache-{SYMCACHE_LATEST_VERSION}+extras-12"


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
    # unstripped binary); else the executable's, when it was given beside the debug file; else
    # derived exactly (an lld-linked program's debug file: lld_layout); None for another
    # detached debug file, whose offsets objcopy cut to their residues.
    file_layout: tuple[LoadSegment, ...] | None


I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
T = TypeVar("T")
# Inline frames followed out from an address at most: past it, the inlined-into links of a
# damaged table loop. Real chains are tens of frames deep, but a chain of 301 is one gcc -O2
# builds on request, and llvm-symbolizer (and symbolic's own lookup) give it whole.
_MAX_DEPTH = 1 << 12
_KEYS_BATCH = 1 << 16


def build_symbol_table(elf_path: Path, out_path: Path, build_id: str,
                       executable: Path | None = None,
                       supplement: Path | None = None) -> BuildResult:
    """Write the SymCache of `elf_path` to `out_path` (atomically); blocking.

    The file must carry `build_id`: a stale local debug tree must not give wrong symbols.
    `executable`, the executable of `build_id` when it is at hand beside a debug file: its
    .dynsym names exported functions as llvm-symbolizer does (function_names.py); ignored
    when it is not that executable. `supplement`, the supplementary file that dwz gave a debug
    file (supplementary.py), when it is at hand: ignored when it is not the one linked.
    """
    # Read many times over, by path (its headers, symbolic, libdw, pyelftools): held open from
    # the first read and read through that descriptor (a link to it beside the table, a
    # leftover as the table's others), a cached file that another serving process evicts
    # meanwhile is still the file read, not one gone midway, which symbolic reported as a
    # malformed file (believed for malformed_retry_s, a day). Gone before the first read:
    # FileNotFoundError, the caller's to tell.
    fd = os.open(elf_path, os.O_RDONLY)
    held = out_path.with_suffix(f".held.{os.getpid()}.tmp")
    try:
        reading = elf_path
        with contextlib.suppress(OSError):  # no /proc, say: read by its path, as before
            out_path.parent.mkdir(parents=True, exist_ok=True)
            held.unlink(missing_ok=True)
            held.symlink_to(f"/proc/self/fd/{fd}")
            reading = held
        return _build_table(elf_path, reading, out_path, build_id, executable, supplement)
    finally:
        os.close(fd)
        held.unlink(missing_ok=True)


def _build_table(elf_path: Path, reading: Path, out_path: Path, build_id: str,
                 executable: Path | None, supplement: Path | None) -> BuildResult:
    """build_symbol_table, the file read at `reading` (a link to its open descriptor)."""
    started = time.perf_counter()
    layout = layout_of_file(reading)
    if layout is None:
        raise MalformedObject(f"{elf_path.name}: not an ELF file")
    if layout.build_id != build_id:
        raise MalformedObject(f"{elf_path.name}: build ID {layout.build_id}, not {build_id}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # DWARF that dwz moved partly into a supplementary file (.gnu_debugaltlink) is not read
    # whole by symbolic: its functions would be nameless, its lines of the wrong files. With
    # the supplement, libdw reads it for symbolic (supplementary.py); without, it is read for
    # its symbol table alone, as llvm-symbolizer names its code.
    headers = _headers_of(reading)
    if headers is not None and (lying := _inflation_lie(reading)) is not None:
        raise MalformedObject(f"{elf_path.name}: {lying}")
    if headers is not None and headers.sections \
            and not any(s.flags & SHF_EXECINSTR for s in headers.sections):
        # dwz's supplementary file (committed to the cache as any debug file is): no code to
        # name, and its table cost a build worker 0.5 s for libc's, beside a cold profile's.
        raise NoSymbols(f"{elf_path.name}: describes no code (a dwz supplementary file?)")
    supplemented = headers is not None and any(
        s.name in (".gnu_debugaltlink", ".debug_sup") for s in headers.sections)
    link = supplement_link(reading) if supplemented else None
    # A link naming the file's own build ID names no supplement: read as its own, the file's
    # references into it land on its own DIEs, which gives functions other names and files.
    if supplement is not None and (link is None or link.build_id == build_id
                                   or not supplement_matches(supplement, link)):
        supplement = None
    # The executable's program headers, when it is the program of `build_id`: read once, for
    # the eu-strip check and for the names (_second_reading).
    segments = executable_segments(executable, build_id)
    copy = out_path.with_suffix(f".src.{os.getpid()}.tmp")
    inflated = out_path.with_suffix(f".inf.{os.getpid()}.tmp")
    breakpad = out_path.with_suffix(f".sym.{os.getpid()}.tmp")
    inflated_supplement = out_path.with_suffix(f".sup.{os.getpid()}.tmp")
    source = reading
    try:
        # eu-strip (Fedora's and RHEL's find-debuginfo) leaves .symtab in a program whose
        # relocations name it (a static one) and makes the debug file's empty: its functions
        # without DWARF (all of libc's) are named by the executable's, as llvm-symbolizer and
        # eu-addr2line name them.
        if executable is not None and executable != elf_path and segments is not None \
                and headers is not None and _symtab_only_in(executable, headers):
            source = _with_symtab_of(reading, executable, copy)
        # Fedora's programs stripped to .dynsym name their other functions in .gnu_debugdata.
        if source == reading and headers is not None \
                and minidebuginfo.has_minidebuginfo(headers):
            source = minidebuginfo.with_minidebuginfo(source, copy)
        if not supplemented:
            source = _inflated_once(_without_discarded_lines(source, copy, layout), inflated)
            if _gcc_lto_dwarf4(source):
                # symbolic reads GCC's link-time-optimized DWARF 4 wrongly (a function's code
                # named after another in another file: main's as __new_allocator::allocate in
                # new_allocator.h); libdw, as llvm-symbolizer and eu-addr2line, reads it right.
                lines = _zstd_inflated(source, copy)
                with contextlib.suppress(MalformedObject):  # else as symbolic reads it
                    return _build(elf_path, reading, lines, out_path, layout, executable,
                                  segments, read_dwarf=True, supplement=None,
                                  symbolic_source=_as_breakpad(lines, None, breakpad, layout),
                                  started=started)
                source = lines
            return _build(elf_path, reading, source, out_path, layout, executable, segments,
                          read_dwarf=True, supplement=None, symbolic_source=source,
                          started=started)
        if supplement is not None:
            # Read by libdw alone, which reads no zstd-compressed section (before 0.189).
            lines = _zstd_inflated(_without_discarded_lines(source, copy, layout), copy)
            held = _openable_by_libdw(_zstd_inflated(supplement, inflated_supplement),
                                      inflated_supplement)
            try:
                return _build(elf_path, reading, lines, out_path, layout, executable,
                              segments, read_dwarf=True, supplement=held,
                              symbolic_source=_as_breakpad(lines, held, breakpad, layout),
                              started=started)
            except MalformedObject:
                # What libdw read of a damaged file and symbolic would not take: named by
                # its symbols, as without the supplement, rather than not at all.
                source = lines
        bare = _without_dwarf(source, copy)
        return _build(elf_path, reading, bare, out_path, layout, executable, segments,
                      read_dwarf=False, supplement=None, symbolic_source=bare, started=started)
    finally:
        copy.unlink(missing_ok=True)
        inflated.unlink(missing_ok=True)
        breakpad.unlink(missing_ok=True)
        inflated_supplement.unlink(missing_ok=True)


def _as_breakpad(source: Path, supplement: Path | None, out: Path, layout: elf.ElfLayout
                 ) -> Path:
    """`out`, the Breakpad text of `source` as libdw reads it (a dwz'd file with its
    `supplement`), for symbolic."""
    code = [(s.vaddr, s.vaddr + s.memsz) for s in layout.segments if s.executable]
    with out.open("w", encoding="utf-8", errors="replace") as f:
        if not write_breakpad(source, supplement, f, layout.load_address, code,
                              function_symbols(source, unsized=True)):
            raise MalformedObject(f"{source.name}: its DWARF cannot be read with libdw")
    return out


def _build(elf_path: Path, reading: Path, source: Path, out_path: Path, layout: elf.ElfLayout,
           executable: Path | None, segments: tuple[LoadSegment, ...] | None, *,
           read_dwarf: bool, supplement: Path | None, symbolic_source: Path,
           started: float) -> BuildResult:
    # symbolic's build releases the GIL: the second reading of the file runs beside it, but for
    # a small file's, made first in this thread (_beside).
    with _beside(reading) as beside:
        # The source: a debug file's own symbol table, or the executable's (_with_symtab_of).
        second = beside.submit(_second_reading, source, executable, segments, read_dwarf,
                               supplement)
        try:
            # What symbolic reads: the source, or its Breakpad text (_as_breakpad).
            archive = Archive.open(str(symbolic_source))
            obj = next(iter(archive.iter_objects()))
            features = set(obj.features)
            if not features & {"debug", "symtab"}:
                raise NoSymbols(f"{elf_path.name}: no DWARF and no symbol table")
            cache = obj.make_symcache()
        except (SymbolicError, StopIteration) as e:
            raise MalformedObject(f"{elf_path.name}: {e}") from e
    tmp = out_path.with_suffix(f".{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            cache.dump_into(f)  # type: ignore[no-untyped-call]
        # A symbolic that writes another layout fails here, not per lookup.
        columns = read_columns(tmp)
        symbols, dwarf, with_executable, exports, executable_layout = second.result()
        extras = choose(columns, layout.load_address, dwarf, symbols, exports)
        extras.from_executable = with_executable
        append_to(tmp, extras)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out_path)
    return BuildResult(
        load_address=layout.load_address,
        code_ranges=_addressable(tuple((s.vaddr, s.vaddr + s.memsz) for s in layout.segments
                                       if s.executable)),
        cold_ranges=elf.cold_ranges(symbols),
        has_lines="debug" in features,
        seconds=time.perf_counter() - started,
        size=out_path.stat().st_size,
        file_layout=(layout.segments if layout.has_file_layout
                     else executable_layout or lld_layout(reading)),
    )


_LAST_ADDRESS = (1 << 64) - 1


def _addressable(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`ranges` cut at the end of the address space: a damaged program header's segment may
    run past it (p_vaddr + p_memsz), and its end, no uint64, failed every lookup in the
    table (OverflowError out of the rewrite job, at each profile)."""
    return tuple((start, min(end, _LAST_ADDRESS)) for start, end in ranges
                 if start < _LAST_ADDRESS)


# Below this size a file's two readings take a few milliseconds together, less than a thread
# started for the second may wait to be first scheduled on a loaded machine (up to 24 ms a
# build, 0.16 s over a cold profile's 30 builds, as measured): its second is made first, in
# the caller's thread. ld.so's debug file (0.5 MB, 0.1 s of reading) keeps its thread.
_BESIDE_FROM = 1 << 18


def _beside(path: Path) -> Executor:
    """Where the second reading of `path` runs: a thread of its own, or the caller's."""
    try:
        small = os.stat(path).st_size < _BESIDE_FROM
    except OSError:
        small = False  # the build itself reports a file it cannot read
    return _InCaller() if small else ThreadPoolExecutor(max_workers=1)


class _InCaller(Executor):
    """Runs a call at once in the caller's thread; its outcome is had as a thread's would be,
    from the future (a failure only where the build asks for the result)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as e:
            done.set_exception(e)
        return done


def _second_reading(path: Path, executable: Path | None,
                    segments: tuple[LoadSegment, ...] | None, read_dwarf: bool = True,
                    supplement: Path | None = None
                    ) -> tuple[tuple[FunctionSymbol, ...], DwarfFunctions, bool,
                               tuple[FunctionSymbol, ...] | None,
                               tuple[LoadSegment, ...] | None]:
    """The symbol table, the DWARF facts (none unless `read_dwarf`), whether the executable
    of the build ID (whose program headers `segments` are) is at hand, its exports (None
    without it, and when it names code by its .symtab; () for a stripped program that
    exports nothing: function_names.py), and `segments`."""
    symbols = function_symbols(path)
    with_executable = executable is not None and segments is not None
    # A stripped program that exports nothing is named by its (empty) .dynsym all the same:
    # llvm-symbolizer, finding no symbol there, names all its code by DWARF, a `.cold` part
    # after its function (`main`, not the debug file's `main.cold`).
    exports = exports_of(executable) if executable is not None and with_executable else None
    dwarf = read_functions(path, sorted({s.value for s in symbols}), supplement) if read_dwarf \
        else DwarfFunctions()
    return symbols, dwarf, with_executable, exports, segments


def _headers_of(path: Path) -> ElfHeaders | None:
    """The file's section headers; None where it cannot be read or they cannot (the build
    itself then reports what is wrong with the file)."""
    try:
        with path.open("rb") as f:
            return read_headers(f.fileno())
    except OSError:
        return None


def _symtab_only_in(executable: Path, dh: ElfHeaders) -> bool:
    """Whether the debug file of headers `dh` has an empty .symtab (SHT_NOBITS, as eu-strip -f
    leaves it, and its names' too) where `executable`, the program of its build ID, keeps a
    whole one."""
    eh = _headers_of(executable)
    if eh is None or (dh.is64, dh.order) != (eh.is64, eh.order):
        return False
    own = dh.section(".symtab")
    theirs = eh.section(".symtab", SHT_SYMTAB)
    return (own is not None and own.type == SHT_NOBITS and own.link < len(dh.sections)
            and dh.sections[own.link].type == SHT_NOBITS
            and theirs is not None and theirs.size > 0 and theirs.link < len(eh.sections)
            and eh.sections[theirs.link].type == SHT_STRTAB
            and not (theirs.flags | eh.sections[theirs.link].flags) & SHF_COMPRESSED
            and theirs.offset + theirs.size <= eh.file_size
            and eh.sections[theirs.link].offset + eh.sections[theirs.link].size
            <= eh.file_size)


def _with_symtab_of(debug: Path, executable: Path, copy: Path) -> Path:
    """A copy of `debug` whose empty .symtab and names (_symtab_only_in) are the executable's,
    appended to it: symbolic and function_symbols read one file."""
    try:
        shutil.copyfile(debug, copy)  # in the try: see _without_dwarf
        with executable.open("rb") as f:
            eh = read_headers(f.fileno())
            theirs = eh.section(".symtab", SHT_SYMTAB) if eh is not None else None
            if eh is None or theirs is None:
                raise MalformedObject(f"{executable.name}: its symbol table went away")
            symbols, names = eh.data(theirs), eh.data(eh.sections[theirs.link])
        with copy.open("r+b") as f:
            fd = f.fileno()
            dh = read_headers(fd)
            own = dh.section(".symtab") if dh is not None else None
            if dh is None or own is None or symbols is None or names is None:
                raise MalformedObject(f"{debug.name}: its symbol table cannot be replaced")
            _append_section(fd, dh, dh.sections.index(own), symbols, kind=SHT_SYMTAB)
            _append_section(fd, dh, own.link, names, kind=SHT_STRTAB)
    except BaseException:
        copy.unlink(missing_ok=True)
        raise
    return copy


def _without_discarded_lines(path: Path, copy: Path, layout: elf.ElfLayout) -> Path:
    """`path`, or a copy of it (`copy`, which it may be already) whose line sequences of code
    that GNU ld discarded are moved away from the code they overlap (line_sequences.py). A
    zlib-compressed .debug_line (-gz) is written back whole, uncompressed, at the copy's end;
    a .zdebug_line (`objcopy --compress-debug-sections=zlib-gnu`, older distributions' debug
    packages) compressed again, since its readers know it by its name."""
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        if headers is None:
            return path  # not read here: as symbolic reads it
        # Where the code starts: its first section's address (kept in a debug file, whose
        # code sections are NOBITS), not its segment's, which begins at 0 with the ELF header
        # where gold or GNU ld -z noseparate-code (its default off x86) put both in one.
        code_start = min((s.addr for s in headers.sections
                          if s.size and s.flags & _CODE == _CODE), default=0) \
            or min((s.vaddr for s in layout.segments if s.executable), default=0)
        if code_start == 0:  # code at 0: a sequence there may be real
            return path
        lines = headers.section(".debug_line") or headers.section(".zdebug_line")
        data = _section_bytes(headers, lines) if lines is not None else None
    if lines is None or data is None:
        return path  # not read here: as symbolic reads it
    operands = discarded_sequences(data, headers.order, code_start)
    if not operands:
        return path
    table = bytearray(data)
    for at, size in operands:
        struct.pack_into(headers.order + ("Q" if size == 8 else "I"), table, at, AWAY[size])
    try:
        if path != copy:
            shutil.copyfile(path, copy)  # in the try: see _without_dwarf
        with copy.open("r+b") as f:
            if lines.flags & SHF_COMPRESSED:
                _append_section(f.fileno(), headers, headers.sections.index(lines),
                                bytes(table), flags=lines.flags & ~SHF_COMPRESSED)
            elif lines.name == ".zdebug_line":
                _append_section(f.fileno(), headers, headers.sections.index(lines),
                                _GNU_ZLIB + struct.pack(">Q", len(table)) + zlib.compress(table))
            else:
                os.pwrite(f.fileno(), table, lines.offset)
    except BaseException:
        copy.unlink(missing_ok=True)
        raise
    return copy


_CODE = SHF_ALLOC | SHF_EXECINSTR
# A compression header: ch_type, ch_reserved, ch_size, ch_addralign (ELF64); ch_type,
# ch_size, ch_addralign (ELF32).
_CHDR64, _CHDR32 = "IIQQ", "III"
_ELFCOMPRESS_ZLIB = 1
# A .zdebug_* section's own header: this magic, then the inflated size (8 bytes, big-endian).
_GNU_ZLIB = b"ZLIB"


# isal's stubs declare its error an instance of Exception; it is the class.
_INFLATE_ERROR = cast("type[Exception]", isal_zlib.error)


# GCC's DW_AT_producer for the units of a link-time optimization ("GNU GIMPLE 12.2.0 ...").
_LTO_PRODUCER = b"GNU GIMPLE "


def _gcc_lto_dwarf4(path: Path) -> bool:
    """Whether the file's DWARF is GCC's link-time optimization's in DWARF 4 (or older): its
    strings name the LTO producer, and its first unit is of version 2 to 4."""
    try:
        with path.open("rb") as f:
            headers = read_headers(f.fileno())
            if headers is None:
                return False
            strings = headers.section(".debug_str") or headers.section(".zdebug_str")
            info = headers.section(".debug_info") or headers.section(".zdebug_info")
            if strings is None or info is None:
                return False
            text = _section_bytes(headers, strings)
            if text is None or _LTO_PRODUCER not in text:
                return False
            # Its first unit's header alone: an LTO program's .debug_info runs to hundreds
            # of MB, which libdw or symbolic read next anyway.
            units = _section_bytes(headers, info, head=12)
    except OSError:
        return False
    if units is None or len(units) < 12:
        return False
    at = 12 if units[:4] == b"\xff\xff\xff\xff" else 4  # 64-bit DWARF's unit length
    version: int = struct.unpack_from(headers.order + "H", units, at)[0]
    return 2 <= version <= 4


def _section_bytes(headers: ElfHeaders, lines: SectionHeader, head: int | None = None
                   ) -> bytes | None:
    """A debug section's bytes (.debug_line's, .zdebug_line's, any SHF_COMPRESSED or
    .zdebug_ section's), inflated where zlib or zstd compressed them; with `head`, its first
    `head` bytes only, inflating no more than those where zlib did. None where they cannot be
    had (a damaged header, past 1 GiB, zstd without libzstd)."""
    gnu = lines.name.startswith(".zdebug_") and not lines.flags & SHF_COMPRESSED
    if not lines.flags & SHF_COMPRESSED and not gnu:
        if head is None or lines.type == SHT_NOBITS:
            return headers.data(lines)
        return headers.read(min(head, lines.size), lines.offset) \
            if lines.offset + lines.size <= headers.file_size else None
    header = 12 if gnu or not headers.is64 else 24
    if lines.size < header or lines.offset + lines.size > headers.file_size:
        return None
    # A zlib stream's first bytes inflate from its first ones: 64 KiB of it is plenty for a
    # unit's header.
    raw = headers.read(lines.size if head is None else min(lines.size, header + (64 << 10)),
                       lines.offset)
    if gnu:
        kind = _ELFCOMPRESS_ZLIB if raw[:4] == _GNU_ZLIB else 0
        size, = struct.unpack_from(">Q", raw, 4)
    elif headers.is64:
        kind, _reserved, size, _align = struct.unpack_from(headers.order + _CHDR64, raw)
    else:
        kind, size, _align = struct.unpack_from(headers.order + _CHDR32, raw)
    if size > 1 << 30:
        return None
    if kind == zstd.ELFCOMPRESS_ZSTD:
        if head is not None:  # a frame is inflated whole
            raw = headers.read(lines.size, lines.offset)
        whole = zstd.inflate(raw[header:], size)
        return whole[:head] if whole is not None and head is not None else whole
    if kind != _ELFCOMPRESS_ZLIB:
        return None
    try:
        # ISA-L's: 2.5 times zlib's speed on a debug section (libc's 10 MB in 17 ms).
        inflater = isal_zlib.decompressobj()
        out = inflater.decompress(raw[header:], size + 1 if head is None else min(head, size))
    except _INFLATE_ERROR:
        return None
    return out if len(out) == (size if head is None else min(head, size)) else None


# Past this many bytes inflated, a file's copy would cost more disk than its readers' own
# inflation costs CPU: a big C++ program's sections inflate to GiBs.
_INFLATE_AT_MOST = 512 << 20


def _inflated_once(path: Path, out: Path) -> Path:
    """`path`, or a copy of it (`out`) whose compressed debug sections (SHF_COMPRESSED, zlib's
    or zstd's) are written back inflated at its end, for symbolic and libdw to read as they
    are. Each would otherwise inflate them itself: libc's 10 MB cost them 43 ms of zlib each,
    the critical path of a cold profile, where ISA-L inflates them once in 17 ms. And libdw
    0.188 reads no zstd at all: a zstd-compressed file had no start lines and no columns.

    Left as it is where nothing is compressed, or more than _INFLATE_AT_MOST would be written.
    A copy the disk has no room for is given up where the readers would read the same from
    zlib's sections; a zstd section must be read inflated, and the disk's error is raised
    (the build then evicts and tries again, or the profile is refused with 507)."""
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        if headers is None:
            return path
        packed = [(i, s, _compression(headers, s)) for i, s in enumerate(headers.sections)
                  if s.flags & SHF_COMPRESSED and s.name.startswith(".debug_")]
        packed = [(i, s, kind) for i, s, kind in packed
                  if kind in (_ELFCOMPRESS_ZLIB, zstd.ELFCOMPRESS_ZSTD)]
        if not packed or sum(_inflated_size(headers, s) for _i, s, _k in packed) \
                > _INFLATE_AT_MOST:
            return path
        try:
            shutil.copyfile(path, out)
            with out.open("r+b") as w:
                for i, section, _kind in packed:  # one at a time: each is read whole
                    if (data := _section_bytes(headers, section)) is not None:
                        _append_section(w.fileno(), headers, i, data,
                                        flags=section.flags & ~SHF_COMPRESSED)
        except OSError:
            out.unlink(missing_ok=True)
            if any(kind == zstd.ELFCOMPRESS_ZSTD for _i, _s, kind in packed):
                raise
            return path
        except BaseException:
            out.unlink(missing_ok=True)
            raise
    return out


def _inflated_size(headers: ElfHeaders, section: SectionHeader) -> int:
    """The size an SHF_COMPRESSED section's header says it inflates to; 0 if it has none."""
    header = 24 if headers.is64 else 12
    if section.size < header or section.offset + section.size > headers.file_size:
        return 0
    fields = struct.unpack_from(headers.order + (_CHDR64 if headers.is64 else _CHDR32),
                                headers.read(header, section.offset))
    size: int = fields[2] if headers.is64 else fields[1]
    return size


def _zstd_inflated(path: Path, copy: Path) -> Path:
    """`path`, or a copy of it (`copy`, which it may be already) whose zstd-compressed debug
    sections (`objcopy --compress-debug-sections=zstd`, `gcc -gz=zstd`) are written back
    inflated at its end, for libdw 0.188, which reads them as missing. One that cannot be
    inflated is left as it is: libdw reads the file as without it."""
    with path.open("rb") as f:
        headers = read_headers(f.fileno())
        packed = [i for i, s in enumerate(headers.sections)
                  if s.flags & SHF_COMPRESSED and s.name.startswith(".debug_")
                  and _compression(headers, s) == zstd.ELFCOMPRESS_ZSTD] \
            if headers is not None else []
        if headers is None or not packed:
            return path
        try:
            if path != copy:
                shutil.copyfile(path, copy)  # in the try: see _without_dwarf
            with copy.open("r+b") as out:
                for i in packed:  # one at a time: a big file's sections inflate to GiBs
                    section = headers.sections[i]
                    if (data := _section_bytes(headers, section)) is not None:
                        _append_section(out.fileno(), headers, i, data,
                                        flags=section.flags & ~SHF_COMPRESSED)
        except BaseException:
            copy.unlink(missing_ok=True)
            raise
    return copy


_STANDALONE = (".debug_info", ".debug_line", ".debug_frame")
# The sections of _openable_by_libdw's file: none, its strings, a line table, their names.
_NAMES = b"\0.debug_str\0.debug_line\0.shstrtab\0"
_SHT_PROGBITS = 1


def _openable_by_libdw(supplement: Path, out: Path) -> Path:
    """`supplement`, or where dwz moved nothing but strings into it (the debug files shared no
    unit: its .debug_str alone), a small ELF file `out` (which it may be) of that .debug_str
    and a one-byte .debug_line: libdw opens no file without .debug_info, .debug_line or
    .debug_frame, and the debug file's DW_FORM_GNU_strp_alt names could not be read. No
    reference reads the supplement's line table: only its units would."""
    with supplement.open("rb") as f:
        headers = read_headers(f.fileno())
        strings = headers.section(".debug_str") if headers is not None else None
        if headers is None or strings is None or strings.type == SHT_NOBITS \
                or strings.offset + strings.size > headers.file_size \
                or any(headers.section(name) for name in _STANDALONE):
            return supplement
        head = bytearray(headers.read(64 if headers.is64 else 52, 0))
        data = headers.read(strings.size, strings.offset)  # as stored: libdw inflates zlib
    order, word = headers.order, "Q" if headers.is64 else "I"
    row = order + ("IIQQQQIIQQ" if headers.is64 else "IIIIIIIIII")
    at_strings = len(head)
    at_line = at_strings + len(data)
    at_names = at_line + 1
    at_rows = -(-(at_names + len(_NAMES)) // 8) * 8
    rows = [bytes(struct.calcsize(row)),
            struct.pack(row, 1, _SHT_PROGBITS, strings.flags, 0, at_strings, len(data), 0, 0,
                        max(strings.align, 1), 0 if strings.flags & SHF_COMPRESSED else 1),
            struct.pack(row, 12, _SHT_PROGBITS, 0, 0, at_line, 1, 0, 0, 1, 0),
            struct.pack(row, 24, SHT_STRTAB, 0, 0, at_names, len(_NAMES), 0, 0, 1, 0)]
    # e_phoff, e_shoff; e_phnum, e_shentsize, e_shnum, e_shstrndx.
    fields = (0x20, 0x28, 0x38) if headers.is64 else (0x1C, 0x20, 0x2C)
    struct.pack_into(order + word + word, head, fields[0], 0, at_rows)
    struct.pack_into(order + "HHHH", head, fields[2], 0, struct.calcsize(row), len(rows), 3)
    try:
        with out.open("wb") as w:
            w.write(b"".join((head, data, b"\0", _NAMES,
                              bytes(at_rows - at_names - len(_NAMES)), *rows)))
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


# Deflate makes at most 258 bytes of a 2-bit code: a zlib stream inflates to at most some
# 1032 times its size. A compression header that claims more lies, and symbolic allocates
# what it claims, before inflating a byte: a 20-byte stream claiming 1 GiB took a build a GiB
# for each such section, and one claiming 2^48 bytes aborted it.
_ZLIB_MAX_RATIO = 1032
_ZLIB_SLACK = 1 << 10


def _inflation_lie(path: Path) -> str | None:
    """What is wrong with a zlib-compressed section (SHF_COMPRESSED, or a .zdebug_ one) whose
    header claims more than its stream can inflate to; None where none does."""
    try:
        with path.open("rb") as f:
            headers = read_headers(f.fileno())
            return _lie_in(headers) if headers is not None else None
    except OSError:
        return None  # the build itself reports a file it cannot read


def _lie_in(headers: ElfHeaders) -> str | None:
    for section in headers.sections:
        if section.type == SHT_NOBITS or section.offset + section.size > headers.file_size:
            continue  # no bytes of its own here: nobody inflates it
        if section.flags & SHF_COMPRESSED:
            if _compression(headers, section) != _ELFCOMPRESS_ZLIB:
                continue
            claimed = _inflated_size(headers, section)
        elif section.name.startswith(".zdebug_") and section.size >= 12:
            head = headers.read(12, section.offset)
            if head[:4] != _GNU_ZLIB:
                continue
            claimed, = struct.unpack_from(">Q", head, 4)
        else:
            continue
        if claimed > section.size * _ZLIB_MAX_RATIO + _ZLIB_SLACK:
            # The name as text every store takes: a byte that is not UTF-8 is a lone
            # surrogate in it (elf_headers), which SQL refused with the build's failure.
            return (f"section {shown_section(section.name)} claims to inflate to {claimed} "
                    f"bytes, from {section.size}")
    return None


def _compression(headers: ElfHeaders, section: SectionHeader) -> int:
    """The ch_type of an SHF_COMPRESSED section's compression header; 0 if it has none."""
    if section.size < 4 or section.offset + section.size > headers.file_size:
        return 0
    kind: int = struct.unpack_from(headers.order + "I", headers.read(4, section.offset))[0]
    return kind


def _append_section(fd: int, headers: ElfHeaders, index: int, data: bytes, *,
                    kind: int | None = None, flags: int | None = None) -> None:
    """Write `data` at the end of the file open on `fd` (8-aligned) and point section
    `index`'s header at it, with a new type and flags where given."""
    word = "Q" if headers.is64 else "I"
    shoff, = struct.unpack_from(headers.order + word,
                                os.pread(fd, 8, 0x28 if headers.is64 else 0x20))
    row = shoff + index * (64 if headers.is64 else 40)
    # sh_type's, sh_flags', sh_offset's and sh_size's offsets in a section header.
    type_at, flags_at, offset_at, size_at = (4, 8, 24, 32) if headers.is64 else (4, 8, 16, 20)
    at = -(-os.fstat(fd).st_size // 8) * 8
    os.pwrite(fd, data, at)
    if kind is not None:
        os.pwrite(fd, struct.pack(headers.order + "I", kind), row + type_at)
    if flags is not None:
        os.pwrite(fd, struct.pack(headers.order + word, flags), row + flags_at)
    os.pwrite(fd, struct.pack(headers.order + word, at), row + offset_at)
    os.pwrite(fd, struct.pack(headers.order + word, len(data)), row + size_at)


def _without_dwarf(path: Path, copy: Path) -> Path:
    """A copy of the ELF file at `path` whose debug sections are renamed (`.debug_info` to
    `.xxxxx_info`), so that symbolic builds its table from the symbol table alone."""
    try:
        # In the try: a copy cut short (the disk full) is the size of what it took, and its
        # name stays until this process ends (disk.clear_symtab_temp spares a live writer's).
        if path != copy:  # else already a copy (_with_symtab_of's)
            shutil.copyfile(path, copy)
        with copy.open("r+b") as f:
            headers = read_headers(f.fileno())
            names = headers.section(".shstrtab", SHT_STRTAB) if headers is not None else None
            data = headers.data(names) if headers is not None and names is not None else None
            if names is None or data is None:
                raise MalformedObject(f"{path.name}: no readable section names")
            os.pwrite(f.fileno(), data.replace(b"debug_", b"xxxxx_"), names.offset)
    except BaseException:
        copy.unlink(missing_ok=True)
        raise
    return copy


@dataclass(frozen=True, slots=True)
class TableSpec:
    """A built table as its file and what its build recorded: all a process needs to open it,
    small enough to send to a worker process (which opens the file itself)."""

    path: Path
    load_address: int
    code_ranges: tuple[tuple[int, int], ...]
    cold_ranges: tuple[tuple[int, int], ...]
    has_lines: bool

    def guessed_layout(self) -> tuple[LoadSegment, ...]:
        """Program headers when no executable can be had: code at file offset vaddr - base.

        This is how GNU ld lays out the text segment of executables and shared libraries alike.
        """
        return tuple(LoadSegment(start - self.load_address, start, end - start, end - start, True)
                     for start, end in self.code_ranges)


class SymbolTable:
    """Lookups in a built SymCache, by ELF virtual address, many at a time.

    Code is cut in pieces: at every start of a SymCache range (one innermost source location)
    and wherever the column of the line table changes, which symbolic does not record. An
    address's frames are named by a key: 0 for none; 1 + the index of its piece for an
    address inside a GCC `.cold` part, whose outermost frame is named after its `.cold` symbol
    (as symbolic does), or, where names came from a stripped executable's .dynsym, after the
    function, as its inlined frames are (by DWARF); that plus the number of pieces for any
    other address, whose outermost frame may be named after an exported symbol instead
    (function_names.py chose both), and after the function where symbolic names it after its
    `.cold` part. Past those, 1 + 2 * pieces +
    the index of the line row that gives the line of code outside every subprogram
    (function_names.py), plus the number of such rows where that code is in a `.cold` part
    (named as the pieces of one are: a split-DWARF program's). The innermost frame has its
    piece's column where a line row covers it; the frames it is inlined into none (their
    DW_AT_call_column is not read).
    """

    def __init__(
        self, path: Path, load_address: int, code_ranges: tuple[tuple[int, int], ...],
        cold_ranges: tuple[tuple[int, int], ...], has_lines: bool, ids: FunctionIds,
    ) -> None:
        try:
            self._cache = SymCache.open(str(path))  # type: ignore[no-untyped-call]
        except SymbolicError as e:
            # Damaged on disk: this table alone is unusable. symbolic's own error must not
            # leave a worker process: it cannot be unpickled, and breaks the whole pool.
            raise UnreadableSymCache(f"{path.name}: symbolic cannot read it ({e})") from e
        self._columns = read_columns(path)
        try:
            self._extras = read_from(path) or TableExtras()
        except ValueError as e:  # damaged behind the SymCache: this table alone is unusable
            raise UnreadableSymCache(f"{path.name}: its extras are unreadable ({e})") from e
        starts, extras = self._columns.range_starts, self._extras
        pieces = sorted_union(starts, extras.column_starts) \
            if len(extras.column_starts) else starts
        self._pieces = len(pieces)
        self._piece_range = (np.searchsorted(starts, pieces, side="right") - 1).astype(np.int32)
        at = np.searchsorted(extras.column_starts, pieces, side="right") - 1
        self._piece_column = np.where(at >= 0, extras.columns[np.maximum(at, 0)], 0).astype(
            np.uint16) if len(extras.columns) else np.zeros(len(pieces), np.uint16)
        self._ranges = RangeIndex(pieces)
        # Per piece, what `keys` asks of its range's source location, asked once here rather
        # than gathered from the SymCache's strided table at every address of every profile
        # (four to six gathers of random rows: some 5 ms of a profile of 100,000 addresses).
        c = self._columns
        leaf = c.first_range_location + np.maximum(self._piece_range, 0).astype(np.int64)
        no_file = c.file[leaf] == NONE
        outermost = c.inlined_into[leaf] == NONE
        # symbolic ends the last range with a location that is all NONE: no code there.
        empty = no_file & outermost & (c.function[leaf] == NONE) & (c.line[leaf] == NONE)
        self._piece_code = (self._piece_range >= 0) & ~empty
        self._piece_lineless = self._piece_code & no_file & outermost
        self.load_address = load_address
        self.code_ranges = _addressable(code_ranges)  # as recorded before, too
        # A range past the address space, as a damaged .symtab recorded before symgate left
        # those out (elf.cold_ranges), cannot be a uint64: without it, the table opens.
        self._cold = np.array([r for r in cold_ranges if r[1] <= _LAST_ADDRESS],
                              dtype=np.uint64).reshape(-1, 2)
        self.has_lines = has_lines
        self._orphan_ranges = np.array(extras.orphan_ranges, dtype=np.uint64).reshape(-1, 2)
        rows = extras.orphan_rows
        self._orphan_rows, self._orphan_lines = rows.address, rows.line
        orphan_files = sorted(set(rows.file))
        # Their files are numbered after the SymCache's, and after NONE's stand-in.
        first = self._columns.files + 1
        number = {f: first + i for i, f in enumerate(orphan_files)}
        self._orphan_files = np.array([number[f] for f in rows.file], dtype=np.int64)
        # symbolic's names: function index -> (system name, demangled); file index -> path.
        self._function_names: dict[int, tuple[str, str]] = {NONE: ("", "")}
        self._paths: dict[int, str] = {NONE: "", **{first + i: f
                                                    for i, f in enumerate(orphan_files)}}
        self._file_span = first + len(orphan_files)
        self._chains = ChainStore(ids, keys=2 * self._pieces + 1 + 2 * len(extras.orphan_rows))

    @classmethod
    def open(cls, spec: TableSpec, ids: FunctionIds) -> SymbolTable:
        return cls(spec.path, spec.load_address, spec.code_ranges, spec.cold_ranges,
                   spec.has_lines, ids)

    def chains(self, vaddrs: U64) -> Chains:
        """The chains of the addresses, remembered; inside a FunctionIds session."""
        keys = np.empty(len(vaddrs), dtype=np.int64)
        # A batch at a time: a lookup's temporaries are a dozen arrays the size of its input,
        # 60 MB at once for a million addresses, twice the profile they came in.
        for start in range(0, len(vaddrs), _KEYS_BATCH):
            keys[start:start + _KEYS_BATCH] = self.keys(vaddrs[start:start + _KEYS_BATCH])
        return self._chains.chains(keys, self._frames)

    def keys(self, vaddrs: U64) -> I64:
        """The key of each address's frames (see the class).

        Addresses outside the code segments get none: symbolic would otherwise answer with
        the nearest preceding symbol.
        """
        if not self._pieces:
            # A table of no range at all (a program whose symbol names symbolic could not
            # read): the lookups below index its empty per-piece arrays.
            return np.zeros(len(vaddrs), dtype=np.int64)
        inside = np.zeros(len(vaddrs), dtype=np.bool_)
        for start, end in self.code_ranges:
            inside |= (vaddrs >= np.uint64(start)) & (vaddrs < np.uint64(end))
        # Code segments lie at or above the load address, so this does not wrap where it counts.
        relative = vaddrs - np.uint64(self.load_address)
        inside &= relative <= np.uint64(NONE)
        piece = self._ranges.find(np.where(inside, relative, 0).astype(np.uint32))
        inside &= piece >= 0
        at = np.maximum(piece, 0)
        inside &= self._piece_code[at]
        keys = piece + 1
        keys[~self._in_cold_part(vaddrs)] += self._pieces
        if len(self._orphan_rows):
            # Only addresses whose piece has no line can be in code outside every subprogram.
            lineless = np.flatnonzero(inside & self._piece_lineless[at])
            row = self._orphan_row(relative[lineless])
            orphan = row >= 0
            # A row in a GCC `.cold` part keeps that part's naming: its rows numbered after
            # the others'.
            cold = keys[lineless[orphan]] <= self._pieces
            keys[lineless[orphan]] = 1 + 2 * self._pieces + row[orphan] \
                + np.where(cold, len(self._orphan_rows), 0)
        keys[~inside] = 0
        return keys

    def _orphan_row(self, relative: U64) -> I64:
        """The line row of each address in code outside every subprogram, else -1."""
        spans = self._orphan_ranges
        i = np.searchsorted(spans[:, 0], relative, side="right") - 1
        within = (i >= 0) & (relative < spans[np.maximum(i, 0), 1])
        row = np.searchsorted(self._orphan_rows, relative, side="right") - 1
        ok = within & (row >= 0)
        ok[ok] &= self._orphan_lines[row[ok]] > 0  # past a sequence's end: no line
        return np.where(ok, row, -1)

    def _in_cold_part(self, vaddrs: U64) -> npt.NDArray[np.bool_]:
        i = np.searchsorted(self._cold[:, 0], vaddrs, side="right") - 1
        return (i >= 0) & (vaddrs < self._cold[np.maximum(i, 0), 1]) if len(self._cold) \
            else np.zeros(len(vaddrs), dtype=np.bool_)

    def _frames(self, keys: I64) -> FrameColumns:
        """The frames of the keys' chains: innermost (inlined callee) first, the function the
        code is in last."""
        c = self._columns
        pieces = self._pieces
        orphan = keys > 2 * pieces
        rows = len(self._orphan_rows)
        cold_orphan = keys > 2 * pieces + rows
        row = np.where(orphan, keys - 1 - 2 * pieces - np.where(cold_orphan, rows, 0), 0)
        renamed = (keys > pieces) & ~cold_orphan
        piece = np.where(orphan, 0, keys - 1 - np.where(renamed, pieces, 0))
        if orphan.any():  # the piece of the row's address: its SymCache location names it
            piece[orphan] = np.maximum(
                self._ranges.find(self._orphan_rows[row[orphan]].astype(np.uint32)), 0)
        leaf = c.first_range_location + np.maximum(self._piece_range[piece], 0).astype(np.int64)
        owner, location = self._walk(leaf)
        function = c.function[location].astype(np.int64)
        file = c.file[location].astype(np.int64)
        line = c.line[location].astype(np.uint64)
        line[line == NONE] = 0
        self._learn_names(leaf, owner, function, file, line)
        if orphan.any():  # chains of one frame: its line is the row's
            from_row = orphan[owner]
            file[from_row] = self._orphan_files[row[owner[from_row]]]
            line[from_row] = self._orphan_lines[row[owner[from_row]]]
        outermost = np.append(owner[1:] != owner[:-1], True)
        innermost = np.ones(len(owner), dtype=np.bool_)
        innermost[1:] = owner[1:] != owner[:-1]
        # A frame of no line row (no file: code without DWARF) has no column either. Past
        # the end of a line sequence no row holds, but the sequence's last row may sit at its
        # end address (GCC's, after a call that does not return), and its column ran on into
        # the code after (_start, after main in a g++ -O2 program, had main's column 19).
        column = np.where(innermost & (file != NONE), self._piece_column[piece][owner],
                          0).astype(np.uint64)
        # One FunctionKey per (function, file, outermost in a hot or a cold part), and frames
        # without a name dropped.
        hot = outermost & renamed[owner]
        triple = (function * self._file_span + np.where(file == NONE, c.files, file)) * 4 \
            + hot + 2 * (outermost & ~hot)
        unique, first, inverse = np.unique(triple, return_index=True, return_inverse=True)
        functions: list[FunctionKey] = []
        named = np.ones(len(unique), dtype=np.bool_)
        extras = self._extras
        for u, at in enumerate(first.tolist()):
            f = int(function[at])
            system_name, name = self._function_names[f]
            kind = unique[u] & 3  # 1: outermost in a hot part, 2: in a cold part
            if not system_name:
                named[u] = False
            elif kind == 2 and not extras.from_dynsym:
                pass  # after the .cold symbol, as llvm-symbolizer names it by a .symtab
            elif (chosen := extras.name(f, kind == 1)) is not None:
                name, system_name = chosen
            elif kind and (hot_name := cold_part(system_name)) is not None:
                # symbolic names a function split by GCC after the symbol at its lowest
                # address, the .cold part; the hot body is the function itself, and so is the
                # cold part by a stripped executable's .dynsym, which has no .cold symbol (as
                # llvm-symbolizer says).
                system_name, name = hot_name, demangle(hot_name)
            path = self._paths[int(file[at])]
            functions.append((name, system_name, path, extras.start_line(f, path)))
        index = np.cumsum(named) - 1
        keep = named[inverse]
        return FrameColumns(chains=len(keys), owner=owner[keep], function=index[inverse][keep],
                            line=line[keep], column=column[keep], functions=functions)

    def _walk(self, leaf: I64) -> tuple[I64, I64]:
        """(chain, source location) of every frame of the chains from `leaf`: chains in order,
        innermost first within each."""
        inlined_into = self._columns.inlined_into
        owners, locations = [], []
        owner, location = np.arange(len(leaf)), leaf
        for _depth in range(_MAX_DEPTH):
            if not len(location):
                break
            owners.append(owner)
            locations.append(location)
            up = inlined_into[location]
            more = up != NONE
            owner, location = owner[more], up[more].astype(np.int64)
        if len(location):  # symbolic's own walk of these links would never end
            raise UnreadableSymCache(f"inlined-into links loop or nest over {_MAX_DEPTH} deep")
        all_owners = np.concatenate(owners)
        order = np.argsort(all_owners, kind="stable")  # stable: depth order within a chain
        return all_owners[order], np.concatenate(locations)[order]

    def _learn_names(self, leaf: I64, owner: I64, function: I64, file: I64,
                     line: U64) -> None:
        """Name the functions and files not named yet.

        A function's name is read from the SymCache, as symbolic's lookup gives it. A file's
        path is symbolic's (its lookup joins and cleans the file's three parts): one lookup at
        the start of a chain's range names every file of that chain. Its answer must have the
        frames, lines and function names the arrays have, or they were misread.
        """
        c = self._columns
        names, paths = self._function_names, self._paths
        for f in sorted_distinct(function).tolist():
            if f not in names:
                symbol = c.symbol(f)
                names[f] = (symbol, demangle(symbol, "rust" if c.is_rust(f) else ""))
        values, first = np.unique(file, return_index=True)
        unknown = [i for v, i in zip(values.tolist(), first.tolist(), strict=True)
                   if v not in paths]
        if not unknown:
            return
        bounds = np.searchsorted(owner, np.arange(len(leaf) + 1)).tolist()
        functions, files, lines = function.tolist(), file.tolist(), line.tolist()
        owners, leaves = owner.tolist(), leaf.tolist()
        for i in unknown:
            if files[i] in paths:
                continue
            chain = owners[i]
            start, end = bounds[chain], bounds[chain + 1]
            found = self._cache.lookup(int(c.range_starts[leaves[chain] - c.first_range_location]))
            answered = [int(f.line or 0) for f in found]
            if len(found) != end - start or [n if n != NONE else 0 for n in answered] \
                    != lines[start:end]:
                raise UnreadableSymCache(
                    f"symbolic answers {len(found)} frames where the arrays have {end - start}")
            if any(f != NONE and (loc.symbol or "") != names[f][0]
                   for f, loc in zip(functions[start:end], found, strict=True)):
                raise UnreadableSymCache("symbolic names a frame otherwise than its SymCache")
            for x, loc in zip(files[start:end], found, strict=True):
                paths.setdefault(x, loc.full_path or "")
