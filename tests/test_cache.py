"""Single flight, streaming, detached fetches, negative caching, eviction, restarts."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from proxy.artifacts.index import ArtifactCache, key_hash
from proxy.config import NegativeConfig
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.store.disk import DiskStore
from proxy.store.migrate import upgrade
from proxy.store.models import Negative
from proxy.store.repository import Repository, create_engine
from tests.conftest import Debuginfod, SymgateFactory, eventually, fast_upstream
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.test_protocol import debuginfod_find


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


async def test_negative_cache_answers_from_sql_then_expires_and_grows(
    start_symgate: SymgateFactory, faults: FaultUpstream, database_url: str
) -> None:
    sg = await start_symgate(
        [faults.url_for("notfound")],
        negative=NegativeConfig(not_found_initial_ttl_s=0.6, not_found_ttl_s=10, memo_s=0.2))
    path = "/buildid/00112233445566778899/debuginfo"
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 1
    for _ in range(5):
        status, _, body = await sg.get(path)
        assert status == 404 and b"remembered" in body
    await asyncio.sleep(0.3)  # past the memo: this one is answered from SQL
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 1
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="negative_hit") == 6
    await asyncio.sleep(0.5)  # past the first TTL
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 2
    engine = create_engine(database_url)
    async with engine.connect() as conn:
        row = (await conn.execute(select(Negative.misses, Negative.first_seen,
                                         Negative.expires_at))).one()
    await engine.dispose()
    assert row.misses == 2  # the second miss doubled the TTL


async def test_errors_are_not_remembered_as_misses(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("status500"), retries=0),
                              faults.url_for("notfound")])
    path = "/buildid/aabbccdd/debuginfo"
    for expected_count in (1, 2):
        status, _, _ = await sg.get(path)
        assert status == 502  # one said 404, one failed: not a 404
        assert faults.count("status500") == expected_count
    # The upstream that answered 404 is remembered on its own and not asked again.
    assert faults.count("notfound") == 1


async def test_in_order_asks_the_next_upstream_after_a_404(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("notfound"), faults.url_for("ok")])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert (faults.count("notfound"), faults.count("ok")) == (1, 1)


async def test_race_takes_the_first_200_and_cancels_the_rest(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    from proxy.config import FetchConfig

    faults.first_byte_delay = 5
    sg = await start_symgate(
        [fast_upstream(faults.url_for("slow-first-byte"), first_byte_timeout_s=10),
         faults.url_for("notfound"), faults.url_for("late")],
        fetch=FetchConfig(policy="race"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _headers, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert loop.time() - started < 4  # did not wait for the slow one
    # All three were asked at once: the slow one had its request before the 0.3 s winner.
    assert [faults.count(m) for m in ("slow-first-byte", "notfound", "late")] == [1, 1, 1]


async def test_lru_eviction_keeps_the_budget(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    from proxy.config import CacheConfig

    sizes = {e.name: e.debug.stat().st_size for e in (elfs.prog, elfs.other)}
    exe = elfs.prog.executable.stat().st_size
    budget = sizes["prog"] + sizes["other"] + exe - 1
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=budget))
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")  # prog is now the most recent

    async def built() -> bool:  # symbol tables are built from each debuginfo as it is cached
        return await sg.metric("symgate_symtab_builds_total", result="ok") == 2

    await eventually(built)  # so no build holds a lease that eviction would pass over
    await sg.get(f"/buildid/{elfs.prog.build_id}/executable")  # over budget: evict `other`
    assert await sg.metric("symgate_cache_evictions_total") == 1
    assert await sg.metric("symgate_cache_size_bytes") == sizes["prog"] + exe
    assert await sg.metric("symgate_cache_entries") == 2
    assert not sg.config.cache_dir.joinpath(
        "objects", ArtifactKey.parse(elfs.other.build_id, "debuginfo").storage_name).exists()
    before = faults.count("ok")
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert faults.count("ok") == before  # still a hit
    await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert faults.count("ok") == before + 1  # evicted, so fetched again


async def test_eviction_passes_over_a_file_being_served(
    tmp_path: Path, database_url: str, elfs: ElfSet
) -> None:
    await asyncio.to_thread(upgrade, database_url)
    repo = Repository(create_engine(database_url))
    store = DiskStore(tmp_path / "cache")
    cache = ArtifactCache(store, repo, ProxyMetrics(CollectorRegistry()), max_bytes=100)
    from datetime import UTC, datetime

    def record(key: ArtifactKey, size: int):  # type: ignore[no-untyped-def]
        from proxy.store.repository import ArtifactRecord

        path = store.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        now = datetime.now(UTC)
        return ArtifactRecord(key_hash(key), key.id, key.build_id, str(key.kind), size, "0",
                              "u", "f", None, now, now, 0)

    old = ArtifactKey.parse("aa" * 20, "debuginfo")
    new = ArtifactKey.parse("bb" * 20, "debuginfo")
    await cache.add(record(old, 80))
    with cache.lease(old):
        await cache.add(record(new, 80))  # over budget, but `old` is being sent
        assert store.path_of(old).exists() and len(cache) == 2
    for _ in range(50):  # the end of the lease starts an eviction in the background
        if not store.path_of(old).exists():
            break
        await asyncio.sleep(0.02)
    assert not store.path_of(old).exists() and store.path_of(new).exists()
    assert cache.total_bytes == 80
    await repo.close()


async def test_restart_keeps_hits_and_cleans_crash_leftovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.stop()
    cache_dir = sg.config.cache_dir
    (cache_dir / "tmp" / "deadbeef.part").write_bytes(b"half a download")
    orphan = cache_dir / "objects" / "cc" / "dd" / "debuginfo"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"renamed into place, row never written")
    sg2 = await start_symgate(config=sg.config)
    status, _, body = await sg2.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("ok") == 1
    assert await sg2.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                            outcome="hit") == 1
    assert not any((cache_dir / "tmp").iterdir()) and not orphan.exists()


async def test_restart_drops_rows_whose_file_is_gone_or_short(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    for e in (elfs.prog, elfs.other):
        await sg.get(f"/buildid/{e.build_id}/debuginfo")
    await sg.stop()
    objects = sg.config.cache_dir / "objects"
    (objects / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name).unlink()
    short = objects / ArtifactKey.parse(elfs.other.build_id, "debuginfo").storage_name
    short.write_bytes(short.read_bytes()[:100])
    sg2 = await start_symgate(config=sg.config)
    assert await sg2.metric("symgate_cache_entries") == 0
    for e in (elfs.prog, elfs.other):
        status, _, body = await sg2.get(f"/buildid/{e.build_id}/debuginfo")
        assert status == 200 and body == e.debug.read_bytes()
    assert faults.count("ok") == 4


async def test_elfutils_client_does_not_cache_a_transient_failure(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """The real debuginfod-find: after symgate's upstream recovers, the next call succeeds."""
    sg = await start_symgate([fast_upstream(faults.url_for("gate"), retries=0)])
    client_cache = tmp_path / "client"
    first = await asyncio.to_thread(debuginfod_find, sg.url, client_cache, "debuginfo",
                                    elfs.prog.build_id)
    assert first.returncode != 0
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="error") == 1
    faults.gate_open = True
    second = await asyncio.to_thread(debuginfod_find, sg.url, client_cache, "debuginfo",
                                     elfs.prog.build_id)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip()).read_bytes() == elfs.prog.debug.read_bytes()


