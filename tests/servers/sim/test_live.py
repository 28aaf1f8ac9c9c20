"""The live engine against its own virtual-time curve, and its lifecycle, over real sockets."""

import asyncio
import signal
import time

import httpx

from crossover.servers.sim.curve import sweep
from crossover.servers.sim.profile import load_profile

TIME_SCALE = 4.0
LEVELS = (1, 8, 32)
INPUT_LEN, OUTPUT_LEN = 16, 128
WARMUP_S, WINDOW_S = 1.0, 3.0
# Clients that resend late on a busy machine leave the batch short for a moment: that, not the engine, is
# what the tolerance allows for. The engine's own speed cannot matter: the window is read on its clock.
TOLERANCE = 0.15
FLOOR = 0.5


async def engine_counters(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """(the engine's clock in profile seconds, output tokens it has generated), from /server_info."""
    schedule = (await client.get(f"{url}/server_info")).json()["schedule"]
    return schedule["clock_s"], schedule["generated_tokens"]


async def live_throughput(url: str, concurrency: int) -> float:
    """Closed-loop streams; output tokens per profile second of the engine's own clock over the window.

    Judged on the stand-in's clock, not the wall's: a machine too busy to keep the schedule makes the window
    last longer in wall time, not deliver fewer tokens per simulated second.
    """
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": " ".join(["the"] * INPUT_LEN)}],
        "max_tokens": OUTPUT_LEN,
        "stream": True,
    }
    stop = asyncio.Event()

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    pass

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        try:
            await asyncio.sleep(WARMUP_S)  # the load's duration, not a wait for readiness
            clock0, tokens0 = await engine_counters(client, url)
            await asyncio.sleep(WINDOW_S)
            clock1, tokens1 = await engine_counters(client, url)
        finally:
            stop.set()
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return (tokens1 - tokens0) / (clock1 - clock0)


def test_live_sim_reproduces_its_virtual_curve(sim):
    server = sim("k25-eagle3", "--time-scale", str(TIME_SCALE))
    virtual = sweep(load_profile("k25-eagle3"), list(LEVELS), input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    ratios = {}
    for point in virtual:
        live = asyncio.run(live_throughput(server.url, point.concurrency))
        ratios[point.concurrency] = live / point.output_throughput
    print("live / virtual throughput (profile time):", {c: round(r, 3) for c, r in ratios.items()})
    for concurrency, ratio in ratios.items():
        # Above: the stand-in can never beat its own model, however idle the machine. Below, load can only
        # lower the ratio - clients starved of CPU leave the closed loop open and the engine idles between a
        # stream's end and its resend (0.79 seen beside the whole suite on 2 cores) - so the bound there only
        # catches an engine that runs at half its model's speed or worse.
        assert FLOOR <= ratio <= 1.0 + TOLERANCE, (concurrency, ratios)


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
        assert time.monotonic() - started < 15.0  # the stream it cut would have run for minutes


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
