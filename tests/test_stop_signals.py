"""`symgate serve` stopped by a signal at each phase of its life: whatever it was doing, it
exits 0 without a traceback and leaves no process and no folder of its own behind.

A phase is held open deterministically by the real parts it waits on (a database that a test
keeps locked), not by sleeping until it is probably under way."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import Debuginfod, eventually
from tests.processes import descendants, reap_all, spawn_serve, stop_serve


@contextlib.asynccontextmanager
async def _database_held(database_url: str) -> AsyncIterator[None]:
    """The database locked against the migrations for the block: they wait in it."""
    if database_url.startswith("sqlite"):
        conn = sqlite3.connect(database_url.split(":///", 1)[1], isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.close()
        return
    import asyncpg

    pg = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    # The table alembic reads first, made as alembic makes it, and locked: its read waits.
    await pg.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                     "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))")
    tx = pg.transaction()
    await tx.start()
    await pg.execute("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE")
    try:
        yield
    finally:
        await tx.rollback()
        await pg.close()


def _named(root: int, name: str) -> set[int]:
    found = set()
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.add(pid)
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_while_the_supervisor_migrates_stops_it_cleanly(
        tmp_path: Path, database_url: str, debuginfod: Debuginfod, sig: signal.Signals
) -> None:
    """Its handlers were set only once the migrations were done: a SIGTERM meanwhile killed
    the supervisor outright (status -15, its metrics folder left behind), a SIGINT ended in
    a KeyboardInterrupt traceback."""
    async with _database_held(database_url):
        _, proc = await spawn_serve(tmp_path, tmp_path / "d", database_url, debuginfod.url,
                                    workers=2)
        try:
            async def migrating() -> bool:
                return bool(_named(proc.pid, "symgate-migrate"))

            await eventually(migrating)
            tree = descendants(proc.pid)
            proc.send_signal(sig)
            await asyncio.wait_for(proc.wait(), 30)
        finally:
            await stop_serve([proc])
    # Read once the database is let go: a migration left running keeps the pipe open.
    said = (await asyncio.wait_for(proc.communicate(), 30))[0].decode(errors="replace")
    assert proc.returncode == 0, said
    assert "Traceback" not in said, said
    await reap_all(tree, "the supervisor")
    # Its metrics folder and multiprocessing's, named after it (proxy.web.supervisor).
    assert not list(Path(tempfile.gettempdir()).glob(f"symgate-*-{proc.pid}-*"))
