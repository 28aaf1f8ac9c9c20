"""Fixtures: a small live deployment on loopback - a gateway process (`crossover serve`) in front of two
stand-ins, and the GPU-host agent (`crossover servers agent`) over the stand-in time-shared profile.

- `deployment` -> Deployment (everything ready; the agent is None, with `agent_missing` saying why, until the
  `crossover servers agent` command exists)
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.conftest import READY_TIMEOUT_S, SimServer, crossover_argv
from tests.gateway.conftest import GatewayProcess, gateway_process  # noqa: F401  (a fixture, used here)
from tests.gateway.gateway_helpers import SIM_SCALE, chat

AGENT_PROFILE = "standin-time-shared"
AGENT_TOKEN = "deploy-test-token"
THRESHOLD = 5
REQUESTS = 3
REQUEST_TIMEOUT_S = 30.0


@dataclass
class Agent:
    url: str
    proc: subprocess.Popen

    def hostport(self) -> str:
        return self.url.removeprefix("http://")


@dataclass
class Deployment:
    gateway: GatewayProcess
    speculative: SimServer
    plain: SimServer
    agent: Agent | None
    agent_missing: str = ""


def agent_command_missing() -> str:
    """Why the agent cannot run here ('' when `crossover servers agent` exists)."""
    result = subprocess.run(
        crossover_argv("servers", "agent", "--help"), capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        return f"`crossover servers agent` is not available yet (issue 9): {result.stderr.strip()[-200:]}"
    return ""


@pytest.fixture
def agent(tmp_path):
    """The GPU-host agent over the stand-in time-shared profile (its servers left stopped), or None."""
    started: list[subprocess.Popen] = []

    def start() -> Agent:
        port = free_port()
        proc = spawn(
            crossover_argv(
                "servers", "agent", AGENT_PROFILE, "--port", str(port), "--token", AGENT_TOKEN,
                "--state-dir", str(tmp_path / "agent-state"),
            ),
            die_with_parent=False,
        )  # fmt: skip
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", proc, READY_TIMEOUT_S)
        return Agent(url, proc)

    yield start
    stop(started)


@pytest.fixture
def deployment(sim, gateway_process, agent):  # noqa: F811  (gateway_process is the imported fixture)
    speculative, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    gateway = gateway_process(
        f'threshold = {THRESHOLD}\nadmin_token = "test"\nload_signal = "max"\n'
        f'[pools.speculative]\nbackends = ["{speculative.url}"]\n'
        f'[pools.plain]\nbackends = ["{plain.url}"]\n'
        "[health]\ninterval = 0.5\ntimeout = 2.0\nfailure_threshold = 1\nload_interval = 0.5\n"
        # No load balancer to drain here: stop at once.
        "[timeouts]\nshutdown_delay = 0\n"
    )
    with httpx.Client(base_url=gateway.url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        for _ in range(REQUESTS):
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    missing = agent_command_missing()
    return Deployment(gateway, speculative, plain, None if missing else agent(), missing)


@pytest.fixture
def time_shared_deployment(sim, gateway_process):  # noqa: F811  (gateway_process is the imported fixture)
    """A time-shared gateway (manual switching: it stays in speculative mode) over two stand-ins, no agent."""
    speculative, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    gateway = gateway_process(
        f'topology = "time-shared"\nthreshold = {THRESHOLD}\nadmin_token = "test"\n'
        f'[pools.speculative]\nbackends = ["{speculative.url}"]\n'
        f'[pools.plain]\nbackends = ["{plain.url}"]\n'
        '[switching]\nmechanism = "manual"\ninitial_mode = "speculative"\n'
        "[health]\ninterval = 0.5\ntimeout = 2.0\nfailure_threshold = 1\n"
        "[timeouts]\nshutdown_delay = 0\n"
    )
    return Deployment(gateway, speculative, plain, None, "not part of a manual time-shared deployment")
