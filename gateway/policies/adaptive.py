"""Where the crossover lies at the live acceptance, and how far the threshold moves toward it: pure, the clock nowhere.

    table = BenchTable.from_results(json.loads(path.read_text()), accept_length=2.4)
    limits = AdaptiveLimits(max_step=4, minimum=1, maximum=256, deadband=1)
    decision = decide(threshold, mean_acceptance(readings), table, limits)   # every window
    if decision.moved:
        ...                                 # the live controller: PUT /admin/threshold's path; the replay: its own

The model. A `crossover bench` results file gives each pool's output tok/s by concurrency (its `levels`, read as
`CurveRates.from_levels` reads them), measured at the acceptance the bench saw: tokens per speculative step, the
bonus token included (a level's `accept_length` on the speculative target where the file records it, else the
setting `[adaptive] bench_accept_length`). Plain throughput does not depend on acceptance. A speculative level's
engine time per request, t = out / X(c) (`out`: output tokens per request, X: the level's tok/s; a closed loop's
engine is busy for t per completed request), splits in two:
- a part that does not scale with acceptance, p: the request's prefill, taken as the speculative target's mean time
  to first token at its lowest level (one request alone: its prefill pass, no queue), at most t;
- the decode part, t - p: steps of fixed cost (a verify pass over the draft tokens plus the draft passes), each
  yielding `accept_length` tokens per stream, so it scales with bench_accept / live_accept.
So at a live acceptance A the speculative level predicts X'(c) = out / (p + (t - p) x A_bench / A). Without a prefill
time (a file without `mean_ttft_ms`, p = 0) this is the proportional X(c) x A / A_bench.
The predicted crossover is the lowest concurrency where plain >= the predicted speculative curve, linear between the
bench's levels (each curve linear between its points and flat beyond its ends, as `CurveRates`): at the lowest level
if plain is ahead there already; beyond the highest level if plain never catches up (`above_range`: then the
crossover is at least the highest level, and that is what the threshold moves toward). Its interval comes from the
levels' 95% intervals (`output_throughput_interval`), each end predicted the same way: from the crossover of
speculative's low end against plain's high end (the earliest plain may be ahead) to that of speculative's high end
against plain's low end; None where a level of the pair has no interval.

The threshold for a crossover x is ceil(x) - 1 (`threshold_for`, as `crossover bench` recommends it): the switch
policy routes a request to plain when the load it finds (the others in flight) is >= the threshold, so a closed loop
of C clients stays speculative while C <= threshold; plain is ahead from C = ceil(x).

What it leaves out: a verify pass's cost does grow with the tokens it verifies and the context grows faster at a
higher acceptance; prefill is batched at high load (less per request than alone); acceptance differs by context
length and batch - so it is a prior that the bench calibrates at one acceptance, trusted near it, and that the live
rate table corrects (`Correction`: per pool and level, the tokens served against the tokens predicted, shrunk toward
1 while the level has few requests).

The decision (`decide`), in order (the first that applies gives the reason, a stable string):
1. `no_acceptance`: no speculative backend reports its acceptance - hold (nothing to predict from).
2. `no_table`: no bench table - hold. The fallback is to do nothing: scaling a threshold that was never measured by a
   ratio would be a guess presented as a measurement.
3. The target is the predicted crossover's threshold (`threshold_for`), within [minimum, maximum]. A threshold
   outside those bounds moves toward them whatever else holds (`into_bounds`).
4. `within_deadband`: the threshold is within `deadband` of the target; `within_interval`: it lies inside the
   thresholds of the prediction's interval (the curves are within the bench's noise there) - hold.
5. `toward_crossover`: move toward the target by at most `max_step` - or, farther, to the `max_levels`-th bench level
   toward it (the bench's own resolution: one level a window crosses the wide levels at high load in a few windows
   where `max_step` alone would take dozens) - never past it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from crossover.gateway.modes import PLAIN, SPECULATIVE
from crossover.gateway.policies.switcher import CurveRates

# Reasons (stable strings: log messages and /admin/state).
NO_ACCEPTANCE = "no_acceptance"
NO_TABLE = "no_table"
WITHIN_DEADBAND = "within_deadband"
WITHIN_INTERVAL = "within_interval"
EXPLORE_DISAGREES = "explore_disagrees"
INTO_BOUNDS = "into_bounds"
TOWARD_CROSSOVER = "toward_crossover"
ADAPTIVE_REASONS = (
    NO_ACCEPTANCE,
    NO_TABLE,
    WITHIN_DEADBAND,
    WITHIN_INTERVAL,
    INTO_BOUNDS,
    TOWARD_CROSSOVER,
    EXPLORE_DISAGREES,
)
# Directions of a move (the `direction` label of crossover_adaptive_moves_total).
UP, DOWN = "up", "down"
DIRECTIONS = (UP, DOWN)


# The correction's prior: a level with this many requests moves halfway from the model to what it measured.
CORRECTION_PRIOR = 32.0
# rate-table.json's `kind` (`crossover bench` writes it beside results.json: loadtest/ratetable.py).
RATE_TABLE_KIND = "crossover-rate-table"


class TableError(ValueError):
    """A results file that cannot be a bench table; the message says what it lacks."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """The crossover (a concurrency) at `accept_length`, with its interval (None: the bench gave none)."""

    crossover: float
    interval: tuple[float, float] | None
    accept_length: float
    # Plain never met speculative within the bench's levels: the crossover is at least `crossover` (the top level).
    above_range: bool = False

    def view(self) -> dict:
        return {
            "crossover": round(self.crossover, 2),
            "interval": None if self.interval is None else [round(x, 2) for x in self.interval],
            "accept_length": round(self.accept_length, 4),
            "above_range": self.above_range,
        }


@dataclass(frozen=True, slots=True)
class BenchTable:
    """Both pools' throughput by concurrency as a bench measured them, at `accept_length`; `low`/`high`: the curves
    at the ends of the levels' intervals (None: not in the file); `prefill_s`: the speculative request's part that
    does not scale with acceptance, `output_tokens` its output tokens (the model: the module docstring)."""

    rates: CurveRates
    accept_length: float
    low: CurveRates | None = None
    high: CurveRates | None = None
    prefill_s: float = 0.0
    output_tokens: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.accept_length) and self.accept_length >= 1):
            raise TableError(f"the bench's accept_length must be a number >= 1, got {self.accept_length}")
        if not (math.isfinite(self.prefill_s) and self.prefill_s >= 0):
            raise TableError(f"the prefill time must be a number >= 0, got {self.prefill_s}")

    @classmethod
    def from_results(cls, results: Mapping[str, Any], *, accept_length: float | None = None) -> BenchTable:
        """From a parsed `crossover bench` results.json: the pair its `crossover` names, each target's levels that
        completed something. The acceptance: the speculative target's levels' mean `accept_length` where recorded,
        else `accept_length`; TableError when neither says. The prefill: the speculative target's `mean_ttft_ms`
        at its lowest level (0 where not recorded); its output tokens per request: its levels' total_output_tokens
        over completed, else the run's `output_len`."""
        crossover = results.get("crossover") if isinstance(results, Mapping) else None
        pair = crossover if isinstance(crossover, Mapping) else {}
        speculative, plain = pair.get("speculative"), pair.get("plain")
        levels = results.get("levels") if isinstance(results, Mapping) else None
        if not isinstance(speculative, str) or not isinstance(plain, str) or not isinstance(levels, list):
            raise TableError(
                "it names no speculative and plain pair (crossover.speculative, crossover.plain) or no levels"
            )
        names = (speculative, plain)
        try:
            rates = CurveRates.from_levels(levels, speculative=speculative, plain=plain)
        except (ValueError, TypeError, KeyError) as exc:
            raise TableError(f"its levels are not two throughput curves: {exc}") from None
        used = [
            level
            for level in levels
            if isinstance(level, Mapping) and level.get("target") in names and rates_point(level) is not None
        ]
        ours = sorted((level for level in used if level.get("target") == speculative), key=lambda lv: lv["concurrency"])
        recorded = [a for level in ours if (a := _number(level.get("accept_length"))) is not None]
        bench_accept = sum(recorded) / len(recorded) if recorded else accept_length
        if bench_accept is None:
            raise TableError(
                "it records no acceptance (a speculative level's accept_length): set adaptive.bench_accept_length "
                "to the accept length the engine reported during the bench"
            )
        low: CurveRates | None = None
        high: CurveRates | None = None
        intervals: list[tuple[float, float]] = [
            tuple(i) for level in used if isinstance(i := level.get("output_throughput_interval"), list | tuple)
        ]
        if used and len(intervals) == len(used) and all(len(i) == 2 for i in intervals):
            ends: dict[str, dict[str, list[tuple[float, float]]]] = {
                "low": {SPECULATIVE: [], PLAIN: []},
                "high": {SPECULATIVE: [], PLAIN: []},
            }
            for level, (lo, hi) in zip(used, intervals, strict=True):
                mode = SPECULATIVE if level["target"] == speculative else PLAIN
                # `low`: the earliest plain may be ahead (speculative low, plain high); `high` the reverse.
                ends["low"][mode].append((level["concurrency"], lo if mode == SPECULATIVE else hi))
                ends["high"][mode].append((level["concurrency"], hi if mode == SPECULATIVE else lo))
            try:
                low, high = CurveRates.from_points(**ends["low"]), CurveRates.from_points(**ends["high"])
            except ValueError:
                low = high = None  # an interval reaching 0: no interval rather than a nonsense one
        ttft = _number(ours[0].get("mean_ttft_ms")) if ours else None
        prefill_s = ttft / 1000 if ttft is not None and ttft >= 0 else 0.0
        per_request = [
            level["total_output_tokens"] / level["completed"]
            for level in ours
            if _number(level.get("total_output_tokens")) is not None
        ]
        metadata = results.get("metadata")
        output_len = _number(metadata.get("output_len")) if isinstance(metadata, Mapping) else None
        output_tokens = sum(per_request) / len(per_request) if per_request else output_len
        if output_tokens is None:
            prefill_s = 0.0  # without the tokens per request the split cannot be made: proportional
        return cls(rates, float(bench_accept), low, high, prefill_s, output_tokens)

    @classmethod
    def from_file(cls, data: Any, *, accept_length: float | None = None) -> BenchTable:
        """From a parsed rate-table.json (its `kind` says so) or results.json: `from_rate_table` or `from_results`."""
        if isinstance(data, Mapping) and data.get("kind") == RATE_TABLE_KIND:
            return cls.from_rate_table(data, accept_length=accept_length)
        return cls.from_results(data, accept_length=accept_length)

    @classmethod
    def from_rate_table(
        cls, table: Mapping[str, Any], *, accept_length: float | None = None, prompt_tokens: str | None = None
    ) -> BenchTable:
        """From a parsed rate-table.json: the rows of one input-length bucket (`prompt_tokens`; default the first
        the speculative target lists), read as a results.json's levels are."""
        targets = table.get("targets")
        speculative, plain = table.get("speculative"), table.get("plain")
        if not isinstance(targets, Mapping) or not isinstance(speculative, str) or not isinstance(plain, str):
            raise TableError("a rate table names its speculative and plain targets and lists their rows")
        rows: dict[str, list[Mapping[str, Any]]] = {}
        for name in (speculative, plain):
            listed = targets.get(name)
            if not isinstance(listed, list) or not all(isinstance(row, Mapping) for row in listed):
                raise TableError(f"a rate table lists rows for both {speculative} and {plain}")
            rows[name] = listed
        if prompt_tokens is None:
            prompt_tokens = next((row.get("prompt_tokens") for row in rows[speculative]), None)
        levels = [
            {
                "target": name,
                "concurrency": row.get("concurrency"),
                "completed": row.get("requests"),
                "output_throughput": row.get("tokens_per_s") or 0,
                "output_throughput_interval": row.get("interval"),
                "accept_length": row.get("accept_length"),
                "mean_ttft_ms": row.get("mean_ttft_ms"),
                "total_output_tokens": _product(row.get("output_tokens_per_request"), row.get("requests")),
            }
            for name, name_rows in rows.items()
            for row in name_rows
            if row.get("prompt_tokens") == prompt_tokens
        ]
        results = {
            "levels": levels,
            "crossover": {"speculative": speculative, "plain": plain},
            "metadata": {"output_len": table.get("output_len")},
        }
        return cls.from_results(results, accept_length=accept_length)

    def speculative_at(self, accept_length: float, rates: CurveRates | None = None) -> CurveRates:
        """`rates` (default: the bench's) with the speculative curve predicted at `accept_length`."""
        rates = self.rates if rates is None else rates
        ratio = self.accept_length / accept_length  # the decode part's time scales by this
        out = self.output_tokens
        if out is None or self.prefill_s <= 0:
            points = [(c, x / ratio) for c, x in rates.speculative]
        else:
            points = []
            for c, x in rates.speculative:
                per_request = out / x
                prefill = min(self.prefill_s, per_request)
                points.append((c, out / (prefill + (per_request - prefill) * ratio)))
        return CurveRates(tuple(points), rates.plain)

    def predict(self, accept_length: float, correction: Correction | None = None) -> Prediction:
        """The crossover at `accept_length` (see the module docstring), each curve scaled by the live `correction`
        where given."""

        def curves(rates: CurveRates | None = None) -> CurveRates:
            predicted = self.speculative_at(accept_length, rates)
            return predicted if correction is None else correction.apply(predicted)

        at, above = crossing(curves())
        interval = None
        if self.low is not None and self.high is not None:
            interval = (crossing(curves(self.low))[0], crossing(curves(self.high))[0])
        return Prediction(at, interval, accept_length, above)

    def level_reach(self, threshold: int, target: int, levels: int) -> int:
        """How far the `levels`-th bench level from `threshold` toward `target` lies (0: none there, or `levels` 0)."""
        if levels < 1 or target == threshold:
            return 0
        loads = sorted({round(x) for x, _ in self.rates.speculative} | {round(x) for x, _ in self.rates.plain})
        ahead = (
            [x for x in loads if x > threshold] if target > threshold else [x for x in reversed(loads) if x < threshold]
        )
        return abs(ahead[min(levels, len(ahead)) - 1] - threshold) if ahead else 0


