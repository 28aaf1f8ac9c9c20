"""vLLM 0.34.0, read from its own files (`.vllm-0.34.0`, unpacked from its wheel by vllm_release_source.py; it has
no CPU build, so nothing here runs it):
- patches/vllm-0.34.0 through `crossover patches`: chosen by the tree's version, applies, is idempotent, checks,
  reverts byte for byte; 0.32.0's series does not fit these files, which is why there are two;
- the port changes what 0.32.0's series changes: the same gate policy (utils.py, which 0.32.0's tests run on real
  vLLM classes), the scheduler reading the lookup the gate replaces, the CUDA graphs sized per query length as the
  gate's widest-batch rule assumes;
- the facts the gateway's vLLM adapter (gateway/engines/vllm.py) rests on, as tests/real_vllm/test_vllm_facts.py
  checks them on 0.32.0's objects: load gauges and labels, spec counters, dev-mode routes, busy and dead answers."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from crossover.gateway.engines.vllm import (
    BUSY_STATUS,
    DEV_MODE_ENV,
    IS_SLEEPING_PATH,
    PATCH_NAME,
    RUNNING,
    SLEEP,
    SPEC_ACCEPTED,
    SPEC_DRAFTS,
    WAITING,
    WAKE_UP,
)
from crossover.servers import patches
from crossover.servers.profile import SUPPORTED_VLLM, VLLM_GATE_RELEASES
from tests.conftest import missing_environment
from tests.patched_tree import overlay
from tests.servers.test_vllm_patches import run_patches
from tests.servers.vllm_release_source import DIRECTORY, VERSION, is_built

OLDER = "0.32.0"


def series(version: str = VERSION) -> list[patches.FileSeries]:
    return patches.load_patches(version, "vllm")


@pytest.fixture(scope="module")
def release() -> Path:
    if not is_built(DIRECTORY):
        build = f"python -m tests.servers.vllm_release_source build {DIRECTORY.name}"
        missing_environment(f"no vLLM {VERSION} files at {DIRECTORY}: run `{build}`")
    assert patches.tree_version(DIRECTORY, "vllm") == VERSION
    return DIRECTORY


@pytest.fixture
def tree(release: Path, tmp_path: Path) -> Path:
    return overlay(release, tmp_path / "tree", "vllm", [fs.path for fs in series()])


def touched(tree: Path) -> dict[str, bytes]:
    return {fs.path: (tree / fs.path).read_bytes() for fs in series()}


def source(root: Path, path: str, name: str) -> str:
    """The source of the function or class `name` (`Class.method` for a method) in `root/path`."""
    text = (root / path).read_text()
    node: ast.AST = ast.parse(text)
    for part in name.split("."):
        node = next(
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and child.name == part
        )
    segment = ast.get_source_segment(text, node)
    assert segment is not None
    return segment


def test_the_gate_is_ported_to_every_release_a_profile_may_pin():
    assert patches.vllm_releases() == sorted(VLLM_GATE_RELEASES) == sorted(SUPPORTED_VLLM)
    # What the gateway tells an operator whose vLLM server has no gate names every series.
    assert all(f"patches/vllm-{release} " in PATCH_NAME for release in patches.vllm_releases())


def test_the_series_is_chosen_by_version_applies_checks_and_reverts_byte_for_byte(tree):
    before = touched(tree)
    result = run_patches("check", "--vllm", str(tree))
    assert result.returncode == 1, result.stderr
    assert f"vLLM {VERSION} at {(tree / 'vllm').resolve()} (patches/vllm-{VERSION}/): patches not applied" in (
        result.stdout
    )
    # No import check: 0.34.0 does not import on this machine (its CUDA torch); the hunks are the check.
    result = run_patches("apply", "--vllm", str(tree), "--no-import-check")
    assert result.returncode == 0 and f"applied to vLLM {VERSION}" in result.stdout, result.stderr
    result = run_patches("apply", "--vllm", str(tree), "--no-import-check")
    assert result.returncode == 0 and "already applied" in result.stdout
    assert run_patches("check", "--vllm", str(tree)).returncode == 0
    for path, text in touched(tree).items():
        compile(text, path, "exec")  # every patched file is Python
    # and names nothing it does not define or import, and imports nothing it leaves unused (the release's files pass).
    lint = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F401,F811,F821,F822,F823"]
    linted = subprocess.run([*lint, *touched(tree)], cwd=tree, capture_output=True, text=True, timeout=120, check=False)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    result = run_patches("revert", "--vllm", str(tree))
    assert result.returncode == 0, result.stderr
    assert touched(tree) == before


def test_the_older_series_does_not_fit_these_files(release):
    states = patches.inspect(release, series(OLDER))
    assert patches.overall(states) == "conflict"
    # The series is applied with exact context and line numbers: most files moved; the scheduler's lines changed.
    assert "vllm/v1/core/sched/scheduler.py" in [state.path for state in states if state.state == "conflict"]


def test_the_port_makes_the_same_changes_only_their_context_differs():
    """Line for line what 0.32.0's series adds and removes, file by file: the gate's policy (utils.py) among them,
    which 0.32.0's tests run on vLLM's real classes (test_vllm_patches.py)."""
    older = {fs.path: changes(fs) for fs in series(OLDER)}
    assert {fs.path: changes(fs) for fs in series()} == older


def changes(fs: patches.FileSeries) -> list[str]:
    """The lines a file's hunks add (`+ `) and remove (`- `), in order."""
    return [line for _, hunks in fs.steps for hunk in hunks for line in difflib.ndiff(hunk.old, hunk.new)
            if line.startswith(("+ ", "- "))]  # fmt: skip


