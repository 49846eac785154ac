"""A cached file of MBs is sent with sendfile(2): clients that stop reading hold nothing the
others need, whose big and small hits go on meanwhile, and every client ends with the whole
file, byte for byte, whether it read fast or slowly, left early or came with many others."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ParamSpec, TypeVar

import aiohttp
import pytest

from proxy.config import UpstreamConfig
from proxy.keys import ArtifactKey
from proxy.web.connections import ConnectionGuard
from proxy.web.fast_hits import FastHits
from proxy.web.file_sends import ShortFile, room_for, send_at_once, send_whole
from proxy.web.hot_files import SMALL_FILE_BYTES
from proxy.web.state import STATE
from tests.elfs import ElfSet, build_id_tree, build_program
from tests.harness import Debuginfod, Symgate, SymgateFactory, eventually

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

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


async def test_a_big_hit_is_corked_until_its_last_byte_and_a_slow_reader_gets_every_byte(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """A cached file goes out corked (full frames only, its head with its first bytes), in
    many sendfile calls as the socket drains: a slow reader gets every byte once, in order,
    and the socket is uncorked after the last byte, so that the next response on the
    connection (a small hit, then the big file again) is not held back."""
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    small, small_body = f"/buildid/{elfs.prog.build_id}/debuginfo", elfs.prog.debug.read_bytes()
    assert (await sg.get(small))[0] == 200
    host, port = sg.url.removeprefix("http://").rsplit(":", 1)

    async def one_connection(paths: list[tuple[str, bytes]]) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)

        async def uncorked() -> bool:
            return _server_side(sock.getsockname(), socket.TCP_CORK) == 0

        try:
            for path, body in paths:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                if body is small_body:
                    assert await asyncio.wait_for(reader.readexactly(len(body)), 30) == body
                    continue
                got = bytearray(await reader.readexactly(1024 * 1024))
                assert _server_side(sock.getsockname(), socket.TCP_CORK) == 1  # mid-file
                while len(got) < len(expected):  # slowly: the server waits on a full socket
                    got += await asyncio.wait_for(
                        reader.read(min(64 * 1024, len(expected) - len(got))), 30)
                    await asyncio.sleep(0.0005)
                assert bytes(got) == expected
                await eventually(uncorked)
        finally:
            writer.close()

    # aiohttp's path (the file's first hit) ...
    await one_connection([(big, expected), (small, small_body), (big, expected)])
    # ... then the quick one, which `symgate serve` puts before aiohttp: a new connection's
    # first request, the file hot by then (proxy.web.fast_hits).
    runner, config = sg.runner, sg.config.server
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, 64, config.retry_after_s, config.header_timeout_s,
                            config.send_timeout_s)
    guard.quick = FastHits(runner.app[STATE], None)
    listener = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    host, port = "127.0.0.1", str(listener.sockets[0].getsockname()[1])
    try:
        before = await sg.metric("symgate_quick_hits_total")
        await one_connection([(big, expected), (small, small_body)])
        assert await sg.metric("symgate_quick_hits_total") == before + 2
    finally:
        listener.close()


def _server_side(client: tuple[str, int], option: int) -> int:
    """A TCP option of the in-process server's end of the connection from `client`."""
    with _server_socket(client) as s:
        return s.getsockopt(socket.IPPROTO_TCP, option)


def _server_socket(client: tuple[str, int]) -> socket.socket:
    """The in-process server's end of the connection from `client`, as a duplicate."""
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
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM \
                    and s.getpeername() == client:
                return s
        except OSError:  # not connected, or gone meanwhile
            pass
        s.close()
    raise AssertionError(f"no server-side socket for {client}")


