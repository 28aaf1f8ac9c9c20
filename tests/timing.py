"""Which tests involve time: the rule behind the `timing` marker, which `python -m tests.busy` runs beside CPU
burners. Found from the code, not listed by hand - a hand-kept list is only as good as the last reading of
the suite, and one such reading let a test that judged wall-clock speed through.

    involves_time(item)   # True for a test that reads a wall clock or runs a stand-in at a time scale

A test involves time when its body, or a function or class of its own module that it names (followed on),
reads a wall clock, sleeps (pacing a client or a backend) or sets a stand-in's time scale (WALL_CLOCK). A live
stand-in keeps its schedule on the wall's clock, so what a test reads from one at a time scale (a throughput,
a lag, how far its clock moved) is a wall-clock figure. Where time enters unseen (a timeout or a window given
as a setting) the module marks itself: `pytestmark = pytest.mark.timing`. Not counted: a test that only asks
a stand-in for answers, or a bounded wait in a shared helper (tests/waiting.py) - both wait on a condition,
with room, as every test does; counting them would put some 200 tests beside the burners, longer than CI has.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from types import ModuleType

# A clock read, a sleep that paces something (a zero sleep only yields), a stand-in's time scale.
WALL_CLOCK = re.compile(
    r"\btime\.(monotonic|perf_counter|time|sleep)\(|\.time\(\)|\basyncio\.sleep\((?!0\))|--time-scale|\btime_scale\b"
)


def involves_time(item) -> bool:
    function, module = getattr(item, "function", None), getattr(item, "module", None)
    return function is not None and module is not None and _reads_clock(module, function.__name__)


@functools.cache
def _definitions(module: ModuleType) -> dict[str, ast.AST]:
    """The module's top-level functions and classes by name."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return {}
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name: node for node in tree.body if isinstance(node, kinds)}


@functools.cache
def _reads_clock(module: ModuleType, name: str) -> bool:
    definitions = _definitions(module)
    seen, pending = set(), [name]
    while pending:
        current = pending.pop()
        if current in seen or current not in definitions:
            continue
        seen.add(current)
        node = definitions[current]
        if WALL_CLOCK.search(textwrap.dedent(ast.unparse(node))):
            return True
        pending += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return False
