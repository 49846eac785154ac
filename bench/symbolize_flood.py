"""What a flood of /symbolize does to /buildid hits and to memory, on one fresh server.

  python bench/symbolize_flood.py [--mappings 100000] [--posts 6] [--bombs 8]

1. Then six (--posts) parallel POSTs of a profile with 100,000 mappings (--mappings) of libc, one
   location each (about 7 MB), while a probe asks for a cached 4 MB debuginfo every 50 ms:
   the probe's latency percentiles, and how each POST ended.
0. First, on the fresh server, eight (--bombs) parallel POSTs of a 1 MB gzip bomb that
   inflates to 1 GiB: their statuses, and the peak RSS (VmHWM) of the server and of each of
   its helper processes.

Needs libc6-dbg. symgate is run as `symgate serve` (PYTHONPATH picks the code measured), with
the work bounds raised so that the flood is worked on, not refused. Bounded in count and time;
loopback only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.symbolize_bench import (  # noqa: E402
    LIBC,
    LIBC_DEBUG,
    LIBC_ID,
    free_port,
    wait_healthy,
)
from symbolize.elf import layout_of_file  # noqa: E402
from symbolize.pprof.profile_pb2 import Location, Mapping, Profile, Sample  # noqa: E402

PAGE = 0x1000


def flood_profile(mappings: int) -> bytes:
    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID, "samples", "count"])
    p.sample_type.add(type=3, unit=4)
    span = (text.vaddr + text.memsz + PAGE) & ~(PAGE - 1)
    for i in range(1, mappings + 1):
        base = 0x7F0000000000 + i * (span + PAGE)
        p.mapping.append(Mapping(id=i, memory_start=base + (text.vaddr & ~(PAGE - 1)),
                                 memory_limit=base + span, file_offset=text.offset & ~(PAGE - 1),
                                 filename=1, build_id=2))
        p.location.append(Location(id=i, mapping_id=i, address=base + text.vaddr + 16 * i
                                   % text.filesz))
        p.sample.append(Sample(location_id=[i], value=[i]))
    return p.SerializeToString()


def gzip_bomb(inflated: int) -> bytes:
    chunk = 1 << 20
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = packer.compress(bytes(chunk)) + packer.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated // chunk):
        crc = zlib.crc32(bytes(chunk), crc)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + block * (inflated // chunk)
            + b"\x03\x00" + crc.to_bytes(4, "little") + (inflated % 2**32).to_bytes(4, "little"))


def post(url: str, body: bytes, timeout: float) -> tuple[int, float]:
    req = urllib.request.Request(url + "/symbolize", data=body, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = 0  # timed out or cut
    return status, time.perf_counter() - started


def probe(url: str, stop: threading.Event, out: list[float], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < deadline and len(out) < 20_000:
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                r.read()
            out.append(time.perf_counter() - started)
        except OSError:
            out.append(float("inf"))
        time.sleep(0.05)


def tree(root: int) -> list[int]:
    parents = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(e)] = int(Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1]
                                      .split()[1])
    found, frontier = [root], {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        found += sorted(frontier)
    return found


def hwm(pid: int) -> tuple[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:60].decode()
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    return name, kib * 1024


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mappings", type=int, default=100_000)
    ap.add_argument("--posts", type=int, default=6)
    ap.add_argument("--bombs", type=int, default=8)
    ap.add_argument("--post-timeout", type=float, default=300.0)
    ap.add_argument("--no-bounds", action="store_true",
                    help="for versions without the max_profile_* keys")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="symgate-flood-") as tmp:
        work = Path(tmp)
        debug = work / "debug" / ".build-id" / LIBC_ID[:2]
        debug.mkdir(parents=True)
        (debug / (LIBC_ID[2:] + ".debug")).symlink_to(LIBC_DEBUG)
        port = free_port()
        bounds = "".join(f"max_profile_{k} = {10 * args.mappings}\n"
                         for k in ("mappings", "locations", "functions", "samples")
                         if not args.no_bounds)
        (work / "symgate.toml").write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{work / "data"}"\n'
            f'access_log = false\n[symbolize]\ndebug_dirs = ["{work / "debug"}"]\n'
            f'deadline_s = 600\n' + bounds
            + f'[[upstreams]]\npath = "{work / "debug"}"\n')
        proc = subprocess.Popen(["symgate", "serve", "--config", str(work / "symgate.toml")],
                                stdout=(work / "log").open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url)
            hit = f"{url}/buildid/{LIBC_ID}/debuginfo"
            urllib.request.urlopen(hit, timeout=60).read()
            bomb = gzip_bomb(1 << 30)
            with concurrent.futures.ThreadPoolExecutor(max(1, args.bombs)) as pool:
                bombs = list(pool.map(lambda _i: post(url, bomb, args.post_timeout),
                                      range(args.bombs)))
            print(f"{args.bombs} gzip bombs of {len(bomb)} bytes (1 GiB inflated): "
                  + ", ".join(f"{s} in {t:.1f}s" for s, t in bombs))
            for pid in tree(proc.pid):
                name, peak = hwm(pid)
                print(f"  VmHWM {peak / 2**20:7.1f} MiB  pid {pid}  {name}")
            body = flood_profile(args.mappings)
            # Warm: the table built, as on a server that has seen libc before.
            print(f"warm-up POST ({len(body)} bytes):", post(url, body, args.post_timeout))
            latencies: list[float] = []
            stop = threading.Event()
            prober = threading.Thread(target=probe, args=(hit, stop, latencies,
                                                          args.post_timeout + 60))
            prober.start()
            with concurrent.futures.ThreadPoolExecutor(args.posts) as pool:
                posts = list(pool.map(lambda _i: post(url, body, args.post_timeout),
                                      range(args.posts)))
            stop.set()
            prober.join()
            print(f"{args.posts} POSTs of {args.mappings} mappings: "
                  + ", ".join(f"{s} in {t:.1f}s" for s, t in posts))
            failed = sum(1 for t in latencies if t == float("inf"))
            print(f"hit probe during them: n={len(latencies)} failed or >60 s={failed} "
                  f"p50={1000 * statistics.median(latencies):.1f} ms "
                  f"p99={1000 * pct(latencies, 0.99):.1f} ms max={1000 * max(latencies):.1f} ms")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
