"""Would time-sharing pay on my traffic, with my switch time, under my gateway's settings? A load trace through
both stand-in engines and the gateway's own switching decision, in virtual time.

    trace = load_trace("trace.csv")                   # duration_s,concurrency - one closed-loop phase a row
    switch = SwitchSettings.of(load_settings(path))   # a gateway's own (gateway/config.py); None: its defaults
    setup = ReplaySetup.from_profiles(load_profile("k25-eagle3"), load_profile("k25-plain"), trace, switch=switch)
    results = replay_all(setup, trace, MECHANISMS)

One engine per mode (lazy_engine.py: the live stand-in's engine.py, each request's decode steps drawn once).
Each phase runs `concurrency` clients in a closed loop (each sends its next request the moment its last one
ends). Only one mode serves at a time:

- `always-speculative`, `always-plain`: one mode throughout, no switches.
- `restart`, `sleep`: the gateway's switch controller, as its settings (`SwitchSettings`: threshold,
  hysteresis, [switching]) make it: every `interval` the load (requests in flight + held) is sampled into the
  `Switcher` that `SwitchSettings.switcher()` builds - the live controller's very stepper and gain rule - on
  the virtual clock, from its initial mode at t = 0. On a switch, the requests in flight drain (finish) on the
  old mode up to `drain_deadline` (then they are cut and counted), new requests wait for the new mode, and
  the switch itself takes the profiles' cost: restart = stop + the new server's `startup_s`; sleep = the old
  server's `release_s` + the new one's `resume_s`. The measured duration (decision to serving again) feeds
  the running switch-cost estimate, which starts at the gateway's prior (`initial_cost`), as live; where none
  is given, a restart's prior is the replayed restart's duration (`ReplaySetup.prior_s`).
- `in-engine`: the speculative engine alone, patched (patches/sglang-0.5.23): decode batches above its gate
  run zero draft steps (engine.py's gate, costs.py's ZERO_STEP_MODEL), in the speculative server's KV pool
  and running cap. Nothing switches, nothing waits. The gate is where a zero-step step out-yields a
  speculative one *in the same server* (`zero_step_gate`), not the crossover against the plain server: what
  the plain server wins by its larger pool and cap, the gate cannot win back. Its result carries what it
  assumed (`InEngineAssumptions`: gate, cost model, pool, cap); the cap is the speculative profile's
  (`with_overrides(max_running_requests=N)`, `--max-running-requests N`).
- `oracle`: the best of all the others (`follows` names it).

Beside them, the *free-switch bound* (`free_switch_bound`): a perfect, free switch - in each phase the better
fixed mode's tokens, nothing lost to a drain or a switch - and each mechanism's share of it.

Restart's cost is the new server's weight loading (`[memory] startup_s`). A profile that does not give it would
make a restart look free, so `restart` is refused unless both profiles give it or `--startup-s` does.

Without a gateway config the threshold is the profiles' crossover (curve.py's closed loop, found by bisection):
where `crossover bench` would tell an operator to put it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import TYPE_CHECKING, NamedTuple

from crossover.gateway.config import (
    MAX_THRESHOLD,
    AdaptiveSettings,
    Mechanism,
    SwitchSettings,
    TopologyName,
    fit_hysteresis,
)
from crossover.gateway.modes import PLAIN, SPECULATIVE, Mode
from crossover.gateway.policies import PolicySettings
from crossover.servers.sim.costs import ZERO_STEP_MODEL, make_costs
from crossover.servers.sim.curve import CurvePoint, run_level
from crossover.servers.sim.engine import Engine, Sequence
from crossover.servers.sim.lazy_engine import LazyEngine
from crossover.servers.sim.profile import Profile
from crossover.servers.sim.trace import TracePhase, shifts_acceptance

if TYPE_CHECKING:
    from crossover.servers.sim.replay_adaptive import AdaptiveReplay

# The replay's model: what it answers for a given trace and profiles. Raised whenever a change moves the answers,
# with the change and its reason at the head of servers/sim/CHANGELOG.md; printed in the text and the JSON.
MODEL_VERSION = 3

ALWAYS_SPECULATIVE = "always-speculative"
ALWAYS_PLAIN = "always-plain"
RESTART: Mechanism = "restart"
SLEEP: Mechanism = "sleep"
ORACLE = "oracle"
IN_ENGINE: TopologyName = "in-engine"
# Partitioned pools, the threshold moved by the adaptive controller (replay_adaptive.py); not one the oracle picks
# from (the others time-share one mode), and the only one that replays a trace's shifts of acceptance.
ADAPTIVE = "adaptive"
MECHANISMS = (ALWAYS_SPECULATIVE, ALWAYS_PLAIN, RESTART, SLEEP, IN_ENGINE, ORACLE, ADAPTIVE)
# What `crossover sim replay` replays without --mechanism.
DEFAULT_MECHANISMS = (ALWAYS_SPECULATIVE, ALWAYS_PLAIN, RESTART, SLEEP, IN_ENGINE, ORACLE)

DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 512
# Stopping a server (SIGTERM to its process group, GPUs free again) before a restart loads the other.
DEFAULT_STOP_S = 5.0
# Steady phases are fast-forwarded (virtual seconds): once a phase has served the same clients in one mode for
# STEADY_WARMUP_ROUNDS x clients requests (STEADY_SETTLE_ROUNDS for a speculative loop that STEADY_CROWD or more
# of its clients joined at once: they drift apart as their accept lengths differ, for tens of rounds, at a rate a
# few percent off), the replay measures stretches of STEADY_SAMPLE_ROUNDS x clients requests, each from one
# completion to the one whole rounds later (the same point of the loop's cycle, so a lumpy loop's rate is not
# sampled off its beat), each speculative one's decode time scaled by its steps' expectation over their draws (a
# short stretch of lucky accept lengths is not a lucky rate). Once two in a row agree within STEADY_AGREEMENT it
# repeats their output in whole rounds, tick by tick, asking the policy every sampling period as usual, until the
# policy switches or the phase ends; until then it steps every token. A day at C = 500 then replays in seconds
# instead of an hour of per-token steps (tests/servers/sim/test_replay.py bounds the difference from stepping
# every token, a steep curve in alternating phases too). The stretch is the replay's own, not a curve's level: a
# closed loop's state depends on its history (clients that joined together stay in step), and a level from a
# cold start differs from it by a few percent.
STEADY_WARMUP_ROUNDS = 2
STEADY_SETTLE_ROUNDS = 20
STEADY_CROWD = 0.5
STEADY_SAMPLE_ROUNDS = 2
STEADY_AGREEMENT = 0.005
# After a small change of load (a share f of the clients new) both scale by f; a sample is never shorter than:
STEADY_MIN_SAMPLE_ROUNDS = 1
# ... nor than this many requests (a few clients' rounds are a noisy sample of accept lengths; more would cost
# thousands of steps a phase at a handful of clients).
STEADY_MIN_SAMPLE_REQUESTS = 16
# ... and a warm-up never shorter than:
STEADY_MIN_ROUNDS = 0.25
# Rounds a curve's level is measured over (after one of warm-up; at least curve.MIN_MEASURED_REQUESTS).
STEADY_LEVEL_ROUNDS = 1


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


@dataclass(frozen=True)
class ReplaySetup:
    speculative: Profile
    plain: Profile
    switch: SwitchSettings  # the gateway's own switch settings (gateway/config.py), as its controller runs them
    times: SwitchTimes
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    seed: int = 0
    fast_forward: bool = True  # repeat measured steady stretches instead of stepping them (STEADY_*)
    # The gateway's `[adaptive]` (window, limits) that `adaptive` runs; its table is the replay's own.
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)

    def prior_s(self, mechanism: Mechanism) -> float:
        """What the policy believes a switch costs until it has measured one: the gateway's `initial_cost` where
        given; else a restart's is the replayed restart (stop + start-up, the mean of both ways: an operator
        who knows the start-up time sets it), a sleep's the gateway's default."""
        if mechanism == RESTART and self.switch.initial_cost is None and not self.times.no_startup:
            return (
                self.times.seconds(RESTART, SPECULATIVE, PLAIN) + self.times.seconds(RESTART, PLAIN, SPECULATIVE)
            ) / 2
        return self.switch.prior_s(mechanism)

    @cached_property
    def settings(self) -> PolicySettings:
        return self.switch.policy()

    @classmethod
    def from_profiles(
        cls,
        speculative: Profile,
        plain: Profile,
        trace: list[TracePhase],
        *,
        switch: SwitchSettings | None = None,
        times: SwitchTimes | None = None,
        input_len: int = DEFAULT_INPUT_LEN,
        output_len: int = DEFAULT_OUTPUT_LEN,
        seed: int = 0,
        adaptive: AdaptiveSettings | None = None,
        **overrides: float | None,
    ) -> ReplaySetup:
        """`switch`: a gateway's (SwitchSettings.of(load_settings(path))); None: the gateway's defaults with
        the threshold at the profiles' crossover. `adaptive`: a gateway's `[adaptive]` (None: its defaults).
        `overrides`: SwitchSettings fields (None: not given)."""
        given = {name: value for name, value in overrides.items() if value is not None}
        if switch is None and "threshold" not in given:
            top = max(phase.concurrency for phase in trace)
            crossover = profiles_crossover(
                speculative, plain, top, input_len=input_len, output_len=output_len, seed=seed
            )
            given["threshold"] = MAX_THRESHOLD if crossover is None else crossover
        switch = switch or SwitchSettings()
        if "threshold" in given and "hysteresis" not in given:
            given["hysteresis"] = fit_hysteresis(int(given["threshold"]), switch.hysteresis)  # as the gateway does
        switch = SwitchSettings.model_validate({**switch.model_dump(), **given})
        times = times or SwitchTimes.from_profiles(speculative, plain)
        adaptive = adaptive or AdaptiveSettings()
        return cls(speculative, plain, switch, times, input_len, output_len, seed, adaptive=adaptive)


def free_switch_bound(setup: ReplaySetup, trace: list[TracePhase], known: dict[str, ReplayResult]) -> float:
    """Output tokens of a perfect, free switch: in each phase the better fixed mode's (as replayed), no drain
    and no switch time. `known`: results replayed so far (the fixed modes are replayed if not there)."""
    fixed = [replay(setup, trace, mechanism, known).phase_tokens for mechanism in (ALWAYS_SPECULATIVE, ALWAYS_PLAIN)]
    return float(sum(max(both) for both in zip(*fixed, strict=True)))


class SwitchEvent(NamedTuple):
    """A switch the policy decided: when (virtual seconds), to which mode, its reason, and how long it took until
    the new mode served (None: the trace ended first)."""

    t: float
    to: Mode
    reason: str
    duration_s: float | None = None


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
    follows: str | None = None  # the oracle: the mechanism whose figures it has (the best of all)
    phase_tokens: tuple[float, ...] = field(default=(), repr=False)  # output tokens of each phase of the trace
    switch_log: tuple[SwitchEvent, ...] = ()  # each switch the policy decided
    running_peak: int = 0  # the most requests running at once on the serving engine (its cap bounds it)
    in_engine: InEngineAssumptions | None = None  # what the in-engine replay assumed (None: another mechanism)
    adaptive: AdaptiveReplay | None = None  # adaptive's threshold and what it is compared with (None: another)

    def as_json(self, best_output_tokens: int | None = None, free_switch_tokens: float | None = None) -> dict:
        """Every column of the table; `vs_best_percent` against `best_output_tokens` (default: its own),
        `vs_free_switch_percent` against `free_switch_tokens` (free_switch_bound; None: left out)."""
        best = best_output_tokens or self.output_tokens or 1
        free = {}
        if free_switch_tokens is not None:
            free = {
                "free_switch_output_tokens": round(free_switch_tokens),
                "vs_free_switch_percent": round(100 * self.output_tokens / (free_switch_tokens or 1), 2),
            }
        return {
            "mechanism": self.mechanism,
            "model_version": MODEL_VERSION,
            "follows": self.follows,
            "output_tokens": self.output_tokens,
            "vs_best_percent": round(100 * self.output_tokens / best, 2),
            **free,
            "requests_completed": self.requests_completed,
            "requests_cut": self.requests_cut,
            "switches": self.switches,
            "switching_s": round(self.switching_s, 3),
            "ttft_p50_s": None if self.ttft_p50_s is None else round(self.ttft_p50_s, 4),
            "ttft_p99_s": None if self.ttft_p99_s is None else round(self.ttft_p99_s, 4),
            "switch_log": [event._asdict() for event in self.switch_log],
            "running_peak": self.running_peak,
            "in_engine": None if self.in_engine is None else self.in_engine._asdict(),
            "adaptive": None if self.adaptive is None else self.adaptive.as_json(),
        }


class InEngineAssumptions(NamedTuple):
    """What `in-engine` ran on: the gate (None: speculation out-yields a zero-step step at every batch up to
    the cap, so it never engages), the context it was found at, the zero-step cost model, and the pool."""

    gate: int | None
    gate_context_tokens: int
    zero_step_model: str
    pool: str  # the speculative server's profile: the patched engine serves in its KV pool
    kv_pool_tokens: int
    max_running_requests: int

    @classmethod
    def of(cls, setup: ReplaySetup) -> InEngineAssumptions:
        # A request holds its input and, on average over its life, half its output.
        context = setup.input_len + setup.output_len // 2
        limits = setup.speculative.limits
        gate = zero_step_gate(setup.speculative, context)
        return cls(
            gate,
            context,
            ZERO_STEP_MODEL,
            setup.speculative.name,
            limits.max_total_num_tokens,
            limits.max_running_requests,
        )


def profiles_crossover(
    speculative: Profile, plain: Profile, top: int, *, input_len: int, output_len: int, seed: int = 0
) -> int | None:
    """The lowest concurrency (up to `top`, or the next power of two) from which plain serves at least as
    many tokens per second as speculative in a closed loop (curve.py); None: it never does."""

    def plain_wins(c: int) -> bool:
        spec = steady_level(speculative, c, input_len, output_len, seed).output_throughput
        return steady_level(plain, c, input_len, output_len, seed).output_throughput >= spec

    below, c = 0, 1
    while not plain_wins(c):
        if c >= top:
            return None
        below, c = c, c * 2
    while c - below > 1:  # plain wins at c, not at below (or below is 0): halve the gap
        middle = (below + c) // 2
        below, c = (below, middle) if plain_wins(middle) else (middle, c)
    return c


@cache
def steady_level(profile: Profile, concurrency: int, input_len: int, output_len: int, seed: int = 0) -> CurvePoint:
    """A mode's closed loop at `concurrency` (curve.py), once per process."""
    return run_level(
        profile,
        concurrency,
        input_len=input_len,
        output_len=output_len,
        seed=seed,
        measured_rounds=STEADY_LEVEL_ROUNDS,
        engine_type=LazyEngine,
    )


