"""POST /symbolize against gcc-built programs and the real libc, checked by llvm-symbolizer."""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig, TenantConfig
from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from symbolize.elf import layout_of_file
from symbolize.pprof.profile_pb2 import Mapping, Profile
from tests.conftest import Debuginfod, Symgate, SymgateFactory, eventually, fast_upstream
from tests.elfs import Elf, ElfSet
from tests.faults import FaultUpstream
from tests.profiles import (
    Expected,
    code_addresses,
    frames_of,
    llvm_symbolize,
    make_profile,
    place,
    symbol_aliases,
)

LIBC_ID = "93ac61ec5a8eb1396f9fbd350e3169a558528a40"
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
# Where a loader would put each kind of file: PIE and shared libraries anywhere, ET_EXEC at 0.
BASES = {"prog": 0x55D0C0DE0000, "nopie": 0, "libmix.so": 0x7F3A12340000, "cpp": 0x5612AB000000}


async def post(sg: Symgate, body: bytes, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return await sg.request("POST", "/symbolize", data=body,
                                 headers={"Content-Type": "application/octet-stream", **headers})


def parse(body: bytes) -> Profile:
    return Profile.FromString(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def symbolize_config(**kw: object) -> SymbolizeConfig:
    return replace(SymbolizeConfig(build_workers=1), **kw)  # type: ignore[arg-type]


def same_frames(got: list[Expected], want: list[Expected]) -> bool:
    """The same chain of functions, and of files and lines where there is DWARF.

    Names are compared demangled, except where llvm-symbolizer 14 could not demangle one (it
    then prints the raw name, which libstdc++'s demangler handles): there the raw names are.
    Raw names alone would differ where a symbol has aliases (GCC gives a destructor's one body
    both its D1 and D2 names; llvm takes the .symtab alias, symbolic the DWARF linkage name).
    For functions known only from .symtab (crt startup code) llvm-symbolizer takes a file
    name from the STT_FILE symbol, which symbolic does not; both report line 0.
    """
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        demangled_by_llvm = w.function != w.system_name or not w.system_name.startswith("_Z")
        if (g.function if demangled_by_llvm else g.system_name) != w.function:
            return False
        if w.line and (g.file, g.line) != (w.file, w.line):
            return False
    return True


def elf_named(elfs: ElfSet, name: str) -> Elf:
    return next(e for e in elfs.all if e.name == name)


@pytest.mark.parametrize("name", ["prog", "nopie", "libmix.so", "cpp"])
@pytest.mark.parametrize("runtime", [True, False], ids=["runtime-addresses", "elf-relative"])
async def test_every_instruction_matches_llvm_symbolizer(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, name: str,
    runtime: bool,
) -> None:
    elf = elf_named(elfs, name)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elf, BASES[name])
    vaddrs = code_addresses(elf)
    expected = llvm_symbolize(elf.debug, vaddrs)
    assert len(expected) > 20
    profile = make_profile([(placed, vaddrs)], runtime=runtime)
    status, headers, body = await post(sg, gzip.compress(profile.SerializeToString()))
    assert status == 200, body
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert body[:2] == b"\x1f\x8b"  # gzip in, gzip out
    out = parse(body)
    by_address = {loc.address: loc for loc in out.location}
    mismatches = []
    for vaddr, frames in expected.items():
        loc = by_address[placed.runtime(vaddr) if runtime else vaddr]
        got = frames_of(out, loc)
        if not same_frames(got, frames):
            mismatches.append((hex(vaddr), got, frames))
    assert not mismatches, mismatches[:5]
    m = out.mapping[0]
    assert (m.has_functions, m.has_filenames, m.has_line_numbers) == (True, True, True)
    assert m.has_inline_frames  # -O2 inlined square() and twist(), or std::vector's helpers
    assert int(headers["X-Symgate-Locations-Symbolized"]) >= len(expected)
    if name == "cpp":
        names = {out.string_table[f.name] for f in out.function}
        systems = {out.string_table[f.system_name] for f in out.function}
        assert "shapes::Acc<long>::total(long) const" in names
        assert "_ZNK6shapes3AccIlE5totalEl" in systems


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


async def test_missing_debug_info_for_one_mapping_does_not_fail_the_others(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    good = place(elfs.prog, BASES["prog"])
    unknown = replace(place(elfs.shlib, BASES["libmix.so"]), build_id="ab" * 20)
    profile = make_profile([(good, code_addresses(elfs.prog)[:40]),
                            (unknown, code_addresses(elfs.shlib)[:40])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1"
    out = parse(body)
    assert out.mapping[0].has_functions and not out.mapping[1].has_functions
    assert all(not loc.line for loc in out.location if loc.mapping_id == 2)
    assert await sg.metric("symgate_symbolize_mappings_total", result="not_found") == 1


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


@pytest.mark.parametrize(("body", "status", "reason"), [
    (b"", 400, b"empty body"),
    (b"this is not a profile at all", 400, b"not a pprof profile"),
    (gzip.compress(b"x" * 1000)[:20], 400, b"truncated gzip"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\xff" * 20, 400, b"not valid gzip"),
])
async def test_bad_bodies_get_a_clear_4xx_and_the_server_survives(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, body: bytes, status: int,
    reason: bytes,
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    got, _, text = await post(sg, body)
    assert got == status and reason in text, text
    assert (await sg.get("/healthz"))[0] == 200
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1


@pytest.mark.parametrize("ctype", ["text/plain", "application/json; charset=utf-8"])
async def test_a_body_that_is_not_a_profile_by_its_type_is_415(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, ctype: str
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, _, text = await post(sg, profile.SerializeToString(), **{"Content-Type": ctype})
    assert status == 415 and b"unsupported Content-Type" in text, text
    status, _, _ = await post(sg, profile.SerializeToString(),
                              **{"Content-Type": "application/x-protobuf"})
    assert status == 200
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1


async def test_gzip_bomb_and_oversized_bodies_are_413(
    start_symgate: SymgateFactory, debuginfod: Debuginfod
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(
        max_request_bytes=1024 * 1024, max_decompressed_bytes=8 * 1024 * 1024))
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB of zeros in ~64 KiB
    assert len(bomb) < 1024 * 1024
    status, _, text = await post(sg, bomb)
    assert status == 413 and b"decompresses to more than" in text
    status, _, text = await post(sg, os.urandom(2 * 1024 * 1024))
    assert status == 413 and b"larger than" in text
    assert (await sg.get("/healthz"))[0] == 200


async def test_a_2000_character_build_id_is_reported_not_fetched(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config())
    placed = replace(place(elfs.prog, BASES["prog"]), build_id="ab" * 1000)
    profile = make_profile([(placed, code_addresses(elfs.prog)[:5])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and body == profile.SerializeToString()
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "invalid_build_id=1"
    assert faults.count("ok") == 0


@pytest.mark.parametrize("mode", ["wrong-bytes", "reset-mid-body", "truncated"])
async def test_an_upstream_that_lies_or_dies_mid_body_costs_its_mapping_only(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream, elfs: ElfSet,
    mode: str,
) -> None:
    sg = await start_symgate(
        [fast_upstream(faults.url_for(mode))], symbolize=symbolize_config(),
        tenants={"good": TenantConfig(upstreams=(debuginfod.url,))})
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    raw = profile.SerializeToString()
    status, headers, body = await post(sg, raw)
    assert status == 200 and body == raw, headers
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "upstream_error=1"
    assert faults.count(mode) >= 1
    # Nothing of the bad bytes stayed: no artifact, no table, no remembered failure.
    state = sg.runner.app[STATE]
    assert state.service.cache.peek(ArtifactKey.parse(elfs.prog.build_id, "debuginfo")) is None
    assert await state.repo.get_symbol_table(elfs.prog.build_id) is None
    assert await state.repo.artifacts_of(elfs.prog.build_id) == []
    assert await state.repo.negatives_of(elfs.prog.build_id) == []
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 0
    # The same server, asked through a sound upstream, symbolizes the same profile.
    status, headers, body = await post(sg, raw, **{"X-Scope-OrgID": "good"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert parse(body).mapping[0].has_functions


async def test_too_many_build_ids_is_422(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config(max_mappings=2))
    placed = [(replace(place(elfs.prog, BASES["prog"]), build_id=f"{i:02x}" * 20), [0x1100])
              for i in range(3)]
    status, _, text = await post(sg, make_profile(placed).SerializeToString())
    assert status == 422 and b"3 build IDs" in text
    assert faults.count("ok") == 0


async def test_deadline_answers_with_what_is_ready(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.first_byte_delay = 3
    sg = await start_symgate(
        [fast_upstream(faults.url_for("slow-first-byte"), first_byte_timeout_s=10)],
        symbolize=symbolize_config(deadline_s=0.5))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and loop.time() - started < 2.5
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "deadline=1"

    async def warmed() -> bool:  # fetches and build went on after the answer
        return (await sg.metric("symgate_symtab_builds_total", result="ok") >= 1
                and await sg.metric("symgate_cache_entries") == 2)  # debuginfo, executable

    await eventually(warmed)
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", (
        headers["X-Symgate-Mappings-Unsymbolized"])


async def test_tenants_can_be_disabled_or_given_their_own_upstreams(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate(
        [debuginfod.url], symbolize=symbolize_config(),
        tenants={"off": TenantConfig(symbolize=False),
                 "own": TenantConfig(upstreams=(faults.url_for("ok"),))})
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    raw = profile.SerializeToString()
    status, headers, body = await post(sg, raw, **{"X-Scope-OrgID": "off"})
    assert status == 200 and body == raw and headers["X-Symgate-Symbolize"] == "disabled"
    status, headers, _ = await post(sg, raw, **{"X-Scope-OrgID": "own"})
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert faults.count("ok") >= 1  # the tenant's upstream, not the global one, was asked


async def test_symbol_tables_are_built_when_cached_and_evicted_with_their_artifact(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")

    async def built() -> bool:
        return await sg.metric("symgate_symtab_builds_total", result="ok") == 1

    await eventually(built)  # pre-extracted in the background, before any profile asked
    table = sg.config.server.data_dir / "symtabs" / elfs.prog.build_id[:2] / (
        elfs.prog.build_id + ".symc")
    assert table.exists()
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    _status, headers, _ = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 1  # not rebuilt
    assert await sg.metric("symgate_symtab_cache_total", result="hit") >= 1
    state = sg.runner.app[STATE]
    assert await state.service.cache.remove(ArtifactKey.parse(elfs.prog.build_id, "debuginfo"))
    assert not table.exists()
    assert await state.repo.get_symbol_table(elfs.prog.build_id) is None


def _libc_placement(pid: int) -> tuple[int, int, int]:
    """(start, end, file offset) of libc's executable mapping in process `pid`."""
    for _ in range(200):  # the dynamic loader maps libc a moment after exec
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "r-xp" in line and line.rstrip().endswith("libc.so.6"):
                addresses, _perms, offset = line.split()[:3]
                start, end = (int(a, 16) for a in addresses.split("-"))
                return start, end, int(offset, 16)
        time.sleep(0.01)
    raise AssertionError("libc is not mapped")


def _libc_functions(limit: int) -> list[int]:
    out = subprocess.run(["nm", "--defined-only", str(LIBC_DEBUG)], capture_output=True,
                         text=True, check=True).stdout
    found = sorted({int(a, 16) for a, t, _n in (ln.split()[:3] for ln in out.splitlines()
                                                 if len(ln.split()) == 3) if t in "Tt"})
    step = max(1, len(found) // limit)
    return [a + 4 for a in found[::step]][:limit]


@pytest.mark.skipif(not LIBC_DEBUG.exists(), reason="needs Debian's libc6-dbg")
@pytest.mark.parametrize("with_executable", [True, False])
async def test_real_libc_of_a_running_process(
    start_symgate: SymgateFactory, tmp_path: Path, with_executable: bool
) -> None:
    """A profile of a live process's libc mapping, symbolized from /usr/lib/debug."""
    debug_dirs = [Path("/usr/lib/debug")]
    if with_executable:  # a tree where .build-id/xx/rest links to the binary, as Fedora's does
        tree = tmp_path / "debug" / ".build-id" / LIBC_ID[:2]
        tree.mkdir(parents=True)
        (tree / LIBC_ID[2:]).symlink_to(LIBC)
        (tree / (LIBC_ID[2:] + ".debug")).symlink_to(LIBC_DEBUG)
        debug_dirs = [tmp_path / "debug"]
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=tuple(debug_dirs)))
    proc = subprocess.Popen(["sleep", "30"])
    try:
        start, end, offset = _libc_placement(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    assert offset == text.offset & ~0xFFF  # the text segment, at a non-zero file offset
    vaddrs = _libc_functions(600)
    runtime = {v: start + (v - text.vaddr + text.offset - offset) for v in vaddrs}
    profile = Profile()
    profile.string_table.extend(["", str(LIBC), LIBC_ID])
    profile.mapping.add(id=1, memory_start=start, memory_limit=end, file_offset=offset,
                        filename=1, build_id=2)
    for i, v in enumerate(vaddrs, start=1):
        profile.location.add(id=i, mapping_id=1, address=runtime[v])
        profile.sample.add(location_id=[i], value=[1])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    out = parse(body)
    expected = llvm_symbolize(LIBC_DEBUG, vaddrs)
    assert len(expected) > 500
    by_address = {loc.address: loc for loc in out.location}
    # glibc defines many functions under several names (__gnu_get_libc_release and
    # gnu_get_libc_release); symbolic names the outer frame from .symtab, llvm from DWARF.
    aliases = symbol_aliases(LIBC_DEBUG)
    wrong = []
    for v, want in expected.items():
        got = [f.function for f in frames_of(out, by_address[runtime[v]])]
        names = [f.function for f in want]
        if got[:-1] != names[:-1] or not got or (
                got[-1] != names[-1] and got[-1] not in aliases.get(names[-1], set())):
            wrong.append((hex(v), got, names))
    assert not wrong, wrong[:5]
    guesses = await sg.metric("symgate_symtab_layout_guesses_total")
    assert guesses == (0 if with_executable else 1)


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Debian's golang-go")
async def test_output_parses_with_go_tool_pprof(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))])
    status, _, body = await post(sg, gzip.compress(profile.SerializeToString()))
    assert status == 200
    out = tmp_path / "out.pb.gz"
    out.write_bytes(body)
    env = {**os.environ, "HOME": str(tmp_path), "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local",
           "PPROF_TMPDIR": str(tmp_path)}
    result = await asyncio.to_thread(
        subprocess.run, ["go", "tool", "pprof", "-raw", str(out)], capture_output=True,
        text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\bmix\b .*util\.c:4", result.stdout), result.stdout[:2000]
    assert "square" in result.stdout and "twist" in result.stdout


def _build_id_tree(root: Path, elf: Elf) -> Path:
    """A /usr/lib/debug-style tree for one program: .build-id/xx/rest(.debug)."""
    d = root / ".build-id" / elf.build_id[:2]
    d.mkdir(parents=True)
    (d / (elf.build_id[2:] + ".debug")).symlink_to(elf.debug)
    (d / elf.build_id[2:]).symlink_to(elf.executable)
    return root


async def test_cli_symbolizes_offline_and_through_a_server(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog)
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile([(placed, vaddrs)]).SerializeToString()))
    tree = _build_id_tree(tmp_path / "debug", elfs.prog)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    outputs = {}
    for mode, flags in (("offline", ["--debug-dir", str(tree)]), ("server", ["--server", sg.url])):
        out = tmp_path / f"{mode}.pb.gz"
        result = await asyncio.to_thread(
            subprocess.run, ["symgate", "symbolize", str(source), "-o", str(out), *flags],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert re.search(r"(?i)mappings[ -]symbolized: 1", result.stderr), result.stderr
        outputs[mode] = parse(out.read_bytes())
    expected = llvm_symbolize(elfs.prog.debug, vaddrs)
    for mode, profile in outputs.items():
        by_address = {loc.address: loc for loc in profile.location}
        for vaddr, frames in expected.items():
            assert same_frames(frames_of(profile, by_address[placed.runtime(vaddr)]), frames), mode


def test_cli_rejects_a_file_that_is_not_a_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pprof"
    bad.write_bytes(b"\x1f\x8b\x08\x00truncated")
    result = subprocess.run(["symgate", "symbolize", str(bad), "-o", str(tmp_path / "o"),
                             "--debug-dir", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and "gzip" in result.stderr
    assert not (tmp_path / "o").exists()


async def test_a_profile_over_a_mebibyte_is_read_whole(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Bodies arrive in many reads; a short read once made big profiles look corrupt."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog) * 400  # ~60k locations, 1.4 MB of raw protobuf
    raw = make_profile([(placed, vaddrs)]).SerializeToString()
    assert len(raw) > 1024 * 1024  # far more than one read returns
    status, headers, body = await post(sg, raw)
    assert status == 200, body[:200]
    assert int(headers["X-Symgate-Locations-Symbolized"]) >= len(vaddrs) * 0.9
