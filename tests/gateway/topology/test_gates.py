"""The in-engine topology, live: the gateway in front of stand-ins that serve the patched /speculative/adaptive
(`crossover sim serve --speculation-gate`), with the patch's validation. The threshold is every engine's gate."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from crossover.gateway.config import Settings
from crossover.gateway.engines.sglang import PATCH_NAME, NotPatched
from crossover.gateway.topology.gates import ControlUnauthorized
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.gate_faults import GATE, GateFaults
from tests.gateway.gateway_helpers import SIM_SCALE, chat, hold, sim_running, start_in_engine, wait_until

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


SLOW_WAIT_S = 120.0


def engine_gate(url: str) -> dict:
    return httpx.get(url + "/speculative/adaptive", timeout=5, trust_env=False).json()["state"]


def in_engine(gateway, backends: list[str], threshold: int = 4, eject_seconds: float = 30.0, engine: str = "sglang"):
    return gateway(
        [],
        [],
        topology="in-engine",
        threshold=threshold,
        admin_token=TOKEN,
        pools={"speculative": {"backends": backends, "engine": engine}},
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


def test_engines_on_the_main_series_wire_are_gated_the_same_way(gateway, sim):
    """Stand-ins playing patches/sglang-main (the gate as /set_internal_state keys, read back in /server_info): the
    start-up gate, a PUT, a mode and a refused gate go through as on the 0.5.23 wire."""
    engines = [sim("k25-eagle3", *SIM_SCALE, "--speculation-gate", "--speculation-gate-wire", "main") for _ in range(2)]

    def gate_of(url: str) -> dict:
        info = httpx.get(url + "/server_info", timeout=5, trust_env=False).json()
        return info["internal_states"][0]["speculative_adaptive"]

    gw = in_engine(gateway, [s.url for s in engines], threshold=4)
    assert [gate_of(s.url)["zero_steps_above_bs"] for s in engines] == [4, 4]  # set at start-up
    response = put(gw, "/admin/threshold", {"threshold": 12})
    assert response.status_code == 200, response.text
    assert {g["zero_steps_above_bs"] for g in response.json()["backend_gates"].values()} == {12}
    assert [gate_of(s.url)["zero_steps_above_bs"] for s in engines] == [12, 12]
    assert put(gw, "/admin/mode", {"mode": "speculative"}).status_code == 200  # no gate: -1 on this wire
    assert [gate_of(s.url)["zero_steps_above_bs"] for s in engines] == [None, None]
    assert all(gate_of(s.url)["last_update"]["result"] == "applied" for s in engines)


def test_a_vllm_pool_is_gated_through_vllms_own_route(gateway, sim):
    """patches/vllm-0.32.0's /speculation_gate, on stand-ins playing vLLM: the same threshold, the vLLM adapter's
    calls (its field, its error body), and the engine's own gauge reads the gate back."""
    engines = [sim("k25-eagle3", *SIM_SCALE, "--engine", "vllm", "--speculation-gate") for _ in range(2)]
    gw = in_engine(gateway, [s.url for s in engines], threshold=4, engine="vllm")

    def vllm_gate(url: str) -> dict:
        return httpx.get(url + "/speculation_gate", timeout=5, trust_env=False).json()

    assert [vllm_gate(s.url)["zero_spec_tokens_above_batch_size"] for s in engines] == [4, 4]
    response = httpx.put(gw.url + "/admin/threshold", json={"threshold": 12}, headers=ADMIN, timeout=10)
    assert response.status_code == 200, response.text
    assert {g["zero_steps_above_bs"] for g in response.json()["backend_gates"].values()} == {12}
    assert [vllm_gate(s.url)["zero_spec_tokens_above_batch_size"] for s in engines] == [12, 12]
    text = httpx.get(engines[0].url + "/metrics", timeout=5, trust_env=False).text
    assert "vllm:spec_decode_gate 12.0" in text
    forced = httpx.put(gw.url + "/admin/mode", json={"mode": "plain"}, headers=ADMIN, timeout=10)
    assert forced.status_code == 200, forced.text
    assert [vllm_gate(s.url)["zero_spec_tokens_above_batch_size"] for s in engines] == [0, 0]


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
    # Usable again once both are true: the gate re-applied and the breaker's probe has it healthy (either may come
    # first); from then on it serves, so the gate must already be the gateway's.
    wait_until(lambda: backend.usable, what="the backend back in rotation")
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
    # What the patch answers on a server started without --speculative-adaptive: 501, reason not_applicable.
    async def no_gate(request):
        body = {"success": False, "message": "adaptive speculation is off: it needs ...", "reason": "not_applicable"}
        return JSONResponse({**body, "partial": False}, 501)

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