def _number(value: object) -> float | None:
    """`value` as a finite float where it is a JSON number (None: it is not)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _product(a: object, b: object) -> float | None:
    x, y = _number(a), _number(b)
    return None if x is None or y is None else x * y


def threshold_for(crossover: float) -> int:
    """The switch threshold that keeps a closed loop on speculative below `crossover` and on plain from it on:
    ceil(crossover) - 1 (the module docstring); a hair over an integer is that integer (float noise)."""
    return max(math.ceil(crossover - 1e-9) - 1, 0)


def rates_point(level: Mapping[str, Any]) -> float | None:
    """A level's throughput if `CurveRates.from_levels` takes it as a point."""
    throughput = level.get("output_throughput")
    if level.get("completed") and isinstance(throughput, int | float) and throughput > 0:
        return float(throughput)
    return None


def crossing(rates: CurveRates) -> tuple[float, bool]:
    """(the lowest load where plain >= speculative, linear between the curves' points; whether plain never got
    there, the load then being the highest point)."""
    loads = sorted({x for x, _ in rates.speculative} | {x for x, _ in rates.plain})
    previous: tuple[float, float] | None = None
    for load in loads:
        ahead = rates.throughput(PLAIN, load) - rates.throughput(SPECULATIVE, load)
        if ahead >= 0:
            if previous is None:
                return load, False
            x0, behind = previous
            return x0 + (load - x0) * -behind / (ahead - behind), False
        previous = (load, ahead)
    return loads[-1], True


