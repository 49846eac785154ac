"""A serving process's periodic background jobs (hit counts' flush, misses' expiry, purge
polls, the heap's trim, the bucket's catch-up): started together, stopped together.

Stopped, each is cancelled and its end waited for, before anything a job uses is closed. The
stop once only cancelled them and went on: a flush of hit counts waiting for SQLite's lock
put its counts back after the stop's own last flush had run (lost), and its task outlived the
stop, the process's exit waiting on it (for good, once the lock was held past
database.timeout_s)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

# What a background job meets while the database is away: SQLAlchemy's errors, and the
# driver's own refused or timed-out connections.
_OUTAGES: tuple[type[BaseException], ...] = (SQLAlchemyError, ConnectionError, TimeoutError)


class Jobs:
    def __init__(self) -> None:
        self._names: dict[asyncio.Task[None], str] = {}
        self._under_way: set[asyncio.Task[None]] = set()  # in a round, not between rounds

    def start(self, seconds: float, job: Callable[[], Awaitable[object]]) -> None:
        """Run `job` every `seconds`, the first time `seconds` from now."""
        # A method's class and name (ArtifactCache.flush_access); a local function's name.
        name = getattr(job, "__qualname__", repr(job)).rpartition("<locals>.")[2]
        self._names[asyncio.create_task(self._every(seconds, job, name))] = name

    async def stop(self) -> None:
        """Cancel every job and wait for its end: a round under way ends as its job does on
        a cancel (a flush of hit counts first finishes its write, within database.timeout_s).
        """
        if self._under_way:
            # A stop that waits on a database for seconds says what for.
            log.info("stopping: waiting for background jobs under way: %s",
                     ", ".join(sorted(self._names[t] for t in self._under_way)))
        for task in self._names:
            task.cancel()
        ends = await asyncio.gather(*self._names, return_exceptions=True)
        for task, end in zip(self._names, ends, strict=True):
            if isinstance(end, BaseException) and not isinstance(end, asyncio.CancelledError):
                log.error("background job %s failed as it stopped", self._names[task],
                          exc_info=end)

    async def _every(self, seconds: float, job: Callable[[], Awaitable[object]],
                     name: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            await asyncio.sleep(seconds)
            self._under_way.add(task)
            try:
                await job()
            except _OUTAGES as e:
                # An outage every job rides out (README: the database down): one line, no
                # traceback, each round; the job tries again at the next. A disk's OSError, or
                # a bug, keeps its traceback.
                log.warning("background job %s failed (%s: %s); trying again in %g s",
                            name, type(e).__name__, e, seconds)
            except Exception:  # a failed background job is logged and tried again next time
                log.exception("background job %s failed", name)
            finally:
                self._under_way.discard(task)
            if task.cancelling():
                # A cancel the job turned into a failure: looping on, the job would hold the
                # stop that waits for it.
                raise asyncio.CancelledError
