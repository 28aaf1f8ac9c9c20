"""`GET/POST /speculation_gate` as patches/vllm-0.32.0 serves it, on the stand-in playing vLLM (`crossover sim serve
--engine vllm --speculation-gate`): the gate with the patch's checks, bounds, replies (vLLM's `ErrorResponse`, its
`type` the reason) and GET fields, and the gauges `vllm:spec_decode_gate` / `_generation`; decode batches above
the gate cost a zero-step step (servers/sim/costs.py), as SGLang mode's do.

The stand-in's start-up schedule is the one a gated vLLM starts with (servers/profiles): K for every batch size but a
full one, K=0 at `max_running_requests` - both query lengths in force - so the Ks a schedule may use are 0 and the
profile's. A `num_speculative_tokens_per_batch_size` is checked as the patch checks it and kept (GET shows it), but
only the gate changes the engine's steps. The admin key and the fence are the SGLang gate's stand-in's
(speculation_gate.py): without `--admin-api-key` the POST is open where the patch answers 403; the fence is checked
with the update and raised only by an applied one.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse

from crossover.gateway.engines import FENCE_HEADER, vllm
from crossover.servers.sim.engine import Engine
from crossover.servers.sim.speculation_gate import MAX_BODY_BYTES, MAX_RUNTIME_INT, GateError, StandInGate

GATE_FIELD, GATE_PATH = vllm.GATE_FIELD, vllm.GATE_PATH
# The patch's bounds and fields (vllm/v1/spec_decode/dynamic/utils.py, entrypoints/serve/dev/sleep/api_router.py).
MAX_RUNTIME_SCHEDULE_ENTRIES = 256
SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"
FIELDS: dict[str, tuple[type, ...]] = {
    GATE_FIELD: (int, type(None)),
    SCHEDULE_FIELD: (list,),
    "reset_schedule": (bool,),
    "expected_generation": (int, type(None)),
    "dry_run": (bool,),
}


def _whole(value: Any, high: int = MAX_RUNTIME_INT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def check_body(body: Any) -> dict[str, Any]:
    """The route's checks (400 `invalid_body`): an object with at least one known field of the right type."""
    if not isinstance(body, dict) or not body:
        raise GateError("the body must be a JSON object with at least one field")
    for name, value in body.items():
        kinds = FIELDS.get(name)
        if kinds is None:
            raise GateError(f"unknown field {name[:64]!r}; known: {sorted(FIELDS)}")
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise GateError(f"{name} has the wrong type")
    return body


def dense_lookup(ranges: list[list[int]], max_num_seqs: int, num_steps: int) -> list[int]:
    """vLLM's `build_dynamic_sd_schedule_lookup` on checked ranges (sorted, from 1, no overlap): the K of each batch
    size (index 0 unused), a gap or the tail carrying the K of the range before it, each K at most `num_steps`."""
    lookup = [0] * (max_num_seqs + 1)
    for batch_size in range(1, max_num_seqs + 1):
        k = next(k for start, _end, k in reversed(ranges) if start <= batch_size)
        lookup[batch_size] = min(k, num_steps)
    return lookup


def widest_batches(lookup: list[int]) -> dict[int, int]:
    """Each K of a lookup and the widest batch size that runs it: how far its query length's CUDA graphs reach when
    the lookup is the start-up one."""
    return {k: batch_size for batch_size, k in enumerate(lookup[1:], start=1)}


def check_schedule(schedule: list, max_num_seqs: int, num_steps: int, widest: dict[int, int]) -> list[list[int]]:
    """The patch's `SpeculationGate._checked_schedule` and its lookup checks (400 `rejected`): only the Ks of the
    start-up schedule, each up to the widest batch it ran at there (`widest`)."""
    if not 0 < len(schedule) <= MAX_RUNTIME_SCHEDULE_ENTRIES:
        message = f"{SCHEDULE_FIELD} must be a list of 1 to {MAX_RUNTIME_SCHEDULE_ENTRIES} ranges"
        raise GateError(message, 400, "rejected")
    ranges = []
    for entry in schedule:
        if not isinstance(entry, list) or len(entry) != 3 or not all(_whole(v) for v in entry):
            raise GateError("each range must be [range_start, range_end, num_speculative_tokens]", 400, "rejected")
        if entry[0] <= 0 or entry[0] > entry[1]:
            raise GateError(f"batch-size range {entry[:2]} must be positive and ordered", 400, "rejected")
        ranges.append(list(entry))
    ranges.sort()
    if ranges[0][0] != 1 or any(b[0] <= a[1] for a, b in itertools.pairwise(ranges)):
        raise GateError("ranges must start at 1 and not overlap", 400, "rejected")
    lookup = dense_lookup(ranges, max_num_seqs, num_steps)
    if missing := sorted(set(lookup[1:]) - set(widest)):
        raise GateError(
            f"num_speculative_tokens {missing} is not in the start-up schedule (only {sorted(widest)}): its query "
            "length has no CUDA graphs captured",
            400,
            "rejected",
        )
    if wider := sorted({k for batch_size, k in enumerate(lookup[1:], start=1) if batch_size > widest[k]}):
        reach = ", ".join(f"K={k} up to {widest[k]}" for k in wider)
        raise GateError(
            f"num_speculative_tokens {wider} at batch sizes past the widest the start-up schedule uses them at "
            f"({reach}): their query lengths have no CUDA graphs captured there",
            400,
            "rejected",
        )
    return ranges


