"""Real processes the tests drive: elfutils' debuginfod-find, symgate's own commands, and
`symgate serve` started and waited for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp

# Starts a `symgate serve` (upstream URL, workers=, extra= more config; tests/conftest.py's
# `serve` fixture): its base URL and process.
Start = Callable[..., Awaitable[tuple[str, asyncio.subprocess.Process]]]


def debuginfod_find(server: str, cache: Path, *args: str, ua_timeout: int = 20
                    ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBUGINFOD_URLS": server, "DEBUGINFOD_CACHE_PATH": str(cache),
           "DEBUGINFOD_TIMEOUT": str(ua_timeout)}
    return subprocess.run(["debuginfod-find", *args], env=env, capture_output=True, text=True,
                          timeout=60)


async def run_in_thread(cmd: list[str], *, timeout: float = 120,
                        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to its end without blocking the event loop, so that a symgate serving in
    this process can answer it."""
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                   env=env, timeout=timeout)


async def wait_until_serving(base_url: str, proc: asyncio.subprocess.Process,
                             log: Path | None = None) -> None:
    """Return once `base_url`/healthz answers 200; if `proc` exits first or 30 s pass, kill it
    and fail with what it printed: its stdout (a pipe), or the tail of `log`."""
    deadline = asyncio.get_running_loop().time() + 30
    async with aiohttp.ClientSession() as s:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with s.get(base_url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if proc.returncode is not None:
                break
            # Often: a refused connection costs nothing, and the suite starts hundreds.
            await asyncio.sleep(0.02)
    if proc.returncode is None:
        proc.kill()
    if log is not None:
        said = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    else:
        said = (await proc.stdout.read() if proc.stdout else b"").decode(errors="replace")
    raise AssertionError(f"the server did not come up: {said}")


async def start_serve(tmp_path: Path, data_dir: Path, database_url: str, upstream: str, *,
                      workers: int = 1, extra: str = "", access_log: bool = False
                      ) -> tuple[str, asyncio.subprocess.Process]:
    """`symgate serve --workers N` on a free port, its output in a pipe, once one of its
    workers serves; (base URL, process). The caller stops it (stop_serve)."""
    base, proc = await spawn_serve(tmp_path, data_dir, database_url, upstream,
                                   workers=workers, extra=extra, access_log=access_log)
    await wait_until_serving(base, proc)
    return base, proc


async def spawn_serve(tmp_path: Path, data_dir: Path, database_url: str, upstream: str, *,
                      workers: int = 1, extra: str = "", access_log: bool = False
                      ) -> tuple[str, asyncio.subprocess.Process]:
    """start_serve without the wait: the process may not serve yet."""
    from tests.harness import free_port

    port = free_port()
    config = tmp_path / f"symgate-{port}.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{data_dir}"\n'
        f'access_log = {str(access_log).lower()}\n{extra}[database]\nurl = "{database_url}"\n'
        f'[[upstreams]]\nurl = "{upstream}"\nbreaker_failures = 0\n'
        'failed_file_rest_s = 0\n')
    proc = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--config", str(config), "--workers", str(workers),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HOME": str(tmp_path)})
    return f"http://127.0.0.1:{port}", proc


async def stop_serve(procs: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM, then SIGKILL past 30 s; reaped before the caller's loop closes."""
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for a parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _parents() -> dict[int, int]:
    """Every process's parent, by pid."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    return parents


def children(root: int) -> set[int]:
    return {pid for pid, ppid in _parents().items() if ppid == root}


def descendants(root: int) -> set[int]:
    parents = _parents()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def descriptors_on(pids: set[int], path: Path) -> int:
    """Descriptors these processes hold on `path`."""
    count = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    count += os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
    return count


def niceness(pid: int) -> int | None:
    """Its nice value; None once it has exited (a short-lived child: the supervisor's
    migration fork lives for a moment at start)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except (FileNotFoundError, ProcessLookupError):
        return None


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """The processes frozen (SIGSTOP) for the block: what they were given waits."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def reap_all(pids: set[int], what: str) -> None:
    """Wait up to 10 s for `pids` to be gone; kill what is left (no orphans of a failed run
    either) and fail naming it."""
    left = pids
    for _ in range(100):
        left = {pid for pid in pids if alive(pid)}
        if not left:
            return
        await asyncio.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"still running after {what} was killed: {sorted(left)}")
