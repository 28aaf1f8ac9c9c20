"""Replicas of one gateway on one real redis-server, each a real gateway on uvicorn in front of the same stand-ins:
one live state, one leader, everyone's in-flight counts, and what a Redis that goes away (or a replica cut off from
it) changes. How soon a change spreads is counted in each replica's own sync rounds, never in wall time."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import redis

from crossover.gateway.backends.pools import Pools
from crossover.gateway.cluster import Cluster, Control, ModeRequest, Solo, Store
from crossover.gateway.cluster.host import Host, Worker
from crossover.gateway.cluster.host_store import HostStore
from crossover.gateway.cluster.redis_store import RedisStore
from crossover.gateway.config import Settings
from crossover.gateway.engines import sglang
from tests.gateway.cluster_helpers import TcpProxy, needs_redis
from tests.gateway.gateway_helpers import chat, hold, wait_until
from tests.gateway.topology.test_gates import engine_gate, faulty  # noqa: F401 - a fixture

pytestmark = needs_redis

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# A change is live everywhere within this many of each replica's sync rounds after the PUT returned: the round
# under way when it was written may have read before it. At the default sync_interval (0.25 s): half a second.
SPREAD_ROUNDS = 2


@pytest.fixture
def replicas(gateway, sims, redis_server, request):
    """`replicas(n, name=..., redis_url=...)`: n partitioned gateways on one cluster, the first started first;
    `one_server`: the speculative stand-in in both pools."""
    speculative, plain = sims

    def start(
        n: int = 3, *, redis_url: str | None = None, urls: list[str] | None = None, one_server: bool = False, **cluster
    ):
        cluster = {"redis_url": redis_server.url, "name": request.node.name[:60], "sync_interval": 0.1, **cluster}
        urls = urls or [redis_url or redis_server.url] * n
        return [
            gateway(
                [speculative.url],
                [speculative.url if one_server else plain.url],
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


def test_a_get_on_another_replica_right_after_a_puts_200_reads_the_new_value(replicas):
    """Syncs 10 s apart: nothing but the GET itself can have brought the change over (issue 39)."""
    first, second = replicas(2, sync_interval=10.0, lease=30.0)
    for threshold, hysteresis in ((12, 3), (20, 5), (7, 0)):
        put = admin(first, "PUT", "/admin/threshold", threshold=threshold, hysteresis=hysteresis)
        assert put.status_code == 200, put.text
        rounds = cluster_of(second).rounds
        view = admin(second, "GET", "/admin/threshold").json()
        assert (view["threshold"], view["hysteresis"]) == (threshold, hysteresis)
        assert admin(second, "GET", "/admin/state").json()["threshold"] == threshold
        assert cluster_of(second).rounds == rounds  # read by the GET, not by a sync that happened to run


def test_a_replica_that_joins_serves_the_cluster_state_not_its_configuration(replicas, redis_server):
    first = replicas(1)[0]
    assert admin(first, "PUT", "/admin/threshold", threshold=5).status_code == 200
    late = replicas(1)[0]  # configured with threshold 32
    assert late.state.routing.threshold == 5  # from its first sync, before it served


@pytest.mark.parametrize("one_server", [False, True], ids=["two-servers", "one-server-in-both-pools"])
def test_every_replica_counts_the_others_requests_in_its_load_per_pool(replicas, one_server):
    # One server in both pools is allowed (config.py: a single-GPU trial): the counts a replica publishes are its
    # pools', not its URLs'.
    one, other = replicas(2, one_server=one_server)

    async def main():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client, hold(client, one.url, 3) as pools:
            assert pools == ["speculative"] * 3
            await asyncio.to_thread(
                wait_until,
                lambda: other.state.pools.pool_load("speculative") == 3,
                what="the other replica's 3 requests in this one's speculative load",
            )
            assert other.state.pools.inflight("speculative") == 0  # its own count is its own
            assert other.state.pools.pool_load("plain") == 0
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


def test_in_engine_a_put_on_one_of_two_replicas_is_every_engines_gate_and_stays(gateway, faulty, redis_server, request):  # noqa: F811
    backends = faulty(2)  # gated stand-ins, each behind a recorder of the gate calls it gets
    engines = [engine for engine, _, _ in backends]
    cluster = {"redis_url": redis_server.url, "name": request.node.name[:60], "sync_interval": 0.1}

    def replica(threshold: int):
        # Configured apart on purpose: without a cluster each would keep its own gate on every engine.
        return gateway(
            [],
            [],
            topology="in-engine",
            threshold=threshold,
            admin_token=TOKEN,
            pools={"speculative": {"backends": [url for _, _, url in backends]}},
            health={"interval": 0.2, "timeout": 2.0},
            cluster=cluster,
        )

    group = [replica(4), replica(9)]
    assert group[1].state.routing.threshold == 4  # joined the cluster's state
    leader = next(gw for gw in group if cluster_of(gw).leader)
    follower = next(gw for gw in group if gw is not leader)
    response = admin(follower, "PUT", "/admin/threshold", threshold=12)
    assert response.status_code == 200, response.text
    wait_until(lambda: [engine_gate(e.url)["zero_steps_above_bs"] for e in engines] == [12, 12], what="gate 12")
    generations = [engine_gate(e.url)["generation"] for e in engines]
    # Several health intervals, on the gateways' own rounds: every replica reads each gate back three more times.
    url_of = {engine.url: url for engine, _, url in backends}
    reads = {(id(gw), e.url): set() for gw in group for e in engines}

    def read_three_times() -> bool:
        for gw in group:
            for e in engines:
                gate = gw.state.topology.gates.gates.get(url_of[e.url])
                reads[(id(gw), e.url)].add(id(gate))
        return all(len(seen) >= 4 for seen in reads.values())

    wait_until(read_three_times, what="three more gate rounds on each replica")
    assert [engine_gate(e.url)["zero_steps_above_bs"] for e in engines] == [12, 12]
    assert [engine_gate(e.url)["generation"] for e in engines] == generations  # nobody wrote it again
    wait_until(
        lambda: all(
            g["in_sync"] for gw in group for g in admin(gw, "GET", "/admin/state").json()["backend_gates"].values()
        ),
        what="every replica reads every gate back in sync",
    )
    assert all(gw.state.routing.threshold == 12 for gw in group)
    # Every gate write came from the leader, under its fencing token; the follower never wrote one.
    token = str(cluster_of(leader).fence())
    assert all(faults.write_fences and set(faults.write_fences) == {token} for _, faults, _ in backends)


class Member:
    """A Cluster over a real Redis (or `store`) with a plain-data `local` state, synced by hand (`await
    member.sync()`)."""

    def __init__(self, redis_url: str, name: str, threshold: int, store: Store | None = None) -> None:
        pools = {"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:10"]}}
        settings = Settings(pools=pools, threshold=threshold)
        self.local = Control(threshold=threshold, hysteresis=settings.hysteresis, policy=settings.policy)
        store = store or RedisStore(redis_url, name, timeout_s=2.0)
        self.cluster = Cluster(store, Pools.from_settings(settings), lease_s=5.0, interval_s=60.0)

    async def apply(self, control: Control) -> None:
        self.local = control

    async def start(self) -> None:
        await self.cluster.start(lambda: self.local, self.apply)

    async def sync(self) -> None:
        await self.cluster._sync()


def test_a_store_restored_by_a_member_that_missed_the_newest_change_is_set_right(redis_server, request):
    async def main():
        name = request.node.name[:60]
        a, b = Member(redis_server.url, name, 20), Member(redis_server.url, name, 20)
        await a.start()
        await b.start()
        try:
            await a.cluster.store._redis.flushdb()  # Redis restarted empty
            b.local = b.local.model_copy(update={"threshold": 7})  # changed on b while it was gone
            await b.sync()  # b writes its change first ...
            stale = a.cluster.seen  # ... and a, which read the empty store just before, restores what it knew
            await a.cluster.store.put_control(stale, b.cluster.seen.version)
            await b.sync()  # b sees the store went back and writes its change again
            await a.sync()
            await b.sync()
            assert a.local.threshold == b.local.threshold == 7
            assert a.cluster.seen.same(b.cluster.seen) and a.cluster.seen.version == b.cluster.seen.version
        finally:
            await a.cluster.stop()
            await b.cluster.stop()

    asyncio.run(main())


class Interleaved:
    """A member's store that runs a step the test gives it (`before[call]`) once, just before that call reaches the
    store: another member's write lands between this member's read and its write, on no clock at all."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.before: dict = {}

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    async def get_control(self):
        await self._step("get_control")
        return await self.store.get_control()

    async def put_control(self, *args):
        await self._step("put_control")
        return await self.store.put_control(*args)

    async def _step(self, call: str) -> None:
        step = self.before.pop(call, None)
        if step is not None:
            await step()


