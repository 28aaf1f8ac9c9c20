"""The generation endpoints, POST /v1/chat/completions and /v1/completions: read and check the request,
admit it, then hand it to an `Exchange` with a watcher that notices when the client hangs up.

Written as a raw ASGI app: the hot path needs a deadline and a disconnect it controls (see exchange.py),
and a framework's response and middleware would wrap `send` for every chunk of every stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from crossover.gateway.errors import BodyTooLarge, GatewayError, Overloaded, send_error
from crossover.gateway.exchange import BAD_REQUEST, CLIENT_DISCONNECT, OVERLOADED, Exchange
from crossover.gateway.metrics import NO_POOL
from crossover.gateway.state import GatewayState
from crossover.gateway.upstream import request_headers
from crossover.gateway.validation import parse_generation

log = logging.getLogger("crossover.proxy")


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


async def read_body(receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"the request body is {int(value)} bytes; the limit is {limit}")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ProxyEndpoint:
    """ASGI app for POST /v1/chat/completions or /v1/completions."""

    def __init__(self, state: GatewayState, path: str) -> None:
        self.state = state
        self.path = path

    async def __call__(self, scope, receive, send) -> None:
        started = time.perf_counter()
        state = self.state
        headers = scope["headers"]
        request_id = (
            next((value for name, value in headers if name == b"x-request-id"), None) or uuid.uuid4().hex.encode()
        )
        try:
            body = await read_body(receive, headers, state.settings.limits.max_body_bytes)
            generation = parse_generation(self.path, body, state.pools.model_names())
            await state.admission.acquire()
        except ClientGone:
            state.metrics.requests.labels(NO_POOL, CLIENT_DISCONNECT).inc()
            return
        except GatewayError as exc:
            outcome = OVERLOADED if isinstance(exc, Overloaded) else BAD_REQUEST
            state.metrics.requests.labels(NO_POOL, outcome).inc()
            await send_error(send, exc, request_id)
            return
        exchange = Exchange(
            state, self.path, body, generation.stream, request_headers(headers, request_id), request_id, send
        )
        watcher = asyncio.create_task(exchange.watch_disconnect(receive))
        try:
            await exchange.run(started)
        except Exception:
            log.exception("request %s failed unexpectedly", request_id.decode(errors="replace"))
            if not exchange.response_started:
                await send_error(send, GatewayError("internal gateway error"), request_id)
        finally:
            watcher.cancel()
            state.admission.release()
