"""Issue 14 (6): large profiles cost in proportion to their size, in time and memory."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from symbolize import fallback
from symbolize.chains import ChainStore, FrameColumns, FunctionIds
from symbolize.elf import layout_of_file
from symbolize.pprof.codec import encode
from symbolize.pprof.columns import location_columns
from symbolize.pprof.profile_pb2 import Location, Profile
from symbolize.pprof.profile_raw_pb2 import RawProfile
from symbolize.rewrite import MappingSymbols, Report, _from_encoding, rewrite
from symbolize.symtab import SymbolTable, build_symbol_table
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.rewriting import open_table


@pytest.fixture(scope="module")
def libc_ids(tmp_path_factory: pytest.TempPathFactory) -> tuple[SymbolTable, FunctionIds]:
    """libc's table, and the function ids it numbers its functions with."""
    assert LIBC_ID
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    out = tmp_path_factory.mktemp("scaling") / "libc.symc"
    ids = FunctionIds()
    return open_table(out, build_symbol_table(LIBC_DEBUG, out, LIBC_ID), ids), ids


@pytest.fixture(scope="module")
def libc(libc_ids: tuple[SymbolTable, FunctionIds]) -> SymbolTable:
    return libc_ids[0]


def _text_addresses(n: int) -> np.ndarray:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    rng = random.Random(n)
    return np.array([text.vaddr + rng.randrange(text.filesz) for _ in range(n)],
                    dtype=np.uint64)


def test_a_profile_with_more_addresses_than_chains_kept_keeps_them(libc: SymbolTable) -> None:
    """A million addresses of libc have some 180,000 chains. The store started over whenever a
    profile had more addresses than it keeps chains, so a warm profile of a million addresses
    resolved every chain again, each time: 1.68 s where 100,000 took 0.1."""
    keys = libc.keys(_text_addresses(20_000))
    resolved: list[int] = []

    def resolve(fresh: np.ndarray) -> FrameColumns:
        resolved.append(len(fresh))
        return libc._frames(fresh)

    distinct = len(np.unique(keys[keys != 0]))
    store = ChainStore(FunctionIds(), keys=int(keys.max()) + 1, limit=distinct + 100)
    assert len(keys) > distinct + 100  # more addresses than the store keeps chains
    with FunctionIds().session():
        first = store.chains(keys, resolve).numbers
        again = store.chains(keys, resolve).numbers
    assert resolved == [distinct]  # the second profile resolved nothing again
    assert np.array_equal(first, again)


def test_reading_a_profiles_locations_takes_memory_in_proportion(tmp_path: Path) -> None:
    """The positions of every varint end of all locations at once were eight bytes for each
    byte of them: 160 MB for the locations of a 26 MB profile."""
    rng = random.Random(6)
    encoded = [Location(id=i, mapping_id=1 + i % 3, address=rng.getrandbits(47))
               .SerializeToString() for i in range(1, 300_001)]
    size = sum(map(len, encoded))
    tracemalloc.start()
    try:
        columns = location_columns(encoded)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert columns.address[5] == Location.FromString(encoded[5]).address
    assert peak < 2.5 * size + 8 * 4 * len(encoded), (peak, size)  # the input, its columns


def test_a_warm_rewrite_takes_memory_in_proportion(tmp_path: Path) -> None:
    """Issue 14's target: the traced peak of a warm rewrite of a million locations at most 5x
    the decoded profile (a smaller one has fewer locations a chain: its chains weigh more).
    It was 7.2x at a million locations: every location held as a bytes object for the whole
    rewrite (twice the profile), and the lookup's temporaries a dozen arrays the size of its
    input at once."""
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    ids = FunctionIds()
    table = open_table(tmp_path / "libc.symc",
                       build_symbol_table(LIBC_DEBUG, tmp_path / "libc.symc", LIBC_ID), ids)
    vaddrs = _text_addresses(1_000_000)
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID])
    p.mapping.add(id=1, filename=1, build_id=2)
    for i, v in enumerate(vaddrs.tolist(), start=1):
        p.location.add(id=i, mapping_id=1, address=v)
        p.sample.add(location_id=[i], value=[1])  # as profiles have them: a sample a location
    body = p.SerializeToString()
    symbols = {LIBC_ID: MappingSymbols(table, ())}

    def once() -> RawProfile:
        profile = RawProfile.FromString(body)
        rewrite(profile, {1: LIBC_ID}, symbols, ids, Report())
        return profile

    once()  # warm: the chains are known
    tracemalloc.start()
    try:
        out = once()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(bool(loc.line) for loc in
               Profile.FromString(out.SerializeToString()).location[:100]) > 90
    assert peak < 5 * len(body), (peak, len(body), peak / len(body))