class VLLMStandInGate(StandInGate):
    """The patch's `SpeculationGate` on the stand-in's engine (the fence and admin key are StandInGate's)."""

    def __init__(self, engine: Engine, num_steps: int, **kwargs: Any) -> None:
        super().__init__(engine, num_steps, **kwargs)
        engine.set_gate(engine.zero_steps_above_bs, 0)  # vLLM's gate has no dwell
        self.max_num_seqs = engine.limits.max_running_requests
        top = self.max_num_seqs
        self.startup_schedule = [[1, max(top - 1, 1), num_steps], [top, top, 0]] if top > 1 else [[1, 1, num_steps]]
        self.schedule = self.startup_schedule
        self.widest = widest_batches(dense_lookup(self.startup_schedule, top, num_steps))
        self.allowed = sorted(self.widest)

    def state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            GATE_FIELD: self.engine.zero_steps_above_bs,
            SCHEDULE_FIELD: self.schedule,
            f"startup_{SCHEDULE_FIELD}": self.startup_schedule,
            "allowed_num_speculative_tokens": self.allowed,
            "num_speculative_tokens": self.num_steps,
            "max_num_seqs": self.max_num_seqs,
            "highest_fence": self.fence_highest,
        }

    def update(self, body: Any, fence: int | None = None) -> dict[str, Any]:
        """Checked as the route then the engine core do: the body's form, the fence, the generation, the values;
        the fence raised only by an applied update."""
        fields = check_body(body)
        self.admit(fence)
        expected = fields.get("expected_generation")
        if expected is not None and expected != self.generation:
            raise GateError(
                f"expected generation {expected}, the schedule is at {self.generation}: read it again",
                409,
                "stale_generation",
            )
        gate = fields.get(GATE_FIELD, self.engine.zero_steps_above_bs)
        if gate is not None and not _whole(gate):
            raise GateError(f"{GATE_FIELD} must be null or an integer in [0, {MAX_RUNTIME_INT}]", 400, "rejected")
        schedule = self.schedule
        if fields.get("reset_schedule"):
            if SCHEDULE_FIELD in fields:
                raise GateError(f"reset_schedule and {SCHEDULE_FIELD} exclude each other", 400, "rejected")
            schedule = self.startup_schedule
        elif SCHEDULE_FIELD in fields:
            schedule = check_schedule(fields[SCHEDULE_FIELD], self.max_num_seqs, self.num_steps, self.widest)
        if fields.get("dry_run"):
            return {**self.state(), GATE_FIELD: gate, SCHEDULE_FIELD: schedule}
        self.engine.set_gate(gate, 0)
        self.schedule = schedule
        self.generation += 1
        self.raise_fence(fence)
        return self.state()


class VLLMGateMetrics(Collector):
    """The patch's gauges, set from the gate as it is now (the patch sets them from every answer of the route)."""

    def __init__(self, gate: VLLMStandInGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gate = self._gate.engine.zero_steps_above_bs
        yield GaugeMetricFamily(
            "vllm:spec_decode_gate",
            "Batch size above which the speculation gate schedules zero speculative tokens (-1: no gate).",
            value=-1 if gate is None else gate,
        )
        yield GaugeMetricFamily(
            "vllm:spec_decode_gate_generation",
            "Run-time updates applied to the speculative schedule.",
            value=self._gate.generation,
        )


def vllm_gate_routes(gate: VLLMStandInGate) -> list[tuple[str, Any, list[str]]]:
    def refused(exc: GateError) -> JSONResponse:
        error = {"message": str(exc), "type": exc.reason, "param": None, "code": exc.status}
        return JSONResponse({"error": error}, status_code=exc.status)

    async def read(request: Request) -> JSONResponse:
        try:
            if gate.admin_api_key is not None:
                gate.authorize(request.headers.get("authorization"))
        except GateError as exc:
            return refused(exc)
        return JSONResponse(gate.state())

    async def write(request: Request) -> JSONResponse:
        try:
            gate.authorize(request.headers.get("authorization"))
            token = gate.fence_token(request.headers.get(FENCE_HEADER))
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise GateError(f"the body is larger than {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise GateError("the body is not JSON") from None
            return JSONResponse(gate.update(body, fence=token))
        except GateError as exc:
            return refused(exc)

    return [(GATE_PATH, read, ["GET"]), (GATE_PATH, write, ["POST"])]
