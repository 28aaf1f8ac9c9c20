"""A time-shared GPU set behind three replicas on one real redis-server: one switch controller (the lease holder),
followers that hold and route their own requests by the mode and phase it publishes, a follower's PUT carried to
it, a leader killed mid-drain replaced by a replica that adopts what really serves, and one killed while its target
starts replaced by one that finishes that start (restart, through the real agent). Stand-ins share the (simulated)
GPU set through the sleep mechanism elsewhere; no test judges wall time beyond generous bounds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from crossover.gateway.admission import Admission
from crossover.gateway.backends.health import Breaker
from crossover.gateway.backends.pools import Pools
from crossover.gateway.cluster.coordination import Cluster
from crossover.gateway.cluster.host import Host, Worker
from crossover.gateway.cluster.host_store import HostStore
from crossover.gateway.errors import SwitchConflict, SwitchRateLimited
from crossover.gateway.metrics import Metrics
from crossover.gateway.topology.factory import TimeShared
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching.controller import Phase, SwitchController
from tests.gateway.cluster.test_coordination_fence import replica_config, role
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.gateway_helpers import LONG, chat
from tests.gateway.ticking import time_shared_settings
from tests.gateway.topology.switching.test_controller import (
    AUTH,
    DROP_REASONS,
    DWELL_S,
    FAST_SWITCHING,
    HYSTERESIS,
    THRESHOLD,
    TOKEN,
    ClosedLoop,
    admin_state,
    memory,
    put_mode,
    released,
    sleep_pair,  # noqa: F401 - a fixture
    switches,
    time_shared,  # noqa: F401 - a fixture
    until,
    wait_phase,
)
from tests.gateway.topology.switching.test_controller_restart import AgentBox, agent_box  # noqa: F401 - a fixture
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


# Seconds (wall clock) the plain stand-in loads for: longer than a lease changing hands, so the leader dies and the
# next one takes over while the agent still starts plain.
TARGET_STARTUP_S = 8.0
# The start-up time the gateway gives a start (`switch_timeout`): generous, a busy machine starts stand-ins slowly.
START_UP_TIME_S = 60.0


def restart_replica_config(box: AgentBox, cluster: dict) -> str:
    """A replica switching by restart through `box`'s agent (test_coordination_fence's), given START_UP_TIME_S."""
    return replica_config(box, box.agent_url, cluster).replace(
        "[switching]\n", f"[switching]\nswitch_timeout = {START_UP_TIME_S}\n", 1
    )


def test_the_leader_killed_while_its_target_starts_the_next_leader_finishes_that_start(
    agent_box,  # noqa: F811
    gateway_process,
    redis_server,
    request,
):
    box = agent_box(plain_startup_s=TARGET_STARTUP_S)
    cluster = {"redis_url": redis_server.url, "name": request.node.name[:60]}
    lease_s = 1.0  # replica_config's
    doomed = gateway_process(restart_replica_config(box, cluster))  # started first: it takes the lease
    wait_until(lambda: role(doomed) == "leader", what="the first replica leading")
    wait_phase(doomed, "active", "speculative")
    taking = gateway_process(restart_replica_config(box, cluster))
    wait_phase(taking, "active", "speculative")
    assert role(taking) == "follower"

    assert put_mode(doomed, "plain").status_code == 202
    wait_until(lambda: box.status("plain")["state"] == "starting", what="the agent starting plain")
    wait_until(lambda: admin_state(taking)["target"] == "plain", what="the follower mirroring the switch")
    os.kill(doomed.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()  # the test's own clock
    doomed.proc.wait(30)
    pid = box.status("plain")["pid"]

    wait_until(lambda: role(taking) == "leader", what="the other replica taking the lease")
    bound = START_UP_TIME_S + lease_s
    state = wait_phase(taking, "active", timeout=2 * bound)
    served_after = time.monotonic() - killed_at
    last = state["last_switch"]
    assert state["mode"] == "plain", last
    # It finished the start it found under way (not a recovery that undid it), and counts that one switch.
    assert (last["to"], last["reason"], last["outcome"]) == ("plain", "adopted", "ok"), last
    labels = (("mechanism", "restart"), ("outcome", "ok"), ("to", "plain"))
    assert taking.metrics()[("crossover_mode_switches_total", labels)] == 1
    assert "plain mode is starting (the switch its last leader began)" in taking.log(), taking.log()
    # One switch is one stop and one start at the agent, in all: the old leader's; the new leader only waited.
    assert (box.operations("stop"), box.operations("start")) == (1, 1)
    assert box.status("plain")["state"] == "ready" and box.status("plain")["pid"] == pid
    assert box.status("speculative")["state"] == "stopped"
    assert served_after <= bound, (served_after, bound)
    answer = httpx.post(taking.url + "/v1/chat/completions", json=chat(), timeout=60, trust_env=False)
    assert answer.status_code == 200 and answer.headers["x-crossover-pool"] == "plain", answer.text


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


class HeldSwitch(SwitchController):
    """A switch that drains until the test ends it (`done`), then serves its target: the run of a switch is not
    under test here, only what a PUT /admin/mode meets while one runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.done = asyncio.Event()

    def _begin(self, target, reason) -> None:
        self.target = target
        self._enter(Phase.DRAINING)
        self._task = asyncio.create_task(self._held(target))

    async def _held(self, target) -> None:
        await self.done.wait()
        self.mode, self.target = target, None
        self._enter(Phase.ACTIVE)


