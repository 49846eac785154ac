"""Offline and server symbolization are one pipeline: the same profile and the same debug
files give the same bytes, whether they come from a local tree or through symgate's cache."""

from __future__ import annotations

import asyncio
import gzip
import sys
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig
from symbolize.elf import function_symbols
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import Elf, ElfSet
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, frames_of, llvm_symbolize, make_profile, place

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
