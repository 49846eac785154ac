"""Hit counts and access times reach SQL in batches; a batch whose write fails is kept for the
next flush, not lost (the LRU order across restarts and replicas depends on it)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from proxy.artifacts.index import ArtifactCache, key_hash
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.store.disk import DiskStore
from proxy.store.migrate import upgrade
from proxy.store.repository import ArtifactRecord, Repository, create_engine


async def _rename(database_url: str, old: str, new: str) -> None:
    """Another connection takes the table away (or gives it back): every write to it fails,
    on SQLite and PostgreSQL alike, without touching symgate's code."""
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))
    finally:
        await engine.dispose()


async def test_a_failed_flush_keeps_its_hits_for_the_next(
    tmp_path: Path, database_url: str
) -> None:
    await asyncio.to_thread(upgrade, database_url)
    repo = Repository(create_engine(database_url))
    store = DiskStore(tmp_path / "cache", tmp_path / "symtabs")
    cache = ArtifactCache(store, repo, ProxyMetrics(CollectorRegistry()), max_bytes=1000)
    key = ArtifactKey.parse("ab" * 20, "debuginfo")
    path = store.artifact_path("", key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 10)
    then = datetime(2020, 1, 1, tzinfo=UTC)
    await cache.add(ArtifactRecord(key_hash("", key), "", key.id, key.build_id, "debuginfo",
                                   10, "0", "u", "f", None, then, then, 0))
    try:
        for _ in range(2):
            assert await cache.get("", key) is not None
        await _rename(database_url, "artifacts", "artifacts_away")
        with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises; it is logged
            await cache.flush_access()
        await _rename(database_url, "artifacts_away", "artifacts")
        assert await cache.get("", key) is not None  # one more since the failed flush
        await cache.flush_access()
        row = await repo.get_artifact(key_hash("", key))
        assert row is not None and row.hits == 3 and row.last_access > then
    finally:
        await repo.close()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_two_processes_flushing_the_same_files_never_deadlock(database_url: str) -> None:
    """Two serving processes of one replica flush hit counts of the same files, each batch in
    the order its own hits came. Rows updated in those orders, one transaction each, wait on
    each other: PostgreSQL breaks the cycle by failing one flush ("deadlock detected"), a
    logged error and a second of waiting every few flushes under real traffic."""
    await asyncio.to_thread(upgrade, database_url)
    repos = [Repository(create_engine(database_url), replica="r") for _ in range(2)]
    then = datetime(2020, 1, 1, tzinfo=UTC)
    hashes = []
    try:
        for i in range(20):
            key = ArtifactKey.parse(f"{i:02x}" * 20, "debuginfo")
            hashes.append(key_hash("", key))
            await repos[0].put_artifact(ArtifactRecord(hashes[-1], "", key.id, key.build_id,
                                                       "debuginfo", 10, "0", "u", "f", None,
                                                       then, then, 0))
        now = datetime.now(UTC)
        # Each statement of a flush is an await: the two interleave, one row at a time.
        await asyncio.gather(
            repos[0].record_access({kh: (1, now) for kh in hashes}),
            repos[1].record_access({kh: (1, now) for kh in reversed(hashes)}))
        for kh in hashes:
            row = await repos[0].get_artifact(kh)
            assert row is not None and row.hits == 2
    finally:
        for repo in repos:
            await repo.close()
