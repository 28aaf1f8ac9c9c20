"""`crossover bench --in-engine URL`: one patched SGLang measured twice, gate off and gate at 0.

The patch (patches/sglang-0.5.23) serves `GET/POST /speculative/adaptive`; `zero_steps_above_bs` null removes
the gate (speculation at every batch), 0 runs every decode batch zero-step. The two settings become two targets
of the sweep (`gate-off`, `gate-0`), set right before each of their passes, so the existing interval and
crossover code says where zero-step overtakes speculation on the user's own GPU. The engine's own gate is
read first and written back at the end, whatever ends the run.
"""

from __future__ import annotations

import httpx

GATE_OFF = "gate-off"
GATE_ZERO = "gate-0"
# Target name -> the engine's zero_steps_above_bs while that target is measured.
GATES: dict[str, int | None] = {GATE_OFF: None, GATE_ZERO: 0}
GATE_TIMEOUT_S = 10.0
GATE_PATH = "/speculative/adaptive"


class EngineGateError(Exception):
    """The engine's gate cannot be read or set; the message says what the engine answered."""


class EngineGate:
    """The gate of one engine, read and written through the patch's endpoint."""

    def __init__(self, base_url: str, admin_key: str | None = None) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1") + GATE_PATH
        # The patch demands the engine's admin key on POST; GET stays open.
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    async def _call(self, method: str, body: dict | None = None) -> dict:
        try:
            async with httpx.AsyncClient(timeout=GATE_TIMEOUT_S) as client:
                response = await client.request(method, self.url, json=body, headers=self._headers)
            reply = response.json()
            state = reply["state"]
            if response.status_code != 200 or not isinstance(state, dict):
                raise ValueError
        except httpx.HTTPError as exc:
            raise EngineGateError(f"{method} {self.url}: {exc!r}") from None
        except (ValueError, KeyError, TypeError):
            why = f"HTTP {response.status_code}: {response.text[:300]}"
            hint = " (needs the engine's admin key: --admin-key-file)" if response.status_code in (401, 403) else ""
            raise EngineGateError(f"{method} {self.url}: {why}{hint}; is it a patched in-engine server?") from None
        return state

    async def read(self) -> int | None:
        """The gate the engine runs now (None: no gate)."""
        return (await self._call("GET")).get("zero_steps_above_bs")

    async def set(self, gate: int | None) -> None:
        state = await self._call("POST", {"zero_steps_above_bs": gate})
        if state.get("zero_steps_above_bs") != gate:
            raise EngineGateError(f"POST {self.url}: asked for gate {gate}, the engine reports {state}")