# -- what real engines do that the stand-in does not: refuse, hang, answer malformed (tests/gateway/gate_faults.py)


@pytest.fixture
def faulty(sim, serve):
    """`faulty(n, *extra)`: n gated stand-ins, each behind a GateFaults backend: [(stand-in, faults, url)]."""
    made: list[GateFaults] = []

    def start(n: int, *extra: str) -> list[tuple]:
        out = []
        for _ in range(n):
            engine = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate", *extra)
            faults = GateFaults(engine.url)
            made.append(faults)
            out.append((engine, faults, serve(faults.app()).url))
        return out

    yield start
    for faults in made:
        faults.release.set()


async def load(url: str, stop: asyncio.Event, concurrency: int = 4) -> Counter:
    """Non-streamed chats through the gateway until `stop`: their statuses."""
    statuses: Counter = Counter()
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:

        async def worker() -> None:
            while not stop.is_set():
                response = await client.post(url + "/v1/chat/completions", json=chat(max_tokens=4))
                statuses[response.status_code] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


@pytest.mark.parametrize("engines", [2, 1])
def test_engines_that_refuse_a_gate_keep_theirs_and_serve(gateway, faulty, engines):
    backends = faulty(engines)
    for _, faults, _ in backends:
        faults.refuse.add(12)
    gw = in_engine(gateway, [url for _, _, url in backends], threshold=4)

    async def refused_under_load() -> tuple[httpx.Response, Counter]:
        stop = asyncio.Event()
        running = asyncio.create_task(load(gw.url, stop))
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            await wait_for_served(backends, 4)
            response = await client.put(gw.url + "/admin/threshold", json={"threshold": 12}, headers=ADMIN)
            await wait_for_served(backends, 8)
        stop.set()
        return response, await running

    response, statuses = asyncio.run(refused_under_load())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "gate_refused" and error["param"] == "threshold", error
    assert "needs a CUDA graph never captured" in error["message"] and "(rejected)" in error["message"]
    assert set(statuses) == {200}, statuses  # 0 failed requests
    assert [engine_gate(engine.url)["zero_steps_above_bs"] for engine, _, _ in backends] == [4] * engines
    live = httpx.get(gw.url + "/admin/threshold", headers=ADMIN, timeout=10).json()
    assert live["threshold"] == 4 and live["gate"]["zero_steps_above_bs"] == 4  # the previous gate is the live one
    assert all(faults.gate_calls["POST"] == 1 for _, faults, _ in backends)  # the start-up write only
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
    refused_mode = put(gw, "/admin/mode", {"mode": "plain"})  # a mode's gate is checked the same way
    assert refused_mode.status_code == 200  # gate 0 is not refused here


async def wait_for_served(backends: list[tuple], more: int) -> None:
    start = sum(faults.served for _, faults, _ in backends)
    await asyncio.to_thread(
        wait_until, lambda: sum(faults.served for _, faults, _ in backends) >= start + more, what="requests served"
    )


def test_the_admin_credential_is_for_control_and_the_api_key_for_generation(gateway, faulty, tmp_path):
    [(engine, faults, url)] = faulty(1, "--admin-api-key", "engine-admin")
    key_file = tmp_path / "admin.key"
    key_file.write_text("engine-admin\n")
    pool = {"backends": [url], "api_key": "engine-api", "admin_api_key_file": str(key_file)}
    gw = gateway(
        [],
        [],
        topology="in-engine",
        threshold=4,
        admin_token=TOKEN,
        pools={"speculative": pool},
        health={"interval": 0.2, "timeout": 2.0},
    )
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=2), timeout=30)
    assert response.status_code == 200, response.text
    assert engine_gate(engine.url)["zero_steps_above_bs"] == 4
    assert faults.credentials["/v1/chat/completions"] == {"Bearer engine-api"}
    assert faults.credentials[GATE] == {"Bearer engine-admin"}
    assert put(gw, "/admin/threshold", {"threshold": 6}).status_code == 200
    assert engine_gate(engine.url)["zero_steps_above_bs"] == 6


def test_a_control_call_refused_for_its_credential_refuses_start_up(sim):
    engine = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate", "--admin-api-key", "engine-admin")
    with pytest.raises(ControlUnauthorized) as refused:
        start_in_engine([engine.url])  # no admin credential: the POST is a 401
    message = str(refused.value)
    assert "\n" not in message and "admin_api_key" in message and "HTTP 401 (unauthorized)" in message


