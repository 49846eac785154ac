"""A download's chunks written to its file in order, one at a time, behind the upstream's reads.

The loop hands each chunk over and goes on reading the upstream: clients are sent the chunks
from memory meanwhile (proxy.artifacts.flight), so a disk slower than the network delays only
the verdict, which needs the whole file, never the bytes before it. Memory is bounded: the
reader waits once `limit` bytes are not yet on disk.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

Write = Callable[[bytes, int], Awaitable[None]]


class ChunkWriter:
    def __init__(self, write: Write, limit: int) -> None:
        """`write(chunk, offset)` puts one chunk in place (and tells the flight)."""
        self._write = write
        self._limit = limit
        self._queue: deque[tuple[bytes, int]] = deque()
        self._queued = 0
        self._task: asyncio.Task[None] | None = None
        self._room = asyncio.Event()

    async def put(self, chunk: bytes, offset: int) -> None:
        """Queue `chunk`; returns at once unless `limit` bytes wait for the disk already.
        Raises what an earlier write failed with."""
        self._raise_failure()
        self._queue.append((chunk, offset))
        self._queued += len(chunk)
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())
        while self._queued > self._limit:
            self._room.clear()
            await self._room.wait()
            self._raise_failure()

    async def flush(self) -> None:
        """Until every chunk is on disk; raises what a write failed with."""
        if self._task is not None:
            await asyncio.shield(self._task)
            self._task = None

    def abandon(self) -> None:
        """The download failed: what is queued is not written. A write under way in a thread
        ends on its own (on a descriptor of its own, see service._write_own)."""
        self._queue.clear()
        if self._task is not None:
            if self._task.done() and not self._task.cancelled():
                self._task.exception()  # told already, as the download's failure or after it
            self._task.cancel()

    def _raise_failure(self) -> None:
        if self._task is not None and self._task.done():
            task, self._task = self._task, None
            task.result()

    async def _drain(self) -> None:
        try:
            while self._queue:
                chunk, offset = self._queue[0]
                await self._write(chunk, offset)
                self._queue.popleft()
                self._queued -= len(chunk)
                self._room.set()
        finally:
            self._room.set()  # a put waiting for room learns of the failure
