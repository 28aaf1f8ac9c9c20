"""When a time-shared GPU set should switch between its speculative and plain configuration.

A pure decision with the clock injected: plain data in (load samples, the current mode and since when, the
switch's measured cost, settings), a `SwitchDecision` out. No I/O, no hidden state, so the live switch
controller (gateway/topology/switching/controller.py) and the virtual-time replay (`crossover sim replay`) run the same
code.

    settings = PolicySettings(threshold=32, hysteresis=8, min_dwell_s=60, window_s=30)
    # (the gateway and `crossover sim replay` build theirs from config.SwitchSettings: .policy(), .switcher())
    cost = SwitchCost(prior_s=240.0)                # a restart of a big model: minutes
    phases = PhaseHistory()
    samples: deque[LoadSample] = deque()            # trim to the window yourself (window_samples helps)

    # every sampling period (a steady period: the statistic is a median over samples, not a time average)
    samples.append(LoadSample(t=now, load=in_flight + queued))
    phases = phases.observe(window_load(samples, now, settings.window_s), now, settings)
    decision = decide(samples, now=now, mode=mode, mode_since=mode_since, switch_cost_s=cost.estimate_s,
                      settings=settings, phases=phases)
    if decision.switch:
        ...                                         # drain, switch, verify; then, success or not:
        cost = cost.observe(measured_duration_s)    # from the decision until the new mode serves again

The rules, in order (the first that applies gives the reason, a constant below, usable as a metric label):
1. `no_samples`: nothing in the window, stay.
2. The window's load is its median (one spike or one idle sample moves nothing). The load calls for plain
   from `threshold` up and for speculative only below `threshold - hysteresis`; in between the current mode
   holds (`within_band`), so a load hovering at the threshold never flaps. If the load calls for the current
   mode: `load_fits_mode`.
3. `dwell`: the current mode has not been held for `min_dwell_s` yet.
4. Weigh the switch. Staying serves r_old tok/s over the expected rest of the phase H; switching serves
   nothing for the switch's cost c, then r_new: switch only if (r_new - r_old) x (H - c) > r_old x c, i.e.
   the tokens gained after the switch beat the tokens lost while switching (`gain_below_cost` otherwise;
   `no_gain` when the rate model says the other mode is not faster at this load). A restart of minutes is
   not worth a 10-second burst; a sleep/wake of seconds is.
5. Switch: `load_above_threshold` (to plain) or `load_below_band` (to speculative).

H, the expected rest of the phase: `settings.expected_phase_s` if set, else the mean length of the load
phases seen so far (`PhaseHistory`, `prior_phase_s` until one has ended), minus the time the current phase
has lasted - but never less than that time (a phase that has lasted long is expected to last as long
again, so a wrong estimate cannot hold the wrong mode forever).

r_old and r_new come from a `RateModel`: `ThresholdRates` (the default) knows only the threshold and says
the mode it calls for is `advantage` faster; `CurveRates` interpolates measured or simulated throughput
curves (`CurveRates.from_levels` reads the levels of a `crossover bench` results.json; `crossover sim replay`
builds them from the stand-in's profiles).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from crossover.gateway.modes import MODES, PLAIN, SPECULATIVE, Mode

# Reasons (stable strings: metric labels and log messages).
NO_SAMPLES = "no_samples"
LOAD_FITS_MODE = "load_fits_mode"
WITHIN_BAND = "within_band"
DWELL = "dwell"
NO_GAIN = "no_gain"
GAIN_BELOW_COST = "gain_below_cost"
LOAD_ABOVE_THRESHOLD = "load_above_threshold"
LOAD_BELOW_BAND = "load_below_band"
REASONS = (
    NO_SAMPLES,
    LOAD_FITS_MODE,
    WITHIN_BAND,
    DWELL,
    NO_GAIN,
    GAIN_BELOW_COST,
    LOAD_ABOVE_THRESHOLD,
    LOAD_BELOW_BAND,
)

DEFAULT_WINDOW_S = 30.0
DEFAULT_MIN_DWELL_S = 60.0
# Until a phase has been seen to end: what an operator's traffic phases (a working day's peaks) tend to be.
DEFAULT_PRIOR_PHASE_S = 600.0
# ThresholdRates: how much faster the mode the threshold calls for is assumed to be (k25 measures ~3-6%,
# llama8b-h200 10-60%: measure yours and give curves instead).
DEFAULT_ADVANTAGE = 0.1
# Weight of the newest measurement in the running switch-cost and phase-length estimates.
DEFAULT_EWMA_ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The load at time `t`: requests in flight plus requests queued (in the gateway and the server)."""

    t: float
    load: float


