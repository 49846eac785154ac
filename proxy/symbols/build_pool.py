"""Symbol-table builds in the worker processes: CPU-heavy, blocking work kept off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path

from proxy.symbols import isolated_build
from proxy.symbols.workers import WorkerPool
from symbolize.symtab import BuildResult

# A build that has waited this long goes next whatever its size: a steady stream of bigger
# ones must not hold a small one back for good (with its cross-process build lock).
PATIENCE_S = 10.0


class BuildPool:
    def __init__(self, pool: WorkerPool, workers: int, patience_s: float = PATIENCE_S, *,
                 timeout_s: float = 0.0, memory_bytes: int = 0) -> None:
        self.pool = pool
        self._limits = (timeout_s, memory_bytes)  # of each build: isolated_build.py
        self._free = workers  # slots in the pool not taken
        self._patience_s = patience_s
        # Builds waiting for a slot, the biggest source first:
        # (-size, arrival, when it came, wake-up).
        self._waiting: list[tuple[int, int, float, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    async def build(self, source: Path, out: Path, build_id: str,
                    executable: Path | None = None,
                    supplement: Path | None = None) -> BuildResult:
        """Raises symbolize.symtab.NoSymbols or MalformedObject for a file without a table
        (or whose build crashed, hung or ran out of memory), proxy.errors.WorkerLost if the
        worker died. `executable`, `supplement`: see build_symbol_table."""
        async with self._slot(_size(source)):
            return await self.pool.run(isolated_build.build, *self._limits, source, out,
                                       build_id, executable, supplement)

    @contextlib.asynccontextmanager
    async def _slot(self, size: int) -> AsyncIterator[None]:
        """A slot in the pool, given to the biggest waiting build first: a cold profile's
        builds all arrive at once, and the profile is done when its biggest one is (libc's
        takes 0.25 s, a small program's 3 ms), so that one must not queue behind the others."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
        else:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()
            entry = (-size, next(self._arrivals), loop.time(), woken)
            heapq.heappush(self._waiting, entry)
            try:
                await woken
            except asyncio.CancelledError:
                if woken.done() and not woken.cancelled():
                    self._release()  # the slot was handed over as this build gave up
                elif entry in self._waiting:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            entry = self._next()
            woken = entry[3]
            if not woken.done():
                woken.set_result(None)  # the slot passes straight to it
                return
        self._free += 1

    def _next(self) -> tuple[int, int, float, asyncio.Future[None]]:
        """The biggest waiting build, or the oldest once it has waited past patience."""
        oldest = min(self._waiting, key=lambda e: e[1])
        if asyncio.get_running_loop().time() - oldest[2] >= self._patience_s:
            self._waiting.remove(oldest)
            heapq.heapify(self._waiting)
            return oldest
        return heapq.heappop(self._waiting)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
