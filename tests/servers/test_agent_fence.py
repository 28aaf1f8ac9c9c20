"""The agent's fencing token (servers/agent_fence.py behind servers/agent.py): a lower token than its GPU set
accepted is refused with 409 `fenced` and nothing moves; an equal or higher one, or none, is accepted; refusals are
counted; the tokens survive an agent restart; servers that share GPUs share a fence, others do not. A token far above
the highest is refused with 403 `fence_jump` (logged, the fence kept) unless the agent allows the jump; an operator
lowers or clears a running agent's fence with `crossover servers fence`, and a lower token then passes."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from crossover.gateway.engines.fence import (
    FENCE_HEADER,
    FENCE_JUMP,
    FENCED,
    MAX_FENCE_JUMP,
    fence_headers,
    is_fenced,
)
from crossover.servers.agent_fence import FENCE_FILE, AgentFences, read_fences
from crossover.servers.profile import load_profile
from tests.servers.conftest import recorded_groups, run_cli


def test_a_lower_token_is_refused_an_equal_or_higher_one_raises_the_fence_and_it_is_kept(standin_profile, tmp_path):
    profile = load_profile(standin_profile("standin-time-shared"))  # both servers on GPUs 0-7
    fences = AgentFences(profile, tmp_path)
    assert fences.admit("speculative", None) is None and fences.current("speculative") is None
    assert fences.admit("speculative", 5) is None
    assert fences.current("plain") == 5, "servers that share GPUs share a fence"
    refused = fences.admit("plain", 4)
    assert refused is not None and (refused.status, refused.code) == (409, FENCED)
    assert "token 4" in refused.message and "token 5" in refused.message
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


def test_a_jump_far_above_the_highest_is_refused_and_kept_off_disk_a_first_token_may_be_anything(
    standin_profile, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="crossover.servers.agent_fence")
    profile = load_profile(standin_profile("standin-partitioned"))
    first, second = (server.name for server in profile.servers)
    fences = AgentFences(profile, tmp_path)
    assert fences.admit(first, 40) is None
    assert fences.admit(second, 10**17) is None, "a GPU set with no token yet takes any"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"fence of {first!r} (gpu:0, gpu:1, gpu:2, gpu:3) raised from None to 40",
        f"fence of {second!r} (gpu:4, gpu:5, gpu:6, gpu:7) raised from None to {10**17}",
    ]

    refused = fences.admit(first, 40 + MAX_FENCE_JUMP + 1)
    assert refused is not None and (refused.status, refused.code) == (403, FENCE_JUMP)
    assert str(40 + MAX_FENCE_JUMP + 1) in refused.message and "40" in refused.message
    assert fences.current(first) == 40 and read_fences(tmp_path)["gpu:3"] == 40, "the fence is unchanged"
    assert fences.admit(first, 40 + MAX_FENCE_JUMP) is None, "a jump of exactly the limit passes"

    assert AgentFences(profile, tmp_path, max_jump=0).admit(first, 10**18 - 1) is None, "0: no limit"
    assert AgentFences(profile, tmp_path, max_jump=5).admit(first, 10**18 - 1 + 6) is not None


def metric(agent, line_start: str) -> str:
    lines = [line for line in agent.client(None).get("/metrics").text.splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, lines
    return lines[0].rsplit(" ", 1)[1]


def test_a_jump_is_refused_with_403_logged_and_the_fence_kept_unless_the_agent_allows_it(
    standin_profile, start_agent, tmp_path
):
    profile = standin_profile("standin-time-shared")
    log = tmp_path / "agent.log"
    agent = start_agent(profile, "--log-level", "info", log=log)
    client = agent.client()
    assert client.get("/servers/plain", headers=fence_headers(5)).status_code == 200
    far = 5 + MAX_FENCE_JUMP + 1
    for method, path in (("POST", "/servers/plain/start"), ("GET", "/servers/speculative")):
        refused = client.request(method, path, headers=fence_headers(far))
        assert refused.status_code == 403, (path, refused.text)
        body = refused.json()
        assert body["error"]["code"] == FENCE_JUMP and not is_fenced(refused.status_code, body)
        assert str(far) in body["error"]["message"]
    assert client.get("/servers/plain").json()["state"] == "stopped", "nothing moved"
    assert metric(agent, 'crossover_agent_fence_token{server="plain"}') == "5.0", "the fence is unchanged"
    assert metric(agent, 'crossover_agent_fence_jumps_refused_total{operation="start"}') == "1.0"
    assert metric(agent, 'crossover_agent_fenced_total{operation="start"}') == "0.0"
    assert client.get("/servers/plain", headers=fence_headers(6)).status_code == 200
    logged = log.read_text()
    assert "INFO crossover.servers.agent_fence: fence of 'plain'" in logged and "raised from None to 5" in logged
    assert f"WARNING crossover.servers.agent: refused start of 'plain': fence_jump: this call carries token {far}" in (
        logged
    )

    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(30)
    agent = start_agent(profile, "--fence-max-jump", str(2 * MAX_FENCE_JUMP))
    assert agent.client().get("/servers/plain", headers=fence_headers(far)).status_code == 200
    assert metric(agent, 'crossover_agent_fence_token{server="plain"}') == f"{float(far)}"


def test_an_operator_lowers_a_running_agents_fence_and_a_lower_token_then_passes(
    standin_profile, start_agent, state_dir, tmp_path
):
    profile = standin_profile("standin-time-shared")  # both servers on GPUs 0-7
    log = tmp_path / "agent.log"
    agent = start_agent(profile, log=log)
    client = agent.client()
    assert client.get("/servers/plain", headers=fence_headers(40)).status_code == 200
    assert client.get("/servers/plain", headers=fence_headers(3)).status_code == 409  # the locked-out cluster

    shown = run_cli("fence", str(profile), "--state-dir", str(state_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    assert {row["key"]: row["highest"] for row in rows} == {f"gpu:{gpu}": 40 for gpu in range(8)}
    assert rows[0]["servers"] == ["speculative", "plain"]

    lowered = run_cli("fence", str(profile), "--state-dir", str(state_dir), "--set", "plain=2")
    assert lowered.returncode == 0, lowered.stderr
    assert "gpu:0: 40 -> 2" in lowered.stderr and "gpu:0" in lowered.stdout
    assert metric(agent, 'crossover_agent_fence_token{server="plain"}') == "2.0", "the agent took it"
    assert client.post("/servers/plain/start", headers=fence_headers(3)).status_code == 202
    assert agent.wait_state("plain", "ready", "failed")["state"] == "ready"
    assert "fence of gpu:0 changed on disk" in log.read_text()

    cleared = run_cli("fence", str(profile), "--state-dir", str(state_dir), "--clear", "speculative")
    assert cleared.returncode == 0, cleared.stderr
    assert read_fences(state_dir) == {}
    assert 'crossover_agent_fence_token{server="plain"}' not in agent.client(None).get("/metrics").text
    assert client.post("/servers/plain/stop", headers=fence_headers(1)).status_code == 202
    assert agent.wait_state("plain", "stopped", "failed")["state"] == "stopped"
    assert read_fences(state_dir) == {f"gpu:{gpu}": 1 for gpu in range(8)}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "plain=50"), "gpu:0 is at 40: 50 would raise it"),
        (("--set", "gpu:0=x"), "N must be a non-negative integer"),
        (("--set", "gpu:0"), "give KEY=N"),
        (("--set", "gpu:99=1"), "'gpu:99' is neither a server of"),
        (("--clear", "nosuch"), "'nosuch' is neither a server of"),
        (("--set", "gpu:0=3", "--clear", "plain"), "gpu:0 is given two different values"),
        (("--set", "gpu:1=3", "--set", "gpu:0=-1"), "N must be a non-negative integer"),
    ],
)
def test_the_fence_command_refuses_bad_input_and_changes_nothing(standin_profile, tmp_path, args, message):
    profile = standin_profile("standin-time-shared")
    AgentFences(load_profile(profile), tmp_path).admit("plain", 40)
    before = (tmp_path / FENCE_FILE).read_bytes()
    result = run_cli("fence", str(profile), "--state-dir", str(tmp_path), *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (tmp_path / FENCE_FILE).read_bytes() == before


def test_the_fence_command_refuses_to_lower_what_has_no_token(standin_profile, tmp_path):
    result = run_cli("fence", standin_profile("standin-time-shared"), "--state-dir", str(tmp_path), "--set", "gpu:0=1")
    assert result.returncode == 2 and "gpu:0 has no token" in result.stderr, result.stderr
    assert not (tmp_path / FENCE_FILE).exists()
