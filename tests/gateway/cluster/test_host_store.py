"""The host's store: one control state with growing versions, one lease holder at a time, the lease gone with its
holder's process, tokens that only grow."""

from __future__ import annotations

import asyncio
import os
import signal

from crossover.gateway.cluster.coordination import Control
from crossover.gateway.cluster.host import Host, Worker
from crossover.gateway.cluster.host_store import HostStore


def stores(tmp_path, count: int = 2) -> list[HostStore]:
    host = Host(count, 1, tmp_path)
    return [HostStore(Worker(host, slot)) for slot in range(count)]


def test_the_control_state_is_one_value_whose_version_grows(tmp_path):
    async def scenario() -> None:
        one, other = stores(tmp_path)
        assert await other.get_control() is None
        first = Control(threshold=8, hysteresis=2, policy="spillover")
        assert await one.put_control(first, 0) == 1
        seen = await other.get_control()
        assert seen is not None and seen.same(first) and seen.version == 1
        assert await other.put_control(first.model_copy(update={"threshold": 9}), 1) == 2
        seen = await one.get_control()
        assert (seen.threshold, seen.version) == (9, 2)

    asyncio.run(scenario())


def test_a_write_over_a_version_another_worker_replaced_stores_nothing(tmp_path):
    async def scenario() -> None:
        one, other = stores(tmp_path)
        first = Control(threshold=8, hysteresis=2, policy="spillover")
        assert await one.put_control(first, 3) is None  # nothing stored: only a writer that read nothing writes
        assert await one.put_control(first, 0) == 1
        assert await other.put_control(first.model_copy(update={"threshold": 9}), 1) == 2
        assert await one.put_control(first.model_copy(update={"threshold": 5}), 1) is None  # it read 1: stale
        seen = await one.get_control()
        assert (seen.threshold, seen.version) == (9, 2)

    asyncio.run(scenario())


def test_one_holder_at_a_time_and_each_new_holder_a_larger_token(tmp_path):
    async def scenario() -> None:
        one, other = stores(tmp_path)
        assert await one.acquire("one", 5) == 1
        assert await other.acquire("other", 5) is None
        assert await one.renew("one", 1, 5) and not await other.renew("other", 1, 5)
        await one.release("one", 1)
        assert await other.acquire("other", 5) == 2
        assert not await one.renew("one", 1, 5)
        await other.close()
        assert await one.acquire("one", 5) == 3

    asyncio.run(scenario())


def test_the_lease_goes_with_its_holders_process(tmp_path):
    host = Host(2, 1, tmp_path)
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: takes the lease, says so, and waits to be killed
        try:
            token = asyncio.run(HostStore(Worker(host, 0)).acquire("holder", 5))
            os.write(ready_write, str(token).encode())
            signal.pause()
        finally:
            os._exit(1)
    os.close(ready_write)
    assert os.read(ready_read, 16) == b"1"
    follower = HostStore(Worker(host, 1))
    assert asyncio.run(follower.acquire("follower", 5)) is None
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert asyncio.run(follower.acquire("follower", 5)) == 2


def test_the_token_is_raised_past_a_refused_one_and_never_lowered(tmp_path):
    async def scenario() -> None:
        one, other = stores(tmp_path)
        first = await one.acquire("one", 1.0)
        assert first == 1  # a new host counts from 1: what its last run handed out is gone with its folder
        await one.raise_fence(50)
        await other.raise_fence(3)
        await one.release("one", first)
        assert await other.acquire("other", 1.0) == 51

    asyncio.run(scenario())


def test_the_holder_keeps_its_lease_under_a_new_token(tmp_path):
    async def scenario() -> None:
        one, other = stores(tmp_path)
        first = await one.acquire("one", 1.0)
        await one.raise_fence(50)
        assert await other.retoken("other", first, 1.0) is None
        assert await one.retoken("one", first, 1.0) == 51
        assert await other.acquire("other", 1.0) is None  # still one's

    asyncio.run(scenario())
