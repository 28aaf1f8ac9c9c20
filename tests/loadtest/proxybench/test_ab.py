"""The A/B timer: its order and ratios, and one real pair of runs (this checkout against itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from crossover.loadtest.proxybench.ab import Run, order, ratios


def test_runs_alternate_so_neither_build_always_goes_first():
    assert order(3) == ["A", "B", "B", "A", "A", "B"]


def test_ratios_are_b_over_a_pair_by_pair_whichever_ran_first():
    runs = [Run("A", 0.2, 1, 1), Run("B", 0.1, 1, 1), Run("B", 0.3, 1, 1), Run("A", 0.2, 1, 1)]
    assert ratios(runs) == pytest.approx([0.5, 1.5])


def run_ab(*args: str) -> subprocess.CompletedProcess:
    # Its own process, as it is run: the servers it starts write to its stderr, which must be a real file.
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.ab", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)


# A timed window, not a count of requests: a count a fast machine serves in a few ticks of CPU is refused (below),
# a window spends CPU in proportion to its length on any machine.
TIMED = ("--duration", "2", "--warmup", "0.3", "--concurrency", "4")


def test_one_pair_of_real_runs_reports_both_and_their_ratio():
    done = run_ab(sys.executable, sys.executable, "--rounds", "1", *TIMED)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["A", "B"]
    assert all(float(line.split()[1]) > 0 for line in lines[:2])  # CPU per request measured on both sides
    assert "B/A per pair: median" in lines[-1] and "(1 pairs)" in lines[-1]


def test_together_runs_both_gateways_of_a_pair_and_reports_their_ratio():
    # B's Python by a relative path: the gateways run elsewhere, so it must be resolved where ab was started.
    b = os.path.relpath(sys.executable)
    done = run_ab(sys.executable, b, "--together", "--rounds", "2", *TIMED)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["A", "B", "B", "A"]  # the first started alternates
    assert all(float(line.split()[1]) > 0 for line in lines[:4])
    assert "(2 pairs)" in lines[-1]


def test_a_window_too_short_for_procs_clock_ticks_is_a_setup_error_not_a_ratio():
    done = run_ab(sys.executable, sys.executable, "--rounds", "1", "--requests", "3", "--concurrency", "1")
    assert done.returncode == 2, done.stdout
    assert "clock ticks of CPU" in done.stderr and "Traceback" not in done.stderr


def test_a_python_that_cannot_start_is_a_setup_error(tmp_path):
    done = run_ab(sys.executable, str(tmp_path / "no-python"), "--rounds", "1", "--requests", "10")
    assert done.returncode == 2
    assert "proxybench.ab:" in done.stderr
