"""The uvicorn server the gateway runs on: sized to its descriptors, bounded request heads, a clean shutdown.

    server = make_server(settings)      # then server.run(), or await server.serve()

Once it serves, the start-up heap is frozen and Python's cyclic collector runs less often (`GC_THRESHOLDS`).

Shutdown (SIGTERM or Ctrl-C), in order:
1. `/health` answers 503 while the gateway keeps serving for `timeouts.shutdown_delay`, so load balancers
   stop sending before connections are refused;
2. the listening sockets close and idle keep-alive connections end;
3. requests in flight get `timeouts.graceful_shutdown` to finish;
4. streams still running then end with an SSE error event and `data: [DONE]` (other requests with a 503),
   with no traceback; whatever is left after `CUT_GRACE_S` is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import os
import resource
import signal

import uvicorn
import uvicorn.config

from crossover.gateway.app import GatewayApp, create_app
from crossover.gateway.cluster import Worker
from crossover.gateway.config import Settings
from crossover.gateway.tracing import make_tracing
from crossover.gateway.wire import client_protocol

log = logging.getLogger("crossover.server")

# Descriptors beyond the requests': listening socket, logs, health checks and load scrapes, the event loop.
FD_MARGIN = 64
# How long requests cut at shutdown (or at a forced exit) get to write their last event before they are cancelled.
CUT_GRACE_S = 5.0
# How long the app's own shutdown may take after a forced exit.
LIFESPAN_FORCED_S = 5.0
POLL_S = 0.1
# Connections the kernel holds for the server before it accepts them.
BACKLOG = 4096
# Python's cyclic collector runs its youngest generation every 700 net allocations of container objects (those
# not freed at once: a request leaves some behind in cycles), every few requests here, and a full pass over the
# whole heap after every 100 of those. With the start-up heap frozen and these thresholds, non-streamed requests
# cost 3-12% less CPU each (the medians of three alternating runs at C=32 on the zero backend: 0.88, 0.89 and
# 0.97 of before); streams and C=1, no change measurable on shared cores. Re-measured with the direct lane
# (proxybench.ab --together, 4 pairs; CPU per request with Python's defaults over with these): non-streamed
# C=256 1.054 (1.018-1.084), C=32 0.921 and 1.043 in two runs, streamed C=32 1.014 (0.788-1.097). The price:
# garbage in cycles waits for a collection, up to ~100,000 objects, so nothing made per connection or request may
# be left in a cycle (client_http.py breaks a connection's when it is lost: without that, 4,000 one-connection
# requests took RSS from 54 to 79 MB; tests/gateway/wire/test_client_http.py's soak holds it flat).
GC_THRESHOLDS = (100_000, 50, 50)


def fit_descriptors(settings: Settings) -> Settings:
    """Raise the soft descriptor limit as far as the hard one allows; if `max_inflight` still does not fit
    (a stream holds two descriptors, a queued request one), lower it to what does and say so loudly, so
    clients beyond it get 429 rather than a dropped connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = settings.limits
    need = 2 * limits.max_inflight + limits.max_queued + FD_MARGIN
    if soft < need and (hard == resource.RLIM_INFINITY or hard > soft):
        wanted = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft >= need:
        return settings
    # A quarter of what is left stays free for connections that are only told no.
    inflight = max(1, (soft - FD_MARGIN) // 4)
    queued = min(limits.max_queued, inflight)
    log.warning(
        "the descriptor limit (ulimit -n %d) cannot hold max_inflight = %d streams (%d descriptors needed): "
        "serving at most %d requests in flight and %d queued; raise the limit (LimitNOFILE= in systemd, "
        "ulimit -n) to serve more",
        soft,
        limits.max_inflight,
        need,
        inflight,
        queued,
    )
    fitted = limits.model_copy(update={"max_inflight": inflight, "max_queued": queued})
    return settings.model_copy(update={"limits": fitted})


def log_config(level: str) -> dict:
    """uvicorn's logging set-up, with the gateway's own loggers (`crossover.*`) beside uvicorn's, at `level`:
    without it they would reach only Python's last-resort handler (warnings and worse, unformatted). They still
    propagate: the root logger has no handler under `crossover serve`, and a host process's may want them."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["crossover"] = {"handlers": ["default"], "level": level.upper(), "propagate": True}
    return config


def protocol_options(settings: Settings, app: GatewayApp) -> dict:
    """The uvicorn.Config options that make the client side what the gateway serves `app` with (tests run these
    too): its metrics count the requests the protocol refuses; its direct lane takes what it can."""
    return {
        "http": client_protocol(
            settings.limits.max_head_bytes,
            settings.timeouts.request_head,
            settings.timeouts.request_body,
            on_refused=app.state.metrics.refused,
            direct=app.direct,
            max_body_bytes=settings.limits.max_body_bytes,
        ),
        # A line per request costs more than the proxying itself; /metrics counts requests instead.
        "access_log": False,
        # Nothing here reads the client's address from the scope: uvicorn's X-Forwarded-For middleware would
        # only add a layer to every request.
        "proxy_headers": False,
    }


def make_server(
    settings: Settings, host: str | None = None, port: int | None = None, worker: Worker | None = None
) -> GatewayServer:
    settings = fit_descriptors(settings)
    # OpenTelemetry by its standard OTEL_* variables, each worker its own exporter (made after the fork).
    app = create_app(settings, worker=worker, tracing=make_tracing(os.environ))
    config = uvicorn.Config(
        app,
        host=host or settings.host,
        port=settings.port if port is None else port,
        loop="uvloop",
        lifespan="on",
        **protocol_options(settings, app),
        log_config=log_config(settings.log_level),
        log_level=settings.log_level,
        timeout_keep_alive=int(settings.timeouts.client_keepalive),
        timeout_graceful_shutdown=int(settings.timeouts.graceful_shutdown),
        backlog=BACKLOG,
    )
    return GatewayServer(config, app)


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: GatewayApp) -> None:
        super().__init__(config)
        self.app = app
        self.interrupted = False  # stopped by Ctrl-C (SIGINT): `crossover serve` exits 130

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # uvicorn raises the signals it handled again once it has stopped: SIGTERM then ends the process
            # as SIGTERM does, but SIGINT would only print a KeyboardInterrupt traceback.
            self.interrupted = signal.SIGINT in self._captured_signals
            self._captured_signals = [sig for sig in self._captured_signals if sig != signal.SIGINT]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # What exists once the app has started (modules, settings, the app) lives as long as the process.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)

    async def shutdown(self, sockets=None) -> None:
        state, timeouts = self.app.state, self.app.state.settings.timeouts
        state.draining = True
        if timeouts.shutdown_delay and not self.force_exit:
            log.info("shutting down: /health answers 503 for %g s before connections close", timeouts.shutdown_delay)
            await self._wait(lambda: False, timeouts.shutdown_delay)

        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()

        if not await self._wait(self._idle, timeouts.graceful_shutdown):
            live = self.app.live
            if self.force_exit:
                log.warning("forced exit: ending %d request(s) with an error now", len(live.requests))
            else:
                log.warning(
                    "graceful shutdown ran out after %g s: ending %d request(s) with an error",
                    timeouts.graceful_shutdown,
                    len(live.requests),
                )
            live.cut_all()
            # Even a forced exit lets cut requests say so (an error event and [DONE]), briefly.
            if not await self._wait(self._idle, CUT_GRACE_S, forced_too=True):
                for task in self.server_state.tasks:
                    task.cancel()
        for server in self.servers:
            await server.wait_closed()
        # Forced or not, the app's own shutdown runs (it stops its checks and closes its backend connections; a
        # lifespan left to be cancelled logs a traceback), bounded when forced.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LIFESPAN_FORCED_S if self.force_exit else None):
                await self.lifespan.shutdown()

    def _idle(self) -> bool:
        return not self.server_state.connections and not self.server_state.tasks

    async def _wait(self, done, timeout: float, forced_too: bool = False) -> bool:
        """Poll `done` for up to `timeout` s (a second Ctrl-C ends the wait, unless `forced_too`); True if it
        came true."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done():
            if (self.force_exit and not forced_too) or loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
