"""Time-shared switching by restart, live: the gateway drives the real GPU-host agent (`crossover servers agent`)
over stand-ins that it starts and stops (and, for sleep with an agent, releases and resumes); and a sleep switch
against a restart switch with the same delays.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.sim.profile import load_profile
from tests.conftest import crossover_argv
from tests.gateway.gateway_helpers import MODEL
from tests.gateway.topology.switching.test_controller import (
    DWELL_S,
    HYSTERESIS,
    THRESHOLD,
    TOKEN,
    admin_state,
    put_mode,
    release,
    released,
    run_load_step,
    wait_last_switch,
    wait_phase,
)
from tests.waiting import wait_until

AGENT_TOKEN = "agent-token"
TIME_SCALE = 50.0
# Seconds (wall clock) the stand-ins take to load their weights at start-up.
STARTUP_S = 1.0
READY_S = 30.0
# The load step's clients hold their number of requests in flight only while a request outlasts a client's own
# time between two: at 50x a stream is over in a few hundredths of a second, less than a client starved of CPU
# takes to resend (beside CPU burners the gateway read a load of 0 from 18 clients). test_switching's 20x holds.
LOAD_STEP_TIME_SCALE = 20.0

SERVER = """
[[servers]]
name = "{name}"
role = "{name}"
engine = "sim"
served_model_name = "{model}"
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
host = "127.0.0.1"
port = {port}
max_running_requests = 128
ready_timeout_s = {ready_timeout_s}
stop_timeout_s = 10
extra_args = []
launcher = []

[servers.sim]
profile = "{sim_profile}"
time_scale = {time_scale}
startup_delay_s = {startup_s}
"""

SPECULATIVE_PARAMS = """
[servers.speculative]
algorithm = "EAGLE3"
draft_model_path = "lightseekorg/kimi-k2.5-eagle3"
num_steps = 3
eagle_topk = 1
num_draft_tokens = 4
"""


@dataclass
class AgentBox:
    """One simulated GPU host: its profile, its servers (started by `crossover servers up`) and its agent."""

    profile: Path
    state_dir: Path
    agent_url: str
    agent_port: int
    urls: dict[str, str]
    agent: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.state_dir.parent / f"agent-{self.agent_port}.log"

    def log(self) -> str:
        """What the agent wrote (its operation log: warnings and up) over all of its starts."""
        return self.log_path.read_text(errors="replace")

    def start_agent(self) -> None:
        with self.log_path.open("ab") as log:
            self.agent = spawn(
                crossover_argv(
                    "servers",
                    "agent",
                    str(self.profile),
                    "--port",
                    str(self.agent_port),
                    "--state-dir",
                    str(self.state_dir),
                    "--token",
                    AGENT_TOKEN,
                ),
                die_with_parent=False,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_ready(self.agent_url + "/health", self.agent, READY_S)

    def kill_agent(self) -> None:
        """The agent dies (SIGKILL): the servers it started live on, as a real agent's do."""
        os.kill(self.agent.pid, signal.SIGKILL)
        self.agent.wait(10)

    def status(self, name: str) -> dict:
        return httpx.get(
            f"{self.agent_url}/servers/{name}", headers={"authorization": f"Bearer {AGENT_TOKEN}"}, timeout=10
        ).json()

    def operate(self, name: str, operation: str) -> dict:
        """POST an operation as a gateway without a cluster does (no fencing token)."""
        return httpx.post(
            f"{self.agent_url}/servers/{name}/{operation}",
            headers={"authorization": f"Bearer {AGENT_TOKEN}"},
            timeout=60,
        ).json()

    def operations(self, operation: str) -> float:
        """How many `operation`s (start, stop, ...) this agent was asked for since it started, whatever the outcome
        (crossover_agent_operations_total)."""
        text = httpx.get(self.agent_url + "/metrics", timeout=10, trust_env=False).text
        prefix = f'crossover_agent_operations_total{{operation="{operation}",'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture
def agent_box(tmp_path):
    """`agent_box(plain_startup_s=..., plain_ready_timeout_s=...)` -> AgentBox with speculative up, plain stopped
    (`mechanism="sleep"`: plain started and released)."""
    boxes: list[AgentBox] = []

    def start(
        *,
        time_scale: float = TIME_SCALE,
        startup_s: float = STARTUP_S,
        plain_startup_s: float | None = None,
        plain_ready_timeout_s: float = READY_S,
        mechanism: str = "restart",
    ) -> AgentBox:
        ports = {"speculative": free_port(), "plain": free_port()}
        text = (
            'description = "test: two stand-ins sharing one simulated GPU set"\n'
            'sglang_version = "0.5.23"\ntopology = "time-shared"\nhost_memory_headroom_gb = 0\n'
            f'sglang_command = ["sglang", "serve"]\n\n[time_shared]\nmechanism = "{mechanism}"\n'
            'initial = "speculative"\n'
        )
        for name, sim_profile in (("speculative", "k25-eagle3"), ("plain", "k25-plain")):
            text += SERVER.format(
                name=name,
                model=MODEL,
                port=ports[name],
                sim_profile=sim_profile,
                time_scale=time_scale,
                startup_s=plain_startup_s if name == "plain" and plain_startup_s is not None else startup_s,
                ready_timeout_s=plain_ready_timeout_s if name == "plain" else READY_S,
            )
            if name == "speculative":
                text += SPECULATIVE_PARAMS
        profile = tmp_path / f"box-{ports['speculative']}.toml"
        profile.write_text(text)
        agent_port = free_port()
        box = AgentBox(
            profile=profile,
            state_dir=tmp_path / f"state-{ports['speculative']}",
            agent_url=f"http://127.0.0.1:{agent_port}",
            agent_port=agent_port,
            urls={name: f"http://127.0.0.1:{port}" for name, port in ports.items()},
        )
        boxes.append(box)
        up = subprocess.run(
            crossover_argv("servers", "up", str(profile), "--state-dir", str(box.state_dir)),
            check=False,
            capture_output=True,
            text=True,
            timeout=READY_S * 2,
        )
        assert up.returncode == 0, up.stderr
        box.start_agent()
        return box

    yield start
    for box in boxes:
        if box.agent is not None:
            stop([box.agent])
        subprocess.run(
            crossover_argv("servers", "down", str(box.profile), "--state-dir", str(box.state_dir)),
            check=False,
            capture_output=True,
            timeout=60,
        )


@pytest.fixture
def restart_gateway(gateway):
    def start(box: AgentBox, health: dict | None = None, **switching):
        """A time-shared gateway restarting through `box`'s agent; `switching` over the defaults below, `health`
        (if given) for the gateway's own."""
        overrides = {} if health is None else {"health": health}
        switching = {
            "mechanism": "restart",
            "dwell": 3600.0,
            "window": 1.0,
            "interval": 0.1,
            "agent_url": box.agent_url,
            "agent_token": AGENT_TOKEN,
            "agent_servers": {"speculative": "speculative", "plain": "plain"},
            "operator_interval": 0.0,
            **switching,
        }
        return gateway(
            [box.urls["speculative"]],
            [box.urls["plain"]],
            topology="time-shared",
            admin_token=TOKEN,
            threshold=4,
            hysteresis=2,
            switching=switching,
            **overrides,
        )

    return start


@pytest.mark.parametrize(
    ("comes_up", "serving", "reason"),
    [
        pytest.param(True, "plain", "adopted", id="it-comes-up-and-serves"),
        # The stand-in loads for 600 s, its ready timeout is 2 s: the agent's start fails, and the gateway recovers as
        # from no serving mode (the initial mode brought up).
        pytest.param(False, "speculative", "startup", id="it-fails-the-initial-mode-comes-up"),
    ],
)
def test_a_gateway_that_finds_a_start_under_way_waits_for_it(agent_box, restart_gateway, comes_up, serving, reason):
    box = agent_box(plain_startup_s=3.0 if comes_up else 600.0, plain_ready_timeout_s=30.0 if comes_up else 2.0)
    box.operate("speculative", "stop")
    wait_until(lambda: box.status("speculative")["state"] == "stopped", what="speculative stopped")
    box.operate("plain", "start")  # as a gateway lost mid-switch leaves it: the target starting, nothing serving
    assert box.status("plain")["state"] == "starting"
    gw = restart_gateway(box)
    state = wait_phase(gw, "active", serving, timeout=90)
    assert (state["last_switch"]["reason"], state["last_switch"]["outcome"]) == (reason, "ok"), state
    assert box.status(serving)["state"] == "ready"
    # The test's stop and start; then nothing (it came up), or the recovery's stop of plain and start of speculative.
    assert (box.operations("stop"), box.operations("start")) == ((1, 1) if comes_up else (2, 2))


