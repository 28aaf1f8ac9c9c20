"""Every error the gateway answers with, as an OpenAI-style body `{"error": {message, type, param, code}}`.

GatewayError
├── InvalidRequest ........ 400  invalid_request_error  (malformed JSON, wrong types, bad admin values)
├── Unauthorized .......... 401  authentication_error   (api_keys configured: missing or wrong client key)
├── AuthenticationFailed .. 401  authentication_error   (admin API: missing or wrong bearer token)
├── AdminDisabled ......... 403  permission_error       (admin API: no token configured)
├── NotFound .............. 404  invalid_request_error  (unknown path)
│   └── ModelNotFound ..... 404  invalid_request_error  (model not served by any pool)
├── MethodNotAllowed ...... 405  invalid_request_error
├── RequestTimeout ........ 408  invalid_request_error  (the request head or body arrived too slowly)
├── BodyTooLarge .......... 413  invalid_request_error
├── HeadersTooLarge ....... 431  invalid_request_error  (the request head exceeds its limit)
├── SwitchConflict ........ 409  invalid_request_error  (PUT /admin/mode while a switch is under way)
├── Overloaded ............ 429  rate_limit_error       (over max_inflight + max_queued; Retry-After)
├── SwitchRateLimited ..... 429  rate_limit_error       (PUT /admin/mode too soon after the last; Retry-After)
├── BackendFailed ......... 502  api_error              (the backend failed the request: connection lost, ...)
├── Unavailable ........... 503  api_error              (shutting down, or the gateway's own resources ran out)
│   ├── NoHealthyBackend .. 503  api_error              (no pool has a usable backend; Retry-After)
│   └── SwitchUnavailable . 503  api_error              (time-shared: switching or recovering; Retry-After)
└── BackendTimeout ........ 504  timeout_error          (first byte or total timeout; x-should-retry: false)

Errors a backend answers itself (a 4xx, or a 500 about the request) go back with the backend's status and
message, reshaped into this body by `backend_error_body`. After the first byte of a stream the status is
already 200: a failure then becomes an SSE `error` event followed by `data: [DONE]` (`sse.error_event`),
the way SGLang reports errors mid-stream.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

REQUEST_ID_HEADER = "x-request-id"


class GatewayError(Exception):
    status = 500
    type = "api_error"
    code: str | None = None
    # The pool whose backend's failure this is, when one answered (after a failover, the last one tried).
    pool: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(GatewayError):
    status, type, code = 401, "authentication_error", "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers["www-authenticate"] = "Bearer"


class AuthenticationFailed(GatewayError):
    status, type, code = 401, "authentication_error", "invalid_admin_token"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers["www-authenticate"] = "Bearer"


class AdminDisabled(GatewayError):
    status, type, code = 403, "permission_error", "admin_disabled"


class NotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTimeout(GatewayError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class BodyTooLarge(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class HeadersTooLarge(GatewayError):
    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class Overloaded(GatewayError):
    status, type, code = 429, "rate_limit_error", "gateway_overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers["retry-after"] = str(retry_after_s)


class BackendFailed(GatewayError):
    status, type, code = 502, "api_error", "backend_unavailable"


class Unavailable(GatewayError):
    status, type, code = 503, "api_error", "gateway_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
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
    status, type, code = 409, "invalid_request_error", "switch_in_progress"


class SwitchRateLimited(GatewayError):
    """PUT /admin/mode again too soon after the last operator change."""

    status, type, code = 429, "rate_limit_error", "mode_change_rate_limited"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers["retry-after"] = str(retry_after_s)


class BackendTimeout(GatewayError):
    status, type, code = 504, "timeout_error", "backend_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # The OpenAI SDK retries 504 twice by itself: three times the wait, for the same outcome.
        self.headers["x-should-retry"] = "false"


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: GatewayError, request_id: str | None = None) -> JSONResponse:
    headers = dict(exc.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def send_error(send, exc: GatewayError, request_id: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    """The error response, straight on an ASGI `send` (the proxy path has no framework around it)."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(b"x-request-id", request_id), *extra]
    headers += [(name.encode(), value.encode()) for name, value in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
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
    return json.dumps(error_body(message, openai_type(status), param, code)).encode()


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
        error = GatewayError(str(exc.detail))
        error.status = exc.status_code
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
