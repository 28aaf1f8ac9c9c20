"""The fencing token never goes back, whatever the store forgets: real `crossover serve` replicas, a real
redis-server, the real agent and real gated stand-ins.

The GPU set's resources remember the highest token they accepted (the agent on disk, the engine in memory); the
store that hands tokens out may not (a Redis restarted empty, `crossover serve --workers N` restarted). The first
refusal names the highest token, the refused member raises the store's counter past it and takes the lease again:
one refused call, where every lease handed out a token one larger and each was refused in turn before.

Each test judges what was refused and what token leads afterwards, not how long it took: the old code fails on
both (the counter climbs from 1, one refusal per lease).
"""

from __future__ import annotations

import httpx
import pytest
import redis

from crossover.gateway.engines.fence import FENCE_HEADER
from tests.gateway.cluster.test_coordination_fence import (
    agent_metric,
    engine_fence,
    in_engine_config,
    put_threshold,
    replica_config,
    role,
)
from tests.gateway.cluster_helpers import RedisServer, needs_redis
from tests.gateway.gateway_helpers import SIM_SCALE
from tests.gateway.topology.switching.test_controller import admin_state, put_mode, wait_phase
from tests.gateway.topology.switching.test_controller_restart import AGENT_TOKEN, agent_box  # noqa: F401 - a fixture
from tests.gateway.topology.test_gates import engine_gate
from tests.waiting import wait_until

pytestmark = needs_redis
# The token the GPU set's resources accepted before the store forgot its counter.
REACHED = 40
WAIT_S = 120.0


@pytest.fixture
def fresh_redis():
    """A redis-server of the test's own: the test restarts it empty."""
    server = RedisServer.start()
    yield server
    server.stop()


def counter_at(redis_url: str, name: str, token: int) -> None:
    """The cluster's token counter as a long-lived cluster leaves it: the next lease gets `token`."""
    with redis.Redis.from_url(redis_url) as direct:
        direct.set(f"{name}:fence", token - 1)


def leader(replicas):
    wait_until(lambda: any(role(gw) == "leader" for gw in replicas), timeout=WAIT_S, what="a replica leading")
    return next(gw for gw in replicas if role(gw) == "leader")


def fence_of(gw) -> int | None:
    return admin_state(gw)["cluster"]["fence"]


def forgotten(server: RedisServer, replicas) -> None:
    """Redis restarted empty, and only a token from its counter started again at 1 leads (until then the old
    leader's lease may still be valid by its own clock: its calls carry the old token, and pass)."""
    server.stop()
    server.restart()

    def fresh_leader() -> bool:
        fences = [view["fence"] for gw in replicas if (view := admin_state(gw)["cluster"])["role"] == "leader"]
        return bool(fences) and all(fence < REACHED for fence in fences)

    wait_until(
        fresh_leader,
        timeout=WAIT_S,
        what="a replica leading under a token from the empty store",
    )


def until_answered(call, statuses: tuple[int, ...], what: str) -> httpx.Response:
    """`call()` until it answers one of `statuses`: a replica answers 503 `state_not_shared` while the store it lost
    is not back in its view (that is the PUT refused, not lost)."""
    answers: list[httpx.Response] = []

    def answered() -> bool:
        answers.append(call())
        return answers[-1].status_code in statuses

    wait_until(answered, timeout=WAIT_S, what=what)
    return answers[-1]


def test_in_engine_redis_restarted_empty_the_next_put_is_on_the_engine_after_one_refusal(
    sim, gateway_process, fresh_redis, request
):
    engine = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    cluster = {"redis_url": fresh_redis.url, "name": request.node.name[:60]}
    counter_at(fresh_redis.url, cluster["name"], REACHED)
    replicas = [gateway_process(in_engine_config(engine.url, cluster)) for _ in range(2)]
    assert fence_of(leader(replicas)) == REACHED
    wait_until(lambda: engine_fence(engine.url)["highest"] == REACHED, what="the engine accepting the token")

    forgotten(fresh_redis, replicas)
    put = until_answered(lambda: put_threshold(replicas[0], 12), (200,), what="the PUT taken by the cluster")
    assert put.status_code == 200, put.text
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 12, timeout=WAIT_S, what="the gate live")

    # One lease from the empty store was refused, its holder raised the counter past the engine's token and led
    # again under the next one: not one refusal (and one lease) per token back up to 40.
    fence = engine_fence(engine.url)
    assert fence["highest"] == REACHED + 1, fence
    assert 1 <= fence["refused"] <= 2, fence
    now = leader(replicas)
    assert fence_of(now) == REACHED + 1
    assert any(f"raised past {REACHED}" in gw.log() for gw in replicas), [gw.log() for gw in replicas]
    assert {admin_state(gw)["threshold"] for gw in replicas} == {12}


