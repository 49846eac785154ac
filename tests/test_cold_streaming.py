"""A cold download streamed to its clients from memory while the disk is written behind
(proxy.artifacts.flight, .chunk_writer), against a raw upstream that sends its body in parts,
with or without a size, and then ends, closes or resets. Written in review of that change."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import threading
from pathlib import Path

import aiohttp
import pytest

from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream, read_broken, read_rest

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


class Raw:
    """A raw HTTP upstream: sends `parts` (with `gap` s between), then closes or resets."""

    def __init__(self, parts: list[bytes], *, size: int | None, chunked: bool = False,
                 reset: bool = False, gap: float = 0.0) -> None:
        self.parts, self.size, self.chunked, self.reset, self.gap = parts, size, chunked, reset, gap
        self.requests = 0
        self.url = ""
        self.server: asyncio.Server | None = None
        self.go = asyncio.Event()
        self.go.set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        head = [b"HTTP/1.1 200 OK", b"Content-Type: application/octet-stream",
                b"Connection: close"]
        if self.size is not None:
            head += [b"Content-Length: %d" % self.size, b"X-DEBUGINFOD-SIZE: %d" % self.size]
        if self.chunked:
            head.append(b"Transfer-Encoding: chunked")
        writer.write(b"\r\n".join(head) + b"\r\n\r\n")
        for i, part in enumerate(self.parts):
            if i:
                await self.go.wait()
                await asyncio.sleep(self.gap)
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if self.chunked else part)
            await writer.drain()
        if self.reset:
            await asyncio.sleep(0.05)
            writer.transport.abort()
            return
        if self.chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-encoding", "until-eof"])
async def test_small_file_without_size_wrong_build_id_is_502(
    start_symgate: SymgateFactory, elfs: ElfSet, chunked: bool
) -> None:
    """A small file in one piece, no announced size, with another file's build ID: a clean
    502, not a 200 cut off (without a size, a first chunk may be the whole body)."""
    body = elfs.other.debug.read_bytes()
    up = Raw([body], size=None, chunked=chunked)
    await up.start()
    try:
        sg = await start_symgate([fast_upstream(up.url, retries=0)])
        status, got, cut = await read_broken(
            f"{sg.url}/buildid/{elfs.prog.build_id}/debuginfo")
        assert (status, cut) == (502, False), (status, got, cut, len(body))
    finally:
        await up.stop()


def _temp_fds(data_dir: Path) -> list[str]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(data_dir)) and "(deleted)" in target:
            out.append(target)
    return out


async def test_a_failed_download_leaks_no_descriptor_while_the_executor_is_busy(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """Threads of the default executor busy (builds, hashes, commits of other downloads): a
    chunk's write handed to a thread waits in the executor's queue. The download then fails
    (its upstream resets): the write still runs and closes the descriptor made for it; a
    cancelled job would have left it open, holding the unlinked temp file's blocks."""
    body = elfs.big.debug.read_bytes()
    up = Raw([body[:200_000], body[200_000:600_000]], size=len(body), reset=True, gap=0.1)
    await up.start()
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    try:
        sg = await start_symgate([fast_upstream(up.url, retries=0)])
        data_dir = sg.config.server.data_dir
        before = _temp_fds(data_dir)
        up.go.clear()
        async with aiohttp.ClientSession() as s, s.get(
                f"{sg.url}/buildid/{elfs.big.build_id}/debuginfo") as r:
            assert r.status == 200
            got = len(await r.content.readany())  # the response has started
            # Saturate the loop's default executor (what asyncio.to_thread uses), then let
            # the upstream send a chunk (written in a thread: queued) and reset.
            busy = [loop.run_in_executor(None, gate.wait) for _ in range(64)]
            up.go.set()
            _status, got, cut = await read_rest(r, got)
        assert cut, got
        gate.set()
        await asyncio.gather(*busy)
        await sg.settled()
        await asyncio.sleep(0.2)
        leaked = [t for t in _temp_fds(data_dir) if t not in before]
        assert leaked == [], leaked
    finally:
        gate.set()
        await up.stop()


@pytest.mark.parametrize("chunked", [False, True], ids=["size", "no-size"])
async def test_clients_joining_at_any_time_get_every_byte_once(
    start_symgate: SymgateFactory, elfs: ElfSet, chunked: bool
) -> None:
    body = elfs.big.debug.read_bytes()
    step = 300_001
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    up = Raw(parts, size=None if chunked else len(body), chunked=chunked, gap=0.01)
    await up.start()
    try:
        # Not a test of the upstream's limits: the upstream, the server and twelve clients
        # reading 4 MB in 8 KB pieces share this process's loop, which a loaded CI machine
        # stalled past fast_upstream's 2 s between two parts (the body cut for all at 2.7 MB).
        sg = await start_symgate([fast_upstream(up.url, retries=0, read_timeout_s=15)])
        url = f"{sg.url}/buildid/{elfs.big.build_id}/debuginfo"

        async def client(i: int) -> bytes:
            await asyncio.sleep(i * 0.03)
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                assert r.status == 200
                out = bytearray()
                async for chunk in r.content.iter_chunked(7777 + i * 1000):
                    out += chunk
                    if i % 3 == 0:
                        await asyncio.sleep(0.001)
                return bytes(out)

        async def head(i: int) -> tuple[int, str | None]:
            await asyncio.sleep(i * 0.05)
            async with aiohttp.ClientSession() as s, s.head(url) as r:
                return r.status, r.headers.get("Content-Length")

        got = await asyncio.gather(*(client(i) for i in range(12)),
                                   *(head(i) for i in range(4)))
        for i, b in enumerate(got[:12]):
            assert len(b) == len(body) and b == body, (i, len(b))
        for status, length in got[12:]:
            assert status == 200 and length == str(len(body)), (status, length)
        assert up.requests == 1
        await sg.settled()
        assert await sg.metric("symgate_cache_entries") == 1
    finally:
        await up.stop()


