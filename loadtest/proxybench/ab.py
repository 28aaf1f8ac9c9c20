"""Two builds of crossover timed against each other on one cell: what a change to the proxy path buys.

    python -m crossover.loadtest.proxybench.ab BEFORE/.venv/bin/python AFTER/.venv/bin/python \
        --kind non-stream --concurrency 32 --rounds 4

Each Python must have the crossover to time installed (a checkout's own venv, `pip install -e .`). One zero
backend serves both; every run starts a fresh gateway and the runs alternate A B B A A B ..., so drift on a
shared machine falls on both alike. It prints each run's CPU per request (the gateway's process tree, from
/proc, as the benchmark measures it), req/s and p50, then the median and range of the per-pair ratios B/A:
below 1 means B costs less.

On a noisy machine one run's CPU per request can move by 15% from the next's. `--together` runs each pair's two
gateways at once instead, each under a load generator of its own, started together (the one started first
alternates too): what the machine does to one it does to the other in the same seconds. The same build against
itself so gave 0.97-1.01 (paced, 128 streams each, 4 pairs), where alternating runs of a paced stream ranged
0.84-1.26. Each gateway then shares the cores with the other's load, so its figures are not the benchmark's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.cli import non_negative_float, positive_float, positive_int
from crossover.loadtest.proxybench.cpu import CLOCK_TICKS
from crossover.loadtest.proxybench.harness import (
    HOST,
    REPO_ROOT,
    STOP_TIMEOUT_S,
    Cell,
    Plan,
    SetupError,
    Target,
    absolute,
    crossover_argv,
    crossover_config,
    run_cell,
    start,
    zerobackend_argv,
)
from crossover.servers import process

KINDS = ("stream", "non-stream", "paced")
# /proc counts CPU in clock ticks (10 ms at the usual 100 Hz): a window that spent fewer than this many is
# rounded by 10% or more, and one that spent none would make the ratio a division by zero.
MIN_CPU_TICKS = 10


@dataclass(frozen=True)
class Run:
    side: str  # "A" or "B"
    cpu_ms_per_request: float
    rps: float
    p50_ms: float


def order(rounds: int) -> list[str]:
    """A B, B A, A B, ...: each pair's two runs as close in time as they can be, neither always first."""
    return [side for r in range(rounds) for side in (("A", "B") if r % 2 == 0 else ("B", "A"))]


def ratios(runs: list[Run]) -> list[float]:
    """B/A of CPU per request, pair by pair (runs as `order` made them)."""
    pairs = [runs[i : i + 2] for i in range(0, len(runs) - 1, 2)]
    out = []
    for pair in pairs:
        by_side = {run.side: run for run in pair}
        out.append(by_side["B"].cpu_ms_per_request / by_side["A"].cpu_ms_per_request)
    return out


def measure(
    pythons: dict[str, str], cell: Cell, plan: Plan, rounds: int, chunk_delay_ms: float, together: bool = False
) -> list[Run]:
    """`rounds` pairs of runs, A and B in `order`; `together`: each pair's two gateways run side by side, each
    under a load generator of its own, both started at once, so the two windows are the same seconds."""
    runs: list[Run] = []
    sides = order(rounds)
    with tempfile.TemporaryDirectory(prefix="proxybench-ab-") as tmp:
        ports = process.free_port(HOST), process.free_port(HOST)
        procs: list[subprocess.Popen] = []
        try:
            start(zerobackend_argv(*ports, chunk_delay_ms), f"http://{HOST}:{ports[0]}", REPO_ROOT, procs)
            config = crossover_config(Path(tmp), f"http://{HOST}:{ports[0]}", f"http://{HOST}:{ports[1]}")
            batches = [sides[i : i + 2] for i in range(0, len(sides), 2)] if together else [[side] for side in sides]
            for batch in batches:
                gateways: list[subprocess.Popen] = []
                try:
                    targets = [_start(pythons[side], config, Path(tmp), gateways) for side in batch]
                    with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
                        reports = list(pool.map(lambda target: run_cell(target, cell, plan), targets))
                finally:
                    process.stop(gateways, STOP_TIMEOUT_S)
                for side, report in zip(batch, reports, strict=True):
                    if report["errors"]:
                        raise SetupError(
                            f"{side} answered {report['errors']} requests with errors: {report['error_kinds']}"
                        )
                    _check_measurable(side, report)
                    run = Run(side, report["cpu_ms_per_request"], report["rps"], report["latency_p50_ms"])
                    runs.append(run)
                    print(
                        f"{side}: {run.cpu_ms_per_request:.4f} CPU ms/request, {run.rps:.0f} req/s, p50 {run.p50_ms} ms"
                    )
        finally:
            process.stop(procs, STOP_TIMEOUT_S)
    return runs


