"""Hit throughput of nginx over three symgate replicas against nginx over one, on loopback.

  python bench/replicas_bench.py [--seconds 10] [--rounds 3] [--ids 64] [--workers 1]
                                 [--nginx-workers N] [--ports 21000-21499] [--keep]

Needs debuginfod nginx-light wrk gcc binutils, and PostgreSQL (SYMGATE_TEST_PG, else
postgresql://postgres@127.0.0.1:5432/postgres; a database of its own is made and dropped).

One elfutils debuginfod serves --ids debug files of 17 KiB, each with a build ID of its own.
Three `symgate serve` replicas of this checkout (`python -m proxy.tools.cli serve`, PYTHONPATH
= this tree, default config but for the port, data dir and database: access log on) share the
database, each with its own data dir and --workers serving processes. In front of them, nginx
with deploy/nginx/symgate.conf as shipped (tests/front.py puts in only the addresses, port and
log directory): once over all three replicas, once over the first replica only. Every file is
fetched once through each nginx first, so what is measured is hits only, spread over all the
build IDs: wrk -t2 -c16, each connection walking the list of IDs, against
  * nginx over 3 replicas,
  * nginx over 1 replica (the same config, one server line),
  * that one replica directly.
Medians of --rounds rounds, the order rotated each round. Prints req/s and the ratios; exits 0
when it measured, 1 when it could not run, 130 when interrupted. Every process it started is
killed at exit, the database dropped and the temp dir removed (unless --keep).

On one machine the replicas, nginx and wrk share the cores: three replicas can only beat one
where there are cores to spare for them (and the ratio says what nginx costs besides).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from procs import Ports, Procs, become_subreaper, loopback_only_environ, stop_on_signals  # noqa: E402
from proxy_bench import SMALL_BYTES, BenchError, pad_to, wait_answering  # noqa: E402

from symbolize.elf import build_id_of_file  # noqa: E402
from tests.elfs import build_program  # noqa: E402
from tests.front import front_config, nginx_binary  # noqa: E402

PG_ADMIN_DSN = os.environ.get("SYMGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REPLICAS = 3


def debug_files(work: Path, count: int) -> tuple[Path, list[str]]:
    """`count` 17 KiB debug files that differ only in their build ID: one gcc build, its
    build-ID note rewritten in each copy (gcc for each would take minutes)."""
    files = work / "files"
    files.mkdir()
    elf = build_program(work / "src", work, "small", 31)
    pad_to(elf.debug, SMALL_BYTES)
    data = elf.debug.read_bytes()
    old = bytes.fromhex(elf.build_id)
    if data.count(old) != 1:
        raise BenchError("the build ID's bytes occur more than once in the debug file")
    ids = []
    for i in range(count):
        new = hashlib.sha1(f"symgate-replicas-bench-{i}".encode()).digest()[:len(old)]
        path = files / f"{i:04d}.debug"
        path.write_bytes(data.replace(old, new))
        if build_id_of_file(path) != new.hex():
            raise BenchError(f"{path}: its build ID did not become {new.hex()}")
        ids.append(new.hex())
    return files, ids


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        if r.status != 200:
            raise BenchError(f"GET {url}: {r.status}")
        return bytes(r.read())


def wrk_script(work: Path, ids: list[str]) -> Path:
    """Each request the next build ID, each wrk thread from its own place in the list."""
    paths = ",\n".join(f'  "/buildid/{i}/debuginfo"' for i in ids)
    script = work / "ids.lua"
    script.write_text(f"""local paths = {{
{paths}
}}
local threads = 0
function setup(thread)
  thread:set("n", threads * 7919)
  threads = threads + 1
