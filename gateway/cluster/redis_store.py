"""The cluster's store in Redis (`[cluster] redis_url`; the `redis` package: `pip install crossover[cluster]`).

    store = RedisStore("redis://redis:6379/0", "crossover", timeout_s=1.0)   # gateway/cluster/coordination.py's Store

Keys, under the cluster's name N (one name per GPU set):
    N:control            the control state (JSON, without its version)
    N:control:version    its version, INCR'd by each write in the same script, which writes only over the version
                         its writer read: a reader gets both at once (MGET)
    N:lease              "member token" of the lease holder, expiring (SET NX PX; extended only by its holder)
    N:fence              INCR'd at each acquisition: the fencing token, larger at every new holder; raised past the
                         token a resource of the GPU set says it accepted (a Redis restarted empty counts from 1)
    N:members            the members that published counts
    N:inflight:M         member M's in-flight count per backend URL (JSON), expiring: a dead member's vanish

Every call is bounded by `timeout_s` and never retried here (the next sync is the retry); anything that goes wrong
talking to Redis is `StoreUnavailable`.

With a key (`[cluster] key_file`), the control state and the counts are sealed with its HMAC (signing.py): one
written without it is as malformed as one that does not parse.

Whatever is read is checked here before anything else sees it, its size bounded before it is read (anyone who can
write Redis can write anything under our names): a control state or version that is not one is `StoreMalformed`
(the state cannot be trusted: the member serves on what it last saw, and says so); a member's counts that are not a
flat object of non-negative integers are left out, that member counted as publishing nothing. Either way one
warning a key a minute (`Complaints`), naming the key and at most `SHOWN_CHARS` of the value, and the key is in
`malformed` until it reads well again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from crossover.gateway.cluster.signing import Seal
from crossover.gateway.cluster.store import Control, StoreMalformed, StoreUnavailable

log = logging.getLogger("crossover.coordination")

# What a well-formed value may take: more is someone else's data, never read whole.
MAX_CONTROL_BYTES = 64 * 1024
MAX_COUNTS_BYTES = 64 * 1024
MAX_MEMBERS = 1024
MAX_COUNT = 10**9
VERSION = re.compile(r"[0-9]{1,18}")
# How much of a malformed value a message shows.
SHOWN_CHARS = 80
# One warning a key this often at most, however many replicas read it how often.
COMPLAIN_EVERY_S = 60.0
# Reads a key whole only if it is a string of at most ARGV[1] bytes; else its length as a negative number, or its
# Redis type in a list: size and type are checked in Redis, before the value crosses the network.
READ_BOUNDED = """
local out = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then out[i] = false
  elseif kind ~= 'string' then out[i] = {kind}
  else
    local size = redis.call('STRLEN', key)
    if size > tonumber(ARGV[1]) then out[i] = -size else out[i] = redis.call('GET', key) end
  end
end
return out
"""

# Takes the lease if free: the token is INCR'd only for a real new holder.
ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
return token
"""
# Raises the token counter to at least ARGV[1], never lowers it (a counter that is no number is someone else's: set).
RAISE_FENCE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""
# The holder's lease under a new token (the counter raised past the one a resource refused).
RETOKEN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] .. ' ' .. ARGV[2] then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[3])
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
# Compare-and-set: written only over the version its writer read (nothing stored reads 0: no version, or a version
# without its state - deleted by an operator - which a reader also reads as nothing stored). The version INCRs on.
PUT_CONTROL = """
local current = 0
if redis.call('EXISTS', KEYS[1]) == 1 then current = tonumber(redis.call('GET', KEYS[2]) or '0') end
if current ~= tonumber(ARGV[2]) then return false end
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('INCR', KEYS[2])
"""


