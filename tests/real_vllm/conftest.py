"""Real vLLM 0.32.0 on CPU: a speculative (EAGLE-3) and a plain server for the whole run, sized to this host.

- `real_vllm` (session): both servers of a tiny Llama made here (`tiny_model.py`, `--load-format dummy`), the
  speculative one with a random-weight EAGLE-3 draft that accepts at a set mean length (synthetic acceptance,
  `engine_env.py`), each pinned to a core of its own that no other run on the host holds (`tests/host_cores.py`)
  - two engines on two shared cores unpinned, one starves. The start-up wait scales with the machine's measured
  speed (`tests/host_speed.py`). Ready once `/health` answers and a 1-token generation did; then a decode step of
  each is measured at one stream (`RealVLLM.token_s`), and every later wait is a bound derived from it
  (`RealVLLM.bound`), never a constant. Stopped (whole process groups) at the end.
- `vllm_gateway`: the project's gateway (partitioned, real uvicorn in a thread) with one server per pool, both
  pools `engine = "vllm"` (load read from vLLM's /metrics gauges).
- `gated_vllm` (session, started on first use): a third server, patches/vllm-0.32.0 applied to an overlay of the
  installed package (the venv is never modified), launched as servers/ launches the gated in-engine profile, its
  synthetic acceptance LOW_ACCEPTANCE: the gate's tests use it, and the adaptive test as its second acceptance
  beside the session's speculative server - one start for both. Pinned to the plain server's core.

Both servers run with `--max-num-queued-reqs` (BUSY_CAP), as the shipped vLLM profiles do: past it vLLM answers
503 busy. Every test here runs on one xdist worker (`tests/conftest.py` schedules them as one unit), so the servers
start once per run; LAST_TESTS run after all others (one kills an engine). The venv is `.venv-vllm`
(tests/setup.sh builds it): without it these tests skip, and in CI (CI=true) they fail.
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

from crossover.gateway.engines.vllm import DEV_MODE_ENV
from crossover.gateway.modes import MODES, PLAIN, SPECULATIVE
from crossover.servers import patches
from crossover.servers.launch import launch_command
from crossover.servers.process import LOOPBACK, free_port, spawn, stop
from crossover.servers.profile import load_profile, parse_profile
from crossover.servers.sglang_check import site_packages, venv_python
from crossover.servers.vllm_check import VLLM_VERSION
from tests.conftest import missing_environment
from tests.gateway.conftest import gateway  # noqa: F401  (the gateway's own fixture, in front of the engines)
from tests.host_cores import claimed_cores
from tests.host_speed import CEILING_S, StartupBudget, wait_started
from tests.patched_tree import overlay
from tests.real_vllm.engine_env import is_built
from tests.servers.conftest import VLLM_VENV

ROOT = Path(__file__).resolve().parents[2]
VENV = VLLM_VENV  # CROSSOVER_VLLM_VENV, else .venv-vllm (the parser checks of tests/servers/ use it too)
MODEL_NAME = "tiny-llama"
# Both servers' start at once, compiling (vLLM's torch.compile cache is keyed by the flags): 8-9 min on the
# reference host (tests/host_speed.py) measured at 0.6 of its idle speed, so ~5 min idle; the wait is twice that,
# scaled by the machine's speed measured just before.
IDLE_START_S = 600.0
# Making the tiny model (the tokenizer; imports transformers): a few seconds idle.
IDLE_MODEL_S = 60.0
# Three drafts a step, accepted at a mean length of 2.75 tokens (the bonus token counted): vLLM's
# minimum-variance schedule then accepts position 0 always, position 1 3/4 of the time, position 2 never.
DRAFT_TOKENS = 3
ACCEPTANCE_LENGTH = 2.75
METRICS_POLL_S = 0.25
KV_CACHE_GB = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE): ~0.25 M tokens of the tiny model
# vLLM's --max-num-queued-reqs on both servers (requests running + waiting; a request of n choices counts n):
# above the bench's top level (64) and a test's few, so only the busy test reaches it.
BUSY_CAP = 80
# The start-up measurement: one stream of PROBE_TOKENS on each server, the best of PROBES (the first may still
# warm caches).
PROBE_TOKENS = 32
PROBES = 2
# A bound is the measured time times this (a machine busier than at start-up, a metrics scrape between steps)
# plus BOUND_BASE_S (an HTTP round trip, a prefill): what a wait may take before the test says it gave up.
BUSY_SLACK = 10.0
BOUND_BASE_S = 10.0
# The plain server runs in vLLM's dev mode on the host this shipped profile gives its servers (it sleeps them, so
# dev mode is on): test_contract shows the dev routes answer on loopback and nothing answers off-host.
DEV_MODE_PROFILE = "llama8b-vllm-time-shared"
# The gated server: its own admin key, a running cap of GATE_CAP (the start-up schedule is then
# [[1, GATE_CAP - 1, DRAFT_TOKENS], [GATE_CAP, GATE_CAP, 0]]) and an acceptance of its own, below the session's.
GATE_ADMIN_KEY = "gate-admin-key-for-the-test"
GATE_CAP = 8
LOW_ACCEPTANCE = 1.75  # 3 drafts: vLLM's schedule accepts position 0 3/4 of the time, the others never
GATED_PROFILE = f"""
description = "the tiny Llama, gated, on one CPU core"
topology = "in-engine"
vllm_version = "{VLLM_VERSION}"
[[servers]]
name = "gated"
role = "speculative"
engine = "vllm"
device = "cpu"
model_path = "{{model}}/target"
served_model_name = "{MODEL_NAME}"
host = "{LOOPBACK}"
port = {{port}}
max_running_requests = {GATE_CAP}
admin_api_key_file = "{{key}}"
extra_args = ["--load-format", "dummy"]
[servers.speculative]
draft_model_path = "{{model}}/draft"
num_steps = {DRAFT_TOKENS}
eagle_topk = 1
num_draft_tokens = {DRAFT_TOKENS + 1}
vllm_config = {{{{ rejection_sample_method = "synthetic", synthetic_acceptance_length = {LOW_ACCEPTANCE} }}}}
"""
# Tests that change a server for good (an EngineCore killed) run after every other real-vLLM test.
LAST_TESTS = ("test_engine_faults.py::test_health_is_503_once_the_engine_core_died",)


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    mine = [item for item in items if Path(item.path).parent == here]
    for item in mine:
        # A backstop only: the first test here also waits for both servers to start (at most CEILING_S), and
        # every wait after that has a bound derived from the measured step time.
        item.add_marker(pytest.mark.timeout(2 * CEILING_S))
    last = [item for item in mine if any(item.nodeid.endswith(name) for name in LAST_TESTS)]
    ordered = [item for item in mine if item not in last] + last
    slots = [index for index, item in enumerate(items) if Path(item.path).parent == here]
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


@dataclass
class VLLMServer:
    mode: str
    url: str
    core: int
    proc: subprocess.Popen
    log: Path
    token_s: float = 0.0  # seconds a token takes at one stream, measured at start-up (prefill included)

    def metric(self, name: str) -> float:
        """A counter or gauge of vLLM's /metrics, summed over its samples (one engine: one sample)."""
        text = httpx.get(self.url + "/metrics", timeout=self.bound(0), trust_env=False).text
        values = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]
        if not values:
            raise AssertionError(f"{self.mode}: no {name} in /metrics")
        return sum(values)

    def bound(self, tokens: int) -> float:
        """Seconds a request of `tokens` alone may take here before a test gives up on it."""
        return BOUND_BASE_S + BUSY_SLACK * tokens * self.token_s

    def wait_for(self, name: str, value: float, tokens: int = PROBE_TOKENS) -> None:
        """Poll a metric until it reads `value`, for as long as `tokens` of generation may take. Gently: the API
        server shares its one core with the engine, and /metrics at the usual 50 Hz poll starves both."""
        timeout = self.bound(tokens)
        deadline = time.monotonic() + timeout
        while (seen := self.metric(name)) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.mode}: {name} read {seen}, not {value}, for {timeout:.0f} s")
            time.sleep(METRICS_POLL_S)


