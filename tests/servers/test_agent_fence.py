"""The agent's fencing token (servers/agent_fence.py behind servers/agent.py): a lower token than its GPU set
accepted is refused with 409 `fenced` and nothing moves; an equal or higher one, or none, is accepted; refusals are
counted; the tokens survive an agent restart; servers that share GPUs share a fence, others do not."""

from __future__ import annotations

import os
import signal

import pytest

from crossover.gateway.engines.fence import FENCE_HEADER, FENCED, fence_headers, is_fenced
from crossover.servers.agent_fence import FENCE_FILE, AgentFences
from crossover.servers.profile import load_profile
from tests.servers.conftest import recorded_groups


def test_a_lower_token_is_refused_an_equal_or_higher_one_raises_the_fence_and_it_is_kept(standin_profile, tmp_path):
    profile = load_profile(standin_profile("standin-time-shared"))  # both servers on GPUs 0-7
    fences = AgentFences(profile, tmp_path)
    assert fences.admit("speculative", None) is None and fences.current("speculative") is None
    assert fences.admit("speculative", 5) is None
    assert fences.current("plain") == 5, "servers that share GPUs share a fence"
    refused = fences.admit("plain", 4)
    assert refused is not None and "token 4" in refused and "token 5" in refused
    assert fences.admit("plain", 5) is None and fences.admit("plain", None) is None
    assert fences.admit("speculative", 9) is None
    assert AgentFences(profile, tmp_path).admit("plain", 8) is not None, "a new agent remembers the tokens"

    (tmp_path / FENCE_FILE).write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable fencing tokens"):
        AgentFences(profile, tmp_path)


def test_servers_on_disjoint_gpus_have_their_own_fence(standin_profile, tmp_path):
    fences = AgentFences(load_profile(standin_profile("standin-partitioned")), tmp_path)
    first, second = (server.name for server in fences.profile.servers)
    assert fences.admit(first, 7) is None
    assert fences.admit(second, 1) is None and fences.current(first) == 7


def test_a_stale_token_moves_nothing_on_the_agent_is_counted_and_survives_a_restart(
    standin_profile, start_agent, state_dir
):
    profile = standin_profile("standin-time-shared")
    agent = start_agent(profile)
    client = agent.client()
    assert client.post("/servers/speculative/start", headers=fence_headers(5)).status_code == 202
    ready = agent.wait_state("speculative", "ready", "failed")
    assert ready["state"] == "ready", ready
    groups = recorded_groups(state_dir)

    # The leader with token 5 acted; a paused ex-leader (token 4) wakes up and carries on where it was.
    for path in ("/servers/speculative/stop", "/servers/plain/start", "/servers/speculative/release"):
        refused = client.post(path, headers=fence_headers(4))
        assert refused.status_code == 409, (path, refused.text)
        assert is_fenced(409, refused.json()) and refused.json()["error"]["code"] == FENCED
        assert "token 4" in refused.json()["error"]["message"] and "token 5" in refused.json()["error"]["message"]
    assert client.get("/servers/speculative").json() == ready, "nothing moved"
    assert client.get("/servers/plain").json()["state"] == "stopped"
    assert recorded_groups(state_dir) == groups

    bad = client.post("/servers/speculative/stop", headers={FENCE_HEADER: "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_fence"

    metrics = agent.client(None).get("/metrics").text
    for operation, count in (("stop", 1), ("start", 1), ("release", 1), ("resume", 0)):
        assert f'crossover_agent_fenced_total{{operation="{operation}"}} {count}.0' in metrics
    assert 'crossover_agent_fence_token{server="plain"} 5.0' in metrics

    os.kill(agent.proc.pid, signal.SIGKILL)  # a new agent must not forget token 5
    agent.proc.wait(10)
    agent = start_agent(profile)
    client = agent.client()
    assert client.post("/servers/speculative/stop", headers=fence_headers(4)).status_code == 409
    assert client.get("/servers/speculative").json()["state"] == "ready"

    # The holder of token 5 (equal) and a gateway without a cluster (no header) are accepted.
    assert client.post("/servers/speculative/stop", headers=fence_headers(5)).status_code == 202
    assert agent.wait_state("speculative", "stopped", "failed")["state"] == "stopped"
    assert client.post("/servers/plain/start").status_code == 202
    assert agent.wait_state("plain", "ready", "failed")["state"] == "ready"


def test_a_lease_holders_status_read_raises_the_fence_and_a_stale_one_is_refused(standin_profile, start_agent):
    # A new leader that only adopts what serves moves nothing: its status read alone must shut the old one out.
    agent = start_agent(standin_profile("standin-time-shared"))
    client = agent.client()
    assert client.get("/servers/plain", headers=fence_headers(7)).status_code == 200
    for method, path in (("POST", "/servers/plain/start"), ("GET", "/servers/speculative")):
        refused = client.request(method, path, headers=fence_headers(6))
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, FENCED), (path, refused.text)
    assert client.get("/servers/plain").status_code == 200, "a read without a token is a gateway without a cluster"
    assert client.get("/servers/plain", headers={FENCE_HEADER: "x"}).status_code == 400
    assert client.get("/servers/plain").json()["state"] == "stopped", "nothing moved"
    assert 'crossover_agent_fenced_total{operation="status"} 1.0' in client.get("/metrics").text
