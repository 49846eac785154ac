"""Several `symgate serve` processes on one data dir: a process starting never removes another
live process's download, two processes wanting the same artifact end with one fetch, one whole
file and one row, a file evicted under a response is still sent whole, or as it is committed,
and an eviction by what a process remembers of a file never removes the copy another fetched
since."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.artifacts.board import VERIFIED
from proxy.artifacts.chunk_writer import ChunkWriter
from proxy.artifacts.index import key_hash
from proxy.config import CacheConfig
from proxy.keys import ArtifactKey
from proxy.store.replica import replica_id
from proxy.store.repository import Repository, create_engine
from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    Symgate,
    SymgateFactory,
    eventually,
    make_config,
    upstream_requests,
)
from tests.processes import start_serve, stop_serve

Serve = Callable[[], Awaitable[str]]


@pytest.fixture
async def serve(tmp_path: Path, database_url: str, faults: FaultUpstream
                ) -> AsyncIterator[Serve]:
    """Starts `symgate serve` processes that share one data dir and database."""
    procs: list[asyncio.subprocess.Process] = []

    async def start() -> str:
        base, proc = await start_serve(tmp_path, tmp_path / "d", database_url,
                                       faults.url_for("held"))
        procs.append(proc)
        return base

    yield start
    await stop_serve(procs)


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url) as r:
        return r.status, await r.read()


async def test_processes_on_one_data_dir_leave_each_others_downloads_alone(
    serve: Serve, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path, database_url: str
) -> None:
    first = await serve()
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        download = asyncio.create_task(_get(s, first + path))
        await asyncio.wait_for(faults.held_half_sent.wait(), 30)
        temps = [p for p in (tmp_path / "d" / "cache" / "tmp").rglob("*") if p.is_file()]
        assert any(p.suffix == ".part" for p in temps)
        second = await serve()  # cleans up what dead processes left, at start
        assert all(p.exists() for p in temps), "the live process's download was removed"
        faults.release.set()
        status, body = await download
        assert status == 200 and body == elfs.big.debug.read_bytes()
        for base in (first, second):  # both find it: one from memory, one from SQL and disk
            assert await _get(s, base + path) == (200, elfs.big.debug.read_bytes())
        assert faults.count("held") == 1

        # Both processes want one artifact at once: one fetches it, the other follows.
        faults.release = asyncio.Event()
        faults.held_half_sent = asyncio.Event()
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        download = asyncio.create_task(_get(s, first + path))
        await asyncio.wait_for(faults.held_half_sent.wait(), 30)
        expected = elfs.prog.debug.read_bytes()
        async with s.get(second + path) as r:
            # The first half (but the byte held back until the whole is verified), while the
            # upstream still holds the rest: streamed from the first process's download.
            head = await r.content.readexactly(len(expected) // 2 - 1)
            faults.release.set()
            assert (r.status, head + await r.read()) == (200, expected)
        assert await download == (200, expected)
        assert faults.count("held") == 2
    stored = tmp_path / "d" / "cache" / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    repo = Repository(create_engine(database_url))
    try:
        async def committed() -> bool:  # just after the clients' last byte, in its process
            return bool(await repo.artifacts_of(elfs.prog.build_id))

        await eventually(committed)
        rows = await repo.artifacts_of(elfs.prog.build_id)
    finally:
        await repo.close()
    assert stored.read_bytes() == expected
    assert [(r.kind, r.size) for r in rows] == [("debuginfo", len(expected))]


async def test_a_file_evicted_by_another_process_is_still_sent_whole(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Eviction is an unlink: a response already sending the file holds its descriptor, so
    another process evicting it (here: unlinking it, as its eviction does) cuts nothing."""
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.big.build_id, "debuginfo").storage_name
    expected = elfs.big.debug.read_bytes()
    async with sg.session.get(sg.url + path) as r:  # a hit, sent from the file
        head = await r.content.readexactly(1024 * 1024)
        stored.unlink()
        rest = await r.content.read()
    assert head + rest == expected
    status, _, body = await sg.get(path)  # gone from disk: fetched again, not a broken hit
    assert status == 200 and body == expected


async def test_files_without_a_row_are_removed_only_when_no_other_process_is_alive(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str
) -> None:
    cfg = make_config(tmp_path / "data", database_url, [])
    orphan = cfg.cache_dir / "objects" / "cc" / "dd" / "debuginfo"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"renamed into place by another process, its row not written yet")
    (cfg.cache_dir / "tmp").mkdir()
    # Another process on this data dir, as a server holds its lock for its whole life.
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n",
        str(cfg.cache_dir / "tmp" / f"{'ab' * 16}.lock"),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"locked\n"
        sg = await start_symgate(config=cfg)
        assert orphan.exists()
        await sg.stop()
        holder.stdin.close()
        await asyncio.wait_for(holder.wait(), 30)
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
    await start_symgate(config=cfg)  # alone now: a file without its row is a crash's
    assert not orphan.exists()


