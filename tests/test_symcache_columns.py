"""The bulk reading of SymCaches agrees with symbolic's own lookups, address for address."""

from __future__ import annotations

import functools
import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from symbolic.symcache import SymCache

from symbolize.chains import FunctionIds
from symbolize.demangle import demangle
from symbolize.elf import cold_part
from symbolize.function_names import TableExtras, read_from
from symbolize.pprof.profile_pb2 import Profile
from symbolize.range_index import RangeIndex
from symbolize.rewrite import MappingSymbols
from symbolize.symcache_columns import NONE, UnreadableSymCache, read_columns
from symbolize.symtab import BuildResult, build_symbol_table
from tests.elfs import ElfSet
from tests.libc import LIBC_DEBUG, LIBC_ID
from tests.profiles import Expected
from tests.rewriting import open_table, run_rewrite

Built = tuple[Path, BuildResult]


def _build(tmp: Path, source: Path, build_id: str) -> Built:
    out = tmp / f"{build_id}.symc"
    return out, build_symbol_table(source, out, build_id)


@pytest.fixture(scope="module")
def libc(tmp_path_factory: pytest.TempPathFactory) -> Built:
    assert LIBC_ID
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    return _build(tmp_path_factory.mktemp("libc"), LIBC_DEBUG, LIBC_ID)


def symbolic_frames(cache: SymCache, built: BuildResult, vaddr: int,
                    table: Path | None = None) -> list[Expected]:
    """What one symbolic lookup says of an address, as symgate must report it: nothing outside
    the code, frames without a name left out, and, outside a cold part, the outermost frame
    named as the table's extras chose (else a `.cold`-named one after the function itself);
    code outside every subprogram has the line of the extras' row."""
    if not any(start <= vaddr < end for start, end in built.code_ranges):
        return []
    found = [loc for loc in cache.lookup(vaddr - built.load_address) if loc.symbol]
    frames = [Expected(demangle(loc.symbol, loc.lang or ""), loc.symbol, loc.full_path or "",
                       int(loc.line or 0)) for loc in found]
    in_cold = any(start <= vaddr < end for start, end in built.cold_ranges)
    extras, entries, by_name = _extras(table) if table else (None, {}, {})
    if extras:
        for i, loc in enumerate(found):
            outermost = i == len(found) - 1
            f = entries.get(loc.sym_addr, -1) if outermost else by_name.get(loc.symbol, -1)
            chosen = extras.names.get(f)
            if chosen is not None and not (outermost and in_cold):
                frames[i] = Expected(chosen[0], chosen[1], frames[i].file, frames[i].line)
    if frames and not in_cold and frames[-1].system_name == found[-1].symbol \
            and (hot := cold_part(frames[-1].system_name)) is not None:
        frames[-1] = Expected(demangle(hot), hot, frames[-1].file, frames[-1].line)
    relative = vaddr - built.load_address
    if extras and len(frames) == 1 and not frames[0].file and any(
            a <= relative < b for a, b in extras.orphan_ranges):
        rows = extras.orphan_rows
        row = max((i for i, a in enumerate(rows.address.tolist()) if a <= relative),
                  key=lambda i: int(rows.address[i]), default=None)
        if row is not None and rows.line[row]:
            frames[0] = Expected(frames[0].function, frames[0].system_name, rows.file[row],
                                 int(rows.line[row]))
    return frames


@functools.cache
def _extras(table: Path) -> tuple[TableExtras | None, dict[int, int], dict[str, int]]:
    """The table's extras, and its functions by their entry (relative) and name."""
    columns = read_columns(table)
    entries = columns.function_entry.tolist()
    names = [columns.string(n) for n in columns.function_name.tolist()]
    extras = read_from(table)
    chosen = extras.names if extras else {}
    # By name, only the choices for functions known only inlined: one with code of its own is
    # renamed where it is the outermost frame (to the name a library exports it under).
    return (extras, {e: f for f, e in enumerate(entries)},
            {n: f for f, n in enumerate(names) if f in chosen and entries[f] == NONE})


def _chosen_alike(table: Path, got: list[Expected], want: list[Expected]) -> bool:
    """The same frames, but where symgate's name is one the table's extras chose: symbolic
    shares one function record between a function's code and its inlined copies, so which
    record a frame is cannot be told from symbolic's name alone."""
    extras = _extras(table)[0]
    chosen = set(extras.names.values()) if extras else set()
    return len(got) == len(want) and all(
        (g.file, g.line) == (w.file, w.line)
        and (g == w or (g.function, g.system_name) in chosen)
        for g, w in zip(got, want, strict=True))


