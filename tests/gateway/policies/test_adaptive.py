"""The adaptive threshold's decision: the bench table at the live acceptance, and one bounded step. No HTTP."""

from __future__ import annotations

import pytest

from crossover.gateway.policies.adaptive import (
    INTO_BOUNDS,
    NO_ACCEPTANCE,
    NO_TABLE,
    TOWARD_CROSSOVER,
    WITHIN_DEADBAND,
    WITHIN_INTERVAL,
    AdaptiveLimits,
    BenchTable,
    TableError,
    decide,
    mean_acceptance,
)

LEVELS = (1, 2, 4, 8, 16, 32)
SPECULATIVE = (100, 190, 360, 600, 800, 900)
PLAIN = (60, 120, 240, 480, 880, 1300)


def results(*, accept: float | None = None, intervals: bool = False, spread: float = 0.05) -> dict:
    """A `crossover bench` results.json, as far as the table reads it."""
    levels = []
    for target, curve in (("eagle", SPECULATIVE), ("plain", PLAIN)):
        for concurrency, throughput in zip(LEVELS, curve, strict=True):
            level = {"target": target, "concurrency": concurrency, "completed": 10, "output_throughput": throughput}
            if intervals:
                level["output_throughput_interval"] = [throughput * (1 - spread), throughput * (1 + spread)]
            if accept is not None and target == "eagle":
                level["accept_length"] = accept
            levels.append(level)
    # A level that completed nothing is no data, never a point.
    levels.append({"target": "plain", "concurrency": 64, "completed": 0, "output_throughput": 0})
    return {"levels": levels, "crossover": {"speculative": "eagle", "plain": "plain"}}


LIMITS = AdaptiveLimits(max_step=4, minimum=2, maximum=24, deadband=1)


def test_the_crossover_is_interpolated_between_bench_levels_at_the_benchs_acceptance():
    table = BenchTable.from_results(results(), accept_length=3.0)
    prediction = table.predict(3.0)
    # 8: plain 480 vs 600 (-120); 16: 880 vs 800 (+80): 8 + 8 x 120 / 200
    assert prediction.crossover == pytest.approx(12.8)
    assert prediction.interval is None and not prediction.above_range


def test_speculative_throughput_scales_with_live_over_bench_acceptance():
    table = BenchTable.from_results(results(), accept_length=3.0)
    assert table.predict(2.0).crossover == pytest.approx(4.0)  # x 2/3: speculative 240 at 4, plain 240
    assert table.predict(1.5).crossover == 1.0  # x 1/2: plain ahead from the lowest level
    higher = table.predict(4.5)  # x 1.5: plain never catches up within the bench's levels
    assert higher.above_range and higher.crossover == 32.0
    assert table.predict(2.5).crossover < table.predict(3.0).crossover < table.predict(3.5).crossover


def test_a_recorded_acceptance_wins_over_the_setting_and_one_is_needed():
    assert BenchTable.from_results(results(accept=2.0), accept_length=3.0).accept_length == 2.0
    with pytest.raises(TableError, match="bench_accept_length"):
        BenchTable.from_results(results())
    with pytest.raises(TableError, match="no speculative and plain pair"):
        BenchTable.from_results({"levels": [], "crossover": {"speculative": None, "plain": None}}, accept_length=2.0)
    with pytest.raises(TableError, match="not two throughput curves"):
        BenchTable.from_results({"levels": [], "crossover": {"speculative": "a", "plain": "b"}}, accept_length=2.0)


def test_the_interval_comes_from_the_levels_intervals():
    prediction = BenchTable.from_results(results(intervals=True), accept_length=3.0).predict(3.0)
    assert prediction.interval is not None
    low, high = prediction.interval
    assert low < prediction.crossover < high


def test_no_acceptance_or_no_table_holds():
    table = BenchTable.from_results(results(), accept_length=3.0)
    assert decide(20, None, table, LIMITS).reason == NO_ACCEPTANCE
    held = decide(20, 1.5, None, LIMITS)
    assert (held.reason, held.threshold, held.moved) == (NO_TABLE, 20, False)
    assert mean_acceptance([None, 2.0, None, 3.0]) == 2.5 and mean_acceptance([None]) is None


def test_a_move_is_at_most_max_step_and_never_past_the_target():
    table = BenchTable.from_results(results(), accept_length=3.0)
    down = decide(20, 3.0, table, LIMITS)  # target 13
    assert (down.threshold, down.reason, down.direction, down.target) == (16, TOWARD_CROSSOVER, "down", 13)
    assert decide(15, 3.0, table, LIMITS).threshold == 13  # 2 away: the whole way, not past
    up = decide(4, 3.0, table, LIMITS)
    assert (up.threshold, up.direction) == (8, "up")


def test_the_threshold_never_leaves_min_and_max():
    table = BenchTable.from_results(results(), accept_length=3.0)
    threshold, seen = 24, []
    for _ in range(10):  # acceptance collapsed: the crossover at the lowest level, the target at min
        decision = decide(threshold, 1.2, table, LIMITS)
        assert abs(decision.threshold - decision.previous) <= LIMITS.max_step
        threshold = decision.threshold
        seen.append(threshold)
    assert min(seen) == LIMITS.minimum and seen[-1] == LIMITS.minimum
    assert decide(20, 4.5, table, LIMITS).threshold == 24  # above range: up to max, no further
    assert decide(24, 4.5, table, LIMITS).reason == WITHIN_DEADBAND
    outside = decide(40, None, table, LIMITS)
    assert outside.reason == NO_ACCEPTANCE  # no acceptance: nothing moves, even outside the bounds
    into = decide(40, 4.5, table, LIMITS)
    assert (into.threshold, into.reason) == (36, INTO_BOUNDS)


def test_the_deadband_and_the_interval_hold():
    table = BenchTable.from_results(results(), accept_length=3.0)
    assert decide(14, 3.0, table, LIMITS).reason == WITHIN_DEADBAND  # target 13, band 1
    assert decide(13, 3.0, table, AdaptiveLimits(max_step=4, minimum=2, maximum=24)).reason == WITHIN_DEADBAND
    wide = BenchTable.from_results(results(intervals=True, spread=0.2), accept_length=3.0)
    low, high = wide.predict(3.0).interval
    inside = round((low + high) / 2) + 2
    assert low <= inside <= high
    assert decide(inside, 3.0, wide, LIMITS).reason == WITHIN_INTERVAL


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ({"max_step": 0, "minimum": 1, "maximum": 2}, "max_step"),
        ({"max_step": 1, "minimum": 3, "maximum": 2}, "minimum <= maximum"),
        ({"max_step": 1, "minimum": 1, "maximum": 2, "deadband": -1}, "deadband"),
    ],
)
def test_limits_are_checked(limits, words):
    with pytest.raises(ValueError, match=words):
        AdaptiveLimits(**limits)
