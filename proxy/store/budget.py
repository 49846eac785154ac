"""How long one request may wait on the database: all its queries together, not each its own.

database.timeout_s bounds each statement at the driver, and a request makes several (a
remembered miss looked up, asked again, written; a section's parent found, its table
looked up): against a database that never answers, each waited its own timeout, and the
request several times it. A request's budget is database.timeout_s in all: spent by every
query made for it, in its own task and in those it starts (a fetch it waits on), and once
spent, the next query fails at once as a database out of reach (TimeoutError).

Work no request started (the periodic jobs) has no budget: only the per-statement bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar


class _Budget:
    """Spent while at least one of its queries is under way: queries at once (a profile's
    tables, each queued for its turn to write SQLite) spend the time they overlap once."""

    __slots__ = ("_left_s", "_running", "_since")

    def __init__(self, seconds: float) -> None:
        self._left_s = seconds
        self._running = 0
        self._since = 0.0

    def left_s(self, now: float) -> float:
        return self._left_s - (now - self._since if self._running else 0.0)

    def start(self, now: float) -> None:
        if not self._running:
            self._since = now
        self._running += 1

    def stop(self, now: float) -> None:
        self._running -= 1
        if not self._running:
            self._left_s -= now - self._since


_BUDGET: ContextVar[_Budget | None] = ContextVar("database_budget", default=None)
# Inside a query being spent for: a query made within another (a write's read) is the outer
# one's time, not counted twice.
_SPENDING: ContextVar[bool] = ContextVar("database_spending", default=False)


@contextlib.contextmanager
def database_budget(seconds: float | None) -> Iterator[None]:
    """The queries made within (and by tasks started within) share `seconds` in all (none
    left: each fails at once); None: no budget, as database.timeout_s = 0 leaves each
    statement unbounded."""
    token = _BUDGET.set(_Budget(seconds) if seconds is not None else None)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def budget_left_s() -> float | None:
    """What the request has left of its database time; None without a budget."""
    budget = _BUDGET.get()
    return None if budget is None else budget.left_s(time.monotonic())


@contextlib.asynccontextmanager
async def spending() -> AsyncIterator[None]:
    """A query, bounded by what its request has left. Raises TimeoutError past it."""
    budget = _BUDGET.get()
    if budget is None or _SPENDING.get():
        yield
        return
    now = time.monotonic()
    if (left := budget.left_s(now)) <= 0:
        raise TimeoutError("the request's database time (database.timeout_s) is spent: "
                           "the database does not answer")
    token = _SPENDING.set(True)
    budget.start(now)
    try:
        async with asyncio.timeout(left):
            yield
    finally:
        budget.stop(time.monotonic())
        _SPENDING.reset(token)
