"""The restart mechanism with real processes: the gateway's switch controller, the GPU-host agent and the
supervisor move a time-shared box between two real SGLang configurations under a load step, and `crossover
servers down` leaves no engine process behind.

Both modes are plain SGLang (a small and a larger running cap): speculation cannot run on CPU here (EAGLE
needs a decode backend that only the CPU kernel build has, and that build is not on the registry). Each switch
is a real start - on a warm machine ~15 s, the first one on a fresh machine about a minute.

Last of the real-SGLang tests (MODULE_ORDER): it leaves the box switched and then stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.state import group_members
from tests.conftest import crossover_argv
from tests.deploy.test_metric_names import exported
from tests.gateway.gateway_helpers import sse_events
from tests.gateway.topology.switching.test_controller import ClosedLoop
from tests.host_speed import StartupBudget
from tests.real_sglang.conftest import CONFIGS, IDLE_START_S, alive, engine_processes_after_down
from tests.real_sglang.test_engine_signals import loads
from tests.real_sglang.test_import_standins import assert_loaded_and_never_called, standin_lines

AGENT_TOKEN = "agent-token"
ADMIN_TOKEN = "admin-token"
THRESHOLD, HYSTERESIS = 4, 2
DWELL_S = 1.0
# A real start, and the drain before it: the start's budget, measured (tests/host_speed.py), twice over.
DRAIN_AND_START = 2


@dataclass
class Load(ClosedLoop):
    """The gateway tests' closed loop, asking for the tiny model, counting what it sent."""

    model: str = ""
    sent: int = 0

    async def _client(self, running: list[bool]) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Count."}], "stream": True}
        body |= {"max_tokens": self.max_tokens, "ignore_eos": True}
        while running[0]:
            self.sent += 1
            try:
                async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                    raw = await response.aread()
            except httpx.HTTPError as exc:
                self.results.append((0, f"{type(exc).__name__}: {exc}"))
                continue
            events = sse_events(raw) if response.status_code == 200 else []
            errors = [event for event in events if isinstance(event, dict) and "error" in event]
            complete = response.status_code == 200 and events[-1:] == ["[DONE]"] and not errors
            self.results.append((response.status_code, "" if complete else raw.decode()[:300]))


