"""`symgate cache ...` and `symgate negative ...` against a running server's state."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from proxy.artifacts.purges import PurgeNotices
from proxy.config import CacheConfig, NegativeConfig
from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from tests.elfs import ElfSet, replace_section_compressed
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, cli, config_file, eventually
from tests.processes import run_in_thread
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config

MISSING = "00112233445566778899aabbccddeeff00112233"


async def test_cache_ls_stats_and_purge(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    for e in (elfs.prog, elfs.other):
        assert (await sg.get(f"/buildid/{e.build_id}/debuginfo"))[0] == 200
    # A file's row is written after its client's last byte: the CLI reads SQL.
    await sg.settled()
    cfg = config_file(sg, tmp_path)
    ls = await cli(cfg, "cache", "ls")
    assert ls.returncode == 0, ls.stderr
    assert f"{elfs.prog.build_id}/debuginfo" in ls.stdout
    assert f"{elfs.other.build_id}/debuginfo" in ls.stdout
    stats = json.loads((await cli(cfg, "cache", "stats", "--json")).stdout)
    size = elfs.prog.debug.stat().st_size + elfs.other.debug.stat().st_size
    assert stats["entries"] == 2 and stats["bytes"] == size
    # `cache stats BUILD_ID` printed the whole cache's numbers, as if they were that build's.
    one = await cli(cfg, "cache", "stats", elfs.prog.build_id)
    assert one.returncode == 2 and one.stdout == ""
    assert "cache stats is of the whole cache" in one.stderr
    assert (await cli(cfg, "cache", "purge")).returncode == 2  # everything needs --all
    purged = await cli(cfg, "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0 and "purged 1 artifacts" in purged.stdout
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    assert not stored.exists()
    only = json.loads((await cli(cfg, "cache", "ls", "--json")).stdout)
    assert [r["key"] for r in only] == [f"{elfs.other.build_id}/debuginfo"]
    # Options between the action and its BUILD_ID, as an operator writes them: argparse had
    # matched the BUILD_ID to nothing, then refused it as an "unrecognized argument".
    one_ls = await run_in_thread(["symgate", "cache", "ls", "--config", str(cfg), "--json",
                                  elfs.other.build_id], timeout=60)
    assert one_ls.returncode == 0, one_ls.stderr
    assert [r["key"] for r in json.loads(one_ls.stdout)] == [f"{elfs.other.build_id}/debuginfo"]
    # The running server notices and fetches the purged file again.
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 3
    bad = await cli(cfg, "cache", "ls", "not-hex")
    assert bad.returncode == 2 and "invalid build ID" in bad.stderr


async def test_an_empty_build_id_purges_and_clears_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """`symgate cache purge "$ID"` with $ID unset or empty purged the whole cache (uploads,
    which no upstream gives back, too) and `negative clear ""` every miss, as only --all may:
    an empty BUILD_ID was taken for none."""
    sg = await start_symgate([faults.url_for("ok")])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.settled()
    cfg = config_file(sg, tmp_path)
    for command in (["cache", "purge", ""], ["negative", "clear", ""], ["cache", "ls", ""]):
        refused = await cli(cfg, *command)
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert "invalid build ID" in refused.stderr, refused.stderr
    listed = json.loads((await cli(cfg, "cache", "ls", "--json")).stdout)
    assert [r["key"] for r in listed] == [f"{elfs.prog.build_id}/debuginfo"]


@pytest.mark.parametrize(("args", "said"), [
    (["cache", "ls", "--all"], "--all goes with cache purge, not cache ls"),
    (["cache", "stats", "--all"], "--all goes with cache purge, not cache stats"),
    (["negative", "ls", "--all", "--json"], "--all goes with negative clear, not negative ls"),
    (["cache", "purge", "--all", "--pinned"], "--pinned goes with cache ls, not cache purge"),
    # Everything, or one build ID: the BUILD_ID won, and --all went nowhere as silently.
    (["cache", "purge", "ab" * 20, "--all"], "cache purge takes a BUILD_ID or --all, not both"),
    (["cache", "purge", "--all", "ab" * 20], "cache purge takes a BUILD_ID or --all, not both"),
    (["cache", "ls", "--json", "ab" * 20, "cd" * 20], "unrecognized arguments: " + "cd" * 20),
    (["negative", "clear", "ab" * 20, "--all"],
     "negative clear takes a BUILD_ID or --all, not both"),
    # Neither: said before the missing database was (exit 1, as if the usage were right).
    (["cache", "purge"], "cache purge needs a BUILD_ID, or --all"),
    (["negative", "clear", "--json"], "negative clear needs a BUILD_ID, or --all"),
])
def test_an_option_of_another_action_is_a_usage_error(
        args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cache ls --all` listed, as `cache ls` does, and nothing said that --all (everything,
    of a purge or a clear) went nowhere. Refused before the data dir is read: no cache is
    needed to tell."""
    from proxy.tools.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([*args, "--data-dir", str(tmp_path)])
    assert stopped.value.code == 2
    assert f"symgate: error: {said}\n" in capsys.readouterr().err