class RedisStore:
    """`Store` over one Redis (see the module docstring)."""

    def __init__(self, url: str, name: str, *, timeout_s: float, key: str = "") -> None:
        self.timeout_s = timeout_s
        self._seal = Seal(key)
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
        self._raise_fence = self._redis.register_script(RAISE_FENCE)
        self._retoken = self._redis.register_script(RETOKEN)
        self._renew = self._redis.register_script(RENEW)
        self._release = self._redis.register_script(RELEASE)
        self._put_control = self._redis.register_script(PUT_CONTROL)
        self._read_bounded = self._redis.register_script(READ_BOUNDED)
        self.complaints = Complaints()
        # Keys whose value is not what it should be, with why (for /admin/state), until they read well again.
        self.malformed: dict[str, str] = {}

    async def _call(self, call):
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {str(exc) or type(exc).__name__}") from None

    async def get_control(self) -> Control | None:
        payload, version = await self._bounded([self._control, self._version], MAX_CONTROL_BYTES)
        if payload is None or version is None:
            self._well(self._control, self._version)
            return None
        if not isinstance(version, str) or not VERSION.fullmatch(version):
            raise self._malformed(self._version, version, "holds no control version (a non-negative integer)")
        if not isinstance(payload, str):
            raise self._malformed(self._control, payload, "holds no control state")
        try:
            payload = self._seal.open(self._control, payload)
        except ValueError as exc:
            what = f"holds a control state that is not the cluster's: {exc}"
            raise self._malformed(self._control, payload, what) from None
        try:
            control = Control.model_validate_json(payload)
        except ValueError as exc:  # someone else's value under our name: say so, and touch nothing
            raise self._malformed(self._control, payload, f"holds no control state ({_first_line(exc)})") from None
        self._well(self._control, self._version)
        return control.model_copy(update={"version": int(version)})

    async def put_control(self, control: Control, expected: int) -> int | None:
        payload = self._seal.close(self._control, control.model_dump_json(exclude={"version"}))
        version = await self._call(self._put_control(keys=[self._control, self._version], args=[payload, expected]))
        return None if version is None else int(version)

    async def acquire(self, member: str, ttl_s: float) -> int | None:
        token = await self._call(self._acquire(keys=[self._lease, self._fence], args=[member, _ms(ttl_s)]))
        return None if token is None else int(token)

    async def raise_fence(self, at_least: int) -> None:
        await self._call(self._raise_fence(keys=[self._fence], args=[at_least]))

    async def retoken(self, member: str, token: int, ttl_s: float) -> int | None:
        token = await self._call(self._retoken(keys=[self._lease, self._fence], args=[member, token, _ms(ttl_s)]))
        return None if token is None else int(token)

    async def renew(self, member: str, token: int, ttl_s: float) -> bool:
        return bool(await self._call(self._renew(keys=[self._lease], args=[f"{member} {token}", _ms(ttl_s)])))

    async def release(self, member: str, token: int) -> None:
        await self._call(self._release(keys=[self._lease], args=[f"{member} {token}"]))

    async def publish(self, member: str, inflight: dict[str, int], ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=False)
        key = self._inflight + member
        pipe.set(key, self._seal.close(key, json.dumps(inflight)), px=_ms(ttl_s))
        pipe.sadd(self._members, member)
        await self._call(pipe.execute())

    async def inflight(self) -> dict[str, dict[str, int]]:
        members = sorted(await self._call(self._redis.smembers(self._members)))
        if not members:
            return {}
        if len(members) > MAX_MEMBERS:
            self._complain(self._members, f"holds {len(members)} members; reading the first {MAX_MEMBERS}")
            members = members[:MAX_MEMBERS]
        keys = [self._inflight + member for member in members]
        values = await self._bounded(keys, MAX_COUNTS_BYTES)
        gone = [member for member, value in zip(members, values, strict=True) if value is None]
        if gone:
            await self._call(self._redis.srem(self._members, *gone))  # expired: a member that stopped publishing
        counts, bad = {}, set()
        for member, key, value in zip(members, keys, values, strict=True):
            if value is None:
                continue
            why = "holds no in-flight counts (an object of non-negative integers)"
            try:
                published = _counts(self._seal.open(key, value) if isinstance(value, str) else value)
            except ValueError as exc:
                published, why = None, f"holds in-flight counts that are not the cluster's: {exc}"
            if published is not None:
                counts[member] = published
            else:
                bad.add(key)
                self._malformed(key, value, why)
        # What no longer reads badly (put right, or gone with its member) is no longer reported.
        self._well(*[key for key in self.malformed if key.startswith(self._inflight) and key not in bad])
        return counts

    async def close(self) -> None:
        await self._redis.aclose()

    async def _bounded(self, keys: list[str], limit: int) -> list[str | int | list | None]:
        """Each key's value; minus its size where it is over `limit` bytes, [its type] where it is no string (neither
        read); None where there is none."""
        values = await self._call(self._read_bounded(keys=keys, args=[limit]))
        return [None if value is None or value is False else value for value in values]

    def _malformed(self, key: str, value: object, what: str) -> StoreMalformed:
        """A value that is not what it should be: warned of (once a minute a key), kept in `malformed`."""
        if isinstance(value, int):
            shown = f"{-value} bytes, not read"
        elif isinstance(value, list):
            shown = f"a Redis {value[0] if value else 'value'}, not a string"
        else:
            shown = shorten(str(value))
        problem = f"redis: {key} {what}: {shown}"
        self.malformed[key] = problem
        self._complain(key, problem)
        return StoreMalformed(problem)

    def _complain(self, key: str, problem: str) -> None:
        if self.complaints.due(key):
            log.warning("%s; fix or delete the key (the replicas serve on the last state they trusted)", problem)

    def _well(self, *keys: str) -> None:
        for key in keys:
            self.malformed.pop(key, None)


class Complaints:
    """At most one complaint a key every `every_s`."""

    def __init__(self, every_s: float = COMPLAIN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}

    def due(self, key: str) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last[key] = now
        return True


def _counts(value: str | int | list) -> dict[str, int] | None:
    """A member's published counts, if they are that: {key: non-negative int}."""
    if not isinstance(value, str):
        return None
    try:
        counts = json.loads(value)
    except ValueError:
        return None
    if not isinstance(counts, dict):
        return None
    for count in counts.values():
        if type(count) is not int or not 0 <= count <= MAX_COUNT:
            return None
    return counts


def shorten(text: str) -> str:
    """At most SHOWN_CHARS of `text`, saying how much more there was."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def _first_line(exc: Exception) -> str:
    return shorten(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
