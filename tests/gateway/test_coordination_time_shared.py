"""A time-shared GPU set behind three replicas on one real redis-server: one switch controller (the lease holder),
followers that hold and route their own requests by the mode and phase it publishes, a follower's PUT carried to
it, and a leader killed mid-drain replaced by a replica that adopts what really serves. Stand-ins share the
(simulated) GPU set through the sleep mechanism; no test judges wall time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import httpx
import pytest

from crossover.gateway.coordination import Cluster
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.gateway_helpers import LONG, chat
from tests.gateway.test_switching import (
    AUTH,
    DROP_REASONS,
    DWELL_S,
    FAST_SWITCHING,
    HYSTERESIS,
    THRESHOLD,
    TOKEN,
    ClosedLoop,
    memory,
    released,
    sleep_pair,  # noqa: F401 - a fixture
    switches,
    time_shared,  # noqa: F401 - a fixture
    until,
)
from tests.waiting import wait_until

pytestmark = needs_redis
# Sync rounds beyond the lease: the round under way at the kill and the one that takes the lease.
SLACK_ROUNDS = 2


@pytest.fixture
def cluster_settings(redis_server, request) -> dict:
    return {"redis_url": redis_server.url, "name": request.node.name[:60], "sync_interval": 0.1, "lease": 1.0}


@pytest.fixture
def time_shared_replicas(time_shared, cluster_settings):  # noqa: F811
    def start(speculative: str, plain: str, n: int = 3, **switching):
        return [time_shared(speculative, plain, cluster=cluster_settings, **switching) for _ in range(n)]

    return start


def coordination(gw) -> Cluster:
    return gw.state.topology.coordination


def leader_of(group):
    wait_until(lambda: sum(coordination(gw).leader for gw in group) == 1, what="one leader")
    return next(gw for gw in group if coordination(gw).leader)


def all_serving(group, mode: str) -> bool:
    controllers = [gw.state.topology.controller for gw in group]
    return all(controller.phase == "active" and controller.mode == mode for controller in controllers)


@contextlib.asynccontextmanager
async def loads_on(group) -> AsyncIterator[list[ClosedLoop]]:
    """One closed loop of streaming clients per replica, none running yet; on exit every one stops (each request
    read to its end)."""
    clients = [httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) for gw in group]
    loads = [ClosedLoop(client) for client in clients]
    try:
        yield loads
    finally:
        for load in loads:
            await load.stop()
        for client in clients:
            await client.aclose()


def problems(loads: list[ClosedLoop]) -> list[tuple[int, str]]:
    return [result for load in loads for result in load.results if result != (200, "")]


def test_one_load_step_over_three_replicas_is_one_switch_each_way_not_three(sleep_pair, time_shared_replicas):  # noqa: F811
    speculative, plain = sleep_pair
    group = time_shared_replicas(speculative.url, plain.url)
    leader = leader_of(group)
    wait_until(lambda: all_serving(group, "speculative"), what="every replica serving speculative")

    async def scenario() -> list[ClosedLoop]:
        async with loads_on(group) as loads:
            for load in loads:
                load.resize(1)  # 3 in all: below the threshold
            await asyncio.sleep(3 * DWELL_S)
            for load in loads:
                load.resize(THRESHOLD)  # 3x the threshold in all, a third through each replica
            await until(lambda: all_serving(group, "plain"), what="every replica serving plain", gw=leader)
            await asyncio.sleep(3 * DWELL_S)
            loads[0].resize(1)
            for load in loads[1:]:
                load.resize(0)
            await until(lambda: all_serving(group, "speculative"), what="every replica back on speculative", gw=leader)
            await asyncio.sleep(3 * DWELL_S)
        return loads

    loads = asyncio.run(scenario())
    counts = [switches(gw, "sleep") for gw in group]
    assert sum(sum(c.values()) for c in counts) == 2, counts  # one switch each way, in the whole cluster
    assert switches(leader, "sleep")[("plain", "ok")] == 1 and switches(leader, "sleep")[("speculative", "ok")] == 1
    assert not problems(loads), problems(loads)[:3]
    assert all(len(load.results) > 10 for load in loads)
    for gw in group:
        assert sum(gw.metric("crossover_switch_dropped_total", reason=reason) for reason in DROP_REASONS) == 0
    for url in (speculative.url, plain.url):
        stats = memory(url)
        assert stats["release_refused_total"] == 0 and stats["resume_not_released_total"] == 0, stats


def test_a_put_mode_on_a_follower_is_run_by_the_leader_and_mirrored_everywhere(sleep_pair, time_shared_replicas):  # noqa: F811
    speculative, plain = sleep_pair
    group = time_shared_replicas(speculative.url, plain.url, dwell=3600.0)
    leader = leader_of(group)
    wait_until(lambda: all_serving(group, "speculative"), what="every replica serving speculative")
    follower = next(gw for gw in group if gw is not leader)
    response = httpx.put(
        follower.url + "/admin/mode", json={"mode": "plain", "pin": True}, headers=AUTH, timeout=30, trust_env=False
    )
    assert response.status_code == 202, response.text
    wait_until(lambda: all_serving(group, "plain"), what="every replica serving plain")
    wait_until(lambda: all(gw.state.topology.controller.pinned for gw in group), what="pinned everywhere")
    assert released(speculative.url) == ["cuda_graph", "kv_cache", "weights"] and released(plain.url) == []
    assert switches(leader, "sleep")[("plain", "ok")] == 1
    assert all(sum(switches(gw, "sleep").values()) == 0 for gw in group if gw is not leader)
    for gw in group:
        answer = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=60, trust_env=False)
        assert answer.status_code == 200 and answer.headers["x-crossover-pool"] == "plain"


def test_the_leader_killed_during_a_drain_leaves_the_gpu_set_serving_one_mode(
    sleep_pair,  # noqa: F811
    time_shared_replicas,
    gateway_process,
    cluster_settings,
):
    speculative, plain = sleep_pair
    switching = {**FAST_SWITCHING, "dwell": 3600.0, "drain_deadline": 600.0}
    toml = "\n".join(
        [
            'topology = "time-shared"',
            f'admin_token = "{TOKEN}"',
            f"threshold = {THRESHOLD}",
            f"hysteresis = {HYSTERESIS}",
            "[pools.speculative]",
            f'backends = ["{speculative.url}"]',
            "[pools.plain]",
            f'backends = ["{plain.url}"]',
            "[health]",
            "interval = 0.5",
            "[switching]",
            *(f"{key} = {value!r}".replace("'", '"') for key, value in switching.items()),
            "[cluster]",
            *(f"{key} = {value!r}".replace("'", '"') for key, value in cluster_settings.items()),
        ]
    )
    doomed = gateway_process(toml)  # started first, so it takes the lease

    def state(url: str) -> dict:
        return httpx.get(url + "/admin/state", headers=AUTH, timeout=10, trust_env=False).json()

    wait_until(lambda: state(doomed.url)["cluster"]["role"] == "leader", what="the process leads")
    wait_until(lambda: state(doomed.url)["phase"] == "active", what="the leader serving")
    followers = time_shared_replicas(speculative.url, plain.url, n=2, dwell=3600.0, drain_deadline=600.0)
    wait_until(lambda: all_serving(followers, "speculative"), what="the followers serving speculative")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            # A long stream on the leader keeps its drain going until the leader dies.
            request = client.build_request("POST", doomed.url + "/v1/chat/completions", json=chat(True, LONG))
            stream = await client.send(request, stream=True)
            try:
                assert stream.status_code == 200
                put = await client.put(doomed.url + "/admin/mode", json={"mode": "plain"}, headers=AUTH)
                assert put.status_code == 202, put.text
                await until(
                    lambda: all(gw.state.topology.controller.phase == "draining" for gw in followers),
                    what="the followers mirroring the drain",
                )
                os.kill(doomed.proc.pid, signal.SIGKILL)
                killed_at.extend(coordination(gw).rounds for gw in followers)
                doomed.proc.wait(30)
            finally:
                await stream.aclose()

    killed_at: list[int] = []
    asyncio.run(scenario())
    new = leader_of(followers)
    wait_until(lambda: all(gw.state.topology.controller.phase == "active" for gw in followers), what="a serving mode")
    # The lease changed hands within the lease, counted in the new leader's own sync rounds: a round lasts at least
    # sync_interval, so a busy machine only makes fewer of them.
    start = killed_at[followers.index(new)]
    bound = cluster_settings["lease"] / cluster_settings["sync_interval"] + SLACK_ROUNDS
    assert coordination(new).took_lease_round - start <= bound, (coordination(new).took_lease_round, start, bound)
    mode = new.state.topology.controller.mode
    assert all(gw.state.topology.controller.mode == mode for gw in followers)
    # One mode holds the GPU set: the one that serves is awake, the other released.
    awake, asleep = (speculative, plain) if mode == "speculative" else (plain, speculative)
    assert released(awake.url) == [] and released(asleep.url) == ["cuda_graph", "kv_cache", "weights"]
    for gw in followers:
        answer = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=60, trust_env=False)
        assert answer.status_code == 200 and answer.headers["x-crossover-pool"] == mode


def test_redis_stopped_no_switch_starts_and_serving_continues_redis_back_the_cluster_converges(
    sleep_pair,  # noqa: F811
    time_shared_replicas,
    redis_server,
):
    speculative, plain = sleep_pair
    group = time_shared_replicas(speculative.url, plain.url)
    leader = leader_of(group)
    wait_until(lambda: all_serving(group, "speculative"), what="every replica serving speculative")
    redis_server.stop()
    restarted = False
    try:
        wait_until(lambda: not any(coordination(gw).connected for gw in group), what="every replica sees Redis gone")
        refused = httpx.put(leader.url + "/admin/mode", json={"mode": "plain"}, headers=AUTH, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_not_shared"

        async def scenario() -> list[ClosedLoop]:
            async with loads_on(group) as loads:
                for load in loads:
                    load.resize(THRESHOLD)  # 3x the threshold in all: a switch, were the cluster whole
                # Several dwell windows on the leader's own rounds (a round lasts at least sync_interval).
                start = coordination(leader).rounds
                rounds = 3 * DWELL_S / coordination(leader).interval_s
                await until(lambda: coordination(leader).rounds - start >= rounds, what="three dwell windows")
                assert all_serving(group, "speculative")
                assert sum(sum(switches(gw, "sleep").values()) for gw in group) == 0
                for gw in group:
                    view = gw.state.snapshot()
                    assert view["cluster"]["connected"] is False and "redis" in view["cluster"]["problem"]
                    assert gw.metric("crossover_cluster_connected") == 0
                nonlocal restarted
                redis_server.restart()
                restarted = True
                await until(lambda: all_serving(group, "plain"), what="the cluster switching once Redis is back")
            return loads

        loads = asyncio.run(scenario())
    finally:
        if not restarted:
            redis_server.restart()
    assert not problems(loads), problems(loads)[:3]
    assert sum(switches(gw, "sleep")[("plain", "ok")] for gw in group) == 1
    wait_until(lambda: all(coordination(gw).connected for gw in group), what="every replica connected")
    assert all(gw.metric("crossover_cluster_connected") == 1 for gw in group)
