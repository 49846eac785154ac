"""Serving benchmark: symgate against real peers, in one run, on loopback.

  python bench/proxy_bench.py [--seconds 10] [--big-mb 100]

Measures, with a real elfutils debuginfod as upstream:
  * single flight: upstream requests caused by 30 concurrent cold requests, and by 5 misses;
  * cold vs warm latency of a big (100 MB) debug file, and symgate's peak RSS (VmHWM) while
    it streams that file to 20 clients at once;
  * wrk -t2 -c16 rates: a cache hit of libc's debug file against nginx (sendfile) serving the
    same file, and a remembered 404 against a federating elfutils debuginfod's remembered 404;
  * ab -k -i -c16: HEAD on that hit, against nginx's HEAD of the same file.
Prints a table of figures and ratios; writes bench/results/proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.elfs import build_program  # noqa: E402

LIBC_ID = "93ac61ec5a8eb1396f9fbd350e3169a558528a40"
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers: good enough
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def wait_200(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never answered 200")


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, **kw: object) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def vm_hwm_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def vm_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def wrk(url: str, seconds: int) -> float:
    out = subprocess.run(["wrk", "-t2", "-c16", f"-d{seconds}s", url], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert m, out
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx and "buildid/00" not in url:
        raise RuntimeError(f"wrk saw errors on {url}:\n{out}")
    return float(m.group(1))


def ab_head(url: str, seconds: int) -> float:
    """HEAD requests per second, keep-alive, 16 at once: wrk cannot time HEAD (it waits for a
    body of the announced length), ApacheBench's -i can."""
    out = subprocess.run(["ab", "-q", "-k", "-i", "-c16", f"-t{seconds}", "-n10000000", url],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests per second:\s+([\d.]+)", out)
    assert m, out
    failed = re.search(r"(Failed requests|Non-2xx responses):\s+(\d+)", out)
    if failed and int(failed.group(2)):
        raise RuntimeError(f"ab saw errors on {url}:\n{out}")
    return float(m.group(1))


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def timed_get(session: aiohttp.ClientSession, url: str) -> tuple[float, float, int]:
    """(seconds to first byte, seconds to last byte, bytes)."""
    t0 = time.perf_counter()
    first = 0.0
    n = 0
    async with session.get(url) as r:
        assert r.status == 200, r.status
        async for chunk in r.content.iter_chunked(1 << 20):
            if not n:
                first = time.perf_counter() - t0
            n += len(chunk)
    return first, time.perf_counter() - t0, n


async def many(url: str, n: int) -> list[tuple[float, float, int]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        return list(await asyncio.gather(*(timed_get(s, url) for _ in range(n))))


def symgate_config(path: Path, data: Path, upstream: str, listen: str) -> None:
    # The access log on, as by default: what an operator runs is what is measured.
    path.write_text(
        f'[server]\nlisten = "{listen}"\ndata_dir = "{data}"\naccess_log = true\n'
        f'[[upstreams]]\nurl = "{upstream}"\n'
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--big-mb", type=int, default=100)
    args = ap.parse_args()
    for tool in ("debuginfod", "nginx", "wrk", "ab"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} is needed: apt-get install debuginfod nginx-light wrk "
                     "apache2-utils")
    if not LIBC_DEBUG.exists():
        sys.exit("libc's debug file is needed: apt-get install libc6-dbg")

    work = Path(tempfile.mkdtemp(prefix="symgate-bench-"))
    procs = Procs()
    results: dict[str, object] = {}
    try:
        files = work / "files"
        files.mkdir()
        big = build_program(work / "src", files, "big", 7, pad_bytes=args.big_mb * 2**20)
        shutil.copy(LIBC_DEBUG, files / "libc.debug")
        size_big = big.debug.stat().st_size

        # The real upstream: elfutils debuginfod indexing the files.
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        procs.start(["debuginfod", "-p", str(up_port), "-d", str(work / "up.sqlite"),
                     "-F", str(files), "-t", "0", "-g", "0"], work / "up.log")
        wait_200(f"{upstream}/buildid/{big.build_id}/debuginfo")
        wait_200(f"{upstream}/buildid/{LIBC_ID}/debuginfo")

        # symgate in front of it.
        sg_port = free_port()
        symgate = f"http://127.0.0.1:{sg_port}"
        symgate_config(work / "sg.toml", work / "sg-data", upstream, f"127.0.0.1:{sg_port}")
        sg = procs.start(["symgate", "serve", "--config", str(work / "sg.toml")],
                         work / "sg.log")
        wait_http(symgate + "/healthz")

        # The federating peer: elfutils debuginfod with no files, DEBUGINFOD_URLS = upstream.
        fed_port = free_port()
        federating = f"http://127.0.0.1:{fed_port}"
        procs.start(["debuginfod", "-p", str(fed_port), "-d", str(work / "fed.sqlite"),
                     "-t", "0", "-g", "0"], work / "fed.log",
                    env={**os.environ, "DEBUGINFOD_URLS": upstream,
                         "DEBUGINFOD_CACHE_PATH": str(work / "fed-cache")})
        wait_http(federating + "/metrics")

        # nginx serving the same libc file at the same path, one worker, sendfile.
        root = work / "www" / "buildid" / LIBC_ID
        root.mkdir(parents=True)
        shutil.copy(LIBC_DEBUG, root / "debuginfo")
        ng_port = free_port()
        (work / "nginx.conf").write_text(f"""
user root; worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/nginx.err;
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; tcp_nopush on;
  server {{ listen 127.0.0.1:{ng_port}; root {work}/www;
    location / {{ default_type application/octet-stream; }} }} }}
""")
        procs.start(["nginx", "-c", str(work / "nginx.conf")], work / "nginx.log")
        nginx = f"http://127.0.0.1:{ng_port}"
        wait_http(nginx + "/")

        # 1. single flight.
        rss_idle = vm_rss_kib(sg.pid)
        before = metric(symgate, "symgate_upstream_requests_total")
        asyncio.run(many(f"{symgate}/buildid/{LIBC_ID}/debuginfo", 30))
        results["singleflight_30_cold_upstream_requests"] = (
            metric(symgate, "symgate_upstream_requests_total") - before)
        for result in ("ok", "not_found", "timeout", "upstream_error"):
            results[f"singleflight_upstream_{result}"] = metric(
                symgate, "symgate_upstream_requests_total", result=result)
        before = metric(symgate, "symgate_upstream_requests_total")
        for _ in range(5):
            try:
                urllib.request.urlopen(f"{symgate}/buildid/0011223344556677/debuginfo")
            except urllib.error.HTTPError as e:
                assert e.code == 404
        results["repeated_5_misses_upstream_requests"] = (
            metric(symgate, "symgate_upstream_requests_total") - before)

        # 2. a big artifact: cold to 20 clients at once (peak RSS), then warm.
        url_big = f"{symgate}/buildid/{big.build_id}/debuginfo"
        cold = asyncio.run(many(url_big, 20))
        assert all(n == size_big for _, _, n in cold)
        results["big_bytes"] = size_big
        results["big_cold_20_clients_first_byte_s_max"] = max(f for f, _, _ in cold)
        results["big_cold_20_clients_total_s_max"] = max(t for _, t, _ in cold)
        results["symgate_rss_idle_mib"] = rss_idle / 1024
        results["symgate_peak_rss_mib"] = vm_hwm_kib(sg.pid) / 1024
        warm = [asyncio.run(many(url_big, 1))[0] for _ in range(3)]
        results["big_warm_1_client_total_s_min"] = min(t for _, t, _ in warm)
        direct = [asyncio.run(many(f"{upstream}/buildid/{big.build_id}/debuginfo", 1))[0]
                  for _ in range(3)]
        results["big_upstream_direct_total_s_min"] = min(t for _, t, _ in direct)

        # 3. wrk rates, each pair in the same run.
        secs = args.seconds
        hit = f"/buildid/{LIBC_ID}/debuginfo"
        results["hit_rps_nginx"] = wrk(nginx + hit, secs)
        results["hit_rps_symgate"] = wrk(symgate + hit, secs)
        results["head_rps_nginx"] = ab_head(nginx + hit, secs)
        results["head_rps_symgate"] = ab_head(symgate + hit, secs)
        urllib.request.urlopen(federating + hit).read()  # warm the federating peer's cache
        results["hit_rps_federating_debuginfod"] = wrk(federating + hit, secs)
        miss = "/buildid/00aabbccddeeff00/debuginfo"
        for server in (symgate, federating):  # the first miss asks upstream; then remembered
            with contextlib.suppress(urllib.error.HTTPError):
                urllib.request.urlopen(server + miss)
        results["negative_rps_symgate"] = wrk(symgate + miss, secs)
        results["negative_rps_federating_debuginfod"] = wrk(federating + miss, secs)
        results["hit_ratio_vs_nginx"] = (
            float(results["hit_rps_symgate"]) / float(results["hit_rps_nginx"]))  # type: ignore[arg-type]
        results["head_ratio_vs_nginx"] = (
            float(results["head_rps_symgate"]) / float(results["head_rps_nginx"]))  # type: ignore[arg-type]
        results["negative_ratio_vs_federating"] = (
            float(results["negative_rps_symgate"])  # type: ignore[arg-type]
            / float(results["negative_rps_federating_debuginfod"]))  # type: ignore[arg-type]
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)

    width = max(len(k) for k in results)
    for k, v in results.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "proxy.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
