"""`Level` records for tests of the pure functions: only the fields a test cares about, the rest blank."""

from __future__ import annotations

from typing import Any

from crossover.loadtest.models import Level


def make_level(target: str, concurrency: int, output_throughput: float, **fields: Any) -> Level:
    blank: dict[str, Any] = {name: None for name, field in Level.model_fields.items() if not field.is_required()}
    for name, field in Level.model_fields.items():
        if field.is_required():
            blank[name] = None if name.endswith("_ms") or name == "mean_tokens_per_chunk" else 0
    blank["errors"] = blank["error_kinds"] = blank["first_errors"] = {}
    blank["completed"] = 100  # a level with data unless a test says otherwise (0 completed: no data)
    return Level(
        **{**blank, "target": target, "concurrency": concurrency, "output_throughput": output_throughput, **fields}
    )
