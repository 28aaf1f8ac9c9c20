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
    Correction,
    ExploreArm,
    TableError,
    decide,
    explore_verdict,
    level_load,
    mean_acceptance,
    threshold_for,
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
    # Crossover 12.8: plain ahead from 13 clients, so the threshold keeps C <= 12 on speculative: target 12.
    down = decide(20, 3.0, table, LIMITS)
    assert (down.threshold, down.reason, down.direction, down.target) == (16, TOWARD_CROSSOVER, "down", 12)
    assert decide(14, 3.0, table, LIMITS).threshold == 12  # 2 away: the whole way, not past
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
    assert decide(13, 3.0, table, LIMITS).reason == WITHIN_DEADBAND  # target 12, band 1
    assert decide(12, 3.0, table, AdaptiveLimits(max_step=4, minimum=2, maximum=24)).reason == WITHIN_DEADBAND
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
        ({"max_step": 1, "minimum": 1, "maximum": 2, "max_levels": -1}, "max_levels"),
    ],
)
def test_limits_are_checked(limits, words):
    with pytest.raises(ValueError, match=words):
        AdaptiveLimits(**limits)


@pytest.mark.parametrize(("crossover", "threshold"), [(12.8, 12), (13.0, 12), (13.0000000001, 12), (1.0, 0), (0.5, 0)])
def test_the_threshold_for_a_crossover_keeps_the_clients_below_it_on_speculative(crossover, threshold):
    # The switch policy sends a request to plain when the others in flight are >= the threshold: C clients stay
    # speculative while C <= threshold, and plain is ahead from ceil(crossover) clients.
    assert threshold_for(crossover) == threshold


def test_the_prefill_does_not_scale_with_acceptance():
    # Per request: 100 output tokens; the speculative level's engine time out / X; 0.1 s of it prefill.
    bench = results()
    for level in bench["levels"]:
        if level["target"] == "eagle":
            level["mean_ttft_ms"] = 100.0 if level["concurrency"] == 1 else 900.0  # the lowest level's counts
            level["total_output_tokens"] = 100 * level["completed"]
    split = BenchTable.from_results(bench, accept_length=3.0)
    assert (split.prefill_s, split.output_tokens) == (0.1, 100.0)
    at_2 = split.speculative_at(2.0)
    # C=8: 600 tok/s is 1/6 s per request: 0.1 prefill + 0.0667 decode; the decode x 3/2: 0.2 s, 500 tok/s.
    assert at_2.throughput("speculative", 8) == pytest.approx(500.0)
    assert at_2.throughput("plain", 8) == 480  # plain does not move
    proportional = BenchTable.from_results(results(), accept_length=3.0)
    assert proportional.prefill_s == 0.0  # no TTFT recorded: the proportional model
    assert proportional.speculative_at(2.0).throughput("speculative", 8) == pytest.approx(400.0)
    # Less of the curve scales, so the crossover moves less: between the proportional one and the bench's.
    assert proportional.predict(2.0).crossover < split.predict(2.0).crossover < split.predict(3.0).crossover
    assert split.predict(3.0).crossover == pytest.approx(proportional.predict(3.0).crossover)


def test_a_window_may_reach_the_next_bench_level_where_it_is_farther_than_max_step():
    table = BenchTable.from_results(results(), accept_length=3.0)
    levels = AdaptiveLimits(max_step=2, minimum=1, maximum=64, deadband=0, max_levels=1)
    assert table.level_reach(31, 12, 1) == 15  # the next level down is 16
    assert decide(31, 3.0, table, levels).threshold == 16
    assert decide(16, 3.0, table, levels).threshold == 12  # 8 is past the target: the target
    assert decide(2, 3.0, table, levels).threshold == 4  # up: the next level, 4
    assert decide(40, 3.0, table, levels).threshold == 32  # beyond the top: down to it
    strict = AdaptiveLimits(max_step=2, minimum=1, maximum=64, deadband=0, max_levels=0)
    assert decide(31, 3.0, table, strict).threshold == 29


def test_the_live_rate_table_corrects_the_model_shrunk_toward_1_while_it_has_few_requests():
    table = BenchTable.from_results(results(), accept_length=3.0)
    correction = Correction(prior=32)
    assert correction.factor("speculative", 8) == 1.0 and correction.view() == []
    # Level 8-15 served half of what the model predicts there (bench 600 tok/s at 8: 600 / level_load per stream).
    per_stream = 600 / level_load(8, 15)
    correction.observe("speculative", 8, 15, requests=8, tokens=0.5 * per_stream * 10, seconds=10, rate=600)
    few = correction.factor("speculative", 8)
    assert few == pytest.approx((8 * 0.5 + 32) / 40)  # 8 requests: mostly the prior
    for _ in range(40):
        correction.observe("speculative", 8, 15, requests=8, tokens=0.5 * per_stream * 10, seconds=10, rate=600)
    many = correction.factor("speculative", 12)
    assert 0.5 < many < few and many == pytest.approx((328 * 0.5 + 32) / 360)
    assert correction.factor("speculative", 16) == 1.0 and correction.factor("plain", 8) == 1.0  # no evidence
    (row,) = correction.view()
    assert (row["pool"], row["level"], row["requests"], row["windows"]) == ("speculative", "8-15", 328, 41)
    assert row["ratio"] == pytest.approx(0.5) and row["stderr"] == pytest.approx(0.0, abs=1e-6)
    # Speculative slower than the bench at 8: plain catches up earlier.
    assert table.predict(3.0, correction).crossover < table.predict(3.0).crossover
    decision = decide(12, 3.0, table, LIMITS, correction)
    assert decision.target is not None and decision.target < 12


def test_an_explore_arm_disagrees_only_beyond_its_interval_and_after_enough_windows():
    arm = ExploreArm()
    arm.add(10.0, realized=1000.0, predicted=1000.0, low=900.0, high=1100.0)
    assert not arm.disagrees()  # one window: not judged yet
    arm.add(10.0, realized=1050.0, predicted=1000.0, low=900.0, high=1100.0)
    assert not arm.disagrees() and explore_verdict({"up": arm}) is None  # 2050 within 1800-2200
    arm.add(10.0, realized=1900.0, predicted=1000.0, low=900.0, high=1100.0)
    assert arm.disagrees()  # 3950 past 3300
    why = explore_verdict({"up": ExploreArm(), "down": arm})
    assert why is not None and "down arm realized 131.7 tok/s" in why and "holding" in why
    # No interval from the bench: the resolution's band.
    bare = ExploreArm()
    for _ in range(2):
        bare.add(1.0, realized=102.0, predicted=100.0, low=100.0, high=100.0)
    assert not bare.disagrees() and bare.view()["interval_tokens_per_s"] == [97.0, 103.0]
