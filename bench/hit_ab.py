"""A/B of the big hit: symgate from two (or more) source trees beside nginx, in one run, the
rounds interleaved, so that a change to the send path is judged against the tree before it
on the same machine at the same moment (runs minutes apart differ by 10%).

  git archive HEAD~1 | tar -x -C /tmp/before
  python bench/hit_ab.py /tmp/before . [--workers 1] [--rounds 8] [--ports 19800-19899]

Each tree's symgate (default config, --workers N) caches libc's 4.2 MB debug file from one
elfutils debuginfod; nginx (N workers, sendfile on, tcp_nopush on) serves the same bytes.
Each round runs `wrk -t2 -c16` on every server in turn, starting with a different one each
round, and reads the CPU time of the server's process tree and of wrk. Prints per tree the
median rate, its ratio to nginx's, and the median server and wrk CPU per response (ms).
Exits 1 when it could not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hit_cpu
import proxy_bench as pb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", type=Path, help="symgate source trees to compare")
    ap.add_argument("--workers", type=int, default=1, help="symgate's and nginx's")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--ports", default=None, help="e.g. 19800-19899 (default: any free)")
    args = ap.parse_args()
    with hit_cpu.bench_world("symgate-hitab-", args.ports) as (work, world):
        path, size = hit_cpu.one_file(world, work, small=False)
        servers, names = [], []
        for tree in args.trees:
            pb.ROOT = tree.resolve()  # where World.symgate runs `python -m proxy.tools.cli`
            servers.append(world.symgate(args.workers))
            names.append(str(tree))
        servers.append(world.nginx(args.workers, work / "docs"))
        names.append(servers[-1].name)
        for srv in servers:
            for _ in range(2):  # the miss, then a hit: the file is hot from the first round
                pb.expect(srv.url + path, 200, size)
        pb.idle_servers({n: s for n, s in zip(names, servers, strict=True)})
        got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            turn = r % len(servers)
            for name, srv in [*zip(names, servers, strict=True)][turn:] + \
                    [*zip(names, servers, strict=True)][:turn]:
                assert srv.proc is not None
                got[name].append(hit_cpu.measure(srv.url + path, args.seconds, srv.proc.pid))
            print(f"round {r + 1}: " + ", ".join(f"{n} {got[n][-1]['rate']:,.0f}"
                                                 for n in names), flush=True)
        nginx = statistics.median(m["rate"] for m in got[names[-1]])
        print(f"\n{'server':<30} {'req/s':>7} {'vs nginx':>9} {'server ms':>10} {'wrk ms':>7}")
        for name in names:
            rate = statistics.median(m["rate"] for m in got[name])
            server = statistics.median(m["server_ms"] for m in got[name])
            client = statistics.median(m["wrk_user_ms"] + m["wrk_sys_ms"] for m in got[name])
            print(f"{name:<30} {rate:>7,.0f} {rate / nginx:>8.3f}x {server:>10.2f} "
                  f"{client:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
