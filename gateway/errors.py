"""Every error the gateway answers with, as an OpenAI-style body `{"error": {message, type, param, code}}`, and
the outcome each one counts as (the `outcome` label of crossover_requests_total).

GatewayError ..................... 500  api_error              backend_error
├── InvalidRequest ............... 400  invalid_request_error  bad_request       (malformed JSON, wrong types, ...)
├── Unauthorized ................. 401  authentication_error   unauthorized      (a missing or wrong client key)
├── AuthenticationFailed ......... 401  authentication_error   bad_request       (admin API: a wrong token)
├── AdminDisabled ................ 403  permission_error       bad_request       (admin API: no token configured)
├── NotFound ..................... 404  invalid_request_error  bad_request       (unknown path)
│   └── ModelNotFound ............ 404  invalid_request_error  bad_request       (no pool serves the model)
├── MethodNotAllowed ............. 405  invalid_request_error  bad_request
├── RequestTimeout ............... 408  invalid_request_error  bad_request       (the request arrived too slowly)
├── ClientTooSlow ................ 408  invalid_request_error  client_slow       (took nothing for client_write)
├── BodyTooLarge ................. 413  invalid_request_error  bad_request
├── HeadersTooLarge .............. 431  invalid_request_error  bad_request       (the head exceeds its limit)
├── ClientGone ................... 499  -                      client_disconnect (never sent: nobody listens)
├── SwitchConflict ............... 409  invalid_request_error  bad_request       (PUT /admin/mode mid-switch)
├── NotForTopology ............... 409  invalid_request_error  bad_request       (admin API: meaningless here)
├── AdaptiveOff .................. 409  invalid_request_error  bad_request       (PUT /admin/adaptive, [adaptive] off)
├── Overloaded ................... 429  rate_limit_error       overloaded        (over max_inflight + max_queued)
├── SwitchRateLimited ............ 429  rate_limit_error       bad_request       (PUT /admin/mode too soon)
├── StatusError .................. any  by status              by status         (bad_request below 500)
│   └── BackendAnswered .......... any  by status              by status         (the backend's own error answer)
├── BackendFailed ................ 502  api_error              backend_error     (connection lost, 502/504, ...)
├── Unavailable .................. 503  api_error              unavailable       (the gateway's resources ran out)
│   ├── NoHealthyBackend ......... 503  api_error              unavailable       (no pool has a usable backend)
│   ├── ShuttingDown ............. 503  api_error              shutdown          (still running when grace ran out)
│   ├── SwitchUnavailable ........ 503  api_error              unavailable       (time-shared: switching, recovering)
│   └── BackendBusy .............. 503  api_error              busy              (queue full or 503, nowhere else)
│       └── BackendRateLimited ... 429  rate_limit_error       busy              (a 429, nowhere else to go)
├── StateNotSaved ................ 500  api_error              -                 (a live change not persisted)
│   └── StateNotShared ........... 503  api_error              -                 (... nor shared: cluster unreachable)
└── BackendTimeout ............... 504  timeout_error          timeout           (first byte or total timeout)

BackendAnswered keeps the backend's status and message: a 4xx, a 500 about the request, an error event before
or after the first token. BackendBusy: SGLang's queue-full event or a 503 (BackendRateLimited: a 429) from
every backend that could take the request.

Retry-After goes with 429 and 503: the OpenAI SDK waits that long before it retries, where a 502 it retries at
once. BackendTimeout says `x-should-retry: false`: the SDK's retries would wait three times as long for the
same outcome. Errors a backend answers itself go back with the backend's status and message, reshaped into
this body (`backend_error_body`, `BackendAnswered`). After the first byte of a stream the status is already
200: a failure then becomes an SSE `error` event followed by `data: [DONE]` (`sse.error_event`), the way SGLang
reports errors mid-stream.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

REQUEST_ID_HEADER = "x-request-id"
# The usual wait before a retry, for errors that tell the client to come back (429, 503).
RETRY_AFTER_S = 1
# The longest Retry-After passed on from a backend: past two minutes the OpenAI SDK would not retry at all.
MAX_RETRY_AFTER_S = 60
# What a request the gateway's shutdown turns away or cuts is told, on whichever path it met it.
SHUTDOWN_MESSAGE = "the gateway is shutting down; retry the request"

# How a request ended (the `outcome` label of crossover_requests_total), each written down once here; the errors
# below carry theirs.
OK = "ok"
BAD_REQUEST = "bad_request"  # refused by the gateway's checks, or answered 4xx / 500 by the backend (the request's)
UNAUTHORIZED = "unauthorized"  # api_keys configured and none of them presented
OVERLOADED = "overloaded"  # over max_inflight + max_queued, or waited too long for a slot
BUSY = "busy"  # every backend that could take it was busy: SGLang's queue full, or HTTP 503 / 429
UNAVAILABLE = "unavailable"  # no healthy backend, or the gateway's own resources ran out
BACKEND_ERROR = "backend_error"  # the backend's fault: connection lost, 502/504, a stream broken or failed mid-way
TIMEOUT = "timeout"  # first byte or total deadline passed (the client's outcome, not the backend's health)
CLIENT_DISCONNECT = "client_disconnect"
CLIENT_SLOW = "client_slow"  # the client took nothing of what it was sent for timeouts.client_write
SHUTDOWN = "shutdown"  # still running when the graceful shutdown ran out: ended with an error event
OUTCOMES = (OK, BAD_REQUEST, UNAUTHORIZED, OVERLOADED, BUSY, UNAVAILABLE, BACKEND_ERROR, TIMEOUT, CLIENT_DISCONNECT,
            CLIENT_SLOW, SHUTDOWN)  # fmt: skip


class GatewayError(Exception):
    status = 500
    type = "api_error"
    code: str | int | None = None
    outcome = BACKEND_ERROR

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, pool: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        # The pool whose backend's failure this is, when one answered (after a failover, the last one tried).
        self.pool = pool
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(GatewayError):
    status, type, code, outcome = 400, "invalid_request_error", "invalid_request", BAD_REQUEST


class Unauthorized(GatewayError):
    status, type, code, outcome = 401, "authentication_error", "invalid_api_key", UNAUTHORIZED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers["www-authenticate"] = "Bearer"


class AuthenticationFailed(GatewayError):
    status, type, code, outcome = 401, "authentication_error", "invalid_admin_token", BAD_REQUEST

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers["www-authenticate"] = "Bearer"


class AdminDisabled(GatewayError):
    status, type, code, outcome = 403, "permission_error", "admin_disabled", BAD_REQUEST


class NotFound(GatewayError):
    status, type, code, outcome = 404, "invalid_request_error", "not_found", BAD_REQUEST


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status, type, code, outcome = 405, "invalid_request_error", "method_not_allowed", BAD_REQUEST


class RequestTimeout(GatewayError):
    status, type, code, outcome = 408, "invalid_request_error", "request_timeout", BAD_REQUEST


class ClientTooSlow(GatewayError):
    """The client took none of the response for `client_write` s: it ends, with an error event if it streams."""

    status, type, code, outcome = 408, "invalid_request_error", "client_too_slow", CLIENT_SLOW


class BodyTooLarge(GatewayError):
    status, type, code, outcome = 413, "invalid_request_error", "request_too_large", BAD_REQUEST


class HeadersTooLarge(GatewayError):
    status, type, code, outcome = 431, "invalid_request_error", "request_header_fields_too_large", BAD_REQUEST


class ClientGone(GatewayError):
    """The client hung up: nothing is sent (499 is nginx's word for it, in logs only)."""

    status, type, code, outcome = 499, "invalid_request_error", "client_closed_request", CLIENT_DISCONNECT


class Overloaded(GatewayError):
    status, type, code, outcome = 429, "rate_limit_error", "gateway_overloaded", OVERLOADED

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.headers["retry-after"] = str(retry_after_s)


class StatusError(GatewayError):
    """An error whose status is given rather than fixed by its kind; counted as the request's below 500."""

    def __init__(self, status: int, message: str, *, code: str | int | None = None, pool: str | None = None) -> None:
        super().__init__(message, code=code, pool=pool)  # type: ignore[arg-type]
        self.status = status
        self.type = openai_type(status)
        self.outcome = BAD_REQUEST if status < 500 else BACKEND_ERROR


class BackendAnswered(StatusError):
    """A backend's own error answer, passed on with its status and message: a 4xx or 500 about the request, or an
    error event (before or after a stream's first token)."""

    code = "backend_error"


class BackendFailed(GatewayError):
    status, type, code = 502, "api_error", "backend_unavailable"


class Unavailable(GatewayError):
    status, type, code, outcome = 503, "api_error", "gateway_unavailable", UNAVAILABLE

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S, pool: str | None = None) -> None:
        super().__init__(message, pool=pool)
        self.headers["retry-after"] = str(retry_after_s)