async def test_a_miss_remembered_by_another_process_between_look_and_claim_is_the_answer(
    start_symgate: SymgateFactory, faults: FaultUpstream, tmp_path: Path
) -> None:
    """The second server looks in SQL (nothing remembered yet), the first's fetch ends in a
    404 it remembers and frees the key, then the second claims it: it must answer from what
    the first remembered, not ask upstream again. Two servers in this process on one data
    dir; the await point between the second's look and its claim is injected."""
    first = await start_symgate([faults.url_for("hold")], data_dir=tmp_path / "d")
    second = await start_symgate([faults.url_for("hold")], data_dir=tmp_path / "d")
    looked, go_on = asyncio.Event(), asyncio.Event()
    misses = second.runner.app[STATE].service.misses
    real_live = misses.live

    async def live_then_pause(scope: str, key: ArtifactKey) -> frozenset[str]:
        found = await real_live(scope, key)
        looked.set()
        await go_on.wait()
        return found

    misses.live = live_then_pause  # type: ignore[method-assign]
    path = f"/buildid/{'cd' * 20}/debuginfo"
    asking = asyncio.create_task(first.get(path))
    async def asked() -> bool:
        return faults.count("hold") == 1

    await eventually(asked)
    following = asyncio.create_task(second.get(path))
    await asyncio.wait_for(looked.wait(), 30)
    faults.release.set()
    assert (await asking)[0] == 404  # remembered, and the key freed, by now
    go_on.set()
    assert (await following)[0] == 404
    assert faults.count("hold") == 1


async def test_an_eviction_by_a_stale_record_leaves_the_copy_fetched_since(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    database_url: str
) -> None:
    """The first server keeps its record of a file that the second evicts, then fetches
    again: when the first evicts by that record, the second's newer copy and its row stay.
    Two servers in this process on one data dir, each with an index of its own; sources,
    which no symbol-table build holds open, and a budget of one of the two files."""
    x, y = elfs.prog.sources[:2]
    budget = x.stat().st_size + y.stat().st_size - 1
    cfg = make_config(tmp_path / "d", database_url, [faults.url_for("ok")],
                      cache=CacheConfig(max_bytes=budget))
    # Only the evictions of the steps below: no judging of the whole cache meanwhile.
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, access_flush_s=3600))
    first = await start_symgate(config=cfg)
    second = await start_symgate(config=cfg)

    async def get(sg: Symgate, src: Path) -> None:
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/source{src}")
        assert (status, body) == (200, src.read_bytes())
        await sg.settled()  # committed, and evicted for

    await get(first, x)  # the first's record of x
    await get(second, x)  # a hit from SQL: the second's record of x too
    await get(second, y)  # evicts x, by the second's record
    await get(second, x)  # fetched again: a newer copy of x; evicts y
    assert faults.count("ok") == 3
    key = ArtifactKey.parse(elfs.prog.build_id, "source", str(x))
    stored = cfg.cache_dir / "objects" / ArtifactKey.from_id(key.id).storage_name
    repo = Repository(create_engine(database_url), replica=replica_id(cfg.cache_dir))
    try:
        newer = await repo.get_artifact(key_hash("", key))
        assert newer is not None and stored.exists()
        await get(first, y)  # makes room by its old record of x: not the second's copy
        assert await repo.get_artifact(key_hash("", key)) == newer
    finally:
        await repo.close()
    assert stored.read_bytes() == x.read_bytes()


