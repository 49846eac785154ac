"""A real S3 API server on loopback for the bucket tests: moto's standalone server (MinIO is
not installable here), run in a thread of the test process, with one bucket."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import timedelta

import obstore
from moto.server import ThreadedMotoServer
from obstore.store import S3Store

from proxy.config import StorageConfig
from tests.harness import free_port

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
        there: moto keeps them in the test process."""
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
