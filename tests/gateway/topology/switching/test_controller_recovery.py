"""A time-shared GPU set that heals itself, live: stand-ins (sleep) and the real GPU-host agent (restart) on
127.0.0.1, a server killed with SIGKILL under steady load, and no operator.

Every request sent during a run is accounted for: it completes, or it gets an OpenAI-style 503 with
Retry-After; only a request that was in flight on the server at the moment it died may end otherwise (a 502
or an error event: its backend vanished mid-answer), and none hangs. No test here judges wall-clock time:
each waits on a condition with a generous bound. The benchmarks at the end (`-m slow`) measure the times.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.gateway.gate_faults import GateFaults
from tests.gateway.gateway_helpers import LONG, chat
from tests.gateway.topology.switching.test_controller import (
    AUTH,
    ClosedLoop,
    admin_state,
    put_mode,
    release,
    sleep_pair,  # noqa: F401 - a fixture
    time_shared,  # noqa: F401 - a fixture
    until,
    wait_last_switch,
    wait_phase,
)
from tests.gateway.topology.switching.test_controller_restart import (
    agent_box,  # noqa: F401 - a fixture
    restart_gateway,  # noqa: F401 - a fixture
)
from tests.waiting import wait_until

RECOVERY_WAIT_S = 90.0
# The self-healing settings of these tests: a few 0.2 s health intervals, a short backoff.
HEALING = {"dead_after_probes": 3, "backoff": 0.2, "backoff_max": 1.0}


@dataclass
class Outcome:
    status: int
    pool: str | None
    retry_after: str | None
    code: str | None
    sent_before_kill: bool
    at: float  # time.monotonic() when it ended


@dataclass
class SteadyLoad:
    """`clients` closed-loop clients sending short non-streamed requests; each outcome recorded."""

    client: httpx.AsyncClient
    clients: int = 3
    killed: list[bool] = field(default_factory=lambda: [False])
    killed_at: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    running: bool = True
    tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]

    async def _client(self) -> None:
        while self.running:
            before = not self.killed[0]
            response = await self.client.post("/v1/chat/completions", json=chat(False, 8))
            code = None
            if response.status_code != 200:
                error = response.json().get("error", {})
                assert {"message", "type", "code"} <= error.keys(), response.text  # OpenAI-style, always
                code = error["code"]
            self.outcomes.append(
                Outcome(
                    response.status_code,
                    response.headers.get("x-crossover-pool"),
                    response.headers.get("retry-after"),
                    code,
                    before,
                    time.monotonic(),
                )
            )
            if response.status_code != 200:
                await asyncio.sleep(0.05)  # pacing, as a client that honours Retry-After does (less eagerly)

    def kill_to_first_success_s(self) -> float:
        return min(o.at for o in self.outcomes if o.status == 200 and not o.sent_before_kill) - self.killed_at

    def served_by(self, pool: str) -> bool:
        return any(o.status == 200 and o.pool == pool and not o.sent_before_kill for o in self.outcomes)

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)

    def check(self) -> None:
        """Every request completed, or got a 503 with Retry-After; only those in flight at the kill may differ."""
        assert self.outcomes
        for outcome in self.outcomes:
            if outcome.status == 200:
                continue
            if outcome.status == 503:
                assert outcome.retry_after is not None and int(outcome.retry_after) >= 1, outcome
                continue
            assert outcome.sent_before_kill, outcome


def kill_pid(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


def run_kill_under_load(gw, kill, survivor_pool: str) -> SteadyLoad:
    """Steady load; `kill()` once it is served; then wait until `survivor_pool` serves new requests again."""

    async def scenario() -> SteadyLoad:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120, trust_env=False) as client:
            load = SteadyLoad(client)
            load.start()
            try:
                await until(lambda: len(load.outcomes) >= 5, what="steady load served", gw=gw)
                load.killed[0], load.killed_at = True, time.monotonic()
                kill()
                await until(lambda: load.served_by(survivor_pool), RECOVERY_WAIT_S, what="service again", gw=gw)
                # A few more after the recovery: it serves, it does not just answer once.
                count = len(load.outcomes)
                await until(lambda: len(load.outcomes) >= count + 5, what="more requests served", gw=gw)
            finally:
                await load.stop()
            return load

    load = asyncio.run(scenario())
    load.check()
    return load


def test_sleep_kill_9_of_the_serving_server_resumes_the_sleeping_one(sleep_pair, time_shared, caplog):  # noqa: F811
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, **HEALING)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.INFO, logger="crossover.switching")
    load = run_kill_under_load(gw, speculative.kill, "plain")
    state = admin_state(gw)
    assert (state["phase"], state["mode"], state["recoveries"]) == ("active", "plain", 1), state
    last = state["last_switch"]
    assert (last["reason"], last["outcome"], last["to"]) == ("recovery", "ok", "plain"), last
    assert gw.metric("crossover_switch_recoveries_total", mechanism="sleep", outcome="ok") == 1
    assert any("recovering without an operator" in r.getMessage() for r in caplog.records)
    assert any(o.status == 200 and o.pool == "plain" for o in load.outcomes)


def test_restart_kill_9_of_the_serving_server_restarts_it_through_the_agent(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
    caplog,
):
    box = agent_box()
    gw = restart_gateway(box, **HEALING)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.INFO, logger="crossover.switching")
    pid = box.status("speculative")["pid"]
    run_kill_under_load(gw, lambda: kill_pid(pid), "speculative")
    state = admin_state(gw)
    assert (state["phase"], state["mode"], state["recoveries"]) == ("active", "speculative", 1), state
    assert state["last_switch"]["reason"] == "recovery"
    assert box.status("speculative")["state"] == "ready"
    assert box.status("speculative")["pid"] != pid
    assert gw.metric("crossover_switch_recoveries_total", mechanism="restart", outcome="ok") == 1
    assert any("recovering without an operator" in r.getMessage() for r in caplog.records)


def run_kill_during_drain(gw, kill) -> None:
    """A stream holds the drain of a switch to plain open; the old server dies: the switch still ends on plain."""

    async def scenario() -> bytes:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120, trust_env=False) as client:
            request = client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG))
            response = await client.send(request, stream=True)
            streaming = asyncio.create_task(response.aread())
            await until(lambda: gw.inflight() == 1, what="a stream in flight")
            switched = await client.put("/admin/mode", json={"mode": "plain"}, headers=AUTH)
            assert switched.status_code == 202
            await until(lambda: gw.state.topology.controller.phase == "draining", what="the drain")
            kill()
            raw = await asyncio.wait_for(streaming, RECOVERY_WAIT_S)  # the cut stream ends, it does not hang
            await until(lambda: gw.state.topology.controller.phase == "active", RECOVERY_WAIT_S, what="serving", gw=gw)
            after = await client.post("/v1/chat/completions", json=chat())
            assert after.status_code == 200 and after.headers["x-crossover-pool"] == "plain", after.text
            return raw

    raw = asyncio.run(scenario())
    assert raw.rstrip().endswith(b"data: [DONE]")
    state = admin_state(gw)
    assert (state["mode"], state["last_switch"]["to"], state["last_switch"]["outcome"]) == ("plain", "plain", "ok")


def test_sleep_kill_9_of_the_old_server_during_the_drain_still_ends_on_the_new_mode(sleep_pair, time_shared):  # noqa: F811
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, drain_deadline=60.0, **HEALING)
    wait_phase(gw, "active", "speculative")
    run_kill_during_drain(gw, speculative.kill)


def test_restart_kill_9_of_the_old_server_during_the_drain_still_ends_on_the_new_mode(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
):
    box = agent_box()
    gw = restart_gateway(box, drain_deadline=60.0, **HEALING)
    wait_phase(gw, "active", "speculative")
    pid = box.status("speculative")["pid"]
    run_kill_during_drain(gw, lambda: kill_pid(pid))
    assert box.status("plain")["state"] == "ready"


def test_sleep_kill_9_of_the_new_server_right_after_a_switch_brings_the_old_mode_back(
    sleep_pair,  # noqa: F811
    time_shared,  # noqa: F811
):
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, **HEALING)
    wait_phase(gw, "active", "speculative")
    assert put_mode(gw, "plain").status_code == 202
    wait_phase(gw, "active", "plain")
    load = run_kill_under_load(gw, plain.kill, "speculative")
    state = admin_state(gw)
    assert (state["mode"], state["last_switch"]["reason"], state["recoveries"]) == ("speculative", "recovery", 1)
    assert any(o.pool == "speculative" and o.status == 200 for o in load.outcomes)


def test_restart_kill_9_of_the_new_server_right_after_a_switch_recovers(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
):
    box = agent_box()
    gw = restart_gateway(box, **HEALING)
    wait_phase(gw, "active", "speculative")
    assert put_mode(gw, "plain").status_code == 202
    wait_phase(gw, "active", "plain", timeout=RECOVERY_WAIT_S)
    pid = box.status("plain")["pid"]
    run_kill_under_load(gw, lambda: kill_pid(pid), "plain")
    state = admin_state(gw)
    assert (state["mode"], state["last_switch"]["reason"]) == ("plain", "recovery"), state


def test_one_put_recovers_a_deployment_whose_active_server_is_dead(sleep_pair, time_shared):  # noqa: F811
    speculative, plain = sleep_pair
    # No self-healing here: the operator's one call does it.
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, dead_after_probes=100_000)
    wait_phase(gw, "active", "speculative")
    speculative.kill()
    assert put_mode(gw, "plain").status_code == 202
    state = wait_last_switch(gw)
    last = state["last_switch"]
    assert (last["outcome"], last["to"], last["from"]) == ("ok", "plain", "speculative"), last
    assert state["mode"] == "plain"
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False).status_code == 200


def attempts_spaced_by_the_backoff(caplog, base: float, marker: str) -> list[float]:
    times = [r.created for r in caplog.records if marker in r.getMessage()]
    # A lower bound only: a busy machine makes attempts later, never sooner.
    for i, (a, b) in enumerate(itertools.pairwise(times)):
        assert b - a >= min(base * 2**i, HEALING["backoff_max"]) * 0.99, times
    return times


def run_policy_switch_that_cannot_start(gw, caplog, marker: str) -> None:
    """Load far above the threshold calls for plain, which cannot come up: nothing is cut or held, ever."""
    cost = admin_state(gw)["switch_cost_s"]

    async def scenario() -> ClosedLoop:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120, trust_env=False) as client:
            load = ClosedLoop(client)
            load.resize(12)
            try:
                await until(
                    lambda: sum(marker in r.getMessage() for r in caplog.records) >= 3, RECOVERY_WAIT_S, what="3 tries"
                )
            finally:
                await load.stop()
            return load

    load = asyncio.run(scenario())
    assert load.results and [r for r in load.results if r != (200, "")] == []
    state = admin_state(gw)
    assert state["switch_cost_s"] == cost
    assert state["backoff"]["failures"] >= 3
    assert (state["phase"], state["mode"]) == ("active", "speculative")
    for reason in ("cut", "queue_full", "queue_timeout", "no_mode"):
        assert gw.metric("crossover_switch_dropped_total", reason=reason) == 0
    attempts_spaced_by_the_backoff(caplog, HEALING["backoff"], marker)


def test_sleep_a_policy_switch_to_a_dead_target_cuts_nothing_and_backs_off(sleep_pair, time_shared, caplog):  # noqa: F811
    speculative, plain = sleep_pair
    gw = time_shared(speculative.url, plain.url, **HEALING)
    wait_phase(gw, "active", "speculative")
    plain.kill()
    caplog.set_level(logging.INFO, logger="crossover.switching")
    run_policy_switch_that_cannot_start(gw, caplog, "not started: preflight")


def test_restart_a_policy_switch_with_the_agent_down_cuts_nothing_and_backs_off(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
    caplog,
):
    box = agent_box()
    gw = restart_gateway(box, dwell=1.0, expected_phase=3600.0, initial_cost=0.5, window=0.5, **HEALING)
    wait_phase(gw, "active", "speculative")
    box.kill_agent()
    caplog.set_level(logging.INFO, logger="crossover.switching")
    run_policy_switch_that_cannot_start(gw, caplog, "not started: preflight")


# --- the benchmark: kill -9 to the first successful request ----------------------------------------------

BENCH_SCALE = 20.0  # the stand-ins' --time-scale: Kimi-K2.5's switch costs (k25 profiles) divided by this


def measure_kill_to_first_success(gw, kill, survivor_pool: str) -> dict:
    """Wall seconds from the kill to the first request served after it, and the recovery's own share."""
    load = run_kill_under_load(gw, kill, survivor_pool)
    last = admin_state(gw)["last_switch"]
    return {"kill_to_first_success_s": round(load.kill_to_first_success_s(), 2), "recovery_s": last["duration_s"]}


