"""How long one forward pass takes, and how many tokens a speculative step yields per request.

    costs = make_costs(profile)
    costs.decode_s(batch=48, context_tokens=48 * 512, in_flight=70)   # seconds, in profile time
    Acceptance(num_steps=3, mean=2.4).draw(rng)                          # 1..4 tokens, mean 2.4

A speculative step (EAGLE, chain drafts) is one verify pass of the target model over batch x
num_draft_tokens query tokens plus num_steps + 1 draft passes (the +1 is the draft-extend pass).
"""

from __future__ import annotations

import bisect
import math
import random
from typing import Protocol

from crossover.servers.sim.profile import Profile, StepTable


class Costs(Protocol):
    # True for measured curves: a request's first token is a delay of its own (the measured TTFT, which
    # already holds the server's prefill and queueing), not a prefill pass that stalls the batch.
    overlapped_prefill: bool

    def decode_s(self, batch: int, context_tokens: int, in_flight: int) -> float:
        """One decode (or draft + verify) step over `batch` requests holding `context_tokens` in total."""
        ...

    def prefill_s(self, tokens: int, requests: int) -> float:
        """One prefill pass over `requests` new requests with `tokens` input tokens in total."""
        ...

    def first_token_s(self, in_flight: int) -> float:
        """Delay before a new request's first token (overlapped prefill only)."""
        ...

    def zero_step_s(self, batch: int, context_tokens: int, skip_draft_extend: bool) -> float:
        """One zero-draft-step decode of an EAGLE-3 server (its speculation gate closed); see ZERO_STEP_MODEL."""
        ...


# The zero-step cost model (in-engine topology: patches/sglang-0.5.23's gate). A batch the gate sends to zero
# draft steps is, in SGLang 0.5.23, a TARGET_VERIFY pass over one query token per request (the CUDA graph
# captured at draft_token_num = 1) - costed as a plain decode pass - plus one draft-extend pass of the draft
# model over the accepted token, unless SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND skips it. What is assumed:
# the 1-token verify costs what a plain server's decode does (same kernels, same batch; measured on H200 only
# for the decode itself, h200-step-times.md); one draft-extend pass costs one draft step; the sampling and
# bookkeeping of the speculative path cost nothing extra. What is *not* assumed away: the KV pool and the
# running cap stay the speculative server's (its profile's limits), smaller than a plain server's.
ZERO_STEP_MODEL = "1-token verify (= plain decode) + 1 draft-extend pass; speculative KV pool and cap"


def make_costs(profile: Profile) -> Costs:
    if profile.kind == "parametric":
        return ParametricCosts(profile)
    if profile.kind == "steptable":
        return StepTableCosts(profile)
    return MeasuredCosts(profile)


class Acceptance:
    """Accepted tokens per request per step: chain acceptance, each draft token kept with probability q.

    q is solved so that the mean of 1 + (accepted drafts) equals the profile's accept length; the bonus
    token makes every step yield at least one token and at most num_steps + 1.
    """

    def __init__(self, num_steps: int, mean: float):
        self.num_steps, self.mean = num_steps, mean
        self.q = solve_chain_probability(num_steps, mean)
        probs = [self.q ** (k - 1) * (1 - self.q) for k in range(1, num_steps + 1)] + [self.q**num_steps]
        self.probabilities = tuple(probs)  # of 1, 2, ... num_steps + 1 tokens
        self._cumulative = list(_running_sum(probs))
        self._cumulative[-1] = 1.0
        self._tokens = range(1, num_steps + 2)

    def draw(self, rng: random.Random) -> int:
        return bisect.bisect_right(self._cumulative, rng.random()) + 1

    def draw_many(self, rng: random.Random, k: int) -> list[int]:
        """`k` draws at once: the same numbers, from the same stream, as `k` calls of draw()."""
        return rng.choices(self._tokens, cum_weights=self._cumulative, k=k)


