"""The rate table `crossover bench` writes beside results.json, and the acceptance each engine reported per level.

    write_rate_table(out_dir, results)           # rate-table.json, after results.json
    before = await read_metrics(client, target, headers); ...; after = await read_metrics(...)
    pass_acceptance(before, after)               # the engine's accept length over the pass (None: not said)

`[adaptive] table = "rate-table.json"` loads it (gateway/policies/adaptive.py `BenchTable.from_file`), as it loads a
results.json. Per target: output tok/s with its 95% interval by concurrency x input-length bucket (the gateway's
prompt-length buckets, gateway/backends/rates.py), the requests it rests on, the accept length the engine reported
during that level, and what the adaptive model needs beside (the mean time to first token, output tokens per
request). A level that completed nothing is a row with `tokens_per_s` null: no data, never a point.

The acceptance is read the way the gateway reads it (gateway/engines adapters, `acceptance`): the engine's /metrics
right before and right after each pass - vLLM's spec_decode counters as 1 + accepted / drafts between the two,
SGLang's `sglang:spec_accept_length` gauge as the pass ends - and a level's is the mean over its passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from crossover.gateway.backends import PROMPT_NAMES, prompt_bucket
from crossover.gateway.engines import adapter
from crossover.gateway.policies import RATE_TABLE_KIND
from crossover.loadtest.models import Results
from crossover.loadtest.plan import Target

RATE_TABLE_JSON = "rate-table.json"
METRICS_TIMEOUT_S = 5.0
# Tried in this order: vLLM's counters need the reading before; SGLang's gauge is read after.
ENGINES = ("vllm", "sglang")


async def read_metrics(client: httpx.AsyncClient, target: Target, headers: dict[str, str]) -> str | None:
    """The target's /metrics text (None: it has none, or did not answer in time - the level has no acceptance)."""
    try:
        response = await client.get(target.base_url + "/metrics", headers=headers, timeout=METRICS_TIMEOUT_S)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return response.text


def pass_acceptance(before: str | None, after: str | None) -> float | None:
    """The accept length the engine reported over a pass, read as the gateway reads it (module docstring)."""
    if after is None:
        return None
    for name in ENGINES:
        read = adapter(name).acceptance
        try:
            start = read(before, None) if before is not None else None
            reading = read(after, start)
        except (ValueError, TypeError, AttributeError):
            continue  # not Prometheus text
        if reading is not None and reading.accept_length is not None:
            return reading.accept_length
    return None


def rate_table(results: Results) -> dict:
    """rate-table.json's content (module docstring)."""
    meta = results.metadata
    targets: dict[str, list[dict]] = {}
    for level in results.levels:
        prompt = level.total_input_tokens / level.completed if level.completed else meta.input_len
        measured = level.completed > 0 and level.output_throughput > 0
        targets.setdefault(level.target, []).append(
            {
                "concurrency": level.concurrency,
                "prompt_tokens": PROMPT_NAMES[prompt_bucket(round(prompt))],
                "tokens_per_s": round(level.output_throughput, 3) if measured else None,
                "interval": None
                if not measured or level.output_throughput_interval is None
                else [round(x, 3) for x in level.output_throughput_interval],
                "requests": level.completed,
                "accept_length": level.accept_length,
                "mean_ttft_ms": level.mean_ttft_ms,
                "output_tokens_per_request": round(level.total_output_tokens / level.completed, 3)
                if level.completed
                else None,
            }
        )
    cross = results.crossover
    return {
        "kind": RATE_TABLE_KIND,
        "speculative": cross.speculative,
        "plain": cross.plain,
        "model": meta.model,
        "input_len": meta.input_len,
        "output_len": meta.output_len,
        "written_at": meta.finished_at,
        "targets": targets,
    }


def write_rate_table(out_dir: Path, results: Results) -> Path:
    path = out_dir / RATE_TABLE_JSON
    path.write_text(json.dumps(rate_table(results), indent=2) + "\n")
    return path
