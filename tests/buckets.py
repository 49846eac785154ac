"""A real S3 API server on loopback for the bucket tests: moto's standalone server (MinIO is
not installable here), run in a thread of the test process, with one bucket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore.store import S3Store

from proxy.config import StorageConfig
from tests.harness import free_port

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

BUCKET = "symgate-test"
# moto takes any credentials; the server reads them from the standard variables.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "symgate-test", "AWS_SECRET_ACCESS_KEY": "symgate-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    port: int
    server: ThreadedMotoServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Started again after stop() on the same port, the bucket and its objects are still
        there: moto keeps them in the test process. moto imported here, not with the module:
        its import (boto3, botocore) cost every test process 2.6 s of CPU as it collected
        the suite, where only test_bucket's start a server."""
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def make_bucket(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{BUCKET}",
                                                      method="PUT"), timeout=10).close()

    def prefix(self) -> Prefix:
        """A part of the bucket of its own, for one test."""
        return Prefix(self, uuid.uuid4().hex[:12])


@dataclass
class Prefix:
    s3: S3Server
    name: str

    def config(self, **kw: object) -> StorageConfig:
        """Short times, so that outages and takeovers end in a second or two."""
        settings: dict[str, object] = dict(
            url=f"s3://{BUCKET}/{self.name}", endpoint=self.s3.endpoint, region="us-east-1",
            connect_timeout_s=1.0, read_timeout_s=2.0, retry_s=0.5, lease_s=1.0, sync_s=0.3)
        settings.update(kw)
        return StorageConfig(**settings)  # type: ignore[arg-type]

    def toml(self, **kw: object) -> str:
        lines = [f"{k} = {v!r}".replace("'", '"') for k, v in
                 dataclasses.asdict(self.config(**kw)).items() if v not in (0, 0.0)]
        return "[storage]\n" + "\n".join(lines) + "\n"

    def _store(self) -> S3Store:
        return S3Store.from_url(f"s3://{BUCKET}/{self.name}", endpoint=self.s3.endpoint,
                                region="us-east-1", client_options={"allow_http": True},
                                retry_config={"max_retries": 0,
                                              "retry_timeout": timedelta(seconds=2)})

    async def paths(self) -> set[str]:
        """The objects under the prefix, listed, not read."""
        return {meta["path"] async for batch in obstore.list(self._store()) for meta in batch}

    async def objects(self) -> dict[str, bytes]:
        """Every object under the prefix and its bytes (as of the listing, less what was
        deleted before it could be read)."""
        store = self._store()
        found: dict[str, bytes] = {}
        async for batch in obstore.list(store):
            for meta in batch:
                try:
                    got = await obstore.get_async(store, meta["path"])
                    found[meta["path"]] = bytes(await got.bytes_async())
                except FileNotFoundError:
                    pass  # deleted since the listing: an eviction under way
        return found

    async def put(self, path: str, data: bytes) -> None:
        await obstore.put_async(self._store(), path, data)

    async def delete(self, path: str) -> None:
        """As a lifecycle rule or an operator would, behind symgate's back."""
        await obstore.delete_async(self._store(), path)


def s3_server() -> S3Server:
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    s3 = S3Server(free_port())
    s3.start()
    s3.make_bucket()
    return s3


async def wait_gone(s3: S3Server) -> None:
    """Until the stopped server's port refuses connections."""
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", s3.port)
        except OSError:
            return
        writer.close()
        await asyncio.sleep(0.05)


@dataclass
class Fault:
    """What FaultyBucket does to the requests it matches: `method` (or "" for any) and a
    `path` substring; `times` of them (0: every one until removed)."""

    action: str
    method: str = ""
    path: str = ""
    times: int = 0
    hits: int = 0