@dataclass
class RealVLLM:
    servers: dict[str, VLLMServer]  # mode -> server
    model: str
    max_model_len: int
    started_s: float  # how long both starts took
    budget: StartupBudget

    def token_s(self) -> dict[str, float]:
        return {mode: server.token_s for mode, server in self.servers.items()}

    def bound(self, tokens: int) -> float:
        """The slower server's bound for a request of `tokens` alone."""
        return max(server.bound(tokens) for server in self.servers.values())

    def timeout(self, tokens: int) -> httpx.Timeout:
        return httpx.Timeout(self.bound(tokens), connect=5.0)


def vllm_venv() -> Path:
    if not is_built(VENV):
        missing_environment(f"no vLLM venv at {VENV}: run `python -m tests.real_vllm.engine_env build {VENV}`")
    return VENV


def dev_mode_launch() -> tuple[str, dict[str, str]]:
    """The listen address and the dev-mode environment DEV_MODE_PROFILE's plain server is launched with."""
    profile = load_profile(DEV_MODE_PROFILE)
    command = launch_command(profile, profile.server(PLAIN))
    host = command.server_args[command.server_args.index("--host") + 1]
    return host, {DEV_MODE_ENV: command.env[DEV_MODE_ENV]}


def server_argv(venv: Path, model: Path, mode: str, port: int, core: int) -> list[str]:
    """The deprecated module, not `vllm serve`: the CPU build's `vllm` script looks up a distribution named `vllm`
    and fails."""
    host = dev_mode_launch()[0] if mode == PLAIN else LOOPBACK
    argv = ["taskset", "-c", str(core), str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model / "target"), "--served-model-name", MODEL_NAME, "--load-format", "dummy"]
    argv += ["--host", host, "--port", str(port), "--max-num-queued-reqs", str(BUSY_CAP)]
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


