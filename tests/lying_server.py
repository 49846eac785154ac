"""A server that is not the symgate an operator meant: the CLI clients' --server, pointed at
another service, a proxy's error page, a server that dies or hangs. The first path segment
names what it does (`{url}/{mode}` is given as --server); every request gets the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from tests.harness import serve_loopback

HTML = b"<!DOCTYPE html>\n<html>\n<head><title>Sign in</title></head>\n<body>\n</body></html>\n"
# What a symgate's answer carries (proxy/web/symbolize.py), claimed by a server that lies.
SYMGATE = {"X-Symgate-Symbolize": "done", "X-DEBUGINFOD-SIZE": "4"}

MODES = ["html", "json", "no-content-type", "not-gzip", "not-pprof", "301", "302", "401",
         "404", "413", "429", "429-retry-after", "500", "503", "endless", "trickle", "reset",
         "silent"]
# Those a client can only end by its own clock.
SLOW = {"trickle", "silent"}


class LyingServer:
    def __init__(self) -> None:
        self.url = ""
        self.asked: list[tuple[str, str, str]] = []  # method, path, Authorization

    async def handle(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        self.asked.append((request.method, request.path, request.headers.get("Authorization",
                                                                               "")))
        if mode != "silent":
            await request.read()
        if mode == "html":
            return web.Response(body=HTML, content_type="text/html")
        if mode == "json":
            return web.Response(text='{"status": "ok", "items": []}',
                                content_type="application/json")
        if mode == "no-content-type":
            response = web.Response(body=b"ok: nothing here\n")
            response.headers.popall("Content-Type", None)
            return response
        if mode == "not-gzip":
            return web.Response(body=b"\x1f\x8b\x08\x00 not a gzip at all", headers=SYMGATE,
                                content_type="application/octet-stream")
        if mode == "not-pprof":
            return web.Response(body=b"\x0a\xff\xff\xff\xff\xff not a profile", headers=SYMGATE,
                                content_type="application/octet-stream")
        if mode in ("301", "302"):
            # Elsewhere: a page that answers 200 to anything, as a login page does.
            raise (web.HTTPMovedPermanently if mode == "301" else web.HTTPFound)(
                f"{self.url}/html/login")
        if mode.isdigit() or mode == "429-retry-after":
            status = int(mode[:3])
            headers = {"Retry-After": "120"} if mode == "429-retry-after" else {}
            return web.Response(status=status, body=HTML, content_type="text/html",
                                headers=headers)
        response = web.StreamResponse(headers=SYMGATE)
        if mode == "reset":
            response.content_length = 1 << 20
            await response.prepare(request)
            await response.write(b"\x1f\x8b\x08\x00" + b"\0" * 1000)
            assert request.transport is not None
            request.transport.abort()
            return response
        if mode == "silent":
            await asyncio.Event().wait()  # accepted, never answered
        await response.prepare(request)
        while True:  # endless: as fast as it goes; trickle: a byte now and then
            await response.write(b"\0" * (65536 if mode == "endless" else 1))
            if mode == "trickle":
                await asyncio.sleep(0.2)


@asynccontextmanager
async def lying_server() -> AsyncIterator[LyingServer]:
    server = LyingServer()
    app = web.Application()
    app.router.add_route("*", "/{mode}/{rest:.*}", server.handle)
    runner, server.url = await serve_loopback(app)
    try:
        yield server
    finally:
        await runner.cleanup()
