"""Upstreams doubted for a key: those whose last answer for it was not the file asked for.

An upstream that answers 200 with another file (another build ID, no ELF at all, fewer bytes
than it announced, more than symgate fetches, or a size past cache.max_artifact_bytes) cannot
be told from a good one until its answer is in, and by then that fetch has failed. Asked first
again, it would fail every later fetch of the key too, though an upstream after it has the
right file: so for a while it is asked after the others, and only when none of them has the
file. A doubt only reorders: an upstream that alone has the file is still asked.

Kept in memory, per process: the cost of forgetting is one more failed fetch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Doubts:
    def __init__(self, doubt_s: float, *, entries: int = 10_000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._doubt_s = doubt_s
        self._entries = entries
        self._monotonic = monotonic
        # (key hash, upstream name) -> monotonic time the doubt lasts until
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def doubt(self, kh: str, upstream: str) -> None:
        """`upstream` answered the key `kh` with a body that was not its file."""
        entry = (kh, upstream)
        self._until.pop(entry, None)
        self._until[entry] = self._monotonic() + self._doubt_s
        while len(self._until) > self._entries:
            self._until.popitem(last=False)

    def doubted(self, kh: str, upstreams: list[str]) -> frozenset[str]:
        """Those of `upstreams` doubted for `kh` now."""
        now = self._monotonic()
        out = set()
        for name in upstreams:
            until = self._until.get((kh, name))
            if until is None:
                continue
            if until > now:
                out.add(name)
            else:
                del self._until[(kh, name)]
        return frozenset(out)

    def forget(self, kh: str, upstream: str) -> None:
        """`upstream` gave the key's file after all."""
        self._until.pop((kh, upstream), None)
