"""results.json follows its schema; results.csv has a row per level; bad files are refused clearly."""

from __future__ import annotations

import csv
import json

import jsonschema
import pytest

from crossover.loadtest.client import RequestResult
from crossover.loadtest.models import Level, Metadata
from crossover.loadtest.results import CSV_FIELDS, ResultsError, build_results, load_results, load_schema, write_results
from crossover.loadtest.stats import summarize

METADATA = Metadata(
    tool="crossover test",
    started_at="2025-01-01T00:00:00+00:00",
    finished_at="2025-01-01T00:01:00+00:00",
    targets={"speculative": {"url": "http://a", "server_info": None}, "plain": {"url": "http://b"}},
    model="m",
    concurrency=[1, 4],
    output_len=16,
    input_len=8,
)


def level(target: str, concurrency: int, tok_s: float, failures: int = 0) -> Level:
    """`concurrency` requests of `tok_s` tokens each in five evenly spaced chunks, over a one-second window."""
    results = [
        RequestResult(
            start=0.0,
            end=1.0,
            success=True,
            output_tokens=int(tok_s),
            prompt_tokens=8,
            chunk_times=[0.1, 0.3, 0.5, 0.7, 1.0],
            chunk_tokens=None,
        )
        for _ in range(concurrency)
    ] + [RequestResult(start=0.0, end=0.01, error="HTTP 503: busy") for _ in range(failures)]
    return summarize(target, concurrency, results, results, t0=0.0, t1=1.0)


@pytest.fixture
def run():
    levels = [
        level("speculative", 1, 100),
        level("plain", 1, 90),
        level("speculative", 4, 150),
        level("plain", 4, 200, failures=2),
    ]
    return build_results(METADATA, levels, "speculative", "plain")


def as_json(run) -> dict:
    return json.loads(run.model_dump_json())


def test_results_validate_against_the_packaged_schema(run):
    jsonschema.Draft202012Validator.check_schema(load_schema())
    jsonschema.validate(as_json(run), load_schema())
    assert run.crossover.status == "crossed"
    assert run.crossover.recommended_threshold.switch >= 1


def test_schema_rejects_a_level_without_its_statistics(run):
    data = as_json(run)
    del data["levels"][0]["p99_ttft_ms"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, load_schema())


def test_a_run_without_both_named_targets_says_the_crossover_was_not_computed():
    run = build_results(METADATA, [level("gateway", 1, 100)], "speculative", "plain")
    jsonschema.validate(as_json(run), load_schema())
    assert run.crossover.status == "not_computed"
    assert run.crossover.recommended_threshold is None


def test_write_and_load_round_trip_with_a_csv_row_per_level(tmp_path, run):
    written = write_results(tmp_path / "out", run)
    assert [p.name for p in written] == ["results.json", "results.csv"]
    assert load_results(tmp_path / "out") == run
    with (tmp_path / "out" / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS
    assert [(r["target"], r["concurrency"], r["failed"]) for r in rows] == [
        ("speculative", "1", "0"),
        ("plain", "1", "0"),
        ("speculative", "4", "0"),
        ("plain", "4", "2"),
    ]
    assert json.loads(rows[3]["errors"]) == {"HTTP 503: busy": 2}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not readable as JSON"),
        ('{"schema_version": 2}', "schema_version 1"),
        ('{"schema_version": 1, "levels": []}', "missing 'metadata'"),
        ('{"schema_version": 1, "metadata": {}, "levels": [], "crossover": {}}', "metadata.tool: Field required"),
    ],
)
def test_loading_a_bad_file_names_the_problem(tmp_path, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsError, match=message):
        load_results(path)
