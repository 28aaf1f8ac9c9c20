"""A real gated vLLM 0.32.0 on CPU: patches/vllm-0.32.0 applied to an overlay of the installed package (the shared
venv is never modified), the server started as servers/ starts the gated profile (`launch_command` of an in-engine
vLLM server: the start-up schedule with both query lengths in force, dev mode, the gate's key in the environment),
and the project's gateway (in-engine, `engine = "vllm"`) in front of it.

- The gateway's threshold is the engine's gate, read back from the engine's own route and gauge.
- A POST without the admin key, and one whose fencing token is lower than one an applied update carried, are refused
  (the latter in the words `Fenced.highest` reads) and move nothing.
- vLLM's own spec-decode counters: a batch above the gate drafts (next to) nothing; the same batch below it drafts.

The server is the session's `gated_vllm` (tests/real_vllm/conftest.py), pinned to one core; every wait bounded.
On this project's 2-core AVX2 host the tiny target runs ~7 tok/s speculative: a batch is 4 prompts x 12 tokens.
"""

from __future__ import annotations

import httpx
import openai

from crossover.gateway.engines import FENCE_HEADER, Fenced, vllm
from tests.real_vllm.conftest import (
    DRAFT_TOKENS,
    GATE_ADMIN_KEY,
    GATE_CAP,
    MODEL_NAME,
    VLLMServer,
)

GATEWAY_TOKEN = "gateway-admin-token"
PROMPTS = 4
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 300.0
DRAFTS = "vllm:spec_decode_num_drafts_total"


def engine_gate(server: VLLMServer, key: str | None = GATE_ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + vllm.GATE_PATH, headers=headers, timeout=30, trust_env=False)


def post_gate(
    server: VLLMServer, body: dict, key: str | None = GATE_ADMIN_KEY, fence: int | None = None
) -> httpx.Response:
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
    schedule = [[1, GATE_CAP - 1, DRAFT_TOKENS], [GATE_CAP, GATE_CAP, 0]]
    assert state["startup_num_speculative_tokens_per_batch_size"] == schedule
    assert state["allowed_num_speculative_tokens"] == [0, DRAFT_TOKENS]
    assert state["zero_spec_tokens_above_batch_size"] is None

    gw = gateway(
        [],
        [],
        topology="in-engine",
        threshold=1,
        admin_token=GATEWAY_TOKEN,
        pools={"speculative": {"backends": [server.url], "engine": "vllm", "admin_api_key": GATE_ADMIN_KEY}},
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
    refused = post_gate(server, {"num_speculative_tokens_per_batch_size": [[1, GATE_CAP, 2]]}, fence=9)
    assert (refused.status_code, refused.json()["error"]["type"]) == (400, "rejected")  # K=2 never in force
    state = engine_gate(server).json()
    assert (state["zero_spec_tokens_above_batch_size"], state["highest_fence"]) == (1, 7)

    # A batch of 4 above the gate (1): next to no drafts - at most one round per prompt, should the prompts reach
    # the engine one step apart and the first run alone for a step.
    gated = drafts_of_one_batch(gw.url, server)
    # The gateway moves the gate above the batch: the start-up schedule's K=3 again, one draft per prompt per step.
    response = httpx.put(
        gw.url + "/admin/threshold",
        json={"threshold": GATE_CAP - 1},
        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert engine_gate(server).json()["zero_spec_tokens_above_batch_size"] == GATE_CAP - 1
    assert server.metric("vllm:spec_decode_gate") == GATE_CAP - 1
    speculating = drafts_of_one_batch(gw.url, server)
    below = GATE_CAP - 1
    print(f"drafts of one batch of {PROMPTS} x {MAX_TOKENS} tokens: gate 1 {gated:g}, gate {below} {speculating:g}")
    assert gated <= PROMPTS, f"drafts went on above the gate: {gated}"
    # K=3 at LOW_ACCEPTANCE (1.75) tokens a round: about MAX_TOKENS / 1.75 rounds per prompt.
    assert speculating >= PROMPTS * 2, f"no speculation below the gate: {speculating}"
