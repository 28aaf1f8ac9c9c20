"""The inline lane: a non-streamed generation request with nothing to wait for, served from callbacks alone.

The usual non-streamed request has its small body in by the end of a read or two, finds a request slot free,
its backend usable and an idle pooled connection to it, and gets a whole answer. For it, the client's read
callback checks the key, parses the body, routes and writes the request to the backend
(`InlineExchange.offer`); the backend connection's read callback, once the answer is whole, writes the
client's response in one write and accounts for the request. There is no ASGI task, coroutine chain, deadline
context or timer per request (the deadline rides on the backend connection's one timer): with the rest of
that change, a third less CPU per non-streamed request than the ordinary path (loadtest/proxybench/RESULTS.md).

Everything else goes the ordinary way (gateway/request/proxy.py), decided before anything is sent: a stream, a body
still arriving, an error to answer, a queue to wait in, a connection to make, the time-shared topology,
another ASGI server or transport. The lane is the callbacks' driver of the request's steps
(gateway/request/lifecycle.py), not a second sequence of them: once it takes a request slot, the request is the lane's,
and it ends exactly as `Exchange` would, on the same rules and with the same words: a failure that may fail over is
handed, with all the request holds, to an ordinary coroutine that goes on from the next backend (`Request.hand_over`,
`Exchange.carry_on`); a deadline, a client that leaves and a shutdown cut the
backend connection and answer at once; a step that raises is answered by `_fault`, every callback's guard. A
request here is in `Live.requests`, holds its slot and its backend's lease like any other, and is accounted for
once, by `Request.end`.
"""

from __future__ import annotations

import asyncio
import logging

from crossover.gateway.backends import Backend
from crossover.gateway.errors import (
    ClientGone,
    GatewayError,
    error_answer,
)
from crossover.gateway.request.failover import Failure, classify_error, classify_response
from crossover.gateway.request.failover import endpoint as backend_target
from crossover.gateway.request.lifecycle import Request, check_body, check_head, first_wait_s, no_answer_in_time
from crossover.gateway.request.proxy import PARSED, Exchange, ProxyEndpoint
from crossover.gateway.request.validation import Generation
from crossover.gateway.tracing import Tracing
from crossover.gateway.wire import ClientLink, Dispatch, Http1Transport, request_headers, request_id

log = logging.getLogger("crossover.proxy")


