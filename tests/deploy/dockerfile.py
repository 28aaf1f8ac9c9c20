"""deploy/Dockerfile read instruction by instruction, so a test can run its commands without a container engine."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    arguments: str
    stage: str  # the stage's name (`FROM ... AS name`) or its index


def parse(path: Path) -> list[Instruction]:
    """Instructions in order, continuation lines joined, comments and the parser directive dropped."""
    instructions, logical, stage, stages = [], "", "", 0
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, arguments = logical.partition(" ")
        keyword, arguments = keyword.upper(), arguments.strip()
        if keyword == "FROM":
            words = arguments.split()
            stage = words[2] if len(words) > 2 and words[1].upper() == "AS" else str(stages)
            stages += 1
        instructions.append(Instruction(keyword, arguments, stage))
        logical = ""
    return instructions


def exec_form(arguments: str) -> list[str]:
    """["a", "b"] (exec form); the shell form is refused: signals must reach the process itself."""
    argv = json.loads(arguments)
    assert isinstance(argv, list) and all(isinstance(word, str) for word in argv), arguments
    return argv


def healthcheck_argv(arguments: str) -> list[str]:
    options, _, command = arguments.partition("CMD ")
    assert all(option.startswith("--") for option in options.split()), options
    return exec_form(command.strip())


def env_values(arguments: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(arguments))


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = instructions[-1].stage
    return [instruction for instruction in instructions if instruction.stage == last]