def symbolize_elf_relative(built: Built, build_id: str, vaddrs: list[int]) -> Profile:
    """Rewrite a profile of ELF-relative addresses in one mapping of `build_id`."""
    path, result = built
    p = Profile()
    p.string_table.extend(["", "binary", build_id])
    p.mapping.add(id=1, filename=1, build_id=2)
    for i, v in enumerate(vaddrs, start=1):
        p.location.add(id=i, mapping_id=1, address=v)
    ids = FunctionIds()
    table = open_table(path, result, ids)
    return run_rewrite(p.SerializeToString(), {build_id: MappingSymbols(table, ())}, ids)[0]


def probe_addresses(path: Path, built: BuildResult, rng: random.Random, n: int) -> list[int]:
    """Range starts, the bytes just before them, and addresses anywhere in and around code."""
    starts = read_columns(path).range_starts.astype(np.int64) + built.load_address
    picked = rng.sample(starts.tolist(), min(n, len(starts)))
    low = min(s for s, _e in built.code_ranges)
    high = max(e for _s, e in built.code_ranges)
    return sorted({*picked, *(s - 1 for s in picked),
                   *(rng.randrange(max(low - 64, 0), high + 64) for _ in range(n)), 0})


def assert_same_as_symbolic(built: Built, build_id: str, vaddrs: list[int]) -> None:
    cache = SymCache.open(str(built[0]))  # type: ignore[no-untyped-call]
    out = symbolize_elf_relative(built, build_id, vaddrs)
    functions = {f.id: f for f in out.function}
    s = out.string_table
    mismatches = []
    for loc in out.location:
        want = symbolic_frames(cache, built[1], loc.address, built[0])
        got = [Expected(s[functions[ln.function_id].name],
                        s[functions[ln.function_id].system_name],
                        s[functions[ln.function_id].filename], ln.line) for ln in loc.line]
        if got != want and not _chosen_alike(built[0], got, want):
            mismatches.append((hex(loc.address), got, want))
    assert not mismatches, (len(mismatches), mismatches[:3])
    assert sum(bool(loc.line) for loc in out.location) > len(vaddrs) // 4


def test_libc_frames_are_symbolics_at_range_starts_and_anywhere(libc: Built) -> None:
    assert libc[1].cold_ranges  # libc has GCC-split functions: the renaming is exercised
    vaddrs = probe_addresses(libc[0], libc[1], random.Random(11), 40_000)
    assert_same_as_symbolic(libc, LIBC_ID, vaddrs)


def test_gcc_built_frames_are_symbolics(elfs: ElfSet, tmp_path: Path) -> None:
    for elf in elfs.all:
        built = _build(tmp_path, elf.debug, elf.build_id)
        vaddrs = probe_addresses(built[0], built[1], random.Random(5), 2_000)
        assert_same_as_symbolic(built, elf.build_id, vaddrs)


def test_range_index_is_searchsorted() -> None:
    rng = np.random.default_rng(3)
    cases = [np.zeros(0, np.uint32), np.array([5], np.uint32),
             np.array([0, 0, 0, 7, 7, 2**32 - 1], np.uint32),
             np.sort(rng.integers(0, 2**32, 5000, dtype=np.uint64)).astype(np.uint32),
             np.sort(rng.integers(4096, 200_000, 50_000)).astype(np.uint32)]
    for starts in cases:
        queries = (np.concatenate([rng.integers(0, 2**32, 2000), rng.integers(0, 210_000, 2000),
                                   starts, starts.astype(np.int64) - 1, [0, 2**32 - 1]])
                   % 2**32).astype(np.uint32)
        assert np.array_equal(RangeIndex(starts).find(queries),
                              np.searchsorted(starts, queries, side="right") - 1)


def _inlined_into_offset(path: Path, location: int) -> int:
    """Where a source location's inlined-into index is in a version 9 SymCache file: the
    locations follow the header (80 bytes), the files (24 bytes each) and the functions (16
    each), each part aligned to 8; the index is a location's fourth u32."""
    files, functions = struct.unpack_from("<II", path.read_bytes()[:80], 8 + 32 + 4)
    locations = (((80 + files * 24 + 7) & ~7) + functions * 16 + 7) & ~7
    return locations + location * 16 + 12


def _patched(src: Path, dst: Path, offset: int, value: bytes) -> Path:
    shutil.copyfile(src, dst)
    with dst.open("r+b") as f:
        f.seek(offset)
        f.write(value)
    return dst