class HealthWatch:
    """Polls a server's /health from a thread: what it answers while it starts. Each sample is taken before
    the server's log is read, so an HTTP answer seen with no 'Uvicorn running' line in the log would be a
    server answering before its HTTP process said it runs."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log
        self.samples: list[tuple[str, bool]] = []  # (refused | HTTP status, the log says uvicorn runs)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while not self.done.wait(0.05):
                try:
                    outcome = str(client.get(self.url + "/health").status_code)
                except httpx.ConnectError:
                    outcome = "refused"
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                text = self.log.read_text(errors="replace") if self.log.exists() else ""
                self.samples.append((outcome, "Uvicorn running on" in text.rsplit("=== crossover servers", 1)[-1]))

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)


@pytest.fixture
def agent(real_sglang):
    port = free_port()
    proc = spawn(
        crossover_argv(
            "servers",
            "agent",
            str(real_sglang.profile),
            "--port",
            str(port),
            "--state-dir",
            str(real_sglang.state_dir),
            "--token",
            AGENT_TOKEN,
        ),
        die_with_parent=False,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc, 60)
        yield AgentProcess(url, proc)
    finally:
        stop([proc])


@dataclass
class AgentProcess:
    url: str
    proc: subprocess.Popen


def switches(gw) -> dict[tuple[str, str], float]:
    return {
        (to, outcome): gw.metric("crossover_mode_switches_total", mechanism="restart", to=to, outcome=outcome)
        for to in ("speculative", "plain")
        for outcome in ("ok", "failed", "unavailable")
    }


async def until(condition, what: str, gw, budget: StartupBudget) -> None:
    deadline = asyncio.get_running_loop().time() + DRAIN_AND_START * budget.seconds
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"gave up waiting for {what} after {DRAIN_AND_START} starts' budget ({budget.gave_up()}); "
                f"switching: {gw.state.topology.controller.view()}"
            )
        await asyncio.sleep(0.05)


def serving(gw, mode: str):
    controller = gw.state.topology.controller
    return lambda: controller.phase == "active" and controller.mode == mode


def test_a_load_step_restarts_between_two_real_servers_and_back_losing_nothing_and_down_leaves_nothing(
    real_sglang, agent, gateway
):
    urls = real_sglang.urls
    budget = StartupBudget.measure(IDLE_START_S, "a restart between the real SGLang servers")
    switch_wait_s = DRAIN_AND_START * budget.seconds
    gw = gateway(
        [urls["speculative"]],
        [urls["plain"]],
        topology="time-shared",
        admin_token=ADMIN_TOKEN,
        threshold=THRESHOLD,
        hysteresis=HYSTERESIS,
        switching={
            "mechanism": "restart",
            "dwell": DWELL_S,
            "window": 0.5,
            "interval": 0.05,
            # Phases long, the first switch assumed cheap: a switch always pays, so only the load decides.
            "expected_phase": 3600.0,
            "initial_cost": 0.5,
            "switch_timeout": switch_wait_s,
            # Nothing may be cut: the drain waits for every request in flight (a request of ~1 s idle takes
            # far longer beside the rest of the suite on 2 cores), held requests wait out a real start.
            "drain_deadline": switch_wait_s,
            "queue_timeout": switch_wait_s,
            "agent_url": agent.url,
            "agent_token": AGENT_TOKEN,
            "agent_servers": {"speculative": "speculative", "plain": "plain"},
        },
    )
    plain_log = real_sglang.state_dir / "logs" / "plain.log"

    async def scenario() -> tuple[Load, HealthWatch]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=httpx.Timeout(switch_wait_s, connect=5.0)) as client:
            # Requests of about a second each: the gateway's in-flight count then is the number of clients.
            load = Load(client, max_tokens=2000, model=real_sglang.model)
            try:
                await until(serving(gw, "speculative"), "the speculative mode serving", gw, budget)
                load.resize(1)
                await asyncio.sleep(3 * DWELL_S)  # low load: the speculative mode stays
                assert sum(switches(gw).values()) == 0
                with HealthWatch(urls["plain"], plain_log) as watch:
                    load.resize(3 * THRESHOLD)
                    await until(serving(gw, "plain"), "the switch to plain", gw, budget)
                await asyncio.sleep(3 * DWELL_S)  # high load holds plain
                assert loads(urls["plain"])["max_running_requests"] == CONFIGS["plain"]["max_running_requests"]
                # A fresh SGLang exports a labelled counter only from its first event (prometheus multiprocess
                # mode): no request was aborted here, so not even its TYPE line (the stand-in's is there).
                assert "sglang:num_aborted_requests_total" not in exported(urls["plain"])
                load.resize(1)
                await until(serving(gw, "speculative"), "the switch back to speculative", gw, budget)
                await asyncio.sleep(DWELL_S)
            finally:
                await load.stop()
            return load, watch

    load, watch = asyncio.run(scenario())
    counts = switches(gw)
    assert counts[("plain", "ok")] == 1 and counts[("speculative", "ok")] == 1, counts
    assert sum(counts.values()) == 2, counts
    # Every request sent was answered in full: none lost, cut or refused across two real restarts.
    assert len(load.results) == load.sent > 20
    assert [result for result in load.results if result != (200, "")] == []
    assert gw.metric("crossover_switch_dropped_total", reason="cut") == 0
    assert gw.state.topology.controller.queued == 0 and gw.inflight() == 0
    assert loads(urls["speculative"])["max_running_requests"] == CONFIGS["speculative"]["max_running_requests"]

    # While SGLang loads, nothing listens: connections are refused until its HTTP process runs (the stand-in
    # instead answers 503 during its start-up delay; servers/sim/README.md).
    outcomes = [outcome for outcome, _ in watch.samples]
    assert "refused" in outcomes, outcomes[:50]
    assert [s for s in watch.samples if s[0] != "refused" and not s[1]] == []
    assert set(outcomes) <= {"refused", "503", "200"}, set(outcomes)

    # `down` stops every process of every server: the HTTP process, its scheduler and its detokenizer.
    marker = str(real_sglang.standin_log)
    members = group_members(real_sglang.pgids()["speculative"])
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in members}
    assert {"sglang::schedul", "sglang::detoken"} <= names, names  # comm is cut at 15 characters
    # The gateway still runs and heals its GPU set: with the agent up it would bring a mode back up the moment
    # `down` stopped it. So the agent goes first; then nothing can start a server behind `down`.
    stop([agent.proc])
    down = real_sglang.run("down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert [pid for pid in members if alive(pid)] == []
    assert engine_processes_after_down(marker) == []  # nor any process started with the server's environment
    assert "no process of its group is left" in down.stderr
    with contextlib.suppress(FileNotFoundError):
        assert real_sglang.pgids() == {}
    assert_loaded_and_never_called(standin_lines(real_sglang.standin_log))
