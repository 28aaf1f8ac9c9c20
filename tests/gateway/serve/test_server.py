"""The uvicorn server `crossover serve` and `crossover demo` run the gateway on: its set-up, its fit to the
descriptor limit, and its shutdown."""

import asyncio
import json
import signal
import subprocess
import sys
from collections import Counter

import httpx

from crossover.gateway.config import Settings
from crossover.gateway.serve.server import GC_THRESHOLDS, make_server
from tests.gateway.gateway_helpers import LONG, Scripted, chat, sse_events, wait_until

POOLS = {"speculative": {"backends": ["http://s:1"]}, "plain": {"backends": ["http://p:2"]}}


def test_the_server_is_set_up_for_many_long_streams():
    config = make_server(Settings(pools=POOLS, timeouts={"client_keepalive": 75, "graceful_shutdown": 12})).config
    assert (config.loop, config.access_log) == ("uvloop", False)
    assert (config.http.max_head_bytes, config.http.head_timeout, config.http.body_timeout) == (
        64 * 1024,
        10.0,
        30.0,
    )  # bounded request heads
    assert config.timeout_keep_alive == 75 and config.timeout_graceful_shutdown == 12
    assert (config.host, config.port) == ("127.0.0.1", 8000)


def test_flags_override_the_listen_address():
    config = make_server(Settings(pools=POOLS, port=9001), host="0.0.0.0", port=9100).config
    assert (config.host, config.port) == ("0.0.0.0", 9100)


GC_PROBE = """
import asyncio, gc, json
from crossover.gateway.config import Settings
from crossover.gateway.serve.server import GC_THRESHOLDS, make_server

async def main():
    default = gc.get_threshold()
    pools = {"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:7"]}}
    server = make_server(Settings(pools=pools, port=0, timeouts={"shutdown_delay": 0}))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(json.dumps({"default": default, "serving": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
    server.should_exit = True
    await serving

asyncio.run(main())
"""


def test_once_started_the_heap_is_frozen_and_the_collector_runs_less_often():
    # In a process of its own: the collector's settings belong to the whole process.
    done = subprocess.run([sys.executable, "-c", GC_PROBE], capture_output=True, text=True, timeout=60, check=True)
    probe = json.loads(done.stdout.splitlines()[0])
    assert probe["default"] == [700, 10, 10] and probe["serving"] == list(GC_THRESHOLDS)
    assert probe["frozen"] > 10_000  # the modules and the app, never scanned again


def gateway_config(sims, extra: str = "") -> str:
    speculative, plain = sims
    pools = f'[pools.speculative]\nbackends = ["{speculative.url}"]\n[pools.plain]\nbackends = ["{plain.url}"]\n'
    return pools + extra


def test_a_descriptor_limit_too_small_is_said_at_start_and_met_with_429s(serve, gateway_process):
    """Under `ulimit -n 256` the default max_inflight of 1024 cannot fit: the gateway says so, serves what
    fits, and tells every client beyond it 429 - never a dropped connection, never a backend's fault. (More
    connections at once than the descriptors themselves cannot be answered by anyone: 160 clients here.)"""
    # Backends that open every stream at once and then hold it, however many there are.
    backends = [serve(Scripted(chunks=[b"data: {}\n\n", b"data: [DONE]\n\n"], stall_after=1)) for _ in range(2)]
    pools = f'[pools.speculative]\nbackends = ["{backends[0].url}"]\n[pools.plain]\nbackends = ["{backends[1].url}"]\n'
    gw = gateway_process(pools + "[timeouts]\nqueue = 1.0\n", nofile=256)
    assert "descriptor limit (ulimit -n 256) cannot hold max_inflight = 1024" in gw.log()

    async def scenario():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=limits, trust_env=False) as client:

            async def one():
                request = client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG))
                response = await client.send(request, stream=True)
                if response.status_code == 200:
                    response.chunks = response.aiter_raw()  # kept: a dropped iterator would close the response
                    await anext(response.chunks)  # under way: holds its descriptors
                    return response
                await response.aread()
                await response.aclose()
                return response

            responses = await asyncio.gather(*(one() for _ in range(160)), return_exceptions=True)
            errors = [response for response in responses if isinstance(response, BaseException)]
            statuses = Counter(response.status_code for response in responses if not isinstance(response, Exception))
            refused = [r for r in responses if not isinstance(r, BaseException) and r.status_code != 200]
            await asyncio.gather(*(r.aclose() for r in responses if not isinstance(r, BaseException)))
            return errors, statuses, refused

    errors, statuses, refused = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert errors == []  # every client got an HTTP answer
    assert set(statuses) <= {200, 429} and statuses[200] >= 40 and statuses[429] > 0, statuses
    assert all(response.json()["error"]["type"] == "rate_limit_error" for response in refused)
    samples = gw.metrics()
    assert all(value == 1 for (name, _), value in samples.items() if name == "crossover_backend_healthy")
    assert not any(name == "crossover_backend_ejections_total" for name, _ in samples)


async def stream_through_a_stop(gw, client: httpx.AsyncClient, stop) -> bytes:
    """A long stream through `gw`; once its first chunk is in, `await stop()`; then the whole stream."""
    request = client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG))
    stream = await client.send(request, stream=True)
    chunks = stream.aiter_raw()
    first = await anext(chunks)
    await stop()
    return first + b"".join([chunk async for chunk in chunks])


def assert_cut_cleanly(streamed: bytes, gw) -> None:
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "gateway_unavailable"
    gw.proc.wait(30)
    assert "Traceback" not in gw.log() and "Exception in ASGI" not in gw.log()


def test_shutdown_turns_health_503_first_then_ends_streams_cleanly(sims, gateway_process):
    gw = gateway_process(gateway_config(sims, "[timeouts]\nshutdown_delay = 3.0\ngraceful_shutdown = 2.0\n"))
    served = []

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client:

            async def sigterm():
                gw.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(wait_until, lambda: _health(gw.url) == 503, what="/health to turn 503")
                # Still serving during the delay: a load balancer has time to notice.
                served.append(await client.post("/v1/chat/completions", json=chat()))

            return await stream_through_a_stop(gw, client, sigterm)

    streamed = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert served[0].status_code == 200
    assert_cut_cleanly(streamed, gw)
    assert gw.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_a_forced_exit_still_ends_streams_with_an_error_event(sims, gateway_process):
    # Ctrl-C twice: no waiting for graceful_shutdown, but cut streams still say so, and nothing is a traceback.
    gw = gateway_process(gateway_config(sims, "[timeouts]\ngraceful_shutdown = 60\n"))

    async def twice_ctrl_c():
        gw.proc.send_signal(signal.SIGINT)
        await asyncio.to_thread(wait_until, lambda: _health(gw.url) is None, what="the listener to close")
        gw.proc.send_signal(signal.SIGINT)

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client:
            return await stream_through_a_stop(gw, client, twice_ctrl_c)

    assert_cut_cleanly(asyncio.run(asyncio.wait_for(scenario(), 60)), gw)
    assert "forced exit" in gw.log() and gw.proc.returncode == 130  # Ctrl-C, as a shell reports it


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code
    except httpx.HTTPError:
        return None
