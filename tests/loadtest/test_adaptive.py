"""`crossover servers adaptive-config`: draft steps where speculation measured ahead, zero steps from the
measured crossover on, in a file SGLang 0.5.23's own loader (`_load_adaptive_config`) accepts."""

from __future__ import annotations

import json
import math

import pytest

from crossover.loadtest.adaptive import AdaptiveConfigError, BenchResults, adaptive_config
from crossover.servers.process import spawn, stop
from crossover.servers.profile import load_profile
from crossover.servers.sglang_check import load_adaptive_config
from tests.conftest import crossover_argv
from tests.servers.conftest import run_cli

BENCH_TIMEOUT_S = 240.0


def results(curves: dict[str, dict[int, float]], server_info: dict | None = None) -> BenchResults:
    return BenchResults.model_validate(
        {
            "schema_version": 1,
            "metadata": {"targets": {"speculative": {"url": "x", "server_info": server_info}, "plain": {"url": "y"}}},
            "levels": [
                {"target": target, "concurrency": c, "output_throughput": tps, "failed": 0}
                for target, curve in curves.items()
                for c, tps in curve.items()
            ],
            "crossover": {"speculative": "speculative", "plain": "plain"},
        }
    )


def test_steps_below_the_crossover_and_none_from_it_on():
    run = results(
        {"speculative": {1: 96, 2: 180, 5: 300, 10: 330}, "plain": {1: 92, 2: 170, 5: 320, 10: 400}},
        server_info={"speculative_num_steps": 3, "max_running_requests": 128},
    )
    config, notes = adaptive_config(run)
    slots = {key: value["candidate_steps"] for key, value in config.items() if key.isdigit()}
    crossover = config["_crossover"]["crossover_concurrency"]
    assert 2 < crossover < 5
    assert slots == {"1": [1, 2, 3], str(math.ceil(crossover)): [0]}
    assert any("draft-extend" in note for note in notes)
    assert any("running-request cap" in note for note in notes)


def test_a_cap_below_the_zero_step_slot_is_reported():
    run = results(
        {"speculative": {1: 96, 30: 320, 70: 340}, "plain": {1: 92, 30: 280, 70: 352}},
        server_info={"speculative_num_steps": 3, "max_running_requests": 48},
    )
    config, notes = adaptive_config(run)
    assert [k for k in config if k.isdigit()] == ["1", str(math.ceil(config["_crossover"]["crossover_concurrency"]))]
    assert any("never reach the zero-step slot" in note for note in notes)


def test_no_crossover_in_range_keeps_speculating_and_says_so():
    config, notes = adaptive_config(results({"speculative": {1: 96, 10: 300}, "plain": {1: 92, 10: 200}}))
    assert {k: v["candidate_steps"] for k, v in config.items() if k.isdigit()} == {"1": [1, 2, 3]}
    assert any("no zero-step slot" in note for note in notes)


def test_plain_ahead_everywhere_turns_speculation_off():
    config, _ = adaptive_config(results({"speculative": {1: 88, 10: 300}, "plain": {1: 92, 10: 400}}), steps=[2, 4])
    assert {k: v["candidate_steps"] for k, v in config.items() if k.isdigit()} == {"1": [0]}


def test_a_run_without_the_pair_is_refused():
    with pytest.raises(AdaptiveConfigError, match="no measured levels for target"):
        adaptive_config(results({"speculative": {1: 96}, "routed": {1: 90}}))


def test_cli_refuses_a_file_that_is_not_a_results_file(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"levels": "no"}))
    result = run_cli("adaptive-config", str(bad))
    assert result.returncode == 2
    assert "not a crossover bench results file" in result.stderr


def test_a_bench_of_two_standins_gives_a_config_sglang_loads(tmp_path, sglang_python, standin_profile, state_dir):
    """End to end: the stand-ins of standin-partitioned, a real `crossover bench` between them, the config
    from its results.json, loaded by SGLang 0.5.23's own loader."""
    # Time scale 5, not 20: stand-ins that keep their schedule on a busy machine.
    profile_path = standin_profile("standin-partitioned", time_scale=5)
    up = run_cli("up", str(profile_path), "--state-dir", str(state_dir))
    assert up.returncode == 0, up.stderr
    profile = load_profile(profile_path)
    out = tmp_path / "bench"
    bench = spawn(
        crossover_argv(
            "bench",
            *(f"--target={s.name}={s.url}" for s in profile.servers),
            "--concurrency=1,2,8,32",
            "--output-len=128",
            "--input-len=16",
            "--requests-per-level=16",
            "--no-plots",
            f"--out={out}",
        ),
        die_with_parent=False,
    )
    try:
        code = bench.wait(BENCH_TIMEOUT_S)
    finally:
        stop([bench])
    measured = json.loads((out / "results.json").read_text())["crossover"]
    # 0, or 1 for a crossover the bench refused to name because a stand-in fell behind its schedule (a busy
    # machine): the results are written either way, and the config is still made from them.
    assert code == (1 if measured["status"] == "refused" else 0), measured

    config_path = tmp_path / "adaptive.json"
    result = run_cli("adaptive-config", str(out / "results.json"), "-o", str(config_path))
    assert result.returncode == 0, result.stderr
    assert "cannot change" in result.stderr
    written = json.loads(config_path.read_text())
    loaded = load_adaptive_config(sglang_python, config_path)
    assert loaded == {k: v["candidate_steps"] for k, v in written.items() if k.isdigit()}
    assert "1" in loaded, "every batch size from 1 on has a slot"
    # The same crossover the bench reported (which side wins with short requests is the run's), or a note that
    # the bench did not trust the curves.
    if measured["status"] == "refused":
        assert "refused to name a crossover" in result.stderr
    else:
        assert written["_crossover"]["status"] == measured["status"]


@pytest.mark.parametrize(
    "curves",
    [
        {"speculative": {1: 96, 2: 180, 5: 300}, "plain": {1: 92, 2: 170, 5: 320}},
        {"speculative": {1: 90, 10: 300}, "plain": {1: 92, 10: 400}},
        {"speculative": {1: 96, 10: 300}, "plain": {1: 92, 10: 200}},
    ],
    ids=["crossed", "plain-ahead", "not-reached"],
)
def test_sglang_loads_every_kind_of_config(tmp_path, sglang_python, curves):
    config, _ = adaptive_config(results(curves))
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(config))
    assert load_adaptive_config(sglang_python, path) == {
        k: v["candidate_steps"] for k, v in config.items() if k.isdigit()
    }
