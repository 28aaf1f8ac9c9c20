"""Would time-sharing pay on my traffic, with my switch time? A load trace through both stand-in engines and
the gateway's own switching decision (gateway/switch_policy.py), in virtual time.

    trace = load_trace("trace.csv")                   # duration_s,concurrency - one closed-loop phase a row
    setup = ReplaySetup.from_profiles(load_profile("k25-eagle3"), load_profile("k25-plain"), trace)
    results = [replay(setup, trace, mechanism) for mechanism in MECHANISMS]

One engine per mode (engine.py, the live stand-in's code). Each phase runs `concurrency` clients in a closed
loop (each sends its next request the moment its last one ends). Only one mode serves at a time:

- `always-speculative`, `always-plain`: one mode throughout, no switches.
- `restart`, `sleep`: every sampling period the load (requests in flight + held) is sampled and
  `switch_policy.Switcher` - the live controller's own stepper - stepped with the virtual clock. On a
  switch, the requests in flight drain (finish) on the old mode up to the drain deadline (then they are
  cut and counted), new requests wait for the new mode, and the switch itself takes the profiles' cost:
  restart = stop + the new server's `startup_s`; sleep = the old server's `release_s` + the new one's
  `resume_s`. The measured duration (decision to serving again) feeds the running switch-cost estimate, as
  in the live controller.
- `in-engine`: the speculative engine alone, patched (patches/sglang-0.5.23): decode batches above its gate
  run zero draft steps (engine.py's gate, costs.py's ZERO_STEP_MODEL), in the speculative server's KV pool
  and running cap. Nothing switches, nothing waits. The gate is where a zero-step step out-yields a
  speculative one *in the same server* (`zero_step_gate`), not the crossover against the plain server: what
  the plain server wins by its larger pool and cap, the gate cannot win back.
- `oracle`: an upper bound on every other mechanism, by construction. It knows the trace, so it can follow
  any schedule for free; it takes the best of two kinds: the *free-switch* schedule (the faster mode for each
  phase by the curves the policy weighs, switched at no cost at the phase boundary - requests in flight move
  with what they have generated, a prefill of their context there, and nothing waits) and each other
  mechanism's own schedule (a policy that drains instead of moving requests can beat free switching, so the
  free-switch schedule alone is no bound: a 24 h k25 trace had `sleep` at 100.1% of it). `follows` says which.

Restart's cost is the new server's weight loading (`[memory] startup_s`). A profile that does not give it would
make a restart look free, so `restart` is refused unless both profiles give it or `--startup-s` does.

The policy's rate model is both profiles' closed-loop curves (curve.py) at the trace's concurrencies and
powers of two; its threshold, unless given, is their crossover.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from crossover.gateway.switch_policy import (
    DEFAULT_MIN_DWELL_S,
    DEFAULT_PRIOR_PHASE_S,
    DEFAULT_WINDOW_S,
    PLAIN,
    SPECULATIVE,
    CurveRates,
    Mode,
    SwitchCost,
    Switcher,
    SwitchSettings,
)
from crossover.servers.sim.costs import make_costs
from crossover.servers.sim.curve import run_level
from crossover.servers.sim.engine import Engine, Sequence
from crossover.servers.sim.profile import Profile

ALWAYS_SPECULATIVE = "always-speculative"
ALWAYS_PLAIN = "always-plain"
RESTART = "restart"
SLEEP = "sleep"
ORACLE = "oracle"
IN_ENGINE = "in-engine"
MECHANISMS = (ALWAYS_SPECULATIVE, ALWAYS_PLAIN, RESTART, SLEEP, IN_ENGINE, ORACLE)

DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 512
# How often the load is sampled and the policy asked (virtual seconds).
DEFAULT_SAMPLE_PERIOD_S = 1.0
# Requests in flight at a switch may finish on the old mode for this long; then they are cut.
DEFAULT_DRAIN_TIMEOUT_S = 120.0
# Stopping a server (SIGTERM to its process group, GPUs free again) before a restart loads the other.
DEFAULT_STOP_S = 5.0
# Hysteresis as a share of the threshold, when not given.
DEFAULT_HYSTERESIS_SHARE = 0.25
# Steady phases are fast-forwarded (virtual seconds): once a phase has served the same clients in one mode for
# STEADY_WARMUP_S and STEADY_WARMUP_ROUNDS x clients requests, the replay measures a stretch of at least
# STEADY_SAMPLE_S and STEADY_SAMPLE_ROUNDS x clients requests (whole rounds of the closed loop, so its first
# tokens are a fair sample) and then repeats that stretch's output, tick by tick, asking the policy every
# sampling period as usual, until the policy switches or the phase is within STEADY_SAMPLE_S of its end. A day
# at C = 500 then replays in seconds instead of an hour of per-token steps (tests/servers/sim/test_replay.py
# bounds the difference from stepping every token).
STEADY_WARMUP_S = 20.0
STEADY_WARMUP_ROUNDS = 10
STEADY_SAMPLE_S = 20.0
STEADY_SAMPLE_ROUNDS = 10
# After a small change of load (a share f of the clients new) both scale by f; a sample is never shorter than:
STEADY_MIN_SAMPLE_ROUNDS = 3
# Shipped example traces (`--trace k25-bursts` or a path).
TRACES_DIR = Path(__file__).with_name("traces")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message says where and why."""


