"""The SQLite file made read-only under a running server (immutable, or its filesystem
remounted read-only after an error), then writable again: misses are fetched and served
meanwhile, and once it is writable the rows kept in memory reach it, with no restart."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, eventually, make_config


def _immutable(files: list[Path], on: bool) -> None:
    done = subprocess.run(["chattr", "+i" if on else "-i", *map(str, files)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {done.stderr.strip()}")


def _rows(db: Path) -> set[str]:
    with sqlite3.connect(db) as con:
        return {key for key, in con.execute("SELECT key FROM artifacts")}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_rows_kept_while_sqlite_was_read_only_are_written_once_it_is_not(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """A connection opened while the file was read-only stayed read-only after it was
    writable again ("attempt to write a readonly database"): pooled, it failed the writes
    that drew it (every other one, with two) until a restart, and the rows kept meanwhile
    could be lost with the process (their files then orphans, fetched again)."""
    cfg = make_config(tmp_path / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=replace(cfg, server=replace(cfg.server,
                                                                access_flush_s=0.1)))
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.settled()
    db = tmp_path / "symgate.sqlite"
    # Not the -shm file, which SQLite maps: a write to a mapped page of an immutable file
    # is a SIGBUS (a filesystem remounted read-only would not map it writable at all).
    files = [db, tmp_path / "symgate.sqlite-wal"]
    _immutable(files, True)
    try:
        # The pool's connections closed, as a pool recycles them: the next one is opened on
        # the read-only file, which is what a busy server's pool comes to by itself.
        await sg.runner.app[STATE].repo.engine.dispose()
        status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
        assert status == 200 and body == elfs.other.debug.read_bytes()
        await sg.settled()
        assert f"{elfs.other.build_id}/debuginfo" not in _rows(db)
        # A ping reads, and reads still work: /healthz said "ok" while every write failed.
        status, _, text = await sg.get("/healthz")
        assert status == 200 and text.startswith(b"degraded\ndatabase: "), text
    finally:
        _immutable(files, False)

    async def written() -> bool:
        return f"{elfs.other.build_id}/debuginfo" in _rows(db)

    await eventually(written, timeout=20)
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 200 and body == elfs.big.debug.read_bytes()
    # Each a write of its own (a remembered miss), on whichever pooled connection comes. The
    # write that finds a connection read-only still fails (a miss is then remembered in
    # memory only); the connection is dropped with it, so the next ones are written.
    missing = [f"{n:02x}" * 20 for n in range(8)]
    for build_id in missing:
        assert (await sg.get(f"/buildid/{build_id}/debuginfo"))[0] == 404
    await sg.settled()
    with sqlite3.connect(db) as con:
        remembered = {bid for bid, in con.execute("SELECT build_id FROM negatives")}
    assert remembered <= set(missing) and len(set(missing) - remembered) <= 1, remembered

    async def kept() -> bool:  # a row that failed is kept, and written at the next flush
        return f"{elfs.big.build_id}/debuginfo" in _rows(db)

    await eventually(kept, timeout=20)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_hit_counts_that_cannot_be_written_keep_healthz_degraded(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """Hits alone while the file is read-only (no row of a new file to write): the failed
    write of their counts said the database down, and /healthz's ping, which reads, said it
    well again, round after round: the status page flipped between degraded and ok."""
    cfg = make_config(tmp_path / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=replace(cfg, server=replace(cfg.server,
                                                                access_flush_s=3600)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    cache = sg.runner.app[STATE].service.cache
    await cache.flush_access()
    files = [tmp_path / "symgate.sqlite", tmp_path / "symgate.sqlite-wal"]
    _immutable(files, True)
    try:
        await sg.runner.app[STATE].repo.engine.dispose()
        assert (await sg.get(path))[0] == 200  # a hit: its count to write
        with pytest.raises(Exception):  # noqa: B017  (the job logs what it is)
            await cache.flush_access()
        for _round in range(2):
            status, _, text = await sg.get("/healthz")
            assert status == 200 and text.startswith(b"degraded\ndatabase: "), text
    finally:
        _immutable(files, False)

    async def counts_written() -> bool:  # a connection opened read-only fails once, and goes
        with contextlib.suppress(Exception):
            await cache.flush_access()
        return (await sg.get("/healthz"))[2] == b"ok\n"

    await eventually(counts_written, timeout=20)

