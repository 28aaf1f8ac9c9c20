"""How fast this machine runs now, measured, so that real-engine start-up waits scale with it, not a constant.

    budget = StartupBudget.measure(IDLE_START_S, "the vLLM server")   # seconds a start may take here, now
    wait_started(url + "/health", proc, budget)                       # AssertionError naming the budget when out

A start of a real engine on CPU is mostly single-threaded Python (imports, the model's set-up, a warm-up): on
an idle 2-core host it takes about a minute, and the same start beside other work took 15 min (issue 42: a
machine at load 17-58). No constant fits both, so the wait is what an idle reference host needs, divided by the
speed measured on a fixed piece of single-threaded work just before the start; at its end the speed is measured
again, and a machine that became slower meanwhile extends the wait once. A faster host keeps the reference's
wait: the work measures one core's arithmetic, not a start's imports and disk, and CI's host measured 2.74 and
then needed more than 180 / 2.74 = 66 s to start a server it had started in 53 s a minute earlier. A host so slow
that the budget would pass CEILING_S is told so at once instead of being waited on.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass

from crossover.servers.process import NotReady, wait_ready

# The work's median seconds on the reference host, idle (2-core AMD EPYC, AVX2 only; measured: 0.15-0.19 s).
REFERENCE_WORK_S = 0.17
WORK_ITERATIONS = 1_000_000
SAMPLES = 5
# No start is waited on longer than this, however slow the machine: past it the host cannot run these tests in
# a CI's time, and the test says so (the tests' pytest-timeout backstops sit above it). Measured here: real vLLM
# started in 483 s at a measured speed of 0.34 and in 640 s at 0.71 (the load rose from 10 to 30 meanwhile).
CEILING_S = 2700.0


def _work() -> float:
    began = time.perf_counter()
    total = 0
    for i in range(WORK_ITERATIONS):
        total += i * i % 7
    return time.perf_counter() - began


def machine_speed() -> float:
    """The reference host's time for the work over this host's, now (the median of SAMPLES runs): 1.0 on the
    reference host idle, 0.25 where it runs four times slower (a slower CPU, or cores shared with other work)."""
    return REFERENCE_WORK_S / statistics.median(_work() for _ in range(SAMPLES))


@dataclass
class StartupBudget:
    idle_s: float  # what the start needs on the reference host, idle, with a margin
    what: str
    speed: float  # measured before the start
    later_speed: float | None = None  # measured again when the first budget ran out

    @classmethod
    def measure(cls, idle_s: float, what: str) -> StartupBudget:
        budget = cls(idle_s, what, machine_speed())
        if budget.seconds >= CEILING_S:
            raise AssertionError(budget.gave_up(waited=False))
        return budget

    @property
    def seconds(self) -> float:
        slowest = min(1.0, self.speed, self.later_speed or self.speed)  # never less than the reference's wait
        return min(CEILING_S, self.idle_s / slowest)

    def extend(self) -> float:
        """Measure again; the seconds more to wait where the machine became slower since the start (else 0)."""
        before = self.seconds
        self.later_speed = machine_speed()
        return self.seconds - before

    def gave_up(self, *, waited: bool = True) -> str:
        speeds = f"{self.speed:.2f}" + (f", then {self.later_speed:.2f}" if self.later_speed is not None else "")
        scaled = (
            f"{self.idle_s:g} s on an idle reference host scaled by this machine's measured speed ({speeds} of that "
            f"host's; tests/host_speed.py), at most {CEILING_S:g} s"
        )
        if not waited:
            return f"{self.what}: not started - this machine is too slow now for a start to end in time ({scaled})"
        return f"{self.what} was not ready within {self.seconds:.0f} s, so the wait gave up: the budget is {scaled}"


def wait_started(
    url: str, proc: subprocess.Popen, budget: StartupBudget, *, json: dict | None = None, since: float | None = None
) -> float:
    """`wait_ready` within the budget counted from `since` (a monotonic time; default now), extended where the
    machine became slower meanwhile; the seconds since `since`. NotReady when the process exits first;
    AssertionError, saying the budget, when it runs out."""
    began = time.monotonic() if since is None else since
    allowed = budget.seconds
    while True:
        try:
            wait_ready(url, proc, max(0.0, began + allowed - time.monotonic()), json=json)
            return time.monotonic() - began
        except NotReady:
            if proc.poll() is not None:
                raise
        more = budget.extend()
        if more <= 0:
            raise AssertionError(budget.gave_up())
        allowed += more
