"""`crossover sim replay --mechanism in-engine`: the speculative engine alone with its zero-step gate."""

from __future__ import annotations

from crossover.servers.sim.profile import load_profile, with_overrides
from crossover.servers.sim.replay import (
    ALWAYS_SPECULATIVE,
    IN_ENGINE,
    MECHANISMS,
    ReplaySetup,
    replay,
    zero_step_gate,
)
from crossover.servers.sim.trace import TracePhase


def llama(accept_length: float):
    spec = with_overrides(load_profile("llama8b-h200-eagle3"), accept_length=accept_length)
    return spec, load_profile("llama8b-h200-plain")


def test_the_gate_is_where_a_zero_step_out_yields_speculation_in_the_same_server():
    assert zero_step_gate(llama(2.0)[0], 512) is not None and 100 < zero_step_gate(llama(2.0)[0], 512) < 256
    assert zero_step_gate(llama(3.0)[0], 512) is None  # at accept length 3 EAGLE still wins at 512 (h200 table)


def test_in_engine_gains_above_the_gate_and_equals_speculation_below_it():
    spec, plain = llama(2.0)
    assert IN_ENGINE in MECHANISMS
    for concurrency, better in ((8, False), (384, True)):
        trace = [TracePhase(duration_s=30, concurrency=concurrency)]
        setup = ReplaySetup.from_profiles(spec, plain, trace, output_len=128)
        gated, always = replay(setup, trace, IN_ENGINE), replay(setup, trace, ALWAYS_SPECULATIVE)
        assert gated.switches == 0 and gated.requests_cut == 0
        if better:
            assert gated.output_tokens > always.output_tokens * 1.05
        else:
            assert gated.output_tokens == always.output_tokens
