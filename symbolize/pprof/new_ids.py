"""Ids for the Functions symbolization adds to a profile: ones its own do not use.

They follow the profile's highest id, as a reader of the profile expects. A profile may already
use an id near 2**64 - 1 (pprof ids are any uint64 but 0): past the top, the lowest ids it does
not use are taken instead, never a wrapped one, which would be 0 (invalid) or another's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

_LAST = (1 << 64) - 1


class NewIds:
    def __init__(self, used: Iterable[int]) -> None:
        self._used = np.fromiter(used, dtype=np.uint64)
        self._next = int(self._used.max()) + 1 if len(self._used) else 1
        self._low = 1  # where the search for unused ids below the profile's resumes
        self._sorted = False  # sorted only for a search below, which almost no profile needs

    def take(self, n: int) -> npt.NDArray[np.uint64]:
        """`n` ids that neither the profile nor an earlier take uses."""
        above = min(n, max(0, _LAST - self._next + 1))
        out = np.arange(above, dtype=np.uint64)
        if above:
            out += np.uint64(self._next)
            self._next += above
        if above == n:
            return out
        return np.concatenate((out, self._below(n - above)))

    def _below(self, n: int) -> npt.NDArray[np.uint64]:
        """The `n` lowest ids from `_low` up that the profile does not use: a window from
        `_low` of n ids plus the profile's own inside it, grown until it holds n free ones.
        Each call costs its n and the profile's ids it passes, never all of them again."""
        if not self._sorted:
            self._used, self._sorted = np.unique(self._used), True
        low = np.uint64(self._low)
        start = int(np.searchsorted(self._used, low))
        window = n
        while True:
            inside = int(np.searchsorted(self._used, low + np.uint64(window))) - start
            if window - inside >= n:
                break
            window = n + inside
        candidates = np.arange(window, dtype=np.uint64) + low
        free = candidates[~np.isin(candidates, self._used[start: start + inside],
                                   assume_unique=True)][:n]
        self._low = int(free[-1]) + 1
        return free
