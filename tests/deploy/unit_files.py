"""systemd unit files read as systemd reads them, enough for the checks in test_systemd.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

# What the units' ExecStart lines refer to, replaced by example values to get an argv our CLI can parse.
EXAMPLE_ENVIRONMENT = {
    "CROSSOVER_AGENT_HOST": "127.0.0.1",
    "CROSSOVER_AGENT_PORT": "9000",
    "CROSSOVER_WORKERS": "4",
}


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}} (repeated keys such as DeviceAllow= keep every value)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_start_argv(unit: dict, instance: str) -> list[str]:
    """The ExecStart command as an argv, the instance (%i), state root (%S) and ${VARIABLES} filled in."""
    (command,) = unit["Service"]["ExecStart"]
    command = command.replace("%i", instance).replace("%S", "/var/lib")
    command = re.sub(r"\$\{(\w+)\}", lambda match: EXAMPLE_ENVIRONMENT[match.group(1)], command)
    return shlex.split(command)
