"""symbolize.distinct stands in for np.unique on the rewrite's integer columns: the same
answer, dtype included."""

from __future__ import annotations

import numpy as np
import pytest

from symbolize.distinct import distinct_below, sorted_distinct


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint16])
@pytest.mark.parametrize("size", [0, 1, 2, 7, 5_000])
def test_the_distinct_values_sorted_as_np_unique_gives_them(dtype: type, size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.integers(0, max(1, size // 3), size).astype(dtype)
    got = sorted_distinct(values)
    want = np.unique(values)
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


def test_extremes_of_the_type() -> None:
    top = np.iinfo(np.uint64).max
    values = np.array([top, 0, top, 1, 0], dtype=np.uint64)
    assert sorted_distinct(values).tolist() == [0, 1, top]


@pytest.mark.parametrize(("size", "bound"), [(0, 10), (1, 10), (50, 20_000_000), (5_000, 100),
                                             (5_000, 4_000_000)])
def test_below_a_bound_by_a_mask_or_a_sort_as_np_unique_gives_them(size: int, bound: int) -> None:
    """Many values for their range take the mask, few of a wide range the sort: both give
    np.unique's answer."""
    values = np.random.default_rng(size + bound).integers(0, bound, size).astype(np.int64)
    got = distinct_below(values, bound)
    assert got.dtype == np.intp
    assert got.tolist() == np.unique(values).tolist()
