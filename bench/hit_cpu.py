"""Where a hit's time goes: CPU per response of the server and of the client (wrk), symgate
beside nginx serving the same file, in one run.

  python bench/hit_cpu.py [--small] [--rounds 3] [--seconds 4] [--workers 1]
                          [--ports 19600-19699]

On 2 cores the server and wrk share the machine, so a response's cost to the client counts as
much as its cost to the server: rates follow the sum. One elfutils debuginfod serves libc's
debug file (with --small, proxy_bench's 17 KiB debug file) as the upstream; symgate (this
checkout, default config, --workers N) caches it; nginx (N workers, sendfile on, tcp_nopush
on) serves the same bytes. Each round runs `wrk -t2 -c16` on each server in turn and reads
the CPU time of the server's process tree (/proc) and of wrk (getrusage), split into user and
system time. Prints per response: server time, wrk time (user / system), in ms (with --small,
us), and the rate ratio against nginx. Exits 1 when it could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as pb
from procs import Ports, Procs, descendants


def tree_cpu_s(root: int) -> float:
    """User + system seconds of `root` and its descendants, every thread counted."""
    total = 0
    for pid in (root, *descendants(root)):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1]
                utime, stime = fields.split()[11:13]
                total += int(utime) + int(stime)
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total / os.sysconf("SC_CLK_TCK")


def measure(url: str, seconds: int, server_pid: int) -> dict[str, float]:
    before_server = tree_cpu_s(server_pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run(["wrk", "-t2", "-c16", f"-d{seconds}s", url], capture_output=True,
                         text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = tree_cpu_s(server_pid) - before_server
    m = re.search(r"Requests/sec:\s+([\d.]+)", run.stdout)
    if m is None:
        raise pb.BenchError(f"wrk on {url}: {run.stdout[-300:]}")
    rate = float(m.group(1))
    n = rate * seconds
    return {"rate": rate, "server_ms": 1000 * server / n,
            "wrk_user_ms": 1000 * (after.ru_utime - before.ru_utime) / n,
            "wrk_sys_ms": 1000 * (after.ru_stime - before.ru_stime) / n}


@contextlib.contextmanager
def bench_world(prefix: str, ports: str | None) -> Iterator[tuple[Path, pb.World]]:
    """A temp dir and the World of servers in it, torn down however the run ends; a run that
    cannot go on (a tool missing, a server that fails) says why and exits 1."""
    for tool in ("debuginfod", "nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} is needed: apt-get install debuginfod nginx-light wrk",
                  file=sys.stderr)
            raise SystemExit(1)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Procs()
    try:
        yield work, pb.World(work, procs, Ports(ports), os.cpu_count() or 1, True)
    except (pb.BenchError, subprocess.CalledProcessError, OSError) as e:
        print(f"could not run: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        procs.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def one_file(world: pb.World, work: Path, *, small: bool) -> tuple[str, int]:
    """libc's debug file (or, `small`, a 17 KiB one) served by the upstream debuginfod and,
    under `work`/docs, by nginx: its path on both, and its size."""
    files = work / "files"
    files.mkdir()
    if small:
        program = pb.build_program(work / "src", files, "small", 21)
        pb.pad_to(program.debug, pb.SMALL_BYTES)
        build_id, served = program.build_id, program.debug
    else:
        build_id, served = pb.LIBC_ID, files / "libc.debug"
        shutil.copy(pb.LIBC_DEBUG, served)
    docs = work / "docs" / "buildid" / build_id
    docs.mkdir(parents=True)
    os.link(served, docs / "debuginfo")
    world.upstream_server(files, [build_id])
    return f"/buildid/{build_id}/debuginfo", served.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="symgate's and nginx's")
    ap.add_argument("--ports", default=None, help="e.g. 19600-19699 (default: any free)")
    ap.add_argument("--small", action="store_true",
                    help="the 17 KiB hit instead of libc's 4.2 MB debug file")
    args = ap.parse_args()
    with bench_world("symgate-hitcpu-", args.ports) as (work, world):
        path, size = one_file(world, work, small=args.small)
        servers = [world.symgate(args.workers), world.nginx(args.workers, work / "docs")]
        for srv in servers:
            pb.expect(srv.url + path, 200, size)
        # What the first fetch set off (symgate builds libc's symbol table) is over.
        pb.idle_servers({s.name: s for s in servers})
        # A small hit costs microseconds.
        unit, scale = ("us", 1000.0) if args.small else ("ms", 1.0)
        print(f"{'round':<6} {'server':<11} {'req/s':>7} {'server ' + unit:>10} "
              f"{'wrk ' + unit + ' (user/sys)':>20} {'vs nginx':>9}")
        for r in range(args.rounds):
            got = {}
            for srv in servers if r % 2 == 0 else servers[::-1]:
                assert srv.proc is not None
                got[srv.name] = measure(srv.url + path, args.seconds, srv.proc.pid)
            nginx_rate = got[servers[1].name]["rate"]
            for name, m in got.items():
                user, system = m["wrk_user_ms"] * scale, m["wrk_sys_ms"] * scale
                print(f"{r + 1:<6} {name:<11} {m['rate']:>7,.0f} "
                      f"{m['server_ms'] * scale:>10.2f} {user + system:>7.2f} "
                      f"({user:.2f}/{system:.2f}) {m['rate'] / nginx_rate:>8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