@pytest.fixture(params=["redis", "host"])
def two_members(request, redis_server, tmp_path):
    """A leader and a follower on one store of each kind: Redis, and the host store of two workers."""
    name = request.node.name[:60]
    host = Host(2, 1, tmp_path)

    def member(slot: int) -> Member:
        store = RedisStore(redis_server.url, name, timeout_s=2.0) if request.param == "redis" else None
        store = Interleaved(store or HostStore(Worker(host, slot)))
        return Member(redis_server.url, name, 20, store)

    return member(0), member(1)


async def started(members):
    for member in members:
        await member.start()
    leader, follower = members
    assert leader.cluster.leader and not follower.cluster.leader


async def stopped(members):
    for member in members:
        await member.cluster.stop()


def publishes(member: Member, phase: str) -> None:
    member.local = member.local.model_copy(update={"mode": "speculative", "phase": phase, "target": "plain"})


def carries(member: Member) -> ModeRequest:
    request = ModeRequest(id="put-1", mode="plain")
    member.local = member.local.model_copy(update={"mode_request": request})
    return request


def test_a_leader_publishing_between_a_followers_read_and_write_loses_nothing(two_members):
    """The follower carries a PUT /admin/mode; the leader publishes its phase just before the follower's write
    lands. Both are stored, and each member has the other's."""
    leader, follower = two_members

    async def main():
        await started(two_members)
        try:
            publishes(leader, "draining")
            follower.cluster.store.before["put_control"] = leader.sync
            request = carries(follower)
            await follower.sync()
            stored = await follower.cluster.store.get_control()
            assert (stored.phase, stored.mode_request) == ("draining", request)
            await leader.sync()
            assert leader.local.mode_request == request and follower.local.phase == "draining"
        finally:
            await stopped(two_members)

    asyncio.run(main())


