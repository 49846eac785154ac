"""A local directory source (and [symbolize] debug_dirs) over a messy or hostile tree: special
files where debug files are expected, names no header can carry, trees deeper than Python's
recursion limit, files swapped under the index, links to files of another build ID. Each client
gets the right file or a precise status, and the server goes on serving."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import UpstreamConfig
from proxy.headers import printable
from proxy.metrics import ProxyMetrics
from proxy.sources.localdir import LocalDirectory
from tests.elfs import ElfSet, build_id_tree
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.processes import run_in_thread
from tests.symbolize_helpers import post, symbolize_config
from tests.test_disk_full import _no_descriptor_left
from tests.test_hostile_debug_files import _profile

FAKE_ID = "ab" + "cd" * 19


@contextmanager
def readers_caught(fifos: list[Path]) -> Iterator[list[Path]]:
    """The FIFOs that anyone opened for reading meanwhile. A thread keeps opening their write
    ends without blocking, which succeeds only while a reader has one open; it so also frees a
    reader that would otherwise wait for a writer forever (symgate's loop or its scan)."""
    caught: list[Path] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for fifo in fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: nobody reads it
                    continue
                caught.append(fifo)
                os.close(fd)  # the reader sees the end of an empty file
            done.wait(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield caught
    finally:
        done.set()
        thread.join()


async def test_fifos_sockets_and_devices_are_never_opened(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A FIFO where a debug file is expected was opened: in the plain layout by the walk (the
    server did not start, a rescan never ended), in the .build-id layout on the event loop (no
    request, not even /healthz, was answered again). A socket, or a link to /dev/zero, named
    like a debug file was a 502 for a file the directory does not have."""
    tree = tmp_path / "debug"
    plain = tree / "opt"
    plain.mkdir(parents=True)
    shutil.copy(elfs.prog.debug, plain / "prog.debug")
    os.mkfifo(plain / "fifo.debug")
    ids = tree / ".build-id" / FAKE_ID[:2]
    ids.mkdir(parents=True)
    os.mkfifo(ids / f"{FAKE_ID[2:]}.debug")
    (ids / FAKE_ID[2:]).symlink_to("/dev/zero")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))  # bound where the path is short enough, then moved
    (tmp_path / "s").rename(ids / f"{FAKE_ID[2:-2]}00.debug")
    fifos = [plain / "fifo.debug", ids / f"{FAKE_ID[2:]}.debug"]
    try:
        with readers_caught(fifos) as caught:
            sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
            status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
            assert status == 200 and body == elfs.prog.debug.read_bytes()
            for key in (f"{FAKE_ID}/debuginfo", f"{FAKE_ID}/executable",
                        f"{FAKE_ID[:-2]}00/debuginfo"):
                assert (await sg.get(f"/buildid/{key}"))[0] == 404, key
            assert (await sg.get("/healthz"))[0] == 200
        assert caught == []
        _, _, listed = await sg.get(f"/metadata?key=buildid&value={FAKE_ID}")
        assert b'"results": []' in listed  # nothing there to list either
    finally:
        sock.close()


async def test_names_no_header_can_carry_are_served_under_the_default_name(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A file named with a newline (or bytes that are not UTF-8) was answered by a dropped
    connection: its name went into X-DEBUGINFOD-FILE, which aiohttp refuses to send (and into
    SQL, which refuses surrogates)."""
    tree = tmp_path / "debug"
    tree.mkdir()
    shutil.copy(elfs.prog.debug, tree / "prog\n.debug")
    shutil.copy(elfs.other.debug, os.fsdecode(bytes(tree) + b"/other\xff.debug"))
    long_name = "n" * 249 + ".debug"  # NAME_MAX, 255
    shutil.copy(elfs.nopie.debug, tree / long_name)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    for elf, name in ((elfs.prog, f"{elfs.prog.build_id}.debug"),
                      (elfs.other, f"{elfs.other.build_id}.debug"), (elfs.nopie, long_name)):
        for _ in range(2):  # the download, then the cached copy
            status, headers, body = await sg.get(f"/buildid/{elf.build_id}/debuginfo")
            assert status == 200 and body == elf.debug.read_bytes(), elf.name
            assert headers["X-DEBUGINFOD-FILE"] == name
            await sg.settled()
    status, _, listed = await sg.get("/metadata?key=glob&value=*.debug")
    assert status == 200 and long_name.encode() in listed
    # Nor in /metadata, where they went as they were: a byte that is not UTF-8 as a lone
    # surrogate, which JSON readers refuse or mangle, a newline as a line break in a listing.
    # Left out, as an upstream's such entries are, and the answer says it is incomplete.
    answer = json.loads(listed)
    assert all(printable(r["file"]) for r in answer["results"]), answer
    assert answer["complete"] is False


async def test_a_tree_deeper_than_the_recursion_limit_is_walked(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """os.walk recursed once per level: a tree deeper than Python's recursion limit failed
    every walk, so the server did not start (and a rescan kept the index it had)."""
    deep = tmp_path / "debug"
    levels = sys.getrecursionlimit() + 100
    bottom = Path(str(deep) + "/d" * levels)
    assert len(str(bottom)) < 4000  # within PATH_MAX: reachable by its full path
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(levels):  # one level at a time: Path.mkdir(parents=True) recurses too
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    shutil.copy(elfs.prog.debug, bottom / "prog.debug")
    try:
        sg = await start_symgate([UpstreamConfig(path=deep, rescan_s=0)])
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
        assert status == 200 and body == elfs.prog.debug.read_bytes()
    finally:  # removed bottom up: pytest's rmtree of its temporary directories recurses too
        (bottom / "prog.debug").unlink()
        while bottom != deep:
            bottom.rmdir()
            bottom = bottom.parent


async def test_a_file_replaced_by_one_of_the_same_size_and_time_is_read_again(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A walk opened only files whose mtime or size changed: a debug file replaced by another
    build's of the same size, its time kept (`rsync -a`, `cp -p`, then a rename), stayed
    indexed under the old build ID and the new one was never found."""
    tree = tmp_path / "debug"
    tree.mkdir()
    served = tree / "app.debug"
    shutil.copy(elfs.prog.debug, served)
    new_id = "f0" * 20
    replacement = elfs.prog.debug.read_bytes().replace(bytes.fromhex(elfs.prog.build_id),
                                                       bytes.fromhex(new_id))
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0.1)])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    st = served.stat()
    staged = tree.parent / "app.debug.new"
    staged.write_bytes(replacement)
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    staged.rename(served)
    assert (served.stat().st_size, served.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    async def found() -> bool:
        return (await sg.get(f"/buildid/{new_id}/debuginfo"))[0] == 200

    await eventually(found, timeout=10)


async def test_a_walk_leaves_no_object_per_file_for_the_garbage_collector(
    tmp_path: Path
) -> None:
    """A walk kept a Path and a dataclass per file: on a tree of 100,000 files each rescan
    (every 60 s by default) set off collections of the whole heap that stopped the event loop
    for 0.2-0.4 s each, every request with it. Held as strings and tuples of numbers, the
    index is nothing the collector looks at."""
    tree = tmp_path / "debug"
    for n in range(2000):
        build_id = f"{n:040x}"
        ids = tree / ".build-id" / build_id[:2]
        ids.mkdir(parents=True, exist_ok=True)
        (ids / f"{build_id[2:]}.debug").write_bytes(b"x")
        plain = tree / "plain" / f"{n // 100}"
        plain.mkdir(parents=True, exist_ok=True)
        (plain / f"notes-{n}.txt").write_bytes(b"not ELF")
    local = LocalDirectory(tree, 0, ProxyMetrics(CollectorRegistry()))
    gc.collect()
    before = len(gc.get_objects())
    await local.rescan()
    gc.collect()
    assert len(local.catalogue()) == 2000
    assert len(gc.get_objects()) - before < 500


async def test_a_debug_dir_link_to_another_build_id_is_passed_over(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """A .build-id link of a debug_dirs tree to another build's file (a stale tree) was taken
    as the debug file: its build was refused (never a table from the wrong file), and the
    mapping answered `malformed` although the upstream had the right file."""
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.other.debug,
                         elfs.other.executable)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(debug_dirs=(tree,)))
    status, headers, body = await post(sg, _profile(elfs, "prog"))
    assert status == 200, body
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    # Offline, the next --debug-dir is looked in.
    right = build_id_tree(tmp_path / "right", elfs.prog.build_id, elfs.prog.debug,
                          elfs.prog.executable)
    profile = tmp_path / "cpu.pb"
    profile.write_bytes(_profile(elfs, "prog"))
    done = await run_in_thread(["symgate", "symbolize", str(profile), "-o",
                                str(tmp_path / "out.pb"), "--debug-dir", str(tree),
                                "--debug-dir", str(right)])
    assert done.returncode == 0, done.stderr
    assert (await post(sg, profile.read_bytes()))[2] == (tmp_path / "out.pb").read_bytes()


async def test_files_whose_times_no_http_date_can_say_are_served(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """A debug file whose mtime is past year 9999 (`touch -d @1099511627776`; tmpfs and btrfs
    keep such times, ext4 clamps them at 2446) was a 500 for every request of it, its
    descriptor left open each time, and the upstreams after the directory never asked: its
    Last-Modified raised (formatdate's "year is out of range", or EOVERFLOW)."""
    try:
        tree = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="symgate-test-"))
    except OSError:
        pytest.skip("no /dev/shm to keep times ext4 cannot")
    try:
        ids = tree / ".build-id" / elfs.prog.build_id[:2]
        ids.mkdir(parents=True)
        files = {"debuginfo": (elfs.prog.debug, 2**40), "executable": (elfs.prog.executable,
                                                                     2**62)}
        for kind, (source, mtime) in files.items():
            copy = ids / (elfs.prog.build_id[2:] + (".debug" if kind == "debuginfo" else ""))
            shutil.copy(source, copy)
            os.utime(copy, (mtime, mtime))
            if copy.stat().st_mtime != mtime:
                pytest.skip("/dev/shm does not keep times past 2446")
        sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0), debuginfod.url])
        for kind, (source, _) in files.items():
            for _ in range(2):  # the download, then the cached copy
                status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/{kind}")
                assert status == 200 and body == source.read_bytes(), (kind, body[:200])
                await sg.settled()
            assert await sg.metric("symgate_upstream_requests_total", upstream=debuginfod.url,
                                   result="ok") == 0  # the directory's own file
    finally:
        shutil.rmtree(tree)


async def test_a_file_swapped_for_a_socket_after_the_walk_is_not_had(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """The walk passes sockets over, and a FIFO swapped in after it is opened without
    blocking and found no file (a 404); a socket swapped in failed its open (ENXIO, as a
    device without a driver does), which was taken for a disk's trouble: a 502, "try again",
    for a file the directory does not have."""
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.prog.debug,
                         elfs.prog.executable)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    debug = tree / ".build-id" / elfs.prog.build_id[:2] / f"{elfs.prog.build_id[2:]}.debug"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))  # bound where the path is short enough, then moved
        (tmp_path / "s").rename(debug)
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
        assert status == 404, body
        assert (await sg.get(f"/buildid/{elfs.prog.build_id}/executable"))[0] == 200
    finally:
        sock.close()