@dataclass(slots=True)
class LevelEvidence:
    """What the live rate table showed at one level of one pool against the model: requests, the tokens served and
    the tokens the model predicted for the same request-seconds; per window, the ratio's sum and sum of squares."""

    requests: float = 0.0
    observed: float = 0.0
    predicted: float = 0.0
    windows: int = 0
    ratios: float = 0.0
    squares: float = 0.0

    @property
    def ratio(self) -> float:
        return self.observed / self.predicted if self.predicted > 0 else 1.0

    def shrunk(self, prior: float) -> float:
        """The ratio pulled toward 1 by `prior` requests' worth of belief in the model."""
        return (self.requests * self.ratio + prior) / (self.requests + prior)

    def stderr(self) -> float | None:
        """The standard error of the ratio over its windows (None: fewer than two)."""
        if self.windows < 2:
            return None
        mean = self.ratios / self.windows
        variance = max(self.squares / self.windows - mean * mean, 0.0) * self.windows / (self.windows - 1)
        return math.sqrt(variance / self.windows)


class Correction:
    """The live rate table's correction of the model, per pool and level bucket (powers of two, as the gateway's
    rate table; `low`-`high` in flight on a backend, the bench's concurrency): every window, the tokens each level
    served against what the model predicted for the same request-seconds at that window's acceptance
    (`observe`); a curve's point is scaled by its level's ratio, shrunk toward 1 while the level has few requests
    (`prior`: a level with `prior` requests moves halfway to its measured ratio) - so the bench's prior holds until
    the live traffic says otherwise, and where it never ran the prior stands."""

    def __init__(self, prior: float = CORRECTION_PRIOR) -> None:
        self.prior = prior
        self.levels: dict[tuple[str, int, int | None], LevelEvidence] = {}

    def observe(
        self, pool: str, low: int, high: int | None, requests: float, tokens: float, seconds: float, rate: float
    ) -> None:
        """A window's requests that ended at level `low`-`high` of `pool`: `tokens` over `seconds` of requests;
        `rate`: the model's pool throughput (tok/s) at the level's load, so `rate / load` per stream."""
        if requests <= 0 or seconds <= 0 or rate <= 0:
            return
        predicted = seconds * rate / level_load(low, high)
        evidence = self.levels.setdefault((pool, low, high), LevelEvidence())
        evidence.requests += requests
        evidence.observed += tokens
        evidence.predicted += predicted
        ratio = tokens / predicted
        evidence.windows += 1
        evidence.ratios += ratio
        evidence.squares += ratio * ratio

    def factor(self, pool: str, load: float) -> float:
        """The shrunk ratio of the level holding `load` (1: no evidence there)."""
        for (name, low, high), evidence in self.levels.items():
            if name == pool and low <= load and (high is None or load <= high):
                return evidence.shrunk(self.prior)
        return 1.0

    def apply(self, rates: CurveRates) -> CurveRates:
        """`rates` with each point scaled by its level's factor."""
        return CurveRates(
            tuple((c, x * self.factor(SPECULATIVE, c)) for c, x in rates.speculative),
            tuple((c, x * self.factor(PLAIN, c)) for c, x in rates.plain),
        )

    def view(self) -> list[dict]:
        """/admin/state's `correction`: per pool and level, the evidence, the ratio, its standard error, and the
        factor applied."""
        return [
            {
                "pool": pool,
                "level": f"{low}+" if high is None else str(low) if low == high else f"{low}-{high}",
                "requests": int(evidence.requests),
                "windows": evidence.windows,
                "ratio": round(evidence.ratio, 4),
                "stderr": None if (se := evidence.stderr()) is None else round(se, 4),
                "factor": round(evidence.shrunk(self.prior), 4),
            }
            for (pool, low, high), evidence in sorted(self.levels.items(), key=lambda item: (item[0][0], item[0][1]))
        ]


