"""/symbolize adds functions and lines and changes nothing else: functions once each, the
profile's own strings, samples, comments and unsymbolizable mappings as they were, addresses
outside their mapping left alone, the encoding it came in (gzip or raw) kept, and a profile
that already has functions returned byte for byte."""

from __future__ import annotations

import gzip

import pytest

from symbolize.pprof.profile_pb2 import Mapping
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_functions_are_deduplicated_and_the_rest_is_untouched(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    profile = make_profile([(placed, code_addresses(elfs.prog))])
    # A mapping that must pass through as it is: [vdso] has no build ID.
    profile.string_table.append("[vdso]")
    profile.mapping.append(Mapping(id=9, memory_start=0x7FFF0000, memory_limit=0x7FFF2000,
                                   filename=len(profile.string_table) - 1))
    raw = profile.SerializeToString()
    status, headers, body = await post(sg, raw)
    assert status == 200
    assert body[:2] != b"\x1f\x8b"  # raw in, raw out
    out = parse(body)
    keys = [(f.name, f.system_name, f.filename, f.start_line) for f in out.function]
    assert len(keys) == len(set(keys))
    assert len({f.id for f in out.function}) == len(out.function)
    assert list(out.string_table[:len(profile.string_table)]) == list(profile.string_table)
    assert list(out.sample) == list(profile.sample) and list(out.comment) == [5]
    assert out.mapping[1] == profile.mapping[1]
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "no_build_id=1"


async def test_profiles_with_functions_come_back_byte_for_byte(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:50])],
                           has_functions=True)
    body_in = gzip.compress(profile.SerializeToString(), mtime=12345)
    status, headers, body = await post(sg, body_in)
    assert status == 200 and body == body_in
    assert headers["X-Symgate-Symbolize"] == "unchanged"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "has_functions=1"


async def test_addresses_outside_the_mapping_stay_as_they_were(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    profile = make_profile([(placed, code_addresses(elfs.prog)[:10])])
    profile.location.add(id=1000, mapping_id=1, address=placed.memory_limit + 0x10)
    profile.location.add(id=1001, mapping_id=1, address=placed.memory_start - 0x10)
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200
    assert headers["X-Symgate-Locations-Unresolved"] == "outside_mapping=2"
    out = parse(body)
    assert [loc.line for loc in out.location if loc.id >= 1000] == [[], []]


async def test_kernel_mappings_are_left_alone_and_their_debug_files_never_fetched(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """perf's `[kernel.kallsyms]` and a module's mapping, each with a build ID an upstream
    has: their addresses are the running kernel's (KASLR), which no program-header
    translation maps into the file, and a real vmlinux's debug file is hundreds of MB. Both
    pass through untouched, counted as `kernel`, and nothing is asked upstream for them."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    profile = make_profile([(placed, code_addresses(elfs.prog)[:20])])
    profile.string_table.extend(["[kernel.kallsyms]", "/lib/modules/6.1.0/kernel/x.ko",
                                 elfs.other.build_id])
    names = len(profile.string_table) - 3
    for mid, name, start in ((7, names, 0xFFFFFFFF81000000),
                             (8, names + 1, 0xFFFFFFFFC0000000)):
        profile.mapping.append(Mapping(id=mid, memory_start=start, memory_limit=start + 0x100000,
                                       filename=name, build_id=names + 2))
        profile.location.add(id=900 + mid, mapping_id=mid, address=start + 0x1234)
        profile.sample.add(location_id=[900 + mid], value=[1])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "kernel=2"
    out = parse(body)
    assert [m for m in out.mapping if m.id in (7, 8)] == list(profile.mapping[1:])
    assert [loc.line for loc in out.location if loc.id > 900] == [[], []]
    await sg.settled()
    async with sg.session.head(f"{sg.url}/buildid/{elfs.other.build_id}/debuginfo",
                               headers={"Cache-Control": "only-if-cached"}) as r:
        assert r.status == 504  # never fetched
