"""`symgate serve` stopped by a signal at each phase of its life: whatever it was doing, it
exits 0 without a traceback and leaves no process and no folder of its own behind.

A phase is held open deterministically by the real parts it waits on (a database that a test
keeps locked), not by sleeping until it is probably under way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from pathlib import Path

import pytest

from tests.db_locks import database_held
from tests.elfs import ElfSet
from tests.harness import Debuginfod, eventually
from tests.processes import descendants, reap_all, spawn_serve, stop_serve


def _database_held(database_url: str) -> contextlib.AbstractAsyncContextManager[None]:
    """The database locked against the migrations for the block: they wait in it. On
    PostgreSQL, the table alembic reads first, made as alembic makes it, and locked: its read
    waits."""
    return database_held(
        database_url, "EXCLUSIVE", "LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE",
        pg_before="CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                  "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))")


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


async def _said_until(proc: asyncio.subprocess.Process, line: bytes) -> bytes:
    """What it printed up to and including `line` (it must print it within 60 s)."""
    assert proc.stdout is not None
    said = b""
    async with asyncio.timeout(60):
        while line not in said:
            chunk = await proc.stdout.read(4096)
            assert chunk, said.decode(errors="replace")
            said += chunk
    return said


@pytest.mark.one_database
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stop_signal_while_a_local_directory_is_walked_at_start_ends_the_walk(
        tmp_path: Path, database_url: str, debuginfod: Debuginfod, elfs: ElfSet, workers: int
) -> None:
    """The start went on to its end first (a minute for 30,000 files), then said "listening"
    just to stop: past a service manager's patience for a big enough tree. Now the walk is
    left and the server stops before it serves."""
    tree = tmp_path / "debug"
    tree.mkdir()
    for n in range(5000):  # links: as many files to open, for no room on disk
        os.link(elfs.prog.debug, tree / f"{n}.debug")
    _, proc = await spawn_serve(tmp_path, tmp_path / "d", database_url, debuginfod.url,
                                workers=workers, extra=f'[[upstreams]]\npath = "{tree}"\n')
    try:
        # Logged just before the local directories are walked.
        said = await _said_until(proc, b"cache index loaded")
        proc.terminate()
        said += (await asyncio.wait_for(proc.communicate(), 60))[0]
    finally:
        await stop_serve([proc])
    text = said.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "listening on" not in text and "Traceback" not in text, text
    assert "Unclosed" not in text and "destroyed" not in text, text


async def test_a_stop_that_cuts_the_database_closing_at_start_closes_it_quietly(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose start failed on an old schema made the supervisor stop the others; one
    cut while its pool's connections closed, and SQLAlchemy logged a traceback for each on a
    start that said its one line. Cut at each step of the closing in turn: the connections
    still close, the cut is passed on, and nothing is logged."""
    from proxy.store import migrate
    from proxy.store.repository import Repository, create_engine

    await asyncio.to_thread(migrate.upgrade, database_url)
    cuts = 0
    for steps in range(1, 100):  # 0: cancelled before it begins, so it never closes
        repo = Repository(create_engine(database_url, 10.0), replica="r", timeout_s=10.0)
        async with repo.engine.connect() as c:  # one pooled connection for close to close
            await c.exec_driver_sql("SELECT 1")
        pool = repo.engine.sync_engine.pool
        closing = asyncio.create_task(repo.close())
        for _ in range(steps):
            await asyncio.sleep(0)
        cut = closing.cancel()
        try:
            await closing
        except asyncio.CancelledError:
            assert cut
            cuts += 1
        else:
            assert not cut, steps  # a close that was cut returned as if it was not
        assert pool.checkedin() == 0, steps
        if not cut:
            break  # closed within `steps`: a later cut finds nothing under way
    assert cuts >= 1
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
