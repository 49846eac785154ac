"""Symbolization benchmark: symgate warm and cold against llvm-symbolizer, in one run.

  python bench/symbolize_bench.py [--sizes 1000,100000] [--repeat 3]

The same N addresses inside the system libc's code (Debian's libc6-dbg debug file) are
symbolized, with inline frames, by:
  * llvm-symbolizer --obj=DEBUG --inlining, one batch on stdin (its cold run: it parses DWARF);
  * symgate cold: a fresh server whose symbol table for libc is not built yet;
  * symgate warm: the same server again, the table built (a second, identical request);
  * symgate warm, gzipped: the same profile gzipped, as profilers send them (and answered
    gzipped).
symgate runs as `symgate serve` and is sent a pprof profile with one location per address, at
the runtime addresses of a real process's libc mapping. Prints times, per-address costs and
ratios of the medians over --repeat fresh servers; writes bench/results/symbolize.json.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.symbolize_targets import main_targets  # noqa: E402
from symbolize.elf import layout_of_file  # noqa: E402
from symbolize.pprof.profile_pb2 import Profile  # noqa: E402

LIBC_ID = "93ac61ec5a8eb1396f9fbd350e3169a558528a40"
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
BASE = 0x7F0000000000  # where the loader put libc (any page-aligned address)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def addresses(n: int) -> list[int]:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    rng = random.Random(n)
    return rng.sample(range(text.vaddr, text.vaddr + text.filesz), n)


def profile_for(vaddrs: list[int]) -> bytes:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID, "cpu", "nanoseconds"])
    p.sample_type.add(type=3, unit=4)
    p.mapping.add(id=1, memory_start=BASE + text.vaddr, memory_limit=BASE + text.vaddr
                  + text.memsz, file_offset=text.offset, filename=1, build_id=2)
    for i, v in enumerate(vaddrs, start=1):
        p.location.add(id=i, mapping_id=1, address=BASE + v)
        p.sample.add(location_id=[i], value=[1])
    return p.SerializeToString()


def llvm(vaddrs: list[int]) -> float:
    started = time.perf_counter()
    out = subprocess.run(["llvm-symbolizer", f"--obj={LIBC_DEBUG}", "--inlining"],
                         input="\n".join(hex(v) for v in vaddrs), capture_output=True,
                         text=True, check=True).stdout
    elapsed = time.perf_counter() - started
    assert out.count("\n\n") >= len(vaddrs) - 1
    return elapsed


def post(url: str, body: bytes) -> tuple[float, dict[str, str], bytes]:
    req = urllib.request.Request(url + "/symbolize", data=body, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = r.read()
            headers = dict(r.headers)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"symgate answered {e.code}: {e.read().decode()}") from e
    return time.perf_counter() - started, headers, answer


def wait_healthy(url: str) -> None:
    """Until `url`/healthz answers (30 s at most)."""
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)


def serve_tree(tree: Path, settle_s: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
    """A fresh `symgate serve` over the debug tree `tree`, once /healthz answers (and
    `settle_s` later)."""
    work = Path(tempfile.mkdtemp(prefix="symgate-symbench-"))
    port = free_port()
    # No upstream: llvm-symbolizer reads the same local files and asks nobody, and a dead
    # one would charge a debug file missing from the tree (libstdc++'s) the retries' backoff.
    (work / "symgate.toml").write_text(
        f'upstreams = []\n[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{work / "data"}"\n'
        f'access_log = false\n[symbolize]\ndebug_dirs = ["{tree}"]\n'
        f'max_request_bytes = "512MiB"\nmax_decompressed_bytes = "1GiB"\ndeadline_s = 600\n')
    proc = subprocess.Popen(["symgate", "serve", "--config", str(work / "symgate.toml")],
                            stdout=(work / "log").open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "DEBUGINFOD_URLS": "http://127.0.0.1:9/"})
    proc.work = work  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    time.sleep(settle_s)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    shutil.rmtree(proc.work, ignore_errors=True)  # type: ignore[attr-defined]


def serve(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    tree = work / "debug" / ".build-id" / LIBC_ID[:2]
    tree.mkdir(parents=True)
    (tree / (LIBC_ID[2:] + ".debug")).symlink_to(LIBC_DEBUG)
    (tree / LIBC_ID[2:]).symlink_to(LIBC)
    # The build workers started, as a long-running server has them.
    return serve_tree(work / "debug", settle_s=1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,100000")
    ap.add_argument("--targets", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure issue 14's targets (symbolize_targets.py)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="fresh servers (and llvm-symbolizer runs) per size; medians reported")
    args = ap.parse_args()
    if not LIBC_DEBUG.exists() or not shutil.which("llvm-symbolizer"):
        sys.exit("needs Debian's libc6-dbg and llvm (llvm-symbolizer)")
    results: dict[str, dict[str, float]] = {}
    for n in (int(x) for x in args.sizes.split(",")):
        vaddrs = addresses(n)
        body = profile_for(vaddrs)
        gzipped = gzip.compress(body, mtime=0)
        runs: dict[str, list[float]] = {"llvm": [], "cold": [], "warm": [], "warm_gzip": []}
        symbolized = 0
        for _ in range(args.repeat):
            work = Path(tempfile.mkdtemp(prefix="symgate-symbench-"))
            proc, url = serve(work)
            try:
                # Interleaved, so that a noisy moment on the machine hits both sides alike.
                runs["llvm"].append(llvm(vaddrs))
                cold_s, cold_h, cold_body = post(url, body)
                warm = [post(url, body) for _ in range(3)]
                warm_gzip = [post(url, gzipped) for _ in range(3)]
            finally:
                stop(proc)
                shutil.rmtree(work, ignore_errors=True)
            assert cold_h["X-Symgate-Mappings-Symbolized"] == "1", cold_h
            assert all(w[2] == cold_body for w in warm), "warm and cold answers differ"
            assert all(gzip.decompress(w[2]) == cold_body for w in warm_gzip), \
                "gzipped and raw answers differ"
            runs["cold"].append(cold_s)
            runs["warm"].append(min(w[0] for w in warm))
            runs["warm_gzip"].append(min(w[0] for w in warm_gzip))
            symbolized = int(cold_h["X-Symgate-Locations-Symbolized"])
        llvm_s, cold_s, warm_s, warm_gzip_s = (
            statistics.median(runs[k]) for k in ("llvm", "cold", "warm", "warm_gzip"))
        results[str(n)] = {
            "llvm_symbolizer_s": llvm_s, "symgate_cold_s": cold_s, "symgate_warm_s": warm_s,
            "symgate_warm_gzip_s": warm_gzip_s,
            "llvm_us_per_address": llvm_s / n * 1e6, "warm_us_per_address": warm_s / n * 1e6,
            "warm_speedup_vs_llvm": llvm_s / warm_s, "cold_speedup_vs_llvm": llvm_s / cold_s,
            "warm_gzip_speedup_vs_llvm": llvm_s / warm_gzip_s,
            "locations_symbolized": float(symbolized),
        }
        print(f"N = {n}: " + ", ".join(f"{k} " + " ".join(f"{v:.4f}" for v in vs)
                                      for k, vs in runs.items()), flush=True)
    for n, r in results.items():
        print(f"N = {n} (medians of {args.repeat})")
        for k, v in r.items():
            print(f"  {k:<24} {v:10.4f}")
    # Linear in N: the warm cost per address at each N over that at the N before.
    sizes = sorted(int(n) for n in results)
    for small, large in itertools.pairwise(sizes):
        growth = (results[str(large)]["symgate_warm_s"] / large) \
            / (results[str(small)]["symgate_warm_s"] / small)
        results[str(large)]["warm_per_address_vs_previous_n"] = growth
        print(f"warm per address, N {small} -> {large}: x{growth:.2f}")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    report: dict[str, object] = {"sizes": results}
    if args.targets:
        report["targets"] = main_targets(LIBC, LIBC_ID, serve_tree, post, stop)
    (out / "symbolize.json").write_text(json.dumps(report, indent=2))

if __name__ == "__main__":
    main()
