"""Handing freed heap back to the system.

A Python process's freed memory mostly stays with glibc's malloc: what a burst of requests
allocated (a download's buffers, a profile's bytes, SQL rows) keeps counting in the process's
resident size long after. Every serving process of `serve --workers N` holds its own, so an
idle server would weigh tens of MiB more after its first minutes than at start (measured:
~10 MiB over two workers). glibc's malloc_trim(0) returns free pages anywhere in the heap.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

# Often enough that a server gone quiet is back to its size within a minute; a trim of an
# idle heap costs well under a millisecond.
TRIM_EVERY_S = 30.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl)."""
    try:
        # The process's own symbols, as proxy.symbols.worker_process takes prctl: libc is
        # among them, and find_library would run ldconfig in a subprocess at every start.
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


async def trim_heap() -> None:
    """Return free heap pages to the system; in a thread, as it holds malloc's locks while
    it walks the heap."""
    if _TRIM is not None:
        await asyncio.to_thread(_TRIM, 0)
