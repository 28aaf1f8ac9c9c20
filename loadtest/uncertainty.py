"""How sure a level's throughput is, and when two curves are too close to call.

**A level's interval: batch means.** Each pass's measurement window is cut into BATCHES equal sub-windows and
the output throughput measured in each; over the n sub-windows of all passes the interval is mean +-
t(0.975, n - 1) x sd / sqrt(n). This is the standard estimate for the steady-state output of a simulation or a
closed loop, whose successive requests are correlated (each finish starts the next one), so resampling single
requests would understate it. The passes alternate the targets (runner.py), so a machine whose speed drifts
during a level spreads every target's sub-windows - a wider interval - rather than favouring whichever target
ran while it was fast.

**Resolution.** No sweep on a shared machine resolves arbitrarily small differences, however steady each
level looks: the stand-in is deterministic (its batch means may agree to 0.1%), and against real servers
`crossover bench` and SGLang's own `bench_serving` agreed only within 3.5% on the same pair, and beside two CPU
burners on 2 cores a pair of stand-ins 0.4% apart once read 2.1% apart with both passes agreeing (a load
generator's late resends, which no interval of one run sees). So two targets at one level are told apart only
when they differ by more than their combined interval *and* by more than DEFAULT_RESOLUTION of the larger one;
otherwise the level is a tie ("within noise").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from crossover.gateway.modes import Mode

# Sub-windows per level for the batch-means interval: enough for a usable sd, few enough that each holds
# several requests' worth of tokens at the default window.
BATCHES = 5
# Two-sided 95% Student t quantiles by degrees of freedom (no scipy needed for a handful of values).
_T_975 = {
    **{1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262},
    **{10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101},
    **{19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052},
    **{28: 2.048, 29: 2.045},
}
# Relative difference below which two throughputs at one level are not told apart.
DEFAULT_RESOLUTION = 0.03

# Which mode's target is clearly ahead at a level, or neither; "no_data": a target completed nothing there, so
# the level says nothing either way (never an interval of [0, 0], never a lead for the other).
NO_DATA = "no_data"
Verdict = Literal[Mode, "tie", "no_data"]


def batch_means_interval(batch_throughputs: Sequence[float]) -> tuple[float, float] | None:
    """95% interval of the mean of per-sub-window throughputs; None with fewer than two sub-windows."""
    n = len(batch_throughputs)
    if n < 2:
        return None
    mean = math.fsum(batch_throughputs) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in batch_throughputs) / (n - 1))
    half = _T_975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return max(mean - half, 0.0), mean + half


def half_width(value: float, interval: tuple[float, float] | None) -> float:
    """The larger distance from `value` to its interval's ends (0 when unknown)."""
    if interval is None:
        return 0.0
    return max(value - interval[0], interval[1] - value, 0.0)


def margin(
    speculative: float,
    plain: float,
    speculative_interval: tuple[float, float] | None,
    plain_interval: tuple[float, float] | None,
    resolution: float = DEFAULT_RESOLUTION,
) -> float:
    """How far apart plain - speculative must be at a level before it says anything."""
    statistical = math.hypot(half_width(speculative, speculative_interval), half_width(plain, plain_interval))
    return max(statistical, resolution * max(speculative, plain))


def verdict(speculative: float, plain: float, level_margin: float) -> Verdict:
    d = plain - speculative
    if d > level_margin:
        return "plain"
    if d < -level_margin:
        return "speculative"
    return "tie"
