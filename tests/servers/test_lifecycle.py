"""`crossover servers up / status / down` with the stand-in profiles, run as an operator would (the CLI in
a subprocess): every server ready by a real generation, then no process left in any of their groups - also
when a server ignores SIGTERM, and when the supervisor that started them was SIGKILLed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from crossover.servers.process import spawn
from crossover.servers.profile import load_profile
from crossover.servers.state import group_members
from crossover.servers.supervisor import Supervisor, SupervisorError
from tests.conftest import crossover_argv
from tests.servers.conftest import recorded_groups, run_cli
from tests.waiting import wait_until

READY_WAIT_S = 60.0


def statuses(profile, state_dir) -> dict[str, dict]:
    result = run_cli("status", str(profile), "--state-dir", str(state_dir), "--json")
    assert result.returncode == 0, result.stderr
    return {s["name"]: s for s in json.loads(result.stdout)}


def generate(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/completions", json={"model": "moonshotai/Kimi-K2.5", "prompt": "hi", "max_tokens": 1}, timeout=10
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def assert_down(profile, state_dir, groups: dict[str, int]) -> str:
    result = run_cli("down", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    for name, pgid in groups.items():
        assert group_members(pgid) == [], f"{name}: processes of group {pgid} survived down"
    assert recorded_groups(state_dir) == {}
    assert all(s["state"] == "stopped" for s in statuses(profile, state_dir).values())
    return result.stderr


def test_partitioned_up_status_down(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned")
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    assert "answered a 1-token generation" in result.stderr

    status = statuses(profile, state_dir)
    assert {name: s["state"] for name, s in status.items()} == {"speculative": "ready", "plain": "ready"}
    assert {s["role"] for s in status.values()} == {"speculative", "plain"}
    for s in status.values():
        assert s["pid"] and s["last_start_s"] > 0
        generate(s["url"])
    assert (state_dir / "logs" / "speculative.log").exists()

    groups = recorded_groups(state_dir)
    assert len(set(groups.values())) == 2, "each server leads its own process group"
    again = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert again.returncode == 0, again.stderr
    assert recorded_groups(state_dir) == groups, "a second up adopts the running servers, never duplicates them"

    assert "no process of its group is left" in assert_down(profile, state_dir, groups)


@pytest.mark.parametrize("mechanism", ["restart", "sleep"])
def test_time_shared_up_starts_the_initial_mode(standin_profile, state_dir, mechanism):
    profile = standin_profile("standin-time-shared", mechanism=mechanism)
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr

    status = statuses(profile, state_dir)
    assert status["speculative"]["state"] == "ready"
    generate(status["speculative"]["url"])
    if mechanism == "restart":
        assert status["plain"]["state"] == "stopped"
    else:
        # Both started; the second one holds no GPU memory and refuses to generate until resumed.
        assert status["plain"]["state"] == "released"
        refused = httpx.post(
            f"{status['plain']['url']}/v1/completions",
            json={"model": "moonshotai/Kimi-K2.5", "prompt": "hi", "max_tokens": 1},
        )
        assert refused.status_code == 503
    assert_down(profile, state_dir, recorded_groups(state_dir))


def test_down_kills_a_server_that_ignores_sigterm(standin_profile, state_dir):
    # The launcher ignores SIGTERM and leaves a child that ignores it too, as SGLang's surviving workers do.
    launcher = ["bash", "-c", "trap '' TERM; \"$@\"; exec sleep 600", "ignore-term"]
    profile = standin_profile("standin-partitioned", launcher=launcher, stop_timeout_s=1.0)
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    groups = recorded_groups(state_dir)

    stderr = assert_down(profile, state_dir, groups)
    assert "SIGKILL after the SIGTERM deadline" in stderr


@contextlib.contextmanager
def foreground_supervisor(profile, state_dir) -> Iterator[subprocess.Popen]:
    """`crossover servers up --foreground`, yielded once both servers are ready; killed on the way out."""
    supervisor = spawn(
        crossover_argv("servers", "up", str(profile), "--state-dir", str(state_dir), "--foreground"),
        die_with_parent=False,
    )
    try:
        wait_until(
            lambda: (
                supervisor.poll() is None and all(s["state"] == "ready" for s in statuses(profile, state_dir).values())
            ),
            timeout=READY_WAIT_S,
            what="both stand-ins ready under a foreground supervisor",
        )
        yield supervisor
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait(10)


def test_down_after_the_supervisor_was_sigkilled(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned")
    with foreground_supervisor(profile, state_dir) as supervisor:
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait(10)
        groups = recorded_groups(state_dir)
        assert all(group_members(pgid) for pgid in groups.values()), "the servers outlive a killed supervisor"
        assert_down(profile, state_dir, groups)


def test_foreground_stops_the_servers_on_sigint(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned")
    with foreground_supervisor(profile, state_dir) as supervisor:
        groups = recorded_groups(state_dir)
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(30) == 0
        assert not any(group_members(pgid) for pgid in groups.values())


def test_up_refuses_a_profile_whose_port_is_taken(standin_profile, state_dir):
    import socket

    profile = standin_profile("standin-partitioned")
    with socket.socket() as sock:
        port = load_profile(profile).servers[0].port
        sock.bind(("127.0.0.1", port))
        result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 1
    assert f"port 127.0.0.1:{port} is in use" in result.stderr
    assert recorded_groups(state_dir) == {}, "nothing starts when the profile does not fit"


def test_a_server_that_exits_fails_up_and_leaves_nothing(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned", launcher=["false"])
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 1
    assert "exited before it was ready" in result.stderr
    assert recorded_groups(state_dir) == {}


def test_time_shared_restart_up_refuses_while_the_other_mode_runs(standin_profile, state_dir):
    profile = standin_profile("standin-time-shared")
    text = profile.read_text()
    profile.write_text(text.replace('initial = "speculative"', 'initial = "plain"'))
    assert run_cli("up", str(profile), "--state-dir", str(state_dir)).returncode == 0
    plain_group = recorded_groups(state_dir)["plain"]

    profile.write_text(text)
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 1
    assert "plain is running on the GPU set" in result.stderr
    assert statuses(profile, state_dir)["plain"]["state"] == "ready", "a refused up leaves the running mode alone"
    assert statuses(profile, state_dir)["speculative"]["state"] == "stopped"
    assert_down(profile, state_dir, {"plain": plain_group})


# Answers /health with 200 but fails every generation: `up` must not take it for ready.
HEALTHY_BUT_BROKEN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"object": "list", "data": [{"id": "moonshotai/Kimi-K2.5"}]}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.send_response(500)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_ready_means_a_generation_not_a_health_check(standin_profile, state_dir):
    profile = standin_profile(
        "standin-partitioned", launcher=[sys.executable, "-c", HEALTHY_BUT_BROKEN], ready_timeout_s=5.0
    )
    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 1
    assert "no 1-token generation within 5 s (last: a 1-token generation on" in result.stderr
    assert "got HTTP 500" in result.stderr
    assert recorded_groups(state_dir) == {}, "a server that never generated is stopped again"


def test_a_crashed_server_shows_as_failed_and_down_cleans_up(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned")
    assert run_cli("up", str(profile), "--state-dir", str(state_dir)).returncode == 0
    groups = recorded_groups(state_dir)
    os.killpg(groups["plain"], signal.SIGKILL)
    wait_until(lambda: not group_members(groups["plain"]), what="the plain server to die")

    status = statuses(profile, state_dir)
    assert status["plain"]["state"] == "failed" and "plain.log" in status["plain"]["error"]
    assert status["speculative"]["state"] == "ready"
    stderr = assert_down(profile, state_dir, groups)
    assert "plain: not running" in stderr


def test_a_foreground_supervisor_ends_when_down_runs_elsewhere(standin_profile, state_dir):
    profile = standin_profile("standin-partitioned")
    with foreground_supervisor(profile, state_dir) as supervisor:
        assert_down(profile, state_dir, recorded_groups(state_dir))
        assert supervisor.wait(30) == 0


def test_sleep_release_and_resume_send_the_servers_admin_key(standin_profile, state_dir, tmp_path):
    # SGLang's release/resume take only the admin key once a server has one; so does the stand-in.
    key_file = tmp_path / "admin.key"
    key_file.write_text("k-admin\n")
    profile = standin_profile("standin-time-shared", mechanism="sleep")
    text = profile.read_text()
    text = re.sub(r"^(port = \d+.*)$", rf"\1\nadmin_api_key_file = {json.dumps(str(key_file))}", text, flags=re.M)
    profile.write_text(text)
    servers = {s.name: s for s in load_profile(profile).servers}
    assert all(s.admin_api_key_file == str(key_file) for s in servers.values())

    result = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    try:
        assert statuses(profile, state_dir)["plain"]["state"] == "released"  # its release carried the key
        plain = servers["plain"].url
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            for path in ("/resume_memory_occupation", "/release_memory_occupation", "/pause_generation"):
                refused = httpx.post(plain + path, json={}, headers=headers, timeout=10)
                assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}, path
        # The key is read at call time: the supervisor resumes with the file's current key.
        supervisor = Supervisor(load_profile(profile), state_dir)
        key_file.write_text("k-rotated\n")
        with pytest.raises(SupervisorError, match="401"):
            asyncio.run(supervisor.resume("plain"))
        key_file.write_text("k-admin\n")
        asyncio.run(supervisor.resume("plain"))
        generate(plain)
    finally:
        assert_down(profile, state_dir, recorded_groups(state_dir))
