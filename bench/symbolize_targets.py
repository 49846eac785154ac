"""Issue 14's targets, measured beside llvm-symbolizer on the same addresses (symbolize_bench.py
prints them after its own rows):

  * exact names: the share of locations whose frames carry llvm-symbolizer's function names
    (and, apart, the DWARF names `--functions=short` gives), lines and inline chains, over a
    profile of libc and gcc-built programs;
  * cold: a realistic profile of 30 mappings (libc, ld.so, libstdc++ and 27 gcc-built
    programs), no table built, to a server that has just started and to one up for a while,
    against one llvm-symbolizer run;
  * peak memory of a warm rewrite against the size of the decoded profile.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symbolize.elf import layout_of_file  # noqa: E402
from symbolize.pprof.profile_pb2 import Profile  # noqa: E402
from symbolize.symtab import TableSpec, build_symbol_table  # noqa: E402
from symbolize.worker import Answer, Limits, Workspace  # noqa: E402

PAGE = 0x1000
_C = r"""
#include <stdio.h>
#include <stdlib.h>
static inline int sq(int x) { return x * x; }
static int __attribute__((noinline)) spin%(n)d(int n) {
    int a = %(n)d; for (int i = 0; i < n; i++) a += sq(i) ^ (a >> 3); return a; }
int main(int c, char **v) { printf("%%d\n", spin%(n)d(c > 1 ? atoi(v[1]) : 9)); return 0; }
"""


def build_programs(out: Path, count: int) -> list[tuple[Path, Path, str]]:
    """`count` gcc -O2 programs, each as (executable, debug file, build ID)."""
    made = []
    for n in range(count):
        src, exe, debug = out / f"p{n}.c", out / f"p{n}", out / f"p{n}.debug"
        src.write_text(_C % {"n": n})
        subprocess.run(["gcc", "-g", "-O2", "-Wl,--build-id", "-o", str(exe), str(src)],
                       check=True)
        subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
        subprocess.run(["objcopy", "--strip-debug", str(exe)], check=True)
        layout = layout_of_file(exe)
        assert layout is not None and layout.build_id
        made.append((exe, debug, layout.build_id))
    return made


def debug_file(build_id: str) -> Path:
    return Path(f"/usr/lib/debug/.build-id/{build_id[:2]}/{build_id[2:]}.debug")


def text_addresses(exe: Path, n: int, rng: random.Random) -> list[int]:
    layout = layout_of_file(exe)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    return [text.vaddr + rng.randrange(text.filesz) for _ in range(n)]


def llvm_frames(pairs: list[tuple[Path, int]], functions: str = "linkage"
                ) -> tuple[float, list[list[dict[str, object]]]]:
    """One llvm-symbolizer run over `obj addr` lines: its time and frames per line."""
    started = time.perf_counter()
    out = subprocess.run(["llvm-symbolizer", "--inlining", "--output-style=JSON",
                          f"--functions={functions}"],
                         input="\n".join(f"{p} {hex(a)}" for p, a in pairs),
                         capture_output=True, text=True, check=True).stdout
    elapsed = time.perf_counter() - started
    return elapsed, [json.loads(line)["Symbol"] for line in out.splitlines() if line.strip()]


def placed_profile(files: list[tuple[Path, str, list[int]]], relative: bool) -> Profile:
    """One mapping per (executable, build ID, vaddrs), at page-aligned bases."""
    p = Profile()
    p.string_table.extend(["", "cpu", "nanoseconds"])
    p.sample_type.add(type=1, unit=2)
    loc = 0
    for mid, (exe, build_id, vaddrs) in enumerate(files, start=1):
        layout = layout_of_file(exe)
        assert layout is not None
        text = next(s for s in layout.segments if s.executable)
        base = 0 if relative else 0x7F0000000000 + mid * 0x10000000
        p.string_table.extend([str(exe), build_id])
        n = len(p.string_table)
        if relative:
            p.mapping.add(id=mid, filename=n - 2, build_id=n - 1)
        else:
            start = base + (text.vaddr & ~(PAGE - 1))
            limit = base + ((text.vaddr + text.memsz + PAGE - 1) & ~(PAGE - 1))
            p.mapping.add(id=mid, memory_start=start, memory_limit=limit,
                          file_offset=text.offset & ~(PAGE - 1), filename=n - 2,
                          build_id=n - 1)
        for v in vaddrs:
            loc += 1
            p.location.add(id=loc, mapping_id=mid, address=base + v)
            p.sample.add(location_id=[loc], value=[1])
    return p


def exactness(programs: list[tuple[Path, Path, str]], libc: Path, libc_id: str,
              work: Path) -> dict[str, float]:
    """Shares of locations with llvm-symbolizer's names, DWARF names, lines and chains."""
    rng = random.Random(14)
    files = [(libc, debug_file(libc_id), libc_id, text_addresses(libc, 3000, rng))]
    files += [(exe, debug, bid, text_addresses(exe, 60, rng)) for exe, debug, bid in programs]
    workspace, answers = Workspace(64), {}
    for _exe, debug, bid, _v in files:
        built = build_symbol_table(debug, work / f"{bid}.symc", bid)
        answers[bid] = Answer(TableSpec(work / f"{bid}.symc", built.load_address,
                                        built.code_ranges, built.cold_ranges, built.has_lines))
    profile = placed_profile([(exe, bid, v) for exe, _d, bid, v in files], relative=True)
    done = workspace.finish(profile.SerializeToString(), Limits(1 << 31, 1000), answers)
    assert done.body is not None
    out = Profile.FromString(done.body)
    s, by_id = out.string_table, {f.id: f for f in out.function}
    ours = [[(s[by_id[ln.function_id].name], ln.line) for ln in loc.line] for loc in out.location]
    pairs = [(debug, v) for _e, debug, _b, vaddrs in files for v in vaddrs]
    _t, llvm = llvm_frames(pairs)
    _t, short = llvm_frames(pairs, "short")
    counted = names = dwarf = lines = line_total = chains = 0
    for got, want, plain in zip(ours, llvm, short, strict=True):
        if not want or want[0]["FunctionName"] in ("", "??"):
            continue
        counted += 1
        names += [g[0] for g in got] == [w["FunctionName"] for w in want]
        dwarf += [g[0] for g in got] == [w["FunctionName"] or g[0]
                                         for g, w in zip(got, plain, strict=False)]
        chains += len(got) == len(want)
        if want[0]["Line"]:
            line_total += 1
            lines += bool(got) and got[0][1] == want[0]["Line"]
    return {"locations": counted, "exact_llvm_names": names / counted,
            "dwarf_names": dwarf / counted, "lines_where_llvm_has_them": lines / line_total,
            "inline_chains": chains / counted}


