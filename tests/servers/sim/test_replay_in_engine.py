"""`crossover sim replay --mechanism in-engine`: the speculative engine alone with its zero-step gate."""

from __future__ import annotations

import json

from crossover.gateway.cli import main
from crossover.servers.sim.costs import ZERO_STEP_MODEL
from crossover.servers.sim.profile import load_profile, with_overrides
from crossover.servers.sim.replay import (
    ALWAYS_SPECULATIVE,
    IN_ENGINE,
    MECHANISMS,
    ReplaySetup,
    replay,
    zero_step_gate,
)
from crossover.servers.sim.trace import TracePhase


def llama(accept_length: float):
    spec = with_overrides(load_profile("llama8b-h200-eagle3"), accept_length=accept_length)
    return spec, load_profile("llama8b-h200-plain")


def test_the_gate_is_where_a_zero_step_out_yields_speculation_in_the_same_server():
    assert zero_step_gate(llama(2.0)[0], 512) is not None and 100 < zero_step_gate(llama(2.0)[0], 512) < 256
    assert zero_step_gate(llama(3.0)[0], 512) is None  # at accept length 3 EAGLE still wins at 512 (h200 table)


def test_in_engine_gains_above_the_gate_and_equals_speculation_below_it():
    spec, plain = llama(2.0)
    assert IN_ENGINE in MECHANISMS
    for concurrency, better in ((8, False), (384, True)):
        trace = [TracePhase(duration_s=30, concurrency=concurrency)]
        setup = ReplaySetup.from_profiles(spec, plain, trace, output_len=128)
        gated, always = replay(setup, trace, IN_ENGINE), replay(setup, trace, ALWAYS_SPECULATIVE)
        assert gated.switches == 0 and gated.requests_cut == 0
        if better:
            assert gated.output_tokens > always.output_tokens * 1.05
        else:
            assert gated.output_tokens == always.output_tokens


# --- what the command says it assumed ---------------------------------------------------------------------


def run_replay(capsys, tmp_path, *options: str) -> str:
    trace = tmp_path / "trace.csv"
    trace.write_text("duration_s,concurrency\n30,96\n")
    argv = ["sim", "replay", "--speculative", "llama8b-h200-eagle3", "--plain", "llama8b-h200-plain"]
    argv += ["--trace", str(trace), "--accept-length", "2.0", "--output-len", "128", *options]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_the_replay_states_its_gate_cost_model_pool_and_cap_in_text_and_json(capsys, tmp_path):
    spec, _ = llama(2.0)
    gate = zero_step_gate(spec, 256 + 128 // 2)
    assert gate is not None
    text = run_replay(capsys, tmp_path, "--mechanism", "in-engine")
    line = next(line for line in text.splitlines() if line.startswith("in-engine: "))
    assert f"gate {gate} " in line and ZERO_STEP_MODEL in line
    assert "pool llama8b-h200-eagle3 (KV 750000 tokens)" in line and line.endswith("running cap 512")

    (entry,) = json.loads(run_replay(capsys, tmp_path, "--mechanism", "in-engine", "--json"))
    assert entry["in_engine"] == {
        "gate": gate,
        "gate_context_tokens": 320,
        "zero_step_model": ZERO_STEP_MODEL,
        "pool": "llama8b-h200-eagle3",
        "kv_pool_tokens": 750000,
        "max_running_requests": 512,
    }
    # A gate that never engages is said so, not left blank.
    k25 = ["--speculative", "k25-eagle3", "--plain", "k25-plain", "--mechanism", "in-engine"]
    argv = ["sim", "replay", *k25, "--trace", str(tmp_path / "trace.csv"), "--output-len", "128"]
    assert main(argv) == 0
    assert "in-engine: gate none (speculation out-yields" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["in_engine"]["gate"] is None


def test_the_running_cap_is_an_option_and_bounds_the_requests_running_at_once(capsys, tmp_path):
    options = ("--mechanism", "in-engine,always-speculative", "--json")
    uncapped = {e["mechanism"]: e for e in json.loads(run_replay(capsys, tmp_path, *options))}
    capped = {
        e["mechanism"]: e for e in json.loads(run_replay(capsys, tmp_path, *options, "--max-running-requests", "32"))
    }
    assert uncapped[IN_ENGINE]["in_engine"]["max_running_requests"] == 512
    assert capped[IN_ENGINE]["in_engine"]["max_running_requests"] == 32
    for mechanism in (IN_ENGINE, ALWAYS_SPECULATIVE):  # the speculative server's cap: both run under it
        assert uncapped[mechanism]["running_peak"] == 96  # every client at once
        assert capped[mechanism]["running_peak"] == 32
    # The gate is looked for up to the cap: a cap below it leaves no gate to engage.
    assert capped[IN_ENGINE]["in_engine"]["gate"] is None
    assert capped[IN_ENGINE]["output_tokens"] < uncapped[IN_ENGINE]["output_tokens"]
    text = run_replay(capsys, tmp_path, "--mechanism", "in-engine", "--max-running-requests", "32")
    assert "running cap 32" in text
    assert text.splitlines()[-2].split()[-1] == "32"  # the table's peak running (the free-switch bound closes it)