def test_a_follower_carrying_a_put_between_the_leaders_read_and_write_loses_nothing(two_members):
    """The leader publishes its phase; the follower's PUT lands just before the leader's write. Both are stored,
    and the leader took the request in the same round."""
    leader, follower = two_members

    async def main():
        await started(two_members)
        try:
            request = None

            async def follower_carries():
                nonlocal request
                request = carries(follower)
                await follower.sync()

            leader.cluster.store.before["put_control"] = follower_carries
            publishes(leader, "draining")
            await leader.sync()
            stored = await leader.cluster.store.get_control()
            assert (stored.phase, stored.mode_request) == ("draining", request)
            assert leader.local.mode_request == request
            await follower.sync()
            assert follower.local.phase == "draining" and follower.local.mode_request == request
        finally:
            await stopped(two_members)

    asyncio.run(main())


def test_a_put_taken_while_the_member_reads_what_the_leader_published_is_kept_and_written(two_members):
    """The follower's background round reads the leader's new phase while a PUT on it carries a request: applying
    what it read keeps the request, and its next round writes it."""
    leader, follower = two_members

    async def main():
        await started(two_members)
        try:
            publishes(leader, "draining")
            await leader.sync()
            request = None

            async def put_arrives():
                nonlocal request
                request = carries(follower)

            follower.cluster.store.before["get_control"] = put_arrives
            await follower.sync()
            assert follower.local.phase == "draining" and follower.local.mode_request == request
            await follower.sync()
            await leader.sync()
            assert leader.local.mode_request == request
        finally:
            await stopped(two_members)

    asyncio.run(main())


