"""Failure handling, in one place: choose a backend, attempt it, classify what went wrong, try elsewhere.

Whose fault is a failed attempt? Decided once, here (`classify_error`, `classify_response`):

    Failure
    ├── REQUEST  the request's: a 4xx, a 500 answered with a body (SGLang answers 500 to any exception
    │            while handling a request, a chat template rejecting a role sequence for one), an error
    │            event other than "queue full". The client gets the backend's status and message; the
    │            backend's health is untouched (a 5xx only asks the health checks for a look).
    ├── BACKEND  the backend's: connection refused or reset, 502/504, a connection lost before the response,
    │            an empty stream - passive evidence for the breaker (gateway/backends/health.py), which probes at once
    │            and never lets passive signals alone eject a pool's last healthy backend; or busy: 503, 429,
    │            SGLang's queue-full event - no evidence at all.
    └── LOCAL    the gateway's own: out of descriptors or memory, its connection pool exhausted. Never
                 counted against a backend; the client gets 503.

Busy is not broken: SGLang's queue-full event and a 503 or 429 answer are the backend refusing before doing any
work. They fail over but are no evidence for ejection (only the periodic probes look); when no other backend can
take the request (always so in time-shared mode) the client gets 503 or 429 with Retry-After (`BackendBusy`),
so the OpenAI SDK backs off instead of retrying at once.

Only failures that say nothing about the request fail over - a connect error (nothing was sent), 502/503/504,
429 and the queue-full event - and a request is never sent twice to backends that may both have started it:
once its bytes are written, nothing sends it again (gateway/wire/http1.py), whatever the connection does next.
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from crossover.gateway import engines
from crossover.gateway import metrics as labels
from crossover.gateway.backends import Backend, Breaker, Lease, Pools
from crossover.gateway.errors import (
    BackendAnswered,
    BackendBusy,
    BackendFailed,
    BackendRateLimited,
    BackendTimeout,
    GatewayError,
    NoHealthyBackend,
    Unavailable,
    backend_error_fields,
    retry_after,
)
from crossover.gateway.metrics import Metrics
from crossover.gateway.request.sse import error_in, first_event
from crossover.gateway.tracing import RequestTrace
from crossover.gateway.wire import ProxySender, RawResponse, Target, request_headers

log = logging.getLogger("crossover.failover")

# Errors of the gateway's own making when it opens a connection: no backend is to blame.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})
BUSY_STATUSES = frozenset({429, 503})
FAILOVER_STATUSES = frozenset({502, 504}) | BUSY_STATUSES
# A stream under way that broke: what its client is told (an SSE error event), however the break was seen.
MID_STREAM = "the backend failed mid-stream"


class Fault(enum.Enum):
    REQUEST = "request"
    BACKEND = "backend"
    LOCAL = "local"


class Failure(Exception):
    """One attempt failed before the client saw a byte; `error` is what the client gets if nothing else works."""

    def __init__(
        self, fault: Fault, error: GatewayError, *, failover: str | None = None, detail: str = "", busy: bool = False
    ) -> None:
        super().__init__(detail or error.message)
        self.fault = fault
        self.error = error
        # The failover reason (a crossover_failovers_total label) when another backend may take the request.
        self.failover = failover
        self.detail = detail or error.message
        # The backend refused for now (queue full, 503, 429): no evidence against its health.
        self.busy = busy


@dataclass(slots=True)
class Opened:
    """A backend response whose first event (streams) or whole body (the rest) has arrived."""

    response: RawResponse
    # The rest of a stream after `head`, or None when `head` is the whole body.
    chunks: AsyncIterator[bytes] | None
    head: bytes
    backend: Backend
    lease: Lease


def classify_error(exc: httpx.HTTPError, pool: str | None = None) -> Failure:
    """A transport error before any response arrived (from a backend of `pool`)."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        cause = exc.__cause__
        if isinstance(cause, OSError) and cause.errno in LOCAL_ERRNOS:
            return Failure(Fault.LOCAL, Unavailable("the gateway is out of resources; retry shortly"), detail=str(exc))
        return Failure(
            Fault.BACKEND,
            BackendFailed("no backend could be reached", pool=pool),
            failover=labels.CONNECT_ERROR,
            detail=str(exc),
        )
    if isinstance(exc, httpx.PoolTimeout):
        return Failure(Fault.LOCAL, Unavailable("the gateway has no free backend connection; retry shortly"))
    if isinstance(exc, httpx.TimeoutException):
        return Failure(Fault.REQUEST, BackendTimeout("the backend did not answer in time"), detail=repr(exc))
    # Reset, closed or broken after the request was written: the backend may have started it, so no resend.
    return Failure(Fault.BACKEND, BackendFailed("the backend closed the connection", pool=pool), detail=repr(exc))


