"""Queueing made visible: between two levels, throughput stays flat while TTFT grows.

That is the signature of a running-request cap (SGLang caps an EAGLE server at 48 running requests unless
`--max-running-requests` says otherwise): extra requests wait for a slot instead of adding work, so a
"saturated" curve may be a configuration choice rather than the GPUs' limit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from crossover.loadtest.models import Level, Queueing

FLAT_THROUGHPUT_GAIN = 1.05  # throughput grew by less than this factor...
TTFT_GROWTH = 2.0  # ...while median TTFT grew by at least this factor


def find_queueing(levels: Sequence[Level]) -> list[Queueing]:
    """One record per target and pair of consecutive levels that shows the signature."""
    found = []
    for name in dict.fromkeys(lv.target for lv in levels):
        curve = sorted((lv for lv in levels if lv.target == name), key=lambda lv: lv.concurrency)
        for lo, hi in itertools.pairwise(curve):
            ttft_lo, ttft_hi = lo.median_ttft_ms, hi.median_ttft_ms
            if not lo.output_throughput or not ttft_lo or ttft_hi is None:
                continue
            gain = hi.output_throughput / lo.output_throughput
            growth = ttft_hi / ttft_lo
            if gain < FLAT_THROUGHPUT_GAIN and growth >= TTFT_GROWTH:
                found.append(
                    Queueing(
                        target=name,
                        from_concurrency=lo.concurrency,
                        to_concurrency=hi.concurrency,
                        throughput_gain=gain,
                        ttft_growth=growth,
                    )
                )
    return found