def solve_chain_probability(num_steps: int, mean: float) -> float:
    """q in [0, 1] with 1 + q + q^2 + ... + q^num_steps == mean (bisection; the sum grows with q)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**k for k in range(num_steps + 1)) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _running_sum(values: list[float]):
    total = 0.0
    for v in values:
        total += v
        yield total


class ParametricCosts:
    overlapped_prefill = False

    def __init__(self, profile: Profile):
        p, spec = profile.parametric, profile.speculative
        assert p is not None
        self._fixed = p.fixed_s + profile.step_overhead_s
        self._per_request = p.per_request_s
        self._per_query = p.per_query_token_s * (spec.num_draft_tokens if spec else 1)
        self._per_context = p.per_context_token_s
        passes = spec.num_steps + 1 if spec else 0
        self._draft_fixed = passes * p.draft_fixed_s
        self._draft_per_request = passes * p.draft_per_request_s
        self._per_query_one = p.per_query_token_s
        self._draft_fixed_one, self._draft_per_request_one = p.draft_fixed_s, p.draft_per_request_s
        self._prefill = profile.prefill
        self._overhead = profile.step_overhead_s

    def decode_s(self, batch: int, context_tokens: int, in_flight: int) -> float:
        return (
            self._fixed
            + self._draft_fixed
            + batch * (self._per_request + self._per_query + self._draft_per_request)
            + context_tokens * self._per_context
        )

    def zero_step_s(self, batch: int, context_tokens: int, skip_draft_extend: bool) -> float:
        passes = 0 if skip_draft_extend else 1
        return (
            self._fixed
            + passes * self._draft_fixed_one
            + batch * (self._per_request + self._per_query_one + passes * self._draft_per_request_one)
            + context_tokens * self._per_context
        )

    def prefill_s(self, tokens: int, requests: int) -> float:
        return self._prefill.fixed_s + tokens * self._prefill.per_token_s + self._overhead

    def first_token_s(self, in_flight: int) -> float:
        return 0.0


class StepTableCosts:
    """Measured step times, linear between measured batch sizes (extended along the last segment beyond
    them) and between the tables' context lengths (clamped to the measured range)."""

    overlapped_prefill = False

    def __init__(self, profile: Profile):
        spec = profile.speculative
        self._passes = spec.num_steps + 1 if spec else 0
        self._speculative = spec is not None
        self._tables = profile.tables
        self._contexts = [t.context for t in profile.tables]
        self._prefill = profile.prefill
        self._overhead = profile.step_overhead_s
        # Each table's step time by batch (and draft-extend skipped), as the steps ask for it: a virtual replay
        # asks for the same few hundred batches millions of times.
        self._step_s: dict[int, list[float]] = {}
        self._zero_step_s: dict[tuple[int, bool], list[float]] = {}

    def decode_s(self, batch: int, context_tokens: int, in_flight: int) -> float:
        if batch <= 0:
            return self._overhead
        steps = self._step_s.get(batch)
        if steps is None:
            steps = self._step_s[batch] = [self._table_step_s(t, batch) for t in self._tables]
        return self._overhead + _between(self._contexts, context_tokens / batch, steps)

    def zero_step_s(self, batch: int, context_tokens: int, skip_draft_extend: bool) -> float:
        if batch <= 0:
            return self._overhead
        steps = self._zero_step_s.get((batch, skip_draft_extend))
        if steps is None:
            steps = [self._zero_step_table_s(t, batch, skip_draft_extend) for t in self._tables]
            self._zero_step_s[batch, skip_draft_extend] = steps
        return self._overhead + _between(self._contexts, context_tokens / batch, steps)

    @staticmethod
    def _zero_step_table_s(table: StepTable, batch: int, skip_draft_extend: bool) -> float:
        # Without a measured 1-token pass the 4-token verify stands in for it (an over-estimate).
        one_token = table.decode_s if table.decode_s is not None else table.verify_s
        assert one_token is not None
        draft = 0.0 if skip_draft_extend or table.draft_s is None else _piecewise(table.batch, table.draft_s, batch)
        return _piecewise(table.batch, one_token, batch) + draft

    def _table_step_s(self, table: StepTable, batch: int) -> float:
        if self._speculative:
            assert table.verify_s is not None and table.draft_s is not None
            return _piecewise(table.batch, table.verify_s, batch) + self._passes * _piecewise(
                table.batch, table.draft_s, batch
            )
        assert table.decode_s is not None
        return _piecewise(table.batch, table.decode_s, batch)

    def prefill_s(self, tokens: int, requests: int) -> float:
        return self._prefill.fixed_s + tokens * self._prefill.per_token_s + self._overhead

    def first_token_s(self, in_flight: int) -> float:
        return 0.0


def _piecewise(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _between(contexts: list[int], context: float, values: list[float]) -> float:
    if context <= contexts[0] or len(contexts) == 1:
        return values[0]
    if context >= contexts[-1]:
        return values[-1]
    i = bisect.bisect_right(contexts, context) - 1
    w = (context - contexts[i]) / (contexts[i + 1] - contexts[i])
    return values[i] + w * (values[i + 1] - values[i])


class MeasuredCosts:
    """Replays (concurrency -> per-request speed, TTFT), linear in log(concurrency) between points.

    The load that matters is the number of requests in flight (running + queued), as a closed-loop load
    test holds it. Below the first point the first point holds; above the last one the server is taken as
    saturated: aggregate throughput stays flat and TTFT grows with the queue (Little's law).
    """

    overlapped_prefill = True

    def __init__(self, profile: Profile):
        self._points = profile.points
        self._logs = [math.log(p.concurrency) for p in profile.points]
        # A speculative server yields several tokens per step; the step is longer by the same factor.
        self._tokens_per_step = profile.speculative.accept_length if profile.speculative else 1.0

    def decode_s(self, batch: int, context_tokens: int, in_flight: int) -> float:
        return self._tokens_per_step / self.per_request_throughput(max(in_flight, 1))

    def prefill_s(self, tokens: int, requests: int) -> float:
        return 0.0

    def first_token_s(self, in_flight: int) -> float:
        return self.ttft_s(max(in_flight, 1))

    def zero_step_s(self, batch: int, context_tokens: int, skip_draft_extend: bool) -> float:
        raise ValueError("a measured (curve) profile has no step times: the zero-step gate needs a step model")

    def per_request_throughput(self, concurrency: float) -> float:
        last = self._points[-1]
        if concurrency > last.concurrency:
            return last.per_request_throughput * last.concurrency / concurrency
        return self._interpolate(concurrency, lambda p: p.per_request_throughput)

    def ttft_s(self, concurrency: float) -> float:
        last = self._points[-1]
        if concurrency > last.concurrency:
            return last.ttft_s * concurrency / last.concurrency
        return self._interpolate(concurrency, lambda p: p.ttft_s)

    def _interpolate(self, concurrency: float, value) -> float:
        points = self._points
        if concurrency <= points[0].concurrency or len(points) == 1:
            return value(points[0])
        x = math.log(concurrency)
        i = min(bisect.bisect_right(self._logs, x) - 1, len(points) - 2)
        w = (x - self._logs[i]) / (self._logs[i + 1] - self._logs[i])
        return value(points[i]) + w * (value(points[i + 1]) - value(points[i]))
