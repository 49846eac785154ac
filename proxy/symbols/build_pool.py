"""Worker processes that build symbol tables: CPU-heavy, blocking work kept off the loop."""

from __future__ import annotations

from pathlib import Path

from proxy.symbols.workers import WorkerPool
from symbolize.symtab import BuildResult, build_symbol_table, warm_up


class BuildPool:
    def __init__(self, workers: int) -> None:
        self.pool = WorkerPool(workers, "symbol-table build")

    def start(self) -> None:
        """Start the workers now rather than on the first cold profile."""
        for _ in range(self.pool.workers):
            self.pool.submit(warm_up)

    async def build(self, source: Path, out: Path, build_id: str) -> BuildResult:
        """Raises symbolize.symtab.NoSymbols or MalformedObject for a file without a table,
        proxy.errors.WorkerLost if the worker died."""
        return await self.pool.run(build_symbol_table, source, out, build_id)

    def close(self) -> None:
        self.pool.close()
