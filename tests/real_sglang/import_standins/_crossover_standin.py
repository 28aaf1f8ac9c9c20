"""Import-only stand-ins for packages real SGLang imports on a CPU machine but never uses on the tests' path.

Every attribute (and every submodule) of a stand-in package resolves to an op that raises when called, and
writes a line to `$CROSSOVER_STANDIN_LOG` first - each import too - so a test can prove that the stand-ins
were loaded and that nothing in them ran (tests/real_sglang/test_import_standins.py). A package's
`__init__.py` is two lines: its docstring says why it is stood in, then `install(__name__)`.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

_LOG = os.environ.get("CROSSOVER_STANDIN_LOG")


def record(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as log:
            log.write(f"{line} pid={os.getpid()}\n")


class StandInCalled(RuntimeError):
    """Something called into a stand-in: this path needs the real package."""


class _Op:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        record(f"call {self._name}")
        raise StandInCalled(f"{self._name}() was called, but it is an import-only stand-in (crossover tests)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Op(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<import-only stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Op(f"{self.__name__}.{name}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, top: str):
        self.top = top

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self.top + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        record(f"import {module.__name__}")


def install(name: str) -> None:
    """Turn the package `name` (being imported) into a stand-in: unknown attributes and submodules are ops."""
    module = sys.modules[name]
    module.__class__ = _StandInModule
    module.__version__ = "0.0.0+crossover.standin"
    sys.meta_path.append(_Submodules(name))
    record(f"import {name}")
