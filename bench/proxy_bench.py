"""Serving benchmark of issue 12: symgate beside nginx and a federating elfutils debuginfod,
in one run, on loopback.

  python bench/proxy_bench.py [--quick] [--seconds 4] [--rounds 3] [--cold-rounds 5]
                              [--big-mb 100] [--ports 19000-19499] [--keep]

One elfutils debuginfod indexes the files: the upstream. In front of it run symgate (this
checkout: `python -m proxy.tools.cli serve` with PYTHONPATH = this tree, its default config, so
the access log is on) and a federating elfutils debuginfod (no files of its own,
DEBUGINFOD_URLS = the upstream, its own fresh cache). symgate runs with 1 serving worker and
with N = os.cpu_count() when `symgate serve --workers` exists; without it, one symgate as it is
and n/a for N. Beside them nginx with 1 and with N workers serves the same files at the same
paths (sendfile).

Measured:
  * wrk -t2 -c16 on a 17 KiB debug file hit, the 4.2 MB libc debug file hit and a remembered
    404; ab -k -i -c16 for HEAD on the libc hit (wrk would wait for the body a HEAD answer
    announces). Medians of --rounds rounds, each running every server in turn, the order
    rotated from round to round so that a noisy moment does not land on one server only;
  * a cold fetch of the libc file, time to the first body byte and to the last, from symgate
    and the federating debuginfod started afresh on new data dirs for every round (and warmed
    up with misses for other keys, so that a process's first-request costs are not counted),
    and from the upstream itself: medians of --cold-rounds;
  * 50 concurrent cold requests for the libc file, and 5 repeated misses, on fresh servers:
    the requests the upstream received, read from its own /metrics (symgate may run several
    processes, each with its own counters);
  * a --big-mb artifact fetched cold by 20 clients at once: first and last byte, symgate's
    peak memory (its process tree's Pss, sampled) and idle memory; warm and direct fetches.
Prints the figures and the issue's targets as ratios with PASS/FAIL; writes
bench/results/proxy.json. Exits 0 when it measured, whatever the verdicts; 1 when it could not
run, 130 when interrupted. Every process it started is killed at exit, the temp dir removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from procs import (  # noqa: E402
    Ports,
    Procs,
    become_subreaper,
    descendants,
    hwm_kib,
    listening_sockets,
    loopback_only_environ,
    rss_kib,
    stop_on_signals,
    tree_cpu_s,
    tree_pss_kib,
)

from tests.elfs import Elf, build_program  # noqa: E402

LIBC_ID = "93ac61ec5a8eb1396f9fbd350e3169a558528a40"
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")
SMALL_BYTES = 17 * 1024
MISS_ID = "00aabbccddeeff00"  # the remembered 404
COLD_MISS_ID = "00112233445566778899"  # the repeated misses on fresh servers
COLD_CLIENTS = 50
REPEATED_MISSES = 5
BIG_CLIENTS = 20
MiB = 1024 * 1024


class BenchError(Exception):
    """A server answered wrongly or not at all: its figure is not a figure."""


# ------------------------------------------------------------------------------------------
# HTTP clients


def status_of(url: str, method: str = "GET") -> tuple[int, int]:
    """(status, body length) of one request."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, len(r.read())
    except urllib.error.HTTPError as e:
        return e.code, len(e.read())


def expect(url: str, status: int, size: int | None = None, method: str = "GET") -> None:
    got, n = status_of(url, method)
    if got != status or (size is not None and n != size):
        raise BenchError(f"{method} {url}: {got}, {n} bytes (expected {status}"
                         + (f", {size} bytes)" if size is not None else ")"))


