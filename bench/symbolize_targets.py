"""Issue 14's targets, measured beside llvm-symbolizer on the same addresses (symbolize_bench.py
prints them after its own rows; `python bench/symbolize_targets.py --only names` measures one):

  * exact names: the share of locations whose frames carry llvm-symbolizer's function names
    (and, apart, the DWARF names `--functions=short` gives), lines and inline chains, over a
    profile of libc and gcc-built programs;
  * cold: a realistic profile of 30 mappings (libc, ld.so, libstdc++ and 27 gcc-built
    programs), no table built, to a server that has just started and to one up for a while,
    against one llvm-symbolizer run;
  * peak memory of a warm rewrite against the size of the decoded profile;
  * many mappings (not a target of its own, reported beside them): a profile of 60 small
    gcc-built programs, 370 addresses each, cold and warm, against one llvm-symbolizer run;
    its cost is per mapping, where the targets' is per address.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symbolize.elf import cold_part, layout_of_file  # noqa: E402
from symbolize.pprof.profile_pb2 import Profile  # noqa: E402
from symbolize.symtab import TableSpec, build_symbol_table  # noqa: E402
from symbolize.worker import Answer, Limits, Workspace  # noqa: E402

PAGE = 0x1000
ROUNDS = 3  # of the cold measures
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


def llvm_frames(pairs: list[tuple[Path, int]], functions: str = "linkage",
                debug_dirs: tuple[Path, ...] = ()) -> tuple[float, list[list[dict[str, object]]]]:
    """One llvm-symbolizer run over `obj addr` lines: its time and frames per line.

    Given executables, llvm-symbolizer finds their debug files by build ID under `debug_dirs`
    (a given one replaces its default, /usr/lib/debug) and names the outermost frame from the
    executable's own symbols, as a profiler that runs it on the mapped file gets them."""
    started = time.perf_counter()
    out = subprocess.run(["llvm-symbolizer", "--inlining", "--output-style=JSON",
                          f"--functions={functions}",
                          *(f"--debug-file-directory={d}" for d in debug_dirs)],
                         input="\n".join(f"{p} {hex(a)}" for p, a in pairs),
                         capture_output=True, text=True, check=True).stdout
    elapsed = time.perf_counter() - started
    return elapsed, [json.loads(line)["Symbol"] for line in out.splitlines() if line.strip()]


def debug_tree(root: Path, programs: list[tuple[Path, Path, str]]) -> Path:
    """A .build-id tree of the programs' debug files, for llvm-symbolizer to find them by."""
    for _exe, debug, bid in programs:
        d = root / ".build-id" / bid[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / (bid[2:] + ".debug")).symlink_to(debug)
    return root


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


Frames = list[tuple[str, str, int]]  # (name, system name, line), innermost first


def exactness(programs: list[tuple[Path, Path, str]], libc: Path, libc_id: str,
              work: Path) -> dict[str, float]:
    """Shares of locations with llvm-symbolizer's names, lines and chains, llvm-symbolizer
    run on the executables (their debug files found by build ID); its names run on the debug
    files beside, for the record, and why the rest differ."""
    rng = random.Random(14)
    files = [(libc, debug_file(libc_id), libc_id, text_addresses(libc, 3000, rng))]
    files += [(exe, debug, bid, text_addresses(exe, 60, rng)) for exe, debug, bid in programs]
    workspace, answers = Workspace(64), {}
    for exe, debug, bid, _v in files:
        # As the server and the CLI build it when both files are at hand.
        built = build_symbol_table(debug, work / f"{bid}.symc", bid, exe)
        answers[bid] = Answer(TableSpec(work / f"{bid}.symc", built.load_address,
                                        built.code_ranges, built.cold_ranges, built.has_lines))
    profile = placed_profile([(exe, bid, v) for exe, _d, bid, v in files], relative=True)
    done = workspace.finish(profile.SerializeToString(), Limits(1 << 31, 1000), answers)
    assert done.body is not None
    out = Profile.FromString(done.body)
    s, by_id = out.string_table, {f.id: f for f in out.function}
    ours: list[Frames] = [[(s[by_id[ln.function_id].name], s[by_id[ln.function_id].system_name],
                            ln.line) for ln in loc.line] for loc in out.location]
    tree = debug_tree(work / "llvm-debug", programs)
    _t, llvm = llvm_frames([(exe, v) for exe, _d, _b, vaddrs in files for v in vaddrs],
                           debug_dirs=(tree, Path("/usr/lib/debug")))
    _t, on_debug = llvm_frames([(debug, v) for _e, debug, _b, vaddrs in files for v in vaddrs])
    aliases = _aliases([debug for _e, debug, _b, _v in files])
    counted = names = debug_names = lines = line_total = chains = 0
    why: dict[str, int] = {}
    for got, want, dbg in zip(ours, llvm, on_debug, strict=True):
        if not want or want[0]["FunctionName"] in ("", "??"):
            continue
        counted += 1
        wanted = [str(w["FunctionName"]) for w in want]
        names += [g[0] for g in got] == wanted
        debug_names += [g[0] for g in got] == [w["FunctionName"] for w in dbg]
        chains += len(got) == len(want)
        if want[0]["Line"]:
            line_total += 1
            lines += bool(got) and got[0][2] == want[0]["Line"]
        if [g[0] for g in got] != wanted:
            reason = mismatch(got, wanted, aliases)
            why[reason] = why.get(reason, 0) + 1
    return {"locations": counted, "exact_llvm_names": names / counted,
            "exact_llvm_names_on_debug_files": debug_names / counted,
            "lines_where_llvm_has_them": lines / line_total,
            "inline_chains": chains / counted,
            **{f"differ_{k}": v / counted for k, v in sorted(why.items())}}


