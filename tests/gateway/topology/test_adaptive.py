"""The adaptive controller end to end: a gateway with [adaptive] in front of two stand-ins; the speculative one's
acceptance drops live and the threshold follows, bounded per window, never past min; an operator's PUT pins it.

Windows are counted by the controller itself (`windows`): the tests wait on its state, never on the wall clock."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from crossover.gateway.app import build_state
from crossover.gateway.config import Settings
from crossover.gateway.engines.calls import SpecReading
from crossover.gateway.policies.adaptive import DOWN, TOWARD_CROSSOVER
from tests.gateway.gateway_helpers import SIM_SCALE, chat, wait_until

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BENCH_ACCEPT = 2.4  # the k25-eagle3 stand-in's profile acceptance
# At the bench's acceptance plain catches up between 16 (-200) and 32 (+300): 16 + 16 x 200 / 500 = 22.4.
LEVELS = {"eagle": ((1, 100), (4, 380), (16, 1200), (32, 1600), (64, 1800)),
          "plain": ((1, 60), (4, 240), (16, 1000), (32, 1900), (64, 2600))}  # fmt: skip
START, MAX_STEP, MINIMUM, MAXIMUM = 22, 3, 4, 40


@pytest.fixture
def table(tmp_path):
    levels = [
        {"target": target, "concurrency": c, "completed": 20, "output_throughput": tok}
        for target, points in LEVELS.items()
        for c, tok in points
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"levels": levels, "crossover": {"speculative": "eagle", "plain": "plain"}}))
    return path


@pytest.fixture
def adaptive_gateway(sim, gateway, table):
    spec, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    gw = gateway(
        [spec.url],
        [plain.url],
        admin_token=TOKEN,
        threshold=START,
        health={"interval": 0.5, "timeout": 2.0, "load_interval": 0.1},
        adaptive={
            "enabled": True,
            "table": str(table),
            "bench_accept_length": BENCH_ACCEPT,
            "window": 0.2,
            "max_step": MAX_STEP,
            "min": MINIMUM,
            "max": MAXIMUM,
            "deadband": 1,
            "max_levels": 0,  # max_step alone bounds a move: what the test counts
            "correct": False,  # the table is not the stand-ins' throughput: the acceptance alone moves it here
        },
    )
    return gw, spec


def test_the_threshold_follows_a_drop_in_acceptance_bounded_pinned_by_an_operator_and_resumed(adaptive_gateway):
    gw, spec = adaptive_gateway
    controller = gw.state.adaptive
    routing = gw.state.routing

    with httpx.Client(timeout=60, trust_env=False) as client:

        def traffic_then(condition):
            """Keep the speculative backend generating (its acceptance is read from what it generates)."""

            def check() -> bool:
                client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=32)).raise_for_status()
                return condition()

            return check

        def windows_pass(n: int):
            start = controller.windows
            return lambda: controller.windows >= start + n

        # The gateway reads the bench's acceptance: the predicted crossover is about where the threshold starts.
        # The stand-in's gauge is SGLang's: until its first window of 40 decode batches ends, the batches so far (one
        # request: ~13), so a reading can be a few batches' luck (3 of them: 3.33) - the next request evens it out.
        wait_until(
            traffic_then(
                lambda: (
                    controller.last is not None
                    and controller.last.accept_length is not None
                    and abs(controller.last.accept_length - BENCH_ACCEPT) < 0.4
                )
            ),
            what="a window with the bench's acceptance read",
        )
        before = len(controller.moves)

        client.post(spec.url + "/sim/acceptance", json={"accept_length": 1.2}).raise_for_status()
        wait_until(traffic_then(lambda: routing.threshold == MINIMUM), what="the threshold down at min")
        moves = [decision for _, decision in list(controller.moves)[before:]]
        downs = [move for move in moves if move.direction == DOWN]
        # From wherever it stood (at most START + a step of noise) to min, a step of at most MAX_STEP per window.
        assert len(downs) >= (START - MINIMUM) // MAX_STEP
        for move in moves:
            assert abs(move.threshold - move.previous) <= MAX_STEP, move
            assert MINIMUM <= move.threshold <= MAXIMUM, move
            assert move.reason == TOWARD_CROSSOVER and move.prediction is not None
        assert downs[-1].prediction.crossover < MINIMUM  # it predicted below min; the bound held
        # More windows: it holds at min (no move past it).
        wait_until(traffic_then(windows_pass(3)), what="three more windows")
        assert routing.threshold == MINIMUM

        state = client.get(gw.url + "/admin/state", headers=AUTH).json()["adaptive"]
        assert state["enabled"] and not state["paused"] and state["deciding"]
        assert state["last_move"]["to"] == MINIMUM and state["last_move"]["reason"] == TOWARD_CROSSOVER
        assert state["last_decision"]["prediction"]["crossover"] < MINIMUM
        assert abs(state["accept_length"] - 1.2) < 0.4
        assert not state["correction"]["on"] and state["correction"]["levels"] == []
        assert gw.metric("crossover_adaptive_moves_total", direction="down") == controller.moved["down"] >= len(downs)
        assert gw.metric("crossover_adaptive_predicted_crossover") == controller.last.prediction.crossover
        assert abs(gw.metric("crossover_adaptive_accept_length") - 1.2) < 0.4

        # An operator's threshold pins it: windows pass and nothing moves.
        pinned = client.put(gw.url + "/admin/threshold", headers=AUTH, json={"threshold": 30})
        assert pinned.status_code == 200, pinned.text
        moved = len(controller.moves)
        wait_until(traffic_then(windows_pass(5)), what="five windows while pinned")
        assert routing.threshold == 30 and len(controller.moves) == moved
        state = client.get(gw.url + "/admin/adaptive", headers=AUTH).json()
        assert state["paused"] and "PUT /admin/threshold" in state["paused_why"]

        # Resumed: it walks down from the operator's value again, bounded as before.
        resumed = client.put(gw.url + "/admin/adaptive", headers=AUTH, json={"enabled": True})
        assert resumed.status_code == 200 and not resumed.json()["paused"]
        wait_until(traffic_then(lambda: routing.threshold == MINIMUM), what="the threshold back down at min")
        after = [decision for _, decision in list(controller.moves)[moved:]]
        assert after[0].previous == 30 and len(after) >= (30 - MINIMUM) // MAX_STEP
        assert all(abs(m.threshold - m.previous) <= MAX_STEP and m.threshold >= MINIMUM for m in after)


def test_put_adaptive_is_an_admin_route_with_openai_style_errors(adaptive_gateway, gateway):
    gw, _ = adaptive_gateway
    with httpx.Client(timeout=10, trust_env=False) as client:
        assert client.put(gw.url + "/admin/adaptive", json={"enabled": True}).status_code == 401
        for body, param in (({"enabled": "yes"}, "enabled"), ({}, "enabled"), ({"enabled": True, "x": 1}, "x")):
            bad = client.put(gw.url + "/admin/adaptive", headers=AUTH, json=body)
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["param"] == param
        paused = client.put(gw.url + "/admin/adaptive", headers=AUTH, json={"enabled": False})
        assert paused.status_code == 200 and paused.json()["paused"]
        assert client.get(gw.url + "/admin/state", headers=AUTH).json()["adaptive"]["paused"]

    off = gateway(gw.settings.pools.speculative.backends, gw.settings.pools.plain.backends, admin_token=TOKEN)
    with httpx.Client(timeout=10, trust_env=False) as client:
        refused = client.put(off.url + "/admin/adaptive", headers=AUTH, json={"enabled": True})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "adaptive_off"
        # Off: a threshold PUT pins nothing, and the state says it is off.
        assert client.put(off.url + "/admin/threshold", headers=AUTH, json={"threshold": 9}).status_code == 200
        state = client.get(off.url + "/admin/state", headers=AUTH).json()["adaptive"]
        assert not state["enabled"] and not state["paused"] and state["windows"] == 0


def test_only_the_leader_decides_and_a_pause_holds(table):
    """The controller on a gateway's state, stepped by hand: a follower and a paused leader move nothing; the leader
    moves through the routing state, counts and says why. Acceptance as the load scrape would have read it."""
    settings = Settings(
        threshold=START,
        pools={"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:10"]}},
        adaptive={"enabled": True, "table": str(table), "bench_accept_length": BENCH_ACCEPT, "max_step": MAX_STEP,
                  "min": MINIMUM, "max": MAXIMUM, "max_levels": 0},
    )  # fmt: skip
    registry = CollectorRegistry()
    state = build_state(settings, registry)
    controller, coordination = state.adaptive, state.topology.coordination
    assert asyncio.run(controller.step()).reason == "no_acceptance"  # nothing read yet: hold
    (backend,) = state.pools.pool("speculative")
    backend.acceptance, backend.acceptance_at = SpecReading(1.2), time.monotonic()

    coordination.leader = False  # a follower: the leader's moves reach it through the cluster's state
    assert asyncio.run(controller.step()) is None and state.routing.threshold == START
    coordination.leader = True
    controller.pause("test")
    assert asyncio.run(controller.step()) is None and state.routing.threshold == START
    assert controller.view()["paused_why"] == "test"
    controller.resume()
    decision = asyncio.run(controller.step())
    assert (decision.previous, decision.threshold, decision.direction) == (START, START - MAX_STEP, DOWN)
    assert state.routing.threshold == START - MAX_STEP and controller.windows == 4
    assert registry.get_sample_value("crossover_adaptive_moves_total", {"direction": "down"}) == 1
    assert registry.get_sample_value("crossover_adaptive_accept_length") == 1.2
    # Between windows it decides at once only when the acceptance moved by `react` (0.2) since that decision.
    backend.acceptance = SpecReading(1.3)
    assert not controller.acceptance_moved()
    backend.acceptance = SpecReading(1.45)
    assert controller.acceptance_moved()
    asyncio.run(controller.step(early=True))
    assert controller.view()["early_decisions"] == 1 and not controller.acceptance_moved()


def test_explore_alternates_the_arms_and_holds_saying_so_where_realized_leaves_the_predicted_interval(
    sim, gateway, table
):
    """The table says 100 tok/s at one stream; the k25-eagle3 stand-in at time scale 10 serves several times that:
    the switchback's realized tokens leave the prediction's band, and the controller holds and says so."""
    spec, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    gw = gateway(
        [spec.url],
        [plain.url],
        admin_token=TOKEN,
        threshold=START,
        health={"interval": 0.5, "timeout": 2.0, "load_interval": 0.1},
        adaptive={"enabled": True, "table": str(table), "bench_accept_length": BENCH_ACCEPT, "window": 0.3,
                  "max_step": MAX_STEP, "min": MINIMUM, "max": MAXIMUM, "explore": True, "explore_delta": 2},
    )  # fmt: skip
    controller, routing = gw.state.adaptive, gw.state.routing
    served: set[tuple[int, str | None, int | None]] = set()  # (threshold, arm, center) as sampled
    with httpx.Client(timeout=60, trust_env=False) as client:

        def held() -> bool:
            client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=32)).raise_for_status()
            served.add((routing.threshold, controller.arm, controller.center))
            return controller.holding is not None

        wait_until(held, what="explore holding")
        client_state = client.get(gw.url + "/admin/state", headers=AUTH).json()["adaptive"]
        state = client_state["explore"]
    center = controller.center
    # Each arm served its side of the center (the center itself moves with the decisions).
    arms = {arm for threshold, arm, at in served if at is not None and threshold == at + (2 if arm == "up" else -2)}
    assert arms == {"up", "down"}, served
    assert state["holding"] and "realized" in state["why"] and "outside the predicted" in state["why"]
    # The live rate table's evidence against the model, per pool and level, with its counts and factor: the
    # stand-in serves several times the table, so the factor is above 1, pulled toward 1 by the prior.
    levels = client_state["correction"]["levels"]
    assert levels and all(row["requests"] > 0 and row["ratio"] > row["factor"] > 1 for row in levels), levels
    judged = [arm for arm in state["arms"].values() if arm["windows"] >= 2]
    assert judged and all(arm["realized_tokens_per_s"] > arm["interval_tokens_per_s"][1] for arm in judged)
    assert routing.threshold == center and controller.last.reason == "explore_disagrees"
    # Resumed by the operator: it starts over.
    with httpx.Client(timeout=10, trust_env=False) as client:
        resumed = client.put(gw.url + "/admin/adaptive", headers=AUTH, json={"enabled": True}).json()
    assert not resumed["explore"]["holding"] and resumed["explore"]["arms"]["up"]["windows"] == 0
