"""Offline and server symbolization are one pipeline: the same profile and the same debug
files give the same bytes, whether they come from a local tree or through symgate's cache."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import sys
from pathlib import Path

import pytest

from proxy.config import DatabaseConfig, NegativeConfig, SymbolizeConfig
from symbolize.elf import function_symbols
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import Elf, ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually, running_debuginfod, serves
from tests.profiles import code_addresses, frames_of, llvm_symbolize, make_profile, place
from tests.symbolize_helpers import post

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

BASES = {"prog": 0x5555_5555_4000, "shlib": 0x7F00_0000_0000, "nopie": 0}


def build_id_tree(root: Path, elves: list[Elf]) -> Path:
    for elf in elves:
        d = root / ".build-id" / elf.build_id[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / (elf.build_id[2:] + ".debug")).symlink_to(elf.debug)
        (d / elf.build_id[2:]).symlink_to(elf.executable)
    return root


def profile(elfs: ElfSet) -> bytes:
    placed = [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)),
              (place(elfs.shlib, BASES["shlib"]), code_addresses(elfs.shlib)[::3]),
              (place(elfs.nopie, BASES["nopie"]), code_addresses(elfs.nopie)[::5])]
    return gzip.compress(make_profile(placed).SerializeToString(), mtime=0)


async def test_offline_and_server_give_the_same_bytes(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    body = profile(elfs)
    elves = [elfs.prog, elfs.shlib, elfs.nopie]
    tree = build_id_tree(tmp_path / "debug", elves)
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)
    offline, report = await asyncio.to_thread(symbolize_bytes, body, [tree], limits)
    assert report.mappings_symbolized == 3 and offline != body

    # The server, once from the same local tree, once from elfutils' debuginfod through its
    # cache (debug file and executable fetched, as a Pyroscope-style deployment does).
    for upstreams, dirs in (([], (tree,)), ([debuginfod.url], ())):
        sg = await start_symgate(upstreams, data_dir=tmp_path / f"data-{len(upstreams)}",
                                 symbolize=SymbolizeConfig(build_workers=1, debug_dirs=dirs))
        status, headers, served = await sg.request(
            "POST", "/symbolize", data=body, headers={"Content-Type": "application/octet-stream"})
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "3", upstreams
        assert served == offline, upstreams


async def test_the_same_bytes_whatever_the_server_symbolized_before(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """Issue 14 (7): function ids were numbered in the order a process first met the functions,
    so a server that had symbolized another profile first answered with other bytes. Here: a
    fresh server, one that symbolized another profile first, the first again after a restart,
    and the CLI, all give the same bytes."""
    body = profile(elfs)
    first = gzip.compress(make_profile([(place(elfs.shlib, BASES["shlib"]),
                                         code_addresses(elfs.shlib)[1::2])]).SerializeToString(),
                          mtime=0)
    tree = build_id_tree(tmp_path / "debug", [elfs.prog, elfs.shlib, elfs.nopie])
    config = SymbolizeConfig(build_workers=1, workers=1, debug_dirs=(tree,))
    answers = []
    for name, before in (("fresh", []), ("seasoned", [first]), ("fresh", [])):
        sg = await start_symgate([], data_dir=tmp_path / f"data-{name}", symbolize=config)
        for request in [*before, body]:
            status, _headers, served = await sg.request(
                "POST", "/symbolize", data=request,
                headers={"Content-Type": "application/octet-stream"})
            assert status == 200
        answers.append(served)
        await sg.stop()  # the third is the first server's data dir again: a restart
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)
    offline, _report = await asyncio.to_thread(symbolize_bytes, body, [tree], limits)
    assert answers[0] != body
    assert answers == [offline] * 3


async def test_a_stripped_librarys_exports_are_named_alike_offline_and_served(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """Both build a table with the executable found beside the debug file (the server's
    fetched beside it from its upstream, or in its debug dirs): a function that a stripped
    library exports under four names is named after the last in its .dynsym, and its `.cold`
    part after it, as llvm-symbolizer says on the library (from the debug file alone, both
    would say another alias and `checked.cold`)."""
    lib = elfs.aliased
    tree = build_id_tree(tmp_path / "debug", [lib])
    starts = {s.name: s.value for s in function_symbols(lib.debug)}
    vaddrs = [starts["mix_a"] + 4, starts["checked"] + 8, starts["checked.cold"] + 4]
    body = make_profile([(place(lib, BASES["shlib"]), vaddrs)]).SerializeToString()
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)
    offline, report = await asyncio.to_thread(symbolize_bytes, body, [tree], limits)
    assert report.mappings_symbolized == 1
    out = Profile.FromString(offline)
    names = {loc.address - BASES["shlib"]: [f.function for f in frames_of(out, loc)]
             for loc in out.location}
    llvm = llvm_symbolize(lib.executable, vaddrs)
    assert names == {v: [f.function for f in llvm[v]] for v in vaddrs}
    assert names[vaddrs[2]][-1] == "checked"

    for upstreams, dirs in (([], (tree,)), ([debuginfod.url], ())):
        sg = await start_symgate(upstreams, data_dir=tmp_path / f"data-{len(upstreams)}",
                                 symbolize=SymbolizeConfig(build_workers=1, debug_dirs=dirs))
        status, _headers, served = await sg.request(
            "POST", "/symbolize", data=body,
            headers={"Content-Type": "application/octet-stream"})
        assert status == 200 and served == offline, upstreams


def aliased_profiles(lib: Elf) -> dict[str, bytes]:
    """Addresses of `elfs.aliased` whose names its stripped executable's .dynsym decides (see
    above), as a profiler with runtime addresses and as the eBPF profiler send them."""
    starts = {s.name: s.value for s in function_symbols(lib.debug)}
    vaddrs = [starts["mix_a"] + 4, starts["checked"] + 8, starts["checked.cold"] + 4]
    placed = [(place(lib, BASES["shlib"]), vaddrs)]
    return {"runtime": make_profile(placed).SerializeToString(),
            "relative": make_profile(placed, runtime=False).SerializeToString()}


async def answers(sg: object, bodies: dict[str, bytes]) -> dict[str, bytes]:
    out = {}
    for name, body in bodies.items():
        status, headers, served = await post(sg, body)  # type: ignore[arg-type]
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
        out[name] = served
    return out


async def test_the_same_bytes_once_a_missing_executable_is_published(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """The upstream had the debug file but not yet the executable (its 404 remembered): the
    table was built without the executable's .dynsym names and program headers, and believed
    for good, so the server answered with other names than a fresh one for as long as it ran
    (and a profile of ELF-relative addresses, which never fetches the executable, for good).
    Once published, the executable is asked for again after the miss TTL, as a missing debug
    file is, and the table is built again with it."""
    lib = elfs.aliased
    bodies = aliased_profiles(lib)
    scanned, work = tmp_path / "upstream", tmp_path / "debuginfod"
    scanned.mkdir()
    work.mkdir()
    shutil.copy(lib.debug, scanned / "libmix.so.debug")
    negative = NegativeConfig(not_found_initial_ttl_s=1, not_found_ttl_s=1)
    config = SymbolizeConfig(build_workers=1)
    with running_debuginfod(scanned, work, "-t", "1") as upstream:
        await eventually(lambda: serves(f"{upstream.url}/buildid/{lib.build_id}/debuginfo"))
        sg = await start_symgate([upstream.url], data_dir=tmp_path / "seasoned",
                                 symbolize=config, negative=negative)
        before = await answers(sg, bodies)
        shutil.copy(lib.executable, scanned / "libmix.so")
        await eventually(lambda: serves(f"{upstream.url}/buildid/{lib.build_id}/executable"))
        # Fresh: a database of its own too. The seasoned server's 404 of the executable, in
        # the one they would share, made the fresh one build without it as well when it came
        # within the miss TTL of that 404 (a quick rescan upstream).
        fresh = await start_symgate(
            [upstream.url], data_dir=tmp_path / "fresh", symbolize=config, negative=negative,
            database=DatabaseConfig(url=f"sqlite+aiosqlite:///{tmp_path / 'fresh.sqlite'}"))
        want = await answers(fresh, bodies)
        assert before != want  # the executable's names: what this test is about

        async def same() -> bool:
            return await answers(sg, bodies) == want

        await eventually(same)


async def test_the_same_bytes_after_a_debugger_fetched_the_debug_file_alone(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """gdb fetched the debug file through symgate, whose table was built at once, without the
    executable (nobody asked for it): profiles were answered from that table, with other
    names than a fresh server gives, for good where their addresses are ELF-relative (a
    profile of runtime addresses fetched the executable, and the table was built again). It
    is asked about again after the miss TTL, as a table from an executable is."""
    lib = elfs.aliased
    bodies = aliased_profiles(lib)
    config = SymbolizeConfig(build_workers=1)
    negative = NegativeConfig(not_found_initial_ttl_s=1, not_found_ttl_s=1)
    fresh = await start_symgate([debuginfod.url], data_dir=tmp_path / "fresh", symbolize=config)
    want = await answers(fresh, bodies)
    relative = {"relative": bodies["relative"]}
    sg = await start_symgate([debuginfod.url], data_dir=tmp_path / "debugged", symbolize=config,
                             negative=negative)
    assert (await sg.get(f"/buildid/{lib.build_id}/debuginfo"))[0] == 200
    await sg.built()
    assert await answers(sg, relative) != {"relative": want["relative"]}

    async def same() -> bool:
        return await answers(sg, relative) == {"relative": want["relative"]}

    await eventually(same)
    assert await answers(sg, bodies) == want
