"""A symbol table is built in the background as soon as its debug file is cached, serves
every later profile without being built again (but once, when the executable comes after
it), and is deleted, file and row, when that debug file leaves the cache."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from proxy.config import UploadConfig
from proxy.keys import ArtifactKey
from proxy.store.disk import DiskStore
from proxy.web.state import STATE
from symbolize.elf import LoadSegment, function_symbols
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_functions
from tests.processes import descendants, descriptors_on, stopped
from tests.profiles import Placed, code_addresses, frames_of, llvm_symbolize, make_profile, place
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


async def test_start_up_removes_the_half_written_table_of_a_worker_dead_but_unreaped(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A builder that died with its worker (or its server) is reparented, to PID 1 most
    likely, and a container's PID 1 may reap it late or never: a zombie, whose pid answers
    kill(pid, 0), was taken for a writer still at work, and what it had written (libc's
    inflated debug file, hundreds of MB) stayed through every start."""
    dead = subprocess.Popen(["true"])  # not waited for: a zombie until the end
    try:
        for _ in range(10000):  # bounded: until it has exited
            if Path(f"/proc/{dead.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
            await asyncio.sleep(0.001)
        folder = tmp_path / "data" / "symtabs" / "ab"
        folder.mkdir(parents=True)
        left = folder / f"{'ab' * 20}.inf.{dead.pid}.tmp"
        left.write_bytes(b"half an inflated debug file")
        await start_symgate(data_dir=tmp_path / "data")
        assert not left.exists()
    finally:
        dead.wait()


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


async def test_a_table_built_while_its_upload_is_deleted_is_not_kept(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A DELETE (or a `cache purge`) that removes the file a table is being built from found
    no table to drop, and the build then recorded its table: after the 204, profiles went on
    being symbolized from the deleted file, for good (no artifact row was left by which a
    purge could find that table). The build's table is dropped once it finds its source gone."""
    if not LIBC_DEBUG.exists():
        pytest.fail(f"{LIBC_DEBUG} is missing: apt-get install libc6-dbg")
    admin = {"Authorization": "Bearer admin-token-of-sixteen-or-more"}
    sg = await start_symgate([], symbolize=symbolize_config(), upload=UploadConfig(
        admin_tokens=(admin["Authorization"].removeprefix("Bearer "),)))
    pool = sg.runner.app[STATE].symbols.workers.pool
    await pool.start()
    workers = set(pool.pids())
    status, _, _ = await sg.request("PUT", f"/buildid/{LIBC_ID}/debuginfo",
                                    data=LIBC_DEBUG.read_bytes(), headers=admin)
    assert status == 201  # its table's build starts as it is committed
    cached = sg.runner.app[STATE].service.cache.peek("", ArtifactKey.parse(LIBC_ID, "debuginfo"))
    assert cached is not None
    source = cached.path

    def reading() -> bool:
        builders = {p for w in workers for p in descendants(w)}
        return descriptors_on(builders, source) > 0

    while not await asyncio.to_thread(reading):  # the build under way
        assert sg.runner.app[STATE].symbols.busy, "built before it was seen reading"
    table = sg.config.server.data_dir / "symtabs" / LIBC_ID[:2] / f"{LIBC_ID}.symc"
    # Its worker frozen: the build ends, its table written, but not yet recorded.
    with stopped(list(workers)):
        await eventually(lambda: table.exists())
        status, _, _ = await sg.request("DELETE", f"/buildid/{LIBC_ID}/debuginfo",
                                        headers=admin)
        assert status == 204
    await sg.built()
    libc = Placed(LIBC_ID, str(LIBC), 0x7F00_0000_0000, 0x7F00_0019_0000, 0x28000,
                  LoadSegment(0x28000, 0x28000, 0x168000, 0x168000, True), 0x7F00_0000_0000)
    profile = make_profile([(libc, libc_functions(20))]).SerializeToString()
    status, headers, _ = await post(sg, profile)
    assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1", \
        headers
    assert await sg.runner.app[STATE].repo.get_symbol_table("", LIBC_ID) is None
    assert not list((sg.config.server.data_dir / "symtabs").rglob(f"{LIBC_ID}.symc"))


def test_a_lost_builds_leftovers_go_but_not_a_live_copy_from_the_bucket(tmp_path: Path) -> None:
    """A build whose worker was lost leaves its files, removed under the table's build lock
    whoever wrote them (the builder may not be torn down yet); a copy of the same table from
    the shared bucket is made outside that lock, by a process that is alive: removed too, its
    rename failed, and the table was built again for nothing."""
    store = DiskStore(tmp_path / "cache", tmp_path / "symtabs")
    bid = "ab" * 20
    folder = store.symtab_path("", bid).parent
    folder.mkdir(parents=True)
    pid = os.getpid()  # alive: the builder still being torn down, the copy under way
    built = [folder / f"{bid}.{pid}.tmp", folder / f"{bid}.inf.{pid}.tmp"]
    copying = folder / f"{bid}.bucket-0123abcd.{pid}.tmp"
    copied_by_the_dead = folder / f"{bid}.bucket-4567ef01.999999999.tmp"
    for f in (*built, copying, copied_by_the_dead):
        f.write_bytes(b"x")
    assert store.clear_table_temp("", bid) == 3
    assert sorted(folder.iterdir()) == [copying]