def _aliases(debug_files: list[Path]) -> dict[str, set[str]]:
    """Every function symbol's name (its version cut) -> the names defined where it is."""
    at: dict[tuple[int, int], set[str]] = {}
    for n, path in enumerate(debug_files):
        out = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True,
                             text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TtWwi":
                at.setdefault((n, int(parts[0], 16)), set()).add(parts[2].partition("@")[0])
    found: dict[str, set[str]] = {}
    for names in at.values():
        for name in names:
            found.setdefault(name, set()).update(names)
    return found


def mismatch(got: Frames, wanted: list[str], aliases: dict[str, set[str]]) -> str:
    """Why symgate's names are not llvm-symbolizer's, where the reason is one of the known
    (both seen only where a table was built without the executable):

      * another_exported_alias: the function is exported under several names (`strxfrm_l`
        and `__strxfrm_l`); llvm takes the last in the executable's .dynsym, which is in hash
        order and which a detached debug file lacks; symgate its DWARF name when exported;
      * cold_part: code in GCC's `.cold` part: llvm names it after the function (no .dynsym
        symbol covers it), symgate after the `.cold` symbol, as llvm does on the debug file.
    """
    names = [g[0] for g in got]
    if len(names) != len(wanted):
        return "unexplained"
    reasons = set()
    for i, (ours, theirs) in enumerate(zip(names, wanted, strict=True)):
        if ours == theirs:
            continue
        if i == len(names) - 1 and cold_part(ours) == theirs:
            reasons.add("cold_part")
        elif i == len(names) - 1 and ours in aliases.get(theirs, set()):
            reasons.add("another_exported_alias")
        else:
            return "unexplained"
    return "+".join(sorted(reasons))


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
        results["many_programs"] = many_programs(work, serve_tree, post, stop)
        print("many programs:", json.dumps(results["many_programs"]), flush=True)
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
    pairs = [(debug, v) for _e, debug, _b, vs in mappings for v in vs]
    # A request the moment /healthz answers, and one to a server up for a while (its workers
    # started): both with no table built yet. Medians of interleaved rounds: one cold run of
    # each moved by 30-50% between runs minutes apart.
    llvm, first, running = [], [], []
    for _round in range(ROUNDS):
        llvm.append(llvm_frames(pairs)[0])
        for settle_s, times in ((0.0, first), (8.0, running)):
            proc, url = serve_tree(tree, settle_s)
            try:
                times.append(post(url, body)[0])
            finally:
                stop(proc)
    llvm_s, first_s, running_s = map(statistics.median, (llvm, first, running))
    return {"locations": float(sum(len(v) for *_x, v in mappings)),
            "llvm_symbolizer_s": llvm_s, "first_after_start_s": first_s,
            "cold_on_a_running_server_s": running_s, "ratio_vs_llvm": running_s / llvm_s,
            "first_over_running": first_s / running_s}


def many_programs(work: Path, serve_tree: Serve, post: Post, stop: Stop, count: int = 60
                  ) -> dict[str, float]:
    """`count` small programs in one profile, 370 addresses each: a site's own binaries."""
    rng = random.Random(60)
    (work / "many").mkdir()
    mappings = [(exe, debug, bid, text_addresses(exe, 370, rng))
                for exe, debug, bid in build_programs(work / "many", count)]
    tree = work / "many-tree"
    for exe, debug, bid, _v in mappings:
        d = tree / ".build-id" / bid[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / (bid[2:] + ".debug")).symlink_to(debug)
        (d / bid[2:]).symlink_to(exe)
    body = placed_profile([(exe, bid, v) for exe, _d, bid, v in mappings],
                          relative=False).SerializeToString()
    pairs = [(debug, v) for _e, debug, _b, vs in mappings for v in vs]
    llvm, cold_runs, warm_runs = [], [], []
    for _round in range(ROUNDS):  # medians of interleaved rounds, as cold()
        llvm.append(llvm_frames(pairs)[0])
        proc, url = serve_tree(tree, 8.0)
        try:
            cold_runs.append(post(url, body)[0])
            warm_runs += [post(url, body)[0] for _ in range(7)]
        finally:
            stop(proc)
    llvm_s, cold_s, warm_s = map(statistics.median, (llvm, cold_runs, warm_runs))
    return {"mappings": float(count), "locations": float(370 * count),
            "llvm_symbolizer_s": llvm_s, "cold_s": cold_s, "warm_s": warm_s,
            "cold_over_llvm": cold_s / llvm_s, "llvm_over_warm": llvm_s / warm_s}


def main() -> None:
    # symbolize_bench.py imports this module: its helpers are taken when run on its own.
    from bench.symbolize_bench import LIBC, LIBC_ID, post, serve_tree, stop

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("names", "memory", "cold", "many"),
                    help="measure this target alone (default: all, as symbolize_bench.py)")
    ap.add_argument("--memory-locations", type=int, default=1_000_000)
    args = ap.parse_args()
    if args.only is None:
        main_targets(LIBC, LIBC_ID, serve_tree, post, stop)
        return
    with tempfile.TemporaryDirectory(prefix="symgate-targets-") as tmp:
        work = Path(tmp)
        if args.only == "memory":
            print("memory:", json.dumps(peak_memory(LIBC, LIBC_ID, work, args.memory_locations)))
            return
        if args.only == "many":
            print("many programs:", json.dumps(many_programs(work, serve_tree, post, stop)))
            return
        programs = build_programs(work, 27)
        if args.only == "names":
            print("exactness:", json.dumps(exactness(programs, LIBC, LIBC_ID, work), indent=1))
        else:
            print("cold:", json.dumps(cold(programs, LIBC, LIBC_ID, work, serve_tree, post,
                                           stop)))


if __name__ == "__main__":
    main()
