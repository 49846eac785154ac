"""Issue 14 (6): large profiles cost in proportion to their size, in time and memory."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from symbolize.chains import ChainStore, FrameColumns, FunctionIds
from symbolize.elf import layout_of_file
from symbolize.pprof.columns import location_columns
from symbolize.pprof.profile_pb2 import Location, Profile
from symbolize.pprof.profile_raw_pb2 import RawProfile
from symbolize.rewrite import MappingSymbols, Report, rewrite
from symbolize.symtab import SymbolTable, build_symbol_table
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.rewriting import open_table


@pytest.fixture(scope="module")
def libc(tmp_path_factory: pytest.TempPathFactory) -> SymbolTable:
    assert LIBC_ID
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    out = tmp_path_factory.mktemp("scaling") / "libc.symc"
    return open_table(out, build_symbol_table(LIBC_DEBUG, out, LIBC_ID), FunctionIds())


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
