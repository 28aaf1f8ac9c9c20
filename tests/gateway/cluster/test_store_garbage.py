"""Whatever anyone wrote under the cluster's keys in a real redis-server: the store layer reads it bounded, checks
it, warns once a key a minute naming the key, and the replicas keep serving - a control state that is not one is
not trusted (503 to a PUT, `connected` false), a member's counts that are not counts are left out, and a new
replica still starts."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import redis

from crossover.gateway.cluster import StoreUnavailable
from crossover.gateway.cluster.redis_store import SHOWN_CHARS, Complaints, RedisStore
from crossover.gateway.cluster.store import Control, StoreMalformed
from tests.gateway.cluster.test_coordination import Member, admin, cluster_of, replicas  # noqa: F401
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.gateway_helpers import wait_until

pytestmark = needs_redis

BIG = "x" * (20 * 1024 * 1024)


def short_id(value: str) -> str:
    """A test id that names a value without holding it: pytest puts the id in PYTEST_CURRENT_TEST, and a 20 MB
    environment variable makes every process the test starts fail with E2BIG."""
    return value if len(value) <= 30 else f"{value[:3]}...x{len(value)}"


# What anyone may have written where a member's in-flight counts belong (raw Redis commands).
BAD_COUNTS = {
    "not json": ("set", "garbage{"),
    "a list": ("set", "[1, 2]"),
    "not integers": ("set", '{"x": "abc"}'),
    "negative": ("set", '{"x": -1}'),
    "20 MiB": ("set", BIG),
    "a Redis list": ("rpush", "a"),
}
# Most a message about a malformed value may say: the key, what it is not, and SHOWN_CHARS of the value.
MAX_MESSAGE_CHARS = 2 * SHOWN_CHARS + 200


def raw(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url, decode_responses=True)


def store_run(redis_server, name: str, body):
    async def main():
        store = RedisStore(redis_server.url, name, timeout_s=2.0)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def warnings_about(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and key in r.getMessage()]


@pytest.mark.parametrize("version", ["abc", "-1", "1.5", "9" * 30, BIG], ids=short_id)
def test_a_version_that_is_none_is_not_trusted_named_and_warned_of_once(redis_server, caplog, version):
    name = f"version-{len(version)}-{version[:3]}"
    raw(redis_server).mset(
        {
            f"{name}:control": Control(threshold=8, hysteresis=2, policy="switch").model_dump_json(),
            f"{name}:control:version": version,
        }
    )

    async def body(store):
        with caplog.at_level(logging.WARNING, logger="crossover.coordination"):
            for _ in range(3):
                with pytest.raises(StoreMalformed) as malformed:
                    await store.get_control()
        message = str(malformed.value)
        assert f"{name}:control:version" in message and len(message) < MAX_MESSAGE_CHARS
        assert isinstance(malformed.value, StoreUnavailable)  # as untrusted as no answer
        assert len(warnings_about(caplog, f"{name}:control:version")) == 1  # three reads, one warning
        assert f"{name}:control:version" in store.malformed
        raw(redis_server).set(f"{name}:control:version", "3")  # put right: read, and no longer reported
        assert (await store.get_control()).version == 3
        assert store.malformed == {}

    store_run(redis_server, name, body)


@pytest.mark.parametrize("payload", ["garbage{", '{"threshold": "many"}', BIG], ids=short_id)
def test_a_control_state_that_is_none_is_not_trusted_and_a_large_one_is_not_read(redis_server, payload):
    name = f"control-{len(payload)}-{payload[:3]}"
    raw(redis_server).mset({f"{name}:control": payload, f"{name}:control:version": "4"})

    async def body(store):
        with pytest.raises(StoreMalformed) as malformed:
            await store.get_control()
        message = str(malformed.value)
        assert f"{name}:control " in message and len(message) < MAX_MESSAGE_CHARS
        if payload is BIG:
            assert f"{len(BIG)} bytes, not read" in message

    store_run(redis_server, name, body)


@pytest.mark.parametrize("command", BAD_COUNTS.values(), ids=BAD_COUNTS.keys())
def test_a_members_counts_that_are_none_are_left_out_and_the_others_read(redis_server, caplog, command):
    name = f"counts-{command[1][:6]}-{len(command[1])}"
    client = raw(redis_server)
    client.sadd(f"{name}:members", "bad")
    getattr(client, command[0])(f"{name}:inflight:bad", command[1])

    async def body(store):
        await store.publish("good", {"speculative http://a": 3}, ttl_s=30)
        with caplog.at_level(logging.WARNING, logger="crossover.coordination"):
            for _ in range(3):
                assert await store.inflight() == {"good": {"speculative http://a": 3}}
        assert len(warnings_about(caplog, f"{name}:inflight:bad")) == 1
        assert all(len(message) < MAX_MESSAGE_CHARS for message in warnings_about(caplog, name))
        assert list(store.malformed) == [f"{name}:inflight:bad"]
        client.delete(f"{name}:inflight:bad")  # gone: the member counts as having left
        assert await store.inflight() == {"good": {"speculative http://a": 3}}
        assert store.malformed == {}

    store_run(redis_server, name, body)


def test_complaints_come_once_a_key_a_minute():
    now = [0.0]
    complaints = Complaints(every_s=60.0, clock=lambda: now[0])
    assert complaints.due("a") and complaints.due("b")
    now[0] = 59.0
    assert not complaints.due("a")
    now[0] = 60.0
    assert complaints.due("a")
    assert not complaints.due("a")


def test_a_member_over_a_malformed_store_starts_serves_its_last_state_and_says_why(redis_server, request):
    name = request.node.name[:60]
    raw(redis_server).mset({f"{name}:control": "{}", f"{name}:control:version": "abc"})

    async def main():
        member = Member(redis_server.url, name, 20)
        await member.start()  # never raises: the store's garbage is not the replica's to die of
        try:
            view = member.cluster.view()["cluster"]
            assert view["connected"] is False and f"{name}:control:version" in view["problem"]
            assert member.local.threshold == 20  # its own state serves
            raw(redis_server).delete(f"{name}:control", f"{name}:control:version")
            await member.sync()
            assert member.cluster.view()["cluster"]["connected"] is True
        finally:
            await member.cluster.stop()

    asyncio.run(main())


def test_replicas_over_a_garbage_version_serve_and_answer_json(replicas, redis_server, request):  # noqa: F811
    over_garbage(replicas, redis_server, request.node.name[:60], "version")


def test_replicas_over_garbage_counts_serve_and_answer_json(replicas, redis_server, request):  # noqa: F811
    over_garbage(replicas, redis_server, request.node.name[:60], "counts")


def over_garbage(start_replicas, redis_server, name: str, where: str) -> None:
    """Two replicas, then garbage in the version or a member's counts: both keep serving and say why; a PUT answers
    JSON (503 where the shared state cannot be trusted); a third replica starts."""
    first, second = start_replicas(2)
    client = raw(redis_server)
    if where == "version":
        client.set(f"{name}:control:version", "abc")
    else:
        client.sadd(f"{name}:members", "intruder")
        client.set(f"{name}:inflight:intruder", "[1, 2]")
    wait_until(
        lambda: all(name in (cluster_of(r).problem or "") for r in (first, second)), what="each replica says why"
    )
    put = admin(first, "PUT", "/admin/threshold", threshold=12)
    assert put.headers["content-type"].startswith("application/json")
    if where == "version":  # the shared state cannot be trusted: live here, not shared, said so
        assert put.status_code == 503 and put.json()["error"]["code"] == "state_not_shared"
    else:  # the control state is sound: the change is shared; the intruder's counts are left out
        assert put.status_code == 200
    state = admin(second, "GET", "/admin/state").json()
    assert name in state["cluster"]["problem"]
    assert state["cluster"]["connected"] is (where == "counts")
    third = start_replicas(1)[0]  # a new replica starts
    assert admin(third, "GET", "/admin/state").status_code == 200
    assert all(httpx.get(r.url + "/health", trust_env=False).status_code == 200 for r in (first, second, third))


def test_with_a_key_a_control_state_or_counts_written_without_it_are_not_read(redis_server):
    async def main():
        name = "sealed"
        store = RedisStore(redis_server.url, name, timeout_s=2.0, key="k" * 32)
        try:
            control = Control(threshold=8, hysteresis=2, policy="switch")
            assert await store.put_control(control, 0) == 1
            assert (await store.get_control()).threshold == 8
            await store._redis.set(f"{name}:control", control.model_copy(update={"threshold": 99}).model_dump_json())
            with pytest.raises(StoreMalformed, match="not sealed with the cluster's key"):
                await store.get_control()
            assert "not the cluster's" in store.malformed[f"{name}:control"]
            await store.publish("honest", {"a": 1}, 5.0)
            await store._redis.set(f"{name}:inflight:forger", '{"a": 500}')
            await store._redis.sadd(f"{name}:members", "forger")
            assert await store.inflight() == {"honest": {"a": 1}}
            assert f"{name}:inflight:forger" in store.malformed
        finally:
            await store.close()

    asyncio.run(main())


def test_a_control_state_written_into_redis_without_the_keys_hmac_moves_nothing_and_is_reported(
    replicas,  # noqa: F811
    redis_server,
    request,
):
    group = replicas(2, key="k" * 32)
    name = request.node.name[:60]
    assert admin(group[0], "PUT", "/admin/threshold", threshold=20).status_code == 200
    wait_until(lambda: all(r.state.routing.threshold == 20 for r in group), what="threshold 20 everywhere")
    with redis.Redis.from_url(redis_server.url) as direct:
        forged = json.loads(direct.get(f"{name}:control").split(b" ", 1)[1])  # the sealed state, unsealed
        direct.set(f"{name}:control", json.dumps({**forged, "threshold": 3, "generation": forged["generation"] + 9}))
        direct.incr(f"{name}:control:version")
    wait_until(lambda: not any(cluster_of(r).connected for r in group), what="every replica distrusting the state")
    for replica in group:
        view = admin(replica, "GET", "/admin/state").json()
        assert view["threshold"] == 20
        assert "not sealed with the cluster's key" in view["cluster"]["problem"], view["cluster"]
    refused = admin(group[1], "PUT", "/admin/threshold", threshold=24)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_not_shared", refused.text
    with redis.Redis.from_url(redis_server.url) as direct:
        direct.delete(f"{name}:control")  # the operator removes what nobody of the cluster wrote
    wait_until(lambda: all(cluster_of(r).connected for r in group), what="every replica trusting the store again")
    wait_until(lambda: all(r.state.routing.threshold == 24 for r in group), what="the refused PUT written after all")
