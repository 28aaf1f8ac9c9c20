"""The zero-step gate as patches/sglang-main serves it, on the stand-in (`crossover sim serve --speculation-gate
--speculation-gate-wire main`): numeric `speculative_adaptive_*` keys of SGLang's own `POST /set_internal_state`
(`{"server_args": {...}}`, answered `[true]` or `[false]`), read back, with why the last update was refused, under
`speculative_adaptive` in `/server_info`'s `internal_states`.

The same StandInGate as the 0.5.23 wire (speculation_gate.py) holds the gate, so the fence, compare-and-set and the
captured steps are judged alike; what differs is only the wire: `-1` removes the gate, the fence is a body key, not
a header, no `dry_run` and no slot `config`, and a refusal is `[false]` with `last_update.reason`
(`rejected`, `stale_generation`, `fenced`, `fence_jump`) where the 0.5.23 wire answers a status.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from crossover.servers.sim.speculation_gate import MAX_GATE_MIN_DWELL_STEPS, GateError, StandInGate

PREFIX = "speculative_adaptive_"
# Field -> its bounds, as the series' check_runtime_update_field (sglang/srt/speculative/adaptive_runtime_state.py).
BOUNDS = {
    "zero_steps_above_bs": (-1, 2**31 - 1),
    "gate_min_dwell_steps": (0, MAX_GATE_MIN_DWELL_STEPS),
    "expected_generation": (0, 2**31 - 1),
    "fence": (0, 10**18 - 1),
}


class InternalStateGate:
    """The series' `speculative_adaptive_*` handler over a StandInGate; `last_update` as the series records it."""

    def __init__(self, gate: StandInGate) -> None:
        self.gate = gate
        self.last_update: dict[str, Any] = {}

    def _record(self, result: str, message: str = "") -> None:
        reason = "" if result == "applied" else result
        self.last_update = {"result": result, "reason": reason, "message": message, "generation": self.gate.generation}

    def set_internal_state(self, server_args: dict[str, Any]) -> bool:
        """One request's keys: True when the gate moved; False (and `last_update` says why) when refused."""
        fields: dict[str, Any] = {}
        for key, value in server_args.items():
            field = key.removeprefix(PREFIX)
            if not key.startswith(PREFIX) or field not in BOUNDS:
                return False  # another key, or one mixed with the gate's: SGLang refuses, logging why
            low, high = BOUNDS[field]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                self._record("rejected", f"{key} must be an int in [{low}, {high}], got {str(value)[:40]}")
                return False
            fields[field] = value
        if "zero_steps_above_bs" not in fields and "gate_min_dwell_steps" not in fields:
            self._record("rejected", "nothing to change")
            return False
        token = fields.pop("fence", None)
        if fields.get("zero_steps_above_bs") == -1:
            fields["zero_steps_above_bs"] = None
        try:
            self.gate.update(fields, fence=token)
        except GateError as exc:
            self._record(exc.reason, str(exc))
            return False
        self._record("applied")
        return True

    def state(self) -> dict[str, Any]:
        """What `/server_info` shows under `speculative_adaptive`."""
        full = self.gate.state()
        keep = (
            "generation",
            "active_steps",
            "captured_steps",
            "captured_graph_bs",
            "zero_steps_above_bs",
            "gate_min_dwell_steps",
            "gate_engaged",
            "gate_flips",
            "decision_errors",
        )
        return {
            **{key: full[key] for key in keep},
            "fence": self.gate.fence(),
            "last_update": dict(self.last_update),
        }


def internal_state_routes(gate: InternalStateGate) -> list[tuple[str, Any, list[str]]]:
    async def set_internal_state(request: Request) -> JSONResponse:
        try:
            gate.gate.authorize(request.headers.get("authorization"))
        except GateError:
            return JSONResponse({"error": "Unauthorized"}, status_code=401)  # SGLang's auth middleware
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            body = None
        server_args = body.get("server_args") if isinstance(body, dict) else None
        if not isinstance(server_args, dict) or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool) for value in server_args.values()
        ):
            # SetInternalStateReq.server_args is Dict[str, int | float]: FastAPI's validation answers 422.
            return JSONResponse({"detail": "server_args must map names to numbers"}, status_code=422)
        return JSONResponse([gate.set_internal_state(server_args)])

    return [("/set_internal_state", set_internal_state, ["POST", "PUT"])]
