"""Where the plain target's throughput meets the speculative one's, and the threshold each policy should use.

Pure functions over measured curves {concurrency: output tok/s}; no I/O.

**Crossover.** d(C) = plain(C) - speculative(C) at every concurrency both targets measured. The crossover is
the first grid level where d >= 0, refined by interpolating d linearly in log C between that level and the
one before (sweeps are log-spaced, 1, 2, 5, 10, 30, ...). If plain already meets speculative at the lowest
level the crossover is reported *at* that level (it may lie lower); if it never does, it is null.

**How sure.** Measured curves carry noise (uncertainty.py): at each level plain and speculative are told apart
only when they differ by more than a margin (their combined 95% intervals, and at least the resolution). Levels
inside the margin are ties. A crossover is named only between a level where speculative is clearly ahead and
the next one, where plain clearly is; its interval is those two levels (the interpolated point between them
rests on the curves' shape there, which nothing measured; add levels to narrow it). Ties in between (or at the
top of the sweep) give status `within_noise`: "no clear crossover between C=a and C=b", with no number and no
switch threshold.

**No data is not a verdict.** A level where either target completed nothing has verdict `no_data`: it is
shown, and left out of the crossover and both thresholds (a 0 there is the absence of a measurement, not a
throughput of 0 - read as one, a speculative server that failed at C=1 made plain "clearly ahead" and the
switch threshold 0, "never speculate"). With no level where both completed something the status is `no_data`
and nothing is recommended.

**switch** (time-shared pools: all traffic goes to one configuration). The gateway sends a new request to
the speculative pool while the total in-flight count it sees is below the threshold T. In a closed loop at
level C a new request sees the C - 1 others, so level C is speculative iff C - 1 < T, i.e. C <= T. Speculation
pays below the crossover C*, so T = ceil(C*) - 1: every level strictly below C* speculative, every level at
or above it plain. With no crossover in range, T = the highest level measured (speculate everywhere we
have evidence for); with a crossover at the lowest level, T = that level - 1.

**spillover** (partitioned pools: both serve at once). The speculative pool holds x = min(C, max(T, ceil(s C)))
requests - the threshold T, or its share s of the load where that is more (gateway/policies/route.py) - and the
plain pool the rest, so the pair delivers R(C) = S(x) + P(C - x). No threshold alone is best at every load: a
small T wastes the speculative GPUs at high load, a large one leaves the plain pool idle at moderate load (real
vLLM's curves on CPU: the best split puts 2 of 4 streams on the speculative server and 16 of 64; the best T alone
serves 85 % of it at 64, a share of 0.35 at least 99 % at every level). We pick the (T, s) that maximises the
worst case over the measured levels of R(C) / B(C), where B(C) = max_k S(k) + P(C - k) is the best split any
router could make, with S and P interpolated linearly in log C between measurements (0 at C = 0, flat beyond the
last level); shares in steps of SHARE_STEP, and among equal worst cases no share (the threshold alone, simplest to
reason about), then the best mean, then the smallest T. The worst-case efficiency is reported.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from crossover.loadtest.models import Crossover, CrossoverStatus, Evidence, Level, RecommendedThreshold
from crossover.loadtest.uncertainty import DEFAULT_RESOLUTION, NO_DATA, Verdict, margin, verdict

Curve = Mapping[int, float]


@dataclass
class Found:
    """Where two curves cross: the concurrency (None if they do not or cannot be told to), its bracketing
    levels, a 95% interval for it, and the per-level evidence."""

    concurrency: float | None = None
    bracket: tuple[int, int] | None = None
    status: CrossoverStatus = "no_common_levels"
    evidence: list[Evidence] = field(default_factory=list)
    interval: tuple[float, float] | None = None


def common_levels(speculative: Curve, plain: Curve) -> list[int]:
    return sorted(set(speculative) & set(plain))


def _log_crossing(lo: int, hi: int, d_lo: float, d_hi: float) -> float:
    """Where d, linear in log C from d_lo < 0 at lo to d_hi >= 0 at hi, is 0."""
    fraction = -d_lo / (d_hi - d_lo)  # 0 < fraction <= 1
    return math.exp(math.log(lo) + fraction * (math.log(hi) - math.log(lo)))


def find_crossover(
    speculative: Curve, plain: Curve, margins: Mapping[int, float] | None = None, no_data: Collection[int] = ()
) -> Found:
    """Crossover concurrency (or None), its bracketing grid levels, its interval and the per-level evidence.

    `margins[C]`: how far apart the curves must be at C to tell them apart (uncertainty.py); without them the
    curves are exact (virtual-time curves) and plain meeting speculative counts as crossing. `no_data`: levels
    where a target completed nothing - shown with verdict no_data, judged nowhere.
    """
    measured = common_levels(speculative, plain)
    margin = {c: (margins or {}).get(c, 0.0) for c in measured}
    verdicts: dict[int, Verdict] = {}
    for c in measured:
        judged = NO_DATA if c in no_data else verdict(speculative[c], plain[c], margin[c])
        verdicts[c] = "plain" if margins is None and judged == "tie" else judged
    evidence = [
        Evidence(
            concurrency=c,
            speculative_output_throughput=speculative[c],
            plain_output_throughput=plain[c],
            plain_over_speculative=plain[c] / speculative[c] if speculative[c] > 0 and c not in no_data else None,
            margin=margin[c] if margins is not None and c not in no_data else None,
            verdict=verdicts[c],
        )
        for c in measured
    ]
    levels = [c for c in measured if c not in no_data]
    if not levels:
        return Found(evidence=evidence, status="no_data" if measured else "no_common_levels")
    first_plain = next((i for i, c in enumerate(levels) if verdicts[levels[i]] == "plain"), None)
    end = len(levels) if first_plain is None else first_plain
    last_speculative = next((i for i in range(end - 1, -1, -1) if verdicts[levels[i]] == "speculative"), None)
    ties_before = end - (0 if last_speculative is None else last_speculative + 1)
    if ties_before:
        # Within noise over a range: where inside it plain overtakes cannot be told from these measurements.
        low = levels[0 if last_speculative is None else last_speculative]
        high = levels[-1] if first_plain is None else levels[first_plain]
        return Found(bracket=(low, high), status="within_noise", evidence=evidence)
    if first_plain is None:
        return Found(status="not_reached", evidence=evidence)
    c = levels[first_plain]
    if first_plain == 0:
        return Found(float(c), (c, c), "at_or_below_lowest_level", evidence, interval=(1.0, float(c)))
    lo = levels[first_plain - 1]
    crossing = _log_crossing(lo, c, plain[lo] - speculative[lo], plain[c] - speculative[c])
    # What the measurements establish is the bracket: speculative clearly ahead at lo, plain clearly at c. The
    # point inside it is an interpolation whose error (the curves' shape between levels) no margin measures.
    return Found(crossing, (lo, c), "crossed", evidence, interval=(float(lo), float(c)))


def switch_threshold(crossover: float | None, levels: list[int]) -> int:
    if crossover is None:
        return max(levels) if levels else 0
    return max(math.ceil(crossover) - 1, 0)


def interpolate(curve: Curve, n: float) -> float:
    """Throughput at concurrency n: 0 at n = 0, linear in log C between measured levels, flat past the last."""
    points = sorted(curve.items())
    if n <= 0 or not points:
        return 0.0
    first_c, first_v = points[0]
    if n <= first_c:
        return first_v * n / first_c
    for (c0, v0), (c1, v1) in itertools.pairwise(points):
        if n <= c1:
            t = (math.log(n) - math.log(c0)) / (math.log(c1) - math.log(c0))
            return v0 + t * (v1 - v0)
    return points[-1][1]


SHARE_STEP = 0.05


def spillover_held(concurrency: int, threshold: int, share: float) -> int:
    """What the speculative pool holds of a closed loop of `concurrency` under spillover (T, share)."""
    return min(concurrency, max(threshold, math.ceil(share * concurrency - 1e-9)))


@dataclass(frozen=True)
class Spillover:
    threshold: int
    share: float
    efficiency: float | None  # the worst case over the measured levels, against the best split


def spillover_threshold(speculative: Curve, plain: Curve) -> Spillover:
    """The spillover policy's threshold and share with the best worst-case efficiency over the measured levels."""
    levels = common_levels(speculative, plain)
    if not levels:
        return Spillover(0, 0.0, None)
    top = max(levels)
    s = [interpolate({c: speculative[c] for c in levels}, k) for k in range(top + 1)]
    p = [interpolate({c: plain[c] for c in levels}, k) for k in range(top + 1)]
    best = {c: max(s[k] + p[c - k] for k in range(c + 1)) for c in levels}
    shares = [round(i * SHARE_STEP, 4) for i in range(round(1 / SHARE_STEP) + 1)]

    def ranked(option: tuple[int, float]) -> tuple[float, bool, float, int]:
        threshold, share = option
        ratios = []
        for c in levels:
            held = spillover_held(c, threshold, share)
            ratios.append((s[held] + p[c - held]) / best[c] if best[c] > 0 else 1.0)
        # Worst case first; among equals (common on a coarse grid) no share, the best mean, the smallest threshold.
        return min(ratios), share == 0.0, sum(ratios) / len(ratios), -threshold

    options = [(threshold, share) for share in shares for threshold in range(top + 1)]
    threshold, share = max(options, key=lambda option: (ranked(option), -option[1]))
    return Spillover(threshold, share, ranked((threshold, share))[0])