async def test_two_symgates_in_a_chain(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    regional = await start_symgate([debuginfod.url], data_dir=tmp_path / "regional")
    site = await start_symgate([regional.url], data_dir=tmp_path / "site")
    result = await asyncio.to_thread(debuginfod_find, site.url, tmp_path / "c", "executable",
                                     elfs.prog.build_id)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).read_bytes() == elfs.prog.executable.read_bytes()
    assert await regional.metric("symgate_requests_total", endpoint="buildid",
                                 kind="executable", outcome="miss") == 1
    status, _, _ = await site.get("/buildid/0badc0de/debuginfo")
    assert status == 404  # a miss upstream of the chain is a plain 404 at the site


def test_serve_on_embedded_defaults(elfs: ElfSet, debuginfod: Debuginfod, tmp_path: Path) -> None:
    """`symgate serve` with no config: data under XDG_DATA_HOME, upstreams from the env."""
    from tests.conftest import free_port

    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg"),
           "DEBUGINFOD_URLS": debuginfod.url}
    proc = subprocess.Popen(["symgate", "serve", "--listen", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import time
        import urllib.request

        url = f"http://127.0.0.1:{port}/buildid/{elfs.prog.build_id}/debuginfo"
        for _ in range(100):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.read() == elfs.prog.debug.read_bytes()
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("symgate serve did not answer")
        assert (tmp_path / "xdg" / "symgate" / "symgate.sqlite").exists()
        assert any((tmp_path / "xdg" / "symgate" / "cache" / "objects").rglob("debuginfo"))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()


async def test_a_cached_file_deleted_behind_the_servers_back_is_fetched_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    stored.unlink()
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("ok") == 2 and stored.exists()
    assert await sg.metric("symgate_cache_entries") == 1
