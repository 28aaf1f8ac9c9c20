"""Time-shared switching, live: a gateway in front of two stand-ins that share one (simulated) GPU set.

The sleep mechanism runs SGLang's endpoints (or vLLM's) on the stand-ins; the restart mechanism runs through the
GPU-host agent (tests/gateway/topology/switching/test_controller_restart.py). Decisions use small dwell and window
settings so a test sees a switch within seconds; stand-ins run fast (--time-scale).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.gateway.gateway_helpers import LONG, chat, sse_events
from tests.gateway.ticking import TickingController, time_shared_settings
from tests.waiting import wait_until

TOKEN = "switch-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SCALE = ("--time-scale", "20")
SWITCH_WAIT_S = 30.0
DWELL_S = 1.0
# The load calls for plain from 6 up, and for speculative again below 3.
THRESHOLD, HYSTERESIS = 6, 3
DROP_REASONS = ("cut", "queue_full", "queue_timeout", "no_mode")


def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10, trust_env=False).json()


def released(url: str) -> list[str]:
    return server_info(url)["internal_states"][0]["memory_released"]


def release(url: str) -> None:
    response = httpx.post(url + "/release_memory_occupation", json={}, timeout=30, trust_env=False)
    assert response.status_code == 200, response.text


def admin_state(gw) -> dict:
    return httpx.get(gw.url + "/admin/state", headers=AUTH, timeout=10, trust_env=False).json()


def put_mode(gw, mode: str) -> httpx.Response:
    return httpx.put(gw.url + "/admin/mode", json={"mode": mode}, headers=AUTH, timeout=10, trust_env=False)


def wait_phase(gw, phase: str, mode: str | None = None, timeout: float = SWITCH_WAIT_S) -> dict:
    seen: dict = {}

    def reached() -> bool:
        seen.update(admin_state(gw))
        return seen["phase"] == phase and (mode is None or seen["mode"] == mode)

    wait_until(reached, timeout, what=f"phase {phase} ({mode or 'any mode'})")
    return seen


def wait_last_switch(gw, timeout: float = SWITCH_WAIT_S) -> dict:
    """The state once the latest switch (or attempt) has an outcome."""
    seen: dict = {}

    def ended() -> bool:
        seen.update(admin_state(gw))
        return seen["last_switch"] is not None and seen["last_switch"]["outcome"] is not None

    wait_until(ended, timeout, what="the switch attempt to end")
    return seen


@dataclass
class ClosedLoop:
    """Streaming clients that each send a request as soon as their last one ended; `resize` changes how many.

    A client told to stop finishes the request it has under way: every request sent is read to its end.
    """

    client: httpx.AsyncClient
    # Long enough (~0.1 s at --time-scale 20) that a client spends most of its time with a request in flight.
    max_tokens: int = 200
    results: list[tuple[int, str]] = field(default_factory=list)  # (status, what went wrong or "")
    tasks: list[tuple[asyncio.Task, list[bool]]] = field(default_factory=list)

    def resize(self, n: int) -> None:
        while len(self.tasks) > n:
            self.tasks.pop()[1][0] = False
        while len(self.tasks) < n:
            running = [True]
            self.tasks.append((asyncio.create_task(self._client(running)), running))

    async def _client(self, running: list[bool]) -> None:
        while running[0]:
            async with self.client.stream("POST", "/v1/chat/completions", json=chat(True, self.max_tokens)) as r:
                raw = await r.aread()
            events = sse_events(raw) if r.status_code == 200 else []
            errors = [event for event in events if isinstance(event, dict) and "error" in event]
            problem = "" if r.status_code == 200 and events[-1:] == ["[DONE]"] and not errors else raw.decode()[:300]
            self.results.append((r.status_code, problem))

    async def stop(self) -> None:
        for _, running in self.tasks:
            running[0] = False
        await asyncio.gather(*(task for task, _ in self.tasks))
        self.tasks.clear()


async def until(condition, timeout: float = SWITCH_WAIT_S, what: str = "condition", gw=None) -> None:
    """The asyncio twin of wait_until, for scenarios that generate load meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            state = f"; switching: {gw.state.topology.controller.view()}" if gw is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{state}")
        await asyncio.sleep(0.02)


