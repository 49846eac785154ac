"""An upload deleted, or put over a downloaded file, on a server of several serving processes:
every process stops serving the old version within cache.purge_poll_s (each holds files in
memory: its index, and small files' bytes), and the notice that tells them so removes that
version only, never a re-upload of the key made before a process applied it.

Which worker the kernel hands a connection to is not ours to choose: `--workers 2` is asked
on a new connection each time, as often as makes both workers answer. The race of a
re-upload with the notice is made certain with two single-worker servers on one data dir,
the one that must apply the notice frozen until the re-upload is done; notices committed out
of their ids' order, with a transaction held open here as another replica's DELETE holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import aiohttp
import asyncpg
import pytest

from proxy.config import CacheConfig, UploadConfig
from tests.elfs import Elf, ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.processes import Start, stopped

ADMIN = "admin-token-of-sixteen-or-more"
POLL_S = 0.3
# New connections per look: both workers of `--workers 2` answer some of them.
ASKED = 40
EXTRA = (f'[upload]\nadmin_tokens = ["{ADMIN}"]\n[cache]\npurge_poll_s = {POLL_S}\n'
         "[symbolize]\nenabled = false\n")



async def _answers(base: str, elf: Elf, times: int = ASKED) -> list[str]:
    """GET of the program's debuginfo `times` times, each on a new connection: what each
    answer was, by name (the bytes of the upload are the program's executable's)."""
    names = {elf.executable.read_bytes(): "upload", elf.debug.read_bytes(): "download"}
    got = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for _ in range(times):
            async with s.get(f"{base}/buildid/{elf.build_id}/debuginfo") as r:
                body = await r.read()
                got.append(names.get(body, f"{len(body)} other bytes")
                           if r.status == 200 else str(r.status))
    return got


async def _send(method: str, base: str, build_id: str, data: bytes | None = None) -> int:
    async with aiohttp.ClientSession() as s, s.request(
            method, f"{base}/buildid/{build_id}/debuginfo", data=data,
            headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return r.status


async def _past_polls() -> None:
    """Long enough for every process to have polled the notices since (a few periods)."""
    await asyncio.sleep(POLL_S * 5 + 1)


async def test_a_deleted_upload_is_served_by_no_worker(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    base, _ = await serve(debuginfod.url, workers=2, extra=EXTRA)
    prog = elfs.prog
    assert await _send("PUT", base, prog.build_id, prog.executable.read_bytes()) == 201
    assert set(await _answers(base, prog)) == {"upload"}  # hot in both workers
    assert await _send("DELETE", base, prog.build_id) == 204
    await _past_polls()
    after = await _answers(base, prog)
    # The upstream's debuginfo, fetched now: never the deleted upload.
    assert "upload" not in after, f"{after.count('upload')} of {ASKED} still the upload"


async def test_an_upload_over_a_download_is_what_every_worker_serves(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    base, _ = await serve(debuginfod.url, workers=2, extra=EXTRA)
    prog = elfs.prog
    assert set(await _answers(base, prog)) == {"download"}  # hot in both workers
    # The same build ID, other bytes: a debug file re-released, say.
    assert await _send("PUT", base, prog.build_id, prog.executable.read_bytes()) == 201
    await _past_polls()
    after = await _answers(base, prog)
    assert set(after) == {"upload"}, f"{after.count('download')} of {ASKED} still the download"


@pytest.mark.parametrize("headers", [{}, {"Cache-Control": "no-cache"}],
                         ids=["quick", "aiohttp"])
async def test_a_big_file_put_over_by_another_process_is_never_sent_as_the_old_one(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, headers: dict[str, str]
) -> None:
    """A process that has not polled the upload's notice yet still holds the download's row
    and headers, and opens the key's path, where the upload is now: it sends the upload,
    whole, or the download it had, never the upload's first bytes under the download's
    Content-Length (a body that looks whole and is neither file)."""
    slow = (f'[upload]\nadmin_tokens = ["{ADMIN}"]\n[cache]\npurge_poll_s = 600\n'
            "[symbolize]\nenabled = false\n")  # b hears of no notice in this test
    a, _ = await serve(debuginfod.url, extra=slow)
    b, _ = await serve(debuginfod.url, extra=slow)
    big = elfs.big
    url = f"/buildid/{big.build_id}/debuginfo"
    old = big.debug.read_bytes()
    # The same build ID, other bytes and more of them: its padding changed, and a tail.
    mid = len(old) // 2
    new = old[:mid] + b"\xaa" * 100 + old[mid + 100:] + bytes(3000)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # fetched, then a hit: its headers in b's memory
            async with s.get(b + url) as r:
                assert await r.read() == old
        assert await _send("PUT", a, big.build_id, new) == 201
        async with s.get(b + url, headers=headers) as r:
            body = await r.read()
            assert r.status == 200 and int(r.headers["Content-Length"]) == len(body)
    got = {new: "upload", old: "download"}.get(body, f"{len(body)} bytes of neither")
    assert got in ("upload", "download")


async def test_a_reupload_right_after_a_delete_outlives_the_delete_s_notice(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The other process applies the DELETE's notice only after the key was uploaded again:
    the notice is of the deleted version, and leaves the re-upload (the very same bytes, a
    new commit) in place, on disk and in SQL, for both."""
    a, _ = await serve(debuginfod.url, extra=EXTRA)
    b, b_proc = await serve(debuginfod.url, extra=EXTRA)
    other = elfs.other
    own = other.executable.read_bytes()
    assert await _send("PUT", a, other.build_id, own) == 201
    assert set(await _answers(b, other, 3)) == {"upload"}  # b holds it, bytes and all
    with stopped([b_proc.pid]):  # b polls no notice until the re-upload is done
        assert await _send("DELETE", a, other.build_id) == 204
        assert await _send("PUT", a, other.build_id, own) == 201
    await _past_polls()
    assert set(await _answers(b, other, 5)) == {"upload"}
    assert set(await _answers(a, other, 5)) == {"upload"}
    # b found the re-upload through SQL and disk (its memory of the old commit went), as
    # an upload of its own to delete; a hears of it as b heard of a's.
    assert await _send("DELETE", b, other.build_id) == 204
    await _past_polls()
    assert "upload" not in await _answers(a, other, 5)


