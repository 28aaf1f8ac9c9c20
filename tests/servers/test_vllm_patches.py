"""patches/vllm-0.32.0 on the real vLLM 0.32.0 (the CPU build in .venv-vllm), through `crossover patches`: applies,
is idempotent, checks, reverts to the release byte for byte, refuses another release; `--python` alone finds the
engine the interpreter has. Then the patch's own tests, in vLLM's layout (patches/vllm-0.32.0/tests/v1/), run in
that venv on the patched tree: the schedule's policy, the real Scheduler built from a real VllmConfig reading the
rewritten lookup, EngineCore's utility, the dev route with its admin key, fence and bounds.

The installed vLLM is never modified (the venv is shared): each test patches an overlay of links to it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from crossover.servers import patches
from crossover.servers.sglang_check import site_packages
from crossover.servers.vllm_check import VLLM_VERSION
from tests.conftest import crossover_argv
from tests.patched_tree import overlay
from tests.servers.conftest import VLLM_VENV

SUITE_TIMEOUT_S = 600.0
VLLM_TESTS = patches.patch_dir(VLLM_VERSION, "vllm") / "tests" / "v1" / "spec_decode"


def series() -> list[patches.FileSeries]:
    return patches.load_patches(VLLM_VERSION, "vllm")


@pytest.fixture(scope="module")
def release(vllm_python: Path) -> Path:
    """The site-packages holding the venv's (unpatched) vllm 0.32.0."""
    root = site_packages(VLLM_VENV)
    assert patches.tree_version(root, "vllm") == VLLM_VERSION
    return root


@pytest.fixture
def tree(release: Path, tmp_path: Path) -> Path:
    return overlay(release, tmp_path / "tree", "vllm", [fs.path for fs in series()])


def run_patches(*args: str) -> subprocess.CompletedProcess:
    argv = crossover_argv("patches", *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, check=False)


def touched(tree: Path) -> dict[str, bytes]:
    return {fs.path: (tree / fs.path).read_bytes() for fs in series()}


def test_apply_is_idempotent_check_says_so_and_revert_restores_the_release(tree, release, vllm_python):
    before = touched(tree)
    result = run_patches("check", "--vllm", str(tree))
    assert result.returncode == 1 and "vLLM 0.32.0" in result.stdout and "patches not applied" in result.stdout

    result = run_patches("apply", "--vllm", str(tree / "vllm"), "--python", str(vllm_python))
    assert result.returncode == 0, result.stderr
    assert "applied to vLLM 0.32.0" in result.stdout  # and every touched module imported in the venv
    applied = touched(tree)
    assert all(applied[path] != before[path] for path in before)
    assert run_patches("apply", "--vllm", str(tree), "--no-import-check").stdout.startswith("already applied")
    assert run_patches("check", "--vllm", str(tree)).returncode == 0

    result = run_patches("revert", "--vllm", str(tree))
    assert result.returncode == 0, result.stderr
    assert touched(tree) == before == {path: (release / path).read_bytes() for path in before}


def test_the_engine_is_the_one_the_interpreter_has(vllm_python, release):
    result = run_patches("check", "--python", str(vllm_python))
    assert result.returncode == 1, result.stderr  # the venv's own vLLM, unpatched
    expected = f"vLLM 0.32.0 at {(release / 'vllm').resolve()} (patches/vllm-0.32.0/): patches not applied"
    assert expected in result.stdout
    assert "Starlette" not in result.stdout  # SGLang's auth middleware concern, not vLLM's


def test_another_release_is_refused_and_left_alone(tree):
    version = tree / "vllm" / "_version.py"
    text = version.read_text().replace("'0.32.0'", "'0.33.0'")
    version.unlink()
    version.write_text(text)
    before = touched(tree)
    result = run_patches("apply", "--vllm", str(tree))
    assert result.returncode == 2
    assert "vLLM 0.33.0" in result.stderr and "for vLLM 0.32.0 and 0.34.0 only" in result.stderr
    assert touched(tree) == before


