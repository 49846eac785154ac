"""A full disk (a real 8 MiB tmpfs holding the data dir and the SQLite file): a miss is
answered 507 with Retry-After and leaves nothing half-written, an unknown ID is still a 404,
/healthz and the status page say what is degraded, eviction makes room where it can, and
everything works again once space is back."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import hashlib
import os
import resource
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from proxy.errors import OutOfResources
from proxy.keys import ArtifactKey
from proxy.sources.base import Hop
from proxy.web.state import STATE
from tests.elfs import Elf, ElfSet, build_id_tree
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory, eventually, fast_upstream, make_config
from tests.processes import start_serve, stop_serve
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config


def _tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "mnt", "size=8m")


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """Room for bytes, but few files: what many small files do to a real disk."""
    yield from _tmpfs(tmp_path / "mnt", "size=8m,nr_inodes=256")


def _fill(path: Path) -> None:
    """Write until the filesystem refuses: ENOSPC."""
    chunk = b"\0" * 65536
    with path.open("ab") as f:
        for _ in range(100_000):  # far more than 8 MiB: bounded, never reached
            try:
                f.write(chunk)
                f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        with contextlib.suppress(OSError):  # the last partial buffer, if any
            f.close()
    for size in (4096, 512, 1):  # the last blocks too
        with contextlib.suppress(OSError), path.open("ab", buffering=0) as f:
            for _ in range(1000):
                f.write(b"\0" * size)


async def test_a_full_disk_is_507_degraded_and_recovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    database_url: str,
) -> None:
    if database_url.startswith("sqlite"):  # the database on the full disk as well
        database_url = f"sqlite+aiosqlite:///{small_disk / 'symgate.sqlite'}"
    cfg = make_config(small_disk / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=cfg)
    filler = small_disk / "filler"
    _fill(filler)
    other = f"/buildid/{elfs.other.build_id}/debuginfo"
    status, headers, body = await sg.get(other)
    assert status == 507, body
    assert headers["Retry-After"] == str(cfg.server.retry_after_s)
    # The server's passing trouble, which an operator's alert on bugs must not count.
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="unavailable") == 1
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="internal") == 0
    status, _, _ = await sg.get("/buildid/" + "ee" * 20 + "/debuginfo")
    assert status == 404  # the upstream's answer, though it cannot be remembered in SQL
    status, _, text = await sg.get("/healthz")
    assert status == 200 and text.startswith(b"degraded") and b"disk" in text, text
    assert b"degraded" in (await sg.get("/"))[2]
    tmp = cfg.cache_dir / "tmp"
    assert not [p for p in tmp.rglob("*") if p.is_file() and p.suffix != ".lock"]
    stored = cfg.cache_dir / "objects"
    assert not [p for p in stored.rglob("*") if p.is_file()]

    filler.unlink()  # space is back
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    for kind, path in (("debuginfo", elfs.prog.debug), ("executable", elfs.prog.executable)):
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/{kind}")
        assert status == 200 and body == path.read_bytes()

    # Both files evictable before the disk fills again: the executable is committed after
    # its client's last byte (not before the response ends), a symbol-table build holds a
    # lease on what it reads, and the executable's commit starts table work of its own.
    await sg.built()
    assert await sg.metric("symgate_symtab_builds_total", result="ok") >= 1
    _fill(filler)  # full again, but now something can be evicted
    status, _, body = await sg.get(other)
    assert status == 200 and body == elfs.other.debug.read_bytes()
    assert not (stored / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name
                ).exists()  # the least recently used made room
    kept = stored / ArtifactKey.parse(elfs.other.build_id, "debuginfo").storage_name

    async def committed() -> bool:  # after the client's last byte, not before it
        return kept.exists()

    await eventually(committed)
    assert hashlib.sha256(kept.read_bytes()).digest() == hashlib.sha256(
        elfs.other.debug.read_bytes()).digest()
    filler.unlink()
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    assert os.path.exists(kept)

@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_full_disk_under_a_sqlite_file_of_its_own_is_degraded_until_space_is_back(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    tmp_path: Path,
) -> None:
    """database.url puts the SQLite file on a filesystem of its own, and that one fills: every
    write fails ("database or disk is full": its log can neither grow nor be checkpointed
    into the file), while the cache's disk has room. Hits and misses are served as usual, and
    /healthz says the database's disk is full, not "ok" by the cache's room, until it is not."""
    cfg = make_config(tmp_path / "data", f"sqlite+aiosqlite:///{small_disk / 'symgate.sqlite'}",
                      [faults.url_for("ok")])
    cfg = replace(cfg, server=replace(cfg.server, access_flush_s=0.1))
    sg = await start_symgate(config=cfg)
    hit, miss = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    assert (await sg.get(hit))[0] == 200
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    filler = small_disk / "filler"
    _fill(filler)
    assert (await sg.get("/buildid/" + "ee" * 20 + "/debuginfo"))[0] == 404  # not written
    status, _, body = await sg.get(miss)
    assert status == 200 and body == elfs.other.debug.read_bytes()
    for _ in range(3):  # every probe, not only the first after a failed write
        status, _, text = await sg.get("/healthz")
        assert status == 200 and text.startswith(b"degraded\n") and b"disk" in text, text
    assert (await sg.get(hit))[0] == 200

    filler.unlink()  # space is back: the rows kept meanwhile are written

    async def healthy() -> bool:
        return (await sg.get("/healthz"))[2] == b"ok\n"

    await eventually(healthy)



async def test_a_full_disk_is_507_for_a_file_of_many_chunks_too(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    database_url: str,
) -> None:
    """Chunks after the first reach clients before the disk; the first is written before any
    client is sent a byte, so a disk that cannot take it still gets a clean 507, not a 200
    cut off after its status line."""
    cfg = make_config(small_disk / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=cfg)
    _fill(small_disk / "filler")
    status, headers, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 507, body[:200]
    assert headers["Retry-After"] == str(cfg.server.retry_after_s)
    (small_disk / "filler").unlink()
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()


def _use_up_inodes(folder: Path) -> list[Path]:
    """Make empty files until the filesystem refuses: ENOSPC with bytes to spare."""
    folder.mkdir()
    made = []
    for i in range(10_000):  # far more than the tmpfs has: bounded, never reached
        try:
            (folder / str(i)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
            return made
        made.append(folder / str(i))
    raise AssertionError("the filesystem never ran out of inodes")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_inode_for_a_temp_file_is_507_degraded_and_recovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, few_inodes: Path,
    database_url: str,
) -> None:
    cfg = make_config(few_inodes / "data", database_url, [faults.url_for("ok")])
    sg = await start_symgate(config=cfg)
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200

    async def built() -> bool:  # its files made before the inodes run out
        return await sg.metric("symgate_symtab_builds_total", result="ok") >= 1

    await eventually(built)
    await sg.settled()  # the fetch's own files tidied up: they would free inodes later
    fillers = _use_up_inodes(few_inodes / "filler")
    path = f"/buildid/{elfs.other.build_id}/debuginfo"
    section = f"/buildid/{elfs.prog.build_id}/section/.debug_info"  # cut from a cached file
    for wanted in (path, section):
        status, headers, body = await sg.get(wanted)
        assert status == 507, body  # the temp file cannot be made
        assert headers["Retry-After"] == str(cfg.server.retry_after_s)
    status, _, text = await sg.get("/healthz")
    assert status == 200 and text.startswith(b"degraded") and b"disk" in text, text

    for filler in fillers:
        filler.unlink()
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.other.debug.read_bytes()
    assert (await sg.get(section))[0] == 200


@contextlib.contextmanager
def _no_descriptor_left(free: int = 0) -> Iterator[None]:
    """Every descriptor this process may open taken (by /dev/null) but `free` of them: the
    open after those is EMFILE. Sockets already open (a client's keep-alive connection) go on
    working."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    # Room past the highest for `free` and a few more: with none to fill past it (a process
    # with few holes), `free` descriptors could not be given back.
    limit = highest + 8 + free
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    fillers: list[int] = []
    try:
        for _ in range(limit):  # bounded: the holes below the limit, then EMFILE
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        for _ in range(free):
            os.close(fillers.pop())
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_descriptor_for_a_temp_file_is_503_with_retry_after(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    # The client's connection is kept alive from this request on: the next needs no socket.
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    # Its commit closes descriptors; done during the fill, it would leave holes in it.
    await sg.settled()
    path = f"/buildid/{elfs.other.build_id}/debuginfo"
    with _no_descriptor_left():
        status, headers, body = await sg.get(path)
    assert status == 503, body
    assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    status, _, body = await sg.get(path)
    assert status == 200 and body == elfs.other.debug.read_bytes()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_descriptor_to_open_a_hit_or_a_sections_file_is_503_with_retry_after(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A hit too big to be kept in memory is sent from its file, and a section is cut from
    its cached file: with no descriptor to open either, a passing condition of the server (a
    503 with Retry-After, counted `unavailable`), not an internal error."""
    sg = await start_symgate([faults.url_for("ok")])
    big = f"/buildid/{elfs.big.build_id}/executable"
    section = f"/buildid/{elfs.big.build_id}/section/.text"
    assert (await sg.get(big))[0] == 200
    # Its symbol table built too: a build still starting its workers when every descriptor
    # is taken fails, lets its own go, and the hit then finds one.
    await sg.built()
    with _no_descriptor_left():
        answers = [await sg.get(big), await sg.get(section)]
    for status, headers, body in answers:
        assert status == 503, body
        assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    status, _, body = await sg.get(big)
    assert status == 200 and body == elfs.big.executable.read_bytes()
    assert (await sg.get(section))[0] == 200
    counted = {labels: n for (name, labels), n in (await sg.metrics()).items()
               if name == "symgate_requests_total" and n}
    outcomes = [dict(labels)["outcome"] for labels in counted]
    assert "internal" not in outcomes and "unavailable" in outcomes, counted


@pytest.mark.parametrize("local", [False, True], ids=["upstream", "debug-dirs"])
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_descriptor_for_a_profile_is_503_never_a_500_or_a_bare_mapping(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    local: bool,
) -> None:
    """A cold profile with every descriptor taken but a few, as many as each step of its
    work may need: its memory file (proxy.symbols.shared_bodies) could not be made, a 500
    "internal error"; a fetch that found none for its temp file left the mapping bare
    (`unavailable`), and a build none for its lock (`internal`), in a 200 that a backend
    keeps for good. Each is a 503 with Retry-After, as for a /buildid hit, and the profile
    sent again once descriptors are back is symbolized.

    With a few more to spare, a fetch's commit found none (its directory's fsync, SQLite's
    journal): the file was served and not kept, and the profile refused with a 507 that
    blamed cache.max_bytes. Two servers, each of the cold files once: descriptors spared
    from none to past what any step takes."""
    tree = tmp_path / "debug"
    for elf in elfs.all:
        build_id_tree(tree, elf.build_id, elf.debug, elf.executable)
    cold_elfs = [elf for elf in elfs.all if elf is not elfs.prog]
    counted: set[str] = set()
    # Past the first server's counts only through the upstream: the commit of a fetch is
    # where they come into play (the debug directories' files are read where they are).
    for first in (0, len(cold_elfs)) if not local else (0,):
        sg = await start_symgate([debuginfod.url], data_dir=tmp_path / f"data{first}",
                                 symbolize=symbolize_config(debug_dirs=(tree,) if local else ()))
        warm = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:10])])
        # The client's connection kept alive from here on, the workers started, a table open.
        assert (await post(sg, warm.SerializeToString()))[0] == 200
        await sg.built()
        for free, elf in enumerate(cold_elfs, start=first):
            cold = make_profile([(place(elf, BASES["prog"]), code_addresses(elf)[:10])]
                                ).SerializeToString()
            with _no_descriptor_left(free):
                status, headers, body = await post(sg, cold)
            await sg.built()  # what it set going ends with descriptors to spare
            if status == 200:
                assert headers["X-Symgate-Mappings-Symbolized"] == "1", (free, headers)
            else:
                assert status == 503 and "Retry-After" in headers, (free, status, body)
            status, headers, _ = await post(sg, cold)
            assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
        counted |= {dict(labels)["outcome"] for (name, labels), n in
                    (await sg.metrics()).items()
                    if name == "symgate_symbolize_profiles_total" and n}
    assert "internal" not in counted and "unavailable" in counted, counted


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_descriptor_for_a_socket_to_the_upstream_is_503_and_the_upstream_not_blamed(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """A socket that could not be made said nothing of the upstream, yet it counted as the
    upstream's failure: its breaker (opened here by one) then turned every miss away with a
    502 for its whole cool-down. Asked of the running server's own upstream: through
    /buildid, a miss's temp file would take the last descriptor before the socket does. A
    real debuginfod, in a process of its own: an upstream in this one needs descriptors too."""
    key = ArtifactKey.parse(elfs.other.build_id, "debuginfo")
    for attempt in range(10):
        # A server of its own each time: the connection a successful attempt made stays in
        # its pool, and the next attempt would need no socket.
        sg = await start_symgate([fast_upstream(debuginfod.url, breaker_failures=1)],
                                 data_dir=tmp_path / f"data{attempt}")
        upstream, = sg.runner.app[STATE].tenancy.shared_sources
        await sg.settled()
        gc.collect()
        for _turn in range(20):  # a transport closed lets its socket go a turn or two later
            await asyncio.sleep(0)
        with _no_descriptor_left():
            try:
                body = await upstream.open(key, Hop())
            except OutOfResources:
                break
        # A descriptor something of the process closed while all were taken (a file of the
        # server's start, an object finalized) let the socket be made: again.
        assert body is not None
        body.close()
    else:
        pytest.fail("a descriptor came free during every attempt")
    assert await sg.metric("symgate_upstream_breaker_state", upstream=upstream.name) == 0
    status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 200 and body == elfs.other.debug.read_bytes()


def _debug_tree(root: Path, *elfs: Elf) -> Path:
    """A local debug directory, off the full disk, as a distribution's debug packages make."""
    for elf in elfs:
        build_id_tree(root, elf.build_id, elf.debug, elf.executable)
    return root


def _profile_of(elf: Elf, base: int) -> bytes:
    placed = place(elf, base)
    return make_profile([(placed, [placed.text.vaddr + 16])]).SerializeToString()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_a_symbol_table_makes_room_or_refuses_the_profile_with_507_and_recovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Debug files from a local tree, off the full disk; their tables go to the data dir on
    it. A build evicts what it can, as a fetch does. With nothing to evict, a 200 with the
    mapping bare would be kept by a profiling backend for good: the whole profile is refused
    with Retry-After instead, and nothing about the build ID is remembered, so the next
    profile after space is back gets its names."""
    tree = _debug_tree(tmp_path / "debug", elfs.prog, elfs.nopie)
    sg = await start_symgate([faults.url_for("ok")], data_dir=small_disk / "data",
                             symbolize=symbolize_config(debug_dirs=(tree,)))
    other = f"/buildid/{elfs.other.build_id}/debuginfo"
    assert (await sg.get(other))[0] == 200
    await sg.built()  # its prebuild lets go of it
    filler = small_disk / "filler"
    _fill(filler)
    status, _, text = await post(sg, _profile_of(elfs.prog, BASES["prog"]))
    assert status == 200, text
    assert any(parse(text).function)
    assert await sg.metric("symgate_cache_evictions_total") == 1

    _fill(filler)  # what the eviction freed, and nothing left to evict
    nopie = _profile_of(elfs.nopie, BASES["nopie"])
    status, headers, text = await post(sg, nopie)
    assert status == 507, text
    assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="unavailable") == 1
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="internal") == 0
    assert b"degraded" in (await sg.get("/healthz"))[2]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text

    filler.unlink()
    status, _, text = await post(sg, nopie)
    assert status == 200, text
    assert any(parse(text).function), "named once there is room for the table"


@pytest.mark.parametrize("local_executable", [True, False])
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_no_room_for_a_debug_file_is_507_not_a_table_from_the_executable(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    tmp_path: Path, local_executable: bool,
) -> None:
    """A debug file bigger than the whole disk: its clients get it from memory, but it is not
    stored (the flight's store error). For a profile that is the server's passing trouble: it
    is refused with Retry-After, as for any file it cannot store, not answered with the bare
    names (no lines) of the executable (local, or fetched beside it), which a backend would
    keep for good; and no table from the executable is recorded in the debug file's place."""
    tree = tmp_path / "debug" / ".build-id" / elfs.big.build_id[:2]
    tree.mkdir(parents=True)
    if local_executable:
        (tree / elfs.big.build_id[2:]).symlink_to(elfs.big.executable)
    sg = await start_symgate([faults.url_for("ok")], data_dir=small_disk / "data",
                             symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    assert elfs.big.debug.stat().st_size > 16 * 1024 * 1024  # more than the whole disk
    status, headers, text = await post(sg, _profile_of(elfs.big, BASES["prog"]))
    assert status == 507, text
    assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_table_whose_row_finds_no_room_in_sqlite_makes_room_or_refuses_the_profile(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """SQLite where it is by default, in the data dir on the full disk: the table a build
    made room for takes the room its row needed. The row makes room as the build does; with
    nothing left to evict the profile is refused 507, never answered 200 with its mapping
    bare (an internal error) that a backend would keep for good; once space is back, named."""
    tree = _debug_tree(tmp_path / "debug", elfs.prog, elfs.nopie)
    cfg = make_config(small_disk / "data", f"sqlite+aiosqlite:///{small_disk / 'symgate.sqlite'}",
                      [faults.url_for("ok")], symbolize=symbolize_config(debug_dirs=(tree,)))
    sg = await start_symgate(config=cfg)
    for kind in ("debuginfo", "executable"):  # to evict: one for the table, one for its row
        assert (await sg.get(f"/buildid/{elfs.other.build_id}/{kind}"))[0] == 200
    await sg.built()  # their prebuilds let go of them
    filler = small_disk / "filler"
    _fill(filler)
    status, _, text = await post(sg, _profile_of(elfs.prog, BASES["prog"]))
    assert status == 200, text
    assert any(parse(text).function), "named: the table was built and recorded"

    _fill(filler)  # nothing left to evict
    nopie = _profile_of(elfs.nopie, BASES["nopie"])
    status, headers, text = await post(sg, nopie)
    assert status == 507, text
    assert headers["Retry-After"] == str(cfg.server.retry_after_s)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text

    filler.unlink()
    status, _, text = await post(sg, nopie)
    assert status == 200, text
    assert any(parse(text).function), "named once there is room for the table and its row"


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_no_room_for_the_executable_a_layout_needs_is_507_not_a_guess(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A debug file from a local tree (no executable beside it), its table built for a
    profile of ELF-relative addresses. A profile of runtime addresses needs the executable's
    program headers, fetched from the upstream onto a disk that is full: a layout guessed in
    their stead is exact for GNU ld's layout only, and a 200 with names from it is kept for
    good. The profile is refused with Retry-After; once there is room, it is named."""
    tree = tmp_path / "debug" / ".build-id" / elfs.prog.build_id[:2]
    tree.mkdir(parents=True)
    (tree / (elfs.prog.build_id[2:] + ".debug")).symlink_to(elfs.prog.debug)
    sg = await start_symgate([faults.url_for("ok")], data_dir=small_disk / "data",
                             symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    placed = place(elfs.prog, BASES["prog"])
    relative = make_profile([(placed, [placed.text.vaddr + 16])], runtime=False)
    status, _, text = await post(sg, relative.SerializeToString())
    assert status == 200 and any(parse(text).function), text
    await sg.built()
    filler = small_disk / "filler"
    _fill(filler)
    runtime = _profile_of(elfs.prog, BASES["prog"])
    status, headers, text = await post(sg, runtime)
    assert status == 507, text
    assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    filler.unlink()
    status, _, text = await post(sg, runtime)
    assert status == 200 and any(parse(text).function), text
    assert faults.count("ok") >= 2  # the executable, asked for again once there was room


async def test_every_serving_process_says_the_disk_is_full(
    tmp_path: Path, small_disk: Path, faults: FaultUpstream, elfs: ElfSet, database_url: str
) -> None:
    """Under `serve --workers 2`, a probe reaches either process: the one whose download met
    the full disk and the one that has written nothing since. Both say so (the second said
    "ok", and a probe's answer flapped with the connection)."""
    base, proc = await start_serve(tmp_path, small_disk / "data", database_url,
                                   faults.url_for("ok"), workers=2)
    try:
        _fill(small_disk / "filler")
        connector = aiohttp.TCPConnector(force_close=True)  # spread over both processes
        async with aiohttp.ClientSession(connector=connector) as s:
            async with s.get(f"{base}/buildid/{elfs.other.build_id}/debuginfo") as r:
                assert r.status == 507
            answers = set()
            for _ in range(20):
                async with s.get(base + "/healthz") as r:
                    answers.add((r.status, (await r.text()).split("\n")[0]))
            assert answers == {(200, "degraded")}
            (small_disk / "filler").unlink()
            for _ in range(20):
                async with s.get(base + "/healthz") as r:
                    answers.add((r.status, await r.text()))
            assert answers == {(200, "degraded"), (200, "ok\n")}
    finally:
        await stop_serve([proc])


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """`folder` read-only while held: what a filesystem remounted read-only after an I/O
    error (ext4's errors=remount-ro) does to a running server, which keeps its descriptors."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        # Lazily: a build worker may hold a descriptor there, which a plain umount waits out.
        subprocess.run(["umount", "-l", str(folder)], check=True)


async def test_a_read_only_data_dir_is_507_degraded_and_recovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
) -> None:
    """Every miss was a 500 counted as `internal` (a bug, with a traceback logged each) and
    /healthz said `ok`, so the probe that should have told the operator saw nothing: the
    cache cannot be written, as on a full disk. Hits are served meanwhile, and misses come
    back once it can be written again."""
    sg = await start_symgate([faults.url_for("ok")], data_dir=small_disk / "data")
    prog = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(prog))[0] == 200
    await sg.built()
    other = f"/buildid/{elfs.other.build_id}/debuginfo"
    with _read_only(sg.config.server.data_dir):
        status, headers, body = await sg.get(other)
        assert status == 507 and "Retry-After" in headers, (status, body)
        assert await sg.metric("symgate_requests_total", endpoint="buildid",
                               kind="debuginfo", outcome="internal") == 0
        status, _, text = await sg.get("/healthz")
        assert status == 200 and text.startswith(b"degraded") and b"read-only" in text, text
        status, _, body = await sg.get(prog)
        assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    status, _, body = await sg.get(other)
    assert status == 200 and body == elfs.other.debug.read_bytes()


async def test_a_profile_whose_table_cannot_be_written_is_507_not_internal(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, small_disk: Path,
) -> None:
    """Its files cached, its table not built yet, the data dir read-only: the profile was
    answered 200 with the mapping `internal` (a traceback logged), which a backend keeps
    unsymbolized for good. Refused with 507 and Retry-After, as on a full disk, it is
    symbolized once the disk can be written again."""
    sg = await start_symgate([faults.url_for("ok")], data_dir=small_disk / "data",
                             symbolize=symbolize_config(enabled=False))
    for kind in ("debuginfo", "executable"):
        assert (await sg.get(f"/buildid/{elfs.prog.build_id}/{kind}"))[0] == 200
    await sg.built()
    await sg.stop()
    sg = await start_symgate(config=replace(sg.config, symbolize=symbolize_config()))
    raw = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])]
                       ).SerializeToString()
    with _read_only(sg.config.server.data_dir):
        status, headers, body = await post(sg, raw)
        assert status == 507 and "Retry-After" in headers, (status, headers, body)
    status, headers, _ = await post(sg, raw)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
