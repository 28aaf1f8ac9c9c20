"""results.json as pydantic models: the one documented output of `crossover bench`, and its JSON Schema.

Field names are SGLang bench_serving's, and stay stable: the stand-in reads results.json as a measured-curve
profile (servers/sim/results.py), and files of earlier runs must still load. New fields get defaults.
`results.schema.json` is generated from these models; regenerate it after changing them:

    python -m crossover.loadtest.models   # rewrites loadtest/results.schema.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from crossover.gateway.policies import PolicyName
from crossover.loadtest.uncertainty import Verdict

SCHEMA_VERSION = 1
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILE = Path(__file__).with_name("results.schema.json")

CrossoverStatus = Literal[
    "crossed",
    "at_or_below_lowest_level",
    "within_noise",
    "not_reached",
    "no_common_levels",
    "not_computed",
    "refused",
    "no_data",
]


class _Model(BaseModel):
    # Unknown fields (from a newer writer) are ignored, so a file loads as long as what we need is there.
    model_config = ConfigDict(extra="ignore")


class Schedule(_Model):
    """A stand-in's own account of keeping up with its schedule (`/server_info` "schedule"); null: not reported."""

    time_scale: float | None = Field(None, description="Profile seconds per wall second.")
    lag_s: float | None = Field(None, description="How far the simulated clock is behind its schedule (seconds).")
    max_lag_s: float | None = Field(None, description="Largest lag seen so far (seconds).")
    speed_ratio: float | None = Field(
        None, description="Simulated seconds advanced / (wall seconds x time_scale) over the recent window; 1 keeps up."
    )
    lagging: bool | None = Field(None, description="The stand-in says it is falling behind its schedule.")


class LevelSchedule(Schedule):
    """The schedule block as read right after one pass of a level of this target."""

    concurrency: int
    pass_index: int | None = Field(None, description="Which pass of the level (from 0); null in older files.")
    rerun: bool = Field(
        False,
        description="A stand-in of the pair fell behind during this pass, so the pass was measured again and "
        "this one's throughput is not in the level; it does not refuse the crossover.",
    )
    level_speed_ratio: float | None = Field(
        None,
        description="Simulated seconds the stand-in advanced during the whole level / (wall seconds x "
        "time_scale), from its clock read right before and right after the level; below 0.9 the level counts "
        "as lagging. Null when the stand-in does not report its clock.",
    )
    held_ratio: float | None = Field(
        None,
        description="Requests the stand-in's engine held over the level (request-seconds, its own count) / "
        "(the level's concurrency x the same wall seconds): below 1 by what the requests spent outside it. "
        "Null when the stand-in does not report the count.",
    )
    schedule_share: float | None = Field(
        None,
        description="The share of its throughput at the level's concurrency the stand-in delivered, read from its "
        "measured curve at the concurrency it held (held_ratio x concurrency); below 0.9 of the best share among "
        "the pass's stand-ins the pass counts as lagging (a lone stand-in is not judged by it). Null where "
        "held_ratio is.",
    )


class Simulation(_Model):
    """What a simulated target (`/server_info` says `"simulated": true`) reported during the run."""

    time_scale: float | None = Field(None, description="The stand-in's --time-scale (null if it did not say).")
    schedule: Schedule | None = Field(None, description="Its schedule block as last read; null if it has none.")
    levels: list[LevelSchedule] = Field(
        default_factory=list,
        description="The schedule block read right after each pass of each level; lagging true (and rerun "
        "false) there means the level's throughput is the stand-in's shortfall, not its profile; all-null "
        "fields mean unknown.",
    )

    def lagging_levels(self) -> set[int]:
        """Levels whose measured passes include one the stand-in fell behind in (passes measured again aside)."""
        return {lv.concurrency for lv in self.levels if lv.lagging and not lv.rerun}


class TargetInfo(_Model):
    url: str
    server_info: dict[str, Any] | None = Field(
        None, description="Selected fields of SGLang's /server_info (null if not offered)."
    )
    simulation: Simulation | None = Field(
        None, description="Set for a simulated target (the crossover stand-in): its time scale and lag."
    )