def server_env(venv: Path, mode: str, core: int) -> dict[str, str]:
    return {
        **os.environ,
        **(dev_mode_launch()[1] if mode == PLAIN else {}),
        # vLLM's CPU backend wants Intel's OpenMP loaded first (it warns, and runs slower, otherwise).
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def make_model(venv: Path, out: Path) -> Path:
    budget = StartupBudget.measure(IDLE_MODEL_S, "making the tiny model")
    try:
        made = subprocess.run(
            [str(venv_python(venv)), "-m", "tests.real_vllm.tiny_model", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=budget.seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(budget.gave_up()) from None
    assert made.returncode == 0, made.stderr[-2000:]
    return out


def start_server(venv: Path, model: Path, mode: str, core: int, base: Path) -> VLLMServer:
    port, log = free_port(), base / f"{mode}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = spawn(
            server_argv(venv, model, mode, port, core),
            env=server_env(venv, mode, core),
            stdout=out,
            stderr=subprocess.STDOUT,
            die_with_parent=False,
        )
    return VLLMServer(mode, f"http://{LOOPBACK}:{port}", core, proc, log)


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory):
    venv = vllm_venv()
    base = tmp_path_factory.mktemp("real-vllm")
    model = make_model(venv, base / "model")
    servers: dict[str, VLLMServer] = {}
    with claimed_cores(len(MODES)) as cores:
        try:
            budget = StartupBudget.measure(IDLE_START_S, "the real vLLM servers")
            began = time.monotonic()
            for mode, core in zip(MODES, cores, strict=True):
                servers[mode] = start_server(venv, model, mode, core, base)
            for server in servers.values():  # both start at once: each on its own core
                ready(server, budget, since=began)
            started_s = time.monotonic() - began
            for server in servers.values():
                server.token_s = measure_token_s(server, budget.seconds)
            card = httpx.get(servers["plain"].url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]
            rates = ", ".join(f"{mode} {1 / server.token_s:.1f} tok/s" for mode, server in servers.items())
            print(f"\nreal vLLM: started in {started_s:.0f} s (speed {budget.speed:.2f}), one stream: {rates}")
            yield RealVLLM(servers, MODEL_NAME, card["max_model_len"], started_s, budget)
        finally:
            stop([server.proc for server in servers.values()])


def start_gated(venv: Path, model: Path, accept: float, core: int, base: Path) -> tuple[VLLMServer, Path]:
    """A gated server (GATED_PROFILE at acceptance `accept`) pinned to `core`, and its admin key's file."""
    touched = [fs.path for fs in patches.load_patches(VLLM_VERSION, "vllm")]
    tree = overlay(site_packages(venv), base / "patched", "vllm", touched)
    assert patches.apply(tree, VLLM_VERSION, package="vllm", verify=False).changed
    key = base / "gate.key"
    key.write_text(GATE_ADMIN_KEY + "\n")
    key.chmod(0o600)
    port = free_port()
    text = GATED_PROFILE.replace(f"length = {LOW_ACCEPTANCE}", f"length = {accept}")
    profile = parse_profile(text.format(model=model, port=port, key=key), name="gated", source="test")
    command = launch_command(profile, profile.servers[0])
    # The module, not `vllm serve` (server_argv says why): it takes the model as --model, `vllm serve` first.
    argv = ["taskset", "-c", str(core), str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    env = {**server_env(venv, SPECULATIVE, core), **command.run_env(), "PYTHONPATH": str(tree)}
    log = base / "gated.log"
    with log.open("wb") as out:
        proc = spawn([*argv, "--model", *command.server_args], env=env, stdout=out, stderr=subprocess.STDOUT)
    return VLLMServer("gated", f"http://{LOOPBACK}:{port}", core, proc, log), key


@pytest.fixture(scope="session")
def gated_vllm(real_vllm, tmp_path_factory):
    """The gated server at LOW_ACCEPTANCE, on the plain server's core: the gate's tests and the adaptive test's
    second acceptance run while the session's plain server idles."""
    venv = vllm_venv()
    base = tmp_path_factory.mktemp("gated-vllm")
    server, _ = start_gated(venv, make_model(venv, base / "model"), LOW_ACCEPTANCE, real_vllm.servers[PLAIN].core, base)
    try:
        budget = StartupBudget.measure(IDLE_START_S, "the gated vLLM server")
        ready(server, budget, since=time.monotonic())
        server.token_s = measure_token_s(server, budget.seconds)
        yield server
    finally:
        stop([server.proc])


def ready(server: VLLMServer, budget: StartupBudget, since: float) -> None:
    try:
        wait_started(server.url + "/health", server.proc, budget, since=since)
        one_token = {"model": MODEL_NAME, "prompt": "Say OK.", "max_tokens": 1}
        wait_started(server.url + "/v1/completions", server.proc, budget, json=one_token, since=since)
    except Exception as error:
        raise AssertionError(f"{server.mode}: {error}\n{server.log.read_text(errors='replace')[-4000:]}") from None


def measure_token_s(server: VLLMServer, timeout: float) -> float:
    """Seconds a token takes at one stream on `server`: one request of PROBE_TOKENS, the best of PROBES."""
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": PROBE_TOKENS, "ignore_eos": True}
    best = timeout
    for _ in range(PROBES):
        began = time.perf_counter()
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout, trust_env=False)
        answer.raise_for_status()
        best = min(best, time.perf_counter() - began)
    return best / PROBE_TOKENS


@pytest.fixture
def vllm_gateway(gateway, real_vllm):  # noqa: F811  (the fixture imported above)
    """The gateway, partitioned: the speculative server in one pool, the plain in the other."""

    def start(**settings):
        # A probe waits for an engine busy on its one core (the bench's C=64): not a failure worth ejecting.
        settings.setdefault("health", {"interval": 0.5, "timeout": real_vllm.bound(PROBE_TOKENS)})
        servers = real_vllm.servers
        settings.setdefault("pools", {mode: {"backends": [servers[mode].url], "engine": "vllm"} for mode in MODES})
        return gateway([], [], **settings)

    return start
