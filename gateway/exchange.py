"""One admitted request's trip: route -> open a backend, failing over before the first byte -> pass the
bytes through -> account for it in `finally`, however it ends (done, error, timeout, client disconnect).

One deadline per request (`asyncio.Timeout`) moves with its phase: first byte, then total. A stalled
stream (no chunk for between_chunks) or a client disconnect expires it early, which cancels whatever the
request waits on - queueing in the engine included - so the backend connection closes and SGLang aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx

from crossover.gateway.config import PLAIN, SPECULATIVE
from crossover.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    GatewayError,
    NoHealthyBackend,
    normalize_backend_error,
    send_error,
    sse_error,
)
from crossover.gateway.metrics import NO_POOL
from crossover.gateway.policy import FALLBACK
from crossover.gateway.pools import Backend
from crossover.gateway.state import GatewayState
from crossover.gateway.upstream import (
    EVENT_ENDS,
    Opened,
    Retry,
    endpoint,
    open_response,
    response_headers,
    split_events,
)

# Outcomes (the `outcome` label of crossover_requests_total).
OK = "ok"
BAD_REQUEST = "bad_request"  # rejected by the gateway's checks or by the backend (4xx)
OVERLOADED = "overloaded"
UNAVAILABLE = "unavailable"
BACKEND_ERROR = "backend_error"
TIMEOUT = "timeout"
CLIENT_DISCONNECT = "client_disconnect"

POOL_HEADER = b"x-crossover-pool"
_JSON = (b"content-type", b"application/json")
_DONE = b"data: [DONE]\n\n"
# An unfinished SSE event longer than this is passed on as it is (the backend is not speaking SSE).
MAX_PENDING_BYTES = 1024 * 1024


class Exchange:
    """One admitted request's trip to a backend and back. `run` accounts for it on every exit."""

    def __init__(
        self, state: GatewayState, path: str, body: bytes, stream: bool, headers: list, request_id: bytes, send
    ) -> None:
        self.state = state
        self.path = path
        self.body = body
        self.stream = stream
        self.headers = headers
        self.request_id = request_id
        self.send = send
        self.loop = asyncio.get_running_loop()
        # One deadline per request: first byte, then total. A stall (no chunk for between_chunks) or a
        # client disconnect expires it early. Per chunk we only note the time; a timer checks it rarely.
        self.deadline: asyncio.Timeout | None = None
        self.between_chunks = state.settings.timeouts.between_chunks
        self.last_chunk_at = 0.0
        self.stall_timer: asyncio.TimerHandle | None = None
        self.stalled = False
        self.backend: Backend | None = None
        self.pool = NO_POOL
        self.outcome = BACKEND_ERROR
        self.response_started = False
        # The last chunk streamed to the client: an error event must not be glued to half an event.
        self.last_chunk = b""
        self.finished = False
        self.disconnected = False

    async def watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.finished:
            return
        self.disconnected = True
        self._expire_now()

    def _expire_now(self) -> None:
        """Whatever the request waits on is cancelled; its cleanup runs in `run`'s `finally`."""
        if self.deadline is not None and not self.deadline.expired():
            with contextlib.suppress(RuntimeError):  # the deadline's block has just ended
                self.deadline.reschedule(self.loop.time())

    def _check_stall(self) -> None:
        due = self.last_chunk_at + self.between_chunks
        if self.loop.time() >= due:
            self.stalled = True
            self._expire_now()
        else:
            self.stall_timer = self.loop.call_at(due, self._check_stall)

    def _hold(self, backend: Backend) -> None:
        self._drop()
        backend.inflight += 1
        self.backend = backend
        self.pool = backend.pool

    def _drop(self) -> None:
        if self.backend is not None:
            self.backend.inflight -= 1
            self.backend = None

    async def run(self, started: float) -> None:
        timeouts = self.state.settings.timeouts
        now = self.loop.time()
        total_deadline = now + timeouts.total
        opened: Opened | None = None
        tokens = 0
        try:
            try:
                async with asyncio.timeout_at(min(total_deadline, now + timeouts.first_byte)) as self.deadline:
                    opened = await self._open()
                    self.deadline.reschedule(total_deadline)
                    if opened.chunks is None:
                        tokens = await self._send_whole(opened)
                    else:
                        tokens = await self._send_stream(opened, started)
            except TimeoutError:
                if self.disconnected:
                    self.outcome = CLIENT_DISCONNECT
                elif self.stalled:
                    await self._fail(BackendTimeout(f"the stream stalled for {self.between_chunks:g} s"), TIMEOUT)
                elif self.response_started:
                    await self._fail(BackendTimeout(f"the request took longer than {timeouts.total:g} s"), TIMEOUT)
                else:
                    if self.backend is not None:
                        self.state.pools.failed(self.backend)
                    limit = min(timeouts.total, timeouts.first_byte)
                    await self._fail(BackendTimeout(f"no response from the backend within {limit:g} s"), TIMEOUT)
            except GatewayError as exc:
                await self._fail(exc, _outcome(exc))
            except httpx.HTTPError as exc:  # the backend broke off a stream already under way
                if self.backend is not None:
                    self.state.pools.failed(self.backend)
                await self._fail(BackendFailed(f"the backend failed mid-stream: {exc!r}"), BACKEND_ERROR)
        finally:
            # Synchronous accounting first, the in-flight count last: nothing can interrupt it, and a count
            # back at zero means every metric of the request is recorded.
            self.finished = True
            if self.stall_timer is not None:
                self.stall_timer.cancel()
            metrics = self.state.metrics
            metrics.requests.labels(self.pool, self.outcome).inc()
            metrics.duration.labels(self.pool).observe(time.perf_counter() - started)
            if tokens:
                metrics.output_tokens.labels(self.pool).inc(tokens)
            self._drop()
            if opened is not None:
                await opened.response.aclose()

    async def _open(self) -> Opened:
        """The first backend that answers without failing: the chosen one, then up to max_failovers others."""
        state = self.state
        pools = state.pools
        decision = state.routing.decide(pools)
        backend = self._choose(decision.pool, set())
        if backend is None:
            raise NoHealthyBackend("no healthy backend in either pool")
        reason = decision.reason if backend.pool == decision.pool else FALLBACK
        state.metrics.route_decisions.labels(backend.pool, reason).inc()
        tried: set[Backend] = set()
        failovers = 0
        while True:
            self._hold(backend)
            try:
                opened = await open_response(
                    state.transport,
                    endpoint(backend.url, self.path),
                    self.body,
                    self.headers,
                    self.stream,
                    state.request_timeout,
                )
            except Retry as retry:
                if retry.backend_at_fault:
                    pools.failed(backend)
                tried.add(backend)
                backend = self._choose(self.pool, tried)
                if backend is None or failovers == state.settings.limits.max_failovers:
                    self._drop()
                    raise retry.error from None
                failovers += 1
                state.metrics.failovers.labels(retry.reason).inc()
                continue
            pools.succeeded(backend)
            return opened

    def _choose(self, pool: str, tried: set[Backend]) -> Backend | None:
        other = PLAIN if pool == SPECULATIVE else SPECULATIVE
        pools = self.state.pools
        return pools.choose(pool, tried) or pools.choose(other, tried)

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> dict:
        self.response_started = True
        headers.append((POOL_HEADER, self.pool.encode()))
        headers.append((b"x-request-id", self.request_id))
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def _send_whole(self, opened: Opened) -> int:
        response, body = opened.response, opened.head
        headers = response_headers(response)
        if response.status_code >= 400:
            body = normalize_backend_error(response.status_code, body)
            headers = [(name, value) for name, value in headers if name != b"content-type"] + [_JSON]
            self.outcome = BAD_REQUEST
        else:
            self.outcome = OK
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send(self._start(response.status_code, headers))
        await self.send({"type": "http.response.body", "body": body})
        return _usage_tokens(body) if response.status_code == 200 else 0

    async def _send_stream(self, opened: Opened, started: float) -> int:
        send, clock = self.send, self.loop.time
        # Chunks go out as they come, cut at the last complete event: if the backend fails mid-event, the
        # client gets whole events and then a clean error event, never half a JSON object.
        head, pending = split_events(opened.head)
        await send(self._start(opened.response.status_code, response_headers(opened.response)))
        await send({"type": "http.response.body", "body": head, "more_body": True})
        self.state.metrics.ttft.labels(self.pool).observe(time.perf_counter() - started)
        # Only the last two chunks are kept: the usage event, if any, sits just before [DONE].
        previous, self.last_chunk = b"", head
        self.last_chunk_at = clock()
        self.stall_timer = self.loop.call_at(self.last_chunk_at + self.between_chunks, self._check_stall)
        async for chunk in opened.chunks:
            self.last_chunk_at = clock()
            if pending:
                chunk, pending = pending + chunk, b""
            if not chunk.endswith(EVENT_ENDS):
                chunk, pending = split_events(chunk)
                if len(pending) > MAX_PENDING_BYTES:  # not SSE after all: stop holding bytes back
                    chunk, pending = chunk + pending, b""
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            previous, self.last_chunk = self.last_chunk, chunk
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        self.outcome = OK
        return _usage_tokens_from_events(previous + self.last_chunk)

    async def _fail(self, error: GatewayError, outcome: str) -> None:
        """Tell a client that is still there: an error response, or an error event if the stream began."""
        self.outcome = outcome
        # A client that stopped reading does not get to hold the request open.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.state.settings.timeouts.between_chunks):
                await self._tell(error)

    async def _tell(self, error: GatewayError) -> None:
        if not self.response_started:
            await send_error(self.send, error, self.request_id, [(POOL_HEADER, self.pool.encode())])
            return
        if not self.last_chunk.endswith(_DONE):  # a stream that already said [DONE] just ends
            # Close a half-sent event first, so the error event parses on its own.
            tail = b"" if self.last_chunk.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
            await self.send(
                {
                    "type": "http.response.body",
                    "body": tail + sse_error(error.message, error.type, error.code),
                    "more_body": True,
                }
            )
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


def _outcome(error: GatewayError) -> str:
    if isinstance(error, NoHealthyBackend):
        return UNAVAILABLE
    return TIMEOUT if isinstance(error, BackendTimeout) else BACKEND_ERROR


def _usage_tokens(body: bytes) -> int:
    try:
        return int(json.loads(body)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


def _usage_tokens_from_events(tail: bytes) -> int:
    at = tail.rfind(b'"usage"')
    if at < 0:
        return 0
    start = tail.rfind(b"data:", 0, at)
    end = tail.find(b"\n\n", at)
    if start < 0:
        return 0
    return _usage_tokens(tail[start + 5 : end if end >= 0 else len(tail)])
