"""The README's test command is what CI runs, and tests/setup.sh installs what the tests would otherwise skip
without: a newcomer following the README checks what CI checks."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.gateway.wire.test_client_http_uvicorn import FLOOR_VENV
from tests.real_sglang.conftest import SERVE_VENV
from tests.real_vllm.conftest import VENV as VLLM_VENV
from tests.servers.conftest import SGLANG_VENV
from tests.servers.vllm_release_source import DIRECTORY as VLLM_034_FILES

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tests" / "setup.sh"


def first_screen_commands() -> list[str]:
    """The commands (not the comments) of the README's first code block."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def ci_command() -> str:
    """.ci/run's last line: its command."""
    return (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]


def setup_steps(kind: str) -> list[list[str]]:
    """setup.sh's one-line steps of a kind (`system`, `build`), as argv without the kind and the comment."""
    lines = [line.split("#")[0] for line in SETUP.read_text().splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith(f"{kind} ")]


def test_the_readme_first_screen_has_two_commands_the_demo_and_the_tests():
    demo, tests = first_screen_commands()
    assert "crossover demo" in demo and "pytest" in tests


def test_the_readme_test_command_is_what_ci_runs_and_starts_with_the_setup():
    command = first_screen_commands()[1]
    assert command == ci_command()
    assert command.startswith("tests/setup.sh && ")
    assert "pytest -n auto" in command and "python -m tests.busy" in command


def test_setup_installs_prometheus_with_promtool_systemd_analyze_and_redis():
    # Debian's `prometheus` package ships promtool beside the server (tests/deploy/test_prometheus_rules.py);
    # redis-server: the tests start their own on a free loopback port, never the system service.
    assert setup_steps("system") == [
        ["prometheus", "prometheus"],
        ["systemd-analyze", "systemd"],
        ["redis-server", "redis-server"],
    ]


def test_setup_builds_every_venv_the_tests_look_for():
    built = {Path(directory).name for _, directory in setup_steps("build")}
    assert built == {SGLANG_VENV.name, SERVE_VENV.name, FLOOR_VENV.name, VLLM_VENV.name, VLLM_034_FILES.name}
