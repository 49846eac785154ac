"""A client that stops reading is disconnected after server.send_timeout_s, whether its response
is a cached file sent with sendfile(2) or a download streamed as it comes; one that reads
slowly but reads gets every byte (proxy/web/send_watch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from pathlib import Path

import aiohttp

from proxy.web.send_watch import SendWatch, send_state
from tests.elfs import ElfSet, build_program
from tests.faults import FaultUpstream
from tests.processes import descendants
from tests.test_hostile_clients import _serve, _stop

TIMEOUT_S = 1.0


def _request(port: int, path: str, receive_buffer: int | None = None) -> socket.socket:
    """A GET sent on a new connection whose answer is not read (yet)."""
    s = socket.socket()
    if receive_buffer is not None:  # before connect: the window offered is then small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: symgate\r\n\r\n".encode())
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


def _open_on(pids: set[int], path: Path) -> int:
    """Descriptors these processes hold on `path`."""
    count = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    count += os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
    return count


async def _metric(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"(?m)^{name} ([\d.e+]+)$", text)
    return float(m.group(1)) if m else 0.0


async def test_a_client_that_stops_reading_a_cached_file_is_cut_and_the_file_let_go(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    base, proc, out, drain = await _serve(tmp_path, faults.url_for("ok"),
                                          f"send_timeout_s = {TIMEOUT_S}\n")
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    async with aiohttp.ClientSession() as s, s.get(base + path) as r:  # cached now
        assert r.status == 200 and len(await r.read()) == size
    cached = None
    for _ in range(250):  # committed once its client has every byte: soon after
        cached = next((p for p in (tmp_path / "d").rglob("*") if "objects" in p.parts
                       and p.is_file() and p.stat().st_size == size), None)
        if cached is not None:
            break
        await asyncio.sleep(0.02)
    assert cached is not None
    port = int(base.rsplit(":", 1)[1])
    stalled = await asyncio.to_thread(_request, port, path, 4096)
    pids = {proc.pid, *descendants(proc.pid)}
    # Being sent: the serving process holds the file.
    for _ in range(100):
        if _open_on(pids, cached):
            break
        await asyncio.sleep(0.02)
    assert _open_on(pids, cached) >= 1
    # The timeout, a sweep's period and the grace before the reset, and some.
    await asyncio.sleep(TIMEOUT_S * 3.5)
    assert _open_on(pids, cached) == 0
    got, length, cut = await asyncio.to_thread(_read_answer, stalled)
    assert length == size and got < size and cut, (got, length, cut)
    assert await _metric(base, "symgate_send_timeouts_total") == 1
    # The server serves on, the same file whole.
    async with aiohttp.ClientSession() as s, s.get(base + path) as r:
        assert r.status == 200 and len(await r.read()) == size
    assert await _stop(proc, drain) == 0
    text = out.decode(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert text.count("server.send_timeout_s") == 1, text[-3000:]


async def test_a_client_that_stops_reading_a_download_is_cut_and_the_download_kept(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    base, proc, out, drain = await _serve(tmp_path, faults.url_for("ok"),
                                          f"send_timeout_s = {TIMEOUT_S}\n")
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    before = faults.count("ok")
    port = int(base.rsplit(":", 1)[1])
    stalled = await asyncio.to_thread(_request, port, path, 4096)  # a miss: streamed
    await asyncio.sleep(TIMEOUT_S * 3.5)
    got, length, cut = await asyncio.to_thread(_read_answer, stalled)
    assert length == size and got < size and cut, (got, length, cut)
    assert await _metric(base, "symgate_send_timeouts_total") == 1
    # The download went on without its client, and was kept: a hit, no second request.
    async with aiohttp.ClientSession() as s, s.get(base + path) as r:
        assert r.status == 200 and len(await r.read()) == size
    assert faults.count("ok") - before == 1
    assert await _stop(proc, drain) == 0
    assert "Traceback" not in out.decode(errors="replace")


async def test_a_client_that_reads_slowly_but_reads_gets_every_byte(
    faults: FaultUpstream, tmp_path: Path
) -> None:
    # A file larger than what the socket buffers of a client that reads seldom hold (they do
    # not grow then), small enough to be read in a few seconds that way.
    files = tmp_path / "files"
    files.mkdir()
    elf = build_program(tmp_path / "src", files, "mid", 71, pad_bytes=1 << 20)
    base, proc, out, drain = await _serve(
        tmp_path, faults.url_for("notfound"),
        f'send_timeout_s = {TIMEOUT_S}\n[[upstreams]]\npath = "{files}"\n')
    path = f"/buildid/{elf.build_id}/debuginfo"
    size = elf.debug.stat().st_size
    port = int(base.rsplit(":", 1)[1])
    for _ in range(2):  # streamed as it is fetched, then sent from the cache
        slow = await asyncio.to_thread(_request, port, path)
        # Each pause shorter than the timeout, the whole reading far longer than it.
        started = time.monotonic()
        got, length, cut = await asyncio.to_thread(_read_answer, slow, TIMEOUT_S * 0.6)
        assert (got, length, cut) == (size, size, False)
        assert time.monotonic() - started > TIMEOUT_S
    assert await _metric(base, "symgate_send_timeouts_total") == 0
    assert await _stop(proc, drain) == 0
    assert "server.send_timeout_s" not in out.decode(errors="replace")


async def test_the_watch_reads_what_a_socket_has_waiting_and_acknowledged() -> None:
    """The kernel's own counts, on a real loopback connection: nothing waits while the peer
    keeps up; bytes wait, and the acknowledged count stands still, while it does not read."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(server.getsockname())
    conn, _ = server.accept()
    try:
        conn.sendall(b"x" * 1000)
        await asyncio.sleep(0.05)
        assert send_state(conn) == (0, 0)
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                conn.send(b"y" * 65536)
        await asyncio.sleep(0.2)
        waiting, acked = send_state(conn) or (0, 0)
        assert waiting > 0 and acked >= 1000
        await asyncio.sleep(0.2)
        assert send_state(conn) == (waiting, acked)
        client.recv(1 << 20)
        for _ in range(50):
            state = send_state(conn)
            if state is not None and state[1] > acked:
                break
            await asyncio.sleep(0.02)
        assert state is not None and state[1] > acked
    finally:
        for s in (conn, client, server):
            s.close()


async def test_a_connection_cut_while_sendfile_waits_ends_the_send() -> None:
    """asyncio's sendfile takes the socket from its transport and waits for room: the cut
    must end that wait (an error), not leave it waiting on a socket nobody watches."""
    server_side: asyncio.Future[tuple[asyncio.Transport, asyncio.Future[int]]] = \
        asyncio.get_running_loop().create_future()
    data = os.urandom(8 << 20)
    payload = Path(os.environ.get("TMPDIR", "/tmp")) / f"send-watch-{os.getpid()}"
    payload.write_bytes(data)

    class Sender(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            sending = asyncio.ensure_future(asyncio.get_running_loop().sendfile(
                transport, payload.open("rb")))
            server_side.set_result((transport, sending))

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Sender, "127.0.0.1", 0)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await asyncio.to_thread(client.connect, server.sockets[0].getsockname())
        transport, sending = await server_side
        watch = SendWatch(0.2)
        started = loop.time()
        while not sending.done() and loop.time() - started < 5:
            watch.sweep([transport], loop.time())
            await asyncio.sleep(0.05)
        assert watch.cut == 1 and sending.done()
        assert isinstance(sending.exception(), OSError)
    finally:
        client.close()
        server.close()
        payload.unlink()
