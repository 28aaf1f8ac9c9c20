"""The load generator accounts for every request it sends: successes, HTTP errors, dead servers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from crossover.loadtest.proxybench.loadgen import LoadSpec, merge, run_load
from crossover.servers.process import free_port
from tests.loadtest.zero_server import running_zero

BOUND_S = 60.0


@pytest.fixture(scope="module")
def zero_url():
    with running_zero() as urls:
        yield urls[0]


def load(spec: LoadSpec) -> dict:
    return asyncio.run(asyncio.wait_for(run_load(spec), BOUND_S))


@pytest.mark.parametrize("stream", [True, False])
def test_fixed_count_is_fully_accounted(zero_url, stream):
    report = load(LoadSpec(zero_url, concurrency=3, stream=stream, max_tokens=4, requests=25))
    assert (report["sent"], report["ok"], report["errors"], report["completed"]) == (25, 25, 0, 25)
    assert report["rps"] > 0
    assert 0 < report["latency_p50_ms"] <= report["latency_p99_ms"]
    assert 0 < report["ttfc_p50_ms"] <= report["latency_p99_ms"]


def test_timed_window_counts_only_what_completes_inside_it(zero_url):
    report = load(LoadSpec(zero_url, concurrency=2, stream=True, max_tokens=4, duration=0.5, warmup=0.2))
    assert report["window_s"] == 0.5
    assert report["sent"] == report["ok"] > report["completed"] > 0  # warm-up requests are sent, not counted
    assert report["errors"] == 0


def test_cpu_of_a_process_tree_is_reported_per_request(zero_url):
    # The load generator measures itself here (run_load runs in this process): it surely spends CPU.
    report = load(LoadSpec(zero_url, concurrency=2, stream=True, max_tokens=16, requests=400, cpu_pid=os.getpid()))
    assert report["cpu_s"] > 0
    assert report["cpu_ms_per_request"] == round(report["cpu_s"] * 1000.0 / 400, 4) or (
        abs(report["cpu_ms_per_request"] - report["cpu_s"] * 1000.0 / 400) < 0.01
    )
    assert load(LoadSpec(zero_url, concurrency=1, stream=False, requests=3))["cpu_ms_per_request"] is None


def test_http_errors_are_counted_by_kind(zero_url):
    # The zero backend refuses max_tokens beyond its limit with a 400.
    report = load(LoadSpec(zero_url, concurrency=2, stream=True, max_tokens=10**9, requests=6))
    assert (report["sent"], report["ok"], report["errors"]) == (6, 0, 6)
    assert report["error_kinds"] == {"http 400": 6}
    assert report["latency_p50_ms"] is None


def test_a_dead_server_is_errors_not_a_hang():
    report = load(LoadSpec(f"http://127.0.0.1:{free_port()}", concurrency=2, stream=False, requests=4))
    assert (report["sent"], report["ok"], report["errors"]) == (4, 0, 4)


def test_cli_prints_one_json_report(zero_url):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "crossover.loadtest.proxybench.loadgen",
            "--url",
            zero_url,
            "--requests",
            "5",
            "--stream",
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] == 5


def test_cli_rejects_nonsense():
    done = subprocess.run(
        [sys.executable, "-m", "crossover.loadtest.proxybench.loadgen", "--url", "http://x", "--concurrency", "0"],
        capture_output=True,
        check=False,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 2 and "--concurrency" in done.stderr


def test_generators_given_one_start_share_one_window_and_merge_into_one_report(zero_url):
    # Two generators in this process, as two processes would run: one start on the shared monotonic clock.
    start_at = time.monotonic() + 0.3
    specs = [
        LoadSpec(zero_url, 2, False, 4, duration=0.6, warmup=0.2, start_at=start_at, samples=True, cpu_pid=pid)
        for pid in (os.getpid(), None)
    ]

    async def both() -> list[dict]:
        return await asyncio.wait_for(asyncio.gather(*(run_load(spec) for spec in specs)), BOUND_S)

    reports = asyncio.run(both())
    assert all(len(r["latency_s"]) == len(r["ttfc_s"]) == r["completed"] > 0 for r in reports)
    merged = merge(reports)
    assert merged["window_s"] == 0.6 and merged["processes"] == 2 and merged["concurrency"] == 4
    assert merged["completed"] == sum(r["completed"] for r in reports) and merged["errors"] == 0
    assert merged["rps"] == round(reports[0]["rps"] + reports[1]["rps"], 1)
    pooled = sorted(value for r in reports for value in r["latency_s"])
    assert pooled[0] * 1000 <= merged["latency_p50_ms"] <= merged["latency_p99_ms"] <= pooled[-1] * 1000
    # CPU from the one that measured it, over every generator's requests in the window.
    assert merged["cpu_s"] == reports[0]["cpu_s"] and reports[1]["cpu_s"] is None
    assert merged["cpu_ms_per_request"] == round(merged["cpu_s"] * 1000 / (merged["rps"] * 0.6), 4)
    assert "latency_s" not in merged and len(merged["load_cores"]) == 2
