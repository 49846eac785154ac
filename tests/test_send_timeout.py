"""A client that stops reading is disconnected after server.send_timeout_s, whether its response
is a cached file sent with sendfile(2), a small one sent from memory, or a download streamed as
it comes; one that reads slowly but reads gets every byte (proxy/web/send_timeout.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from proxy.web.send_timeout import is_send_timeout, limit_unacknowledged
from tests.elfs import ElfSet, build_program
from tests.faults import FaultUpstream
from tests.processes import descendants, descriptors_on
from tests.test_hostile_clients import _serve, _stop

TIMEOUT_S = 1.0


def _request(port: int, path: str, receive_buffer: int | None = None,
             segment: int | None = None, extra: str = "") -> socket.socket:
    """A GET sent on a new connection whose answer is not read (yet); `segment`: the MSS, as
    on a real network rather than loopback's 64 KiB; `extra`: header lines, each ending in
    CRLF."""
    s = socket.socket()
    if receive_buffer is not None:  # before connect: the window offered is then small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    if segment is not None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, segment)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: symgate\r\n{extra}\r\n".encode())
    return s


def _read_answer(s: socket.socket, pause_s: float = 0.0) -> tuple[int, int, bool]:
    """(body bytes received, Content-Length, whether the server cut the connection): reads
    until the body is whole or the connection ends, pausing `pause_s` between reads."""
    s.settimeout(10)
    data, length, cut = b"", None, False
    try:
        while length is None or len(data) < length:
            if pause_s:
                time.sleep(pause_s)
            chunk = s.recv(4 << 20)
            if not chunk:
                cut = True
                break
            data += chunk
            if length is None and b"\r\n\r\n" in data:
                head, data = data.split(b"\r\n\r\n", 1)
                m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                assert head.startswith(b"HTTP/1.1 200") and m, head
                length = int(m.group(1))
    except ConnectionResetError:
        cut = True
    finally:
        s.close()
    return len(data), length or -1, cut


@contextlib.asynccontextmanager
async def _server(tmp_path: Path, upstream: str, extra: str = ""
                  ) -> AsyncIterator[tuple[str, int, bytearray, set[int]]]:
    """A `symgate serve` with a 1 s send timeout: (base URL, port, its output so far, its
    processes); stopped however the test ends, its exit checked when it passed."""
    base, proc, out, drain = await _serve(tmp_path, upstream,
                                          f"send_timeout_s = {TIMEOUT_S}\n{extra}")
    try:
        yield base, int(base.rsplit(":", 1)[1]), out, {proc.pid, *descendants(proc.pid)}
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    assert await _stop(proc, drain) == 0
    assert "Traceback" not in out.decode(errors="replace"), out.decode()[-3000:]


def _cut_lines(out: bytearray) -> int:
    return out.decode(errors="replace").count("(server.send_timeout_s)")


async def _all_cut_and_counted(stalled: list[socket.socket], size: int, base: str,
                               out: bytearray) -> None:
    """Each of these connections ended before its body did, and each was counted and logged
    once."""
    for sock in stalled:
        got, length, cut = await asyncio.to_thread(_read_answer, sock)
        assert length == size and got < size and cut, (got, length, cut)
    assert await _metric(base, "symgate_send_timeouts_total") == len(stalled), out.decode()[-3000:]
    assert _cut_lines(out) == len(stalled), out.decode()[-3000:]


async def _served_whole(url: str, size: int) -> None:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200 and len(await r.read()) == size


async def _metric(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"(?m)^{name} ([\d.e+]+)$", text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("answered", ["by aiohttp", "quickly"])
async def test_a_client_that_stops_reading_a_cached_file_is_cut_and_the_file_let_go(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path, answered: str
) -> None:
    """A hit with a header the quick path leaves to aiohttp goes through aiohttp; a plain
    one is answered quickly (proxy.web.fast_hits), the file sent by the connection itself."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    # One serving process: the hit that keeps the answer's head in memory and the stalled
    # request reach the same one.
    async with _server(tmp_path, faults.url_for("ok"), "workers = 1\n") as (base, port, out,
                                                                          pids):
        await _served_whole(base + path, size)  # cached now
        quick_before = await _metric(base, "symgate_quick_hits_total")
        cached = None
        for _ in range(250):  # committed once its client has every byte: soon after
            cached = next((p for p in (tmp_path / "d").rglob("*") if "objects" in p.parts
                           and p.is_file() and p.stat().st_size == size), None)
            if cached is not None:
                break
            await asyncio.sleep(0.02)
        assert cached is not None
        for _ in range(250):  # and in the index (a hit not yet settled is aiohttp's)
            if await _metric(base, "symgate_cache_entries") == 1:
                break
            await asyncio.sleep(0.02)
        stalled = await asyncio.to_thread(
            _request, port, path, 4096, None,
            "Cache-Control: no-cache\r\n" if answered == "by aiohttp" else "")
        # Being sent (with sendfile): the serving process holds the file.
        for _ in range(100):
            if descriptors_on(pids, cached):
                break
            await asyncio.sleep(0.02)
        assert descriptors_on(pids, cached) >= 1
        await asyncio.sleep(TIMEOUT_S * 3)
        assert descriptors_on(pids, cached) == 0
        await _all_cut_and_counted([stalled], size, base, out)
        assert await _metric(base, "symgate_quick_hits_total") == quick_before + (
            answered == "quickly")
        await _served_whole(base + path, size)  # the server serves on, the same file whole
    # Its access line says why, as aiohttp's path says it: the quick path's said only "the
    # connection ended before the file's last byte", for a client cut and a client gone alike.
    cut = [line for line in out.decode().splitlines()
           if "symgate.access" in line and "outcome=aborted" in line]
    assert len(cut) == 1 and 'error="[Errno 110] Connection timed out"' in cut[0], cut


