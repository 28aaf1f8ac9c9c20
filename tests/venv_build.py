"""The `python -m MODULE build DIR` command every builder of a test venv (or of an engine's files) answers
(tests/setup.sh's `build` lines)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from crossover.servers.sglang_check import venv_python


def build_command(
    module: str,
    what: str,
    build: Callable[[Path], float],
    argv: list[str] | None = None,
    shown: Callable[[Path], Path] = venv_python,
) -> int:
    """Build the venv (or, with `shown` saying what to print, any directory) named on the command line (`build`
    returns the seconds it took, 0 if it was built already)."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] != "build":
        print(f"usage: python -m {module} build DIR", file=sys.stderr)
        return 2
    directory = Path(args[1])
    took = build(directory)
    state = f"built in {took:.0f} s" if took else "already built"
    print(f"{what} {state}: {shown(directory)}")
    return 0