class TracePhase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(gt=0, allow_inf_nan=False, description="how long this phase lasts (seconds)")
    concurrency: int = Field(ge=0, description="closed-loop clients during this phase")


_TRACE = TypeAdapter(list[TracePhase])


def load_trace(path: str | Path) -> list[TracePhase]:
    """A CSV with the header `duration_s,concurrency`, or a JSON list of {"duration_s", "concurrency"}; a bare
    name is a shipped trace (servers/sim/traces/NAME.csv) when no such file exists."""
    path = Path(path)
    if not path.exists() and (shipped := TRACES_DIR / f"{path}.csv").exists():
        path = shipped
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    return parse_trace(text, where=str(path), json_format=path.suffix.lower() == ".json")


def parse_trace(text: str, *, where: str = "trace", json_format: bool = False) -> list[TracePhase]:
    if json_format:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON: {exc}") from None
        label = "item"
    else:
        reader = csv.DictReader(io.StringIO(text))
        header = [name.strip() for name in reader.fieldnames or []]
        if header != ["duration_s", "concurrency"]:
            raise TraceError(f"{where}: the CSV header must be 'duration_s,concurrency', got {','.join(header)!r}")
        rows = []
        for line in csv.reader(io.StringIO(text)):
            if line and any(cell.strip() for cell in line):
                rows.append(line)
        rows = [dict(zip(header, (cell.strip() for cell in row), strict=False)) for row in rows[1:]]
        label = "row"
    if isinstance(rows, list) and not rows:
        raise TraceError(f"{where}: the trace has no phases")
    try:
        return _TRACE.validate_python(rows)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = list(error["loc"])
            position = f"{label} {loc.pop(0) + (2 if label == 'row' else 0)}" if loc and isinstance(loc[0], int) else ""
            field_name = ".".join(str(part) for part in loc)
            problems.append(": ".join(part for part in (position, field_name, error["msg"]) if part))
        raise TraceError(f"{where}: " + "; ".join(problems)) from None