def test_files_it_cannot_read_are_refused(libc: Built, tmp_path: Path) -> None:
    good = libc[0]
    size = good.stat().st_size
    bad = {
        "not a little-endian SymCache": _patched(good, tmp_path / "magic", 0, b"CMYS"),
        "SymCache version 99": _patched(good, tmp_path / "version", 4, struct.pack("<I", 99)),
        # The source location count (header field 4) made larger than the file holds.
        "do not fit": _patched(good, tmp_path / "counts", 8 + 32 + 12,
                               struct.pack("<I", size)),
    }
    truncated = tmp_path / "short"
    truncated.write_bytes(good.read_bytes()[:40])
    bad["too short"] = truncated
    # Range 0's source location inlined into a location that does not exist.
    inlined_into = _inlined_into_offset(good, read_columns(good).first_range_location)
    bad["inlined-into index is out of range"] = _patched(
        good, tmp_path / "index", inlined_into, struct.pack("<I", 10**9))
    for reason, path in bad.items():
        with pytest.raises(UnreadableSymCache, match=reason):
            read_columns(path)


def _good_and_bad(good_id: str, good: BuildResult, bad_id: str, bad: BuildResult,
                  per_mapping: int) -> Profile:
    """A profile of two mappings, a good table's and a damaged one's, with up to
    `per_mapping` addresses each from the start of its code."""
    p = Profile()
    p.string_table.extend(["", "good", good_id, "bad", bad_id])
    p.mapping.add(id=1, filename=1, build_id=2)
    p.mapping.add(id=2, filename=3, build_id=4)
    for mid, built in ((1, good), (2, bad)):
        start, end = built.code_ranges[0]
        for v in range(start, min(end, start + per_mapping)):
            p.location.add(id=len(p.location) + 1, mapping_id=mid, address=v)
    return p


def test_a_table_whose_links_loop_fails_its_mapping_alone(elfs: ElfSet, tmp_path: Path) -> None:
    good_elf, bad_elf = elfs.prog, elfs.shlib
    good = _build(tmp_path, good_elf.debug, good_elf.build_id)
    bad_path, bad = _build(tmp_path, bad_elf.debug, bad_elf.build_id)
    columns = read_columns(bad_path)
    # Every range's innermost location made inlined into itself.
    data = bytearray(bad_path.read_bytes())
    first = _inlined_into_offset(bad_path, 0)
    for i in range(columns.first_range_location, len(columns.file)):
        struct.pack_into("<I", data, first + i * 16, i)
    looped = tmp_path / "looped.symc"
    looped.write_bytes(bytes(data))

    ids = FunctionIds()
    p = _good_and_bad(good_elf.build_id, good[1], bad_elf.build_id, bad, 200)
    tables = {elf.build_id: MappingSymbols(open_table(path, b, ids), ())
              for elf, (path, b) in ((good_elf, good), (bad_elf, (looped, bad)))}
    out, report = run_rewrite(p.SerializeToString(), tables, ids)
    assert report.mappings_symbolized == 1
    assert report.mappings_skipped["malformed"] == 1
    assert [m.has_functions for m in out.mapping] == [True, False]
    assert all(not loc.line for loc in out.location if loc.mapping_id == 2)
    assert any(loc.line for loc in out.location if loc.mapping_id == 1)


def _symbols_along_walks(path: Path, ranges: list[int]) -> tuple[list[list[str]],
                                                                 list[list[str]]]:
    """For each range: the names the columns give its chain's functions, and symbolic's."""
    c = read_columns(path)
    cache = SymCache.open(str(path))  # type: ignore[no-untyped-call]
    ours, theirs = [], []
    for r in ranges:
        chain, location = [], c.first_range_location + r
        if c.function[location] == c.file[location] == c.line[location] \
                == c.inlined_into[location] == NONE:
            continue  # how symbolic ends its last range: no code, and no frame, there
        while location != NONE and len(chain) < 256:
            chain.append(c.symbol(int(c.function[location])))
            location = int(c.inlined_into[location])
        ours.append(chain)
        theirs.append([loc.symbol for loc in cache.lookup(int(c.range_starts[r]))])
    return ours, theirs


def test_function_names_read_from_the_table_are_symbolics(libc: Built, elfs: ElfSet,
                                                          tmp_path: Path) -> None:
    """symtab.py takes a frame's function name from the columns, asking symbolic only for
    file paths: the two must give the same name for every frame, C++ and inlined ones too."""
    for elf in elfs.all:
        path = _build(tmp_path, elf.debug, elf.build_id)[0]
        ours, theirs = _symbols_along_walks(path, list(range(len(read_columns(path)
                                                                  .range_starts))))
        assert ours == theirs, elf.name
    ranges = len(read_columns(libc[0]).range_starts)
    ours, theirs = _symbols_along_walks(libc[0], random.Random(3).sample(range(ranges), 20_000))
    assert ours == theirs


