"""Time-shared switching, live: a gateway in front of two stand-ins that share one (simulated) GPU set.

The sleep mechanism runs SGLang's endpoints on the stand-ins; the restart mechanism runs through the
GPU-host agent (tests/gateway/test_switching_restart.py). Decisions use small dwell and window settings so
a test sees a switch within seconds; stand-ins run fast (--time-scale).
"""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.waiting import wait_until

TOKEN = "switch-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SCALE = ("--time-scale", "20")
SWITCH_WAIT_S = 30.0


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


@pytest.fixture
def sleep_pair(sim):
    """Stand-ins for the two modes of one GPU set: speculative serving, plain asleep (memory released)."""
    speculative, plain = sim("k25-eagle3", *SCALE), sim("k25-plain", *SCALE)
    release(plain.url)
    return speculative, plain


@pytest.fixture
def time_shared(gateway):
    def start(speculative: str, plain: str, **switching):
        switching = {"mechanism": "sleep", "dwell": 1.0, "window": 1.0, "interval": 0.1, **switching}
        return gateway(
            [speculative],
            [plain],
            topology="time-shared",
            admin_token=TOKEN,
            threshold=4,
            hysteresis=2,
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