def wait_answering(url: str, proc: subprocess.Popen[bytes], log: Path,
                   timeout: float = 120, any_status: bool = False) -> None:
    """Until `url` answers 200 (any status with `any_status`); a server that exits or never
    answers is an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise BenchError(f"{proc.args!r} exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_status:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise BenchError(f"{url} did not answer 200 in {timeout:.0f} s")


def _count(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else 0


def wrk(url: str, seconds: int, want_404: bool = False) -> float:
    run = subprocess.run(["wrk", "-t2", "-c16", f"-d{seconds}s", url], capture_output=True,
                         text=True)
    out = run.stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if run.returncode or not m:
        raise BenchError(f"wrk on {url} failed ({run.returncode}): "
                         f"{(run.stderr or out).strip()[-300:]}")
    requests = _count(r"(\d+) requests in", out)
    non2xx = _count(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       out)
    if errors and any(int(x) for x in errors.groups()):
        raise BenchError(f"wrk saw socket errors on {url}: {errors.group(0)}")
    if non2xx != (requests if want_404 else 0):
        raise BenchError(f"wrk on {url}: {non2xx} of {requests} answers were not "
                         + ("404s" if want_404 else "2xx"))
    return float(m.group(1))


def ab_head(url: str, seconds: int) -> float:
    out = subprocess.run(["ab", "-q", "-k", "-i", "-c16", f"-t{seconds}", "-n10000000", url],
                         capture_output=True, text=True)
    m = re.search(r"Requests per second:\s+([\d.]+)", out.stdout)
    if out.returncode or not m:
        raise BenchError(f"ab on {url} failed ({out.returncode}): {out.stderr.strip()[-300:]}")
    bad = (_count(r"Failed requests:\s+(\d+)", out.stdout)
           + _count(r"Non-2xx responses:\s+(\d+)", out.stdout))
    if bad:
        raise BenchError(f"ab on {url}: {bad} failed or non-2xx answers")
    return float(m.group(1))


async def _timed_get(session: aiohttp.ClientSession, url: str, size: int,
                     body: bytearray | None = None) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the last); the bytes into `body`."""
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    async with session.get(url) as r:
        if r.status != 200:
            raise BenchError(f"GET {url}: {r.status}")
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
            if body is not None:
                body += chunk
    total = time.perf_counter() - t0
    if n != size or first is None:
        raise BenchError(f"GET {url}: {n} bytes, expected {size}")
    return first, total


def timed_gets(url: str, size: int, clients: int) -> list[tuple[float, float]]:
    """`clients` concurrent GETs, each on its own new connection."""
    async def run() -> list[tuple[float, float]]:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=120)) as s:
            return list(await asyncio.gather(*(_timed_get(s, url, size)
                                               for _ in range(clients))))
    try:
        return asyncio.run(run())
    except (TimeoutError, aiohttp.ClientError) as e:
        raise BenchError(f"GET {url}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------------
# The files and the servers


def pad_to(debug: Path, size: int) -> None:
    """Grows a debug file to `size` bytes with one extra section (build ID unchanged): a
    first try tells objcopy's overhead for a section, the second lands on the size."""
    original = debug.read_bytes()
    pad = debug.with_suffix(".pad")
    overhead = 0
    for _ in range(2):
        debug.write_bytes(original)
        pad.write_bytes(b"\xa5" * max(0, size - len(original) - overhead))
        subprocess.run(["objcopy", "--add-section", f".symgate_pad={pad}", str(debug)],
                       check=True, capture_output=True)
        overhead = debug.stat().st_size - len(original) - pad.stat().st_size
    pad.unlink()


@dataclass
class Files:
    small: Elf
    small_bytes: int
    libc_bytes: int
    big: Elf
    big_bytes: int


def build_files(work: Path, big_mb: int) -> tuple[Path, Files]:
    files = work / "files"
    files.mkdir()
    small = build_program(work / "src", files, "small", 21)
    pad_to(small.debug, SMALL_BYTES)
    big = build_program(work / "src", files, "big", 22, pad_bytes=big_mb * MiB)
    shutil.copy(LIBC_DEBUG, files / "libc.debug")
    return files, Files(small, small.debug.stat().st_size, LIBC_DEBUG.stat().st_size, big,
                        big.debug.stat().st_size)


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class World:
    work: Path
    procs: Procs
    ports: Ports
    n: int
    workers_flag: bool
    upstream: str = ""
    started: int = 0

    def fresh(self, what: str) -> Path:
        self.started += 1
        return self.work / f"{what}-{self.started}"

    def stop(self, server: Server) -> None:
        if server.proc is not None:
            self.procs.stop(server.proc)

    def symgate(self, workers: int | None) -> Server:
        """A symgate with a new data dir; `workers` None: started as symgate is today."""
        port = self.ports.take()
        data = self.fresh("symgate")
        cfg = data.with_suffix(".toml")
        cfg.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
data_dir = "{data}"
# The default, said out loud: what an operator runs is what is measured.
access_log = true
# Stopping a server between cold rounds need not wait for anything.
shutdown_grace_s = 2.0

[[upstreams]]
url = "{self.upstream}"
""")
        cmd = [sys.executable, "-m", "proxy.tools.cli", "serve", "--config", str(cfg)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        log = data.with_suffix(".log")
        proc = self.procs.start(cmd, log, cwd=ROOT, env={
            **os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        wait_answering(url + "/healthz", proc, log)
        # /healthz answers as soon as one worker serves; the others may still be starting,
        # and a measure begun then would see fewer processes than it names.
        deadline = time.monotonic() + 60
        while (ready := listening_sockets(port)) < (workers or 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"  warning: {ready} of {workers} symgate workers listening on {port}",
                      flush=True)
                break
            time.sleep(0.05)
        return Server(f"symgate {workers or 1}w", url, proc, log)

    def federating(self) -> Server:
        """A federating debuginfod with a new database and cache."""
        port = self.ports.take()
        data = self.fresh("federating")
        data.mkdir()
        log = data / "log"
        proc = self.procs.start(
            ["debuginfod", "-p", str(port), "-d", str(data / "db.sqlite"), "-t", "0", "-g", "0"],
            log, env={**os.environ, "DEBUGINFOD_URLS": self.upstream,
                      "DEBUGINFOD_CACHE_PATH": str(data / "cache")})
        url = f"http://127.0.0.1:{port}"
        wait_answering(url + "/metrics", proc, log)
        return Server("federating", url, proc, log)

    def upstream_server(self, files: Path, ids: list[str]) -> Server:
        port = self.ports.take()
        log = self.work / "upstream.log"
        proc = self.procs.start(["debuginfod", "-p", str(port), "-d",
                                 str(self.work / "upstream.sqlite"), "-F", str(files), "-t",
                                 "0", "-g", "0"], log)
        self.upstream = f"http://127.0.0.1:{port}"
        for build_id in ids:  # answers once it has indexed them
            wait_answering(f"{self.upstream}/buildid/{build_id}/debuginfo", proc, log)
        return Server("upstream", self.upstream, proc, log)

    def nginx(self, workers: int, docs: Path) -> Server:
        port = self.ports.take()
        conf = self.fresh("nginx")
        user = "user root; " if os.geteuid() == 0 else ""
        conf.with_suffix(".conf").write_text(f"""
{user}worker_processes {workers}; daemon off; pid {conf}.pid; error_log {conf}.err;
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; tcp_nopush on;
  server {{ listen 127.0.0.1:{port}; root {docs};
    location / {{ default_type application/octet-stream; }} }} }}
