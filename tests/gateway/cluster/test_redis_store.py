"""The cluster's store in a real redis-server: the versioned control state, the lease and its fencing token, the
expiring in-flight counts, and a Redis that does not answer."""

from __future__ import annotations

import asyncio

import pytest

from crossover.gateway.cluster.coordination import Control, StoreUnavailable
from crossover.gateway.cluster.redis_store import RedisStore
from crossover.servers.process import free_port
from tests.gateway.cluster_helpers import needs_redis

pytestmark = needs_redis


def run(redis_server, name: str, body):
    """`body(store, other)`: two stores (two members) on one cluster name, on one loop."""

    async def main():
        store = RedisStore(redis_server.url, name, timeout_s=2.0)
        other = RedisStore(redis_server.url, name, timeout_s=2.0)
        try:
            return await body(store, other)
        finally:
            await store.close()
            await other.close()

    return asyncio.run(main())


def test_the_control_state_is_one_versioned_value(redis_server):
    async def body(store, other):
        assert await store.get_control() is None
        first = Control(threshold=8, hysteresis=2, policy="switch", forced_mode="plain", pinned=True)
        v1 = await store.put_control(first, 0)
        read = await other.get_control()
        assert read.version == v1 and read.same(first)
        v2 = await other.put_control(first.model_copy(update={"threshold": 9}), v1)
        assert v2 > v1
        assert (await store.get_control()).threshold == 9

    run(redis_server, "control", body)


def test_a_write_over_a_version_another_member_replaced_stores_nothing(redis_server):
    async def body(store, other):
        first = Control(threshold=8, hysteresis=2, policy="switch")
        assert await store.put_control(first, 3) is None  # nothing stored: only a writer that read nothing writes
        v1 = await store.put_control(first, 0)
        assert await other.put_control(first, 0) is None
        v2 = await other.put_control(first.model_copy(update={"threshold": 9}), v1)
        assert await store.put_control(first.model_copy(update={"threshold": 5}), v1) is None  # it read v1: stale
        read = await store.get_control()
        assert (read.threshold, read.version) == (9, v2)

    run(redis_server, "compare", body)


def test_one_holder_at_a_time_and_every_new_holder_a_larger_token(redis_server):
    async def body(store, other):
        token = await store.acquire("a", 5.0)
        assert token is not None
        assert await other.acquire("b", 5.0) is None  # held
        assert await store.renew("a", token, 5.0)
        assert not await other.renew("b", token, 5.0)  # not the holder: no extension
        assert not await store.renew("a", token + 1, 5.0)  # the holder under another token: neither
        await other.release("b", token)  # not the holder: nothing happens
        assert await other.acquire("b", 5.0) is None
        await store.release("a", token)
        taken = await other.acquire("b", 0.2)
        assert taken is not None and taken > token
        # An expired lease is free again, with a larger token still.
        deadline = asyncio.get_running_loop().time() + 10
        while (again := await store.acquire("a", 5.0)) is None:
            assert asyncio.get_running_loop().time() < deadline, "the lease never expired"
            await asyncio.sleep(0.05)
        assert again > taken
        assert not await other.renew("b", taken, 5.0)  # the expired holder cannot extend what is another's

    run(redis_server, "lease", body)


def test_in_flight_counts_per_member_expire_with_their_member(redis_server):
    async def body(store, other):
        await store.publish("a", {"http://x": 3}, 60.0)
        await other.publish("b", {"http://x": 1, "http://y": 2}, 0.2)
        assert await store.inflight() == {"a": {"http://x": 3}, "b": {"http://x": 1, "http://y": 2}}
        deadline = asyncio.get_running_loop().time() + 10
        while "b" in await store.inflight():
            assert asyncio.get_running_loop().time() < deadline, "b's counts never expired"
            await asyncio.sleep(0.05)
        assert await other.inflight() == {"a": {"http://x": 3}}

    run(redis_server, "inflight", body)


def test_a_redis_that_does_not_answer_is_store_unavailable():
    async def main():
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "gone", timeout_s=1.0)
        try:
            for call in (store.get_control(), store.acquire("a", 1.0), store.inflight()):
                with pytest.raises(StoreUnavailable, match="redis"):
                    await call
        finally:
            await store.close()

    asyncio.run(main())


def test_a_value_that_is_no_control_state_is_said_not_taken(redis_server):
    async def body(store, other):
        await store._redis.set("junk:control", "{not json")
        await store._redis.set("junk:control:version", "4")
        junk = RedisStore(redis_server.url, "junk", timeout_s=2.0)
        try:
            with pytest.raises(StoreUnavailable, match="holds no control state"):
                await junk.get_control()
        finally:
            await junk.close()

    run(redis_server, "junk-other", body)


def test_the_token_counter_is_raised_past_a_refused_token_and_never_lowered(redis_server):
    async def body(store, other):
        first = await store.acquire("a", 5.0)
        await store.raise_fence(40)  # a resource of the GPU set accepted 40: no token at or below it is handed out
        await store.raise_fence(7)  # a lower one changes nothing
        await store.release("a", first)
        assert await other.acquire("b", 5.0) == 41

    run(redis_server, "raise", body)


def test_a_token_counter_that_is_no_number_is_replaced_by_the_raise(redis_server):
    async def body(store, other):
        await store._redis.set("garbage-fence:fence", "abc")
        await store.raise_fence(12)
        assert await other.acquire("b", 5.0) == 13

    run(redis_server, "garbage-fence", body)


def test_the_holder_keeps_its_lease_under_a_new_token_and_nobody_else_can(redis_server):
    async def body(store, other):
        first = await store.acquire("a", 5.0)
        await store.raise_fence(40)
        assert await other.retoken("b", first, 5.0) is None  # not b's lease
        assert await store.retoken("a", first, 5.0) == 41
        assert await store.renew("a", 41, 5.0) and not await store.renew("a", first, 5.0)
        assert await other.acquire("b", 5.0) is None

    run(redis_server, "retoken", body)
