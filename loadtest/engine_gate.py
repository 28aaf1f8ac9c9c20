"""`crossover bench --in-engine URL`: one gated server measured twice, gate off and gate at 0.

Either engine's gate: patches/sglang-0.5.23 (`/speculative/adaptive`, or SGLang main's `/set_internal_state`) and
patches/vllm-0.32.0 (`/speculation_gate`), spoken through the gateway's own engine adapters, so the bench moves a
gate exactly as the in-engine topology does. The engine is the one whose gate route answers (vLLM's is tried first:
an SGLang server answers it 404). A null gate removes it (speculation at every batch); 0 runs every decode batch
without drafts (SGLang: zero-step; vLLM: K=0, the draft's first forward still runs to keep its KV in sync). The two
settings become two targets of the sweep (`gate-off`, `gate-0`), set right before each of their passes, so the
existing interval and crossover code says where "off" overtakes speculation on the user's own hardware. The
engine's own gate is read first and written back at the end, whatever ends the run.
"""

from __future__ import annotations

import httpx

from crossover.gateway.engines import ENGINES, EngineAdapter, EngineError, Gate, GateRejected, NotPatched

GATE_OFF = "gate-off"
GATE_ZERO = "gate-0"
# Target name -> the engine's gate while that target is measured.
GATES: dict[str, int | None] = {GATE_OFF: None, GATE_ZERO: 0}
GATE_TIMEOUT_S = 10.0
# Tried in this order by the first read (module docstring).
ENGINE_ORDER = ("vllm", "sglang")
KEY_HINT = " (needs the engine's admin key: --admin-key-file)"


class EngineGateError(Exception):
    """The engine's gate cannot be read or set; the message says what the engine answered."""


class EngineGate:
    """The gate of one engine, read and written through the engine's adapter."""

    def __init__(self, base_url: str, admin_key: str | None = None) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1")
        # Both patches demand the engine's admin key on a write; vLLM's on a read too.
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.engine: EngineAdapter | None = None  # known after the first read

    async def read(self) -> int | None:
        """The gate the engine runs now (None: no gate)."""
        async with httpx.AsyncClient(trust_env=False) as client:
            if self.engine is not None:
                return (await self._call(self.engine, client, None, read=True)).zero_steps_above_bs
            unpatched = []
            for name in ENGINE_ORDER:
                try:
                    gate = await self._call(ENGINES[name], client, None, read=True, probing=True)
                except NotPatched as exc:
                    unpatched.append(str(exc))
                    continue
                self.engine = ENGINES[name]
                return gate.zero_steps_above_bs
        raise EngineGateError(f"{self.url}: no speculation gate answers: {'; '.join(unpatched)}")

    async def set(self, gate: int | None) -> None:
        if self.engine is None:
            await self.read()
        assert self.engine is not None
        async with httpx.AsyncClient(trust_env=False) as client:
            state = await self._call(self.engine, client, gate)
        if state.zero_steps_above_bs != gate:
            raise EngineGateError(f"{self.url}: asked for gate {gate}, the engine reports {state.zero_steps_above_bs}")

    async def _call(
        self,
        engine: EngineAdapter,
        client: httpx.AsyncClient,
        gate: int | None,
        *,
        read: bool = False,
        probing: bool = False,
    ) -> Gate:
        try:
            if read:
                return await engine.read_gate(client, self.url, headers=self._headers, timeout=GATE_TIMEOUT_S)
            return await engine.write_gate(client, self.url, gate, headers=self._headers, timeout=GATE_TIMEOUT_S)
        except NotPatched:
            if probing:
                raise
            raise EngineGateError(f"{self.url}: the {engine.name} server has no speculation gate now") from None
        except EngineError as exc:
            key = isinstance(exc, GateRejected) and exc.unauthorized
            raise EngineGateError(f"{exc}{KEY_HINT if key else ''}") from None
        except (httpx.HTTPError, TimeoutError) as exc:
            raise EngineGateError(f"{self.url}: the gate did not answer: {exc!r}") from None
