"""deploy/systemd: the units pass `systemd-analyze verify`, and their commands parse with crossover's own CLI.

`systemd-analyze verify` needs no running systemd (it loads the units offline); it does need each ExecStart
binary to exist, so the test points the units at this machine's `crossover` script.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crossover.gateway.cli import build_parser
from crossover.gateway.config import load_settings
from tests.deploy.deploy_files import ROOT, SYSTEMD_DIR
from tests.deploy.unit_files import EXAMPLE_ENVIRONMENT, exec_start_argv, parse_unit

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
INSTALLED_CROSSOVER = "/opt/crossover/venv/bin/crossover"
VERIFY_TIMEOUT_S = 60.0
# One instance per template: a shipped profile of the topology the unit serves.
INSTANCES = {
    "crossover-gateway.service": ("crossover-gateway.service", None),
    "crossover-agent@.service": ("crossover-agent@kimi-k25-time-shared.service", "kimi-k25-time-shared"),
    "crossover-servers@.service": ("crossover-servers@llama8b-partitioned.service", "llama8b-partitioned"),
}
GPU_UNITS = ("crossover-agent@.service", "crossover-servers@.service")
EXAMPLE_TOML = ROOT / "gateway" / "example.toml"


def units() -> list[Path]:
    return sorted(SYSTEMD_DIR.glob("*.service"))


def test_every_unit_is_covered():
    assert {path.name for path in units()} == set(INSTANCES)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian package `systemd`)")
def test_units_pass_systemd_analyze_verify(tmp_path):
    crossover = shutil.which("crossover") or str(Path(sys.executable).with_name("crossover"))
    assert Path(crossover).exists(), "the crossover console script is not installed (pip install -e .)"
    for path in units():
        (tmp_path / path.name).write_text(path.read_text().replace(INSTALLED_CROSSOVER, crossover))
    names = [str(tmp_path / instance) for instance, _ in INSTANCES.values()]
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *names],
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
        check=False,
        cwd=tmp_path,
    )
    # verify exits 0 on unknown keys (it only warns), so any message at all fails the test.
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), (
        result.stdout + result.stderr
    )


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_commands_parse_with_the_crossover_cli(name):
    unit = parse_unit(SYSTEMD_DIR / name)
    argv = exec_start_argv(unit, INSTANCES[name][1] or "")
    assert argv[0] == INSTALLED_CROSSOVER
    if "--workers" in argv and not _serve_knows("--workers"):
        # `serve --workers` comes with issue 31's workers change; until it is in, the rest must parse.
        at = argv.index("--workers")
        argv = argv[:at] + argv[at + 2 :]
    build_parser().parse_args(argv[1:])


def _serve_knows(flag: str) -> bool:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return any(flag in action.option_strings for action in commands.choices["serve"]._actions)


def test_the_gateway_runs_its_workers_with_a_default_the_env_file_overrides(tmp_path, monkeypatch):
    service = parse_unit(SYSTEMD_DIR / "crossover-gateway.service")["Service"]
    argv = exec_start_argv({"Service": service}, "")
    assert argv[argv.index("--workers") + 1] == EXAMPLE_ENVIRONMENT["CROSSOVER_WORKERS"]
    # systemd reads Environment= first and lets EnvironmentFile= override it: the unit runs even with no
    # CROSSOVER_WORKERS in gateway.env (an unset ${VAR} would pass an empty argument).
    assert service["Environment"] == ["CROSSOVER_WORKERS=2"]
    # Every setting the example env file sets (and every commented-out one) loads with the gateway's own loader.
    lines = (SYSTEMD_DIR / "gateway.env.example").read_text().splitlines()
    for line in lines:
        if "=" in line and line.lstrip("# ").startswith("CROSSOVER_"):
            name, value = line.lstrip("# ").split("=", 1)
            monkeypatch.setenv(name, value)
    settings = load_settings(EXAMPLE_TOML)
    assert settings.workers == 4 and settings.cluster.redis_url.startswith("redis://")


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_units_stop_every_process_restart_on_failure_and_read_secrets_from_a_file(name):
    service = parse_unit(SYSTEMD_DIR / name)["Service"]
    assert service["KillMode"] == ["control-group"]
    assert service["Restart"] == ["on-failure"]
    assert service.get("EnvironmentFile"), "tokens come from an EnvironmentFile, not the command line"
    assert "User" in service, "runs as a system user, not root"


@pytest.mark.parametrize("name", GPU_UNITS)
def test_gpu_units_keep_the_gpus_reachable(name):
    service = parse_unit(SYSTEMD_DIR / name)["Service"]
    assert "PrivateDevices" not in service, "PrivateDevices hides /dev/nvidia*"
    assert "MemoryDenyWriteExecute" not in service, "CUDA and Triton JIT-compile into executable memory"
    allowed = " ".join(service["DeviceAllow"])
    for device in ("/dev/nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm"):
        assert device in allowed
    assert service["LimitMEMLOCK"] == ["infinity"]
