"""Worker processes that build symbol tables: CPU-heavy, blocking work kept off the loop."""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from symbolize.symtab import BuildResult, build_symbol_table, warm_up


class BuildPool:
    def __init__(self, workers: int) -> None:
        self._workers = workers
        # forkserver: never fork a process that runs an event loop and threads.
        self._executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))

    def start(self) -> None:
        """Start the workers now rather than on the first cold profile."""
        for _ in range(self._workers):
            self._executor.submit(warm_up)

    async def build(self, source: Path, out: Path, build_id: str) -> BuildResult:
        """Raises symbolize.symtab.NoSymbols or MalformedObject for a file without a table."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, build_symbol_table, source, out,
                                          build_id)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
