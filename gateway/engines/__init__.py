"""The engines a pool may run, behind one adapter, and the contracts of the calls that move a GPU set: the
GPU-host agent's, and the fencing token every such call carries."""

from __future__ import annotations

from crossover.gateway.engines import gate, sglang, vllm
from crossover.gateway.engines.adapters import (
    DEFAULT_ENGINE,
    ENGINE_NAMES,
    ENGINES,
    EngineAdapter,
    EngineName,
    adapter,
    busy,
)
from crossover.gateway.engines.agent_contract import (
    OPERATIONS,
    SERVER_STATES,
    TOKEN_ENV,
    Operation,
    ServerList,
    ServerState,
    ServerStatus,
)
from crossover.gateway.engines.calls import (
    METRICS_PATH,
    ControlCall,
    EngineError,
    SpecReading,
    control,
    error_message,
    generate_once,
)
from crossover.gateway.engines.fence import (
    FENCE_HEADER,
    FENCE_JUMP,
    FENCED,
    MAX_FENCE_JUMP,
    Fenced,
    LeaseLost,
    fence_headers,
    is_fenced,
    jump_refusal,
    jumps_too_far,
    parse_fence,
    refusal,
)
from crossover.gateway.engines.gate import Gate, GateFenced, GateRejected, MalformedGate, NotPatched
from crossover.gateway.engines.sglang import SGLangError, read_gate, write_gate

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "ENGINE_NAMES",
    "FENCED",
    "FENCE_HEADER",
    "FENCE_JUMP",
    "MAX_FENCE_JUMP",
    "METRICS_PATH",
    "OPERATIONS",
    "SERVER_STATES",
    "TOKEN_ENV",
    "ControlCall",
    "EngineAdapter",
    "EngineError",
    "EngineName",
    "Fenced",
    "Gate",
    "GateFenced",
    "GateRejected",
    "LeaseLost",
    "MalformedGate",
    "NotPatched",
    "Operation",
    "SGLangError",
    "ServerList",
    "ServerState",
    "ServerStatus",
    "SpecReading",
    "adapter",
    "busy",
    "control",
    "error_message",
    "fence_headers",
    "gate",
    "generate_once",
    "is_fenced",
    "jump_refusal",
    "jumps_too_far",
    "parse_fence",
    "read_gate",
    "refusal",
    "sglang",
    "vllm",
    "write_gate",
]
