"""The engine for virtual time: a decode step costs the same whatever the batch, not one update per request.

    engine = LazyEngine(profile, random.Random(seed))   # as Engine; replay.py steps it on its virtual clock

engine.py's `Engine` touches every running request at every decode step, so that the live stand-in can wake
each stream as its tokens arrive. A replay wants only the finishes and the totals, and at C = 500 the per-request
updates were most of a day's replay. Here a request's decode steps are drawn once, when it starts decoding: a
plain request finishes `max_new_tokens - generated` steps later (exactly as Engine); a speculative one after the
number of steps that chain acceptance (costs.Acceptance) needs to yield the rest, drawn from that number's exact
distribution (`steps_cdf`). In between, its tokens are counted at its mean rate (tokens left / steps left), so
`generated_total` and the KV tokens in use - which the step cost reads - are exact at every finish and smooth
between. Requests finishing at the same step finish in the order they started decoding, as Engine's.

When the patched engine's zero-step gate flips, every decoding request is brought up to date (at its rate)
and what it has left is drawn again for the new kind of step.

Not for the live stand-in: a request's `generated` is only brought up to date when it ends or is aborted, and
`touched` holds only the finished.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_right
from functools import cache
from itertools import count

from crossover.servers.sim.costs import Acceptance, Costs
from crossover.servers.sim.engine import Engine, Sequence, State, Step
from crossover.servers.sim.profile import Profile

# Probabilities below this are left off a step count's distribution (its tails; the rest is renormalised by the
# draw, which reads the cumulative sum as it stands).
_NEGLIGIBLE = 1e-12


class LazyEngine(Engine):
    def __init__(self, profile: Profile, rng: random.Random, costs: Costs | None = None):
        super().__init__(profile, rng, costs)
        self._steps = 0  # decode steps taken
        self._rate = 0.0  # tokens per decode step of all the decoding requests together
        # A decoding request: (its decode step at the start, tokens generated then, tokens per step, its draw).
        self._lazy: dict[Sequence, tuple[int, int, float, int]] = {}
        # (the decode step it finishes at, its draw, request): draws are numbered in order, so requests that
        # finish together finish in the order they started decoding.
        self._ends: list[tuple[int, int, Sequence]] = []
        self._draws = count()
        self._zero_step = False  # the kind of step the requests' steps were drawn for (the gate's, engine.py)
        # Speculative decode steps drawn so far, and their expectation: how lucky a stretch's acceptance was.
        self.steps_drawn = 0
        self.steps_expected = 0.0

    def abort(self, seq: Sequence) -> bool:
        if seq in self._lazy:
            self._bring_up_to_date(seq)
        return super().abort(seq)

    def pause(self, mode):
        raise NotImplementedError("the live stand-in runs engine.Engine, which pauses")

    def _decode_step(self, in_flight: int) -> Step:
        batch = len(self._running)
        zero_step = self._gate_decide(batch)
        if zero_step != self._zero_step:
            # The gate flipped: what each request has left is drawn again for the new kind of step.
            self._zero_step = zero_step
            for seq in list(self._lazy):
                self._bring_up_to_date(seq)
                self._draw(seq)
        # No list of the batch: _decode below reads none.
        if zero_step:
            duration = self.costs.zero_step_s(batch, self._used, self.skip_zero_step_draft_extend)
        else:
            duration = self.costs.decode_s(batch, self._used, in_flight)
        return Step("decode", [], duration, zero_step=zero_step)

    def _start(self, seq: Sequence, now: float, touched: list[Sequence], finished: list[Sequence]) -> None:
        super()._start(seq, now, touched, finished)
        if seq.state is State.RUNNING:
            self._draw(seq)

    def _draw(self, seq: Sequence) -> None:
        """Its remaining decode steps, at the kind of step the engine now takes."""
        left = seq.max_new_tokens - seq.generated
        if self.acceptance is None or self._zero_step or left <= 0:
            steps = left
        else:
            steps = _draw_steps(self.acceptance, left, self._rng)
            self.steps_drawn += steps
            self.steps_expected += mean_steps(self.acceptance.probabilities, left)
        rate = left / steps if steps else 0.0
        draw = next(self._draws)
        self._lazy[seq] = (self._steps, seq.generated, rate, draw)
        self._rate += rate
        heapq.heappush(self._ends, (self._steps + steps, draw, seq))

    def _decode(
        self, seqs: list[Sequence], now: float, touched: list[Sequence], finished: list[Sequence], zero_step=False
    ) -> None:
        self.decode_batches_total += 1
        self.zero_step_batches_total += zero_step
        self._steps += 1
        self._used += self._rate
        self.generated_total += self._rate
        if self.acceptance is not None and not zero_step:
            self.spec_verify_total += len(self._running)
            self.spec_accepted_total += self._rate
        ends, lazy = self._ends, self._lazy
        while ends and ends[0][0] <= self._steps:
            _, draw, seq = heapq.heappop(ends)
            if seq not in lazy or lazy[seq][3] != draw:
                continue  # aborted, or drawn again when the gate flipped
            self._bring_up_to_date(seq)
            touched.append(seq)
            self._finish(seq, now)
            finished.append(seq)

    def _bring_up_to_date(self, seq: Sequence) -> None:
        """Its real token count in place of the rate's (exact at its last step), for its release."""
        start, generated, rate, _ = self._lazy.pop(seq)
        self._rate -= rate
        counted = rate * (self._steps - start)
        seq.generated = min(generated + round(counted), seq.max_new_tokens)
        real = seq.generated - generated
        self._used += real - counted
        self.generated_total += real - counted
        if not self._lazy:
            self._rate = 0.0  # no float residue left behind


