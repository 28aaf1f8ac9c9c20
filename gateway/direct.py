"""The direct lane: a non-streamed generation request with nothing to wait for, served from callbacks alone.

The usual non-streamed request has its small body in by the end of a read or two, finds a request slot free,
its backend usable and an idle pooled connection to it, and gets a whole answer. For it, the client's read
callback checks the key, parses the body, routes and writes the request to the backend
(`DirectExchange.offer`); the backend connection's read callback, once the answer is whole, writes the
client's response in one write and accounts for the request. There is no ASGI task, coroutine chain, deadline
context or timer per request (the deadline rides on the backend connection's one timer): with the rest of
that change, a third less CPU per non-streamed request than the ordinary path (README, "Performance").

Everything else goes the ordinary way (gateway/proxy.py), decided before anything is sent: a stream, a body
still arriving, an error to answer, a queue to wait in, a connection to make, the time-shared topology,
another ASGI server or transport. Once the request is out, the lane ends it exactly as `Exchange` would, on
the same rules and with the same words: a failure that may fail over goes on as an ordinary coroutine from the
next backend (`_carry_on`); a deadline, a client that leaves and a shutdown cut the backend connection and
answer at once. A request here is in `Live.requests`, holds its slot and its backend's lease like any other,
and is accounted for once, by `Exchange._account`.
"""

from __future__ import annotations

import asyncio

from crossover.gateway._http1 import Http1Transport, _Connection
from crossover.gateway.auth import authorize_client
from crossover.gateway.client_http import ClientLink
from crossover.gateway.errors import (
    BackendTimeout,
    ClientGone,
    GatewayError,
    error_answer,
)
from crossover.gateway.failover import Failure, Outgoing, classify_error, classify_response
from crossover.gateway.failover import endpoint as backend_target
from crossover.gateway.headers import POOL, request_headers
from crossover.gateway.metrics import NO_POOL
from crossover.gateway.policy import FALLBACK
from crossover.gateway.pools import Backend
from crossover.gateway.proxy import PARSED, Exchange, ProxyEndpoint, first_wait_s
from crossover.gateway.sse import usage_tokens
from crossover.gateway.validation import parse_generation


