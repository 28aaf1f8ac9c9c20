"""A lean HTTP/1.1 transport for httpx, for the proxy path: `Http1Transport(httpx.Limits(...))`.

    response = await transport.handle_async_request(request)                 # as any httpx transport
    raw = await transport.open("POST", url, headers, body, timeout)          # the proxy path: no httpx models

Why: the gateway (run as gateway/serve/server.py runs it) in front of a zero-work backend, 256 concurrent streams,
one run on 2 shared cores: httpx's default transport (httpcore's pool) 126 req/s, httpx-aiohttp's
AiohttpTransport 1835, this one 3023, SGLang's Rust router 2402. Added latency per non-streamed request at
C=1: +0.48 ms, +0.31, +0.21 and +0.14. It is cheap because nothing sits between the socket and the parser
(httptools), because a body yields everything buffered as one piece (one write downstream per socket read,
not one per HTTP chunk, and no Python call per chunk: llhttp appends to a list), and because the proxy path
(`open`) builds no httpx.Request or httpx.Response.

It keeps a keep-alive pool per (scheme, host, port) under one connection limit, with a bounded wait; never
reuses a connection idle past the expiry (and closes those as traffic passes); speaks http and https; sends
a body whole (a streamed one is read first); reads content-length, chunked and close-delimited responses,
with backpressure and a bounded response head; applies `request.extensions["timeout"]` and raises httpx's
exceptions. Nothing is ever resent: a request whose bytes were written may have reached the backend, whatever
happens next - a close with zero response bytes is also what a backend that read the request and then died
looks like. Instead an idle connection is checked as it is taken from the pool: one the server has already
closed (its EOF waiting unread in the socket) is dropped before anything is written on it, and counted
(`on_stale`). A body not read to the end closes its connection, so the backend sees the disconnect (SGLang
aborts the request).
It does no HTTP/2, proxies, redirects, cookies, auth, decompression, 1xx or Upgrade: a proxy needs none.
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import httptools
import httpx

# httpx's own defaults, so that this is a drop-in for httpx.AsyncHTTPTransport.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
DEFAULT_TIMEOUT = 5.0  # seconds, for any timeout a request leaves out: no socket wait is unbounded
HIGH_WATER = 256 * 1024  # buffered response bytes above which the socket is not read until the consumer catches up
MAX_HEAD_BYTES = 64 * 1024  # a response's status line and headers; more is not a backend we should trust
DEFAULT_PORTS = {"http": 80, "https": 443}
_FRAMING = (b"content-length", b"transfer-encoding")
_VERSIONS = {"1.1": b"HTTP/1.1", "1.0": b"HTTP/1.0"}

Key = tuple[str, str, int]
RawHeaders = list[tuple[bytes, bytes]]
Timeouts = dict[str, float | None]  # httpx's extensions["timeout"]: connect, read, write, pool
MaybeRequest = httpx.Request | None  # only for httpx's exceptions to carry


class Dispatch(Protocol):
    """A request `Http1Transport.dispatch` wrote, whose whole answer its caller awaits from the connection's own
    callbacks (no task): once settled, `answer()` or `error`, then `release()`; `cancel()` to give up first."""

    error: tuple[type[httpx.TransportError], str] | None

    def answer(self) -> tuple[int, RawHeaders, bytes]: ...

    def release(self) -> None:
        """Once settled: the connection back to its pool (kept if the server keeps it open, else closed)."""

    def close(self) -> None:
        """Once expired: closed (the backend hears it; SGLang aborts the request)."""

    def cancel(self) -> None:
        """Give up before either callback: neither is called, and the connection closes (the backend hears it)."""


class Relay(Protocol):
    """What `pump` hands a streamed body's pieces to from the connection's read callback itself, while its task
    waits (gateway/request/proxy.py's Exchange is one). While `out` (the client's transport) is set, a piece that ends
    with one of `ends` and holds no `mark` is written to it as `frame % (len(piece), piece)`, framed as the client's
    connection frames a piece (an HTTP/1.1 chunk: gateway/wire/client_http.py's CHUNK) - if it is not closing and holds
    no unsent bytes - then recorded in `previous_chunk`, `last_chunk` and `last_chunk_at` (event-loop time); any
    other piece wakes the task, which delivers it after whatever came before. `out` is None whenever a piece must not
    skip its task: the request is ending, part of an event is held back, the client's connection refused a
    request behind it.

    The relay is plain data read in the read callback, not a method called: a stream pays one Python call per
    token, the callback (loadtest/proxybench/RESULTS.md)."""

    out: asyncio.WriteTransport | None
    frame: bytes
    ends: tuple[bytes, ...]
    mark: bytes
    previous_chunk: bytes
    last_chunk: bytes
    last_chunk_at: float


class Target:
    """A URL as `open` sends to it, parsed once: its pool key (None: not http or https), request target and Host
    line. httpx.URL's properties are parsed again on every access; the proxy path keeps one per backend and
    path (gateway/request/failover.py)."""

    __slots__ = ("host_line", "key", "path", "url")

    def __init__(self, url: httpx.URL) -> None:
        port = url.port or DEFAULT_PORTS.get(url.scheme)
        self.url = url
        self.key: Key | None = None if port is None else (url.scheme, url.host, port)
        self.path = url.raw_path
        self.host_line = b"Host: %s\r\n" % url.netloc


class Http1Transport(httpx.AsyncBaseTransport):
    """A keep-alive HTTP/1.1 connection pool; `limits` mean what they mean to httpx.AsyncHTTPTransport."""

    def __init__(
        self,
        limits: httpx.Limits = DEFAULT_LIMITS,
        *,
        ssl_context: ssl.SSLContext | None = None,
        on_stale: Callable[[], None] = lambda: None,
    ) -> None:
        self._on_stale = on_stale
        self._max = limits.max_connections if limits.max_connections is not None else float("inf")
        self._max_idle = limits.max_keepalive_connections if limits.max_keepalive_connections is not None else self._max
        self._expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else float("inf")
        self._ssl = ssl_context
        self._conns: set[_Connection] = set()  # open ones, idle or busy
        self._connecting = 0
        self._idle: dict[Key, dict[_Connection, None]] = {}  # ordered sets, longest idle first
        self._idle_count = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()  # a streamed body is read whole: this proxy's bodies are small JSON
        timeout = request.extensions.get("timeout", {})
        raw = await self.open(request.method, request.url, request.headers.raw, body, timeout, request)
        return httpx.Response(
            raw.status_code,
            headers=raw.headers,
            stream=raw.stream,
            extensions={"http_version": raw.http_version, "reason_phrase": raw.reason_phrase},
        )

    async def open(
        self,
        method: str,
        url: httpx.URL | Target,
        headers: RawHeaders,
        body: bytes,
        timeout: Timeouts,
        request: MaybeRequest = None,
    ) -> RawResponse:
        """The proxy path's entry: no httpx.Request or httpx.Response to build (their header normalisation costs
        more than the rest of the transport). Raises httpx's exceptions, with `request` when one is given."""
        target = url if type(url) is Target else Target(url)
        if target.key is None:
            raise httpx.UnsupportedProtocol(
                f"Http1Transport speaks http and https, not {target.url.scheme!r}", request=request
            )
        read_timeout = timeout.get("read", DEFAULT_TIMEOUT)
        data = _encode(method, target, headers, body, request) + body  # one segment for the usual small request
        conn = await self._acquire(target.key, timeout, request)
        conn.begin(head_only=method == "HEAD")
        try:
            await conn.send(data, timeout.get("write", DEFAULT_TIMEOUT), request)
            while not conn.head_done:
                await conn.wait(read_timeout, httpx.ReadTimeout, request)
        except BaseException:  # failed, or cancelled (the caller is gone, so the request must go too)
            self.release(conn)
            raise
        return RawResponse(
            conn.parser.get_status_code(),
            conn.headers,
            _Body(self, conn, request, read_timeout),
            _VERSIONS.get(conn.parser.get_http_version(), b"HTTP/1.1"),
            conn.reason,
        )

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._conns):
            conn.close()
        while self._waiters:  # they wake to find the transport closed
            _resolve(self._waiters.popleft())

    async def _acquire(self, key: Key, timeout: dict, request: MaybeRequest) -> _Connection:
        loop = None  # asked for only when no idle connection is there: asyncio.get_running_loop() is a getpid()
        woken = False
        while True:
            if self._closed:
                raise httpx.ConnectError("the transport is closed", request=request)
            conn = self._take_idle(key)
            if conn is not None:
                return conn
            if loop is None:
                loop = asyncio.get_running_loop()
                pool_timeout = timeout.get("pool", DEFAULT_TIMEOUT)
                deadline = None if pool_timeout is None else loop.time() + pool_timeout
            if len(self._conns) + self._connecting < self._max or self._evict_oldest():
                return await self._connect(key, timeout.get("connect", DEFAULT_TIMEOUT), request, loop)
            waiter = loop.create_future()
            # A waiter woken only to lose the race to a newcomer keeps its place at the front.
            (self._waiters.appendleft if woken else self._waiters.append)(waiter)
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await _bounded(loop, waiter, remaining, httpx.PoolTimeout, "no connection became free", request)
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake_one()  # woken and cancelled at once: pass the wakeup on rather than lose it
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
            woken = True

    def _take_idle(self, key: Key) -> _Connection | None:
        """An idle connection to `key` that can carry a request, or None."""
        idle = self._idle.get(key)
        while idle:
            conn, _ = idle.popitem()  # the most recently used: the least likely to be closed by now
            self._idle_count -= 1
            if conn.loop.time() - conn.idle_since >= self._expiry:  # (a closed one has left the pool already)
                conn.close()
            elif conn.closed_by_server():
                conn.close()
                self._on_stale()
            else:
                return conn
        return None

    def dispatch(
        self,
        target: Target,
        headers: RawHeaders,
        body: bytes,
        settled: Callable[[Dispatch], None],
        due: float,
        expired: Callable[[Dispatch], None],
    ) -> Dispatch | None:
        """POST `body` on an idle connection at once, if one is there (else None, with nothing sent), with `headers`
        as gateway/wire/headers.py's `request_headers` makes them: no Host or framing among them. Then one
        of two is called once, from the connection's own callbacks: `settled(conn)` when the whole response is
        in (`conn.answer()`) or the connection failed (`conn.error`), after which the caller gives it back with
        `conn.release()`; or `expired(conn)` if neither happened by `due` (event-loop time), after which the
        caller closes it. A caller that gives up first calls `conn.cancel()`."""
        if self._closed or target.key is None:
            return None
        conn = self._take_idle(target.key)
        if conn is None:
            return None
        conn.begin(head_only=False)
        conn.settled, conn.expired = settled, expired
        conn.transport.write(_head("POST", target, headers, len(body), False, None) + body)
        conn._bound(due)
        return conn

    async def _connect(self, key: Key, timeout: float | None, request: MaybeRequest, loop) -> _Connection:
        scheme, host, port = key
        tls = scheme == "https"
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        # Made here, not by the event loop's call of a factory, so that one that never opens (refused, timed out,
        # or its request gone meanwhile) can be let go of too (`abandon`).
        conn = _Connection(self, key, loop)
        opened = False
        self._connecting += 1
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: conn,
                    host,
                    port,
                    ssl=self._ssl if tls else None,
                    server_hostname=host if tls else None,
                )
            opened = True
        except TimeoutError:  # before OSError, which it is
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}", request=request) from exc
        finally:
            self._connecting -= 1
            if not opened:
                conn.abandon()
                self._wake_one()
        if self._closed or conn.closed:
            conn.close()
            self._wake_one()
            raise httpx.ConnectError(f"the connection to {host}:{port} closed as it opened", request=request)
        self._conns.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """Pooled if the whole response arrived and the server keeps the connection open; closed otherwise."""
        if not (conn.complete and conn.keep_alive and not conn.closed and self._idle_count < self._max_idle):
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        idle = self._idle.setdefault(conn.key, {})
        idle[conn] = None
        self._idle_count += 1
        oldest = next(iter(idle))  # expire as traffic passes; servers close the ones left behind themselves
        if conn.idle_since - oldest.idle_since >= self._expiry:
            oldest.close()
        if self._waiters:
            self._wake_one()

    def _forget(self, conn: _Connection) -> None:
        """`conn` has closed, from either side: its slot is free."""
        if conn in self._conns:
            self._conns.remove(conn)
            idle = self._idle.get(conn.key)
            if idle is not None and conn in idle:
                del idle[conn]
                self._idle_count -= 1
            self._wake_one()

    def _evict_oldest(self) -> bool:
        """Close the longest-idle connection, to any host, to make room; False if none is idle."""
        oldest = [next(iter(idle)) for idle in self._idle.values() if idle]
        if oldest:
            min(oldest, key=lambda conn: conn.idle_since).close()
        return bool(oldest)

    def _wake_one(self) -> None:
        while self._waiters and not _resolve(self._waiters.popleft()):
            pass


