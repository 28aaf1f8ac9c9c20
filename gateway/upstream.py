"""Opening one backend response, before anything has reached the client, and judging whether to retry.

`open_response` returns an `Opened` response whose first SSE event (streams) or whole body (the rest)
has already arrived, or raises `Retry` (try another backend) or a GatewayError (give up).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from crossover.gateway.errors import BackendFailed, BackendTimeout, GatewayError

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
_DROP_FROM_REQUEST = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect"}
# uvicorn adds its own date and server; the gateway sets length and request id.
_DROP_FROM_RESPONSE = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}
_IDENTITY = (b"accept-encoding", b"identity")
EVENT_ENDS = (b"\n\n", b"\r\n\r\n")

# Failover reasons (the `reason` label of crossover_failovers_total).
CONNECT_ERROR = "connect_error"
# The backend closed a fresh connection or died (the transport itself retries a stale pooled connection).
CONNECTION_LOST = "connection_lost"
BACKEND_5XX = "backend_5xx"
SSE_ERROR = "sse_error"
EMPTY_STREAM = "empty_stream"
HTTP_ERROR = "http_error"  # any other transport error before a response


class Retry(Exception):
    """This attempt failed before the client saw a byte; another backend may serve the request."""

    def __init__(self, reason: str, error: GatewayError, *, backend_at_fault: bool):
        super().__init__(reason)
        self.reason = reason
        self.error = error
        self.backend_at_fault = backend_at_fault


@dataclass(slots=True)
class Opened:
    response: httpx.Response
    # The rest of a stream after `head`, or None when `head` is the whole body.
    chunks: AsyncIterator[bytes] | None
    head: bytes


def _strip(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """Drop `drop` and whatever the Connection header names as hop-by-hop (RFC 9110 7.6.1)."""
    named = {
        token.strip().lower() for name, value in headers if name.lower() == b"connection" for token in value.split(b",")
    }
    drop = drop | named if named else drop
    return [(name.lower(), value) for name, value in headers if name.lower() not in drop]


def request_headers(client_headers: list[tuple[bytes, bytes]], request_id: bytes) -> list[tuple[bytes, bytes]]:
    headers = _strip(client_headers, _DROP_FROM_REQUEST | {b"x-request-id"})
    headers.append((b"x-request-id", request_id))
    headers.append(_IDENTITY)
    return headers


def response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return _strip(response.headers.raw, _DROP_FROM_RESPONSE)


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete SSE events at the start of `data`, the unfinished event after them)."""
    if data.endswith(EVENT_ENDS):
        return data, b""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return data[:end], data[end:]


async def _first_event(chunks: AsyncIterator[bytes]) -> bytes:
    """Read until the first SSE event is complete (or the stream ends)."""
    head = b""
    async for chunk in chunks:
        head += chunk
        if any(end in head for end in EVENT_ENDS):
            break
    return head


def sse_error_message(head: bytes) -> str | None:
    """The message of an `error` event if the stream opens with one (SGLang: HTTP 200, then the error)."""
    end = head.find(b"\n\n")
    if end < 0:
        end = head.find(b"\r\n\r\n")
    event = (head if end < 0 else head[:end]).strip()
    if not event.startswith(b"data:"):
        return None
    data = event[5:].strip()
    if not data.startswith(b"{"):
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not error:
        return None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


@functools.lru_cache(maxsize=1024)
def endpoint(backend_url: str, path: str) -> httpx.URL:
    """Parsed once per backend and path: URL parsing is a visible share of a proxied request's cost."""
    return httpx.URL(backend_url + path)


async def open_response(
    transport: httpx.AsyncBaseTransport, url: httpx.URL, body: bytes, headers: list, stream: bool, timeout: dict
) -> Opened:
    """POST `body` to `url` and wait for the first event or the whole body; see the module docstring."""
    request = httpx.Request("POST", url, content=body, headers=headers, extensions={"timeout": timeout})
    try:
        response = await transport.handle_async_request(request)
        response.request = request
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise Retry(CONNECT_ERROR, BackendFailed(f"cannot connect to a backend: {exc}"), backend_at_fault=True) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        raise Retry(
            CONNECTION_LOST, BackendFailed(f"a backend closed the connection: {exc}"), backend_at_fault=True
        ) from exc
    except httpx.TimeoutException as exc:
        raise BackendTimeout(f"a backend did not answer in time: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise Retry(HTTP_ERROR, BackendFailed(f"a request to a backend failed: {exc}"), backend_at_fault=True) from exc
    try:
        if response.status_code >= 500:
            await response.aread()
            raise Retry(
                BACKEND_5XX, BackendFailed(f"a backend answered HTTP {response.status_code}"), backend_at_fault=True
            )
        if stream and response.status_code == 200:
            # The transport's byte stream itself: `aiter_raw()` would only add a layer per chunk.
            chunks = aiter(response.stream)
            head = await _first_event(chunks)
            if not head:
                raise Retry(
                    EMPTY_STREAM, BackendFailed("a backend ended the stream before any event"), backend_at_fault=True
                )
            message = sse_error_message(head)
            if message is not None:
                # e.g. SGLang's "The request queue is full.": the backend is fine, just busy.
                raise Retry(SSE_ERROR, BackendFailed(f"a backend reported: {message}"), backend_at_fault=False)
            return Opened(response, chunks, head)
        return Opened(response, None, await response.aread())
    except httpx.TimeoutException as exc:
        await response.aclose()
        raise BackendTimeout(f"a backend did not answer in time: {exc!r}") from exc
    except httpx.HTTPError as exc:
        await response.aclose()
        raise Retry(
            CONNECTION_LOST, BackendFailed(f"a backend failed mid-response: {exc}"), backend_at_fault=True
        ) from exc
    except BaseException:
        await response.aclose()
        raise
