"""Serving processes on one data dir build each symbol table once: a process that needs a
table another one is building waits for that build and reads its row, and builds the table
itself if the builder dies holding the lock."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.keys import ArtifactKey
from proxy.store.disk import DiskStore
from proxy.web.state import STATE
from symbolize import symtab
from symbolize.elf import ElfLayout
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    SymgateFactory,
    cli,
    config_file,
    eventually,
    make_config,
)
from tests.processes import stopped
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config, table_lock_file

# A process that holds a table's build lock until it is killed, as a server building it does.
_HOLD = ("import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\n"
         "time.sleep(600)\n")


def _profile(elfs: ElfSet) -> bytes:
    return make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()



async def test_a_table_another_process_is_building_is_waited_for_not_built_again(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    # Two servers on one data dir and database, as `serve --workers 2` runs them.
    builder = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    waiter = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    pool = builder.runner.app[STATE].symbols.workers.pool
    waiting = waiter.runner.app[STATE].symbols
    await pool.start()
    with stopped(pool.pids()):
        # The builder takes the lock and hands the build to a worker that cannot run it.
        assert (await builder.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
        await eventually(lambda: pool.in_flight > 0)
        pending = asyncio.ensure_future(post(waiter, _profile(elfs)))
        await eventually(lambda: waiting.builds_waiting == 1)
        assert not pending.done()
    status, headers, _ = await pending
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await builder.metric("symgate_symtab_builds_total", result="ok") == 1
    # The waiter built nothing for the profile. But the builder had the debug file alone; the
    # executable the profile fetched makes the table once more, with it, after the profile
    # (as a server that had both from the start builds it): that one build, no other.
    await waiter.built()
    assert await waiter.metric("symgate_symtab_builds_total", result="ok") == 1
    assert not table_lock_file(builder, elfs.prog.build_id).exists()


async def test_when_the_builder_is_killed_holding_the_lock_the_waiter_builds_the_table(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    symbols = sg.runner.app[STATE].symbols
    lock = table_lock_file(sg, elfs.prog.build_id)
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD, str(lock), stdout=asyncio.subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"held\n"
        pending = asyncio.ensure_future(post(sg, _profile(elfs)))
        await eventually(lambda: symbols.builds_waiting == 1)
        assert not pending.done()
    finally:
        holder.kill()
        await holder.wait()
    status, headers, _ = await pending
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 1
    assert not lock.exists()


def test_a_source_evicted_after_the_builds_first_read_is_built_all_the_same(
    elfs: ElfSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build reads its file many times over by path (headers, symbolic, libdw): a cached
    file that another process evicted after the first read made symbolic's open fail, and the
    table was recorded malformed, for malformed_retry_s (a day), the mapping bare meanwhile (a
    CI run's profile: `malformed=1`). The eviction is made at once after the first read."""
    source = tmp_path / "cache" / "prog.debug"
    source.parent.mkdir()
    shutil.copyfile(elfs.prog.debug, source)
    first_read = symtab.layout_of_file

    def then_evicted(path: Path) -> ElfLayout | None:
        layout = first_read(path)
        source.unlink()
        return layout

    monkeypatch.setattr(symtab, "layout_of_file", then_evicted)
    out = tmp_path / "tables" / "prog.symc"
    built = symtab.build_symbol_table(source, out, elfs.prog.build_id)
    assert built.has_lines and out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["prog.symc"]  # nothing left