class RateModel(Protocol):
    def throughput(self, mode: Mode, load: float) -> float:
        """Output tok/s of `mode` at `load` requests (any unit, as long as both modes use the same)."""
        ...


@dataclass(frozen=True, slots=True)
class ThresholdRates:
    """Only the threshold known: the mode it calls for is `advantage` faster than the other, at any load."""

    threshold: float
    advantage: float = DEFAULT_ADVANTAGE

    def __post_init__(self) -> None:
        if not self.advantage > 0:
            raise ValueError(f"advantage must be > 0, got {self.advantage}")

    def throughput(self, mode: Mode, load: float) -> float:
        better = PLAIN if load >= self.threshold else SPECULATIVE
        return 1.0 + self.advantage if mode == better else 1.0


@dataclass(frozen=True, slots=True)
class CurveRates:
    """Aggregate throughput per mode as (load, tok/s) points, linear between them, flat beyond the ends.

    CurveRates.from_points(speculative=[(1, 96), (48, 340)], plain=[(1, 93), (100, 360)])
    """

    speculative: tuple[tuple[float, float], ...]
    plain: tuple[tuple[float, float], ...]

    @classmethod
    def from_points(
        cls, *, speculative: Iterable[tuple[float, float]], plain: Iterable[tuple[float, float]]
    ) -> CurveRates:
        return cls(_curve(speculative, SPECULATIVE), _curve(plain, PLAIN))

    @classmethod
    def from_levels(cls, levels: Iterable[Mapping[str, Any]], *, speculative: str, plain: str) -> CurveRates:
        """From `crossover bench` results (the `levels` of a parsed results.json): each target's
        `output_throughput` per `concurrency`; levels without completed requests are skipped."""
        points: dict[str, list[tuple[float, float]]] = {speculative: [], plain: []}
        for level in levels:
            target, throughput = level.get("target"), level.get("output_throughput")
            if target in points and level.get("completed") and isinstance(throughput, int | float) and throughput > 0:
                points[target].append((level["concurrency"], throughput))
        return cls.from_points(speculative=points[speculative], plain=points[plain])

    def __post_init__(self) -> None:
        _curve(self.speculative, SPECULATIVE)
        _curve(self.plain, PLAIN)

    def throughput(self, mode: Mode, load: float) -> float:
        points = self.speculative if mode == SPECULATIVE else self.plain
        xs = [x for x, _ in points]
        if load <= xs[0]:
            return points[0][1]
        if load >= xs[-1]:
            return points[-1][1]
        i = bisect.bisect_right(xs, load) - 1
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        return y0 + (y1 - y0) * (load - x0) / (x1 - x0)

    def crossover(self) -> float | None:
        """The lowest load (among both curves' points) from which plain is at least as fast, if any."""
        loads = sorted({x for x, _ in self.speculative} | {x for x, _ in self.plain})
        for load in loads:
            if self.throughput(PLAIN, load) >= self.throughput(SPECULATIVE, load):
                return load
        return None


