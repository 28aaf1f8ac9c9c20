"""`GET/POST /speculative/adaptive` as patches/sglang-0.5.23 serves it, on the stand-in (`crossover sim serve
--speculation-gate`): the zero-step gate with the patch's validation, bounds, replies (status and `reason`), GET
fields and metrics; decode batches above the gate cost a zero-step step (servers/sim/costs.py, ZERO_STEP_MODEL).

The stand-in captured two step counts (0 and the profile's), has no CUDA graphs and one speculative step count,
so a slot `config` is checked as the patch checks it and kept (GET shows it) but does not change the engine's
steps. One deliberate difference: without `--admin-api-key` the stand-in's POST is open, where the patch answers
403 (`admin_api_key_required`) - so that a gateway that sends no admin credential still drives it; with a key,
it answers 401 as the patch does.

The fencing token (gateway/engines/fence.py) as the patch checks it: a malformed `X-Crossover-Fence` is refused with
400 `invalid_fence` after the admin key; then the body is read and checked (400 `invalid_body`); then, with the
update itself and before the generation or the slots, a token lower than the highest one an applied update carried
is refused with 409 `fenced` (logged, counted in the reply's `fence`) - so a writer whose body arrives after a newer
token's update is refused, whenever its headers came. Only an applied update raises the fence: a refused one (a bad
body, a stale generation, a rejection) or a dry run leaves it where it was. None at all is accepted. One more than
`fence_max_jump` above the highest (`crossover sim serve --fence-max-jump`, default MAX_FENCE_JUMP, 0: no limit) is
refused with 403 `fence_jump`, logged, the fence unchanged - a check the stand-in has ahead of the patch, which
forgets its fence on a restart where the agent keeps its on disk. Each raise is logged at INFO, old and new token.
The patch's bounds on work are the stand-in's too: at most MAX_ADAPTIVE_SLOTS slots of at most
MAX_CANDIDATE_STEPS_LEN candidate steps each, a body of at most MAX_BODY_BYTES; past them, 400 `invalid_body`.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse

from crossover.gateway.engines import (
    FENCE_HEADER,
    FENCE_JUMP,
    FENCED,
    MAX_FENCE_JUMP,
    jump_refusal,
    jumps_too_far,
    parse_fence,
    refusal,
)
from crossover.servers.sim.engine import Engine

# The patch's bounds and fields (sglang/srt/speculative/adaptive_spec_params.py, patched).
MAX_RUNTIME_INT = 2**31 - 1
MAX_CANDIDATE_STEP = 64
MAX_HYSTERESIS = float(MAX_CANDIDATE_STEP)
MAX_CEILING_COEFF = float(MAX_CANDIDATE_STEP)
MAX_ADAPTIVE_SLOTS = 256
MAX_CANDIDATE_STEPS_LEN = MAX_CANDIDATE_STEP + 1
DEFAULT_GATE_MIN_DWELL_STEPS = 32
MAX_GATE_MIN_DWELL_STEPS = 100_000
FIELDS = ("zero_steps_above_bs", "gate_min_dwell_steps", "config", "reset_config", "expected_generation", "dry_run")
SLOT_KNOBS = (
    "candidate_steps",
    "ema_alpha",
    "update_interval",
    "warmup_batches",
    "down_hysteresis",
    "up_hysteresis",
    "ceiling_coeff",
)
UPDATE_RESULTS = ("applied", "rejected", "conflict", "failed")
MAX_BODY_BYTES = 64 * 1024

logger = logging.getLogger(__name__)


def _is_int(value: Any, low: int = -MAX_RUNTIME_INT, high: int = MAX_RUNTIME_INT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any, low: float, high: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return low <= value <= high


_KNOB_CHECKS = (
    ("ema_alpha", lambda v: _is_number(v, 0, 1) and v > 0, "a number in (0, 1]"),
    ("update_interval", lambda v: _is_int(v, 1), f"an int in [1, {MAX_RUNTIME_INT}]"),
    ("warmup_batches", lambda v: _is_int(v, 0), f"an int in [0, {MAX_RUNTIME_INT}]"),
    (
        "down_hysteresis",
        lambda v: _is_number(v, -MAX_HYSTERESIS, MAX_HYSTERESIS),
        f"a number in [-{MAX_HYSTERESIS:g}, {MAX_HYSTERESIS:g}]",
    ),
    (
        "up_hysteresis",
        lambda v: _is_number(v, -MAX_HYSTERESIS, MAX_HYSTERESIS),
        f"a number in [-{MAX_HYSTERESIS:g}, {MAX_HYSTERESIS:g}]",
    ),
    ("ceiling_coeff", lambda v: _is_number(v, 0, MAX_CEILING_COEFF), f"a number in [0, {MAX_CEILING_COEFF:g}]"),
)


class GateError(ValueError):
    """A refusal: the patch's HTTP status and machine-readable reason."""

    def __init__(self, message: str, status: int = 400, reason: str = "invalid_body") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def _clip(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters, for a refusal's message (as the patch does)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_knobs(where: str, knobs: dict) -> None:
    for name, ok, expected in _KNOB_CHECKS:
        if name in knobs and not ok(knobs[name]):
            raise GateError(f"{where}: {name} must be {expected}, got {_clip(knobs[name])}")


def normalize_config(cfg: Any) -> dict:
    """The patch's `normalize_adaptive_config`: comment keys dropped, BS keys canonical, everything bounded."""
    if not isinstance(cfg, dict):
        raise GateError(f"config must be a JSON object of BS slots, got {type(cfg).__name__}")
    clean: dict = {}
    spelled: dict[str, str] = {}
    for key, value in cfg.items():
        if key.startswith("_"):
            continue
        if key.isascii() and key.isdigit():
            if len(spelled) >= MAX_ADAPTIVE_SLOTS:
                raise GateError(
                    f"config has more than {MAX_ADAPTIVE_SLOTS} BS slots; a batch routes to one of the captured "
                    "CUDA-graph sizes, so more slots than those cannot matter"
                )
            if int(key) > MAX_RUNTIME_INT:
                raise GateError(f"BS {key}: batch size out of range")
            canonical = str(int(key))
            if canonical in spelled:
                raise GateError(f"BS keys {spelled[canonical]!r} and {key!r} name the same batch size")
            spelled[canonical] = key
            if not isinstance(value, dict):
                raise GateError(f"BS {key}: slot must be a JSON object, got {value!r}")
            unknown = sorted(k for k in value if k not in SLOT_KNOBS and not k.startswith("_"))
            if unknown:
                raise GateError(f"BS {key}: unknown keys {unknown}; allowed: {list(SLOT_KNOBS)}")
            steps = value.get("candidate_steps")
            if (
                not isinstance(steps, list)
                or not steps
                or len(steps) > MAX_CANDIDATE_STEPS_LEN
                or not all(_is_int(s, 0, MAX_CANDIDATE_STEP) for s in steps)
            ):
                raise GateError(
                    f"BS {key}: candidate_steps must be a non-empty list of at most {MAX_CANDIDATE_STEPS_LEN} ints "
                    f"in [0, {MAX_CANDIDATE_STEP}], got {_clip(steps)}"
                )
            _check_knobs(f"BS {key}", value)
            clean[canonical] = {
                k: list(v) if k == "candidate_steps" else v for k, v in value.items() if k in SLOT_KNOBS
            }
        elif key in SLOT_KNOBS and key != "candidate_steps":
            _check_knobs("config", {key: value})
            clean[key] = value
        else:
            raise GateError(
                f"unknown top-level key {key!r}: use integer-string BS keys or slot defaults {list(SLOT_KNOBS[1:])}"
            )
    if not spelled:
        raise GateError(
            'config must contain at least one integer-string BS key, e.g. {"1": {"candidate_steps": [1, 3]}}'
        )
    return clean


def parse_body(body: Any) -> dict[str, Any]:
    """The patch's `parse_runtime_update_body`: GateError (400, invalid_body) for what it refuses."""
    if not isinstance(body, dict):
        raise GateError("body must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise GateError(f"unknown fields {unknown}; allowed: {list(FIELDS)}")
    fields = dict(body)
    if body.get("config") is not None:
        fields["config"] = normalize_config(body["config"])
    else:
        fields.pop("config", None)
    for flag in ("reset_config", "dry_run"):
        if flag in body and not isinstance(body[flag], bool):
            raise GateError(f"{flag} must be true or false")
    if "config" in fields and body.get("reset_config"):
        raise GateError("give either config or reset_config, not both")
    gate = body.get("zero_steps_above_bs")
    if gate is not None and not _is_int(gate, 0):
        raise GateError(f"zero_steps_above_bs must be an int in [0, {MAX_RUNTIME_INT}] or null")
    if "gate_min_dwell_steps" in body and not _is_int(body["gate_min_dwell_steps"], 0, MAX_GATE_MIN_DWELL_STEPS):
        raise GateError(f"gate_min_dwell_steps must be an int in [0, {MAX_GATE_MIN_DWELL_STEPS}]")
    expected = body.get("expected_generation")
    if expected is not None and not _is_int(expected, 0):
        raise GateError(f"expected_generation must be an int in [0, {MAX_RUNTIME_INT}]")
    if (
        "config" not in fields
        and not body.get("reset_config")
        and "zero_steps_above_bs" not in body
        and "gate_min_dwell_steps" not in body
    ):
        raise GateError("nothing to change: give zero_steps_above_bs, gate_min_dwell_steps, config or reset_config")
    return fields


def bearer_matches(authorization: str | None, key: str) -> bool:
    """SGLang's check of an `Authorization: Bearer <key>` header (constant-time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


class StandInGate:
    """The gate's state on one stand-in engine; `generation` counts applied updates, as the patch's does."""

    def __init__(
        self,
        engine: Engine,
        num_steps: int,
        *,
        admin_api_key: str | None = None,
        fence_max_jump: int = MAX_FENCE_JUMP,
    ) -> None:
        self.engine = engine
        self.num_steps = num_steps
        self.admin_api_key = admin_api_key
        self.fence_max_jump = fence_max_jump
        self.generation = 0
        engine.set_gate(engine.zero_steps_above_bs, DEFAULT_GATE_MIN_DWELL_STEPS)
        self.captured_steps = sorted({0, num_steps})
        self.startup_config = {"1": {"candidate_steps": [num_steps]}}
        self.config = self.startup_config
        self.updates = dict.fromkeys(UPDATE_RESULTS, 0)
        self.fence_highest: int | None = None
        self.fenced = 0

    def state(self) -> dict[str, Any]:
        engine = self.engine
        engaged = engine.gated(engine.num_running)
        return {
            "generation": self.generation,
            "active_steps": 0 if engaged else self.num_steps,
            "captured_steps": self.captured_steps,
            "captured_graph_bs": {str(step): None for step in self.captured_steps},  # no CUDA graphs
            "cuda_graph_bs": None,
            "zero_steps_above_bs": engine.zero_steps_above_bs,
            "gate_min_dwell_steps": engine.gate_min_dwell_steps,
            "gate_engaged": engaged,
            "gate_flips": engine.gate_flips_total,
            "decision_errors": 0,
            "config": self.config,
            "slot_state": {
                key: {"current_steps": self.num_steps, "ema_accept_len": 0.0, "batches_seen": 0} for key in self.config
            },
            # The stand-in's own counters (not in the patch's reply): what the gate did so far.
            "decode_batches": engine.decode_batches_total,
            "zero_step_batches": engine.zero_step_batches_total,
        }

    def authorize(self, authorization: str | None) -> None:
        """The patch's admin-key check on POST (open while the stand-in has no key: see the module's note)."""
        if self.admin_api_key is not None and not bearer_matches(authorization, self.admin_api_key):
            raise GateError("Unauthorized", 401, "unauthorized")

    @staticmethod
    def fence_token(header: str | None) -> int | None:
        """The token a POST's `X-Crossover-Fence` carries (None: none); GateError (400) for a malformed one."""
        try:
            return parse_fence(header)
        except ValueError as exc:
            raise GateError(str(exc), 400, "invalid_fence") from None

    def admit(self, token: int | None) -> None:
        """The patch's fence, checked with the update: GateError unless an update carrying `token` may move the gate.
        Raises nothing: only an applied update does (`raise_fence`)."""
        if token is None:
            return
        if self.fence_highest is not None and token < self.fence_highest:
            self.fenced += 1
            self.updates["conflict"] += 1
            message = refusal(token, self.fence_highest)
            logger.warning("/speculative/adaptive refused: %s", message)
            raise GateError(message, 409, FENCED)
        if self.fence_highest is not None and jumps_too_far(token, self.fence_highest, self.fence_max_jump):
            message = jump_refusal(token, self.fence_highest, self.fence_max_jump)
            logger.warning("/speculative/adaptive refused: %s", message)
            raise GateError(message, 403, FENCE_JUMP)

    def raise_fence(self, token: int | None) -> None:
        if token is None:
            return
        if token != self.fence_highest:
            logger.info("/speculative/adaptive: fence raised from %s to %d", self.fence_highest, token)
        self.fence_highest = token

    def fence(self) -> dict[str, Any]:
        return {"highest": self.fence_highest, "refused": self.fenced}

    def update(self, body: Any, fence: int | None = None) -> dict[str, Any]:
        """Apply a POST's body carrying the fencing token `fence` (None: no header), as the patch's scheduler does:
        the body checked, then the fence, the generation and the slots; the fence raised only if it is applied."""
        fields = parse_body(body)
        self.admit(fence)
        expected = fields.get("expected_generation")
        if expected is not None and expected != self.generation:
            self.updates["conflict"] += 1
            raise GateError(
                f"expected_generation={expected} but the policy is at generation {self.generation}; re-read it and "
                "retry",
                409,
                "stale_generation",
            )
        config = self.startup_config if fields.get("reset_config") else fields.get("config", self.config)
        for bs, slot in sorted((int(k), v) for k, v in config.items() if k.isdigit()):
            missing = sorted(set(slot["candidate_steps"]) - set(self.captured_steps))
            if missing:
                self.updates["rejected"] += 1
                raise GateError(
                    f"BS {bs}: candidate_steps {missing} have no runtime state; only the step counts captured at "
                    f"startup can be used: {self.captured_steps}. Restart with a --speculative-adaptive-config that "
                    "lists them to make them available.",
                    400,
                    "rejected",
                )
        gate = fields.get("zero_steps_above_bs", self.engine.zero_steps_above_bs)
        dwell = fields.get("gate_min_dwell_steps", self.engine.gate_min_dwell_steps)
        if fields.get("dry_run"):
            return {**self.state(), "zero_steps_above_bs": gate, "gate_min_dwell_steps": dwell, "config": config}
        self.engine.set_gate(gate, dwell)
        self.config = config
        self.generation += 1
        self.updates["applied"] += 1
        self.raise_fence(fence)
        return self.state()


class GateMetrics(Collector):
    """The patch's policy metrics beside the stand-in's `sglang:spec_adaptive_zero_steps_above_bs`."""

    def __init__(self, gate: StandInGate, labels: dict[str, str]) -> None:
        self._gate, self._labels = gate, labels

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        names, values = list(self._labels), list(self._labels.values())
        generation = GaugeMetricFamily(
            "sglang:spec_adaptive_policy_generation",
            "Runtime adaptive-speculation policy updates applied since startup.",
            labels=names,
        )
        generation.add_metric(values, self._gate.generation)
        yield generation
        updates = CounterMetricFamily(
            "sglang:spec_adaptive_policy_updates",
            "Runtime adaptive-speculation policy updates, by result (applied, rejected, conflict, failed).",
            labels=[*names, "result"],
        )
        for result, count in self._gate.updates.items():
            updates.add_metric([*values, result], count)
        yield updates


def gate_routes(gate: StandInGate) -> list[tuple[str, Any, list[str]]]:
    def refused(exc: GateError) -> JSONResponse:
        body = {"success": False, "message": str(exc), "reason": exc.reason, "partial": False}
        return JSONResponse(body, status_code=exc.status)

    async def read(request: Request) -> JSONResponse:
        state = gate.state()
        return JSONResponse({"success": True, "message": "", "state": state, "states": [state], "fence": gate.fence()})

    async def write(request: Request) -> JSONResponse:
        try:
            gate.authorize(request.headers.get("authorization"))
            token = gate.fence_token(request.headers.get(FENCE_HEADER))
        except GateError as exc:
            return refused(exc)
        raw = await request.body()
        try:
            if len(raw) > MAX_BODY_BYTES:
                raise GateError(f"body too large: at most {MAX_BODY_BYTES} bytes are read, got {len(raw)}")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise GateError(str(exc) or "invalid JSON") from None
            state = gate.update(body, fence=token)
        except GateError as exc:
            return refused(exc)
        message = (
            "dry run: nothing applied" if body.get("dry_run") else "applied; takes effect from the next decode batch"
        )
        return JSONResponse(
            {"success": True, "message": message, "state": state, "states": [state], "fence": gate.fence()}
        )

    return [("/speculative/adaptive", read, ["GET"]), ("/speculative/adaptive", write, ["POST"])]
