"""The run-time speculation gate (patches/sglang-0.5.23), live: a copy of the serve venv's `sglang/` patched by
`crossover patches apply`, served by a second real SGLang 0.5.23 (plain, on CPU: EAGLE cannot run here) that
`crossover servers up` starts with the copy first on PYTHONPATH - the session's server stays the unpatched release.

On a plain server (started with an admin key) the patch's endpoint exists and says speculation does not apply
here (501); a POST without the admin key is a 401; every malformed body is a 400 from the HTTP process (it never
reaches the scheduler, whose socket decode must not fail) and the server still serves after each, a body past the
size bound among them; the fencing token is checked by the scheduler with the update, so a server without a gate
keeps no fence (every well-formed token is the same 501, a malformed one a 400 from the HTTP process); the
in-engine gateway refuses to start in front of it and says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import httpx
import pytest

from crossover.gateway.engines.fence import FENCE_HEADER
from crossover.gateway.engines.sglang import NotPatched
from crossover.gateway.topology.gates import ControlUnauthorized
from crossover.servers.process import free_port
from crossover.servers.sglang_check import venv_python
from crossover.servers.state import group_members
from tests.conftest import crossover_argv
from tests.gateway.gateway_helpers import start_in_engine
from tests.host_speed import StartupBudget
from tests.real_sglang.conftest import (
    CONFIGS,
    IDLE_START_S,
    SERVE_VENV,
    RealSGLang,
    alive,
    engine_processes_after_down,
    profile_text,
    running,
)
from tests.real_sglang.engine_env import STANDINS, sglang_dir

GATE = "/speculative/adaptive"
ADMIN_KEY = "patch-live-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# What the patch's scheduler answers when the server runs no speculation (internal_state.py,
# `_adaptive_controller`), through `_spec_adaptive_response` (http_server.py): a 501, not a 404 or a 400.
OFF = {
    "success": False,
    "message": "speculative decoding is not enabled on this server",
    "reason": "not_applicable",
    "partial": False,
}
MAX_INT = 2**31 - 1
FIELDS = "['zero_steps_above_bs', 'gate_min_dwell_steps', 'config', 'reset_config', 'expected_generation', 'dry_run']"
GATE_TYPE = f"zero_steps_above_bs must be an int in [0, {MAX_INT}] or null"
DEPTH = 10_000  # far past any JSON parser's nesting limit (orjson: 1024), within the 64 KiB body bound
# (id, raw body, in the patch's message): parse_runtime_update_body and normalize_adaptive_config
# (adaptive_spec_params.py), or the parser's error, each answered {"success": false, "message": ...}. SGLang's
# HTTP process parses with orjson (http_server.py's ORJSONRequest): an int past 64 bits arrives as a float, NaN
# is a syntax error (its position pinned), and nesting stops at 1024 levels (the patch's RecursionError
# branch, for the stdlib parser, is not reached).
MALFORMED = [
    ("not-json", b"{zero_steps_above_bs: 4", "line 1 column 2 (char 1)"),
    ("no-body", b"", "line 1 column 1 (char 0)"),
    ("not-an-object", b"[4]", "body must be a JSON object"),
    ("a-string-gate", b'{"zero_steps_above_bs": "4"}', GATE_TYPE),
    ("a-boolean-gate", b'{"zero_steps_above_bs": true}', GATE_TYPE),
    ("a-negative-gate", b'{"zero_steps_above_bs": -1}', GATE_TYPE),
    ("a-huge-gate", b'{"zero_steps_above_bs": %d}' % 10**30, GATE_TYPE),
    ("a-float-gate", b'{"zero_steps_above_bs": 4.5}', GATE_TYPE),
    ("an-unknown-field", b'{"threshold": 4}', f"unknown fields ['threshold']; allowed: {FIELDS}"),
    ("a-non-bool-flag", b'{"zero_steps_above_bs": 4, "dry_run": 1}', "dry_run must be true or false"),
    (
        "a-huge-step",
        b'{"config": {"1": {"candidate_steps": [%d]}}}' % 10**30,
        "BS 1: candidate_steps must be a non-empty list of at most 65 ints in [0, 64], got [1e+30]",
    ),
    (
        "an-unknown-slot-key",
        b'{"config": {"1": {"candidate_steps": [1], "steps": 2}}}',
        "BS 1: unknown keys ['steps']; allowed: ['candidate_steps', 'ema_alpha', 'update_interval', "
        "'warmup_batches', 'down_hysteresis', 'up_hysteresis', 'ceiling_coeff']",
    ),
    ("a-nan", b'{"config": {"1": {"candidate_steps": [1], "ema_alpha": NaN}}}', "line 1 column 56 (char 55)"),
    (
        "a-knob-out-of-range",
        b'{"config": {"1": {"candidate_steps": [1], "ema_alpha": 2}}}',
        "BS 1: ema_alpha must be a number in (0, 1], got 2",
    ),
    (
        "a-zero-interval",
        b'{"config": {"update_interval": 0, "1": {"candidate_steps": [1]}}}',
        "config: update_interval must be an int in [1, 2147483647], got 0",
    ),
    (
        "an-overflowing-ceiling",
        b'{"config": {"1": {"candidate_steps": [1], "ceiling_coeff": 1e308}}}',
        "BS 1: ceiling_coeff must be a number in [0, 64], got 1e+308",
    ),
    ("a-removed-switch", b'{"skip_zero_step_draft_extend": true}', "unknown fields ['skip_zero_step_draft_extend']"),
    (
        "config-and-reset",
        b'{"config": {"1": {"candidate_steps": [1]}}, "reset_config": true}',
        "give either config or reset_config, not both",
    ),
    ("deep-nesting", b"[" * DEPTH + b"]" * DEPTH, "depth limit exceeded"),
    (
        "past-the-slot-bound",
        b'{"config": {' + b", ".join(b'"%d": {"candidate_steps": [1]}' % bs for bs in range(1, 258)) + b"}}",
        "config has more than 256 BS slots",
    ),
    (
        "deep-nesting-under-a-comment-key",
        b'{"config": {"_note": ' + b"[" * DEPTH + b"]" * DEPTH + b"}}",
        "depth limit exceeded",
    ),
    (
        "nothing-to-change",
        b"{}",
        "nothing to change: give zero_steps_above_bs, gate_min_dwell_steps, config or reset_config",
    ),
]
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


@pytest.fixture(scope="module")
def patched_root(real_sglang, tmp_path_factory):
    """A directory holding a patched copy of the serve venv's `sglang/` (the venv itself is never touched)."""
    venv = SERVE_VENV
    root = tmp_path_factory.mktemp("patched-sglang")
    shutil.copytree(sglang_dir(venv), root / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    # The import check runs the serve venv's python, with the stand-ins it imports on CPU (as the server has).
    env = {**os.environ, "PYTHONPATH": str(STANDINS)}
    applied = patches("apply", "--sglang", str(root), "--python", str(venv_python(venv)), env=env)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.startswith(f"applied to SGLang 0.5.23 at {root / 'sglang'}: "), applied.stdout
    return root


def patches(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        crossover_argv("patches", *args), capture_output=True, text=True, timeout=600, env=env, check=False
    )


@pytest.fixture(scope="module")
def patched_server(real_sglang, patched_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("patched-server")
    ports = {name: free_port() for name in CONFIGS}
    standin_log = base / "standins.log"  # also this server's marker in its processes' environment
    profile = base / "patched.toml"
    # The session's time-shared profile of the same tiny model: `up` starts its initial (plain) mode only.
    budget = StartupBudget.measure(IDLE_START_S, "the patched real SGLang server")
    text = profile_text(
        SERVE_VENV, real_sglang.model_path, ports, standin_log, budget.seconds, first_on_path=patched_root
    )
    admin = f'"--dtype", "float32", "--admin-api-key", "{ADMIN_KEY}"]'
    profile.write_text(text.replace('"--dtype", "float32"]', admin))
    server = RealSGLang(
        profile=profile,
        state_dir=base / "state",
        urls={name: f"http://127.0.0.1:{port}" for name, port in ports.items()},
        model=real_sglang.model,
        model_path=real_sglang.model_path,
        standin_log=standin_log,
        budget=budget,
    )
    with running(server, "patched real SGLang"):
        yield server


@pytest.fixture(scope="module")
def patched_url(patched_server) -> str:
    return patched_server.urls["speculative"]  # the profile's initial mode: a plain server, whatever its name


def assert_serving(url: str) -> None:
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        assert client.get(url + "/health").status_code == 200
        answer = client.post(
            url + "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 1


def post_gate(url: str, raw: bytes, headers: dict[str, str] = ADMIN) -> httpx.Response:
    return httpx.post(
        url + GATE,
        content=raw,
        headers={"content-type": "application/json", **headers},
        timeout=TIMEOUT,
        trust_env=False,
    )


def test_the_copy_is_patched_and_the_session_venv_is_not(real_sglang, patched_root):
    check = patches("check", "--sglang", str(patched_root))
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.rstrip().endswith("patches applied"), check.stdout
    again = patches("apply", "--sglang", str(patched_root), "--no-import-check")
    assert again.returncode == 0 and "already applied" in again.stdout, again.stdout + again.stderr
    release = patches("check", "--sglang", str(sglang_dir(SERVE_VENV)))
    assert release.returncode == 1 and release.stdout.rstrip().endswith("patches not applied"), release.stdout


def test_the_unpatched_session_server_has_no_gate(real_sglang, active_url):
    assert httpx.get(active_url + GATE, timeout=30, trust_env=False).status_code == 404


def test_the_gate_says_speculation_does_not_apply_here(patched_url):
    read = httpx.get(patched_url + GATE, headers=ADMIN, timeout=30, trust_env=False)
    assert (read.status_code, read.json()) == (501, OFF)
    # A well-formed update reaches the scheduler, which refuses it the same way.
    update = post_gate(patched_url, b'{"zero_steps_above_bs": 4}')
    assert (update.status_code, update.json()) == (501, OFF)
    assert_serving(patched_url)


def test_the_gate_needs_the_admin_key(patched_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert post_gate(patched_url, b'{"zero_steps_above_bs": 4}', headers).status_code == 401
        assert httpx.get(patched_url + GATE, headers=headers, timeout=30, trust_env=False).status_code == 401
    assert_serving(patched_url)  # generation needs no key: the server has an admin key only


def test_a_server_without_a_gate_keeps_no_fence_and_a_malformed_token_is_a_400(patched_url):
    # The scheduler checks the fence with the update and raises it only when one is applied: here none is, so no
    # token - 10^17 included - raises it, and a lower one is answered as any other (501).
    for token in ("5", str(10**17), "4"):
        answer = post_gate(patched_url, b'{"zero_steps_above_bs": 4}', {**ADMIN, FENCE_HEADER: token})
        assert (answer.status_code, answer.json()["reason"]) == (501, "not_applicable"), (token, answer.text)
    bad = post_gate(patched_url, b'{"zero_steps_above_bs": 4}', {**ADMIN, FENCE_HEADER: "four"})
    assert (bad.status_code, bad.json()["reason"]) == (400, "invalid_fence"), bad.text
    assert_serving(patched_url)


def test_a_body_past_the_size_bound_is_a_400_and_the_server_still_serves(patched_url):
    padded = b'{"zero_steps_above_bs": 4}' + b" " * (64 * 1024)
    answer = post_gate(patched_url, padded)
    assert (answer.status_code, answer.json()["reason"]) == (400, "invalid_body"), answer.text[:500]
    assert "body too large" in answer.json()["message"]
    assert_serving(patched_url)


@pytest.mark.parametrize(("raw", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_a_malformed_body_is_a_400_and_the_server_still_serves(patched_url, raw, message):
    response = post_gate(patched_url, raw)
    assert response.status_code == 400, response.text[:500]
    body = response.json()
    assert set(body) == {"success", "message", "reason", "partial"} and body["success"] is False, body
    assert body["reason"] == "invalid_body"
    assert message in body["message"], body["message"]
    assert_serving(patched_url)


def test_the_metrics_count_the_refused_updates_only(patched_url):
    # Malformed bodies never reach the scheduler; each well-formed refused update counts as `rejected`. Other tests
    # share the server, so the count is judged by what this test adds. The gauges are set only by a server with a
    # gate to read.
    def counters() -> list[str]:
        metrics = httpx.get(patched_url + "/metrics", timeout=30, trust_env=False).text
        return [line for line in metrics.splitlines() if line.startswith("sglang:spec_adaptive_")]

    def rejected() -> float:
        lines = [line for line in counters() if 'result="rejected"' in line]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = rejected()
    assert post_gate(patched_url, b'{"zero_steps_above_bs": "x"}').status_code == 400
    assert rejected() == before
    assert post_gate(patched_url, b'{"zero_steps_above_bs": 4}').status_code == 501
    assert rejected() == before + 1
    lines = counters()
    assert [line.split("{")[0] for line in lines] == ["sglang:spec_adaptive_policy_updates_total"], lines


def test_the_in_engine_gateway_refuses_a_plain_patched_server_and_says_why(patched_url):
    with pytest.raises(NotPatched) as refused:
        start_in_engine([patched_url], admin_api_key=ADMIN_KEY)
    assert patched_url in str(refused.value)
    assert OFF["message"] in str(refused.value) and "HTTP 501" in str(refused.value)


def test_the_in_engine_gateway_without_the_admin_key_refuses_to_start(patched_url):
    with pytest.raises(ControlUnauthorized) as refused:
        start_in_engine([patched_url])  # the engine has an admin key: its GET answers 401 without it
    assert patched_url in str(refused.value) and "admin_api_key" in str(refused.value)
    assert "HTTP 401" in str(refused.value) and "\n" not in str(refused.value)


def test_down_stops_the_patched_server_and_leaves_no_process(patched_server):
    members = group_members(patched_server.pgids()["speculative"])
    assert members
    down = patched_server.run("down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert [pid for pid in members if alive(pid)] == []
    assert engine_processes_after_down(str(patched_server.standin_log)) == []
    with contextlib.suppress(FileNotFoundError):
        assert patched_server.pgids() == {}
