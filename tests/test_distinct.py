"""symbolize.distinct stands in for np.unique on the rewrite's integer columns: the same
answer, dtype included."""

from __future__ import annotations

import numpy as np
import pytest

from symbolize.distinct import sorted_distinct


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
