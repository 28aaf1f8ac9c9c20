import random
from collections import Counter

import pytest

from crossover.servers.sim.costs import (
    Acceptance,
    MeasuredCosts,
    ParametricCosts,
    StepTableCosts,
    solve_chain_probability,
)
from crossover.servers.sim.profile import load_profile


@pytest.mark.parametrize(("steps", "mean"), [(3, 1.0), (3, 2.4), (3, 4.0), (5, 3.1), (1, 1.5)])
def test_chain_probability_gives_the_mean(steps, mean):
    q = solve_chain_probability(steps, mean)
    assert sum(q**k for k in range(steps + 1)) == pytest.approx(mean, abs=1e-9)


def test_acceptance_draws_have_the_profile_mean_and_bounds():
    acceptance = Acceptance(num_steps=3, mean=2.4)
    rng = random.Random(7)
    draws = [acceptance.draw(rng) for _ in range(40_000)]
    assert set(draws) == {1, 2, 3, 4}
    assert sum(draws) / len(draws) == pytest.approx(2.4, rel=0.02)
    counts = Counter(draws)
    assert counts[1] > counts[2] > counts[3]  # chain acceptance: each longer run is rarer...
    assert counts[4] > 0  # ...and a full accept of all drafts happens


def test_parametric_step_matches_its_formula():
    eagle = ParametricCosts(load_profile("k25-eagle3"))
    p = load_profile("k25-eagle3").parametric
    batch, context = 10, 10 * 512
    expected = (
        p.fixed_s
        + batch * (p.per_request_s + 4 * p.per_query_token_s)
        + context * p.per_context_token_s
        + 4 * (p.draft_fixed_s + batch * p.draft_per_request_s)
    )
    assert eagle.decode_s(batch, context, batch) == pytest.approx(expected)
    plain = ParametricCosts(load_profile("k25-plain"))
    assert plain.decode_s(1, 512, 1) < eagle.decode_s(1, 512, 1)
    assert plain.prefill_s(256, 1) == pytest.approx(0.05 + 256 * 0.00015)


def test_steptable_is_exact_at_measured_points_and_linear_between():
    plain = StepTableCosts(load_profile("llama8b-h200-plain"))
    assert plain.decode_s(64, 64 * 1024, 64) == pytest.approx(0.00768)
    assert plain.decode_s(80, 80 * 1024, 80) == pytest.approx((0.00768 + 0.00921) / 2)
    assert plain.decode_s(1, 4096, 1) == pytest.approx(0.00672)  # the 4096-token table
    assert plain.decode_s(1, 2560, 1) == pytest.approx((0.00547 + 0.00672) / 2)  # between contexts
    assert plain.decode_s(1, 100_000, 1) == pytest.approx(0.00672)  # clamped to the measured range
    assert plain.decode_s(1024, 1024 * 1024, 1024) > plain.decode_s(512, 512 * 1024, 512)  # extended beyond
    eagle = StepTableCosts(load_profile("llama8b-h200-eagle3"))
    assert eagle.decode_s(128, 128 * 1024, 128) == pytest.approx(0.01986 + 4 * 0.000456)


def test_measured_costs_interpolate_in_log_concurrency(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(
        'kind = "measured"\nmodel_name = "m"\n'
        "points = [{concurrency = 1, per_request_throughput = 100.0, ttft_s = 0.1},"
        " {concurrency = 100, per_request_throughput = 10.0, ttft_s = 1.1}]\n"
    )
    costs = MeasuredCosts(load_profile(str(path)))
    assert costs.per_request_throughput(1) == 100.0
    assert costs.per_request_throughput(10) == pytest.approx(55.0)  # halfway in log(C)
    assert costs.ttft_s(10) == pytest.approx(0.6)
    # Above the last point: saturated, so aggregate stays flat and TTFT grows with the queue.
    assert costs.per_request_throughput(200) * 200 == pytest.approx(10.0 * 100)
    assert costs.ttft_s(200) == pytest.approx(2.2)
    assert costs.decode_s(batch=5, context_tokens=0, in_flight=10) == pytest.approx(1 / 55.0)
    assert costs.overlapped_prefill
