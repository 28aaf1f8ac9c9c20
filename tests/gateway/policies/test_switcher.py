"""The switching decision is a pure function of plain data: these tests drive it with a virtual clock."""

from __future__ import annotations

import math

import pytest

from crossover.gateway.policies.switcher import (
    DWELL,
    GAIN_BELOW_COST,
    LOAD_ABOVE_THRESHOLD,
    LOAD_BELOW_BAND,
    LOAD_FITS_MODE,
    NO_GAIN,
    NO_SAMPLES,
    PLAIN,
    REASONS,
    SPECULATIVE,
    WITHIN_BAND,
    CurveRates,
    LoadSample,
    PhaseHistory,
    PolicySettings,
    SwitchCost,
    SwitchDecision,
    ThresholdRates,
    decide,
    window_load,
)

SETTINGS = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=60, window_s=30, expected_phase_s=600)


def samples_of(loads: list[float], *, end: float, period: float = 1.0) -> list[LoadSample]:
    """`loads` sampled every `period` seconds, the last at `end`."""
    start = end - period * (len(loads) - 1)
    return [LoadSample(start + i * period, load) for i, load in enumerate(loads)]


def decide_after(
    loads: list[float], *, end: float = 1000.0, mode: str = SPECULATIVE, cost_s: float = 1.0, settings=SETTINGS
) -> SwitchDecision:
    """The decision once `loads` were sampled every second up to `end`, `mode` held since for ever."""
    return decide(
        samples_of(loads, end=end), now=end, mode=mode, mode_since=-math.inf, switch_cost_s=cost_s, settings=settings
    )


def run(
    load_at,
    *,
    duration_s: float,
    settings: PolicySettings = SETTINGS,
    cost_s: float = 5.0,
    period: float = 1.0,
    learn_phases: bool = False,
) -> list[tuple[float, SwitchDecision]]:
    """Drive the decision as a controller would: sample every period, switch at once (the cost is only weighed)."""
    mode, since = SPECULATIVE, -math.inf
    samples: list[LoadSample] = []
    phases = PhaseHistory() if learn_phases else None
    switches = []
    t = 0.0
    while t <= duration_s:
        samples.append(LoadSample(t, load_at(t)))
        samples = samples[-int(settings.window_s / period) - 1 :]
        if phases is not None:
            phases = phases.observe(window_load(samples, t, settings.window_s), t, settings)
        decision = decide(
            samples, now=t, mode=mode, mode_since=since, switch_cost_s=cost_s, settings=settings, phases=phases
        )
        if decision.switch:
            switches.append((t, decision))
            mode, since = decision.mode, t
        t += period
    return switches


# --- the window statistic --------------------------------------------------------------------------------


def test_window_load_is_the_median_of_the_samples_inside_the_window():
    samples = samples_of([100, 1, 2, 3, 500], end=10.0)  # t = 6..10
    assert window_load(samples, 10.0, window_s=30) == 3
    # (now - window, now]: the sample at t = 6 is just outside a 4-second window.
    assert window_load(samples, 10.0, window_s=4) == 2.5
    assert window_load(samples, 100.0, window_s=30) is None


def test_no_samples_means_stay():
    decision = decide([], now=0.0, mode=PLAIN, mode_since=0.0, switch_cost_s=1.0, settings=SETTINGS)
    assert decision == SwitchDecision(PLAIN, False, NO_SAMPLES)


def test_one_spike_in_the_window_does_not_switch():
    loads = [4] * 29 + [1000]
    decision = decide_after(loads, end=100.0)
    assert (decision.switch, decision.reason, decision.load) == (False, LOAD_FITS_MODE, 4)


