"""A local directory source over a messy or hostile tree: special files where debug files are
expected, names no header can carry. Each client gets the right file or a precise status, and
the server goes on serving."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.config import UpstreamConfig
from tests.elfs import ElfSet
from tests.harness import SymgateFactory

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