class _Connection(asyncio.Protocol):
    """One socket and its response parser, carrying one request at a time."""

    def __init__(self, pool: Http1Transport, key: Key, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.key, self.loop = pool, key, loop
        # llhttp calls on_body once per HTTP chunk - once per token of a stream: a bare list append, with the
        # bookkeeping done once per socket read (data_received). One list for the connection's life.
        self.chunks: list[bytes] = []
        self.on_body = self.chunks.append
        # llhttp reads one response after another; closed, what it read (connection_lost).
        self.parser: httptools.HttpResponseParser | _Ended = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = self.busy = self.writing_paused = self.head_only = False
        self.idle_since = 0.0
        # Plain TCP only: what closed_by_server looks at, a poll set of this one socket. poll(0) on it costs a
        # third of what select.select((fd,), (), (), 0) costs (no fd_set or lists to build per call).
        self.poller: select.poll | None = None
        self.waiter: asyncio.Future | None = None
        # While `pump` waits: where the pieces a read brings go on, from the read's own callback (`Relay`).
        self.relay: Relay | None = None
        # A request sent by `dispatch`, with no task waiting: told once its response is whole or has failed.
        self.settled: Callable[[_Connection], None] | None = None
        self.expired: Callable[[_Connection], None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # bounds the current wait (`wait_due`)
        self.wait_due = 0.0
        self.wait_timeout: float | None = None
        self.wait_for: tuple[type[httpx.TimeoutException], MaybeRequest] = (httpx.ReadTimeout, None)

    def begin(self, head_only: bool) -> None:
        """Fresh response state, before a request goes out."""
        self.busy, self.head_only, self.keep_alive = True, head_only, True
        self.head_done = self.complete = self.received = self.reading_paused = False
        self.error: tuple[type[httpx.TransportError], str] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.reason = b""
        self.chunks.clear()
        self.buffered = 0

    async def send(self, data: bytes, timeout: float | None, request: MaybeRequest) -> None:
        self.transport.write(data)
        while self.writing_paused:
            await self.wait(timeout, httpx.WriteTimeout, request)

    async def wait(self, timeout: float | None, kind: type[httpx.TimeoutException], request: MaybeRequest) -> None:
        """Until the parser or the socket has news, or `timeout` passes (then `kind`); raises what broke it."""
        if self.error is not None:
            raise self.error[0](self.error[1], request=request)
        self.waiter = waiter = self.loop.create_future()
        self.wait_timeout = timeout
        if timeout is not None:
            self.wait_for = (kind, request)
            self._bound(self.loop.time() + timeout)
        await waiter

    def _bound(self, due: float) -> None:
        """The current wait ends at `due`. One timer per connection, moved only when it fires: a stream waits
        once per piece, and a timer made and cancelled per piece (or per request) costs more than its own
        bookkeeping."""
        self.wait_due = due
        if self.timer is None or self.timer.when() > due:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(due, self._wait_timer)

    def _wait_timer(self) -> None:
        self.timer = None
        waiter = self.waiter
        if (waiter is None or waiter.done()) and self.settled is None:  # nobody waits: the next wait arms it
            return
        due = self.wait_due
        relay = self.relay
        if relay is not None and self.wait_timeout is not None:  # what it took on counts, and it keeps its own time
            due = max(due, relay.last_chunk_at + self.wait_timeout)
        if self.loop.time() < due:  # waiting again since it was armed, or a relay took a piece since
            self.timer = self.loop.call_at(due, self._wait_timer)
            return
        if waiter is None or waiter.done():  # `dispatch`'s answer is late: its sender decides what that means
            expired, self.settled, self.expired = self.expired, None, None
            expired(self)
            return
        self.waiter = None
        kind, request = self.wait_for
        waiter.set_exception(kind("timed out waiting for the server", request=request))

    def take(self) -> bytes:
        """Everything buffered, as one piece."""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.reading_paused:
            self._resume_reading()
        return data

    def closed_by_server(self) -> bool:
        """Whether this idle connection has something to read - an EOF or a reset not yet delivered by the
        event loop, or bytes nobody asked for: either way it cannot carry a request. One poll of the socket,
        for a close that crossed the pool's last look. (Not under TLS, whose records may come unasked.)"""
        if self.poller is None:
            return False
        try:
            return bool(self.poller.poll(0))  # readable, hung up, in error, or not a descriptor (POLLNVAL)
        except OSError:
            return True

    def answer(self) -> tuple[int, RawHeaders, bytes]:
        """A whole response's status, headers and body."""
        return self.parser.get_status_code(), self.headers, self.take()

    def release(self) -> None:
        self.pool.release(self)

    def cancel(self) -> None:
        self.settled = self.expired = None
        self.close()

    def close(self) -> None:
        if not self.closed:
            if self.busy:
                self._fail(httpx.ReadError, "the connection was closed on this side")
            self.closed = True
            self.transport.close()
            self.pool._forget(self)

    def _fail(self, kind: type[httpx.TransportError], message: str) -> None:
        if self.error is None:
            self.error = (kind, message)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None:
            _resolve(self.waiter)
            self.waiter = None
        elif self.settled is not None and (self.complete or self.error is not None):
            settled, self.settled, self.expired = self.settled, None, None
            settled(self)

    def _resume_reading(self) -> None:
        if self.reading_paused and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport  # with TCP_NODELAY: asyncio and uvloop both set it (no 40 ms Nagle stalls)
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.received = True
        chunks = self.chunks
        before = len(chunks)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.busy:
                self._fail(httpx.RemoteProtocolError, f"malformed response: {exc}")
            self.close()  # bytes nobody asked for (junk, a 408 before an idle close) are out of step too
            return
        if len(chunks) == before:
            return
        # A piece of a body still under way, with nothing buffered before it (that would go out of order): written
        # on here and now if the relay takes it - a stream's every token costs this one Python call.
        relay = self.relay
        out = None if relay is None else relay.out
        if out is not None and not before and self.busy:
            piece = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if (
                piece.endswith(relay.ends)
                and piece.find(relay.mark) < 0
                and not out.is_closing()
                and not out.get_write_buffer_size()  # a client behind: its task waits for it to catch up
            ):
                out.write(relay.frame % (len(piece), piece))
                chunks.clear()
                relay.previous_chunk, relay.last_chunk = relay.last_chunk, piece
                relay.last_chunk_at = self.loop.time()  # the wait's bound runs from here (`_wait_timer`)
                return
        if self.head_only:  # a body after a HEAD response: out of step, like junk
            chunks.clear()
            self.close()
            return
        self.buffered += len(data)  # framing included: a high-water mark need not be exact
        # A response that completed in this read stays readable: its connection may go back to the pool. One
        # that `dispatch` sent is read whole, as `aread` would read it: nothing takes its pieces before the end.
        if self.buffered > HIGH_WATER and self.busy and not self.reading_paused and self.settled is None:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.busy and self.error is None:
            if self.head_done and not self._framed() and exc is None:  # a close-delimited body ends here
                self.busy, self.complete, self.keep_alive = False, True, False
            elif not self.received:
                self._fail(httpx.RemoteProtocolError, "the server closed the connection without a response")
            elif exc is not None:
                self._fail(httpx.ReadError, f"the connection broke mid-response: {exc}")
            else:
                self._fail(httpx.RemoteProtocolError, "the server closed the connection mid-response")
        self._wake()
        self.pool._forget(self)
        self.unhook()

    def abandon(self) -> None:
        """Never opened: closed and unhooked, from its transport too - which refers back to it, and which uvloop
        closes without a connection_lost when the connecting request goes first."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.unhook()

    def unhook(self) -> None:
        """Once closed, or never opened: the parser lets go of this connection's callbacks. The two form a
        reference cycle that only the cyclic collector frees, and it runs seldom here (gateway/serve/server.py's
        GC_THRESHOLDS): every backend connection an aborted stream closed held its ~5 KB until then (RSS grew
        4.7 KB per aborted stream). What may still be asked of the parser (the status and version of a response
        in) is kept, so the connection is freed by reference counting once let go."""
        parser = self.parser
        self.parser = _Ended(parser.get_status_code(), parser.get_http_version(), parser.should_keep_alive())

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if not self.busy:
            raise ValueError("a response nobody asked for")

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > MAX_HEAD_BYTES:
            raise ValueError(f"a response head over {MAX_HEAD_BYTES} bytes")  # the parser fails the response
        self.headers.append((name, value))

    def _framed(self) -> bool:
        """Whether the response says where its body ends (else the close does): asked only at a close."""
        return any(name.lower() in _FRAMING for name, _ in self.headers)

    def on_headers_complete(self) -> None:
        self.head_done = True
        if self.head_only:  # the parser cannot tell that a HEAD response has no body, nor where the next begins
            self.busy, self.complete, self.keep_alive = False, True, False
            self._wake()
        elif self.waiter is not None:  # (a request `dispatch` sent waits for the whole response)
            self._wake()

    def on_message_complete(self) -> None:
        self.busy, self.complete = False, True
        self.keep_alive = self.keep_alive and self.parser.should_keep_alive()
        if self.reading_paused:  # it may go back to the pool with its last bytes still unread
            self._resume_reading()
        self._wake()


@dataclass(frozen=True, slots=True)
class _Ended:
    """What a closed connection's parser still answers (`_Connection.connection_lost`)."""

    status_code: int
    http_version: str
    keep_alive: bool

    def get_status_code(self) -> int:
        return self.status_code

    def get_http_version(self) -> str:
        return self.http_version

    def should_keep_alive(self) -> bool:
        return self.keep_alive

    def feed_data(self, data: bytes) -> None:
        raise httptools.HttpParserError("the connection is closed")


@dataclass(slots=True)
class RawResponse:
    """A response as `Http1Transport.open` returns it: the status, the headers as received, the body stream.
    Its body must be read to the end (`aread`, or iterating `stream`) or closed (`aclose`)."""

    status_code: int
    headers: RawHeaders
    stream: httpx.AsyncByteStream
    http_version: bytes = b"HTTP/1.1"
    reason_phrase: bytes = b""

    async def aread(self) -> bytes:
        parts: list[bytes] = []
        await pump(self.stream, lambda piece, ended: parts.append(piece))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def ended(self) -> bool:
        """Whether the body has been read to its end: what the last read gave was all there is. (A stream of
        another transport cannot tell, and says False.)"""
        return getattr(self.stream, "ended", False)

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Body(httpx.AsyncByteStream):
    """A response body. Read to the end, its connection goes back to the pool; otherwise it is closed."""

    def __init__(self, pool: Http1Transport, conn: _Connection, request: MaybeRequest, timeout: float | None):
        self._pool, self._conn, self._request, self._timeout = pool, conn, request, timeout

    # An iterator, not an async generator: no asyncgen hooks to run per response, nothing left to finalise
    # when a consumer stops early (it closes the body instead).
    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        try:
            while not conn.chunks:
                if conn.complete:
                    self._done()
                    raise StopAsyncIteration
                await conn.wait(self._timeout, httpx.ReadTimeout, self._request)
        except StopAsyncIteration:
            raise
        except BaseException:  # cancellation, errors: the connection cannot be reused
            self._done()
            raise
        data = conn.take()
        if conn.complete:  # the last piece: the connection can serve another request meanwhile
            self._done()
        return data

    @property
    def ended(self) -> bool:
        return self._conn is None

    async def aclose(self) -> None:
        self._done()

    def _done(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None


async def pump(
    chunks: AsyncIterator[bytes],
    deliver: Callable[[bytes, bool], Awaitable[None] | None],
    relay: Relay | None = None,
) -> None:
    """A response body to its end through `deliver(piece, ended)`, which returns None once the piece is out, or
    an awaitable that sends it. On this transport, while the task waits, each piece that is not the last and has
    nothing still buffered ahead of it goes to `relay` from the connection's read callback itself (`Relay`);
    what the relay does not take goes to `deliver` (from the waiting task, in order). So while the client keeps
    up, a stream's pieces cost no task wake-up each. Any other body (another transport's) is iterated, its end
    delivered as an empty last piece.
    """
    if type(chunks) is not _Body:
        async for piece in chunks:
            sending = deliver(piece, False)
            if sending is not None:
                await sending
        sending = deliver(b"", True)
        if sending is not None:
            await sending
        return
    body: _Body = chunks
    conn = body._conn
    if conn is None:
        return
    try:
        while True:
            if conn.chunks or conn.complete:
                ended = conn.complete
                piece = conn.take()
                if ended:
                    body._done()
                sending = deliver(piece, ended)
                if sending is not None:
                    await sending
                if ended:
                    return
                continue
            conn.relay = relay
            try:
                await conn.wait(body._timeout, httpx.ReadTimeout, body._request)
            finally:
                conn.relay = None
    except BaseException:  # cancelled or failed: the connection cannot be reused
        body._done()
        raise


def _encode(method: str, target: Target, headers: RawHeaders, body: bytes, request: MaybeRequest) -> bytes:
    """The request head, the headers as given but for framing: the body goes whole, after a Content-Length."""
    kept = []
    has_host = False
    for name, value in headers:
        lowered = name.lower()
        if lowered not in _FRAMING:
            kept.append((name, value))
            has_host = has_host or lowered == b"host"
    return _head(method, target, kept, len(body), has_host, request)


def _head(
    method: str, target: Target, headers: RawHeaders, length: int, has_host: bool, request: MaybeRequest
) -> bytes:
    """The request head of `headers` as they are, none of them framing; Host from `target` unless `has_host`."""
    host = b"" if has_host else target.host_line
    framing = b"Content-Length: %d\r\n" % length if length or method in ("POST", "PUT", "PATCH") else b""
    lines = b"".join([b"%s: %s\r\n" % header for header in headers])
    head = b"%s %s HTTP/1.1\r\n%s%s%s\r\n" % (method.encode("ascii"), target.path, host, lines, framing)
    # Every line ends in a CRLF added here: a CR or LF inside a header would smuggle in another.
    count = len(headers) + 2 + (not has_host) + (framing != b"")
    if head.count(b"\n") != count or head.count(b"\r") != count:
        raise httpx.LocalProtocolError("a request header contains CR or LF", request=request)
    return head


async def _bounded(loop, future: asyncio.Future, timeout: float | None, kind, message: str, request) -> None:
    """Await `future`, failing it with kind(message) after `timeout` s. A timer handle is cheaper than a task."""
    if timeout is None:
        await future
        return
    timer = loop.call_later(timeout, _expire, future, kind, message, request)
    try:
        await future
    finally:
        timer.cancel()


def _expire(future: asyncio.Future, kind, message: str, request: MaybeRequest) -> None:
    if not future.done():
        future.set_exception(kind(message, request=request))


def _resolve(future: asyncio.Future) -> bool:
    if future.done():
        return False
    future.set_result(None)
    return True
