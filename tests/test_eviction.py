"""The cache stays within its byte budget by evicting the least recently used artifacts, but
never a file that is being sent to a client: that one goes when its last reader is done."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry

from proxy.artifacts.index import ArtifactCache, key_hash
from proxy.config import CacheConfig
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.store.disk import DiskStore
from proxy.store.migrate import upgrade
from proxy.store.repository import ArtifactRecord, Repository, create_engine
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, eventually


async def test_lru_eviction_keeps_the_budget(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sizes = {e.name: e.debug.stat().st_size for e in (elfs.prog, elfs.other)}
    exe = elfs.prog.executable.stat().st_size
    budget = sizes["prog"] + sizes["other"] + exe - 1
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=budget))
    for name in ("prog", "other"):
        await sg.get(f"/buildid/{getattr(elfs, name).build_id}/debuginfo")
        await sg.settled()  # cached in this order (a file counts as used when committed)
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")  # prog is now the most recent

    async def built() -> bool:  # symbol tables are built from each debuginfo as it is cached
        return await sg.metric("symgate_symtab_builds_total", result="ok") == 2

    await eventually(built)  # so no build holds a lease that eviction would pass over
    await sg.get(f"/buildid/{elfs.prog.build_id}/executable")  # over budget: evict `other`
    await sg.settled()
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
    store = DiskStore(tmp_path / "cache", tmp_path / "symtabs")
    cache = ArtifactCache(store, repo, ProxyMetrics(CollectorRegistry()), max_bytes=100)

    def record(key: ArtifactKey, size: int) -> ArtifactRecord:
        path = store.artifact_path("", key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        now = datetime.now(UTC)
        return ArtifactRecord(key_hash("", key), "", key.id, key.build_id, str(key.kind), size, "0",
                              "u", "f", None, now, now, 0)

    old = ArtifactKey.parse("aa" * 20, "debuginfo")
    new = ArtifactKey.parse("bb" * 20, "debuginfo")
    await cache.add(record(old, 80))
    with cache.lease("", old):
        await cache.add(record(new, 80))  # over budget, but `old` is being sent
        assert store.artifact_path("", old).exists() and len(cache) == 2
    for _ in range(50):  # the end of the lease starts an eviction in the background
        if not store.artifact_path("", old).exists():
            break
        await asyncio.sleep(0.02)
    assert not store.artifact_path("", old).exists()
    assert store.artifact_path("", new).exists()
    assert cache.total_bytes == 80
    await repo.close()