class Replica:
    """A time-shared topology of one replica over the host store of two workers, on a clock the test owns; synced
    by hand (`await replica.sync()`), no servers."""

    def __init__(self, host: Host, slot: int, clock) -> None:
        settings = time_shared_settings(operator_interval=60.0)
        pools = Pools.from_settings(settings)
        routing = Routing.from_settings(settings)
        metrics = Metrics(CollectorRegistry(), pools, routing, Admission(10, 10, 1.0))
        self.cluster = Cluster(HostStore(Worker(host, slot)), pools, lease_s=3600.0, interval_s=3600.0, clock=clock)
        self.controller = HeldSwitch(
            settings,
            pools,
            routing,
            metrics,
            Breaker(pools, settings.health),
            httpx.AsyncClient(),  # never opened
            coordination=self.cluster,
            clock=clock,
        )
        self.topology = TimeShared(pools, routing, metrics, self.cluster, self.controller)

    async def start(self) -> None:
        await self.cluster.start(self.topology.control, self.topology.apply_control)
        if self.cluster.leader:  # the start-up adoption is not under test: the leader serves speculative
            self.controller.acting, self.controller.phase = True, Phase.ACTIVE

    async def sync(self) -> None:
        await self.cluster._sync()

    async def put_mode(self, mode: str) -> tuple[dict, int]:
        """PUT /admin/mode as the admin API runs it."""
        view, status = await self.topology.set_mode(mode, None)
        await self.topology.share()
        return view, status

    def mode_request(self) -> dict | None:
        return self.topology.state_view({"inflight": 0, "queued": 0})["mode_request"]


@contextlib.asynccontextmanager
async def leader_and_follower(tmp_path) -> AsyncIterator[tuple[Replica, Replica, list[float]]]:
    now = [0.0]
    host = Host(2, 1, tmp_path)
    leader, follower = Replica(host, 0, lambda: now[0]), Replica(host, 1, lambda: now[0])
    try:
        await leader.start()
        await follower.start()
        await leader.sync()
        await follower.sync()
        assert follower.controller.phase == "active" and not follower.cluster.leader
        yield leader, follower, now
    finally:
        for replica in (follower, leader):
            await replica.controller.stop()
            await replica.cluster.stop()


def test_a_follower_refuses_a_put_mode_mid_switch_and_too_soon_as_the_leader_does(tmp_path):
    async def scenario() -> None:
        async with leader_and_follower(tmp_path) as (leader, follower, now):
            assert (await leader.put_mode("plain"))[1] == 202  # an operator's switch, on the leader
            await follower.sync()
            assert follower.controller.phase == "draining"
            with pytest.raises(SwitchConflict) as conflict:
                await follower.put_mode("speculative")
            assert conflict.value.status == 409 and "switching to plain" in str(conflict.value)
            leader.controller.done.set()
            await leader.controller._task
            await leader.sync()
            await follower.sync()
            assert (follower.controller.phase, follower.controller.mode) == ("active", "plain")
            now[0] = 1.0
            with pytest.raises(SwitchRateLimited) as limited:  # one operator change per 60 s, on every replica
                await follower.put_mode("speculative")
            assert limited.value.status == 429 and int(limited.value.headers["retry-after"]) == 59
            now[0] = 61.0
            view, status = await follower.put_mode("speculative")
            assert status == 202 and view["mode_request"]["mode"] == "speculative"
            assert follower.mode_request()["answer"] is None  # carried, not yet run
            await leader.sync()
            assert leader.controller.target == "speculative"
            await leader.sync()
            await follower.sync()
            assert follower.mode_request()["answer"] == {"status": 202, "error": None}

    asyncio.run(scenario())


def test_a_put_mode_that_reaches_a_leader_still_finding_out_what_serves_waits_for_it(tmp_path):
    """A replica that has just taken the lease first finds out which mode serves (adoption.py). A request a follower
    carried meanwhile meets no switch: it waits for that and then runs - it is not refused for it (an operator told
    202 whose switch never ran, seen when Redis restarted empty under two replicas)."""

    async def scenario() -> None:
        async with leader_and_follower(tmp_path) as (leader, follower, _):
            controller, found = leader.controller, asyncio.Event()

            async def adopt() -> bool:
                await found.wait()
                controller._activate("speculative")
                return True

            controller.adoption.adopt = adopt
            controller.replica.take_over()  # the lease just taken: finding out what serves
            assert (await follower.put_mode("plain"))[1] == 202
            for replica in (leader, leader, follower):
                await replica.sync()
            assert controller.adopting and follower.mode_request()["answer"] is None  # waiting, not refused
            found.set()
            await controller._task  # adopted: now it runs
            await asyncio.sleep(0)
            assert controller.target == "plain" and controller.phase == "draining"
            await leader.sync()
            await follower.sync()
            assert follower.mode_request()["answer"] == {"status": 202, "error": None}

    asyncio.run(scenario())


def test_a_put_mode_that_reaches_the_leader_mid_switch_is_refused_where_every_replica_sees_it(tmp_path):
    """The follower found no switch under way and answered 202; the leader started one before the request reached
    it. The leader does not run it later (the switch that won may be what was asked): /admin/state on every
    replica says it was refused, and why."""

    async def scenario() -> None:
        async with leader_and_follower(tmp_path) as (leader, follower, _):
            view, status = await follower.put_mode("plain")
            assert status == 202
            request = view["mode_request"]["id"]
            assert (await leader.put_mode("plain"))[1] == 202  # it read no request before its own switch began
            await leader.sync()  # takes the request: refused (409), published on its next round
            await leader.sync()
            await follower.sync()
            for replica in (leader, follower):
                answer = replica.mode_request()
                assert answer["id"] == request and answer["answer"]["status"] == 409
                assert "switching to plain" in answer["answer"]["error"]
            assert leader.controller.switches == 0 and leader.controller.target == "plain"

    asyncio.run(scenario())
