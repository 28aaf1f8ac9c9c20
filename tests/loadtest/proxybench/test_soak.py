"""The memory soak: its verdict from samples, its arguments, and (slow) one short real soak."""

from __future__ import annotations

import subprocess
import sys

import pytest

from crossover.loadtest.proxybench.soak import MIB, judge, report

TOLERANCE = 5 * MIB


def test_each_worker_is_judged_from_the_first_sample_at_the_baseline_to_the_last():
    samples = [
        (0.0, {1: 40 * MIB, 2: 40 * MIB}),
        (60.0, {1: 46 * MIB, 2: 47 * MIB}),
        (120.0, {1: 50 * MIB, 2: 49 * MIB}),
    ]
    verdict = judge(samples, 60.0, TOLERANCE)
    assert verdict.baseline == {1: 46 * MIB, 2: 47 * MIB} and verdict.grown == {1: 4 * MIB, 2: 2 * MIB}
    assert verdict.passed and "PASS" in report(verdict, 1, 2)
    grew = judge([*samples, (180.0, {1: 52 * MIB, 2: 49 * MIB})], 60.0, TOLERANCE)
    assert not grew.passed and "+6.00 MB" in report(grew, 1, 3)


def test_a_replaced_worker_fails_the_soak():
    verdict = judge([(60.0, {1: 40 * MIB, 2: 40 * MIB}), (120.0, {1: 40 * MIB, 3: 30 * MIB})], 60.0, TOLERANCE)
    assert verdict.replaced and not verdict.passed
    assert "gone" in report(verdict, 1, 2) and "(replacement)" in report(verdict, 1, 2)


def soak(*args: str, timeout: float) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.soak", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_baseline_must_come_before_the_end():
    done = soak("--minutes", "1", "--baseline-minutes", "1", timeout=60)
    assert done.returncode == 2 and "--baseline-minutes (1) must be less than --minutes (1)" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_soak_passes_with_every_kind_of_request_answered_as_expected():
    done = soak("--minutes", "1.5", "--baseline-minutes", "0.5", "--sample-s", "10", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "unexpected" not in done.stdout, done.stdout
    workers = done.stdout.rsplit("worker", 1)[1].splitlines()[1:-1]  # the report's lines, one per worker
    assert len(workers) == 2 and all(line.endswith(" MB") for line in workers), done.stdout
