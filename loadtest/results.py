"""results.json / results.csv: the one documented output of a run (schema: loadtest/results.schema.json).

`results.json` is also a measured-curve profile for the SGLang stand-in (`servers/sim`): bench real servers
once, replay their curves anywhere. Keep `schema_version` and the level field names stable.
"""

from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path

from crossover.loadtest.crossover import analyse
from crossover.loadtest.saturation import find_queueing
from crossover.loadtest.stats import LATENCY_METRICS

SCHEMA_VERSION = 1
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
    "total_input_tokens",
    "total_output_tokens",
    "measured_concurrency",
    "mean_tokens_per_chunk",
    *(f"{stat}_{name}" for name in LATENCY_METRICS for stat in ("mean", "median", "std", "p90", "p99")),
    "errors",
]


class ResultsError(Exception):
    """A results file that is missing, unreadable or of another schema version."""


def load_schema() -> dict:
    return json.loads(resources.files("loadtest").joinpath("results.schema.json").read_text())


def crossover_section(levels: list[dict], speculative: str, plain: str) -> dict:
    """`analyse` when both targets were benchmarked, else an explicit 'not computed' record."""
    names = {lv["target"] for lv in levels}
    if speculative in names and plain in names:
        return analyse(levels, speculative, plain)
    return {
        "concurrency": None,
        "recommended_threshold": None,
        "speculative": speculative if speculative in names else None,
        "plain": plain if plain in names else None,
        "status": "not_computed",
        "bracket": None,
        "spillover_worst_case_efficiency": None,
        "evidence": [],
    }


def build_results(metadata: dict, levels: list[dict], speculative: str, plain: str) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "metadata": metadata,
        "levels": levels,
        "crossover": crossover_section(levels, speculative, plain),
        "queueing": find_queueing(levels),
    }


def write_results(out_dir: Path, results: dict) -> list[Path]:
    """Write results.json and results.csv into `out_dir` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / RESULTS_JSON
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    csv_path = out_dir / RESULTS_CSV
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for level in results["levels"]:
            writer.writerow({**level, "errors": json.dumps(level.get("errors") or {})})
    return [json_path, csv_path]


def load_results(path: Path) -> dict:
    """Read a results.json, or the one inside a run directory."""
    file = path / RESULTS_JSON if path.is_dir() else path
    try:
        results = json.loads(file.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{file}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{file}: not readable as JSON ({exc})") from None
    if not isinstance(results, dict) or results.get("schema_version") != SCHEMA_VERSION:
        raise ResultsError(f"{file}: not a crossover results file of schema_version {SCHEMA_VERSION}")
    for key in ("metadata", "levels", "crossover"):
        if key not in results:
            raise ResultsError(f"{file}: missing {key!r}")
    return results