def peak_memory(libc: Path, libc_id: str, work: Path, n: int) -> dict[str, float]:
    """Traced peak of a warm rewrite of `n` libc addresses over the decoded profile's size
    (Python's allocations: protobuf's own arena is not traced)."""
    built = build_symbol_table(debug_file(libc_id), work / "mem.symc", libc_id)
    spec = TableSpec(work / "mem.symc", built.load_address, built.code_ranges,
                     built.cold_ranges, built.has_lines)
    layout = layout_of_file(libc)
    assert layout is not None
    body = placed_profile([(libc, libc_id, text_addresses(libc, n, random.Random(n)))],
                          relative=False).SerializeToString()
    workspace = Workspace(8)
    answers = {libc_id: Answer(spec, layout.segments)}
    workspace.finish(body, Limits(1 << 31, 100), answers)
    tracemalloc.start()
    workspace.finish(body, Limits(1 << 31, 100), answers)
    _now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"profile_bytes": float(len(body)), "traced_peak_bytes": float(peak),
            "peak_over_profile": peak / len(body)}


Serve = Callable[[Path, float], tuple[subprocess.Popen[bytes], str]]
Post = Callable[[str, bytes], tuple[float, dict[str, str], bytes]]
Stop = Callable[[subprocess.Popen[bytes]], None]


def main_targets(libc: Path, libc_id: str, serve_tree: Serve, post: Post, stop: Stop
                 ) -> dict[str, object]:
    """Everything above, printed. symbolize_bench.py's helpers: `serve_tree(tree)` starts a
    fresh server over a debug tree (and waits as long as asked after /healthz answers),
    `post` sends it a profile, `stop` stops it."""
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="symgate-targets-") as tmp:
        work = Path(tmp)
        programs = build_programs(work, 27)
        results["names"] = exactness(programs, libc, libc_id, work)
        print("exactness:", json.dumps(results["names"]), flush=True)
        results["memory_1M"] = peak_memory(libc, libc_id, work, 1_000_000)
        print("memory:", json.dumps(results["memory_1M"]), flush=True)
        results["cold_30_mappings"] = cold(programs, libc, libc_id, work, serve_tree, post,
                                           stop)
        print("cold:", json.dumps(results["cold_30_mappings"]), flush=True)
    return results


def cold(programs: list[tuple[Path, Path, str]], libc: Path, libc_id: str, work: Path,
         serve_tree: Serve, post: Post, stop: Stop) -> dict[str, float]:
    """A 30-mapping profile of 20,000 locations, cold, against llvm-symbolizer."""
    rng = random.Random(30)
    ld_so = Path("/lib64/ld-linux-x86-64.so.2").resolve()
    stdcxx = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6").resolve()
    mappings: list[tuple[Path, Path, str, list[int]]] = []
    for exe, share in ((libc, 8000), (ld_so, 1000), (stdcxx, 1000)):
        layout = layout_of_file(exe)
        assert layout is not None and layout.build_id
        debug = debug_file(layout.build_id)
        mappings.append((exe, debug if debug.exists() else exe, layout.build_id,
                         text_addresses(exe, share, rng)))
    mappings += [(exe, debug, bid, text_addresses(exe, 10_000 // len(programs), rng))
                 for exe, debug, bid in programs]
    tree = work / "tree"
    for exe, debug, bid, _v in mappings:
        d = tree / ".build-id" / bid[:2]
        d.mkdir(parents=True, exist_ok=True)
        if debug != exe:
            (d / (bid[2:] + ".debug")).symlink_to(debug)
        (d / bid[2:]).symlink_to(exe)
    body = placed_profile([(exe, bid, v) for exe, _d, bid, v in mappings],
                          relative=False).SerializeToString()
    llvm_s, _frames = llvm_frames([(debug, v) for _e, debug, _b, vs in mappings for v in vs])
    times = []
    # A request the moment /healthz answers, and one to a server up for a while (its workers
    # started): both with no table built yet.
    for settle_s in (0.0, 8.0):
        proc, url = serve_tree(tree, settle_s)
        try:
            elapsed, _headers, _out = post(url, body)
        finally:
            stop(proc)
        times.append(elapsed)
    return {"locations": float(sum(len(v) for *_x, v in mappings)),
            "llvm_symbolizer_s": llvm_s, "first_after_start_s": times[0],
            "cold_on_a_running_server_s": times[1], "ratio_vs_llvm": times[1] / llvm_s,
            "first_over_running": times[0] / times[1]}
