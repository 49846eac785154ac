"""Worker processes that build symbol tables: CPU-heavy, blocking work kept off the loop."""

from __future__ import annotations

from pathlib import Path

from proxy.symbols.workers import WorkerPool
from symbolize.symtab import BuildResult, build_symbol_table


class BuildPool:
    def __init__(self, workers: int, idle_s: float) -> None:
        self.pool = WorkerPool(workers, "symbol-table build", idle_s=idle_s)

    async def build(self, source: Path, out: Path, build_id: str) -> BuildResult:
        """Raises symbolize.symtab.NoSymbols or MalformedObject for a file without a table,
        proxy.errors.WorkerLost if the worker died."""
        return await self.pool.run(build_symbol_table, source, out, build_id)

    def close(self) -> None:
        self.pool.close()
