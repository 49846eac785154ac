"""Uploads of a site's own debug files: PUT and DELETE /buildid/ID/debuginfo|executable with a
tenant's or an admin's bearer token, `symgate upload`, and the real debuginfod-find reading
them back through symgate. Hostile uploads get their precise status and leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from proxy.artifacts.purges import PurgeNotices
from proxy.config import CacheConfig, Config, TenantConfig, UploadConfig, UpstreamConfig
from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from symbolize.elf import build_id_of_file, section_extent
from tests.elfs import Elf, ElfSet, build_id_tree, build_program
from tests.faults import FaultUpstream, _gzip_zeros
from tests.harness import (
    Debuginfod,
    Symgate,
    SymgateFactory,
    cli,
    config_file,
    eventually,
    make_config,
)
from tests.processes import debuginfod_find, run_in_thread, stopped
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config
from tests.test_disk_full import _fill, _tmpfs
from tests.test_sqlite_read_only import _immutable, _rows

ADMIN = "admin-token-of-sixteen-or-more"
ACME = "acme-token-of-sixteen-or-more"
GLOBEX = "globex-token-of-sixteen-or-more"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Elf:
    """A program no upstream has: the site's own."""
    root = tmp_path_factory.mktemp("own")
    out = root / "bin"
    out.mkdir()
    return build_program(root / "src", out, "inhouse", 77)


def _config(base: Config, **upload: object) -> Config:
    return replace(base, upload=UploadConfig(admin_tokens=(ADMIN,), **upload),  # type: ignore[arg-type]
                   tenants={"acme": TenantConfig(tokens=(ACME,)),
                            "globex": TenantConfig(tokens=(GLOBEX,))})


async def _start(start_symgate: SymgateFactory, tmp_path: Path, database_url: str,
                 upstreams: list[str], **upload: object) -> Symgate:
    base = make_config(tmp_path / "data", database_url, upstreams)
    return await start_symgate(config=_config(base, **upload))


def _auth(token: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **more}


async def _put(sg: Symgate, build_id: str, kind: str, data: bytes | object, token: str = ADMIN,
               **headers: str) -> tuple[int, dict[str, str], bytes]:
    return await sg.request("PUT", f"/buildid/{build_id}/{kind}", data=data,
                            headers=_auth(token, **headers))


def _cli_env(token: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SYMGATE_TOKEN": token}


async def _cli(*args: str, token: str = ADMIN) -> subprocess.CompletedProcess[str]:
    return await run_in_thread([sys.executable, "-m", "proxy.tools.entry", *args],
                               env=_cli_env(token), timeout=120)


async def test_upload_cli_then_the_real_client_reads_it_through_symgate(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, own: Elf, tmp_path: Path,
    database_url: str,
) -> None:
    sg = await _start(start_symgate, tmp_path, database_url, [debuginfod.url])
    # Asked before it is uploaded: the upstream's 404 is remembered.
    miss = await asyncio.to_thread(debuginfod_find, sg.url, tmp_path / "c0", "debuginfo",
                                   own.build_id)
    assert miss.returncode != 0
    state = sg.runner.app[STATE]
    assert await state.repo.negatives_of(own.build_id)

    first = await _cli("upload", str(own.executable.parent), "--server", sg.url)
    assert first.returncode == 0, first.stderr
    size = own.debug.stat().st_size + own.executable.stat().st_size
    assert first.stdout.splitlines()[0] == (
        f"2 artifacts from 2 files: 2 uploaded, 0 already there, 0 failed; {size} bytes sent")
    # A file after an option is one too (argparse had refused it, unrecognized).
    again = await _cli("upload", str(own.executable), "--server", sg.url, str(own.debug))
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0] == (
        "2 artifacts from 2 files: 0 uploaded, 2 already there, 0 failed; 0 bytes sent")
    # A wrong token: the HEAD before each PUT is refused, and its answer has no body. The
    # reason read `HEAD 401: Bearer realm="symgate"`, the challenge header, not what failed.
    wrong = await _cli("upload", str(own.executable), "--server", sg.url,
                       token="not-a-token-this-server-knows")
    assert wrong.returncode == 1
    assert "HEAD 401: the server refused the token" in wrong.stdout, wrong.stdout

    assert await state.repo.negatives_of(own.build_id) == []
    for kind, expected in (("debuginfo", own.debug), ("executable", own.executable)):
        got = await asyncio.to_thread(debuginfod_find, sg.url, tmp_path / f"c-{kind}", kind,
                                      own.build_id)
        assert got.returncode == 0, got.stderr
        assert Path(got.stdout.strip()).read_bytes() == expected.read_bytes()

    async def built() -> bool:  # its symbol table, from the debug file (with lines), though
        # the executable, uploaded at the same time, may have been committed first
        rec = await state.repo.get_symbol_table("", own.build_id)
        return rec is not None and rec.outcome == "ok" and rec.has_lines \
            and rec.source_key == f"{own.build_id}/debuginfo"

    await eventually(built)
    config = tmp_path / "admin.toml"
    config.write_text(f'[server]\ndata_dir = "{sg.config.server.data_dir}"\n'
                      f'[database]\nurl = "{sg.config.database_url}"\n')
    listed = await _cli("cache", "ls", "--pinned", "--json", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted((r["key"], r["pinned"], r["upstream"]) for r in rows) == [
        (f"{own.build_id}/debuginfo", True, "upload"),
        (f"{own.build_id}/executable", True, "upload")]


async def test_uploads_are_pinned_outside_the_lru_budget(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, own: Elf, elfs: ElfSet,
    tmp_path: Path, database_url: str,
) -> None:
    budget = elfs.prog.debug.stat().st_size + 1024  # room for one downloaded file
    base = make_config(tmp_path / "data", database_url, [debuginfod.url],
                       cache=CacheConfig(max_bytes=budget))
    sg = await start_symgate(config=_config(base))
    assert (await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes()))[0] == 201
    for n, elf in enumerate((elfs.prog, elfs.other, elfs.shlib), start=2):
        status, _, _ = await sg.get(f"/buildid/{elf.build_id}/debuginfo")
        assert status == 200
        await sg.settled()

        async def built(n: int = n) -> bool:  # a build leases its file: eviction passes it by
            return await sg.metric("symgate_symtab_builds_total", result="ok") >= n

        await eventually(built)  # so each download evicts the one before
    cache = sg.runner.app[STATE].service.cache

    async def within() -> bool:  # once the symbol-table builds let go of what they read
        return cache.total_bytes <= budget and await sg.metric(
            "symgate_cache_evictions_total") >= 1

    await eventually(within)
    assert cache.pinned_bytes == own.debug.stat().st_size
    assert cache.total_bytes + cache.pinned_bytes > budget  # the upload is outside the budget
    uploaded = cache.peek("", ArtifactKey.parse(own.build_id, "debuginfo"))
    assert uploaded is not None and uploaded.path.read_bytes() == own.debug.read_bytes()


async def test_the_cache_gauges_leave_uploads_out_with_one_serving_process_as_with_several(
    start_symgate: SymgateFactory, faults: FaultUpstream, own: Elf, elfs: ElfSet,
    tmp_path: Path, database_url: str,
) -> None:
    """cache_entries and cache_size_bytes tell the files under cache.max_bytes, which uploads
    are not: several serving processes read them so from SQL. One process counted an upload
    in cache_entries but not in cache_size_bytes, so the same cache showed another count by
    the number of workers, and a figure per artifact that was no file's."""
    sg = await _start(start_symgate, tmp_path, database_url, [faults.url_for("ok")])
    assert (await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes()))[0] == 201
    assert await sg.metric("symgate_cache_entries") == 0
    assert await sg.metric("symgate_cache_size_bytes") == 0
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.settled()
    assert await sg.metric("symgate_cache_entries") == 1
    assert await sg.metric("symgate_cache_size_bytes") == elfs.prog.debug.stat().st_size
    # Deleted, the upload takes nothing from the downloads' figures either.
    status, _, _ = await sg.request("DELETE", f"/buildid/{own.build_id}/debuginfo",
                                    headers=_auth(ADMIN))
    assert status == 204
    assert await sg.metric("symgate_cache_entries") == 1
    assert await sg.metric("symgate_cache_size_bytes") == elfs.prog.debug.stat().st_size