# Explore: windows each arm needs before its realized rate is judged; the relative band used where the bench gave
# no interval (the bench's own resolution, loadtest/uncertainty.py DEFAULT_RESOLUTION).
EXPLORE_MIN_WINDOWS = 2
EXPLORE_RESOLUTION = 0.03
EXPLORE_ARMS = ("up", "down")


@dataclass(slots=True)
class ExploreArm:
    """One arm of the switchback (threshold + or - delta): the tokens its windows served, and what the model
    predicted for the same request-seconds at each pool and level (with the interval's ends, where the bench gave
    one)."""

    windows: int = 0
    seconds: float = 0.0
    realized: float = 0.0
    predicted: float = 0.0
    low: float = 0.0
    high: float = 0.0

    def add(self, seconds: float, realized: float, predicted: float, low: float, high: float) -> None:
        self.windows += 1
        self.seconds += seconds
        self.realized += realized
        self.predicted += predicted
        self.low += low
        self.high += high

    def band(self) -> tuple[float, float]:
        """The predicted tokens' interval: the bench's, at least +-EXPLORE_RESOLUTION of the prediction."""
        low = min(self.low, self.predicted * (1 - EXPLORE_RESOLUTION))
        high = max(self.high, self.predicted * (1 + EXPLORE_RESOLUTION))
        return low, high

    def disagrees(self) -> bool:
        low, high = self.band()
        return self.windows >= EXPLORE_MIN_WINDOWS and not low <= self.realized <= high

    def view(self) -> dict:
        per_s = (lambda tokens: round(tokens / self.seconds, 3)) if self.seconds > 0 else (lambda _: None)
        low, high = self.band()
        return {
            "windows": self.windows,
            "realized_tokens_per_s": per_s(self.realized),
            "predicted_tokens_per_s": per_s(self.predicted),
            "interval_tokens_per_s": [per_s(low), per_s(high)],
        }


