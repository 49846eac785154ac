"""A small debuginfod-speaking upstream that misbehaves on purpose.

The first path segment picks the behaviour, so one server covers every fault: an upstream URL
of http://127.0.0.1:PORT/hang-mid-body makes symgate request /hang-mid-body/buildid/...
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from tests.elfs import Elf, ElfSet

HALF = 0.5


class FaultUpstream:
    def __init__(self, elfs: ElfSet) -> None:
        self.elfs = elfs
        self.by_id = {e.build_id: e for e in (elfs.prog, elfs.other, elfs.big)}
        self.requests: collections.Counter[str] = collections.Counter()
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []  # raw request paths, as they arrived
        self.first_byte_delay = 5.0
        self.chunk_size = 1024 * 1024
        self.chunk_delay = 0.05
        self.flaky_failures = 1
        self.gate_open = False
        # mode "hold": answers wait until this is set, the await point a test controls.
        self.release = asyncio.Event()
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
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_get("/{mode}/buildid/{build_id}/{kind}{rest:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

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
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        self.requests[mode] += 1
        self.headers.append(dict(request.headers))
        bid, kind, rest = (request.match_info[k] for k in ("build_id", "kind", "rest"))
        if mode == "notfound":
            return web.Response(status=404, text="not found")
        if mode == "status500" or (mode == "flaky" and self.requests[mode] <= self.flaky_failures):
            return web.Response(status=500, text="internal error")
        if mode == "hold":
            await self.release.wait()
        if mode == "gate" and not self.gate_open:
            return web.Response(status=503, text="try later")
        if mode == "auth" and request.headers.get("Authorization") != "Bearer sesame":
            return web.Response(status=401, text="who are you")
        if mode == "redirect":
            raise web.HTTPFound(f"/ok/buildid/{bid}/{kind}{rest}")
        if mode == "redirect-loop":
            raise web.HTTPFound(request.path)
        if mode == "redirect-file":
            raise web.HTTPFound("file:///etc/passwd")
        if mode == "slow-first-byte":
            await asyncio.sleep(self.first_byte_delay)
        if mode == "late":  # a prompt upstream, but not instant
            await asyncio.sleep(0.3)
        if mode == "hold":
            mode = "ok"
        if mode == "wrong-bytes":
            bid = self.elfs.other.build_id
        if mode == "wrong-big":
            bid = self.elfs.big.build_id
        path = self._file(bid, kind, rest)
        if path is None:
            return web.Response(status=404, text="not found")
        data = path.read_bytes()
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "X-DEBUGINFOD-FILE": path.name})
        if mode != "chunked":  # chunked: an upstream that does not say how big the file is
            response.headers["X-DEBUGINFOD-SIZE"] = str(len(data))
            response.content_length = len(data)
        await response.prepare(request)
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
        if mode == "slow-body":
            for i in range(0, len(data), self.chunk_size):
                if i:
                    await asyncio.sleep(self.chunk_delay)
                await response.write(data[i:i + self.chunk_size])
            self.body_done[request.path] = asyncio.get_running_loop().time()
        else:
            await response.write(data)
        await response.write_eof()
        return response