async def test_a_file_evicted_as_it_is_committed_is_served_and_no_failed_fetch(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Another process may evict a file the moment it is renamed into place (an eviction
    that raced a fetch of the same key): its clients have had every byte, and the commit
    says nothing of a failed fetch. The upstream (elfutils') sends Last-Modified, which the
    file takes as its mtime. The rename is followed by the unlink here, in the server's
    own commit."""
    sg = await start_symgate([debuginfod.url])
    store = sg.runner.app[STATE].service.cache.store
    real_commit = store.commit

    def commit_then_lose(*args: Any) -> Path:
        final = real_commit(*args)
        final.unlink()  # what the other process's eviction does, right then
        return final

    store.commit = commit_then_lose  # type: ignore[method-assign]
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    expected = elfs.prog.debug.read_bytes()
    status, headers, body = await sg.get(path)
    await sg.settled()
    assert (status, body) == (200, expected) and "Last-Modified" in headers
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    store.commit = real_commit  # type: ignore[method-assign]
    status, _, body = await sg.get(path)  # its row names a file that is gone: fetched again
    assert (status, body) == (200, expected)


async def test_a_debuginfo_evicted_as_it_is_committed_is_fetched_again_for_its_section(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A section is cut from its debuginfo, fetched for it. Another process (its eviction, an
    operator's `cache purge`) may remove that file the moment it is committed, before the
    cut opens it: the cut fetches it again, rather than failing with a 500 on a file that
    this process's memory still holds."""
    sg = await start_symgate([faults.url_for("ok")])
    store = sg.runner.app[STATE].service.cache.store
    real_commit = store.commit
    lost: list[Path] = []

    def commit_then_lose(*args: Any) -> Path:
        final = real_commit(*args)
        if not lost and final.name == "debuginfo":
            final.unlink()  # what the other process does, right then
            lost.append(final)
        return final

    store.commit = commit_then_lose  # type: ignore[method-assign]
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/section/.debug_info")
    store.commit = real_commit  # type: ignore[method-assign]
    assert lost, "the debuginfo was committed for the cut, and lost"
    assert status == 200 and body, body[:200]
    assert faults.count("ok") == 2  # fetched again after the loss
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("paused", ["upload_here", "add"])  # before the rename; before the row
async def test_a_request_that_comes_while_another_process_commits_waits_and_is_a_hit(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    paused: str
) -> None:
    """The first server has sent the file's last byte and commits it (paused there); a
    request to the second comes meanwhile. In the process that fetched it, such a request
    waits for the commit and is a hit (README); in the other it followed the fetch and was a
    miss and a join, so that serve --workers N read a lower hit ratio than one process for
    the same requests. Two servers in this process on one data dir."""
    first = await start_symgate([debuginfod.url], data_dir=tmp_path / "d")
    second = await start_symgate([debuginfod.url], data_dir=tmp_path / "d")
    service = first.runner.app[STATE].service
    committing, go_on = asyncio.Event(), asyncio.Event()
    real = getattr(service.cache, paused)

    async def pause_then(*args: Any, **kw: Any) -> Any:
        committing.set()
        await go_on.wait()
        return await real(*args, **kw)

    setattr(service.cache, paused, pause_then)
    board = second.runner.app[STATE].service._board
    real_follow, following = board.follow, asyncio.Event()

    async def follow(kh: str) -> Any:
        following.set()  # its first look is made before follow's first await
        return await real_follow(kh)

    board.follow = follow  # type: ignore[method-assign]
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    expected = elfs.prog.debug.read_bytes()
    assert (await first.get(path))[::2] == (200, expected)  # its last byte, before the commit
    await asyncio.wait_for(committing.wait(), 30)
    await asyncio.to_thread(service._board.drain)  # the verdict told to the other processes
    late = asyncio.create_task(second.get(path))
    await asyncio.wait_for(following.wait(), 30)
    go_on.set()
    assert (await late)[::2] == (200, expected)
    await first.settled()
    requests = "symgate_requests_total"
    assert [await second.metric(requests, endpoint="buildid", kind="debuginfo", outcome=o)
            for o in ("hit", "miss")] == [1, 0]
    assert await second.metric("symgate_singleflight_joins_total") == 0
    assert await second.metric("symgate_served_bytes_total", source="cache") == len(expected)


async def test_a_request_that_comes_while_another_process_ends_a_file_not_kept_is_served_it(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the file does not fit the budget: served, not kept. The request that
    came after its verdict, which waits for its end, is sent the file it holds open, not
    fetched again. The first server is paused after its verdict, before it ends the fetch."""
    cfg = make_config(tmp_path / "d", database_url, [debuginfod.url],
                      cache=CacheConfig(max_bytes=1024))
    first = await start_symgate(config=cfg)
    second = await start_symgate(config=cfg)
    board = first.runner.app[STATE].service._board
    key = ArtifactKey.parse(elfs.prog.build_id, "debuginfo")
    ended, go_on = asyncio.Event(), asyncio.Event()
    real_flush = ChunkWriter.flush

    async def flush_then_pause(writer: ChunkWriter) -> None:
        await real_flush(writer)
        board.drain()
        if (board.read_state(key_hash("", key)) or {}).get("state") == VERIFIED:
            ended.set()
            await go_on.wait()

    monkeypatch.setattr(ChunkWriter, "flush", flush_then_pause)
    asked = await upstream_requests(debuginfod)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    expected = elfs.prog.debug.read_bytes()
    assert (await first.get(path))[::2] == (200, expected)
    await asyncio.wait_for(ended.wait(), 30)
    late = asyncio.create_task(second.get(path))
    # Its claim refused, it waits for the fetch's end.
    async def waiting() -> bool:
        return await second.metric("symgate_fetch_waiters") == 1

    await eventually(waiting)
    go_on.set()
    assert (await late)[::2] == (200, expected)
    assert await upstream_requests(debuginfod) == asked + 1
