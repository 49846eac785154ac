"""The grace a stopping server gives responses under way, which a second stop signal ends."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Collection
from typing import Any, TypeVar

T = TypeVar("T")

# What stops a server, supervisor and workers alike: SIGHUP too, since a terminal's hangup (or
# an operator used to it) reaches its whole process group and must drain, not kill at once
# and leave the workers to be reaped and the metrics folder behind.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


async def unfinished(tasks: Collection[asyncio.Future[T]], grace_s: float,
                     cut: asyncio.Event) -> set[asyncio.Future[T]]:
    """Wait up to `grace_s` for `tasks`, less once `cut` is set (an operator's second Ctrl-C
    or SIGTERM: a grace of minutes is not to be sat through when asked twice); those not done
    then, left running for the caller to cut."""
    pending = {t for t in tasks if not t.done()}
    if not pending or cut.is_set():
        return pending
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    cutting = asyncio.ensure_future(cut.wait())
    try:
        while pending and not cutting.done() and (left := deadline - loop.time()) > 0:
            watched: set[asyncio.Future[Any]] = {*pending, cutting}
            await asyncio.wait(watched, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending = {t for t in pending if not t.done()}
    finally:
        cutting.cancel()
    return pending
