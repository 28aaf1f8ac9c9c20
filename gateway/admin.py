"""The operator's API: read and change the routing threshold live, and inspect pools and backends.

    curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:8000/admin/threshold
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"threshold": 24}' http://127.0.0.1:8000/admin/threshold
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"mode": "plain"}' http://127.0.0.1:8000/admin/mode

With no admin token configured the API answers 403: it is never open.
"""

from __future__ import annotations

import json
import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from crossover.gateway.config import POOL_NAMES
from crossover.gateway.errors import AdminDisabled, AuthenticationFailed, BodyTooLarge, GatewayError, InvalidRequest
from crossover.gateway.routing import POLICIES
from crossover.gateway.state import GatewayState

MAX_ADMIN_BODY_BYTES = 64 * 1024
_FIELDS = ("threshold", "hysteresis", "policy")


def authorize(request: Request, token: str) -> None:
    if not token:
        raise AdminDisabled("the admin API is disabled: configure admin_token to enable it")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise AuthenticationFailed("missing or wrong admin token: send 'Authorization: Bearer <admin_token>'")


def threshold_view(state: GatewayState) -> dict:
    pools = state.pools
    return {
        **state.routing.state(),
        "load_signal": pools.load_signal,
        "loads": {name: pools.pool_load(name) for name in POOL_NAMES},
    }


def parse_update(body: bytes) -> dict:
    """`{"threshold": int, "hysteresis": int, "policy": str}`, each optional but at least one present."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest('the request body must be a JSON object like {"threshold": 32}', code="invalid_json")
    unknown = sorted(set(payload) - set(_FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown field(s) {unknown}; expected {list(_FIELDS)}", param=unknown[0])
    if not payload:
        raise InvalidRequest("send at least one of threshold, hysteresis, policy", param="threshold")
    for name in ("threshold", "hysteresis"):
        if name in payload:
            value = payload[name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(
                    f"'{name}' must be a non-negative integer, got {value!r}", param=name, code="invalid_type"
                )
            if value < 0:
                raise InvalidRequest(
                    f"'{name}' must be a non-negative integer, got {value}", param=name, code="invalid_value"
                )
    if "policy" in payload and payload["policy"] not in POLICIES:
        raise InvalidRequest(f"'policy' must be one of {list(POLICIES)}, got {payload['policy']!r}", param="policy")
    return payload


def parse_mode(body: bytes) -> str:
    """`{"mode": "speculative" | "plain"}`."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest('the request body must be a JSON object like {"mode": "plain"}', code="invalid_json")
    unknown = sorted(set(payload) - {"mode"})
    if unknown:
        raise InvalidRequest(f"unknown field(s) {unknown}; expected ['mode']", param=unknown[0])
    if "mode" not in payload:
        raise InvalidRequest('send {"mode": "speculative"} or {"mode": "plain"}', param="mode")
    if payload["mode"] not in POOL_NAMES:
        raise InvalidRequest(f"'mode' must be one of {list(POOL_NAMES)}, got {payload['mode']!r}", param="mode")
    return payload["mode"]


async def read_admin_body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_ADMIN_BODY_BYTES:
            raise BodyTooLarge(f"an admin request body is at most {MAX_ADMIN_BODY_BYTES} bytes")
    return body


def admin_routes(state: GatewayState) -> list[Route]:
    token = state.settings.admin_token

    async def get_threshold(request: Request) -> JSONResponse:
        authorize(request, token)
        return JSONResponse(threshold_view(state))

    async def put_threshold(request: Request) -> JSONResponse:
        authorize(request, token)
        update = parse_update(await read_admin_body(request))
        try:
            state.routing.update(update.get("threshold"), update.get("hysteresis"), update.get("policy"))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="hysteresis" if "hysteresis" in str(exc) else "threshold") from None
        except OSError as exc:
            raise GatewayError(f"the change is live but could not be saved to the state file: {exc}") from None
        return JSONResponse(threshold_view(state))

    async def get_state(request: Request) -> JSONResponse:
        authorize(request, token)
        snapshot = state.snapshot()
        snapshot["topology"] = state.settings.topology
        if state.switching is not None:
            snapshot.update(state.switching.view())
        return JSONResponse(snapshot)

    async def get_mode(request: Request) -> JSONResponse:
        authorize(request, token)
        if state.switching is None:
            raise InvalidRequest("mode switching needs topology = 'time-shared'", code="not_time_shared")
        return JSONResponse(state.switching.view())

    async def put_mode(request: Request) -> JSONResponse:
        """Force a mode now (the policy is bypassed): 202 while the switch runs, 200 if it already serves."""
        authorize(request, token)
        mode = parse_mode(await read_admin_body(request))
        if state.switching is None:
            raise InvalidRequest("mode switching needs topology = 'time-shared'", code="not_time_shared")
        started = state.switching.request_switch(mode)
        return JSONResponse(state.switching.view(), status_code=202 if started else 200)

    return [
        Route("/admin/threshold", get_threshold, methods=["GET"]),
        Route("/admin/threshold", put_threshold, methods=["PUT"]),
        Route("/admin/state", get_state, methods=["GET"]),
        Route("/admin/mode", get_mode, methods=["GET"]),
        Route("/admin/mode", put_mode, methods=["PUT"]),
    ]