def test_a_name_the_table_cannot_give_is_a_question_mark_as_symbolics(
        elfs: ElfSet, tmp_path: Path) -> None:
    """symbolic names a function "?" where its string cannot be read: an offset past the
    strings, or bytes that are not UTF-8. The columns must say the same."""
    path = _build(tmp_path, elfs.cpp.debug, elfs.cpp.build_id)[0]
    c = read_columns(path)
    files = struct.unpack_from("<I", path.read_bytes()[:80], 8 + 32 + 4)[0]
    function_table = (80 + files * 24 + 7) & ~7
    leaf = c.first_range_location
    f = int(c.function[leaf])
    assert f != NONE
    name_at = int(c.function_name[f])
    strings_at = len(path.read_bytes()) - len(c.strings) - _trailer_bytes(path)
    cases = {
        "past the strings": _patched(path, tmp_path / "past.symc", function_table + f * 16,
                                     struct.pack("<I", 0xFFFFFFF0)),
        "not UTF-8": _patched(path, tmp_path / "utf8.symc", strings_at + name_at + 1,
                              b"\xff\xfe"),
        # "abc" behind a length of 3 written in eleven bytes: the leb128 crate that symbolic
        # reads it with gives up at the tenth, which may only be 0 or 1.
        "an over-long length": _patched(path, tmp_path / "long.symc", strings_at + name_at,
                                        b"\x83" + b"\x80" * 9 + b"\x00abc"),
    }
    for case, bad in cases.items():
        columns = read_columns(bad)
        cache = SymCache.open(str(bad))  # type: ignore[no-untyped-call]
        theirs = cache.lookup(int(columns.range_starts[0]))[0].symbol
        assert columns.symbol(f) == theirs == "?", case


def _trailer_bytes(path: Path) -> int:
    """What symgate wrote behind the SymCache (function_names.py), which read_columns' view
    of the strings does not reach."""
    symcache = struct.unpack("<QQQ8s", path.read_bytes()[-32:])[2]
    return len(path.read_bytes()) - symcache


def test_a_table_whose_extras_are_damaged_fails_its_mapping_alone(
        elfs: ElfSet, tmp_path: Path) -> None:
    good_elf, bad_elf = elfs.prog, elfs.shlib
    good = _build(tmp_path, good_elf.debug, good_elf.build_id)
    bad_path, bad = _build(tmp_path, bad_elf.debug, bad_elf.build_id)
    blob, rows, symcache, mark = struct.unpack("<QQQ8s", bad_path.read_bytes()[-32:])
    data = bad_path.read_bytes()
    extras = json.loads(data[symcache:symcache + blob])

    def with_extras(name: str, raw: bytes = b"", **changed: object) -> Path:
        damaged = raw or json.dumps({**extras, **changed}).encode()
        out = tmp_path / name
        out.write_bytes(data[:symcache] + damaged + data[symcache + blob:-32]
                        + struct.pack("<QQQ8s", len(damaged), rows, symcache, mark))
        return out

    # JSON still, but not what was written: orphan rows that are not (address, file, line),
    # one whose address is a pair, a number past any integer, nesting past the parser's depth.
    for damaged in (with_extras("file.symc", orphan_rows=[[1, 5, "x"]]),
                    with_extras("pair.symc", orphan_rows=[[[0, 0], "f", 3]]),
                    with_extras("inf.symc", start_lines=[float("inf")]),
                    with_extras("in-file.symc", start_lines_in=[[3, ["a.c", 1]]]),
                    with_extras("in-file-pair.symc", start_lines_in=[[3]]),
                    with_extras("in-file-line.symc", start_lines_in=[[3, {"a.c": "one"}]]),
                    with_extras("deep.symc", b'{"names":' + b"[" * 5000 + b"]" * 5000 + b"}")):
        with pytest.raises(ValueError):
            read_from(damaged)
    broken = with_extras("broken.symc", orphan_rows=[[-1, 5, "x"]])

    ids = FunctionIds()
    p = _good_and_bad(good_elf.build_id, good[1], bad_elf.build_id, bad, 1)
    with pytest.raises(UnreadableSymCache, match="extras"):
        open_table(broken, bad, ids)
    out, report = run_rewrite(p.SerializeToString(), {
        good_elf.build_id: MappingSymbols(open_table(*good, ids), ())}, ids)
    assert report.mappings_symbolized == 1
    assert [m.has_functions for m in out.mapping] == [True, False]
