"""Replicas sharing a bucket ([storage]): each artifact crosses from upstream once for the
whole cluster, a replica that dies mid-fetch is taken over, a symbol table is built once, a
purge reaches the bucket, a bucket that lies or goes down costs clients nothing.

Real parts: moto's S3 server on loopback (tests/buckets.py), PostgreSQL, the real elfutils
debuginfod as upstream (its own /metrics counts what it was asked), real `symgate serve`
processes where a process must die, in-process servers elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import hashlib
import itertools
import logging
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import obstore
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.artifacts.index import key_hash
from proxy.artifacts.scope import SHARED
from proxy.bucket import tier
from proxy.bucket.objects import Bucket
from proxy.config import (
    CacheConfig,
    ConfigError,
    DatabaseConfig,
    StorageConfig,
    TenantConfig,
    UploadConfig,
    load_config,
)
from proxy.health import Health
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.store.repository import BucketRecord, Repository, create_engine
from proxy.web.app import body_options, create_app
from proxy.web.state import STATE
from tests.buckets import BUCKET, FaultyBucket, Prefix, S3Server, s3_server, wait_gone
from tests.elfs import Elf, ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    Symgate,
    SymgateFactory,
    eventually,
    fast_upstream,
    free_port,
    make_config,
    read_broken,
    upstream_requests,
)
from tests.processes import run_in_thread, start_serve, stop_serve
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config
from tests.test_database_down import Forwarder

# A cluster's replicas share PostgreSQL.
on_postgresql = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = s3_server()
    yield server
    server.stop()


def _hash(elf: Elf, kind: str = "debuginfo") -> str:
    return key_hash("", ArtifactKey.from_id(f"{elf.build_id}/{kind}"))


def object_of(elf: Elf, kind: str = "debuginfo") -> str:
    return f"{kind}/{_hash(elf, kind)}"


def table_object_of(elf: Elf) -> str:
    return tier.object_path(tier.TABLE, tier.table_hash("", elf.build_id))


async def get(base: str, build_id: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(f"{base}/buildid/{build_id}/debuginfo") as r:
        return r.status, await r.read()


@pytest.fixture
def prefix(s3: S3Server) -> Prefix:
    return s3.prefix()


async def replicas(start_symgate: SymgateFactory, tmp_path: Path, upstream: str | None,
                   names: str, storage: StorageConfig, **options: Any) -> list[Symgate]:
    """In-process replicas, each a data dir (a disk) of its own, sharing the bucket; one
    upstream or none; `options` as start_symgate takes them, for every replica."""
    options.setdefault("symbolize", symbolize_config())
    return [await start_symgate([upstream] if upstream is not None else [],
                                data_dir=tmp_path / name, storage=storage, **options)
            for name in names]


@on_postgresql
async def test_fifty_cold_requests_over_three_replicas_make_one_upstream_request(
    tmp_path: Path, database_url: str, debuginfod: Debuginfod, elfs: ElfSet, prefix: Prefix
) -> None:
    procs: list[asyncio.subprocess.Process] = []
    try:
        # Real processes: three event loops, as on three machines, started at once.
        started = await asyncio.gather(*(start_serve(tmp_path, tmp_path / name, database_url,
                                                     debuginfod.url, extra=prefix.toml())
                                         for name in "abc"))
        procs += [proc for _, proc in started]
        bases = [base for base, _ in started]
        elf = elfs.nopie  # small: fifty bodies of it cost the test process little
        expected = elf.debug.read_bytes()
        before = await upstream_requests(debuginfod)
        spread = itertools.islice(itertools.cycle(bases), 50)
        got = await asyncio.gather(*(get(base, elf.build_id) for base in spread))
        assert [status for status, _ in got] == [200] * 50
        assert all(body == expected for _, body in got), "a body differs from the upstream's"
        assert await upstream_requests(debuginfod) == before + 1
        hows = [await _cluster_fetches(base) for base in bases]
        assert sum(h.get("upstream", 0) for h in hows) == 1, hows
        assert all(sum(h.values()) == 1 for h in hows), hows  # one fetch per replica
        objects = await prefix.objects()
        assert objects.pop(object_of(elf)) == expected
        # Besides it, at most the symbol table its commit built; nothing half-written.
        assert all(path.startswith("symtab/") for path in objects), objects.keys()
    finally:
        await stop_serve(procs)


@on_postgresql
async def test_a_file_one_replica_fetched_is_read_from_the_bucket_by_the_others(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    before = await upstream_requests(debuginfod)
    assert await get(a.url, elfs.prog.build_id) == (200, elfs.prog.debug.read_bytes())
    await eventually(lambda: _published(a, prefix, elfs.prog))
    status, headers, body = await b.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert (status, body) == (200, elfs.prog.debug.read_bytes())
    _, on_a, _ = await a.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert _described(headers) == _described(on_a), "the bucket copy lost what upstream said"
    assert await upstream_requests(debuginfod) == before + 1
    assert await a.metric("symgate_cluster_fetches_total", how="upstream") == 1
    assert await b.metric("symgate_cluster_fetches_total", how="bucket") == 1
    # Now b's own: a hit, the bucket not asked.
    gets = await b.metric("symgate_bucket_requests_total", op="get", outcome="ok")
    assert (await b.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    assert await b.metric("symgate_bucket_requests_total", op="get", outcome="ok") == gets


async def _cluster_fetches(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        text = await r.text()
    return {how: float(n) for how, n in re.findall(
        r'^symgate_cluster_fetches_total\{how="(\w+)"\} (\S+)$', text, re.M) if float(n)}


def _described(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()
            if k.lower().startswith("x-debuginfod-") or k.lower() == "last-modified"}


async def _has(prefix: Prefix, path: str) -> bool:
    return path in await prefix.paths()


async def _published(sg: Symgate, prefix: Prefix, elf: Elf) -> bool:
    """`elf`'s debug file in the bucket and in its catalogue: another replica finds a copy by
    its row, which `sg` writes after the object's upload is complete. Waited for on the object
    alone, a replica that asked in between found no copy, took the fetch lease, and read the
    copy as one it had waited for ("waited", not "bucket": 1 run of 3 under load)."""
    state = sg.runner.app[STATE]
    return await _has(prefix, object_of(elf)) \
        and _hash(elf) in await state.repo.bucket_objects([_hash(elf)])


@on_postgresql
async def test_a_file_too_big_for_every_replicas_disk_still_crosses_from_upstream_once(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """Served and not kept on each disk, but kept in the bucket: a replica waiting on the
    fetching one's lease reads the bucket's copy rather than fetch it upstream itself."""
    held = faults.url_for("held")  # sends half the body, then waits for `release`
    small = CacheConfig(max_bytes=elfs.big.debug.stat().st_size // 2)
    a, b = await replicas(start_symgate, tmp_path, held, "ab", prefix.config(), cache=small)
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    on_a = asyncio.ensure_future(a.get(path))
    await asyncio.wait_for(faults.held_half_sent.wait(), 30)  # a holds the key's lease
    on_b = asyncio.ensure_future(b.get(path))
    await asyncio.sleep(0.5)  # b waits on the lease by now; if not, it finds the copy later
    faults.release.set()
    expected = elfs.big.debug.read_bytes()
    assert [(r[0], r[2]) for r in await asyncio.gather(on_a, on_b)] == [(200, expected)] * 2
    assert faults.count("held") == 1
    assert await a.metric("symgate_cache_not_kept_total") == 1
    assert (await b.metric("symgate_cluster_fetches_total", how="waited")
            + await b.metric("symgate_cluster_fetches_total", how="bucket")) == 1
    assert (await prefix.objects())[object_of(elfs.big)] == expected
    # Neither disk keeps it, and each answers it again from the bucket, not upstream.
    assert (await a.get(path))[::2] == (200, expected)
    assert faults.count("held") == 1


async def _uploaded_to_a(start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet,
                         faults: FaultUpstream, prefix: Prefix
                         ) -> tuple[Symgate, Symgate, str, bytes, dict[str, str]]:
    """Replicas a and b sharing the bucket, prog's debug file uploaded to a and nowhere else
    (their upstream has nothing): a, b, its path, its bytes and the uploader's headers."""
    token = "symgate-test-upload-token"
    a, b = await replicas(start_symgate, tmp_path, faults.url_for("notfound"), "ab",
                          prefix.config(), upload=UploadConfig(admin_tokens=(token,)),
                          cache=CacheConfig(purge_poll_s=0.2))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    auth = {"Authorization": f"Bearer {token}"}
    assert (await a.request("PUT", path, data=data, headers=auth))[0] == 201
    return a, b, path, data, auth


