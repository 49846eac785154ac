"""Function ids of the rewrite: shared across profiles, yet never clashing with a profile's."""

from __future__ import annotations

import random

import pytest

from symbolize.chains import FIRST_ID, FunctionIds
from symbolize.elf import layout_of_file
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
    theirs = next(f for f in first.function if f.id >= FIRST_ID)
    # The same profile, owning FIRST_ID for a function of its own and one of libc's functions
    # already, under id 7, with its strings appearing twice in the string table.
    p = _profile(libc[0])
    p.string_table.append("their own")
    p.function.add(id=FIRST_ID, name=len(p.string_table) - 1)
    for k in ("name", "system_name", "filename"):
        p.string_table.append(first.string_table[getattr(theirs, k)])
    n = len(p.string_table)
    p.function.add(id=7, name=n - 3, system_name=n - 2, filename=n - 1)
    second = _run(p.SerializeToString(), libc)

    ids = [f.id for f in second.function]
    assert len(ids) == len(set(ids))
    s = second.string_table
    keys = [(s[f.name], s[f.system_name], s[f.filename]) for f in second.function]
    assert len(keys) == len(set(keys))
    assert _frames(second) == _frames(first)
    assert {f.id: s[f.name] for f in second.function}[FIRST_ID] == "their own"
    assert any(ln.function_id == 7 for loc in second.location for ln in loc.line)