@dataclass(eq=False, slots=True)
class _Request:
    arrival: float
    first_token_at: float | None = None


SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"


class _Stretch(NamedTuple):
    """A measured steady stretch: its tokens per second, its first-token times, its length, and one round's."""

    rate: float
    ttfts: list[float]
    span: float
    round_s: float


class _Mark(NamedTuple):
    """The replay's totals at a completion, where a measured stretch begins or ends."""

    t: float
    tokens: float
    completed: int
    ttfts: int  # first-token times seen
    decode_s: float  # time spent in decode steps
    steps_drawn: int  # speculative decode steps drawn (LazyEngine), and their expectation
    steps_expected: float

    def rate(self, start: _Mark) -> float:
        """Tokens per second since `start`, as if acceptance had been as lucky as its mean: the decode time
        scaled by expected over drawn steps, so a short stretch of a speculative loop is not a lucky one."""
        decode_s = self.decode_s - start.decode_s
        drawn = self.steps_drawn - start.steps_drawn
        if drawn:
            decode_s *= (self.steps_expected - start.steps_expected) / drawn - 1
        else:
            decode_s = 0.0
        return (self.tokens - start.tokens) / (self.t - start.t + decode_s)


@dataclass(slots=True)
class _Steady:
    """What fast-forwarded stretches added (STEADY_*), and the stretch being measured."""

    since: float = 0.0  # when the current steady stretch began (a phase, a switch, a change of load)
    since_completed: int | None = None  # requests completed then (set at the first steady tick)
    change: float = 1.0  # how much of the load is new (0-1): scales the rounds of warm-up and sample
    sample: _Mark | None = None  # where the stretch being measured began
    measured: _Stretch | None = None  # kept while the load stays the same
    # The last stretch measured: (its tokens/s, its start as `sample`), for the next one to agree with.
    previous: tuple[float, _Mark] | None = None
    tokens: float = 0.0
    completed: float = 0.0
    ttft_copies: list[tuple[list[float], float]] = field(default_factory=list)

    def reset(self, now: float, change: float = 1.0) -> None:
        if self.sample is None and self.since_completed is not None:
            change = max(change, self.change)  # still settling from the last change
        self.since, self.since_completed, self.sample, self.change = now, None, None, min(change, 1.0)
        self.measured = self.previous = None

    def rounds(self, full: int) -> float:
        """Rounds of the closed loop to wait (or measure) after this change: `full` for a new load."""
        return max(full * self.change, STEADY_MIN_ROUNDS)

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

    def __init__(
        self,
        setup: ReplaySetup,
        trace: list[TracePhase],
        mechanism: str,
        on_sample: Callable[[float, int], None] | None = None,
    ):
        """`on_sample(t, load)`: each load sample the policy is given, as it is given."""
        self.setup, self.trace, self.mechanism = setup, trace, mechanism
        self.engines = {
            SPECULATIVE: LazyEngine(_closed_loop(setup.speculative), random.Random(setup.seed)),
            PLAIN: LazyEngine(_closed_loop(setup.plain), random.Random(setup.seed + 1)),
        }
        for engine in self.engines.values():
            if not engine.fits(setup.input_len, setup.output_len):
                raise ValueError(
                    f"input_len + output_len = {setup.input_len + setup.output_len} exceeds a profile's KV pool"
                )
        self.in_engine = InEngineAssumptions.of(setup) if mechanism == IN_ENGINE else None
        if self.in_engine is not None:
            self.engines[SPECULATIVE].zero_steps_above_bs = self.in_engine.gate
        if mechanism == ALWAYS_PLAIN:
            self.mode: Mode = PLAIN
        else:
            self.mode = setup.switch.initial_mode
        self.state = SERVING
        self.mode_since = 0.0  # the gateway starts serving its initial mode with the trace
        self.owner: dict[Sequence, _Request] = {}  # live sequences on the serving (or draining) engine
        self.held: deque[_Request] = deque()  # waiting for the new mode during a switch
        self.outstanding = 0
        self.clients = 0
        self.step = None
        self.step_end = math.inf
        self.target: Mode = self.mode
        self.switch_started = self.switch_done = self.drain_deadline = math.inf
        # The controller's own stepper (gateway/policies/switcher.py): the replay decides as production does.
        switch = setup.switch
        if mechanism in (RESTART, SLEEP):
            switch = switch.model_copy(update={"initial_cost": setup.prior_s(mechanism)})
        self.switcher = switch.switcher(mechanism if mechanism in (RESTART, SLEEP) else None)
        self.ttfts: list[float] = []
        self.completed = self.cut = self.switches = 0
        self.switching_s = 0.0
        self.running_peak = 0
        self.decode_s = 0.0  # time spent in decode steps (_Mark)
        self.steady = _Steady()
        self.phase_tokens: list[float] = []
        self.switch_log: list[SwitchEvent] = []
        self.on_sample = on_sample

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
                self._phase_ended()
                phase += 1
                self._enter_phase(self.trace[phase].concurrency, now)
            if self.state == SWITCHING and now >= self.switch_done:
                self._finish_switch(now)
            if self.state == DRAINING and now >= self.drain_deadline:
                self._cut(now)
                self._begin_switch(now)
            if now >= next_tick:
                self._tick(now)
                next_tick += setup.switch.interval
                if setup.fast_forward:
                    now, next_tick = self._fast_forward(now, next_tick, ends[phase])
        if self.state != SERVING:
            self.switching_s += end - self.switch_started
        self.steady.settle(self)
        self._phase_ended()
        tokens = round(self._served())
        return ReplayResult(
            mechanism=self.mechanism,
            output_tokens=tokens,
            requests_completed=self.completed + round(self.steady.completed),
            switches=self.switches,
            switching_s=self.switching_s,
            ttft_p50_s=_quantile(self.ttfts, 0.50),
            ttft_p99_s=_quantile(self.ttfts, 0.99),
            requests_cut=self.cut,
            phase_tokens=tuple(self.phase_tokens),
            switch_log=tuple(self.switch_log),
            running_peak=self.running_peak,
            in_engine=self.in_engine,
        )

    def _served(self) -> float:
        return self._tokens() + self.steady.tokens

    def _phase_ended(self) -> None:
        self.phase_tokens.append(self._served() - sum(self.phase_tokens))

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
        self.running_peak = max(self.running_peak, self.engine.num_running)
        if step.kind == "decode":
            self.decode_s += step.duration
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
            if self.setup.fast_forward:
                self._measure(now)

    def _enter_phase(self, concurrency: int, now: float) -> None:
        if concurrency == self.clients:
            return  # the same load goes on: so does its stretch, measured or not
        # A small change of load settles sooner: only the clients that joined (or left) are out of place.
        self.steady.reset(now, abs(concurrency - self.clients) / max(concurrency, self.clients, 1))
        # Fewer clients: the extra ones simply send nothing after their current request ends.
        self.clients = concurrency
        self._top_up(now)

    # --- steady phases (STEADY_*) -------------------------------------------------------------------

    def _steady_now(self) -> bool:
        """Serving the phase's clients, every one in flight, nothing held: a stretch that repeats."""
        return self.state == SERVING and not self.held and self.clients > 0 and self.outstanding == self.clients

    def _fast_forward(self, now: float, next_tick: float, phase_end: float) -> tuple[float, float]:
        """At a tick: once a steady stretch is measured (_measure, at completions), repeat it tick by tick while
        the policy stays put."""
        steady, period = self.steady, self.setup.switch.interval
        if not self._steady_now():
            # Leavers still in flight settle the same change (a switch resets it in full).
            steady.reset(now, steady.change)
            return now, next_tick
        if steady.since_completed is None:
            steady.since_completed = self.completed
        if steady.measured is None:
            return now, next_tick
        tokens_rate, ttfts, span, round_s = steady.measured
        # Whole copies of the stretch: the loop then stands where it stood, at the same point of its cycle, and
        # the phase's end sees the requests in flight that stepping would have seen.
        until = now + round_s * math.floor((phase_end - now) / round_s)
        start = now
        # Repeat the stretch while the phase has room and each tick (the real policy, same constant load) stays.
        while next_tick <= until and self.state == SERVING:
            now, next_tick = next_tick, next_tick + period
            self._tick(now)
        if self.state == SERVING:
            now = max(now, until)
        skipped = now - start
        # Every request ends with output_len tokens: completions follow the tokens (they come in lumps).
        steady.add(skipped * tokens_rate, skipped * tokens_rate / self.setup.output_len, ttfts, skipped / span)
        self._shift(skipped)
        return now, next_tick

    def _measure(self, now: float) -> None:
        """At a completion while steady: warm up, then measure a stretch from one completion to the one that
        ends whole rounds later (each client served as often: the same point of the closed loop's cycle, so
        the stretch's rate is its average, whatever its clients' rhythm)."""
        steady = self.steady
        if steady.since_completed is None or steady.measured is not None or not self._steady_now():
            return
        if steady.sample is None:
            # A speculative loop's clients that joined together drift apart as their accept lengths differ (tens
            # of rounds, at a rate a few percent off); a plain loop's keep their rhythm, and a few joiners change
            # little.
            crowd = self.engine.acceptance is not None and steady.change >= STEADY_CROWD
            warmup = STEADY_SETTLE_ROUNDS if crowd else STEADY_WARMUP_ROUNDS
            if self.completed - steady.since_completed >= steady.rounds(warmup) * self.clients:
                steady.sample = self._mark(now)
            return
        done = self.completed - steady.sample.completed
        sample_rounds = max(steady.rounds(STEADY_SAMPLE_ROUNDS), STEADY_MIN_SAMPLE_ROUNDS)
        least = max(sample_rounds * self.clients, STEADY_MIN_SAMPLE_REQUESTS)
        # Whole rounds; clients that finish in lumps that never add up to one stop at twice the least.
        if done < least or (done % self.clients and done < 2 * least):
            return
        mark = self._mark(now)
        rate = mark.rate(steady.sample)
        previous, steady.previous, steady.sample = steady.previous, (rate, steady.sample), mark
        # Clients that joined together drift apart for tens of rounds: until two stretches in a row agree, the
        # loop is still settling and is stepped.
        if previous is None or abs(rate - previous[0]) > STEADY_AGREEMENT * previous[0]:
            return
        start = previous[1]
        span = now - start.t
        round_s = span * self.clients / (self.completed - start.completed)
        steady.measured = _Stretch(mark.rate(start), self.ttfts[start.ttfts :], span, round_s)

    def _mark(self, now: float) -> _Mark:
        engines = self.engines.values()
        return _Mark(
            now,
            self._tokens(),
            self.completed,
            len(self.ttfts),
            self.decode_s,
            sum(engine.steps_drawn for engine in engines),
            sum(engine.steps_expected for engine in engines),
        )

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
        if self.on_sample is not None:
            self.on_sample(now, self.outstanding)
        if self.mechanism not in (RESTART, SLEEP):
            return  # nothing asks the policy
        self.switcher.observe(now, self.outstanding, setup.settings)
        if self.state != SERVING:
            return
        decision = self.switcher.decide(now, mode=self.mode, mode_since=self.mode_since, settings=setup.settings)
        if decision.switch:
            self.switch_log.append(SwitchEvent(now, decision.mode, decision.reason))
            self.switches += 1
            self.target = decision.mode
            self.state = DRAINING
            self.switch_started = now
            self.drain_deadline = now + setup.switch.drain_deadline

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
        self.switch_log[-1] = self.switch_log[-1]._replace(duration_s=duration)
        self.mode, self.mode_since, self.state = self.target, now, SERVING
        self.switch_started = self.switch_done = math.inf
        while self.held:
            self._submit(self.held.popleft(), self.setup.input_len, self.setup.output_len, now)


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
    if mechanism != ADAPTIVE and shifts_acceptance(trace):
        raise ValueError(
            f"{mechanism} replays at the profile's accept length, and this trace changes it (accept_length, "
            "--accept-drop): only adaptive replays a shift of acceptance - give --mechanism adaptive"
        )
    known = {} if known is None else known
    if mechanism not in known:
        if mechanism == ADAPTIVE:
            # Imported here: replay_adaptive builds on this module (ReplaySetup, steady_level).
            from crossover.servers.sim.replay_adaptive import replay_adaptive

            known[mechanism] = replay_adaptive(setup, trace)
        elif mechanism == ORACLE:
            known[mechanism] = _oracle(setup, trace, known)
        else:
            known[mechanism] = _Replay(setup, trace, mechanism).run()
    return known[mechanism]


def replay_all(
    setup: ReplaySetup,
    trace: list[TracePhase],
    mechanisms: Iterable[str],
    known: dict[str, ReplayResult] | None = None,
) -> list[ReplayResult]:
    """Each mechanism over the trace, each replayed once (the oracle reuses the others; so does
    free_switch_bound, given the same `known`)."""
    known = {} if known is None else known
    return [replay(setup, trace, mechanism, known) for mechanism in mechanisms]


def _oracle(setup: ReplaySetup, trace: list[TracePhase], known: dict[str, ReplayResult]) -> ReplayResult:
    """The best of all: the mechanism that served the most (`follows` names it)."""
    candidates = []
    for mechanism in MECHANISMS:
        if mechanism in (ORACLE, ADAPTIVE):
            continue
        try:
            setup.times.check(mechanism)
        except ValueError:
            continue  # a mechanism that cannot be costed is not replayed, so there is nothing to bound
        candidates.append(replace(replay(setup, trace, mechanism, known), follows=mechanism))
    best = max(candidates, key=lambda result: result.output_tokens)  # the first of equals
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
