"""`GET/POST /speculative/adaptive` as patches/sglang-0.5.23 serves it, on the stand-in (`crossover sim serve
--speculation-gate`): the zero-step gate with the patch's validation and replies; decode batches above the gate
cost a zero-step step (servers/sim/costs.py, ZERO_STEP_MODEL). The stand-in has one step count, so slot configs
(`config`, `reset_config`) are refused with a reason; everything else answers as the patch does.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from crossover.servers.sim.engine import Engine

# The patch's bounds and fields (sglang/srt/speculative/adaptive_spec_params.py, patched).
MAX_RUNTIME_INT = 2**31 - 1
FIELDS = (
    "config",
    "reset_config",
    "zero_steps_above_bs",
    "allow_eager_fallback",
    "skip_zero_step_draft_extend",
    "expected_generation",
    "dry_run",
)
MAX_BODY_BYTES = 64 * 1024


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_RUNTIME_INT <= value <= MAX_RUNTIME_INT


class GateError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class StandInGate:
    """The gate's state on one stand-in engine; `generation` counts applied updates, as the patch's does."""

    def __init__(self, engine: Engine, num_steps: int) -> None:
        self.engine = engine
        self.num_steps = num_steps
        self.generation = 0
        self.updates = {"applied": 0, "rejected": 0, "conflict": 0}

    def state(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "generation": self.generation,
            "active_steps": 0 if engine.gated(engine.num_running) else self.num_steps,
            "captured_steps": sorted({0, self.num_steps}),
            "zero_steps_above_bs": engine.zero_steps_above_bs,
            # The stand-in's own counters (not in the patch's reply): what the gate did so far.
            "decode_batches": engine.decode_batches_total,
            "zero_step_batches": engine.zero_step_batches_total,
            "skip_zero_step_draft_extend": {
                "override": engine.skip_zero_step_draft_extend,
                "effective": engine.skip_zero_step_draft_extend,
            },
        }

    def update(self, body: Any) -> dict[str, Any]:
        fields = parse_body(body)
        expected = fields.get("expected_generation")
        if expected is not None and expected != self.generation:
            self.updates["conflict"] += 1
            raise GateError(
                f"expected_generation={expected} but the policy is at generation {self.generation}; re-read it and "
                "retry",
                409,
            )
        if "config" in fields or fields.get("reset_config"):
            self.updates["rejected"] += 1
            raise GateError("the stand-in models the zero-step gate only: it has no slot config to replace")
        if fields.get("dry_run"):
            return {**self.state(), "zero_steps_above_bs": fields.get("zero_steps_above_bs")}
        if "zero_steps_above_bs" in fields:
            self.engine.zero_steps_above_bs = fields["zero_steps_above_bs"]
        if "skip_zero_step_draft_extend" in fields:
            self.engine.skip_zero_step_draft_extend = bool(fields["skip_zero_step_draft_extend"])
        self.generation += 1
        self.updates["applied"] += 1
        return self.state()


def parse_body(body: Any) -> dict[str, Any]:
    """The patch's `parse_runtime_update_body` rules for what the stand-in models; GateError (400) otherwise."""
    if not isinstance(body, dict):
        raise GateError("body must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise GateError(f"unknown fields {unknown}; allowed: {list(FIELDS)}")
    for flag in ("reset_config", "allow_eager_fallback", "dry_run"):
        if flag in body and not isinstance(body[flag], bool):
            raise GateError(f"{flag} must be true or false")
    skip = body.get("skip_zero_step_draft_extend")
    if skip is not None and not isinstance(skip, bool):
        raise GateError("skip_zero_step_draft_extend must be true, false or null")
    gate = body.get("zero_steps_above_bs")
    if gate is not None and (not _is_int(gate) or gate < 0):
        raise GateError(f"zero_steps_above_bs must be an int in [0, {MAX_RUNTIME_INT}] or null")
    expected = body.get("expected_generation")
    if expected is not None and (not _is_int(expected) or expected < 0):
        raise GateError(f"expected_generation must be an int in [0, {MAX_RUNTIME_INT}]")
    if body.get("config") is not None and body.get("reset_config"):
        raise GateError("give either config or reset_config, not both")
    if (
        body.get("config") is None
        and not body.get("reset_config")
        and "zero_steps_above_bs" not in body
        and "skip_zero_step_draft_extend" not in body
    ):
        raise GateError(
            "nothing to change: give config, reset_config, zero_steps_above_bs or skip_zero_step_draft_extend"
        )
    return {key: value for key, value in body.items() if key != "config" or value is not None}


def gate_routes(gate: StandInGate) -> list[tuple[str, Any, list[str]]]:
    async def read(request: Request) -> JSONResponse:
        state = gate.state()
        return JSONResponse({"success": True, "message": "", "state": state, "states": [state]})

    async def write(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            if len(raw) > MAX_BODY_BYTES:
                raise GateError("body too large")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise GateError(str(exc) or "invalid JSON") from None
            state = gate.update(body)
        except GateError as exc:
            return JSONResponse({"success": False, "message": str(exc), "partial": False}, status_code=exc.status)
        message = "applied; takes effect from the next decode batch"
        return JSONResponse({"success": True, "message": message, "state": state, "states": [state]})

    return [("/speculative/adaptive", read, ["GET"]), ("/speculative/adaptive", write, ["POST"])]