async def test_a_tenants_upload_is_its_own_and_delete_takes_it_back(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}/debuginfo"
    status, _, body = await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes(), ACME)
    assert status == 201 and json.loads(body)["scope"] == "acme"
    status, _, body = await sg.get(path, headers=_auth(ACME))
    assert status == 200 and body == own.debug.read_bytes()
    assert (await sg.get(path))[0] == 404  # nobody else sees it
    query = f"/metadata?key=buildid&value={own.build_id}"
    assert json.loads((await sg.get(query, headers=_auth(ACME)))[2])["results"] == [
        {"type": "debuginfo", "buildid": own.build_id, "file": f"{own.build_id}.debug"}]
    assert json.loads((await sg.get(query))[2])["results"] == []
    assert (await sg.get(path, headers=_auth(GLOBEX)))[0] == 404
    assert (await sg.request("DELETE", path, headers=_auth(GLOBEX)))[0] == 404
    assert (await sg.request("DELETE", path))[0] == 401
    # An admin may act for a tenant by naming it.
    status, _, _ = await sg.get(path, headers=_auth(ADMIN, **{"X-Scope-OrgID": "acme"}))
    assert status == 200
    assert (await sg.request("DELETE", path, headers=_auth(ACME)))[0] == 204
    assert (await sg.get(path, headers=_auth(ACME)))[0] == 404
    assert (await sg.request("DELETE", path, headers=_auth(ACME)))[0] == 404
    # Uploads and metadata queries are counted as /buildid requests are.
    assert {o: await sg.metric("symgate_requests_total", endpoint="upload", kind="debuginfo",
                               outcome=o)
            for o in ("uploaded", "deleted", "not_found", "rejected")} == {
        "uploaded": 1, "deleted": 1, "not_found": 2, "rejected": 1}
    assert await sg.metric("symgate_requests_total", endpoint="metadata", kind="buildid",
                           outcome="ok") == 2
    assert (await sg.get("/metadata?key=nonsense&value=x"))[0] == 400
    assert await sg.metric("symgate_requests_total", endpoint="metadata", kind="invalid",
                           outcome="rejected") == 1



async def test_the_sections_of_a_deleted_upload_go_with_it(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """A section cut from an upload is kept as an artifact of its own, in the upload's scope:
    it went on being served after the upload was deleted with a 204."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}"
    assert (await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes(), ACME))[0] == 201
    status, _, body = await sg.get(f"{path}/section/.debug_info", headers=_auth(ACME))
    assert status == 200 and body
    assert (await sg.request("DELETE", f"{path}/debuginfo", headers=_auth(ACME)))[0] == 204
    assert (await sg.get(f"{path}/section/.debug_info", headers=_auth(ACME)))[0] == 404


def _comment_of(elf: Elf) -> tuple[Callable[[int], bytes], Callable[[bytes], bytes]]:
    """For `elf`'s debug file: its bytes with a bit of .comment flipped (the same build ID,
    another file), and a file's .comment."""
    debug = elf.debug.read_bytes()
    extent = section_extent(elf.debug, ".comment")
    assert extent is not None
    offset, size = extent
    at = offset + size // 2

    def flipped(bit: int) -> bytes:
        return debug[:at] + bytes([debug[at] ^ bit]) + debug[at + 1:]

    return flipped, lambda data: data[offset:offset + size]


async def test_a_tenants_upload_shadows_the_shared_scopes_cut_of_a_section(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """A tenant's upload answers its requests for the file before the shared scope's copy,
    and so must it for a section: a cut the shared scope already had (of the shared file)
    was served to the tenant in place of its own file's section. Its requests cut from its
    own file; everyone else keeps the shared cut; its upload deleted, the shared one again."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}"
    flipped, comment = _comment_of(own)
    shared, mine = flipped(0), flipped(0x20)
    ours, theirs = comment(mine), comment(shared)
    assert (await _put(sg, own.build_id, "debuginfo", shared))[0] == 201  # an admin's: shared
    section = f"{path}/section/.comment"
    assert (await sg.get(section))[::2] == (200, theirs)
    assert (await _put(sg, own.build_id, "debuginfo", mine, ACME))[0] == 201
    for _ in range(2):  # cut, then a hit of the tenant's own cut
        assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, ours)
    assert (await sg.get(section))[::2] == (200, theirs)
    assert (await sg.request("DELETE", f"{path}/debuginfo", headers=_auth(ACME)))[0] == 204
    assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, theirs)


async def test_a_tenants_upload_shadows_the_shared_file_in_every_process_on_the_data_dir(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """Two serving processes on one data dir (serve --workers 2). The other process holds
    the shared file and a section cut from it in memory when the tenant's upload is taken in
    here: that memory hit answered the tenant's requests there, the shared file and its cut
    in place of the tenant's own, for as long as it stayed in memory, by which process the
    kernel handed the connection to."""
    here, there = [await _start(start_symgate, tmp_path, database_url, []) for _ in range(2)]
    path = f"/buildid/{own.build_id}"
    flipped, comment = _comment_of(own)
    shared, mine = flipped(0), flipped(0x20)
    section = f"{path}/section/.comment"
    assert (await _put(here, own.build_id, "debuginfo", shared))[0] == 201  # an admin's
    assert (await there.get(f"{path}/debuginfo"))[::2] == (200, shared)
    assert (await there.get(section))[::2] == (200, comment(shared))
    assert (await _put(here, own.build_id, "debuginfo", mine, ACME))[0] == 201
    for _ in range(2):  # the section first: its cut must not take the shared one for ACME's
        assert (await there.get(section, headers=_auth(ACME)))[::2] == (200, comment(mine))
        assert (await there.get(f"{path}/debuginfo", headers=_auth(ACME)))[::2] == (200, mine)
        assert (await there.head(f"{path}/debuginfo", headers=_auth(ACME)))[1][
            "Content-Length"] == str(len(mine))
    for sg in (here, there):  # and everyone else keeps the shared ones
        assert (await sg.get(f"{path}/debuginfo", headers=_auth(GLOBEX)))[::2] == (200, shared)
        assert (await sg.get(section))[::2] == (200, comment(shared))


async def test_a_tenants_cut_of_the_shared_file_goes_with_it_and_with_its_own_upload(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """A tenant with a file of its own (its executable) keeps its cuts in its own scope, even
    one cut from the shared debuginfo (asked first): that cut must go when the shared file
    it was cut from is deleted, and when the tenant uploads a debuginfo of its own, else it
    answers with the bytes of a file the tenant no longer sees."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}"
    flipped, comment = _comment_of(own)
    shared, mine = flipped(0x20), flipped(0x40)
    exe_extent = section_extent(own.executable, ".comment")
    assert exe_extent is not None
    exe = own.executable.read_bytes()[exe_extent[0]:exe_extent[0] + exe_extent[1]]
    section = f"{path}/section/.comment"
    assert (await _put(sg, own.build_id, "executable", own.executable.read_bytes(),
                       ACME))[0] == 201
    assert (await _put(sg, own.build_id, "debuginfo", shared))[0] == 201  # an admin's
    assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, comment(shared))
    assert (await sg.request("DELETE", f"{path}/debuginfo", headers=_auth(ADMIN)))[0] == 204
    assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, exe)

    assert (await _put(sg, own.build_id, "debuginfo", shared))[0] == 201
    assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, comment(shared))
    assert (await _put(sg, own.build_id, "debuginfo", mine, ACME))[0] == 201
    assert (await sg.get(section, headers=_auth(ACME)))[::2] == (200, comment(mine))