def classify_response(
    status: int, head: bytes, stream: bool, pool: str | None = None, headers: list[tuple[bytes, bytes]] = ()
) -> Failure | None:
    """A response that arrived (from a backend of `pool`): None if it goes to the client as it is (4xx and 500)."""
    if status in BUSY_STATUSES:
        wait = retry_after(next((value for name, value in headers if name.lower() == b"retry-after"), None))
        busy = BackendRateLimited if status == 429 else BackendBusy
        message = backend_error_fields(status, head)[0]
        return Failure(
            Fault.BACKEND, busy(message, retry_after_s=wait, pool=pool), failover=labels.BACKEND_BUSY, busy=True
        )
    if status in FAILOVER_STATUSES:
        return Failure(
            Fault.BACKEND,
            BackendFailed(f"the backend answered HTTP {status}", pool=pool),
            failover=labels.BACKEND_UNAVAILABLE,
        )
    if status != 200:
        return None
    if not head:
        if stream:
            return Failure(Fault.BACKEND, BackendFailed("the backend ended the stream before any event", pool=pool))
        return None
    event = error_in(head) if head.startswith(b"data:") else None
    if event is None:
        return None
    if engines.busy(event.status):
        return Failure(Fault.BACKEND, BackendBusy(event.message, pool=pool), failover=labels.QUEUE_FULL, busy=True)
    if not stream:  # an error event as a non-streaming body: not a success, whatever its status line said
        return Failure(Fault.REQUEST, BackendAnswered(event.status or 500, event.message, pool=pool))
    return None  # a stream that opens with the request's error: passed on, reshaped (gateway/request/proxy.py)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One client request as every attempt sends it."""

    target: str  # path and query string, e.g. "/v1/chat/completions"
    body: bytes
    client_headers: list[tuple[bytes, bytes]]
    request_id: bytes
    stream: bool
    timeout: dict[str, float]  # per-operation socket bounds (httpx's extensions["timeout"])
    trace: RequestTrace | None = None  # the request's spans, when tracing is on (gateway/tracing.py)