class FaultyBucket:
    """An S3 endpoint on loopback that forwards to moto, except where a Fault says otherwise:
    a bucket that fails, hangs, cuts, lies or holds a request at a point the test chooses.

    Actions: "500", "503" (SlowDown), "403" (credentials revoked), "404" (NoSuchKey),
    "nosuchbucket", "gateway-404" (a 404 that is not S3's: a proxy or ingress in front of a
    bucket it cannot route to), "reset" (the connection dropped before any answer), "hang" (never
    answered), "hang-body" (moto's status and headers, then nothing), "cut" (half the body,
    then the connection dropped), "flip" (moto's answer with a byte of its body changed),
    "hold" (forwarded once `release` is set; `held` is set when one arrives), "hold-after"
    (forwarded at once, answered once `release` is set). `path` is matched against the
    path and query."""

    def __init__(self, s3: S3Server) -> None:
        self._target = s3.endpoint
        self.faults: list[Fault] = []
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request
        self.answering = 0  # requests whose answer is not yet all sent (or given up)
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self._runner: Any = None
        self._session: Any = None
        self._hanging: list[asyncio.Future[None]] = []
        self.endpoint = ""

    def add(self, action: str, method: str = "", path: str = "", times: int = 0) -> Fault:
        fault = Fault(action, method, path, times)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()
        for hanging in self._hanging:
            hanging.cancel()
        self._hanging.clear()

    async def __aenter__(self) -> FaultyBucket:
        import aiohttp
        from aiohttp import web

        from tests.harness import serve_loopback

        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.endpoint = await serve_loopback(app)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.clear()
        await self._runner.cleanup()
        await self._session.close()

    def _fault(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if (fault.method in ("", method) and fault.path in path
                    and (not fault.times or fault.hits < fault.times)):
                fault.hits += 1
                return fault
        return None

    async def _handle(self, request: Any) -> Any:

        self.seen.append((request.method, request.path))
        self.answering += 1
        try:
            return await self._answer(request)
        finally:
            self.answering -= 1

    async def _answer(self, request: Any) -> Any:
        from aiohttp import web

        fault = self._fault(request.method, request.path_qs)
        action = fault.action if fault is not None else ""
        errors = {"500": (500, "InternalError"), "503": (503, "SlowDown"),
                  "403": (403, "AccessDenied"), "404": (404, "NoSuchKey"),
                  "nosuchbucket": (404, "NoSuchBucket")}
        if action in errors:
            status, code = errors[action]
            return web.Response(status=status, content_type="application/xml", text=(
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{code}</Message></Error>"))
        if action == "gateway-404":
            return web.Response(status=404, content_type="text/html",
                                text="<html><body><h1>404 Not Found</h1></body></html>")
        if action in ("reset", "hang"):
            if action == "hang":
                await self._hang()
            request.transport.abort()
            raise asyncio.CancelledError
        if action == "hold":
            self.held.set()
            await self.release.wait()
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with self._session.request(request.method, self._target + request.raw_path,
                                         headers=headers, data=body) as r:
            data = await r.read()
            if action == "flip" and data:
                flipped = bytearray(data)
                flipped[len(flipped) // 2] ^= 0xFF
                data = bytes(flipped)
            if action == "short" and r.status == 200:
                data = data[:len(data) // 2]
            if action == "long" and r.status == 200:
                data += bytes(len(data))
            response = web.StreamResponse(status=r.status, headers={
                k: v for k, v in r.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                     "content-encoding", "server", "date")})
            response.content_length = len(data)
            await response.prepare(request)
            if action == "hold-after":
                self.held.set()
                await self.release.wait()
            if action == "hang-body":
                await self._hang()
            if action == "cut":
                await response.write(data[:len(data) // 2])
                request.transport.abort()
                raise asyncio.CancelledError
            await response.write(data)
            await response.write_eof()
            return response

    async def _hang(self) -> None:
        hanging = asyncio.get_running_loop().create_future()
        self._hanging.append(hanging)
        with contextlib.suppress(asyncio.CancelledError):
            await hanging