class InlineExchange(Request):
    """One request driven from the client's and the backend's read callbacks (the steps and the guard that
    accounts for it: gateway/request/lifecycle.py)."""

    __slots__ = ("backend", "body", "carry", "conn", "cut", "loop", "reason", "route_pool", "scope", "total_due")
    endpoint: ProxyEndpoint  # the lifecycle's `Endpoint`, as this driver's path has it

    def __init__(self, endpoint: ProxyEndpoint, scope, request_id: bytes, link: ClientLink) -> None:
        super().__init__(endpoint, request_id, link)
        self.scope = scope
        self.loop = link.loop
        self.conn: Dispatch | None = None  # the backend's answer while it is awaited
        self.backend: Backend | None = None
        self.route_pool = self.reason = ""
        self.body = b""
        self.total_due = 0.0
        self.cut: GatewayError | None = None  # why the request was cut short (the first reason stands)
        self.carry: asyncio.Task | None = None  # the coroutine the request was handed to, if it was

    @classmethod
    def offer(cls, endpoint: ProxyEndpoint, scope, body: bytes, link: ClientLink) -> bool:
        """Send the request to its backend now, if nothing has to wait: True once it is the lane's (sent, or
        answered), False (with nothing done) to leave the request to the ordinary path."""
        sender = endpoint.failover.sender
        if (
            type(sender) is not Http1Transport
            or not endpoint.topology.direct_lane
            or scope.get("http_version") == "1.0"
            or len(body) > endpoint.settings.limits.max_body_bytes
        ):
            return False
        try:
            check_head(endpoint, scope["headers"])
            generation = check_body(endpoint, body, scope["headers"])
            if not generation.stream and cls._send(endpoint, scope, body, link, sender, generation):
                return True
        except Exception:  # before a slot was taken: answered (or logged) the ordinary way
            return False
        scope[PARSED] = (body, generation)  # for the ordinary way
        return False

    @classmethod
    def _send(
        cls,
        endpoint: ProxyEndpoint,
        scope,
        body: bytes,
        link: ClientLink,
        sender: Http1Transport,
        generation: Generation,
    ) -> bool:
        """admit, route, choose and send, if none of them has to wait: True once the request is the lane's."""
        tier = generation.tier
        pool, reason = endpoint.route(tier)
        # Only looked at until the request is sent: if it goes the ordinary way, that way chooses the same.
        backend = endpoint.failover.choose(pool, set(), turn=False)
        if backend is None:
            return False
        exchange = cls(endpoint, scope, request_id(scope["headers"]), link)
        exchange.tier = tier
        if not endpoint.admission.take_free():
            return False
        exchange.admitted = True  # from here on the request is the lane's, and `end` accounts for it
        try:
            headers = request_headers(scope["headers"], exchange.request_id, backend.api_key)
            if endpoint.tracing is not None:
                headers = exchange._traced(endpoint.tracing, generation, pool, reason, headers, backend)
            # The deadlines `Exchange` keeps: the whole answer within `non_stream` (else `total`), all within `total`.
            timeouts, now = endpoint.settings.timeouts, exchange.loop.time()
            due = now + first_wait_s(timeouts, stream=False)
            target = backend_target(backend.url, endpoint.target(scope))
            exchange.conn = sender.dispatch(target, headers, body, exchange._settled, due, exchange._timed_out)
            if exchange.conn is None:  # no idle connection: the ordinary way makes one
                exchange.admitted = False
                endpoint.admission.release()
                return False
            endpoint.pools.turn()
            exchange._dispatched(backend, pool, reason, body, now + timeouts.total)
        except Exception:
            exchange._fault()
        return True

    def _traced(
        self, tracing: Tracing, generation: Generation, pool: str, reason: str, headers: list, backend: Backend
    ) -> list[tuple[bytes, bytes]]:
        """Tracing is on: the request's server span, its routing decision, and `headers` with the attempt's
        `traceparent`. (Should the lane give the request up after all, the ordinary way traces it afresh.)"""
        trace = self.trace = tracing.request(self.scope, self.started)
        trace.checked(generation.model, generation.tier)
        trace.routed(pool, reason, self.endpoint.topology.trace_view())
        return trace.attempt(headers, backend.url, backend.pool)

    def _dispatched(self, backend: Backend, pool: str, reason: str, body: bytes, total_due: float) -> None:
        endpoint = self.endpoint
        self.lease = endpoint.pools.lease(backend)
        self.backend, self.route_pool, self.reason = backend, pool, reason
        self.pool = pool  # until the backend answers: where the request was headed
        self.body, self.total_due = body, total_due
        endpoint.live.requests.add(self)
        self.link.callback = self._client_left

    # -- the backend's side ---------------------------------------------------------------------------

    def _settled(self, conn: Dispatch) -> None:
        """The backend's answer is whole, or its connection failed (the connection's callback): `_settle`, guarded."""
        try:
            self._settle(conn)
        except Exception:
            self._fault()

    def _settle(self, conn: Dispatch) -> None:
        backend = self.backend
        self.conn = None
        if conn.error is not None:
            kind, message = conn.error
            conn.release()  # closed: it failed
            self._backend_failed(classify_error(kind(message), backend.pool))
            return
        status, headers, body = conn.answer()
        if self.trace is not None:
            self.trace.answered(status)
        failure = classify_response(status, body, False, backend.pool, headers)
        if failure is not None:
            conn.release()
            self._backend_failed(failure)
            return
        self.pool = backend.pool
        answer = self._whole(status, headers, body)
        conn.release()  # pooled again if the server keeps it open
        self.response_ended = self.link.respond(*answer)
        endpoint = self.endpoint
        endpoint.failover.answered(backend, status)
        self.routed(self.route_pool, self.reason)
        self.end(self.usage(body) if status == 200 else 0)

    def _backend_failed(self, failure: Failure) -> None:
        """The backend failed the request before the client saw a byte: handed to a coroutine that goes on from the
        next backend if the failure allows, else the error it ends with."""
        self.lease.release()
        self.lease = None
        if self.trace is not None:
            self.trace.attempt_failed(failure.failover or failure.fault.value, failure.detail)
        tried: set[Backend] = set()
        try:
            self.endpoint.failover.failed(self.backend, failure, self.route_pool, tried, other_pool=True)
        except GatewayError as error:
            self.pool = error.pool or self.pool
            self._answer_error(error)
            return
        exchange = Exchange(self.endpoint, self.scope, self.link.cycle.send)
        self.hand_over(exchange)
        self.carry = self.loop.create_task(
            exchange.carry_on(self.route_pool, self.reason, self.body, self.total_due, tried)
        )

    # -- ending early ---------------------------------------------------------------------------------

    def _timed_out(self, conn: Dispatch) -> None:
        """No answer by the deadline (the connection's timer): `_expire`, guarded."""
        try:
            self._expire(conn)
        except Exception:
            self._fault()

    def _expire(self, conn: Dispatch) -> None:
        self.conn = None
        conn.close()  # the backend hears it (SGLang aborts the request)
        self._answer_error(no_answer_in_time(self.endpoint.settings.timeouts, stream=False))

    def _cut(self, why: GatewayError) -> None:
        """Cut while the backend's answer is awaited: the backend hears it at once, and the client is answered."""
        if self.finished or self.cut is not None or self.conn is None:
            return
        try:
            self.cut = why
            conn, self.conn = self.conn, None
            conn.cancel()  # the backend hears it (SGLang aborts the request)
            if isinstance(why, ClientGone):
                self.outcome = why.outcome
                self.end(0)
            else:
                self._answer_error(why)
        except Exception:
            self._fault()

    def _answer_error(self, error: GatewayError) -> None:
        self.outcome = error.outcome
        status, headers, body = error_answer(error, self.request_id, self._error_headers())
        if self.trace is not None:
            self.trace.responded(status)
        self.response_started = self.link.respond(status, headers, body)
        self.end(0)

    def _fault(self) -> None:
        """The guard of the steps run from callbacks, one of which raised: the backend connection given up, the
        client told what it is still owed, and the request ended, whatever fails on the way. (A coroutine that
        carries the request on has its own: `Exchange._failed`.)"""
        try:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.cancel()
            error = self.failed_unexpectedly()
            if error is not None:
                self._answer_error(error)
        except Exception:  # nothing more can be said: the client sees its connection close rather than wait
            log.exception("request %s could not be answered", self.request_id.decode(errors="replace"))
            self.link.abort()
        finally:
            self.end(0)