class Failover:
    """Opens a backend response for one request, trying other backends on failures that allow it."""

    def __init__(
        self, pools: Pools, breaker: Breaker, metrics: Metrics, max_failovers: int, sender: ProxySender
    ) -> None:
        self.pools = pools
        self.breaker = breaker
        self.metrics = metrics
        self.max_failovers = max_failovers
        self.sender = sender

    async def open(
        self, pool: str, outgoing: Outgoing, *, other_pool: bool = True, tried: set[Backend] | None = None
    ) -> Opened:
        """The first backend that answers without a backend failure: the chosen pool's least loaded, then others
        (the other pool too, unless `other_pool` is False: a time-shared GPU set serves one mode at a time).
        `tried`: backends that already failed this request (and the failovers that took it past them)."""
        tried = set() if tried is None else tried
        backend = self.choose(pool, tried, other_pool)
        if backend is None:
            raise NoHealthyBackend("no healthy backend in either pool" if other_pool else f"no healthy {pool} backend")
        while True:
            lease = self.pools.lease(backend)
            try:
                opened = await attempt(self.sender, backend, outgoing)
            except Failure as failure:
                lease.release()
                if outgoing.trace is not None:
                    outgoing.trace.attempt_failed(failure.failover or failure.fault.value, failure.detail)
                backend = self.failed(backend, failure, pool, tried, other_pool)
                continue
            except BaseException:
                lease.release()
                raise
            self.answered(backend, opened.response.status_code)
            if outgoing.trace is not None:
                outgoing.trace.answered(opened.response.status_code)
            opened.lease = lease
            return opened

    def failed(self, backend: Backend, failure: Failure, pool: str, tried: set[Backend], other_pool: bool) -> Backend:
        """`backend` failed the request: the backend to try next (a failover, counted), else raise the error the
        client gets."""
        self._report(backend, failure)
        tried.add(backend)
        following = self.choose(pool, tried, other_pool) if failure.failover else None
        if following is None or len(tried) > self.max_failovers:
            raise failure.error from None
        self.metrics.failovers.labels(failure.failover).inc()
        return following

    def answered(self, backend: Backend, status: int) -> None:
        if status >= 500:
            self.breaker.check_soon(backend)  # a 500 is usually the request's; a look at /health tells
        else:
            self.breaker.succeeded(backend)

    def broke_mid_stream(self, backend: Backend, exc: Exception) -> None:
        """A stream under way broke: the backend's kind of failure, though nothing can fail over any more."""
        failure = Failure(Fault.BACKEND, BackendFailed(MID_STREAM, pool=backend.pool), detail=repr(exc))
        self._report(backend, failure)

    def _report(self, backend: Backend, failure: Failure) -> None:
        if failure.busy:
            # A busy backend, not a broken one: nothing counts against it, and no probe is asked for (SGLang's
            # /health generates a token, which a full queue would refuse too: a busy backend would be ejected).
            log.info("backend %s is busy: %s", backend.url, failure.detail)
        elif failure.fault is Fault.BACKEND:
            log.warning("backend %s failed a request: %s", backend.url, failure.detail)
            self.breaker.failed_passively(backend)
        elif failure.fault is Fault.LOCAL:
            log.error("the gateway itself failed a request to %s: %s", backend.url, failure.detail)

    def choose(self, pool: str, tried: set[Backend], other_pool: bool = True, turn: bool = True) -> Backend | None:
        chosen = self.pools.choose(pool, tried, turn)
        if chosen is None and other_pool:
            chosen = self.pools.choose(self.pools.other(pool), tried, turn)
        return chosen


@functools.lru_cache(maxsize=1024)
def endpoint(backend_url: str, target: str) -> Target:
    """Parsed once per backend and target: URL parsing is a visible share of a proxied request's cost."""
    return Target(httpx.URL(backend_url + target))


async def attempt(sender: ProxySender, backend: Backend, outgoing: Outgoing) -> Opened:
    """POST the request to `backend` and wait for the first event (streams) or the whole body (the rest)."""
    headers = request_headers(outgoing.client_headers, outgoing.request_id, backend.api_key)
    if outgoing.trace is not None:
        headers = outgoing.trace.attempt(headers, backend.url, backend.pool)
    url = endpoint(backend.url, outgoing.target)
    try:
        response = await sender.open("POST", url, headers, outgoing.body, outgoing.timeout)
    except httpx.HTTPError as exc:
        raise classify_error(exc, backend.pool) from exc
    try:
        if outgoing.stream and response.status_code == 200:
            chunks = aiter(response.stream)
            head = await first_event(chunks)
        else:
            chunks, head = None, await response.aread()
        failure = classify_response(response.status_code, head, outgoing.stream, backend.pool, response.headers)
    except httpx.HTTPError as exc:
        await response.aclose()
        raise classify_error(exc, backend.pool) from exc
    except BaseException:
        await response.aclose()
        raise
    if failure is not None:
        await response.aclose()
        raise failure
    return Opened(response, chunks, head, backend, None)  # type: ignore[arg-type]  # the lease: set by open
