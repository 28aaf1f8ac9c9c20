"""The cluster's store in Redis (`[cluster] redis_url`; the `redis` package: `pip install crossover[cluster]`).

    store = RedisStore("redis://redis:6379/0", "crossover", timeout_s=1.0)   # gateway/cluster/coordination.py's Store

Keys, under the cluster's name N (one name per GPU set):
    N:control            the control state (JSON, without its version)
    N:control:version    its version, INCR'd by each write in the same script, which writes only over the version
                         its writer read: a reader gets both at once (MGET)
    N:lease              "member token" of the lease holder, expiring (SET NX PX; extended only by its holder)
    N:fence              INCR'd at each acquisition: the fencing token, larger at every new holder
    N:members            the members that published counts
    N:inflight:M         member M's in-flight count per backend URL (JSON), expiring: a dead member's vanish

Every call is bounded by `timeout_s` and never retried here (the next sync is the retry); anything that goes wrong
talking to Redis is `StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from crossover.gateway.cluster.store import Control, StoreUnavailable

# Takes the lease if free: the token is INCR'd only for a real new holder.
ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
return token
"""
# Compare-and-extend: only the holder, under the token it got, extends the lease.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Compare-and-set: written only over the version its writer read (a missing version reads 0: nothing stored).
PUT_CONTROL = """
if tonumber(redis.call('GET', KEYS[2]) or '0') ~= tonumber(ARGV[2]) then return false end
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('INCR', KEYS[2])
"""


class RedisStore:
    """`Store` over one Redis (see the module docstring)."""

    def __init__(self, url: str, name: str, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._control, self._version = f"{name}:control", f"{name}:control:version"
        self._lease, self._fence = f"{name}:lease", f"{name}:fence"
        self._members, self._inflight = f"{name}:members", f"{name}:inflight:"
        self._acquire = self._redis.register_script(ACQUIRE)
        self._renew = self._redis.register_script(RENEW)
        self._release = self._redis.register_script(RELEASE)
        self._put_control = self._redis.register_script(PUT_CONTROL)

    async def _call(self, call):
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {str(exc) or type(exc).__name__}") from None

    async def get_control(self) -> Control | None:
        payload, version = await self._call(self._redis.mget(self._control, self._version))
        if payload is None or version is None:
            return None
        try:
            control = Control.model_validate_json(payload)
        except ValueError as exc:  # someone else's value under our name: say so, and touch nothing
            raise StoreUnavailable(f"redis: {self._control} holds no control state: {exc}") from None
        return control.model_copy(update={"version": int(version)})

    async def put_control(self, control: Control, expected: int) -> int | None:
        payload = control.model_dump_json(exclude={"version"})
        version = await self._call(self._put_control(keys=[self._control, self._version], args=[payload, expected]))
        return None if version is None else int(version)

    async def acquire(self, member: str, ttl_s: float) -> int | None:
        token = await self._call(self._acquire(keys=[self._lease, self._fence], args=[member, _ms(ttl_s)]))
        return None if token is None else int(token)

    async def renew(self, member: str, token: int, ttl_s: float) -> bool:
        return bool(await self._call(self._renew(keys=[self._lease], args=[f"{member} {token}", _ms(ttl_s)])))

    async def release(self, member: str, token: int) -> None:
        await self._call(self._release(keys=[self._lease], args=[f"{member} {token}"]))

    async def publish(self, member: str, inflight: dict[str, int], ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._inflight + member, json.dumps(inflight), px=_ms(ttl_s))
        pipe.sadd(self._members, member)
        await self._call(pipe.execute())

    async def inflight(self) -> dict[str, dict[str, int]]:
        members = sorted(await self._call(self._redis.smembers(self._members)))
        if not members:
            return {}
        values = await self._call(self._redis.mget([self._inflight + member for member in members]))
        gone = [member for member, value in zip(members, values, strict=True) if value is None]
        if gone:
            await self._call(self._redis.srem(self._members, *gone))  # expired: a member that stopped publishing
        return {member: json.loads(value) for member, value in zip(members, values, strict=True) if value is not None}

    async def close(self) -> None:
        await self._redis.aclose()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