""")
        log = conf.with_suffix(".log")
        proc = self.procs.start(["nginx", "-c", str(conf.with_suffix(".conf"))], log)
        url = f"http://127.0.0.1:{port}"
        wait_answering(url + "/", proc, log, any_status=True)
        return Server(f"nginx {workers}w", url, proc, log)

    def upstream_requests(self) -> float:
        """debuginfo requests the upstream has received, by its own count."""
        with urllib.request.urlopen(self.upstream + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r'^http_requests_total\{type="debuginfo"\} ([\d.e+]+)$', text, re.M)
        return float(m.group(1)) if m else 0.0


def workers_flag_exists() -> bool:
    out = subprocess.run([sys.executable, "-m", "proxy.tools.cli", "serve", "--help"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return "--workers" in out.stdout


# ------------------------------------------------------------------------------------------
# Measures


def median(values: list[float | None]) -> float | None:
    """None when any round failed: a median over the rounds that worked would flatter."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


@dataclass
class Rate:
    name: str
    path: str
    servers: list[str]
    run: Callable[[str, int], float]
    runs: dict[str, list[float | None]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    # With `timed`: CPU seconds a request, (the server's whole tree, the load generator's).
    timed: bool = False
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def rates(servers: dict[str, Server], files: Files, args: argparse.Namespace,
          sym: list[str], memory_out: dict[str, Any]) -> dict[str, Rate]:
    small = f"/buildid/{files.small.build_id}/debuginfo"
    libc = f"/buildid/{LIBC_ID}/debuginfo"
    miss = f"/buildid/{MISS_ID}/debuginfo"
    every = list(servers)
    nginxes = [s for s in every if s.startswith("nginx")]
    measures = {
        # Where a small hit's CPU goes: what N workers can do at all beside wrk on these cores.
        "hit_17k": Rate("hit, 17 KiB", small, every, lambda u, s: wrk(u, s), timed=True),
        "hit_4m": Rate("hit, 4.2 MB libc", libc, every, lambda u, s: wrk(u, s)),
        "head": Rate("HEAD on a hit", libc, [*sym, "federating", *nginxes], ab_head),
        "miss_404": Rate("remembered 404", miss, [*sym, "federating"],
                         lambda u, s: wrk(u, s, want_404=True)),
    }
    # Every cache warm, every miss remembered, then a pause for what a first fetch sets off
    # in the background (symgate builds the symbol table of a debug file it has fetched).
    for name, srv in servers.items():
        try:
            expect(srv.url + small, 200, files.small_bytes)
            expect(srv.url + libc, 200, files.libc_bytes)
            if name in measures["miss_404"].servers:
                expect(srv.url + miss, 404)
            status, _ = status_of(srv.url + libc, "HEAD")
        except (BenchError, OSError) as e:  # the others are still worth measuring
            for m in measures.values():
                if name in m.servers:
                    m.servers.remove(name)
                    m.notes[name] = f"error: warm-up: {e}"[:300]
            continue
        if status != 200 and name in measures["head"].servers:
            measures["head"].servers.remove(name)
            measures["head"].notes[name] = f"n/a (answers {status})"
    memory_out["idle_after_warmup"] = memory(idle_servers(servers))

    for r in range(args.rounds):
        for key, m in measures.items():
            order = m.servers[r % len(m.servers):] + m.servers[:r % len(m.servers)]
            for name in order:
                url = servers[name].url + m.path
                value: float | None
                try:
                    if key == "miss_404":
                        expect(url, 404)  # still remembered: its TTL may have run out
                    proc = servers[name].proc
                    before = (tree_cpu_s(proc.pid) if proc else 0.0, _children_cpu_s())
                    value = m.run(url, args.seconds)
                    if m.timed and proc is not None and value:
                        served = value * args.seconds
                        m.cpu.setdefault(name, []).append(
                            ((tree_cpu_s(proc.pid) - before[0]) / served,
                             (_children_cpu_s() - before[1]) / served))
                except (BenchError, OSError) as e:
                    value = None
                    m.notes[name] = f"error: {e}"[:300]
                m.runs.setdefault(name, []).append(value)
                print(f"  round {r + 1}/{args.rounds}  {m.name:<18} {name:<12} "
                      + (f"{value:>10,.0f} req/s" if value is not None else "error"),
                      flush=True)
    return measures


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children: the load generators run to their end."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def cpu_bound(cpu: dict[str, list[tuple[float, float]]], name: str, cores: int
              ) -> tuple[float, float, float] | None:
    """(server, load generator) CPU seconds a request, medians, and the rate `cores` allow
    with both on them: neither N workers nor nginx's go past it."""
    runs = cpu.get(name)
    if not runs:
        return None
    server = statistics.median(r[0] for r in runs)
    client = statistics.median(r[1] for r in runs)
    return server, client, cores / (server + client) if server + client > 0 else 0.0


