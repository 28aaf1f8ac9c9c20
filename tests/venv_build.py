"""The `python -m MODULE build VENV_DIR` command every test venv builder answers (tests/setup.sh's `build` lines)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from crossover.servers.sglang_check import venv_python


def build_command(module: str, what: str, build: Callable[[Path], float], argv: list[str] | None = None) -> int:
    """Build the venv named on the command line (`build` returns the seconds it took, 0 if it was built already)."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] != "build":
        print(f"usage: python -m {module} build VENV_DIR", file=sys.stderr)
        return 2
    venv = Path(args[1])
    took = build(venv)
    state = f"built in {took:.0f} s" if took else "already built"
    print(f"{what} venv {state}: {venv_python(venv)}")
    return 0
