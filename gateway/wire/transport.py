"""The one place the backend HTTP machinery is built. Swap the transport here, nowhere else.

    transport = make_transport(settings)            # an httpx transport: the backend connections
    client = make_client(settings, transport)       # the same connections, with httpx's conveniences,
                                                    # for health checks and load scrapes
    sender = proxy_sender(transport)                # what generation requests go through:
    response = await sender.open("POST", url, headers, body, timeout)

The proxy path builds no httpx.Request or httpx.Response: their header normalisation, like httpx's client
layers (cookies, auth, redirects, URL merging), costs more per request than the transport does, and a proxy
needs none of it. Our own transport is called directly; any other httpx transport (an ASGI transport in a
test, say) is adapted. A transport passed in brings its own connection limits: it must allow
`connection_limit(settings)` connections and drop idle ones after `settings.timeouts.backend_keepalive` s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from crossover.gateway.config import Settings, TimeoutSettings
from crossover.gateway.wire.http1 import Http1Transport, RawHeaders, RawResponse, Target, Timeouts

# Health checks and load scrapes need connections even while every request slot streams.
PROBE_CONNECTIONS_PER_BACKEND = 4


def connection_limit(settings: Settings) -> int:
    plain = settings.pools.plain  # none in topology "in-engine"
    backends = len(settings.pools.speculative.backends) + (len(plain.backends) if plain else 0)
    return settings.limits.max_inflight + PROBE_CONNECTIONS_PER_BACKEND * backends


def backend_timeout(timeouts: TimeoutSettings) -> httpx.Timeout:
    # The proxy enforces first-byte, between-chunks and total deadlines itself (they change with the phase
    # of a request); these per-operation bounds are the backstop that keeps every socket wait finite.
    # A non-streaming answer's first byte comes when generation ends, so its read may take the whole request.
    whole = min(timeouts.non_stream or timeouts.total, timeouts.total)
    return httpx.Timeout(
        connect=timeouts.connect,
        read=max(timeouts.first_byte, timeouts.between_chunks, whole),
        write=timeouts.between_chunks,
        pool=timeouts.connect,
    )


def make_transport(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None = None,
    on_stale: Callable[[], None] = lambda: None,
) -> httpx.AsyncBaseTransport:
    if transport is not None:
        return transport
    limit = connection_limit(settings)
    # Not httpx's own transport: its connection pool collapses under a few hundred concurrent streams
    # (loadtest/proxybench/ measured 2% of direct's paced req/s); see gateway/wire/http1.py for the figures.
    return Http1Transport(
        httpx.Limits(
            max_connections=limit,
            max_keepalive_connections=limit,
            keepalive_expiry=settings.timeouts.backend_keepalive,
        ),
        on_stale=on_stale,
    )


def make_client(settings: Settings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    return BackendClient(
        transport=transport, timeout=backend_timeout(settings.timeouts), trust_env=False, follow_redirects=False
    )


class BackendClient(httpx.AsyncClient):
    """httpx's client, but a response read whole is freed as soon as it is let go. httpx wraps each response's
    stream in one that refers back to the response (encode/httpx#3733), a cycle that only the cyclic collector
    frees, which runs seldom here (gateway/serve/server.py's GC_THRESHOLDS): every health check and load scrape
    left ~2 KB behind until then (~7 MB an hour on an idle gateway with two backends)."""

    async def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        response = await super().send(request, stream=stream, **kwargs)
        if not stream:  # read whole and closed: the body is in `content`, the stream is never read again
            response.stream = httpx.ByteStream(response.content)
        return response


class HttpxSender:
    """Any httpx transport behind the proxy path's `open`, at the cost of httpx's request and response objects."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport

    async def open(
        self, method: str, url: httpx.URL | Target, headers: RawHeaders, body: bytes, timeout: Timeouts
    ) -> RawResponse:
        """As `Http1Transport.open`."""
        url = url.url if isinstance(url, Target) else url
        request = httpx.Request(method, url, content=body, headers=headers, extensions={"timeout": timeout})
        response = await self.transport.handle_async_request(request)
        return RawResponse(response.status_code, response.headers.raw, response.stream)


# What the proxy path sends through: the same `open`, either way.
ProxySender = Http1Transport | HttpxSender


def proxy_sender(transport: httpx.AsyncBaseTransport) -> ProxySender:
    return transport if isinstance(transport, Http1Transport) else HttpxSender(transport)