def idle_servers(servers: dict[str, Server]) -> dict[str, Server]:
    """`servers` once idle as symgate defines it: its symbol workers (warm-up's fetches set off
    table builds) exited after their idle time, and a heap trim run since (every
    proxy.web.heap.TRIM_EVERY_S). What an operator sees between bursts."""
    from proxy.config import SymbolizeConfig
    from proxy.web.heap import TRIM_EVERY_S

    t0 = time.monotonic()
    deadline = t0 + SymbolizeConfig().worker_idle_s + 30
    trees = [s.proc.pid for n, s in servers.items() if n.startswith("symgate") and s.proc]
    while time.monotonic() < deadline and any(
            comm(p) == "symgate-worker" for t in trees for p in descendants(t)):
        time.sleep(1)
    time.sleep(TRIM_EVERY_S + 1)
    print(f"  idle after {time.monotonic() - t0:.0f} s (workers exited, heap trimmed)",
          flush=True)
    return servers


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def memory(servers: dict[str, Server]) -> dict[str, float]:
    """MiB: symgate's whole process tree by Pss (workers included), the others' RSS."""
    out: dict[str, float] = {}
    for name, srv in servers.items():
        if srv.proc is not None and not name.startswith("nginx"):
            pid = srv.proc.pid
            out[name] = (tree_pss_kib(pid) if name.startswith("symgate") else rss_kib(pid)) / 1024
    return out


def cold(world: World, files: Files, default_workers: int | None, rounds: int
         ) -> dict[str, list[tuple[float, float] | None]]:
    """A cold libc fetch on fresh servers, round after round, the order rotated."""
    libc = f"/buildid/{LIBC_ID}/debuginfo"
    out: dict[str, list[tuple[float, float] | None]] = {
        "symgate": [], "federating": [], "upstream": []}

    def one(which: str) -> tuple[float, float]:
        if which == "upstream":
            return timed_gets(world.upstream + libc, files.libc_bytes, 1)[0]
        srv = world.symgate(default_workers) if which == "symgate" else world.federating()
        try:
            # A cold fetch on a running server, not the first request of a process: misses
            # on many connections reach every serving process (SO_REUSEPORT spreads them),
            # each then has its upstream client and database connection; then a pause.
            warm_up(srv.url, 4 * world.n)
            time.sleep(1)
            return timed_gets(srv.url + libc, files.libc_bytes, 1)[0]
        finally:
            world.stop(srv)

    for r in range(rounds):
        order = list(out)[r % 3:] + list(out)[:r % 3]
        for which in order:
            try:
                got: tuple[float, float] | None = one(which)
            except (BenchError, OSError) as e:
                print(f"  cold round {r + 1}: {which}: {e}", flush=True)
                got = None
            out[which].append(got)
            print(f"  cold round {r + 1}/{rounds}  {which:<11} " + (
                f"first byte {got[0] * 1000:7.1f} ms  total {got[1] * 1000:7.1f} ms"
                if got else "error"), flush=True)
    return out


