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
