"""Where strings are in a profile's string table, for the few strings a rewrite asks about.

A dict of the whole table cost a microsecond and some 120 bytes a string: a profile of ten
million short strings (26 MB gzipped, inside every limit) held a worker for ten seconds and
1.2 GB. Testing each string against the few wanted ones costs a tenth of that, and no memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Set


def first_indices(strings: Iterable[str], wanted: Set[str]) -> dict[str, int]:
    """The index of the first occurrence of each string of `wanted` that `strings` has."""
    out: dict[str, int] = {}
    for i, s in enumerate(strings):
        if s in wanted:
            out.setdefault(s, i)
    return out
