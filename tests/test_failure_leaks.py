"""What failed requests leave in a long-running `symgate serve`: descriptors, temp files,
threads, processes and database connections must come back to what the server held before,
however many requests failed (clients that leave mid-body or send no request, upstreams that
reset, cut, lie or fail, uploads cut off, profiles whose client gives up). Each is counted
against a margin far below the number of failures, once the server says nothing is under way:
a leak of one a failure cannot hide in it, and no timing is assumed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, eventually, serves
from tests.processes import Start, descendants
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES

TOKEN = "leak-test-admin-token"
# The modes whose answer is a file, given for any build ID (a file of another one, then).
_FILE_MODES = {"reset-mid-body", "truncated", "wrong-bytes", "slow-body"}


class SwitchedUpstream(FaultUpstream):
    """One fault upstream whose fault is switched by the test (`mode`), whatever path the
    server was configured with: one server goes through every kind of failure."""

    mode = "notfound"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request.match_info["mode"] = self.mode
        if self.mode in _FILE_MODES and request.match_info["build_id"] not in self.by_id:
            request.match_info["build_id"] = self.elfs.big.build_id
        return await super().handle(request)


def _held(pids: set[int]) -> collections.Counter[str]:
    """The descriptors these processes hold, by kind: socket, pipe, the SQLite files, other
    files (the cache's, temp files, locks)."""
    kinds: collections.Counter[str] = collections.Counter()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    kinds["socket" if target.startswith("socket:") else
                          "pipe" if target.startswith("pipe:") else
                          "sqlite" if ".sqlite" in target else
                          "file" if target.startswith("/") else "other"] += 1
    return kinds


def _threads(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return total


def _serving(root: int) -> set[int]:
    """The supervisor and its serving processes: its children but multiprocessing's helpers
    (the symbolize workers are their children, with bounds of their own)."""
    kids = {root}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                helper = b"multiprocessing" in f.read()
            if parent == root and not helper:
                kids.add(pid)
    return kids


def _temp_files(data: Path) -> list[str]:
    """Files in the serving processes' temp folders (cache/tmp/<process>/): partial
    downloads and uploads."""
    return [name for folder in (data / "cache" / "tmp").glob("*/") for name in
            os.listdir(folder)]


async def _pg_sessions(database_url: str) -> int:
    if not database_url.startswith("postgresql"):
        return 0
    import asyncpg

    from tests.conftest import PG_ADMIN_DSN
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        return int(await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
            database_url.rsplit("/", 1)[1]))
    finally:
        await admin.close()


async def _idle(base: str) -> bool:
    """Nothing under way in the server but the request asking: no fetch, no waiter, one
    connection."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith(("symgate_inflight_fetches ", "symgate_fetch_waiters ",
                                  "symgate_open_connections "))}
    return values == {"symgate_inflight_fetches": 0, "symgate_fetch_waiters": 0,
                      "symgate_open_connections": 1}


async def _many(n: int, concurrency: int, one: Callable[[int], Awaitable[object]]) -> None:
    """`n` requests, `concurrency` at a time; each may fail: that is what is measured."""
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with gate:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError,
                                     asyncio.IncompleteReadError):
                await one(i)
    await asyncio.gather(*(run(i) for i in range(n)))


async def _raw(port: int, data: bytes) -> None:
    """A connection that sends `data` (maybe nothing) and is reset."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    await asyncio.sleep(0.01)
    writer.transport.abort()


# On the default database alone: the leaks sought are the server's own (descriptors, threads,
# temp files, places), and a run costs CI 20 s. PostgreSQL's pool is bounded by SQLAlchemy's.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_failed_requests_leave_nothing_behind(
    serve: Start, elfs: ElfSet, debuginfod: Debuginfod, database_url: str, tmp_path: Path
) -> None:
    workers = 2  # the supervisor's part measured too, and a download one worker follows
    up = SwitchedUpstream(elfs)
    await up.start()
    try:
        up.chunk_size, up.chunk_delay = 256 * 1024, 0.01
        # debuginfod first, with the files the tests hit; then the fault upstream, asked
        # for what debuginfod lacks: its failures are what is measured.
        base, proc = await serve(
            up.url_for("any"), workers=workers,
            extra=(f'[upload]\nadmin_tokens = ["{TOKEN}"]\n[[upstreams]]\n'
                   f'url = "{debuginfod.url}"\n'))
        port = int(base.rsplit(":", 1)[1])
        data = tmp_path / "d"
        big = f"{base}/buildid/{elfs.big.build_id}/debuginfo"
        profile = make_profile([(place(elfs.prog, BASES["prog"]),
                                 code_addresses(elfs.prog)[:20])]).SerializeToString()
        # Connections closed after each answer: one kept alive counts as open in the server
        # until its header timeout, and idle is judged by the open connections.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                         connector=aiohttp.TCPConnector(force_close=True)
                                         ) as s:
            async def whole(url: str) -> int:
                async with s.get(url) as r:
                    await r.read()
                    return r.status

            async def cut(url: str) -> None:  # a client that leaves after the first bytes
                async with aiohttp.ClientSession() as own, own.get(url) as r:
                    await r.content.readexactly(64 * 1024)

            async def symbolized() -> int:
                async with s.post(base + "/symbolize", data=profile) as r:
                    await r.read()
                    return r.status

            async def warm() -> None:
                """Every pool filled to its bound (database connections, symbolize workers
                and their pipes and threads): what comes after is measured against them."""
                assert await whole(big) == 200
                assert await asyncio.gather(*(symbolized() for _ in range(20))) == [200] * 20
                await _many(40, 20, lambda i: whole(
                    f"{base}/buildid/{os.urandom(20).hex()}/debuginfo"))
                await eventually(lambda: _idle(base))

            async def held() -> tuple[collections.Counter[str], int, int]:
                serving = _serving(proc.pid)
                return _held(serving), _threads(serving), await _pg_sessions(database_url)

            await warm()
            before, threads_before, sessions_before = await held()
            processes_before = len(descendants(proc.pid))

            # Clients: leaving mid-body of a hit, connecting and sending nothing or half a
            # head, and a head then a reset; and uploads cut off mid-body.
            await _many(150, 10, lambda i: cut(big))
            await _many(300, 30, lambda i: _raw(port, b""))
            await _many(300, 30, lambda i: _raw(port, b"GET /buildid/ab HTTP/1.1\r\nHo"))
            await _many(300, 30, lambda i: _raw(
                port, b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n"))
            upload = (f"PUT /buildid/{elfs.other.build_id}/debuginfo HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {TOKEN}\r\nContent-Length: 9999999\r\n\r\n"
                      ).encode() + elfs.other.debug.read_bytes()[:100_000]
            await _many(100, 10, lambda i: _raw(port, upload))
            # Upstreams failing cold misses each way, and clients leaving cold misses.
            for mode in ("reset-mid-body", "truncated", "wrong-bytes", "status500"):
                up.mode = mode
                await _many(25, 10, lambda i: whole(
                    f"{base}/buildid/{os.urandom(20).hex()}/debuginfo"))
            up.mode = "slow-body"
            await _many(30, 10, lambda i: cut(
                f"{base}/buildid/{os.urandom(20).hex()}/debuginfo"))
            up.mode = "notfound"

            # Profiles whose client gives up while they are worked on: their places must come
            # back (else the next ones are 429s), and so must what they held.
            async def given_up(i: int) -> None:
                timeout = aiohttp.ClientTimeout(total=0.01 * (i % 10 + 1))
                async with aiohttp.ClientSession(timeout=timeout) as own, own.post(
                        base + "/symbolize", data=profile) as r:
                    await r.read()
            await _many(30, 10, given_up)

            await eventually(lambda: _idle(base))
            # Every place free again: as many profiles at once as may be admitted are all
            # worked on (symbolize.max_concurrent + max_waiting, 4 + 16 by default), once the
            # handlers of the profiles given up have ended (aiohttp lets them run on; no
            # metric tells when): a place lost for good fails every try.
            async def all_admitted() -> bool:
                return await asyncio.gather(*(symbolized() for _ in range(20))) == [200] * 20
            await eventually(all_admitted)
            await eventually(lambda: _idle(base))

            # Once nothing is under way: the temp files of the downloads and uploads gone (a
            # fetch's flight files linger 5 s, proxy.artifacts.board.LINGER_S: not counted),
            # and descriptors, threads, database sessions and processes back near where they
            # were. The margins allow what is pooled to have grown to its bound: upstream
            # keep-alive connections, and the database pool's connections (on SQLite a thread
            # and three descriptors each; campaign: up to 17 more descriptors and 7 more
            # threads a worker, however many failures followed). A leak of one a failed
            # request, of the 1,500 here, is far past them.
            async def back() -> bool:
                now, threads, sessions = await held()
                return (_temp_files(data) == []
                        and now["file"] <= before["file"] + 4 * workers
                        and now["pipe"] <= before["pipe"] + 8 * workers
                        and now["sqlite"] <= before["sqlite"] + 30 * workers
                        and now["socket"] <= before["socket"] + 80 * workers
                        and threads <= threads_before + 16 * workers
                        and sessions <= sessions_before + 6 * workers)

            try:
                await eventually(back, timeout=20)
            except AssertionError:
                now, threads, sessions = await held()
                raise AssertionError(
                    f"descriptors {dict(before)} -> {dict(now)}, threads {threads_before} -> "
                    f"{threads}, database sessions {sessions_before} -> {sessions}, temp "
                    f"files {_temp_files(data)}"
                ) from None
            # The symbolize workers and their builders have a bound of their own (a pool of
            # build_workers + workers per serving process, a builder each, the shared helpers).
            assert len(descendants(proc.pid)) <= max(processes_before, 2 + workers * 13)
            assert await serves(base)
    finally:
        await up.stop()
