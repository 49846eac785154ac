"""Processes and ports for the benchmarks: everything started is tracked, and killed by pid,
with its descendants, however the run ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "debuginfod_urls"}


def loopback_only_environ() -> None:
    """Drops proxy variables from this process (urllib, libcurl in debuginfod and symgate
    honour them), so that every request stays on loopback; children inherit the result."""
    for k in list(os.environ):
        if k.lower() in _PROXY_VARS:
            del os.environ[k]
    os.environ["NO_PROXY"] = "*"


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, so that a bench's cleanup (its processes,
    its temp dir) runs. SIGINT too: a shell starts background jobs with it ignored, and Python
    then leaves it so."""
    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)


def become_subreaper() -> None:
    # Orphans of the servers we stop (their workers) are re-parented to us, so we can end them.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a live process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text.rsplit(")", 1)[1].split()
    return int(rest[1]), rest[0], int(rest[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (st := proc_stat(int(entry.name))) and st[1] != "Z":
            children.setdefault(st[0], []).append(int(entry.name))
            starts[int(entry.name)] = st[2]
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = starts[c]
                todo.append(c)
    return out


def kill_alive(snapshot: dict[int, int]) -> int:
    """SIGKILLs the processes of `snapshot` still alive (same pid *and* start time, so a
    recycled pid is left alone) and reaps them and those that had exited; returns how many
    had to be killed."""
    alive = [pid for pid, start in snapshot.items()
             if (st := proc_stat(pid)) is not None and st[1] != "Z" and st[2] == start]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in snapshot:
        for _ in range(50):
            # Orphans re-parented to this subreaper stay zombies until reaped here.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            st = proc_stat(pid)
            if st is None or st[2] != snapshot[pid] or (st[1] == "Z" and st[0] != os.getpid()):
                break
            time.sleep(0.02)
    return len(alive)


def _status_kib(pid: int, field: str, path: str = "status") -> int:
    try:
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS:")


def hwm_kib(pid: int) -> int:
    return _status_kib(pid, "VmHWM:")


def tree_pss_kib(pid: int) -> int:
    """Pss of `pid` and all its descendants: forked workers share pages with their parent,
    and VmRSS would count those once per process."""
    def pss(p: int) -> int:
        return _status_kib(p, "Pss:", "smaps_rollup") or rss_kib(p)
    return pss(pid) + sum(pss(p) for p in descendants(pid))


def cpu_s(pid: int) -> float:
    """CPU seconds `pid` has used, and those of its children it has reaped; 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name.
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (and what those reaped)."""
    return cpu_s(pid) + sum(cpu_s(p) for p in descendants(pid))


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL after `grace_s`; then whatever it started that is still alive."""
        tree = descendants(p.pid)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        kill_alive(tree)
        with contextlib.suppress(ValueError):
            self.procs.remove(p)

    def cleanup(self) -> int:
        """Stops everything started here and its descendants; returns how many processes had
        to be killed after their parent was gone."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        self.procs.clear()
        # Being a subreaper, every orphan of what we started is our descendant.
        return kill_alive(descendants(os.getpid()))


def listening_sockets(port: int) -> int:
    """Sockets in LISTEN state on `port` (IPv4 and IPv6): with SO_REUSEPORT each serving
    process has its own, so this counts the processes ready to accept."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


class Ports:
    """Ports to listen on: the next free one of `spec` ("LO-HI"), or any the kernel picks."""

    def __init__(self, spec: str | None) -> None:
        self.range: list[int] = []
        if spec:
            lo, hi = (int(x) for x in spec.split("-"))
            self.range = list(range(lo, hi + 1))

    def take(self) -> int:
        if not self.range:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])
        while self.range:
            port = self.range.pop(0)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise RuntimeError("no free port left in the --ports range")