def serving(gw, mode: str):
    controller = gw.state.topology.controller
    return lambda: controller.phase == "active" and controller.mode == mode


def switches(gw, mechanism: str) -> dict[tuple[str, str], float]:
    return {
        (to, outcome): gw.metric("crossover_mode_switches_total", mechanism=mechanism, to=to, outcome=outcome)
        for to in ("speculative", "plain")
        for outcome in ("ok", "failed", "unavailable")
    }


@pytest.fixture
def sleep_pair(sim):
    """Stand-ins for the two modes of one GPU set: speculative serving, plain asleep (memory released)."""
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(plain.url)
    return speculative, plain


# Sleep switches decided within seconds. Phases long enough, switches cheap enough: a switch always pays, so only
# the load decides.
FAST_SWITCHING = {
    "mechanism": "sleep",
    "dwell": DWELL_S,
    "window": 0.5,
    "interval": 0.05,
    # Phases long enough, switches cheap enough: a switch always pays, so only the load decides.
    "expected_phase": 3600.0,
    "initial_cost": 0.5,
    "operator_interval": 0.0,
}


@pytest.fixture
def time_shared(gateway):
    def start(speculative: str, plain: str, engine: str = "sglang", cluster: dict | None = None, **switching):
        """`cluster`: one replica of a cluster ([cluster] settings),
        tests/gateway/cluster/test_coordination_time_shared.py."""
        switching = {**FAST_SWITCHING, **switching}
        return gateway(
            [speculative],
            [plain],
            pools={
                "speculative": {"backends": [speculative], "engine": engine},
                "plain": {"backends": [plain], "engine": engine},
            },
            topology="time-shared",
            admin_token=TOKEN,
            threshold=THRESHOLD,
            hysteresis=HYSTERESIS,
            switching=switching,
            **({"cluster": cluster} if cluster else {}),
        )

    return start


def test_an_operator_switch_by_sleep_moves_the_gpu_set_and_says_so(sleep_pair, time_shared):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, mechanism="sleep", dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    assert gw.metric("crossover_active_mode", mode="speculative") == 1

    response = put_mode(gw, "plain")
    assert response.status_code == 202, response.text
    state = wait_phase(gw, "active", "plain")
    assert released(speculative.url) == ["cuda_graph", "kv_cache", "weights"]
    assert released(plain.url) == []
    last = state["last_switch"]
    assert (last["from"], last["to"], last["outcome"], last["reason"]) == ("speculative", "plain", "ok", "operator")
    assert last["duration_s"] > 0
    assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to="plain", outcome="ok") == 1
    assert gw.metric("crossover_active_mode", mode="plain") == 1
    assert gw.metric("crossover_active_mode", mode="speculative") == 0
    assert gw.metric("crossover_switch_duration_seconds_count") == 1
    assert put_mode(gw, "plain").status_code == 200  # already there: nothing to do


def test_the_new_server_dying_mid_switch_brings_the_old_mode_back(sleep_pair, time_shared, caplog):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    assert put_mode(gw, "plain").status_code == 202
    wait_until(lambda: admin_state(gw)["phase"] != "draining", what="the drain to end")
    plain.kill()  # while the speculative server releases its memory, or the plain one resumes
    state = wait_phase(gw, "active", "speculative")
    last = state["last_switch"]
    assert (last["outcome"], last["mode_after"]) == ("failed", "speculative")
    assert last["failed_step"] in ("resume", "continue", "verify"), last
    assert released(speculative.url) == []  # resumed again
    # Real SGLang 0.5.23 dies on a resume of memory it holds: the recovery never sends one.
    assert memory(speculative.url)["resume_not_released_total"] == 0
    assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to="plain", outcome="failed") == 1
    assert gw.metric("crossover_active_mode", mode="speculative") == 1
    assert any("switch speculative -> plain (sleep) failed" in r.getMessage() for r in caplog.records)