def at_kimi(result: dict, detection_s: float) -> float:
    """The same recovery at the k25 profiles' real costs and the default health settings (3 x 5 s probes)."""
    from crossover.gateway.config import DEFAULT_DEAD_AFTER_PROBES, DEFAULT_HEALTH_INTERVAL_S

    default_detection = DEFAULT_DEAD_AFTER_PROBES * DEFAULT_HEALTH_INTERVAL_S
    return round(default_detection + (result["kill_to_first_success_s"] - detection_s) * BENCH_SCALE, 1)


@pytest.mark.slow  # a benchmark: prints wall-clock times, asserts only that service came back
def test_benchmark_kill_9_to_first_success_sleep(sim, time_shared):  # noqa: F811
    speculative, plain = (
        sim("k25-eagle3", "--time-scale", f"{BENCH_SCALE:g}"),
        sim("k25-plain", "--time-scale", f"{BENCH_SCALE:g}"),
    )
    httpx.post(plain.url + "/release_memory_occupation", json={}, timeout=30, trust_env=False)
    gw = time_shared(speculative.url, plain.url, dwell=3600.0, **HEALING)
    wait_phase(gw, "active", "speculative")
    result = measure_kill_to_first_success(gw, speculative.kill, "plain")
    detection = HEALING["dead_after_probes"] * gw.settings.health.interval
    print(f"sleep at 1/{BENCH_SCALE:g} of Kimi's costs: {result}; at Kimi's: ~{at_kimi(result, detection)} s")
    assert admin_state(gw)["mode"] == "plain"


