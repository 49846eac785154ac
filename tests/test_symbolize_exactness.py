"""/symbolize names every address as llvm-symbolizer does: each instruction of gcc-built PIE,
ET_EXEC, shared-library and C++ programs, in runtime or ELF-relative addresses, and functions
across a live process's libc, from Debian's debug files with or without the binary beside
them."""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig
from symbolize.elf import layout_of_file
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import ElfSet, build_id_tree, build_program
from tests.harness import Debuginfod, SymgateFactory
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_functions, libc_placement
from tests.processes import run_in_thread
from tests.profiles import (
    code_addresses,
    frames_of,
    llvm_symbolize,
    make_profile,
    place,
    symbol_aliases,
)
from tests.symbolize_helpers import BASES, parse, post, same_frames, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


@pytest.mark.parametrize("name", ["prog", "nopie", "libmix.so", "cpp"])
@pytest.mark.parametrize("runtime", [True, False], ids=["runtime-addresses", "elf-relative"])
async def test_every_instruction_matches_llvm_symbolizer(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, name: str,
    runtime: bool,
) -> None:
    elf = elfs.named(name)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elf, BASES[name])
    vaddrs = code_addresses(elf)
    # On the executable, as a profiler runs it: it finds the debug file by .gnu_debuglink.
    expected = llvm_symbolize(elf.executable, vaddrs)
    assert len(expected) > 20
    assert any(frames[-1].file for frames in expected.values())  # it found the debug file
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