async def test_a_client_that_stops_reading_a_small_hit_is_cut_though_its_connection_closes(
    faults: FaultUpstream, tmp_path: Path
) -> None:
    """A hit sent from memory, whose tail waits in asyncio's buffer: the connection's idle
    timer (header_timeout_s, shorter here) closes it, which waits for that buffer to drain,
    and a client that never reads would keep it open for good."""
    files = tmp_path / "files"
    files.mkdir()
    elf = build_program(tmp_path / "src", files, "small", 72)
    pad = tmp_path / "pad.bin"  # to ~160 KiB: sent from memory (<= 256 KiB), not with sendfile
    pad.write_bytes(os.urandom(160 << 10))
    subprocess.run(["objcopy", "--add-section", f".pad={pad}", str(elf.debug)], check=True)
    path = f"/buildid/{elf.build_id}/debuginfo"
    size = elf.debug.stat().st_size
    async with _server(tmp_path, faults.url_for("notfound"),
                       f'header_timeout_s = {TIMEOUT_S / 2}\n[[upstreams]]\npath = "{files}"\n'
                       ) as (base, port, out, _pids):
        for _ in range(2):  # fetched, then a hit from memory
            await _served_whole(base + path, size)
        stalled = [await asyncio.to_thread(_request, port, path, 4096, 1448) for _ in range(3)]
        await asyncio.sleep(TIMEOUT_S * 3)
        await _all_cut_and_counted(stalled, size, base, out)


