"""Does the profile fit the box: GPUs that exist and are not shared by servers running at once, free ports,
and host memory for sleep's released weights. The probes are injected, or - for the CLI - a fake
`nvidia-smi` on PATH that answers the queries the real one would."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess

import pytest
import uvicorn

from crossover.servers.fit import check_fit, folder_weights_gb, gpu_processes, port_is_free
from crossover.servers.profile import load_profile, parse_profile
from tests.conftest import crossover_argv
from tests.servers.conftest import CLI_TIMEOUT_S, SHIPPED, run_cli
from tests.waiting import wait_until

FAKE_SMI = """#!/usr/bin/env bash
# Answers the nvidia-smi queries crossover makes, from $FAKE_GPUS and $FAKE_APPS ("pid,gpu,MiB;...").
case "$1" in
  --query-gpu=index) for i in $(seq 0 $((FAKE_GPUS - 1))); do echo "$i"; done ;;
  --query-gpu=index,uuid) for i in $(seq 0 $((FAKE_GPUS - 1))); do echo "$i, GPU-fake-$i"; done ;;
  --query-compute-apps=*)
    IFS=';' read -ra apps <<< "${FAKE_APPS:-}"
    for app in "${apps[@]}"; do IFS=',' read -r pid gpu mib <<< "$app"; echo "$pid, GPU-fake-$gpu, $mib"; done ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
"""


def always_free(host: str, port: int) -> bool:
    return True


def sleep_profile(**replace: str):
    text = (SHIPPED / "kimi-k25-time-shared.toml").read_text().replace('mechanism = "restart"', 'mechanism = "sleep"')
    for old, new in replace.items():
        text = text.replace(old, new)
    return parse_profile(text, name="k25-sleep", source="test")


def test_missing_gpus_are_named():
    report = check_fit(load_profile("llama8b-partitioned"), gpus=lambda: [0, 1, 2, 3], port_free=always_free)
    assert report.problems == ["server 'plain': GPU 4, 5, 6, 7 not present (nvidia-smi sees [0, 1, 2, 3])"]


def test_without_nvidia_smi_only_disjointness_is_checked_and_the_report_says_so():
    report = check_fit(load_profile("llama8b-partitioned"), gpus=lambda: None, port_free=always_free)
    assert report.fits
    assert any("no nvidia-smi" in note and "disjointness only" in note for note in report.notes)

    overlapping = (
        (SHIPPED / "llama8b-partitioned.toml").read_text().replace("gpus = [4, 5, 6, 7]", "gpus = [3, 4, 5, 6]")
    )
    report = check_fit(parse_profile(overlapping, name="x", source="x"), gpus=lambda: None, port_free=always_free)
    assert report.problems == ["GPU 3 is given to both 'speculative' and 'plain', which run at the same time"]


def test_time_shared_servers_share_their_gpus_by_design():
    report = check_fit(load_profile("kimi-k25-time-shared"), gpus=lambda: list(range(8)), port_free=always_free)
    assert report.fits, report.problems


def test_a_taken_port_is_refused():
    profile = load_profile("standin-partitioned")
    report = check_fit(profile, port_free=lambda host, port: port != profile.servers[1].port)
    assert report.problems == [f"server 'plain': port 127.0.0.1:{profile.servers[1].port} is in use"]


def test_sleep_needs_host_memory_for_the_released_weights():
    profile = sleep_profile()
    short = check_fit(profile, gpus=lambda: list(range(8)), available_gb=lambda: 500.0, port_free=always_free)
    (problem,) = short.problems
    # The larger configuration (610 GB, target + draft) sleeps while the plain one runs, plus 64 GB headroom.
    assert "sleep needs 674.0 GB" in problem and "only 500.0 GB is available - 174.0 GB short" in problem
    roomy = check_fit(profile, gpus=lambda: list(range(8)), available_gb=lambda: 1500.0, port_free=always_free)
    assert roomy.fits
    assert "server 'speculative': 610.0 GB of weights (weights_gb)" in roomy.notes


def test_weights_come_from_a_local_safetensors_index(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 40e9}}))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"\0" * 1000)
    assert folder_weights_gb(str(model)) == pytest.approx(40.0)
    assert folder_weights_gb(str(draft)) == pytest.approx(1e-6)
    assert folder_weights_gb(str(tmp_path / "absent")) is None

    profile = sleep_profile(
        **{
            'model_path = "moonshotai/Kimi-K2.5"': f'model_path = "{model}"',
            'draft_model_path = "lightseekorg/kimi-k2.5-eagle3"': f'draft_model_path = "{draft}"',
        }
    )
    report = check_fit(profile, gpus=lambda: list(range(8)), available_gb=lambda: 100.0, port_free=always_free)
    assert f"server 'plain': 40.0 GB of weights (safetensors in {model})" in report.notes
    assert report.problems == [report.problems[0]] and "sleep needs 104.0 GB" in report.problems[0]


def test_unknown_weight_size_is_refused_for_sleep():
    profile = sleep_profile(**{"weights_gb = 600 ": "# weights_gb = 600 "})
    report = check_fit(profile, gpus=lambda: list(range(8)), available_gb=lambda: 5000.0, port_free=always_free)
    assert any("server 'plain': weight size unknown" in p for p in report.problems)


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)

    def env(gpus: int, apps: str = "") -> dict[str, str]:
        return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GPUS": str(gpus), "FAKE_APPS": apps}

    return env


def run_servers(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        crossover_argv("servers", *args), capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env, check=False
    )


def test_plan_refuses_a_profile_the_box_cannot_hold(fake_nvidia_smi):
    result = run_servers("plan", "llama8b-partitioned", env=fake_nvidia_smi(4))
    assert result.returncode == 1
    assert "does not fit: server 'plain': GPU 4, 5, 6, 7 not present" in result.stderr
    assert "refusing llama8b-partitioned" in result.stderr
    enough = run_servers("plan", "llama8b-partitioned", env=fake_nvidia_smi(8))
    assert "not present" not in enough.stderr and "no nvidia-smi" not in enough.stderr


def test_down_reports_processes_still_holding_the_profiles_gpus(fake_nvidia_smi, tmp_path, monkeypatch):
    env = fake_nvidia_smi(8, "4242,2,81234;5151,7,100")
    result = run_servers("down", "llama8b-partitioned", "--state-dir", str(tmp_path / "state"), env=env)
    assert result.returncode == 1
    assert "GPU 2 still holds 81234 MiB for pid 4242" in result.stderr
    assert "GPU 7 still holds 100 MiB for pid 5151" in result.stderr
    clean = run_servers("down", "llama8b-partitioned", "--state-dir", str(tmp_path / "state"), env=fake_nvidia_smi(8))
    assert clean.returncode == 0, clean.stderr

    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("FAKE_GPUS", "8")
    monkeypatch.setenv("FAKE_APPS", "4242,2,81234;5151,7,100")
    assert [(p.pid, p.gpu) for p in gpu_processes([0, 1, 2, 3])] == [(4242, 2)]


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free_as_its_next_server_binds(serve):
    """`servers down` then `up`: the stopped server closed its connections first, so its port sits in
    TIME_WAIT for a minute. uvicorn (SGLang's server) binds with SO_REUSEADDR and gets it; so must the check."""

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b"ok"})

    server = serve(app)
    # The server closes first (Connection: close; the client reads to its EOF before closing): the TIME_WAIT
    # is on the server's side, at its listening port.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    assert b"200 OK" in answer
    server.server.should_exit = True
    wait_until(lambda: port_is_free("127.0.0.1", server.port), what="the stopped server's port to be free")
    # The state the old check tripped on: a bind without SO_REUSEADDR fails.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", server.port))
    assert port_is_free("127.0.0.1", server.port)
    config = uvicorn.Config(app, host="127.0.0.1", port=server.port)
    config.bind_socket().close()  # and the next server really binds there


