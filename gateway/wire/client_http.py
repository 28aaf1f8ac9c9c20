"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol with bounded request heads, bounded waits,
and a line from the app to the client's connection.

uvicorn (with httptools) takes a request head of any size, for as long as the client likes: 40 connections
each sending an unterminated 8 MiB header took a gateway from 58 to 402 MB. Here:
- a head larger than `max_head_bytes` gets 431: counted as it arrives while it is unfinished (httptools holds an
  unfinished header whole), and as the parser reads it, for a head that arrives whole in one read;
- a head not complete within `head_timeout` of its first byte, and a body not complete within
  `body_timeout` of the end of its head, get 408; a new connection that sends nothing for `head_timeout`
  is closed;
- the parser's own 400s are OpenAI-style JSON too, and every refusal carries an X-Request-Id;
- every refusal is counted (`on_refused(reason)`, one of REFUSALS) and logged at debug only: a fuzzer or a
  port scanner must not fill the log (uvicorn logs each unparsable request as a warning).
A refused connection is closed gracefully: the answer goes out, then what the client still sends is read and
dropped for up to `LINGER_S` (closing with unread input would reset the connection and lose the answer).
The head timer is armed only for a head that did not arrive whole in one read, so the usual request pays for
none; the body timer and uvicorn's keep-alive timer are one per connection, moved only when they fire. Body
sizes are bounded where bodies are read (gateway/request/proxy.py).

Each request's `scope["extensions"][CLIENT_LINK]` is a `ClientLink`: the app sets its `callback` to hear at once
when the client disconnects (under plain ASGI an app learns of it only by awaiting `receive()`, which costs
every request a task of its own), and may `abort()` a connection whose client stopped reading, so neither its
buffers nor its descriptor outlive the request.