def explore_verdict(arms: Mapping[str, ExploreArm]) -> str | None:
    """Why the controller holds (None: the realized tokens lie within every judged arm's interval)."""
    for name, arm in arms.items():
        if arm.disagrees():
            low, high = arm.band()
            return (
                f"explore: the {name} arm realized {arm.realized / arm.seconds:.1f} tok/s over {arm.windows} windows, "
                f"outside the predicted {low / arm.seconds:.1f}-{high / arm.seconds:.1f}: the model does not hold here "
                '- holding the threshold (PUT /admin/adaptive {"enabled": true} starts over)'
            )
    return None


def level_load(low: int, high: int | None) -> float:
    """The load standing for a level bucket: the geometric middle of its bounds (the lower bound if open)."""
    return float(low) if high is None else math.sqrt(low * high)


@dataclass(frozen=True, slots=True)
class AdaptiveLimits:
    """How far and where the threshold may move: per window at most `max_step`, or as far as the `max_levels`-th
    bench level toward the target where that is farther (0: `max_step` alone), within [minimum, maximum], and not
    at all within `deadband` of the target."""

    max_step: int
    minimum: int
    maximum: int
    deadband: int = 0
    max_levels: int = 0

    def __post_init__(self) -> None:
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")
        if not 0 <= self.minimum <= self.maximum:
            raise ValueError(f"need 0 <= minimum <= maximum, got {self.minimum}, {self.maximum}")
        if self.deadband < 0:
            raise ValueError(f"deadband must be >= 0, got {self.deadband}")
        if self.max_levels < 0:
            raise ValueError(f"max_levels must be >= 0, got {self.max_levels}")


