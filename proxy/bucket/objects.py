"""The bucket's objects through obstore: streamed both ways, with flat memory.

obstore (object_store's Rust client) is imported only when [storage] is set: a single node
never pays for it. Every failure to reach or use the bucket is one exception, BucketDown; the
bucket then counts as down for `retry_s`, so that a dead bucket costs one miss a timeout, not
every miss, and /healthz says so (Health's BUCKET) until a request succeeds again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from proxy.config import StorageConfig
from proxy.health import BUCKET, Health
from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)
CHUNK = 256 * 1024
# Read from the file for an upload; obstore gathers them into parts of 5 MiB.
PUT_CHUNK = 1024 * 1024
# A file up to this size is written by one PUT, not as a multipart upload: one request, not
# three, and one cut short (a server stopping mid-upload) leaves nothing in the bucket, where
# an unfinished multipart upload stays, unseen and billed, until a lifecycle rule aborts it.
# At most this is held in memory.
ONE_PUT = 5 * 1024 * 1024
# Objects a listing page holds: S3's own most.
LIST_PAGE = 1000
# What probe() asks for: no object is ever written under it (object paths are kinds' names).
PROBE = ".symgate-probe"


class BucketDown(Exception):
    """The bucket could not be reached, or failed a request."""


class WrongCopy(Exception):
    """An object whose bytes are not those its catalogue row says were written there."""


class Bucket:
    def __init__(self, config: StorageConfig, metrics: ProxyMetrics, health: Health) -> None:
        import obstore
        from obstore.store import S3Store

        self._obstore = obstore
        self._config = config
        self._metrics = metrics
        self._health = health
        options: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=config.connect_timeout_s),
            # Whole requests may be long (a GiB debug file); stalls are cut by read_timeout_s.
            "timeout": timedelta(hours=1),
            "allow_http": config.endpoint.startswith("http://"),
        }
        aws: dict[str, Any] = {}
        if config.endpoint:
            aws["endpoint"] = config.endpoint
        if config.region:
            aws["region"] = config.region
        self._store = S3Store.from_url(
            config.url, client_options=options, config=aws or None,  # type: ignore[arg-type]
            retry_config={"max_retries": 1,
                          "retry_timeout": timedelta(seconds=config.read_timeout_s)})
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        """False for retry_s after a failure."""
        return time.monotonic() >= self._down_until

    @property
    def failing(self) -> bool:
        """Whether the last request failed: until one succeeds (see probe())."""
        return self._health.get(BUCKET) is not None

    def _failed(self, op: str, error: BaseException) -> BucketDown:
        self._metrics.bucket_requests.labels(op, "error").inc()
        if self.available:
            log.warning("the shared bucket failed a %s (%s); not asked again for %.0f s",
                        op, _first_line(error), self._config.retry_s)
        self._down_until = time.monotonic() + self._config.retry_s
        self._health.fail(BUCKET, f"a {op} failed: {_first_line(error)}")
        return BucketDown(f"{op}: {_first_line(error)}")

    def _ok(self, op: str, outcome: str = "ok") -> None:
        self._metrics.bucket_requests.labels(op, outcome).inc()
        if self.failing:
            log.info("the shared bucket answers again")
        self._down_until = 0.0
        self._health.ok(BUCKET)

    async def probe(self) -> None:
        """Ask the bucket for an object that is never written: its 404 says the bucket
        answers. For a bucket that failed, while no request of a client's asks it (a quiet
        replica would say `degraded` for ever after a blip). Raises BucketDown."""
        await self.open(PROBE)

    async def open(self, path: str) -> ObjectStream | None:
        """The object's bytes as they come; None when there is no such object. The iterator
        raises BucketDown if the bucket stops sending for read_timeout_s or fails."""
        try:
            got = await asyncio.wait_for(self._obstore.get_async(self._store, path),
                                         self._config.read_timeout_s)
        except FileNotFoundError as e:
            if not _no_object(e):
                raise self._failed("get", e) from e
            self._ok("get", "not_found")
            return None
        except (self._obstore.exceptions.BaseError, OSError, TimeoutError) as e:
            raise self._failed("get", e) from e
        self._ok("get")
        return ObjectStream(got.stream(min_chunk_size=CHUNK), self)

    async def next_chunk(self, stream: Any) -> bytes:
        """The next chunk of an object being read (ObjectStream); StopAsyncIteration at its
        end, BucketDown when the bucket fails or sends nothing for read_timeout_s."""
        try:
            return bytes(await asyncio.wait_for(anext(stream), self._config.read_timeout_s))
        except (self._obstore.exceptions.BaseError, OSError, TimeoutError) as e:
            raise self._failed("get", e) from e

    async def put_file(self, path: str, file: Path) -> None:
        """Write the object from a file, whole or not at all: S3 shows an object (or the
        completed multipart upload) only once every byte is in. A bucket that takes no bytes
        for read_timeout_s counts as down: the upload holds the key's lease, which other
        replicas wait on."""
        whole = file.stat().st_size <= ONE_PUT  # an OSError: this disk's, as below
        loop = asyncio.get_running_loop()
        last_taken = loop.time()
        local: list[OSError] = []

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal last_taken
            try:
                with file.open("rb") as f:
                    while data := await asyncio.to_thread(f.read, PUT_CHUNK):
                        last_taken = loop.time()
                        yield data
            except OSError as e:
                local.append(e)
                raise

        put = asyncio.ensure_future(self._obstore.put_async(self._store, path, chunks(),
                                                            use_multipart=not whole))
        try:
            while not put.done():
                await asyncio.wait([put], timeout=self._config.read_timeout_s)
                if not put.done() and loop.time() - last_taken > self._config.read_timeout_s:
                    raise TimeoutError(f"no byte taken for {self._config.read_timeout_s:g} s")
            put.result()
        except (self._obstore.exceptions.BaseError, OSError, TimeoutError) as e:
            if local:
                # This disk's file (a table rebuilt or dropped meanwhile), not the bucket:
                # taken for the bucket's failure, it went unasked for retry_s, and an upload
                # published in that time reached no other replica.
                raise local[0] from e
            raise self._failed("put", e) from e
        finally:
            put.cancel()
        self._ok("put")

    async def get_file(self, path: str, dest: Path, size: int, sha256: str) -> bool:
        """Download the object to `dest`, which appears only once whole and found to be the
        `size` bytes of digest `sha256` that were written there (WrongCopy if not); False
        when there is no such object."""
        chunks = await self.open(path)
        if chunks is None:
            return False
        # A name of this call's own: two requests of this process may copy one table at once
        # (they shared `.<name>.<pid>.part`, and the second found it renamed under it, read
        # that as the bucket failing and built the table again). Named as a build's temp
        # (`<build ID>.<...>.<pid>.tmp`), so that one left by a killed process is cleared at
        # the next start as theirs are: a `.part` stayed for good.
        temp = dest.with_name(f"{dest.stem}.bucket-{uuid.uuid4().hex[:8]}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        got = 0
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with temp.open("wb") as f:
                async for chunk in chunks:
                    got += len(chunk)
                    if got > size:  # not read to its end: it cannot be the copy
                        break
                    digest.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
            if got != size or digest.hexdigest() != sha256:
                raise WrongCopy(f"{path} is not the {size} bytes written there")
            temp.replace(dest)
        finally:
            chunks.close()
            temp.unlink(missing_ok=True)
        return True

    async def listing(self) -> AsyncIterator[tuple[str, datetime]]:
        """Every object's path (under the configured prefix) and when it was written, a page
        at a time. Raises BucketDown if the bucket fails, or takes read_timeout_s for a page."""
        pages = self._obstore.list(self._store, chunk_size=LIST_PAGE)
        while True:
            try:
                page = await asyncio.wait_for(anext(pages), self._config.read_timeout_s)
            except StopAsyncIteration:
                break
            # A listing has no object to miss: even the bucket's own 404 (FileNotFoundError,
            # an OSError) is its failure.
            except (self._obstore.exceptions.BaseError, OSError, TimeoutError) as e:
                raise self._failed("list", e) from e
            for meta in page:
                yield meta["path"], meta["last_modified"]
        self._ok("list")

    async def delete(self, paths: list[str]) -> None:
        """Raises BucketDown if the bucket fails, or takes read_timeout_s to answer: a DELETE
        of an upload, a purge and the eviction wait on it (the first under the replica's
        upload lock), and the client library's own limit is an hour."""
        if not paths:
            return
        try:
            await asyncio.wait_for(self._obstore.delete_async(self._store, paths),
                                   self._config.read_timeout_s)
        except FileNotFoundError as e:
            if not _no_object(e):
                raise self._failed("delete", e) from e
        except (self._obstore.exceptions.BaseError, OSError, TimeoutError) as e:
            raise self._failed("delete", e) from e
        self._ok("delete")