@dataclass(frozen=True)
class SwitchTimes:
    """Durations (virtual seconds) a switch spends with no server serving."""

    stop_s: float = DEFAULT_STOP_S
    startup_s: dict[Mode, float] = field(default_factory=dict)  # weight loading of each mode's server
    release_s: dict[Mode, float] = field(default_factory=dict)
    resume_s: dict[Mode, float] = field(default_factory=dict)
    # Profiles (by name) that give no startup_s, when none was given for both: a restart cannot be costed.
    no_startup: tuple[str, ...] = ()

    @classmethod
    def from_profiles(
        cls,
        speculative: Profile,
        plain: Profile,
        *,
        stop_s: float = DEFAULT_STOP_S,
        startup_s: float | None = None,
        release_s: float | None = None,
        resume_s: float | None = None,
    ) -> SwitchTimes:
        """The profiles' `[memory]` figures (0 where a profile has none), each overridable for both modes."""
        profiles = {SPECULATIVE: speculative, PLAIN: plain}

        def read(name: str, override: float | None) -> dict[Mode, float]:
            if override is not None:
                return dict.fromkeys(profiles, override)
            return {mode: float(getattr(p.memory, name, 0.0) or 0.0) for mode, p in profiles.items()}

        startups = read("startup_s", startup_s)
        # 0 is what an absent [memory] startup_s reads as; no real server loads its weights in no time.
        no_startup = tuple(profiles[mode].name for mode in profiles if startup_s is None and not startups[mode])
        return cls(stop_s, startups, read("release_s", release_s), read("resume_s", resume_s), no_startup)

    def check(self, mechanism: str) -> None:
        """ValueError if `mechanism` cannot be costed from these times."""
        if mechanism == RESTART and self.no_startup:
            raise ValueError(
                f"restart needs each server's weight-loading time, and {' and '.join(self.no_startup)} gives no "
                "[memory] startup_s: a restart would look free. Give --startup-s SECONDS (or add startup_s to the "
                "profile), or leave restart out of --mechanism."
            )

    def seconds(self, mechanism: str, old: Mode, new: Mode) -> float:
        if mechanism == RESTART:
            return self.stop_s + self.startup_s.get(new, 0.0)
        if mechanism == SLEEP:
            return self.release_s.get(old, 0.0) + self.resume_s.get(new, 0.0)
        return 0.0

    def prior_s(self, mechanism: str) -> float:
        """The switch-cost estimate before any switch was measured: the mean of both directions."""
        both = self.seconds(mechanism, SPECULATIVE, PLAIN) + self.seconds(mechanism, PLAIN, SPECULATIVE)
        return both / 2