def test_a_big_string_table_costs_no_memory_beyond_itself(
        libc_ids: tuple[SymbolTable, FunctionIds]) -> None:
    """The rewrite kept a dict of every string of the table, to find the few it reuses: a
    microsecond and some 120 bytes a string, so a profile of ten million short strings
    (21 MB gzipped, inside every limit) held a worker for 13 s and 2 GB. Only the strings it
    asks about are kept now, whatever the table's size; the answer is the same."""
    libc, ids = libc_ids
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID, "__libc_start_main"])
    p.mapping.add(id=1, filename=1, build_id=2)
    p.function.add(id=1, name=3, system_name=3)
    for i, v in enumerate(_text_addresses(100).tolist(), start=1):
        p.location.add(id=i, mapping_id=1, address=v)
        p.sample.add(location_id=[i], value=[1])
    padding = [f"{i:07x}" for i in range(300_000)]
    p.string_table.extend(padding)
    body = p.SerializeToString()
    del padding
    symbols = {LIBC_ID: MappingSymbols(libc, ())}

    def once() -> tuple[RawProfile, Report]:
        profile, report = RawProfile.FromString(body), Report()
        rewrite(profile, {1: LIBC_ID}, symbols, ids, report)
        return profile, report

    once()  # warm: the chains are known
    tracemalloc.start()
    try:
        out, report = once()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.locations_symbolized > 90
    got = Profile.FromString(out.SerializeToString())
    names = {got.string_table[f.name] for f in got.function}
    assert len(got.string_table) > 300_000 and len(names) > 10
    assert peak < 8 * 1024 * 1024, peak  # 300,000 strings: 36 MB in a dict


def test_naming_frames_in_a_big_string_table_costs_no_memory_beyond_it() -> None:
    """The module+offset names (symbolize.fallback) were looked for in a list and a dict of the
    whole string table: some 200 bytes a string."""
    p = Profile()
    p.string_table.extend(["", "/usr/lib/libfoo.so"])
    p.mapping.add(id=1, filename=1, memory_start=0x1000, memory_limit=0x9000)
    for i in range(1, 101):
        p.location.add(id=i, mapping_id=1, address=0x1000 + 16 * i)
    p.string_table.extend(f"{i:07x}" for i in range(300_000))
    profile = RawProfile.FromString(p.SerializeToString())
    tracemalloc.start()
    try:
        named = fallback.fill(profile)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert named == 100
    got = Profile.FromString(profile.SerializeToString())
    assert got.string_table[got.function[0].name] == "libfoo.so+0x10"
    assert peak < 8 * 1024 * 1024, peak  # 300,000 strings: 60 MB in a list and a dict