@pytest.mark.skipif(not hasattr(sglang, "GateFenced"), reason="needs the engine gate's fence (the fence branch)")
def test_a_leader_whose_lease_ran_out_behind_its_back_is_refused_by_the_engines_fence(
    gateway,
    faulty,  # noqa: F811
    redis_server,
    request,
):
    """The leader's own clock says its lease holds (it renews every 10 s), but Redis let it go - as for a leader
    paused past its lease: the replica that took it over writes the gate under a larger token, and the old leader's
    next gate write is refused by the engine, counted, and it steps down. The gate stays the new leader's."""
    backends = faulty(1)
    engine, faults, url = backends[0]
    name = request.node.name[:60]

    def replica(sync_interval: float):
        return gateway(
            [],
            [],
            topology="in-engine",
            threshold=4,
            admin_token=TOKEN,
            pools={"speculative": {"backends": [url]}},
            health={"interval": 0.2, "timeout": 2.0},
            cluster={"redis_url": redis_server.url, "name": name, "lease": 30.0, "sync_interval": sync_interval},
        )

    stale = replica(10.0)
    assert cluster_of(stale).leader
    taking = replica(0.1)
    with redis.Redis.from_url(redis_server.url) as direct:
        direct.delete(f"{name}:lease")  # what Redis does to a lease nobody renewed in time
    wait_until(lambda: cluster_of(taking).leader, what="the other replica takes the lease")
    assert cluster_of(taking).fence() > cluster_of(stale).fence()  # the stale one still believes it leads
    assert admin(taking, "PUT", "/admin/threshold", threshold=12).status_code == 200
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 12, what="the new leader's gate")
    # The stale leader's next round sees the gate is not its own threshold (it has not synced since) and writes 4.
    wait_until(lambda: cluster_of(stale).fenced == 1, what="the stale leader's write refused by the fence")
    assert not cluster_of(stale).leader and cluster_of(stale).fence() is None
    assert stale.metric("crossover_cluster_fenced_total") == 1
    assert stale.metric("crossover_gate_sync_errors_total", backend=url, kind="fenced") >= 1
    assert engine_gate(engine.url)["zero_steps_above_bs"] == 12
    assert int(faults.write_fences[-1]) < cluster_of(taking).fence()  # the refused write carried the stale token


@pytest.mark.parametrize("refused_first", [True, False], ids=["refused-then-accepted", "accepted-then-refused"])
def test_a_cut_replicas_refused_put_never_overwrites_an_accepted_one(replicas, redis_server, refused_first, caplog):
    """A PUT the store did not take (503 `state_not_shared`) loses to one it took meanwhile on another replica,
    whichever came first: the cluster orders changes by when its store took them, not by when a replica reconnects."""
    caplog.set_level(logging.WARNING, "crossover.coordination")
    proxy = TcpProxy(redis_server.port)
    cut = replicas(1, redis_url=proxy.url)[0]
    others = replicas(2)
    for refused, accepted in ((7, 9), (11, 13), (15, 17)):
        proxy.cut()
        wait_until(lambda: not cluster_of(cut).connected, what="the replica cut off from Redis")
        puts = [(cut, refused, 503), (others[0], accepted, 200)]
        for replica, threshold, status in puts if refused_first else reversed(puts):
            answer = admin(replica, "PUT", "/admin/threshold", threshold=threshold)
            assert answer.status_code == status, answer.text
        assert cut.state.routing.threshold == refused  # live where it was made, until the store says otherwise
        proxy.heal()
        wait_until(lambda: cluster_of(cut).connected, what="the replica reaching Redis again")
        # Every replica has synced twice since: whatever the reconnected one would write is written by then.
        rounds = {id(r): cluster_of(r).rounds for r in (cut, *others)}
        wait_until(
            lambda rounds=rounds: all(cluster_of(r).rounds > rounds[id(r)] + SPREAD_ROUNDS for r in (cut, *others)),
            what="every replica syncing after the reconnection",
        )
        assert [r.state.routing.threshold for r in (cut, *others)] == [accepted] * 3
    assert "dropped what this replica changed while the cluster's store did not answer (threshold=" in caplog.text


