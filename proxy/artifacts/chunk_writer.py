"""A download's chunks written to its file in order, one at a time, behind the upstream's reads.

The loop hands each chunk over and goes on reading the upstream: clients are sent the chunks
from memory meanwhile (proxy.artifacts.flight), so a disk slower than the network delays only
the verdict, which needs the whole file, never the bytes before it.

Memory is bounded by a Backlog that every download of the process shares: a download reads on
while its own chunks waiting for the disk are few (`floor`), or while all of them together
stay under the backlog's limit. One download alone may run far ahead of a slow disk (on this
VM, page cache takes 0.5 ms per 256 KiB: a 2 MiB bound paced a cold 4.2 MB fetch by the disk,
25 ms against 17 ms with the whole file allowed ahead); many at once share the same bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

Write = Callable[[bytes, int], Awaitable[None]]


class Backlog:
    """Bytes that every download of the process holds in memory for the disk."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._changed = asyncio.Event()

    def add(self, n: int) -> None:
        self.total += n

    def done(self, n: int) -> None:
        self.total -= n
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class ChunkWriter:
    def __init__(self, write: Write, backlog: Backlog, floor: int) -> None:
        """`write(chunk, offset)` puts one chunk in place (and tells the flight)."""
        self._write = write
        self._backlog = backlog
        self._floor = floor
        self._queue: deque[tuple[bytes, int]] = deque()
        self._queued = 0
        self._task: asyncio.Task[None] | None = None

    async def put(self, chunk: bytes, offset: int) -> None:
        """Queue `chunk`; returns at once unless there is no room (see the module docstring)
        until chunks are written. Raises what an earlier write failed with."""
        self._raise_failure()
        self._queue.append((chunk, offset))
        self._queued += len(chunk)
        self._backlog.add(len(chunk))
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())
        # This download's own writes go on meanwhile: a wait always ends.
        while self._queued > self._floor and self._backlog.total > self._backlog.limit:
            await self._backlog.changed()
            self._raise_failure()

    async def flush(self) -> None:
        """Until every chunk is on disk; raises what a write failed with."""
        if self._task is not None:
            await asyncio.shield(self._task)
            self._task = None

    def abandon(self) -> None:
        """The download failed: what is queued is not written, and leaves the backlog. A
        write under way in a thread ends on its own (on a descriptor of its own, see
        service._write_own)."""
        self._queue.clear()
        self._backlog.done(self._queued)
        self._queued = 0
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
                self._backlog.done(len(chunk))
        finally:
            self._backlog.done(0)  # a put waiting for room learns of the failure
