"""The GPU-host agent (`crossover servers agent`), run as a process against the standin-time-shared profile:
the token is never optional, one operation per GPU set, start/stop of a stand-in, and an agent restart that
finds the running servers instead of starting duplicates. The contract is in the agent's module docstring;
the switch controller depends on it."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.state import group_members
from tests.conftest import crossover_argv
from tests.servers.conftest import recorded_groups, run_cli
from tests.waiting import wait_until

TOKEN = "s3cret-agent-token"
AGENT_READY_S = 30.0
OPERATION_WAIT_S = 60.0
STATUS_KEYS = {"name", "role", "state", "pid", "url", "last_start_s", "error"}


@dataclass
class Agent:
    url: str
    proc: subprocess.Popen

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10, trust_env=False)

    def wait_state(self, name: str, *states: str) -> dict:
        seen: dict = {}

        def reached() -> bool:
            seen.update(self.client().get(f"/servers/{name}").json())
            return seen["state"] in states

        wait_until(reached, timeout=OPERATION_WAIT_S, what=f"{name} to become {'/'.join(states)}")
        return seen


@pytest.fixture
def start_agent(state_dir):
    agents: list[subprocess.Popen] = []

    def start(profile, *, token: str = TOKEN) -> Agent:
        port = free_port()
        env = {**os.environ, "CROSSOVER_AGENT_TOKEN": token}
        proc = spawn(
            crossover_argv("servers", "agent", str(profile), "--port", str(port), "--state-dir", str(state_dir)),
            die_with_parent=False,
            env=env,
        )
        agents.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", proc, AGENT_READY_S)
        return Agent(url, proc)

    yield start
    stop(agents)


def run_agent_without_a_usable_token(standin_profile, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        crossover_argv("servers", "agent", str(standin_profile("standin-time-shared")), "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_the_agent_refuses_to_start_without_a_token(standin_profile):
    env = {k: v for k, v in os.environ.items() if k != "CROSSOVER_AGENT_TOKEN"}
    result = run_agent_without_a_usable_token(standin_profile, env)
    assert result.returncode == 2
    assert "--token" in result.stderr and "CROSSOVER_AGENT_TOKEN" in result.stderr


def test_missing_or_wrong_token_is_401_and_health_and_metrics_are_open(standin_profile, start_agent):
    agent = start_agent(standin_profile("standin-time-shared"))
    assert agent.client(None).get("/health").json() == {"status": "ok"}
    assert "crossover_agent_operations_total" in agent.client(None).get("/metrics").text
    for token in (None, "wrong", TOKEN + "x"):
        for method, path in (("GET", "/servers"), ("GET", "/servers/plain"), ("POST", "/servers/plain/start")):
            response = agent.client(token).request(method, path)
            assert response.status_code == 401, (token, path)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "authentication_error"
    assert agent.client("Basic " + TOKEN).get("/servers").status_code == 401
    listed = agent.client().get("/servers").json()["servers"]
    assert [s["name"] for s in listed] == ["speculative", "plain"]
    assert all(set(s) == STATUS_KEYS and s["state"] == "stopped" for s in listed)
    assert agent.client().get("/servers/nope").status_code == 404
    assert agent.client().post("/servers/nope/start").status_code == 404
    assert agent.client(None).post("/servers/plain/start").status_code == 401
    assert recorded_groups_of(agent) == {}, "a refused request starts nothing"


def recorded_groups_of(agent: Agent) -> dict:
    return {s["name"]: s["pid"] for s in agent.client().get("/servers").json()["servers"] if s["pid"]}


def test_start_and_stop_a_standin_with_one_operation_per_gpu_set(standin_profile, start_agent, state_dir):
    # A slow start (3 s of emulated weight loading) leaves time to collide with it.
    agent = start_agent(standin_profile("standin-time-shared", startup_delay_s=3.0))
    client = agent.client()

    started = client.post("/servers/speculative/start")
    assert started.status_code == 202
    assert started.json()["state"] == "starting" and started.json()["role"] == "speculative"

    for path in ("/servers/plain/start", "/servers/plain/stop", "/servers/speculative/stop"):
        conflict = client.post(path)
        assert conflict.status_code == 409, path
        assert conflict.json()["error"]["code"] == "gpu_set_busy"

    ready = agent.wait_state("speculative", "ready", "failed")
    assert ready["state"] == "ready", ready
    assert ready["pid"] and ready["last_start_s"] >= 3.0
    completion = httpx.post(
        f"{ready['url']}/v1/completions",
        json={"model": "moonshotai/Kimi-K2.5", "prompt": "hi", "max_tokens": 1},
        timeout=10,
    )
    assert completion.status_code == 200

    # The speculative server holds the GPU set: the plain one may start only after it stopped.
    held = client.post("/servers/plain/start")
    assert held.status_code == 409 and "stop it first" in held.json()["error"]["message"]

    pgid = recorded_groups(state_dir)["speculative"]
    stopping = client.post("/servers/speculative/stop")
    assert stopping.status_code == 202 and stopping.json()["state"] == "stopping"
    assert agent.wait_state("speculative", "stopped", "failed")["state"] == "stopped"
    assert group_members(pgid) == []

    assert client.post("/servers/plain/start").status_code == 202
    assert agent.wait_state("plain", "ready", "failed")["state"] == "ready"

    metrics = agent.client(None).get("/metrics").text
    assert 'crossover_agent_operations_total{operation="start",outcome="ok"} 2.0' in metrics
    assert 'crossover_agent_operations_total{operation="stop",outcome="ok"} 1.0' in metrics
    assert 'crossover_agent_operations_total{operation="start",outcome="conflict"} 2.0' in metrics
    assert 'crossover_agent_operations_total{operation="stop",outcome="conflict"} 2.0' in metrics
    assert 'crossover_agent_server_state{role="plain",server="plain",state="ready"} 1.0' in metrics
    assert 'crossover_agent_last_start_duration_seconds{server="speculative"}' in metrics


def test_a_restarted_agent_finds_running_servers_instead_of_starting_duplicates(
    standin_profile, start_agent, state_dir
):
    profile = standin_profile("standin-time-shared")
    first = start_agent(profile)
    assert first.client().post("/servers/speculative/start").status_code == 202
    before = first.wait_state("speculative", "ready", "failed")
    assert before["state"] == "ready"
    groups = recorded_groups(state_dir)

    os.kill(first.proc.pid, signal.SIGKILL)  # the agent dies; its servers must not
    first.proc.wait(10)
    assert group_members(groups["speculative"])

    second = start_agent(profile)
    after = second.client().get("/servers/speculative").json()
    assert after["state"] == "ready" and after["pid"] == before["pid"]
    assert second.client().post("/servers/speculative/start").status_code == 202
    assert second.wait_state("speculative", "ready", "failed")["pid"] == before["pid"]
    assert recorded_groups(state_dir) == groups, "no second copy was started"
    assert second.client().get("/servers/plain").json()["state"] == "stopped"

    # And `down` from the CLI still reaches what the agents started.
    result = run_cli("down", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    assert group_members(groups["speculative"]) == []


def test_a_start_that_fails_is_reported_as_failed(standin_profile, start_agent):
    agent = start_agent(standin_profile("standin-time-shared", launcher=["false"]))
    assert agent.client().post("/servers/plain/start").status_code == 202
    failed = agent.wait_state("plain", "failed", "ready")
    assert failed["state"] == "failed" and "exited before it was ready" in failed["error"]
    assert 'operation="start",outcome="failed"} 1.0' in agent.client(None).get("/metrics").text


def test_sleep_a_start_of_the_released_mode_resumes_it(standin_profile, start_agent, state_dir):
    profile = standin_profile("standin-time-shared", mechanism="sleep")
    up = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert up.returncode == 0, up.stderr
    agent = start_agent(profile)
    client = agent.client()
    plain = client.get("/servers/plain").json()
    assert plain["state"] == "released"
    assert client.get("/servers/speculative").json()["state"] == "ready"

    held = client.post("/servers/plain/start")
    assert held.status_code == 409 and "'speculative' holds GPUs" in held.json()["error"]["message"]
    assert client.post("/servers/speculative/stop").status_code == 202
    assert agent.wait_state("speculative", "stopped", "failed")["state"] == "stopped"

    assert client.post("/servers/plain/start").status_code == 202
    resumed = agent.wait_state("plain", "ready", "failed")
    assert resumed["state"] == "ready" and resumed["pid"] == plain["pid"], "resumed in place, not restarted"
    completion = httpx.post(
        f"{resumed['url']}/v1/completions",
        json={"model": "moonshotai/Kimi-K2.5", "prompt": "hi", "max_tokens": 1},
        timeout=10,
    )
    assert completion.status_code == 200
