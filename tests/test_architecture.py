"""ARCHITECTURE.md names every module of the installed packages, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Section heading folder -> where its table's entries live.
SECTIONS = {
    "gateway/": ROOT / "gateway",
    "servers/": ROOT / "servers",
    "servers/sim/": ROOT / "servers" / "sim",
    "loadtest/": ROOT / "loadtest",
    "loadtest/proxybench/": ROOT / "loadtest" / "proxybench",
}


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
    for node in ast.walk(ast.parse(source)):
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

    tree = ast.parse((ROOT / "gateway" / "app.py").read_text())
    build_state = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build_state")
    assigned = [
        ast.unparse(target)
        for node in ast.walk(build_state)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    ]
    assert assigned == []