async def test_a_client_that_stops_reading_a_download_is_cut_and_the_download_kept(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    before = faults.count("ok")
    async with _server(tmp_path, faults.url_for("ok")) as (base, port, out, _pids):
        stalled = await asyncio.to_thread(_request, port, path, 4096)  # a miss: streamed
        await asyncio.sleep(TIMEOUT_S * 3)
        await _all_cut_and_counted([stalled], size, base, out)
        # The download went on without its client, and was kept: a hit, no second request.
        await _served_whole(base + path, size)
        assert faults.count("ok") - before == 1


def _padded_debug_file(tmp_path: Path, name: str, seed: int, pad: int
                       ) -> tuple[Path, str, int]:
    """A program's debug file padded by `pad` bytes in a folder of its own, for a local
    upstream: the folder, the file's /buildid path and its size."""
    files = tmp_path / "files"
    files.mkdir()
    elf = build_program(tmp_path / "src", files, name, seed, pad_bytes=pad)
    return files, f"/buildid/{elf.build_id}/debuginfo", elf.debug.stat().st_size


async def test_a_client_that_reads_slowly_but_reads_gets_every_byte(
    faults: FaultUpstream, tmp_path: Path
) -> None:
    # A file larger than what the socket buffers of a client that reads seldom hold (they do
    # not grow then), small enough to be read in a few seconds that way.
    files, path, size = _padded_debug_file(tmp_path, "mid", 71, 1 << 20)
    async with _server(tmp_path, faults.url_for("notfound"),
                       f'[[upstreams]]\npath = "{files}"\n') as (base, port, out, _pids):
        for _ in range(2):  # streamed as it is fetched, then sent from the cache
            slow = await asyncio.to_thread(_request, port, path)
            # Each pause shorter than the timeout, the whole reading longer than it.
            started = time.monotonic()
            got, length, cut = await asyncio.to_thread(_read_answer, slow, TIMEOUT_S * 0.6)
            assert (got, length, cut) == (size, size, False)
            assert time.monotonic() - started > TIMEOUT_S
        assert await _metric(base, "symgate_send_timeouts_total") == 0
        assert _cut_lines(out) == 0


async def test_the_kernel_ends_a_sendfile_waiting_on_a_client_that_stopped_reading() -> None:
    """What the server relies on, checked on the kernel it runs on: with the option set, a
    client that acknowledges nothing (its window shut) has the connection closed, and
    asyncio's sendfile, which took the socket from its transport to wait for room, ends
    with the error rather than waiting forever."""
    loop = asyncio.get_running_loop()
    sending: asyncio.Future[asyncio.Future[int]] = loop.create_future()
    payload = Path(os.environ.get("TMPDIR", "/tmp")) / f"send-timeout-{os.getpid()}"
    payload.write_bytes(os.urandom(8 << 20))

    class Sender(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            limit_unacknowledged(transport.get_extra_info("socket"), 0.3)
            sending.set_result(asyncio.ensure_future(loop.sendfile(transport,
                                                                   payload.open("rb"))))

    server = await loop.create_server(Sender, "127.0.0.1", 0)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await asyncio.to_thread(client.connect, server.sockets[0].getsockname())
        send = await sending
        await asyncio.wait_for(asyncio.wait([send]), 10)
        assert is_send_timeout(send.exception()), send.exception()
    finally:
        client.close()
        server.close()
        payload.unlink()


@pytest.mark.parametrize("answered", ["by aiohttp", "quickly"])
async def test_a_client_that_stops_reading_a_file_the_buffer_nearly_holds_is_counted(
    faults: FaultUpstream, tmp_path: Path, answered: str
) -> None:
    """A file whose size the send buffer seems to have room for (SO_SNDBUF less SIOCOUTQ),
    but which one sendfile(2) sends only part of (the buffer's own overhead, more of it for a
    client with a small window): the rest goes by a task whose first sendfile(2) waits, and
    the kernel's cut of a client that stopped reading must be counted all the same."""
    files, path, size = _padded_debug_file(tmp_path, "near", 73, 3584 << 10)
    async with _server(tmp_path, faults.url_for("notfound"),
                       f'workers = 1\n[[upstreams]]\npath = "{files}"\n'
                       ) as (base, port, out, _pids):
        await _served_whole(base + path, size)  # cached now
        await asyncio.sleep(0.5)  # committed
        stalled = await asyncio.to_thread(_request, port, path, 4096)
        await asyncio.sleep(TIMEOUT_S * 3)
        await _all_cut_and_counted([stalled], size, base, out)
        await _served_whole(base + path, size)


def test_a_send_timeout_past_the_kernels_limit_is_the_longest_it_takes() -> None:
    """TCP_USER_TIMEOUT is an int of milliseconds: server.send_timeout_s past some 24.8 days
    (3000000, a month, as good as never) made setsockopt raise in every connection_made,
    a traceback a connection, and the connection's head timer never started."""
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        limit_unacknowledged(client, 3_000_000.0)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2**31 - 1
        limit_unacknowledged(client, 60.0)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000
