"""Worker processes: the CPU-bound work kept off the event loop, and what keeps them in check.

One set of processes does both kinds of work, symbol-table builds and profiles, so that a
profile whose table is built on the way is scanned, built for and rewritten in one worker,
not two; each kind keeps its own limit (build_workers, workers), and there are as many
processes as both together, so neither waits for the other's. A profile's samples are checked
in processes of their own (`SymbolizeWorkers.checks`), beside its resolution and rewrite.

A worker starts with the server, so that the first profile does not wait for one, and workers
start with the job that needs one after that; they exit after `worker_idle_s` without a job
(with multiprocessing's helper processes: executors.py): an idle server costs no more than its
own process. Every worker dies with the server, however the server dies (worker_process.py).

A worker that dies (the OOM killer, a crash in native code) breaks its ProcessPoolExecutor for
good: the pool is retired, the work that was in it, of either kind, ends in WorkerLost (a 503;
for a build, that build ID's outcome is `internal` and it is built again next time), and the
next job starts new workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any, TypeVar

from proxy.config import SymbolizeConfig
from proxy.errors import Overloaded, WorkerLost
from proxy.symbols import executors, forked_helpers, shared_bodies, worker_process
from proxy.symbols.shared_bodies import SharedBytes, Unshareable
from symbolize import worker
from symbolize.worker import Answer, Finished, Limits, Scanned

log = logging.getLogger(__name__)
T = TypeVar("T")
# How often a profile waiting for a worker slot looks whether its client is still there.
_GONE_POLL_S = 0.5


class WorkerPool:
    """Up to `workers` worker processes, started with the server (start_soon) and on demand,
    exited when idle, replaced when one dies, and dying with the server. 0 `idle_s`: they
    never exit for idleness."""

    def __init__(self, workers: int, *, idle_s: float, init: Callable[..., None] | None = None,
                 args: tuple[Any, ...] = ()) -> None:
        self.workers = workers
        self._idle_s = idle_s
        self._initargs = (os.getpid(), init, args)
        # Set by the thread that starts the pool too: whatever the order of a start and a close
        # (even one that the loop's end leaves unawaited), no pool is left running unowned.
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._starting: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._closed = False
        self._retiring: list[Future[None]] = []  # pools shutting down, until their workers exit
        self._warming: asyncio.Future[None] | None = None
        self.in_flight = 0  # calls made and not yet answered, waiting for a start included

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            for _attempt in range(2):
                executor = await self._running()
                try:
                    job = asyncio.get_running_loop().run_in_executor(
                        executor, worker_process.run, fn, *args)
                except BrokenProcessPool:
                    # Broken before this job (a worker died while idle): the job never ran,
                    # and new workers take it.
                    self._retire_broken(executor)
                    continue
                try:
                    return await job
                except BrokenProcessPool as e:
                    self._retire_broken(executor)
                    raise WorkerLost("a worker process died; try again") from e
            raise WorkerLost("worker processes die as they start; try again")
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._idle_s and not self._closed:
                self._idle = asyncio.get_running_loop().call_later(self._idle_s, self._retire)

    def _retire_broken(self, executor: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not executor:  # the first to notice retires it
                return
            self._executor = None
        log.error("a worker process died; the next job starts new ones")
        self._retire_pool(executor, cancel=True)

    async def start(self) -> None:
        """A worker started now rather than by the first job (for tests: its pid)."""
        await self.run(worker_process.ready)

    def start_soon(self) -> None:
        """Start a worker in the background now, so that the first profile after a start waits
        for no start (the forkserver's imports took 3-4.7 s of it); like any job's, it exits
        after `idle_s` if no job comes. Not where the supervisor's forkserver is shared
        (forked_helpers.py): a worker is a fork of it away, and N serving processes would
        otherwise each hold one from the start (kept for good, with 0 `idle_s`, all the same)."""
        if self._warming is not None or (self._idle_s and forked_helpers.inherited()):
            return
        self._warming = asyncio.ensure_future(self.start())

        def done(warming: asyncio.Future[None]) -> None:
            if not warming.cancelled() and (error := warming.exception()) is not None:
                log.warning("worker processes did not start: %s", error)

        self._warming.add_done_callback(done)

    async def _running(self) -> ProcessPoolExecutor:
        while (executor := self._executor) is None:
            if self._closed:
                raise WorkerLost("the worker processes are shutting down")
            if self._starting is None:
                # In a thread: the first start waits for the forkserver's imports. A plain
                # future, not a task: the loop's end must not cancel it and lose the pool.
                self._starting = asyncio.get_running_loop().run_in_executor(None, self._start)
                self._starting.add_done_callback(self._started)
            try:
                await asyncio.shield(self._starting)
            except Exception as e:
                raise WorkerLost(f"the worker processes could not start: {e}") from e
        return executor

    def _start(self) -> None:
        """In a thread."""
        executor = executors.start(self.workers, worker_process.init, self._initargs)
        with self._lock:
            if not self._closed:
                self._executor = executor
                return
        self._retire_pool(executor, cancel=True)
        raise WorkerLost("the worker processes are shutting down")

    def _started(self, starting: asyncio.Future[None]) -> None:
        self._starting = None
        if not starting.cancelled():
            starting.exception()  # retrieved: the callers that wait for it are told

    def _retire(self) -> None:
        self._idle = None
        with self._lock:
            executor = self._executor
            if self.in_flight or executor is None:
                return
            self._executor = None
        log.info("worker processes idle for %g s: they exit until the next job", self._idle_s)
        self._retire_pool(executor)

    def _retire_pool(self, executor: ProcessPoolExecutor, *, cancel: bool = False) -> None:
        retiring = executors.retire(executor, cancel=cancel)
        with self._lock:
            self._retiring = [f for f in self._retiring if not f.done()] + [retiring]

    def pids(self) -> list[int]:
        """The live workers' pids (for tests and the status of the pool)."""
        processes = getattr(self._executor, "_processes", None) or {}
        return list(processes)

    async def close(self) -> None:
        """Stop the workers and wait until they have exited: the jobs in them end first, the
        queued ones are dropped."""
        if self._warming is not None:
            self._warming.cancel()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            self._retire_pool(executor, cancel=True)
        if self._starting is not None:  # its pool is retired as it comes up
            await asyncio.wait([self._starting])
        with self._lock:
            retiring = list(self._retiring)
        await asyncio.gather(*(asyncio.wrap_future(f) for f in retiring))


def worker_pool(cfg: SymbolizeConfig) -> WorkerPool:
    """The one set of worker processes of a server, for builds and profiles alike."""
    return WorkerPool(cfg.build_workers + cfg.workers, idle_s=cfg.worker_idle_s,
                      init=worker.init_worker, args=(cfg.open_tables,))


# What a body may lag behind symbolize.min_body_rate before its place can be taken back: a
# chunk of the slowest link's first second.
_BODY_SLACK = 64 << 10


class Reception:
    """A place held by a profile: how much of its body has come, since when, and whether the
    place was taken back from it (`revoked`) while the body still came."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.received = 0
        self.whole = False  # its body is in: the place is never taken back then
        self.revoked: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def rate(self, now: float) -> float:
        return self.received / max(now - self.since, 1e-6)

    def behind(self, now: float, min_rate: float) -> bool:
        """Still coming, slower than `min_rate` bytes a second (past a slack)."""
        return not self.whole and not self.revoked.done() \
            and self.received + _BODY_SLACK < min_rate * (now - self.since)


class _Places:
    """At most `limit` held at once; past them, Overloaded (429), unless a body still coming
    slower than `min_rate` bytes a second holds one: that place is taken back (its request
    answered 408) for the profile that would be refused. Else a client that trickles bodies
    on `limit` connections, each within the body timeout, kept everyone else at 429."""

    def __init__(self, limit: int, min_rate: float) -> None:
        self.limit = limit
        self.taken = 0
        self._min_rate = min_rate
        self._held: list[Reception] = []

    @contextlib.contextmanager
    def take(self, refusal: str) -> Iterator[Reception]:
        if self.taken >= self.limit and not self._take_back():
            raise Overloaded(refusal)
        self.taken += 1
        held = Reception()
        self._held.append(held)
        try:
            yield held
        finally:
            self.taken -= 1
            self._held.remove(held)

    def _take_back(self) -> bool:
        """Revoke the place of the slowest body behind the floor; whether there was one."""
        if not self._min_rate:
            return False
        now = time.monotonic()
        behind = [r for r in self._held if r.behind(now, self._min_rate)]
        if not behind:
            return False
        slowest = min(behind, key=lambda r: r.rate(now))
        slowest.revoked.set_result(None)
        # Counted as held until its request leaves: briefly one over the limit.
        return True


class SymbolizeWorkers:
    """symbolize.pipeline.Work in worker processes, behind an admission gate: at most
    `max_concurrent` profiles in work and `max_waiting` waiting; past that, Overloaded (429)
    at once, before the body is read."""

    def __init__(self, cfg: SymbolizeConfig, pool: WorkerPool) -> None:
        self.pool = pool
        self._jobs = asyncio.Semaphore(cfg.workers)  # in the pool at once
        # Where samples are checked, beside the resolution and the rewrite: processes of their
        # own, never one that rewrites. In `pool`, a third job per profile turned its order
        # over, and the rewrite of a profile sent again went to a worker that had not numbered
        # its addresses yet: a million locations took 0.75-0.9 s there, 0.45 where they were.
        self.checks = WorkerPool(cfg.workers, idle_s=cfg.worker_idle_s)
        self._max_concurrent = cfg.max_concurrent
        # Profiles in work or waiting for a slot; and, apart, those passed through untouched.
        self._admission = _Places(cfg.max_concurrent + cfg.max_waiting, cfg.min_body_rate)
        self._passes = _Places(cfg.max_concurrent + cfg.max_waiting, cfg.min_body_rate)
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self._queued = 0  # of the admitted, those whose body is in and that wait for a slot
        # Until a worker could not open a memory file of this process (shared_bodies.py).
        self.sharing = hasattr(os, "memfd_create")

    @property
    def admitted_count(self) -> int:
        """Profiles in work or waiting for a slot."""
        return self._admission.taken

    @property
    def queued_count(self) -> int:
        """Profiles whose body is in, waiting for a slot."""
        return self._queued

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[tuple[Reception, Callable[
            [Callable[[], bool]], AsyncContextManager[None]]]]:
        """A place among the profiles in work or waiting (Overloaded past them), to receive
        the body in, and what takes a worker slot once the profile's body is in (given what
        tells that its client has left): an upload that trickles in must hold a waiting
        place, never a slot."""
        with self._admission.take(f"symgate is symbolizing {self._max_concurrent} profiles "
                                  "and has as many waiting as it may: try again later") as held:
            yield held, self._slot

    @property
    def passing_count(self) -> int:
        """Profiles being passed through untouched (symbolization off for them)."""
        return self._passes.taken

    @contextlib.asynccontextmanager
    async def passing(self) -> AsyncIterator[Reception]:
        """A place among the profiles passed through untouched, as many as may be admitted
        (Overloaded past them), apart from those: they need no worker, but each body is held
        whole, inflated, and without a bound a client could send any number at once."""
        with self._passes.take(f"symgate is passing {self._passes.taken} profiles through, "
                               "as many as it may: try again later") as held:
            yield held

    @contextlib.asynccontextmanager
    async def _slot(self, gone: Callable[[], bool]) -> AsyncIterator[None]:
        """A worker slot, waited for while the profile's client is there (`gone` says when
        it has left): aiohttp lets a handler run on after its client hangs up, and a profile
        nobody waits for any more held its waiting place, then a slot and the work, while
        the clients that were there got 429s (a client that gives up on a long queue and
        sends again filled it with its own abandoned profiles)."""
        self._queued += 1
        try:
            await self._acquire_for(gone)
        finally:
            self._queued -= 1
        try:
            yield
        finally:
            self._slots.release()

    async def _acquire_for(self, gone: Callable[[], bool]) -> None:
        if gone():
            raise ConnectionResetError("the client left before its profile was worked on")
        if not self._slots.locked():
            await self._slots.acquire()
            return
        # One acquire, looked in on: cancelling and retrying it would lose its turn.
        acquiring = asyncio.ensure_future(self._slots.acquire())
        try:
            await _watched(acquiring, gone, "waited for a worker slot")
        except BaseException:
            # Given up (the client gone, or the request cancelled): a pending acquire is
            # cancelled, and a slot it got meanwhile is handed on.
            if not acquiring.cancel() and not acquiring.cancelled():
                self._slots.release()
            raise

    @staticmethod
    async def while_there(gone: Callable[[], bool], work: Awaitable[T]) -> T:
        """`work`, given up (ConnectionResetError) once its client has left (`gone`): a
        client that gave up on a cold profile (its timeout shorter than the deadline) held its
        slot until the fetches and builds ended, then had the profile rewritten for nobody,
        while the profiles of the clients still there waited. The fetches and builds go on for
        the next profile (the resolver shares them), as a job in a worker does (`run`)."""
        task = asyncio.ensure_future(work)
        try:
            await _watched(task, gone, "was worked on")
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])  # its steps let go of what they hold first
            if not task.cancelled():
                task.exception()  # retrieved: nobody is left to be told of it

    async def scan(self, body: bytes, limits: Limits) -> Scanned:
        return await self.run(worker.scan, body, limits)

    async def check_samples(self, body: bytes, limits: Limits) -> None:
        await self.checks.run(worker.check_samples, body, limits)

    async def finish(self, body: bytes, limits: Limits,
                     answers: dict[str, Answer]) -> Finished:
        return await self.run(worker.finish, body, limits, answers)

    @contextlib.contextmanager
    def for_request(self) -> Iterator[RequestWork]:
        """The Work of one request: its profile's bytes cross to the workers once, in a
        memory file, not twice through the pipes (shared_bodies.py); freed at the end."""
        work = RequestWork(self)
        try:
            yield work
        finally:
            work.close()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker, in the place of a profile's job, held until the job has
        ended. A caller that gives up on it (its profile refused by the sample check while it
        is rewritten, its request cancelled) cannot take back what a process runs: let go at
        once, the place would admit the next profile's job beside it, and profiles refused
        for a corrupt sample, each at once, would fill the processes kept for builds."""
        await self._jobs.acquire()
        job = asyncio.ensure_future(self.pool.run(fn, *args))

        def ended(done: asyncio.Future[T]) -> None:
            self._jobs.release()
            if not done.cancelled():
                done.exception()  # retrieved: a caller that gave up is not told of it

        job.add_done_callback(ended)
        return await asyncio.shield(job)

    async def close(self) -> None:
        """Stop every worker of profiles and builds (`WorkerPool.close`)."""
        await asyncio.gather(self.pool.close(), self.checks.close())


