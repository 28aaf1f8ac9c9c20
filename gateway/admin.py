"""The operator's API: read and change the routing threshold live, and inspect pools and backends.

    curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:8000/admin/threshold
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"threshold": 24}' http://127.0.0.1:8000/admin/threshold
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"priority_headroom": 32}' .../admin/threshold  # service_tier
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"spillover_share": 0.5}' .../admin/threshold  # spillover
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"mode": "plain"}' http://127.0.0.1:8000/admin/mode
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"mode": "plain", "pin": true}' .../admin/mode  # until unpinned
    curl -X PUT -H "Authorization: Bearer $TOKEN" -d '{"enabled": true}' .../admin/adaptive  # after a threshold PUT

With [adaptive] enabled, a PUT of the threshold pins it: the adaptive controller pauses until PUT /admin/adaptive
{"enabled": true} (`false` pauses it without moving the threshold).

With no admin token configured the API answers 403: it is never open.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from crossover.gateway.config import MAX_THRESHOLD, POOL_NAMES, Mode, Policy, ThresholdError
from crossover.gateway.errors import AdaptiveOff, BodyTooLarge, InvalidRequest, RequestTimeout, StateNotSaved
from crossover.gateway.request import authorize_admin
from crossover.gateway.state import GatewayState

MAX_ADMIN_BODY_BYTES = 64 * 1024
# An admin body is a few bytes: one that trickles in is not an operator.
ADMIN_BODY_TIMEOUT_S = 10.0

_Count = Annotated[int, Field(strict=True, ge=0, le=MAX_THRESHOLD)]
# A number, not a string that reads as one; NaN and infinities are refused by the bounds and allow_inf_nan.
_Share = Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)]
_Body = TypeVar("_Body", bound=BaseModel)


class ThresholdUpdate(BaseModel):
    """PUT /admin/threshold: any of these, at least one (`priority_headroom`: per speculative server, as the
    config's)."""

    model_config = ConfigDict(extra="forbid")

    # Absent means "keep"; an explicit null is refused (defaults are not validated, values are).
    threshold: _Count = None  # type: ignore[assignment]
    hysteresis: _Count = None  # type: ignore[assignment]
    policy: Policy = None  # type: ignore[assignment]
    priority_headroom: _Count = None  # type: ignore[assignment]
    spillover_share: _Share = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _something(self) -> ThresholdUpdate:
        if not self.model_fields_set:
            raise PydanticCustomError(
                "empty_update",
                "send at least one of threshold, hysteresis, policy, priority_headroom, spillover_share",
            )
        return self


class ModeUpdate(BaseModel):
    """PUT /admin/mode: a mode to switch to now, and/or `pin` (true: the policy leaves the mode alone until
    unpinned; false: unpin). At least one."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode = None  # type: ignore[assignment]
    pin: StrictBool = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _something(self) -> ModeUpdate:
        if not self.model_fields_set:
            raise PydanticCustomError("empty_update", "send mode, pin, or both")
        return self


class AdaptiveUpdate(BaseModel):
    """PUT /admin/adaptive: `enabled` true resumes the adaptive controller (after an operator's threshold paused it),
    false pauses it."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool


def parse_body(model: type[_Body], body: bytes) -> _Body:
    """The admin body as `model`, or InvalidRequest naming the first field at fault."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or None
        code = "invalid_json" if error["type"] in ("json_invalid", "model_type") else "invalid_value"
        message = f"'{field}': {error['msg']}" if field else error["msg"]
        raise InvalidRequest(message, param=field, code=code) from None


async def read_admin_body(request: Request) -> bytes:
    body = b""
    try:
        async with asyncio.timeout(ADMIN_BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_ADMIN_BODY_BYTES:
                    raise BodyTooLarge(f"an admin request body is at most {MAX_ADMIN_BODY_BYTES} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the admin request body did not arrive within {ADMIN_BODY_TIMEOUT_S:g} s") from None
    return body


def threshold_view(state: GatewayState) -> dict:
    pools = state.pools
    return {
        **state.routing.state(),
        "load_signal": pools.load_signal,
        "loads": {name: pools.pool_load(name) for name in POOL_NAMES},
        **state.topology.threshold_view(),
    }


def admin_routes(state: GatewayState) -> list[Route]:
    """What the threshold, a mode and a pin mean is the topology's (gateway/topology/factory.py); what it cannot honour
    it refuses with a 409."""
    token = state.settings.admin_token
    topology = state.topology
    adaptive = state.adaptive

    async def get_threshold(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        await topology.refresh()
        return JSONResponse(threshold_view(state))

    async def put_threshold(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        update = parse_body(ThresholdUpdate, await read_admin_body(request))
        fields = set(update.model_fields_set)
        topology.check_threshold_update(fields)
        try:
            state.routing.update(
                update.threshold, update.hysteresis, update.policy, update.priority_headroom, update.spillover_share
            )
        except ThresholdError as exc:
            raise InvalidRequest(str(exc), param=exc.field, code="invalid_value") from None
        except OSError as exc:
            raise StateNotSaved(f"the change is live but could not be saved to the state file: {exc}") from None
        if "threshold" in fields:
            adaptive.pause("an operator's PUT /admin/threshold")  # before `share`: every replica's pause
        await topology.threshold_changed(fields)
        await topology.share()
        return JSONResponse(threshold_view(state))

    async def get_state(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        await topology.refresh()
        return JSONResponse(state.snapshot())

    async def get_mode(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        await topology.refresh()
        return JSONResponse(topology.mode_view())

    async def put_mode(request: Request) -> JSONResponse:
        """Force a mode now and/or pin it: the status and view are the topology's (time-shared: 202 while the
        switch runs, 200 if it already serves)."""
        authorize_admin(request.headers.get("authorization"), token)
        update = parse_body(ModeUpdate, await read_admin_body(request))
        view, status = await topology.set_mode(update.mode, update.pin)
        await topology.share()
        return JSONResponse(view, status_code=status)

    async def get_adaptive(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        await topology.refresh()
        return JSONResponse(adaptive.view())

    async def put_adaptive(request: Request) -> JSONResponse:
        authorize_admin(request.headers.get("authorization"), token)
        update = parse_body(AdaptiveUpdate, await read_admin_body(request))
        if not state.settings.adaptive.enabled:
            raise AdaptiveOff(
                "the adaptive controller is off in this gateway's settings ([adaptive] enabled = false): there is "
                "nothing to resume or pause",
                param="enabled",
            )
        if update.enabled:
            adaptive.resume()
        else:
            adaptive.pause("an operator's PUT /admin/adaptive")
        await topology.share()
        return JSONResponse(adaptive.view())

    return [
        Route("/admin/threshold", get_threshold, methods=["GET"]),
        Route("/admin/threshold", put_threshold, methods=["PUT"]),
        Route("/admin/state", get_state, methods=["GET"]),
        Route("/admin/mode", get_mode, methods=["GET"]),
        Route("/admin/mode", put_mode, methods=["PUT"]),
        Route("/admin/adaptive", get_adaptive, methods=["GET"]),
        Route("/admin/adaptive", put_adaptive, methods=["PUT"]),
    ]