async def _retire_elsewhere(conn: asyncpg.Connection, build_id: str) -> None:
    """What another replica's DELETE of the upload does in SQL (Repository.retire_artifact):
    the copies' rows go, and a notice of that version is left."""
    row = await conn.fetchrow("SELECT key_hash, scope, key, sha256, fetched_at FROM artifacts"
                              " WHERE build_id = $1", build_id)
    await conn.execute("DELETE FROM artifacts WHERE key_hash = $1", row["key_hash"])
    await conn.execute(
        "INSERT INTO purges (key_hash, scope, key, purged_at, sha256, fetched_at, replica) "
        "VALUES ($1, $2, $3, now(), $4, $5, 'elsewhere')",
        row["key_hash"], row["scope"], row["key"], row["sha256"], row["fetched_at"])


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_a_notice_committed_after_a_newer_one_is_applied_all_the_same(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, database_url: str
) -> None:
    """Two replicas' DELETEs at once: the first takes its notice's id, the second takes the
    next and commits first. A poll between the commits reads the second's notice only; the
    first's must not be left behind for having the smaller id."""
    sg = await start_symgate([debuginfod.url], upload=UploadConfig(admin_tokens=(ADMIN,)),
                             cache=CacheConfig(purge_poll_s=POLL_S))
    first, second = elfs.prog, elfs.other
    for elf in (first, second):
        assert await _send("PUT", sg.url, elf.build_id, elf.executable.read_bytes()) == 201
        assert set(await _answers(sg.url, elf, 3)) == {"upload"}
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    held, other = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        async with held.transaction():
            await _retire_elsewhere(held, first.build_id)  # its id taken, not committed
            async with other.transaction():
                await _retire_elsewhere(other, second.build_id)

            async def second_gone() -> bool:
                return "upload" not in await _answers(sg.url, second, 3)

            await eventually(second_gone, timeout=10)  # polled past the first's id
            assert set(await _answers(sg.url, first, 3)) == {"upload"}  # not committed yet

        async def first_gone() -> bool:
            return "upload" not in await _answers(sg.url, first, 3)

        await eventually(first_gone, timeout=10)
    finally:
        await held.close()
        await other.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_notice_after_old_ones_were_deleted_takes_an_id_not_seen_before(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, database_url: str
) -> None:
    """SQLite gives a row the largest id there plus one: had a start deleted every notice
    (all older than a day), the next one would take an id a running process has applied
    already, and be ignored by it."""
    a, _ = await serve(debuginfod.url, extra=EXTRA)
    first, second = elfs.prog, elfs.other
    assert await _send("PUT", a, first.build_id, first.executable.read_bytes()) == 201
    assert await _send("DELETE", a, first.build_id) == 204
    await _past_polls()  # a has applied the notice (its own: nothing to do)
    with contextlib.closing(sqlite3.connect(database_url.split("///", 1)[1])) as db, db:
        db.execute("UPDATE purges SET purged_at = '2000-01-01 00:00:00.000000'")
    b, _ = await serve(debuginfod.url, extra=EXTRA)  # its start deletes the notices of long ago
    assert await _send("PUT", b, second.build_id, second.executable.read_bytes()) == 201
    assert set(await _answers(a, second, 3)) == {"upload"}
    assert await _send("DELETE", b, second.build_id) == 204
    await _past_polls()
    assert "upload" not in await _answers(a, second, 3)