# --- hysteresis, dwell -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "load", "expected"),
    [
        (SPECULATIVE, 31, (SPECULATIVE, LOAD_FITS_MODE)),
        (SPECULATIVE, 32, (PLAIN, LOAD_ABOVE_THRESHOLD)),  # from the threshold up
        (PLAIN, 32, (PLAIN, LOAD_FITS_MODE)),
        (PLAIN, 31, (PLAIN, WITHIN_BAND)),
        (PLAIN, 24, (PLAIN, WITHIN_BAND)),  # the band is [threshold - hysteresis, threshold)
        (PLAIN, 23, (SPECULATIVE, LOAD_BELOW_BAND)),
    ],
)
def test_hysteresis_band(mode, load, expected):
    decision = decide_after([load] * 30, mode=mode)
    assert (decision.mode, decision.reason) == expected
    assert decision.switch == (decision.mode != mode)
    assert decision.reason in REASONS


def test_min_dwell_holds_the_mode_then_lets_it_go():
    high = samples_of([100] * 30, end=1000.0)
    kwargs = dict(now=1000.0, mode=SPECULATIVE, switch_cost_s=1.0, settings=SETTINGS)
    assert decide(high, mode_since=950.0, **kwargs).reason == DWELL
    assert decide(high, mode_since=940.0, **kwargs).reason == LOAD_ABOVE_THRESHOLD


def test_a_step_up_and_back_down_switches_exactly_once_each_way_after_the_dwell():
    # 1 until t=300, 100 until t=900, then 1 again.
    switches = run(lambda t: 100 if 300 <= t < 900 else 1, duration_s=1800)
    assert [(d.mode, d.reason) for _, d in switches] == [
        (PLAIN, LOAD_ABOVE_THRESHOLD),
        (SPECULATIVE, LOAD_BELOW_BAND),
    ]
    up, down = switches[0][0], switches[1][0]
    # The median needs half the window to turn; the way back also waits out the dwell in plain.
    assert 300 < up <= 300 + SETTINGS.window_s
    assert 900 < down <= 900 + SETTINGS.window_s
    assert down - up >= SETTINGS.min_dwell_s


def test_a_step_back_down_right_after_a_switch_waits_for_the_dwell():
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=200, window_s=10, expected_phase_s=600)
    switches = run(lambda t: 100 if 100 <= t < 150 else 1, duration_s=600, settings=settings)
    assert [d.mode for _, d in switches] == [PLAIN, SPECULATIVE]
    assert switches[1][0] - switches[0][0] == pytest.approx(settings.min_dwell_s)


def test_load_oscillating_around_the_threshold_does_not_flap():
    # Every sample alternates 28 / 36 around threshold 32: the median sits at 32, always plain once there.
    switches = run(lambda t: 36 if int(t) % 2 else 28, duration_s=3600)
    assert [d.mode for _, d in switches] == [PLAIN]


def test_load_swinging_slowly_across_the_threshold_inside_the_band_does_not_flap():
    # 40 s at 34, 40 s at 26 (inside the band), for an hour: one switch to plain, none back.
    switches = run(lambda t: 34 if int(t // 40) % 2 == 0 else 26, duration_s=3600)
    assert [d.mode for _, d in switches] == [PLAIN]


def test_without_hysteresis_or_dwell_a_hovering_load_would_flap():
    """The test above can fail: the same load through a policy with no band and no dwell switches often."""
    settings = PolicySettings(threshold=32, hysteresis=0, min_dwell_s=0, window_s=5, expected_phase_s=600)
    switches = run(lambda t: 34 if int(t // 40) % 2 == 0 else 26, duration_s=3600, settings=settings)
    assert len(switches) > 50


# --- the cost of a switch against its gain ---------------------------------------------------------------


def test_a_short_burst_is_not_worth_a_restart():
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, window_s=10, expected_phase_s=10)
    switches = run(lambda t: 100 if 300 <= t < 310 else 1, duration_s=900, settings=settings, cost_s=240)
    assert switches == []


def test_the_same_burst_reason_is_gain_below_cost():
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, window_s=10, expected_phase_s=10)
    decision = decide_after([100] * 10, end=310.0, cost_s=240, settings=settings)
    assert decision.reason == GAIN_BELOW_COST
    assert decision.gain == 0.0  # the burst is over before the restart is
    assert decision.loss == pytest.approx(240.0)  # r_old = 1 (ThresholdRates units) x 240 s


def test_gain_against_cost_break_even():
    # ThresholdRates: the right mode is 10% faster. Switch iff 0.1 x (H - c) > 1 x c, i.e. H > 11 c.
    def decision_for(phase_s: float) -> SwitchDecision:
        settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, expected_phase_s=phase_s)
        return decide_after([100] * 30, cost_s=10.0, settings=settings)

    assert decision_for(109.0).reason == GAIN_BELOW_COST
    assert decision_for(111.0).reason == LOAD_ABOVE_THRESHOLD


def test_a_long_phase_is_worth_even_a_restart():
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=60, window_s=30, expected_phase_s=7200)
    switches = run(lambda t: 100 if t >= 300 else 1, duration_s=900, settings=settings, cost_s=240)
    assert [d.mode for _, d in switches] == [PLAIN]