def test_a_restart_switch_through_the_agent_and_back(agent_box, restart_gateway):
    box = agent_box()
    gw = restart_gateway(box)
    wait_phase(gw, "active", "speculative")
    assert put_mode(gw, "plain").status_code == 202
    state = wait_phase(gw, "active", "plain")
    assert state["last_switch"]["outcome"] == "ok", state
    assert box.status("speculative")["state"] == "stopped"
    assert box.status("plain")["state"] == "ready"
    assert put_mode(gw, "speculative").status_code == 202
    state = wait_phase(gw, "active", "speculative")
    assert state["last_switch"]["outcome"] == "ok", state
    assert box.status("plain")["state"] == "stopped"
    assert gw.metric("crossover_mode_switches_total", mechanism="restart", to="plain", outcome="ok") == 1
    assert gw.metric("crossover_mode_switches_total", mechanism="restart", to="speculative", outcome="ok") == 1


def test_a_sleep_switch_through_the_agent_and_back(agent_box, restart_gateway):
    box = agent_box(mechanism="sleep")  # speculative serves, plain is released
    gw = restart_gateway(box, mechanism="sleep")
    wait_phase(gw, "active", "speculative")
    for mode, other in (("plain", "speculative"), ("speculative", "plain")):
        assert put_mode(gw, mode).status_code == 202
        state = wait_phase(gw, "active", mode)
        assert state["last_switch"]["outcome"] == "ok", state
        assert (box.status(other)["state"], box.status(mode)["state"]) == ("released", "ready")
        assert gw.metric("crossover_mode_switches_total", mechanism="sleep", to=mode, outcome="ok") == 1
    agent_metrics = httpx.get(box.agent_url + "/metrics", timeout=10).text
    for operation in ("release", "resume"):  # the switches' own calls went through the agent
        assert f'crossover_agent_operations_total{{operation="{operation}",outcome="ok"}} 2.0' in agent_metrics


def test_a_load_step_up_and_back_restarts_once_each_way_and_every_request_completes(agent_box, gateway):
    box = agent_box(time_scale=LOAD_STEP_TIME_SCALE)
    gw = gateway(
        [box.urls["speculative"]],
        [box.urls["plain"]],
        topology="time-shared",
        admin_token=TOKEN,
        threshold=THRESHOLD,
        hysteresis=HYSTERESIS,
        switching={
            "mechanism": "restart",
            "dwell": DWELL_S,
            "window": 0.5,
            "interval": 0.05,
            "expected_phase": 3600.0,
            "initial_cost": 0.5,
            "agent_url": box.agent_url,
            "agent_token": AGENT_TOKEN,
            "agent_servers": {"speculative": "speculative", "plain": "plain"},
        },
    )
    wait_phase(gw, "active", "speculative")
    run_load_step(gw, "restart")
    assert box.status("plain")["state"] == "stopped"


def test_a_server_that_never_becomes_ready_sends_the_gpu_set_back_to_the_old_mode(agent_box, restart_gateway, caplog):
    box = agent_box(plain_startup_s=600.0, plain_ready_timeout_s=2.0)
    gw = restart_gateway(box)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    assert put_mode(gw, "plain").status_code == 202
    state = wait_last_switch(gw, timeout=60)
    last = state["last_switch"]
    assert (last["outcome"], last["failed_step"], last["mode_after"]) == ("failed", "start", "speculative"), last
    assert box.status("speculative")["state"] == "ready"
    assert gw.metric("crossover_mode_switches_total", mechanism="restart", to="plain", outcome="failed") == 1
    assert any("failed at start" in r.getMessage() for r in caplog.records)