@dataclass(frozen=True)
class ReplaySetup:
    speculative: Profile
    plain: Profile
    settings: SwitchSettings
    times: SwitchTimes
    rates: CurveRates
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    seed: int = 0
    sample_period_s: float = DEFAULT_SAMPLE_PERIOD_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    fast_forward: bool = True  # repeat measured steady stretches instead of stepping them (STEADY_*)

    @classmethod
    def from_profiles(
        cls,
        speculative: Profile,
        plain: Profile,
        trace: list[TracePhase],
        *,
        times: SwitchTimes | None = None,
        threshold: float | None = None,
        hysteresis: float | None = None,
        min_dwell_s: float = DEFAULT_MIN_DWELL_S,
        window_s: float = DEFAULT_WINDOW_S,
        expected_phase_s: float | None = None,
        prior_phase_s: float = DEFAULT_PRIOR_PHASE_S,
        input_len: int = DEFAULT_INPUT_LEN,
        output_len: int = DEFAULT_OUTPUT_LEN,
        seed: int = 0,
        sample_period_s: float = DEFAULT_SAMPLE_PERIOD_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> ReplaySetup:
        rates = curve_rates(
            speculative, plain, _curve_loads(trace), input_len=input_len, output_len=output_len, seed=seed
        )
        if threshold is None:
            crossover = rates.crossover()
            threshold = math.inf if crossover is None else crossover
        if hysteresis is None:
            hysteresis = 0.0 if math.isinf(threshold) else math.floor(threshold * DEFAULT_HYSTERESIS_SHARE)
        settings = SwitchSettings(
            threshold=threshold,
            hysteresis=hysteresis,
            min_dwell_s=min_dwell_s,
            window_s=window_s,
            expected_phase_s=expected_phase_s,
            prior_phase_s=prior_phase_s,
            rates=rates,
        )
        return cls(
            speculative,
            plain,
            settings,
            times or SwitchTimes.from_profiles(speculative, plain),
            rates,
            input_len,
            output_len,
            seed,
            sample_period_s,
            drain_timeout_s,
        )


FREE_SWITCH = "free-switch"  # the oracle's own schedule: the faster mode per phase, switched for free


@dataclass(frozen=True)
class ReplayResult:
    mechanism: str
    output_tokens: int
    requests_completed: int
    switches: int
    switching_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_cut: int = 0  # in flight at a drain deadline
    follows: str | None = None  # the oracle: whose schedule gave its figures (FREE_SWITCH or a mechanism)

    def as_json(self, best_output_tokens: int | None = None) -> dict[str, object]:
        """Every column of the table; `vs_best_percent` against `best_output_tokens` (default: its own)."""
        best = best_output_tokens or self.output_tokens or 1
        return {
            "mechanism": self.mechanism,
            "follows": self.follows,
            "output_tokens": self.output_tokens,
            "vs_best_percent": round(100 * self.output_tokens / best, 2),
            "requests_completed": self.requests_completed,
            "requests_cut": self.requests_cut,
            "switches": self.switches,
            "switching_s": round(self.switching_s, 3),
            "ttft_p50_s": None if self.ttft_p50_s is None else round(self.ttft_p50_s, 4),
            "ttft_p99_s": None if self.ttft_p99_s is None else round(self.ttft_p99_s, 4),
        }


def curve_rates(
    speculative: Profile, plain: Profile, loads: Iterable[int], *, input_len: int, output_len: int, seed: int = 0
) -> CurveRates:
    """Both profiles' closed-loop output throughput at `loads` (virtual time, curve.py)."""
    points = {
        mode: [(c, _throughput(profile, c, input_len, output_len, seed)) for c in sorted(set(loads))]
        for mode, profile in ((SPECULATIVE, speculative), (PLAIN, plain))
    }
    return CurveRates.from_points(speculative=points[SPECULATIVE], plain=points[PLAIN])


@cache
def _throughput(profile: Profile, concurrency: int, input_len: int, output_len: int, seed: int) -> float:
    return run_level(profile, concurrency, input_len=input_len, output_len=output_len, seed=seed).output_throughput


def _curve_loads(trace: list[TracePhase]) -> list[int]:
    top = max(phase.concurrency for phase in trace)
    loads = {phase.concurrency for phase in trace if phase.concurrency > 0} | {1}
    c = 1
    while c < top:
        loads.add(c)
        c *= 2
    return sorted(loads)


@dataclass(eq=False, slots=True)
class _Request:
    arrival: float
    first_token_at: float | None = None


SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"


@dataclass(slots=True)
class _Steady:
    """What fast-forwarded stretches added (STEADY_*), and the stretch being measured."""

    since: float = 0.0  # when the current steady stretch began (a phase, a switch, a change of load)
    since_completed: int | None = None  # requests completed then (set at the first steady tick)
    change: float = 1.0  # how much of the load is new (0-1): scales the rounds of warm-up and sample
    sample: tuple[float, int, int, int] | None = None  # (t, tokens, completed, TTFTs seen) at its start
    tokens: float = 0.0
    completed: float = 0.0
    ttft_copies: list[tuple[list[float], float]] = field(default_factory=list)

    def reset(self, now: float, change: float = 1.0) -> None:
        if self.sample is None and self.since_completed is not None:
            change = max(change, self.change)  # still settling from the last change
        self.since, self.since_completed, self.sample, self.change = now, None, None, min(change, 1.0)

    def rounds(self, full: int) -> float:
        """Rounds of the closed loop to wait (or measure) after this change: `full` for a new load."""
        return max(full * self.change, 1.0)

    def add(self, tokens: float, completed: float, ttfts: list[float], copies: float) -> None:
        self.tokens += tokens
        self.completed += completed
        if ttfts and copies:
            self.ttft_copies.append((ttfts, copies))

    def settle(self, replay: _Replay) -> None:
        """Count the repeated stretches' first tokens with the others (whole copies; the rest by sampling)."""
        for ttfts, copies in self.ttft_copies:
            whole, part = divmod(copies, 1.0)
            replay.ttfts.extend(ttfts * int(whole))
            replay.ttfts.extend(ttfts[: round(part * len(ttfts))])
        self.ttft_copies.clear()


class _Replay:
    """One mechanism over one trace. Times are virtual (profile) seconds."""

    def __init__(self, setup: ReplaySetup, trace: list[TracePhase], mechanism: str):
        self.setup, self.trace, self.mechanism = setup, trace, mechanism
        self.engines = {
            SPECULATIVE: Engine(_closed_loop(setup.speculative), random.Random(setup.seed)),
            PLAIN: Engine(_closed_loop(setup.plain), random.Random(setup.seed + 1)),
        }
        for engine in self.engines.values():
            if not engine.fits(setup.input_len, setup.output_len):
                raise ValueError(
                    f"input_len + output_len = {setup.input_len + setup.output_len} exceeds a profile's KV pool"
                )
        if mechanism == IN_ENGINE:
            context = setup.input_len + setup.output_len // 2
            self.engines[SPECULATIVE].zero_steps_above_bs = zero_step_gate(setup.speculative, context)
        if mechanism == ALWAYS_PLAIN:
            self.mode: Mode = PLAIN
        elif mechanism == ORACLE:
            self.mode = self._best(trace[0].concurrency, SPECULATIVE)
        else:
            self.mode = SPECULATIVE
        self.state = SERVING
        self.mode_since = -math.inf
        self.owner: dict[Sequence, _Request] = {}  # live sequences on the serving (or draining) engine
        self.held: deque[_Request] = deque()  # waiting for the new mode during a switch
        self.outstanding = 0
        self.clients = 0
        self.step = None
        self.step_end = math.inf
        self.target: Mode = self.mode
        self.switch_started = self.switch_done = self.drain_deadline = math.inf
        # The controller's own stepper (gateway/switch_policy.py): the replay decides as production does.
        self.switcher = Switcher(SwitchCost(prior_s=setup.times.prior_s(mechanism)))
        self.ttfts: list[float] = []
        self.completed = self.cut = self.switches = 0
        self.switching_s = 0.0
        self.steady = _Steady()

    @property
    def engine(self) -> Engine:
        return self.engines[self.mode]

    def run(self) -> ReplayResult:
        setup = self.setup
        ends = list(_cumulative(p.duration_s for p in self.trace))
        end = ends[-1]
        phase = 0
        now = 0.0
        next_tick = 0.0
        self.clients = self.trace[0].concurrency
        self._top_up(now)
        while True:
            if self.step is None and self.state != SWITCHING:
                self.step = self.engine.next_step(now)
                if self.step is not None:
                    self.step_end = now + self.step.duration
                elif self.state == DRAINING:
                    self._begin_switch(now)
            step_end = self.step_end if self.step is not None else math.inf
            now = min(step_end, next_tick, ends[phase], self.switch_done, self.drain_deadline, end)
            if self.step is not None and self.step_end <= now:
                step, self.step = self.step, None
                self._finish_step(step, now)
            if now >= end:
                break
            if now >= ends[phase]:
                phase += 1
                self._enter_phase(self.trace[phase].concurrency, now)
            if self.state == SWITCHING and now >= self.switch_done:
                self._finish_switch(now)
            if self.state == DRAINING and now >= self.drain_deadline:
                self._cut(now)
                self._begin_switch(now)
            if now >= next_tick:
                self._tick(now)
                next_tick += setup.sample_period_s
                if setup.fast_forward:
                    now, next_tick = self._fast_forward(now, next_tick, ends[phase])
        if self.state != SERVING:
            self.switching_s += end - self.switch_started
        self.steady.settle(self)
        tokens = sum(engine.generated_total for engine in self.engines.values()) + round(self.steady.tokens)
        return ReplayResult(
            mechanism=self.mechanism,
            output_tokens=tokens,
            requests_completed=self.completed + round(self.steady.completed),
            switches=self.switches,
            switching_s=self.switching_s,
            ttft_p50_s=_quantile(self.ttfts, 0.50),
            ttft_p99_s=_quantile(self.ttfts, 0.99),
            requests_cut=self.cut,
        )

    # --- clients --------------------------------------------------------------------------------------

    def _top_up(self, now: float) -> None:
        while self.outstanding < self.clients:
            self.outstanding += 1
            request = _Request(arrival=now)
            if self.state == SERVING:
                self._submit(request, self.setup.input_len, self.setup.output_len, now)
            else:
                self.held.append(request)

    def _submit(self, request: _Request, input_tokens: int, max_new_tokens: int, now: float) -> None:
        seq = Sequence(input_tokens, max_new_tokens)
        self.engine.submit(seq, now)
        self.owner[seq] = request

    def _finish_step(self, step, now: float) -> None:
        # The engine stamps each sequence's first token; reading it at the finish keeps this loop off the
        # batch (per step it would cost as much as the step itself at C = 500).
        _, finished = self.engine.finish_step(step, now)
        for seq in finished:
            request = self.owner.pop(seq)
            self.completed += 1
            self.outstanding -= 1
            first = request.first_token_at if request.first_token_at is not None else seq.first_token_at
            if first is not None:
                self.ttfts.append(first - request.arrival)
        if finished:
            self._top_up(now)

    def _enter_phase(self, concurrency: int, now: float) -> None:
        # A small change of load settles sooner: only the clients that joined (or left) are out of place.
        self.steady.reset(now, abs(concurrency - self.clients) / max(concurrency, self.clients, 1))
        # Fewer clients: the extra ones simply send nothing after their current request ends.
        self.clients = concurrency
        if self.mechanism == ORACLE and concurrency > 0:
            best = self._best(concurrency, self.mode)
            if best != self.mode:
                self._migrate(best, now)
        self._top_up(now)

    # --- steady phases (STEADY_*) -------------------------------------------------------------------

    def _steady_now(self, now: float) -> bool:
        """Serving the phase's clients, every one in flight, nothing held: a stretch that repeats."""
        return self.state == SERVING and not self.held and self.clients > 0 and self.outstanding == self.clients

    def _fast_forward(self, now: float, next_tick: float, phase_end: float) -> tuple[float, float]:
        """At a tick: measure a steady stretch, then repeat it tick by tick while the policy stays put."""
        steady, period = self.steady, self.setup.sample_period_s
        if not self._steady_now(now):
            steady.reset(now)
            return now, next_tick
        if steady.since_completed is None:
            steady.since_completed = self.completed
        rounds = (self.completed - steady.since_completed) / self.clients
        if now - steady.since < STEADY_WARMUP_S or rounds < steady.rounds(STEADY_WARMUP_ROUNDS):
            return now, next_tick
        if steady.sample is None:
            steady.sample = (now, self._tokens(), self.completed, len(self.ttfts))
            return now, next_tick
        t0, tokens0, completed0, ttfts0 = steady.sample
        sample_rounds = max(steady.rounds(STEADY_SAMPLE_ROUNDS), STEADY_MIN_SAMPLE_ROUNDS)
        if now - t0 < STEADY_SAMPLE_S or self.completed - completed0 < sample_rounds * self.clients:
            return now, next_tick
        span = now - t0
        tokens_rate = (self._tokens() - tokens0) / span
        # Every request ends with output_len tokens: completions follow the tokens (they come in lumps).
        completed_rate = tokens_rate / self.setup.output_len
        ttfts, skipped = self.ttfts[ttfts0:], 0.0
        # Repeat the stretch while the phase has room and each tick (the real policy, same constant load) stays.
        while next_tick + STEADY_SAMPLE_S <= phase_end and self.state == SERVING:
            now, next_tick = next_tick, next_tick + period
            skipped += period
            self._tick(now)
        steady.add(skipped * tokens_rate, skipped * completed_rate, ttfts, skipped / span)
        self._shift(skipped)
        steady.reset(now)
        return now, next_tick

    def _tokens(self) -> int:
        return sum(engine.generated_total for engine in self.engines.values())

    def _shift(self, delta: float) -> None:
        """Move everything in flight `delta` later: the skipped stretch ended where the measured one did."""
        if not delta:
            return
        for engine in self.engines.values():
            engine.shift_clock(delta)
        for request in self.owner.values():
            request.arrival += delta
            if request.first_token_at is not None:
                request.first_token_at += delta
        if self.step is not None:
            self.step_end += delta

    # --- switching ------------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        setup = self.setup
        self.switcher.observe(now, self.outstanding, setup.settings)
        if self.mechanism not in (RESTART, SLEEP) or self.state != SERVING:
            return
        decision = self.switcher.decide(now, mode=self.mode, mode_since=self.mode_since, settings=setup.settings)
        if decision.switch:
            self.switches += 1
            self.target = decision.mode
            self.state = DRAINING
            self.switch_started = now
            self.drain_deadline = now + setup.drain_timeout_s

    def _cut(self, now: float) -> None:
        """The drain deadline: what still runs on the old mode ends with an error; its clients send again."""
        for seq in list(self.owner):
            self.engine.abort(seq)
            del self.owner[seq]
            self.cut += 1
            self.outstanding -= 1
        self.step = None
        self._top_up(now)

    def _begin_switch(self, now: float) -> None:
        self.state = SWITCHING
        self.step = None
        self.drain_deadline = math.inf
        self.switch_done = now + self.setup.times.seconds(self.mechanism, self.mode, self.target)

    def _finish_switch(self, now: float) -> None:
        self.steady.reset(now)
        duration = now - self.switch_started
        self.switching_s += duration
        self.switcher.switched(duration)
        self.mode, self.mode_since, self.state = self.target, now, SERVING
        self.switch_started = self.switch_done = math.inf
        while self.held:
            self._submit(self.held.popleft(), self.setup.input_len, self.setup.output_len, now)

    def _migrate(self, best: Mode, now: float) -> None:
        """The oracle's free switch: requests in flight carry on in the new mode from where they were."""
        old, moving = self.engine, list(self.owner.items())
        self.owner.clear()
        self.step = None
        self.mode, self.mode_since = best, now
        self.switches += 1
        for seq, request in moving:
            if request.first_token_at is None:
                request.first_token_at = seq.first_token_at  # its first token came from the old mode
            old.abort(seq)
            self._submit(request, seq.input_tokens + seq.generated, seq.max_new_tokens - seq.generated, now)

    def _best(self, concurrency: int, current: Mode) -> Mode:
        rates = self.setup.rates
        spec, plain = rates.throughput(SPECULATIVE, concurrency), rates.throughput(PLAIN, concurrency)
        if spec == plain:
            return current
        return SPECULATIVE if spec > plain else PLAIN


def zero_step_gate(profile: Profile, context_tokens: int) -> int | None:
    """The largest batch that still speculates: above it a zero-step step yields more tokens per second than a
    speculative one (accept length x batch / step time), at `context_tokens` per request. None: never."""
    costs = make_costs(profile)
    assert profile.speculative is not None
    accept = profile.speculative.accept_length
    for batch in range(1, profile.limits.max_running_requests + 1):
        context = batch * context_tokens
        if batch / costs.zero_step_s(batch, context, False) > batch * accept / costs.decode_s(batch, context, batch):
            return batch - 1
    return None


def replay(
    setup: ReplaySetup, trace: list[TracePhase], mechanism: str, known: dict[str, ReplayResult] | None = None
) -> ReplayResult:
    """One mechanism over the trace. `known`: results already replayed on this setup and trace (the oracle
    reuses them, and adds what it replays)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    if not trace:
        raise ValueError("the trace has no phases")
    setup.times.check(mechanism)
    known = {} if known is None else known
    if mechanism not in known:
        known[mechanism] = (
            _oracle(setup, trace, known) if mechanism == ORACLE else _Replay(setup, trace, mechanism).run()
        )
    return known[mechanism]


def replay_all(setup: ReplaySetup, trace: list[TracePhase], mechanisms: Iterable[str]) -> list[ReplayResult]:
    """Each mechanism over the trace, each replayed once (the oracle's bound reuses the others)."""
    known: dict[str, ReplayResult] = {}
    return [replay(setup, trace, mechanism, known) for mechanism in mechanisms]


def _oracle(setup: ReplaySetup, trace: list[TracePhase], known: dict[str, ReplayResult]) -> ReplayResult:
    """The best schedule of all: free switching, or any other mechanism's where it did better."""
    candidates = [replace(_Replay(setup, trace, ORACLE).run(), follows=FREE_SWITCH)]
    for mechanism in MECHANISMS:
        if mechanism == ORACLE:
            continue
        try:
            setup.times.check(mechanism)
        except ValueError:
            continue  # a mechanism that cannot be costed is not replayed, so there is nothing to bound
        candidates.append(replace(replay(setup, trace, mechanism, known), follows=mechanism))
    best = max(candidates, key=lambda result: result.output_tokens)  # the first of equals: free switching
    return replace(best, mechanism=ORACLE)


def _closed_loop(profile: Profile) -> Profile:
    # Closed-loop clients wait rather than give up, so a queue bound would only make them spin (as curve.py).
    return replace(profile, limits=replace(profile.limits, max_queued_requests=None))


def _cumulative(values: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for value in values:
        total += value
        yield total


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_command(args) -> int:
    """`crossover sim replay` (its arguments are declared in cli.py)."""
    import sys

    from crossover.servers.sim.profile import ProfileError, load_profile, with_overrides

    mechanisms = [m.strip() for m in args.mechanism.split(",") if m.strip()]
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown or not mechanisms:
        print(
            f"crossover sim replay: error: --mechanism takes a comma-separated list of {', '.join(MECHANISMS)}; "
            f"got {args.mechanism!r}",
            file=sys.stderr,
        )
        return 2
    try:
        speculative = with_overrides(load_profile(args.speculative), accept_length=args.accept_length)
        plain = load_profile(args.plain)
        trace = load_trace(args.trace)
        times = SwitchTimes.from_profiles(
            speculative,
            plain,
            stop_s=_given(args.stop_s, DEFAULT_STOP_S),
            startup_s=args.startup_s,
            release_s=args.release_s,
            resume_s=args.resume_s,
        )
        setup = ReplaySetup.from_profiles(
            speculative,
            plain,
            trace,
            times=times,
            threshold=args.threshold,
            hysteresis=args.hysteresis,
            min_dwell_s=_given(args.min_dwell_s, DEFAULT_MIN_DWELL_S),
            window_s=_given(args.window_s, DEFAULT_WINDOW_S),
            expected_phase_s=args.expected_phase_s,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            drain_timeout_s=_given(args.drain_timeout_s, DEFAULT_DRAIN_TIMEOUT_S),
        )
        setup = replace(setup, fast_forward=not getattr(args, "exact", False))
        results = replay_all(setup, trace, mechanisms)
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"crossover sim replay: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        best = max(r.output_tokens for r in results)
        print(json.dumps([r.as_json(best) for r in results], indent=2))
        return 0
    print(describe(setup, trace))
    print(format_table(results))
    return 0


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def describe(setup: ReplaySetup, trace: list[TracePhase]) -> str:
    s, t = setup.settings, setup.times
    spec = setup.speculative.speculative
    accept = f" (accept length {spec.accept_length:g})" if spec else ""
    total = sum(p.duration_s for p in trace)
    return (
        f"{setup.speculative.name}{accept} / {setup.plain.name}: {len(trace)} phases, {total:g} s, "
        f"{setup.input_len} input / {setup.output_len} output tokens; virtual time, profile seconds\n"
        f"policy: threshold {s.threshold:g} hysteresis {s.hysteresis:g} min dwell {s.min_dwell_s:g} s "
        f"window {s.window_s:g} s, expected phase "
        f"{'learned' if s.expected_phase_s is None else f'{s.expected_phase_s:g} s'}; drain deadline "
        f"{setup.drain_timeout_s:g} s\n"
        f"switch: restart {t.seconds(RESTART, SPECULATIVE, PLAIN):g} s to plain / "
        f"{t.seconds(RESTART, PLAIN, SPECULATIVE):g} s back, sleep {t.seconds(SLEEP, SPECULATIVE, PLAIN):g} s / "
        f"{t.seconds(SLEEP, PLAIN, SPECULATIVE):g} s (without the drain)"
    )


def format_table(results: list[ReplayResult]) -> str:
    best = max((r.output_tokens for r in results), default=0) or 1

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    names = [r.mechanism if r.follows in (None, FREE_SWITCH) else f"{r.mechanism} (= {r.follows})" for r in results]
    width = max([20, *map(len, names)])
    lines = [
        f"{'mechanism':<{width}} {'output tokens':>14} {'vs best':>8} {'completed':>10} {'cut':>5} {'switches':>9} "
        f"{'switching s':>12} {'TTFT p50 s':>11} {'TTFT p99 s':>11}"
    ]
    for name, r in zip(names, results, strict=True):
        lines.append(
            f"{name:<{width}} {r.output_tokens:>14} {100 * r.output_tokens / best:>7.1f}% "
            f"{r.requests_completed:>10} {r.requests_cut:>5} {r.switches:>9} {r.switching_s:>12.1f} "
            f"{seconds(r.ttft_p50_s):>11} {seconds(r.ttft_p99_s):>11}"
        )
    return "\n".join(lines)
