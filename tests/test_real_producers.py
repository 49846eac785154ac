"""/symbolize fed by real profilers rather than profiles made up here: Go's runtime/pprof CPU
profile of a cgo program whose own threads spend their time in C code and libc. What comes
back names every frame llvm-symbolizer names, and changes nothing else of the profile."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig
from symbolize.elf import build_id_of_file, layout_of_file
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Location, Mapping, Profile
from tests.elfs import build_id_tree, go_build
from tests.harness import SymgateFactory
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.profiles import Expected, frames_of, llvm_symbolize
from tests.symbolize_helpers import parse, post, same_frames, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

# Two threads of its own C code, started and joined from Go: a Go thread in a cgo call is
# sampled as runtime.cgocall, a thread Go did not start at the PC the signal interrupted.
CGO_MAIN = r"""
package main

/*
#cgo CFLAGS: -g -O2
#cgo LDFLAGS: -lpthread
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static volatile unsigned long sink;

static inline unsigned long mixc(unsigned long x) { return x * 2654435761u ^ (x >> 7); }

__attribute__((noinline)) static unsigned long spin(unsigned long n) {
    unsigned long acc = 0;
    for (unsigned long i = 0; i < n; i++) acc += mixc(i + acc);
    return acc;
}

static int cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static void *worker(void *arg) {
    int *buf = malloc(sizeof(int) * 20000);
    char s[4096];
    memset(s, 'a', sizeof s - 1);
    s[sizeof s - 1] = 0;
    for (long r = 0; r < (long)arg; r++) {
        for (int i = 0; i < 20000; i++) buf[i] = (i * 7919) % 20011;
        qsort(buf, 20000, sizeof(int), cmp);
        sink += strlen(s);
        sink += spin(100000);
    }
    free(buf);
    return NULL;
}

static void run_workers(long rounds) {
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, worker, (void *)rounds);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
}
*/
import "C"

import (
	"os"
	"runtime/pprof"
)