class DirectExchange(Exchange):
    __slots__ = ("backend", "body", "carry", "conn", "reason", "route_pool", "total_due")

    def __init__(self, endpoint: ProxyEndpoint, scope, link: ClientLink) -> None:
        super().__init__(endpoint, scope, link.cycle.send)
        self.conn: _Connection | None = None  # the backend connection while the answer is awaited
        self.backend: Backend | None = None
        self.route_pool = self.reason = ""
        self.body = b""
        self.total_due = 0.0
        self.carry: asyncio.Task | None = None  # the ordinary coroutine that took the request on, if one did

    @classmethod
    def offer(cls, endpoint: ProxyEndpoint, scope, body: bytes, link: ClientLink) -> bool:
        """Send the request to its backend now, if nothing has to wait: True once sent, False (with nothing done)
        to leave the request to the ordinary path."""
        sender = endpoint.failover.sender
        if (
            type(sender) is not Http1Transport
            or not endpoint.topology.direct_lane
            or endpoint.live.shutting_down
            or scope.get("http_version") == "1.0"
            or len(body) > endpoint.settings.limits.max_body_bytes
        ):
            return False
        try:
            authorize_client(scope["headers"], endpoint.api_keys)
            generation = parse_generation(body, endpoint.pools.model_names())
        except Exception:  # answered (or logged) the ordinary way
            return False
        if not generation.stream and cls._send(endpoint, scope, body, link, sender):
            return True
        scope[PARSED] = (body, generation)  # for the ordinary way
        return False

    @classmethod
    def _send(cls, endpoint: ProxyEndpoint, scope, body: bytes, link: ClientLink, sender: Http1Transport) -> bool:
        pool, reason = endpoint.route()
        # Only looked at until the request is sent: if it goes the ordinary way, that way chooses the same.
        backend = endpoint.failover.choose(pool, set(), turn=False)
        if backend is None or not endpoint.admission.take_free():
            return False
        exchange = cls(endpoint, scope, link)
        headers = request_headers(scope["headers"], exchange.request_id, backend.api_key)
        # The deadlines `Exchange` keeps: the whole answer within `non_stream` (else `total`), all within `total`.
        timeouts, now = exchange.timeouts, exchange.loop.time()
        due = now + first_wait_s(timeouts, stream=False)
        target = backend_target(backend.url, exchange.target())
        conn = sender.dispatch(target, headers, body, exchange._settled, due, exchange._timed_out_direct)
        if conn is None:
            endpoint.admission.release()
            return False
        endpoint.pools.turn()
        exchange._dispatched(conn, backend, pool, reason, body, now + timeouts.total)
        return True

    def _dispatched(
        self, conn: _Connection, backend: Backend, pool: str, reason: str, body: bytes, total_due: float
    ) -> None:
        endpoint = self.endpoint
        self.admitted = True
        self.lease = endpoint.pools.lease(backend)
        self.conn, self.backend, self.route_pool, self.reason = conn, backend, pool, reason
        self.pool = pool  # until the backend answers: where the request was headed
        self.body, self.body_unread, self.total_due = body, False, total_due
        endpoint.live.requests.add(self)
        self.link.callback = self._client_left

    # -- the backend's side ---------------------------------------------------------------------------

    def _settled(self, conn: _Connection) -> None:
        """The backend's answer is whole, or its connection failed (called from the connection's callbacks)."""
        self.conn = None
        backend, sender = self.backend, self.endpoint.failover.sender
        if conn.error is not None:
            kind, message = conn.error
            sender.release(conn)  # closed: it failed
            self._failed(classify_error(kind(message), backend.pool))
            return
        status, headers, body = conn.answer()
        failure = classify_response(status, body, False, backend.pool, headers)
        if failure is not None:
            sender.release(conn)
            self._failed(failure)
            return
        self.pool = backend.pool
        answer = self._whole(status, headers, body)
        self.link.respond(*answer)  # first: the rest is bookkeeping (a client that left has ended the request)
        sender.release(conn)  # pooled again if the server keeps it open
        endpoint = self.endpoint
        endpoint.failover.answered(backend, status)
        endpoint.metrics.routed(self.pool, self.reason if self.pool == self.route_pool else FALLBACK)
        self._account(usage_tokens(body) if status == 200 else 0)

    def _failed(self, failure: Failure) -> None:
        """The backend failed the request before the client saw a byte: on to the next backend as an ordinary
        coroutine if the failure allows, else the error it ends with."""
        self.lease.release()
        tried: set[Backend] = set()
        try:
            self.endpoint.failover.failed(self.backend, failure, self.route_pool, tried, other_pool=True)
        except GatewayError as error:
            self.pool = error.pool or self.pool
            self._answer_error(error)
            return
        self.carry = self.loop.create_task(self._carry_on(tried))

    async def _carry_on(self, tried: set[Backend]) -> None:
        tokens = 0
        try:
            tokens = await self._guarded(self._reopen(tried), stream=False)
        finally:
            await self._close(tokens)

    async def _reopen(self, tried: set[Backend]) -> int:
        if self.cut is not None:  # cut before the coroutine began: it ends as the cut says (`_timed_out`)
            raise TimeoutError
        endpoint = self.endpoint
        self._move_deadline(min(self.total_due, self.loop.time() + first_wait_s(self.timeouts, stream=False)))
        outgoing = Outgoing(
            self.target(), self.body, self.scope["headers"], self.request_id, False, endpoint.socket_timeout
        )
        return await self._open_and_send(self.route_pool, self.reason, outgoing, self.total_due, tried)

    # -- ending early ---------------------------------------------------------------------------------

    def _timed_out_direct(self, conn: _Connection) -> None:
        self.conn = None
        conn.close()  # the backend hears it (SGLang aborts the request)
        limit = first_wait_s(self.timeouts, stream=False)
        self._answer_error(BackendTimeout(f"no response from the backend within {limit:g} s"))

    def _cut(self, why: GatewayError) -> None:
        if self.conn is None:  # carried on as a coroutine (or over): its deadline ends it
            super()._cut(why)
            return
        if self.finished or self.cut is not None:
            return
        self.cut = why
        self._abandon()
        if isinstance(why, ClientGone):
            self.outcome = why.outcome
            self._account(0)
        else:
            self._answer_error(why)

    def _abandon(self) -> None:
        """Give up on the backend's answer: closing the connection tells the backend (SGLang aborts the request)."""
        conn, self.conn = self.conn, None
        conn.settled = conn.expired = None
        conn.close()

    def _answer_error(self, error: GatewayError) -> None:
        self.outcome = error.outcome
        extra = [(POOL, self.pool.encode())] if self.pool != NO_POOL else []
        status, headers, body = error_answer(error, self.request_id, extra)
        self.response_started = self.link.respond(status, headers, body)
        self._account(0)
