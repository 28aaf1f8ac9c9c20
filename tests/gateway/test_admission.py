"""The gateway's own in-flight limit and its FIFO queue."""

import asyncio

import httpx
import pytest

from crossover.gateway.admission import Admission
from crossover.gateway.errors import Overloaded
from tests.gateway.gateway_helpers import LONG, chat, wait_until

# The queue's timeouts run on the wall's clock (tests/timing.py cannot see a timeout given as a setting).
pytestmark = pytest.mark.timing


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


def test_a_client_that_leaves_while_queued_frees_its_place_at_once(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], limits={"max_inflight": 1, "max_queued": 1}, timeouts={"queue": 30})

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            held = await client.send(
                client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG)), stream=True
            )
            try:
                departing = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
                await asyncio.to_thread(wait_until, lambda: gw.state.admission.queued == 1, what="a queued request")
                departing.cancel()  # the client hangs up while it waits for a slot
                await asyncio.to_thread(wait_until, lambda: gw.state.admission.queued == 0, what="the place freed")
                waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
                await asyncio.to_thread(wait_until, lambda: gw.state.admission.queued == 1, what="the next in line")
            finally:
                await held.aclose()
            return await waiting

    served = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert served.status_code == 200  # it got the place, not a 429 for a queue of departed clients
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="none", outcome="client_disconnect") == 1
    assert gw.metric("crossover_requests_total", pool="none", outcome="overloaded") == 0


def test_flex_waits_behind_the_other_tiers_and_priority_goes_first():
    async def scenario():
        admission = Admission(max_inflight=1, max_queued=4, queue_timeout=5.0)
        await admission.acquire()
        order = []

        async def waiter(name, tier):
            await admission.acquire(tier)
            order.append(name)
            admission.release()

        tasks = []
        for name, tier in (("flex", "flex"), ("none", None), ("default", "default"), ("priority", "priority")):
            tasks.append(asyncio.create_task(waiter(name, tier)))
            await asyncio.sleep(0)
        assert admission.queued == 4
        admission.release()
        await asyncio.gather(*tasks)
        assert order == ["priority", "none", "default", "flex"]
        assert admission.active == 0 and admission.queued == 0

    asyncio.run(scenario())


def test_a_full_line_sheds_its_newest_flex_waiter_first():
    async def scenario():
        admission = Admission(max_inflight=1, max_queued=2, queue_timeout=5.0)
        await admission.acquire()
        old_flex = asyncio.create_task(admission.acquire("flex"))
        new_flex = asyncio.create_task(admission.acquire("flex"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await admission.acquire("flex")  # a flex newcomer to a full line is refused
        ordinary = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="flex"):
            await new_flex  # gave its place to the request without a tier
        assert admission.queued == 2
        priority = asyncio.create_task(admission.acquire("priority"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="flex"):
            await old_flex
        with pytest.raises(Overloaded):  # no flex left to shed: the line is full for everyone
            await admission.acquire("priority")
        admission.release()
        await priority
        admission.release()
        await ordinary
        admission.release()
        assert admission.active == 0 and admission.queued == 0

    asyncio.run(scenario())
