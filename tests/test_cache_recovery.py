"""The cache index and the files on disk agree: a restart keeps every hit and clears what a
crash left behind, and a cached file that is gone or short, found at start-up or while
serving, is fetched again rather than served."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from sqlalchemy import text

from proxy.artifacts.index import key_hash
from proxy.keys import ArtifactKey
from proxy.store.replica import replica_id
from proxy.store.repository import ArtifactRecord, Repository, create_engine
from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory


async def test_restart_keeps_hits_and_cleans_crash_leftovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.stop()
    cache_dir = sg.config.cache_dir
    (cache_dir / "tmp" / "deadbeef.part").write_bytes(b"half a download")
    orphan = cache_dir / "objects" / "cc" / "dd" / "debuginfo"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"renamed into place, row never written")
    sg2 = await start_symgate(config=sg.config)
    status, _, body = await sg2.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("ok") == 1
    assert await sg2.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                            outcome="hit") == 1
    # The first server gave up its temp folder and lock when it stopped, as an exiting
    # process does: with no other process alive, the orphan is a crash's and goes.
    assert not any(p.is_file() and p.suffix != ".lock" for p in (cache_dir / "tmp").rglob("*"))
    assert not orphan.exists()


async def test_restart_drops_rows_whose_file_is_gone_or_short(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    for e in (elfs.prog, elfs.other):
        await sg.get(f"/buildid/{e.build_id}/debuginfo")
    await sg.stop()
    objects = sg.config.cache_dir / "objects"
    (objects / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name).unlink()
    short = objects / ArtifactKey.parse(elfs.other.build_id, "debuginfo").storage_name
    short.write_bytes(short.read_bytes()[:100])
    sg2 = await start_symgate(config=sg.config)
    assert await sg2.metric("symgate_cache_entries") == 0
    for e in (elfs.prog, elfs.other):
        status, _, body = await sg2.get(f"/buildid/{e.build_id}/debuginfo")
        assert status == 200 and body == e.debug.read_bytes()
    assert faults.count("ok") == 4


async def test_a_row_whose_key_is_no_key_is_dropped_and_the_server_starts(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A row edited by hand or damaged, whose key reads as no key: the index's load raised,
    and the server could not start. The row goes as a stale one does; the others stay."""
    sg = await start_symgate([faults.url_for("ok")])
    for e in (elfs.prog, elfs.other):
        await sg.get(f"/buildid/{e.build_id}/debuginfo")
    await sg.settled()
    engine = sg.runner.app[STATE].repo.engine
    async with engine.begin() as c:
        await c.execute(text("UPDATE artifacts SET key = 'not hex/debuginfo' WHERE build_id = "
                             ":bid"), {"bid": elfs.prog.build_id})
    await sg.stop()
    sg2 = await start_symgate(config=sg.config)
    assert await sg2.metric("symgate_cache_entries") == 1
    for e in (elfs.prog, elfs.other):
        status, _, body = await sg2.get(f"/buildid/{e.build_id}/debuginfo")
        assert status == 200 and body == e.debug.read_bytes()
    assert faults.count("ok") == 3  # the damaged row's file fetched again, the other a hit


async def test_a_cached_file_deleted_behind_the_servers_back_is_fetched_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    stored.unlink()
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    await sg.settled()
    assert faults.count("ok") == 2 and stored.exists()
    assert await sg.metric("symgate_cache_entries") == 1


async def test_a_process_starting_keeps_the_rows_another_commits_while_it_loads(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A serving process that starts beside running ones (a worker the supervisor replaces
    after it died, a second server on the data dir) lists the disk, then reads the rows: a
    file another process commits in between (renamed, then its row written) has a row but
    was not in the listing. That row is the commit's, not a crash's, and must stay. The
    commit is injected between the two reads."""
    first = await start_symgate([faults.url_for("ok")], data_dir=tmp_path / "d")
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    real = Repository.all_artifacts
    committed = False

    async def commit_then_read(repo: Repository) -> Sequence[ArtifactRecord]:
        nonlocal committed
        if not committed:
            committed = True
            assert (await first.get(path))[0] == 200
            await first.settled()
        return await real(repo)

    monkeypatch.setattr(Repository, "all_artifacts", commit_then_read)
    await start_symgate([faults.url_for("ok")], data_dir=tmp_path / "d")
    monkeypatch.undo()
    assert committed
    key = ArtifactKey.parse(elfs.prog.build_id, "debuginfo")
    repo = Repository(create_engine(database_url), replica=replica_id(first.config.cache_dir))
    try:
        assert await repo.get_artifact(key_hash("", key)) is not None
    finally:
        await repo.close()
    assert (first.config.cache_dir / "objects" / key.storage_name).exists()


@pytest.mark.parametrize("removed", ["its contents", "the folder"])
async def test_the_cache_removed_under_a_running_server_is_made_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, removed: str
) -> None:
    """An operator's `rm -rf cache/*` (or of the folder) to clear the cache of a running
    server: every miss after it was a 500 (an internal error, a traceback each) until the
    server was restarted, since the folders its downloads and their locks go in were gone
    (tmp/, flights/), and /healthz said nothing (or that the disk was read-only). They are
    made again as they are needed, and the files removed are fetched again."""
    sg = await start_symgate([faults.url_for("ok")])
    prog = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(prog))[0] == 200
    await sg.built()
    cache = sg.config.cache_dir
    if removed == "the folder":
        shutil.rmtree(cache)
    else:
        for path in cache.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for e in (elfs.other, elfs.prog):
        status, _, body = await sg.get(f"/buildid/{e.build_id}/debuginfo")
        assert status == 200 and body == e.debug.read_bytes()
    await sg.built()
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="internal") == 0
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    for e in (elfs.other, elfs.prog):
        assert (cache / "objects" / ArtifactKey.parse(e.build_id, "debuginfo").storage_name
                ).exists()
