"""Everything one gateway instance holds at run time, built once by `create_app`: what the admin API and
the app's own endpoints read. The request path takes only the parts it uses (gateway/proxy.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from crossover.gateway.admission import Admission
from crossover.gateway.config import Settings
from crossover.gateway.failover import Failover
from crossover.gateway.health import Breaker
from crossover.gateway.metrics import Metrics
from crossover.gateway.pools import Pools
from crossover.gateway.routing import Routing

if TYPE_CHECKING:
    from crossover.gateway.in_engine import GateSync
    from crossover.gateway.switching import SwitchController


@dataclass
class GatewayState:
    settings: Settings
    pools: Pools
    routing: Routing
    metrics: Metrics
    admission: Admission
    breaker: Breaker
    failover: Failover
    started_at: float = field(default_factory=time.time)
    # Made in the app's lifespan (on the serving event loop), closed when it ends; the transport carries
    # generation requests, the client (over the same transport) health checks and the switch controller's calls.
    client: httpx.AsyncClient | None = None
    # The switch controller of a time-shared GPU set (topology = "time-shared"), else None.
    switching: SwitchController | None = None
    # The engines' speculation gate of an in-engine pool (topology = "in-engine"), else None.
    in_engine: GateSync | None = None
    # Set at SIGTERM: /health answers 503 so load balancers stop sending before connections close.
    draining: bool = False

    def snapshot(self) -> dict:
        return {
            **self.routing.state(),
            "load_signal": self.pools.load_signal,
            "inflight": self.admission.active,
            "queued": self.admission.queued,
            "models": sorted(self.pools.model_names()),
            "pools": self.pools.state(),
        }
