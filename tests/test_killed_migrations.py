"""A server killed while it migrates the database (at its first start, or at the first start
of a newer version) leaves it as it was before: the next start migrates it from there.

The migrations run in a real process, killed with SIGKILL as a given statement of theirs has
run; then the ordinary upgrade runs on the same database."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from proxy.store import migrate
from proxy.store.repository import create_engine
from tests.harness import Debuginfod
from tests.processes import run_in_thread, spawn_serve, stop_serve, wait_until_serving

# Runs the migrations and SIGKILLs itself once a statement containing argv[2] has run.
_KILLED_AT = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
from proxy.store import migrate

@event.listens_for(Engine, "after_cursor_execute")
def _killed(conn, cursor, statement, *args):
    if sys.argv[2] in statement:
        os.kill(os.getpid(), signal.SIGKILL)

migrate.upgrade(sys.argv[1])
"""

ROOT = Path(__file__).resolve().parent.parent


async def _revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            with contextlib.suppress(Exception):
                return (await conn.execute(text("SELECT version_num FROM alembic_version"))
                        ).scalar()
        return None
    finally:
        await engine.dispose()


@pytest.mark.parametrize("statement", [
    "CREATE TABLE negatives",  # the first migration's second table: its first one is made
    "INSERT INTO artifacts_new",  # migration 0005, its table made anew: 0001 to 0004 are done
])
async def test_a_migration_killed_midway_is_done_at_the_next_start(
        database_url: str, statement: str) -> None:
    # SQLite's driver began no transaction before a CREATE or ALTER (only before INSERT,
    # UPDATE or DELETE), and alembic committed SQLite's migrations one by one: a kill midway
    # kept the tables made so far without their revision, and every later start failed on
    # "table artifacts already exists" (or "duplicate column", "artifacts_new already
    # exists"), for good.
    killed = await run_in_thread([sys.executable, "-c", _KILLED_AT, database_url, statement],
                                 env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert await _revision(database_url) == await asyncio.to_thread(_head)


def _head() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()


async def test_a_migration_waits_for_another_servers_migration_on_sqlite(
        tmp_path: Path, debuginfod: Debuginfod) -> None:
    """Two servers started at once on a fresh SQLite database: the one that came second to
    the file's write lock failed at once with "database is locked" (its transaction had
    read alembic_version before it asked to write), rather than waiting for the first one's
    migration and finding the schema at head. The first one is played by a connection of
    the test's holding the write lock."""
    db = tmp_path / "symgate.sqlite"
    url = f"sqlite+aiosqlite:///{db}"
    held = sqlite3.connect(db, isolation_level=None)
    held.execute("PRAGMA journal_mode=WAL")  # as symgate's connections set it
    held.execute("BEGIN IMMEDIATE")
    base, proc = await spawn_serve(tmp_path, tmp_path / "d", url, debuginfod.url)
    try:
        assert proc.stdout is not None
        said = b""
        async with asyncio.timeout(60):
            while b"Will assume transactional DDL" not in said:
                said += await proc.stdout.readline()
                assert not proc.stdout.at_eof(), said.decode()
        # Time to reach the lock: arriving later only lets the test pass without a wait.
        await asyncio.sleep(1)
        held.rollback()
        await wait_until_serving(base, proc)
    finally:
        held.close()
        await stop_serve([proc])
