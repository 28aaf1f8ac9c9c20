"""One adapter per engine, against the stand-in playing each: load read where the engine reports it, busy
reshaped into the gateway's OpenAI 503, the control calls each engine has."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from crossover.gateway.engines import sglang, vllm
from crossover.gateway.engines.adapters import ENGINE_NAMES, SGLANG, VLLM, EngineError, adapter, busy
from tests.gateway.gateway_helpers import LONG, chat
from tests.waiting import wait_until

# Real time (time scale 1), one running request at most: a held stream keeps the server busy for seconds.
SLOW = ("--time-scale", "1", "--max-running-requests", "1")


def hold(url: str, n: int) -> tuple[httpx.Client, list[httpx.Response]]:
    client = httpx.Client(timeout=20, trust_env=False)
    request = lambda: client.build_request("POST", url + "/v1/chat/completions", json=chat(True, LONG))  # noqa: E731
    return client, [client.send(request(), stream=True) for _ in range(n)]


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_each_adapter_reads_the_load_its_engine_reports(sim, engine):
    server = sim("k25-plain", *SLOW, "--engine", engine)
    client, held = hold(server.url, 2)

    async def load(of) -> int:
        async with httpx.AsyncClient(trust_env=False) as c:
            return await of.server_load(c, server.url, headers=None, timeout=5)

    try:
        wait_until(lambda: asyncio.run(load(adapter(engine))) == 2, what=f"{engine}: 1 running + 1 waiting")
        # The other engine's places are not there: its adapter says so, naming where it looked.
        other = VLLM if engine == "sglang" else SGLANG
        with pytest.raises(EngineError, match=f"cannot read the load of {server.url} \\({other.name}\\)"):
            asyncio.run(load(other))
    finally:
        for response in held:
            response.close()
        client.close()
    wait_until(lambda: asyncio.run(load(adapter(engine))) == 0, what="the load to drop once the streams closed")


def test_both_engines_say_busy_with_503_and_each_speaks_its_own_gate_route():
    assert busy(503) and not busy(500) and not busy(None)
    assert (SGLANG.read_gate, SGLANG.write_gate) == (sglang.read_gate, sglang.write_gate)
    assert (VLLM.read_gate, VLLM.write_gate) == (vllm.read_gate, vllm.write_gate)
    # vLLM's sleep does what SGLang's pause and continue do around a release: no separate calls.
    assert VLLM.pause is None and VLLM.resume_generation is None
    assert SGLANG.pause is not None and SGLANG.resume_generation is not None


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_vllm_server_is_the_gateway_s_503_with_retry_after(sim, gateway, stream):
    """vLLM past --max-num-queued-reqs answers 503 (a body, or an event once streaming): both pools on it are
    busy, so the client gets the gateway's 503 with Retry-After and vLLM's message, and no backend is ejected."""
    server = sim("k25-plain", *SLOW, "--max-queued-requests", "1", "--engine", "vllm")
    pools = {mode: {"backends": [server.url], "engine": "vllm"} for mode in ("speculative", "plain")}
    gw = gateway([server.url], [server.url], pools=pools)
    client, held = hold(server.url, 2)  # one runs, one waits: the queue is full
    try:
        wait_until(lambda: asyncio.run(_load(server.url)) == 2, what="a full server")
        response = httpx.post(gw.url + "/v1/chat/completions", json=chat(stream), timeout=20, trust_env=False)
    finally:
        for r in held:
            r.close()
        client.close()
    assert response.status_code == 503 and "retry-after" in response.headers
    error = response.json()["error"]
    assert "The engine is currently busy" in error["message"]
    assert all(backend.healthy for backend in gw.state.pools.all())


async def _load(url: str, engine: str = "vllm") -> int:
    async with httpx.AsyncClient(trust_env=False) as c:
        return await adapter(engine).server_load(c, url, headers=None, timeout=5)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_client_that_leaves_through_the_gateway_is_aborted_in_either_engine(sim, gateway, engine):
    server = sim("k25-plain", *SLOW, "--engine", engine)
    pools = {mode: {"backends": [server.url], "engine": engine} for mode in ("speculative", "plain")}
    gw = gateway([server.url], [server.url], pools=pools)
    client, held = hold(gw.url, 1)
    wait_until(lambda: asyncio.run(_load(server.url, engine)) == 1, what="the stream running in the engine")
    held[0].close()
    client.close()
    wait_until(lambda: asyncio.run(_load(server.url, engine)) == 0, what="the engine to drop the request")
    gw.settled()
