"""Worker processes: the CPU-bound work kept off the event loop, and what keeps them in check.

Every worker dies with the server, however the server dies: its parent is the forkserver, not
the server, so it watches the server's pid itself (a pidfd), and takes the parent-death signal
for the forkserver. Once the workers are gone, the forkserver and the resource tracker see
their pipes close and exit too: a SIGKILLed server leaves nothing behind.

A worker that dies (the OOM killer, a crash in native code) breaks its ProcessPoolExecutor for
good: the pool is replaced, and the work that was in it ends in WorkerLost (a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any, TypeVar

from proxy.config import SymbolizeConfig
from proxy.errors import Overloaded, WorkerLost
from symbolize import worker
from symbolize.worker import Answer, Finished, Limits

log = logging.getLogger(__name__)
T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


def _die_with(server_pid: int) -> None:
    """Kill this process when the server or the forkserver (its parent) exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(server_pid)
    except ProcessLookupError:  # gone before this worker started
        os._exit(1)
    except OSError:  # no pidfd (Linux before 5.3): look every second instead
        threading.Thread(target=_poll, args=(server_pid,), daemon=True).start()
        return
    threading.Thread(target=_watch, args=(pidfd,), daemon=True).start()


def _watch(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)


def _poll(pid: int) -> None:
    while True:
        time.sleep(1)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)


# Workers yield the CPU to the server's event loop: on a machine whose cores they fill, a
# /buildid hit still gets its share at once (CFS weight 1024 against 335).
_NICENESS = 5


def _init(server_pid: int, init: Callable[..., None] | None, args: tuple[Any, ...]) -> None:
    _die_with(server_pid)
    with contextlib.suppress(OSError):
        os.nice(_NICENESS)
    if init is not None:
        init(*args)


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
        # forkserver: never fork a process that runs an event loop and threads. The forkserver
        # imports numpy, protobuf and symbolic once, so a new worker is a fork, ready at once,
        # not a second of imports on the first profile (or after a worker died).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["proxy.symbols.workers", "symbolize.symtab"])
        return ProcessPoolExecutor(
            max_workers=self.workers, mp_context=context,
            initializer=_init, initargs=(os.getpid(), self._init, self._args))

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