def no_data_levels(levels: Sequence[Level], speculative: str, plain: str) -> dict[int, list[str]]:
    """Concurrency -> the targets of the pair that completed nothing there (a level with no data)."""
    empty: dict[int, list[str]] = {}
    for lv in levels:
        if lv.target in (speculative, plain) and lv.completed == 0:
            empty.setdefault(lv.concurrency, []).append(lv.target)
    return empty


def analyse(levels: Sequence[Level], speculative: str, plain: str, resolution: float = DEFAULT_RESOLUTION) -> Crossover:
    """The `crossover` object of results.json from the `levels` entries of two named targets."""
    by = {(lv.target, lv.concurrency): lv for lv in levels}
    empty = no_data_levels(levels, speculative, plain)
    curves = {
        name: {lv.concurrency: lv.output_throughput for lv in levels if lv.target == name}
        for name in (speculative, plain)
    }
    margins = {
        c: margin(
            by[speculative, c].output_throughput,
            by[plain, c].output_throughput,
            by[speculative, c].output_throughput_interval,
            by[plain, c].output_throughput_interval,
            resolution,
        )
        for c in common_levels(curves[speculative], curves[plain])
    }
    found = find_crossover(curves[speculative], curves[plain], margins, no_data=empty)
    # Only levels with data on both sides inform either threshold.
    with_data = {name: {c: v for c, v in curve.items() if c not in empty} for name, curve in curves.items()}
    spill = spillover_threshold(with_data[speculative], with_data[plain])
    measured = common_levels(with_data[speculative], with_data[plain])
    for row in found.evidence:
        row.speculative_failed = by[speculative, row.concurrency].failed
        row.plain_failed = by[plain, row.concurrency].failed
    # Too close to call: any switch threshold inside the range serves about as well, so none is named.
    switch = None if found.status == "within_noise" else switch_threshold(found.concurrency, measured)
    recommended = None if found.status == "no_data" else RecommendedThreshold(switch=switch, spillover=spill.threshold)
    reasons = [_within_noise_reason(found)] if found.status == "within_noise" else []
    if empty and set(empty) & set(common_levels(curves[speculative], curves[plain])):
        reasons.append(_no_data_reason(empty, found.status == "no_data"))
    return Crossover(
        concurrency=found.concurrency,
        interval=found.interval,
        recommended_threshold=recommended,
        speculative=speculative,
        plain=plain,
        status=found.status,
        bracket=found.bracket,
        spillover_share=None if recommended is None else spill.share,
        spillover_worst_case_efficiency=None if recommended is None else spill.efficiency,
        evidence=found.evidence,
        reason="; ".join(reasons) or None,
    )


def _no_data_reason(empty: Mapping[int, list[str]], nothing_left: bool) -> str:
    levels = ", ".join(f"C={c} ({' and '.join(names)} completed nothing)" for c, names in sorted(empty.items()))
    if nothing_left:
        return f"no data: no level where both targets completed a request - {levels}; nothing is recommended"
    return f"no data at {levels}: left out of the crossover and the thresholds"


def _within_noise_reason(found: Found) -> str:
    assert found.bracket is not None
    ties = [row.concurrency for row in found.evidence if row.verdict == "tie"]
    return (
        f"no clear crossover between C={found.bracket[0]} and C={found.bracket[1]}: the curves are within noise "
        f"at C = {', '.join(map(str, ties))} (see each level's margin)"
    )
