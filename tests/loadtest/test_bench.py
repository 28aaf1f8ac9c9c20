"""`crossover bench` against live SGLang stand-ins and the real gateway: the issue's must-shows.

1. A sweep of k25-eagle3 vs k25-plain finds a crossover (or a range too close to call) that holds the
   stand-ins' own virtual-time crossover (same input/output lengths).
   The virtual curves run their closed loop in lock-step (all clients start together with equal requests),
   so this sweep does too (`--lockstep`): out of step, the k25-plain stand-in loses up to ~18% to prefill
   interruptions and the two curves no longer describe the same traffic.
2. Through the gateway (switch policy, the recommended threshold, else the virtual one), routed throughput
   at every level is at least 95% of the better direct target at that level. All three targets run in ONE
   sweep, interleaved by level, so the machine's speed cancels out of the ratios, and out of step (the
   default): a gateway that splits the first wave between pools breaks lock-step, so only out-of-step
   direct runs are a fair yardstick.

On the k25 pair the two curves differ by only a few per cent around the crossover (EAGLE-3 wins by ~2% at
one stream), so where exactly plain "meets" speculative is within measurement noise; what is robust, and
what the checks use, is the bracket. At a level that sits at the crossover both pools deliver the same
throughput within that noise, so either routing choice lies on the envelope - the 95% bar is what allows
for it. Throughput is compared as ratios, never as absolute speeds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import jsonschema
import pytest

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings
from crossover.loadtest.crossover import find_crossover
from crossover.loadtest.results import load_schema

# CI: short outputs and a coarse grid on stand-ins running TIME_SCALE x faster than the profile. The
# slow variant below uses the issue's lengths and the deployment's grid.
TIME_SCALE = 5
OUTPUT_LEN = 64
INPUT_LEN = 16
GRID = [1, 4, 16]
ADMIN_TOKEN = "bench-test-token"
INITIAL_THRESHOLD = 1000  # far from any recommendation, so --apply visibly changes it
BENCH_TIMEOUT_S = 240
ENVELOPE = 0.95


def crossover_cli(*argv: str, timeout: float = BENCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """The real `crossover` command in its own process (its CPU is not the gateway's)."""
    return subprocess.run(
        [sys.executable, "-m", "crossover.gateway.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def virtual_curve(profile: str, levels: list[int], output_len: int, input_len: int, *extra: str) -> dict[int, float]:
    """`crossover sim curve` of `profile` (a name or a results.json; `extra`, e.g. `--target plain`)."""
    done = crossover_cli(
        "sim",
        "curve",
        "--profile",
        profile,
        "--concurrency",
        ",".join(map(str, levels)),
        "--output-len",
        str(output_len),
        "--input-len",
        str(input_len),
        *extra,
        "--json",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return {p["concurrency"]: p["output_throughput"] for p in json.loads(done.stdout)}


def stand_ins(sim, time_scale: int):
    return (
        sim("k25-eagle3", "--time-scale", str(time_scale), "--log-level", "warning"),
        sim("k25-plain", "--time-scale", str(time_scale), "--log-level", "warning"),
    )


def switch_gateway(serve, speculative_url: str, plain_url: str):
    settings = Settings(
        policy="switch",
        threshold=INITIAL_THRESHOLD,
        hysteresis=0,
        admin_token=ADMIN_TOKEN,
        log_level="warning",
        pools={"speculative": {"backends": [speculative_url]}, "plain": {"backends": [plain_url]}},
    )
    return serve(create_app(settings))


def bench(
    out,
    targets: dict[str, str],
    grid: list[int],
    output_len: int,
    input_len: int,
    *extra: str,
    timeout: float = BENCH_TIMEOUT_S,
) -> dict:
    argv = [
        "bench",
        "--concurrency",
        ",".join(map(str, grid)),
        "--output-len",
        str(output_len),
        "--input-len",
        str(input_len),
        "--out",
        str(out),
        *extra,
    ]
    for name, url in targets.items():
        argv += ["--target", f"{name}={url}"]
    done = crossover_cli(*argv, timeout=timeout)
    print(done.stdout)  # the evidence, shown when a check fails
    assert done.returncode == 0, done.stderr
    run = json.loads((out / "results.json").read_text())
    jsonschema.validate(run, load_schema())
    for png in ("throughput.png", "latency.png"):
        assert (out / png).stat().st_size > 0
    return run


def check_crossover(run: dict, grid: list[int], output_len: int, input_len: int) -> float:
    """The measured crossover (or the range too close to call) holds the virtual one; returns the virtual one."""
    fine = list(range(1, grid[-1] + 1))
    virtual = find_crossover(
        virtual_curve("k25-eagle3", fine, output_len, input_len),
        virtual_curve("k25-plain", fine, output_len, input_len),
    )
    measured = run["crossover"]
    print(f"crossover: measured {measured['concurrency']} ({measured['status']}), virtual {virtual.concurrency}")
    assert virtual.concurrency is not None, "the stand-ins' curves should cross inside the grid"
    assert measured["status"] in ("crossed", "within_noise"), measured["evidence"]
    low, high = measured["interval"] if measured["status"] == "crossed" else measured["bracket"]
    assert low <= virtual.concurrency <= high, (measured, virtual.concurrency)
    return virtual.concurrency


def check_envelope(run: dict) -> None:
    by = {(lv["target"], lv["concurrency"]): lv for lv in run["levels"]}
    for c in run["metadata"]["concurrency"]:
        best = max(by["speculative", c]["output_throughput"], by["plain", c]["output_throughput"])
        routed = by["routed", c]
        assert routed["failed"] == 0, routed["errors"]
        assert routed["output_throughput"] >= ENVELOPE * best, (
            f"C={c}: routed {routed['output_throughput']:.1f} tok/s < {ENVELOPE:.0%} of the better direct "
            f"target's {best:.1f}"
        )


def run_must_shows(
    sim,
    serve,
    tmp_path,
    time_scale: float,
    grid: list[int],
    output_len: int,
    input_len: int,
    timeout: float = BENCH_TIMEOUT_S,
) -> None:
    speculative, plain = stand_ins(sim, time_scale)
    gateway = switch_gateway(serve, speculative.url, plain.url)
    direct = {"speculative": speculative.url, "plain": plain.url}

    first = bench(tmp_path / "direct", direct, grid, output_len, input_len, "--lockstep", timeout=timeout)
    virtual = check_crossover(first, grid, output_len, input_len)
    # The k25 pair is within a few per cent around its crossover, so the sweep may rightly call it too close;
    # the routed run then uses the profiles' own threshold (--apply is shown in test_bench_uncertainty.py).
    threshold = first["crossover"]["recommended_threshold"]["switch"]
    threshold = math.ceil(virtual) - 1 if threshold is None else threshold
    httpx.put(
        f"{gateway.url}/admin/threshold",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        json={"threshold": threshold},
        timeout=10,
    ).raise_for_status()

    second = bench(
        tmp_path / "routed", {**direct, "routed": f"{gateway.url}/v1"}, grid, output_len, input_len, timeout=timeout
    )
    check_envelope(second)


# Benchmarks: stand-ins at 5x and 10x fall behind on a busy machine (the bench then rightly refuses), and the
# 95% envelope is a throughput ratio between live runs. What CI must see of bench is in
# test_bench_uncertainty.py, on stand-ins that a busy machine cannot push off their profiles.
@pytest.mark.slow
def test_sweep_finds_the_crossover_applies_it_and_the_gateway_rides_the_envelope(sim, serve, tmp_path):
    run_must_shows(sim, serve, tmp_path, TIME_SCALE, GRID, OUTPUT_LEN, INPUT_LEN)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_same_with_the_issues_lengths_and_the_deployments_grid(sim, serve, tmp_path):
    run_must_shows(sim, serve, tmp_path, 10, [1, 2, 5, 10, 30, 70, 100], 512, 256, timeout=1500)
