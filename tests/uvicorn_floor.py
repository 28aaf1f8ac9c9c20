"""The venv that runs the client protocol's tests on the oldest uvicorn pyproject.toml allows (`.venv-uvicorn-floor`).

    python -m tests.uvicorn_floor build .venv-uvicorn-floor    # once, ~1 min; skipped when built

gateway/wire/client_http.py builds on uvicorn's internals (`UVICORN_INTERNALS`), which any release may change: the floor
in pyproject.toml is the first release that has them all and behaves as the module relies on. This venv holds
`uvicorn[standard]` at exactly that floor, the project (editable, from this checkout) with its other dependencies as
pip resolves them beside it, and pytest: tests/gateway/wire/test_client_http_uvicorn.py runs the client protocol's tests
with its Python. The floor is read from pyproject.toml, so raising it there rebuilds the venv on the next build.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from crossover.servers.sglang_check import venv_python
from tests.venv_build import build_command

REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER = ".crossover-uvicorn-floor"
# What the tests need beyond the project's own dependencies (pytest's ini options name pytest-timeout).
TEST_PACKAGES = ("pytest>=8", "pytest-timeout>=2.3")


def floor(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The lowest uvicorn release pyproject.toml allows: its `uvicorn[standard]>=X` requirement's X."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for requirement in dependencies:
        found = re.fullmatch(r"uvicorn\[standard\]\s*>=\s*([0-9.]+)\s*(,.*)?", requirement)
        if found:
            return found[1]
    raise ValueError(f"{pyproject} has no uvicorn[standard]>=X requirement")


def _digest() -> str:
    # The checkout is part of it: the project is installed editable, from where the venv was built.
    return hashlib.sha256(f"{floor()}\n{REPO_ROOT}\n{TEST_PACKAGES}".encode()).hexdigest()[:16]


def is_built(venv: Path) -> bool:
    """Built, at today's floor, for this checkout."""
    marker = venv / MARKER
    return venv_python(venv).exists() and marker.exists() and marker.read_text().strip() == _digest()


def build(venv: Path) -> float:
    """Build `venv` unless it is built; returns the seconds it took (0 when skipped)."""
    if is_built(venv):
        return 0.0
    began = time.monotonic()
    (venv / MARKER).unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"uvicorn[standard]=={floor()}", "-e", str(REPO_ROOT), *TEST_PACKAGES], check=True)
    (venv / MARKER).write_text(_digest() + "\n")
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    return build_command("tests.uvicorn_floor", f"uvicorn {floor()} (the floor) venv", build, argv)


if __name__ == "__main__":
    sys.exit(main())
