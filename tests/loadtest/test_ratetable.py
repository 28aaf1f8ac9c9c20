"""`crossover bench` records the acceptance each engine reported during each level (read as the gateway reads it)
and writes rate-table.json, which `[adaptive] table` loads: live stand-ins in SGLang and vLLM mode at a set
acceptance, the real CLI."""

from __future__ import annotations

import json

import jsonschema
import pytest

from crossover.gateway.config import AdaptiveSettings
from crossover.gateway.policies import RATE_TABLE_KIND, BenchTable
from crossover.loadtest.ratetable import pass_acceptance
from crossover.loadtest.results import load_schema
from tests.loadtest.test_bench import crossover_cli

ACCEPT = 1.8  # set on the speculative stand-in; the k25-eagle3 profile's own is 2.4
GRID = [1, 4]
TOLERANCE = 0.2  # the stand-in draws each step's accepted tokens: a level's mean is within this of the setting


def vllm_text(drafts: float, accepted: float) -> str:
    return (
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}\n'
    )


def test_a_pass_reads_vllms_counters_between_its_ends_and_sglangs_gauge_at_its_end():
    # vLLM: 1 + accepted / drafts over the pass, not since the engine started.
    assert pass_acceptance(vllm_text(100, 300), vllm_text(300, 500)) == pytest.approx(2.0)
    assert pass_acceptance(None, vllm_text(300, 500)) is None  # no start: no window
    sglang = '# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{tp_rank="0"} 2.3\n'
    assert pass_acceptance(None, sglang) == pytest.approx(2.3)
    assert pass_acceptance("# nothing\n", "# TYPE x gauge\nx 1\n") is None  # a plain server reports none
    assert pass_acceptance(None, None) is None


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_bench_records_each_levels_acceptance_and_writes_a_rate_table_the_gateway_loads(sim, tmp_path, engine):
    quiet = ("--time-scale", "20", "--log-level", "warning", "--engine", engine)
    speculative = sim("k25-eagle3", *quiet, "--accept-length", str(ACCEPT))
    plain = sim("k25-plain", *quiet)
    out = tmp_path / "run"
    done = crossover_cli(
        "bench", "--concurrency", ",".join(map(str, GRID)), "--output-len", "32", "--input-len", "16",
        "--duration-per-level", "2", "--warmup-rounds", "1", "--no-plots", "--out", str(out),
        "--target", f"speculative={speculative.url}", "--target", f"plain={plain.url}",
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr  # 1: a refused crossover on a busy machine; the file is written
    run = json.loads((out / "results.json").read_text())
    jsonschema.validate(run, load_schema())
    by = {(level["target"], level["concurrency"]): level for level in run["levels"]}
    for c in GRID:
        assert by["speculative", c]["accept_length"] == pytest.approx(ACCEPT, abs=TOLERANCE), by["speculative", c]
        assert by["plain", c]["accept_length"] is None

    table = json.loads((out / "rate-table.json").read_text())
    assert table["kind"] == RATE_TABLE_KIND and (table["speculative"], table["plain"]) == ("speculative", "plain")
    rows = table["targets"]["speculative"]
    assert [row["concurrency"] for row in rows] == GRID
    for row in rows:
        level = by["speculative", row["concurrency"]]
        assert row["prompt_tokens"] == "0-127" and row["requests"] == level["completed"] > 0
        assert row["tokens_per_s"] == pytest.approx(level["output_throughput"], rel=1e-3)
        assert row["accept_length"] == level["accept_length"]

    # The gateway loads it, the bench's acceptance from the table (no bench_accept_length needed).
    loaded = AdaptiveSettings(enabled=True, table=out / "rate-table.json").bench_table()
    assert isinstance(loaded, BenchTable)
    assert loaded.accept_length == pytest.approx(ACCEPT, abs=TOLERANCE)
    assert loaded.prefill_s > 0 and loaded.output_tokens == pytest.approx(32, abs=1)
    from_results = BenchTable.from_results(run)
    for mode in ("speculative", "plain"):
        for c in GRID:
            assert loaded.rates.throughput(mode, c) == pytest.approx(from_results.rates.throughput(mode, c), rel=1e-3)