async def test_hostile_uploads_get_their_precise_status_and_leave_nothing(
    start_symgate: SymgateFactory, own: Elf, elfs: ElfSet, tmp_path: Path, database_url: str,
) -> None:
    small = own.debug.stat().st_size + own.executable.stat().st_size + 10
    sg = await _start(start_symgate, tmp_path, database_url, [], max_bytes=small,
                      max_file_bytes=small)
    bid, data = own.build_id, own.debug.read_bytes()
    assert (await sg.request("PUT", f"/buildid/{bid}/debuginfo", data=data))[0] == 401
    assert (await _put(sg, bid, "debuginfo", data, "not-a-known-token-at-all"))[0] == 401
    assert (await _put(sg, bid, "debuginfo", data, ACME, **{"X-Scope-OrgID": "globex"}))[0] \
        == 401
    assert (await _put(sg, "zz", "debuginfo", data))[0] == 400
    assert (await _put(sg, bid, "source", data))[0] == 405  # only ELF files are uploaded
    # The debug file as the executable: gdb would get a program without its code.
    status, _, body = await _put(sg, bid, "executable", data)
    assert status == 422 and b"upload it as debuginfo" in body, body
    status, _, body = await _put(sg, bid, "debuginfo", elfs.prog.debug.read_bytes())
    assert status == 422 and elfs.prog.build_id.encode() in body
    assert (await _put(sg, bid, "debuginfo", b"not an ELF file"))[0] == 422
    assert (await _put(sg, bid, "debuginfo", b""))[0] == 422
    status, _, body = await _put(sg, elfs.big.build_id, "debuginfo", elfs.big.debug.read_bytes())
    assert status == 413, body

    async def chunked() -> AsyncIterator[bytes]:  # no size announced: cut off when past it
        with elfs.big.debug.open("rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    try:
        status = (await _put(sg, elfs.big.build_id, "debuginfo", chunked()))[0]
    except aiohttp.ClientError:  # answered before the rest of the body was taken
        status = 413
    assert status == 413
    assert (await _put(sg, bid, "debuginfo", data))[0] == 201
    assert (await _put(sg, bid, "debuginfo", data))[0] == 200  # the same file: nothing to do
    status, _, _ = await _put(sg, bid, "debuginfo", own.executable.read_bytes())
    assert status == 409  # another file of that ID: DELETE first
    assert (await _put(sg, bid, "executable", own.executable.read_bytes()))[0] == 201
    status, headers, _ = await _put(sg, elfs.prog.build_id, "debuginfo",
                                    elfs.prog.debug.read_bytes())
    assert status == 507 and "Retry-After" not in headers  # past upload.max_bytes
    cfg = sg.config
    assert not [p for p in (cfg.cache_dir / "tmp").rglob("*.part")]
    rows = await sg.runner.app[STATE].repo.artifacts_of(None)
    assert sorted((r.key, r.pinned) for r in rows) == [
        (f"{bid}/debuginfo", True), (f"{bid}/executable", True)]


async def test_a_body_that_its_content_encoding_does_not_decode_is_400(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """aiohttp fails such a body as it is read: that was a 500, "internal error"."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    bid, data = own.build_id, own.debug.read_bytes()
    status, _, body = await _put(sg, bid, "debuginfo", b"\x1f\x8b" + data[:4000],
                                 **{"Content-Encoding": "gzip"})
    assert status == 400 and b"request body is unreadable" in body, body
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]
    status, _, _ = await _put(sg, bid, "debuginfo", gzip.compress(data),
                              **{"Content-Encoding": "gzip"})
    assert status == 201
    assert (await sg.get(f"/buildid/{bid}/debuginfo"))[2] == data


async def test_a_compressed_upload_is_inflated_no_further_than_the_largest_file(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """aiohttp inflated an upload on the event loop, and went on inflating a refused one as
    it drained it, for 10 s: a gzip bomb held every request that long. symgate inflates it in
    a thread, no further than upload.max_file_bytes, and refuses codings it does not know."""
    sg = await _start(start_symgate, tmp_path, database_url, [], max_file_bytes=4 << 20)
    # ELF's magic first, or it is refused at its first bytes, with nothing more inflated.
    head, block = _gzip_zeros(b"\x7fELF")
    bomb = head + block * (2048 - 1)  # 2 GiB of zeros in 2 MB
    status, _, body = await _put(sg, own.build_id, "debuginfo", bomb,
                                 **{"Content-Encoding": "gzip"})
    assert status == 413 and b"upload.max_file_bytes" in body, body
    started = time.monotonic()
    assert (await sg.get("/healthz"))[0] == 200
    # A bound on a stall (the inflating of 2 GiB held the loop some 10 s), not a speed test:
    # the suite runs two tests a core, and a loaded machine answers in more than 1 s at times.
    assert time.monotonic() - started < 3.0
    status, _, body = await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes(),
                                 **{"Content-Encoding": "br"})
    assert status == 415 and b"unsupported Content-Encoding 'br'" in body, body
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]


async def test_a_stalled_upload_is_408_and_concurrent_uploads_of_one_id_end_whole(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    sg = await _start(start_symgate, tmp_path, database_url, [], body_timeout_s=1.0)
    data = own.debug.read_bytes()

    # Half a body, then silence: the answer comes while the client still holds its socket.
    port = int(sg.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"PUT /buildid/{own.build_id}/debuginfo HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(data)}\r\n\r\n"
                  ).encode() + data[:1000])
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status_line.split()[1] == b"408", status_line
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]
    answers = await asyncio.gather(*(_put(sg, own.build_id, "debuginfo", data)
                                     for _ in range(6)))
    assert sorted(a[0] for a in answers) == [200] * 5 + [201]
    status, _, body = await sg.get(f"/buildid/{own.build_id}/debuginfo")
    assert status == 200 and body == data
    rows = await sg.runner.app[STATE].repo.artifacts_of(own.build_id)
    assert len(rows) == 1 and rows[0].size == len(data)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "mnt", "size=8m")


async def test_an_upload_onto_a_full_disk_is_507_and_leaves_no_temp_file(
    start_symgate: SymgateFactory, elfs: ElfSet, small_disk: Path, database_url: str,
) -> None:
    base = make_config(small_disk / "data", database_url, [])
    sg = await start_symgate(config=_config(base))
    _fill(small_disk / "filler")
    status, _, body = await _put(sg, elfs.big.build_id, "debuginfo", elfs.big.debug.read_bytes())
    assert status == 507, body
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]
    assert b"degraded" in (await sg.get("/healthz"))[2]


async def _expect(sg: Symgate, build_id: str, size: int, token: str | None) -> bytes:
    """The status line a PUT with `Expect: 100-continue` gets before it sends its body."""
    port = int(sg.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write((f"PUT /buildid/{build_id}/debuginfo HTTP/1.1\r\nHost: x\r\n{auth}"
                  f"Content-Length: {size}\r\nExpect: 100-continue\r\n\r\n").encode())
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return line


async def test_expect_continue_refuses_before_the_body_is_sent(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    size = own.debug.stat().st_size
    sg = await _start(start_symgate, tmp_path, database_url, [], max_file_bytes=size)
    assert (await _expect(sg, own.build_id, size, None)).startswith(b"HTTP/1.1 401")
    assert (await _expect(sg, own.build_id, size, "an-unknown-token-0123")).startswith(
        b"HTTP/1.1 401")
    assert (await _expect(sg, own.build_id, size + 1, ADMIN)).startswith(b"HTTP/1.1 413")
    # A malformed build ID too: its 400 came after a 100 Continue, and the body with it.
    for bad in ("abc", "zz" * 20, "ab" * 65):
        assert (await _expect(sg, bad, size, ADMIN)).startswith(b"HTTP/1.1 400"), bad
    assert (await _expect(sg, own.build_id, size, ADMIN)).startswith(b"HTTP/1.1 100")
    # And curl, which sends Expect for any body past a KiB, uploads through it.
    done = await run_in_thread(["curl", "-s", "-w", "%{http_code}", "-X", "PUT",
                                "--data-binary", f"@{own.debug}", "-H",
                                f"Authorization: Bearer {ADMIN}",
                                f"{sg.url}/buildid/{own.build_id}/debuginfo"])
    assert done.stdout.endswith("201"), done.stdout


async def test_an_upload_refused_before_its_body_is_counted_as_one_refused_after(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """aiohttp runs an expect handler before any middleware: its refusals (curl's uploads
    past a KiB with a wrong token, too big, of a malformed build ID) were in no count."""
    size = own.debug.stat().st_size
    sg = await _start(start_symgate, tmp_path, database_url, [], max_file_bytes=size)
    assert (await _expect(sg, own.build_id, size, None)).startswith(b"HTTP/1.1 401")
    assert (await _expect(sg, own.build_id, size + 1, ADMIN)).startswith(b"HTTP/1.1 413")
    assert (await _put(sg, own.build_id, "debuginfo", b"x", token="an-unknown-token-0123")
            )[0] == 401
    assert await sg.metric("symgate_requests_total", endpoint="upload", kind="debuginfo",
                           outcome="rejected") == 3


async def test_an_uploader_that_hangs_up_midway_leaves_nothing_and_no_error(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sg = await _start(start_symgate, tmp_path, database_url, [])
    data = own.debug.read_bytes()
    port = int(sg.url.rsplit(":", 1)[1])
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"PUT /buildid/{own.build_id}/debuginfo HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(data)}\r\n\r\n"
                  ).encode() + data[:len(data) // 2])
    await writer.drain()
    await asyncio.sleep(0.3)  # the server is reading the body into its temp file by now
    assert [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]
    writer.close()

    async def cleaned() -> bool:
        return not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]

    await eventually(cleaned)
    assert (await sg.get(f"/buildid/{own.build_id}/debuginfo"))[0] == 404
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert (await _put(sg, own.build_id, "debuginfo", data))[0] == 201


async def test_a_file_replaced_within_the_second_has_another_etag(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """An upload deleted and uploaded again with other bytes of the same size, at once: a
    client that holds the first one's ETag must get the second whole, never a 304 for the
    bytes it has, nor a range of the new one spliced onto the old (FileResponse's ETag is
    the file's time and size: times kept to the second made the two alike)."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}/debuginfo"
    first = own.debug.read_bytes()
    second = first.replace(b"GCC:", b"XCC:", 1)  # same size, same build ID
    assert second != first and len(second) == len(first)
    assert (await _put(sg, own.build_id, "debuginfo", first))[0] == 201
    # A range: past the hot file's headers, to FileResponse's own.
    status, headers, _ = await sg.get(path, headers={"Range": "bytes=0-3"})
    assert status == 206
    etag = headers["Etag"]
    assert (await sg.request("DELETE", path, headers=_auth(ADMIN)))[0] == 204
    assert (await _put(sg, own.build_id, "debuginfo", second))[0] == 201
    status, headers, body = await sg.get(path, headers={"If-None-Match": etag})
    assert status == 200 and body == second
    assert headers["Etag"] != etag
    status, _, body = await sg.get(path, headers={"Range": "bytes=0-3", "If-Range": etag})
    assert status == 200 and body == second


async def test_more_uploads_at_once_than_the_loop_has_threads_all_end(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path, database_url: str,
) -> None:
    """Each PUT waited for the upload lock in a thread of the loop's pool (cores + 4 of them):
    with more uploads at once than that, every thread waited on the lock, and the holder's
    commit, which needs a thread too, never ran. The server hung for good."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    files = [(e.build_id, kind, path.read_bytes()) for e in elfs.all
             for kind, path in (("debuginfo", e.debug), ("executable", e.executable))]
    threads = min(32, (os.cpu_count() or 1) + 4)
    files = (files * (threads // len(files) + 2))[:threads + 2]
    # Another process on the data dir commits an upload meanwhile: every PUT reaches the lock
    # and waits there before any takes it.
    lock = os.open(sg.config.cache_dir / "uploads.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        puts = [asyncio.ensure_future(_put(sg, b, k, d)) for b, k, d in files]

        async def all_received() -> bool:
            return len(list((sg.config.cache_dir / "tmp").rglob("*.part"))) == len(files)

        await eventually(all_received)
        await asyncio.sleep(0.5)  # their build IDs read, in the pool's threads
    finally:
        os.close(lock)
    answers = await asyncio.wait_for(asyncio.gather(*puts), 30)
    assert {a[0] for a in answers} <= {200, 201}
    assert sum(a[0] == 201 for a in answers) == len({(b, k) for b, k, _ in files})
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()


async def test_a_download_that_ends_after_an_upload_of_its_key_leaves_the_upload(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    database_url: str,
) -> None:
    """A GET's download, under way when a PUT of the same key was answered 201, was renamed
    over the upload once it ended: the uploader's file was gone, the upstream's served in its
    place under a row still pinned."""
    sg = await _start(start_symgate, tmp_path, database_url, [faults.url_for("held")])
    bid, path = elfs.prog.build_id, f"/buildid/{elfs.prog.build_id}/debuginfo"
    fetched = asyncio.ensure_future(sg.get(path))
    await faults.held_half_sent.wait()
    mine = elfs.prog.executable.read_bytes()  # of that build ID, but not the upstream's file
    status, _, body = await _put(sg, bid, "debuginfo", mine)
    assert status == 201, body
    faults.release.set()
    status, _, got = await fetched
    assert status == 200 and got == elfs.prog.debug.read_bytes()  # what it began to send
    await sg.settled()
    status, _, got = await sg.get(path)
    assert status == 200 and got == mine
    rows = await sg.runner.app[STATE].repo.artifacts_of(bid)
    assert [(r.upstream, r.pinned, r.sha256) for r in rows] == [
        ("upload", True, json.loads(body)["sha256"])]
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_an_upload_whose_row_sql_refuses_is_503_and_not_kept(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """SQL that reads but does not write (a SQLite file made read-only) let the budget be
    judged and then took no row: the PUT was 201, though no other serving process saw the
    upload (nor could DELETE it) and a restart removed its file as an orphan."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    db = tmp_path / "symgate.sqlite"
    files = [db, tmp_path / "symgate.sqlite-wal"]  # not -shm: see test_sqlite_read_only
    _immutable(files, True)
    try:
        await sg.runner.app[STATE].repo.engine.dispose()  # its connections opened read-only
        status, headers, body = await _put(sg, own.build_id, "debuginfo",
                                           own.debug.read_bytes())
        assert status == 503 and "Retry-After" in headers, body
        assert (await sg.get(f"/buildid/{own.build_id}/debuginfo"))[0] == 404
    finally:
        _immutable(files, False)
    cache = sg.config.cache_dir
    assert not [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert not [p for p in (cache / "tmp").rglob("*.part")]
    status, _, body = await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes())
    assert status == 201, body
    assert f"{own.build_id}/debuginfo" in _rows(db)


async def test_an_upload_onto_a_disk_full_of_cached_files_evicts_them_for_room(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, own: Elf,
    small_disk: Path, database_url: str,
) -> None:
    """A download on a full disk evicts least recently used files for room; an upload was a
    507 there, however much of the disk the cache's own files held, until some download
    evicted them."""
    base = make_config(small_disk / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=_config(base))
    for kind in ("debuginfo", "executable"):
        assert (await sg.get(f"/buildid/{elfs.other.build_id}/{kind}"))[0] == 200
    # Their table built too: its build leases them, and a file leased is not evicted.
    await sg.built()
    _fill(small_disk / "filler")
    status, _, body = await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes())
    assert status == 201, body
    assert (await sg.get(f"/buildid/{own.build_id}/debuginfo"))[2] == own.debug.read_bytes()
    assert await sg.metric("symgate_cache_evictions_total") >= 1
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]


async def test_a_delete_cut_short_never_leaves_symbols_of_an_upload_that_is_gone(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, own: Elf
) -> None:
    """A DELETE took the upload's row, then its file, then the symbol table built from it: a
    server killed in between kept the table, and profiles were symbolized for good by an
    upload that GET says is gone (nor could `cache purge`, which finds tables by the rows of
    their artifacts, take it). Whatever point the kill lands on, what GET says and what a
    profile gets after the restart now agree. The kill is the DELETE's task cancelled where
    the table is dropped: nothing after that point runs; the server then stops and another
    starts on the same data dir and database."""
    cfg = _config(make_config(tmp_path / "data", database_url, [],
                              symbolize=symbolize_config()))
    sg = await start_symgate(config=cfg)
    path = f"/buildid/{own.build_id}/debuginfo"
    assert (await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes()))[0] == 201
    profile = make_profile([(place(own, BASES["prog"]), code_addresses(own)[:20])]
                           ).SerializeToString()
    status, headers, _ = await post(sg, profile)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    tables = sg.runner.app[STATE].symbols._tables
    killed = asyncio.Event()

    async def killed_here(scope: str, build_id: str) -> None:
        killed.set()
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    tables.drop = killed_here  # type: ignore[method-assign]
    with contextlib.suppress(aiohttp.ClientError):
        await sg.request("DELETE", path, headers=_auth(ADMIN))
    assert killed.is_set()
    await sg.stop()
    again = await start_symgate(config=cfg)
    there = (await again.get(path))[0]
    assert there in (200, 404)
    status, headers, _ = await post(again, profile)
    assert status == 200
    symbolized = headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert symbolized == (there == 200), headers
    # And a DELETE that runs its course takes the symbols with the upload.
    if there == 200:
        assert (await again.request("DELETE", path, headers=_auth(ADMIN)))[0] == 204
    assert (await again.get(path))[0] == 404
    status, headers, _ = await post(again, profile)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "0", headers