def _curve(points: Iterable[tuple[float, float]], name: str) -> tuple[tuple[float, float], ...]:
    curve = tuple(sorted((float(x), float(y)) for x, y in points))
    if not curve:
        raise ValueError(f"{name} curve: needs at least one (load, throughput) point")
    xs = [x for x, _ in curve]
    if len(set(xs)) != len(xs):
        raise ValueError(f"{name} curve: two points at the same load")
    if any(not (math.isfinite(y) and y > 0) or x < 0 for x, y in curve):
        raise ValueError(f"{name} curve: loads must be >= 0 and throughputs finite and > 0")
    return curve


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The decision's inputs. The gateway's are `config.SwitchSettings.policy()`: its defaults are these."""

    threshold: float
    hysteresis: float = 0.0
    min_dwell_s: float = DEFAULT_MIN_DWELL_S
    window_s: float = DEFAULT_WINDOW_S
    # Fixed expected phase length; None = learn it (PhaseHistory), with prior_phase_s until a phase ends.
    expected_phase_s: float | None = None
    prior_phase_s: float = DEFAULT_PRIOR_PHASE_S
    # None = ThresholdRates(threshold).
    rates: RateModel | None = None

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.hysteresis < 0:
            raise ValueError(f"threshold and hysteresis must be >= 0, got {self.threshold}, {self.hysteresis}")
        if self.hysteresis and self.hysteresis >= self.threshold:
            raise ValueError(f"hysteresis ({self.hysteresis}) must be less than threshold ({self.threshold}), or 0")
        if self.min_dwell_s < 0 or not self.window_s > 0 or not self.prior_phase_s > 0:
            raise ValueError("min_dwell_s must be >= 0, window_s and prior_phase_s > 0")
        if self.expected_phase_s is not None and not self.expected_phase_s > 0:
            raise ValueError(f"expected_phase_s must be > 0, got {self.expected_phase_s}")

    @property
    def rate_model(self) -> RateModel:
        return self.rates if self.rates is not None else ThresholdRates(self.threshold)

    def called_for(self, load: float, mode: Mode) -> Mode:
        """The mode the load calls for, with the hysteresis band holding `mode`."""
        if load >= self.threshold:
            return PLAIN
        if load < self.threshold - self.hysteresis:
            return SPECULATIVE
        return mode


@dataclass(frozen=True, slots=True)
class SwitchDecision:
    """`mode` is the mode to be in: a switch when it differs from the current one (`switch`)."""

    mode: Mode
    switch: bool
    reason: str
    load: float | None = None  # the window's statistic (median)
    remaining_s: float | None = None  # expected rest of the phase (H)
    gain: float = 0.0  # tokens gained after the switch over H, in the rate model's unit x seconds
    loss: float = 0.0  # tokens lost while switching


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """Running estimate of a switch's duration: the prior until the first measurement, then an EWMA.

    Measure from the decision until the new mode serves again (drain + switch + verify): all of it is time
    in which the GPUs do not serve the load at the new mode's rate.
    """

    prior_s: float
    alpha: float = DEFAULT_EWMA_ALPHA
    estimate_s: float = field(default=-1.0)
    measurements: int = 0

    def __post_init__(self) -> None:
        if self.prior_s < 0 or not 0 < self.alpha <= 1:
            raise ValueError(f"prior_s must be >= 0 and alpha in (0, 1], got {self.prior_s}, {self.alpha}")
        if self.estimate_s < 0:
            object.__setattr__(self, "estimate_s", self.prior_s)

    def observe(self, duration_s: float) -> SwitchCost:
        if not (duration_s >= 0 and math.isfinite(duration_s)):
            raise ValueError(f"a switch duration must be finite and >= 0, got {duration_s}")
        # The first measurement replaces the prior outright: it is worth more than any guess.
        estimate = (
            duration_s if not self.measurements else self.estimate_s + self.alpha * (duration_s - self.estimate_s)
        )
        return replace(self, estimate_s=estimate, measurements=self.measurements + 1)


@dataclass(frozen=True, slots=True)
class PhaseHistory:
    """Which side of the threshold the load is on (with the hysteresis band), since when, and the mean
    length (EWMA) of the phases that have ended. Feed it the window's load each sampling period."""

    alpha: float = DEFAULT_EWMA_ALPHA
    side: Mode | None = None
    since: float | None = None
    mean_s: float | None = None
    ended: int = 0

    def observe(self, load: float | None, now: float, settings: PolicySettings) -> PhaseHistory:
        if load is None:
            return self
        if self.side is None:
            return replace(self, side=settings.called_for(load, SPECULATIVE), since=now)
        side = settings.called_for(load, self.side)
        if side == self.side:
            return self
        assert self.since is not None
        length = now - self.since
        mean = length if self.mean_s is None else self.mean_s + self.alpha * (length - self.mean_s)
        return replace(self, side=side, since=now, mean_s=mean, ended=self.ended + 1)

    def remaining_s(self, now: float, expected_s: float) -> float:
        age = max(now - self.since, 0.0) if self.since is not None else 0.0
        return max(expected_s - age, age)


