"""The GPU-host agent (`crossover servers agent`), run as a process against the standin-time-shared profile:
the token is never optional, one operation per GPU set, start/stop of a stand-in, and an agent restart that
finds the running servers instead of starting duplicates. The contract is in the agent's module docstring;
the switch controller depends on it."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx

from crossover.servers.process import free_port
from crossover.servers.state import group_members
from tests.conftest import crossover_argv
from tests.servers.conftest import STATUS_KEYS, TOKEN, Agent, recorded_groups, run_cli
from tests.waiting import wait_until


def assert_generates(url: str) -> None:
    completion = httpx.post(
        f"{url}/v1/completions", json={"model": "moonshotai/Kimi-K2.5", "prompt": "hi", "max_tokens": 1}, timeout=10
    )
    assert completion.status_code == 200, completion.text


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
    assert_generates(ready["url"])

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


def sleeping(standin_profile, start_agent, state_dir) -> tuple[Agent, dict]:
    """A sleep profile `up` (speculative serving, plain released) and an agent over it; the plain server's status."""
    profile = standin_profile("standin-time-shared", mechanism="sleep")
    up = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert up.returncode == 0, up.stderr
    agent = start_agent(profile)
    plain = agent.client().get("/servers/plain").json()
    assert plain["state"] == "released"
    return agent, plain


def test_sleep_a_start_of_the_released_mode_resumes_it(standin_profile, start_agent, state_dir):
    agent, plain = sleeping(standin_profile, start_agent, state_dir)
    client = agent.client()
    assert client.get("/servers/speculative").json()["state"] == "ready"

    held = client.post("/servers/plain/start")
    assert held.status_code == 409 and "'speculative' holds GPUs" in held.json()["error"]["message"]
    assert client.post("/servers/speculative/stop").status_code == 202
    assert agent.wait_state("speculative", "stopped", "failed")["state"] == "stopped"

    assert client.post("/servers/plain/start").status_code == 202
    resumed = agent.wait_state("plain", "ready", "failed")
    assert resumed["state"] == "ready" and resumed["pid"] == plain["pid"], "resumed in place, not restarted"
    assert_generates(resumed["url"])


def test_sleep_release_and_resume_through_the_agent_one_mode_at_a_time_and_idempotent(
    standin_profile, start_agent, state_dir
):
    agent, plain = sleeping(standin_profile, start_agent, state_dir)
    client = agent.client()

    held = client.post("/servers/plain/resume")
    assert held.status_code == 409 and "'speculative' holds GPUs" in held.json()["error"]["message"]
    assert "release it first" in held.json()["error"]["message"]

    for _ in range(2):  # a second release of a released server changes nothing
        released = client.post("/servers/speculative/release")
        assert released.status_code == 200, released.text
        assert released.json()["state"] == "released"
    for _ in range(2):  # nor does a second resume (SGLang 0.5.23 would die on it)
        resumed = client.post("/servers/plain/resume")
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["state"] == "ready" and resumed.json()["pid"] == plain["pid"], "resumed in place"
    info = httpx.get(f"{plain['url']}/server_info", timeout=10).json()["memory"]
    assert info["resume_total"] == 1 and info["resume_not_released_total"] == 0, info
    assert_generates(plain["url"])
    assert client.post("/servers/plain/frobnicate").status_code == 404

    metrics = agent.client(None).get("/metrics").text
    assert 'crossover_agent_operations_total{operation="release",outcome="ok"} 2.0' in metrics
    assert 'crossover_agent_operations_total{operation="resume",outcome="conflict"} 1.0' in metrics


def test_a_release_that_fails_is_answered_with_why(standin_profile, start_agent, state_dir):
    agent, _ = sleeping(standin_profile, start_agent, state_dir)
    pgid = recorded_groups(state_dir)["speculative"]
    os.killpg(pgid, signal.SIGKILL)
    wait_until(lambda: not group_members(pgid), timeout=10, what="the killed server to be gone")
    failed = agent.client().post("/servers/speculative/release")
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"]["code"] == "operation_failed" and "not running" in failed.json()["error"]["message"]
    assert 'operation="release",outcome="failed"} 1.0' in agent.client(None).get("/metrics").text
