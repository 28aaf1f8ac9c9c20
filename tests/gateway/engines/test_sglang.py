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


def test_acceptance_is_the_spec_accept_length_gauge_over_the_ranks_that_report_one():
    from crossover.gateway.engines.sglang import acceptance_from_metrics

    def gauge(*values: float) -> str:
        lines = "".join(
            f'sglang:spec_accept_length{{model_name="m",tp_rank="{rank}"}} {value}\n'
            for rank, value in enumerate(values)
        )
        return f"# HELP sglang:spec_accept_length x\n# TYPE sglang:spec_accept_length gauge\n{lines}"

    assert acceptance_from_metrics(gauge(2.5, 2.5)).accept_length == 2.5
    assert acceptance_from_metrics(gauge(0.0)) is None  # a plain server, or no window yet
    assert acceptance_from_metrics("sglang:num_running_reqs 1\n") is None