def test_an_operator_switch_to_a_dead_server_is_refused_before_anything_is_drained_or_released(
    sleep_pair, time_shared, caplog
):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    cost = admin_state(gw)["switch_cost_s"]
    plain.kill()  # its resume cannot succeed: the preflight sees that before the drain
    assert put_mode(gw, "plain").status_code == 202
    state = wait_last_switch(gw)
    last = state["last_switch"]
    assert (last["outcome"], last["failed_step"], last["mode_after"]) == ("failed", "preflight", "speculative"), last
    assert (last["drain_s"], last["cut_requests"]) == (None, 0)
    assert (state["phase"], state["mode"]) == ("active", "speculative")
    assert state["switch_cost_s"] == cost  # a switch that never ran says nothing about what one costs
    assert state["backoff"]["failures"] == 1
    stats = memory(speculative.url)
    assert (stats["release_total"], stats["resume_total"]) == (0, 0), stats
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False).status_code == 200
    assert any("not started: preflight" in r.getMessage() for r in caplog.records)


def test_with_no_mode_left_the_gateway_says_so_and_recovers_when_one_comes_back(sim, time_shared, caplog):
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(plain.url)
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, backoff=0.2, backoff_max=1.0)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    plain.kill()
    speculative.kill()
    state = wait_phase(gw, "unavailable")
    assert state["mode"] is None
    assert state["last_switch"]["outcome"] == "unavailable"
    assert state["last_switch"]["reason"] == "recovery"
    assert gw.metric("crossover_switch_recoveries_total", mechanism="sleep", outcome="unavailable") >= 1
    assert gw.metric("crossover_active_mode", mode="speculative") == 0
    assert gw.metric("crossover_active_mode", mode="plain") == 0
    assert any("no mode serves" in r.getMessage() for r in caplog.records)
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_serving_mode"
    assert "retry-after" in response.headers

    # A server comes back (the operator restarted it): the gateway finds it by itself and serves again.
    sim("k25-eagle3", *SCALE, port=speculative.port)
    wait_phase(gw, "active", "speculative")
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False).status_code == 200


def run_load_step(gw, mechanism: str) -> None:
    """Load 1, then 3x the threshold, then 1 again: exactly one switch each way, every request served."""

    async def scenario() -> ClosedLoop:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as client:
            load = ClosedLoop(client)
            try:
                load.resize(1)
                await asyncio.sleep(3 * DWELL_S)  # low load: speculative stays
                assert sum(switches(gw, mechanism).values()) == 0
                load.resize(3 * THRESHOLD)
                await until(serving(gw, "plain"), what="the switch to plain", gw=gw)
                await asyncio.sleep(3 * DWELL_S)  # high load holds plain
                load.resize(1)
                await until(serving(gw, "speculative"), what="the switch back to speculative", gw=gw)
                await asyncio.sleep(3 * DWELL_S)
            finally:
                await load.stop()
            return load

    load = asyncio.run(scenario())
    counts = switches(gw, mechanism)
    assert counts[("plain", "ok")] == 1 and counts[("speculative", "ok")] == 1, counts
    assert sum(counts.values()) == 2, counts
    problems = [result for result in load.results if result != (200, "")]
    assert not problems, problems[:3]
    assert len(load.results) > 50
    assert sum(gw.metric("crossover_switch_dropped_total", reason=reason) for reason in DROP_REASONS) == 0
    assert gw.state.topology.controller.queued == 0 and gw.inflight() == 0


def test_a_load_step_up_and_back_switches_once_each_way_and_every_request_completes(sleep_pair, time_shared):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url)
    wait_phase(gw, "active", "speculative")
    run_load_step(gw, "sleep")
    for url in (speculative.url, plain.url):
        stats = memory(url)
        assert stats["release_refused_total"] == 0 and stats["resume_not_released_total"] == 0, stats


