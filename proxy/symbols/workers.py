"""Worker processes: the CPU-bound work kept off the event loop, and what keeps them in check.

Every worker dies with the server, however the server dies (worker_process.py). A worker that
dies (the OOM killer, a crash in native code) breaks its ProcessPoolExecutor for good: the
pool is replaced, and the work that was in it ends in WorkerLost (a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any, TypeVar

from proxy.config import SymbolizeConfig
from proxy.errors import Overloaded, WorkerLost
from proxy.symbols import worker_process
from symbolize import worker
from symbolize.worker import Answer, Finished, Limits

log = logging.getLogger(__name__)
T = TypeVar("T")
# Loaded once by the forkserver, whose forks the workers are: see that module.
_PRELOAD = "proxy.symbols.forkserver_preload"


class WorkerPool:
    """A pool of worker processes that survives the death of one and dies with the server."""

    def __init__(self, workers: int, name: str, init: Callable[..., None] | None = None,
                 args: tuple[Any, ...] = ()) -> None:
        self.workers = workers
        self._name = name
        self._init = init
        self._args = args
        self._executor = self._new()
        self.in_flight = 0  # calls submitted and not yet answered

    def _new(self) -> ProcessPoolExecutor:
        # forkserver: never fork a process that runs an event loop and threads.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([_PRELOAD])
        return ProcessPoolExecutor(
            max_workers=self.workers, mp_context=context,
            initializer=worker_process.init, initargs=(os.getpid(), self._init, self._args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (warming up)."""
        self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        executor = self._executor
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except BrokenProcessPool as e:
            if self._executor is executor:  # the first to notice replaces it
                log.error("a %s worker process died; starting new ones", self._name)
                executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._new()
            raise WorkerLost(f"a {self._name} worker process died; try again") from e
        finally:
            self.in_flight -= 1

    def pids(self) -> list[int]:
        """The live workers' pids (for tests and the status of the pool)."""
        processes = getattr(self._executor, "_processes", None) or {}
        return list(processes)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class SymbolizeWorkers:
    """symbolize.pipeline.Work in worker processes, behind an admission gate: at most
    `max_concurrent` profiles in work and `max_waiting` waiting; past that, Overloaded (429)
    at once, before the body is read."""

    def __init__(self, cfg: SymbolizeConfig) -> None:
        self.pool = WorkerPool(cfg.workers, "symbolize", worker.init_worker, (cfg.open_tables,))
        self._max_concurrent = cfg.max_concurrent
        self._admissible = cfg.max_concurrent + cfg.max_waiting
        self._admitted = 0
        self._slots = asyncio.Semaphore(cfg.max_concurrent)

    def start(self) -> None:
        for _ in range(self.pool.workers):
            self.pool.submit(worker.warm_up)

    @property
    def admitted_count(self) -> int:
        """Profiles in work or waiting for a slot."""
        return self._admitted

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[Callable[[], AsyncContextManager[None]]]:
        """A place among the profiles in work or waiting (Overloaded past them), and what
        takes a worker slot once the profile's body is in: an upload that trickles in must
        hold a waiting place, never a slot."""
        if self._admitted >= self._admissible:
            raise Overloaded(f"symgate is symbolizing {self._max_concurrent} profiles and has "
                             "as many waiting as it may: try again later")
        self._admitted += 1
        try:
            yield lambda: self._slots
        finally:
            self._admitted -= 1

    async def scan(self, body: bytes, limits: Limits) -> dict[str, bool]:
        return await self.pool.run(worker.scan, body, limits)

    async def finish(self, body: bytes, limits: Limits,
                     answers: dict[str, Answer]) -> Finished:
        return await self.pool.run(worker.finish, body, limits, answers)

    def close(self) -> None:
        self.pool.close()