async def test_a_file_fetched_again_before_the_purge_reached_the_server_stays(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """A purge reaches a running server at its next poll (cache.purge_poll_s). A request in
    between finds the file gone, fetches it again and keeps it: the notice, applied after,
    took that new copy too (and a profile whose table was built from it meanwhile got a 503:
    tests/test_shared_builds.py met it under load), and the next request fetched it a third
    time. The purge is of the versions it found; a commit made since stays. The await point:
    the server's own poll held off (an hour), this process's notices applied by hand."""
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(purge_poll_s=3600))
    state = sg.runner.app[STATE]
    notices = PurgeNotices(state.repo, state.service.cache)
    await notices.start()
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    purged = await cli(config_file(sg, tmp_path), "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0 and not stored.exists(), purged.stderr
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 2
    await sg.settled()
    assert await notices.poll() == 1
    assert stored.exists()
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 2


# SQLite commits one writer at a time: its notice ids commit in order.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize(("between", "behind_s"), [("start", 0), ("poll", 0), ("start", 300)])
async def test_a_purge_committed_out_of_order_is_applied(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    between: str, behind_s: int
) -> None:
    """Two purges on PostgreSQL may take notice ids in one order and commit in the other. A
    serving process that started between the two commits took the newest id there as applied,
    and never applied the other: the purged file stayed on its disk and in its memory, served
    for good (one that polled between them looks for the id it passed over). Nor may a clock
    tell it the missing id is settled: the later purges' replica stamped them `behind_s`
    slow, and a start that took a notice stamped over GAP_WAIT_S ago for one committed that
    long ago gave up the id below it. The await point: the first purge's transaction held
    open by the test, the server's own poll held off (an hour), the notices applied by
    hand."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(purge_poll_s=3600))
    state = sg.runner.app[STATE]
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    engine = create_async_engine(database_url)
    notices = PurgeNotices(state.repo, state.service.cache)
    if between == "poll":
        await notices.start()
    try:
        async with engine.connect() as held:
            # The first purge takes its id and holds its transaction open...
            row = (await held.execute(text(
                "DELETE FROM artifacts WHERE build_id = :b RETURNING key_hash, scope, key"),
                {"b": elfs.prog.build_id})).one()
            await held.execute(text(
                "INSERT INTO purges (key_hash, scope, key, purged_at) "
                "VALUES (:h, :s, :k, now())"), {"h": row.key_hash, "s": row.scope, "k": row.key})
            # ...while two more, of a file this server never had, commit after it.
            async with engine.begin() as other:
                for _ in range(2):
                    await other.execute(text(
                        "INSERT INTO purges (key_hash, scope, key, purged_at) "
                        "VALUES ('0', '', :k, now() - make_interval(secs => :behind))"),
                        {"k": f"{MISSING}/debuginfo", "behind": behind_s})
            if between == "start":
                await notices.start()  # a process starting now, its index loaded with the row
            else:
                assert await notices.poll() == 2  # the later ones only
            await held.commit()
        assert stored.exists()
        assert await notices.poll() == 1
        assert not stored.exists()
        status, _, body = await sg.get(path)
        assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 2
    finally:
        await engine.dispose()


async def test_a_purge_notice_this_version_cannot_read_holds_no_other_back(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path
) -> None:
    """A notice whose key this version cannot parse (a newer version's kind of file, written
    while replicas are upgraded one by one) raised out of every poll: the purges after it were
    never applied, and their files served for good."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(purge_poll_s=3600))
    state = sg.runner.app[STATE]
    notices = PurgeNotices(state.repo, state.service.cache)
    await notices.start()
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.settled()
    engine = create_async_engine(database_url)
    try:
        async with engine.begin() as db:
            await db.execute(text(
                "INSERT INTO purges (key_hash, scope, key, purged_at) "
                "VALUES ('0', '', :k, CURRENT_TIMESTAMP)"), {"k": f"{MISSING}/symbols"})
    finally:
        await engine.dispose()
    purged = await cli(config_file(sg, tmp_path), "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0 and not stored.exists(), purged.stderr
    assert await notices.poll() == 2
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 2


async def test_negative_ls_and_clear_make_a_miss_retryable(
    start_symgate: SymgateFactory, faults: FaultUpstream, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("notfound")],
                             negative=NegativeConfig(not_found_initial_ttl_s=600, memo_s=0.2))
    path = f"/buildid/{MISSING}/debuginfo"
    assert (await sg.get(path))[0] == 404
    cfg = config_file(sg, tmp_path)
    rows = json.loads((await cli(cfg, "negative", "ls", "--json")).stdout)
    assert [(r["key"], r["live"]) for r in rows] == [(f"{MISSING}/debuginfo", True)]
    text = (await cli(cfg, "negative", "ls", MISSING)).stdout
    assert faults.url_for("notfound") in text and "yes" in text
    assert (await sg.get(path))[0] == 404 and faults.count("notfound") == 1  # remembered
    cleared = await cli(cfg, "negative", "clear", MISSING)
    assert cleared.returncode == 0 and "cleared 1" in cleared.stdout
    await asyncio.sleep(0.3)  # the server's in-memory copy lasts memo_s
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 2  # asked again


async def test_purge_forgets_a_failed_build_of_a_local_tree(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A debug tree that held a damaged file under a build ID was believed malformed for
    symbolize.malformed_retry_s (a day), fixed or not, and `cache purge ID` could not say
    otherwise: it dropped only the tables of cached artifacts (a hostile campaign's find).
    (A file of another build ID is passed over, not built: tests/test_localdir_hostile.py.)"""
    bid = elfs.prog.build_id
    tree = tmp_path / "debug" / ".build-id" / bid[:2]
    tree.mkdir(parents=True)
    wrong = tree / (bid[2:] + ".debug")
    shutil.copyfile(elfs.prog.debug, wrong)  # its build ID, and a .debug_info that inflates
    replace_section_compressed(wrong, ".debug_info", b"not a zlib stream", 1 << 20)  # to none
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:20])]).SerializeToString()
    for _ in range(2):  # the second time, fixed already, but believed
        status, headers, _ = await post(sg, body)
        assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "malformed=1", \
            headers
        wrong.unlink()
        wrong.symlink_to(elfs.prog.debug)
    cfg = config_file(sg, tmp_path)
    other = await cli(cfg, "cache", "purge", elfs.other.build_id)
    assert other.returncode == 0 and "forgot" not in other.stdout  # another build ID's
    purged = await cli(cfg, "cache", "purge", bid)
    assert purged.returncode == 0, purged.stderr
    assert "forgot 1 failed symbol-table builds" in purged.stdout, purged.stdout
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers


async def test_purge_drops_the_table_built_from_a_local_trees_file(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A debug tree's file is read where it lies, never cached: `cache purge ID` found no
    artifact of it, so the table built from it stayed, believed for good. A tree that held
    a debug file without DWARF (symbols only) and now holds the whole one kept serving
    names without lines however often it was purged."""
    import subprocess

    from proxy.web.state import STATE

    bid = elfs.prog.build_id
    tree = tmp_path / "debug" / ".build-id" / bid[:2]
    tree.mkdir(parents=True)
    local = tree / (bid[2:] + ".debug")
    subprocess.run(["objcopy", "--strip-debug", str(elfs.prog.debug), str(local)], check=True)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:20])]).SerializeToString()
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    repo = sg.runner.app[STATE].repo
    built = await repo.get_symbol_table("", bid)
    assert built is not None and not built.has_lines
    local.unlink()
    shutil.copyfile(elfs.prog.debug, local)  # the whole debug file, lines and all
    purged = await cli(config_file(sg, tmp_path), "cache", "purge", bid)
    assert purged.returncode == 0, purged.stderr
    assert await repo.get_symbol_table("", bid) is None
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    again = await repo.get_symbol_table("", bid)
    assert again is not None and again.has_lines


