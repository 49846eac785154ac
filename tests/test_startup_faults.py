"""Start-up and command-line faults a new user meets end in one clear line and a non-zero exit,
never a traceback (issue 11, item 17).

Every case is a run of the real `symgate` command; they run at once (one module fixture), since
each spends most of its second importing, and the tests check one run each.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.store import migrate
from tests.harness import free_port
from tests.profiles import make_profile

PG_UNREACHABLE = "postgresql+asyncpg://nobody@127.0.0.1:9/none"  # nothing listens on port 9
NO_DRIVER = "mysql+nosuchdriver://x@127.0.0.1/y"


@dataclass
class Run:
    code: int
    lines: list[str]
    text: str


def _serve_config(root: Path, data: Path, port: int | None = None, url: str = "") -> str:
    text = (f'[server]\nlisten = "127.0.0.1:{port or free_port()}"\n'
            f'data_dir = "{data}"\n')
    return text + (f'[database]\nurl = "{url}"\n' if url else "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    root = tmp_path_factory.mktemp("startup")
    (root / "a-file").write_text("not a directory")
    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root writes anywhere: for it, a file in the way is what cannot be created through
    uncreatable = (root / "a-file" / "data") if os.geteuid() == 0 else (locked / "data")
    profile = root / "in.pb.gz"
    profile.write_bytes(gzip.compress(make_profile([]).SerializeToString()))
    # A database a newer symgate migrated (a revision these migrations lack), and one an
    # older symgate left (0005), each in a data dir of its own.
    newer, older = root / "newer", root / "older"
    for data, revision in ((newer, "head"), (older, "0005")):
        migrate.upgrade(f"sqlite+aiosqlite:///{data / 'symgate.sqlite'}", revision)
    with contextlib.closing(sqlite3.connect(newer / "symgate.sqlite")) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")
    # A SQLite file that cannot be opened (a directory in its place, as root meets it).
    (root / "unopenable" / "symgate.sqlite").mkdir(parents=True)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    cases: dict[str, tuple[list[str], str]] = {
        "port-in-use": (["serve"], _serve_config(root, root / "d1", busy_port)),
        "data-is-a-file": (["serve"], _serve_config(root, root / "a-file")),
        "data-cannot-be-created": (["serve"], _serve_config(root, uncreatable)),
        "no-migrate": (["serve", "--no-migrate"], _serve_config(root, root / "d2")),
        "serve-pg-unreachable": (["serve"], _serve_config(root, root / "d3", url=PG_UNREACHABLE)),
        "serve-no-driver": (["serve"], _serve_config(root, root / "d4", url=NO_DRIVER)),
        "db-upgrade-pg-unreachable": (["db", "upgrade"],
                                      _serve_config(root, root / "d5", url=PG_UNREACHABLE)),
        "serve-newer-schema": (["serve", "--workers", "1"], _serve_config(root, newer)),
        "serve-workers-newer-schema": (["serve", "--workers", "2"],
                                       _serve_config(root, newer)),
        "serve-no-migrate-newer-schema": (["serve", "--workers", "1", "--no-migrate"],
                                          _serve_config(root, newer)),
        "serve-workers-no-migrate-newer-schema": (["serve", "--workers", "2", "--no-migrate"],
                                                  _serve_config(root, newer)),
        "db-upgrade-newer-schema": (["db", "upgrade"], _serve_config(root, newer)),
        "db-current-newer-schema": (["db", "current"], _serve_config(root, newer)),
        "no-migrate-older-schema": (["serve", "--no-migrate"], _serve_config(root, older)),
        "serve-sqlite-unopenable": (["serve", "--workers", "1"],
                                    _serve_config(root, root / "unopenable")),
        "serve-no-migrate-sqlite-unopenable": (["serve", "--workers", "1", "--no-migrate"],
                                               _serve_config(root, root / "unopenable")),
        "symbolize-missing-input": (
            ["symbolize", str(root / "absent.pb.gz"), "-o", str(root / "o1")], ""),
        "symbolize-missing-output-folder": (
            ["symbolize", str(profile), "-o", str(root / "no" / "such" / "o2"),
             "--debug-dir", str(root)], ""),
        "symbolize-unreachable-server": (
            ["symbolize", str(profile), "-o", str(root / "o3"),
             "--server", "http://127.0.0.1:9"], ""),
    }

    def run(name: str) -> Run:
        args, config = cases[name]
        cmd = ["symgate", *args]
        if config:
            conf = root / f"{name}.toml"
            conf.write_text(config)
            cmd += ["--config", str(conf)]
        env = {**os.environ, "HOME": str(root), "XDG_DATA_HOME": str(root / "xdg"),
               "DEBUGINFOD_URLS": "http://127.0.0.1:9/"}
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        text = result.stdout + result.stderr
        return Run(result.returncode, [ln for ln in text.splitlines() if ln.strip()], text)

    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            yield dict(zip(cases, pool.map(run, cases), strict=True))
    finally:
        busy.close()
        locked.chmod(0o700)
    assert not (root / "o3").exists()


def _one_clear_line(run: Run, *words: str) -> None:
    assert run.code != 0, run.text
    assert "Traceback" not in run.text, run.text
    # alembic says which dialect it runs on as it connects: not the fault, nor part of it
    said = [ln for ln in run.lines if "INFO alembic.runtime.migration" not in ln]
    assert 1 <= len(said) <= 2, run.text
    for word in words:
        assert word in run.text, run.text


def test_port_in_use_is_one_line_and_never_says_listening(runs: dict[str, Run]) -> None:
    run = runs["port-in-use"]
    _one_clear_line(run, "cannot listen on 127.0.0.1:", "address already in use")
    assert "listening on" not in run.text


@pytest.mark.parametrize("case", ["data-is-a-file", "data-cannot-be-created"])
def test_unusable_data_dir_is_one_line(runs: dict[str, Run], case: str) -> None:
    _one_clear_line(runs[case], "cannot use data directory")


def test_no_migrate_on_a_fresh_database_says_to_upgrade(runs: dict[str, Run]) -> None:
    _one_clear_line(runs["no-migrate"], "symgate db upgrade")


@pytest.mark.parametrize("case", ["serve-newer-schema", "serve-workers-newer-schema",
                                  "serve-no-migrate-newer-schema",
                                  "serve-workers-no-migrate-newer-schema",
                                  "db-upgrade-newer-schema", "db-current-newer-schema"])
def test_a_database_a_newer_symgate_migrated_is_one_line(runs: dict[str, Run], case: str
                                                         ) -> None:
    """Neither upgraded nor used (this version's queries are not written for that schema),
    and said so: not alembic's traceback of a revision it cannot locate. With --no-migrate
    too (a deploy whose own job upgrades the schema), which started and served with it."""
    _one_clear_line(runs[case], "revision 0099", "a newer symgate")


def test_no_migrate_on_an_older_schema_says_to_upgrade(runs: dict[str, Run]) -> None:
    """A column a later migration added, missing: the same advice as a schema missing."""
    _one_clear_line(runs["no-migrate-older-schema"], "symgate db upgrade")


@pytest.mark.parametrize("case", ["serve-pg-unreachable", "serve-no-driver",
                                  "db-upgrade-pg-unreachable"])
def test_unusable_database_at_start_is_one_line(runs: dict[str, Run], case: str) -> None:
    _one_clear_line(runs[case], "database")


@pytest.mark.parametrize("case", ["serve-sqlite-unopenable",
                                  "serve-no-migrate-sqlite-unopenable"])
def test_a_sqlite_file_that_cannot_be_opened_is_one_line(runs: dict[str, Run], case: str
                                                         ) -> None:
    """Not followed by the traceback of aiosqlite's thread for the failed connect, whose
    answer came to the start's event loop once it was closed (most starts)."""
    _one_clear_line(runs[case], "cannot use the database at", "unable to open database file")


def test_a_failed_sqlite_connect_leaves_no_thread_behind(tmp_path: Path) -> None:
    """What the test above sees in most starts, made certain: when the connect has failed,
    its thread has ended, so that nothing of it can come to a loop closed meanwhile."""
    import asyncio
    import sys
    import threading

    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from proxy.store.repository import create_engine

    (tmp_path / "symgate.sqlite").mkdir()
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'symgate.sqlite'}", 5.0)

    async def connect() -> list[threading.Thread]:
        with pytest.raises(OperationalError, match="unable to open database file"):
            async with engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
        # aiosqlite names its threads after their function.
        left = [t for t in threading.enumerate() if "_connection_worker_thread" in t.name]
        await engine.dispose()
        return left

    # This thread keeps the interpreter from the moment the connect fails until the threads
    # are listed (it waits on nothing between them): aiosqlite's thread cannot end there.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        left = asyncio.run(connect())
    finally:
        sys.setswitchinterval(switch)
    assert left == []


@pytest.mark.parametrize("case, names", [
    ("symbolize-missing-input", "absent.pb.gz"),
    ("symbolize-missing-output-folder", "o2"),
    ("symbolize-unreachable-server", "http://127.0.0.1:9"),
])
def test_symbolize_faults_are_one_line(runs: dict[str, Run], case: str, names: str) -> None:
    _one_clear_line(runs[case], names)
