"""Symbol-table builds in the worker processes: CPU-heavy, blocking work kept off the loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.symbols.workers import WorkerPool
from symbolize.symtab import BuildResult, build_symbol_table


class BuildPool:
    def __init__(self, pool: WorkerPool, workers: int) -> None:
        self.pool = pool
        self._builds = asyncio.Semaphore(workers)  # in the pool at once

    async def build(self, source: Path, out: Path, build_id: str,
                    executable: Path | None = None) -> BuildResult:
        """Raises symbolize.symtab.NoSymbols or MalformedObject for a file without a table,
        proxy.errors.WorkerLost if the worker died. `executable`: see build_symbol_table."""
        async with self._builds:
            return await self.pool.run(build_symbol_table, source, out, build_id, executable)