@pytest.mark.skipif(not LIBC_DEBUG.exists(), reason="needs Debian's libc6-dbg")
@pytest.mark.parametrize("with_executable", [True, False])
async def test_real_libc_of_a_running_process(
    start_symgate: SymgateFactory, tmp_path: Path, with_executable: bool
) -> None:
    """A profile of a live process's libc mapping, symbolized from /usr/lib/debug."""
    debug_dirs = [Path("/usr/lib/debug")]
    if with_executable:  # a tree where .build-id/xx/rest links to the binary, as Fedora's does
        debug_dirs = [build_id_tree(tmp_path / "debug", LIBC_ID, LIBC_DEBUG, LIBC)]
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=tuple(debug_dirs)))
    proc = subprocess.Popen(["sleep", "30"])
    try:
        start, end, offset = libc_placement(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    assert offset == text.offset & ~0xFFF  # the text segment, at a non-zero file offset
    vaddrs = libc_functions(600)
    runtime = {v: start + (v - text.vaddr + text.offset - offset) for v in vaddrs}
    profile = Profile()
    profile.string_table.extend(["", str(LIBC), LIBC_ID, "samples", "count"])
    profile.sample_type.add(type=3, unit=4)
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
    # gnu_get_libc_release); symgate names the outer frame after its DWARF subprogram (as
    # --functions=short does) or an export, llvm after the last of its .symtab aliases.
    # Given the executable, symgate names a `.cold` part (which no .dynsym symbol covers) by
    # its DWARF linkage name (`__GI_putwc`), as llvm does given the executable.
    aliases = symbol_aliases(LIBC_DEBUG)
    dwarf = llvm_symbolize(LIBC_DEBUG, vaddrs, functions="short")
    on_executable = llvm_symbolize(LIBC, vaddrs) if with_executable else {}
    wrong = []
    for v, want in expected.items():
        frames = frames_of(out, by_address[runtime[v]])
        got = [f.function for f in frames]
        names = [f.function for f in want]
        outer = {names[-1], dwarf[v][-1].function}
        if v in on_executable:
            outer.add(on_executable[v][-1].function)
        # Inlined frames: llvm prints the linkage name, which is symgate's name and system
        # name.
        if [(f.function, f.system_name) for f in frames[:-1]] \
                != [(f.function, f.system_name) for f in want[:-1]] \
                or not got or (got[-1] not in outer
                               and got[-1] not in aliases.get(names[-1], set())):
            wrong.append((hex(v), got, names))
    assert not wrong, wrong[:5]
    guesses = await sg.metric("symgate_symtab_layout_guesses_total")
    assert guesses == (0 if with_executable else 1)


@pytest.mark.skipif(shutil.which("ld.lld") is None, reason="needs lld (Debian's lld)")
async def test_an_lld_linked_pie_from_its_debug_file_alone(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """Issue 14 (4): with only a `.debug` tree (a site's own build output), an lld-linked PIE
    got none of its addresses: GNU ld's layout, guessed where no executable could be had, puts
    its code a page away from where lld does. The layout is derived from the debug file."""
    elf = build_program(tmp_path / "src", tmp_path, "lldprog", 7, extra_flags=("-fuse-ld=lld",))
    layout = layout_of_file(elf.executable)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    assert text.offset != text.vaddr - layout.load_address  # not GNU ld's layout
    tree = tmp_path / "debug" / ".build-id" / elf.build_id[:2]
    tree.mkdir(parents=True)
    (tree / (elf.build_id[2:] + ".debug")).symlink_to(elf.debug)  # and no executable
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    placed = place(elf, 0x55D0C0DE0000)
    vaddrs = code_addresses(elf)
    expected = llvm_symbolize(elf.debug, vaddrs)
    assert len(expected) > 20
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    status, headers, body = await post(sg, sent)
    assert status == 200, body
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    # And `symgate inspect`, over the same tree, says so too.
    (tmp_path / "cpu.pb").write_bytes(sent)
    (tmp_path / "inspect.toml").write_text(f'[[upstreams]]\npath = "{tmp_path / "debug"}"\n')
    inspected = await run_in_thread(["symgate", "inspect", str(tmp_path / "cpu.pb"), "--config",
                                     str(tmp_path / "inspect.toml"), "--json"], timeout=60)
    assert inspected.returncode == 0, inspected.stderr
    assert [r["would_symbolize"] for r in json.loads(inspected.stdout)] == [True]
    out = parse(body)
    by_address = {loc.address: loc for loc in out.location}
    wrong = [hex(v) for v, frames in expected.items()
             if not same_frames(frames_of(out, by_address[placed.runtime(v)]), frames)]
    assert not wrong, wrong[:5]
    assert await sg.metric("symgate_symtab_layout_guesses_total") == 0


@pytest.mark.parametrize("linker", ["gnu-ld-noseparate-code", "gold"])
@pytest.mark.parametrize("with_executable", [True, False], ids=["with-executable", "debug-only"])
async def test_code_in_the_first_segment_with_the_elf_header(
    start_symgate: SymgateFactory, tmp_path: Path, linker: str, with_executable: bool
) -> None:
    """GNU ld -z noseparate-code (the default before binutils 2.31, and on RHEL 8) and gold
    put the code in the first PT_LOAD, at file offset 0, with the ELF header and the notes.
    objcopy --only-keep-debug keeps those bytes, so the debug file's code segment claims a few
    hundred bytes of file: taken for the program's layout, it left every runtime address past
    them outside the mapping, even with the executable beside."""
    flag = "-Wl,-z,noseparate-code" if linker != "gold" else "-fuse-ld=gold"
    if linker == "gold" and shutil.which("ld.gold") is None:
        pytest.skip("needs gold (binutils)")
    elf = build_program(tmp_path / "src", tmp_path, "firstseg", 9, extra_flags=(flag,))
    exe_layout, debug_layout = layout_of_file(elf.executable), layout_of_file(elf.debug)
    assert exe_layout is not None and debug_layout is not None
    text = next(s for s in exe_layout.segments if s.executable)
    assert text.offset == 0
    kept = next(s for s in debug_layout.segments if s.executable).filesz
    assert 0 < kept < text.filesz  # the header's bytes, not the code's
    assert exe_layout.has_file_layout and not debug_layout.has_file_layout
    tree = tmp_path / "debug" / ".build-id" / elf.build_id[:2]
    tree.mkdir(parents=True)
    (tree / (elf.build_id[2:] + ".debug")).symlink_to(elf.debug)
    if with_executable:
        (tree / elf.build_id[2:]).symlink_to(elf.executable)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    placed = place(elf, 0x55D0C0DE0000 if exe_layout.elf_type == "ET_DYN" else 0)
    vaddrs = code_addresses(elf)
    assert max(vaddrs) - text.vaddr > kept  # addresses past what the debug file claims
    expected = llvm_symbolize(elf.debug, vaddrs)
    assert len(expected) > 20
    status, headers, body = await post(sg, make_profile([(placed, vaddrs)]).SerializeToString())
    assert status == 200, body
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    out = parse(body)
    by_address = {loc.address: loc for loc in out.location}
    wrong = [hex(v) for v, frames in expected.items()
             if not same_frames(frames_of(out, by_address[placed.runtime(v)]), frames)]
    assert not wrong, wrong[:5]
    # Without the executable, GNU ld's layout is guessed, and fits: code at vaddr - base.
    assert await sg.metric("symgate_symtab_layout_guesses_total") == (0 if with_executable
                                                                       else 1)


FAR_C = r"""
#include <stdio.h>
#include <stdlib.h>
static inline int sq(int x) { return x * x; }
__attribute__((noinline, section(".farcode"))) int far_fn(int a) {
    int s = 0;
    for (int i = 0; i < a; i++) s += sq(i) ^ (i >> 2);
    return s;
}
__attribute__((noinline, section(".farcode"))) int far_fn2(int a) { return far_fn(a) * 3 + sq(a); }
__attribute__((noinline, aligned(4096))) int near_fn(int a) { return far_fn2(a) + sq(a + 1); }
int main(int argc, char **argv) {
    printf("%d\n", near_fn(argc > 1 ? atoi(argv[1]) : 10));
    return 0;
}
"""


async def test_every_mapping_of_a_program_with_two_code_segments(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A PIE whose code is in two PT_LOADs (a section placed far from .text: the second at a
    file offset unrelated to its vaddr), mapped as a process has it, every segment a mapping of
    one build ID (its first r-- page, the data, each code segment), and mapped again at another
    base under its build ID in upper case. Every byte of both code segments is named as
    llvm-symbolizer names it, nothing outside them is, and the server and the CLI give the same
    bytes, run after run."""
    (tmp_path / "far.c").write_text(FAR_C)
    exe = tmp_path / "far"
    subprocess.run(["gcc", "-g", "-O2", "-Wl,--build-id", "-Wl,--section-start=.farcode=0x200000",
                    "-o", exe, tmp_path / "far.c"], check=True, capture_output=True)
    layout = layout_of_file(exe)
    assert layout is not None and layout.build_id
    code = [s for s in layout.segments if s.executable]
    assert len(code) == 2 and code[1].offset != code[1].vaddr  # not where GNU ld's guess has it
    data = [s for s in layout.segments if not s.executable]

    def page(x: int) -> int:
        return x & ~0xFFF

    symbols = subprocess.run(["nm", exe], capture_output=True, text=True, check=True).stdout
    near = next(int(line.split()[0], 16) for line in symbols.splitlines()
                if line.endswith(" T near_fn"))
    assert page(near) == near > code[0].vaddr  # the first code segment's second page
    tree = tmp_path / "debug" / ".build-id" / layout.build_id[:2]
    tree.mkdir(parents=True)
    (tree / layout.build_id[2:]).symlink_to(exe)

    profile = Profile()
    profile.string_table.extend(["", "cpu", "nanoseconds", str(exe), layout.build_id,
                                 layout.build_id.upper()])
    profile.sample_type.add(type=1, unit=2)
    # /proc/PID/maps' lines of each segment: the first code segment's in two, at the page of
    # near_fn (as after an mprotect of part of it), which its first byte begins.
    split = page(near)
    pieces = [(page(data[0].vaddr), page(data[0].vaddr + data[0].memsz + 0xFFF)),
              (page(code[0].vaddr), split), (split, page(code[0].vaddr + code[0].memsz + 0xFFF)),
              (page(code[1].vaddr), page(code[1].vaddr + code[1].memsz + 0xFFF)),
              (page(data[-1].vaddr), page(data[-1].vaddr + data[-1].memsz + 0xFFF))]
    in_code = {v for seg in code for v in range(seg.vaddr, seg.vaddr + seg.filesz)}
    vaddrs = sorted(in_code)
    expected = llvm_symbolize(exe, vaddrs)
    assert {f.function for frames in expected.values() for f in frames} >= {"far_fn", "near_fn"}
    where: dict[int, int | None] = {}  # location id -> its vaddr, None where it names nothing
    for base, bid in ((0x55D0C0DE0000, 4), (0x5612AB000000, 5)):
        for start, limit in pieces:
            seg = next(s for s in layout.segments if page(s.vaddr) <= start < s.vaddr + s.memsz)
            m = profile.mapping.add(id=len(profile.mapping) + 1, memory_start=base + start,
                                    memory_limit=base + limit, filename=3, build_id=bid,
                                    file_offset=page(seg.offset) + start - page(seg.vaddr))
            step = 1 if seg.executable else 61
            # A byte before the mapping, and its limit and the byte after: another mapping's.
            for v in (start - 1, *range(start, limit, step), limit, limit + 1):
                loc = profile.location.add(id=len(profile.location) + 1, mapping_id=m.id,
                                           address=base + v)
                where[loc.id] = v if start <= v < limit and v in in_code else None
                profile.sample.add(location_id=[loc.id, loc.id], value=[loc.id])
    body = profile.SerializeToString()

    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    served = []
    for _ in range(2):
        status, headers, answer = await post(sg, body)
        assert status == 200, answer
        served.append(answer)
    assert headers["X-Symgate-Mappings-Symbolized"] == "6", headers  # the code, twice
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)
    offline = [(await asyncio.to_thread(symbolize_bytes, body, [tmp_path / "debug"], limits))[0]
               for _ in range(2)]
    assert served == offline == [served[0]] * 2
    out = parse(served[0])
    wrong = []
    for loc in out.location:
        v = where[loc.id]
        want = expected.get(v, []) if v is not None else []
        if not same_frames(frames_of(out, loc), want):
            wrong.append((loc.mapping_id, hex(loc.address), frames_of(out, loc), want))
    assert not wrong, wrong[:5]
    assert sum(1 for loc in out.location if loc.line) >= 2 * len(expected)