def test_time_shared_redis_restarted_empty_the_next_switch_runs_after_one_refusal(
    agent_box,  # noqa: F811
    gateway_process,
    fresh_redis,
    request,
):
    box = agent_box()
    cluster = {"redis_url": fresh_redis.url, "name": request.node.name[:60]}
    counter_at(fresh_redis.url, cluster["name"], REACHED)
    replicas = [gateway_process(replica_config(box, box.agent_url, cluster)) for _ in range(2)]
    first = leader(replicas)
    assert fence_of(first) == REACHED
    wait_phase(first, "active", "speculative")

    forgotten(fresh_redis, replicas)
    put = until_answered(lambda: put_mode(first, "plain"), (202,), what="the switch taken by the cluster")
    assert put.status_code == 202, put.text
    for gw in replicas:
        wait_phase(gw, "active", "plain", timeout=WAIT_S)

    assert box.status("plain")["state"] == "ready" and box.status("speculative")["state"] == "stopped"
    # The refused lease is the only one: the counter went past 40 once, and the switch ran under the next token.
    fenced = sum(agent_metric(box, f'crossover_agent_fenced_total{{operation="{op}"}}') for op in ("status", "stop"))
    assert 1 <= fenced <= 3, box.log()
    assert fence_of(leader(replicas)) == REACHED + 1
    # The operator's switch met the fence first (the lease from the empty store): said so, and run again once the
    # replica led under a token that passes - not a silent 202.
    logs = "".join(gw.log() for gw in replicas)
    assert "refused by the GPU set's fence" in logs and "this replica leads again: running it" in logs, logs
    assert agent_metric(box, 'crossover_agent_operations_total{operation="stop",outcome="ok"}') == 1
    assert agent_metric(box, 'crossover_agent_operations_total{operation="start",outcome="ok"}') == 1


def test_workers_restarted_in_front_of_an_engine_that_accepted_token_50_write_its_gate(sim, gateway_process):
    engine = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    # What the workers of the last run left on the engine: a fence at 50 (under it, the gate they wrote).
    raised = httpx.post(
        engine.url + "/speculative/adaptive",
        json={"zero_steps_above_bs": 8},
        headers={FENCE_HEADER: "50"},
        timeout=10,
        trust_env=False,
    )
    assert raised.status_code == 200, raised.text
    config = in_engine_config(engine.url, {"redis_url": "", "name": ""}).split("[cluster]")[0]
    gw = gateway_process("workers = 2\n" + config)
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 4, timeout=WAIT_S, what="the start-up gate")
    assert put_threshold(gw, 12).status_code == 200
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 12, timeout=WAIT_S, what="the gate live")
    fence = engine_fence(engine.url)
    assert fence["highest"] == 51 and fence["refused"] == 1, fence
    assert "raised past 50" in gw.log()


def test_workers_restarted_in_front_of_an_agent_that_accepted_token_50_switch(
    agent_box,  # noqa: F811
    gateway_process,
):
    box = agent_box()
    status = httpx.get(
        box.agent_url + "/servers/speculative",
        headers={"authorization": f"Bearer {AGENT_TOKEN}", FENCE_HEADER: "50"},
        timeout=10,
        trust_env=False,
    )
    assert status.status_code == 200, status.text
    config = replica_config(box, box.agent_url, {"redis_url": "", "name": ""}).split("[cluster]")[0]
    gw = gateway_process("workers = 2\n" + config)
    wait_phase(gw, "active", "speculative")
    put = until_answered(lambda: put_mode(gw, "plain"), (202,), what="the switch taken")
    assert put.status_code == 202, put.text
    wait_phase(gw, "active", "plain", timeout=WAIT_S)
    assert box.status("plain")["state"] == "ready" and box.status("speculative")["state"] == "stopped"
    assert agent_metric(box, 'crossover_agent_operations_total{operation="stop",outcome="ok"}') == 1
    assert agent_metric(box, 'crossover_agent_operations_total{operation="start",outcome="ok"}') == 1
    assert "raised past 50" in gw.log()
