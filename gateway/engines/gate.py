"""The run-time speculation gate, whichever engine holds it: what one server says about its gate, and how a gate call
fails. Each engine's module speaks its own route (`sglang.py`: `/speculative/adaptive` of patches/sglang-0.5.23;
`vllm.py`: `/speculation_gate` of patches/vllm-0.32.0) and raises these, so gateway/topology/gates.py moves either
through the adapter (`EngineAdapter.read_gate` / `write_gate`) without knowing which.

The gate itself is one number: batches of more than N running requests run no draft tokens (None: no gate; 0:
never speculate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from crossover.gateway.engines.calls import EngineError
from crossover.gateway.engines.fence import FENCE_JUMP, Fenced

# The reason both patches give a compare-and-set (`expected_generation`) that lost to a newer write.
STALE_GENERATION = "stale_generation"


class NotPatched(EngineError):
    """A server with no gate to move: no gate route (an unpatched engine), or the patch's 501 `not_applicable` (no
    speculation, no schedule to gate, PP > 1, data parallelism): no retry or gateway restart fixes it."""


class GateRejected(EngineError):
    """The server answered, but refused the gate (`reason` says how, the message why) or read back another value."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason

    @property
    def refused(self) -> bool:
        """The engine refused this gate itself (400 `invalid_body` / `rejected`): keep the one it has."""
        return self.status == 400

    @property
    def stale(self) -> bool:
        """409 `stale_generation`: a compare-and-set lost to a write made since its read - the gate is not wrong."""
        return self.reason == STALE_GENERATION

    @property
    def unauthorized(self) -> bool:
        """401 `unauthorized` / 403 `admin_api_key_required`: the gateway's admin credential is wrong or missing (a
        403 `fence_jump` is the fence's, not the credential's)."""
        return self.status in (401, 403) and self.reason != FENCE_JUMP


class GateFenced(GateRejected, Fenced):
    """409 `fenced`: the engine accepted a newer lease's fencing token; this gateway no longer leads its gate."""


class MalformedGate(GateRejected, ValueError):
    """A 200 whose state is not a gate (`"state": "idle"`, `"generation": null`): logged, counted, read again."""


@dataclass(frozen=True, slots=True)
class Gate:
    """What one server's engine says about its gate, as last read back (DP group 0's, when all groups agree)."""

    zero_steps_above_bs: int | None
    generation: int
    active_steps: int | None = None
    # How many DP groups answered (SGLang's `states`, one per group); they all hold this gate.
    groups: int = 1


def whole(value: object) -> TypeGuard[int]:
    """A non-negative int (not a bool): what a gate, a generation or a step count must be."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