def _check_measurable(side: str, report: dict) -> None:
    """A run whose CPU /proc cannot resolve is a setup error: its ratio would be noise or a division by zero."""
    ticks = round((report["cpu_s"] or 0.0) * CLOCK_TICKS)
    if ticks < MIN_CPU_TICKS:
        raise SetupError(
            f"{side}'s gateway spent {ticks} clock ticks of CPU in the window, under the {MIN_CPU_TICKS} "
            f"(1/{CLOCK_TICKS} s each) a ratio needs: give each run more --duration or --requests"
        )


def _start(python: str, config: Path, cwd: Path, started: list[subprocess.Popen]) -> Target:
    """A fresh gateway of `python`'s build, serving; added to `started` as soon as it runs. `cwd` is not this
    checkout: nothing of it may shadow theirs."""
    port = process.free_port(HOST)
    return start(crossover_argv(python, config, port), f"http://{HOST}:{port}", cwd, started)


def summary(runs: list[Run]) -> str:
    found = ratios(runs)
    median = {side: statistics.median(run.cpu_ms_per_request for run in runs if run.side == side) for side in "AB"}
    p50 = {side: statistics.median(run.p50_ms for run in runs if run.side == side) for side in "AB"}
    return (
        f"CPU ms/request: A {median['A']:.4f}, B {median['B']:.4f}; B/A per pair: median "
        f"{statistics.median(found):.3f}, range {min(found):.3f}-{max(found):.3f} ({len(found)} pairs); "
        f"p50 ms: A {p50['A']}, B {p50['B']}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m crossover.loadtest.proxybench.ab", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("a", help="the Python of build A (the one before)")
    parser.add_argument("b", help="the Python of build B")
    parser.add_argument("--kind", choices=KINDS, default="non-stream")
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=4, help="pairs of runs (default 4)")
    parser.add_argument("--max-tokens", type=positive_int, default=Plan.max_tokens, help="chunks per stream")
    parser.add_argument("--duration", type=positive_float, default=3.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=non_negative_float, default=1.0, help="unmeasured seconds before each")
    parser.add_argument("--requests", type=positive_int, help="a fixed number of requests per run instead")
    parser.add_argument(
        "--paced-delay-ms", type=non_negative_float, default=Plan.paced_delay_ms, help="gap between chunks (paced)"
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run each pair's two gateways at once, each with --concurrency of its own: the same seconds for both",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paced = args.kind == "paced"
    plan = Plan(
        duration=args.duration,
        warmup=args.warmup,
        requests=args.requests,
        paced_duration=args.duration,
        paced_delay_ms=args.paced_delay_ms,
    )
    cell = Cell(args.kind, args.concurrency, args.max_tokens)
    try:
        delay = args.paced_delay_ms if paced else 0.0
        # The gateways run in a scratch directory: a relative path must mean what it meant where this was started.
        pythons = {"A": absolute(args.a), "B": absolute(args.b)}
        runs = measure(pythons, cell, plan, args.rounds, delay, args.together)
    except (SetupError, process.NotReady, subprocess.TimeoutExpired, OSError) as exc:
        print(f"proxybench.ab: {exc}", file=sys.stderr)
        return 2
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
