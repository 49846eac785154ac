"""Hit counts and access times reach SQL in batches; a batch whose write fails is kept for the
next flush, not lost (the LRU order across restarts and replicas depends on it), and a stop
waits for a batch being written."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
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
from proxy.web.state import STATE
from tests.db_locks import database_held
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually, make_config


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


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
async def test_a_stop_while_hits_are_written_waits_for_the_write_and_loses_none(
    start_symgate: SymgateFactory, tmp_path: Path, database_url: str, debuginfod: Debuginfod,
    elfs: ElfSet, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop cancelled the background jobs and went on without waiting for them. On
    SQLite, a flush waiting for the lock put its hits back only once the lock came free,
    after the stop's own last flush had run: lost, and its task outlived the stop. On
    PostgreSQL that last flush was left waiting for the lock. Driven by a lock on the rows,
    held until the stop says it waits for the flush (or is over)."""
    caplog.set_level(logging.INFO, logger="proxy.web.jobs")
    config = make_config(tmp_path / "d", database_url, [debuginfod.url])
    sg = await start_symgate(config=replace(
        config, server=replace(config.server, access_flush_s=0.05),
        # The flush waits for the test's lock, not 5 s (and fails).
        database=replace(config.database, timeout_s=60.0)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()  # its row written
    cache = sg.runner.app[STATE].service.cache
    kh = key_hash("", ArtifactKey.parse(elfs.prog.build_id, "debuginfo"))
    hits = 5
    # No write to the artifacts' rows completes in the block: SQLite's write lock, or
    # PostgreSQL's locks on the rows.
    async with database_held(database_url, "IMMEDIATE",
                             "SELECT key_hash FROM artifacts FOR UPDATE"):
        for _ in range(hits):
            assert (await sg.get(path))[0] == 200
        # A flush took some of them (the rest wait for the next), and writes them until the
        # lock is let go.
        await eventually(lambda: cache._pending_access.get(kh, (0, None))[0] < hits)
        stopping = asyncio.ensure_future(sg.stop())

        def waiting() -> bool:
            return any("waiting for background jobs under way" in r.getMessage()
                       and "ArtifactCache.flush_access" in r.getMessage()
                       for r in caplog.records)

        await eventually(lambda: stopping.done() or waiting())
    await asyncio.wait_for(stopping, 30)
    engine = create_engine(database_url)
    try:
        async with engine.connect() as c:
            assert (await c.execute(text("SELECT hits FROM artifacts"))).scalars().all() == [hits]
    finally:
        await engine.dispose()
    assert not [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_every"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not said, said
