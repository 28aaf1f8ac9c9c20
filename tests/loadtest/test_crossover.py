"""Crossover interpolation and the threshold each policy gets: pure functions, no servers."""

from __future__ import annotations

import math

import pytest

from crossover.gateway.policies.route import spillover
from crossover.loadtest.crossover import (
    analyse,
    find_crossover,
    interpolate,
    spillover_held,
    spillover_threshold,
    switch_threshold,
)
from tests.loadtest.levels import make_level

SPEC = {1: 96.0, 2: 184.0, 5: 300.0, 10: 330.0, 30: 340.0}
PLAIN = {1: 92.0, 2: 176.0, 5: 400.0, 10: 600.0, 30: 900.0}


def test_crossover_is_interpolated_in_log_concurrency_between_the_bracketing_levels():
    found = find_crossover(SPEC, PLAIN)
    assert found.status == "crossed"
    assert found.bracket == (2, 5)
    # d(2) = -8, d(5) = +100: the zero sits 8/108 of the way from log 2 to log 5.
    expected = math.exp(math.log(2) + 8 / 108 * (math.log(5) - math.log(2)))
    assert found.concurrency == pytest.approx(expected)
    assert [row.concurrency for row in found.evidence] == [1, 2, 5, 10, 30]
    assert found.evidence[2].plain_over_speculative == pytest.approx(400 / 300)


def test_equal_throughput_at_a_level_is_the_crossover_itself():
    found = find_crossover({1: 100.0, 4: 200.0}, {1: 50.0, 4: 200.0})
    assert found.concurrency == pytest.approx(4.0)


def test_plain_never_catching_up_gives_no_crossover_and_speculation_everywhere():
    found = find_crossover(SPEC, {c: v / 2 for c, v in SPEC.items()})
    assert found.concurrency is None and found.status == "not_reached"
    assert switch_threshold(None, [1, 2, 5, 10, 30]) == 30


def test_plain_ahead_at_the_lowest_level_is_reported_at_that_level():
    found = find_crossover({1: 90.0, 2: 170.0}, {1: 95.0, 2: 190.0})
    assert (found.status, found.concurrency) == ("at_or_below_lowest_level", 1.0)
    assert switch_threshold(found.concurrency, [1, 2]) == 0  # never speculative


def test_only_common_levels_count():
    found = find_crossover({1: 10.0, 2: 20.0, 3: 30.0}, {2: 10.0, 3: 40.0, 4: 50.0})
    assert [row.concurrency for row in found.evidence] == [2, 3]
    assert found.bracket == (2, 3)


@pytest.mark.parametrize(("crossing", "threshold"), [(3.01, 3), (3.5, 3), (4.0, 3), (4.2, 4), (1.0, 0)])
def test_switch_threshold_makes_every_level_below_the_crossover_speculative(crossing, threshold):
    # A new request at level C sees C - 1 others and goes speculative iff C - 1 < threshold.
    assert switch_threshold(crossing, [1, 2, 5]) == threshold
    for level in range(1, 10):
        assert (level - 1 < threshold) == (level < crossing)


def test_interpolation_is_zero_at_zero_linear_in_log_c_and_flat_past_the_last_level():
    curve = {1: 100.0, 4: 300.0}
    assert interpolate(curve, 0) == 0.0
    assert interpolate(curve, 1) == 100.0
    assert interpolate(curve, 2) == pytest.approx(200.0)  # log 2 is half way from log 1 to log 4
    assert interpolate(curve, 100) == 300.0


def test_spillover_keeps_the_speculative_pool_small_when_plain_scales_better():
    fit = spillover_threshold(SPEC, PLAIN)
    # Speculation adds little past 2-5 requests while an idle plain pool adds ~92 tok/s per request.
    assert [spillover_held(c, fit.threshold, fit.share) for c in sorted(SPEC)] == [1, 1, 2, 3, 8]
    assert 0.95 < fit.efficiency <= 1.0


def test_spillover_gives_everything_to_speculation_when_it_wins_everywhere():
    double = {c: 2 * v for c, v in PLAIN.items()}
    fit = spillover_threshold(double, PLAIN)
    assert spillover_held(100, fit.threshold, fit.share) >= 10
    assert fit.efficiency > 0.9


