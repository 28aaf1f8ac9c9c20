"""`crossover sim replay --mechanism adaptive`: two pools routed by a threshold that the gateway's own adaptive
controller moves every window at the trace's live acceptance, in virtual time; beside it the best fixed threshold
and the per-window oracle.

    result = replay_adaptive(setup, with_accept_drop(trace, at_s=3600, accept_length=1.6))
    result.adaptive.best_fixed_tokens, result.adaptive.oracle_tokens, result.adaptive.settled

What it runs:
- The decision is `gateway/policies/adaptive.py`'s `decide` - the function the live controller calls - at the end
  of every `[adaptive] window` seconds of virtual time, with `[adaptive]`'s limits (`setup.adaptive`: a gateway
  config's, else the gateway's defaults), at the acceptance then (the trace's; a phase without `accept_length` runs
  at the profile's), as the load scrape reads the engines' gauge; and, as the live controller does, at once when the
  acceptance moved by `react` or more since its last decision - REACT_LAG_S after the change. A move serves from
  then on. It starts from the replay's threshold (the profiles' crossover unless `--threshold`), within [min, max].
- Its bench table is the model's own: both profiles' closed-loop throughput (curve.py, as `crossover bench` would
  measure the stand-ins) at `BENCH_LEVELS`, the speculative one at the profile's accept length. No intervals (a
  replay has no noise), so the controller never holds `within_interval`.
- Routing is partitioned with the `switch` policy (route.py's, hysteresis 0): a request that finds the other C - 1
  clients in flight goes to the speculative pool while C - 1 < threshold, else to the plain pool - the whole load
  on one pool, which is the crossover's own meaning (under `spillover` the threshold caps the speculative pool
  instead, and its best value is not the crossover). Both pools are up, so a move costs nothing; the requests in
  flight finish where they were, a transient this replay leaves out: each stretch of a window is its pool's steady
  throughput at the stretch's concurrency and acceptance (`replay.steady_level`).
- The performance model at a live acceptance A: the speculative profile with `accept_length` = A, stepped by the
  engine - a speculative step's cost does not depend on A (a verify pass over num_draft_tokens per request plus
  the draft passes), each request accepts A tokens per step on average, and its prefill pass costs the same at any
  A. The controller's model (gateway/policies/adaptive.py) splits a level's time the same way, the prefill read as
  the bench reads it (the time to first token at the lowest level); what it leaves out (prefill batched at high
  load, the context growing faster) is its prediction error here, and its levels' linear interpolation the rest.

Against it, on the same stretches and model:
- the best fixed threshold: every threshold that routes differently (0 and each concurrency of the trace), the one
  serving the most over the whole trace (`best_fixed_threshold`);
- the per-window oracle: in each window, with hindsight, whichever threshold serves that window the most (the
  better pool at its load; at most the free-switch bound of a partitioned gateway).
And after each change of acceptance, how many windows the threshold took to come within one bench level of the
new crossover (`settled`: the crossover by bisection of the model's curves, one bench level the width of the
bench interval holding it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from crossover.gateway.config import AdaptiveSettings
from crossover.gateway.modes import PLAIN, SPECULATIVE, Mode
from crossover.gateway.policies import AdaptiveLimits, BenchTable, CurveRates, decide_threshold, switch
from crossover.servers.sim.profile import Profile, load_profile, with_overrides
from crossover.servers.sim.replay import ADAPTIVE, ReplayResult, ReplaySetup, profiles_crossover, steady_level
from crossover.servers.sim.trace import TRACES_DIR, TracePhase, load_trace, shifts_acceptance, with_accept_drop

# How long after the acceptance moves the controller decides on it: its look (ADAPTIVE_LOOK_S) at the gauge the
# load scrape last read, and the engines' gauge itself, a mean over the last 40 decode batches (a few seconds).
REACT_LAG_S = 5.0
# `crossover bench`'s default levels (loadtest/config.py DEFAULT_CONCURRENCY, which says why 50; servers may not
# import loadtest, a test holds the two equal).
BENCH_LEVELS = (1, 2, 5, 10, 30, 50, 70, 100, 250)


class Stretch(NamedTuple):
    """Part of one window within one phase: its load and acceptance are constant."""

    window: int
    phase: int
    start_s: float
    duration_s: float
    concurrency: int
    accept_length: float


class Move(NamedTuple):
    """A window's decision that moved the threshold: at `t` (the window's end), from, to, why, at which acceptance,
    toward which predicted crossover."""

    t: float
    previous: int
    threshold: int
    reason: str
    accept_length: float
    predicted: float | None


class Settling(NamedTuple):
    """After the acceptance changed at `t` to `accept_length`: the model's crossover there (None: plain never wins up
    to the top bench level or load, which then stands for it), the bench level's width around it, and the windows
    the threshold took to come within that width (None: not by the trace's end)."""

    t: float
    accept_length: float
    crossover: int | None
    level_width: float
    windows: int | None


@dataclass(frozen=True)
class AdaptiveReplay:
    """What `adaptive` ran and what it is compared with (ReplayResult.adaptive)."""

    window_s: float
    limits: AdaptiveLimits
    react: float  # an acceptance change this large is decided on REACT_LAG_S after it, not at the window's end
    bench_accept_length: float
    bench_levels: tuple[int, ...]
    initial_threshold: int
    thresholds: tuple[int, ...]  # the threshold served in each window
    moves: tuple[Move, ...]
    best_fixed_threshold: int
    best_fixed_tokens: float
    oracle_tokens: float
    settled: tuple[Settling, ...]

    def as_json(self) -> dict:
        return {
            "routing": "partitioned, switch policy (hysteresis 0)",
            "window_s": self.window_s,
            "limits": {
                "max_step": self.limits.max_step,
                "min": self.limits.minimum,
                "max": self.limits.maximum,
                "deadband": self.limits.deadband,
                "max_levels": self.limits.max_levels,
            },
            "react": self.react,
            "bench_accept_length": self.bench_accept_length,
            "bench_levels": list(self.bench_levels),
            "initial_threshold": self.initial_threshold,
            "final_threshold": self.thresholds[-1] if self.thresholds else self.initial_threshold,
            "moves": [move._asdict() for move in self.moves],
            "best_fixed_threshold": self.best_fixed_threshold,
            "best_fixed_output_tokens": round(self.best_fixed_tokens),
            "oracle_output_tokens": round(self.oracle_tokens),
            "settled": [settling._asdict() for settling in self.settled],
        }


class ModelRates:
    """Steady closed-loop output tok/s of a pool at a concurrency and (speculative) acceptance, each measured once."""

    def __init__(self, setup: ReplaySetup) -> None:
        self.setup = setup
        self._profiles: dict[float, Profile] = {}

    @property
    def accept_length(self) -> float:
        """The speculative profile's own (the bench's)."""
        assert self.setup.speculative.speculative is not None, "adaptive needs a speculative profile"
        return self.setup.speculative.speculative.accept_length

    def speculative(self, accept_length: float) -> Profile:
        if accept_length not in self._profiles:
            self._profiles[accept_length] = with_overrides(self.setup.speculative, accept_length=accept_length)
        return self._profiles[accept_length]

    def throughput(self, pool: Mode, concurrency: int, accept_length: float) -> float:
        if concurrency < 1:
            return 0.0
        setup = self.setup
        profile = setup.plain if pool == PLAIN else self.speculative(accept_length)
        return steady_level(profile, concurrency, setup.input_len, setup.output_len, setup.seed).output_throughput

    def bench_table(self, levels: tuple[int, ...] = BENCH_LEVELS) -> BenchTable:
        """What `crossover bench` would record on the two profiles: both curves at `levels`, at the profile's
        acceptance."""
        accept = self.accept_length
        curves = {mode: [(c, self.throughput(mode, c, accept)) for c in levels] for mode in (SPECULATIVE, PLAIN)}
        setup = self.setup
        # The prefill as the bench reads it: the mean time to first token of one request alone (the lowest level).
        alone = steady_level(self.speculative(accept), levels[0], setup.input_len, setup.output_len, setup.seed)
        return BenchTable(
            CurveRates.from_points(**curves), accept, prefill_s=alone.mean_ttft_s, output_tokens=setup.output_len
        )

    def crossover(self, accept_length: float, top: int) -> int | None:
        """The lowest concurrency from which plain serves at least as much (replay.profiles_crossover)."""
        setup = self.setup
        return profiles_crossover(
            self.speculative(accept_length),
            setup.plain,
            top,
            input_len=setup.input_len,
            output_len=setup.output_len,
            seed=setup.seed,
        )


def pool_at(concurrency: int, threshold: int) -> Mode:
    """The pool the gateway's `switch` policy picks for a closed loop of `concurrency` (the others in flight)."""
    return PLAIN if switch(max(concurrency - 1, 0), threshold, 0, SPECULATIVE).pool == PLAIN else SPECULATIVE


def stretches(trace: list[TracePhase], window_s: float, accept_length: float) -> list[Stretch]:
    """The trace cut at its phases' and the windows' ends."""
    out: list[Stretch] = []
    start = 0.0
    for index, phase in enumerate(trace):
        end = start + phase.duration_s
        accept = accept_length if phase.accept_length is None else phase.accept_length
        t = start
        while t < end:
            window = int(t // window_s)
            # A float window boundary a hair past t would make a stretch of nothing: step to the next one.
            upto = min(end, (window + 1) * window_s)
            if upto - t <= 1e-9 * max(1.0, end):
                window += 1
                upto = min(end, (window + 1) * window_s)
            out.append(Stretch(window, index, t, upto - t, phase.concurrency, accept))
            t = upto
        start = end
    return out


def replay_adaptive(setup: ReplaySetup, trace: list[TracePhase]) -> ReplayResult:
    """The adaptive controller over the trace (module docstring), with the best fixed threshold and the oracle."""
    rates = ModelRates(setup)
    limits = setup.adaptive.limits()
    window_s = setup.adaptive.window
    table = rates.bench_table()
    parts = stretches(trace, window_s, rates.accept_length)
    windows = parts[-1].window + 1 if parts else 0
    by_window: list[list[Stretch]] = [[] for _ in range(windows)]
    for part in parts:
        by_window[part.window].append(part)

    def tokens(part: Stretch, threshold: int) -> float:
        pool = pool_at(part.concurrency, threshold)
        return part.duration_s * rates.throughput(pool, part.concurrency, part.accept_length)

    initial = min(max(setup.switch.threshold, limits.minimum), limits.maximum)
    threshold = initial
    served = 0.0
    phase_tokens = [0.0] * len(trace)
    thresholds: list[int] = []
    moves: list[Move] = []
    decided_at = rates.accept_length  # the acceptance of the last decision (the bench's before the first)

    def serve(part: Stretch, threshold: int) -> None:
        nonlocal served
        got = tokens(part, threshold)
        served += got
        phase_tokens[part.phase] += got

    def decide_at(t: float, accept: float) -> None:
        nonlocal threshold, decided_at
        decision = decide_threshold(threshold, accept, table, limits)
        decided_at = accept
        if decision.moved:
            predicted = None if decision.prediction is None else decision.prediction.crossover
            moves.append(Move(t, threshold, decision.threshold, decision.reason, accept, predicted))
        threshold = decision.threshold

    for window, window_parts in enumerate(by_window):
        thresholds.append(threshold)
        for part in window_parts:
            if abs(part.accept_length - decided_at) >= setup.adaptive.react and part.duration_s > REACT_LAG_S:
                # The acceptance moved: the controller sees it REACT_LAG_S later and decides at once.
                serve(part._replace(duration_s=REACT_LAG_S), threshold)
                decide_at(part.start_s + REACT_LAG_S, part.accept_length)
                part = part._replace(start_s=part.start_s + REACT_LAG_S, duration_s=part.duration_s - REACT_LAG_S)
            serve(part, threshold)
        if window_parts:
            decide_at((window + 1) * window_s, window_parts[-1].accept_length)  # the gauge at the window's end

    candidates = sorted({0, *(part.concurrency for part in parts)})
    fixed = {t: sum(tokens(part, t) for part in parts) for t in candidates}
    best_fixed = max(candidates, key=lambda t: (fixed[t], -t))
    oracle = sum(
        max(sum(tokens(part, t) for part in window_parts) for t in {0, *(p.concurrency for p in window_parts)})
        for window_parts in by_window
    )
    top = max(BENCH_LEVELS[-1], *(part.concurrency for part in parts))
    report = AdaptiveReplay(
        window_s=window_s,
        limits=limits,
        react=setup.adaptive.react,
        bench_accept_length=table.accept_length,
        bench_levels=BENCH_LEVELS,
        initial_threshold=initial,
        thresholds=tuple(thresholds),
        moves=tuple(moves),
        best_fixed_threshold=best_fixed,
        best_fixed_tokens=fixed[best_fixed],
        oracle_tokens=oracle,
        settled=tuple(_settling(parts, thresholds, rates, top)),
    )
    return ReplayResult(
        mechanism=ADAPTIVE,
        output_tokens=round(served),
        requests_completed=round(served / setup.output_len),
        switches=0,
        switching_s=0.0,
        ttft_p50_s=None,
        ttft_p99_s=None,
        phase_tokens=tuple(phase_tokens),
        adaptive=report,
    )


def level_width(crossover: float, levels: tuple[int, ...] = BENCH_LEVELS) -> float:
    """The width of the bench interval holding `crossover` (beyond the ends: the nearest interval's)."""
    for low, high in itertools.pairwise(levels):
        if crossover <= high:
            return float(high - low)
    return float(levels[-1] - levels[-2])


def _settling(parts: list[Stretch], thresholds: list[int], rates: ModelRates, top: int) -> list[Settling]:
    """After each change of acceptance between windows: windows until the threshold is within one bench level."""
    out: list[Settling] = []
    previous: float | None = None
    for part in parts:
        if previous is not None and part.accept_length != previous:
            crossover = rates.crossover(part.accept_length, top)
            # Plain never wins up to the top: the crossover is at least there (as the table's `above_range`).
            at = top if crossover is None else crossover
            width = level_width(at)
            taken = None
            # The threshold in effect from the window after the change (a window's move serves the next).
            for waited, threshold in enumerate(thresholds[part.window + 1 :], start=1):
                if abs(threshold - at) <= width or (crossover is None and threshold >= at):
                    taken = waited
                    break
            out.append(Settling(part.start_s, part.accept_length, crossover, width, taken))
        previous = part.accept_length
    return out


# --- every shipped trace: `python -m crossover.servers.sim.replay_adaptive` prints the table ---------------------

# Each shipped trace on its pair (trace name prefix -> speculative, plain, input length, bench accept length): k25-*
# on the k25 profiles at their own 2.4; llama-* on llama8b-h200 at input 768 benched at 2.0 - or at the profile's
# 2.5 where the trace gives its own acceptance.
SHIPPED_PAIRS = {
    "k25": ("k25-eagle3", "k25-plain", 256, None),
    "llama": ("llama8b-h200-eagle3", "llama8b-h200-plain", 768, 2.0),
}
# Where a shipped trace gives no acceptance, it drops to this halfway through.
DROPPED_ACCEPT = 1.6


class ShippedRow(NamedTuple):
    trace: str
    adaptive_tokens: int
    best_fixed_threshold: int
    best_fixed_tokens: float
    oracle_tokens: float
    settled: tuple[int | None, ...]  # windows to settle after each change of acceptance


def shipped_setup(name: str, trace: list[TracePhase], adaptive: AdaptiveSettings | None = None) -> ReplaySetup:
    """The replay setup of a shipped trace's pair (SHIPPED_PAIRS)."""
    speculative, plain, input_len, accept = SHIPPED_PAIRS[name.split("-", maxsplit=1)[0]]
    spec = load_profile(speculative)
    shipped = {path.stem for path in TRACES_DIR.glob("*.csv")}
    if accept is not None and not (name in shipped and shifts_acceptance(load_trace(name))):
        spec = with_overrides(spec, accept_length=accept)
    return ReplaySetup.from_profiles(spec, load_profile(plain), trace, input_len=input_len, adaptive=adaptive)


def shipped_trace(name: str) -> list[TracePhase]:
    """A shipped trace, its acceptance dropped to DROPPED_ACCEPT halfway where it gives none of its own."""
    trace = load_trace(name)
    if shifts_acceptance(trace):
        return trace
    half = sum(phase.duration_s for phase in trace) / 2
    return with_accept_drop(trace, at_s=half, accept_length=DROPPED_ACCEPT)


def shipped_rows() -> list[ShippedRow]:
    """The adaptive replay of every shipped trace at the gateway's default [adaptive], beside the best fixed
    threshold and the per-window oracle."""
    from crossover.servers.sim.replay import replay  # replay.py imports this module lazily too

    rows = []
    for name in sorted(path.stem for path in TRACES_DIR.glob("*.csv")):
        trace = shipped_trace(name)
        result = replay(shipped_setup(name, trace), trace, ADAPTIVE)
        report = result.adaptive
        assert report is not None
        rows.append(
            ShippedRow(
                name,
                result.output_tokens,
                report.best_fixed_threshold,
                report.best_fixed_tokens,
                report.oracle_tokens,
                tuple(settling.windows for settling in report.settled),
            )
        )
    return rows


def format_rows(rows: list[ShippedRow]) -> str:
    lines = [
        "| trace | adaptive tokens | best fixed (threshold) | adaptive / best fixed | per-window oracle | adaptive / "
        "oracle | windows to settle |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.trace} | {row.adaptive_tokens:,} | {row.best_fixed_tokens:,.0f} ({row.best_fixed_threshold}) | "
            f"{100 * row.adaptive_tokens / row.best_fixed_tokens:.2f} % | {row.oracle_tokens:,.0f} | "
            f"{100 * row.adaptive_tokens / row.oracle_tokens:.2f} % | "
            f"{', '.join('-' if w is None else str(w) for w in row.settled)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_rows(shipped_rows()))
