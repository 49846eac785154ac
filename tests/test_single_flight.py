"""One upstream fetch per artifact, however many clients ask for it at once: each of them is
streamed the bytes as they arrive, and the fetch runs to its end even when the client that
started it hangs up, so the next request is a hit."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.artifacts.board import FlightBoard
from proxy.errors import UpstreamUnavailable
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, eventually, fast_upstream
from tests.processes import start_serve, stop_serve


async def test_single_flight_50_clients_one_upstream_request_streamed(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.chunk_size, faults.chunk_delay = 1024 * 1024, 0.05  # ~1.3 s for the 24 MiB file
    sg = await start_symgate([faults.url_for("slow-body")])
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = hashlib.sha256(elfs.big.debug.read_bytes()).hexdigest()
    loop = asyncio.get_running_loop()
    first_bytes: list[float] = []

    async def client(session: aiohttp.ClientSession) -> str:
        digest = hashlib.sha256()
        first = True
        async with session.get(sg.url + path) as r:
            assert r.status == 200
            async for chunk in r.content.iter_chunked(1 << 16):
                if first:
                    first_bytes.append(loop.time())
                    first = False
                digest.update(chunk)
        return digest.hexdigest()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        digests = await asyncio.gather(*(client(session) for _ in range(50)))
    assert digests == [expected] * 50
    assert faults.count("slow-body") == 1
    upstream_done = faults.body_done[f"/slow-body{path}"]
    # Every client had its first bytes before the upstream had sent its last one.
    assert len(first_bytes) == 50 and max(first_bytes) < upstream_done
    assert await sg.metric("symgate_singleflight_joins_total") == 49
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="miss") == 50
    status, _, body = await sg.get(path)
    assert status == 200 and hashlib.sha256(body).hexdigest() == expected
    assert faults.count("slow-body") == 1


async def test_fetch_goes_on_when_the_client_that_started_it_leaves(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.chunk_size, faults.chunk_delay = 1024 * 1024, 0.03
    sg = await start_symgate([faults.url_for("slow-body")])
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    async with aiohttp.ClientSession() as s, s.get(sg.url + path) as r:
        assert r.status == 200
        await r.content.read(1 << 16)
        r.close()  # hang up with most of the file still to come
    for _ in range(100):
        if await sg.metric("symgate_cache_entries") == 1:
            break
        await asyncio.sleep(0.1)
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.big.debug.read_bytes()
    assert faults.count("slow-body") == 1
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="hit") == 1


async def test_staggered_clients_over_many_keys_cost_one_request_per_key(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Requests that arrive while a fetch is finishing (the window between its commit, or its
    remembered 404, and its unregistering) must not start a second one. 300 clients, spread
    over 12 keys (found and not found) and over time, cost exactly 12 upstream requests."""
    sg = await start_symgate([faults.url_for("ok")])
    found = [f"/buildid/{e.build_id}/{kind}" for e in (elfs.prog, elfs.other, elfs.big)
             for kind in ("debuginfo", "executable")]
    missing = [f"/buildid/{i:02x}{'cd' * 19}/debuginfo" for i in range(6)]
    paths = found + missing
    rng = random.Random(11)
    # Two thirds at once (their SQL lookups queue behind each other while fast fetches end),
    # the rest spread over the time those fetches take.
    delays = [0.0 if i % 3 else rng.uniform(0, 0.2) for i in range(300)]

    async def one(i: int) -> tuple[str, int]:
        await asyncio.sleep(delays[i])
        path = paths[i % len(paths)]
        status, _, _ = await sg.get(path)
        return path, status

    results = await asyncio.gather(*(one(i) for i in range(300)))
    assert {p for p, s in results if s == 200} == set(found)
    assert {p for p, s in results if s == 404} == set(missing)
    assert faults.count("ok") == len(paths), [k for k, n in faults.asked.items() if n > 1]


@pytest.mark.parametrize("later", ["same process", "another process"])
async def test_a_failed_fetch_is_not_replayed_to_a_later_request_while_a_child_holds_its_lock(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    database_url: str, later: str,
) -> None:
    """A process forked while a fetch holds its key's lock (the forkserver started beside the
    first requests) holds a copy of that lock until it execs. A request that comes after the
    fetch failed, to this server process or to another on the same data dir, must then ask the
    upstream itself, not take that failure for a fetch under way and be handed it."""
    upstream = [fast_upstream(faults.url_for("hold500"), retries=0)]
    sg = await start_symgate(upstream, data_dir=tmp_path / "data")
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    first = asyncio.create_task(sg.get(path))

    async def asked() -> bool:
        return faults.count("hold500") == 1

    await eventually(asked)
    flights = str(tmp_path / "data" / "cache" / "flights")
    locks = [fd for fd in map(int, os.listdir("/proc/self/fd"))
             if _link(fd).startswith(flights) and _link(fd).endswith(".lock")]
    assert len(locks) == 1, locks
    # The child a fork leaves between fork and exec, made lasting: it holds the lock's copy.
    child = subprocess.Popen(["sleep", "60"], pass_fds=locks)
    try:
        faults.release.set()
        status, _, body = await first
        assert status == 502 and b"answered 500" in body, body
        if later == "same process":
            status, _, body = await sg.get(path)
            assert faults.count("hold500") == 2  # asked again, not handed the first one's end
        else:  # `symgate serve` on the same data dir and database
            base, proc = await start_serve(tmp_path, tmp_path / "data", database_url,
                                           faults.url_for("hold500"))
            try:
                async with sg.session.get(base + path) as r:
                    status, body = r.status, await r.read()
            finally:
                await stop_serve([proc])
            assert faults.count("hold500") > 1  # asked again (and retried), not handed it
        assert status == 502 and b"answered 500" in body, body
    finally:
        child.kill()
        child.wait()


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


async def test_a_follower_that_looks_as_the_fetch_fails_gets_that_failure(
    tmp_path: Path,
) -> None:
    """A follower looks at the writer's state, then, once it has waited a while, at whether
    its lock is still held. A fetch that failed and let go between the two looks was taken
    for a writer gone: the follower missed the failure it had waited for, was counted as no
    join, and answered with the miss the writer remembered (a --workers test met it one run
    in twelve). The await point: the writer fails and lets go right after a look at its
    state, 40 looks in (well past the first liveness check)."""
    writer, follower = FlightBoard(tmp_path), FlightBoard(tmp_path)
    kh = "ab" * 32
    claim = writer.claim(kh)
    assert claim is not None and follower.claim(kh) is None
    read, looks = follower.read_state, 0

    def fail_after_the_40th_look(key: str) -> dict[str, Any] | None:
        nonlocal looks
        state = read(key)
        looks += 1
        if looks == 40:
            claim.failed(UpstreamUnavailable("upstream answered 500"))
            claim.release()
        return state

    follower.read_state = fail_after_the_40th_look  # type: ignore[method-assign]
    try:
        with pytest.raises(UpstreamUnavailable, match="upstream answered 500"):
            await asyncio.wait_for(follower.follow(kh), 30)
    finally:
        writer.close()
        follower.close()
