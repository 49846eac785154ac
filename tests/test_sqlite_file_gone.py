"""The SQLite file deleted, or another moved to its path, under a running server: its open
connections go on answering (the file they opened is still open) and hits are served, but
what it writes is lost at the next start, which finds another file or none. /healthz says
so, rather than "ok"."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pytest

from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, make_config


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_sqlite_file_gone_from_under_the_server_is_degraded(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, how: str,
) -> None:
    db = Path(database_url.split("///", 1)[1])
    sg = await start_symgate(config=make_config(tmp_path / "data", database_url,
                                                [faults.url_for("ok")]))
    hit = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(hit))[0] == 200
    assert (await sg.get("/healthz"))[2] == b"ok\n"

    if how == "deleted":
        for name in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            name.unlink(missing_ok=True)
    else:  # a copy put in its place (a backup restored with mv)
        copy = tmp_path / "copy.sqlite"
        with contextlib.closing(sqlite3.connect(db)) as source, \
                contextlib.closing(sqlite3.connect(copy)) as target:
            source.backup(target)
        os.replace(copy, db)
    status, _, body = await sg.get(hit)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    for _ in range(2):  # every probe says it, not only the first
        status, _, text = await sg.get("/healthz")
        assert status == 200 and text.startswith(b"degraded\n"), text
        assert b"deleted or replaced while in use" in text, text
