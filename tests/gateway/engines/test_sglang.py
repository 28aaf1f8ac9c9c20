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


def test_the_gate_on_the_main_series_wire_set_internal_state_and_server_info(sim):
    """A server patched with patches/sglang-main has no /speculative/adaptive: the same calls go through numeric
    speculative_adaptive_* keys of /set_internal_state, read back in /server_info, each refusal as the 0.5.23 series
    answers it."""
    server = sim("llama8b-h200-eagle3", "--speculation-gate", "--speculation-gate-wire", "main")

    async def scenario() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(server.url + sglang.GATE_PATH)).status_code == 404

            async def write(gate: int | None, fence: int | None = None, **kwargs) -> sglang.Gate:
                return await sglang.write_gate(client, server.url, gate, headers=None, timeout=9, fence=fence, **kwargs)

            assert (await write(16, 2)).zero_steps_above_bs == 16
            with pytest.raises(sglang.GateFenced) as caught:
                await write(4, 1)
            assert isinstance(caught.value, Fenced) and caught.value.reason == "fenced"
            assert caught.value.highest == 2  # read back from the refusal's words, as on the 0.5.23 wire
            with pytest.raises(sglang.GateRejected) as stale:
                await write(4, 2, expected_generation=0)
            assert (stale.value.status, stale.value.reason) == (409, "stale_generation")
            dry = await write(8, 2, dry_run=True)  # the main series has no dry run: a read, nothing moves
            assert (dry.zero_steps_above_bs, dry.generation) == (16, 1)
            gate = await sglang.read_gate(client, server.url, headers=None, timeout=10)
            assert (gate.zero_steps_above_bs, gate.generation, gate.groups) == (16, 1, 1)
            cleared = await write(None, 3, expected_generation=1)
            assert (cleared.zero_steps_above_bs, cleared.generation) == (None, 2)
            info = (await client.get(server.url + "/server_info")).json()["internal_states"][0]
            assert info["speculative_adaptive"]["fence"] == {"highest": 3, "refused": 1}
            assert info["speculative_adaptive"]["last_update"]["result"] == "applied"
            refused = await client.post(
                server.url + "/set_internal_state", json={"server_args": {"speculative_adaptive_fence": {"n": 1}}}
            )
            assert refused.status_code == 422  # server_args holds numbers only

    asyncio.run(scenario())


def test_a_server_with_neither_gate_is_not_patched(sim):
    server = sim("llama8b-h200-eagle3")  # no --speculation-gate

    async def scenario() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(sglang.NotPatched, match="speculative_adaptive"):
                await sglang.read_gate(client, server.url, headers=None, timeout=10)
            with pytest.raises(sglang.NotPatched):
                await sglang.write_gate(client, server.url, 8, headers=None, timeout=10)

    asyncio.run(scenario())