def test_curves_that_say_the_other_mode_is_slower_mean_no_gain():
    rates = CurveRates.from_points(speculative=[(1, 100), (100, 400)], plain=[(1, 90), (100, 380)])
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, expected_phase_s=3600, rates=rates)
    decision = decide_after([64] * 30, settings=settings)
    assert decision.reason == NO_GAIN


def test_curves_weigh_the_gain_at_the_measured_rates():
    # At load 100 plain does 360 tok/s, speculative 340: +20 tok/s. Cost 60 s loses 340 x 60 = 20400 tokens,
    # so the rest of the phase must exceed 60 + 20400 / 20 = 1080 s.
    rates = CurveRates.from_points(speculative=[(1, 96), (48, 340), (250, 340)], plain=[(1, 93), (100, 360)])
    assert rates.throughput(PLAIN, 100) == 360
    assert rates.throughput(SPECULATIVE, 24.5) == pytest.approx(218.0)
    assert rates.throughput(SPECULATIVE, 0.5) == 96  # flat beyond the ends
    assert rates.crossover() == 100  # plain 360 >= speculative 340 first at load 100

    def reason(phase_s: float) -> str:
        settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, expected_phase_s=phase_s, rates=rates)
        return decide_after([100] * 30, cost_s=60.0, settings=settings).reason

    assert reason(1070.0) == GAIN_BELOW_COST
    assert reason(1090.0) == LOAD_ABOVE_THRESHOLD


def test_curves_from_bench_results_levels():
    levels = [
        {"target": "speculative", "concurrency": 1, "completed": 10, "output_throughput": 96.0},
        {"target": "speculative", "concurrency": 64, "completed": 90, "output_throughput": 340.0},
        {"target": "plain", "concurrency": 1, "completed": 10, "output_throughput": 93.0},
        {"target": "plain", "concurrency": 64, "completed": 90, "output_throughput": 360.0},
        {"target": "plain", "concurrency": 128, "completed": 0, "output_throughput": 0.0},  # a failed level
        {"target": "other", "concurrency": 1, "completed": 5, "output_throughput": 1.0},
    ]
    rates = CurveRates.from_levels(levels, speculative="speculative", plain="plain")
    assert rates.speculative == ((1.0, 96.0), (64.0, 340.0))
    assert rates.plain == ((1.0, 93.0), (64.0, 360.0))
    assert rates.crossover() == 64
    with pytest.raises(ValueError, match="plain curve"):
        CurveRates.from_levels(levels, speculative="speculative", plain="eagle")


def test_curve_crossover():
    rates = CurveRates.from_points(
        speculative=[(1, 100), (10, 500), (100, 600)], plain=[(1, 80), (10, 450), (100, 900)]
    )
    assert rates.crossover() == 100
    assert CurveRates.from_points(speculative=[(1, 2)], plain=[(1, 1)]).crossover() is None