end
function request()
  n = n + 1
  return wrk.format("GET", paths[(n % #paths) + 1])
end
""")
    return script


def wrk(url: str, script: Path, seconds: int) -> float:
    run = subprocess.run(["wrk", "-t2", "-c16", f"-d{seconds}s", "-s", str(script), url],
                         capture_output=True, text=True)
    out = run.stdout
    rate = next((float(line.split()[1]) for line in out.splitlines()
                 if line.startswith("Requests/sec:")), None)
    if run.returncode or rate is None:
        raise BenchError(f"wrk on {url} failed ({run.returncode}): "
                         f"{(run.stderr or out).strip()[-300:]}")
    bad = [line.strip() for line in out.splitlines()
           if line.strip().startswith(("Non-2xx", "Socket errors"))]
    if bad:
        raise BenchError(f"wrk on {url}: {'; '.join(bad)}")
    return rate


def run(args: argparse.Namespace, work: Path, procs: Procs, database: str) -> dict[str, float]:
    ports = Ports(args.ports)
    files, ids = debug_files(work, args.ids)
    size = (files / "0000.debug").stat().st_size
    print(f"{len(ids)} debug files of {size} bytes", flush=True)

    port = ports.take()
    upstream = f"http://127.0.0.1:{port}"
    log = work / "upstream.log"
    proc = procs.start(["debuginfod", "-p", str(port), "-d", str(work / "upstream.sqlite"),
                        "-F", str(files), "-t", "0", "-g", "0"], log)
    for build_id in ids:  # answers once it has indexed them all
        wait_answering(f"{upstream}/buildid/{build_id}/debuginfo", proc, log)

    replicas: list[str] = []
    for i in range(REPLICAS):
        # One after another: the first makes the schema (migrations take no lock).
        port = ports.take()
        data = work / f"replica{i}"
        cfg = work / f"replica{i}.toml"
        cfg.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{data}"\n'
                       f'[database]\nurl = "{database}"\n[[upstreams]]\nurl = "{upstream}"\n')
        log = work / f"replica{i}.log"
        proc = procs.start(
            [sys.executable, "-m", "proxy.tools.cli", "serve", "--config", str(cfg),
             "--workers", str(args.workers)], log, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        replicas.append(f"http://127.0.0.1:{port}")
        wait_answering(replicas[-1] + "/healthz", proc, log)

    nginx = nginx_binary()
    assert nginx is not None
    fronts: dict[str, str] = {}
    for name, over in ((f"nginx over {REPLICAS}", replicas), ("nginx over 1", replicas[:1])):
        port = ports.take()
        prefix = work / name.replace(" ", "-")
        conf = front_config(prefix, port, [r.removeprefix("http://") for r in over],
                            workers=args.nginx_workers)
        proc = procs.start([nginx, "-p", str(prefix), "-c", str(conf)], prefix / "stdout.log")
        fronts[name] = f"http://127.0.0.1:{port}"
        wait_answering(fronts[name] + "/healthz", proc, prefix / "logs" / "error.log")
        # Warm: each build ID fetched once through this nginx, onto the replica it hashes to
        # (over one: the first replica gets them all), and checked.
        for build_id in ids:
            if len(get(f"{fronts[name]}/buildid/{build_id}/debuginfo")) != size:
                raise BenchError(f"{name}: {build_id} came back short")
    targets = {**fronts, "1 replica direct": replicas[0]}

    script = wrk_script(work, ids)
    rates: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rates[name].append(wrk(targets[name], script, args.seconds))
            print(f"  round {r + 1}: {name}: {rates[name][-1]:,.0f} req/s", flush=True)
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10, help="length of each wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--ids", type=int, default=64, help="build IDs the hits spread over")
    ap.add_argument("--workers", type=int, default=1,
                    help="serving processes per replica (symgate serve --workers)")
    ap.add_argument("--nginx-workers", type=int, default=os.cpu_count() or 1,
                    help="nginx worker processes (default: one per core)")
    ap.add_argument("--ports", help="listen on ports of this range, e.g. 21000-21499 "
                    "(default: any free ones)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    args = ap.parse_args()
    for tool in ("debuginfod", "wrk", "gcc", "objcopy"):
        if not shutil.which(tool):
            print(f"{tool} is needed: apt-get install debuginfod nginx-light wrk gcc binutils",
                  file=sys.stderr)
            return 1
    if nginx_binary() is None:
        print("nginx is needed: apt-get install nginx-light", file=sys.stderr)
        return 1

    loopback_only_environ()
    become_subreaper()

    stop_on_signals()
    name = f"symgate_bench_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    except Exception as e:  # any failure to reach it: this bench cannot run
        print(f"PostgreSQL is needed ({PG_ADMIN_DSN}): {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    database = (PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
                + f"/{name}")
    work = Path(tempfile.mkdtemp(prefix="symgate-replicas-bench-"))
    procs = Procs()
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        rates = run(args, work, procs, database)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BenchError, subprocess.CalledProcessError, OSError) as e:
        print(f"could not run: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if killed := procs.cleanup():
            print(f"cleanup killed {killed} leftover processes", file=sys.stderr)
        try:
            asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        except Exception as e:  # said, not raised: the figures (or the first error) matter more
            print(f"could not drop database {name}: {e}", file=sys.stderr)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    three, one = rates[f"nginx over {REPLICAS}"], rates["nginx over 1"]
    direct = rates["1 replica direct"]
    print(f"\nHits of {SMALL_BYTES // 1024} KiB over {args.ids} build IDs, wrk -t2 -c16 "
          f"-d{args.seconds}s, median of {args.rounds}; {os.cpu_count()} cores, "
          f"{args.workers} worker(s) a replica, {args.nginx_workers} nginx worker(s), "
          f"load {load:.1f} -> {os.getloadavg()[0]:.1f}, {time.monotonic() - t0:.0f} s")
    for label, rate in rates.items():
        print(f"  {label:<18} {rate:>10,.0f} req/s")
    print(f"  nginx over {REPLICAS} / nginx over 1: {three / one:.2f}x")
    print(f"  nginx over 1 / 1 replica direct: {one / direct:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
