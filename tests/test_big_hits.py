"""A cached file of MBs is sent with sendfile(2): clients that stop reading hold nothing the
others need, whose big and small hits go on meanwhile, and every client ends with the whole
file, byte for byte, whether it read fast or slowly, left early or came with many others."""

from __future__ import annotations

import asyncio
import os
import socket

import aiohttp

from proxy.web.file_sends import UNSENT_BYTES
from tests.elfs import ElfSet
from tests.harness import Debuginfod, Symgate, SymgateFactory

# More clients that stop reading than the server has cores, or any pool would have threads.
STALLED = 5


async def _stalled_client(host: str, port: int, path: str
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A client with a small receive buffer that sends its request, reads the head and then
    stops reading: its connection holds what the server could not send."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return reader, writer, length


async def test_clients_that_stop_reading_hold_up_nobody_and_still_get_every_byte(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    big = f"/buildid/{elfs.big.build_id}/debuginfo"
    small = f"/buildid/{elfs.prog.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    assert len(expected) > 16 * 1024 * 1024  # far more than any socket buffer holds
    for path, body in ((big, expected), (small, elfs.prog.debug.read_bytes())):
        status, _, got = await sg.get(path)  # cached now: hits from here on
        assert status == 200 and got == body
    host, port = sg.url.removeprefix("http://").rsplit(":", 1)
    stalled = [await _stalled_client(host, int(port), big) for _ in range(STALLED)]
    try:
        # Served while every stalled client's response waits on its socket.
        async def whole(path: str) -> bytes:
            status, _, body = await sg.get(path)
            assert status == 200
            return body

        fast = await asyncio.wait_for(asyncio.gather(
            *(whole(big) for _ in range(4)), *(whole(small) for _ in range(8))), 60)
        assert all(body == expected for body in fast[:4])
        assert all(body == elfs.prog.debug.read_bytes() for body in fast[4:])
        # Then they read: each gets the whole file, in order.
        for reader, _, length in stalled:
            assert length == len(expected)
            assert await asyncio.wait_for(reader.readexactly(length), 60) == expected
    finally:
        for _, writer, _ in stalled:
            writer.close()


async def _big_cached(start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
                      ) -> tuple[Symgate, str, bytes]:
    """A server with the big file cached: it, the file's path and its bytes."""
    sg = await start_symgate([debuginfod.url])
    big = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    assert (await sg.get(big))[2] == expected
    return sg, big, expected


async def test_a_client_gone_mid_file_leaves_the_server_serving(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.get(sg.url + big) as r:
                assert r.status == 200
                await r.content.readexactly(1024 * 1024)
                r.close()  # gone with most of the file unsent
    status, _, body = await sg.get(big)
    assert status == 200 and body == expected


async def test_many_clients_at_once_get_the_same_big_file(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    bodies = await asyncio.gather(*(sg.get(big) for _ in range(16)))
    assert all(status == 200 and body == expected for status, _, body in bodies)


async def test_a_client_socket_holds_little_unsent_and_a_slow_reader_still_gets_every_byte(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """sendfile(2) would queue a whole file in the socket at once; while a cached file is sent,
    the server's side of the connection keeps at most UNSENT_BYTES unsent, so a big hit goes
    out in many sendfile calls, each when the socket has drained: a slow reader gets every byte
    once, in order; and so does the next response on the connection, the bound still set."""
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    host, port = sg.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
    try:
        for _ in range(2):  # the second on the same connection
            writer.write(f"GET {big} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            got = bytearray(await reader.readexactly(1024 * 1024))
            assert _server_side_bound(sock.getsockname()) == UNSENT_BYTES  # mid-file
            while len(got) < len(expected):  # slowly: the server waits on a full socket
                got += await asyncio.wait_for(
                    reader.read(min(64 * 1024, len(expected) - len(got))), 30)
                await asyncio.sleep(0.0005)
            assert bytes(got) == expected
    finally:
        writer.close()


def _server_side_bound(client: tuple[str, int]) -> int:
    """TCP_NOTSENT_LOWAT of the in-process server's end of the connection from `client`."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            fd = os.dup(int(name))
        except OSError:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            continue
        with s:
            try:
                if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM \
                        and s.getpeername() == client:
                    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
            except OSError:  # not connected, or gone meanwhile
                continue
    raise AssertionError(f"no server-side socket for {client}")
