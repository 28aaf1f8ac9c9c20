"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol with a bounded request head, and word
of a client that leaves.

uvicorn (with httptools) takes a request head of any size, for as long as the client likes: 40 connections
each sending an unterminated 8 MiB header took a gateway from 58 to 402 MB. Here a head larger than
`max_head_bytes` gets 431, a head not complete within `head_timeout` (from its first byte) and a body not
complete within `body_timeout` (from the end of its head) get 408, and the connection closes; the parser's
own 400s are OpenAI-style JSON too. Timers are armed only for a request that did not arrive whole in one
read, so the usual request pays for none. Body sizes are bounded where bodies are read (gateway/proxy.py).

A client that disconnects before its response is complete is reported to the app through the request's
`scope["extensions"][CLIENT_GONE]` (a `ClientGone` whose `callback` the app sets): under plain ASGI an app
learns of it only by awaiting `receive()`, which costs every request a task of its own.

    config = uvicorn.Config(app, http=client_protocol(65536, head_timeout=10.0, body_timeout=30.0), ...)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from crossover.gateway.errors import error_body

log = logging.getLogger("crossover.client_http")

CLIENT_GONE = "crossover.client_gone"
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def client_protocol(max_head_bytes: int, head_timeout: float, body_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these bounds."""

    class ClientProtocol(_BoundedHead):
        pass

    ClientProtocol.max_head_bytes = max_head_bytes
    ClientProtocol.head_timeout = head_timeout
    ClientProtocol.body_timeout = body_timeout
    return ClientProtocol


class ClientGone:
    """`callback` (set by the app) is called once if the client disconnects before the response is complete."""

    __slots__ = ("callback",)

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None


class _BoundedHead(HttpToolsProtocol):
    max_head_bytes = 64 * 1024
    head_timeout = 10.0
    body_timeout = 30.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The first byte of a request: its head must now be complete in time and in size.
        self._end_head()
        self._in_head = True
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, f"the request head exceeds {self.max_head_bytes} bytes", "request_header_too_large")
            elif self._head_timer is None:
                # Armed only for a head that did not arrive whole in one read: the usual request costs no timer.
                self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)
        elif self._body_timer is None and self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._end_body()
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._end_head()
        self.scope.setdefault("extensions", {})[CLIENT_GONE] = ClientGone()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        self._end_body()
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            gone = cycle.scope.get("extensions", {}).get(CLIENT_GONE)
            if gone is not None and gone.callback is not None:
                callback, gone.callback = gone.callback, None
                callback()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "invalid_http_request")

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _end_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            # The app waits in receive() for the rest; closing tells it the client is gone.
            self._refuse(408, f"the request body did not arrive within {self.body_timeout:g} s", "request_timeout")

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(408, f"the request head did not arrive within {self.head_timeout:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._end_head()
        if self.transport is None or self.transport.is_closing():
            return
        log.info("refused a request from %s: %s", self.client, message)
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()