@dataclass(frozen=True, slots=True)
class AdaptiveDecision:
    """`threshold` is the one to serve: a move when it differs from `previous`."""

    previous: int
    threshold: int
    reason: str
    accept_length: float | None = None
    prediction: Prediction | None = None
    target: int | None = None  # the prediction's threshold (threshold_for), within the bounds

    @property
    def moved(self) -> bool:
        return self.threshold != self.previous

    @property
    def direction(self) -> str | None:
        return None if not self.moved else UP if self.threshold > self.previous else DOWN

    def view(self) -> dict:
        return {
            "from": self.previous,
            "to": self.threshold,
            "reason": self.reason,
            "accept_length": None if self.accept_length is None else round(self.accept_length, 4),
            "prediction": None if self.prediction is None else self.prediction.view(),
            "target": self.target,
        }


def mean_acceptance(readings: Iterable[float | None]) -> float | None:
    """The mean over the backends that report an acceptance (None: none does)."""
    values = [value for value in readings if value is not None and math.isfinite(value)]
    return sum(values) / len(values) if values else None


def decide(
    threshold: int,
    accept_length: float | None,
    table: BenchTable | None,
    limits: AdaptiveLimits,
    correction: Correction | None = None,
) -> AdaptiveDecision:
    """Hold or move the threshold one bounded step toward the predicted crossover (rules: the module docstring)."""
    if accept_length is None:
        return AdaptiveDecision(threshold, threshold, NO_ACCEPTANCE)
    if table is None:
        return AdaptiveDecision(threshold, threshold, NO_TABLE, accept_length)
    prediction = table.predict(accept_length, correction)
    target = min(max(threshold_for(prediction.crossover), limits.minimum), limits.maximum)
    inside = limits.minimum <= threshold <= limits.maximum
    held = None
    if inside and abs(target - threshold) <= limits.deadband:
        held = WITHIN_DEADBAND
    elif inside and prediction.interval is not None:
        low, high = prediction.interval
        if threshold_for(low) <= threshold <= threshold_for(high):
            held = WITHIN_INTERVAL
    if held is not None:
        return AdaptiveDecision(threshold, threshold, held, accept_length, prediction, target)
    bound = max(limits.max_step, table.level_reach(threshold, target, limits.max_levels))
    step = max(-bound, min(bound, target - threshold))
    reason = TOWARD_CROSSOVER if inside else INTO_BOUNDS
    return AdaptiveDecision(threshold, threshold + step, reason, accept_length, prediction, target)
