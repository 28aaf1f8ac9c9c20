"""ARCHITECTURE.md names every module of the installed packages, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Section heading folder -> where its table's entries live.
SECTIONS = {
    "gateway/": ROOT / "gateway",
    **{
        f"gateway/{package}/": ROOT / "gateway" / package
        for package in (
            "engines",
            "policies",
            "wire",
            "backends",
            "cluster",
            "topology",
            "topology/switching",
            "request",
            "serve",
        )
    },
    "servers/": ROOT / "servers",
    "servers/sim/": ROOT / "servers" / "sim",
    "loadtest/": ROOT / "loadtest",
    "loadtest/proxybench/": ROOT / "loadtest" / "proxybench",
}


def parse(source: str):
    """`ast.parse`, once more if CPython 3.11.7's AST recursion counter was upset by another thread (gh-106905: a
    traceback formatted meanwhile, as a server thread logging an error does, parses its line with `ast` too)."""
    import ast

    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def documented() -> dict[str, set[str]]:
    entries: dict[str, set[str]] = {}
    folder = None
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        heading = re.match(r"## (\S+/) ", line)
        if heading:
            folder = heading.group(1) if heading.group(1) in SECTIONS else None
            continue
        row = re.match(r"\| `([^`]+)` \|", line)
        if folder and row:
            entries.setdefault(folder, set()).add(row.group(1))
    return entries


def test_every_module_is_on_the_map_and_the_map_names_only_what_exists():
    entries = documented()
    assert set(entries) == set(SECTIONS)
    for folder, path in SECTIONS.items():
        modules = {p.name for p in path.glob("*.py") if p.name != "__init__.py"}
        listed = entries[folder]
        assert modules - listed == set(), f"{folder}: not on the map"
        for name in listed:
            assert (path / name.rstrip("/")).exists(), f"{folder}{name} is on the map but not in the tree"


# --- layers: gateway below servers below loadtest ---------------------------------------------------------

LAYERS = {"gateway": 0, "servers": 1, "loadtest": 2}
# Imports that break the layering, each with why (none today: the demo moved to servers/, adaptive-config to
# loadtest/).
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def imported_modules(source: str) -> list[str]:
    """Every module an import statement of `source` names (`from a import b` names a and a.b)."""
    import ast

    names: list[str] = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def upward_imports(package: str, source: str) -> set[str]:
    """The crossover packages above `package` that `source` imports."""
    found = set()
    for name in imported_modules(source):
        parts = name.split(".")
        if parts[0] == "crossover" and len(parts) > 1 and LAYERS.get(parts[1], -1) > LAYERS[package]:
            found.add(f"crossover.{parts[1]}")
    return found


def test_no_module_imports_a_package_above_its_layer():
    violations = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for target in upward_imports(package, path.read_text()):
                if (relative, target) not in ALLOWED_UPWARD:
                    violations.append(f"{relative} imports {target}")
    assert violations == [], "imports above their layer (gateway < servers < loadtest):\n" + "\n".join(violations)


def test_the_layer_check_sees_every_form_of_an_upward_import():
    for source in (
        "import crossover.servers.sim\n",
        "from crossover.loadtest import bench\n",
        "from crossover import servers\n",
        "def late():\n    from crossover.servers.process import spawn\n",
    ):
        assert upward_imports("gateway", source), source
    assert upward_imports("servers", "from crossover.loadtest.crossover import find_crossover\n")
    assert not upward_imports("servers", "from crossover.gateway.modes import other\n")
    assert not upward_imports("loadtest", "import crossover.servers.sim\n")


def test_app_builds_its_objects_whole():
    """No collaborator wired into an object after it was built (tests/gateway/test_app.py checks every object of
    the graph at run time, through start-up and shutdown, for each topology)."""
    import ast

    tree = parse((ROOT / "gateway" / "app.py").read_text())
    build_state = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build_state")
    assigned = [
        ast.unparse(target)
        for node in ast.walk(build_state)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    ]
    assert assigned == []


# --- packages: entered through their faces, stacked in one order ---------------------------------------

# gateway/'s units from the bottom up: a root module, or a package entered through its face (`__init__.py` and its
# `__all__`). A unit imports only units below it; inside a package, a module imports its siblings directly and a
# subpackage (topology/switching/) through that subpackage's face.
GATEWAY_ORDER = (
    "modes",
    "errors",
    "cli",
    "engines",
    "policies",
    "config",
    "admission",
    "wire",
    "backends",
    "cluster",
    "metrics",
    "tracing",
    "topology",
    "request",
    "state",
    "admin",
    "app",
    "serve",
)
# (importing module, imported module) pairs that break the rules above, each with why. Empty: keep it so.
ALLOWED_BYPASS: set[tuple[str, str]] = set()
MAX_ROOT_MODULES = 14


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["crossover", *parts])


def imports_of(source: str) -> list[tuple[str, str | None]]:
    """(module, name) for every import statement of `source`, wherever it stands (in a function, under
    TYPE_CHECKING): `from a import b` is (a, b), `import a.b` is (a.b, None)."""
    import ast

    found: list[tuple[str, str | None]] = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def packages_of(root: Path) -> dict[str, list[str]]:
    """Every package under `root`/gateway by module name, with its face's `__all__`."""
    import ast

    faces = {}
    for init in (root / "gateway").rglob("__init__.py"):
        names: list[str] = []
        for node in parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names = list(ast.literal_eval(node.value))
        faces[module_name(root, init)] = names
    return faces


