"""`crossover bench --in-engine`: one patched engine (the stand-in with `--speculation-gate`, playing SGLang on either
of its wires or vLLM) measured with its gate off and at 0, beside a plain stand-in, through the real CLI.

The stand-ins run at time scale 1 (k25 steps of tens of milliseconds), so a busy machine does not push them
off their profiles; nothing here judges speed, only what the run reports and what it leaves on the engine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest

from crossover.loadtest.engine_gate import GATE_OFF, GATE_ZERO
from crossover.loadtest.results import load_schema
from tests.loadtest.run_cli import crossover
from tests.loadtest.test_bench import crossover_cli

ADMIN_KEY = "engine-admin"
ORIGINAL_GATE = 24  # what the shipped in-engine profile sets: the run must leave it there
STAND_IN = ("--time-scale", "1", "--log-level", "warning")
LEVELS = "1,8"
RUN = ("--duration-per-level", "2", "--warmup-rounds", "1", "--output-len", "16", "--input-len", "16", "--no-plots")
WAIT_S = 60.0


# How each engine's patch is started on the stand-in, and where its gate is read.
ENGINE_FLAGS = {
    "sglang": ("--speculation-gate",),
    "sglang-main": ("--speculation-gate", "--speculation-gate-wire", "main"),
    "vllm": ("--engine", "vllm", "--speculation-gate"),
}
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def gate_of(url: str, engine: str = "sglang") -> int | None:
    if engine == "vllm":
        return httpx.get(f"{url}/speculation_gate", headers=AUTH, timeout=10).json()[
            "zero_spec_tokens_above_batch_size"
        ]
    if engine == "sglang-main":
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        return info["internal_states"][0]["speculative_adaptive"]["zero_steps_above_bs"]
    return httpx.get(f"{url}/speculative/adaptive", timeout=10).json()["state"]["zero_steps_above_bs"]


def patched_engine(sim, tmp_path, engine: str = "sglang"):
    server = sim("k25-eagle3", *STAND_IN, *ENGINE_FLAGS[engine], "--admin-api-key", ADMIN_KEY)
    if engine == "vllm":
        route, body = "/speculation_gate", {"zero_spec_tokens_above_batch_size": ORIGINAL_GATE}
    elif engine == "sglang-main":
        route, body = (
            "/set_internal_state",
            {"server_args": {"speculative_adaptive_zero_steps_above_bs": ORIGINAL_GATE}},
        )
    else:
        route, body = "/speculative/adaptive", {"zero_steps_above_bs": ORIGINAL_GATE}
    httpx.post(f"{server.url}{route}", json=body, headers=AUTH, timeout=10).raise_for_status()
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    return server, key_file


@pytest.mark.parametrize("kind", list(ENGINE_FLAGS))
def test_gate_off_and_gate_0_are_two_targets_compared_and_against_plain_and_the_gate_is_restored(sim, tmp_path, kind):
    engine, key_file = patched_engine(sim, tmp_path, kind)
    plain = sim("k25-plain", *STAND_IN)
    out = tmp_path / "run"
    done = crossover_cli(
        "bench",
        "--in-engine",
        engine.url,
        "--admin-key-file",
        str(key_file),
        "--target",
        f"plain={plain.url}",
        "--concurrency",
        LEVELS,
        "--out",
        str(out),
        *RUN,
    )
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    assert gate_of(engine.url, kind) == ORIGINAL_GATE
    assert f"gate restored to {ORIGINAL_GATE}" in done.stdout
    # The run's crossover is gate-0 against gate-off; both settings are also set against plain.
    for versus in (f"{GATE_ZERO} vs {GATE_OFF}", f"plain vs {GATE_OFF}", f"plain vs {GATE_ZERO}"):
        assert f"crossover evidence: {versus}" in done.stdout

    run = json.loads((out / "results.json").read_text())
    jsonschema.validate(run, load_schema())
    assert (run["crossover"]["speculative"], run["crossover"]["plain"]) == (GATE_OFF, GATE_ZERO)
    assert run["crossover"]["status"] != "not_computed"
    assert {(lv["target"], lv["concurrency"]) for lv in run["levels"]} == {
        (name, c) for name in (GATE_OFF, GATE_ZERO, "plain") for c in (1, 8)
    }
    assert all(lv["completed"] > 0 and lv["failed"] == 0 for lv in run["levels"])
    assert run["metadata"]["targets"][GATE_OFF]["url"] == run["metadata"]["targets"][GATE_ZERO]["url"] == engine.url
    # The engine ran both settings: zero-step batches while gate-0 was measured, speculative ones otherwise.
    if kind == "sglang":
        state = httpx.get(f"{engine.url}/speculative/adaptive", timeout=10).json()["state"]
        assert 0 < state["zero_step_batches"] < state["decode_batches"]


def test_without_the_admin_key_the_run_stops_before_measuring_and_the_gate_is_untouched(sim, tmp_path):
    engine, _ = patched_engine(sim, tmp_path)
    done = crossover_cli("bench", "--in-engine", engine.url, "--concurrency", "1", "--out", str(tmp_path), *RUN)
    assert done.returncode == 1
    assert "401" in done.stderr and "--admin-key-file" in done.stderr
    assert gate_of(engine.url) == ORIGINAL_GATE


def test_ctrl_c_mid_sweep_restores_the_engines_gate(sim, tmp_path):
    engine, key_file = patched_engine(sim, tmp_path)
    argv = ["bench", "--in-engine", engine.url, "--admin-key-file", str(key_file), "--concurrency", "1,2,4,8"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "crossover.gateway.cli", *argv, "--out", str(tmp_path / "run"), *RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The event to interrupt on: the engine moved off its own gate, so the sweep is under way.
        deadline = time.monotonic() + WAIT_S
        while gate_of(engine.url) == ORIGINAL_GATE:
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "the sweep never set the gate"
        bench.send_signal(signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=WAIT_S)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, stderr
    assert "interrupted" in stderr
    assert gate_of(engine.url) == ORIGINAL_GATE, stdout


def test_an_unreadable_or_empty_key_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "empty.key").write_text("\n")
    for key_file, why in ((tmp_path / "missing.key", "cannot be read"), (tmp_path / "empty.key", "is empty")):
        argv = ("--in-engine", "http://127.0.0.1:9", "--admin-key-file", str(key_file), "--out", str(tmp_path))
        assert crossover("bench", *argv) == 2
        assert f"--admin-key-file {key_file} {why}" in capsys.readouterr().err
