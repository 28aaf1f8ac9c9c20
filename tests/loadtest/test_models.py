"""results.json's models: the committed schema is generated from them, and files of earlier runs still load."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from crossover.loadtest.models import SCHEMA_FILE, Results, render_schema, results_schema
from crossover.loadtest.results import load_results, load_schema

OLD_RUN = Path(__file__).with_name("data") / "results-v1.json"  # written by the hand-validated version


def test_the_committed_schema_is_what_the_models_generate():
    # On failure: python -m crossover.loadtest.models (rewrites loadtest/results.schema.json), then commit it.
    assert SCHEMA_FILE.read_text() == render_schema()
    assert load_schema() == results_schema()
    jsonschema.Draft202012Validator.check_schema(load_schema())


def test_a_results_file_of_an_earlier_version_loads_and_writes_back_the_same_fields():
    old = json.loads(OLD_RUN.read_text())
    run = load_results(OLD_RUN)
    assert run.crossover.status == "crossed" and run.crossover.recommended_threshold is not None
    assert [q.target for q in run.queueing] == ["speculative"]
    again = json.loads(run.model_dump_json())
    # Only new optional fields are added; everything the old file had comes back unchanged, in the same order.
    assert _old_part(again, old) == old
    jsonschema.validate(again, load_schema())


def test_what_a_run_writes_validates_against_the_schema_and_reads_back_equal(tmp_path):
    run = Results.model_validate_json(OLD_RUN.read_text())
    path = tmp_path / "results.json"
    path.write_text(run.model_dump_json(indent=2))
    jsonschema.validate(json.loads(path.read_text()), load_schema())
    assert load_results(path) == run


def _old_part(new, old):
    """`new` restricted to the keys `old` has (recursively)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: _old_part(new[k], old[k]) for k in new if k in old}
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [_old_part(n, o) for n, o in zip(new, old, strict=True)]
    return new