@pytest.mark.slow  # a benchmark: prints wall-clock times, asserts only that service came back
def test_benchmark_kill_9_to_first_success_restart(agent_box, restart_gateway):  # noqa: F811
    from crossover.servers.sim.profile import load_profile

    startup_s = load_profile("k25-eagle3").memory.startup_s / BENCH_SCALE
    box = agent_box(time_scale=BENCH_SCALE, startup_s=startup_s)
    gw = restart_gateway(box, **HEALING)
    wait_phase(gw, "active", "speculative", timeout=RECOVERY_WAIT_S)
    pid = box.status("speculative")["pid"]
    result = measure_kill_to_first_success(gw, lambda: kill_pid(pid), "speculative")
    detection = HEALING["dead_after_probes"] * gw.settings.health.interval
    print(f"restart at 1/{BENCH_SCALE:g} of Kimi's costs: {result}; at Kimi's: ~{at_kimi(result, detection)} s")
    assert admin_state(gw)["mode"] == "speculative"


# --- the agent dies mid-switch; SGLang's queue-full ----------------------------------------------------------


def test_restart_the_agent_killed_while_it_starts_the_target_the_target_is_adopted(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
    caplog,
):
    # The plain server loads for a while: the agent dies while it waits for it. The server lives on (a real
    # agent's do), comes up by itself, and the gateway serves it without an operator; the agent's return stops
    # nothing.
    box = agent_box(plain_startup_s=3.0)
    gw = restart_gateway(box, **HEALING)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.INFO, logger="crossover.switching")
    assert put_mode(gw, "plain").status_code == 202
    wait_until(lambda: box.status("plain")["state"] == "starting", what="the agent starting plain")
    pid = box.status("plain")["pid"]
    box.kill_agent()
    wait_until(lambda: serves(box.urls["plain"]), timeout=RECOVERY_WAIT_S, what="the plain server up by itself")
    state = wait_phase(gw, "active", "plain", timeout=RECOVERY_WAIT_S)  # no operator call since the kill
    assert state["last_switch"]["to"] == "plain" and state["last_switch"]["outcome"] == "ok", state
    assert any("adopting it" in r.getMessage() for r in caplog.records)
    served = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)
    assert served.status_code == 200 and served.headers["x-crossover-pool"] == "plain", served.text

    box.start_agent()
    wait_until(lambda: box.status("plain")["state"] == "ready", what="the agent back, the plain server known")
    for _ in range(20):  # a few health rounds and many switch ticks with the agent back: plain still serves
        again = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)
        assert again.status_code == 200 and again.headers["x-crossover-pool"] == "plain", again.text
    assert box.status("plain")["pid"] == pid and box.status("plain")["state"] == "ready"
    assert admin_state(gw)["mode"] == "plain"


