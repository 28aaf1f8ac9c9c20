"""Load traces for `crossover sim replay`: phases of closed-loop clients, from a CSV or a JSON file.

trace = load_trace("trace.csv")      # duration_s,concurrency - one phase a row; or a shipped trace's name
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# Shipped example traces (`--trace k25-bursts` or a path).
TRACES_DIR = Path(__file__).with_name("traces")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message says where and why."""


class TracePhase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(gt=0, allow_inf_nan=False, description="how long this phase lasts (seconds)")
    concurrency: int = Field(ge=0, description="closed-loop clients during this phase")


_TRACE = TypeAdapter(list[TracePhase])


def load_trace(path: str | Path) -> list[TracePhase]:
    """A CSV with the header `duration_s,concurrency`, or a JSON list of {"duration_s", "concurrency"}; a bare
    name is a shipped trace (servers/sim/traces/NAME.csv) when no such file exists."""
    path = Path(path)
    if not path.exists() and (shipped := TRACES_DIR / f"{path}.csv").exists():
        path = shipped
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    return parse_trace(text, where=str(path), json_format=path.suffix.lower() == ".json")


def parse_trace(text: str, *, where: str = "trace", json_format: bool = False) -> list[TracePhase]:
    if json_format:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON: {exc}") from None
        label = "item"
    else:
        reader = csv.DictReader(io.StringIO(text))
        header = [name.strip() for name in reader.fieldnames or []]
        if header != ["duration_s", "concurrency"]:
            raise TraceError(f"{where}: the CSV header must be 'duration_s,concurrency', got {','.join(header)!r}")
        rows = []
        for line in csv.reader(io.StringIO(text)):
            if line and any(cell.strip() for cell in line):
                rows.append(line)
        rows = [dict(zip(header, (cell.strip() for cell in row), strict=False)) for row in rows[1:]]
        label = "row"
    if isinstance(rows, list) and not rows:
        raise TraceError(f"{where}: the trace has no phases")
    try:
        return _TRACE.validate_python(rows)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = list(error["loc"])
            position = f"{label} {loc.pop(0) + (2 if label == 'row' else 0)}" if loc and isinstance(loc[0], int) else ""
            field_name = ".".join(str(part) for part in loc)
            problems.append(": ".join(part for part in (position, field_name, error["msg"]) if part))
        raise TraceError(f"{where}: " + "; ".join(problems)) from None