def _draw_steps(acceptance: Acceptance, tokens: int, rng: random.Random) -> int:
    low, cumulative = steps_cdf(acceptance.probabilities, tokens)
    return low + min(bisect_right(cumulative, rng.random() * cumulative[-1]), len(cumulative) - 1)


@cache
def mean_steps(yields: tuple[float, ...], tokens: int) -> float:
    """The decode steps a speculative request needs for `tokens` more tokens, on average (steps_cdf's mean)."""
    low, cumulative = steps_cdf(yields, tokens)
    below = sum(cumulative[:-1])  # sum of P(steps <= low + i) over all but the last
    return low + len(cumulative) - 1 - below / cumulative[-1]


@cache
def steps_cdf(yields: tuple[float, ...], tokens: int) -> tuple[int, tuple[float, ...]]:
    """The decode steps a speculative request needs for `tokens` more tokens: (the fewest, the cumulative
    probabilities from there). A step yields k tokens with probability yields[k - 1] (costs.Acceptance's); the
    last step's surplus is cut (Engine's min(n, remaining))."""
    for fewer in range(tokens):  # bottom up: the recursion below then stays one level deep
        _steps_distribution(yields, fewer)
    low, probabilities = _steps_distribution(yields, tokens)
    total, cumulative = 0.0, []
    for p in probabilities:
        total += p
        cumulative.append(total)
    return low, tuple(cumulative)


@cache
def _steps_distribution(yields: tuple[float, ...], tokens: int) -> tuple[int, tuple[float, ...]]:
    if tokens <= 0:
        return 0, (1.0,)
    low = high = None
    parts = []
    for k, p in enumerate(yields, start=1):  # the first step yields k; the rest needs tokens - k
        rest_low, rest = _steps_distribution(yields, tokens - k)
        parts.append((rest_low + 1, rest, p))
        low = rest_low + 1 if low is None else min(low, rest_low + 1)
        high = rest_low + len(rest) if high is None else max(high, rest_low + len(rest))
    assert low is not None and high is not None
    probabilities = [0.0] * (high - low + 1)
    for start, rest, p in parts:
        offset = start - low
        for i, q in enumerate(rest):
            probabilities[offset + i] += p * q
    first = next(i for i, p in enumerate(probabilities) if p > _NEGLIGIBLE)
    last = max(i for i, p in enumerate(probabilities) if p > _NEGLIGIBLE)
    return low + first, tuple(probabilities[first : last + 1])
