"""vLLM's runtime surface as the gateway reads it: its scheduler gauges, its sleep calls, the patched gate."""

from __future__ import annotations

import pytest

from crossover.gateway.engines.vllm import SLEEP, WAKE_UP, load_from_metrics

# As vLLM 0.32 writes them with two data-parallel engines (vllm/v1/metrics/loggers.py: labels model_name, engine).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_load_is_running_plus_waiting_summed_over_engines():
    assert load_from_metrics(VLLM_METRICS) == 3 + 2 + 4
    with pytest.raises(ValueError, match="vllm:num_requests_running"):
        load_from_metrics('sglang:num_running_reqs{tp_rank="0"} 3\n')


def test_sleep_keeps_weights_in_host_memory_and_ends_what_runs_and_wake_up_wakes_everything():
    assert SLEEP.path == "/sleep?level=1&mode=abort" and SLEEP.name == "release"
    assert WAKE_UP.path == "/wake_up" and WAKE_UP.name == "resume"


def spec_counters(drafts: float, accepted: float) -> str:
    """vLLM 0.32's speculative counters, two DP engines sharing the counts."""
    return f"""\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts / 2}
vllm:spec_decode_num_drafts_total{{engine="1",model_name="m"}} {drafts / 2}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted / 2}
vllm:spec_decode_num_accepted_tokens_total{{engine="1",model_name="m"}} {accepted / 2}
vllm:spec_decode_num_accepted_tokens_created{{engine="0",model_name="m"}} 1.7e9
"""


def test_acceptance_is_one_plus_accepted_over_drafts_between_two_readings_not_since_start():
    from crossover.gateway.engines.vllm import acceptance_from_metrics

    assert acceptance_from_metrics(VLLM_METRICS) is None  # no speculation
    first = acceptance_from_metrics(spec_counters(1000, 2000))
    assert first is not None and first.accept_length is None and first.counts == (1000, 2000)  # a window starts
    second = acceptance_from_metrics(spec_counters(1100, 2050), first)
    assert second is not None and second.accept_length == pytest.approx(1.5)  # 1 + 50/100, not 1 + 2050/1100
    idle = acceptance_from_metrics(spec_counters(1100, 2050), second)
    assert idle is not None and idle.accept_length == pytest.approx(1.5)  # nothing drafted: the last window stands
    restarted = acceptance_from_metrics(spec_counters(10, 5), idle)
    assert restarted is not None and restarted.accept_length is None and restarted.counts == (10, 5)


def test_the_gate_goes_through_vllms_route_with_its_fence_key_and_errors(sim):
    """gateway/engines/vllm.py against the stand-in's patched /speculation_gate (servers/sim/vllm_gate.py): the token
    travels as the header, a stale one is `GateFenced` whose `highest` the fence reads back, a missing key is
    `unauthorized`, a K the start-up schedule never used is refused, an unpatched server is `NotPatched`."""
    import asyncio

    import httpx

    from crossover.gateway.engines import GateFenced, GateRejected, NotPatched, vllm

    server = sim("llama8b-h200-eagle3", "--engine", "vllm", "--speculation-gate", "--admin-api-key", "k")
    plain = sim("llama8b-h200-eagle3", "--engine", "vllm")
    admin = {"Authorization": "Bearer k"}

    async def scenario() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:

            async def write(gate: int | None, fence: int | None, headers=admin, **kwargs) -> vllm.Gate:
                url = server.url
                return await vllm.write_gate(client, url, gate, headers=headers, timeout=10, fence=fence, **kwargs)

            assert (await write(16, 2)).zero_steps_above_bs == 16
            with pytest.raises(GateFenced) as caught:
                await write(4, 1)
            assert caught.value.highest == 2 and caught.value.reason == "fenced"
            with pytest.raises(GateRejected) as caught:
                await write(4, None, headers=None)
            assert caught.value.unauthorized and caught.value.status == 401
            assert (await write(3, None, dry_run=True)).zero_steps_above_bs == 3
            with pytest.raises(GateRejected) as caught:
                await write(3, None, expected_generation=0)
            assert (caught.value.status, caught.value.reason) == (409, "stale_generation")
            gate = await vllm.read_gate(client, server.url, headers=admin, timeout=10)
            assert (gate.zero_steps_above_bs, gate.generation) == (16, 1)
            assert (await write(None, 3)).zero_steps_above_bs is None
            schedule = {"num_speculative_tokens_per_batch_size": [[1, 8, 2]]}
            refused = await client.post(server.url + vllm.GATE_PATH, json=schedule, headers=admin)
            assert (refused.status_code, refused.json()["error"]["type"]) == (400, "rejected")
            with pytest.raises(NotPatched, match=r"patches/vllm-0\.32\.0"):
                await vllm.read_gate(client, plain.url, headers=None, timeout=10)

    asyncio.run(scenario())
