"""The stand-in's patched /speculative/adaptive (the patch's validation and replies) and the zero-step cost model."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random

import httpx
import pytest

from crossover.gateway.engines.fence import (
    FENCE_HEADER,
    FENCE_JUMP,
    FENCED,
    MAX_FENCE_JUMP,
    is_fenced,
    refused_highest,
)
from crossover.servers.sim.costs import make_costs
from crossover.servers.sim.engine import Engine, Sequence
from crossover.servers.sim.profile import load_profile
from crossover.servers.sim.speculation_gate import (
    MAX_ADAPTIVE_SLOTS,
    MAX_CANDIDATE_STEPS_LEN,
    GateError,
    StandInGate,
    gate_routes,
)


def post(url: str, body, key: str | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    kwargs = {"content": content} if content is not None else {"json": body}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/speculative/adaptive", timeout=10, trust_env=False, headers=headers, **kwargs)


def read(url: str) -> dict:
    return httpx.get(url + "/speculative/adaptive", timeout=10, trust_env=False).json()["state"]


def test_the_endpoint_validates_and_answers_as_the_patch_does(sim):
    server = sim("llama8b-h200-eagle3", "--speculation-gate")
    state = read(server.url)
    assert state["zero_steps_above_bs"] is None and state["generation"] == 0 and state["active_steps"] == 3
    assert state["gate_min_dwell_steps"] == 32 and state["captured_steps"] == [0, 3]

    for bad in (
        b"{not json",
        [],
        {},
        {"zero_steps_above_bs": "16"},
        {"zero_steps_above_bs": True},
        {"zero_steps_above_bs": -1},
        {"zero_steps_above_bs": 10**30},
        {"dry_run": "yes", "zero_steps_above_bs": 1},
        {"zero_step_above_bs": 1},
        {"skip_zero_step_draft_extend": True},  # no longer part of the API
        {"config": {"1": {"candidate_steps": [3], "ceiling_coeff": 1e308}}},
    ):
        response = post(server.url, bad)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["success"] is False and response.json()["reason"] == "invalid_body"
    response = post(server.url, {"config": {"1": {"candidate_steps": [0, 5]}}})  # 5 was not captured
    assert (response.status_code, response.json()["reason"]) == (400, "rejected")
    assert read(server.url)["generation"] == 0

    response = post(server.url, {"zero_steps_above_bs": 16})
    assert response.status_code == 200
    assert response.json()["state"]["zero_steps_above_bs"] == 16 and response.json()["state"]["generation"] == 1
    stale = post(server.url, {"zero_steps_above_bs": None, "expected_generation": 0})
    assert (stale.status_code, stale.json()["reason"]) == (409, "stale_generation")
    assert post(server.url, {"zero_steps_above_bs": None, "expected_generation": 1}).json()["state"] == {
        **response.json()["state"],
        "zero_steps_above_bs": None,
        "generation": 2,
    }
    config = {"1": {"candidate_steps": [0, 3]}}
    assert post(server.url, {"config": config, "gate_min_dwell_steps": 4}).status_code == 200
    assert (read(server.url)["config"], read(server.url)["gate_min_dwell_steps"]) == (config, 4)

    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'sglang:spec_adaptive_policy_generation{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0' in metrics
    for result, count in (("applied", 3), ("rejected", 1), ("conflict", 1), ("failed", 0)):
        assert f'result="{result}"}} {count}.0' in metrics


@pytest.mark.parametrize("from_file", [False, True])
def test_post_needs_the_admin_key_the_stand_in_was_given(sim, tmp_path, from_file):
    key_file = tmp_path / "admin.key"
    key_file.write_text("admin-secret\n")
    given = ["--admin-api-key-file", str(key_file)] if from_file else ["--admin-api-key", "admin-secret"]
    server = sim("llama8b-h200-eagle3", "--speculation-gate", *given)
    for key in (None, "wrong"):
        response = post(server.url, {"zero_steps_above_bs": 8}, key)
        assert (response.status_code, response.json()["reason"]) == (401, "unauthorized")
    assert post(server.url, {"zero_steps_above_bs": 8}, "admin-secret").status_code == 200
    assert read(server.url)["zero_steps_above_bs"] == 8  # reading stays open


def test_an_unpatched_stand_in_has_no_endpoint(sim):
    server = sim("llama8b-h200-eagle3")
    assert httpx.get(server.url + "/speculative/adaptive", timeout=10).status_code == 404


def test_the_gate_needs_a_speculative_profile():
    from crossover.servers.sim.app import SimSettings, create_app

    with pytest.raises(ValueError, match="speculative profile"):
        create_app(SimSettings(profile=load_profile("llama8b-h200-plain"), speculation_gate=True))


@pytest.mark.parametrize("name", ["llama8b-h200-eagle3", "k25-eagle3"])
def test_a_zero_step_costs_a_plain_decode_plus_one_draft_extend(name):
    spec, plain = load_profile(name), load_profile(name.replace("eagle3", "plain"))
    spec_costs, plain_costs = make_costs(spec), make_costs(plain)
    for batch in (1, 64, 256):
        context = batch * 1024
        zero = spec_costs.zero_step_s(batch, context, skip_draft_extend=False)
        skipped = spec_costs.zero_step_s(batch, context, skip_draft_extend=True)
        plain_step = plain_costs.decode_s(batch, context, batch)
        assert skipped == pytest.approx(plain_step, rel=0.02)  # the 1-token verify is a plain decode pass
        assert plain_step < zero < spec_costs.decode_s(batch, context, batch)


def test_a_batch_hovering_at_the_gate_flips_at_most_once_per_dwell():
    engine = Engine(load_profile("llama8b-h200-eagle3"), random.Random(0))
    engine.set_gate(4, 8)
    decisions = [engine._gate_decide(4 + i % 2) for i in range(200)]
    flips = sum(a != b for a, b in itertools.pairwise(decisions))
    assert 0 < flips <= 200 // 8 + 1 and engine.gate_flips_total == flips
    engine.set_gate(None, 8)
    assert engine._gate_decide(100) is False  # removing the gate never waits


def test_batches_above_the_gate_take_zero_steps():
    engine = Engine(load_profile("llama8b-h200-eagle3"), random.Random(0))
    engine.zero_steps_above_bs = 4
    now = 0.0
    for _ in range(6):
        engine.submit(Sequence(128, 64), now)
    kinds = []
    while (step := engine.next_step(now)) is not None and len(kinds) < 40:
        now += step.duration
        if step.kind == "decode":
            kinds.append((len(step.seqs), step.zero_step))
        engine.finish_step(step, now)
    assert kinds and all(zero == (batch > 4) for batch, zero in kinds)
    assert engine.zero_step_batches_total == sum(zero for _, zero in kinds)


def test_a_lower_fencing_token_moves_nothing_an_equal_higher_or_no_token_moves_the_gate(sim):
    server = sim("llama8b-h200-eagle3", "--speculation-gate")

    def post_fenced(gate: int | None, token: str | None) -> httpx.Response:
        headers = {} if token is None else {FENCE_HEADER: token}
        body = {"zero_steps_above_bs": gate}
        return httpx.post(server.url + "/speculative/adaptive", json=body, headers=headers, timeout=10, trust_env=False)

    assert post_fenced(16, "2").status_code == 200
    stale = post_fenced(4, "1")  # a paused ex-leader's late write
    assert (stale.status_code, stale.json()["reason"]) == (409, FENCED)
    assert "token 1" in stale.json()["message"] and "token 2" in stale.json()["message"]
    assert is_fenced(stale.status_code, stale.json())
    assert read(server.url)["zero_steps_above_bs"] == 16 and read(server.url)["generation"] == 1, "nothing moved"
    bad = post_fenced(4, "two")
    assert (bad.status_code, bad.json()["reason"]) == (400, "invalid_fence")
    assert post_fenced(8, "2").status_code == 200 and post_fenced(6, None).status_code == 200
    assert post_fenced(5, "3").status_code == 200 and post_fenced(4, "2").status_code == 409
    answer = httpx.get(server.url + "/speculative/adaptive", timeout=10).json()
    assert answer["fence"] == {"highest": 3, "refused": 2} and answer["state"]["zero_steps_above_bs"] == 5


def post_fenced(url: str, gate: int, token: int) -> httpx.Response:
    body = {"zero_steps_above_bs": gate}
    return httpx.post(url + "/speculative/adaptive", json=body, headers={FENCE_HEADER: str(token)}, timeout=10)


def test_a_token_far_above_the_highest_is_refused_with_403_and_moves_nothing_unless_allowed(sim):
    server = sim("llama8b-h200-eagle3", "--speculation-gate")
    assert post_fenced(server.url, 16, 2).status_code == 200
    far = post_fenced(server.url, 4, 2 + MAX_FENCE_JUMP + 1)
    assert (far.status_code, far.json()["reason"]) == (403, FENCE_JUMP) and not is_fenced(403, far.json())
    assert far.json()["success"] is False and str(2 + MAX_FENCE_JUMP + 1) in far.json()["message"]
    answer = httpx.get(server.url + "/speculative/adaptive", timeout=10).json()
    assert answer["fence"]["highest"] == 2 and answer["state"]["zero_steps_above_bs"] == 16, "nothing moved"
    assert post_fenced(server.url, 8, 2 + MAX_FENCE_JUMP).status_code == 200, "a jump of exactly the limit passes"

    allowed = sim("llama8b-h200-eagle3", "--speculation-gate", "--fence-max-jump", "0")
    assert post_fenced(allowed.url, 16, 2).status_code == 200
    assert post_fenced(allowed.url, 8, 10**18 - 1).status_code == 200


def test_the_gate_logs_each_raise_and_a_refused_jump(caplog):
    caplog.set_level(logging.INFO, logger="crossover.servers.sim.speculation_gate")
    gate = StandInGate(Engine(load_profile("llama8b-h200-eagle3"), random.Random(0)), 3, fence_max_jump=10)
    gate.update({"zero_steps_above_bs": 8}, fence=5)
    gate.update({"zero_steps_above_bs": 8}, fence=5)
    gate.update({"zero_steps_above_bs": 8}, fence=15)
    with pytest.raises(GateError) as refused:
        gate.update({"zero_steps_above_bs": 8}, fence=26)
    assert (refused.value.status, refused.value.reason) == (403, FENCE_JUMP) and gate.fence_highest == 15
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "/speculative/adaptive: fence raised from None to 5"),
        (logging.INFO, "/speculative/adaptive: fence raised from 5 to 15"),
        (logging.WARNING, f"/speculative/adaptive refused: {refused.value}"),
    ]


def stand_in_gate() -> StandInGate:
    return StandInGate(Engine(load_profile("llama8b-h200-eagle3"), random.Random(0)), 3)


class HeldRequest:
    """What the stand-in's POST handler reads of a Starlette request; the body waits for `arrives`."""

    def __init__(self, body: dict, token: int, arrives: asyncio.Event | None = None) -> None:
        self.headers = {FENCE_HEADER: str(token)}
        self._body, self.arrives = json.dumps(body).encode(), arrives

    async def body(self) -> bytes:
        if self.arrives is not None:
            await self.arrives.wait()
        return self._body