def test_restart_with_the_agent_gone_an_operator_put_serves_the_mode_that_serves(
    agent_box,  # noqa: F811
    restart_gateway,  # noqa: F811
):
    # Nothing heals by itself here (health rounds and backoff an hour apart): only the operator's PUT can bring
    # service back, and with the agent gone it does so by serving the server that already serves.
    box = agent_box(plain_startup_s=3.0)
    gw = restart_gateway(box, health={"interval": 3600.0, "timeout": 2.0}, backoff=3600.0, backoff_max=3600.0)
    wait_phase(gw, "active", "speculative")
    assert put_mode(gw, "plain").status_code == 202
    wait_until(lambda: box.status("plain")["state"] == "starting", what="the agent starting plain")
    box.kill_agent()
    wait_phase(gw, "unavailable", timeout=RECOVERY_WAIT_S)
    wait_until(lambda: serves(box.urls["plain"]), timeout=RECOVERY_WAIT_S, what="the plain server up by itself")
    assert admin_state(gw)["phase"] == "unavailable"  # nothing healed it: the hour-long waits hold
    assert put_mode(gw, "plain").status_code == 202
    state = wait_phase(gw, "active", "plain")
    assert state["last_switch"]["outcome"] == "ok", state
    served = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)
    assert served.status_code == 200 and served.headers["x-crossover-pool"] == "plain", served.text


def serves(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_sglang_queue_full_in_time_shared_mode_is_busy_not_a_dead_mode(sim, serve, time_shared):  # noqa: F811
    speculative = sim("k25-eagle3", "--time-scale", "20")
    plain = sim("k25-plain", "--time-scale", "20")
    release(plain.url)
    full = GateFaults(speculative.url)  # forwards everything; answers SGLang's queue-full when told
    gw = time_shared(serve(full.app()).url, plain.url, dwell=3600.0)
    wait_phase(gw, "active", "speculative")
    full.queue_full = True
    refused = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "backend_busy", refused.text  # not serving_mode_failed
    assert int(refused.headers["retry-after"]) <= 2  # retry shortly: the server is up, only full
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="busy") == 1
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="unavailable") == 0
    full.queue_full = False
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False).status_code == 200
    assert admin_state(gw)["phase"] == "active"  # nothing to recover