def warm_up(url: str, connections: int) -> None:
    """One miss for a distinct unknown build ID on each of `connections` new connections."""
    async def run() -> None:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def miss(i: int) -> None:
                async with s.get(f"{url}/buildid/{0xFEED0000 + i:08x}/debuginfo") as r:
                    if r.status != 404:
                        raise BenchError(f"warm-up miss on {url}: {r.status}")
            await asyncio.gather(*(miss(i) for i in range(connections)))
    try:
        asyncio.run(run())
    except (TimeoutError, aiohttp.ClientError) as e:
        raise BenchError(f"warm-up of {url}: {type(e).__name__}: {e}") from e


def burst(world: World, srv: Server, files: Files) -> dict[str, Any]:
    """50 concurrent cold requests for one key, and 5 repeated misses, counted upstream."""
    libc = f"/buildid/{LIBC_ID}/debuginfo"
    before = world.upstream_requests()
    got = timed_gets(srv.url + libc, files.libc_bytes, COLD_CLIENTS)
    time.sleep(0.5)  # a duplicate fetch still under way has reached the upstream by now
    after = world.upstream_requests()
    for _ in range(REPEATED_MISSES):
        expect(f"{srv.url}/buildid/{COLD_MISS_ID}/debuginfo", 404)
    misses = world.upstream_requests() - after
    return {"cold_50_upstream_requests": after - before,
            "cold_50_first_byte_s_max": max(f for f, _ in got),
            "cold_50_total_s_max": max(t for _, t in got),
            "repeated_5_misses_upstream_requests": misses}


