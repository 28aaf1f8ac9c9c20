"""HTTP on both sides of the gateway: the client-facing protocol, the lean HTTP/1.1 backend transport, the
client and sender built over it, and the headers that cross."""

from __future__ import annotations

from crossover.gateway.wire.client_http import CHUNK, CLIENT_LINK, ClientLink, client_protocol
from crossover.gateway.wire.headers import (
    POOL,
    SHOULD_RETRY,
    RequestIdMiddleware,
    bearer,
    request_headers,
    request_id,
    response_headers,
)
from crossover.gateway.wire.http1 import Dispatch, Http1Transport, RawResponse, Relay, Target, pump
from crossover.gateway.wire.transport import ProxySender, backend_timeout, make_client, make_transport, proxy_sender

__all__ = [
    "CHUNK",
    "CLIENT_LINK",
    "POOL",
    "SHOULD_RETRY",
    "ClientLink",
    "Dispatch",
    "Http1Transport",
    "ProxySender",
    "RawResponse",
    "Relay",
    "RequestIdMiddleware",
    "Target",
    "backend_timeout",
    "bearer",
    "client_protocol",
    "make_client",
    "make_transport",
    "proxy_sender",
    "pump",
    "request_headers",
    "request_id",
    "response_headers",
]
