"""`?fallback=module-offset` and the per-tenant key: frames that cannot be symbolized get
`module+0xoffset` names by file offset, their mappings keep has_functions false, and a later pass
with the debug info at hand symbolizes them as if the names had never been there."""

from __future__ import annotations

import asyncio
import posixpath
import sys
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig, TenantConfig
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Location, Mapping, Profile
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, frames_of, llvm_symbolize, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, same_frames, symbolize_config
from tests.test_offline_matches_server import build_id_tree

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

VDSO_START = 0x7FFF8A3FE000


def _profile(elfs: ElfSet) -> tuple[Profile, dict[int, int]]:
    """prog (known to no upstream of the first server), other (known), a library without a
    build ID, and a [vdso] without a file; and each location's file offset where it has one."""
    prog, other = place(elfs.prog, BASES["prog"]), place(elfs.other, 0x7F0000000000)
    prog_vaddrs = code_addresses(elfs.prog)[::7]
    p = make_profile([(prog, prog_vaddrs), (other, code_addresses(elfs.other)[::9])])
    s = len(p.string_table)
    p.string_table.extend(["/usr/lib/libnobuildid.so.1", "[vdso]", "[anon:v8]"])
    p.mapping.append(Mapping(id=3, memory_start=0x7F5500000000, memory_limit=0x7F5500010000,
                             file_offset=0x2000, filename=s))
    p.mapping.append(Mapping(id=4, memory_start=VDSO_START, memory_limit=VDSO_START + 0x2000,
                             filename=s + 1))
    p.mapping.append(Mapping(id=5, memory_start=0x3F00000000, memory_limit=0x3F00100000,
                             filename=s + 2))  # JIT code: no file, offsets mean nothing
    next_id = len(p.location) + 1
    p.location.append(Location(id=next_id + 2, mapping_id=5, address=0x3F00000040))
    p.location.append(Location(id=next_id, mapping_id=3, address=0x7F5500001A2B))
    p.location.append(Location(id=next_id + 1, mapping_id=4, address=VDSO_START + 0x10))
    offsets = {loc.id: prog.runtime(v) - prog.memory_start + prog.file_offset
               for loc, v in zip(p.location, prog_vaddrs, strict=False)}
    offsets[next_id] = 0x1A2B + 0x2000
    return p, offsets


def _names(profile: Profile, mapping_id: int) -> dict[int, list[str]]:
    s = profile.string_table
    functions = {f.id: f for f in profile.function}
    return {loc.id: [s[functions[ln.function_id].name] for ln in loc.line]
            for loc in profile.location if loc.mapping_id == mapping_id}


async def test_unsymbolizable_frames_get_module_offset_names_and_a_later_pass_symbolizes_them(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
) -> None:
    p, offsets = _profile(elfs)
    # A first server with no debug info at all: every mapping stays unsymbolized.
    sg = await start_symgate([], symbolize=symbolize_config(), data_dir=tmp_path / "a")
    body = p.SerializeToString()
    status, headers, plain = await post(sg, body)
    assert status == 200 and plain == body  # not asked: bare addresses stay
    status, headers, named_body = await sg.request(
        "POST", "/symbolize?fallback=module-offset", data=body,
        headers={"Content-Type": "application/octet-stream"})
    assert status == 200, named_body
    assert headers["X-Symgate-Symbolize"] == "named"
    named = parse(named_body)
    module = posixpath.basename(str(elfs.prog.executable))
    got = _names(named, 1)
    assert got == {lid: [f"{module}+0x{off:x}"] for lid, off in offsets.items() if lid in got}
    assert len(got) == len(code_addresses(elfs.prog)[::7])
    assert _names(named, 3) == {len(p.location) - 2: [f"libnobuildid.so.1+0x{0x3a2b:x}"]}
    assert _names(named, 4) == {len(p.location) - 1: ["[vdso]+0x10"]}
    assert _names(named, 5) == {len(p.location): []}
    assert not any(m.has_functions for m in named.mapping)
    counted = headers["X-Symgate-Locations-Unresolved"]
    assert f"module_offset={len(got) + len(_names(named, 2)) + 2}" in counted
    await sg.stop()

    # Later, with prog's debug info reachable: the names give way to real frames.
    later = await start_symgate([debuginfod.url], symbolize=symbolize_config(),
                                data_dir=tmp_path / "b")
    status, headers, again = await post(later, named_body)
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    result = parse(again)
    prog_mapping = next(m for m in result.mapping if m.id == 1)
    assert prog_mapping.has_functions
    placed = place(elfs.prog, BASES["prog"])
    want = llvm_symbolize(elfs.prog.debug, [a - placed.base for a in
                                            (loc.address for loc in result.location
                                             if loc.mapping_id == 1)])
    checked = 0
    for loc in result.location:
        if loc.mapping_id != 1:
            continue
        frames = frames_of(result, loc)
        assert not any("+0x" in f.function for f in frames), frames
        if (expected := want.get(loc.address - placed.base)) is not None:
            assert same_frames(frames, expected), (hex(loc.address), frames, expected)
            checked += 1
    assert checked >= len(want) * 0.95 and checked > 10
    # The library without a build ID keeps its name: nothing can symbolize it.
    assert _names(result, 3) == _names(named, 3)


