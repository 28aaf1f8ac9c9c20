"""One generation request's lifecycle, POST /v1/chat/completions and /v1/completions:

    check the key -> read the body (bounded in size and time) -> check what routing needs -> admission (a
    client that leaves frees its place) -> route -> open a backend response (gateway/request/failover.py) -> pass
    the bytes through -> account for it in `finally`, however it ends.

One deadline per request (`asyncio.Timeout`) moves with its phase: first byte (streams) or the whole body
(non-streaming: `non_stream`, else only `total`), then `total`. It also expires early - cancelling whatever
the request waits on, queueing in the engine included, so the backend connection closes and SGLang aborts -
when the client hangs up, when the backend stays silent for `between_chunks`, when the client takes none of
what it was sent for `client_write` (the client's slowness, never the backend's: measured by the bytes its
TCP stack acknowledged, so a slow reader that keeps reading is never cut), or when a shutdown runs out of
grace. The reason it was cut is the error it ends with (`Exchange.cut`). A stream cut for any reason other
than the client leaving ends with an SSE error event and `data: [DONE]`. A backend's own error event, before
or after the first token, is passed on in the gateway's error shape (its message and status kept) and counted
as the failure it is.

Written as a raw ASGI app: a framework's response and middleware would wrap `send` for every chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable

import httpx

from crossover.gateway import metrics as labels
from crossover.gateway.admission import Admission
from crossover.gateway.backends import Backend, Pools
from crossover.gateway.config import Settings
from crossover.gateway.errors import (
    BackendAnswered,
    BackendFailed,
    BackendTimeout,
    BodyTooLarge,
    ClientGone,
    ClientTooSlow,
    GatewayError,
    RequestTimeout,
    Unavailable,
    error_body,
    openai_type,
    send_error,
)
from crossover.gateway.metrics import Metrics
from crossover.gateway.request.auth import client_keys, key_tiers
from crossover.gateway.request.failover import MID_STREAM, Failover, Opened, Outgoing
from crossover.gateway.request.lifecycle import (
    Live,
    Request,
    check_body,
    check_head,
    first_wait_s,
    no_answer_in_time,
)
from crossover.gateway.request.sse import (
    DONE,
    ERROR_MARK,
    EVENT_ENDS,
    error_event,
    error_in,
    split_events,
)
from crossover.gateway.topology import SwitchUnavailable, Topology
from crossover.gateway.tracing import Tracing
from crossover.gateway.wire import CHUNK, CLIENT_LINK, backend_timeout, pump, request_id, response_headers

log = logging.getLogger("crossover.proxy")

# An unfinished SSE event longer than this is passed on as it is (the backend is not speaking SSE).
MAX_PENDING_BYTES = 1024 * 1024
# How long the last words (an error response or event) may take to reach a client that stopped reading.
LAST_WORDS_TIMEOUT_S = 1.0
# The scope key under which the direct lane leaves (body, Generation) of a request it read and left to this
# path (a stream, say), so that the body is not parsed twice (gateway/request/inline.py).
PARSED = "crossover.parsed"


class ProxyEndpoint:
    """The ASGI app for one generation path."""

    def __init__(
        self,
        path: str,
        settings: Settings,
        pools: Pools,
        admission: Admission,
        failover: Failover,
        metrics: Metrics,
        live: Live,
        topology: Topology,
        tracing: Tracing | None = None,
    ) -> None:
        self.path = path
        self.settings = settings
        self.pools = pools
        self.admission = admission
        self.failover = failover
        self.metrics = metrics
        self.live = live
        # Which pool a request goes to, and whether it must hold a place on a mode first (gateway/topology/factory.py).
        self.topology = topology
        self.api_keys = client_keys(settings.api_keys)
        self.key_tiers = key_tiers(settings.api_key_tiers)
        self.tracing = tracing
        self.socket_timeout = backend_timeout(settings.timeouts).as_dict()

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("http_version") == "1.0":
            send = Http10Send(send)
        await Exchange(self, scope, send).run(receive)

    def route(self, tier: str | None) -> tuple[str, str]:
        """(pool, reason) for a new request with service tier `tier`."""
        return self.topology.route(None, tier)

    def target(self, scope) -> str:
        """The request target the backend gets: the path and the client's query string."""
        query = scope.get("query_string")
        return self.path + "?" + query.decode("latin-1") if query else self.path


