"""One request through the gateway: its lifecycle, the coroutine and the inline driver, failover, and the checks
(keys, body, SSE framing)."""

from __future__ import annotations

from crossover.gateway.request.auth import authorize_admin, authorize_client, client_keys
from crossover.gateway.request.failover import Failover
from crossover.gateway.request.inline import InlineExchange
from crossover.gateway.request.proxy import Live, ProxyEndpoint
from crossover.gateway.request.validation import CHAT, COMPLETIONS

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "Failover",
    "InlineExchange",
    "Live",
    "ProxyEndpoint",
    "authorize_admin",
    "authorize_client",
    "client_keys",
]