@on_postgresql
async def test_an_upload_to_one_replica_is_served_by_every_replica_and_deleted_from_all(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    a, b, path, data, auth = await _uploaded_to_a(start_symgate, tmp_path, elfs, faults, prefix)
    assert (await b.get(path))[::2] == (200, data)  # at once: the PUT waited for the bucket
    assert faults.count("notfound") == 0
    assert (await a.request("DELETE", path, headers=auth))[0] == 204
    assert object_of(elfs.prog) not in await prefix.objects()

    async def gone_from_b() -> bool:
        return (await b.get(path))[0] == 404

    await eventually(gone_from_b, timeout=10)


@on_postgresql
async def test_a_copy_of_an_upload_committed_after_its_delete_elsewhere_is_not_kept(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """A replica commits a copy it took from the bucket after its client had the last byte:
    a DELETE on another replica meanwhile found no row of that copy to remove, and the copy's
    row, written after it, kept the deleted upload served there for as long as it was
    cached."""
    a, b, path, data, auth = await _uploaded_to_a(start_symgate, tmp_path, elfs, faults, prefix)
    # b's commit waits for its data dir's upload lock, as while an upload is committed there.
    lock = os.open(b.config.cache_dir / "uploads.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert (await b.get(path))[::2] == (200, data)
        assert (await a.request("DELETE", path, headers=auth))[0] == 204
    finally:
        os.close(lock)
    await b.settled()

    async def gone_from_b() -> bool:
        return (await b.get(path))[0] == 404

    await eventually(gone_from_b, timeout=10)
    assert not list((b.config.cache_dir / "objects").rglob("debuginfo"))


@on_postgresql
async def test_an_upload_over_a_download_replaces_it_on_every_replica(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    token = "symgate-test-upload-token"
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config(),
                          upload=UploadConfig(admin_tokens=(token,)),
                          cache=CacheConfig(purge_poll_s=0.2))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    downloaded = elfs.prog.debug.read_bytes()
    uploaded = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    for sg in (a, b):  # a copy on each disk (b's from the bucket), and in each memory
        for _ in range(2):
            assert (await sg.get(path))[::2] == (200, downloaded)
        await sg.settled()
    auth = {"Authorization": f"Bearer {token}"}
    assert (await a.request("PUT", path, data=uploaded, headers=auth))[0] == 201
    assert (await prefix.objects())[object_of(elfs.prog)] == uploaded

    async def b_serves_the_upload() -> bool:
        return (await b.get(path))[::2] == (200, uploaded)

    await eventually(b_serves_the_upload, timeout=10)
    assert (await a.get(path))[::2] == (200, uploaded)


@on_postgresql
async def test_a_local_file_gone_before_its_upload_leaves_the_bucket_up(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    """A file that left this disk between its hash and its upload (a table dropped or
    rebuilt meanwhile) is this replica's affair, not the bucket's: taken for a bucket failure,
    the bucket went unasked for retry_s, and an upload published the next moment reached no
    other replica (CI's failure of the test above)."""
    token = "symgate-test-upload-token"
    sg = await start_symgate([debuginfod.url], data_dir=tmp_path / "a",
                             storage=prefix.config(), upload=UploadConfig(admin_tokens=(token,)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    state = sg.runner.app[STATE]
    shared = state.service.tier
    assert shared is not None
    cached = state.service.cache.peek(SHARED, ArtifactKey.parse(elfs.prog.build_id, "debuginfo"))
    assert cached is not None
    other = replace(cached.record, key_hash=hashlib.sha256(b"gone").hexdigest())
    assert not await shared.publish(other, tmp_path / "gone")
    assert shared.bucket.available
    uploaded = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    assert (await sg.request("PUT", path, data=uploaded,
                             headers={"Authorization": f"Bearer {token}"}))[0] == 201
    assert (await prefix.objects())[object_of(elfs.prog)] == uploaded


@on_postgresql
async def test_a_replica_killed_mid_fetch_loses_its_lease_and_another_takes_the_fetch_over(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, elfs: ElfSet,
    faults: FaultUpstream, prefix: Prefix
) -> None:
    held = faults.url_for("held")  # sends half the body, then waits for `release`
    base, proc = await start_serve(tmp_path, tmp_path / "a", database_url, held,
                                   extra=prefix.toml())
    try:
        cut = asyncio.ensure_future(read_broken(f"{base}/buildid/{elfs.big.build_id}/debuginfo"))
        await asyncio.wait_for(faults.held_half_sent.wait(), 30)
        proc.send_signal(signal.SIGKILL)  # holding the key's lease, half the file written
        await proc.wait()
        await cut
    finally:
        await stop_serve([proc])
    faults.release.set()  # the next request for it is answered whole
    (b,) = await replicas(start_symgate, tmp_path, held, "b", prefix.config())
    status, _, body = await b.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert (status, body) == (200, elfs.big.debug.read_bytes())
    assert faults.count("held") == 2
    assert await b.metric("symgate_cluster_fetches_total", how="upstream") == 1
    await b.settled()
    objects = await prefix.objects()
    assert objects.pop(object_of(elfs.big)) == elfs.big.debug.read_bytes()
    assert all(path.startswith("symtab/") for path in objects), "a partial object"


def _profile(elfs: ElfSet) -> bytes:
    return make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()


@on_postgresql
async def test_a_symbol_table_built_on_one_replica_is_used_by_another_without_a_build(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    status, _, on_a = await post(a, _profile(elfs))
    assert status == 200
    assert await a.metric("symgate_symtab_builds_total", result="ok") == 1

    async def table_in_bucket() -> bool:
        return any(p.startswith("symtab/") for p in await prefix.objects())

    await eventually(table_in_bucket)
    await a.settled()  # what a fetched for it is in the bucket too
    before = await upstream_requests(debuginfod)
    status, _, on_b = await post(b, _profile(elfs))
    assert status == 200 and on_b == on_a
    assert await b.metric("symgate_symtab_builds_total", result="ok") == 0
    assert await b.metric("symgate_symtab_cache_total", result="bucket") == 1
    assert await upstream_requests(debuginfod) == before


@on_postgresql
async def test_a_purge_on_one_replica_removes_the_bucket_copy_and_reaches_the_others(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, debuginfod: Debuginfod,
    elfs: ElfSet, prefix: Prefix
) -> None:
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    assert (await get(a.url, elfs.prog.build_id))[0] == 200
    await eventually(lambda: _has(prefix, table_object_of(elfs.prog)))  # a's prebuild's
    assert (await get(b.url, elfs.prog.build_id))[0] == 200
    await a.settled()
    await b.settled()
    config = tmp_path / "admin.toml"
    config.write_text(f'[server]\ndata_dir = "{tmp_path / "a"}"\n'
                      f'[database]\nurl = "{database_url}"\n{prefix.toml()}')
    purged = await run_in_thread(["symgate", "cache", "purge", elfs.prog.build_id,
                                  "--config", str(config)], timeout=60)
    assert purged.returncode == 0, purged.stderr
    objects = await prefix.objects()
    assert object_of(elfs.prog) not in objects
    assert not [p for p in objects if p.startswith("symtab/")], "its symbol table stayed"
    before = await upstream_requests(debuginfod)

    async def b_fetches_it_again() -> bool:
        assert (await get(b.url, elfs.prog.build_id))[0] == 200
        return await upstream_requests(debuginfod) == before + 1

    await eventually(b_fetches_it_again, timeout=10)


@on_postgresql
async def test_a_bucket_copy_that_does_not_match_its_row_is_refused_and_deleted(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    assert (await get(a.url, elfs.other.build_id))[0] == 200
    await eventually(lambda: _published(a, prefix, elfs.other))
    real = elfs.other.debug.read_bytes()
    forged = bytearray(real)
    forged[len(forged) // 2] ^= 0xFF  # the build ID note intact: only the row's sha256 tells
    await prefix.put(object_of(elfs.other), bytes(forged))
    status, received, cut = await read_broken(f"{b.url}/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 502 or (status == 200 and cut and received < len(real)), (status, cut)
    assert (await b.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[2] == real

    async def forged_copy_gone() -> bool:
        return (await prefix.objects()).get(object_of(elfs.other)) != bytes(forged)

    await eventually(forged_copy_gone)


@on_postgresql
async def test_the_bucket_down_for_ten_seconds_under_load_costs_no_5xx_and_is_caught_up(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    s3: S3Server, prefix: Prefix, database_url: str
) -> None:
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    assert (await get(a.url, elfs.prog.build_id))[0] == 200  # in the bucket: b will look there
    await eventually(lambda: _has(prefix, object_of(elfs.prog)))
    s3.stop()
    await wait_gone(s3)
    statuses: list[int] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    try:
        while loop.time() < end:
            # b has none of them: the bucket's row for prog, then upstream for all of them.
            for replica in (b, a):
                got = await asyncio.gather(*(get(replica.url, elf.build_id)
                                             for elf in (elfs.prog, elfs.other, elfs.big)))
                statuses += [status for status, _ in got]
            await asyncio.sleep(0.2)
    finally:
        s3.start()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert await b.metric("symgate_cluster_fetches_total", how="alone") >= 1

    async def caught_up() -> bool:  # what b fetched while the bucket was down is there now
        objects = await prefix.objects()
        return all(object_of(elf) in objects for elf in (elfs.prog, elfs.other, elfs.big))

    await eventually(caught_up, timeout=20)
    repo = Repository(create_engine(database_url))
    try:
        rows = await repo.bucket_objects([_hash(elf) for elf in (elfs.other, elfs.big)])
    finally:
        await repo.close()
    for elf in (elfs.other, elfs.big):
        assert rows[_hash(elf)].sha256 == hashlib.sha256(elf.debug.read_bytes()).hexdigest()
    # Both replicas fetched other and big alone, and both caught up: one upload each still.
    await asyncio.sleep(1.0)  # a few more catch-up rounds (sync_s 0.3 s) on each
    uploads = [await r.metric("symgate_bucket_uploads_total", kind="debuginfo") for r in (a, b)]
    assert sum(uploads) == 3, uploads


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
async def test_a_lease_has_one_holder_until_it_lapses(database_url: str) -> None:
    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    repo = Repository(create_engine(database_url))
    now = datetime.now(UTC)
    later = now + timedelta(seconds=10)
    try:
        assert await repo.take_lease("fetch:k", "a", now, later)
        assert await repo.take_lease("fetch:k", "a", now, later)  # its holder's already
        assert not await repo.take_lease("fetch:k", "b", now, later)
        assert await repo.lease_of("fetch:k") == ("a", later)
        # Past its time, unrenewed: the next taker has it, and the old holder cannot renew.
        assert await repo.take_lease("fetch:k", "b", later + timedelta(seconds=1),
                                     later + timedelta(seconds=11))
        assert not await repo.renew_lease("fetch:k", "a", later)
        await repo.drop_lease("fetch:k", "a")  # not a's to drop
        assert (await repo.lease_of("fetch:k") or ("",))[0] == "b"
        await repo.drop_lease("fetch:k", "b")
        assert await repo.lease_of("fetch:k") is None
    finally:
        await repo.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_cancel_while_a_lease_is_released_is_a_cancel_and_the_lease_goes(
    database_url: str
) -> None:
    """Cancelled as it waited for its renewal to stop, release() took the cancel for the
    renewal's and went on: the task that released (a fetch at a server's stop) ran on."""
    from proxy.bucket.leases import Leases
    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    repo = Repository(create_engine(database_url))
    try:
        lease = await Leases(repo, "r", 30.0).take("fetch:k")
        assert lease is not None
        releasing = asyncio.ensure_future(lease.release())
        await asyncio.sleep(0)  # at its first await: the renewal's end
        releasing.cancel()
        await asyncio.gather(releasing, return_exceptions=True)
        assert releasing.cancelled()
        assert await repo.lease_of("fetch:k") is None
    finally:
        await repo.close()


@on_postgresql
async def test_a_lease_being_released_is_not_taken_again_by_its_own_process(
    database_url: str
) -> None:
    """The name was let go of before the row was: a second job of the process taking it
    meanwhile (the row is its holder's to take again) could have its row deleted under it
    by the first's DELETE, and the other replicas stop waiting and fetch the key too. Driven
    by a lock on the row (another session's SELECT ... FOR UPDATE), which holds the DELETE."""
    import asyncpg

    from proxy.bucket.leases import Leases
    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    repo = Repository(create_engine(database_url))
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    locker, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        leases = Leases(repo, "r", 30.0)
        first = await leases.take("fetch:k")
        assert first is not None
        locking = locker.transaction()
        await locking.start()
        await locker.fetch("SELECT name FROM leases WHERE name = 'fetch:k' FOR UPDATE")
        releasing = asyncio.ensure_future(first.release())

        async def dropping() -> bool:
            return bool(await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'DELETE FROM leases%'"))

        await eventually(dropping)
        taking = asyncio.ensure_future(leases.take("fetch:k"))
        await asyncio.sleep(0)
        await locking.rollback()
        await releasing
        second = await taking
        if second is not None:
            await second.release()
        assert second is None, "taken again while its row was being dropped"
        assert await repo.lease_of("fetch:k") is None
    finally:
        await locker.close()
        await watcher.close()
        await repo.close()


def test_storage_settings_are_checked(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[storage]\nurl = "gs://bucket"\n')
    with pytest.raises(ConfigError, match=r"storage\.url: expected s3://BUCKET"):
        load_config(config)
    config.write_text('[storage]\nurl = "s3://bucket/p/"\nendpoint = "minio:9000"\n')
    with pytest.raises(ConfigError, match=r"storage\.endpoint: expected an http"):
        load_config(config)
    config.write_text('[storage]\nurl = "s3://bucket/p/"\n')
    loaded = load_config(config, {"SYMGATE_DATABASE_URL": "postgresql+asyncpg://db/symgate"})
    assert loaded.storage is not None and loaded.storage.url == "s3://bucket/p"
    assert loaded.database_url == "postgresql+asyncpg://db/symgate"


@on_postgresql
async def test_the_bucket_is_kept_under_its_budget_oldest_read_first(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    # Room for other and big and their symbol tables (some 1.7 KiB each), not for prog's
    # 8 KiB too: prog and its table, written first, go.
    budget = sum(elf.debug.stat().st_size for elf in (elfs.other, elfs.big)) + (
        elfs.prog.debug.stat().st_size // 2)
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab",
                          prefix.config(max_bytes=budget))
    for elf in (elfs.prog, elfs.other, elfs.big):  # prog is read longest ago
        assert (await get(a.url, elf.build_id))[0] == 200
        for path in (object_of(elf), table_object_of(elf)):  # in this order of writing
            await eventually(lambda path=path: _has(prefix, path))  # type: ignore[misc]

    async def prog_evicted() -> bool:
        files = {p for p in await prefix.objects() if p.startswith("debuginfo/")}
        return files == {object_of(elfs.other), object_of(elfs.big)}

    await eventually(prog_evicted, timeout=10)
    before = await upstream_requests(debuginfod)
    for elf in (elfs.other, elfs.big):
        assert (await get(b.url, elf.build_id))[0] == 200
    assert await upstream_requests(debuginfod) == before
    assert (await get(b.url, elfs.prog.build_id))[0] == 200
    assert await upstream_requests(debuginfod) == before + 1


@on_postgresql
async def test_a_bucket_that_accepts_and_never_answers_costs_a_miss_only_its_timeout(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads nothing, answers nothing, closes nothing

    silent = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a", prefix.config())
        assert (await get(a.url, elfs.prog.build_id))[0] == 200
        await eventually(lambda: _published(a, prefix, elfs.prog))
        # b reaches the bucket through an endpoint that hangs: its catalogue says prog is
        # there, its GET never gets an answer, and its uploads never finish.
        (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b",
                              prefix.config(endpoint=f"http://127.0.0.1:{port}",
                                            read_timeout_s=1.0, retry_s=30.0))
        got = await asyncio.gather(*(get(b.url, elf.build_id)
                                     for elf in (elfs.prog, elfs.other, elfs.big)))
        assert got == [(200, elf.debug.read_bytes())
                       for elf in (elfs.prog, elfs.other, elfs.big)]
        assert held, "the bucket was never asked"
        assert await b.metric("symgate_cluster_fetches_total", how="alone") >= 1
        # Nothing waits on an upload that hangs: the lease of each key is free again.
        await b.settled()
        assert (await get(a.url, elfs.other.build_id))[0] == 200
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


class _DyingBucket:
    """A way to the S3 server that forwards everything until a response has carried `after`
    bytes, then cuts that response and refuses every later connection: a bucket that dies
    in the middle of a copy (and is not back when the client library retries)."""

    def __init__(self, endpoint: str, after: int) -> None:
        self._host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        self._port = int(port)
        self._after = after
        self.cut = False
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        if self.cut:
            client_w.transport.abort()
            return
        s3_r, s3_w = await asyncio.open_connection(self._host, self._port)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, limit: bool) -> None:
            passed = 0
            while data := await r.read(65536):
                if limit and passed + len(data) > self._after:
                    w.write(data[:self._after - passed])
                    await w.drain()
                    self.cut = True
                    client_w.transport.abort()
                    s3_w.transport.abort()
                    return
                passed += len(data)
                w.write(data)
                await w.drain()
            w.close()

        with contextlib.suppress(ConnectionError):
            await asyncio.gather(pump(client_r, s3_w, False), pump(s3_r, client_w, True))


async def _big_file_in_the_bucket(start_symgate: SymgateFactory, tmp_path: Path,
                                  debuginfod: Debuginfod, elfs: ElfSet, prefix: Prefix
                                  ) -> tuple[str, bytes]:
    """The big debug file fetched by a replica and published to the bucket: its path, bytes."""
    (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a", prefix.config())
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    assert (await a.get(path))[::2] == (200, expected)
    await eventually(lambda: _published(a, prefix, elfs.big))
    return path, expected


@on_postgresql
async def test_a_bucket_copy_that_breaks_off_is_finished_from_upstream_not_cut(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server
) -> None:
    path, expected = await _big_file_in_the_bucket(start_symgate, tmp_path, debuginfod,
                                                   elfs, prefix)
    before = await upstream_requests(debuginfod)
    dying = _DyingBucket(s3.endpoint, after=len(expected) // 2)
    async with dying as endpoint:
        (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b",
                              prefix.config(endpoint=endpoint, retry_s=30.0))
        # Ten clients on the one copy: each gets the whole file, none a spliced or cut one.
        got = await asyncio.gather(*(b.get(path) for _ in range(10)))
        assert [(status, body) for status, _, body in got] == [(200, expected)] * 10
        assert dying.cut, "the copy was never cut"
    assert await b.metric("symgate_bucket_copies_resumed_total") == 1
    assert await upstream_requests(debuginfod) == before + 1
    await b.settled()
    assert (await b.get(path))[::2] == (200, expected)  # kept: a hit now
    assert await upstream_requests(debuginfod) == before + 1


@on_postgresql
@pytest.mark.parametrize("lie", ["short", "long"])
async def test_a_bucket_copy_of_the_wrong_size_is_finished_from_upstream_not_cut(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server, database_url: str, lie: str
) -> None:
    """A bucket that answers a copy with fewer bytes than were written there, or more, each
    a whole answer by its Content-Length: what was sent of it may be the file's start, as
    with a copy that breaks off, and is finished from an upstream once checked against its
    first bytes. The client was cut off, and had to come again for its file."""
    path, expected = await _big_file_in_the_bucket(start_symgate, tmp_path, debuginfod,
                                                   elfs, prefix)
    before = await upstream_requests(debuginfod)
    async with FaultyBucket(s3) as bucket:
        (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b",
                              prefix.config(endpoint=bucket.endpoint, retry_s=30.0))
        bucket.add(lie, "GET", object_of(elfs.big), times=1)
        # The copy that runs on is read no further, and its connection let go: left to the
        # garbage collector, the bucket's side stayed blocked writing the rest, for minutes.
        gc.disable()
        try:
            assert (await b.get(path))[::2] == (200, expected)
            await eventually(lambda: bucket.answering == 0)
        finally:
            gc.enable()
        assert bucket.faults[0].hits == 1, "the bucket was not asked"
    assert await b.metric("symgate_bucket_copies_resumed_total") == 1
    assert await upstream_requests(debuginfod) == before + 1
    repo = Repository(create_engine(database_url))
    try:  # the copy that did not match its row is refused all the same
        assert _hash(elfs.big) not in await repo.bucket_objects([_hash(elfs.big)])
    finally:
        await repo.close()


@on_postgresql
@pytest.mark.parametrize("where", ["head", "tail"])
async def test_a_broken_off_copy_is_not_finished_with_an_upstreams_different_bytes(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server, faults: FaultUpstream, where: str
) -> None:
    """The head already sent must be the upstream's head too, or the client would get one
    file's start and another's end; and the rest must make the copy's file (its sha256), or
    another file of the same build ID, size and head (a tenant's private server's, say) would
    be kept under the copy's scope, the shared one: cut off then, before its last byte, and
    nothing kept."""
    path, expected = await _big_file_in_the_bucket(start_symgate, tmp_path, debuginfod,
                                                   elfs, prefix)
    size = len(expected)
    mode = f"flipped-{where}"
    async with _DyingBucket(s3.endpoint, after=size // 2) as endpoint:
        (b,) = await replicas(start_symgate, tmp_path, faults.url_for(mode), "b",
                              prefix.config(endpoint=endpoint, retry_s=30.0))
        status, got, cut = await read_broken(b.url + path)
    assert (status, cut) == (200, True) and got < size
    assert faults.count(mode) == 1
    assert await b.metric("symgate_bucket_copies_resumed_total") == 1
    await b.settled()
    only_cached = {"Cache-Control": "only-if-cached"}
    assert (await b.request("GET", path, headers=only_cached))[0] == 504  # not cached


@on_postgresql
async def test_the_database_lost_mid_fetch_under_the_lease_costs_no_client_its_file(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, elfs: ElfSet,
    faults: FaultUpstream, prefix: Prefix
) -> None:
    """The lease's holder can no longer renew it, the waiting replica can no longer look
    for the copy: each serves its clients all the same, from upstream, and once the
    database is back the file reaches the bucket."""
    real = urlsplit(database_url)
    forwarder = Forwarder(real.hostname or "127.0.0.1", real.port or 5432)
    await forwarder.start()
    via = urlunsplit(real._replace(netloc=f"127.0.0.1:{forwarder.port}"))
    # Sends half the body, then waits for `release`, some 1.8 s below: fast_upstream gives a
    # held mode's reads room for that (harness._HELD_MODES).
    held = faults.url_for("held")
    a, b = [await start_symgate(config=make_config(
        tmp_path / name, via, [held], storage=prefix.config(), symbolize=symbolize_config(),
        database=DatabaseConfig(url=via, timeout_s=1.0))) for name in "ab"]
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    on_a = asyncio.ensure_future(a.get(path))
    await asyncio.wait_for(faults.held_half_sent.wait(), 30)  # a holds the key's lease
    on_b = asyncio.ensure_future(b.get(path))
    await asyncio.sleep(0.3)  # b waits on a's lease, polling the database
    await forwarder.cut()
    await asyncio.sleep(1.5)  # past a's renewal (lease_s / 3) and b's next looks
    faults.release.set()
    assert [(r[0], r[2]) for r in await asyncio.gather(on_a, on_b)] == [(200, expected)] * 2
    assert await b.metric("symgate_cluster_fetches_total", how="alone") == 1
    assert faults.count("held") == 2  # the price of the outage: b could not wait for a
    await forwarder.start()

    async def caught_up() -> bool:
        # Both replicas have the file and may both upload it; moto (not S3) can fail a GET
        # while a second upload of the same key completes.
        with contextlib.suppress(obstore.exceptions.GenericError):
            return (await prefix.objects()).get(object_of(elfs.big)) == expected
        return False

    await eventually(caught_up, timeout=30)


@on_postgresql
async def test_objects_unread_for_max_age_leave_the_bucket(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                          prefix.config(max_age_s=1.0))
    assert (await get(a.url, elfs.cpp.build_id))[0] == 200
    await eventually(lambda: _has(prefix, object_of(elfs.cpp)))

    async def aged_out() -> bool:
        return object_of(elfs.cpp) not in await prefix.objects()

    await eventually(aged_out, timeout=10)
    # Its local copy is this replica's own: still a hit, and not uploaded again.
    assert (await get(a.url, elfs.cpp.build_id))[0] == 200
    await asyncio.sleep(1.0)  # three catch-up rounds
    assert await a.metric("symgate_bucket_uploads_total", kind="debuginfo") == 1


ALPHA = "alpha-token-of-sixteen-or-more"


async def tenant_replicas(start_symgate: SymgateFactory, tmp_path: Path, upstreams: list[str],
                          prefix: Prefix) -> list[Symgate]:
    """Two replicas sharing the bucket, with a tenant `alpha` that has no sources of its own
    (it shares the shared scope with every other such tenant) but may upload."""
    return [await start_symgate(upstreams, data_dir=tmp_path / name, storage=prefix.config(),
                                tenants={"alpha": TenantConfig(tokens=(ALPHA,))},
                                cache=CacheConfig(purge_poll_s=0.2))
            for name in "ab"]


@on_postgresql
async def test_a_tenants_upload_copied_from_the_bucket_is_never_streamed_to_another_tenant(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """Tenants without sources share the shared scope's fetches: replica b's copy of alpha's
    upload must not be one of them, or whoever asks b meanwhile gets alpha's file."""
    a, b = await tenant_replicas(start_symgate, tmp_path, [faults.url_for("notfound")], prefix)
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    data = elfs.big.debug.read_bytes()
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    assert (await a.request("PUT", path, data=data, headers=alpha))[0] == 201
    async with aiohttp.ClientSession() as s, s.get(b.url + path, headers=alpha) as r:
        assert r.status == 200
        first = await r.content.readexactly(1 << 20)  # b's copy from the bucket under way
        others = await asyncio.gather(b.get(path, headers={"X-Scope-OrgID": "mallory"}),
                                      b.get(path))
        rest = await r.read()
    assert first + rest == data
    assert [status for status, _, _ in others] == [404, 404]


@on_postgresql
async def test_a_tenants_upload_learnt_of_during_its_miss_is_still_looked_for(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """Replica b learns which tenants have uploads every purge_poll_s. A request of alpha's
    that found b not knowing of alpha's upload asks the upstream; if b learns of it while the
    upstream answers (a miss), the upload must still be looked for: it was answered 404 (a
    race CI met under load: the PUT had its 201, the bucket had the file)."""
    faults.release.clear()
    a, b = await replicas(start_symgate, tmp_path, faults.url_for("hold404"), "ab",
                          prefix.config(), tenants={"alpha": TenantConfig(tokens=(ALPHA,))},
                          cache=CacheConfig(purge_poll_s=3600.0))
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    data = elfs.big.debug.read_bytes()
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    assert (await a.request("PUT", path, data=data, headers=alpha))[0] == 201
    asked = faults.count("hold404")
    got = asyncio.ensure_future(b.get(path, headers=alpha))
    async def upstream_asked() -> bool:
        return faults.count("hold404") > asked

    await eventually(upstream_asked)  # b asks its upstream
    await b.runner.app[STATE].service.refresh_uploaders()  # and learns of alpha's upload
    faults.release.set()
    status, _, body = await got
    assert status == 200 and body == data, status


@on_postgresql
async def test_another_tenants_remembered_miss_never_hides_a_tenants_upload(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """mallory's 404 for a build ID, remembered in the shared scope for a minute or more,
    speaks for the shared upstreams, not for alpha's upload of it."""
    a, b = await tenant_replicas(start_symgate, tmp_path, [faults.url_for("notfound")], prefix)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    assert (await a.request("PUT", path, data=data, headers=alpha))[0] == 201
    for _ in range(2):  # the second from the remembered miss
        assert (await b.get(path, headers={"X-Scope-OrgID": "mallory"}))[0] == 404
    assert faults.count("notfound") == 1

    async def alpha_gets_it() -> bool:
        return (await b.get(path, headers=alpha))[::2] == (200, data)

    # At once if b has learnt that alpha has uploads (it looks every purge_poll_s), else from
    # then on.
    await eventually(alpha_gets_it, timeout=5)
    assert (await b.get(path, headers={"X-Scope-OrgID": "mallory"}))[0] == 404


@on_postgresql
async def test_an_upload_reaches_replicas_without_any_remote_upstream(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, prefix: Prefix
) -> None:
    """No remote source to remember a miss of is no proof of one: the bucket still holds
    what another replica took in."""
    token = "symgate-test-upload-token"
    a, b = await replicas(start_symgate, tmp_path, None, "ab", prefix.config(),
                          upload=UploadConfig(admin_tokens=(token,)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    assert (await b.get(path))[0] == 404
    put = await a.request("PUT", path, data=data, headers={"Authorization": f"Bearer {token}"})
    assert put[0] == 201
    assert (await b.get(path))[::2] == (200, data)
    assert (await b.get("/buildid/" + "cd" * 20 + "/debuginfo"))[0] == 404


@on_postgresql
async def test_a_section_of_a_tenants_upload_too_big_to_keep_stays_the_tenants(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """A copy from the bucket that b's disk cannot keep is cut from where it was read: the
    section it gives is kept under alpha's scope, not the shared one."""
    nowhere = faults.url_for("notfound")
    data = elfs.prog.debug.read_bytes()
    a = await start_symgate([nowhere], data_dir=tmp_path / "a", storage=prefix.config(),
                            tenants={"alpha": TenantConfig(tokens=(ALPHA,))})
    b = await start_symgate([nowhere], data_dir=tmp_path / "b", storage=prefix.config(),
                            tenants={"alpha": TenantConfig(tokens=(ALPHA,))},
                            cache=CacheConfig(max_bytes=len(data) // 2))
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    put = await a.request("PUT", f"/buildid/{elfs.prog.build_id}/debuginfo", data=data,
                          headers=alpha)
    assert put[0] == 201
    section = f"/buildid/{elfs.prog.build_id}/section/.debug_info"
    status, _, body = await b.get(section, headers=alpha)
    assert status == 200 and body
    assert (await b.get(section, headers={"X-Scope-OrgID": "mallory"}))[0] == 404
    assert (await b.get(section))[0] == 404


@on_postgresql
async def test_a_different_upload_of_a_key_uploaded_on_another_replica_is_a_conflict(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """A key's upload is the cluster's, not the replica's that took it: another file PUT
    through another replica is a 409 there too, or the replicas serve two files for one key
    (a keeps its own, b and the bucket the other) until one is deleted; the very same file
    again is a 200, not a second upload."""
    token = "symgate-test-upload-token"
    a, b, c = await replicas(start_symgate, tmp_path, faults.url_for("notfound"), "abc",
                             prefix.config(), upload=UploadConfig(admin_tokens=(token,)),
                             cache=CacheConfig(purge_poll_s=0.2))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    first = elfs.prog.debug.read_bytes()
    other = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    auth = {"Authorization": f"Bearer {token}"}
    assert (await a.request("PUT", path, data=first, headers=auth))[0] == 201
    assert (await b.request("PUT", path, data=other, headers=auth))[0] == 409
    assert (await b.request("PUT", path, data=first, headers=auth))[0] == 200
    await asyncio.sleep(0.5)  # purge_poll_s twice over: any notice has been applied
    for sg in (a, b, c):
        assert (await sg.get(path))[::2] == (200, first), sg.url


@on_postgresql
async def test_an_upload_is_deleted_through_any_replica(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """Behind a balancer a DELETE need not reach the replica that took the PUT (a replica
    replaced, the ring moved): any replica deletes the upload, from the bucket and every
    replica, whether or not it has read a copy of it."""
    token = "symgate-test-upload-token"
    a, b, c = await replicas(start_symgate, tmp_path, faults.url_for("notfound"), "abc",
                             prefix.config(), upload=UploadConfig(admin_tokens=(token,)),
                             cache=CacheConfig(purge_poll_s=0.2))
    auth = {"Authorization": f"Bearer {token}"}
    for elf, deleter in ((elfs.prog, b), (elfs.other, c)):
        path = f"/buildid/{elf.build_id}/debuginfo"
        data = elf.debug.read_bytes()
        assert (await a.request("PUT", path, data=data, headers=auth))[0] == 201
        assert (await b.get(path))[::2] == (200, data)  # b has a copy; c has none
        await b.settled()
        assert (await deleter.request("DELETE", path, headers=auth))[0] == 204, deleter.url
        assert object_of(elf) not in await prefix.objects()

        async def gone_everywhere(path: str = path) -> bool:
            return [(await sg.get(path))[0] for sg in (a, b, c)] == [404, 404, 404]

        await eventually(gone_everywhere, timeout=10)


@on_postgresql
async def test_a_tenants_first_upload_is_served_by_another_replica_at_the_next_request(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix
) -> None:
    """README: an upload is found 'at the next request', by every replica. Replica b learns
    which tenants have uploads only every purge_poll_s; until then a shared miss another
    tenant made it remember (after the upload) answered alpha's request for its own upload
    404, which elfutils' client then caches for ten minutes."""
    a = await start_symgate([faults.url_for("notfound")], data_dir=tmp_path / "a",
                            storage=prefix.config(),
                            tenants={"alpha": TenantConfig(tokens=(ALPHA,))})
    b = await start_symgate([faults.url_for("notfound")], data_dir=tmp_path / "b",
                            storage=prefix.config(),
                            tenants={"alpha": TenantConfig(tokens=(ALPHA,))},
                            cache=CacheConfig(purge_poll_s=3600.0))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    assert (await a.request("PUT", path, data=data, headers=alpha))[0] == 201
    assert (await b.get(path, headers={"X-Scope-OrgID": "mallory"}))[0] == 404
    await b.settled()  # that miss's fetch has ended: it is remembered, not joined
    assert (await b.get(path, headers=alpha))[::2] == (200, data)
    assert (await b.get(path, headers={"X-Scope-OrgID": "mallory"}))[0] == 404
    assert (await b.get(path))[0] == 404


@on_postgresql
async def test_a_tenants_upload_is_never_answered_404_while_the_database_is_down(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, elfs: ElfSet,
    faults: FaultUpstream, prefix: Prefix
) -> None:
    """The bucket's catalogue is in SQL: with the database down, replica b cannot tell
    whether alpha (known to have uploads) has uploaded a key. Its upstream's 404 speaks for
    the shared scope only; answering it to alpha told alpha's client (which caches a 404 for
    ten minutes) that its own upload is not there. 503 with Retry-After, until the database
    is back; then the upload."""
    real = urlsplit(database_url)
    forwarder = Forwarder(real.hostname or "127.0.0.1", real.port or 5432)
    await forwarder.start()
    via = urlunsplit(real._replace(netloc=f"127.0.0.1:{forwarder.port}"))
    a, b = [await start_symgate(config=make_config(
        tmp_path / name, via, [faults.url_for("notfound")], storage=prefix.config(),
        tenants={"alpha": TenantConfig(tokens=(ALPHA,))}, cache=CacheConfig(purge_poll_s=0.2),
        database=DatabaseConfig(url=via, timeout_s=1.0))) for name in "ab"]
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    assert (await a.request("PUT", path, data=data, headers=alpha))[0] == 201

    async def b_knows_alpha_uploads() -> bool:
        return "alpha" in b.runner.app[STATE].service.uploaders

    await eventually(b_knows_alpha_uploads, timeout=10)
    await forwarder.cut()
    status, headers, _ = await b.get(path, headers=alpha)
    assert status == 503 and "Retry-After" in headers, status
    assert (await b.get(path))[0] == 404  # the shared scope's own answer stands
    await forwarder.start()

    async def alpha_gets_it() -> bool:
        return (await b.get(path, headers=alpha))[::2] == (200, data)

    await eventually(alpha_gets_it, timeout=10)


@on_postgresql
async def test_a_database_outage_is_one_warning_per_background_job_not_a_traceback(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, faults: FaultUpstream,
    prefix: Prefix, caplog: pytest.LogCaptureFixture
) -> None:
    """The database down is a condition every replica is built to ride out: its background
    jobs (purge notices, the bucket's catch-up, the shared budget) try again at their next
    round. Each round logged an ERROR with a full traceback, every purge_poll_s, for every
    job and process, paging whoever watches ERRORs for what needs nobody."""
    real = urlsplit(database_url)
    forwarder = Forwarder(real.hostname or "127.0.0.1", real.port or 5432)
    await forwarder.start()
    via = urlunsplit(real._replace(netloc=f"127.0.0.1:{forwarder.port}"))
    await start_symgate(config=make_config(
        tmp_path / "a", via, [faults.url_for("notfound")], storage=prefix.config(),
        cache=CacheConfig(purge_poll_s=0.1), database=DatabaseConfig(url=via, timeout_s=1.0)))
    await forwarder.cut()

    async def purge_poll_failed() -> bool:
        return any("PurgeNotices.poll" in r.getMessage() for r in caplog.records)

    await eventually(purge_poll_failed, timeout=10)
    await forwarder.start()
    failed = [r for r in caplog.records if r.name == "proxy.web.jobs"
              and "background job" in r.getMessage()]
    assert failed and all(r.levelno == logging.WARNING and r.exc_info is None
                          for r in failed), [(r.levelname, r.getMessage()) for r in failed]


@on_postgresql
async def test_a_loop_of_caches_back_to_another_replica_is_a_404_not_a_wait(
    start_symgate: SymgateFactory, tmp_path: Path, prefix: Prefix
) -> None:
    """Replicas A1 and A2 ask B, which asks A (here A2, as a balancer in front of A may pick):
    A2 must know the request has been through its cluster, or it waits for A1's fetch (the
    key's lease), which waits for B, which waits for A2: a timeout, then a 502, and A1's
    breaker opened on B, for what is a plain miss."""
    port_b = free_port()
    b_url = f"http://127.0.0.1:{port_b}"
    a1 = await start_symgate([fast_upstream(b_url, first_byte_timeout_s=10)],
                             data_dir=tmp_path / "a1", storage=prefix.config())
    a2 = await start_symgate([fast_upstream(b_url, first_byte_timeout_s=10)],
                             data_dir=tmp_path / "a2", storage=prefix.config())
    b_config = make_config(tmp_path / "b", f"sqlite+aiosqlite:///{tmp_path}/b.sqlite",
                           [fast_upstream(a2.url, first_byte_timeout_s=3, retries=0)])
    b_runner = web.AppRunner(create_app(b_config, CollectorRegistry()), access_log=None,
                             **body_options())
    await b_runner.setup()
    await web.TCPSite(b_runner, "127.0.0.1", port_b).start()
    try:
        status, _, body = await a1.get("/buildid/" + "ee" * 20 + "/debuginfo")
        assert status == 404, body
    finally:
        await b_runner.cleanup()


@on_postgresql
async def test_a_bucket_that_never_answers_a_delete_costs_the_upload_delete_only_its_timeout(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, faults: FaultUpstream,
    prefix: Prefix, s3: S3Server
) -> None:
    """An upload's DELETE removes its row from the catalogue first (no replica reads the
    object after that), then the object. A bucket that took the object's DELETE and never
    answered held the client's DELETE (and the replica's upload lock, which every upload and
    every download's commit waits for) for the client library's limit: an hour."""
    token = "symgate-test-upload-token"
    async with FaultyBucket(s3) as bucket:
        a, b = await replicas(start_symgate, tmp_path, faults.url_for("notfound"), "ab",
                              prefix.config(endpoint=bucket.endpoint, read_timeout_s=1.0),
                              upload=UploadConfig(admin_tokens=(token,)),
                              cache=CacheConfig(purge_poll_s=0.2))
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        data = elfs.prog.debug.read_bytes()
        auth = {"Authorization": f"Bearer {token}"}
        assert (await a.request("PUT", path, data=data, headers=auth))[0] == 201
        assert (await b.get(path))[::2] == (200, data)
        bucket.add("hang", method="POST", path="/" + BUCKET)  # S3's DeleteObjects
        bucket.add("hang", method="DELETE")
        deleted = await asyncio.wait_for(b.request("DELETE", path, headers=auth), 15)
        assert deleted[0] == 204
        assert any(fault.hits for fault in bucket.faults), "the bucket was not asked"
        # Another upload goes on meanwhile, and the deleted one is gone everywhere.
        other = f"/buildid/{elfs.other.build_id}/debuginfo"
        put = await asyncio.wait_for(b.request("PUT", other, data=elfs.other.debug.read_bytes(),
                                               headers=auth), 15)
        assert put[0] == 201

        async def gone_everywhere() -> bool:
            return [(await sg.get(path))[0] for sg in (a, b)] == [404, 404]

        await eventually(gone_everywhere, timeout=10)


@on_postgresql
async def test_healthz_says_the_bucket_fails_until_it_answers_again(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server
) -> None:
    """Credentials revoked (every request a 403): clients are served from upstream, and
    only /healthz can tell the operator that the cluster now fetches each file once per
    replica. It said ok."""
    async with FaultyBucket(s3) as bucket:
        (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                              prefix.config(endpoint=bucket.endpoint))

        async def swept() -> bool:
            # The first catch-up's sweep of orphans lists the bucket, the next an hour later:
            # refused too (a machine slow to its first round), it was the failure told.
            return await a.metric("symgate_bucket_requests_total", op="list", outcome="ok") >= 1

        await eventually(swept)
        bucket.add("403")
        assert (await get(a.url, elfs.prog.build_id)) == (200, elfs.prog.debug.read_bytes())
        await a.settled()  # its upload to the bucket refused
        status, _, body = await a.get("/healthz")
        assert status == 200 and body.startswith(b"degraded\nbucket: a put failed"), body
        bucket.clear()

        async def healthy() -> bool:  # no client request needed: the catch-up asks
            return (await a.get("/healthz"))[2] == b"ok\n"

        await eventually(healthy, timeout=10)


@on_postgresql
@pytest.mark.parametrize("answer", ["nosuchbucket", "gateway-404"])
async def test_a_404_for_no_missing_object_is_a_bucket_down_not_a_catalogue_of_missing_objects(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server, database_url: str, answer: str
) -> None:
    """A 404 that is not S3's NoSuchKey says nothing of the object: S3's for an object of a
    bucket that is gone (or misnamed in one replica's [storage]), NoSuchBucket in its body,
    and one whose body is no S3 error at all (an ingress or proxy in front of the bucket
    that cannot route to it, an endpoint that is not S3). Taken for a missing object, every
    miss dropped the catalogue row of a file the other replicas still read from the real
    bucket, so each was fetched from upstream again, and /healthz said ok."""
    async with FaultyBucket(s3) as bucket:
        a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
        assert (await get(a.url, elfs.prog.build_id))[0] == 200
        await eventually(lambda: _published(a, prefix, elfs.prog))
        (c,) = await replicas(start_symgate, tmp_path, debuginfod.url, "c",
                              prefix.config(endpoint=bucket.endpoint))
        bucket.add(answer)
        assert (await get(c.url, elfs.prog.build_id)) == (200, elfs.prog.debug.read_bytes())
        assert bucket.seen, "the bucket was not asked"
        repo = Repository(create_engine(database_url))
        try:
            assert _hash(elfs.prog) in await repo.bucket_objects([_hash(elfs.prog)])
        finally:
            await repo.close()
        assert (await c.get("/healthz"))[2].startswith(b"degraded\nbucket: ")
        assert await c.metric("symgate_bucket_requests_total", op="get", outcome="error") >= 1
        assert await c.metric("symgate_cluster_fetches_total", how="alone") == 1
        gets = await b.metric("symgate_cluster_fetches_total", how="bucket")
        assert (await get(b.url, elfs.prog.build_id))[0] == 200
        assert await b.metric("symgate_cluster_fetches_total", how="bucket") == gets + 1


def _function_names(profile: bytes) -> set[str]:
    parsed = parse(profile)
    return {parsed.string_table[f.name] for f in parsed.function} - {""}


def _held(name: str) -> bytes:
    return bytes([len(name)]) + name.encode()


@on_postgresql
async def test_a_symbol_table_whose_bucket_copy_does_not_match_its_row_is_not_used(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    """A table read from the bucket was put in place without a look at its row's size and
    sha256: a copy with another name where a function's was (the object overwritten, or
    rotted) named that function so in every profile, and was kept on the replica's disk."""
    a, b = await replicas(start_symgate, tmp_path, debuginfod.url, "ab", prefix.config())
    status, _, on_a = await post(a, _profile(elfs))
    assert status == 200
    await eventually(lambda: _has(prefix, table_object_of(elfs.prog)))
    await a.settled()
    table = (await prefix.objects())[table_object_of(elfs.prog)]
    # A function's name as the table holds it: its length, then its bytes.
    name = next(n for n in _function_names(on_a) if table.count(_held(n)) == 1)
    forged = table.replace(_held(name), _held("X" * len(name)))
    await prefix.put(table_object_of(elfs.prog), forged)
    status, _, on_b = await post(b, _profile(elfs))
    assert status == 200
    assert "X" * len(name) not in _function_names(on_b)
    assert on_b == on_a
    assert await b.metric("symgate_symtab_cache_total", result="bucket") == 0

    async def good_copy_again() -> bool:  # b's own build, published over the bad one
        return (await prefix.objects()).get(table_object_of(elfs.prog)) == table

    await eventually(good_copy_again, timeout=10)


@on_postgresql
async def test_a_copy_replaced_by_an_upload_while_it_was_read_leaves_the_upload_in_the_bucket(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server
) -> None:
    """Replica b reads the download's row, and its GET of the object comes after an upload
    of the key put other bytes there (and its own row): the copy does not match the row b
    read. Refused by key, that took the upload's row and object: the upload then reached no
    other replica, and they served the download it replaced, fetched from upstream again."""
    token = "symgate-test-upload-token"
    auth = {"Authorization": f"Bearer {token}"}
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    uploaded = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    async with FaultyBucket(s3) as bucket:
        a, c = await replicas(start_symgate, tmp_path, debuginfod.url, "ac", prefix.config(),
                              upload=UploadConfig(admin_tokens=(token,)),
                              cache=CacheConfig(purge_poll_s=0.2))
        (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b",
                              prefix.config(endpoint=bucket.endpoint),
                              cache=CacheConfig(purge_poll_s=0.2))
        assert (await get(a.url, elfs.prog.build_id))[0] == 200
        await eventually(lambda: _published(a, prefix, elfs.prog))
        bucket.add("hold", method="GET", path=object_of(elfs.prog), times=1)
        reading = asyncio.ensure_future(b.get(path))
        await asyncio.wait_for(bucket.held.wait(), 10)  # b has the download's row
        assert (await a.request("PUT", path, data=uploaded, headers=auth))[0] == 201
        bucket.release.set()
        status, _, body = await reading
        assert body != uploaded or status != 200  # it was not the copy b asked for
        await b.settled()
    assert (await prefix.objects()).get(object_of(elfs.prog)) == uploaded
    assert (await c.get(path))[::2] == (200, uploaded)


@on_postgresql
async def test_a_purge_made_while_a_replica_uploads_the_file_keeps_it_out_of_the_bucket(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, debuginfod: Debuginfod,
    elfs: ElfSet, prefix: Prefix, s3: S3Server
) -> None:
    """Replica a commits a file, then writes it to the bucket, then the bucket's row. A
    purge in between found no bucket row to delete, and the row a wrote after it served the
    purged file to every replica, for as long as the bucket kept it."""
    async with FaultyBucket(s3) as bucket:
        # The answer to the PUT of the object, held: it is whole there.
        bucket.add("hold-after", method="PUT", path=object_of(elfs.prog), times=1)
        (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                              prefix.config(endpoint=bucket.endpoint, read_timeout_s=30.0),
                              cache=CacheConfig(purge_poll_s=3600.0))
        assert (await get(a.url, elfs.prog.build_id))[0] == 200
        await asyncio.wait_for(bucket.held.wait(), 10)
        # Run on another machine: a's own copy goes at a's next poll of the notices.
        config = tmp_path / "admin.toml"
        config.write_text(f'[server]\ndata_dir = "{tmp_path / "admin"}"\n'
                          f'[database]\nurl = "{database_url}"\n{prefix.toml()}')
        purged = await run_in_thread(["symgate", "cache", "purge", elfs.prog.build_id,
                                      "--config", str(config)], timeout=60)
        assert purged.returncode == 0, purged.stderr
        bucket.release.set()
        await a.settled()
    repo = Repository(create_engine(database_url))
    try:
        assert not await repo.bucket_objects([_hash(elfs.prog)]), "the purged file is back"
    finally:
        await repo.close()
    (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b", prefix.config())
    before = await upstream_requests(debuginfod)
    assert (await get(b.url, elfs.prog.build_id))[0] == 200
    assert await upstream_requests(debuginfod) == before + 1


@on_postgresql
async def test_a_catch_up_round_during_a_slow_upload_leaves_the_keys_lease_held(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, debuginfod: Debuginfod,
    elfs: ElfSet, prefix: Prefix, s3: S3Server
) -> None:
    """Replica a fetched a file and writes it to a slow bucket, holding the key's lease so
    that b waits for that copy. a's catch-up came round meanwhile, took the same lease (its
    holder's already, so granted) and released it when it found the upload under way: b
    stopped waiting and fetched the file from upstream too."""
    from sqlalchemy import text

    async with FaultyBucket(s3) as bucket:
        bucket.add("hold", path=object_of(elfs.prog), times=1)
        (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                              prefix.config(endpoint=bucket.endpoint, read_timeout_s=30.0))
        (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b", prefix.config())
        before = await upstream_requests(debuginfod)
        assert (await get(a.url, elfs.prog.build_id))[0] == 200
        await asyncio.wait_for(bucket.held.wait(), 10)  # a's upload to the bucket under way
        # A catch-up round now (rather than at its time): the file counts as settled.
        engine = create_engine(database_url)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE artifacts SET fetched_at = fetched_at - "
                                    "interval '1 hour'"))
        await engine.dispose()
        service = a.runner.app[STATE].service
        assert service.tier is not None
        await service.tier.sync(lambda rec: service.cache.store.artifact_path(
            rec.scope, ArtifactKey.from_id(rec.key)))
        repo = Repository(create_engine(database_url))
        try:
            assert await repo.lease_of(tier.fetch_lease(_hash(elfs.prog))) is not None
        finally:
            await repo.close()
        on_b = asyncio.ensure_future(get(b.url, elfs.prog.build_id))

        async def b_asks() -> bool:
            return await b.metric("symgate_inflight_fetches") == 1

        await eventually(b_asks)  # and waits for a's copy, the lease being held
        bucket.release.set()
        assert (await on_b)[0] == 200
        await a.settled()
    assert await upstream_requests(debuginfod) == before + 1
    assert await b.metric("symgate_cluster_fetches_total", how="upstream") == 0


@on_postgresql
async def test_objects_no_row_names_are_deleted_once_old_and_nothing_else(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix
) -> None:
    """What no row names is never read again, and would cost the bucket's storage for good:
    an object whose replica was killed before its row, a table of an older format. The sweep
    deletes them once past the grace (a publish writes its row just after its object), and
    leaves what rows name and what is not symgate's."""
    (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                          prefix.config(orphan_grace_s=3600.0))
    assert (await a.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await a.built()
    tier = a.runner.app[STATE].service.tier
    assert tier is not None
    rowless, old_table, foreign = (f"debuginfo/{'ab' * 32}", f"symtab/extras-1/{'cd' * 32}",
                                   "notes/kept-by-an-operator.txt")
    for path in (rowless, old_table, foreign):
        await prefix.put(path, b"not named by any row")

    async def sweep(now: datetime | None = None) -> int:
        found: list[int] = []

        async def swept() -> bool:  # once the start-up's own sweep has let go of the lease
            found[:] = [n] if (n := await tier.sweep_orphans(now)) is not None else []
            return bool(found)

        await eventually(swept)
        return found[0]

    assert await sweep() == 0  # written just now: maybe a publish under way
    assert await sweep(datetime.now(UTC) + timedelta(hours=2)) == 2
    left = await prefix.paths()
    assert rowless not in left and old_table not in left
    assert {foreign, object_of(elfs.prog)} <= left
    status, _, body = await a.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert (status, body) == (200, elfs.prog.debug.read_bytes())


def _bucket_at(prefix: Prefix, endpoint: str) -> Bucket:
    """A Bucket of its own (no server): for what one process's calls do to each other."""
    return Bucket(prefix.config(endpoint=endpoint), ProxyMetrics(CollectorRegistry()), Health())


async def test_two_copies_of_one_table_at_once_both_land_and_leave_no_temp(
    prefix: Prefix, s3: S3Server, tmp_path: Path
) -> None:
    """Two requests of one process bring the same table from the bucket at once (a profile's
    lookup and a rebuild's): they shared one temp file, and the second found it renamed
    under it, a FileNotFoundError taken for the bucket failing: the table was built again.
    Its temp is named as a build's, so that one a killed process left goes at the next
    start (a `.part` stayed for good)."""
    data = os.urandom(600 * 1024)
    await prefix.put("symtab/t", data)
    build_id = "ab" * 20
    dest = tmp_path / "ab" / f"{build_id}.symc"
    async with FaultyBucket(s3) as faulty:
        faulty.add("hold-after", method="GET", path="symtab/t")
        bucket = _bucket_at(prefix, faulty.endpoint)
        copies = [asyncio.ensure_future(bucket.get_file(
            "symtab/t", dest, len(data), hashlib.sha256(data).hexdigest())) for _ in range(2)]
        # Both under way, each with its temp, before either has a byte.
        await eventually(lambda: len(list(dest.parent.glob(f"{build_id}.*.tmp"))) == 2)
        assert all(temp.name.endswith(f".{os.getpid()}.tmp")
                   for temp in dest.parent.glob("*.tmp"))
        faulty.release.set()
        assert await asyncio.gather(*copies) == [True, True]
        assert faulty.answering == 0
    assert dest.read_bytes() == data
    assert list(dest.parent.iterdir()) == [dest]


@on_postgresql
async def test_a_server_stopping_as_a_fetch_releases_its_lease_still_releases_it(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, faults: FaultUpstream,
    elfs: ElfSet, prefix: Prefix, s3: S3Server
) -> None:
    """The server stopped while a fetch that had ended was dropping its key's lease: the stop
    cancelled the DELETE, and the row stayed until it lapsed (lease_s), every other replica
    waiting on it for a fetch nobody made. Driven by a lock on the row (another session's
    SELECT ... FOR UPDATE), which holds the DELETE until the stop has cancelled its task."""
    import asyncpg

    (a,) = await replicas(start_symgate, tmp_path, faults.url_for("hold404"), "a",
                          prefix.config())
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    locker, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        client = asyncio.ensure_future(get(a.url, elfs.prog.build_id))
        await eventually(lambda: faults.count("hold404") == 1)  # under the key's lease
        locking = locker.transaction()
        await locking.start()
        assert len(await locker.fetch("SELECT name FROM leases WHERE name LIKE 'fetch:%' "
                                      "FOR UPDATE")) == 1
        faults.release.set()
        assert (await client)[0] == 404

        async def dropping() -> bool:  # the fetch's DELETE of the row, waiting for the lock
            return bool(await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'DELETE FROM leases%'"))

        await eventually(dropping)
        service = a.runner.app[STATE].service
        stopping = asyncio.ensure_future(a.runner.cleanup())
        # The stop has cancelled the fetch's task (gone, or still dropping its row).
        await eventually(lambda: all(t.cancelling() for t in service._tasks))
        await locking.rollback()
        await asyncio.wait_for(stopping, 30)
        assert await watcher.fetch("SELECT name FROM leases") == []
        # And the fetch landed all the same: its temp file gone, its gauge back.
        assert list((tmp_path / "a").rglob("*.part")) == []
        assert a.registry.get_sample_value("symgate_inflight_fetches") == 0
    finally:
        await locker.close()
        await watcher.close()


@on_postgresql
async def test_a_copy_found_under_the_lease_is_closed_when_a_stop_cuts_the_leases_release(
    prefix: Prefix, s3: S3Server, database_url: str
) -> None:
    """The replica that held a key's lease published the key and let the lease go just as
    this one took it: this one finds the copy after all, and drops the lease. A stop that
    cancelled the miss as the lease's row was deleted left the copy open, its connection
    held and the bucket's side blocked writing into it, until the garbage collector came.
    Driven by locks on the lease's row (another session's uncommitted DELETE, then its
    SELECT ... FOR UPDATE) and by the misses lookup, which waits for the test."""
    import asyncpg

    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    repo = Repository(create_engine(database_url), replica="b")
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    locker, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    key = ArtifactKey.parse("ab" * 20, "debuginfo")
    kh = key_hash("", key)
    name = tier.fetch_lease(kh)
    # More than loopback's socket buffers take: unread, the bucket's side blocks writing it.
    data = os.urandom(32 * 1024 * 1024)
    await prefix.put(tier.object_path("debuginfo", kh), data)
    now = datetime.now(UTC)
    asked, answer = asyncio.Event(), asyncio.Event()

    async def missing() -> bool:
        asked.set()
        await answer.wait()
        return False

    async def waiting(query: str) -> bool:
        return bool(await watcher.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE $1", f"{query}%"))

    gc.disable()  # what is left open stays open, as until the collector's next round
    try:
        async with FaultyBucket(s3) as faulty:
            config = prefix.config(endpoint=faulty.endpoint, lease_s=30.0)
            registry = CollectorRegistry()
            metrics = ProxyMetrics(registry)
            shared = tier.SharedTier(Bucket(config, metrics, Health()), repo, config, metrics,
                                     "b")
            # Another replica's lease, which it drops as this one asks for it.
            assert await repo.take_lease(name, "a", now, now + timedelta(seconds=60))
            dropping = locker.transaction()
            await dropping.start()
            await locker.execute("DELETE FROM leases WHERE name = $1", name)
            obtaining = asyncio.ensure_future(shared.obtain(kh, [kh], key, missing))
            await eventually(lambda: waiting("INSERT INTO leases"))  # no copy: the lease
            await repo.put_bucket_object(BucketRecord(
                key_hash=kh, scope="", key=key.id, build_id=key.build_id, kind="debuginfo",
                size=len(data), sha256=hashlib.sha256(data).hexdigest(), upstream="u",
                filename="f", archive=None, last_modified=None, ima_signature=None,
                pinned=False, stored_at=now, last_access=now))
            await dropping.commit()
            await asyncio.wait_for(asked.wait(), 30)  # the lease is this one's: both asked
            holding = locker.transaction()
            await holding.start()
            await locker.execute("SELECT name FROM leases WHERE name = $1 FOR UPDATE", name)
            answer.set()
            await eventually(lambda: waiting("DELETE FROM leases"))  # the copy is open
            assert registry.get_sample_value(
                "symgate_bucket_requests_total", {"op": "get", "outcome": "ok"}) == 1
            obtaining.cancel()
            await holding.rollback()
            with pytest.raises(asyncio.CancelledError):
                await obtaining
            await eventually(lambda: faulty.answering == 0)  # the copy's connection let go
            await shared.close()
        assert await repo.lease_of(name) is None
    finally:
        gc.enable()
        await locker.close()
        await watcher.close()
        await repo.close()


@on_postgresql
async def test_a_lease_taken_as_its_miss_is_cancelled_is_dropped_at_once(
    prefix: Prefix, s3: S3Server, database_url: str
) -> None:
    """A stop (or the client leaving) cancelled a miss once the database had committed the
    INSERT of the key's lease and before its answer came: the row stayed, nothing renewing or
    releasing it, and every other replica that asked for the key waited lease_s on it before
    fetching it itself. Driven by a forwarder in front of PostgreSQL that holds the COMMIT's
    answer (a lock on the row would not do: the cancel reaches the server, which cuts the
    INSERT waiting for it)."""
    import asyncpg

    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    real = urlsplit(database_url)
    forwarder = Forwarder(real.hostname or "127.0.0.1", real.port or 5432)
    await forwarder.start()
    via = urlunsplit(real._replace(netloc=f"127.0.0.1:{forwarder.port}"))
    on_a, on_b = Repository(create_engine(via), replica="a"), Repository(
        create_engine(database_url), replica="b")
    watcher = await asyncpg.connect(database_url.replace("postgresql+asyncpg://",
                                                         "postgresql://"))
    key = ArtifactKey.parse("ab" * 20, "debuginfo")
    kh = key_hash("", key)
    config = prefix.config(lease_s=30.0)  # for good, as far as this test goes

    async def missing() -> bool:
        return False

    def shared(repo: Repository, replica: str) -> tuple[tier.SharedTier, CollectorRegistry]:
        registry = CollectorRegistry()
        metrics = ProxyMetrics(registry)
        return tier.SharedTier(Bucket(config, metrics, Health()), repo, config, metrics,
                               replica), registry

    async def committed() -> bool:  # the lease's row, as any other session sees it
        return bool(await watcher.fetch("SELECT holder FROM leases"))

    try:
        a, _ = shared(on_a, "a")
        forwarder.hold_commit(b"INSERT INTO leases")
        obtaining = asyncio.ensure_future(a.obtain(kh, [kh], key, missing))
        await eventually(committed)  # and a waits for the COMMIT's answer
        obtaining.cancel()
        forwarder.answer()
        with pytest.raises(asyncio.CancelledError):
            await obtaining
        assert await watcher.fetch("SELECT holder FROM leases") == [], "the lease is held"
        # Another replica asking for the key gets its lease, not a wait.
        b, registry = shared(on_b, "b")
        got = await b.obtain(kh, [kh], key, missing)
        assert got.lease is not None
        assert registry.get_sample_value("symgate_cluster_fetches_total",
                                         {"how": "upstream"}) == 1
        await got.lease.release()
        await a.close()
        await b.close()
    finally:
        forwarder.answer()
        await watcher.close()
        await on_a.close()
        await on_b.close()
        await forwarder.cut()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_stop_cuts_the_bucket_jobs_still_running_after_its_wait_and_waits_for_them(
    prefix: Prefix, s3: S3Server, database_url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop waited CLOSE_WAIT_S for the tier's background jobs, then neither cancelled
    nor waited for what was left: a symbol table's upload to a bucket that had not answered
    outlived the stop, its connection held as the process exited and its failure never
    retrieved. Driven by a bucket that holds the upload's PUT past the (shortened) wait."""
    from proxy.store import migrate

    await asyncio.to_thread(migrate.upgrade, database_url)
    repo = Repository(create_engine(database_url))
    table = tmp_path / "table.symc"
    table.write_bytes(os.urandom(64 * 1024))
    monkeypatch.setattr(tier, "CLOSE_WAIT_S", 0.1)
    try:
        async with FaultyBucket(s3) as faulty:
            faulty.add("hold", method="PUT", times=1)
            config = prefix.config(endpoint=faulty.endpoint, read_timeout_s=60.0)
            metrics = ProxyMetrics(CollectorRegistry())
            shared = tier.SharedTier(Bucket(config, metrics, Health()), repo, config, metrics,
                                     "a")
            shared.publish_table("", "ab" * 20, table)
            await asyncio.wait_for(faulty.held.wait(), 10)
            uploading = set(shared._tasks)
            assert len(uploading) == 1
            caplog.set_level(logging.WARNING, logger="proxy.bucket.tier")
            await shared.close()
            assert all(task.cancelled() for task in uploading), "the upload outlived the stop"
            assert [r.getMessage() for r in caplog.records if "cut after" in r.getMessage()
                    ] == ["stopping: 1 background jobs of the shared bucket (uploads, access "
                          "times) cut after 0.1 s"]
            faulty.release.set()
            await eventually(lambda: faulty.answering == 0)
    finally:
        await repo.close()


async def test_an_upload_cut_short_leaves_no_unfinished_multipart_upload(
    prefix: Prefix, s3: S3Server, tmp_path: Path
) -> None:
    """A table or debug file of a few MiB went up as a multipart upload; cancelled between
    its parts (a server stopping), the upload stayed in the bucket, unseen by any listing of
    objects and billed, until a lifecycle rule (if any) aborted it. One PUT leaves nothing."""
    file = tmp_path / "f"
    file.write_bytes(os.urandom(600 * 1024))
    async with FaultyBucket(s3) as faulty:
        faulty.add("hold", method="PUT", path="debuginfo/f", times=1)
        bucket = _bucket_at(prefix, faulty.endpoint)
        put = asyncio.ensure_future(bucket.put_file("debuginfo/f", file))
        await asyncio.wait_for(faulty.held.wait(), 10)
        put.cancel()
        await asyncio.gather(put, return_exceptions=True)
        faulty.release.set()
        await eventually(lambda: faulty.answering == 0)
    async with aiohttp.ClientSession() as s, s.get(
            f"{s3.endpoint}/{BUCKET}?uploads&prefix={prefix.name}/") as r:
        assert "<Upload>" not in await r.text()


@on_postgresql
async def test_an_upload_whose_replica_was_killed_before_the_bucket_had_it_is_taken_again(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, elfs: ElfSet,
    faults: FaultUpstream, prefix: Prefix, s3: S3Server
) -> None:
    """Replica a commits an upload on its disk and its row, then writes it to the bucket,
    and is SIGKILLed before that is done: the uploader has no answer and sends the PUT again,
    through b. b found a's row and answered that the file was there already, though no
    replica but the dead one had it: b then answered the file's GET with a 404, and the upload
    was lost with a's disk."""
    token = "symgate-test-upload-token"
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    auth = {"Authorization": f"Bearer {token}"}
    async with FaultyBucket(s3) as bucket:
        bucket.add("hold", method="PUT", path=object_of(elfs.prog), times=1)
        base, proc = await start_serve(
            tmp_path, tmp_path / "a", database_url, faults.url_for("notfound"),
            extra=prefix.toml(endpoint=bucket.endpoint, read_timeout_s=30.0)
            + f'[upload]\nadmin_tokens = ["{token}"]\n')
        try:
            async with aiohttp.ClientSession() as s:
                put = asyncio.ensure_future(s.put(base + path, data=data, headers=auth))
                await asyncio.wait_for(bucket.held.wait(), 30)  # committed on a, row and all
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
                with pytest.raises(aiohttp.ClientError):
                    await put
        finally:
            await stop_serve([proc])
    (b,) = await replicas(start_symgate, tmp_path, faults.url_for("notfound"), "b",
                          prefix.config(), upload=UploadConfig(admin_tokens=(token,)))
    status, _, text = await b.request("PUT", path, data=data, headers=auth)
    assert status in (200, 201), (status, text)
    assert (await b.get(path))[::2] == (200, data), "the upload answered for is not served"
    await b.settled()
    assert (await prefix.objects()).get(object_of(elfs.prog)) == data


@on_postgresql
@pytest.mark.parametrize("evicting", ["e", "a"], ids=["another replica", "a's other process"])
async def test_an_upload_published_while_the_eviction_deletes_the_download_stays_in_the_bucket(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server, evicting: str
) -> None:
    """Replica e evicts a download from the bucket: its row, then its object. An upload of
    the key on replica a wrote its object and row between the two: e's DELETE took the
    upload's object, the upload's row named nothing, and every other replica served the
    download it replaced, fetched from upstream again (the PUT had been answered 201).
    Alike where the eviction is that of another process on a's data dir (serve --workers):
    the upload took its lease for that of a fetch of a's, which it does not wait for."""
    token = "symgate-test-upload-token"
    auth = {"Authorization": f"Bearer {token}"}
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    uploaded = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    async with FaultyBucket(s3) as bucket:
        # a waits for the key's lease up to read_timeout_s: longer than the test holds it.
        a, c = await replicas(start_symgate, tmp_path, debuginfod.url, "ac",
                              prefix.config(read_timeout_s=30.0),
                              upload=UploadConfig(admin_tokens=(token,)))
        assert (await a.get(path))[0] == 200
        await eventually(lambda: _published(a, prefix, elfs.prog))
        # The eviction's DELETE of the object, held: its row is gone already.
        bucket.add("hold", method="POST", path="delete", times=1)
        (e,) = await replicas(start_symgate, tmp_path, debuginfod.url, evicting,
                              prefix.config(endpoint=bucket.endpoint, max_age_s=1.0,
                                            read_timeout_s=30.0))
        await asyncio.wait_for(bucket.held.wait(), 20)
        putting = asyncio.ensure_future(a.request("PUT", path, data=uploaded, headers=auth))
        state = a.runner.app[STATE]

        async def committed() -> bool:
            row = await state.repo.get_artifact(_hash(elfs.prog))
            return row is not None and row.pinned

        await eventually(committed)
        await asyncio.sleep(0.5)  # the upload's own publish, if it does not wait for e's
        bucket.release.set()
        assert (await putting)[0] == 201
        await e.settled()
    assert (await prefix.objects()).get(object_of(elfs.prog)) == uploaded
    assert (await c.get(path))[::2] == (200, uploaded)


@on_postgresql
async def test_an_upload_the_bucket_missed_replaces_the_download_there_at_its_catch_up(
    start_symgate: SymgateFactory, tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet,
    prefix: Prefix, s3: S3Server
) -> None:
    """Replica a takes in an upload while the bucket fails its writes (the PUT is answered
    201: the catch-up writes it later). The bucket holds the download of the key from replica
    c. a's catch-up found the key's row there and took it for its own: the upload never
    reached the bucket, and every replica without a copy of its own served the download it
    replaced, as a PUT taken with the bucket up would not have let them."""
    token = "symgate-test-upload-token"
    auth = {"Authorization": f"Bearer {token}"}
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    uploaded = elfs.prog.executable.read_bytes()  # the same build ID, other bytes
    async with FaultyBucket(s3) as bucket:
        (c,) = await replicas(start_symgate, tmp_path, debuginfod.url, "c", prefix.config())
        assert (await c.get(path))[0] == 200
        await eventually(lambda: _published(c, prefix, elfs.prog))
        (a,) = await replicas(start_symgate, tmp_path, debuginfod.url, "a",
                              prefix.config(endpoint=bucket.endpoint),
                              upload=UploadConfig(admin_tokens=(token,)))
        failing = bucket.add("503", method="PUT", path=object_of(elfs.prog))
        assert (await a.request("PUT", path, data=uploaded, headers=auth))[0] == 201
        assert failing.hits
        bucket.clear()
        state = a.runner.app[STATE]

        async def caught_up() -> bool:
            row = await state.repo.get_artifact(_hash(elfs.prog))
            return row is not None and row.shared

        await eventually(caught_up, timeout=10)
    assert (await prefix.objects()).get(object_of(elfs.prog)) == uploaded
    (b,) = await replicas(start_symgate, tmp_path, debuginfod.url, "b", prefix.config())
    assert (await b.get(path))[::2] == (200, uploaded)


@on_postgresql
async def test_an_upload_whose_object_left_the_bucket_is_written_there_again(
    start_symgate: SymgateFactory, tmp_path: Path, elfs: ElfSet, prefix: Prefix
) -> None:
    """The object of an upload deleted behind symgate's back (a lifecycle rule, an operator):
    the first replica to miss it drops its row, and the replica that took the upload in, its
    copy marked as in the bucket, never wrote it there again. Every other replica answered
    404 for good, for a file the cluster has."""
    token = "symgate-test-upload-token"
    a, b = await replicas(start_symgate, tmp_path, None, "ab", prefix.config(),
                          upload=UploadConfig(admin_tokens=(token,)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    put = await a.request("PUT", path, data=data, headers={"Authorization": f"Bearer {token}"})
    assert put[0] == 201
    await prefix.delete(object_of(elfs.prog))
    assert (await b.get(path))[0] == 404  # nothing to read, and no upstream

    async def b_serves_it() -> bool:
        return (await b.get(path))[::2] == (200, data)

    await eventually(b_serves_it, timeout=10)
