"""Level statistics: bench_serving's definitions over a steady-state window; failures never look fast."""

from __future__ import annotations

import pytest

from crossover.loadtest.client import RequestResult
from crossover.loadtest.stats import LATENCY_METRICS, summarize, token_gaps


def ok(start: float, times: list[float], tokens: list[int] | None, total: int | None = None) -> RequestResult:
    """A successful request whose text chunks arrived at `times` carrying `tokens` each."""
    return RequestResult(
        start=start,
        end=times[-1],
        success=True,
        output_tokens=total if total is not None else sum(tokens),
        prompt_tokens=10,
        chunk_times=times,
        chunk_tokens=tokens,
    )


def failed(start: float, end: float, error: str) -> RequestResult:
    return RequestResult(start=start, end=end, success=False, error=error)


def test_token_gaps_split_each_chunk_gap_over_its_tokens():
    r = ok(0, [0.1, 0.4, 1.0], [1, 3, 3])
    assert token_gaps(r) == pytest.approx([0.1] * 3 + [0.2] * 3)


def test_token_gaps_without_per_chunk_usage_spread_tokens_evenly():
    r = ok(0, [0.1, 0.4, 1.0], None, total=6)  # two tokens per chunk
    assert token_gaps(r) == pytest.approx([0.15, 0.3])


def test_window_counts_requests_that_ended_in_it_and_tokens_that_arrived_in_it():
    results = [
        ok(0.0, [0.5, 1.0], [1, 1]),  # warm-up: ended before the window
        ok(0.5, [1.5, 2.0, 2.5], [1, 2, 2]),  # inside
        ok(1.0, [2.0, 3.0, 3.5], [1, 2, 2]),  # straddles the end: only its first two chunks count
        failed(2.0, 2.001, "HTTP 503: busy"),
        failed(2.1, 2.102, "HTTP 503: busy"),
        RequestResult(
            start=1.2,
            end=2.8,
            error="stream error event: 503: queue full",
            output_tokens=0,
            chunk_times=[1.4, 2.4],
            chunk_tokens=[1, 2],
        ),  # its tokens never count
    ]
    results[2].cancelled = True  # cut by the load tester at the window's end: neither success nor failure
    level = summarize("t", 3, results, [results[i] for i in (1, 3, 4, 5)], t0=1.0, t1=3.0)
    assert (level.completed, level.failed) == (1, 3)
    assert level.duration_s == pytest.approx(2.0)
    assert level.total_output_tokens == 5 + 3
    assert level.output_throughput == pytest.approx(4.0)
    assert level.request_throughput == pytest.approx(0.5)
    assert level.mean_ttft_ms == pytest.approx(1000.0)  # the failures are not in it
    assert level.mean_tpot_ms == pytest.approx(250.0)  # (2.0 - 1.0) / (5 - 1)
    assert level.mean_itl_ms == pytest.approx(500.0)
    assert level.mean_token_itl_ms == pytest.approx(250.0)
    assert level.mean_tokens_per_chunk == pytest.approx(8 / 5)
    # In flight inside [1, 3]: 1.5 + 2.0 + 0.001 + 0.002 + 1.6 seconds.
    assert level.measured_concurrency == pytest.approx(5.103 / 2.0)
    assert level.errors == {"HTTP 503: busy": 2, "stream error event: 503: queue full": 1}


def test_a_window_where_everything_failed_has_no_latencies_and_no_throughput():
    results = [failed(0, 0.01 * i, "boom") for i in range(1, 5)]
    level = summarize("t", 2, results, results, t0=0.0, t1=0.04)
    assert (level.completed, level.failed, level.output_throughput) == (0, 4, 0.0)
    for name in LATENCY_METRICS:
        assert getattr(level, f"median_{name}") is None


def test_a_level_where_nothing_completed_has_no_interval_not_zero_to_zero():
    from crossover.loadtest.client import RequestResult
    from crossover.loadtest.stats import Window, summarize_passes

    failed = [RequestResult(success=False, error="HTTP 500", start=0.1 * i, end=0.1 * i + 0.05) for i in range(5)]
    level = summarize_passes("speculative", 1, [Window(failed, failed, 0.0, 1.0)])
    assert (level.completed, level.failed) == (0, 5)
    assert level.output_throughput_interval is None