def test_servers_up_straight_after_down_with_connections_that_were_open(standin_profile, state_dir):
    """A gateway holds keep-alive connections to its servers; `down` stops them, so each server closes those
    first and leaves its port in TIME_WAIT. `up` at once must not call the ports taken."""
    profile = standin_profile("standin-partitioned")
    assert run_cli("up", str(profile), "--state-dir", str(state_dir)).returncode == 0
    servers = load_profile(str(profile)).servers
    held = []
    for server in servers:  # what a gateway's pool holds: a request answered, its connection kept open
        sock = socket.create_connection((server.host, server.port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        held.append(sock)
    try:
        down = run_cli("down", str(profile), "--state-dir", str(state_dir))
        assert down.returncode == 0, down.stderr
        for sock in held:  # the server closed first (its shutdown); the client then closes its side
            while sock.recv(65536):
                pass
    finally:
        for sock in held:
            sock.close()
    again = run_cli("up", str(profile), "--state-dir", str(state_dir))
    assert again.returncode == 0 and "in use" not in again.stderr, again.stderr
    assert run_cli("down", str(profile), "--state-dir", str(state_dir)).returncode == 0


def test_a_missing_slots_file_names_the_remedy_the_profile_itself_gives():
    report = check_fit(load_profile("kimi-k25-in-engine"), gpus=lambda: None, port_free=always_free)
    (problem,) = [p for p in report.problems if "adaptive config" in p]
    shipped = "servers/profiles/kimi-k25-in-engine.slots.json"
    assert f"cp {shipped} /etc/crossover/kimi-k25-in-engine.slots.json" in problem, problem
    assert f"cp {shipped} /etc/crossover/" in (SHIPPED / "kimi-k25-in-engine.toml").read_text()