async def test_a_source_another_process_evicts_before_the_build_reads_it_is_a_503(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    database_url: str,
) -> None:
    """A process's lease on the file a build reads is its own: another process on the data
    dir judging the whole cache's budget may evict that file before the build's worker opens
    it. The profile then got a 200 with the mapping `not_found` (a backend keeps it for good,
    though upstream has the file); it is refused with Retry-After, and the next one fetches
    the file again and is symbolized."""
    budget = elfs.prog.debug.stat().st_size + elfs.other.debug.stat().st_size - 1
    cfg = make_config(tmp_path / "data", database_url, [debuginfod.url],
                      symbolize=symbolize_config())
    cfg = replace(cfg, cache=replace(cfg.cache, max_bytes=budget))
    # Only the evicting process judges the whole budget, at once and often.
    builder = await start_symgate(
        config=replace(cfg, server=replace(cfg.server, access_flush_s=3600)))
    evicting = await start_symgate(
        config=replace(cfg, server=replace(cfg.server, access_flush_s=0.2)))
    pool = builder.runner.app[STATE].symbols.workers.pool
    await pool.start()
    source = DiskStore(tmp_path / "data" / "cache", tmp_path / "data" / "symtabs"
                       ).artifact_path("", ArtifactKey.from_id(f"{elfs.prog.build_id}/debuginfo"))
    with stopped(pool.pids()):
        # Cached and leased for its table's build, which waits for a worker that cannot run.
        assert (await builder.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
        await eventually(lambda: pool.in_flight > 0)
        pending = asyncio.ensure_future(post(builder, _profile(elfs)))
        # The other process's file puts the cache over budget: the least recently used goes.
        assert (await evicting.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[0] == 200
        await eventually(lambda: not source.exists())
    status, headers, text = await pending
    # Refused with Retry-After: 503 where the build's worker found the file gone, 507 where
    # the resolution did (gone as it was fetched again: not kept, for the build). Or, where
    # the resolution came after the eviction, fetched again and symbolized. Never a 200 with
    # the mapping bare.
    if status == 200:
        assert headers["X-Symgate-Mappings-Symbolized"] == "1", _said(headers)
    else:
        assert status in (503, 507) and "Retry-After" in headers, (status, headers, text)

    async def symbolized() -> bool:
        # The evicting process judges the budget every 0.2 s: the fetch again may be evicted
        # again before it is read, and that profile refused too.
        status, headers, _ = await post(builder, _profile(elfs))
        if status == 200:
            assert headers["X-Symgate-Mappings-Symbolized"] == "1", _said(headers)
            return True
        assert status in (503, 507), status
        return False

    await eventually(symbolized, timeout=30)


def _said(headers: Mapping[str, str]) -> dict[str, str]:
    """What symgate said of the profile's mappings, for an assertion's message."""
    return {k: v for k, v in headers.items() if k.startswith("X-Symgate")}


async def test_a_table_evicted_between_its_resolution_and_the_rewrite_is_built_again(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A profile's tables are resolved, then read by the rewrite: one evicted in between (with
    the file it was built from, under a tight budget another process judges, or purged) was
    taken for a damaged table, its mapping answered `malformed` in a 200 that a backend keeps
    for good, and, met twice within the hour, recorded malformed for a day. It is resolved
    (built) again and the profile symbolized whole. The await point: a second mapping whose
    fetch the upstream holds, while prog's table, resolved already, is purged."""
    caplog.set_level(logging.INFO, "proxy.artifacts.purges")
    sg = await start_symgate([faults.url_for("hold404"), debuginfod.url],
                             symbolize=symbolize_config())
    faults.release.set()
    status, headers, _ = await post(sg, _profile(elfs))
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", _said(headers)
    faults.release = asyncio.Event()
    both = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5]),
                         (place(elfs.other, 0x5633F00D0000), code_addresses(elfs.other)[:5])])
    asked = faults.count("hold404")
    pending = asyncio.ensure_future(post(sg, both.SerializeToString()))
    # prog's table is resolved (open already); other's fetch waits on the upstream.
    await eventually(lambda: faults.count("hold404") > asked)
    purged = await cli(config_file(sg, tmp_path), "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0, purged.stderr
    # The server applies the CLI's purge at its next poll: before the rebuild's fetch, as
    # here, or during it, which makes the build's worker find its file gone (a 503 to send
    # again, test_a_source_another_process_evicts_before_the_build_reads_it_is_a_503's case).
    await eventually(lambda: "purges (by an operator" in caplog.text)
    faults.release.set()
    status, headers, _ = await pending
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "2", _said(headers)
    assert await sg.metric("symgate_symtab_builds_total", result="malformed") == 0