class Exchange(Request):
    """One request driven by a coroutine, from its first byte in to its last byte out (the steps and the guard
    that accounts for it on every exit: gateway/request/lifecycle.py)."""

    # One is made per request: slots make its two dozen fields cheaper to set and read.
    __slots__ = (
        "body_unread",
        "cut",
        "deadline",
        "last_chunk",
        "last_chunk_at",
        "loop",
        "out",
        "pending",
        "previous_chunk",
        "scope",
        "send",
        "stream_error",
        "streaming",
        "taken",
        "timeouts",
        "writing_since",
    )
    # As a stream's relay (gateway/wire/http1.py's `Relay`): whole events pass on from the backend connection's read
    # callback, framed as the client's connection frames them; an error event, or part of an event, waits for the
    # task (`_deliver`).
    frame = CHUNK
    ends = EVENT_ENDS
    mark = ERROR_MARK
    endpoint: ProxyEndpoint  # the lifecycle's `Endpoint`, as this driver's path has it

    def __init__(self, endpoint: ProxyEndpoint, scope, send) -> None:
        super().__init__(endpoint, request_id(scope["headers"]), scope.get("extensions", {}).get(CLIENT_LINK))
        self.scope = scope
        self.send = send
        # The connection's loop, where there is one: asyncio.get_running_loop() is a getpid() system call.
        self.loop = asyncio.get_running_loop() if self.link is None else self.link.loop
        self.timeouts = endpoint.settings.timeouts
        self.deadline: asyncio.Timeout | None = None
        # Why the deadline was expired early: the error the request ends with (the first reason wins).
        self.cut: GatewayError | None = None
        # Until the whole body is in, an early answer must close the connection: the rest is still coming.
        self.body_unread = True
        # Backend silence and blocked client writes are timed apart: only the first is the backend's.
        self.last_chunk_at = 0.0
        self.writing_since: float | None = None
        # What the client's TCP stack had acknowledged when a blocked write was last looked at (None: unknown).
        self.taken: int | None = None
        self.streaming = False
        # A backend's own error event in the stream (passed on reshaped): the failure the request counts as.
        self.stream_error: BackendAnswered | None = None
        # The last chunk streamed to the client: an error event must not be glued to half an event. Only the last
        # two are kept: the usage event, if any, sits just before [DONE].
        self.last_chunk = self.previous_chunk = b""
        # As a stream's relay: the client's transport while the backend's pieces may go there from the read
        # callback (a chunked response under way, the request not being cut, no part of an event held back).
        self.out: asyncio.WriteTransport | None = None

    async def run(self, receive) -> None:
        """The steps, from the first to `end`, whatever happens between."""
        endpoint = self.endpoint
        watcher: asyncio.Task | None = None
        tokens = 0
        endpoint.live.requests.add(self)
        if endpoint.tracing is not None:
            self.trace = endpoint.tracing.request(self.scope, self.started)
        try:
            try:
                check_head(endpoint, self.scope["headers"])
                body = await self._read_body(receive)
                parsed = self.scope.pop(PARSED, None)  # what the direct lane read of it, if it looked
                if parsed is not None and parsed[0] == body:
                    generation = parsed[1]
                else:
                    generation = check_body(endpoint, body, self.scope["headers"])
                self.tier = generation.tier
                if self.trace is not None:
                    self.trace.checked(generation.model, generation.tier)
            except Exception as exc:
                await self._failed(exc, stream=False)
                return
            if self.link is not None:  # our server says when the client leaves
                self.link.callback = self._client_left
            else:  # any other ASGI server: only receive() says
                watcher = asyncio.create_task(self._watch_disconnect(receive))
            tokens = await self._guarded(self._admit_and_relay(body, generation.stream), generation.stream)
        finally:
            if watcher is not None:
                watcher.cancel()
            await self._close(tokens)

    async def carry_on(self, pool: str, reason: str, body: bytes, total_due: float, tried: set[Backend]) -> None:
        """A non-streamed request the inline lane sent, whose backend failed it before a byte reached the client:
        on to the next backend, on this coroutine from here (its request handed over: `Request.hand_over`)."""
        self.body_unread = False
        if self.link is not None:
            self.link.callback = self._client_left
        tokens = 0
        try:
            tokens = await self._guarded(self._reopen(pool, reason, body, total_due, tried), stream=False)
        finally:
            await self._close(tokens)

    async def _reopen(self, pool: str, reason: str, body: bytes, total_due: float, tried: set[Backend]) -> int:
        self._move_deadline(min(total_due, self.loop.time() + first_wait_s(self.timeouts, stream=False)))
        endpoint = self.endpoint
        outgoing = Outgoing(
            self.target(), body, self.scope["headers"], self.request_id, False, endpoint.socket_timeout, self.trace
        )
        return await self._open_and_send(pool, reason, outgoing, total_due, tried)

    async def _guarded(self, work: Awaitable[int], stream: bool) -> int:
        """`work` (which passes the response on and returns its output tokens) under the request's deadline;
        whatever it fails with, the client is told."""
        try:
            async with asyncio.timeout(None) as self.deadline:
                if self.cut is not None:  # cut before its deadline was there to expire: it ends as the cut says
                    raise TimeoutError
                return await work
        except Exception as exc:
            await self._failed(exc, stream)
        return 0

    async def _failed(self, exc: Exception, stream: bool) -> None:
        """The one answer to a step that raised `exc`: the request's outcome set, the client told what it is still
        owed (nothing, if it left). The coroutine's guard: it raises nothing."""
        try:
            error = self._error(exc, stream)
        except Exception:
            error = self.failed_unexpectedly()
        if error is None:
            return
        self.outcome = error.outcome
        if isinstance(error, ClientGone):
            return
        if self.trace is not None and not self.response_started:
            self.trace.responded(error.status)
        if isinstance(error, ClientTooSlow):
            log.info("request %s: %s", self.request_id.decode(), error.message)
        await self._tell(error)
        if isinstance(error, ClientTooSlow) and self.link is not None:
            # What it left unread would keep its buffers and descriptor for a long while.
            self.link.abort()

    def _error(self, exc: Exception, stream: bool) -> GatewayError:
        """The error a failure that a step may meet ends the request with; any other is raised again."""
        if isinstance(exc, TimeoutError):  # the deadline, or a cut (`_cut`)
            return self.cut or self._deadline_passed(stream)
        if isinstance(exc, GatewayError):
            self.pool = exc.pool or self.pool
            return exc
        if isinstance(exc, httpx.HTTPError):  # the backend broke off a stream already under way
            if self.opened is not None:
                self.endpoint.failover.broke_mid_stream(self.opened.backend, exc)
            return BackendFailed(MID_STREAM)
        raise exc  # unexpected: `_failed` says so

    def _deadline_passed(self, stream: bool) -> BackendTimeout:
        timeouts = self.timeouts
        if self.response_started or self.opened is not None:
            return BackendTimeout(f"the request took longer than {timeouts.total:g} s")
        return no_answer_in_time(timeouts, stream)

    async def _close(self, tokens: int) -> None:
        try:
            self.end(tokens)
        finally:
            if self.opened is not None:
                await self.opened.response.aclose()

    # -- phases ---------------------------------------------------------------------------------------

    async def _read_body(self, receive) -> bytes:
        limit = self.endpoint.settings.limits.max_body_bytes
        for name, value in self.scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise BodyTooLarge(f"the request body is {int(value)} bytes; the limit is {limit}")
        # The usual body came with its head: one receive, no deadline to set up.
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client left before its request arrived")
        chunks = [message.get("body", b"")]
        size = len(chunks[0])
        if size > limit:
            raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            self.body_unread = False
            return chunks[0]
        try:
            async with asyncio.timeout(self.timeouts.request_body):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone("the client left before its request arrived")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        self.body_unread = False
                        return b"".join(chunks)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {self.timeouts.request_body:g} s") from None

    async def _admit_and_relay(self, body: bytes, stream: bool) -> int:
        await self.endpoint.admission.acquire(self.tier)
        self.admitted = True
        return await self._relay(body, stream)

    async def _relay(self, body: bytes, stream: bool) -> int:
        endpoint, timeouts = self.endpoint, self.timeouts
        # Time-shared: the active mode takes every request; during a switch this waits in the switch queue
        # (bounded in length and time), before the first-byte clock starts. Elsewhere: no lease.
        self.mode_lease = await endpoint.topology.admit(self.cut_for_switch)
        now = self.loop.time()
        total_deadline = now + timeouts.total
        self._move_deadline(now + first_wait_s(timeouts, stream))
        pool, reason = endpoint.topology.route(self.mode_lease, self.tier)
        self.pool = pool  # until a backend answers: where the request was headed when it failed
        if self.trace is not None:
            self.trace.routed(pool, reason, endpoint.topology.trace_view())
        outgoing = Outgoing(
            self.target(), body, self.scope["headers"], self.request_id, stream, endpoint.socket_timeout, self.trace
        )
        return await self._open_and_send(pool, reason, outgoing, total_deadline)

    async def _open_and_send(
        self, pool: str, reason: str, outgoing: Outgoing, total_deadline: float, tried: set | None = None
    ) -> int:
        endpoint = self.endpoint
        # A time-shared GPU set serves one mode: the other mode's server is stopped or asleep.
        try:
            self.opened = opened = await endpoint.failover.open(
                pool, outgoing, other_pool=endpoint.topology.other_pool, tried=tried
            )
        except (BackendFailed, Unavailable) as exc:
            # Time-shared: its one server failed it (dead, say): a 503 that says the GPU set is on it, with Retry-After.
            raise endpoint.topology.open_failed(pool, exc) from None
        self.pool = opened.backend.pool
        self.routed(pool, reason)
        self._move_deadline(total_deadline)
        if opened.chunks is None:
            return await self._send_whole(opened)
        return await self._send_stream(opened)

    def target(self) -> str:
        return self.endpoint.target(self.scope)

    async def _send_whole(self, opened: Opened) -> int:
        status, headers, body = self._whole(opened.response.status_code, opened.response.headers, opened.head)
        # Our server takes the whole response in one write, with nothing to wait for; under another, two sends.
        if self.link is None or not self.link.respond(status, headers, body):
            self._watch(streaming=False)
            await self._write({"type": "http.response.start", "status": status, "headers": headers})
            await self._write({"type": "http.response.body", "body": body})
        self.response_ended = True
        return self.usage(body) if status == 200 else 0

    async def _send_stream(self, opened: Opened) -> int:
        response = opened.response
        # Chunks go out as they come, cut at the last complete event: if the backend fails mid-event, the
        # client gets whole events and then a clean error event, never half a JSON object.
        head, pending = split_events(opened.head)
        # A stream that opens with the request's own error (not queue-full: that failed over) is passed on.
        if head.find(ERROR_MARK) >= 0:
            head = self._reshape(head)
        self._watch(streaming=True)
        # The piece that ends the backend's body also ends the client's: one write less per stream.
        ended = response.ended()
        if ended:
            head, pending = head + pending, b""
        headers = self._own(response_headers(response.headers))
        if self.trace is not None:
            self.trace.responded(response.status_code)
        if self.link is not None and self.link.start_stream(response.status_code, headers, head, ended):
            self._sent(head)  # the response's head and its first piece in one write
        else:
            await self._write({"type": "http.response.start", "status": response.status_code, "headers": headers})
            sending = self._put(head, ended)
            if sending is not None:
                await sending
        self.endpoint.metrics.first_event(self.pool, time.perf_counter() - self.started)
        if ended:
            self._stream_ended()
            return self.usage(head)
        self.pending = pending
        self._relay_now()
        await pump(opened.chunks, self._deliver, self if self.link is not None else None)
        self._stream_ended()
        return self.usage(self.previous_chunk + self.last_chunk)

    def _stream_ended(self) -> None:
        """How a stream read to its end counts: as the backend's error event, if it sent one, or as a client that
        left, if it left as the last pieces came (they went nowhere, and no cut reached an await to say so)."""
        self.response_ended = True
        if isinstance(self.cut, ClientGone):
            self.outcome = self.cut.outcome
        else:
            self.outcome = labels.OK if self.stream_error is None else self.stream_error.outcome

    def _relay_now(self) -> None:
        """Whether the backend's next pieces may skip the task, as the request's relay (`pump`): while the client's
        connection takes them (`ClientLink.relay_out`), but not while the request is being cut (the cut is its
        last word) nor while part of an event is held back (the next piece completes it)."""
        self.out = None if self.link is None or self.cut is not None or self.pending else self.link.relay_out(self)

    def _deliver(self, chunk: bytes, ended: bool):
        """One piece of the backend's stream (`ended`: its last) on to the client, whole events only; None when
        it went out at once, else an awaitable that sends it."""
        self.last_chunk_at = self.loop.time()
        if self.pending:
            chunk, self.pending = self.pending + chunk, b""
        if not ended and not chunk.endswith(EVENT_ENDS):
            chunk, self.pending = split_events(chunk)
            if len(self.pending) > MAX_PENDING_BYTES:  # not SSE after all: stop holding bytes back
                chunk, self.pending = chunk + self.pending, b""
        if ended:  # the pump is over: nothing more goes to the relay
            self.out = None
        else:
            self._relay_now()
            if not chunk:
                return None
        if chunk.find(ERROR_MARK) >= 0:  # rare: SGLang's error event, just before [DONE]
            chunk = self._reshape(chunk)
        return self._put(chunk, ended)

    def _put(self, chunk: bytes, ended: bool):
        """`chunk` to the client: None when our server's link took it at once, else an awaitable that sends it."""
        if self.link is not None and self.link.write_body(chunk, not ended):
            self._sent(chunk)
            return None
        return self._send_piece(chunk, ended)

    async def _send_piece(self, chunk: bytes, ended: bool) -> None:
        await self._write({"type": "http.response.body", "body": chunk, "more_body": not ended})
        self._sent(chunk)

    def _sent(self, chunk: bytes) -> None:
        if chunk:  # an empty end says nothing of what the client has
            self.previous_chunk, self.last_chunk = self.last_chunk, chunk

    def _reshape(self, events: bytes) -> bytes:
        """SGLang's error events (`data: {"error": {"object": "error", "type": "BadRequest", "code": 400, ...}}`)
        in the gateway's error shape, their message and status kept; the first is the failure the request counts as."""
        out = []
        for event in events.split(b"\n\n"):
            found = error_in(event) if event.find(ERROR_MARK) >= 0 else None
            if found is not None:
                status = found.status or 500
                event = b"data: " + json.dumps(error_body(found.message, openai_type(status), None, status)).encode()
                if self.stream_error is None:
                    self.stream_error = BackendAnswered(status, found.message, pool=self.pool)
                    log.info("request %s: the backend's stream failed: %s", self.request_id.decode(), found.message)
            out.append(event)
        return b"\n\n".join(out)

    # -- timing ---------------------------------------------------------------------------------------

    async def _write(self, message: dict) -> None:
        """A send whose time blocked on the client is the client's: the backend's silence clock stops."""
        self.writing_since = self.loop.time()
        if self.link is not None:
            self.link.going()  # a connection closing under a pipelined request: uvicorn must not write on it
        await self.send(message)
        self.writing_since = None
        self.last_chunk_at = self.loop.time()

    def _watch(self, streaming: bool) -> None:
        """From the response's first byte: a write blocked on the client for `client_write` is the client's
        slowness; a stream's backend silent for `between_chunks` (not counting blocked writes) is a stall."""
        self.streaming = streaming
        self.last_chunk_at = now = self.loop.time()
        timeouts = self.timeouts
        self._arm(now + (min(timeouts.client_write, timeouts.between_chunks) if streaming else timeouts.client_write))

    def _arm(self, due: float) -> None:
        self.timer = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        now, timeouts = self.loop.time(), self.timeouts
        if self.writing_since is not None:
            due = self.writing_since + timeouts.client_write
            if now >= due:
                # A write blocks until the kernel has room, which may take far longer than the client takes to
                # read a little: what counts is whether it took anything since the last look.
                taken = self.link.taken() if self.link is not None else None
                if taken is None or taken == self.taken:
                    self._cut(ClientTooSlow(f"the client read nothing for {timeouts.client_write:g} s"))
                    return
                self.taken, self.writing_since = taken, now
                due = now + timeouts.client_write
        elif self.streaming:
            due = self.last_chunk_at + timeouts.between_chunks
            if now >= due:
                self._cut(BackendTimeout(f"the stream stalled for {timeouts.between_chunks:g} s"))
                return
        else:
            due = now + timeouts.client_write
        self._arm(min(due, now + timeouts.client_write))

    def _move_deadline(self, when: float) -> None:
        """The next phase's deadline - unless the request was cut early: the cut arrives at the next await,
        and a phase that began meanwhile must not undo it."""
        if self.cut is None and self.deadline.when() != when:
            self.deadline.reschedule(when)

    def _cut(self, why: GatewayError) -> None:
        """End the request early with `why`: whatever it waits on is cancelled; its cleanup runs in `run`'s
        `finally`. The first reason stands."""
        if self.finished or self.cut is not None:
            return
        self.cut = why
        self.out = None
        if self.deadline is not None and not self.deadline.expired():
            with contextlib.suppress(RuntimeError):  # the deadline's block has just ended
                self.deadline.reschedule(self.loop.time())

    async def _watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left()

    def cut_for_switch(self, reason: str) -> None:
        """A mode switch's drain deadline passed: end the request (an error event and [DONE] if it streams)."""
        self._cut(SwitchUnavailable(reason, code="mode_switch_cut"))

    # -- answers --------------------------------------------------------------------------------------

    async def _tell(self, error: GatewayError) -> None:
        """Tell a client that is still there: an error response, or an error event if the stream began; nothing
        once its response is complete. A client that stopped reading does not get to hold the request open."""
        if self.response_ended:
            return
        if self.link is not None:
            self.link.going()
        try:
            async with asyncio.timeout(LAST_WORDS_TIMEOUT_S):
                if not self.response_started:
                    extra = self._error_headers()
                    if self.body_unread:
                        extra.append((b"connection", b"close"))
                    await send_error(self.send, error, self.request_id, extra)
                    return
                if not self.last_chunk.endswith(DONE):  # a stream that already said [DONE] just ends
                    # Close a half-sent event first, so the error event parses on its own.
                    tail = b"" if self.last_chunk.endswith(EVENT_ENDS) else b"\n\n"
                    event = tail + error_event(error.message, error.type, error.code)
                    await self.send({"type": "http.response.body", "body": event, "more_body": True})
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            pass
        except Exception:  # the last words failed: the request still ends, and is counted, as it was going to
            log.exception("request %s: its error could not be told", self.request_id.decode(errors="replace"))


class Http10Send:
    """HTTP/1.0 clients cannot read chunked encoding (RFC 9112 7.1): their response goes whole, with a length."""

    def __init__(self, send) -> None:
        self.send = send
        self.start: dict | None = None
        self.parts: list[bytes] = []

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            return
        self.parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self.parts)
        framing = (b"content-length", b"transfer-encoding")
        headers = [(name, value) for name, value in self.start["headers"] if name.lower() not in framing]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
