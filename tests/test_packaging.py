"""The distribution as a user installs it: `pip install -e .` in a fresh venv (no extras) gives one import
namespace, `crossover.`, no top-level `gateway`, `servers` or `loadtest`, and a `crossover` command whose every
subcommand answers --help."""

from __future__ import annotations

import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fresh") / "venv"
    venv.create(root, with_pip=True)
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "-e", str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def run(venv_root: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    # Run away from the checkout: its folders on the path would hide what the install itself provides.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv_root / 'bin'}{os.pathsep}{env['PATH']}"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def test_one_namespace_and_no_generic_top_level_names(fresh_venv, tmp_path):
    probe = (
        "import importlib.util, crossover.gateway, crossover.servers, crossover.servers.sim, crossover.loadtest; "
        "print([name for name in ('gateway', 'servers', 'loadtest') if importlib.util.find_spec(name)])"
    )
    done = run(fresh_venv, str(fresh_venv / "bin" / "python"), "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    # The GPU host's engine is an extra, never the gateway's requirement.
    assert run(fresh_venv, str(fresh_venv / "bin" / "python"), "-c", "import sglang", cwd=tmp_path).returncode != 0


def subcommands(help_text: str) -> list[str]:
    """The commands an argparse help lists under its positional COMMAND / SUBCOMMAND."""
    return re.findall(r"^    (\S+)\s{2,}", help_text.split("options:", maxsplit=1)[0], flags=re.MULTILINE)


def test_every_subcommand_answers_help_without_the_extras(fresh_venv, tmp_path):
    top = run(fresh_venv, "crossover", "--help", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    commands = subcommands(top.stdout)
    assert set(commands) == {"serve", "demo", "sim", "servers", "patches", "bench", "advise"}
    checked = 0
    for command in commands:
        done = run(fresh_venv, "crossover", command, "--help", cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr)
        for sub in subcommands(done.stdout) if "SUBCOMMAND" in done.stdout else []:
            nested = run(fresh_venv, "crossover", command, sub, "--help", cwd=tmp_path)
            assert nested.returncode == 0 and "usage: crossover" in nested.stdout, (command, sub, nested.stderr)
            checked += 1
    assert checked >= 10  # sim serve/curve/steps/replay, servers plan/up/down/status/adaptive-config/agent, ...


def test_every_package_in_the_tree_is_in_the_distribution():
    """pyproject.toml names its packages (package-dir maps the folders): one left out installs editable and is
    missing from the wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join([name, *parts]))
    assert found == set(setuptools["packages"])
