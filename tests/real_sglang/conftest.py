"""Real SGLang 0.5.23 on CPU: one server for the whole run, started and stopped by `crossover servers up/down`.

- `real_sglang` (session): a time-shared test profile of two plain configurations of a tiny Llama made here
  (`tiny_model.py`); `up` starts its initial mode and returns once it answered a 1-token generation.
- `real_gateway`: the project's gateway (real uvicorn, in a thread) in front of the running mode.

Every test here runs on one xdist worker (`tests/conftest.py` schedules them as one unit), in the order of
MODULE_ORDER (the restart switch last: it changes the server and ends with `down`). The server's
venv is `.venv-sglang-serve` (`engine_env.py`, built by .ci/run): without it these tests skip, and in CI
(CI=true) they fail - a contract that silently did not run proves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from crossover.servers.process import free_port
from crossover.servers.sglang_check import venv_python
from crossover.servers.state import group_members
from tests.conftest import crossover_argv, missing_environment
from tests.gateway.conftest import gateway  # noqa: F401  (the gateway's own fixture, in front of the engine)
from tests.host_speed import CEILING_S, StartupBudget
from tests.real_sglang.engine_env import STANDINS, is_built

ROOT = Path(__file__).resolve().parents[2]
SERVE_VENV = Path(os.environ.get("CROSSOVER_SGLANG_SERVE_VENV", ROOT / ".venv-sglang-serve"))
MODULE_ORDER = (
    "test_contract",
    "test_engine_signals",
    "test_standin_agreement",
    "test_import_standins",
    "test_patch_live",  # a second server (the patched copy): before the restart test ends the session's
    "test_restart",
)
MODEL_NAME = "tiny-llama"
# A start takes ~1 min on the idle reference host, 15 min at load 17-58: the wait is 3x the idle start scaled by
# the machine's speed measured before it (tests/host_speed.py), never a constant and never a sleep.
IDLE_START_S = 180.0
# `crossover servers up` beyond the server's own readiness wait (the agent's start, the state file).
UP_OVERHEAD_S = 60.0
# Two plain configurations (speculation cannot run on CPU here: EAGLE needs the CPU kernel build): a small
# and a larger running cap, so a switch is visible in /v1/loads. KV pools of a few MB: SGLang on CPU
# otherwise sizes its pool from host memory (15 GB of a 24 GB box).
CONFIGS = {
    "speculative": {"max_running_requests": 8, "max_total_tokens": 160_000},
    "plain": {"max_running_requests": 16, "max_total_tokens": 320_000},
}

SERVER = """
[[servers]]
name = "{name}"
role = "{name}"
engine = "sglang"
device = "cpu"
model_path = "{model}"
served_model_name = "{served}"
host = "127.0.0.1"
port = {port}
max_running_requests = {max_running_requests}
ready_timeout_s = {ready_timeout_s}
stop_timeout_s = 30
# SGLang's own warm-up is a generation the supervisor's readiness check makes anyway. float32 (the model's
# dtype; SGLang's CPU default is half): greedy tokens that do not depend on the batch they ran in.
extra_args = ["--max-total-tokens", "{max_total_tokens:d}", "--skip-server-warmup", "--dtype", "float32"]
env = {env}
"""


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    mine = [item for item in items if Path(item.path).parent == here]
    for item in mine:
        # A backstop only (each wait has its own measured budget): the first test here also waits for the
        # session's `up`, the restart test for two starts.
        item.add_marker(pytest.mark.timeout(2 * (CEILING_S + UP_OVERHEAD_S)))
    rank = {name: index for index, name in enumerate(MODULE_ORDER)}
    ordered = sorted(mine, key=lambda item: rank.get(Path(item.path).stem, len(rank)))
    slots = [index for index, item in enumerate(items) if Path(item.path).parent == here]
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


@dataclass
class RealSGLang:
    profile: Path
    state_dir: Path
    urls: dict[str, str]  # mode -> URL
    model: str
    model_path: Path  # the tiny model's directory, for a test that starts another server of it
    standin_log: Path
    budget: StartupBudget  # how long a start may take here (measured when the profile was written)
    up_s: float = 0.0  # how long `crossover servers up` took

    def log(self, mode: str) -> str:
        return (self.state_dir / "logs" / f"{mode}.log").read_text(errors="replace")

    def pgids(self) -> dict[str, int]:
        path = self.state_dir / "state.json"
        servers = json.loads(path.read_text())["servers"] if path.exists() else {}
        return {name: record["pgid"] for name, record in servers.items()}

    def run(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        """`crossover servers ARGS` on this profile, given a start's budget (and `up`'s overhead) unless told."""
        timeout = self.budget.seconds + UP_OVERHEAD_S if timeout is None else timeout
        return subprocess.run(
            crossover_argv("servers", *args, str(self.profile), "--state-dir", str(self.state_dir)),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def serve_venv() -> Path:
    if not is_built(SERVE_VENV):
        message = (
            f"no real-SGLang venv at {SERVE_VENV}: run `python -m tests.real_sglang.engine_env build {SERVE_VENV}`"
        )
        missing_environment(message)
    return SERVE_VENV


def alive(pid: int) -> bool:
    """Running, not a zombie (an exited child its parent has not reaped yet still has a /proc entry)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def engine_processes_after_down(marker: str, timeout: float = 30.0) -> list[str]:
    """What still carries `marker` once `down` returned, given `timeout` s to finish exiting: a helper outside
    the server's process group (Python's multiprocessing resource tracker, say) exits when its pipe closes, a
    moment after the server; a leak stays. Each survivor as "pid comm", so a failure says what it was."""
    deadline = time.monotonic() + timeout
    while (found := engine_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [f"{pid} {_comm(pid)}" for pid in found]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def engine_processes(marker: str) -> list[int]:
    """Every live process whose environment carries `marker` - the server's own and any child, whatever
    process group it ended up in."""
    found = []
    needle = marker.encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if needle in environ and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def profile_text(
    venv: Path,
    model: Path,
    ports: dict[str, int],
    standin_log: Path,
    ready_timeout_s: float,
    first_on_path: Path | None = None,
) -> str:
    """`first_on_path`: a directory holding an `sglang/` the server imports instead of the venv's (a patched copy)."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(str(p) for p in (first_on_path, STANDINS) if p is not None),
        "CROSSOVER_STANDIN_LOG": str(standin_log),
        # SGLang binds one OpenMP thread per core; on cores shared with other work their barriers spin, and a
        # decode step of the tiny model took 17x longer (11.3 s instead of 0.65 s for 200 tokens, measured).
        "OMP_NUM_THREADS": "1",
    }
    env_toml = "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items()) + " }"
    text = (
        'description = "test: real SGLang 0.5.23 on CPU, a tiny local Llama, two plain configurations in turn"\n'
        'sglang_version = "0.5.23"\ntopology = "time-shared"\nhost_memory_headroom_gb = 0\n'
        f'sglang_command = [{json.dumps(str(venv / "bin" / "sglang"))}, "serve"]\n\n'
        '[time_shared]\nmechanism = "restart"\ninitial = "speculative"\n'
    )
    for name, config in CONFIGS.items():
        text += SERVER.format(
            name=name,
            model=model,
            served=MODEL_NAME,
            port=ports[name],
            ready_timeout_s=f"{ready_timeout_s:.0f}",
            env=env_toml,
            **config,
        )
    return text


@pytest.fixture(scope="session")
def real_sglang(tmp_path_factory):
    venv = serve_venv()
    base = tmp_path_factory.mktemp("real-sglang")
    model = base / "tiny-llama"
    made = subprocess.run(
        [str(venv_python(venv)), str(Path(__file__).with_name("tiny_model.py")), str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    ports = {name: free_port() for name in CONFIGS}
    standin_log = base / "standins.log"
    profile = base / "real-sglang.toml"
    budget = StartupBudget.measure(IDLE_START_S, "the real SGLang server")
    profile.write_text(profile_text(venv, model, ports, standin_log, budget.seconds))
    server = RealSGLang(
        profile=profile,
        state_dir=base / "state",
        urls={name: f"http://127.0.0.1:{port}" for name, port in ports.items()},
        model=MODEL_NAME,
        model_path=model,
        standin_log=standin_log,
        budget=budget,
    )
    with running(server, "real SGLang"):
        yield server


@contextlib.contextmanager
def running(server: RealSGLang, what: str):
    """`up` (asserted), then `down` whatever happened; SIGKILL what `down` left, so no engine outlives a test."""
    began = time.monotonic()
    try:
        try:
            up = server.run("up")
        except subprocess.TimeoutExpired:
            raise AssertionError(server.budget.gave_up()) from None
        server.up_s = time.monotonic() - began
        print(f"\n{what}: `crossover servers up` took {server.up_s:.1f} s (speed {server.budget.speed:.2f})")
        assert up.returncode == 0, f"{up.stderr[-3000:]}\n({server.budget.gave_up()}?)"
        yield server
    finally:
        server.run("down", timeout=120)
        for pgid in server.pgids().values():  # only if `down` failed: never leave an engine behind
            for pid in group_members(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def active_url(real_sglang) -> str:
    """The URL of the mode that serves now."""
    for url in real_sglang.urls.values():
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200:
                return url
    raise AssertionError("no mode of the real SGLang profile answers /health")


@pytest.fixture
def real_gateway(gateway, real_sglang, active_url):  # noqa: F811  (the fixture imported above)
    """The gateway with the running real server in both pools (allowed: one server, each pool counts its own)."""

    def start(**settings):
        return gateway([active_url], [active_url], **settings)

    return start