def test_the_patched_scheduler_reads_the_lookup_the_gate_replaces_and_graphs_reach_the_widest_batch(tree):
    patches.apply(tree, VERSION, package="vllm", verify=False)
    scheduler = "vllm/v1/core/sched/scheduler.py"
    init = source(tree, scheduler, "Scheduler.__init__")
    assert "self.dynamic_sd_lookup = self.speculation_gate.lookup" in init
    assert "build_dynamic_sd_schedule_lookup" not in init
    assert "self.dynamic_sd_lookup[" in source(tree, scheduler, "Scheduler.schedule")
    updated = source(tree, scheduler, "Scheduler.update_speculation_gate")
    assert "self.dynamic_sd_lookup = lookup" in updated
    # 0.34.0 captures each decode query length (1 + K) up to the widest batch the start-up lookup runs it at: the
    # premise of the gate's widest-batch refusal.
    sizes = source(tree, "vllm/config/vllm.py", "VllmConfig.get_decode_cudagraph_query_lens")
    assert "build_dynamic_sd_schedule_lookup(" in sizes and "k + num_new_sampled_tokens: batch_size" in sizes
    # The engine core's utility reaches the scheduler the busy loop steps.
    assert "getattr(self.scheduler, method, None)" in source(tree, "vllm/v1/engine/core.py", "EngineCore")


def test_the_adapters_facts_hold_in_the_release_source(release):
    loggers = source(release, "vllm/v1/metrics/loggers.py", "PrometheusStatLogger.__init__")
    for gauge in (RUNNING, WAITING):
        assert f'name="{gauge}"' in loggers, gauge
    assert 'labelnames = ["model_name", "engine"]' in loggers
    spec = (release / "vllm/v1/spec_decode/metrics.py").read_text()
    for counter in (SPEC_DRAFTS, SPEC_ACCEPTED):
        assert f'"{counter}"' in spec, counter
    # --disable-log-stats builds no stat loggers, so no gauges (profile.REFUSED_VLLM_ARGS refuses it).
    assert "log_stats=not engine_args.disable_log_stats" in source(release, "vllm/v1/engine/async_llm.py", "AsyncLLM")
    assert "if self.log_stats:" in source(release, "vllm/v1/engine/async_llm.py", "AsyncLLM.__init__")
    # Dev mode opens sleep's routes and /collective_rpc, only with the variable set.
    assert f'"{DEV_MODE_ENV}"' in (release / "vllm/envs.py").read_text()
    assert "if envs.VLLM_SERVER_DEV_MODE:" in (release / "vllm/entrypoints/launchers/api_server/routers.py").read_text()
    dev = source(release, "vllm/entrypoints/serve/__init__.py", "register_vllm_dev_api_routers")
    assert ".dev.sleep.api_router" in dev and ".dev.rpc.api_router" in dev
    assert '@router.post("/collective_rpc")' in (release / "vllm/entrypoints/serve/dev/rpc/api_router.py").read_text()
    sleep_router = release / "vllm/entrypoints/serve/dev/sleep/api_router.py"
    routes = sleep_router.read_text()
    path, query = SLEEP.path.split("?")
    assert f'@router.post("{path}")' in routes and f'@router.post("{WAKE_UP.path}")' in routes
    assert f'@router.get("{IS_SLEEPING_PATH}")' in routes
    sleep = next(
        node
        for node in ast.walk(ast.parse(routes))
        if isinstance(node, ast.AsyncFunctionDef) and node.name == path.strip("/")
    )
    parameters = [arg.arg for arg in sleep.args.args]
    given = dict(pair.split("=") for pair in query.split("&"))
    assert set(given) <= set(parameters)
    # Every parameter past the request has a default: 0.34.0's new reset_connector does not break the call.
    assert len(sleep.args.defaults) == len(parameters) - 1
    pause_modes = (release / "vllm/v1/engine/__init__.py").read_text().split("PauseMode = ", 1)[1].split("\n")[0]
    assert f'"{given["mode"]}"' in pause_modes
    # Busy and dead.
    assert BUSY_STATUS == 503
    assert "HTTPStatus.SERVICE_UNAVAILABLE" in source(release, "vllm/exceptions.py", "QueueOverflowError")
    health = (release / "vllm/entrypoints/serve/instrumentator/health.py").read_text()
    assert "except EngineDeadError:" in health and "status_code=503" in health