def window_samples(samples: Iterable[LoadSample], now: float, window_s: float) -> list[LoadSample]:
    """The samples in (now - window_s, now]."""
    start = now - window_s
    return [s for s in samples if start < s.t <= now]


def window_load(samples: Iterable[LoadSample], now: float, window_s: float) -> float | None:
    """The window's load: the median of its samples (None without any)."""
    loads = [s.load for s in window_samples(samples, now, window_s)]
    return statistics.median(loads) if loads else None


def decide(
    samples: Sequence[LoadSample],
    *,
    now: float,
    mode: Mode,
    mode_since: float,
    switch_cost_s: float,
    settings: PolicySettings,
    phases: PhaseHistory | None = None,
) -> SwitchDecision:
    """Stay in `mode` or switch (see the module docstring for the rules and reasons).

    `mode_since` is when the current mode started serving (-math.inf: long ago); `switch_cost_s` the
    expected duration of a switch (`SwitchCost.estimate_s`); `phases` the load's phase history, for the
    expected rest of the phase (without it: the expected phase length, whole).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    load = window_load(samples, now, settings.window_s)
    if load is None:
        return SwitchDecision(mode, False, NO_SAMPLES)
    target = settings.called_for(load, mode)
    if target == mode:
        in_band = settings.threshold - settings.hysteresis <= load < settings.threshold
        return SwitchDecision(mode, False, WITHIN_BAND if in_band and mode == PLAIN else LOAD_FITS_MODE, load)
    if now - mode_since < settings.min_dwell_s:
        return SwitchDecision(mode, False, DWELL, load)

    expected = settings.expected_phase_s
    if expected is None:
        expected = phases.mean_s if phases is not None and phases.mean_s is not None else settings.prior_phase_s
    remaining = phases.remaining_s(now, expected) if phases is not None else expected
    rates = settings.rate_model
    r_old, r_new = rates.throughput(mode, load), rates.throughput(target, load)
    cost = max(switch_cost_s, 0.0)
    gain = (r_new - r_old) * max(remaining - cost, 0.0)
    loss = r_old * cost
    if r_new <= r_old:
        return SwitchDecision(mode, False, NO_GAIN, load, remaining, gain, loss)
    if gain <= loss:
        return SwitchDecision(mode, False, GAIN_BELOW_COST, load, remaining, gain, loss)
    reason = LOAD_ABOVE_THRESHOLD if target == PLAIN else LOAD_BELOW_BAND
    return SwitchDecision(target, True, reason, load, remaining, gain, loss)


class Switcher:
    """The policy's stepper: load samples in, a decision out. Pure (no I/O, the clock passed in), so the live
    controller (gateway/topology/switching/controller.py) and the replay (`crossover sim replay`) run this very code.

        switcher = Switcher(SwitchCost(prior_s=240.0))
        switcher.observe(now, load, settings)        # every sampling period, whatever the GPU set is doing
        decision = switcher.decide(now, mode=mode, mode_since=since, settings=settings)  # when free to switch
        switcher.switched(duration_s)                # a switch that succeeded: what it really cost
    """

    def __init__(self, cost: SwitchCost) -> None:
        self.cost = cost
        self.phases = PhaseHistory()
        self.samples: deque[LoadSample] = deque()

    def observe(self, now: float, load: float, settings: PolicySettings) -> None:
        """One sample: trim the window to (now - window_s, now] and follow the load's phases."""
        self.samples.append(LoadSample(now, load))
        while self.samples and self.samples[0].t <= now - settings.window_s:
            self.samples.popleft()
        self.phases = self.phases.observe(window_load(self.samples, now, settings.window_s), now, settings)

    def decide(self, now: float, *, mode: Mode, mode_since: float, settings: PolicySettings) -> SwitchDecision:
        return decide(
            self.samples,
            now=now,
            mode=mode,
            mode_since=mode_since,
            switch_cost_s=self.cost.estimate_s,
            settings=settings,
            phases=self.phases,
        )

    def switched(self, duration_s: float) -> None:
        """Only switches that succeeded teach the cost: a failed one says nothing about what a switch takes."""
        self.cost = self.cost.observe(duration_s)
