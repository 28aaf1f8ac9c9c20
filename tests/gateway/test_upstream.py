"""Failures before the first byte are retried elsewhere (bounded, counted); failures after it end the
stream cleanly. Every backend here is real: stand-ins, or small scripted servers on loopback."""

from __future__ import annotations

import asyncio

import httpx

from crossover.gateway.upstream import split_events, sse_error_message
from tests.gateway.gateway_helpers import LONG, ClosingBackend, Scripted, chat, sse_events, stream_text, unused_url


def test_a_backend_killed_mid_test(sim, gateway):
    # One running slot on the speculative stand-in, so a second stream waits in its queue.
    speculative = sim("k25-eagle3", "--time-scale", "20", "--max-running-requests", "1")
    plain = sim("k25-plain", "--time-scale", "20")
    gw = gateway([speculative.url], [plain.url], health={"interval": 60})

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client:
            running = await client.send(
                client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG)), stream=True
            )
            assert running.headers["x-crossover-pool"] == "speculative"
            chunks = running.aiter_raw()
            started = await anext(chunks)
            # Not started yet: queued behind `running` in the stand-in, nothing sent to its client.
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=chat(True, 16)))
            while speculative_waiting() < 1:
                await asyncio.sleep(0.02)
            speculative.kill()
            rest = b"".join([chunk async for chunk in chunks])
            await running.aclose()
            after = [await client.post("/v1/chat/completions", json=chat(stream)) for stream in (True, False) * 3]
            return started + rest, await queued, after

    def speculative_waiting() -> int:
        loads = httpx.get(speculative.url + "/v1/loads", timeout=5, trust_env=False).json()["loads"]
        return loads[0]["num_waiting_reqs"]

    cut, queued, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    events = sse_events(cut)
    assert stream_text(events)  # tokens arrived before the cut
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "backend_unavailable"
    assert queued.status_code == 200 and queued.headers["x-crossover-pool"] == "plain"
    assert sse_events(queued.content)[-1] == "[DONE]"
    assert [response.status_code for response in after] == [200] * 6
    assert {response.headers["x-crossover-pool"] for response in after} == {"plain"}
    assert gw.state.pools.speculative[0].healthy is False  # ejected after repeated failures
    assert gw.metric("crossover_failovers_total", reason="connection_lost") >= 1
    assert gw.metric("crossover_failovers_total", reason="connect_error") >= 1
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="backend_error") == 1


def test_a_5xx_fails_over_to_the_other_pool(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], health={"interval": 60})
    assert httpx.post(speculative.url + "/release_memory_occupation", json={}, timeout=10).status_code == 200
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    assert gw.metric("crossover_failovers_total", reason="backend_5xx") == 1
    assert gw.metric("crossover_route_decisions_total", pool="speculative", reason="below_threshold") == 1


def test_an_sse_error_before_any_token_fails_over(sim, gateway):
    # No running slot to spare and no queue: SGLang answers 200, then `data: {"error": ...}`.
    speculative = sim("k25-eagle3", "--time-scale", "20", "--max-running-requests", "1", "--max-queued-requests", "0")
    plain = sim("k25-plain", "--time-scale", "20")
    gw = gateway([speculative.url], [plain.url])

    async def scenario():
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            request = client.build_request("POST", speculative.url + "/v1/chat/completions", json=chat(True, LONG))
            held = await client.send(request, stream=True)
            try:
                return await client.post(gw.url + "/v1/chat/completions", json=chat(True))
            finally:
                await held.aclose()

    response = asyncio.run(scenario())
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    assert not any(isinstance(event, dict) and "error" in event for event in sse_events(response.content))
    assert gw.metric("crossover_failovers_total", reason="sse_error") == 1
    assert gw.state.pools.speculative[0].healthy is True  # busy is not broken


def test_failover_is_bounded_and_ends_in_502(serve, gateway):
    backends = [Scripted(status=500, body=b"boom") for _ in range(4)]
    urls = [serve(backend).url for backend in backends]
    gw = gateway(urls[:2], urls[2:], limits={"max_failovers": 2})
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 502 and response.json()["error"]["code"] == "backend_unavailable"
    assert sum(len(backend.requests) for backend in backends) == 3  # the first try and two failovers
    assert gw.metric("crossover_failovers_total", reason="backend_5xx") == 2


def test_connect_errors_fail_over_within_the_pool(sim, gateway):
    speculative = sim("k25-eagle3", "--time-scale", "20")
    gw = gateway([unused_url(), speculative.url], [unused_url()], health={"interval": 60})
    gw.state.pools.speculative[0].healthy = None  # pretend the first health round has not seen it fail
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        responses = [client.post("/v1/chat/completions", json=chat()) for _ in range(4)]
    assert [response.status_code for response in responses] == [200] * 4
    assert {response.headers["x-crossover-pool"] for response in responses} == {"speculative"}


def test_a_stale_keepalive_connection_is_retried_not_surfaced(gateway):
    backend = ClosingBackend()
    try:
        # No failover budget: only the transport's retry on a fresh connection can save these.
        gw = gateway([backend.url], [backend.url], health={"interval": 60}, limits={"max_failovers": 0})
        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
            statuses = [client.post("/v1/chat/completions", json=chat()).status_code for _ in range(3)]
    finally:
        backend.close()
    assert statuses == [200, 200, 200]
    assert backend.posts == 3
    assert gw.metric("crossover_failovers_total", reason="connection_lost") == 0
    assert all(b.healthy for b in gw.state.pools.all())


def test_sse_helpers():
    assert sse_error_message(b'data: {"error": {"message": "The request queue is full."}}\n\ndata: [DONE]\n\n') == (
        "The request queue is full."
    )
    assert sse_error_message(b'data: {"choices": []}\n\n') is None
    assert sse_error_message(b"data: [DONE]\n\n") is None
    assert split_events(b"data: a\n\ndata: b") == (b"data: a\n\n", b"data: b")
    assert split_events(b"data: a\r\n\r\n") == (b"data: a\r\n\r\n", b"")
    assert split_events(b"data: a") == (b"", b"data: a")
