"""`crossover sim replay --mechanism adaptive` (servers/sim/replay_adaptive.py): the gateway's adaptive controller
stepped in virtual time, against the best fixed threshold and the per-window oracle, on every shipped trace with its
acceptance shifting; and how fast it follows an acceptance drop.

Each shipped trace runs on its pair (k25-*: the k25 profiles at their accept length 2.4; llama-*: llama8b-h200 at
input 768 and accept length 2.0, or the profile's 2.5 where the trace gives its own acceptance), with the accept
length dropped to 1.6 halfway through where the trace gives none. All of them together take ~15 s of CPU (the
levels are measured once per process; llama-diurnal-24h's 500 clients are most of it).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from crossover.gateway.config import AdaptiveSettings
from crossover.gateway.policies import BenchTable
from crossover.gateway.policies.adaptive import threshold_for
from crossover.loadtest.config import DEFAULT_CONCURRENCY
from crossover.servers.sim.profile import with_overrides
from crossover.servers.sim.replay import ADAPTIVE, ReplayResult, profiles_crossover, replay
from crossover.servers.sim.replay_adaptive import (
    BENCH_LEVELS,
    DROPPED_ACCEPT,
    ModelRates,
    format_rows,
    level_width,
    pool_at,
    shipped_rows,
    shipped_setup,
    shipped_trace,
    stretches,
)
from crossover.servers.sim.trace import TRACES_DIR, TracePhase, load_trace, shifts_acceptance, with_accept_drop

# The must-show's bounds: at or above the best fixed threshold, within 5% of the per-window oracle.
ORACLE_SHARE = 0.95
SETTLE_WINDOWS = 5
SHIPPED = sorted(path.stem for path in TRACES_DIR.glob("*.csv"))
setup_for, shifting = shipped_setup, shipped_trace


def test_the_replayed_bench_measures_the_levels_crossover_bench_measures_by_default():
    assert BENCH_LEVELS == DEFAULT_CONCURRENCY


@pytest.mark.parametrize("name", SHIPPED)
def test_adaptive_is_at_least_the_best_fixed_threshold_and_near_the_oracle_on_every_shipped_trace(name):
    trace = shifting(name)
    assert shifts_acceptance(trace)
    result = replay(setup_for(name, trace), trace, ADAPTIVE)
    report = result.adaptive
    assert report is not None
    assert result.output_tokens >= report.best_fixed_tokens
    assert result.output_tokens >= ORACLE_SHARE * report.oracle_tokens
    # The oracle bounds every threshold, fixed or moved.
    assert report.oracle_tokens >= max(result.output_tokens, report.best_fixed_tokens) - 1
    assert result.output_tokens == pytest.approx(sum(result.phase_tokens), abs=1)


def test_the_shipped_traces_include_one_whose_acceptance_shifts():
    assert any(shifts_acceptance(load_trace(name)) for name in SHIPPED)


@pytest.mark.parametrize("name", ["k25-2-100-1h", "llama-4-512-drop"])
def test_after_an_acceptance_drop_the_threshold_is_within_one_bench_level_of_the_new_crossover_in_5_windows(name):
    # The gateway's defaults: k25's crossover 4 -> 1; llama8b's 161 -> 64 (predicted 160 -> 63), one bench level a
    # window at most (max_levels 1) where that is farther than max_step.
    if name == "llama-4-512-drop":
        trace = [TracePhase(duration_s=1800, concurrency=96), TracePhase(duration_s=1800, concurrency=48)]
    else:
        trace = load_trace(name)
    drop_at = sum(phase.duration_s for phase in trace) / 2
    trace = with_accept_drop(trace, at_s=drop_at, accept_length=DROPPED_ACCEPT)
    adaptive = AdaptiveSettings()
    setup = setup_for(name, trace, adaptive)
    report = replay(setup, trace, ADAPTIVE).adaptive
    assert report is not None
    top = max(BENCH_LEVELS[-1], *(phase.concurrency for phase in trace))
    crossover = profiles_crossover(
        with_overrides(setup.speculative, accept_length=DROPPED_ACCEPT),
        setup.plain,
        top,
        input_len=setup.input_len,
        output_len=setup.output_len,
    )
    assert crossover is not None
    drop_window = int(drop_at // adaptive.window)
    far = abs(report.thresholds[drop_window] - crossover) > level_width(crossover)
    later = report.thresholds[drop_window + SETTLE_WINDOWS]
    assert abs(later - crossover) <= level_width(crossover), (report.thresholds[drop_window], later, crossover)
    (settling,) = report.settled
    assert settling.crossover == crossover and settling.windows is not None
    assert settling.windows <= SETTLE_WINDOWS
    if name == "llama-4-512-drop":
        assert far  # the drop did move the crossover away by more than a level


def test_the_model_predicts_the_crossover_at_2_0_from_a_bench_at_2_5_near_the_simulations():
    # llama8b-h200 at input 768, benched at the profile's 2.5. The proportional model (speculative tok/s x 2.0/2.5,
    # prefill scaled too) put it at 82; the split (prefill apart from the decode steps) lands near the engine's.
    setup = setup_for("llama-accept-shift", load_trace("llama-accept-shift"))
    rates = ModelRates(setup)
    assert rates.accept_length == 2.5
    table = rates.bench_table()
    assert table.prefill_s > 0 and table.output_tokens == setup.output_len
    simulated = rates.crossover(2.0, BENCH_LEVELS[-1])
    assert simulated is not None
    predicted = table.predict(2.0).crossover
    assert predicted == pytest.approx(simulated, rel=0.05), (predicted, simulated)
    proportional = BenchTable(table.rates, table.accept_length).predict(2.0).crossover
    assert proportional < 0.6 * simulated
    assert threshold_for(predicted) == math.ceil(predicted) - 1


@pytest.mark.parametrize("max_levels", [0, 1])
def test_each_move_is_the_controllers_bounded_step_within_its_bounds(max_levels):
    trace = load_trace("llama-accept-shift")
    adaptive = AdaptiveSettings(max_step=4, min=8, max=200, max_levels=max_levels)
    report = replay(setup_for("llama-accept-shift", trace, adaptive), trace, ADAPTIVE).adaptive
    assert report is not None
    assert report.moves
    for move in report.moves:
        step = abs(move.threshold - move.previous)
        if max_levels == 0:
            assert step <= 4
        else:  # at most 4, or up to the next bench level toward the target
            low, high = sorted((move.previous, move.threshold))
            assert step <= 4 or not any(low < level < high for level in BENCH_LEVELS), move
    assert all(8 <= threshold <= 200 for threshold in report.thresholds)
    assert {move.reason for move in report.moves} <= {"toward_crossover", "into_bounds"}


def test_routing_is_the_switch_policy_of_a_closed_loop():
    # A request finds the other C - 1 clients in flight: threshold T keeps C <= T on the speculative pool.
    assert pool_at(4, 4) == "speculative"
    assert pool_at(5, 4) == "plain"
    assert pool_at(1, 0) == "plain"


def test_stretches_cut_at_windows_and_phases():
    trace = [TracePhase(duration_s=45, concurrency=2), TracePhase(duration_s=30, concurrency=8, accept_length=1.5)]
    parts = stretches(trace, 30.0, 2.4)
    assert [(p.window, p.duration_s, p.concurrency, p.accept_length) for p in parts] == [
        (0, 30.0, 2, 2.4),
        (1, 15.0, 2, 2.4),
        (1, 15.0, 8, 1.5),
        (2, 15.0, 8, 1.5),
    ]
    assert math.isclose(sum(p.duration_s for p in parts), 75)


def test_the_other_mechanisms_refuse_a_trace_whose_acceptance_shifts():
    trace = load_trace("llama-accept-shift")
    with pytest.raises(ValueError, match="only adaptive replays a shift of acceptance"):
        replay(setup_for("llama-accept-shift", trace), trace, "always-plain")


def test_the_json_carries_adaptive_beside_the_best_fixed_and_the_oracle():
    trace = shifting("k25-bursts")
    result: ReplayResult = replay(setup_for("k25-bursts", trace), trace, ADAPTIVE)
    body = result.as_json()["adaptive"]
    assert {"best_fixed_threshold", "best_fixed_output_tokens", "oracle_output_tokens", "moves", "settled"} <= set(body)
    assert body["limits"] == {"max_step": 4, "min": 1, "max": 256, "deadband": 1, "max_levels": 1}
    assert body["react"] == 0.2


def crossover_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossover.gateway.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_command_lists_adaptive_and_reports_it():
    assert "adaptive" in crossover_cli("sim", "replay", "--help").stdout
    done = crossover_cli(
        "sim", "replay", "--speculative", "k25-eagle3", "--plain", "k25-plain", "--trace", "k25-bursts",
        "--mechanism", "adaptive", "--accept-drop", "600:1.6", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["mechanism"] == "adaptive" and row["adaptive"]["settled"][0]["accept_length"] == 1.6
    table = crossover_cli(
        "sim", "replay", "--speculative", "k25-eagle3", "--plain", "k25-plain", "--trace", "k25-bursts",
        "--mechanism", "adaptive", "--accept-drop", "600:1.6",
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "best fixed threshold 0" in table.stdout and "per-window oracle" in table.stdout
    refused = crossover_cli(
        "sim", "replay", "--speculative", "k25-eagle3", "--plain", "k25-plain", "--trace", "k25-bursts",
        "--mechanism", "sleep", "--accept-drop", "600:1.6",
    )  # fmt: skip
    assert refused.returncode == 2 and "--mechanism adaptive" in refused.stderr


def test_the_table_of_every_shipped_trace_prints_adaptive_beside_best_fixed_and_oracle():
    rows = shipped_rows()
    assert [row.trace for row in rows] == SHIPPED
    table = format_rows(rows)
    assert table.count("\n") == len(rows) + 1 and "| llama-accept-shift |" in table
    for row in rows:
        assert row.adaptive_tokens >= row.best_fixed_tokens, row
        assert row.adaptive_tokens >= ORACLE_SHARE * row.oracle_tokens, row
        assert all(windows is not None and windows <= SETTLE_WINDOWS for windows in row.settled), row


def test_every_adaptive_setting_has_its_option_and_a_bad_one_names_it():
    argv = (
        "sim", "replay", "--speculative", "llama8b-h200-eagle3", "--plain", "llama8b-h200-plain", "--trace",
        "k25-bursts", "--mechanism", "adaptive", "--accept-drop", "600:1.6", "--json",
    )  # fmt: skip
    default, given = (
        json.loads(crossover_cli(*argv, *extra).stdout)[0]["adaptive"]
        for extra in ((), ("--adaptive-max-levels", "0", "--adaptive-react", "5", "--adaptive-max-step", "2"))
    )
    assert given["limits"]["max_levels"] == 0 and given["react"] == 5.0 and given["limits"]["max_step"] == 2
    # Steps of 2 and no bench level at once: more moves than the default's to reach the same crossover.
    assert len(given["moves"]) > len(default["moves"])
    refused = crossover_cli(*argv, "--adaptive-min", "300")
    assert refused.returncode != 0 and "--adaptive" in refused.stderr and "Traceback" not in refused.stderr
    refused = crossover_cli(*argv, "--adaptive-max-levels", "65")
    assert refused.returncode != 0 and "--adaptive-max-levels" in refused.stderr, refused.stderr