async def test_a_tenants_config_key_turns_names_on_and_the_query_overrides_it(
    start_symgate: SymgateFactory, elfs: ElfSet,
) -> None:
    p, _ = _profile(elfs)
    body = p.SerializeToString()
    sg = await start_symgate([], symbolize=symbolize_config(), tenants={
        "acme": TenantConfig(fallback="module-offset")})

    async def ask(query: str = "", **headers: str) -> tuple[int, dict[str, str], bytes]:
        return await sg.request("POST", "/symbolize" + query, data=body, headers={
            "Content-Type": "application/octet-stream", **headers})

    status, headers, out = await ask(**{"X-Scope-OrgID": "acme"})
    assert status == 200 and headers["X-Symgate-Symbolize"] == "named"
    assert _names(parse(out), 3) != {}
    status, headers, out = await ask(**{"X-Scope-OrgID": "globex"})
    assert status == 200 and out == body
    status, headers, out = await ask("?fallback=none", **{"X-Scope-OrgID": "acme"})
    assert status == 200 and out == body
    status, headers, out = await ask("?fallback=module-offset", **{"X-Scope-OrgID": "globex"})
    assert status == 200 and headers["X-Symgate-Symbolize"] == "named"
    for bad in ("?fallback=offsets", "?fallback=none&fallback=module-offset"):
        assert (await ask(bad))[0] == 400


async def test_a_profile_owning_the_last_function_id_is_named_not_refused(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
) -> None:
    """New Functions were numbered from the profile's highest id + 1: a profile owning
    2**64 - 1 got a 500, with names or symbols (a hostile campaign's find). Both passes now
    take the lowest ids it does not use."""
    p, offsets = _profile(elfs)
    p.string_table.append("their own")
    p.function.add(id=(1 << 64) - 1, name=len(p.string_table) - 1)
    body = p.SerializeToString()
    bare = await start_symgate([], symbolize=symbolize_config(), data_dir=tmp_path / "a")
    status, _headers, named_body = await bare.request(
        "POST", "/symbolize?fallback=module-offset", data=body,
        headers={"Content-Type": "application/octet-stream"})
    assert status == 200, named_body
    named = parse(named_body)
    module = posixpath.basename(str(elfs.prog.executable))
    got = _names(named, 1)
    assert got == {lid: [f"{module}+0x{off:x}"] for lid, off in offsets.items() if lid in got}
    ids = [f.id for f in named.function]
    assert len(ids) == len(set(ids)) and 0 not in ids and (1 << 64) - 1 in ids
    await bare.stop()

    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(),
                             data_dir=tmp_path / "b")
    for sent in (body, named_body):
        status, headers, out_body = await post(sg, sent)
        assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", out_body
        out = parse(out_body)
        ids = [f.id for f in out.function]
        assert len(ids) == len(set(ids)) and 0 not in ids
        known = set(ids)
        assert all(ln.function_id in known for loc in out.location for ln in loc.line)
        assert next(m for m in out.mapping if m.id == 1).has_functions


async def test_no_names_where_a_mapping_gives_no_offset(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path,
) -> None:
    """An inverted range was read as no range, which named its frames after offsets that mean
    nothing (`prog+0x7` for offset 0x1007), and a file offset near 2**64 gave names past 64
    bits; the rewrite counts both outside their mapping. They get no name; the sound mapping
    beside them does."""
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog)[:3]
    p = make_profile([(placed, vaddrs)] * 3)
    p.mapping[1].memory_start, p.mapping[1].memory_limit = placed.memory_limit, \
        placed.memory_start
    p.mapping[2].file_offset = (1 << 64) - 16  # + the address - memory_start: past 2**64
    sg = await start_symgate([], symbolize=symbolize_config(), data_dir=tmp_path / "a")
    status, _headers, body = await sg.request(
        "POST", "/symbolize?fallback=module-offset", data=p.SerializeToString(),
        headers={"Content-Type": "application/octet-stream"})
    assert status == 200, body
    named = parse(body)
    module = posixpath.basename(str(elfs.prog.executable))
    assert sorted(n for names in _names(named, 1).values() for n in names) == sorted(
        f"{module}+0x{placed.runtime(v) - placed.memory_start + placed.file_offset:x}"
        for v in vaddrs)
    assert _names(named, 2) == {loc.id: [] for loc in named.location if loc.mapping_id == 2}
    assert _names(named, 3) == {loc.id: [] for loc in named.location if loc.mapping_id == 3}


async def test_names_are_numbered_alike_whatever_the_order_of_the_locations(
    elfs: ElfSet, tmp_path: Path,
) -> None:
    """Symbolized functions are numbered in the order of their names, but the names given
    in their stead were numbered (and their strings appended) in the order of the locations
    first naming them: the same profile with its locations in another order got other
    function ids and another string table. Both are numbered by name now."""
    p, _offsets = _profile(elfs)
    shuffled = Profile()
    shuffled.CopyFrom(p)
    locations = list(shuffled.location)
    del shuffled.location[:]
    shuffled.location.extend(locations[::-1])
    tree = build_id_tree(tmp_path / "debug", [elfs.other])  # prog's debug info is nowhere
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize,
                    fallback=True)
    outs = [Profile.FromString((await asyncio.to_thread(
        symbolize_bytes, profile.SerializeToString(), [tree], limits))[0])
        for profile in (p, shuffled)]
    assert len(_names(outs[0], 1)) > 1 and _names(outs[0], 2)  # names and symbols
    assert list(outs[0].string_table) == list(outs[1].string_table)
    assert list(outs[0].function) == list(outs[1].function)
    assert sorted(outs[0].location, key=lambda loc: loc.id) == sorted(
        outs[1].location, key=lambda loc: loc.id)