def test_a_store_too_slow_to_hold_a_lease_leaves_no_leader_says_so_and_bounds_a_put(replicas, redis_server):
    """Redis delayed 0.5 s each way: every call answers (in 1 s, within its timeout), but a sync round takes
    longer than a lease can wait for its renewal. No replica takes the lease through it, none says it is connected,
    and a PUT is answered within its bound (the lease)."""
    lease = 5.0
    proxy = TcpProxy(redis_server.port)
    group = replicas(2, urls=[proxy.url] * 2, lease=lease, sync_interval=0.25)
    wait_until(lambda: sum(cluster_of(r).leader for r in group) == 1, what="one leader")
    first = next(r for r in group if cluster_of(r).leader)
    proxy.delay_s = 0.5
    leaders_seen: set[int] = set()

    def settled() -> bool:
        leaders_seen.update(index for index, replica in enumerate(group) if cluster_of(replica).leader)
        return not any(cluster_of(r).leader or cluster_of(r).connected for r in group)

    wait_until(settled, timeout=60, what="no leader and no replica connected")
    assert leaders_seen <= {group.index(first)}  # the lease never passed to the other replica
    for replica in group:
        # Too slow for the lease, or a call over its timeout (min(lease / 3, 2 s)) where two chunks queue up.
        problem = admin(replica, "GET", "/admin/state").json()["cluster"]["problem"]
        assert "too slow to hold a lease" in problem or "Timeout" in problem, problem
    # A replica that is not connected takes no lease for as long as the store stays this slow.
    rounds = cluster_of(group[1]).rounds
    wait_until(lambda: cluster_of(group[1]).rounds >= rounds + 3, timeout=60, what="three more rounds")
    assert not any(cluster_of(r).leader for r in group)
    began = time.monotonic()
    answer = admin(group[0], "PUT", "/admin/threshold", threshold=11)
    assert time.monotonic() - began < lease + 5.0, answer.text  # the bound, plus what a busy machine adds
    assert answer.status_code in (200, 503), answer.text
    proxy.delay_s = 0.0
    wait_until(lambda: sum(cluster_of(r).leader for r in group) == 1, timeout=60, what="one leader again")
    wait_until(lambda: all(cluster_of(r).connected for r in group), timeout=60, what="connected again")


class Slow:
    """A member's store whose every call takes `per_call` seconds on the member's clock (`now[0]`): a slow link
    on no real clock at all."""

    def __init__(self, store: Store, now: list[float]) -> None:
        self.store, self.now, self.per_call = store, now, 0.0

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def call(*args, **kwargs):
            self.now[0] += self.per_call
            return await attr(*args, **kwargs)

        return call


def test_a_member_whose_rounds_outlast_a_third_of_the_lease_takes_no_lease_until_they_are_quick(redis_server, request):
    async def main():
        now = [0.0]
        name = request.node.name[:60]
        backends = {"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:10"]}}
        pools = Pools.from_settings(Settings(pools=backends))
        local = Control(threshold=8, hysteresis=2, policy="spillover")
        stores = [Slow(RedisStore(redis_server.url, name, timeout_s=2.0), now) for _ in range(2)]
        a, b = (Cluster(store, pools, lease_s=3.0, interval_s=60.0, clock=lambda: now[0]) for store in stores)

        async def apply(_: Control) -> None:
            pass

        for member in (a, b):
            await member.start(lambda: local, apply)
        try:
            assert a.leader and a.connected and not b.leader
            for store in stores:
                store.per_call = 1.0  # four calls a round: 4 s, against a lease of 3 s
            await a._sync()
            assert not a.connected and "too slow to hold a lease" in a.problem
            assert not a.leader  # its own clock: the renewal came too late
            await stores[0].store._redis.delete(f"{name}:lease")  # the lease lapsed in Redis too
            for _ in range(3):
                await b._sync()
                await a._sync()
                assert not a.leader and not b.leader and not a.connected and not b.connected
            for store in stores:
                store.per_call = 0.0
            for _ in range(2):  # quick again: connected, and within two rounds one of them leads
                await b._sync()
                await a._sync()
            assert a.connected and b.connected and a.leader + b.leader == 1
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_a_member_that_reaches_its_store_at_start_logs_no_reconnection(redis_server, request, caplog):
    """Nothing was ever unreachable at start-up: "reachable again" there only misleads an operator."""
    caplog.set_level(logging.INFO, "crossover.coordination")

    async def main():
        member = Member(redis_server.url, request.node.name[:60], 20)
        await member.start()
        try:
            await member.sync()
        finally:
            await member.cluster.stop()

    asyncio.run(main())
    assert "reachable again" not in caplog.text
    assert "took the cluster's lease (token" in caplog.text
