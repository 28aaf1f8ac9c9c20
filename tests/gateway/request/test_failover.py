"""Whose fault a failure is, and what follows: the backend's kind fails over before the first byte (bounded,
counted) and feeds the breaker; the request's kind goes back to the client and leaves every backend healthy;
failures after the first byte end the stream cleanly; no request is sent twice to backends that may both
have started it. Every backend here is real: stand-ins, or small scripted servers on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import openai
import pytest

from crossover.gateway.request.failover import Fault, classify_error, classify_response
from tests.gateway.gateway_helpers import (
    LONG,
    MODEL,
    QUEUE_FULL_EVENT,
    ClosingBackend,
    DroppingBackend,
    Picky,
    Scripted,
    chat,
    sglang_error,
    sse_events,
    stream_text,
    unused_url,
    wait_until,
)


def test_a_backend_killed_mid_test(sim, gateway):
    # One running slot on the speculative stand-in, so a second stream waits in its queue.
    speculative = sim("k25-eagle3", "--time-scale", "20", "--max-running-requests", "1")
    plain = sim("k25-plain", "--time-scale", "20")
    # No probe but the start-up one, and that one not failed by a loaded machine's slowness: a backend whose first
    # probe fails is out until the next (a minute away), and the first stream would go to plain.
    gw = gateway([speculative.url], [plain.url], health={"interval": 60, "timeout": 30})

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client:
            running = await client.send(
                client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG)), stream=True
            )
            assert running.headers["x-crossover-pool"] == "speculative"
            chunks = running.aiter_raw()
            started = await anext(chunks)
            # Queued behind `running` in the stand-in, nothing sent to its client yet - but it reached the
            # backend, which may have started it: it must not be sent anywhere else.
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=chat(True, 16)))
            while speculative_load() < 1:
                await asyncio.sleep(0.02)
            speculative.kill()
            rest = b"".join([chunk async for chunk in chunks])
            await running.aclose()
            after = [await client.post("/v1/chat/completions", json=chat(stream)) for stream in (True, False) * 3]
            return started + rest, await queued, after

    def speculative_load(key: str = "num_waiting_reqs") -> int:
        loads = httpx.get(speculative.url + "/v1/loads", timeout=5, trust_env=False).json()["loads"]
        return loads[0][key]

    # The gateway's start-up probe generates a token on the stand-in's one slot (SGLang's /health does): once it
    # is done, the first stream holds the slot and the second queues behind that stream, not behind the probe.
    wait_until(lambda: speculative_load("num_running_reqs") + speculative_load() == 0, what="the probe's slot free")
    cut, queued, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    events = sse_events(cut)
    assert stream_text(events)  # tokens arrived before the cut
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "backend_unavailable"
    assert queued.status_code == 502 and queued.json()["error"]["code"] == "backend_unavailable"
    assert [response.status_code for response in after] == [200] * 6
    assert {response.headers["x-crossover-pool"] for response in after} == {"plain"}
    # The failed requests asked for a probe at once, and the probe (connection refused) decided.
    wait_until(lambda: gw.state.pools.speculative[0].healthy is False, what="the probe to eject the dead backend")
    assert (
        gw.metric("crossover_backend_ejections_total", pool="speculative", backend=speculative.url, source="probe") == 1
    )
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="backend_error") == 2


def test_a_503_fails_over_to_the_other_pool(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], health={"interval": 60})
    assert httpx.post(speculative.url + "/release_memory_occupation", json={}, timeout=10).status_code == 200
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    assert gw.metric("crossover_failovers_total", reason="backend_busy") == 1
    assert gw.metric("crossover_route_decisions_total", pool="plain", reason="fallback") == 1


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
    assert gw.metric("crossover_failovers_total", reason="queue_full") == 1
    assert gw.state.pools.speculative[0].healthy is True  # busy is not broken


@pytest.mark.parametrize("stream", [True, False], ids=["queue-full-event", "http-503"])
def test_busy_everywhere_is_503_with_retry_after_and_the_openai_sdk_backs_off(serve, gateway, stream):
    """SGLang's queue-full answers - an error event after HTTP 200 when streaming, a 503 otherwise - from every
    backend that could take the request: the client hears "busy, come back in a second", not "broken", and the
    official SDK waits that second before each retry. Judged on the backends' own clock, by a lower bound only:
    a loaded machine makes the gaps longer, never shorter."""
    if stream:
        backends = [Scripted(chunks=[QUEUE_FULL_EVENT, b"data: [DONE]\n\n"]) for _ in range(2)]
    else:
        body = json.dumps(sglang_error("The request queue is full.", 503, "ServiceUnavailable")).encode()
        backends = [Scripted(status=503, body=body) for _ in range(2)]
    speculative, plain = backends
    gw = gateway([serve(speculative).url], [serve(plain).url], health={"interval": 60})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=2, timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
        if stream:
            list(answer)
    error = caught.value
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert error.body["code"] == "backend_busy" and error.body["message"] == "The request queue is full."
    # Three attempts (max_retries=2), each tried on both pools; between attempts the SDK slept Retry-After.
    paths = {
        name: [path for path, _, _ in backend.requests] for name, backend in (("spec", speculative), ("plain", plain))
    }
    assert len(speculative.arrived) == len(plain.arrived) == 3, paths
    gaps = [later - earlier for earlier, later in itertools.pairwise(speculative.arrived)]
    assert all(gap >= 0.9 for gap in gaps), gaps  # the SDK's own backoff without Retry-After: 0.375-0.5 s first
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="plain", outcome="busy") == 3
    assert gw.metric("crossover_failovers_total", reason="queue_full" if stream else "backend_busy") == 3
    assert all(backend.healthy is not False for backend in gw.state.pools.all())  # busy is no evidence


def test_a_backend_429_alone_is_429_with_its_retry_after(serve, gateway):
    backend = Scripted(status=429, headers=[(b"retry-after", b"3")], body=b'{"message": "slow down"}')
    url = serve(backend).url
    gw = gateway([url], [url], limits={"max_failovers": 0}, health={"interval": 60})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"] == {
        "message": "slow down", "type": "rate_limit_error", "param": None, "code": "backend_rate_limited"
    }  # fmt: skip
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="busy") == 1


def test_failover_is_bounded_and_ends_in_502(serve, gateway):
    backends = [Scripted(status=502, body=b"bad gateway") for _ in range(4)]
    urls = [serve(backend).url for backend in backends]
    gw = gateway(urls[:2], urls[2:], limits={"max_failovers": 2}, health={"interval": 60})
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 502 and response.json()["error"]["code"] == "backend_unavailable"
    assert sum(len(backend.requests) for backend in backends) == 3  # the first try and two failovers
    assert gw.metric("crossover_failovers_total", reason="backend_unavailable") == 2


def test_a_failure_after_failover_is_the_last_pool_tried(serve, gateway):
    # Speculative answers 503, plain then 502: the client's 502 is plain's, and says so.
    speculative, plain = Scripted(status=503, body=b"busy"), Scripted(status=502, body=b"bad gateway")
    gw = gateway([serve(speculative).url], [serve(plain).url], health={"interval": 60})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert response.status_code == 502 and "502" in response.json()["error"]["message"]
    assert response.headers["x-crossover-pool"] == "plain"
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="plain", outcome="backend_error") == 1
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="backend_error") == 0


@pytest.mark.parametrize("concurrent", [3, 30])
def test_requests_that_make_every_backend_answer_500_take_no_pool_down(serve, gateway, concurrent):
    """SGLang answers 500 to an exception while handling a request: the request's fault. However many such
    requests arrive at once, they go back to their clients as they are, and other clients keep being served."""
    poison = {"messages": [{"role": "user", "content": "poison"}]}

    # Both pools answer 500 to the poison request and serve everything else.
    picky = [Picky("poison") for _ in range(2)]
    urls = [serve(backend).url for backend in picky]
    gw = gateway([urls[0]], [urls[1]], health={"interval": 60, "failure_threshold": 2})

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client:
            bad = [client.post("/v1/chat/completions", json=chat(**poison)) for _ in range(concurrent)]
            good = [client.post("/v1/chat/completions", json=chat()) for _ in range(concurrent)]
            results = await asyncio.gather(*bad, *good)
            after = [await client.post("/v1/chat/completions", json=chat()) for _ in range(8)]
            return results, after

    results, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(response.status_code == 200 for response in after)
    for response in results:
        if response.status_code == 500:
            assert response.json()["error"]["message"] == "template error"
            assert response.headers["x-should-retry"] == "false"
    # No failover: a 500 says something about the request, so no other backend is asked to repeat it.
    assert gw.metric("crossover_failovers_total", reason="backend_unavailable") == 0
    assert sum(backend.poisoned for backend in picky) == concurrent  # each reached one backend, once
    assert all(response.status_code == 500 for response in results[:concurrent])
    assert all(response.status_code == 200 for response in results[concurrent:])
    assert all(backend.healthy for backend in gw.state.pools.all())
    assert not any(key[0] == "crossover_backend_ejections_total" for key in gw.samples())


def test_a_dead_backend_is_ejected_and_its_peer_serves_with_nothing_lost(sim, gateway):
    first, second = sim("k25-eagle3", "--time-scale", "20"), sim("k25-eagle3", "--time-scale", "20")
    plain = sim("k25-plain", "--time-scale", "20")
    gw = gateway([first.url, second.url], [plain.url], health={"interval": 60})
    first.kill()
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        responses = [client.post("/v1/chat/completions", json=chat()) for _ in range(10)]
    # Nothing had started on the dead one (connection refused): each request moved to its peer.
    assert [response.status_code for response in responses] == [200] * 10
    assert {response.headers["x-crossover-pool"] for response in responses} == {"speculative"}
    assert gw.state.pools.speculative[0].healthy is False and gw.state.pools.speculative[1].healthy is True
    assert gw.metric("crossover_failovers_total", reason="connect_error") >= 1


def test_connect_errors_fail_over_within_the_pool(sim, gateway):
    speculative = sim("k25-eagle3", "--time-scale", "20")
    gw = gateway([unused_url(), speculative.url], [unused_url()], health={"interval": 60})
    gw.state.pools.speculative[0].healthy = None  # pretend the first health round has not seen it fail
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        responses = [client.post("/v1/chat/completions", json=chat()) for _ in range(4)]
    assert [response.status_code for response in responses] == [200] * 4
    assert {response.headers["x-crossover-pool"] for response in responses} == {"speculative"}


def test_a_request_the_backend_received_is_never_sent_again(gateway):
    """The backend reads a request on a reused keep-alive connection and closes it without a byte. The close
    proves nothing - the backend may be generating it - so the request reaches it once, and the client hears
    that the backend failed (502: the OpenAI SDK may retry it; the gateway must not decide that for it)."""
    backend = ClosingBackend()
    try:
        # A failover budget, and the backend in both pools: only "it was never sent" could justify a second try.
        gw = gateway([backend.url], [backend.url], health={"interval": 60})
        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
            responses = [
                client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": f"req-{n}"}) for n in range(3)
            ]
    finally:
        backend.close()
    # Each connection: one answered, then one read and dropped; the third goes on a new connection.
    assert [response.status_code for response in responses] == [200, 502, 200]
    assert responses[1].json()["error"]["code"] == "backend_unavailable"
    assert sorted(backend.received) == [b"req-0", b"req-1", b"req-2"]  # each generated once, backend-side
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="backend_error") == 1
    assert gw.metric("crossover_failovers_total", reason="connect_error") == 0


def test_a_backend_that_drops_requests_it_read_gets_each_once(gateway):
    """It reads each request, records it, and closes without a word: it may have started each one, so nothing
    is resent and nothing fails over."""
    backend = DroppingBackend()
    other = DroppingBackend()
    try:
        gw = gateway([backend.url], [other.url], health={"interval": 60})
        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
            responses = [client.post("/v1/chat/completions", json=chat(stream)) for stream in (False, True) * 3]
    finally:
        backend.close()
        other.close()
    assert all(response.status_code == 502 for response in responses)
    assert backend.posts + other.posts == len(responses)
    assert len(set(backend.received + other.received)) == len(responses)
    assert gw.metric("crossover_failovers_total", reason="connect_error") == 0


def test_classification():
    refused = httpx.ConnectError("refused")
    refused.__cause__ = ConnectionRefusedError(111, "refused")
    assert classify_error(refused).fault is Fault.BACKEND and classify_error(refused).failover == "connect_error"
    exhausted = httpx.ConnectError("no descriptors")
    exhausted.__cause__ = OSError(24, "Too many open files")
    assert classify_error(exhausted).fault is Fault.LOCAL and classify_error(exhausted).failover is None
    lost = classify_error(httpx.RemoteProtocolError("closed"))
    assert lost.fault is Fault.BACKEND and lost.failover is None  # it may have started: no resend elsewhere
    assert classify_error(httpx.ReadTimeout("slow")).fault is Fault.REQUEST
    assert classify_response(502, b"", False).failover == "backend_unavailable"
    busy = classify_response(503, b"", False, headers=[(b"retry-after", b"7")])
    assert busy.failover == "backend_busy" and busy.busy and busy.error.headers["retry-after"] == "7"
    assert busy.error.status == 503 and busy.error.outcome == "busy"
    assert classify_response(429, b"", True).error.status == 429
    assert classify_response(500, b"{}", False) is None and classify_response(400, b"{}", True) is None
    queue_full = b'data: {"error": {"message": "The request queue is full.", "code": 503}}\n\ndata: [DONE]\n\n'
    assert classify_response(200, queue_full, True).failover == "queue_full"
    own_error = b'data: {"error": {"message": "bad logprobs", "code": 400}}\n\n'
    assert classify_response(200, own_error, True) is None  # passed on as the backend sent it
    assert classify_response(200, own_error, False).error.status == 400  # not a success, whatever the status line
    assert classify_response(200, queue_full, True, pool="plain").error.pool == "plain"  # built whole, not edited
    assert classify_response(200, b"", True).fault is Fault.BACKEND
