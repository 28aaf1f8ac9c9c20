"""The live engine against its own virtual-time curve, and its lifecycle, over real sockets."""

import asyncio
import re
import signal
import time

import httpx
import pytest

from crossover.servers.sim.curve import sweep
from crossover.servers.sim.profile import load_profile

TIME_SCALE = 8.0
LEVELS = (1, 8, 32)
INPUT_LEN, OUTPUT_LEN = 16, 128
WARMUP_S, WINDOW_S = 1.0, 3.0
TOKENS = re.compile(rb'"completion_tokens":(\d+)')


async def live_throughput(url: str, concurrency: int) -> float:
    """Closed-loop streams; output tokens arriving inside the window / window (real tok/s)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": " ".join(["the"] * INPUT_LEN)}],
        "max_tokens": OUTPUT_LEN,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    loop = asyncio.get_running_loop()
    start = loop.time() + WARMUP_S
    end = start + WINDOW_S
    counted = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal counted
        while loop.time() < end:
            seen = 0
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for data in response.aiter_bytes():
                    found = TOKENS.findall(data)
                    if found:
                        total = int(found[-1])
                        if start <= loop.time() < end:
                            counted += total - seen
                        seen = total
            assert seen == OUTPUT_LEN

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), 60)
    return counted / WINDOW_S


def test_live_sim_reproduces_its_virtual_curve(sim):
    server = sim("k25-eagle3", "--time-scale", str(TIME_SCALE))
    virtual = sweep(load_profile("k25-eagle3"), list(LEVELS), input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    ratios = {}
    for point in virtual:
        live = asyncio.run(live_throughput(server.url, point.concurrency))
        ratios[point.concurrency] = live / TIME_SCALE / point.output_throughput
    print("live / virtual throughput:", {c: round(r, 3) for c, r in ratios.items()})
    for concurrency, ratio in ratios.items():
        assert ratio == pytest.approx(1.0, abs=0.15), (concurrency, ratios)


def test_sigterm_stops_a_busy_sim_promptly(sim):
    server = sim("k25-plain", "--time-scale", "1")
    with httpx.Client(timeout=10.0) as client:
        request = client.build_request(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000, "stream": True},
        )
        response = client.send(request, stream=True)
        lines = response.iter_lines()
        next(lines)
        started = time.monotonic()
        server.proc.terminate()
        rest = [line for line in lines if line]  # the stream ends cleanly rather than being cut
        assert '"finish_reason":"abort"' in rest[-2] and rest[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once shut down, so the exit status says SIGTERM.
        assert server.proc.wait(timeout=10) in (0, -signal.SIGTERM)
        assert time.monotonic() - started < 5.0


def test_measured_first_token_is_not_held_behind_a_longer_wait(sim_app, tmp_path):
    # An odd but legal curve: alone, a request waits 5 s for its first token; with company, 0.1 s.
    profile = tmp_path / "odd.toml"
    profile.write_text(
        'kind = "measured"\nmodel_name = "m"\npoints = ['
        "{concurrency = 1, per_request_throughput = 50.0, ttft_s = 5.0},"
        "{concurrency = 2, per_request_throughput = 50.0, ttft_s = 0.1}]\n"
    )
    server = sim_app(str(profile), time_scale=1.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(timeout=10.0) as client:
        first = client.send(
            client.build_request("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}),
            stream=True,
        )
        second = client.post(f"{server.url}/v1/chat/completions", json=body)
        assert second.json()["usage"]["completion_tokens"] == 1
        metrics = client.get(f"{server.url}/metrics").text
        assert 'sglang:time_to_first_token_seconds_count{model_name="m"} 1.0' in metrics  # only the second
        first.close()