class Metadata(_Model):
    """How the run was made."""

    tool: str = Field(description="crossover version that wrote the file.")
    started_at: str = Field(description="ISO 8601 UTC.")
    finished_at: str = Field(description="ISO 8601 UTC.")
    command: list[str] = Field(default_factory=list, description="argv of the run.")
    targets: dict[str, TargetInfo] = Field(description="Target name -> where it was and what it said about itself.")
    model: str
    concurrency: list[int] = Field(description="Levels in sweep order.")
    output_len: int = Field(ge=1, description="max_tokens of every request.")
    input_len: int = Field(ge=0, description="Approximate prompt tokens (the real count is in total_input_tokens).")
    ignore_eos: bool = True
    requests_per_level: int | None = Field(
        None,
        description="Measured requests per level as given; null for the default (3 x C, at least 16) or a timed "
        "window.",
    )
    duration_per_level_s: float | None = Field(
        None, description="Length of each level's measurement window when timed; null when counted in requests."
    )
    warmup_rounds: int = Field(
        1, ge=0, description="Unmeasured requests per level before the window opens, in rounds of C."
    )
    passes_per_level: int = Field(
        1,
        ge=1,
        description="Passes each level was measured in, the targets alternating pass by pass (A B B A), each a "
        "warm-up and a window of its share of the level; 1 in files written before passes.",
    )
    lockstep: bool = Field(
        False,
        description="True: all C workers started full-length requests together and stayed in step (bench_serving, "
        "the stand-in's virtual curves); false: the warm-up round had random lengths so workers run out of step, "
        "as independent users do.",
    )
    extra_body: dict[str, Any] = Field(default_factory=dict)
    host: dict[str, Any] = Field(default_factory=dict, description="Where the load generator ran.")


_STAT = {
    "mean": "Mean",
    "median": "Median (p50)",
    "std": "Population standard deviation",
    "p90": "90th percentile",
    "p99": "99th percentile",
}
_METRIC = {
    "ttft_ms": "time to first token: request sent -> first chunk carrying text",
    "tpot_ms": "time per output token: (e2e latency - TTFT) / (output tokens - 1), per request",
    "itl_ms": "inter-token latency per chunk: gap between consecutive text chunks (bench_serving's ITL)",
    "token_itl_ms": "inter-token latency per token: each chunk gap divided over the tokens it carried "
    "(per-chunk usage; evenly spread if the server gives none)",
    "e2e_latency_ms": "end-to-end latency: request sent -> [DONE]",
}


def _latency(stat: str, metric: str) -> Any:
    """A required, nullable latency statistic in milliseconds."""
    return Field(ge=0, description=f"{_STAT[stat]} of {_METRIC[metric]}; ms; null when no request succeeded.")


