"""Summaries of one level (one target at one concurrency), named and defined as SGLang's `bench_serving`.

A level is measured over a steady-state window [t0, t1]: after a warm-up round (so the synchronised first
wave's prefill is not in it) and before the load tester cancels what is still running (so there is no drain
tail, when fewer than C requests are in flight). This is how GuideLLM and genai-perf measure and how the
stand-in computes its virtual curves; with few requests per level it matters (3 waves with a drain tail
under-read a speculative server by ~10%).

- requests that finished inside the window count as `completed` / `failed`, and only the successful ones
  give latencies, so a failing server cannot look fast
- `output_throughput` = output tokens that *arrived* in the window (from per-chunk usage) / `duration_s`
  (= t1 - t0), counting successful requests, never failed ones, and the requests still running when the
  window closed weighted by the success rate of those that ended (whether they would have failed is
  unknown; a server that fails every request delivers nothing) - bench_serving divides the tokens of all
  successes by the whole run instead
- `tpot_ms` = (e2e latency - TTFT) / (output tokens - 1), per request with more than one token
- `itl_ms` = gaps between text chunks (bench_serving's ITL); `token_itl_ms` spreads each gap over the tokens
  that chunk carried, one sample per token - a speculative server sends several tokens per chunk, so its
  chunk ITL overstates the time per token and its token ITL does not
- `output_throughput_interval` = a 95% interval for it, from batch means over sub-windows (uncertainty.py)
- `measured_concurrency` = time requests spent in flight within the window / `duration_s`
- percentiles (median, p90, p99) interpolate linearly between closest ranks, as numpy does (percentile.py)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from crossover.loadtest.client import RequestResult
from crossover.loadtest.models import Level
from crossover.loadtest.percentile import percentiles
from crossover.loadtest.uncertainty import BATCHES, batch_means_interval

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "token_itl_ms", "e2e_latency_ms")
MAX_ERROR_KINDS = 10  # distinct failure reasons kept per level


def describe(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean_/median_/std_/p90_/p99_<name> in milliseconds; None when there is no sample."""
    if not values_s:
        return {f"{stat}_{name}": None for stat in ("mean", "median", "std", "p90", "p99")}
    values = [v * 1000.0 for v in values_s]
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    median, p90, p99 = percentiles(values, (50, 90, 99))
    return {f"mean_{name}": mean, f"median_{name}": median, f"std_{name}": std, f"p90_{name}": p90, f"p99_{name}": p99}


def chunk_token_counts(result: RequestResult, fallback_per_chunk: float) -> list[float]:
    """Tokens each text chunk carried: from per-chunk usage, else the request's own average, else the level's."""
    if result.chunk_tokens is not None:
        return [float(k) for k in result.chunk_tokens]
    chunks = len(result.chunk_times)
    per_chunk = result.output_tokens / chunks if result.success and chunks else fallback_per_chunk
    return [per_chunk] * chunks


def token_gaps(result: RequestResult) -> list[float]:
    """Per-token inter-token latencies of one request (seconds): each chunk gap split over its tokens."""
    counts = chunk_token_counts(result, 1.0)
    out: list[float] = []
    for gap, tokens in zip(result.chunk_gaps, counts[1:], strict=False):
        if result.chunk_tokens is None:
            out.append(gap / max(tokens, 1.0))  # an estimate: one sample per chunk
        else:
            tokens = max(int(tokens), 1)
            out.extend([gap / tokens] * tokens)
    return out


@dataclass(frozen=True)
class Window:
    """One measured window of a level: every request it started, and those that ended inside [t0, t1]."""

    started: Sequence[RequestResult]
    ended: Sequence[RequestResult]
    t0: float
    t1: float


def summarize(
    target: str,
    concurrency: int,
    results: Sequence[RequestResult],
    ended: Sequence[RequestResult],
    t0: float,
    t1: float,
) -> Level:
    """One `levels[]` entry of results.json from one window.

    `results`: every request the level started; `ended`: those that finished inside the window [t0, t1].
    """
    return summarize_passes(target, concurrency, [Window(results, ended, t0, t1)])


def summarize_passes(target: str, concurrency: int, windows: Sequence[Window]) -> Level:
    """One `levels[]` entry from the windows of its passes (bench alternates the targets pass by pass): their
    requests and tokens pooled over their summed duration, and the interval from every pass's sub-windows, so
    a machine that changed speed between passes widens it (uncertainty.py)."""
    duration = max(math.fsum(w.t1 - w.t0 for w in windows), 1e-9)
    ended = [r for w in windows for r in w.ended]
    ok = [r for r in ended if r.success]
    ok_chunks = sum(len(r.chunk_times) for r in ok)
    level_per_chunk = sum(r.output_tokens for r in ok) / ok_chunks if ok_chunks else 1.0

    # A failed request's tokens never reached a user as an answer; an unfinished one's count as likely as not.
    unfinished_weight = len(ok) / len(ended) if ended else 1.0
    output_tokens = 0.0
    in_flight = 0.0
    window_chunks = 0.0
    batch_rates: list[float] = []  # output tok/s per sub-window of every pass, for the interval
    pass_rates: list[float] = []
    for window in windows:
        t0, t1 = window.t0, window.t1
        span = max(t1 - t0, 1e-9)
        batches = [0.0] * BATCHES  # output tokens per sub-window
        for r in window.started:
            in_flight += max(0.0, min(r.end, t1) - max(r.start, t0))
            weight = 1.0 if r.success else unfinished_weight if r.cancelled else 0.0
            if not weight:
                continue
            counts = chunk_token_counts(r, level_per_chunk)
            arrived = [(t, k) for t, k in zip(r.chunk_times, counts, strict=False) if t0 < t <= t1]
            for t, k in arrived:
                batches[min(int((t - t0) / span * BATCHES), BATCHES - 1)] += weight * k
            window_chunks += weight * len(arrived)
        output_tokens += math.fsum(batches)
        batch_rates += [b * BATCHES / span for b in batches]
        pass_rates.append(math.fsum(batches) / span)
    input_tokens = sum(r.prompt_tokens for r in ok)

    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for r in ok:
        ttft = r.ttft or 0.0
        samples["ttft_ms"].append(ttft)
        samples["e2e_latency_ms"].append(r.latency)
        if r.output_tokens > 1:
            samples["tpot_ms"].append((r.latency - ttft) / (r.output_tokens - 1))
        samples["itl_ms"].extend(r.chunk_gaps)
        samples["token_itl_ms"].extend(token_gaps(r))

    level: dict = {
        "target": target,
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(ended) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        # Nothing completed: no data, not a throughput known to be 0 (an interval of [0, 0] would read as one).
        "output_throughput_interval": batch_means_interval(batch_rates) if ok else None,
        "pass_output_throughputs": pass_rates if len(windows) > 1 else None,
        "total_input_tokens": input_tokens,
        "total_output_tokens": round(output_tokens),
        "measured_concurrency": in_flight / duration,
        "mean_tokens_per_chunk": output_tokens / window_chunks if window_chunks else None,
    }
    for name in LATENCY_METRICS:
        level.update(describe(name, samples[name]))
    failures = sorted((r for r in ended if not r.success), key=lambda r: r.end)
    level["errors"] = dict(Counter(r.error for r in failures).most_common(MAX_ERROR_KINDS))
    level["error_kinds"] = dict(Counter(r.error_kind or "other" for r in failures).most_common())
    first: dict[str, str] = {}
    for r in failures:
        first.setdefault(r.error_kind or "other", r.error)
    level["first_errors"] = first
    return Level.model_validate(level)
