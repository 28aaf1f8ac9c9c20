"""A real gated vLLM 0.32.0 on CPU: patches/vllm-0.32.0 applied to an overlay of the installed package (the shared
venv is never modified), the server started as servers/ starts the gated profile (`launch_command` of an in-engine
vLLM server: the start-up schedule with both query lengths in force, dev mode, the gate's key in the environment),
and the project's gateway (in-engine, `engine = "vllm"`) in front of it.

- The gateway's threshold is the engine's gate, read back from the engine's own route and gauge.
- A POST without the admin key, and one whose fencing token is lower than one an applied update carried, are refused
  (the latter in the words `Fenced.highest` reads) and move nothing.
- vLLM's own spec-decode counters: a batch above the gate drafts (next to) nothing; the same batch below it drafts.

Its own module-scoped server (not tests/real_vllm/conftest.py's session pair), pinned to one core; every wait bounded.
On this project's 2-core AVX2 host the tiny target runs ~7 tok/s speculative: a batch is 4 prompts x 12 tokens.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import openai
import pytest

from crossover.gateway.engines import FENCE_HEADER, Fenced, vllm
from crossover.servers import patches
from crossover.servers.launch import launch_command
from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.profile import parse_profile
from crossover.servers.sglang_check import site_packages, venv_python
from crossover.servers.vllm_check import VLLM_VERSION
from tests.patched_tree import overlay
from tests.real_vllm import tiny_model
from tests.real_vllm.conftest import (
    ACCEPTANCE_LENGTH,
    DRAFT_TOKENS,
    MODEL_NAME,
    READY_TIMEOUT_S,
    ROOT,
    VLLMServer,
    server_env,
    vllm_venv,
)

ADMIN_KEY = "gate-admin-key-for-the-test"
GATEWAY_TOKEN = "gateway-admin-token"
CAP = 8  # --max-num-seqs: the start-up schedule is [[1, 7, 3], [8, 8, 0]]
PROMPTS = 4
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 300.0
DRAFTS = "vllm:spec_decode_num_drafts_total"

PROFILE = f"""
description = "the tiny Llama, gated, on one CPU core"
topology = "in-engine"
[[servers]]
name = "gated"
role = "speculative"
engine = "vllm"
device = "cpu"
model_path = "{{model}}/target"
served_model_name = "{MODEL_NAME}"
host = "127.0.0.1"
port = {{port}}
max_running_requests = {CAP}
admin_api_key_file = "{{key}}"
extra_args = ["--load-format", "dummy"]
[servers.speculative]
draft_model_path = "{{model}}/draft"
num_steps = {DRAFT_TOKENS}
eagle_topk = 1
num_draft_tokens = {DRAFT_TOKENS + 1}
vllm_config = {{{{ rejection_sample_method = "synthetic", synthetic_acceptance_length = {ACCEPTANCE_LENGTH} }}}}
"""


@pytest.fixture(scope="module")
def gated_vllm(tmp_path_factory):
    venv = vllm_venv()
    base = tmp_path_factory.mktemp("gated-vllm")
    model = tiny_model.build(venv, base / "model", ROOT)
    release = site_packages(venv)
    tree = overlay(release, base / "patched", "vllm", [fs.path for fs in patches.load_patches(VLLM_VERSION, "vllm")])
    assert patches.apply(tree, VLLM_VERSION, package="vllm", verify=False).changed
    key = base / "gate.key"
    key.write_text(ADMIN_KEY + "\n")
    key.chmod(0o600)
    port = free_port()
    profile = parse_profile(PROFILE.format(model=model, port=port, key=key), name="gated", source="test")
    command = launch_command(profile, profile.servers[0])
    core = sorted(os.sched_getaffinity(0))[-1]
    argv = ["taskset", "-c", str(core), str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    env = {**server_env(venv, core), **command.run_env(), "PYTHONPATH": str(tree)}
    log = base / "gated.log"
    with log.open("wb") as out:
        proc = spawn([*argv, *command.server_args], env=env, stdout=out, stderr=subprocess.STDOUT)
    server = VLLMServer("gated", f"http://127.0.0.1:{port}", core, proc, log)
    try:
        try:
            wait_ready(server.url + "/health", proc, READY_TIMEOUT_S)
            one_token = {"model": MODEL_NAME, "prompt": "Say OK.", "max_tokens": 1}
            wait_ready(server.url + "/v1/completions", proc, READY_TIMEOUT_S, json=one_token)
        except Exception as error:
            raise AssertionError(f"gated vLLM: {error}\n{log.read_text(errors='replace')[-4000:]}") from None
        yield server
    finally:
        stop([proc])


def engine_gate(server: VLLMServer, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + vllm.GATE_PATH, headers=headers, timeout=30, trust_env=False)


def post_gate(server: VLLMServer, body: dict, key: str | None = ADMIN_KEY, fence: int | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if fence is not None:
        headers[FENCE_HEADER] = str(fence)
    return httpx.post(server.url + vllm.GATE_PATH, json=body, headers=headers, timeout=30, trust_env=False)


def drafts_of_one_batch(gateway_url: str, server: VLLMServer) -> float:
    """vLLM's draft count for one batch of PROMPTS prompts sent as one request (they join one batch)."""
    before = server.metric(DRAFTS)
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    answer = client.completions.create(
        model=MODEL_NAME,
        prompt=[f"Count from {i} onwards:" for i in range(PROMPTS)],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [choice.finish_reason for choice in answer.choices] == ["length"] * PROMPTS
    return server.metric(DRAFTS) - before


def test_the_gateway_moves_the_real_engines_gate_refusals_move_nothing_and_drafts_stop_above_it(gated_vllm, gateway):
    server = gated_vllm
    state = engine_gate(server).json()
    assert state["startup_num_speculative_tokens_per_batch_size"] == [[1, CAP - 1, DRAFT_TOKENS], [CAP, CAP, 0]]
    assert state["allowed_num_speculative_tokens"] == [0, DRAFT_TOKENS]
    assert state["zero_spec_tokens_above_batch_size"] is None

    gw = gateway(
        [],
        [],
        topology="in-engine",
        threshold=1,
        admin_token=GATEWAY_TOKEN,
        pools={"speculative": {"backends": [server.url], "engine": "vllm", "admin_api_key": ADMIN_KEY}},
        health={"interval": 0.5, "timeout": 30.0},
    )
    state = engine_gate(server).json()
    assert state["zero_spec_tokens_above_batch_size"] == 1 and state["generation"] >= 1  # set at the gateway's start
    assert server.metric("vllm:spec_decode_gate") == 1

    # Refused, and nothing moves: no admin key; a fencing token below one an applied update carried.
    assert post_gate(server, {"zero_spec_tokens_above_batch_size": 5}, key=None).status_code == 401
    assert engine_gate(server, key=None).status_code == 401
    assert post_gate(server, {"zero_spec_tokens_above_batch_size": 1}, fence=7).status_code == 200
    stale = post_gate(server, {"zero_spec_tokens_above_batch_size": 5}, fence=6)
    assert (stale.status_code, stale.json()["error"]["type"]) == (409, "fenced")
    assert Fenced(stale.json()["error"]["message"]).highest == 7  # in refusal()'s words
    refused = post_gate(server, {"num_speculative_tokens_per_batch_size": [[1, CAP, 2]]}, fence=9)
    assert (refused.status_code, refused.json()["error"]["type"]) == (400, "rejected")  # K=2 never in force
    state = engine_gate(server).json()
    assert (state["zero_spec_tokens_above_batch_size"], state["highest_fence"]) == (1, 7)

    # A batch of 4 above the gate (1): next to no drafts - at most one round per prompt, should the prompts reach
    # the engine one step apart and the first run alone for a step.
    gated = drafts_of_one_batch(gw.url, server)
    # The gateway moves the gate above the batch: the start-up schedule's K=3 again, one draft per prompt per step.
    response = httpx.put(
        gw.url + "/admin/threshold",
        json={"threshold": CAP - 1},
        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert engine_gate(server).json()["zero_spec_tokens_above_batch_size"] == CAP - 1
    assert server.metric("vllm:spec_decode_gate") == CAP - 1
    speculating = drafts_of_one_batch(gw.url, server)
    print(f"drafts of one batch of {PROMPTS} x {MAX_TOKENS} tokens: gate 1 {gated:g}, gate {CAP - 1} {speculating:g}")
    assert gated <= PROMPTS, f"drafts went on above the gate: {gated}"
    # K=3 at ~2.75 tokens a round: about MAX_TOKENS / 2.75 rounds per prompt.
    assert speculating >= PROMPTS * 2, f"no speculation below the gate: {speculating}"
