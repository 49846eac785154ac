"""Function ids of the rewrite: shared across profiles, yet never clashing with a profile's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from symbolize.chains import FunctionIds
from symbolize.elf import layout_of_file
from symbolize.pprof.new_ids import NewIds
from symbolize.pprof.profile_pb2 import Profile
from symbolize.rewrite import MappingSymbols
from symbolize.symtab import SymbolTable, build_symbol_table
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.rewriting import open_table, run_rewrite

BASE = 0x7F0000000000


@pytest.fixture(scope="module")
def libc(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, SymbolTable, FunctionIds]:
    assert LIBC_ID
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    out = tmp_path_factory.mktemp("symtab") / "libc.symc"
    built = build_symbol_table(LIBC_DEBUG, out, LIBC_ID)
    ids = FunctionIds()
    return LIBC_ID, open_table(out, built, ids), ids


def _profile(build_id: str) -> Profile:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    p = Profile()
    p.string_table.extend(["", str(LIBC), build_id])
    p.mapping.add(id=1, memory_start=BASE + text.vaddr, memory_limit=BASE + text.vaddr
                  + text.memsz, file_offset=text.offset, filename=1, build_id=2)
    rng = random.Random(5)
    for i, v in enumerate(rng.sample(range(text.vaddr, text.vaddr + text.filesz), 500), 1):
        p.location.add(id=i, mapping_id=1, address=BASE + v)
    return p


def _run(body: bytes, libc: tuple[str, SymbolTable, FunctionIds]) -> Profile:
    build_id, table, ids = libc
    layout = layout_of_file(LIBC)
    assert layout is not None
    return run_rewrite(body, {build_id: MappingSymbols(table, layout.segments)}, ids)[0]


def _frames(p: Profile) -> list[list[tuple[str, str, int]]]:
    by_id = {f.id: f for f in p.function}
    s = p.string_table
    return [[(s[by_id[ln.function_id].name], s[by_id[ln.function_id].filename], ln.line)
             for ln in loc.line] for loc in p.location]


def test_a_profiles_own_ids_and_functions_are_kept_and_reused(
        libc: tuple[str, SymbolTable, FunctionIds]) -> None:
    plain = _profile(libc[0])
    first = _run(plain.SerializeToString(), libc)
    theirs = first.function[len(first.function) // 2]
    # The same profile, owning id 1 for a function of its own and one of libc's functions
    # already, under id 7, with its strings appearing twice in the string table.
    p = _profile(libc[0])
    p.string_table.append("their own")
    p.function.add(id=1, name=len(p.string_table) - 1)
    for k in ("name", "system_name", "filename"):
        p.string_table.append(first.string_table[getattr(theirs, k)])
    n = len(p.string_table)
    p.function.add(id=7, name=n - 3, system_name=n - 2, filename=n - 1,
                   start_line=theirs.start_line)
    second = _run(p.SerializeToString(), libc)

    ids = [f.id for f in second.function]
    assert len(ids) == len(set(ids))
    assert min(ids[2:]) == 8  # new functions numbered after the profile's own
    s = second.string_table
    keys = [(s[f.name], s[f.system_name], s[f.filename]) for f in second.function]
    assert len(keys) == len(set(keys))
    assert _frames(second) == _frames(first)
    assert {f.id: s[f.name] for f in second.function}[1] == "their own"
    assert any(ln.function_id == 7 for loc in second.location for ln in loc.line)


def test_ids_do_not_depend_on_what_the_process_symbolized_before(
        libc: tuple[str, SymbolTable, FunctionIds], tmp_path: Path) -> None:
    """Issue 14 (7): two fresh servers gave one profile different function ids (numbered
    from 1048576 on one, 1048578 on the other). Here one process has symbolized another
    profile first, and the other has not: the bytes must be the same."""
    body = _profile(libc[0]).SerializeToString()
    build_id, table, ids = libc
    layout = layout_of_file(LIBC)
    assert layout is not None
    other = _profile(libc[0])
    other.location[0].address += 1  # another first address: other functions seen first
    del other.location[1:250]
    _run(other.SerializeToString(), libc)
    seasoned = run_rewrite(body, {build_id: MappingSymbols(table, layout.segments)}, ids)[0]

    fresh_ids = FunctionIds()
    out = tmp_path / "libc.symc"
    built = build_symbol_table(LIBC_DEBUG, out, LIBC_ID)
    fresh = run_rewrite(body, {build_id: MappingSymbols(open_table(out, built, fresh_ids),
                                                        layout.segments)}, fresh_ids)[0]
    assert fresh.SerializeToString() == seasoned.SerializeToString()
    assert sorted(f.id for f in fresh.function) == list(range(1, len(fresh.function) + 1))


@pytest.mark.parametrize("theirs", [(1 << 64) - 1, (1 << 64) - 3, 1 << 63],
                         ids=["last", "two-below-last", "half"])
def test_a_profile_that_owns_ids_near_the_top(
        libc: tuple[str, SymbolTable, FunctionIds], theirs: int) -> None:
    """New ids followed max(id) + 1: a profile owning 2**64 - 1 made that 2**64 (a 500, and
    the CLI crashed), and one owning 2**64 - 3 would have wrapped its new ids to 0 and on,
    over its own. Past the top, the lowest ids the profile does not use are taken."""
    p = _profile(libc[0])
    p.string_table.extend(["their own", "theirs too"])
    n = len(p.string_table)
    p.function.add(id=theirs, name=n - 2)
    p.function.add(id=2, name=n - 1)  # a low one, to be skipped
    out = _run(p.SerializeToString(), libc)
    ids = [f.id for f in out.function]
    assert len(ids) == len(set(ids)) and 0 not in ids
    assert len(ids) > 100  # libc's functions were added
    s = out.string_table
    assert {f.id: s[f.name] for f in out.function}[theirs] == "their own"
    new = sorted(ids[2:])
    room = (1 << 64) - 1 - theirs
    above = [i for i in new if i > theirs]
    assert above == list(range(theirs + 1, theirs + 1 + min(room, len(new))))
    below = [i for i in new if i < theirs]
    assert below == [i for i in range(1, len(below) + 2) if i != 2][:len(below)]
    assert bool(below) == (room < len(new))
    known = set(ids)
    assert all(ln.function_id in known for loc in out.location for ln in loc.line)
    assert _frames(out) == _frames(_run(_profile(libc[0]).SerializeToString(), libc))


@pytest.mark.parametrize("count", [0, 1, 5])
@pytest.mark.parametrize("used", [[], [1], [(1 << 64) - 1], [(1 << 64) - 2, 1, 3],
                                  [(1 << 64) - 1, *range(1, 50)]])
def test_new_ids_are_unused_and_never_zero(used: list[int], count: int) -> None:
    ids = NewIds(used)
    taken = [*ids.take(count).tolist(), *ids.take(1).tolist(), *ids.take(count).tolist()]
    assert len(taken) == len(set(taken)) == 2 * count + 1
    assert not set(taken) & set(used) and 0 not in taken
    assert all(0 < i < 1 << 64 for i in taken)
    # After the profile's highest id where there is room, else from the lowest unused.
    top = max(used, default=0)
    expected = list(range(top + 1, min(top + 1 + len(taken), 1 << 64)))
    free_below = [i for i in range(1, 200) if i not in set(used)]
    expected += free_below[:len(taken) - len(expected)]
    assert taken == expected


def test_new_ids_past_the_top_among_many_of_the_profiles_own() -> None:
    """Every new id taken past the top searched all of the profile's ids again: a profile of
    thousands of sparse ids and the last one cost minutes of CPU in the fallback pass."""
    used = [*range(2, 20_002, 2), (1 << 64) - 1]
    ids = NewIds(used)
    taken = [*ids.take(3).tolist(), *ids.take(5_000).tolist(), *ids.take(7_000).tolist()]
    assert taken == [*range(1, 20_001, 2), *range(20_001, 22_004)]
