"""One generation request's lifecycle, written once: its steps, and the one guard that accounts for it.

    check (the key, then what routing needs) -> admit -> route -> choose a backend -> send -> settle (pass the
    answer on) -> end;  cut (a deadline, the client leaving, a shutdown) at any point, from outside

Two drivers run these steps. A coroutine (gateway/request/proxy.py's `Exchange.run`) may wait - for a body, a request
slot, a switch, a connection, a failover. The read callbacks of the client's and the backend's connections
(gateway/request/inline.py's `InlineExchange`) run them for a request that needs to wait for nothing, with no task;
one that must wait after all (a failover) is handed to a coroutine (`Request.hand_over`), never driven by both.
The steps that need no waiting are written here once, for both: the checks (`check_head`, `check_body`) and what
the client gets of a backend's whole answer (`Request._whole`). Either way a request holds what it takes on its
`Request` - its admission slot, its backend's lease (or the `Opened` response that holds one), its mode lease, its
place in `Live.requests` - and `end` gives it all back and counts the request, once, on every exit: an answer,
an error, a cut, a shutdown, or a step that raised.

A step that raises unexpectedly is logged, and the client still gets an answer (`failed_unexpectedly`): a 500
`internal gateway error` if nothing was sent yet, an error event and `data: [DONE]` if its stream began, nothing
more if its response is complete (the request then counts as what the client got).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from crossover.gateway import metrics as labels
from crossover.gateway.errors import (
    SHUTDOWN_MESSAGE,
    BackendAnswered,
    BackendTimeout,
    ClientGone,
    GatewayError,
    ShuttingDown,
    Unavailable,
    backend_error_body,
)
from crossover.gateway.metrics import NO_POOL
from crossover.gateway.policies import FALLBACK
from crossover.gateway.request.auth import authorize_client, key_tier
from crossover.gateway.request.sse import usage_prompt_tokens, usage_tokens
from crossover.gateway.request.validation import Generation, parse_generation
from crossover.gateway.wire import POOL, SHOULD_RETRY, response_headers

if TYPE_CHECKING:
    from crossover.gateway.admission import Admission
    from crossover.gateway.backends import Lease, Pools
    from crossover.gateway.config import TimeoutSettings
    from crossover.gateway.metrics import Metrics
    from crossover.gateway.request.failover import Opened
    from crossover.gateway.topology import ModeLease
    from crossover.gateway.tracing import RequestTrace, Tracing
    from crossover.gateway.wire import ClientLink

log = logging.getLogger("crossover.proxy")

INTERNAL_ERROR = "internal gateway error"
JSON = (b"content-type", b"application/json")


def first_wait_s(timeouts: TimeoutSettings, stream: bool) -> float:
    """How long a request may wait for its first event (a stream) or its whole answer (the rest), within `total`."""
    first = timeouts.first_byte if stream else timeouts.non_stream
    return min(first or timeouts.total, timeouts.total)


def no_answer_in_time(timeouts: TimeoutSettings, stream: bool) -> BackendTimeout:
    """The backend sent nothing (a stream) or not its whole answer within the first wait."""
    return BackendTimeout(f"no response from the backend within {first_wait_s(timeouts, stream):g} s")


class Live:
    """The requests in progress, so a shutdown that runs out of grace can end each one cleanly."""

    def __init__(self) -> None:
        self.requests: set[Request] = set()
        self.shutting_down = False

    def cut_all(self) -> None:
        self.shutting_down = True
        for request in list(self.requests):
            request.cut_for_shutdown()


class Endpoint(Protocol):
    """What a request reads of the path it came in on (gateway/request/proxy.py's `ProxyEndpoint`)."""

    live: Live
    api_keys: list[bytes]
    pools: Pools
    metrics: Metrics
    admission: Admission
    # The service tier of a client key's requests that name none (settings' `api_key_tiers`); empty: none.
    key_tiers: dict[bytes, str]
    # OpenTelemetry (gateway/tracing.py); None: off, and a request pays for nothing of it.
    tracing: Tracing | None


def check_head(endpoint: Endpoint, headers: list[tuple[bytes, bytes]]) -> None:
    """The first step, before the body is read: the gateway still takes requests, and the client's key."""
    if endpoint.live.shutting_down:
        raise Unavailable(SHUTDOWN_MESSAGE)
    authorize_client(headers, endpoint.api_keys)


def check_body(endpoint: Endpoint, body: bytes, headers: list[tuple[bytes, bytes]]) -> Generation:
    """What routing needs from the body (a model the pools serve, whether it streams, its service tier - else its
    key's), and nothing more."""
    generation = parse_generation(body, endpoint.pools.model_names())
    if generation.tier is None and endpoint.key_tiers:
        return generation._replace(tier=key_tier(headers, endpoint.key_tiers))
    return generation


class Request:
    """What one request holds while it is in progress, and `end`, which gives it all back."""

    __slots__ = (
        "admitted",
        "endpoint",
        "finished",
        "lease",
        "link",
        "mode_lease",
        "opened",
        "outcome",
        "pool",
        "prompt_tokens",
        "request_id",
        "response_ended",
        "response_started",
        "started",
        "tier",
        "timer",
        "trace",
    )

    def __init__(self, endpoint: Endpoint, request_id: bytes, link: ClientLink | None) -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        # Our server's line to the client's connection (gateway/wire/client_http.py); None under another server.
        self.link = link
        self.started = time.perf_counter()
        self.finished = False
        self.admitted = False  # holds an admission slot
        # A backend's place: held by the opened response, or on its own while the direct lane waits for the answer.
        self.opened: Opened | None = None
        self.lease: Lease | None = None
        # Time-shared: the request's place on the active mode.
        self.mode_lease: ModeLease | None = None
        self.pool = NO_POOL
        self.outcome = labels.BACKEND_ERROR
        self.tier: str | None = None  # its service tier, once its body is read (None: none)
        # Whether the client's response began, and whether it is complete: what a failure can still tell it.
        self.response_started = self.response_ended = False
        self.timer = None
        # Its answer's `usage.prompt_tokens` (read with its completion tokens, `usage`): the rate table's input length.
        self.prompt_tokens = 0
        self.trace: RequestTrace | None = None  # its spans, when tracing is on

    def end(self, tokens: int) -> None:
        """However the request ended, once: synchronous accounting first, what it held given back last - even if
        the accounting fails (logged) - so a backend's in-flight count back at zero means every metric of the
        request is recorded."""
        if self.finished:
            return
        self.finished = True
        endpoint = self.endpoint
        try:
            endpoint.live.requests.discard(self)
            if self.timer is not None:
                self.timer.cancel()
            link = self.link
            if link is not None:
                link.callback = None  # the connection's scope would keep this request alive until its next one
                # Its cycle, scope and link refer to one another: let them go now rather than to the cyclic collector.
                link.cycle = None
            lease = self.opened.lease if self.opened is not None else self.lease
            endpoint.metrics.request_ended(
                self.pool,
                self.outcome,
                time.perf_counter() - self.started,
                tokens,
                0 if lease is None else lease.level,
                self.prompt_tokens,
            )
            if self.trace is not None:
                self.trace.end(self.outcome, tokens, self.prompt_tokens)
        except Exception:
            log.exception("request %s: its accounting failed", self.request_id.decode(errors="replace"))
        finally:
            if self.opened is not None:
                self.opened.lease.release()
            if self.lease is not None:
                self.lease.release()
            if self.mode_lease is not None:
                self.mode_lease.close()
            if self.admitted:
                endpoint.admission.release()

    def hand_over(self, other: Request) -> None:
        """What this request holds is `other`'s from now on, and `other.end` accounts for it: a driver that passes
        its request on (the inline lane, to fail over) ends its own part uncounted and holding nothing."""
        other.request_id, other.started, other.pool, other.outcome, other.tier, other.trace = (
            self.request_id,
            self.started,
            self.pool,
            self.outcome,
            self.tier,
            self.trace,
        )
        other.admitted, self.admitted = self.admitted, False
        other.lease, self.lease = self.lease, None
        other.opened, self.opened = self.opened, None
        other.mode_lease, self.mode_lease = self.mode_lease, None
        self.finished = True
        requests = self.endpoint.live.requests
        requests.discard(self)
        requests.add(other)

    def usage(self, data: bytes) -> int:
        """The completion tokens of an answer's `usage` (a body, or a stream's tail), and its prompt tokens kept."""
        tokens = usage_tokens(data)
        if tokens:
            self.prompt_tokens = usage_prompt_tokens(data)
        return tokens

    def routed(self, route_pool: str, reason: str) -> None:
        """Counted where it went, once a backend of `self.pool` answered: why, or that it fell back to that pool
        (and, for a request with a service tier, by its tier)."""
        metrics = self.endpoint.metrics
        metrics.routed(self.pool, reason if self.pool == route_pool else FALLBACK)
        if self.tier is not None:
            metrics.tiered(self.tier, self.pool)

    def _cut(self, why: GatewayError) -> None:
        """End the request early with `why` (the first reason stands): each driver its own way."""
        raise NotImplementedError

    def _client_left(self) -> None:
        self._cut(ClientGone("the client disconnected"))

    def cut_for_shutdown(self) -> None:
        """A shutdown ran out of grace: the request ends now, told so."""
        self._cut(ShuttingDown(SHUTDOWN_MESSAGE))

    def failed_unexpectedly(self) -> GatewayError | None:
        """A step raised what no step expects (the exception being handled): logged. The error the client is still
        owed, its outcome the request's; None once the response is complete: the request counts as what it got."""
        log.exception("request %s failed unexpectedly", self.request_id.decode(errors="replace"))
        if self.response_ended:
            return None
        error = GatewayError(INTERNAL_ERROR)
        self.outcome = error.outcome
        return error

    # -- settle: the client's answer, whichever driver writes it ----------------------------------------------

    def _whole(self, status: int, backend_headers: list[tuple[bytes, bytes]], body: bytes):
        """(status, headers, body) of a whole backend response as the client gets it; its outcome is set."""
        headers = response_headers(backend_headers)
        if status >= 400:
            body = backend_error_body(status, body)
            headers = [(name, value) for name, value in headers if name != b"content-type"] + [JSON]
            if status >= 500:  # SGLang's 500 is about the request: an SDK's retry would only repeat it
                headers.append((SHOULD_RETRY, b"false"))
            self.outcome = BackendAnswered(status, "").outcome
        else:
            self.outcome = labels.OK
        headers.append((b"content-length", b"%d" % len(body)))
        if self.trace is not None:
            self.trace.responded(status)
        return status, self._own(headers), body

    def _own(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """`headers` with the gateway's own added: the response begins."""
        self.response_started = True
        headers.append((POOL, self.pool.encode()))
        headers.append((b"x-request-id", self.request_id))
        return headers

    def _error_headers(self) -> list[tuple[bytes, bytes]]:
        """The gateway's own headers on an error response."""
        return [(POOL, self.pool.encode())] if self.pool != NO_POOL else []