class Level(_Model):
    """One target at one concurrency, measured over a steady-state window (loadtest/stats.py)."""

    target: str = Field(description="Name given with --target NAME=URL.")
    concurrency: int = Field(
        ge=1, description="Closed-loop level: number of workers sending back to back (bench_serving's max_concurrency)."
    )
    completed: int = Field(
        ge=0,
        description="Successful requests that ended inside the measurement window: HTTP 200, tokens, usage, "
        "no error event, [DONE].",
    )
    failed: int = Field(
        ge=0,
        description="Failed requests that ended inside the window: HTTP errors, SSE error events, streams cut "
        "before [DONE], timeouts, connection errors.",
    )
    duration_s: float = Field(
        ge=0,
        description="Length of the steady-state measurement window: from the end of the warm-up round to the "
        "last measured request (or the timed window).",
    )
    request_throughput: float = Field(ge=0, description="completed / duration_s (req/s).")
    input_throughput: float = Field(ge=0, description="total_input_tokens / duration_s (tok/s).")
    output_throughput: float = Field(
        ge=0,
        description="Output tokens that arrived inside the window (per-chunk usage; requests still running count "
        "their part) / duration_s (tok/s): the curve the crossover is found on.",
    )
    output_throughput_interval: tuple[float, float] | None = Field(
        None,
        description="95% interval of output_throughput (tok/s): batch means over equal sub-windows of the "
        "measurement window (loadtest/uncertainty.py); null in files written before it was measured.",
    )
    pass_output_throughputs: list[float] | None = Field(
        None,
        description="output_throughput of each pass's window, in run order, when the level was measured in "
        "several passes (the targets alternating pass by pass); null for one pass and in older files.",
    )
    total_input_tokens: int = Field(ge=0, description="Sum of usage.prompt_tokens over the successful requests.")
    total_output_tokens: int = Field(ge=0, description="Output tokens that arrived inside the window.")
    measured_concurrency: float = Field(
        ge=0,
        description="Time requests spent in flight inside the window / duration_s: the load the server actually "
        "saw (bench_serving's 'concurrency').",
    )
    mean_tokens_per_chunk: float | None = Field(
        ge=0, description="Output tokens per streamed text chunk inside the window; above 1 on a speculative server."
    )
    accept_length: float | None = Field(
        None,
        ge=1,
        description="Tokens per speculative step (the bonus token included) the engine reported during the level, "
        "read from its /metrics as the gateway reads it: vLLM's spec_decode counters between the start and the end "
        "of each pass, SGLang's sglang:spec_accept_length gauge as it ends; the mean over the passes. Null: the "
        "engine reported none (no speculation, or no /metrics).",
    )
    mean_ttft_ms: float | None = _latency("mean", "ttft_ms")
    median_ttft_ms: float | None = _latency("median", "ttft_ms")
    std_ttft_ms: float | None = _latency("std", "ttft_ms")
    p90_ttft_ms: float | None = _latency("p90", "ttft_ms")
    p99_ttft_ms: float | None = _latency("p99", "ttft_ms")
    mean_tpot_ms: float | None = _latency("mean", "tpot_ms")
    median_tpot_ms: float | None = _latency("median", "tpot_ms")
    std_tpot_ms: float | None = _latency("std", "tpot_ms")
    p90_tpot_ms: float | None = _latency("p90", "tpot_ms")
    p99_tpot_ms: float | None = _latency("p99", "tpot_ms")
    mean_itl_ms: float | None = _latency("mean", "itl_ms")
    median_itl_ms: float | None = _latency("median", "itl_ms")
    std_itl_ms: float | None = _latency("std", "itl_ms")
    p90_itl_ms: float | None = _latency("p90", "itl_ms")
    p99_itl_ms: float | None = _latency("p99", "itl_ms")
    mean_token_itl_ms: float | None = _latency("mean", "token_itl_ms")
    median_token_itl_ms: float | None = _latency("median", "token_itl_ms")
    std_token_itl_ms: float | None = _latency("std", "token_itl_ms")
    p90_token_itl_ms: float | None = _latency("p90", "token_itl_ms")
    p99_token_itl_ms: float | None = _latency("p99", "token_itl_ms")
    mean_e2e_latency_ms: float | None = _latency("mean", "e2e_latency_ms")
    median_e2e_latency_ms: float | None = _latency("median", "e2e_latency_ms")
    std_e2e_latency_ms: float | None = _latency("std", "e2e_latency_ms")
    p90_e2e_latency_ms: float | None = _latency("p90", "e2e_latency_ms")
    p99_e2e_latency_ms: float | None = _latency("p99", "e2e_latency_ms")
    errors: dict[str, int] = Field(description="Failure reason -> count (the most frequent reasons).")
    error_kinds: dict[str, int] = Field(
        default_factory=dict,
        description="Failure kind (an httpx error's class such as ReadError, `HTTP 503`, `timeout`, `cut before "
        "[DONE]`, ...) -> count, every failure counted; empty in files written before kinds were counted.",
    )
    first_errors: dict[str, str] = Field(
        default_factory=dict,
        description="Failure kind -> the message of the first failure of that kind in the window (for an "
        "httpx error: the cause underneath it and what the kind usually means).",
    )


class Evidence(_Model):
    """Both targets at one concurrency they were both measured at."""

    concurrency: int
    speculative_output_throughput: float
    plain_output_throughput: float
    plain_over_speculative: float | None = None
    margin: float | None = Field(
        None,
        description="tok/s: plain - speculative must exceed this (either way) to tell them apart here "
        "(combined 95% intervals, at least the resolution); null for exact curves.",
    )
    verdict: Verdict | None = Field(
        None,
        description="Which target is clearly ahead at this level; tie: within the margin; no_data: a target "
        "completed nothing here, so the level is left out of the crossover and the thresholds.",
    )
    speculative_failed: int = 0
    plain_failed: int = 0


