"""The uvicorn server the gateway runs on, configured for proxying many long streams."""

from __future__ import annotations

import uvicorn

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings


def make_server(settings: Settings, host: str | None = None, port: int | None = None) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        host=host or settings.host,
        port=settings.port if port is None else port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        # A line per request costs more than the proxying itself; /metrics counts requests instead.
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=int(settings.timeouts.client_keepalive),
        # Without a bound, one long stream would hold a SIGTERM'd gateway open until it ends.
        timeout_graceful_shutdown=int(settings.timeouts.graceful_shutdown),
        backlog=4096,
    )
    return uvicorn.Server(config)
