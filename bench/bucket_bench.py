"""Replicas sharing a bucket (issue 13): upstream requests per artifact across three replicas,
and the time to first byte of a bucket hit against a local hit and an upstream fetch.

  python bench/bucket_bench.py [--artifacts 30] [--requests 10] [--rounds 7]
                               [--ports 19500-19599] [--keep]

On loopback: one elfutils debuginfod indexes the files (the upstream); moto's S3 server (in a
process of its own) is the bucket; a fresh PostgreSQL database (127.0.0.1:5432) is the shared
catalogue; three `symgate serve --workers 1` of this checkout, each with its own data dir,
share both.

Measured:
  * --artifacts small debug files, each asked --requests times, spread at random over the
    three replicas, all at once: the upstream's own count of the requests it got, per
    distinct artifact (symgate's promise: 1.00);
  * for --rounds fresh 4.2 MB debug files (libc's size), each: replica A's cold fetch from
    upstream, the same file from the upstream directly, replica B's first request (a bucket
    hit: B's disk lacks it, the bucket has it), the object from the bucket directly, then
    A's second request (a local hit): time to the first body byte and to the last, medians.
Writes bench/results/bucket.json. Exits 0 when it measured, 1 when it could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
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
    loopback_only_environ,
    stop_on_signals,
)
from proxy_bench import BenchError, _timed_get, pad_to, wait_answering  # noqa: E402

from tests.elfs import build_program  # noqa: E402

PG_ADMIN_DSN = os.environ.get("SYMGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
BUCKET = "symgate-bench"
LIBC_BYTES = 4_166_896
MiB = 1024 * 1024


async def timed_get(session: aiohttp.ClientSession, url: str, size: int
                    ) -> tuple[float, float, bytes]:
    """(seconds to the first body byte, to the last, the body)."""
    body = bytearray()
    first, total = await _timed_get(session, url, size, body)
    return first, total, bytes(body)


def upstream_requests(upstream: str) -> float:
    with urllib.request.urlopen(upstream + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith('http_requests_total{type="debuginfo"}'):
            return float(line.split()[-1])
    return 0.0


async def make_database() -> str:
    import asyncpg

    name = f"symgate_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


async def drop_database(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await conn.close()


class Cluster:
    def __init__(self, work: Path, procs: Procs, ports: Ports) -> None:
        self.work = work
        self.procs = procs
        self.ports = ports
        self.upstream = ""
        self.s3 = ""
        self.replicas: list[str] = []

    def start_upstream(self, files: Path, ids: list[str]) -> None:
        port = self.ports.take()
        log = self.work / "upstream.log"
        proc = self.procs.start(["debuginfod", "-p", str(port), "-d",
                                 str(self.work / "upstream.sqlite"), "-F", str(files),
                                 "-t", "0", "-g", "0"], log)
        self.upstream = f"http://127.0.0.1:{port}"
        for build_id in ids:  # answers once it has indexed them
            wait_answering(f"{self.upstream}/buildid/{build_id}/debuginfo", proc, log)

    def start_bucket(self) -> None:
        port = self.ports.take()
        log = self.work / "moto.log"
        proc = self.procs.start([shutil.which("moto_server") or "moto_server", "-H",
                                 "127.0.0.1", "-p", str(port)], log)
        self.s3 = f"http://127.0.0.1:{port}"
        wait_answering(self.s3 + "/", proc, log, any_status=True)
        urllib.request.urlopen(urllib.request.Request(f"{self.s3}/{BUCKET}", method="PUT"),
                               timeout=10).close()

    def start_replicas(self, database: str, n: int) -> None:
        for i in range(n):
            port = self.ports.take()
            data = self.work / f"replica-{i}"
            cfg = data.with_suffix(".toml")
            cfg.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
data_dir = "{data}"
access_log = false
[database]
url = "{database}"
[storage]
url = "s3://{BUCKET}/bench"
endpoint = "{self.s3}"
region = "us-east-1"
[[upstreams]]
url = "{self.upstream}"
""")
            log = data.with_suffix(".log")
            proc = self.procs.start(
                [sys.executable, "-m", "proxy.tools.cli", "serve", "--config", str(cfg),
                 "--workers", "1"], log, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": "bench",
                     "AWS_SECRET_ACCESS_KEY": "bench"})
            url = f"http://127.0.0.1:{port}"
            wait_answering(url + "/healthz", proc, log)
            self.replicas.append(url)