def test_a_malformed_gate_reply_is_logged_counted_and_retried(gateway, faulty, caplog):
    caplog.set_level(logging.WARNING, logger="crossover.in_engine")
    [(engine, faults, url)] = faulty(1)
    gw = in_engine(gateway, [url], threshold=4)
    faults.malformed = 3
    wait_until(lambda: faults.malformed == 0, what="three malformed replies read")
    # Someone else moves the gate: a sync that is still alive puts it back, and says so.
    httpx.post(engine.url + GATE, json={"zero_steps_above_bs": 9}, timeout=10, trust_env=False)
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 4, what="the gate restored")
    assert gw.metric("crossover_gate_sync_errors_total", backend=url, kind="malformed") == 3
    assert gw.metric("crossover_backend_gate_moved_total", backend=url) == 1
    assert "not in sync (malformed)" in caplog.text and "moved by someone else: 4 -> 9" in caplog.text
    assert gw.state.pools.speculative[0].usable  # it stayed in rotation on its gate throughout
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=2), timeout=30).status_code == 200


def test_a_gate_moved_between_the_gateways_write_and_its_read_back_is_counted_and_restored(gateway, faulty, caplog):
    caplog.set_level(logging.WARNING, logger="crossover.in_engine")
    [(engine, faults, url)] = faulty(1)
    gw = in_engine(gateway, [url], threshold=4)

    def by_hand() -> None:
        httpx.post(engine.url + GATE, json={"zero_steps_above_bs": 2}, timeout=10, trust_env=False)

    faults.after_write = by_hand  # the gateway's write of 9 lands, then a hand moves it before the read-back
    put(gw, "/admin/threshold", {"threshold": 9})  # its answer may name the gate not read back: not under test
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 9, what="the gate restored")
    assert faults.after_write is None  # the hand did move it
    assert gw.metric("crossover_backend_gate_moved_total", backend=url) == 1
    assert "moved by someone else: 9 -> 2" in caplog.text, caplog.text


@pytest.mark.parametrize("engines", [2, 1])
def test_an_engine_restarted_under_load_serves_nothing_ungated(gateway, faulty, sim, engines):
    backends = faulty(engines)
    # A sync interval far longer than the restart: only holding a returning engine out keeps it gated.
    gw = gateway(
        [],
        [],
        topology="in-engine",
        threshold=2,
        admin_token=TOKEN,
        pools={"speculative": {"backends": [url for _, _, url in backends]}},
        health={"interval": 5.0, "timeout": 2.0, "eject_seconds": 0.3},
    )
    engine, faults, _ = backends[0]

    async def restart_under_load() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(load(gw.url, stop, concurrency=6))
        await wait_for_served(backends[:1], 3)
        engine.kill()
        again = await asyncio.to_thread(sim, "k25-eagle3", *SIM_SCALE, "--speculation-gate", port=engine.port)
        served = faults.served
        await asyncio.to_thread(wait_until, lambda: faults.served >= served + 10, what="the restarted engine serving")
        stop.set()
        await running
        assert engine_gate(again.url)["zero_steps_above_bs"] == 2

    asyncio.run(restart_under_load())
    assert faults.ungated_served == 0


def test_one_hanging_gate_endpoint_does_not_hold_up_changes(gateway, faulty):
    backends = faulty(2)
    gw = in_engine(gateway, [url for _, _, url in backends], threshold=4)
    (_, hanging, hanging_url), (sound, _, _) = backends[1], backends[0]
    before = hanging.gate_calls["dry_run"]  # the start-up check
    hanging.hang.set()

    async def puts() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            return await asyncio.gather(
                *(client.put(gw.url + "/admin/threshold", json={"threshold": t}, headers=ADMIN) for t in range(5, 15))
            )

    answers = asyncio.run(puts())
    assert all(a.status_code in (200, 502) for a in answers), [a.text for a in answers]
    # Each change waited on the hanging endpoint at most once: the first found it slow, the rest left it to the
    # background rounds (every call has its own timeout, 2 s here).
    assert hanging.gate_calls["dry_run"] - before <= 1, hanging.gate_calls
    final = gw.state.routing.threshold
    assert engine_gate(sound.url)["zero_steps_above_bs"] == final
    assert gw.state.pools.speculative[1].usable  # on its last good gate meanwhile
    hanging.release.set()
    wait_until(lambda: engine_gate(backends[1][0].url)["zero_steps_above_bs"] == final, what="it catches up")

    def caught_up() -> bool:
        view = httpx.get(gw.url + "/admin/threshold", headers=ADMIN, timeout=10).json()["backend_gates"]
        return view[hanging_url]["in_sync"]

    wait_until(caught_up, what="in sync again")