async def test_a_section_cut_during_a_purge_by_another_process_keeps_its_file_and_row(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Two serving processes on one data dir. `cache purge` deletes the rows, then the files,
    under the upload lock, which every commit holds from its rename to its row: but a section's
    cut did not take it. B, which did not have the section in memory, found its row gone and
    cut it again between the purge's rows and its files: the purge removed B's new file, and
    B's row named a file that was not there."""
    from proxy.tools.admin import Admin

    a = await start_symgate([faults.url_for("ok")])
    b = await start_symgate(config=a.config)
    bid = elfs.prog.build_id
    section = f"/buildid/{bid}/section/.debug_info"
    status, _, cut_by_a = await a.get(section)  # cut from its debuginfo, fetched for it
    assert status == 200 and cut_by_a
    assert (await b.get(f"/buildid/{bid}/debuginfo"))[0] == 200  # a hit, in B's memory
    cache_b = b.runner.app[STATE].service.cache
    cut: asyncio.Task[tuple[int, dict[str, str], bytes]] | None = None

    admin = Admin(a.config)
    purge_rows = admin.repo.purge_artifacts

    async def rows_then_cut(*args: object) -> None:
        nonlocal cut
        await purge_rows(*args)  # type: ignore[arg-type]
        # Between the rows and the files: B asks for the section, whose row is gone.
        cut = asyncio.create_task(b.get(section))

        async def committed_or_waiting() -> bool:
            return cut.done() or cache_b._upload_turn.locked()

        await eventually(committed_or_waiting)

    admin.repo.purge_artifacts = rows_then_cut  # type: ignore[method-assign]
    try:
        await admin.purge(bid)
    finally:
        await admin.close()
    assert cut is not None
    status, _, body = await cut
    assert status == 200 and body == cut_by_a
    await b.settled()
    store = cache_b.store
    for rec in await b.runner.app[STATE].repo.artifacts_of(None):
        assert store.artifact_path(rec.scope, ArtifactKey.from_id(rec.key)).exists(), \
            f"a row of {rec.key} without its file"
