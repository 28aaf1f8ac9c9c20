"""Real vLLM 0.32.0 on CPU: a speculative (EAGLE-3) and a plain server for the whole run.

- `real_vllm` (session): both servers of a tiny Llama made here (`tiny_model.py`, `--load-format dummy`), the
  speculative one with a random-weight EAGLE-3 draft that accepts at a set mean length (synthetic acceptance,
  `engine_env.py`), each pinned to its own core - two engines on two shared cores unpinned, one starves.
  Ready once `/health` answers and a 1-token generation did; stopped (whole process groups) at the end.
- `vllm_gateway`: the project's gateway (partitioned, real uvicorn in a thread) with one server per pool, both
  pools `engine = "vllm"` (load read from vLLM's /metrics gauges).

Every test here runs on one xdist worker (`tests/conftest.py` schedules them as one unit), so the servers start
once per run. The venv is `.venv-vllm` (tests/setup.sh builds it): without it these tests skip, and in CI
(CI=true) they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.modes import MODES
from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.sglang_check import venv_python
from tests.conftest import missing_environment
from tests.gateway.conftest import gateway  # noqa: F401  (the gateway's own fixture, in front of the engines)
from tests.real_vllm.engine_env import is_built
from tests.servers.conftest import VLLM_VENV

ROOT = Path(__file__).resolve().parents[2]
VENV = VLLM_VENV  # CROSSOVER_VLLM_VENV, else .venv-vllm (the parser checks of tests/servers/ use it too)
MODEL_NAME = "tiny-llama"
# A start takes 50-90 s on 2 idle cores; several minutes beside other work. Generous, never a sleep.
READY_TIMEOUT_S = 900
# Three drafts a step, accepted at a mean length of 2.75 tokens (the bonus token counted): vLLM's
# minimum-variance schedule then accepts position 0 always, position 1 3/4 of the time, position 2 never.
DRAFT_TOKENS = 3
ACCEPTANCE_LENGTH = 2.75
WAIT_S = 120.0
METRICS_POLL_S = 0.25
KV_CACHE_GB = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE): ~0.25 M tokens of the tiny model


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(item.path).parent == here:
            # The first test here also waits for both servers to start; the bench runs minutes of load.
            item.add_marker(pytest.mark.timeout(2 * READY_TIMEOUT_S))


@dataclass
class VLLMServer:
    mode: str
    url: str
    core: int
    proc: subprocess.Popen
    log: Path

    def metric(self, name: str) -> float:
        """A counter or gauge of vLLM's /metrics, summed over its samples (one engine: one sample)."""
        text = httpx.get(self.url + "/metrics", timeout=10, trust_env=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(f"{self.mode}: no {name} in /metrics")

    def wait_for(self, name: str, value: float, timeout: float = WAIT_S) -> None:
        """Poll a metric until it reads `value`. Gently: the API server shares its one core with the engine, and
        /metrics at the usual 50 Hz poll starves both."""
        deadline = time.monotonic() + timeout
        while (seen := self.metric(name)) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.mode}: {name} read {seen}, not {value}, for {timeout} s")
            time.sleep(METRICS_POLL_S)


@dataclass
class RealVLLM:
    servers: dict[str, VLLMServer]  # mode -> server
    model: str
    max_model_len: int


def vllm_venv() -> Path:
    if not is_built(VENV):
        missing_environment(f"no vLLM venv at {VENV}: run `python -m tests.real_vllm.engine_env build {VENV}`")
    return VENV


def cores() -> dict[str, int]:
    """One core each where there are two; both on the one core otherwise."""
    mine = sorted(os.sched_getaffinity(0))
    return {mode: mine[index % len(mine)] for index, mode in enumerate(MODES)}


def server_argv(venv: Path, model: Path, mode: str, port: int, core: int) -> list[str]:
    argv = ["taskset", "-c", str(core), str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model / "target"), "--served-model-name", MODEL_NAME, "--load-format", "dummy"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    if mode == "speculative":
        spec = {
            "method": "eagle3",
            "model": str(model / "draft"),
            "num_speculative_tokens": DRAFT_TOKENS,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": ACCEPTANCE_LENGTH,
        }
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


def server_env(venv: Path, core: int) -> dict[str, str]:
    return {
        **os.environ,
        # vLLM's CPU backend wants Intel's OpenMP loaded first (it warns, and runs slower, otherwise).
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory):
    venv = vllm_venv()
    base = tmp_path_factory.mktemp("real-vllm")
    model = base / "model"
    made = subprocess.run(
        [str(venv_python(venv)), "-m", "tests.real_vllm.tiny_model", str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    servers: dict[str, VLLMServer] = {}
    try:
        for mode, core in cores().items():
            port, log = free_port(), base / f"{mode}.log"
            with log.open("wb") as out:
                proc = spawn(
                    server_argv(venv, model, mode, port, core),
                    env=server_env(venv, core),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    die_with_parent=False,
                )
            servers[mode] = VLLMServer(mode, f"http://127.0.0.1:{port}", core, proc, log)
        for server in servers.values():  # both start at once: each on its own core
            ready(server)
        card = httpx.get(servers["plain"].url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]
        yield RealVLLM(servers=servers, model=MODEL_NAME, max_model_len=card["max_model_len"])
    finally:
        stop([server.proc for server in servers.values()])


def ready(server: VLLMServer) -> None:
    try:
        wait_ready(server.url + "/health", server.proc, READY_TIMEOUT_S)
        one_token = {"model": MODEL_NAME, "prompt": "Say OK.", "max_tokens": 1}
        wait_ready(server.url + "/v1/completions", server.proc, READY_TIMEOUT_S, json=one_token)
    except Exception as error:
        raise AssertionError(f"{server.mode}: {error}\n{server.log.read_text(errors='replace')[-4000:]}") from None


@pytest.fixture
def vllm_gateway(gateway, real_vllm):  # noqa: F811  (the fixture imported above)
    """The gateway, partitioned: the speculative server in one pool, the plain in the other."""

    def start(**settings):
        # A probe waits for an engine busy on its one core (the bench's C=64): not a failure worth ejecting.
        settings.setdefault("health", {"interval": 0.5, "timeout": 30.0})
        servers = real_vllm.servers
        pools = {mode: {"backends": [servers[mode].url], "engine": "vllm"} for mode in MODES}
        return gateway([], [], pools=pools, **settings)

    return start