def test_health_is_503_when_no_backend_is_usable(gateway, faulty, sim, caplog):
    caplog.set_level(logging.WARNING, logger="crossover.in_engine")
    [(engine, faults, url)] = faulty(1)
    gw = in_engine(gateway, [url], threshold=4, eject_seconds=0.3)
    assert httpx.get(gw.url + "/health", timeout=10).json()["usable_backends"] == 1
    faults.refuse.add(4)  # it comes back ungated and refuses the gate: it must not serve
    engine.kill()
    backend = gw.state.pools.speculative[0]
    wait_until(lambda: not backend.usable, what="the dead engine out of rotation")
    sim("k25-eagle3", *SIM_SCALE, "--speculation-gate", port=engine.port)
    wait_until(lambda: backend.healthy is True and gw.state.topology.gates.gates.get(url), what="it is back, read")
    health = httpx.get(gw.url + "/health", timeout=10)
    assert (health.status_code, health.json()) == (
        503,
        {"status": "unavailable", "usable_backends": 0, "healthy_backends": 1},
    )
    assert gw.metric("crossover_backend_gate_held_out", backend=url) == 1
    assert "held out of rotation" in caplog.text
    faults.refuse.clear()
    wait_until(lambda: backend.usable, what="gated and back in rotation")
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200


def test_the_admin_credential_comes_from_a_file_or_the_settings(tmp_path):
    key = tmp_path / "admin.key"
    key.write_text("  from-file\n")

    def pool(**fields) -> Settings:
        return Settings(topology="in-engine", pools={"speculative": {"backends": ["http://127.0.0.1:1"], **fields}})

    assert pool(admin_api_key_file=str(key)).pools.speculative.control_key == "from-file"
    assert pool(api_key="api", admin_api_key="admin").pools.speculative.control_key == "admin"
    assert pool(api_key="api").pools.speculative.control_key == "api"  # what SGLang takes without an admin key
    with pytest.raises(ValueError, match="not both"):
        pool(admin_api_key="a", admin_api_key_file=str(key))
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        pool(admin_api_key_file=str(tmp_path / "empty.key"))
    with pytest.raises(ValueError, match="cannot be read"):
        pool(admin_api_key_file=str(tmp_path / "missing.key"))


# -- replicas: one leader writes the gates, a follower reads them back -----------------------------------------------


@needs_redis
def test_a_follower_counts_no_gate_the_leader_wrote_but_one_moved_by_hand(
    gateway, faulty, redis_server, request, caplog
):
    caplog.set_level(logging.WARNING, logger="crossover.in_engine")
    backends = faulty(2)
    urls = [url for _, _, url in backends]
    cluster = {"redis_url": redis_server.url, "name": request.node.name[:60], "sync_interval": 0.1}
    group = [
        gateway(
            [],
            [],
            topology="in-engine",
            threshold=4,
            admin_token=TOKEN,
            pools={"speculative": {"backends": urls}},
            health={"interval": 0.2, "timeout": 2.0},
            cluster=cluster,
        )
        for _ in range(2)
    ]
    leader = next(gw for gw in group if gw.state.topology.coordination.leader)
    follower = next(gw for gw in group if gw is not leader)

    def moved(gw, url: str) -> float:
        return gw.metric("crossover_backend_gate_moved_total", backend=url)

    def read_back(gw, gate: int) -> bool:
        views = gw.state.topology.gates.view()["backend_gates"].values()
        return all(view["zero_steps_above_bs"] == gate and view["in_sync"] for view in views)

    # PUTs through either replica: the leader writes every gate, the follower reads each one back.
    for threshold, through in ((12, leader), (7, follower), (20, leader), (9, follower)):
        assert put(through, "/admin/threshold", {"threshold": threshold}).status_code == 200
        wait_until(
            lambda t=threshold: read_back(follower, t),
            timeout=SLOW_WAIT_S,
            what=f"the follower reading gate {threshold} back",
        )
    assert [moved(gw, url) for gw in group for url in urls] == [0, 0, 0, 0]
    assert "moved by someone else" not in caplog.text, caplog.text

    # A gate moved by hand is counted, here too: the leader's restore is held until the follower has read it.
    (engine, faults, url), _ = backends
    faults.hang_writes.set()
    httpx.post(engine.url + GATE, json={"zero_steps_above_bs": 3}, timeout=10, trust_env=False)
    # Bounds for a loaded machine: a gate read is retried every 0.2 s, but each may wait out its 2 s timeout.
    wait_until(
        lambda: moved(follower, url) == 1 and moved(leader, url) == 1,
        timeout=SLOW_WAIT_S,
        what="both replicas counting the move",
    )
    faults.release.set()
    wait_until(
        lambda: read_back(follower, 9),
        timeout=SLOW_WAIT_S,
        what="the leader restoring the gate, the follower reading it back",
    )
    assert [moved(gw, u) for gw in (follower, leader) for u in urls] == [1, 0, 1, 0]
    assert "moved by someone else: 9 -> 3 (generation" in caplog.text
    assert caplog.text.count("the replica that leads restores 9") == 1, caplog.text