@pytest.mark.parametrize(
    ("speculative", "plain"),
    [([], [(1, 1)]), ([(1, 1), (1, 2)], [(1, 1)]), ([(1, 0)], [(1, 1)]), ([(1, math.nan)], [(1, 1)])],
)
def test_bad_curves_are_refused(speculative, plain):
    with pytest.raises(ValueError, match="curve"):
        CurveRates.from_points(speculative=speculative, plain=plain)


def test_threshold_rates_favour_the_mode_the_threshold_calls_for():
    rates = ThresholdRates(threshold=8, advantage=0.5)
    assert rates.throughput(PLAIN, 8) == 1.5
    assert rates.throughput(SPECULATIVE, 8) == 1.0
    assert rates.throughput(SPECULATIVE, 7) == 1.5


# --- the expected rest of the phase ------------------------------------------------------------------------


def test_phase_history_learns_the_phase_length():
    settings = PolicySettings(threshold=32, hysteresis=8, window_s=10)
    phases = PhaseHistory(alpha=0.5)
    for t, load in [(0, 1), (100, 50), (150, 50), (400, 1), (700, 60)]:
        phases = phases.observe(load, float(t), settings)
    # Phases ended after 100 s (low), 300 s (high), 300 s (low): 100, then 100 + 0.5 x 200, then + 0.5 x 100.
    assert phases.ended == 3
    assert phases.mean_s == pytest.approx(250.0)
    assert (phases.side, phases.since) == (PLAIN, 700.0)
    assert phases.observe(None, 800.0, settings) is phases
    # Inside the band the side holds.
    assert phases.observe(30, 800.0, settings) is phases


def test_the_expected_rest_of_a_phase_shrinks_with_its_age_but_never_below_it():
    phases = PhaseHistory(side=PLAIN, since=100.0, mean_s=600.0)
    assert phases.remaining_s(100.0, 600.0) == 600.0
    assert phases.remaining_s(300.0, 600.0) == 400.0
    assert phases.remaining_s(400.0, 600.0) == 300.0
    assert phases.remaining_s(1100.0, 600.0) == 1000.0  # lasted 1000 s: expected to last as long again


def test_learned_short_bursts_stop_restarts_and_a_long_phase_still_gets_one():
    # Bursts of 20 s every 200 s: once learned, a restart (120 s) is not worth it; then a long high phase
    # grows old enough that it is.
    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=0, window_s=10, prior_phase_s=20)

    def load(t: float) -> float:
        if t >= 4000:
            return 100
        return 100 if t % 200 < 20 else 1

    switches = run(load, duration_s=6000, settings=settings, cost_s=120, learn_phases=True)
    assert len(switches) == 1
    t, decision = switches[0]
    assert decision.mode == PLAIN
    # 0.1 x (H - 120) > 120 with H = the phase's age: after ~1320 s of the long phase.
    assert 4000 + 1300 < t < 4000 + 1400


# --- the switch-cost estimate ------------------------------------------------------------------------------


def test_switch_cost_starts_at_the_prior_then_follows_the_measurements():
    cost = SwitchCost(prior_s=240.0, alpha=0.5)
    assert (cost.estimate_s, cost.measurements) == (240.0, 0)
    cost = cost.observe(100.0)  # the first measurement replaces the prior
    assert (cost.estimate_s, cost.measurements) == (100.0, 1)
    cost = cost.observe(200.0)
    assert cost.estimate_s == pytest.approx(150.0)
    assert SwitchCost(prior_s=0.0).estimate_s == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_switch_cost_refuses_impossible_durations(bad):
    with pytest.raises(ValueError, match="duration"):
        SwitchCost(prior_s=1.0).observe(bad)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="hysteresis"):
        PolicySettings(threshold=8, hysteresis=8)
    with pytest.raises(ValueError, match="window_s"):
        PolicySettings(threshold=8, window_s=0)
    with pytest.raises(ValueError, match="expected_phase_s"):
        PolicySettings(threshold=8, expected_phase_s=0)
    with pytest.raises(ValueError, match="mode"):
        decide([], now=0.0, mode="eagle", mode_since=0.0, switch_cost_s=0.0, settings=PolicySettings(threshold=8))
