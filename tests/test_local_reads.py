"""The point reads a cold fetch and a cold profile make of a SQLite file run on the caller's
thread through the sqlite3 driver (proxy.store.local_reads), and must give exactly what the
same queries give through the engine: the same types (aware datetimes, bools), the same
NULLs, the same rows. When the file is busy or gone they give way to the engine."""

from __future__ import annotations

import asyncio
import gc
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.store.local_reads import LocalReads
from proxy.store.migrate import upgrade
from proxy.store.repository import (
    _ARTIFACT_READ,
    _NEGATIVES_READ,
    ArtifactRecord,
    Repository,
    SymbolTableRecord,
    create_engine,
)

WHEN = datetime(2026, 12, 5, 6, 7, 8, 123456, tzinfo=UTC)


@pytest.fixture
async def repos(tmp_path: Path) -> AsyncIterator[tuple[Repository, Repository]]:
    """One database, read by a repository with local reads and by one without."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'r.sqlite'}"
    await asyncio.to_thread(upgrade, url)
    local, engine_only = Repository(create_engine(url)), Repository(create_engine(url))
    assert local._local is not None
    engine_only._local = None
    yield local, engine_only
    await local.close()
    await engine_only.close()


def _artifact(key_hash: str, *, archive: str | None, pinned: bool) -> ArtifactRecord:
    return ArtifactRecord(key_hash, "tenant-a", f"/buildid/{key_hash[:40]}/debuginfo",
                          key_hash[:40], "debuginfo", 12345678901, "ab" * 32,
                          "http://127.0.0.1:1", "debuginfo", archive, WHEN,
                          WHEN + timedelta(seconds=1), 7, "sig" if pinned else None,
                          pinned, not pinned)


def _table(build_id: str, expires: datetime | None, layout: str | None) -> SymbolTableRecord:
    return SymbolTableRecord("", build_id, "ok", "symcache-8", "key", 99, 0x400000,
                             "[[1, 2]]", "[]", True, layout, None, WHEN, 0.25, expires)


async def test_point_reads_give_what_the_engine_gives(
        repos: tuple[Repository, Repository]) -> None:
    local, engine_only = repos
    for rec in (_artifact("1" * 64, archive=None, pinned=False),
                _artifact("2" * 64, archive="x.rpm", pinned=True)):
        await local.put_artifact(rec)
    for upstream in ("http://a", "http://b"):
        await local.put_negative(key_hash="3" * 64, scope="", key="k", build_id="c" * 40,
                                 upstream=upstream, outcome="not_found", misses=3,
                                 first_seen=WHEN, expires_at=WHEN + timedelta(hours=1))
    await local.put_symbol_table(_table("d" * 40, None, None))
    await local.put_symbol_table(_table("e" * 40, WHEN + timedelta(days=2), "[[0, 1, 2, 3]]"))

    for kh in ("1" * 64, "2" * 64, "f" * 64):
        assert await local.get_artifact(kh) == await engine_only.get_artifact(kh)
    assert await local.get_artifact("2" * 64) == _artifact("2" * 64, archive="x.rpm",
                                                           pinned=True)
    for kh in ("3" * 64, "f" * 64):
        assert await local.get_negatives(kh) == await engine_only.get_negatives(kh)
    assert len(await local.get_negatives("3" * 64)) == 2
    for bid in ("d" * 40, "e" * 40, "f" * 40):
        assert await local.get_symbol_table("", bid) == \
            await engine_only.get_symbol_table("", bid)
    got = await local.get_symbol_table("", "e" * 40)
    assert got == _table("e" * 40, WHEN + timedelta(days=2), "[[0, 1, 2, 3]]")
    assert got is not None and got.has_lines is True and got.built_at.tzinfo is not None


async def test_a_locked_database_is_read_through_the_engine(
        repos: tuple[Repository, Repository], tmp_path: Path) -> None:
    """A writer holding the file exclusively makes the local read busy at once: the engine,
    which waits, answers once the writer is done, never a stale or empty answer."""
    local, _engine_only = repos
    await local.put_artifact(_artifact("1" * 64, archive=None, pinned=False))
    assert local._local is not None
    await local.engine.dispose()  # its pooled connections would keep the blocker out
    blocker = sqlite3.connect(tmp_path / "r.sqlite", isolation_level=None)
    blocker.execute("PRAGMA locking_mode=EXCLUSIVE")
    blocker.execute("BEGIN EXCLUSIVE")
    # The local read alone gives way at once ...
    assert local._local.rows(_ARTIFACT_READ, {"kh": "1" * 64, "replica": ""}) is None
    # ... and the repository's answer comes through the engine once the file is free.
    # (In exclusive locking mode, only closing lets go of the file.)
    asyncio.get_running_loop().call_later(0.2, blocker.close)
    found = await local.get_artifact("1" * 64)
    assert found == _artifact("1" * 64, archive=None, pinned=False)


async def test_a_database_file_that_is_gone_is_not_made_anew(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gone.sqlite'}"
    await asyncio.to_thread(upgrade, url)
    repo = Repository(create_engine(url))
    try:
        (tmp_path / "gone.sqlite").unlink()
        assert repo._local is not None
        assert repo._local.rows(_NEGATIVES_READ, {"kh": "x"}) is None
        assert not (tmp_path / "gone.sqlite").exists()
    finally:
        await repo.close()


async def test_closing_while_another_thread_reads_ends_its_reads_not_the_process(
        repos: tuple[Repository, Repository]) -> None:
    """A connection closed by another thread in the middle of its read crashed the process
    (SIGSEGV, 3 runs of 3 with a closing loop like this one): close() now leaves every
    other thread's connection to that thread."""
    local, _engine_only = repos
    reads = local._local
    assert reads is not None
    stop = threading.Event()
    answers: list[object] = []

    def reader() -> None:
        while not stop.is_set():
            answers.append(reads.rows(_NEGATIVES_READ, {"kh": "3" * 64}))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(200):
            reads.close()
            time.sleep(0.0005)
    finally:
        stop.set()
        thread.join()
    assert answers and answers[-1] is None  # closed: the engine's to answer
    assert await local.get_negatives("3" * 64) == []  # and it does


def test_the_connections_of_threads_that_ended_are_let_go(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'threads.sqlite'}"
    upgrade(url)
    reads = LocalReads.of(create_engine(url))
    assert reads is not None

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = descriptors()
    for _ in range(100):
        thread = threading.Thread(target=reads.rows, args=(_NEGATIVES_READ, {"kh": "x"}))
        thread.start()
        thread.join()
    gc.collect()
    assert descriptors() - before < 5
    reads.close()