async def test_a_quick_hit_the_send_buffer_has_room_for_goes_whole_and_the_next_follows(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A file past the size kept in memory whose bytes the socket's send buffer has room for
    is sent by the connection in one sendfile(2), no task of its own: whole, uncorked after
    it, and a next request on the connection answered as well."""
    (tmp_path / "out").mkdir()
    mid = build_program(tmp_path / "src", tmp_path / "out", "mid", 31, pad_bytes=300 * 1024)
    size = mid.debug.stat().st_size
    assert SMALL_FILE_BYTES < size < 400 * 1024
    sg = await start_symgate([UpstreamConfig(path=build_id_tree(
        tmp_path / "tree", mid.build_id, mid.debug, mid.executable), rescan_s=0)])
    path, expected = f"/buildid/{mid.build_id}/debuginfo", mid.debug.read_bytes()
    for _ in range(2):  # cached, then its head kept in memory
        assert (await sg.get(path))[2] == expected
    runner, config = sg.runner, sg.config.server
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, 64, config.retry_after_s, config.header_timeout_s,
                            config.send_timeout_s)
    guard.quick = FastHits(runner.app[STATE], None)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(guard, "127.0.0.1", 0)
    sock = socket.create_connection(listener.sockets[0].getsockname()[:2])
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        await eventually(lambda: _has_server_side(sock.getsockname()))
        with _server_socket(sock.getsockname()) as server_end:
            server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            assert room_for(server_end) > size + 1024  # the head's too
        before = await sg.metric("symgate_quick_hits_total")
        for _ in range(2):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and f"{size}".encode() in head, head
            assert await asyncio.wait_for(reader.readexactly(size), 30) == expected
            assert _server_side(sock.getsockname(), socket.TCP_CORK) == 0
        assert await sg.metric("symgate_quick_hits_total") == before + 2
        assert all(c._sending is None for c in guard._quick_only)
    finally:
        writer.close()
        listener.close()


async def _has_server_side(client: tuple[str, int]) -> bool:
    try:
        _server_socket(client).close()
    except AssertionError:
        return False
    return True


async def test_a_file_the_send_buffer_has_room_for_goes_at_once_and_the_rest_after(
        tmp_path: Path) -> None:
    """file_sends on a real TCP connection: a file the send buffer has room for goes in one
    sendfile(2), the file's position past it; one it has not, in part, then the rest by
    send_whole from where that left off; a file shorter than its entry is cut, not padded."""
    payload = os.urandom(3 * 1024 * 1024)
    (tmp_path / "f").write_bytes(payload)
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            accepted.set_result(transport)

    listener = await loop.create_server(Server, "127.0.0.1", 0)
    client = socket.create_connection(listener.sockets[0].getsockname()[:2])
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    transport = await accepted
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)  # the kernel doubles it
    try:
        room = room_for(sock)
        assert 0 < room <= sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        with (tmp_path / "f").open("rb", buffering=0) as f:
            small = room // 2
            assert send_at_once(sock, f, small, "f") == small and f.tell() == small
            assert room_for(sock) < room  # held until the client has it
            got = await loop.run_in_executor(None, _read_exactly, client, small)
            assert got == payload[:small]
        with (tmp_path / "f").open("rb", buffering=0) as f:
            first = send_at_once(sock, f, len(payload), "f")
            assert 0 < first < len(payload) and f.tell() == first  # the client reads nothing
            reading = loop.run_in_executor(None, _read_exactly, client, len(payload))
            await send_whole(transport, f, len(payload), "f", fallback=False, offset=first)
            assert await reading == payload
        # A file shorter than its entry: what it has goes, and the send ends there.
        (tmp_path / "short").write_bytes(payload[:1000])
        with (tmp_path / "short").open("rb", buffering=0) as f:
            assert send_at_once(sock, f, 2000, "short") == 1000
            with pytest.raises(ShortFile):
                await send_whole(transport, f, 2000, "short", fallback=False, offset=1000)
        (tmp_path / "empty").write_bytes(b"")
        with (tmp_path / "empty").open("rb", buffering=0) as f, pytest.raises(ShortFile):
            send_at_once(sock, f, 2000, "empty")
    finally:
        client.close()
        transport.close()
        listener.close()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    sock.settimeout(30)
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, (len(got), n)
        got += chunk
    return bytes(got)


_T = TypeVar("_T")
_P = ParamSpec("_P")


class _FileOpens(ThreadPoolExecutor):
    """The loop's thread pool, running FileResponse's open and stat of a file (aiohttp's
    _make_response, after the handler found the hit) inside `around`."""

    def __init__(self, around: Callable[[], AbstractContextManager[object]]) -> None:
        super().__init__(max_workers=4)
        self._around = around

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
               ) -> Future[_T]:
        if getattr(fn, "__name__", "") != "_make_response":
            return super().submit(fn, *args, **kwargs)

        def within() -> _T:
            with self._around():
                return fn(*args, **kwargs)

        return super().submit(within)


async def _cached_path(sg: Symgate, elf_build_id: str) -> Path:
    """The cache's file of the key's debuginfo, once committed (after its last byte)."""
    cache = sg.runner.app[STATE].service.cache
    key = ArtifactKey.parse(elf_build_id, "debuginfo")
    await eventually(lambda: cache.peek("", key) is not None)
    hit = cache.peek("", key)
    assert hit is not None
    return hit.path


async def test_a_cached_file_cut_short_before_its_range_is_read_is_not_sent_as_whole(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The file shrinks on disk (an operator, a bad disk) after its hit was found whole and
    before FileResponse reads its size (a range, or a conditional request): that size is not
    the response's, whose body would look whole and be a piece of the file; the connection
    ends unanswered, and the next request finds the damage and fetches the file anew."""
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    cached = await _cached_path(sg, elfs.big.build_id)
    entered, go = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        entered.set()
        go.wait(60)
        yield

    asyncio.get_running_loop().set_default_executor(_FileOpens(held))
    try:
        host, port = sg.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET {big} HTTP/1.1\r\nHost: {host}\r\nRange: bytes=0-\r\n\r\n"
                     .encode())
        assert await asyncio.to_thread(entered.wait, 60)
        with cached.open("r+b") as f:
            f.truncate(1 << 20)
        go.set()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        except asyncio.IncompleteReadError as e:  # the connection's end
            head = e.partial
        except ConnectionResetError:  # its end as a cut's now (errors.cut_off): nothing came
            head = b""
        writer.close()
        assert head == b"", head  # not the damaged file's size, as if it were the file's
    finally:
        go.set()
    status, _, body = await sg.get(big)
    assert status == 200 and body == expected



@contextlib.contextmanager
def _no_descriptor_left() -> Iterator[None]:
    """Every descriptor the process may open taken, for as long as it is held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    # Lowered first: the limit (raised for servers) could be a million descriptors to take.
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_range_of_a_cached_file_with_no_descriptor_left_is_no_404(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """FileResponse (a range, a conditional request) opened the cached file once more by its
    path, and answered 404 when that failed: out of descriptors, a file that is cached was
    not found, for as long as an elfutils client keeps a 404. It is sent from the descriptor
    the hit was found with."""
    sg, big, expected = await _big_cached(start_symgate, debuginfod, elfs)
    await _cached_path(sg, elfs.big.build_id)
    asyncio.get_running_loop().set_default_executor(_FileOpens(_no_descriptor_left))
    status, headers, body = await sg.get(big, headers={"Range": "bytes=100-199"})
    assert (status, headers["Content-Range"], body) == (
        206, f"bytes 100-199/{len(expected)}", expected[100:200])
