"""A symbol table is built in the background as soon as its debug file is cached, serves
every later profile without being built again (but once, when the executable comes after
it), and is deleted, file and row, when that debug file leaves the cache."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
from pathlib import Path

from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from symbolize.elf import function_symbols
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.profiles import code_addresses, frames_of, llvm_symbolize, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config, table_lock_file


async def test_symbol_tables_are_built_when_cached_and_evicted_with_their_artifact(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")

    async def built() -> bool:
        return await sg.metric("symgate_symtab_builds_total", result="ok") == 1

    await eventually(built)  # pre-extracted in the background, before any profile asked
    table = sg.config.server.data_dir / "symtabs" / elfs.prog.build_id[:2] / (
        elfs.prog.build_id + ".symc")
    assert table.exists()
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    _status, headers, _ = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    # Built once more, in the background, with the executable the profile's program headers
    # were fetched from (the debugger fetched the debug file alone): as a fresh server
    # builds it. Then not again.
    await sg.built()
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 2
    _status, headers, _ = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    await sg.built()
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 2  # not rebuilt
    assert await sg.metric("symgate_symtab_cache_total", result="hit") >= 1
    state = sg.runner.app[STATE]
    key = ArtifactKey.parse(elfs.prog.build_id, "debuginfo")
    assert await state.service.cache.remove("", key)
    assert not table.exists()
    assert await state.repo.get_symbol_table("", elfs.prog.build_id) is None



async def test_with_symbolization_off_no_table_is_built_and_no_worker_started(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """/symbolize passes profiles through untouched then: a table built ahead would never be
    read, and libc's costs a second of CPU beside the fetches."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(enabled=False))
    state = sg.runner.app[STATE]
    # Looked at as each file is committed, right after the resolver heard of it (the
    # callbacks run in order): a table set off then would be under way.
    building_at_commit: list[bool] = []
    state.service.committed.append(
        lambda _scope, _key, _req: building_at_commit.append(state.symbols.busy))
    for kind in ("debuginfo", "executable"):
        status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/{kind}")
        assert status == 200
    await eventually(lambda: len(building_at_commit) == 2)
    assert building_at_commit == [False, False]
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 0
    assert not state.symbols.workers.pool.pids()
    assert not (sg.config.server.data_dir / "symtabs").exists() or not any(
        (sg.config.server.data_dir / "symtabs").rglob("*.symc"))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Symbolize"] == "disabled"
    assert body == profile.SerializeToString()



async def test_start_up_removes_half_written_tables_of_dead_workers_only(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = tmp_path / "data" / "symtabs" / "ab"
    folder.mkdir(parents=True)
    left = folder / f"{'ab' * 20}.{dead.pid}.tmp"  # a worker SIGKILLed with its server
    building = folder / f"{'ab' * 19}cd.{os.getpid()}.tmp"  # another server's, being written
    for temp in (left, building):
        temp.write_bytes(b"half a table")
    await start_symgate(data_dir=tmp_path / "data")
    assert not left.exists()
    assert building.exists()


async def test_a_debug_files_table_is_built_again_when_its_stripped_executable_comes(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """A debugger fetched the debug file alone: its table names exported functions without
    the executable's .dynsym. Once the executable is cached, the table is built again with it,
    and names them as llvm-symbolizer on the stripped library does."""
    lib = elfs.aliased
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    await sg.get(f"/buildid/{lib.build_id}/debuginfo")

    async def builds(n: int) -> bool:
        return await sg.metric("symgate_symtab_builds_total", result="ok") == n

    await eventually(lambda: builds(1))
    await sg.get(f"/buildid/{lib.build_id}/executable")
    await eventually(lambda: builds(2))
    mix_a = next(s.value for s in function_symbols(lib.debug) if s.name == "mix_a")
    profile = make_profile([(place(lib, BASES["libmix.so"]), [mix_a + 4])])
    _status, headers, body = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    out = Profile.FromString(body)
    assert [f.function for f in frames_of(out, out.location[0])] == [
        f.function for f in llvm_symbolize(lib.executable, [mix_a + 4])[mix_a + 4]]
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 2


async def test_a_source_gone_before_its_build_is_not_found_and_not_believed(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A debug file found, then gone before a worker opened it (a cached one evicted between
    its lookup and its lease; here a local one removed while its build waited for the table's
    lock, held by this test as another process's build would hold it): that was an `internal`
    failure with a traceback."""
    copy = tmp_path / "prog.debug"
    copy.write_bytes(elfs.prog.debug.read_bytes())
    d = tmp_path / "debug" / ".build-id" / elfs.prog.build_id[:2]
    d.mkdir(parents=True)
    (d / (elfs.prog.build_id[2:] + ".debug")).symlink_to(copy)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    symbols = sg.runner.app[STATE].symbols
    lock = table_lock_file(sg, elfs.prog.build_id)
    lock.parent.mkdir(parents=True, exist_ok=True)
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:20])]).SerializeToString()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        pending = asyncio.ensure_future(post(sg, body))

        async def waiting() -> bool:  # its source found, its build waiting for the lock
            return symbols.builds_waiting == 1

        await eventually(waiting)
        copy.unlink()
    finally:
        os.close(fd)  # the lock goes with it
    status, headers, _ = await pending
    assert status == 200
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1", headers
    assert await sg.metric("symgate_symtab_builds_total", result="internal") == 0
    copy.write_bytes(elfs.prog.debug.read_bytes())  # back: built at once, nothing believed
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
