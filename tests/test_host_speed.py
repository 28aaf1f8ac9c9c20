"""The real-engine tests' start-up waits (tests/host_speed.py) and core claims (tests/host_cores.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from crossover.servers.process import free_port
from tests import host_cores, host_speed
from tests.host_cores import claimed_cores
from tests.host_speed import CEILING_S, StartupBudget, wait_started


def test_the_machine_speed_is_measured_and_positive():
    assert host_speed.machine_speed() > 0


def test_a_budget_scales_with_the_measured_speed(monkeypatch):
    monkeypatch.setattr(host_speed, "machine_speed", lambda: 0.25)
    budget = StartupBudget.measure(100.0, "a server")
    assert budget.seconds == 400.0
    monkeypatch.setattr(host_speed, "machine_speed", lambda: 0.1)  # slower by the time the budget ran out
    assert budget.extend() == 600.0 and budget.seconds == 1000.0
    assert "1000 s" in budget.gave_up() and "0.25, then 0.10" in budget.gave_up()


def test_a_faster_host_keeps_the_reference_hosts_wait(monkeypatch):
    monkeypatch.setattr(host_speed, "machine_speed", lambda: 2.74)  # CI's host, measured: its start took > 66 s
    budget = StartupBudget.measure(180.0, "a server")
    assert budget.seconds == 180.0
    monkeypatch.setattr(host_speed, "machine_speed", lambda: 0.5)  # a slower machine still extends it
    assert budget.extend() == 180.0 and budget.seconds == 360.0


def test_a_machine_too_slow_for_the_ceiling_is_told_so_before_anything_starts(monkeypatch):
    monkeypatch.setattr(host_speed, "machine_speed", lambda: 0.01)
    with pytest.raises(AssertionError, match="too slow now for a start to end in time") as raised:
        StartupBudget.measure(100.0, "a server")
    assert f"at most {CEILING_S:g} s" in str(raised.value)


def test_a_wait_that_runs_out_gives_up_saying_its_budget(monkeypatch):
    speeds = iter([1.0, 0.5, 0.5])  # at the start; slower at the first deadline (extended); the same again
    monkeypatch.setattr(host_speed, "machine_speed", lambda: next(speeds))
    budget = StartupBudget.measure(0.2, "a server that never answers")
    never = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match=r"a server that never answers was not ready within 0 s, so the"):
            wait_started(f"http://127.0.0.1:{free_port()}/health", never, budget)
        assert budget.seconds == pytest.approx(0.4)  # extended once, for the slower machine
    finally:
        never.kill()
        never.wait()


def test_concurrent_runs_claim_different_cores_while_there_are_free_ones(monkeypatch, tmp_path):
    monkeypatch.setattr(host_cores, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(host_cores.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with claimed_cores(2) as first, claimed_cores(2) as second:
        assert sorted(first + second) == [0, 1, 2, 3]
        with claimed_cores(2) as third:  # none free: shared, still two
            assert len(third) == 2
    with claimed_cores(2) as again:  # released when the runs ended
        assert again == [0, 1]
