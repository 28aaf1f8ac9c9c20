"""Time-shared switching, live: a gateway in front of two stand-ins that share one (simulated) GPU set.

The sleep mechanism runs SGLang's endpoints on the stand-ins; the restart mechanism runs through the
GPU-host agent (tests/gateway/test_switching_restart.py). Decisions use small dwell and window settings so
a test sees a switch within seconds; stand-ins run fast (--time-scale).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.gateway.gateway_helpers import chat, sse_events
from tests.waiting import wait_until

TOKEN = "switch-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SCALE = ("--time-scale", "20")
SWITCH_WAIT_S = 30.0
DWELL_S = 1.0
# The load calls for plain from 6 up, and for speculative again below 3.
THRESHOLD, HYSTERESIS = 6, 3


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


async def until(condition, timeout: float = SWITCH_WAIT_S, what: str = "condition") -> None:
    """The asyncio twin of wait_until, for scenarios that generate load meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def serving(gw, mode: str):
    controller = gw.state.switching
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


@pytest.fixture
def time_shared(gateway):
    def start(speculative: str, plain: str, **switching):
        switching = {
            "mechanism": "sleep",
            "dwell": DWELL_S,
            "window": 0.5,
            "interval": 0.05,
            # Phases long enough, switches cheap enough: a switch always pays, so only the load decides.
            "expected_phase": 3600.0,
            "initial_cost": 0.5,
            **switching,
        }
        return gateway(
            [speculative],
            [plain],
            topology="time-shared",
            admin_token=TOKEN,
            threshold=THRESHOLD,
            hysteresis=HYSTERESIS,
            switching=switching,
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
    assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to="plain", outcome="failed") == 1
    assert gw.metric("crossover_active_mode", mode="speculative") == 1
    assert any("switch speculative -> plain (sleep) failed" in r.getMessage() for r in caplog.records)


def test_with_no_mode_left_the_gateway_says_so_and_recovers_when_one_comes_back(sim, time_shared, caplog):
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(plain.url)
    gw = time_shared(speculative.url, plain.url, dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    plain.kill()
    speculative.kill()
    assert put_mode(gw, "plain").status_code == 202
    state = wait_phase(gw, "unavailable")
    assert state["mode"] is None
    assert state["last_switch"]["outcome"] == "unavailable"
    assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to="plain", outcome="unavailable") == 1
    assert gw.metric("crossover_active_mode", mode="speculative") == 0
    assert gw.metric("crossover_active_mode", mode="plain") == 0
    assert any("no mode serves" in r.getMessage() for r in caplog.records)


def test_a_load_step_up_and_back_switches_once_each_way_and_every_request_completes(sleep_pair, time_shared):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url)
    wait_phase(gw, "active", "speculative")

    async def scenario() -> ClosedLoop:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as client:
            load = ClosedLoop(client)
            load.resize(1)
            await asyncio.sleep(3 * DWELL_S)  # low load: speculative stays
            assert switches(gw, "sleep")[("plain", "ok")] == 0
            load.resize(3 * THRESHOLD)
            await until(serving(gw, "plain"), what="the switch to plain")
            await asyncio.sleep(3 * DWELL_S)  # high load holds plain
            load.resize(1)
            await until(serving(gw, "speculative"), what="the switch back to speculative")
            await asyncio.sleep(3 * DWELL_S)
            await load.stop()
            return load

    load = asyncio.run(scenario())
    counts = switches(gw, "sleep")
    assert counts[("plain", "ok")] == 1 and counts[("speculative", "ok")] == 1, counts
    assert sum(counts.values()) == 2, counts
    problems = [result for result in load.results if result != (200, "")]
    assert not problems, problems[:3]
    assert len(load.results) > 50
    assert gw.metric("crossover_switch_dropped_total", reason="cut") == 0
    assert gw.state.switching.queued == 0 and gw.inflight() == 0


def test_load_hovering_at_the_threshold_does_not_flap(sleep_pair, time_shared):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url)
    wait_phase(gw, "active", "speculative")

    async def scenario() -> ClosedLoop:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as client:
            load = ClosedLoop(client)
            for step in range(40):  # just below and just above the threshold, faster than the window
                load.resize(THRESHOLD - 1 if step % 2 else THRESHOLD + 1)
                await asyncio.sleep(0.2)
            await load.stop()
            return load

    load = asyncio.run(scenario())
    counts = switches(gw, "sleep")
    assert sum(counts.values()) <= 1, counts  # into plain at most once, and never back
    assert counts[("speculative", "ok")] == 0, counts
    assert [result for result in load.results if result != (200, "")] == []
