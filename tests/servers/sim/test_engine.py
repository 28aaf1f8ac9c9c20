import random

import pytest

from crossover.servers.sim.engine import Engine, QueueFull, Sequence, State
from crossover.servers.sim.profile import load_profile, with_overrides


def engine_for(profile="k25-plain", **overrides) -> Engine:
    return Engine(with_overrides(load_profile(profile), **overrides), random.Random(0))


def run(engine: Engine, now: float = 0.0, max_steps: int = 100_000) -> float:
    """Step until idle; returns the clock."""
    for _ in range(max_steps):
        step = engine.next_step(now)
        if step is None:
            return now
        now += step.duration
        engine.finish_step(step, now)
    raise AssertionError("engine did not go idle")


def test_prefill_then_decode_yields_every_token_once():
    engine = engine_for()
    seqs = [Sequence(100, 20) for _ in range(3)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    step = engine.next_step(0.0)
    assert step.kind == "prefill" and step.seqs == seqs
    assert engine.num_running == 3 and engine.num_waiting == 0
    touched, finished = engine.finish_step(step, step.duration)
    assert touched == seqs and not finished
    assert all(s.generated == 1 and s.first_token_at == step.duration for s in seqs)  # prefill's token
    run(engine, step.duration)
    assert all(s.state is State.FINISHED and s.generated == 20 for s in seqs)
    assert engine.generated_total == 60 and engine.num_used_tokens == 0 and engine.idle


def test_cap_queues_the_rest_fifo():
    engine = engine_for("k25-eagle3", max_running_requests=2)
    seqs = [Sequence(10, 5) for _ in range(5)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    now, admitted = 0.0, []
    while (step := engine.next_step(now)) is not None:
        assert engine.num_running <= 2
        if step.kind == "prefill":
            admitted += step.seqs
        now += step.duration
        engine.finish_step(step, now)
        if now == step.duration:
            assert engine.num_running == 2 and engine.num_waiting == 3
    assert admitted == seqs  # first come, first served
    assert all(s.generated == 5 for s in seqs) and seqs[4].admitted_at > seqs[1].finished_at - 1e-9


def test_speculative_steps_yield_several_tokens_and_never_overshoot():
    engine = engine_for("k25-eagle3")
    seqs = [Sequence(10, 101) for _ in range(8)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    run(engine)
    assert all(s.generated == 101 for s in seqs)
    assert 2.2 < engine.avg_accept_length < 2.6
    assert engine.generated_total == 8 * 101


def test_queue_bound_rejects_as_sglang_does():
    engine = engine_for(max_queued_requests=2)
    engine.submit(Sequence(10, 5), 0.0)
    engine.submit(Sequence(10, 5), 0.0)
    with pytest.raises(QueueFull, match=r"The request queue is full\."):
        engine.submit(Sequence(10, 5), 0.0)
    engine.next_step(0.0)  # both admitted: the queue has room again
    engine.submit(Sequence(10, 5), 0.0)


def test_kv_pool_bounds_admission():
    engine = engine_for()  # 100_000 tokens
    seqs = [Sequence(5_000, 35_000) for _ in range(3)]
    for seq in seqs:
        engine.submit(seq, 0.0)
    engine.next_step(0.0)
    assert engine.num_running == 2 and engine.num_waiting == 1  # a third 40k reservation does not fit
    assert not engine.fits(90_000, 20_000)
    with pytest.raises(ValueError, match="KV tokens"):
        engine.submit(Sequence(90_000, 20_000), 0.0)


def test_prefill_budget_splits_batches_but_admits_one_long_prompt():
    engine = engine_for()
    engine.submit(Sequence(20_000, 5), 0.0)
    engine.submit(Sequence(100, 5), 0.0)
    first = engine.next_step(0.0)
    assert len(first.seqs) == 1
    engine.finish_step(first, first.duration)
    second = engine.next_step(first.duration)
    assert second.kind == "prefill" and len(second.seqs) == 1


def test_abort_frees_the_slot_at_once_wherever_the_request_is():
    engine = engine_for(max_running_requests=1)
    running, waiting = Sequence(10, 50), Sequence(10, 50)
    engine.submit(running, 0.0)
    engine.submit(waiting, 0.0)
    step = engine.next_step(0.0)
    assert engine.abort(waiting) and engine.num_waiting == 0
    assert engine.abort(running) and engine.num_running == 0  # mid-step: the count drops now
    assert engine.finish_step(step, step.duration) == ([], [])  # the step's result is dropped
    assert not engine.abort(running)
    assert running.state is State.ABORTED and engine.aborted_total == 2
    assert engine.num_used_tokens == 0 and engine.idle


def test_pause_modes():
    engine = engine_for()
    a, b = Sequence(10, 50), Sequence(10, 50)
    engine.submit(a, 0.0)
    engine.next_step(0.0)
    engine.submit(b, 0.0)
    assert engine.pause("in_place") == [] and engine.next_step(0.0) is None
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.pause("retract") == []
    assert engine.num_running == 0 and engine.num_waiting == 2 and engine.num_used_tokens == 0
    engine.resume()
    run(engine)
    assert a.generated == b.generated == 50
    c = Sequence(10, 50)
    engine.submit(c, 0.0)
    assert engine.pause("abort") == [c] and c.state is State.ABORTED


def test_zero_new_tokens_finish_at_prefill():
    engine = engine_for()
    seq = Sequence(10, 0)
    engine.submit(seq, 0.0)
    step = engine.next_step(0.0)
    _, finished = engine.finish_step(step, 1.0)
    assert finished == [seq] and seq.generated == 0 and seq.first_token_at == 1.0


def test_measured_profile_delays_first_tokens_without_stalling_the_batch(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(
        'kind = "measured"\nmodel_name = "m"\n'
        "points = [{concurrency = 1, per_request_throughput = 10.0, ttft_s = 1.0}]\n"
    )
    engine = Engine(load_profile(str(path)), random.Random(0))
    first = Sequence(10, 100)
    engine.submit(first, 0.0)
    wait = engine.next_step(0.0)
    assert wait.kind == "wait" and wait.duration == pytest.approx(1.0)
    engine.finish_step(wait, 1.0)
    assert first.generated == 1 and first.first_token_at == 1.0
    second = Sequence(10, 100)
    engine.submit(second, 1.0)
    step = engine.next_step(1.0)
    assert step.kind == "decode" and step.seqs == [first]
    # Two in flight, above the only point: saturated, each request gets half the rate.
    assert step.duration == pytest.approx(0.2)


def test_abort_of_a_request_never_submitted_is_a_no_op():
    engine = engine_for()
    assert not engine.abort(Sequence(10, 5)) and engine.aborted_total == 0
