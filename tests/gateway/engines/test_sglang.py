"""gateway/engines/sglang.py's gate write under a fencing token, against the stand-in's patched /speculative/adaptive:
the token travels as the header, and the engine's 409 `fenced` is `GateFenced` (a `Fenced`), never a retryable
conflict."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossover.gateway.engines import sglang
from crossover.gateway.engines.fence import Fenced


def test_a_gate_write_carries_the_fence_and_a_stale_one_is_gate_fenced(sim):
    server = sim("llama8b-h200-eagle3", "--speculation-gate")

    async def scenario() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:

            async def write(gate: int, fence: int | None) -> sglang.Gate:
                return await sglang.write_gate(client, server.url, gate, headers=None, timeout=10, fence=fence)

            assert (await write(16, 2)).zero_steps_above_bs == 16
            with pytest.raises(sglang.GateFenced) as caught:
                await write(4, 1)
            assert isinstance(caught.value, Fenced) and caught.value.reason == "fenced"
            assert "token 1" in str(caught.value) and "token 2" in str(caught.value)
            gate = await sglang.read_gate(client, server.url, headers=None, timeout=10)
            assert (gate.zero_steps_above_bs, gate.generation) == (16, 1)
            assert (await write(8, 2)).zero_steps_above_bs == 8 and (await write(8, None)).generation == 3

    asyncio.run(scenario())