@pytest.mark.parametrize("mappings", [1, 3, 70_000])
def test_locations_of_many_mappings_get_the_lines_of_one(
        libc_ids: tuple[SymbolTable, FunctionIds], mappings: int) -> None:
    """Locations are grouped by mapping in one pass (a 16-bit radix sort up to 65,536
    mappings, a general one past that): whatever the mappings' count and interleaving, with
    locations of mappings not asked for and locations that have lines already among them,
    each symbolized location gets the lines its address gets in a profile of one mapping."""
    libc, ids = libc_ids
    vaddrs = _text_addresses(90_000).tolist()
    rng = random.Random(mappings)

    def rewritten(mapping_of: list[int]) -> list[list[tuple[str, int]]]:
        p = Profile()
        p.string_table.extend(["", str(LIBC), LIBC_ID])
        for mid in sorted(set(mapping_of)):
            p.mapping.add(id=mid, filename=1, build_id=2)
        for i, (v, mid) in enumerate(zip(vaddrs, mapping_of, strict=True), start=1):
            loc = p.location.add(id=i, mapping_id=mid, address=v)
            if i % 11 == 0:  # symbolized already: left as it is
                loc.line.add(function_id=0, line=i)
        profile = RawProfile.FromString(p.SerializeToString())
        asked = {m.id: LIBC_ID for m in p.mapping if m.id % 7}  # not every seventh mapping
        rewrite(profile, asked, {LIBC_ID: MappingSymbols(libc, ())}, ids, Report())
        out = Profile.FromString(profile.SerializeToString())
        names = {f.id: out.string_table[f.name] for f in out.function}
        return [[(names.get(ln.function_id, ""), ln.line) for ln in loc.line]
                for loc in out.location]

    alone = rewritten([1] * len(vaddrs))
    mapping_of = [1 + rng.randrange(mappings) for _ in vaddrs]
    mixed = rewritten(mapping_of)
    if mappings > 1:
        assert len(set(mapping_of)) > mappings * 0.6
    for i, (one, many, mid) in enumerate(zip(alone, mixed, mapping_of, strict=True), start=1):
        if i % 11 == 0:
            assert many == [("", i)]
        elif mid % 7 == 0:
            assert many == []
        else:
            assert many == one, i
    assert sum(map(bool, alone)) > 0.9 * len(alone)


def test_locations_read_from_the_encoding_give_the_bytes_read_one_by_one_give(
        libc_ids: tuple[SymbolTable, FunctionIds]) -> None:
    """A rewrite given the profile's encoding reads its locations from it in bulk
    (columns.record_columns), and writes them out again from those bytes, heads and all: the
    same answer, byte for byte, as from the RawProfile's locations one by one. Locations of
    two mappings, one not asked for, over several batches of the writer."""
    libc, ids = libc_ids
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID])
    p.mapping.add(id=1, filename=1, build_id=2)
    p.mapping.add(id=2, filename=1)
    for i, v in enumerate(_text_addresses(70_000).tolist(), start=1):
        p.location.add(id=i, mapping_id=1 + (i % 5 == 0), address=v)
        p.sample.add(location_id=[i], value=[i])
    raw = p.SerializeToString()
    assert _from_encoding(RawProfile.FromString(raw), raw) is not None  # what is compared
    answers = []
    for given in (raw, None):
        profile = RawProfile.FromString(raw)
        report = Report()
        rewrite(profile, {1: LIBC_ID}, {LIBC_ID: MappingSymbols(libc, ())}, ids, report, given)
        answers.append((profile.SerializeToString(), report))
    assert answers[0] == answers[1]
    assert answers[0][1].locations_symbolized > 50_000
    # Kept apart and appended to the rest of the encoding: the same profile once parsed.
    profile = RawProfile.FromString(raw)
    apart = rewrite(profile, {1: LIBC_ID}, {LIBC_ID: MappingSymbols(libc, ())}, ids, Report(),
                    raw, locations_apart=True)
    assert len(apart) > 1 and not profile.location
    appended = encode(profile, False, [fields.data for fields in apart])
    assert appended != answers[0][0]  # the locations come last
    assert Profile.FromString(appended) == Profile.FromString(answers[0][0])


def test_locations_are_read_from_the_encoding_only_where_that_is_worth_it() -> None:
    """Parsing the locations out of the encoding holds a copy of all of it for a moment: not
    for a profile whose samples are most of it, nor for a few locations, nor where the first
    location is not of the shape profilers write."""
    def profile(locations: int, samples: int, lines: bool = False) -> bytes:
        p = Profile(string_table=[""])
        for i in range(1, locations + 1):
            loc = p.location.add(id=i, mapping_id=1, address=0x1000 + i)
            if lines and i == 1:
                loc.line.add(function_id=1, line=1)
        for _ in range(samples):
            p.sample.add(location_id=range(1, 40), value=[1])
        return p.SerializeToString()

    for raw, worth in ((profile(10_000, 100), True), (profile(10_000, 20_000), False),
                       (profile(1_000, 0), False), (profile(10_000, 100, lines=True), False)):
        assert (_from_encoding(RawProfile.FromString(raw), raw) is not None) == worth
