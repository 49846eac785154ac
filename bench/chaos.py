"""Load and chaos run of issue 11: one real `symgate serve` held to its promises, in one go.

  python bench/chaos.py [--only 1,3] [--server-nofile 1024] [--keep]

Everything runs on loopback. The server is the checked-out code (`python -m proxy.tools.cli
serve`, PYTHONPATH = this tree) with an explicit config in a temp dir; its upstream is a
counting debuginfod written here (it serves gcc-built ELF files by build ID, counts every
request it gets, and streams large files at a bounded rate so that downloads can be caught
half-way). Scenarios, each bounded in count and time:

  1. 1,000 concurrent connections each GET one cached artifact;
  2. 200 concurrent cold GETs over 20 artifacts, counted at the upstream (must be 20);
  3. 2,000 slowloris connections (headers a byte at a time) while a probe process GETs a
     cached artifact on a new connection every 20 ms;
  4. 6 concurrent /symbolize POSTs of a 100,000-mapping profile while the probe runs (the
     per-profile work bound is raised past it, so that the workers really do the work);
  5. 8 concurrent gzip bombs (~1 MB inflating to 1 GiB) on /symbolize while the server's RSS
     and its whole process tree's Pss are sampled;
  6. 5 rounds of start, GETs (some caught mid-download), SIGKILL, restart on the same data
     dir, then a final check of everything; orphans are the server's descendants still alive
     after its SIGKILL.

Every 200 body is checked against the source file's sha256. Prints one table of figures,
targets and PASS/FAIL; writes bench/results/chaos.json. Exits 0 when the table was measured,
whatever the verdicts; non-zero only when it could not run (1), or some scenario could not
be run (2, its row says ERROR), or it was interrupted (130).

The server's RLIMIT_NOFILE is set to --server-nofile (1024: the soft limit a systemd service
or a login shell gets by default), the client's is raised to its hard limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symbolize.pprof.profile_pb2 import Profile  # noqa: E402
from tests.elfs import Elf, build_id_tree, build_program  # noqa: E402
from tests.profiles import code_addresses, place  # noqa: E402

MiB = 1024 * 1024
PR_SET_CHILD_SUBREAPER = 36
SLOW_THRESHOLD = 1 * MiB  # the upstream streams files larger than this at --upstream-rate

# The targets.
HIT_P99_MS = 100.0
RSS_MB = 300.0
TREE_GROWTH_MB = 64.0


# ------------------------------------------------------------------------------------------
# Helpers run as child processes of this script: the counting upstream and the latency probe.
# They are processes, not tasks, so that the load generated here does not slow what they
# measure or serve.


def upstream_main(files: Path, rate: float) -> None:
    """Serves files/<build_id>/<kind> like debuginfod; GET /_count gives the request counts."""
    counts: Counter[str] = Counter()

    async def artifact(request: web.Request) -> web.StreamResponse:
        bid, kind = request.match_info["build_id"], request.match_info["kind"]
        counts[f"{bid}/{kind}"] += 1
        path = files / bid / kind
        if kind not in ("debuginfo", "executable") or not path.is_file():
            return web.Response(status=404, text="not found\n")
        data = path.read_bytes()
        resp = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream",
            "X-DEBUGINFOD-SIZE": str(len(data)),
            "X-DEBUGINFOD-FILE": f"/usr/lib/debug/{bid}.{kind}",
        })
        resp.content_length = len(data)
        await resp.prepare(request)
        if len(data) > SLOW_THRESHOLD and rate > 0:
            step = 64 * 1024
            for i in range(0, len(data), step):
                await resp.write(data[i:i + step])
                await asyncio.sleep(step / rate)
        else:
            await resp.write(data)
        await resp.write_eof()
        return resp

    async def count(_: web.Request) -> web.Response:
        return web.json_response(dict(counts))

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/buildid/{build_id}/{kind}", artifact)
        app.router.add_get("/_count", count)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())


def probe_main(url: str, sha: str, max_s: float) -> None:
    """GETs `url` on a new connection every 20 ms until SIGTERM (or max_s); prints JSON
    [[latency_s or null, "ok" | status | error], ...]."""
    async def run() -> list[tuple[float | None, str]]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        out: list[tuple[float | None, str]] = []
        deadline = time.monotonic() + max_s
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                timeout=timeout) as s:
            while not stop.is_set() and time.monotonic() < deadline and len(out) < 20000:
                t0 = time.perf_counter()
                try:
                    async with s.get(url) as r:
                        body = await r.read()
                        dt = time.perf_counter() - t0
                        if r.status != 200:
                            out.append((dt, str(r.status)))
                        elif hashlib.sha256(body).hexdigest() != sha:
                            out.append((dt, "wrong-bytes"))
                        else:
                            out.append((dt, "ok"))
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    out.append((None, type(e).__name__))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.02)
        return out

    print(json.dumps(asyncio.run(run())), flush=True)


# ------------------------------------------------------------------------------------------
# Processes: everything started here is tracked, and the whole tree is killed by pid on exit.

import procs  # noqa: E402  (bench/ is the script's folder)
from procs import descendants, kill_alive  # noqa: E402


def tree_rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS of pid, sum of Pss of pid and all its descendants) in KiB.

    The tree is summed by Pss, not VmRSS: the workers are forks of one forkserver that
    imported numpy, protobuf and symbolic, and VmRSS would count those shared pages once per
    worker. Pss splits each shared page among the processes that map it."""
    def field(p: int, name: str, path: str) -> int:
        try:
            for line in Path(f"/proc/{p}/{path}").read_text().splitlines():
                if line.startswith(name):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def pss(p: int) -> int:
        return field(p, "Pss:", "smaps_rollup") or field(p, "VmRSS:", "status")
    return field(pid, "VmRSS:", "status"), pss(pid) + sum(pss(p) for p in descendants(pid))


