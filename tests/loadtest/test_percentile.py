"""One percentile definition for both load tools: linear between closest ranks, as numpy and bench_serving."""

from __future__ import annotations

import numpy as np
import pytest

from crossover.loadtest.percentile import percentile, percentiles


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = np.random.default_rng(q).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_order_does_not_matter_and_ranks_are_interpolated():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentiles([4, 1, 3, 2], (0, 50, 100)) == [1, 2.5, 4]


def test_one_value_is_every_percentile_and_none_is_an_error():
    assert percentiles([7.0], (50, 99)) == [7.0, 7.0]
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0, 2.0], 101)