def big(world: World, srv: Server, files: Files) -> dict[str, Any]:
    """The big artifact cold to 20 clients at once, symgate's tree Pss sampled meanwhile."""
    assert srv.proc is not None
    url = f"{srv.url}/buildid/{files.big.build_id}/debuginfo"
    peak = [tree_pss_kib(srv.proc.pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(tree_pss_kib(srv.proc.pid))  # type: ignore[union-attr]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        got = timed_gets(url, files.big_bytes, BIG_CLIENTS)
    finally:
        done.set()
        sampler.join()
    warm = [timed_gets(url, files.big_bytes, 1)[0][1] for _ in range(3)]
    direct = [timed_gets(f"{world.upstream}/buildid/{files.big.build_id}/debuginfo",
                         files.big_bytes, 1)[0][1] for _ in range(3)]
    return {"big_bytes": files.big_bytes,
            "big_cold_20_clients_first_byte_s_max": max(f for f, _ in got),
            "big_cold_20_clients_total_s_max": max(t for _, t in got),
            "big_cold_20_clients_tree_pss_peak_mib": max(peak) / 1024,
            "big_cold_main_process_vmhwm_mib": hwm_kib(srv.proc.pid) / 1024,
            "big_warm_1_client_total_s_min": min(warm),
            "big_upstream_direct_total_s_min": min(direct)}


# ------------------------------------------------------------------------------------------
# The report


@dataclass
class Target:
    what: str
    figures: str  # what the value is made of
    value: float | None  # a ratio (unit "x") or a figure
    bound: float
    at_least: bool
    unit: str = "x"
    applies: bool = True  # False: not measurable in this run (n/a), else no value is an error

    @property
    def goal(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.show(self.bound)}"

    def show(self, v: float | None) -> str:
        if v is None:
            return "n/a"
        return f"{v:.2f}x" if self.unit == "x" else f"{v:,.{1 if v < 100 else 0}f}{self.unit}"

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "ERROR" if self.applies else "n/a"
        return "PASS" if (self.value >= self.bound if self.at_least
                          else self.value <= self.bound) else "FAIL"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def targets(med: dict[str, dict[str, float | None]],
            cold_med: dict[str, tuple[float, float] | None], counts: dict[str, Any],
            idle: list[float], sg: str, sg_n: str | None, n: int,
            cpu: dict[str, list[tuple[float, float]]]) -> list[Target]:
    """The issue's targets, then two more: single flight at least as good as the federating
    debuginfod's (REFERENCE.md), and the issue's idle memory bound."""
    def rate(m: str, s: str | None) -> float | None:
        return med[m].get(s) if s else None

    def versus(m: str, a: str | None, b: str | None, bound: float, what: str) -> Target:
        return Target(what, f"{fmt(rate(m, a))} vs {fmt(rate(m, b))} req/s",
                      ratio(rate(m, a), rate(m, b)), bound, True, applies=a is not None)

    def upstream_gets(name: str) -> float | None:
        c = counts.get(name)
        return c.get("cold_50_upstream_requests") if isinstance(c, dict) else None

    def ms(v: float | None) -> str:
        return fmt(v and v * 1000, ".1f")

    def allowed(t: Target) -> Target:
        """`t`, N workers against 1, with what these cores allow at most: N workers' CPU a
        request and wrk's, on the same cores (cpu_bound), against one worker's rate."""
        bound = cpu_bound(cpu, sg_n, n) if sg_n else None
        one = rate("hit_17k", "symgate 1w")
        if bound is not None and one:
            t.figures += f"; these cores allow {bound[2] / one:.2f}x"
        return t

    sym, fed, up = (cold_med.get(k) for k in ("symgate", "federating", "upstream"))
    fed_gets, sg_gets = upstream_gets("federating"), upstream_gets(sg)
    return [
        versus("hit_17k", sg, "federating", 2.0, "17 KiB hit vs federating debuginfod"),
        versus("hit_4m", "symgate 1w", "nginx 1w", 1.0, "4.2 MB hit vs nginx, 1 worker each"),
        versus("hit_4m", sg_n, f"nginx {n}w", 1.0, f"4.2 MB hit vs nginx, {n} workers each"),
        Target("HEAD on a hit", f"{fmt(rate('head', sg))} req/s", rate("head", sg), 10_000.0,
               True, " req/s"),
        Target("cold 4.2 MB total vs federating debuginfod",
               f"{ms(sym and sym[1])} vs {ms(fed and fed[1])} ms",
               ratio(sym and sym[1], fed and fed[1]), 1.5, False),
        Target("cold first byte, later than the upstream's by",
               f"{ms(sym and sym[0])} vs {ms(up and up[0])} ms",
               (sym[0] - up[0]) * 1000 if sym and up else None, 5.0, False, " ms"),
        allowed(versus("hit_17k", sg_n, "symgate 1w", 1.7, f"17 KiB hit, {n} workers vs 1")),
        versus("miss_404", sg, "federating", 1.5, "remembered 404 vs federating debuginfod"),
        Target(f"{COLD_CLIENTS} cold requests, upstream GETs", f"{fmt(sg_gets)} vs federating "
               f"debuginfod's {fmt(fed_gets)}", sg_gets,
               fed_gets if fed_gets is not None else 1.0, False, ""),
        Target("idle memory, workers included", "tree Pss idle at start and after warm-up",
               max(idle) if idle else None, 150.0, False, " MiB"),
    ]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def report(results: dict[str, Any], measures: dict[str, Rate], cols: list[str],
           sg: str, sg_n: str | None, tgts: list[Target]) -> str:
    c = c_cfg = results["config"]
    load = results["load_1min"]
    lines = [
        f"symgate serving benchmark of {c['root']}: {results['total_s']:.0f} s on {c['cpus']} "
        f"CPUs (1-min load {load['start']:.1f} at start, {load['end']:.1f} at end)",
        f"rates: wrk -t2 -c16 (HEAD: ab -k -i -c16), {c['seconds']} s runs, medians of "
        f"{c['rounds']} interleaved rounds; cold: medians of {c['cold_rounds']} fresh starts",
        f"symgate as run by default: {sg}" + ("" if sg_n else
                                               " (no `serve --workers`: one process, N n/a)"),
        ""]
    # nginx's own N workers against 1 beside symgate's: how far this machine lets N workers go
    # at all, wrk taking its share of the same cores.
    ng_n = sg_n.replace("symgate", "nginx") if sg_n else None
    rows = [["req/s", *cols, "Nw/1w", "nginx Nw/1w"]]
    for key, m in measures.items():
        med = results["rates"][key]["median"]
        row = [m.name]
        for c in cols:
            note = m.notes.get(c, "")
            row.append("error" if note.startswith("error") else fmt(med.get(c))
                       if c in m.servers else "n/a")
        row.append(fmt(ratio(med.get(sg_n), med.get("symgate 1w")) if sg_n else None, ".2f"))
        row.append(fmt(ratio(med.get(ng_n), med.get("nginx 1w")) if ng_n else None, ".2f"))
        rows.append(row)
    lines += [table(rows), ""]
    for m in measures.values():
        for c, note in m.notes.items():
            lines.append(f"  {m.name}, {c}: {note}")
    cores = c_cfg["cpus"]
    for m in measures.values():
        if not m.cpu:
            continue
        lines.append(f"  {m.name}, CPU a request (server's whole tree + wrk's) and the rate "
                     f"{cores} cores allow with both on them:")
        for name in cols:
            if (b := cpu_bound(m.cpu, name, cores)) is not None:
                lines.append(f"    {name:<12} {b[0] * 1e6:6.1f} + {b[1] * 1e6:5.1f} us  "
                             f"<= {b[2]:>9,.0f} req/s")
    cold_rows = [["cold 4.2 MB fetch (ms)", "first byte", "total", "rounds (total)"]]
    for which, runs in results["cold"]["runs"].items():
        med = results["cold"]["median"].get(which)
        cold_rows.append([which, fmt(med and med[0] * 1000, ".1f"),
                          fmt(med and med[1] * 1000, ".1f"),
                          " ".join(fmt(r and r[1] * 1000, ".0f") for r in runs)])
    lines += ["", table(cold_rows), ""]
    count_rows = [["upstream requests", f"{COLD_CLIENTS} cold", "5 misses", "slowest (ms)"]]
    for name, c in results["singleflight"].items():
        if isinstance(c, dict):
            count_rows.append([name, fmt(c.get("cold_50_upstream_requests")),
                               fmt(c.get("repeated_5_misses_upstream_requests")),
                               fmt(c.get("cold_50_total_s_max", 0) * 1000, ".0f")])
        else:
            count_rows.append([name, str(c)[:60], "", ""])
    lines += [table(count_rows), ""]
    for k, v in results.get("big", {}).items():
        lines.append(f"  {k:<42} {v:.3f}" if isinstance(v, float) else f"  {k:<42} {v}")
    for when in ("idle_at_start", "idle_after_warmup", "after_load"):
        mem = results["memory"].get(when)
        if mem:
            lines.append(f"  memory {when.replace('_', ' ')} (MiB; symgate: tree Pss): "
                         + ", ".join(f"{k} {v:.0f}" for k, v in mem.items()))
    t_rows = [["target", "figures", "value", "goal", "verdict"]]
    t_rows += [[t.what, t.figures, t.show(t.value), t.goal, t.verdict] for t in tgts]
    lines += ["", table(t_rows)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, world: World, results: dict[str, Any]) -> tuple[
        dict[str, Rate], list[str], str, str | None, list[Target]]:
    t0 = time.monotonic()
    n = world.n
    print("building the files ...", flush=True)
    files_dir, files = build_files(world.work, args.big_mb)
    results["files"] = {"small_bytes": files.small_bytes, "libc_bytes": files.libc_bytes,
                        "big_bytes": files.big_bytes}
    world.upstream_server(files_dir, [files.small.build_id, LIBC_ID, files.big.build_id])
    docs = world.work / "www" / "buildid"
    for build_id, path in ((files.small.build_id, files.small.debug), (LIBC_ID, LIBC_DEBUG)):
        (docs / build_id).mkdir(parents=True)
        shutil.copy(path, docs / build_id / "debuginfo")

    # symgate as operators run it: N workers where the flag exists, else as it is today.
    default_workers = n if world.workers_flag else None
    # On one CPU, N workers is one worker: no second column of the same.
    sg_n = f"symgate {n}w" if world.workers_flag and n > 1 else None
    sg = sg_n or "symgate 1w"
    servers: dict[str, Server] = {}
    servers["symgate 1w"] = world.symgate(1 if world.workers_flag else None)
    if sg_n:
        servers[sg_n] = world.symgate(n)
    servers["federating"] = world.federating()
    for w in sorted({1, n}):
        servers[f"nginx {w}w"] = world.nginx(w, docs.parent)
    cols = ["symgate 1w", *([sg_n] if sg_n else []), "federating", "nginx 1w",
            *([f"nginx {n}w"] if n != 1 else [])]
    sym = ["symgate 1w", *([sg_n] if sg_n else [])]
    print(f"ready in {time.monotonic() - t0:.0f} s; upstream {world.upstream}; "
          f"`serve --workers`: {'yes' if world.workers_flag else 'absent, n/a for N'}",
          flush=True)

    results["memory"] = {}
    print("rates ...", flush=True)
    measures = rates(servers, files, args, sym, results["memory"])
    results["memory"]["after_load"] = memory(servers)
    results["rates"] = {
        key: {"runs": m.runs, "median": {s: median(v) for s, v in m.runs.items()},
              "notes": m.notes, "cpu": m.cpu} for key, m in measures.items()}
    for name in [*sym, "federating"]:  # the cold measures below want the machine quiet
        world.stop(servers.pop(name))

    print("cold fetches ...", flush=True)
    cold_runs = cold(world, files, default_workers, args.cold_rounds)
    cold_med: dict[str, tuple[float, float] | None] = {}
    for which, runs in cold_runs.items():
        firsts, totals = median([r and r[0] for r in runs]), median([r and r[1] for r in runs])
        cold_med[which] = (firsts, totals) if firsts is not None and totals is not None else None
    results["cold"] = {"runs": cold_runs, "median": cold_med}

    print(f"{COLD_CLIENTS} concurrent cold requests, repeated misses, big artifact ...",
          flush=True)
    counts: dict[str, Any] = {}
    results["singleflight"] = counts
    starts: list[tuple[str, Callable[[], Server]]] = [
        (sg, lambda: world.symgate(default_workers)),
        *([("symgate 1w", lambda: world.symgate(1))] if sg_n else []),
        ("federating", world.federating)]
    for name, start in starts:
        srv: Server | None = None
        try:
            srv = start()
            assert srv.proc is not None
            if name == sg:
                time.sleep(2)
                results["memory"]["idle_at_start"] = {sg: tree_pss_kib(srv.proc.pid) / 1024}
            counts[name] = burst(world, srv, files)
            if name == sg:
                results["big"] = big(world, srv, files)
        except (BenchError, OSError) as e:
            counts[name] = f"error: {e}"
        finally:
            if srv is not None:
                world.stop(srv)
        print(f"  {name}: {counts[name]}", flush=True)

    med = results["rates"]
    idle = [v for k in ("idle_at_start", "idle_after_warmup")
            if (v := results["memory"].get(k, {}).get(sg)) is not None]
    tgts = targets({k: v["median"] for k, v in med.items()}, cold_med, counts, idle, sg, sg_n,
                   n, med["hit_17k"]["cpu"])
    results["targets"] = [{**t.__dict__, "goal": t.goal, "verdict": t.verdict} for t in tgts]
    return measures, cols, sg, sg_n, tgts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 round, 1 s runs, 1 cold round, a 10 MB big file")
    ap.add_argument("--seconds", type=int, help="length of each wrk/ab run (default 4)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of rates (default 3)")
    ap.add_argument("--cold-rounds", type=int, help="cold fetch rounds (default 5)")
    ap.add_argument("--big-mb", type=int, help="size of the big artifact (default 100)")
    ap.add_argument("--ports", help="listen on ports of this range, e.g. 19000-19499 "
                    "(default: any free ones)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    args = ap.parse_args()
    quick = args.quick
    for k, full, smoke in (("seconds", 4, 1), ("rounds", 3, 1), ("cold_rounds", 5, 1),
                           ("big_mb", 100, 10)):
        if getattr(args, k) is None:
            setattr(args, k, smoke if quick else full)
    for tool in ("debuginfod", "nginx", "wrk", "ab", "gcc", "objcopy"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            print(f"{tool} is needed: apt-get install debuginfod nginx-light wrk apache2-utils "
                  "gcc binutils", file=sys.stderr)
            return 1
    if not LIBC_DEBUG.exists():
        print("libc's debug file is needed: apt-get install libc6-dbg", file=sys.stderr)
        return 1

    loopback_only_environ()
    become_subreaper()

    stop_on_signals()
    work = Path(tempfile.mkdtemp(prefix="symgate-bench-"))
    procs = Procs()
    n = os.cpu_count() or 1
    world = World(work, procs, Ports(args.ports), n, workers_flag_exists())
    results: dict[str, Any] = {"config": {
        "seconds": args.seconds, "rounds": args.rounds, "cold_rounds": args.cold_rounds,
        "big_mb": args.big_mb, "cpus": n, "workers_flag": world.workers_flag,
        "root": str(ROOT)}}
    # Other work on a shared machine moves absolute figures: said, so a reader can judge.
    results["load_1min"] = {"start": os.getloadavg()[0]}
    t0 = time.monotonic()
    try:
        measured = run(args, world, results)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BenchError, subprocess.CalledProcessError, OSError) as e:
        print(f"could not run: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if killed := procs.cleanup():
            print(f"cleanup killed {killed} leftover processes", file=sys.stderr)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["total_s"] = time.monotonic() - t0
    results["load_1min"]["end"] = os.getloadavg()[0]
    print()
    print(report(results, *measured))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "proxy.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