# Real vLLM on CPU, one core a server (stop 45's sweep, 32 in / 128 out tokens): the speculative server's own
# capacity grows with the load, so no threshold alone fits both 4 streams (2 of them speculative at best) and 64
# (16 of them).
VLLM_SPEC = {1: 120.0, 4: 246.0, 16: 429.0, 64: 511.0}
VLLM_PLAIN = {1: 72.0, 4: 229.0, 16: 468.0, 64: 719.0}


def test_spillover_takes_a_share_of_the_load_where_no_threshold_alone_fits_every_level():
    fit = spillover_threshold(VLLM_SPEC, VLLM_PLAIN)
    print(fit)
    assert fit.share > 0 and fit.efficiency > 0.95
    # The threshold alone, fitted the same way, serves one of the levels far below the best split.
    levels = sorted(VLLM_SPEC)
    top = max(levels)
    best = {c: max(interpolate(VLLM_SPEC, k) + interpolate(VLLM_PLAIN, c - k) for k in range(c + 1)) for c in levels}
    threshold_alone = max(
        min((interpolate(VLLM_SPEC, min(c, t)) + interpolate(VLLM_PLAIN, c - min(c, t))) / best[c] for c in levels)
        for t in range(top + 1)
    )
    assert threshold_alone < 0.9 < fit.efficiency
    # What the gateway's policy holds in a closed loop is what the fit predicted it would.
    for c in levels:
        speculative = 0
        for arrived in range(c):
            speculative += spillover(speculative, fit.threshold, arrived, fit.share).pool == "speculative"
        assert speculative == spillover_held(c, fit.threshold, fit.share)


def test_analyse_reports_thresholds_and_failures_per_level():
    levels = [
        make_level(name, c, v, failed=1 if (name, c) == ("plain", 5) else 0)
        for name, curve in (("speculative", SPEC), ("plain", PLAIN))
        for c, v in curve.items()
    ]
    section = analyse(levels, "speculative", "plain")
    assert section.recommended_threshold.switch == 2
    assert section.bracket == (2, 5)
    row = next(r for r in section.evidence if r.concurrency == 5)
    assert (row.speculative_failed, row.plain_failed) == (0, 1)


def levels_of(speculative: dict[int, float], plain: dict[int, float], spread: float = 0.0) -> list:
    """Both curves as measured levels, each with an interval of +- spread x its throughput."""
    return [
        make_level(name, c, v, output_throughput_interval=(v * (1 - spread), v * (1 + spread)))
        for name, curve in (("speculative", speculative), ("plain", plain))
        for c, v in curve.items()
    ]


def test_curves_within_noise_over_a_range_give_no_number_and_no_switch_threshold():
    speculative = {1: 200.0, 2: 300.0, 4: 400.0, 8: 480.0, 16: 320.0}
    plain = {1: 100.0, 2: 299.0, 4: 402.0, 8: 482.0, 16: 640.0}  # within 1% at C = 2, 4, 8
    section = analyse(levels_of(speculative, plain), "speculative", "plain")
    assert (section.status, section.concurrency, section.bracket) == ("within_noise", None, (1, 16))
    assert section.reason.startswith("no clear crossover between C=1 and C=16")
    assert [row.verdict for row in section.evidence] == ["speculative", "tie", "tie", "tie", "plain"]
    assert section.recommended_threshold.switch is None and section.recommended_threshold.spillover is not None


def test_a_wide_interval_makes_a_tie_of_a_difference_the_resolution_would_resolve():
    speculative, plain = {1: 200.0, 4: 400.0}, {1: 100.0, 4: 440.0}  # 10% apart at C = 4
    assert analyse(levels_of(speculative, plain, spread=0.01), "speculative", "plain").status == "crossed"
    assert analyse(levels_of(speculative, plain, spread=0.10), "speculative", "plain").status == "within_noise"


def test_a_sharp_crossing_is_named_with_the_levels_that_bound_it():
    section = analyse(
        levels_of({1: 200.0, 8: 520.0, 16: 320.0}, {1: 100.0, 8: 440.0, 16: 640.0}), "speculative", "plain"
    )
    assert (section.status, section.bracket, section.interval) == ("crossed", (8, 16), (8.0, 16.0))
    assert 8 < section.concurrency < 16 and section.recommended_threshold.switch == math.ceil(section.concurrency) - 1


def test_ties_at_the_top_of_the_sweep_are_too_close_to_call_not_speculative_everywhere():
    section = analyse(levels_of({1: 200.0, 4: 400.0}, {1: 100.0, 4: 401.0}), "speculative", "plain")
    assert (section.status, section.bracket) == ("within_noise", (1, 4))