def test_the_agent_dying_mid_switch_leaves_no_serving_mode_and_the_gateway_says_so(agent_box, restart_gateway, caplog):
    box = agent_box(plain_startup_s=600.0)
    gw = restart_gateway(box)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.switching")
    assert put_mode(gw, "plain").status_code == 202
    wait_until(lambda: box.status("plain")["state"] == "starting", what="the plain server starting")
    box.kill_agent()
    state = wait_phase(gw, "unavailable", timeout=60)
    assert state["last_switch"]["outcome"] == "unavailable"
    assert "agent" in state["last_switch"]["error"]
    assert gw.metric("crossover_mode_switches_total", mechanism="restart", to="plain", outcome="unavailable") == 1
    assert any("no mode serves" in r.getMessage() for r in caplog.records)

    # Once an agent is back, the operator brings a mode back.
    box.start_agent()

    # The gateway keeps retrying by itself meanwhile: a PUT that lands during an attempt is refused 409
    # switch_in_progress, and the operator sends it again.
    def taken() -> bool:
        answer = put_mode(gw, "speculative")
        assert answer.status_code == 202 or answer.json()["error"]["code"] == "switch_in_progress", answer.text
        return answer.status_code == 202

    wait_until(taken, timeout=60, what="the PUT taken")
    state = wait_phase(gw, "active", "speculative", timeout=60)
    assert state["last_switch"]["outcome"] == "ok"
    assert box.status("plain")["state"] == "stopped"


@pytest.mark.slow  # compares two wall-clock durations: a benchmark, not a pass/fail test on shared cores
def test_a_sleep_switch_is_several_times_faster_than_a_restart_with_the_same_stand_in_delays(
    agent_box, restart_gateway, sim, gateway
):
    # Both mechanisms on the same stand-in profile's delays ([memory] startup_s for a restart, release_s and
    # resume_s for sleep/wake), at the same time scale.
    scale = 200.0
    startup_s = load_profile("k25-plain").memory.startup_s / scale
    box = agent_box(time_scale=scale, plain_startup_s=startup_s)
    restart_gw = restart_gateway(box)
    speculative, plain = sim("k25-eagle3", "--time-scale", f"{scale:g}"), sim("k25-plain", "--time-scale", f"{scale:g}")
    release(plain.url)
    sleep_gw = gateway(
        [speculative.url],
        [plain.url],
        topology="time-shared",
        admin_token=TOKEN,
        switching={"mechanism": "sleep", "dwell": 3600.0, "interval": 0.1},
    )
    durations = {}
    for name, gw in (("restart", restart_gw), ("sleep", sleep_gw)):
        wait_phase(gw, "active", "speculative")
        assert put_mode(gw, "plain").status_code == 202
        state = wait_phase(gw, "active", "plain")
        assert state["last_switch"]["outcome"] == "ok"
        durations[name] = state["last_switch"]["duration_s"]
    assert released(speculative.url)
    print("switch durations (s):", durations)
    assert durations["restart"] > 3 * durations["sleep"], durations
    assert admin_state(sleep_gw)["switch_cost_s"] == pytest.approx(durations["sleep"], rel=1e-3)


def test_a_planned_stop_is_not_an_ejection(agent_box, restart_gateway, caplog):
    box = agent_box()
    gw = restart_gateway(box)
    wait_phase(gw, "active", "speculative")
    caplog.set_level(logging.WARNING, logger="crossover.health")
    assert put_mode(gw, "plain").status_code == 202
    wait_phase(gw, "active", "plain")
    stopped = gw.state.pools.speculative[0]
    # The health checks keep probing the stopped server: past the failure threshold, no ejection.
    wait_until(lambda: stopped.failures >= 2 * gw.settings.health.failure_threshold, what="failed probes of it")
    assert not any("ejected backend" in r.getMessage() for r in caplog.records)
    assert gw.metric("crossover_backend_ejections_total", pool="speculative", backend=stopped.url, source="probe") == 0


def test_with_nothing_serving_at_start_up_the_gateway_brings_the_initial_mode_up(agent_box, restart_gateway):
    box = agent_box()
    headers = {"authorization": f"Bearer {AGENT_TOKEN}"}
    assert httpx.post(f"{box.agent_url}/servers/speculative/stop", headers=headers, timeout=10).status_code == 202
    wait_until(lambda: box.status("speculative")["state"] == "stopped", what="speculative stopped")
    gw = restart_gateway(box)
    state = wait_phase(gw, "active", "speculative", timeout=60)
    assert (state["last_switch"]["reason"], state["last_switch"]["outcome"]) == ("startup", "ok"), state
    assert box.status("speculative")["state"] == "ready" and box.status("plain")["state"] == "stopped"
