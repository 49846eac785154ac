"""Memory of an idle `symgate serve` process tree, and what its worker processes cost a profile.

  python bench/memory.py [--checkout PATH] [--port N] [--repeat 3] [--idle-s 5]
                         [--serve-workers N]

Runs `symgate serve` from a checkout (this script's own by default; `--checkout /work/main`
measures another, for a before/after) with libc's debug file (Debian's libc6-dbg) in a local
debug tree (`--serve-workers N` serving processes where the checkout has `serve --workers`),
and sums the Pss of the server and all its descendants (/proc/<pid>/smaps_rollup:
shared pages counted once across the tree, so the sum is what the tree costs the machine):

  1. idle: once /healthz answers and `--settle-s` seconds have passed;
  2. after one cold /symbolize of N libc addresses (its table built, the workers up);
  3. after `symbolize.worker_idle_s` (`--idle-s`) with no work, when the workers have exited
     (skipped for a checkout without that key).

It also times a cold /symbolize sent the moment /healthz answers (on a fresh server of its
own), one sent after the settle time, the warm repeat, and the first one after the idle exit.
Medians over `--repeat` fresh servers; per-process figures of the last run.
"""

from __future__ import annotations

import argparse
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
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBC_ID = "93ac61ec5a8eb1396f9fbd350e3169a558528a40"
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
BASE = 0x7F0000000000


@dataclass(frozen=True)
class Tree:
    """Pss and role of every process of a server's tree, in KiB."""

    processes: dict[int, tuple[str, int]]

    @property
    def pss_kib(self) -> int:
        return sum(kib for _role, kib in self.processes.values())

    def describe(self) -> str:
        by_role: dict[str, list[int]] = {}
        for role, kib in self.processes.values():
            by_role.setdefault(role, []).append(kib)
        return ", ".join(f"{role} " + "+".join(f"{k / 1024:.0f}" for k in kibs)
                         for role, kibs in sorted(by_role.items()))


