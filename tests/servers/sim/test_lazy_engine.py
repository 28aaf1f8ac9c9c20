"""lazy_engine.py against engine.py: the same closed loop, exactly for plain and gated steps, in distribution for
speculative ones."""

from __future__ import annotations

import dataclasses
import random

import pytest

from crossover.servers.sim.costs import Acceptance
from crossover.servers.sim.engine import Engine, Sequence, State
from crossover.servers.sim.lazy_engine import LazyEngine, steps_cdf
from crossover.servers.sim.profile import load_profile, with_overrides

INPUT, OUTPUT = 768, 128


def llama(name: str, **overrides):
    profile = with_overrides(load_profile(name), **overrides)
    return dataclasses.replace(profile, limits=dataclasses.replace(profile.limits, max_queued_requests=None))


def closed_loop(engine: Engine, clients: int, requests: int) -> tuple[list[tuple[float, int]], float]:
    """`clients` each sending its next request when its last ends: (each finish's time and request, tokens)."""
    now, ids = 0.0, {}
    for _ in range(clients):
        seq = Sequence(INPUT, OUTPUT)
        ids[seq] = len(ids)
        engine.submit(seq, now)
    finishes = []
    while len(finishes) < requests:
        step = engine.next_step(now)
        now += step.duration
        for seq in engine.finish_step(step, now)[1]:
            assert seq.generated == OUTPUT and seq.state is State.FINISHED
            finishes.append((round(now, 9), ids[seq]))
            following = Sequence(INPUT, OUTPUT)
            ids[following] = len(ids)
            engine.submit(following, now)
    return finishes, engine.generated_total


def both(profile, clients: int, requests: int, gate: int | None = None):
    runs = []
    for kind in (Engine, LazyEngine):
        engine = kind(profile, random.Random(0))
        engine.zero_steps_above_bs = gate
        runs.append(closed_loop(engine, clients, requests))
    return runs


def test_plain_steps_finish_the_same_requests_at_the_same_times():
    (stepped, stepped_tokens), (lazy, lazy_tokens) = both(llama("llama8b-h200-plain"), 64, 1000)
    assert lazy == stepped
    assert lazy_tokens == pytest.approx(stepped_tokens, abs=1e-6)


def test_a_gate_that_stays_closed_steps_as_the_full_engine_does():
    """Above the gate every step is a zero-step one: the draws made before the gate closed are drawn again."""
    spec = llama("llama8b-h200-eagle3", accept_length=2.0)
    (stepped, _), (lazy, _) = both(spec, 300, 1500, gate=100)
    assert lazy == stepped


def test_speculative_steps_yield_what_the_full_engine_yields():
    spec = llama("llama8b-h200-eagle3", accept_length=2.0)
    rates = []
    for kind in (Engine, LazyEngine):
        engine = kind(spec, random.Random(0))
        finishes, tokens = closed_loop(engine, 32, 3000)
        rates.append((len(finishes) / finishes[-1][0], tokens / finishes[-1][0]))
    assert rates[1] == pytest.approx(rates[0], rel=0.01)  # requests and tokens per second


def test_the_steps_a_request_needs_are_exactly_distributed():
    # One draft step: a step yields 2 tokens with probability q, else 1. Two tokens: 1 step (q) or 2 (1 - q).
    acceptance = Acceptance(1, 1.3)
    low, cumulative = steps_cdf(acceptance.probabilities, 2)
    assert low == 1 and cumulative == pytest.approx((0.3, 1.0))
    # A long request: the mean by Monte Carlo of costs.Acceptance's own draws.
    acceptance, tokens = Acceptance(3, 2.0), 511
    low, cumulative = steps_cdf(acceptance.probabilities, tokens)
    mean = low + sum(1 - c for c in cumulative)
    rng, total = random.Random(1), 0
    for _ in range(400):
        left = tokens
        while left > 0:
            left -= acceptance.draw(rng)
            total += 1
    assert cumulative[-1] == pytest.approx(1.0) and mean == pytest.approx(total / 400, rel=0.01)


def test_an_aborted_request_gives_its_tokens_back():
    engine = LazyEngine(llama("llama8b-h200-eagle3", accept_length=2.0), random.Random(0))
    seqs = [Sequence(INPUT, OUTPUT) for _ in range(3)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    now = 0.0
    for _ in range(20):
        step = engine.next_step(now)
        now += step.duration
        engine.finish_step(step, now)
    assert engine.abort(seqs[0]) and seqs[0].state is State.ABORTED
    assert 1 < seqs[0].generated < OUTPUT  # brought up to date at its rate
    assert not engine.abort(seqs[0])
    for seq in seqs[1:]:
        engine.abort(seq)
    assert engine.num_used_tokens == pytest.approx(0, abs=1e-6) and engine.idle
