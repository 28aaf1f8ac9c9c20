"""The backend transport: bounded, and deaf to proxy settings in the environment."""

from __future__ import annotations

import asyncio
import gc

import httpx

from crossover.gateway.config import Settings
from crossover.gateway.wire.transport import (
    HttpxSender,
    backend_timeout,
    connection_limit,
    make_client,
    make_transport,
)
from tests.gateway.gateway_helpers import Scripted, chat, sse_events


def settings_for(*urls: str, **overrides) -> Settings:
    return Settings(pools={"speculative": {"backends": list(urls)}, "plain": {"backends": list(urls)}}, **overrides)


def test_limits_and_timeouts_are_named_and_bounded():
    settings = settings_for(
        "http://a:1",
        "http://b:2",
        limits={"max_inflight": 10},
        timeouts={"first_byte": 100, "between_chunks": 30, "connect": 2, "non_stream": 50},
    )
    assert connection_limit(settings) == 10 + 4 * 4  # room for health checks while every slot streams
    timeout = backend_timeout(settings.timeouts)
    assert (timeout.connect, timeout.read, timeout.write, timeout.pool) == (2, 100, 30, 2)
    # Without a non-streaming bound, a whole answer may take the whole request: the socket read allows it.
    unbounded = backend_timeout(settings_for("http://a:1", timeouts={"total": 900, "first_byte": 100}).timeouts)
    assert unbounded.read == 900
    given = httpx.AsyncHTTPTransport()
    assert make_transport(settings, given) is given


def test_backend_requests_ignore_proxies_from_the_environment(serve, monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    url = serve(Scripted(body=b'{"ok": true}')).url
    settings = settings_for(url)

    async def scenario():
        transport = make_transport(settings)
        async with make_client(settings, transport) as client:
            health = await client.get(url + "/health")
            request = httpx.Request(
                "POST",
                url + "/v1/completions",
                content=b"{}",
                extensions={"timeout": backend_timeout(settings.timeouts).as_dict()},
            )
            response = await transport.handle_async_request(request)
            body = await response.aread()
        return health.status_code, response.status_code, body

    assert asyncio.run(scenario()) == (200, 200, b'{"ok": true}')


def test_a_response_read_whole_is_freed_without_the_cyclic_collector(serve, without_cyclic_collector):
    """httpx's response and its stream refer to each other (encode/httpx#3733); the backend client lets go of that
    once a response is read whole, so health checks and load scrapes leave nothing for the cyclic collector (before:
    ~2 KB each, ~7 MB an hour on an idle gateway with two backends)."""
    url = serve(Scripted()).url
    settings = settings_for(url)

    async def scenario():
        async with make_client(settings, make_transport(settings)) as client:
            for _ in range(5):
                assert (await client.get(url + "/health")).status_code == 200
            return sum(1 for obj in gc.get_objects() if type(obj) is httpx.Response)

    assert asyncio.run(scenario()) == 0


def test_any_httpx_transport_serves_the_proxy_path(sims, gateway):
    # httpx's own transport instead of ours: adapted, with the same answers, streams and accounting.
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], transport=httpx.AsyncHTTPTransport())
    assert isinstance(gw.state.failover.sender, HttpxSender)

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            answer = await client.post("/v1/chat/completions", json=chat(max_tokens=8))
            streamed = await client.post("/v1/chat/completions", json=chat(True, 16))
            missing = await client.post("/v1/chat/completions", json={**chat(), "model": "no-such-model"})
        return answer, streamed, missing

    answer, streamed, missing = asyncio.run(scenario())
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 200 and sse_events(streamed.content)[-1] == "[DONE]"
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 2