@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_the_patch_tests_pass_on_the_patched_tree_on_cpu(tree, vllm_python):
    assert patches.apply(tree, VLLM_VERSION, package="vllm", verify=False).changed
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run(
        [str(vllm_python), "-m", "unittest", "-v", "test_speculation_gate"],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        cwd=VLLM_TESTS,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stderr.rstrip().endswith("OK")
    # It ran against the patched tree: on the release the suite cannot import what it tests.
    env["PYTHONPATH"] = ""
    unpatched = subprocess.run(
        [str(vllm_python), "-m", "unittest", "test_speculation_gate"],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        cwd=VLLM_TESTS,
        check=False,
    )
    assert unpatched.returncode != 0
    assert "cannot import name" in unpatched.stderr and "vllm.v1.spec_decode.dynamic.utils" in unpatched.stderr


# Run in the vLLM venv on the patched tree: each body through the route's own check, then the engine's
# SpeculationGate on a fresh schedule; prints [status, reason] per body.
PARITY_SCRIPT = """
import json, sys
from vllm.entrypoints.serve.dev.sleep.api_router import _GATE_STATUS, _gate_body_problem
from vllm.v1.spec_decode.dynamic.utils import SpeculationGate, SpeculationGateRefused
setup = json.loads(sys.stdin.read())
verdicts = []
for body in setup["bodies"]:
    if _gate_body_problem(body):
        verdicts.append([400, "invalid_body"])
        continue
    gate = SpeculationGate(setup["schedule"], setup["max_num_seqs"], setup["num_steps"])
    try:
        gate.update(body)
    except SpeculationGateRefused as exc:
        verdicts.append([_GATE_STATUS[exc.reason], exc.reason])
    else:
        verdicts.append([200, ""])
print(json.dumps(verdicts))
"""
BODIES = [
    {"zero_spec_tokens_above_batch_size": 4},
    {"zero_spec_tokens_above_batch_size": None},
    {"zero_spec_tokens_above_batch_size": 0, "dry_run": True},
    {"zero_spec_tokens_above_batch_size": -1},
    {"zero_spec_tokens_above_batch_size": 2**31},
    {"zero_spec_tokens_above_batch_size": True},
    {"zero_spec_tokens_above_batch_size": "4"},
    {"zero_spec_tokens_above_batch_size": 4, "expected_generation": 0},
    {"zero_spec_tokens_above_batch_size": 4, "expected_generation": 3},
    {"num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 64, 0]]},
    {"num_speculative_tokens_per_batch_size": [[1, 64, 2]]},
    {"num_speculative_tokens_per_batch_size": [[2, 64, 0]]},
    {"num_speculative_tokens_per_batch_size": [[1, 8, 3], [8, 64, 0]]},
    # K=3 past 511, the widest batch the stand-in's start-up schedule drafts 3 at (max_num_seqs 512): refused,
    # directly, through the tail carrying it, or through a gap; a gap that stays inside it is not.
    {"num_speculative_tokens_per_batch_size": [[1, 512, 3]]},
    {"num_speculative_tokens_per_batch_size": [[1, 511, 3]]},
    {"num_speculative_tokens_per_batch_size": [[1, 4, 0], [5, 500, 3]]},
    {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [10, 512, 0]]},
    {"num_speculative_tokens_per_batch_size": []},
    {"num_speculative_tokens_per_batch_size": [[1, 1, 0]] * 300},
    {"num_speculative_tokens_per_batch_size": "all"},
    {"num_speculative_tokens_per_batch_size": [[1, 64, 3]], "reset_schedule": True},
    {"reset_schedule": True},
    {"dry_run": "yes"},
    {"surprise": 1},
    {},
    [],
]


def test_the_stand_in_judges_every_body_as_the_patch_does(tree, vllm_python):
    """The same bodies through the patch's route check and SpeculationGate (in the vLLM venv, on the stand-in's
    start-up schedule) and through the stand-in's vLLM gate (servers/sim/vllm_gate.py): the same status and reason."""
    import json
    import random

    from crossover.servers.sim.engine import Engine
    from crossover.servers.sim.profile import load_profile
    from crossover.servers.sim.speculation_gate import GateError
    from crossover.servers.sim.vllm_gate import VLLMStandInGate

    profile = load_profile("llama8b-h200-eagle3")

    def stand_in() -> VLLMStandInGate:
        return VLLMStandInGate(Engine(profile, random.Random(0)), profile.speculative.num_steps)

    def verdict(body) -> list:
        try:
            stand_in().update(body)
        except GateError as exc:
            return [exc.status, exc.reason]
        return [200, ""]

    assert patches.apply(tree, VLLM_VERSION, package="vllm", verify=False).changed
    gate = stand_in()
    setup = {
        "bodies": BODIES,
        "schedule": gate.startup_schedule,
        "max_num_seqs": gate.max_num_seqs,
        "num_steps": gate.num_steps,
    }
    result = subprocess.run(
        [str(vllm_python), "-c", PARITY_SCRIPT],
        input=json.dumps(setup),
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(tree), "VLLM_LOGGING_LEVEL": "ERROR"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    patch = json.loads(result.stdout.strip().splitlines()[-1])
    mine = [verdict(body) for body in BODIES]
    differ = [(b, m, p) for b, m, p in zip(BODIES, mine, patch, strict=True) if m != p]
    assert differ == [], differ
    assert {status for status, _ in mine} == {200, 400, 409}