class NoHealthyBackend(Unavailable):
    code = "no_healthy_backend"


class SwitchUnavailable(Unavailable):
    """A time-shared GPU set is between modes: its switch queue is full or too slow, no mode serves (recovery
    is under way), or a switch cut the request. The message says what is under way, never a backend's URL."""

    def __init__(self, message: str, *, code: str, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code


class SwitchConflict(GatewayError):
    status, type, code, outcome = 409, "invalid_request_error", "switch_in_progress", BAD_REQUEST


class NotForTopology(GatewayError):
    """An admin change the deployment's topology cannot honour (a mode on partitioned pools, a routing policy on
    one GPU set): refused, never answered 200 with nothing done. `code` says which."""

    status, type, code, outcome = 409, "invalid_request_error", "not_for_topology", BAD_REQUEST


class AdaptiveOff(GatewayError):
    """PUT /admin/adaptive on a gateway whose settings leave the adaptive controller off."""

    status, type, code, outcome = 409, "invalid_request_error", "adaptive_off", BAD_REQUEST


class SwitchRateLimited(GatewayError):
    """PUT /admin/mode again too soon after the last operator change."""

    status, type, code, outcome = 429, "rate_limit_error", "mode_change_rate_limited", BAD_REQUEST

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers["retry-after"] = str(retry_after_s)


class ShuttingDown(Unavailable):
    outcome = SHUTDOWN


class BackendBusy(Unavailable):
    """Busy, not broken: SGLang's queue-full event, or a 503, from every backend that could take the request
    (in time-shared mode there is one). Retry-After is the backend's if it sent one, else RETRY_AFTER_S."""

    code, outcome = "backend_busy", BUSY


class BackendRateLimited(BackendBusy):
    status, type, code = 429, "rate_limit_error", "backend_rate_limited"


class StateNotSaved(GatewayError):
    """A live change that applies but could not be written to the state file."""

    code = "state_not_saved"


class StateNotShared(StateNotSaved):
    """A live change on this replica that the cluster's store did not take (it is written once the store answers)."""

    status, code = 503, "state_not_shared"


class BackendTimeout(GatewayError):
    status, type, code, outcome = 504, "timeout_error", "backend_timeout", TIMEOUT

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # The OpenAI SDK retries 504 twice by itself: three times the wait, for the same outcome.
        self.headers["x-should-retry"] = "false"


def retry_after(value: bytes | str | None) -> int:
    """A backend's Retry-After (seconds) as we pass it on: whole seconds from 1 to MAX_RETRY_AFTER_S, else the
    usual wait (an HTTP date, or nothing at all)."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if text is None or not text.strip().isdigit():
        return RETRY_AFTER_S
    return min(max(int(text.strip()), 1), MAX_RETRY_AFTER_S)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: GatewayError, request_id: str | None = None) -> JSONResponse:
    headers = dict(exc.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def error_answer(
    exc: GatewayError, request_id: bytes, extra: list[tuple[bytes, bytes]] = ()
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of the error response the proxy path sends (it has no framework around it)."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(b"x-request-id", request_id), *extra]
    headers += [(name.encode(), value.encode()) for name, value in exc.headers.items()]
    return exc.status, headers, body


async def send_error(send, exc: GatewayError, request_id: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    """The error response, straight on an ASGI `send`."""
    status, headers, body = error_answer(exc, request_id, extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# OpenAI's error types by status, for backend errors that come without one (or with SGLang's "BadRequest").
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip


def openai_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def backend_error_body(status: int, body: bytes) -> bytes:
    """A backend's error answer in OpenAI's shape, its message kept: SGLang answers with a top-level
    `{"object": "error", "message", "type": "BadRequest", "code": 400}`; a proxy in between with plain text."""
    message, param, code = backend_error_fields(status, body)
    return json.dumps(error_body(message, openai_type(status), param, code)).encode()


def backend_error_fields(status: int, body: bytes) -> tuple[str, str | None, str | int]:
    """(message, param, code) of a backend's error answer (or error event's data), whatever its shape."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        error = payload["error"]
        message = error.get("message")
        code, param = error.get("code"), error.get("param")
    elif isinstance(payload, dict) and "message" in payload:
        message, param = payload["message"], payload.get("param")
        # SGLang's `type` is an exception class name ("BadRequest"): the most specific code it gives.
        code = payload.get("type") if isinstance(payload.get("type"), str) else payload.get("code")
    else:
        message = body.decode("utf-8", "replace").strip()
        code = param = None
    message = str(message) if message else f"the backend answered HTTP {status}"
    code = code if isinstance(code, str | int) and not isinstance(code, bool) else status
    param = param if isinstance(param, str) else None
    return message, param, code


async def on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc, request.headers.get(REQUEST_ID_HEADER))


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 for unknown paths and methods, in OpenAI form."""
    assert isinstance(exc, HTTPException)
    error: GatewayError
    if exc.status_code == 404:
        error = NotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
    else:
        error = StatusError(exc.status_code, str(exc.detail))
    response = error_response(error, request.headers.get(REQUEST_ID_HEADER))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def on_unexpected(request: Request, exc: Exception) -> Response:
    return error_response(GatewayError("internal gateway error"), request.headers.get(REQUEST_ID_HEADER))


EXCEPTION_HANDLERS = {
    GatewayError: on_gateway_error,
    HTTPException: on_http_exception,
    Exception: on_unexpected,
}
