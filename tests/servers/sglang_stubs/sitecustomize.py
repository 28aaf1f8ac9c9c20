"""Import-time stubs that let SGLang 0.5.23 modules import on a CPU box (tests/servers/test_sglang_patch.py).

Put this directory on PYTHONPATH. The GPU-only packages named below are replaced by permissive dummies when they
are not installed - or when all that is installed is the empty `triton` placeholder the parser venv carries
(servers/sglang_check.py) - and every other package must be real; sglang itself is never stubbed. Nothing here runs
a kernel; it only lets `import` complete. From the patch sketch (shared/reference/sglang-patch-sketch)."""

import importlib.abc
import importlib.machinery
import os
import sys
import types

_NEVER = {"sglang"}
_STUB = {
    "triton",
    "torchvision",
    "cuda",
    "flash_attn",
    "sgl_kernel",
    "flashinfer",
    "deep_gemm",
    "pynvml",
    "mlx",
    "torchcomms",
    "xgrammar",
    "soundfile",
    # sglang.test.test_utils (CustomTestCase, the upstream CPU tests' base) imports the benchmark datasets.
    "datasets",
}
_VERSIONS = {"triton": "3.5.0", "torchvision": "0.29.0"}
STUBBED = set()
# Attribute names whose absence the callers handle (e.g. triton.runtime.driver:
# SGLang falls back to "cpu" when it raises).
_RAISE = {"driver"}


class _Any:
    def __init__(self, name="stub"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return _Any(self._name + "()")

    def __getattr__(self, item):
        if item.startswith("__") or item in _RAISE:
            raise AttributeError(item)
        return _Any(f"{self._name}.{item}")

    def __getitem__(self, item):
        return _Any(self._name + "[]")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __repr__(self):
        return f"<stub {self._name}>"


class _AnyMeta(type):
    def __getattr__(cls, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Any(f"{cls.__name__}.{item}")


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__") or item in _RAISE:
            raise AttributeError(item)
        if item[:1].isupper():
            # Capitalised names are usually classes: isinstance()/subclassing work.
            cls = _AnyMeta(
                item,
                (),
                {
                    "__module__": self.__name__,
                    "__init__": lambda obj, *a, **k: None,
                    "__getattr__": lambda obj, name: _Any(f"{item}().{name}"),
                },
            )
            setattr(self, item, cls)
            return cls
        return _Any(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in _NEVER or top not in _STUB:
            return None
        if top != fullname and top not in STUBBED:
            return None  # submodule of a real package: let its ImportError stand
        if top in _PLACEHOLDERS:
            STUBBED.add(top)
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                spec = finder.find_spec(fullname, path, target)
            except Exception:
                spec = None
            if spec is not None:
                return None
        STUBBED.add(top)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = _VERSIONS.get(spec.name.split(".")[0], "0.0.0")
        return m

    def exec_module(self, module):
        pass


def _placeholders() -> set[str]:
    """Stubbed names whose installed package is an empty __init__.py (the parser venv's `triton`)."""
    found = set()
    for name in _STUB:
        spec = importlib.machinery.PathFinder.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith("__init__.py") and os.path.getsize(origin) == 0:
            found.add(name)
    return found


_PLACEHOLDERS = _placeholders()
sys.meta_path.insert(0, _Finder())