def import_violations(root: Path) -> list[str]:
    """What the modules under `root` (gateway/, servers/, loadtest/) import past a face or upward."""
    faces = packages_of(root)
    gateway = "crossover.gateway"
    violations = []
    for folder in ("gateway", "servers", "loadtest"):
        for path in sorted((root / folder).rglob("*.py")):
            me = module_name(root, path)
            for module, name in imports_of(path.read_text()):
                if module != gateway and not module.startswith(gateway + "."):
                    continue
                target = f"{module}.{name}" if name and f"{module}.{name}" in faces else module
                if module == gateway and name is not None:
                    target = f"{gateway}.{name}"
                if (me, target) in ALLOWED_BYPASS:
                    continue
                problem = _face_problem(me, module, name, faces) or _order_problem(me, target)
                if problem:
                    violations.append(f"{path.relative_to(root)}: {me} imports {target}: {problem}")
    return violations


def _face_problem(me: str, module: str, name: str | None, faces: dict[str, list[str]]) -> str | None:
    """Whether `me` names `module` (or `module.name`) past the face of a package it is not in."""
    for package in sorted(faces, key=len):
        if package in ("crossover.gateway", me) or me.startswith(package + "."):
            continue  # the root, or a package `me` is inside: its modules are `me`'s siblings
        if module.startswith(package + "."):
            return f"past the face of {package}"
        if module == package and name is not None and name not in faces[package]:
            return f"{name} is not on the face of {package} (its __all__)"
    return None


def _order_problem(me: str, target: str) -> str | None:
    """Whether `target` is a gateway unit above `me`'s (servers/ and loadtest/ are above every one)."""
    parts = target.split(".")
    if len(parts) < 3 or parts[1] != "gateway" or not me.startswith("crossover.gateway."):
        return None
    mine, theirs = me.split(".")[2], parts[2]
    if mine == theirs:
        return None
    if mine not in GATEWAY_ORDER or theirs not in GATEWAY_ORDER:
        return f"{mine if mine not in GATEWAY_ORDER else theirs} has no place in GATEWAY_ORDER"
    if GATEWAY_ORDER.index(theirs) > GATEWAY_ORDER.index(mine):
        return f"upward ({theirs} is above {mine} in GATEWAY_ORDER)"
    return None


def test_every_import_of_a_gateway_package_goes_through_its_face_and_downward():
    assert import_violations(ROOT) == []


def test_the_face_check_fails_on_a_planted_module_that_bypasses_a_face_or_points_upward(tmp_path):
    import shutil

    shutil.copytree(ROOT / "gateway", tmp_path / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("servers", "loadtest"):
        (tmp_path / folder).mkdir()
    assert import_violations(tmp_path) == []
    planted = {
        "gateway/request/planted.py": "from crossover.gateway.cluster.redis_store import RedisStore\n",
        "gateway/backends/planted.py": "def late():\n    from crossover.gateway.app import create_app\n",
        "gateway/topology/planted.py": "from crossover.gateway.topology.switching.queue import SwitchQueue\n",
        "gateway/planted.py": "from crossover.gateway.engines import calls\n",
        "servers/planted.py": "import crossover.gateway.wire.http1\n",
    }
    for where, source in planted.items():
        (tmp_path / where).write_text(source)
    found = import_violations(tmp_path)
    assert len(found) == len(planted), found
    for where in planted:
        assert any(line.startswith(where + ":") for line in found), (where, found)
    assert any("upward" in line for line in found)


def test_every_package_has_a_face_that_names_what_it_offers():
    import importlib

    faces = packages_of(ROOT)
    for package, names in faces.items():
        if package == "crossover.gateway":
            continue
        assert names, f"{package}/__init__.py has no __all__"
        module = importlib.import_module(package)
        assert [name for name in names if not hasattr(module, name)] == [], package
    units = {name.split(".")[2] for name in faces if name != "crossover.gateway"}
    roots = {path.stem for path in (ROOT / "gateway").glob("*.py") if path.stem != "__init__"}
    assert units | roots == set(GATEWAY_ORDER)
    assert len(roots) <= MAX_ROOT_MODULES


def import_graph(root: Path) -> dict[str, set[str]]:
    """gateway/'s modules and the gateway modules each imports (a face counts as the package's `__init__`)."""
    modules = {module_name(root, path): path for path in (root / "gateway").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, imported in imports_of(path.read_text()):
            for candidate in (f"{module}.{imported}", module):
                if candidate in modules:
                    edges.add(candidate)
                    break
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_gateway_modules():
    assert cycles(import_graph(ROOT)) == []


def test_the_cycle_check_sees_a_cycle_through_a_late_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# --- the switch controller stops growing ----------------------------------------------------------------

# SwitchController grew 374 -> 465 -> 540 lines as each job beside a switch landed in it; those jobs are
# collaborators now (topology/switching/: adoption, recovery, replicas, drain). A new one goes beside it too.
MAX_CONTROLLER_LINES = 450


def class_lines(source: str, name: str) -> int:
    """How many lines the class `name` of `source` spans, from its `class` line (or first decorator) to its end."""
    import ast

    node = next(n for n in ast.walk(parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
    return node.end_lineno - first + 1


def test_the_switch_controller_stays_under_its_size():
    source = (ROOT / "gateway" / "topology" / "switching" / "controller.py").read_text()
    assert class_lines(source, "SwitchController") < MAX_CONTROLLER_LINES, (
        "SwitchController has grown to its limit: give the new job a module beside it (topology/switching/), as "
        "adoption, recovery and the replica have"
    )


def test_the_size_check_counts_the_whole_class():
    source = "x = 1\n\n@decorated\nclass C:\n    a = 1\n\n    def f(self):\n        return 2\n\ny = 3\n"
    assert class_lines(source, "C") == 6
    grown = "class SwitchController:\n" + "    x = 1\n" * MAX_CONTROLLER_LINES
    assert class_lines(grown, "SwitchController") >= MAX_CONTROLLER_LINES
