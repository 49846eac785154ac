"""Cleanup that a cancel must not cut short: a database's connections closing, a lease's row
being deleted. Cut midway, the first logged a traceback for each connection and left its
thread; the second left the row until it lapsed, other replicas waiting on it for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(job: Awaitable[T]) -> T:
    """`job`'s result, the job run to its end even if the caller is cancelled meanwhile; the
    caller's cancel is raised then (from the job's failure, if it failed)."""
    task = asyncio.ensure_future(job)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait([task])  # which, cancelled, leaves the task running
        except asyncio.CancelledError as e:
            cancelled = e
    if cancelled is not None:
        raise cancelled from None if task.cancelled() else task.exception()
    return task.result()
