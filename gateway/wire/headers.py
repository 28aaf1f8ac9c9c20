"""Headers on the way through: hop-by-hop stripping (RFC 9110 7.6.1), the request id, backend credentials.

headers = request_headers(scope["headers"], request_id, backend_key="sk-...")   # to the backend
headers = response_headers(response.headers)                                   # back to the client
"""

from __future__ import annotations

import itertools
import os

REQUEST_ID = b"x-request-id"
POOL = b"x-crossover-pool"
# OpenAI's SDKs read it: `false` stops their automatic retries where a retry would only repeat the failure.
SHOULD_RETRY = b"x-should-retry"
AUTHORIZATION = b"authorization"
# A client's request id is echoed, but only within reason: it ends up in logs and in backend headers.
MAX_REQUEST_ID_BYTES = 128

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# httpx sets these itself, and the backend must answer uncompressed so the bytes pass through as they are.
_DROP_FROM_REQUEST = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect", REQUEST_ID}
# uvicorn adds its own date and server; the gateway sets length and request id.
_DROP_FROM_RESPONSE = HOP_BY_HOP | {b"content-length", b"date", b"server", REQUEST_ID}
_IDENTITY = (b"accept-encoding", b"identity")
# The usual Connection values, which name no header `drop` keeps (Keep-Alive is hop-by-hop itself).
_NAMES_NOTHING = frozenset({b"keep-alive", b"close"})


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's X-Request-Id if it sent a sane one, else a fresh one."""
    for name, value in headers:
        if (
            name == REQUEST_ID
            and 0 < len(value) <= MAX_REQUEST_ID_BYTES
            and value.isascii()
            and value.decode().isprintable()
        ):
            return value
    return fresh_id()


def fresh_id() -> bytes:
    """A new request id, 32 hex digits like uuid4().hex: a random prefix per process and a counter, unique
    across gateways and restarts as a random id would be, without a system call per request."""
    return b"%s%016x" % (_id_prefix, next(_id_counter))


def _new_prefix() -> None:
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = os.urandom(8).hex().encode(), itertools.count()


_id_prefix, _id_counter = b"", itertools.count()
_new_prefix()
os.register_at_fork(after_in_child=_new_prefix)  # a forked worker must not repeat its parent's ids


def strip(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """Drop `drop` (which holds `connection`) and whatever the Connection header names as hop-by-hop."""
    kept = []
    named: set[bytes] | None = None
    for name, value in headers:
        name = name.lower()
        if name not in drop:
            kept.append((name, value))
        elif name == b"connection":
            value = value.lower()
            if value in _NAMES_NOTHING:
                continue
            tokens = {token.strip() for token in value.split(b",")}
            named = tokens if named is None else named | tokens
    if named:
        kept = [(name, value) for name, value in kept if name not in named]
    return kept


def request_headers(
    client_headers: list[tuple[bytes, bytes]], request_id: bytes, backend_key: str | None = None
) -> list[tuple[bytes, bytes]]:
    """What goes to the backend. With a backend key configured, the client's credentials never leave the gateway."""
    drop = _DROP_FROM_REQUEST | {AUTHORIZATION} if backend_key else _DROP_FROM_REQUEST
    headers = strip(client_headers, drop)
    headers.append((REQUEST_ID, request_id))
    headers.append(_IDENTITY)
    if backend_key:
        headers.append((AUTHORIZATION, b"Bearer " + backend_key.encode()))
    return headers


def response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """What goes back to the client of the headers a backend answered with."""
    return strip(headers, _DROP_FROM_RESPONSE)


def bearer(key: str | None) -> dict[str, str]:
    """httpx headers for the gateway's own calls to a backend (health, models, loads)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class RequestIdMiddleware:
    """Every response outside the proxy path carries X-Request-Id too (echoed, or a fresh one)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
