"""The optional `[bench]` extra (matplotlib, rich): imported only when used, with a clear message if absent."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'crossover[bench]'"


class MissingExtra(RuntimeError):
    """A package of the `[bench]` extra is not installed."""


def require(module: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".", maxsplit=1)[0]
        raise MissingExtra(f"{purpose} needs {top}, which is not installed: {INSTALL_HINT}") from None
