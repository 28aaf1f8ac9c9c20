"""What the gateway reads from real SGLang 0.5.23 besides generations: the abort of a request whose client left,
its load (`/v1/loads`) for `load_signal = "scraped"` and `"max"`, its `/metrics` names that deploy/ uses, and
`/health` - the gateway's health checks, which are its readiness (its own /health answers 200 once one backend
is healthy). What SGLang answers while it loads is pinned by test_restart.py, which watches a start.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_metric_names import SGLANG_NAMES, exported, used
from tests.real_sglang.tiny_model import CONTEXT_TOKENS
from tests.waiting import wait_until

# As long as the context allows (a minute and more on two cores), and `ignore_eos` so it does not end early.
LONG = {"max_tokens": CONTEXT_TOKENS - 64, "ignore_eos": True}
WAIT_S = 60.0


def engine_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def loads(url: str) -> dict:
    return httpx.get(url + "/v1/loads", timeout=10, trust_env=False).json()["loads"][0]


def running(url: str) -> int:
    rank = loads(url)
    return rank["num_running_reqs"] + rank["num_waiting_reqs"]


def long_chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Count."}], "stream": True, **LONG}


@contextlib.asynccontextmanager
async def streams(url: str, model: str, n: int):
    """n long streams open at `url`, each past its first event (so in SGLang's scheduler) and read on as a
    client reads; on exit the client leaves. (Not SGLang's /pause_generation to hold them: /v1/loads is a
    snapshot the scheduler publishes as it steps, so it stands still while paused.)"""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), trust_env=False) as client:
        responses, readers = [], []
        try:
            for _ in range(n):
                request = client.build_request("POST", url + "/v1/chat/completions", json=long_chat(model))
                response = await client.send(request, stream=True)
                assert response.status_code == 200
                responses.append(response)
                chunks = response.aiter_raw()
                await anext(chunks)
                readers.append(asyncio.create_task(_read_all(chunks)))
            yield responses
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await asyncio.gather(*(response.aclose() for response in responses))


async def _read_all(chunks) -> None:
    async for _ in chunks:
        pass


def test_a_client_that_leaves_mid_stream_is_aborted_inside_sglang(real_sglang, active_url, real_gateway):
    gw = real_gateway()
    aborted = engine_metric(active_url, "sglang:num_aborted_requests_total")

    async def leave_mid_stream() -> None:
        async with streams(gw.url, real_sglang.model, 1):
            await until(lambda: running(active_url) == 1, "SGLang to run the request")

    asyncio.run(leave_mid_stream())
    # SGLang's own books: its scheduler dropped the request, and counted it as aborted.
    wait_until(lambda: running(active_url) == 0, timeout=WAIT_S, what="SGLang's running count back to 0")
    wait_until(
        lambda: engine_metric(active_url, "sglang:num_aborted_requests_total") == aborted + 1,
        timeout=WAIT_S,
        what="sglang:num_aborted_requests_total to count the abort",
    )
    gw.settled()


def test_scraped_load_follows_the_real_v1_loads(real_sglang, active_url, real_gateway):
    gw = real_gateway(load_signal="scraped")
    backend = gw.state.pools.speculative[0]

    async def scenario() -> None:
        # Another client (a second gateway replica, say) loads the server directly: only a scrape sees it.
        async with streams(active_url, real_sglang.model, 3):
            await until(lambda: gw.state.pools.backend_load(backend) == 3, "the scraped load to reach 3")
            assert backend.inflight == 0
        await until(lambda: gw.state.pools.backend_load(backend) == 0, "the scraped load back to 0")

    asyncio.run(scenario())


def test_max_load_is_the_larger_of_the_gateways_count_and_the_engines(real_sglang, active_url, real_gateway):
    gw = real_gateway(load_signal="max")
    backend = gw.state.pools.speculative[0]
    plain = gw.state.pools.plain[0]

    async def scenario() -> None:
        async with streams(gw.url, real_sglang.model, 2) as through:
            pools = [response.headers["x-crossover-pool"] for response in through]
            async with streams(active_url, real_sglang.model, 2):
                # The engine sees all 4 (the gateway's 2 and the direct 2); each pool's own count is lower.
                await until(lambda: gw.state.pools.backend_load(backend) == 4, "the max load to reach 4")
                assert backend.inflight + plain.inflight == 2, pools
        await until(lambda: gw.state.pools.backend_load(backend) == 0, "the load back to 0")

    asyncio.run(scenario())
    gw.settled()


def test_every_sglang_metric_deploy_uses_is_in_the_real_metrics(real_sglang, active_url):
    # SGLang exports a labelled series only from its first event: a generation and an abort make them all.
    async def leave_mid_stream() -> None:
        async with streams(active_url, real_sglang.model, 1):
            pass

    asyncio.run(leave_mid_stream())
    wait_until(
        lambda: "sglang:num_aborted_requests_total" in exported(active_url), timeout=WAIT_S, what="the abort counted"
    )
    names = exported(active_url)
    sglang_used = {name for name in used() if name.startswith("sglang:")}
    assert "sglang:num_queue_reqs" in sglang_used  # the extraction sees them, or this would pass vacuously
    assert sglang_used - names == set()
    # Every SGLang name the deploy tests allow is a real one.
    assert SGLANG_NAMES - names == set()


def test_the_gateway_is_ready_and_healthy_on_the_real_server(real_sglang, active_url, real_gateway):
    gw = real_gateway()
    wait_until(lambda: all(b.healthy for b in gw.state.pools.all()), timeout=WAIT_S, what="backends healthy")
    health = httpx.get(gw.url + "/health", timeout=10, trust_env=False)
    assert (health.status_code, health.json()) == (200, {"status": "ok", "usable_backends": 2, "healthy_backends": 2})
    assert all(b.models == (real_sglang.model,) for b in gw.state.pools.all())
    # SGLang's /health is an empty 200 (it runs a 1-token generation to say so).
    health = httpx.get(active_url + "/health", timeout=30, trust_env=False)
    assert (health.status_code, health.content) == (200, b"")


async def until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)