def test_a_stale_body_arriving_after_a_newer_update_is_refused():
    """A sends its headers with token 5, B sets gate 6 with token 6, then A's body arrives: A is refused (the
    review's finding on the patch: the stale writer won, gate 6 -> 5)."""
    gate = stand_in_gate()
    write = next(handler for _, handler, methods in gate_routes(gate) if methods == ["POST"])

    async def race() -> tuple:
        arrives = asyncio.Event()
        a = asyncio.ensure_future(write(HeldRequest({"zero_steps_above_bs": 5}, 5, arrives)))
        await asyncio.sleep(0)
        b = await write(HeldRequest({"zero_steps_above_bs": 6}, 6))
        arrives.set()
        return b, await a

    b, a = asyncio.run(race())
    assert b.status_code == 200
    assert (a.status_code, json.loads(a.body)["reason"]) == (409, FENCED)
    assert refused_highest(json.loads(a.body)["message"]) == 6, "the gateway's parser reads the refusal"
    assert (
        gate.engine.zero_steps_above_bs == 6 and gate.generation == 1 and gate.fence() == {"highest": 6, "refused": 1}
    )


def test_a_refused_request_leaves_the_fence_where_it_was():
    """One malformed (or stale, or rejected, or dry-run) request carrying 10^17 must not lock the real leader out."""
    gate = stand_in_gate()
    huge = 10**17
    for body, status in (
        ({"zero_steps_above_bs": -1}, 400),
        ({"zero_steps_above_bs": 4, "expected_generation": 3}, 409),
        ({"config": {"1": {"candidate_steps": [2]}}}, 400),
    ):
        with pytest.raises(GateError) as refused:
            gate.update(body, fence=huge)
        assert refused.value.status == status
    gate.update({"zero_steps_above_bs": 4, "dry_run": True}, fence=huge)
    assert gate.fence_highest is None
    gate.update({"zero_steps_above_bs": 8}, fence=2)  # the real leader
    with pytest.raises(GateError):
        gate.update({"gate_min_dwell_steps": -1}, fence=5)
    assert gate.fence() == {"highest": 2, "refused": 0} and gate.engine.zero_steps_above_bs == 8


def test_slots_and_candidate_lists_are_bounded_as_the_patch_bounds_them():
    gate = stand_in_gate()
    at = {str(bs): {"candidate_steps": [3]} for bs in range(1, MAX_ADAPTIVE_SLOTS + 1)}
    assert len(gate.update({"config": at})["config"]) == MAX_ADAPTIVE_SLOTS
    over = {**at, str(MAX_ADAPTIVE_SLOTS + 1): {"candidate_steps": [3]}}
    with pytest.raises(GateError, match=f"more than {MAX_ADAPTIVE_SLOTS} BS slots") as refused:
        gate.update({"config": over})
    assert (refused.value.status, refused.value.reason) == (400, "invalid_body")
    with pytest.raises(GateError, match=f"at most {MAX_CANDIDATE_STEPS_LEN} ints"):
        gate.update({"config": {"1": {"candidate_steps": [3] * (MAX_CANDIDATE_STEPS_LEN + 1)}}})
    assert gate.generation == 1
