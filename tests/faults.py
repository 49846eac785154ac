"""A small debuginfod-speaking upstream that misbehaves on purpose.

The first path segment picks the behaviour, so one server covers every fault: an upstream URL
of http://127.0.0.1:PORT/hang-mid-body makes symgate request /hang-mid-body/buildid/...
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import ipaddress
import socket
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from tests.elfs import Elf, ElfSet
from tests.harness import serve_loopback

HALF = 0.5
SLOW_HOPS = 20  # the most an upstream's max_redirects may be
MIB = 1024 * 1024


def _gzip_zeros(start: bytes = b"") -> tuple[bytes, bytes]:
    """The start of a gzip stream of zeros (after `start`), and a block that, repeated,
    continues it: each block inflates to 1 MiB, so a bomb of any size costs the sender nothing
    to make. (The trailer never comes: a reader that stops at its limit never needs it.)"""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(MIB)
    head = c.compress(start + zeros[len(start):]) + c.flush(zlib.Z_SYNC_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_SYNC_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_SYNC_FLUSH) == block
    return head, block


class FaultUpstream:
    def __init__(self, elfs: ElfSet) -> None:
        self.elfs = elfs
        self.by_id = {e.build_id: e for e in (elfs.prog, elfs.other, elfs.big)}
        self.requests: collections.Counter[str] = collections.Counter()
        # (mode, build ID, kind) of every request, to tell which file was asked twice.
        self.asked: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []  # raw request paths, as they arrived
        self.last_modified: str | None = None  # sent as Last-Modified where set
        self.set_cookie = ""  # sent as Set-Cookie with every answer where set
        self.first_byte_delay = 5.0
        self.chunk_size = 1024 * 1024
        self.chunk_delay = 0.05
        self.flaky_failures = 1
        self.retry_after = "120"  # what the busy mode's 429 says
        self.gate_open = False
        self.gate_delay = 0.0  # before the answer of an open gate
        # Where the redirect-to mode sends clients (an absolute URL).
        self.redirect_target = ""
        # The gzip-bomb mode: how many MiB it would inflate to, how many compressed bytes it
        # got to send, and whether it sent them all (False: the reader hung up first).
        self.bomb_mib = 64 * 1024
        self.bomb_sent = 0
        self.bomb_finished: bool | None = None
        # "held": half the body is sent, `held_half_sent` set, then the rest once `release` is;
        # "hold": the answer waits for `release` ("hold500": then fails, "hold404": then is a
        # miss, "hold-wrong": then is another build ID's file). The await points a test
        # controls.
        self.held_half_sent = asyncio.Event()
        self.release = asyncio.Event()
        # "headers-held": the status line and headers are sent, `headers_sent` set, then the
        # body once `release` is: an upstream slow to its first byte after a prompt answer.
        self.headers_sent = asyncio.Event()
        # Set when a slow-body response has sent its last byte, to prove clients got bytes
        # before the upstream was done.
        self.body_done: dict[str, float] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    def url_for(self, mode: str) -> str:
        return f"{self.url}/{mode}"

    def count(self, mode: str) -> int:
        return self.requests[mode]

    async def start(self) -> None:
        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.paths.append(request.raw_path)
            try:
                response = await handler(request)
            except web.HTTPException as e:  # the redirect modes raise theirs
                if self.set_cookie:
                    e.headers["Set-Cookie"] = self.set_cookie
                raise
            if self.set_cookie and not response.prepared:
                response.headers["Set-Cookie"] = self.set_cookie
            return response

        app = web.Application(middlewares=[record])
        app.router.add_get("/{mode}/buildid/{build_id}/{kind}{rest:(?s:.*)}", self.handle)
        self._runner, self.url = await serve_loopback(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _file(self, build_id: str, kind: str, rest: str) -> Path | None:
        elf: Elf | None = self.by_id.get(build_id)
        if elf is None:
            return None
        if kind == "debuginfo":
            return elf.debug
        if kind == "executable":
            return elf.executable
        if kind == "source":
            return next((s for s in elf.sources if str(s) == rest), None)
        if kind == "section":  # an upstream that ignores the name: a lie nobody can check
            return elf.executable
        return None

    async def _gzip_bomb(self, request: web.Request) -> web.StreamResponse:
        # It starts as an ELF file does: only its size can stop it.
        head, block = _gzip_zeros(b"\x7fELF")
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        await response.prepare(request)
        # A reader that hangs up stops this with an error or a cancellation, leaving
        # bomb_finished False: what the tests look for.
        self.bomb_sent, self.bomb_finished = 0, False
        await response.write(head)
        self.bomb_sent += len(head)
        for _ in range(self.bomb_mib - 1):
            await response.write(block)
            self.bomb_sent += len(block)
        self.bomb_finished = True
        await response.write_eof()
        return response

    async def _zeros(self, request: web.Request, start: bytes = b"") -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        if start:
            await response.write(start)
        block = bytes(MIB)
        while True:  # until the reader hangs up, which ends this with an error
            await response.write(block)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        self.requests[mode] += 1
        self.asked[mode, request.match_info["build_id"], request.match_info["kind"]] += 1
        self.headers.append(dict(request.headers))
        bid, kind, rest = (request.match_info[k] for k in ("build_id", "kind", "rest"))
        if mode == "notfound":
            return web.Response(status=404, text="not found")
        if mode == "busy":  # rate limited, and says for how long
            return web.Response(status=429, text="slow down",
                                headers={"Retry-After": self.retry_after})
        if mode == "status500" or (mode == "flaky" and self.requests[mode] <= self.flaky_failures):
            return web.Response(status=500, text="internal error")
        if mode in ("hold", "hold500", "hold404", "hold-wrong"):
            await self.release.wait()
        if mode == "hold500":  # a failure that comes when the test says
            return web.Response(status=500, text="internal error")
        if mode == "hold404":  # a miss that comes when the test says
            return web.Response(status=404, text="not found")
        if mode == "gate" and not self.gate_open:
            return web.Response(status=503, text="try later")
        if mode == "gate":
            await asyncio.sleep(self.gate_delay)
        if mode == "auth" and request.headers.get("Authorization") != "Bearer sesame":
            return web.Response(status=401, text="who are you")
        if mode == "redirect":
            raise web.HTTPFound(f"/ok/buildid/{bid}/{kind}{rest}")
        if mode == "redirect-loop":
            raise web.HTTPFound(request.path)
        if mode == "redirect-file":
            raise web.HTTPFound("file:///etc/passwd")
        if mode == "redirect-to":
            raise web.HTTPFound(self.redirect_target)
        if mode == "slow-hops":  # each hop's headers half a second late, the 21st the file
            hop = int(request.query.get("hop", "0"))
            await asyncio.sleep(HALF)
            if hop < SLOW_HOPS:
                raise web.HTTPFound(request.rel_url.update_query(hop=hop + 1))
            mode = "ok"
        if mode == "html":  # a proxy's or CDN's error page, sent with 200
            return web.Response(text="<html><body>Service maintenance</body></html>",
                                content_type="text/html")
        if mode == "gzip-bomb":
            return await self._gzip_bomb(request)
        if mode == "zeros":  # a 200 of no stated size whose body never ends, and is no file
            return await self._zeros(request)
        if mode == "elf-zeros":  # the same, but it starts as an ELF file does
            return await self._zeros(request, b"\x7fELF")
        if mode == "slow-first-byte":
            await asyncio.sleep(self.first_byte_delay)
        if mode == "late":  # a prompt upstream, but not instant
            await asyncio.sleep(0.3)
        if mode == "hold":
            mode = "ok"
        if mode in ("wrong-bytes", "hold-wrong"):  # hold-wrong: once `release` is set
            bid = self.elfs.other.build_id
        if mode == "wrong-big":
            bid = self.elfs.big.build_id
        path = self._file(bid, kind, rest)
        if path is None:
            return web.Response(status=404, text="not found")
        data = path.read_bytes()
        if mode == "gzip":  # compressed anyway, though symgate asks for identity
            return web.Response(body=gzip.compress(data), headers={
                "Content-Type": "application/octet-stream", "Content-Encoding": "gzip",
                "X-DEBUGINFOD-FILE": path.name})
        if mode == "gzip-cut":  # compressed anyway, the stream cut short at a whole length
            packed = gzip.compress(data)
            return web.Response(body=packed[: len(packed) * 2 // 3], headers={
                "Content-Type": "application/octet-stream", "Content-Encoding": "gzip",
                "X-DEBUGINFOD-FILE": path.name})
        if mode in ("flipped-head", "flipped-tail"):  # the same size and build ID, one byte
            at = len(data) // 4 if mode == "flipped-head" else len(data) * 3 // 4  # wrong
            data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "X-DEBUGINFOD-FILE": path.name})
        if self.last_modified is not None:
            response.headers["Last-Modified"] = self.last_modified
        if mode != "chunked":  # chunked: an upstream that does not say how big the file is
            response.headers["X-DEBUGINFOD-SIZE"] = str(len(data))
            response.content_length = len(data)
        if mode == "huge-size":  # the right bytes, said to be a terabyte
            response.headers["X-DEBUGINFOD-SIZE"] = str(1 << 40)
        await response.prepare(request)
        if mode == "headers-held":
            # aiohttp holds a head back until the first body bytes; this one goes alone.
            writer = response._payload_writer
            assert writer is not None
            writer.send_headers()
            self.headers_sent.set()
            await self.release.wait()
        if mode in ("hang-mid-body", "reset-mid-body", "truncated"):
            await response.write(data[: int(len(data) * HALF)])
            await asyncio.sleep(0.1)
            if mode == "hang-mid-body":
                await asyncio.sleep(3600)
            assert request.transport is not None
            if mode == "reset-mid-body":
                request.transport.abort()
            else:
                request.transport.close()
            return response
        if mode == "held":
            await response.write(data[: len(data) // 2])
            self.held_half_sent.set()
            await self.release.wait()
            await response.write(data[len(data) // 2:])
        elif mode == "slow-body":
            for i in range(0, len(data), self.chunk_size):
                if i:
                    await asyncio.sleep(self.chunk_delay)
                await response.write(data[i:i + self.chunk_size])
            self.body_done[request.path] = asyncio.get_running_loop().time()
        else:
            await response.write(data)
        await response.write_eof()
        return response


class RawUpstream:
    """Answers every GET with the artifact's bytes and the header lines it is given: a raw
    socket server, because HTTP libraries refuse to send the bytes a broken or hostile server
    does send (control characters and non-UTF-8 in header values)."""

    def __init__(self, body: bytes, header_lines: list[bytes]) -> None:
        self.body = body
        self.header_lines = header_lines
        self.requests = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(self.body),
                b"Connection: close", *self.header_lines]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + self.body)
        await writer.drain()
        writer.close()


class FakeNetwork:
    """The OS's name resolution and routing, faked on the running loop (symgate's own modules
    are not touched): a name answers the addresses the test gives it, one per lookup, the
    last repeating; a connection to an address in `routes` goes to that port on 127.0.0.1;
    any other connection off loopback is recorded and refused, so nothing leaves the box."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[str, list[str]] = {}
        self.lookups: collections.Counter[str] = collections.Counter()
        self.routes: set[str] = set()
        self.off_box: list[object] = []
        loop = asyncio.get_running_loop()
        real_getaddrinfo, real_connect = loop.getaddrinfo, loop.sock_connect

        async def getaddrinfo(host: Any, port: Any, **kw: Any) -> Any:
            # A name given as text is asked as its IDNA form, as the socket module does.
            name = str(host).rstrip(".").lower().encode("idna").decode()
            if name not in self.answers:
                return await real_getaddrinfo(host, port, **kw)
            answers = self.answers[name]
            ip = answers[min(self.lookups[name], len(answers) - 1)]
            self.lookups[name] += 1
            if kw.get("family", 0) not in (0, socket.AF_INET):
                return []
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                     (ip, int(port or 0)))]

        async def sock_connect(sock: socket.socket, address: Any) -> None:
            host, port = address[0], address[1]
            if host in self.routes:
                address = ("127.0.0.1", port)
            elif not ipaddress.ip_address(host).is_loopback:
                self.off_box.append(address)
                raise ConnectionRefusedError(f"test network: {host} is off the box")
            await real_connect(sock, address)

        monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
        monkeypatch.setattr(loop, "sock_connect", sock_connect)

    def public_url(self, upstream: FaultUpstream, mode: str) -> str:
        """`upstream`'s URL for `mode` under a public name, up.test, whose address is routed
        to it: an upstream not on loopback, whose redirects the address rule applies to."""
        self.answers["up.test"] = ["93.184.216.80"]
        self.routes.add("93.184.216.80")
        return f"http://up.test:{upstream.url.rsplit(':', 1)[1]}/{mode}"