func main() {
	f, err := os.Create(os.Args[1])
	if err != nil {
		panic(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		panic(err)
	}
	C.run_workers(400)
	pprof.StopCPUProfile()
	f.Close()
}
"""


def _nameless(profile: Profile, location: Location) -> bool:
    """What Go's runtime/pprof writes for a PC it cannot name: a line of a function named ""."""
    s = profile.string_table
    functions = {f.id: f for f in profile.function}
    return bool(location.line) and all(
        not s[functions[ln.function_id].name] and not s[functions[ln.function_id].system_name]
        for ln in location.line)


def _vaddr(m: Mapping, address: int, elf: Path) -> int | None:
    layout = layout_of_file(elf)
    assert layout is not None
    offset = address - m.memory_start + m.file_offset
    for seg in layout.segments:
        if seg.offset <= offset < seg.offset + seg.filesz:
            return offset - seg.offset + seg.vaddr
    return None


@dataclass(frozen=True)
class GoProfile:
    exe: Path  # built with DWARF, not stripped: its own debug file
    body: bytes  # gzipped, as runtime/pprof writes it


@pytest.fixture(scope="module")
def go_cgo_profile(tmp_path_factory: pytest.TempPathFactory) -> GoProfile:
    if shutil.which("go") is None:
        pytest.skip("needs Debian's golang-go")
    root = tmp_path_factory.mktemp("cgo")
    exe, env = go_build(root, CGO_MAIN, "cgoprof", cgo=True)
    subprocess.run([str(exe), str(root / "cpu.pprof")], env=env, check=True,
                   capture_output=True, timeout=300)
    return GoProfile(exe, (root / "cpu.pprof").read_bytes())


@pytest.mark.skipif(not LIBC_DEBUG.exists(), reason="needs Debian's libc6-dbg")
async def test_a_go_cgo_cpu_profile_gets_its_c_and_libc_frames_named(
    start_symgate: SymgateFactory, go_cgo_profile: GoProfile, tmp_path: Path
) -> None:
    """Go names the PCs it cannot symbolize (C code, libc) with one line of a function whose
    name is "" rather than leaving the location without lines. Such a location was taken for a
    symbolized one: a real cgo profile came back with nothing filled in."""
    exe, body = go_cgo_profile.exe, go_cgo_profile.body
    exe_id = build_id_of_file(exe)
    assert exe_id
    tree = build_id_tree(tmp_path / "debug", exe_id, exe, exe)
    tree = build_id_tree(tree, LIBC_ID, LIBC_DEBUG, LIBC)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tree,)))
    status, _headers, served = await post(sg, body)
    assert status == 200

    before, after = parse(body), parse(served)
    s = before.string_table
    files = {exe_id: exe, LIBC_ID: LIBC}
    ours = {m.id: m for m in before.mapping if s[m.build_id] in files}
    assert len(ours) == 2, [(s[m.filename], s[m.build_id]) for m in before.mapping]
    unnamed = [loc for loc in before.location if loc.mapping_id in ours
               and _nameless(before, loc)]
    assert unnamed  # the C threads ran for seconds: sampled in C code
    # Nothing but the lines of those locations changed (their mappings say they have
    # functions now).
    assert list(after.string_table[:len(s)]) == list(s)
    assert list(after.sample) == list(before.sample)
    named_before = {loc.id: loc for loc in before.location if not _nameless(before, loc)}
    after_by_id = {loc.id: loc for loc in after.location}
    for loc_id, loc in named_before.items():
        assert frames_of(after, after_by_id[loc_id]) == frames_of(before, loc)
    for m in after.mapping:
        if m.id not in ours:
            assert m == next(o for o in before.mapping if o.id == m.id)

    wrong, named = [], 0
    for bid, elf in files.items():
        m = next(m for m in ours.values() if s[m.build_id] == bid)
        locs = [loc for loc in unnamed if loc.mapping_id == m.id]
        vaddrs = {loc.id: _vaddr(m, loc.address, elf) for loc in locs}
        want = llvm_symbolize(elf, [v for v in vaddrs.values() if v is not None])
        dwarf = llvm_symbolize(elf, [v for v in vaddrs.values() if v is not None], "short")
        for loc in locs:
            v = vaddrs[loc.id]
            got = frames_of(after, after_by_id[loc.id])
            expected = want.get(v, []) if v is not None else []
            if not expected:
                continue  # a PC Go moved back a byte, into the padding before a function
            named += 1
            # Paths as symbolic writes them (`.` and `..` resolved); glibc's outer frames by
            # their DWARF name or an exported one (`__nanosleep`, where llvm, on the debug
            # file, takes another of its .symtab aliases, `nanosleep`).
            normal = [Expected(e.function, e.system_name, os.path.normpath(e.file), e.line,
                               e.start_line) for e in expected]
            short = [Expected(e.function, e.system_name, os.path.normpath(e.file), e.line,
                              e.start_line) for e in dwarf.get(v, [])]
            if not (same_frames(got, normal) or same_frames(got, short)):
                wrong.append((hex(loc.address), got, expected))
    assert named and not wrong, wrong[:5]

    # The same bytes offline, from the same tree.
    limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)
    offline, _report = await asyncio.to_thread(symbolize_bytes, body, [tree], limits)
    assert offline == served


async def test_go_s_unnamed_frames_get_the_fallback_name(
    start_symgate: SymgateFactory, go_cgo_profile: GoProfile, tmp_path: Path
) -> None:
    """With ?fallback=module-offset, a frame no debug info names is `module+0xoffset`: Go's
    frames of a function named "" too, which were left as they came, nameless."""
    body = go_cgo_profile.body
    empty = tmp_path / "debug"
    empty.mkdir()
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(empty,)))
    status, _headers, served = await sg.request(
        "POST", "/symbolize?fallback=module-offset", data=body,
        headers={"Content-Type": "application/octet-stream"})
    assert status == 200
    before, after = parse(body), parse(served)
    s = before.string_table
    libc = next(m for m in before.mapping if s[m.build_id] == LIBC_ID)
    unnamed = [loc for loc in before.location if loc.mapping_id == libc.id
               and _nameless(before, loc)]
    assert unnamed  # the C threads ran for seconds, much of it in qsort and strlen
    after_by_id = {loc.id: loc for loc in after.location}
    for loc in unnamed:
        offset = loc.address - libc.memory_start + libc.file_offset
        assert [f.function for f in frames_of(after, after_by_id[loc.id])] == \
            [f"libc.so.6+{offset:#x}"], hex(loc.address)