async def test_a_build_id_tree_under_a_directory_whose_name_ends_so_is_indexed(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """The build ID was read after the path's first ".build-id/", which ended another name
    here ("app.build-id/.build-id/xx/..."): nothing after it matched, and the tree's files
    were never served."""
    tree = tmp_path / "debug"
    build_id_tree(tree / "app.build-id", elfs.prog.build_id, elfs.prog.debug,
                  elfs.prog.executable)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    for kind, expected in (("debuginfo", elfs.prog.debug), ("executable", elfs.prog.executable)):
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/{kind}")
        assert status == 200 and body == expected.read_bytes(), kind


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_descriptor_to_open_a_local_file_is_503_with_retry_after(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A local directory's file that could not be opened for want of a descriptor (EMFILE)
    was the directory's failure: a 502 that blamed it ("Too many open files"), counted as its
    error, where an HTTP upstream's connect without one is this server's passing trouble, a
    503. However many descriptors the fetch finds before it runs out, it answers so or 200."""
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.prog.debug,
                         elfs.prog.executable)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get("/healthz"))[0] == 200  # the client's connection, kept alive
    answers = []
    for free in range(12):  # the fetch's own descriptors first, then the file's open
        with _no_descriptor_left(free):
            status, headers, body = await sg.get(path)
        answers.append(status)
        if status == 200:
            assert body == elfs.prog.debug.read_bytes()
            break
        assert status == 503, (free, body)
        assert headers["Retry-After"] == str(sg.config.server.retry_after_s)
    assert answers[-1] == 200, answers
    assert await sg.metric("symgate_upstream_requests_total", upstream=f"dir:{tree}",
                           result="upstream_error") == 0
