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


def test_one_pair_of_real_runs_reports_both_and_their_ratio():
    done = run_ab(sys.executable, sys.executable, "--rounds", "1", "--requests", "300", "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["A", "B"]
    assert all(float(line.split()[1]) > 0 for line in lines[:2])  # CPU per request measured on both sides
    assert "B/A per pair: median" in lines[-1] and "(1 pairs)" in lines[-1]


def test_together_runs_both_gateways_of_a_pair_and_reports_their_ratio():
    # B's Python by a relative path: the gateways run elsewhere, so it must be resolved where ab was started.
    b = os.path.relpath(sys.executable)
    done = run_ab(sys.executable, b, "--together", "--rounds", "2", "--requests", "200", "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["A", "B", "B", "A"]  # the first started alternates
    assert all(float(line.split()[1]) > 0 for line in lines[:4])
    assert "(2 pairs)" in lines[-1]


def test_a_python_that_cannot_start_is_a_setup_error(tmp_path):
    done = run_ab(sys.executable, str(tmp_path / "no-python"), "--rounds", "1", "--requests", "10")
    assert done.returncode == 2
    assert "proxybench.ab:" in done.stderr
