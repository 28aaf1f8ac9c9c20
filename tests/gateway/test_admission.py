"""The gateway's own in-flight limit and its FIFO queue."""

import asyncio

import pytest

from crossover.gateway.admission import Admission
from crossover.gateway.errors import Overloaded


def test_over_the_limit_and_queue_is_429():
    async def scenario():
        admission = Admission(max_inflight=2, max_queued=0, queue_timeout=1.0)
        await admission.acquire()
        await admission.acquire()
        with pytest.raises(Overloaded) as caught:
            await admission.acquire()
        assert caught.value.status == 429 and "retry-after" in caught.value.headers
        admission.release()
        await admission.acquire()  # a released slot is usable again
        assert admission.active == 2

    asyncio.run(scenario())


def test_queued_requests_get_slots_in_order():
    async def scenario():
        admission = Admission(max_inflight=1, max_queued=2, queue_timeout=5.0)
        await admission.acquire()
        order = []

        async def waiter(name):
            await admission.acquire()
            order.append(name)

        tasks = [asyncio.create_task(waiter(name)) for name in ("a", "b")]
        await asyncio.sleep(0)
        assert admission.queued == 2
        with pytest.raises(Overloaded):
            await admission.acquire()  # the queue is full too
        admission.release()
        await tasks[0]
        admission.release()
        await tasks[1]
        assert order == ["a", "b"] and admission.active == 1 and admission.queued == 0

    asyncio.run(scenario())


def test_queue_timeout_and_cancellation_leave_no_trace():
    async def scenario():
        admission = Admission(max_inflight=1, max_queued=5, queue_timeout=0.05)
        await admission.acquire()
        with pytest.raises(Overloaded, match="waited"):
            await admission.acquire()
        waiting = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.queued == 0
        admission.release()
        assert admission.active == 0

    asyncio.run(scenario())