def test_load_hovering_at_the_threshold_does_not_flap():
    # On a clock the test owns: the load just above and just below the threshold every sampling period, faster
    # than the window. The controller's own tick decides (ticking.py); the machine's load cannot change it.
    # As the live tests run it: a switch always pays (long phases, cheap switches), so only the load decides.
    ticking = TickingController(
        time_shared_settings(
            threshold=THRESHOLD, hysteresis=HYSTERESIS, dwell=DWELL_S, window=0.5, expected_phase=3600, initial_cost=0.5
        )
    )
    for step in range(1, 400):
        ticking.step(step * 0.05, THRESHOLD - 1 if step % 2 else THRESHOLD + 1)
    assert len(ticking.switches) <= 1, ticking.switches  # into plain at most once, and never back
    assert all(target == "plain" for _, target, _ in ticking.switches), ticking.switches
    assert [target for _, target, _ in ticking.switches] == ["plain"], ticking.switches  # the band holds it there
    assert ticking.controller.last_decision.reason in ("within_band", "load_fits_mode")


def memory(url: str) -> dict:
    return server_info(url)["memory"]


def test_requests_past_the_drain_deadline_are_cut_cleanly_and_a_busy_server_is_never_released(sim, time_shared):
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(plain.url)
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, drain_deadline=0.5)
    wait_phase(gw, "active", "speculative")

    async def scenario() -> tuple[list[bytes], bytes]:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:

            async def stream(url: str) -> bytes:
                request = client.build_request("POST", url + "/v1/chat/completions", json=chat(True, LONG))
                response = await client.send(request, stream=True)
                assert response.status_code == 200
                return await response.aread()

            through_gateway = [asyncio.create_task(stream(gw.url)) for _ in range(3)]
            # Another client of the same server, which the gateway does not see.
            direct = asyncio.create_task(stream(speculative.url))
            await until(lambda: gw.inflight() == 3, what="three streams through the gateway")
            response = await client.put(gw.url + "/admin/mode", json={"mode": "plain"}, headers=AUTH)
            assert response.status_code == 202
            await until(serving(gw, "plain"), what="the switch to plain")
            return await asyncio.gather(*through_gateway), await direct

    cut, direct = asyncio.run(scenario())
    for raw in cut:
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "mode_switch_cut", events[-2]
        assert "drain deadline" in events[-2]["error"]["message"]
    assert sse_events(direct)[-1] == "[DONE]"  # ended by SGLang's pause (abort), not left hanging
    assert gw.metric("crossover_switch_dropped_total", reason="cut") == 3
    assert admin_state(gw)["last_switch"]["cut_requests"] == 3
    stats = memory(speculative.url)
    assert stats["release_total"] == 1 and stats["release_refused_total"] == 0, stats
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="unavailable") == 3


@pytest.fixture
def slow_wake(sim):
    """A pair whose plain server takes 3 s to resume: a switch long enough to queue requests behind."""
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE, "--resume-delay", "3")
    release(plain.url)
    return speculative, plain


def test_the_switch_queue_holds_requests_up_to_its_bound_and_a_client_that_leaves_frees_its_place(
    slow_wake, time_shared
):
    speculative, plain = slow_wake
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, queue_max=2)
    wait_phase(gw, "active", "speculative")
    controller = gw.state.topology.controller

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as client:
            assert (await client.put("/admin/mode", json={"mode": "plain"}, headers=AUTH)).status_code == 202
            await until(lambda: controller.phase == "switching", what="the switch under way")
            leaving = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
            staying = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
            await until(lambda: controller.queued == 2, what="two requests held")
            assert gw.metric("crossover_switch_queued_requests") == 2
            refused = await client.post("/v1/chat/completions", json=chat())
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "switch_queue_full"
            assert int(refused.headers["retry-after"]) >= 1
            leaving.cancel()  # the client gives up: its place is free at once
            await until(lambda: controller.queued == 1, what="the place freed")
            taken = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
            await until(lambda: controller.queued == 2, what="the freed place taken")
            for response in await asyncio.gather(staying, taken):
                assert response.status_code == 200
                assert response.headers["x-crossover-pool"] == "plain"

    asyncio.run(scenario())
    assert gw.metric("crossover_switch_dropped_total", reason="queue_full") == 1
    assert controller.queued == 0


