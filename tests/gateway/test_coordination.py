"""Replicas of one gateway on one real redis-server, each a real gateway on uvicorn in front of the same stand-ins:
one live state, one leader, everyone's in-flight counts, and what a Redis that goes away (or a replica cut off from
it) changes. How soon a change spreads is counted in each replica's own sync rounds, never in wall time."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossover.gateway.coordination import Cluster, Solo
from tests.gateway.cluster_helpers import RedisServer, TcpProxy, needs_redis
from tests.gateway.gateway_helpers import chat, hold, wait_until

pytestmark = needs_redis

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# A change is live everywhere within this many of each replica's sync rounds after the PUT returned: the round
# under way when it was written may have read before it. At the default sync_interval (0.25 s): half a second.
SPREAD_ROUNDS = 2


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer.start()
    yield server
    server.stop()


@pytest.fixture
def replicas(gateway, sims, redis_server, request):
    """`replicas(n, name=..., redis_url=...)`: n partitioned gateways on one cluster, the first started first."""
    speculative, plain = sims

    def start(n: int = 3, *, redis_url: str | None = None, urls: list[str] | None = None, **cluster):
        cluster = {"redis_url": redis_server.url, "name": request.node.name[:60], "sync_interval": 0.1, **cluster}
        urls = urls or [redis_url or redis_server.url] * n
        return [
            gateway(
                [speculative.url],
                [plain.url],
                admin_token=TOKEN,
                threshold=32,
                hysteresis=4,
                cluster={**cluster, "redis_url": url},
            )
            for url in urls
        ]

    return start


def cluster_of(replica) -> Cluster:
    coordination = replica.state.topology.coordination
    assert isinstance(coordination, Cluster)
    return coordination


def admin(replica, method: str, path: str, **body) -> httpx.Response:
    return httpx.request(method, replica.url + path, headers=ADMIN, json=body or None, timeout=30, trust_env=False)


def test_without_a_cluster_a_gateway_is_its_own_leader_and_says_so(gateway, sims):
    speculative, plain = sims
    alone = gateway([speculative.url], [plain.url], admin_token=TOKEN)
    assert isinstance(alone.state.topology.coordination, Solo)
    assert admin(alone, "GET", "/admin/state").json()["cluster"] is None
    assert alone.metric("crossover_cluster_connected") == 1 and alone.metric("crossover_cluster_leader") == 1


def test_a_put_on_one_replica_is_live_on_all_three_and_reads_back_identical(replicas):
    group = replicas(3)
    wait_until(lambda: sum(cluster_of(r).leader for r in group) == 1, what="one leader")
    response = admin(group[1], "PUT", "/admin/threshold", threshold=12, hysteresis=3)
    assert response.status_code == 200, response.text
    put_at = [cluster_of(r).rounds for r in group]
    for replica, start in zip(group, put_at, strict=True):
        wait_until(lambda r=replica: r.state.routing.threshold == 12, what="the threshold on every replica")
        assert cluster_of(replica).rounds - start <= SPREAD_ROUNDS
    views = [admin(r, "GET", "/admin/threshold").json() for r in group]
    assert all((v["threshold"], v["hysteresis"], v["policy"]) == (12, 3, "spillover") for v in views), views
    states = [admin(r, "GET", "/admin/state").json()["cluster"] for r in group]
    assert sorted(s["role"] for s in states) == ["follower", "follower", "leader"]
    assert all(s["connected"] and s["problem"] is None for s in states)
    assert len({s["control_version"] for s in states}) == 1


def test_a_replica_that_joins_serves_the_cluster_state_not_its_configuration(replicas, redis_server):
    first = replicas(1)[0]
    assert admin(first, "PUT", "/admin/threshold", threshold=5).status_code == 200
    late = replicas(1)[0]  # configured with threshold 32
    assert late.state.routing.threshold == 5  # from its first sync, before it served


def test_every_replica_counts_the_others_requests_in_its_load(replicas):
    one, other = replicas(2)

    async def main():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client, hold(client, one.url, 3) as pools:
            assert pools == ["speculative"] * 3
            await asyncio.to_thread(
                wait_until,
                lambda: other.state.pools.pool_load("speculative") == 3,
                what="the other replica's 3 requests in this one's load",
            )
            assert other.state.pools.inflight("speculative") == 0  # its own count is its own
        await asyncio.to_thread(
            wait_until, lambda: other.state.pools.pool_load("speculative") == 0, what="the load gone with them"
        )

    asyncio.run(main())


def test_redis_down_every_replica_serves_on_the_last_state_and_says_so_then_converges(replicas, redis_server):
    group = replicas(3)
    assert admin(group[0], "PUT", "/admin/threshold", threshold=20).status_code == 200
    wait_until(lambda: all(r.state.routing.threshold == 20 for r in group), what="threshold 20 everywhere")
    redis_server.stop()
    try:
        wait_until(lambda: not any(cluster_of(r).connected for r in group), what="every replica sees Redis gone")
        for replica in group:
            answer = httpx.post(
                replica.url + "/v1/chat/completions",
                json=chat(max_tokens=4),
                timeout=60,
                trust_env=False,
            )
            assert answer.status_code == 200, answer.text
            state = admin(replica, "GET", "/admin/state").json()
            assert state["threshold"] == 20
            assert state["cluster"]["connected"] is False and "redis" in state["cluster"]["problem"]
            assert replica.metric("crossover_cluster_connected") == 0
        wait_until(lambda: not any(cluster_of(r).leader for r in group), what="no leader without Redis")
        # A change while Redis is down: live where it was made, said not shared; shared when Redis is back.
        refused = admin(group[2], "PUT", "/admin/threshold", threshold=7)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_not_shared"
        assert group[2].state.routing.threshold == 7 and group[0].state.routing.threshold == 20
    finally:
        redis_server.restart()
    wait_until(lambda: all(cluster_of(r).connected for r in group), what="every replica reconnected")
    wait_until(lambda: all(r.state.routing.threshold == 7 for r in group), what="converged on the last change")
    wait_until(lambda: sum(cluster_of(r).leader for r in group) == 1, what="one leader again")
    assert all(r.metric("crossover_cluster_connected") == 1 for r in group)


def test_a_replica_cut_off_from_redis_stops_acting_when_its_lease_would_have_expired(replicas, redis_server):
    proxy = TcpProxy(redis_server.port)
    cut = replicas(1, redis_url=proxy.url, lease=1.0)[0]
    wait_until(lambda: cluster_of(cut).leader, what="the first replica leads")
    others = replicas(2, lease=1.0)
    assert not any(cluster_of(r).leader for r in others)
    proxy.cut()
    two_leaders = []

    def handed_over() -> bool:
        leaders = [r for r in [cut, *others] if cluster_of(r).leader]
        if len(leaders) > 1:
            two_leaders.append(len(leaders))
        return not cluster_of(cut).leader and len(leaders) == 1

    wait_until(handed_over, what="the lease handed to a replica that reaches Redis")
    assert two_leaders == []
    view = admin(cut, "GET", "/admin/state").json()["cluster"]
    assert view["role"] == "follower" and view["connected"] is False and view["fence"] is None
    assert cluster_of(cut).fence() is None
