"""results.json / results.csv: the one documented output of a run (models and schema: models.py).

`results.json` is also a measured-curve profile for the SGLang stand-in (`servers/sim`): bench real servers
once, replay their curves anywhere. Keep `schema_version` and the level field names stable.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from crossover.loadtest.crossover import analyse
from crossover.loadtest.models import SCHEMA_VERSION, Crossover, Level, Metadata, Results, TargetInfo
from crossover.loadtest.saturation import find_queueing
from crossover.loadtest.standin import refusal
from crossover.loadtest.stats import LATENCY_METRICS

# The exit status of a run (and of `bench report` on its file) whose crossover was refused: the results are
# kept, not trusted, and a script that wanted a crossover must not read success.
REFUSED_EXIT_STATUS = 1

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"

CSV_FIELDS = [
    "target",
    "concurrency",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "output_throughput_low",
    "output_throughput_high",
    "total_input_tokens",
    "total_output_tokens",
    "measured_concurrency",
    "mean_tokens_per_chunk",
    *(f"{stat}_{name}" for name in LATENCY_METRICS for stat in ("mean", "median", "std", "p90", "p99")),
    "errors",
    "error_kinds",
]


class ResultsError(Exception):
    """A results file that is missing, unreadable or of another schema version."""


def load_schema() -> dict:
    """The packaged results.schema.json (generated from models.py; a test keeps them equal)."""
    return json.loads(resources.files("crossover.loadtest").joinpath("results.schema.json").read_text())


def crossover_section(
    levels: Sequence[Level], speculative: str, plain: str, targets: Mapping[str, TargetInfo] | None = None
) -> Crossover:
    """`analyse` when both targets were benchmarked, else an explicit 'not computed' record; 'refused' (with
    the evidence, without a crossover or thresholds) when a stand-in of the pair lagged during a level."""
    names = {lv.target for lv in levels}
    if speculative in names and plain in names:
        found = analyse(levels, speculative, plain)
        reason = refusal(targets or {}, speculative, plain)
        if reason is None:
            return found
        return Crossover(
            concurrency=None,
            recommended_threshold=None,
            speculative=speculative,
            plain=plain,
            status="refused",
            evidence=found.evidence,
            reason=reason,
        )
    return Crossover(
        concurrency=None,
        recommended_threshold=None,
        speculative=speculative if speculative in names else None,
        plain=plain if plain in names else None,
        status="not_computed",
        evidence=[],
    )


def build_results(metadata: Metadata, levels: Sequence[Level], speculative: str, plain: str) -> Results:
    return Results(
        metadata=metadata,
        levels=list(levels),
        crossover=crossover_section(levels, speculative, plain, metadata.targets),
        queueing=find_queueing(levels),
    )


def exit_status(results: Results) -> int:
    """What `crossover bench` exits with for these results before --apply: REFUSED_EXIT_STATUS if refused."""
    return REFUSED_EXIT_STATUS if results.crossover.status == "refused" else 0


def write_results(out_dir: Path, results: Results) -> list[Path]:
    """Write results.json and results.csv into `out_dir` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / RESULTS_JSON
    json_path.write_text(results.model_dump_json(indent=2) + "\n")
    csv_path = out_dir / RESULTS_CSV
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for level in results.levels:
            low, high = level.output_throughput_interval or (None, None)
            row = {**level.model_dump(), "output_throughput_low": low, "output_throughput_high": high}
            writer.writerow({**row, "errors": json.dumps(level.errors), "error_kinds": json.dumps(level.error_kinds)})
    return [json_path, csv_path]


def load_results(path: Path) -> Results:
    """Read a results.json, or the one inside a run directory."""
    file = path / RESULTS_JSON if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{file}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{file}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise ResultsError(f"{file}: not a crossover results file of schema_version {SCHEMA_VERSION}")
    for key in ("metadata", "levels", "crossover"):
        if key not in data:
            raise ResultsError(f"{file}: missing {key!r}")
    try:
        return Results.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ResultsError(f"{file}: {where}: {first['msg']} ({exc.error_count()} problem(s))") from None