class Procs(procs.Procs):
    def start(self, cmd: list[str], log: Path, *, pipe: bool = False, **kw: Any
              ) -> subprocess.Popen[bytes]:
        """Output to `log`; with pipe, stdout is kept for the caller and stderr goes there."""
        if not pipe:
            return super().start(cmd, log, **kw)
        with log.open("ab") as out:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out,
                                 stdin=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p


_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "debuginfod_urls"}


def python_env() -> dict[str, str]:
    # symgate honours HTTP(S)_PROXY: none, so that every request stays on loopback.
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    return {**env, "NO_PROXY": "*", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------
# symgate


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@dataclass
class World:
    work: Path
    procs: Procs
    upstream: str
    server_nofile: int
    artifacts: dict[str, str] = field(default_factory=dict)  # "id/kind" -> sha256

    def config(self, data: Path, port: int, debug_dir: Path) -> Path:
        # Every key spelled out, so the run says what it measured; only keys that exist in
        # proxy/config.py today (keys added later keep their defaults).
        path = data.with_suffix(f".{port}.toml")
        path.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
data_dir = "{data}"
access_log = false
log_format = "text"
forwarded_ttl_limit = 8
retry_after_s = 30
shutdown_grace_s = 2.0
access_flush_s = 5.0

[cache]
max_bytes = "2GiB"
max_concurrent_fetches = 32
max_artifact_bytes = "4GiB"

[database]
migrate_on_start = true

[fetch]
policy = "in_order"

[symbolize]
enabled = true
debug_dirs = ["{debug_dir}"]
max_request_bytes = "32MiB"
max_decompressed_bytes = "256MiB"
max_mappings = 256
# Scenario 4 floods with 100k-mapping profiles: let them past the per-profile work bound
# (10,000 mappings by default, which answers them 422 at once) so the workers really work.
max_profile_mappings = 200000
deadline_s = 30.0
build_workers = 2

[[upstreams]]
url = "{self.upstream}"
connect_timeout_s = 5.0
first_byte_timeout_s = 30.0
read_timeout_s = 30.0
total_timeout_s = 120.0
retries = 2
breaker_failures = 5
breaker_cooldown_s = 30.0
""")
        return path

    async def serve(self, data: Path, debug_dir: Path) -> Server:
        port = free_port()
        cfg = self.config(data, port, debug_dir)
        log = data.parent / f"{data.name}.log"
        proc = self.procs.start(
            [sys.executable, "-m", "proxy.tools.cli", "serve", "--config", str(cfg)], log,
            env=python_env(), cwd=ROOT)
        # Set from outside (no preexec_fn: threads run here); the interpreter takes far longer
        # to import symgate than this takes, and the workers it starts later inherit it.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (min(self.server_nofile, hard), hard))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"symgate exited with {proc.returncode}:\n{tail}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            return Server(proc, url, log)
                await asyncio.sleep(0.1)
        raise RuntimeError(f"symgate at {url} did not answer /healthz in 60 s")

    async def stop(self, server: Server) -> int:
        """SIGTERM, SIGKILL after 10 s; returns descendants left alive, which it kills."""
        tree = descendants(server.proc.pid)
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(server.proc.wait, 10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            await asyncio.to_thread(server.proc.wait)
        await asyncio.sleep(1.0)
        return kill_alive(tree)

    async def own_upstream_requests(self, sg: Server) -> float:
        """symgate's own count (symgate_upstream_requests_total, every result), as a check."""
        async with aiohttp.ClientSession() as s, s.get(sg.url + "/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("symgate_upstream_requests_total"))

    async def upstream_counts(self) -> Counter[str]:
        async with aiohttp.ClientSession() as s, s.get(self.upstream + "/_count") as r:
            return Counter(await r.json())


class Probe:
    """The latency probe process, started and stopped around a flood."""

    def __init__(self, world: World, url: str, sha: str, max_s: float) -> None:
        self.proc = world.procs.start(
            [sys.executable, str(Path(__file__).resolve()), "_probe", url, sha, str(max_s)],
            world.work / "probe.err", pipe=True, env=python_env())

    async def finish(self) -> list[tuple[float | None, str]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(self.proc.communicate, None, 30)
        return [tuple(x) for x in json.loads(out or b"[]")]  # type: ignore[misc]


def server_faults(statuses: Counter[str]) -> int:
    """5xx answers other than 503: a 503 (with Retry-After) is how the issue wants load shed;
    500, 502 and 504 to hostile clients are the server's faults."""
    return sum(n for st, n in statuses.items() if st.startswith("5") and st != "503")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def ms(v: float) -> str:
    return "-" if v != v else f"{v:.0f}ms" if v >= 100 else f"{v:.1f}ms"


def probe_figures(samples: list[tuple[float | None, str]]) -> tuple[str, bool, dict[str, Any]]:
    ok = [t * 1000 for t, what in samples if what == "ok" and t is not None]
    errors = Counter(what for _, what in samples if what != "ok")
    p50, p99 = pct(ok, 50), pct(ok, 99)
    mx = max(ok, default=float("nan"))
    figures = (f"probe n={len(samples)} p50={ms(p50)} p99={ms(p99)} max={ms(mx)} "
               f"errors={sum(errors.values())}"
               + (f" {dict(errors)}" if errors else ""))
    passed = bool(ok) and not errors and p99 < HIT_P99_MS
    data = {"n": len(samples), "p50_ms": p50, "p99_ms": p99, "max_ms": mx,
            "errors": dict(errors)}
    return figures, passed, data


@dataclass
class Row:
    scenario: str
    figures: str
    target: str
    verdict: str  # PASS, FAIL or ERROR


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    corrupt: int = 0  # 200 answers whose bytes differ from the source file, all scenarios
    # 404s for an artifact known to be cached: a debuginfod client believes them (elfutils
    # caches a miss for 10 minutes), so they are wrong answers too.
    cached_404: int = 0

    def add(self, scenario: str, figures: str, target: str, passed: bool) -> None:
        self.rows.append(Row(scenario, figures, target, "PASS" if passed else "FAIL"))
        print(f"  {scenario}: {figures} -> {'PASS' if passed else 'FAIL'}", flush=True)


async def fetch_checked(session: aiohttp.ClientSession, url: str, sha: str | None
                        ) -> tuple[str, float]:
    """('ok' | 'wrong' | status | error name, seconds)."""
    t0 = time.perf_counter()
    try:
        async with session.get(url) as r:
            body = await r.read()
            dt = time.perf_counter() - t0
            if r.status != 200:
                return str(r.status), dt
            if sha is not None and hashlib.sha256(body).hexdigest() != sha:
                return "wrong", dt
            return "ok", dt
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return type(e).__name__, time.perf_counter() - t0


def session(total: float) -> aiohttp.ClientSession:
    # A connection per request, as 1,000 separate clients would open.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=total))


# ------------------------------------------------------------------------------------------
# Scenarios


async def hits(world: World, sg: Server, report: Report, hit: Elf) -> None:
    key = f"{hit.build_id}/debuginfo"
    url = f"{sg.url}/buildid/{key}"
    async with session(120) as s:
        results = await asyncio.gather(*(fetch_checked(s, url, world.artifacts[key])
                                         for _ in range(1000)))
    outcomes = Counter(what for what, _ in results)
    ok_ms = [dt * 1000 for what, dt in results if what == "ok"]
    report.corrupt += outcomes["wrong"]
    report.cached_404 += outcomes["404"]
    errors = 1000 - outcomes["ok"]
    report.data["1_hits"] = {"outcomes": dict(outcomes), "p50_ms": pct(ok_ms, 50),
                             "p99_ms": pct(ok_ms, 99)}
    report.add("1 1000 concurrent hits",
               f"ok={outcomes['ok']} errors={errors}"
               + (f" {dict(outcomes - Counter(ok=outcomes['ok']))}" if errors else "")
               + f" p50={ms(pct(ok_ms, 50))} p99={ms(pct(ok_ms, 99))} (of ok)",
               "0 errors, 0 wrong", errors == 0)


async def cold(world: World, sg: Server, report: Report, elfs: list[Elf]) -> None:
    before = await world.upstream_counts()
    own_before = await world.own_upstream_requests(sg)
    keys = [f"{e.build_id}/debuginfo" for e in elfs]
    async with session(120) as s:
        results = await asyncio.gather(*(fetch_checked(s, f"{sg.url}/buildid/{k}",
                                                       world.artifacts[k])
                                         for k in keys for _ in range(200 // len(keys))))
    after = await world.upstream_counts()
    own = await world.own_upstream_requests(sg) - own_before
    per_key = [after[k] - before[k] for k in keys]
    total = sum(per_key)
    outcomes = Counter(what for what, _ in results)
    report.corrupt += outcomes["wrong"]
    report.data["2_cold"] = {"outcomes": dict(outcomes), "upstream_requests": total,
                             "per_artifact": per_key, "symgate_metric": own}
    report.add("2 200 cold over 20",
               f"upstream GETs={total} (counted by the upstream; max per artifact "
               f"{max(per_key)}; symgate's own metric says {own:.0f}) answers={dict(outcomes)}",
               f"upstream == {len(keys)}, all 200",
               total == len(keys) and outcomes["ok"] == len(results))


async def slowloris(world: World, sg: Server, report: Report, hit: Elf) -> None:
    key = f"{hit.build_id}/debuginfo"
    url = f"{sg.url}/buildid/{key}"
    idle = Probe(world, url, world.artifacts[key], 10)
    await asyncio.sleep(3)
    _, _, idle_data = probe_figures(await idle.finish())
    host, port = "127.0.0.1", int(sg.url.rsplit(":", 1)[1])
    request = f"GET /buildid/{key} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: slow\r\n\r\n".encode()
    hold_s, n = 20.0, 2000
    stats: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    connect_gate = asyncio.Semaphore(1000)
    started = time.monotonic()

    async def one(i: int) -> None:
        # An attacker reconnects when cut off, so the pressure lasts hold_s whatever the server
        # does; bounded by that time and by a count.
        for _ in range(200):
            if time.monotonic() - started > hold_s:
                return
            async with connect_gate:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, port), 5)
                except (TimeoutError, OSError):
                    stats["connect_failed"] += 1
                    await asyncio.sleep(0.5)
                    continue
            stats["connections"] += 1
            if await dribble(i, reader, writer):
                return

    async def dribble(i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> bool:
        """Sends the request a byte at a time; True if held to the end, False if cut off."""
        read = asyncio.ensure_future(reader.read(256))
        try:
            for b in range(len(request) - 2):  # never the final CRLF
                if time.monotonic() - started > hold_s or read.done():
                    break
                writer.write(request[b:b + 1])
                await writer.drain()
                await asyncio.sleep(0.5 + (i % 100) / 200)  # spread the bytes over time
            if read.done() and not read.cancelled():
                stats["closed_by_server"] += 1
                if read.exception() is None and (data := read.result()):
                    answers[data.split(b"\r\n", 1)[0].decode(errors="replace")[:40]] += 1
                return False
            stats["held_to_end"] += 1
            return True
        except (TimeoutError, OSError):
            stats["closed_by_server"] += 1
            return False
        finally:
            if read.done() and not read.cancelled():
                read.exception()  # retrieved: an RST seen by the read is counted above
            read.cancel()
            writer.close()

    probe = Probe(world, url, world.artifacts[key], hold_s + 30)
    log_before = sg.log.stat().st_size
    await asyncio.gather(*(one(i) for i in range(n)))
    samples = await probe.finish()
    log_growth = sg.log.stat().st_size - log_before
    figures, passed, data = probe_figures(samples)
    report.corrupt += data["errors"].get("wrong-bytes", 0)
    report.cached_404 += data["errors"].get("404", 0)
    server_5xx = server_faults(Counter({k.split(" ")[1] if " " in k else k: v
                                        for k, v in answers.items()}))
    report.data["3_slowloris"] = {"probe": data, "idle_probe": idle_data,
                                  "connections": dict(stats), "answers": dict(answers),
                                  "server_log_bytes": log_growth}
    report.add("3 2000 slowloris + probe",
               f"{figures}; idle p99={ms(idle_data['p99_ms'])}; slow conns "
               f"{dict(stats)} answers={dict(answers)}; server log +{log_growth // 1024} KiB",
               f"hit p99 < {HIT_P99_MS:.0f}ms, 0 probe errors, 0 5xx but 503",
               passed and server_5xx == 0 and sg.proc.poll() is None)


def big_profile(elf: Elf, mappings: int) -> bytes:
    """`mappings` mappings of one ELF at distinct load addresses, one location each."""
    addrs = code_addresses(elf)
    at0 = place(elf, 0)  # the ELF is read once; each mapping is this one moved by `base`
    p = Profile()
    p.string_table.extend(["", "cpu", "nanoseconds", str(elf.executable), elf.build_id])
    p.sample_type.add(type=1, unit=2)
    for i in range(1, mappings + 1):
        base = 0x7F0000000000 + i * 0x100000
        p.mapping.add(id=i, memory_start=base + at0.memory_start,
                      memory_limit=base + at0.memory_limit, file_offset=at0.file_offset,
                      filename=3, build_id=4)
        p.location.add(id=i, mapping_id=i, address=base + addrs[i % len(addrs)])
        p.sample.add(location_id=[i], value=[i])
    return p.SerializeToString()


async def post(s: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
               ) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        async with s.post(url, data=body, headers=headers) as r:
            await r.read()
            return str(r.status), time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return type(e).__name__, time.perf_counter() - t0


async def symbolize_flood(world: World, sg: Server, report: Report, hit: Elf,
                          profile: bytes, bound_s: float) -> None:
    key = f"{hit.build_id}/debuginfo"
    headers = {"Content-Type": "application/octet-stream"}
    async with session(120) as s:  # the symbol table built first: the flood measures lookups
        warm = await post(s, sg.url + "/symbolize", big_profile(hit, 1), headers)
    probe = Probe(world, f"{sg.url}/buildid/{key}", world.artifacts[key], bound_s + 30)
    await asyncio.sleep(1)
    flood_started = time.monotonic()
    async with session(bound_s) as s:
        results = await asyncio.gather(*(post(s, sg.url + "/symbolize", profile, headers)
                                         for _ in range(6)))
    # A server that refuses the POSTs at once is still probed for a while after them.
    await asyncio.sleep(max(0.0, 3 - (time.monotonic() - flood_started)))
    samples = await probe.finish()
    figures, passed, data = probe_figures(samples)
    report.corrupt += data["errors"].get("wrong-bytes", 0)
    report.cached_404 += data["errors"].get("404", 0)
    statuses = Counter(st for st, _ in results)
    times = [dt for _, dt in results]
    server_5xx = server_faults(statuses)
    report.data["4_symbolize"] = {"probe": data, "posts": dict(statuses),
                                  "post_s": times, "warm_post": warm,
                                  "profile_bytes": len(profile)}
    report.add("4 6x100k-mapping /symbolize + probe",
               f"{figures}; POSTs ({len(profile) / MiB:.1f} MB) {dict(statuses)} in "
               f"{min(times):.1f}-{max(times):.1f}s (client gives up at {bound_s:.0f}s)",
               f"hit p99 < {HIT_P99_MS:.0f}ms, 0 probe errors, 0 5xx but 503",
               passed and server_5xx == 0)


def gzip_bomb(inflated: int) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip container
    zeros = bytes(MiB)
    parts = [z.compress(zeros) for _ in range(inflated // MiB)]
    parts.append(z.flush())
    return b"".join(parts)


async def bombs(world: World, sg: Server, report: Report, bomb: bytes) -> None:
    headers = {"Content-Type": "application/octet-stream"}
    # One bomb first, so that the workers have started and run their code path once: what is
    # measured below is what the bombs add, not the workers' own start.
    async with session(60) as s:
        await post(s, sg.url + "/symbolize", bomb, headers)
    await asyncio.sleep(0.5)
    rss_idle, tree_idle = tree_rss_kib(sg.proc.pid)
    peak = [rss_idle, tree_idle]
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            own, tree = await asyncio.to_thread(tree_rss_kib, sg.proc.pid)
            peak[0], peak[1] = max(peak[0], own), max(peak[1], tree)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 0.02)

    sampler = asyncio.create_task(sample())
    async with session(60) as s:
        results = await asyncio.gather(*(post(s, sg.url + "/symbolize", bomb, headers)
                                         for _ in range(8)))
    await asyncio.sleep(0.5)
    done.set()
    await sampler
    statuses = Counter(st for st, _ in results)
    times = [dt for _, dt in results]
    server_5xx = server_faults(statuses)
    refused = all(st.startswith("4") for st, _ in results)
    report.data["5_bombs"] = {"answers": dict(statuses), "seconds": times,
                              "rss_idle_mib": rss_idle / 1024, "tree_idle_mib": tree_idle / 1024,
                              "peak_rss_mib": peak[0] / 1024, "peak_tree_mib": peak[1] / 1024,
                              "bomb_bytes": len(bomb)}
    # The target is the server's RSS; the tree (forkserver, build and symbolize
    # workers) is shown too, and what the bombs add to it must stay near nothing.
    report.add("5 8 gzip bombs: server RSS",
               f"main process peak {peak[0] / 1024:.0f} MB (idle {rss_idle / 1024:.0f})",
               f"server RSS < {RSS_MB:.0f} MB", peak[0] / 1024 < RSS_MB)
    grown = (peak[1] - tree_idle) / 1024
    report.add("5 8 gzip bombs: tree",
               f"whole tree Pss peak {peak[1] / 1024:.0f} MB, idle {tree_idle / 1024:.0f} "
               f"(+{grown:.0f} MB under the bombs)",
               f"bombs add < {TREE_GROWTH_MB:.0f} MB", grown < TREE_GROWTH_MB)
    report.add("5 8 gzip bombs: answers",
               f"{len(bomb) / MiB:.2f} MB -> 1 GiB each: {dict(statuses)} in "
               f"{min(times):.1f}-{max(times):.1f}s",
               "all 4xx (413), 0 5xx", refused and server_5xx == 0)


async def kill_loop(world: World, report: Report, keys: list[str], debug_dir: Path,
                    left_after_stops: list[int]) -> None:
    data = world.work / "kill-data"
    kill_after = [0.2, 0.7, 1.2, 1.8, 2.6]
    orphans: list[int] = []
    under_way: list[int] = []  # temp files of downloads at the moment of each SIGKILL
    outcomes: Counter[str] = Counter()
    for delay in kill_after:
        sg = await world.serve(data, debug_dir)
        async with session(60) as s:
            tasks = [asyncio.ensure_future(fetch_checked(s, f"{sg.url}/buildid/{k}",
                                                         world.artifacts[k])) for k in keys]
            await asyncio.sleep(delay)
            under_way.append(sum(1 for _ in (data / "cache" / "tmp").rglob("*.part")))
            tree = descendants(sg.proc.pid)
            sg.proc.kill()
            await asyncio.to_thread(sg.proc.wait)
            results = await asyncio.gather(*tasks)
        outcomes.update(what for what, _ in results)
        await asyncio.sleep(1.5)  # what dies with its parent has had time to
        orphans.append(kill_alive(tree))
    # Once more, to the end: everything must now be served, and right.
    sg = await world.serve(data, debug_dir)
    async with session(120) as s:
        final = await asyncio.gather(*(fetch_checked(s, f"{sg.url}/buildid/{k}",
                                                     world.artifacts[k]) for k in keys))
    final_outcomes = Counter(what for what, _ in final)
    tmp_left = sum(1 for _ in (data / "cache" / "tmp").glob("*")) if (
        data / "cache" / "tmp").is_dir() else 0
    orphans_after_term = await world.stop(sg)
    corrupt = outcomes["wrong"] + final_outcomes["wrong"]
    report.corrupt += corrupt
    report.data["6_kill_loop"] = {"kill_after_s": kill_after, "orphans": orphans,
                                  "during_rounds": dict(outcomes),
                                  "downloads_under_way_at_kill": under_way,
                                  "final": dict(final_outcomes),
                                  "tmp_files_after_restart": tmp_left,
                                  "orphans_after_sigterm": orphans_after_term}
    report.add("6 SIGKILL/restart x5: data",
               f"kills at {kill_after}s caught {under_way} downloads under way; answers in "
               f"the rounds {dict(outcomes)}; after restart: {dict(final_outcomes)} of "
               f"{len(keys)}; wrong bytes={corrupt}; temp files left at restart={tmp_left}",
               "0 corrupt, all served after restart",
               corrupt == 0 and final_outcomes["ok"] == len(keys))
    report.add("6 SIGKILL/restart x5: orphans",
               f"descendants alive after SIGKILL per round {orphans} (total {sum(orphans)}); "
               f"after the final SIGTERM {orphans_after_term}; after each earlier "
               f"scenario's stop {left_after_stops}",
               "0 orphans",
               sum(orphans) + orphans_after_term + sum(left_after_stops) == 0)


# ------------------------------------------------------------------------------------------


def build_world(work: Path) -> tuple[dict[str, Elf], list[Elf], list[Elf]]:
    src, out = work / "src", work / "elfs"
    out.mkdir()
    with ThreadPoolExecutor(2) as pool:  # gcc and objcopy are processes: two at a time
        hit = pool.submit(build_program, src, out, "hit", 1000)
        small = [pool.submit(build_program, src, out, f"cold{i}", 2000 + i) for i in range(20)]
        big = [pool.submit(build_program, src, out, f"big{i}", 3000 + i, pad_bytes=6 * MiB)
               for i in range(3)]
        return {"hit": hit.result()}, [f.result() for f in small], [f.result() for f in big]


async def run(args: argparse.Namespace, work: Path, procs: Procs, report: Report) -> None:
    t0 = time.monotonic()
    print("building ELF files, the profile and the bomb ...", flush=True)
    named, small, big = await asyncio.to_thread(build_world, work)
    hit = named["hit"]
    files = work / "upstream"
    world_files: dict[str, Path] = {}
    for e in [hit, *small, *big]:
        (files / e.build_id).mkdir(parents=True)
        for kind, path in (("debuginfo", e.debug), ("executable", e.executable)):
            (files / e.build_id / kind).symlink_to(path)
            world_files[f"{e.build_id}/{kind}"] = path
    debug_dir = build_id_tree(work / "debug", hit.build_id, hit.debug, hit.executable)
    profile = await asyncio.to_thread(big_profile, hit, 100_000)
    bomb = await asyncio.to_thread(gzip_bomb, 1024 * MiB)

    up = procs.start([sys.executable, str(Path(__file__).resolve()), "_upstream", str(files),
                      str(args.upstream_rate)], work / "upstream.err", pipe=True,
                     env=python_env())
    assert up.stdout is not None
    port = int(await asyncio.to_thread(up.stdout.readline))
    world = World(work, procs, f"http://127.0.0.1:{port}", args.server_nofile,
                  {k: sha256(p) for k, p in world_files.items()})
    print(f"ready in {time.monotonic() - t0:.0f}s; upstream {world.upstream}", flush=True)

    data = work / "data"
    stopped_left: list[int] = []

    async def scenario(name: str, body: Any) -> None:
        print(f"{name} ...", flush=True)
        t = time.monotonic()
        sg = await world.serve(data, debug_dir)
        try:
            await body(sg)
        except Exception as e:  # one scenario's failure must not hide the rest
            alive = sg.proc.poll() is None
            report.rows.append(Row(name, f"{type(e).__name__}: {e}"[:150]
                                   + ("" if alive else f" (server exited {sg.proc.returncode})"),
                                   "-", "ERROR" if alive else "FAIL"))
            print(f"  {name}: {type(e).__name__}: {e}", flush=True)
        finally:
            stopped_left.append(await world.stop(sg))
            report.data.setdefault("scenario_s", {})[name] = time.monotonic() - t

    async def warmup(sg: Server) -> None:
        async with session(60) as s:
            what, _ = await fetch_checked(s, f"{sg.url}/buildid/{hit.build_id}/debuginfo",
                                          world.artifacts[f"{hit.build_id}/debuginfo"])
        if what != "ok":
            raise RuntimeError(f"could not cache the hit artifact: {what}")

    async def s12(sg: Server) -> None:
        await warmup(sg)
        if 1 in only:
            await hits(world, sg, report, hit)
        if 2 in only:
            await cold(world, sg, report, small)

    only = {int(x) for x in args.only.split(",")} if args.only else set(range(1, 7))
    if only & {1, 2}:
        await scenario("1+2 hits, cold", s12)
    if 3 in only:
        await scenario("3 slowloris", lambda sg: slowloris(world, sg, report, hit))
    if 4 in only:
        await scenario("4 symbolize", lambda sg: symbolize_flood(
            world, sg, report, hit, profile, args.symbolize_bound_s))
    if 5 in only:
        await scenario("5 gzip bombs", lambda sg: bombs(world, sg, report, bomb))
    if 6 in only:
        print("6 SIGKILL/restart ...", flush=True)
        keys = [f"{e.build_id}/{k}" for e in [*small, *big] for k in ("debuginfo", "executable")]
        try:
            await kill_loop(world, report, keys, debug_dir, stopped_left)
        except Exception as e:  # a harness fault in the loop: reported, not fatal
            report.rows.append(Row("6 SIGKILL/restart", f"{type(e).__name__}: {e}"[:150], "-",
                                   "ERROR"))
    report.add("all: wrong artifacts", f"200 answers with bytes unlike the source: "
               f"{report.corrupt}", "0", report.corrupt == 0)
    report.add("all: 404 for a cached artifact", f"{report.cached_404} (hits and probes)", "0",
               report.cached_404 == 0)
    report.data["left_after_sigterm_per_scenario"] = stopped_left
    report.data["total_s"] = time.monotonic() - t0


async def guarded(body: Any, procs: Procs) -> None:
    # Ended inside the loop, on Ctrl-C too: threads waiting on these processes then return, so
    # asyncio.run's own shutdown does not wait for them.
    try:
        await body
    finally:
        if killed := procs.cleanup():
            print(f"cleanup killed {killed} leftover processes", file=sys.stderr)


def render(report: Report, args: argparse.Namespace, total_s: float) -> str:
    # Long figures wrap within their column, so the table stays readable in a terminal.
    header = ("scenario", "result", "target", "figures")
    rows = [(r.scenario, r.verdict, r.target, r.figures) for r in report.rows]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(3)]
    lines = [f"symgate chaos run ({total_s:.0f} s; server RLIMIT_NOFILE {args.server_nofile}, "
             f"upstream rate for >1 MiB files {args.upstream_rate / MiB:.0f} MiB/s)"]
    for r in [header, *rows]:
        lead = "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  "
        for i, part in enumerate(textwrap.wrap(r[3], 80) or [""]):
            lines.append((lead if i == 0 else " " * len(lead)) + part)
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        upstream_main(Path(sys.argv[2]), float(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        probe_main(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-nofile", type=int, default=1024,
                    help="the server's RLIMIT_NOFILE soft limit (default 1024)")
    ap.add_argument("--upstream-rate", type=float, default=3 * MiB,
                    help="bytes/s at which the upstream streams files over 1 MiB")
    ap.add_argument("--symbolize-bound-s", type=float, default=45.0,
                    help="seconds after which the /symbolize flood's clients give up")
    ap.add_argument("--only", help="some scenarios, e.g. 1,3 (default: all six)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    args = ap.parse_args()
    for tool in ("gcc", "objcopy", "objdump"):
        if not shutil.which(tool):
            print(f"{tool} is needed (apt-get install gcc binutils)", file=sys.stderr)
            return 2

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 4000:
        print(f"RLIMIT_NOFILE hard limit {hard} is too low for 2,000 client sockets",
              file=sys.stderr)
        return 2
    # Orphans of the servers we SIGKILL are re-parented to us, so we can count and end them.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="symgate-chaos-"))
    procs = Procs()
    report = Report()
    t0 = time.monotonic()
    code = 0
    try:
        asyncio.run(guarded(run(args, work, procs, report), procs))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # say why the run could not happen, then clean up
        print(f"could not run: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        killed = procs.cleanup()
        if killed:
            print(f"cleanup killed {killed} leftover processes", file=sys.stderr)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if code:
        return code
    print(render(report, args, time.monotonic() - t0))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(
        {"rows": [r.__dict__ for r in report.rows], "figures": report.data}, indent=2,
        default=str))
    return 2 if any(r.verdict == "ERROR" for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