def _stat(pid: int) -> tuple[int, str]:
    """(parent pid, state) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid, state = _stat(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state not in ("Z", "X"):
                parents[int(entry)] = ppid
    found: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        found += sorted(frontier)
    return found


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for {pid}")


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _role(pid: int, root: int, parents: dict[int, int]) -> str:
    """server (one serving process), supervisor and server (`serve --workers N`), forkserver,
    worker (a fork of the forkserver), resource-tracker."""
    if pid == root:
        return "server"
    cmdline = _cmdline(pid)
    if "resource_tracker" in cmdline:
        return "resource-tracker"
    if "forkserver" in cmdline:
        parent = parents.get(pid, 0)
        return "worker" if parent != root and "forkserver" in _cmdline(parent) else "forkserver"
    if "spawn_main" in cmdline:
        return "server"
    return "child"


def measure(root: int) -> Tree:
    processes: dict[int, tuple[str, int]] = {}
    pids = [root, *_descendants(root)]
    parents = {}
    for pid in pids:
        try:
            parents[pid] = _stat(pid)[0]
        except FileNotFoundError:
            continue
    for pid in parents:
        try:
            processes[pid] = (_role(pid, root, parents), _pss_kib(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while being measured
    if any(role == "server" for pid, (role, _) in processes.items() if pid != root):
        processes[root] = ("supervisor", processes[root][1])
    return Tree(processes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile(n: int) -> bytes:
    sys.path.insert(0, str(ROOT))
    from symbolize.elf import layout_of_file
    from symbolize.pprof.profile_pb2 import Profile

    layout = layout_of_file(LIBC)
    assert layout is not None
    text = next(s for s in layout.segments if s.executable)
    p = Profile()
    p.string_table.extend(["", str(LIBC), LIBC_ID, "cpu", "nanoseconds"])
    p.sample_type.add(type=3, unit=4)
    p.mapping.add(id=1, memory_start=BASE + text.vaddr, memory_limit=BASE + text.vaddr
                  + text.memsz, file_offset=text.offset, filename=1, build_id=2)
    rng = random.Random(n)
    for i, v in enumerate(rng.sample(range(text.vaddr, text.vaddr + text.filesz), n), start=1):
        p.location.add(id=i, mapping_id=1, address=BASE + v)
        p.sample.add(location_id=[i], value=[1])
    return p.SerializeToString()


def post(url: str, body: bytes) -> float:
    req = urllib.request.Request(url + "/symbolize", data=body, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            symbolized = r.headers["X-Symgate-Mappings-Symbolized"]
    except urllib.error.HTTPError as e:
        raise SystemExit(f"symgate answered {e.code}: {e.read().decode()}") from e
    elapsed = time.perf_counter() - started
    if symbolized != "1":
        raise SystemExit(f"libc was not symbolized: {symbolized}")
    return elapsed


def has_idle_key(checkout: Path) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", "from proxy.config import SymbolizeConfig as C; "
         "print('worker_idle_s' in C.__dataclass_fields__)"],
        env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout, capture_output=True,
        text=True, check=True)
    return out.stdout.strip() == "True"


def has_serve_workers(checkout: Path) -> bool:
    out = subprocess.run([sys.executable, "-m", "proxy.tools.cli", "serve", "--help"],
                         env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout,
                         capture_output=True, text=True, check=True)
    return "--workers" in out.stdout


class Server:
    def __init__(self, checkout: Path, port: int, idle_s: float | None,
                 serve_workers: int | None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="symgate-membench-"))
        tree = self.work / "debug" / ".build-id" / LIBC_ID[:2]
        tree.mkdir(parents=True)
        (tree / (LIBC_ID[2:] + ".debug")).symlink_to(LIBC_DEBUG)
        (tree / LIBC_ID[2:]).symlink_to(LIBC)
        idle = f"worker_idle_s = {idle_s}\n" if idle_s is not None else ""
        (self.work / "symgate.toml").write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{self.work / "data"}"\n'
            f'access_log = false\n[symbolize]\ndebug_dirs = ["{self.work / "debug"}"]\n{idle}'
            f'[[upstreams]]\nurl = "http://127.0.0.1:9/"\n')
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.tools.cli", "serve", "--config",
             str(self.work / "symgate.toml"),
             *(["--workers", str(serve_workers)] if serve_workers else [])], cwd=checkout,
            stdout=(self.work / "log").open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(checkout)})
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        for _ in range(600):
            try:
                urllib.request.urlopen(self.url + "/healthz", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise SystemExit("symgate did not come up")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def _wait_for_exit(root: int, timeout_s: float) -> None:
    """Until only the serving processes are left, or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            role not in ("server", "supervisor") for role, _ in measure(root).processes.values()):
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkout", type=Path, default=ROOT, help="whose symgate to run")
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--addresses", type=int, default=1000)
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="wait after /healthz before the idle figure (eager workers start)")
    ap.add_argument("--idle-s", type=float, default=5.0,
                    help="symbolize.worker_idle_s for the idle-exit figure")
    ap.add_argument("--serve-workers", type=int, default=None,
                    help="serving processes (serve --workers N), where the checkout has them; "
                         "default: the server's own (one per core)")
    args = ap.parse_args()
    if not LIBC_DEBUG.exists():
        sys.exit("needs Debian's libc6-dbg")
    checkout = args.checkout.resolve()
    idle_s = args.idle_s if has_idle_key(checkout) else None
    serve_workers = args.serve_workers if has_serve_workers(checkout) else None
    body = profile(args.addresses)
    figures: dict[str, list[float]] = {}
    trees: dict[str, Tree] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    def snapshot(name: str, root: int) -> None:
        tree = measure(root)
        trees[name] = tree
        note(f"pss {name} (MiB)", tree.pss_kib / 1024)
        note(f"processes {name}", len(tree.processes))

    for _ in range(args.repeat):
        port = args.port or free_port()
        # A profile the moment /healthz answers: what a client that starts with the server sees.
        first = Server(checkout, port, idle_s, serve_workers)
        try:
            note("first /symbolize at /healthz (s)", post(first.url, body))
        finally:
            first.stop()
        server = Server(checkout, port, idle_s, serve_workers)
        try:
            time.sleep(args.settle_s)
            snapshot("idle", server.proc.pid)
            note("cold /symbolize after settling (s)", post(server.url, body))
            snapshot("after a cold /symbolize", server.proc.pid)
            note("warm /symbolize (s)", post(server.url, body))
            if idle_s:  # 0: the workers stay
                _wait_for_exit(server.proc.pid, idle_s + 30)
                snapshot("after idle exit", server.proc.pid)
                note("/symbolize after idle exit (s)", post(server.url, body))
        finally:
            server.stop()
    print(f"checkout {checkout}, {args.addresses} libc addresses, medians of {args.repeat} "
          f"fresh servers" + (f", worker_idle_s {idle_s:g}" if idle_s is not None else "")
          + (f", serve --workers {serve_workers}" if serve_workers else ""))
    for name, values in figures.items():
        shown = " ".join(f"{v:.3f}" if "(s)" in name else f"{v:.0f}" for v in values)
        print(f"  {name:<38} {statistics.median(values):9.3f}   [{shown}]")
    print("per process, last run (Pss MiB):")
    for name, tree in trees.items():
        print(f"  {name:<26} {tree.describe()}")


if __name__ == "__main__":
    main()