def test_a_request_held_past_the_queue_deadline_gets_503_with_retry_after(slow_wake, time_shared):
    speculative, plain = slow_wake
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, queue_timeout=0.5)
    wait_phase(gw, "active", "speculative")
    assert put_mode(gw, "plain").status_code == 202
    wait_until(lambda: gw.state.topology.controller.phase == "switching", what="the switch under way")
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "switch_queue_timeout"
    assert "retry-after" in response.headers
    assert gw.metric("crossover_switch_dropped_total", reason="queue_timeout") == 1
    wait_phase(gw, "active", "plain")


def test_an_operator_pin_holds_the_mode_against_the_policy_until_unpinned_and_changes_are_rate_limited():
    from crossover.gateway.errors import SwitchRateLimited

    ticking = TickingController(
        time_shared_settings(threshold=THRESHOLD, hysteresis=HYSTERESIS, dwell=DWELL_S, operator_interval=60.0)
    )
    controller = ticking.controller
    ticking.now = 1.0
    assert controller.request_switch("plain", pin=True)
    assert controller.pinned and controller.mode == "plain"
    ticking.now = 2.0
    with pytest.raises(SwitchRateLimited) as refused:  # 1 s after the last change, one per 60 s
        controller.request_switch("speculative")
    assert refused.value.status == 429 and int(refused.value.headers["retry-after"]) == 59
    for t in range(2, 200):  # idle: the policy would go back to speculative, the pin holds plain
        ticking.step(float(t), 0)
    assert [target for _, target, _ in ticking.switches] == ["plain"]
    assert controller.request_switch("plain") is False  # already serving: nothing to do, nothing to refuse
    assert controller.request_switch(None, pin=False) is False  # unpinning is no mode change
    ticking.step(200.0, 0)
    assert [target for _, target, _ in ticking.switches] == ["plain", "speculative"]


def test_policy_decisions_are_logged_when_they_change(caplog):
    caplog.set_level(logging.INFO, logger="crossover.switching")
    ticking = TickingController(
        time_shared_settings(threshold=THRESHOLD, hysteresis=HYSTERESIS, dwell=DWELL_S, expected_phase=3600)
    )
    for t in range(1, 40):
        ticking.step(float(t), 1 if t < 20 else 3 * THRESHOLD)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("switch policy:")]
    # Staying (load fits) once, the switch, staying in the new mode: not one line per tick.
    assert len(lines) == 3, lines
    assert "stay in speculative mode (load_fits_mode" in lines[0]
    assert "switch speculative -> plain (load_above_threshold" in lines[1]
    assert "stay in plain mode (load_fits_mode" in lines[2]


