"""The in-engine topology, live: the gateway in front of stand-ins that serve the patched /speculative/adaptive
(`crossover sim serve --speculation-gate`), with the patch's validation. The threshold is every engine's gate."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from crossover.gateway.config import Settings
from crossover.gateway.sglang import PATCH_NAME, NotPatched
from tests.gateway.gateway_helpers import SIM_SCALE, hold, sim_running, start_in_engine, wait_until

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def engine_gate(url: str) -> dict:
    return httpx.get(url + "/speculative/adaptive", timeout=5, trust_env=False).json()["state"]


def in_engine(gateway, backends: list[str], threshold: int = 4, eject_seconds: float = 30.0):
    return gateway(
        [],
        [],
        topology="in-engine",
        threshold=threshold,
        admin_token=TOKEN,
        pools={"speculative": {"backends": backends}},
        health={"interval": 0.2, "timeout": 2.0, "eject_seconds": eject_seconds},
    )


@pytest.fixture
def gated(sim):
    return [sim("k25-eagle3", *SIM_SCALE, "--speculation-gate") for _ in range(2)]


def test_the_threshold_is_every_engines_gate_and_reads_back(gateway, gated):
    gw = in_engine(gateway, [s.url for s in gated], threshold=4)
    assert [engine_gate(s.url)["zero_steps_above_bs"] for s in gated] == [4, 4]  # set at start-up

    response = httpx.put(gw.url + "/admin/threshold", json={"threshold": 12}, headers=ADMIN, timeout=10)
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["gate"] == {"zero_steps_above_bs": 12, "forced_mode": None, "pinned": False}
    assert {g["zero_steps_above_bs"] for g in view["backend_gates"].values()} == {12}  # read back
    assert all(g["in_sync"] for g in view["backend_gates"].values())
    assert [engine_gate(s.url)["zero_steps_above_bs"] for s in gated] == [12, 12]

    state = httpx.get(gw.url + "/admin/state", headers=ADMIN, timeout=10).json()
    assert state["topology"] == "in-engine"
    assert set(state["backend_gates"]) == {s.url for s in gated}
    for s in gated:
        assert gw.metric("crossover_backend_speculation_gate", backend=s.url) == 12
        assert gw.metric("crossover_backend_gate_in_sync", backend=s.url) == 1


def test_zero_step_batches_begin_at_the_gate(gateway, sim):
    backend = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    gw = in_engine(gateway, [backend.url], threshold=3)
    asyncio.run(load_step(gw.url, backend.url))


async def load_step(gateway_url: str, backend_url: str) -> None:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        async with hold(client, gateway_url, 3):
            await asyncio.to_thread(wait_until, lambda: sim_running(backend_url) == 3, what="3 running")
            start = engine_gate(backend_url)["decode_batches"]
            await asyncio.to_thread(
                wait_until, lambda: engine_gate(backend_url)["decode_batches"] > start + 5, what="decode batches of 3"
            )
            below = engine_gate(backend_url)
            assert below["zero_step_batches"] == 0 and below["active_steps"] == 3  # 3 is not above a gate of 3
        async with hold(client, gateway_url, 5):
            await asyncio.to_thread(
                wait_until, lambda: engine_gate(backend_url)["zero_step_batches"] > 0, what="zero-step batches"
            )
            assert engine_gate(backend_url)["active_steps"] == 0


def test_a_restarted_backend_gets_the_gate_back_before_it_serves(gateway, sim):
    first = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    gw = in_engine(gateway, [first.url], threshold=7, eject_seconds=0.5)
    assert engine_gate(first.url)["zero_steps_above_bs"] == 7
    first.kill()
    backend = gw.state.pools.speculative[0]
    wait_until(lambda: backend.gate_pending, what="the dead backend held out")
    # Back on the same port with its start-up gate (none), as a restarted SGLang comes back.
    again = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate", port=first.port)
    wait_until(lambda: not backend.gate_pending, what="the gate re-applied")
    assert backend.usable
    state = engine_gate(again.url)
    assert state["zero_steps_above_bs"] == 7 and state["generation"] >= 1  # re-applied on a fresh engine
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200


def test_a_backend_without_the_endpoint_is_refused_at_start(sim):
    unpatched = sim("k25-eagle3", *SIM_SCALE)  # no --speculation-gate: /speculative/adaptive is a 404
    with pytest.raises(NotPatched) as refused:
        start_in_engine([unpatched.url])
    assert PATCH_NAME in str(refused.value) and unpatched.url in str(refused.value)
    assert "crossover patches apply" in str(refused.value)


def test_in_engine_settings_have_one_pool():
    with pytest.raises(ValueError, match=r"remove pools\.plain"):
        Settings(
            topology="in-engine",
            pools={"speculative": {"backends": ["http://127.0.0.1:1"]}, "plain": {"backends": ["http://127.0.0.1:2"]}},
        )
    with pytest.raises(ValueError, match=r"needs pools\.plain"):
        Settings(pools={"speculative": {"backends": ["http://127.0.0.1:1"]}})


def test_a_mode_is_forced_on_every_engine_until_the_next_threshold(gateway, gated):
    gw = in_engine(gateway, [s.url for s in gated], threshold=6)
    for mode, gate in (("plain", 0), ("speculative", None)):
        response = httpx.put(gw.url + "/admin/mode", json={"mode": mode}, headers=ADMIN, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["gate"] == {"zero_steps_above_bs": gate, "forced_mode": mode, "pinned": False}
        assert [engine_gate(s.url)["zero_steps_above_bs"] for s in gated] == [gate, gate]
    assert httpx.get(gw.url + "/admin/mode", headers=ADMIN, timeout=10).json()["gate"]["forced_mode"] == "speculative"
    response = httpx.put(gw.url + "/admin/threshold", json={"threshold": 5}, headers=ADMIN, timeout=10)
    assert response.json()["gate"] == {"zero_steps_above_bs": 5, "forced_mode": None, "pinned": False}
    assert [engine_gate(s.url)["zero_steps_above_bs"] for s in gated] == [5, 5]


def test_a_patched_server_without_adaptive_speculation_is_refused_at_start(serve):
    # What the patch answers on a server started without --speculative-adaptive.
    async def no_gate(request):
        return JSONResponse({"success": False, "message": "adaptive speculation is off: it needs ..."}, 400)

    async def health(request):
        return JSONResponse({})

    backend = serve(Starlette(routes=[Route("/speculative/adaptive", no_gate), Route("/health", health)]))
    with pytest.raises(NotPatched, match="adaptive speculation is off"):
        start_in_engine([backend.url])


def put(gw, path: str, body: dict) -> httpx.Response:
    return httpx.put(gw.url + path, json=body, headers=ADMIN, timeout=10, trust_env=False)


def test_a_pinned_mode_holds_until_it_is_unpinned(gateway, gated):
    gw = in_engine(gateway, [s.url for s in gated], threshold=6)

    def engines() -> list:
        return [engine_gate(s.url)["zero_steps_above_bs"] for s in gated]

    # Nothing forced: nothing to pin, and saying so is a refusal, not a 200 that ends or starts anything.
    refused = put(gw, "/admin/mode", {"pin": True})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "nothing_to_pin", refused.text
    assert engines() == [6, 6]

    forced = put(gw, "/admin/mode", {"mode": "plain"})
    assert forced.json()["gate"] == {"zero_steps_above_bs": 0, "forced_mode": "plain", "pinned": False}
    pinned = put(gw, "/admin/mode", {"pin": True})  # pins the forced mode (it used to end it)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["gate"] == {"zero_steps_above_bs": 0, "forced_mode": "plain", "pinned": True}
    assert engines() == [0, 0]

    for change in ({"hysteresis": 2}, {"threshold": 9}, {"threshold": 8, "hysteresis": 1}):
        response = put(gw, "/admin/threshold", change)
        assert response.status_code == 200, (change, response.text)
        assert response.json()["gate"] == {"zero_steps_above_bs": 0, "forced_mode": "plain", "pinned": True}, change
        assert engines() == [0, 0], change
    assert put(gw, "/admin/mode", {"pin": True}).json()["gate"]["forced_mode"] == "plain"  # again: still held

    unpinned = put(gw, "/admin/mode", {"pin": False})  # the gate follows the threshold again
    assert unpinned.json()["gate"] == {"zero_steps_above_bs": 8, "forced_mode": None, "pinned": False}
    assert engines() == [8, 8]

    # Forced and pinned at once; a hysteresis change alone ends no forced mode, a threshold ends an unpinned one.
    both = put(gw, "/admin/mode", {"mode": "speculative", "pin": True}).json()["gate"]
    assert both == {"zero_steps_above_bs": None, "forced_mode": "speculative", "pinned": True}
    assert engines() == [None, None]
    put(gw, "/admin/mode", {"mode": "plain", "pin": False})
    assert put(gw, "/admin/threshold", {"hysteresis": 0}).json()["gate"]["forced_mode"] == "plain"
    after = put(gw, "/admin/threshold", {"threshold": 4}).json()["gate"]
    assert after == {"zero_steps_above_bs": 4, "forced_mode": None, "pinned": False}
    assert engines() == [4, 4]


def test_a_routing_policy_is_refused_on_one_pool(gateway, gated):
    gw = in_engine(gateway, [s.url for s in gated], threshold=6)
    response = put(gw, "/admin/threshold", {"threshold": 3, "policy": "switch"})
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "no_routing_policy" and error["param"] == "policy" and "one pool" in error["message"]
    assert gw.state.routing.threshold == 6  # all or nothing
    assert [engine_gate(s.url)["zero_steps_above_bs"] for s in gated] == [6, 6]
