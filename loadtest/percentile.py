"""The one percentile definition both load tools use (`crossover bench` and the proxy benchmark's loadgen).

Linear interpolation between closest ranks: `statistics.quantiles(method="inclusive")`, numpy's default and
R's type 7, which SGLang's bench_serving reports (it calls numpy). p50 of [1, 2, 3, 4] is 2.5, not 2 or 3.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[int]) -> list[float]:
    """The qs-th percentiles (each in 0..100) of `values` (any order, at least one), sorting once."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    if any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles are 0..100, got {list(qs)}")
    if len(data) == 1:
        return [data[0]] * len(qs)
    cuts = [data[0], *statistics.quantiles(data, n=100, method="inclusive"), data[-1]]
    return [cuts[q] for q in qs]


def percentile(values: Iterable[float], q: int) -> float:
    """The q-th percentile (0..100) of `values`: `percentile([1, 2, 3, 4], 50) == 2.5`."""
    return percentiles(values, (q,))[0]