def _no_object(error: FileNotFoundError) -> bool:
    """Whether a 404 is S3's word that the object is missing, not the bucket's own (deleted,
    or a wrong name in [storage]: NoSuchBucket), nor another server's (a proxy or ingress in
    front of the bucket that cannot route to it, an endpoint that is no S3): S3 says which in
    the error's body, which obstore quotes. Taken for an object's, every read of the
    catalogue's objects dropped their rows, and /healthz said ok."""
    return "<Code>NoSuchKey</Code>" in str(error)


def _first_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0][:300]


class ObjectStream:
    """An object's bytes as the bucket sends them. Closed, its connection goes at once: a
    stream left when its reader stopped early (a copy longer than its row) held the
    connection, and the bucket's side blocked writing into it, until the garbage collector
    came round, minutes later at times."""

    def __init__(self, stream: Any, bucket: Bucket) -> None:
        self._stream: Any = stream
        self._bucket = bucket

    def __aiter__(self) -> ObjectStream:
        return self

    async def __anext__(self) -> bytes:
        if self._stream is None:
            raise StopAsyncIteration
        try:
            return await self._bucket.next_chunk(self._stream)
        except BaseException:  # its end, a failure, or a cancel: nothing more is read
            self.close()
            raise

    def close(self) -> None:
        self._stream = None  # obstore's stream, and its connection, are dropped with it
