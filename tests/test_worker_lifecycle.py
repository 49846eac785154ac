"""Worker processes start with the server, and with the first job that needs one after they
exited, and exit after `symbolize.worker_idle_s` without a job. A lone `symgate serve` starts
multiprocessing's forkserver and resource tracker with them and stops them with them: when not
symbolizing it is one process. With `--workers N` the supervisor forks one forkserver and one
tracker for all serving processes before it forks them (proxy.symbols.forked_helpers): they
stay, sharing the supervisor's memory, and a worker is a fork away. Workers run at nice 5."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.elfs import ElfSet
from tests.harness import Debuginfod, eventually
from tests.processes import descendants, niceness, start_serve, stop_serve
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES


async def _symbolized(base: str, body: bytes) -> str:
    async with aiohttp.ClientSession() as s, s.post(
            base + "/symbolize", data=body,
            headers={"Content-Type": "application/octet-stream"}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Symgate-Mappings-Symbolized"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("serving", [1, 2])
async def test_workers_start_with_the_first_job_and_exit_with_their_helpers_when_idle(
    tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet, serving: int
) -> None:
    base, proc = await start_serve(
        tmp_path, tmp_path / "d", f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}",
        debuginfod.url, workers=serving,
        extra="[symbolize]\nbuild_workers = 1\nworkers = 1\nworker_idle_s = 1\n")
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()

    async def serving_alone() -> bool:
        return len(descendants(proc.pid)) == (0 if serving == 1 else serving + 2)

    async def a_worker() -> bool:
        return any(niceness(pid) == 5 for pid in descendants(proc.pid))

    try:
        # Alone, a worker started with the server (the first profile must not wait for the
        # forkserver's imports), and exited without a job, with its helpers. Supervised, a
        # worker is a fork of the shared forkserver away: none starts before a job, and the
        # forkserver and resource tracker stay, the supervisor's children.
        if serving == 1:
            await eventually(a_worker)
        await eventually(serving_alone)
        at_start = descendants(proc.pid)

        async def idle() -> bool:
            return descendants(proc.pid) == at_start

        assert all(niceness(pid) == 0 for pid in at_start)
        assert len({pid for pid in at_start if _parent(pid) == proc.pid}) == (
            0 if serving == 1 else serving + 2)
        assert len(at_start) == (0 if serving == 1 else serving + 2)
        assert await _symbolized(base, body) == "1"
        helpers = descendants(proc.pid) - at_start
        # Workers are the forkserver's forks, told apart by their parent: one may have been
        # forked for the job that another took, and not be reniced yet (its start-up).
        forks = {pid for pid in helpers if _parent(pid) != proc.pid}
        # A worker that built a table keeps a builder child (isolated_build.py), its fork.
        builders = {pid for pid in forks if _parent(pid) in forks}
        workers = forks - builders
        # The workers that built and rewrote (one pool of build_workers + workers, 2) and the
        # one that checked the samples (a pool of `workers`, 1); alone, with the forkserver
        # and tracker started for them.
        assert workers and len(workers) <= 3, helpers
        assert any(niceness(pid) == 5 for pid in workers), helpers
        assert len(helpers - forks) == (2 if serving == 1 else 0), helpers
        if serving == 1:  # named as the supervisor's are (the tracker runs no code of ours)
            assert "symgate-forksrv" in {_comm(pid) for pid in helpers - forks}, helpers
        await eventually(idle)
        assert await _symbolized(base, body) == "1"
        again = descendants(proc.pid) - at_start
        assert again and again.isdisjoint(helpers), (helpers, again)
        assert any(niceness(pid) == 5 for pid in again)
        await eventually(idle)
    finally:
        await stop_serve([proc])
    assert proc.stdout is not None
    out = await proc.stdout.read()
    assert b"Traceback" not in out, out.decode()


@pytest.mark.parametrize("idle_s", [30, 0])
async def test_a_worker_starts_with_the_server(
    tmp_path: Path, debuginfod: Debuginfod, idle_s: int
) -> None:
    """Issue 14 (5): the first /symbolize after a start waited 3-4.7 s for the workers, while
    /healthz said ok. One starts with the server now, before any request, whether workers
    exit when idle or (worker_idle_s = 0) are kept for good."""
    _base, proc = await start_serve(
        tmp_path, tmp_path / "d", f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}",
        debuginfod.url, extra=f"[symbolize]\nworker_idle_s = {idle_s}\n")

    async def a_worker() -> bool:
        return any(niceness(pid) == 5 for pid in descendants(proc.pid))

    try:
        await eventually(a_worker)  # with no request at all
    finally:
        await stop_serve([proc])


async def test_without_a_worker_at_start_the_first_profile_starts_one(
    tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """worker_at_start = false: a server used as a proxy alone is one process from its start
    (no forkserver, no worker), and its first profile starts
    the workers it needs."""
    base, proc = await start_serve(
        tmp_path, tmp_path / "d", f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}",
        debuginfod.url, extra="[symbolize]\nworker_at_start = false\n")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(10):  # as long as a worker started with the server takes to show
                async with s.get(f"{base}/healthz") as r:
                    assert r.status == 200
                assert not descendants(proc.pid)
                await asyncio.sleep(0.1)
        body = make_profile([(place(elfs.prog, BASES["prog"]),
                              code_addresses(elfs.prog)[:5])]).SerializeToString()
        assert await _symbolized(base, body) == "1"
        assert any(niceness(pid) == 5 for pid in descendants(proc.pid))
    finally:
        await stop_serve([proc])


def _named(root: int, name: str) -> set[int]:
    """The supervisor's children of that name (its forks' workers are named anew)."""
    found = set()
    for pid in descendants(root):
        try:
            if _parent(pid) != root:
                continue
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.add(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


async def test_serving_processes_share_the_supervisors_forkserver_and_survive_its_death(
    tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    base, proc = await start_serve(
        tmp_path, tmp_path / "d", f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}",
        debuginfod.url, workers=2, extra="[symbolize]\nworker_idle_s = 30\n")
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()
    try:
        forkservers = _named(proc.pid, "symgate-forksrv")
        assert len(forkservers) == 1 and len(_named(proc.pid, "symgate-tracker")) == 1
        (forkserver,) = forkservers

        # Profiles on new connections reach both serving processes (SO_REUSEPORT); every
        # worker any of them starts is a fork of the one forkserver.
        async def both_have_workers() -> bool:
            assert await _symbolized(base, body) == "1"
            niced = {pid for pid in descendants(proc.pid) if niceness(pid) == 5}
            # A worker that built a table keeps a builder child (isolated_build.py).
            builders = {pid for pid in niced if _parent(pid) in niced}
            workers = niced - builders
            assert all(_parent(pid) == forkserver for pid in workers), workers
            assert all(Path(f"/proc/{pid}/comm").read_text().strip() == "symgate-worker"
                       for pid in workers)
            assert all(Path(f"/proc/{pid}/comm").read_text().strip() == "symgate-builder"
                       for pid in builders)
            return len(workers) >= 2

        await eventually(both_have_workers)
        assert _named(proc.pid, "symgate-forksrv") == {forkserver}

        # The forkserver killed: running workers go on; a serving process that needs another
        # worker starts its own forkserver, the usual way.
        os.kill(forkserver, signal.SIGKILL)
        for pid in {pid for pid in descendants(proc.pid) if niceness(pid) == 5}:
            os.kill(pid, signal.SIGKILL)  # its pool is then broken and replaced

        async def serves_again() -> bool:
            async with aiohttp.ClientSession() as s, s.post(
                    base + "/symbolize", data=body,
                    headers={"Content-Type": "application/octet-stream"}) as r:
                return r.status == 200

        for _ in range(4):
            await eventually(serves_again)
    finally:
        await stop_serve([proc])
    assert proc.stdout is not None
    out = await proc.stdout.read()
    assert b"Traceback" not in out, out.decode()


def test_what_every_serving_process_shares_leaves_the_migrations_out() -> None:
    """What `serve --workers N` imports before it forks, and so what every serving process
    shares or copies, leaves out alembic and what it brings (mako, pygments: ~12 MiB): the
    migrations run in a short-lived fork of their own."""
    code = ("import sys, proxy.tools.cli, proxy.web.supervisor, proxy.web.app; "
            "print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('alembic', 'mako', 'pygments')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]"
