"""The stand-in's HTTP surface: SGLang's endpoints (0.5.23, entrypoints/http_server.py) over one LiveEngine, or
vLLM's (`engine="vllm"`, vllm_surface.py).

    run(SimSettings(profile=load_profile("k25-eagle3"), port=30001, time_scale=50.0))   # until SIGTERM
    app = create_app(settings, registry=CollectorRegistry())                              # to embed or test

Generation lives in generation.py; this module holds health, info, load, metrics and the admin endpoints
(pause/continue, release/resume memory, flush cache). `/server_info` says that this is a simulator.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from crossover.gateway.engines import DEFAULT_ENGINE, MAX_FENCE_JUMP, EngineName
from crossover.servers.profile import ENGINE_TITLES, SIM_SLEEP_ARGS
from crossover.servers.sim import generation
from crossover.servers.sim.engine import PAUSE_MODES, Engine
from crossover.servers.sim.generation import TooLarge, json_response, read_json
from crossover.servers.sim.internal_state_gate import InternalStateGate, internal_state_routes
from crossover.servers.sim.live import MEMORY_TAGS, Busy, LiveEngine
from crossover.servers.sim.metrics import SimMetrics
from crossover.servers.sim.openai_format import (
    SGLANG_ERRORS,
    VLLM_ERRORS,
    WEIGHT_VERSION,
    BadRequest,
    ErrorShape,
    error_body,
)
from crossover.servers.sim.profile import Profile, ProfileError
from crossover.servers.sim.speculation_gate import GateMetrics, StandInGate, bearer_matches, gate_routes
from crossover.servers.sim.vllm_gate import VLLMGateMetrics, VLLMStandInGate, vllm_gate_routes
from crossover.servers.sim.vllm_surface import VLLM_VERSION, Route, vllm_routes

SGLANG_VERSION = "0.5.23"  # the release whose surface the stand-in mirrors
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
# Requests still open at SIGTERM are aborted first; anything left after this long is cancelled.
SHUTDOWN_GRACE_S = 1.0


@dataclass(frozen=True)
class Surface:
    """What differs between the engines the stand-in plays (`--engine`), besides their routes (create_app's)."""

    errors: ErrorShape
    # A request while the memory is released: refused, 503 (SGLang), or held until it is resumed (vLLM asleep).
    refuses_released: bool


SURFACES: dict[EngineName, Surface] = {
    "sglang": Surface(SGLANG_ERRORS, refuses_released=True),
    "vllm": Surface(VLLM_ERRORS, refuses_released=False),
}


@dataclass(frozen=True)
class SimSettings:
    profile: Profile
    host: str = "127.0.0.1"
    port: int = 30000
    time_scale: float = 1.0
    # Wall-clock overrides of the profile's [memory] durations (None: the profile's, divided by time_scale).
    startup_delay_s: float | None = None
    release_delay_s: float | None = None
    resume_delay_s: float | None = None
    seed: int = 0
    extra_metric_labels: dict[str, str] = field(default_factory=dict)
    # Serve /speculative/adaptive as a server patched with patches/sglang-0.5.23 (speculative profiles only).
    speculation_gate: bool = False
    # SGLang's --admin-api-key: the gate's POST then needs it (speculation_gate.py says what it does without one), and
    # so do pause/continue and release/resume (SGLang's ADMIN_OPTIONAL endpoints: open only while no key is set).
    admin_api_key: str | None = None
    # The gate's fence: how far above the highest accepted a token may lie (0: no limit), as the agent's.
    fence_max_jump: int = MAX_FENCE_JUMP
    # Which patch series' wire the gate speaks: "0.5.23" (/speculative/adaptive) or "main" (/set_internal_state keys,
    # read back in /server_info; internal_state_gate.py).
    speculation_gate_wire: str = "0.5.23"
    # The engine it plays: SGLang's surface, or vLLM's (vllm_surface.py: its endpoints, metric names, errors).
    engine: EngineName = DEFAULT_ENGINE
    # vLLM's --enable-sleep-mode (with VLLM_SERVER_DEV_MODE=1): /sleep, /wake_up and /is_sleeping.
    sleep_mode: bool = False


# The stand-in's acceptance, changed live (tests, and whatever plays a traffic shift).
ACCEPTANCE_PATH = "/sim/acceptance"


def run(settings: SimSettings, *, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM. Open streams end cleanly (finish_reason "abort", [DONE]) at shutdown."""
    # The stand-in's own warnings (falling behind its schedule, a resume of unreleased memory) on stderr.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.live.abort_all()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    Server(config).run()


def create_app(settings: SimSettings, *, registry: CollectorRegistry | None = None) -> FastAPI:
    profile = settings.profile
    live = LiveEngine(
        Engine(profile, random.Random(settings.seed)),
        time_scale=settings.time_scale,
        memory=profile.memory,
        startup_delay_s=settings.startup_delay_s,
        release_delay_s=settings.release_delay_s,
        resume_delay_s=settings.resume_delay_s,
    )
    spec = profile.speculative
    metrics = SimMetrics(
        registry or CollectorRegistry(),
        live,
        model_name=profile.model_name,
        extra_labels=settings.extra_metric_labels,
        num_spec_steps=spec.num_steps if spec else 0,
        engine=settings.engine,
    )
    surface, title = SURFACES[settings.engine], ENGINE_TITLES[settings.engine]
    errors = surface.errors
    if settings.sleep_mode and not SIM_SLEEP_ARGS[settings.engine]:
        raise ValueError(f"--enable-sleep-mode is vLLM's: the {title} stand-in always has its memory saver")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await live.start()
        try:
            yield
        finally:
            await live.stop()

    app = FastAPI(title=f"crossover sim: a simulated {title} server", lifespan=lifespan)
    # As SGLang's HTTP server: every response then says `vary: Origin`.
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and methods: the same error body as every other failure, not FastAPI's {"detail"}.
        err_type = errors.http_type(HTTPStatus(exc.status_code).phrase)
        return json_response(errors.body(str(exc.detail), status=exc.status_code, err_type=err_type), exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect) -> Response:
        # The client left while its body was still arriving: nothing reached the engine, and nobody reads this.
        return Response(status_code=499)

    app.state.live, app.state.metrics = live, metrics
    generation.register(app, live, metrics, profile, errors, refuse_released=surface.refuses_released)

    async def health() -> Response:
        return Response(status_code=200 if live.healthy else 503)

    async def model_info() -> Response:
        return json_response(
            {
                "model_path": profile.model_name,
                "tokenizer_path": profile.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": WEIGHT_VERSION,
                "served_model_name": profile.model_name,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            }
        )

    upstream_gate: list[InternalStateGate] = []  # the main series' gate, read back in /server_info

    async def server_info() -> Response:
        return json_response(
            {
                **server_args(settings),
                "memory": memory_report(live),
                "max_total_num_tokens": profile.limits.max_total_num_tokens,
                "max_req_input_len": profile.limits.context_length - 1,
                "internal_states": [internal_state(live, profile, upstream_gate)],
                "version": SGLANG_VERSION,
                **simulation_report(settings, live),
            }
        )

    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(profile)]})

    async def model(model: str) -> Response:
        if model != profile.model_name:
            return json_response(
                {
                    "error": {
                        "message": f"The model '{model}' does not exist",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                404,
            )
        return json_response(model_card(profile))

    async def loads(request: Request) -> Response:
        params = request.query_params
        include = [s.strip() for s in params["include"].split(",")] if params.get("include") else ["all"]
        unknown = sorted(set(include) - set(LOAD_SECTIONS))
        if unknown:
            return json_response(
                error_body(
                    f"Invalid include sections: {unknown}. Valid options: {sorted(LOAD_SECTIONS)}",
                    status=400,
                    err_type="400",
                ),
                400,
            )
        if params.get("dp_rank") not in (None, "0"):
            return json_response(
                error_body("dp_rank out of range: this server has one DP rank (0)", status=400, err_type="400"), 400
            )
        load = load_report(live, profile, set(include))
        if params.get("format") == "prometheus":
            return PlainTextResponse(loads_prometheus(load), media_type="text/plain; version=0.0.4; charset=utf-8")
        return json_response({"timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_VERSION, "loads": [load]})

    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def flush_cache() -> Response:
        # SGLang: is_fully_idle(ignore_waiting=paused) - retracted requests waiting in a paused engine are fine.
        engine = live.engine
        idle = not engine.num_running and (engine.paused or not engine.num_waiting)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n",
            status_code=200 if idle else 400,
        )

    def unauthorized(request: Request) -> Response | None:
        """SGLang's answer to a control call without the admin key, when the server has one (else None)."""
        key = settings.admin_api_key
        if key is None or bearer_matches(request.headers.get("authorization"), key):
            return None
        return json_response({"error": "Unauthorized"}, 401)

    async def pause_generation(request: Request) -> Response:
        if refused := unauthorized(request):
            return refused
        try:
            body = await _optional_json(request)
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise BadRequest(f"'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        except (BadRequest, TooLarge) as exc:
            return json_response(error_body(str(exc)), 400)
        live.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> Response:
        if refused := unauthorized(request):
            return refused
        try:
            await _optional_json(request)
        except (BadRequest, TooLarge) as exc:
            return json_response(error_body(str(exc)), 400)
        live.resume_generation()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(request: Request) -> Response:
        if refused := unauthorized(request):
            return refused
        try:
            await live.release_memory(await _tags(request))
        except (BadRequest, TooLarge, Busy) as exc:
            return json_response({"error": {"message": str(exc)}}, 400)
        return json_response(None)

    async def resume_memory(request: Request) -> Response:
        if refused := unauthorized(request):
            return refused
        try:
            await live.resume_memory(await _tags(request))
        except (BadRequest, TooLarge) as exc:
            return json_response({"error": {"message": str(exc)}}, 400)
        return json_response(None)

    async def vllm_server_info() -> Response:
        # vLLM's /server_info (dev mode) dumps its config; the stand-in's says what it simulates, as SGLang's does.
        return json_response({"version": VLLM_VERSION, **simulation_report(settings, live)})

    async def acceptance(request: Request) -> Response:
        """The stand-in's own control (no engine has it): GET the acceptance later draws have, POST
        `{"accept_length": 1.5}` to change it live - the traffic changed. SGLang's gauge and vLLM's counters follow."""
        engine = live.engine
        if engine.acceptance is None:
            return json_response(error_body("this profile does not speculate: it has no acceptance"), 400)
        if request.method == "POST":
            if refused := unauthorized(request):
                return refused
            try:
                value = (await _optional_json(request)).get("accept_length")
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise BadRequest(f"'accept_length' must be a number, got {value!r}")
                engine.set_accept_length(float(value))
            except (BadRequest, TooLarge, ProfileError) as exc:
                return json_response(error_body(str(exc)), 400)
        return json_response({"accept_length": engine.acceptance.mean, "num_steps": engine.acceptance.num_steps})

    def gate_args() -> tuple[int, dict]:
        """The gate's step count and keywords, either engine's."""
        if spec is None:
            raise ValueError("--speculation-gate needs a speculative profile (the gate sends batches to zero steps)")
        return spec.num_steps, {"admin_api_key": settings.admin_api_key, "fence_max_jump": settings.fence_max_jump}

    def vllm_surface() -> list[Route]:
        routes: list[Route] = []
        if settings.speculation_gate:
            num_steps, kwargs = gate_args()
            vllm_gate = VLLMStandInGate(live.engine, num_steps, **kwargs)
            metrics.registry.register(VLLMGateMetrics(vllm_gate))
            routes += vllm_gate_routes(vllm_gate)
        return [
            *routes,
            (ACCEPTANCE_PATH, acceptance, ["GET", "POST"]),
            *vllm_routes(live, model_card(profile, settings.engine), sleep_mode=settings.sleep_mode),
            ("/metrics", metrics_endpoint, ["GET"]),
            ("/server_info", vllm_server_info, ["GET"]),
        ]

    def sglang_surface() -> list[Route]:
        routes: list[Route] = []
        if settings.speculation_gate:
            num_steps, kwargs = gate_args()
            gate = StandInGate(live.engine, num_steps, **kwargs)
            metrics.registry.register(
                GateMetrics(gate, {"model_name": profile.model_name, **settings.extra_metric_labels})
            )
            if settings.speculation_gate_wire == "main":
                upstream_gate.append(InternalStateGate(gate))
                routes += internal_state_routes(upstream_gate[0])
            else:
                routes += gate_routes(gate)
        return [
            *routes,
            (ACCEPTANCE_PATH, acceptance, ["GET", "POST"]),
            ("/health", health, ["GET"]),
            ("/health_generate", health, ["GET"]),
            ("/ready", health, ["GET"]),
            ("/model_info", model_info, ["GET"]),
            ("/get_model_info", model_info, ["GET"]),
            ("/server_info", server_info, ["GET"]),
            ("/get_server_info", server_info, ["GET"]),
            ("/v1/models", models, ["GET"]),
            ("/v1/models/{model:path}", model, ["GET"]),
            ("/v1/loads", loads, ["GET"]),
            ("/metrics", metrics_endpoint, ["GET"]),
            ("/flush_cache", flush_cache, ["GET", "POST"]),
            ("/pause_generation", pause_generation, ["POST"]),
            ("/continue_generation", continue_generation, ["POST"]),
            ("/release_memory_occupation", release_memory, ["GET", "POST"]),
            ("/resume_memory_occupation", resume_memory, ["GET", "POST"]),
        ]

    # Each engine's endpoints over the same live engine.
    surfaces: dict[EngineName, Callable[[], list[Route]]] = {"sglang": sglang_surface, "vllm": vllm_surface}
    for path, endpoint, methods in surfaces[settings.engine]():
        app.add_api_route(path, endpoint, methods=methods)
    return app


async def _optional_json(request: Request) -> dict:
    """Admin bodies are optional and, as in SGLang, need no content type; empty means the defaults."""
    body = await read_json(request, require_json_type=False)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


async def _tags(request: Request) -> list[str] | None:
    tags = (await _optional_json(request)).get("tags")
    if tags is not None and (not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS)):
        raise BadRequest(f"'tags' must be null or a list drawn from {list(MEMORY_TAGS)}, got {tags!r}")
    return tags


def simulation_report(settings: SimSettings, live: LiveEngine) -> dict[str, Any]:
    """What `/server_info` says of the stand-in itself, whichever engine it plays (`crossover bench` reads it to
    tell a stand-in that kept up with its schedule from one that fell behind)."""
    profile, spec = settings.profile, settings.profile.speculative
    engine = ENGINE_TITLES[settings.engine]
    return {
        "schedule": live.schedule_report(),
        "simulated": True,
        "simulator": {
            "note": f"crossover's {engine} stand-in: no model runs; timings come from the profile, text is filler",
            "profile": profile.name,
            "kind": profile.kind,
            "source": profile.source,
            "description": profile.description,
            "time_scale": settings.time_scale,
            "seed": settings.seed,
            "accept_length": spec.accept_length if spec else None,
            # Wall-clock seconds of weight loading, release and resume on this stand-in.
            "delays_s": {
                "startup": live.startup_delay_s,
                "release": live.release_delay_s,
                "resume": live.resume_delay_s,
            },
        },
    }


def server_args(settings: SimSettings) -> dict[str, Any]:
    """The resolved server arguments SGLang reports, as this simulated server would have been launched."""
    profile, spec, limits = settings.profile, settings.profile.speculative, settings.profile.limits
    return {
        "model_path": profile.model_name,
        "tokenizer_path": profile.model_name,
        "served_model_name": profile.model_name,
        "host": settings.host,
        "port": settings.port,
        "tp_size": profile.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "context_length": limits.context_length,
        "max_running_requests": limits.max_running_requests,
        "max_queued_requests": limits.max_queued_requests,
        "max_total_tokens": limits.max_total_num_tokens,
        "max_prefill_tokens": limits.max_prefill_tokens,
        "chunked_prefill_size": limits.max_prefill_tokens,
        "enable_mixed_chunk": False,
        "speculative_algorithm": spec.algorithm if spec else None,
        "speculative_num_steps": spec.num_steps if spec else None,
        "speculative_eagle_topk": spec.eagle_topk if spec else None,
        "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
        "enable_metrics": True,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "extra_metric_labels": settings.extra_metric_labels or None,
        "random_seed": settings.seed,
        "weight_version": WEIGHT_VERSION,
    }


def internal_state(live: LiveEngine, profile: Profile, gates: Sequence[InternalStateGate] = ()) -> dict[str, Any]:
    """DP group 0's internal state; with the main series' gate, its `speculative_adaptive` readback."""
    spec, engine = profile.speculative, live.engine
    gate = {"speculative_adaptive": gates[0].state()} if gates else {}
    return {
        **gate,
        "speculative_num_steps": spec.num_steps if spec else None,
        "avg_spec_accept_length": engine.avg_accept_length if spec else None,
        "last_gen_throughput": live.gen_throughput(),
        "max_running_requests": profile.limits.max_running_requests,
        "memory_released": sorted(live.released),
        "generation_paused": engine.paused,
    }


def memory_report(live: LiveEngine) -> dict[str, Any]:
    """Released tags and every release/resume call (a switch controller must never release a busy server)."""
    return {"released": sorted(live.released), **dataclasses.asdict(live.memory_stats)}


def model_card(profile: Profile, owned_by: str = "sglang") -> dict[str, Any]:
    """One entry of /v1/models, as the engine the stand-in plays writes it (`owned_by` its name)."""
    return {
        "id": profile.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": owned_by,
        "root": profile.model_name,
        "parent": None,
        "max_model_len": profile.limits.context_length,
    }


def load_report(live: LiveEngine, profile: Profile, include: set[str]) -> dict[str, Any]:
    """One DP rank's entry of /v1/loads (SGLang's GetLoadsReqOutput.to_dict)."""
    engine, limits, every = live.engine, profile.limits, "all" in include
    report: dict[str, Any] = {"dp_rank": 0, "timestamp": time.time()}
    if every or "core" in include:
        used = engine.num_used_tokens
        report.update(
            {
                "num_running_reqs": engine.num_running,
                "num_waiting_reqs": engine.num_waiting,
                "num_used_tokens": used,
                "max_total_num_tokens": limits.max_total_num_tokens,
                "token_usage": used / limits.max_total_num_tokens,
                "gen_throughput": live.gen_throughput(),
                "cache_hit_rate": 0.0,
                "utilization": engine.num_running / limits.max_running_requests,
                "max_running_requests": limits.max_running_requests,
            }
        )
    if (every or "spec" in include) and profile.speculative is not None:
        accept = engine.window_accept_length
        report["speculative"] = {
            "accept_length": accept,
            "accept_rate": (accept - 1) / profile.speculative.num_steps if accept else 0.0,
        }
    if every or "queues" in include:
        report["queues"] = {
            "waiting": engine.num_waiting,
            "grammar": 0,
            "paused": live.num_held,  # held before the engine while generation is paused
            "retracted": 0,
        }
    return report


def loads_prometheus(load: dict[str, Any]) -> str:
    """`/v1/loads?format=prometheus`: one gauge per number, nested sections prefixed (spec_, queues_)."""
    prefixes = {"speculative": "spec"}
    lines = []
    for key, value in load.items():
        if key == "dp_rank":
            continue
        items = (
            [(f"{prefixes.get(key, key)}_{k}", v) for k, v in value.items()]
            if isinstance(value, dict)
            else [(key, value)]
        )
        for name, number in items:
            if isinstance(number, int | float):
                lines += [f"# TYPE sglang_{name} gauge", f'sglang_{name}{{dp_rank="0"}} {number}']
    return "\n".join(lines) + "\n"
