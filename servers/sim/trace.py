"""Load traces for `crossover sim replay`: phases of closed-loop clients, from a CSV or a JSON file.

trace = load_trace("trace.csv")      # duration_s,concurrency[,accept_length] - one phase a row; or a shipped name
trace = with_accept_drop(trace, at_s=3600, accept_length=1.6)   # --accept-drop 3600:1.6

`accept_length` (optional; an empty cell or no column: the profile's) is the speculative engine's acceptance during
the phase - tokens per speculative step, the bonus token included - as the gateway would read it live.
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
    accept_length: float | None = Field(
        None, ge=1, allow_inf_nan=False, description="the speculative accept length (None: the profile's)"
    )


_TRACE = TypeAdapter(list[TracePhase])
HEADERS = (["duration_s", "concurrency"], ["duration_s", "concurrency", "accept_length"])


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
        if header not in HEADERS:
            raise TraceError(
                f"{where}: the CSV header must be 'duration_s,concurrency' or 'duration_s,concurrency,accept_length', "
                f"got {','.join(header)!r}"
            )
        rows = []
        for line in csv.reader(io.StringIO(text)):
            if line and any(cell.strip() for cell in line):
                rows.append(line)
        # An empty accept_length cell: the profile's (the field's default).
        cells = [zip(header, (cell.strip() for cell in row), strict=False) for row in rows[1:]]
        rows = [{name: cell for name, cell in row if cell or name != "accept_length"} for row in cells]
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


def shifts_acceptance(trace: list[TracePhase]) -> bool:
    """Whether any phase gives its own accept length."""
    return any(phase.accept_length is not None for phase in trace)


def with_accept_drop(trace: list[TracePhase], *, at_s: float, accept_length: float) -> list[TracePhase]:
    """The trace with the speculative accept length `accept_length` from `at_s` seconds on (`--accept-drop T:A`):
    the phase running at `at_s` is split there. A drop past the trace's end changes nothing."""
    phases: list[TracePhase] = []
    start = 0.0
    for phase in trace:
        end = start + phase.duration_s
        if end <= at_s:
            phases.append(phase)
        elif start >= at_s:
            phases.append(phase.model_copy(update={"accept_length": accept_length}))
        else:
            phases.append(phase.model_copy(update={"duration_s": at_s - start}))
            phases.append(phase.model_copy(update={"duration_s": end - at_s, "accept_length": accept_length}))
        start = end
    return phases