# Bodies past this size are written into their memory file by a thread: each is a copy, some
# 0.2-0.5 ms a megabyte, and a body may be hundreds of them.
_WRITE_INLINE = 1 << 22


class RequestWork:
    """symbolize.pipeline.Work for one request. The body it is first given goes into a
    memory file of this process, which its scan and finish both read; an answer comes back
    through another. Any other body, or where workers cannot open this process's memory files,
    goes through the pipes as SymbolizeWorkers sends it."""

    def __init__(self, workers: SymbolizeWorkers) -> None:
        self._workers = workers
        self._pid = os.getpid()  # whose memory files the workers open
        self._body: bytes | None = None
        self._shared: SharedBytes | None = None

    async def _share(self, body: bytes) -> SharedBytes | None:
        if not self._workers.sharing or not body:
            return None
        if self._body is None:
            fd = shared_bodies.create("symgate-profile")
            self._body, self._shared = body, SharedBytes.of(self._pid, fd, len(body))
            if len(body) > _WRITE_INLINE:
                # On a descriptor of the thread's own: a request cancelled meanwhile closes
                # `fd`, whose number may then be another file's before the thread is done.
                await asyncio.to_thread(_write_closing, os.dup(fd), body)
            else:
                shared_bodies.write_all(fd, body)
        return self._shared if body is self._body else None

    def _unshareable(self, error: Unshareable) -> None:
        if self._workers.sharing:
            log.warning("profiles go to the workers through pipes: %s", error)
        self._workers.sharing = False

    async def scan(self, body: bytes, limits: Limits) -> Scanned:
        shared = await self._share(body)
        if shared is not None:
            try:
                return await self._workers.run(shared_bodies.scan, shared, limits)
            except Unshareable as e:
                self._unshareable(e)
        return await self._workers.scan(body, limits)

    async def check_samples(self, body: bytes, limits: Limits) -> None:
        shared = await self._share(body)
        if shared is not None:
            try:
                return await self._workers.checks.run(shared_bodies.check_samples, shared,
                                                      limits)
            except Unshareable as e:
                self._unshareable(e)
        await self._workers.check_samples(body, limits)

    async def finish(self, body: bytes, limits: Limits,
                     answers: dict[str, Answer]) -> Finished:
        shared = await self._share(body)
        if shared is not None:
            out = shared_bodies.create("symgate-answer")
            try:
                written = await self._workers.run(
                    shared_bodies.finish, shared, SharedBytes.of(self._pid, out, 0), limits,
                    answers)
                if written.size is None:
                    return Finished(None, written.report)
                return Finished(shared_bodies.mapped(out, written.size), written.report)
            except Unshareable as e:
                self._unshareable(e)
            finally:
                os.close(out)
        return await self._workers.finish(body, limits, answers)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker, in the place of one of the profile's jobs (through the
        pipes)."""
        return await self._workers.run(fn, *args)

    def close(self) -> None:
        if self._shared is not None:
            os.close(self._shared.fd)
            self._shared = self._body = None


def _write_closing(fd: int, data: bytes) -> None:
    try:
        shared_bodies.write_all(fd, data)
    finally:
        os.close(fd)


async def _watched(task: asyncio.Future[Any], gone: Callable[[], bool], doing: str) -> None:
    """Until `task` is done, looked in on: ConnectionResetError once its client has left
    (`gone`) while its profile was `doing` so."""
    while not task.done():
        await asyncio.wait([task], timeout=_GONE_POLL_S)
        if not task.done() and gone():
            raise ConnectionResetError(f"the client left while its profile {doing}")
