"""Queueing shows as flat throughput with growing TTFT between consecutive levels."""

from __future__ import annotations

from crossover.loadtest.models import Level
from crossover.loadtest.saturation import find_queueing
from tests.loadtest.levels import make_level


def level(target: str, c: int, tok_s: float, ttft_ms: float | None) -> Level:
    return make_level(target, c, tok_s, median_ttft_ms=ttft_ms)


def test_a_capped_server_is_flagged_where_ttft_grows_and_throughput_does_not():
    levels = [
        level("spec", 30, 330.0, 130.0),
        level("spec", 70, 340.0, 33000.0),
        level("spec", 100, 341.0, 78000.0),
        level("plain", 30, 342.0, 1200.0),
        level("plain", 70, 361.0, 2500.0),  # gains 5.6%: not flagged
        level("dead", 1, 0.0, None),
        level("dead", 2, 0.0, None),  # no data: ignored
    ]
    found = find_queueing(levels)
    assert [(q.target, q.from_concurrency, q.to_concurrency) for q in found] == [
        ("spec", 30, 70),
        ("spec", 70, 100),
    ]
    assert found[0].ttft_growth > 100 and found[0].throughput_gain < 1.05