async def per_artifact(cluster: Cluster, ids: dict[str, bytes], requests: int
                       ) -> dict[str, Any]:
    before = upstream_requests(cluster.upstream)
    rng = random.Random(13)
    asks = [(rng.choice(cluster.replicas), bid) for bid in ids for _ in range(requests)]
    rng.shuffle(asks)
    limit = asyncio.Semaphore(64)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(base: str, bid: str) -> bool:
            async with limit:
                _, _, body = await timed_get(s, f"{base}/buildid/{bid}/debuginfo",
                                             len(ids[bid]))
                return body == ids[bid]

        right = await asyncio.gather(*(one(base, bid) for base, bid in asks))
    asked = upstream_requests(cluster.upstream) - before
    return {"artifacts": len(ids), "requests": len(asks), "wrong_bodies": right.count(False),
            "upstream_requests": asked, "upstream_requests_per_artifact": asked / len(ids)}


async def first_bytes(cluster: Cluster, ids: dict[str, bytes]) -> dict[str, Any]:
    a, b = cluster.replicas[0], cluster.replicas[1]
    rows: dict[str, list[tuple[float, float]]] = {
        "upstream fetch (A, cold)": [], "upstream itself": [], "bucket hit (B)": [],
        "bucket itself": [], "local hit (A)": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for bid, data in ids.items():
            path = f"/buildid/{bid}/debuginfo"
            before = await uploads(s, a)
            for name, url in (("upstream fetch (A, cold)", a + path),
                              ("upstream itself", cluster.upstream + path)):
                first, total, body = await timed_get(s, url, len(data))
                if body != data:
                    raise BenchError(f"{url}: wrong body")
                rows[name].append((first, total))
            await wait_published(s, a, before)
            # The object as the bucket serves it (moto takes unsigned requests).
            key = hashlib.sha256(f"{bid}/debuginfo".encode()).hexdigest()
            bucket = f"{cluster.s3}/{BUCKET}/bench/debuginfo/{key}"
            for name, url in (("bucket hit (B)", b + path), ("bucket itself", bucket),
                              ("local hit (A)", a + path)):
                first, total, body = await timed_get(s, url, len(data))
                if body != data:
                    raise BenchError(f"{url}: wrong body")
                rows[name].append((first, total))
    return {name: {"first_byte_ms": statistics.median(f for f, _ in v) * 1000,
                   "total_ms": statistics.median(t for _, t in v) * 1000, "rounds": len(v)}
            for name, v in rows.items()}


async def uploads(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """What replica `base` has written to the bucket, by kind (its metrics)."""
    async with s.get(base + "/metrics") as r:
        return {kind: float(line.split()[-1]) for line in (await r.text()).splitlines()
                for kind in ("debuginfo", "symtab")
                if line.startswith(f'symgate_bucket_uploads_total{{kind="{kind}"}}')}


async def wait_published(s: aiohttp.ClientSession, base: str, before: dict[str, float]
                         ) -> None:
    """Until replica `base` has written one more debug file and symbol table to the bucket
    than `before`: the bucket hit is then timed on a quiet replica, with the copy there."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = await uploads(s, base)
        if all(done.get(kind, 0) > before.get(kind, 0) for kind in ("debuginfo", "symtab")):
            return
        await asyncio.sleep(0.05)
    raise BenchError(f"{base} did not publish its file and table to the bucket")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", type=int, default=30)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ports", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    loopback_only_environ()
    become_subreaper()
    stop_on_signals()
    work = Path(tempfile.mkdtemp(prefix="symgate-bucket-bench-"))
    procs = Procs()
    database = ""
    try:
        files = work / "files"
        files.mkdir()
        small = [build_program(work / "src", files, f"s{i}", 100 + i)
                 for i in range(args.artifacts)]
        big = [build_program(work / "src", files, f"b{i}", 300 + i)
               for i in range(args.rounds)]
        for elf in big:
            pad_to(elf.debug, LIBC_BYTES)
        cluster = Cluster(work, procs, Ports(args.ports))
        cluster.start_upstream(files, [e.build_id for e in small + big])
        cluster.start_bucket()
        database = asyncio.run(make_database())
        cluster.start_replicas(database, 3)
        spread = asyncio.run(per_artifact(
            cluster, {e.build_id: e.debug.read_bytes() for e in small}, args.requests))
        timing = asyncio.run(first_bytes(
            cluster, {e.build_id: e.debug.read_bytes() for e in big}))
        size = big[0].debug.stat().st_size
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        if database:
            asyncio.run(drop_database(database))
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{spread['requests']} requests for {spread['artifacts']} artifacts over 3 replicas:"
          f" {spread['upstream_requests']:.0f} upstream requests, "
          f"{spread['upstream_requests_per_artifact']:.2f} per artifact, "
          f"{spread['wrong_bodies']} wrong bodies")
    print(f"\n{size / MiB:.1f} MiB debug file, medians of {args.rounds} rounds:")
    print(f"  {'':28} {'first byte':>12} {'last byte':>12}")
    for name, row in timing.items():
        print(f"  {name:28} {row['first_byte_ms']:>9.1f} ms {row['total_ms']:>9.1f} ms")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "bucket.json").write_text(json.dumps({"spread": spread, "timing": timing,
                                                 "file_bytes": size}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
