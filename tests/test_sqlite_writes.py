"""A serving process's writes to SQLite queue in the process, one transaction after another,
rather than in SQLite's busy handler: a writer that finds the database locked sleeps 1, 2, 5,
10... ms and tries again, and a cold profile's tables, built at once, made their rows wait
each other's sleeps (proxy.store.repository)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlalchemy import event

from proxy.store.migrate import upgrade
from proxy.store.repository import Repository, create_engine
from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, eventually, make_config
from tests.test_database_down import stops_within_one_timeout, with_database_timeout
from tests.test_local_reads import WHEN, _artifact, _table


@pytest.fixture
async def impatient(tmp_path: Path) -> AsyncIterator[Repository]:
    """A repository on a SQLite file whose connections give up at once on a locked database
    (busy_timeout 0): a write that meets another of this process's in SQLite fails."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.sqlite'}"
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(url)

    @event.listens_for(engine.sync_engine, "connect")
    def _no_patience(dbapi_conn: Any, _record: Any) -> None:  # after create_engine's pragmas
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=0")
        cur.close()

    repo = Repository(engine)
    yield repo
    await repo.close()
    await engine.dispose()


async def test_concurrent_writes_of_one_process_never_meet_in_sqlite(
    impatient: Repository,
) -> None:
    # The engine's pool opens several connections, each its own thread: without the queue,
    # these transactions overlap in SQLite and all but one fail "database is locked".
    tables = [_table(f"{i:040x}", None, None) for i in range(40)]
    artifacts = [_artifact(f"{i:064x}", archive=None, pinned=False) for i in range(40)]
    await asyncio.gather(*(impatient.put_symbol_table(t) for t in tables),
                         *(impatient.put_artifact(a) for a in artifacts),
                         *(impatient.touch_bucket_object(f"{i:064x}", WHEN) for i in range(20)))
    for t in tables:
        got = await impatient.get_symbol_table(t.scope, t.build_id)
        assert got is not None and got.size == t.size
    for a in artifacts:
        assert await impatient.get_artifact(a.key_hash) is not None


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_file_locked_elsewhere_holds_no_miss_past_the_timeouts(
    start_symgate: SymgateFactory, faults: FaultUpstream, database_url: str, tmp_path: Path,
) -> None:
    """Another process holds the file's write lock (an operator's `BEGIN EXCLUSIVE`, a
    backup): each write fails after busy_timeout, and the misses queued behind the first
    must not each wait their own turn of it after the others'. They are answered (their 404
    remembered in memory), within database.timeout_s for their turn and as long again for
    SQLite's lock, however many came at once."""
    cfg = make_config(tmp_path / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=replace(cfg, database=replace(cfg.database, timeout_s=1.0)))
    assert (await sg.get("/healthz"))[0] == 200  # schema made; the server up
    blocker = sqlite3.connect(database_url.split("///", 1)[1], isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        # One after another, each waited its predecessors' busy_timeout: the last of 12 a
        # minute, far past this client's patience.
        patience = aiohttp.ClientTimeout(total=15)
        statuses = await asyncio.gather(*(
            sg.get(f"/buildid/{i:040x}/debuginfo", timeout=patience) for i in range(1, 13)))
        assert [s for s, _, _ in statuses] == [404] * 12
        # Remembered in memory meanwhile: a negative hit, not another upstream request.
        before = faults.count("ok")
        assert (await sg.get(f"/buildid/{1:040x}/debuginfo", timeout=patience))[0] == 404
        assert faults.count("ok") == before
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


async def test_a_long_database_timeout_is_the_longest_sqlite_waits(tmp_path: Path) -> None:
    """busy_timeout is a C int of milliseconds: database.timeout_s past some 24.8 days (an
    operator's 'wait as long as it takes') was read by SQLite as 0, and every write that met
    another process's lock failed at once instead of waiting."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.sqlite'}"
    engine = create_engine(url, 3_000_000.0)
    try:
        async with engine.connect() as conn:
            waits = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar()
    finally:
        await engine.dispose()
    assert waits == 2**31 - 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_stop_while_the_file_is_locked_elsewhere_waits_one_timeout_for_it(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """A flush of hit counts waits in SQLite's busy handler, in its thread, as the stop
    begins; the stop's last flush is given what is left of one timeout, but a cancel does not
    reach a statement in its thread: it waited its connection's whole busy_timeout, and the
    stop two timeouts in all."""
    timeout_s = 3.0
    cfg = make_config(tmp_path / "data", database_url, [faults.url_for("ok")])
    cfg = with_database_timeout(cfg, timeout_s)
    sg = await start_symgate(config=cfg)
    hit = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(hit))[0] == 200
    # The fetch's table built and recorded first: on a loaded machine (a CI run) the build
    # was still to write its row as the file was locked, and its statement too waited in
    # SQLite's busy handler on the one connection, which this test is not about.
    await sg.built()
    cache = sg.runner.app[STATE].service.cache
    blocker = sqlite3.connect(database_url.split("///", 1)[1], isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        assert (await sg.get(hit))[0] == 200  # a hit count to write

        async def flushing() -> bool:  # its batch taken, and not put back: being written
            return not cache._pending_access

        await eventually(flushing)
        await stops_within_one_timeout(sg, timeout_s)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