# --- no data is never a verdict --------------------------------------------------------------------------------


def test_a_target_that_completed_nothing_at_a_level_gives_no_data_there_not_a_lead_for_the_other():
    # The run that once read "plain clearly ahead at C=1, threshold 0 (never speculate)": speculative failed
    # every request at C=1 (0 tok/s, no interval), and led clearly from C=2 on.
    levels = levels_of({1: 0.0, 2: 300.0, 8: 500.0, 16: 320.0}, {1: 90.0, 2: 250.0, 8: 440.0, 16: 640.0}, 0.01)
    levels[0] = make_level("speculative", 1, 0.0, completed=0, failed=12, output_throughput_interval=None)
    section = analyse(levels, "speculative", "plain")
    row = section.evidence[0]
    assert (row.concurrency, row.verdict, row.margin, row.plain_over_speculative) == (1, "no_data", None, None)
    assert section.status == "crossed" and section.bracket == (8, 16)
    assert section.recommended_threshold.switch == math.ceil(section.concurrency) - 1 >= 8
    assert section.reason == (
        "no data at C=1 (speculative completed nothing): left out of the crossover and the thresholds"
    )


def test_no_data_at_the_lowest_level_does_not_move_the_crossover_there():
    levels = levels_of({1: 95.0, 2: 150.0, 4: 200.0}, {1: 92.0, 2: 170.0, 4: 260.0}, 0.005)
    levels[3] = make_level("plain", 1, 0.0, completed=0, output_throughput_interval=None)
    section = analyse(levels, "speculative", "plain")
    assert [r.verdict for r in section.evidence] == ["no_data", "plain", "plain"]
    # Judged on the levels with data: plain ahead from the lowest of them (C=2), so speculative below it.
    assert (section.status, section.recommended_threshold.switch) == ("at_or_below_lowest_level", 1)


def test_no_level_with_data_on_both_sides_recommends_nothing():
    levels = levels_of({1: 0.0, 2: 0.0}, {1: 90.0, 2: 150.0})
    levels[0] = make_level("speculative", 1, 0.0, completed=0, output_throughput_interval=None)
    levels[1] = make_level("speculative", 2, 0.0, completed=0, output_throughput_interval=None)
    section = analyse(levels, "speculative", "plain")
    assert section.status == "no_data" and section.recommended_threshold is None
    assert section.concurrency is None and section.spillover_worst_case_efficiency is None
    assert [r.verdict for r in section.evidence] == ["no_data", "no_data"]
    assert section.reason.startswith("no data: no level where both targets completed a request")


def test_find_crossover_judges_no_level_it_is_told_has_no_data():
    found = find_crossover({1: 0.0, 4: 400.0}, {1: 90.0, 4: 380.0}, {1: 5.0, 4: 5.0}, no_data={1})
    assert [e.verdict for e in found.evidence] == ["no_data", "speculative"]
    assert found.status == "not_reached"


@pytest.mark.parametrize(
    ("plain", "said"),
    [
        ({1: 120.0, 10: 900.0}, "switch = 0 (never speculative: plain leads from one stream on)"),
        ({1: 50.0, 10: 900.0}, "(speculative while total in-flight < "),
    ],
)
def test_the_printed_switch_threshold_says_never_when_it_is_zero(plain, said, capsys):
    from crossover.loadtest.display import make_console, print_crossover

    section = analyse(levels_of({1: 100.0, 10: 500.0}, plain), "speculative", "plain")
    assert (section.recommended_threshold.switch == 0) == ("never" in said)
    print_crossover(make_console(), section, [])
    printed = capsys.readouterr().out
    assert said in printed and "in-flight < 0" not in printed


def test_the_printed_spillover_says_the_share_it_fitted(capsys):
    from crossover.loadtest.display import make_console, print_crossover

    section = analyse(levels_of(VLLM_SPEC, VLLM_PLAIN), "speculative", "plain")
    fit = spillover_threshold(VLLM_SPEC, VLLM_PLAIN)
    assert (section.recommended_threshold.spillover, section.spillover_share) == (fit.threshold, fit.share)
    print_crossover(make_console(), section, [])
    printed = " ".join(capsys.readouterr().out.split())
    assert f"spillover = 0, share {fit.share:g} (speculative pool holds {fit.share:.0%} of the requests" in printed