async def test_a_write_failing_after_the_verdict_and_a_follower(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The last chunk's write fails after the verdict (EFBIG through RLIMIT_FSIZE; ENOSPC
    takes the same path). The writing process's client has every byte, from memory; the
    other process's, which follows the file, cannot: it is cut, and told why (the fetch
    failed), not that its server is shutting down."""
    body = elfs.big.debug.read_bytes()
    up = Raw([body[:-1000], body[-1000:]], size=len(body))
    await up.start()
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        d = tmp_path / "d"
        a = await start_symgate([fast_upstream(up.url, retries=0)], data_dir=d)
        b = await start_symgate([fast_upstream(up.url, retries=0)], data_dir=d)
        path = f"/buildid/{elfs.big.build_id}/debuginfo"
        up.go.clear()

        async with aiohttp.ClientSession() as s, s.get(a.url + path) as ra:
            ga = len(await ra.content.readany())
            async with s.get(b.url + path) as rb:
                gb = len(await rb.content.readany())
                resource.setrlimit(resource.RLIMIT_FSIZE, (len(body) - 1000, old[1]))
                up.go.set()
                res_a, res_b = await asyncio.gather(read_rest(ra, ga), read_rest(rb, gb))
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        assert res_a == (200, len(body), False)
        assert res_b[0] == 200 and res_b[1] < len(body) and res_b[2], res_b
        cuts = [r.getMessage() for r in caplog.records if "cutting off" in r.getMessage()]
        assert cuts and all("shutting down" not in c for c in cuts), cuts
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_sig)
        await up.stop()


async def _get_http10(url: str, path: str) -> tuple[bytes, bytes]:
    """GET over HTTP/1.0 (no chunked encoding): the head, and the body read to the end of
    the connection, as such a client reads one without a Content-Length."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    try:
        got = await reader.read()
    except ConnectionResetError:
        got = b""
    writer.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("reset", [True, False], ids=["cut", "whole"])
async def test_an_http10_client_of_a_file_of_unknown_size_can_tell_a_cut_from_the_end(
    start_symgate: SymgateFactory, elfs: ElfSet, reset: bool
) -> None:
    """An HTTP/1.0 client has no chunked encoding: a body of unknown size was sent until the
    connection closed, and a download cut mid-body closed it too, so the client had a few MB
    of a 25 MB file that looked whole (nginx speaks HTTP/1.0 to its upstreams by default).
    Such a client waits for the file, and gets a Content-Length or a status that failed."""
    body = elfs.big.debug.read_bytes()
    parts = [body[i:i + 500_000] for i in range(0, 3_000_000, 500_000)]
    up = Raw(parts if reset else [body[:1_000_000], body[1_000_000:]], size=None,
             chunked=True, reset=reset)
    await up.start()
    try:
        sg = await start_symgate([fast_upstream(up.url, retries=0)])
        head, got = await _get_http10(sg.url, f"/buildid/{elfs.big.build_id}/debuginfo")
        status = head.split(b"\r\n")[0]
        if reset:
            assert status.startswith(b"HTTP/1.0 502"), head
        else:
            assert status.startswith(b"HTTP/1.0 200"), head
            assert f"Content-Length: {len(body)}".encode() in head and got == body
    finally:
        await up.stop()


async def test_a_head_that_joins_a_download_is_told_of_the_file_only_once_it_is_verified(
    start_symgate: SymgateFactory, elfs: ElfSet, faults: FaultUpstream
) -> None:
    """A HEAD's whole answer is its status and headers: a 200 says the file is there, and how
    big. One that joined a cold download was told so at its first bytes on disk, before the
    verdict: for another build ID's file (here a liar's, 25 MB in place of a small debug
    file) it had a 200 and the liar's size, while the cache rejected the file and the GET was
    cut. It waits for the verdict now, as elfutils' debuginfod fetches before it answers: the
    liar's failure, and where another upstream has the file, that one's answer."""
    wrong = elfs.big.debug.read_bytes()
    liar = Raw([wrong[:len(wrong) // 2], wrong[len(wrong) // 2:]], size=len(wrong))
    await liar.start()
    try:
        sg = await start_symgate([fast_upstream(liar.url, retries=0),
                                  fast_upstream(faults.url_for("ok"), retries=0)])
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        liar.go.clear()
        async with aiohttp.ClientSession() as s, s.get(sg.url + path) as r:
            got = len(await r.content.readany())  # the liar's first half is streaming
            heading = asyncio.ensure_future(sg.head(path))
            while not await sg.metric("symgate_singleflight_joins_total"):
                await asyncio.sleep(0.01)  # the HEAD has joined the download
            liar.go.set()
            status, got, cut = await read_rest(r, got)
        assert status == 200 and cut  # it had bytes: cut, never whole
        status, headers = await heading
        assert status == 200
        assert headers["Content-Length"] == str(elfs.prog.debug.stat().st_size)
        assert liar.requests == 1 and faults.count("ok") == 1
    finally:
        await liar.stop()