# `symgate cache purge`, killed with SIGKILL as the statement that deletes the rows starts.
_PURGE_KILLED = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
from proxy.tools.cli import main

@event.listens_for(Engine, "before_cursor_execute")
def _killed(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith("DELETE FROM ARTIFACTS"):
        os.kill(os.getpid(), signal.SIGKILL)

sys.exit(main(sys.argv[1:]))
"""


async def test_a_purge_killed_midway_leaves_no_row_without_its_file(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, own: Elf
) -> None:
    """`cache purge` removed the files, then the rows: killed in between (an operator's
    Ctrl-C in a long `--all`), it left rows naming files that were gone, and a PUT of the
    very upload again was told 200, 'the same file is there', with nothing on disk: the next
    GET was a 404 (until a restart dropped the rows). The rows go first now; killed there,
    nothing is removed. The server runs meanwhile, as it does under an operator's purge."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    path = f"/buildid/{own.build_id}/debuginfo"
    data = own.debug.read_bytes()
    assert (await _put(sg, own.build_id, "debuginfo", data))[0] == 201
    config = tmp_path / "admin.toml"
    config.write_text(f'upstreams = []\n[server]\ndata_dir = "{sg.config.server.data_dir}"\n'
                      f'[database]\nurl = "{database_url}"\n')
    killed = await run_in_thread([sys.executable, "-c", _PURGE_KILLED, "cache", "purge",
                                  own.build_id, "--config", str(config)],
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    status, _, _ = await _put(sg, own.build_id, "debuginfo", data)
    assert status in (200, 201)
    status, _, body = await sg.get(path)
    assert (status, body) == (200, data)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
async def test_the_same_upload_again_repairs_a_copy_damaged_on_disk(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str, damage: str,
) -> None:
    """An upload's file removed or cut short behind the server's back (an operator, a disk
    cleaner, a damaged disk): uploading the very same file again must put it back, not answer
    "nothing to do" from the row alone and leave the key unservable (an upload has no
    upstream to fetch it from again)."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    data = own.debug.read_bytes()
    assert (await _put(sg, own.build_id, "debuginfo", data))[0] == 201
    stored = sg.config.cache_dir / "objects"
    [file] = [p for p in stored.rglob("*") if p.is_file()]
    if damage == "removed":
        file.unlink()
    else:
        with file.open("r+b") as f:
            f.truncate(len(data) // 2)
    assert (await _put(sg, own.build_id, "debuginfo", data))[0] == 201
    status, _, body = await sg.get(f"/buildid/{own.build_id}/debuginfo")
    assert status == 200 and body == data
    assert (await _put(sg, own.build_id, "debuginfo", data))[0] == 200  # whole: nothing to do


async def test_an_executable_uploaded_while_its_debug_files_table_is_built_is_built_in(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """The debug file's table, started at its upload before the executable came, is built
    without it (no .dynsym names, no program headers) and marked so. The executable's own
    upload, committed while that build ran, was passed over ("a resolution is under way"):
    the table stayed without it until the miss TTL, though both files were there."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    state = sg.runner.app[STATE]
    pool = state.symbols.workers.pool
    await pool.start()
    with stopped(pool.pids()):
        assert (await _put(sg, own.build_id, "debuginfo", own.debug.read_bytes()))[0] == 201
        await eventually(lambda: pool.in_flight > 0)  # without the executable
        assert (await _put(sg, own.build_id, "executable", own.executable.read_bytes()))[0] \
            == 201

    async def built_with_it() -> bool:
        rec = await state.repo.get_symbol_table("", own.build_id)
        return rec is not None and rec.outcome == "ok" \
            and rec.source_key == f"{own.build_id}/debuginfo"

    await eventually(built_with_it, timeout=20)


async def test_upload_cli_reports_a_server_that_answers_bytes_that_are_not_text(
    elfs: ElfSet
) -> None:
    """Something else than a symgate at --server (a misrouted port, a proxy's binary error
    page): its answer was decoded as UTF-8, and the whole upload ended in a
    UnicodeDecodeError traceback, the files that did go never reported."""
    from aiohttp import web

    from tests.harness import serve_loopback

    async def garbage(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.method == "HEAD":
            return web.Response(status=404)
        return web.Response(status=500, body=b"\xff\xfe\x00 not text",
                            content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{rest:.*}", garbage)
    runner, url = await serve_loopback(app)
    try:
        result = await _cli("upload", str(elfs.prog.debug), "--server", url)
    finally:
        await runner.cleanup()
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result
    assert "1 failed" in result.stdout and "500: " in result.stdout and "not text" in result.stdout


@pytest.mark.parametrize("written", [b"a-token-of-some-length\nand-a-second-line\n",
                                     b"a-token-of-some-length\x1b[2J",
                                     b"\xd0a-token-of-some-length\xff"])
async def test_a_token_file_that_is_no_token_is_refused_without_showing_it(
    tmp_path: Path, elfs: ElfSet, written: bytes
) -> None:
    """A --token-file of two lines (a token and a comment, two tokens), or not text at all:
    aiohttp refused the header with a ValueError whose traceback printed the token (into a
    CI job's log), or the decoding ended in a traceback. Nothing was reached."""
    token_file = tmp_path / "token"
    token_file.write_bytes(written)
    profile = tmp_path / "p.pb"
    profile.write_bytes(b"")
    for args in (["upload", str(elfs.prog.debug)], ["symbolize", str(profile), "-o",
                                                     str(tmp_path / "o.pb")]):
        result = await _cli(*args, "--server", "http://127.0.0.1:9", "--token-file",
                            str(token_file))
        assert "Traceback" not in result.stderr, result.stderr
        assert "a-token-of-some-length" not in result.stdout + result.stderr
        assert result.returncode == 2, result
        assert f"symgate: --token-file {token_file}: not a bearer token" in result.stderr


async def test_upload_to_a_server_that_is_down_says_the_connection_was_refused(
    tmp_path: Path, elfs: ElfSet
) -> None:
    """Said as "ClientConnectorError: Cannot connect to host ... [Connect call failed
    ('127.0.0.1', 9)]" per file: what to act on is that nothing listens there."""
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-some-length\n")
    result = await _cli("upload", str(elfs.prog.debug), "--server", "http://127.0.0.1:9",
                        "--token-file", str(token_file))
    assert result.returncode == 1, result
    assert "cannot connect: connection refused" in result.stdout, result.stdout
    assert "ClientConnectorError" not in result.stdout + result.stderr


async def test_upload_cli_sends_files_whose_names_no_header_can_carry(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path, database_url: str,
) -> None:
    """A directory walk that met a file named with a line break, or with bytes that are not
    UTF-8 (an old archive's Latin-1 name), put the name in X-DEBUGINFOD-FILE as it was:
    aiohttp refused the header and the whole upload ended in a traceback, the other files
    unsent or unreported. Such a file is sent without the header (served under the default
    name), the others as before."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    files = tmp_path / "files"
    files.mkdir()
    shutil.copyfile(elfs.prog.debug, files / "line\nbreak.debug")
    shutil.copyfile(elfs.other.debug, os.fsdecode(bytes(files) + b"/caf\xe9.debug"))
    shutil.copyfile(elfs.nopie.debug, files / "plain.debug")
    result = await _cli("upload", str(files), "--server", sg.url)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result
    assert result.stdout.startswith("3 artifacts from 3 files: 3 uploaded"), result.stdout
    status, headers, _ = await sg.get(f"/buildid/{elfs.nopie.build_id}/debuginfo")
    assert status == 200 and headers["X-DEBUGINFOD-FILE"] == "plain.debug"
    status, headers, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and "\n" not in headers.get("X-DEBUGINFOD-FILE", "")


async def _chunked(data: bytes, piece: int = 256 * 1024) -> AsyncIterator[bytes]:
    """`data` sent with no Content-Length: its size unknown until its end."""
    for at in range(0, len(data), piece):
        yield data[at:at + piece]


@pytest.fixture
def disk_of_cached_files(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "mnt", "size=24m")


async def test_a_chunked_upload_on_a_full_disk_evicts_no_more_than_it_takes(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
    disk_of_cached_files: Path,
) -> None:
    """A chunked upload on a full disk evicted twice all it had received at each ENOSPC, and
    went on evicting for a body past upload.max_file_bytes or the upload budget, or for one
    that was no ELF file at all: cached files were lost for an upload that was then refused.
    A refused one now costs no more than the bytes it may be at most; one that is no ELF
    file, nothing; one taken, about its own size."""
    disk = disk_of_cached_files
    (tmp_path / "bin").mkdir()
    cached = [build_program(tmp_path / "src", tmp_path / "bin", f"cached{i}", 90 + i,
                            pad_bytes=2 << 20) for i in range(4)]
    tree = tmp_path / "tree"
    for e in cached:
        build_id_tree(tree, e.build_id, e.debug, e.executable)
    base = make_config(disk / "data", database_url, [UpstreamConfig(path=tree)])
    limit = 1 << 20
    sg = await start_symgate(config=_config(base, max_file_bytes=limit, max_bytes=8 << 20))
    for e in cached:
        assert (await sg.get(f"/buildid/{e.build_id}/debuginfo"))[0] == 200
    await sg.built()
    _fill(disk / "filler")

    async def evicted() -> float:
        return await sg.metric("symgate_cache_evicted_bytes_total")

    status, _, body = await _put(sg, own.build_id, "debuginfo", _chunked(b"\0" * (limit - 1)))
    assert status == 422, body
    assert await evicted() == 0  # refused at its first bytes

    oversized = own.debug.read_bytes() + b"\0" * (3 << 20)
    try:
        status = (await _put(sg, own.build_id, "debuginfo", _chunked(oversized)))[0]
    except aiohttp.ClientError:  # answered before the rest of the body was taken
        status = 413
    assert status == 413
    # Room for at most the largest file an upload may be, in whole cached files.
    assert await evicted() <= limit + (3 << 20)
    status, _, body = await _put(sg, own.build_id, "debuginfo", _chunked(own.debug.read_bytes()))
    assert status == 201, body
    assert await evicted() <= limit + (3 << 20)
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*.part")]


async def test_concurrent_uploads_of_one_key_with_different_bytes_end_with_one_whole_winner(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """Found sound in a campaign (24 clients, 2 serving processes, a 6 MB file too): exactly
    one is taken (201), every other hears 409, and what is served, and its row, are the
    winner's file whole. A GET racing the DELETE of it gets that file whole, or a miss."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    base = own.debug.read_bytes()
    bodies = [base + bytes([i]) * (i + 1) for i in range(8)]  # one build ID, other bytes
    answers = await asyncio.gather(*(_put(sg, own.build_id, "debuginfo", b) for b in bodies))
    assert sorted(a[0] for a in answers) == [201] + [409] * 7
    assert {a[2] for a in answers if a[0] == 409} == {
        f"a different upload of {own.build_id}/debuginfo is here; DELETE it first\n".encode()}
    winner = bodies[[a[0] for a in answers].index(201)]
    assert (await sg.get(f"/buildid/{own.build_id}/debuginfo"))[2] == winner
    rows = await sg.runner.app[STATE].repo.artifacts_of(own.build_id)
    assert [(r.size, r.sha256, r.pinned) for r in rows] == [
        (len(winner), hashlib.sha256(winner).hexdigest(), True)]

    got, deleted = await asyncio.gather(
        sg.get(f"/buildid/{own.build_id}/debuginfo"),
        sg.request("DELETE", f"/buildid/{own.build_id}/debuginfo", headers=_auth(ADMIN)))
    assert deleted[0] == 204
    assert got[0] == 404 or (got[0], got[2]) == (200, winner)
    assert (await sg.get(f"/buildid/{own.build_id}/debuginfo"))[0] == 404
    assert await sg.runner.app[STATE].repo.artifacts_of(own.build_id) == []


@pytest.mark.parametrize("extra", [{}, {"Range": "bytes=0-"}, {"If-None-Match": '"other"'}],
                         ids=["whole", "range", "conditional"])
@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
async def test_a_hit_on_an_upload_another_process_replaced_is_one_commit(
    start_symgate: SymgateFactory, own: Elf, elfs: ElfSet, tmp_path: Path, database_url: str,
    extra: dict[str, str], big: bool,
) -> None:
    """One process committed an upload and never served it; another deleted it and uploaded
    other bytes of the same size, and the first has not polled that notice yet (its index
    still holds the first commit). A hit there read the second file's bytes under the first
    row's headers (its X-DEBUGINFOD-FILE, its size), as only the sizes were compared: a body
    of one version with the other's headers. Either version whole is an answer; a mix is
    not. A small file's bytes are kept in memory, a big one is sent from its file."""
    elf = elfs.big if big else own
    base = make_config(tmp_path / "data", database_url, [],
                       cache=CacheConfig(purge_poll_s=3600))
    first_sg = await start_symgate(config=_config(base))
    second_sg = await start_symgate(config=_config(base))
    path = f"/buildid/{elf.build_id}/debuginfo"
    first = elf.debug.read_bytes()
    second = first.replace(b"GCC:", b"XCC:", 1)  # same size, same build ID
    assert second != first and len(second) == len(first)
    put = await _put(first_sg, elf.build_id, "debuginfo", first, **{"X-DEBUGINFOD-FILE": "1"})
    assert put[0] == 201
    assert (await second_sg.request("DELETE", path, headers=_auth(ADMIN)))[0] == 204
    put = await _put(second_sg, elf.build_id, "debuginfo", second, **{"X-DEBUGINFOD-FILE": "2"})
    assert put[0] == 201
    status, headers, body = await first_sg.get(path, headers=extra)
    assert status in (200, 206)
    assert (headers["X-DEBUGINFOD-FILE"], body) in (("1", first), ("2", second))
    got = {k.lower(): v for k, v in headers.items()}
    _, head = await first_sg.head(path)
    assert {k.lower(): v for k, v in head.items()}["etag"] == got["etag"]
    assert head["X-DEBUGINFOD-FILE"] == got["x-debuginfod-file"]


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
async def test_an_upload_whose_inode_changed_since_its_commit_is_served(
    start_symgate: SymgateFactory, own: Elf, elfs: ElfSet, tmp_path: Path, database_url: str,
    caplog: pytest.LogCaptureFixture, big: bool,
) -> None:
    """A chmod (or a backup restored) gives the file a change time after its row's commit, as
    a file put there by a later commit has: its bytes (a small file's) or SQL (a big one's)
    tell it is still the row's, and it is served and kept. Forgotten, an upload would be a
    404, its file on no row."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    elf = elfs.big if big else own
    bid, data = elf.build_id, elf.debug.read_bytes()
    assert (await _put(sg, bid, "debuginfo", data))[0] == 201
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(bid, "debuginfo").storage_name
    stored.chmod(0o600)
    for _ in range(2):
        status, _, body = await sg.get(f"/buildid/{bid}/debuginfo")
        assert status == 200 and body == data
    assert "is not the file its index entry describes" not in caplog.text


async def test_a_purge_applied_as_an_upload_commits_leaves_that_upload(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """An operator's purge reaches a serving process at its poll, and removes the files whose
    rows the purge deleted. A poll that came as another process's upload of the same key was
    between putting its file in place and writing its row (its commit, under the data dir's
    upload lock) found no row, and removed the new upload's file: the PUT had its 201, then
    a GET a 404 and its DELETE a 404. The await point: the upload held after its file's
    rename, before its row, while the poll runs."""
    base = make_config(tmp_path / "data", database_url, [],
                       cache=CacheConfig(purge_poll_s=3600))
    sg = await start_symgate(config=_config(base))
    state = sg.runner.app[STATE]
    notices = PurgeNotices(state.repo, state.service.cache)
    await notices.start()
    bid, data = own.build_id, own.debug.read_bytes()
    path = f"/buildid/{bid}/debuginfo"
    assert (await _put(sg, bid, "debuginfo", data))[0] == 201
    purged = await cli(config_file(sg, tmp_path), "cache", "purge", bid)
    assert purged.returncode == 0, purged.stderr
    cache = state.service.cache
    add, renamed, go_on = cache.add, asyncio.Event(), asyncio.Event()

    async def add_when_told(*args: object, **kwargs: object) -> None:
        renamed.set()
        await go_on.wait()
        await add(*args, **kwargs)  # type: ignore[arg-type]

    cache.add = add_when_told  # type: ignore[method-assign]
    put = asyncio.create_task(_put(sg, bid, "debuginfo", data))
    await asyncio.wait_for(renamed.wait(), 30)
    poll = asyncio.create_task(notices.poll())
    await asyncio.sleep(0.2)  # the poll as far as it goes before the upload's row
    go_on.set()
    assert (await put)[0] == 201
    assert await poll >= 1
    cache.add = add  # type: ignore[method-assign]
    status, _, body = await sg.get(path)
    assert status == 200 and body == data
    assert (await sg.request("DELETE", path, headers=_auth(ADMIN)))[0] == 204


def _waiting_for_a_lock(pid: int) -> bool:
    """Whether process `pid` is blocked waiting for a file lock (/proc/locks lists a waiter
    with "->")."""
    return any("->" in line and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


async def test_a_purge_from_the_cli_waits_for_a_commit_under_way(
    start_symgate: SymgateFactory, own: Elf, tmp_path: Path, database_url: str,
) -> None:
    """`symgate cache purge` deleted a key's rows, then removed its file: an upload of the key
    committed between the two (the upload lock held from its file's rename to its row) lost
    its file after its PUT was told 201. The purge now takes that lock for its rows and files:
    with a commit under way (the lock held here), it waits for it."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    bid, data = own.build_id, own.debug.read_bytes()
    assert (await _put(sg, bid, "debuginfo", data))[0] == 201
    store = sg.runner.app[STATE].service.cache.store
    lock = store.upload_lock()
    assert lock is not None
    purge = await asyncio.create_subprocess_exec(
        "symgate", "cache", "purge", bid, "--config", str(config_file(sg, tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            while purge.returncode is None and not _waiting_for_a_lock(purge.pid):
                await asyncio.sleep(0.05)
        assert purge.returncode is None, "the purge ran through a commit under way"
        assert (await sg.get(f"/buildid/{bid}/debuginfo"))[0] == 200
    finally:
        os.close(lock)
    out, err = await purge.communicate()
    assert purge.returncode == 0, err
    assert b"purged 1 artifacts" in out


def test_a_named_path_that_is_no_file_is_said_to_be_none_not_missing(tmp_path: Path) -> None:
    """`symgate upload /dev/null` (or a FIFO) said "no such file or directory" of a path that
    is there, and a FIFO is never opened: it would hold the command."""
    from proxy.tools.upload import Summary, find_items

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    summary = Summary()
    assert find_items([fifo, Path("/dev/null"), tmp_path / "absent"], summary) == []
    assert summary.skipped == [f"{fifo}: not a file or directory",
                               "/dev/null: not a file or directory",
                               f"{tmp_path / 'absent'}: no such file or directory"]


async def test_upload_cli_sends_a_file_the_server_holds_only_as_a_download_or_another_file(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    database_url: str,
) -> None:
    """The CLI's HEAD said 200 for a download of the key (or another upload of it), and the
    CLI reported the site's file "already there" and sent nothing: what was served was the
    upstream's copy, evictable, or another file, never the site's upload a PUT would have
    made. Only an upload of this very file is "already there" now."""
    sg = await _start(start_symgate, tmp_path, database_url, [debuginfod.url])
    bid = elfs.prog.build_id
    assert (await sg.get(f"/buildid/{bid}/debuginfo"))[0] == 200  # a download, cached
    await sg.settled()
    own = tmp_path / "own"
    own.mkdir()
    shutil.copy(elfs.prog.debug, own / "prog.debug")
    first = await _cli("upload", str(own), "--server", sg.url)
    assert first.stdout.splitlines()[0].startswith(
        "1 artifacts from 1 files: 1 uploaded, 0 already there, 0 failed"), first.stdout
    rows = await sg.runner.app[STATE].repo.artifacts_of(bid)
    assert [(r.scope, r.pinned, r.upstream) for r in rows] == [("", True, "upload")]
    again = await _cli("upload", str(own), "--server", sg.url)
    assert again.stdout.splitlines()[0] == (
        "1 artifacts from 1 files: 0 uploaded, 1 already there, 0 failed; 0 bytes sent")
    # A tenant's own file, where the shared scope has an upload of another file: its own.
    with (own / "prog.debug").open("ab") as f:
        f.write(b"rebuilt")
    mine = await _cli("upload", str(own), "--server", sg.url, token=ACME)
    assert mine.stdout.splitlines()[0].startswith(
        "1 artifacts from 1 files: 1 uploaded, 0 already there, 0 failed"), mine.stdout
    status, _, body = await sg.get(f"/buildid/{bid}/debuginfo", headers=_auth(ACME))
    assert status == 200 and body == (own / "prog.debug").read_bytes()
    # The admin's, the same path again: another upload of the key is a conflict, not "there".
    clash = await _cli("upload", str(own), "--server", sg.url)
    assert clash.returncode == 1 and "409" in clash.stdout, clash.stdout


async def test_upload_cli_of_a_tenant_sends_the_bytes_the_shared_scope_has_as_its_upload(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path, database_url: str,
) -> None:
    """A tenant's HEAD sees the shared scope's upload, and it carried that upload's sha256: the
    tenant's CLI, uploading the very same bytes, said "already there" and sent nothing. The
    tenant had no upload of its own, and lost the file when the shared one was deleted. The
    sha256 is said only to the scope the upload is in."""
    sg = await _start(start_symgate, tmp_path, database_url, [])
    bid = elfs.prog.build_id
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(elfs.prog.debug, files / "prog.debug")
    shared = await _cli("upload", str(files), "--server", sg.url)
    assert " 1 uploaded," in shared.stdout.splitlines()[0], shared.stdout
    status, headers, _ = await sg.request("HEAD", f"/buildid/{bid}/debuginfo",
                                          headers=_auth(ACME))
    assert status == 200 and "X-Symgate-Upload-SHA256" not in headers, headers
    status, headers, _ = await sg.request("GET", f"/buildid/{bid}/debuginfo",
                                          headers=_auth(ACME, Range="bytes=0-3"))
    assert status == 206 and "X-Symgate-Upload-SHA256" not in headers, headers
    mine = await _cli("upload", str(files), "--server", sg.url, token=ACME)
    assert " 1 uploaded," in mine.stdout.splitlines()[0], mine.stdout
    rows = await sg.runner.app[STATE].repo.artifacts_of(bid)
    assert sorted((r.scope, r.pinned) for r in rows) == [("", True), ("acme", True)]
    # Its own now: told so, and kept when the shared scope's goes.
    again = await _cli("upload", str(files), "--server", sg.url, token=ACME)
    assert " 0 uploaded, 1 already there," in again.stdout.splitlines()[0], again.stdout
    assert (await sg.request("DELETE", f"/buildid/{bid}/debuginfo",
                             headers=_auth(ADMIN)))[0] in (200, 204)
    status, _, body = await sg.get(f"/buildid/{bid}/debuginfo", headers=_auth(ACME))
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert (await sg.get(f"/buildid/{bid}/debuginfo"))[0] == 404


@pytest.mark.one_database  # SQL is not its subject
@pytest.mark.parametrize("linker", ["gold", "lld"])
async def test_a_library_of_data_alone_is_taken_as_the_executable(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, linker: str,
) -> None:
    """A shared library of data and no code (libicudata is one: built -nostdlib), linked by
    gold or lld, keeps an empty .text: a PROGBITS section of no bytes, which is not the
    SHT_NOBITS of a debug file's. The CLI sends it as the executable, as it is; it was a 422,
    "a debug file, not the executable", and the site could not upload its own library."""
    if shutil.which(f"ld.{linker}") is None:
        pytest.skip(f"needs ld.{linker}")
    src = tmp_path / "data.c"
    src.write_text("const int table[4] = {1, 2, 3, 4};\n")
    files = tmp_path / "files"
    files.mkdir()
    lib = files / "libdata.so"
    subprocess.run(["gcc", f"-fuse-ld={linker}", "-Wl,--build-id=sha1", "-shared", "-fPIC",
                    "-nostdlib", "-o", str(lib), str(src)], check=True)
    sg = await _start(start_symgate, tmp_path, database_url, [])
    sent = await _cli("upload", str(files), "--server", sg.url)
    assert sent.returncode == 0 and " 1 uploaded," in sent.stdout.splitlines()[0], sent.stdout
    status, headers, _ = await sg.request("HEAD", f"/buildid/{build_id_of_file(lib)}/executable")
    assert status == 200 and headers["Content-Length"] == str(lib.stat().st_size)


async def test_a_tenants_answers_are_private_to_any_http_cache_in_front(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    database_url: str,
) -> None:
    """Every artifact answer said `Cache-Control: public` with no Vary: an HTTP cache in front
    of symgate (a CDN, nginx's proxy_cache) could store a tenant's own upload, even fetched
    with its bearer token, and give it to anyone asking that URL, or give the tenant the
    shared file its upload shadows. A tenant's answers are private now, on every path (a
    miss streamed, a hit from memory, a range), and every answer varies on what tells a
    tenant."""
    sg = await _start(start_symgate, tmp_path, database_url, [debuginfod.url])
    bid = elfs.prog.build_id
    assert (await _put(sg, bid, "executable", elfs.prog.executable.read_bytes(), ACME))[0] \
        == 201
    vary = "Authorization, X-Scope-OrgID"
    # The tenant's: a miss (streamed), then hits; its own upload, whole and a range of it.
    for path, extra in ((f"/buildid/{bid}/debuginfo", {}),
                        (f"/buildid/{bid}/debuginfo", {}),
                        (f"/buildid/{bid}/executable", {}),
                        (f"/buildid/{bid}/executable", {"Range": "bytes=0-3"})):
        for method in ("GET", "HEAD"):
            status, headers, _ = await sg.request(method, path, headers=_auth(ACME, **extra))
            assert status in (200, 206), (path, method, status)
            assert headers["Cache-Control"] == "private" and headers["Vary"] == vary, headers
    # Anyone else's: the shared file, public, varying all the same (the quick path's too).
    await sg.settled()
    for _ in range(2):
        status, headers, _ = await sg.request("GET", f"/buildid/{bid}/debuginfo")
        assert status == 200 and headers["Cache-Control"] == "public", headers
        assert headers["Vary"] == vary, headers
    assert (await sg.get(f"/buildid/{bid}/executable"))[0] == 200  # the upstream's, not acme's
    # A token without a tenant's name (an admin's; on a token-only site, the nameless
    # tenant's) is as much the sender's own: a shared cache must not give it to anyone.
    status, headers, _ = await sg.request("GET", f"/buildid/{bid}/debuginfo",
                                          headers=_auth(ADMIN))
    assert status == 200 and headers["Cache-Control"] == "private", headers
    # A miss varies too (a 404 is cacheable by default): acme's upload is not hidden behind
    # the 404 another got for the same URL, nor its misses given to others. Twice: a miss
    # the upstream answered, then remembered (the quick path's answer, for a request with no
    # tenant).
    missing = "/buildid/" + "ab" * 20 + "/executable"
    for _ in range(2):
        status, headers, _ = await sg.request("GET", missing)
        assert status == 404 and headers["Vary"] == vary and "Cache-Control" not in headers
        status, headers, _ = await sg.request("GET", missing, headers=_auth(ACME))
        assert status == 404 and headers["Vary"] == vary, headers
        assert headers["Cache-Control"] == "private", headers