def test_the_state_of_a_time_shared_gateway_says_time_shared_and_counts_held_requests_once(slow_wake, time_shared):
    speculative, plain = slow_wake
    gw = time_shared(speculative.url, plain.url, dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    assert admin_state(gw)["policy"] == "time-shared"

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as client:
            assert (await client.put("/admin/mode", json={"mode": "plain"}, headers=AUTH)).status_code == 202
            await until(lambda: gw.state.topology.controller.phase == "switching", what="the switch under way")
            held = [asyncio.create_task(client.post("/v1/chat/completions", json=chat())) for _ in range(2)]
            await until(lambda: gw.state.topology.controller.queued == 2, what="two requests held")
            state = (await client.get("/admin/state", headers=AUTH)).json()
            assert (state["inflight"], state["queued"], state["switch_queued"]) == (0, 2, 2), state
            assert all(r.status_code == 200 for r in await asyncio.gather(*held))

    asyncio.run(scenario())


def test_at_start_up_the_gateway_adopts_the_mode_that_really_serves(sim, time_shared):
    # The operator left plain serving and speculative asleep; the gateway's initial_mode says speculative.
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(speculative.url)
    gw = time_shared(speculative.url, plain.url, dwell=3600.0)
    state = wait_phase(gw, "active", "plain")
    assert state["switches"] == 0  # adopted, not switched to
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False).status_code == 200
    # And the belief is right from there on: a switch back resumes speculative, never a resume of held memory.
    assert put_mode(gw, "speculative").status_code == 202
    wait_phase(gw, "active", "speculative")
    assert admin_state(gw)["last_switch"]["outcome"] == "ok"
    for url in (speculative.url, plain.url):
        assert memory(url)["resume_not_released_total"] == 0


def is_sleeping(url: str) -> bool:
    return httpx.get(url + "/is_sleeping", timeout=10, trust_env=False).json()["is_sleeping"]


def test_a_switch_by_sleep_on_vllm_sleeps_and_wakes_through_vllm_s_endpoints(sim, time_shared):
    """The same sleep mechanism on two stand-ins playing vLLM (--enable-sleep-mode): /sleep ends what the old
    server runs (another client's stream too, which the gateway did not send) and /wake_up brings the new one
    back; no pause or continue exists to call."""
    vllm = ("--engine", "vllm", "--enable-sleep-mode")
    speculative, plain = sim("k25-eagle3", *SCALE, *vllm), sim("k25-plain", *SCALE, *vllm)
    assert httpx.post(plain.url + "/sleep?level=1", timeout=10, trust_env=False).status_code == 200
    gw = time_shared(speculative.url, plain.url, engine="vllm", dwell=3600.0)
    wait_phase(gw, "active", "speculative")

    async def scenario() -> bytes:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            request = client.build_request("POST", speculative.url + "/v1/chat/completions", json=chat(True, LONG))
            direct = await client.send(request, stream=True)
            response = await client.put(gw.url + "/admin/mode", json={"mode": "plain"}, headers=AUTH)
            assert response.status_code == 202
            await until(serving(gw, "plain"), what="the switch to plain")
            return await direct.aread()

    direct = asyncio.run(scenario())
    assert sse_events(direct)[-1] == "[DONE]"  # ended by vLLM's sleep (mode abort), not left hanging
    assert is_sleeping(speculative.url) and not is_sleeping(plain.url)
    assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to="plain", outcome="ok") == 1
    with httpx.Client(base_url=gw.url, timeout=20, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    assert put_mode(gw, "speculative").status_code == 202
    wait_phase(gw, "active", "speculative")
    assert not is_sleeping(speculative.url) and is_sleeping(plain.url)


def test_at_start_up_vllm_s_own_word_on_sleep_beats_the_presumption(sim, time_shared):
    """The operator left plain serving and speculative asleep; initial_mode says speculative. vLLM holds a request
    that reaches it asleep (it does not refuse it), so its /is_sleeping is asked first: no verify waits on it."""
    vllm = ("--engine", "vllm", "--enable-sleep-mode")
    speculative, plain = sim("k25-eagle3", *SCALE, *vllm), sim("k25-plain", *SCALE, *vllm)
    assert httpx.post(speculative.url + "/sleep", timeout=10, trust_env=False).status_code == 200
    gw = time_shared(speculative.url, plain.url, engine="vllm", dwell=3600.0, verify_timeout=600.0)
    state = wait_phase(gw, "active", "plain")
    assert state["switches"] == 0  # adopted, not switched to
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False).status_code == 200
    assert put_mode(gw, "speculative").status_code == 202
    wait_phase(gw, "active", "speculative")
    assert not is_sleeping(speculative.url) and is_sleeping(plain.url)
