"""The gateway as an ASGI app: `create_app(settings)` builds one; nothing here is global.

app = create_app(settings)                                      # what `crossover serve` runs
app = create_app(settings, registry=CollectorRegistry())        # tests read metrics from `registry`
app = create_app(settings, worker=Worker(host, slot))           # one of `crossover serve --workers N`
app.state                                                       # the live GatewayState
app.live                                                        # the requests in progress
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from crossover.gateway.admin import admin_routes
from crossover.gateway.admission import Admission
from crossover.gateway.backends import HealthMonitor, Pools
from crossover.gateway.cluster import HostPools, HostRegistry, Worker
from crossover.gateway.config import Settings
from crossover.gateway.errors import EXCEPTION_HANDLERS, ModelNotFound
from crossover.gateway.metrics import Metrics
from crossover.gateway.request import (
    CHAT,
    COMPLETIONS,
    Failover,
    InlineExchange,
    Live,
    ProxyEndpoint,
    authorize_client,
    client_keys,
)
from crossover.gateway.state import GatewayState
from crossover.gateway.topology import AdaptiveController, Routing, make_topology
from crossover.gateway.tracing import Tracing
from crossover.gateway.wire import ClientLink, RequestIdMiddleware, make_client, make_transport, proxy_sender


def build_state(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    worker: Worker | None = None,
    tracing: Tracing | None = None,
) -> GatewayState:
    """Every object the gateway runs on, each built whole: nothing is wired in afterwards (the lifespan only starts
    and stops them). Nothing here touches an event loop: connections open on the serving one. A worker of several
    counts in flight on its host's table (gateway/cluster/host.py)."""
    pools = Pools.from_settings(settings) if worker is None else HostPools.from_settings(settings, worker=worker)
    routing = Routing.from_settings(settings)
    limits = settings.limits
    admission = Admission(limits.max_inflight, limits.max_queued, settings.timeouts.queue)
    metrics = Metrics(registry if registry is not None else CollectorRegistry(), pools, routing, admission)
    backend_transport = make_transport(settings, transport, on_stale=metrics.stale_connections.inc)
    client = make_client(settings, backend_transport)
    monitor = HealthMonitor(
        pools,
        client,
        settings.health,
        scrape=settings.load_signal != "local",
        on_eject=lambda backend, source: metrics.ejections.labels(backend.pool, backend.url, source).inc(),
        acceptance=settings.adaptive.enabled,  # the controller reads it whatever the load signal
    )
    breaker = monitor.breaker
    failover = Failover(pools, breaker, metrics, limits.max_failovers, proxy_sender(backend_transport))
    topology = make_topology(settings, pools, routing, metrics, breaker, admission, client, worker, tracing)
    adaptive = AdaptiveController(settings.adaptive, pools, routing, metrics, topology)
    return GatewayState(
        settings,
        pools,
        routing,
        metrics,
        admission,
        breaker,
        failover,
        monitor,
        client,
        topology,
        adaptive,
        worker=worker,
    )


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: CollectorRegistry | None = None,
    worker: Worker | None = None,
    tracing: Tracing | None = None,
) -> GatewayApp:
    """The gateway app; its lifespan runs the backend client, the health checks and the topology (and a worker's
    publishing of its metrics to the others). `tracing` (gateway/tracing.py's `make_tracing`): OpenTelemetry spans,
    flushed when the lifespan ends; None: off, and no request pays for it."""
    state = build_state(settings, registry, transport, worker, tracing)
    exposed = state.metrics.registry if worker is None else HostRegistry(state.metrics.registry, worker)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with state.client:
            # One round before serving, so /health and routing start from what the backends really say.
            await state.monitor.check_all()
            tasks = [asyncio.create_task(state.monitor.run())]
            try:
                await state.topology.start()  # what it raises refuses to serve (in-engine: NotPatched)
                await state.adaptive.start()
                if worker is not None:
                    tasks.append(asyncio.create_task(worker.publish_every(state.metrics.registry, state.admission)))
                    worker.serving()
                yield
            finally:
                await state.adaptive.stop()
                await state.topology.stop()
                state.monitor.stop()
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                if tracing is not None:
                    await asyncio.to_thread(tracing.close)  # the last spans exported, off the loop

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "crossover"}

    keys = client_keys(settings.api_keys)

    async def list_models(request: Request) -> JSONResponse:
        authorize_client(request.scope["headers"], keys)
        return JSONResponse(
            {"object": "list", "data": [model_card(name) for name in sorted(state.pools.model_names())]}
        )

    async def get_model(request: Request) -> JSONResponse:
        authorize_client(request.scope["headers"], keys)
        name = request.path_params["model"]
        if name not in state.pools.model_names():
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return JSONResponse(model_card(name))

    async def health(request: Request) -> JSONResponse:
        backends = state.pools.all()
        healthy = sum(1 for backend in backends if backend.healthy)
        # Usable: healthy and in rotation (in-engine: not held out for its gate) - what a request can reach.
        usable = sum(1 for backend in backends if backend.healthy and backend.usable)
        status = "draining" if state.draining else "ok" if usable else "unavailable"
        body = {"status": status, "usable_backends": usable, "healthy_backends": healthy}
        if worker is not None:
            body["worker"] = worker.slot
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        if worker is not None:
            await worker.gather()  # the other workers' numbers as of now
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    live = Live()
    proxies = {
        path: ProxyEndpoint(
            path,
            settings,
            state.pools,
            state.admission,
            state.failover,
            state.metrics,
            live,
            state.topology,
            tracing,
        )
        for path in (CHAT, COMPLETIONS)
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in proxies.items()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(state),
    ]
    rest = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    # A path with a slash too many is not found, as at OpenAI: Starlette's redirect would name a URL built
    # from the client's own Host header.
    rest.router.redirect_slashes = False
    return GatewayApp(state, proxies, live, rest)


class GatewayApp:
    """The ASGI entry point. Generation requests go straight to the proxy; the rest through Starlette.

    The proxy sends its own responses and errors, so it skips Starlette's middleware, which would wrap
    `send` for every chunk of every stream.
    """

    def __init__(self, state: GatewayState, proxies: dict[str, ProxyEndpoint], live: Live, rest: Starlette) -> None:
        self.state = state
        self.proxies = proxies
        self.live = live
        self.rest = RequestIdMiddleware(rest)

    def direct(self, scope, body: bytes, link: ClientLink) -> bool:
        """Our server offers each small POST once its body is in: a generation request the direct lane can
        serve now is taken (gateway/request/inline.py)."""
        endpoint = self.proxies.get(scope["path"])
        return endpoint is not None and InlineExchange.offer(endpoint, scope, body, link)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.proxies.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.rest(scope, receive, send)
