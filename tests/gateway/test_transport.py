"""The backend transport: bounded, and deaf to proxy settings in the environment."""

from __future__ import annotations

import asyncio

import httpx

from crossover.gateway.config import Settings
from crossover.gateway.transport import backend_timeout, connection_limit, make_client, make_transport
from tests.gateway.gateway_helpers import Scripted


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