class RecommendedThreshold(_Model):
    """Threshold for each gateway policy (PUT /admin/threshold)."""

    switch: int | None = Field(
        ge=0,
        description="For the switch policy: speculative while total in-flight < threshold; ceil(crossover) - 1. "
        "Null when the curves are within noise around the crossover (status within_noise).",
    )
    spillover: int = Field(
        ge=0,
        description="For the spillover policy: the speculative pool's in-flight cap with the best worst-case "
        "efficiency over the measured levels.",
    )


# One field for each of the gateway's policies, named as the policy (apply.py looks a gateway's policy up by name).
assert set(RecommendedThreshold.model_fields) == set(get_args(PolicyName)), "a policy without its threshold"


class Crossover(_Model):
    """Where the plain target's output_throughput first meets the speculative one's (see loadtest/crossover.py
    for the method and the threshold reasoning)."""

    concurrency: float | None = Field(
        ge=0,
        description="Interpolated crossover concurrency (log C); null if plain never met speculative in range, "
        "or if it was refused (see reason).",
    )
    recommended_threshold: RecommendedThreshold | None = Field(
        description="Null when no speculative/plain pair was benchmarked, or the crossover was refused."
    )
    speculative: str | None = Field(description="Target treated as the speculative pool.")
    plain: str | None = Field(description="Target treated as the plain pool.")
    status: CrossoverStatus
    bracket: tuple[int, int] | None = Field(
        None, description="Grid levels the crossover lies between (within_noise: the range too close to call)."
    )
    interval: tuple[float, float] | None = Field(
        None,
        description="Where the crossover lies for sure: from the last level where speculative is clearly ahead "
        "(beyond the margin) to the first where plain is (at_or_below_lowest_level: from 1). Null unless status "
        "is crossed or at_or_below_lowest_level.",
    )
    spillover_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="For the spillover policy, with its threshold: the share of the requests in flight the "
        "speculative pool also takes above the threshold (the gateway's spillover_share); 0: the threshold alone. "
        "Null where no threshold is recommended, and in files from before it was fitted.",
    )
    spillover_worst_case_efficiency: float | None = Field(
        None,
        description="Lowest predicted routed/best-split throughput over the measured levels at the spillover "
        "threshold and share.",
    )
    evidence: list[Evidence]
    reason: str | None = Field(
        None,
        description="Why no crossover is named although both curves were measured: refused (a stand-in fell "
        "behind its schedule during a level of the pair), within_noise (the curves are too close to call) or "
        "no_data (no level where both targets completed a request); otherwise which levels had no data.",
    )


class Queueing(_Model):
    """Consecutive levels of one target where throughput stayed flat (< x1.05) while median TTFT grew (>= x2):
    requests waiting for a running slot, e.g. SGLang's running-request cap."""

    target: str
    from_concurrency: int
    to_concurrency: int
    throughput_gain: float
    ttft_growth: float


class Results(_Model):
    """One `crossover bench` run: a closed-loop concurrency sweep of one or more OpenAI-compatible targets,
    measured per level over a steady-state window, with the crossover between a speculative and a plain target.
    Level fields are named and defined as in SGLang's bench_serving (loadtest/stats.py states where the window
    differs)."""

    model_config = ConfigDict(title="crossover bench results")

    schema_version: Literal[1] = SCHEMA_VERSION
    metadata: Metadata
    levels: list[Level] = Field(
        description="One entry per target and concurrency, in run order (levels interleaved across targets)."
    )
    crossover: Crossover
    queueing: list[Queueing] = Field(default_factory=list)


def results_schema() -> dict[str, Any]:
    """The JSON Schema of results.json, as committed in loadtest/results.schema.json."""
    return {"$schema": SCHEMA_DIALECT, **Results.model_json_schema()}


def render_schema() -> str:
    return json.dumps(results_schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render_schema())
    print(f"wrote {SCHEMA_FILE}", file=sys.stderr)
