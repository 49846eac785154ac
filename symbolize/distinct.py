"""The distinct values of an integer array, sorted: by a sort, or by a mask over their range
where they are many for it.

numpy 2's np.unique (without return_index and the like) hashes instead, and on many distinct
int64 values it grows worse than linearly: 278 ms for a million random ones on the machine
issue 14 is measured on, 1.19 s for 2.5 million, where a sort takes 10 and 27 ms. The
rewrite's columns are such arrays.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T", bound=np.generic)


def sorted_distinct(values: npt.NDArray[T]) -> npt.NDArray[T]:
    ordered = np.sort(values, axis=None)
    first = np.ones(len(ordered), dtype=np.bool_)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    distinct: npt.NDArray[T] = ordered[first]
    return distinct


def distinct_below(values: npt.NDArray[np.integer[Any]], bound: int) -> npt.NDArray[np.intp]:
    """The distinct values, every one in [0, bound), sorted. A mask over the range takes 6 ms
    for a million values where a sort takes 14, but costs the range's size: for a few values
    of a wide range (50 keys of a table of 2e7: 3 ms), a sort."""
    if len(values) * 8 >= bound:
        seen = np.zeros(bound, dtype=np.bool_)
        seen[values] = True
        return np.flatnonzero(seen)
    return sorted_distinct(values).astype(np.intp, copy=False)