A POST whose body is small is held back from uvicorn's task until its body is in, then offered to `direct`
(the gateway's direct lane, gateway/request/inline.py): a request it takes costs no task and no ASGI messages; one it
declines, a body that grows past `DIRECT_MAX_BODY_BYTES`, a client that leaves or is refused first, get their
task as before, with everything that arrived; one that declares a larger body gets its task at once.

    config = uvicorn.Config(app, http=client_protocol(65536, 10.0, 30.0, on_refused=metrics.refused), ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from crossover.gateway.errors import error_body
from crossover.gateway.wire.headers import REQUEST_ID, request_id

if TYPE_CHECKING:
    from crossover.gateway.wire.http1 import Relay

log = logging.getLogger("crossover.client_http")

CLIENT_LINK = "crossover.client_link"
# One piece of a chunked response body as the client reads it: `CHUNK % (len(piece), piece)`.
CHUNK = b"%x\r\n%s\r\n"
# How long a refused connection's further input is read and dropped before it is closed.
LINGER_S = 2.0
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
# Why a request was refused before it reached the app (crossover_client_requests_refused_total{reason}).
INVALID_HTTP = "invalid_http"  # the parser could not read it (400)
HEAD_TOO_LARGE = "head_too_large"  # 431
HEAD_TIMEOUT = "head_timeout"  # 408
BODY_TIMEOUT = "body_timeout"  # 408
REFUSALS = (INVALID_HTTP, HEAD_TOO_LARGE, HEAD_TIMEOUT, BODY_TIMEOUT)
# What uvicorn answers an unparsable request with (here, in an OpenAI-style body).
_UVICORN_INVALID = "Invalid HTTP request received."
# Linux's struct tcp_info: tcpi_bytes_acked is the u64 at offset 120 (since 4.1).
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_BYTES = 256
_BYTES_ACKED_AT = 120
_LITTLE = sys.byteorder == "little"


# uvicorn's internals this module and gateway/serve/server.py build on, by owner: none is public API, so each is
# checked in the installed uvicorn (tests/gateway/wire/test_client_http_uvicorn.py, also at the floor pyproject.toml
# allows). `_start_asgi_task` first exists in 0.45.0; `RequestResponseCycle.keep_alive` says whether the client
# asked to close (its Connection header), which `ClientLink` answers by, from 0.53.0.
UVICORN_INTERNALS: dict[str, tuple[str, ...]] = {
    "httptools_impl": ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle"),
    "HttpToolsProtocol": (
        # what _BoundedHead overrides or calls
        "_start_asgi_task",
        "_should_upgrade",
        "_unsupported_upgrade_warning",
        "handle_websocket_upgrade",
        "on_message_begin",
        "on_headers_complete",
        "on_message_complete",
        "on_response_complete",
        "send_400_response",
        "timeout_keep_alive_handler",
        "shutdown",
        # what it reads and sets
        "loop",
        "transport",
        "parser",
        "flow",
        "client",
        "url",
        "headers",
        "scope",
        "cycle",
        "pipeline",
        "server_state",
        "timeout_keep_alive",
        "timeout_keep_alive_task",
    ),
    "RequestResponseCycle": (
        "scope",
        "flow",
        "body",
        "more_body",
        "message_event",
        "on_response",
        "default_headers",
        "keep_alive",
        "disconnected",
        "waiting_for_100_continue",
        "response_started",
        "response_complete",
        "chunked_encoding",
        "expected_content_length",
        "send",
    ),
    "FlowControl": ("write_paused", "resume_reading"),
    "ServerState": ("total_requests", "connections", "tasks"),
    # gateway/serve/server.py's GatewayServer
    "Server": (
        "capture_signals",
        "_captured_signals",
        "startup",
        "shutdown",
        "servers",
        "server_state",
        "force_exit",
        "lifespan",
    ),
    "config": ("LOGGING_CONFIG",),
}

# The largest body a request may have to be offered to `direct`: one that needs no flow control.
DIRECT_MAX_BODY_BYTES = 32 * 1024
# `direct(scope, body, link)`: True if the app took a request whose body is all here, without an ASGI task.
Direct = Callable[[dict, bytes, "ClientLink"], bool]


def client_protocol(
    max_head_bytes: int,
    head_timeout: float,
    body_timeout: float,
    on_refused: Callable[[str], None] = lambda reason: None,
    direct: Direct | None = None,
    max_body_bytes: int = DIRECT_MAX_BODY_BYTES,
) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these bounds; `on_refused` hears of each refusal;
    `direct` is offered each POST with a small body (at most `DIRECT_MAX_BODY_BYTES` and `max_body_bytes`, the
    app's own limit), once it is all in, before an ASGI task is made for it."""

    class ClientProtocol(_BoundedHead):
        pass

    ClientProtocol.max_head_bytes = max_head_bytes
    ClientProtocol.head_timeout = head_timeout
    ClientProtocol.body_timeout = body_timeout
    ClientProtocol.on_refused = staticmethod(on_refused)
    ClientProtocol.direct = staticmethod(direct) if direct is not None else None
    ClientProtocol.direct_max_body = min(DIRECT_MAX_BODY_BYTES, max_body_bytes)
    return ClientProtocol


class ClientLink:
    """The app's line to its client's connection: `callback` (set by the app) is called once if the client
    disconnects before the response is complete; `respond()` writes a whole response; `abort()` drops the
    connection at once."""

    __slots__ = ("_protocol", "callback", "cycle")

    def __init__(self, protocol: _BoundedHead) -> None:
        self._protocol = protocol
        self.callback: Callable[[], None] | None = None
        self.cycle = None  # uvicorn's request-response cycle of this request (not of one pipelined after it)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._protocol.loop

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a whole response - status line, uvicorn's own headers, `headers` (which carry the length and
        no Connection header), `body` - in one write, ending the request as uvicorn's `send` would end it in
        two: half the syscalls and none of its per-header checks, which a proxied response needs none of (the
        backend's headers passed llhttp's). False, with nothing written, if a response began or the client left.
        """
        cycle = self._begin()
        if cycle is None:
            return False
        parts = self._head(cycle, status, headers)
        parts += (b"\r\n", body)
        self._protocol.transport.write(b"".join(parts))
        self._complete(cycle)
        return True

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes, ended: bool) -> bool:
        """Begin a chunked response - the head as `respond` writes it, then `first` as its first piece (and its
        end, if `ended`) - in one write, where uvicorn's `send` and `write_body` would take two. False, with
        nothing written, if a response began, the client left or its connection asks the writer to wait, or
        the status has no body, or the client speaks HTTP/1.0 (which has no chunked encoding)."""
        cycle = self.cycle
        if cycle is None or cycle.flow.write_paused or status in (204, 304) or cycle.scope["http_version"] == "1.0":
            return False
        cycle = self._begin()
        if cycle is None:
            return False
        cycle.chunked_encoding, cycle.expected_content_length = True, 0
        parts = self._head(cycle, status, headers)
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        if first:
            parts += (b"%x\r\n" % len(first), first, b"\r\n")
        if ended:
            parts.append(b"0\r\n\r\n")
        self._protocol.transport.write(b"".join(parts))
        if ended:
            self._complete(cycle)
        return True

    def _begin(self):
        """uvicorn's cycle of a response that may begin now, marked begun; None if a response began already or
        the client is gone."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or cycle.disconnected or self.going():
            return None
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        return cycle

    @staticmethod
    def _head(cycle, status: int, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        """The status line and header lines as uvicorn writes them (its own headers first), the blank line not."""
        parts = [STATUS_LINE[status]]
        for name, value in itertools.chain(cycle.default_headers, headers):
            parts += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        return parts

    def takes_body(self) -> bool:
        """Whether `write_body` would write now: a chunked response under way, the client there, and its
        connection not asking the writer to wait."""
        cycle = self.cycle
        return not (
            cycle is None
            or not cycle.chunked_encoding
            or cycle.response_complete
            or cycle.disconnected
            or cycle.flow.write_paused
            or self.going()
        )

    def going(self) -> bool:
        """Whether the connection is closing under this request (uvicorn marks only the newest request of a
        pipelined connection disconnected, and a refused one has had its last word): if so the request hears
        that its client is gone, and uvicorn's `send` writes nothing more on it either."""
        cycle, protocol = self.cycle, self._protocol
        transport = protocol.transport
        if cycle is None or (transport is not None and not transport.is_closing() and not protocol._lingering):
            return False
        cycle.disconnected = True
        self.gone()
        return True

    def write_body(self, body: bytes, more_body: bool) -> bool:
        """A piece of a chunked response already started, written at once as uvicorn's `send` would frame it,
        without a coroutine and a message per piece; False, with nothing written, where `send` must decide
        (`takes_body` says which)."""
        if not self.takes_body():
            return False
        cycle = self.cycle
        framed = CHUNK % (len(body), body) if body else b""
        if more_body:
            self._protocol.transport.write(framed)
            return True
        self._protocol.transport.write(framed + b"0\r\n\r\n")
        self._complete(cycle)
        return True

    def relay_out(self, relay: Relay) -> asyncio.WriteTransport | None:
        """The client's transport, for `relay` to write a stream's pieces on as HTTP chunks from the backend
        connection's read callback (gateway/wire/http1.py's `Relay`), while the chunked response this request began
        is under way and the client there; None otherwise. Refusing a request pipelined behind this one takes the
        transport back from the relay at once (its `out`): the refusal is the connection's last word, and the
        transport still takes writes until it closes."""
        cycle, protocol = self.cycle, self._protocol
        transport = protocol.transport
        if (
            cycle is None
            or not cycle.chunked_encoding
            or cycle.response_complete
            or cycle.disconnected
            or transport is None
            or transport.is_closing()
            or protocol._lingering
        ):
            return None
        protocol._relay = relay
        return transport

    def _complete(self, cycle) -> None:
        """The response is out: the request ends as uvicorn's `send` ends it (keep-alive or close, next request)."""
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self._protocol.transport.close()
        cycle.on_response()

    def abort(self) -> None:
        """Reset the connection: what the kernel still holds for the client is dropped, not sent."""
        self.callback = None
        protocol = self._protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:  # without SO_LINGER 0 a close still sends every queued byte, however long it takes
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if protocol.cycle is not None:
            protocol.cycle.disconnected = True  # the app's end is no incomplete response of uvicorn's to report
        transport.abort()

    def taken(self) -> int | None:
        """Bytes the client's TCP stack has acknowledged on this connection - what it really took, however long
        a write blocks for room - or None where the socket cannot say (not TCP, not Linux)."""
        transport = self._protocol.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or _TCP_INFO is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < _BYTES_ACKED_AT + 8:  # a kernel before 4.1
            return None
        return int.from_bytes(info[_BYTES_ACKED_AT : _BYTES_ACKED_AT + 8], "little" if _LITTLE else "big")

    def gone(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


def _client_gone(cycle) -> None:
    """Tell the app of `cycle` (uvicorn's request-response cycle) that its client is gone."""
    link = cycle.scope.get("extensions", {}).get(CLIENT_LINK)
    if link is not None:
        link.gone()


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the parser stops, and uvicorn asks for a 400, which becomes a 431."""


def _declares_more_than(headers: list[tuple[bytes, bytes]], size: int) -> bool:
    """Whether a request head declares a body (Content-Length) larger than `size`; a chunked one declares none."""
    for name, value in headers:
        if name == b"content-length":
            return value.isdigit() and int(value) > size  # llhttp refuses (400) a length that is not digits
    return False


class _BoundedHead(HttpToolsProtocol):
    max_head_bytes = 64 * 1024
    head_timeout = 10.0
    body_timeout = 30.0
    on_refused: Callable[[str], None] = staticmethod(lambda reason: None)
    direct: Direct | None = None
    direct_max_body = DIRECT_MAX_BODY_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # When the connection last went idle (None while a request is under way): what the keep-alive timer reads.
        self._idle_at: float | None = None
        # A POST whose ASGI task waits to see whether `direct` takes it, once its body is in.
        self._feeding = False
        self._reading = 0  # the size of the read being parsed
        self._deferred: tuple | None = None
        # A head's size two ways: bytes received while it is unfinished, and what the parser has read of it.
        self._head_received = self._head_parsed = 0
        self._in_head = self._lingering = False
        self._head_timer: asyncio.TimerHandle | None = None
        # One body timer per connection, moved only when it fires (uvloop's timers cost more to make and cancel
        # than the rest of a request's protocol work): `_body_due` says when the body awaited must be in.
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due: float | None = None
        # The relay writing a stream's pieces on this connection, if one is (`ClientLink.relay_out`): one response
        # at a time is written on a connection.
        self._relay: Relay | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # uvicorn's keep-alive timer starts only after a first response: a connection that never sends a byte
        # would hold its descriptor for ever.
        self._head_timer = self.loop.call_later(self.head_timeout, self._silent_too_long)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The first byte of a request: its head must now be complete in time and in size.
        if self._head_timer is not None:
            self._end_head()
        self._in_head = True
        self._head_received = self._head_parsed = 0

    def _count_head(self) -> None:
        """What the parser read of the head, counted once it is complete: one read holds at most a few hundred
        KiB, and a head arriving over several is bounded as it arrives (`data_received`)."""
        if self._head_received + self._reading <= self.max_head_bytes:
            return  # all it could be is what arrived since it began
        headers = self.headers
        self._head_parsed = len(self.url) + sum(map(len, itertools.chain.from_iterable(headers))) + 4 * len(headers)
        if self._head_parsed > self.max_head_bytes:
            raise _HeadTooLarge

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused: read and drop, so the close does not reset the answer away
            return
        self._idle_at = None
        self._feeding, self._reading = True, len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # counted and logged at debug by the refusal, not warned of as uvicorn does
            self.send_400_response(_UVICORN_INVALID)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        finally:
            self._feeding = False
        if self._deferred is not None:
            self._start_deferred()
        if self._in_head:
            self._head_received += len(data)
            if self._head_received > self.max_head_bytes:
                self._refuse_too_large()
            elif self._head_timer is None:
                # Armed only for a head that did not arrive whole in one read: the usual request costs no timer.
                self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)
        elif self._body_due is None and self.cycle is not None and self.cycle.more_body:
            self._body_due = due = self.loop.time() + self.body_timeout
            if self._body_timer is None:
                self._body_timer = self.loop.call_at(due, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._body_due = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # uvicorn's, but for its keep-alive timer: one per connection, moved only when it fires, where uvicorn
        # makes one per response and cancels it at the next request's first byte.
        self.server_state.total_requests += 1
        self._relay = None
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_at = now = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(now + self.timeout_keep_alive, self._keep_alive_due)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_at is None:  # a request came since: the response that ends it arms the timer again
            return
        due = self._idle_at + self.timeout_keep_alive
        if self.loop.time() < due:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def _start_asgi_task(self, cycle, app) -> None:
        # Called by uvicorn once a request's head is parsed. A POST's small body comes with it or just after:
        # the app may take it whole at the end of a read, with no task, no coroutine and no ASGI messages.
        # (Not one that waits for "100 Continue": uvicorn sends it when the app first asks for the body.)
        # One that declares a larger body gets its task at once: the app refuses one over its limit (413) from
        # the head alone, where waiting for a body that may never come would end in a 408.
        if (
            self._feeding
            and self._deferred is None
            and self.direct is not None
            and cycle.scope["method"] == "POST"
            and not cycle.waiting_for_100_continue
            and not _declares_more_than(cycle.scope["headers"], self.direct_max_body)
        ):
            self._deferred = (cycle, app)
            return
        super()._start_asgi_task(cycle, app)

    def _start_deferred(self) -> None:
        cycle, app = self._deferred
        if cycle.more_body and not cycle.disconnected and len(cycle.body) <= self.direct_max_body:
            return  # the rest of a small body is on its way (clients often write head and body apart)
        self._deferred = None
        scope = cycle.scope
        if (
            cycle.more_body
            or cycle.disconnected
            or not self.direct(scope, bytes(cycle.body), scope["extensions"][CLIENT_LINK])
        ):
            super()._start_asgi_task(cycle, app)  # the app reads the body, all of it or as it comes, from receive()

    def _start_deferred_task(self) -> None:
        """The client left or was refused while its body was coming: the app hears of it as it would have."""
        if self._deferred is not None:
            cycle, app = self._deferred
            self._deferred = None
            super()._start_asgi_task(cycle, app)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._end_head()
        self._count_head()
        link = self.scope.setdefault("extensions", {})[CLIENT_LINK] = ClientLink(self)
        super().on_headers_complete()
        link.cycle = self.cycle

    def connection_lost(self, exc: Exception | None) -> None:
        self._relay = None  # the transport says it is closing, which stops the relay
        self._end_head()
        self._end_body()
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:  # uvicorn leaves it armed after a reset
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        self._start_deferred_task()
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            _client_gone(cycle)
        # A connection's requests refer back to it (their scope's ClientLink; uvicorn's `on_response`, which only
        # a task resets): let go of them, and the connection is freed by reference counting now, not by the
        # cyclic collector, which runs seldom here (server.py's GC_THRESHOLDS): 24 MB over 3,800 connections
        # waited for it. A request still running keeps what it uses.
        self.cycle = self.scope = self.headers = None
        self.pipeline.clear()

    def send_400_response(self, msg: str) -> None:
        if self._head_parsed > self.max_head_bytes:
            self._refuse_too_large()
        else:
            self._refuse(400, msg, "invalid_http_request", INVALID_HTTP)

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _end_body(self) -> None:
        self._body_due = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _silent_too_long(self) -> None:
        self._head_timer = None
        if self.cycle is None and not self._in_head and self.transport is not None:
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._body_timer = None
        due = self._body_due
        if due is None:  # the body came: the next one awaited arms the timer again
            return
        if self.loop.time() < due:  # a later request's body, awaited since the timer was armed
            self._body_timer = self.loop.call_at(due, self._body_too_slow)
            return
        self._body_due = None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            message = f"the request body did not arrive within {self.body_timeout:g} s"
            self._refuse(408, message, "request_timeout", BODY_TIMEOUT)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head:
            message = f"the request head did not arrive within {self.head_timeout:g} s"
            self._refuse(408, message, "request_timeout", HEAD_TIMEOUT)

    def _refuse_too_large(self) -> None:
        message = f"the request head exceeds {self.max_head_bytes} bytes"
        self._refuse(431, message, "request_header_too_large", HEAD_TOO_LARGE)

    def _refuse(self, status: int, message: str, code: str, reason: str) -> None:
        self._end_head()
        self._end_body()
        transport = self.transport
        if transport is None or transport.is_closing() or self._lingering:
            return
        log.debug("refused a request from %s: %s", self.client, message)
        self.on_refused(reason)
        if self._relay is not None:  # a stream under way: nothing more of it goes after the refusal
            self._relay.out = None
            self._relay = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app may be waiting in receive() for the rest of the body: it hears that the client is gone,
            # and whatever it still sends goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
            _client_gone(cycle)
            self._start_deferred_task()
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
            b"%s: %s\r\n\r\n%s"
            % (status, _REASONS[status], len(body), REQUEST_ID, request_id(self.headers or []), body)
        )
        self._lingering = True
        self.flow.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)
