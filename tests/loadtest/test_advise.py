"""`crossover advise` (loadtest/advise.py): on the shipped Kimi-K2.5 profiles the replay's answer - raise EAGLE's
running cap - ranked first with its figures and margin, and configs that load; on a bench of the stand-ins, the
measured curves' ranking; and no data never a verdict."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path

import pytest

from crossover.gateway.cli import main
from crossover.gateway.config import MAX_THRESHOLD, load_settings
from crossover.loadtest.advise import Option, advise_results, gateway_config, step_cost_lines
from crossover.loadtest.models import Level
from crossover.loadtest.results import load_results
from crossover.servers.profile import load_profile as load_deployment
from crossover.servers.profile import parse_profile
from tests.loadtest.levels import make_level

FIXTURE = Path(__file__).parent / "data" / "results-v1.json"
# Two of the four Kimi traces keep the replay to a few seconds: a bursty one and 1 h phases of 2 / 100 clients.
K25 = ["--speculative", "k25-eagle3", "--plain", "k25-plain", "--trace", "k25-bursts", "--trace", "k25-2-100-1h"]


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["advise", *argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def k25(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("advise")
    code, text = run([*K25, "--deployment", "kimi-k25-time-shared", "--json", "--write", str(out)])
    assert code == 0
    return json.loads(text), out


def test_k25_the_first_advice_is_raising_eagles_running_cap_from_48_to_256(k25):
    advice, _ = k25
    first = advice["ranking"][0]
    assert advice["advice"] == first["option"] == "raise-cap" and first["verdict"] == "pays"
    assert first["title"] == "raise EAGLE's running cap 48 -> 256"
    bursts, hours = first["outcomes"]
    today = next(o for o in advice["ranking"] if o["option"] == "nothing")["outcomes"]
    # The replay's figures: tokens within the resolution (-2.0 % on bursts, +3.0 % on 1 h phases), TTFT p99 cut
    # from a minute or two of queueing behind the cap to a couple of seconds.
    gains = first["tokens_vs_today_percent"]
    assert -3 < gains[0] < 0 and 2 < gains[1] < 4
    assert today[0]["ttft_p99_s"] > 60 and today[1]["ttft_p99_s"] > 100
    assert bursts["ttft_p99_s"] < 3 and hours["ttft_p99_s"] < 3 and hours["ttft_p50_s"] < 0.2
    # Its uncertainty: each token figure carries the margin it is told apart by (3 % of today's).
    assert bursts["margin"] == pytest.approx(0.03 * today[0]["tokens"], rel=1e-3)
    assert advice["sure"].startswith("high: it improves 2 of 2 traces and loses on none")


def test_k25_the_rest_of_the_ranking_says_why_each_does_not_pay(k25):
    advice, _ = k25
    by = {o["option"]: o for o in advice["ranking"]}
    assert [o["option"] for o in advice["ranking"]][:3] == ["raise-cap", "nothing", "in-engine"]
    assert by["in-engine"]["verdict"] == "no gain" and "never engages" in by["in-engine"]["note"]
    assert by["sleep"]["verdict"] == by["restart"]["verdict"] == by["always-plain"]["verdict"] == "trade-off"
    assert min(by["sleep"]["tokens_vs_today_percent"]) < -5  # sleep loses on bursts (-5.7 %)
    assert "requests cut" in by["restart"]["why"]
    assert by["partitioned"]["verdict"] == "not possible" and "whole GPU set" in by["partitioned"]["why"]


def test_k25_low_acceptance_is_said_with_the_step_cost_ratio(k25):
    advice, _ = k25
    text = "\n".join(advice["acceptance"])
    assert "single stream: speculative 95.9 tok/s vs plain 92.6 (+3.6%)" in text
    assert "at accept length 2.4 tokens/step a speculative step costs 2.32x" in text
    assert "at the published 3.1 it would cost 2.99x a plain one" in text
    assert "acceptance is low" in text


def test_k25_what_it_writes_loads_with_the_gateways_and_the_profiles_own_loaders(k25):
    _, out = k25
    settings = load_settings(out / "gateway.toml")
    assert (settings.topology, settings.threshold, settings.switching.mechanism) == (
        "time-shared",
        MAX_THRESHOLD,
        "manual",
    )
    assert settings.served_model_names == ["moonshotai/Kimi-K2.5"]
    text = (out / "kimi-k25-time-shared.toml").read_text()
    changed = parse_profile(text, name="kimi-k25-time-shared", source="written")
    before = load_deployment("kimi-k25-time-shared")
    caps = {s.role: (s.max_running_requests, s.cuda_graph_max_bs_decode) for s in changed.servers}
    assert caps == {"speculative": (256, 256), "plain": (256, 256)}
    assert [s.model_dump() for s in changed.servers if s.role == "plain"] == [
        s.model_dump() for s in before.servers if s.role == "plain"
    ]
    assert tomllib.loads(text)["topology"] == "time-shared"


def test_a_partitioned_config_carries_the_threshold_and_the_share_fitted_with_it(tmp_path):
    option = Option("partitioned", "partitioned split, spillover at 0, share 0.35", spillover_share=0.35)
    written = tmp_path / "gateway.toml"
    written.write_text(gateway_config(option, None, threshold=0))
    settings = load_settings(written)
    assert (settings.topology, settings.policy, settings.threshold, settings.spillover_share) == (
        "partitioned",
        "spillover",
        0,
        0.35,
    )


def test_the_step_cost_ratio_of_the_reference_figures():
    lines = step_cost_lines(96.1, 92.6, 3.1, "moonshotai/Kimi-K2.5")
    assert lines[0] == "single stream: speculative 96.1 tok/s vs plain 92.6 (+3.8%)"
    assert "costs 2.99x" in lines[1] and "acceptance is low" in lines[2]
    assert step_cost_lines(0.0, 92.6, 3.1, None) == [
        "single stream: no data (a target completed nothing at C=1): no step-cost ratio"
    ]


# --- from a bench of the stand-ins ---------------------------------------------------------------------------


def stand_in_bench(**changes: dict) -> list[Level]:
    """A sweep of the k25 stand-ins (tok/s, intervals +-2 %, TTFT ms as they measure): speculation ahead at low
    load, queueing behind its cap of 48 from C = 70, plain ahead there."""
    curves = {
        "speculative": {1: (95.7, 90, 95), 10: (281.6, 95, 110), 30: (330.5, 130, 160), 70: (340.3, 33000, 40000)},
        "plain": {1: (92.9, 90, 95), 10: (285.8, 300, 400), 30: (337.7, 900, 1100), 70: (356.0, 2500, 2800)},
    }
    levels = []
    for target, curve in curves.items():
        for c, (tps, ttft, p99) in curve.items():
            fields = {
                "output_throughput_interval": (tps * 0.98, tps * 1.02),
                "median_ttft_ms": ttft,
                "p99_ttft_ms": p99,
                "mean_tokens_per_chunk": 2.4 if target == "speculative" else 1.0,
                **changes.get(f"{target}@{c}", {}),
            }
            levels.append(make_level(target, c, tps, **fields))
    return levels


def results_of(levels: list[Level]):
    from crossover.loadtest.results import build_results

    metadata = load_results(FIXTURE).metadata
    return build_results(metadata, levels, "speculative", "plain")


def test_bench_of_the_stand_ins_ranks_a_switch_first_and_says_the_cap_queues():
    advice = advise_results(results_of(stand_in_bench()))
    by = {o.key: o for o in advice.ranked}
    # Ties up to C = 30 (the bench names no crossover), plain clearly ahead at C = 70: speculate through the
    # ties, plain from 70 - more tokens and no queue there, the same elsewhere.
    assert advice.ranked[0].key == "switch" and advice.ranked[0].verdict == "pays"
    assert advice.ranked[0].title.startswith("switch by load at threshold 69")
    assert by["switch"].gains(advice.today) == pytest.approx([0, 0, 0, 100 * (356.0 / 340.3 - 1)])
    assert advice.ranked[1] is advice.today
    assert by["always-plain"].verdict == "trade-off"  # TTFT p50 worse at C = 10, 30
    assert "queueing at C=30->70" in by["raise-cap"].why
    assert by["partitioned"].verdict == "not possible"
    assert "single stream: speculative 95.7 tok/s vs plain 92.9 (+3.0%)" in advice.acceptance[0]
    assert "accept length 2.4 tokens/step a speculative step costs 2.33x" in advice.acceptance[1]


def test_bench_no_data_at_a_level_is_left_out_not_a_verdict():
    empty = {"completed": 0, "failed": 12, "output_throughput_interval": None, "median_ttft_ms": None}
    results = results_of(stand_in_bench(**{"speculative@1": {**empty}}))
    results.levels[0] = make_level("speculative", 1, 0.0, **empty)
    results.crossover = results_of(results.levels).crossover
    assert results.crossover.evidence[0].verdict == "no_data"
    assert results.crossover.recommended_threshold.switch != 0
    advice = advise_results(results)
    assert advice.refused is None
    assert [o.where for o in advice.today.outcomes] == ["C=10", "C=30", "C=70"]
    assert "no data at C=1 (speculative completed nothing): left out" in advice.assumptions
    assert advice.acceptance == ["single stream: no data (a target completed nothing at C=1): no step-cost ratio"]


def test_bench_with_no_level_of_data_refuses_with_a_clear_message(tmp_path):
    levels = [
        make_level(t, c, 0.0 if t == "speculative" else 100.0, completed=0 if t == "speculative" else 50)
        for t in ("speculative", "plain")
        for c in (1, 4)
    ]
    results = results_of(levels)
    assert results.crossover.status == "no_data" and results.crossover.recommended_threshold is None
    path = tmp_path / "results.json"
    path.write_text(results.model_dump_json())
    code, text = run(["--results", str(path), "--write", str(tmp_path / "out")])
    assert code == 1 and not (tmp_path / "out").exists()
    assert text.strip() == (
        "crossover advise: nothing to advise: no data at C=1 (speculative completed nothing), C=4 (speculative "
        "completed nothing): no level where both targets completed a request"
    )
