"""One streaming chat completion, timed the way `bench_serving` times it, with every way it can fail.

A request succeeds only if the server answered 200, streamed at least one token, reported `usage`, sent no
`error` event and ended with `data: [DONE]`. Anything else is a failure with a short reason - an HTTP error,
an SSE `error` event (SGLang sends those with status 200, even after tokens), a stream cut before `[DONE]`,
a timeout - never a fast success. Each failure has a kind (`error_kind`: `ReadError`, `HTTP 503`, `timeout`,
`cut before [DONE]`, ...) that a level counts, and a message (`error`) that says what the kind alone does not:
an httpx error's message is often empty, so the cause underneath it (`[Errno 104] Connection reset by peer`)
is named, with what the kind usually means (HTTPX_ERROR_MEANINGS).

Timing (seconds, `time.perf_counter`): `chunk_times` holds the arrival of every chunk carrying text, so TTFT
is the first minus `start` and the gaps between them are bench_serving's ITL. With `continuous_usage_stats`
the cumulative usage in each chunk tells how many tokens it carried (`chunk_tokens`) - a speculative server
sends several at a time; latency ends when `[DONE]` arrives. A request cancelled by the load tester (its
measurement window closed) keeps what it received so far and is marked `cancelled`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

ERROR_BODY_LIMIT = 2048  # bytes of a non-200 body kept for the error message
ERROR_MESSAGE_LIMIT = 400  # characters of an error message kept per request
MAX_LINE_BYTES = 1 << 20  # an SSE line longer than this is not a chat completion stream

# What an httpx transport error usually means in a load test, for a message that names nothing else.
HTTPX_ERROR_MEANINGS = {
    "ReadError": "the connection failed while the response was being read (reset or closed by the server, "
    "its proxy or the kernel: a crashed or overloaded server, a full accept backlog, no file descriptors left)",
    "WriteError": "the connection failed while the request was being sent (closed or reset by the server)",
    "RemoteProtocolError": "the server broke HTTP (closed the connection mid-response, or sent a malformed one)",
    "ConnectError": "no connection (nothing listening, refused, or the accept backlog full)",
    "ConnectTimeout": "no connection within the connect timeout (an overloaded server or a full backlog)",
    "ReadTimeout": "the server sent nothing within the read timeout",
    "WriteTimeout": "the request could not be sent within the write timeout",
    "PoolTimeout": "no free connection in the client's pool within its timeout",
}


@dataclass(slots=True)
class RequestResult:
    start: float
    end: float = 0.0
    success: bool = False
    cancelled: bool = False
    error: str = ""
    error_kind: str = ""  # what a level counts failures by; `error` says more
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    # Tokens carried by each chunk of `chunk_times`; None when the server does not report per-chunk usage.
    chunk_tokens: list[int] | None = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def chunk_gaps(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]


class _StreamFailed(Exception):
    """The stream said something that makes the request a failure; the message is the reason."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


async def run_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    total_timeout: float,
    result: RequestResult | None = None,
) -> RequestResult:
    """POST one streaming request and measure it into `result`; never raises for a server-side problem.

    Pass `result` to see a request's progress while it runs (and after it is cancelled).
    """
    if result is None:
        result = RequestResult(start=time.perf_counter())
    try:
        async with asyncio.timeout(total_timeout):
            async with client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code != 200:
                    raise _StreamFailed(f"HTTP {response.status_code}", await _http_error(response))
                await _read_stream(response, result)
    except _StreamFailed as exc:
        _fail(result, exc.kind, str(exc))
    except TimeoutError:
        _fail(result, "timeout", f"timed out after {total_timeout:g} s")
    except httpx.HTTPError as exc:
        _fail(result, type(exc).__name__, describe_transport_error(exc))
    except asyncio.CancelledError:
        _fail(result, "cancelled", "cancelled by the load tester")
        result.cancelled = True
        raise
    return result


def _fail(result: RequestResult, kind: str, reason: str) -> None:
    result.success = False
    result.end = time.perf_counter()
    result.error_kind = kind
    result.error = reason[:ERROR_MESSAGE_LIMIT]


def describe_transport_error(exc: BaseException) -> str:
    """`ReadError: [Errno 104] Connection reset by peer (the connection failed while ...)`: the first message
    found down the exception's causes (httpx often wraps an empty one), and what the kind usually means."""
    kind = type(exc).__name__
    message, seen = "", set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen and not message:
        seen.add(id(cause))
        message = str(cause) or (repr(cause) if isinstance(cause, OSError) and cause.errno else "")
        cause = cause.__cause__ or cause.__context__
    meaning = HTTPX_ERROR_MEANINGS.get(kind)
    text = f"{kind}: {message}" if message else kind
    return f"{text} ({meaning})" if meaning else text


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    usage_seen = False
    reported_tokens = 0  # cumulative completion_tokens seen so far (continuous usage)
    done = False
    pending = b""
    async for piece in response.aiter_bytes():
        now = time.perf_counter()
        pending += piece
        if b"\n" not in piece:
            if len(pending) > MAX_LINE_BYTES:
                raise _StreamFailed("malformed stream", f"no SSE line break in {len(pending)} bytes")
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments and keep-alives
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                result.end = now
                continue
            event = _parse_event(data)
            if "error" in event:
                raise _StreamFailed("stream error event", f"stream error event: {_error_message(event)}")
            usage = event.get("usage")
            if usage:
                usage_seen = True
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            if not _has_text(event):
                continue
            result.chunk_times.append(now)
            if result.chunk_tokens is not None:
                if usage:
                    result.chunk_tokens.append(result.output_tokens - reported_tokens)
                    reported_tokens = result.output_tokens
                else:
                    result.chunk_tokens = None
    if not done:
        raise _StreamFailed("cut before [DONE]", "stream ended without [DONE]")
    if not result.chunk_times:
        raise _StreamFailed("no tokens", "stream carried no tokens")
    if not usage_seen:
        raise _StreamFailed("no usage", "stream carried no usage (server ignores stream_options.include_usage?)")
    result.success = True


def _parse_event(data: bytes) -> dict:
    try:
        event = json.loads(data)
    except ValueError:
        raise _StreamFailed("malformed stream", f"malformed SSE data: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise _StreamFailed("malformed stream", f"unexpected SSE data: {data[:80]!r}")
    return event


def _has_text(event: dict) -> bool:
    choices = event.get("choices")
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if delta:
        # Reasoning models (Kimi-K2.5 with a reasoning parser) stream their thinking tokens here.
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


def _error_message(body: object) -> str:
    """The message of an OpenAI-style, SGLang-style or FastAPI-style error body."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("detail") or json.dumps(inner)
            code = inner.get("code")
            return f"{code}: {message}" if code is not None else str(message)
        return str(inner)
    return str(body)


async def _http_error(response: httpx.Response) -> str:
    raw = b""
    async for piece in response.aiter_bytes():
        raw += piece
        if len(raw) >= ERROR_BODY_LIMIT:
            break
    try:
        detail = _error_message(json.loads(raw))
    except ValueError:
        detail = raw[:ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
    return f"HTTP {response.status_code}: {detail}" if detail else f"HTTP {response.status_code}"
